//! The fused gemv ops (kernels_cuda/gemv.cu, modes RMS_IN and RESIDUAL_OUT) against the unfused
//! ops they replace on the same backend, on fresh random inputs with poisoned outputs:
//! - scale_cols on the GPU vs the CPU backend's: bit for bit (one rounding of one product);
//! - gemm_rms_in with W·diag(γ) vs add_rmsnorm(γ) (no delta) then gemm with W: max |Δ| over
//!   max |reference| ≤ 2e-3 in f16 and 1.6e-2 in bf16 (8× its coarser rounding): the fused path
//!   never rounds the normalized x and rounds W·γ once, so it is close, not bit for bit;
//! - gemm_rms_glu vs gemm_rms_in into [M, 2N] then silu_mul: bit for bit (the same roundings);
//! - gemm_residual_out vs gemm into a temporary then add_rmsnorm's residual add: bit for bit;
//! - gemm_rms_rope_append vs gemm_rms_in into qkv then qkv_rope_append: q and both whole pools
//!   bit for bit (scattered pages, ragged lengths, positions past 130000, with and without bias);
//!   partial and interleaved rotary decline;
//! - cases without a fused kernel decline with `Unsupported`.
//!
//! `fused_timings_llama2_7b_m1` prints the µs of the fused and unfused ops (not asserted).
//! Run on a GPU machine with `cargo test --release --test gpu_cuda_fused -- --ignored --test-threads 1`.

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::cuda::CudaBackend;
use fdpp::backend::Backend;
use fdpp::bench::Stats;
use fdpp::dtype::{random_bits, DType};
use fdpp::error::FdppError;
use fdpp::kv::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout};
use fdpp::ops::attention::AttnGeometry;
use fdpp::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use fdpp::ops::layer::{KvAppendParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const DTYPES: [DType; 2] = [DType::F16, DType::Bf16];
/// Every gemv layout (rows per block): K split over 4 or 2 warps, and 1..4 whole rows per warp.
const GEMV_BN: [u32; 5] = [1, 2, 4, 8, 16];
/// (K, N): Llama2-7B's QKV, O and FFN2, then K = 8·odd with odd N (partial last blocks, rows
/// past 8·1024 for add_rmsnorm's second pass, a K shorter than one warp's first loads).
const SHAPES: [(usize, usize); 6] = [
    (4096, 12288),
    (4096, 4096),
    (11008, 4096),
    (8 * 1377, 33),
    (8 * 131, 1001),
    (8 * 3, 7),
];
/// NaN in both 16-bit types (quiet, all mantissa bits set).
const POISON: u16 = 0x7fff;

/// `FDPP_FUSED_QUICK=1` (for the compute-sanitizer runs, which slow kernels many times over):
/// the small shapes, M = 1, 3, 8, and the K-split and 4-rows-per-warp layouts only.
/// A device buffer of `n` elements, every one the NaN POISON (a kernel must write what is read).
fn poisoned(gpu: &CudaBackend, dt: DType, n: usize) -> fdpp::backend::cuda::CudaBuffer {
    let mut b = gpu.alloc(dt, n).unwrap();
    gpu.fill(&mut b, POISON).unwrap();
    b
}

fn quick() -> bool {
    std::env::var_os("FDPP_FUSED_QUICK").is_some()
}

fn shapes() -> Vec<(usize, usize)> {
    SHAPES
        .iter()
        .copied()
        .filter(|&(k, n)| !quick() || n * k < 1 << 20)
        .collect()
}

fn ms() -> Vec<usize> {
    if quick() {
        vec![1, 3, 8]
    } else {
        (1..=8).collect()
    }
}

fn layouts() -> Vec<u32> {
    if quick() {
        vec![1, 16]
    } else {
        GEMV_BN.to_vec()
    }
}

fn rng() -> rand::rngs::SmallRng {
    rand::rngs::SmallRng::seed_from_u64(rand::random())
}

fn gemv(dt: DType, bn: u32) -> GemmSpec {
    GemmSpec::new(GemmImpl::Gemv, dt).with_block_n(bn)
}

/// Rows of a residual stream with different magnitudes: row m uniform in ±(1 + 3m).
fn residual_rows(dt: DType, m: usize, k: usize, seed: u64) -> Vec<u16> {
    (0..m)
        .flat_map(|r| random_bits(dt, k, 1.0 + 3.0 * r as f32, seed.wrapping_add(r as u64)))
        .collect()
}

/// Bit-identical count and max relative error (|g − w| / max(|w|, 1e-3)) of got against want;
/// a NaN in got (an unwritten, poisoned element) fails at once.
fn compare(dt: DType, got: &[u16], want: &[u16], what: &str) -> (usize, f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut same = 0;
    let mut max_rel = 0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (gf, wf) = (dt.to_f32(g) as f64, dt.to_f32(w) as f64);
        assert!(!gf.is_nan(), "{what}: element {i} is NaN (want {wf})");
        if g == w {
            same += 1;
        }
        max_rel = max_rel.max((gf - wf).abs() / wf.abs().max(1e-3));
    }
    (same, max_rel)
}

