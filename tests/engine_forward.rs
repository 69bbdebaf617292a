//! The forward pass on the CPU backend with a tiny random Llama (GQA, head_dim 64, hidden ≠
//! heads·head_dim): the KV cache and RoPE positions (prefill then decode equals one longer
//! prefill), batching (two prompts together equal each alone), chunked prefill, and the memory
//! plan's buffers with and without reuse giving the same logits.

use fdpp::backend::cpu::CpuBackend;
use fdpp::engine::build::{build, memory_plan, EngineOptions, WeightSource};
use fdpp::engine::runner::Engine;
use fdpp::kv::BlockTable;
use fdpp::model::hf::HfExtras;
use fdpp::model::llama::ModelSpec;
use fdpp::model::{ModelArch, ModelConfig};
use fdpp::ops::attention::SoftmaxScheme;

fn tiny(qkv_bias: bool, tied: bool) -> ModelSpec {
    ModelSpec {
        cfg: ModelConfig {
            name: "tiny".into(),
            arch: if qkv_bias { ModelArch::Qwen2 } else { ModelArch::Llama },
            hidden_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            intermediate_size: 256,
            vocab_size: 256,
            max_position_embeddings: 512,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: tied,
            qkv_bias,
            gated_ffn: true,
        },
        extras: HfExtras::default(),
        dir: None,
        gguf: None,
    }
}

fn engine<'b>(b: &'b CpuBackend, spec: &ModelSpec, opts: &EngineOptions, lens: &[usize]) -> Engine<'b, CpuBackend> {
    let total: usize = lens.iter().sum();
    let plan = memory_plan(b, spec, opts, lens, total).expect("plan");
    build(b, spec, &WeightSource::Random { seed: 7 }, None, opts, plan).expect("engine")
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + salt * 101 + 11) % 256).collect()
}

/// Largest |a − b| relative to the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert!(a.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
    let spread = b.iter().fold(f32::MIN, |m, &v| m.max(v)) - b.iter().fold(f32::MAX, |m, &v| m.min(v));
    assert!(
        spread > 1.0,
        "{what}: logits nearly constant ({spread}), the test would prove little"
    );
    // The CPU gives the same bits on both paths; 2e-3 leaves room for GPU GEMMs that sum in
    // another order, and is far below what a token at the wrong position does (≈ 5e-2).
    let e = rel_err(a, b);
    assert!(e < 2e-3, "{what}: relative error {e}");
}

fn prefill_alone(spec: &ModelSpec, opts: &EngineOptions, p: &[u32]) -> Vec<f32> {
    let b = CpuBackend::new();
    let mut e = engine(&b, spec, opts, &[p.len()]);
    let mut t = vec![BlockTable::default()];
    e.prefill(&mut t, &[p], opts.chunk, &mut |_, _| Ok(()))
        .expect("prefill")
        .remove(0)
}

#[test]
fn prefill_then_decode_equals_one_longer_prefill() {
    for (bias, tied) in [(false, false), (true, true)] {
        let spec = tiny(bias, tied);
        let opts = EngineOptions::default();
        let full = prompt(21, 1);
        let (head, tail) = full.split_at(18);
        let b = CpuBackend::new();
        let mut e = engine(&b, &spec, &opts, &[full.len()]);
        let mut tables = vec![BlockTable::default()];
        e.prefill(&mut tables, &[head], opts.chunk, &mut |_, _| Ok(()))
            .expect("prefill");
        let mut last = Vec::new();
        for &tok in tail {
            let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
            last = e.decode(&mut refs, &[tok]).expect("decode").remove(0);
        }
        assert_eq!(tables[0].seq_len, 21);
        let want = prefill_alone(&spec, &opts, &full);
        assert_close(&last, &want, &format!("bias={bias} tied={tied}"));
    }
}

