// What both attention kernels need beyond common.cuh (still header-free for NVRTC).
#pragma once

// +inf as a constant expression (no math.h under NVRTC without headers).
#define FDPP_INF __int_as_float(0x7f800000)

// Finite: neither inf nor NaN (NaN compares false).
__device__ __forceinline__ bool finite(float x) { return fabsf(x) < FDPP_INF; }

// Ordered key of a float: unsigned comparison of keys follows float comparison, and the key 0
// lies below −inf, so a zero-initialised workspace means "no score seen".
__device__ __forceinline__ unsigned fkey(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unkey(unsigned k) {
    if (k == 0) return -FDPP_INF;
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The tiled prefill kernels' softmax helpers (attn_prefill.cu, attn_prefill_hopper.cu).
// 2^x with the hardware approximation (2 ulp; the fp32 accumulators and the 16-bit P operand
// absorb it).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats to a packed pair of 16-bit elements, `lo` in the low half.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if FDPP_BF16
    asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
#else
    asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
#endif
    return r;
}
