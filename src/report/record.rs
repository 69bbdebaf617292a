//! One measured GEMM candidate at one M: a row that describes itself.

use serde::{Deserialize, Serialize};

use crate::bench::Stats;
use crate::ops::gemm::{GemmDims, GemmSpec};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmRecord {
    pub fdpp_version: String,
    pub git_commit: String,
    pub device: String,
    pub backend: String,
    pub model: String,
    /// qkv | o | ffn1 | ffn2
    pub shape: String,
    pub k: usize,
    pub n: usize,
    /// The candidate's spec URI, e.g. `flat_gemm_f16_bn64`.
    pub implementation: String,
    /// gemv | flat_gemm | gemm
    pub imp: String,
    pub m: usize,
    pub samples: usize,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    /// Minimum bytes (W, x read once, y written once) over the median time.
    pub gbps: f64,
    pub gflops: f64,
    /// NMSE against the f64 reference (sampled columns in the tuner).
    pub nmse: f64,
    /// Memory roofline time (minimum bytes / measured copy bandwidth) as a percentage of the
    /// median: 100 means the candidate moves its bytes as fast as a plain copy. Filled by
    /// [`crate::report::annotate`]; None when no copy bandwidth was measured.
    #[serde(default)]
    pub roofline_pct: Option<f64>,
    /// Median of the fastest `gemm` candidate at the same shape and M over this median: above 1
    /// this candidate beats the vendor GEMM. Filled by [`crate::report::annotate`].
    #[serde(default)]
    pub speedup_vs_gemm: Option<f64>,
}

/// Context shared by every row of one run.
#[derive(Clone, Debug)]
pub struct RunContext {
    pub build: crate::provenance::BuildInfo,
    pub device: String,
    pub backend: String,
    pub model: String,
}

impl GemmRecord {
    pub fn new(ctx: &RunContext, shape: &str, spec: &GemmSpec, dims: GemmDims, stats: Stats, nmse: f64) -> Self {
        let secs = stats.median_us * 1e-6;
        GemmRecord {
            fdpp_version: ctx.build.fdpp_version.clone(),
            git_commit: ctx.build.git_commit.clone(),
            device: ctx.device.clone(),
            backend: ctx.backend.clone(),
            model: ctx.model.clone(),
            shape: shape.to_string(),
            k: dims.k,
            n: dims.n,
            implementation: spec.uri(),
            imp: spec.imp.name().to_string(),
            m: dims.m,
            samples: stats.samples,
            median_us: stats.median_us,
            min_us: stats.min_us,
            max_us: stats.max_us,
            gbps: dims.min_bytes() / secs / 1e9,
            gflops: dims.flops() / secs / 1e9,
            nmse,
            roofline_pct: None,
            speedup_vs_gemm: None,
        }
    }
}
