//! Parse a Hugging Face `config.json` into a [`ModelConfig`].
//!
//! Each family spells the same quantities differently (OPT's `ffn_dim`, ChatGLM's
//! `multi_query_group_num`, `kv_channels`, `padded_vocab_size`, `seq_length`); the table in
//! [`Keys::of`] maps them onto HF LlamaConfig's names. Absent optional fields take the default
//! of the family's HF config class, so that a config parses to what transformers would build.

use std::path::Path;

use serde_json::{Map, Value};

use super::config::{ModelArch, ModelConfig, RopeScaling};
use crate::error::{FdppError, Result};
use crate::ops::layer::Activation;

/// `architectures[0]` values we accept, and the family each maps to.
const ARCHITECTURES: &[(&str, ModelArch)] = &[
    ("LlamaForCausalLM", ModelArch::Llama),
    ("MistralForCausalLM", ModelArch::Mistral),
    ("Qwen2ForCausalLM", ModelArch::Qwen2),
    ("OPTForCausalLM", ModelArch::Opt),
    ("ChatGLMModel", ModelArch::ChatGlm),
    ("ChatGLMForConditionalGeneration", ModelArch::ChatGlm),
];

/// The keys one family uses for each quantity, the preferred spelling first.
struct Keys {
    layers: &'static [&'static str],
    /// Empty: the family has no grouped KV heads (KV heads = query heads).
    kv_heads: &'static [&'static str],
    /// Empty: always hidden / heads.
    head_dim: &'static [&'static str],
    intermediate: &'static [&'static str],
    vocab: &'static [&'static str],
    max_positions: &'static [&'static str],
    eps: &'static [&'static str],
    default_max_positions: usize,
    default_eps: f64,
    default_tie: bool,
}

impl Keys {
    fn of(arch: ModelArch) -> Keys {
        // Defaults are those of transformers' LlamaConfig, MistralConfig, Qwen2Config, OPTConfig
        // and THUDM's ChatGLMConfig.
        let llama_like = |default_max_positions| Keys {
            layers: &["num_hidden_layers"],
            kv_heads: &["num_key_value_heads"],
            head_dim: &["head_dim"],
            intermediate: &["intermediate_size"],
            vocab: &["vocab_size"],
            max_positions: &["max_position_embeddings"],
            eps: &["rms_norm_eps"],
            default_max_positions,
            default_eps: 1e-6,
            default_tie: false,
        };
        match arch {
            ModelArch::Llama => llama_like(2048),
            ModelArch::Mistral => llama_like(4096 * 32),
            ModelArch::Qwen2 => llama_like(32768),
            ModelArch::Opt => Keys {
                layers: &["num_hidden_layers"],
                kv_heads: &[],
                head_dim: &[],
                intermediate: &["ffn_dim"],
                vocab: &["vocab_size"],
                max_positions: &["max_position_embeddings"],
                eps: &[],
                default_max_positions: 2048,
                // torch.nn.LayerNorm's default: OPT's config does not carry one.
                default_eps: 1e-5,
                // OPTForCausalLM ties lm_head to embed_tokens unless told otherwise.
                default_tie: true,
            },
            ModelArch::ChatGlm => Keys {
                layers: &["num_layers", "num_hidden_layers"],
                kv_heads: &["multi_query_group_num", "num_key_value_heads"],
                head_dim: &["kv_channels", "head_dim"],
                intermediate: &["ffn_hidden_size", "intermediate_size"],
                // The embedding and output layer are sized by the padded vocabulary.
                vocab: &["padded_vocab_size", "vocab_size"],
                max_positions: &["seq_length", "max_position_embeddings"],
                eps: &["layernorm_epsilon"],
                default_max_positions: 2048,
                default_eps: 1e-5,
                default_tie: false,
            },
        }
    }
}

