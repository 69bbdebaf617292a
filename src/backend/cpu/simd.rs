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
    /// Every lane `v`.
    fn splat(v: f32) -> Self;
    fn add(self, b: Self) -> Self;
    fn sub(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    fn div(self, b: Self) -> Self;
    /// e^x lane-wise to ~2 ulp over the whole f32 range (see [`exp_lanes`]); NaN stays NaN,
    /// −∞ gives 0, overflow gives +∞.
    fn exp(self) -> Self;
    /// Lane j = the sum of the lanes of `v[j]`: eight horizontal sums at once.
    fn hsum8(v: [Self; LANES]) -> Self;
    /// Round the lanes to 16-bit values (nearest, ties to even; bit-identical to
    /// [`DType::from_f32`]) and store them.
    fn store_narrow(self, dt: DType, dst: &mut [u16; LANES]);
}

/// Cody–Waite split of ln 2: the high part has 9 significant bits, so n · LN2_HI is exact for
/// every |n| ≤ 150 that [`exp_lanes`] forms.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// e^x is 0 in f32 below this (e^−104 < half the smallest subnormal) and +∞ above the upper
/// bound; clamping there keeps n = round(x / ln 2) within [−150, 129].
const EXP_LO: f32 = -104.0;
const EXP_HI: f32 = 89.0;
/// Taylor coefficients 1/k!, k = 7 down to 2: on |r| ≤ ln2/2 the degree-7 remainder is
/// below 6e-9 relative, under half an f32 ulp.
const EXP_POLY: [f32; 6] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5];

