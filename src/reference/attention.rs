//! Reference attention in f64 with the exact two-pass softmax: pass one takes every score
//! x = q·k/√d and their maximum m, pass two sums e^(x−m) and e^(x−m)·v. No running maximum, no
//! splits, no unified φ: nothing the kernels do to go fast is repeated here, so the oracle cannot
//! share their mistakes. Inputs are widened exactly (f16/bf16 → f64), the keys and values of each
//! (sequence, kv head) once for all the rows and heads that read them.
//!
//! The prefill oracle reads the new tokens' K and V from the k/v inputs, not from the pools the
//! kernel writes, and the cached prefix from the pools as they were before the step.

use rayon::prelude::*;

use crate::dtype::DType;
use crate::kv::paged::{read_token, PagedKvLayout};
use crate::ops::attention::{DecodeParams, PrefillParams};

/// out = softmax(q·Kᵀ/√d) · V over `n` keys, in f64; `key(t)` and `val(t)` give token t's rows.
fn attend<'a>(
    q: &[f64],
    n: usize,
    scale: f64,
    key: impl Fn(usize) -> &'a [f64],
    val: impl Fn(usize) -> &'a [f64],
    out: &mut [f64],
) {
    let scores: Vec<f64> = (0..n)
        .map(|t| q.iter().zip(key(t)).map(|(a, b)| a * b).sum::<f64>() * scale)
        .collect();
    let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    out.fill(0.0);
    let mut l = 0f64;
    for (t, &x) in scores.iter().enumerate() {
        let p = (x - m).exp();
        l += p;
        for (o, &v) in out.iter_mut().zip(val(t)) {
            *o += p * v;
        }
    }
    for o in out.iter_mut() {
        *o /= l;
    }
}

/// `n` rows of `d` elements widened exactly to f64, [n][d]; a row `row(t)` does not give (a
/// token the table does not hold) reads as zeros.
fn widen<'a>(dt: DType, n: usize, d: usize, row: impl Fn(usize) -> Option<&'a [u16]> + Sync) -> Vec<f64> {
    let mut w = vec![0f64; n * d];
    w.par_chunks_mut(d).enumerate().for_each(|(t, o)| {
        if let Some(r) = row(t) {
            for (o, &x) in o.iter_mut().zip(r) {
                *o = dt.to_f32(x) as f64;
            }
        }
    });
    w
}

/// The f64 rows of one (sequence, kv head)'s keys and values, widened once for every query row
/// and head of its group that reads them.
struct KvRows {
    k: Vec<f64>,
    v: Vec<f64>,
    d: usize,
}

impl KvRows {
    /// `n` tokens' rows; `row(pool, t)` gives token t's row of the K or V source (None: zeros).
    fn widen<'a, P: Copy + Sync>(
        dt: DType,
        n: usize,
        d: usize,
        pools: (P, P),
        row: impl Fn(P, usize) -> Option<&'a [u16]> + Sync,
    ) -> Self {
        KvRows {
            k: widen(dt, n, d, |t| row(pools.0, t)),
            v: widen(dt, n, d, |t| row(pools.1, t)),
            d,
        }
    }
    fn key(&self, t: usize) -> &[f64] {
        &self.k[t * self.d..(t + 1) * self.d]
    }
    fn val(&self, t: usize) -> &[f64] {
        &self.v[t * self.d..(t + 1) * self.d]
    }
}

/// Query row `row` of `q` (`d` elements each), widened.
fn q_row(dt: DType, q: &[u16], row: usize, d: usize) -> Vec<f64> {
    q[row * d..(row + 1) * d].iter().map(|&x| dt.to_f32(x) as f64).collect()
}

/// Decode reference, `[batch][num_heads][head_dim]`. Panics if the buffers are shorter than the
/// validated params say: callers validate first.
pub fn decode_ref(p: &DecodeParams, layout: &PagedKvLayout, q: &[u16], k_pool: &[u16], v_pool: &[u16]) -> Vec<f64> {
    let g = p.geom;
    let (h, d, dt) = (g.num_heads, g.head_dim, p.dtype);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; p.batch() * h * d];
    // A group's heads are adjacent in a sequence's row: chunk i is (sequence, kv head) i.
    out.par_chunks_mut(g.group() * d).enumerate().for_each(|(i, o)| {
        let (b, kvh) = (i / g.num_kv_heads, i % g.num_kv_heads);
        let table = p.tables.table(b);
        let n = p.tables.seq_len(b);
        let kv = KvRows::widen(dt, n, d, (k_pool, v_pool), |pool, t| {
            read_token(layout, pool, &table, t, kvh)
        });
        o.par_chunks_mut(d).enumerate().for_each(|(j, o)| {
            let qf = q_row(dt, q, b * h + kvh * g.group() + j, d);
            attend(&qf, n, scale, |t| kv.key(t), |t| kv.val(t), o);
        });
    });
    out
}

