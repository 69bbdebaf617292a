//! The decode attention's main pass for models with one query head per kv head (MHA), chosen by
//! timing on the device being tuned. Such a launch gives each block one head, which the
//! CUDA-core pass serves by default; the tensor-core pass (attn_decode_tc.cuh, built for the
//! grouped heads of GQA) serves it too, with the head on the MMA's N side. Which one streams the
//! cache faster is a property of the card, not of the shape alone: on the H200 the tensor-core
//! pass was 2-19 % faster at batch 1-16 and 13 % slower at batch 32 (1024 keys, async), on the
//! H100 of session 24 up to 14 % slower at batch 1 (reports/NOTES.md, sessions 24 and 41). So
//! the tune times both at the engine's decode shapes and the profile records up to which batch
//! the tensor-core pass is no slower (`DecodePassSection::rule`).

use crate::backend::Backend;
use crate::bench::attention::{plan_copies, AttnBenchCase, AttnInputs, AttnPhase, AttnVariant};
use crate::bench::TimingOpts;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::DEFAULT_PAGE_SIZE;
use crate::model::ModelConfig;
use crate::ops::attention::{AttnGeometry, SoftmaxScheme};
use crate::profile::{DecodePassRow, DecodePassSection};
use crate::run_config::{self, Key};

/// What is timed: decode batches (smallest first: the rule stops at the first the tensor-core
/// pass loses) at `kv_len` keys, `reps` calls per pass and batch in `rounds` interleaved rounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    pub batches: Vec<usize>,
    pub kv_len: usize,
    pub reps: usize,
    pub rounds: usize,
}

impl Default for Grid {
    /// Batch 1-64 at 1024 keys (the decode of a 1024-token prompt, the engine's common case),
    /// 40 calls per point.
    fn default() -> Self {
        Grid {
            batches: vec![1, 2, 4, 8, 16, 32, 64],
            kv_len: 1024,
            reps: 40,
            rounds: 4,
        }
    }
}

/// Why a tune has no decode-pass section: the model or the backend offers no choice.
pub fn skip_reason<B: Backend>(b: &B, cfg: &ModelConfig) -> Option<String> {
    if cfg.num_kv_heads != cfg.num_heads {
        return Some(format!(
            "decode pass: {} groups {} query heads per kv head, which the tensor-core pass serves already",
            cfg.name,
            cfg.num_heads / cfg.num_kv_heads.max(1)
        ));
    }
    if !b.decode_pass_choice(cfg.head_dim) {
        return Some(format!(
            "decode pass: {} has one decode pass for head_dim {}; nothing to choose",
            b.info().name,
            cfg.head_dim
        ));
    }
    if let Some(v) = run_config::get().get(Key::DecodeTc).filter(|v| !v.trim().is_empty()) {
        return Some(format!(
            "decode pass: not timed, the decode_tc switch is set ({v}) and would force both candidates; unset \
             FDPP_DECODE_TC (or drop --set decode_tc) to time them"
        ));
    }
    None
}

/// Time both passes over `grid` with `scheme` (the engine's softmax), each checked against the
/// f64 reference first. Batches whose cache does not fit the device are left out (and the
/// larger ones with them). `on_batch` hears each batch before it runs.
pub fn measure<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    dtype: DType,
    scheme: SoftmaxScheme,
    grid: &Grid,
    on_batch: &mut dyn FnMut(usize),
) -> Result<DecodePassSection> {
    let geom = AttnGeometry::new(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)?;
    let variant = match scheme {
        SoftmaxScheme::Sync => AttnVariant::Sync,
        SoftmaxScheme::Async { .. } => AttnVariant::Async,
    };
    let cus = b.info().compute_units as usize;
    let mut rows = Vec::new();
    let result = (|| -> Result<()> {
        for &batch in &grid.batches {
            let case = AttnBenchCase {
                phase: AttnPhase::Decode,
                dtype,
                geom,
                page_size: DEFAULT_PAGE_SIZE,
                page_group: 1,
                batch,
                kv_len: grid.kv_len,
            };
            let Ok(copies) = plan_copies(&case, b.info()) else {
                break;
            };
            on_batch(batch);
            let mut inputs = AttnInputs::new(b, &case, copies, 0xdec0 ^ batch as u64)?;
            let run = inputs.variant(variant, scheme, cus);
            let pass = |i: usize| (i == 1).then_some(usize::MAX);
            for i in 0..2 {
                b.set_decode_tensor_cores(pass(i));
                inputs.check(b, &run).map_err(|e| {
                    FdppError::device(
                        "decode pass",
                        format!(
                            "the {} pass failed its reference check at {}: {e}",
                            ["CUDA-core", "tensor-core"][i],
                            case.label()
                        ),
                    )
                })?;
            }
            let opts = TimingOpts {
                warmup: 3,
                reps: grid.reps,
            };
            let t = inputs.time_settings(b, &run, 2, opts, grid.rounds, &mut |i| {
                b.set_decode_tensor_cores(pass(i))
            });
            let mut us = t.into_iter().map(|r| r.map(|s| s.median_us));
            let (Some(cc), Some(tc)) = (us.next(), us.next()) else {
                return Err(FdppError::device(
                    "decode pass",
                    "the timer returned fewer than two results",
                ));
            };
            rows.push(DecodePassRow {
                batch,
                cuda_core_us: cc?,
                tensor_core_us: tc?,
            });
        }
        Ok(())
    })();
    // Whatever happened, leave the backend on its built-in rule.
    b.set_decode_tensor_cores(None);
    result?;
    if rows.is_empty() {
        return Err(FdppError::InvalidArgument(format!(
            "decode pass: not even batch {} of {} at {} keys fits {}",
            grid.batches.first().copied().unwrap_or(1),
            cfg.name,
            grid.kv_len,
            b.info().name
        )));
    }
    Ok(DecodePassSection {
        kv_len: grid.kv_len,
        scheme: scheme.label(),
        git_commit: crate::provenance::BuildInfo::current().git_commit,
        tensor_cores_up_to_batch: DecodePassSection::rule(&rows),
        rows,
    })
}