#[test]
fn fused_ops_decline_on_the_cpu_and_scale_cols_scales_each_column() {
    let cpu = CpuBackend::new();
    assert!(!cpu.fused_gemv_ops());
    let dt = DType::F16;
    let d = GemmDims::new(1, 8, 8).unwrap();
    let (x, w) = (
        cpu.upload(dt, &[0x3c00; 8]).unwrap(),
        cpu.upload(dt, &[0x3c00; 64]).unwrap(),
    );
    let mut y = cpu.alloc(dt, 8).unwrap();
    let e = cpu.gemm_rms_in(&gemv(dt, 1), d, 1e-5, &x, &w, &mut y);
    assert!(matches!(e, Err(FdppError::Unsupported { .. })), "{e:?}");
    let e = cpu.gemm_residual_out(&gemv(dt, 1), d, &x, &w, &mut y);
    assert!(matches!(e, Err(FdppError::Unsupported { .. })), "{e:?}");

    // scale_cols on [3, 5]: w[n, k] · scale[k], one rounding (values exact in f16 here).
    let wv: Vec<f32> = (0..15).map(|i| i as f32 - 7.0).collect();
    let sv = [0.5f32, -2.0, 1.0, 0.25, 3.0];
    let mut wb = cpu
        .upload(dt, &wv.iter().map(|&v| dt.from_f32(v)).collect::<Vec<_>>())
        .unwrap();
    let sb = cpu
        .upload(dt, &sv.iter().map(|&v| dt.from_f32(v)).collect::<Vec<_>>())
        .unwrap();
    cpu.scale_cols(&mut wb, &sb, 3, 5).unwrap();
    let got: Vec<f32> = cpu.download(&wb).unwrap().iter().map(|&b| dt.to_f32(b)).collect();
    let want: Vec<f32> = wv.iter().enumerate().map(|(i, &v)| v * sv[i % 5]).collect();
    assert_eq!(got, want);
    // A w that is not rows × cols, a scale that is not cols long, or two dtypes: refused.
    for (rows, cols) in [(3, 4), (4, 5), (0, 0)] {
        let e = cpu.scale_cols(&mut wb, &sb, rows, cols);
        assert!(matches!(e, Err(FdppError::Shape { .. })), "[{rows}, {cols}]: {e:?}");
    }
    let sb16 = cpu.upload(DType::Bf16, &[0x3f80; 5]).unwrap();
    let e = cpu.scale_cols(&mut wb, &sb16, 3, 5);
    assert!(matches!(e, Err(FdppError::InvalidArgument(_))), "{e:?}");
}

/// max |got − want| / max |want| (a NaN in got, an unwritten poisoned element, fails at once).
fn scaled_err(dt: DType, got: &[u16], want: &[u16], what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut diff, mut scale) = (0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (gf, wf) = (dt.to_f32(g) as f64, dt.to_f32(w) as f64);
        assert!(!gf.is_nan(), "{what}: element {i} is NaN (want {wf})");
        diff = diff.max((gf - wf).abs());
        scale = scale.max(wf.abs());
    }
    diff / scale.max(f64::MIN_POSITIVE)
}

