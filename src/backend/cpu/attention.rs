//! CPU attention over the paged KV cache, with the structure the GPU kernels have (so that the
//! schemes, the split/combine arithmetic and the recompute rule are exercised without a GPU):
//!
//! - decode is split-KV (Flash-Decoding): one task per (sequence, kv head, split) serves the
//!   whole GQA head group, producing one partial (m, l, acc) per query head; a combine step
//!   merges the splits of each row;
//! - prefill writes the new K and V into the pools, then one task per new token attends
//!   causally, walking the keys in tiles of [`TILE`] as a FlashAttention-2 block does;
//! - `sync`: running max, partial sums rescaled when it grows (within a split, tile by tile, and
//!   again in the combine); `async` (FlashDecoding++ §3): every term is e^(x−φ), no max and no
//!   rescale, the combine is a plain sum, and rows that leave [a, b] are recomputed with `sync`.
//!
//! Accumulation is fp32 throughout; q is pre-multiplied by 1/√d once.

use std::ops::Range;

use super::pool;

use super::simd::{self, multiversion, Vf32, LANES};
use crate::dtype::DType;
use crate::error::Result;
use crate::kv::paged::{write_tokens, PagedKvLayout};
use crate::ops::attention::{num_splits, AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};

/// Keys per tile: the sync scheme updates its running max once per tile (as a GPU block does
/// per KV tile), not per key.
pub const TILE: usize = 32;

/// Query tokens per prefill task: 8 tokens × every head share each widened tile of keys, and a
/// 128-token prompt still gives 16 tasks to balance over the threads (causal: later blocks
/// read more keys).
const PREFILL_BLOCK: usize = 8;

/// Partial softmax state of one row over one range of keys.
#[derive(Clone, Debug)]
struct Partial {
    /// The reference the terms are taken against: the running max (sync) or φ (async).
    m: f32,
    /// Σ e^(x − m).
    l: f32,
    /// Σ e^(x − m) · v.
    acc: Vec<f32>,
    /// Largest score seen (async flag test).
    max_x: f32,
    /// Some x − φ > b was met (async).
    over: bool,
}

impl Partial {
    fn empty(d: usize, m: f32) -> Self {
        Partial {
            m,
            l: 0.0,
            acc: vec![0.0; d],
            max_x: f32::NEG_INFINITY,
            over: false,
        }
    }
}

/// Where the token rows of one sequence lie in a pool.
struct SeqView<'a> {
    layout: &'a PagedKvLayout,
    pages: &'a [i32],
}

impl SeqView<'_> {
    /// Token t's row: every kv head's head_dim run, which the layout stores contiguously.
    /// Tables are validated before any kernel runs, so every page lies in the pool.
    fn row<'p>(&self, pool: &'p [u16], t: usize) -> &'p [u16] {
        let l = self.layout;
        let page = self.pages[t / l.page_size] as usize;
        let at = l.offset(page, t % l.page_size, 0);
        &pool[at..at + l.token_elems()]
    }
}

multiversion! {
    /// Accumulates keys into `parts`, query rows of one sequence (every head; in prefill a
    /// block of consecutive tokens): part j takes keys `start..ends[j]` with its q row
    /// `qs[j·d..(j+1)·d]` (q · 1/√d in f32), reading columns `cols[j]..cols[j] + d` of the
    /// token rows `key(t)` / `val(t)` (all kv heads of a token; its kv head's run). The
    /// AVX2+FMA+F16C build where the CPU has it, the portable one otherwise.
    ///
    /// A tile of [`TILE`] whole token rows is widened to f32 once for all the parts (whole rows:
    /// one contiguous read per token, which the hardware prefetcher follows; one kv head's run
    /// per task left 2/3 of every line to other tasks and the widening waited on memory), the scores of eight keys
    /// at a time come from eight independent vector dot products reduced together, the weights
    /// e^(x − m) are taken eight at a time with the vector exp of simd.rs, and each part's
    /// accumulator takes the widened V rows of the tile in registers. With a scalar exp per key
    /// and K/V widened once per query head, attention was ~14 % of a SmolLM2-135M decode step and
    /// ~15 % of its prefill on 2 cores (reports/NOTES.md).
    #[allow(clippy::too_many_arguments)]
    fn accumulate<'a>(
        dt: DType,
        scheme: SoftmaxScheme,
        qs: &[f32],
        start: usize,
        ends: &[usize],
        cols: &[usize],
        key: &dyn Fn(usize) -> &'a [u16],
        val: &dyn Fn(usize) -> &'a [u16],
        parts: &mut [Partial],
        scratch: &mut Vec<f32>,
    ) => accumulate_generic
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn accumulate_generic<'a, V: Vf32>(
    dt: DType,
    scheme: SoftmaxScheme,
    qs: &[f32],
    start: usize,
    ends: &[usize],
    cols: &[usize],
    key: &dyn Fn(usize) -> &'a [u16],
    val: &dyn Fn(usize) -> &'a [u16],
    parts: &mut [Partial],
    scratch: &mut Vec<f32>,
) {
    let g = parts.len().min(ends.len()).min(cols.len());
    let stop = ends[..g].iter().copied().max().unwrap_or(start);
    if g == 0 || stop <= start {
        return;
    }
    let d = qs.len() / g;
    // Width of a token row (every kv head); parts read their kv head's run of it.
    let rw = key(start).len();
    // The tile's widened rows (K, then V), then each part's TILE scores / weights.
    scratch.resize(TILE * rw + g * TILE, 0.0);
    let (rows, xs) = scratch.split_at_mut(TILE * rw);
    let mut t0 = start;
    while t0 < stop {
        let t1 = (t0 + TILE).min(stop);
        let n = t1 - t0;
        // Keys of this tile that part j takes (0: its keys ended before the tile).
        let taken = |j: usize| ends[j].min(t1).saturating_sub(t0);
        for (i, t) in (t0..t1).enumerate() {
            V::widen(dt, key(t), &mut rows[i * rw..(i + 1) * rw]);
        }
        // Parts side by side that read the same kv head's run and take the same keys of this
        // tile (the query heads of a GQA group for one token) go through the grouped tiles,
        // which load each key / value row once for all of them.
        let mut j = 0;
        while j < g {
            let nj = taken(j);
            let r = group_len(j, g, |i| (cols[i], taken(i)));
            if nj > 0 {
                let kv = Strided {
                    rows: &rows[..nj * rw],
                    stride: rw,
                    col: cols[j],
                };
                let x = &mut xs[j * TILE..(j + r) * TILE];
                let q = &qs[j * d..(j + r) * d];
                match r {
                    3 => scores_group::<V, 3>(q, kv, x, nj),
                    2 => scores_group::<V, 2>(q, kv, x, nj),
                    _ => scores::<V>(q, kv, &mut x[..nj]),
                }
                for (p, x) in parts[j..j + r].iter_mut().zip(x.chunks_exact_mut(TILE)) {
                    weigh::<V>(scheme, p, x, nj);
                }
            }
            j += r;
        }
        for (i, t) in (t0..t1).enumerate() {
            V::widen(dt, val(t), &mut rows[i * rw..(i + 1) * rw]);
        }
        let mut j = 0;
        while j < g {
            let nj = taken(j);
            let r = group_len(j, g, |i| (cols[i], taken(i)));
            let kv = Strided {
                rows: &rows[..nj * rw],
                stride: rw,
                col: cols[j],
            };
            let w = &xs[j * TILE..(j + r) * TILE];
            match r {
                3 => weighted_rows_group::<V, 3>(w, nj, kv, &mut parts[j..j + 3]),
                2 => weighted_rows_group::<V, 2>(w, nj, kv, &mut parts[j..j + 2]),
                _ => weighted_rows::<V>(&w[..nj], kv, &mut parts[j].acc),
            }
            j += r;
        }
        debug_assert!(n <= TILE);
        t0 = t1;
    }
}

