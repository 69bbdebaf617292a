// ImplB `flat_gemm` (FlashDecoding++ §4, "flat GEMM"): tensor cores for small M without padding
// M to 64. We compute Yᵀ[N, M] = W[N, K] · xᵀ[K, M] with mma.sync m16n8k16 so that N fills the
// 16-row side and M (padded to 8, not 64) the 8-column side. Tiles on N (B_N) and K (B_K) only;
// K runs sequentially inside a block (no atomics, no split-K across blocks); W and x tiles are
// staged in shared memory by cp.async with FDPP_STAGES buffers (2 = the paper's double buffering).
// A block covers up to 64 rows of M (MT = 1, 2, 4 or 8 n8-tiles), so that at M <= 64 every W
// byte is read from memory once: before, M > 32 took two blocks along M, each streaming all of W.
//
// Operand loading uses a permutation of K inside each 32-wide chunk: a product summed over K does
// not depend on the order of K, so each thread may read 8 consecutive elements (one 16-byte
// shared-memory load) and feed them to two m16n8k16 steps, provided A (W) and B (x) use the same
// permutation. This avoids ldmatrix and keeps every access 16 bytes wide.
#include "common.cuh"

#ifndef FDPP_BN
#define FDPP_BN 64
#endif
#ifndef FDPP_STAGES
#define FDPP_STAGES 2
#endif
#ifndef FDPP_STAGE_KB
#define FDPP_STAGE_KB 32
#endif

constexpr int BN = FDPP_BN;            // rows of W per block
constexpr int STAGES = FDPP_STAGES;
constexpr int BK = FDPP_STAGE_KB * 512 / BN;  // K columns per stage: the W tile is FDPP_STAGE_KB KiB whatever B_N
constexpr int CH = BK / 8;                    // 16-byte chunks per tile row

// 8 warps per block (src/backend/cuda/sources.rs FLAT_WARPS). Measured on the H100 against 4
// (reports/NOTES.md): where one block per SM streams all of K (N = 4096), 4 warps leave one warp
// per scheduler, which stalls on every shared-memory load and mma between two tiles; 8 warps
// were faster at every shape and M = 8..64 but one tie (QKV M = 24, 44.5 against 44.4 µs).
constexpr int FLAT_WARPS = 8;

static_assert(BN % 16 == 0 && BN >= 32 && BN <= 256, "B_N must be 32, 64, 128 or 256");
static_assert(CH >= 8, "the swizzle permutes 16-byte chunks within 128-byte groups: B_K must be >= 64");

// Warp layout of a block of WARPS warps for MT n8-tiles of M. A warp owns WROWS rows of the
// tile and WKCOLS columns of each K tile; warps that share rows (WK > 1) add their partial sums
// at the end. Few warps along N means each x fragment is read from shared memory by few warps
// (x is read WN times per tile, W once), so WN is as small as the accumulators allow: at most
// 64 fp32 accumulators per thread (MT16 · MT · 4), and each warp needs whole 32-wide K chunks.
template <int MT, int WARPS>
struct Layout {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int WROWS_MAX = MT >= 8 ? 32 : MT == 4 ? 64 : 128;
    static constexpr int WN_ACC = BN / WROWS_MAX > 1 ? BN / WROWS_MAX : 1;  // enough warps for the accumulators
    static constexpr int WN_K = WARPS / (BK / 32) > 1 ? WARPS / (BK / 32) : 1;  // few enough along K
    static constexpr int WN_MAX = WN_ACC > WN_K ? WN_ACC : WN_K;
    static constexpr int WN = WN_MAX < WARPS ? WN_MAX : WARPS;
    static constexpr int WK = WARPS / WN;
    static constexpr int WROWS = BN / WN;
    static constexpr int MT16 = WROWS / 16;  // m16 tiles per warp
    static constexpr int WKCOLS = BK / WK;   // K columns per warp per stage
    static_assert(WROWS % 16 == 0, "whole m16 tiles per warp");
    static_assert(WKCOLS % 32 == 0, "each warp needs whole 32-wide K chunks");
    // The K-split partials are summed through the (then idle) stage buffers: [WK][8·MT][BN + 4]
    // fp32 (the +4 spreads a warp's 4 column pairs over all 32 banks).
    static constexpr int RED_STRIDE = BN + 4;
    static constexpr int RED_BYTES = WK == 1 ? 0 : WK * 8 * MT * RED_STRIDE * 4;
    static_assert(RED_BYTES <= STAGES * (BN + 8 * MT) * BK * 2, "the reduction buffer must fit in the stage buffers");
};

