// A persistent Hopper (sm_90a) GEMM y[M, N] = x[M, K] · W[N, K]ᵀ in fdpp's linear layout (both
// operands K-major, as HF stores W), with the small ops of a Llama layer as optional epilogues
// (see Epi). FlashAttention-3's warp specialisation (Shah et al. 2024, §3.1) applied to a GEMM,
// on the plumbing of hopper.cuh:
// - a persistent grid (one CTA per SM) walks 128 × BN output tiles, M fastest, so the CTAs in
//   flight share few W tiles and x stays in L2;
// - warpgroup 0 gives its registers back and issues TMA loads of 64-wide K blocks of x and W
//   into a ring of STAGES stages (128-byte swizzle), completing on each stage's "full"
//   mbarrier; for SwiGLU the W block is two boxes, BN/2 gate rows and the same BN/2 up rows;
// - warpgroups 1 and 2 each own 64 rows of the tile: m64nBNk16 wgmma from shared memory, one
//   commit group per K block, the previous block's stage released (its "empty" mbarrier) once
//   wait_group 1 says its wgmmas are done; the epilogue works on the fp32 accumulators in
//   registers and leaves through shared memory (the staged epilogue, below).
//
// Why (reports/NOTES.md, sessions 26, 30, 31): at a 1024-token prompt Llama2-7B's prefill spends
// 17.5 ms in cuBLAS and 1.8 ms in silu_mul, add_rmsnorm and qkv_rope, each at the card's streaming
// rate; only a GEMM that takes them as epilogues, which cuBLAS cannot, removes them.
//
// The engine's entries (below): gemm_hopper, the plain product (ImplC on sm_90a), and
// gemm_hopper_epi, one epilogue per build (FDPP_EPI), with row_sumsq and rope_table beside it: the
// prefill's fused layer (src/backend/cuda/gemm_epi.rs). scripts/hopper_gemm.cu times every
// epilogue against cuBLAS plus fdpp's own small ops.
#include "common.cuh"
#include "hopper.cuh"

// EPI_NONE stores nothing: the main loop and the pipeline alone, timed beside the others to show
// what an epilogue costs (scripts/hopper_gemm.cu; not checked).
// The RMSNorm between the residual add and the next linear, taken apart (its γ folded into the
// next W, as fdpp's fused GEMV path does): EPI_RES_SS writes each stored row's sum of squares
// over the tile's columns to ss[tn][row] (the O and FFN2 GEMMs: one partial per column tile, no
// atomics, so the sum's order and the result are the same on every run), and EPI_STORE_RS /
// EPI_GLU_RS scale row r of their product by 1/rms = 1/sqrt(Σ_t ss[t][r]/K + eps) (QKV, FFN1),
// which is rmsnorm(x)·W'ᵀ since the scale is per row. With them a Llama layer runs no
// add_rmsnorm and no silu_mul.
// Roundings, as the fused GEMV's (gemv.cu) so that each epilogue is its unfused pair bit for bit
// on the same tile: EPI_RES stores round(res + round(acc)) (the plain product, then add_rmsnorm's
// add), the GLU silu(round(g))·round(u) (the product, then silu_mul), the rotary rotates the
// rounded product with qkv_rope's arithmetic. The one exception is the SiLU itself (silu_fast,
// below): the GLU's outputs match silu_mul's to within an ulp, most of them bit for bit.
// EPI_QKV_ROPE is QKV's whole tail: the 1/rms scale, the rotary of q and k heads (HF Llama's
// rotate-half: d pairs with d + D/2, which one thread holds as accumulator groups i and i + 8),
// q to its buffer and k, v straight to their slot rows of the paged pools, as fdpp's qkv_rope
// does after the GEMM today.
enum Epi { EPI_STORE = 0, EPI_GLU = 1, EPI_RES = 2, EPI_NONE = 3, EPI_STORE_RS = 4, EPI_GLU_RS = 5, EPI_RES_SS = 6, EPI_QKV_ROPE = 7 };
constexpr int HD = 128;  // head_dim of the rotary epilogue
__host__ __device__ constexpr bool is_glu(int e) { return e == EPI_GLU || e == EPI_GLU_RS; }
__host__ __device__ constexpr bool is_res(int e) { return e == EPI_RES || e == EPI_RES_SS; }
__host__ __device__ constexpr bool row_scaled(int e) { return e == EPI_STORE_RS || e == EPI_GLU_RS || e == EPI_QKV_ROPE; }

// FDPP_GEMM_PDL (the engine's fused-prefill entries, launched chained: src/backend/cuda/launch.rs):
// every thread lets the next kernel launch at once and waits for the previous one before it reads
// or writes activations; the producer first loads the W boxes of its first tile's first stages
// (weights: no kernel writes them), so that a GEMM's set-up and first W reads run under the
// previous kernel's tail instead of after it.
#ifndef FDPP_GEMM_PDL
#define FDPP_GEMM_PDL 0
#endif

