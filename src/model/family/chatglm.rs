//! HF names of ChatGLM2/ChatGLM3 checkpoints (THUDM's ChatGLMModel): q, k and v already fused
//! in query_key_value (rows q, then k, then v), the SwiGLU's gate and up fused in
//! dense_h_to_4h (gate half first), RMSNorms without bias, an untied output_layer.

use super::{one, opt_one};
use crate::model::arch::Arch;
use crate::model::tensors::{LayerTensors, Norm, Stack, Tensors};

pub fn names(a: &Arch) -> Tensors<Stack> {
    let (h, q, qkv, inter) = (a.hidden, a.q_width(), a.qkv_width(), a.inter);
    let norm = |name: String| Norm {
        weight: one(format!("{name}.weight"), vec![h]),
        bias: None,
    };
    let layers = (0..a.layers)
        .map(|i| {
            let p = format!("transformer.encoder.layers.{i}");
            LayerTensors {
                attn_norm: norm(format!("{p}.input_layernorm")),
                qkv: one(format!("{p}.self_attention.query_key_value.weight"), vec![qkv, h]),
                qkv_bias: opt_one(
                    a.qkv_bias,
                    format!("{p}.self_attention.query_key_value.bias"),
                    vec![qkv],
                ),
                o: one(format!("{p}.self_attention.dense.weight"), vec![h, q]),
                o_bias: opt_one(a.o_bias, format!("{p}.self_attention.dense.bias"), vec![h]),
                ffn_norm: norm(format!("{p}.post_attention_layernorm")),
                ffn1: one(format!("{p}.mlp.dense_h_to_4h.weight"), vec![2 * inter, h]),
                ffn1_bias: opt_one(a.ffn_bias, format!("{p}.mlp.dense_h_to_4h.bias"), vec![2 * inter]),
                ffn2: one(format!("{p}.mlp.dense_4h_to_h.weight"), vec![h, inter]),
                ffn2_bias: opt_one(a.ffn_bias, format!("{p}.mlp.dense_4h_to_h.bias"), vec![h]),
            }
        })
        .collect();
    Tensors {
        embed: one("transformer.embedding.word_embeddings.weight".into(), vec![a.vocab, h]),
        positions: None,
        project_in: None,
        project_out: None,
        layers,
        final_norm: norm("transformer.encoder.final_layernorm".into()),
        lm_head: opt_one(
            !a.tied_embeddings,
            "transformer.output_layer.weight".into(),
            vec![a.vocab, h],
        ),
    }
}
