//! Building an [`Engine`] for a request: the memory plan first (a batch that cannot fit fails
//! before any weight is read), then the weights, the KV pools and the activation buffers.

use std::path::PathBuf;
use std::sync::Arc;

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
use crate::profile::{Profile, SoftmaxSection};
use crate::run_config::{Key, RunConfig};
use crate::tp;

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
    /// One async window per layer (the profile's calibrated ones, [`softmax_setup`]); empty:
    /// `scheme` for every layer. Ignored while `scheme` is sync.
    pub layer_schemes: Vec<SoftmaxScheme>,
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
            layer_schemes: Vec::new(),
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
    let weights = load_weights(b, spec, source, opts.dtype, None)?;
    assemble(b, spec, weights, profile, opts)
}

/// The model of one rank of `comm`'s tensor-parallel group (issue #22): the rank's config
/// ([`tp::rank_config`]: its heads, KV heads and intermediate slice, so its GEMM shapes, KV
/// cache and profile lookup are the per-rank ones), its slices of the checkpoint
/// ([`tp::source`]), and the all-reduces between its layers. `spec` is the whole model's; plan
/// the rank's memory with [`tp::rank_spec`]. Random weights are each rank's own draw (a model
/// of the same shape and scales as the whole random model, not its slices): for benchmarks.
pub fn build_rank_model<'b, B: Backend>(
    b: &'b B,
    spec: &ModelSpec,
    source: &WeightSource,
    profile: Option<Profile>,
    opts: &EngineOptions,
    comm: Arc<dyn tp::Communicator<B> + 'b>,
) -> Result<Model<'b, B>> {
    let (rank, world) = (comm.rank(), comm.world());
    let split = tp::Split::new(&spec.cfg, rank, world)?;
    let rank_spec = tp::rank_spec(spec, world)?;
    let weights = load_weights(b, &rank_spec, source, opts.dtype, Some((spec, split)))?;
    let mut model = assemble(b, &rank_spec, weights, profile, opts)?;
    model.set_comm(comm)?;
    Ok(model)
}

/// The weights of `spec`; with `whole`, `spec` is one rank's model, cut from the whole
/// model's checkpoint by the split.
fn load_weights<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    source: &WeightSource,
    dtype: DType,
    whole: Option<(&ModelSpec, tp::Split)>,
) -> Result<crate::model::tensors::ModelWeights<B::Buffer>> {
    let arch = spec.arch()?;
    let read = |src: &dyn crate::model::weights::TensorSource| match &whole {
        None => family::load(b, src, &arch, dtype),
        Some((full, split)) => {
            let cut = tp::source::ShardSource::new(src, &full.arch()?, &arch, split.clone())?;
            family::load(b, &cut, &arch, dtype)
        }
    };
    match source {
        WeightSource::Random { seed } => {
            let seed = match &whole {
                Some((_, split)) if split.world > 1 => seed ^ (split.rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                _ => *seed,
            };
            family::random(b, &arch, dtype, seed)
        }
        WeightSource::Dir(dir) => read(&WeightStore::open(dir)?),
        WeightSource::Gguf(path) => {
            // GGUF's Llama q/k rows are permuted back per head of the whole model.
            let cfg = whole.as_ref().map_or(&spec.cfg, |(full, _)| &full.cfg);
            let file = crate::model::gguf::GgufFile::open(path)?;
            let permute = cfg.arch == crate::model::ModelArch::Llama;
            let store = crate::model::gguf::GgufStore::new(file, permute, cfg.num_heads, cfg.num_kv_heads)?;
            read(&store)
        }
    }
}

/// The model over loaded weights: the linear planner (profile and the backend's fallback)
/// and the softmax windows.
fn assemble<'b, B: Backend>(
    b: &'b B,
    spec: &ModelSpec,
    weights: crate::model::tensors::ModelWeights<B::Buffer>,
    profile: Option<Profile>,
    opts: &EngineOptions,
) -> Result<Model<'b, B>> {
    // What the profile does not cover (all of it without one) follows the backend's rule.
    let fallback = crate::select::Fallback::configured(b.info().backend)?;
    let decode_tc_up_to = profile
        .as_ref()
        .and_then(|p| p.decode_pass.as_ref())
        .and_then(|d| d.tensor_cores_up_to_batch);
    let linears = LinearPlanner::new(&spec.cfg, opts.dtype, profile).with_fallback(fallback);
    let mut model = Model::new(
        b,
        spec.cfg.clone(),
        &spec.extras,
        opts.dtype,
        weights,
        linears,
        opts.scheme,
    )?;
    model.set_layer_schemes(opts.layer_schemes.clone())?;
    model.decode_tc_up_to = decode_tc_up_to;
    prepare_linears(b, &mut model)?;
    Ok(model)
}

