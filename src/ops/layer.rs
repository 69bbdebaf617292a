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

/// Which elements of a head a rotary pair joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RopeLayout {
    /// HF Llama's rotate-half (GPT-NeoX): over the first R = rotary_dim elements, element i
    /// pairs with i + R/2 (i < R/2).
    #[default]
    Half,
    /// GPT-J / ChatGLM: element 2i pairs with 2i + 1 (i < R/2).
    Interleaved,
}

/// The QKV split (with the optional bias) fused with a rotary embedding of the q and k heads.
///
/// The rotation covers the first `rotary_dim() = 2 · inv_freq.len()` elements of every q and k
/// head; the rest of the head passes through unrotated (ChatGLM2 rotates half of each head,
/// [`RopeLayout::Interleaved`]). An empty `inv_freq` rotates nothing: the op is then the split
/// and the bias alone (OPT, whose positions are learned and added to the embedding).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub geom: AttnGeometry,
    pub dtype: DType,
    /// Position of each token (its index in its sequence).
    pub positions: Vec<i32>,
    /// The rotary_dim / 2 inverse frequencies (rope_theta and rope_scaling already applied):
    /// token at position p rotates pair i by p · inv_freq[i].
    pub inv_freq: Vec<f32>,
    pub layout: RopeLayout,
}

impl RopeParams {
    pub fn tokens(&self) -> usize {
        self.positions.len()
    }

    /// Elements of each q and k head that are rotated (0: none).
    pub fn rotary_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Refuses what a kernel written for the whole-head rotate-half form cannot run (partial
    /// rotary, the interleaved layout), naming the kernel, so that it is never computed wrong.
    pub fn require_whole_half(&self, kernel: &str) -> Result<()> {
        if self.layout == RopeLayout::Half && self.rotary_dim() == self.geom.head_dim {
            return Ok(());
        }
        Err(FdppError::Unsupported {
            spec: kernel.to_string(),
            what: format!(
                "rotary over {} of {} head elements in the {:?} layout (it rotates whole heads, rotate-half)",
                self.rotary_dim(),
                self.geom.head_dim,
                self.layout
            ),
        })
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
        if self.inv_freq.len() > g.head_dim / 2 {
            return Err(FdppError::Shape {
                what: "rope inv_freq".into(),
                expected: format!("at most head_dim / 2 = {}", g.head_dim / 2),
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

/// residual += delta (when given); out = (residual − mean) / √(var + eps) · weight + bias, per
/// row, in fp32 (OPT's LayerNorm; the statistics over the row's `hidden` elements).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormParams {
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
    pub dtype: DType,
}

impl LayerNormParams {
    /// Lengths of (residual, delta, weight, bias, out).
    pub fn validate(
        &self,
        residual: usize,
        delta: Option<usize>,
        weight: usize,
        bias: usize,
        out: usize,
    ) -> Result<()> {
        RmsNormParams {
            rows: self.rows,
            hidden: self.hidden,
            eps: self.eps,
            dtype: self.dtype,
        }
        .validate(residual, delta, weight, out)
        .map_err(|e| FdppError::InvalidArgument(e.to_string().replace("rmsnorm", "layernorm")))?;
        check_len("layernorm bias", self.hidden, bias)
    }
}

/// The activation functions of the MLPs the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// The identity (a bias add alone).
    None,
    Relu,
    /// x · sigmoid(x).
    Silu,
    /// The exact GELU, x · Φ(x) (erf form).
    Gelu,
    /// GELU's tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Relu => "relu",
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
        }
    }

    /// The function in f64 (the reference's precision).
    pub fn apply(self, x: f64) -> f64 {
        match self {
            Activation::None => x,
            Activation::Relu => x.max(0.0),
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
            Activation::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                // x·(1 + tanh u)/2 written as x·σ(2u), which does not cancel for large negative x.
                x / (1.0 + (-2.0 * c * (x + 0.044715 * x * x * x)).exp())
            }
        }
    }
}

/// erf(x) to about 1e-7 absolute (Abramowitz–Stegun 7.1.26 is too coarse for a reference, so
/// this sums the Taylor series near 0 and the continued fraction of erfc beyond).
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 2.5 {
        // erf(a) = 2/√π · Σ (−1)^n a^(2n+1) / (n! (2n+1))
        let mut term = a;
        let mut sum = a;
        let a2 = a * a;
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -a2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(a) = e^(−a²)/√π · 1/(a + 1/2/(a + 1/(a + 3/2/(a + …)))), evaluated from the tail.
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (a + f);
        }
        1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f)
    };
    r.copysign(x)
}

/// x[r][i] = act(x[r][i] + bias[i]) in place over `rows` rows of `width` (a GEMM output's bias
/// and activation: OPT's biased O, fc1 + ReLU and fc2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BiasActParams {
    pub rows: usize,
    pub width: usize,
    pub act: Activation,
    pub dtype: DType,
}

impl BiasActParams {
    /// Lengths of (x, bias).
    pub fn validate(&self, x: usize, bias: Option<usize>) -> Result<()> {
        positive("bias_act", &[("rows", self.rows), ("width", self.width)])?;
        check_len("bias_act x", self.rows * self.width, x)?;
        if let Some(b) = bias {
            check_len("bias_act bias", self.width, b)?;
        }
        Ok(())
    }
}

