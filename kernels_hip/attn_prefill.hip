// Causal prefill attention over the paged KV cache for AMD CDNA (HIP), in the FlashAttention-2
// shape on matrix cores: a port of kernels_cuda/attn_prefill.cu with the same entry points and
// arguments (the host passes one (sequence, first row, first position, rows) int4 per query
// tile, longest key range first). The new tokens' K and V are already in the cache.
//
// Two softmax schemes (FlashDecoding++ §3): `sync` keeps a running row max and rescales O and l
// when it grows (FlashAttention-2); `async` takes every term against the unified φ, so no row
// max and no rescale of O. A row whose scores leave [φ + a, φ + b] (or whose sums are not
// finite) is flagged; if any row of the block is flagged, the block walks the keys again with
// the sync scheme and rewrites the flagged rows, counting them.
//
// What differs from CUDA and why:
// - MFMA v_mfma_f32_16x16x16{f16,bf16_1k} instead of mma.sync + ldmatrix, computed transposed:
//   Sᵀ = K·Qᵀ and Oᵀ += Vᵀ·Pᵀ. In MFMA's lane layout (A: lane l gives row l%16, K elements
//   4·(l/16)..+3; B: column l%16, same K elements; D: lane l holds rows 4·(l/16)..+3 of column
//   l%16) the D fragment of Sᵀ for 16 keys is exactly the B fragment Pᵀ needs for those 16 keys,
//   so P never leaves registers (no LDS round trip, no ldmatrix-style shuffle). Each lane owns
//   one query row (l%16) and 4 keys of every 16; the four lanes l, l^16, l^32, l^48 share a row,
//   so row reductions are two __shfl_xor steps (16, 32) on a 64-lane wavefront.
// - One block = 4 wavefronts × 16 query rows = 64 rows (BM; PREFILL_BM in attention.rs).
// - No cp.async on AMD and no double buffering: each K/V tile is loaded with plain 16-byte
//   loads into LDS, then the block synchronises (FlashDecoding++ notes double buffering does
//   not pay on AMD's small L1). LDS rows are padded by 16 bytes against bank conflicts.
// - Q fragments live in registers for every head_dim (CDNA has 512 VGPRs per lane).
// - P is rounded to 16 bits for the MFMA, as on CUDA: under `async` a term above the 16-bit
//   range becomes inf, the row's sums are not finite, and the row is recomputed.
// MFMA needs wave64 and CDNA2/3; other targets fail to compile on purpose (no WMMA path), and the
// host declines prefill there.
#include "common.h"

#if defined(__HIP_DEVICE_COMPILE__) && !(defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#error "fdpp attn_prefill needs CDNA2/CDNA3 MFMA (gfx90a, gfx94x); no WMMA path for RDNA yet"
#endif

#ifndef FDPP_D
#define FDPP_D 128
#endif

constexpr int D = FDPP_D;
constexpr int WAVE = 64;             // the MFMA lane layout below assumes wave64
constexpr int WAVES = 4;
constexpr int THREADS = WAVES * WAVE;
constexpr int BM = 16 * WAVES;       // query rows per block
constexpr int BN = D == 256 ? 32 : 64;  // keys per LDS tile
constexpr int CH = D / 8;            // 16-byte chunks per row
constexpr int KSTR = D + 8;          // LDS row stride in elements (16 bytes of padding)
constexpr int JT = BN / 16;          // 16-key tiles per K/V tile
constexpr int KS = D / 16;           // 16-wide steps of Q·Kᵀ over head_dim
constexpr int DT = D / 16;           // 16-dim tiles of O

static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");

#define FDPP_INF __builtin_inff()

typedef _Float16 half4_t __attribute__((ext_vector_type(4)));
typedef short short4_t __attribute__((ext_vector_type(4)));
typedef float float4_t __attribute__((ext_vector_type(4)));
typedef u32 u32x2 __attribute__((ext_vector_type(2)));

__device__ __forceinline__ bool finite(float x) { return fabsf(x) < FDPP_INF; }

// D += A·B for one 16x16x16 step; a and b each carry 4 K elements of this lane's row/column.
__device__ __forceinline__ float4_t mfma16(u32x2 a, u32x2 b, float4_t c) {
#if FDPP_BF16
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(short4_t, a), __builtin_bit_cast(short4_t, b),
                                                     c, 0, 0, 0);
#else
    return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(half4_t, a), __builtin_bit_cast(half4_t, b), c, 0,
                                                 0, 0);
#endif
}

__device__ __forceinline__ u32 pack2(float lo, float hi) { return (u32)from_f32(lo) | ((u32)from_f32(hi) << 16); }

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
    u16* sk;  // [BN][KSTR]
    u16* sv;  // [BN][KSTR]
};

