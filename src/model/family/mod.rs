//! Checkpoint families: one small file each mapping a family's HF weight names onto the slots of
//! [`Tensors`], read through [`TensorSource`] (safetensors today, GGUF through the same trait).
//! Loading, the presence check and random weights are written once, here, for every family.

pub mod chatglm;
pub mod llama;
pub mod opt;

use super::arch::{Arch, NormKind};
use super::config::ModelArch;
use super::tensors::{stack_elems, ModelWeights, Stack, Tensors};
use super::weights::TensorSource;
use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::layer::random_value;

/// The checkpoint tensors of `arch`, by slot.
pub fn names(arch: &Arch) -> Tensors<Stack> {
    match arch.family {
        ModelArch::Llama | ModelArch::Mistral | ModelArch::Qwen2 => llama::names(arch),
        ModelArch::Opt => opt::names(arch),
        ModelArch::ChatGlm => chatglm::names(arch),
    }
}

/// The weight-name family a model is read with, for messages.
pub fn family_name(arch: &Arch) -> &'static str {
    match arch.family {
        ModelArch::Llama | ModelArch::Mistral | ModelArch::Qwen2 => "llama (Llama, Mistral, Qwen2 names)",
        ModelArch::Opt => "opt (OPTForCausalLM names)",
        ModelArch::ChatGlm => "chatglm (ChatGLMModel names)",
    }
}

/// How many missing names an error lists.
const MISSING_SHOWN: usize = 5;

/// Every tensor `arch` needs is in `src` with its shape, checked before anything is allocated:
/// missing tensors are listed (the first few, and how many in all) with the family tried; else
/// the first wrong shape is the error.
pub fn check(src: &dyn TensorSource, arch: &Arch) -> Result<()> {
    let want = names(arch).names();
    let have: std::collections::HashSet<String> = src.names().into_iter().collect();
    let missing: Vec<&str> = want
        .iter()
        .filter(|(n, _)| !have.contains(n))
        .map(|(n, _)| n.as_str())
        .collect();
    if !missing.is_empty() {
        let shown: Vec<String> = missing.iter().take(MISSING_SHOWN).map(|n| format!("'{n}'")).collect();
        let more = if missing.len() > MISSING_SHOWN { ", …" } else { "" };
        let mut sample: Vec<&String> = have.iter().collect();
        sample.sort();
        // Most names absent: another family's checkpoint (or another naming); a few: a
        // truncated or partial one.
        let msg = if 2 * missing.len() > want.len() {
            format!(
                "the weight names match no family the engine runs: tried {} for architecture \
                 '{}', and {} of its {} tensors are missing ({}{more}); the checkpoint has {} \
                 tensors{}",
                family_name(arch),
                arch.family,
                missing.len(),
                want.len(),
                shown.join(", "),
                have.len(),
                match sample.first() {
                    Some(n) => format!(", the first named '{n}'"),
                    None => String::new(),
                }
            )
        } else {
            format!(
                "missing tensor {}{more} ({} of the {} tensors of the {} family)",
                shown.join(", "),
                missing.len(),
                want.len(),
                family_name(arch)
            )
        };
        return Err(FdppError::Config {
            path: src.describe().into(),
            msg,
        });
    }
    for (name, shape) in &want {
        let found = src.shape(name)?;
        if &found != shape {
            return Err(FdppError::Shape {
                what: format!("tensor '{name}' in {}", src.describe()),
                expected: format!("{shape:?}"),
                found: format!("{found:?}"),
            });
        }
    }
    Ok(())
}

/// Upload a checkpoint, every tensor checked first.
pub fn load<B: Backend>(b: &B, src: &dyn TensorSource, arch: &Arch, dtype: DType) -> Result<ModelWeights<B::Buffer>> {
    check(src, arch)?;
    names(arch).try_map(|stack| {
        let mut all = Vec::with_capacity(stack_elems(&stack));
        for (name, shape) in &stack {
            all.extend(src.load(name, shape, dtype)?);
        }
        b.upload(dtype, &all)
    })
}

