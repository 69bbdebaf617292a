//! Tuning profiles: what `fdpp tune` measured on one device for one model, kept as JSON.
//!
//! A profile holds every candidate's timings (not only the winner, so that later analysis and
//! re-selection need no re-run), the best verified config per implementation and M, and the
//! inflection points M1/M2 per shape (FlashDecoding++ §4). It says where it came from (device,
//! driver, kernel source hash, fdpp version), and a profile made elsewhere is classified on load:
//! hard mismatches are refused, soft ones warned about.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::{Backend, BackendKind, DeviceInfo};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::{LinearKind, LinearShape, ModelConfig, ModelShapes};
use crate::ops::gemm::GemmImpl;

pub mod lookup;

/// Bumped whenever a field changes meaning or a required field is added.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub schema_version: u32,
    pub provenance: Provenance,
    pub model: ModelSection,
    pub dtype: DType,
    pub timing: TimingSection,
    pub shapes: Vec<ShapeProfile>,
    /// Unified-max softmax parameters (FlashDecoding++ §3); filled by softmax calibration.
    #[serde(default)]
    pub softmax: Option<SoftmaxSection>,
    /// Which main pass the one-head-per-block decode attention runs (MHA), timed on this
    /// device; absent where the backend offers one pass only, and in profiles made before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_pass: Option<DecodePassSection>,
}

/// The decode attention of a model with one query head per kv head, timed on its two main
/// passes (`tune::decode_pass`): the CUDA-core one and the tensor-core one. Which is faster
/// depends on the card: on the H200 the tensor-core pass ran 2-19 % faster at batch 1-16 and 13 %
/// slower at batch 32 (reports/NOTES.md, session 41); on the H100 of session 24 it was up to 14 %
/// slower at batch 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodePassSection {
    /// Keys per sequence of the timed launches.
    pub kv_len: usize,
    /// The softmax scheme timed (the engine's: the profile's async window, or the default one).
    pub scheme: String,
    /// The fdpp build that timed it (`tune --decode-pass` adds the section to a profile made by
    /// another).
    pub git_commit: String,
    pub rows: Vec<DecodePassRow>,
    /// The engine runs the tensor-core pass for decode batches up to this one: the largest
    /// timed batch up to which it was never slower. None: the CUDA-core pass everywhere.
    pub tensor_cores_up_to_batch: Option<usize>,
}

/// Median µs of one decode attention launch at `batch` sequences, per pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodePassRow {
    pub batch: usize,
    pub cuda_core_us: f64,
    pub tensor_core_us: f64,
}

impl DecodePassSection {
    /// The rule of `tensor_cores_up_to_batch` over `rows` (in any order): batches in increasing
    /// order while the tensor-core pass is no slower; None when it loses at the smallest.
    pub fn rule(rows: &[DecodePassRow]) -> Option<usize> {
        let mut sorted: Vec<&DecodePassRow> = rows.iter().collect();
        sorted.sort_by_key(|r| r.batch);
        sorted
            .iter()
            .take_while(|r| r.tensor_core_us <= r.cuda_core_us)
            .last()
            .map(|r| r.batch)
    }
}

/// Where and with what a profile was made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    pub device: DeviceInfo,
    pub backend: BackendKind,
    pub fdpp_version: String,
    pub git_commit: String,
    pub kernel_hash: String,
    /// Made on sm_90a: the hash of fdpp's Hopper GEMM, which its sweep timed
    /// (`crate::backend::cuda::sources::hopper_gemm_hash`); None elsewhere and in profiles made
    /// before the kernel existed, which name no spec of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hopper_gemm_hash: Option<String>,
    /// UTC, RFC 3339.
    pub created: String,
    /// The run-configuration switches set when it was made (`crate::run_config`); empty in
    /// profiles made before it was recorded.
    #[serde(default)]
    pub run_config: String,
}

