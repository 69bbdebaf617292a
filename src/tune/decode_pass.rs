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

/// Decode batches timed, smallest first (the rule stops at the first the tensor-core pass loses).
pub const BATCHES: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Keys per sequence of the timed launches: the decode of a 1024-token prompt, the engine's
/// common case (at batch 1 the split count and so the pass matter most at short contexts).
pub const KV_LEN: usize = 1024;
/// Timed calls per pass and batch, and the rounds they are interleaved in.
const REPS: usize = 40;
const ROUNDS: usize = 4;

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

/// Time both passes at [`BATCHES`] × [`KV_LEN`] with `scheme` (the engine's softmax), each
/// checked against the f64 reference first. Batches whose cache does not fit the device are
/// left out (and the larger ones with them). `on_batch` hears each batch before it runs.
pub fn measure<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    dtype: DType,
    scheme: SoftmaxScheme,
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
        for &batch in &BATCHES {
            let case = AttnBenchCase {
                phase: AttnPhase::Decode,
                dtype,
                geom,
                page_size: DEFAULT_PAGE_SIZE,
                page_group: 1,
                batch,
                kv_len: KV_LEN,
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
                    FdppError::InvalidArgument(format!(
                        "decode pass: the {} pass failed its reference check at {}: {e}",
                        ["CUDA-core", "tensor-core"][i],
                        case.label()
                    ))
                })?;
            }
            let opts = TimingOpts { warmup: 3, reps: REPS };
            let t = inputs.time_settings(b, &run, 2, opts, ROUNDS, &mut |i| b.set_decode_tensor_cores(pass(i)));
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
            "decode pass: not even batch 1 of {} at {KV_LEN} keys fits {}",
            cfg.name,
            b.info().name
        )));
    }
    Ok(DecodePassSection {
        kv_len: KV_LEN,
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
