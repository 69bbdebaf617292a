// Split-KV decode attention over the paged KV cache (Flash-Decoding), with the two softmax
// schemes of FlashDecoding++ §3:
//
// - attn_decode_sync_*: each split keeps a running max and rescales its partial sums when the
//   max grows; it writes (m, l, acc) per row and split, and attn_combine merges the splits with
//   one more rescale (the FlashDecoding baseline: two kernels, a synchronisation between them).
// - attn_decode_async_*: every term is e^(x − φ) with one unified φ, so partial results from
//   different splits need no common max: each split adds its Σe^(x−φ)·v and Σe^(x−φ) into a
//   per-row fp32 accumulator with atomics, and the last split of a row to finish normalises and
//   writes the output. No combine kernel, no rescale. A row whose scores leave [φ + a, φ + b]
//   (x − φ > b anywhere: overflow risk; max x − φ < a: every term underflows) or whose sums are
//   not finite is flagged; the last split recomputes it with the sync scheme over the whole
//   sequence, in the same launch, and counts it.
//
// One block serves one (sequence, kv head, split) and HG query heads of the kv head's group
// (GQA: the K and V rows are read once for all of them). A group that HG does not divide (GQA
// ratios 3, 5, 6, 7, …: the launcher picks HG = ⌈group / ⌈group / 4⌉⌉) ends in a partial chunk:
// its blocks hold `nh` < HG live heads, and the others are masked heads that load no q (zeros),
// write nothing, add nothing to the workspaces and raise no flag. They cost FMAs, not bytes. Inside a block, 16-byte loads: one
// token row of D elements is read by D/8 lanes (a "token group"); 128 threads make 128/(D/8)
// groups that take U = 4 consecutive tokens each per round. Scores are in log2 units (q is
// pre-scaled by log2(e)/√d) so that the exponentials are exp2.
//
// Two implementations with the same arguments, grid and workspaces; the launcher picks one
// (src/backend/attn_plan.rs `DecodePath`):
// - the latency path, attn_decode_{sync,async}_t128u4 (first in this file): for small batches
//   with short splits, where a launch is a chain of dependent round trips (lens → page ids →
//   K/V → merge → atomics → arrival → epilogue) rather than a stream of bytes. Page ids are
//   requested a round ahead (one dependent round trip per round instead of two), without a
//   division per token; the token groups of a warp merge with shuffles and the warps behind one
//   barrier; the async flags are reduced per block (one atomic per head, not one per lane); the
//   async epilogue counts the arrival from one thread after a barrier and the last split reads
//   every total it needs in one round trip and tests the flags with one barrier-reduction.
// - the bandwidth path, attn_decode_{sync,async}: the same block, merge and epilogue around the
//   earlier kernel's loop (accumulate_bw: a page id, then K/V, per token), for batches that fill
//   the device and for long splits, where that loop measured faster. (Until session 8 this path
//   kept its own merge and epilogue: four barriers, a flag atomic per lane, three read-back round
//   trips in the last split; its async kernel then ran 3-4 µs longer than its sync one.)
//
// Two main passes, chosen per launch (src/backend/cuda/decode_tc.rs, run-configuration switch
// decode_tc): the CUDA-core pass below (token groups of D/8 lanes, FMAs and shuffles; HG ≤ 4),
// and the tensor-core pass of attn_decode_tc.cuh (mma.sync with the block's heads on the n8 side;
// HG ≤ 8, head_dim 64-256, at 256 two warps per key step), which grouped decode takes by default
// because the CUDA-core pass is issue-bound above two heads per block. Both leave the same
// per-warp state to the same merge, epilogues and workspaces.
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
constexpr int LPT = D / 8;          // lanes per token row
constexpr int GPW = 32 / LPT;       // token groups per warp (4, 2 or 1)
constexpr int COMBINE_THREADS = 128;
// Most async splits of a row that one thread-block cluster holds (the portable cluster size; the
// launcher clusters 2..=8 splits of a single head chunk: cuda/attention.rs `cluster_splits`).
constexpr int CLUSTER_MAX = 8;
constexpr int COMBINE_MAX_SPLITS = 256;  // ops/attention.rs MAX_SPLITS

static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
// Up to 4 heads per block on the CUDA-core pass (HG · 8 q and HG · 8 accumulator floats per lane);
// up to 8 on the tensor-core pass (attn_decode_tc.cuh: the heads fill the n8 side of the mma, so
// a block costs the same at 2 heads as at 8), at every head_dim. The launcher chunks larger
// groups; modules of HG 5-8 hold only the tensor-core entries.
static_assert(HG >= 1 && HG <= 8, "at most 8 query heads per block (the launcher chunks larger groups)");

// Derived sizes of one block shape.
template <int NT, int U>
struct Shape {
    static constexpr int NG = NT / LPT;                  // token groups
    static constexpr int NW = NT / 32;                   // warps
    static constexpr int ROUND = NG * U;                 // tokens per round
    static constexpr int EPT = (HG * D + NT - 1) / NT;   // merged elements per thread
    static_assert(NT % 32 == 0 && NG >= 1, "whole warps of whole token groups");
};

// Partial softmax state of one lane: for each of the HG heads, the 8 output dims it owns.
struct Part {
    float m[HG];       // running max (sync) or φ (async), log2 units
    float l[HG];       // Σ 2^(s − m) over this lane's tokens
    float acc[HG][8];  // Σ 2^(s − m) · v
    float mx[HG];      // largest score seen (async flag test)
    bool over[HG];     // some s − φ > b (async)
};

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

// Page ids of tokens base .. base + U − 1 (0 past t1: never used); returns base's slot in its
// page. One division per run of U tokens: the tokens after it step through the slots (a
// division per token, emulated in ~25 instructions with quarter-rate conversions, measured
// 15-20 % of a bandwidth-bound round).
template <int U>
__device__ __forceinline__ int fetch_pages(int (&pg)[U], const int* __restrict__ pages, int page_size, int base,
                                           int t1) {
    int idx = base / page_size;
    const int slot0 = base - idx * page_size;
    int slot = slot0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        pg[u] = base + u < t1 ? pages[idx] : 0;
        if (++slot == page_size) {
            slot = 0;
            ++idx;
        }
    }
    return slot0;
}