impl Provenance {
    pub fn of<B: Backend>(b: &B) -> Self {
        let build = crate::provenance::BuildInfo::current();
        Provenance {
            device: b.info().clone(),
            backend: b.info().backend,
            fdpp_version: build.fdpp_version,
            git_commit: build.git_commit,
            kernel_hash: b.kernel_hash(),
            hopper_gemm_hash: crate::backend::hopper_gemm_hash_of(b.info()),
            created: crate::provenance::now_utc(),
            run_config: build.run_config,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSection {
    pub name: String,
    pub config: ModelConfig,
    pub shapes: Vec<LinearShape>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimingSection {
    pub warmup: usize,
    pub reps: usize,
    /// Output columns checked against the f64 reference per candidate and M.
    pub verify_cols: usize,
    /// The noise margin of the inflection rule (0.02 = 2 %).
    pub margin: f64,
    /// The inflection and selection rule in words (see `tune::inflection`).
    pub rule: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SoftmaxSection {
    pub phi: f64,
    pub a: f64,
    pub b: f64,
    /// Share of calibration inputs that stayed inside [a, b].
    #[serde(default)]
    pub coverage: Option<f64>,
    /// False when calibration found the inputs too wide for an fp32 window: the engine then
    /// runs the synchronous softmax, and `reason` says why.
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub reason: Option<String>,
    /// The coverage asked for (`--coverage`).
    #[serde(default)]
    pub target_coverage: Option<f64>,
    /// Scores gathered by the calibration.
    #[serde(default)]
    pub samples: u64,
    /// Exact extremes of the scores gathered.
    #[serde(default)]
    pub min: Option<f64>,
    #[serde(default)]
    pub max: Option<f64>,
    /// What was run: weights (trained or random), prompts, tokens.
    #[serde(default)]
    pub source: Option<String>,
    /// The window each layer's scores alone get. The engine runs each layer with its own
    /// (the global one where a layer has none usable) unless `softmax_windows=global`.
    #[serde(default)]
    pub per_layer: Vec<LayerWindow>,
    /// The calibration's held-out comparison: sync, async with the global window, async with
    /// the per-layer windows.
    #[serde(default)]
    pub comparison: Vec<WindowComparison>,
    /// Share of the calibration scores inside FlashDecoding++'s Llama2-7B range [−16.8, 6.5].
    #[serde(default)]
    pub paper_range_share: Option<f64>,
    /// Held-out validation with these φ, a, b: rows recomputed / rows.
    #[serde(default)]
    pub recompute_rate: Option<f64>,
    /// Held-out validation: largest |async − sync| logit over the largest |sync| logit.
    #[serde(default)]
    pub validated_logit_diff: Option<f64>,
    /// Held-out validation: async and sync gave the same greedy tokens.
    #[serde(default)]
    pub validated_same_tokens: Option<bool>,
    /// The same measure between two sync runs that differ only in how the prompt is cut into
    /// prefill chunks (other kernel tilings, the same maths): the fp16 rounding floor of this
    /// model, against which the async − sync difference is read.
    #[serde(default)]
    pub sync_noise_floor: Option<f64>,
    /// The same measure between two async runs whose φ differs by 0.5 (the same maths, other
    /// rounding): the floor of fp16 rounding amplified through the layers.
    #[serde(default)]
    pub async_rounding_floor: Option<f64>,
}

fn yes() -> bool {
    true
}

impl SoftmaxSection {
    /// A section holding only the window (the fields of the first schema).
    pub fn window(phi: f64, a: f64, b: f64, coverage: Option<f64>) -> Self {
        SoftmaxSection {
            phi,
            a,
            b,
            coverage,
            enabled: true,
            reason: None,
            target_coverage: None,
            samples: 0,
            min: None,
            max: None,
            source: None,
            per_layer: Vec::new(),
            comparison: Vec::new(),
            paper_range_share: None,
            recompute_rate: None,
            validated_logit_diff: None,
            validated_same_tokens: None,
            sync_noise_floor: None,
            async_rounding_floor: None,
        }
    }
}

/// One run of the calibration's held-out comparison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowComparison {
    /// `sync`, `global` or `per_layer`.
    pub windows: String,
    /// Attention rows recomputed / rows (async only).
    #[serde(default)]
    pub recompute_rate: Option<f64>,
    /// Largest |async − sync| logit over the largest |sync| logit (async only).
    #[serde(default)]
    pub logit_diff: Option<f64>,
    #[serde(default)]
    pub same_tokens: Option<bool>,
    /// Perplexity over the calibration's perplexity text, and the tokens it scored.
    #[serde(default)]
    pub ppl: Option<f64>,
    #[serde(default)]
    pub ppl_tokens: u64,
}

/// One layer's calibrated window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerWindow {
    pub layer: usize,
    pub phi: f64,
    pub a: f64,
    pub b: f64,
    pub coverage: f64,
    pub samples: u64,
    pub min: f64,
    pub max: f64,
    /// Set when this layer's scores alone are too wide (φ, a, b then describe its coverage
    /// interval, which no fp32 window can hold).
    #[serde(default)]
    pub reason: Option<String>,
}

/// Everything measured for one [K, N] shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShapeProfile {
    pub kind: LinearKind,
    pub k: usize,
    pub n: usize,
    pub m_grid: Vec<usize>,
    /// Every candidate, with its outcome at every M of the grid.
    pub candidates: Vec<CandidateResult>,
    /// Per grid M, each implementation's fastest verified config (the gemv layout where some
    /// were also timed fused: the fastest fused, see [`best_per_impl`]).
    pub best: Vec<BestAtM>,
    /// flat_gemm from here (None = never).
    pub m1: Option<usize>,
    /// gemm from here (None = never).
    pub m2: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateResult {
    /// Spec URI, e.g. `flat_gemm_f16_bn64`.
    pub uri: String,
    pub imp: GemmImpl,
    #[serde(default)]
    pub block_n: Option<u32>,
    /// cp.async pipeline depth (flat_gemm).
    #[serde(default)]
    pub stages: Option<u32>,
    /// cuBLASLt algorithm rank (gemm on CUDA; [`crate::ops::gemm::GemmSpec::algo`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algo: Option<u32>,
    pub results: Vec<Measurement>,
    /// A gemv layout at the M where the engine runs it fused (`tune::fused`): the same layout
    /// timed as that fused op. Empty for every other candidate, on backends without fused gemv
    /// ops, and in profiles made before it was measured, which then serialise as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fused: Vec<FusedMeasurement>,
}

/// The fused op a decode step runs in place of a plain gemv (`Backend::fused_gemv_ops`), with
/// the row / K-split layout of the gemv spec's block_n.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FusedOp {
    /// QKV: rmsnorm of the residual inside the GEMV (`Backend::gemm_rms_in`; the engine's
    /// `gemm_rms_rope_append` is the same GEMV with a rotary epilogue).
    GemmRmsIn,
    /// O and FFN2: the residual add as the GEMV's epilogue (`Backend::gemm_residual_out`).
    GemmResidualOut,
}

impl FusedOp {
    pub fn name(self) -> &'static str {
        match self {
            FusedOp::GemmRmsIn => "gemm_rms_in",
            FusedOp::GemmResidualOut => "gemm_residual_out",
        }
    }
}

impl std::fmt::Display for FusedOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One gemv layout at one M timed as its fused op. Only timed, never verified: the plain product
/// verified the layout, and the fused kernels are checked against their unfused ops elsewhere
/// (tests/gpu_cuda_fused.rs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum FusedMeasurement {
    Ok {
        m: usize,
        op: FusedOp,
        samples: usize,
        median_us: f64,
        min_us: f64,
        max_us: f64,
    },
    /// The fused op failed while timed: the layout is not chosen at this M by fused time.
    Rejected { m: usize, op: FusedOp, reason: String },
    /// The backend has no fused kernel for these dims after all (`Unsupported`).
    Skipped { m: usize, op: FusedOp, reason: String },
}

