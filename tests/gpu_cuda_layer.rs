//! The CUDA layer ops (kernels_cuda/layer.cu) against the CPU backend on fresh random inputs:
//! copies (embedding, gather_rows, kv_append) and the residual of add_rmsnorm bit for bit,
//! fill_random bit for bit with `random_value`, and the computed outputs (rmsnorm, RoPE,
//! SiLU·mul) within one rounding of the 16-bit type. Odd widths reach every vector variant.
//! The ops of the general executor (issue #17: LayerNorm, bias + activation, GLU, learned
//! positions, the general rotary) against the f64 reference of `fdpp::reference::layer`, and the
//! general rotary kernel against the Llama one on permuted heads, bit for bit.
//! Run on a GPU machine with `cargo test --test gpu_cuda_layer -- --ignored`.

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::cuda::CudaBackend;
use fdpp::backend::Backend;
use fdpp::dtype::{random_bits, DType};
use fdpp::error::FdppError;
use fdpp::kv::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout};
use fdpp::ops::attention::AttnGeometry;
use fdpp::ops::layer::{
    random_value, Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};
use fdpp::reference::layer::{add_layernorm_ref, add_positions_ref, bias_act_ref, glu_ref, qkv_rope_ref, round_f64};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const DTYPES: [DType; 2] = [DType::F16, DType::Bf16];

fn open() -> (CpuBackend, CudaBackend) {
    (CpuBackend::new(), CudaBackend::open(0).expect("CUDA device 0"))
}

fn rng() -> rand::rngs::SmallRng {
    rand::rngs::SmallRng::seed_from_u64(rand::random())
}

