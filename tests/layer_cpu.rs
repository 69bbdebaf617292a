//! The small layer ops of the CPU backend against the f64 reference on odd sizes, and every bad
//! input refused with a clean error that names it, leaving the buffers untouched (no panics).

use fdpp::backend::cpu::{CpuBackend, CpuBuffer};
use fdpp::backend::Backend;
use fdpp::dtype::{random_bits, DType};
use fdpp::error::FdppError;
use fdpp::kv::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout};
use fdpp::ops::attention::AttnGeometry;
use fdpp::ops::layer::{
    random_value, Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};
use fdpp::reference::gemm::nmse;
use fdpp::reference::layer::{
    add_rmsnorm_ref, embedding_ref, gather_rows_ref, kv_append_ref, qkv_rope_ref, silu_mul_ref,
};

fn up(b: &CpuBackend, dt: DType, bits: &[u16]) -> CpuBuffer {
    b.upload(dt, bits).expect("upload")
}

fn widen(dt: DType, bits: &[u16]) -> Vec<f64> {
    bits.iter().map(|&x| dt.to_f32(x) as f64).collect()
}

fn inv_freq(theta: f64, d: usize) -> Vec<f32> {
    (0..d / 2)
        .map(|i| theta.powf(-2.0 * i as f64 / d as f64) as f32)
        .collect()
}

#[test]
fn rmsnorm_silu_and_rope_match_the_reference_in_both_dtypes() {
    let b = CpuBackend::new();
    for dt in [DType::F16, DType::Bf16] {
        // add_rmsnorm: 3 rows of 1001, with and without a delta.
        let p = RmsNormParams {
            rows: 3,
            hidden: 1001,
            eps: 1e-5,
            dtype: dt,
        };
        let res0 = random_bits(dt, 3 * 1001, 2.0, 1);
        let delta = random_bits(dt, 3 * 1001, 1.0, 2);
        let w = random_bits(dt, 1001, 1.0, 3);
        for with_delta in [false, true] {
            let mut res = up(&b, dt, &res0);
            let d = up(&b, dt, &delta);
            let mut out = b.alloc(dt, 3 * 1001).expect("alloc");
            b.add_rmsnorm(&p, &mut res, with_delta.then_some(&d), &up(&b, dt, &w), &mut out)
                .expect("add_rmsnorm");
            let (want_res, want) = add_rmsnorm_ref(&p, &res0, with_delta.then_some(&delta[..]), &w);
            assert_eq!(res.data, want_res, "{dt} residual (delta {with_delta})");
            let e = nmse(&widen(dt, &out.data), &want);
            assert!(e < dt.nmse_limit(), "{dt} rmsnorm nmse {e}");
        }

        // silu_mul: 2 rows of 5003 (two tasks per row, the last ragged).
        let p = SiluMulParams {
            rows: 2,
            inter: 5003,
            dtype: dt,
        };
        let gu = random_bits(dt, 2 * 2 * 5003, 4.0, 4);
        let mut out = b.alloc(dt, 2 * 5003).expect("alloc");
        b.silu_mul(&p, &up(&b, dt, &gu), &mut out).expect("silu_mul");
        let e = nmse(&widen(dt, &out.data), &silu_mul_ref(&p, &gu));
        assert!(e < dt.nmse_limit(), "{dt} silu nmse {e}");

        // qkv_rope: GQA 4, d 128, positions up to 4095, with a bias.
        let geom = AttnGeometry::new(8, 2, 128).expect("geom");
        let p = RopeParams {
            geom,
            dtype: dt,
            positions: vec![4095, 0, 17, 1234, 3],
            inv_freq: inv_freq(500000.0, 128),
            layout: RopeLayout::Half,
        };
        let (t, wd) = (p.tokens(), p.qkv_width());
        let qkv = random_bits(dt, t * wd, 1.0, 5);
        let bias = random_bits(dt, wd, 0.5, 6);
        let mut q = b.alloc(dt, t * 8 * 128).expect("alloc");
        let mut k = b.alloc(dt, t * 2 * 128).expect("alloc");
        let mut v = b.alloc(dt, t * 2 * 128).expect("alloc");
        b.qkv_rope(&p, &up(&b, dt, &qkv), Some(&up(&b, dt, &bias)), &mut q, &mut k, &mut v)
            .expect("qkv_rope");
        let (rq, rk, rv) = qkv_rope_ref(&p, &qkv, Some(&bias));
        for (name, got, want) in [("q", &q, rq), ("k", &k, rk), ("v", &v, rv)] {
            let e = nmse(&widen(dt, &got.data), &want);
            assert!(e < dt.nmse_limit(), "{dt} rope {name} nmse {e}");
        }
    }
}

