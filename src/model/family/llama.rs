//! HF names of the Llama family's checkpoints (LlamaForCausalLM, MistralForCausalLM,
//! Qwen2ForCausalLM: Llama 2/3/3.x, Mistral, Qwen1.5/2/2.5 share them).

use super::{one, opt_one};
use crate::model::arch::Arch;
use crate::model::tensors::{LayerTensors, Norm, Stack, Tensors};

pub fn names(a: &Arch) -> Tensors<Stack> {
    let (h, q, kv, inter) = (a.hidden, a.q_width(), a.kv_width(), a.inter);
    let layers = (0..a.layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            let attn = |w: &str, suffix: &str, shape: Vec<usize>| (format!("{p}.self_attn.{w}_proj.{suffix}"), shape);
            LayerTensors {
                attn_norm: Norm {
                    weight: one(format!("{p}.input_layernorm.weight"), vec![h]),
                    bias: None,
                },
                qkv: vec![
                    attn("q", "weight", vec![q, h]),
                    attn("k", "weight", vec![kv, h]),
                    attn("v", "weight", vec![kv, h]),
                ],
                qkv_bias: a.qkv_bias.then(|| {
                    vec![
                        attn("q", "bias", vec![q]),
                        attn("k", "bias", vec![kv]),
                        attn("v", "bias", vec![kv]),
                    ]
                }),
                o: vec![attn("o", "weight", vec![h, q])],
                o_bias: opt_one(a.o_bias, format!("{p}.self_attn.o_proj.bias"), vec![h]),
                ffn_norm: Norm {
                    weight: one(format!("{p}.post_attention_layernorm.weight"), vec![h]),
                    bias: None,
                },
                ffn1: vec![
                    (format!("{p}.mlp.gate_proj.weight"), vec![inter, h]),
                    (format!("{p}.mlp.up_proj.weight"), vec![inter, h]),
                ],
                ffn1_bias: None,
                ffn2: one(format!("{p}.mlp.down_proj.weight"), vec![h, inter]),
                ffn2_bias: None,
            }
        })
        .collect();
    Tensors {
        embed: one("model.embed_tokens.weight".into(), vec![a.vocab, h]),
        positions: None,
        project_in: None,
        project_out: None,
        layers,
        final_norm: Norm {
            weight: one("model.norm.weight".into(), vec![h]),
            bias: None,
        },
        lm_head: opt_one(!a.tied_embeddings, "lm_head.weight".into(), vec![a.vocab, h]),
    }
}
