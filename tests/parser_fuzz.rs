//! Property-based tests (proptest) of every parser of outside input except GGUF (tests/gguf_fuzz.rs):
//! config.json and generation_config.json, the profile JSON, safetensors files and their index,
//! tokenizer.json, and the command line's number lists. Inputs are mutations of valid files (bit
//! flips, truncations, deletions, insertions of JSON tokens, splices of the input onto itself)
//! and structure-aware JSON mutations (a value replaced by a huge, negative, fractional,
//! mistyped or deeply nested one; a field removed), plus generated strings for the lists.
//!
//! The property: an error or a value, never a panic (proptest fails the case and shrinks it), an
//! abort (the test process dies) or a hang: each input has a time bound, and no input may ask the
//! allocator for more than [`ALLOC_LIMIT`] at once. A value is used further (shapes, plans,
//! tensor loads, an encode) so that a parse that "succeeds" into nonsense is caught too.
//!
//! The runs are deterministic (a fixed RNG), so CI sees the same inputs each time. Case counts,
//! chosen for about 2-6 s of CPU each in a debug build (measured on the 2-core machine): config.json
//! 1000 mutations and 100 generated configs (a config that validates is built into the engine's
//! description, ~50 ms each), profile 600, safetensors 1000, safetensors index 800, tokenizer.json
//! 400, number lists 600 strings (each through five flags and three list validators).
//! `FDPP_FUZZ_SCALE=10` multiplies them for a longer local run.
//!
//! Found so far: a tokenizer.json whose decoder section is malformed made the `tokenizers` crate
//! panic while loading (now an error naming the file, `model::tokenizer::guarded`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fdpp::backend::BackendKind;
use fdpp::dtype::DType;
use fdpp::model::weights::{TensorSource, WeightStore};
use fdpp::model::{hf, ModelShapes};
use fdpp::profile::Profile;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{json, Value};

/// The largest single allocation seen (the counting allocator below).
struct Counting;
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LARGEST.fetch_max(n, Ordering::Relaxed);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static A: Counting = Counting;

/// No input of a few kilobytes may make a parser ask for more at once (tests run in parallel,
/// so this bounds what any of them asked for).
const ALLOC_LIMIT: usize = 256 << 20;

/// Per input, in a debug build on a loaded 2-core machine (a typical input takes well under
/// 10 ms; a hang or a quadratic blow-up takes far longer).
const TIME_LIMIT: Duration = Duration::from_secs(3);