constexpr int BM = 128;  // rows of a tile: two consumer warpgroups of 64
constexpr int BK = 64;   // K of a stage: one 128-byte swizzle row of 16-bit elements
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;  // 128·40 + 256·232 = 64512 ≤ 65536

struct Args {
    u16* y;
    const u16* res;  // EPI_RES: added to the product (may be y itself)
    float* ss;       // [parts][M]: EPI_RES_SS writes Σ y² of each row's tile (parts = tiles_n); *_RS read
    float eps;
    // EPI_QKV_ROPE: H q heads and G kv heads of HD; cos/sin [M][HD/2] of each row's position;
    // q [M][H·HD]; the pools [slots][G·HD]; each row's slot.
    const float2* cs;
    u16 *q, *kpool, *vpool;
    const int* slots;
    int H, G;
    int M, N, K;     // N: columns of y (the intermediate width for EPI_GLU)
    int tiles_m, tiles_n;
    int nparts;      // *_RS: partial sums of squares per row in ss
};

// The 16-bit value a rounded store and reload of f gives (the unfused op's stored output).
__device__ __forceinline__ float rnd16(float f) { return to_f32(from_f32(f)); }

// The row scales of the *_RS epilogues: 1/rms of row r = 1/sqrt(Σ_t ss[t][r]/K + eps), summed in
// the order t = 0, 1, ... (add_rmsnorm_v's formula), are computed by warp 1 of the producer
// warpgroup, otherwise idle, a tile ahead of the consumers: BM floats per tile in one of two
// shared buffers, handed over by mbarriers (full: the warp's 32 arrivals; empty: the 256 consumer
// threads'). Why: the consumers summed their rows' parts in their first K block, and with the
// engine's 16-32 parts a row (one per column tile of the O or FFN2 GEMM before) their L2 and DRAM
// round trips kept the warpgroup from issuing wgmmas while one K block ran (the SwiGLU·1/rms tile
// took 15 µs more per Llama2-7B FFN1 than the same tile without the scale; reports/NOTES.md,
// session 36).
constexpr u32 RS_BUF_BYTES = BM * 4;  // one tile's row scales
template <int EPI>
__host__ __device__ constexpr u32 row_scale_bytes() {
    return row_scaled(EPI) ? 32 + 2 * RS_BUF_BYTES : 0;  // four barriers, two buffers
}

// CL CTAs of a cluster take CL tiles stacked along M that share their W block: each loads 1/CL
// of it and multicasts it to all (TMA .multicast::cluster), so a CTA pulls A + B/CL bytes of a
// K block through L2 instead of A + B (B is twice A at BN = 256).
template <int BN, int EPI, int CL>
struct Tile {
    static constexpr int OUT_N = is_glu(EPI) ? BN / 2 : BN;  // columns of y a tile writes
    // W rows of one TMA box: GLU loads gate and up as two boxes (rank 0 and 1 of a pair);
    // otherwise one box, or a half per rank.
    static constexpr int W_BOX = is_glu(EPI) || CL == 2 ? BN / 2 : BN;
    static constexpr u32 A_BYTES = BM * BK * 2;
    static constexpr u32 B_BYTES = BN * BK * 2;
    static constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
};

// The epilogue is staged: each consumer warpgroup writes its 64 rows of the tile, 64 columns
// at a time, into one of two 8 KiB shared buffers (the 128-byte swizzle: conflict-free for the
// accumulator layout) and one thread hands the buffer to a TMA store, which runs on while the
// warpgroup goes on to the next chunk and the next tile's main loop (CUTLASS's TMA epilogue).
// The residual comes the same way, a TMA load into the buffer, the first two issued halfway
// through the tile's main loop. Direct 4-byte stores from the accumulators kept the tensor
// cores idle until the last store had left: 5-8 us of a 46 us tile (reports/NOTES.md, session
// 31), the staged form 0.5-3 %.
// A chunk is 64 columns (128-byte rows, 128-byte swizzle) where the tile's output width allows,
// else 32 (64-byte rows, 64-byte swizzle: the 96 columns of a 128 x (96 + 96) SwiGLU tile).
constexpr int CH = 64;                    // the rotary's chunk: half a head
constexpr u32 CHUNK_BYTES = 64 * CH * 2;  // 64 rows of it: 8 KiB
template <int BN, int EPI>
struct Stage {
    static constexpr int OUT_N = Tile<BN, EPI, 1>::OUT_N;
    static constexpr int CW = OUT_N % 64 == 0 ? 64 : 32;  // columns of a chunk
    static constexpr int NCH = OUT_N / CW;
    static constexpr u32 BYTES = 64 * CW * 2;              // a warpgroup's 64 rows of a chunk
    static_assert(OUT_N % CW == 0, "whole chunks");
};