impl FusedMeasurement {
    pub fn m(&self) -> usize {
        match self {
            FusedMeasurement::Ok { m, .. }
            | FusedMeasurement::Rejected { m, .. }
            | FusedMeasurement::Skipped { m, .. } => *m,
        }
    }
    pub fn median_us(&self) -> Option<f64> {
        match self {
            FusedMeasurement::Ok { median_us, .. } => Some(*median_us),
            _ => None,
        }
    }
}

impl CandidateResult {
    /// The plain median at grid M, if verified and timed there.
    pub fn plain_us(&self, m: usize) -> Option<f64> {
        self.results
            .iter()
            .find(|r| r.m() == m)
            .and_then(Measurement::median_us)
    }
    /// The fused median at grid M, if this layout was timed fused there.
    pub fn fused_us(&self, m: usize) -> Option<f64> {
        self.fused
            .iter()
            .find(|r| r.m() == m)
            .and_then(FusedMeasurement::median_us)
    }
}

/// One candidate at one M: timed after passing verification, rejected (wrong result or an
/// error; never selectable), or skipped (the candidate does not support these dims).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Measurement {
    Ok {
        m: usize,
        samples: usize,
        median_us: f64,
        min_us: f64,
        max_us: f64,
        nmse: f64,
    },
    Rejected {
        m: usize,
        reason: String,
    },
    Skipped {
        m: usize,
        reason: String,
    },
}

