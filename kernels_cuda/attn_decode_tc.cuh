// The tensor-core main pass of the grouped decode kernels (included by attn_decode.cu after the
// block's Shape, Smem and merge helpers; head_dim 64, 128 and 256).
//
// Why: with several query heads per block the CUDA-core pass spends ~116 instructions per key
// (per head and lane: 8 FMAs for q·k, 4 shuffles to sum them, 8 FMAs for p·v; SASS of session 9)
// and ncu read it as issue-bound: GQA 32/8 reached 2.2-2.5 TB/s where the MHA kernel and SDPA
// reach ~3 TB/s, and ratios 5-8 fell to 1.3-1.8 TB/s (reports/NOTES.md, sessions 9 and 10).
// FlashDecoding++ §4 pads the small side of a flat GEMM to 8 to run it on tensor cores; here the
// small side is the group's heads:
//
// - S^T = K·Q^T with mma.sync m16n8k16: 16 keys of a warp's step on M, the block's heads on N
//   (≤ 8; zero q columns pad the rest and the masked heads of a partial chunk), 16 dims per
//   k-step. A lane (g = lane / 4, t = lane % 4) reads 16 bytes of keys g and g + 8 per 32 dims
//   (dims 32c + 8t .. + 7) and feeds them to two k-steps as they are: the k-steps then see the
//   dims in a permuted order, and q's B fragments are read with the same permutation, which a dot
//   product does not see. 2·D/32 mma per 16 keys.
// - O^T += V^T·P^T: dims on M, heads on N, keys on K. Both operands want key pairs in a register,
//   the loads give dim pairs, so the 8×8 tiles of V and P are transposed in registers
//   (movmatrix: D/4 + 2 per 16 keys). The rows of O^T come out in a permuted order of the dims
//   (tc_dim), undone when the warp writes its slot of shared memory. D/16 mma per 16 keys.
// - About 18 instructions per key instead of ~116 (session 9's SASS of the same design): the
//   pass costs the same at 2 heads as at 8, which is why the launcher gives CUDA up to 8 heads
//   per block where this pass runs (a group of 5-8 reads each K/V row once).
//
// Softmax inside a warp, for both schemes: a running max per head (m), P = 2^(s − m) ≤ 1. P enters
// the mma in 16 bits, and under the async scheme 2^(s − φ) reaches 2^b (b = 12 is 2^17.3, past
// fp16's 65504), so the async kernel too keeps the warp's running max and turns its sums into
// sums against φ once, at the end (× 2^(m − φ)). Between warps, blocks and splits nothing changes:
// async still adds without a common max and needs no combine kernel. A row whose largest score
// leaves the window is flagged as before (mx − φ > b, or < a) and recomputed by the sync pass; an
// overflowing 2^(m − φ) belongs to such a row.
//
// head_dim 256: a warp alone would hold D/2 = 128 fp32 accumulators, D/8 = 32 q registers and
// D/2 = 128 registers of K/V rows per lane, past 255 registers (the CUDA-core pass at d256 runs
// at 165 registers, 3 blocks per SM, and 0.74-0.86x SDPA: reports/NOTES.md, session 12). So two
// warps (a "team") share each 16-key step, each over 128 of the dims: a warp's loads, q
// fragments and O^T tiles are then exactly those of the d128 pass (128 registers at 4 blocks per
// SM, 8 KiB of K/V in flight per warp step, as at d128), and only S^T needs the other half: each
// warp adds its partner's partial S^T (16 keys x 8 heads, 512 bytes per warp) through shared
// memory behind one named barrier of the team's 64 threads per step. Both warps then hold the
// same S^T bit for bit (a + b == b + a in IEEE arithmetic), so they take the same running max,
// the same P and the same rescales without exchanging anything else; each accumulates its own
// half of O^T.
//
// The CPU model of one warp (src/backend/cuda/decode_tc_model.rs) runs this pass with mma and
// movmatrix in their PTX lane layouts (at d256 as a team of two with the exchange) and fails when
// the dim permutation, a transpose or the exchange is broken.

