// Split-KV decode attention over the paged KV cache (Flash-Decoding), with the two softmax
// schemes of FlashDecoding++ §3:
//
// - attn_decode_sync: each split keeps a running max and rescales its partial sums when the max
//   grows; it writes (m, l, acc) per row and split, and attn_combine merges the splits with one
//   more rescale (the FlashDecoding baseline: two kernels, a synchronisation between them).
// - attn_decode_async: every term is e^(x − φ) with one unified φ, so partial results from
//   different splits need no common max: each split adds its Σe^(x−φ)·v and Σe^(x−φ) into a
//   per-row fp32 accumulator with atomics, and the last split of a row to finish normalises and
//   writes the output. No combine kernel, no rescale. A row whose scores leave [φ + a, φ + b]
//   (x − φ > b anywhere: overflow risk; max x − φ < a: every term underflows) or whose sums are not
//   finite is flagged; the last split recomputes it with the sync scheme over the whole
//   sequence, in the same launch, and counts it.
//
// One block serves one (sequence, kv head, split) and HG query heads of the kv head's group
// (GQA: the K and V rows are read once for all of them). Inside a block, 16-byte loads: one
// token row of D elements is read by D/8 lanes (a "token group"); 128 threads make 128/(D/8)
// groups that take tokens in turn, U at a time in flight. Scores are in log2 units (q is
// pre-scaled by log2(e)/√d) so that the exponentials are exp2.
#include "common.cuh"
#include "attn_common.cuh"

#ifndef FDPP_D
#define FDPP_D 128
#endif
#ifndef FDPP_HG
#define FDPP_HG 4
#endif

constexpr int D = FDPP_D;
constexpr int HG = FDPP_HG;         // query heads per block
constexpr int THREADS = 128;
constexpr int LPT = D / 8;          // lanes per token row
constexpr int NG = THREADS / LPT;   // token groups per block
constexpr int U = 4;                // tokens per group in flight
constexpr int DPT = D / THREADS > 0 ? D / THREADS : 1;

static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
static_assert(HG >= 1 && HG <= 4, "at most 4 query heads per block");

// Partial softmax state of one lane: for each of the HG heads, the 8 output dims it owns.
struct Part {
    float m[HG];       // running max (sync) or φ (async), log2 units
    float l[HG];       // Σ 2^(s − m) over this lane's tokens
    float acc[HG][8];  // Σ 2^(s − m) · v
    float mx[HG];      // largest score seen (async flag test)
    bool over[HG];     // some s − φ > b (async)
};