// Scores and sums of CH tokens whose K and V rows (this lane's 16 bytes of each) are in kr, vr,
// for the first NH ≤ HG heads of the block (a partial chunk's loop leaves the heads past them at
// their initial state: the kernels are issue-bound, and a masked head cost as much as a live one).
template <bool ASYNC, int CH, int NH>
__device__ __forceinline__ void consume(Part& p, const float (&qr)[HG][8], const uint4 (&kr)[CH],
                                        const uint4 (&vr)[CH], const bool (&ok)[CH], float phi2, float b2) {
    float s[CH][HG];
#pragma unroll
    for (int u = 0; u < CH; ++u) {
        float kf[8];
        if (ok[u]) {
            unpack2(kr[u].x, kf[0], kf[1]);
            unpack2(kr[u].y, kf[2], kf[3]);
            unpack2(kr[u].z, kf[4], kf[5]);
            unpack2(kr[u].w, kf[6], kf[7]);
        }
#pragma unroll
        for (int h = 0; h < NH; ++h) {
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
    for (int h = 0; h < NH; ++h) {
        float cm = s[0][h];
#pragma unroll
        for (int u = 1; u < CH; ++u) cm = fmaxf(cm, s[u][h]);
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
    for (int u = 0; u < CH; ++u) {
        if (!ok[u]) continue;
        float vf[8];
        unpack2(vr[u].x, vf[0], vf[1]);
        unpack2(vr[u].y, vf[2], vf[3]);
        unpack2(vr[u].z, vf[4], vf[5]);
        unpack2(vr[u].w, vf[6], vf[7]);
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            const float w = exp2f(s[u][h] - p.m[h]);
            p.l[h] += w;
#pragma unroll
            for (int i = 0; i < 8; ++i) p.acc[h][i] += w * vf[i];
        }
    }
}

// Accumulate tokens [t0, t1) of one (sequence, kv head) into `p` for the lane's group: per round
// each group takes U consecutive tokens, and the page ids of its next round are requested while
// this round's K/V rows are in flight (one dependent round trip per round instead of two).
template <bool ASYNC, int NT, int U, int NH>
__device__ __forceinline__ void accumulate(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                           const u16* __restrict__ vp, const int* __restrict__ pages, int page_size,
                                           int G, int kvh, int t0, int t1, float phi2, float b2) {
    using S = Shape<NT, U>;
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    const size_t row_elems = (size_t)G * D;
    const u16* kb = kp + (size_t)kvh * D + li * 8;
    const u16* vb = vp + (size_t)kvh * D + li * 8;
    int pg[U];
    int slot0 = fetch_pages<U>(pg, pages, page_size, t0 + gid * U, t1);
    // The trip count is the same for every group: the shuffles in consume need whole warps.
    for (int base0 = t0; base0 < t1; base0 += S::ROUND) {
        const int base = base0 + gid * U;
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) ok[u] = base + u < t1;
        uint4 kr[U], vr[U];
        int slot = slot0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (ok[u]) {
                const size_t at = ((size_t)pg[u] * page_size + slot) * row_elems;
                kr[u] = ld_stream16(kb + at);
                vr[u] = ld_stream16(vb + at);
            }
            if (++slot == page_size) slot = 0;
        }
        if (base0 + S::ROUND < t1) slot0 = fetch_pages<U>(pg, pages, page_size, base + S::ROUND, t1);
        consume<ASYNC, U, NH>(p, qr, kr, vr, ok, phi2, b2);
    }
}

// One round of the bandwidth loop for the lane's token group: tokens base .. base + U − 1 below
// t1, each looking up its page as it goes (page id, then K/V), this lane's 16 bytes of each row.
template <int U>
__device__ __forceinline__ void load_round_bw(uint4 (&kr)[U], uint4 (&vr)[U], bool (&ok)[U], const u16* __restrict__ kp,
                                              const u16* __restrict__ vp, const int* __restrict__ pages,
                                              int page_size, int G, int kvh, int li, int base, int t1) {
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
}

// The bandwidth path's loop (session 3): per round each group takes U consecutive tokens and looks
// up each token's page as it goes (page id, then K/V). Measured 5-15 % faster than the loop above
// wherever the batch fills the device or the splits are long (reports/NOTES-decode-s4.md); the
// loop above wins only while a split is a round or two.
template <bool ASYNC, int NT, int U, int NH>
__device__ __forceinline__ void accumulate_bw(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                              const u16* __restrict__ vp, const int* __restrict__ pages,
                                              int page_size, int G, int kvh, int t0, int t1, float phi2, float b2) {
    using S = Shape<NT, U>;
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    // The trip count is the same for every group: the shuffles in consume need whole warps.
    for (int base0 = t0; base0 < t1; base0 += S::ROUND) {
        uint4 kr[U], vr[U];
        bool ok[U];
        load_round_bw<U>(kr, vr, ok, kp, vp, pages, page_size, G, kvh, li, base0 + gid * U, t1);
        consume<ASYNC, U, NH>(p, qr, kr, vr, ok, phi2, b2);
    }
}

// The async bandwidth loop with one head per block (MHA, head_dim 128+) software-pipelined across
// rounds (entry attn_decode_async_pipe): round r + 1's page ids and K/V rows are requested before
// round r is consumed, so a block keeps a round of loads in flight while it computes
// (accumulate_bw drains them every round and leaves the overlap to the SM's other blocks). Twice
// the K/V registers: 119-127 against 80 (NVRTC 13.0), 4 blocks per SM against 6. Measured on the
// H100 (reports/NOTES.md, sessions 27-28), MHA d128 async, TB/s against accumulate_bw in the same
// call: 64 · 1024-16384 2.97-3.00 → 3.03-3.05, 16 · 1024 2.86 → 2.90, 8 · 4096 level, 8 · 16384
// 3.00 → 2.96-2.99; d256 level to +2 %; d64 1 % slower at batch 64 (hence D ≥ 128). Its fewer
// resident blocks move the split planner's waves (24 · 1024: 2.68 against 2.99), so the host picks
// it per launch together with the split count (ops::attention `plan_mha_async`). The sync kernel
// (72 registers, 7 blocks per SM) ran 1-4 % slower with it, and the HG 2-4 kernels never take it.
template <bool ASYNC, int NT, int U, int NH>
__device__ __forceinline__ void accumulate_bw_pipe(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                                   const u16* __restrict__ vp, const int* __restrict__ pages,
                                                   int page_size, int G, int kvh, int t0, int t1, float phi2,
                                                   float b2) {
    static_assert(ASYNC && HG == 1 && D >= 128, "built for attn_decode_async_pipe only");
    using S = Shape<NT, U>;
    const int gid = threadIdx.x / LPT, li = threadIdx.x % LPT;
    uint4 ka[U], va[U], kb[U], vb[U];
    bool oa[U], ob[U];
    // Two named buffers, alternating by hand: a copy between them would be 16 moves a round.
    // The trip count is the same for every group (the shuffles in consume need whole warps).
    int base0 = t0;
    if (base0 < t1) load_round_bw<U>(ka, va, oa, kp, vp, pages, page_size, G, kvh, li, base0 + gid * U, t1);
    while (base0 < t1) {
        load_round_bw<U>(kb, vb, ob, kp, vp, pages, page_size, G, kvh, li, base0 + S::ROUND + gid * U, t1);
        consume<ASYNC, U, NH>(p, qr, ka, va, oa, phi2, b2);
        base0 += S::ROUND;
        if (base0 >= t1) break;
        load_round_bw<U>(ka, va, oa, kp, vp, pages, page_size, G, kvh, li, base0 + S::ROUND + gid * U, t1);
        consume<ASYNC, U, NH>(p, qr, kb, vb, ob, phi2, b2);
        base0 += S::ROUND;
    }
}

