//! ImplB `flat_gemm` on the CPU: the flat GEMM of FlashDecoding++ §3 with the tile roles of a
//! CPU. There is no tile along M (x is short and stays whole); W is cut into tiles of B_N rows ×
//! B_K columns, each tile widened once into a thread-local f32 buffer and swept by a
//! register-blocked micro-kernel over MR rows of x × NR rows of W. K runs sequentially inside a
//! task, so each output is owned by one task and summed in f32 without atomics (§3.2).

use super::simd::{multiversion, Vf32, LANES};
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// B_N when the spec names none.
pub(super) const DEFAULT_BLOCK_N: usize = 16;
/// Register block: MR × NR vector accumulators (8 of the 16 AVX registers, leaving room for
/// the MR + NR operands loaded per step).
const MR: usize = 2;
const NR: usize = 4;

/// B_K: 256 columns keep a B_N = 16 tile at 16 KiB of f32, inside L1 next to the x vectors it
/// meets (measured on a 2-core EPYC: 512 and 1024 were no faster at M = 1..64, and slower at M = 1
/// with B_N = 8 and 16).
const BLOCK_K: usize = 256;

/// `out_t` is y transposed, [N, M]; `xf` is x widened, [M, K]; `w` holds N·K bits.
pub(super) fn flat_gemm(dt: DType, d: GemmDims, xf: &[f32], w: &[u16], out_t: &mut [f32], block_n: usize) {
    let (m, k) = (d.m, d.k);
    let bk = BLOCK_K;
    // x with each row zero-padded to a whole number of vectors, so that the micro-kernel has
    // no ragged tail: the tile rows are padded with zeros to match, and 0 · 0 adds nothing.
    let k8 = k.next_multiple_of(LANES);
    let mut xp = vec![0f32; m * k8];
    for (dst, src) in xp.chunks_exact_mut(k8).zip(xf.chunks_exact(k)) {
        dst[..k].copy_from_slice(src);
    }
    let xp = &xp;
    super::pool::chunks_mut(out_t, block_n * m, |task, out| {
        let (mut tile, mut vacc) = (vec![0f32; block_n * bk], vec![0f32; block_n * m * LANES]);
        let n0 = task * block_n;
        let rows = out.len() / m;
        let slab = &w[n0 * k..(n0 + rows) * k];
        task_slab(dt, k, bk, xp, slab, &mut tile, &mut vacc[..rows * m * LANES], out);
    });
}

multiversion! {
    /// out = x · slabᵀ for one slab of B_N rows of W ([rows, K]); out is [rows, M]. K runs in
    /// blocks of `bk`, each widened into `tile`; the sums stay in vector form in `vacc`
    /// ([rows, M, LANES]) across K blocks and are reduced once at the end.
    #[allow(clippy::too_many_arguments)]
    fn task_slab(dt: DType, k: usize, bk: usize, xp: &[f32], slab: &[u16], tile: &mut [f32], vacc: &mut [f32], out: &mut [f32]) => task_slab_generic
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn task_slab_generic<V: Vf32>(
    dt: DType,
    k: usize,
    bk: usize,
    xp: &[f32],
    slab: &[u16],
    tile: &mut [f32],
    vacc: &mut [f32],
    out: &mut [f32],
) {
    let k8 = k.next_multiple_of(LANES);
    let rows = slab.len() / k;
    let m = xp.len() / k8;
    vacc.fill(0.0);
    let mut k0 = 0;
    while k0 < k {
        let kb = bk.min(k - k0);
        let kb8 = kb.next_multiple_of(LANES);
        let tile = &mut tile[..rows * kb8];
        for (r, dst) in tile.chunks_exact_mut(kb8).enumerate() {
            V::widen(dt, &slab[r * k + k0..r * k + k0 + kb], &mut dst[..kb]);
            dst[kb..].fill(0.0);
        }
        let xrow = |i: usize| &xp[i * k8 + k0..i * k8 + k0 + kb8];
        let mut i = 0;
        while i + MR <= m {
            let xs: [&[f32]; MR] = std::array::from_fn(|a| xrow(i + a));
            rows_of_tile::<V, MR>(xs, i, tile, kb8, vacc, m);
            i += MR;
        }
        while i < m {
            rows_of_tile::<V, 1>([xrow(i)], i, tile, kb8, vacc, m);
            i += 1;
        }
        k0 += kb;
    }
    let (sums, _) = vacc.as_chunks::<LANES>();
    for (o, v) in out.iter_mut().zip(sums) {
        *o = V::load(v).hsum();
    }
}

/// R rows of x, starting at row `i0`, against every row of the tile, NR tile rows at a time.
#[inline(always)]
fn rows_of_tile<V: Vf32, const R: usize>(
    xs: [&[f32]; R],
    i0: usize,
    tile: &[f32],
    kb8: usize,
    vacc: &mut [f32],
    m: usize,
) {
    let rows = tile.len() / kb8;
    let wrow = |r: usize| &tile[r * kb8..(r + 1) * kb8];
    let (vacc, _) = vacc.as_chunks_mut::<LANES>();
    let mut r = 0;
    while r + NR <= rows {
        micro::<V, R, NR>(xs, std::array::from_fn(|b| wrow(r + b)), vacc, i0, r, m);
        r += NR;
    }
    while r < rows {
        micro::<V, R, 1>(xs, [wrow(r)], vacc, i0, r, m);
        r += 1;
    }
}

/// R × C running dot products over one K block (lengths a multiple of LANES): the accumulators
/// for (x row i0 + a, tile row r0 + b) are loaded from `vacc`, kept in registers while every x
/// vector loaded is used C times and every W vector R times, then stored back.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // the register block reads clearest as explicit (a, b) indices
fn micro<V: Vf32, const R: usize, const C: usize>(
    xs: [&[f32]; R],
    ws: [&[f32]; C],
    vacc: &mut [[f32; LANES]],
    i0: usize,
    r0: usize,
    m: usize,
) {
    let chunks = xs[0].len() / LANES;
    // Re-sliced to exactly `chunks` so the indexing below needs no bounds checks in the loop.
    let xc: [&[[f32; LANES]]; R] = xs.map(|s| &s.as_chunks::<LANES>().0[..chunks]);
    let wc: [&[[f32; LANES]]; C] = ws.map(|s| &s.as_chunks::<LANES>().0[..chunks]);
    let slot = |a: usize, b: usize| (r0 + b) * m + i0 + a;
    let mut acc: [[V; C]; R] = std::array::from_fn(|a| std::array::from_fn(|b| V::load(&vacc[slot(a, b)])));
    for c in 0..chunks {
        let wv: [V; C] = std::array::from_fn(|b| V::load(&wc[b][c]));
        for a in 0..R {
            let xv = V::load(&xc[a][c]);
            for b in 0..C {
                acc[a][b] = xv.madd(wv[b], acc[a][b]);
            }
        }
    }
    for a in 0..R {
        for b in 0..C {
            acc[a][b].store(&mut vacc[slot(a, b)]);
        }
    }
}
