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

// grid (rows, column blocks): dst[i] = src[rows[i] - offset], `width` elements per row; a row
// index outside [offset, offset + limit) gives a zero row (offset: the first id of a
// tensor-parallel rank's slice of the embedding, 0 otherwise). The host checks the indices it uploads; the bound is for
// indices the device chose (a pipelined decode step embeds the previous step's argmax, which marks
// a NaN row with 0xffffffff: the host reports that row when it reads the choice).
template <int V>
__device__ __forceinline__ void gather(const u16* __restrict__ src, u16* __restrict__ dst,
                                       const int* __restrict__ rows, int width, int limit, int offset) {
    pdl_wait();
    pdl_trigger();
    typedef typename Vec<V>::T T;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (c >= width) return;
    // Unsigned: the NaN mark (-1) and ids below the slice wrap to large values, out of range.
    const int r = (int)((unsigned)rows[blockIdx.x] - (unsigned)offset);
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
                         int width, int limit, int offset) {                                        \
        gather<V>(src, dst, rows, width, limit, offset);                                            \
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

// ==== The ops of the general model executor (issue #17): OPT's LayerNorm, biases, ReLU MLP and
// learned positions, GeGLU MLPs, and ChatGLM2's partial interleaved rotary. Same rules as above:
// fp32 math, one rounding per stored element, 16-byte vectors where the widths allow, every
// thread waits (pdl_wait) before touching what an earlier kernel wrote.

// ---- add_layernorm: one block per row -----------------------------------------------------------

// residual[c] (+= delta[c], rounded and stored back); returns the stored vector and adds its
// elements to s.
__device__ __forceinline__ uint4 ln_add(uint4* __restrict__ res, const uint4* __restrict__ del, int c, float& s) {
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
        unpack8(r, x);  // the statistics are of the stored (rounded) residual
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) s += x[e];
    return r;
}

__device__ __forceinline__ float ln_centred_sq(uint4 r, float mean) {
    float x[8], ss = 0.f;
    unpack8(r, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float d = x[e] - mean;
        ss = fmaf(d, d, ss);
    }
    return ss;
}

__device__ __forceinline__ void ln_scale(uint4 r, uint4 w, uint4 b, uint4* out, float mean, float inv) {
    float x[8], g[8], h[8];
    unpack8(r, x);
    unpack8(w, g);
    unpack8(b, h);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = (x[e] - mean) * inv * g[e] + h[e];
    *out = pack8(x);
}

// Vector path: hidden % 8 == 0. The variance is the mean of centred squares, a second pass over
// the register cache (not E[x²] − mean², which cancels when a row's mean is large against its
// spread, as OPT's residual streams can be).
extern "C" __global__ void __launch_bounds__(1024)
    add_layernorm_v(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                    const u16* __restrict__ bias, u16* __restrict__ out, int hidden, float eps) {
    const int nvec = hidden >> 3;
    const uint4* w = reinterpret_cast<const uint4*>(weight);
    const uint4* bv = reinterpret_cast<const uint4*>(bias);
    const int stride = blockDim.x;
    // The norm's weight and bias are never written during generation: read before the wait.
    uint4 wc[RMS_CACHE], bc[RMS_CACHE];
#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) {
            wc[j] = w[c];
            bc[j] = bv[c];
        }
    }
    pdl_wait();
    pdl_trigger();
    const size_t row = (size_t)blockIdx.x * hidden;
    uint4* res = reinterpret_cast<uint4*>(residual + row);
    const uint4* del = delta ? reinterpret_cast<const uint4*>(delta + row) : nullptr;
    uint4* o = reinterpret_cast<uint4*>(out + row);

    uint4 cache[RMS_CACHE];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) cache[j] = ln_add(res, del, c, s);
    }
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) ln_add(res, del, c, s);
    const float mean = block_sum(s) / (float)hidden;

    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) ss += ln_centred_sq(cache[j], mean);
    }
    // Past the register cache: each thread reads back only what it stored itself.
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) ss += ln_centred_sq(res[c], mean);
    // block_sum's partials are reused: every warp must have read the mean's before they change.
    __syncthreads();
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);

#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) ln_scale(cache[j], wc[j], bc[j], o + c, mean, inv);
    }
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) ln_scale(res[c], w[c], bv[c], o + c, mean, inv);
}

// Scalar path for any hidden: three passes over the row in memory; correct, not fast.
extern "C" __global__ void __launch_bounds__(1024)
    add_layernorm_s(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                    const u16* __restrict__ bias, u16* __restrict__ out, int hidden, float eps) {
    pdl_wait();
    pdl_trigger();
    const size_t row = (size_t)blockIdx.x * hidden;
    float s = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float x = to_f32(residual[row + i]);
        if (delta) {
            const u16 r = from_f32(x + to_f32(delta[row + i]));
            residual[row + i] = r;
            x = to_f32(r);
        }
        s += x;
    }
    const float mean = block_sum(s) / (float)hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float d = to_f32(residual[row + i]) - mean;
        ss = fmaf(d, d, ss);
    }
    __syncthreads();  // block_sum's partials are reused
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[row + i] = from_f32((to_f32(residual[row + i]) - mean) * inv * to_f32(weight[i]) + to_f32(bias[i]));
}

