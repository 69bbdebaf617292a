//! GGUF without any download: files written by a small writer (tests/gguf_common) with every
//! value type and every quantization type fdpp reads, read back; the tiny model's config, HF
//! names, shapes and Q/K order; the tokenizers; and every kind of bad file.

mod gguf_common;

use fdpp::backend::cpu::CpuBackend;
use fdpp::dtype::DType;
use fdpp::model::arch::Arch;
use fdpp::model::config::ModelArch;
use fdpp::model::family;
use fdpp::model::gguf::{self, GgufFile, MetaValue};
use fdpp::model::weights::TensorSource;
use gguf_common::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn err_of<T>(r: fdpp::error::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// Every quantization type: the raw blocks of tests/fixtures/gguf/quant_blocks.json (random
/// bytes with finite scales, made by scripts/gguf_reference.py) dequantize bit for bit to the
/// values gguf-py 0.19.0 computed from them; and to f16/bf16 as those values rounded.
#[test]
fn every_quant_type_matches_gguf_py() {
    let text = std::fs::read_to_string("tests/fixtures/gguf/quant_blocks.json").unwrap();
    let fx: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (rows, cols) = (fx["rows"].as_u64().unwrap(), fx["cols"].as_u64().unwrap());
    let mut w = Writer::new();
    let mut expect = Vec::new();
    for t in fx["types"].as_array().unwrap() {
        let name = t["type"].as_str().unwrap();
        w.tensor(
            name,
            &[cols, rows],
            t["id"].as_u64().unwrap() as u32,
            hex(t["hex"].as_str().unwrap()),
        );
        let vals: Vec<f32> = t["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        expect.push((name.to_string(), vals));
    }
    assert_eq!(
        expect.len(),
        11,
        "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"
    );
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(&w.write(dir.path(), "q.gguf")).unwrap();
    for (name, vals) in &expect {
        let got = f.dequantize_f32(name).unwrap();
        assert_eq!(got.len(), vals.len());
        let bad = got.iter().zip(vals).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(bad, 0, "{name}: {bad} of {} values differ from gguf-py", vals.len());
        for dt in [DType::F16, DType::Bf16] {
            let h = f.dequantize_rows(name, dt, &|r| r).unwrap();
            for (x, v) in h.iter().zip(vals) {
                assert_eq!(*x, dt.from_f32(*v), "{name} as {dt}");
            }
        }
    }
}

#[test]
fn metadata_of_every_value_type_round_trips() {
    let nested = MetaValue::Array(vec![
        MetaValue::Array(vec![MetaValue::I16(-3), MetaValue::I16(7)]),
        MetaValue::Array(vec![]),
    ]);
    let kv = vec![
        ("a.u8", MetaValue::U8(200)),
        ("a.i8", MetaValue::I8(-100)),
        ("a.u16", MetaValue::U16(60000)),
        ("a.i16", MetaValue::I16(-30000)),
        ("a.u32", MetaValue::U32(4_000_000_000)),
        ("a.i32", MetaValue::I32(-2_000_000_000)),
        ("a.f32", MetaValue::F32(1.5e-5)),
        ("a.bool", MetaValue::Bool(true)),
        ("a.str", s("héllo ✓")),
        ("a.u64", MetaValue::U64(u64::MAX)),
        ("a.i64", MetaValue::I64(i64::MIN)),
        ("a.f64", MetaValue::F64(-2.25)),
        ("a.strs", strs(&["x", "", "yz"])),
        ("a.nested", nested),
        ("general.alignment", MetaValue::U32(64)),
    ];
    for version in [2, 3] {
        let mut w = Writer::new();
        w.version = version;
        w.alignment = 64;
        for (k, v) in &kv {
            w.kv(k, v.clone());
        }
        w.f32_tensor("t", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let dir = tempfile::tempdir().unwrap();
        let f = GgufFile::open(&w.write(dir.path(), "m.gguf")).unwrap();
        assert_eq!(f.header().version, version);
        assert_eq!(f.header().alignment, 64);
        assert_eq!(f.header().data_offset % 64, 0);
        for (k, v) in &kv {
            assert_eq!(f.get(k), Some(v), "{k}");
        }
        assert_eq!(f.dequantize_f32("t").unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(f.tensor("t").unwrap().hf_shape(), vec![2, 3]);
    }
}

#[test]
fn tiny_llama_config_names_shapes_and_qk_order() {
    let (w, expect) = tiny_model("llama");
    let dir = tempfile::tempdir().unwrap();
    let m = gguf::open(&w.write(dir.path(), "tiny-llama.gguf")).unwrap();
    let c = &m.cfg;
    assert_eq!(c.arch, ModelArch::Llama);
    assert_eq!(c.name, "tiny-llama");
    assert_eq!(
        (
            c.hidden_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size
        ),
        (HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN)
    );
    assert_eq!(c.vocab_size, gpt2_vocab().0.len());
    assert_eq!(c.max_position_embeddings, 256);
    assert_eq!(c.rope_theta, 50000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(c.tie_word_embeddings, "no output.weight: tied");
    assert!(!c.qkv_bias);
    assert_eq!(m.extras.bos_token_id, Some(1));
    assert_eq!(m.extras.eos_token_ids, vec![0]);
    assert_eq!(m.chat_template.as_deref(), Some("{{ messages }}"));

    let names = m.store.names();
    assert_eq!(names.len(), expect.len());
    for (name, shape, vals) in &expect {
        assert!(names.contains(name), "{name}");
        assert_eq!(&m.store.shape(name).unwrap(), shape, "{name}");
        // f32 → f16 then back: within half an f16 ulp of the HF-layout value. Q and K come back
        // in HF's order although the file holds them interleaved.
        let got = m.store.load(name, shape, DType::F16).unwrap();
        for (i, (g, v)) in got.iter().zip(vals).enumerate() {
            let g = DType::F16.to_f32(*g);
            assert!((g - v).abs() <= 1e-3, "{name}[{i}]: {g} vs {v}");
        }
    }
    // The engine's family map finds every tensor it needs and loads them onto the CPU backend.
    let arch = Arch::of(&m.cfg, &m.extras).unwrap();
    family::check(&m.store, &arch).unwrap();
    family::load(&CpuBackend::new(), &m.store, &arch, DType::F16).unwrap();
    // A wrong shape asked for is an error naming both.
    let e = err_of(
        m.store
            .load("model.layers.0.self_attn.q_proj.weight", &[HIDDEN, 3], DType::F16),
    );
    assert!(
        e.contains("q_proj") && e.contains("[64, 3]") && e.contains("[64, 64]"),
        "{e}"
    );
    let e = err_of(m.store.shape("model.layers.9.mlp.up_proj.weight"));
    assert!(
        e.contains("blk.9.ffn_up.weight") && e.contains("tiny-llama.gguf"),
        "{e}"
    );
}

#[test]
fn qwen2_is_not_permuted_and_has_biases() {
    let (w, expect) = tiny_model("qwen2");
    let dir = tempfile::tempdir().unwrap();
    let m = gguf::open(&w.write(dir.path(), "tiny-qwen.gguf")).unwrap();
    assert_eq!(m.cfg.arch, ModelArch::Qwen2);
    assert!(m.cfg.qkv_bias);
    for (name, shape, vals) in &expect {
        let got = m.store.load(name, shape, DType::Bf16).unwrap();
        for (g, v) in got.iter().zip(vals) {
            assert!((DType::Bf16.to_f32(*g) - v).abs() <= 4e-3, "{name}");
        }
    }
    assert!(m
        .store
        .names()
        .contains(&"model.layers.1.self_attn.k_proj.bias".to_string()));
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let (w, _) = tiny_model("gemma");
    let dir = tempfile::tempdir().unwrap();
    let e = err_of(gguf::open(&w.write(dir.path(), "g.gguf")));
    assert!(
        e.contains("'gemma'") && e.contains("llama, qwen2") && e.contains("g.gguf"),
        "{e}"
    );
}

#[test]
fn gpt2_tokenizer_round_trips_and_merges() {
    let (w, _) = tiny_model("llama");
    let dir = tempfile::tempdir().unwrap();
    let m = gguf::open(&w.write(dir.path(), "t.gguf")).unwrap();
    let tok = &m.tokenizer;
    let (tokens, _, _) = gpt2_vocab();
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    // add_bos_token is absent: gpt2 vocabularies add nothing.
    let ids = tok.encode(" the world").unwrap();
    assert_eq!(ids, vec![id("Ġthe"), id("Ġworld")]);
    // SmolLM's pre-tokenizer splits digits one by one.
    let ids = tok.encode("x42").unwrap();
    assert_eq!(ids, vec![id("x"), id("4"), id("2")]);
    for text in ["Hello, the world!\n  tabs\tand ünïcödé ✓ 12345", "", " "] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // A control token in the text is one special token, skipped on decode.
    let ids = tok.encode("<|im_start|>the").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids).unwrap(), "the");
}

#[test]
fn spm_tokenizer_uses_scores_and_byte_fallback() {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    // Pieces and scores: "▁the" must come from "▁t" + "he" (the better-scored path), not
    // "▁th" + "e".
    for (p, sc) in [
        ("▁", -1.0),
        ("t", -2.0),
        ("h", -2.0),
        ("e", -2.0),
        ("▁t", -3.0),
        ("he", -3.5),
        ("▁th", -9.0),
        ("▁the", -4.0),
        ("a", -2.0),
    ] {
        tokens.push(p.into());
        types.push(1);
        scores.push(sc);
    }
    let mut w = Writer::new();
    w.kv("general.architecture", s("llama"))
        .kv("tokenizer.ggml.model", s("llama"))
        .kv(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.iter().map(|t| s(t)).collect()),
        )
        .kv(
            "tokenizer.ggml.scores",
            MetaValue::Array(scores.iter().map(|&x| MetaValue::F32(x)).collect()),
        )
        .kv(
            "tokenizer.ggml.token_type",
            MetaValue::Array(types.iter().map(|&x| MetaValue::I32(x)).collect()),
        )
        .kv("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .kv("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
        .kv("tokenizer.ggml.unknown_token_id", MetaValue::U32(0));
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(&w.write(dir.path(), "spm.gguf")).unwrap();
    let tok = gguf::tokenizer::build(&f).unwrap();
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    let enc = tok.encode("the a", true).unwrap();
    // BOS (llama's default), "▁the", "▁", "a".
    assert_eq!(enc.get_ids(), &[1, id("▁the"), id("▁"), id("a")]);
    // "é" is not a piece: its two UTF-8 bytes fall back to byte tokens, and decode restores it.
    let enc = tok.encode("té", false).unwrap();
    assert_eq!(enc.get_ids(), &[id("▁t"), id("<0xC3>"), id("<0xA9>")]);
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "té");
    let enc = tok.encode("the  a", true).unwrap();
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "the  a");
}

// ---------------------------------------------------------------- bad files

fn open_bytes(b: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, b).unwrap();
    let e = err_of(GgufFile::open(&p));
    assert!(e.contains("bad.gguf"), "the error names the file: {e}");
    e
}

