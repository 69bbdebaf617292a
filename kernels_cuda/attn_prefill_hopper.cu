// Causal prefill attention for Hopper (sm_90a), in the FlashAttention-3 shape (Shah et al.,
// 2024, §3.1): warp specialisation and wgmma. The semantics of attn_prefill.cu (causal mask,
// GQA, K/V read from the paged cache after the host appended the new tokens, sync and async
// softmax with the recompute rule) and its block order; the schedule and the instructions
// differ, and the host lists each block's tile, head and first key tile's slot (attn_plan.rs
// `prefill_blocks`) where attn_prefill.cu derives them from the block index.
//
// A block owns BM = 128 query rows of one head and has three warpgroups:
// - warpgroup 0, the producer, gives most of its registers back (setmaxnreg) and fills a ring of
//   STAGES stages, each a tile of BN = 128 keys of K and of V. A tile whose keys all lie before
//   kv_end comes by TMA: one tensor map over the whole pool ([slots][kv heads][D], the host's
//   tma.rs), one box per page (every 64-column block of it), landing in the layout below (the
//   map's 128-byte swizzle is the descriptors'), the bytes counted on the stage's "K full" /
//   "V full" mbarrier. The last tile of a sequence (keys past kv_end must read as zeros: a stale
//   V row times P = 0 can be NaN) and page sizes TMA cannot box come by 16-byte cp.async gathered
//   row by row, each thread's copies arriving on the same mbarriers when they land
//   (cp.async.mbarrier.arrive.noinc). Either way the producer never blocks on its own loads, and
//   S = Q·Kᵀ starts before V is in.
// - warpgroups 1 and 2, the consumers, own 64 query rows each (FA3's consumer shape) and take
//   the registers the producer gave back. Per key tile: S = Q·Kᵀ with wgmma m64n128k16, both
//   operands from shared memory (Q [rows, D] and K [keys, D] are both K-major), the softmax on
//   the fp32 accumulators, then O += P·V with P from registers (the accumulator layout of S is
//   the A-operand layout of the next wgmma for 16-bit types: FA3 §3.3, no shuffles) and V from
//   shared memory through the transpose bit (V [keys, D] is N-major for B). A consumer releases
//   K of a stage on its "K empty" mbarrier once S = Q·Kᵀ is done and V on "V empty" once P·V is
//   (FA3's separate K and V pipelines): under the overlapped schedule K is free a whole tile
//   before V, and the producer refills it then. The two consumers run out of step, so one's
//   softmax overlaps the other's tensor-core work (the effect FA3's ping-pong schedule enforces).
//
// Shared tiles use the 128-byte swizzle of the wgmma descriptors: atoms of 8 rows × 128 bytes
// (64 columns), 1024-byte aligned, the 16-byte chunk c of row r at chunk c ^ (r % 8). Q [BM, D]
// is stored as D/64 column blocks [BM][64] (swz()). K and V [BN, D] interleave the atoms: row r,
// column block cb at (r / 8)·KV_ATOMS + cb·1024 (kv_at()), so that the 16 rows of one page and
// both column blocks are one contiguous 4 KiB, one TMA box of the pool's 5-D map (tma.rs). With
// D/64 column blocks [BN][64] a page of 16 took one box per block, 32 a tile of K at d128, and
// the box count, not where the pages lie, cost pages of 16 14-20 % against pages of 128
// (reports/NOTES.md, session 37); 16 boxes gained 6-13 % with scattered pages (session 38).
//
// Softmax (FlashDecoding++ §3), as attn_prefill.cu: `sync` keeps a running row max and rescales
// O and l when it grows; `async` takes every term against the unified φ, no row max, no rescale.
// A row whose scores leave [φ + a, φ + b] (or whose sum is not finite) is flagged; if any row of
// the block is flagged, the whole block (producer included) walks the keys again with the sync
// scheme and rewrites the flagged rows, counting them.
#include "common.cuh"
#include "attn_common.cuh"

#ifndef FDPP_D
#define FDPP_D 128
#endif
#ifndef FDPP_STAGES
#define FDPP_STAGES 2
#endif
// 1: overlap the softmax of a tile with P·V of the previous one inside a warpgroup.
#ifndef FDPP_OVERLAP
#define FDPP_OVERLAP 0
#endif
// 1: FA3 §3.1's ping-pong: the two consumer warpgroups take turns issuing their GEMMs (named
// barriers), so that one's softmax runs under the other's tensor-core work. Needs FDPP_OVERLAP.
#ifndef FDPP_PINGPONG
#define FDPP_PINGPONG 0
#endif
// 1: a whole key tile of consecutive pages comes as one TMA box (load_tma). Only in
// the schedule the host picks where such tiles dominate: elsewhere the per-tile test cost 5 %.
#ifndef FDPP_RUN_BOXES
#define FDPP_RUN_BOXES 0
#endif
// 1: a persistent kernel (FA3 §3.1's persistent tile scheduler; async redoes a flagged block
// after the next one, see `prefill`): one block
// per SM takes the host's list entries from a counter, and the producer loads the next entry's Q
// and first K/V tiles while the consumers finish the current one (the start of a short block,
// ~20 % of an 8 · 1024 block's time, was the wait for exactly those; reports/NOTES.md, sessions
// 21-22). Q is double-buffered where shared memory allows (QBUF).
#ifndef FDPP_PERSIST
#define FDPP_PERSIST 0
#endif
#if FDPP_PINGPONG && !FDPP_OVERLAP
#error "FDPP_PINGPONG needs FDPP_OVERLAP"
#endif
// Measurement only, never a default (results are garbage): 1 = the producer copies nothing
// (the ceiling without K/V loads), 2 = no exponentials in the softmax (P = S, the ceiling of the
// GEMMs and the pipeline). Sync timings only: async would recompute the garbage rows.
// 3 = a timeline (results correct): each consumer warpgroup's first thread writes one record of
// eleven words per block into fdpp_trace (the host reads it after the launch, prefill_hopper.rs):
// block, SM and warpgroup; its key tiles, head and first position; the global timer at entry;
// the SM clock, from entry, when Q was in, when the first K tile was requested (by thread 0 at
// entry, or by the producer), when that tile was in, when the walk ended, when O was stored, when
// the producer began its walk (the first tile's page ids in hand), when this thread had the
// block's entry in the host's list, and when it asked for that entry. (Not printf: a call in the kernel makes ptxas
// serialise every wgmma.)
#ifndef FDPP_DIAG
#define FDPP_DIAG 0
#endif
#if FDPP_DIAG == 3
#define TRACE(x) x
constexpr int TRACE_CAP = 32768;  // records (two per block)
constexpr int TRACE_WORDS = 11;
__device__ unsigned long long fdpp_trace[TRACE_CAP * TRACE_WORDS];
#else
#define TRACE(x)
#endif

#include "hopper.cuh"

constexpr int D = FDPP_D;
constexpr int STAGES = FDPP_STAGES;
constexpr int WG_ROWS = 64;               // query rows per consumer warpgroup (wgmma's M)
constexpr int CONSUMERS = 2;
constexpr int BM = WG_ROWS * CONSUMERS;   // query rows per block (sources.rs: PREFILL_BM)
constexpr int BN = 128;                   // keys per tile (the N of S = Q·Kᵀ)
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int CH = D / 8;                 // 16-byte chunks per row
constexpr int NT = BN / 8;                // n8 column groups of S a thread holds
constexpr int DT = D / 8;                 // n8 column groups of O
constexpr int KS = D / 16;                // k16 steps of Q·Kᵀ
constexpr int PS = BN / 16;               // k16 steps of P·V
constexpr u32 Q_BYTES = BM * D * 2;
constexpr u32 KV_BYTES = BN * D * 2;      // K (or V) of one stage
constexpr u32 KV_ATOMS = D / 64 * 1024;   // bytes from one 8-row group of K or V to the next
// The byte of (row r, 16-byte chunk ch) in a K or V stage buffer (the layout above).
__device__ __forceinline__ u32 kv_at(int r, int ch) {
    return (u32)(r >> 3) * KV_ATOMS + (u32)(ch >> 3) * 1024u + (u32)(r & 7) * 128u + ((u32)((ch & 7) ^ (r & 7)) << 4);
}
// Q tiles in shared memory: two under FDPP_PERSIST where they fit the 227 KiB opt-in (the host's
// prefill_hopper.rs `q_buffers` makes the same choice), so that the next block's Q lands while
// this one is walked; else one, refilled once both consumers' last Q·Kᵀ is done.
constexpr int QBUF = FDPP_PERSIST && 2 * Q_BYTES + 2 * STAGES * KV_BYTES + 256 + 1024 <= 227 * 1024 ? 2 : 1;
constexpr u32 BAR_AT = QBUF * Q_BYTES + 2 * STAGES * KV_BYTES;
// Registers per thread after setmaxnreg: 128·48 + 256·224 = 63488 ≤ 65536, the pool of one
// 384-thread block launched at 168 (FA3 gives its producers 24–32; these ones compute the
// page addresses of their copies, so more: at 40 ptxas spilled in some schedules; the
// consumers' main loop needs about 200).
constexpr int PRODUCER_REGS = 48;
constexpr int CONSUMER_REGS = 224;

