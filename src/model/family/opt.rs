//! HF names of OPT checkpoints (OPTForCausalLM, pre-LayerNorm): biased q/k/v/out_proj, fc1 and
//! fc2, LayerNorms with bias, learned positions with two leading rows, project_in/project_out
//! when word_embed_proj_dim differs from hidden_size, and an LM head tied to embed_tokens.

use super::{one, opt_one};
use crate::model::arch::{Arch, Positions};
use crate::model::tensors::{LayerTensors, Norm, Stack, Tensors};

pub fn names(a: &Arch) -> Tensors<Stack> {
    let (h, q, kv, inter, e) = (a.hidden, a.q_width(), a.kv_width(), a.inter, a.embed_dim);
    let d = "model.decoder";
    let norm = |name: String| Norm {
        weight: one(format!("{name}.weight"), vec![h]),
        bias: Some(one(format!("{name}.bias"), vec![h])),
    };
    let layers = (0..a.layers)
        .map(|i| {
            let p = format!("{d}.layers.{i}");
            let attn = |w: &str, suffix: &str, shape: Vec<usize>| (format!("{p}.self_attn.{w}_proj.{suffix}"), shape);
            LayerTensors {
                attn_norm: norm(format!("{p}.self_attn_layer_norm")),
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
                o: vec![attn("out", "weight", vec![h, q])],
                o_bias: opt_one(a.o_bias, format!("{p}.self_attn.out_proj.bias"), vec![h]),
                // OPT calls the layer's second norm final_layer_norm (before fc1).
                ffn_norm: norm(format!("{p}.final_layer_norm")),
                ffn1: one(format!("{p}.fc1.weight"), vec![inter, h]),
                ffn1_bias: opt_one(a.ffn_bias, format!("{p}.fc1.bias"), vec![inter]),
                ffn2: one(format!("{p}.fc2.weight"), vec![h, inter]),
                ffn2_bias: opt_one(a.ffn_bias, format!("{p}.fc2.bias"), vec![h]),
            }
        })
        .collect();
    let rows = match a.positions {
        Positions::Learned { rows, .. } => Some(rows),
        Positions::Rotary { .. } => None,
    };
    Tensors {
        embed: one(format!("{d}.embed_tokens.weight"), vec![a.vocab, e]),
        positions: rows.map(|r| one(format!("{d}.embed_positions.weight"), vec![r, h])),
        project_in: opt_one(a.projects_embedding(), format!("{d}.project_in.weight"), vec![h, e]),
        project_out: opt_one(a.projects_embedding(), format!("{d}.project_out.weight"), vec![e, h]),
        layers,
        final_norm: norm(format!("{d}.final_layer_norm")),
        lm_head: opt_one(!a.tied_embeddings, "lm_head.weight".into(), vec![a.vocab, e]),
    }
}
