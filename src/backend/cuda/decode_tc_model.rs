//! A CPU model of one warp of the tensor-core decode pass (kernels_cuda/attn_decode_tc.cuh), for
//! correctness without a GPU. It runs the kernel's steps lane by lane: the same loads (16 bytes
//! of keys g and g + 8 per 32 dims), mma.sync m16n8k16 and movmatrix.m8n8.trans in their PTX
//! fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "movmatrix"), the xor
//! shuffles of the max, P rounded to the 16-bit type, the async scheme's conversion to sums
//! against φ at the end, and the un-permutation of O^T's rows (`tc_dim`). It compares against
//! attention computed directly in f64.
//!
//! [`Fault`] breaks one part of the pass; the tests require each broken model to fail, so the
//! comparison is shown able to catch what it is there for.

use rand::{Rng, SeedableRng};

use crate::dtype::DType;

const LANES: usize = 32;

/// One 32-bit register: two 16-bit elements (low half first), kept as their f32 values.
type Reg = [f32; 2];

/// A deliberate defect, to show the model's comparison can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// O^T's rows written back with the two halves of each tile swapped.
    DimPermutation,
    /// P packed as the B operand without the movmatrix transpose.
    NoPTranspose,
    /// V's tiles fed to the A operand without the transpose.
    NoVTranspose,
    /// The async scheme's P taken against φ (as a first version of the branch did), not
    /// against the warp's running max.
    PAgainstPhi,
}

fn round16(dt: DType, x: f32) -> f32 {
    dt.to_f32(dt.from_f32(x))
}

/// D = A·B + C for one m16n8k16 on the warp's fragments (row-major A, column-major B, f32 C):
/// a[lane] = {a0, a1, a2, a3}, b[lane] = {b0, b1}, c[lane] = {c0, c1, c2, c3}.
fn mma(c: &mut [[f32; 4]; LANES], a: &[[Reg; 4]; LANES], b: &[[Reg; 2]; LANES]) {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    let mut cm = [[0f32; 8]; 16];
    for lane in 0..LANES {
        let (g, t) = (lane / 4, lane % 4);
        for e in 0..2 {
            am[g][2 * t + e] = a[lane][0][e];
            am[g + 8][2 * t + e] = a[lane][1][e];
            am[g][2 * t + 8 + e] = a[lane][2][e];
            am[g + 8][2 * t + 8 + e] = a[lane][3][e];
            bm[2 * t + e][g] = b[lane][0][e];
            bm[2 * t + 8 + e][g] = b[lane][1][e];
            cm[g][2 * t + e] = c[lane][e];
            cm[g + 8][2 * t + e] = c[lane][2 + e];
        }
    }
    let mut dm = [[0f32; 8]; 16];
    for (i, row) in dm.iter_mut().enumerate() {
        for (j, d) in row.iter_mut().enumerate() {
            let dot: f64 = (0..16).map(|k| am[i][k] as f64 * bm[k][j] as f64).sum();
            *d = (dot + cm[i][j] as f64) as f32;
        }
    }
    for (lane, cl) in c.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for e in 0..2 {
            cl[e] = dm[g][2 * t + e];
            cl[2 + e] = dm[g + 8][2 * t + e];
        }
    }
}

/// movmatrix.sync.aligned.m8n8.trans.b16: lane (g, t) holds row g, columns 2t, 2t + 1 before and
/// after.
fn trans(x: &[Reg; LANES]) -> [Reg; LANES] {
    let mut m = [[0f32; 8]; 8];
    for (lane, r) in x.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        m[g][2 * t] = r[0];
        m[g][2 * t + 1] = r[1];
    }
    let mut y = [[0f32; 2]; LANES];
    for (lane, r) in y.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        *r = [m[2 * t][g], m[2 * t + 1][g]];
    }
    y
}

/// __shfl_xor_sync over the warp.
fn shfl_xor(v: &[f32; LANES], mask: usize) -> [f32; LANES] {
    std::array::from_fn(|lane| v[lane ^ mask])
}

/// The kernel's tc_dim.
fn tc_dim(j: usize, hi: usize, g: usize, fault: Fault) -> usize {
    let hi = if fault == Fault::DimPermutation { 1 - hi } else { hi };
    32 * (j >> 1) + 8 * (g >> 1) + 2 * (2 * (j & 1) + hi) + (g & 1)
}

/// One head block's inputs: q [heads][d], K and V [keys][d] (values already 16-bit).
struct Case {
    dt: DType,
    d: usize,
    /// Live heads (≤ 8); columns past them are zero q, as the kernel's masked and padding heads.
    nh: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    keys: usize,
    /// log2(e)/√d.
    scale2: f32,
}

