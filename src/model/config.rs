//! The model configuration, from a preset or an HF config.json.
//!
//! Field names follow HF's LlamaConfig; other families' names are mapped onto them by the parser.

use serde::{Deserialize, Serialize};

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
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    /// Bias on the Q, K and V projections (Qwen1.5/Qwen2).
    pub qkv_bias: bool,
    /// Gated FFN (gate and up projections, SiLU): Llama family. OPT has a single up projection.
    pub gated_ffn: bool,
}

impl ModelConfig {
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
        if self.hidden_size == 0 || self.head_dim == 0 || self.intermediate_size == 0 {
            return bad("hidden_size, head_dim and intermediate_size must be positive".into());
        }
        if self.num_layers == 0 || self.vocab_size == 0 {
            return bad("num_hidden_layers and vocab_size must be positive".into());
        }
        Ok(())
    }
}
