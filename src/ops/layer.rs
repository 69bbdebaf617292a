//! The small ops of one Llama-family layer besides the GEMMs and attention: embedding lookup,
//! residual add fused with RMSNorm, the QKV split fused with bias and rotary embedding, SiLU·mul,
//! the KV append of a decode step, row gather, and device-side random fill.
//!
//! They move a few MB per layer against the weights' hundreds, so what matters is how many
//! launches a decode step makes (FlashDecoding++Next keeps the step a fixed sequence of kernels):
//! every op here fuses what the forward always does back to back.
//!
//! Layouts (row-major, 16-bit elements of `dtype`):
//! - hidden states `[rows][hidden]`;
//! - the fused QKV output `[tokens][(H + 2·G)·D]`: H query heads, then G key heads, then G
//!   value heads of D each (the fused weight stacks q_proj, k_proj, v_proj rows in that order);
//! - the fused FFN1 output `[rows][2·inter]`: gate first, then up (gate_proj rows, then up_proj);
//! - q `[tokens][H·D]`, k and v `[tokens][G·D]`, as the attention ops take them.

use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::paged::{FlatBlockTables, PagedKvLayout};
use crate::ops::attention::AttnGeometry;

/// residual += delta (when given); out = residual / rms(residual) · weight, per row, in fp32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormParams {
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
    pub dtype: DType,
}

impl RmsNormParams {
    /// Lengths of (residual, delta, weight, out).
    pub fn validate(&self, residual: usize, delta: Option<usize>, weight: usize, out: usize) -> Result<()> {
        positive("rmsnorm", &[("rows", self.rows), ("hidden", self.hidden)])?;
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(FdppError::InvalidArgument(format!(
                "rmsnorm: eps {} must be a positive finite number (config rms_norm_eps)",
                self.eps
            )));
        }
        let n = self.rows * self.hidden;
        check_len("rmsnorm residual", n, residual)?;
        if let Some(d) = delta {
            check_len("rmsnorm delta", n, d)?;
        }
        check_len("rmsnorm weight", self.hidden, weight)?;
        check_len("rmsnorm out", n, out)
    }
}

/// Rotary embedding in the rotate-half form of HF's Llama (element i pairs with i + D/2), applied
/// to the q and k heads while the fused QKV output is split.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub geom: AttnGeometry,
    pub dtype: DType,
    /// Position of each token (its index in its sequence).
    pub positions: Vec<i32>,
    /// The D/2 inverse frequencies (rope_theta and rope_scaling already applied): token at
    /// position p rotates pair i by p · inv_freq[i].
    pub inv_freq: Vec<f32>,
}

impl RopeParams {
    pub fn tokens(&self) -> usize {
        self.positions.len()
    }

    /// Width of one row of the fused QKV output.
    pub fn qkv_width(&self) -> usize {
        let g = &self.geom;
        (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
    }

    /// Lengths of (qkv, bias, q, k, v).
    pub fn validate(&self, qkv: usize, bias: Option<usize>, q: usize, k: usize, v: usize) -> Result<()> {
        self.geom.validate()?;
        let g = &self.geom;
        if self.positions.is_empty() {
            return Err(FdppError::InvalidArgument("rope: no tokens".into()));
        }
        if let Some(p) = self.positions.iter().find(|&&p| p < 0) {
            return Err(FdppError::InvalidArgument(format!("rope: position {p} is negative")));
        }
        if self.inv_freq.len() != g.head_dim / 2 {
            return Err(FdppError::Shape {
                what: "rope inv_freq".into(),
                expected: format!("head_dim / 2 = {}", g.head_dim / 2),
                found: self.inv_freq.len().to_string(),
            });
        }
        let t = self.tokens();
        check_len("rope qkv", t * self.qkv_width(), qkv)?;
        if let Some(b) = bias {
            check_len("rope qkv bias", self.qkv_width(), b)?;
        }
        check_len("rope q", t * g.num_heads * g.head_dim, q)?;
        check_len("rope k", t * g.num_kv_heads * g.head_dim, k)?;
        check_len("rope v", t * g.num_kv_heads * g.head_dim, v)
    }
}

/// out[r][i] = silu(gate[r][i]) · up[r][i] over the fused FFN1 output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SiluMulParams {
    pub rows: usize,
    pub inter: usize,
    pub dtype: DType,
}

impl SiluMulParams {
    /// Lengths of (gate_up, out).
    pub fn validate(&self, gate_up: usize, out: usize) -> Result<()> {
        positive("silu_mul", &[("rows", self.rows), ("inter", self.inter)])?;
        check_len("silu_mul gate_up", 2 * self.rows * self.inter, gate_up)?;
        check_len("silu_mul out", self.rows * self.inter, out)
    }
}

/// out[t] = table[ids[t]]: the token embedding lookup.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingParams {
    pub ids: Vec<i32>,
    pub vocab: usize,
    pub hidden: usize,
    pub dtype: DType,
}

impl EmbeddingParams {
    /// Lengths of (table, out); every id inside the vocabulary.
    pub fn validate(&self, table: usize, out: usize) -> Result<()> {
        positive(
            "embedding",
            &[
                ("tokens", self.ids.len()),
                ("vocab", self.vocab),
                ("hidden", self.hidden),
            ],
        )?;
        if let Some(&id) = self.ids.iter().find(|&&id| id < 0 || id as usize >= self.vocab) {
            return Err(FdppError::InvalidArgument(format!(
                "token id {id} is outside the vocabulary (0..{})",
                self.vocab
            )));
        }
        check_len("embedding table", self.vocab * self.hidden, table)?;
        check_len("embedding out", self.ids.len() * self.hidden, out)
    }
}

