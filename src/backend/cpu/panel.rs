//! A linear's W in the layout the CPU GEMMs read, prepared once at load (issue #21 item 5), and
//! the one kernel that reads it at every M.
//!
//! Layout: W [N, K] is cut into panels of [`NP`] = 16 rows; panel p holds rows 16p..16p + 16
//! interleaved along K (`[K][16]`, rows past N zero), so one k of a panel is 32 contiguous
//! bytes: two vectors of eight 16-bit values. A task's W is then one sequential 16-bit stream
//! whatever M is. The row-major kernels had to widen W into an f32 copy per call with its rows
//! fetched 48 at a time (the GEMM: ~7 % of its tile samples after session 14's bursts) or read
//! four rows 2K bytes apart with software prefetches (the GEMV).
//!
//! Kernel: yᵀ's panel of 16 columns × 6 rows of x is a register tile of 12 accumulators; each
//! step loads the panel's two W vectors of one k and broadcasts 6 values of x against them
//! (12 FMAs). Past M = 6, x is widened and packed per call into panels of 6 rows interleaved
//! along K (`[K-block][⌈M/6⌉][kc][6]`, the six broadcasts one base register plus constant
//! offsets), and each K-block of a W panel is widened once into L1 (F16C / a shift for bf16)
//! for the ⌈M/6⌉ tiles that reuse it. K runs in the row-major GEMM's equal blocks
//! ([`super::gemm::k_block`]), the first block's sums stored, later ones added, in that GEMM's
//! order: past M = 6 the results are bit-identical to it. A panel's sums for every row of x
//! ([⌈M/6⌉·6, 16] f32, in L1 at M = 128) are rounded straight into the panel's 16 columns of
//! y (row-major y: no transposed write-back), or written transposed for the row-parallel
//! partial product ([`super::CpuBackend::gemm_partial`]).
//!
//! At M ≤ 6 (decode) W is read once: it is widened in the loads, prefetched a few KiB ahead,
//! and since one tile has too few accumulators to hide the FMA latency (two chains at M = 1),
//! K is also split over 2-4 interleaved accumulator sets, summed at the end.

use rayon::prelude::*;

use super::gemm::{k_block, YBase, YCols, KC_MAX};
use super::gemv::load_w;
use super::pool::{self, Rows};
use super::simd::{multiversion, narrow_generic, Vf32, LANES};
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Rows of W per panel (two vectors).
pub(super) const NP: usize = 2 * LANES;
/// Rows of x per tile: 6 × 2 accumulators leave 4 of the 16 vector registers for the two W
/// vectors and the broadcast.
const MP: usize = 6;

/// The values a panel-packed W of [N, K] holds (zero rows pad the last panel).
pub(super) fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(NP) * NP * k
}

/// `dst` (of [`packed_len`]) = W [N, K] row-major in panels; one rayon task per panel.
pub(super) fn pack(w: &[u16], n: usize, k: usize, dst: &mut [u16]) {
    debug_assert!(w.len() >= n * k && dst.len() == packed_len(n, k));
    if k == 0 {
        return;
    }
    dst.par_chunks_mut(NP * k).enumerate().for_each(|(p, panel)| {
        for r in 0..NP {
            let row = p * NP + r;
            if row < n {
                for (kk, &v) in w[row * k..(row + 1) * k].iter().enumerate() {
                    panel[kk * NP + r] = v;
                }
            } else {
                // +0.0 in f16 and bf16 alike: padding rows add nothing and are never stored.
                for kk in 0..k {
                    panel[kk * NP + r] = 0;
                }
            }
        }
    });
}

/// W [N, K] row-major from its panels (what `download` gives back).
pub(super) fn unpack(p: &[u16], n: usize, k: usize) -> Vec<u16> {
    let mut w = vec![0u16; n * k];
    for (row, out) in w.chunks_exact_mut(k.max(1)).enumerate().take(n) {
        let panel = &p[(row / NP) * NP * k..];
        for (kk, o) in out.iter_mut().enumerate() {
            *o = panel[kk * NP + row % NP];
        }
    }
    w
}

