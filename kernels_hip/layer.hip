// The small ops of one Llama-family layer for AMD: a port of kernels_cuda/layer.cu (same entry
// points, arguments, grids and semantics; src/ops/layer.rs has the layouts). What differs: the
// wavefront width (64 lanes on CDNA, 32 on RDNA) in the block reduction of add_rmsnorm, clang
// vector types instead of uint4, and FMA contraction switched off where the CPU does separate
// multiplies and adds (HIP's clang contracts across statements by default).
//
// The host (src/backend/layer_plan.rs) picks the entry point and the grid; the names below must
// match its `LayerKernel::name`.
#include "common.h"

typedef u32 u32x2 __attribute__((ext_vector_type(2)));
typedef float f32x4 __attribute__((ext_vector_type(4)));

// 16-byte vectors of the stored residual one add_rmsnorm thread keeps in registers between the
// sum of squares and the scaling pass.
constexpr int RMS_CACHE = 4;
constexpr int MAX_WAVES = 32;  // 1024 threads of wave32
constexpr int WAVE = FDPP_WAVE;

__device__ __forceinline__ void st16(void* p, u32x4 v) { *reinterpret_cast<u32x4*>(p) = v; }

__device__ __forceinline__ void unpack8(u32x4 q, float f[8]) {
    unpack2(q.x, f[0], f[1]);
    unpack2(q.y, f[2], f[3]);
    unpack2(q.z, f[4], f[5]);
    unpack2(q.w, f[6], f[7]);
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)from_f32(lo) | ((u32)from_f32(hi) << 16);
}

__device__ __forceinline__ u32x4 pack8(const float f[8]) {
    return u32x4{pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7])};
}

// Sum over the block; every thread returns the total. blockDim.x is a multiple of the wavefront,
// at most 1024. Each wavefront reduces the per-wavefront partials itself: one barrier.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[MAX_WAVES];
    const int lane = threadIdx.x % WAVE, wave = threadIdx.x / WAVE, waves = blockDim.x / WAVE;
    v = wave_sum(v);
    if (lane == 0) part[wave] = v;
    __syncthreads();
    return wave_sum(lane < waves ? part[lane] : 0.f);
}

// ---- add_rmsnorm: one block per row ------------------------------------------------------------

__device__ __forceinline__ u32x4 rms_add(u32x4* __restrict__ res, const u32x4* __restrict__ del, int c, float& ss) {
    u32x4 r = res[c];
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

__device__ __forceinline__ void rms_scale(u32x4 r, u32x4 w, u32x4* out, float inv) {
    float x[8], g[8];
    unpack8(r, x);
    unpack8(w, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = x[e] * inv * g[e];
    *out = pack8(x);
}

// Vector path: hidden % 8 == 0. delta may be null.
extern "C" __global__ void __launch_bounds__(1024)
    add_rmsnorm_v(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                  u16* __restrict__ out, int hidden, float eps) {
    const int nvec = hidden >> 3;
    const size_t row = (size_t)blockIdx.x * hidden;
    u32x4* res = reinterpret_cast<u32x4*>(residual + row);
    const u32x4* del = delta ? reinterpret_cast<const u32x4*>(delta + row) : nullptr;
    const u32x4* w = reinterpret_cast<const u32x4*>(weight);
    u32x4* o = reinterpret_cast<u32x4*>(out + row);
    const int stride = blockDim.x;

    u32x4 cache[RMS_CACHE];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) cache[j] = rms_add(res, del, c, ss);
    }
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) rms_add(res, del, c, ss);

    const float inv = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);

#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) rms_scale(cache[j], w[c], o + c, inv);
    }
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) rms_scale(res[c], w[c], o + c, inv);
}

// Scalar path for any hidden: correct, not fast.
extern "C" __global__ void __launch_bounds__(1024)
    add_rmsnorm_s(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                  u16* __restrict__ out, int hidden, float eps) {
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

// One item is 8 pairs (i, i + D/2) of one q or k head, or 8 elements of one v head; rotate-half
// RoPE as in kernels_cuda/layer.cu, with the accurate sincosf.
extern "C" __global__ void __launch_bounds__(128)
    qkv_rope(const u16* __restrict__ qkv, const u16* __restrict__ bias, u16* __restrict__ q, u16* __restrict__ k,
             u16* __restrict__ v, const int* __restrict__ positions, const float* __restrict__ inv_freq, int H, int G,
             int D) {
#pragma clang fp contract(off)
    const int t = blockIdx.x;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    const int half = D >> 1, hc = half >> 3;
    const int rot_items = (H + G) * hc;
    const int v_items = G * (D >> 3);
    const u16* row = qkv + (size_t)t * (size_t)((H + 2 * G) * D);
    if (item < rot_items) {
        const int head = item / hc, i0 = (item - head * hc) * 8;
        const int off = head * D + i0;
        float x1[8], x2[8];
        unpack8(ld16(row + off), x1);
        unpack8(ld16(row + off + half), x2);
        if (bias) {
            float b1[8], b2[8];
            unpack8(ld16(bias + off), b1);
            unpack8(ld16(bias + off + half), b2);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                x1[e] += b1[e];
                x2[e] += b2[e];
            }
        }
        const float pos = (float)positions[t];
        const f32x4 f0 = *reinterpret_cast<const f32x4*>(inv_freq + i0);
        const f32x4 f1 = *reinterpret_cast<const f32x4*>(inv_freq + i0 + 4);
        const float f[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
        float o1[8], o2[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float s, c;
            sincosf(pos * f[e], &s, &c);
            o1[e] = x1[e] * c - x2[e] * s;
            o2[e] = x2[e] * c + x1[e] * s;
        }
        u16* dst = head < H ? q + (size_t)t * (size_t)(H * D) + off : k + (size_t)t * (size_t)(G * D) + (off - H * D);
        st16(dst, pack8(o1));
        st16(dst + half, pack8(o2));
    } else if (item < rot_items + v_items) {
        const int c = 8 * (item - rot_items);
        const int off = (H + G) * D + c;
        u32x4 x = ld16(row + off);
        if (bias) {
            float a[8], b[8];
            unpack8(x, a);
            unpack8(ld16(bias + off), b);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] += b[e];
            x = pack8(a);
        }
        st16(v + (size_t)t * (size_t)(G * D) + c, x);
    }
}

