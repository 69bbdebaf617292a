//! The fused prefill ops (fdpp's wgmma GEMM with epilogues, src/backend/cuda/gemm_epi.rs) against
//! the unfused ops they replace on the same GPU, on fresh random inputs with poisoned outputs, at
//! prefill sizes with ragged last tiles on every axis:
//! - prefill_residual_out vs the Hopper GEMM of the same tile, then add_rmsnorm's residual add:
//!   bit for bit;
//! - prefill_rms_in with those row sums vs add_rmsnorm (γ folded: ones) then the Hopper GEMM:
//!   close (max |Δ| / max |reference| ≤ 2e-3 f16, 1.6e-2 bf16), as the fused GEMV is;
//! - prefill_rms_glu vs prefill_rms_in into [M, 2N] then silu_mul: close (its SiLU is the fast form),
//!   bit-identical share printed;
//! - prefill_rms_rope_append vs prefill_rms_in into qkv then qkv_rope_append: q and both whole
//!   pools bit for bit (a chunk behind a cached prefix and a fresh sequence, scattered pages);
//! - what the epilogues do not take (head_dim 64, an interleaved rotary, K not a multiple of 8)
//!   declines with `Unsupported`; the CPU has no fused prefill.
//!
//! Run on an sm_90a GPU: `cargo test --release --test gpu_cuda_prefill_fused -- --ignored --test-threads 1`.

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::cuda::gemm_epi::{pick_tile, Epi};
use fdpp::backend::cuda::{CudaBackend, CudaBuffer};
use fdpp::backend::Backend;
use fdpp::dtype::{random_bits, DType};
use fdpp::error::FdppError;
use fdpp::kv::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout};
use fdpp::ops::attention::AttnGeometry;
use fdpp::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use fdpp::ops::layer::{KvAppendParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const DTYPES: [DType; 2] = [DType::F16, DType::Bf16];
const POISON: u16 = 0x7fff;
const EPS: f32 = 1e-5;

fn rng() -> rand::rngs::SmallRng {
    rand::rngs::SmallRng::seed_from_u64(rand::random())
}

/// `FDPP_PREFILL_FUSED_QUICK=1` (for the compute-sanitizer runs, which slow kernels many times
/// over): only the problems of at most 2^28 multiply-adds.
fn keep(m: usize, n: usize, k: usize) -> bool {
    std::env::var_os("FDPP_PREFILL_FUSED_QUICK").is_none() || m * n * k <= 1 << 28
}

fn tol(dt: DType) -> f64 {
    if dt == DType::F16 {
        2e-3
    } else {
        1.6e-2
    }
}

fn gpu() -> Option<CudaBackend> {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    if gpu.prefill_fusion(DType::F16) {
        Some(gpu)
    } else {
        eprintln!("skipped: {} has no fused prefill (sm_90a only)", gpu.info().arch);
        None
    }
}

fn poisoned(gpu: &CudaBackend, dt: DType, n: usize) -> CudaBuffer {
    let mut b = gpu.alloc(dt, n).unwrap();
    gpu.fill(&mut b, POISON).unwrap();
    b
}

/// Rows of a residual stream with different magnitudes: row m uniform in ±(1 + (m % 7)).
fn residual_rows(dt: DType, m: usize, k: usize, seed: u64) -> Vec<u16> {
    (0..m)
        .flat_map(|r| random_bits(dt, k, 1.0 + (r % 7) as f32, seed.wrapping_add(r as u64)))
        .collect()
}

/// The plain Hopper GEMM spec with the tile the fused op picks (the same accumulation order).
fn plain(gpu: &CudaBackend, dt: DType, epi: Epi, m: usize, n: usize) -> GemmSpec {
    let t = pick_tile(epi, m, n, gpu.info().compute_units);
    GemmSpec::new(GemmImpl::Gemm, dt)
        .with_block_n(t.bn)
        .with_stages(t.stages)
}

/// Bit-identical count; a NaN in got (an unwritten, poisoned element) fails at once.
fn same_bits(dt: DType, got: &[u16], want: &[u16], what: &str) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut same = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            !dt.to_f32(g).is_nan() || dt.to_f32(w).is_nan(),
            "{what}: element {i} is NaN"
        );
        same += usize::from(g == w);
    }
    same
}

/// max |got − want| / max |want|; a NaN in got fails at once.
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

/// rmsnorm(x) with unit γ (what the folded weights expect) by the unfused kernel.
fn normed(gpu: &CudaBackend, dt: DType, x: &mut CudaBuffer, m: usize, k: usize) -> CudaBuffer {
    let ones = gpu.upload(dt, &vec![dt.from_f32(1.0); k]).unwrap();
    let mut out = poisoned(gpu, dt, m * k);
    let p = RmsNormParams {
        rows: m,
        hidden: k,
        eps: EPS,
        dtype: dt,
    };
    gpu.add_rmsnorm(&p, x, None, &ones, &mut out).unwrap();
    out
}

