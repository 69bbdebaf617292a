//! Per-layer softmax windows reach the attention of their own layer (FlashDecoding++ §3 with a
//! φ and [a, b] per layer), on the CPU backend with a tiny random Llama of 3 layers.
//!
//! A window whose φ sits far above every score flags every row of its layer (the row's largest
//! score minus φ is below a), and a flagged row is recomputed with the sync softmax. Giving that
//! window to layer 1 alone must recompute exactly one layer's rows — no more (the other layers
//! keep the global window) and no fewer (the window reached the kernel) — and leave the logits
//! those of the sync softmax.

use fdpp::backend::cpu::CpuBackend;
use fdpp::engine::build::{build, memory_plan, EngineOptions, WeightSource};
use fdpp::kv::BlockTable;
use fdpp::model::hf::HfExtras;
use fdpp::model::llama::ModelSpec;
use fdpp::model::{ModelArch, ModelConfig};
use fdpp::ops::attention::SoftmaxScheme;

const LAYERS: usize = 3;
const DECODE: usize = 3;

fn tiny() -> ModelSpec {
    ModelSpec {
        cfg: ModelConfig {
            name: "tiny".into(),
            arch: ModelArch::Llama,
            hidden_size: 128,
            num_layers: LAYERS,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            intermediate_size: 256,
            vocab_size: 256,
            max_position_embeddings: 512,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            qkv_bias: false,
            gated_ffn: true,
        },
        extras: HfExtras::default(),
        dir: None,
        gguf: None,
    }
}

/// Every row flagged: the largest score minus φ = 1000 is far below a.
const FLAG_ALL: SoftmaxScheme = SoftmaxScheme::Async {
    phi: 1000.0,
    a: -10.0,
    b: 10.0,
};

/// (logits of every step, attention rows, rows recomputed) for a prefill of two prompts and
/// DECODE greedy steps.
fn run(scheme: SoftmaxScheme, layer_schemes: Vec<SoftmaxScheme>) -> (Vec<Vec<Vec<f32>>>, usize, usize) {
    let spec = tiny();
    let b = CpuBackend::new();
    let prompts: Vec<Vec<u32>> = [11usize, 19]
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 53 + n as u32) % 256).collect())
        .collect();
    let opts = EngineOptions {
        scheme,
        layer_schemes,
        ..EngineOptions::default()
    };
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + DECODE).collect();
    let total = prompts.iter().map(Vec::len).sum();
    let plan = memory_plan(&b, &spec, &opts, &lens, total).expect("plan");
    let mut e = build(&b, &spec, &WeightSource::Random { seed: 3 }, None, &opts, plan).expect("engine");
    let mut tables = vec![BlockTable::default(); prompts.len()];
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut all = vec![e.prefill(&mut tables, &refs, 8, &mut |_, _| Ok(())).expect("prefill")];
    for _ in 0..DECODE {
        let next: Vec<u32> = all
            .last()
            .expect("logits")
            .iter()
            .map(|r| r.iter().enumerate().fold(0, |m, (i, &x)| if x > r[m] { i } else { m }) as u32)
            .collect();
        let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
        all.push(e.decode(&mut refs, &next).expect("decode"));
    }
    (all, e.attn.rows, e.attn.recomputed)
}

fn max_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    let mut d = 0f32;
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        for (p, q) in x.iter().zip(y) {
            d = d.max((p - q).abs());
        }
    }
    d
}

#[test]
fn a_layer_with_its_own_window_is_recomputed_alone() {
    let global = SoftmaxScheme::ASYNC_DEFAULT;
    let (sync, rows, rec) = run(SoftmaxScheme::Sync, Vec::new());
    assert_eq!(rec, 0);
    assert!(rows > 0 && rows % LAYERS == 0, "{rows}");
    let per_layer_rows = rows / LAYERS;

    // The global window: random weights' scores sit near 0, nothing flagged.
    let (g, _, rec) = run(global, Vec::new());
    assert_eq!(rec, 0, "the default window flags nothing here");
    // Layer 1 alone with the flag-all window.
    let (one, rows1, rec1) = run(global, vec![global, FLAG_ALL, global]);
    assert_eq!(rows1, rows);
    assert_eq!(rec1, per_layer_rows, "exactly layer 1's rows recomputed");
    // Every layer with it (as a global window): all rows.
    let (all, _, rec_all) = run(FLAG_ALL, Vec::new());
    assert_eq!(rec_all, rows);
    // Per-layer windows are ignored when the model runs sync.
    let (_, _, rec_sync) = run(SoftmaxScheme::Sync, vec![FLAG_ALL; LAYERS]);
    assert_eq!(rec_sync, 0);

    // A recomputed row is the sync row; unflagged async rows agree with sync to rounding.
    for (what, got) in [("global", &g), ("layer 1 own window", &one), ("all flagged", &all)] {
        let d = max_diff(got, &sync);
        assert!(d < 2e-2, "{what}: logits differ from sync by {d}");
    }
}

#[test]
fn per_layer_windows_must_be_one_per_layer_and_valid() {
    let spec = tiny();
    let b = CpuBackend::new();
    let build_with = |layer_schemes: Vec<SoftmaxScheme>| {
        let opts = EngineOptions {
            layer_schemes,
            ..EngineOptions::default()
        };
        let plan = memory_plan(&b, &spec, &opts, &[8], 8).expect("plan");
        build(&b, &spec, &WeightSource::Random { seed: 3 }, None, &opts, plan).map(|_| ())
    };
    let e = build_with(vec![SoftmaxScheme::ASYNC_DEFAULT; 2])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2 per-layer softmax windows") && e.contains("3 layers"),
        "{e}"
    );
    let bad = SoftmaxScheme::Async {
        phi: 0.0,
        a: 5.0,
        b: -5.0,
    };
    let e = build_with(vec![SoftmaxScheme::ASYNC_DEFAULT, bad, SoftmaxScheme::ASYNC_DEFAULT])
        .unwrap_err()
        .to_string();
    assert!(e.contains("a must be below b"), "{e}");
    assert!(build_with(vec![SoftmaxScheme::ASYNC_DEFAULT; 3]).is_ok());
}
