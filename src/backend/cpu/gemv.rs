//! ImplA `gemv` on the CPU: at small M the op is a GEMV bound by reading W (FlashDecoding++ §4),
//! so W must be read exactly once, however many rows x has, and at the memory's speed.
//!
//! The weights stay 16-bit in memory and are widened in registers (F16C for f16, a shift for
//! bf16) right before the FMAs: no f32 copy of a row is written and read back, so the only
//! traffic is W itself, streamed once. A step of the micro-kernel loads 8 columns of C = 4 rows
//! of W and multiplies them by the same 8 columns of up to 2 rows of x, which sit in L1 for the
//! whole task; at M = 1 the K loop is unrolled twice so that 8 independent accumulators hide
//! the FMA latency. Rows of x beyond two are taken in further passes over the same 4 rows of W,
//! which are then in L1. Each step also prefetches a line of the next 4 rows, so that W arrives
//! as one sequential stream (see [`dots`]).

use super::simd::{multiversion, Vf32, LANES};
use crate::dtype::DType;
use crate::ops::gemm::GemmDims;

/// Rows of W per task when the spec names none: see [`default_rows_per_task`].
pub(super) const DEFAULT_ROWS_PER_TASK: usize = 64;

/// Rows of W a step of the micro-kernel reads together.
const C: usize = 4;

/// Rows of W per task when the spec names none: about 16 tasks per thread, so that a thread
/// slowed by another process on the machine is made up for by the others (an op is a few tens
/// of microseconds at M = 1; with 2 tasks per thread one late task decides the op's time), and
/// at least 32 KiB of W per task so that scheduling stays a small share. A multiple of [`C`].
pub(super) fn default_rows_per_task(n: usize, k: usize) -> usize {
    let threads = super::pool::threads();
    let by_balance = n.div_ceil(16 * threads);
    let by_size = (32 << 10) / (2 * k.max(1));
    by_balance
        .max(by_size)
        .clamp(C, DEFAULT_ROWS_PER_TASK.max(C))
        .next_multiple_of(C)
}

/// `out_t` is y transposed, [N, M]: each task owns a contiguous run of rows of W and the
/// matching contiguous run of `out_t`. `xf` is x widened, [M, K]; `w` holds N·K bits.
pub(super) fn gemv(dt: DType, d: GemmDims, xf: &[f32], w: &[u16], out_t: &mut [f32], rows_per_task: usize) {
    let (m, k) = (d.m, d.k);
    // One pool task per task of rows: the tasks are few and even.
    super::pool::chunks_mut(out_t, rows_per_task * m, |task, out| {
        let n0 = task * rows_per_task;
        let rows = out.len() / m;
        task_rows(dt, k, xf, &w[n0 * k..(n0 + rows) * k], out);
    });
}

multiversion! {
    /// out[r, i] = x_i · w_r for every row r of `w_rows` ([rows, K]) and row i of x ([M, K]).
    fn task_rows(dt: DType, k: usize, xf: &[f32], w_rows: &[u16], out: &mut [f32]) => task_rows_generic
}

#[inline(always)]
fn task_rows_generic<V: Vf32>(dt: DType, k: usize, xf: &[f32], w_rows: &[u16], out: &mut [f32]) {
    match dt {
        DType::F16 => rows_of::<V, false>(k, xf, w_rows, out),
        DType::Bf16 => rows_of::<V, true>(k, xf, w_rows, out),
    }
}

#[inline(always)]
fn rows_of<V: Vf32, const BF16: bool>(k: usize, xf: &[f32], w_rows: &[u16], out: &mut [f32]) {
    let m = xf.len() / k;
    let rows = w_rows.len() / k;
    let mut r = 0;
    while r + C <= rows {
        block::<V, BF16, C>(k, m, xf, &w_rows[r * k..(r + C) * k], &mut out[r * m..(r + C) * m]);
        r += C;
    }
    while r < rows {
        block::<V, BF16, 1>(k, m, xf, &w_rows[r * k..(r + 1) * k], &mut out[r * m..(r + 1) * m]);
        r += 1;
    }
}

