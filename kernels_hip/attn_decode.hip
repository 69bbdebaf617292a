// Split-KV decode attention over the paged KV cache for AMD (HIP), a port of
// kernels_cuda/attn_decode.cu with the same entry points, arguments and workspace layout, so that
// src/backend/rocm/attention.rs mirrors the CUDA launcher. The two softmax schemes of
// FlashDecoding++ §3:
//
// - attn_decode_sync: each split keeps a running max and rescales its partial sums when the max
//   grows, writes (m, l, acc) per row and split; attn_combine merges the splits with one more
//   rescale (the FlashDecoding baseline).
// - attn_decode_async: every term is e^(x − φ) with one unified φ; each split adds Σe^(x−φ)·v and
//   Σe^(x−φ) into per-row fp32 accumulators with atomics, and the last split of a row normalises
//   and writes it. A row whose scores leave [φ + a, φ + b], or whose sums are not finite, is
//   flagged and recomputed with the sync scheme by that last split, in the same launch, and
//   counted.
//
// What differs from CUDA and why:
// - Wavefronts are 64 lanes on CDNA (32 on RDNA). A token row of D elements is read by D/8 lanes
//   (a "token group": 8, 16 or 32 lanes), which divides either width, so a group never straddles
//   a wavefront; the group's dot product is reduced with __shfl_xor(v, o, LPT) (the width keeps
//   the butterfly inside the group on any wavefront size). HIP has no *_sync shuffles or masks:
//   every lane of the wavefront executes them (the loop trip count is uniform).
// - No PTX: the 16-byte K/V loads are non-temporal loads (common.h), exp2 is exp2f.
// - Reading what other blocks wrote: CDNA's per-CU L1 is not coherent, so after the arrival
//   counter says "last", the totals are read with device-coherent atomic loads (the role of
//   __ldcg), after __threadfence (an agent-scope acquire/release fence).
// - Float atomicAdd: HIP's atomicAdd(float*) on global memory (a hardware float atomic where the
//   compiler is allowed to use one, a CAS loop otherwise); both are correct on hipMalloc memory.
#include "common.h"

#ifndef FDPP_D
#define FDPP_D 128
#endif
#ifndef FDPP_HG
#define FDPP_HG 4
#endif

constexpr int D = FDPP_D;
constexpr int HG = FDPP_HG;         // query heads per block
constexpr int THREADS = 128;        // 2 wavefronts on CDNA, 4 on RDNA (ATTN_THREADS in attention.rs)
constexpr int LPT = D / 8;          // lanes per token row
constexpr int NG = THREADS / LPT;   // token groups per block
constexpr int U = 4;                // tokens per group in flight
constexpr int DPT = D / THREADS > 0 ? D / THREADS : 1;

static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
static_assert(HG >= 1 && HG <= 4, "at most 4 query heads per block (the launcher chunks larger groups)");
static_assert(FDPP_WAVE % LPT == 0, "a token group must not straddle a wavefront");
static_assert(THREADS % FDPP_WAVE == 0, "a block is whole wavefronts");

#define FDPP_INF __builtin_inff()

__device__ __forceinline__ bool finite(float x) { return fabsf(x) < FDPP_INF; }
__device__ __forceinline__ u32 f32_bits(float f) { return __builtin_bit_cast(u32, f); }

