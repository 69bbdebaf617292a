//! Derived columns: how close each candidate gets to the memory roofline, and how it compares
//! with the vendor GEMM measured in the same run (ratios between variants of one run are the
//! figures worth reading; absolute times drift between runs and machines).

use std::collections::HashMap;

use super::GemmRecord;
use crate::ops::gemm::GemmDims;

/// The rows that are the same problem: one device, model, shape and M.
fn problem_key(r: &GemmRecord) -> (&str, &str, &str, &str, usize, usize, usize) {
    (&r.device, &r.backend, &r.model, &r.shape, r.k, r.n, r.m)
}

fn usable(t: f64) -> bool {
    t.is_finite() && t > 0.0
}

/// Memory roofline time in microseconds of a GEMM: the fewest bytes it must move over the copy
/// bandwidth (which counts read plus write bytes, as `min_bytes` does).
pub fn roofline_us(m: usize, n: usize, k: usize, copy_gbps: f64) -> f64 {
    let bytes = GemmDims { m, n, k }.min_bytes();
    bytes / (copy_gbps * 1e9) * 1e6
}

/// Fill `roofline_pct` (when `copy_gbps` is a usable bandwidth) and `speedup_vs_gemm` (when
/// the same shape and M has a `gemm` row) on every record; clears them otherwise, so stale
/// values from an earlier run never survive.
pub fn annotate(records: &mut [GemmRecord], copy_gbps: Option<f64>) {
    let copy = copy_gbps.filter(|g| usable(*g));
    let mut best_gemm: HashMap<_, f64> = HashMap::new();
    for r in records.iter() {
        if r.imp == "gemm" && usable(r.median_us) {
            let e = best_gemm.entry(problem_key(r)).or_insert(f64::INFINITY);
            *e = e.min(r.median_us);
        }
    }
    let speedups: Vec<Option<f64>> = records
        .iter()
        .map(|r| {
            let best = best_gemm.get(&problem_key(r)).copied()?;
            usable(r.median_us).then(|| best / r.median_us)
        })
        .collect();
    for (r, s) in records.iter_mut().zip(speedups) {
        r.speedup_vs_gemm = s;
        // Over 100 % the inputs came from a cache, not from the memory whose bandwidth was
        // measured: that is no share of this roofline, so the cell stays empty (never a made-up
        // figure above 100 %); `over_roofline` counts such rows for a note.
        r.roofline_pct = match copy {
            Some(g) if usable(r.median_us) => {
                Some(100.0 * roofline_us(r.m, r.n, r.k, g) / r.median_us).filter(|p| *p <= 100.0)
            }
            _ => None,
        };
    }
}

/// Rows that ran faster than the memory roofline allows (their inputs were served from a
/// cache): [`annotate`] leaves their `roofline_pct` empty, and the caller says how many.
pub fn over_roofline(records: &[GemmRecord], copy_gbps: Option<f64>) -> usize {
    let Some(g) = copy_gbps.filter(|g| usable(*g)) else {
        return 0;
    };
    records
        .iter()
        .filter(|r| usable(r.median_us) && roofline_us(r.m, r.n, r.k, g) > r.median_us)
        .count()
}
