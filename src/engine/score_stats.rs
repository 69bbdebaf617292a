//! The engine's statistics mode (softmax calibration, FlashDecoding++ §3): when on, every
//! layer's attention step is followed by [`Backend::attention_score_hist`] over the same new
//! tokens and cached keys, and the histograms are summed per layer. It reads q and the cache
//! only, so the step's results are the same with it on or off; it costs a second pass over the
//! keys and a wait for the device per layer, so it is for calibration runs, not serving.

use crate::error::{FdppError, Result};
use crate::ops::scores::{ScoreHist, ScoreStatsParams};

/// Histograms gathered so far: `layers[l]` holds one histogram, or one per query head.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreStats {
    pub params: ScoreStatsParams,
    pub layers: Vec<Vec<ScoreHist>>,
    /// Attention steps (prefill chunks and decode steps) gathered.
    pub steps: usize,
}

impl ScoreStats {
    pub fn new(params: ScoreStatsParams, num_layers: usize, num_heads: usize) -> Result<Self> {
        params.spec.validate()?;
        let per_layer = if params.per_head { num_heads } else { 1 };
        Ok(ScoreStats {
            params,
            layers: vec![vec![ScoreHist::new(params.spec); per_layer]; num_layers],
            steps: 0,
        })
    }

    /// Add one layer's histograms of one step.
    pub fn add(&mut self, layer: usize, hists: &[ScoreHist]) -> Result<()> {
        let Some(mine) = self.layers.get_mut(layer) else {
            return Err(FdppError::InvalidArgument(format!(
                "score statistics: layer {layer} of a model with {} layers",
                self.layers.len()
            )));
        };
        if hists.len() != mine.len() {
            return Err(FdppError::Shape {
                what: format!("score histograms of layer {layer}"),
                expected: mine.len().to_string(),
                found: hists.len().to_string(),
            });
        }
        for (m, h) in mine.iter_mut().zip(hists) {
            m.merge(h)?;
        }
        Ok(())
    }

    /// One layer's scores over all heads.
    pub fn layer(&self, layer: usize) -> Result<ScoreHist> {
        let mut out = ScoreHist::new(self.params.spec);
        for h in self.layers.get(layer).into_iter().flatten() {
            out.merge(h)?;
        }
        Ok(out)
    }

    /// Every layer's scores together.
    pub fn global(&self) -> Result<ScoreHist> {
        let mut out = ScoreHist::new(self.params.spec);
        for l in 0..self.layers.len() {
            out.merge(&self.layer(l)?)?;
        }
        Ok(out)
    }
}