// EPI_NONE stages nothing (its 128 x 192 tile would not fit beside 5 stages with the buffers).
template <int BN, int EPI>
__host__ __device__ constexpr u32 staging_bytes() {
    return EPI == EPI_NONE ? 0 : 4 * Stage<BN, EPI>::BYTES;
}

// The stages, two staging buffers per consumer warpgroup, the stages' barriers and the four
// residual barriers, and the slack that aligns the base to 1024 (src/backend/cuda/gemm_hopper.rs
// computes the same).
template <int BN, int STAGES, int EPI, int CL>
__host__ __device__ constexpr size_t smem_bytes() {
    return (size_t)STAGES * Tile<BN, EPI, CL>::STAGE_BYTES + staging_bytes<BN, EPI>() + 16 * STAGES + 32 + row_scale_bytes<EPI>() + 1024;
}

__device__ __forceinline__ void tma_store_2d(const TmaMap* map, u32 src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(reinterpret_cast<u64>(map)),
                 "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most N of this thread's committed TMA stores still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ uint4 smem_ld16(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

// A consumer warpgroup's staging state (uniform over its threads).
struct Staging {
    u32 buf;   // its two buffers: buf and buf + Stage::BYTES
    u32 rbar;  // their residual loads' barriers: rbar and rbar + 8
    u32 n;     // chunks it has staged so far: the next one goes to buffer n & 1
    u32 rph;   // bit b: the parity of buffer b's next residual load
};

// mbar_wait, or with HG_WATCHDOG_CYCLES defined non-zero (the experiment, scripts/hopper_gemm.cu)
// one that gives up: a trap (the launch fails with an illegal-instruction error) ends the process
// where a deadlock would hang it. No printf: a call there would serialise the wgmmas and void
// setmaxnreg (ptxas C7510 / C7507). The watchdog's clock reads cost registers: with it, nvcc
// spills the rotary and SwiGLU 128 × 256 tiles (~1 KB), which the engine's build does not, so
// the harness times a build with HG_WATCHDOG_CYCLES=0.
__device__ __forceinline__ void wait_or_trap(u32 bar, u32 parity) {
#if defined(HG_WATCHDOG_CYCLES) && HG_WATCHDOG_CYCLES > 0
    if (mbar_try_wait(bar, parity)) return;
    const long long t0 = clock64();
    while (!mbar_try_wait(bar, parity))
        if (clock64() - t0 > HG_WATCHDOG_CYCLES) __trap();
#else
    mbar_wait(bar, parity);
#endif
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrive on the mbarrier at the same shared offset in cluster CTA `rank`. Its default CTA-scope
// release is enough: what it publishes is that this warp's wgmmas have finished reading the
// stage (wait_group), not data; `.release.cluster` put a MEMBAR.ALL.GPU before every arrival.
__device__ __forceinline__ void mbar_arrive_remote(u32 bar, u32 rank) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [ra];\n}" ::"r"(bar),
        "r"(rank)
        : "memory");
}
// TMA multicast: the box lands at dst in every CTA of `mask`, completing on each one's bar.
__device__ __forceinline__ void tma_load_2d_mc(u32 dst, const TmaMap* map, u32 bar, int c0, int c1, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
        : "memory");
}

// S = A·B (+ S when `acc`): m64n192k16, A and B from shared memory, both K-major (the SwiGLU
// tile of 96 gate and 96 up columns: FFN1's 11008 columns in 6.97 waves on 132 SMs, where 128 + 128 fill 5.21).
__device__ __forceinline__ void wgmma_ss_n192(float (&d)[96], u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32." WG_T "." WG_T " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
        "%96, %97, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(acc));
}

template <int BN>
__device__ __forceinline__ void mma_block(float (&acc)[BN / 2], u64 da, u64 db, bool first) {
#pragma unroll
    for (int k = 0; k < BK / 16; ++k) {
        // +32 bytes along K inside the swizzle atom: +2 in the descriptor's address field.
        if constexpr (BN == 256) {
            wgmma_ss_n256(acc, da + 2 * k, db + 2 * k, !(first && k == 0));
        } else if constexpr (BN == 192) {
            wgmma_ss_n192(acc, da + 2 * k, db + 2 * k, !(first && k == 0));
        } else {
            wgmma_ss_n128(acc, da + 2 * k, db + 2 * k, !(first && k == 0));
        }
    }
}

// The accumulator layout of m64nN (PTX ISA, wgmma D fragments): warp q of the warpgroup holds
// rows 16q + lane/4 and +8; element 4i + {0,1} is (row, 8i + 2·(lane%4) + {0,1}), 4i + {2,3}
// the same columns 8 rows down.

