//! Building an [`Engine`] for a request: the memory plan first (a batch that cannot fit fails
//! before any weight is read), then the weights, the KV pools and the activation buffers.

use std::path::PathBuf;

use crate::backend::{Backend, BackendKind};
use crate::dtype::DType;
use crate::engine::forward::Model;
use crate::engine::linear::LinearPlanner;
use crate::engine::memory::{self, ActDims, MemoryPlan, MemoryRequest};
use crate::engine::runner::{Engine, DEFAULT_CHUNK};
use crate::error::{FdppError, Result};
use crate::kv::DEFAULT_PAGE_SIZE;
use crate::model::family;
use crate::model::spec::ModelSpec;
use crate::model::weights::WeightStore;
use crate::ops::attention::SoftmaxScheme;
use crate::profile::Profile;

/// Where the weights come from.
#[derive(Clone, Debug)]
pub enum WeightSource {
    /// Generated on the backend from this seed (see [`family::random`]).
    Random { seed: u64 },
    /// The safetensors of an HF directory.
    Dir(PathBuf),
    /// A GGUF file, dequantized tensor by tensor as it is uploaded.
    Gguf(PathBuf),
}

impl WeightSource {
    /// For output: where the weights came from.
    pub fn describe(&self) -> String {
        match self {
            WeightSource::Random { seed } => format!("random (seed {seed}, generated on the device)"),
            WeightSource::Dir(d) => format!("loaded from {}", d.display()),
            WeightSource::Gguf(f) => format!("dequantized from {}", f.display()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub dtype: DType,
    pub mem_fraction: f64,
    pub page_size: usize,
    /// Tokens per prefill step.
    pub chunk: usize,
    /// Reuse activation buffers across layers (`--no-reuse` turns it off).
    pub reuse: bool,
    /// `--max-kv-tokens`: None = every page the pool holds on a GPU, and on the CPU just the
    /// pages the request needs (the host's memory is shared with everything else).
    pub max_kv_tokens: Option<usize>,
    pub scheme: SoftmaxScheme,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            dtype: DType::F16,
            mem_fraction: 0.9,
            page_size: DEFAULT_PAGE_SIZE,
            chunk: DEFAULT_CHUNK,
            reuse: true,
            max_kv_tokens: None,
            scheme: SoftmaxScheme::ASYNC_DEFAULT,
        }
    }
}

/// The memory plan for sequences of `seq_tokens` tokens each (prompt plus generated) with
/// prompts of `prompt_tokens` in all.
pub fn memory_plan<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    opts: &EngineOptions,
    seq_tokens: &[usize],
    prompt_tokens: usize,
) -> Result<MemoryPlan> {
    if opts.chunk == 0 {
        return Err(FdppError::InvalidArgument("--chunk-size must be at least 1".into()));
    }
    let arch = spec.arch()?;
    let batch = seq_tokens.len().max(1);
    let max_step = opts.chunk.min(prompt_tokens).max(batch);
    let cap = match (opts.max_kv_tokens, b.info().backend) {
        (Some(t), _) => Some(t),
        (None, BackendKind::Cpu) => Some(
            seq_tokens
                .iter()
                .map(|t| t.div_ceil(opts.page_size.max(1)) * opts.page_size)
                .sum(),
        ),
        (None, _) => None,
    };
    memory::plan(
        &spec.cfg,
        &ActDims::of(&arch),
        &MemoryRequest {
            dtype: opts.dtype,
            device_memory: b.info().memory_bytes,
            mem_fraction: opts.mem_fraction,
            weights_bytes: family::weights_bytes(&arch, opts.dtype),
            max_step_tokens: max_step,
            max_batch: batch,
            page_size: opts.page_size,
            reuse: opts.reuse,
            seq_tokens: seq_tokens.to_vec(),
            kv_tokens_cap: cap,
        },
    )
}

/// Load (or generate) the weights and allocate everything `plan` describes.
pub fn build<'b, B: Backend>(
    b: &'b B,
    spec: &ModelSpec,
    source: &WeightSource,
    profile: Option<Profile>,
    opts: &EngineOptions,
    plan: MemoryPlan,
) -> Result<Engine<'b, B>> {
    let model = build_model(b, spec, source, profile, opts)?;
    Engine::new(model, plan)
}