/// Bytes of the weights in a 16-bit type (a tied LM head counted once).
pub fn weights_bytes(arch: &Arch, dtype: DType) -> u64 {
    (names(arch).elems() * dtype.size_bytes()) as u64
}

/// Spread of random norm weights around 1.
pub const RANDOM_NORM_SPREAD: f32 = 0.1;
/// Spread of random biases (and of LayerNorm biases and learned positions).
pub const RANDOM_BIAS_SCALE: f32 = 0.1;

/// A random model generated where it runs (`fill_random` on the backend), for benchmarks and
/// tests: no host copy of the large tensors is ever made.
///
/// Scales keep activations near unit size through every layer: a projection with fan-in K is
/// uniform in ±√(3/K), so that its output has the variance of its (normed, unit) input; the
/// embedding is uniform in ±1 (the first norm rescales it); norm weights are
/// 1 ± [`RANDOM_NORM_SPREAD`] (made on the host: they are `hidden` elements each); biases and
/// learned positions ±[`RANDOM_BIAS_SCALE`]. Each tensor draws from its own seed, a hash of
/// `seed` and its index, so the model depends on `seed` alone, on every backend. The Llama
/// family's tensors take the indices they had before the other families existed (embedding,
/// then per layer QKV, its bias, O, FFN1, FFN2, then the LM head), so its random models are
/// unchanged; the other families' extra tensors follow.
pub fn random<B: Backend>(b: &B, arch: &Arch, dtype: DType, seed: u64) -> Result<ModelWeights<B::Buffer>> {
    let shapes = names(arch);
    let mut index = 0u64;
    let mut dense = |stack: &Stack, scale: f32| -> Result<B::Buffer> {
        index += 1;
        let mut buf = b.alloc(dtype, stack_elems(stack))?;
        b.fill_random(&mut buf, tensor_seed(seed, index), scale)?;
        Ok(buf)
    };
    // Fan-in of a projection: the columns of its (first) [rows, cols] tensor.
    let proj = |stack: &Stack| {
        let k = stack.first().and_then(|(_, s)| s.get(1)).copied().unwrap_or(1);
        (3.0 / k as f32).sqrt()
    };
    let embed = dense(&shapes.embed, 1.0)?;
    let mut layers = Vec::with_capacity(shapes.layers.len());
    for l in &shapes.layers {
        let qkv = dense(&l.qkv, proj(&l.qkv))?;
        let qkv_bias = l.qkv_bias.as_ref().map(|s| dense(s, RANDOM_BIAS_SCALE)).transpose()?;
        let o = dense(&l.o, proj(&l.o))?;
        let ffn1 = dense(&l.ffn1, proj(&l.ffn1))?;
        let ffn2 = dense(&l.ffn2, proj(&l.ffn2))?;
        layers.push((qkv, qkv_bias, o, ffn1, ffn2));
    }
    let lm_head = shapes.lm_head.as_ref().map(|s| dense(s, proj(s))).transpose()?;
    let positions = shapes
        .positions
        .as_ref()
        .map(|s| dense(s, RANDOM_BIAS_SCALE))
        .transpose()?;
    let project_in = shapes.project_in.as_ref().map(|s| dense(s, proj(s))).transpose()?;
    let project_out = shapes.project_out.as_ref().map(|s| dense(s, proj(s))).transpose()?;
    let mut biases = Vec::with_capacity(shapes.layers.len());
    for l in &shapes.layers {
        let mut one = |s: &Option<Stack>| s.as_ref().map(|s| dense(s, RANDOM_BIAS_SCALE)).transpose();
        biases.push((one(&l.o_bias)?, one(&l.ffn1_bias)?, one(&l.ffn2_bias)?));
    }
    let h = arch.hidden;
    let host = |s: u64, center: f32, spread: f32| -> Result<B::Buffer> {
        let bits: Vec<u16> = (0..h as u64)
            .map(|i| dtype.from_f32(center + random_value(s, i, spread)))
            .collect();
        b.upload(dtype, &bits)
    };
    let norm_base = tensor_seed(seed, u64::MAX);
    let bias_base = tensor_seed(seed, u64::MAX - 1);
    let layer_norm = arch.norm == NormKind::Layer;
    let norm = |k: u64| -> Result<super::tensors::Norm<B::Buffer>> {
        Ok(super::tensors::Norm {
            weight: host(tensor_seed(norm_base, k), 1.0, RANDOM_NORM_SPREAD)?,
            bias: if layer_norm {
                Some(host(tensor_seed(bias_base, k), 0.0, RANDOM_BIAS_SCALE)?)
            } else {
                None
            },
        })
    };
    let layers = layers
        .into_iter()
        .zip(biases)
        .enumerate()
        .map(
            |(i, ((qkv, qkv_bias, o, ffn1, ffn2), (o_bias, ffn1_bias, ffn2_bias)))| {
                Ok(super::tensors::LayerTensors {
                    attn_norm: norm(2 * i as u64)?,
                    qkv,
                    qkv_bias,
                    o,
                    o_bias,
                    ffn_norm: norm(2 * i as u64 + 1)?,
                    ffn1,
                    ffn1_bias,
                    ffn2,
                    ffn2_bias,
                })
            },
        )
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensors {
        embed,
        positions,
        project_in,
        project_out,
        layers,
        final_norm: norm(u64::MAX - 1)?,
        lm_head,
    })
}

