// Causal prefill attention over the paged KV cache, in the FlashAttention-2 shape: one block
// owns BM = 128 query rows of one head (16 per warp, 8 warps: each K/V tile staged once serves
// 128 rows, halving the L2 traffic of 64-row blocks) and walks the key tiles of BN keys in
// order, S = Q·Kᵀ and O += P·V on tensor cores (mma.sync m16n8k16, fp32 accumulation), K and V
// tiles double-buffered in shared memory by cp.async and gathered row by row from their pages.
// The new tokens' K and V are already in the cache (the host appends them first).
//
// Two softmax schemes (FlashDecoding++ §3): `sync` keeps a running row max and rescales O and l
// when it grows (FlashAttention-2); `async` takes every term against the unified φ, so no row
// max, no rescale of O. A row whose scores leave [φ + a, φ + b] (or whose sum is not finite) is
// flagged; if any row of the block is flagged, the block walks the keys again with the sync
// scheme and rewrites the flagged rows, counting them.
//
// The host passes one int4 per query tile: (sequence, first row in q/out, position of the first
// query in its sequence, rows), ordered longest key range first so that the causal tail
// balances.
#include "common.cuh"
#include "attn_common.cuh"

#ifndef FDPP_D
#define FDPP_D 128
#endif

constexpr int D = FDPP_D;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int BM = 16 * WARPS;
constexpr int BN = D == 256 ? 32 : 64;
constexpr int CH = D / 8;          // 16-byte chunks per row
constexpr int NT = BN / 8;         // n8 tiles of S per warp
constexpr int DT = D / 8;          // n8 tiles of O per warp
constexpr int KS = D / 16;         // k16 steps of Q·Kᵀ
// Q fragments stay in registers up to d128; at d256 they are re-read from shared memory.
constexpr bool QREG = D <= 128;

static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");

// Shared memory layout (dynamic): Q [BM][D], then two stages of K [BN][D] and V [BN][D]
// (sources.rs: prefill_smem_bytes).
constexpr int Q_ELEMS = BM * D;
constexpr int KV_ELEMS = BN * D;