/// Parse the text of `path` (used in messages only); `name` becomes `ModelConfig::name`.
pub fn parse(text: &str, path: &Path, name: String) -> Result<ModelConfig> {
    let err = |msg: String| FdppError::Config {
        path: path.to_path_buf(),
        msg,
    };
    let value: Value = serde_json::from_str(text).map_err(|e| {
        // serde_json appends the position itself; say it once, up front.
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let what = full.strip_suffix(&suffix).unwrap_or(&full);
        err(format!(
            "malformed JSON at line {}, column {}: {what}",
            e.line(),
            e.column()
        ))
    })?;
    let Value::Object(obj) = &value else {
        return Err(err(format!(
            "expected a JSON object at the top level, found {}",
            describe(&value)
        )));
    };
    let f = Fields { obj, path };
    let arch = detect_arch(&f)?;
    let keys = Keys::of(arch);

    let hidden_size = f.usize_req(&["hidden_size"])?;
    let num_layers = f.usize_req(keys.layers)?;
    let num_heads = f.usize_req(&["num_attention_heads"])?;
    if num_heads == 0 {
        return Err(err(
            "field 'num_attention_heads' is 0: a model needs at least one attention head".into(),
        ));
    }

    // ChatGLM only groups KV heads when multi_query_attention is on; otherwise it is plain MHA.
    let grouped = arch != ModelArch::ChatGlm || f.bool_opt("multi_query_attention")?.unwrap_or(false);
    let kv = if grouped { f.usize_opt(keys.kv_heads)? } else { None };
    let num_kv_heads = match kv {
        Some((key, 0)) => {
            return Err(err(format!(
                "field '{key}' is 0: a model needs at least one key/value head"
            )))
        }
        Some((key, n)) if !num_heads.is_multiple_of(n) => {
            return Err(err(format!(
                "field '{key}' ({n}) does not divide num_attention_heads ({num_heads}): each KV \
                 head must serve a whole group of query heads"
            )))
        }
        Some((_, n)) => n,
        None => num_heads,
    };

    let head_dim = match f.usize_opt(keys.head_dim)? {
        Some((_, d)) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(err(format!(
                "hidden_size ({hidden_size}) is not divisible by num_attention_heads \
                 ({num_heads}) and no head_dim is given, so the head dimension is undefined"
            )))
        }
    };

    let rope_theta = rope_theta(&f, arch)?;
    let qkv_bias = match arch {
        ModelArch::Llama => f.bool_opt("attention_bias")?.unwrap_or(false),
        ModelArch::Mistral => false,
        // Qwen2Attention always builds q/k/v with bias=True; there is no switch in the config.
        ModelArch::Qwen2 => true,
        ModelArch::Opt => f.bool_opt("enable_bias")?.unwrap_or(true),
        ModelArch::ChatGlm => f.bool_opt("add_qkv_bias")?.unwrap_or(false),
    };

    let cfg = ModelConfig {
        name,
        arch,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: f.usize_req(keys.intermediate)?,
        vocab_size: f.usize_req(keys.vocab)?,
        max_position_embeddings: f
            .usize_opt(keys.max_positions)?
            .map_or(keys.default_max_positions, |(_, n)| n),
        rope_theta,
        rms_norm_eps: f.f64_opt(keys.eps)?.unwrap_or(keys.default_eps),
        tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(keys.default_tie),
        qkv_bias,
        gated_ffn: arch != ModelArch::Opt,
    };
    // validate() speaks of the model; here the user needs to know which file to fix.
    cfg.validate().map_err(|e| match e {
        FdppError::InvalidModel { msg, .. } => err(msg),
        other => other,
    })?;
    Ok(cfg)
}

/// The family from `architectures[0]`, else from `model_type`.
fn detect_arch(f: &Fields) -> Result<ModelArch> {
    let architecture = match f.obj.get("architectures") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => match items.first() {
            None => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(other) => {
                return Err(f.err(format!(
                    "field 'architectures' must hold strings, found {}",
                    describe(other)
                )))
            }
        },
        Some(other) => {
            return Err(f.err(format!(
                "field 'architectures' must be an array of strings, found {}",
                describe(other)
            )))
        }
    };
    let model_type = f.str_opt("model_type")?;
    if let Some(arch) = architecture
        .and_then(|a| ARCHITECTURES.iter().find(|(name, _)| *name == a))
        .map(|(_, arch)| *arch)
    {
        return Ok(arch);
    }
    if let Some(arch) = model_type.and_then(|t| ModelArch::ALL.into_iter().find(|a| a.name() == t)) {
        return Ok(arch);
    }
    let supported = format!(
        "supported: {} (model_type {})",
        ARCHITECTURES
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", "),
        ModelArch::ALL.map(ModelArch::name).join(", ")
    );
    Err(f.err(match (architecture, model_type) {
        (Some(a), Some(t)) => format!("unsupported architecture '{a}' (model_type '{t}'); {supported}"),
        (Some(a), None) => format!("unsupported architecture '{a}'; {supported}"),
        (None, Some(t)) => format!("unsupported model_type '{t}'; {supported}"),
        (None, None) => format!(
            "neither 'architectures' nor 'model_type' is given, so the model family is unknown; \
             {supported}"
        ),
    }))
}