impl Case {
    fn random(dt: DType, d: usize, nh: usize, keys: usize, q_mul: f32, seed: u64) -> Self {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut gen = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| round16(dt, rng.gen_range(-s..s))).collect() };
        let q = gen(nh * d, 2.1).into_iter().map(|x| round16(dt, x * q_mul)).collect();
        let k = gen(keys * d, 2.1);
        let v = gen(keys * d, 1.0);
        Case {
            dt,
            d,
            nh,
            q,
            k,
            v,
            keys,
            scale2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
        }
    }

    /// Scores in log2 units, f64.
    fn score(&self, h: usize, key: usize) -> f64 {
        let d = self.d;
        let dot: f64 = (0..d)
            .map(|i| self.q[h * d + i] as f64 * self.k[key * d + i] as f64)
            .sum();
        dot * self.scale2 as f64
    }

    /// Direct attention: (out [nh][d], Σ 2^(s − φ) per head, max score per head).
    fn direct(&self, phi2: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let d = self.d;
        let mut out = vec![0f64; self.nh * d];
        let (mut lphi, mut mx) = (vec![0f64; self.nh], vec![f64::NEG_INFINITY; self.nh]);
        for h in 0..self.nh {
            let s: Vec<f64> = (0..self.keys).map(|t| self.score(h, t)).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = s.iter().map(|x| (x - m).exp2()).sum();
            for (t, x) in s.iter().enumerate() {
                let p = (x - m).exp2() / l;
                for i in 0..d {
                    out[h * d + i] += p * self.v[t * d + i] as f64;
                }
            }
            lphi[h] = l * (m - phi2).exp2();
            mx[h] = m;
        }
        (out, lphi, mx)
    }
}

/// What the warp leaves in its slot of shared memory, per head < 8: acc [8][d], m, l, mx.
struct WarpOut {
    acc: Vec<f32>,
    m: [f32; 8],
    l: [f32; 8],
    mx: [f32; 8],
}