#[test]
fn a_batch_of_two_prompts_equals_each_alone() {
    let spec = tiny(false, false);
    let opts = EngineOptions::default();
    let (p0, p1) = (prompt(13, 2), prompt(30, 3));
    let b = CpuBackend::new();
    let mut e = engine(&b, &spec, &opts, &[p0.len() + 3, p1.len() + 3]);
    let mut tables = vec![BlockTable::default(), BlockTable::default()];
    let mut order = Vec::new();
    let first = e
        .prefill(&mut tables, &[&p0, &p1], opts.chunk, &mut |s, _| {
            order.push(s);
            Ok(())
        })
        .expect("prefill");
    assert_eq!(order, vec![0, 1]);
    assert_close(&first[0], &prefill_alone(&spec, &opts, &p0), "prompt 0 in a batch");
    assert_close(&first[1], &prefill_alone(&spec, &opts, &p1), "prompt 1 in a batch");
    // Decode both together: sequence 1's logits equal a prefill of its longer prompt alone.
    let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
    let next = e.decode(&mut refs, &[5, 9]).expect("decode");
    let mut p1_longer = p1.clone();
    p1_longer.push(9);
    assert_close(&next[1], &prefill_alone(&spec, &opts, &p1_longer), "decode in a batch");
    let mut p0_longer = p0.clone();
    p0_longer.push(5);
    assert_close(&next[0], &prefill_alone(&spec, &opts, &p0_longer), "decode in a batch");
}

#[test]
fn chunked_prefill_equals_unchunked() {
    let spec = tiny(false, false);
    let p = prompt(40, 4);
    let whole = prefill_alone(&spec, &EngineOptions::default(), &p);
    for chunk in [7, 16, 39] {
        let opts = EngineOptions {
            chunk,
            ..EngineOptions::default()
        };
        assert_close(&prefill_alone(&spec, &opts, &p), &whole, &format!("chunk {chunk}"));
    }
    // Two sequences whose prompts straddle chunk boundaries.
    let q = prompt(11, 5);
    let opts = EngineOptions {
        chunk: 8,
        ..EngineOptions::default()
    };
    let b = CpuBackend::new();
    let mut e = engine(&b, &spec, &opts, &[p.len(), q.len()]);
    assert_eq!(e.max_step_tokens(), 8);
    let mut tables = vec![BlockTable::default(), BlockTable::default()];
    let got = e
        .prefill(&mut tables, &[&p, &q], 8, &mut |_, _| Ok(()))
        .expect("prefill");
    assert_close(&got[0], &whole, "chunked batch, sequence 0");
    assert_close(
        &got[1],
        &prefill_alone(&spec, &EngineOptions::default(), &q),
        "chunked batch, sequence 1",
    );
}

#[test]
fn no_reuse_and_sync_softmax_give_the_same_logits() {
    let spec = tiny(true, false);
    let p = prompt(25, 6);
    let base = prefill_alone(&spec, &EngineOptions::default(), &p);
    let no_reuse = EngineOptions {
        reuse: false,
        ..EngineOptions::default()
    };
    let got = prefill_alone(&spec, &no_reuse, &p);
    assert_eq!(got, base, "the same ops on other buffers give the same bits");
    let sync = EngineOptions {
        scheme: SoftmaxScheme::Sync,
        ..EngineOptions::default()
    };
    assert_close(&prefill_alone(&spec, &sync, &p), &base, "sync softmax");
}