/// NR rows of W ([NR, K]) against every row of x; out is [NR, M].
#[inline(always)]
fn block<V: Vf32, const BF16: bool, const NR: usize>(k: usize, m: usize, xf: &[f32], w: &[u16], out: &mut [f32]) {
    let mut ws: [&[u16]; NR] = [&[]; NR];
    for (b, row) in ws.iter_mut().enumerate() {
        *row = &w[b * k..(b + 1) * k];
    }
    // The rows of W that follow this block (the next block's, or past the task's end, where
    // the prefetches are wasted but harmless); `wrapping_add` as the address may be past `w`.
    let next = w.as_ptr().wrapping_add(NR * k);
    let xrow = |i: usize| &xf[i * k..(i + 1) * k];
    let mut i = 0;
    while i < m {
        let sums: [[f32; NR]; 2];
        let rows_x = if m - i == 1 {
            let s = dots::<V, BF16, 1, NR, 2>([xrow(i)], ws, next);
            sums = [s[0], [0.0; NR]];
            1
        } else {
            sums = dots::<V, BF16, 2, NR, 1>([xrow(i), xrow(i + 1)], ws, next);
            2
        };
        for (a, row) in sums.iter().enumerate().take(rows_x) {
            for (b, s) in row.iter().enumerate() {
                out[b * m + i + a] = *s;
            }
        }
        i += rows_x;
    }
}

/// [`LANES`] 16-bit W values widened to f32 (F16C or the bf16 shift), for both W layouts.
#[inline(always)]
pub(super) fn load_w<V: Vf32, const BF16: bool>(src: &[u16; LANES]) -> V {
    if BF16 {
        V::load_bf16(src)
    } else {
        V::load_f16(src)
    }
}

#[inline(always)]
fn widen1<const BF16: bool>(bits: u16) -> f32 {
    if BF16 {
        f32::from_bits((bits as u32) << 16)
    } else {
        DType::F16.to_f32(bits)
    }
}

