//! ImplC `gemm` on the CPU: the general cache-blocked GEMM (matrixmultiply's sgemm, which packs
//! panels and picks an AVX/FMA kernel at run time), fed with W widened a block of rows at a time.
//! This is the CPU's stand-in for cuBLAS, the path FlashDecoding++ §4 keeps for large M.

use rayon::prelude::*;

use super::simd::widen;

use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Rows of W per block when the spec names none. 256 rows of K = 4096 are 4 MiB of f32: large
/// enough for sgemm to run at speed, and N = 11008 still gives 43 blocks to share between cores.
pub(super) const DEFAULT_BLOCK_ROWS: usize = 256;

/// `out_t` is y transposed, [N, M]; `xf` is x widened, [M, K]; `w` holds at least N·K bits.
pub(super) fn gemm(dt: DType, d: GemmDims, xf: &[f32], w: &[u16], out_t: &mut [f32], block_rows: usize) {
    let (m, k) = (d.m, d.k);
    out_t.par_chunks_mut(block_rows * m).enumerate().for_each_init(
        || vec![0f32; block_rows * k],
        |wf, (task, out)| {
            let n0 = task * block_rows;
            let rows = out.len() / m;
            let wf = &mut wf[..rows * k];
            widen(dt, &w[n0 * k..(n0 + rows) * k], wf);
            sgemm_block(m, k, rows, xf, wf, out);
        },
    );
}

/// out_t[r, i] = Σ_k x[i, k] · wf[r, k] for a block of `rows` rows of W.
fn sgemm_block(m: usize, k: usize, rows: usize, xf: &[f32], wf: &[f32], out: &mut [f32]) {
    // The operands are checked here so that the unchecked pointer arithmetic of sgemm stays
    // inside them; sizes come from GemmDims, which the caller has validated.
    assert!(xf.len() >= m * k && wf.len() >= rows * k && out.len() >= rows * m);
    let (ik, im) = (k as isize, m as isize);
    // SAFETY: sgemm reads A = x as an M×K matrix with strides (K, 1): elements up to (M−1)·K +
    // K−1 < len(xf). It reads B = Wᵀ as K×rows with strides (1, K): W [rows, K] row-major read
    // column by column, elements up to (K−1) + (rows−1)·K < len(wf). It writes C as M×rows with
    // strides (1, M), i.e. the [rows, M] layout of out_t, elements up to (M−1) + (rows−1)·M <
    // len(out). With beta = 0, C is written without being read.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            rows,
            1.0,
            xf.as_ptr(),
            ik,
            1,
            wf.as_ptr(),
            1,
            ik,
            0.0,
            out.as_mut_ptr(),
            1,
            im,
        );
    }
}