fn small() -> Writer {
    let mut w = Writer::new();
    w.kv("general.architecture", s("llama"))
        .kv("x.list", strs(&["a", "b", "c"]));
    w.f32_tensor("a", &[8, 2], &[0.5; 16]);
    w.tensor("b", &[64], 8, vec![0u8; 68]); // two Q8_0 blocks
    w
}

#[test]
fn bad_magic_version_and_endianness() {
    let mut b = small().bytes();
    b[..4].copy_from_slice(b"GGML");
    assert!(open_bytes(&b).contains("not a GGUF file"));
    for (v, want) in [(1u32, "version 1"), (4, "version 4"), (0x0300_0000, "big-endian")] {
        let mut b = small().bytes();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let e = open_bytes(&b);
        assert!(e.contains(want), "{v}: {e}");
    }
}

#[test]
fn every_truncation_is_an_error() {
    let full = small().bytes();
    // The padding after the last tensor's data is optional: every cut before its end must fail.
    let h = fdpp::model::gguf::file::parse_header(&full).unwrap();
    let last = h.tensors.last().unwrap();
    let end = (h.data_offset + last.offset + last.size) as usize;
    assert!(end < full.len());
    assert!(fdpp::model::gguf::file::parse_header(&full[..end]).is_ok());
    for cut in 0..end {
        let e = match fdpp::model::gguf::file::parse_header(&full[..cut]) {
            Ok(_) => panic!("a file cut at {cut} of {} parsed", full.len()),
            Err(e) => e,
        };
        assert!(e.contains("truncated") || e.contains("remain"), "cut at {cut}: {e}");
    }
    assert!(open_bytes(&full[..end - 1]).contains("truncated"));
}

