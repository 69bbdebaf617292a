//! Reference versions of the small layer ops ([`crate::ops::layer`]): one element at a time, in
//! f64, written straight from the definitions (HF transformers' Llama, OPT and ChatGLM2), with
//! none of the kernels' row blocking or vector tricks.
//!
//! The arithmetic ops return f64 outputs (judged by NMSE); the data-movement ops and
//! `fill_random` return the exact bit patterns the kernels must produce. Every function panics
//! on buffers shorter than the validated params say: callers validate first.

use half::{bf16, f16};

use crate::dtype::DType;
use crate::kv::paged::PagedKvLayout;
use crate::ops::layer::{
    erf, random_value, Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams,
    LayerNormParams, PositionParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};

fn wide(dt: DType, bits: u16) -> f64 {
    dt.to_f32(bits) as f64
}

/// The 16-bit value nearest to `v` (ties to even), rounded once from f64.
pub fn round_f64(dt: DType, v: f64) -> u16 {
    match dt {
        DType::F16 => f16::from_f64(v).to_bits(),
        DType::Bf16 => bf16::from_f64(v).to_bits(),
    }
}

/// out = table[ids], as bits.
pub fn embedding_ref(p: &EmbeddingParams, table: &[u16]) -> Vec<u16> {
    let (first, rows) = p.held.unwrap_or((0, p.vocab));
    let mut out = Vec::with_capacity(p.ids.len() * p.hidden);
    for &id in &p.ids {
        let id = id as usize;
        if (first..first + rows).contains(&id) {
            out.extend_from_slice(&table[(id - first) * p.hidden..(id - first + 1) * p.hidden]);
        } else {
            // Another rank's row: zeros (+0.0 in both 16-bit types).
            out.extend(std::iter::repeat_n(0u16, p.hidden));
        }
    }
    out
}

/// dst = src[rows], as bits.
pub fn gather_rows_ref(p: &GatherParams, src: &[u16]) -> Vec<u16> {
    let mut out = Vec::with_capacity(p.rows.len() * p.width);
    for &r in &p.rows {
        for i in 0..p.width {
            out.push(src[r as usize * p.width + i]);
        }
    }
    out
}

/// `len` elements of [`random_value`]`(seed, i, scale)`, rounded to `dt`.
pub fn fill_random_ref(dt: DType, len: usize, seed: u64, scale: f32) -> Vec<u16> {
    (0..len as u64)
        .map(|i| dt.from_f32(random_value(seed, i, scale)))
        .collect()
}

/// (residual after the add, as bits; the normalised output, in f64), both `[rows][hidden]`.
///
/// The residual is the exact sum rounded once to the dtype (it is stored in the dtype); the
/// norm reads that stored value: mean of squares, 1/√(mean + eps), times the weight, in f64.
pub fn add_rmsnorm_ref(
    p: &RmsNormParams,
    residual: &[u16],
    delta: Option<&[u16]>,
    weight: &[u16],
) -> (Vec<u16>, Vec<f64>) {
    let (dt, h) = (p.dtype, p.hidden);
    let n = p.rows * h;
    let res: Vec<u16> = match delta {
        Some(d) => (0..n)
            .map(|i| round_f64(dt, wide(dt, residual[i]) + wide(dt, d[i])))
            .collect(),
        None => residual[..n].to_vec(),
    };
    let mut out = vec![0f64; n];
    for r in 0..p.rows {
        let x: Vec<f64> = res[r * h..(r + 1) * h].iter().map(|&b| wide(dt, b)).collect();
        let mean_sq = x.iter().map(|v| v * v).sum::<f64>() / h as f64;
        let inv = 1.0 / (mean_sq + p.eps as f64).sqrt();
        for i in 0..h {
            out[r * h + i] = x[i] * inv * wide(dt, weight[i]);
        }
    }
    (res, out)
}

