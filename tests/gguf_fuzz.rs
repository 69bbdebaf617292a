//! Fuzzing the GGUF parser: thousands of random and mutated files (bit flips, overwritten
//! fields, extreme counts and lengths, truncations, insertions) from a valid small synthetic
//! model. The property: every input gives a value or an error — never a panic, a hang or a huge
//! allocation. A counting allocator bounds the largest single allocation; each input has a time
//! limit. A sample of the inputs also goes through the whole `gguf::open` (config, tokenizer)
//! and the load of every tensor.

mod gguf_common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fdpp::dtype::DType;
use fdpp::model::gguf::{self, file::parse_header};
use fdpp::model::weights::TensorSource;
use gguf_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The largest single allocation seen while `TRACK` is on.
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

/// No input of a few kilobytes may make the parser ask for more than this at once.
const ALLOC_LIMIT: usize = 64 << 20;
const TIME_LIMIT: Duration = Duration::from_secs(2);

/// Interesting values for a u64/u32 field: zero, one, the sign bits, all ones, lengths near
/// the file's.
fn extreme(rng: &mut SmallRng, len: usize) -> u64 {
    let v = [
        0,
        1,
        2,
        3,
        31,
        32,
        u64::from(u32::MAX),
        u64::MAX,
        u64::MAX / 2,
        1 << 31,
        1 << 32,
        1 << 63,
        len as u64,
        len as u64 + 1,
        (len as u64).wrapping_sub(1),
    ];
    v[rng.gen_range(0..v.len())]
}

/// A mutation of `base`; positions fall before `header_end` (metadata and tensor infos, where
/// the parser's decisions are) nine times in ten.
fn mutate(base: &[u8], header_end: usize, rng: &mut SmallRng) -> Vec<u8> {
    let mut b = base.to_vec();
    let len = b.len();
    let pos = |rng: &mut SmallRng, room: usize| {
        let hi = if rng.gen_bool(0.9) { header_end.min(len) } else { len };
        rng.gen_range(0..hi.saturating_sub(room).max(1))
    };
    match rng.gen_range(0..7) {
        // Flip 1 to 8 bits.
        0 => {
            for _ in 0..rng.gen_range(1..=8) {
                let i = pos(rng, 0);
                b[i] ^= 1 << rng.gen_range(0..8);
            }
        }
        // Overwrite a u64-aligned-or-not field with an extreme value.
        1 => {
            let i = pos(rng, 8);
            let v = extreme(rng, b.len());
            b[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        // Overwrite a u32 (types, dims counts, versions).
        2 => {
            let i = pos(rng, 4);
            let v = extreme(rng, b.len()) as u32;
            b[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        // Truncate.
        3 => {
            let n = rng.gen_range(0..b.len());
            b.truncate(n);
        }
        // Insert or delete a run of bytes.
        4 => {
            let i = pos(rng, 0);
            if rng.gen_bool(0.5) {
                let n = rng.gen_range(1..16);
                let ins: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                b.splice(i..i, ins);
            } else {
                let n = rng.gen_range(1..16).min(b.len() - i);
                b.drain(i..i + n);
            }
        }
        // Random bytes after a valid magic and version.
        5 => {
            let n = rng.gen_range(8..512);
            b.truncate(8);
            b.extend((8..n).map(|_| rng.gen::<u8>()));
        }
        // Entirely random.
        _ => {
            let n = rng.gen_range(0..256);
            b = (0..n).map(|_| rng.gen()).collect();
        }
    }
    b
}

#[test]
fn random_and_mutated_headers_never_panic_hang_or_balloon() {
    let (w, _) = tiny_model("llama");
    let base = w.bytes();
    let header_end = parse_header(&base).unwrap().data_offset as usize;
    let mut rng = SmallRng::seed_from_u64(0x6767_7566);
    let (mut ok, mut err) = (0usize, 0usize);
    let inputs = 6000;
    for n in 0..inputs {
        let b = mutate(&base, header_end, &mut rng);
        LARGEST.store(0, Ordering::Relaxed);
        let t0 = Instant::now();
        let r = std::panic::catch_unwind(|| parse_header(&b).map(|h| h.tensors.len()));
        let dt = t0.elapsed();
        let largest = LARGEST.load(Ordering::Relaxed);
        let r = r.unwrap_or_else(|_| panic!("input #{n} ({} bytes) panicked the parser", b.len()));
        assert!(dt < TIME_LIMIT, "input #{n} took {dt:?}");
        assert!(
            largest < ALLOC_LIMIT,
            "input #{n} ({} bytes) allocated {largest} bytes at once",
            b.len()
        );
        match r {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!e.is_empty());
                err += 1
            }
        }
    }
    println!("{inputs} inputs: {ok} parsed, {err} rejected with a message");
    assert_eq!(ok + err, inputs);
    assert!(err > inputs / 2, "most mutations break the file");
    assert!(ok > 0, "some bit flips land in tensor data and still parse");
}

/// A sample of mutated files through everything a user's `--model x.gguf` does: open (config,
/// tokenizer) and the load of every tensor by HF name; an error or a model, never a panic.
#[test]
fn mutated_files_through_open_and_load() {
    let (w, _) = tiny_model("llama");
    let base = w.bytes();
    let header_end = parse_header(&base).unwrap().data_offset as usize;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    let mut rng = SmallRng::seed_from_u64(18);
    let (mut opened, mut loaded) = (0usize, 0usize);
    let inputs = 400;
    for n in 0..inputs {
        // Bit flips and field overwrites in the header: they keep the file parseable often
        // enough to reach the config, the tokenizer and the loads.
        let mut b = base.clone();
        for _ in 0..rng.gen_range(1..4) {
            let i = rng.gen_range(0..header_end - 8);
            if rng.gen_bool(0.7) {
                b[i] ^= 1 << rng.gen_range(0..8);
            } else {
                let v = extreme(&mut rng, b.len());
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        std::fs::write(&p, &b).unwrap();
        LARGEST.store(0, Ordering::Relaxed);
        let t0 = Instant::now();
        let r = std::panic::catch_unwind(|| {
            let m = gguf::open(&p)?;
            let mut elems = 0;
            for name in m.store.names() {
                let shape = m.store.shape(&name)?;
                elems += m.store.load(&name, &shape, DType::F16)?.len();
            }
            let ids = m.tokenizer.encode("the world 42")?;
            m.tokenizer.decode(&ids)?;
            Ok::<usize, fdpp::error::FdppError>(elems)
        });
        let r = r.unwrap_or_else(|_| panic!("mutated file #{n} panicked open/load"));
        assert!(
            t0.elapsed() < TIME_LIMIT * 5,
            "mutated file #{n} took {:?}",
            t0.elapsed()
        );
        assert!(
            LARGEST.load(Ordering::Relaxed) < ALLOC_LIMIT,
            "mutated file #{n} allocated too much"
        );
        match r {
            Ok(_) => {
                opened += 1;
                loaded += 1;
            }
            Err(e) => {
                if !e.to_string().contains("m.gguf") && !e.to_string().contains("shape mismatch") {
                    // Errors name the file (shape errors name the source through `what`).
                    panic!("mutated file #{n}: an error that does not name the file: {e}");
                }
            }
        }
    }
    println!(
        "{inputs} mutated files: {opened} opened and loaded, {} rejected",
        inputs - opened
    );
    let _ = loaded;
}
