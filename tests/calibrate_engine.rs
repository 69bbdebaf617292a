//! The engine's statistics mode on the CPU backend with a tiny random Llama (GQA 2): it does not
//! change the logits, and it counts every causal (query, key) pair of every head of every layer
//! once, through chunked prefill and decode steps.

use fdpp::backend::cpu::CpuBackend;
use fdpp::engine::build::{build, memory_plan, EngineOptions, WeightSource};
use fdpp::engine::runner::Engine;
use fdpp::engine::score_stats::ScoreStats;
use fdpp::kv::BlockTable;
use fdpp::model::hf::HfExtras;
use fdpp::model::llama::ModelSpec;
use fdpp::model::{ModelArch, ModelConfig};
use fdpp::ops::scores::{HistSpec, ScoreHist, ScoreStatsParams};

fn tiny() -> ModelSpec {
    ModelSpec {
        cfg: ModelConfig {
            name: "tiny".into(),
            arch: ModelArch::Llama,
            hidden_size: 128,
            num_layers: 3,
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

const DECODE: usize = 4;

fn prompts() -> Vec<Vec<u32>> {
    [13usize, 30, 7]
        .iter()
        .enumerate()
        .map(|(s, &n)| (0..n as u32).map(|i| (i * 37 + s as u32 * 101 + 11) % 256).collect())
        .collect()
}

/// Chunked prefill (chunk 8: sequences span steps, steps hold several sequences) then DECODE
/// greedy steps; every step's logits, and the statistics when they were on.
fn run(stats: Option<ScoreStatsParams>) -> (Vec<Vec<Vec<f32>>>, Option<ScoreStats>) {
    let spec = tiny();
    let b = CpuBackend::new();
    let ps = prompts();
    let opts = EngineOptions::default();
    let lens: Vec<usize> = ps.iter().map(|p| p.len() + DECODE).collect();
    let total = ps.iter().map(|p| p.len()).sum();
    let plan = memory_plan(&b, &spec, &opts, &lens, total).expect("plan");
    let mut e: Engine<'_, CpuBackend> =
        build(&b, &spec, &WeightSource::Random { seed: 5 }, None, &opts, plan).expect("engine");
    e.set_score_stats(stats).expect("stats params");
    let mut tables = vec![BlockTable::default(); ps.len()];
    let refs: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
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
    (all, e.take_score_stats())
}

/// Heads · Σ over sequences of the causal pairs of the prompt and of each decode step.
fn expected_per_layer() -> u64 {
    let pairs: u64 = prompts()
        .iter()
        .map(|p| {
            let l = p.len() as u64;
            l * (l + 1) / 2 + (1..=DECODE as u64).map(|k| l + k).sum::<u64>()
        })
        .sum();
    4 * pairs
}

#[test]
fn statistics_mode_leaves_the_logits_unchanged_and_counts_every_score_once() {
    let (off, none) = run(None);
    assert!(none.is_none());
    let params = ScoreStatsParams {
        spec: HistSpec::DEFAULT,
        per_head: false,
    };
    let (on, stats) = run(Some(params));
    // Bit for bit: the statistics only read q and the cache.
    assert_eq!(off, on);
    let spread = off[0][0].iter().fold(f32::MIN, |m, &v| m.max(v)) - off[0][0].iter().fold(f32::MAX, |m, &v| m.min(v));
    assert!(
        spread > 1.0,
        "logits nearly constant: the comparison would prove little"
    );

    let stats = stats.expect("stats on");
    assert_eq!(stats.layers.len(), 3);
    // Prefill of 50 tokens in chunks of 8 (7 steps), then 4 decode steps.
    assert_eq!(stats.steps, 7 + DECODE);
    let want = expected_per_layer();
    for l in 0..3 {
        let h = stats.layer(l).expect("layer");
        assert_eq!(h.count, want, "layer {l}");
        assert_eq!(h.counts.iter().sum::<u64>() + h.under + h.over, want);
        assert!(h.min < 0.0 && h.max > 0.0 && h.min.is_finite() && h.max.is_finite());
    }
    let g = stats.global().expect("global");
    assert_eq!(g.count, 3 * want);
    // Layers differ (each has its own weights).
    assert_ne!(stats.layer(0).expect("0").counts, stats.layer(1).expect("1").counts);
}

#[test]
fn per_head_histograms_sum_to_the_layer_histogram() {
    let spec = HistSpec {
        lo: -8.0,
        hi: 8.0,
        bins: 256,
    };
    let (_, one) = run(Some(ScoreStatsParams { spec, per_head: false }));
    let (_, heads) = run(Some(ScoreStatsParams { spec, per_head: true }));
    let (one, heads) = (one.expect("on"), heads.expect("on"));
    for l in 0..3 {
        assert_eq!(heads.layers[l].len(), 4);
        let mut sum = ScoreHist::new(spec);
        for h in &heads.layers[l] {
            assert!(h.count > 0);
            sum.merge(h).expect("spec");
        }
        assert_eq!(sum, one.layers[l][0]);
    }
}

#[test]
fn take_restarts_from_empty_and_off_stops_gathering() {
    let spec = tiny();
    let b = CpuBackend::new();
    let opts = EngineOptions::default();
    let plan = memory_plan(&b, &spec, &opts, &[12], 12).expect("plan");
    let mut e = build(&b, &spec, &WeightSource::Random { seed: 5 }, None, &opts, plan).expect("engine");
    let bad = ScoreStatsParams {
        spec: HistSpec {
            lo: 1.0,
            hi: -1.0,
            bins: 8,
        },
        per_head: false,
    };
    assert!(e.set_score_stats(Some(bad)).is_err(), "an empty bin range is refused");
    e.set_score_stats(Some(ScoreStatsParams {
        spec: HistSpec::DEFAULT,
        per_head: false,
    }))
    .expect("on");
    let mut t = vec![BlockTable::default()];
    let p: Vec<u32> = (0..6).collect();
    e.prefill(&mut t, &[&p], 64, &mut |_, _| Ok(())).expect("prefill");
    let first = e.take_score_stats().expect("on");
    assert_eq!(first.layer(0).expect("0").count, 4 * 21);
    let again = e.take_score_stats().expect("still on");
    assert_eq!((again.steps, again.global().expect("g").count), (0, 0));
    e.set_score_stats(None).expect("off");
    let mut refs: Vec<&mut BlockTable> = t.iter_mut().collect();
    e.decode(&mut refs, &[3]).expect("decode");
    assert!(e.take_score_stats().is_none());
}
