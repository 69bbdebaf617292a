//! ImplC `gemm` on the CPU: the general GEMM for large M (prefill), the CPU's stand-in for
//! cuBLAS, the path FlashDecoding++ §4 keeps for large M.
//!
//! A register-tiled, packed GEMM computing yᵀ = W · xᵀ (the layout the caller wants, [N, M]):
//! - x (already widened, [M, K]) is packed once per call into panels of [`MR`] = 16 rows of x
//!   interleaved along K (`[M/16][K][16]`, zero-padded past M), so that a step of the
//!   micro-kernel reads 16 values of one k with two aligned-size vector loads;
//! - each task owns a run of rows of W; for one K-block of [`KC`] it widens [`NR`] = 6 rows of
//!   W (F16C / shift) into a small f32 strip that stays in L1, then sweeps every x panel with it:
//!   a 6 × 16 tile of yᵀ lives in 12 vector registers, each step broadcasts 6 values of W and
//!   does 12 FMAs against the two x vectors;
//! - the K-block keeps one x panel (16 · KC · 4 bytes = 16 KiB) in L1 and all the panels of a
//!   K-block (M · KC · 4 bytes, 128 KiB at M = 128) in L2 while the strips of W pass.
//!
//! W is widened once per K-block and strip, i.e. once per call: at M = 128 that is 1/128 of the
//! multiply-adds. The matrixmultiply sgemm this replaces needed W widened to a full f32 block
//! first and reached ~60-70 GFLOP/s on the 2-core EPYC (reports/NOTES.md).

use rayon::prelude::*;

use super::simd::{multiversion, narrow, Vf32, LANES};
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Rows of x per tile (two vectors).
const MR: usize = 2 * LANES;
/// Rows of W per tile: 6 × 2 accumulators leave 4 of the 16 vector registers for the two x
/// vectors and the broadcast.
const NR: usize = 6;
/// K per block: a 16 × KC panel of x is 16 KiB (L1 is 32 KiB), the 6 × KC strip of W 6 KiB.
const KC: usize = 256;

/// The most rows of W per task (a multiple of [`NR`]).
pub(super) const DEFAULT_BLOCK_ROWS: usize = 42 * NR;

/// Rows of W per task when the spec names none: about 8 tasks per thread (a thread slowed by
/// another process is made up for by the others), a multiple of [`NR`], at most
/// [`DEFAULT_BLOCK_ROWS`].
pub(super) fn default_block_rows(n: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    n.div_ceil(8 * threads)
        .next_multiple_of(NR)
        .clamp(NR, DEFAULT_BLOCK_ROWS)
}

/// y [M, N] = narrow(x · Wᵀ); `xf` is x widened, [M, K]; `w` holds at least N·K bits.
///
/// Each task computes its rows of W into a task-local yᵀ block ([rows, M] f32, still in L2
/// when it ends), rounds it transposed into a task-local [M, rows] block, and a last parallel
/// pass copies each row of y together from the blocks. Rounding a whole [N, M] yᵀ transposed
/// afterwards read it column-wise from L3 (FFN1 at M = 512: 6 MiB) and took ~11 % of prefill.
pub(super) fn gemm(dt: DType, d: GemmDims, xf: &[f32], w: &[u16], y: &mut [u16], block_rows: usize) {
    let (m, n, k) = (d.m, d.n, d.k);
    let y = &mut y[..m * n];
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(dt.from_f32(0.0));
        return;
    }
    let xp = pack_x(m, k, xf);
    let block_rows = block_rows.max(1);
    let blocks: Vec<Vec<u16>> = (0..n.div_ceil(block_rows))
        .into_par_iter()
        .with_max_len(1)
        .map_init(
            || vec![0f32; NR * KC],
            |wf, task| {
                let n0 = task * block_rows;
                let rows = block_rows.min(n - n0);
                let mut out = vec![0f32; rows * m];
                task_tiles(dt, m, k, &xp, &w[n0 * k..(n0 + rows) * k], wf, &mut out);
                let mut yt = vec![0u16; m * rows];
                let mut col = vec![0f32; rows];
                for (i, yt_row) in yt.chunks_exact_mut(rows).enumerate() {
                    for (c, o) in col.iter_mut().zip(out.chunks_exact(m)) {
                        *c = o[i];
                    }
                    narrow(dt, &col, yt_row);
                }
                yt
            },
        )
        .collect();
    y.par_chunks_mut(n).enumerate().for_each(|(i, y_row)| {
        for (task, yt) in blocks.iter().enumerate() {
            let n0 = task * block_rows;
            let rows = yt.len() / m;
            y_row[n0..n0 + rows].copy_from_slice(&yt[i * rows..(i + 1) * rows]);
        }
    });
}

