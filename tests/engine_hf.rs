//! The engine against HF transformers itself, on the fixtures that
//! scripts/make_hf_fixtures.py writes under tests/fixtures/hf (issue #5, item 9): small
//! random-weight checkpoints (Llama with GQA and llama3 rope_scaling; Qwen2 with q/k/v bias and
//! tied embeddings; Mistral; OPT with LayerNorms, biases, ReLU, learned positions and
//! project_in/out; Qwen2 with GQA ratio 6; ChatGLM2, whose reference is the script's own torch
//! forward since transformers has no ChatGLM class) saved in fp16, their tokenizer.json, and
//! the reference's fp32 logits and greedy tokens for three prompts.
//!
//! For each fixture and prompt, batch 1: the prompt's ids must match what the tokenizer.json
//! gives here; fed HF's greedy tokens, the logits at the last prompt position and after each
//! greedy token must be within [`TOLERANCE`] of HF's, as the relative error
//! max_v |fdpp_v − hf_v| / max_v |hf_v| over the vocabulary; fdpp's greedy choice must be HF's
//! at every step, except at a near-tie: where the fixture records HF's top-2 gap per step
//! (`gaps`), a different choice at a step whose gap is below [`NEAR_TIE`] is reported, not
//! failed. Then all prompts at once through `generate` (batched decode, prefill in chunks of 16
//! tokens): the same tokens, up to such a near-tie.
//!
//! On CUDA the fixtures run twice: without a profile (every GEMM on the vendor library, the
//! layers unfused) and with a made-up profile that puts every shape on gemv below M = 9 (four
//! gemv layouts between them), which is what sends decode steps down the fused layer path (the
//! norms' γ in the weights, the residual adds in the GEMV epilogues; engine/forward.rs).
//!
//! FDPP_HF_FIXTURES=DIR points the tests at other fixtures.

use std::path::{Path, PathBuf};

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::Backend;
use fdpp::engine::batch::{generate, GenerateOptions};
use fdpp::engine::build::{build, memory_plan, EngineOptions, WeightSource};
use fdpp::engine::sampler::{argmax, SamplingParams};
use fdpp::kv::BlockTable;
use fdpp::model::llama::ModelSpec;
use fdpp::model::shapes::{LinearKind, ModelShapes};
use fdpp::model::tokenizer::Tokenizer;
use fdpp::ops::gemm::{GemmImpl, GemmSpec};
use fdpp::profile::{BestAtM, BestConfig, Profile, ShapeProfile};
use serde::Deserialize;

/// fp16 weights and activations against HF in fp32 (the bound).
const TOLERANCE: f64 = 1e-2;

/// A greedy choice may differ from HF's where HF's top-2 gap over max|logit| is below this:
/// logits within [`TOLERANCE`] of HF's can then pick the other token (the fixture script's
/// margin is twice the tolerance for the same reason).
const NEAR_TIE: f64 = 2.0 * TOLERANCE;

/// Fixtures whose geometry waits for another helper's branch: helper "attn"'s any-GQA-ratio
/// attention (issue #17 item 3) for `qwen2-gqa6` (6 query heads on 1 KV head). The main tests
/// skip them; `cpu_engine_matches_hf_transformers_pending` runs them once that branch is in.
const AWAITING_ATTN: &[&str] = &[];

/// Prefill chunk of the batched run: the three prompts span several steps.
const BATCH_CHUNK: usize = 16;

const HOW_TO_MAKE: &str = "make them with `python3 scripts/make_hf_fixtures.py --out tests/fixtures/hf` \
     on a machine with torch (CPU is enough), transformers, tokenizers and safetensors, and commit them";

#[derive(Deserialize)]
struct Expected {
    architecture: String,
    steps: usize,
    prompts: Vec<PromptCase>,
}

#[derive(Deserialize)]
struct PromptCase {
    text: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    /// HF's top-2 gap over max|logit| at each greedy step (fixtures made after the first three).
    #[serde(default)]
    gaps: Option<Vec<f64>>,
    /// Row 0: the last prompt position; row i: after i greedy tokens.
    logits: Vec<Vec<f32>>,
}

fn fixtures_root() -> PathBuf {
    match std::env::var_os("FDPP_HF_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf"),
    }
}

/// Every fixture directory (one holding expected.json), sorted, those of [`AWAITING_ATTN`] only
/// (`pending`) or all others; a missing or empty root fails the test, saying how to make the
/// fixtures.
fn fixture_dirs(pending: bool) -> Vec<PathBuf> {
    let root = fixtures_root();
    let entries = std::fs::read_dir(&root).unwrap_or_else(|e| {
        panic!(
            "HF fixtures missing: cannot read {} ({e}); {HOW_TO_MAKE}",
            root.display()
        )
    });
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            AWAITING_ATTN.contains(&name) == pending
        })
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "HF fixtures missing: no directory with expected.json under {}; {HOW_TO_MAKE}",
        root.display()
    );
    dirs
}