// Tokens [t0, t1) into `p` by the loop of the path the kernel is built for (BW: the bandwidth
// path's, else the latency path's), for the block's `nh` live heads. At HG = 3 a group's partial
// last chunk (ratio 5: 3 + 2) takes a loop over 2 heads, picked by a block-uniform branch once per
// call (measured 4-5 % faster at ratio 5 than computing the masked head on zero q). At HG = 4 the
// masked heads (ratios 7, 10, 11, 13-15) are computed on zero q: the second loop there gained
// ratio 7 2-8 % but cost the powers of two's four-head kernels 1-2 % (sync, batch 16), and HG 4
// serves ratios 4, 8 and 16.
template <bool ASYNC, int NT, int U, bool BW, int NH, bool PIPE>
__device__ __forceinline__ void accumulate_nh(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                              const u16* __restrict__ vp, const int* __restrict__ pages,
                                              int page_size, int G, int kvh, int t0, int t1, float phi2, float b2) {
    if constexpr (BW && PIPE)
        accumulate_bw_pipe<ASYNC, NT, U, NH>(p, qr, kp, vp, pages, page_size, G, kvh, t0, t1, phi2, b2);
    else if constexpr (BW)
        accumulate_bw<ASYNC, NT, U, NH>(p, qr, kp, vp, pages, page_size, G, kvh, t0, t1, phi2, b2);
    else
        accumulate<ASYNC, NT, U, NH>(p, qr, kp, vp, pages, page_size, G, kvh, t0, t1, phi2, b2);
}

template <bool ASYNC, int NT, int U, bool BW, bool PIPE>
__device__ __forceinline__ void accumulate_path(Part& p, const float (&qr)[HG][8], const u16* __restrict__ kp,
                                                const u16* __restrict__ vp, const int* __restrict__ pages,
                                                int page_size, int G, int kvh, int t0, int t1, float phi2,
                                                float b2, int nh) {
    if constexpr (HG == 3) {
        if (nh < HG) {
            accumulate_nh<ASYNC, NT, U, BW, HG - 1, PIPE>(p, qr, kp, vp, pages, page_size, G, kvh, t0, t1, phi2, b2);
            return;
        }
    }
    accumulate_nh<ASYNC, NT, U, BW, HG, PIPE>(p, qr, kp, vp, pages, page_size, G, kvh, t0, t1, phi2, b2);
}

// Shared memory of one block: each warp's merged state, then the epilogue's per-head values.
template <int NW>
struct Smem {
    float acc[NW][HG][D];
    float m[NW][HG];
    float l[NW][HG];
    float mx[NW][HG];
    unsigned over[NW][HG];
    float lfin[HG];  // async epilogue: the row's total Σ 2^(s − φ)
    unsigned bad;    // async epilogue: flagged heads (slow path only)
    // An async split's per-head totals for its cluster's rank 0 (cluster_publish).
    float cl[HG], cmx[HG];
    unsigned cover[HG];
};

// 2^(m − bm), 0 for a state that saw no token (m = −inf; also avoids −inf − −inf).
__device__ __forceinline__ float rescale(float m, float bm) { return m == -FDPP_INF ? 0.f : exp2f(m - bm); }

template <bool ASYNC, int NT, int U>
__device__ __forceinline__ void block_sum(Smem<Shape<NT, U>::NW>& sm, float (&a)[Shape<NT, U>::EPT]);

// Merge the block's token groups. First the GPW groups of each warp, with shuffles; then the
// warps, through shared memory behind one barrier. On return, for each of the thread's merged
// elements e = threadIdx.x + j·NT (< HG·D; head e / D, dim e % D): a[j] is the block's sum
// (sync: rescaled to the block max of that head), and the per-warp (m, l, mx, over) in `sm` stay
// readable (through block_head) until the next barrier that precedes a rewrite.
template <bool ASYNC, int NT, int U>
__device__ __forceinline__ void block_merge(Smem<Shape<NT, U>::NW>& sm, Part& p,
                                            float (&a)[Shape<NT, U>::EPT]) {
    using S = Shape<NT, U>;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, li = threadIdx.x % LPT;
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < HG; ++h) {
            const float lo = __shfl_xor_sync(0xffffffffu, p.l[h], o);
            if (ASYNC) {
                p.l[h] += lo;
                p.mx[h] = fmaxf(p.mx[h], __shfl_xor_sync(0xffffffffu, p.mx[h], o));
                p.over[h] |= __shfl_xor_sync(0xffffffffu, (int)p.over[h], o) != 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) p.acc[h][i] += __shfl_xor_sync(0xffffffffu, p.acc[h][i], o);
            } else {
                const float mo = __shfl_xor_sync(0xffffffffu, p.m[h], o);
                const float nm = fmaxf(p.m[h], mo);
                const float f = rescale(p.m[h], nm), fo = rescale(mo, nm);
                p.l[h] = p.l[h] * f + lo * fo;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float ao = __shfl_xor_sync(0xffffffffu, p.acc[h][i], o);
                    p.acc[h][i] = p.acc[h][i] * f + ao * fo;
                }
                p.m[h] = nm;
            }
        }
    }
    if (lane < LPT) {
#pragma unroll
        for (int h = 0; h < HG; ++h) {
            float4* dst = reinterpret_cast<float4*>(&sm.acc[warp][h][li * 8]);
            dst[0] = make_float4(p.acc[h][0], p.acc[h][1], p.acc[h][2], p.acc[h][3]);
            dst[1] = make_float4(p.acc[h][4], p.acc[h][5], p.acc[h][6], p.acc[h][7]);
        }
        if (lane == 0) {
#pragma unroll
            for (int h = 0; h < HG; ++h) {
                sm.m[warp][h] = p.m[h];
                sm.l[warp][h] = p.l[h];
                sm.mx[warp][h] = p.mx[h];
                sm.over[warp][h] = p.over[h];
            }
        }
    }
    block_sum<ASYNC, NT, U>(sm, a);
}

