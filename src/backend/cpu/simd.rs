//! What the CPU kernels share: an 8-lane f32 vector type, and a one-time choice between a build
//! for the baseline target and one for AVX2+FMA+F16C.
//!
//! The crate is built for the baseline x86-64 target (SSE2) so that one binary runs anywhere.
//! The hot loops are written once, generic over [`Vf32`], and instantiated twice: [`Portable`]
//! (plain arrays, left to the auto-vectoriser) and, on x86-64, [`Avx2`] (one AVX register per
//! vector, one `vfmadd` per lane-wise multiply-add, F16C for widening) inside a
//! `#[target_feature]` function. Which one runs is decided at run time by [`multiversion!`].
//! Explicit vectors rather than auto-vectorised arrays in the fast build because, tuned for the
//! generic x86-64 CPU, LLVM splits such loops into 128-bit halves with shuffles between them.

use crate::dtype::DType;

/// Lanes of a [`Vf32`]: one AVX register of f32.
pub(super) const LANES: usize = 8;

/// Eight f32 lanes. Lane-wise arithmetic never reassociates a sum: each lane is its own
/// running sum, reduced once by [`Vf32::hsum`].
pub(super) trait Vf32: Copy {
    fn zero() -> Self;
    fn load(chunk: &[f32; LANES]) -> Self;
    fn store(self, chunk: &mut [f32; LANES]);
    /// `self · b + acc`, lane-wise.
    fn madd(self, b: Self, acc: Self) -> Self;
    /// Sum of the lanes, pairwise (the same order in every build).
    fn hsum(self) -> f32;
    /// Scalar `a · b + acc` for the ragged tails, rounded the way `madd` rounds.
    fn madd1(a: f32, b: f32, acc: f32) -> f32;
    /// Widen 16-bit values to f32 (`dst.len() == src.len()`).
    fn widen(dt: DType, src: &[u16], dst: &mut [f32]);
    /// Eight f16 values widened in registers (exact), for kernels that read a 16-bit operand
    /// once and must not pay a store and reload of its f32 form.
    fn load_f16(src: &[u16; LANES]) -> Self;
    /// Eight bf16 values widened in registers (exact: bf16 is the top half of an f32).
    fn load_bf16(src: &[u16; LANES]) -> Self;
    /// A hint to bring the cache line holding `addr` into L1 (no effect on the results; any
    /// address is allowed, a prefetch never faults).
    fn prefetch(addr: *const u16);
}

/// `FDPP_CPU_ISA=portable` forces the portable build on any CPU, so that it can be checked (and
/// timed) on machines that would otherwise always take the AVX2 one.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn portable_requested() -> bool {
    crate::run_config::get()
        .get(crate::run_config::Key::CpuIsa)
        .is_some_and(|v| v.eq_ignore_ascii_case("portable"))
}