#[test]
fn lengths_and_counts_past_the_file() {
    let w = small();
    let b = w.bytes();
    // The metadata count (offset 16) claims a billion pairs.
    let mut x = b.clone();
    x[16..24].copy_from_slice(&1_000_000_000u64.to_le_bytes());
    assert!(open_bytes(&x).contains("metadata count"));
    // The tensor count, u64::MAX.
    let mut x = b.clone();
    x[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_bytes(&x).contains("tensor count"));
    // The first key's length.
    let mut x = b.clone();
    x[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(open_bytes(&x).contains("length of metadata key"));
    // The string array's element count: it follows key "x.list" (8 + 6 bytes), the type (4), the
    // element type (4), after the first pair.
    let first = 8 + "general.architecture".len() + 4 + 8 + "llama".len();
    let at = 24 + first + 8 + 6 + 4 + 4;
    let mut x = b.clone();
    assert_eq!(u64::from_le_bytes(x[at..at + 8].try_into().unwrap()), 3);
    x[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let e = open_bytes(&x);
    assert!(e.contains("element count of metadata 'x.list'"), "{e}");
}

#[test]
fn tensor_extents_types_and_sizes() {
    // A byte size that disagrees with type and shape: "a" claims 3 rows, so "b" no longer
    // starts where "a" ends.
    let mut w = small();
    w.tensors[0].dims = vec![8, 3];
    let e = open_bytes(&w.bytes_with_data_of(&small()));
    assert!(e.contains("byte size disagrees"), "{e}");
    // The last tensor runs past the end of the file.
    let mut w = small();
    w.tensors[1].dims = vec![64 * 50];
    let e = open_bytes(&w.bytes_with_data_of(&small()));
    assert!(e.contains("'b'") && e.contains("past the end"), "{e}");
    // A size just under 2^64 bytes (2^62 − 1 f32 elements): no wrap-around to a small end.
    let mut w = small();
    w.tensors[1].ty = 0;
    w.tensors[1].dims = vec![(1 << 62) - 1];
    let e = open_bytes(&w.bytes_with_data_of(&small()));
    assert!(e.contains("'b'") && e.contains("past the end"), "{e}");
    // An unknown quantization type.
    let mut w = small();
    w.tensors[1].ty = 99;
    let e = open_bytes(&w.bytes());
    assert!(e.contains("ggml type 99") && e.contains("Q4_K"), "{e}");
    // Rows that are not whole blocks.
    let mut w = small();
    w.tensors[1].dims = vec![48];
    assert!(open_bytes(&w.bytes_with_data_of(&small())).contains("whole Q8_0 blocks"));
    // Too many dimensions.
    let mut w = small();
    w.tensors[0].dims = vec![1, 1, 2, 2, 2];
    assert!(open_bytes(&w.bytes_with_data_of(&small())).contains("5 dimensions"));
    // A bad alignment value.
    let mut w = small();
    w.kv("general.alignment", MetaValue::U32(48));
    assert!(open_bytes(&w.bytes()).contains("power of two"));
    // A duplicated key or tensor name.
    let mut w = small();
    w.kv("x.list", MetaValue::U8(1));
    assert!(open_bytes(&w.bytes()).contains("appears twice"));
}

#[test]
fn a_known_but_unsupported_type_parses_and_refuses_to_load() {
    let mut w = Writer::new();
    w.tensor("q2", &[256, 1], 10, vec![0u8; 84]);
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(&w.write(dir.path(), "q2.gguf")).unwrap();
    let e = err_of(f.dequantize_f32("q2"));
    assert!(
        e.contains("'q2' is Q2_K") && e.contains("supported: F32, F16, BF16, Q8_0"),
        "{e}"
    );
}

trait WithData {
    fn bytes_with_data_of(&self, data_from: &Writer) -> Vec<u8>;
}

impl WithData for Writer {
    /// This writer's header (with its possibly wrong dims, offsets as `data_from` computes them)
    /// over `data_from`'s data: a header that lies about a tensor.
    fn bytes_with_data_of(&self, data_from: &Writer) -> Vec<u8> {
        let mut lying = Writer {
            version: self.version,
            alignment: self.alignment,
            kv: self.kv.clone(),
            tensors: Vec::new(),
        };
        for (t, d) in self.tensors.iter().zip(&data_from.tensors) {
            lying.tensor(&t.name, &t.dims, t.ty, d.data.clone());
        }
        lying.bytes()
    }
}