/// Most parts one grouped tile serves: 3 parts × 4 keys (scores) or × 4 runs of eight lanes
/// (values) are 12 accumulators, which with the 3 q runs / weights and one key / value run
/// fill AVX2's 16 registers. SmolLM2's GQA groups are 3 heads; larger groups go 3 at a time.
const GROUP: usize = 3;

/// How many parts from `j` on (at most [`GROUP`]) share `key(j)`: the same kv head's run and
/// the same keys of the tile.
#[inline(always)]
fn group_len<K: PartialEq>(j: usize, g: usize, key: impl Fn(usize) -> K) -> usize {
    let k = key(j);
    (1..GROUP.min(g - j))
        .find(|&r| key(j + r) != k)
        .unwrap_or(GROUP.min(g - j))
}

/// One part's scores of a tile, `x[..nj]`, become its weights e^(x − m) in place (sync: the
/// running max first grows, and what was summed is rescaled; async: against φ, flagging a
/// score past b), and their sum joins `p.l`. `x` is the part's whole tile chunk: the lanes
/// past nj up to the next multiple of eight are computed too and never read.
#[inline(always)]
fn weigh<V: Vf32>(scheme: SoftmaxScheme, p: &mut Partial, x: &mut [f32], nj: usize) {
    let tile_max = x[..nj].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    p.max_x = p.max_x.max(tile_max);
    match scheme {
        SoftmaxScheme::Sync => {
            if tile_max > p.m {
                // The running max grew: rescale what was summed against the old one.
                let f = (p.m - tile_max).exp();
                p.l *= f;
                p.acc.iter_mut().for_each(|a| *a *= f);
                p.m = tile_max;
            }
        }
        SoftmaxScheme::Async { phi, b, .. } => {
            p.over |= tile_max - phi > b;
        }
    }
    // Eight lanes at a time over the whole chunks; their sum in a vector (a scalar sum of the
    // tile's weights, one dependent add per key, was ~8 % of attention in a 512-token
    // prefill's profile), the keys of a last partial chunk one at a time.
    let m = V::splat(p.m);
    let whole = nj / LANES;
    let (x8, _) = x[..nj.next_multiple_of(LANES)].as_chunks_mut::<LANES>();
    let mut sum = V::zero();
    for (ci, c) in x8.iter_mut().enumerate() {
        let e = V::load(c).sub(m).exp();
        e.store(c);
        if ci < whole {
            sum = sum.add(e);
        }
    }
    p.l += sum.hsum() + x[whole * LANES..nj].iter().sum::<f32>();
}

/// Rows of `stride` values, of which a part reads the run starting at `col` (its kv head's).
#[derive(Clone, Copy)]
struct Strided<'r> {
    rows: &'r [f32],
    stride: usize,
    col: usize,
}

impl<'r> Strided<'r> {
    #[inline(always)]
    fn row(&self, i: usize, d: usize) -> &'r [f32] {
        let at = i * self.stride + self.col;
        &self.rows[at..at + d]
    }

    /// The rows from row `i` on.
    #[inline(always)]
    fn skip(self, i: usize) -> Self {
        Strided {
            rows: &self.rows[i * self.stride..],
            ..self
        }
    }
}

/// x[i] = q · row i of `rows` (its run of d = q.len()): eight keys at a time, each its own chain of FMAs
/// over head_dim (so the FMA latency is hidden without splitting one dot product), the eight
/// sums reduced together into one vector; the keys past a multiple of eight one at a time.
#[inline(always)]
fn scores<V: Vf32>(q: &[f32], rows: Strided, x: &mut [f32]) {
    let d = q.len();
    let (q8, q_tail) = q.as_chunks::<LANES>();
    let dot_tail = |row: &[f32]| dot_tail::<V>(q, row);
    let (x8, x_rest) = x.as_chunks_mut::<LANES>();
    for (blk, xb) in x8.iter_mut().enumerate() {
        let r: [&[f32]; LANES] = std::array::from_fn(|j| rows.row(blk * LANES + j, d));
        let mut acc = [V::zero(); LANES];
        for (c, qc) in q8.iter().enumerate() {
            let qv = V::load(qc);
            for (a, row) in acc.iter_mut().zip(&r) {
                let (k8, _) = row.as_chunks::<LANES>();
                *a = qv.madd(V::load(&k8[c]), *a);
            }
        }
        V::hsum8(acc).store(xb);
        if !q_tail.is_empty() {
            for (xv, row) in xb.iter_mut().zip(&r) {
                *xv += dot_tail(row);
            }
        }
    }
    let done = x8.len() * LANES;
    for (i, xv) in x_rest.iter_mut().enumerate() {
        let row = rows.row(done + i, d);
        let (k8, _) = row.as_chunks::<LANES>();
        let mut a = V::zero();
        for (qc, kc) in q8.iter().zip(k8) {
            a = V::load(qc).madd(V::load(kc), a);
        }
        *xv = a.hsum() + dot_tail(row);
    }
}