fn here() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Cases of each suite (see the module docs).
fn cases(base: u32) -> u32 {
    let scale: f64 = std::env::var("FDPP_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|s: &f64| *s > 0.0)
        .unwrap_or(1.0);
    ((base as f64 * scale) as u32).max(1)
}

fn runner(n: u32) -> TestRunner {
    let config = Config {
        cases: cases(n),
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
}

/// Run `f` on one input: it must return within [`TIME_LIMIT`] (a panic fails the case).
fn bounded<T>(what: &str, input: &[u8], f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    assert!(
        took < TIME_LIMIT,
        "{what}: one input took {took:?}: {:?}",
        String::from_utf8_lossy(&input[..input.len().min(300)])
    );
    let big = LARGEST.load(Ordering::Relaxed);
    assert!(big <= ALLOC_LIMIT, "{what}: an allocation of {big} bytes");
    r
}

// ---- mutations ----------------------------------------------------------------------------

/// Tokens that JSON parsers and the code after them find hard: numbers past every integer type,
/// negative and fractional where counts go, unpaired surrogates, deep nesting, stray structure.
const TOKENS: &[&str] = &[
    "18446744073709551616",
    "18446744073709551615",
    "9223372036854775808",
    "4294967296",
    "-1",
    "-0",
    "0",
    "1e308",
    "-1e308",
    "1e999",
    "0.5",
    "1.0e2",
    "null",
    "true",
    "\"\"",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "\"",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    "\u{feff}",
    "\u{0}",
];

#[derive(Clone, Debug)]
enum ByteMut {
    Flip {
        at: usize,
        bit: u8,
    },
    Truncate {
        at: usize,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Token {
        at: usize,
        tok: usize,
    },
    Bytes {
        at: usize,
        bytes: Vec<u8>,
    },
    /// Copy `len` bytes from `from` over `at` (a splice of the input onto itself).
    Splice {
        at: usize,
        from: usize,
        len: usize,
    },
}

fn byte_mut() -> impl Strategy<Value = ByteMut> {
    prop_oneof![
        3 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| ByteMut::Flip { at, bit }),
        1 => any::<usize>().prop_map(|at| ByteMut::Truncate { at }),
        1 => (any::<usize>(), 1usize..64).prop_map(|(at, len)| ByteMut::Delete { at, len }),
        3 => (any::<usize>(), 0..TOKENS.len()).prop_map(|(at, tok)| ByteMut::Token { at, tok }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| ByteMut::Bytes { at, bytes }),
        1 => (any::<usize>(), any::<usize>(), 1usize..256).prop_map(|(at, from, len)| ByteMut::Splice { at, from, len }),
    ]
}

fn apply_bytes(base: &[u8], muts: &[ByteMut]) -> Vec<u8> {
    let mut b = base.to_vec();
    for m in muts {
        let n = b.len();
        let pos = |at: usize| if n == 0 { 0 } else { at % (n + 1) };
        match m {
            ByteMut::Flip { at, bit } => {
                if n > 0 {
                    b[at % n] ^= 1 << bit;
                }
            }
            ByteMut::Truncate { at } => b.truncate(pos(*at)),
            ByteMut::Delete { at, len } => {
                let s = pos(*at);
                let e = (s + len).min(n);
                b.drain(s..e);
            }
            ByteMut::Token { at, tok } => {
                let s = pos(*at);
                b.splice(s..s, TOKENS[*tok].bytes());
            }
            ByteMut::Bytes { at, bytes } => {
                let s = pos(*at);
                b.splice(s..s, bytes.iter().copied());
            }
            ByteMut::Splice { at, from, len } => {
                if n > 0 {
                    let f = from % n;
                    let piece: Vec<u8> = b[f..(f + len).min(n)].to_vec();
                    let s = pos(*at);
                    let e = (s + piece.len()).min(n);
                    b.splice(s..e, piece);
                }
            }
        }
    }
    b
}

/// Values that replace a node of a JSON document.
fn replacement(i: usize) -> Value {
    let deep = (0..200).fold(json!(1), |v, _| json!([v]));
    let candidates = [
        json!(u64::MAX),
        json!(i64::MIN),
        json!(-1),
        json!(0),
        json!(1),
        json!(2),
        json!(3),
        json!(1u64 << 31),
        json!(1u64 << 32),
        json!(1u64 << 40),
        json!(1u64 << 53),
        json!(0.5),
        json!(-0.0),
        json!(1e308),
        json!(f64::MIN_POSITIVE),
        json!("x"),
        json!(""),
        json!("llama"),
        json!(["LlamaForCausalLM"]),
        json!(null),
        json!(true),
        json!([]),
        json!({}),
        json!([1, 2, 3]),
        json!({"type": "llama3", "factor": 0.0}),
        deep,
    ];
    candidates[i % candidates.len()].clone()
}

#[derive(Clone, Debug)]
enum JsonMut {
    /// Replace the node at (pre-order index mod node count) by [`replacement`].
    Replace { node: usize, with: usize },
    /// Remove the node (a field of an object, an element of an array).
    Remove { node: usize },
    /// Add a field to the node if it is an object.
    Add { node: usize, key: usize, with: usize },
}

fn json_mut() -> impl Strategy<Value = JsonMut> {
    prop_oneof![
        4 => (any::<usize>(), any::<usize>()).prop_map(|(node, with)| JsonMut::Replace { node, with }),
        2 => any::<usize>().prop_map(|node| JsonMut::Remove { node }),
        1 => (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(node, key, with)| JsonMut::Add { node, key, with }),
    ]
}

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Object(o) => o.values().map(count).sum(),
        _ => 0,
    }
}