// Accumulate tokens [t0, t1) of one (sequence, kv head) into `p` for the lane's group.
template <bool ASYNC>
__device__ __forceinline__ void accumulate(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                           const u16* __restrict__ vp, const int* __restrict__ pages, int page_size,
                                           int G, int kvh, int t0, int t1, float phi2, float b2) {
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    // The trip count is the same for every group: the shuffles below need whole warps.
    for (int base0 = t0; base0 < t1; base0 += NG * U) {
        const int base = base0 + gid * U;
        uint4 kr[U], vr[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u;
            ok[u] = t < t1;
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
            if (ok[u]) {
                unpack2(kr[u].x, kf[0], kf[1]);
                unpack2(kr[u].y, kf[2], kf[3]);
                unpack2(kr[u].z, kf[4], kf[5]);
                unpack2(kr[u].w, kf[6], kf[7]);
            }
#pragma unroll
            for (int h = 0; h < HG; ++h) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d += ok[u] ? qr[h][i] * kf[i] : 0.f;
                // Sum over the LPT lanes of the token group (xor stays inside aligned groups).
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
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
            unpack2(vr[u].x, vf[0], vf[1]);
            unpack2(vr[u].y, vf[2], vf[3]);
            unpack2(vr[u].z, vf[4], vf[5]);
            unpack2(vr[u].w, vf[6], vf[7]);
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

// Shared memory of one block: the groups' partial states, merged per head.
struct Smem {
    float acc[NG][HG][D];
    float m[NG][HG];
    float l[NG][HG];
    float bm[HG];      // block max per head (sync)
    int flag;
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

// This lane's 8 dims of q for each of the block's heads, scaled to log2 units.
__device__ __forceinline__ void load_q(float (&qr)[HG][8], const u16* __restrict__ q, int row0, float scale2) {
    const int li = threadIdx.x % LPT;
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        const uint4 v = *reinterpret_cast<const uint4*>(q + (size_t)(row0 + h) * D + li * 8);
        unpack2(v.x, qr[h][0], qr[h][1]);
        unpack2(v.y, qr[h][2], qr[h][3]);
        unpack2(v.z, qr[h][4], qr[h][5]);
        unpack2(v.w, qr[h][6], qr[h][7]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qr[h][i] *= scale2;
    }
}

struct Where {
    int b, kvh, split, h0, len, t0, t1;
};

// Block → (sequence, kv head, split, first query head). grid.x = chunks · splits (the head
// chunks of one split are adjacent, so they run together and share the K/V rows in L2);
// grid.y = batch · kv heads.
__device__ __forceinline__ Where where(const int* __restrict__ lens, int G, int group, int splits) {
    const int chunks = group / HG;
    Where w;
    const int chunk = blockIdx.x % chunks;
    w.split = blockIdx.x / chunks;
    w.b = blockIdx.y / G;
    w.kvh = blockIdx.y % G;
    w.h0 = w.kvh * group + chunk * HG;
    w.len = lens[w.b];
    const int per = (w.len + splits - 1) / splits;
    w.t0 = min(w.len, w.split * per);
    w.t1 = min(w.len, w.t0 + per);
    return w;
}

// Write the block's merged rows, normalised, to out (rows [row0, row0 + HG)).
__device__ __forceinline__ void write_rows(const Smem& sm, u16* __restrict__ out, int row0, unsigned mask) {
    for (int i = threadIdx.x; i < HG * D; i += THREADS) {
        const int h = i / D, d = i % D;
        if (mask & (1u << h)) out[(size_t)(row0 + h) * D + d] = from_f32(sm.acc[0][h][d] / sm.l[0][h]);
    }
}

// Whole-sequence sync attention for the block's heads (the async recompute path).
__device__ void recompute_sync(Smem& sm, const float (&qr)[HG][8], const u16* __restrict__ kp,
                               const u16* __restrict__ vp, const int* __restrict__ pages, int page_size, int G,
                               int kvh, int len, u16* __restrict__ out, int row0, unsigned mask) {
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
    pdl_wait();
    pdl_trigger();
    __shared__ Smem sm;
    const int group = H / G;
    const Where w = where(lens, G, group, splits);
    float qr[HG][8];
    load_q(qr, q, w.b * H + w.h0, scale2);
    Part p;
    init_part(p, -FDPP_INF);
    const int* pages = table + (size_t)w.b * max_pages;
    accumulate<false>(p, qr, kp, vp, pages, page_size, G, w.kvh, w.t0, w.t1, 0.f, 0.f);
    block_merge<false>(sm, p, 0.f);
    if (splits == 1) {
        write_rows(sm, out, w.b * H + w.h0, ~0u);
        return;
    }
    // Partials: acc [row][split][D], then (m, l) [row][split] after all rows' acc.
    const int rows = gridDim.y * group;
    for (int i = threadIdx.x; i < HG * D; i += THREADS) {
        const int h = i / D, d = i % D;
        part[((size_t)(w.b * H + w.h0 + h) * splits + w.split) * D + d] = sm.acc[0][h][d];
    }
    if (threadIdx.x < HG) {
        float* ml = part + (size_t)rows * splits * D;
        const size_t at = ((size_t)(w.b * H + w.h0 + threadIdx.x) * splits + w.split) * 2;
        ml[at] = sm.bm[threadIdx.x];
        ml[at + 1] = sm.l[0][threadIdx.x];
    }
}

// One block per row: merge the splits' partials, each rescaled to the largest max.
extern "C" __global__ void __launch_bounds__(THREADS)
attn_combine(const float* __restrict__ part, int rows, int splits, u16* __restrict__ out) {
    pdl_wait();
    pdl_trigger();
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
                  unsigned* __restrict__ recomputed, u16* __restrict__ out) {
    pdl_wait();
    pdl_trigger();
    __shared__ Smem sm;
    const int group = H / G;
    const Where w = where(lens, G, group, splits);
    const int rows = gridDim.y * group;
    float* accs = ws;
    float* ls = accs + (size_t)rows * D;
    unsigned* keys = reinterpret_cast<unsigned*>(ls + rows);
    unsigned* overs = keys + rows;
    unsigned* arrivals = overs + rows;
    const int row0 = w.b * H + w.h0;
    const int* pages = table + (size_t)w.b * max_pages;

    float qr[HG][8];
    load_q(qr, q, row0, scale2);
    Part p;
    init_part(p, phi2);
    accumulate<true>(p, qr, kp, vp, pages, page_size, G, w.kvh, w.t0, w.t1, phi2, b2);
    // Flags first (a lane's view), then the sums merged in shared memory.
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        if (p.over[h]) atomicOr(&overs[row0 + h], 1u);
        if (p.mx[h] != -FDPP_INF) atomicMax(&keys[row0 + h], fkey(p.mx[h]));
    }
    block_merge<true>(sm, p, phi2);
    if (splits > 1) {
        for (int i = threadIdx.x; i < HG * D; i += THREADS) atomicAdd(&accs[(size_t)row0 * D + i], sm.acc[0][i / D][i % D]);
        if (threadIdx.x < HG) atomicAdd(&ls[row0 + threadIdx.x], sm.l[0][threadIdx.x]);
        __threadfence();
    }
    __syncthreads();
    const int chunk_id = blockIdx.y * (group / HG) + blockIdx.x % (group / HG);
    if (threadIdx.x == 0) sm.flag = splits == 1 || atomicAdd(&arrivals[chunk_id], 1u) == (unsigned)(splits - 1);
    __syncthreads();
    if (!sm.flag) return;
    // The last split of these rows: totals are complete.
    __threadfence();
    if (splits > 1) {
        for (int i = threadIdx.x; i < HG * D; i += THREADS) {
            sm.acc[0][i / D][i % D] = __ldcg(&accs[(size_t)row0 * D + i]);
            accs[(size_t)row0 * D + i] = 0.f;
        }
        __syncthreads();
        if (threadIdx.x < HG) {
            sm.l[0][threadIdx.x] = __ldcg(&ls[row0 + threadIdx.x]);
            ls[row0 + threadIdx.x] = 0.f;
        }
    }
    __syncthreads();
    __shared__ unsigned bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    if (threadIdx.x < HG) {
        const int h = threadIdx.x;
        const float mx = unkey(__ldcg(&keys[row0 + h]));
        const bool over = __ldcg(&overs[row0 + h]) != 0;
        const float l = sm.l[0][h];
        const bool ok = !over && mx - phi2 >= a2 && l > 0.f && finite(l);
        if (!ok) atomicOr(&bad, 1u << h);
        keys[row0 + h] = 0;
        overs[row0 + h] = 0;
    }
    if (threadIdx.x == 0 && splits > 1) arrivals[chunk_id] = 0;
    __syncthreads();
    // Non-finite sums show in the accumulator too.
    for (int i = threadIdx.x; i < HG * D; i += THREADS)
        if (!finite(sm.acc[0][i / D][i % D])) atomicOr(&bad, 1u << (i / D));
    __syncthreads();
    const unsigned flagged = bad;
    write_rows(sm, out, row0, ~flagged);
    if (flagged) {
        __syncthreads();
        recompute_sync(sm, qr, kp, vp, pages, page_size, G, w.kvh, w.len, out, row0, flagged);
        if (threadIdx.x == 0) atomicAdd(recomputed, __popc(flagged));
    }
}
