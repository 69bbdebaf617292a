//! How a model is cut across `world` ranks, Megatron-LM style (Shoeybi et al., 2019, §3): the
//! QKV and FFN1 GEMMs column-parallel (each rank its query heads, its KV heads, its slice of
//! the intermediate size), O and FFN2 row-parallel (each rank the matching columns of K), so a
//! layer needs one all-reduce after O and one after FFN2 and nothing in between. Everything
//! else (embedding, norms, LM head) is replicated.
//!
//! GQA: with at least as many KV heads as ranks each rank keeps `kv_heads / world` of them; with
//! fewer, every rank keeps the one KV head its query heads read (replicated over
//! `world / kv_heads` ranks), which needs `world` to be a multiple of `kv_heads`.
//!
//! A rank runs the engine on the model of [`rank_config`]: the same hidden size, head size and
//! vocabulary, 1/world of the heads and of the intermediate size. Its KV cache, activation
//! buffers and GEMM shapes follow from that config (FlashDecoding++Next sizes its buffers by
//! F·H·D/T the same way), and so does the profile lookup (issue #22 item 3).

use std::ops::Range;

use crate::error::{FdppError, Result};
use crate::model::ModelConfig;

/// The flag every message names.
pub const FLAG: &str = "--tp";

/// Why `world` ranks cannot split `cfg`, naming the sizes; Ok when they can.
pub fn check(cfg: &ModelConfig, world: usize) -> Result<()> {
    let bad = |msg: String| Err(FdppError::InvalidArgument(format!("{FLAG} {world}: {msg}")));
    if world == 0 {
        return bad("tensor parallelism needs at least 1 rank (1 runs on one device)".into());
    }
    let (h, g, i) = (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size);
    if h == 0 || g == 0 || i == 0 {
        return bad(format!(
            "model '{}' has {h} attention heads, {g} KV heads and intermediate size {i}; none may be 0",
            cfg.name
        ));
    }
    if !h.is_multiple_of(world) {
        return bad(format!(
            "it does not divide the {h} attention heads (num_attention_heads) of '{}'; use one of {}",
            cfg.name,
            divisors(h).join(", ")
        ));
    }
    if g >= world && !g.is_multiple_of(world) {
        return bad(format!(
            "it does not divide the {g} KV heads (num_key_value_heads) of '{}'; use a divisor of {g}, or a \
             multiple of {g} that divides {h}",
            cfg.name
        ));
    }
    if g < world && !world.is_multiple_of(g) {
        return bad(format!(
            "'{}' has {g} KV heads, fewer than the ranks: each KV head is then replicated over a whole \
             number of ranks, so {FLAG} must be a multiple of {g}",
            cfg.name
        ));
    }
    if !i.is_multiple_of(world) {
        return bad(format!(
            "it does not divide the intermediate size {i} (intermediate_size / ffn_dim) of '{}'",
            cfg.name
        ));
    }
    Ok(())
}

fn divisors(n: usize) -> Vec<String> {
    (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect()
}

/// The model one rank of `world` runs: 1/world of the heads and of the intermediate size, at
/// least one KV head, the rest as `cfg`. Named `<name>-tp<world>` when world > 1, so that
/// `fdpp tune --tp N` writes, and the engine finds, the profile of the per-rank shapes.
pub fn rank_config(cfg: &ModelConfig, world: usize) -> Result<ModelConfig> {
    check(cfg, world)?;
    if world == 1 {
        return Ok(cfg.clone());
    }
    let mut c = cfg.clone();
    c.name = format!("{}-tp{world}", cfg.name);
    c.num_heads = cfg.num_heads / world;
    c.num_kv_heads = (cfg.num_kv_heads / world).max(1);
    c.intermediate_size = cfg.intermediate_size / world;
    Ok(c)
}

/// One rank's share, as row and column ranges of the full weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub rank: usize,
    pub world: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    gated: bool,
}

impl Split {
    /// Rank `rank` of `world` over `cfg` (checked as [`check`] does).
    pub fn new(cfg: &ModelConfig, rank: usize, world: usize) -> Result<Split> {
        check(cfg, world)?;
        if rank >= world {
            return Err(FdppError::InvalidArgument(format!(
                "internal: rank {rank} of {world} ranks"
            )));
        }
        Ok(Split {
            rank,
            world,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            inter: cfg.intermediate_size,
            gated: cfg.gated_ffn,
        })
    }