/// The seed of tensor `index` of a random model.
fn tensor_seed(seed: u64, index: u64) -> u64 {
    let mut z = seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^ (z >> 29)
}

/// A slot of one tensor.
fn one(name: String, shape: Vec<usize>) -> Stack {
    vec![(name, shape)]
}

/// A slot of one tensor when `present`.
fn opt_one(present: bool, name: String, shape: Vec<usize>) -> Option<Stack> {
    present.then(|| one(name, shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    #[test]
    fn weight_bytes_of_the_papers_models() {
        let llama = Arch::from_config(&preset("llama2-7b").expect("preset")).expect("arch");
        // 6.74 B parameters in fp16.
        assert_eq!(weights_bytes(&llama, DType::F16), 2 * 6_738_415_616);
        // facebook/opt-6.7b: 6.66 B parameters (tied head; 2050 position rows; biases).
        let opt = Arch::from_config(&preset("opt-6.7b").expect("preset")).expect("arch");
        let h = 4096usize;
        let per_layer = 4 * h * h + 4 * h + 2 * h * 16384 + 16384 + h + 4 * h;
        let want = 50272 * h + 2050 * h + 32 * per_layer + 2 * h;
        assert_eq!(weights_bytes(&opt, DType::F16), 2 * want as u64);
        // THUDM/chatglm2-6b: 6.24 B parameters.
        let glm = Arch::from_config(&preset("chatglm2-6b").expect("preset")).expect("arch");
        let qkv = 4096 + 2 * 2 * 128;
        let per_layer = 2 * h + qkv * h + qkv + h * h + 2 * 13696 * h + 13696 * h;
        let want = 2 * 65024 * h + 28 * per_layer + h;
        assert_eq!(weights_bytes(&glm, DType::F16), 2 * want as u64);
    }

    #[test]
    fn every_family_names_distinct_tensors() {
        for p in ["llama2-7b", "qwen1.5-7b", "opt-6.7b", "chatglm2-6b"] {
            let arch = Arch::from_config(&preset(p).expect("preset")).expect("arch");
            let mut n: Vec<String> = names(&arch).names().into_iter().map(|(n, _)| n).collect();
            let all = n.len();
            n.sort();
            n.dedup();
            assert_eq!(n.len(), all, "{p}: a name appears twice");
        }
    }
}
