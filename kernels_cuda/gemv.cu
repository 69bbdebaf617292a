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

// 1: no RMS_GLU entries in this build (the tuned layouts, where ROWS may differ from 2).
#ifndef FDPP_GLU_OFF
#define FDPP_GLU_OFF 1
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

// What the vector path fuses around the product (FlashDecoding++ §4 treats a decode step's small
// ops as overheads of the GEMV it feeds or follows; fusing them removes a kernel boundary at
// which the next GEMV could not yet stream its weights):
// - PLAIN: y = x · Wᵀ.
// - RMS_IN: x is the residual stream and W was scaled by the norm's γ at load (W' = W·diag(γ)), so
//   rmsnorm(x)·γ · Wᵀ = inv · (x · W'ᵀ) with inv = 1/rms(x): the loop is the plain one plus the
//   sum of squares of the x chunks it already unpacks, and inv scales the result at the end. Not
//   bit for bit add_rmsnorm + gemv (x·inv is never rounded to 16 bits; W' is rounded once).
// - RESIDUAL_OUT: y is the residual stream: y = round(y + round(x · Wᵀ)), add_rmsnorm_v's add.
// - RMS_GLU: RMS_IN over the fused gate/up weights [2N, K] with silu_mul as the epilogue: each
//   row group (ROWS = 2) takes gate row n and up row N + n and writes
//   y[m, n] = silu(round(g)) · round(u) into y [M, N], what silu_mul computes from RMS_IN's output.
constexpr int PLAIN = 0, RMS_IN = 1, RESIDUAL_OUT = 2, RMS_GLU = 3;
static_assert(ROWS == 2 || FDPP_GLU_OFF, "the GLU entries need 2 rows per warp (gemv_fused.rs builds them so)");

// The 16-bit value a rounded store and reload of f gives (add_rmsnorm_v's output, read back).
__device__ __forceinline__ float round16(float f) { return to_f32(from_f32(f)); }

// Vector path: K % 8 == 0 and 16-byte aligned rows.
// KSPLIT warps share each group of ROWS rows, each taking a contiguous slice of K, and combine
// their partial sums through shared memory. With N = 4096 (O, FFN2 of Llama2-7B) a warp per row
// leaves ~16 warps per SM, too few loads in flight to cover HBM latency; splitting K restores it.
// eps is read by the RMS modes (RMS_IN, RMS_GLU) only.
template <int M, int MODE>
__device__ __forceinline__ void gemv_vec(const u16* __restrict__ x, const u16* __restrict__ w,
                                         u16* __restrict__ y, int N, int K, float eps) {
    __shared__ float red[WARPS][ROWS][M];
    __shared__ float red_sq[WARPS][M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ks = warp % KSPLIT;
    constexpr bool GLU = MODE == RMS_GLU, RMS = MODE == RMS_IN || GLU;
    // The row group's first row of W and of y; RMS_GLU: its gate/up pair n, rows n and N + n of W.
    const int row0 = (blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT) * (GLU ? 1 : ROWS);
    const bool active = row0 < N;  // no early return: the K-split reduction below has a barrier
    const int K8 = K >> 3;
    const int per = (K8 + KSPLIT - 1) / KSPLIT;
    const int c_begin = ks * per, c_end = min(K8, c_begin + per);
    const uint4* wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        wr[r] = reinterpret_cast<const uint4*>(w + (GLU ? (size_t)min(row0, N - 1) + (size_t)r * N
                                                        : (size_t)min(row0 + r, N - 1)) * K);
    const uint4* xv = reinterpret_cast<const uint4*>(x);

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    float sq[M];  // the RMS modes: Σx² of each row of x over this lane's chunks
#pragma unroll
    for (int m = 0; m < M; ++m) sq[m] = 0.f;

    const int first = c_begin + lane;
    uint4 wv[UNROLL][ROWS];
    // The weights are never written during generation: the first loads go out before pdl_wait(),
    // while the previous kernel of the step may still be finishing (launch.rs).
    if (active) load_w(wv, wr, first, c_end);
    pdl_wait();
    pdl_trigger();
    // RESIDUAL_OUT: the residual elements this lane adds to, requested now (after the wait:
    // an earlier kernel wrote them) so that the epilogue does not wait a memory round trip
    // (measured on the H100: O 18.0 µs with the load in the epilogue, 15.7 µs with it here,
    // the plain gemv's time).
    u16 res[ROWS][M];
    if (MODE == RESIDUAL_OUT && lane == 0 && active && (KSPLIT == 1 || ks == 0))
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) res[r][m] = row0 + r < N ? y[(size_t)m * N + row0 + r] : 0;
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
                    if (RMS)
#pragma unroll
                        for (int e = 0; e < 8; ++e) sq[m] = fmaf(xf[e], xf[e], sq[m]);
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
    if (RMS)
#pragma unroll
        for (int m = 0; m < M; ++m) sq[m] = warp_sum(sq[m]);
    if (KSPLIT > 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) red[warp][r][m] = acc[r][m];
            if (RMS)
#pragma unroll
                for (int m = 0; m < M; ++m) red_sq[warp][m] = sq[m];
        }
        __syncthreads();
        if (ks != 0) return;
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m)
                for (int s2 = 1; s2 < KSPLIT; ++s2) acc[r][m] += red[warp + s2][r][m];
        if (RMS)