/// e^x of one lane, the arithmetic [`Avx2::exp`] does per lane (without the FMAs): x = n·ln2 + r,
/// e^r by a degree-7 polynomial, 2^n applied as two factors 2^⌊n/2⌋ · 2^(n−⌊n/2⌋) so that
/// results in the subnormal range and up to f32::MAX come out right without special cases.
#[inline(always)]
fn exp_lanes(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.clamp(EXP_LO, EXP_HI);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    p = (p * r + 1.0) * r + 1.0;
    let n = n as i32;
    let n1 = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    p * pow2(n1) * pow2(n - n1)
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
    #[inline(always)]
    fn splat(v: f32) -> Self {
        Portable([v; LANES])
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] + b.0[i]))
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] - b.0[i]))
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] * b.0[i]))
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] / b.0[i]))
    }
    #[inline(always)]
    fn exp(self) -> Self {
        Portable(self.0.map(exp_lanes))
    }
    #[inline(always)]
    fn hsum8(v: [Self; LANES]) -> Self {
        Portable(v.map(|x| pairwise_sum(x.0)))
    }
    #[inline(always)]
    fn store_narrow(self, dt: DType, dst: &mut [u16; LANES]) {
        dt.narrow(&self.0, dst)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{has_avx2_fma_f16c, Avx2};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{pairwise_sum, Vf32, EXP_HI, EXP_LO, EXP_POLY, LANES, LN2_HI, LN2_LO};
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
        #[inline(always)]
        fn splat(v: f32) -> Self {
            Avx2(unsafe { _mm256_set1_ps(v) })
        }
        #[inline(always)]
        fn add(self, b: Self) -> Self {
            Avx2(unsafe { _mm256_add_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn sub(self, b: Self) -> Self {
            Avx2(unsafe { _mm256_sub_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn mul(self, b: Self) -> Self {
            Avx2(unsafe { _mm256_mul_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn div(self, b: Self) -> Self {
            Avx2(unsafe { _mm256_div_ps(self.0, b.0) })
        }
        #[inline(always)]
        fn exp(self) -> Self {
            // The steps of `exp_lanes`, eight lanes at a time, with FMAs.
            // SAFETY: register-only AVX2/FMA arithmetic, see the type.
            Avx2(unsafe {
                let x = self.0;
                let c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
                let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                    c,
                    _mm256_set1_ps(std::f32::consts::LOG2_E),
                ));
                let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), c);
                let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
                let mut p = _mm256_set1_ps(EXP_POLY[0]);
                for &k in &EXP_POLY[1..] {
                    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
                }
                let one = _mm256_set1_ps(1.0);
                p = _mm256_fmadd_ps(_mm256_fmadd_ps(p, r, one), r, one);
                let ni = _mm256_cvtps_epi32(n);
                let n1 = _mm256_srai_epi32::<1>(ni);
                let n2 = _mm256_sub_epi32(ni, n1);
                let bias = _mm256_set1_epi32(127);
                let p1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
                let p2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
                let e = _mm256_mul_ps(_mm256_mul_ps(p, p1), p2);
                // max/min dropped a NaN lane (they return the second operand): put it back.
                _mm256_blendv_ps(e, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
            })
        }
        #[inline(always)]
        fn hsum8(v: [Self; LANES]) -> Self {
            // Pairwise within each 128-bit half by horizontal adds (lane j of u0 holds half of
            // v[j]'s sum for j < 4 in the low half, the other half in the high half; u1 the same
            // for v[4..]), then the two halves added.
            // SAFETY: register-only AVX arithmetic, see the type.
            Avx2(unsafe {
                let t0 = _mm256_hadd_ps(v[0].0, v[1].0);
                let t1 = _mm256_hadd_ps(v[2].0, v[3].0);
                let t2 = _mm256_hadd_ps(v[4].0, v[5].0);
                let t3 = _mm256_hadd_ps(v[6].0, v[7].0);
                let u0 = _mm256_hadd_ps(t0, t1);
                let u1 = _mm256_hadd_ps(t2, t3);
                _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(u0, u1),
                    _mm256_permute2f128_ps::<0x31>(u0, u1),
                )
            })
        }
        #[inline(always)]
        fn store_narrow(self, dt: DType, dst: &mut [u16; LANES]) {
            // SAFETY: register arithmetic, then a store of exactly the 16 bytes of `dst`.
            unsafe {
                let h = match dt {
                    // F16C, round to nearest even: what `half` does (it uses F16C itself).
                    DType::F16 => _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(self.0),
                    // bf16: add 0x7fff plus the kept part's lowest bit and truncate (nearest,
                    // ties to even; overflow rounds to ∞ as it should); a NaN keeps its top
                    // half with the quiet bit set, as `half` does.
                    DType::Bf16 => {
                        let b = _mm256_castps_si256(self.0);
                        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
                        let rounded = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
                        let rounded = _mm256_srli_epi32::<16>(rounded);
                        let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
                        let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(self.0, self.0));
                        let v = _mm256_blendv_epi8(rounded, nan, is_nan);
                        // Every lane is ≤ 0xffff, so the unsigned saturating pack is exact.
                        _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
                    }
                };
                _mm_storeu_si128(dst.as_mut_ptr().cast(), h);
            }
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

/// Eight 16-bit values of type `dt` widened in registers.
#[inline(always)]
pub(super) fn load16<V: Vf32>(dt: DType, src: &[u16; LANES]) -> V {
    match dt {
        DType::F16 => V::load_f16(src),
        DType::Bf16 => V::load_bf16(src),
    }
}

multiversion! {
    /// dst = src rounded to the 16-bit type, eight at a time in registers where the CPU has
    /// F16C/AVX2 (bit-identical to [`DType::narrow`], which rounds one value per call).
    pub(super) fn narrow(dt: DType, src: &[f32], dst: &mut [u16]) => narrow_generic
}

#[inline(always)]
pub(super) fn narrow_generic<V: Vf32>(dt: DType, src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let (s8, s_tail) = src[..n].as_chunks::<LANES>();
    let (d8, d_tail) = dst[..n].as_chunks_mut::<LANES>();
    for (s, d) in s8.iter().zip(d8) {
        V::load(s).store_narrow(dt, d);
    }
    dt.narrow(s_tail, d_tail);
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

    /// Fresh pseudo-random 32-bit patterns (splitmix64), so the tests need no RNG crate API.
    fn bits32(n: usize, seed: u64) -> Vec<u32> {
        let mut z = seed;
        (0..n)
            .map(|_| {
                z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut x = z;
                x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((x ^ (x >> 31)) >> 16) as u32
            })
            .collect()
    }

    multiversion! {
        fn exp_into(x: &[f32], out: &mut [f32]) => exp_into_generic
    }
    #[inline(always)]
    fn exp_into_generic<V: Vf32>(x: &[f32], out: &mut [f32]) {
        let (x8, _) = x.as_chunks::<LANES>();
        let (o8, _) = out.as_chunks_mut::<LANES>();
        for (a, o) in x8.iter().zip(o8) {
            V::load(a).exp().store(o);
        }
    }

    #[test]
    fn exp_matches_f64_over_the_whole_range_in_every_build() {
        // A sweep from below the subnormal range to past f32::MAX, random values of every
        // magnitude, and the special values.
        let mut xs: Vec<f32> = (0..4200).map(|i| -110.0 + i as f32 * 0.047_3).collect();
        xs.extend(bits32(4000, 7).iter().map(|&b| f32::from_bits(b) % 120.0));
        xs.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            88.72,
            88.723,
            88.73,
            -87.3,
            -103.2,
            -104.5,
            1e-8,
            -1e-30,
        ]);
        xs.resize(xs.len().next_multiple_of(LANES), 0.5);
        let mut fast = vec![f32::NAN; xs.len()];
        exp_into(&xs, &mut fast);
        let mut portable = vec![f32::NAN; xs.len()];
        exp_into_generic::<Portable>(&xs, &mut portable);
        for got in [&fast, &portable] {
            for (&x, &e) in xs.iter().zip(got.iter()) {
                if x.is_nan() {
                    assert!(e.is_nan(), "exp({x}) = {e}");
                    continue;
                }
                let want = (x as f64).exp();
                let w32 = want as f32;
                if w32.is_infinite() {
                    assert_eq!(e, f32::INFINITY, "exp({x})");
                } else {
                    // Four ulps relative, or two of the smallest subnormal in absolute terms.
                    let tol = 4.0 * f32::EPSILON as f64 * want + 2.0 * 1.4e-45;
                    assert!((e as f64 - want).abs() <= tol, "exp({x}) = {e}, want {want}");
                }
            }
        }
    }

    #[test]
    fn narrowing_is_bit_identical_to_dtype_in_every_build() {
        // Random bit patterns (every exponent, NaNs, infinities, subnormals) and exact ties.
        let mut xs: Vec<f32> = bits32(20_003, 11).iter().map(|&b| f32::from_bits(b)).collect();
        xs.extend([
            1.0 + f32::EPSILON * 1024.0, // an f16 tie
            f32::from_bits(0x3f80_8000), // a bf16 tie, even below
            f32::from_bits(0x3f81_8000), // a bf16 tie, odd below
            f32::MAX,
            65520.0, // rounds to f16 ∞
            -0.0,
            f32::NAN,
        ]);
        for dt in [DType::F16, DType::Bf16] {
            let mut fast = vec![dt.poison(); xs.len()];
            narrow(dt, &xs, &mut fast);
            let mut portable = vec![dt.poison(); xs.len()];
            narrow_generic::<Portable>(dt, &xs, &mut portable);
            for got in [&fast, &portable] {
                for (i, (&x, &g)) in xs.iter().zip(got.iter()).enumerate() {
                    let want = dt.from_f32(x);
                    if x.is_nan() {
                        assert!(dt.to_f32(g).is_nan(), "{dt} element {i}: {x} gave {g:#x}");
                    } else {
                        assert_eq!(g, want, "{dt} element {i}: {x} ({:#x})", x.to_bits());
                    }
                }
            }
        }
    }

    multiversion! {
        fn hsum8_into(v: &[[f32; LANES]; LANES], out: &mut [f32; LANES]) => hsum8_into_generic
    }
    #[inline(always)]
    fn hsum8_into_generic<V: Vf32>(v: &[[f32; LANES]; LANES], out: &mut [f32; LANES]) {
        V::hsum8(v.map(|r| V::load(&r))).store(out);
    }

    #[test]
    fn hsum8_sums_each_vector_in_every_build() {
        let b = bits32(64, 5);
        let v: [[f32; LANES]; LANES] =
            std::array::from_fn(|j| std::array::from_fn(|i| (b[j * 8 + i] % 1000) as f32 - 500.0));
        let mut fast = [f32::NAN; LANES];
        hsum8_into(&v, &mut fast);
        let mut portable = [f32::NAN; LANES];
        hsum8_into_generic::<Portable>(&v, &mut portable);
        for j in 0..LANES {
            // Small integers: every order of summation is exact.
            let want: f32 = v[j].iter().sum();
            assert_eq!((fast[j], portable[j]), (want, want), "lane {j}");
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
