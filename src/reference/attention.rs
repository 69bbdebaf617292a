//! Reference attention in f64 with the exact two-pass softmax: pass one takes every score
//! x = q·k/√d and their maximum m, pass two sums e^(x−m) and e^(x−m)·v. No running maximum, no
//! splits, no unified φ: nothing the kernels do to go fast is repeated here, so the oracle cannot
//! share their mistakes. Inputs are widened exactly (f16/bf16 → f64).
//!
//! The prefill oracle reads the new tokens' K and V from the k/v inputs, not from the pools the
//! kernel writes, and the cached prefix from the pools as they were before the step.

use rayon::prelude::*;

use crate::dtype::DType;
use crate::kv::paged::{read_token, PagedKvLayout};
use crate::ops::attention::{DecodeParams, PrefillParams};

/// out = softmax(q·Kᵀ/√d) · V over `n` keys, in f64; `key(t)` and `val(t)` give token t's rows.
fn attend<'a>(
    dt: DType,
    q: &[f64],
    n: usize,
    scale: f64,
    key: impl Fn(usize) -> &'a [u16],
    val: impl Fn(usize) -> &'a [u16],
    out: &mut [f64],
) {
    let scores: Vec<f64> = (0..n)
        .map(|t| q.iter().zip(key(t)).map(|(a, &b)| a * dt.to_f32(b) as f64).sum::<f64>() * scale)
        .collect();
    let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    out.fill(0.0);
    let mut l = 0f64;
    for (t, &x) in scores.iter().enumerate() {
        let p = (x - m).exp();
        l += p;
        for (o, &v) in out.iter_mut().zip(val(t)) {
            *o += p * dt.to_f32(v) as f64;
        }
    }
    for o in out.iter_mut() {
        *o /= l;
    }
}

/// Decode reference, `[batch][num_heads][head_dim]`. Panics if the buffers are shorter than the
/// validated params say: callers validate first.
pub fn decode_ref(p: &DecodeParams, layout: &PagedKvLayout, q: &[u16], k_pool: &[u16], v_pool: &[u16]) -> Vec<f64> {
    let g = p.geom;
    let (h, d, dt) = (g.num_heads, g.head_dim, p.dtype);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; p.batch() * h * d];
    out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
        let (b, head) = (row / h, row % h);
        let kvh = head / g.group();
        let table = p.tables.table(b);
        let qf: Vec<f64> = q[row * d..(row + 1) * d].iter().map(|&x| dt.to_f32(x) as f64).collect();
        let tok = |pool, t| read_token(layout, pool, &table, t, kvh).unwrap_or(&[]);
        let keys: Vec<&[u16]> = (0..p.tables.seq_len(b)).map(|t| tok(k_pool, t)).collect();
        let vals: Vec<&[u16]> = (0..p.tables.seq_len(b)).map(|t| tok(v_pool, t)).collect();
        attend(dt, &qf, keys.len(), scale, |t| keys[t], |t| vals[t], o);
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
    let spans = p.spans();
    // Sequence of each new-token row.
    let seq_of: Vec<usize> = spans
        .iter()
        .enumerate()
        .flat_map(|(b, &(_, _, n))| std::iter::repeat_n(b, n))
        .collect();
    let mut out = vec![0f64; p.tokens() * h * d];
    out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
        let (tok, head) = (row / h, row % h);
        let b = seq_of[tok];
        let (row0, prefix, _) = spans[b];
        let pos = prefix + (tok - row0);
        let kvh = head / g.group();
        let table = p.tables.table(b);
        // Borrowed rows, not copies: a 16384-token prompt's rows attend to 8k keys on average.
        let pick = |pool: &'a [u16], new: &'a [u16], t: usize| -> &'a [u16] {
            if t < prefix {
                read_token(layout, pool, &table, t, kvh).unwrap_or(&[])
            } else {
                let r = row0 + t - prefix;
                &new[r * kvd + kvh * d..r * kvd + (kvh + 1) * d]
            }
        };
        let keys: Vec<&[u16]> = (0..=pos).map(|t| pick(k_pool_before, k_new, t)).collect();
        let vals: Vec<&[u16]> = (0..=pos).map(|t| pick(v_pool_before, v_new, t)).collect();
        let qf: Vec<f64> = q[row * d..(row + 1) * d].iter().map(|&x| dt.to_f32(x) as f64).collect();
        attend(dt, &qf, keys.len(), scale, |t| keys[t], |t| vals[t], o);
    });
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
        let mut out = [0f64; 4];
        attend(dt, &q, 2, scale, |t| &k[t], |t| &v[t], &mut out);
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