/// Every element of `got` within one rounding of the 16-bit type of `want` (plus a small
/// absolute slack for results that cancel to near zero), and no NaN where `want` has none.
fn assert_close(dt: DType, got: &[u16], want: &[u16], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let rel = match dt {
        DType::F16 => 1.0 / 1024.0,
        DType::Bf16 => 1.0 / 128.0,
    };
    let mut bad = vec![];
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (dt.to_f32(g), dt.to_f32(w));
        let ok = g == w || (w.is_nan() && g.is_nan()) || (g - w).abs() <= rel * w.abs() + 1e-4;
        if !ok {
            bad.push(format!("[{i}] got {g} want {w}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{what} ({dt}): {} of {} differ, first: {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(8)]
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_random_equals_random_value_bit_for_bit() {
    let (cpu, gpu) = open();
    for dt in DTYPES {
        for (len, seed, scale) in [
            (1, 0, 1.0),
            (7, 3, 0.02),
            (8, u64::MAX, 0.5),
            (1001, 42, 0.02),
            ((1 << 20) + 3, 7, 1.0),
        ] {
            let mut g = gpu.alloc(dt, len).unwrap();
            gpu.fill_random(&mut g, seed, scale).unwrap();
            let got = gpu.download(&g).unwrap();
            let want: Vec<u16> = (0..len as u64)
                .map(|i| dt.from_f32(random_value(seed, i, scale)))
                .collect();
            assert_eq!(got, want, "{dt} len {len} seed {seed}");
            let mut c = cpu.alloc(dt, len).unwrap();
            cpu.fill_random(&mut c, seed, scale).unwrap();
            assert_eq!(cpu.download(&c).unwrap(), got, "cpu vs cuda, {dt} len {len}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_and_gather_rows_copy_exactly_at_every_width() {
    let (cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        // Widths for the 16-, 8-, 4- and 2-byte paths.
        for width in [4096usize, 4100, 4098, 4097] {
            let vocab = 1000;
            let table_bits = random_bits(dt, vocab * width, 1.0, r.gen());
            let (tc, tg) = (
                cpu.upload(dt, &table_bits).unwrap(),
                gpu.upload(dt, &table_bits).unwrap(),
            );
            // Growing, then shrinking, id lists: the argument scratch grows and is reused.
            for n in [3usize, 3000, 2] {
                let mut ids: Vec<i32> = (0..n).map(|_| r.gen_range(0..vocab as i32)).collect();
                ids[0] = vocab as i32 - 1;
                let p = EmbeddingParams {
                    ids,
                    vocab,
                    hidden: width,
                    dtype: dt,
                    held: None,
                };
                let mut oc = cpu.alloc(dt, n * width).unwrap();
                let mut og = gpu.alloc(dt, n * width).unwrap();
                cpu.embedding(&p, &tc, &mut oc).unwrap();
                gpu.embedding(&p, &tg, &mut og).unwrap();
                assert_eq!(
                    gpu.download(&og).unwrap(),
                    cpu.download(&oc).unwrap(),
                    "embedding {dt} w{width} n{n}"
                );
            }
            let rows: Vec<i32> = (0..37).map(|_| r.gen_range(0..vocab as i32)).collect();
            let p = GatherParams {
                rows: rows.clone(),
                width,
                dtype: dt,
            };
            let mut oc = cpu.alloc(dt, rows.len() * width).unwrap();
            let mut og = gpu.alloc(dt, rows.len() * width).unwrap();
            cpu.gather_rows(&p, &tc, &mut oc).unwrap();
            gpu.gather_rows(&p, &tg, &mut og).unwrap();
            let got = gpu.download(&og).unwrap();
            assert_eq!(got, cpu.download(&oc).unwrap(), "gather_rows {dt} w{width}");
            assert_eq!(&got[..width], &table_bits[rows[0] as usize * width..][..width]);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn add_rmsnorm_matches_with_and_without_delta() {
    let (cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        // 40000 is past the kernel's register cache (4 vectors × 1024 threads × 8).
        for (rows, hidden, with_delta) in [(3, 4096, true), (2, 5120, false), (4, 1001, true), (1, 40000, true)] {
            let p = RmsNormParams {
                rows,
                hidden,
                eps: 1e-5,
                dtype: dt,
            };
            let res = random_bits(dt, rows * hidden, 2.0, r.gen());
            let delta = random_bits(dt, rows * hidden, 1.0, r.gen());
            let weight = random_bits(dt, hidden, 1.0, r.gen());
            let (mut rc, mut rg) = (cpu.upload(dt, &res).unwrap(), gpu.upload(dt, &res).unwrap());
            let (dc, dg) = (cpu.upload(dt, &delta).unwrap(), gpu.upload(dt, &delta).unwrap());
            let (wc, wg) = (cpu.upload(dt, &weight).unwrap(), gpu.upload(dt, &weight).unwrap());
            let mut oc = cpu.alloc(dt, rows * hidden).unwrap();
            let mut og = gpu.alloc(dt, rows * hidden).unwrap();
            cpu.add_rmsnorm(&p, &mut rc, with_delta.then_some(&dc), &wc, &mut oc)
                .unwrap();
            gpu.add_rmsnorm(&p, &mut rg, with_delta.then_some(&dg), &wg, &mut og)
                .unwrap();
            let what = format!("add_rmsnorm rows {rows} hidden {hidden} delta {with_delta}");
            assert_eq!(
                gpu.download(&rg).unwrap(),
                cpu.download(&rc).unwrap(),
                "{what}: residual"
            );
            assert_close(dt, &gpu.download(&og).unwrap(), &cpu.download(&oc).unwrap(), &what);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn qkv_rope_matches_at_long_positions_with_and_without_bias() {
    let (cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        for (h, g, d, theta, with_bias) in [
            (32, 8, 128, 10_000f64, false),
            (16, 4, 128, 1_000_000f64, true),
            (4, 4, 64, 10_000f64, true),
            (16, 1, 256, 500_000f64, false),
        ] {
            let geom = AttnGeometry::new(h, g, d).unwrap();
            let inv_freq: Vec<f32> = (0..d / 2)
                .map(|i| theta.powf(-2.0 * i as f64 / d as f64) as f32)
                .collect();
            let positions = vec![0, 1, 7, 4095, 65_535, 131_071, r.gen_range(0..200_000)];
            let p = RopeParams {
                geom,
                dtype: dt,
                positions,
                inv_freq,
                layout: RopeLayout::Half,
            };
            let t = p.tokens();
            let qkv = random_bits(dt, t * p.qkv_width(), 1.0, r.gen());
            let bias = random_bits(dt, p.qkv_width(), 0.5, r.gen());
            let (xc, xg) = (cpu.upload(dt, &qkv).unwrap(), gpu.upload(dt, &qkv).unwrap());
            let (bc, bg) = (cpu.upload(dt, &bias).unwrap(), gpu.upload(dt, &bias).unwrap());
            let mut outs_c = [t * h * d, t * g * d, t * g * d].map(|n| cpu.alloc(dt, n).unwrap());
            let mut outs_g = [t * h * d, t * g * d, t * g * d].map(|n| gpu.alloc(dt, n).unwrap());
            {
                let [q, k, v] = &mut outs_c;
                cpu.qkv_rope(&p, &xc, with_bias.then_some(&bc), q, k, v).unwrap();
            }
            {
                let [q, k, v] = &mut outs_g;
                gpu.qkv_rope(&p, &xg, with_bias.then_some(&bg), q, k, v).unwrap();
            }
            for (name, (c, g)) in ["q", "k", "v"].iter().zip(outs_c.iter().zip(&outs_g)) {
                let what = format!("qkv_rope {} bias {with_bias}: {name}", p.geom.label());
                assert_close(dt, &gpu.download(g).unwrap(), &cpu.download(c).unwrap(), &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn silu_mul_matches_on_the_vector_and_scalar_paths() {
    let (cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        for (rows, inter) in [(1, 11008), (5, 14336), (3, 1001)] {
            let p = SiluMulParams { rows, inter, dtype: dt };
            let gu = random_bits(dt, 2 * rows * inter, 6.0, r.gen());
            let (gc, gg) = (cpu.upload(dt, &gu).unwrap(), gpu.upload(dt, &gu).unwrap());
            let mut oc = cpu.alloc(dt, rows * inter).unwrap();
            let mut og = gpu.alloc(dt, rows * inter).unwrap();
            cpu.silu_mul(&p, &gc, &mut oc).unwrap();
            gpu.silu_mul(&p, &gg, &mut og).unwrap();
            let what = format!("silu_mul rows {rows} inter {inter}");
            assert_close(dt, &gpu.download(&og).unwrap(), &cpu.download(&oc).unwrap(), &what);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kv_append_writes_the_same_slots_as_the_cpu() {
    let (cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        // Token widths for the 16-, 8- and 2-byte scatter paths.
        for (kv_heads, head_dim) in [(8, 128), (3, 36), (1, 7)] {
            let layout = PagedKvLayout::new(16, 64, kv_heads, head_dim, dt).unwrap();
            let mut pages: Vec<u32> = (0..64).collect();
            pages.shuffle(&mut r);
            // A decode token, a chunk crossing a page boundary, and a whole prefill.
            let (seq_lens, new_lens) = ([10usize, 40, 17], [1i32, 10, 17]);
            let mut at = 0;
            let tables: Vec<BlockTable> = seq_lens
                .iter()
                .map(|&len| {
                    let n = layout.pages_for(len);
                    let t = BlockTable {
                        pages: pages[at..at + n].to_vec(),
                        seq_len: len,
                    };
                    at += n;
                    t
                })
                .collect();
            let p = KvAppendParams {
                tables: FlatBlockTables::new(&layout, &tables).unwrap(),
                new_lens: new_lens.to_vec(),
            };
            let n = p.tokens() * layout.token_elems();
            let (k, v) = (random_bits(dt, n, 1.0, r.gen()), random_bits(dt, n, 1.0, r.gen()));
            let pool_k = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
            let pool_v = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
            let mut kv_c = PagedKv {
                layout,
                k: cpu.upload(dt, &pool_k).unwrap(),
                v: cpu.upload(dt, &pool_v).unwrap(),
            };
            let mut kv_g = PagedKv {
                layout,
                k: gpu.upload(dt, &pool_k).unwrap(),
                v: gpu.upload(dt, &pool_v).unwrap(),
            };
            cpu.kv_append(
                &p,
                &cpu.upload(dt, &k).unwrap(),
                &cpu.upload(dt, &v).unwrap(),
                &mut kv_c,
            )
            .unwrap();
            gpu.kv_append(
                &p,
                &gpu.upload(dt, &k).unwrap(),
                &gpu.upload(dt, &v).unwrap(),
                &mut kv_g,
            )
            .unwrap();
            let what = format!("kv_append {}", layout.label());
            let got_k = gpu.download(&kv_g.k).unwrap();
            assert_eq!(got_k, cpu.download(&kv_c.k).unwrap(), "{what}: K pool");
            assert_eq!(
                gpu.download(&kv_g.v).unwrap(),
                cpu.download(&kv_c.v).unwrap(),
                "{what}: V pool"
            );
            assert_ne!(got_k, pool_k, "{what}: something was written");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_layer_op_inputs_are_refused_before_any_launch() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let table = gpu.alloc(DType::F16, 10 * 8).unwrap();
    let mut out = gpu.alloc(DType::Bf16, 2 * 8).unwrap();
    let p = EmbeddingParams {
        ids: vec![1, 2],
        vocab: 10,
        hidden: 8,
        dtype: DType::F16,
        held: None,
    };
    match gpu.embedding(&p, &table, &mut out) {
        Err(FdppError::InvalidArgument(m)) => assert!(m.contains("out is bf16"), "{m}"),
        other => panic!("expected a dtype error, got {other:?}"),
    }
    let bad_id = EmbeddingParams { ids: vec![10], ..p };
    let mut out16 = gpu.alloc(DType::F16, 8).unwrap();
    assert!(gpu.embedding(&bad_id, &table, &mut out16).is_err());
    let mut short = gpu.alloc(DType::F16, 7).unwrap();
    let sp = SiluMulParams {
        rows: 1,
        inter: 8,
        dtype: DType::F16,
    };
    assert!(matches!(
        gpu.silu_mul(&sp, &table, &mut short),
        Err(FdppError::Shape { .. })
    ));
    gpu.synchronize().unwrap();
}

/// The device's greedy choice (kernels_cuda/sample.cu) equals the host's on fresh random logits
/// at odd widths, with planted ties (the lowest index wins) and −inf rows; a NaN anywhere in a
/// row is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_argmax_rows_matches_the_host_and_refuses_nan() {
    let (_cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        for (rows, width) in [(1usize, 32000usize), (3, 1000), (17, 257), (32, 32001), (5, 1)] {
            let mut bits = random_bits(dt, rows * width, 8.0, r.gen());
            for row in 0..rows {
                let base = row * width;
                match row % 3 {
                    // A tie for the maximum at two random places.
                    0 if width > 1 => {
                        let (i, j) = (r.gen_range(0..width), r.gen_range(0..width));
                        bits[base + i] = dt.from_f32(100.0);
                        bits[base + j] = dt.from_f32(100.0);
                    }
                    // Every value −inf: index 0.
                    1 if row == 1 => bits[base..base + width].fill(dt.from_f32(f32::NEG_INFINITY)),
                    _ => {}
                }
            }
            let want = fdpp::backend::host_argmax_rows(dt, &bits, rows, width).expect("host argmax");
            // Rows past `rows` in the buffer are ignored: a poisoned tail row proves it.
            let mut padded = bits.clone();
            padded.extend(std::iter::repeat_n(dt.poison(), width));
            let buf = gpu.upload(dt, &padded).expect("upload");
            let got = gpu.argmax_rows(&buf, rows, width).expect("device argmax");
            assert_eq!(got, want, "{dt} rows {rows} width {width}");
        }
        let mut bits = random_bits(dt, 4 * 300, 1.0, r.gen());
        bits[2 * 300 + 123] = dt.from_f32(f32::NAN);
        let buf = gpu.upload(dt, &bits).expect("upload");
        let e = gpu.argmax_rows(&buf, 4, 300).expect_err("NaN row").to_string();
        assert!(e.contains("row 2") && e.contains("NaN"), "{e}");
        assert!(gpu.argmax_rows(&buf, 5, 300).is_err(), "rows past the buffer");
    }
}

/// The decode step's fused rotation and KV append (one kernel) writes the same q and the same
/// pools, bit for bit, as qkv_rope followed by kv_append on the same device; pages scattered,
/// GQA and MHA, with and without bias, one token per sequence at ragged lengths.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_rope_append_equals_rope_then_append() {
    let (_cpu, gpu) = open();
    let mut r = rng();
    for dt in DTYPES {
        for (h, g, d, with_bias, rot, rope_layout) in [
            (32, 8, 128, false, 128, RopeLayout::Half),
            (32, 32, 128, true, 128, RopeLayout::Half),
            (4, 2, 64, true, 64, RopeLayout::Half),
            // The general kernel: ChatGLM2's half-head interleaved rotary, OPT's none, and a
            // partial rotate-half.
            (32, 2, 128, true, 64, RopeLayout::Interleaved),
            (4, 4, 64, true, 0, RopeLayout::Half),
            (8, 2, 256, false, 32, RopeLayout::Half),
        ] {
            let geom = AttnGeometry::new(h, g, d).unwrap();
            let layout = PagedKvLayout::new(16, 40, g, d, dt).unwrap();
            let mut pages: Vec<u32> = (0..40).collect();
            pages.shuffle(&mut r);
            let seq_lens = [1usize, 17, 100, 33];
            let mut at = 0;
            let tables: Vec<BlockTable> = seq_lens
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
                new_lens: vec![1; seq_lens.len()],
            };
            let inv_freq: Vec<f32> = (0..rot / 2)
                .map(|i| 10_000f32.powf(-2.0 * i as f32 / rot as f32))
                .collect();
            let rope = RopeParams {
                geom,
                dtype: dt,
                positions: seq_lens.iter().map(|&l| l as i32 - 1).collect(),
                inv_freq,
                layout: rope_layout,
            };
            let t = rope.tokens();
            let qkv = gpu
                .upload(dt, &random_bits(dt, t * rope.qkv_width(), 1.0, r.gen()))
                .unwrap();
            let bias = gpu
                .upload(dt, &random_bits(dt, rope.qkv_width(), 0.5, r.gen()))
                .unwrap();
            let pool_k = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
            let pool_v = random_bits(dt, layout.pool_elems(), 1.0, r.gen());
            let mut runs = Vec::new();
            for fused in [false, true] {
                let mut bufs = [t * h * d, t * g * d, t * g * d].map(|n| gpu.alloc(dt, n).unwrap());
                let mut kv = PagedKv {
                    layout,
                    k: gpu.upload(dt, &pool_k).unwrap(),
                    v: gpu.upload(dt, &pool_v).unwrap(),
                };
                let [q, k, v] = &mut bufs;
                let b = with_bias.then_some(&bias);
                if fused {
                    gpu.qkv_rope_append(&rope, &append, &qkv, b, q, k, v, &mut kv).unwrap();
                } else {
                    gpu.qkv_rope(&rope, &qkv, b, q, k, v).unwrap();
                    gpu.kv_append(&append, k, v, &mut kv).unwrap();
                }
                runs.push([q, &kv.k, &kv.v].map(|x| gpu.download(x).unwrap()));
            }
            let what = format!("{dt} {} bias {with_bias} rot {rot} {rope_layout:?}", geom.label());
            assert_eq!(runs[0][0], runs[1][0], "{what}: q");
            assert_eq!(runs[0][1], runs[1][1], "{what}: K pool");
            assert_eq!(runs[0][2], runs[1][2], "{what}: V pool");
            assert_ne!(runs[1][1], pool_k, "{what}: the fused kernel wrote the K pool");
        }
    }
}

/// The running recompute total of the enqueued decode attention is read back with the greedy
/// choice (one host wait per step): after argmax_rows, take_recomputed returns what the counting
/// path reports for the same launch, and then nothing until another launch counts.
#[test]
#[ignore = "needs a CUDA GPU"]
fn recompute_total_comes_back_with_the_greedy_choice() {
    let (_cpu, gpu) = open();
    let mut r = rng();
    let dt = DType::F16;
    let geom = AttnGeometry::new(4, 4, 64).unwrap();
    let layout = PagedKvLayout::new(16, 8, 4, 64, dt).unwrap();
    let tables = vec![
        BlockTable {
            pages: vec![3, 1, 6],
            seq_len: 40,
        },
        BlockTable {
            pages: vec![0, 5],
            seq_len: 29,
        },
    ];
    // A window of width 1 around φ = 0: random scores leave it, so rows are recomputed.
    let p = fdpp::ops::attention::DecodeParams {
        geom,
        dtype: dt,
        scheme: fdpp::ops::attention::SoftmaxScheme::Async {
            phi: 0.0,
            a: -0.5,
            b: 0.5,
        },
        tables: FlatBlockTables::new(&layout, &tables).unwrap(),
        num_splits: None,
    };
    let q = gpu.upload(dt, &random_bits(dt, 2 * 4 * 64, 4.0, r.gen())).unwrap();
    let kv = PagedKv {
        layout,
        k: gpu
            .upload(dt, &random_bits(dt, layout.pool_elems(), 4.0, r.gen()))
            .unwrap(),
        v: gpu
            .upload(dt, &random_bits(dt, layout.pool_elems(), 1.0, r.gen()))
            .unwrap(),
    };
    let mut out = gpu.alloc(dt, 2 * 4 * 64).unwrap();
    let counted = gpu.attention_decode(&p, &q, &kv, &mut out).unwrap().recomputed;
    assert!(counted > 0, "the narrow window flags rows");
    assert_eq!(
        gpu.take_recomputed().unwrap(),
        0,
        "the counting path keeps its own count"
    );
    gpu.attention_decode_enqueue(&p, &q, &kv, &mut out).unwrap();
    gpu.attention_decode_enqueue(&p, &q, &kv, &mut out).unwrap();
    let logits = gpu.upload(dt, &random_bits(dt, 2 * 300, 1.0, r.gen())).unwrap();
    let ids = gpu.argmax_rows(&logits, 2, 300).unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(gpu.take_recomputed().unwrap(), 2 * counted, "two launches' rows");
    assert_eq!(gpu.take_recomputed().unwrap(), 0, "nothing counted since");
    // Without a greedy choice in between, take_recomputed reads the device itself.
    gpu.attention_decode_enqueue(&p, &q, &kv, &mut out).unwrap();
    assert_eq!(gpu.take_recomputed().unwrap(), counted);
}

/// Every element of `got` within one unit in the last place of the f64 reference rounded once
/// (what an f32 computation rounded once gives), and the count of those off by one.
fn assert_within_one_ulp(dt: DType, got: &[u16], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let line = |x: u16| {
        let m = (x & 0x7fff) as i32;
        if x & 0x8000 != 0 {
            -m
        } else {
            m
        }
    };
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (&g, &w))| line(g).abs_diff(line(round_f64(dt, w))) > 1)
        .map(|(i, (&g, &w))| format!("[{i}] got {} want {w}", dt.to_f32(g)))
        .collect();
    assert!(
        bad.is_empty(),
        "{what} ({dt}): {} of {} more than 1 ulp off, first: {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(8)]
    );
}

/// Every element within `ulps` units of the 16-bit type at its magnitude (plus `abs` for
/// results that cancel to near zero) of the f64 reference.
fn assert_near(dt: DType, got: &[u16], want: &[f64], ulps: f64, abs: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let eps = match dt {
        DType::F16 => 1.0 / 1024.0,
        DType::Bf16 => 1.0 / 128.0,
    };
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (&g, &w))| {
            let g = dt.to_f32(g) as f64;
            !(g.is_finite() && (g - w).abs() <= ulps * eps * w.abs() + abs)
        })
        .map(|(i, (&g, &w))| format!("[{i}] got {} want {w}", dt.to_f32(g)))
        .collect();
    assert!(
        bad.is_empty(),
        "{what} ({dt}): {} of {} differ, first: {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(8)]
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn add_layernorm_matches_the_reference_on_both_paths_and_past_the_register_cache() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        // 40000 is past the register cache (4 vectors × 1024 threads × 8); 4097 and 133 take
        // the scalar path.
        for (rows, hidden, with_delta) in [
            (3, 4096, true),
            (17, 1000, false),
            (2, 4097, true),
            (3, 133, true),
            (1, 40000, true),
        ] {
            let p = LayerNormParams {
                rows,
                hidden,
                eps: 1e-5,
                dtype: dt,
            };
            // A mean of 3 on every row: the variance must be taken around it.
            let res: Vec<u16> = random_bits(dt, rows * hidden, 2.0, r.gen())
                .iter()
                .map(|&x| dt.from_f32(3.0 + dt.to_f32(x)))
                .collect();
            let delta = random_bits(dt, rows * hidden, 1.0, r.gen());
            let weight = random_bits(dt, hidden, 1.0, r.gen());
            let bias = random_bits(dt, hidden, 0.5, r.gen());
            let mut rg = gpu.upload(dt, &res).unwrap();
            let dg = gpu.upload(dt, &delta).unwrap();
            let (wg, bg) = (gpu.upload(dt, &weight).unwrap(), gpu.upload(dt, &bias).unwrap());
            let mut og = gpu.alloc(dt, rows * hidden).unwrap();
            gpu.add_layernorm(&p, &mut rg, with_delta.then_some(&dg), &wg, &bg, &mut og)
                .unwrap();
            let (want_res, want) = add_layernorm_ref(&p, &res, with_delta.then_some(&delta[..]), &weight, &bias);
            let what = format!("add_layernorm rows {rows} hidden {hidden} delta {with_delta}");
            let got_res = gpu.download(&rg).unwrap();
            let want_res_f: Vec<f64> = want_res.iter().map(|&b| dt.to_f32(b) as f64).collect();
            assert_within_one_ulp(dt, &got_res, &want_res_f, &format!("{what}: residual"));
            // Normalised values reach ~4σ: a few ulps of slack for the f32 statistics.
            assert_near(dt, &gpu.download(&og).unwrap(), &want, 2.0, 2e-3, &what);
        }
    }
}

const ACTS: [Activation; 5] = [
    Activation::None,
    Activation::Relu,
    Activation::Silu,
    Activation::Gelu,
    Activation::GeluTanh,
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn bias_act_and_glu_are_within_one_ulp_for_every_activation() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        for act in ACTS {
            for (rows, width, with_bias) in [(3, 4096, true), (17, 1000, true), (2, 4097, false), (1, 133, true)] {
                let p = BiasActParams {
                    rows,
                    width,
                    act,
                    dtype: dt,
                };
                let x = random_bits(dt, rows * width, 6.0, r.gen());
                let bias = random_bits(dt, width, 1.0, r.gen());
                let mut xg = gpu.upload(dt, &x).unwrap();
                let bg = gpu.upload(dt, &bias).unwrap();
                gpu.bias_act(&p, &mut xg, with_bias.then_some(&bg)).unwrap();
                let want = bias_act_ref(&p, &x, with_bias.then_some(&bias[..]));
                let what = format!("bias_act {act:?} rows {rows} width {width} bias {with_bias}");
                assert_within_one_ulp(dt, &gpu.download(&xg).unwrap(), &want, &what);
            }
            for (rows, inter) in [(1, 11008), (3, 1000), (17, 133), (2, 4097)] {
                let p = GluParams {
                    rows,
                    inter,
                    act,
                    dtype: dt,
                };
                let gu = random_bits(dt, 2 * rows * inter, 6.0, r.gen());
                let gg = gpu.upload(dt, &gu).unwrap();
                let mut og = gpu.alloc(dt, rows * inter).unwrap();
                gpu.glu(&p, &gg, &mut og).unwrap();
                let what = format!("glu {act:?} rows {rows} inter {inter}");
                assert_within_one_ulp(dt, &gpu.download(&og).unwrap(), &glu_ref(&p, &gu), &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn add_positions_adds_the_offset_rows_and_repeats_with_new_positions() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        for hidden in [768usize, 1000, 133, 4097] {
            let table_rows = 2050;
            let table = random_bits(dt, table_rows * hidden, 1.0, r.gen());
            let tg = gpu.upload(dt, &table).unwrap();
            // A prefill, then decode steps: the positions' upload changes every call.
            for positions in [(0..17).collect::<Vec<i32>>(), vec![17], vec![18], vec![2047, 0, 5]] {
                let p = PositionParams {
                    positions,
                    offset: 2,
                    table_rows,
                    hidden,
                    dtype: dt,
                };
                let emb = random_bits(dt, p.positions.len() * hidden, 1.0, r.gen());
                let mut og = gpu.upload(dt, &emb).unwrap();
                gpu.add_positions(&p, &tg, &mut og).unwrap();
                let want: Vec<f64> = add_positions_ref(&p, &table, &emb)
                    .iter()
                    .map(|&b| dt.to_f32(b) as f64)
                    .collect();
                let what = format!("add_positions hidden {hidden} {:?}", p.positions);
                assert_within_one_ulp(dt, &gpu.download(&og).unwrap(), &want, &what);
            }
            let bad = PositionParams {
                positions: vec![2048],
                offset: 2,
                table_rows,
                hidden,
                dtype: dt,
            };
            let mut og = gpu.alloc(dt, hidden).unwrap();
            assert!(
                gpu.add_positions(&bad, &tg, &mut og).is_err(),
                "position past the table"
            );
        }
    }
}

/// The element of the whole-head rotate-half layout that plays the part of element `e` of a
/// head rotated in `layout` over `r` of `d` elements: pair i of the general form, wherever its two
/// elements are, becomes the Llama pair (i, i + d/2); the elements that pass through take the
/// Llama pairs past r/2, whose frequency is set to 0 (cos 1, sin 0: they pass through too).
fn llama_slot(layout: RopeLayout, r: usize, d: usize) -> Vec<usize> {
    let mut slot = vec![usize::MAX; d];
    for i in 0..r / 2 {
        let (a, b) = match layout {
            RopeLayout::Half => (i, i + r / 2),
            RopeLayout::Interleaved => (2 * i, 2 * i + 1),
        };
        slot[a] = i;
        slot[b] = i + d / 2;
    }
    let mut free = (r / 2..d / 2).chain(d / 2 + r / 2..d);
    for s in slot.iter_mut().filter(|s| **s == usize::MAX) {
        *s = free.next().expect("as many free slots as passed-through elements");
    }
    slot
}

/// The general rotary kernel (partial, interleaved, none) equals the Llama kernel bit for bit
/// on the same data laid out as whole-head rotate-half (both compute pos · inv_freq and the
/// rotation with the same rounded f32 products), at positions up to 131071; and the reference,
/// within a few ulps at positions up to 4095 (past that the f32 angle itself drifts from the f64
/// one by more than the 16-bit types resolve).
#[test]
#[ignore = "needs a CUDA GPU"]
fn general_rotary_equals_the_llama_kernel_on_permuted_heads_and_the_reference() {
    let gpu = CudaBackend::open(0).expect("CUDA device 0");
    let mut r = rng();
    for dt in DTYPES {
        for (h, g, d) in [(8, 2, 64), (4, 4, 128), (4, 1, 256)] {
            for rot in [0, 20, 24, 32, d / 2, d] {
                for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
                    if rot == d && layout == RopeLayout::Half {
                        continue; // the Llama kernel itself
                    }
                    let geom = AttnGeometry::new(h, g, d).unwrap();
                    let inv_freq: Vec<f32> = (0..rot / 2)
                        .map(|i| 10_000f64.powf(-2.0 * i as f64 / rot.max(1) as f64) as f32)
                        .collect();
                    let gen = RopeParams {
                        geom,
                        dtype: dt,
                        positions: vec![0, 1, 4095, 65_535, 131_071, r.gen_range(0..200_000)],
                        inv_freq: inv_freq.clone(),
                        layout,
                    };
                    let mut llama_freq = inv_freq;
                    llama_freq.resize(d / 2, 0.0);
                    let llama = RopeParams {
                        inv_freq: llama_freq,
                        layout: RopeLayout::Half,
                        ..gen.clone()
                    };
                    let (t, width) = (gen.tokens(), gen.qkv_width());
                    let qkv = random_bits(dt, t * width, 1.0, r.gen());
                    let bias = random_bits(dt, width, 0.5, r.gen());
                    let slot = llama_slot(layout, rot, d);
                    // Permute the q and k heads into the Llama layout; v as it is.
                    let permute = |row: &[u16]| {
                        let mut out = row.to_vec();
                        for head in 0..h + g {
                            for e in 0..d {
                                out[head * d + slot[e]] = row[head * d + e];
                            }
                        }
                        out
                    };
                    let qkv_l: Vec<u16> = qkv.chunks(width).flat_map(permute).collect();
                    let bias_l = permute(&bias);
                    let run = |p: &RopeParams, x: &[u16], b: &[u16]| {
                        let (xg, bg) = (gpu.upload(dt, x).unwrap(), gpu.upload(dt, b).unwrap());
                        let mut outs = [t * h * d, t * g * d, t * g * d].map(|n| gpu.alloc(dt, n).unwrap());
                        let [q, k, v] = &mut outs;
                        gpu.qkv_rope(p, &xg, Some(&bg), q, k, v).unwrap();
                        outs.map(|o| gpu.download(&o).unwrap())
                    };
                    let [q, k, v] = run(&gen, &qkv, &bias);
                    let [ql, kl, vl] = run(&llama, &qkv_l, &bias_l);
                    let what = format!("{dt} {} rot {rot} {layout:?}", geom.label());
                    for (name, (a, b, heads)) in [("q", (&q, &ql, h)), ("k", (&k, &kl, g))] {
                        for tok in 0..t {
                            for head in 0..heads {
                                for e in 0..d {
                                    let at = (tok * heads + head) * d;
                                    assert_eq!(
                                        a[at + e],
                                        b[at + slot[e]],
                                        "{what}: {name} token {tok} head {head} element {e}"
                                    );
                                }
                            }
                        }
                    }
                    assert_eq!(v, vl, "{what}: v");
                    // Against the f64 reference at the positions below 4096.
                    let near = RopeParams {
                        positions: vec![0, 1, 7, 4095],
                        ..gen.clone()
                    };
                    let tn = near.tokens();
                    let x = &qkv[..tn * width];
                    let (xg, bg) = (gpu.upload(dt, x).unwrap(), gpu.upload(dt, &bias).unwrap());
                    let mut outs = [tn * h * d, tn * g * d, tn * g * d].map(|n| gpu.alloc(dt, n).unwrap());
                    {
                        let [q, k, v] = &mut outs;
                        gpu.qkv_rope(&near, &xg, Some(&bg), q, k, v).unwrap();
                    }
                    let (rq, rk, rv) = qkv_rope_ref(&near, x, Some(&bias));
                    for (name, (o, want)) in ["q", "k", "v"].iter().zip(outs.iter().zip([rq, rk, rv])) {
                        // θ = 4095 · 1 in f32 is off by up to 2.4e-4 rad: that much absolute slack.
                        assert_near(
                            dt,
                            &gpu.download(o).unwrap(),
                            &want,
                            1.0,
                            1e-3,
                            &format!("{what}: {name} vs reference"),
                        );
                    }
                }
            }
        }
    }
}