/// f32 scratch a task passes to [`panel_run`] for `xp`: the panel's sums ([mp, 16]) and, where
/// W is reused over several tiles (M > 6), one widened K-block of the panel ([KC_MAX, 16]).
/// Allocated (and zeroed) per task: at M = 1 the 16 KiB block was ~0.8 MB of memset per FFN1
/// call of ~0.2 ms, so it is left out there.
fn scratch_len(xp: &XPanels) -> usize {
    xp.mp * NP + if xp.m > MP { KC_MAX * NP } else { 0 }
}

/// Rows of W per task for the panel kernel: `rows` rounded up to whole panels.
pub(super) fn task_rows(rows: usize) -> usize {
    rows.max(1).next_multiple_of(NP)
}

/// x widened and packed: K-block after K-block, each `[⌈M/lanes⌉][len][lanes]`, rows past M
/// zero. Past one tile (M > 6) the lanes are [`MP`] = 6 and K runs in the row-major GEMM's
/// blocks; at M ≤ 6 (decode) the lanes are M and K is one block: x is then M plain rows
/// interleaved (at M = 1 the widened row itself, 2.3 KiB at K = 576, in L1), where 6 lanes
/// would read 6× the bytes of x per step beside W, and K-blocks only stop and restart the
/// accumulators of a tile that never reuses W.
pub(super) struct XPanels {
    m: usize,
    k: usize,
    /// M rounded up to whole panels.
    mp: usize,
    kc: usize,
    data: Vec<f32>,
}

/// Below this many values of x, packing runs on the calling thread: a decode step's x (M = 1)
/// is a few microseconds of work, less than waking the pool for a parallel pass.
const SERIAL_PACK: usize = 16 << 10;

