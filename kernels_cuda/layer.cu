// The small ops of one Llama-family layer (src/ops/layer.rs has the layouts and the semantics):
// residual add fused with RMSNorm, the QKV split fused with bias and rotary embedding, SiLU·mul,
// row gather (embedding lookup, last-token gather), the paged KV append, and the random fill.
//
// They move a few MB per layer against the weights' hundreds, so each is one memory-bound pass
// with 16-byte loads and stores where the rows allow it; what they save is launches and
// round trips through memory (FlashDecoding++Next keeps a decode step a fixed, short sequence of
// kernels). All math is fp32 with one rounding per output element, as the CPU reference does.
//
// The host (src/backend/layer_plan.rs) picks the entry point and the grid; the names below must
// match its `LayerKernel::name`.
#include "common.cuh"

// 16-byte vectors of the stored residual one add_rmsnorm thread keeps in registers between the
// sum of squares and the scaling pass (the rest, past hidden = 8 · 4 · 1024, is read again).
constexpr int RMS_CACHE = 4;
constexpr int MAX_WARPS = 32;

__device__ __forceinline__ uint4 ld16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void st16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

__device__ __forceinline__ void unpack8(uint4 q, float f[8]) {
    unpack2(q.x, f[0], f[1]);
    unpack2(q.y, f[2], f[3]);
    unpack2(q.z, f[4], f[5]);
    unpack2(q.w, f[6], f[7]);
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)from_f32(lo) | ((u32)from_f32(hi) << 16);
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
    return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// Sum over the block; every thread returns the total. blockDim.x is a multiple of 32, at most
// 1024. Each warp reduces the per-warp partials itself, so one barrier is enough.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[MAX_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? part[lane] : 0.f);
}

// ---- add_rmsnorm: one block per row ------------------------------------------------------------

// residual[c] (+= delta[c], rounded and stored back); returns the stored vector and adds its
// squares to ss.
__device__ __forceinline__ uint4 rms_add(uint4* __restrict__ res, const uint4* __restrict__ del, int c, float& ss) {
    uint4 r = res[c];
    float x[8];
    unpack8(r, x);
    if (del) {
        float d[8];
        unpack8(del[c], d);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] += d[e];
        r = pack8(x);
        res[c] = r;
        unpack8(r, x);  // the norm is of the stored (rounded) residual
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(x[e], x[e], ss);
    return r;
}

__device__ __forceinline__ void rms_scale(uint4 r, uint4 w, uint4* out, float inv) {
    float x[8], g[8];
    unpack8(r, x);
    unpack8(w, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = x[e] * inv * g[e];
    *out = pack8(x);
}

// Vector path: hidden % 8 == 0 (every row starts on a 16-byte boundary). delta may be null.
extern "C" __global__ void __launch_bounds__(1024)
    add_rmsnorm_v(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                  u16* __restrict__ out, int hidden, float eps) {
    const int nvec = hidden >> 3;
    const uint4* w = reinterpret_cast<const uint4*>(weight);
    const int stride = blockDim.x;
    // The norm's weights are never written during generation: they are read before the wait,
    // while the kernel before this one drains, and the scaling pass no longer waits on them.
    uint4 wc[RMS_CACHE];
#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) wc[j] = w[c];
    }
    pdl_wait();
    pdl_trigger();
    const size_t row = (size_t)blockIdx.x * hidden;
    uint4* res = reinterpret_cast<uint4*>(residual + row);
    const uint4* del = delta ? reinterpret_cast<const uint4*>(delta + row) : nullptr;
    uint4* o = reinterpret_cast<uint4*>(out + row);

    uint4 cache[RMS_CACHE];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) cache[j] = rms_add(res, del, c, ss);
    }
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) rms_add(res, del, c, ss);

    // Plain division and sqrt (IEEE under NVRTC's defaults), not rsqrtf: once per row, and it
    // keeps the scale within an ulp of the CPU's.
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);

#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) rms_scale(cache[j], wc[j], o + c, inv);
    }
    // Past the register cache: each thread reads back only what it stored itself.
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) rms_scale(res[c], w[c], o + c, inv);
}

// Scalar path for any hidden (rows not 16-byte aligned): correct, not fast.
extern "C" __global__ void __launch_bounds__(1024)
    add_rmsnorm_s(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                  u16* __restrict__ out, int hidden, float eps) {
    pdl_wait();
    pdl_trigger();
    const size_t row = (size_t)blockIdx.x * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float x = to_f32(residual[row + i]);
        if (delta) {
            const u16 r = from_f32(x + to_f32(delta[row + i]));
            residual[row + i] = r;
            x = to_f32(r);
        }
        ss = fmaf(x, x, ss);
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = from_f32(to_f32(residual[row + i]) * inv * to_f32(weight[i]));
}

// ---- qkv_rope: grid (tokens, item blocks) ------------------------------------------------------