/// One warp's pass over all of `c`'s keys (16 per step), then tc_store.
fn run_warp(c: &Case, async_phi2: Option<f32>, fault: Fault) -> WarpOut {
    let (d, dt) = (c.d, c.dt);
    let (kc, mt) = (d / 32, d / 16);
    // q fragments: lane (g, t) holds head g's dims 32c + 8t + 2r + {0, 1} as register r of chunk c.
    let qf: Vec<[[Reg; 4]; LANES]> = (0..kc)
        .map(|ch| {
            std::array::from_fn(|lane| {
                let (g, t) = (lane / 4, lane % 4);
                std::array::from_fn(|r| {
                    std::array::from_fn(|e| {
                        if g < c.nh {
                            c.q[g * d + 32 * ch + 8 * t + 2 * r + e]
                        } else {
                            0.0
                        }
                    })
                })
            })
        })
        .collect();
    // The lane's 16-byte load of one row; keys past the end read the last row again (the
    // kernel's tc_page clamps), their scores are masked.
    let load = |rows: &[f32], key: usize, ch: usize, t: usize| -> [Reg; 4] {
        let key = key.min(c.keys - 1);
        std::array::from_fn(|r| std::array::from_fn(|e| rows[key * d + 32 * ch + 8 * t + 2 * r + e]))
    };
    let mut o = vec![[[0f32; 4]; LANES]; mt];
    let mut m = [[f32::NEG_INFINITY; 2]; LANES];
    let mut l = [[0f32; 2]; LANES];
    let mut base = 0;
    while base < c.keys {
        // Per lane and chunk: (ka, kb, va, vb).
        let kk: Vec<[[[Reg; 4]; 4]; LANES]> = (0..kc)
            .map(|ch| {
                std::array::from_fn(|lane| {
                    let (g, t) = (lane / 4, lane % 4);
                    [
                        load(&c.k, base + g, ch, t),
                        load(&c.k, base + g + 8, ch, t),
                        load(&c.v, base + g, ch, t),
                        load(&c.v, base + g + 8, ch, t),
                    ]
                })
            })
            .collect();
        // S^T = K·Q^T.
        let mut s = [[0f32; 4]; LANES];
        for (ch, kl) in kk.iter().enumerate() {
            for half in 0..2 {
                let a: [[Reg; 4]; LANES] = std::array::from_fn(|lane| {
                    let [ka, kb, _, _] = kl[lane];
                    [ka[2 * half], kb[2 * half], ka[2 * half + 1], kb[2 * half + 1]]
                });
                let b: [[Reg; 2]; LANES] =
                    std::array::from_fn(|lane| [qf[ch][lane][2 * half], qf[ch][lane][2 * half + 1]]);
                mma(&mut s, &a, &b);
            }
        }
        for (lane, sl) in s.iter_mut().enumerate() {
            let g = lane / 4;
            let (oka, okb) = (base + g < c.keys, base + g + 8 < c.keys);
            for (i, x) in sl.iter_mut().enumerate() {
                let ok = if i < 2 { oka } else { okb };
                *x = if ok { *x * c.scale2 } else { f32::NEG_INFINITY };
            }
        }
        // The step's max per head, xor-shuffled over the lanes of a column pair.
        let mut cm: [[f32; LANES]; 2] =
            std::array::from_fn(|k| std::array::from_fn(|lane| s[lane][k].max(s[lane][2 + k])));
        for off in [4, 8, 16] {
            for cmk in cm.iter_mut() {
                let other = shfl_xor(cmk, off);
                for lane in 0..LANES {
                    cmk[lane] = cmk[lane].max(other[lane]);
                }
            }
        }
        let mut e = [[0f32; 4]; LANES];
        for lane in 0..LANES {
            for k in 0..2 {
                let nm = m[lane][k].max(cm[k][lane]);
                // (The faulty version keeps no running max to rescale against.)
                let against_phi = fault == Fault::PAgainstPhi && async_phi2.is_some();
                if nm > m[lane][k] && !against_phi {
                    let f = if m[lane][k] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (m[lane][k] - nm).exp2()
                    };
                    for oj in o.iter_mut() {
                        oj[lane][k] *= f;
                        oj[lane][2 + k] *= f;
                    }
                    l[lane][k] *= f;
                    m[lane][k] = nm;
                } else if against_phi {
                    m[lane][k] = nm;
                }
            }
            for i in 0..4 {
                let base_m = match (fault, async_phi2) {
                    (Fault::PAgainstPhi, Some(phi2)) => phi2,
                    _ => m[lane][i & 1],
                };
                e[lane][i] = if s[lane][i] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (s[lane][i] - base_m).exp2()
                };
            }
            l[lane][0] += e[lane][0] + e[lane][2];
            l[lane][1] += e[lane][1] + e[lane][3];
        }
        // P^T as the B operand: pack2 rounds to the 16-bit type, then the transpose.
        let p0: [Reg; LANES] = std::array::from_fn(|lane| [round16(dt, e[lane][0]), round16(dt, e[lane][1])]);
        let p1: [Reg; LANES] = std::array::from_fn(|lane| [round16(dt, e[lane][2]), round16(dt, e[lane][3])]);
        let (pb0, pb1) = if fault == Fault::NoPTranspose {
            (p0, p1)
        } else {
            (trans(&p0), trans(&p1))
        };
        let b: [[Reg; 2]; LANES] = std::array::from_fn(|lane| [pb0[lane], pb1[lane]]);
        // O^T += V^T·P^T.
        for (j, oj) in o.iter_mut().enumerate() {
            let (ch, r) = (j >> 1, 2 * (j & 1));
            let reg = |which: usize, r: usize| -> [Reg; LANES] {
                let x: [Reg; LANES] = std::array::from_fn(|lane| kk[ch][lane][which][r]);
                if fault == Fault::NoVTranspose {
                    x
                } else {
                    trans(&x)
                }
            };
            let (a0, a1, a2, a3) = (reg(2, r), reg(2, r + 1), reg(3, r), reg(3, r + 1));
            let a: [[Reg; 4]; LANES] = std::array::from_fn(|lane| [a0[lane], a1[lane], a2[lane], a3[lane]]);
            mma(oj, &a, &b);
        }
        base += 16;
    }
    // tc_store: l over the lanes of a column pair, the async conversion, O^T's rows in dim order.
    for off in [4, 8, 16] {
        for k in 0..2 {
            let lk: [f32; LANES] = std::array::from_fn(|lane| l[lane][k]);
            let other = shfl_xor(&lk, off);
            for (ll, o) in l.iter_mut().zip(other) {
                ll[k] += o;
            }
        }
    }
    let mut out = WarpOut {
        acc: vec![f32::NAN; 8 * d],
        m: [0.0; 8],
        l: [0.0; 8],
        mx: [0.0; 8],
    };
    for lane in 0..LANES {
        let (g, t) = (lane / 4, lane % 4);
        for k in 0..2 {
            let h = 2 * t + k;
            let f = match async_phi2 {
                Some(_) if fault == Fault::PAgainstPhi => 1.0,
                Some(phi2) if m[lane][k] != f32::NEG_INFINITY => (m[lane][k] - phi2).exp2(),
                Some(_) => 0.0,
                None => 1.0,
            };
            for (j, oj) in o.iter().enumerate() {
                out.acc[h * d + tc_dim(j, 0, g, fault)] = oj[lane][k] * f;
                out.acc[h * d + tc_dim(j, 1, g, fault)] = oj[lane][2 + k] * f;
            }
            if g == 0 {
                out.m[h] = async_phi2.unwrap_or(m[lane][k]);
                out.l[h] = l[lane][k] * f;
                out.mx[h] = m[lane][k];
            }
        }
    }
    out
}

