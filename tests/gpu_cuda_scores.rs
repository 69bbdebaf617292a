//! The CUDA softmax-input histograms (kernels_cuda/attn_scores.cu) against the CPU backend's on
//! fresh random q and paged K: the same count, the same extremes (to fp32 rounding) and bins
//! that differ only where a score's fp32 rounding moves it across a bin edge.
//! Run on a GPU machine with `cargo test --test gpu_cuda_scores -- --ignored`.

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::cuda::CudaBackend;
use fdpp::backend::Backend;
use fdpp::dtype::{random_bits, DType};
use fdpp::kv::{BlockTable, FlatBlockTables, PageAllocator, PagedKv, PagedKvLayout};
use fdpp::ops::attention::{AttnGeometry, PrefillParams, SoftmaxScheme};
use fdpp::ops::scores::{score_count, HistSpec, ScoreHist, ScoreStatsParams};

fn run<B: Backend>(
    b: &B,
    p: &PrefillParams,
    s: &ScoreStatsParams,
    layout: PagedKvLayout,
    q: &[u16],
    pools: (&[u16], &[u16]),
) -> Vec<ScoreHist> {
    let q = b.upload(p.dtype, q).expect("q");
    let kv = PagedKv {
        layout,
        k: b.upload(p.dtype, pools.0).expect("k"),
        v: b.upload(p.dtype, pools.1).expect("v"),
    };
    b.attention_score_hist(p, s, &q, &kv).expect("score histogram")
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_score_histograms_match_the_cpu() {
    let (cpu, gpu) = (CpuBackend::new(), CudaBackend::open(0).expect("CUDA device 0"));
    for (dt, heads, kv_heads, d, lens, per_head) in [
        (DType::F16, 8, 2, 128, vec![(97usize, 97usize), (300, 40)], false),
        (DType::Bf16, 4, 4, 64, vec![(1, 1), (530, 530)], true),
        (DType::F16, 4, 1, 256, vec![(200, 1), (33, 1), (77, 1)], false),
    ] {
        let geom = AttnGeometry::new(heads, kv_heads, d).expect("geometry");
        let pages_needed: usize = lens.iter().map(|&(l, _)| l.div_ceil(16)).sum();
        let layout = PagedKvLayout::new(16, pages_needed + 3, kv_heads, d, dt).expect("layout");
        let mut alloc = PageAllocator::new(&layout);
        let mut tables = Vec::new();
        for &(len, _) in &lens {
            let mut t = BlockTable::default();
            alloc.extend(&layout, &mut t, len).expect("pages");
            tables.push(t);
        }
        let flat = FlatBlockTables::new(&layout, &tables).expect("tables");
        let p = PrefillParams {
            geom,
            dtype: dt,
            scheme: SoftmaxScheme::Sync,
            tables: flat,
            new_lens: lens.iter().map(|&(_, n)| n as i32).collect(),
        };
        let q = random_bits(dt, p.tokens() * heads * d, 2.0, 11);
        let k = random_bits(dt, layout.pool_elems(), 2.0, 12);
        let v = random_bits(dt, layout.pool_elems(), 1.0, 13);
        let s = ScoreStatsParams {
            spec: HistSpec {
                lo: -4.0,
                hi: 4.0,
                bins: 256,
            },
            per_head,
        };
        let want = run(&cpu, &p, &s, layout, &q, (&k, &v));
        let got = run(&gpu, &p, &s, layout, &q, (&k, &v));
        assert_eq!(got.len(), want.len());
        let total: u64 = got.iter().map(|h| h.count).sum();
        assert_eq!(total, score_count(&p), "every causal score counted once");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.count, w.count);
            assert!(
                (g.min - w.min).abs() <= 1e-4 * w.min.abs().max(1.0),
                "min {} vs {}",
                g.min,
                w.min
            );
            assert!(
                (g.max - w.max).abs() <= 1e-4 * w.max.abs().max(1.0),
                "max {} vs {}",
                g.max,
                w.max
            );
            let moved: u64 = g.counts.iter().zip(&w.counts).map(|(a, b)| a.abs_diff(*b)).sum::<u64>()
                + g.under.abs_diff(w.under)
                + g.over.abs_diff(w.over);
            assert!(
                moved * 1000 <= g.count.max(1),
                "{moved} of {} scores in other bins",
                g.count
            );
            assert!(
                g.under + g.over > 0 && g.counts.iter().sum::<u64>() > 0,
                "scores reach both the bins and the tails"
            );
        }
    }
}