static_assert(D == 64 || D == 128, "the Hopper prefill handles head_dim 64 and 128");
static_assert(4 * STAGES * 8 + 152 <= 256, "prefill_hopper.rs reserves 256 bytes of barriers (the votes, the trace slots, Q's, the persistent kernel's entries and words)");
static_assert(BN == 4 * 32, "four producer warps stage 32 rows each");

#if FDPP_DIAG == 3
__device__ __forceinline__ u64 smem_ld64(u32 addr) {
    u64 v;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(addr) : "memory");
    return v;
}
#endif

// ---- the block ----

struct Ctx {
    const u16* q;
    const u16* kp;
    const u16* vp;
    const int* pages;
    const TmaMap* kmap;
    const TmaMap* vmap;
    const TmaMap* kmap_run;  // boxes of BN rows: a tile of consecutive slots (valid when tma_rows < BN)
    const TmaMap* vmap_run;
    int tma_rows;  // rows of a TMA box (min(page_size, BN)), 0: every tile by cp.async
    int page_size, H, G, h, kvh, kv_end;
    int row0, pos0, rows;
    int qb;    // the Q buffer this block uses (0 unless QBUF = 2)
    u32 base;  // shared address of the 1024-byte aligned tile area
    __device__ __forceinline__ u32 sq() const { return base + (u32)qb * Q_BYTES; }
    __device__ __forceinline__ u32 sk(int s) const { return base + QBUF * Q_BYTES + 2 * s * KV_BYTES; }
    __device__ __forceinline__ u32 sv(int s) const { return sk(s) + KV_BYTES; }
    __device__ __forceinline__ u32 full_k(int s) const { return base + BAR_AT + 8 * s; }
    __device__ __forceinline__ u32 full_v(int s) const { return base + BAR_AT + 8 * (STAGES + s); }
    __device__ __forceinline__ u32 empty_k(int s) const { return base + BAR_AT + 8 * (2 * STAGES + s); }
    __device__ __forceinline__ u32 empty_v(int s) const { return base + BAR_AT + 8 * (3 * STAGES + s); }
    // The async vote's mbarrier and word. FDPP_PERSIST keeps two of each, for the CTA's async
    // blocks by parity (the producer reads block k's vote after the consumers may have begun
    // block k + 1's; the rest of the area hangs off parity 0's).
    __device__ __forceinline__ u32 vote_bar(int p = 0) const { return base + BAR_AT + 8 * (4 * STAGES) + 136u * (u32)p; }
    __device__ __forceinline__ u32 vote_word(int p = 0) const { return vote_bar(p) + 8; }
    // FDPP_PERSIST, async: whether the producer streams the pending block again (thread 0 to the
    // producer warpgroup).
    __device__ __forceinline__ u32 redo_word() const { return vote_bar() + 148; }
    // FDPP_DIAG 3: the SM clock when the first K tile was requested, and when it had that
    // tile's page ids (8 bytes each).
    __device__ __forceinline__ u32 trace_slot() const { return vote_bar() + 16; }
    __device__ __forceinline__ u32 trace_slot_box() const { return vote_bar() + 24; }
    // Q's rows by TMA (q_tma): the bytes complete on this one (one per Q buffer).
    __device__ __forceinline__ u32 q_bar() const { return vote_bar() + 32 + 8 * qb; }
    // FDPP_PERSIST: both consumers' last Q·Kᵀ of the buffer's block is done (one arrival per
    // consumer thread), and the block's entry (two int4, written by the producer before Q's
    // arrival) for the consumers.
    __device__ __forceinline__ u32 q_empty() const { return vote_bar() + 48 + 8 * qb; }
    __device__ __forceinline__ u32 entry_at() const { return vote_bar() + 64 + 32 * qb; }
    // FDPP_PERSIST: the producer's ticket of the block, one word per block parity.
    __device__ __forceinline__ u32 ticket_word(int parity) const { return vote_bar() + 128 + 4 * parity; }
    // Key tiles of the block, and those consumer w needs (its last row's position + 1 keys).
    __device__ __forceinline__ int tiles() const { return (kv_end + BN - 1) / BN; }
    __device__ __forceinline__ int tiles_of(int w) const {
        const int first = WG_ROWS * w;
        if (first >= rows) return 0;
        const int last = min(rows, first + WG_ROWS);
        return (pos0 + last + BN - 1) / BN;
    }
};

// Producer warp pw (0..3) stages rows 32·pw .. 32·pw + 31 of every tile. Lane l owns the cache
// slot (page · page_size + key % page_size) of row 32·pw + l, or NO_SLOT past kv_end: one
// page-table load and one division per row and tile, shared by K and V and broadcast by
// shuffles. (A lookup per 16-byte chunk, as attn_prefill.cu does, made the producer's dependent
// loads the bottleneck: ncu showed the L1TEX scoreboard as the main stall and the tensor pipe
// nearly idle.)
constexpr u32 NO_SLOT = 0xffffffffu;
__device__ __forceinline__ u32 row_slot(const Ctx& c, int key) {
    if (key >= c.kv_end) return NO_SLOT;
    return (u32)c.pages[key / c.page_size] * (u32)c.page_size + (u32)(key % c.page_size);
}

// Copy the warp's 32 rows of one tile of K or V: iteration i copies rows RPI·i .. RPI·i + RPI − 1,
// lane l chunk l % CH of row RPI·i + l / CH, to kv_at()'s place.
// The copy loop is the producer's whole instruction stream, and its warps share each SM
// sub-partition's issue slot with the consumer warps, whose softmax is issue-bound (FA3 §3.1
// gives the producer one thread issuing TMA for this reason). Measured (reports/NOTES-prefill-s4.md):
// with no copies at all (FDPP_DIAG=1) the kernel ran 20–25 % faster, while a third stage or
// releasing K before V changed nothing. (Session 7: with TMA taking the copies off the
// producer's issue slots the consumers still wait on "K full", so their cost is not the issue
// either; TMA is faster under the default schedule, and this loop now serves only the tile
// holding kv_end and page sizes TMA cannot box.) An earlier form shuffled a 64-bit offset per copy and rebuilt the address and the swizzle
// each time (about 30 instructions per 16-byte copy in SASS); here a copy is a shuffle of the
// 32-bit slot, one wide multiply-add and the cp.async, with the swizzled destinations
// precomputed: the row's XOR term (row % 8) takes only 8 / RPI values per lane.
__device__ __forceinline__ void copy_rows(const u16* src, u32 dst, u32 slot, const Ctx& c, int pw, int lane) {
    constexpr int RPI = 32 / CH;  // rows per iteration: 2 (D = 128) or 4 (D = 64)
    constexpr int NX = 8 / RPI;   // distinct values of (row % 8) − (row % RPI) over iterations
    const int ch = lane % CH, sub = lane / CH;
    // Row 32·pw + RPI·i + sub, chunk ch: kv_at() = (row / 8)·KV_ATOMS + (ch / 8)·1024 +
    // (row % 8)·128 + ((ch % 8) ^ (row % 8))·16, with row % 8 = RPI·(i % NX) + sub and
    // row / 8 = 4·pw + i / NX (RPI·NX = 8).
    u32 at[NX];
#pragma unroll
    for (int x = 0; x < NX; ++x)
        at[x] = dst + (u32)(4 * pw) * KV_ATOMS + (u32)(ch >> 3) * 1024 + (u32)(sub + RPI * x) * 128 +
                ((u32)((ch & 7) ^ sub ^ (RPI * x)) << 4);
    const char* base = reinterpret_cast<const char*>(src + (size_t)c.kvh * D + ch * 8);
    const u32 stride = (u32)(c.G * D * 2);  // bytes from one token slot to the next
#pragma unroll
    for (int i = 0; i < 32 / RPI; ++i) {
        const u32 sl = __shfl_sync(0xffffffffu, slot, RPI * i + sub);
        const bool ok = sl != NO_SLOT;
        cp_async16(at[i % NX] + (u32)(i / NX) * KV_ATOMS, base + (size_t)(ok ? sl : 0u) * stride, ok ? 16 : 0);
    }
}