// Stage key tile n (keys n·BN .. +BN) of K and V in LDS; keys at or past kv_end are zero-filled.
__device__ __forceinline__ void load_kv(const Ctx& c, int n) {
    for (int i = threadIdx.x; i < BN * CH; i += THREADS) {
        const int r = i / CH, ch = i % CH;
        const int key = n * BN + r;
        u32x4 kv = u32x4{0, 0, 0, 0}, vv = u32x4{0, 0, 0, 0};
        if (key < c.kv_end) {
            const int page = c.pages[key / c.page_size];
            const size_t at = ((size_t)page * c.page_size + key % c.page_size) * c.G * D + (size_t)c.kvh * D + ch * 8;
            kv = ld16(c.kp + at);
            vv = ld16(c.vp + at);
        }
        *reinterpret_cast<u32x4*>(c.sk + r * KSTR + ch * 8) = kv;
        *reinterpret_cast<u32x4*>(c.sv + r * KSTR + ch * 8) = vv;
    }
}

// Row state of the one query row a lane holds (shared with lanes l^16, l^32, l^48).
struct Rows {
    float4_t o[DT];  // O[row][16·dt + 4·(l/16) + e]
    float m, l, mx;
    bool over;
};

// Walk every key tile for this block's rows with one scheme; O, l and the flags end in `st`.
template <bool ASYNC>
__device__ void walk(const Ctx& c, Rows& st, const u32x2 (&qb)[KS], float scale2, float phi2, float b2) {
    const int lane = threadIdx.x % WAVE, wave = threadIdx.x / WAVE;
    const int r16 = lane % 16, quad = lane / 16;
    st.m = ASYNC ? phi2 : -FDPP_INF;
    st.l = 0.f;
    st.mx = -FDPP_INF;
    st.over = false;
#pragma unroll
    for (int j = 0; j < DT; ++j) st.o[j] = float4_t{0.f, 0.f, 0.f, 0.f};
    const int qpos = c.t.pos0 + wave * 16 + r16;
    const int ntiles = (c.kv_end + BN - 1) / BN;
    for (int n = 0; n < ntiles; ++n) {
        __syncthreads();  // the previous tile's readers are done with the LDS
        load_kv(c, n);
        __syncthreads();
        // Sᵀ = K · Qᵀ for BN keys and this wavefront's 16 rows: s[j][e] is the score of this
        // lane's row against key n·BN + 16·j + 4·quad + e.
        float4_t s[JT];
#pragma unroll
        for (int j = 0; j < JT; ++j) {
            s[j] = float4_t{0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const u32x2 a = *reinterpret_cast<const u32x2*>(c.sk + (16 * j + r16) * KSTR + 16 * ks + 4 * quad);
                s[j] = mfma16(a, qb[ks], s[j]);
            }
        }
        // Scale to log2 units and mask keys past the row's position (causal; keys past the end
        // of the sequence are past every valid row's position too).
        float tm = -FDPP_INF;
#pragma unroll
        for (int j = 0; j < JT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n * BN + 16 * j + 4 * quad + e;
                const float x = key > qpos ? -FDPP_INF : s[j][e] * scale2;
                s[j][e] = x;
                tm = fmaxf(tm, x);
            }
        tm = fmaxf(tm, __shfl_xor(tm, 16, WAVE));
        tm = fmaxf(tm, __shfl_xor(tm, 32, WAVE));
        float corr = 1.f;
        if (ASYNC) {
            st.mx = fmaxf(st.mx, tm);
            st.over |= tm - phi2 > b2;
        } else {
            const float mn = fmaxf(st.m, tm);
            // A row with every key so far masked keeps m = −inf; nothing to rescale.
            corr = mn == -FDPP_INF ? 1.f : exp2f(st.m - mn);
            st.m = mn;
        }
        // P = 2^(S − m); its Sᵀ layout is the B operand of Oᵀ += Vᵀ · Pᵀ as it stands.
        u32x2 pb[JT];
        float ls = 0.f;
#pragma unroll
        for (int j = 0; j < JT; ++j) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[e] = s[j][e] == -FDPP_INF ? 0.f : exp2f(s[j][e] - st.m);
                ls += p[e];
            }
            pb[j] = u32x2{pack2(p[0], p[1]), pack2(p[2], p[3])};
        }
        st.l = st.l * corr + ls;
        if (!ASYNC) {
#pragma unroll
            for (int d = 0; d < DT; ++d) st.o[d] *= corr;
        }
        // Oᵀ += Vᵀ · Pᵀ: the A operand is V[key 16·j + 4·quad + i][16·dt + r16], i = 0..3.