// The block half of a merge, after each warp has written its slot of `sm` (block_merge for the
// CUDA-core pass, tc_store for the tensor-core pass): one barrier, then each thread's merged
// elements, as block_merge describes.
template <bool ASYNC, int NT, int U>
__device__ __forceinline__ void block_sum(Smem<Shape<NT, U>::NW>& sm, float (&a)[Shape<NT, U>::EPT]) {
    using S = Shape<NT, U>;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < S::EPT; ++j) {
        const int e = threadIdx.x + j * NT;
        a[j] = 0.f;
        if (e < HG * D) {
            const int h = e / D, d = e % D;
            float bm = -FDPP_INF;
            if (!ASYNC)
#pragma unroll
                for (int w = 0; w < S::NW; ++w) bm = fmaxf(bm, sm.m[w][h]);
#pragma unroll
            for (int w = 0; w < S::NW; ++w) a[j] += sm.acc[w][h][d] * (ASYNC ? 1.f : rescale(sm.m[w][h], bm));
        }
    }
}

// Head h's block totals from the warps' states left by block_merge: (block max, Σ l rescaled to
// it, largest score, over flag). Async states share φ: the max is φ and the sums add.
template <bool ASYNC, int NW>
__device__ __forceinline__ void block_head(const Smem<NW>& sm, int h, float phi2, float& bm, float& l, float& mx,
                                           bool& over) {
    bm = ASYNC ? phi2 : -FDPP_INF;
    l = 0.f;
    mx = -FDPP_INF;
    over = false;
    if (!ASYNC)
#pragma unroll
        for (int w = 0; w < NW; ++w) bm = fmaxf(bm, sm.m[w][h]);
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        l += sm.l[w][h] * (ASYNC ? 1.f : rescale(sm.m[w][h], bm));
        mx = fmaxf(mx, sm.mx[w][h]);
        over |= sm.over[w][h] != 0;
    }
}

// This lane's 8 dims of q for each of the block's `nh` live heads, scaled to log2 units; zeros
// for the masked heads of a partial chunk (their rows belong to the next kv head, or lie past q).
__device__ __forceinline__ void load_q(float (&qr)[HG][8], const u16* __restrict__ q, int row0, float scale2,
                                       int nh) {
    const int li = threadIdx.x % LPT;
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        const uint4 v =
            h < nh ? *reinterpret_cast<const uint4*>(q + (size_t)(row0 + h) * D + li * 8) : make_uint4(0, 0, 0, 0);
        unpack2(v.x, qr[h][0], qr[h][1]);
        unpack2(v.y, qr[h][2], qr[h][3]);
        unpack2(v.z, qr[h][4], qr[h][5]);
        unpack2(v.w, qr[h][6], qr[h][7]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qr[h][i] *= scale2;
    }
}

#include "attn_decode_tc.cuh"

// One block's main pass over keys [t0, t1) of its heads (q rows row0 .. row0 + nh − 1), merged:
// on return a[] holds the thread's merged elements and `sm` the per-warp (m, l, mx, over), as
// block_merge describes. TC picks the main pass: 0 the CUDA-core one, 1 the tensor-core pass
// (attn_decode_tc.cuh), ST ≥ 2 its staged form with ST shared-memory stages per warp (bandwidth
// path only); BW the bandwidth path's loop over the latency path's (the tensor-core pass: page
// ids looked up per step, or a step ahead).
template <bool ASYNC, int NT, int U, bool BW, int TC, bool PIPE = false>
__device__ __forceinline__ void block_pass(Smem<Shape<NT, U>::NW>& sm, float (&a)[Shape<NT, U>::EPT],
                                           const u16* __restrict__ q, int row0, int nh, float scale2,
                                           const u16* __restrict__ kp, const u16* __restrict__ vp,
                                           const int* __restrict__ pages, int page_size, int G, int kvh, int t0,
                                           int t1, float phi2, float b2) {
    if constexpr (TC >= 2) {
        static_assert(BW, "the staged pass has the bandwidth path's loop only");
        tcs_block_pass<ASYNC, NT, U, TC>(sm, a, q, row0, nh, scale2, kp, vp, pages, page_size, G, kvh, t0, t1, phi2,
                                         b2);
    } else if constexpr (TC) {
        tc_block_pass<ASYNC, NT, U, !BW>(sm, a, q, row0, nh, scale2, kp, vp, pages, page_size, G, kvh, t0, t1, phi2,
                                         b2);
    } else {
        float qr[HG][8];
        load_q(qr, q, row0, scale2, nh);
        Part p;
        init_part(p, ASYNC ? phi2 : -FDPP_INF);
        accumulate_path<ASYNC, NT, U, BW, PIPE>(p, qr, kp, vp, pages, page_size, G, kvh, t0, t1, phi2, b2, nh);
        block_merge<ASYNC, NT, U>(sm, p, a);
    }
}

// Async workspace, zero between launches (the last split of each block-row restores it):
// acc [rows][D] f32, then l [rows] f32, then max-score keys [rows], over-flags [rows], and one
// arrival counter per (sequence, kv head, head chunk). Both paths lay it out the same way (the
// launcher sizes it once: attn_plan.rs, accum_words).
struct AsyncWs {
    float* accs;
    float* ls;
    unsigned* keys;
    unsigned* overs;
    unsigned* arrivals;
};

__device__ __forceinline__ AsyncWs async_ws(float* ws, int rows) {
    AsyncWs a;
    a.accs = ws;
    a.ls = ws + (size_t)rows * D;
    a.keys = reinterpret_cast<unsigned*>(a.ls + rows);
    a.overs = a.keys + rows;
    a.arrivals = a.overs + rows;
    return a;
}

struct Where {
    int b, kvh, split, h0, len, t0, t1;
    int nh;  // live heads of the block's chunk (HG but in a group's partial last chunk)
};

// Head chunks per kv head: ⌈group / HG⌉ (the last one partial when HG does not divide group).
__device__ __forceinline__ int chunks_of(int group) { return (group + HG - 1) / HG; }

// Bits of the live heads 0 .. nh − 1.
__device__ __forceinline__ unsigned live_mask(int nh) { return nh >= 32 ? ~0u : (1u << nh) - 1u; }

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