// One item is 8 pairs (i, i + D/2) of one q or k head, or 8 elements of one v head. q and k heads
// are rotated in the rotate-half form of HF's Llama: θ = pos · inv_freq[i] in fp32, out[i] =
// x1·cosθ − x2·sinθ, out[i + D/2] = x2·cosθ + x1·sinθ. sincosf, not __sincosf: θ reaches the
// thousands of radians at long positions, where the fast intrinsic loses every digit. The
// explicit _rn products keep the compiler from fusing them into FMAs the CPU does not do.
extern "C" __global__ void __launch_bounds__(128)
    qkv_rope(const u16* __restrict__ qkv, const u16* __restrict__ bias, u16* __restrict__ q, u16* __restrict__ k,
             u16* __restrict__ v, const int* __restrict__ positions, const float* __restrict__ inv_freq, int H, int G,
             int D, const int* __restrict__ slots) {
    const int t = blockIdx.x;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    const int half = D >> 1, hc = half >> 3;
    const int rot_items = (H + G) * hc;
    const int v_items = G * (D >> 3);
    const u16* row = qkv + (size_t)t * (size_t)((H + 2 * G) * D);
    if (item < rot_items) {
        const int head = item / hc, i0 = (item - head * hc) * 8;
        const int off = head * D + i0;
        // The angles need only the positions and inv_freq (host uploads, complete before the
        // kernel ahead of this one started) and the bias is a weight: all of it is read and
        // the sines computed before the wait, while that kernel drains (launch.rs).
        const float pos = (float)positions[t];
        const float4 f0 = *reinterpret_cast<const float4*>(inv_freq + i0);
        const float4 f1 = *reinterpret_cast<const float4*>(inv_freq + i0 + 4);
        const float f[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
        float sn[8], cs[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) sincosf(__fmul_rn(pos, f[e]), &sn[e], &cs[e]);
        float b1[8], b2[8];
        if (bias) {
            unpack8(ld16(bias + off), b1);
            unpack8(ld16(bias + off + half), b2);
        }
        pdl_wait();
        pdl_trigger();
        float x1[8], x2[8];
        unpack8(ld16(row + off), x1);
        unpack8(ld16(row + off + half), x2);
        if (bias) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x1[e] += b1[e];
                x2[e] += b2[e];
            }
        }
        float o1[8], o2[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float s = sn[e], c = cs[e];
            o1[e] = __fsub_rn(__fmul_rn(x1[e], c), __fmul_rn(x2[e], s));
            o2[e] = __fadd_rn(__fmul_rn(x2[e], c), __fmul_rn(x1[e], s));
        }
        // With `slots` (a decode step's fused KV append), k and v rows go straight to their slot
        // rows of the paged pools (k and v are then the pools); otherwise to row t.
        const size_t kv_row = slots ? (size_t)slots[t] : (size_t)t;
        u16* dst = head < H ? q + (size_t)t * (size_t)(H * D) + off : k + kv_row * (size_t)(G * D) + (off - H * D);
        st16(dst, pack8(o1));
        st16(dst + half, pack8(o2));
    } else {
        // Every thread waits, whichever branch it takes (launch.rs: the rule of the chain).
        pdl_wait();
        pdl_trigger();
    }
    if (item >= rot_items && item < rot_items + v_items) {
        const int c = 8 * (item - rot_items);
        const int off = (H + G) * D + c;
        uint4 x = ld16(row + off);
        if (bias) {
            float a[8], b[8];
            unpack8(x, a);
            unpack8(ld16(bias + off), b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] += b[e];
            x = pack8(a);
        }
        st16(v + (slots ? (size_t)slots[t] : (size_t)t) * (size_t)(G * D) + c, x);
    }
}

// ---- silu_mul: grid-stride over the output ------------------------------------------------------

// inter % 8 == 0: 8 outputs per step, gate and up read as 16-byte vectors.
extern "C" __global__ void __launch_bounds__(256)
    silu_mul_v(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter) {
    pdl_wait();
    pdl_trigger();
    const long long iv = inter >> 3, total = (long long)rows * iv;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / iv, c = 8 * (i - r * iv);
        const u16* g = gate_up + r * 2 * inter + c;
        float a[8], b[8];
        unpack8(ld16(g), a);
        unpack8(ld16(g + inter), b);
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = silu(a[e]) * b[e];
        st16(out + r * inter + c, pack8(a));
    }
}

extern "C" __global__ void __launch_bounds__(256)
    silu_mul_s(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter) {
    pdl_wait();
    pdl_trigger();
    const long long total = (long long)rows * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i - r * inter;
        const u16* g = gate_up + r * 2 * inter + c;
        out[i] = from_f32(silu(to_f32(g[0])) * to_f32(g[inter]));
    }
}

// ---- row copies: gather (embedding, last tokens) and the paged KV scatter ----------------------

// V elements moved as one load/store: V = 8, 4, 2 or 1, the largest that divides the row width
// (so every row starts aligned for it).
template <int V> struct Vec;
template <> struct Vec<8> { typedef uint4 T; };
template <> struct Vec<4> { typedef uint2 T; };
template <> struct Vec<2> { typedef u32 T; };
template <> struct Vec<1> { typedef u16 T; };

