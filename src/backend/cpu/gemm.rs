//! ImplC `gemm` on the CPU: the general GEMM for large M (prefill), the CPU's stand-in for
//! cuBLAS, the path FlashDecoding++ §4 keeps for large M.
//!
//! A register-tiled, packed GEMM computing yᵀ = W · xᵀ:
//! - K is cut into blocks of at most [`KC_MAX`], of equal length (576 = 3 × 192, not 256 +
//!   256 + 64: a short last block pays the tile's set-up and write-back for few steps);
//! - x ([M, K], 16-bit) is widened and packed once per call, K-block by K-block, into panels
//!   of [`MR`] = 16 rows interleaved along K (`[K-block][⌈M/16⌉][kc][16]`, zero past M), so a
//!   step of the micro-kernel reads 16 values of one k with two vector loads and the sweep
//!   over a K-block's panels is one contiguous stream (the hardware prefetcher follows it);
//! - each task owns a run of rows of W; per K-block it widens [`WB`] = 48 rows of W at a time
//!   (F16C / shift) into an f32 chunk (≤ 48 KiB), then for each x panel (≤ 16 KiB, kept in
//!   L1) runs the chunk's strips of [`NR`] = 6 rows over it: a 6 × 16 tile of yᵀ lives in 12
//!   vector registers, each step broadcasts 6 values of W and does 12 FMAs against the two x
//!   vectors;
//! - the task's yᵀ block has rows padded to whole panels, so every tile is written back with
//!   whole vector stores.
//!
//! W is widened once per call (at M = 128 that is 1/128 of the multiply-adds), in bursts of 48
//! rows: widening each 6-row strip just before its tiles left the core waiting on its rows'
//! lines one strip at a time (session 14, reports/NOTES.md).

use super::simd::{multiversion, narrow, widen, Vf32, LANES};
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Rows of x per tile (two vectors).
const MR: usize = 2 * LANES;
/// Rows of W per tile: 6 × 2 accumulators leave 4 of the 16 vector registers for the two x
/// vectors and the broadcast.
const NR: usize = 6;
/// The longest K-block: a 16 × 256 panel of x is 16 KiB (L1 is 32 KiB), the 6 × 256 strip of
/// W 6 KiB.
pub(super) const KC_MAX: usize = 256;

/// The most rows of W per task (a multiple of [`NR`]).
pub(super) const DEFAULT_BLOCK_ROWS: usize = 42 * NR;

/// Rows of W per task when the spec names none: about 8 tasks per thread (a thread slowed by
/// another process is made up for by the others), a multiple of [`NR`], at most
/// [`DEFAULT_BLOCK_ROWS`].
pub(super) fn default_block_rows(n: usize) -> usize {
    let threads = super::pool::threads();
    n.div_ceil(8 * threads)
        .next_multiple_of(NR)
        .clamp(NR, DEFAULT_BLOCK_ROWS)
}

/// The K-block length for K: the fewest blocks of at most [`KC_MAX`], of equal length rounded
/// up to a multiple of 8 (still at most [`KC_MAX`], which is one); the last block takes what is
/// left.
pub(super) fn k_block(k: usize) -> usize {
    let blocks = k.div_ceil(KC_MAX).max(1);
    k.div_ceil(blocks).next_multiple_of(8).min(KC_MAX)
}

/// y [M, N] = narrow(x · Wᵀ); `x` holds at least M·K values, `w` at least N·K.
///
/// Each task computes its rows of W into a task-local yᵀ block ([rows, ⌈M/16⌉·16] f32, still
/// in L2 when it ends) and rounds it transposed straight into its own columns of y. (Rounding a
/// whole [N, M] yᵀ transposed afterwards read it column-wise from L3 and took ~11 % of a
/// 512-token prefill; rounding into task-local [M, rows] blocks and copying the rows of y
/// together in another parallel pass cost a third phase per call and a copy of y.)
pub(super) fn gemm(dt: DType, d: GemmDims, x: &[u16], w: &[u16], y: &mut [u16], block_rows: usize) {
    let (m, n, k) = (d.m, d.n, d.k);
    let y = &mut y[..m * n];
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(dt.from_f32(0.0));
        return;
    }
    let xp = Packed::new(dt, m, k, &x[..m * k]);
    let block_rows = block_rows.max(1);
    let mp = xp.mp;
    let y_all = YBase::new(y, m, n);
    super::pool::for_each(n.div_ceil(block_rows), &|task| {
        let mut wf = vec![0f32; WF_LEN];
        let n0 = task * block_rows;
        let rows = block_rows.min(n - n0);
        let mut out = vec![0f32; rows * mp];
        task_tiles(dt, &xp, &w[n0 * k..(n0 + rows) * k], &mut wf, &mut out);
        // SAFETY: task `task` alone takes columns n0..n0 + rows (the tasks' runs of rows of W
        // are disjoint), and nothing else touches y until the loop ends.
        let mut cols = unsafe { y_all.cols(n0, rows) };
        narrow_block(dt, m, &out, &mut cols);
    });
}