#pragma unroll
            for (int m = 0; m < M; ++m)
                for (int s2 = 1; s2 < KSPLIT; ++s2) sq[m] += red_sq[warp + s2][m];
    }
    // The KSPLIT warps of a row group covered all K chunks between them: sq is Σx² over the row.
    if (RMS)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float inv = 1.f / sqrtf(sq[m] / (float)K + eps);  // add_rmsnorm_v's formula
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r][m] *= inv;
        }
    if (GLU) {
        if (lane == 0 && active)
#pragma unroll
            for (int m = 0; m < M; ++m)
                y[(size_t)m * N + row0] = from_f32(silu(round16(acc[0][m])) * round16(acc[ROWS - 1][m]));
        return;
    }
    if (lane == 0 && active)
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (row0 + r < N)
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    u16* out = y + (size_t)m * N + row0 + r;
                    if (MODE == RESIDUAL_OUT)
                        // Read (above) and written by this thread alone: in place is safe.
                        *out = from_f32(to_f32(res[r][m]) + round16(acc[r][m]));
                    else
                        *out = from_f32(acc[r][m]);
                }
}

#define FDPP_GEMV_ENTRY(MM)                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
        gemv_m##MM(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y,     \
                   int N, int K) {                                                                \
        gemv_vec<MM, PLAIN>(x, w, y, N, K, 0.f);                                                  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
        gemv_rms_m##MM(const u16* __restrict__ residual, const u16* __restrict__ w,               \
                       u16* __restrict__ y, int N, int K, float eps) {                            \
        gemv_vec<MM, RMS_IN>(residual, w, y, N, K, eps);                                          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
        gemv_res_m##MM(const u16* __restrict__ x, const u16* __restrict__ w,                      \
                       u16* __restrict__ residual, int N, int K) {                                \
        gemv_vec<MM, RESIDUAL_OUT>(x, w, residual, N, K, 0.f);                                    \
    }
FDPP_GEMV_ENTRY(1)
FDPP_GEMV_ENTRY(2)
FDPP_GEMV_ENTRY(3)
FDPP_GEMV_ENTRY(4)
FDPP_GEMV_ENTRY(5)
FDPP_GEMV_ENTRY(6)
FDPP_GEMV_ENTRY(7)
FDPP_GEMV_ENTRY(8)

#if !FDPP_GLU_OFF
// y[M, N] = silu(gate) · up of rmsnorm(residual) · W'ᵀ, W' = [gate; up] [2N, K] with γ folded in.
#define FDPP_GEMV_GLU_ENTRY(MM)                                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
        gemv_rms_glu_m##MM(const u16* __restrict__ residual, const u16* __restrict__ w,           \
                           u16* __restrict__ y, int N, int K, float eps) {                        \
        gemv_vec<MM, RMS_GLU>(residual, w, y, N, K, eps);                                         \
    }
FDPP_GEMV_GLU_ENTRY(1)
FDPP_GEMV_GLU_ENTRY(2)
FDPP_GEMV_GLU_ENTRY(3)
FDPP_GEMV_GLU_ENTRY(4)
FDPP_GEMV_GLU_ENTRY(5)
FDPP_GEMV_GLU_ENTRY(6)
FDPP_GEMV_GLU_ENTRY(7)
FDPP_GEMV_GLU_ENTRY(8)
#endif

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
