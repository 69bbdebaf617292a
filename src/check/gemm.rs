//! GEMM checks: every candidate on every case, fresh random inputs per case, the output poisoned
//! before each run and followed by a guard region, the result judged against the f64 reference.

use super::{CheckRow, Status};
use crate::backend::Backend;
use crate::dtype::{random_bits, DType};
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};
use crate::reference::gemm::{gemm_ref, nmse};

/// Elements past the end of y, filled with poison before each run and checked afterwards: a
/// kernel that writes out of bounds (a ragged last tile) changes them.
pub const GUARD_ELEMS: usize = 256;

/// One GEMM to check: its dims and element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmCase {
    pub dims: GemmDims,
    pub dtype: DType,
}

/// (N, K) pairs of the full list: Llama2-7B's FFN1 and FFN2 shapes (11008 × 4096, 4096 × 11008),
/// then odd sizes that leave a ragged edge on every tile: N = 5504 and 1000, K = 4097 (one past
/// a power of two, so every K block is full but the last, which holds one element), and a small
/// N = 133, K = 1031 (prime-ish: no B_N, NR or lane width divides them).
const FULL_NK: [(usize, usize); 5] = [(11008, 4096), (5504, 4097), (1000, 4097), (4096, 11008), (133, 1031)];
/// M of the full list: 1 (GEMV), 3 and 17 (odd, ragged in every register block), 8 (the M
/// flat_gemm pads to on tensor cores, FlashDecoding++ §3), 41 (flat_gemm's 64-row block with
/// three n8-tiles past M) and 70 (two blocks along M, the second holding 6 rows).
const FULL_M: [usize; 6] = [1, 3, 8, 17, 41, 70];
/// Prefill-sized cases for the GEMMs of 128-row tiles (fdpp's Hopper GEMM; cuBLAS): several M
/// tiles with a ragged last one (333 = 2·128 + 77, 1000 = 7·128 + 104, 130 = 128 + 2), N with a
/// ragged last 256- and 128-wide tile (1000, 4104 = 16·256 + 8), K with a partial last 64-wide
/// block (1032, 264; multiples of 8, which TMA needs) and one full Llama shape (4096 × 4096).
const PREFILL_MNK: [(usize, usize, usize); 3] = [(333, 1000, 1032), (1000, 4104, 264), (130, 4096, 4096)];

/// The reduced list for `cargo test` and `fdpp check --quick`, small enough for a debug build
/// (about 10 M multiply-adds per dtype) yet with every ragged edge: N = 1000 (no B_N of 16 or 64
/// divides it), N = 133 and 67 (ragged in the NR = 4 register block too), K = 263 and 1031 (a
/// tail shorter than one 8-lane chunk after full K blocks), K = 4097 (a last K block of one
/// element), odd M = 1, 3, 17, 41, 70 and M = 8.
const QUICK_MNK: [(usize, usize, usize); 8] = [
    (1, 1000, 263),
    (17, 1000, 263),
    (3, 133, 1031),
    (17, 133, 1031),
    (1, 67, 4097),
    (8, 67, 4097),
    (41, 133, 1031),
    (70, 67, 263),
];

/// Every case of `fdpp check`: each M × (N, K), then the prefill-sized cases, in f16 and bf16.
pub fn gemm_cases() -> Vec<GemmCase> {
    let mnk: Vec<_> = FULL_NK
        .iter()
        .flat_map(|&(n, k)| FULL_M.iter().map(move |&m| (m, n, k)))
        .chain(PREFILL_MNK)
        .collect();
    cases_of(&mnk)
}

/// The reduced list ([`QUICK_MNK`]) in f16 and bf16.
pub fn gemm_cases_quick() -> Vec<GemmCase> {
    cases_of(&QUICK_MNK)
}

fn cases_of(mnk: &[(usize, usize, usize)]) -> Vec<GemmCase> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::Bf16] {
        for &(m, n, k) in mnk {
            // All dims are nonzero constants, so this never skips a case.
            if let Ok(dims) = GemmDims::new(m, n, k) {
                out.push(GemmCase { dims, dtype });
            }
        }
    }
    out
}

