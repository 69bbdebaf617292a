//! A Llama-family model (Llama 2/3, Mistral, Qwen1.5/2) as the engine runs it: where its
//! description comes from (preset or HF directory), and its weights on a backend, with q/k/v
//! fused into one QKV weight and gate/up into one FFN1 weight (the four linear shapes of
//! [`crate::model::shapes`]).

use std::path::{Path, PathBuf};

use super::config::{ModelArch, ModelConfig};
use super::hf::{self, HfExtras};
use super::presets;
use super::weights::{check_llama, llama_tensors, WeightStore};
use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::attention::AttnGeometry;
use crate::ops::layer::random_value;

/// The families the engine's forward pass runs.
pub const SUPPORTED_ARCHS: [ModelArch; 3] = [ModelArch::Llama, ModelArch::Mistral, ModelArch::Qwen2];

/// What `--model` names: the config, what the engine reads beside it, and the directory (None
/// for a preset, which has neither weights nor a tokenizer).
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub cfg: ModelConfig,
    pub extras: HfExtras,
    pub dir: Option<PathBuf>,
}

impl ModelSpec {
    /// A preset name, an HF directory, or an HF config.json (its directory holds the weights).
    pub fn resolve(arg: &str) -> Result<ModelSpec> {
        let cfg = ModelConfig::resolve(arg)?;
        let path = Path::new(arg);
        if presets::PRESET_NAMES.contains(&arg) || !path.exists() {
            return Ok(ModelSpec {
                cfg,
                extras: HfExtras::default(),
                dir: None,
            });
        }
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("config.json"))
        } else {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            (dir.to_path_buf(), path.to_path_buf())
        };
        let text = std::fs::read_to_string(&file).map_err(|e| FdppError::io(&file, e))?;
        let mut extras = hf::parse_extras(&text, &file)?;
        let gen = dir.join("generation_config.json");
        if gen.is_file() {
            let text = std::fs::read_to_string(&gen).map_err(|e| FdppError::io(&gen, e))?;
            for id in hf::parse_generation_eos(&text, &gen)? {
                if !extras.eos_token_ids.contains(&id) {
                    extras.eos_token_ids.push(id);
                }
            }
        }
        Ok(ModelSpec {
            cfg,
            extras,
            dir: Some(dir),
        })
    }

    /// The longest sequence the model attends over correctly: max_position_embeddings, or
    /// Mistral's sliding window when smaller (the kernels attend to the whole prefix, which is
    /// the same computation only while the sequence fits in the window).
    pub fn context_len(&self) -> usize {
        let w = self.extras.sliding_window.unwrap_or(usize::MAX);
        self.cfg.max_position_embeddings.min(w)
    }
}

/// Refuse what the forward pass cannot run, naming what it can.
pub fn check_supported(cfg: &ModelConfig) -> Result<()> {
    if !SUPPORTED_ARCHS.contains(&cfg.arch) || !cfg.gated_ffn {
        return Err(FdppError::Unsupported {
            spec: format!("the engine (model '{}')", cfg.name),
            what: format!(
                "architecture '{}'; it runs {} (OPT and ChatGLM have shapes and profiles, not a forward pass)",
                cfg.arch,
                SUPPORTED_ARCHS.map(ModelArch::name).join(", ")
            ),
        });
    }
    cfg.validate()?;
    AttnGeometry::new(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim).map_err(|e| FdppError::Unsupported {
        spec: format!("the engine (model '{}')", cfg.name),
        what: format!("its attention: {e}"),
    })?;
    Ok(())
}