// The box at (0, 0, 0, c3, c4) of a 5-D tensor map lands at dst, its bytes completing on bar.
__device__ __forceinline__ void tma_load_5d(u32 dst, const TmaMap* map, u32 bar, int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %3, %3, %4, %5}], [%2];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(0), "r"(c3), "r"(c4)
        : "memory");
}

// Rows j·tma_rows .. + tma_rows − 1 of K or V of a tile into stage buffer dst by TMA, from
// `slot` on (a multiple of 8: a page's first slot, or a tile's within a page of 128 or more):
// one box of every column block (the pool's 5-D map: 64 columns, 8 rows, D/64 column blocks,
// the kv head, groups of 8 slots), landing in kv_at()'s layout.
__device__ __forceinline__ void tma_tile(const Ctx& c, const TmaMap* map, u32 dst, u32 bar, int slot, int j) {
    tma_load_5d(dst + (u32)(j * c.tma_rows / 8) * KV_ATOMS, map, bar, c.kvh, slot / 8);
}

// K or V of one tile by TMA, the bytes expected on `full` first; every producer thread then
// arrives on it. A tile of consecutive slots (`run`: its pages follow one another in the pool)
// is one box of BN rows from lane 0 (`run_map`); any other, one box per page from each of the
// first BN / tma_rows lanes of warp 0. Measured (reports/NOTES.md, sessions 19, 37): with pages
// of 16 the consumers waited on "K full", and it was the box count (then one per page and
// column block, 32 a tile at d128), not where the pages lie: the same pages in pool order, boxed
// per page, ran as slowly as scattered ones, and 14-20 % faster as run boxes. (V by cp.async,
// session 19, and every tile by cp.async, session 37, cost the producer more than the boxes they
// replace.) A box now holds every column block (kv_at's layout): 16 a tile, 6-13 % faster
// (session 38); what remains is the per-box cost, so a RUNS schedule for per-page tiles still
// loses (hopper_runs=1 with scattered pages: level to 11 % slower than the default, session 38).
__device__ __forceinline__ void load_tma(const Ctx& c, const TmaMap* map, const TmaMap* run_map, u32 dst, u32 full, int box,
                                         bool run, int pw, int lane, bool tma_lane) {
#if FDPP_DIAG != 1
    if (pw == 0) {
        if (lane == 0) mbar_expect_tx(full, KV_BYTES);
        __syncwarp();
        if (FDPP_RUN_BOXES && run) {
            if (lane == 0) tma_tile(c, run_map, dst, full, box, 0);
        } else if (tma_lane) {
            tma_tile(c, map, dst, full, box, lane);
        }
    }
#endif
    mbar_arrive(full);
}

// Whether warp 0's boxes of a tile (lane j < BN / tma_rows: the slot of row j·tma_rows in `box`)
// are one run of consecutive slots that a BN-row box covers. Called by all of warp 0.
__device__ __forceinline__ bool tile_is_run(const Ctx& c, int box, int lane, bool tma_lane) {
    if (!FDPP_RUN_BOXES || c.tma_rows == 0 || c.tma_rows >= BN) return false;
    const int first = __shfl_sync(0xffffffffu, box, 0);
    return __all_sync(0xffffffffu, !tma_lane || box == first + lane * c.tma_rows);
}

// The producer's page lookups for the first key tile of a walk: the slot of each TMA lane's box
// (by_tma > 0), or of every thread's row when the tile comes by cp.async.
struct Lookup {
    u32 slot;
    int box;
};
__device__ __forceinline__ Lookup first_lookup(const Ctx& c) {
    const int t = threadIdx.x % 128, pw = t / 32, lane = t % 32;
    const int by_tma = c.tma_rows > 0 ? c.kv_end / BN : 0;
    const bool tma_lane = pw == 0 && c.tma_rows > 0 && lane < BN / c.tma_rows;
    // TMA lane j (< BN / tma_rows) of warp 0 loads rows j·tma_rows .. + tma_rows − 1 of a tile,
    // which lie in one page from the slot of its first row on (keys of TMA tiles are < kv_end).
    return {by_tma > 0 ? NO_SLOT : row_slot(c, 32 * pw + lane), by_tma > 0 && tma_lane ? (int)row_slot(c, lane * c.tma_rows) : 0};
}

// K of tile 0 of the block's first walk into stage 0, requested by thread 0 right after it set
// up the barrier and before the block's __syncthreads, from the slot the host looked up (`box0`,
// attn_plan.rs `prefill_blocks`: the tile is one box, from the pool map when pages
// hold a whole tile, else from the run map). The producer's walk then arrives for it and requests
// V of the tile, from the same slot. Before, the block's first K request waited for the tile
// entry, then the tile's page id, then the barrier setup: ~3,300 SM cycles of an 8 · 1024
// block's ~20,000 (reports/NOTES.md, session 21's timeline). V requested here as well measured
// the same, and 1-2 % slower at 1 · 1024 (session 22).
__device__ __forceinline__ void issue_first(const Ctx& c, int box0) {
#if FDPP_DIAG != 1
    mbar_expect_tx(c.full_k(0), KV_BYTES);
    tma_tile(c, c.tma_rows >= BN ? c.kmap : c.kmap_run, c.sk(0), c.full_k(0), box0, 0);
#endif
    TRACE(asm volatile("st.shared.u64 [%0], %1;" ::"r"(c.trace_slot()), "l"(clock64()) : "memory");)
}

// The producer's walk over the key tiles; `it` counts stage uses across walks (the ring's
// phases continue into the recompute walk). Tiles before `by_tma` come by TMA, issued by the
// first BN / tma_rows lanes of warp 0; the rest (the one holding kv_end, or all when the page
// size does not box) by cp.async from every producer thread. Each of the 128 producer threads
// arrives once per stage use on each full barrier either way (the count they were made with).
__device__ __forceinline__ void load_q_tma(const Ctx& c, const TmaMap* qmap);
__device__ __forceinline__ void next_q(const Ctx& c, const TmaMap* qmap, const int4& tv, const int4& te, u32 parity);