// Ordered key of a float: unsigned comparison of keys follows float comparison, and the key 0
// lies below −inf, so a zero-initialised workspace means "no score seen".
__device__ __forceinline__ u32 fkey(float f) {
    const u32 u = f32_bits(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unkey(u32 k) {
    if (k == 0) return -FDPP_INF;
    return bits_to_f32((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Device-coherent loads of what other blocks wrote (bypass the non-coherent per-CU L1).
__device__ __forceinline__ u32 ld_coherent(const u32* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
__device__ __forceinline__ float ld_coherent(const float* p) {
    return bits_to_f32(__atomic_load_n(reinterpret_cast<const u32*>(p), __ATOMIC_RELAXED));
}

// Partial softmax state of one lane: for each of the HG heads, the 8 output dims it owns.
struct Part {
    float m[HG];       // running max (sync) or φ (async), log2 units
    float l[HG];       // Σ 2^(s − m) over this lane's tokens
    float acc[HG][8];  // Σ 2^(s − m) · v
    float mx[HG];      // largest score seen (async flag test)
    bool over[HG];     // some s − φ > b (async)
};

__device__ __forceinline__ void unpack8(const u32x4& r, float (&f)[8]) {
    unpack2(r.x, f[0], f[1]);
    unpack2(r.y, f[2], f[3]);
    unpack2(r.z, f[4], f[5]);
    unpack2(r.w, f[6], f[7]);
}

// Accumulate tokens [t0, t1) of one (sequence, kv head) into `p` for the lane's group.
template <bool ASYNC>
__device__ __forceinline__ void accumulate(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                           const u16* __restrict__ vp, const int* __restrict__ pages, int page_size,
                                           int G, int kvh, int t0, int t1, float phi2, float b2) {
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    // The trip count is the same for every group: the shuffles below need every lane active.
    for (int base0 = t0; base0 < t1; base0 += NG * U) {
        const int base = base0 + gid * U;
        u32x4 kr[U], vr[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u;
            ok[u] = t < t1;
            kr[u] = vr[u] = u32x4{0, 0, 0, 0};
            if (ok[u]) {
                const int page = pages[t / page_size];
                const size_t at = ((size_t)page * page_size + t % page_size) * G * D + (size_t)kvh * D + li * 8;
                kr[u] = ld_stream16(kp + at);
                vr[u] = ld_stream16(vp + at);
            }
        }
        float s[U][HG];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8(kr[u], kf);
#pragma unroll
            for (int h = 0; h < HG; ++h) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d += ok[u] ? qr[h][i] * kf[i] : 0.f;
                // Sum over the LPT lanes of the token group (width LPT: xor stays in the group).
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) d += __shfl_xor(d, o, LPT);
                s[u][h] = ok[u] ? d : -FDPP_INF;
            }
        }
#pragma unroll
        for (int h = 0; h < HG; ++h) {
            float cm = s[0][h];
#pragma unroll
            for (int u = 1; u < U; ++u) cm = fmaxf(cm, s[u][h]);
            if (ASYNC) {
                p.mx[h] = fmaxf(p.mx[h], cm);
                p.over[h] |= cm - phi2 > b2;
            } else if (cm > p.m[h]) {
                // The running max grew: rescale what was summed against the old one.
                const float f = exp2f(p.m[h] - cm);
                p.l[h] *= f;
#pragma unroll
                for (int i = 0; i < 8; ++i) p.acc[h][i] *= f;
                p.m[h] = cm;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (!ok[u]) continue;
            float vf[8];
            unpack8(vr[u], vf);
#pragma unroll
            for (int h = 0; h < HG; ++h) {
                const float w = exp2f(s[u][h] - p.m[h]);
                p.l[h] += w;
#pragma unroll
                for (int i = 0; i < 8; ++i) p.acc[h][i] += w * vf[i];
            }
        }
    }
}

__device__ __forceinline__ void init_part(Part& p, float m0) {
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        p.m[h] = m0;
        p.l[h] = 0.f;
        p.mx[h] = -FDPP_INF;
        p.over[h] = false;
#pragma unroll
        for (int i = 0; i < 8; ++i) p.acc[h][i] = 0.f;
    }
}

// LDS of one block: the groups' partial states, merged per head.
struct Smem {
    float acc[NG][HG][D];
    float m[NG][HG];
    float l[NG][HG];
    float bm[HG];      // block max per head (sync)
    int flag;
    u32 bad;
};

// Merge the groups' states into block-wide (m, l, acc) per head: on return sm.acc[0][h][:],
// sm.l[0][h] and sm.bm[h] hold them. Sync states are rescaled to the block max; async states
// share φ and are summed.
template <bool ASYNC>
__device__ void block_merge(Smem& sm, Part& p, float phi2) {
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    if (li == 0) {
#pragma unroll
        for (int h = 0; h < HG; ++h) {
            sm.m[gid][h] = p.m[h];
            sm.l[gid][h] = p.l[h];
        }
    }
    __syncthreads();
    if (threadIdx.x < HG) {
        float bm = ASYNC ? phi2 : -FDPP_INF;
        if (!ASYNC)
            for (int g = 0; g < NG; ++g) bm = fmaxf(bm, sm.m[g][threadIdx.x]);
        sm.bm[threadIdx.x] = bm;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        // A group that saw no token has m = −inf and nothing to add.
        const float f = ASYNC ? 1.f : (p.m[h] == -FDPP_INF ? 0.f : exp2f(p.m[h] - sm.bm[h]));
#pragma unroll
        for (int i = 0; i < 8; ++i) sm.acc[gid][h][li * 8 + i] = p.acc[h][i] * f;
    }
    __syncthreads();
    if (threadIdx.x < HG) {
        const int h = threadIdx.x;
        float l = 0.f;
        for (int g = 0; g < NG; ++g) {
            const float f = ASYNC ? 1.f : (sm.m[g][h] == -FDPP_INF ? 0.f : exp2f(sm.m[g][h] - sm.bm[h]));
            l += sm.l[g][h] * f;
        }
        sm.l[0][h] = l;
    }
    for (int i = threadIdx.x; i < HG * D; i += THREADS) {
        const int h = i / D, d = i % D;
        float a = 0.f;
        for (int g = 0; g < NG; ++g) a += sm.acc[g][h][d];
        sm.acc[0][h][d] = a;  // group 0's slot is read only by this thread, before this write
    }
    __syncthreads();
}

// This lane's 8 dims of q for each of the block's `nh` live heads, scaled to log2 units; zeros
// for the masked heads of a group's partial last chunk (their rows are another kv head's, or
// lie past q).
__device__ __forceinline__ void load_q(float (&qr)[HG][8], const u16* __restrict__ q, int row0, float scale2,
                                       int nh) {
    const int li = threadIdx.x % LPT;
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        float f[8];
        if (h < nh) {
            unpack8(ld16(q + (size_t)(row0 + h) * D + li * 8), f);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) qr[h][i] = f[i] * scale2;
    }
}

struct Where {
    int b, kvh, split, h0, len, t0, t1;
    int nh;  // live heads of the block's chunk (HG but in a group's partial last chunk)
};

// Head chunks per kv head: ⌈group / HG⌉ (the last one partial when HG does not divide group,
// GQA ratios 3, 5, 6, 7, …; the masked heads load no q, write nothing and raise no flag).
__device__ __forceinline__ int chunks_of(int group) { return (group + HG - 1) / HG; }

// Bits of the live heads 0 .. nh − 1.
__device__ __forceinline__ u32 live_mask(int nh) { return nh >= 32 ? ~0u : (1u << nh) - 1u; }

// Block → (sequence, kv head, split, first query head). grid.x = chunks · splits (the head
// chunks of one split are adjacent, so they run together and share the K/V rows in L2);
// grid.y = batch · kv heads.
__device__ __forceinline__ Where where(const int* __restrict__ lens, int G, int group, int splits) {
    const int chunks = chunks_of(group);
    Where w;
    const int chunk = blockIdx.x % chunks;
    w.split = blockIdx.x / chunks;
    w.b = blockIdx.y / G;
    w.kvh = blockIdx.y % G;
    w.h0 = w.kvh * group + chunk * HG;
    w.nh = min(HG, group - chunk * HG);
    w.len = lens[w.b];
    const int per = (w.len + splits - 1) / splits;
    w.t0 = min(w.len, w.split * per);
    w.t1 = min(w.len, w.t0 + per);
    return w;
}

// Write the block's merged rows, normalised, to out (rows [row0, row0 + HG)).
__device__ __forceinline__ void write_rows(const Smem& sm, u16* __restrict__ out, int row0, u32 mask) {
    for (int i = threadIdx.x; i < HG * D; i += THREADS) {
        const int h = i / D, d = i % D;
        if (mask & (1u << h)) out[(size_t)(row0 + h) * D + d] = from_f32(sm.acc[0][h][d] / sm.l[0][h]);
    }
}

// Whole-sequence sync attention for the block's heads (the async recompute path).
__device__ void recompute_sync(Smem& sm, const float (&qr)[HG][8], const u16* __restrict__ kp,
                               const u16* __restrict__ vp, const int* __restrict__ pages, int page_size, int G,
                               int kvh, int len, u16* __restrict__ out, int row0, u32 mask) {
    Part p;
    init_part(p, -FDPP_INF);
    accumulate<false>(p, qr, kp, vp, pages, page_size, G, kvh, 0, len, 0.f, 0.f);
    block_merge<false>(sm, p, 0.f);
    write_rows(sm, out, row0, mask);
}

extern "C" __global__ void __launch_bounds__(THREADS)
attn_decode_sync(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                 const int* __restrict__ table, const int* __restrict__ lens, int max_pages, int page_size, int H,
                 int G, int splits, float scale2, float* __restrict__ part, u16* __restrict__ out) {
    __shared__ Smem sm;
    const int group = H / G;
    const Where w = where(lens, G, group, splits);
    float qr[HG][8];
    load_q(qr, q, w.b * H + w.h0, scale2, w.nh);
    Part p;
    init_part(p, -FDPP_INF);
    const int* pages = table + (size_t)w.b * max_pages;
    accumulate<false>(p, qr, kp, vp, pages, page_size, G, w.kvh, w.t0, w.t1, 0.f, 0.f);
    block_merge<false>(sm, p, 0.f);
    if (splits == 1) {
        write_rows(sm, out, w.b * H + w.h0, live_mask(w.nh));
        return;
    }
    // Partials: acc [row][split][D], then (m, l) [row][split] after all rows' acc.
    const int rows = gridDim.y * group;
    for (int i = threadIdx.x; i < w.nh * D; i += THREADS) {
        const int h = i / D, d = i % D;
        part[((size_t)(w.b * H + w.h0 + h) * splits + w.split) * D + d] = sm.acc[0][h][d];
    }
    if (threadIdx.x < w.nh) {
        float* ml = part + (size_t)rows * splits * D;
        const size_t at = ((size_t)(w.b * H + w.h0 + threadIdx.x) * splits + w.split) * 2;
        ml[at] = sm.bm[threadIdx.x];
        ml[at + 1] = sm.l[0][threadIdx.x];
    }
}

// One block per row: merge the splits' partials, each rescaled to the largest max. A separate
// launch after attn_decode_sync, so plain loads see the partials.
extern "C" __global__ void __launch_bounds__(THREADS)
attn_combine(const float* __restrict__ part, int rows, int splits, u16* __restrict__ out) {
    const int row = blockIdx.x;
    const float* ml = part + (size_t)rows * splits * D + (size_t)row * splits * 2;
    float m = -FDPP_INF;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, ml[2 * s]);
    float l = 0.f;
    float acc[DPT];
#pragma unroll
    for (int j = 0; j < DPT; ++j) acc[j] = 0.f;
    for (int s = 0; s < splits; ++s) {
        if (ml[2 * s + 1] == 0.f) continue;  // an empty split (m = −inf)
        const float f = exp2f(ml[2 * s] - m);
        l += ml[2 * s + 1] * f;
#pragma unroll
        for (int j = 0; j < DPT; ++j) {
            const int d = threadIdx.x + j * THREADS;
            if (d < D) acc[j] += part[((size_t)row * splits + s) * D + d] * f;
        }
    }
#pragma unroll
    for (int j = 0; j < DPT; ++j) {
        const int d = threadIdx.x + j * THREADS;
        if (d < D) out[(size_t)row * D + d] = from_f32(acc[j] / l);
    }
}

// Async workspace, zero between launches (the last split of each block-row restores it):
// acc [rows][D] f32, then l [rows] f32, then max-score keys [rows], over-flags [rows], and one
// arrival counter per (sequence, kv head, head chunk); `recomputed` is a running total.
extern "C" __global__ void __launch_bounds__(THREADS)
attn_decode_async(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                  const int* __restrict__ table, const int* __restrict__ lens, int max_pages, int page_size, int H,
                  int G, int splits, float scale2, float phi2, float a2, float b2, float* __restrict__ ws,
                  u32* __restrict__ recomputed, u16* __restrict__ out) {
    __shared__ Smem sm;
    const int group = H / G;
    const Where w = where(lens, G, group, splits);
    const int rows = gridDim.y * group;
    float* accs = ws;
    float* ls = accs + (size_t)rows * D;
    u32* keys = reinterpret_cast<u32*>(ls + rows);
    u32* overs = keys + rows;
    u32* arrivals = overs + rows;
    const int row0 = w.b * H + w.h0;
    const int* pages = table + (size_t)w.b * max_pages;

    float qr[HG][8];
    load_q(qr, q, row0, scale2, w.nh);
    Part p;
    init_part(p, phi2);
    accumulate<true>(p, qr, kp, vp, pages, page_size, G, w.kvh, w.t0, w.t1, phi2, b2);
    // Flags first (a lane's view), then the sums merged in LDS.
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        if (h >= w.nh) continue;
        if (p.over[h]) atomicOr(&overs[row0 + h], 1u);
        if (p.mx[h] != -FDPP_INF) atomicMax(&keys[row0 + h], fkey(p.mx[h]));
    }
    block_merge<true>(sm, p, phi2);
    if (splits > 1) {
        for (int i = threadIdx.x; i < w.nh * D; i += THREADS)
            atomicAdd(&accs[(size_t)row0 * D + i], sm.acc[0][i / D][i % D]);
        if (threadIdx.x < w.nh) atomicAdd(&ls[row0 + threadIdx.x], sm.l[0][threadIdx.x]);
    }
    // Release: this block's atomics are visible device-wide before its arrival is counted.
    __threadfence();
    __syncthreads();
    const int chunks = chunks_of(group);
    const int chunk_id = blockIdx.y * chunks + blockIdx.x % chunks;
    if (threadIdx.x == 0) sm.flag = splits == 1 || atomicAdd(&arrivals[chunk_id], 1u) == (u32)(splits - 1);
    __syncthreads();
    if (!sm.flag) return;
    // The last split of these rows: totals are complete. Acquire, then coherent loads.
    __threadfence();
    if (splits > 1) {
        for (int i = threadIdx.x; i < w.nh * D; i += THREADS) {
            sm.acc[0][i / D][i % D] = ld_coherent(&accs[(size_t)row0 * D + i]);
            accs[(size_t)row0 * D + i] = 0.f;
        }
        __syncthreads();
        if (threadIdx.x < w.nh) {
            sm.l[0][threadIdx.x] = ld_coherent(&ls[row0 + threadIdx.x]);
            ls[row0 + threadIdx.x] = 0.f;
        }
    }
    if (threadIdx.x == 0) sm.bad = 0;
    __syncthreads();
    if (threadIdx.x < w.nh) {
        const int h = threadIdx.x;
        const float mx = unkey(ld_coherent(&keys[row0 + h]));
        const bool over = ld_coherent(&overs[row0 + h]) != 0;
        const float l = sm.l[0][h];
        const bool ok = !over && mx - phi2 >= a2 && l > 0.f && finite(l);
        if (!ok) atomicOr(&sm.bad, 1u << h);
        keys[row0 + h] = 0;
        overs[row0 + h] = 0;
    }
    if (threadIdx.x == 0 && splits > 1) arrivals[chunk_id] = 0;
    __syncthreads();
    // Non-finite sums show in the accumulator too.
    for (int i = threadIdx.x; i < w.nh * D; i += THREADS)
        if (!finite(sm.acc[0][i / D][i % D])) atomicOr(&sm.bad, 1u << (i / D));
    __syncthreads();
    const u32 flagged = sm.bad;
    write_rows(sm, out, row0, live_mask(w.nh) & ~flagged);
    if (flagged) {
        __syncthreads();
        recompute_sync(sm, qr, kp, vp, pages, page_size, G, w.kvh, w.len, out, row0, flagged);
        if (threadIdx.x == 0) atomicAdd(recomputed, (u32)__popc(flagged));
    }
}