/// y ([M, N], borrowed mutably for the whole parallel loop) shared by the tasks, each of which
/// writes only its own run of columns of every row.
pub(super) struct YBase<'y> {
    ptr: *mut u16,
    m: usize,
    n: usize,
    _y: std::marker::PhantomData<&'y mut [u16]>,
}

// SAFETY: a YBase only hands out column runs through the `unsafe` [`YBase::cols`], whose
// callers guarantee that no two live runs overlap; u16 is Send.
unsafe impl Send for YBase<'_> {}
unsafe impl Sync for YBase<'_> {}

impl<'y> YBase<'y> {
    pub(super) fn new(y: &'y mut [u16], m: usize, n: usize) -> Self {
        assert!(y.len() >= m * n);
        YBase {
            ptr: y.as_mut_ptr(),
            m,
            n,
            _y: std::marker::PhantomData,
        }
    }

    /// Columns n0..n0 + rows of every row.
    ///
    /// # Safety
    /// No two [`YCols`] alive at the same time may share a column.
    pub(super) unsafe fn cols(&self, n0: usize, rows: usize) -> YCols<'_> {
        assert!(n0 + rows <= self.n);
        YCols { y: self, n0, rows }
    }
}

/// One task's columns of y.
pub(super) struct YCols<'a> {
    y: &'a YBase<'a>,
    n0: usize,
    /// How many columns (rows of W).
    pub(super) rows: usize,
}

impl YCols<'_> {
    /// Row i's run of the columns.
    pub(super) fn row(&mut self, i: usize) -> &mut [u16] {
        assert!(i < self.y.m);
        // SAFETY: i < M and n0 + rows ≤ N (checked in `cols`), so the run lies inside y, which
        // outlives `self`; no other YCols shares these columns (the contract of `cols`), and
        // `&mut self` keeps two runs of this one from being alive together.
        unsafe { std::slice::from_raw_parts_mut(self.y.ptr.add(i * self.y.n + self.n0), self.rows) }
    }
}

/// Columns of y = narrow(out [rows, mp]ᵀ) for the M rows, 16 rows of y at a time: each line of
/// `out` (16 columns of one row) is read once and scattered into a [16, rows] f32 block, whose
/// rows are then rounded with the vector narrowing. Gathering one row of y at a time read `out`
/// at a stride of mp · 4 bytes (512 at M = 128), which maps to 8 of L1's 64 sets (that gather
/// was ~10 % of an FFN1 task on one thread).
fn narrow_block(dt: DType, m: usize, out: &[f32], y: &mut YCols) {
    let rows = y.rows;
    let mp = out.len() / rows.max(1);
    let mut tmp = vec![0f32; MR * rows];
    for i0 in (0..m).step_by(MR) {
        let cols = MR.min(m - i0);
        for (r, line) in out.chunks_exact(mp).enumerate() {
            for (j, &v) in line[i0..i0 + cols].iter().enumerate() {
                tmp[j * rows + r] = v;
            }
        }
        for (j, t) in tmp.chunks_exact(rows).take(cols).enumerate() {
            narrow(dt, t, y.row(i0 + j));
        }
    }
}

/// x widened and packed: K-block after K-block, each `[⌈M/16⌉][len][16]` (`len` the block's
/// length), rows past M zero.
struct Packed {
    k: usize,
    /// M rounded up to whole panels.
    mp: usize,
    /// The K-block length (the last block may be shorter).
    kc: usize,
    data: Vec<f32>,
}