constexpr int TC_DW = D < 128 ? D : 128;  // dims one warp covers
constexpr int TC_SPLIT = D / TC_DW;       // warps per 16-key step (a team): 1, or 2 at d256
constexpr int TC_KC = TC_DW / 32;         // 32-dim chunks: one 16-byte load per key and chunk
constexpr int TC_MT = TC_DW / 16;         // 16-dim row tiles of O^T
static_assert(TC_SPLIT == 1 || TC_SPLIT == 2, "head_dim 64, 128 or 256");

// This warp's half of the dims (0 but at d256) and its team (the warp but at d256).
__device__ __forceinline__ int tc_half() { return TC_SPLIT == 1 ? 0 : (threadIdx.x / 32) % TC_SPLIT; }
__device__ __forceinline__ int tc_team() { return (threadIdx.x / 32) / TC_SPLIT; }

#if FDPP_D > 128
// The teams' partial S^T, [team][step parity][half][lane]: two teams of a 128-thread block, two
// slots so that one barrier per step suffices (a warp rewrites a slot two steps later, after the
// barrier of the step between, which its partner reaches only after reading it). 4 KiB, in the
// tensor-core entries only (the CUDA-core ones never reference it).
constexpr int TC_TEAMS_MAX = 2;
__shared__ float4 tc_xs[TC_TEAMS_MAX * 2 * 2 * 32];
#endif

// head_dim 256: add the partner warp's partial S^T (its 128 dims) to this warp's. Named barrier
// 1 + team (barrier 0 is __syncthreads), 64 threads: the team's two warps, whose trip counts are
// equal (they step over the same keys).
__device__ __forceinline__ void tc_exchange(float (&s)[4], int parity) {
#if FDPP_D > 128
    const int lane = threadIdx.x % 32, team = tc_team(), half = tc_half();
    float4* slot = tc_xs + (team * 2 + parity) * 2 * 32 + lane;
    slot[half * 32] = make_float4(s[0], s[1], s[2], s[3]);
    // Immediate barrier ids: with the id in a register ptxas reserves all 16 barriers.
    if (team == 0)
        asm volatile("bar.sync 1, 64;" ::: "memory");
    else
        asm volatile("bar.sync 2, 64;" ::: "memory");
    const float4 o = slot[(half ^ 1) * 32];
    s[0] += o.x;
    s[1] += o.y;
    s[2] += o.z;
    s[3] += o.w;
#endif
}

__device__ __forceinline__ void tc_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if FDPP_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Transpose of the 8×8 16-bit matrix whose row lane / 4, columns 2·(lane % 4) + {0, 1} this lane
// holds.
__device__ __forceinline__ u32 tc_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// The dim of row g of O^T tile j's half `hi` (rows g or g + 8): register 2·(j % 2) + hi of the
// lanes' loads of chunk j / 2, transposed, holds dims 32c + 8·(g / 2) + 2r + g % 2.
__device__ __forceinline__ int tc_dim(int j, int hi, int g) {
    return 32 * (j >> 1) + 8 * (g >> 1) + 2 * (2 * (j & 1) + hi) + (g & 1);
}

// One warp's partial state: O^T tiles (c0, c1: dim row g, heads 2t, 2t + 1; c2, c3: row g + 8),
// and per head 2t + k the running max and this lane's share of Σ 2^(s − m).
struct TcPart {
    float o[TC_MT][4];
    float m[2];
    float l[2];
};

// A warp's state before its first key: O^T zero, no max yet, empty sums.
__device__ __forceinline__ void tc_init(TcPart& p) {
#pragma unroll
    for (int j = 0; j < TC_MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) p.o[j][i] = 0.f;
    p.m[0] = p.m[1] = -FDPP_INF;
    p.l[0] = p.l[1] = 0.f;
}

// Scale head 2t's sums (O^T columns 0 and 2 of each tile, l[0]) by f0 and head 2t + 1's by f1.
__device__ __forceinline__ void tc_scale(TcPart& p, float f0, float f1) {
#pragma unroll
    for (int j = 0; j < TC_MT; ++j) {
        p.o[j][0] *= f0;
        p.o[j][1] *= f1;
        p.o[j][2] *= f0;
        p.o[j][3] *= f1;
    }
    p.l[0] *= f0;
    p.l[1] *= f1;
}

