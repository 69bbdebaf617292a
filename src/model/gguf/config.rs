//! The model description from GGUF metadata: `general.architecture` names the family and every
//! hyper-parameter is stored under `{arch}.…` (llama.cpp's key names), mapped here onto HF's
//! [`ModelConfig`] and [`HfExtras`].

use super::file::GgufFile;
use super::value::MetaValue;
use crate::error::Result;
use crate::model::config::{ModelArch, ModelConfig, RopeScaling};
use crate::model::hf::HfExtras;

/// `general.architecture` values fdpp runs, and the family each is.
pub const ARCHITECTURES: &[(&str, ModelArch)] = &[("llama", ModelArch::Llama), ("qwen2", ModelArch::Qwen2)];

/// The architecture string and family of a file; anything else is an error listing the
/// supported ones.
pub fn architecture(file: &GgufFile) -> Result<(String, ModelArch)> {
    let arch = str_req(file, "general.architecture")?;
    ARCHITECTURES
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(a, m)| (a.to_string(), *m))
        .ok_or_else(|| {
            let known: Vec<&str> = ARCHITECTURES.iter().map(|(a, _)| *a).collect();
            file.err(format!(
                "general.architecture is '{arch}', which fdpp does not run; supported: {}",
                known.join(", ")
            ))
        })
}

fn str_req<'a>(file: &'a GgufFile, key: &str) -> Result<&'a str> {
    match file.get(key) {
        Some(v) => v
            .as_str()
            .ok_or_else(|| file.err(format!("metadata '{key}' is a {}, expected a string", v.type_name()))),
        None => Err(file.err(format!("metadata '{key}' is missing"))),
    }
}

/// An optional non-negative integer that fits usize.
fn usize_opt(file: &GgufFile, key: &str) -> Result<Option<usize>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                file.err(format!(
                    "metadata '{key}' is {} ({}), expected a non-negative integer",
                    v.summary(),
                    v.type_name()
                ))
            }),
    }
}

fn usize_req(file: &GgufFile, key: &str) -> Result<usize> {
    usize_opt(file, key)?.ok_or_else(|| file.err(format!("metadata '{key}' is missing")))
}

fn f64_opt(file: &GgufFile, key: &str) -> Result<Option<f64>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| file.err(format!("metadata '{key}' is a {}, expected a number", v.type_name()))),
    }
}

/// [`ModelConfig`] and [`HfExtras`] of a file whose architecture is supported.
pub fn model_config(file: &GgufFile) -> Result<(ModelConfig, HfExtras)> {
    let (a, arch) = architecture(file)?;
    let k = |s: &str| format!("{a}.{s}");
    let hidden_size = usize_req(file, &k("embedding_length"))?;
    let num_layers = usize_req(file, &k("block_count"))?;
    let num_heads = usize_req(file, &k("attention.head_count"))?;
    if num_heads == 0 {
        return Err(file.err(format!("metadata '{}' is 0", k("attention.head_count"))));
    }
    let num_kv_heads = usize_opt(file, &k("attention.head_count_kv"))?.unwrap_or(num_heads);
    let head_dim = match usize_opt(file, &k("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(file.err(format!(
                "{} ({hidden_size}) is not divisible by {} ({num_heads}) and no {} is given",
                k("embedding_length"),
                k("attention.head_count"),
                k("attention.key_length")
            )))
        }
    };
    if let Some(vd) = usize_opt(file, &k("attention.value_length"))? {
        if vd != head_dim {
            return Err(file.err(format!(
                "value heads of {vd} differ from key heads of {head_dim}; fdpp needs them equal"
            )));
        }
    }
    if let Some(rd) = usize_opt(file, &k("rope.dimension_count"))? {
        if rd != head_dim {
            return Err(file.err(format!(
                "{} is {rd} but heads are {head_dim} wide: partial rotary embeddings are not read \
                 from GGUF yet",
                k("rope.dimension_count")
            )));
        }
    }
    // HF sizes the vocabulary by the embedding; the token list may be shorter (padding rows).
    let embd = file
        .tensor("token_embd.weight")
        .ok_or_else(|| file.err("tensor 'token_embd.weight' is missing"))?;
    let vocab_size = match embd.dims.as_slice() {
        [h, v] if *h as usize == hidden_size => *v as usize,
        d => {
            return Err(file.err(format!(
                "tensor 'token_embd.weight' has dims {d:?}, expected [{hidden_size}, vocab]"
            )))
        }
    };
    if file.tensor("rope_freqs.weight").is_some() {
        return Err(file.err(
            "the file carries per-dimension rope factors ('rope_freqs.weight', Llama 3.1-style \
             scaling), which fdpp does not read from GGUF yet",
        ));
    }
    let rope_scaling = match file.get(&k("rope.scaling.type")).map(|v| v.as_str()) {
        None | Some(Some("none")) => None,
        Some(Some("linear")) => {
            let factor = f64_opt(file, &k("rope.scaling.factor"))?
                .ok_or_else(|| file.err(format!("linear rope scaling without '{}'", k("rope.scaling.factor"))))?;
            Some(RopeScaling::Linear { factor })
        }
        Some(other) => {
            return Err(file.err(format!(
                "rope scaling type {:?} is not supported (none, linear are)",
                other.unwrap_or("(not a string)")
            )))
        }
    };
    let qkv_bias = file.tensor("blk.0.attn_q.bias").is_some();
    if arch == ModelArch::Qwen2 && !qkv_bias {
        return Err(file.err("a qwen2 model without 'blk.0.attn_q.bias': Qwen2 always has Q/K/V biases"));
    }
    let name = file
        .path()
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("gguf")
        .to_string();
    let cfg = ModelConfig {
        name,
        arch,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: usize_req(file, &k("feed_forward_length"))?,
        vocab_size,
        max_position_embeddings: usize_opt(file, &k("context_length"))?.unwrap_or(2048),
        rope_theta: f64_opt(file, &k("rope.freq_base"))?.unwrap_or(10000.0),
        rms_norm_eps: f64_opt(file, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        qkv_bias,
        gated_ffn: true,
    };
    cfg.validate().map_err(|e| file.err(e))?;

    let id = |key: &str| -> Result<Option<u32>> { Ok(usize_opt(file, key)?.and_then(|n| u32::try_from(n).ok())) };
    let mut eos_token_ids: Vec<u32> = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(e) = id(key)? {
            if !eos_token_ids.contains(&e) {
                eos_token_ids.push(e);
            }
        }
    }
    // Biases beyond Q/K/V (on O or the MLP) are not something llama/qwen2 files carry; say so
    // through `unsupported` (the engine refuses naming it) rather than drop them silently.
    let unsupported = ["attn_output.bias", "ffn_up.bias", "ffn_down.bias", "ffn_gate.bias"]
        .iter()
        .filter(|t| file.tensor(&format!("blk.0.{t}")).is_some())
        .map(|t| (format!("blk.0.{t}"), "present".to_string()))
        .collect();
    let extras = HfExtras {
        rope_scaling,
        eos_token_ids,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        sliding_window: None,
        // llama and qwen2 use SiLU, their family's default.
        hidden_act: None,
        embed_proj_dim: None,
        linear_bias: None,
        unsupported,
    };
    Ok((cfg, extras))
}

/// `tokenizer.chat_template`, when the file has one.
pub fn chat_template(file: &GgufFile) -> Option<String> {
    file.get("tokenizer.chat_template")
        .and_then(MetaValue::as_str)
        .map(str::to_string)
}
