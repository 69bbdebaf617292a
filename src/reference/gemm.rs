//! Reference y = x · Wᵀ in f64.

use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Full reference output, row-major [M, N], in f64.
pub fn gemm_ref(dt: DType, d: GemmDims, x: &[u16], w: &[u16]) -> Vec<f64> {
    gemm_ref_cols(dt, d, x, w, &(0..d.n).collect::<Vec<_>>())
}

/// Reference for a subset of output columns: returns [M, cols.len()] row-major. Lets the tuner
/// verify every candidate at full size without an f64 GEMM of the whole shape.
pub fn gemm_ref_cols(dt: DType, d: GemmDims, x: &[u16], w: &[u16], cols: &[usize]) -> Vec<f64> {
    let mut out = vec![0f64; d.m * cols.len()];
    for (j, &n) in cols.iter().enumerate() {
        let wr = &w[n * d.k..(n + 1) * d.k];
        for m in 0..d.m {
            let xr = &x[m * d.k..(m + 1) * d.k];
            let mut acc = 0f64;
            for (a, b) in xr.iter().zip(wr) {
                acc += dt.to_f32(*a) as f64 * dt.to_f32(*b) as f64;
            }
            out[m * cols.len() + j] = acc;
        }
    }
    out
}

/// Normalised mean squared error ‖out − ref‖² / ‖ref‖². Any non-finite output gives +∞, so a
/// poisoned (unwritten) element can never pass.
pub fn nmse(out: &[f64], reference: &[f64]) -> f64 {
    let mut num = 0f64;
    let mut den = 0f64;
    for (o, r) in out.iter().zip(reference) {
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        num / den
    }
}