// q as the B operand of S^T = K·Q^T: lane (g, t) holds head g's dims 32c + 8t .. + 7 of each chunk
// c of the warp's dims (from TC_DW·half), raw (the scale is applied to the fp32 scores: q·scale
// rounded to 16 bits would cost accuracy); zero for columns past the live heads (masked heads of a
// partial chunk, padding to 8).
__device__ __forceinline__ void tc_load_q(uint4 (&qf)[TC_KC], const u16* __restrict__ q, int row0, int nh) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int c = 0; c < TC_KC; ++c)
        qf[c] = g < nh ? *reinterpret_cast<const uint4*>(q + (size_t)(row0 + g) * D + TC_DW * tc_half() + 32 * c +
                                                         8 * t)
                       : make_uint4(0, 0, 0, 0);
}

// The page id and slot of token tok, clamped to the last token t1 − 1 (t1 > 0): a step's keys past
// t1 read that row again instead of being zeroed (zeroing and predicating them cost 32 CS2R per
// step in the SASS); their scores are masked to −inf, so P = 0 meets a finite V row.
__device__ __forceinline__ void tc_page(int& page, int& slot, const int* __restrict__ pages, int page_size, int tok,
                                        int t1) {
    tok = min(tok, t1 - 1);
    const int idx = tok / page_size;
    slot = tok - idx * page_size;
    page = pages[idx];
}