// SiLU through the fast exponential and division (two MUFU ops and two multiplies) instead of
// common.cuh's expf and IEEE division: with those, the 48 SiLUs a thread computes in a
// 128 x (96 + 96) tile's epilogue took ~4 us of it while the tensor cores idled (2 warps per
// scheduler, so latency-bound); this form cut the SwiGLU epilogue's cost over the bare main loop
// from 34 to 11 us per Llama2-7B FFN1 at M = 1024 (reports/NOTES.md, session 34). Its error, a
// few fp32 ulp for |g| < 80, is far below a 16-bit output's rounding; past that 1 + e^-g
// overflows and both forms give -0. common.cuh keeps the accurate form: it is hashed into the
// shipped tuning profiles (the GEMV's GLU uses it), and silu_mul must keep agreeing with that GLU.
__device__ __forceinline__ float silu_fast(float g) { return __fdividef(g, 1.f + __expf(-g)); }

// pack2 of layer.cu, which this file does not include.
__device__ __forceinline__ u32 pack_pair(float lo, float hi) { return (u32)from_f32(lo) | ((u32)from_f32(hi) << 16); }

// EPI_NONE: ptxas drops wgmmas whose results are unused (it left one HGMMA.64x8x16 on RZ), so
// every accumulator feeds a sum that is stored only if it is exactly 1e30, which it never is.
template <int BN>
__device__ __forceinline__ void none_epilogue(const Args& a, const float (&acc)[BN / 2]) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) sum += acc[i];
    if (sum == 1e30f) a.y[0] = 0;
}

// The byte of (row rr of the warpgroup's 64, column pair of accumulator group ii of a chunk) in
// a staging buffer, as the TMA's swizzle lays the box out: CW = 64, 128 bytes a row, the 16-byte
// group XORed with rr % 8 (128-byte swizzle); CW = 32, 64 bytes a row, XORed with (rr / 2) % 4
// (64-byte swizzle: address bits 4-5 with bits 7-8). rr % 8 is lane / 4 for every row a thread
// holds; either way a warp's 32 stores hit 32 banks.
template <int CW>
__device__ __forceinline__ u32 stage_at(u32 buf, int rr, int ii, int lane) {
    if constexpr (CW == 64) return buf + rr * 128 + ((ii ^ (lane / 4)) << 4) + 4 * (lane % 4);
    else return buf + rr * 64 + ((ii ^ ((lane / 8) & 3)) << 4) + 4 * (lane % 4);
}

// Leader of the warpgroup, halfway through a tile's main loop: the residual of its first two
// chunks into the two buffers, once the previous tile's stores have read them.
// A box wholly past the last row (a cluster pair's spare tile, whose results are never stored)
// loads the last row's box instead: whether TMA completes the bytes of a box wholly outside the
// tensor is not something to rely on.
template <int BN, int EPI>
__device__ __forceinline__ void prefetch_residual(const Staging& st, const TmaMap* rmap, int tm, int tn, int w, int M) {
    using S = Stage<BN, EPI>;
    const int row0 = min(tm * BM + w * 64, M - 1);
    bulk_wait_read<0>();
#pragma unroll
    for (int c = 0; c < (S::NCH < 2 ? S::NCH : 2); ++c) {
        const u32 b = (st.n + c) & 1;
        mbar_arrive_expect_tx(st.rbar + 8 * b, S::BYTES);
        tma_load_2d(st.buf + b * S::BYTES, rmap, st.rbar + 8 * b, tn * S::OUT_N + c * S::CW, row0);
    }
}

