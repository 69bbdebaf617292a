// ImplA `gemv` for AMD (FlashDecoding++ §4, heuristic dataflow: the vector-ALU path for the
// smallest M). y[M, N] = x[M, K] · W[N, K]ᵀ. Same dataflow as kernels_cuda/gemv.cu: one wavefront
// owns FDPP_ROWS rows of W; each lane streams 16-byte chunks of them along K with several loads
// in flight, and every loaded weight is used for all M rows of x. The only differences are the
// wavefront width (64 lanes on CDNA, 32 on RDNA) in the stride and in the reduction.
#include "common.h"

#ifndef FDPP_ROWS
#define FDPP_ROWS 2
#endif
#ifndef FDPP_INFLIGHT
#define FDPP_INFLIGHT 8
#endif

constexpr int ROWS = FDPP_ROWS;
constexpr int WAVES = 4;  // wavefronts per block (must match GEMV_WAVES in src/backend/rocm/launch.rs)
constexpr int WAVE = FDPP_WAVE;
constexpr int UNROLL = FDPP_INFLIGHT / ROWS > 0 ? FDPP_INFLIGHT / ROWS : 1;

// Vector path: K % 8 == 0 and 16-byte aligned rows.
template <int M>
__device__ __forceinline__ void gemv_vec(const u16* __restrict__ x, const u16* __restrict__ w,
                                         u16* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x % WAVE;
    const int row0 = (blockIdx.x * WAVES + threadIdx.x / WAVE) * ROWS;
    if (row0 >= N) return;
    const int K8 = K >> 3;
    const u16* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) wr[r] = w + (size_t)min(row0 + r, N - 1) * K;

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

    for (int c0 = lane; c0 < K8; c0 += WAVE * UNROLL) {
        u32x4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                wv[u][r] = (c0 + WAVE * u < K8) ? ld_stream16(wr[r] + 8 * (c0 + WAVE * u)) : u32x4{0, 0, 0, 0};
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + WAVE * u;
            if (c < K8) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const u32x4 xq = ld16(x + (size_t)m * K + 8 * c);
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
        for (int m = 0; m < M; ++m) {
            const float v = wave_sum(acc[r][m]);
            if (lane == 0 && row0 + r < N) y[(size_t)m * N + row0 + r] = from_f32(v);
        }
}

#define FDPP_GEMV_ENTRY(MM)                                                                       \
    extern "C" __global__ void __launch_bounds__(WAVES * WAVE)                                    \
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

// Scalar path for any K (rows not 16-byte aligned) and any M ≤ 8: correct, not fast.
extern "C" __global__ void __launch_bounds__(WAVES * WAVE)
    gemv_scalar(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y, int M, int N, int K) {
    const int lane = threadIdx.x % WAVE;
    const int row0 = (blockIdx.x * WAVES + threadIdx.x / WAVE) * ROWS;
    for (int r = 0; r < ROWS; ++r) {
        const int n = row0 + r;
        if (n >= N) return;
        const u16* wr = w + (size_t)n * K;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k = lane; k < K; k += WAVE) {
            const float wk = to_f32(wr[k]);
#pragma unroll
            for (int m = 0; m < 8; ++m)
                if (m < M) acc[m] = fmaf(wk, to_f32(x[(size_t)m * K + k]), acc[m]);
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float v = wave_sum(acc[m]);
            if (lane == 0 && m < M) y[(size_t)m * N + n] = from_f32(v);
        }
    }
}