// A 16-byte K/V load, streamed past L1, with an L2 prefetch-size hint: a miss fetches the whole
// 128-byte line. A lane quad reads 64 bytes of each line per instruction (8 tokens x 64 B, the
// next chunk's load the other half); without the hint DRAM served the halves apart. GQA 32/8 d128
// on the H100: 2.92 -> 3.00 TB/s at batch 16 · 131072, 2.77 -> 2.84 at 4 · 32768 (L2::256B the
// same; reports/NOTES.md, session 12). The CUDA-core pass reads whole lines (D/8 lanes per token
// row) and measured the same with or without a hint, so it keeps ld_stream16.
__device__ __forceinline__ uint4 tc_ld16(const u16* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// This lane's 16 bytes of each chunk of one token's K and V row.
__device__ __forceinline__ void tc_load_row(uint4 (&kr)[TC_KC], uint4 (&vr)[TC_KC], const u16* __restrict__ kb,
                                            const u16* __restrict__ vb, int page, int slot, int page_size,
                                            size_t row_elems) {
    const size_t at = ((size_t)page * page_size + slot) * row_elems;
#pragma unroll
    for (int c = 0; c < TC_KC; ++c) {
        kr[c] = tc_ld16(kb + at + 32 * c);
        vr[c] = tc_ld16(vb + at + 32 * c);
    }
}

__device__ __forceinline__ u32 tc_reg(const uint4& v, int r) { return r == 0 ? v.x : r == 1 ? v.y : r == 2 ? v.z : v.w; }

// The softmax of one 16-key step, shared by both forms of the pass: S^T (rows keys g, g + 8,
// columns heads 2t, 2t + 1; unscaled, whole dot products) scaled and masked, the running max and
// sums updated, and P^T returned as the B operand of O^T += V^T·P^T (pb0: keys 0-7, pb1: 8-15).
__device__ __forceinline__ void tc_softmax(TcPart& p, float (&s)[4], bool oka, bool okb, float scale2, u32& pb0,
                                           u32& pb1) {
    s[0] = oka ? s[0] * scale2 : -FDPP_INF;
    s[1] = oka ? s[1] * scale2 : -FDPP_INF;
    s[2] = okb ? s[2] * scale2 : -FDPP_INF;
    s[3] = okb ? s[3] * scale2 : -FDPP_INF;
    // The step's max per head over its 16 keys (the 8 lanes of a column pair share t).
    float cm[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int k = 0; k < 2; ++k) cm[k] = fmaxf(cm[k], __shfl_xor_sync(0xffffffffu, cm[k], o));
    const float nm0 = fmaxf(p.m[0], cm[0]), nm1 = fmaxf(p.m[1], cm[1]);
    if (nm0 > p.m[0] || nm1 > p.m[1]) {
        // The running max grew: rescale what was summed against the old one (rare after the
        // first steps; the branch differs between lanes only by t).
        tc_scale(p, rescale(p.m[0], nm0), rescale(p.m[1], nm1));
        p.m[0] = nm0;
        p.m[1] = nm1;
    }
    float e[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = s[i] == -FDPP_INF ? 0.f : ex2(s[i] - p.m[i & 1]);
    p.l[0] += e[0] + e[2];
    p.l[1] += e[1] + e[3];
    // P^T as the B operand: (keys 2t, 2t + 1; head g) of keys 0-7, then of keys 8-15.
    pb0 = tc_trans(pack2(e[0], e[1]));
    pb1 = tc_trans(pack2(e[2], e[3]));
}

// 16 keys of one warp step: keys g (ka, va; valid if oka) and g + 8 (kb, vb; okb) of this lane
// (their dims of the warp's half). `parity`: the step's exchange slot (d256).
__device__ __forceinline__ void tc_step(TcPart& p, const uint4 (&qf)[TC_KC], const uint4 (&ka)[TC_KC],
                                        const uint4 (&kb)[TC_KC], const uint4 (&va)[TC_KC],
                                        const uint4 (&vb)[TC_KC], bool oka, bool okb, float scale2, int parity) {
    // S^T: rows keys (g, g + 8), columns heads (2t, 2t + 1).
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < TC_KC; ++c) {
        tc_mma(s, ka[c].x, kb[c].x, ka[c].y, kb[c].y, qf[c].x, qf[c].y);
        tc_mma(s, ka[c].z, kb[c].z, ka[c].w, kb[c].w, qf[c].z, qf[c].w);
    }
    if constexpr (TC_SPLIT > 1) tc_exchange(s, parity);
    u32 pb0, pb1;
    tc_softmax(p, s, oka, okb, scale2, pb0, pb1);
    // V^T as the A operand of tile j: rows g from register 2·(j % 2), rows g + 8 from the next,
    // keys 0-7 from key row g's load, 8-15 from key row g + 8's.
#pragma unroll
    for (int j = 0; j < TC_MT; ++j) {
        const int c = j >> 1, r = 2 * (j & 1);
        tc_mma(p.o[j], tc_trans(tc_reg(va[c], r)), tc_trans(tc_reg(va[c], r + 1)), tc_trans(tc_reg(vb[c], r)),
               tc_trans(tc_reg(vb[c], r + 1)), pb0, pb1);
    }
}

// Steps of the team whose first key is b0 over keys [t0, t1). At d256 every team takes as many
// steps as team 0 (the first keys, so the most), the extra one masked: its keys lie past t1, so
// tc_page reads row t1 − 1 again and the scores are −inf. The partners' named barriers then pair
// up in every warp of the block the same number of times: with teams one exchange apart,
// compute-sanitizer's racecheck reported hazards between tc_store's writes and block_sum's reads
// across the __syncthreads between them (H200, session 14: only where the teams' counts
// differed, and no check case ever failed), and the masked step costs no time (team 0 is still
// on its last step).
template <int STEP>
__device__ __forceinline__ int tc_steps(int b0, int t0, int t1) {
    const int from = TC_SPLIT > 1 ? t0 : b0;
    return from < t1 ? (t1 - from + STEP - 1) / STEP : 0;
}

// Keys [t0, t1) into the warp's state: team w (the warp, or at d256 a pair of warps) takes keys
// t0 + 16w + 16·teams·i. AHEAD (the latency path): the page ids of the warp's next step are
// requested while this step's K/V rows are in flight, one dependent round trip per step instead
// of two; else (the bandwidth path) a page id, then K/V, per step. The trip count is uniform
// within a team (shuffles and mma need whole warps, the exchange both warps of a team); at d64
// and d128 teams may differ, at d256 they don't (tc_steps).
template <int NT, bool AHEAD>
__device__ __forceinline__ void tc_accumulate(TcPart& p, const uint4 (&qf)[TC_KC], const u16* __restrict__ kp,
                                              const u16* __restrict__ vp, const int* __restrict__ pages,
                                              int page_size, int G, int kvh, int t0, int t1, float scale2) {
    constexpr int TEAMS = NT / 32 / TC_SPLIT;
    constexpr int STEP = 16 * TEAMS;
#if FDPP_D > 128
    static_assert(TEAMS <= TC_TEAMS_MAX, "tc_xs holds two teams");
#endif
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const size_t row_elems = (size_t)G * D;
    const u16* kb = kp + (size_t)kvh * D + TC_DW * tc_half() + 8 * t;
    const u16* vb = vp + (size_t)kvh * D + TC_DW * tc_half() + 8 * t;
    const int b0 = t0 + 16 * tc_team(), n = tc_steps<STEP>(b0, t0, t1);
    int parity = 0;
    int pa = 0, sa = 0, pb = 0, sb = 0;
    if (AHEAD && n > 0) {
        tc_page(pa, sa, pages, page_size, b0 + g, t1);
        tc_page(pb, sb, pages, page_size, b0 + g + 8, t1);
    }
    for (int i = 0; i < n; ++i) {
        const int base = b0 + i * STEP;
        const bool oka = base + g < t1, okb = base + g + 8 < t1;
        if (!AHEAD) {
            tc_page(pa, sa, pages, page_size, base + g, t1);
            tc_page(pb, sb, pages, page_size, base + g + 8, t1);
        }
        uint4 ka[TC_KC], va[TC_KC], kb2[TC_KC], vb2[TC_KC];
        tc_load_row(ka, va, kb, vb, pa, sa, page_size, row_elems);
        tc_load_row(kb2, vb2, kb, vb, pb, sb, page_size, row_elems);
        if (AHEAD && i + 1 < n) {
            tc_page(pa, sa, pages, page_size, base + STEP + g, t1);
            tc_page(pb, sb, pages, page_size, base + STEP + g + 8, t1);
        }
        tc_step(p, qf, ka, kb2, va, vb2, oka, okb, scale2, parity);
        parity ^= 1;
    }
}

// The warp's state into its slot of shared memory, in block_merge's form: per head, the sums
// against the warp's max (sync) or against φ (async: × 2^(m − φ), once), the largest score and
// the over flag; O^T's rows back in dim order. At d256 each warp of a team fills its half of the
// dims and zeros the other, and only half 0 gives l (both warps hold the same l, m and flags):
// block_sum and block_head then merge the slots unchanged. NATURAL: O^T's rows are in dim order
// (the staged pass: V^T from ldmatrix.trans), else permuted as tc_dim says.
template <bool ASYNC, int NW, bool NATURAL = false>
__device__ __forceinline__ void tc_store(Smem<NW>& sm, TcPart& p, float phi2, float b2) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3, warp = threadIdx.x / 32;
    const int half = tc_half(), d0 = TC_DW * half;
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int k = 0; k < 2; ++k) p.l[k] += __shfl_xor_sync(0xffffffffu, p.l[k], o);
    if constexpr (TC_SPLIT > 1) {
        const int other = TC_DW * (half ^ 1);
#pragma unroll
        for (int h = 0; h < HG; ++h)
#pragma unroll
            for (int i = 0; i < TC_DW / 32; ++i) sm.acc[warp][h][other + 32 * i + lane] = 0.f;
    }
    const float mx[2] = {p.m[0], p.m[1]};
    if (ASYNC) {
        // A warp that saw no key has m = −inf and zero sums: factor 0, not exp2(−inf − φ)·0 = NaN
        // if φ were infinite. Past 2^b the row is flagged (mx − φ > b) and recomputed.
        tc_scale(p, rescale(p.m[0], phi2), rescale(p.m[1], phi2));
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int h = 2 * t + k;
        if (h < HG) {
#pragma unroll
            for (int j = 0; j < TC_MT; ++j) {
                sm.acc[warp][h][d0 + (NATURAL ? 16 * j + g : tc_dim(j, 0, g))] = p.o[j][k];
                sm.acc[warp][h][d0 + (NATURAL ? 16 * j + 8 + g : tc_dim(j, 1, g))] = p.o[j][2 + k];
            }
            if (g == 0) {
                sm.m[warp][h] = ASYNC ? phi2 : p.m[k];
                sm.l[warp][h] = half == 0 ? p.l[k] : 0.f;
                sm.mx[warp][h] = mx[k];
                sm.over[warp][h] = ASYNC && mx[k] - phi2 > b2;
            }
        }
    }
}

