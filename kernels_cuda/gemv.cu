// ImplA `gemv` (FlashDecoding++ §4, heuristic dataflow: the CUDA-core path for the smallest M).
// y[M, N] = x[M, K] · W[N, K]ᵀ. One warp owns FDPP_ROWS rows of W; each lane streams 16-byte
// chunks of them along K with several loads in flight, and every loaded weight is used for all
// M rows of x (x is tiny and stays in L1). fp32 accumulation, shuffle reduction.
#include "common.cuh"

#ifndef FDPP_ROWS
#define FDPP_ROWS 2
#endif

#ifndef FDPP_INFLIGHT
#define FDPP_INFLIGHT 8
#endif

#ifndef FDPP_KSPLIT
#define FDPP_KSPLIT 1
#endif

constexpr int ROWS = FDPP_ROWS;
constexpr int WARPS = 4;
constexpr int KSPLIT = FDPP_KSPLIT;  // warps sharing one group of rows, each on a slice of K
static_assert(WARPS % KSPLIT == 0, "KSPLIT must divide the warps of a block");
// 16-byte weight loads in flight per lane: ROWS × UNROLL = FDPP_INFLIGHT (covers HBM latency).
constexpr int UNROLL = FDPP_INFLIGHT / ROWS > 0 ? FDPP_INFLIGHT / ROWS : 1;

// UNROLL × ROWS 16-byte weight loads per lane, starting at chunk c0 (zeros past c_end).
__device__ __forceinline__ void load_w(uint4 (&wv)[UNROLL][ROWS], const uint4* const (&wr)[ROWS], int c0,
                                       int c_end) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            wv[u][r] = (c0 + 32 * u < c_end) ? ld_stream16(wr[r] + c0 + 32 * u) : make_uint4(0, 0, 0, 0);
}

// Vector path: K % 8 == 0 and 16-byte aligned rows.
// KSPLIT warps share each group of ROWS rows, each taking a contiguous slice of K, and combine
// their partial sums through shared memory. With N = 4096 (O, FFN2 of Llama2-7B) a warp per row
// leaves ~16 warps per SM, too few loads in flight to cover HBM latency; splitting K restores it.
template <int M>
__device__ __forceinline__ void gemv_vec(const u16* __restrict__ x, const u16* __restrict__ w,
                                         u16* __restrict__ y, int N, int K) {
    __shared__ float red[WARPS][ROWS][M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ks = warp % KSPLIT;
    const int row0 = (blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT) * ROWS;
    const bool active = row0 < N;  // no early return: the K-split reduction below has a barrier
    const int K8 = K >> 3;
    const int per = (K8 + KSPLIT - 1) / KSPLIT;
    const int c_begin = ks * per, c_end = min(K8, c_begin + per);
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = reinterpret_cast<const uint4*>(w + (size_t)min(row0 + r, N - 1) * K);
    const uint4* xv = reinterpret_cast<const uint4*>(x);

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

    const int first = c_begin + lane;
    uint4 wv[UNROLL][ROWS];
    // The weights are never written during generation: the first loads go out before pdl_wait(),
    // while the previous kernel of the step may still be finishing (launch.rs).
    if (active) load_w(wv, wr, first, c_end);
    pdl_wait();
    pdl_trigger();
    for (int c0 = first; active && c0 < c_end; c0 += 32 * UNROLL) {
        if (c0 != first) load_w(wv, wr, c0, c_end);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + 32 * u;
            if (c < c_end) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const uint4 xq = __ldg(xv + (size_t)m * K8 + c);
                    float xf[8];
                    unpack2(xq.x, xf[0], xf[1]);
                    unpack2(xq.y, xf[2], xf[3]);
                    unpack2(xq.z, xf[4], xf[5]);
                    unpack2(xq.w, xf[6], xf[7]);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        float wf[8];
                        unpack2(wv[u][r].x, wf[0], wf[1]);
                        unpack2(wv[u][r].y, wf[2], wf[3]);
                        unpack2(wv[u][r].z, wf[4], wf[5]);
                        unpack2(wv[u][r].w, wf[6], wf[7]);
                        float s = acc[r][m];
#pragma unroll
                        for (int e = 0; e < 8; ++e) s = fmaf(wf[e], xf[e], s);
                        acc[r][m] = s;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
    if (KSPLIT > 1) {
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) red[warp][r][m] = acc[r][m];
        __syncthreads();
        if (ks != 0) return;
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m)
                for (int s2 = 1; s2 < KSPLIT; ++s2) acc[r][m] += red[warp + s2][r][m];
    }
    if (lane == 0 && active)
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (row0 + r < N)
#pragma unroll
                for (int m = 0; m < M; ++m) y[(size_t)m * N + row0 + r] = from_f32(acc[r][m]);
}

#define FDPP_GEMV_ENTRY(MM)                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
        gemv_m##MM(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y,     \
                   int N, int K) {                                                                \
        gemv_vec<MM>(x, w, y, N, K);                                                              \
    }
FDPP_GEMV_ENTRY(1)
FDPP_GEMV_ENTRY(2)
FDPP_GEMV_ENTRY(3)
FDPP_GEMV_ENTRY(4)
FDPP_GEMV_ENTRY(5)
FDPP_GEMV_ENTRY(6)
FDPP_GEMV_ENTRY(7)
FDPP_GEMV_ENTRY(8)

// Scalar path for any K (K = 4097: rows are not 16-byte aligned) and any M ≤ 8: correct, not fast.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
    gemv_scalar(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y, int M, int N, int K) {
    pdl_wait();
    pdl_trigger();
    // Same rows per block as the vector path; the warps of a row group share its rows.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int base = (blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT) * ROWS;
    for (int r = warp % KSPLIT; r < ROWS; r += KSPLIT) {
        const int n = base + r;
        if (n >= N) return;
        const u16* wr = w + (size_t)n * K;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k = lane; k < K; k += 32) {
            const float wk = to_f32(wr[k]);
#pragma unroll
            for (int m = 0; m < 8; ++m)
                if (m < M) acc[m] = fmaf(wk, to_f32(x[(size_t)m * K + k]), acc[m]);
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float v = warp_sum(acc[m]);
            if (lane == 0 && m < M) y[(size_t)m * N + n] = from_f32(v);
        }
    }
}
