//! Correctness checks of every kernel a backend offers, against the f64 oracles of
//! `crate::reference`. One harness serves `fdpp check` and `cargo test`: the same cases, the same
//! poison and guard checks, the same NMSE limits, whatever the backend.

pub mod attention;
pub mod gemm;
pub mod layer;

use serde::Serialize;

pub use attention::{attention_cases, attention_cases_quick, check_attention, AttnCase, AttnCheckRow};
pub use gemm::{check_gemm, gemm_cases, gemm_cases_quick, GemmCase, GUARD_ELEMS};
pub use layer::{check_layer, layer_cases, layer_cases_quick, LayerCase, LayerCheckRow, LayerShape};

use crate::backend::BackendKind;
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// The outcome of one check.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", content = "reason", rename_all = "lowercase")]
pub enum Status {
    Pass,
    /// The kernel ran and its output is wrong (or it failed to run): why.
    Fail(String),
    /// The candidate declined these dims (`Unsupported`): not a failure.
    Skipped(String),
}

impl Status {
    pub fn label(&self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail(_) => "fail",
            Status::Skipped(_) => "skipped",
        }
    }
    pub fn reason(&self) -> Option<&str> {
        match self {
            Status::Pass => None,
            Status::Fail(r) | Status::Skipped(r) => Some(r),
        }
    }
    pub fn is_fail(&self) -> bool {
        matches!(self, Status::Fail(_))
    }
}

/// One kernel spec on one case.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CheckRow {
    pub backend: BackendKind,
    /// The op family, e.g. "gemm".
    pub op: String,
    /// The spec URI, e.g. `flat_gemm_f16_bn16`.
    pub spec: String,
    #[serde(flatten)]
    pub dims: GemmDims,
    pub dtype: DType,
    /// ‖y − ref‖² / ‖ref‖² over every output; +∞ when an output is not finite. None when the
    /// kernel did not produce an output (skipped, or failed to run).
    pub nmse: Option<f64>,
    /// max |y − ref| / max |ref|: the worst single error, relative to the output's scale (an
    /// element-wise relative error would blow up on outputs that happen to be near zero).
    pub max_rel_err: Option<f64>,
    #[serde(flatten)]
    pub status: Status,
}

/// Counts of (passed, failed, skipped) rows.
pub fn tally(rows: &[CheckRow]) -> (usize, usize, usize) {
    rows.iter().fold((0, 0, 0), |(p, f, s), r| match r.status {
        Status::Pass => (p + 1, f, s),
        Status::Fail(_) => (p, f + 1, s),
        Status::Skipped(_) => (p, f, s + 1),
    })
}