// block_pass's tensor-core form.
template <bool ASYNC, int NT, int U, bool AHEAD>
__device__ __forceinline__ void tc_block_pass(Smem<Shape<NT, U>::NW>& sm, float (&a)[Shape<NT, U>::EPT],
                                              const u16* __restrict__ q, int row0, int nh, float scale2,
                                              const u16* __restrict__ kp, const u16* __restrict__ vp,
                                              const int* __restrict__ pages, int page_size, int G, int kvh, int t0,
                                              int t1, float phi2, float b2) {
    static_assert(TC_DW <= 128, "a warp holds TC_DW/2 accumulator floats per lane");
    uint4 qf[TC_KC];
    tc_load_q(qf, q, row0, nh);
    TcPart p;
    tc_init(p);
    tc_accumulate<NT, AHEAD>(p, qf, kp, vp, pages, page_size, G, kvh, t0, t1, scale2);
    tc_store<ASYNC>(sm, p, phi2, b2);
    block_sum<ASYNC, NT, U>(sm, a);
}

// ---- The staged form (switch FDPP_DECODE_TC_STAGES=2|3, bandwidth path only; default off) ----
//
// Why: in the pass above a warp's K/V bytes in flight live in its registers: a 16-key step (8 KiB
// per warp at d128) is requested, waited for, then computed, and the next step is requested only
// after that. At 128 registers and 4 blocks per SM the kernel streams at 96-97 % of the card's
// measured read ceiling where SDPA reaches ~100 % (reports/NOTES.md, session 12: 2.87 TB/s at
// batch 1 · 131072 against a target of 2.9). Here each warp copies its steps into its own ring of
// ST shared-memory stages with cp.async, ST − 1 steps ahead, so that loads stay in flight while a
// step is computed and registers no longer bound them; the fragments come from shared memory by
// ldmatrix (K as the A operand of S^T), ldmatrix.trans (V^T, which also drops the pass's D/4
// movmatrix per step). Only P keeps its two movmatrix.
//
// - Copies: lane (g, t) copies its keys g and g + 8 (page ids looked up one step before they are
//   needed), chunks t, t + 4, ... of 16 bytes of the warp's dims of K and V, with the same
//   L2::128B prefetch hint as the loads above (a lane quad covers 64 bytes of a line per
//   instruction). Keys past the end copy the last row again; their scores are masked.
// - A stage is K then V, [16 keys][TC_DW dims] each; 16-byte chunk c of key k sits at chunk
//   c ^ (k & 7) of its row, so the 8 rows an ldmatrix phase reads at one chunk fall in 8 distinct
//   bank groups (the rows are 128 or 256 bytes: unswizzled, all 8 would share one).
// - Ordering is per warp: cp.async.wait_group then __syncwarp before a stage is read (the other
//   lanes' copies), __syncwarp before a stage is refilled (the other lanes' ldmatrix reads).
//   Nothing is shared between warps but the d256 exchange, as above.
// - q's B fragments are in natural dim order (ldmatrix keeps it), and so are O^T's rows.
//
// Shared memory: NW · ST stages of 2 · 16 · TC_DW · 2 bytes, dynamic (d128 at ST = 3: 96 KiB, two
// blocks per SM beside the merge area; the launcher asks the driver's occupancy for it).
constexpr int TCS_ROW = TC_DW * 2;          // bytes of one key's row of the warp's dims
constexpr int TCS_CPR = TCS_ROW / 16;       // 16-byte chunks per row (8 or 16)
constexpr int TCS_TILE = 16 * TCS_ROW;      // K (or V) of one 16-key step
constexpr int TCS_STAGE = 2 * TCS_TILE;     // K, then V
static_assert(TCS_CPR % 8 == 0, "the swizzle permutes chunks within groups of 8");

