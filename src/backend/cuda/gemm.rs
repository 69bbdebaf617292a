//! Launching the three GEMM implementations on CUDA (ImplC: cuBLAS, a cuBLASLt rank, or on
//! sm_90a fdpp's own wgmma GEMM, gemm_hopper.rs).

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{sys, LaunchConfig};

use super::launch::Launch;
use super::sources::{self, flat_smem_bytes, flat_stages, FLAT_WARPS, GEMV_WARPS};
use super::{drv, CudaBackend, CudaBuffer};
use crate::backend::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};

/// gemv entry points by rows of x (the kernels hold M rows of accumulators in registers).
const GEMV_M: [&str; 8] = [
    "gemv_m1", "gemv_m2", "gemv_m3", "gemv_m4", "gemv_m5", "gemv_m6", "gemv_m7", "gemv_m8",
];

/// The 16-byte vector paths need every row of x and W to start on a 16-byte boundary.
pub(crate) fn vec_ok(d: &GemmDims) -> bool {
    d.k.is_multiple_of(8)
}

pub(crate) fn i32_of(v: usize, what: &str, spec: &GemmSpec) -> Result<i32> {
    i32::try_from(v).map_err(|_| FdppError::Unsupported {
        spec: spec.uri(),
        what: format!("{what} = {v} (over i32)"),
    })
}

/// M, N and K as the kernels' and cuBLAS's i32 arguments.
pub(crate) fn mnk_i32(d: &GemmDims, spec: &GemmSpec) -> Result<(i32, i32, i32)> {
    Ok((
        i32_of(d.m, "M", spec)?,
        i32_of(d.n, "N", spec)?,
        i32_of(d.k, "K", spec)?,
    ))
}

pub fn run(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    d.check_lens(spec, x.len(), w.len(), y.len())?;
    if x.dtype() != spec.dtype || w.dtype() != spec.dtype || y.dtype() != spec.dtype {
        return Err(FdppError::InvalidArgument(format!(
            "{spec}: buffers are not all {}",
            spec.dtype
        )));
    }
    match spec.imp {
        GemmImpl::Gemv => gemv(b, spec, d, x, w, y),
        GemmImpl::FlatGemm => flat(b, spec, d, x, w, y),
        GemmImpl::Gemm if spec.is_hopper_gemm() => super::gemm_hopper::run(b, spec, d, x, w, y),
        GemmImpl::Gemm => match spec.algo {
            None => cublas(b, spec, d, x, w, y),
            Some(rank) => {
                if super::blaslt::matmul(b, spec, rank, d, x, w, y)? {
                    Ok(())
                } else {
                    cublas(b, spec, d, x, w, y)
                }
            }
        },
    }?;
    b.check_launch(&format!("{spec} at {}", d.label()))
}