/// The model alone (weights, linear planner, softmax scheme), for callers that run several
/// engines — memory plans — over the same weights (`fdpp bench e2e`).
pub fn build_model<'b, B: Backend>(
    b: &'b B,
    spec: &ModelSpec,
    source: &WeightSource,
    profile: Option<Profile>,
    opts: &EngineOptions,
) -> Result<Model<'b, B>> {
    let arch = spec.arch()?;
    let weights = match source {
        WeightSource::Random { seed } => family::random(b, &arch, opts.dtype, *seed)?,
        WeightSource::Dir(dir) => {
            let store = WeightStore::open(dir)?;
            family::load(b, &store, &arch, opts.dtype)?
        }
        WeightSource::Gguf(path) => {
            let file = crate::model::gguf::GgufFile::open(path)?;
            let permute = spec.cfg.arch == crate::model::ModelArch::Llama;
            let store = crate::model::gguf::GgufStore::new(file, permute, spec.cfg.num_heads, spec.cfg.num_kv_heads)?;
            family::load(b, &store, &arch, opts.dtype)?
        }
    };
    // What the profile does not cover (all of it without one) follows the backend's rule.
    let fallback = crate::select::Fallback::configured(b.info().backend)?;
    let linears = LinearPlanner::new(&spec.cfg, opts.dtype, profile).with_fallback(fallback);
    let model = Model::new(
        b,
        spec.cfg.clone(),
        &spec.extras,
        opts.dtype,
        weights,
        linears,
        opts.scheme,
    )?;
    Ok(model)
}

/// `--softmax`: the attention softmax scheme (FlashDecoding++ §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SoftmaxChoice {
    /// Running max with rescale (the FlashDecoding baseline).
    Sync,
    /// Unified max φ with the profile's φ, a, b (or the safe default).
    Async,
}

/// The scheme to run and a line saying where it came from: `--softmax sync` is the baseline;
/// otherwise the async scheme with the profile's calibrated φ, a, b when it has them, else
/// [`SoftmaxScheme::ASYNC_DEFAULT`]; sync when the profile's calibration disabled async.
pub fn softmax_scheme(choice: Option<SoftmaxChoice>, profile: Option<&Profile>) -> Result<(SoftmaxScheme, String)> {
    if choice == Some(SoftmaxChoice::Sync) {
        return Ok((SoftmaxScheme::Sync, "softmax: sync (asked for)".into()));
    }
    match profile.and_then(|p| p.softmax.as_ref()) {
        // Calibration found the scores too wide for an fp32 window (FlashDecoding++ §3: such
        // models keep the synchronous softmax). Asked for explicitly, async still runs
        // correctly with the default window (flagged rows are recomputed), only slower.
        Some(s) if !s.enabled => {
            let why = s.reason.as_deref().unwrap_or("no reason recorded");
            if choice == Some(SoftmaxChoice::Async) {
                Ok((
                    SoftmaxScheme::ASYNC_DEFAULT,
                    format!(
                        "softmax: {} (asked for; the profile disables async for this model: {why})",
                        SoftmaxScheme::ASYNC_DEFAULT.label()
                    ),
                ))
            } else {
                Ok((
                    SoftmaxScheme::Sync,
                    format!("softmax: sync (the profile disables async for this model: {why})"),
                ))
            }
        }
        Some(s) => {
            let scheme = SoftmaxScheme::Async {
                phi: s.phi as f32,
                a: s.a as f32,
                b: s.b as f32,
            };
            scheme.validate().map_err(|e| {
                FdppError::InvalidArgument(format!(
                    "the profile's softmax section is unusable ({e}); re-run the calibration or pass --softmax sync"
                ))
            })?;
            let cov = s.coverage.map(|c| format!(", coverage {c}")).unwrap_or_default();
            Ok((scheme, format!("softmax: {} from the profile{cov}", scheme.label())))
        }
        None => Ok((
            SoftmaxScheme::ASYNC_DEFAULT,
            format!(
                "softmax: {} (default; {})",
                SoftmaxScheme::ASYNC_DEFAULT.label(),
                if profile.is_some() {
                    "the profile has no softmax section"
                } else {
                    "no profile"
                }
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::SoftmaxSection;

    fn scheme_of(section: SoftmaxSection, choice: Option<SoftmaxChoice>) -> (SoftmaxScheme, String) {
        let b = crate::backend::cpu::CpuBackend::new();
        let cfg = crate::model::ModelConfig::resolve("llama2-7b").expect("preset");
        let mut p = Profile::without_gemm(&b, &cfg, DType::F16);
        p.softmax = Some(section);
        softmax_scheme(choice, Some(&p)).expect("scheme")
    }

    #[test]
    fn a_disabled_section_runs_sync_and_says_why() {
        let mut s = SoftmaxSection::window(0.0, -30.0, 30.0, Some(0.9999));
        let (on, note) = scheme_of(s.clone(), None);
        assert_eq!(
            on,
            SoftmaxScheme::Async {
                phi: 0.0,
                a: -30.0,
                b: 30.0
            }
        );
        assert!(note.contains("from the profile"), "{note}");
        s.enabled = false;
        s.reason = Some("too wide: 99.99 % span 120".into());
        let (off, note) = scheme_of(s.clone(), None);
        assert_eq!(off, SoftmaxScheme::Sync);
        assert!(note.contains("disables async") && note.contains("span 120"), "{note}");
        let (asked, note) = scheme_of(s, Some(SoftmaxChoice::Async));
        assert_eq!(asked, SoftmaxScheme::ASYNC_DEFAULT);
        assert!(note.contains("asked for"), "{note}");
    }
}