// STORE, GLU, RES and their norm forms (see Epi) through the staging buffers and TMA stores,
// which clip rows past M and columns past N.
// rs: 1/rms of the thread's two rows (row_scaled epilogues; 1 otherwise), from row_scales.
template <int BN, int EPI>
__device__ __forceinline__ void staged_epilogue(const Args& a, const float (&acc)[BN / 2], int tm, int tn, int w, Staging& st,
                                                const TmaMap* ymap, const TmaMap* rmap, const float (&rs)[2]) {
    using S = Stage<BN, EPI>;
    constexpr int OUT_N = S::OUT_N, NCH = S::NCH, CW = S::CW, PAIRS = OUT_N / 8;
    const int lane = threadIdx.x % 32, q = (threadIdx.x / 32) % 4;
    const bool leader = threadIdx.x % 128 == 0;
    const int row0 = tm * BM + w * 64;
    float sq[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NCH; ++j, ++st.n) {
        const u32 b = st.n & 1, buf = st.buf + b * S::BYTES;
        if constexpr (is_res(EPI)) {
            // Its load was issued only after the store that last read the buffer was done.
            wait_or_trap(st.rbar + 8 * b, (st.rph >> b) & 1);
            st.rph ^= 1u << b;
        } else {
            if (leader) bulk_wait_read<1>();  // the store of two chunks ago has read this buffer
            named_sync(1 + w, 128);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rr = q * 16 + lane / 4 + 8 * h;
#pragma unroll
            for (int ii = 0; ii < CW / 8; ++ii) {
                const int i = j * (CW / 8) + ii;
                const u32 at = stage_at<CW>(buf, rr, ii, lane);
                float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
                if constexpr (is_glu(EPI)) {
                    v0 = silu_fast(rnd16(rs[h] * v0)) * rnd16(rs[h] * acc[4 * (i + PAIRS) + 2 * h]);
                    v1 = silu_fast(rnd16(rs[h] * v1)) * rnd16(rs[h] * acc[4 * (i + PAIRS) + 2 * h + 1]);
                } else if constexpr (is_res(EPI)) {
                    float r0f, r1f;
                    unpack2(smem_ld(at), r0f, r1f);
                    v0 = r0f + rnd16(v0);
                    v1 = r1f + rnd16(v1);
                } else {
                    v0 *= rs[h];
                    v1 *= rs[h];
                }
                const u32 out = pack_pair(v0, v1);
                smem_st(at, out);
                if constexpr (EPI == EPI_RES_SS) {
                    float q0, q1;
                    unpack2(out, q0, q1);
                    sq[h] += q0 * q0 + q1 * q1;
                }
            }
        }
        fence_async_smem();  // the generic writes, before the TMA (async proxy) reads them
        named_sync(1 + w, 128);
        if (leader) {
            tma_store_2d(ymap, buf, tn * OUT_N + j * CW, row0);
            bulk_commit();
            if constexpr (is_res(EPI)) {
                if (j + 2 < NCH) {
                    bulk_wait_read<0>();
                    mbar_arrive_expect_tx(st.rbar + 8 * b, S::BYTES);
                    tma_load_2d(buf, rmap, st.rbar + 8 * b, tn * OUT_N + (j + 2) * CW, min(row0, a.M - 1));
                }
            }
        }
    }
    if constexpr (EPI == EPI_RES_SS) {
        const unsigned quad = 0xfu << (lane & ~3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = sq[h];
            v += __shfl_xor_sync(quad, v, 1);
            v += __shfl_xor_sync(quad, v, 2);
            const int r = row0 + q * 16 + lane / 4 + 8 * h;
            if (lane % 4 == 0 && r < a.M) a.ss[(size_t)tn * a.M + r] = v;
        }
    }
}

// EPI_QKV_ROPE staged: a head at a time, its two halves (d < 64, d >= 64) rotated into the two
// buffers, then read back as 16-byte rows pieces and stored whole (a warp writes two 256-byte
// head rows) to q or to the row's slot of a pool; no TMA, since the pool rows are scattered.
template <int BN>
__device__ __forceinline__ void staged_rope(const Args& a, const float (&acc)[BN / 2], int tm, int tn, int w, const Staging& st,
                                            const float (&rs)[2]) {
    static_assert(BN % HD == 0 && HD == 2 * CH, "a tile holds whole heads, a head two chunks");
    const int lane = threadIdx.x % 32, q = (threadIdx.x / 32) % 4, t = threadIdx.x % 128;
    const int row0 = tm * BM + w * 64;
    // The pool slots of the 8 rows this thread stores in the read-back (the same rows for every
    // head of the tile), in one burst: loaded beside each store, they waited on L2 one at a time
    // (the shared-memory asm between them keeps the compiler from hoisting them).
    int slot[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int r = row0 + (t + 128 * k) / 16;
        slot[k] = r < a.M ? a.slots[r] : 0;
    }
#pragma unroll
    for (int hh = 0; hh < BN / HD; ++hh) {
        const int head = (tn * BN) / HD + hh;
        if (head >= a.H + 2 * a.G) break;  // uniform: the tile's heads past the last
        const bool rot = head < a.H + a.G;
        named_sync(1 + w, 128);  // the previous head's read-back is done with the buffers
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rr = q * 16 + lane / 4 + 8 * h, r = row0 + rr;
            // The row's (cos, sin) of its 8 column pairs, in one burst (as the slots above).
            float4 cs[8];
            if (rot && r < a.M) {
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    cs[i] = *reinterpret_cast<const float4*>(a.cs + (size_t)r * (HD / 2) + 8 * i + 2 * (lane % 4));
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int g1 = 4 * (hh * 16 + i) + 2 * h, g2 = 4 * (hh * 16 + i + 8) + 2 * h;
                // qkv_rope's input is the product as stored (16 bits); its arithmetic: _rn products
                // (no FMA contraction), the angles' sincosf values from rope_table.
                float x1[2] = {rnd16(rs[h] * acc[g1]), rnd16(rs[h] * acc[g1 + 1])};
                float x2[2] = {rnd16(rs[h] * acc[g2]), rnd16(rs[h] * acc[g2 + 1])};
                if (rot && r < a.M) {
                    const float c[2] = {cs[i].x, cs[i].z}, sn[2] = {cs[i].y, cs[i].w};
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float o1 = __fsub_rn(__fmul_rn(x1[j], c[j]), __fmul_rn(x2[j], sn[j]));
                        const float o2 = __fadd_rn(__fmul_rn(x2[j], c[j]), __fmul_rn(x1[j], sn[j]));
                        x1[j] = o1;
                        x2[j] = o2;
                    }
                }
                smem_st(stage_at<CH>(st.buf, rr, i, lane), pack_pair(x1[0], x1[1]));
                smem_st(stage_at<CH>(st.buf + CHUNK_BYTES, rr, i, lane), pack_pair(x2[0], x2[1]));
            }
        }
        named_sync(1 + w, 128);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int v = t + 128 * k, row = v / 16, part = v % 16, r = row0 + row;
            if (r >= a.M) continue;
            const uint4 val = smem_ld16(st.buf + (part / 8) * CHUNK_BYTES + row * 128 + (((part % 8) ^ (row & 7)) << 4));
            u16* dst = head < a.H         ? a.q + (size_t)r * a.H * HD + head * HD
                       : head < a.H + a.G ? a.kpool + (size_t)slot[k] * a.G * HD + (head - a.H) * HD
                                          : a.vpool + (size_t)slot[k] * a.G * HD + (head - a.H - a.G) * HD;
            *reinterpret_cast<uint4*>(dst + part * 8) = val;
        }
    }
}