// Keys whose K and V lines an async block requests into L2 before pdl_wait() (switch
// decode_prefetch, FDPP_DECODE_PREFETCH; 0: none), in splits of at least PREFETCH_MIN_SPLIT keys.
// Measured on the H100 (reports/NOTES.md, session 23): with the QKV GEMV's rotary epilogue
// (gemv_rope.cu) attention directly follows that GEMV, whose tail is the window, and Llama-3.1-8B's
// shape at 32768 tokens decodes in 6.46 ms per token against 6.51 without it. Alone, the async
// kernel gained 0.5-3.5 % at long splits, but lost 6-8 % at splits of 64 keys (the page-id round
// trip then precedes the q load on the critical path) and the sync kernel lost 2-12 % (ptxas put
// a spill into its main loop): hence async only, long splits only.
#ifndef FDPP_DECODE_PREFETCH
#define FDPP_DECODE_PREFETCH 64
#endif
constexpr int PREFETCH_KEYS = FDPP_DECODE_PREFETCH;
constexpr int PREFETCH_MIN_SPLIT = 512;

// Before pdl_wait(): the K and V lines of the block's first PREFETCH_KEYS keys, requested into L2.
//
// Why: in a decode step this kernel follows qkv_rope_append, a short kernel, and with PDL
// (launch.rs) its blocks are resident while that one runs; until now they spent that time in
// griddepcontrol.wait and only then began the chain lens → page ids → K/V, so each layer's
// attention started with a DRAM round trip the previous kernel could have hidden (the ramp that
// session 4's ablation put at about half of attention's 12.5 µs per layer at 1024 tokens).
// What is read here no kernel of the step writes: lens and the block table are host uploads,
// queued ahead of every kernel after them (cuda/attention.rs, upload.rs); the rows below
// len − 1 were appended by earlier steps. Row len − 1, the one qkv_rope_append writes now, is
// left out. A prefetch moves nothing into registers, so even a stale line could not reach a
// result: the loads after pdl_wait() read L2, the point of coherence.
__device__ __forceinline__ void prefetch_first(const u16* __restrict__ kp, const u16* __restrict__ vp,
                                               const int* __restrict__ pages, int page_size, int G, int kvh,
                                               int t0, int t1, int len) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int LPR = D / 64;  // 128-byte lines of one kv head's row (d64: 1, d256: 4)
    const int n = min(PREFETCH_KEYS, min(t1, len - 1) - t0);
    // Element e: key e / (2·LPR), K or V, line; neighbouring threads share a key's page id.
    for (int e = threadIdx.x; e < n * 2 * LPR; e += blockDim.x) {
        const int tok = t0 + e / (2 * LPR), r = e % (2 * LPR);
        const int idx = tok / page_size;
        const size_t row = ((size_t)pages[idx] * page_size + (tok - idx * page_size)) * G + kvh;
        const u16* at = (r < LPR ? kp : vp) + row * D + 64 * (r % LPR);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
    }
#endif
}

// Write the merged elements a[] of the heads in `mask` (live heads only), each divided by its
// head's l.
template <int NT, int U>
__device__ __forceinline__ void write_elems(const float (&a)[Shape<NT, U>::EPT], const float (&lh)[HG],
                                            u16* __restrict__ out, int row0, unsigned mask) {
#pragma unroll
    for (int j = 0; j < Shape<NT, U>::EPT; ++j) {
        const int e = threadIdx.x + j * NT;
        if (e < HG * D) {
            const int h = e / D;
            float l = lh[0];
#pragma unroll
            for (int k = 1; k < HG; ++k)
                if (h == k) l = lh[k];
            if (mask & (1u << h)) out[(size_t)row0 * D + e] = from_f32(a[j] / l);
        }
    }
}

// Whole-sequence sync attention for the block's heads in `mask` (the async recompute path). The
// caller has passed a barrier since its last read of `sm`'s per-warp slots. Not inlined, and q
// loaded again: the rare path then costs the common one no registers.
template <int NT, int U, bool BW, int TC>
__device__ __noinline__ void recompute_sync(Smem<Shape<NT, U>::NW>& sm, const u16* __restrict__ q, float scale2,
                                            const u16* __restrict__ kp, const u16* __restrict__ vp,
                                            const int* __restrict__ pages, int page_size, int G, int kvh, int len,
                                            u16* __restrict__ out, int row0, int nh, unsigned mask) {
    float a[Shape<NT, U>::EPT];
    block_pass<false, NT, U, BW, TC>(sm, a, q, row0, nh, scale2, kp, vp, pages, page_size, G, kvh, 0, len, 0.f, 0.f);
    float lh[HG];
#pragma unroll
    for (int h = 0; h < HG; ++h) {
        float bm, mx;
        bool over;
        block_head<false>(sm, h, 0.f, bm, lh[h], mx, over);
    }
    write_elems<NT, U>(a, lh, out, row0, mask);
}

// A row's async splits finished inside one thread-block cluster (sm_90).
//
// Why: async split blocks meet through global memory: each adds its sums with atomics, fences,
// counts its arrival, and the last to arrive reads the totals back — three dependent L2 round
// trips after the last loop ends. Measured on the H100 (reports/NOTES.md, session 29; MHA d128,
// launches of the same blocks with the same keys per block): 2-8 splits of a row cost 3.0-3.5 µs
// more than whole rows, 6 % of a batch-8 step at 1024 keys. Where the launcher puts a row's
// splits in one cluster (2..=CLUSTER_MAX splits, one head chunk: cluster rank = split), each
// split leaves its merged partial in its own shared memory and rank 0 reads the others' through
// distributed shared memory behind one cluster barrier; the partials share φ (FlashDecoding++
// §3), so they add as they are, and rank 0 finishes the row exactly as the last split did.
// (The sync scheme's combine done the same way measured level to 0.9 % slower: not built.)

// CTAs in this block's cluster (1 without a cluster launch, and before sm_90).
__device__ __forceinline__ unsigned cluster_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
#else
    return 1;
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    return 0;
#endif
}

// Every thread of every CTA of the cluster: this CTA's shared-memory writes before it become
// visible to the others' reads after it.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The word at `p` (in this CTA's shared memory) in cluster CTA `rank`'s copy of it.
__device__ __forceinline__ unsigned ld_cluster(const void* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned a, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
#else
    return 0;
#endif
}
__device__ __forceinline__ float ld_cluster_f(const float* p, unsigned rank) {
    return __uint_as_float(ld_cluster(p, rank));
}

// This async split's merged partial into its shared memory (a[] over sm.acc[0], which each thread
// read only at its own elements in block_sum; the per-head totals beside it), then the cluster
// barrier: afterwards rank 0 may read every split's.
template <int NT, int U>
__device__ __forceinline__ void cluster_publish(Smem<Shape<NT, U>::NW>& sm, const float (&a)[Shape<NT, U>::EPT],
                                                int nh, float phi2) {
#pragma unroll
    for (int j = 0; j < Shape<NT, U>::EPT; ++j) {
        const int e = threadIdx.x + j * NT;
        if (e < nh * D) sm.acc[0][e / D][e % D] = a[j];
    }
    if (threadIdx.x < nh) {
        float bm, l, mx;
        bool over;
        block_head<true>(sm, threadIdx.x, phi2, bm, l, mx, over);
        sm.cl[threadIdx.x] = l;
        sm.cmx[threadIdx.x] = mx;
        sm.cover[threadIdx.x] = over;
    }
    cluster_barrier();
}