/// (M, N, K): Llama2-7B's O at 1024 rows, then ragged tiles on every axis and a lone M tile.
const RES_SHAPES: [(usize, usize, usize); 3] = [(1024, 4096, 4096), (333, 1032, 1000), (77, 520, 264)];

#[test]
#[ignore = "needs an sm_90a GPU"]
fn residual_out_is_the_gemm_then_the_add_and_its_sums_feed_rms_in() {
    let Some(gpu) = gpu() else { return };
    let mut r = rng();
    for dt in DTYPES {
        for (m, h, k) in RES_SHAPES.into_iter().filter(|&(m, h, k)| keep(m, h, k)) {
            let what = format!("prefill_residual_out {dt} M={m} N={h} K={k}");
            let x = gpu.upload(dt, &random_bits(dt, m * k, 1.0, r.gen())).unwrap();
            let w = gpu
                .upload(dt, &random_bits(dt, h * k, 2.0 / (k as f32).sqrt(), r.gen()))
                .unwrap();
            let res_bits = residual_rows(dt, m, h, r.gen());
            let dims = GemmDims::new(m, h, k).unwrap();
            // The reference: the same tile's plain product, then add_rmsnorm's residual add.
            let mut y = poisoned(&gpu, dt, m * h);
            gpu.gemm(&plain(&gpu, dt, Epi::ResSs, m, h), dims, &x, &w, &mut y)
                .unwrap();
            let mut want = gpu.upload(dt, &res_bits).unwrap();
            let ones = gpu.upload(dt, &vec![dt.from_f32(1.0); h]).unwrap();
            let mut scratch = poisoned(&gpu, dt, m * h);
            let p = RmsNormParams {
                rows: m,
                hidden: h,
                eps: EPS,
                dtype: dt,
            };
            gpu.add_rmsnorm(&p, &mut want, Some(&y), &ones, &mut scratch).unwrap();
            let mut got = gpu.upload(dt, &res_bits).unwrap();
            let mut ss = poisoned(&gpu, dt, gpu.row_sums_len(m, h));
            let sums = gpu
                .prefill_residual_out(dims, &x, &w, &mut got, &mut ss)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!((sums.rows, sums.cols), (m, h), "{what}: {sums:?}");
            let (gb, wb) = (gpu.download(&got).unwrap(), gpu.download(&want).unwrap());
            let same = same_bits(dt, &gb, &wb, &what);
            assert_eq!(same, wb.len(), "{what}: {} of {} differ", wb.len() - same, wb.len());

            // Its row sums as the next norm's statistics: QKV-like N = 640 on the new residual.
            let n2 = 640;
            let what = format!(
                "prefill_rms_in {dt} M={m} N={n2} K={h} (row sums of {} parts)",
                sums.parts
            );
            let w2 = gpu
                .upload(dt, &random_bits(dt, n2 * h, 1.0 / (h as f32).sqrt(), r.gen()))
                .unwrap();
            let d2 = GemmDims::new(m, n2, h).unwrap();
            let mut y_got = poisoned(&gpu, dt, m * n2);
            gpu.prefill_rms_in(d2, sums, EPS, &ss, &got, &w2, &mut y_got)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let xn = normed(&gpu, dt, &mut got, m, h);
            let mut y_want = poisoned(&gpu, dt, m * n2);
            gpu.gemm(&plain(&gpu, dt, Epi::StoreRs, m, n2), d2, &xn, &w2, &mut y_want)
                .unwrap();
            let e = scaled_err(
                dt,
                &gpu.download(&y_got).unwrap(),
                &gpu.download(&y_want).unwrap(),
                &what,
            );
            assert!(e <= tol(dt), "{what}: error {e:.3e} of the largest value");
            println!("{what}: residual bit for bit; rms_in error {e:.2e}");
        }
    }
}