// Byte offset of 16-byte chunk c of key k in a tile (the swizzle above).
__device__ __forceinline__ u32 tcs_off(int k, int c) { return k * TCS_ROW + ((c ^ (k & 7)) << 4); }

__device__ __forceinline__ void tcs_cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// ldmatrix.x4 (TRANS: .trans): lane l gives the address of row l % 8 of matrix l / 8; register i
// receives matrix i in the mma fragment layout (row g, columns 2t, 2t + 1; transposed: column g,
// rows 2t, 2t + 1).
template <bool TRANS>
__device__ __forceinline__ void tcs_ldm4(u32 (&r)[4], u32 addr) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr)
                     : "memory");
}

// q as the B operand in natural dim order: for k-step ks (dims 16ks ..), lane (g, t) holds head
// g's dims 16ks + 2t, + 1 (b0) and 16ks + 8 + 2t, + 1 (b1) of the warp's dims; zero past the live
// heads.
__device__ __forceinline__ void tcs_load_q(u32 (&qn)[TC_DW / 16][2], const u16* __restrict__ q, int row0, int nh) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const u32* qr = reinterpret_cast<const u32*>(q + (size_t)(row0 + g) * D + TC_DW * tc_half());
#pragma unroll
    for (int ks = 0; ks < TC_DW / 16; ++ks) {
        qn[ks][0] = g < nh ? qr[8 * ks + t] : 0u;
        qn[ks][1] = g < nh ? qr[8 * ks + 4 + t] : 0u;
    }
}