fn gemv(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    let uri = spec.uri();
    let src = || sources::gemm_source(spec).ok_or_else(|| FdppError::device("cuda", format!("{spec}: no source")));
    let (rows, ksplit) = sources::gemv_layout(spec.block_n.unwrap_or(8));
    let rows_per_block = rows * GEMV_WARPS / ksplit;
    let (n, k) = (i32_of(d.n, "N", spec)?, i32_of(d.k, "K", spec)?);
    let cfg = LaunchConfig {
        grid_dim: (d.n.div_ceil(rows_per_block as usize) as u32, 1, 1),
        block_dim: (GEMV_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (xp, wp, yp) = (b.ptr(x), b.ptr(w), b.ptr(y));
    // The kernels hold M rows of accumulators in registers: M is taken 8 rows at a time.
    let mut m0 = 0;
    while m0 < d.m {
        let mm = (d.m - m0).min(8);
        let xo = xp + (2 * m0 * d.k) as u64;
        let yo = yp + (2 * m0 * d.n) as u64;
        if vec_ok(&d) {
            let f = b.function_of(&uri, GEMV_M[mm - 1], 0, src)?;
            let mut l = Launch::chained(b, &f);
            l.arg(&xo).arg(&wp).arg(&yo).arg(&n).arg(&k);
            // SAFETY: pointers cover [M, K], [N, K], [M, N] (checked above); grid matches the kernel.
            unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {spec}")))?;
        } else {
            let f = b.function_of(&uri, "gemv_scalar", 0, src)?;
            let mm32 = mm as i32;
            let mut l = Launch::chained(b, &f);
            l.arg(&xo).arg(&wp).arg(&yo).arg(&mm32).arg(&n).arg(&k);
            // SAFETY: as above.
            unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {spec}")))?;
        }
        m0 += mm;
    }
    Ok(())
}

fn flat(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    let bn = spec.block_n.unwrap_or(64);
    let mt = sources::flat_mt(d.m);
    let smem = flat_smem_bytes(bn, mt, flat_stages(spec));
    if smem > b.max_smem_per_block() {
        return Err(FdppError::Unsupported {
            spec: spec.uri(),
            what: format!(
                "M = {} ({} KiB of shared memory, the device allows {} KiB)",
                d.m,
                smem >> 10,
                b.max_smem_per_block() >> 10
            ),
        });
    }
    let name = format!("flat_gemm_mt{mt}_{}", if vec_ok(&d) { "v" } else { "s" });
    let f = b.function_of(&spec.uri(), &name, smem, || {
        sources::gemm_source(spec).ok_or_else(|| FdppError::device("cuda", format!("{spec}: no source")))
    })?;
    let (m, n, k) = mnk_i32(&d, spec)?;
    let cfg = LaunchConfig {
        grid_dim: (
            d.n.div_ceil(bn as usize) as u32,
            d.m.div_ceil(8 * mt as usize) as u32,
            1,
        ),
        block_dim: (32 * FLAT_WARPS, 1, 1),
        shared_mem_bytes: smem,
    };
    let (xp, wp, yp) = (b.ptr(x), b.ptr(w), b.ptr(y));
    let mut l = Launch::chained(b, &f);
    l.arg(&xp).arg(&wp).arg(&yp).arg(&m).arg(&n).arg(&k);
    // SAFETY: pointers cover [M, K], [N, K], [M, N]; smem matches the kernel's layout.
    unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {spec}")))?;
    Ok(())
}

/// ImplC: cublasGemmEx, fp32 accumulation. Row-major y[M,N] = x[M,K]·W[N,K]ᵀ is, in cuBLAS's
/// column-major terms, yᵀ[N,M] = W·xᵀ: op(A) = Aᵀ with A = W (K×N, ld K), B = x (K×M, ld K).
fn cublas(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    let ty = match spec.dtype {
        DType::F16 => sys_dt(blas_sys::cudaDataType_t::CUDA_R_16F),
        DType::Bf16 => sys_dt(blas_sys::cudaDataType_t::CUDA_R_16BF),
    };
    let (m, n, k) = mnk_i32(&d, spec)?;
    let (alpha, beta) = (1f32, 0f32);
    let (xp, wp, yp) = (b.ptr(x), b.ptr(w), b.ptr(y));
    // SAFETY: pointers cover the operands (checked in run); scalars are host f32 as the compute
    // type requires.
    unsafe {
        blas::gemm_ex(
            *b.blas().handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            n,
            m,
            k,
            &alpha as *const f32 as *const _,
            wp as *const _,
            ty,
            k,
            xp as *const _,
            ty,
            k,
            &beta as *const f32 as *const _,
            yp as *mut _,
            ty,
            n,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| FdppError::device("cuda", format!("cublasGemmEx {spec} at {}: {e:?}", d.label())))
}

fn sys_dt(t: blas_sys::cudaDataType_t) -> blas_sys::cudaDataType {
    t
}

/// Raise a kernel's dynamic shared-memory limit past the 48 KiB default.
pub(crate) fn set_smem(f: &cudarc::driver::CudaFunction, bytes: u32) -> Result<()> {
    if bytes > 48 * 1024 {
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(drv("cuFuncSetAttribute(max dynamic smem)"))?;
    }
    Ok(())
}