// ---- activations: the `act` codes of layer_plan::act_code --------------------------------------

// 0 none, 1 ReLU, 2 SiLU, 3 GELU (erf), 4 GELU (tanh). GELU is written through erfc, x·Φ(x) =
// x · erfc(−x/√2) / 2, which keeps its relative accuracy in the negative tail where 1 + erf
// cancels; the tanh form through the identity (1 + tanh u) / 2 = σ(2u), for the same reason.
template <int ACT>
__device__ __forceinline__ float act_f(float x) {
    if (ACT == 1) return fmaxf(x, 0.f);
    if (ACT == 2) return silu(x);
    if (ACT == 3) return 0.5f * x * erfcf(-0.70710678118654752f * x);
    if (ACT == 4) {
        const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
        return x / (1.f + expf(-2.f * u));
    }
    return x;
}

// The activation is a kernel argument, switched on once per launch (not per element), so one
// entry point serves every model with every loop body specialised.
#define FDPP_ACT_SWITCH(act, CALL)  \
    switch (act) {                  \
        case 1: CALL(1); break;     \
        case 2: CALL(2); break;     \
        case 3: CALL(3); break;     \
        case 4: CALL(4); break;     \
        default: CALL(0); break;    \
    }

// ---- bias_act: x = act(x + bias) in place, grid-stride ------------------------------------------

template <int ACT>
__device__ __forceinline__ void bias_act_vec(u16* __restrict__ x, const u16* __restrict__ bias, int rows, int width) {
    const long long wv = width >> 3, total = (long long)rows * wv;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long c = 8 * (i % wv);
        float a[8];
        unpack8(ld16(x + 8 * i), a);
        if (bias) {
            float b[8];
            unpack8(ld16(bias + c), b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] += b[e];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = act_f<ACT>(a[e]);
        st16(x + 8 * i, pack8(a));
    }
}

template <int ACT>
__device__ __forceinline__ void bias_act_one(u16* __restrict__ x, const u16* __restrict__ bias, int rows, int width) {
    const long long total = (long long)rows * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        float a = to_f32(x[i]);
        if (bias) a += to_f32(bias[i % width]);
        x[i] = from_f32(act_f<ACT>(a));
    }
}

// width % 8 == 0. bias may be null (an activation alone).
extern "C" __global__ void __launch_bounds__(256)
    bias_act_v(u16* __restrict__ x, const u16* __restrict__ bias, int rows, int width, int act) {
    pdl_wait();
    pdl_trigger();
#define FDPP_CALL(A) bias_act_vec<A>(x, bias, rows, width)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

extern "C" __global__ void __launch_bounds__(256)
    bias_act_s(u16* __restrict__ x, const u16* __restrict__ bias, int rows, int width, int act) {
    pdl_wait();
    pdl_trigger();
#define FDPP_CALL(A) bias_act_one<A>(x, bias, rows, width)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

// ---- glu: out = act(gate) · up over the fused FFN1 output, grid-stride ---------------------------
// (SiLU keeps silu_mul above; this serves GeGLU and the rest.)

template <int ACT>
__device__ __forceinline__ void glu_vec(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter) {
    const long long iv = inter >> 3, total = (long long)rows * iv;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / iv, c = 8 * (i - r * iv);
        const u16* g = gate_up + r * 2 * inter + c;
        float a[8], b[8];
        unpack8(ld16(g), a);
        unpack8(ld16(g + inter), b);
#pragma unroll
        for (int e = 0; e < 8; ++e) a[e] = act_f<ACT>(a[e]) * b[e];
        st16(out + r * inter + c, pack8(a));
    }
}

template <int ACT>
__device__ __forceinline__ void glu_one(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter) {
    const long long total = (long long)rows * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i - r * inter;
        const u16* g = gate_up + r * 2 * inter + c;
        out[i] = from_f32(act_f<ACT>(to_f32(g[0])) * to_f32(g[inter]));
    }
}

