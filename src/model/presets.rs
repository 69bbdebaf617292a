//! Built-in configurations of the models the FlashDecoding++ papers evaluate.

use super::config::{ModelArch, ModelConfig};
use crate::error::{FdppError, Result};

/// Names accepted by `--model`.
pub const PRESET_NAMES: &[&str] = &["llama2-7b"];

pub fn preset(name: &str) -> Result<ModelConfig> {
    let cfg = match name {
        "llama2-7b" => ModelConfig {
            name: name.into(),
            arch: ModelArch::Llama,
            hidden_size: 4096,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 32,
            head_dim: 128,
            intermediate_size: 11008,
            vocab_size: 32000,
            max_position_embeddings: 4096,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            qkv_bias: false,
            gated_ffn: true,
        },
        _ => {
            return Err(FdppError::UnknownPreset {
                name: name.into(),
                known: PRESET_NAMES.join(", "),
            })
        }
    };
    Ok(cfg)
}