/// Each layer's four linear weights into the layout the backend's GEMMs read
/// ([`Backend::prepare_linear_weight`]), once, after anything that rewrites them (the norm
/// folding in `Model::new`). The LM head is left as loaded: it may be the tied embedding table.
fn prepare_linears<B: Backend>(b: &B, model: &mut Model<'_, B>) -> Result<()> {
    let a = &model.arch;
    let (h, qkv, q, ffn1, inter) = (a.hidden, a.qkv_width(), a.q_width(), a.ffn1_width(), a.inter);
    for l in model.weights.layers.iter_mut() {
        b.prepare_linear_weight(&mut l.qkv, qkv, h)?;
        b.prepare_linear_weight(&mut l.o, h, q)?;
        b.prepare_linear_weight(&mut l.ffn1, ffn1, h)?;
        b.prepare_linear_weight(&mut l.ffn2, h, inter)?;
    }
    Ok(())
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

/// `softmax_windows` (run configuration): which async window each layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowsChoice {
    /// Each layer's own calibrated window where the profile has one (the default).
    PerLayer,
    /// The global window for every layer.
    Global,
}

impl WindowsChoice {
    /// The run configuration's `softmax_windows` (default per_layer).
    pub fn from_config(cfg: &RunConfig) -> Result<Self> {
        match cfg.get(Key::SoftmaxWindows) {
            None | Some("per_layer") | Some("per-layer") => Ok(WindowsChoice::PerLayer),
            Some("global") => Ok(WindowsChoice::Global),
            Some(v) => Err(FdppError::InvalidArgument(format!(
                "softmax_windows={v}: expected per_layer or global (--set softmax_windows=global, or \
                 FDPP_SOFTMAX_WINDOWS)"
            ))),
        }
    }
}

/// Each layer's async window from the profile's `softmax.per_layer` (FlashDecoding++ §3: the
/// unified max φ only has to sit near the scores of the rows it serves, and one layer's scores
/// sit in a narrower band than all layers' together, so its own φ and [a, b] flag fewer rows
/// for recomputation and keep e^(x − φ) nearer 1). Empty when `scheme` is sync, when
/// `windows` is global, or when the profile has no per-layer windows: `scheme` then serves
/// every layer. A layer whose window the calibration marked too wide, or that the profile
/// lacks, runs `scheme` (the global window). The string says what was chosen (None: nothing
/// to say).
pub fn layer_schemes(
    scheme: SoftmaxScheme,
    section: Option<&SoftmaxSection>,
    layers: usize,
    windows: WindowsChoice,
) -> Result<(Vec<SoftmaxScheme>, Option<String>)> {
    let Some(section) = section.filter(|s| !s.per_layer.is_empty()) else {
        return Ok((Vec::new(), None));
    };
    if scheme == SoftmaxScheme::Sync {
        return Ok((Vec::new(), None));
    }
    if windows == WindowsChoice::Global {
        return Ok((
            Vec::new(),
            Some("softmax windows: global for every layer (softmax_windows=global)".into()),
        ));
    }
    let mut out = vec![None; layers];
    for lw in &section.per_layer {
        if lw.layer >= layers {
            return Err(FdppError::InvalidArgument(format!(
                "the profile's softmax.per_layer has a window for layer {}, but the model has {layers} layers: \
                 re-run `fdpp tune --calibrate` for this model, or --set softmax_windows=global",
                lw.layer
            )));
        }
        let w = SoftmaxScheme::Async {
            phi: lw.phi as f32,
            a: lw.a as f32,
            b: lw.b as f32,
        };
        if lw.reason.is_none() && w.validate().is_ok() {
            out[lw.layer] = Some(w);
        }
    }
    let own = out.iter().flatten().count();
    if own == 0 {
        return Ok((
            Vec::new(),
            Some("softmax windows: global (no layer's own window is usable: each is too wide alone)".into()),
        ));
    }
    let phis: Vec<f32> = out
        .iter()
        .flatten()
        .filter_map(|s| match s {
            SoftmaxScheme::Async { phi, .. } => Some(*phi),
            SoftmaxScheme::Sync => None,
        })
        .collect();
    let (lo, hi) = phis
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &p| (l.min(p), h.max(p)));
    let note = format!(
        "softmax windows: per layer from the profile ({own} of {layers} layers their own, phi {lo:.2} to {hi:.2}{}; \
         --set softmax_windows=global for one window)",
        if own < layers {
            format!("; {} on the global window", layers - own)
        } else {
            String::new()
        }
    );
    Ok((out.into_iter().map(|s| s.unwrap_or(scheme)).collect(), Some(note)))
}