// Copy one step (keys g, g + 8 of this lane at (page, slot) pa/sa and pb/sb) into stage `st`.
__device__ __forceinline__ void tcs_issue(u32 st, const u16* __restrict__ kb, const u16* __restrict__ vb, int pa,
                                          int sa, int pb, int sb, int page_size, size_t row_elems) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const size_t at_a = ((size_t)pa * page_size + sa) * row_elems, at_b = ((size_t)pb * page_size + sb) * row_elems;
#pragma unroll
    for (int i = 0; i < TCS_CPR / 4; ++i) {
        const int c = t + 4 * i;
        tcs_cp16(st + tcs_off(g, c), kb + at_a + 8 * c);
        tcs_cp16(st + tcs_off(g + 8, c), kb + at_b + 8 * c);
        tcs_cp16(st + TCS_TILE + tcs_off(g, c), vb + at_a + 8 * c);
        tcs_cp16(st + TCS_TILE + tcs_off(g + 8, c), vb + at_b + 8 * c);
    }
}

// One 16-key step from stage `st`.
__device__ __forceinline__ void tcs_step(TcPart& p, const u32 (&qn)[TC_DW / 16][2], u32 st, bool oka, bool okb,
                                         float scale2, int parity) {
    const int lane = threadIdx.x % 32, mat = lane >> 3, r = lane & 7;
    // S^T = K·Q^T: matrix 0 keys 0-7 / dims 16ks .. + 7, 1 keys 8-15 / same dims, 2 and 3 the
    // next 8 dims: a0-a3 of the A fragment.
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < TC_DW / 16; ++ks) {
        u32 a[4];
        tcs_ldm4<false>(a, st + tcs_off(r + 8 * (mat & 1), 2 * ks + (mat >> 1)));
        tc_mma(s, a[0], a[1], a[2], a[3], qn[ks][0], qn[ks][1]);
    }
    if constexpr (TC_SPLIT > 1) tc_exchange(s, parity);
    u32 pb0, pb1;
    tc_softmax(p, s, oka, okb, scale2, pb0, pb1);
    // O^T += V^T·P^T: V^T tile j (dims 16j .. + 15) by ldmatrix.trans of the stored [key][dim]
    // tiles: a0 keys 0-7 / dims 16j .. + 7, a1 keys 0-7 / the next 8 dims, a2 and a3 keys 8-15.
#pragma unroll
    for (int j = 0; j < TC_MT; ++j) {
        u32 a[4];
        tcs_ldm4<true>(a, st + TCS_TILE + tcs_off(r + 8 * (mat >> 1), 2 * j + (mat & 1)));
        tc_mma(p.o[j], a[0], a[1], a[2], a[3], pb0, pb1);
    }
}