// `qmap` (FDPP_PERSIST with one Q buffer): once K and V of the walk's first tile are requested,
// warp 0 waits for the Q buffer to be free and its lane 0 requests this block's Q (next_q).
__device__ void produce(const Ctx& c, int& it, Lookup first, bool issued0, const TmaMap* qmap = nullptr,
                        int4 tv = int4{}, int4 te = int4{}, u32 q_parity = 0) {
    const int t = threadIdx.x % 128, pw = t / 32, lane = t % 32;
    const int ntiles = c.tiles();
    const int by_tma = c.tma_rows > 0 ? c.kv_end / BN : 0;
    const bool tma_lane = pw == 0 && c.tma_rows > 0 && lane < BN / c.tma_rows;
    u32 slot = first.slot;
    int box = first.box;
    // Tile 0 from the host's slot (issued0) is one box by construction.
    bool run = FDPP_RUN_BOXES && pw == 0 && by_tma > 0 && (issued0 ? c.tma_rows < BN : tile_is_run(c, box, lane, tma_lane));
    TRACE(asm volatile("" ::"r"(box), "r"(slot)); if (t == 0) asm volatile("st.shared.u64 [%0], %1;" ::"r"(c.trace_slot_box()), "l"(clock64()) : "memory");)
    for (int n = 0; n < ntiles; ++n, ++it) {
        const int s = it % STAGES;
        // Use u = it / STAGES of K (of V) in stage s waits until both consumers released K (V)
        // of use u − 1.
        const u32 prev = (u32)((it / STAGES) - 1) & 1u;
        if (it >= STAGES) mbar_wait(c.empty_k(s), prev);
        TRACE(if (n == 0 && t == 0 && !issued0) asm volatile("st.shared.u64 [%0], %1;" ::"r"(c.trace_slot()), "l"(clock64()) : "memory");)
        if (n == 0 && issued0) {
            // Thread 0 requested K at entry (issue_first); V of the tile goes out from here.
            mbar_arrive(c.full_k(s));
            load_tma(c, c.vmap, c.vmap_run, c.sv(s), c.full_v(s), box, run, pw, lane, tma_lane);
        } else if (n < by_tma) {
            load_tma(c, c.kmap, c.kmap_run, c.sk(s), c.full_k(s), box, run, pw, lane, tma_lane);
            if (it >= STAGES) mbar_wait(c.empty_v(s), prev);
            load_tma(c, c.vmap, c.vmap_run, c.sv(s), c.full_v(s), box, run, pw, lane, tma_lane);
        } else {
            // The stage may last have been written by TMA (the async proxy).
            if (c.tma_rows > 0) fence_async_smem();
#if FDPP_DIAG != 1
            copy_rows(c.kp, c.sk(s), slot, c, pw, lane);
#endif
            cp_async_arrive(c.full_k(s));
            if (it >= STAGES) mbar_wait(c.empty_v(s), prev);
#if FDPP_DIAG != 1
            copy_rows(c.vp, c.sv(s), slot, c, pw, lane);
#endif
            cp_async_arrive(c.full_v(s));
        }
        if (FDPP_PERSIST && n == 0 && qmap != nullptr && pw == 0) next_q(c, qmap, tv, te, q_parity);
        // The next tile's rows, looked up while the consumers work on this one.
        if (n + 1 < by_tma) {
            if (tma_lane) box = (int)row_slot(c, (n + 1) * BN + lane * c.tma_rows);
            if (FDPP_RUN_BOXES && pw == 0) run = tile_is_run(c, box, lane, tma_lane);
        } else if (n + 1 < ntiles) {
            slot = row_slot(c, (n + 1) * BN + 32 * pw + lane);
        }
    }
}

// The block's Q rows [BM, D] by TMA from thread 0: one box of 128 rows per 64 columns (tma.rs
// `query_map`, swizzled as the K/V boxes), rows past the last token zeros, the bytes on q_bar.
// Rows past the block's own (a sequence's last tile) hold the next sequence's queries: their
// scores are computed and never stored, as the zero rows of load_q are. Measured
// (reports/NOTES.md, session 22): the consumers' 2,048 cp.async copies of Q took ~2,500 SM cycles
// to land at a block's start; by TMA, 8 · 1024 ran 1-2 % faster and 1 · 1024 1 % slower.
__device__ __forceinline__ void load_q_tma(const Ctx& c, const TmaMap* qmap) {
    mbar_arrive_expect_tx(c.q_bar(), Q_BYTES);
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) tma_load_3d(c.sq() + (u32)cb * BM * 128, qmap, c.q_bar(), 64 * cb, c.h, c.row0);
}

// FDPP_PERSIST: warp 0 of the producer waits until both consumers are done with the Q buffer's
// previous block (use parity `parity` of its q_empty), then lane 0 writes the block's entry next
// to it and requests Q, arriving on q_bar (release: the consumers read the entry after waiting
// there); with no `qmap`, the entry is the list's end marker and lane 0 only arrives.
__device__ __forceinline__ void next_q(const Ctx& c, const TmaMap* qmap, const int4& tv, const int4& te, u32 parity) {
    mbar_wait(c.q_empty(), parity);
    if (threadIdx.x % 32 == 0) {
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(c.entry_at()), "r"(tv.x), "r"(tv.y), "r"(tv.z), "r"(tv.w) : "memory");
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(c.entry_at() + 16), "r"(te.x), "r"(te.y), "r"(te.z), "r"(te.w) : "memory");
        if (qmap != nullptr) load_q_tma(c, qmap);
        else mbar_arrive(c.q_bar());  // the end marker (zero rows), no bytes
    }
    __syncwarp();
}

// Consumer w requests its 64 rows of Q into the swizzled Q tile (one cp.async group; the caller
// waits for it).
__device__ __forceinline__ void load_q(const Ctx& c, int w) {
    const int t = threadIdx.x % 128;
    for (int i = t; i < WG_ROWS * CH; i += 128) {
        const int row = WG_ROWS * w + i / CH, ch = i % CH;
        const bool ok = row < c.rows;
        const size_t at = ok ? ((size_t)(c.row0 + row) * c.H + c.h) * D + ch * 8 : 0;
        cp_async16(c.sq() + swz(row, ch, BM), c.q + at, ok ? 16 : 0);
    }
    cp_async_commit();
}

// Row state of the two rows a thread holds (16·warp + g and + 8 within its warpgroup's 64);
// o[4·j + i] is the accumulator element of column group j (wgmma's D fragment: i = 0, 1 on the
// first row, columns 8j + 2·(lane % 4) + {0, 1}; i = 2, 3 on the second).
struct Rows {
    float o[DT * 4];
    float m[2], l[2], mx[2];
    bool over[2];
    TRACE(long long tk0;)  // the SM clock when K of the first tile was in
};

// What one consumer thread needs to walk the tiles: its warpgroup, its rows' positions, and
// the softmax constants.
struct Walker {
    int w, tq, lane;
    int warp_pos0;  // position of the warp's first row
    int qpos[2];
    u32 q_at;  // this warpgroup's 64 rows of the Q tile
    u64 q_desc;  // and its wgmma descriptor
#if FDPP_PERSIST
    u64 qd[KS];  // and those of its k-steps (issue_qk)
#endif
    float scale2, phi2, b2;
    // FDPP_PERSIST under ping-pong: the turns chain across the CTA's blocks (warpgroup 0 waits
    // for warpgroup 1's last turn of the previous block, which then arrives for it), so that
    // warpgroup 0 cannot arrive twice on a turn barrier before warpgroup 1 has waited once.
    bool chain_in = false, chain_out = false;
};

// S = Q · Kᵀ of stage s issued (not waited): 64 rows × BN keys, K-major A and B, k16 steps
// along D (4 per 128-byte column block, +32 bytes each); K's 8-key groups KV_ATOMS apart, its
// column blocks 1024 (kv_at()).
__device__ __forceinline__ void issue_qk(const Ctx& c, const Walker& k, float (&sc)[NT * 4], int s) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const u32 kb = (u32)(ks >> 2) * 128u, ko = (u32)(ks & 3) * 32u;
#if FDPP_PERSIST
        // Each k-step's Q descriptor set per block, K's added in the low word: with the 64-bit
        // adds below, ptxas kept no descriptor across the persistent kernel's key tiles (as it
        // does for one block per tile) and rebuilt each with an add with carry and its constant
        // high word: a consumer warp's async loop took 622 instructions per tile against 574
        // (s3o1p1r d128), sync 687 against 634; this way 583 and 643. One block per tile keeps
        // its form, which this one made 8 instructions longer at s2o0p0 (SASS, NVRTC 13.0,
        // reports/NOTES.md, session 25).
        const u64 da = k.qd[ks];
        const u64 db = desc_add(desc_sw128(c.sk(s), 16, KV_ATOMS), ((kb << 3) + ko) >> 4);
#else
        const u64 da = k.q_desc + ((kb * BM + ko) >> 4);
        const u64 db = desc_sw128(c.sk(s), 16, KV_ATOMS) + (((kb << 3) + ko) >> 4);
#endif
        wgmma_ss_n128(sc, da, db, ks);
    }
    wg_commit();
}

// O += P · V of stage s issued: V [keys, D] is N-major for B (transpose bit); a k16 step is 16
// keys, two 8-key groups, 2·KV_ATOMS bytes; the D/64 column blocks are 1024 bytes apart (leading
// byte offset), the 8-key groups KV_ATOMS (stride byte offset): kv_at().
__device__ __forceinline__ void issue_pv(const Ctx& c, Rows& st, const u32 (&pa)[PS][4], int s) {
    const u64 vd = desc_sw128(c.sv(s), 1024, KV_ATOMS);
#pragma unroll
    for (int kk = 0; kk < PS; ++kk) wgmma_rs_tb(st.o, pa[kk], vd + kk * ((2 * KV_ATOMS) >> 4));
    wg_commit();
}

