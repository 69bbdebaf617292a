//! The small ops of a layer on the CPU (see [`crate::ops::layer`] for the layouts): the CPU
//! backend runs real small models end to end, so these are multithreaded over rows (tokens)
//! like the GEMMs, widen a row to f32 once, and round to the 16-bit type once per output.
//!
//! Every function validates its params against the buffer lengths and dtypes before it touches
//! memory, so that a bad call is a clean error and leaves every buffer as it was.

use rayon::prelude::*;

use super::pool::{self, Rows};
use super::simd::{self, load16, multiversion, Vf32, LANES};
use super::CpuBuffer;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::paged::{write_tokens, PagedKv};
use crate::ops::layer::{
    random_value, Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};

/// Every named buffer must hold `dtype`; the error names the first that does not.
fn check_dtypes(op: &str, dtype: DType, bufs: &[(&str, &CpuBuffer)]) -> Result<()> {
    match bufs.iter().find(|(_, b)| b.dtype != dtype) {
        Some((name, b)) => Err(FdppError::InvalidArgument(format!(
            "{op}: buffer '{name}' holds {}, the call is {dtype}; every buffer must be {dtype}",
            b.dtype
        ))),
        None => Ok(()),
    }
}

/// out[t] = table[ids[t]].
pub fn embedding(p: &EmbeddingParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
    p.validate(table.data.len(), out.data.len())?;
    check_dtypes("embedding", p.dtype, &[("table", table), ("out", out)])?;
    let h = p.hidden;
    let rows = p.local_rows();
    pool::for_row_blocks_mut(&mut out.data[..p.ids.len() * h], h, |t0, block| {
        for (t, o) in (t0..).zip(block.chunks_exact_mut(h)) {
            // Validated: 0 <= id < vocab; a row of the table, or -1 for another rank's slice.
            match usize::try_from(rows[t]) {
                Ok(r) => o.copy_from_slice(&table.data[r * h..(r + 1) * h]),
                Err(_) => o.fill(0),
            }
        }
    });
    Ok(())
}

/// residual += delta (stored rounded); out = residual · rsqrt(mean(residual²) + eps) · weight.
///
/// HF's LlamaRMSNorm rounds the normalised value to the dtype before multiplying by the weight
/// (two roundings); here the product is taken in f32 and rounded once. Both stay within the
/// 16-bit types' tolerance of the exact result.
pub fn add_rmsnorm(
    p: &RmsNormParams,
    residual: &mut CpuBuffer,
    delta: Option<&CpuBuffer>,
    weight: &CpuBuffer,
    out: &mut CpuBuffer,
) -> Result<()> {
    p.validate(
        residual.data.len(),
        delta.map(|d| d.data.len()),
        weight.data.len(),
        out.data.len(),
    )?;
    let mut named = vec![("residual", &*residual), ("weight", weight), ("out", &*out)];
    if let Some(d) = delta {
        named.push(("delta", d));
    }
    check_dtypes("add_rmsnorm", p.dtype, &named)?;
    let (dt, h, n) = (p.dtype, p.hidden, p.rows * p.hidden);
    let mut w = vec![0f32; h];
    simd::widen(dt, &weight.data[..h], &mut w);
    let delta = delta.map(|d| &d.data[..n]);
    let (ress, outs) = (Rows::new(&mut residual.data[..n], h), Rows::new(&mut out.data[..n], h));
    pool::for_ranges(p.rows, |rs| {
        let mut x = vec![0f32; h];
        for r in rs {
            // SAFETY: the ranges are disjoint, so row r is this task's alone.
            let (res, o) = unsafe { (ress.row(r), outs.row(r)) };
            let d = delta.map(|d| &d[r * h..(r + 1) * h]);
            rms_row(dt, p.eps, res, d, &w, &mut x, o);
        }
    });
    Ok(())
}