/// q · row over the dims past the last multiple of eight (q.len() = d ≤ row.len()), one FMA
/// chain.
#[inline(always)]
fn dot_tail<V: Vf32>(q: &[f32], row: &[f32]) -> f32 {
    let t0 = q.len() - q.len() % LANES;
    let mut s = 0f32;
    for (a, b) in q[t0..].iter().zip(&row[t0..q.len()]) {
        s = V::madd1(*a, *b, s);
    }
    s
}

/// acc += Σ_i w[i] · row i of `rows` (its run of d = acc.len()): runs of eight lanes of acc
/// stay in registers over the whole tile, up to eight at once (head_dim 64 in one pass, 128 in
/// two), each its own chain of FMAs; the block sizes are constants so that the accumulators
/// are registers, not an array in memory.
#[inline(always)]
fn weighted_rows<V: Vf32>(w: &[f32], rows: Strided, acc: &mut [f32]) {
    let d = acc.len();
    let (a8, a_tail) = acc.as_chunks_mut::<LANES>();
    let mut c0 = 0;
    while c0 < a8.len() {
        c0 += match a8.len() - c0 {
            8.. => runs_block::<V, 8>(w, rows, d, c0, a8),
            4..=7 => runs_block::<V, 4>(w, rows, d, c0, a8),
            2 | 3 => runs_block::<V, 2>(w, rows, d, c0, a8),
            _ => runs_block::<V, 1>(w, rows, d, c0, a8),
        };
    }
    weighted_tail::<V>(w, rows, d, a_tail);
}

/// The lanes of acc past the last multiple of eight (`a_tail`, of a run of d): one FMA chain
/// each over the keys.
#[inline(always)]
fn weighted_tail<V: Vf32>(w: &[f32], rows: Strided, d: usize, a_tail: &mut [f32]) {
    let t0 = d - a_tail.len();
    for (j, a) in a_tail.iter_mut().enumerate() {
        for (i, &wi) in w.iter().enumerate() {
            *a = V::madd1(wi, rows.row(i, d)[t0 + j], *a);
        }
    }
}

/// NC runs of eight lanes of acc from run c0 on (see [`weighted_rows`]); returns NC.
#[inline(always)]
fn runs_block<V: Vf32, const NC: usize>(
    w: &[f32],
    rows: Strided,
    d: usize,
    c0: usize,
    a8: &mut [[f32; LANES]],
) -> usize {
    let mut a: [V; NC] = std::array::from_fn(|r| V::load(&a8[c0 + r]));
    for (i, &wi) in w.iter().enumerate() {
        let wv = V::splat(wi);
        let (v8, _) = rows.row(i, d).as_chunks::<LANES>();
        let v8 = &v8[c0..c0 + NC];
        for r in 0..NC {
            a[r] = wv.madd(V::load(&v8[r]), a[r]);
        }
    }
    for (r, v) in a.iter().enumerate() {
        v.store(&mut a8[c0 + r]);
    }
    NC
}

/// [`scores`] for R parts that read the same rows: part r's q run is `q[r·d..(r+1)·d]` and its
/// scores go to `x[r·TILE..r·TILE + nj]`. Four keys at a time × the R parts, so each loaded run
/// of a key row serves R FMAs (one part at a time loads 9 runs for 8 FMAs); each key's sum is
/// the same chain of FMAs and the same eight-key reduction as in [`scores`], so the scores
/// are bit-identical to it.
#[inline(always)]
fn scores_group<V: Vf32, const R: usize>(q: &[f32], rows: Strided, x: &mut [f32], nj: usize) {
    let d = q.len() / R;
    let qr: [&[f32]; R] = std::array::from_fn(|r| &q[r * d..(r + 1) * d]);
    let q8: [&[[f32; LANES]]; R] = std::array::from_fn(|r| qr[r].as_chunks::<LANES>().0);
    let tail = d % LANES;
    let blocks = nj / LANES;
    for blk in 0..blocks {
        let mut sums = [[V::zero(); LANES]; R];
        for half in 0..2 {
            let k0 = blk * LANES + half * 4;
            let r4: [&[[f32; LANES]]; 4] = std::array::from_fn(|i| rows.row(k0 + i, d).as_chunks::<LANES>().0);
            let mut acc = [[V::zero(); 4]; R];
            for c in 0..d / LANES {
                let qv: [V; R] = std::array::from_fn(|r| V::load(&q8[r][c]));
                for (i, row) in r4.iter().enumerate() {
                    let kv = V::load(&row[c]);
                    for r in 0..R {
                        acc[r][i] = qv[r].madd(kv, acc[r][i]);
                    }
                }
            }
            for r in 0..R {
                sums[r][half * 4..half * 4 + 4].copy_from_slice(&acc[r]);
            }
        }
        for r in 0..R {
            let xb = &mut x[r * TILE + blk * LANES..r * TILE + (blk + 1) * LANES];
            let xb: &mut [f32; LANES] = xb.try_into().expect("eight lanes");
            V::hsum8(sums[r]).store(xb);
            if tail > 0 {
                for (i, xv) in xb.iter_mut().enumerate() {
                    *xv += dot_tail::<V>(qr[r], rows.row(blk * LANES + i, d));
                }
            }
        }
    }
    // The keys past a multiple of eight one part at a time, as [`scores`] takes them.
    let done = blocks * LANES;
    if done < nj {
        for r in 0..R {
            scores::<V>(qr[r], rows.skip(done), &mut x[r * TILE + done..r * TILE + nj]);
        }
    }
}