// The softmax of key tile n in place: mask keys past each row's position (causal; keys past
// the end lie past every real row's position), update the row state, and leave
// P = 2^(S·scale2 − m) in `sc`, m in log2 units; `corr` is the factor O must be rescaled by
// before P·V of this tile is added (1 under async). The scale is folded into the exponent's FMA
// (FA3 does the same); m is finite from the first tile on (key 0 is at or before every row's
// position; async's m is φ), so a masked −inf gives 2^−inf = 0 with no test.
template <bool ASYNC>
__device__ __forceinline__ void softmax_tile(const Walker& k, float (&sc)[NT * 4], Rows& st, float (&corr)[2], int n) {
    if (n * BN + BN - 1 > k.warp_pos0) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = n * BN + 8 * j + 2 * k.tq + (i & 1);
                if (key > k.qpos[i >> 1]) sc[4 * j + i] = -FDPP_INF;
            }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float tm = -FDPP_INF;
#pragma unroll
        for (int j = 0; j < NT; ++j) tm = fmaxf(tm, fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
        tm *= k.scale2;  // scale2 > 0: the max commutes with it
        if (ASYNC) {
            st.mx[r] = fmaxf(st.mx[r], tm);
            st.over[r] |= tm - k.phi2 > k.b2;
            corr[r] = 1.f;
        } else {
            const float mn = fmaxf(st.m[r], tm);
            // Before the first tile m = −inf and O = 0: nothing to rescale.
            corr[r] = st.m[r] == -FDPP_INF ? 1.f : ex2(st.m[r] - mn);
            st.m[r] = mn;
        }
    }
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float& x = sc[4 * j + i];
#if FDPP_DIAG == 2
            x = fmaf(x, k.scale2, -st.m[i >> 1]);
#else
            x = ex2(fmaf(x, k.scale2, -st.m[i >> 1]));
#endif
            ls[i >> 1] += x;
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * corr[r] + ls[r];
}

// P as the A operand of P·V: column groups 2kk and 2kk + 1 of S are registers {0, 1} and {2, 3}
// of k-step kk (wgmma's accumulator and A-fragment layouts line up for 16-bit types).
__device__ __forceinline__ void pack_p(const float (&sc)[NT * 4], u32 (&pa)[PS][4]) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        pa[j / 2][(j % 2) * 2 + 0] = pack2(sc[4 * j + 0], sc[4 * j + 1]);
        pa[j / 2][(j % 2) * 2 + 1] = pack2(sc[4 * j + 2], sc[4 * j + 3]);
    }
}

template <bool ASYNC>
__device__ __forceinline__ void rescale_o(Rows& st, const float (&corr)[2]) {
    if (!ASYNC) {
#pragma unroll
        for (int j = 0; j < DT; ++j) {
            st.o[4 * j + 0] *= corr[0];
            st.o[4 * j + 1] *= corr[0];
            st.o[4 * j + 2] *= corr[1];
            st.o[4 * j + 3] *= corr[1];
        }
    }
}

__device__ __forceinline__ void keep_all(float* x, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) keep(x[i]);
}

// Consumer w walks every key tile with one scheme; O, l and the flags end in `st`. `it` counts
// stage uses (the ring's phases continue into the recompute walk). `q_done` runs once this
// warpgroup's last Q·Kᵀ has completed (at once when it has no tile): FDPP_PERSIST frees the Q
// buffer then.
struct NoQDone {
    __device__ void operator()() const {}
};
template <bool ASYNC, class QDone = NoQDone>
__device__ void walk(const Ctx& c, const Walker& k, int& it, Rows& st, QDone q_done = QDone{}) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.m[r] = ASYNC ? k.phi2 : -FDPP_INF;
        st.l[r] = 0.f;
        st.mx[r] = -FDPP_INF;
        st.over[r] = false;
    }
#pragma unroll
    for (int i = 0; i < DT * 4; ++i) st.o[i] = 0.f;
    const int ntiles = c.tiles(), mine = c.tiles_of(k.w);
    int qk_left = mine;
    if (mine == 0) q_done();
    auto qk_done = [&]() {
        if (--qk_left == 0) q_done();
    };
    auto stage = [](int i) { return i % STAGES; };
    auto parity = [](int i) { return (u32)(i / STAGES) & 1u; };
    // This warp's part of every wgmma that read K (V) of use i is complete.
    auto release_k = [&](int i) {
        if (k.lane == 0) mbar_arrive(c.empty_k(stage(i)));
    };
    auto release_v = [&](int i) {
        if (k.lane == 0) mbar_arrive(c.empty_v(stage(i)));
    };
    float sc[NT * 4];
    u32 pa[PS][4];
    float corr[2];
#if FDPP_OVERLAP
    // FA3 §3.2's intra-warpgroup pipelining: the softmax of tile n runs while the tensor cores
    // do P·V of tile n − 1, so each iteration issues S_n = Q·K_nᵀ and O += P_{n−1}·V_{n−1}
    // together, waits for S_n only, and rescales O for tile n at the start of the next one.
    // The issue points are phases 0 .. ntiles (QK_0; QK_n with PV_{n−1}; PV_last); under
    // ping-pong both warpgroups go through all ntiles + 1 of them (a warpgroup with fewer tiles
    // passes the rest empty) so that the turn-taking barriers stay paired:
    // barrier 3 (warpgroup 0 waits, before every phase but the first; warpgroup 1 arrives after
    // every phase but the last) and barrier 4 (warpgroup 1 waits before every phase, warpgroup 0
    // arrives after every phase).
    int phase = 0;
    auto turn_begin = [&]() {
#if FDPP_PINGPONG
        if (k.w == 0) {
            if (phase > 0 || k.chain_in) named_sync(3, 256);
        } else {
            named_sync(4, 256);
        }
#endif
    };
    auto turn_end = [&]() {
#if FDPP_PINGPONG
        if (k.w == 0) {
            named_arrive(4, 256);
        } else if (phase < ntiles || k.chain_out) {
            named_arrive(3, 256);
        }
#endif
        ++phase;
    };
    if (mine > 0) {
        mbar_wait(c.full_k(stage(it)), parity(it));
        TRACE(st.tk0 = clock64();)
        fence_async_smem();
        turn_begin();
        wg_fence();
        issue_qk(c, k, sc, stage(it));
        turn_end();
        wg_wait<0>();
        keep_all(sc, NT * 4);
        qk_done();
        release_k(it);
        softmax_tile<ASYNC>(k, sc, st, corr, 0);
        pack_p(sc, pa);
        for (int n = 1; n < mine; ++n, ++it) {
            // `it` is tile n − 1's use.
            mbar_wait(c.full_k(stage(it + 1)), parity(it + 1));
            rescale_o<ASYNC>(st, corr);
            mbar_wait(c.full_v(stage(it)), parity(it));
            fence_async_smem();
            turn_begin();
            wg_fence();
            issue_qk(c, k, sc, stage(it + 1));
            issue_pv(c, st, pa, stage(it));
            turn_end();
            wg_wait<1>();
            keep_all(sc, NT * 4);
            qk_done();
            release_k(it + 1);
            // The softmax of tile n + 1 is what runs under P·V of tile n, but ptxas schedules
            // straight-line code past WARPGROUP.DEPBAR: with the call unguarded, every one of the
            // tile's 64 MUFU.EX2 sat after the wait for P·V (SASS, NVRTC 13.0), so nothing
            // overlapped. A branch it cannot resolve (scale2 > 0 always holds) is a region
            // boundary it keeps, as it keeps the masking branch's.
            if (k.scale2 > 0.f) {
                softmax_tile<ASYNC>(k, sc, st, corr, n);
            } else {
                corr[0] = corr[1] = 1.f;
            }
            wg_wait<0>();
            keep_all(st.o, DT * 4);
            release_v(it);
            pack_p(sc, pa);
        }
        rescale_o<ASYNC>(st, corr);
        mbar_wait(c.full_v(stage(it)), parity(it));
        fence_async_smem();
        turn_begin();
        wg_fence();
        issue_pv(c, st, pa, stage(it));
        turn_end();
        wg_wait<0>();
        keep_all(st.o, DT * 4);
        release_v(it);
        ++it;
    }
    // The phases of the tiles this warpgroup skips (past its last row: the causal diagonal, or
    // padding rows) pass empty; phase p releases tile p − 1 as a real one would, in order and
    // after it was filled, so that the ring's phases stay paired and the producer is never held
    // up by a release waiting behind a turn (which would deadlock the ping-pong).
    while (phase <= ntiles) {
        turn_begin();
        turn_end();
        if (phase - 2 >= mine) {
            mbar_wait(c.full_k(stage(it)), parity(it));
            mbar_wait(c.full_v(stage(it)), parity(it));
            release_k(it);
            release_v(it);
            ++it;
        }
    }
