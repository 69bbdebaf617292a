//! CPU attention against the f64 reference: every quick case under both schemes, the forced
//! recomputes, and every bad input of issue #4 refused with its reason (no panics).

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::Backend;
use fdpp::check::attention::{attention_cases_quick, check_attention, AttnKind, CHECK_ASYNC};
use fdpp::check::Status;
use fdpp::dtype::{random_bits, DType};
use fdpp::kv::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout};
use fdpp::ops::attention::{AttnGeometry, DecodeParams, PrefillParams, SoftmaxScheme};
use fdpp::reference::attention::decode_ref;
use fdpp::reference::gemm::nmse;

#[test]
fn every_quick_case_passes_on_the_cpu() {
    let b = CpuBackend::new();
    let cases = attention_cases_quick();
    let rows = check_attention(&b, &cases, 0xC0FFEE).expect("check runs");
    assert_eq!(rows.len(), 2 * cases.len(), "sync and async per case");
    for r in &rows {
        assert_eq!(
            r.status,
            Status::Pass,
            "{} {} {}: {:?}",
            r.spec,
            r.dtype,
            r.case,
            r.status
        );
        assert!(r.nmse.is_some_and(|e| e < 1e-5), "{} {}: {:?}", r.spec, r.case, r.nmse);
    }
    // The forced cases recomputed under async, and only the targeted row.
    let forced: Vec<_> = rows
        .iter()
        .filter(|r| r.case.contains("force=") && r.spec.contains("async"))
        .collect();
    assert_eq!(forced.len(), 8, "2 kinds × 2 forces × 2 dtypes");
    for r in forced {
        assert_eq!(r.recomputed, Some(1), "{} {}", r.spec, r.case);
    }
    for kind in [AttnKind::Decode, AttnKind::Prefill] {
        assert!(rows
            .iter()
            .any(|r| r.kind == kind && r.recomputed == Some(0) && r.spec.contains("async")));
    }
}

/// A small decode set-up: one sequence of `len` tokens in pages 0.., h/kv heads of dim d.
fn decode_setup(
    h: usize,
    kv: usize,
    d: usize,
    len: usize,
) -> (CpuBackend, DecodeParams, PagedKv<fdpp::backend::cpu::CpuBuffer>) {
    let b = CpuBackend::new();
    let dt = DType::F16;
    let pages = len.div_ceil(16).max(1);
    let layout = PagedKvLayout::new(16, pages + 1, kv, d, dt).expect("layout");
    let table = BlockTable {
        pages: (0..pages as u32).collect(),
        seq_len: len,
    };
    let tables = FlatBlockTables::new(&layout, &[table]).expect("tables");
    let kv = PagedKv {
        layout,
        k: b.upload(dt, &random_bits(dt, layout.pool_elems(), 2.0, 1)).expect("k"),
        v: b.upload(dt, &random_bits(dt, layout.pool_elems(), 1.0, 2)).expect("v"),
    };
    let p = DecodeParams {
        geom: AttnGeometry {
            num_heads: h,
            num_kv_heads: kv.layout.num_kv_heads,
            head_dim: d,
        },
        dtype: dt,
        scheme: SoftmaxScheme::Sync,
        tables,
        num_splits: None,
    };
    (b, p, kv)
}

fn run_decode(b: &CpuBackend, p: &DecodeParams, kv: &PagedKv<fdpp::backend::cpu::CpuBuffer>) -> fdpp::Result<Vec<u16>> {
    let n = p.batch() * p.geom.num_heads * p.geom.head_dim;
    let q = b.upload(p.dtype, &random_bits(p.dtype, n, 2.0, 3))?;
    let mut out = b.alloc(p.dtype, n)?;
    b.attention_decode(p, &q, kv, &mut out)?;
    b.download(&out)
}

#[test]
fn split_count_does_not_change_the_result() {
    let (b, mut p, kv) = decode_setup(8, 2, 64, 1500);
    let n = p.geom.num_heads * p.geom.head_dim;
    let qb = random_bits(p.dtype, n, 2.0, 9);
    let q = b.upload(p.dtype, &qb).expect("q");
    let reference = decode_ref(&p, &kv.layout, &qb, &kv.k.data, &kv.v.data);
    for scheme in [SoftmaxScheme::Sync, CHECK_ASYNC] {
        for splits in [1, 2, 5, 64] {
            p.scheme = scheme;
            p.num_splits = Some(splits);
            let mut out = b.alloc(p.dtype, n).expect("out");
            let stats = b.attention_decode(&p, &q, &kv, &mut out).expect("decode");
            assert_eq!(stats.recomputed, 0);
            let y: Vec<f64> = out.data.iter().map(|&x| p.dtype.to_f32(x) as f64).collect();
            let e = nmse(&y, &reference);
            assert!(e < 1e-5, "{} splits={splits}: NMSE {e}", scheme.label());
        }
    }
}