impl Measurement {
    pub fn m(&self) -> usize {
        match self {
            Measurement::Ok { m, .. } | Measurement::Rejected { m, .. } | Measurement::Skipped { m, .. } => *m,
        }
    }
    pub fn median_us(&self) -> Option<f64> {
        match self {
            Measurement::Ok { median_us, .. } => Some(*median_us),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BestConfig {
    pub uri: String,
    #[serde(default)]
    pub block_n: Option<u32>,
    #[serde(default)]
    pub stages: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algo: Option<u32>,
    pub median_us: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BestAtM {
    pub m: usize,
    pub gemv: Option<BestConfig>,
    pub flat_gemm: Option<BestConfig>,
    pub gemm: Option<BestConfig>,
}

impl BestAtM {
    pub fn get(&self, imp: GemmImpl) -> Option<&BestConfig> {
        match imp {
            GemmImpl::Gemv => self.gemv.as_ref(),
            GemmImpl::FlatGemm => self.flat_gemm.as_ref(),
            GemmImpl::Gemm => self.gemm.as_ref(),
        }
    }
    fn slot(&mut self, imp: GemmImpl) -> &mut Option<BestConfig> {
        match imp {
            GemmImpl::Gemv => &mut self.gemv,
            GemmImpl::FlatGemm => &mut self.flat_gemm,
            GemmImpl::Gemm => &mut self.gemm,
        }
    }
}

impl ShapeProfile {
    /// Assemble a shape's entry from its measurements: best verified config per implementation
    /// and M, then M1/M2 by the rule of `tune::inflection` with `margin`.
    pub fn from_measurements(
        kind: LinearKind,
        k: usize,
        n: usize,
        m_grid: Vec<usize>,
        candidates: Vec<CandidateResult>,
        margin: f64,
    ) -> Self {
        // M1/M2 choose between implementations on each one's fastest plain time, never a fused
        // one: a fused time includes the norm or residual add that flat_gemm and gemm would run
        // as separate kernels, so comparing it with their plain time would favour gemv.
        let mut sp = ShapeProfile {
            kind,
            k,
            n,
            best: best_plain(&m_grid, &candidates),
            m_grid,
            candidates,
            m1: None,
            m2: None,
        };
        let inf = crate::tune::inflection::inflection_points(
            &sp.m_grid,
            &sp.times(GemmImpl::Gemv),
            &sp.times(GemmImpl::FlatGemm),
            &sp.times(GemmImpl::Gemm),
            margin,
        );
        sp.m1 = inf.m1;
        sp.m2 = inf.m2;
        // Then the config each implementation runs with, which for gemv at a fused M is the
        // layout fastest fused.
        sp.best = best_per_impl(&sp.m_grid, &sp.candidates);
        sp
    }

    /// The plain median time of the implementation's config in `best` at each grid M (None = none
    /// verified). For gemv at an M where layouts were timed fused, that is the fused pick's plain
    /// time, which may exceed the fastest layout's that M1/M2 were read from.
    pub fn times(&self, imp: GemmImpl) -> Vec<Option<f64>> {
        self.m_grid
            .iter()
            .map(|&m| self.best_at(m).and_then(|b| b.get(imp)).map(|c| c.median_us))
            .collect()
    }

    pub fn best_at(&self, m: usize) -> Option<&BestAtM> {
        self.best.iter().find(|b| b.m == m)
    }

    pub fn label(&self) -> String {
        format!("{}[K={},N={}]", self.kind, self.k, self.n)
    }
}

/// For each grid M and implementation, the config that runs there: the fastest verified and
/// timed candidate, except that where some gemv layouts were also timed fused at M, the gemv is
/// the layout whose fused op is fastest ([`fastest_fused_gemv`]).
pub fn best_per_impl(m_grid: &[usize], candidates: &[CandidateResult]) -> Vec<BestAtM> {
    let mut rows = best_plain(m_grid, candidates);
    for row in &mut rows {
        if let Some(b) = fastest_fused_gemv(candidates, row.m) {
            row.gemv = Some(b);
        }
    }
    rows
}

/// For each grid M and implementation, the candidate fastest by its plain time (what M1/M2 are
/// chosen on, see [`ShapeProfile::from_measurements`]).
pub fn best_plain(m_grid: &[usize], candidates: &[CandidateResult]) -> Vec<BestAtM> {
    m_grid
        .iter()
        .map(|&m| {
            let mut row = BestAtM {
                m,
                gemv: None,
                flat_gemm: None,
                gemm: None,
            };
            for c in candidates {
                let Some(t) = c.plain_us(m) else {
                    continue;
                };
                let slot = row.slot(c.imp);
                if slot.as_ref().is_none_or(|b| t < b.median_us) {
                    *slot = Some(config_of(c, t));
                }
            }
            row
        })
        .collect()
}

/// The gemv layout at grid M with the fastest fused time among those verified there, or None
/// where no layout has a fused time at M. The engine runs the fused kernel with that layout
/// (`gemv_fused` takes its row / K-split layout from block_n), and the layout fastest plain is
/// not always fastest fused (H200: QKV bn16 and O bn1 plain-fastest made the fused decode 1.5 %
/// slower than bn1 and bn8). Its `median_us` stays the plain time: that is what other
/// implementations' times are compared with (`select`'s fallback) and shown beside. (A step
/// whose other linears are not all gemv runs unfused, and then runs this layout plain, losing
/// at most its plain gap to the fastest layout.)
pub fn fastest_fused_gemv(candidates: &[CandidateResult], m: usize) -> Option<BestConfig> {
    candidates
        .iter()
        .filter(|c| c.imp == GemmImpl::Gemv)
        .filter_map(|c| Some((c, c.plain_us(m)?, c.fused_us(m)?)))
        // min_by keeps the first of equal times, as best_plain does.
        .min_by(|a, b| a.2.total_cmp(&b.2))
        .map(|(c, plain, _)| config_of(c, plain))
}

fn config_of(c: &CandidateResult, median_us: f64) -> BestConfig {
    BestConfig {
        uri: c.uri.clone(),
        block_n: c.block_n,
        stages: c.stages,
        algo: c.algo,
        median_us,
    }
}

/// `profiles/<device-slug>/<model>.json`.
pub fn default_path(device_slug: &str, model_name: &str) -> PathBuf {
    PathBuf::from("profiles")
        .join(file_stem(device_slug))
        .join(format!("{}.json", file_stem(model_name)))
}

/// A model or device name made safe as one path component ("meta-llama/Llama-2-7b" →
/// "meta-llama-Llama-2-7b").
pub fn file_stem(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let s = s.trim_matches(|c| c == '-' || c == '.').to_string();
    if s.is_empty() {
        "unnamed".into()
    } else {
        s
    }
}

impl Profile {
    /// A profile with no GEMM measurements (`fdpp tune --calibrate` before any sweep): the
    /// model's shapes, so that it loads for this model, and no shape entries, so that select()
    /// uses the vendor GEMM everywhere until `fdpp tune` adds them.
    pub fn without_gemm<B: Backend>(b: &B, cfg: &ModelConfig, dtype: DType) -> Profile {
        Profile {
            schema_version: SCHEMA_VERSION,
            provenance: Provenance::of(b),
            model: ModelSection {
                name: cfg.name.clone(),
                config: cfg.clone(),
                shapes: ModelShapes::of(cfg).linears,
            },
            dtype,
            timing: TimingSection {
                warmup: 0,
                reps: 0,
                verify_cols: 0,
                margin: 0.0,
                rule: "no GEMM sweep yet (made by `fdpp tune --calibrate`): the vendor gemm for every \
                       shape; `fdpp tune --model <model>` adds the sweep and keeps the softmax section"
                    .into(),
            },
            shapes: Vec::new(),
            softmax: None,
            decode_pass: None,
        }
    }

    /// The entry for a shape: same K and N (preferring the same kind, as two kinds may share a
    /// shape).
    pub fn shape_for(&self, shape: &LinearShape) -> Option<&ShapeProfile> {
        let same = |s: &&ShapeProfile| s.k == shape.k && s.n == shape.n;
        self.shapes
            .iter()
            .filter(same)
            .find(|s| s.kind == shape.kind)
            .or_else(|| self.shapes.iter().find(same))
    }

    /// Refuse a profile made for a model with other linear shapes: its thresholds would be for
    /// other GEMMs. (The name may differ: a preset and its HF directory are the same model.)
    pub fn check_model(&self, cfg: &ModelConfig) -> Result<()> {
        let want = ModelShapes::of(cfg);
        let mut diffs = Vec::new();
        for s in &want.linears {
            match self.model.shapes.iter().find(|p| p.kind == s.kind) {
                Some(p) if p.k == s.k && p.n == s.n => {}
                Some(p) => diffs.push(format!(
                    "{} is {} here but {} in the profile",
                    s.kind,
                    s.label(),
                    p.label()
                )),
                None => diffs.push(format!("{} is missing from the profile", s.kind)),
            }
        }
        if diffs.is_empty() {
            return Ok(());
        }
        Err(FdppError::InvalidModel {
            model: cfg.name.clone(),
            msg: format!(
                "the profile was made for model '{}' with other shapes ({}); re-run `fdpp tune --model {}`",
                self.model.name,
                diffs.join("; "),
                cfg.name
            ),
        })
    }

    /// Read and validate a profile, with an error that names the file and what to do.
    pub fn load(path: &Path) -> Result<Profile> {
        let err = |msg: String| FdppError::Profile {
            path: path.to_path_buf(),
            msg,
        };
        let text = match fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(err(
                "no such file; make one with `fdpp tune --model <model>` (default path profiles/<device>/<model>.json)"
                    .into(),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                return Err(err(
                    "not a text file (its bytes are not UTF-8), so not an fdpp profile; give the .json that \
                     `fdpp tune` wrote"
                        .into(),
                ))
            }
            Err(e) => return Err(err(format!("cannot read: {e}"))),
        };
        Profile::from_json(&text).map_err(err)
    }

    /// Parse profile JSON; the error is a message for the user (without the path).
    pub fn from_json(text: &str) -> std::result::Result<Profile, String> {
        // The version is read first, alone, so that a profile of another schema gets a version
        // message rather than a confusing "missing field".
        #[derive(Deserialize)]
        struct Head {
            schema_version: Option<serde_json::Value>,
        }
        // Anything but an object is not a profile, whatever else it is.
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| json_error(&e))?;
        if !value.is_object() {
            let kind = match value {
                serde_json::Value::Array(_) => "an array",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                _ => "null",
            };
            return Err(format!(
                "the file holds {kind}, not a JSON object: this is not an fdpp profile (`fdpp tune` writes one)"
            ));
        }
        let head: Head = serde_json::from_value(value).map_err(|e| json_error(&e))?;
        let version = match head.schema_version {
            None => return Err("no `schema_version`: this is not an fdpp profile".into()),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| format!("`schema_version` is {v}, not a number"))?,
        };
        let ours = SCHEMA_VERSION as u64;
        if version > ours {
            return Err(format!(
                "schema_version {version} was made by a newer fdpp (this one reads {ours}); \
                 upgrade fdpp or re-run `fdpp tune`"
            ));
        }
        if version < ours {
            return Err(format!(
                "schema_version {version} was made by an older fdpp (this one reads {ours}); re-run `fdpp tune`"
            ));
        }
        serde_json::from_str(text).map_err(|e| json_error(&e))
    }

    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| FdppError::InvalidArgument(format!("profile does not serialise: {e}")))
    }