#else
    // One tile at a time: S, softmax, P·V (the other consumer warpgroup fills the gaps).
    for (int n = 0; n < mine; ++n, ++it) {
        mbar_wait(c.full_k(stage(it)), parity(it));
        TRACE(if (n == 0) st.tk0 = clock64();)
        fence_async_smem();
        wg_fence();
        issue_qk(c, k, sc, stage(it));
        wg_wait<0>();
        keep_all(sc, NT * 4);
        qk_done();
        release_k(it);
        softmax_tile<ASYNC>(k, sc, st, corr, n);
        pack_p(sc, pa);
        rescale_o<ASYNC>(st, corr);
        mbar_wait(c.full_v(stage(it)), parity(it));
        fence_async_smem();
        wg_fence();
        issue_pv(c, st, pa, stage(it));
        wg_wait<0>();
        keep_all(st.o, DT * 4);
        release_v(it);
    }
    // Past this warpgroup's last row (the causal diagonal, or padding rows): nothing to compute,
    // but each stage is released in order, after it was filled, so that the phases stay paired.
    for (int n = mine; n < ntiles; ++n, ++it) {
        mbar_wait(c.full_k(stage(it)), parity(it));
        mbar_wait(c.full_v(stage(it)), parity(it));
        release_k(it);
        release_v(it);
    }
#endif
    // Row sums over the quad that holds each row.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    }
}

// The block's part of the context, from its entry (prefill's comment has the fields).
__device__ __forceinline__ void set_block(Ctx& c, const int4& tv, const int4& te, const int* table, int max_pages) {
    c.pages = table + (size_t)tv.x * max_pages;
    c.h = te.x;
    c.kvh = te.z;
    c.row0 = tv.y;
    c.pos0 = tv.z;
    c.rows = tv.w;
    c.kv_end = c.pos0 + c.rows;
}

// An int4 of shared memory as lane 0 read it (warp-uniform for ptxas).
__device__ __forceinline__ int4 shfl_entry(u32 at) {
    int4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at) : "memory");
    v.x = __shfl_sync(0xffffffffu, v.x, 0);
    v.y = __shfl_sync(0xffffffffu, v.y, 0);
    v.z = __shfl_sync(0xffffffffu, v.z, 0);
    v.w = __shfl_sync(0xffffffffu, v.w, 0);
    return v;
}

// The consumer's per-block walker state: its rows' positions and its Q rows' descriptor.
__device__ __forceinline__ void set_walker(Walker& k, const Ctx& c) {
    k.warp_pos0 = c.pos0 + WG_ROWS * k.w + 16 * ((threadIdx.x % 128) / 32);
    k.qpos[0] = k.warp_pos0 + k.lane / 4;
    k.qpos[1] = k.qpos[0] + 8;
    k.q_at = c.sq() + WG_ROWS * k.w * 128;
    k.q_desc = desc_sw128(k.q_at, 16, 1024);
#if FDPP_PERSIST
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) k.qd[ks] = desc_sw128(k.q_at + (u32)(ks >> 2) * 128u * BM + (u32)(ks & 3) * 32u, 16, 1024);
#endif
}

// Write rows whose bit in `mask` (bit 0: first row, bit 1: second) is set. A lane holds two
// columns of each 8-column group of its row (wgmma's D fragment); the quad sharing the row trades
// them (a 4 × 4 transpose per four groups: 2 × 2 blocks across lane pairs, then the off-diagonal
// blocks across pairs of pairs) so that each lane stores whole groups: four 16-byte stores per
// row and lane, a quad 64 contiguous bytes per instruction, where one 4-byte store per group and
// lane made each warp instruction write 16 bytes of 8 rows. Every lane runs the shuffles (the
// row tests only guard the stores): shuffles under a partial mask cost ptxas's divergence checks
// around each one, and made the store three times slower. Measured (reports/NOTES.md, session
// 21): a block's store took 1,900-2,900 SM cycles before and 1,000-1,400 after; 8 · 1024
// +11 %, 1 · 1024 +8 %.
__device__ __forceinline__ void store(const Ctx& c, int w, const Rows& st, u16* __restrict__ out, unsigned mask) {
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int g = lane / 4, tq = lane % 4;
    const bool odd = tq & 1, high = tq & 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = WG_ROWS * w + 16 * warp + g + 8 * r;
        const bool keep = (mask & (1u << r)) && row < c.rows;
        const float inv = 1.f / st.l[r];
        u16* o = out + ((size_t)(c.row0 + row) * c.H + c.h) * D;
#pragma unroll
        for (int k = 0; k < DT / 4; ++k) {
            // a[i]: this lane's columns 2tq, 2tq + 1 of group 4k + i; afterwards lane tq's
            // a[i] holds lane i's columns of group 4k + tq.
            u32 a[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = 4 * k + i;
                a[i] = pack2(st.o[4 * j + 2 * r] * inv, st.o[4 * j + 2 * r + 1] * inv);
            }
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                const u32 got = __shfl_xor_sync(0xffffffffu, odd ? a[i] : a[i + 1], 1);
                if (odd) a[i] = got;
                else a[i + 1] = got;
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 got = __shfl_xor_sync(0xffffffffu, high ? a[i] : a[i + 2], 2);
                if (high) a[i] = got;
                else a[i + 2] = got;
            }
            if (keep) *reinterpret_cast<uint4*>(o + 8 * (4 * k + tq)) = make_uint4(a[0], a[1], a[2], a[3]);
        }
    }
}

// The async walk's rows this thread holds that the sync scheme must redo (bit r for row r of
// its two; FlashDecoding++ §3): a score above the window (`over`), a row maximum below it, or a
// sum or output that is not finite. The quad shares the row, so any lane's view flags it; rows
// past the block's own are never flagged.
__device__ __forceinline__ u32 flagged_rows(const Ctx& c, int w, const Rows& st, float phi2, float a2) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    u32 bad = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        bool fin = st.l[r] > 0.f && finite(st.l[r]);
#pragma unroll
        for (int j = 0; j < DT; ++j) fin = fin && finite(st.o[4 * j + 2 * r]) && finite(st.o[4 * j + 2 * r + 1]);
        const bool flag_lane = st.over[r] || st.mx[r] - phi2 < a2 || !fin;
        const unsigned quad = __ballot_sync(0xffffffffu, flag_lane) >> (lane & ~3);
        const bool row_ok = WG_ROWS * w + 16 * warp + lane / 4 + 8 * r < c.rows;
        if ((quad & 0xfu) && row_ok) bad |= 1u << r;
    }
    return bad;
}

// FDPP_PERSIST's producer: block (tv, te) as the CTA's `j`-th (end markers and async redos
// counted): its entry and Q into buffer j % QBUF once that buffer's previous block let go of it,
// its tiles into the ring.
__device__ void next_block(Ctx& c, int& it, int j, const int4& tv, const int4& te, const int* table, int max_pages,
                           const TmaMap* qmap) {
    c.qb = j % QBUF;
    // Use u = j / QBUF of the Q buffer waits for use u − 1's release.
    const u32 q_parity = (u32)(j / QBUF - 1) & 1u;
    set_block(c, tv, te, table, max_pages);
    // The host's slot of tile 0's box stands for the page lookup where one box is the tile.
    const bool known = te.y >= 0 && c.tma_rows >= BN && c.kv_end >= BN;
    const Lookup first = known ? Lookup{NO_SLOT, te.y} : first_lookup(c);
    if (QBUF == 2) {
        if (threadIdx.x < 32) next_q(c, qmap, tv, te, q_parity);
        produce(c, it, first, false);
    } else {
        produce(c, it, first, false, qmap, tv, te, q_parity);
    }
}

