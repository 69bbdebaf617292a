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