/// Run every spec on every case of the same dtype (a spec of another dtype has nothing to say
/// about the case and gets no row) and judge the outputs.
///
/// Per case: fresh inputs from a seed derived from `seed` and the case's index (x scaled by
/// 1/√K so outputs stay O(1) in f16 at any K), one f64 reference over all M × N outputs
/// (`gemm_ref`, parallel over columns; every column is checked, so a single wrong element
/// anywhere is seen). Per spec: y holds M·N + [`GUARD_ELEMS`] elements, all poisoned; after the
/// run every output must be finite (the poison is NaN, so an element never written fails), the
/// guard must still be poison, and the NMSE must be within `dtype.nmse_limit()`.
///
/// A spec that returns `Unsupported` is recorded as skipped; any other error from the run is a
/// failure of that spec. Errors moving data to or from the backend end the check (`Err`).
pub fn check_gemm<B: Backend>(b: &B, specs: &[GemmSpec], cases: &[GemmCase], seed: u64) -> Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    for (ci, case) in cases.iter().enumerate() {
        let specs: Vec<&GemmSpec> = specs.iter().filter(|s| s.dtype == case.dtype).collect();
        if specs.is_empty() {
            continue;
        }
        let (d, dt) = (case.dims, case.dtype);
        let case_seed = splitmix64(seed.wrapping_add(ci as u64));
        let x = random_bits(dt, d.m * d.k, 1.0 / (d.k as f32).sqrt(), splitmix64(case_seed));
        let w = random_bits(dt, d.n * d.k, 1.0, splitmix64(case_seed ^ 1));
        let xb = b.upload(dt, &x)?;
        // W as the engine holds a layer's linear: in the backend's prepared layout.
        let mut wb = b.upload(dt, &w)?;
        b.prepare_linear_weight(&mut wb, d.n, d.k)?;
        let mut yb = b.alloc(dt, d.m * d.n + GUARD_ELEMS)?;
        let mut reference: Option<Vec<f64>> = None;
        for spec in specs {
            b.fill(&mut yb, dt.poison())?;
            let ran = b.gemm(spec, d, &xb, &wb, &mut yb).and_then(|()| b.synchronize());
            let mut row = CheckRow {
                backend: b.info().backend,
                op: "gemm".into(),
                spec: spec.uri(),
                dims: d,
                dtype: dt,
                nmse: None,
                max_rel_err: None,
                status: Status::Pass,
            };
            match ran {
                Err(e @ FdppError::Unsupported { .. }) => row.status = Status::Skipped(e.to_string()),
                Err(e) => row.status = Status::Fail(format!("run failed: {e}")),
                Ok(()) => {
                    let out = b.download(&yb)?;
                    let r = reference.get_or_insert_with(|| gemm_ref(dt, d, &x, &w));
                    judge(dt, d, &out, r, &mut row);
                }
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Fill in the row's measures and status from the downloaded y (outputs then guard).
fn judge(dt: DType, d: GemmDims, out: &[u16], reference: &[f64], row: &mut CheckRow) {
    let len = d.m * d.n;
    if out.len() != len + GUARD_ELEMS {
        row.status = Status::Fail(format!(
            "download returned {} elements, expected {}",
            out.len(),
            len + GUARD_ELEMS
        ));
        return;
    }
    let (y, guard) = out.split_at(len);
    let y: Vec<f64> = y.iter().map(|&b| dt.to_f32(b) as f64).collect();
    let err = nmse(&y, reference);
    row.nmse = Some(err);

    let scale = reference.iter().fold(0f64, |a, r| a.max(r.abs()));
    let worst = y.iter().zip(reference).map(|(o, r)| (o - r).abs()).fold(0f64, f64::max);
    let non_finite: Vec<usize> = (0..len).filter(|&i| !y[i].is_finite()).collect();
    row.max_rel_err = Some(if non_finite.is_empty() {
        worst / scale.max(f64::MIN_POSITIVE)
    } else {
        f64::INFINITY
    });

    let guard_hit: Vec<usize> = (0..GUARD_ELEMS).filter(|&i| guard[i] != dt.poison()).collect();
    row.status = if let Some(&first) = non_finite.first() {
        Status::Fail(format!(
            "{} of {len} outputs not finite (never written?), first at m={} n={}",
            non_finite.len(),
            first / d.n,
            first % d.n
        ))
    } else if let Some(&first) = guard_hit.first() {
        Status::Fail(format!(
            "wrote past the end of y: {} of {GUARD_ELEMS} guard elements changed, first at y[{}]",
            guard_hit.len(),
            len + first
        ))
    } else if err > dt.nmse_limit() {
        let (at, _) = y
            .iter()
            .zip(reference)
            .map(|(o, r)| (o - r).abs())
            .enumerate()
            .fold((0, -1f64), |best, (i, e)| if e > best.1 { (i, e) } else { best });
        Status::Fail(format!(
            "NMSE {err:.3e} > {:.1e}; worst at m={} n={}: {} vs reference {:.6}",
            dt.nmse_limit(),
            at / d.n,
            at % d.n,
            y[at],
            reference[at]
        ))
    } else {
        Status::Pass
    };
}

/// A well-mixed 64-bit value from any input (SplitMix64's finaliser), so that consecutive case
/// indices give unrelated input streams.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> CheckRow {
        CheckRow {
            backend: crate::backend::BackendKind::Cpu,
            op: "gemm".into(),
            spec: "t".into(),
            dims: GemmDims { m: 2, n: 3, k: 4 },
            dtype: DType::F16,
            nmse: None,
            max_rel_err: None,
            status: Status::Pass,
        }
    }

    /// A correct output for [`row`]'s dims with an intact guard.
    fn good(reference: &[f64]) -> Vec<u16> {
        let mut out: Vec<u16> = reference.iter().map(|&r| DType::F16.from_f32(r as f32)).collect();
        out.extend(std::iter::repeat_n(DType::F16.poison(), GUARD_ELEMS));
        out
    }

    const REF: [f64; 6] = [0.5, -1.25, 2.0, 0.75, -0.375, 1.5];

    #[test]
    fn exact_output_passes() {
        let mut r = row();
        judge(DType::F16, r.dims, &good(&REF), &REF, &mut r);
        assert_eq!(r.status, Status::Pass);
        assert_eq!(r.nmse, Some(0.0));
        assert_eq!(r.max_rel_err, Some(0.0));
    }

    #[test]
    fn unwritten_output_fails() {
        let mut out = good(&REF);
        out[4] = DType::F16.poison();
        let mut r = row();
        judge(DType::F16, r.dims, &out, &REF, &mut r);
        assert!(
            matches!(&r.status, Status::Fail(m) if m.contains("m=1 n=1")),
            "{:?}",
            r.status
        );
    }

    #[test]
    fn write_into_guard_fails() {
        let mut out = good(&REF);
        out[6 + 100] = DType::F16.from_f32(0.0);
        let mut r = row();
        judge(DType::F16, r.dims, &out, &REF, &mut r);
        assert!(
            matches!(&r.status, Status::Fail(m) if m.contains("y[106]")),
            "{:?}",
            r.status
        );
    }

    #[test]
    fn wrong_value_fails_on_nmse() {
        let mut out = good(&REF);
        out[2] = DType::F16.from_f32(2.5);
        let mut r = row();
        judge(DType::F16, r.dims, &out, &REF, &mut r);
        assert!(
            matches!(&r.status, Status::Fail(m) if m.contains("NMSE")),
            "{:?}",
            r.status
        );
        assert!(r.max_rel_err.is_some_and(|e| (e - 0.25).abs() < 1e-9));
    }

    #[test]
    fn case_lists_hold_the_odd_sizes() {
        for list in [gemm_cases(), gemm_cases_quick()] {
            for dt in [DType::F16, DType::Bf16] {
                let of_dt: Vec<_> = list.iter().filter(|c| c.dtype == dt).collect();
                assert!(
                    of_dt.iter().any(|c| c.dims.m % 2 == 1 && c.dims.m > 1),
                    "{dt}: no odd M > 1"
                );
                assert!(
                    of_dt.iter().any(|c| c.dims.n % 16 != 0 && c.dims.n % 4 != 0),
                    "{dt}: no ragged N"
                );
                assert!(of_dt.iter().any(|c| c.dims.k == 4097), "{dt}: no K = 4097");
            }
        }
        assert!(gemm_cases().iter().any(|c| c.dims
            == GemmDims {
                m: 17,
                n: 11008,
                k: 4096
            }));
        // Several 128-row tiles with a ragged last one, and every axis TMA can take (multiples
        // of 8) ragged against the 256- and 128-wide tiles and the 64-wide K blocks.
        assert!(gemm_cases().iter().any(|c| c.dims.m > 256
            && c.dims.m % 128 != 0
            && c.dims.n % 128 != 0
            && c.dims.k % 64 != 0
            && c.dims.n % 8 == 0
            && c.dims.k % 8 == 0));
    }
}