#[test]
fn unsupported_head_dim_is_refused_naming_the_supported_set() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.geom.head_dim = 80;
    let e = run_decode(&b, &p, &kv).expect_err("head_dim 80");
    assert!(e.to_string().contains("head_dim 80; supported: [64, 128, 256]"), "{e}");
}

#[test]
fn unsupported_gqa_ratio_is_refused_naming_the_supported_set() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.geom.num_heads = 12; // ratio 3
    let e = run_decode(&b, &p, &kv).expect_err("ratio 3");
    let s = e.to_string();
    assert!(
        s.contains("GQA ratio 3") && s.contains("supported: [1, 2, 4, 8, 16]"),
        "{s}"
    );
}

#[test]
fn kv_len_zero_is_refused() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.tables.seq_lens[0] = 0;
    let e = run_decode(&b, &p, &kv).expect_err("kv_len 0");
    assert!(e.to_string().contains("kv_len is 0"), "{e}");
}

#[test]
fn block_table_past_the_pool_is_refused() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 40);
    p.tables.block_table[1] = kv.layout.num_pages as i32 + 5;
    let e = run_decode(&b, &p, &kv).expect_err("page past the pool");
    assert!(e.to_string().contains("past the pool"), "{e}");
    // The same table for prefill.
    let layout = kv.layout;
    let mut kv = kv;
    let pp = PrefillParams {
        geom: p.geom,
        dtype: p.dtype,
        scheme: SoftmaxScheme::Sync,
        tables: p.tables.clone(),
        new_lens: vec![40],
    };
    let n = 40 * p.geom.num_heads * p.geom.head_dim;
    let q = b.upload(p.dtype, &random_bits(p.dtype, n, 1.0, 4)).expect("q");
    let kn = b
        .upload(p.dtype, &random_bits(p.dtype, 40 * layout.token_elems(), 1.0, 5))
        .expect("k");
    let mut out = b.alloc(p.dtype, n).expect("out");
    let before = kv.k.data.clone();
    let e = b
        .attention_prefill(&pp, &q, &kn, &kn, &mut kv, &mut out)
        .expect_err("prefill too");
    assert!(e.to_string().contains("past the pool"), "{e}");
    assert_eq!(kv.k.data, before, "a refused prefill writes nothing");
}

#[test]
fn async_windows_that_overflow_fp32_are_refused_with_the_reason() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.scheme = SoftmaxScheme::Async {
        phi: 0.0,
        a: -80.0,
        b: 10.0,
    };
    let e = run_decode(&b, &p, &kv).expect_err("b - a = 90");
    assert!(e.to_string().contains("e^(b−a) = e^90 overflows fp32"), "{e}");
    p.scheme = SoftmaxScheme::Async {
        phi: 0.0,
        a: 1.0,
        b: -1.0,
    };
    assert!(run_decode(&b, &p, &kv).is_err());
}

#[test]
fn prefill_with_bad_new_lens_is_refused() {
    let (b, p, mut kv) = decode_setup(4, 4, 64, 20);
    let n = 21 * p.geom.num_heads * p.geom.head_dim;
    let q = b.upload(p.dtype, &random_bits(p.dtype, n, 1.0, 4)).expect("q");
    let k = b
        .upload(p.dtype, &random_bits(p.dtype, 21 * 4 * 64, 1.0, 5))
        .expect("k");
    let mut out = b.alloc(p.dtype, n).expect("out");
    for new_lens in [vec![21], vec![0], vec![5, 5]] {
        let pp = PrefillParams {
            geom: p.geom,
            dtype: p.dtype,
            scheme: SoftmaxScheme::Sync,
            tables: p.tables.clone(),
            new_lens: new_lens.clone(),
        };
        let e = b
            .attention_prefill(&pp, &q, &k, &k, &mut kv, &mut out)
            .expect_err("bad new_lens");
        assert!(e.to_string().contains("new"), "{new_lens:?}: {e}");
    }
}

#[test]
fn short_buffers_and_mismatched_caches_are_refused() {
    let (b, p, kv) = decode_setup(4, 4, 64, 20);
    let q = b.upload(p.dtype, &random_bits(p.dtype, 4 * 64 - 1, 1.0, 4)).expect("q");
    let mut out = b.alloc(p.dtype, 4 * 64).expect("out");
    let e = b.attention_decode(&p, &q, &kv, &mut out).expect_err("short q");
    assert!(e.to_string().contains("decode q"), "{e}");
    let mut p2 = p.clone();
    p2.geom = AttnGeometry::new(8, 2, 64).expect("geom");
    let e = run_decode(&b, &p2, &kv).expect_err("cache has 4 kv heads");
    assert!(e.to_string().contains("kv_heads=4"), "{e}");
}
