//! Choosing the unified max φ and the window [a, b] of the asynchronous softmax from the
//! distribution of its inputs (FlashDecoding++ §3: for Llama2-7B over 99.99 % of the scores
//! lie in [−16.8, 6.5]; OPT-6.7B's range is too wide and it keeps the synchronous softmax).
//!
//! The async scheme sums e^(x − φ) with no running max; a row is recomputed with the sync scheme
//! when one of its scores has x − φ > b, or when its largest has x − φ < a. The rule here:
//!
//! 1. The *core*: the narrowest interval [lo, hi] of x (bin edges, tightened to the exact min
//!    and max) that holds at least `coverage` of the scores. Narrowest, not the central
//!    quantiles: a skewed distribution gets its window where its mass is.
//! 2. If the core is wider than [`MAX_WINDOW`] the model is *too wide*: no fp32 window both holds
//!    its scores and keeps the precision bound below; async is disabled, with the reason.
//! 3. Otherwise the core is widened, within [`MAX_WINDOW`], towards the observed range plus
//!    [`HEADROOM`] of it on each side (held-out inputs stray past the calibration's extremes):
//!    upwards first, because any one score above φ + b recomputes its row, while a score below
//!    φ + a does only when it is the row's largest; then downwards.
//! 4. φ is the window's midpoint, so a = −w/2 and b = w/2 with w ≤ 60: the largest term is at
//!    most e^30 (≈ 1e13; summed over 2^24 keys ≈ 2e20, far below fp32's 3.4e38), and a row whose
//!    largest score sits at φ + a has its terms that still count (within e^−17, the 24-bit
//!    mantissa, of its largest) above e^−47 ≈ 4e−21, far above fp32's smallest normal 1.2e−38.
//!    That is the precision bound: no term that can change a row's fp32 sum becomes subnormal or
//!    overflows. e^(b−a) ≤ e^60 also stays inside fp32, as [`SoftmaxScheme::validate`] requires.

use serde::{Deserialize, Serialize};

use crate::error::{FdppError, Result};
use crate::ops::attention::SoftmaxScheme;
use crate::ops::scores::ScoreHist;

/// Default share of scores the window must hold (the paper's 99.99 %).
pub const DEFAULT_COVERAGE: f64 = 0.9999;
/// Widest window b − a (see the module docs for why 60).
pub const MAX_WINDOW: f64 = 60.0;
/// The window may reach this share of the observed range past each observed extreme.
pub const HEADROOM: f64 = 0.25;

/// A chosen window, in the score space x and as φ, a, b.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Window {
    pub phi: f64,
    pub a: f64,
    pub b: f64,
    /// Share of the histogram's scores inside [φ + a, φ + b] (at least the coverage asked for).
    pub coverage: f64,
    /// The narrowest interval holding the coverage asked for.
    pub core: (f64, f64),
    pub samples: u64,
    pub min: f64,
    pub max: f64,
}

impl Window {
    pub fn lo(&self) -> f64 {
        self.phi + self.a
    }
    pub fn hi(&self) -> f64 {
        self.phi + self.b
    }
    pub fn scheme(&self) -> SoftmaxScheme {
        SoftmaxScheme::Async {
            phi: self.phi as f32,
            a: self.a as f32,
            b: self.b as f32,
        }
    }
}

/// What the distribution allows.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    Async(Window),
    /// The core is wider than [`MAX_WINDOW`]: async softmax is disabled for this model.
    TooWide {
        core: (f64, f64),
        samples: u64,
        min: f64,
        max: f64,
        reason: String,
    },
}

/// One contiguous run of the distribution: [left, right] holding `count` scores.
struct Cell {
    left: f64,
    right: f64,
    count: u64,
}

/// The histogram as contiguous cells: the under-range scores as [min, lo), the bins, the
/// over-range scores as [hi, max]; edges tightened to the exact extremes.
fn cells(h: &ScoreHist) -> Vec<Cell> {
    let (min, max) = (h.min as f64, h.max as f64);
    let (lo, w) = (h.spec.lo as f64, h.spec.width() as f64);
    let mut out = Vec::with_capacity(h.counts.len() + 2);
    if h.under > 0 {
        out.push(Cell {
            left: min,
            right: lo.min(max),
            count: h.under,
        });
    }
    for (i, &c) in h.counts.iter().enumerate().filter(|(_, &c)| c > 0) {
        let left = lo + i as f64 * w;
        out.push(Cell {
            left: left.max(min),
            right: (left + w).min(max),
            count: c,
        });
    }
    if h.over > 0 {
        out.push(Cell {
            // NaN scores land in `over` with no effect on max: keep the cell non-empty.
            left: (h.spec.hi as f64).min(max),
            right: max.max(h.spec.hi as f64),
            count: h.over,
        });
    }
    out
}

