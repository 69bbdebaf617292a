//! GGUF tensor names (llama.cpp's `blk.N.attn_q.weight`) onto HF Llama-style names
//! (`model.layers.N.self_attn.q_proj.weight`), and the row order llama.cpp's converter gives
//! Q and K of the `llama` architecture.

/// (GGUF name within a block, HF name within a layer).
const BLOCK: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Top-level tensors.
const TOP: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// The HF name of a GGUF tensor, None for a tensor with no HF counterpart (it keeps its GGUF
/// name).
pub fn hf_name(gguf: &str) -> Option<String> {
    let (stem, suffix) = gguf.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    if let Some((_, hf)) = TOP.iter().find(|(g, _)| *g == stem) {
        return Some(format!("{hf}.{suffix}"));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, hf) = BLOCK.iter().find(|(g, _)| *g == part)?;
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The GGUF name of an HF name (the inverse of [`hf_name`]), for messages.
pub fn gguf_name(hf: &str) -> Option<String> {
    let (stem, suffix) = hf.rsplit_once('.')?;
    if let Some((g, _)) = TOP.iter().find(|(_, h)| *h == stem) {
        return Some(format!("{g}.{suffix}"));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let (g, _) = BLOCK.iter().find(|(_, h)| *h == part)?;
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Which projection a GGUF name is, for the Q/K row permutation.
pub fn qk_kind(gguf: &str) -> Option<QK> {
    let stem = gguf.rsplit_once('.')?.0;
    let part = stem.strip_prefix("blk.")?.split_once('.')?.1;
    match part {
        "attn_q" => Some(QK::Q),
        "attn_k" => Some(QK::K),
        _ => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QK {
    Q,
    K,
}

/// The file row holding HF row `r` of a Q or K projection (or bias) of `heads` heads.
///
/// HF Llama rotates the pair (i, i + d/2) of each head (rotate_half); llama.cpp's kernels rotate
/// adjacent pairs (2i, 2i + 1), so its converter stores each head's rows interleaved: file row
/// h·d + 2i + s is HF row h·d + s·d/2 + i (s ∈ {0, 1}). Undoing it puts the rows back where HF's
/// rotate_half expects them.
pub fn unpermute_row(r: usize, rows: usize, heads: usize) -> usize {
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return r;
    }
    let d = rows / heads;
    let (h, within) = (r / d, r % d);
    let (s, i) = (within / (d / 2), within % (d / 2));
    h * d + 2 * i + s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("output_norm.weight").as_deref(), Some("model.norm.weight"));
        assert_eq!(
            hf_name("blk.17.attn_output.weight").as_deref(),
            Some("model.layers.17.self_attn.o_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.attn_q.bias").as_deref(),
            Some("model.layers.0.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight").as_deref(),
            Some("model.layers.3.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.1.attn_q"), None);
        for g in ["token_embd.weight", "blk.4.ffn_up.weight", "blk.0.attn_k.bias"] {
            assert_eq!(gguf_name(&hf_name(g).unwrap()).as_deref(), Some(g));
        }
        assert_eq!(qk_kind("blk.2.attn_k.weight"), Some(QK::K));
        assert_eq!(qk_kind("blk.2.attn_v.weight"), None);
    }

    /// llama.cpp's permutation written the other way (reshape to [heads, 2, d/2], swap the
    /// middle axes), composed with ours: the identity.
    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        let (heads, d) = (3, 8);
        let rows = heads * d;
        // permuted[h][i][s] = hf[h][s][i]
        let mut permuted = vec![0usize; rows];
        for h in 0..heads {
            for s in 0..2 {
                for i in 0..d / 2 {
                    permuted[h * d + i * 2 + s] = h * d + s * (d / 2) + i;
                }
            }
        }
        for r in 0..rows {
            assert_eq!(permuted[unpermute_row(r, rows, heads)], r);
        }
    }
}