std::thread_local! {
    /// The last packed x's storage, kept by the thread that packed it for its next GEMM: a
    /// fresh zeroed allocation per call was ~1.5 % of a 128-token prefill's samples in
    /// `memset` (ffn2's x is 0.8 MB), beside `malloc`'s consolidation of the freed blocks.
    static SPARE_X: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A buffer of `len` values whose contents are stale (the packing writes every one).
fn spare_x(len: usize) -> Vec<f32> {
    let mut v = SPARE_X.take();
    if v.len() < len {
        v.resize(len, 0.0);
    }
    v.truncate(len);
    v
}

impl Drop for XPanels {
    fn drop(&mut self) {
        SPARE_X.set(std::mem::take(&mut self.data));
    }
}

impl XPanels {
    pub(super) fn new(dt: DType, m: usize, k: usize, x: &[u16]) -> XPanels {
        let (lanes, kc) = if m <= MP {
            (m.max(1), k.max(1))
        } else {
            (MP, k_block(k))
        };
        let mp = m.next_multiple_of(lanes);
        // Every value is written below (rows past M as zeros), so stale contents are fine.
        let mut data = spare_x(mp * k);
        let mut panels = Vec::with_capacity(k.div_ceil(kc) * (mp / lanes));
        let mut rest = &mut data[..];
        let mut k0 = 0;
        while k0 < k {
            let len = kc.min(k - k0);
            for mb in 0..mp / lanes {
                let (panel, tail) = rest.split_at_mut(len * lanes);
                panels.push((k0, mb, panel));
                rest = tail;
            }
            k0 += len;
        }
        // The tile's rows widened side by side ([lanes][len], rows past M zero), then
        // interleaved with contiguous stores: scattering each row into the panel at a stride
        // of `lanes` values one store at a time was ~3 % of a prefill's samples.
        let fill = |rows: &mut Vec<f32>, (k0, mb, panel): (usize, usize, &mut [f32])| {
            let len = panel.len() / lanes;
            if lanes == 1 {
                super::simd::widen(dt, &x[mb * k + k0..mb * k + k0 + len], panel);
                return;
            }
            let rows = &mut rows[..lanes * len];
            for (lane, row) in rows.chunks_exact_mut(len).enumerate() {
                let r = mb * lanes + lane;
                if r < m {
                    super::simd::widen(dt, &x[r * k + k0..r * k + k0 + len], row);
                } else {
                    row.fill(0.0);
                }
            }
            interleave(lanes, rows, panel);
        };
        let rows = || vec![0f32; lanes * kc];
        if m * k <= SERIAL_PACK {
            let mut row = rows();
            panels.into_iter().for_each(|p| fill(&mut row, p));
        } else {
            pool::for_row_blocks_mut(&mut panels, 1, |_, block| {
                let mut row = rows();
                for (k0, mb, panel) in block {
                    fill(&mut row, (*k0, *mb, &mut **panel));
                }
            });
        }
        XPanels { m, k, mp, kc, data }
    }

    fn block(&self, k0: usize, len: usize) -> &[f32] {
        &self.data[k0 * self.mp..(k0 + len) * self.mp]
    }
}

/// `panel` ([len][lanes]) = `rows` ([lanes][len]) transposed; the tile's six lanes unrolled.
fn interleave(lanes: usize, rows: &[f32], panel: &mut [f32]) {
    let len = panel.len() / lanes;
    if lanes == MP {
        let r: [&[f32]; MP] = std::array::from_fn(|i| &rows[i * len..(i + 1) * len]);
        let (steps, _) = panel.as_chunks_mut::<MP>();
        for (kk, s) in steps.iter_mut().enumerate().take(len) {
            *s = [r[0][kk], r[1][kk], r[2][kk], r[3][kk], r[4][kk], r[5][kk]];
        }
        return;
    }
    for (kk, s) in panel.chunks_exact_mut(lanes).enumerate() {
        for (lane, v) in s.iter_mut().enumerate() {
            *v = rows[lane * len + kk];
        }
    }
}

/// Where a panel's sums go.
enum Out<'a, 'y> {
    /// Rounded into the panel's columns of y [M, N].
    Y(&'a mut YCols<'y>),
    /// f32, transposed: the panel's rows of yᵀ ([cols, M]).
    Wide(&'a mut [f32]),
}

/// y [M, N] = narrow(x · Wᵀ) with W in panels (`wp`, [`packed_len`]); `rows_per_task` a
/// multiple of [`NP`].
pub(super) fn gemm(dt: DType, d: GemmDims, x: &[u16], wp: &[u16], y: &mut [u16], rows_per_task: usize) {
    let (m, n, k) = (d.m, d.n, d.k);
    let y = &mut y[..m * n];
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(dt.from_f32(0.0));
        return;
    }
    let xp = XPanels::new(dt, m, k, &x[..m * k]);
    let per = task_rows(rows_per_task) / NP;
    let y_all = YBase::new(y, m, n);
    pool::for_each(n.div_ceil(NP).div_ceil(per), &|task| {
        with_scratch(scratch_len(&xp), |acc| {
            for p in task * per..((task + 1) * per).min(n.div_ceil(NP)) {
                let cols = NP.min(n - p * NP);
                // SAFETY: panel p's columns belong to this task alone (the tasks' runs of
                // panels are disjoint), and nothing else touches y until the loop ends.
                let mut yc = unsafe { y_all.cols(p * NP, cols) };
                panel_run(dt, &xp, &wp[p * NP * k..(p + 1) * NP * k], acc, &mut Out::Y(&mut yc));
            }
        })
    });
}

std::thread_local! {
    /// Each worker's task scratch, kept between tasks and calls (a zeroed 25 KiB per task was
    /// about as many bytes of `memset` per layer as packing x).
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `f` on this thread's scratch of at least `len` values, contents stale: [`panel_run`] stores
/// every sum before it reads one and widens W's block before the tiles read it.
fn with_scratch(len: usize, f: impl FnOnce(&mut [f32])) {
    let mut v = SCRATCH.take();
    if v.len() < len {
        v.resize(len, 0.0);
    }
    f(&mut v[..len]);
    SCRATCH.set(v);
}

/// out_t [N, M] = x · Wᵀ in f32, not rounded, with W in panels (the row-parallel partial).
pub(super) fn gemm_wide(dt: DType, d: GemmDims, x: &[u16], wp: &[u16], out_t: &mut [f32], rows_per_task: usize) {
    let (m, n, k) = (d.m, d.n, d.k);
    let out_t = &mut out_t[..n * m];
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out_t.fill(0.0);
        return;
    }
    let xp = XPanels::new(dt, m, k, &x[..m * k]);
    let rows = task_rows(rows_per_task);
    let len = out_t.len();
    let outs = Rows::new(out_t, 1);
    pool::for_each(len.div_ceil(rows * m), &|task| {
        // SAFETY: task t's rows of out_t are its alone (the tasks' runs are disjoint).
        let out = unsafe { outs.span(task * rows * m, ((task + 1) * rows * m).min(len)) };
        with_scratch(scratch_len(&xp), |acc| {
            for (i, o) in out.chunks_mut(NP * m).enumerate() {
                let p = task * rows / NP + i;
                panel_run(dt, &xp, &wp[p * NP * k..(p + 1) * NP * k], acc, &mut Out::Wide(o));
            }
        })
    });
}

multiversion! {
    /// One panel of W (`wp`, [K][16]) against every row of x: the sums in `acc` ([mp, 16]),
    /// then written to `out`.
    fn panel_run(dt: DType, xp: &XPanels, wp: &[u16], acc: &mut [f32], out: &mut Out<'_, '_>) => panel_run_generic
}

#[inline(always)]
fn panel_run_generic<V: Vf32>(dt: DType, xp: &XPanels, wp: &[u16], acc: &mut [f32], out: &mut Out<'_, '_>) {
    match dt {
        DType::F16 => panel_sums::<V, false>(xp, wp, acc),
        DType::Bf16 => panel_sums::<V, true>(xp, wp, acc),
    }
    let m = xp.m;
    match out {
        Out::Y(y) => {
            let cols = y.rows;
            for i in 0..m {
                narrow_generic::<V>(dt, &acc[i * NP..i * NP + cols], y.row(i));
            }
        }
        Out::Wide(o) => {
            let cols = o.len() / m;
            for (c, line) in o.chunks_exact_mut(m).enumerate().take(cols) {
                for (i, v) in line.iter_mut().enumerate() {
                    *v = acc[i * NP + c];
                }
            }
        }
    }
}

#[inline(always)]
fn panel_sums<V: Vf32, const BF16: bool>(xp: &XPanels, wp: &[u16], scratch: &mut [f32]) {
    let (m, k) = (xp.m, xp.k);
    let (acc, wf) = scratch.split_at_mut(xp.mp * NP);
    let dt = if BF16 { DType::Bf16 } else { DType::F16 };
    let mut k0 = 0;
    while k0 < k {
        let kc = xp.kc.min(k - k0);
        let first = k0 == 0;
        let xb = xp.block(k0, kc);
        let wb = &wp[k0 * NP..(k0 + kc) * NP];
        // What follows this block in memory: the panel's next K-block, or the next panel's
        // first (a task's panels are contiguous); past the task's end the prefetches are
        // wasted but harmless (`wrapping_add`: the address may lie past `wp`).
        let next = wb.as_ptr().wrapping_add(kc * NP);
        if m <= MP {
            // One tile for all of x, W read once: K is also split over interleaved accumulator
            // sets (see the module comment) and W is prefetched a few KiB ahead inside the
            // loop (the hardware prefetcher alone left a DRAM-bound GEMV at ~14 GB/s where
            // the row-major GEMV with its software prefetches streamed ~23: ffn1 at M = 1).
            let out = &mut acc[..m * NP];
            let t = (kc, first);
            match m {
                6 => tile::<V, BF16, 6, 1>(t, xb, wb, out),
                5 => tile::<V, BF16, 5, 2>(t, xb, wb, out),
                4 => tile::<V, BF16, 4, 2>(t, xb, wb, out),
                3 => tile::<V, BF16, 3, 2>(t, xb, wb, out),
                2 => tile::<V, BF16, 2, 3>(t, xb, wb, out),
                _ => tile::<V, BF16, 1, 4>(t, xb, wb, out),
            }
            k0 += kc;
            continue;
        }
        let tiles = xb.len() / (kc * MP);
        // Lines of the next block to prefetch per tile: spread over the tiles that reuse this
        // block.
        let per_tile = (kc * NP / 32).div_ceil(tiles.max(1));
        // W is reused over several tiles: its block is widened once into L1 and the tiles
        // read f32 (two plain loads a step). Widening in every tile's loads cost two
        // `vcvtph2ps` per step, ⌈M/6⌉ times over (22 at M = 128), beside the FMAs.
        V::widen(dt, wb, &mut wf[..kc * NP]);
        let wf = &wf[..kc * NP];
        for (mb, panel) in xb.chunks_exact(kc * MP).enumerate() {
            let out = &mut acc[mb * MP * NP..(mb + 1) * MP * NP];
            for line in mb * per_tile..((mb + 1) * per_tile).min(kc * NP / 32) {
                V::prefetch(next.wrapping_add(line * 32));
            }
            // The rows of x in this tile (zero rows past M are not computed), one accumulator
            // set: the order of the row-major GEMM.
            let t = (kc, first);
            match (m - mb * MP).min(MP) {
                6 => tile_f32::<V, 6>(t, panel, wf, out),
                5 => tile_f32::<V, 5>(t, panel, wf, out),
                4 => tile_f32::<V, 4>(t, panel, wf, out),
                3 => tile_f32::<V, 3>(t, panel, wf, out),
                2 => tile_f32::<V, 2>(t, panel, wf, out),
                _ => tile_f32::<V, 1>(t, panel, wf, out),
            }
        }
        k0 += kc;
    }
}

/// How far ahead of the step the small-M tiles prefetch W, in 16-bit values: 4 KiB, about
/// what the row-major GEMV's "next block of 4 rows" was at K = 576.
const PF_AHEAD: usize = 2048;

/// The tile of all M = R ≤ 6 rows of x × 16 columns, W widened in the loads: `panel` is x
/// ([kc][R]), `wb` the W panel ([kc][16]), `out` the panel's sums ([R][16]; stored on the
/// first K-block, added to on later ones). U interleaved accumulator sets take k, k + 1, …,
/// k + U − 1 in turn and are summed in order at the end. W is read once here: each step
/// prefetches it [`PF_AHEAD`] values ahead.
#[inline(always)]
fn tile<V: Vf32, const BF16: bool, const R: usize, const U: usize>(
    (kc, first): (usize, bool),
    panel: &[f32],
    wb: &[u16],
    out: &mut [f32],
) {
    let (xr, _) = panel.as_chunks::<R>();
    let (w8, _) = wb.as_chunks::<LANES>();
    // Bounds the compiler can see, so that the loop below runs without checks.
    let (xr, w8) = (&xr[..kc], &w8[..2 * kc]);
    let ahead = wb.as_ptr().wrapping_add(PF_AHEAD);
    let mut c = [[[V::zero(); 2]; R]; U];
    let mut kk = 0;
    while kk + U <= kc {
        // One prefetch per 64-byte line (two steps of the panel) of the steps just read
        // (at U = 1, one per step).
        for u in (0..U).step_by(2) {
            V::prefetch(ahead.wrapping_add((kk + u) * NP));
        }
        for (u, cu) in c.iter_mut().enumerate() {
            let w0 = load_w::<V, BF16>(&w8[2 * (kk + u)]);
            let w1 = load_w::<V, BF16>(&w8[2 * (kk + u) + 1]);
            let xs = &xr[kk + u];
            for (i, ci) in cu.iter_mut().enumerate() {
                let xv = V::splat(xs[i]);
                ci[0] = w0.madd(xv, ci[0]);
                ci[1] = w1.madd(xv, ci[1]);
            }
        }
        kk += U;
    }
    // The ragged end (K not a multiple of U), into the first set.
    while kk < kc {
        let w0 = load_w::<V, BF16>(&w8[2 * kk]);
        let w1 = load_w::<V, BF16>(&w8[2 * kk + 1]);
        for i in 0..R {
            let xv = V::splat(xr[kk][i]);
            c[0][i][0] = w0.madd(xv, c[0][i][0]);
            c[0][i][1] = w1.madd(xv, c[0][i][1]);
        }
        kk += 1;
    }
    for i in 0..R {
        let mut s = c[0][i];
        for cu in c.iter().skip(1) {
            s[0] = s[0].add(cu[i][0]);
            s[1] = s[1].add(cu[i][1]);
        }
        let (o8, _) = out[i * NP..(i + 1) * NP].as_chunks_mut::<LANES>();
        for (o, v) in o8.iter_mut().zip(s) {
            if first {
                v.store(o);
            } else {
                V::load(o).add(v).store(o);
            }
        }
    }
}

/// [`tile`] with U = 1 over a K-block of the panel already widened (`wf`, [kc][16] f32).
#[inline(always)]
fn tile_f32<V: Vf32, const R: usize>((kc, first): (usize, bool), panel: &[f32], wf: &[f32], out: &mut [f32]) {
    let (x6, _) = panel.as_chunks::<MP>();
    let (w16, _) = wf.as_chunks::<NP>();
    let mut c = [[V::zero(); 2]; R];
    for (xs, w) in x6[..kc].iter().zip(&w16[..kc]) {
        let (w8, _) = w.as_chunks::<LANES>();
        let (w0, w1) = (V::load(&w8[0]), V::load(&w8[1]));
        for (i, ci) in c.iter_mut().enumerate() {
            let xv = V::splat(xs[i]);
            ci[0] = w0.madd(xv, ci[0]);
            ci[1] = w1.madd(xv, ci[1]);
        }
    }
    for (i, ci) in c.iter().enumerate() {
        let (o8, _) = out[i * NP..(i + 1) * NP].as_chunks_mut::<LANES>();
        for (o, v) in o8.iter_mut().zip(ci) {
            if first {
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

    fn want(dt: DType, m: usize, n: usize, k: usize, xb: &[u16], wb: &[u16]) -> Vec<f64> {
        let mut xf = vec![0f32; m * k];
        dt.widen(xb, &mut xf);
        let mut wf = vec![0f32; n * k];
        dt.widen(wb, &mut wf);
        (0..m)
            .flat_map(|i| {
                let (xf, wf) = (&xf, &wf);
                (0..n).map(move |r| {
                    (0..k)
                        .map(|kk| xf[i * k + kk] as f64 * wf[r * k + kk] as f64)
                        .sum::<f64>()
                })
            })
            .collect()
    }

    fn tol(dt: DType, k: usize, w: f64) -> f64 {
        let ulp = match dt {
            DType::F16 => 1.0 / 1024.0,
            DType::Bf16 => 1.0 / 128.0,
        };
        1e-5 * (1.0 + (k as f64).sqrt()) + w.abs() * ulp
    }

    #[test]
    fn pack_and_unpack_round_trip_at_odd_sizes() {
        for (n, k) in [(1, 1), (15, 3), (16, 7), (17, 9), (33, 1), (40, 65)] {
            let w: Vec<u16> = (0..n * k).map(|i| (i * 7919 % 65521) as u16).collect();
            let mut p = vec![0xFFFFu16; packed_len(n, k)];
            pack(&w, n, k, &mut p);
            assert_eq!(unpack(&p, n, k), w, "n {n} k {k}");
            // Padding rows are zeros.
            for (i, &v) in p.iter().enumerate() {
                if i / (NP * k) * NP + i % NP >= n {
                    assert_eq!(v, 0, "n {n} k {k} at {i}");
                }
            }
        }
    }

    /// Both builds' panel sums (every M-path: the one-tile paths of 1-6 rows with their split K
    /// and its ragged ends, and the widened-block tiles past M = 6), against f64 at odd M, N (partial last panel) and K (uneven K-blocks, ragged ends of
    /// the split K), with NaN-poisoned outputs; then the whole op's rounded y, and the wide
    /// (transposed f32) output.
    #[test]
    fn panel_gemm_matches_f64_at_odd_sizes_in_every_build() {
        let mut seed = 900;
        for dt in [DType::F16, DType::Bf16] {
            for (m, n, k) in [
                (1, 1, 1),
                (1, 17, 300),
                (1, 40, 131),
                (2, 7, 9),
                (2, 9, 100),
                (3, 16, 513),
                (4, 33, 77),
                (5, 20, 255),
                (6, 31, 600),
                (7, 13, 129),
                (17, 40, 300),
                (128, 50, 576),
                (130, 18, 1537),
            ] {
                seed += 1;
                let xb = random_bits(dt, m * k, 1.0, seed);
                let wb = random_bits(dt, n * k, 1.0, seed + 7);
                let want = want(dt, m, n, k, &xb, &wb);
                let mut wp = vec![dt.poison(); packed_len(n, k)];
                pack(&wb, n, k, &mut wp);
                let xp = XPanels::new(dt, m, k, &xb);
                for portable in [false, true] {
                    for p in 0..n.div_ceil(NP) {
                        let mut acc = vec![f32::NAN; scratch_len(&xp)];
                        let cols = NP.min(n - p * NP);
                        let mut o = vec![f32::NAN; cols * m];
                        let w = &wp[p * NP * k..(p + 1) * NP * k];
                        if portable {
                            panel_run_generic::<Portable>(dt, &xp, w, &mut acc, &mut Out::Wide(&mut o));
                        } else {
                            panel_run(dt, &xp, w, &mut acc, &mut Out::Wide(&mut o));
                        }
                        for c in 0..cols {
                            for i in 0..m {
                                let (g, w) = (o[c * m + i] as f64, want[i * n + p * NP + c]);
                                assert!(
                                    (g - w).abs() <= tol(dt, k, 0.0),
                                    "{dt} m {m} n {n} k {k} portable {portable} [{i}, {}]: {g} vs {w}",
                                    p * NP + c
                                );
                            }
                        }
                    }
                }
                for rows in [1, 16, 32, 48] {
                    let d = GemmDims { m, n, k };
                    let mut y = vec![dt.poison(); m * n];
                    gemm(dt, d, &xb, &wp, &mut y, rows);
                    let mut t = vec![f32::NAN; m * n];
                    gemm_wide(dt, d, &xb, &wp, &mut t, rows);
                    for i in 0..m {
                        for r in 0..n {
                            let w = want[i * n + r];
                            let g = dt.to_f32(y[i * n + r]) as f64;
                            assert!(
                                (g - w).abs() <= tol(dt, k, w),
                                "{dt} m {m} n {n} k {k} rows {rows} y[{i}, {r}]: {g} vs {w}"
                            );
                            let g = t[r * m + i] as f64;
                            assert!(
                                (g - w).abs() <= tol(dt, k, 0.0),
                                "{dt} m {m} n {n} k {k} rows {rows} yᵀ[{r}, {i}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// At M > 6 the panel kernel adds in the row-major GEMM's order: the same bits.
    #[test]
    fn panel_gemm_is_bit_identical_to_the_row_major_gemm_past_one_tile() {
        for dt in [DType::F16, DType::Bf16] {
            for (m, n, k) in [(7, 20, 300), (128, 48, 576), (33, 17, 1536)] {
                let xb = random_bits(dt, m * k, 1.0, 77);
                let wb = random_bits(dt, n * k, 1.0, 78);
                let mut wp = vec![0u16; packed_len(n, k)];
                pack(&wb, n, k, &mut wp);
                let d = GemmDims { m, n, k };
                let (mut a, mut b) = (vec![dt.poison(); m * n], vec![dt.poison(); m * n]);
                gemm(dt, d, &xb, &wp, &mut a, 32);
                super::super::gemm::gemm(dt, d, &xb, &wb, &mut b, 12);
                assert_eq!(a, b, "{dt} m {m} n {n} k {k}");
            }
        }
    }
}