template <bool ASYNC>
__device__ void prefill(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                        const int* __restrict__ table, const int4* __restrict__ blocks, int max_pages, int page_size,
                        int H, int G, int entry_ahead, int q_tma, int nblocks, unsigned* __restrict__ sched, float scale2, float phi2, float a2, float b2,
                        unsigned* __restrict__ recomputed, u16* __restrict__ out, const TmaMap* kmap, const TmaMap* vmap,
                        int tma_rows, const TmaMap* kmap_run, const TmaMap* vmap_run, const TmaMap* qmap) {
    extern __shared__ __align__(1024) unsigned char smem[];
    // Launched chained (src/backend/cuda/attention.rs), as the layer's GEMMs are: the blocks may
    // be resident while the QKV GEMM before them finishes, and wait here, in every thread, before
    // reading anything; the O GEMM after them may launch at once, to load its first W stages
    // while the last blocks run. Measured level on the H200 at 1024 tokens (reports/NOTES.md,
    // session 36: the ~2.7 µs idle before each attention stayed).
    pdl_wait();
    pdl_trigger();
    TRACE(const long long tc0 = clock64(); unsigned long long tg0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(tg0));)
    // The block's entry, two int4 of the host's list (attn_plan.rs `prefill_blocks`, in the order
    // of attn_common.cuh's tile_head): sequence, first row, first position, rows; head, the slot
    // of the first key tile's box (−1: looked up here), KV head. Computing the (tile, head) here
    // took ~170 instructions with six dependent integer divisions before the first load. The
    // entry of the block `entry_ahead` on (a wave later: the one likely to follow this block on
    // its SM) goes to L2 meanwhile; uploaded just before the launch, the list is read from DRAM
    // otherwise (~900 SM cycles at 8 · 1024 against ~400 for the L2-resident tile list).
    TRACE(const long long tcpre = clock64();)
    const int4 tv = blocks[2 * blockIdx.x], te = blocks[2 * blockIdx.x + 1];
    if (threadIdx.x == 0 && entry_ahead > 0 && blockIdx.x + (unsigned)entry_ahead < gridDim.x)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(blocks + 2 * (blockIdx.x + (unsigned)entry_ahead)));
    Ctx c;
    c.q = q;
    c.kp = kp;
    c.vp = vp;
    c.kmap = kmap;
    c.vmap = vmap;
    c.kmap_run = kmap_run;
    c.vmap_run = vmap_run;
    c.tma_rows = tma_rows;
    c.page_size = page_size;
    c.H = H;
    c.G = G;
    c.qb = 0;
    set_block(c, tv, te, table, max_pages);
    TRACE(asm volatile("" ::"r"(tv.x), "r"(tv.y), "r"(tv.z), "r"(tv.w), "r"(te.x), "r"(te.y), "r"(te.z)); const long long tct = clock64();)
    // The swizzle atoms must be 1024-byte aligned; the host adds 1024 bytes of slack.
    c.base = (smem_addr(smem) + 1023u) & ~1023u;
    // The warpgroup through a shuffle from lane 0: ptxas then treats it (and the tile counts, the
    // ring index and the wgmma descriptors derived from it) as warp-uniform and computes them in
    // the uniform datapath. From threadIdx.x directly, every descriptor of the main loop was
    // rebuilt in vector registers and moved over (R2UR) for each wgmma: 80 of the 480
    // instructions a consumer warp issued per key tile (SASS, session 7).
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    // Everything the block's first S = Q·Kᵀ waits on is requested before the rest of the setup,
    // as soon as the entry is in: with the host's slot (the tile comes by TMA: its keys all lie
    // before kv_end) thread 0 requests K of tile 0 (issue_first) and, under q_tma, the Q rows
    // (load_q_tma) right after initialising the barriers they complete on; otherwise the
    // producer looks up tile 0's pages and the consumers copy Q (measured, reports/NOTES.md,
    // session 21: +1-2.5 % at 1 · 1024 for those two before the setup over after it). Session
    // 22, all of it together: 8 · 1024 +5 %, GQA 32/8 8 · 1024 +6 %, 1 · 1024 +2-4 %.
    const bool issued0 = te.y >= 0 && c.tma_rows > 0 && c.kv_end >= BN;
    Lookup first{NO_SLOT, 0};
    if (wg == 0) {
        if (!issued0) first = first_lookup(c);
        else if (threadIdx.x == 0) first.box = te.y;
    } else if (!q_tma) {
        load_q(c, wg - 1);
    }
    if (threadIdx.x == 0) {
        mbar_init(c.full_k(0), 128);  // one (deferred) arrival per producer thread
        mbar_init(c.full_v(0), 128);
        mbar_init(c.q_bar(), 1);  // thread 0's arrival with Q's bytes
        if (FDPP_PERSIST) {
            for (int b = 0; b < QBUF; ++b) {
                Ctx x = c;
                x.qb = b;
                if (b > 0) mbar_init(x.q_bar(), 1);
                mbar_init(x.q_empty(), CONSUMERS * 128);  // one arrival per consumer thread
            }
        }
        if (issued0 || q_tma) {
            // The initialised barriers visible to the TMA unit before it completes on them.
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
            if (q_tma) load_q_tma(c, qmap);
            if (issued0) issue_first(c, te.y);
        }
        for (int s = 0; s < STAGES; ++s) {
            if (s > 0) {
                mbar_init(c.full_k(s), 128);
                mbar_init(c.full_v(s), 128);
            }
            mbar_init(c.empty_k(s), CONSUMERS * 4);  // one arrival per consumer warp
            mbar_init(c.empty_v(s), CONSUMERS * 4);
        }
        for (int p = 0; p < 1 + FDPP_PERSIST; ++p) {
            mbar_init(c.vote_bar(p), CONSUMERS * 128);  // one arrival per consumer thread
            smem_st(c.vote_word(p), 0);
        }
    }
    __syncthreads();
    int it = 0;