/// The pre-order `i`-th node's parent container and the child's key or index.
fn mutate_at(v: &mut Value, i: &mut usize, m: &JsonMut) -> bool {
    let keys = [
        "hidden_size",
        "vocab_size",
        "num_hidden_layers",
        "schema_version",
        "weight_map",
        "x",
    ];
    if *i == 0 {
        match m {
            JsonMut::Replace { with, .. } => *v = replacement(*with),
            JsonMut::Add { key, with, .. } => {
                if let Value::Object(o) = v {
                    o.insert(keys[key % keys.len()].into(), replacement(*with));
                }
            }
            JsonMut::Remove { .. } => {}
        }
        return true;
    }
    *i -= 1;
    match v {
        Value::Array(a) => {
            for k in 0..a.len() {
                if *i == 0 && matches!(m, JsonMut::Remove { .. }) {
                    a.remove(k);
                    return true;
                }
                if mutate_at(&mut a[k], i, m) {
                    return true;
                }
            }
        }
        Value::Object(o) => {
            let ks: Vec<String> = o.keys().cloned().collect();
            for k in ks {
                if *i == 0 && matches!(m, JsonMut::Remove { .. }) {
                    o.remove(&k);
                    return true;
                }
                if let Some(c) = o.get_mut(&k) {
                    if mutate_at(c, i, m) {
                        return true;
                    }
                }
            }
        }
        _ => {}
    }
    false
}

fn apply_json(base: &Value, muts: &[JsonMut]) -> Vec<u8> {
    let mut v = base.clone();
    for m in muts {
        let n = count(&v);
        let node = match m {
            JsonMut::Replace { node, .. } | JsonMut::Remove { node } | JsonMut::Add { node, .. } => *node,
        };
        let mut i = node % n;
        mutate_at(&mut v, &mut i, m);
    }
    serde_json::to_vec(&v).unwrap_or_default()
}

/// A mutated input: of seed `seed`, structure-aware or byte-level.
#[derive(Clone, Debug)]
enum Input {
    Json(usize, Vec<JsonMut>),
    Bytes(usize, Vec<ByteMut>),
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        (any::<usize>(), prop::collection::vec(json_mut(), 1..4)).prop_map(|(s, m)| Input::Json(s, m)),
        (any::<usize>(), prop::collection::vec(byte_mut(), 1..6)).prop_map(|(s, m)| Input::Bytes(s, m)),
    ]
}

fn realise(seeds: &[(Value, Vec<u8>)], inp: &Input) -> Vec<u8> {
    match inp {
        Input::Json(s, m) => apply_json(&seeds[s % seeds.len()].0, m),
        Input::Bytes(s, m) => apply_bytes(&seeds[s % seeds.len()].1, m),
    }
}

fn json_seeds(paths: &[PathBuf]) -> Vec<(Value, Vec<u8>)> {
    paths
        .iter()
        .map(|p| {
            let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (v, bytes)
        })
        .collect()
}

fn fixtures(file: &str) -> Vec<PathBuf> {
    let dir = here().join("tests/fixtures/hf");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("fixtures")
        .filter_map(|e| e.ok().map(|e| e.path().join(file)))
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    assert!(v.len() >= 5, "the HF fixtures' {file}: {v:?}");
    v
}

// ---- config.json and generation_config.json -------------------------------------------------

fn check_config(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    let path = Path::new("fuzz/config.json");
    if let Ok(cfg) = hf::parse(&text, path, "fuzz".into()) {
        // A config that parses is used as the commands use it.
        if cfg.validate().is_ok() {
            let s = ModelShapes::of(&cfg);
            assert_eq!(s.linears.len(), 4);
            let _ = fdpp::model::spec::weights_bytes(&cfg, DType::F16);
            let _ = fdpp::engine::memory::kv_bytes_per_token(&cfg, DType::F16);
            if let Ok(extras) = hf::parse_extras(&text, path) {
                let _ = fdpp::model::spec::check_arch(&cfg, &extras);
            }
        }
    }
    let _ = hf::parse_extras(&text, path);
    let _ = hf::parse_generation_eos(&text, Path::new("fuzz/generation_config.json"));
}

#[test]
fn config_json_mutations_give_a_value_or_an_error() {
    let mut seeds = json_seeds(&fixtures("config.json"));
    seeds.extend(json_seeds(&fixtures("generation_config.json")));
    runner(1000)
        .run(&input(), |inp| {
            let bytes = realise(&seeds, &inp);
            bounded("config.json", &bytes, || check_config(&bytes));
            Ok(())
        })
        .unwrap();
}

