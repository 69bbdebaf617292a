//! Timing a gemv layout as the fused op the engine runs with it at decode.
//!
//! On a backend with fused gemv ops, a decode step of at most [`FUSED_MAX_M`] tokens whose four
//! linears all run the gemv does not run the plain products: QKV is `gemm_rms_in` (or
//! `gemm_rms_rope_append`, the same GEMV with a rotary epilogue), O and FFN2 are
//! `gemm_residual_out`, FFN1 is `gemm_rms_glu`. The first two take their row / K-split layout
//! from the spec's block_n (`gemv_fused::config`), and the layout fastest as a plain GEMV is not
//! always the fastest fused: on the H200 the plain-fastest QKV bn16 and O bn1 made the fused
//! decode 1.5 % slower than bn1 and bn8, the unfused decode being equal. So the sweep times
//! those layouts as their fused op too, and the profile picks the gemv layout at such M by that
//! time ([`crate::profile::best_per_impl`]). FFN1's GLU kernel has a layout of its own whatever
//! block_n says, so its plain time keeps deciding.

use crate::backend::Backend;
use crate::bench::{GemmInputs, Stats, TimingOpts};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::{LinearKind, LinearShape};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::profile::{FusedMeasurement, FusedOp};

/// The most rows a fused step takes: the engine's `FUSED_MAX_M` (src/engine/forward.rs) and the
/// CUDA kernels' `gemv_fused::MAX_M` (they hold M rows of accumulators in registers).
pub const FUSED_MAX_M: usize = 8;

/// The norm's epsilon for `gemm_rms_in`; any positive value runs the same kernel at the same
/// speed (Llama uses 1e-5 or 1e-6).
pub const FUSED_EPS: f32 = 1e-5;

/// The fused op to time beside the plain product for a candidate of `imp` on `shape` at `m`
/// rows, on a backend whose `fused_gemv_ops()` is `fused_ops`: only where the engine runs one
/// with the layout the candidate's block_n gives (the gemv at m ≤ [`FUSED_MAX_M`], K a whole
/// number of 16-byte chunks, as `gemv_fused::check_supported` asks).
pub fn fused_op(fused_ops: bool, shape: &LinearShape, imp: GemmImpl, m: usize) -> Option<FusedOp> {
    if !fused_ops || imp != GemmImpl::Gemv || m == 0 || m > FUSED_MAX_M || !shape.k.is_multiple_of(8) {
        return None;
    }
    match shape.kind {
        LinearKind::Qkv => Some(FusedOp::GemmRmsIn),
        LinearKind::O | LinearKind::Ffn2 => Some(FusedOp::GemmResidualOut),
        // gemm_rms_glu ignores block_n: every layout runs the same fused kernel.
        LinearKind::Ffn1 => None,
    }
}

/// Times one shape's gemv layouts as `op`, reading x and W from the sweep's [`GemmInputs`].
pub struct FusedTimer<B: Backend> {
    op: FusedOp,
    /// [rows, N]: the y of `gemm_rms_in`, or the residual `gemm_residual_out` adds into.
    out: B::Buffer,
    /// The copy of x and W the next run reads, cycling as `GemmInputs` does so that consecutive
    /// runs never find their weights in the cache. It starts at 0, not where the plain timing
    /// left off (that cursor is private to `GemmInputs`): only the first warm-up run may reuse
    /// the copy the last plain run read, and warm-up runs are not timed.
    cursor: usize,
}

impl<B: Backend> FusedTimer<B> {
    /// A timer for `op` on an [N]-wide output at up to `rows` rows (at most [`FUSED_MAX_M`]).
    pub fn new(b: &B, dtype: DType, op: FusedOp, n: usize, rows: usize) -> Result<Self> {
        let mut out = b.alloc(dtype, rows.min(FUSED_MAX_M) * n)?;
        // Never refreshed: gemm_residual_out adds its product in place, so the residual drifts
        // over the reps (a random walk of O(1) products, far from fp16's range in any tune; and
        // the GPU takes the same time on any value, inf or NaN included).
        b.fill(&mut out, 0)?;
        Ok(FusedTimer { op, out, cursor: 0 })
    }

    pub fn op(&self) -> FusedOp {
        self.op
    }