#[test]
fn data_movement_ops_are_exact() {
    let b = CpuBackend::new();
    let dt = DType::Bf16;
    let table = random_bits(dt, 67 * 1001, 1.0, 7);
    let e = EmbeddingParams {
        ids: vec![66, 0, 31, 66],
        vocab: 67,
        hidden: 1001,
        dtype: dt,
        held: None,
    };
    let mut out = b.alloc(dt, 4 * 1001).expect("alloc");
    b.embedding(&e, &up(&b, dt, &table), &mut out).expect("embedding");
    assert_eq!(out.data, embedding_ref(&e, &table));

    let g = GatherParams {
        rows: vec![5, 66, 5],
        width: 1001,
        dtype: dt,
    };
    let mut dst = b.alloc(dt, 3 * 1001).expect("alloc");
    b.gather_rows(&g, &up(&b, dt, &table), &mut dst).expect("gather");
    assert_eq!(dst.data, gather_rows_ref(&g, &table));

    // kv_append: three sequences on scattered pages, one of them appending 5 tokens.
    let layout = PagedKvLayout::new(16, 12, 2, 64, dt).expect("layout");
    let tables = [
        BlockTable {
            pages: vec![7],
            seq_len: 1,
        },
        BlockTable {
            pages: vec![3, 10, 0],
            seq_len: 33,
        },
        BlockTable {
            pages: vec![5, 1],
            seq_len: 20,
        },
    ];
    let p = KvAppendParams {
        tables: FlatBlockTables::new(&layout, &tables).expect("tables"),
        new_lens: vec![1, 1, 5],
    };
    let n = p.tokens() * layout.token_elems();
    let (k, v) = (random_bits(dt, n, 1.0, 8), random_bits(dt, n, 1.0, 9));
    let (kp, vp) = (
        random_bits(dt, layout.pool_elems(), 1.0, 10),
        random_bits(dt, layout.pool_elems(), 1.0, 11),
    );
    let mut kv = PagedKv {
        layout,
        k: up(&b, dt, &kp),
        v: up(&b, dt, &vp),
    };
    b.kv_append(&p, &up(&b, dt, &k), &up(&b, dt, &v), &mut kv)
        .expect("kv_append");
    let (ek, ev) = kv_append_ref(&p, &layout, &k, &v, &kp, &vp);
    assert_eq!(kv.k.data, ek);
    assert_eq!(kv.v.data, ev);
    assert_ne!(ek, kp, "the append changed the pool");

    let mut buf = b.alloc(DType::F16, 200_003).expect("alloc");
    b.fill_random(&mut buf, 42, 0.02).expect("fill_random");
    for i in [0usize, 1, 65_535, 65_536, 200_002] {
        assert_eq!(
            buf.data[i],
            DType::F16.from_f32(random_value(42, i as u64, 0.02)),
            "element {i}"
        );
    }
}

/// The error's message, asserting it is of the expected kind.
fn msg(e: FdppError) -> String {
    assert!(
        matches!(e, FdppError::InvalidArgument(_) | FdppError::Shape { .. }),
        "unexpected kind: {e:?}"
    );
    e.to_string()
}

