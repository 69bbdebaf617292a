// Softmax-input histograms for calibration (FlashDecoding++ §3): every score x = q·k/√d that a
// causal attention step computes, binned on the device. One block per (query tile, head), as the
// prefill kernel's tiles (the host's int4 list: sequence, first row, first position, rows); the
// block bins into shared memory and adds its bins to the global histogram once. Exact extremes
// through ordered-key atomics, exact count in 64 bits.
//
// Global histogram layout per histogram: [under, bins..., over] u32; then per histogram the
// (min key, max key) pair (the host sets the min keys to all ones first); then one u64 count per histogram.
#include "common.cuh"
#include "attn_common.cuh"

#ifndef FDPP_D
#define FDPP_D 128
#endif

constexpr int D = FDPP_D;
constexpr int THREADS = 128;
constexpr int LPT = D / 8;         // lanes per key row
constexpr int NG = THREADS / LPT;  // key groups per block
constexpr int MAX_BINS = 4096;     // shared-memory bins (host refuses more)

extern "C" __global__ void __launch_bounds__(THREADS)
attn_score_hist(const u16* __restrict__ q, const u16* __restrict__ kp, const int* __restrict__ table,
                const int4* __restrict__ tiles, int max_pages, int page_size, int H, int G, float scale, float lo,
                float hi, float width, int bins, int per_head, unsigned* __restrict__ hist,
                unsigned* __restrict__ ext, unsigned long long* __restrict__ counts) {
    __shared__ unsigned sh[MAX_BINS + 2];
    __shared__ unsigned smin, smax;
    __shared__ unsigned long long scount;
    for (int i = threadIdx.x; i < bins + 2; i += THREADS) sh[i] = 0;
    if (threadIdx.x == 0) {
        smin = 0xffffffffu;
        smax = 0;
        scount = 0;
    }
    __syncthreads();
    const int4 t = tiles[blockIdx.x];
    const int h = blockIdx.y, kvh = h / (H / G);
    const int* pages = table + (size_t)t.x * max_pages;
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    unsigned lmin = 0xffffffffu, lmax = 0;
    unsigned long long lcount = 0;
    for (int r = 0; r < t.w; ++r) {
        const int pos = t.z + r;
        float qf[8];
        const uint4 qv = *reinterpret_cast<const uint4*>(q + ((size_t)(t.y + r) * H + h) * D + li * 8);
        unpack2(qv.x, qf[0], qf[1]);
        unpack2(qv.y, qf[2], qf[3]);
        unpack2(qv.z, qf[4], qf[5]);
        unpack2(qv.w, qf[6], qf[7]);
        // Keys 0..=pos; the trip count is the same for every group (whole-warp shuffles).
        for (int k0 = 0; k0 <= pos; k0 += NG) {
            const int key = k0 + gid;
            const bool ok = key <= pos;
            float d = 0.f;
            if (ok) {
                const int page = pages[key / page_size];
                const uint4 kv = *reinterpret_cast<const uint4*>(
                    kp + ((size_t)page * page_size + key % page_size) * G * D + (size_t)kvh * D + li * 8);
                float kf[8];
                unpack2(kv.x, kf[0], kf[1]);
                unpack2(kv.y, kf[2], kf[3]);
                unpack2(kv.z, kf[4], kf[5]);
                unpack2(kv.w, kf[6], kf[7]);
#pragma unroll
                for (int i = 0; i < 8; ++i) d += qf[i] * kf[i];
            }
#pragma unroll
            for (int o = LPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            if (ok && li == 0) {
                const float x = d * scale;
                // HistSpec::bin's rule: floor((x − lo) / width) inside [lo, hi), clamped to
                // the last bin; below lo under, at or past hi (or NaN) over.
                int b;
                if (x >= lo && x < hi) {
                    b = 1 + min((int)floorf((x - lo) / width), bins - 1);
                } else {
                    b = x < lo ? 0 : bins + 1;
                }
                atomicAdd(&sh[b], 1u);
                const unsigned k = fkey(x);
                lmin = min(lmin, k);
                lmax = max(lmax, k);
                ++lcount;
            }
        }
    }
    if (li == 0) {
        atomicMin(&smin, lmin);
        atomicMax(&smax, lmax);
        atomicAdd(&scount, lcount);
    }
    __syncthreads();
    const int which = per_head ? h : 0;
    unsigned* gh = hist + (size_t)which * (bins + 2);
    for (int i = threadIdx.x; i < bins + 2; i += THREADS)
        if (sh[i]) atomicAdd(&gh[i], sh[i]);
    if (threadIdx.x == 0 && scount) {
        atomicMin(&ext[2 * which], smin);
        atomicMax(&ext[2 * which + 1], smax);
        atomicAdd(&counts[which], scount);
    }
}