// XOR swizzle of the 16-byte chunk index by the row's parity: a quarter-warp reading rows r and
// r+1 at the same column then hits disjoint 64-byte halves of the 128-byte bank window.
__device__ __forceinline__ int swz(int row, int chunk) { return chunk ^ ((row & 1) << 2); }

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if FDPP_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Stage one K tile of W (BN rows) into shared memory. Rows past N are zero-filled (their outputs
// are not stored), columns past K too (they are summed into real outputs).
template <int THREADS, bool VEC>
__device__ __forceinline__ void load_w_tile(u16* sw, const u16* __restrict__ w, int N, int K, int n0, int kt) {
    const int k0 = kt * BK;
    if (VEC) {
        for (int i = threadIdx.x; i < BN * CH; i += THREADS) {
            const int row = i / CH, ch = i % CH;
            const int n = n0 + row, k = k0 + ch * 8;
            const bool ok = n < N && k < K;
            cp_async16(smem_addr(sw + row * BK + swz(row, ch) * 8), ok ? (const void*)(w + (size_t)n * K + k) : (const void*)w,
                       ok ? 16 : 0);
        }
    } else {
        // Any K (rows not 16-byte aligned): element by element, synchronously. Correct, slow.
        for (int i = threadIdx.x; i < BN * BK; i += THREADS) {
            const int row = i / BK, col = i % BK;
            const int n = n0 + row, k = k0 + col;
            sw[row * BK + swz(row, col / 8) * 8 + col % 8] = (n < N && k < K) ? w[(size_t)n * K + k] : (u16)0;
        }
    }
}

// Stage one K tile of the `rows` live rows of x (rows <= 8·MT, the rest of the block's M range
// is past M). Rows past M are not loaded at all: column m of the product depends on row m of x
// only, and those columns are never stored, so their shared memory may hold anything. Columns
// past K are zero-filled (0 · W is summed into real outputs).
template <int THREADS, bool VEC>
__device__ __forceinline__ void load_x_tile(u16* sx, const u16* __restrict__ x, int rows, int K, int m0, int kt) {
    const int k0 = kt * BK;
    if (VEC) {
        for (int i = threadIdx.x; i < rows * CH; i += THREADS) {
            const int row = i / CH, ch = i % CH;
            const int k = k0 + ch * 8;
            const bool ok = k < K;
            cp_async16(smem_addr(sx + row * BK + swz(row, ch) * 8),
                       ok ? (const void*)(x + (size_t)(m0 + row) * K + k) : (const void*)x, ok ? 16 : 0);
        }
    } else {
        for (int i = threadIdx.x; i < rows * BK; i += THREADS) {
            const int row = i / BK, col = i % BK;
            const int k = k0 + col;
            sx[row * BK + swz(row, col / 8) * 8 + col % 8] = k < K ? x[(size_t)(m0 + row) * K + k] : (u16)0;
        }
    }
}

template <int MT, int WARPS, bool VEC>
__device__ __forceinline__ void flat_gemm(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y,
                                          int M, int N, int K) {
    using L = Layout<MT, WARPS>;
    constexpr int THREADS = L::THREADS, WN = L::WN, WK = L::WK, WROWS = L::WROWS, MT16 = L::MT16, WKCOLS = L::WKCOLS;
    extern __shared__ __align__(16) u16 smem[];
    u16* sw = smem;                               // [STAGES][BN][BK]
    u16* sx = smem + STAGES * BN * BK;            // [STAGES][8·MT][BK]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wn = warp % WN, wk = warp / WN;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * 8 * MT;
    const int KT = (K + BK - 1) / BK;
    // Live rows of x in this block and live n8-tiles (block-uniform): at M = 40 with MT = 8 the
    // last three n8-tiles are neither loaded nor multiplied.
    const int rows = M - m0 < 8 * MT ? M - m0 : 8 * MT;
    const int jlive = (rows + 7) / 8;

    float acc[MT16][MT][4];
#pragma unroll
    for (int i = 0; i < MT16; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // The W tiles of the first stages do not depend on the previous kernel (weights are never
    // written during generation): they are requested before pdl_wait() (launch.rs). Their
    // cp.asyncs join the commit group of stage 0, which is waited for first.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < KT) load_w_tile<THREADS, VEC>(sw + s * BN * BK, w, N, K, n0, s);
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_x_tile<THREADS, VEC>(sx + s * 8 * MT * BK, x, rows, K, m0, s);
        cp_async_commit();
    }

    for (int kt = 0; kt < KT; ++kt) {
        // Refill the slot of tile kt-1 before waiting for tile kt, so that STAGES tiles (not
        // STAGES-1) are in flight while this block waits: the kernel is latency-bound on
        // memory, and bytes in flight per SM is what sets its bandwidth (FlashDecoding++ §4
        // double buffering, one tile deeper for the same shared memory).
        if (kt > 0) __syncthreads();  // every warp is done reading tile kt-1's slot
        {
            const int nk = kt + STAGES - 1;
            const int slot = nk % STAGES;
            if (nk < KT) {
                load_w_tile<THREADS, VEC>(sw + slot * BN * BK, w, N, K, n0, nk);
                load_x_tile<THREADS, VEC>(sx + slot * 8 * MT * BK, x, rows, K, m0, nk);
            }
            cp_async_commit();
        }
        cp_async_wait<STAGES - 1>();
        __syncthreads();  // tile kt (all threads' copies) visible to every warp
        const u16* tw = sw + (kt % STAGES) * BN * BK;
        const u16* tx = sx + (kt % STAGES) * 8 * MT * BK;
#pragma unroll
        for (int c32 = 0; c32 < WKCOLS / 32; ++c32) {
            const int ch = (wk * WKCOLS + 32 * c32) / 8 + t;  // this thread's 16-byte chunk in the 32-wide K chunk
            uint4 b[MT];
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                const int row = 8 * j + g;
                if (j < jlive) b[j] = *reinterpret_cast<const uint4*>(tx + row * BK + swz(row, ch) * 8);
            }
#pragma unroll
            for (int i = 0; i < MT16; ++i) {
                const int r0 = wn * WROWS + 16 * i + g;
                const uint4 p = *reinterpret_cast<const uint4*>(tw + r0 * BK + swz(r0, ch) * 8);
                const uint4 q = *reinterpret_cast<const uint4*>(tw + (r0 + 8) * BK + swz(r0 + 8, ch) * 8);
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    if (j < jlive) {
                        mma16816(acc[i][j], p.x, q.x, p.y, q.y, b[j].x, b[j].y);
                        mma16816(acc[i][j], p.z, q.z, p.w, q.w, b[j].z, b[j].w);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // Accumulator layout of m16n8: c0,c1 at (row g, cols 2t, 2t+1), c2,c3 at (row g+8, same cols);
    // rows are n, columns are m.
    if (WK == 1) {
#pragma unroll
        for (int i = 0; i < MT16; ++i)
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int n = n0 + wn * WROWS + 16 * i + g + (e >= 2 ? 8 : 0);
                    const int m = m0 + 8 * j + 2 * t + (e & 1);
                    if (n < N && m < M) y[(size_t)m * N + n] = from_f32(acc[i][j][e]);
                }
        return;
    }
    // K split over WK warps: every warp puts its partials in red[wk][m][n] (the stage buffers are
    // idle now), then all threads sum over wk, one output each, consecutive threads on consecutive
    // n: the y stores are coalesced.
    constexpr int RS = L::RED_STRIDE;
    float* red = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done reading the last tile
#pragma unroll
    for (int i = 0; i < MT16; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int nl = wn * WROWS + 16 * i + g + (e >= 2 ? 8 : 0);
                const int ml = 8 * j + 2 * t + (e & 1);
                red[(wk * 8 * MT + ml) * RS + nl] = acc[i][j][e];
            }
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * BN; idx += THREADS) {
        const int ml = idx / BN, nl = idx % BN;
        const int n = n0 + nl;
        if (n >= N) continue;
        float s = red[ml * RS + nl];
#pragma unroll
        for (int q = 1; q < WK; ++q) s += red[(q * 8 * MT + ml) * RS + nl];
        y[(size_t)(m0 + ml) * N + n] = from_f32(s);
    }
}

#define FDPP_FLAT_ENTRY(MT, VEC, SUFFIX)                                                                  \
    extern "C" __global__ void __launch_bounds__(FLAT_WARPS * 32)                                         \
        flat_gemm_mt##MT##_##SUFFIX(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y, \
                                    int M, int N, int K) {                                                \
        flat_gemm<MT, FLAT_WARPS, VEC>(x, w, y, M, N, K);                                                 \
    }
// MT = 1, 2, 4 or 8 n8-tiles of M (M up to 64 in one block, so that W is read once), 16-byte
// (v) or scalar (s) loads.
FDPP_FLAT_ENTRY(1, true, v)
FDPP_FLAT_ENTRY(2, true, v)
FDPP_FLAT_ENTRY(4, true, v)
FDPP_FLAT_ENTRY(8, true, v)
FDPP_FLAT_ENTRY(1, false, s)
FDPP_FLAT_ENTRY(2, false, s)
FDPP_FLAT_ENTRY(4, false, s)
FDPP_FLAT_ENTRY(8, false, s)