/// Fully generated JSON objects with the config's field names and arbitrary values.
#[test]
fn generated_configs_give_a_value_or_an_error() {
    let keys = prop::sample::select(vec![
        "architectures",
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "sliding_window",
        "eos_token_id",
        "hidden_act",
        "multi_query_attention",
        "ffn_dim",
        "num_layers",
        "partial_rotary_factor",
    ]);
    let entries = prop::collection::vec((keys, any::<usize>()), 0..20);
    runner(100)
        .run(&entries, |fields| {
            let mut o = serde_json::Map::new();
            o.insert("architectures".into(), json!(["LlamaForCausalLM"]));
            for (k, w) in fields {
                o.insert(k.to_string(), replacement(w));
            }
            let bytes = serde_json::to_vec(&Value::Object(o)).unwrap_or_default();
            bounded("generated config.json", &bytes, || check_config(&bytes));
            Ok(())
        })
        .unwrap();
}

// ---- the profile JSON -----------------------------------------------------------------------

/// A shipped profile cut to a few M per shape (the whole file is 0.5 MB: too slow per input in
/// a debug build), still a valid profile.
fn small_profile() -> (Value, Vec<u8>) {
    let path = here().join("profiles/nvidia-h100-80gb-hbm3/llama-gqa.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).expect("profile")).expect("json");
    if let Some(shapes) = v.get_mut("shapes").and_then(Value::as_array_mut) {
        shapes.truncate(2);
        for s in shapes {
            for key in ["m_grid", "best"] {
                if let Some(a) = s.get_mut(key).and_then(Value::as_array_mut) {
                    a.truncate(3);
                }
            }
            if let Some(cands) = s.get_mut("candidates").and_then(Value::as_array_mut) {
                cands.truncate(3);
                for c in cands {
                    if let Some(r) = c.get_mut("results").and_then(Value::as_array_mut) {
                        r.truncate(3);
                    }
                }
            }
        }
    }
    let text = serde_json::to_vec(&v).expect("json");
    Profile::from_json(std::str::from_utf8(&text).expect("utf-8")).expect("the cut profile still loads");
    (v, text)
}

fn check_profile(bytes: &[u8], file: &Path) {
    let parsed = match std::str::from_utf8(bytes) {
        Ok(text) => Profile::from_json(text).ok(),
        // Binary: through the file loader, which must say so.
        Err(_) => {
            std::fs::write(file, bytes).expect("write");
            let e = Profile::load(file).expect_err("bytes that are not UTF-8 are no profile");
            assert!(e.to_string().contains("not UTF-8"), "{e}");
            None
        }
    };
    if let Some(p) = parsed {
        // A profile that parses is used as generate and `profile show` use it.
        for sp in &p.shapes {
            for m in [0, 1, 7, 16, 1 << 20, usize::MAX] {
                let plan = fdpp::select::select_in(sp, m);
                let _ = plan.spec(p.dtype);
            }
            let _ = sp.label();
        }
        for shape in &p.model.shapes {
            let _ = fdpp::select::select(shape, 3, Some(&p));
        }
        let cpu = fdpp::backend::cpu::CpuBackend::new();
        let _ = fdpp::profile::classify_mismatches(&p.provenance, fdpp::backend::Backend::info(&cpu), "x");
        let _ = p.check_model(&p.model.config);
        let _ = p.to_json();
    }
}

#[test]
fn profile_mutations_give_a_value_or_an_error() {
    let seeds = vec![small_profile()];
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("p.json");
    runner(600)
        .run(&input(), |inp| {
            let bytes = realise(&seeds, &inp);
            bounded("profile", &bytes, || check_profile(&bytes, &file));
            Ok(())
        })
        .unwrap();
}

// ---- safetensors files and the index --------------------------------------------------------

/// A small valid safetensors file: three tensors of f16, bf16 and f32.
fn small_safetensors() -> Vec<u8> {
    safetensors_named(["a", "b", "c"])
}

fn safetensors_named(names: [&str; 3]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    header.insert(
        names[0].into(),
        json!({"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 12]}),
    );
    header.insert(
        names[1].into(),
        json!({"dtype": "BF16", "shape": [4], "data_offsets": [12, 20]}),
    );
    header.insert(
        names[2].into(),
        json!({"dtype": "F32", "shape": [1, 2], "data_offsets": [20, 28]}),
    );
    let header = Value::Object(header);
    let mut h = serde_json::to_vec(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend((0..28u8).map(|i| i.wrapping_mul(37)));
    out
}

/// Byte mutations that mostly hit the header (its length prefix and JSON), where the decisions
/// are, with the header's JSON also mutated structurally.
#[derive(Clone, Debug)]
enum StMut {
    Header(Vec<JsonMut>),
    Bytes(Vec<ByteMut>),
    /// Overwrite the 8-byte length prefix.
    Len(u64),
}

fn st_mut() -> impl Strategy<Value = StMut> {
    prop_oneof![
        3 => prop::collection::vec(json_mut(), 1..4).prop_map(StMut::Header),
        3 => prop::collection::vec(byte_mut(), 1..5).prop_map(StMut::Bytes),
        1 => prop_oneof![Just(0u64), Just(1), Just(7), Just(u64::MAX), Just(1 << 40), any::<u64>(), 0u64..400].prop_map(StMut::Len),
    ]
}

fn apply_st(base: &[u8], m: &StMut) -> Vec<u8> {
    match m {
        StMut::Bytes(b) => apply_bytes(base, b),
        StMut::Len(n) => {
            let mut b = base.to_vec();
            b[..8].copy_from_slice(&n.to_le_bytes());
            b
        }
        StMut::Header(j) => {
            let n = u64::from_le_bytes(base[..8].try_into().expect("8 bytes")) as usize;
            let header: Value = serde_json::from_slice(&base[8..8 + n]).expect("header");
            let new = apply_json(&header, j);
            let mut out = (new.len() as u64).to_le_bytes().to_vec();
            out.extend(new);
            out.extend(&base[8 + n..]);
            out
        }
    }
}

fn check_store(dir: &Path) {
    if let Ok(store) = WeightStore::open(dir) {
        for name in store.names() {
            let Ok(shape) = store.shape(name).map(<[usize]>::to_vec) else {
                continue;
            };
            let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            // The loader allocates the tensor it is asked for; ask only for what the file holds.
            if elems.is_some_and(|e| e <= 1 << 16) {
                for dt in [DType::F16, DType::Bf16] {
                    let _ = TensorSource::load(&store, name, &shape, dt);
                }
            }
            let _ = TensorSource::load(&store, name, &[1, 2, 3], DType::F16);
        }
        let _ = TensorSource::describe(&store);
    }
}

#[test]
fn safetensors_mutations_give_a_value_or_an_error() {
    let base = small_safetensors();
    let dir = tempfile::tempdir().expect("tmp");
    // The seed itself loads, each tensor with its values.
    std::fs::write(dir.path().join("model.safetensors"), &base).expect("write");
    let store = WeightStore::open(dir.path()).expect("the seed is valid");
    assert_eq!(store.names(), vec!["a", "b", "c"]);
    runner(1000)
        .run(&st_mut(), |m| {
            let bytes = apply_st(&base, &m);
            std::fs::write(dir.path().join("model.safetensors"), &bytes).expect("write");
            bounded("safetensors", &bytes, || check_store(dir.path()));
            Ok(())
        })
        .unwrap();
}

#[test]
fn safetensors_index_mutations_give_a_value_or_an_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let shard = small_safetensors();
    std::fs::write(dir.path().join("model-00001-of-00002.safetensors"), &shard).expect("write");
    // A second shard with other names.
    let other = safetensors_named(["d", "e", "f"]);
    std::fs::write(dir.path().join("model-00002-of-00002.safetensors"), other).expect("write");
    let index = json!({
        "metadata": {"total_size": 56},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors",
            "d": "model-00002-of-00002.safetensors",
            "e": "model-00002-of-00002.safetensors",
            "f": "model-00002-of-00002.safetensors",
        }
    });
    let seeds = vec![(index.clone(), serde_json::to_vec_pretty(&index).expect("json"))];
    let path = dir.path().join("model.safetensors.index.json");
    std::fs::write(&path, &seeds[0].1).expect("write");
    assert_eq!(
        WeightStore::open(dir.path()).expect("the seed is valid").names().len(),
        6
    );
    runner(800)
        .run(&input(), |inp| {
            let bytes = realise(&seeds, &inp);
            std::fs::write(&path, &bytes).expect("write");
            bounded("safetensors index", &bytes, || check_store(dir.path()));
            Ok(())
        })
        .unwrap();
}

/// An index may name only files beside it: no absolute paths, no `..`.
#[test]
fn an_index_naming_files_outside_its_directory_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("model.safetensors"), small_safetensors()).expect("write");
    for bad in ["/etc/passwd", "../model.safetensors", "sub/../../x.safetensors"] {
        let index = json!({"weight_map": {"a": bad}});
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).expect("write");
        let e = WeightStore::open(dir.path()).err().expect("refused").to_string();
        assert!(e.contains(bad) && e.contains("file name"), "{bad}: {e}");
    }
}

