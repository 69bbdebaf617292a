//! End-to-end measurement of the engine (`fdpp bench e2e`): one batch of random prompts
//! prefilled together, then a fixed number of decode steps (EOS ignored, so every sequence
//! runs the same length), timed on the host around a device synchronize. The memory of each
//! configuration comes from its memory plan, and the largest batch that fits is found from the
//! plan too (FlashDecoding++Next judges the engine by its highest achievable throughput), with
//! no trial allocation.

use rand::{Rng, SeedableRng};

use crate::backend::Backend;
use crate::engine::batch::{generate, GenerateOptions};
use crate::engine::build::{memory_plan, EngineOptions};
use crate::engine::memory::{self, MemoryPlan};
use crate::engine::runner::Engine;
use crate::engine::sampler::SamplingParams;
use crate::error::{FdppError, Result};
use crate::model::llama::{self, ModelSpec};

/// One configuration: `batch` sequences of `prompt_len` prompt tokens, each generating
/// `gen_len` tokens (the first from the prefill, the rest from `gen_len − 1` decode steps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct E2eCase {
    pub batch: usize,
    pub prompt_len: usize,
    pub gen_len: usize,
}

impl E2eCase {
    /// Tokens each sequence holds at the end.
    pub fn seq_tokens(&self) -> usize {
        self.prompt_len + self.gen_len
    }

    pub fn label(&self) -> String {
        format!("batch {} prompt {} gen {}", self.batch, self.prompt_len, self.gen_len)
    }

    /// Refuse what cannot run on this model, whatever the memory.
    pub fn validate(&self, context_len: usize) -> Result<()> {
        if self.batch == 0 {
            return Err(FdppError::InvalidArgument(
                "--batch: a batch needs at least 1 sequence".into(),
            ));
        }
        if self.prompt_len == 0 {
            return Err(FdppError::InvalidArgument(
                "--prompt-len: a prompt needs at least 1 token".into(),
            ));
        }
        if self.gen_len < 2 {
            return Err(FdppError::InvalidArgument(format!(
                "--gen-len {}: at least 2 tokens are needed (the first comes from the prefill; the time per output token needs a decode step)",
                self.gen_len
            )));
        }
        if self.seq_tokens() > context_len {
            return Err(FdppError::InvalidArgument(format!(
                "{}: prompt + generated = {} tokens, longer than the model's context of {context_len}; lower --prompt-len or --gen-len",
                self.label(),
                self.seq_tokens()
            )));
        }
        Ok(())
    }
}

/// Bytes one configuration needs, computed without the plan's fit check, so that a
/// configuration that does not fit can still say how much it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    pub weights: u64,
    pub kv: u64,
    pub activations: u64,
    /// The activations of the same step with a buffer per op (`--no-reuse`).
    pub activations_no_reuse: u64,
}

impl MemoryNeed {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.activations
    }
}

/// The largest step of a run of `case` (as [`memory_plan`] sizes it).
fn max_step(case: &E2eCase, chunk: usize) -> usize {
    chunk.min(case.batch * case.prompt_len).max(case.batch)
}

/// KV tokens the case needs: every sequence's pages, whole.
pub fn kv_tokens_needed(case: &E2eCase, page_size: usize) -> usize {
    let page = page_size.max(1);
    case.batch * case.seq_tokens().div_ceil(page) * page
}

pub fn memory_need(spec: &ModelSpec, opts: &EngineOptions, case: &E2eCase) -> MemoryNeed {
    let cfg = &spec.cfg;
    let step = max_step(case, opts.chunk.max(1));
    let acts = |reuse| memory::plan_activations(cfg, opts.dtype, step, case.batch, reuse).bytes;
    MemoryNeed {
        weights: llama::weights_bytes(cfg, opts.dtype),
        kv: kv_tokens_needed(case, opts.page_size) as u64 * memory::kv_bytes_per_token(cfg, opts.dtype),
        activations: acts(opts.reuse),
        activations_no_reuse: acts(false),
    }
}

