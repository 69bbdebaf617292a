// Greedy token choice on the device: one block per row of logits writes the index of the row's
// largest value (the lowest index among equals, as the host sampler chooses), or 0xffffffff when
// the row holds a NaN (the host then refuses the step, as it does for NaN logits it reads). A
// decode step then copies `rows` indices to the host instead of rows × vocab logits
// (src/backend/mod.rs, Backend::argmax_rows).
#include "common.cuh"

// One block per row: a decode step has at most a few hundred rows, and at batch 1 the row's
// 64 KB must be read in one round trip, so wide blocks with 16-byte loads (a few per thread).
constexpr int THREADS = 1024;

// (value, index) a beats (value, index) b: larger value, or the same value at a lower index.
__device__ __forceinline__ bool beats(float av, int ai, float bv, int bi) { return av > bv || (av == bv && ai < bi); }

extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_rows(const u16* __restrict__ logits, unsigned* __restrict__ out, int width) {
    pdl_wait();
    pdl_trigger();
    __shared__ float sv[THREADS / 32];
    __shared__ int si[THREADS / 32];
    __shared__ int snan;
    if (threadIdx.x == 0) snan = 0;
    __syncthreads();
    const u16* row = logits + (size_t)blockIdx.x * width;
    float best = -__int_as_float(0x7f800000);  // −inf
    int idx = 0x7fffffff;
    bool nan = false;
    if ((width & 7) == 0) {
        // Rows start on 16-byte boundaries: 8 logits per load, taken in index order.
        const uint4* rv = reinterpret_cast<const uint4*>(row);
        for (int c = threadIdx.x; c < (width >> 3); c += THREADS) {
            const uint4 q = rv[c];
            float f[8];
            unpack2(q.x, f[0], f[1]);
            unpack2(q.y, f[2], f[3]);
            unpack2(q.z, f[4], f[5]);
            unpack2(q.w, f[6], f[7]);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (f[e] != f[e])
                    nan = true;
                else if (beats(f[e], 8 * c + e, best, idx)) {
                    best = f[e];
                    idx = 8 * c + e;
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < width; i += THREADS) {
            const float v = to_f32(row[i]);
            if (v != v)
                nan = true;
            else if (beats(v, i, best, idx)) {
                best = v;
                idx = i;
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (beats(ov, oi, best, idx)) {
            best = ov;
            idx = oi;
        }
    }
    if (nan) atomicOr(&snan, 1);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w)
            if (beats(sv[w], si[w], best, idx)) {
                best = sv[w];
                idx = si[w];
            }
        // A row of width ≥ 1 with no NaN always has an index (−inf values tie at the lowest).
        out[blockIdx.x] = snan ? 0xffffffffu : (unsigned)idx;
    }
}