#[test]
fn greedy_decode_chooses_the_argmax_of_the_logits_decode() {
    let spec = tiny(false, false);
    let opts = EngineOptions::default();
    let prompts = [prompt(9, 2), prompt(14, 3)];
    let b = CpuBackend::new();
    // Room for each step twice: every step runs from a copy of the tables for the logits, then
    // from the tables themselves greedily (the same K/V go to the same slots; a page the copy
    // grew is left unused).
    let lens: Vec<usize> = prompts.iter().map(|p| 2 * (p.len() + 8)).collect();
    let mut e = engine(&b, &spec, &opts, &lens);
    let mut tables = vec![BlockTable::default(); 2];
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    e.prefill(&mut tables, &refs, opts.chunk, &mut |_, _| Ok(()))
        .expect("prefill");
    let mut next = vec![5u32, 77];
    for _ in 0..3 {
        let mut copy = tables.clone();
        let mut refs: Vec<&mut BlockTable> = copy.iter_mut().collect();
        let logits = e.decode(&mut refs, &next).expect("decode");
        let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
        let ids = e.decode_greedy(&mut refs, &next).expect("greedy decode");
        let want: Vec<u32> = logits.iter().map(|l| fdpp::engine::sampler::argmax(l) as u32).collect();
        assert_eq!(ids, want);
        next = ids;
    }
}

/// A tiny OPT (LayerNorm with bias, learned positions, ReLU MLP with biases, tied head) whose
/// embedding is projected (64 ↔ 128), and a tiny ChatGLM2 (rotary over half of each head,
/// interleaved; MQA groups; QKV bias).
fn other_families() -> Vec<ModelSpec> {
    let opt = ModelSpec {
        cfg: ModelConfig {
            name: "tiny-opt".into(),
            arch: ModelArch::Opt,
            num_kv_heads: 2,
            num_heads: 2,
            tie_word_embeddings: true,
            qkv_bias: true,
            gated_ffn: false,
            ..tiny(false, false).cfg
        },
        extras: HfExtras {
            embed_proj_dim: Some(64),
            ..HfExtras::default()
        },
        dir: None,
        gguf: None,
    };
    let glm = ModelSpec {
        cfg: ModelConfig {
            name: "tiny-glm".into(),
            arch: ModelArch::ChatGlm,
            qkv_bias: true,
            ..tiny(false, false).cfg
        },
        extras: HfExtras::default(),
        dir: None,
        gguf: None,
    };
    vec![opt, glm]
}

#[test]
fn opt_and_chatglm_keep_the_cache_batch_chunk_and_reuse_invariants() {
    for spec in other_families() {
        let name = spec.cfg.name.clone();
        let opts = EngineOptions::default();
        let b = CpuBackend::new();
        // Prefill then decode equals one longer prefill (positions and the cache).
        let full = prompt(21, 1);
        let (head, tail) = full.split_at(18);
        let mut e = engine(&b, &spec, &opts, &[full.len()]);
        let mut tables = vec![BlockTable::default()];
        e.prefill(&mut tables, &[head], opts.chunk, &mut |_, _| Ok(()))
            .expect("prefill");
        let mut last = Vec::new();
        for &tok in tail {
            let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
            last = e.decode(&mut refs, &[tok]).expect("decode").remove(0);
        }
        let whole = prefill_alone(&spec, &opts, &full);
        assert_close(&last, &whole, &format!("{name}: prefill + decode"));
        // A batch of two equals each alone; chunked equals unchunked.
        let (p0, p1) = (prompt(13, 2), prompt(30, 3));
        let chunked = EngineOptions {
            chunk: 8,
            ..EngineOptions::default()
        };
        let mut e = engine(&b, &spec, &chunked, &[p0.len(), p1.len()]);
        let mut tables = vec![BlockTable::default(), BlockTable::default()];
        let got = e
            .prefill(&mut tables, &[&p0, &p1], 8, &mut |_, _| Ok(()))
            .expect("prefill");
        assert_close(&got[0], &prefill_alone(&spec, &opts, &p0), &format!("{name}: batch 0"));
        assert_close(&got[1], &prefill_alone(&spec, &opts, &p1), &format!("{name}: batch 1"));
        // Buffers without reuse: the same bits.
        let no_reuse = EngineOptions {
            reuse: false,
            ..EngineOptions::default()
        };
        assert_eq!(prefill_alone(&spec, &no_reuse, &full), whole, "{name}: no reuse");
    }
}