extern "C" __global__ void __launch_bounds__(256)
    glu_v(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter, int act) {
    pdl_wait();
    pdl_trigger();
#define FDPP_CALL(A) glu_vec<A>(gate_up, out, rows, inter)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

extern "C" __global__ void __launch_bounds__(256)
    glu_s(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter, int act) {
    pdl_wait();
    pdl_trigger();
#define FDPP_CALL(A) glu_one<A>(gate_up, out, rows, inter)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

// ---- add_positions: out[t] += table[rows[t]], grid (tokens, column blocks) -----------------------
// rows[t] = position + offset, computed on the host (layer_plan::position_rows) and checked there
// against the table.

// hidden % 8 == 0: 8 elements per thread.
extern "C" __global__ void __launch_bounds__(128)
    add_positions_v(u16* __restrict__ out, const u16* __restrict__ table, const int* __restrict__ rows, int hidden) {
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    // The table is a weight and the rows a host upload: read before the wait.
    const bool live = c < hidden;
    float p[8];
    if (live) unpack8(ld16(table + (size_t)rows[blockIdx.x] * hidden + c), p);
    pdl_wait();
    pdl_trigger();
    if (!live) return;
    u16* o = out + (size_t)blockIdx.x * hidden + c;
    float x[8];
    unpack8(ld16(o), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] += p[e];
    st16(o, pack8(x));
}

extern "C" __global__ void __launch_bounds__(128)
    add_positions_s(u16* __restrict__ out, const u16* __restrict__ table, const int* __restrict__ rows, int hidden) {
    pdl_wait();
    pdl_trigger();
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    u16* o = out + (size_t)blockIdx.x * hidden + c;
    *o = from_f32(to_f32(*o) + to_f32(table[(size_t)rows[blockIdx.x] * hidden + c]));
}

// ---- qkv_rope_g: the general rotary, grid (tokens, item blocks) ---------------------------------
// One item is 8 consecutive elements of one q, k or v head, so every stored vector is one 16-byte
// store whatever the layout. Of each q and k head the first R elements are rotated, the rest
// (and v) pass through with the bias. Rotate-half over R (R < D): element i pairs with i ± R/2;
// interleaved (ChatGLM2, GPT-J): 2i with 2i + 1; pair i turns by pos · inv_freq[i] in both. A
// rotated element needs its partner: in the interleaved layout it is in the same vector; in the
// rotate-half one it is the vector R/2 away (read as one 16-byte load when R/2 % 8 == 0, element
// by element otherwise). Same arithmetic as qkv_rope: sincosf, and products rounded apart
// (_rn) so that the compiler does not fuse them into FMAs the CPU does not do. `interleaved` is
// 0 or 1; R = 0 is the split and the bias alone (OPT).
extern "C" __global__ void __launch_bounds__(128)
    qkv_rope_g(const u16* __restrict__ qkv, const u16* __restrict__ bias, u16* __restrict__ q, u16* __restrict__ k,
               u16* __restrict__ v, const int* __restrict__ positions, const float* __restrict__ inv_freq, int H,
               int G, int D, const int* __restrict__ slots, int R, int interleaved) {
    const int t = blockIdx.x;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    const int dc = D >> 3, heads = H + 2 * G, hr = R >> 1;
    const bool live = item < heads * dc;
    const int head = item / dc, c0 = (item - head * dc) * 8;
    const int off = head * D + c0;
    const bool rot = live && head < H + G && c0 < R;
    // Angles (host uploads) and the bias (a weight) before the wait, as qkv_rope does.
    float sn[8], cs[8], b[8];
    if (rot) {
        const float pos = (float)positions[t];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int i = c0 + e;
            const int pair = interleaved ? (i >> 1) : (i < hr ? i : i - hr);
            if (i < R) {
                sincosf(__fmul_rn(pos, inv_freq[pair]), &sn[e], &cs[e]);
            } else {
                sn[e] = 0.f;
                cs[e] = 1.f;
            }
        }
    }
    if (live && bias) unpack8(ld16(bias + off), b);
    pdl_wait();
    pdl_trigger();
    if (!live) return;
    const u16* row = qkv + (size_t)t * (size_t)(heads * D);
    float x[8];
    unpack8(ld16(row + off), x);
    if (bias) {
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] += b[e];
    }
    if (rot) {
        float y[8];  // each element's partner, bias included
        if (interleaved) {
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] = x[e ^ 1];
        } else if ((hr & 7) == 0) {
            // R/2 a multiple of 8: the vector lies wholly in [0, R/2) or [R/2, R), and so does its
            // partner vector.
            const int poff = head * D + (c0 < hr ? c0 + hr : c0 - hr);
            unpack8(ld16(row + poff), y);
            if (bias) {
                float pb[8];
                unpack8(ld16(bias + poff), pb);
#pragma unroll
                for (int e = 0; e < 8; ++e) y[e] += pb[e];
            }
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int i = c0 + e;
                const int j = head * D + (i < hr ? i + hr : i - hr);
                y[e] = i < R ? to_f32(row[j]) + (bias ? to_f32(bias[j]) : 0.f) : 0.f;
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int i = c0 + e;
            if (i < R) {
                const bool first = interleaved ? (i & 1) == 0 : i < hr;
                const float a = __fmul_rn(x[e], cs[e]), s = __fmul_rn(y[e], sn[e]);
                x[e] = first ? __fsub_rn(a, s) : __fadd_rn(a, s);
            }
        }
    }
    // With `slots` (the decode step's fused KV append) k and v go to their slot rows of the pools.
    const size_t kv_row = slots ? (size_t)slots[t] : (size_t)t;
    u16* dst = head < H       ? q + (size_t)t * (size_t)(H * D) + off
               : head < H + G ? k + kv_row * (size_t)(G * D) + (off - H * D)
                              : v + kv_row * (size_t)(G * D) + (off - (H + G) * D);
    st16(dst, pack8(x));
}