/// out[r][i] = act(gate[r][i]) · up[r][i] over the fused FFN1 output (`[rows][2·inter]`, gate
/// first): SwiGLU with [`Activation::Silu`] (what [`SiluMulParams`] runs), GeGLU with GELU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GluParams {
    pub rows: usize,
    pub inter: usize,
    pub act: Activation,
    pub dtype: DType,
}

impl GluParams {
    /// Lengths of (gate_up, out).
    pub fn validate(&self, gate_up: usize, out: usize) -> Result<()> {
        positive("glu", &[("rows", self.rows), ("inter", self.inter)])?;
        check_len("glu gate_up", 2 * self.rows * self.inter, gate_up)?;
        check_len("glu out", self.rows * self.inter, out)
    }
}

/// out[t] += table[positions[t] + offset]: learned absolute positions added to the token
/// embedding (OPT's table has `max_position_embeddings + 2` rows and an offset of 2).
#[derive(Clone, Debug, PartialEq)]
pub struct PositionParams {
    pub positions: Vec<i32>,
    pub offset: usize,
    /// Rows of the table.
    pub table_rows: usize,
    pub hidden: usize,
    pub dtype: DType,
}

impl PositionParams {
    /// Lengths of (table, out); every position + offset inside the table.
    pub fn validate(&self, table: usize, out: usize) -> Result<()> {
        positive(
            "add_positions",
            &[
                ("tokens", self.positions.len()),
                ("table_rows", self.table_rows),
                ("hidden", self.hidden),
            ],
        )?;
        if let Some(&p) = self
            .positions
            .iter()
            .find(|&&p| p < 0 || p as usize + self.offset >= self.table_rows)
        {
            return Err(FdppError::InvalidArgument(format!(
                "position {p} (+ offset {}) is outside the learned position table of {} rows; \
                 the model's context is {} tokens",
                self.offset,
                self.table_rows,
                self.table_rows.saturating_sub(self.offset)
            )));
        }
        check_len("position table", self.table_rows * self.hidden, table)?;
        check_len("add_positions out", self.positions.len() * self.hidden, out)
    }
}

/// out[t] = table[ids[t]]: the token embedding lookup.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingParams {
    pub ids: Vec<i32>,
    pub vocab: usize,
    pub hidden: usize,
    pub dtype: DType,
    /// (first id, rows) when the table holds only those rows of the vocabulary (a tensor-parallel
    /// rank's slice): ids outside them give zero rows, which the all-reduce after the lookup
    /// fills from the rank that holds them. None: the table holds all `vocab` rows.
    pub held: Option<(usize, usize)>,
}

impl EmbeddingParams {
    /// The table's rows (all of the vocabulary, or the slice held).
    pub fn table_rows(&self) -> usize {
        self.held.map_or(self.vocab, |(_, rows)| rows)
    }

    /// Each id as a row of the table, or -1 (a zero row) for an id of another rank's slice.
    pub fn local_rows(&self) -> Vec<i32> {
        match self.held {
            None => self.ids.clone(),
            Some((first, rows)) => self
                .ids
                .iter()
                .map(|&id| {
                    let r = id as i64 - first as i64;
                    if (0..rows as i64).contains(&r) {
                        r as i32
                    } else {
                        -1
                    }
                })
                .collect(),
        }
    }

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
        if let Some((first, rows)) = self.held {
            if first.checked_add(rows).is_none_or(|end| end > self.vocab) {
                return Err(FdppError::InvalidArgument(format!(
                    "embedding slice of {rows} rows from id {first} outside the vocabulary (0..{})",
                    self.vocab
                )));
            }
        }
        check_len("embedding table", self.table_rows() * self.hidden, table)?;
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
    fn erf_and_the_activations_match_known_values() {
        for (x, e) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.4, 0.999_311_486_103_355),
            (2.6, 0.999_763_965_583_347_4),
            (3.0, 0.999_977_909_503_001_4),
            (-1.0, -0.842_700_792_949_714_9),
        ] {
            assert!((erf(x) - e).abs() < 1e-9, "erf({x}) = {} not {e}", erf(x));
        }
        // torch.nn.functional.gelu(1.0) and gelu(1.0, approximate='tanh').
        assert!((Activation::Gelu.apply(1.0) - 0.841_344_746).abs() < 1e-8);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_191_990).abs() < 1e-8);
        assert!((Activation::Silu.apply(1.0) - 0.731_058_579).abs() < 1e-8);
        assert_eq!(Activation::Relu.apply(-2.0), 0.0);
        assert_eq!(Activation::None.apply(-2.0), -2.0);
    }

    #[test]
    fn bad_inputs_are_refused_with_names() {
        let e = EmbeddingParams {
            ids: vec![1, 32000],
            vocab: 32000,
            hidden: 8,
            dtype: DType::F16,
            held: None,
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
            inv_freq: vec![1.0; 33],
            layout: RopeLayout::Half,
        };
        assert!(r.validate(2 * 8 * 64, None, 512, 256, 256).is_err(), "inv_freq of 33");
        let g = GatherParams {
            rows: vec![3],
            width: 4,
            dtype: DType::F16,
        };
        assert!(g.validate(12, 4).is_err(), "row 3 of a 3-row source");
    }
}