/// x [M, K] as `[⌈M/16⌉][K][16]`, rows past M zero; one task per panel.
fn pack_x(m: usize, k: usize, xf: &[f32]) -> Vec<f32> {
    let mut xp = vec![0f32; m.div_ceil(MR) * k * MR];
    xp.par_chunks_mut(k * MR).enumerate().for_each(|(mb, panel)| {
        let rows = MR.min(m - mb * MR);
        for lane in 0..rows {
            let row = &xf[(mb * MR + lane) * k..(mb * MR + lane + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * MR + lane] = v;
            }
        }
    });
    xp
}

multiversion! {
    /// out[r, i] = x_i · w_r for the rows r of `w_rows` ([rows, K]) and every row i of x
    /// (packed, see [`pack_x`]); `wf` is scratch of NR · KC.
    fn task_tiles(dt: DType, m: usize, k: usize, xp: &[f32], w_rows: &[u16], wf: &mut [f32], out: &mut [f32]) => task_tiles_generic
}

#[inline(always)]
fn task_tiles_generic<V: Vf32>(
    dt: DType,
    m: usize,
    k: usize,
    xp: &[f32],
    w_rows: &[u16],
    wf: &mut [f32],
    out: &mut [f32],
) {
    let rows = w_rows.len() / k;
    let mblocks = m.div_ceil(MR);
    let mut k0 = 0;
    while k0 < k {
        let kc = KC.min(k - k0);
        let first = k0 == 0;
        let mut r = 0;
        while r < rows {
            let nr = NR.min(rows - r);
            for i in 0..nr {
                let at = (r + i) * k + k0;
                V::widen(dt, &w_rows[at..at + kc], &mut wf[i * KC..i * KC + kc]);
            }
            let out_rows = &mut out[r * m..(r + nr) * m];
            for mb in 0..mblocks {
                let panel = &xp[(mb * k + k0) * MR..(mb * k + k0 + kc) * MR];
                let (m0, cols) = (mb * MR, MR.min(m - mb * MR));
                let t = Tile { kc, m, m0, cols, first };
                match nr {
                    6 => tile::<V, 6>(t, panel, wf, out_rows),
                    5 => tile::<V, 5>(t, panel, wf, out_rows),
                    4 => tile::<V, 4>(t, panel, wf, out_rows),
                    3 => tile::<V, 3>(t, panel, wf, out_rows),
                    2 => tile::<V, 2>(t, panel, wf, out_rows),
                    _ => tile::<V, 1>(t, panel, wf, out_rows),
                }
            }
            r += nr;
        }
        k0 += kc;
    }
}

/// Where a tile lies: K-block length, the row length of yᵀ, the first column and how many
/// columns are real (the rest of the panel is padding), and whether this is the first K-block
/// (write) or a later one (add).
#[derive(Clone, Copy)]
struct Tile {
    kc: usize,
    m: usize,
    m0: usize,
    cols: usize,
    first: bool,
}

