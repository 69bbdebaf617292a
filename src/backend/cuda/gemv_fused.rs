//! The gemv vector path with the layer's small ops fused in (kernels_cuda/gemv.cu, modes RMS_IN
//! and RESIDUAL_OUT). FlashDecoding++ fuses what surrounds a decode GEMM into it: here the RMSNorm
//! that feeds QKV and FFN1 is taken inside their GEMV (its γ folded into the weights at load, its
//! 1/rms applied to the product), and the residual add that follows O and FFN2 is their GEMV's
//! epilogue, so a Llama layer loses both add_rmsnorm launches and, with them, the kernel
//! boundaries at which the next GEMV could not yet stream its weights.
//!
//! Only `GemmImpl::Gemv` at M ≤ 8 and K % 8 == 0 (16-byte rows) has these kernels; every other
//! case returns `Unsupported` so that the caller takes the unfused ops.

use cudarc::driver::LaunchConfig;

use super::gemm::{i32_of, vec_ok};
use super::launch::Launch;
use super::sources::{self, GEMV_WARPS};
use super::{drv, CudaBackend, CudaBuffer};
use crate::backend::DeviceBuffer;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::ops::layer::{KvAppendParams, RopeParams};

/// Rows of x one fused launch takes (the kernels hold M rows of accumulators in registers).
pub const MAX_M: usize = 8;

const RMS_M: [&str; MAX_M] = [
    "gemv_rms_m1",
    "gemv_rms_m2",
    "gemv_rms_m3",
    "gemv_rms_m4",
    "gemv_rms_m5",
    "gemv_rms_m6",
    "gemv_rms_m7",
    "gemv_rms_m8",
];

const GLU_M: [&str; MAX_M] = [
    "gemv_rms_glu_m1",
    "gemv_rms_glu_m2",
    "gemv_rms_glu_m3",
    "gemv_rms_glu_m4",
    "gemv_rms_glu_m5",
    "gemv_rms_glu_m6",
    "gemv_rms_glu_m7",
    "gemv_rms_glu_m8",
];

const ROPE_M: [&str; MAX_M] = [
    "gemv_rms_rope_m1",
    "gemv_rms_rope_m2",
    "gemv_rms_rope_m3",
    "gemv_rms_rope_m4",
    "gemv_rms_rope_m5",
    "gemv_rms_rope_m6",
    "gemv_rms_rope_m7",
    "gemv_rms_rope_m8",
];

const RES_M: [&str; MAX_M] = [
    "gemv_res_m1",
    "gemv_res_m2",
    "gemv_res_m3",
    "gemv_res_m4",
    "gemv_res_m5",
    "gemv_res_m6",
    "gemv_res_m7",
    "gemv_res_m8",
];

/// Whether `spec` at `d` has a fused kernel; `Unsupported` names the op, the spec and the reason.
pub fn check_supported(op: &str, spec: &GemmSpec, d: &GemmDims) -> Result<()> {
    let why = if spec.imp != GemmImpl::Gemv {
        Some(format!("{op} (only the gemv implementation fuses it)"))
    } else if d.m > MAX_M {
        Some(format!(
            "{op} at M = {} (the fused gemv takes at most {MAX_M} rows)",
            d.m
        ))
    } else if !vec_ok(d) {
        Some(format!("{op} at K = {} (the fused gemv needs K % 8 == 0)", d.k))
    } else {
        None
    };
    match why {
        Some(what) => Err(FdppError::Unsupported { spec: spec.uri(), what }),
        None => Ok(()),
    }
}

fn check_dtypes(op: &str, spec: &GemmSpec, bufs: &[(&str, &CudaBuffer)]) -> Result<()> {
    match bufs.iter().find(|(_, b)| b.dtype() != spec.dtype) {
        Some((name, b)) => Err(FdppError::InvalidArgument(format!(
            "{op} {spec}: {name} is {}, the kernel runs in {}",
            b.dtype(),
            spec.dtype
        ))),
        None => Ok(()),
    }
}

