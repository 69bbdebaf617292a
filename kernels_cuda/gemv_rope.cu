// The decode step's QKV GEMV with the rotary and the KV append as its epilogue: q [M, H·D] and the
// new tokens' k and v in the paged pools, from rmsnorm(residual) · W'ᵀ with the norm's γ folded
// into W' (gemv.cu's RMS_IN), in one launch instead of gemv_rms_m* then layer.cu's qkv_rope.
//
// Why: in a decode step qkv_rope is a kernel of a few microseconds between the QKV GEMV and
// attention, and attention cannot start before it ends; session 4's ablation put the rotation at
// about 0.1 ms of a Llama2-7B step (3 µs a layer, reports/NOTES.md). FlashDecoding++ §4 folds a
// decode GEMM's small neighbours into it; this is that fold for the rotary.
//
// Why a file of its own: gemv.cu and common.cuh are hashed into every tuning profile
// (sources.rs kernel_hash), and an edit there would make every profile refuse to load until
// re-tuned. So this file includes gemv.cu for its helpers, built with the GLU entries' layout
// (sources::GEMV_GLU_LAYOUT: two rows per row group, K split over 4 warps), and has its own copy
// of the K loop, the same dataflow and the same order of every sum as gemv_vec's RMS_IN, so that
// its products are bit for bit gemv_rms_m*'s at that layout (tests/gpu_cuda_fused.rs).
//
// Row group j < (H + G)·D/2 takes the pair (i, i + D/2) of q or k head j / (D/2) (rows head·D + i
// and + D/2 of W) and rotates it in the rotate-half form; the later groups take two adjacent v
// rows. The epilogue is qkv_rope's arithmetic on gemv's rounded output: the bias added in fp32,
// sincosf (not the fast intrinsic: θ reaches thousands of radians), _rn products.
#include "gemv.cu"

static_assert(ROWS == 2 && KSPLIT == WARPS, "built with GEMV_GLU_LAYOUT: a row pair per block");

// The destinations and the rotary (qkv_rope's arguments in its slots form).
struct RopeOut {
    const u16* bias;    // [(H + 2G)·D] or null
    u16* q;             // [M, H·D]
    u16* kp;            // K pool, rows of G·D
    u16* vp;            // V pool
    const int* pos;     // [M] positions
    const float* freq;  // [D/2] inverse frequencies
    const int* slots;   // [M] pool rows
    int H, G, D;
};

// W's rows of row group j: a rotated pair, or two adjacent v rows.
__device__ __forceinline__ void rope_rows(const RopeOut& ro, int j, int& ra, int& rb) {
    const int half = ro.D >> 1, rot = (ro.H + ro.G) * half;
    if (j < rot) {
        const int head = j / half;
        ra = head * ro.D + (j - head * half);
        rb = ra + half;
    } else {
        ra = (ro.H + ro.G) * ro.D + 2 * (j - rot);
        rb = ra + 1;
    }
}

// Token m's outputs of row group j from its normalised products a0, a1.
__device__ __forceinline__ void rope_store(const RopeOut& ro, int j, int m, float a0, float a1) {
    const int half = ro.D >> 1;
    int ra, rb;
    rope_rows(ro, j, ra, rb);
    // What qkv_rope reads: the product as gemv stored it (16 bits), the bias added in fp32.
    float x1 = round16(a0), x2 = round16(a1);
    if (ro.bias) {
        x1 += to_f32(ro.bias[ra]);
        x2 += to_f32(ro.bias[rb]);
    }
    const size_t slot = (size_t)ro.slots[m];
    if (j < (ro.H + ro.G) * half) {
        const int head = ra / ro.D, i = ra - head * ro.D;
        float sn, cs;
        sincosf(__fmul_rn((float)ro.pos[m], ro.freq[i]), &sn, &cs);
        const float o1 = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
        const float o2 = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
        u16* dst = head < ro.H ? ro.q + (size_t)m * ro.H * ro.D + ra : ro.kp + slot * ro.G * ro.D + (ra - ro.H * ro.D);
        dst[0] = from_f32(o1);
        dst[half] = from_f32(o2);
    } else {
        u16* dst = ro.vp + slot * ro.G * ro.D + (ra - (ro.H + ro.G) * ro.D);
        dst[0] = from_f32(x1);
        dst[1] = from_f32(x2);
    }
}