#[test]
#[ignore = "needs an sm_90a GPU"]
fn rms_glu_is_rms_in_then_silu_mul() {
    let Some(gpu) = gpu() else { return };
    let mut r = rng();
    for dt in DTYPES {
        // (M, inter, K): Llama2-7B's FFN1 at 1024 rows (the 96 + 96 tile), 2048 rows of 2048
        // (128 + 128), ragged tiles on every axis and an odd cluster pair.
        for (m, inter, k) in [
            (1024, 11008, 4096),
            (2048, 2048, 1032),
            (333, 1000, 1032),
            (77, 264, 64),
        ] {
            if !keep(m, 2 * inter, k) {
                continue;
            }
            let what = format!("prefill_rms_glu {dt} M={m} inter={inter} K={k}");
            let x_bits = residual_rows(dt, m, k, r.gen());
            let x = gpu.upload(dt, &x_bits).unwrap();
            let w = gpu
                .upload(dt, &random_bits(dt, 2 * inter * k, 1.0 / (k as f32).sqrt(), r.gen()))
                .unwrap();
            let mut ss = poisoned(&gpu, dt, gpu.row_sums_len(m, k));
            let sums = gpu.prefill_row_sumsq(m, k, &x, &mut ss).unwrap();
            let mut got = poisoned(&gpu, dt, m * inter);
            gpu.prefill_rms_glu(GemmDims::new(m, inter, k).unwrap(), sums, EPS, &ss, &x, &w, &mut got)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut gate_up = poisoned(&gpu, dt, m * 2 * inter);
            gpu.prefill_rms_in(
                GemmDims::new(m, 2 * inter, k).unwrap(),
                sums,
                EPS,
                &ss,
                &x,
                &w,
                &mut gate_up,
            )
            .unwrap();
            let mut want = poisoned(&gpu, dt, m * inter);
            let p = SiluMulParams {
                rows: m,
                inter,
                dtype: dt,
            };
            gpu.silu_mul(&p, &gate_up, &mut want).unwrap();
            let (gb, wb) = (gpu.download(&got).unwrap(), gpu.download(&want).unwrap());
            let same = same_bits(dt, &gb, &wb, &what);
            let e = scaled_err(dt, &gb, &wb, &what);
            assert!(e <= tol(dt), "{what}: error {e:.3e} of the largest value");
            println!("{what}: {same} of {} bit-identical, error {e:.2e}", wb.len());
        }
    }
}

/// A prefill step's rotary inputs: a chunk of `m - fresh` tokens behind `cached` tokens and a
/// fresh sequence of `fresh`, over scattered pages of 16; positions from the cached length on.
fn prefill_step(
    r: &mut rand::rngs::SmallRng,
    dt: DType,
    (h, g, d): (usize, usize, usize),
    (m, cached, fresh): (usize, usize, usize),
    kind: RopeLayout,
) -> (RopeParams, KvAppendParams, PagedKvLayout) {
    let chunk = m - fresh;
    let lens = [cached + chunk, fresh];
    let layout = PagedKvLayout::new(16, (lens[0] + lens[1]) / 16 + 8, g, d, dt).unwrap();
    let mut pages: Vec<u32> = (0..layout.num_pages as u32).collect();
    pages.shuffle(r);
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
        new_lens: vec![chunk as i32, fresh as i32],
    };
    let positions = (cached..cached + chunk).chain(0..fresh).map(|p| p as i32).collect();
    let rope = RopeParams {
        geom: AttnGeometry::new(h, g, d).unwrap(),
        dtype: dt,
        positions,
        inv_freq: (0..d / 2)
            .map(|i| 500_000f32.powf(-2.0 * i as f32 / d as f32))
            .collect(),
        layout: kind,
    };
    (rope, append, layout)
}

