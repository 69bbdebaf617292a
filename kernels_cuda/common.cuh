// Shared helpers for fdpp's CUDA kernels. Header-free on purpose: NVRTC compiles these without
// the CUDA toolkit headers, so CI can compile every kernel from the NVRTC wheel alone.
// Element storage is the raw 16-bit pattern (unsigned short); FDPP_BF16 selects bf16 over f16.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef FDPP_BF16
#define FDPP_BF16 0
#endif

// Widen the two 16-bit elements packed in `u` (low half first).
__device__ __forceinline__ void unpack2(u32 u, float& lo, float& hi) {
#if FDPP_BF16
    // bf16 is the top half of an f32: widening is a shift, exact.
    lo = __uint_as_float(u << 16);
    hi = __uint_as_float(u & 0xffff0000u);
#else
    asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h; }"
        : "=f"(lo), "=f"(hi) : "r"(u));
#endif
}

__device__ __forceinline__ float to_f32(u16 v) {
#if FDPP_BF16
    return __uint_as_float(((u32)v) << 16);
#else
    float f;
    asm("{ .reg .f16 h;\n mov.b16 h, %1;\n cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
    return f;
#endif
}

// Round to nearest even, as the CPU reference narrows.
__device__ __forceinline__ u16 from_f32(float f) {
    u16 v;
#if FDPP_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
#else
    asm("{ .reg .f16 h;\n cvt.rn.f16.f32 h, %1;\n mov.b16 %0, h; }" : "=h"(v) : "f"(f));
#endif
    return v;
}

// 16-byte load that bypasses L1: weights are streamed once and must not evict x from L1.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// cp.async of 16 bytes; src_bytes = 0 zero-fills the destination (rows/columns past the edge).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// SiLU (x·σ(x)) as silu_mul (layer.cu) and the gemv's GLU epilogue (gemv.cu) compute it.
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Programmatic dependent launch (sm_90+; src/backend/cuda/launch.rs). A chained kernel may start
// while the previous one finishes: before pdl_wait() it may only read memory that no kernel of
// the step writes (weights); pdl_wait() returns once the previous grid has completed and its
// writes are visible. pdl_trigger() lets the next chained kernel start launching its blocks.
// Without the launch attribute (or before sm_90) both are no-ops in effect.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