// One row pair per block (its 4 warps split K); N = (H + 2G)·D rows of W, N / 2 blocks.
template <int M>
__device__ __forceinline__ void gemv_rope(const u16* __restrict__ x, const u16* __restrict__ w, int N, int K,
                                          float eps, const RopeOut& ro) {
    __shared__ float red[WARPS][ROWS][M];
    __shared__ float red_sq[WARPS][M];
    const int lane = threadIdx.x & 31, ks = threadIdx.x >> 5, j = blockIdx.x;
    const bool active = j < N / 2;  // no early return: the K-split reduction has a barrier
    const int K8 = K >> 3, per = (K8 + KSPLIT - 1) / KSPLIT;
    const int c_begin = ks * per, c_end = min(K8, c_begin + per);
    int ra, rb;
    rope_rows(ro, min(j, N / 2 - 1), ra, rb);
    const uint4* wr[ROWS] = {reinterpret_cast<const uint4*>(w + (size_t)ra * K),
                             reinterpret_cast<const uint4*>(w + (size_t)rb * K)};
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float acc[ROWS][M], sq[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = sq[m] = 0.f;
    const int first = c_begin + lane;
    uint4 wv[UNROLL][ROWS];
    // Weights before the wait (nothing writes them), as gemv_vec does.
    if (active) load_w(wv, wr, first, c_end);
    pdl_wait();
    pdl_trigger();
    for (int c0 = first; active && c0 < c_end; c0 += 32 * UNROLL) {
        if (c0 != first) load_w(wv, wr, c0, c_end);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + 32 * u;
            if (c >= c_end) continue;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const uint4 xq = __ldg(xv + (size_t)m * K8 + c);
                float xf[8];
                unpack2(xq.x, xf[0], xf[1]);
                unpack2(xq.y, xf[2], xf[3]);
                unpack2(xq.z, xf[4], xf[5]);
                unpack2(xq.w, xf[6], xf[7]);
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
    // The split warps' sums, added in gemv_vec's order (warp 0's, then 1's, 2's, 3's).
#pragma unroll
    for (int m = 0; m < M; ++m) {
        acc[0][m] = warp_sum(acc[0][m]);
        acc[1][m] = warp_sum(acc[1][m]);
        sq[m] = warp_sum(sq[m]);
    }
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            red[ks][0][m] = acc[0][m];
            red[ks][1][m] = acc[1][m];
            red_sq[ks][m] = sq[m];
        }
    }
    __syncthreads();
    if (ks != 0 || lane != 0 || !active) return;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        for (int s2 = 1; s2 < KSPLIT; ++s2) {
            acc[0][m] += red[s2][0][m];
            acc[1][m] += red[s2][1][m];
            sq[m] += red_sq[s2][m];
        }
        const float inv = 1.f / sqrtf(sq[m] / (float)K + eps);  // add_rmsnorm_v's formula
        rope_store(ro, j, m, acc[0][m] * inv, acc[1][m] * inv);
    }
}

#define FDPP_GEMV_ROPE_ENTRY(MM)                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv_rms_rope_m##MM(                       \
        const u16* __restrict__ residual, const u16* __restrict__ w, int N, int K, float eps,            \
        const u16* __restrict__ bias, u16* __restrict__ q, u16* __restrict__ kp, u16* __restrict__ vp,   \
        const int* __restrict__ pos, const float* __restrict__ freq, const int* __restrict__ slots, int H, \
        int G, int D) {                                                                                 \
        gemv_rope<MM>(residual, w, N, K, eps, RopeOut{bias, q, kp, vp, pos, freq, slots, H, G, D});      \
    }
FDPP_GEMV_ROPE_ENTRY(1)
FDPP_GEMV_ROPE_ENTRY(2)
FDPP_GEMV_ROPE_ENTRY(3)
FDPP_GEMV_ROPE_ENTRY(4)
FDPP_GEMV_ROPE_ENTRY(5)
FDPP_GEMV_ROPE_ENTRY(6)
FDPP_GEMV_ROPE_ENTRY(7)
FDPP_GEMV_ROPE_ENTRY(8)