/// dst[i] = src[rows[i]] for rows of `width` elements (the last token of each sequence before
/// the LM head).
#[derive(Clone, Debug, PartialEq)]
pub struct GatherParams {
    pub rows: Vec<i32>,
    pub width: usize,
    pub dtype: DType,
}

impl GatherParams {
    /// Lengths of (src, dst); every row inside src.
    pub fn validate(&self, src: usize, dst: usize) -> Result<()> {
        positive("gather_rows", &[("rows", self.rows.len()), ("width", self.width)])?;
        let src_rows = src / self.width;
        if let Some(&r) = self.rows.iter().find(|&&r| r < 0 || r as usize >= src_rows) {
            return Err(FdppError::InvalidArgument(format!(
                "gather_rows: row {r} is outside the source's {src_rows} rows"
            )));
        }
        check_len("gather_rows dst", self.rows.len() * self.width, dst)
    }
}

/// Writes the new tokens' k and v (`[tokens][G·D]`, sequence 0's first) into the pools at
/// positions `seq_lens[b] − new_lens[b] .. seq_lens[b]` of each block table (the decode step
/// appends its one token per sequence before attending).
#[derive(Clone, Debug, PartialEq)]
pub struct KvAppendParams {
    pub tables: FlatBlockTables,
    pub new_lens: Vec<i32>,
}

impl KvAppendParams {
    pub fn tokens(&self) -> usize {
        self.new_lens.iter().map(|&n| n.max(0) as usize).sum()
    }

    /// Lengths of (k, v, K pool, V pool).
    pub fn validate(&self, layout: &PagedKvLayout, k: usize, v: usize, pools: (usize, usize)) -> Result<()> {
        self.tables.validate(layout)?;
        if self.new_lens.len() != self.tables.batch() {
            return Err(FdppError::Shape {
                what: "kv_append new_lens".into(),
                expected: format!("one per sequence ({})", self.tables.batch()),
                found: self.new_lens.len().to_string(),
            });
        }
        for (b, &n) in self.new_lens.iter().enumerate() {
            if n < 1 || n as usize > self.tables.seq_len(b) {
                return Err(FdppError::InvalidArgument(format!(
                    "kv_append sequence {b}: {n} new tokens, must be 1..={} (its kv_len after the step)",
                    self.tables.seq_len(b)
                )));
            }
        }
        let n = self.tokens() * layout.token_elems();
        check_len("kv_append k", n, k)?;
        check_len("kv_append v", n, v)?;
        check_len("K pool", layout.pool_elems(), pools.0)?;
        check_len("V pool", layout.pool_elems(), pools.1)
    }
}

/// The value [`fill_random`](crate::backend::Backend::fill_random) writes at `index`: uniform in
/// [−scale, scale), from a counter-based hash of (seed, index), so that every backend builds the
/// same random model bit for bit, directly in its own memory.
pub fn random_value(seed: u64, index: u64, scale: f32) -> f32 {
    // splitmix64 of the counter: cheap, stateless, and the same in Rust, CUDA and HIP.
    let mut z = seed
        .wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 29;
    // The top 24 bits as a fraction in [0, 1): exact in f32.
    let unit = (z >> 40) as f32 / (1u64 << 24) as f32;
    (2.0 * unit - 1.0) * scale
}

fn positive(op: &str, dims: &[(&str, usize)]) -> Result<()> {
    for (name, v) in dims {
        if *v == 0 {
            return Err(FdppError::InvalidArgument(format!("{op}: {name} must be at least 1")));
        }
    }
    Ok(())
}

fn check_len(what: &str, need: usize, found: usize) -> Result<()> {
    if found < need {
        return Err(FdppError::Shape {
            what: what.into(),
            expected: format!("at least {need} elements"),
            found: found.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_are_uniform_in_range_and_reproducible() {
        let vals: Vec<f32> = (0..100_000).map(|i| random_value(7, i, 0.5)).collect();
        assert!(vals.iter().all(|v| (-0.5..0.5).contains(v)));
        let mean = vals.iter().sum::<f32>() / vals.len() as f32;
        assert!(mean.abs() < 0.01, "mean {mean}");
        // Uniform on [-0.5, 0.5): variance 1/12.
        let var = vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / vals.len() as f32;
        assert!((var - 1.0 / 12.0).abs() < 0.003, "var {var}");
        assert_eq!(random_value(7, 123, 0.5), vals[123]);
        assert_ne!(random_value(8, 123, 0.5), vals[123]);
    }

    #[test]
    fn bad_inputs_are_refused_with_names() {
        let e = EmbeddingParams {
            ids: vec![1, 32000],
            vocab: 32000,
            hidden: 8,
            dtype: DType::F16,
        }
        .validate(32000 * 8, 16)
        .expect_err("id out of range");
        assert!(e.to_string().contains("token id 32000"), "{e}");
        let p = RmsNormParams {
            rows: 2,
            hidden: 4,
            eps: 0.0,
            dtype: DType::F16,
        };
        assert!(p.validate(8, None, 4, 8).is_err());
        let geom = AttnGeometry::new(4, 2, 64).expect("geom");
        let r = RopeParams {
            geom,
            dtype: DType::F16,
            positions: vec![0, 1],
            inv_freq: vec![1.0; 31],
        };
        assert!(r.validate(2 * 8 * 64, None, 512, 256, 256).is_err(), "inv_freq of 31");
        let g = GatherParams {
            rows: vec![3],
            width: 4,
            dtype: DType::F16,
        };
        assert!(g.validate(12, 4).is_err(), "row 3 of a 3-row source");
    }
}