fn rope_theta(f: &Fields, arch: ModelArch) -> Result<f64> {
    const DEFAULT: f64 = 10000.0;
    if arch == ModelArch::ChatGlm {
        // ChatGLM scales the fixed base 10000 by rope_ratio (50 in chatglm3-6b-32k).
        return Ok(DEFAULT * f.f64_opt(&["rope_ratio"])?.unwrap_or(1.0));
    }
    if let Some(theta) = f.f64_opt(&["rope_theta"])? {
        return Ok(theta);
    }
    // transformers 5 moves rope_theta into a rope_parameters object.
    if let Some(params) = f.obj.get("rope_parameters") {
        if let Value::Object(inner) = params {
            let sub = Fields {
                obj: inner,
                path: f.path,
            };
            if let Some(theta) = sub.f64_opt(&["rope_theta"])? {
                return Ok(theta);
            }
        } else if !params.is_null() {
            return Err(f.err(format!(
                "field 'rope_parameters' must be an object, found {}",
                describe(params)
            )));
        }
    }
    Ok(DEFAULT)
}

/// What the engine needs from config.json beyond [`ModelConfig`] (the shapes and the tuner do
/// not depend on it), plus the EOS ids of generation_config.json when the directory has one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HfExtras {
    pub rope_scaling: Option<RopeScaling>,
    /// Generation stops at any of these (config.json's, then generation_config.json's).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// Mistral's sliding-window span; None: every token attends to its whole prefix.
    pub sliding_window: Option<usize>,
    /// The MLP's activation (`hidden_act`, OPT's `activation_function`); None: the family's
    /// default ([`crate::model::arch::Arch::of`]).
    pub hidden_act: Option<Activation>,
    /// OPT's `word_embed_proj_dim` when it differs from hidden_size: the embedding and the LM
    /// head are this wide, and project_in / project_out map to and from the hidden size.
    pub embed_proj_dim: Option<usize>,
    /// Bias on the O projection and the MLP (OPT's `enable_bias`, ChatGLM's
    /// `add_bias_linear`); None: the family's default.
    pub linear_bias: Option<bool>,
    /// Settings of the config that the engine's forward pass does not run, as (field, value):
    /// the shapes and the tuner do not care, `Arch::of` refuses them naming the field.
    pub unsupported: Vec<(String, String)>,
}

/// `hidden_act` / `activation_function` spellings and what they compute (transformers' ACT2FN).
const ACTIVATIONS: &[(&str, Activation)] = &[
    ("silu", Activation::Silu),
    ("swish", Activation::Silu),
    ("relu", Activation::Relu),
    ("gelu", Activation::Gelu),
    ("gelu_new", Activation::GeluTanh),
    ("gelu_pytorch_tanh", Activation::GeluTanh),
    ("gelu_fast", Activation::GeluTanh),
];

