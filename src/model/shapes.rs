//! The four linear shapes [K, N] a decoder layer runs, and its attention geometry.
//!
//! FFN1 fuses the gate and up projections into one GEMM with N = 2·intermediate (one read of x,
//! one launch); for a non-gated FFN (OPT) it is the single up projection.

use serde::{Deserialize, Serialize};

use super::config::{ModelArch, ModelConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinearKind {
    Qkv,
    O,
    Ffn1,
    Ffn2,
}

impl LinearKind {
    pub const ALL: [LinearKind; 4] = [LinearKind::Qkv, LinearKind::O, LinearKind::Ffn1, LinearKind::Ffn2];
    pub fn name(self) -> &'static str {
        match self {
            LinearKind::Qkv => "qkv",
            LinearKind::O => "o",
            LinearKind::Ffn1 => "ffn1",
            LinearKind::Ffn2 => "ffn2",
        }
    }
}

impl std::fmt::Display for LinearKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// y[M, N] = x[M, K] · W[N, K]ᵀ
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LinearShape {
    pub kind: LinearKind,
    pub k: usize,
    pub n: usize,
}

impl LinearShape {
    pub fn label(&self) -> String {
        format!("{}[K={},N={}]", self.kind, self.k, self.n)
    }
    /// Elements of W (K·N).
    pub fn weight_elems(&self) -> u64 {
        (self.k as u64).saturating_mul(self.n as u64)
    }
    /// Bytes of W in fp16/bf16.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_elems().saturating_mul(2)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionGeometry {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionGeometry {
    /// Query heads per KV head: 1 for MHA, num_heads for MQA, in between for GQA.
    pub fn gqa_ratio(&self) -> usize {
        self.num_heads.checked_div(self.num_kv_heads).unwrap_or(0)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelShapes {
    pub model: String,
    pub arch: ModelArch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub linears: Vec<LinearShape>,
    pub attention: AttentionGeometry,
    /// Query heads per KV head (attention.num_heads / attention.num_kv_heads).
    pub gqa_ratio: usize,
    pub num_layers: usize,
    /// Bytes of weights read per decode step (all layers, fp16/bf16, plus the LM head).
    pub weight_bytes_per_token: u64,
    /// FFN1 holds gate and up fused (N = 2·intermediate).
    pub ffn1_fused_gate_up: bool,
}

impl ModelShapes {
    pub fn of(cfg: &ModelConfig) -> ModelShapes {
        let h = cfg.hidden_size;
        let q = cfg.num_heads.saturating_mul(cfg.head_dim);
        let kv = cfg.num_kv_heads.saturating_mul(cfg.head_dim);
        let ffn1_n = if cfg.gated_ffn {
            cfg.intermediate_size.saturating_mul(2)
        } else {
            cfg.intermediate_size
        };
        let linears = vec![
            LinearShape {
                kind: LinearKind::Qkv,
                k: h,
                n: q.saturating_add(kv.saturating_mul(2)),
            },
            LinearShape {
                kind: LinearKind::O,
                k: q,
                n: h,
            },
            LinearShape {
                kind: LinearKind::Ffn1,
                k: h,
                n: ffn1_n,
            },
            LinearShape {
                kind: LinearKind::Ffn2,
                k: cfg.intermediate_size,
                n: h,
            },
        ];
        // Saturating: `of` must not panic on a config that skipped validate().
        let per_layer = linears.iter().fold(0u64, |acc, s| acc.saturating_add(s.weight_elems()));
        let lm_head = (cfg.vocab_size as u64).saturating_mul(h as u64);
        let attention = AttentionGeometry {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        ModelShapes {
            model: cfg.name.clone(),
            arch: cfg.arch,
            hidden_size: h,
            intermediate_size: cfg.intermediate_size,
            vocab_size: cfg.vocab_size,
            linears,
            attention,
            gqa_ratio: attention.gqa_ratio(),
            num_layers: cfg.num_layers,
            weight_bytes_per_token: per_layer
                .saturating_mul(cfg.num_layers as u64)
                .saturating_add(lm_head)
                .saturating_mul(2),
            ffn1_fused_gate_up: cfg.gated_ffn,
        }
    }
    pub fn get(&self, kind: LinearKind) -> Option<&LinearShape> {
        self.linears.iter().find(|s| s.kind == kind)
    }
}