    /// Time `specs` as the fused op at `m` rows, interleaved as the plain products are (warm-ups,
    /// then rounds in a seeded order: [`crate::bench::attention::time_interleaved`]), so that a
    /// transient slowdown lands on every layout alike. One result per spec, in order.
    pub fn time_interleaved(
        &mut self,
        b: &B,
        inputs: &GemmInputs<B>,
        specs: &[GemmSpec],
        m: usize,
        opts: TimingOpts,
        rounds: usize,
    ) -> Vec<Result<Stats>> {
        let dims = match GemmDims::new(m, inputs.n, inputs.k) {
            Ok(d) => d,
            Err(e) => {
                return specs
                    .iter()
                    .map(|_| Err(FdppError::InvalidArgument(e.to_string())))
                    .collect()
            }
        };
        let mut run = |i: usize| {
            crate::interrupt::check("timing")?;
            self.run_next(b, inputs, &specs[i], dims)
        };
        crate::bench::attention::time_interleaved(b, specs.len(), opts, rounds, &mut run)
    }

    fn run_next(&mut self, b: &B, inputs: &GemmInputs<B>, spec: &GemmSpec, dims: GemmDims) -> Result<()> {
        let j = self.cursor % inputs.copies();
        self.cursor = self.cursor.wrapping_add(1);
        let (x, w) = (&inputs.xs[j], &inputs.ws[j]);
        match self.op {
            // The sweep's x stands for the residual the norm reads: the same [M, K] rows.
            FusedOp::GemmRmsIn => b.gemm_rms_in(spec, dims, FUSED_EPS, x, w, &mut self.out),
            FusedOp::GemmResidualOut => b.gemm_residual_out(spec, dims, x, w, &mut self.out),
        }
    }
}

/// A fused timing's outcome at `m`, as the profile keeps it.
pub fn measurement(op: FusedOp, m: usize, t: Result<Stats>) -> FusedMeasurement {
    match t {
        Ok(s) => FusedMeasurement::Ok {
            m,
            op,
            samples: s.samples,
            median_us: s.median_us,
            min_us: s.min_us,
            max_us: s.max_us,
        },
        Err(e @ FdppError::Unsupported { .. }) => FusedMeasurement::Skipped {
            m,
            op,
            reason: e.to_string(),
        },
        Err(e) => FusedMeasurement::Rejected {
            m,
            op,
            reason: format!("failed while timed as {op}: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kind: LinearKind, k: usize) -> LinearShape {
        LinearShape { kind, k, n: 64 }
    }

    #[test]
    fn only_the_ops_whose_layout_is_block_n_are_timed() {
        let g = GemmImpl::Gemv;
        assert_eq!(
            fused_op(true, &shape(LinearKind::Qkv, 64), g, 1),
            Some(FusedOp::GemmRmsIn)
        );
        assert_eq!(
            fused_op(true, &shape(LinearKind::O, 64), g, 8),
            Some(FusedOp::GemmResidualOut)
        );
        assert_eq!(
            fused_op(true, &shape(LinearKind::Ffn2, 64), g, 4),
            Some(FusedOp::GemmResidualOut)
        );
        // FFN1's GLU kernel ignores block_n.
        assert_eq!(fused_op(true, &shape(LinearKind::Ffn1, 64), g, 1), None);
        // Past the fused M, other implementations, K not in 16-byte chunks, no fused ops.
        assert_eq!(fused_op(true, &shape(LinearKind::O, 64), g, FUSED_MAX_M + 1), None);
        assert_eq!(fused_op(true, &shape(LinearKind::O, 64), GemmImpl::FlatGemm, 1), None);
        assert_eq!(fused_op(true, &shape(LinearKind::O, 64), GemmImpl::Gemm, 1), None);
        assert_eq!(fused_op(true, &shape(LinearKind::O, 60), g, 1), None);
        assert_eq!(fused_op(false, &shape(LinearKind::Qkv, 64), g, 1), None);
        assert_eq!(fused_op(true, &shape(LinearKind::Qkv, 64), g, 0), None);
    }

    #[test]
    fn the_limit_is_the_cuda_kernels() {
        assert_eq!(FUSED_MAX_M, crate::backend::cuda::gemv_fused::MAX_M);
    }

    #[test]
    fn outcomes_are_kept_with_their_reason() {
        let op = FusedOp::GemmResidualOut;
        let s = Stats {
            samples: 3,
            median_us: 2.0,
            min_us: 1.0,
            max_us: 3.0,
        };
        assert_eq!(measurement(op, 2, Ok(s)).median_us(), Some(2.0));
        let skipped = measurement(
            op,
            2,
            Err(FdppError::Unsupported {
                spec: "gemv_f16".into(),
                what: "x".into(),
            }),
        );
        assert!(matches!(skipped, FusedMeasurement::Skipped { m: 2, .. }), "{skipped:?}");
        let failed = measurement(op, 3, Err(FdppError::device("cuda", "launch failed")));
        match failed {
            FusedMeasurement::Rejected { m: 3, reason, .. } => {
                assert!(
                    reason.contains("gemm_residual_out") && reason.contains("launch failed"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