/// Prefill reference, `[tokens][num_heads][head_dim]`: new token i of sequence b (position
/// prefix + i) attends to positions 0..=prefix + i.
pub fn prefill_ref<'a>(
    p: &PrefillParams,
    layout: &PagedKvLayout,
    qkv_new: (&'a [u16], &'a [u16], &'a [u16]),
    k_pool_before: &'a [u16],
    v_pool_before: &'a [u16],
) -> Vec<f64> {
    let (q, k_new, v_new) = qkv_new;
    let g = p.geom;
    let (h, d, dt) = (g.num_heads, g.head_dim, p.dtype);
    let kvd = g.num_kv_heads * d;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; p.tokens() * h * d];
    for (b, &(row0, prefix, n)) in p.spans().iter().enumerate() {
        let table = p.tables.table(b);
        for kvh in 0..g.num_kv_heads {
            // Position t: the cached prefix from the pools as they were, the new tokens from k/v.
            let kv = KvRows::widen(
                dt,
                prefix + n,
                d,
                ((k_pool_before, k_new), (v_pool_before, v_new)),
                |(pool, new): (&'a [u16], &'a [u16]), t| {
                    if t < prefix {
                        read_token(layout, pool, &table, t, kvh)
                    } else {
                        let r = row0 + t - prefix;
                        Some(&new[r * kvd + kvh * d..r * kvd + (kvh + 1) * d])
                    }
                },
            );
            // This group's heads of each new token (adjacent in the token's row), each attending
            // to the token's causal prefix.
            let heads = kvh * g.group()..(kvh + 1) * g.group();
            out[row0 * h * d..(row0 + n) * h * d]
                .par_chunks_mut(h * d)
                .enumerate()
                .for_each(|(i, o)| {
                    let tok = row0 + i;
                    for (j, o) in o[heads.start * d..heads.end * d].chunks_mut(d).enumerate() {
                        let qf = q_row(dt, q, tok * h + heads.start + j, d);
                        attend(&qf, prefix + i + 1, scale, |t| kv.key(t), |t| kv.val(t), o);
                    }
                });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_keys_by_hand() {
        // q = (1, 0, ...), keys k0 = (0, ...), k1 = (√d · ln 3, 0, ...): scores 0 and ln 3, so
        // the weights are 1/4 and 3/4.
        let dt = DType::F16;
        let d = 4;
        let scale = 1.0 / (d as f64).sqrt();
        let q = [1.0, 0.0, 0.0, 0.0];
        let enc = |v: &[f32]| v.iter().map(|&x| dt.from_f32(x)).collect::<Vec<u16>>();
        let ln3 = (3f64.ln() / scale) as f32;
        let k = [enc(&[0.0; 4]), enc(&[ln3, 0.0, 0.0, 0.0])];
        let v = [enc(&[4.0, 8.0, -4.0, 0.0]), enc(&[0.0, 4.0, 8.0, 1.0])];
        let wide = |r: &[u16]| r.iter().map(|&x| dt.to_f32(x) as f64).collect::<Vec<f64>>();
        let (kf, vf): (Vec<_>, Vec<_>) = (k.iter().map(|r| wide(r)).collect(), v.iter().map(|r| wide(r)).collect());
        let mut out = [0f64; 4];
        attend(&q, 2, scale, |t| &kf[t], |t| &vf[t], &mut out);
        // e^(x1) is 3 up to the f16 rounding of ln3·√d.
        let w1 = ((dt.to_f32(k[1][0]) as f64) * scale).exp();
        let (p0, p1) = (1.0 / (1.0 + w1), w1 / (1.0 + w1));
        for (i, want) in [4.0 * p0, 8.0 * p0 + 4.0 * p1, -4.0 * p0 + 8.0 * p1, p1]
            .iter()
            .enumerate()
        {
            assert!((out[i] - want).abs() < 1e-12, "out[{i}] = {} vs {want}", out[i]);
        }
        assert!((p1 - 0.75).abs() < 1e-3);
    }
}