/// W' = W·diag(γ) on the GPU: bit for bit the CPU backend's.
fn scaled_weights(gpu: &CudaBackend, dt: DType, w_bits: &[u16], g_bits: &[u16], n: usize, k: usize) -> Vec<u16> {
    let cpu = CpuBackend::new();
    let mut wc = cpu.upload(dt, w_bits).unwrap();
    cpu.scale_cols(&mut wc, &cpu.upload(dt, g_bits).unwrap(), n, k).unwrap();
    let mut wg = gpu.upload(dt, w_bits).unwrap();
    gpu.scale_cols(&mut wg, &gpu.upload(dt, g_bits).unwrap(), n, k).unwrap();
    let (host, dev) = (cpu.download(&wc).unwrap(), gpu.download(&wg).unwrap());
    assert_eq!(dev, host, "scale_cols {dt} [{n}, {k}]: GPU vs CPU");
    dev
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_in_with_folded_gamma_matches_add_rmsnorm_then_gemv() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    assert!(gpu.fused_gemv_ops());
    let mut r = rng();
    for dt in DTYPES {
        let tol = if dt == DType::F16 { 2e-3 } else { 1.6e-2 };
        let (mut cases, mut worst) = (0usize, 0f64);
        for (k, n) in shapes() {
            let w_bits = random_bits(dt, n * k, 1.0 / (k as f32).sqrt(), r.gen());
            let g_bits = random_bits(dt, k, 1.5, r.gen());
            let w = gpu.upload(dt, &w_bits).unwrap();
            let gamma = gpu.upload(dt, &g_bits).unwrap();
            let w_folded = gpu
                .upload(dt, &scaled_weights(&gpu, dt, &w_bits, &g_bits, n, k))
                .unwrap();
            for m in ms() {
                let res_bits = residual_rows(dt, m, k, r.gen());
                let res = gpu.upload(dt, &res_bits).unwrap();
                let norm = RmsNormParams {
                    rows: m,
                    hidden: k,
                    eps: 1e-5,
                    dtype: dt,
                };
                let d = GemmDims::new(m, n, k).unwrap();
                // The unfused reference: add_rmsnorm with no delta (on a copy), then gemm.
                let mut res_copy = gpu.upload(dt, &res_bits).unwrap();
                let mut xn = gpu.alloc(dt, m * k).unwrap();
                gpu.add_rmsnorm(&norm, &mut res_copy, None, &gamma, &mut xn).unwrap();
                for bn in layouts() {
                    let spec = gemv(dt, bn);
                    let what = format!("rms_in {spec} M={m} N={n} K={k}");
                    let mut want = poisoned(&gpu, dt, m * n);
                    gpu.gemm(&spec, d, &xn, &w, &mut want).unwrap();
                    let mut got = poisoned(&gpu, dt, m * n);
                    gpu.gemm_rms_in(&spec, d, norm.eps, &res, &w_folded, &mut got)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let err = scaled_err(dt, &gpu.download(&got).unwrap(), &gpu.download(&want).unwrap(), &what);
                    assert!(err <= tol, "{what}: max |Δ| / max |ref| = {err:.3e} (tolerance {tol})");
                    cases += 1;
                    worst = worst.max(err);
                }
                assert_eq!(
                    gpu.download(&res).unwrap(),
                    res_bits,
                    "rms_in wrote its residual (M={m} K={k})"
                );
            }
        }
        println!("rms_in {dt}: {cases} cases, worst max |Δ| / max |ref| {worst:.3e} (tolerance {tol})");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_glu_is_rms_in_then_silu_mul_bit_for_bit() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        let mut total = 0usize;
        // (K, N) of SHAPES with N as the intermediate width: W has 2N rows (gate, then up).
        for (k, inter) in shapes() {
            let w = gpu
                .upload(dt, &random_bits(dt, 2 * inter * k, 1.0 / (k as f32).sqrt(), r.gen()))
                .unwrap();
            for m in ms() {
                let res = gpu.upload(dt, &residual_rows(dt, m, k, r.gen())).unwrap();
                for bn in layouts() {
                    let spec = gemv(dt, bn);
                    let what = format!("rms_glu {spec} M={m} N={inter} K={k}");
                    let mut gate_up = poisoned(&gpu, dt, m * 2 * inter);
                    // The reference splits K over 4 warps as the GLU entries do (bn1): every dot
                    // product is then summed in the same order.
                    gpu.gemm_rms_in(
                        &gemv(dt, 1),
                        GemmDims::new(m, 2 * inter, k).unwrap(),
                        1e-5,
                        &res,
                        &w,
                        &mut gate_up,
                    )
                    .unwrap();
                    let mut want = poisoned(&gpu, dt, m * inter);
                    let sp = SiluMulParams {
                        rows: m,
                        inter,
                        dtype: dt,
                    };
                    gpu.silu_mul(&sp, &gate_up, &mut want).unwrap();
                    let mut got = poisoned(&gpu, dt, m * inter);
                    gpu.gemm_rms_glu(&spec, GemmDims::new(m, inter, k).unwrap(), 1e-5, &res, &w, &mut got)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let (same, rel) = compare(dt, &gpu.download(&got).unwrap(), &gpu.download(&want).unwrap(), &what);
                    assert_eq!(
                        same,
                        m * inter,
                        "{what}: {} of {} differ (max rel {rel:.3e})",
                        m * inter - same,
                        m * inter
                    );
                    total += m * inter;
                }
            }
        }
        println!("rms_glu {dt}: {total} of {total} elements bit-identical");
    }
}