    /// Write atomically: a temp file in the same directory, fsync, rename over `path`. A failure
    /// at any step leaves the previous profile at `path` as it was.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut json = self.to_json()?;
        json.push('\n');
        write_atomic(path, json.as_bytes())
    }
}

fn json_error(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    match e.classify() {
        Category::Eof => format!("truncated JSON ({e}); the file was cut short, re-run `fdpp tune` to remake it"),
        Category::Syntax => format!("malformed JSON ({e})"),
        Category::Data => format!("not a valid profile ({e})"),
        Category::Io => format!("cannot read ({e})"),
    }
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn temp_path(path: &Path) -> Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| FdppError::io(path, "not a file path"))?
        .to_string_lossy();
    // Unique per writer within the process too: tensor-parallel ranks are threads of one
    // process and may cache the same kernel at once.
    static WRITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(parent_dir(path).join(format!(".{name}.tmp-{}-{n}", std::process::id())))
}

/// Check before a long run that `path` could be written: its directory can be made and a file
/// created in it. Leaves nothing behind but the directory.
pub fn check_writable(path: &Path) -> Result<()> {
    let dir = parent_dir(path);
    fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, format!("cannot create the directory: {e}")))?;
    if path.is_dir() {
        return Err(FdppError::io(path, "is a directory; give a file path"));
    }
    let tmp = temp_path(path)?;
    fs::File::create(&tmp).map_err(|e| FdppError::io(path, format!("cannot write here: {e}")))?;
    fs::remove_file(&tmp).map_err(|e| FdppError::io(&tmp, e))?;
    Ok(())
}

/// Replace `path` with `bytes` so that a reader sees either the old or the new file, never a
/// partial one, even if the process dies midway.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent_dir(path);
    fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, format!("cannot create the directory: {e}")))?;
    let tmp = temp_path(path)?;
    let res = (|| -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(FdppError::io(
            path,
            format!("cannot write: {e} (any previous file is unchanged)"),
        ));
    }
    // Make the rename itself durable; not every platform can open a directory, hence best effort.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// How much a difference between the profile's machine and this one matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The measurements do not describe this machine: refuse.
    Hard,
    /// Likely still close: warn and use.
    Soft,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    pub severity: Severity,
    pub field: &'static str,
    pub profile: String,
    pub current: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: profile has {}, this machine has {}",
            self.field, self.profile, self.current
        )
    }
}

/// Load a profile for use on this machine and model: hard mismatches (other backend, arch or
/// kernels) and a profile that measures none of the model's shapes are refused with the reason;
/// soft mismatches, shapes that fall back to the vendor GEMM and a softmax window calibrated on
/// another model come back as warnings.
pub fn load_for_use(
    path: &Path,
    cfg: &ModelConfig,
    current: &DeviceInfo,
    kernel_hash: &str,
) -> Result<(Profile, Vec<String>)> {
    let p = Profile::load(path)?;
    let coverage = lookup::Coverage::of(&p, cfg);
    // A profile without a sweep (made by `tune --calibrate`) must be the model's own; one with
    // a sweep must measure at least one of its shapes.
    if p.shapes.is_empty() || coverage.covered.is_empty() {
        p.check_model(cfg)?;
    }
    let mismatches = classify_mismatches(&p.provenance, current, kernel_hash);
    let hard: Vec<String> = mismatches
        .iter()
        .filter(|m| m.severity == Severity::Hard)
        .map(|m| m.to_string())
        .collect();
    if !hard.is_empty() {
        return Err(FdppError::Profile {
            path: path.to_path_buf(),
            msg: format!(
                "made for another machine ({}); re-run `fdpp tune` here",
                hard.join("; ")
            ),
        });
    }
    let mut warnings = load_for_use_warnings(path, &p, current, kernel_hash);
    if !p.shapes.is_empty() && !coverage.missing.is_empty() {
        warnings.push(format!(
            "{}: no entry for {} (made for '{}'): the vendor GEMM runs it",
            path.display(),
            coverage.missing_label(),
            p.model.name
        ));
    }
    if p.softmax.is_some() && !lookup::same_model(&p, cfg) {
        warnings.push(format!(
            "{}: its softmax window was calibrated on '{}', not on '{}'; used as given",
            path.display(),
            p.model.name,
            cfg.name
        ));
    }
    Ok((p, warnings))
}

/// The soft mismatches of a profile with this machine, as warnings naming the file.
pub fn load_for_use_warnings(path: &Path, p: &Profile, current: &DeviceInfo, kernel_hash: &str) -> Vec<String> {
    classify_mismatches(&p.provenance, current, kernel_hash)
        .iter()
        .filter(|m| m.severity == Severity::Soft)
        .map(|m| format!("{}: {m}", path.display()))
        .collect()
}