/// The scheme, the per-layer windows and the lines saying where they came from: what
/// [`softmax_scheme`] and [`layer_schemes`] choose, with `softmax_windows` from the run
/// configuration.
pub fn softmax_setup(
    choice: Option<SoftmaxChoice>,
    profile: Option<&Profile>,
    layers: usize,
) -> Result<(SoftmaxScheme, Vec<SoftmaxScheme>, String)> {
    let (scheme, mut note) = softmax_scheme(choice, profile)?;
    let windows = WindowsChoice::from_config(crate::run_config::get())?;
    let (per_layer, more) = layer_schemes(scheme, profile.and_then(|p| p.softmax.as_ref()), layers, windows)?;
    if let Some(m) = more {
        note.push('\n');
        note.push_str(&m);
    }
    Ok((scheme, per_layer, note))
}

/// `sync`, `async(phi=…,a=…,b=…)`, or `async(per-layer windows)` when layers have their own.
pub fn softmax_label(scheme: SoftmaxScheme, per_layer: &[SoftmaxScheme]) -> String {
    if scheme != SoftmaxScheme::Sync && per_layer.iter().any(|s| *s != scheme) {
        "async(per-layer windows)".into()
    } else {
        scheme.label()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

#[cfg(test)]
mod layer_window_tests {
    use super::*;
    use crate::profile::LayerWindow;

    fn lw(layer: usize, phi: f64, too_wide: bool) -> LayerWindow {
        LayerWindow {
            layer,
            phi,
            a: -10.0,
            b: 10.0,
            coverage: 0.9999,
            samples: 100,
            min: phi - 5.0,
            max: phi + 5.0,
            reason: too_wide.then(|| "too wide".to_string()),
        }
    }

    fn profile(per_layer: Vec<LayerWindow>) -> Profile {
        let b = crate::backend::cpu::CpuBackend::new();
        let cfg = crate::model::ModelConfig::resolve("llama2-7b").expect("preset");
        let mut p = Profile::without_gemm(&b, &cfg, DType::F16);
        let mut s = SoftmaxSection::window(-2.0, -30.0, 30.0, Some(0.9999));
        s.per_layer = per_layer;
        p.softmax = Some(s);
        p
    }

    #[test]
    fn each_layer_gets_its_window_and_the_global_one_where_it_has_none() {
        let p = profile(vec![lw(0, -5.0, false), lw(1, 3.0, true), lw(3, 1.5, false)]);
        let (scheme, _) = softmax_scheme(None, Some(&p)).unwrap();
        let sec = p.softmax.as_ref();
        let (per, note) = layer_schemes(scheme, sec, 4, WindowsChoice::PerLayer).unwrap();
        let own = |phi: f32| SoftmaxScheme::Async { phi, a: -10.0, b: 10.0 };
        assert_eq!(per, vec![own(-5.0), scheme, scheme, own(1.5)]);
        let note = note.unwrap();
        assert!(note.contains("2 of 4") && note.contains("2 on the global"), "{note}");
        assert_eq!(softmax_label(scheme, &per), "async(per-layer windows)");
        // Global asked for, sync, or no per-layer windows: none.
        let (g, note) = layer_schemes(scheme, sec, 4, WindowsChoice::Global).unwrap();
        assert!(g.is_empty() && note.unwrap().contains("softmax_windows=global"));
        assert!(layer_schemes(SoftmaxScheme::Sync, sec, 4, WindowsChoice::PerLayer)
            .unwrap()
            .0
            .is_empty());
        let empty = profile(vec![]);
        assert!(
            layer_schemes(scheme, empty.softmax.as_ref(), 4, WindowsChoice::PerLayer)
                .unwrap()
                .0
                .is_empty()
        );
        assert_eq!(softmax_label(scheme, &[]), scheme.label());
    }

    #[test]
    fn a_window_for_a_layer_the_model_lacks_is_an_error_naming_the_switch() {
        let p = profile(vec![lw(7, 0.0, false)]);
        let e = layer_schemes(
            SoftmaxScheme::ASYNC_DEFAULT,
            p.softmax.as_ref(),
            4,
            WindowsChoice::PerLayer,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("layer 7") && e.contains("softmax_windows=global"), "{e}");
    }

    #[test]
    fn the_switch_parses_and_refuses_unknown_values() {
        let cfg = |v: &str| RunConfig::build(|_| None, &[format!("softmax_windows={v}")]).unwrap();
        assert_eq!(
            WindowsChoice::from_config(&cfg("global")).unwrap(),
            WindowsChoice::Global
        );
        assert_eq!(
            WindowsChoice::from_config(&cfg("per_layer")).unwrap(),
            WindowsChoice::PerLayer
        );
        let none = RunConfig::build(|_| None, &[]).unwrap();
        assert_eq!(WindowsChoice::from_config(&none).unwrap(), WindowsChoice::PerLayer);
        // A value outside the choices is refused when the configuration is built (the CLI's
        // start-up), before this reader sees it.
        let e = RunConfig::build(|_| None, &["softmax_windows=layer".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("softmax_windows=layer") && e.contains("per_layer|global"),
            "{e}"
        );
    }
}