/// (q, k, v) in f64: `[tokens][H·D]`, `[tokens][G·D]`, `[tokens][G·D]`.
///
/// Each row of the fused output plus the bias; the first R = rotary_dim elements of every q and
/// k head rotated pair by pair by θ = position · inv_freq[i], taken in f64 (pair i is (i, i + R/2)
/// in the rotate-half layout, (2i, 2i + 1) in the interleaved one); elements R.. and the v heads
/// pass through.
pub fn qkv_rope_ref(p: &RopeParams, qkv: &[u16], bias: Option<&[u16]>) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let g = p.geom;
    let (dt, d, r) = (p.dtype, g.head_dim, p.rotary_dim());
    let width = p.qkv_width();
    let (hq, hk) = (g.num_heads, g.num_kv_heads);
    let mut q = Vec::with_capacity(p.tokens() * hq * d);
    let mut k = Vec::with_capacity(p.tokens() * hk * d);
    let mut v = Vec::with_capacity(p.tokens() * hk * d);
    for (t, &pos) in p.positions.iter().enumerate() {
        let x: Vec<f64> = (0..width)
            .map(|j| wide(dt, qkv[t * width + j]) + bias.map_or(0.0, |b| wide(dt, b[j])))
            .collect();
        for head in 0..hq + 2 * hk {
            let xh = &x[head * d..(head + 1) * d];
            if head >= hq + hk {
                v.extend_from_slice(xh);
                continue;
            }
            let mut rotated = xh.to_vec();
            for i in 0..r / 2 {
                let theta = pos as f64 * p.inv_freq[i] as f64;
                let (a, b) = match p.layout {
                    RopeLayout::Half => (i, i + r / 2),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x1, x2) = (xh[a], xh[b]);
                rotated[a] = x1 * theta.cos() - x2 * theta.sin();
                rotated[b] = x2 * theta.cos() + x1 * theta.sin();
            }
            if head < hq {
                q.extend(rotated);
            } else {
                k.extend(rotated);
            }
        }
    }
    (q, k, v)
}

/// out[r][i] = silu(gate) · up = gate / (1 + e^−gate) · up, in f64.
pub fn silu_mul_ref(p: &SiluMulParams, gate_up: &[u16]) -> Vec<f64> {
    let (dt, inter) = (p.dtype, p.inter);
    let mut out = Vec::with_capacity(p.rows * inter);
    for r in 0..p.rows {
        for i in 0..inter {
            let g = wide(dt, gate_up[r * 2 * inter + i]);
            let u = wide(dt, gate_up[r * 2 * inter + inter + i]);
            out.push(g / (1.0 + (-g).exp()) * u);
        }
    }
    out
}

/// (residual after the add, as bits; the normalised output, in f64), both `[rows][hidden]`.
///
/// As [`add_rmsnorm_ref`] for the residual; the norm is torch's LayerNorm over the stored
/// values: mean, the biased variance (divided by `hidden`), (x − mean) / √(var + eps) · weight +
/// bias, in f64 with two passes over the row.
pub fn add_layernorm_ref(
    p: &LayerNormParams,
    residual: &[u16],
    delta: Option<&[u16]>,
    weight: &[u16],
    bias: &[u16],
) -> (Vec<u16>, Vec<f64>) {
    let (dt, h) = (p.dtype, p.hidden);
    let n = p.rows * h;
    let res: Vec<u16> = match delta {
        Some(d) => (0..n)
            .map(|i| round_f64(dt, wide(dt, residual[i]) + wide(dt, d[i])))
            .collect(),
        None => residual[..n].to_vec(),
    };
    let mut out = vec![0f64; n];
    for r in 0..p.rows {
        let x: Vec<f64> = res[r * h..(r + 1) * h].iter().map(|&b| wide(dt, b)).collect();
        let mean = x.iter().sum::<f64>() / h as f64;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / h as f64;
        let inv = 1.0 / (var + p.eps as f64).sqrt();
        for i in 0..h {
            out[r * h + i] = (x[i] - mean) * inv * wide(dt, weight[i]) + wide(dt, bias[i]);
        }
    }
    (res, out)
}

/// The activation in f64, written so that it keeps its relative accuracy everywhere the
/// kernels are judged. [`Activation::apply`] takes GELU as x·(1 + erf)/2 and its tanh form as
/// x·(1 + tanh u)/2: in the negative tail 1 + erf and 1 + tanh cancel, and past x ≈ −6 they keep
/// only a few digits even in f64 (1 + tanh u is 7e-16 at x = −7), less than a 16-bit result
/// needs. Here GELU is x·erfc(−x/√2)/2 and the tanh form x·σ(2u) = x / (1 + e^(−2u)).
pub fn act_ref(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Gelu if x < 0.0 => 0.5 * x * erfc_pos(-x / std::f64::consts::SQRT_2),
        Activation::GeluTanh => {
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            x / (1.0 + (-2.0 * u).exp())
        }
        _ => act.apply(x),
    }
}

