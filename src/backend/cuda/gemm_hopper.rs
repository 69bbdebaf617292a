//! ImplC's own form on Hopper: fdpp's wgmma GEMM (kernels_cuda/gemm_hopper.cu). A persistent
//! grid of 128 × B_N output tiles: a TMA producer warpgroup feeds a ring of K blocks to two
//! wgmma consumer warpgroups, whose results leave through shared memory and TMA stores while
//! the next tile's main loop runs. A spec of ImplC with `block_n` and `stages` names it (uri
//! `gemm_f16_bn256_s4`); `fdpp tune` times it beside cuBLAS and cuBLASLt's ranks, and the profile
//! keeps whichever wins per shape and M (reports/NOTES.md, session 31, `bench gemm` on an H200:
//! Llama2-7B's QKV, O and FFN2 at M = 1024 1.03×, 1.01× and 1.01× cublasGemmEx; at 4096
//! 0.96-1.02×; FFN1 0.87×, whose 128 × 256 tiles fill 5.2 of 6 waves).

use cudarc::driver::LaunchConfig;

use super::gemm::mnk_i32;
use super::launch::Launch;
use super::sources;
use super::tma;
use super::{drv, CudaBackend, CudaBuffer};
use crate::backend::Backend;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};

/// (B_N, stages) offered: 128 × 256 tiles with 4 stages, the fastest on every Llama2-7B shape;
/// 128 × 128 with 6 for shapes whose 256-wide tiles fill the last wave badly (Llama-3.1-8B's
/// QKV, N = 6144: 1.45 waves of 256-wide tiles on 132 SMs, 2.9 of 128-wide).
pub const TILES: &[(u32, u32)] = &[(256, 4), (128, 6)];
/// Rows of x per tile (two consumer warpgroups of 64) and K per stage (one 128-byte row).
const BM: u32 = 128;
const BK: u32 = 64;
/// Columns and rows of a staged output chunk (a TMA store box).
const CHUNK: u32 = 64;
/// A producer warpgroup and two consumer warpgroups (gemm_hopper.cu's THREADS).
const THREADS: u32 = 384;

/// Dynamic shared memory of a block, as gemm_hopper.cu's `smem_bytes` lays it out for the plain
/// product: the stages (x and W boxes), four staging buffers, the stages' barriers, the four
/// residual barriers and 1024 bytes of slack to align the base for the swizzle.
pub fn smem_bytes(bn: u32, stages: u32) -> u32 {
    stages * (BM * BK * 2 + bn * BK * 2) + 4 * CHUNK * CHUNK * 2 + 16 * stages + 32 + 1024
}

/// The specs of the kernel for one dtype, as `fdpp tune` and `fdpp check` offer them on sm_90a.
pub fn specs(dtype: crate::dtype::DType) -> Vec<GemmSpec> {
    TILES
        .iter()
        .map(|&(bn, st)| {
            GemmSpec::new(crate::ops::gemm::GemmImpl::Gemm, dtype)
                .with_block_n(bn)
                .with_stages(st)
        })
        .collect()
}

pub fn run(
    b: &CudaBackend,
    spec: &GemmSpec,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    let unsupported = |what: String| FdppError::Unsupported { spec: spec.uri(), what };
    let (bn, stages) = match (spec.block_n, spec.stages) {
        (Some(bn), Some(st)) if TILES.contains(&(bn, st)) => (bn, st),
        _ => {
            return Err(FdppError::InvalidArgument(format!(
                "{spec}: fdpp's Hopper GEMM is built for (block_n, stages) in {TILES:?}; re-run `fdpp tune`"
            )))
        }
    };
    if b.info().arch != super::prefill_hopper::ARCH {
        return Err(unsupported(format!(
            "arch {} (the wgmma kernel needs {}; cuBLAS runs ImplC elsewhere)",
            b.info().arch,
            super::prefill_hopper::ARCH
        )));
    }
    // TMA rows start on 16-byte boundaries: K and N multiples of 8 elements, buffers aligned.
    if !d.k.is_multiple_of(8) || !d.n.is_multiple_of(8) {
        return Err(unsupported(format!(
            "K = {} and N = {} (TMA needs both to be multiples of 8)",
            d.k, d.n
        )));
    }
    let (xp, wp, yp) = (b.ptr(x), b.ptr(w), b.ptr(y));
    if [xp, wp, yp].iter().any(|p| p % 16 != 0) {
        return Err(unsupported("a buffer not 16-byte aligned".into()));
    }
    let smem = smem_bytes(bn, stages);
    if smem > b.max_smem_per_block() {
        return Err(unsupported(format!(
            "{} KiB of shared memory (the device allows {} KiB)",
            smem >> 10,
            b.max_smem_per_block() >> 10
        )));
    }
    let (m, n, k) = mnk_i32(&d, spec)?;
    let xm = tma::matrix_map(xp, d.m, d.k, BM, BK, "x")?;
    let wm = tma::matrix_map(wp, d.n, d.k, bn, BK, "W")?;
    let ym = tma::matrix_map(yp, d.m, d.n, CHUNK, CHUNK, "y")?;
    let f = b.function_of(&spec.uri(), "gemm_hopper", smem, || {
        sources::gemm_source(spec).ok_or_else(|| FdppError::device("cuda", format!("{spec}: no source")))
    })?;
    let tiles = d.m.div_ceil(BM as usize) * d.n.div_ceil(bn as usize);
    let cfg = LaunchConfig {
        grid_dim: (tiles.min(b.info().compute_units as usize) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    // Plain: the kernel has no pdl_wait, so it must not start before its inputs are written.
    let mut l = Launch::plain(b, &f);
    l.arg(&xm).arg(&wm).arg(&ym).arg(&m).arg(&n).arg(&k);
    // SAFETY: the maps cover x [M, K], W [N, K] and y [M, N] (lengths checked in gemm::run); the
    // store clips to y's [M, N]; smem and the block match the kernel's layout.
    unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {spec}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tile_fits_the_227_kib_an_sm90a_block_may_opt_into() {
        for &(bn, st) in TILES {
            assert!(
                smem_bytes(bn, st) <= 227 * 1024,
                "bn {bn} s{st}: {}",
                smem_bytes(bn, st)
            );
        }
        // The kernel's own count for 128 × 256, 4 stages (gemm_hopper.cu smem_bytes).
        assert_eq!(smem_bytes(256, 4), 4 * 49152 + 32768 + 64 + 32 + 1024);
    }

    #[test]
    fn its_specs_are_implc_with_a_tile() {
        for s in specs(crate::dtype::DType::F16) {
            assert!(s.is_hopper_gemm());
            assert!(s.uri().starts_with("gemm_f16_bn"), "{}", s.uri());
        }
        assert!(!GemmSpec::new(crate::ops::gemm::GemmImpl::Gemm, crate::dtype::DType::F16).is_hopper_gemm());
    }
}