#[test]
fn bad_inputs_are_refused_and_leave_buffers_untouched() {
    let b = CpuBackend::new();
    let dt = DType::F16;

    // Embedding: an id past the vocabulary, a negative id.
    let table = up(&b, dt, &random_bits(dt, 10 * 8, 1.0, 1));
    let mut out = b.alloc(dt, 16).expect("alloc");
    for ids in [vec![3, 10], vec![-1]] {
        let p = EmbeddingParams {
            ids,
            vocab: 10,
            hidden: 8,
            dtype: dt,
            held: None,
        };
        let m = msg(b.embedding(&p, &table, &mut out).expect_err("bad id"));
        assert!(m.contains("outside the vocabulary"), "{m}");
    }
    assert!(out.data.iter().all(|&x| x == dt.poison()), "out untouched");

    // RMSNorm: eps 0, a short output, a weight of the other dtype, a short delta.
    let res0 = random_bits(dt, 2 * 8, 1.0, 2);
    let mut res = up(&b, dt, &res0);
    let w = up(&b, dt, &random_bits(dt, 8, 1.0, 3));
    let mut out = b.alloc(dt, 16).expect("alloc");
    let p = RmsNormParams {
        rows: 2,
        hidden: 8,
        eps: 0.0,
        dtype: dt,
    };
    let m = msg(b.add_rmsnorm(&p, &mut res, None, &w, &mut out).expect_err("eps 0"));
    assert!(m.contains("eps"), "{m}");
    let p = RmsNormParams { eps: 1e-5, ..p };
    let mut short = b.alloc(dt, 15).expect("alloc");
    let m = msg(b
        .add_rmsnorm(&p, &mut res, None, &w, &mut short)
        .expect_err("short out"));
    assert!(m.contains("rmsnorm out") && m.contains("16"), "{m}");
    let w_bf = up(&b, DType::Bf16, &random_bits(DType::Bf16, 8, 1.0, 3));
    let m = msg(b.add_rmsnorm(&p, &mut res, None, &w_bf, &mut out).expect_err("dtype"));
    assert!(m.contains("'weight'") && m.contains("bf16"), "{m}");
    let d_short = up(&b, dt, &random_bits(dt, 8, 1.0, 4));
    let m = msg(b
        .add_rmsnorm(&p, &mut res, Some(&d_short), &w, &mut out)
        .expect_err("short delta"));
    assert!(m.contains("delta"), "{m}");
    let d_bf = up(&b, DType::Bf16, &random_bits(DType::Bf16, 16, 1.0, 4));
    let m = msg(b
        .add_rmsnorm(&p, &mut res, Some(&d_bf), &w, &mut out)
        .expect_err("delta dtype"));
    assert!(m.contains("'delta'"), "{m}");
    assert_eq!(res.data, res0, "residual untouched");
    assert!(out.data.iter().all(|&x| x == dt.poison()), "out untouched");

    // RoPE: inv_freq of the wrong length, a short k, a bias of the wrong dtype.
    let geom = AttnGeometry::new(4, 2, 64).expect("geom");
    let p = RopeParams {
        geom,
        dtype: dt,
        positions: vec![0, 9],
        inv_freq: vec![1.0; 33],
        layout: RopeLayout::Half,
    };
    let qkv = up(&b, dt, &random_bits(dt, 2 * 8 * 64, 1.0, 5));
    let mut q = b.alloc(dt, 2 * 4 * 64).expect("alloc");
    let mut k = b.alloc(dt, 2 * 2 * 64).expect("alloc");
    let mut v = b.alloc(dt, 2 * 2 * 64).expect("alloc");
    let m = msg(b
        .qkv_rope(&p, &qkv, None, &mut q, &mut k, &mut v)
        .expect_err("inv_freq"));
    assert!(m.contains("inv_freq") && m.contains("32"), "{m}");
    let p = RopeParams {
        inv_freq: vec![1.0; 32],
        layout: RopeLayout::Half,
        ..p
    };
    let mut k_short = b.alloc(dt, 2 * 64).expect("alloc");
    let m = msg(b
        .qkv_rope(&p, &qkv, None, &mut q, &mut k_short, &mut v)
        .expect_err("short k"));
    assert!(m.contains("rope k"), "{m}");
    let bias_bf = up(&b, DType::Bf16, &random_bits(DType::Bf16, 8 * 64, 1.0, 6));
    let m = msg(b
        .qkv_rope(&p, &qkv, Some(&bias_bf), &mut q, &mut k, &mut v)
        .expect_err("bias dtype"));
    assert!(m.contains("'bias'"), "{m}");
    for o in [&q, &k, &v] {
        assert!(o.data.iter().all(|&x| x == dt.poison()), "rope outputs untouched");
    }

    // silu_mul: a short gate_up, a zero inter.
    let gu = up(&b, dt, &random_bits(dt, 2 * 2 * 10 - 1, 1.0, 7));
    let mut out = b.alloc(dt, 20).expect("alloc");
    let p = SiluMulParams {
        rows: 2,
        inter: 10,
        dtype: dt,
    };
    let m = msg(b.silu_mul(&p, &gu, &mut out).expect_err("short gate_up"));
    assert!(m.contains("gate_up"), "{m}");
    let p = SiluMulParams { inter: 0, ..p };
    let m = msg(b.silu_mul(&p, &gu, &mut out).expect_err("inter 0"));
    assert!(m.contains("inter"), "{m}");

    // gather_rows: a row outside the source, a dst of the other dtype.
    let src = up(&b, dt, &random_bits(dt, 3 * 4, 1.0, 8));
    let mut dst = b.alloc(dt, 8).expect("alloc");
    let p = GatherParams {
        rows: vec![0, 3],
        width: 4,
        dtype: dt,
    };
    let m = msg(b.gather_rows(&p, &src, &mut dst).expect_err("row 3"));
    assert!(m.contains("row 3"), "{m}");
    let mut dst_bf = b.alloc(DType::Bf16, 8).expect("alloc");
    let p = GatherParams { rows: vec![0, 2], ..p };
    let m = msg(b.gather_rows(&p, &src, &mut dst_bf).expect_err("dst dtype"));
    assert!(m.contains("'dst'"), "{m}");

    // kv_append: more new tokens than the sequence holds, a short k, pools of the other dtype.
    let layout = PagedKvLayout::new(4, 4, 1, 64, dt).expect("layout");
    let tables = FlatBlockTables::new(
        &layout,
        &[BlockTable {
            pages: vec![2, 0],
            seq_len: 6,
        }],
    )
    .expect("tables");
    let pool0 = random_bits(dt, layout.pool_elems(), 1.0, 9);
    let mut kv = PagedKv {
        layout,
        k: up(&b, dt, &pool0),
        v: up(&b, dt, &pool0),
    };
    let kn = up(&b, dt, &random_bits(dt, 2 * 64, 1.0, 10));
    let p = KvAppendParams {
        tables: tables.clone(),
        new_lens: vec![7],
    };
    let m = msg(b.kv_append(&p, &kn, &kn, &mut kv).expect_err("7 of 6"));
    assert!(m.contains("7 new tokens"), "{m}");
    let p = KvAppendParams {
        tables,
        new_lens: vec![3],
    };
    let m = msg(b.kv_append(&p, &kn, &kn, &mut kv).expect_err("short k"));
    assert!(m.contains("kv_append k"), "{m}");
    let kn3 = up(&b, DType::Bf16, &random_bits(DType::Bf16, 3 * 64, 1.0, 10));
    let m = msg(b.kv_append(&p, &kn3, &kn3, &mut kv).expect_err("k dtype"));
    assert!(m.contains("'k'"), "{m}");
    assert_eq!(kv.k.data, pool0, "K pool untouched");
    assert_eq!(kv.v.data, pool0, "V pool untouched");

    // fill_random: a scale that is not a number.
    let mut buf = b.alloc(dt, 10).expect("alloc");
    let m = msg(b.fill_random(&mut buf, 1, f32::NAN).expect_err("NaN scale"));
    assert!(m.contains("scale"), "{m}");
}