multiversion! {
    /// One row of [`add_rmsnorm`], eight lanes at a time (widening and rounding in registers
    /// where the CPU has F16C: the scalar per-element rounding of `half` was most of the op's
    /// time). `x` is scratch of the row's length.
    fn rms_row(dt: DType, eps: f32, res: &mut [u16], delta: Option<&[u16]>, w: &[f32], x: &mut [f32], o: &mut [u16]) => rms_row_generic
}

#[inline(always)]
fn rms_row_generic<V: Vf32>(
    dt: DType,
    eps: f32,
    res: &mut [u16],
    delta: Option<&[u16]>,
    w: &[f32],
    x: &mut [f32],
    o: &mut [u16],
) {
    let h = res.len();
    let x = &mut x[..h];
    V::widen(dt, res, x);
    if let Some(d) = delta {
        // The sum is stored in the dtype and the norm reads the stored value, as HF keeps the
        // residual stream in the model's dtype.
        let (x8, x_tail) = x.as_chunks_mut::<LANES>();
        let (d8, d_tail) = d[..h].as_chunks::<LANES>();
        let (r8, r_tail) = res.as_chunks_mut::<LANES>();
        for ((xc, dc), rc) in x8.iter_mut().zip(d8).zip(r8) {
            V::load(xc).add(load16::<V>(dt, dc)).store_narrow(dt, rc);
            load16::<V>(dt, rc).store(xc);
        }
        for ((xv, &dv), rv) in x_tail.iter_mut().zip(d_tail).zip(r_tail) {
            *rv = dt.from_f32(*xv + dt.to_f32(dv));
            *xv = dt.to_f32(*rv);
        }
    }
    let (x8, x_tail) = x.as_chunks::<LANES>();
    let mut acc = V::zero();
    for c in x8 {
        let v = V::load(c);
        acc = v.madd(v, acc);
    }
    let ss = acc.hsum() + x_tail.iter().map(|v| v * v).sum::<f32>();
    let inv = 1.0 / (ss / h as f32 + eps).sqrt();
    let (w8, w_tail) = w[..h].as_chunks::<LANES>();
    let (o8, o_tail) = o[..h].as_chunks_mut::<LANES>();
    let vi = V::splat(inv);
    for ((xc, wc), oc) in x8.iter().zip(w8).zip(o8) {
        V::load(xc).mul(vi).mul(V::load(wc)).store_narrow(dt, oc);
    }
    for ((ov, &xv), &wv) in o_tail.iter_mut().zip(x_tail).zip(w_tail) {
        *ov = dt.from_f32(xv * inv * wv);
    }
}

/// Σ x² in f32 with eight independent running sums (one per lane of a vector), reduced
/// pairwise: shorter dependency chains and a smaller rounding error than one running sum.
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (chunks, tail) = x.as_chunks::<8>();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, v) in acc.iter_mut().zip(tail) {
        *a += v * v;
    }
    let s = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Split the fused QKV rows into q, k, v: bias added (when given), the first rotary_dim elements
/// of every q and k head rotated (rotate-half or interleaved pairs, [`RopeLayout`]; none when
/// inv_freq is empty), the rest of each head and v copied.
///
/// HF rounds the projection (with its bias) to the dtype, takes cos and sin rounded to the
/// dtype and rotates in the dtype; here bias, rotation and cos/sin stay in f32 and each output
/// is rounded once. The angle θ = position · inv_freq is taken in f32 as HF takes it.
pub fn qkv_rope(
    p: &RopeParams,
    qkv: &CpuBuffer,
    bias: Option<&CpuBuffer>,
    q: &mut CpuBuffer,
    k: &mut CpuBuffer,
    v: &mut CpuBuffer,
) -> Result<()> {
    qkv_rope_with(p, &RopeTable::new(&p.positions, &p.inv_freq), qkv, bias, q, k, v)
}

