// fdpp's HIP compatibility header: what maps one to one from kernels_cuda/common.cuh, written
// without inline PTX. hiprtc provides the HIP device headers itself; hipcc needs the include.
// Element storage is the raw 16-bit pattern (unsigned short); FDPP_BF16 selects bf16 over f16.
#pragma once
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

typedef unsigned short u16;
typedef unsigned int u32;
// A 16-byte vector as clang sees it: loads of it become one global_load_dwordx4.
typedef u32 u32x4 __attribute__((ext_vector_type(4)));

#ifndef FDPP_BF16
#define FDPP_BF16 0
#endif

// The wavefront width the compiler targets: 64 on CDNA (gfx9), 32 by default on RDNA (gfx10+).
// The host launches with the device's reported width, which must agree (checked in Rust).
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define FDPP_WAVE __AMDGCN_WAVEFRONT_SIZE
#else
#define FDPP_WAVE 64
#endif

__device__ __forceinline__ float bits_to_f32(u32 b) { return __builtin_bit_cast(float, b); }

// Widen the two 16-bit elements packed in `u` (low half first).
__device__ __forceinline__ void unpack2(u32 u, float& lo, float& hi) {
#if FDPP_BF16
    // bf16 is the top half of an f32: widening is a shift, exact.
    lo = bits_to_f32(u << 16);
    hi = bits_to_f32(u & 0xffff0000u);
#else
    lo = (float)__builtin_bit_cast(_Float16, (u16)(u & 0xffffu));
    hi = (float)__builtin_bit_cast(_Float16, (u16)(u >> 16));
#endif
}

__device__ __forceinline__ float to_f32(u16 v) {
#if FDPP_BF16
    return bits_to_f32(((u32)v) << 16);
#else
    return (float)__builtin_bit_cast(_Float16, v);
#endif
}

// Round to nearest even, as the CPU reference narrows.
__device__ __forceinline__ u16 from_f32(float f) {
#if FDPP_BF16
    u32 b = __builtin_bit_cast(u32, f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);  // NaN stays NaN
    b += 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
#else
    return __builtin_bit_cast(u16, (_Float16)f);
#endif
}

// 16-byte weight load marked non-temporal: weights are streamed once and should not evict x
// from the caches (the role of ld.global.nc.L1::no_allocate on CUDA).
__device__ __forceinline__ u32x4 ld_stream16(const void* p) {
    return __builtin_nontemporal_load(reinterpret_cast<const u32x4*>(p));
}

__device__ __forceinline__ u32x4 ld16(const void* p) { return *reinterpret_cast<const u32x4*>(p); }

// Sum over the whole wavefront (64 lanes on CDNA): butterfly with __shfl_xor, every lane ends
// with the total.
__device__ __forceinline__ float wave_sum(float v) {
#pragma unroll
    for (int o = FDPP_WAVE / 2; o > 0; o >>= 1) v += __shfl_xor(v, o, FDPP_WAVE);
    return v;
}
