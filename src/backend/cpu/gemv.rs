//! ImplA `gemv` on the CPU: one dot product per output element, each weight row widened once and
//! reused for every row of x (FlashDecoding++ §4: at small M the op is a GEMV bound by reading W,
//! so W must be read exactly once however many rows x has).

use rayon::prelude::*;

use super::simd::{dot, multiversion, Vf32};
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Rows of W per rayon task when the spec names none: enough work per task (64 rows of K
/// elements) to hide the scheduling cost, small enough that N = 1000 still splits across cores.
pub(super) const DEFAULT_ROWS_PER_TASK: usize = 64;

/// `out_t` is y transposed, [N, M]: each task owns a contiguous run of rows of W and the
/// matching contiguous run of `out_t`. `xf` is x widened, [M, K]; `w` holds N·K bits.
pub(super) fn gemv(dt: DType, d: GemmDims, xf: &[f32], w: &[u16], out_t: &mut [f32], rows_per_task: usize) {
    let (m, k) = (d.m, d.k);
    out_t.par_chunks_mut(rows_per_task * m).enumerate().for_each_init(
        || vec![0f32; k],
        |wrow, (task, out)| {
            let n0 = task * rows_per_task;
            let rows = out.len() / m;
            task_rows(dt, xf, &w[n0 * k..(n0 + rows) * k], wrow, out);
        },
    );
}

multiversion! {
    /// For each row r of `w_rows` ([rows, K]): widen it into `wrow`, then
    /// out[r, i] = x_i · wrow for every row i of x.
    fn task_rows(dt: DType, xf: &[f32], w_rows: &[u16], wrow: &mut [f32], out: &mut [f32]) => task_rows_generic
}

#[inline(always)]
fn task_rows_generic<V: Vf32>(dt: DType, xf: &[f32], w_rows: &[u16], wrow: &mut [f32], out: &mut [f32]) {
    let k = wrow.len();
    let m = xf.len() / k;
    for (w_row, y_col) in w_rows.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
        V::widen(dt, w_row, wrow);
        for (y, xrow) in y_col.iter_mut().zip(xf.chunks_exact(k)) {
            *y = dot::<V>(xrow, wrow);
        }
    }
}
