//! The four linear shapes [K, N] a decoder layer runs, and its attention geometry.
//!
//! FFN1 fuses the gate and up projections into one GEMM with N = 2·intermediate (one read of x,
//! one launch); for a non-gated FFN (OPT) it is the single up projection.

use serde::{Deserialize, Serialize};

use super::config::ModelConfig;

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionGeometry {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelShapes {
    pub model: String,
    pub linears: Vec<LinearShape>,
    pub attention: AttentionGeometry,
    pub num_layers: usize,
    /// Bytes of weights read per decode step (all layers, fp16/bf16, plus the LM head).
    pub weight_bytes_per_token: u64,
    /// FFN1 holds gate and up fused (N = 2·intermediate).
    pub ffn1_fused_gate_up: bool,
}

impl ModelShapes {
    pub fn of(cfg: &ModelConfig) -> ModelShapes {
        let h = cfg.hidden_size;
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        let ffn1_n = if cfg.gated_ffn {
            2 * cfg.intermediate_size
        } else {
            cfg.intermediate_size
        };
        let linears = vec![
            LinearShape {
                kind: LinearKind::Qkv,
                k: h,
                n: q + 2 * kv,
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
        let per_layer: u64 = linears.iter().map(|s| (s.k * s.n) as u64).sum();
        let head = (cfg.vocab_size * h) as u64;
        ModelShapes {
            model: cfg.name.clone(),
            linears,
            attention: AttentionGeometry {
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            },
            num_layers: cfg.num_layers,
            weight_bytes_per_token: 2 * (per_layer * cfg.num_layers as u64 + head),
            ffn1_fused_gate_up: cfg.gated_ffn,
        }
    }
    pub fn get(&self, kind: LinearKind) -> Option<&LinearShape> {
        self.linears.iter().find(|s| s.kind == kind)
    }
}