#pragma unroll
        for (int j = 0; j < JT; ++j) {
            const u16* vrow = c.sv + (16 * j + 4 * quad) * KSTR + r16;
#pragma unroll
            for (int d = 0; d < DT; ++d) {
                const u32x2 a = u32x2{(u32)vrow[16 * d] | ((u32)vrow[KSTR + 16 * d] << 16),
                                      (u32)vrow[2 * KSTR + 16 * d] | ((u32)vrow[3 * KSTR + 16 * d] << 16)};
                st.o[d] = mfma16(a, pb[j], st.o[d]);
            }
        }
    }
    // Row sums over the four lanes that hold each row.
    st.l += __shfl_xor(st.l, 16, WAVE);
    st.l += __shfl_xor(st.l, 32, WAVE);
}

// Write this lane's 4·DT elements of its row when `write` (and the row is inside the tile).
__device__ __forceinline__ void store(const Ctx& c, const Rows& st, u16* __restrict__ out, bool write) {
    const int lane = threadIdx.x % WAVE, wave = threadIdx.x / WAVE;
    const int row = wave * 16 + lane % 16;
    if (!write || row >= c.t.rows) return;
    const float inv = 1.f / st.l;
    u16* o = out + ((size_t)(c.t.row0 + row) * c.H + c.h) * D + 4 * (lane / 16);
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        const float4_t v = st.o[d] * inv;
        *reinterpret_cast<u32x2*>(o + 16 * d) = u32x2{pack2(v[0], v[1]), pack2(v[2], v[3])};
    }
}

template <bool ASYNC>
__device__ void prefill(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                        const int* __restrict__ table, const int* __restrict__ tiles, int max_pages, int page_size,
                        int H, int G, float scale2, float phi2, float a2, float b2, u32* __restrict__ recomputed,
                        u16* __restrict__ out) {
    __shared__ __attribute__((aligned(16))) u16 sk[BN * KSTR];
    __shared__ __attribute__((aligned(16))) u16 sv[BN * KSTR];
    const int* tv = tiles + 4 * blockIdx.x;
    Ctx c;
    c.t = Tile{tv[0], tv[1], tv[2], tv[3]};
    c.q = q;
    c.kp = kp;
    c.vp = vp;
    c.pages = table + (size_t)c.t.b * max_pages;
    c.page_size = page_size;
    c.H = H;
    c.G = G;
    c.h = blockIdx.y;
    c.kvh = c.h / (H / G);
    c.kv_end = c.t.pos0 + c.t.rows;
    c.sk = sk;
    c.sv = sv;

    const int lane = threadIdx.x % WAVE, wave = threadIdx.x / WAVE;
    const int row = wave * 16 + lane % 16;
    const bool row_ok = row < c.t.rows;
    // The B operand of Sᵀ = K·Qᵀ: Q[row][16·ks + 4·(l/16) .. +3], zero for rows past the tile.
    u32x2 qb[KS];
    const u16* qrow = q + ((size_t)(c.t.row0 + row) * H + c.h) * D + 4 * (lane / 16);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) qb[ks] = row_ok ? *reinterpret_cast<const u32x2*>(qrow + 16 * ks) : u32x2{0, 0};

    Rows st;
    walk<ASYNC>(c, st, qb, scale2, phi2, b2);
    if (!ASYNC) {
        store(c, st, out, true);
        return;
    }
    bool fin = st.l > 0.f && finite(st.l);
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) fin = fin && finite(st.o[d][e]);
    // The four lanes of a row hold different dims: any lane's view flags it (64-bit ballot).
    const unsigned long long vote = __ballot(st.over || st.mx - phi2 < a2 || !fin);
    const int r16 = lane % 16;
    const bool bad = row_ok && (((vote >> r16) | (vote >> (r16 + 16)) | (vote >> (r16 + 32)) | (vote >> (r16 + 48))) & 1ull);
    store(c, st, out, !bad);
    if (__syncthreads_or(bad)) {
        walk<false>(c, st, qb, scale2, 0.f, 0.f);
        store(c, st, out, bad);
        // One lane per row (the first 16) counts; lane 0 adds the wavefront's total.
        const unsigned long long rows_bad = __ballot(bad && lane < 16);
        if (lane == 0 && rows_bad) atomicAdd(recomputed, (u32)__popcll(rows_bad));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
attn_prefill_sync(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                  const int* __restrict__ table, const int* __restrict__ tiles, int max_pages, int page_size, int H,
                  int G, float scale2, u16* __restrict__ out) {
    prefill<false>(q, kp, vp, table, tiles, max_pages, page_size, H, G, scale2, 0.f, 0.f, 0.f, nullptr, out);
}

extern "C" __global__ void __launch_bounds__(THREADS)
attn_prefill_async(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                   const int* __restrict__ table, const int* __restrict__ tiles, int max_pages, int page_size, int H,
                   int G, float scale2, float phi2, float a2, float b2, u32* __restrict__ recomputed,
                   u16* __restrict__ out) {
    prefill<true>(q, kp, vp, table, tiles, max_pages, page_size, H, G, scale2, phi2, a2, b2, recomputed, out);
}