// The kernel, for a __global__ entry of 384 threads (__launch_bounds__(THREADS, 1)) to call with
// its __grid_constant__ maps: x [M, K] in boxes of 64 × BM; W [N, K] (GLU: its gate rows, and
// umap its up rows) in boxes of 64 × W_BOX; y and the residual [M, N] in boxes of CW × 64.
// The grid is persistent: at most one CTA (CL = 2: cluster) per SM, each walking tiles.
template <int BN, int STAGES, int EPI, int CL>
__device__ __forceinline__ void hgemm_body(const TmaMap& xmap, const TmaMap& wmap, const TmaMap& umap, const TmaMap& ymap,
                                           const TmaMap& rmap, const Args& a) {
    using T = Tile<BN, EPI, CL>;
    static_assert(CL == 1 || CL == 2, "clusters of one or two CTAs");
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms are 1024-aligned
    const u32 stg = base + STAGES * T::STAGE_BYTES;  // the staging buffers (1024-aligned)
    const u32 bars = stg + staging_bytes<BN, EPI>();
    auto sa = [&](int s) { return base + s * T::STAGE_BYTES; };
    auto sb = [&](int s) { return base + s * T::STAGE_BYTES + T::A_BYTES; };
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (STAGES + s); };
    // The row scales (row_scaled epilogues): buffer b's barriers and floats.
    const u32 rsb = bars + 16 * STAGES + 32;
    auto rs_full = [&](int b) { return rsb + 8 * b; };
    auto rs_empty = [&](int b) { return rsb + 16 + 8 * b; };
    auto rs_buf = [&](int b) { return rsb + 32 + b * RS_BUF_BYTES; };
    const int kblocks = (a.K + BK - 1) / BK;  // TMA fills K past the edge with zeros
    // Warpgroup-uniform through a shuffle, so that ptxas keeps what derives from it (descriptors,
    // ring indices) in uniform registers (reports/NOTES.md, session 7).
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);
    const u32 rank = CL == 2 ? cluster_rank() : 0;
    // A cluster walks pairs of tiles (tm = 2·pair_m + rank) of one W block; a lone CTA, tiles.
    const int pairs_m = (a.tiles_m + CL - 1) / CL, units = pairs_m * a.tiles_n;
    const int unit0 = blockIdx.x / CL, unit_step = gridDim.x / CL;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);            // the producer's arrival, with the stage's bytes
            mbar_init(empty(s), 2 * 4 * CL);  // one arrival per consumer warp of the cluster
        }
        for (int i = 0; i < 4; ++i) mbar_init(bars + 16 * STAGES + 8 * i, 1);  // residual loads
        if constexpr (row_scaled(EPI)) {
            for (int b = 0; b < 2; ++b) {
                mbar_init(rs_full(b), 32);
                mbar_init(rs_empty(b), 256);
            }
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (CL == 2) cluster_sync();  // the peer's barriers exist before anything lands on them
    else __syncthreads();
    if constexpr (FDPP_GEMM_PDL) pdl_trigger();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        if (threadIdx.x == 0) {
            // Stage s's W boxes of K block kb of column tile tn, completing on full(s).
            auto load_w = [&](int s, int kb, int tn) {
                if constexpr (CL == 1) {
                    tma_load_2d(sb(s), &wmap, full(s), kb * BK, tn * T::W_BOX);
                    if constexpr (is_glu(EPI)) tma_load_2d(sb(s) + T::W_BOX * 128, &umap, full(s), kb * BK, tn * T::W_BOX);
                } else if constexpr (is_glu(EPI)) {
                    // rank 0 the gate rows, rank 1 the up rows, each to both CTAs.
                    tma_load_2d_mc(sb(s) + rank * T::W_BOX * 128, rank ? &umap : &wmap, full(s), kb * BK, tn * T::W_BOX, 3);
                } else {
                    tma_load_2d_mc(sb(s) + rank * T::W_BOX * 128, &wmap, full(s), kb * BK, tn * BN + rank * T::W_BOX, 3);
                }
            };
            // With PDL: the first tile's first stages' W before the wait (they hold no output of
            // the previous kernel), each stage armed for its whole bytes, x to follow.
            const int pre = FDPP_GEMM_PDL && unit0 < units ? min(STAGES, kblocks) : 0;
            for (int kb = 0; kb < pre; ++kb) {
                mbar_arrive_expect_tx(full(kb), T::STAGE_BYTES);
                load_w(kb, kb, unit0 / pairs_m);
            }
            if constexpr (FDPP_GEMM_PDL) pdl_wait();
            int it = 0;
            for (int u = unit0; u < units; u += unit_step) {
                // A pair's second tile past the last M tile loads the last one's rows (its
                // results are never stored) rather than a box wholly outside the tensor.
                const int tm = min((u % pairs_m) * CL + (int)rank, a.tiles_m - 1), tn = u / pairs_m;
                for (int kb = 0; kb < kblocks; ++kb, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) wait_or_trap(empty(s), ((it / STAGES) - 1) & 1);
                    if (it >= pre) mbar_arrive_expect_tx(full(s), T::STAGE_BYTES);
                    tma_load_2d(sa(s), &xmap, full(s), kb * BK, tm * BM);
                    if (it >= pre) load_w(s, kb, tn);
                }
            }
        } else {
            if constexpr (FDPP_GEMM_PDL) pdl_wait();  // before the row sums are read
            if constexpr (row_scaled(EPI)) {
                if (threadIdx.x / 32 == 1) {
                    // Tile j's rows' scales into buffer j % 2, the tiles in the consumers' order;
                    // lane l takes rows l, l + 32, l + 64, l + 96 (coalesced per part).
                    const int lane = threadIdx.x % 32;
                    int j = 0;
                    for (int u = unit0; u < units; u += unit_step, ++j) {
                        const int tm = (u % pairs_m) * CL + rank, b = j & 1;
                        if (j >= 2) wait_or_trap(rs_empty(b), ((j >> 1) - 1) & 1);
                        float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
                        for (int t = 0; t < a.nparts; ++t)
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int r = tm * BM + lane + 32 * i;
                                if (r < a.M) sum[i] += a.ss[(size_t)t * a.M + r];
                            }
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int r = tm * BM + lane + 32 * i;
                            const float v = r < a.M ? 1.f / sqrtf(sum[i] / (float)a.K + a.eps) : 1.f;
                            smem_st(rs_buf(b) + 4 * (lane + 32 * i), __float_as_uint(v));
                        }
                        mbar_arrive(rs_full(b));  // release: the stores above, to the consumers' wait
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
        // Before the row sums (ss) are read or anything is stored.
        if constexpr (FDPP_GEMM_PDL) pdl_wait();
        const int w = wg - 1;
        const bool signal = threadIdx.x % 32 == 0;
        auto release = [&](int s) {
            if (!signal) return;
            mbar_arrive(empty(s));
            if (CL == 2) mbar_arrive_remote(empty(s), rank ^ 1);
        };
        Staging st = {stg + (u32)w * 2 * Stage<BN, EPI>::BYTES, bars + 16 * STAGES + 16 * (u32)w, 0, 0};
        const bool leader = threadIdx.x % 128 == 0;
        int it = 0, jt = 0;
        for (int u = unit0; u < units; u += unit_step, ++jt) {
            const int tm = (u % pairs_m) * CL + rank, tn = u / pairs_m;
            float rs[2] = {1.f, 1.f};
            float acc[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
            for (int kb = 0; kb < kblocks; ++kb, ++it) {
                const int s = it % STAGES;
                wait_or_trap(full(s), (it / STAGES) & 1);
                const u64 da = desc_sw128(sa(s) + (u32)w * 64u * 128u, 16, 1024);
                const u64 db = desc_sw128(sb(s), 16, 1024);
                wg_fence();
                mma_block<BN>(acc, da, db, kb == 0);
                wg_commit();
                if constexpr (is_res(EPI))
                    if (leader && kb == kblocks / 2) prefetch_residual<BN, EPI>(st, &rmap, tm, tn, w, a.M);
                wg_wait<1>();  // the previous block's wgmmas have read their stage
                if (kb > 0) release((it - 1) % STAGES);
            }
            wg_wait<0>();
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) keep(acc[i]);
            release((it - 1) % STAGES);
            if constexpr (row_scaled(EPI)) {
                // This tile's row scales, from producer warp 1 (above).
                const int b = jt & 1, lane = threadIdx.x % 32, q = (threadIdx.x / 32) % 4;
                wait_or_trap(rs_full(b), (jt >> 1) & 1);
#pragma unroll
                for (int h = 0; h < 2; ++h) rs[h] = __uint_as_float(smem_ld(rs_buf(b) + 4 * (w * 64 + q * 16 + lane / 4 + 8 * h)));
                mbar_arrive(rs_empty(b));
            }
            if constexpr (EPI == EPI_NONE) none_epilogue<BN>(a, acc);
            else if constexpr (EPI == EPI_QKV_ROPE) staged_rope<BN>(a, acc, tm, tn, w, st, rs);
            else staged_epilogue<BN, EPI>(a, acc, tm, tn, w, st, &ymap, &rmap, rs);
        }
        if (leader) bulk_wait_all();  // the last stores are out before the CTA's memory goes
    }
    // No CTA of a pair leaves while its peer may still arrive on its barriers (the producer's
    // idle lanes waited here for its lane 0).
    if (CL == 2) {
        __syncwarp();
        cluster_sync();
    }
}