// ---- silu_mul: grid-stride over the output ------------------------------------------------------

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

extern "C" __global__ void __launch_bounds__(256)
    silu_mul_v(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter) {
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
    const long long total = (long long)rows * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i - r * inter;
        const u16* g = gate_up + r * 2 * inter + c;
        out[i] = from_f32(silu(to_f32(g[0])) * to_f32(g[inter]));
    }
}

// ---- row copies: gather (embedding, last tokens) and the paged KV scatter ----------------------

template <int V> struct Vec;
template <> struct Vec<8> { typedef u32x4 T; };
template <> struct Vec<4> { typedef u32x2 T; };
template <> struct Vec<2> { typedef u32 T; };
template <> struct Vec<1> { typedef u16 T; };

// Row r of dst = row rows[r] of src; a negative row id gives a zero row (an embedding id that
// another tensor-parallel rank's vocabulary slice holds: the all-reduce after the lookup adds
// that rank's row).
template <int V>
__device__ __forceinline__ void gather(const u16* __restrict__ src, u16* __restrict__ dst,
                                       const int* __restrict__ rows, int width) {
    typedef typename Vec<V>::T T;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (c >= width) return;
    const int row = rows[blockIdx.x];
    const size_t to = (size_t)blockIdx.x * width + c;
    *reinterpret_cast<T*>(dst + to) = row < 0 ? T{} : *reinterpret_cast<const T*>(src + (size_t)row * width + c);
}

template <int V>
__device__ __forceinline__ void scatter_kv(const u16* __restrict__ k, const u16* __restrict__ v,
                                           u16* __restrict__ kpool, u16* __restrict__ vpool,
                                           const int* __restrict__ slots, int width) {
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
                         int width) {                                                               \
        gather<V>(src, dst, rows, width);                                                           \
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

// ==== The ops of the general model executor (issue #17), ported from kernels_cuda/layer.cu:
// OPT's LayerNorm, biases, ReLU MLP and learned positions, GeGLU MLPs, and ChatGLM2's partial
// interleaved rotary. Same entry points, arguments (qkv_rope_g without the CUDA-only `slots`),
// grids and arithmetic; no PDL waits on AMD.

// ---- add_layernorm: one block per row -----------------------------------------------------------

__device__ __forceinline__ u32x4 ln_add(u32x4* __restrict__ res, const u32x4* __restrict__ del, int c, float& s) {
    u32x4 r = res[c];
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

__device__ __forceinline__ float ln_centred_sq(u32x4 r, float mean) {
    float x[8], ss = 0.f;
    unpack8(r, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float d = x[e] - mean;
        ss = fmaf(d, d, ss);
    }
    return ss;
}

__device__ __forceinline__ void ln_scale(u32x4 r, u32x4 w, u32x4 b, u32x4* out, float mean, float inv) {
    float x[8], g[8], h[8];
    unpack8(r, x);
    unpack8(w, g);
    unpack8(b, h);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = (x[e] - mean) * inv * g[e] + h[e];
    *out = pack8(x);
}

// Vector path: hidden % 8 == 0; the variance from centred squares, a second pass over the cache.
extern "C" __global__ void __launch_bounds__(1024)
    add_layernorm_v(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                    const u16* __restrict__ bias, u16* __restrict__ out, int hidden, float eps) {
    const int nvec = hidden >> 3;
    const size_t row = (size_t)blockIdx.x * hidden;
    u32x4* res = reinterpret_cast<u32x4*>(residual + row);
    const u32x4* del = delta ? reinterpret_cast<const u32x4*>(delta + row) : nullptr;
    const u32x4* w = reinterpret_cast<const u32x4*>(weight);
    const u32x4* bv = reinterpret_cast<const u32x4*>(bias);
    u32x4* o = reinterpret_cast<u32x4*>(out + row);
    const int stride = blockDim.x;

    u32x4 cache[RMS_CACHE];
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
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) ss += ln_centred_sq(res[c], mean);
    __syncthreads();  // block_sum's partials are reused
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)hidden + eps);