/// `got` (16-bit bits) within `tol` of each hand-computed value.
fn assert_close(dt: DType, got: &[u16], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = dt.to_f32(g) as f64;
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: {g} vs {w}");
    }
}

fn bits(dt: DType, v: &[f64]) -> Vec<u16> {
    v.iter().map(|&x| dt.from_f32(x as f32)).collect()
}

// The new ops against values worked out by hand (fp16 and bf16 rounding: 2e-3 and 1e-2
// relative). helper "ops" checks them against the f64 reference at odd sizes (`fdpp check`).
#[test]
fn layernorm_with_bias_and_its_residual_add_by_hand() {
    let b = CpuBackend::new();
    for (dt, tol) in [(DType::F16, 2e-3), (DType::Bf16, 1e-2)] {
        // Row [1, 2, 3, 4] (given as [0.5, 1.5, 2.5, 3.5] + delta 0.5): mean 2.5, variance
        // 1.25, so (x − mean)/√1.25 = [−1.341641, −0.447214, 0.447214, 1.341641]; the second row
        // is the first negated.
        let p = LayerNormParams {
            rows: 2,
            hidden: 4,
            eps: 1e-5,
            dtype: dt,
        };
        let mut res = up(&b, dt, &bits(dt, &[0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5]));
        let delta = up(&b, dt, &bits(dt, &[0.5, 0.5, 0.5, 0.5, -0.5, -0.5, -0.5, -0.5]));
        let w = up(&b, dt, &bits(dt, &[1.0, 1.0, 2.0, 1.0]));
        let bias = up(&b, dt, &bits(dt, &[0.0, 0.5, 0.0, -1.0]));
        let mut out = b.alloc(dt, 8).expect("alloc");
        b.add_layernorm(&p, &mut res, Some(&delta), &w, &bias, &mut out)
            .expect("add_layernorm");
        assert_close(
            dt,
            &res.data,
            &[1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0],
            0.0,
            "residual",
        );
        // √(1.25 + 1e-5) moves the values by 4e-6 relative: far below the tolerance.
        let n = [-1.341641, -0.447214, 0.447214, 1.341641];
        let want: Vec<f64> = n
            .iter()
            .chain(n.iter().map(|x| -x).collect::<Vec<_>>().iter())
            .zip([1.0, 1.0, 2.0, 1.0].iter().cycle())
            .zip([0.0, 0.5, 0.0, -1.0].iter().cycle())
            .map(|((x, w), b)| x * w + b)
            .collect();
        assert_close(dt, &out.data, &want, tol, &format!("{dt} layernorm"));
        // Without a delta the residual is only read.
        let before = res.data.clone();
        b.add_layernorm(&p, &mut res, None, &w, &bias, &mut out)
            .expect("no delta");
        assert_eq!(res.data, before);
        assert_close(dt, &out.data, &want, tol, &format!("{dt} layernorm, no delta"));
    }
}