/// [`weighted_rows`] for R parts that read the same rows: part r's weights are
/// `w[r·TILE..r·TILE + nj]`, its accumulator `parts[r].acc`. Four runs of eight lanes × the R
/// parts in registers, so each loaded run of a value row serves R FMAs; every lane is the same
/// chain of FMAs over the keys as in [`weighted_rows`], so the sums are bit-identical to it.
#[inline(always)]
fn weighted_rows_group<V: Vf32, const R: usize>(w: &[f32], nj: usize, rows: Strided, parts: &mut [Partial]) {
    let d = parts[0].acc.len();
    let runs = d / LANES;
    let mut c0 = 0;
    while c0 < runs {
        c0 += match runs - c0 {
            4.. => runs_group::<V, R, 4>(w, nj, rows, d, c0, parts),
            2 | 3 => runs_group::<V, R, 2>(w, nj, rows, d, c0, parts),
            _ => runs_group::<V, R, 1>(w, nj, rows, d, c0, parts),
        };
    }
    for (r, p) in parts.iter_mut().enumerate().take(R) {
        weighted_tail::<V>(&w[r * TILE..r * TILE + nj], rows, d, &mut p.acc[runs * LANES..]);
    }
}

/// NC runs of eight lanes from run c0 on, for R parts (see [`weighted_rows_group`]); returns NC.
#[inline(always)]
fn runs_group<V: Vf32, const R: usize, const NC: usize>(
    w: &[f32],
    nj: usize,
    rows: Strided,
    d: usize,
    c0: usize,
    parts: &mut [Partial],
) -> usize {
    let mut a: [[V; NC]; R] = std::array::from_fn(|r| {
        let (a8, _) = parts[r].acc.as_chunks::<LANES>();
        std::array::from_fn(|n| V::load(&a8[c0 + n]))
    });
    let wr: [&[f32]; R] = std::array::from_fn(|r| &w[r * TILE..r * TILE + nj]);
    // Key i indexes R weight runs and a value row at once; an index reads plainer than R zips.
    #[allow(clippy::needless_range_loop)]
    for i in 0..nj {
        let ws: [V; R] = std::array::from_fn(|r| V::splat(wr[r][i]));
        let (v8, _) = rows.row(i, d).as_chunks::<LANES>();
        let v8 = &v8[c0..c0 + NC];
        for n in 0..NC {
            let v = V::load(&v8[n]);
            for r in 0..R {
                a[r][n] = ws[r].madd(v, a[r][n]);
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        let (a8, _) = parts[r].acc.as_chunks_mut::<LANES>();
        for (n, v) in ar.iter().enumerate() {
            v.store(&mut a8[c0 + n]);
        }
    }
    NC
}

/// Merges split partials into (l, acc). Sync partials carry their own max and are rescaled to
/// the largest; async partials share φ and are summed. None: the row is flagged (async only).
fn combine(scheme: SoftmaxScheme, parts: &[&Partial], d: usize) -> Option<(f32, Vec<f32>)> {
    let mut acc = vec![0f32; d];
    match scheme {
        SoftmaxScheme::Sync => {
            let m = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.m));
            let mut l = 0f32;
            for p in parts.iter().filter(|p| p.l > 0.0) {
                let f = (p.m - m).exp();
                l += p.l * f;
                acc.iter_mut().zip(&p.acc).for_each(|(a, &v)| *a += v * f);
            }
            Some((l, acc))
        }
        SoftmaxScheme::Async { phi, a, .. } => {
            let max_x = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.max_x));
            let over = parts.iter().any(|p| p.over);
            let l: f32 = parts.iter().map(|p| p.l).sum();
            for p in parts {
                acc.iter_mut().zip(&p.acc).for_each(|(s, &v)| *s += v);
            }
            async_accepts(over, max_x - phi, a, l, &acc).then_some((l, acc))
        }
    }
}

/// Whether an async row stands without the sync recompute (FlashDecoding++ §3): no score past
/// b, the row's max not below φ + a, and a finite, positive sum. `rise` = max − φ.
fn async_accepts(over: bool, rise: f32, a: f32, l: f32, acc: &[f32]) -> bool {
    !over && rise >= a && l.is_finite() && l > 0.0 && acc.iter().all(|v| v.is_finite())
}

fn start_of(scheme: SoftmaxScheme) -> f32 {
    match scheme {
        SoftmaxScheme::Sync => f32::NEG_INFINITY,
        SoftmaxScheme::Async { phi, .. } => phi,
    }
}

/// q rows widened and scaled by 1/√d.
fn scaled_q(dt: DType, q: &[u16], scale: f32) -> Vec<f32> {
    let mut qf = vec![0f32; q.len()];
    // The vector widening (exact, as DType::widen): the scalar one was ~2 % of a 128-token
    // prefill's attention samples.
    simd::widen(dt, q, &mut qf);
    qf.iter_mut().for_each(|v| *v *= scale);
    qf
}