/// max_v |got_v − want_v| / max_v |want_v|.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(
        got.len(),
        want.len(),
        "logits of {} entries, HF has {}",
        got.len(),
        want.len()
    );
    let scale = want.iter().fold(0f64, |m, &w| m.max((w as f64).abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((g as f64 - w as f64).abs()));
    diff / scale
}

/// What one fixture gave: a line per prompt, and the failures.
struct Outcome {
    lines: Vec<String>,
    failures: Vec<String>,
}

/// A profile, not measured, that picks gemv for every shape at M = 1..8 (the flat GEMM never,
/// the vendor GEMM from M = 9), each shape with another gemv layout.
fn gemv_profile<B: Backend>(b: &B, spec: &ModelSpec, opts: &EngineOptions) -> Profile {
    let mut p = Profile::without_gemm(b, &spec.cfg, opts.dtype);
    for s in ModelShapes::of(&spec.cfg).linears {
        let bn = match s.kind {
            LinearKind::Qkv => 1,
            LinearKind::O => 2,
            LinearKind::Ffn1 => 4,
            LinearKind::Ffn2 => 16,
        };
        let g = GemmSpec::new(GemmImpl::Gemv, opts.dtype).with_block_n(bn);
        let m_grid: Vec<usize> = (1..=8).collect();
        let best = m_grid
            .iter()
            .map(|&m| BestAtM {
                m,
                gemv: Some(BestConfig {
                    uri: g.uri(),
                    block_n: Some(bn),
                    stages: None,
                    algo: None,
                    median_us: 1.0,
                }),
                flat_gemm: None,
                gemm: None,
            })
            .collect();
        p.shapes.push(ShapeProfile {
            kind: s.kind,
            k: s.k,
            n: s.n,
            m_grid,
            candidates: Vec::new(),
            best,
            m1: None,
            m2: Some(9),
        });
    }
    p
}

fn check_fixture<B: Backend>(b: &B, dir: &Path, gemv: bool) -> Outcome {
    let name = dir
        .file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let text = std::fs::read_to_string(dir.join("expected.json")).expect("read expected.json");
    let exp: Expected = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}/expected.json: {e}"));
    let spec = ModelSpec::resolve(dir.to_str().expect("utf-8 path")).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = spec.cfg.vocab_size;
    let tok = Tokenizer::load(&dir.join("tokenizer.json")).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut out = Outcome {
        lines: Vec::new(),
        failures: Vec::new(),
    };
    for (i, p) in exp.prompts.iter().enumerate() {
        let ids = tok.encode(&p.text).expect("encode");
        assert_eq!(
            ids, p.ids,
            "{name} prompt {i}: tokenizer.json gives other ids than HF's tokenizers"
        );
        assert_eq!(p.greedy.len(), exp.steps, "{name} prompt {i}: greedy tokens");
        assert_eq!(p.logits.len(), exp.steps, "{name} prompt {i}: logit rows");
        let scale = p.logits[0].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            p.logits[0].len() == vocab && scale > 1.0,
            "{name} prompt {i}: degenerate HF logits"
        );
    }

    let opts = EngineOptions::default();
    let seq_tokens: Vec<usize> = exp.prompts.iter().map(|p| p.ids.len() + exp.steps).collect();
    let prompt_tokens: usize = exp.prompts.iter().map(|p| p.ids.len()).sum();
    let plan = memory_plan(b, &spec, &opts, &seq_tokens, prompt_tokens).expect("memory plan");
    let source = WeightSource::Dir(dir.to_path_buf());
    let profile = gemv.then(|| gemv_profile(b, &spec, &opts));
    let name = if gemv { format!("{name} [gemv profile]") } else { name };
    let mut e = build(b, &spec, &source, profile, &opts, plan).unwrap_or_else(|e| panic!("{name}: {e}"));

    // Batch 1, step by step: every step's logits against HF's, fed HF's greedy tokens (so the
    // logits are always compared on the same prefix).
    for (i, p) in exp.prompts.iter().enumerate() {
        let mut tables = vec![BlockTable::default()];
        let mut logits = e
            .prefill(&mut tables, &[&p.ids], opts.chunk, &mut |_, _| Ok(()))
            .expect("prefill")
            .remove(0);
        let (mut first_err, mut worst, mut worst_step) = (0.0, 0.0, 0);
        let mut ties = Vec::new();
        for step in 0..exp.steps {
            let err = rel_err(&logits, &p.logits[step]);
            if step == 0 {
                first_err = err;
            }
            if err > worst {
                (worst, worst_step) = (err, step);
            }
            let (mine, hf) = (argmax(&logits) as u32, p.greedy[step]);
            if mine != hf {
                match near_tie(p, step) {
                    Some(gap) => ties.push(format!("step {step} (HF gap {gap:.2e})")),
                    None => out.failures.push(format!(
                        "{name} prompt {i}: greedy token {mine} at step {step}, HF's is {hf} (HF's top-2 gap {})",
                        gap_text(p, step)
                    )),
                }
            }
            if step + 1 < exp.steps {
                let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
                logits = e.decode(&mut refs, &[hf]).expect("decode").remove(0);
            }
        }
        e.release(&mut tables[0]).expect("release");
        out.lines.push(format!(
            "{name} ({}) prompt {i} ({} tokens): last-prompt rel err {first_err:.2e}, \
             max over {} steps {worst:.2e} (step {worst_step}), greedy {}/{} identical{}",
            exp.architecture,
            p.ids.len(),
            exp.steps,
            exp.steps - ties.len(),
            exp.steps,
            if ties.is_empty() {
                String::new()
            } else {
                format!(", near-ties: {}", ties.join(", "))
            }
        ));
        if worst > TOLERANCE {
            out.failures.push(format!(
                "{name} prompt {i}: logits at step {worst_step} are {worst:.3e} off HF's (tolerance {TOLERANCE})"
            ));
        }
    }

    // All prompts together through generate: batched decode, chunked prefill.
    let prompts: Vec<Vec<u32>> = exp.prompts.iter().map(|p| p.ids.clone()).collect();
    let gen = GenerateOptions {
        max_tokens: exp.steps,
        eos_ids: spec.extras.eos_token_ids.clone(),
        ignore_eos: true,
        stop: Vec::new(),
        sampling: SamplingParams::default(),
        chunk: BATCH_CHUNK,
        context_len: spec.context_len(),
        pipeline: true,
    };
    let res = generate(&mut e, &prompts, &gen, Some(&tok), &mut |_, _, _| {}).expect("generate");
    for (i, (s, p)) in res.seqs.iter().zip(&exp.prompts).enumerate() {
        let same = s.tokens.iter().zip(&p.greedy).take_while(|(a, b)| a == b).count();
        if s.tokens == p.greedy {
            continue;
        }
        match near_tie(p, same) {
            Some(gap) => out.lines.push(format!(
                "{name} prompt {i}, batched generate: diverges at step {same}, a near-tie (HF gap {gap:.2e})"
            )),
            None => out.failures.push(format!(
                "{name} prompt {i}, batched generate diverges at step {same} (HF's top-2 gap {}): fdpp {:?}, HF {:?}",
                gap_text(p, same),
                s.tokens,
                p.greedy
            )),
        }
    }
    out.lines.push(format!(
        "{name}: batched generate of {} prompts (prefill chunk {BATCH_CHUNK}): {}/{} sequences identical",
        prompts.len(),
        res.seqs
            .iter()
            .zip(&exp.prompts)
            .filter(|(s, p)| s.tokens == p.greedy)
            .count(),
        prompts.len()
    ));
    out
}