// Rank 0 of a cluster of n splits: the row's sums into a[], each head's total l into sm.lfin, and
// in `bad` the heads flagged as the last split of the atomic path flags them. Then the cluster
// barrier that lets the other ranks exit (they call it without this).
template <int NT, int U>
__device__ __forceinline__ void cluster_gather(Smem<Shape<NT, U>::NW>& sm, float (&a)[Shape<NT, U>::EPT], int nh,
                                               unsigned n, float phi2, float a2, unsigned& bad) {
    // Every remote word is requested before any is used (one round trip, not n).
    if (threadIdx.x < nh) {
        const int h = threadIdx.x;
        float cl[CLUSTER_MAX], cmx[CLUSTER_MAX];
        unsigned cover[CLUSTER_MAX];
#pragma unroll
        for (int r = 0; r < CLUSTER_MAX; ++r) {
            const bool in = r < (int)n;
            cl[r] = in ? ld_cluster_f(&sm.cl[h], r) : 0.f;
            cmx[r] = in ? ld_cluster_f(&sm.cmx[h], r) : -FDPP_INF;
            cover[r] = in ? ld_cluster(&sm.cover[h], r) : 0u;
        }
        float l = 0.f, mx = -FDPP_INF;
        bool over = false;
#pragma unroll
        for (int r = 0; r < CLUSTER_MAX; ++r) {
            l += cl[r];
            mx = fmaxf(mx, cmx[r]);
            over |= cover[r] != 0;
        }
        sm.lfin[h] = l;
        if (over || !(mx - phi2 >= a2) || !(l > 0.f) || !finite(l)) bad |= 1u << h;
    }
#pragma unroll
    for (int j = 0; j < Shape<NT, U>::EPT; ++j) {
        const int e = threadIdx.x + j * NT;
        if (e < nh * D) {
            float x[CLUSTER_MAX];
#pragma unroll
            for (int r = 0; r < CLUSTER_MAX; ++r) x[r] = r < (int)n ? ld_cluster_f(&sm.acc[0][e / D][e % D], r) : 0.f;
            float v = 0.f;
#pragma unroll
            for (int r = 0; r < CLUSTER_MAX; ++r) v += x[r];
            a[j] = v;
        }
    }
    cluster_barrier();
}

template <int NT, int U, bool BW, int TC>
__device__ __forceinline__ void decode_sync(const u16* __restrict__ q, const u16* __restrict__ kp,
                                            const u16* __restrict__ vp, const int* __restrict__ table,
                                            const int* __restrict__ lens, int max_pages, int page_size, int H, int G,
                                            int splits, float scale2, float* __restrict__ part,
                                            u16* __restrict__ out) {
    using S = Shape<NT, U>;
    pdl_wait();
    pdl_trigger();
    __shared__ Smem<S::NW> sm;
    const int group = H / G;
    const Where w = where(lens, G, group, splits);
    const int row0 = w.b * H + w.h0;
    const int* pages = table + (size_t)w.b * max_pages;
    float a[S::EPT];
    block_pass<false, NT, U, BW, TC>(sm, a, q, row0, w.nh, scale2, kp, vp, pages, page_size, G, w.kvh, w.t0, w.t1, 0.f,
                                     0.f);
    if (splits == 1) {
        float lh[HG];
#pragma unroll
        for (int h = 0; h < HG; ++h) {
            float bm, mx;
            bool over;
            block_head<false>(sm, h, 0.f, bm, lh[h], mx, over);
        }
        write_elems<NT, U>(a, lh, out, row0, live_mask(w.nh));
        return;
    }
    // Partials: acc [row][split][D], then (m, l) [row][split] after all rows' acc.
    const int rows = gridDim.y * group;
#pragma unroll
    for (int j = 0; j < S::EPT; ++j) {
        const int e = threadIdx.x + j * NT;
        if (e < w.nh * D) part[((size_t)(row0 + e / D) * splits + w.split) * D + e % D] = a[j];
    }
    if (threadIdx.x < w.nh) {
        float bm, l, mx;
        bool over;
        block_head<false>(sm, threadIdx.x, 0.f, bm, l, mx, over);
        float* ml = part + (size_t)rows * splits * D;
        const size_t at = ((size_t)(row0 + threadIdx.x) * splits + w.split) * 2;
        ml[at] = bm;
        ml[at + 1] = l;
    }
}

// One block per row: merge the splits' partials, each rescaled to the largest max. This kernel's
// time is round trips, not bytes (a row's partials are splits · D floats, just written, in L2):
// every thread reads its splits' (m, l) at once and the block reduces the max and the total in
// shared memory; then the threads split into groups of D/4, each group summing every
// CMB_GROUPS-th split's partial as float4s, so a round trip serves CMB_GROUPS splits and the loads
// carry no branch on loaded data. Up to COMBINE_MAX_SPLITS splits: the grouped decode launches
// at batch 1 split each of its few (sequence, kv head) items up to a wave of resident blocks
// (GQA 32/4: 4 items, 132 splits on 132 SMs; reports/NOTES.md, session 18).
constexpr int CMB_TPS = D / 4;                          // threads per split: a float4 of dims each
constexpr int CMB_GROUPS = COMBINE_THREADS / CMB_TPS;   // splits summed side by side (4 at d128)
constexpr int CMB_PER = COMBINE_MAX_SPLITS / COMBINE_THREADS;  // (m, l) pairs per thread
static_assert(COMBINE_THREADS % CMB_TPS == 0 && COMBINE_MAX_SPLITS % COMBINE_THREADS == 0,
              "the combine's thread layout");