impl Packed {
    /// One task per panel of each K-block; each row of x is widened a K-block at a time (F16C
    /// where the CPU has it) and scattered into its lane.
    fn new(dt: DType, m: usize, k: usize, x: &[u16]) -> Packed {
        let (mp, kc) = (m.next_multiple_of(MR), k_block(k));
        let mut data = vec![0f32; mp * k];
        // Cut the buffer into its panels in order: block by block, panel by panel.
        let mut panels = Vec::with_capacity(k.div_ceil(kc) * (mp / MR));
        let mut rest = &mut data[..];
        let mut k0 = 0;
        while k0 < k {
            let len = kc.min(k - k0);
            for mb in 0..mp / MR {
                let (panel, tail) = rest.split_at_mut(len * MR);
                panels.push((k0, mb, panel));
                rest = tail;
            }
            k0 += len;
        }
        super::pool::for_row_blocks_mut(&mut panels, 1, |_, block| {
            let mut row = vec![0f32; kc];
            for (k0, mb, panel) in block {
                let (k0, mb) = (*k0, *mb);
                let len = panel.len() / MR;
                for lane in 0..MR.min(m - mb * MR) {
                    let at = (mb * MR + lane) * k + k0;
                    widen(dt, &x[at..at + len], &mut row[..len]);
                    for (kk, &v) in row[..len].iter().enumerate() {
                        panel[kk * MR + lane] = v;
                    }
                }
            }
        });
        Packed { k, mp, kc, data }
    }

    /// The panels of the K-block starting at `k0`, `len` long, one after another.
    fn block(&self, k0: usize, len: usize) -> &[f32] {
        &self.data[k0 * self.mp..(k0 + len) * self.mp]
    }
}

multiversion! {
    /// out[r, i] = x_i · w_r for the rows r of `w_rows` ([rows, K]) and every row i of x;
    /// `out` is [rows, ⌈M/16⌉·16] (the padding columns get zeros' products), `wf` scratch of
    /// [`WF_LEN`].
    fn task_tiles(dt: DType, xp: &Packed, w_rows: &[u16], wf: &mut [f32], out: &mut [f32]) => task_tiles_generic
}

/// Rows of W widened together: 8 strips. Widening one strip just before its tiles left the
/// core waiting on each of its 6 rows' lines from L3 or DRAM in turn (software prefetches of
/// the next strip did not hide it: with W's widening skipped, the tiles of an FFN1 task ran
/// ~25 % faster); a burst of 48 independent rows keeps many misses in flight, and the
/// 48 × 256 × 4 = 48 KiB of f32 it writes stay in L2 while the x panels pass.
const WB: usize = 8 * NR;
/// Scratch for [`task_tiles`]: WB rows of one K-block.
pub(super) const WF_LEN: usize = WB * KC_MAX;

#[inline(always)]
fn task_tiles_generic<V: Vf32>(dt: DType, xp: &Packed, w_rows: &[u16], wf: &mut [f32], out: &mut [f32]) {
    let (k, mp) = (xp.k, xp.mp);
    let rows = w_rows.len() / k;
    let mut k0 = 0;
    while k0 < k {
        let kc = xp.kc.min(k - k0);
        let first = k0 == 0;
        let xb = xp.block(k0, kc);
        let mut r0 = 0;
        while r0 < rows {
            // Widen up to WB rows of this K-block, at a constant stride of KC_MAX (so that the
            // tile's six broadcasts address one base register plus constant offsets; at a
            // stride of kc the compiler ran out of registers for six row pointers and reloaded
            // two of them from the stack in every step).
            let wb = WB.min(rows - r0);
            for (i, dst) in wf[..wb * KC_MAX].chunks_exact_mut(KC_MAX).enumerate() {
                let at = (r0 + i) * k + k0;
                V::widen(dt, &w_rows[at..at + kc], &mut dst[..kc]);
            }
            // The next chunk's rows of W (the next WB rows of this K-block, or the first WB of
            // the next K-block), NR rows per x panel, one prefetch per 64-byte line: fetched
            // from memory while this chunk's tiles run, so that its widening above does not
            // wait on them (in a whole-model prefill W comes from DRAM, and the burst of 48
            // rows still waited there: ~15 % of the task's samples were in the widening).
            let (next_r0, next_k0) = if r0 + wb < rows { (r0 + wb, k0) } else { (0, k0 + kc) };
            let next_kc = xp.kc.min(k.saturating_sub(next_k0));
            for (mb, panel) in xb.chunks_exact(kc * MR).enumerate() {
                let ahead = next_r0 + mb * NR;
                if next_kc > 0 && mb * NR < WB {
                    for i in ahead..(ahead + NR).min(rows).min(next_r0 + WB) {
                        let at = i * k + next_k0;
                        for c in (0..next_kc).step_by(32) {
                            V::prefetch(w_rows[at + c..].as_ptr());
                        }
                    }
                }
                let t = Tile {
                    kc,
                    mp,
                    m0: mb * MR,
                    first,
                };
                let mut r = 0;
                while r < wb {
                    let nr = NR.min(wb - r);
                    let strip = &wf[r * KC_MAX..(r + nr) * KC_MAX];
                    let out_rows = &mut out[(r0 + r) * mp..(r0 + r + nr) * mp];
                    match nr {
                        6 => tile::<V, 6>(t, panel, strip, out_rows),
                        5 => tile::<V, 5>(t, panel, strip, out_rows),
                        4 => tile::<V, 4>(t, panel, strip, out_rows),
                        3 => tile::<V, 3>(t, panel, strip, out_rows),
                        2 => tile::<V, 2>(t, panel, strip, out_rows),
                        _ => tile::<V, 1>(t, panel, strip, out_rows),
                    }
                    r += nr;
                }
            }
            r0 += wb;
        }
        k0 += kc;
    }
}