// grid (rows, column blocks): dst[i] = src[rows[i]], `width` elements per row; a row index
// outside [0, limit) gives a zero row. The host checks the indices it uploads; the bound is for
// indices the device chose (a pipelined decode step embeds the previous step's argmax, which marks
// a NaN row with 0xffffffff: the host reports that row when it reads the choice).
template <int V>
__device__ __forceinline__ void gather(const u16* __restrict__ src, u16* __restrict__ dst,
                                       const int* __restrict__ rows, int width, int limit) {
    pdl_wait();
    pdl_trigger();
    typedef typename Vec<V>::T T;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (c >= width) return;
    const int r = rows[blockIdx.x];
    const size_t to = (size_t)blockIdx.x * width + c;
    T v{};
    if ((unsigned)r < (unsigned)limit) v = *reinterpret_cast<const T*>(src + (size_t)r * width + c);
    *reinterpret_cast<T*>(dst + to) = v;
}

// grid (tokens, column blocks): token i's k and v rows go to slot row slots[i] of the pools
// (page · page_size + slot, computed on the host from the block tables).
template <int V>
__device__ __forceinline__ void scatter_kv(const u16* __restrict__ k, const u16* __restrict__ v,
                                           u16* __restrict__ kpool, u16* __restrict__ vpool,
                                           const int* __restrict__ slots, int width) {
    pdl_wait();
    pdl_trigger();
    typedef typename Vec<V>::T T;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (c >= width) return;
    const size_t from = (size_t)blockIdx.x * width + c;
    const size_t to = (size_t)slots[blockIdx.x] * width + c;
    *reinterpret_cast<T*>(kpool + to) = *reinterpret_cast<const T*>(k + from);
    *reinterpret_cast<T*>(vpool + to) = *reinterpret_cast<const T*>(v + from);
}

#define FDPP_ROW_COPIES(V)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                               \
        gather_rows_v##V(const u16* __restrict__ src, u16* __restrict__ dst, const int* __restrict__ rows, \
                         int width, int limit) {                                                    \
        gather<V>(src, dst, rows, width, limit);                                                    \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(128)                                               \
        scatter_kv_v##V(const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ kpool, \
                        u16* __restrict__ vpool, const int* __restrict__ slots, int width) {         \
        scatter_kv<V>(k, v, kpool, vpool, slots, width);                                            \
    }
FDPP_ROW_COPIES(8)
FDPP_ROW_COPIES(4)
FDPP_ROW_COPIES(2)
FDPP_ROW_COPIES(1)

// ---- fill_random --------------------------------------------------------------------------------

// BEGIN random_value (a port of src/ops/layer.rs's random_value, bit for bit; also compiled as
// plain C by a host test, hence the C subset and the FDPP_HD qualifier)
#ifndef FDPP_HD
#define FDPP_HD __device__ __forceinline__
#endif
FDPP_HD float fdpp_random_value(unsigned long long seed, unsigned long long index, float scale) {
    // splitmix64 of the counter; unsigned 64-bit arithmetic wraps as Rust's wrapping_* does.
    unsigned long long z = (seed + (index + 1ull) * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    z ^= z >> 29;
    // The top 24 bits as a fraction in [0, 1): exact in f32, and so is 2·unit − 1; the product
    // with scale is the one rounding.
    const float unit = (float)(z >> 40) * (1.0f / 16777216.0f);
    return (2.0f * unit - 1.0f) * scale;
}
// END random_value

// Grid-stride over 8-element chunks: a full chunk is one 16-byte store, the last partial chunk
// is written element by element.
extern "C" __global__ void __launch_bounds__(256)
    fill_random(u16* __restrict__ buf, unsigned long long len, unsigned long long seed, float scale) {
    const unsigned long long chunks = (len + 7) / 8;
    for (unsigned long long ch = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; ch < chunks;
         ch += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long i0 = 8 * ch;
        if (i0 + 8 <= len) {
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = fdpp_random_value(seed, i0 + e, scale);
            st16(buf + i0, pack8(f));
        } else {
            for (unsigned long long i = i0; i < len; ++i) buf[i] = from_f32(fdpp_random_value(seed, i, scale));
        }
    }
}

// ---- scale_cols: w[n, k] *= scale[k], once at load ------------------------------------------------
// Folds an RMSNorm's γ into the weights of the GEMM that reads the norm (gemv.cu, RMS_IN). One
// element per step of a grid-stride loop: it runs once per weight matrix, not per token.
extern "C" __global__ void __launch_bounds__(256)
    scale_cols(u16* __restrict__ w, const u16* __restrict__ scale, unsigned long long len, int cols) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < len;
         i += (unsigned long long)gridDim.x * blockDim.x)
        w[i] = from_f32(to_f32(w[i]) * to_f32(scale[i % (unsigned long long)cols]));
}