/// The plan of one configuration with the KV cache capped at what it needs, so that the
/// plan's total is the configuration's peak memory (weights + KV + activations) rather than
/// the whole pool. Fails, saying how much it needs, when it does not fit.
pub fn case_plan<B: Backend>(b: &B, spec: &ModelSpec, opts: &EngineOptions, case: &E2eCase) -> Result<MemoryPlan> {
    let capped = EngineOptions {
        max_kv_tokens: Some(kv_tokens_needed(case, opts.page_size)),
        ..opts.clone()
    };
    memory_plan(
        b,
        spec,
        &capped,
        &vec![case.seq_tokens(); case.batch],
        case.batch * case.prompt_len,
    )
}

/// The largest n in 1..=limit with `fits(n)`, for a `fits` that holds up to some n and fails
/// beyond it; None when not even 1 fits. Doubling then bisection: O(log n) plans.
pub fn largest_fitting(limit: usize, mut fits: impl FnMut(usize) -> bool) -> Option<usize> {
    if limit == 0 || !fits(1) {
        return None;
    }
    let mut lo = 1; // fits
    let mut hi = None; // first known not to fit
    while hi.is_none() && lo < limit {
        let next = (lo * 2).min(limit);
        if fits(next) {
            lo = next;
        } else {
            hi = Some(next);
        }
    }
    let Some(mut hi) = hi else {
        return Some(lo);
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// The largest batch of `prompt_len + gen_len`-token sequences whose memory plan fits the
/// device (at most `limit`), or None when not even one sequence fits.
pub fn max_batch<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    opts: &EngineOptions,
    prompt_len: usize,
    gen_len: usize,
    limit: usize,
) -> Option<usize> {
    largest_fitting(limit, |batch| {
        let case = E2eCase {
            batch,
            prompt_len,
            gen_len,
        };
        case_plan(b, spec, opts, &case).is_ok()
    })
}

/// `batch` random prompts of `len` ids; the same seed gives the same prompts, so the runs with
/// and without the profile see the same tokens.
pub fn random_prompts(vocab: usize, batch: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let vocab = vocab.max(1) as u32;
    (0..batch)
        .map(|_| (0..len).map(|_| rng.gen_range(0..vocab)).collect())
        .collect()
}

/// What one timed run gives.
#[derive(Clone, Debug, PartialEq)]
pub struct E2eMeasure {
    /// Prefill of the whole batch until every sequence has its first token.
    pub ttft_ms: f64,
    /// Median decode step: the time per output token every sequence sees.
    pub tpot_ms: f64,
    /// Mean decode step.
    pub tpot_mean_ms: f64,
    /// batch / TPOT.
    pub decode_tok_s: f64,
    /// Tokens generated (batch · gen_len) over the whole run, prefill included.
    pub e2e_tok_s: f64,
    pub total_ms: f64,
    pub decode_steps: usize,
    pub attn_rows: usize,
    /// Attention rows the async softmax recomputed with the sync scheme (FlashDecoding++ §3).
    pub recomputed: usize,
}

pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// Run `case` on `engine`: `warmup` untimed runs of the same batch (one decode step each: the
/// first run pays for kernel compilation and library start-up), then the timed one. Sampling is
/// greedy and EOS is ignored, so every sequence produces exactly `gen_len` tokens.
///
/// Timing is the host's wall clock around [`Backend::synchronize`] (inside
/// [`generate`]): at the end-to-end scale (milliseconds per step) the launch overhead it
/// includes is part of what a user sees, and device events would miss the host work between
/// steps (sampling, block tables).
pub fn run_case<B: Backend>(
    engine: &mut Engine<'_, B>,
    case: &E2eCase,
    context_len: usize,
    seed: u64,
    warmup: usize,
) -> Result<E2eMeasure> {
    let b = engine.model.backend();
    let prompts = random_prompts(engine.model.cfg.vocab_size, case.batch, case.prompt_len, seed);
    let chunk = engine.max_step_tokens();
    let opts = |max_tokens| GenerateOptions {
        max_tokens,
        eos_ids: Vec::new(),
        ignore_eos: true,
        stop: Vec::new(),
        sampling: SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed,
        },
        chunk,
        context_len,
        pipeline: true,
    };
    let mut quiet = |_: usize, _: u32, _: &str| {};
    for _ in 0..warmup {
        generate(engine, &prompts, &opts(2), None, &mut quiet)?;
    }
    // Whatever the warm-up left in the backend's running recompute total is not this run's.
    let _ = b.take_recomputed()?;
    let out = generate(engine, &prompts, &opts(case.gen_len), None, &mut quiet)?;
    b.synchronize()?;
    let enqueued = b.take_recomputed()?;
    let t = &out.timings;
    let produced: usize = out.seqs.iter().map(|s| s.tokens.len()).sum();
    if produced != case.batch * case.gen_len {
        return Err(FdppError::InvalidArgument(format!(
            "{}: {produced} tokens generated, expected {} (a sequence stopped early)",
            case.label(),
            case.batch * case.gen_len
        )));
    }
    let tpot_ms = median(&t.step_ms);
    Ok(E2eMeasure {
        ttft_ms: t.prefill_ms,
        tpot_ms,
        tpot_mean_ms: t.per_token_ms,
        decode_tok_s: case.batch as f64 / (tpot_ms / 1e3),
        e2e_tok_s: produced as f64 / (t.total_ms / 1e3),
        total_ms: t.total_ms,
        decode_steps: t.decode_steps,
        attn_rows: out.attention.rows,
        recomputed: out.attention.recomputed + enqueued,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_fitting_finds_the_edge_and_respects_the_limit() {
        for edge in [1usize, 2, 3, 7, 8, 9, 100, 1000] {
            let mut calls = 0;
            let got = largest_fitting(4096, |n| {
                calls += 1;
                n <= edge
            });
            assert_eq!(got, Some(edge));
            assert!(calls <= 2 * 13 + 2, "{calls} plans for edge {edge}");
        }
        assert_eq!(largest_fitting(5, |n| n <= 1000), Some(5));
        assert_eq!(largest_fitting(64, |_| false), None);
        assert_eq!(largest_fitting(0, |_| true), None);
    }

    #[test]
    fn cases_refuse_zero_short_generation_and_overlong_sequences() {
        let ok = E2eCase {
            batch: 2,
            prompt_len: 60,
            gen_len: 4,
        };
        assert!(ok.validate(64).is_ok());
        let e = E2eCase { gen_len: 5, ..ok }.validate(64).unwrap_err().to_string();
        assert!(e.contains("65 tokens") && e.contains("context of 64"), "{e}");
        assert!(E2eCase { batch: 0, ..ok }.validate(64).is_err());
        assert!(E2eCase { prompt_len: 0, ..ok }.validate(64).is_err());
        assert!(E2eCase { gen_len: 1, ..ok }.validate(64).is_err());
    }

    #[test]
    fn prompts_are_seeded_and_inside_the_vocabulary() {
        let a = random_prompts(97, 3, 11, 42);
        assert_eq!(a, random_prompts(97, 3, 11, 42));
        assert_ne!(a, random_prompts(97, 3, 11, 43));
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|p| p.len() == 11 && p.iter().all(|&t| t < 97)));
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn kv_need_counts_whole_pages_per_sequence() {
        let c = E2eCase {
            batch: 3,
            prompt_len: 10,
            gen_len: 7,
        };
        assert_eq!(kv_tokens_needed(&c, 16), 3 * 32);
        assert_eq!(kv_tokens_needed(&c, 1), 3 * 17);
    }
}