// XOR swizzle of 16-byte chunks within each 128-byte group: ldmatrix's eight row addresses of
// one 8×8 matrix then fall in eight different bank groups.
__device__ __forceinline__ int sw(int row, int chunk) { return row * D + ((chunk ^ (row & 7)) * 8); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if FDPP_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


struct Tile {
    int b, row0, pos0, rows;
};

struct Ctx {
    const u16* q;
    const u16* kp;
    const u16* vp;
    const int* pages;
    int page_size, H, G, h, kvh, kv_end;
    Tile t;
    u16* sq;
    u16* skv;  // stage s: K at skv + 2·s·KV_ELEMS, V right after it
    __device__ __forceinline__ u16* sk(int stage) const { return skv + 2 * stage * KV_ELEMS; }
    __device__ __forceinline__ u16* sv(int stage) const { return skv + (2 * stage + 1) * KV_ELEMS; }
};

// Stage key tile n (keys n·BN .. +BN) of K and V; keys at or past kv_end are zero-filled.
__device__ __forceinline__ void load_kv(const Ctx& c, int n, int stage) {
    for (int i = threadIdx.x; i < BN * CH; i += THREADS) {
        const int r = i / CH, ch = i % CH;
        const int key = n * BN + r;
        const bool ok = key < c.kv_end;
        size_t at = 0;
        if (ok) {
            const int page = c.pages[key / c.page_size];
            at = ((size_t)page * c.page_size + key % c.page_size) * c.G * D + (size_t)c.kvh * D + ch * 8;
        }
        cp_async16(smem_addr(c.sk(stage) + sw(r, ch)), c.kp + at, ok ? 16 : 0);
        cp_async16(smem_addr(c.sv(stage) + sw(r, ch)), c.vp + at, ok ? 16 : 0);
    }
}

__device__ __forceinline__ void load_q(const Ctx& c) {
    for (int i = threadIdx.x; i < BM * CH; i += THREADS) {
        const int r = i / CH, ch = i % CH;
        const bool ok = r < c.t.rows;
        const size_t at = ok ? ((size_t)(c.t.row0 + r) * c.H + c.h) * D + ch * 8 : 0;
        cp_async16(smem_addr(c.sq + sw(r, ch)), c.q + at, ok ? 16 : 0);
    }
}

// A fragment of Q for k-step ks of this warp's 16 rows.
__device__ __forceinline__ void q_frag(const Ctx& c, int ks, u32 (&a)[4]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
    ldsm_x4(smem_addr(c.sq + sw(row, 2 * ks + lane / 16)), a[0], a[1], a[2], a[3]);
}

// Row state of the two rows (g and g + 8) a thread holds.
struct Rows {
    float o[DT][4];
    float m[2], l[2], mx[2];
    bool over[2];
};

// Walk every key tile for this block's rows with one scheme; O, l and the flags end in `st`.
template <bool ASYNC>
__device__ void walk(const Ctx& c, Rows& st, const u32 (&qa)[QREG ? KS : 1][4], float scale2, float phi2, float b2) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.m[r] = ASYNC ? phi2 : -FDPP_INF;
        st.l[r] = 0.f;
        st.mx[r] = -FDPP_INF;
        st.over[r] = false;
    }
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) st.o[j][i] = 0.f;
    // Query positions of the thread's two rows.
    const int qpos[2] = {c.t.pos0 + warp * 16 + g, c.t.pos0 + warp * 16 + g + 8};
    const int ntiles = (c.kv_end + BN - 1) / BN;
    load_kv(c, 0, 0);
    cp_async_commit();
    for (int n = 0; n < ntiles; ++n) {
        const int stage = n & 1;
        if (n + 1 < ntiles) {
            load_kv(c, n + 1, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        // S = Q · Kᵀ for this warp's 16 rows and BN keys.
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            u32 a[4];
            if (QREG) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = qa[QREG ? ks : 0][i];
            } else {
                q_frag(c, ks, a);
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 b0, b1, b2_, b3;
                const int key = 8 * (j + lane / 16) + lane % 8;
                ldsm_x4(smem_addr(c.sk(stage) + sw(key, 2 * ks + (lane / 8) % 2)), b0, b1, b2_, b3);
                mma(s[j], a[0], a[1], a[2], a[3], b0, b1);
                mma(s[j + 1], a[0], a[1], a[2], a[3], b2_, b3);
            }
        }
        // Scale to log2 units and mask keys past each row's position (causal) or past the end.
        const bool diag = n * BN + BN - 1 > c.t.pos0 + warp * 16;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = n * BN + 8 * j + 2 * tq + (i & 1);
                const int r = i >> 1;
                s[j][i] *= scale2;
                if (diag && key > qpos[r]) s[j][i] = -FDPP_INF;
            }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float tm = -FDPP_INF;
#pragma unroll
            for (int j = 0; j < NT; ++j) tm = fmaxf(tm, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
            if (ASYNC) {
                st.mx[r] = fmaxf(st.mx[r], tm);
                st.over[r] |= tm - phi2 > b2;
                corr[r] = 1.f;
            } else {
                const float mn = fmaxf(st.m[r], tm);
                // A row with every key so far masked keeps m = −inf; nothing to rescale.
                corr[r] = mn == -FDPP_INF ? 1.f : ex2(st.m[r] - mn);
                st.m[r] = mn;
            }
        }
        // P = 2^(S − m), packed as the A operand of P·V (two n8 tiles of S make one k16 step).
        u32 pa[NT / 2][4];
        float ls[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float m = st.m[i >> 1];
                p[i] = s[j][i] == -FDPP_INF ? 0.f : ex2(s[j][i] - m);
            }
            ls[0] += p[0] + p[1];
            ls[1] += p[2] + p[3];
            pa[j / 2][(j % 2) * 2 + 0] = pack2(p[0], p[1]);
            pa[j / 2][(j % 2) * 2 + 1] = pack2(p[2], p[3]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * corr[r] + ls[r];
        if (!ASYNC) {
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                st.o[j][0] *= corr[0];
                st.o[j][1] *= corr[0];
                st.o[j][2] *= corr[1];
                st.o[j][3] *= corr[1];
            }
        }
        // O += P · V.
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
#pragma unroll
            for (int jd = 0; jd < DT; jd += 2) {
                u32 b0, b1, b2_, b3;
                const int key = 16 * kk + (lane % 8) + 8 * ((lane / 8) % 2);
                ldsm_x4_t(smem_addr(c.sv(stage) + sw(key, jd + lane / 16)), b0, b1, b2_, b3);
                mma(st.o[jd], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
                mma(st.o[jd + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b2_, b3);
            }
        }
        __syncthreads();
    }
    // Row sums over the quad that holds each row.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    }
}

