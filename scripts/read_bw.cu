// The card's streaming-read ceiling: the most bytes per second any of a sweep of plain read
// kernels pulls from device memory. Decode attention reads K and V once and writes almost
// nothing, so this (not the copy bandwidth, which also writes) bounds its effective TB/s; a
// peer at x TB/s can be beaten by 5 % only if 1.05·x is below this ceiling.
//
//   nvcc -O3 -arch=sm_90a scripts/read_bw.cu -o /tmp/read_bw && /tmp/read_bw [GiB]
//   /tmp/read_bw sizes BYTES[,BYTES...]   the ceiling at each size (below)
//   /tmp/read_bw layout HEADS TOKENS[,TOKENS...] [all]   the MHA decode pattern in fdpp's pool and
//                                                         in SDPA's layout (all: every configuration)
//   /tmp/read_bw gqa KV_HEADS TOKENS[,TOKENS...]   the GQA decode pattern's variants (below)
//
// `sizes`: the same sweep over a buffer of exactly BYTES, read again and again as a benchmark
// reads one KV cache, each launch timed alone with events and the median of 20 taken, as `fdpp
// bench attention` times a decode call. At small sizes a launch's ramp and tail are a large share
// of it, so the ceiling of a decode point is the read of its own bytes, not the 8 GiB figure: a
// peer at x TB/s can be beaten by 5 % at that point only if 1.05·x is below it.
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "cuda_check.h"

// Milliseconds of `reps` launches of `launch`, each alone between two events, after two untimed
// ones; sorted, so [0] is the fastest and [reps / 2] the median.
template <class F>
static std::vector<float> time_launches(F launch, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int w = 0; w < 2; ++w) launch();
    std::vector<float> ms;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float t = 0;
        CK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return ms;
}

__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// ld_nc with an L2 prefetch-size hint: on a miss, L2 fetches HINT bytes around the address.
template <int HINT>
__device__ __forceinline__ uint4 ld_nc_hint(const uint4* p) {
    uint4 v;
    if (HINT == 256)
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    else if (HINT == 128)
        asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    else
        v = ld_nc(p);
    return v;
}

// The decode kernels' pattern (kernels_cuda/attn_decode_tc.cuh, bandwidth path): K and V rows of
// 256 bytes (d128 fp16) of one kv head inside token rows of 8 kv heads (2 KiB), one block per
// (kv head, split of the tokens), 4 warps; a warp step is 16 tokens, lane (g, t) reading 16 bytes
// at dims 32c + 8t of tokens g and g + 8 for c = 0..3, K and V: every load instruction covers
// 8 tokens x 64 bytes (half of each 128-byte line).
template <int HINT>
__global__ void __launch_bounds__(128) read_rows(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                 size_t tokens, int splits, unsigned* out) {
    const int kvh = blockIdx.x % 8, split = blockIdx.x / 8;
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3, warp = threadIdx.x / 32;
    const size_t per = (tokens + splits - 1) / splits;
    const size_t t0 = split * per, t1 = t0 + per < tokens ? t0 + per : tokens;
    unsigned acc = 0;
    for (size_t base = t0 + 16 * warp; base + 16 <= t1; base += 64) {
        uint4 r[16];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const size_t at = (base + g + 8 * h) * 128 + kvh * 16 + c * 4 + t;  // in uint4
                r[c * 4 + h * 2] = ld_nc_hint<HINT>(k + at);
                r[c * 4 + h * 2 + 1] = ld_nc_hint<HINT>(v + at);
            }
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) acc ^= r[i].x ^ r[i].y ^ r[i].z ^ r[i].w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

template <int HINT>
static double time_rows(const uint4* p, size_t n, unsigned* out, int splits, double* median) {
    const size_t half = n / 2, tokens = half / 128;
    const uint4 *k = p, *v = p + half;
    const std::vector<float> ms =
        time_launches([&] { read_rows<HINT><<<8 * splits, 128>>>(k, v, tokens, splits, out); }, 10);
    const double bytes = (double)tokens * 128 * 16 * 2;
    *median = bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
    return bytes / (ms[0] * 1e-3) / 1e12;
}