/// Split-KV decode. `compute_units` stands in for the SM count when choosing the splits.
/// Params and buffers are validated by the caller.
pub fn decode(
    p: &DecodeParams,
    layout: &PagedKvLayout,
    compute_units: usize,
    q: &[u16],
    pools: (&[u16], &[u16]),
    out: &mut [u16],
) -> Result<AttnStats> {
    let g = p.geom;
    let (bsz, h, kvh, grp, d, dt) = (p.batch(), g.num_heads, g.num_kv_heads, g.group(), g.head_dim, p.dtype);
    let max_len = (0..bsz).map(|b| p.tables.seq_len(b)).max().unwrap_or(1);
    let splits = p
        .num_splits
        .unwrap_or_else(|| num_splits(bsz, kvh, max_len, compute_units));
    let qf = scaled_q(dt, &q[..bsz * h * d], g.scale());
    let tb = &p.tables;
    let view = |b: usize| SeqView {
        layout,
        pages: &tb.block_table[b * tb.max_pages..(b + 1) * tb.max_pages],
    };
    let split_range = |b: usize, s: usize| {
        let len = tb.seq_len(b);
        let chunk = len.div_ceil(splits);
        (s * chunk).min(len)..((s + 1) * chunk).min(len)
    };
    // The partials of one (sequence, split) task: one per query head in `heads`, each reading
    // its kv head's run of the token rows.
    let run = |scheme: SoftmaxScheme, b: usize, s: usize, heads: Range<usize>| -> Vec<Partial> {
        let v = view(b);
        let key = |t: usize| v.row(pools.0, t);
        let val = |t: usize| v.row(pools.1, t);
        let mut scratch = Vec::new();
        let mut parts: Vec<Partial> = heads.clone().map(|_| Partial::empty(d, start_of(scheme))).collect();
        let qs = &qf[(b * h + heads.start) * d..(b * h + heads.end) * d];
        let r = split_range(b, s);
        let ends = vec![r.end; parts.len()];
        let cols: Vec<usize> = heads.map(|head| head / grp * d).collect();
        accumulate(
            dt,
            scheme,
            qs,
            r.start,
            &ends,
            &cols,
            &key,
            &val,
            &mut parts,
            &mut scratch,
        );
        parts
    };
    // Splits as the shared rule counts them for (sequence, kv head) items; one CPU task per
    // (sequence, split) serves every head, so that each task reads whole token rows.
    let tasks: Vec<Vec<Partial>> = pool::map(bsz * splits, |i| run(p.scheme, i / splits, i % splits, 0..h));
    // Combine: rows in runs, one run per task.
    let rows = bsz * h;
    let outs = pool::Rows::new(&mut out[..rows * d], d);
    let again = std::sync::atomic::AtomicUsize::new(0);
    pool::for_ranges(rows, |run_rows| {
        for row in run_rows {
            // SAFETY: the ranges are disjoint, so output row `row` is this task's alone.
            let o = unsafe { outs.row(row) };
            let (b, head) = (row / h, row % h);
            let parts: Vec<&Partial> = (0..splits).map(|s| &tasks[b * splits + s][head]).collect();
            let (res, recount) = match combine(p.scheme, &parts, d) {
                Some(r) => (r, 0),
                None => {
                    // Flagged by the async scheme: the whole row again with the sync scheme.
                    let redo: Vec<Partial> = (0..splits)
                        .map(|s| run(SoftmaxScheme::Sync, b, s, head..head + 1).remove(0))
                        .collect();
                    let refs: Vec<&Partial> = redo.iter().collect();
                    (
                        combine(SoftmaxScheme::Sync, &refs, d).unwrap_or((1.0, vec![f32::NAN; d])),
                        1,
                    )
                }
            };
            write_row(dt, &res, o);
            again.fetch_add(recount, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let recomputed = again.into_inner();
    Ok(AttnStats {
        rows: bsz * h,
        recomputed,
        splits,
    })
}

/// o = acc / l rounded, as combine then [`write_row`] compute it for a row of one partial
/// ((0 + a) · (1/l), then the rounding of DType::from_f32, which simd::narrow matches bit
/// for bit); acc is scaled in place.
fn write_acc(dt: DType, l: f32, acc: &mut [f32], o: &mut [u16]) {
    let inv = 1.0 / l;
    // + 0.0 as combine's sum into a zeroed row does: a −0.0 lane leaves it as +0.0.
    acc.iter_mut().for_each(|a| *a = (*a + 0.0) * inv);
    simd::narrow(dt, acc, o);
}

fn write_row(dt: DType, (l, acc): &(f32, Vec<f32>), o: &mut [u16]) {
    let inv = 1.0 / l;
    for (d, &a) in o.iter_mut().zip(acc) {
        *d = dt.from_f32(a * inv);
    }
}

/// Causal prefill: writes k and v into the pools, then attends. Params and buffers are
/// validated by the caller.
pub fn prefill(
    p: &PrefillParams,
    layout: &PagedKvLayout,
    q: &[u16],
    kv_new: (&[u16], &[u16]),
    pools: (&mut [u16], &mut [u16]),
    out: &mut [u16],
) -> Result<AttnStats> {
    let kvd = p.geom.num_kv_heads * p.geom.head_dim;
    for (b, &(row0, prefix, n)) in p.spans().iter().enumerate() {
        let table = p.tables.table(b);
        write_tokens(layout, pools.0, &table, prefix, &kv_new.0[row0 * kvd..(row0 + n) * kvd])?;
        write_tokens(layout, pools.1, &table, prefix, &kv_new.1[row0 * kvd..(row0 + n) * kvd])?;
    }
    prefill_cached(p, layout, q, (pools.0, pools.1), out)
}

/// Causal prefill of new tokens whose k and v the pools already hold: attend only.
pub fn prefill_cached(
    p: &PrefillParams,
    layout: &PagedKvLayout,
    q: &[u16],
    (kp, vp): (&[u16], &[u16]),
    out: &mut [u16],
) -> Result<AttnStats> {
    let g = p.geom;
    let (h, grp, d, dt) = (g.num_heads, g.group(), g.head_dim, p.dtype);
    let spans = p.spans();
    let tokens = p.tokens();
    let qf = scaled_q(dt, &q[..tokens * h * d], g.scale());
    let seq_of: Vec<usize> = spans
        .iter()
        .enumerate()
        .flat_map(|(b, &(_, _, n))| std::iter::repeat_n(b, n))
        .collect();
    let tb = &p.tables;
    // One task per block of up to PREFILL_BLOCK consecutive tokens of one sequence: for each kv
    // head, the block's tokens × the group's heads read the same K/V rows (causal: token i stops
    // at its own position), so each tile of keys is widened once for all of them.
    let blocks: Vec<(usize, usize)> = spans
        .iter()
        .flat_map(|&(row0, _, n)| {
            (0..n.div_ceil(PREFILL_BLOCK))
                .map(move |i| (row0 + i * PREFILL_BLOCK, row0 + ((i + 1) * PREFILL_BLOCK).min(n)))
        })
        .collect();
    let mut outs: Vec<&mut [u16]> = Vec::with_capacity(blocks.len());
    let mut rest = &mut out[..tokens * h * d];
    for &(a, z) in &blocks {
        let (head, tail) = rest.split_at_mut((z - a) * h * d);
        outs.push(head);
        rest = tail;
    }
    let slots = pool::Rows::new(&mut outs, 1);
    let recomputed = std::sync::atomic::AtomicUsize::new(0);
    // Tasks are claimed in order, so the last blocks (the most keys under the causal mask)
    // go first and the short ones fill in at the end.
    pool::for_each(blocks.len(), &|t| {
        let i = blocks.len() - 1 - t;
        // SAFETY: block i's output rows are task t's alone.
        let o: &mut [u16] = unsafe { &mut *slots.row(i)[0] };
        let (a, z) = blocks[i];
        let b = seq_of[a];
        let (row0, prefix, _) = spans[b];
        let v = SeqView {
            layout,
            pages: &tb.block_table[b * tb.max_pages..(b + 1) * tb.max_pages],
        };
        let key = |t: usize| v.row(kp, t);
        let val = |t: usize| v.row(vp, t);
        let nt = z - a;
        let mut scratch = Vec::new();
        let mut again = 0;
        // Part j = (token a + j / h, head j % h): q and the output row are at j·d of the
        // block's rows; its keys end after the token's own position.
        let ends: Vec<usize> = (0..nt * h).map(|j| prefix + (a + j / h - row0) + 1).collect();
        let cols: Vec<usize> = (0..nt * h).map(|j| j % h / grp * d).collect();
        let qs = &qf[a * h * d..z * h * d];
        let mut parts: Vec<Partial> = (0..nt * h).map(|_| Partial::empty(d, start_of(p.scheme))).collect();
        accumulate(dt, p.scheme, qs, 0, &ends, &cols, &key, &val, &mut parts, &mut scratch);
        for (j, (part, oh)) in parts.iter_mut().zip(o.chunks_exact_mut(d)).enumerate() {
            // A row of one partial that combine would accept is its own combine (sync:
            // rescaled by e^0 = 1; async: inside the window, summed with nothing):
            // written straight from its accumulator, without combine's copy of it, and
            // rounded eight lanes at a time (the per-element rounding call and the copies
            // were ~10 % of a 128-token prefill's attention samples). The engine runs the
            // async scheme by default, so both take this path.
            let direct = match p.scheme {
                SoftmaxScheme::Sync => part.l > 0.0,
                SoftmaxScheme::Async { phi, a, .. } => async_accepts(part.over, part.max_x - phi, a, part.l, &part.acc),
            };
            if direct {
                write_acc(dt, part.l, &mut part.acc, oh);
                continue;
            }
            let res = match combine(p.scheme, &[&*part], d) {
                Some(r) => r,
                None => {
                    // Flagged by the async scheme: this row again with the sync one.
                    again += 1;
                    let mut redo = [Partial::empty(d, start_of(SoftmaxScheme::Sync))];
                    let q = &qs[j * d..(j + 1) * d];
                    let (e, c) = (&ends[j..j + 1], &cols[j..j + 1]);
                    accumulate(dt, SoftmaxScheme::Sync, q, 0, e, c, &key, &val, &mut redo, &mut scratch);
                    combine(SoftmaxScheme::Sync, &[&redo[0]], d).unwrap_or((1.0, vec![f32::NAN; d]))
                }
            };
            write_row(dt, &res, oh);
        }
        recomputed.fetch_add(again, std::sync::atomic::Ordering::Relaxed);
    });
    let recomputed = recomputed.into_inner();
    Ok(AttnStats {
        rows: tokens * h,
        recomputed,
        splits: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: usize = 4;

    /// Keys whose scores (with q = (1, 0, 0, 0) and no scale) are `xs`, values v_t = (t, 1, −t, 2).
    fn rows(xs: &[f32]) -> (Vec<Vec<u16>>, Vec<Vec<u16>>) {
        let dt = DType::F16;
        let k = xs.iter().map(|&x| vec![dt.from_f32(x), 0, 0, 0]).collect();
        let v = (0..xs.len())
            .map(|t| {
                [t as f32, 1.0, -(t as f32), 2.0]
                    .iter()
                    .map(|&x| dt.from_f32(x))
                    .collect()
            })
            .collect();
        (k, v)
    }

    fn run(scheme: SoftmaxScheme, xs: &[f32], splits: &[Range<usize>]) -> (Vec<Partial>, Option<(f32, Vec<f32>)>) {
        let (k, v) = rows(xs);
        let key = |t: usize| k[t].as_slice();
        let val = |t: usize| v[t].as_slice();
        let q = [1.0, 0.0, 0.0, 0.0];
        let mut scratch = Vec::new();
        let parts: Vec<Partial> = splits
            .iter()
            .map(|r| {
                let mut p = [Partial::empty(D, start_of(scheme))];
                accumulate(
                    DType::F16,
                    scheme,
                    &q,
                    r.start,
                    &[r.end],
                    &[0],
                    &key,
                    &val,
                    &mut p,
                    &mut scratch,
                );
                p.into_iter().next().expect("one partial")
            })
            .collect();
        let refs: Vec<&Partial> = parts.iter().collect();
        let c = combine(scheme, &refs, D);
        (parts, c)
    }

    fn normalised((l, acc): (f32, Vec<f32>)) -> Vec<f32> {
        acc.iter().map(|a| a / l).collect()
    }

    /// The grouped accumulate against an f64 softmax, at odd head dims (vector tails), part
    /// counts, key counts (tile tails, the eight-key step's tail), range offsets and per-part
    /// key ends, over token rows of three kv heads, in the AVX2 and the portable build, with
    /// both schemes. Parts either each read another kv head's run (`shared` 1) or come in runs
    /// of `shared` parts with one run and the same keys (a GQA group of one token: the grouped
    /// tiles, including groups cut at GROUP and a last group cut short).
    #[test]
    fn grouped_accumulate_matches_f64_at_odd_sizes_in_every_build() {
        use crate::backend::cpu::simd::Portable;
        use crate::dtype::random_bits;
        let dt = DType::F16;
        let mut seed = 1;
        for d in [8, 20, 64, 72] {
            for (g, shared) in [(1, 1), (3, 1), (5, 1), (3, 3), (5, 2), (7, 4), (9, 3)] {
                for (r0, len) in [(0, 1), (3, 7), (1, 33), (5, 70)] {
                    seed += 1;
                    let total = r0 + len;
                    // Token rows of KVH kv heads; part h reads kv head h % KVH.
                    const KVH: usize = 3;
                    let rw = KVH * d;
                    let k = random_bits(dt, total * rw, 1.0, seed);
                    let v = random_bits(dt, total * rw, 1.0, seed + 1000);
                    let qb = random_bits(dt, g * d, 1.0, seed + 2000);
                    let mut q = vec![0f32; g * d];
                    dt.widen(&qb, &mut q);
                    q.iter_mut().for_each(|x| *x *= 0.7);
                    let key = |t: usize| &k[t * rw..(t + 1) * rw];
                    let val = |t: usize| &v[t * rw..(t + 1) * rw];
                    let cols: Vec<usize> = (0..g).map(|h| h / shared % KVH * d).collect();
                    // Part h stops early(h) keys before the end (the causal prefill case),
                    // except the first group, which takes them all (the decode case).
                    let early = |h: usize| (h / shared).min(len - 1);
                    let wide = |b: &[u16]| -> Vec<f64> { b.iter().map(|&x| dt.to_f32(x) as f64).collect() };
                    let want: Vec<Vec<f64>> = (0..g)
                        .map(|h| {
                            let qh = &q[h * d..(h + 1) * d];
                            let total = total - early(h);
                            let c = cols[h];
                            let xs: Vec<f64> = (r0..total)
                                .map(|t| wide(&key(t)[c..c + d]).iter().zip(qh).map(|(a, &b)| a * b as f64).sum())
                                .collect();
                            let m = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let w: Vec<f64> = xs.iter().map(|x| (x - m).exp()).collect();
                            let l: f64 = w.iter().sum();
                            (0..d)
                                .map(|j| {
                                    (r0..total)
                                        .zip(&w)
                                        .map(|(t, p)| p * wide(&val(t)[c..c + d])[j])
                                        .sum::<f64>()
                                        / l
                                })
                                .collect()
                        })
                        .collect();
                    let schemes = [
                        SoftmaxScheme::Sync,
                        SoftmaxScheme::Async {
                            phi: 0.0,
                            a: -60.0,
                            b: 20.0,
                        },
                    ];
                    for scheme in schemes {
                        for portable in [false, true] {
                            let mut parts: Vec<Partial> = (0..g).map(|_| Partial::empty(d, start_of(scheme))).collect();
                            // Poisoned scratch: nothing may read what the kernel did not write.
                            let mut scratch = vec![f32::NAN; 7];
                            let ends: Vec<usize> = (0..g).map(|h| total - early(h)).collect();
                            if portable {
                                accumulate_generic::<Portable>(
                                    dt,
                                    scheme,
                                    &q,
                                    r0,
                                    &ends,
                                    &cols,
                                    &key,
                                    &val,
                                    &mut parts,
                                    &mut scratch,
                                );
                            } else {
                                accumulate(dt, scheme, &q, r0, &ends, &cols, &key, &val, &mut parts, &mut scratch);
                            }
                            for (h, part) in parts.iter().enumerate() {
                                let got = normalised(combine(scheme, &[part], d).expect("inside the window"));
                                for (j, (x, y)) in got.iter().zip(&want[h]).enumerate() {
                                    assert!(
                                        (*x as f64 - y).abs() < 2e-5,
                                        "d {d} g {g}/{shared} keys {r0}..{total} {} portable {portable} head {h} dim {j}: {x} vs {y}",
                                        scheme.label()
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The grouped tiles add in the order of the one-part path: a prefill-shaped block (tokens ×
    /// heads, GQA groups of `grp`) accumulated at once equals each part accumulated alone, bit
    /// for bit, in both builds and schemes, at head dims with vector tails and key counts with
    /// tile and eight-key tails; scratch and outputs start poisoned.
    #[test]
    fn grouped_tiles_are_bit_identical_to_one_part_at_a_time() {
        use crate::backend::cpu::simd::Portable;
        use crate::dtype::random_bits;
        let dt = DType::F16;
        let mut seed = 500;
        for d in [8, 20, 64, 72] {
            for (h, grp) in [(9, 3), (8, 4), (6, 2), (12, 6)] {
                for (prefix, nt) in [(0, 1), (0, 5), (29, 3), (61, 8)] {
                    seed += 1;
                    let kvh = h / grp;
                    let rw = kvh * d;
                    let total = prefix + nt;
                    let k = random_bits(dt, total * rw, 1.0, seed);
                    let v = random_bits(dt, total * rw, 1.0, seed + 1000);
                    let qb = random_bits(dt, nt * h * d, 1.0, seed + 2000);
                    let mut q = vec![0f32; nt * h * d];
                    dt.widen(&qb, &mut q);
                    q.iter_mut().for_each(|x| *x *= 0.3);
                    let key = |t: usize| &k[t * rw..(t + 1) * rw];
                    let val = |t: usize| &v[t * rw..(t + 1) * rw];
                    let ends: Vec<usize> = (0..nt * h).map(|j| prefix + j / h + 1).collect();
                    let cols: Vec<usize> = (0..nt * h).map(|j| j % h / grp * d).collect();
                    let schemes = [
                        SoftmaxScheme::Sync,
                        SoftmaxScheme::Async {
                            phi: 0.5,
                            a: -60.0,
                            b: 20.0,
                        },
                    ];
                    for scheme in schemes {
                        for portable in [false, true] {
                            let run = |qs: &[f32], e: &[usize], c: &[usize]| -> Vec<Partial> {
                                let mut parts: Vec<Partial> =
                                    (0..e.len()).map(|_| Partial::empty(d, start_of(scheme))).collect();
                                let mut scratch = vec![f32::NAN; 3];
                                if portable {
                                    accumulate_generic::<Portable>(
                                        dt,
                                        scheme,
                                        qs,
                                        0,
                                        e,
                                        c,
                                        &key,
                                        &val,
                                        &mut parts,
                                        &mut scratch,
                                    );
                                } else {
                                    accumulate(dt, scheme, qs, 0, e, c, &key, &val, &mut parts, &mut scratch);
                                }
                                parts
                            };
                            let all = run(&q, &ends, &cols);
                            for j in 0..nt * h {
                                let one = run(&q[j * d..(j + 1) * d], &ends[j..j + 1], &cols[j..j + 1]);
                                let (a, b) = (&all[j], &one[0]);
                                let same = a.m.to_bits() == b.m.to_bits()
                                    && a.l.to_bits() == b.l.to_bits()
                                    && a.max_x.to_bits() == b.max_x.to_bits()
                                    && a.over == b.over
                                    && a.acc.iter().zip(&b.acc).all(|(x, y)| x.to_bits() == y.to_bits());
                                assert!(
                                    same,
                                    "d {d} h {h}/{grp} prefix {prefix} tokens {nt} part {j} {} portable {portable}",
                                    scheme.label()
                                );
                                assert!(a.l.is_finite() && a.l > 0.0);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The prefill's direct write of a row of one partial rounds as combine then write_row do,
    /// bit for bit (a −0.0 lane included), in both schemes, at lengths with vector tails, in
    /// f16 and bf16, into poisoned rows; and against the f64 quotient within half an ulp.
    #[test]
    fn direct_write_rounds_as_write_row() {
        use crate::dtype::random_bits;
        for dt in [DType::F16, DType::Bf16] {
            for (i, d) in [1usize, 7, 8, 20, 64, 72].into_iter().enumerate() {
                let bits = random_bits(dt, d, 3.0, 90 + i as u64);
                let mut acc: Vec<f32> = bits.iter().map(|&b| dt.to_f32(b) * 1.37).collect();
                // A −0.0 lane: combine's sum into a zeroed row makes it +0.0.
                acc[d / 2] = -0.0;
                let l = 2.9f32 + i as f32;
                let mut want = vec![0xFFFFu16; d];
                let mut part = Partial::empty(d, 0.5);
                part.l = l;
                part.acc = acc.clone();
                part.max_x = 1.0;
                for scheme in [
                    SoftmaxScheme::Sync,
                    SoftmaxScheme::Async {
                        phi: 0.5,
                        a: -20.0,
                        b: 20.0,
                    },
                ] {
                    let row = combine(scheme, &[&part], d).expect("inside the window");
                    write_row(dt, &row, &mut want);
                    let mut got = vec![0xFFFFu16; d];
                    let mut scaled = acc.clone();
                    write_acc(dt, l, &mut scaled, &mut got);
                    assert_eq!(got, want, "{dt:?} d {d} {}", scheme.label());
                }
                for (g, a) in want.iter().zip(&acc) {
                    let exact = *a as f64 / l as f64;
                    let ulp = match dt {
                        DType::Bf16 => 2f64.powi(-8),
                        _ => 2f64.powi(-11),
                    } * exact.abs().max(1e-4);
                    assert!((dt.to_f32(*g) as f64 - exact).abs() <= ulp, "{dt:?} d {d}");
                }
            }
        }
    }

    #[test]
    fn async_sums_against_phi_and_agrees_with_sync() {
        // 70 scores over three tiles and two splits, inside [a, b] around φ = 1.
        let xs: Vec<f32> = (0..70).map(|t| ((t * 7 % 13) as f32) * 0.5 - 2.0).collect();
        let scheme = SoftmaxScheme::Async {
            phi: 1.0,
            a: -10.0,
            b: 10.0,
        };
        let splits = [0..40, 40..70];
        let (parts, got) = run(scheme, &xs, &splits);
        // No rescale: each split's l is Σ e^(x − φ) of its own keys.
        let want: f32 = xs[..40].iter().map(|x| (x - 1.0).exp()).sum();
        assert!((parts[0].l - want).abs() < 1e-4 * want, "{} vs {want}", parts[0].l);
        let (_, sync) = run(SoftmaxScheme::Sync, &xs, &splits);
        let (a, s) = (normalised(got.expect("not flagged")), normalised(sync.expect("sync")));
        for (x, y) in a.iter().zip(&s) {
            assert!((x - y).abs() < 1e-4, "{a:?} vs {s:?}");
        }
    }

    #[test]
    fn rows_leaving_the_window_are_flagged_exactly_at_its_edges() {
        let scheme = SoftmaxScheme::Async {
            phi: 0.0,
            a: -4.0,
            b: 4.0,
        };
        let one = |xs: &[f32]| run(scheme, xs, std::slice::from_ref(&(0..xs.len()))).1.is_some();
        // x − φ = b is inside; one score past b in any split flags the row.
        assert!(one(&[4.0, 0.0, -1.0]));
        assert!(!one(&[4.5, 0.0, -1.0]));
        assert!(run(scheme, &[0.0, 1.0, 4.5], &[0..2, 2..3]).1.is_none());
        // The row's max at a is inside; every score below a flags it.
        assert!(one(&[-4.0, -9.0]));
        assert!(!one(&[-4.5, -9.0]));
        // An underflowing split is fine when another split holds the max.
        assert!(run(scheme, &[-9.0, -8.0, 0.5], &[0..2, 2..3]).1.is_some());
    }

    #[test]
    fn sync_rescales_when_the_max_grows_and_the_combine_weights_splits() {
        // Rising scores (exact in f16): the running max grows in every tile.
        let xs: Vec<f32> = (0..100).map(|t| t as f32 * 0.125).collect();
        let (parts, got) = run(SoftmaxScheme::Sync, &xs, &[0..50, 50..100]);
        assert_eq!(parts[0].m, xs[49]);
        assert_eq!(parts[1].m, xs[99]);
        let out = normalised(got.expect("sync never flags"));
        let w: Vec<f64> = xs.iter().map(|&x| (x as f64 - 12.375).exp()).collect();
        let l: f64 = w.iter().sum();
        let want0: f64 = w.iter().enumerate().map(|(t, p)| p * t as f64).sum::<f64>() / l;
        assert!((out[0] as f64 - want0).abs() < 1e-3 * want0, "{} vs {want0}", out[0]);
        assert!((out[1] - 1.0).abs() < 1e-5 && (out[3] - 2.0).abs() < 1e-5);
    }
}
