//! Checking one GEMM candidate's output against the f64 reference before it may be timed.
//!
//! A full f64 reference of a [2048, 22016] output takes minutes on the host, so the check samples
//! output columns (every row of them): the first and last columns (edge tiles), evenly spaced
//! ones (every tile), and pseudo-random ones (offsets inside tiles). Reference rows do not depend
//! on M, so a [`Verifier`] computes them once for the largest M of a sweep and serves every M.
//! The output is poisoned before each run: an element the kernel never wrote reads as NaN and
//! fails, and any change to the rows at or past M (the kernel wrote outside its output) fails.

use std::collections::BTreeSet;

use rayon::prelude::*;

use crate::backend::Backend;
use crate::bench::GemmInputs;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};
use crate::reference::gemm::{gemm_ref_cols, nmse};

/// Output columns checked per candidate and M.
pub const DEFAULT_SAMPLE_COLS: usize = 256;

/// `count` distinct output columns of `n`, sorted: always 0 and n−1, half evenly spaced, the
/// rest pseudo-random from a fixed seed (the same columns on every run). All of them if count ≥ n.
pub fn sample_columns(n: usize, count: usize) -> Vec<usize> {
    if n == 0 || count == 0 {
        return vec![];
    }
    if count >= n {
        return (0..n).collect();
    }
    let mut set = BTreeSet::new();
    set.insert(0);
    set.insert(n - 1);
    let even = (count / 2).max(2);
    for i in 0..even {
        set.insert(i * (n - 1) / (even - 1));
    }
    // splitmix64: a fixed, dependency-free sequence.
    let mut state: u64 = 0x5EED_F00D_u64 ^ (n as u64);
    while set.len() < count {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        set.insert((z % n as u64) as usize);
    }
    set.into_iter().collect()
}

/// f64 reference of the sampled columns for the leading `rows` rows of one [`GemmInputs`].
pub struct Verifier {
    pub cols: Vec<usize>,
    rows: usize,
    /// [rows, cols.len()] row-major.
    reference: Vec<f64>,
}

impl Verifier {
    /// Reference for rows 0..rows of `inputs.x0` against `inputs.w0` (rows ≤ inputs.max_m).
    pub fn new<B: Backend>(inputs: &GemmInputs<B>, rows: usize, sample_cols: usize) -> Result<Self> {
        if rows == 0 || rows > inputs.max_m {
            return Err(FdppError::InvalidArgument(format!(
                "verifier rows {rows} outside 1..={} (inputs [N={}, K={}])",
                inputs.max_m, inputs.n, inputs.k
            )));
        }
        let (n, k, dt) = (inputs.n, inputs.k, inputs.dtype);
        let cols = sample_columns(n, sample_cols);
        let (x0, w0) = (&inputs.x0[..], &inputs.w0[..]);
        // Rows are independent: spread them over threads, 8 at a time.
        const CHUNK: usize = 8;
        let parts: Vec<Vec<f64>> = (0..rows.div_ceil(CHUNK))
            .into_par_iter()
            .map(|c| {
                let r0 = c * CHUNK;
                let r1 = (r0 + CHUNK).min(rows);
                let d = GemmDims { m: r1 - r0, n, k };
                gemm_ref_cols(dt, d, &x0[r0 * k..r1 * k], w0, &cols)
            })
            .collect();
        Ok(Verifier {
            cols,
            rows,
            reference: parts.concat(),
        })
    }

    /// Run `spec` once at M rows on the first input copy, download the output and compare the
    /// sampled columns with the reference. Ok(NMSE) when within `dtype.nmse_limit()`; otherwise
    /// `WrongResult` (or `WroteOutside`); the candidate's own error (e.g. `Unsupported`) passes
    /// through unchanged.
    pub fn check<B: Backend>(&self, b: &B, inputs: &mut GemmInputs<B>, spec: &GemmSpec, m: usize) -> Result<f64> {
        if m == 0 || m > self.rows || m > inputs.max_m {
            return Err(FdppError::InvalidArgument(format!(
                "verify {spec} at M={m}: outside the verified rows 1..={}",
                self.rows.min(inputs.max_m)
            )));
        }
        let (n, k, dt) = (inputs.n, inputs.k, inputs.dtype);
        let dims = GemmDims::new(m, n, k)?;
        let poison = dt.poison();
        b.fill(&mut inputs.y, poison)?;
        b.gemm(spec, dims, &inputs.xs[0], &inputs.ws[0], &mut inputs.y)?;
        b.synchronize()?;
        let y = b.download(&inputs.y)?;
        let shape = dims.label();
        if y.len() < m * n {
            return Err(FdppError::Shape {
                what: format!("{spec} output at {shape}"),
                expected: format!(">= {} elements", m * n),
                found: y.len().to_string(),
            });
        }
        if let Some(pos) = y[m * n..].iter().position(|&v| v != poison) {
            let idx = m * n + pos;
            return Err(FdppError::WroteOutside {
                spec: spec.uri(),
                shape,
                what: format!(
                    "row {} col {} of a {}-row buffer changed",
                    idx / n,
                    idx % n,
                    y.len() / n
                ),
            });
        }
        let nc = self.cols.len();
        let mut got = Vec::with_capacity(m * nc);
        for r in 0..m {
            for &c in &self.cols {
                got.push(dt.to_f32(y[r * n + c]) as f64);
            }
        }
        let err = nmse(&got, &self.reference[..m * nc]);
        let limit = dt.nmse_limit();
        // NaN fails too.
        if err.is_nan() || err > limit {
            return Err(FdppError::WrongResult {
                spec: spec.uri(),
                shape,
                nmse: err,
                limit,
            });
        }
        Ok(err)
    }
}