/// The narrowest [left, right] over whole cells holding at least `need` scores.
fn narrowest(cells: &[Cell], need: u64) -> Option<(f64, f64)> {
    let mut best: Option<(f64, f64)> = None;
    let (mut i, mut sum) = (0usize, 0u64);
    for j in 0..cells.len() {
        sum += cells[j].count;
        while sum - cells[i].count >= need && i < j {
            sum -= cells[i].count;
            i += 1;
        }
        if sum >= need {
            let cand = (cells[i].left, cells[j].right);
            if best.is_none_or(|b| cand.1 - cand.0 < b.1 - b.0) {
                best = Some(cand);
            }
        }
    }
    best
}

/// Share of the scores in cells wholly inside [lo, hi] (a lower bound on the true share).
fn share_inside(cells: &[Cell], total: u64, lo: f64, hi: f64) -> f64 {
    let inside: u64 = cells
        .iter()
        .filter(|c| c.left >= lo && c.right <= hi)
        .map(|c| c.count)
        .sum();
    inside as f64 / total.max(1) as f64
}

/// Choose φ, a, b for the scores of `h` so that at least `coverage` of them lie in
/// [φ + a, φ + b] (see the module docs for the rule).
pub fn choose_window(h: &ScoreHist, coverage: f64) -> Result<Choice> {
    if !(coverage > 0.0 && coverage <= 1.0) {
        return Err(FdppError::InvalidArgument(format!(
            "--coverage {coverage}: must be in (0, 1], e.g. 0.9999 for 99.99 % of the scores"
        )));
    }
    if h.count == 0 {
        return Err(FdppError::InvalidArgument(
            "softmax calibration gathered no scores; run at least one prompt".into(),
        ));
    }
    let cs = cells(h);
    let need = ((coverage * h.count as f64).ceil() as u64).clamp(1, h.count);
    let (min, max) = (h.min as f64, h.max as f64);
    let Some(core) = narrowest(&cs, need) else {
        return Err(FdppError::InvalidArgument(format!(
            "score histogram of {} scores holds fewer than {need} in its bins; it is inconsistent",
            h.count
        )));
    };
    let width = core.1 - core.0;
    if !width.is_finite() || width > MAX_WINDOW {
        return Ok(Choice::TooWide {
            core,
            samples: h.count,
            min,
            max,
            reason: format!(
                "{:.4} % of the softmax inputs span [{:.2}, {:.2}], {:.1} wide; an fp32 window of the \
                 asynchronous softmax is at most {MAX_WINDOW} wide (FlashDecoding++ §3: such models keep \
                 the synchronous softmax)",
                coverage * 100.0,
                core.0,
                core.1,
                width
            ),
        });
    }
    let span = (max - min).max(0.0);
    let (want_lo, want_hi) = (min - HEADROOM * span, max + HEADROOM * span);
    let mut slack = MAX_WINDOW - width;
    let hi = (core.1 + slack).min(want_hi.max(core.1));
    slack -= hi - core.1;
    let lo = (core.0 - slack).max(want_lo.min(core.0));
    // A window of zero width (every score equal) still needs a < b.
    let (lo, hi) = if hi - lo < 1e-3 { (lo - 0.5, hi + 0.5) } else { (lo, hi) };
    let phi = (lo + hi) / 2.0;
    let w = Window {
        phi,
        a: lo - phi,
        b: hi - phi,
        coverage: share_inside(&cs, h.count, lo, hi),
        core,
        samples: h.count,
        min,
        max,
    };
    w.scheme().validate()?;
    Ok(Choice::Async(w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::scores::HistSpec;
    use rand::{Rng, SeedableRng};

    fn hist(xs: impl IntoIterator<Item = f32>) -> ScoreHist {
        let mut h = ScoreHist::new(HistSpec::DEFAULT);
        xs.into_iter().for_each(|x| h.add(x));
        h
    }

    fn normal(n: usize, mean: f32, sd: f32, seed: u64) -> Vec<f32> {
        // Box–Muller.
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let (u, v): (f64, f64) = (rng.gen::<f64>().max(1e-300), rng.gen());
                let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
                mean + sd * z as f32
            })
            .collect()
    }

    fn window(c: Choice) -> Window {
        match c {
            Choice::Async(w) => w,
            Choice::TooWide { reason, .. } => panic!("too wide: {reason}"),
        }
    }

    fn share(xs: &[f32], lo: f64, hi: f64) -> f64 {
        xs.iter().filter(|&&x| (x as f64) >= lo && (x as f64) <= hi).count() as f64 / xs.len() as f64
    }

    #[test]
    fn narrow_distribution_gets_its_whole_range_with_headroom() {
        let xs = normal(200_000, -2.0, 1.5, 1);
        let w = window(choose_window(&hist(xs.iter().copied()), DEFAULT_COVERAGE).expect("ok"));
        // Every calibration score inside, and the window reaches past both extremes.
        assert_eq!(share(&xs, w.lo(), w.hi()), 1.0);
        assert!(w.lo() < w.min - 1.0 && w.hi() > w.max + 1.0, "{w:?}");
        assert!(w.b - w.a <= MAX_WINDOW + 1e-9);
        assert!((w.a + w.b).abs() < 1e-9, "φ is the midpoint");
        assert!(w.coverage >= DEFAULT_COVERAGE);
        assert_eq!(w.samples, 200_000);
        // The core of 99.99 % of N(−2, 1.5) is about ±3.9 σ.
        let core_w = w.core.1 - w.core.0;
        assert!((10.0..13.0).contains(&core_w), "core {:?}", w.core);
        w.scheme().validate().expect("valid scheme");
    }

    #[test]
    fn wide_distribution_is_refused_with_the_reason() {
        let xs = normal(100_000, 0.0, 20.0, 2);
        match choose_window(&hist(xs), DEFAULT_COVERAGE).expect("ok") {
            Choice::TooWide { core, reason, .. } => {
                assert!(core.1 - core.0 > MAX_WINDOW);
                assert!(
                    reason.contains("an fp32 window") && reason.contains("99.9900 %"),
                    "{reason}"
                );
            }
            Choice::Async(w) => panic!("should be too wide: {w:?}"),
        }
        // The same scores at a looser coverage fit: 60 % of N(0, 20) is within ±17.
        let xs = normal(100_000, 0.0, 20.0, 2);
        let w = window(choose_window(&hist(xs.iter().copied()), 0.6).expect("ok"));
        assert!(share(&xs, w.lo(), w.hi()) >= 0.6);
        assert!((w.b - w.a - MAX_WINDOW).abs() < 1e-6, "uses the whole budget");
    }

    #[test]
    fn skewed_distribution_gets_the_narrowest_core_not_the_central_quantiles() {
        // Most scores near 0, a long tail down to −40 (as after a causal mask's early keys).
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let xs: Vec<f32> = (0..100_000)
            .map(|_| {
                let e: f32 = -rng.gen::<f32>().max(1e-12).ln();
                1.0 - 4.0 * e
            })
            .collect();
        let w = window(choose_window(&hist(xs.iter().copied()), 0.999).expect("ok"));
        assert!(share(&xs, w.core.0, w.core.1) >= 0.999);
        // The narrowest 99.9 % interval runs from −4·ln(1000) ≈ −26.6 to the top at 1.
        assert!((w.core.1 - 1.0).abs() < 0.2, "{:?}", w.core);
        assert!((w.core.0 + 26.6).abs() < 1.0, "{:?}", w.core);
        assert!(w.hi() > w.max, "nothing above φ + b");
    }

    #[test]
    fn outliers_outside_the_bins_are_left_out_of_the_core_but_counted() {
        let mut xs = normal(100_000, 1.0, 2.0, 4);
        // Five scores far past the bins (1 in 20000, under the 1e-4 allowed).
        xs.extend([150.0, -300.0, 90.0, 200.0, -80.0]);
        let h = hist(xs.iter().copied());
        assert_eq!((h.under, h.over), (2, 3));
        let w = window(choose_window(&h, DEFAULT_COVERAGE).expect("ok"));
        assert!(w.core.1 - w.core.0 < 20.0, "{:?}", w.core);
        assert_eq!((w.min, w.max), (-300.0, 200.0));
        assert!(w.b - w.a <= MAX_WINDOW + 1e-9);
        assert!(share(&xs, w.lo(), w.hi()) >= DEFAULT_COVERAGE);
        // At a coverage that needs them, the outliers make the range too wide.
        assert!(matches!(choose_window(&h, 1.0).expect("ok"), Choice::TooWide { .. }));
    }

    #[test]
    fn bad_coverage_and_empty_histograms_are_errors() {
        let h = hist([1.0, 2.0]);
        for c in [0.0, 1.5, f64::NAN] {
            let e = choose_window(&h, c).expect_err("bad coverage");
            assert!(e.to_string().contains("--coverage"), "{e}");
        }
        let e = choose_window(&hist([]), 0.9).expect_err("empty");
        assert!(e.to_string().contains("no scores"), "{e}");
        // Equal scores: a window of positive width around them.
        let w = window(choose_window(&hist([3.0; 10]), 1.0).expect("ok"));
        assert!(w.a < 0.0 && w.b > 0.0 && w.lo() <= 3.0 && w.hi() >= 3.0, "{w:?}");
    }
}