/// erfc(a) for a ≥ 0 to about 1e-14 relative: 1 − erf(a) where erfc is at least 4e-4, the
/// continued fraction erfc(a) = e^(−a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + …)))) beyond.
fn erfc_pos(a: f64) -> f64 {
    if a < 2.5 {
        return 1.0 - erf(a);
    }
    let mut f = 0.0;
    for k in (1..200).rev() {
        f = (k as f64 / 2.0) / (a + f);
    }
    (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f)
}

/// x[r][i] = act(x[r][i] + bias[i]), in f64.
pub fn bias_act_ref(p: &BiasActParams, x: &[u16], bias: Option<&[u16]>) -> Vec<f64> {
    let (dt, w) = (p.dtype, p.width);
    (0..p.rows * w)
        .map(|j| act_ref(p.act, wide(dt, x[j]) + bias.map_or(0.0, |b| wide(dt, b[j % w]))))
        .collect()
}

/// out[r][i] = act(gate[r][i]) · up[r][i] over `[rows][2·inter]` (gate first), in f64.
pub fn glu_ref(p: &GluParams, gate_up: &[u16]) -> Vec<f64> {
    let (dt, inter) = (p.dtype, p.inter);
    let mut out = Vec::with_capacity(p.rows * inter);
    for r in 0..p.rows {
        for i in 0..inter {
            let g = wide(dt, gate_up[r * 2 * inter + i]);
            let u = wide(dt, gate_up[r * 2 * inter + inter + i]);
            out.push(act_ref(p.act, g) * u);
        }
    }
    out
}

/// out[t] + table[positions[t] + offset], the exact sum rounded once to the dtype, as bits
/// (out is stored in the dtype, like the residual of [`add_rmsnorm_ref`]).
pub fn add_positions_ref(p: &PositionParams, table: &[u16], out: &[u16]) -> Vec<u16> {
    let (dt, h) = (p.dtype, p.hidden);
    let mut y = Vec::with_capacity(p.positions.len() * h);
    for (t, &pos) in p.positions.iter().enumerate() {
        let row = pos as usize + p.offset;
        for i in 0..h {
            y.push(round_f64(dt, wide(dt, out[t * h + i]) + wide(dt, table[row * h + i])));
        }
    }
    y
}