// The block's max (MAX) or sum of v; every thread gets it. `red` holds COMBINE_THREADS floats.
template <bool MAX>
__device__ __forceinline__ float combine_reduce(float v, float* red) {
    __syncthreads();  // red's previous use is over
    red[threadIdx.x] = v;
    __syncthreads();
#pragma unroll
    for (int w = COMBINE_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            const float o = red[threadIdx.x + w];
            red[threadIdx.x] = MAX ? fmaxf(red[threadIdx.x], o) : red[threadIdx.x] + o;
        }
        __syncthreads();
    }
    return red[0];
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
attn_combine(const float* __restrict__ part, int rows, int splits, u16* __restrict__ out) {
    pdl_wait();
    pdl_trigger();
    __shared__ float wt[COMBINE_MAX_SPLITS];
    __shared__ float red[COMBINE_THREADS];
    __shared__ float4 sums[COMBINE_THREADS];
    const int row = blockIdx.x, tid = threadIdx.x;
    const float* ml = part + (size_t)rows * splits * D + (size_t)row * splits * 2;
    float m[CMB_PER], l[CMB_PER];
    float bm = -FDPP_INF;
#pragma unroll
    for (int k = 0; k < CMB_PER; ++k) {
        const int sp = tid + COMBINE_THREADS * k;
        m[k] = sp < splits ? __ldcg(ml + 2 * sp) : -FDPP_INF;
        l[k] = sp < splits ? __ldcg(ml + 2 * sp + 1) : 0.f;
        bm = fmaxf(bm, m[k]);
    }
    bm = combine_reduce<true>(bm, red);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < CMB_PER; ++k) {
        const int sp = tid + COMBINE_THREADS * k;
        // An empty split (l = 0, m = −inf) weighs nothing (and −inf − −inf is not computed).
        const float f = l[k] == 0.f ? 0.f : exp2f(m[k] - bm);
        sum += l[k] * f;
        if (sp < splits) wt[sp] = f;
    }
    const float total = combine_reduce<false>(sum, red);  // its barriers publish wt
    const int grp = tid / CMB_TPS, c = tid % CMB_TPS;
    const float4* src = reinterpret_cast<const float4*>(part + (size_t)row * splits * D) + c;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int sp = grp; sp < splits; sp += CMB_GROUPS) {
        const float f = wt[sp];
        const float4 v = __ldcg(src + (size_t)sp * (D / 4));
        acc.x += v.x * f;
        acc.y += v.y * f;
        acc.z += v.z * f;
        acc.w += v.w * f;
    }
    sums[tid] = acc;
    __syncthreads();
    if (tid < CMB_TPS) {
#pragma unroll
        for (int g = 1; g < CMB_GROUPS; ++g) {
            const float4 o = sums[g * CMB_TPS + tid];
            acc.x += o.x;
            acc.y += o.y;
            acc.z += o.z;
            acc.w += o.w;
        }
        u16* dst = out + (size_t)row * D + 4 * tid;
        dst[0] = from_f32(acc.x / total);
        dst[1] = from_f32(acc.y / total);
        dst[2] = from_f32(acc.z / total);
        dst[3] = from_f32(acc.w / total);
    }
}

// The async kernel of both paths (workspace: async_ws(); `recomputed` is a running total).
template <int NT, int U, bool BW, int TC, bool PIPE = false>
__device__ __forceinline__ void decode_async(const u16* __restrict__ q, const u16* __restrict__ kp,
                                             const u16* __restrict__ vp, const int* __restrict__ table,
                                             const int* __restrict__ lens, int max_pages, int page_size, int H, int G,
                                             int splits, float scale2, float phi2, float a2, float b2,
                                             float* __restrict__ ws, unsigned* __restrict__ recomputed,
                                             u16* __restrict__ out) {
    using S = Shape<NT, U>;
    __shared__ Smem<S::NW> sm;
    const int group = H / G;
    const Where w = where(lens, G, group, splits);
    const int rows = gridDim.y * group;
    const auto [accs, ls, keys, overs, arrivals] = async_ws(ws, rows);
    const int row0 = w.b * H + w.h0;
    const int* pages = table + (size_t)w.b * max_pages;
    if (PREFETCH_KEYS > 0 && w.t1 - w.t0 >= PREFETCH_MIN_SPLIT)
        prefetch_first(kp, vp, pages, page_size, G, w.kvh, w.t0, w.t1, w.len);
    pdl_wait();
    pdl_trigger();

    float a[S::EPT];
    block_pass<true, NT, U, BW, TC, PIPE>(sm, a, q, row0, w.nh, scale2, kp, vp, pages, page_size, G, w.kvh, w.t0,
                                          w.t1, phi2, b2);

    // Per head: the row's total l, and whether it is flagged (a bit per head of `bad`).
    float lh[HG];
    unsigned bad = 0;
    if (splits == 1) {
        // The block is the whole row: its totals are final, no workspace.
#pragma unroll
        for (int h = 0; h < HG; ++h) {
            float bm, mx;
            bool over;
            block_head<true>(sm, h, phi2, bm, lh[h], mx, over);
            if (h < w.nh && (over || !(mx - phi2 >= a2) || !(lh[h] > 0.f) || !finite(lh[h]))) bad |= 1u << h;
        }
    } else if (splits <= CLUSTER_MAX && cluster_ctas() == (unsigned)splits) {
        cluster_publish<NT, U>(sm, a, w.nh, phi2);
        if (cluster_rank() != 0) {
            cluster_barrier();
            return;
        }
        cluster_gather<NT, U>(sm, a, w.nh, splits, phi2, a2, bad);
    } else {
        // Add this split's sums and flags to the row's, then count the arrival: the block that
        // brings the count to `splits` sees every other split's atomics (each split's thread 0
        // fences after its barrier, so the whole block's atomics are ordered before its count).
#pragma unroll
        for (int j = 0; j < S::EPT; ++j) {
            const int e = threadIdx.x + j * NT;
            if (e < w.nh * D) atomicAdd(&accs[(size_t)row0 * D + e], a[j]);
        }
        if (threadIdx.x < w.nh) {
            float bm, l, mx;
            bool over;
            block_head<true>(sm, threadIdx.x, phi2, bm, l, mx, over);
            atomicAdd(&ls[row0 + threadIdx.x], l);
            if (mx != -FDPP_INF) atomicMax(&keys[row0 + threadIdx.x], fkey(mx));
            if (over) atomicOr(&overs[row0 + threadIdx.x], 1u);
        }
        __syncthreads();
        const int chunks = chunks_of(group);
        const int chunk_id = blockIdx.y * chunks + blockIdx.x % chunks;
        int last = 0;
        if (threadIdx.x == 0) {
            __threadfence();
            last = atomicAdd(&arrivals[chunk_id], 1u) == (unsigned)(splits - 1);
            // Acquire: what the other splits added is read below, after the barrier.
            __threadfence();
        }
        if (!__syncthreads_or(last)) return;
        // The last split of these rows: totals are complete. Every read in one round trip, each
        // slot restored to zero for the next launch.
#pragma unroll
        for (int j = 0; j < S::EPT; ++j) {
            const int e = threadIdx.x + j * NT;
            if (e < w.nh * D) {
                a[j] = __ldcg(&accs[(size_t)row0 * D + e]);
                accs[(size_t)row0 * D + e] = 0.f;
            }
        }
        if (threadIdx.x < w.nh) {
            const int h = threadIdx.x;
            const float l = __ldcg(&ls[row0 + h]);
            const float mx = unkey(__ldcg(&keys[row0 + h]));
            const bool over = __ldcg(&overs[row0 + h]) != 0;
            ls[row0 + h] = 0.f;
            keys[row0 + h] = 0;
            overs[row0 + h] = 0;
            sm.lfin[h] = l;
            if (over || !(mx - phi2 >= a2) || !(l > 0.f) || !finite(l)) bad |= 1u << h;
        }
        if (threadIdx.x == 0) arrivals[chunk_id] = 0;
    }
    // Non-finite sums show in the accumulator too.
#pragma unroll
    for (int j = 0; j < S::EPT; ++j) {
        const int e = threadIdx.x + j * NT;
        if (e < w.nh * D && !finite(a[j])) bad |= 1u << (e / D);
    }
    // One barrier-reduction tells whether any head is flagged (and publishes sm.lfin); the
    // per-head mask is gathered only when one is.
    const bool any_bad = __syncthreads_or(bad != 0);
    if (splits > 1) {
#pragma unroll
        for (int h = 0; h < HG; ++h) lh[h] = h < w.nh ? sm.lfin[h] : 1.f;
    }
    unsigned flagged = 0;
    if (any_bad) {
        if (threadIdx.x == 0) sm.bad = 0;
        __syncthreads();
        if (bad) atomicOr(&sm.bad, bad);
        __syncthreads();
        flagged = sm.bad;
    }
    write_elems<NT, U>(a, lh, out, row0, live_mask(w.nh) & ~flagged);
    if (flagged) {
        // Every read of the per-warp slots happened before the barriers above.
        recompute_sync<NT, U, BW, TC>(sm, q, scale2, kp, vp, pages, page_size, G, w.kvh, w.len, out, row0, w.nh,
                                  flagged);
        if (threadIdx.x == 0) atomicAdd(recomputed, __popc(flagged));
    }
}