/// R rows of x against NR rows of W: R × NR dot products of length K, each summed in U
/// interleaved vector accumulators (U > 1 hides the FMA latency when R·NR alone is too few),
/// the ragged tail of K one element at a time.
///
/// `next` is where the following rows of W start: each step, which reads one 64-byte line's
/// worth of W (8 columns × NR rows of 2 bytes, NR = 4), prefetches the matching line of the
/// next block. The NR rows are NR streams 2K bytes apart, a pattern the hardware prefetcher
/// follows late (measured: at N = 3072, K = 576 the kernel ran slower than a widen-then-dot
/// pass that reads one row at a time); the prefetch turns the whole task into one sequential
/// stream, one block ahead.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // the register block reads clearest as explicit (u, a, b) indices
fn dots<V: Vf32, const BF16: bool, const R: usize, const NR: usize, const U: usize>(
    xs: [&[f32]; R],
    ws: [&[u16]; NR],
    next: *const u16,
) -> [[f32; NR]; R] {
    let k = xs[0].len();
    let chunks = k / LANES;
    // Re-sliced to exactly `chunks` so that the indexing below needs no bounds checks.
    let xc: [&[[f32; LANES]]; R] = xs.map(|s| &s.as_chunks::<LANES>().0[..chunks]);
    let wc: [&[[u16; LANES]]; NR] = ws.map(|s| &s.as_chunks::<LANES>().0[..chunks]);
    let mut acc = [[[V::zero(); NR]; R]; U];
    // No closures below: a closure does not inherit the AVX2 build's target features, so the
    // intrinsics it calls could not be inlined into it.
    let mut wv = [V::zero(); NR];
    let mut c = 0;
    while c + U <= chunks {
        for u in 0..U {
            V::prefetch(next.wrapping_add((c + u) * NR * LANES));
            for b in 0..NR {
                wv[b] = load_w::<V, BF16>(&wc[b][c + u]);
            }
            for a in 0..R {
                let xv = V::load(&xc[a][c + u]);
                for b in 0..NR {
                    acc[u][a][b] = xv.madd(wv[b], acc[u][a][b]);
                }
            }
        }
        c += U;
    }
    while c < chunks {
        V::prefetch(next.wrapping_add(c * NR * LANES));
        for b in 0..NR {
            wv[b] = load_w::<V, BF16>(&wc[b][c]);
        }
        for a in 0..R {
            let xv = V::load(&xc[a][c]);
            for b in 0..NR {
                acc[0][a][b] = xv.madd(wv[b], acc[0][a][b]);
            }
        }
        c += 1;
    }
    let mut sums = [[0f32; NR]; R];
    for a in 0..R {
        for b in 0..NR {
            let mut tail = 0f32;
            for t in chunks * LANES..k {
                tail = V::madd1(xs[a][t], widen1::<BF16>(ws[b][t]), tail);
            }
            let mut s = 0f32;
            for u in 0..U {
                s += acc[u][a][b].hsum();
            }
            sums[a][b] = s + tail;
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::random_bits;

    /// y[n, i] in f64 from the same 16-bit inputs.
    fn reference(dt: DType, m: usize, n: usize, k: usize, x: &[f32], w: &[u16]) -> Vec<f64> {
        let mut wf = vec![0f32; w.len()];
        dt.widen(w, &mut wf);
        let mut out = vec![0f64; n * m];
        for r in 0..n {
            for i in 0..m {
                out[r * m + i] = (0..k).map(|t| x[i * k + t] as f64 * wf[r * k + t] as f64).sum();
            }
        }
        out
    }

    #[test]
    fn gemv_matches_f64_at_odd_sizes_in_every_build() {
        // K: below one vector, ragged, one unrolled pair plus a vector plus a tail; N: odd (a
        // ragged block of W rows, a ragged last task); M: 1..5 covers both x paths and a pass
        // with a single row after pairs.
        for dt in [DType::F16, DType::Bf16] {
            for &(n, k) in &[(1, 3), (7, 8), (13, 25), (33, 71), (10, 576)] {
                for m in 1..=5 {
                    let x = random_bits(dt, m * k, 1.0, (m * 31 + k) as u64);
                    let mut xf = vec![0f32; x.len()];
                    dt.widen(&x, &mut xf);
                    let w = random_bits(dt, n * k, 1.0, (n * 7 + k) as u64);
                    let want = reference(dt, m, n, k, &xf, &w);
                    let d = GemmDims::new(m, n, k).expect("nonzero");
                    for rows_per_task in [1, 5, 64] {
                        let mut got = vec![f32::NAN; n * m];
                        gemv(dt, d, &xf, &w, &mut got, rows_per_task);
                        let mut portable = vec![f32::NAN; n * m];
                        rows_of_portable(dt, k, &xf, &w, &mut portable);
                        for (j, ((g, p), r)) in got.iter().zip(&portable).zip(&want).enumerate() {
                            let tol = 1e-5 * (1.0 + k as f64);
                            assert!(
                                (*g as f64 - r).abs() <= tol && (*p as f64 - r).abs() <= tol,
                                "{dt} M{m} N{n} K{k} rows/task {rows_per_task} element {j}: \
                                 fast {g}, portable {p}, f64 {r}"
                            );
                        }
                    }
                }
            }
        }
    }

    fn rows_of_portable(dt: DType, k: usize, xf: &[f32], w: &[u16], out: &mut [f32]) {
        task_rows_generic::<crate::backend::cpu::simd::Portable>(dt, k, xf, w, out)
    }

    #[test]
    fn default_rows_per_task_is_a_multiple_of_the_block() {
        for (n, k) in [
            (1, 1),
            (576, 576),
            (960, 576),
            (49152, 576),
            (3072, 576),
            (576, 1536),
            (7, 100_000),
        ] {
            let r = default_rows_per_task(n, k);
            assert!(
                r.is_multiple_of(C) && (C..=DEFAULT_ROWS_PER_TASK).contains(&r),
                "N {n} K {k}: {r}"
            );
        }
    }
}
