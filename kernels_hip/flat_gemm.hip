// ImplB `flat_gemm` for AMD CDNA (FlashDecoding++ §4, "flat GEMM"): matrix cores for small M
// without padding M to 64. As on CUDA we compute Yᵀ[N, M] = W[N, K] · xᵀ[K, M] so that N fills
// the A side of the matrix instruction, but with MFMA v_mfma_f32_16x16x16{f16,bf16_1k}: M is
// padded to 16 (the instruction's narrowest side on CDNA; CUDA's mma.sync allowed 8).
// Tiles on N (B_N) and K only; K runs sequentially inside a block (no atomics, no split-K across
// blocks).
//
// What differs from kernels_cuda/flat_gemm.cu and why:
// - No shared-memory staging and no double buffering. MFMA reads its operands from VGPRs and
//   CDNA has no cp.async; each W element is used by exactly one wavefront, so staging it through
//   LDS would only add a copy. Lanes load W and x straight from global memory into registers with
//   16-byte loads, several chunks per iteration so that loads stay in flight. LDS is used only to
//   sum the partials of wavefronts that split K (B_N = 32).
// - The same K permutation trick: a sum over K does not depend on the order of K, so each lane
//   loads 8 consecutive K elements (one 16-byte load) and feeds them to two MFMA steps, A (W) and
//   B (x) using the same permutation.
// MFMA needs wave64 and a CDNA target (gfx908/gfx90a/gfx94x); RDNA would need WMMA, which the
// compiler CI has (ROCm 5.2) cannot target, so other targets fail to compile here on purpose and
// the host reports flat_gemm unsupported on them.
#include "common.h"

#if defined(__HIP_DEVICE_COMPILE__) && !(defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#error "fdpp flat_gemm needs CDNA2/CDNA3 MFMA (gfx90a, gfx94x); no WMMA path for RDNA yet"
#endif

#ifndef FDPP_BN
#define FDPP_BN 64
#endif
#ifndef FDPP_UNROLL
#define FDPP_UNROLL 2
#endif

constexpr int BN = FDPP_BN;                  // rows of W per block
constexpr int WAVES = 4;                     // wavefronts per block (FLAT_WAVES in launch.rs)
constexpr int WAVE = 64;                     // MFMA lane layout below assumes wave64
constexpr int THREADS = WAVES * WAVE;
constexpr int WN = (BN / 16) < WAVES ? (BN / 16) : WAVES;  // wavefronts along N
constexpr int WK = WAVES / WN;                              // wavefronts splitting K
constexpr int WROWS = BN / WN;                              // W rows per wavefront (multiple of 16)
constexpr int NT = WROWS / 16;                              // 16-row N tiles per wavefront
constexpr int U = FDPP_UNROLL;  // 32-wide K chunks in flight per lane (FLAT_UNROLL in launch.rs models it)

static_assert(BN % 16 == 0 && BN >= 32 && BN <= 256, "B_N must be 32, 64, 128 or 256");
static_assert(WN * WK == WAVES, "wavefronts must tile N x K exactly");

typedef _Float16 half4_t __attribute__((ext_vector_type(4)));
typedef short short4_t __attribute__((ext_vector_type(4)));
typedef float float4_t __attribute__((ext_vector_type(4)));
typedef u32 u32x2 __attribute__((ext_vector_type(2)));

// D += A·B for one 16x16x16 step; a and b each carry 4 K elements of this lane's row/column.
__device__ __forceinline__ float4_t mfma16(u32x2 a, u32x2 b, float4_t c) {
#if FDPP_BF16
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(short4_t, a), __builtin_bit_cast(short4_t, b),
                                                     c, 0, 0, 0);
#else
    return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(half4_t, a), __builtin_bit_cast(half4_t, b), c, 0,
                                                 0, 0);
#endif
}

// 8 consecutive elements of row `row` from column k, zero past the edges.
template <bool VEC>
__device__ __forceinline__ u32x4 load8(const u16* __restrict__ p, int row, int rows, int k, int K) {
    if (row >= rows) return u32x4{0, 0, 0, 0};
    const u16* r = p + (size_t)row * K;
    if (VEC) return k < K ? ld16(r + k) : u32x4{0, 0, 0, 0};
    u16 e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = (k + i < K) ? r[k + i] : (u16)0;
    return u32x4{e[0] | ((u32)e[1] << 16), e[2] | ((u32)e[3] << 16), e[4] | ((u32)e[5] << 16), e[6] | ((u32)e[7] << 16)};
}

template <int MT, bool VEC>
__device__ __forceinline__ void flat_gemm(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y,
                                          int M, int N, int K) {
    extern __shared__ float red[];  // [WK-1][WN][64][NT*MT*4], only when WK > 1
    const int wave = threadIdx.x / WAVE, lane = threadIdx.x % WAVE;
    const int r16 = lane % 16, q = lane / 16;  // MFMA 16x16x16: lane holds row r16, K slice q
    const int wn = wave % WN, wk = wave / WN;
    const int n0 = blockIdx.x * BN + wn * WROWS, m0 = blockIdx.y * 16 * MT;
    const int chunks = (K + 31) / 32;

    float4_t acc[NT][MT];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j) acc[i][j] = float4_t{0.f, 0.f, 0.f, 0.f};

    for (int c0 = wk; c0 < chunks; c0 += WK * U) {
        u32x4 a[U][NT], b[U][MT];
        // All loads of U chunks first, then the MFMAs: U·(NT+MT) 16-byte loads in flight.
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = 32 * (c0 + WK * u) + 8 * q;
#pragma unroll
            for (int i = 0; i < NT; ++i) a[u][i] = load8<VEC>(w, n0 + 16 * i + r16, N, k, K);
#pragma unroll
            for (int j = 0; j < MT; ++j) b[u][j] = load8<VEC>(x, m0 + 16 * j + r16, M, k, K);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    acc[i][j] = mfma16(a[u][i].xy, b[u][j].xy, acc[i][j]);
                    acc[i][j] = mfma16(a[u][i].zw, b[u][j].zw, acc[i][j]);
                }
    }

    if (WK > 1) {
        constexpr int PER = NT * MT * 4;
        if (wk > 0) {
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        red[(((wk - 1) * WN + wn) * WAVE + lane) * PER + (i * MT + j) * 4 + e] = acc[i][j][e];
        }
        __syncthreads();
        if (wk > 0) return;
        for (int s = 1; s < WK; ++s)
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[i][j][e] += red[(((s - 1) * WN + wn) * WAVE + lane) * PER + (i * MT + j) * 4 + e];
    }

    // MFMA 16x16 accumulator layout: lane holds rows 4q..4q+3 (here n) of column r16 (here m).
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int m = m0 + 16 * j + r16;
            if (m >= M) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = n0 + 16 * i + 4 * q + e;
                if (n < N) y[(size_t)m * N + n] = from_f32(acc[i][j][e]);
            }
        }
}

#define FDPP_FLAT_ENTRY(MT, VEC, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                             \
        flat_gemm_mt##MT##_##SUFFIX(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y, \
                                    int M, int N, int K) {                                            \
        flat_gemm<MT, VEC>(x, w, y, M, N, K);                                                         \
    }
FDPP_FLAT_ENTRY(1, true, v)
FDPP_FLAT_ENTRY(2, true, v)
FDPP_FLAT_ENTRY(4, true, v)
FDPP_FLAT_ENTRY(1, false, s)
FDPP_FLAT_ENTRY(2, false, s)
FDPP_FLAT_ENTRY(4, false, s)
