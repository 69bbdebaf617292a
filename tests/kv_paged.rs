//! The paged KV cache end to end on the CPU backend: two sequences share one pool (their pages
//! interleave as they grow), a prefill writes their prompts into it, decode steps append one
//! token each and read everything back, and running out of pages is a clean error.

use fdpp::backend::cpu::{CpuBackend, CpuBuffer};
use fdpp::backend::Backend;
use fdpp::dtype::{random_bits, DType};
use fdpp::kv::paged::{read_token, write_tokens};
use fdpp::kv::{BlockTable, FlatBlockTables, PageAllocator, PagedKv, PagedKvLayout};
use fdpp::ops::attention::{AttnGeometry, DecodeParams, PrefillParams, SoftmaxScheme};
use fdpp::reference::attention::{decode_ref, prefill_ref};
use fdpp::reference::gemm::nmse;
use fdpp::FdppError;

const DT: DType = DType::Bf16;

fn widen(bits: &[u16]) -> Vec<f64> {
    bits.iter().map(|&b| DT.to_f32(b) as f64).collect()
}

#[test]
fn prefill_then_decode_steps_share_one_pool() {
    let b = CpuBackend::new();
    let geom = AttnGeometry::new(8, 2, 64).expect("geom");
    // 5 pages of 8 tokens: prompts of 13 and 5 tokens, then 6 decode steps (19 and 11 tokens:
    // 3 + 2 pages, the whole pool), then a step that needs more than is left.
    let layout = PagedKvLayout::new(8, 5, geom.num_kv_heads, geom.head_dim, DT).expect("layout");
    let mut alloc = PageAllocator::new(&layout);
    let mut tables = vec![BlockTable::default(), BlockTable::default()];
    // Grow the two sequences a page at a time, alternately, so their pages interleave.
    alloc.extend(&layout, &mut tables[0], 8).expect("page");
    alloc.extend(&layout, &mut tables[1], 5).expect("page");
    alloc.extend(&layout, &mut tables[0], 13).expect("page");
    assert_eq!(tables[0].pages, vec![0, 2]);
    assert_eq!(tables[1].pages, vec![1]);

    let mut kv = PagedKv {
        layout,
        k: b.upload(DT, &random_bits(DT, layout.pool_elems(), 2.0, 1))
            .expect("k pool"),
        v: b.upload(DT, &random_bits(DT, layout.pool_elems(), 1.0, 2))
            .expect("v pool"),
    };
    let kvd = layout.token_elems();
    let hd = geom.num_heads * geom.head_dim;

    // Prefill both prompts.
    let tokens = 13 + 5;
    let q = random_bits(DT, tokens * hd, 2.0, 3);
    let k = random_bits(DT, tokens * kvd, 2.0, 4);
    let v = random_bits(DT, tokens * kvd, 1.0, 5);
    let p = PrefillParams {
        geom,
        dtype: DT,
        scheme: SoftmaxScheme::ASYNC_DEFAULT,
        tables: FlatBlockTables::new(&layout, &tables).expect("tables"),
        new_lens: vec![13, 5],
    };
    let reference = prefill_ref(&p, &layout, (&q, &k, &v), &kv.k.data, &kv.v.data);
    let (qb, kb, vb) = (
        b.upload(DT, &q).expect("q"),
        b.upload(DT, &k).expect("k"),
        b.upload(DT, &v).expect("v"),
    );
    let mut out = b.alloc(DT, tokens * hd).expect("out");
    let stats = b
        .attention_prefill(&p, &qb, &kb, &vb, &mut kv, &mut out)
        .expect("prefill");
    assert_eq!((stats.rows, stats.recomputed), (tokens * geom.num_heads, 0));
    let e = nmse(&widen(&out.data), &reference);
    assert!(e < 1e-4, "prefill NMSE {e}");
    // The prompt's K of sequence 1, token 4, kv head 1 is where the table says.
    let got = read_token(&layout, &kv.k.data, &tables[1], 4, 1).expect("token");
    assert_eq!(got, &k[(13 + 4) * kvd + 64..(13 + 4) * kvd + 128]);

    // Decode steps: append each sequence's new token, then attend.
    for step in 0..6u64 {
        let mut new_kv: Vec<(Vec<u16>, Vec<u16>)> = Vec::new();
        for (s, t) in tables.iter_mut().enumerate() {
            let pos = t.seq_len;
            alloc.extend(&layout, t, pos + 1).expect("room for 6 steps");
            let kt = random_bits(DT, kvd, 2.0, 100 + step * 2 + s as u64);
            let vt = random_bits(DT, kvd, 1.0, 200 + step * 2 + s as u64);
            write_tokens(&layout, &mut kv.k.data, t, pos, &kt).expect("write k");
            write_tokens(&layout, &mut kv.v.data, t, pos, &vt).expect("write v");
            new_kv.push((kt, vt));
        }
        let q = random_bits(DT, 2 * hd, 2.0, 300 + step);
        let p = DecodeParams {
            geom,
            dtype: DT,
            scheme: if step % 2 == 0 {
                SoftmaxScheme::Sync
            } else {
                SoftmaxScheme::ASYNC_DEFAULT
            },
            tables: FlatBlockTables::new(&layout, &tables).expect("tables"),
            num_splits: Some(2),
        };
        let reference = decode_ref(&p, &layout, &q, &kv.k.data, &kv.v.data);
        let mut out: CpuBuffer = b.alloc(DT, 2 * hd).expect("out");
        b.attention_decode(&p, &b.upload(DT, &q).expect("q"), &kv, &mut out)
            .expect("decode");
        let e = nmse(&widen(&out.data), &reference);
        assert!(e < 1e-4, "step {step}: NMSE {e}");
        // The appended token is read back from the pool.
        let last = read_token(&layout, &kv.v.data, &tables[0], tables[0].seq_len - 1, 0).expect("token");
        assert_eq!(last, &new_kv[0].1[..64]);
    }
    assert_eq!((tables[0].seq_len, tables[1].seq_len), (19, 11));
    assert_eq!(alloc.free_pages(), 0);
    let before = tables[1].clone();
    let e = alloc.extend(&layout, &mut tables[1], 17).expect_err("no page left");
    assert!(
        matches!(
            e,
            FdppError::OutOfKvPages {
                needed: 1,
                free: 0,
                total: 5
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("out of KV pages"), "{e}");
    assert_eq!(tables[1], before);
    alloc.release(&mut tables[0]).expect("release");
    assert_eq!(alloc.free_pages(), 3);
    assert!(alloc.release(&mut before.clone()).is_ok());
    let mut twice = BlockTable {
        pages: vec![3],
        seq_len: 1,
    };
    assert!(alloc.release(&mut twice).is_err(), "page 3 is already free");
}
