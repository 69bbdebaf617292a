//! Reference y = x · Wᵀ in f64.
//!
//! Every input element is widened exactly (f16/bf16 → f32 → f64 loses nothing) and every product
//! and sum is taken in f64, so the only error left in the oracle is f64 rounding, far below what
//! a 16-bit output can show. The work is spread over output columns with rayon: it is the same
//! arithmetic in the same order whichever thread does it, so the result does not depend on the
//! number of threads.

use rayon::prelude::*;

use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Full reference output, row-major [M, N], in f64.
pub fn gemm_ref(dt: DType, d: GemmDims, x: &[u16], w: &[u16]) -> Vec<f64> {
    gemm_ref_cols(dt, d, x, w, &(0..d.n).collect::<Vec<_>>())
}

/// Reference for a subset of output columns: returns [M, cols.len()] row-major. Lets the tuner
/// verify every candidate at full size without an f64 GEMM of the whole shape.
///
/// Panics if `x` holds fewer than M·K elements, `w` fewer than N·K, or a column is ≥ N: callers
/// pass buffers they sized from `d` themselves.
pub fn gemm_ref_cols(dt: DType, d: GemmDims, x: &[u16], w: &[u16], cols: &[usize]) -> Vec<f64> {
    let (m, k) = (d.m, d.k);
    let xd = widen_f64(dt, &x[..m * k]);
    // Column-major while computing ([cols, M]): each task owns one column, which it fills from
    // one pass over that row of W. Transposed to [M, cols] at the end.
    let mut by_col = vec![0f64; cols.len() * m];
    by_col.par_chunks_mut(m).zip(cols.par_iter()).for_each_init(
        || vec![0f64; k],
        |wrow, (out, &n)| {
            for (o, &b) in wrow.iter_mut().zip(&w[n * k..(n + 1) * k]) {
                *o = dt.to_f32(b) as f64;
            }
            for (row, o) in out.iter_mut().enumerate() {
                *o = dot_f64(&xd[row * k..(row + 1) * k], wrow);
            }
        },
    );
    let mut out = vec![0f64; m * cols.len()];
    for (j, col) in by_col.chunks_exact(m).enumerate() {
        for (row, v) in col.iter().enumerate() {
            out[row * cols.len() + j] = *v;
        }
    }
    out
}

fn widen_f64(dt: DType, bits: &[u16]) -> Vec<f64> {
    bits.iter().map(|&b| dt.to_f32(b) as f64).collect()
}

/// f64 dot product with four running sums: the independent sums let the CPU overlap the adds
/// (a single sum is bound by add latency), at no cost in accuracy that an f16 output could see.
fn dot_f64(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 4];
    let ca = a.chunks_exact(4);
    let cb = b.chunks_exact(4);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (pa, pb) in ca.zip(cb) {
        for ((s, p), q) in acc.iter_mut().zip(pa).zip(pb) {
            *s += p * q;
        }
    }
    let mut tail = 0f64;
    for (p, q) in ra.iter().zip(rb) {
        tail += p * q;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::random_bits;

    #[test]
    fn nmse_of_exact_copy_is_zero() {
        let r: Vec<f64> = (0..100).map(|i| (i as f64 * 0.37).sin()).collect();
        assert_eq!(nmse(&r, &r), 0.0);
    }

    #[test]
    fn nmse_of_poisoned_output_is_infinite() {
        let r: Vec<f64> = (0..100).map(|i| (i as f64 * 0.37).cos()).collect();
        let poison = DType::F16.to_f32(DType::F16.poison()) as f64;
        for bad in [poison, f64::INFINITY, f64::NEG_INFINITY] {
            let mut o = r.clone();
            o[57] = bad;
            assert_eq!(nmse(&o, &r), f64::INFINITY, "output holding {bad}");
        }
    }

    #[test]
    fn nmse_measures_relative_error() {
        let r = vec![3.0, -4.0];
        // ‖(0.3, -0.4)‖² / ‖(3, -4)‖² = 0.25 / 25
        let o = vec![3.3, -4.4];
        assert!((nmse(&o, &r) - 0.01).abs() < 1e-12);
        // Any error against an all-zero reference is infinitely wrong.
        assert_eq!(nmse(&[1e-9], &[0.0]), f64::INFINITY);
    }

    #[test]
    fn reference_matches_a_hand_computed_product() {
        // x = [[1, 2, 3], [-1, 0.5, 2]], W = [[1, 0, -1], [2, 2, 2]]: y = x · Wᵀ.
        let dt = DType::Bf16;
        let enc = |v: &[f32]| v.iter().map(|&f| dt.from_f32(f)).collect::<Vec<_>>();
        let x = enc(&[1.0, 2.0, 3.0, -1.0, 0.5, 2.0]);
        let w = enc(&[1.0, 0.0, -1.0, 2.0, 2.0, 2.0]);
        let d = GemmDims::new(2, 2, 3).expect("nonzero dims");
        assert_eq!(gemm_ref(dt, d, &x, &w), vec![-2.0, 12.0, -3.0, 3.0]);
    }

    #[test]
    fn column_subset_equals_the_same_columns_of_the_full_reference() {
        let dt = DType::F16;
        let d = GemmDims::new(3, 37, 29).expect("nonzero dims");
        let x = random_bits(dt, d.m * d.k, 0.2, 1);
        let w = random_bits(dt, d.n * d.k, 1.0, 2);
        let full = gemm_ref(dt, d, &x, &w);
        let cols = [36, 0, 17, 5];
        let sub = gemm_ref_cols(dt, d, &x, &w, &cols);
        for m in 0..d.m {
            for (j, &n) in cols.iter().enumerate() {
                assert_eq!(sub[m * cols.len() + j], full[m * d.n + n]);
            }
        }
    }
}