/// One decode step's rotary inputs: `m` sequences at ragged lengths over scattered pages of a
/// 16-token pool, one new token each; positions len − 1, past 130000 for every other sequence
/// (sincosf's long-argument path; the rotary does not read the cache).
fn rope_step(
    r: &mut rand::rngs::SmallRng,
    dt: DType,
    (h, g, d): (usize, usize, usize),
    m: usize,
    rot: usize,
    layout_kind: RopeLayout,
) -> (RopeParams, KvAppendParams, PagedKvLayout) {
    let layout = PagedKvLayout::new(16, 12 * m, g, d, dt).unwrap();
    let mut pages: Vec<u32> = (0..12 * m as u32).collect();
    pages.shuffle(r);
    let lens: Vec<usize> = (0..m).map(|i| [1, 17, 100, 33, 160, 2, 64, 129][i % 8]).collect();
    let mut at = 0;
    let tables: Vec<BlockTable> = lens
        .iter()
        .map(|&len| {
            let n = layout.pages_for(len);
            at += n;
            BlockTable {
                pages: pages[at - n..at].to_vec(),
                seq_len: len,
            }
        })
        .collect();
    let append = KvAppendParams {
        tables: FlatBlockTables::new(&layout, &tables).unwrap(),
        new_lens: vec![1; m],
    };
    let rope = RopeParams {
        geom: AttnGeometry::new(h, g, d).unwrap(),
        dtype: dt,
        positions: lens
            .iter()
            .enumerate()
            .map(|(i, &l)| (l - 1 + if i % 2 == 1 { 130_000 } else { 0 }) as i32)
            .collect(),
        inv_freq: (0..rot / 2)
            .map(|i| 500_000f32.powf(-2.0 * i as f32 / rot as f32))
            .collect(),
        layout: layout_kind,
    };
    (rope, append, layout)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_rope_append_is_rms_in_then_rope_append_bit_for_bit() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        let mut total = 0usize;
        // (H, G, D, K, bias): Llama-3.1-8B's QKV, Llama2-7B's with a bias (Qwen2's form),
        // head_dim 64 and 256, K of one warp's first loads and less.
        for (h, g, d, k, with_bias) in [
            (32, 8, 128, 4096, false),
            (32, 32, 128, 4096, true),
            (12, 4, 64, 8 * 131, true),
            (8, 2, 256, 8 * 3, false),
        ] {
            let n = (h + 2 * g) * d;
            if quick() && n * k >= 1 << 22 {
                continue;
            }
            let w = gpu
                .upload(dt, &random_bits(dt, n * k, 1.0 / (k as f32).sqrt(), r.gen()))
                .unwrap();
            let bias = with_bias.then(|| gpu.upload(dt, &random_bits(dt, n, 0.5, r.gen())).unwrap());
            for m in ms() {
                let (rope, append, layout) = rope_step(&mut r, dt, (h, g, d), m, d, RopeLayout::Half);
                let res = gpu.upload(dt, &residual_rows(dt, m, k, r.gen())).unwrap();
                let pool_k = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
                let pool_v = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
                let new_kv = |gpu: &CudaBackend| PagedKv {
                    layout,
                    k: gpu.upload(dt, &pool_k).unwrap(),
                    v: gpu.upload(dt, &pool_v).unwrap(),
                };
                let dims = GemmDims::new(m, n, k).unwrap();
                let what = format!("rms_rope_append {dt} H{h}/G{g} d{d} K={k} M={m} bias={with_bias}");
                // The reference: the same K split as the fused entries (bn1: K over 4 warps).
                let mut qkv = poisoned(&gpu, dt, m * n);
                gpu.gemm_rms_in(&gemv(dt, 1), dims, 1e-5, &res, &w, &mut qkv).unwrap();
                let mut kv_want = new_kv(&gpu);
                let mut q_want = poisoned(&gpu, dt, m * h * d);
                let mut k_tmp = poisoned(&gpu, dt, m * g * d);
                let mut v_tmp = poisoned(&gpu, dt, m * g * d);
                gpu.qkv_rope_append(
                    &rope,
                    &append,
                    &qkv,
                    bias.as_ref(),
                    &mut q_want,
                    &mut k_tmp,
                    &mut v_tmp,
                    &mut kv_want,
                )
                .unwrap();
                let mut kv_got = new_kv(&gpu);
                let mut q_got = poisoned(&gpu, dt, m * h * d);
                // The profile's layout for the QKV spec does not matter: the entries have their own.
                gpu.gemm_rms_rope_append(
                    &gemv(dt, 16),
                    dims,
                    1e-5,
                    &res,
                    &w,
                    &rope,
                    &append,
                    bias.as_ref(),
                    &mut q_got,
                    &mut kv_got,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                for (name, got, want) in [
                    ("q", &q_got, &q_want),
                    ("K pool", &kv_got.k, &kv_want.k),
                    ("V pool", &kv_got.v, &kv_want.v),
                ] {
                    let (g_bits, w_bits) = (gpu.download(got).unwrap(), gpu.download(want).unwrap());
                    let (same, rel) = compare(dt, &g_bits, &w_bits, &format!("{what}: {name}"));
                    assert_eq!(
                        same,
                        w_bits.len(),
                        "{what}: {name}: {} of {} differ (max rel {rel:.3e})",
                        w_bits.len() - same,
                        w_bits.len()
                    );
                    total += same;
                }
            }
        }
        println!("rms_rope_append {dt}: {total} of {total} elements bit-identical (q and whole pools)");
    }
    // What the kernel does not rotate: declined, nothing written.
    let dt = DType::F16;
    for (h, g, d, rot, kind) in [
        (32, 2, 128, 64, RopeLayout::Interleaved),
        (8, 2, 256, 32, RopeLayout::Half),
        (4, 4, 64, 0, RopeLayout::Half),
    ] {
        let (rope, append, layout) = rope_step(&mut r, dt, (h, g, d), 1, rot, kind);
        let (n, k) = ((h + 2 * g) * d, 64);
        let w = gpu.upload(dt, &random_bits(dt, n * k, 0.1, r.gen())).unwrap();
        let res = gpu.upload(dt, &residual_rows(dt, 1, k, r.gen())).unwrap();
        let mut q = poisoned(&gpu, dt, h * d);
        let mut kv = PagedKv {
            layout,
            k: poisoned(&gpu, dt, layout.pool_elems()),
            v: poisoned(&gpu, dt, layout.pool_elems()),
        };
        let e = gpu.gemm_rms_rope_append(
            &gemv(dt, 1),
            GemmDims::new(1, n, k).unwrap(),
            1e-5,
            &res,
            &w,
            &rope,
            &append,
            None,
            &mut q,
            &mut kv,
        );
        assert!(
            matches!(e, Err(FdppError::Unsupported { .. })),
            "rotary {rot} of {d} {kind:?}: {e:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn residual_out_is_gemv_then_add_bit_for_bit() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        let mut total = 0usize;
        for (k, n) in shapes() {
            let w = gpu.upload(dt, &random_bits(dt, n * k, 1.0, r.gen())).unwrap();
            // add_rmsnorm needs a weight and an output; only its residual is compared.
            let gamma = gpu.upload(dt, &random_bits(dt, n, 1.0, r.gen())).unwrap();
            for m in ms() {
                let x = gpu
                    .upload(dt, &random_bits(dt, m * k, 1.0 / (k as f32).sqrt(), r.gen()))
                    .unwrap();
                let res_bits = residual_rows(dt, m, n, r.gen());
                let d = GemmDims::new(m, n, k).unwrap();
                let norm = RmsNormParams {
                    rows: m,
                    hidden: n,
                    eps: 1e-5,
                    dtype: dt,
                };
                for bn in layouts() {
                    let spec = gemv(dt, bn);
                    let what = format!("residual_out {spec} M={m} N={n} K={k}");
                    let mut tmp = poisoned(&gpu, dt, m * n);
                    gpu.gemm(&spec, d, &x, &w, &mut tmp).unwrap();
                    let mut want = gpu.upload(dt, &res_bits).unwrap();
                    let mut normed = gpu.alloc(dt, m * n).unwrap();
                    gpu.add_rmsnorm(&norm, &mut want, Some(&tmp), &gamma, &mut normed)
                        .unwrap();
                    let want = gpu.download(&want).unwrap();
                    // The same add on the host, from the downloaded product.
                    let host: Vec<u16> = res_bits
                        .iter()
                        .zip(gpu.download(&tmp).unwrap())
                        .map(|(&a, b)| dt.from_f32(dt.to_f32(a) + dt.to_f32(b)))
                        .collect();
                    assert_eq!(want, host, "{what}: add_rmsnorm's add vs the host's");
                    let mut got = gpu.upload(dt, &res_bits).unwrap();
                    gpu.gemm_residual_out(&spec, d, &x, &w, &mut got)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = gpu.download(&got).unwrap();
                    let (same, _) = compare(dt, &got, &want, &what);
                    assert_eq!(same, m * n, "{what}: {} of {} differ", m * n - same, m * n);
                    total += m * n;
                }
            }
        }
        println!("residual_out {dt}: {total} of {total} elements bit-identical");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cases_without_a_fused_kernel_decline() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let dt = DType::F16;
    let (m_max, n, k_max) = (9, 64, 4104);
    let x = gpu.upload(dt, &random_bits(dt, m_max * k_max, 1.0, 1)).unwrap();
    let w = gpu.upload(dt, &random_bits(dt, n * k_max, 1.0, 2)).unwrap();
    let mut y = gpu.alloc(dt, m_max * n).unwrap();
    let cases = [
        (gemv(dt, 1), 9, 4096, "M = 9"),
        (gemv(dt, 8), 1, 4100, "K % 8 != 0"),
        (gemv(dt, 8), 2, 4097, "K % 8 != 0"),
        (
            GemmSpec::new(GemmImpl::FlatGemm, dt).with_block_n(64),
            1,
            4096,
            "flat_gemm",
        ),
        (GemmSpec::new(GemmImpl::Gemm, dt), 1, 4096, "cuBLAS"),
    ];
    for (spec, m, k, why) in cases {
        let d = GemmDims::new(m, n, k).unwrap();
        let e = gpu.gemm_rms_in(&spec, d, 1e-5, &x, &w, &mut y);
        assert!(matches!(e, Err(FdppError::Unsupported { .. })), "rms_in {why}: {e:?}");
        let half = GemmDims::new(m, n / 2, k).unwrap();
        let e = gpu.gemm_rms_glu(&spec, half, 1e-5, &x, &w, &mut y);
        assert!(matches!(e, Err(FdppError::Unsupported { .. })), "rms_glu {why}: {e:?}");
        let e = gpu.gemm_residual_out(&spec, d, &x, &w, &mut y);
        assert!(
            matches!(e, Err(FdppError::Unsupported { .. })),
            "residual_out {why}: {e:?}"
        );
    }
    // An eps that is not finite and positive is refused before any launch.
    let d = GemmDims::new(2, n, 4096).unwrap();
    for eps in [0.0, -1e-5, f32::NAN] {
        let e = gpu.gemm_rms_in(&gemv(dt, 8), d, eps, &x, &w, &mut y);
        assert!(matches!(e, Err(FdppError::InvalidArgument(_))), "eps {eps}: {e:?}");
    }
    // Buffers too short for the dims: a shape error.
    let short = gpu.alloc(dt, 10).unwrap();
    let e = gpu.gemm_residual_out(&gemv(dt, 8), d, &short, &w, &mut y);
    assert!(matches!(e, Err(FdppError::Shape { .. })), "{e:?}");
    let e = gpu.gemm_rms_in(&gemv(dt, 8), d, 1e-5, &short, &w, &mut y);
    assert!(matches!(e, Err(FdppError::Shape { .. })), "{e:?}");
    // W must hold 2N rows and y N columns per row.
    let d = GemmDims::new(2, n / 2, 4096).unwrap();
    let e = gpu.gemm_rms_glu(&gemv(dt, 8), d, 1e-5, &x, &short, &mut y);
    assert!(matches!(e, Err(FdppError::Shape { .. })), "{e:?}");
    let mut y_short = gpu.alloc(dt, n - 1).unwrap();
    let e = gpu.gemm_rms_glu(&gemv(dt, 8), d, 1e-5, &x, &w, &mut y_short);
    assert!(matches!(e, Err(FdppError::Shape { .. })), "{e:?}");
    gpu.synchronize().unwrap();
}

/// Median µs of `f` over `reps` back-to-back runs (PDL-chained as in a decode step).
fn time_us(gpu: &CudaBackend, reps: usize, f: &mut dyn FnMut(usize) -> fdpp::error::Result<()>) -> f64 {
    let ms = gpu.time_each(reps, f).unwrap();
    Stats::from_ms(&ms).unwrap().median_us
}

/// Llama2-7B at M = 1 (f16): each fused op against the ops it replaces, and the two kernel
/// pairs of a layer that fusion changes (O → FFN1 and FFN2 → next QKV). Weights are cycled over
/// copies (≥ 150 MB) so no run finds its weights in L2. Printed, not asserted.
#[test]
#[ignore = "needs a CUDA GPU; prints timings"]
fn fused_timings_llama2_7b_m1() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let dt = DType::F16;
    let reps = 200;
    let hidden = 4096;
    let mut r = rng();
    let upload_copies = |r: &mut rand::rngs::SmallRng, n: usize, k: usize| {
        let copies = (150usize << 20).div_ceil(2 * n * k).clamp(2, 8);
        (0..copies)
            .map(|_| {
                gpu.upload(dt, &random_bits(dt, n * k, 1.0 / (k as f32).sqrt(), r.gen()))
                    .unwrap()
            })
            .collect::<Vec<_>>()
    };
    let shapes = [
        ("qkv", 4096, 12288),
        ("o", 4096, 4096),
        ("ffn1", 4096, 22016),
        ("ffn2", 11008, 4096),
    ];
    let ws: Vec<_> = shapes.iter().map(|&(_, k, n)| upload_copies(&mut r, n, k)).collect();
    let gamma = gpu.upload(dt, &random_bits(dt, hidden, 1.5, r.gen())).unwrap();
    let res = gpu.upload(dt, &residual_rows(dt, 1, hidden, r.gen())).unwrap();
    let mut res_w = gpu.upload(dt, &residual_rows(dt, 1, hidden, r.gen())).unwrap();
    let x_big = gpu.upload(dt, &random_bits(dt, 11008, 0.01, r.gen())).unwrap();
    let mut xn = gpu.alloc(dt, hidden).unwrap();
    let mut y = gpu.alloc(dt, 22016).unwrap();
    let mut y2 = gpu.alloc(dt, 22016).unwrap();
    let norm = RmsNormParams {
        rows: 1,
        hidden,
        eps: 1e-5,
        dtype: dt,
    };
    let mut scratch = gpu.upload(dt, &residual_rows(dt, 1, hidden, r.gen())).unwrap();
    gpu.add_rmsnorm(&norm, &mut scratch, None, &gamma, &mut xn).unwrap();
    // The producers' inputs (attention output, SiLU·mul output).
    let x_attn = gpu.upload(dt, &random_bits(dt, hidden, 0.5, r.gen())).unwrap();
    let x_for = |k: usize| if k == hidden { &x_attn } else { &x_big };

    // Per shape: plain gemv of every layout, the fused op of every layout; the best plain
    // layout is the one the profile would pick, and the chains below use it.
    let mut best = vec![];
    for (si, &(name, k, n)) in shapes.iter().enumerate() {
        let d = GemmDims::new(1, n, k).unwrap();
        let w = &ws[si];
        let c = w.len();
        let x = if name == "o" || name == "ffn2" { x_for(k) } else { &xn };
        let mut line = format!("{name:5} [K={k}, N={n}] M=1:");
        let mut best_bn = (f64::INFINITY, 0);
        for bn in GEMV_BN {
            let spec = gemv(dt, bn);
            let plain = time_us(&gpu, reps, &mut |i| gpu.gemm(&spec, d, x, &w[i % c], &mut y));
            let fused = if name == "qkv" || name == "ffn1" {
                time_us(&gpu, reps, &mut |i| {
                    gpu.gemm_rms_in(&spec, d, norm.eps, &res, &w[i % c], &mut y)
                })
            } else {
                time_us(&gpu, reps, &mut |i| {
                    gpu.gemm_residual_out(&spec, d, x, &w[i % c], &mut res_w)
                })
            };
            line += &format!(" bn{bn} gemv {plain:.2} fused {fused:.2} |");
            if plain < best_bn.0 {
                best_bn = (plain, bn);
            }
        }
        println!("{line}");
        best.push(best_bn.1);
    }
    let spec = |si: usize| gemv(dt, best[si]);
    let dims = |si: usize| GemmDims::new(1, shapes[si].2, shapes[si].1).unwrap();

    // Single ops with the best layout.
    for (si, consumer) in [(0usize, true), (2, true), (1, false), (3, false)] {
        let (name, w, c) = (shapes[si].0, &ws[si], ws[si].len());
        let (s, d) = (spec(si), dims(si));
        let x = x_for(shapes[si].1);
        let (unfused, fused) = if consumer {
            let u = time_us(&gpu, reps, &mut |i| {
                gpu.add_rmsnorm(&norm, &mut res_w, None, &gamma, &mut xn)?;
                gpu.gemm(&s, d, &xn, &w[i % c], &mut y)
            });
            let f = time_us(&gpu, reps, &mut |i| {
                gpu.gemm_rms_in(&s, d, norm.eps, &res, &w[i % c], &mut y)
            });
            (u, f)
        } else {
            let u = time_us(&gpu, reps, &mut |i| {
                gpu.gemm(&s, d, x, &w[i % c], &mut y2)?;
                gpu.add_rmsnorm(&norm, &mut res_w, Some(&y2), &gamma, &mut xn)
            });
            let f = time_us(&gpu, reps, &mut |i| {
                gpu.gemm_residual_out(&s, d, x, &w[i % c], &mut res_w)
            });
            (u, f)
        };
        let what = if consumer {
            "add_rmsnorm + gemv  vs  gemv_rms"
        } else {
            "gemv + add_rmsnorm(delta)  vs  gemv_res (no norm)"
        };
        println!("{name:5} bn{}: {what}: {unfused:.2} µs vs {fused:.2} µs", best[si]);
    }

    // FFN1 with silu_mul as its epilogue against the two launches, at the fused kernels' M = 1.
    {
        let (w, c) = (&ws[2], ws[2].len());
        let inter = shapes[2].2 / 2;
        let (s, d) = (spec(2), dims(2));
        let half = GemmDims::new(1, inter, hidden).unwrap();
        let sp = SiluMulParams {
            rows: 1,
            inter,
            dtype: dt,
        };
        let mut act = gpu.alloc(dt, inter).unwrap();
        let unfused = time_us(&gpu, reps, &mut |i| {
            gpu.gemm_rms_in(&s, d, norm.eps, &res, &w[i % c], &mut y)?;
            gpu.silu_mul(&sp, &y, &mut act)
        });
        let fused = time_us(&gpu, reps, &mut |i| {
            gpu.gemm_rms_glu(&s, half, norm.eps, &res, &w[i % c], &mut act)
        });
        println!("ffn1: gemv_rms + silu_mul {unfused:.2} µs vs gemv_rms_glu {fused:.2} µs");
    }

    // The layer's pairs: O → FFN1 and FFN2 → QKV, unfused (gemv, add_rmsnorm with the delta,
    // gemv) against fused (gemv_res, gemv_rms).
    for (prod, cons) in [(1usize, 2usize), (3, 0)] {
        let (wp, cp, wc, cc) = (&ws[prod], ws[prod].len(), &ws[cons], ws[cons].len());
        let (sp, dp, sc, dc) = (spec(prod), dims(prod), spec(cons), dims(cons));
        let xp = x_for(shapes[prod].1);
        let unfused = time_us(&gpu, reps, &mut |i| {
            gpu.gemm(&sp, dp, xp, &wp[i % cp], &mut y2)?;
            gpu.add_rmsnorm(&norm, &mut res_w, Some(&y2), &gamma, &mut xn)?;
            gpu.gemm(&sc, dc, &xn, &wc[i % cc], &mut y)
        });
        let fused = time_us(&gpu, reps, &mut |i| {
            gpu.gemm_residual_out(&sp, dp, xp, &wp[i % cp], &mut res_w)?;
            gpu.gemm_rms_in(&sc, dc, norm.eps, &res_w, &wc[i % cc], &mut y)
        });
        println!(
            "pair {} -> {}: unfused (gemv, add_rmsnorm, gemv) {unfused:.2} µs, fused (gemv_res, gemv_rms) {fused:.2} µs, saved {:.2} µs",
            shapes[prod].0,
            shapes[cons].0,
            unfused - fused
        );
    }
}