#[test]
fn bias_activation_and_glu_by_hand() {
    let b = CpuBackend::new();
    let dt = DType::F16;
    let x0 = [-1.0, 0.5, 2.0, -0.25, 1.0, -2.0, 0.0, 3.0];
    let bias = up(&b, dt, &bits(dt, &[0.5, -1.0, 0.0, 0.5]));
    // x + bias = [−0.5, −0.5, 2, 0.25, 1.5, −3, 0, 3.5].
    let cases: [(Activation, [f64; 8]); 4] = [
        (Activation::None, [-0.5, -0.5, 2.0, 0.25, 1.5, -3.0, 0.0, 3.5]),
        (Activation::Relu, [0.0, 0.0, 2.0, 0.25, 1.5, 0.0, 0.0, 3.5]),
        // x·Φ(x): Φ(−0.5) = 0.308538, Φ(2) = 0.977250, Φ(0.25) = 0.598706, Φ(1.5) = 0.933193,
        // Φ(−3) = 0.001350, Φ(3.5) = 0.999767.
        (
            Activation::Gelu,
            [
                -0.154269, -0.154269, 1.954500, 0.149677, 1.399789, -0.004050, 0.0, 3.499186,
            ],
        ),
        // x·sigmoid(x): sigmoid(−0.5) = 0.377541, sigmoid(2) = 0.880797, sigmoid(0.25) =
        // 0.562177, sigmoid(1.5) = 0.817574, sigmoid(−3) = 0.047426, sigmoid(3.5) = 0.970688.
        (
            Activation::Silu,
            [
                -0.188771, -0.188771, 1.761594, 0.140544, 1.226361, -0.142278, 0.0, 3.397408,
            ],
        ),
    ];
    for (act, want) in cases {
        let mut x = up(&b, dt, &bits(dt, &x0));
        let p = BiasActParams {
            rows: 2,
            width: 4,
            act,
            dtype: dt,
        };
        b.bias_act(&p, &mut x, Some(&bias)).expect("bias_act");
        assert_close(dt, &x.data, &want, 2e-3, act.name());
    }
    // No bias, ReLU alone.
    let mut x = up(&b, dt, &bits(dt, &x0));
    let p = BiasActParams {
        rows: 2,
        width: 4,
        act: Activation::Relu,
        dtype: dt,
    };
    b.bias_act(&p, &mut x, None).expect("relu");
    assert_close(dt, &x.data, &[0.0, 0.5, 2.0, 0.0, 1.0, 0.0, 0.0, 3.0], 0.0, "relu");

    // GLU over [gate | up] rows: gate [1, −2], up [3, 4]: GELU gives [0.841345·3, −0.045500·4],
    // ReLU [3, 0], the tanh GELU 0.841192·3 and −0.045402·4, SiLU 0.731059·3 and −0.238406·4.
    let gate_up = up(&b, dt, &bits(dt, &[1.0, -2.0, 3.0, 4.0]));
    for (act, want) in [
        (Activation::Gelu, [2.524034, -0.182001]),
        (Activation::Relu, [3.0, 0.0]),
        (Activation::GeluTanh, [2.523577, -0.181609]),
        (Activation::Silu, [2.193176, -0.953624]),
    ] {
        let mut out = b.alloc(dt, 2).expect("alloc");
        let p = GluParams {
            rows: 1,
            inter: 2,
            act,
            dtype: dt,
        };
        b.glu(&p, &gate_up, &mut out).expect("glu");
        assert_close(dt, &out.data, &want, 2e-3, &format!("glu {}", act.name()));
    }
}