/// The section in lines: one per timed batch, then the choice.
pub fn describe(s: &DecodePassSection) -> Vec<String> {
    let mut out = vec![format!(
        "decode pass ({} keys, {}, fdpp {}): µs per launch, CUDA-core / tensor-core pass",
        s.kv_len, s.scheme, s.git_commit
    )];
    for r in &s.rows {
        out.push(format!(
            "  batch {:>3}: {:>9.2} / {:>9.2}  ({:.3}x)",
            r.batch,
            r.cuda_core_us,
            r.tensor_core_us,
            r.cuda_core_us / r.tensor_core_us
        ));
    }
    out.push(match s.tensor_cores_up_to_batch {
        Some(n) => format!("  the engine runs the tensor-core pass up to batch {n}, the CUDA-core pass above"),
        None => "  the engine runs the CUDA-core pass (the tensor-core one was slower at batch 1)".into(),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    fn row(batch: usize, cc: f64, tc: f64) -> DecodePassRow {
        DecodePassRow {
            batch,
            cuda_core_us: cc,
            tensor_core_us: tc,
        }
    }

    #[test]
    fn the_rule_stops_at_the_first_batch_the_tensor_cores_lose() {
        // Session 41's H200 shape of the result: faster up to 16, slower at 32, faster at 64.
        let rows = [
            row(1, 14.2, 13.1),
            row(8, 39.7, 36.5),
            row(16, 70.8, 64.7),
            row(32, 133.0, 152.0),
            row(64, 252.0, 242.0),
        ];
        assert_eq!(DecodePassSection::rule(&rows), Some(16));
        // Order of the rows does not matter; a tie counts as no slower.
        let rows = [row(8, 40.0, 40.0), row(1, 14.0, 13.0)];
        assert_eq!(DecodePassSection::rule(&rows), Some(8));
        // Slower at batch 1: never.
        assert_eq!(DecodePassSection::rule(&[row(1, 12.0, 13.5), row(8, 40.0, 30.0)]), None);
        assert_eq!(DecodePassSection::rule(&[]), None);
    }

    #[test]
    fn the_timing_runs_checks_and_records_every_batch_on_the_cpu() {
        // The CPU backend has one pass, so both candidates run it: this exercises the inputs,
        // the reference checks, the interleaved timing and the rule, not the choice.
        let b = CpuBackend::new();
        let mut cfg = ModelConfig::resolve("llama2-7b").expect("preset");
        (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) = (3, 3, 64);
        let grid = Grid {
            batches: vec![1, 2, 5],
            kv_len: 97,
            reps: 2,
            rounds: 2,
        };
        let mut heard = Vec::new();
        let s = measure(&b, &cfg, DType::F16, SoftmaxScheme::ASYNC_DEFAULT, &grid, &mut |n| {
            heard.push(n)
        })
        .expect("measured");
        assert_eq!(heard, [1, 2, 5]);
        assert_eq!(s.rows.iter().map(|r| r.batch).collect::<Vec<_>>(), [1, 2, 5]);
        assert!(s.rows.iter().all(|r| r.cuda_core_us > 0.0 && r.tensor_core_us > 0.0));
        assert_eq!(s.tensor_cores_up_to_batch, DecodePassSection::rule(&s.rows));
        assert_eq!(
            (s.kv_len, s.scheme.as_str()),
            (97, SoftmaxScheme::ASYNC_DEFAULT.label().as_str())
        );
    }

    #[test]
    fn models_and_backends_without_a_choice_are_skipped_with_the_reason() {
        let b = CpuBackend::new();
        let gqa = ModelConfig::resolve("llama3-8b").expect("preset");
        assert!(skip_reason(&b, &gqa)
            .expect("skipped")
            .contains("query heads per kv head"));
        let mha = ModelConfig::resolve("llama2-7b").expect("preset");
        assert!(skip_reason(&b, &mha).expect("skipped").contains("one decode pass"));
    }
}