/// The R × 16 register tile over one K-block: `wf` holds R widened rows of W at stride KC,
/// `panel` the K-block's 16-wide x panel, `out` the R rows of yᵀ.
#[inline(always)]
fn tile<V: Vf32, const R: usize>(t: Tile, panel: &[f32], wf: &[f32], out: &mut [f32]) {
    let kc = t.kc;
    let (p16, _) = panel.as_chunks::<MR>();
    let w: [&[f32]; R] = std::array::from_fn(|i| &wf[i * KC..i * KC + kc]);
    // Bounds the compiler can see, so that the loop below runs without checks.
    assert!(p16.len() >= kc && w.iter().all(|r| r.len() >= kc));
    let mut c = [[V::zero(); 2]; R];
    for kk in 0..kc {
        let (x8, _) = p16[kk].as_chunks::<LANES>();
        let (x0, x1) = (V::load(&x8[0]), V::load(&x8[1]));
        for i in 0..R {
            let wv = V::splat(w[i][kk]);
            c[i][0] = wv.madd(x0, c[i][0]);
            c[i][1] = wv.madd(x1, c[i][1]);
        }
    }
    for (i, ci) in c.iter().enumerate() {
        let mut buf = [0f32; MR];
        let (b8, _) = buf.as_chunks_mut::<LANES>();
        ci[0].store(&mut b8[0]);
        ci[1].store(&mut b8[1]);
        let row = &mut out[i * t.m + t.m0..i * t.m + t.m0 + t.cols];
        if t.first {
            row.copy_from_slice(&buf[..t.cols]);
        } else {
            row.iter_mut().zip(&buf).for_each(|(o, v)| *o += v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::Portable;
    use crate::dtype::random_bits;

    /// Every build against an f64 reference at odd M (panel padding), N (row-tile tails), K
    /// (K-block tails) and block rows, with NaN-poisoned outputs.
    #[test]
    fn gemm_matches_f64_at_odd_sizes_in_every_build() {
        let mut seed = 300;
        for dt in [DType::F16, DType::Bf16] {
            for (m, n, k) in [
                (1, 1, 1),
                (3, 7, 9),
                (17, 13, 300),
                (33, 20, 513),
                (16, 6, 256),
                (40, 31, 77),
            ] {
                for block in [1, 5, 6, 12, 64] {
                    seed += 1;
                    let xb = random_bits(dt, m * k, 1.0, seed);
                    let wb = random_bits(dt, n * k, 1.0, seed + 7);
                    let mut xf = vec![0f32; m * k];
                    dt.widen(&xb, &mut xf);
                    let mut wf64 = vec![0f32; n * k];
                    dt.widen(&wb, &mut wf64);
                    let want: Vec<f64> = (0..n)
                        .flat_map(|r| {
                            let (xf, wf64) = (&xf, &wf64);
                            (0..m).map(move |i| {
                                (0..k)
                                    .map(|kk| xf[i * k + kk] as f64 * wf64[r * k + kk] as f64)
                                    .sum::<f64>()
                            })
                        })
                        .collect();
                    let d = GemmDims { m, n, k };
                    let xp = pack_x(m, k, &xf);
                    let tol = |w: f64| 1e-5 * (1.0 + (k as f64).sqrt()) + w.abs() * dt_ulp(dt);
                    // Both builds' tiles in f32 (yᵀ, [N, M]).
                    for portable in [false, true] {
                        let mut out = vec![f32::NAN; n * m];
                        for (task, o) in out.chunks_mut(block * m).enumerate() {
                            let rows = o.len() / m;
                            let mut wf = vec![f32::NAN; NR * KC];
                            let w = &wb[task * block * k..(task * block + rows) * k];
                            if portable {
                                task_tiles_generic::<Portable>(dt, m, k, &xp, w, &mut wf, o);
                            } else {
                                task_tiles(dt, m, k, &xp, w, &mut wf, o);
                            }
                        }
                        for (j, (g, w)) in out.iter().zip(&want).enumerate() {
                            assert!(
                                (*g as f64 - w).abs() <= tol(0.0),
                                "{dt} m {m} n {n} k {k} block {block} portable {portable} [{j}]: {g} vs {w}"
                            );
                        }
                    }
                    // The whole op: y [M, N], rounded once.
                    let mut y = vec![dt.poison(); m * n];
                    gemm(dt, d, &xf, &wb, &mut y, block);
                    for i in 0..m {
                        for r in 0..n {
                            let (g, w) = (dt.to_f32(y[i * n + r]) as f64, want[r * m + i]);
                            assert!(
                                (g - w).abs() <= tol(w),
                                "{dt} m {m} n {n} k {k} block {block} y[{i}, {r}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// One unit in the last place of the 16-bit type, relative.
    fn dt_ulp(dt: DType) -> f64 {
        match dt {
            DType::F16 => 1.0 / 1024.0,
            DType::Bf16 => 1.0 / 128.0,
        }
    }

    #[test]
    fn default_block_rows_is_a_multiple_of_the_tile() {
        for n in [1, 5, 6, 576, 960, 3072, 49152] {
            let b = default_block_rows(n);
            assert!(
                b.is_multiple_of(NR) && (NR..=DEFAULT_BLOCK_ROWS).contains(&b),
                "n {n}: {b}"
            );
        }
    }
}
