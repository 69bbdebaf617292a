//! Built-in configurations of the models the FlashDecoding++ papers evaluate (§6: Llama2,
//! OPT, ChatGLM2) and of their common successors.
//!
//! Every value is the one in the model's published `config.json` on the Hugging Face Hub (the
//! repository is listed in [`PRESETS`]); where the file omits a field, the value is the default
//! of the family's HF config class, which is what transformers builds.

use super::config::{ModelArch, ModelConfig};
use crate::error::{FdppError, Result};

/// Preset name and the Hugging Face repository whose config.json it reproduces.
pub const PRESETS: &[(&str, &str)] = &[
    ("llama2-7b", "meta-llama/Llama-2-7b-hf"),
    ("llama2-13b", "meta-llama/Llama-2-13b-hf"),
    ("llama2-70b", "meta-llama/Llama-2-70b-hf"),
    ("llama3-8b", "meta-llama/Meta-Llama-3-8B"),
    ("llama3-70b", "meta-llama/Meta-Llama-3-70B"),
    ("qwen1.5-7b", "Qwen/Qwen1.5-7B"),
    ("qwen1.5-72b", "Qwen/Qwen1.5-72B"),
    ("mistral-7b", "mistralai/Mistral-7B-v0.1"),
    ("codellama-34b", "codellama/CodeLlama-34b-hf"),
    ("opt-6.7b", "facebook/opt-6.7b"),
    ("chatglm2-6b", "THUDM/chatglm2-6b"),
];

/// Names accepted by `--model`.
pub const PRESET_NAMES: &[&str] = &[
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "qwen1.5-7b",
    "qwen1.5-72b",
    "mistral-7b",
    "codellama-34b",
    "opt-6.7b",
    "chatglm2-6b",
];

/// The Hugging Face repository a preset was taken from.
pub fn preset_source(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, repo)| *repo)
}

pub fn preset(name: &str) -> Result<ModelConfig> {
    // Llama 2 7B is the base the others differ from; each preset below states every field that
    // differs, so it can be read against its config.json.
    let llama2_7b = ModelConfig {
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
    };
    let cfg = match name {
        "llama2-7b" => llama2_7b,
        "llama2-13b" => ModelConfig {
            hidden_size: 5120,
            num_layers: 40,
            num_heads: 40,
            num_kv_heads: 40,
            intermediate_size: 13824,
            ..llama2_7b
        },
        "llama2-70b" => ModelConfig {
            hidden_size: 8192,
            num_layers: 80,
            num_heads: 64,
            num_kv_heads: 8,
            intermediate_size: 28672,
            ..llama2_7b
        },
        "llama3-8b" => ModelConfig {
            num_kv_heads: 8,
            intermediate_size: 14336,
            vocab_size: 128256,
            max_position_embeddings: 8192,
            rope_theta: 500000.0,
            ..llama2_7b
        },
        "llama3-70b" => ModelConfig {
            hidden_size: 8192,
            num_layers: 80,
            num_heads: 64,
            num_kv_heads: 8,
            intermediate_size: 28672,
            vocab_size: 128256,
            max_position_embeddings: 8192,
            rope_theta: 500000.0,
            ..llama2_7b
        },
        "qwen1.5-7b" => ModelConfig {
            arch: ModelArch::Qwen2,
            vocab_size: 151936,
            max_position_embeddings: 32768,
            rope_theta: 1000000.0,
            rms_norm_eps: 1e-6,
            qkv_bias: true,
            ..llama2_7b
        },
        "qwen1.5-72b" => ModelConfig {
            arch: ModelArch::Qwen2,
            hidden_size: 8192,
            num_layers: 80,
            num_heads: 64,
            num_kv_heads: 64,
            intermediate_size: 24576,
            vocab_size: 152064,
            max_position_embeddings: 32768,
            rope_theta: 1000000.0,
            rms_norm_eps: 1e-6,
            qkv_bias: true,
            ..llama2_7b
        },
        "mistral-7b" => ModelConfig {
            arch: ModelArch::Mistral,
            num_kv_heads: 8,
            intermediate_size: 14336,
            max_position_embeddings: 32768,
            ..llama2_7b
        },
        "codellama-34b" => ModelConfig {
            hidden_size: 8192,
            num_layers: 48,
            num_heads: 64,
            num_kv_heads: 8,
            intermediate_size: 22016,
            max_position_embeddings: 16384,
            rope_theta: 1000000.0,
            ..llama2_7b
        },
        // OPT: learned absolute positions (rope_theta unused), LayerNorm eps 1e-5, bias on every
        // linear, ReLU FFN with a single fc1 (not gated), LM head tied to the embedding.
        "opt-6.7b" => ModelConfig {
            arch: ModelArch::Opt,
            intermediate_size: 16384,
            vocab_size: 50272,
            max_position_embeddings: 2048,
            tie_word_embeddings: true,
            qkv_bias: true,
            gated_ffn: false,
            ..llama2_7b
        },
        // ChatGLM2: multi_query_group_num 2, kv_channels 128, ffn_hidden_size 13696 (SwiGLU,
        // dense_h_to_4h holds gate and up), padded_vocab_size 65024, seq_length 32768,
        // add_qkv_bias true, separate output_layer.
        "chatglm2-6b" => ModelConfig {
            arch: ModelArch::ChatGlm,
            num_layers: 28,
            num_kv_heads: 2,
            intermediate_size: 13696,
            vocab_size: 65024,
            max_position_embeddings: 32768,
            qkv_bias: true,
            ..llama2_7b
        },
        _ => {
            return Err(FdppError::UnknownPreset {
                name: name.into(),
                known: format!(
                    "{}; or give the path of an HF config.json, of a directory holding one, or of a GGUF file",
                    PRESET_NAMES.join(", ")
                ),
            })
        }
    };
    Ok(cfg)
}