#if FDPP_PERSIST
    // Block 0 of this CTA is entry blockIdx.x, set up above as the non-persistent kernel's; each
    // later one is the next entry of the host's list (longest first) that no CTA has taken:
    // gridDim.x + a ticket from `sched` (zeroed by the host before the launch). The producer
    // takes it when it begins the block's loads, a block ahead of the consumers, and passes the
    // entry to them beside the block's Q (next_q), or an entry of zero rows when the list is
    // done. A static stride of the grid instead measured 7-17 % slower than one block per entry
    // at batch 1 (each stride of the longest-first list, cut in sections, gives its first CTA
    // the heaviest block, every stride; H100, reports/NOTES.md, session 24). Q comes by TMA
    // only (the host keeps q_tma on).
    //
    // Async (FlashDecoding++ §3): a block's recompute vote is known only at its end, so the
    // producer reads it one block late, after it has streamed the next block, and then streams
    // the flagged block again as a block of its own (its Q reloaded, te.w = 1 + the vote's
    // parity), which the consumers walk with the sync scheme, storing only the flagged rows.
    // Waiting for the vote before the next block instead would leave the ring empty across
    // every block's end, which is what the persistent kernel is for.
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        produce(c, it, first, issued0);
        int4 ptv = tv, pte = te;  // async: the produced block whose vote is still to be read
        int j = 1;                // blocks handed to the consumers, redos included
        for (int n = 1;; ++n) {
            // The ticket to the whole producer warpgroup through a word per ticket parity: the
            // barrier of ticket n + 1 orders every read of the word of ticket n before its rewrite.
            if (threadIdx.x == 0) smem_st(c.ticket_word(n & 1), gridDim.x + atomicAdd(sched, 1u));
            named_sync(5, 128);
            const int e = (int)smem_ld(c.ticket_word(n & 1));
            int4 ntv{}, nte{};
            if (e < nblocks) {
                ntv = blocks[2 * e];
                nte = blocks[2 * e + 1];
                // About the entry this CTA's next ticket will name, into L2 meanwhile.
                if (threadIdx.x == 0 && e + (int)gridDim.x < nblocks)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(blocks + 2 * (e + gridDim.x)));
                next_block(c, it, j++, ntv, nte, table, max_pages, qmap);
            }
            if (ASYNC) {
                // Vote n − 1 (of the CTA's async block n − 1) is on the barrier of its parity;
                // thread 0 reads it and clears the word before block n + 1, whose vote reuses
                // it, is streamed.
                const int p = (n - 1) & 1;
                if (threadIdx.x == 0) {
                    mbar_wait(c.vote_bar(p), (u32)((n - 1) >> 1) & 1u);
                    smem_st(c.redo_word(), smem_ld(c.vote_word(p)));
                    smem_st(c.vote_word(p), 0);
                }
                named_sync(5, 128);
                if (smem_ld(c.redo_word())) {
                    pte.w = 1 + p;
                    next_block(c, it, j++, ptv, pte, table, max_pages, qmap);
                }
                ptv = ntv;
                pte = nte;
            }
            if (e >= nblocks) {
                c.qb = j % QBUF;
                if (threadIdx.x < 32) next_q(c, nullptr, int4{0, 0, 0, 0}, int4{0, 0, 0, 0}, (u32)(j / QBUF - 1) & 1u);
                break;
            }
        }
        cp_async_wait<0>();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    {
        Walker k;
        k.w = wg - 1;
        k.lane = threadIdx.x % 32;
        k.tq = k.lane % 4;
        k.scale2 = scale2;
        k.phi2 = phi2;
        k.b2 = b2;
        u32 flags = 0;  // async: this thread's flagged rows of the CTA's last two async blocks, two bits per vote parity
        int votes = 0;  // async blocks walked
        for (int j = 0;; ++j) {
            c.qb = j % QBUF;
            mbar_wait(c.q_bar(), (u32)(j / QBUF) & 1u);
            int redo = 0;
            if (j > 0) {
                // The entry through lane 0: uniform values keep the walk's loop bounds and
                // descriptors in the uniform datapath (see `wg` above).
                const int4 ntv = shfl_entry(c.entry_at()), nte = shfl_entry(c.entry_at() + 16);
                if (ntv.w <= 0) {
                    // The list is done. Warpgroup 0 takes warpgroup 1's arrival after the
                    // previous block's last turn (chain_out), so no arrival is left pending.
                    if (FDPP_PINGPONG && k.w == 0) named_sync(3, 256);
                    break;
                }
                set_block(c, ntv, nte, table, max_pages);
                redo = nte.w;
            }
            set_walker(k, c);
            k.chain_in = j > 0;
            k.chain_out = true;
            Rows st;
            const Ctx& cc = c;
            const auto q_done = [&]() { mbar_arrive(cc.q_empty()); };
            if (!ASYNC || redo) {
                walk<false>(c, k, it, st, q_done);
                const u32 mask = ASYNC ? (flags >> (2 * (redo - 1))) & 3u : 3u;
                store(c, k.w, st, out, mask);
                // One lane per quad counts its rows.
                if (ASYNC && k.lane % 4 == 0 && mask) atomicAdd(recomputed, __popc(mask));
            } else {
                walk<true>(c, k, it, st, q_done);
                const u32 bad = flagged_rows(c, k.w, st, phi2, a2);
                store(c, k.w, st, out, ~bad & 3u);
                const int p = votes & 1;
                if (bad) smem_or(c.vote_word(p), 1u);
                mbar_arrive(c.vote_bar(p));
                flags = (flags & ~(3u << (2 * p))) | (bad << (2 * p));
                ++votes;
            }
        }
    }
    return;
#endif
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        produce(c, it, first, issued0);
        if (ASYNC) {
            mbar_wait(c.vote_bar(), 0);
            if (smem_ld(c.vote_word())) produce(c, it, first_lookup(c), false);
        }
        // Leave no copy in flight behind an exited thread.
        cp_async_wait<0>();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    const int w = wg - 1;
    if (q_tma) {
        mbar_wait(c.q_bar(), 0);
    } else {
        cp_async_wait<0>();
        fence_async_smem();
        named_sync(1 + w, 128);
    }
    TRACE(const long long tcq = clock64();)
    Walker k;
    k.w = w;
    k.lane = threadIdx.x % 32;
    k.tq = k.lane % 4;
    set_walker(k, c);
    k.scale2 = scale2;
    k.phi2 = phi2;
    k.b2 = b2;
    Rows st;
    TRACE(st.tk0 = 0;)
    walk<ASYNC>(c, k, it, st);
    TRACE(const long long tcw = clock64(); const long long tk0 = st.tk0;
          auto trace = [&]() {
              const int rec = 2 * (int)blockIdx.x + w;
              if (threadIdx.x % 128 == 0 && rec < TRACE_CAP) {
                  unsigned smid;
                  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
                  unsigned long long* r = fdpp_trace + TRACE_WORDS * (size_t)rec;
                  r[0] = (unsigned long long)blockIdx.x | ((unsigned long long)smid << 32) | ((unsigned long long)w << 48) | (1ull << 56);
                  r[1] = (unsigned long long)c.tiles_of(w) | ((unsigned long long)c.h << 16) | ((unsigned long long)c.pos0 << 32);
                  r[2] = tg0;
                  r[3] = tcq - tc0;
                  r[4] = (long long)smem_ld64(c.trace_slot()) - tc0;
                  r[5] = tk0 - tc0;
                  r[6] = tcw - tc0;
                  r[7] = clock64() - tc0;
                  r[8] = (long long)smem_ld64(c.trace_slot_box()) - tc0;
                  r[9] = tct - tc0;
                  r[10] = tcpre - tc0;
              }
          };)
    if (!ASYNC) {
        store(c, w, st, out, 3u);
        TRACE(trace();)
        return;
    }
    const int lane = threadIdx.x % 32;
    const u32 bad = flagged_rows(c, w, st, phi2, a2);
    store(c, w, st, out, ~bad & 3u);
    // The vote: the producer waits on the same mbarrier and, when any row is flagged, streams the
    // keys again.
    if (bad) smem_or(c.vote_word(), 1u);
    mbar_arrive(c.vote_bar());
    mbar_wait(c.vote_bar(), 0);
    if (smem_ld(c.vote_word())) {
        walk<false>(c, k, it, st);
        store(c, w, st, out, bad);
        // One lane per quad counts its rows.
        if (lane % 4 == 0 && bad) atomicAdd(recomputed, __popc(bad));
    }
    TRACE(trace();)
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attn_prefill_hopper_sync(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                         const int* __restrict__ table, const int4* __restrict__ blocks, int max_pages, int page_size,
                         int H, int G, int entry_ahead, int q_tma, int nblocks, unsigned* __restrict__ sched, float scale2, u16* __restrict__ out,
                         const __grid_constant__ TmaMap kmap, const __grid_constant__ TmaMap vmap, int tma_rows,
                         const __grid_constant__ TmaMap kmap_run, const __grid_constant__ TmaMap vmap_run,
                         const __grid_constant__ TmaMap qmap) {
    prefill<false>(q, kp, vp, table, blocks, max_pages, page_size, H, G, entry_ahead, q_tma, nblocks, sched, scale2, 0.f, 0.f, 0.f, nullptr, out,
                   &kmap, &vmap, tma_rows, &kmap_run, &vmap_run, &qmap);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attn_prefill_hopper_async(const u16* __restrict__ q, const u16* __restrict__ kp, const u16* __restrict__ vp,
                          const int* __restrict__ table, const int4* __restrict__ blocks, int max_pages, int page_size,
                          int H, int G, int entry_ahead, int q_tma, int nblocks, unsigned* __restrict__ sched, float scale2, float phi2, float a2, float b2,
                          unsigned* __restrict__ recomputed, u16* __restrict__ out, const __grid_constant__ TmaMap kmap,
                          const __grid_constant__ TmaMap vmap, int tma_rows, const __grid_constant__ TmaMap kmap_run,
                          const __grid_constant__ TmaMap vmap_run, const __grid_constant__ TmaMap qmap) {
    prefill<true>(q, kp, vp, table, blocks, max_pages, page_size, H, G, entry_ahead, q_tma, nblocks, sched, scale2, phi2, a2, b2, recomputed,
                  out, &kmap, &vmap, tma_rows, &kmap_run, &vmap_run, &qmap);
}