// ---- tokenizer.json -------------------------------------------------------------------------

#[test]
fn tokenizer_mutations_give_a_value_or_an_error() {
    let seeds = json_seeds(&fixtures("tokenizer.json")[..1]);
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("tokenizer.json");
    runner(400)
        .run(&input(), |inp| {
            let bytes = realise(&seeds, &inp);
            std::fs::write(&path, &bytes).expect("write");
            bounded("tokenizer.json", &bytes, || {
                if let Ok(t) = fdpp::model::spec::ModelSpec::load_tokenizer(&path) {
                    if let Ok(ids) = t.encode("Hello, world! 12 ü") {
                        let _ = t.decode(&ids);
                    }
                    let _ = t.decode(&[0, 1, 2, u32::MAX]);
                    let _ = t.vocab_size();
                }
            });
            Ok(())
        })
        .unwrap();
}

// ---- the command line's number lists --------------------------------------------------------

/// Strings made of what lists are made of: digits, commas, signs, spaces, huge numbers.
fn list_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => (0u64..100_000).prop_map(|n| n.to_string()),
        1 => Just("18446744073709551616".to_string()),
        1 => Just("-1".to_string()),
        1 => Just("".to_string()),
        1 => Just(" ".to_string()),
        1 => Just("1e3".to_string()),
        1 => Just("0x10".to_string()),
        1 => Just("+5".to_string()),
        1 => Just("٣".to_string()),
        1 => "[ -~]{0,4}",
    ];
    prop::collection::vec(piece, 0..12).prop_map(|v| v.join(","))
}