/// The activation a config names, or an error listing the ones the engine runs.
fn activation(f: &Fields) -> Result<Option<Activation>> {
    let Some((key, v)) = f.first(&["hidden_act", "activation_function"]) else {
        return Ok(None);
    };
    let name = v
        .as_str()
        .ok_or_else(|| f.err(format!("field '{key}' must be a string, found {}", describe(v))))?;
    ACTIVATIONS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, a)| Some(*a))
        .ok_or_else(|| {
            f.err(format!(
                "field '{key}': activation '{name}' is not supported; supported: {}",
                ACTIVATIONS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// The family-specific fields of [`HfExtras`]: OPT's projection width, bias switch and
/// post-LayerNorm variant; ChatGLM's norm and residual switches.
fn family_extras(f: &Fields, extras: &mut HfExtras) -> Result<()> {
    let arch = match detect_arch(f) {
        Ok(a) => a,
        // parse() reports an unknown family; the extras alone have nothing to add.
        Err(_) => return Ok(()),
    };
    let mut refuse_if = |key: &str, bad: bool, value: Option<bool>| {
        if value == Some(bad) {
            extras.unsupported.push((key.to_string(), bad.to_string()));
        }
    };
    match arch {
        ModelArch::Opt => {
            refuse_if("do_layer_norm_before", false, f.bool_opt("do_layer_norm_before")?);
            refuse_if(
                "layer_norm_elementwise_affine",
                false,
                f.bool_opt("layer_norm_elementwise_affine")?,
            );
            refuse_if(
                "_remove_final_layer_norm",
                true,
                f.bool_opt("_remove_final_layer_norm")?,
            );
            let hidden = f.usize_opt(&["hidden_size"])?.map(|(_, n)| n);
            extras.embed_proj_dim = f
                .usize_opt(&["word_embed_proj_dim"])?
                .map(|(_, n)| n)
                .filter(|&n| Some(n) != hidden);
            extras.linear_bias = f.bool_opt("enable_bias")?;
        }
        ModelArch::ChatGlm => {
            refuse_if("rmsnorm", false, f.bool_opt("rmsnorm")?);
            refuse_if("post_layer_norm", false, f.bool_opt("post_layer_norm")?);
            refuse_if(
                "apply_residual_connection_post_layernorm",
                true,
                f.bool_opt("apply_residual_connection_post_layernorm")?,
            );
            refuse_if(
                "fp32_residual_connection",
                true,
                f.bool_opt("fp32_residual_connection")?,
            );
            extras.linear_bias = f.bool_opt("add_bias_linear")?;
        }
        ModelArch::Llama | ModelArch::Mistral | ModelArch::Qwen2 => {
            // Llama's gate/up/down biases have no weight names in the Llama family map.
            refuse_if("mlp_bias", true, f.bool_opt("mlp_bias")?);
        }
    }
    Ok(())
}

/// Read the extras of an HF config.json (`path` is used in messages only). An unknown
/// rope_scaling type is an error naming the supported ones: running with unscaled frequencies
/// would produce plausible but wrong text.
pub fn parse_extras(text: &str, path: &Path) -> Result<HfExtras> {
    let value: Value = serde_json::from_str(text).map_err(|e| FdppError::Config {
        path: path.to_path_buf(),
        msg: format!("malformed JSON at line {}, column {}", e.line(), e.column()),
    })?;
    let Value::Object(obj) = &value else {
        return Err(FdppError::Config {
            path: path.to_path_buf(),
            msg: format!("expected a JSON object at the top level, found {}", describe(&value)),
        });
    };
    let f = Fields { obj, path };
    // Qwen2 carries sliding_window but only uses it with use_sliding_window.
    let window_on = f.bool_opt("use_sliding_window")?.unwrap_or(true);
    let sliding_window = if window_on {
        f.usize_opt(&["sliding_window"])?.map(|(_, n)| n)
    } else {
        None
    };
    let mut extras = HfExtras {
        rope_scaling: rope_scaling(&f)?,
        eos_token_ids: token_ids(&f, "eos_token_id")?,
        bos_token_id: token_ids(&f, "bos_token_id")?.first().copied(),
        sliding_window,
        hidden_act: activation(&f)?,
        ..HfExtras::default()
    };
    family_extras(&f, &mut extras)?;
    Ok(extras)
}

/// The EOS ids of a generation_config.json.
pub fn parse_generation_eos(text: &str, path: &Path) -> Result<Vec<u32>> {
    let value: Value = serde_json::from_str(text).map_err(|e| FdppError::Config {
        path: path.to_path_buf(),
        msg: format!("malformed JSON at line {}, column {}", e.line(), e.column()),
    })?;
    match &value {
        Value::Object(obj) => token_ids(&Fields { obj, path }, "eos_token_id"),
        other => Err(FdppError::Config {
            path: path.to_path_buf(),
            msg: format!("expected a JSON object at the top level, found {}", describe(other)),
        }),
    }
}

/// A token id field that may be one integer or a list of them (Llama 3 lists several EOS ids).
fn token_ids(f: &Fields, key: &str) -> Result<Vec<u32>> {
    let Some((key, v)) = f.first(&[key]) else {
        return Ok(Vec::new());
    };
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| f.err(format!("field '{key}' must hold token ids, found {}", describe(v))))
    };
    match v {
        Value::Array(items) => items.iter().map(one).collect(),
        other => Ok(vec![one(other)?]),
    }
}

/// `rope_scaling` (or transformers 5's `rope_parameters`) as a [`RopeScaling`].
fn rope_scaling(f: &Fields) -> Result<Option<RopeScaling>> {
    let Some((key, v)) = f.first(&["rope_scaling", "rope_parameters"]) else {
        return Ok(None);
    };
    let Value::Object(inner) = v else {
        return Err(f.err(format!("field '{key}' must be an object, found {}", describe(v))));
    };
    let sub = Fields {
        obj: inner,
        path: f.path,
    };
    let kind = match (sub.str_opt("rope_type")?, sub.str_opt("type")?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) if key == "rope_parameters" => "default",
        (None, None) => return Err(f.err(format!("field '{key}' has no 'rope_type' (or 'type')"))),
    };
    let factor = || -> Result<f64> {
        match sub.f64_opt(&["factor"])? {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            Some(x) => Err(f.err(format!("{key}.factor must be a positive number, found {x}"))),
            None => Err(f.err(format!("{key} of type '{kind}' needs a 'factor'"))),
        }
    };
    let scaling = match kind {
        "default" => return Ok(None),
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => {
            let need = |name: &str| -> Result<f64> {
                sub.f64_opt(&[name])?
                    .ok_or_else(|| f.err(format!("{key} of type 'llama3' needs '{name}'")))
            };
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if !(low > 0.0 && high > low) {
                return Err(f.err(format!(
                    "{key}: low_freq_factor ({low}) must be positive and below high_freq_factor ({high})"
                )));
            }
            let original = sub
                .usize_opt(&["original_max_position_embeddings"])?
                .map(|(_, n)| n)
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    f.err(format!(
                        "{key} of type 'llama3' needs a positive 'original_max_position_embeddings'"
                    ))
                })?;
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }
        }
        other => {
            return Err(f.err(format!(
                "{key} type '{other}' is not supported; supported: {}",
                RopeScaling::SUPPORTED.join(", ")
            )))
        }
    };
    Ok(Some(scaling))
}