static uint4* filled_buffer(size_t bytes, unsigned** out);
static double best_read(const uint4* p, size_t n, unsigned* out, int sms, int reps, char* cfg, size_t cfg_len);

// `layout`: the MHA decode pattern against the layout of its peer. K and V pools of `tokens`
// token rows of `heads` rows of 256 bytes (d128 fp16), one block per (head, range of tokens),
// 16 lanes per 256-byte row, U rows of K and of V in flight per thread. `head_major` 0: fdpp's
// pool, a token's heads side by side (row (tok, h) at (tok·heads + h)·256 B, so a head's rows lie
// heads·256 B apart); 1: SDPA's [heads, tokens, 128] tensors, each head's rows contiguous.
template <int U>
__global__ void read_layout(const uint4* __restrict__ k, const uint4* __restrict__ v, size_t tokens, int heads,
                            int ranges, int head_major, unsigned* out) {
    const int h = blockIdx.x % heads, range = blockIdx.x / heads;
    const size_t per = (tokens + ranges - 1) / ranges;
    const size_t t0 = range * per, t1 = t0 + per < tokens ? t0 + per : tokens;
    const int lane = threadIdx.x % 16, rows = blockDim.x / 16;
    unsigned acc = 0;
    for (size_t t = t0 + threadIdx.x / 16; t < t1; t += (size_t)U * rows) {
        uint4 r[2 * U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t tok = t + (size_t)u * rows < t1 ? t + (size_t)u * rows : t;
            const size_t at = (head_major ? (size_t)h * tokens + tok : tok * heads + h) * 16 + lane;
            r[2 * u] = ld_nc(k + at);
            r[2 * u + 1] = ld_nc(v + at);
        }
#pragma unroll
        for (int i = 0; i < 2 * U; ++i) acc ^= r[i].x ^ r[i].y ^ r[i].z ^ r[i].w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// The best median TB/s of read_layout over threads, rows in flight and ranges (per head), for
// one layout; its configuration in cfg. `all`: every configuration's median printed as well.
static bool g_layout_all = false;
static double best_layout(const uint4* p, size_t tokens, int heads, int head_major, unsigned* out, char* cfg,
                          size_t cfg_len) {
    const size_t pool = tokens * heads * 16;  // uint4 per pool
    const uint4 *k = p, *v = p + pool;
    const double bytes = 2.0 * pool * 16;
    double best = 0;
    for (int threads : {128, 256, 512})
        for (int ranges : {4, 8, 16, 24, 32, 64})
            for (int u : {1, 2, 4}) {
                const int blocks = heads * ranges;
                auto launch = [&] {
                    if (u == 1) read_layout<1><<<blocks, threads>>>(k, v, tokens, heads, ranges, head_major, out);
                    if (u == 2) read_layout<2><<<blocks, threads>>>(k, v, tokens, heads, ranges, head_major, out);
                    if (u == 4) read_layout<4><<<blocks, threads>>>(k, v, tokens, heads, ranges, head_major, out);
                };
                const std::vector<float> ms = time_launches(launch, 20);
                const double med = bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
                if (g_layout_all)
                    printf("#   %s tokens %zu threads %d ranges %d rows %d: %.3f\n", head_major ? "head-major" : "token-major",
                           tokens, threads, ranges, u, med);
                if (med > best) {
                    best = med;
                    snprintf(cfg, cfg_len, "%d,%d,%d", threads, ranges, u);
                }
            }
    return best;
}

// A comma-separated list of token counts, each at least `least`, into toks; false (with the
// offending text on stderr) otherwise.
static bool token_counts(const char* list, long least, const char* mode, std::vector<size_t>& toks) {
    for (const char* s = list; *s;) {
        char* end = nullptr;
        const long v = strtol(s, &end, 10);
        if (end == s || v < least) {
            fprintf(stderr, "%s: bad token count at '%s' (at least %ld)\n", mode, s, least);
            return false;
        }
        toks.push_back((size_t)v);
        s = *end == ',' ? end + 1 : end;
    }
    return !toks.empty();
}

static int layout_mode(int heads, const char* list) {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::vector<size_t> toks;
    if (!token_counts(list, 16, "layout", toks)) return 2;
    const size_t most = *std::max_element(toks.begin(), toks.end());
    unsigned* out;
    const uint4* p = filled_buffer(2 * most * heads * 256, &out);
    printf("# device %s; K+V of %d heads d128 fp16; best median of 20 launches over threads, ranges, rows in flight\n",
           prop.name, heads);
    printf("tokens,bytes,token_major_tbs,cfg,head_major_tbs,cfg,plain_tbs,cfg\n");
    for (size_t t : toks) {
        char c0[64] = "", c1[64] = "", c2[64] = "";
        const double tm = best_layout(p, t, heads, 0, out, c0, sizeof c0);
        const double hm = best_layout(p, t, heads, 1, out, c1, sizeof c1);
        const double pl = best_read(p, 2 * t * heads * 16, out, prop.multiProcessorCount, 20, c2, sizeof c2);
        printf("%zu,%zu,%.3f,%s,%.3f,%s,%.3f,%s\n", t, 2 * t * heads * 256, tm, c0, hm, c1, pl, c2);
        fflush(stdout);
    }
    return 0;
}

// `gqa`: what the grouped decode's access pattern costs, and the patterns it could take instead.
// Why: the tensor-core pass streams at 85-97 % of a plain read of its bytes where SDPA reaches
// 97-101 % (GQA, batch >= 16, H200); this separates the load pattern from the rest of the kernel.
// On the H200 (reports/NOTES.md, session 39) whole lines gained only with twice the kernel's bytes
// in flight, the block order that gained here did nothing in the kernel, and every prefetch
// variant below was slower, in the mimic and in the kernel.
// K and V pools of `tokens` rows of G kv heads x 256 bytes (d128 fp16, fdpp's token-major pool),
// blocks of 4 warps, a warp step of 16 tokens x 256 bytes of one kv head (K and V), 16 loads of
// 16 bytes per lane and step. FULL 0: lane (g, t) reads tokens g, g + 8 at 16-byte chunks
// 4c + t (the tensor-core pass's fragments: a load instruction covers 8 tokens x 64 B, half of
// each line); FULL 1: lane l reads tokens l / 8 + 4j at chunks l % 8 + 8c (4 tokens x 128 B,
// whole lines). WARPS_HEADS 0: a block is one kv head, its warps take every fourth step (the
// kernel's split); 1: a block is 4 kv heads, warp w kv head 4u + w, all warps step over the same
// tokens (a token row's heads read side by side). SPLIT_FAST: consecutive blocks are splits of
// one unit (the kernel's grid), else units of one split.
// One warp step of the mimic: this lane's 16 loads of 16 bytes of tokens base .. base + 15 of kv
// head `head` (K and V), half lines or whole lines as FULL says; the xor of what it read.
template <bool FULL>
__device__ __forceinline__ unsigned gqa_step(const uint4* __restrict__ k, const uint4* __restrict__ v, size_t base,
                                             int G, int head, int lane) {
    uint4 r[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        size_t tok, chunk;
        if (FULL) {
            tok = base + lane / 8 + 4 * (i % 4);
            chunk = lane % 8 + 8 * (i / 4);
        } else {
            tok = base + lane / 4 + 8 * (i % 2);
            chunk = 4 * (i / 2) + lane % 4;
        }
        const size_t at = (tok * G + head) * 16 + chunk;
        r[2 * i] = ld_nc_hint<128>(k + at);
        r[2 * i + 1] = ld_nc_hint<128>(v + at);
    }
    unsigned acc = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc ^= r[i].x ^ r[i].y ^ r[i].z ^ r[i].w;
    return acc;
}

template <bool FULL, bool WARPS_HEADS, bool SPLIT_FAST>
__global__ void __launch_bounds__(128) read_gqa(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                size_t tokens, int G, int splits, unsigned* out) {
    const int units = WARPS_HEADS ? G / 4 : G;
    const int unit = SPLIT_FAST ? blockIdx.x / splits : blockIdx.x % units;
    const int split = SPLIT_FAST ? blockIdx.x % splits : blockIdx.x / units;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int head = WARPS_HEADS ? 4 * unit + warp : unit;
    const size_t per = ((tokens + splits - 1) / splits + 15) / 16 * 16;
    const size_t t0 = split * per, t1 = t0 + per < tokens ? t0 + per : tokens;
    const size_t first = WARPS_HEADS ? t0 : t0 + 16 * warp, step = WARPS_HEADS ? 16 : 64;
    unsigned acc = 0;
    for (size_t base = first; base + 16 <= t1; base += step) {
        acc ^= gqa_step<FULL>(k, v, base, G, head, lane);
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

template <bool FULL, bool WARPS_HEADS, bool SPLIT_FAST>
static double time_gqa(const uint4* p, size_t tokens, int G, int blocks, unsigned* out) {
    const size_t pool = tokens * G * 16;
    const int units = WARPS_HEADS ? G / 4 : G;
    const int splits = std::max(1, blocks / units);
    const std::vector<float> ms = time_launches(
        [&] { read_gqa<FULL, WARPS_HEADS, SPLIT_FAST><<<units * splits, 128>>>(p, p + pool, tokens, G, splits, out); },
        20);
    return 2.0 * pool * 16 / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

// The tensor-core pass's pattern (half lines, a block per kv head, the kernel's split order) with
// the K and V rows of the step PF steps ahead requested into L2 first. KIND 0: one
// `cp.async.bulk.prefetch.L2` of a key's whole 256-byte row from lane k < 16 (two full lines);
// KIND 1: `prefetch.global.L2` of one 128-byte line per lane (key lane / 2, line lane % 2).
template <int KIND>
__global__ void __launch_bounds__(128) read_gqa_pf(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                                   size_t tokens, int G, int splits, int pf, unsigned* out) {
    const int unit = blockIdx.x / splits, split = blockIdx.x % splits;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const size_t per = ((tokens + splits - 1) / splits + 15) / 16 * 16;
    const size_t t0 = split * per, t1 = t0 + per < tokens ? t0 + per : tokens;
    unsigned acc = 0;
    for (size_t base = t0 + 16 * warp; base + 16 <= t1; base += 64) {
        const size_t ahead = base + 64 * (size_t)pf;
        if (pf > 0 && ahead + 16 <= t1) {
            if (KIND == 0) {
                if (lane < 16) {
                    const size_t at = ((ahead + lane) * G + unit) * 16;
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], 256;" ::"l"(k + at) : "memory");
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], 256;" ::"l"(v + at) : "memory");
                }
            } else {
                const size_t at = ((ahead + lane / 2) * G + unit) * 16 + 8 * (lane % 2);
                asm volatile("prefetch.global.L2 [%0];" ::"l"(k + at));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(v + at));
            }
        }
        acc ^= gqa_step<false>(k, v, base, G, unit, lane);
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

template <int KIND>
static double time_gqa_pf(const uint4* p, size_t tokens, int G, int blocks, int pf, unsigned* out) {
    const size_t pool = tokens * G * 16;
    const int splits = std::max(1, blocks / G);
    const std::vector<float> ms = time_launches(
        [&] { read_gqa_pf<KIND><<<G * splits, 128>>>(p, p + pool, tokens, G, splits, pf, out); }, 20);
    return 2.0 * pool * 16 / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

static int gqa_mode(int G, const char* list) {
    if (G < 4 || G % 4 != 0) {
        fprintf(stderr, "gqa: KV_HEADS must be a multiple of 4 (got %d)\n", G);
        return 2;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::vector<size_t> toks;
    if (!token_counts(list, 64, "gqa", toks)) return 2;
    const size_t most = *std::max_element(toks.begin(), toks.end());
    unsigned* out;
    const uint4* p = filled_buffer(2 * most * G * 256, &out);
    printf("# device %s; K+V of %d kv heads d128 fp16; median TB/s of 20 launches\n", prop.name, G);
    printf("tokens,bytes,blocks,order,half_1head,full_1head,half_4heads,full_4heads\n");
    for (size_t t : toks) {
        for (int blocks : {256, 512, 1024})
            for (int sf = 0; sf < 2; ++sf) {
                double r[4];
                if (sf) {
                    r[0] = time_gqa<false, false, true>(p, t, G, blocks, out);
                    r[1] = time_gqa<true, false, true>(p, t, G, blocks, out);
                    r[2] = time_gqa<false, true, true>(p, t, G, blocks, out);
                    r[3] = time_gqa<true, true, true>(p, t, G, blocks, out);
                } else {
                    r[0] = time_gqa<false, false, false>(p, t, G, blocks, out);
                    r[1] = time_gqa<true, false, false>(p, t, G, blocks, out);
                    r[2] = time_gqa<false, true, false>(p, t, G, blocks, out);
                    r[3] = time_gqa<true, true, false>(p, t, G, blocks, out);
                }
                printf("%zu,%zu,%d,%s,%.3f,%.3f,%.3f,%.3f\n", t, 2 * t * G * 256, blocks, sf ? "splits" : "units", r[0],
                       r[1], r[2], r[3]);
                fflush(stdout);
            }
        for (int blocks : {512, 1024})
            for (int pf : {0, 1, 2, 4, 8})
                printf("%zu,%d,prefetch %d steps ahead: bulk rows %.3f, lines %.3f\n", t, blocks, pf,
                       time_gqa_pf<0>(p, t, G, blocks, pf, out), time_gqa_pf<1>(p, t, G, blocks, pf, out));
        fflush(stdout);
        char cfg[64] = "";
        const double pl = best_read(p, 2 * t * G * 16, out, prop.multiProcessorCount, 20, cfg, sizeof cfg);
        printf("# plain read of the same bytes: %.3f TB/s (%s)\n", pl, cfg);
    }
    return 0;
}

// U independent 16-byte loads in flight per thread, grid-stride; the xor of everything read is
// written only if it equals a value it cannot plausibly take, so no load is dead code.
template <int U>
__global__ void read_kernel(const uint4* __restrict__ p, size_t n, unsigned* out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ld_nc(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        uint4 v = ld_nc(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

template <int U>
static double time_read(const uint4* p, size_t n, unsigned* out, int blocks, int threads, int reps,
                        double* median) {
    const std::vector<float> ms = time_launches([&] { read_kernel<U><<<blocks, threads>>>(p, n, out); }, reps);
    const double bytes = (double)n * 16;
    *median = bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
    return bytes / (ms[0] * 1e-3) / 1e12;
}

// A device buffer of `bytes` filled with a constant (the reads need no particular data), the
// kernels' 4-byte sink, ready to read.
static uint4* filled_buffer(size_t bytes, unsigned** out) {
    uint4* p;
    CK(cudaMalloc(&p, bytes));
    CK(cudaMalloc(out, 4));
    CK(cudaMemset(p, 0x5a, bytes));
    CK(cudaDeviceSynchronize());
    return p;
}

// The best median over the sweep for a buffer of n 16-byte words; its configuration in cfg.
static double best_read(const uint4* p, size_t n, unsigned* out, int sms, int reps, char* cfg, size_t cfg_len) {
    double best = 0;
    for (int threads : {128, 256, 512, 1024})
        for (int per_sm : {1, 2, 4, 8, 16})
            for (int u : {1, 2, 4, 8}) {
                if (threads * per_sm > 2048) continue;
                double med = 0;
                if (u == 1) time_read<1>(p, n, out, sms * per_sm, threads, reps, &med);
                if (u == 2) time_read<2>(p, n, out, sms * per_sm, threads, reps, &med);
                if (u == 4) time_read<4>(p, n, out, sms * per_sm, threads, reps, &med);
                if (u == 8) time_read<8>(p, n, out, sms * per_sm, threads, reps, &med);
                if (med > best) {
                    best = med;
                    snprintf(cfg, cfg_len, "%d,%d,%d", u, per_sm, threads);
                }
            }
    return best;
}

static int sizes_mode(const char* list) {
    std::vector<size_t> sizes;
    for (const char* s = list; *s;) {
        char* end = nullptr;
        const double v = strtod(s, &end);
        if (end == s || v < 16) {
            fprintf(stderr, "sizes: bad byte count at '%s'\n", s);
            return 2;
        }
        sizes.push_back((size_t)v / 16 * 16);
        s = *end == ',' ? end + 1 : end;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t most = *std::max_element(sizes.begin(), sizes.end());
    unsigned* out;
    const uint4* p = filled_buffer(most, &out);
    printf("# device %s, %d SMs; median of 20 timed launches per configuration, best configuration\n", prop.name,
           prop.multiProcessorCount);
    printf("bytes,ceiling_tbs,unroll,blocks_per_sm,threads\n");
    for (size_t b : sizes) {
        char cfg[64] = "";
        const double best = best_read(p, b / 16, out, prop.multiProcessorCount, 20, cfg, sizeof cfg);
        printf("%zu,%.3f,%s\n", b, best, cfg);
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc > 2 && std::string(argv[1]) == "sizes") return sizes_mode(argv[2]);
    if (argc > 3 && std::string(argv[1]) == "gqa") return gqa_mode(atoi(argv[2]), argv[3]);
    if (argc > 3 && std::string(argv[1]) == "layout") {
        g_layout_all = argc > 4 && std::string(argv[4]) == "all";
        return layout_mode(atoi(argv[2]), argv[3]);
    }
    const double gib = argc > 1 ? atof(argv[1]) : 8.0;
    const size_t bytes = (size_t)(gib * (1ull << 30)) / 16 * 16;
    const size_t n = bytes / 16;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    unsigned* out;
    const uint4* p = filled_buffer(bytes, &out);
    printf("device %s, %d SMs, buffer %.2f GiB, TB/s = 1e12 B/s, 10 timed runs each\n", prop.name,
           prop.multiProcessorCount, gib);
    printf("unroll,blocks_per_sm,threads,best_tbs,median_tbs\n");
    double best = 0;
    const int sms = prop.multiProcessorCount;
    for (int threads : {256, 512, 1024})
        for (int per_sm : {1, 2, 4, 8})
            for (int u : {2, 4, 8}) {
                if (threads * per_sm > 2048) continue;
                double med = 0, top = 0;
                if (u == 2) top = time_read<2>(p, n, out, sms * per_sm, threads, 10, &med);
                if (u == 4) top = time_read<4>(p, n, out, sms * per_sm, threads, 10, &med);
                if (u == 8) top = time_read<8>(p, n, out, sms * per_sm, threads, 10, &med);
                printf("%d,%d,%d,%.3f,%.3f\n", u, per_sm, threads, top, med);
                best = std::max(best, med);
            }
    printf("ceiling (best median over the sweep): %.3f TB/s\n", best);
    printf("decode pattern (8 tokens x 64 B per load instruction), hint,splits,best_tbs,median_tbs\n");
    for (int splits : {32, 64, 128}) {
        double med = 0, top = 0;
        top = time_rows<0>(p, n, out, splits, &med);
        printf("none,%d,%.3f,%.3f\n", splits, top, med);
        top = time_rows<128>(p, n, out, splits, &med);
        printf("L2::128B,%d,%.3f,%.3f\n", splits, top, med);
        top = time_rows<256>(p, n, out, splits, &med);
        printf("L2::256B,%d,%.3f,%.3f\n", splits, top, med);
    }
    return 0;
}