/// Compare the machine a profile was made on with this one. Hard: another backend, another
/// arch (other kernels, other tensor-core paths), another kernel source hash (the timed code
/// changed). Soft: another device name with the same arch, compute-unit count, memory or cache
/// size, driver or runtime version.
pub fn classify_mismatches(made_on: &Provenance, current: &DeviceInfo, kernel_hash: &str) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let mut push = |severity, field, profile: String, current: String| {
        if profile != current {
            out.push(Mismatch {
                severity,
                field,
                profile,
                current,
            });
        }
    };
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
    let d = &made_on.device;
    push(
        Severity::Hard,
        "backend",
        made_on.backend.to_string(),
        current.backend.to_string(),
    );
    push(Severity::Hard, "arch", d.arch.clone(), current.arch.clone());
    push(
        Severity::Hard,
        "kernel_hash",
        made_on.kernel_hash.clone(),
        kernel_hash.to_string(),
    );
    if let Some(h) = &made_on.hopper_gemm_hash {
        let here = crate::backend::hopper_gemm_hash_of(current).unwrap_or_else(|| "none".into());
        push(Severity::Hard, "hopper_gemm_hash", h.clone(), here);
    }
    push(Severity::Soft, "device name", d.name.clone(), current.name.clone());
    push(
        Severity::Soft,
        "compute units",
        d.compute_units.to_string(),
        current.compute_units.to_string(),
    );
    push(
        Severity::Soft,
        "memory bytes",
        d.memory_bytes.to_string(),
        current.memory_bytes.to_string(),
    );
    push(
        Severity::Soft,
        "L2 bytes",
        d.l2_bytes.to_string(),
        current.l2_bytes.to_string(),
    );
    push(
        Severity::Soft,
        "driver version",
        opt(&d.driver_version),
        opt(&current.driver_version),
    );
    push(
        Severity::Soft,
        "runtime version",
        opt(&d.runtime_version),
        opt(&current.runtime_version),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_pass_section_round_trips_and_its_absence_writes_nothing() {
        let cfg = ModelConfig::resolve("llama2-7b").expect("preset");
        let mut p = Profile::without_gemm(&crate::backend::cpu::CpuBackend::new(), &cfg, DType::F16);
        let none = p.to_json().expect("json");
        assert!(!none.contains("decode_pass"), "{none}");
        assert_eq!(Profile::from_json(&none).expect("parse").decode_pass, None);
        let rows = vec![
            DecodePassRow {
                batch: 1,
                cuda_core_us: 14.2,
                tensor_core_us: 13.1,
            },
            DecodePassRow {
                batch: 32,
                cuda_core_us: 133.0,
                tensor_core_us: 152.0,
            },
        ];
        p.decode_pass = Some(DecodePassSection {
            kv_len: 1024,
            scheme: "sync".into(),
            git_commit: "abc".into(),
            tensor_cores_up_to_batch: DecodePassSection::rule(&rows),
            rows,
        });
        let back = Profile::from_json(&p.to_json().expect("json")).expect("parse");
        assert_eq!(back.decode_pass, p.decode_pass);
        assert_eq!(back.decode_pass.and_then(|d| d.tensor_cores_up_to_batch), Some(1));
    }

    fn dev() -> DeviceInfo {
        DeviceInfo {
            backend: BackendKind::Cuda,
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            slug: "nvidia-h100-80gb-hbm3".into(),
            arch: "sm_90".into(),
            compute_units: 132,
            memory_bytes: 80 << 30,
            l2_bytes: 50 << 20,
            driver_version: Some("580.1".into()),
            runtime_version: Some("13.0".into()),
        }
    }

    fn prov() -> Provenance {
        Provenance {
            device: dev(),
            backend: BackendKind::Cuda,
            fdpp_version: "0.1.0".into(),
            git_commit: "abc".into(),
            kernel_hash: "k1".into(),
            hopper_gemm_hash: None,
            created: "2025-01-01T00:00:00Z".into(),
            run_config: "defaults".into(),
        }
    }

    fn fields(v: &[Mismatch], s: Severity) -> Vec<&'static str> {
        v.iter().filter(|m| m.severity == s).map(|m| m.field).collect()
    }

    #[test]
    fn same_machine_has_no_mismatch() {
        assert!(classify_mismatches(&prov(), &dev(), "k1").is_empty());
    }

    #[test]
    fn ordinal_and_slug_do_not_matter() {
        let mut d = dev();
        d.ordinal = 3;
        assert!(classify_mismatches(&prov(), &d, "k1").is_empty());
    }

    #[test]
    fn hard_mismatches() {
        let mut d = dev();
        d.arch = "sm_80".into();
        let v = classify_mismatches(&prov(), &d, "k1");
        assert_eq!(fields(&v, Severity::Hard), vec!["arch"]);

        let v = classify_mismatches(&prov(), &dev(), "k2");
        assert_eq!(fields(&v, Severity::Hard), vec!["kernel_hash"]);
        assert!(v[0].to_string().contains("k1") && v[0].to_string().contains("k2"));

        let mut d = dev();
        d.backend = BackendKind::Cpu;
        let v = classify_mismatches(&prov(), &d, "k1");
        assert_eq!(fields(&v, Severity::Hard), vec!["backend"]);
    }

    #[test]
    fn a_hopper_gemm_hash_must_match_where_one_was_recorded() {
        // Recorded on sm_90a: the same build matches, another hash is refused.
        let mut d = dev();
        d.arch = "sm_90a".into();
        let mut p = prov();
        p.device.arch = "sm_90a".into();
        p.hopper_gemm_hash = crate::backend::hopper_gemm_hash_of(&d);
        assert!(p.hopper_gemm_hash.is_some());
        assert!(classify_mismatches(&p, &d, "k1").is_empty());
        p.hopper_gemm_hash = Some("0000000000000000".into());
        let v = classify_mismatches(&p, &d, "k1");
        assert_eq!(fields(&v, Severity::Hard), vec!["hopper_gemm_hash"]);
        // A profile without one (made elsewhere or before the kernel) is not checked for it.
        p.hopper_gemm_hash = None;
        assert!(classify_mismatches(&p, &d, "k1").is_empty());
        assert_eq!(crate::backend::hopper_gemm_hash_of(&dev()), None);
    }

    #[test]
    fn soft_mismatches() {
        let mut d = dev();
        d.name = "NVIDIA H100 PCIe".into();
        d.compute_units = 114;
        d.memory_bytes = 81 << 30;
        d.driver_version = Some("590.0".into());
        d.runtime_version = None;
        let v = classify_mismatches(&prov(), &d, "k1");
        assert!(fields(&v, Severity::Hard).is_empty());
        assert_eq!(
            fields(&v, Severity::Soft),
            vec![
                "device name",
                "compute units",
                "memory bytes",
                "driver version",
                "runtime version"
            ]
        );
        assert!(v.iter().any(|m| m.current == "none"));
    }

    #[test]
    fn file_stems_are_one_component() {
        assert_eq!(file_stem("llama2-7b"), "llama2-7b");
        assert_eq!(file_stem("meta-llama/Llama-2-7b"), "meta-llama-Llama-2-7b");
        assert_eq!(file_stem("../x"), "x");
        assert_eq!(file_stem("//"), "unnamed");
        assert_eq!(
            default_path("cpu-x86_64", "Qwen1.5-7B"),
            PathBuf::from("profiles/cpu-x86_64/Qwen1.5-7B.json")
        );
    }

    fn ok(m: usize, t: f64) -> Measurement {
        Measurement::Ok {
            m,
            samples: 3,
            median_us: t,
            min_us: t,
            max_us: t,
            nmse: 1e-8,
        }
    }

    #[test]
    fn best_takes_the_fastest_verified_config() {
        let cands = vec![
            CandidateResult {
                uri: "flat_gemm_f16_bn64".into(),
                imp: GemmImpl::FlatGemm,
                block_n: Some(64),
                stages: None,
                algo: None,
                fused: Vec::new(),
                results: vec![ok(1, 10.0), ok(2, 10.0)],
            },
            CandidateResult {
                uri: "flat_gemm_f16_bn128".into(),
                imp: GemmImpl::FlatGemm,
                block_n: Some(128),
                stages: None,
                algo: None,
                fused: Vec::new(),
                results: vec![
                    ok(1, 12.0),
                    Measurement::Rejected {
                        m: 2,
                        reason: "wrong".into(),
                    },
                ],
            },
            CandidateResult {
                uri: "flat_gemm_f16_bn32".into(),
                imp: GemmImpl::FlatGemm,
                block_n: Some(32),
                stages: None,
                algo: None,
                fused: Vec::new(),
                results: vec![ok(1, 9.0), ok(2, 11.0)],
            },
        ];
        let b = best_per_impl(&[1, 2, 3], &cands);
        assert_eq!(b[0].flat_gemm.as_ref().unwrap().block_n, Some(32));
        assert_eq!(b[1].flat_gemm.as_ref().unwrap().block_n, Some(64));
        assert!(b[2].flat_gemm.is_none(), "no measurement at M=3");
        assert!(b.iter().all(|r| r.gemv.is_none() && r.gemm.is_none()));
    }

    #[test]
    fn a_rejected_fastest_candidate_never_becomes_best() {
        let cands = vec![
            CandidateResult {
                uri: "gemv_f16".into(),
                imp: GemmImpl::Gemv,
                block_n: None,
                stages: None,
                algo: None,
                fused: Vec::new(),
                results: vec![ok(1, 5.0)],
            },
            CandidateResult {
                uri: "flat_gemm_f16_bn64".into(),
                imp: GemmImpl::FlatGemm,
                block_n: Some(64),
                stages: None,
                algo: None,
                fused: Vec::new(),
                results: vec![Measurement::Rejected {
                    m: 1,
                    reason: "NMSE 1".into(),
                }],
            },
        ];
        let sp = ShapeProfile::from_measurements(LinearKind::O, 8, 8, vec![1], cands, 0.02);
        assert_eq!(sp.times(GemmImpl::FlatGemm), vec![None]);
        assert_eq!(sp.times(GemmImpl::Gemv), vec![Some(5.0)]);
        assert_eq!(sp.m1, None);
    }

    fn gemv(bn: u32, plain: &[(usize, f64)], fused: Vec<FusedMeasurement>) -> CandidateResult {
        CandidateResult {
            uri: format!("gemv_f16_bn{bn}"),
            imp: GemmImpl::Gemv,
            block_n: Some(bn),
            stages: None,
            algo: None,
            results: plain.iter().map(|&(m, t)| ok(m, t)).collect(),
            fused,
        }
    }

    fn fused_ok(m: usize, t: f64) -> FusedMeasurement {
        FusedMeasurement::Ok {
            m,
            op: FusedOp::GemmResidualOut,
            samples: 3,
            median_us: t,
            min_us: t,
            max_us: t,
        }
    }

    #[test]
    fn the_gemv_layout_fastest_fused_beats_the_one_fastest_plain() {
        // bn16 is fastest plain at both M, bn8 fastest fused at M = 1; at M = 2 bn8's fused op
        // failed, so bn1 (the only other fused time) is taken; M = 3 has no fused time.
        let cands = vec![
            gemv(
                16,
                &[(1, 10.0), (2, 11.0), (3, 12.0)],
                vec![fused_ok(1, 15.0), fused_ok(2, 16.0)],
            ),
            gemv(
                8,
                &[(1, 11.0), (2, 12.0), (3, 13.0)],
                vec![
                    fused_ok(1, 13.0),
                    FusedMeasurement::Rejected {
                        m: 2,
                        op: FusedOp::GemmResidualOut,
                        reason: "launch failed".into(),
                    },
                ],
            ),
            gemv(
                1,
                &[(1, 12.0), (2, 13.0), (3, 14.0)],
                vec![fused_ok(1, 14.0), fused_ok(2, 14.5)],
            ),
        ];
        let b = best_per_impl(&[1, 2, 3], &cands);
        let pick = |i: usize| b[i].gemv.as_ref().map(|g| (g.block_n, g.median_us));
        // The fused pick keeps its plain time, the one other implementations are compared with.
        assert_eq!(pick(0), Some((Some(8), 11.0)));
        assert_eq!(pick(1), Some((Some(1), 13.0)));
        assert_eq!(pick(2), Some((Some(16), 12.0)));
        // The plain rule, what M1/M2 are read from, still sees bn16 everywhere.
        let plain = best_plain(&[1, 2, 3], &cands);
        assert!(plain
            .iter()
            .all(|r| r.gemv.as_ref().and_then(|g| g.block_n) == Some(16)));
    }

    #[test]
    fn fused_times_do_not_move_m1_or_m2() {
        // Plain: gemv bn16 (10) beats flat_gemm (10.5) by less than the margin at M = 1, loses
        // from M = 2. Fused, bn8 wins but is 14: were its fused time (or its plain 11) compared
        // with flat_gemm, flat_gemm would take M = 1 too.
        let flat = CandidateResult {
            uri: "flat_gemm_f16_bn64".into(),
            imp: GemmImpl::FlatGemm,
            block_n: Some(64),
            stages: None,
            algo: None,
            results: vec![ok(1, 10.5), ok(2, 10.6)],
            fused: Vec::new(),
        };
        let with = vec![
            gemv(16, &[(1, 10.0), (2, 12.0)], vec![fused_ok(1, 16.0), fused_ok(2, 18.0)]),
            gemv(8, &[(1, 11.0), (2, 13.0)], vec![fused_ok(1, 14.0), fused_ok(2, 16.0)]),
            flat.clone(),
        ];
        let without: Vec<CandidateResult> = with
            .iter()
            .cloned()
            .map(|mut c| {
                c.fused.clear();
                c
            })
            .collect();
        let a = ShapeProfile::from_measurements(LinearKind::O, 8, 8, vec![1, 2], with, 0.02);
        let b = ShapeProfile::from_measurements(LinearKind::O, 8, 8, vec![1, 2], without, 0.02);
        assert_eq!((a.m1, a.m2), (Some(2), None));
        assert_eq!((a.m1, a.m2), (b.m1, b.m2));
        assert_eq!(a.best[0].gemv.as_ref().unwrap().block_n, Some(8));
        assert_eq!(b.best[0].gemv.as_ref().unwrap().block_n, Some(16));
        assert_eq!(a.best[0].flat_gemm, b.best[0].flat_gemm);
    }

    #[test]
    fn fused_times_are_optional_in_the_json() {
        let plain = gemv(8, &[(1, 1.0)], Vec::new());
        let j = serde_json::to_string(&plain).unwrap();
        assert!(!j.contains("fused"), "{j}");
        // A candidate written before fused times existed reads back with none.
        let old: CandidateResult =
            serde_json::from_str(r#"{"uri":"gemv_f16_bn8","imp":"gemv","block_n":8,"stages":null,"results":[]}"#)
                .unwrap();
        assert!(old.fused.is_empty());
        let with = gemv(8, &[(1, 1.0)], vec![fused_ok(1, 2.0)]);
        let j = serde_json::to_string(&with).unwrap();
        assert!(
            j.contains(r#""fused":[{"status":"ok","m":1,"op":"gemm_residual_out""#),
            "{j}"
        );
        assert_eq!(serde_json::from_str::<CandidateResult>(&j).unwrap(), with);
        assert_eq!(with.fused_us(1), Some(2.0));
        assert_eq!(with.fused_us(2), None);
    }

    #[test]
    fn measurement_json_is_tagged() {
        let j = serde_json::to_string(&ok(4, 1.5)).unwrap();
        assert!(j.contains(r#""status":"ok""#) && j.contains(r#""m":4"#), "{j}");
        let r: Measurement = serde_json::from_str(r#"{"status":"skipped","m":2,"reason":"unsupported"}"#).unwrap();
        assert_eq!(r.m(), 2);
        assert_eq!(r.median_us(), None);
    }

    #[test]
    fn version_errors_say_newer_or_older() {
        let e = Profile::from_json(r#"{"schema_version": 99}"#).unwrap_err();
        assert!(e.contains("newer") && e.contains("fdpp tune"), "{e}");
        let e = Profile::from_json(r#"{"schema_version": 0, "other": 1}"#).unwrap_err();
        assert!(e.contains("older") && e.contains("fdpp tune"), "{e}");
        let e = Profile::from_json(r#"{"x": 1}"#).unwrap_err();
        assert!(e.contains("not an fdpp profile"), "{e}");
        let e = Profile::from_json(r#"{"schema_version": "one"}"#).unwrap_err();
        assert!(e.contains("not a number"), "{e}");
    }

    #[test]
    fn json_errors_give_line_and_column() {
        let e = Profile::from_json("{\n  \"schema_version\": 1,\n  \"provenance\": {").unwrap_err();
        assert!(e.contains("truncated") && e.contains("line 3"), "{e}");
        let e = Profile::from_json("{\n  \"schema_version\": 1,,\n}").unwrap_err();
        assert!(e.contains("malformed") && e.contains("line 2"), "{e}");
        let e = Profile::from_json("{\"schema_version\": 1}").unwrap_err();
        assert!(e.contains("not a valid profile") && e.contains("missing field"), "{e}");
    }
}
