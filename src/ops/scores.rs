//! Softmax-input statistics for calibration (FlashDecoding++ §3: φ and [a, b] are chosen from
//! the distribution of the pre-softmax scores x = q·k/√d). A backend fills fixed-bin histograms
//! with exact min, max and count, over the scores an attention step computes: every new token
//! (a prefill row, or a decode step's one token per sequence) against every cached key at or
//! before its position, as [`PrefillParams`] describes them (a decode step is a prefill of one new
//! token per sequence).

use serde::{Deserialize, Serialize};

use crate::error::{FdppError, Result};
use crate::ops::attention::PrefillParams;

/// Fixed bins: `bins` equal bins over [lo, hi); scores outside fall in `under` / `over`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HistSpec {
    pub lo: f32,
    pub hi: f32,
    pub bins: usize,
}

impl HistSpec {
    /// The default calibration grid: [−64, 64) in 1/8 steps (1024 bins); Llama2-7B's scores
    /// lie in [−16.8, 6.5] (§3).
    pub const DEFAULT: HistSpec = HistSpec {
        lo: -64.0,
        hi: 64.0,
        bins: 1024,
    };

    pub fn validate(&self) -> Result<()> {
        if !(self.lo.is_finite() && self.hi.is_finite() && self.lo < self.hi) || self.bins == 0 || self.bins > 1 << 20 {
            return Err(FdppError::InvalidArgument(format!(
                "score histogram [{}, {}) with {} bins: need finite lo < hi and 1..=1048576 bins",
                self.lo, self.hi, self.bins
            )));
        }
        Ok(())
    }

    pub fn width(&self) -> f32 {
        (self.hi - self.lo) / self.bins as f32
    }

    /// The bin of x, or None when x falls outside [lo, hi) (or is NaN). The same rule on every
    /// backend: floor((x − lo) / width) with the width in f32.
    pub fn bin(&self, x: f32) -> Option<usize> {
        if !(x >= self.lo && x < self.hi) {
            return None;
        }
        let i = ((x - self.lo) / self.width()).floor() as usize;
        Some(i.min(self.bins - 1))
    }
}

/// One histogram of scores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoreHist {
    pub spec: HistSpec,
    pub counts: Vec<u64>,
    pub under: u64,
    pub over: u64,
    /// Exact extremes and count of every score seen (inside the bins or not).
    pub min: f32,
    pub max: f32,
    pub count: u64,
}

impl ScoreHist {
    pub fn new(spec: HistSpec) -> Self {
        ScoreHist {
            spec,
            counts: vec![0; spec.bins],
            under: 0,
            over: 0,
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            count: 0,
        }
    }

    pub fn add(&mut self, x: f32) {
        self.count += 1;
        self.min = self.min.min(x);
        self.max = self.max.max(x);
        match self.spec.bin(x) {
            Some(i) => self.counts[i] += 1,
            None if x < self.spec.lo => self.under += 1,
            None => self.over += 1,
        }
    }

    /// Add another histogram of the same spec.
    pub fn merge(&mut self, o: &ScoreHist) -> Result<()> {
        if o.spec != self.spec {
            return Err(FdppError::InvalidArgument(format!(
                "merging score histograms of different bins ({:?} and {:?})",
                self.spec, o.spec
            )));
        }
        self.counts.iter_mut().zip(&o.counts).for_each(|(a, b)| *a += b);
        self.under += o.under;
        self.over += o.over;
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.count += o.count;
        Ok(())
    }
}

/// What to gather for one attention step: one histogram over all heads, or one per query head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreStatsParams {
    pub spec: HistSpec,
    pub per_head: bool,
}

/// Scores one step computes: the causal pairs of [`PrefillParams`] times the heads.
pub fn score_count(p: &PrefillParams) -> u64 {
    p.spans()
        .iter()
        .map(|&(_, prefix, n)| (prefix as u64) * n as u64 + (n as u64) * (n as u64 + 1) / 2)
        .sum::<u64>()
        * p.geom.num_heads as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_count_every_score_once_with_exact_extremes() {
        let spec = HistSpec {
            lo: -4.0,
            hi: 4.0,
            bins: 8,
        };
        let mut h = ScoreHist::new(spec);
        for x in [-5.0, -4.0, -0.5, 0.0, 3.999, 4.0, 9.0] {
            h.add(x);
        }
        assert_eq!((h.under, h.over, h.count), (1, 2, 7));
        assert_eq!(h.counts, vec![1, 0, 0, 1, 1, 0, 0, 1]);
        assert_eq!((h.min, h.max), (-5.0, 9.0));
        let mut g = ScoreHist::new(spec);
        g.add(1.5);
        h.merge(&g).expect("same spec");
        assert_eq!(h.counts[5], 1);
        assert!(h.merge(&ScoreHist::new(HistSpec::DEFAULT)).is_err());
        assert!(HistSpec {
            lo: 1.0,
            hi: 1.0,
            bins: 4
        }
        .validate()
        .is_err());
    }
}