    /// This rank's query heads.
    pub fn q_heads(&self) -> Range<usize> {
        let n = self.heads / self.world;
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's KV heads: its own slice, or (fewer KV heads than ranks) the one its query
    /// heads read.
    pub fn kv_heads(&self) -> Range<usize> {
        if self.kv_heads >= self.world {
            let n = self.kv_heads / self.world;
            self.rank * n..(self.rank + 1) * n
        } else {
            let group = self.heads / self.kv_heads;
            let kv = self.q_heads().start / group;
            kv..kv + 1
        }
    }

    /// Whether KV heads are replicated over ranks (fewer of them than ranks).
    pub fn replicated_kv(&self) -> bool {
        self.kv_heads < self.world
    }

    /// This rank's slice of the intermediate size.
    pub fn inter(&self) -> Range<usize> {
        let n = self.inter / self.world;
        self.rank * n..(self.rank + 1) * n
    }

    /// Rows of the full QKV weight (q rows, then k, then v) this rank keeps, in its order.
    pub fn qkv_rows(&self) -> Vec<Range<usize>> {
        let d = self.head_dim;
        let (q, kv) = (self.q_heads(), self.kv_heads());
        let k0 = self.heads * d;
        let v0 = k0 + self.kv_heads * d;
        vec![
            q.start * d..q.end * d,
            k0 + kv.start * d..k0 + kv.end * d,
            v0 + kv.start * d..v0 + kv.end * d,
        ]
    }

    /// Rows of the full FFN1 weight this rank keeps: its gate rows then the matching up rows
    /// (gated: the slot holds all gate rows, then all up rows), or its fc1 rows.
    pub fn ffn1_rows(&self) -> Vec<Range<usize>> {
        let i = self.inter();
        if self.gated {
            vec![i.clone(), self.inter + i.start..self.inter + i.end]
        } else {
            vec![i]
        }
    }

    /// Columns of the full O weight (K = heads × head_dim) this rank keeps.
    pub fn o_cols(&self) -> Range<usize> {
        let q = self.q_heads();
        q.start * self.head_dim..q.end * self.head_dim
    }

    /// Columns of the full FFN2 weight (K = intermediate size) this rank keeps.
    pub fn ffn2_cols(&self) -> Range<usize> {
        self.inter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    fn cfg(h: usize, g: usize, inter: usize) -> ModelConfig {
        let mut c = preset("llama2-7b").expect("preset");
        c.num_heads = h;
        c.num_kv_heads = g;
        c.head_dim = 4;
        c.intermediate_size = inter;
        c
    }

    #[test]
    fn ranks_cover_the_heads_and_the_intermediate_size_once() {
        for (h, g, tp) in [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 4), (32, 8, 8), (6, 1, 2)] {
            let c = cfg(h, g, 24);
            let splits: Vec<Split> = (0..tp).map(|r| Split::new(&c, r, tp).expect("split")).collect();
            let q: Vec<usize> = splits.iter().flat_map(|s| s.q_heads()).collect();
            assert_eq!(q, (0..h).collect::<Vec<_>>(), "h={h} tp={tp}");
            let inter: Vec<usize> = splits.iter().flat_map(|s| s.inter()).collect();
            assert_eq!(inter, (0..24).collect::<Vec<_>>());
            for s in &splits {
                // Every query head of the rank reads a KV head the rank holds.
                let group = h / g;
                for qh in s.q_heads() {
                    assert!(s.kv_heads().contains(&(qh / group)), "h={h} g={g} tp={tp}");
                }
                let rc = rank_config(&c, tp).expect("rank config");
                assert_eq!(s.kv_heads().len(), rc.num_kv_heads);
                assert_eq!(s.q_heads().len(), rc.num_heads);
                assert_eq!(s.replicated_kv(), g < tp);
                let rows: usize = s.qkv_rows().iter().map(|r| r.len()).sum();
                assert_eq!(rows, (rc.num_heads + 2 * rc.num_kv_heads) * 4);
            }
        }
    }

    #[test]
    fn the_qkv_and_ffn1_rows_follow_the_slot_layouts() {
        // 4 query heads, 2 KV heads of 4: q rows 0..16, k 16..24, v 24..32.
        let c = cfg(4, 2, 8);
        let s = Split::new(&c, 1, 2).expect("split");
        assert_eq!(s.qkv_rows(), vec![8..16, 20..24, 28..32]);
        // Gate rows 0..8 then up rows 8..16.
        assert_eq!(s.ffn1_rows(), vec![4..8, 12..16]);
        assert_eq!(s.o_cols(), 8..16);
        assert_eq!(s.ffn2_cols(), 4..8);
        // 4 ranks over 2 KV heads: ranks 0, 1 read KV head 0, ranks 2, 3 KV head 1.
        let kv: Vec<_> = (0..4)
            .map(|r| Split::new(&c, r, 4).expect("split").kv_heads())
            .collect();
        assert_eq!(kv, vec![0..1, 0..1, 1..2, 1..2]);
        let mut plain = c.clone();
        plain.gated_ffn = false;
        assert_eq!(Split::new(&plain, 1, 2).expect("split").ffn1_rows(), vec![4..8]);
    }

    #[test]
    fn bad_degrees_name_the_flag_and_the_sizes() {
        let err = |h, g, i, tp| check(&cfg(h, g, i), tp).unwrap_err().to_string();
        let e = err(32, 8, 64, 0);
        assert!(e.contains("--tp 0") && e.contains("at least 1"), "{e}");
        let e = err(32, 8, 64, 3);
        assert!(
            e.contains("--tp 3") && e.contains("32 attention heads") && e.contains("1, 2, 4, 8, 16, 32"),
            "{e}"
        );
        let e = err(32, 8, 60, 8);
        assert!(e.contains("intermediate size 60"), "{e}");
        let e = err(12, 3, 64, 4);
        assert!(e.contains("3 KV heads") && e.contains("multiple of 3"), "{e}");
        let e = err(24, 6, 64, 4);
        assert!(e.contains("6 KV heads"), "{e}");
        assert!(check(&cfg(32, 8, 64), 4).is_ok());
        assert_eq!(rank_config(&cfg(32, 8, 64), 1).expect("tp 1"), cfg(32, 8, 64));
        let rc = rank_config(&cfg(32, 8, 64), 4).expect("tp 4");
        assert_eq!((rc.num_heads, rc.num_kv_heads, rc.intermediate_size), (8, 2, 16));
        assert!(rc.name.ends_with("-tp4"));
    }
}