#[test]
fn learned_positions_add_the_offset_row() {
    let b = CpuBackend::new();
    let dt = DType::F16;
    // Row r of the table is [r, 10r]; positions 0 and 2 with OPT's offset 2 read rows 2 and 4.
    let table: Vec<f64> = (0..5).flat_map(|r| [r as f64, 10.0 * r as f64]).collect();
    let table = up(&b, dt, &bits(dt, &table));
    let mut out = up(&b, dt, &bits(dt, &[1.0, 1.0, 0.0, 0.5]));
    let p = PositionParams {
        positions: vec![0, 2],
        offset: 2,
        table_rows: 5,
        hidden: 2,
        dtype: dt,
    };
    b.add_positions(&p, &table, &mut out).expect("add_positions");
    assert_close(dt, &out.data, &[3.0, 21.0, 4.0, 40.5], 0.0, "positions");
    // Position 3 + 2 is past the 5 rows: refused, out untouched.
    let before = out.data.clone();
    let p = PositionParams {
        positions: vec![3],
        ..p
    };
    let m = msg(b.add_positions(&p, &table, &mut out).expect_err("past the table"));
    assert!(m.contains("position 3") && m.contains("5 rows"), "{m}");
    assert_eq!(out.data, before);
}

#[test]
fn partial_rotary_in_both_layouts_and_none_by_hand() {
    let b = CpuBackend::new();
    let dt = DType::F16;
    // One q head, one k head, one v head of 64; token at position 1; two frequencies [1, 0.5]
    // rotate the first 4 elements of q and k; the other 60 pass through (plus the bias).
    let geom = AttnGeometry::new(1, 1, 64).expect("geom");
    let head: Vec<f64> = [1.0, 0.0, 0.0, 1.0]
        .into_iter()
        .chain((4..64).map(|i| i as f64 / 16.0))
        .collect();
    let v_head: Vec<f64> = (0..64).map(|i| -(i as f64) / 32.0).collect();
    let row: Vec<f64> = head.iter().chain(&head).chain(&v_head).copied().collect();
    let qkv = up(&b, dt, &bits(dt, &row));
    let (c1, s1, ch, sh) = (1f64.cos(), 1f64.sin(), 0.5f64.cos(), 0.5f64.sin());
    // Interleaved: pairs (0, 1) at angle 1 and (2, 3) at angle 0.5.
    let inter = [1.0 * c1, 1.0 * s1, -sh, ch];
    // Rotate-half over R = 4: pairs (0, 2) at angle 1 and (1, 3) at angle 0.5.
    let half = [c1, -sh, s1, ch];
    for (layout, inv_freq, first) in [
        (RopeLayout::Interleaved, vec![1.0, 0.5], inter),
        (RopeLayout::Half, vec![1.0, 0.5], half),
        (RopeLayout::Half, vec![], [1.0, 0.0, 0.0, 1.0]),
    ] {
        let p = RopeParams {
            geom,
            dtype: dt,
            positions: vec![1],
            inv_freq,
            layout,
        };
        let (mut q, mut k, mut v) = (
            b.alloc(dt, 64).expect("alloc"),
            b.alloc(dt, 64).expect("alloc"),
            b.alloc(dt, 64).expect("alloc"),
        );
        b.qkv_rope(&p, &qkv, None, &mut q, &mut k, &mut v).expect("qkv_rope");
        let want: Vec<f64> = first.iter().chain(&head[4..]).copied().collect();
        let what = format!("{layout:?} over {}", p.rotary_dim());
        assert_close(dt, &q.data, &want, 2e-3, &format!("q {what}"));
        assert_close(dt, &k.data, &want, 2e-3, &format!("k {what}"));
        assert_close(dt, &v.data, &v_head, 0.0, &format!("v {what}"));
    }
    // With a bias of 0.25 everywhere and no rotation (OPT): the split plus the bias.
    let p = RopeParams {
        geom,
        dtype: dt,
        positions: vec![1],
        inv_freq: vec![],
        layout: RopeLayout::Half,
    };
    let bias = up(&b, dt, &bits(dt, &[0.25; 192]));
    let (mut q, mut k, mut v) = (
        b.alloc(dt, 64).expect("alloc"),
        b.alloc(dt, 64).expect("alloc"),
        b.alloc(dt, 64).expect("alloc"),
    );
    b.qkv_rope(&p, &qkv, Some(&bias), &mut q, &mut k, &mut v)
        .expect("split + bias");
    let want: Vec<f64> = head.iter().map(|x| x + 0.25).collect();
    assert_close(dt, &q.data, &want, 2e-3, "q + bias");
    let want_v: Vec<f64> = v_head.iter().map(|x| x + 0.25).collect();
    assert_close(dt, &v.data, &want_v, 2e-3, "v + bias");
}