fn parse_cli(args: &[&str]) -> Option<fdpp::cli::Cli> {
    use clap::Parser;
    fdpp::cli::Cli::try_parse_from(args).ok()
}

#[test]
fn number_lists_give_a_value_or_an_error() {
    use fdpp::cli::{bench, bench_attention, bench_e2e, generate};
    runner(600)
        .run(&list_text(), |s| {
            bounded("number list", s.as_bytes(), || {
                // --token-ids: every id a u32, no empty entry.
                if let Ok(ids) = generate::parse_ids(&s) {
                    assert!(!ids.is_empty());
                    assert!(!s.split(',').any(|t| t.trim().is_empty()), "{s:?} gave {ids:?}");
                }
                // The lists clap splits at commas, then validates.
                for (sub, flag) in [
                    (&["bench", "gemm"][..], "--m"),
                    (&["bench", "attention"][..], "--batch"),
                    (&["bench", "attention"][..], "--kv-len"),
                    (&["bench", "e2e"][..], "--batch"),
                    (&["bench", "e2e"][..], "--prompt-len"),
                ] {
                    let mut args = vec!["fdpp"];
                    args.extend(sub);
                    args.extend(["--model", "llama2-7b", flag, s.as_str()]);
                    let Some(cli) = parse_cli(&args) else { continue };
                    let fdpp::cli::Command::Bench(b) = cli.command else {
                        panic!("{args:?} parsed as another command")
                    };
                    match b.what {
                        bench::BenchCommand::Gemm(g) => {
                            if let Ok(ms) = bench::m_list(&g.m, BackendKind::Cpu) {
                                assert!(ms.windows(2).all(|w| w[0] < w[1]) && ms[0] >= 1, "{ms:?}");
                            }
                        }
                        bench::BenchCommand::Attention(a) => {
                            for l in [&a.batch, &a.kv_len] {
                                if let Ok(Some(v)) = bench_attention::positive_list(flag, "value", l) {
                                    assert!(v.iter().all(|&x| x >= 1));
                                }
                            }
                        }
                        bench::BenchCommand::E2e(e) => {
                            for l in [&e.batch, &e.prompt_len] {
                                if let Ok(v) = bench_e2e::list(flag, l, &[1]) {
                                    assert!(v.iter().all(|&x| x >= 1));
                                }
                            }
                        }
                    }
                }
                // --range a,b of the async softmax.
                let _ = bench_attention::parse_scheme(None, Some(&s));
            });
            Ok(())
        })
        .unwrap();
}