fn pairwise_sum(v: [f32; LANES]) -> f32 {
    let a = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// Plain arrays: multiply, round, add, round (no FMA on the baseline target).
#[derive(Clone, Copy)]
pub(super) struct Portable([f32; LANES]);

impl Vf32 for Portable {
    #[inline(always)]
    fn zero() -> Self {
        Portable([0.0; LANES])
    }
    #[inline(always)]
    fn load(chunk: &[f32; LANES]) -> Self {
        Portable(*chunk)
    }
    #[inline(always)]
    fn store(self, chunk: &mut [f32; LANES]) {
        *chunk = self.0;
    }
    #[inline(always)]
    fn madd(self, b: Self, acc: Self) -> Self {
        let mut out = acc.0;
        for ((o, x), y) in out.iter_mut().zip(self.0).zip(b.0) {
            *o += x * y;
        }
        Portable(out)
    }
    #[inline(always)]
    fn hsum(self) -> f32 {
        pairwise_sum(self.0)
    }
    #[inline(always)]
    fn madd1(a: f32, b: f32, acc: f32) -> f32 {
        a * b + acc
    }
    #[inline(always)]
    fn widen(dt: DType, src: &[u16], dst: &mut [f32]) {
        dt.widen(src, dst)
    }
    #[inline(always)]
    fn load_f16(src: &[u16; LANES]) -> Self {
        let mut v = [0f32; LANES];
        DType::F16.widen(src, &mut v);
        Portable(v)
    }
    #[inline(always)]
    fn load_bf16(src: &[u16; LANES]) -> Self {
        Portable(src.map(|b| f32::from_bits((b as u32) << 16)))
    }
    #[inline(always)]
    fn prefetch(_addr: *const u16) {}
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{has_avx2_fma_f16c, Avx2};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{pairwise_sum, Vf32, LANES};
    use crate::dtype::DType;

    /// Whether the [`Avx2`] build runs: the CPU has the features and `FDPP_CPU_ISA` does not ask
    /// for the portable build. Decided once per process.
    pub(in crate::backend::cpu) fn has_avx2_fma_f16c() -> bool {
        static USE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *USE.get_or_init(|| {
            !super::portable_requested()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// One AVX register. Its methods use AVX2, FMA and F16C instructions, so they may only run
    /// where [`has_avx2_fma_f16c`] holds: the type is private to the CPU backend and only
    /// instantiated by [`multiversion!`](super::multiversion) behind that check, inside a
    /// function compiled with those features (where the `#[inline(always)]` methods inline).
    #[derive(Clone, Copy)]
    pub(in crate::backend::cpu) struct Avx2(__m256);

    impl Vf32 for Avx2 {
        #[inline(always)]
        fn zero() -> Self {
            // SAFETY (every `unsafe` in this impl): the CPU has AVX2, FMA and F16C, see the type.
            Avx2(unsafe { _mm256_setzero_ps() })
        }
        #[inline(always)]
        fn load(chunk: &[f32; LANES]) -> Self {
            // SAFETY: reads exactly the 8 floats of `chunk` (unaligned load).
            Avx2(unsafe { _mm256_loadu_ps(chunk.as_ptr()) })
        }
        #[inline(always)]
        fn store(self, chunk: &mut [f32; LANES]) {
            // SAFETY: writes exactly the 8 floats of `chunk` (unaligned store).
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn madd(self, b: Self, acc: Self) -> Self {
            Avx2(unsafe { _mm256_fmadd_ps(self.0, b.0, acc.0) })
        }
        #[inline(always)]
        fn hsum(self) -> f32 {
            let mut v = [0f32; LANES];
            self.store(&mut v);
            pairwise_sum(v)
        }
        #[inline(always)]
        fn madd1(a: f32, b: f32, acc: f32) -> f32 {
            a.mul_add(b, acc)
        }
        #[inline(always)]
        fn widen(dt: DType, src: &[u16], dst: &mut [f32]) {
            let n = src.len().min(dst.len());
            let (src, dst) = (&src[..n], &mut dst[..n]);
            let (s8, s_tail) = src.as_chunks::<LANES>();
            let (d8, d_tail) = dst.as_chunks_mut::<LANES>();
            match dt {
                // F16C: one instruction per 8 values, exact.
                DType::F16 => {
                    for (s, d) in s8.iter().zip(d8) {
                        // SAFETY: reads the 16 bytes of `s`, writes the 32 bytes of `d`.
                        unsafe {
                            let h = _mm_loadu_si128(s.as_ptr().cast());
                            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
                        }
                    }
                }
                // bf16 is the top half of an f32: zero-extend and shift, exact (a NaN stays NaN).
                DType::Bf16 => {
                    for (s, d) in s8.iter().zip(d8) {
                        // SAFETY: as above.
                        unsafe {
                            let h = _mm_loadu_si128(s.as_ptr().cast());
                            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_castsi256_ps(w));
                        }
                    }
                }
            }
            dt.widen(s_tail, d_tail);
        }
        #[inline(always)]
        fn load_f16(src: &[u16; LANES]) -> Self {
            // SAFETY: reads the 16 bytes of `src`; F16C, see the type.
            Avx2(unsafe { _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast())) })
        }
        #[inline(always)]
        fn load_bf16(src: &[u16; LANES]) -> Self {
            // SAFETY: reads the 16 bytes of `src`; AVX2, see the type.
            Avx2(unsafe {
                let h = _mm_loadu_si128(src.as_ptr().cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            })
        }
        #[inline(always)]
        fn prefetch(addr: *const u16) {
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(addr.cast()) }
        }
    }
}

/// Name of the kernel build that runs on this machine, for the device's arch string.
pub(super) fn kernel_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma_f16c() {
            return "avx2+fma+f16c";
        }
        "portable"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "portable"
    }
}