/// HF's top-2 gap at `step` when the fixture records it and it is below [`NEAR_TIE`].
fn near_tie(p: &PromptCase, step: usize) -> Option<f64> {
    p.gaps.as_ref()?.get(step).copied().filter(|&g| g < NEAR_TIE)
}

fn gap_text(p: &PromptCase, step: usize) -> String {
    match p.gaps.as_ref().and_then(|g| g.get(step)) {
        Some(g) => format!("{g:.2e}"),
        None => format!("not recorded; at least {NEAR_TIE} over the path"),
    }
}

fn check_all<B: Backend>(b: &B, gemv: bool) {
    check_dirs(b, &fixture_dirs(false), gemv);
}

fn check_dirs<B: Backend>(b: &B, dirs: &[PathBuf], gemv: bool) {
    let mut failures = Vec::new();
    for dir in dirs {
        let o = check_fixture(b, dir, gemv);
        for l in &o.lines {
            eprintln!("{l}");
        }
        failures.extend(o.failures);
    }
    assert!(
        failures.is_empty(),
        "fdpp differs from HF transformers:\n{}",
        failures.join("\n")
    );
}

// The fixtures are committed (made on the GPU machine, where transformers is installed); a
// missing fixtures directory fails the test with HOW_TO_MAKE.
#[test]
fn cpu_engine_matches_hf_transformers() {
    check_all(&CpuBackend::new(), false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_engine_matches_hf_transformers() {
    let b = fdpp::backend::cuda::CudaBackend::open(0).expect("CUDA device 0");
    check_all(&b, false);
    check_all(&b, true);
}

#[test]
fn relative_error_is_the_largest_difference_over_the_largest_reference_logit() {
    // max |Δ| = 0.5 (second entry), max |hf| = 4 (third entry, negative).
    let got = [1.0, 2.5, -4.0, 0.1];
    let want = [1.1, 2.0, -4.0, 0.0];
    assert!((rel_err(&got, &want) - 0.125).abs() < 1e-9);
}
