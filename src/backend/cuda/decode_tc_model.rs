//! A CPU model of one warp of the tensor-core decode pass (kernels_cuda/attn_decode_tc.cuh), for
//! correctness without a GPU. It runs the kernel's steps lane by lane: the same loads (16 bytes
//! of keys g and g + 8 per 32 dims), mma.sync m16n8k16 and movmatrix.m8n8.trans in their PTX
//! fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "movmatrix"), the xor
//! shuffles of the max, P rounded to the 16-bit type, the async scheme's conversion to sums
//! against φ at the end, and the un-permutation of O^T's rows (`tc_dim`). At head_dim 256 it runs
//! the kernel's team of two warps, each over 128 of the dims, with the exchange of partial S^T
//! (each warp adds its partner's, computed as the partner computes it) and the merge of the two
//! warps' slots as block_sum and block_head do it. It compares against attention computed
//! directly in f64.
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
    /// head_dim 256: each warp of a team keeps its own partial S^T (no exchange).
    NoExchange,
    /// The staged form: ldmatrix reads the tiles without the swizzle the copies wrote them with.
    NoSwizzleRead,
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
    /// The staged form (K/V through shared memory, fragments by ldmatrix) instead of the register
    /// pass.
    staged: bool,
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
            staged: false,
        }
    }

    fn staged(mut self) -> Self {
        self.staged = true;
        self
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

/// The kernel's TC_DW and TC_SPLIT: dims per warp, warps per key step.
fn team_shape(d: usize) -> (usize, usize) {
    let dw = d.min(128);
    (dw, d / dw)
}

/// q fragments of the warp covering dims `d0 ..`: lane (g, t) holds head g's dims
/// d0 + 32c + 8t + 2r + {0, 1} as register r of chunk c.
fn q_frags(c: &Case, d0: usize, kc: usize) -> Vec<[[Reg; 4]; LANES]> {
    let d = c.d;
    (0..kc)
        .map(|ch| {
            std::array::from_fn(|lane| {
                let (g, t) = (lane / 4, lane % 4);
                std::array::from_fn(|r| {
                    std::array::from_fn(|e| {
                        if g < c.nh {
                            c.q[g * d + d0 + 32 * ch + 8 * t + 2 * r + e]
                        } else {
                            0.0
                        }
                    })
                })
            })
        })
        .collect()
}

/// The lane's 16-byte load of one row's chunk `ch` of the dims from `d0`; keys past the end read
/// the last row again (the kernel's tc_page clamps), their scores are masked.
fn load(c: &Case, rows: &[f32], key: usize, d0: usize, ch: usize, t: usize) -> [Reg; 4] {
    let key = key.min(c.keys - 1);
    std::array::from_fn(|r| std::array::from_fn(|e| rows[key * c.d + d0 + 32 * ch + 8 * t + 2 * r + e]))
}

/// The partial S^T = K·Q^T of keys base + g, base + g + 8 over the dims from `d0` (one warp's
/// chunks), unscaled.
fn partial_s(c: &Case, qf: &[[[Reg; 4]; LANES]], base: usize, d0: usize) -> [[f32; 4]; LANES] {
    let mut s = [[0f32; 4]; LANES];
    for (ch, qc) in qf.iter().enumerate() {
        let kl: [[[Reg; 4]; 2]; LANES] = std::array::from_fn(|lane| {
            let (g, t) = (lane / 4, lane % 4);
            [
                load(c, &c.k, base + g, d0, ch, t),
                load(c, &c.k, base + g + 8, d0, ch, t),
            ]
        });
        for half in 0..2 {
            let a: [[Reg; 4]; LANES] = std::array::from_fn(|lane| {
                let [ka, kb] = kl[lane];
                [ka[2 * half], kb[2 * half], ka[2 * half + 1], kb[2 * half + 1]]
            });
            let b: [[Reg; 2]; LANES] = std::array::from_fn(|lane| [qc[lane][2 * half], qc[lane][2 * half + 1]]);
            mma(&mut s, &a, &b);
        }
    }
    s
}

/// The staged form's tile of one 16-key step (K or V of the warp's dims from `d0`), as tcs_issue
/// writes it: lane (g, t) copies chunks t, t + 4, … of keys g and g + 8 to chunk position
/// c ^ (key & 7) of the key's row (tcs_off). Each position is written exactly once (asserted).
fn stage_tile(c: &Case, rows: &[f32], base: usize, d0: usize) -> Vec<[f32; 8]> {
    let cpr = c.d.min(128) / 8;
    let mut tile = vec![[f32::NAN; 8]; 16 * cpr];
    let mut written = vec![0u8; 16 * cpr];
    for lane in 0..LANES {
        let (g, t) = (lane / 4, lane % 4);
        for i in 0..cpr / 4 {
            let ch = t + 4 * i;
            for key in [g, g + 8] {
                let row = (base + key).min(c.keys - 1);
                let at = key * cpr + (ch ^ (key & 7));
                tile[at] = std::array::from_fn(|e| rows[row * c.d + d0 + 8 * ch + e]);
                written[at] += 1;
            }
        }
    }
    assert!(written.iter().all(|&w| w == 1), "the copies cover the tile once");
    tile
}

/// ldmatrix.x4 (`trans`: .trans) on a tile: lane l addresses row l % 8 of matrix l / 8 at
/// (key, chunk) = `at(l)`; register m of lane (g, t) gets matrix m's row g, columns 2t, 2t + 1
/// (transposed: column g, rows 2t, 2t + 1).
fn ldmatrix_x4(
    tile: &[[f32; 8]],
    cpr: usize,
    at: impl Fn(usize) -> (usize, usize),
    trans: bool,
    fault: Fault,
) -> [[Reg; 4]; LANES] {
    let rows: [[[f32; 8]; 8]; 4] = std::array::from_fn(|m| {
        std::array::from_fn(|r| {
            let (key, ch) = at(8 * m + r);
            let phys = if fault == Fault::NoSwizzleRead {
                ch
            } else {
                ch ^ (key & 7)
            };
            tile[key * cpr + phys]
        })
    });
    std::array::from_fn(|lane| {
        let (g, t) = (lane / 4, lane % 4);
        std::array::from_fn(|m| {
            if trans {
                [rows[m][2 * t][g], rows[m][2 * t + 1][g]]
            } else {
                [rows[m][g][2 * t], rows[m][g][2 * t + 1]]
            }
        })
    })
}

/// The staged form's partial S^T over the dims from `d0`: K fragments by ldmatrix from the tile,
/// q's B fragments in natural dim order (tcs_load_q).
fn partial_s_staged(c: &Case, base: usize, d0: usize, fault: Fault) -> [[f32; 4]; LANES] {
    let dw = c.d.min(128);
    let cpr = dw / 8;
    let tile = stage_tile(c, &c.k, base, d0);
    let mut s = [[0f32; 4]; LANES];
    for ks in 0..dw / 16 {
        let a = ldmatrix_x4(
            &tile,
            cpr,
            |l| {
                let (m, r) = (l >> 3, l & 7);
                (r + 8 * (m & 1), 2 * ks + (m >> 1))
            },
            false,
            fault,
        );
        let b: [[Reg; 2]; LANES] = std::array::from_fn(|lane| {
            let (g, t) = (lane / 4, lane % 4);
            let q = |dim: usize| -> Reg {
                std::array::from_fn(|e| if g < c.nh { c.q[g * c.d + d0 + dim + e] } else { 0.0 })
            };
            [q(16 * ks + 2 * t), q(16 * ks + 8 + 2 * t)]
        });
        mma(&mut s, &a, &b);
    }
    s
}

/// One warp's pass over all of `c`'s keys (16 per step), then tc_store. `half`: the warp's half
/// of the dims at head_dim 256 (0 otherwise).
fn run_warp(c: &Case, async_phi2: Option<f32>, fault: Fault, half: usize) -> WarpOut {
    let (d, dt) = (c.d, c.dt);
    let (dw, split) = team_shape(d);
    let d0 = dw * half;
    let (kc, mt) = (dw / 32, dw / 16);
    let qf = q_frags(c, d0, kc);
    // The partner's q fragments (head_dim 256): its partial S^T is computed as it computes it.
    let partner_qf = (split > 1).then(|| q_frags(c, dw * (1 - half), kc));
    let mut o = vec![[[0f32; 4]; LANES]; mt];
    let mut m = [[f32::NEG_INFINITY; 2]; LANES];
    let mut l = [[0f32; 2]; LANES];
    let mut base = 0;
    while base < c.keys {
        // Per lane and chunk: (va, vb) of the warp's dims.
        let vv: Vec<[[[Reg; 4]; 2]; LANES]> = (0..kc)
            .map(|ch| {
                std::array::from_fn(|lane| {
                    let (g, t) = (lane / 4, lane % 4);
                    [
                        load(c, &c.v, base + g, d0, ch, t),
                        load(c, &c.v, base + g + 8, d0, ch, t),
                    ]
                })
            })
            .collect();
        // S^T = K·Q^T over the warp's dims, plus the partner's partial (tc_exchange: mine + the
        // other's, an f32 add as the kernel does it).
        let mut s = if c.staged {
            partial_s_staged(c, base, d0, fault)
        } else {
            partial_s(c, &qf, base, d0)
        };
        if let Some(pq) = &partner_qf {
            if fault != Fault::NoExchange {
                let o = if c.staged {
                    partial_s_staged(c, base, dw * (1 - half), fault)
                } else {
                    partial_s(c, pq, base, dw * (1 - half))
                };
                for (sl, ol) in s.iter_mut().zip(o) {
                    for (x, y) in sl.iter_mut().zip(ol) {
                        *x += y;
                    }
                }
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
        // O^T += V^T·P^T; the staged form takes V^T by ldmatrix.trans from its tile.
        let vtile = c.staged.then(|| stage_tile(c, &c.v, base, d0));
        for (j, oj) in o.iter_mut().enumerate() {
            if let Some(tile) = &vtile {
                let a = ldmatrix_x4(
                    tile,
                    dw / 8,
                    |l| {
                        let (m, r) = (l >> 3, l & 7);
                        (r + 8 * (m >> 1), 2 * j + (m & 1))
                    },
                    fault != Fault::NoVTranspose,
                    fault,
                );
                mma(oj, &a, &b);
                continue;
            }
            let (ch, r) = (j >> 1, 2 * (j & 1));
            let reg = |which: usize, r: usize| -> [Reg; LANES] {
                let x: [Reg; LANES] = std::array::from_fn(|lane| vv[ch][lane][which][r]);
                if fault == Fault::NoVTranspose {
                    x
                } else {
                    trans(&x)
                }
            };
            let (a0, a1, a2, a3) = (reg(0, r), reg(0, r + 1), reg(1, r), reg(1, r + 1));
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
    // The warp's own dims are written below; the other half (head_dim 256) is zeroed, as tc_store
    // does for block_sum.
    let mut out = WarpOut {
        acc: (0..8 * d)
            .map(|i| if (i % d) / dw == half { f32::NAN } else { 0.0 })
            .collect(),
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
                // The staged form's O^T rows are in dim order (tc_store<…, NATURAL>).
                let (r0, r1) = if c.staged {
                    let (lo, hi) = if fault == Fault::DimPermutation { (8, 0) } else { (0, 8) };
                    (16 * j + lo + g, 16 * j + hi + g)
                } else {
                    (tc_dim(j, 0, g, fault), tc_dim(j, 1, g, fault))
                };
                out.acc[h * d + d0 + r0] = oj[lane][k] * f;
                out.acc[h * d + d0 + r1] = oj[lane][2 + k] * f;
            }
            if g == 0 {
                out.m[h] = async_phi2.unwrap_or(m[lane][k]);
                // Half 1 of a team gives no l: its partner holds the same.
                out.l[h] = if half == 0 { l[lane][k] * f } else { 0.0 };
                out.mx[h] = m[lane][k];
            }
        }
    }
    out
}

/// The warps' slots merged as block_sum and block_head do it: sync rescales each slot to the
/// largest m, async adds (every slot's m is φ); the largest score is the maximum over the slots.
fn merge(warps: &[WarpOut], d: usize, is_async: bool) -> WarpOut {
    let mut out = WarpOut {
        acc: vec![0.0; 8 * d],
        m: [f32::NEG_INFINITY; 8],
        l: [0.0; 8],
        mx: [f32::NEG_INFINITY; 8],
    };
    for h in 0..8 {
        let bm = warps.iter().map(|w| w.m[h]).fold(f32::NEG_INFINITY, f32::max);
        out.m[h] = bm;
        for w in warps {
            let f = if is_async {
                1.0
            } else if w.m[h] == f32::NEG_INFINITY {
                0.0
            } else {
                (w.m[h] - bm).exp2()
            };
            for i in 0..d {
                out.acc[h * d + i] += w.acc[h * d + i] * f;
            }
            out.l[h] += w.l[h] * f;
            out.mx[h] = out.mx[h].max(w.mx[h]);
        }
    }
    out
}

/// Largest |model − direct| of out = acc / l over the live heads (∞ for a non-finite value), and
/// under async the largest relative error of l against Σ 2^(s − φ).
fn errors(c: &Case, async_phi2: Option<f32>, fault: Fault) -> (f64, f64) {
    let (_, split) = team_shape(c.d);
    let warps: Vec<WarpOut> = (0..split).map(|half| run_warp(c, async_phi2, fault, half)).collect();
    let w = merge(&warps, c.d, async_phi2.is_some());
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
        let mx_ok = (w.mx[h] as f64 - mx[h]).abs() <= 1e-3 * mx[h].abs().max(1.0);
        // A broken model may get the scores wrong: that is a failure to report, not a panic.
        assert!(mx_ok || fault != Fault::None, "max score of head {h}");
        if !mx_ok {
            worst = f64::INFINITY;
        }
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
    for d in [64, 128, 256] {
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
    for (d, nh, keys) in [(64, 4, 50), (128, 8, 33), (128, 5, 17), (256, 8, 33), (256, 3, 17)] {
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
        for (d, nh, keys) in [(64, 2, 17), (128, 8, 50), (128, 5, 33), (256, 4, 33)] {
            let c = Case::random(DType::F16, d, nh, keys, 1.0, 5 + nh as u64);
            let (e, _) = errors(&c, None, fault);
            assert!(
                e.is_nan() || e > TOL,
                "{fault:?} passed at d{d} nh{nh} keys {keys}: error {e:.2e}"
            );
        }
    }
}

/// head_dim 256: a team whose warps keep their own partial S^T (no exchange) fails, sync and
/// async; with the exchange both warps take the same running max (asserted through the merge:
/// the slots' m agree).
#[test]
fn the_d256_team_fails_without_the_exchange() {
    for (nh, keys) in [(8, 50), (2, 17), (5, 33)] {
        let c = Case::random(DType::F16, 256, nh, keys, 1.0, 0xd256 + keys as u64);
        let (e, _) = errors(&c, None, Fault::NoExchange);
        assert!(
            e.is_nan() || e > TOL,
            "no exchange passed at nh{nh} keys {keys}: {e:.2e}"
        );
        let (e, _) = errors(&c, Some(1.7), Fault::NoExchange);
        assert!(
            e.is_nan() || e > TOL,
            "async, no exchange passed at nh{nh} keys {keys}: {e:.2e}"
        );
        let w: Vec<WarpOut> = (0..2).map(|h| run_warp(&c, None, Fault::None, h)).collect();
        for h in 0..nh {
            assert_eq!(
                w[0].m[h].to_bits(),
                w[1].m[h].to_bits(),
                "head {h}: the halves' maxima differ"
            );
        }
    }
}

/// The staged form (kernels_cuda/attn_decode_tc.cuh, "The staged form"): the copies' swizzled
/// tiles, ldmatrix and ldmatrix.trans fragments, q in natural dim order and O^T's rows in dim
/// order match direct attention at every head_dim, sync and async; it fails with the swizzle
/// left out of the reads, with V read without .trans, with the halves of O^T's rows swapped.
#[test]
fn the_staged_form_matches_and_its_faults_fail() {
    for (i, (d, nh, keys)) in shapes().into_iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        let dt = if i % 3 == 2 { DType::Bf16 } else { DType::F16 };
        let tol = if dt == DType::Bf16 { 8.0 * TOL } else { TOL };
        let c = Case::random(dt, d, nh, keys, 1.0, 0x57a6 + i as u64).staged();
        let (e, _) = errors(&c, None, Fault::None);
        assert!(e <= tol, "staged sync {dt} d{d} nh{nh} keys {keys}: error {e:.2e}");
        let (e, le) = errors(&c, Some(-2.3), Fault::None);
        assert!(
            e <= tol && le <= 1e-5,
            "staged async {dt} d{d} nh{nh} keys {keys}: {e:.2e}, l {le:.2e}"
        );
    }
    for fault in [Fault::NoSwizzleRead, Fault::NoVTranspose, Fault::DimPermutation] {
        for (d, nh, keys) in [(64, 2, 17), (128, 8, 50), (256, 5, 33)] {
            let c = Case::random(DType::F16, d, nh, keys, 1.0, 11 + nh as u64).staged();
            let (e, _) = errors(&c, None, fault);
            assert!(e.is_nan() || e > TOL, "staged {fault:?} passed at d{d} nh{nh}: {e:.2e}");
        }
    }
    // The exchange is the same at d256.
    let c = Case::random(DType::F16, 256, 8, 50, 1.0, 3).staged();
    let (e, _) = errors(&c, None, Fault::NoExchange);
    assert!(e.is_nan() || e > TOL, "staged without the exchange passed: {e:.2e}");
}