// Write rows whose bit in `mask` (bit 0: row g, bit 1: row g + 8) is set.
__device__ __forceinline__ void store(const Ctx& c, const Rows& st, u16* __restrict__ out, unsigned mask) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r;
        if (!(mask & (1u << r)) || row >= c.t.rows) continue;
        const float inv = 1.f / st.l[r];
        u16* o = out + ((size_t)(c.t.row0 + row) * c.H + c.h) * D;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
            const u32 v = pack2(st.o[j][2 * r] * inv, st.o[j][2 * r + 1] * inv);
            *reinterpret_cast<u32*>(o + 8 * j + 2 * tq) = v;
        }
    }
}

template <bool ASYNC>
__device__ void prefill(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                        const int* __restrict__ table, const int4* __restrict__ tiles, int max_pages, int page_size,
                        int H, int G, int nsec, float scale2, float phi2, float a2, float b2, unsigned* __restrict__ recomputed,
                        u16* __restrict__ out) {
    extern __shared__ __align__(128) u16 smem[];
    // Which (query tile, head) this block computes: see tile_head() in attn_common.cuh.
    const TileHead th = tile_head(H, G, nsec);
    const int4 tv = tiles[th.tile];
    Ctx c;
    c.t = Tile{tv.x, tv.y, tv.z, tv.w};
    c.q = q;
    c.kp = kp;
    c.vp = vp;
    c.pages = table + (size_t)c.t.b * max_pages;
    c.page_size = page_size;
    c.H = H;
    c.G = G;
    c.h = th.head;
    c.kvh = c.h / (H / G);
    c.kv_end = c.t.pos0 + c.t.rows;
    c.sq = smem;
    c.skv = smem + Q_ELEMS;

    load_q(c);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qa[QREG ? KS : 1][4];
    if (QREG) {
#pragma unroll
        for (int ks = 0; ks < (QREG ? KS : 1); ++ks) q_frag(c, ks, qa[ks]);
    }
    Rows st;
    walk<ASYNC>(c, st, qa, scale2, phi2, b2);
    if (!ASYNC) {
        store(c, st, out, 3u);
        return;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned bad = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        bool fin = st.l[r] > 0.f && finite(st.l[r]);
#pragma unroll
        for (int j = 0; j < DT; ++j) fin = fin && finite(st.o[j][2 * r]) && finite(st.o[j][2 * r + 1]);
        // The quad shares the row: any lane's view flags it.
        const bool flag_lane = st.over[r] || st.mx[r] - phi2 < a2 || !fin;
        const unsigned quad = __ballot_sync(0xffffffffu, flag_lane) >> (lane & ~3);
        const bool row_ok = warp * 16 + lane / 4 + 8 * r < c.t.rows;
        if ((quad & 0xfu) && row_ok) bad |= 1u << r;
    }
    store(c, st, out, ~bad & 3u);
    if (__syncthreads_or(bad != 0)) {
        walk<false>(c, st, qa, scale2, 0.f, 0.f);
        store(c, st, out, bad);
        // One lane per quad counts its rows.
        if (lane % 4 == 0 && bad) atomicAdd(recomputed, __popc(bad));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
attn_prefill_sync(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                  const int* __restrict__ table, const int4* __restrict__ tiles, int max_pages, int page_size, int H,
                  int G, int nsec, float scale2, u16* __restrict__ out) {
    prefill<false>(q, kp, vp, table, tiles, max_pages, page_size, H, G, nsec, scale2, 0.f, 0.f, 0.f, nullptr, out);
}

extern "C" __global__ void __launch_bounds__(THREADS)
attn_prefill_async(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                   const int* __restrict__ table, const int4* __restrict__ tiles, int max_pages, int page_size, int H,
                   int G, int nsec, float scale2, float phi2, float a2, float b2, unsigned* __restrict__ recomputed,
                   u16* __restrict__ out) {
    prefill<true>(q, kp, vp, table, tiles, max_pages, page_size, H, G, nsec, scale2, phi2, a2, b2, recomputed, out);
}