/// Bytes of the weights in a 16-bit type (the tied LM head counted once).
pub fn weights_bytes(cfg: &ModelConfig, dtype: DType) -> u64 {
    let elems: usize = llama_tensors(cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    (elems * dtype.size_bytes()) as u64
}

/// One decoder layer's weights on a backend.
pub struct LayerWeights<Buf> {
    pub attn_norm: Buf,
    /// [(H + 2G)·D, hidden]: q_proj rows, then k_proj, then v_proj.
    pub qkv: Buf,
    /// [(H + 2G)·D] (Qwen).
    pub qkv_bias: Option<Buf>,
    /// [hidden, H·D].
    pub o: Buf,
    pub ffn_norm: Buf,
    /// [2·inter, hidden]: gate_proj rows, then up_proj.
    pub ffn1: Buf,
    /// [hidden, inter].
    pub ffn2: Buf,
}

pub struct LlamaWeights<Buf> {
    /// [vocab, hidden].
    pub embed: Buf,
    pub layers: Vec<LayerWeights<Buf>>,
    pub final_norm: Buf,
    /// [vocab, hidden]; None when tied to the embedding.
    pub lm_head: Option<Buf>,
}

impl<Buf> LlamaWeights<Buf> {
    pub fn lm_head(&self) -> &Buf {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Upload an HF checkpoint, checking every tensor's presence and shape before the first upload.
pub fn load<B: Backend>(
    b: &B,
    store: &WeightStore,
    cfg: &ModelConfig,
    dtype: DType,
) -> Result<LlamaWeights<B::Buffer>> {
    check_supported(cfg)?;
    check_llama(store, cfg)?;
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let (qd, kvd, inter) = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size);
    let one = |name: &str, shape: &[usize]| -> Result<B::Buffer> { b.upload(dtype, &store.load(name, shape, dtype)?) };
    // Row-stacking [rows, cols] tensors is a concatenation of their row-major data.
    let stacked = |parts: &[(String, Vec<usize>)]| -> Result<B::Buffer> {
        let mut all = Vec::new();
        for (name, shape) in parts {
            all.extend(store.load(name, shape, dtype)?);
        }
        b.upload(dtype, &all)
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let attn = |w: &str, rows: usize, bias: bool| {
            let suffix = if bias { "bias" } else { "weight" };
            let shape = if bias { vec![rows] } else { vec![rows, h] };
            (format!("{p}.self_attn.{w}_proj.{suffix}"), shape)
        };
        let qkv_bias = if cfg.qkv_bias {
            Some(stacked(&[
                attn("q", qd, true),
                attn("k", kvd, true),
                attn("v", kvd, true),
            ])?)
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: one(&format!("{p}.input_layernorm.weight"), &[h])?,
            qkv: stacked(&[attn("q", qd, false), attn("k", kvd, false), attn("v", kvd, false)])?,
            qkv_bias,
            o: one(&format!("{p}.self_attn.o_proj.weight"), &[h, qd])?,
            ffn_norm: one(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            ffn1: stacked(&[
                (format!("{p}.mlp.gate_proj.weight"), vec![inter, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![inter, h]),
            ])?,
            ffn2: one(&format!("{p}.mlp.down_proj.weight"), &[h, inter])?,
        });
    }
    Ok(LlamaWeights {
        embed: one("model.embed_tokens.weight", &[cfg.vocab_size, h])?,
        layers,
        final_norm: one("model.norm.weight", &[h])?,
        lm_head: if cfg.tie_word_embeddings {
            None
        } else {
            Some(one("lm_head.weight", &[cfg.vocab_size, h])?)
        },
    })
}

/// Spread of the random RMSNorm weights around 1.
pub const RANDOM_NORM_SPREAD: f32 = 0.1;
/// Spread of the random QKV biases.
pub const RANDOM_BIAS_SCALE: f32 = 0.1;

/// A random model generated where it runs (`fill_random` on the backend), for benchmarks and
/// tests: no host copy of the large tensors is ever made.
///
/// Scales keep activations near unit size through every layer: a projection with fan-in K is
/// uniform in ±√(3/K), so that its output has the variance of its (RMS-normed, unit) input;
/// the embedding is uniform in ±1 (the first RMSNorm rescales it); RMSNorm weights are
/// 1 ± [`RANDOM_NORM_SPREAD`] (made on the host: they are `hidden` elements each); QKV biases
/// ±[`RANDOM_BIAS_SCALE`]. Each tensor draws from its own seed, a hash of `seed` and its
/// index, so the model depends on `seed` alone, on every backend.
pub fn random<B: Backend>(b: &B, cfg: &ModelConfig, dtype: DType, seed: u64) -> Result<LlamaWeights<B::Buffer>> {
    check_supported(cfg)?;
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let (qd, kvd, inter) = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size);
    let mut index = 0u64;
    let mut next_seed = || {
        index += 1;
        tensor_seed(seed, index)
    };
    let mut dense = |len: usize, scale: f32| -> Result<B::Buffer> {
        let mut buf = b.alloc(dtype, len)?;
        b.fill_random(&mut buf, next_seed(), scale)?;
        Ok(buf)
    };
    let proj = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let embed = dense(cfg.vocab_size * h, 1.0)?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for _ in 0..cfg.num_layers {
        let qkv = dense((qd + 2 * kvd) * h, proj(h))?;
        let qkv_bias = if cfg.qkv_bias {
            Some(dense(qd + 2 * kvd, RANDOM_BIAS_SCALE)?)
        } else {
            None
        };
        let o = dense(h * qd, proj(qd))?;
        let ffn1 = dense(2 * inter * h, proj(h))?;
        let ffn2 = dense(h * inter, proj(inter))?;
        layers.push((qkv, qkv_bias, o, ffn1, ffn2));
    }
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(dense(cfg.vocab_size * h, proj(h))?)
    };
    let norm = |s: u64| -> Result<B::Buffer> {
        let bits: Vec<u16> = (0..h as u64)
            .map(|i| dtype.from_f32(1.0 + random_value(s, i, RANDOM_NORM_SPREAD)))
            .collect();
        b.upload(dtype, &bits)
    };
    let norm_base = tensor_seed(seed, u64::MAX);
    let layers = layers
        .into_iter()
        .enumerate()
        .map(|(i, (qkv, qkv_bias, o, ffn1, ffn2))| {
            Ok(LayerWeights {
                attn_norm: norm(tensor_seed(norm_base, 2 * i as u64))?,
                qkv,
                qkv_bias,
                o,
                ffn_norm: norm(tensor_seed(norm_base, 2 * i as u64 + 1))?,
                ffn1,
                ffn2,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(LlamaWeights {
        embed,
        layers,
        final_norm: norm(tensor_seed(norm_base, u64::MAX - 1))?,
        lm_head,
    })
}

/// The seed of tensor `index` of a random model.
fn tensor_seed(seed: u64, index: u64) -> u64 {
    let mut z = seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^ (z >> 29)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_bytes_of_llama2_7b() {
        let cfg = presets::preset("llama2-7b").expect("preset");
        // 6.74 B parameters in fp16.
        assert_eq!(weights_bytes(&cfg, DType::F16), 2 * 6_738_415_616);
    }

    #[test]
    fn unsupported_families_are_named() {
        let cfg = presets::preset("opt-6.7b").expect("preset");
        let e = check_supported(&cfg).expect_err("opt");
        let msg = e.to_string();
        assert!(msg.contains("'opt'") && msg.contains("llama, mistral, qwen2"), "{msg}");
        check_supported(&presets::preset("qwen1.5-7b").expect("preset")).expect("qwen runs");
    }
}