/// One-off check of `spec` at M rows (for `fdpp bench gemm`): builds the reference for M rows
/// and verifies. Sweeps over many M should build one [`Verifier`] for the largest M instead.
pub fn verify_gemm<B: Backend>(b: &B, inputs: &mut GemmInputs<B>, spec: &GemmSpec, m: usize) -> Result<f64> {
    Verifier::new(inputs, m, DEFAULT_SAMPLE_COLS)?.check(b, inputs, spec, m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::hooked::HookedCpu;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::Backend;
    use crate::dtype::DType;
    use crate::ops::gemm::GemmImpl;

    #[test]
    fn columns_include_edges_and_are_distinct() {
        let c = sample_columns(11008, 256);
        assert_eq!(c.len(), 256);
        assert_eq!(c[0], 0);
        assert_eq!(*c.last().unwrap(), 11007);
        assert!(c.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(c, sample_columns(11008, 256), "deterministic");
    }

    #[test]
    fn columns_small_n() {
        assert_eq!(sample_columns(5, 256), vec![0, 1, 2, 3, 4]);
        assert_eq!(sample_columns(1, 3), vec![0]);
        assert!(sample_columns(0, 3).is_empty());
        let c = sample_columns(300, 256);
        assert_eq!(c.len(), 256);
        assert!(c.iter().all(|&x| x < 300));
        assert_eq!(sample_columns(1000, 2), vec![0, 999]);
    }

    #[test]
    fn correct_candidate_passes() {
        let b = CpuBackend::new();
        for dt in [DType::F16, DType::Bf16] {
            let mut inp = GemmInputs::new(&b, dt, 300, 97, 9, 1 << 20, 7).unwrap();
            let v = Verifier::new(&inp, 9, 64).unwrap();
            for m in [1, 4, 9] {
                let e = v.check(&b, &mut inp, &GemmSpec::new(GemmImpl::Gemm, dt), m).unwrap();
                assert!(e < dt.nmse_limit(), "{dt} M={m}: {e}");
            }
            let e = verify_gemm(&b, &mut inp, &GemmSpec::new(GemmImpl::Gemv, dt), 3).unwrap();
            assert!(e < dt.nmse_limit());
        }
    }

    #[test]
    fn m_outside_the_reference_is_an_error() {
        let b = CpuBackend::new();
        let mut inp = GemmInputs::new(&b, DType::F16, 16, 16, 4, 1 << 20, 1).unwrap();
        assert!(Verifier::new(&inp, 5, 8).is_err());
        let v = Verifier::new(&inp, 2, 8).unwrap();
        let spec = GemmSpec::new(GemmImpl::Gemm, DType::F16);
        assert!(v.check(&b, &mut inp, &spec, 3).is_err());
        assert!(v.check(&b, &mut inp, &spec, 0).is_err());
    }

    fn check_with(damage: fn(&mut Vec<u16>, GemmDims), m: usize) -> Result<f64> {
        // The CPU backend, then the output damaged as told.
        let b = HookedCpu::new(move |inner, spec, d, x, w, y| {
            inner.gemm(spec, d, x, w, y)?;
            damage(&mut y.data, d);
            Ok(())
        });
        let mut inp = GemmInputs::new(&b, DType::F16, 200, 64, 6, 1 << 20, 3)?;
        let v = Verifier::new(&inp, 6, 32)?;
        v.check(&b, &mut inp, &GemmSpec::new(GemmImpl::FlatGemm, DType::F16), m)
    }

    #[test]
    fn wrong_last_column_is_caught() {
        let e = check_with(
            |y, d| {
                for r in 0..d.m {
                    y[r * d.n + d.n - 1] = DType::F16.from_f32(3.0);
                }
            },
            4,
        )
        .unwrap_err();
        assert!(matches!(e, FdppError::WrongResult { .. }), "{e}");
    }

    #[test]
    fn unwritten_element_is_caught() {
        let e = check_with(|y, d| y[(d.m - 1) * d.n] = DType::F16.poison(), 5).unwrap_err();
        assert!(matches!(e, FdppError::WrongResult { .. }), "{e}");
    }

    #[test]
    fn write_past_m_rows_is_caught() {
        let e = check_with(|y, d| y[d.m * d.n + 7] = 0, 3).unwrap_err();
        match e {
            FdppError::WroteOutside { what, .. } => assert!(what.contains("row 3 col 7"), "{what}"),
            other => panic!("expected WroteOutside, got {other}"),
        }
    }

    #[test]
    fn small_rounding_noise_passes() {
        // Flip the lowest mantissa bit of every output: well inside the f16 limit.
        check_with(
            |y, d| {
                for v in &mut y[..d.m * d.n] {
                    *v ^= 1;
                }
            },
            6,
        )
        .unwrap();
    }
}