/// Where a tile lies: K-block length, the row length of the yᵀ block, the first column, and
/// whether this is the first K-block (write) or a later one (add).
#[derive(Clone, Copy)]
struct Tile {
    kc: usize,
    mp: usize,
    m0: usize,
    first: bool,
}

/// The R × 16 register tile over one K-block: `wf` holds R widened rows of W at stride KC_MAX,
/// `panel` the K-block's 16-wide x panel, `out` the R rows of the yᵀ block.
#[inline(always)]
fn tile<V: Vf32, const R: usize>(t: Tile, panel: &[f32], wf: &[f32], out: &mut [f32]) {
    let kc = t.kc;
    let (p16, _) = panel.as_chunks::<MR>();
    let w: [&[f32]; R] = std::array::from_fn(|i| &wf[i * KC_MAX..i * KC_MAX + kc]);
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
        let (o8, _) = out[i * t.mp + t.m0..i * t.mp + t.m0 + MR].as_chunks_mut::<LANES>();
        for (o, v) in o8.iter_mut().zip(ci) {
            if t.first {
                v.store(o);
            } else {
                V::load(o).add(*v).store(o);
            }
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
                (130, 50, 600),
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
                    let xp = Packed::new(dt, m, k, &xb);
                    let mp = xp.mp;
                    let tol = |w: f64| 1e-5 * (1.0 + (k as f64).sqrt()) + w.abs() * dt_ulp(dt);
                    // Both builds' tiles in f32 (yᵀ blocks, [rows, ⌈M/16⌉·16]).
                    for portable in [false, true] {
                        let mut out = vec![f32::NAN; n * mp];
                        for (task, o) in out.chunks_mut(block * mp).enumerate() {
                            let rows = o.len() / mp;
                            let mut wf = vec![f32::NAN; WF_LEN];
                            let w = &wb[task * block * k..(task * block + rows) * k];
                            if portable {
                                task_tiles_generic::<Portable>(dt, &xp, w, &mut wf, o);
                            } else {
                                task_tiles(dt, &xp, w, &mut wf, o);
                            }
                        }
                        for r in 0..n {
                            for i in 0..m {
                                let (g, w) = (out[r * mp + i], want[r * m + i]);
                                assert!(
                                    (g as f64 - w).abs() <= tol(0.0),
                                    "{dt} m {m} n {n} k {k} block {block} portable {portable} [{r}, {i}]: {g} vs {w}"
                                );
                            }
                        }
                    }
                    // The whole op: y [M, N], rounded once.
                    let mut y = vec![dt.poison(); m * n];
                    gemm(dt, d, &xb, &wb, &mut y, block);
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
    fn k_blocks_are_equal_and_at_most_kc_max() {
        for k in [1, 7, 8, 255, 256, 257, 576, 600, 1536, 4096, 11008] {
            let kc = k_block(k);
            let blocks = k.div_ceil(kc);
            assert!(
                kc <= KC_MAX && kc.is_multiple_of(8) && blocks == k.div_ceil(KC_MAX),
                "k {k}: {kc}"
            );
        }
        assert_eq!(k_block(576), 192);
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