// The entry points: attn_decode_{sync,async}_t128u4, the latency path (128 threads, 4 tokens per
// group per round), and attn_decode_{sync,async}, the bandwidth path (the same block, merge and
// epilogue around the bandwidth loop).
#define FDPP_DECODE_ENTRIES(SUFFIX, NT, U, BW, TC, MINB_SYNC, MINB_ASYNC)                                       \
    extern "C" __global__ void __launch_bounds__(NT, MINB_SYNC) attn_decode_sync##SUFFIX(                    \
        const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,                    \
        const int* __restrict__ table, const int* __restrict__ lens, int max_pages, int page_size, int H,     \
        int G, int splits, float scale2, float* __restrict__ part, u16* __restrict__ out) {                   \
        decode_sync<NT, U, BW, TC>(q, kp, vp, table, lens, max_pages, page_size, H, G, splits, scale2, part, out); \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(NT, MINB_ASYNC) attn_decode_async##SUFFIX(                  \
        const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,                    \
        const int* __restrict__ table, const int* __restrict__ lens, int max_pages, int page_size, int H,     \
        int G, int splits, float scale2, float phi2, float a2, float b2, float* __restrict__ ws,               \
        unsigned* __restrict__ recomputed, u16* __restrict__ out) {                                           \
        decode_async<NT, U, BW, TC>(q, kp, vp, table, lens, max_pages, page_size, H, G, splits, scale2, phi2, a2,  \
                                b2, ws, recomputed, out);                                                     \
    }

// Blocks per SM (0: ptxas's choice). The bandwidth path's async kernel with one head per block is
// held to 80 registers, the 6 blocks per SM its earlier version had (90 otherwise: 5), its
// pipelined form (attn_decode_async_pipe, MHA at head_dim 128+) to 128, 4 blocks per SM. With
// three heads per block (GQA 3, 5, 6, 9) it is held to 128 registers, 4 blocks per SM (144
// otherwise: 3; ptxas spills 12 bytes at d128): measured on the H100 at d128, batch 16-64, 6-17 %
// faster at 4096-32768 keys, and 22-27 % at batch 1 · 32768, level elsewhere. Every other kernel
// keeps its registers (a minimum of 1 is not neutral: it let ptxas take 8-16 more).
#if FDPP_HG <= 4
FDPP_DECODE_ENTRIES(_t128u4, 128, 4, false, 0, 0, 0)
FDPP_DECODE_ENTRIES(, 128, 4, true, 0, 0, HG == 1 ? 6 : HG == 3 ? 4 : 0)
#endif
#if FDPP_HG == 1 && FDPP_D >= 128
extern "C" __global__ void __launch_bounds__(128, 4) attn_decode_async_pipe(
    const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp, const int* __restrict__ table,
    const int* __restrict__ lens, int max_pages, int page_size, int H, int G, int splits, float scale2, float phi2,
    float a2, float b2, float* __restrict__ ws, unsigned* __restrict__ recomputed, u16* __restrict__ out) {
    decode_async<128, 4, true, 0, true>(q, kp, vp, table, lens, max_pages, page_size, H, G, splits, scale2, phi2, a2,
                                        b2, ws, recomputed, out);
}
#endif

// The tensor-core pass (attn_decode_tc.cuh), every head_dim, any HG up to 8: attn_decode_*_tc
// (the bandwidth path: page ids per step) and attn_decode_*_tc_t128u4 (the latency path: page ids
// a step ahead). NVRTC 13.0, sm_90a, d128 HG 8: ptxas would take 128 registers for the bandwidth
// sync kernel and 150 for its async one (3 blocks per SM); held to 128 (4 blocks, as the
// CUDA-core kernels measured best in session 9) the async kernel spills 36 bytes, none of it in
// the main loop (305-309 instructions per 16 keys in both). The latency path's kernels (148-156)
// would spill inside the loop at 128 and keep ptxas's choice: they serve launches of few blocks.
// d256 (teams of two warps, session 13): 128 registers for both bandwidth kernels (sync no spill,
// async 16-20 bytes outside the loop), 140-160 for the latency ones.
FDPP_DECODE_ENTRIES(_tc_t128u4, 128, 4, false, 1, 0, 0)
FDPP_DECODE_ENTRIES(_tc, 128, 4, true, 1, 4, 4)

// The staged form of the tensor-core pass (attn_decode_tc.cuh, "The staged form"), bandwidth path,
// 2 or 3 cp.async stages per warp in dynamic shared memory (FDPP_DECODE_TC_STAGES; off by default
// until measured). No launch bounds: its K/V in flight are not in registers.
FDPP_DECODE_ENTRIES(_tcs2, 128, 4, true, 2, 0, 0)
FDPP_DECODE_ENTRIES(_tcs3, 128, 4, true, 3, 0, 0)
