//! Softmax-input histograms on the CPU (calibration, FlashDecoding++ §3): every score
//! x = (q·k)/√d that an attention step computes, binned.
//!
//! q and k are widened to f32 and dotted in f32 in four interleaved partial sums, then scaled by
//! 1/√d. The GPU kernels sum in another order (and the CPU attention pre-scales q instead), so a
//! score may differ from theirs in its last bits and land in the neighbouring bin when it lies on
//! an edge; counts, extremes to a few ulps and the calibrated window do not depend on it.

use rayon::prelude::*;

use crate::kv::paged::PagedKvLayout;
use crate::ops::attention::PrefillParams;
use crate::ops::scores::{ScoreHist, ScoreStatsParams};

fn dot4(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 4];
    let n = a.len().min(b.len()) / 4 * 4;
    for (x, y) in a[..n].chunks_exact(4).zip(b[..n].chunks_exact(4)) {
        for i in 0..4 {
            s[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a[n..].iter().zip(&b[n..]).map(|(x, y)| x * y).sum();
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

/// Histograms of the scores of `p` (one, or one per query head when `s.per_head`). Params and
/// buffers are validated by the caller; the new tokens' K must already be in `k_pool`.
pub fn score_hist(
    p: &PrefillParams,
    s: &ScoreStatsParams,
    layout: &PagedKvLayout,
    q: &[u16],
    k_pool: &[u16],
) -> Vec<ScoreHist> {
    let g = p.geom;
    let (h, grp, d, dt) = (g.num_heads, g.group(), g.head_dim, p.dtype);
    let scale = g.scale();
    let n_hists = if s.per_head { h } else { 1 };
    let spans = p.spans();
    let tb = &p.tables;
    // One task per new token: (sequence, its index within the step's rows).
    let rows: Vec<(usize, usize)> = spans
        .iter()
        .enumerate()
        .flat_map(|(b, &(row0, _, n))| (0..n).map(move |j| (b, row0 + j)))
        .collect();
    let empty = || vec![ScoreHist::new(s.spec); n_hists];
    rows.par_iter()
        .fold(
            || (empty(), vec![0f32; d], vec![0f32; d]),
            |(mut hists, mut qf, mut kf), &(b, row)| {
                let (row0, prefix, _) = spans[b];
                let keys = prefix + (row - row0) + 1;
                let pages = &tb.block_table[b * tb.max_pages..(b + 1) * tb.max_pages];
                for head in 0..h {
                    let at = (row * h + head) * d;
                    dt.widen(&q[at..at + d], &mut qf);
                    let hist = &mut hists[if s.per_head { head } else { 0 }];
                    for t in 0..keys {
                        let page = pages[t / layout.page_size] as usize;
                        let off = layout.offset(page, t % layout.page_size, head / grp);
                        dt.widen(&k_pool[off..off + d], &mut kf);
                        hist.add(dot4(&qf, &kf) * scale);
                    }
                }
                (hists, qf, kf)
            },
        )
        .map(|(hists, _, _)| hists)
        .reduce(empty, |mut a, b| {
            for (x, y) in a.iter_mut().zip(&b) {
                // Same spec by construction.
                let _ = x.merge(y);
            }
            a
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{random_bits, DType};
    use crate::kv::paged::{write_tokens, FlatBlockTables};
    use crate::kv::BlockTable;
    use crate::ops::attention::{AttnGeometry, SoftmaxScheme};
    use crate::ops::scores::{score_count, HistSpec};

    /// A ragged batch with a cached prefix, GQA 2, against a plain loop over (token, head, key)
    /// in f64: every score lands in the bin of its f64 value (up to f32 rounding at an edge).
    #[test]
    fn histograms_match_a_plain_loop_and_count_every_causal_pair() {
        let dt = DType::F16;
        let geom = AttnGeometry::new(4, 2, 64).expect("geom");
        let layout = PagedKvLayout::new(4, 16, 2, 64, dt).expect("layout");
        let tables = [
            BlockTable {
                pages: vec![3, 0, 7],
                seq_len: 11,
            },
            BlockTable {
                pages: vec![5, 9],
                seq_len: 6,
            },
        ];
        let new_lens = [3i32, 6];
        let mut k_pool = vec![0u16; layout.pool_elems()];
        for (i, t) in tables.iter().enumerate() {
            let bits = random_bits(dt, t.seq_len * layout.token_elems(), 1.0, 40 + i as u64);
            write_tokens(&layout, &mut k_pool, t, 0, &bits).expect("write");
        }
        let tokens = 9;
        let q = random_bits(dt, tokens * 4 * 64, 1.0, 7);
        let p = PrefillParams {
            geom,
            dtype: dt,
            scheme: SoftmaxScheme::Sync,
            tables: FlatBlockTables::new(&layout, &tables).expect("flat"),
            new_lens: new_lens.to_vec(),
        };
        let spec = HistSpec {
            lo: -4.0,
            hi: 4.0,
            bins: 64,
        };
        let per_head = score_hist(&p, &ScoreStatsParams { spec, per_head: true }, &layout, &q, &k_pool);
        let one = score_hist(&p, &ScoreStatsParams { spec, per_head: false }, &layout, &q, &k_pool);
        assert_eq!(per_head.len(), 4);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].count, score_count(&p));
        let mut merged = ScoreHist::new(spec);
        for hh in &per_head {
            merged.merge(hh).expect("spec");
        }
        assert_eq!(merged, one[0]);

        // The plain loop.
        let mut want = vec![ScoreHist::new(spec); 4];
        let mut row = 0;
        for (b, t) in tables.iter().enumerate() {
            let n = new_lens[b] as usize;
            let prefix = t.seq_len - n;
            for j in 0..n {
                for head in 0..4 {
                    let qv: Vec<f64> = (0..64)
                        .map(|i| dt.to_f32(q[(row * 4 + head) * 64 + i]) as f64)
                        .collect();
                    for key in 0..=prefix + j {
                        let (page, slot) = t.locate(&layout, key).expect("page");
                        let off = layout.offset(page, slot, head / 2);
                        let x: f64 = (0..64).map(|i| qv[i] * dt.to_f32(k_pool[off + i]) as f64).sum::<f64>() / 8.0;
                        want[head].add(x as f32);
                    }
                }
                row += 1;
            }
        }
        for (got, want) in per_head.iter().zip(&want) {
            assert_eq!((got.count, got.under, got.over), (want.count, want.under, want.over));
            assert!((got.min - want.min).abs() < 1e-5 && (got.max - want.max).abs() < 1e-5);
            // A score within f32 rounding of a bin edge may move one bin.
            let moved: u64 = got.counts.iter().zip(&want.counts).map(|(a, b)| a.abs_diff(*b)).sum();
            assert!(moved <= 2, "{moved} scores in other bins");
            assert!(got.counts.iter().filter(|&&c| c > 0).count() > 4, "spread over bins");
        }
    }
}