#if defined(FDPP_BN) && !defined(FDPP_EPI)
// ImplC's fdpp form (GemmSpec with block_n and stages, src/backend/cuda/gemm_hopper.rs): the
// plain product, 128 × FDPP_BN tiles, FDPP_STAGES stages; grid min(tiles, SMs) × 384 threads.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    gemm_hopper(const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap, const __grid_constant__ TmaMap ymap,
                int M, int N, int K) {
    Args a = {};
    a.M = M;
    a.N = N;
    a.K = K;
    a.tiles_m = (M + BM - 1) / BM;
    a.tiles_n = (N + FDPP_BN - 1) / FDPP_BN;
    hgemm_body<FDPP_BN, FDPP_STAGES, EPI_STORE, 1>(xmap, wmap, wmap, ymap, ymap, a);
}
#endif

#ifdef FDPP_EPI
// The prefill's fused layer (src/backend/cuda/gemm_epi.rs): epilogue FDPP_EPI on 128 × FDPP_BN
// tiles, FDPP_STAGES stages, clusters of FDPP_CL CTAs along M; the host fills `a` (tiles_m,
// tiles_n, nparts included) and the grid is min(units, resident clusters) · FDPP_CL.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    gemm_hopper_epi(const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,
                    const __grid_constant__ TmaMap umap, const __grid_constant__ TmaMap ymap,
                    const __grid_constant__ TmaMap rmap, const Args a) {
    hgemm_body<FDPP_BN, FDPP_STAGES, FDPP_EPI, FDPP_CL>(xmap, wmap, umap, ymap, rmap, a);
}