#[test]
#[ignore = "needs an sm_90a GPU"]
fn rms_rope_append_is_rms_in_then_qkv_rope_append_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let mut r = rng();
    for dt in DTYPES {
        // (H, G, K; M, cached, fresh): Llama-3.1-8B's heads at a 1024-token step (a chunk behind
        // 12000 cached keys: positions past 12000), Llama2-7B's at 333, an odd 3/1 whose last
        // 128 × 256 tile holds one head.
        for ((h, g, k), step) in [
            ((32, 8, 4096), (1024, 12000, 24)),
            ((32, 32, 1032), (333, 0, 111)),
            ((3, 1, 264), (77, 5, 3)),
        ] {
            let d = 128;
            let n = (h + 2 * g) * d;
            let m = step.0;
            if !keep(m, n, k) {
                continue;
            }
            let what = format!("prefill_rms_rope_append {dt} H{h}/G{g} K={k} M={m} behind {}", step.1);
            let (rope, append, layout) = prefill_step(&mut r, dt, (h, g, d), step, RopeLayout::Half);
            let x = gpu.upload(dt, &residual_rows(dt, m, k, r.gen())).unwrap();
            let w = gpu
                .upload(dt, &random_bits(dt, n * k, 1.0 / (k as f32).sqrt(), r.gen()))
                .unwrap();
            let pool_k = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
            let pool_v = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
            let new_kv = |gpu: &CudaBackend| PagedKv {
                layout,
                k: gpu.upload(dt, &pool_k).unwrap(),
                v: gpu.upload(dt, &pool_v).unwrap(),
            };
            let mut ss = poisoned(&gpu, dt, gpu.row_sums_len(m, k));
            let sums = gpu.prefill_row_sumsq(m, k, &x, &mut ss).unwrap();
            let dims = GemmDims::new(m, n, k).unwrap();
            let mut qkv = poisoned(&gpu, dt, m * n);
            gpu.prefill_rms_in(dims, sums, EPS, &ss, &x, &w, &mut qkv).unwrap();
            let mut kv_want = new_kv(&gpu);
            let mut q_want = poisoned(&gpu, dt, m * h * d);
            let (mut kt, mut vt) = (poisoned(&gpu, dt, m * g * d), poisoned(&gpu, dt, m * g * d));
            gpu.qkv_rope_append(&rope, &append, &qkv, None, &mut q_want, &mut kt, &mut vt, &mut kv_want)
                .unwrap();
            let mut kv_got = new_kv(&gpu);
            let mut q_got = poisoned(&gpu, dt, m * h * d);
            gpu.prefill_rms_rope_append(dims, sums, EPS, &ss, &x, &w, &rope, &append, &mut q_got, &mut kv_got)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for (name, got, want) in [
                ("q", &q_got, &q_want),
                ("K pool", &kv_got.k, &kv_want.k),
                ("V pool", &kv_got.v, &kv_want.v),
            ] {
                let (gb, wb) = (gpu.download(got).unwrap(), gpu.download(want).unwrap());
                let same = same_bits(dt, &gb, &wb, &format!("{what}: {name}"));
                assert_eq!(
                    same,
                    wb.len(),
                    "{what}: {name}: {} of {} differ",
                    wb.len() - same,
                    wb.len()
                );
            }
            println!("{what}: q and both pools bit for bit");
        }
    }
}

#[test]
#[ignore = "needs an sm_90a GPU"]
fn what_the_epilogues_do_not_take_declines() {
    let Some(gpu) = gpu() else { return };
    let mut r = rng();
    let dt = DType::F16;
    // Rotaries the epilogue does not run: head_dim 64, interleaved pairs.
    for (h, g, d, kind) in [(4, 2, 64, RopeLayout::Half), (2, 1, 128, RopeLayout::Interleaved)] {
        let (m, k) = (40, 64);
        let (rope, append, layout) = prefill_step(&mut r, dt, (h, g, d), (m, 0, 8), kind);
        let n = (h + 2 * g) * d;
        let x = gpu.upload(dt, &residual_rows(dt, m, k, r.gen())).unwrap();
        let w = gpu.upload(dt, &random_bits(dt, n * k, 0.1, r.gen())).unwrap();
        let mut ss = poisoned(&gpu, dt, gpu.row_sums_len(m, k));
        let sums = gpu.prefill_row_sumsq(m, k, &x, &mut ss).unwrap();
        let mut q = poisoned(&gpu, dt, m * h * d);
        let mut kv = PagedKv {
            layout,
            k: poisoned(&gpu, dt, layout.pool_elems()),
            v: poisoned(&gpu, dt, layout.pool_elems()),
        };
        let e = gpu.prefill_rms_rope_append(
            GemmDims::new(m, n, k).unwrap(),
            sums,
            EPS,
            &ss,
            &x,
            &w,
            &rope,
            &append,
            &mut q,
            &mut kv,
        );
        assert!(matches!(e, Err(FdppError::Unsupported { .. })), "d{d} {kind:?}: {e:?}");
    }
    // K not a multiple of 8 (TMA rows): declined, not computed wrong.
    let (m, n, k) = (64, 64, 60);
    let x = gpu.upload(dt, &random_bits(dt, m * k, 1.0, r.gen())).unwrap();
    let w = gpu.upload(dt, &random_bits(dt, n * k, 0.1, r.gen())).unwrap();
    let mut res = poisoned(&gpu, dt, m * n);
    let mut ss = poisoned(&gpu, dt, gpu.row_sums_len(m, n));
    let e = gpu.prefill_residual_out(GemmDims::new(m, n, k).unwrap(), &x, &w, &mut res, &mut ss);
    assert!(matches!(e, Err(FdppError::Unsupported { .. })), "K = 60: {e:?}");
}

#[test]
fn the_cpu_has_no_fused_prefill() {
    let cpu = CpuBackend::new();
    assert!(!cpu.prefill_fusion(DType::F16));
    let x = cpu.upload(DType::F16, &[0x3c00; 64]).unwrap();
    let mut ss = cpu.alloc(DType::F16, 16).unwrap();
    let e = cpu.prefill_row_sumsq(8, 8, &x, &mut ss);
    assert!(matches!(e, Err(FdppError::Unsupported { .. })), "{e:?}");
}