/// The gemv grid for `spec` (same rows per block as the plain kernel).
fn config(spec: &GemmSpec, d: &GemmDims) -> LaunchConfig {
    let (rows, ksplit) = sources::gemv_layout(spec.block_n.unwrap_or(8));
    let rows_per_block = (rows * GEMV_WARPS / ksplit) as usize;
    LaunchConfig {
        grid_dim: (d.n.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: (GEMV_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn source(spec: &GemmSpec) -> Result<sources::KernelSource> {
    sources::gemm_source(spec).ok_or_else(|| FdppError::device("cuda", format!("{spec}: no source")))
}

/// y = rmsnorm(residual) · W'ᵀ, where W' already holds the norm's γ (`Backend::scale_cols` at
/// load): the GEMV runs on the raw residual rows and scales each output by 1/rms of its row.
pub fn rms_in(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    eps: f32,
    residual: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    const OP: &str = "gemm_rms_in";
    check_supported(OP, spec, &d)?;
    check_eps(OP, spec, eps)?;
    d.check_lens(spec, residual.len(), w.len(), y.len())?;
    check_dtypes(OP, spec, &[("residual", residual), ("w", w), ("y", y)])?;
    let f = b.function_of(&spec.uri(), RMS_M[d.m - 1], 0, || source(spec))?;
    // SAFETY: residual covers [M, K], w [N, K], y [M, N] (checked above); the grid is the plain
    // gemv's for this spec.
    unsafe { launch_rms(b, OP, spec, &d, &f, config(spec, &d), (residual, w, y), eps) }
}

/// Launch an RMS entry (residual, w, y, N = d.n, K, eps), chained.
///
/// # Safety
/// The buffers must cover what the entry reads and writes over `cfg` for `d` (K % 8 == 0, so
/// every row starts 16-byte aligned in a device allocation).
#[allow(clippy::too_many_arguments)]
unsafe fn launch_rms(
    b: &CudaBackend,
    op: &str,
    spec: &GemmSpec,
    d: &GemmDims,
    f: &cudarc::driver::CudaFunction,
    cfg: LaunchConfig,
    (residual, w, y): (&CudaBuffer, &CudaBuffer, &mut CudaBuffer),
    eps: f32,
) -> Result<()> {
    let (n, k) = (i32_of(d.n, "N", spec)?, i32_of(d.k, "K", spec)?);
    let (rp, wp, yp) = (b.ptr(residual), b.ptr(w), b.ptr(y));
    let mut l = Launch::chained(b, f);
    l.arg(&rp).arg(&wp).arg(&yp).arg(&n).arg(&k).arg(&eps);
    // SAFETY: the caller's.
    unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {op} {spec}")))?;
    b.check_launch(&format!("{op} {spec} at {}", d.label()))
}

/// y [M, N] = silu(g) · u, where [g | u] = rmsnorm(residual) · W'ᵀ and W' [2N, K] holds the gate
/// rows then the up rows, with the norm's γ folded in: `gemm_rms_in` and silu_mul in one launch.
/// The layout is the GLU entries' own (sources::GEMV_GLU_LAYOUT), whatever `spec`'s block_n.
pub fn rms_glu(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    eps: f32,
    residual: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    const OP: &str = "gemm_rms_glu";
    check_supported(OP, spec, &d)?;
    check_eps(OP, spec, eps)?;
    // W holds 2N rows: checked as a GEMM of width 2N; y holds only N columns per row.
    let wide = GemmDims::new(d.m, 2 * d.n, d.k)?;
    wide.check_lens(spec, residual.len(), w.len(), 2 * d.m * d.n)?;
    if y.len() < d.m * d.n {
        return Err(FdppError::Shape {
            what: format!("{OP} {spec} at {}: y", d.label()),
            expected: format!("at least {} elements", d.m * d.n),
            found: y.len().to_string(),
        });
    }
    check_dtypes(OP, spec, &[("residual", residual), ("w", w), ("y", y)])?;
    let src = sources::gemv_glu_source(spec.dtype);
    let f = b.function_of(&src.uri.clone(), GLU_M[d.m - 1], 0, || Ok(src))?;
    let (_, ksplit) = sources::GEMV_GLU_LAYOUT;
    let pairs_per_block = (GEMV_WARPS / ksplit) as usize;
    let cfg = LaunchConfig {
        grid_dim: (d.n.div_ceil(pairs_per_block) as u32, 1, 1),
        block_dim: (GEMV_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: residual covers [M, K], w [2N, K], y [M, N] (checked above); one row group per
    // gate/up pair.
    unsafe { launch_rms(b, OP, spec, &d, &f, cfg, (residual, w, y), eps) }
}

/// QKV of a decode step in one launch: q [M, H·D] and the new tokens' k and v in the pools at
/// their slots from rmsnorm(residual) · W'ᵀ (W' [(H + 2G)·D, K] with the norm's γ folded in),
/// rotated by the whole-head rotate-half rotary (kernels_cuda/gemv_rope.cu): `gemm_rms_in` into
/// qkv followed by `qkv_rope_append`, bit for bit when that gemm splits K over 4 warps as these
/// entries do (sources::GEMV_GLU_LAYOUT). Other rotary forms and shapes are `Unsupported`.
#[allow(clippy::too_many_arguments)]
pub fn rms_rope_append(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    eps: f32,
    residual: &CudaBuffer,
    w: &CudaBuffer,
    rope: &RopeParams,
    append: &KvAppendParams,
    bias: Option<&CudaBuffer>,
    q: &mut CudaBuffer,
    kv: &mut PagedKv<CudaBuffer>,
) -> Result<()> {
    const OP: &str = "gemm_rms_rope_append";
    check_supported(OP, spec, &d)?;
    rope.require_whole_half(OP)?;
    check_eps(OP, spec, eps)?;
    let g = rope.geom;
    if d.n != rope.qkv_width() || d.m != rope.tokens() || !d.n.is_multiple_of(2) {
        return Err(FdppError::InvalidArgument(format!(
            "{OP} {spec} at {}: the rotary is over {} tokens of width {} (N must be that width, even)",
            d.label(),
            rope.tokens(),
            rope.qkv_width()
        )));
    }
    let kv_elems = d.m * g.num_kv_heads * g.head_dim;
    rope.validate(d.m * d.n, bias.map(|x| x.len()), q.len(), kv_elems, kv_elems)?;
    let layout = kv.layout;
    layout.validate()?;
    append.validate(&layout, kv_elems, kv_elems, (kv.k.len(), kv.v.len()))?;
    if append.tokens() != d.m || layout.token_elems() != g.num_kv_heads * g.head_dim {
        return Err(FdppError::InvalidArgument(format!(
            "{OP} {spec}: {} appended tokens of width {} for {} rotated tokens of {} kv heads × {}",
            append.tokens(),
            layout.token_elems(),
            d.m,
            g.num_kv_heads,
            g.head_dim
        )));
    }
    d.check_lens(spec, residual.len(), w.len(), d.m * d.n)?;
    check_dtypes(
        OP,
        spec,
        &[
            ("residual", residual),
            ("w", w),
            ("q", q),
            ("K pool", &kv.k),
            ("V pool", &kv.v),
        ],
    )?;
    if let Some(x) = bias {
        check_dtypes(OP, spec, &[("bias", x)])?;
    }
    let src = sources::gemv_rope_source(spec.dtype);
    let f = b.function_of(&src.uri.clone(), ROPE_M[d.m - 1], 0, || Ok(src))?;
    let slots = super::layer::slot_rows(b, append, &layout)?;
    let (pos, freq) = super::layer::rope_args(b, rope)?;
    let cfg = LaunchConfig {
        // One row pair (a rotated pair of q or k, or two v rows) per block.
        grid_dim: ((d.n / 2) as u32, 1, 1),
        block_dim: (GEMV_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n, k) = (i32_of(d.n, "N", spec)?, i32_of(d.k, "K", spec)?);
    let heads = [
        i32_of(g.num_heads, "heads", spec)?,
        i32_of(g.num_kv_heads, "kv heads", spec)?,
        i32_of(g.head_dim, "head_dim", spec)?,
    ];
    let (rp, wp, bp, qp) = (b.ptr(residual), b.ptr(w), bias.map_or(0, |x| b.ptr(x)), b.ptr(q));
    let (kp, vp) = (b.ptr(&kv.k), b.ptr(&kv.v));
    let mut l = Launch::chained(b, &f);
    l.arg(&rp).arg(&wp).arg(&n).arg(&k).arg(&eps);
    l.arg(&bp).arg(&qp).arg(&kp).arg(&vp).arg(&pos).arg(&freq).arg(&slots);
    l.arg(&heads[0]).arg(&heads[1]).arg(&heads[2]);
    // SAFETY: residual covers [M, K], w [N, K], q [M, H·D], the bias N elements (checked above);
    // every slot row lies in the pools (append.validate); positions (M i32), inv_freq (D/2 f32)
    // and the slots are in the layer scratch; one row group per rotated pair or v pair.
    unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {OP} {spec}")))?;
    b.check_launch(&format!("{OP} {spec} at {}", d.label()))
}

fn check_eps(op: &str, spec: &GemmSpec, eps: f32) -> Result<()> {
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        Err(FdppError::InvalidArgument(format!(
            "{op} {spec}: eps = {eps} (must be finite and > 0)"
        )))
    }
}

/// residual = round(residual + round(x · Wᵀ)), bit for bit gemv into a temporary followed by
/// add_rmsnorm's residual add.
pub fn residual_out(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    residual: &mut CudaBuffer,
) -> Result<()> {
    const OP: &str = "gemm_residual_out";
    check_supported(OP, spec, &d)?;
    d.check_lens(spec, x.len(), w.len(), residual.len())?;
    check_dtypes(OP, spec, &[("x", x), ("w", w), ("residual", residual)])?;
    let (n, k) = (i32_of(d.n, "N", spec)?, i32_of(d.k, "K", spec)?);
    let f = b.function_of(&spec.uri(), RES_M[d.m - 1], 0, || source(spec))?;
    let (xp, wp, rp) = (b.ptr(x), b.ptr(w), b.ptr(residual));
    let mut l = Launch::chained(b, &f);
    l.arg(&xp).arg(&wp).arg(&rp).arg(&n).arg(&k);
    // SAFETY: x covers [M, K], w [N, K], residual [M, N] (checked above), 16-byte aligned; each
    // residual element is read and written by one thread.
    unsafe { l.launch(config(spec, &d)) }.map_err(drv(&format!("launch {OP} {spec}")))?;
    b.check_launch(&format!("{OP} {spec} at {}", d.label()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn only_gemv_at_small_m_and_aligned_k_is_fused() {
        let gemv = GemmSpec::new(GemmImpl::Gemv, DType::F16).with_block_n(1);
        let ok = |spec: &GemmSpec, m, n, k| check_supported("op", spec, &GemmDims::new(m, n, k).expect("dims"));
        for m in 1..=MAX_M {
            assert!(ok(&gemv, m, 4096, 4096).is_ok(), "M = {m}");
        }
        assert!(ok(&gemv, 1, 7, 24).is_ok());
        for (m, k) in [(9, 4096), (1, 4100), (8, 4097)] {
            let e = ok(&gemv, m, 4096, k).expect_err("unsupported");
            assert!(matches!(e, FdppError::Unsupported { .. }), "{e}");
        }
        for imp in [GemmImpl::FlatGemm, GemmImpl::Gemm] {
            let e = ok(&GemmSpec::new(imp, DType::F16), 1, 4096, 4096).expect_err("not gemv");
            assert!(e.to_string().contains("only the gemv"), "{e}");
        }
    }

    #[test]
    fn the_fused_entry_points_are_in_the_gemv_source() {
        let spec = GemmSpec::new(GemmImpl::Gemv, DType::Bf16).with_block_n(4);
        let src = sources::gemm_source(&spec).expect("gemv source");
        for name in RMS_M.iter().chain(RES_M.iter()).chain(GLU_M.iter()) {
            assert!(src.text.contains(&name[..name.len() - 1]), "{name}");
        }
        // The GLU entries are compiled only in their own build, with two rows per warp.
        let glu = sources::gemv_glu_source(DType::F16);
        for (k, v) in [("FDPP_GLU_OFF", "0"), ("FDPP_ROWS", "2"), ("FDPP_KSPLIT", "4")] {
            assert!(glu.defines.iter().any(|(a, b)| a == k && b == v), "{k}={v}");
        }
        assert!(!src.defines.iter().any(|(a, _)| a == "FDPP_GLU_OFF"));
        // The rotary entries are in their own source, which inlines gemv.cu for its helpers.
        let rope = sources::gemv_rope_source(DType::F16);
        for name in ROPE_M {
            assert!(rope.text.contains(&name[..name.len() - 1]), "{name}");
        }
        assert!(rope.text.contains("gemv_vec") && !rope.text.contains("#include \"gemv.cu\""));
    }
}