/// cos and sin of θ = position · inv_freq for every token of a step and every pair, the same
/// in every layer: the CPU backend keeps the last one ([`RopeCache`]) so that a prefill of 128
/// tokens computes its 4096 pairs once per step, not once per layer (~3 ms of 30 layers).
pub struct RopeTable {
    positions: Vec<i32>,
    inv_freq: Vec<f32>,
    /// [tokens, pairs].
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(positions: &[i32], inv_freq: &[f32]) -> RopeTable {
        let stride = Self::stride(inv_freq.len());
        let (mut cos, mut sin) = (
            vec![0f32; positions.len() * stride],
            vec![0f32; positions.len() * stride],
        );
        for (t, &pos) in positions.iter().enumerate() {
            for (i, &f) in inv_freq.iter().enumerate() {
                let theta = pos as f32 * f;
                cos[t * stride + i] = theta.cos();
                sin[t * stride + i] = theta.sin();
            }
        }
        RopeTable {
            positions: positions.to_vec(),
            inv_freq: inv_freq.to_vec(),
            cos,
            sin,
        }
    }

    /// A token's row in the tables: at least one value, so that a model without RoPE (no
    /// pairs) still has one row per token to iterate over.
    fn stride(pairs: usize) -> usize {
        pairs.max(1)
    }

