// Greedy token choice on the device: one block per row of logits writes the index of the row's
// largest value (the lowest index among equals, as the host sampler chooses), or 0xffffffff when
// the row holds a NaN (the host then refuses the step, as it does for NaN logits it reads). A
// decode step then copies `rows` indices to the host instead of rows × vocab logits
// (src/backend/mod.rs, Backend::argmax_rows).
#include "common.cuh"

constexpr int THREADS = 256;

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
    for (int i = threadIdx.x; i < width; i += THREADS) {
        const float v = to_f32(row[i]);
        if (v != v)
            nan = true;
        else if (beats(v, i, best, idx)) {
            best = v;
            idx = i;
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