// tc_accumulate's bandwidth loop, staged: the team's steps i = 0 .. n − 1 (keys t0 + 16·team +
// 16·teams·i), step i + ST − 1 copied while step i is computed. One commit per iteration (empty
// past the last step), so wait_group ST − 1 always means "step i has landed".
template <int NT, int ST>
__device__ __forceinline__ void tcs_accumulate(TcPart& p, const u32 (&qn)[TC_DW / 16][2], const u16* __restrict__ kp,
                                               const u16* __restrict__ vp, const int* __restrict__ pages,
                                               int page_size, int G, int kvh, int t0, int t1, float scale2) {
    // 16-byte alignment is all ldmatrix and cp.async need; the swizzle's bank groups are
    // relative, so any base works (128 would round every entry's static shared memory up).
    extern __shared__ __align__(16) unsigned char tcs_ring[];
    constexpr int TEAMS = NT / 32 / TC_SPLIT;
    constexpr int STEP = 16 * TEAMS;
    static_assert(ST >= 2, "a stage computed, at least one in flight");
    const int lane = threadIdx.x % 32, g = lane >> 2, warp = threadIdx.x / 32;
    const u32 ring = smem_addr(tcs_ring) + warp * ST * TCS_STAGE;
    const size_t row_elems = (size_t)G * D;
    const u16* kb = kp + (size_t)kvh * D + TC_DW * tc_half();
    const u16* vb = vp + (size_t)kvh * D + TC_DW * tc_half();
    const int b0 = t0 + 16 * tc_team(), n = tc_steps<STEP>(b0, t0, t1);
    // Page and slot of keys g, g + 8 of the next step to copy, looked up a step early.
    int pa = 0, sa = 0, pb = 0, sb = 0;
    if (n > 0) {
        tc_page(pa, sa, pages, page_size, b0 + g, t1);
        tc_page(pb, sb, pages, page_size, b0 + g + 8, t1);
    }
#pragma unroll
    for (int j = 0; j < ST - 1; ++j) {
        if (j < n) {
            tcs_issue(ring + j * TCS_STAGE, kb, vb, pa, sa, pb, sb, page_size, row_elems);
            if (j + 1 < n) {
                tc_page(pa, sa, pages, page_size, b0 + (j + 1) * STEP + g, t1);
                tc_page(pb, sb, pages, page_size, b0 + (j + 1) * STEP + g + 8, t1);
            }
        }
        cp_async_commit();
    }
    int parity = 0, fill = ST - 1, use = 0;  // stage indices of step i + ST − 1 and step i
    for (int i = 0; i < n; ++i) {
        const int j = i + ST - 1;
        __syncwarp();  // every lane's ldmatrix of stage `fill` (step i − 1) is done
        if (j < n) {
            tcs_issue(ring + fill * TCS_STAGE, kb, vb, pa, sa, pb, sb, page_size, row_elems);
            if (j + 1 < n) {
                tc_page(pa, sa, pages, page_size, b0 + (j + 1) * STEP + g, t1);
                tc_page(pb, sb, pages, page_size, b0 + (j + 1) * STEP + g + 8, t1);
            }
        }
        cp_async_commit();
        cp_async_wait<ST - 1>();
        __syncwarp();  // every lane's copies of step i are visible to the warp
        const int base = b0 + i * STEP;
        tcs_step(p, qn, ring + use * TCS_STAGE, base + g < t1, base + g + 8 < t1, scale2, parity);
        parity ^= 1;
        fill = fill + 1 == ST ? 0 : fill + 1;
        use = use + 1 == ST ? 0 : use + 1;
    }
    cp_async_wait<0>();
}

// tc_block_pass, staged (ST stages; the bandwidth path's loop).
template <bool ASYNC, int NT, int U, int ST>
__device__ __forceinline__ void tcs_block_pass(Smem<Shape<NT, U>::NW>& sm, float (&a)[Shape<NT, U>::EPT],
                                               const u16* __restrict__ q, int row0, int nh, float scale2,
                                               const u16* __restrict__ kp, const u16* __restrict__ vp,
                                               const int* __restrict__ pages, int page_size, int G, int kvh, int t0,
                                               int t1, float phi2, float b2) {
    u32 qn[TC_DW / 16][2];
    tcs_load_q(qn, q, row0, nh);
    TcPart p;
    tc_init(p);
    tcs_accumulate<NT, ST>(p, qn, kp, vp, pages, page_size, G, kvh, t0, t1, scale2);
    tc_store<ASYNC, Shape<NT, U>::NW, true>(sm, p, phi2, b2);
    block_sum<ASYNC, NT, U>(sm, a);
}