// ss[r] = Σ_c x[r, c]² of a row-major [rows, C] matrix (C % 8 == 0), one block of 256 per row:
// the first layer's norm input, which no GEMM epilogue has summed (one partial per row).
extern "C" __global__ void __launch_bounds__(256) row_sumsq(const u16* __restrict__ x, float* __restrict__ ss, int C) {
    __shared__ float part[8];
    const u16* row = x + (size_t)blockIdx.x * C;
    float s = 0.f;
    for (int c = 8 * threadIdx.x; c < C; c += 8 * 256) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + c);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float lo, hi;
            unpack2(w[e], lo, hi);
            s = fmaf(lo, lo, s);
            s = fmaf(hi, hi, s);
        }
    }
    s = warp_sum(s);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int i = 0; i < 8; ++i) t += part[i];
        ss[blockIdx.x] = t;
    }
}

// The (cos, sin) table EPI_QKV_ROPE reads, [M][HD/2]: row r's angles as layer.cu's qkv_rope
// computes them (θ = pos · inv_freq[i] rounded in fp32, sincosf), so that the fused epilogue
// rotates by the same values. Once per step: every layer's positions are the same.
extern "C" __global__ void __launch_bounds__(256)
    rope_table(const int* __restrict__ pos, const float* __restrict__ inv_freq, float2* __restrict__ cs, int M) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < M * (HD / 2); i += gridDim.x * blockDim.x) {
        float sn, c;
        sincosf(__fmul_rn((float)pos[i / (HD / 2)], inv_freq[i % (HD / 2)]), &sn, &c);
        cs[i] = make_float2(c, sn);
    }
}
#endif
