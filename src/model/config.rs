//! The model configuration, from a preset or an HF config.json.
//!
//! Field names follow HF's LlamaConfig; other families' names are mapped onto them by the parser
//! in `hf.rs`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{hf, presets};
use crate::error::{FdppError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelArch {
    Llama,
    Mistral,
    Qwen2,
    Opt,
    ChatGlm,
}

impl ModelArch {
    pub const ALL: [ModelArch; 5] = [
        ModelArch::Llama,
        ModelArch::Mistral,
        ModelArch::Qwen2,
        ModelArch::Opt,
        ModelArch::ChatGlm,
    ];

    /// The lower-case name, as serialized and as HF's `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            ModelArch::Llama => "llama",
            ModelArch::Mistral => "mistral",
            ModelArch::Qwen2 => "qwen2",
            ModelArch::Opt => "opt",
            ModelArch::ChatGlm => "chatglm",
        }
    }
}

impl std::fmt::Display for ModelArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Preset name or the directory/file name it was read from.
    pub name: String,
    pub arch: ModelArch,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// RoPE base. OPT has learned absolute positions and no RoPE: there it is the unused default.
    pub rope_theta: f64,
    /// Epsilon of the RMSNorm (LayerNorm for OPT).
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    /// Bias on the Q, K and V projections (Qwen1.5/Qwen2, ChatGLM2, OPT).
    pub qkv_bias: bool,
    /// Gated FFN (gate and up projections, SiLU): Llama family. OPT has a single up projection.
    pub gated_ffn: bool,
}

/// Upper bounds that no real model comes near. They exist so that a corrupted config is rejected
/// with a message instead of overflowing the byte counts derived from it.
const MAX_WIDTH: usize = 1 << 20;
const MAX_VOCAB: usize = 1 << 24;
const MAX_LAYERS: usize = 1 << 14;

impl ModelConfig {
    /// `--model` argument: a preset name, a path to an HF config.json, a directory holding one, or
    /// a GGUF file.
    ///
    /// Presets win over paths of the same name; an argument that is neither gives the list of
    /// presets (for a bare word) or a missing-file error naming the path (for a path).
    pub fn resolve(arg: &str) -> Result<ModelConfig> {
        if presets::PRESET_NAMES.contains(&arg) {
            return presets::preset(arg);
        }
        let path = Path::new(arg);
        if super::gguf::is_gguf_path(path) && path.is_file() {
            let file = super::gguf::GgufFile::open(path)?;
            return Ok(super::gguf::config::model_config(&file)?.0);
        }
        if path.exists() {
            return Self::from_hf_path(path);
        }
        if looks_like_path(arg) {
            return Err(FdppError::Config {
                path: path.to_path_buf(),
                msg: "no such file or directory; give a preset name, an HF config.json, a \
                      directory holding config.json, or a GGUF file"
                    .into(),
            });
        }
        presets::preset(arg)
    }

    /// Read an HF config.json, given the file or the directory holding it.
    pub fn from_hf_path(path: &Path) -> Result<ModelConfig> {
        let file: PathBuf = if path.is_dir() {
            let f = path.join("config.json");
            if !f.exists() {
                return Err(FdppError::Config {
                    path: path.to_path_buf(),
                    msg: "directory holds no config.json (expected an HF model directory)".into(),
                });
            }
            f
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|e| FdppError::Config {
            path: file.clone(),
            msg: format!("cannot read: {e}"),
        })?;
        hf::parse(&text, &file, model_name_for(&file))
    }

    /// Reject sizes the engine cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| {
            Err(FdppError::InvalidModel {
                model: self.name.clone(),
                msg,
            })
        };
        if self.num_heads == 0 {
            return bad("num_attention_heads is 0".into());
        }
        if self.num_kv_heads == 0 {
            return bad("num_key_value_heads is 0".into());
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_key_value_heads ({}) does not divide num_attention_heads ({})",
                self.num_kv_heads, self.num_heads
            ));
        }
        // One field at a time, by its config.json name: "x and y must be positive" left the
        // user to guess which.
        for (field, value) in [
            ("hidden_size", self.hidden_size),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return bad(format!("{field} is 0; it must be positive"));
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!(
                "rope_theta must be a positive number, found {}",
                self.rope_theta
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps must be a positive number, found {}",
                self.rms_norm_eps
            ));
        }
        let q_width = self.num_heads.saturating_mul(self.head_dim);
        for (field, value, limit) in [
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_attention_heads × head_dim", q_width, MAX_WIDTH),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
        ] {
            if value > limit {
                return bad(format!(
                    "{field} ({value}) exceeds {limit}, far beyond any real model; is the config corrupted?"
                ));
            }
        }
        Ok(())
    }

    /// Query heads per KV head (1 for multi-head attention, `num_heads` for multi-query).
    pub fn gqa_ratio(&self) -> usize {
        self.num_heads.checked_div(self.num_kv_heads).unwrap_or(0)
    }
}

/// A bare word such as `llama2-7x` is a mistyped preset; anything with a separator or a `.json`
/// ending was meant as a path.
fn looks_like_path(arg: &str) -> bool {
    arg.contains('/')
        || arg.contains(std::path::MAIN_SEPARATOR)
        || arg.ends_with(".json")
        || super::gguf::is_gguf_path(Path::new(arg))
}

/// `.../Llama-2-7b-hf/config.json` is called `Llama-2-7b-hf`; `fixtures/qwen2.json` is `qwen2`.
fn model_name_for(file: &Path) -> String {
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    if stem != "config" {
        return stem.to_string();
    }
    let parent = file
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .or_else(|| std::env::current_dir().ok());
    parent
        .as_deref()
        .and_then(|p| p.canonicalize().ok().or_else(|| Some(p.to_path_buf())))
        .and_then(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_string))
        .unwrap_or_else(|| stem.to_string())
}

/// `rope_scaling` of an HF config.json: how the rotary frequencies are stretched for contexts
/// longer than the model was trained on. Kept beside [`ModelConfig`] rather than in it (the
/// shapes, the profile and the tuner do not depend on it); the engine reads it with
/// [`hf::parse_extras`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Llama 3.1's scheme: long wavelengths divided by `factor`, short ones kept, a smooth blend
    /// between `original_max_position_embeddings / low_freq_factor` and `/ high_freq_factor`.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The `rope_type` names the engine understands ("default" means no scaling).
    pub const SUPPORTED: [&'static str; 3] = ["default", "linear", "llama3"];
}