/// Defines `$name(args)` that runs `$generic::<Avx2>(args)`, compiled for AVX2+FMA+F16C, when
/// the CPU has them, and `$generic::<Portable>(args)` otherwise. `$generic` must be
/// `#[inline(always)]` so that its whole body is compiled inside the AVX2 function.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident $(<$lt:lifetime>)? ($($arg:ident: $ty:ty),* $(,)?) => $generic:ident) => {
        $(#[$meta])*
        $vis fn $name $(<$lt>)? ($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                #[allow(clippy::too_many_arguments)]
                fn avx2_fma_f16c $(<$lt>)? ($($arg: $ty),*) {
                    $generic::<$crate::backend::cpu::simd::Avx2>($($arg),*)
                }
                if $crate::backend::cpu::simd::has_avx2_fma_f16c() {
                    // SAFETY: the CPU was just found to support AVX2, FMA and F16C, the only
                    // requirement of calling a `#[target_feature]` function.
                    unsafe { avx2_fma_f16c($($arg),*) };
                    return;
                }
            }
            $generic::<$crate::backend::cpu::simd::Portable>($($arg),*)
        }
    };
}
pub(super) use multiversion;

multiversion! {
    /// dst = src widened to f32, with F16C where the CPU has it.
    pub(super) fn widen(dt: DType, src: &[u16], dst: &mut [f32]) => widen_generic
}

#[inline(always)]
fn widen_generic<V: Vf32>(dt: DType, src: &[u16], dst: &mut [f32]) {
    V::widen(dt, src, dst)
}

/// Dot product of two equal-length slices: four vector accumulators (to overlap the FMA
/// latency), reduced at the end; the ragged tail one element at a time. Kept as the tested
/// pattern for f32 dot products (the GEMV now widens W in registers, see gemv.rs).
#[cfg(test)]
#[inline(always)]
pub(super) fn dot<V: Vf32>(a: &[f32], b: &[f32]) -> f32 {
    let (ca, ta) = a.as_chunks::<{ 4 * LANES }>();
    let (cb, tb) = b.as_chunks::<{ 4 * LANES }>();
    let mut acc = [V::zero(); 4];
    for (pa, pb) in ca.iter().zip(cb) {
        let (qa, _) = pa.as_chunks::<LANES>();
        let (qb, _) = pb.as_chunks::<LANES>();
        for ((s, x), y) in acc.iter_mut().zip(qa).zip(qb) {
            *s = V::load(x).madd(V::load(y), *s);
        }
    }
    let mut v = V::zero();
    let (ra, ta) = ta.as_chunks::<LANES>();
    let (rb, tb) = tb.as_chunks::<LANES>();
    for (x, y) in ra.iter().zip(rb) {
        v = V::load(x).madd(V::load(y), v);
    }
    let mut tail = 0f32;
    for (p, q) in ta.iter().zip(tb) {
        tail = V::madd1(*p, *q, tail);
    }
    (acc[0].hsum() + acc[1].hsum()) + (acc[2].hsum() + acc[3].hsum()) + (v.hsum() + tail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::random_bits;

    fn dot_in_f64(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(p, q)| *p as f64 * *q as f64).sum()
    }

    multiversion! {
        fn dot_into(a: &[f32], b: &[f32], out: &mut f32) => dot_into_generic
    }
    #[inline(always)]
    fn dot_into_generic<V: Vf32>(a: &[f32], b: &[f32], out: &mut f32) {
        *out = dot::<V>(a, b);
    }

    #[test]
    fn dot_matches_f64_for_every_tail_length() {
        for len in [1, 7, 8, 9, 31, 32, 33, 64, 71, 4097] {
            let a: Vec<f32> = (0..len).map(|i| ((i * 7 + 3) % 13) as f32 * 0.25 - 1.5).collect();
            let b: Vec<f32> = (0..len).map(|i| ((i * 5 + 1) % 11) as f32 * 0.125 - 0.6).collect();
            let want = dot_in_f64(&a, &b);
            let mut fast = f32::NAN;
            dot_into(&a, &b, &mut fast);
            for got in [dot::<Portable>(&a, &b), fast] {
                assert!(
                    (got as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "len {len}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn widening_is_exact_in_every_build() {
        for dt in [DType::F16, DType::Bf16] {
            // Odd length: full 8-lane chunks and a tail. Includes subnormals and a NaN-free range.
            let mut src = random_bits(dt, 203, 3.0, 9);
            src[5] = 0x0001; // smallest subnormal (f16) / tiny (bf16)
            src[6] = 0x8000; // -0
            let mut want = vec![0f32; src.len()];
            dt.widen(&src, &mut want);
            let mut got = vec![f32::NAN; src.len()];
            widen(dt, &src, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{dt} element {i}");
            }
            let mut portable = vec![f32::NAN; src.len()];
            Portable::widen(dt, &src, &mut portable);
            assert_eq!(portable, want);
        }
    }
}