#pragma unroll
    for (int j = 0; j < RMS_CACHE; ++j) {
        const int c = threadIdx.x + j * stride;
        if (c < nvec) ln_scale(cache[j], w[c], bv[c], o + c, mean, inv);
    }
    for (int c = threadIdx.x + RMS_CACHE * stride; c < nvec; c += stride) ln_scale(res[c], w[c], bv[c], o + c, mean, inv);
}

extern "C" __global__ void __launch_bounds__(1024)
    add_layernorm_s(u16* __restrict__ residual, const u16* __restrict__ delta, const u16* __restrict__ weight,
                    const u16* __restrict__ bias, u16* __restrict__ out, int hidden, float eps) {
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

// ---- activations (layer_plan::act_code): 0 none, 1 ReLU, 2 SiLU, 3 GELU (erf), 4 GELU (tanh) ----

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

extern "C" __global__ void __launch_bounds__(256)
    bias_act_v(u16* __restrict__ x, const u16* __restrict__ bias, int rows, int width, int act) {
#define FDPP_CALL(A) bias_act_vec<A>(x, bias, rows, width)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

extern "C" __global__ void __launch_bounds__(256)
    bias_act_s(u16* __restrict__ x, const u16* __restrict__ bias, int rows, int width, int act) {
#define FDPP_CALL(A) bias_act_one<A>(x, bias, rows, width)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

// ---- glu: out = act(gate) · up, grid-stride ----------------------------------------------------

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
#define FDPP_CALL(A) glu_vec<A>(gate_up, out, rows, inter)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

extern "C" __global__ void __launch_bounds__(256)
    glu_s(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter, int act) {
#define FDPP_CALL(A) glu_one<A>(gate_up, out, rows, inter)
    FDPP_ACT_SWITCH(act, FDPP_CALL)
#undef FDPP_CALL
}

// ---- add_positions: out[t] += table[rows[t]], grid (tokens, column blocks) -----------------------

extern "C" __global__ void __launch_bounds__(128)
    add_positions_v(u16* __restrict__ out, const u16* __restrict__ table, const int* __restrict__ rows, int hidden) {
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= hidden) return;
    float p[8], x[8];
    unpack8(ld16(table + (size_t)rows[blockIdx.x] * hidden + c), p);
    u16* o = out + (size_t)blockIdx.x * hidden + c;
    unpack8(ld16(o), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] += p[e];
    st16(o, pack8(x));
}

extern "C" __global__ void __launch_bounds__(128)
    add_positions_s(u16* __restrict__ out, const u16* __restrict__ table, const int* __restrict__ rows, int hidden) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    u16* o = out + (size_t)blockIdx.x * hidden + c;
    *o = from_f32(to_f32(*o) + to_f32(table[(size_t)rows[blockIdx.x] * hidden + c]));
}

// ---- qkv_rope_g: the general rotary (partial, interleaved, none), grid (tokens, item blocks) ----
// One item is 8 consecutive elements of one head; see kernels_cuda/layer.cu for the layouts.
extern "C" __global__ void __launch_bounds__(128)
    qkv_rope_g(const u16* __restrict__ qkv, const u16* __restrict__ bias, u16* __restrict__ q, u16* __restrict__ k,
               u16* __restrict__ v, const int* __restrict__ positions, const float* __restrict__ inv_freq, int H,
               int G, int D, int R, int interleaved) {
#pragma clang fp contract(off)
    const int t = blockIdx.x;
    const int item = blockIdx.y * blockDim.x + threadIdx.x;
    const int dc = D >> 3, heads = H + 2 * G, hr = R >> 1;
    if (item >= heads * dc) return;
    const int head = item / dc, c0 = (item - head * dc) * 8;
    const int off = head * D + c0;
    const u16* row = qkv + (size_t)t * (size_t)(heads * D);
    float x[8];
    unpack8(ld16(row + off), x);
    if (bias) {
        float b[8];
        unpack8(ld16(bias + off), b);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] += b[e];
    }
    if (head < H + G && c0 < R) {
        const float pos = (float)positions[t];
        float y[8];
        if (interleaved) {
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] = x[e ^ 1];
        } else if ((hr & 7) == 0) {
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
                const int pair = interleaved ? (i >> 1) : (i < hr ? i : i - hr);
                float s, c;
                sincosf(pos * inv_freq[pair], &s, &c);
                const bool first = interleaved ? (i & 1) == 0 : i < hr;
                x[e] = first ? x[e] * c - y[e] * s : x[e] * c + y[e] * s;
            }
        }
    }
    u16* dst = head < H       ? q + (size_t)t * (size_t)(H * D) + off
               : head < H + G ? k + (size_t)t * (size_t)(G * D) + (off - H * D)
                              : v + (size_t)t * (size_t)(G * D) + (off - (H + G) * D);
    st16(dst, pack8(x));
}
