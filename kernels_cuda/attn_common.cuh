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

// The query tile and head of a prefill block. The launch is one-dimensional, tiles × H blocks,
// and blocks start in index order: the H / GS KV groups (GS query heads each) go in `nsec`
// sections of consecutive groups, sizes differing by at most one (the first ones larger), as
// many groups per section as keep its K/V in a share of the L2 cache (attn_plan.rs's
// prefill_sections); within a section the host's tiles, longest first, with the section's heads
// side by side. So every head of a section starts its longest tile before any shorter one (at
// 1024 tokens, 8 tiles × 32 heads, head by head left the last wave's blocks running alone) while
// the blocks running at once read the K/V of few enough heads to hit in L2 (FlashAttention-3's
// causal tile order sections the heads by L2 size the same way). Equal sections: a last small
// one would start its longest tiles with little work left beside them.
struct TileHead {
    int tile, head;
};
__device__ __forceinline__ TileHead tile_head(int H, int G, int nsec) {
    const int gs = H / G, ntiles = (int)(gridDim.x / (unsigned)H);
    const int q = G / nsec, r = G % nsec;  // r sections of q + 1 groups, then q groups
    const int big = (q + 1) * gs * ntiles, small = q * gs * ntiles;
    const int b = (int)blockIdx.x;
    const int sec = b < r * big ? b / big : r + (b - r * big) / small;
    const int rem = b - (sec < r ? sec * big : r * big + (sec - r) * small);
    const int h0 = (sec * q + min(sec, r)) * gs, hs = (q + (sec < r ? 1 : 0)) * gs;
    return {rem / hs, h0 + rem % hs};
}