/// Largest |model − direct| of out = acc / l over the live heads (∞ for a non-finite value), and
/// under async the largest relative error of l against Σ 2^(s − φ).
fn errors(c: &Case, async_phi2: Option<f32>, fault: Fault) -> (f64, f64) {
    let w = run_warp(c, async_phi2, fault);
    let (want, lphi, mx) = c.direct(async_phi2.unwrap_or(0.0) as f64);
    let mut worst = 0f64;
    for h in 0..c.nh {
        for i in 0..c.d {
            let got = (w.acc[h * c.d + i] / w.l[h]) as f64;
            let err = if got.is_finite() {
                (got - want[h * c.d + i]).abs()
            } else {
                f64::INFINITY
            };
            worst = worst.max(err);
        }
        assert!(
            (w.mx[h] as f64 - mx[h]).abs() <= 1e-3 * mx[h].abs().max(1.0),
            "max score of head {h}"
        );
    }
    let mut lerr = 0f64;
    if async_phi2.is_some() {
        for (h, &lp) in lphi.iter().enumerate() {
            let e = ((w.l[h] as f64 - lp) / lp).abs();
            lerr = lerr.max(if e.is_finite() { e } else { f64::INFINITY });
        }
    }
    (worst, lerr)
}

const TOL: f64 = 2e-3;

fn shapes() -> Vec<(usize, usize, usize)> {
    let mut v = Vec::new();
    for d in [64, 128] {
        for nh in 2..=8 {
            for keys in [1, 7, 16, 17, 33, 50] {
                v.push((d, nh, keys));
            }
        }
    }
    v
}

#[test]
fn one_warp_matches_direct_attention_sync_and_async() {
    for (i, (d, nh, keys)) in shapes().into_iter().enumerate() {
        let dt = if i % 3 == 2 { DType::Bf16 } else { DType::F16 };
        let tol = if dt == DType::Bf16 { 8.0 * TOL } else { TOL };
        let c = Case::random(dt, d, nh, keys, 1.0, 0x7c00 + i as u64);
        let (e, _) = errors(&c, None, Fault::None);
        assert!(e <= tol, "sync {dt} d{d} nh{nh} keys {keys}: error {e:.2e}");
        // φ ≠ 0, on both sides of the scores.
        for phi2 in [1.7f32, -2.3] {
            let (e, le) = errors(&c, Some(phi2), Fault::None);
            assert!(
                e <= tol && le <= 1e-5,
                "async φ {phi2} {dt} d{d} nh{nh} keys {keys}: {e:.2e}, l {le:.2e}"
            );
        }
    }
}

/// q 8× larger and φ 20 below the top score: the largest 2^(s − φ) is 2^20, past fp16's range
/// (asserted), so P against φ could not enter the mma; against the warp's running max it stays ≤ 1
/// and the sums against φ come out right (2^20 is far inside f32: a row past 2^b is flagged and
/// recomputed anyway).
#[test]
fn async_sums_survive_scores_whose_exponential_overflows_fp16() {
    for (d, nh, keys) in [(64, 4, 50), (128, 8, 33), (128, 5, 17)] {
        let c = Case::random(DType::F16, d, nh, keys, 8.0, 99 + keys as u64);
        let top = (0..nh)
            .flat_map(|h| (0..keys).map(move |t| (h, t)))
            .map(|(h, t)| c.score(h, t))
            .fold(f64::NEG_INFINITY, f64::max);
        let phi2 = (top - 20.0) as f32;
        assert!(phi2 != 0.0);
        assert!(
            (top - phi2 as f64).exp2() > 65504.0,
            "2^(s − φ) fits fp16: not the case meant"
        );
        let (e, le) = errors(&c, Some(phi2), Fault::None);
        assert!(e <= TOL && le <= 1e-5, "d{d} nh{nh}: {e:.2e}, l {le:.2e}");
        // P against φ, as a first version of the design had it, fails here (inf in fp16).
        let (e, _) = errors(&c, Some(phi2), Fault::PAgainstPhi);
        assert!(e.is_nan() || e > TOL, "P against φ passed (d{d} nh{nh}): {e:.2e}");
    }
}

/// The comparison catches each defect it is there for: a wrong dim un-permutation, a missing
/// transpose of P or of V.
#[test]
fn the_model_fails_when_the_permutation_or_a_transpose_is_broken() {
    for fault in [Fault::DimPermutation, Fault::NoPTranspose, Fault::NoVTranspose] {
        for (d, nh, keys) in [(64, 2, 17), (128, 8, 50), (128, 5, 33)] {
            let c = Case::random(DType::F16, d, nh, keys, 1.0, 5 + nh as u64);
            let (e, _) = errors(&c, None, fault);
            assert!(
                e.is_nan() || e > TOL,
                "{fault:?} passed at d{d} nh{nh} keys {keys}: error {e:.2e}"
            );
        }
    }
}