/// The pools after the append: new token j of sequence b (position seq_len − new_len + j)
/// copied element by element to (page of the position, slot, kv head); everything else as it
/// was. Returns (K pool, V pool).
pub fn kv_append_ref(
    p: &KvAppendParams,
    layout: &PagedKvLayout,
    k: &[u16],
    v: &[u16],
    k_pool: &[u16],
    v_pool: &[u16],
) -> (Vec<u16>, Vec<u16>) {
    let (mut kp, mut vp) = (k_pool.to_vec(), v_pool.to_vec());
    let (hk, d) = (layout.num_kv_heads, layout.head_dim);
    let mut row = 0;
    for (b, &n) in p.new_lens.iter().enumerate() {
        let len = p.tables.seq_lens[b] as usize;
        for pos in len - n as usize..len {
            let page = p.tables.block_table[b * p.tables.max_pages + pos / layout.page_size] as usize;
            let slot = pos % layout.page_size;
            for head in 0..hk {
                for i in 0..d {
                    let dst = ((page * layout.page_size + slot) * hk + head) * d + i;
                    let src = (row * hk + head) * d + i;
                    kp[dst] = k[src];
                    vp[dst] = v[src];
                }
            }
            row += 1;
        }
    }
    (kp, vp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::AttnGeometry;

    fn enc(dt: DType, v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| dt.from_f32(x)).collect()
    }

    #[test]
    fn rmsnorm_of_a_hand_computed_row() {
        // x = (1, 2) + (2, 2) = (3, 4): mean square 12.5, so out = x / √12.5 · w.
        let dt = DType::F16;
        let p = RmsNormParams {
            rows: 1,
            hidden: 2,
            eps: 1e-6,
            dtype: dt,
        };
        let (res, out) = add_rmsnorm_ref(
            &p,
            &enc(dt, &[1.0, 2.0]),
            Some(&enc(dt, &[2.0, 2.0])),
            &enc(dt, &[1.0, 0.5]),
        );
        assert_eq!(res, enc(dt, &[3.0, 4.0]));
        let s = (12.5f64 + 1e-6f32 as f64).sqrt();
        assert!(
            (out[0] - 3.0 / s).abs() < 1e-12 && (out[1] - 2.0 / s).abs() < 1e-12,
            "{out:?}"
        );
    }

    #[test]
    fn rope_rotates_q_and_k_by_the_position_angle_and_copies_v() {
        let dt = DType::Bf16;
        let geom = AttnGeometry::new(1, 1, 64).expect("geom");
        let mut inv_freq = vec![0f32; 32];
        inv_freq[0] = 0.5;
        let p = RopeParams {
            geom,
            dtype: dt,
            positions: vec![3],
            inv_freq,
            layout: RopeLayout::Half,
        };
        // Row: q = e_0, k = e_32 (the partner of element 0), v = 2 · e_5.
        let mut row = vec![0f32; 3 * 64];
        row[0] = 1.0;
        row[64 + 32] = 1.0;
        row[128 + 5] = 2.0;
        let bias: Vec<f32> = (0..3 * 64).map(|i| if i == 128 + 5 { -0.5 } else { 0.0 }).collect();
        let (q, k, v) = qkv_rope_ref(&p, &enc(dt, &row), Some(&enc(dt, &bias)));
        let th = 1.5f64;
        // q: (x1, x2) = (1, 0) → (cos, sin); k: (0, 1) → (−sin, cos).
        assert!((q[0] - th.cos()).abs() < 1e-15 && (q[32] - th.sin()).abs() < 1e-15);
        assert!((k[0] + th.sin()).abs() < 1e-15 && (k[32] - th.cos()).abs() < 1e-15);
        // Pairs with inv_freq 0 do not move.
        assert!(q[1..32].iter().chain(&q[33..]).all(|&x| x == 0.0));
        assert_eq!(v[5], 1.5);
        assert_eq!(v.iter().filter(|&&x| x != 0.0).count(), 1);
    }

    fn rope8(layout: RopeLayout, inv_freq: Vec<f32>) -> RopeParams {
        RopeParams {
            // head_dim 8 is below what attention supports; the reference does not mind.
            geom: AttnGeometry {
                num_heads: 1,
                num_kv_heads: 1,
                head_dim: 8,
            },
            dtype: DType::F16,
            positions: vec![2],
            inv_freq,
            layout,
        }
    }

    #[test]
    fn partial_rope_rotates_only_the_first_rotary_dim_elements_in_either_layout() {
        let dt = DType::F16;
        // q = e_0 + 5·e_5, k = e_1, v = e_7; rotary_dim 4 (two pairs), pair 0 at θ = 2 · 0.25,
        // pair 1 at θ = 0.
        let mut row = vec![0f32; 3 * 8];
        row[0] = 1.0;
        row[5] = 5.0;
        row[8 + 1] = 1.0;
        row[16 + 7] = 1.0;
        let x = enc(dt, &row);
        let (c, s) = (0.5f64.cos(), 0.5f64.sin());
        let near = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-15);

        // Half: pair 0 is (0, 2), pair 1 is (1, 3); elements 4.. pass through.
        let (q, k, v) = qkv_rope_ref(&rope8(RopeLayout::Half, vec![0.25, 0.0]), &x, None);
        assert!(near(&q, &[c, 0.0, s, 0.0, 0.0, 5.0, 0.0, 0.0]), "{q:?}");
        assert!(near(&k, &[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), "{k:?}");
        assert_eq!(v, vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);

        // Interleaved: pair 0 is (0, 1), pair 1 is (2, 3): k's e_1 is pair 0's second element,
        // so it goes to (−sin, cos).
        let (q, k, _) = qkv_rope_ref(&rope8(RopeLayout::Interleaved, vec![0.25, 0.0]), &x, None);
        assert!(near(&q, &[c, s, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0]), "{q:?}");
        assert!(near(&k, &[-s, c, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), "{k:?}");

        // Pair 1 of the interleaved layout uses inv_freq[1], not inv_freq[2]: e_2 at θ = 2 · 0.5.
        let mut r2 = vec![0f32; 3 * 8];
        r2[2] = 1.0;
        let (q, _, _) = qkv_rope_ref(&rope8(RopeLayout::Interleaved, vec![0.0, 0.5]), &enc(dt, &r2), None);
        assert!(
            near(&q, &[0.0, 0.0, 1f64.cos(), 1f64.sin(), 0.0, 0.0, 0.0, 0.0]),
            "{q:?}"
        );

        // rotary_dim 0 (OPT): the split and the bias, nothing rotated.
        let bias: Vec<f32> = (0..24).map(|i| if i == 3 { 0.5 } else { 0.0 }).collect();
        let (q, k, v) = qkv_rope_ref(&rope8(RopeLayout::Half, vec![]), &x, Some(&enc(dt, &bias)));
        assert_eq!(q, vec![1.0, 0.0, 0.0, 0.5, 0.0, 5.0, 0.0, 0.0]);
        assert_eq!(k[1], 1.0);
        assert_eq!(v[7], 1.0);
    }

    #[test]
    fn layernorm_of_a_hand_computed_row() {
        // x = (0, 1, 4) + (1, 1, 2) = (1, 2, 6): mean 3, deviations (−2, −1, 3), variance 14/3.
        let dt = DType::Bf16;
        let p = LayerNormParams {
            rows: 1,
            hidden: 3,
            eps: 1e-5,
            dtype: dt,
        };
        let (res, out) = add_layernorm_ref(
            &p,
            &enc(dt, &[0.0, 1.0, 4.0]),
            Some(&enc(dt, &[1.0, 1.0, 2.0])),
            &enc(dt, &[1.0, 2.0, 0.5]),
            &enc(dt, &[0.5, -1.0, 0.0]),
        );
        assert_eq!(res, enc(dt, &[1.0, 2.0, 6.0]));
        let inv = 1.0 / (14.0f64 / 3.0 + 1e-5f32 as f64).sqrt();
        let want = [-2.0 * inv + 0.5, -2.0 * inv - 1.0, 1.5 * inv];
        assert!(out.iter().zip(want).all(|(o, w)| (o - w).abs() < 1e-12), "{out:?}");
        // Without a delta the residual is read as it is.
        let (res, _) = add_layernorm_ref(
            &p,
            &enc(dt, &[1.0, 2.0, 6.0]),
            None,
            &enc(dt, &[1.0; 3]),
            &enc(dt, &[0.0; 3]),
        );
        assert_eq!(res, enc(dt, &[1.0, 2.0, 6.0]));
    }

    #[test]
    fn bias_act_adds_the_bias_per_column_then_applies_the_activation() {
        let dt = DType::F16;
        let x = enc(dt, &[-1.0, 0.5, 2.0, -3.0]);
        let bias = enc(dt, &[0.5, -1.0]);
        let p = |act| BiasActParams {
            rows: 2,
            width: 2,
            act,
            dtype: dt,
        };
        // x + bias = (−0.5, −0.5, 2.5, −4).
        assert_eq!(
            bias_act_ref(&p(Activation::None), &x, Some(&bias)),
            vec![-0.5, -0.5, 2.5, -4.0]
        );
        assert_eq!(
            bias_act_ref(&p(Activation::Relu), &x, Some(&bias)),
            vec![0.0, 0.0, 2.5, 0.0]
        );
        // torch.nn.functional.gelu(2.5) and gelu(−0.5).
        let g = bias_act_ref(&p(Activation::Gelu), &x, Some(&bias));
        assert!((g[2] - 2.484_475_836_685_56).abs() < 1e-9, "{g:?}");
        assert!((g[0] + 0.154_268_769_362_99).abs() < 1e-9, "{g:?}");
        // gelu(−0.5, approximate='tanh').
        let t = bias_act_ref(&p(Activation::GeluTanh), &x, Some(&bias));
        assert!((t[1] + 0.154_285_990_174_86).abs() < 1e-9, "{t:?}");
        assert_eq!(bias_act_ref(&p(Activation::Relu), &x, None), vec![0.0, 0.5, 2.0, 0.0]);
    }

    #[test]
    fn activations_keep_their_relative_accuracy_in_the_negative_tail() {
        // mpmath at 40 digits: 0.5·x·(1 + tanh u) and 0.5·x·erfc(−x/√2).
        for (x, tanh_form, erf_form) in [
            (-7.0, -2.315_442_262_072_549e-15, -8.958_687_807_200_845e-12),
            (-5.5, -5.927_640_263_880_262e-9, -1.044_425_935_623_824_6e-7),
            (-3.0, -3.637_392_081_773_019e-3, -4.049_694_094_890_283_6e-3),
        ] {
            let t = act_ref(Activation::GeluTanh, x);
            let g = act_ref(Activation::Gelu, x);
            assert!(((t - tanh_form) / tanh_form).abs() < 1e-12, "gelu_tanh({x}) = {t}");
            assert!(((g - erf_form) / erf_form).abs() < 1e-12, "gelu({x}) = {g}");
        }
        // Elsewhere the same as the contract's definition.
        for x in [-2.0, -0.3, 0.0, 0.7, 4.0] {
            for act in [
                Activation::Gelu,
                Activation::GeluTanh,
                Activation::Silu,
                Activation::Relu,
            ] {
                assert!((act_ref(act, x) - act.apply(x)).abs() < 1e-14, "{act:?}({x})");
            }
        }
    }

    #[test]
    fn glu_multiplies_the_activated_gate_by_up() {
        let dt = DType::F16;
        // gate (0, 1, −2), up (3, 2, 0.5).
        let gu = enc(dt, &[0.0, 1.0, -2.0, 3.0, 2.0, 0.5]);
        let p = |act| GluParams {
            rows: 1,
            inter: 3,
            act,
            dtype: dt,
        };
        assert_eq!(glu_ref(&p(Activation::Relu), &gu), vec![0.0, 2.0, 0.0]);
        assert_eq!(glu_ref(&p(Activation::None), &gu), vec![0.0, 2.0, -1.0]);
        let t = glu_ref(&p(Activation::GeluTanh), &gu);
        assert!((t[1] - 1.682_383_981_216_55).abs() < 1e-9, "{t:?}");
        let g = glu_ref(&p(Activation::Gelu), &gu);
        assert!((g[2] + 0.022_750_131_948_18).abs() < 1e-9, "{g:?}");
        // SiLU is what silu_mul computes.
        let s = glu_ref(&p(Activation::Silu), &gu);
        let sm = silu_mul_ref(
            &SiluMulParams {
                rows: 1,
                inter: 3,
                dtype: dt,
            },
            &gu,
        );
        assert_eq!(s, sm);
    }

    #[test]
    fn add_positions_adds_the_offset_row_and_rounds_once() {
        let dt = DType::Bf16;
        // 4 rows of 2; offset 2: position 1 reads row 3, position 0 row 2.
        let table = enc(dt, &[9.0, 9.0, 9.0, 9.0, 0.25, -1.0, 0.01171875, 2.0]);
        let p = PositionParams {
            positions: vec![1, 0],
            offset: 2,
            table_rows: 4,
            hidden: 2,
            dtype: dt,
        };
        let out = enc(dt, &[1.0, 1.0, 1.0, 1.0]);
        let y = add_positions_ref(&p, &table, &out);
        // 1 + 0.01171875 = 1 + 1.5 · 2^−7: bf16 keeps 7 fraction bits, so this is a tie between
        // 1 + 2^−7 and 1 + 2^−6, broken to the even 1 + 2^−6 (0x3f82).
        assert_eq!(y, vec![0x3f82, dt.from_f32(3.0), dt.from_f32(1.25), dt.from_f32(0.0)]);
    }

    #[test]
    fn silu_mul_of_known_values() {
        let dt = DType::F16;
        let p = SiluMulParams {
            rows: 1,
            inter: 2,
            dtype: dt,
        };
        let out = silu_mul_ref(&p, &enc(dt, &[0.0, 2.0, 3.0, -1.0]));
        assert_eq!(out[0], 0.0);
        let silu2 = 2.0 / (1.0 + (-2.0f64).exp());
        assert!((out[1] + silu2).abs() < 1e-15, "{out:?}");
    }

    #[test]
    fn embedding_and_gather_pick_rows() {
        let dt = DType::F16;
        let table: Vec<u16> = (0..12).collect();
        let e = EmbeddingParams {
            ids: vec![2, 0, 2],
            vocab: 4,
            hidden: 3,
            dtype: dt,
            held: None,
        };
        assert_eq!(embedding_ref(&e, &table), vec![6, 7, 8, 0, 1, 2, 6, 7, 8]);
        // A slice of ids 2..4 (rows 0..2 of its table): id 0 is another rank's, a zero row.
        let s = EmbeddingParams {
            held: Some((2, 2)),
            ..e
        };
        assert_eq!(embedding_ref(&s, &table[..6]), vec![0, 1, 2, 0, 0, 0, 0, 1, 2]);
        let g = GatherParams {
            rows: vec![3, 1],
            width: 3,
            dtype: dt,
        };
        assert_eq!(gather_rows_ref(&g, &table), vec![9, 10, 11, 3, 4, 5]);
    }

    #[test]
    fn rounding_from_f64_is_to_nearest() {
        // 1 + 2^-11 is the midpoint between 1 and the next f16: ties to even gives 1.
        assert_eq!(round_f64(DType::F16, 1.0 + 2f64.powi(-11)), 0x3c00);
        assert_eq!(round_f64(DType::F16, 1.0 + 1.5 * 2f64.powi(-11)), 0x3c01);
        assert_eq!(round_f64(DType::Bf16, 1.0 + 1.5 * 2f64.powi(-8)), 0x3f81);
    }
}