/// Typed access to the fields of one config object; every error names the file and the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, msg: String) -> FdppError {
        FdppError::Config {
            path: self.path.to_path_buf(),
            msg,
        }
    }

    /// The first of `keys` that is present and not null.
    fn first<'k>(&self, keys: &[&'k str]) -> Option<(&'k str, &Value)> {
        keys.iter()
            .find_map(|k| self.obj.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    }

    fn usize_opt<'k>(&self, keys: &[&'k str]) -> Result<Option<(&'k str, usize)>> {
        let Some((key, v)) = self.first(keys) else {
            return Ok(None);
        };
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(|n| Some((key, n)))
            .ok_or_else(|| {
                self.err(format!(
                    "field '{key}' must be a non-negative integer, found {}",
                    describe(v)
                ))
            })
    }

    fn usize_req(&self, keys: &[&str]) -> Result<usize> {
        match self.usize_opt(keys)? {
            Some((_, n)) => Ok(n),
            None => Err(self.err(missing(keys))),
        }
    }

    fn f64_opt(&self, keys: &[&str]) -> Result<Option<f64>> {
        let Some((key, v)) = self.first(keys) else {
            return Ok(None);
        };
        v.as_f64()
            .map(Some)
            .ok_or_else(|| self.err(format!("field '{key}' must be a number, found {}", describe(v))))
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        let Some((key, v)) = self.first(&[key]) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.err(format!("field '{key}' must be true or false, found {}", describe(v))))
    }

    fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        let Some((key, v)) = self.first(&[key]) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.err(format!("field '{key}' must be a string, found {}", describe(v))))
    }
}

fn missing(keys: &[&str]) -> String {
    match keys {
        [] => "missing required field".into(),
        [only] => format!("missing required field '{only}'"),
        [first, rest @ ..] => format!(
            "missing required field '{first}' (also accepted: {})",
            rest.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// A short description of a JSON value for type errors: its kind and, when short, the value.
fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    let text = v.to_string();
    if text.len() <= 40 && !matches!(v, Value::Null) {
        format!("{kind} ({text})")
    } else {
        kind.to_string()
    }
}