    /// Whether this is the table of these positions and frequencies (compared bit for bit).
    fn is_for(&self, positions: &[i32], inv_freq: &[f32]) -> bool {
        self.positions == positions
            && self.inv_freq.len() == inv_freq.len()
            && self
                .inv_freq
                .iter()
                .zip(inv_freq)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

/// The last step's [`RopeTable`], reused while the positions and frequencies stay the same.
#[derive(Default)]
pub struct RopeCache(std::sync::Mutex<Option<std::sync::Arc<RopeTable>>>);

impl RopeCache {
    pub fn get(&self, positions: &[i32], inv_freq: &[f32]) -> std::sync::Arc<RopeTable> {
        // A poisoned lock only means another call panicked mid-update of the Option: start over.
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match &*slot {
            Some(t) if t.is_for(positions, inv_freq) => t.clone(),
            _ => {
                let t = std::sync::Arc::new(RopeTable::new(positions, inv_freq));
                *slot = Some(t.clone());
                t
            }
        }
    }
}

/// [`qkv_rope`] with cos and sin from `table`, which must be of `p`'s positions and inv_freq.
pub fn qkv_rope_with(
    p: &RopeParams,
    table: &RopeTable,
    qkv: &CpuBuffer,
    bias: Option<&CpuBuffer>,
    q: &mut CpuBuffer,
    k: &mut CpuBuffer,
    v: &mut CpuBuffer,
) -> Result<()> {
    if !table.is_for(&p.positions, &p.inv_freq) {
        return Err(FdppError::InvalidArgument(
            "qkv_rope: the cos/sin table is of other positions or frequencies".into(),
        ));
    }
    p.validate(
        qkv.data.len(),
        bias.map(|b| b.data.len()),
        q.data.len(),
        k.data.len(),
        v.data.len(),
    )?;
    let mut named = vec![("qkv", qkv), ("q", &*q), ("k", &*k), ("v", &*v)];
    if let Some(b) = bias {
        named.push(("bias", b));
    }
    check_dtypes("qkv_rope", p.dtype, &named)?;
    let g = p.geom;
    let (dt, d, t) = (p.dtype, g.head_dim, p.tokens());
    let (qw, kw, width) = (g.num_heads * d, g.num_kv_heads * d, p.qkv_width());
    let pairs = p.inv_freq.len();
    let bias: Option<Vec<f32>> = bias.map(|b| {
        let mut f = vec![0f32; width];
        simd::widen(dt, &b.data[..width], &mut f);
        f
    });
    let (qs, ks, vs) = (
        Rows::new(&mut q.data[..t * qw], qw),
        Rows::new(&mut k.data[..t * kw], kw),
        Rows::new(&mut v.data[..t * kw], kw),
    );
    let stride = RopeTable::stride(pairs);
    pool::for_ranges(t, |rs| {
        let mut x = vec![0f32; width];
        for r in rs {
            // SAFETY: the ranges are disjoint, so token r's rows are this task's alone.
            let (qo, ko, vo) = unsafe { (qs.row(r), ks.row(r), vs.row(r)) };
            let cos = &table.cos[r * stride..r * stride + pairs];
            let sin = &table.sin[r * stride..r * stride + pairs];
            simd::widen(dt, &qkv.data[r * width..(r + 1) * width], &mut x);
            if let Some(b) = &bias {
                for (xv, bv) in x.iter_mut().zip(b) {
                    *xv += bv;
                }
            }
            let (xq, rest) = x.split_at_mut(qw);
            let (xk, xv) = rest.split_at_mut(kw);
            rotate_heads(p.layout, d, xq, cos, sin);
            rotate_heads(p.layout, d, xk, cos, sin);
            simd::narrow(dt, xq, qo);
            simd::narrow(dt, xk, ko);
            simd::narrow(dt, xv, vo);
        }
    });
    Ok(())
}

/// RoPE of every head of `x` (heads of `d` elements) in place: pair i (i < cos.len()) is
/// (i, i + R/2) in the rotate-half layout or (2i, 2i + 1) interleaved, R = 2·cos.len(); the
/// elements from R on are left as they are. The caller rounds the whole row at once.
fn rotate_heads(layout: RopeLayout, d: usize, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for xh in x.chunks_exact_mut(d) {
        for i in 0..half {
            let (a, b) = match layout {
                RopeLayout::Half => (i, i + half),
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
            };
            let (xa, xb) = (xh[a], xh[b]);
            xh[a] = xa * cos[i] - xb * sin[i];
            xh[b] = xb * cos[i] + xa * sin[i];
        }
    }
}

/// out[r][i] = silu(gate[r][i]) · up[r][i]. HF rounds silu(gate) to the dtype before the
/// product; here it is one f32 expression rounded once.
pub fn silu_mul(p: &SiluMulParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
    p.validate(gate_up.data.len(), out.data.len())?;
    check_dtypes("silu_mul", p.dtype, &[("gate_up", gate_up), ("out", out)])?;
    let (dt, inter) = (p.dtype, p.inter);
    // Chunks of at most SILU_CHUNK outputs, so that one long row (decode: rows = 1) is still
    // spread over the threads.
    let chunk = inter.clamp(1, SILU_CHUNK);
    let per_row = inter.div_ceil(chunk);
    let outs = Rows::new(&mut out.data[..p.rows * inter], inter);
    // Items (row, chunk) in row order; a task takes a run of them.
    pool::for_ranges(p.rows * per_row, |items| {
        let (mut gf, mut uf) = (vec![0f32; chunk], vec![0f32; chunk]);
        for item in items {
            let (r, c) = (item / per_row, item % per_row);
            let (a, z) = (c * chunk, ((c + 1) * chunk).min(inter));
            // SAFETY: the ranges are disjoint, so chunk c of row r is this task's alone.
            let oc = unsafe { outs.span(r * inter + a, r * inter + z) };
            let at = r * 2 * inter + a;
            let n = z - a;
            simd::widen(dt, &gate_up.data[at..at + n], &mut gf[..n]);
            simd::widen(dt, &gate_up.data[at + inter..at + inter + n], &mut uf[..n]);
            silu_mul_run(dt, &gf[..n], &uf[..n], oc);
        }
    });
    Ok(())
}

multiversion! {
    /// o = silu(g) · u rounded, eight lanes at a time with the vector exp of simd.rs (a scalar
    /// `exp` and rounding per element were the op's time).
    fn silu_mul_run(dt: DType, g: &[f32], u: &[f32], o: &mut [u16]) => silu_mul_run_generic
}

#[inline(always)]
fn silu_mul_run_generic<V: Vf32>(dt: DType, g: &[f32], u: &[f32], o: &mut [u16]) {
    let n = o.len();
    let (g8, g_tail) = g[..n].as_chunks::<LANES>();
    let (u8s, u_tail) = u[..n].as_chunks::<LANES>();
    let (o8, o_tail) = o.as_chunks_mut::<LANES>();
    let (zero, one) = (V::zero(), V::splat(1.0));
    for ((gc, uc), oc) in g8.iter().zip(u8s).zip(o8) {
        let gv = V::load(gc);
        gv.div(one.add(zero.sub(gv).exp()))
            .mul(V::load(uc))
            .store_narrow(dt, oc);
    }
    for ((ov, &gv), &uv) in o_tail.iter_mut().zip(g_tail).zip(u_tail) {
        *ov = dt.from_f32(gv / (1.0 + (-gv).exp()) * uv);
    }
}

/// Outputs per task of [`silu_mul`].
const SILU_CHUNK: usize = 4096;

/// residual += delta (stored rounded); out = (residual − mean) / √(var + eps) · weight + bias,
/// the statistics over the stored residual in f32 (two passes: mean, then the centred squares,
/// which loses nothing to cancellation), the output rounded once.
pub fn add_layernorm(
    p: &LayerNormParams,
    residual: &mut CpuBuffer,
    delta: Option<&CpuBuffer>,
    weight: &CpuBuffer,
    bias: &CpuBuffer,
    out: &mut CpuBuffer,
) -> Result<()> {
    p.validate(
        residual.data.len(),
        delta.map(|d| d.data.len()),
        weight.data.len(),
        bias.data.len(),
        out.data.len(),
    )?;
    let mut named = vec![
        ("residual", &*residual),
        ("weight", weight),
        ("bias", bias),
        ("out", &*out),
    ];
    if let Some(d) = delta {
        named.push(("delta", d));
    }
    check_dtypes("add_layernorm", p.dtype, &named)?;
    let (dt, h, n) = (p.dtype, p.hidden, p.rows * p.hidden);
    let (mut w, mut bf) = (vec![0f32; h], vec![0f32; h]);
    simd::widen(dt, &weight.data[..h], &mut w);
    simd::widen(dt, &bias.data[..h], &mut bf);
    let delta = delta.map(|d| &d.data[..n]);
    let (ress, outs) = (Rows::new(&mut residual.data[..n], h), Rows::new(&mut out.data[..n], h));
    pool::for_ranges(p.rows, |rs| {
        let (mut x, mut dx) = (vec![0f32; h], vec![0f32; h]);
        for r in rs {
            // SAFETY: the ranges are disjoint, so row r is this task's alone.
            let (res, o) = unsafe { (ress.row(r), outs.row(r)) };
            let (x, dx) = (&mut x, &mut dx);
            simd::widen(dt, res, x);
            if let Some(d) = delta {
                simd::widen(dt, &d[r * h..(r + 1) * h], dx);
                for ((xv, &dv), rv) in x.iter_mut().zip(dx.iter()).zip(res.iter_mut()) {
                    *rv = dt.from_f32(*xv + dv);
                    *xv = dt.to_f32(*rv);
                }
            }
            let mean = x.iter().sum::<f32>() / h as f32;
            for v in x.iter_mut() {
                *v -= mean;
            }
            let inv = 1.0 / (sum_squares(x) / h as f32 + p.eps).sqrt();
            for (((ov, &xv), &wv), &bv) in o.iter_mut().zip(x.iter()).zip(&w).zip(&bf) {
                *ov = dt.from_f32(xv * inv * wv + bv);
            }
        }
    });
    Ok(())
}

/// The activation in f32 (what the kernels compute; [`Activation::apply`] is the f64 reference).
fn act_f32(act: Activation, x: f32) -> f32 {
    match act {
        Activation::None => x,
        Activation::Relu => x.max(0.0),
        Activation::Silu => x / (1.0 + (-x).exp()),
        // f32 has no erf in std: the f64 one, rounded once (the CPU is not the fast path here).
        Activation::Gelu => Activation::Gelu.apply(x as f64) as f32,
        Activation::GeluTanh => {
            let c = (2.0 / std::f32::consts::PI).sqrt();
            // x·(1 + tanh u)/2 = x·σ(2u): the σ form keeps its digits in the negative tail,
            // where 1 + tanh u cancels.
            x / (1.0 + (-2.0 * c * (x + 0.044715 * x * x * x)).exp())
        }
    }
}

/// x[r][i] = act(x[r][i] + bias[i]) in place, rounded once.
pub fn bias_act(p: &BiasActParams, x: &mut CpuBuffer, bias: Option<&CpuBuffer>) -> Result<()> {
    p.validate(x.data.len(), bias.map(|b| b.data.len()))?;
    let mut named = vec![("x", &*x)];
    if let Some(b) = bias {
        named.push(("bias", b));
    }
    check_dtypes("bias_act", p.dtype, &named)?;
    let (dt, w, act) = (p.dtype, p.width, p.act);
    let mut bf = vec![0f32; w];
    if let Some(b) = bias {
        simd::widen(dt, &b.data[..w], &mut bf);
    }
    pool::for_row_blocks_mut(&mut x.data[..p.rows * w], w, |_, block| {
        let mut xf = vec![0f32; w];
        for row in block.chunks_exact_mut(w) {
            simd::widen(dt, row, &mut xf);
            for ((o, &v), &b) in row.iter_mut().zip(xf.iter()).zip(&bf) {
                *o = dt.from_f32(act_f32(act, v + b));
            }
        }
    });
    Ok(())
}

/// out[r][i] = act(gate[r][i]) · up[r][i]; SiLU is [`silu_mul`] itself.
pub fn glu(p: &GluParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
    let sm = SiluMulParams {
        rows: p.rows,
        inter: p.inter,
        dtype: p.dtype,
    };
    if p.act == Activation::Silu {
        return silu_mul(&sm, gate_up, out);
    }
    p.validate(gate_up.data.len(), out.data.len())?;
    check_dtypes("glu", p.dtype, &[("gate_up", gate_up), ("out", out)])?;
    let (dt, inter, act) = (p.dtype, p.inter, p.act);
    pool::for_row_blocks_mut(&mut out.data[..p.rows * inter], inter, |r0, block| {
        let (mut gf, mut uf) = (vec![0f32; inter], vec![0f32; inter]);
        for (r, o) in (r0..).zip(block.chunks_exact_mut(inter)) {
            let at = r * 2 * inter;
            simd::widen(dt, &gate_up.data[at..at + inter], &mut gf);
            simd::widen(dt, &gate_up.data[at + inter..at + 2 * inter], &mut uf);
            for ((ov, &g), &u) in o.iter_mut().zip(gf.iter()).zip(uf.iter()) {
                *ov = dt.from_f32(act_f32(act, g) * u);
            }
        }
    });
    Ok(())
}

/// out[t] += table[positions[t] + offset], the sum rounded once.
pub fn add_positions(p: &PositionParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
    p.validate(table.data.len(), out.data.len())?;
    check_dtypes("add_positions", p.dtype, &[("table", table), ("out", out)])?;
    let (dt, h) = (p.dtype, p.hidden);
    pool::for_row_blocks_mut(&mut out.data[..p.positions.len() * h], h, |t0, block| {
        for (t, o) in (t0..).zip(block.chunks_exact_mut(h)) {
            // Validated: 0 <= pos + offset < table_rows.
            let at = (p.positions[t] as usize + p.offset) * h;
            for (ov, &tv) in o.iter_mut().zip(&table.data[at..at + h]) {
                *ov = dt.from_f32(dt.to_f32(*ov) + dt.to_f32(tv));
            }
        }
    });
    Ok(())
}

/// Writes the new tokens' k and v at positions seq_len − new_len .. seq_len of each sequence.
pub fn kv_append(p: &KvAppendParams, k: &CpuBuffer, v: &CpuBuffer, kv: &mut PagedKv<CpuBuffer>) -> Result<()> {
    let layout = kv.layout;
    layout.validate()?;
    p.validate(&layout, k.data.len(), v.data.len(), (kv.k.data.len(), kv.v.data.len()))?;
    check_dtypes(
        "kv_append",
        layout.dtype,
        &[("k", k), ("v", v), ("K pool", &kv.k), ("V pool", &kv.v)],
    )?;
    let te = layout.token_elems();
    let mut row0 = 0;
    for (b, &n) in p.new_lens.iter().enumerate() {
        // Validated: 1 <= n <= seq_len(b), and the table holds pages for every position below
        // seq_len(b), so no write below can be refused half way.
        let n = n as usize;
        let table = p.tables.table(b);
        let start = p.tables.seq_len(b) - n;
        let span = row0 * te..(row0 + n) * te;
        write_tokens(&layout, &mut kv.k.data, &table, start, &k.data[span.clone()])?;
        write_tokens(&layout, &mut kv.v.data, &table, start, &v.data[span])?;
        row0 += n;
    }
    Ok(())
}

/// dst[i] = src[rows[i]].
pub fn gather_rows(p: &GatherParams, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
    p.validate(src.data.len(), dst.data.len())?;
    check_dtypes("gather_rows", p.dtype, &[("src", src), ("dst", dst)])?;
    let w = p.width;
    pool::for_row_blocks_mut(&mut dst.data[..p.rows.len() * w], w, |i0, block| {
        for (i, o) in (i0..).zip(block.chunks_exact_mut(w)) {
            // Validated: 0 <= r < src rows.
            let at = p.rows[i] as usize * w;
            o.copy_from_slice(&src.data[at..at + w]);
        }
    });
    Ok(())
}

/// buf[i] = random_value(seed, i, scale) in the buffer's dtype.
pub fn fill_random(buf: &mut CpuBuffer, seed: u64, scale: f32) -> Result<()> {
    if !scale.is_finite() {
        return Err(FdppError::InvalidArgument(format!(
            "fill_random: scale {scale} must be finite"
        )));
    }
    let dt = buf.dtype;
    buf.data.par_chunks_mut(FILL_CHUNK).enumerate().for_each(|(c, chunk)| {
        let base = (c * FILL_CHUNK) as u64;
        for (j, x) in chunk.iter_mut().enumerate() {
            *x = dt.from_f32(random_value(seed, base + j as u64, scale));
        }
    });
    Ok(())
}

/// w[n, k] = round(w[n, k] · scale[k]) (see [`crate::backend::Backend::scale_cols`]).
pub fn scale_cols(w: &mut CpuBuffer, scale: &CpuBuffer, rows: usize, cols: usize) -> Result<()> {
    if w.panels.is_some() {
        // Rows of W are interleaved in panels there; the engine folds norms before preparing.
        return Err(FdppError::InvalidArgument(
            "scale_cols: W is already prepared for the GEMMs (panels); scale it before".into(),
        ));
    }
    crate::backend::check_scale_cols((w.data.len(), w.dtype), (scale.data.len(), scale.dtype), rows, cols)?;
    let dt = w.dtype;
    let s: Vec<f32> = scale.data.iter().map(|&b| dt.to_f32(b)).collect();
    w.data.par_chunks_mut(cols).for_each(|row| {
        for (x, &g) in row.iter_mut().zip(&s) {
            *x = dt.from_f32(dt.to_f32(*x) * g);
        }
    });
    Ok(())
}

/// Elements per task of [`fill_random`].
const FILL_CHUNK: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::Portable;
    use crate::dtype::random_bits;

    /// The cache hands back the table of exactly these positions and frequencies (bit for
    /// bit), a new one when either changes, and its values are the per-call ones.
    #[test]
    fn rope_cache_follows_the_positions_and_frequencies() {
        let cache = RopeCache::default();
        let (f, g) = (vec![1.0f32, 0.01], vec![1.0f32, 0.02]);
        let a = cache.get(&[0, 1, 2], &f);
        assert!(std::sync::Arc::ptr_eq(&a, &cache.get(&[0, 1, 2], &f)));
        for (pos, fr) in [(&[0, 1, 3][..], &f), (&[0, 1][..], &f), (&[0, 1, 2][..], &g)] {
            let t = cache.get(pos, fr);
            assert!(!std::sync::Arc::ptr_eq(&a, &t) && t.is_for(pos, fr));
            let want = RopeTable::new(pos, fr);
            assert_eq!((t.cos.clone(), t.sin.clone()), (want.cos, want.sin));
        }
        assert_eq!(a.cos[2 * 2 + 1], (2.0f32 * 0.01).cos());
        // No RoPE (no pairs): still one row per token to iterate over.
        assert_eq!(RopeTable::new(&[5, 6], &[]).cos.len(), 2);
    }

    fn wide(dt: DType, b: &[u16]) -> Vec<f64> {
        b.iter().map(|&x| dt.to_f32(x) as f64).collect()
    }

    /// One rounding of the 16-bit type, relative, plus a little for the f32 arithmetic.
    fn close(dt: DType, got: u16, want: f64) -> bool {
        let ulp = match dt {
            DType::F16 => 1.0 / 1024.0,
            DType::Bf16 => 1.0 / 128.0,
        };
        (dt.to_f32(got) as f64 - want).abs() <= ulp * want.abs() + 1e-6
    }

    #[test]
    fn rms_row_matches_f64_at_odd_sizes_in_every_build() {
        for dt in [DType::F16, DType::Bf16] {
            for (i, h) in [1usize, 7, 8, 13, 64, 577].into_iter().enumerate() {
                let seed = 40 + i as u64;
                let res0 = random_bits(dt, h, 2.0, seed);
                let delta = random_bits(dt, h, 1.0, seed + 100);
                let wb = random_bits(dt, h, 1.5, seed + 200);
                let mut w = vec![0f32; h];
                dt.widen(&wb, &mut w);
                let eps = 1e-5;
                for with_delta in [false, true] {
                    // The stored residual: the sum rounded once (or the input as it was).
                    let stored: Vec<u16> = if with_delta {
                        res0.iter()
                            .zip(&delta)
                            .map(|(&a, &b)| dt.from_f32(dt.to_f32(a) + dt.to_f32(b)))
                            .collect()
                    } else {
                        res0.clone()
                    };
                    let x = wide(dt, &stored);
                    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps as f64).sqrt();
                    for portable in [false, true] {
                        let mut res = res0.clone();
                        let mut out = vec![dt.poison(); h];
                        let mut scratch = vec![f32::NAN; h];
                        let d = with_delta.then_some(delta.as_slice());
                        if portable {
                            rms_row_generic::<Portable>(dt, eps, &mut res, d, &w, &mut scratch, &mut out);
                        } else {
                            rms_row(dt, eps, &mut res, d, &w, &mut scratch, &mut out);
                        }
                        assert_eq!(res, stored, "{dt} h {h} residual");
                        for (j, &o) in out.iter().enumerate() {
                            let want = x[j] * inv * w[j] as f64;
                            assert!(
                                close(dt, o, want),
                                "{dt} h {h} delta {with_delta} portable {portable} [{j}]: {} vs {want}",
                                dt.to_f32(o)
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn silu_mul_run_matches_f64_at_odd_sizes_in_every_build() {
        for dt in [DType::F16, DType::Bf16] {
            for (i, n) in [1usize, 9, 16, 23, 1537].into_iter().enumerate() {
                let gb = random_bits(dt, n, 12.0, 70 + i as u64);
                let ub = random_bits(dt, n, 3.0, 80 + i as u64);
                let (mut g, mut u) = (vec![0f32; n], vec![0f32; n]);
                dt.widen(&gb, &mut g);
                dt.widen(&ub, &mut u);
                for portable in [false, true] {
                    let mut out = vec![dt.poison(); n];
                    if portable {
                        silu_mul_run_generic::<Portable>(dt, &g, &u, &mut out);
                    } else {
                        silu_mul_run(dt, &g, &u, &mut out);
                    }
                    for (j, &o) in out.iter().enumerate() {
                        let (gv, uv) = (g[j] as f64, u[j] as f64);
                        let want = gv / (1.0 + (-gv).exp()) * uv;
                        assert!(
                            close(dt, o, want),
                            "{dt} n {n} portable {portable} [{j}]: {} vs {want}",
                            dt.to_f32(o)
                        );
                    }
                }
            }
        }
    }
}
