//! Host-side planning of the attention kernels, shared by the CUDA and ROCm backends
//! (kernels_cuda/attn_*.cu and their HIP ports kernels_hip/attn_*.hip take the same arguments):
//! heads per decode block, the split count and grid of a decode launch, the sizes of its
//! workspaces, the async window in the kernels' log2 units, and the prefill tile list with the
//! block tables packed in front of it. Pure functions of the params, unit-tested on the CPU.

use crate::error::{FdppError, Result};
use crate::ops::attention::{num_splits, num_splits_resident, DecodeParams, PrefillParams, SoftmaxScheme};

/// The kernels work in log2 units (exp2 is one instruction): scores and (φ, a, b) are scaled by
/// log2(e).
pub const LOG2E: f32 = std::f32::consts::LOG2_E;

/// Most query heads one decode block serves: each holds HG · 8 q and HG · 8 accumulator floats
/// per lane, and at 4 heads the bandwidth kernel already runs at 3 resident blocks per SM.
pub const MAX_HEADS_PER_BLOCK: usize = 4;

/// Query heads one decode block serves (the kernels' HG): a GQA group of up to 4 in one block,
/// larger groups in chunks (the chunks of one split run side by side and share K/V in L2).
pub const ATTN_HEADS_PER_BLOCK: &[usize] = &[1, 2, 3, 4];

/// Head chunks of a GQA group: ⌈group / [`MAX_HEADS_PER_BLOCK`]⌉, the fewest blocks that read
/// a kv head's K/V rows (each block of a split reads them once; the second and later come from
/// L2, but every block pays its round trips and its share of the merge).
pub fn attn_chunks(group: usize) -> usize {
    attn_chunks_max(group, MAX_HEADS_PER_BLOCK)
}

/// [`attn_chunks`] for kernels that serve up to `max_hg` heads per block (CUDA's tensor-core
/// pass: 8, so groups of 5-8 take one chunk and 16 two).
pub fn attn_chunks_max(group: usize, max_hg: usize) -> usize {
    group.max(1).div_ceil(max_hg.max(1))
}

/// HG for a GQA group size: the fewest heads per block that keep [`attn_chunks`] chunks, so a
/// group that 4 does not divide wastes the least (ratio 3: one block of 3; 5 and 6: two of 3,
/// the last one partial at 5; 7: two of 4, one head masked; 12: three of 4). Powers of two keep
/// the HG they always had (1, 2, 4). The kernels mask the heads of a partial last chunk.
pub fn attn_heads_per_block(group: usize) -> usize {
    attn_heads_per_block_max(group, MAX_HEADS_PER_BLOCK)
}

/// [`attn_heads_per_block`] for kernels that serve up to `max_hg` heads per block: the fewest
/// heads that keep [`attn_chunks_max`] chunks (max 8: ratios 2-8 in one block of `group` heads,
/// 12 in two of 6, 16 in two of 8).
pub fn attn_heads_per_block_max(group: usize, max_hg: usize) -> usize {
    let group = group.max(1);
    group.div_ceil(attn_chunks_max(group, max_hg))
}

/// The async window in the kernels' log2 units: (φ, a, b) · log2(e); zeros under `Sync`.
pub fn window(scheme: SoftmaxScheme) -> (f32, f32, f32) {
    match scheme {
        SoftmaxScheme::Sync => (0.0, 0.0, 0.0),
        SoftmaxScheme::Async { phi, a, b } => (phi * LOG2E, a * LOG2E, b * LOG2E),
    }
}

/// A kernel's i32 argument, or an error naming it.
pub fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| FdppError::InvalidArgument(format!("attention: {what} = {v} does not fit i32")))
}

/// One split-KV decode launch (FlashDecoding++ §3 on top of Flash-Decoding): the grid is
/// (chunks · splits, batch · kv_heads), one block per (sequence, kv head, split, head chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Query heads per block.
    pub hg: usize,
    /// Blocks per (sequence, kv head, split): ⌈group / hg⌉ (the last one partial when hg does not
    /// divide the group).
    pub chunks: usize,
    pub splits: usize,
    /// batch · heads: the rows of q and out.
    pub rows: usize,
    /// The longest sequence (the split count is chosen for it).
    pub max_len: usize,
}

impl DecodePlan {
    /// The plan of `p` on a device with `compute_units` SMs or CUs; the split count is
    /// `p.num_splits`, else [`num_splits_resident`] when the kernel's resident blocks per SM are
    /// known (`resident`), else [`num_splits`] of the shape.
    pub fn new(p: &DecodeParams, compute_units: usize, resident: Option<usize>) -> Self {
        Self::with_max_heads(p, compute_units, resident, MAX_HEADS_PER_BLOCK)
    }

    /// [`Self::new`] for kernels that serve up to `max_hg` query heads per block.
    pub fn with_max_heads(p: &DecodeParams, compute_units: usize, resident: Option<usize>, max_hg: usize) -> Self {
        let g = p.geom;
        let batch = p.batch();
        let hg = attn_heads_per_block_max(g.group(), max_hg);
        let max_len = (0..batch).map(|i| p.tables.seq_len(i)).max().unwrap_or(1);
        let is_async = matches!(p.scheme, SoftmaxScheme::Async { .. });
        let chunks = g.group().div_ceil(hg);
        let splits = p.num_splits.unwrap_or_else(|| match resident {
            Some(r) => num_splits_resident(batch, g.num_kv_heads, max_len, compute_units, r, hg, chunks, is_async),
            None => num_splits(batch, g.num_kv_heads, max_len, compute_units),
        });
        DecodePlan {
            batch,
            heads: g.num_heads,
            kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
            hg,
            chunks,
            splits,
            rows: batch * g.num_heads,
            max_len,
        }
    }

    /// This plan, made with `resident` blocks per SM of the kernel of path `first`, or, for an
    /// MHA async launch whose split count moved it onto the other path (whose kernel holds
    /// `resident_of(path)`, fewer), the plan made with that kernel's: one wave of the first
    /// kernel would overfill the second's (batch 1 at 2177-3072 keys on 132 SMs: 24 splits at the
    /// bandwidth kernel's 6 per SM are at most 128 keys, the latency path's, whose kernel holds 5).
    pub fn replanned(
        self,
        p: &DecodeParams,
        compute_units: usize,
        max_hg: usize,
        (first, resident): (DecodePath, usize),
        resident_of: &mut dyn FnMut(DecodePath) -> Result<usize>,
    ) -> Result<Self> {
        let path = DecodePath::for_plan(&self, p.scheme, compute_units);
        let mha_async = self.hg == 1 && matches!(p.scheme, SoftmaxScheme::Async { .. });
        if !mha_async || path == first || p.num_splits.is_some() {
            return Ok(self);
        }
        let other = resident_of(path)?;
        Ok(if other < resident {
            DecodePlan::with_max_heads(p, compute_units, Some(other), max_hg)
        } else {
            self
        })
    }

    /// Grid of attn_decode_sync / attn_decode_async.
    pub fn grid(&self) -> Result<(u32, u32, u32)> {
        let u = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| FdppError::InvalidArgument(format!("attention decode: {what} = {v} over u32")))
        };
        Ok((
            u(self.chunks * self.splits, "blocks along x")?,
            u(self.batch * self.kv_heads, "blocks along y")?,
            1,
        ))
    }

    /// f32 elements of the sync partials: acc [rows][splits][D], then (m, l) [rows][splits].
    /// None with one split (the kernel writes out directly, no combine).
    pub fn partial_elems(&self) -> Option<usize> {
        (self.splits > 1).then(|| self.rows * self.splits * (self.head_dim + 2))
    }

    /// 4-byte words of the async workspace: acc [rows][D] and l [rows] (f32), max keys [rows] and
    /// over-flags [rows] (u32), one arrival counter per (sequence, kv head, head chunk).
    pub fn accum_words(&self) -> usize {
        self.rows * (self.head_dim + 3) + self.batch * self.kv_heads * self.chunks
    }
}

/// Longest split (in keys) the latency path takes: measured faster at 64 keys per split (batch 1,
/// kv_len 1024-1088: a split is two rounds of 32 keys) and slower at 241 (kv_len 4096), where the
/// bandwidth path's loop wins; 128 lies between, unmeasured (reports/NOTES-decode-s4.md).
pub const LATENCY_MAX_SPLIT_KEYS: usize = 128;

/// Which CUDA decode kernel a launch uses (kernels_cuda/attn_decode.cu; both take the same
/// arguments, grid and workspaces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePath {
    /// `attn_decode_{sync,async}_t128u4`: page ids a round ahead, one-barrier merge, per-block
    /// flags, one-round-trip async epilogue. For launches that are a chain of dependent round
    /// trips: few blocks' worth of work and short splits.
    Latency,
    /// `attn_decode_{sync,async}`: the same kernel around the bandwidth loop (a page id, then K/V,
    /// per token), for bandwidth-bound launches.
    Bandwidth,
}

impl DecodePath {
    /// Latency for the async scheme when the batch has fewer (sequence, kv head) items than SMs
    /// and every split is at most [`LATENCY_MAX_SPLIT_KEYS`] keys; Bandwidth otherwise (the sync
    /// scheme measured 2-5 % slower on the latency path at batch 1, kv_len 1024-1088).
    /// `--set decode_path=latency|bandwidth` (or `FDPP_DECODE_PATH`) forces one (read once per
    /// process), for measuring.
    pub fn for_plan(plan: &DecodePlan, scheme: SoftmaxScheme, compute_units: usize) -> Self {
        static FORCED: std::sync::OnceLock<Option<DecodePath>> = std::sync::OnceLock::new();
        let forced = *FORCED.get_or_init(
            || match crate::run_config::get().get(crate::run_config::Key::DecodePath) {
                Some("latency") => Some(DecodePath::Latency),
                Some("bandwidth") => Some(DecodePath::Bandwidth),
                _ => None,
            },
        );
        forced.unwrap_or_else(|| Self::by_shape(plan, scheme, compute_units))
    }

    /// The rule of [`Self::for_plan`] without the override.
    pub fn by_shape(plan: &DecodePlan, scheme: SoftmaxScheme, compute_units: usize) -> Self {
        let small = plan.batch * plan.kv_heads < compute_units.max(1);
        let per_split = plan.max_len.div_ceil(plan.splits.max(1));
        let is_async = matches!(scheme, SoftmaxScheme::Async { .. });
        if is_async && small && per_split <= LATENCY_MAX_SPLIT_KEYS {
            DecodePath::Latency
        } else {
            DecodePath::Bandwidth
        }
    }

    /// (sync entry, async entry) of the CUDA-core pass, or (`tc`) of the tensor-core pass
    /// (kernels_cuda/attn_decode_tc.cuh; CUDA only, head_dim 64-256).
    pub fn entries(self, tc: bool) -> (&'static str, &'static str) {
        match (self, tc) {
            (DecodePath::Latency, false) => ("attn_decode_sync_t128u4", "attn_decode_async_t128u4"),
            (DecodePath::Bandwidth, false) => ("attn_decode_sync", "attn_decode_async"),
            (DecodePath::Latency, true) => ("attn_decode_sync_tc_t128u4", "attn_decode_async_tc_t128u4"),
            (DecodePath::Bandwidth, true) => ("attn_decode_sync_tc", "attn_decode_async_tc"),
        }
    }

    /// (sync entry, async entry) of the tensor-core pass's staged form with `stages` cp.async
    /// stages per warp (kernels_cuda/attn_decode_tc.cuh; CUDA only, bandwidth path only), or None
    /// for a stage count that is not built.
    pub fn staged_entries(stages: usize) -> Option<(&'static str, &'static str)> {
        match stages {
            2 => Some(("attn_decode_sync_tcs2", "attn_decode_async_tcs2")),
            3 => Some(("attn_decode_sync_tcs3", "attn_decode_async_tcs3")),
            _ => None,
        }
    }
}

/// The block tables and sequence lengths of a decode launch as one i32 upload: the table
/// (`max_pages` per sequence), then the lengths at the returned index.
pub fn decode_ints(p: &DecodeParams) -> (Vec<i32>, usize) {
    let mut host = p.tables.block_table.clone();
    let lens_at = host.len();
    host.extend_from_slice(&p.tables.seq_lens);
    (host, lens_at)
}

/// The prefill query tiles: one per `bm` new rows of a sequence, as (sequence, first row in
/// q/out, position of the first query in its sequence, rows), the longest key range first so
/// that the causal tail balances across the device.
pub fn prefill_tiles(p: &PrefillParams, bm: usize) -> Result<Vec<[i32; 4]>> {
    if bm == 0 {
        return Err(FdppError::InvalidArgument("attention prefill: 0 rows per tile".into()));
    }
    let mut tiles: Vec<[i32; 4]> = Vec::new();
    for (seq, &(row0, prefix, n)) in p.spans().iter().enumerate() {
        for i in (0..n).step_by(bm) {
            let rows = bm.min(n - i);
            tiles.push([
                i32_of(seq, "sequence")?,
                i32_of(row0 + i, "row")?,
                i32_of(prefix + i, "position")?,
                rows as i32,
            ]);
        }
    }
    tiles.sort_by_key(|t| std::cmp::Reverse(t[2] + t[3]));
    Ok(tiles)
}

/// What [`prefill_sections`] sizes the sections from: the device's L2 and SM count, and the
/// run configuration's `prefill_l2_share` and `prefill_section_waves`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SectionBudget {
    pub l2_bytes: u64,
    pub compute_units: usize,
    /// The share of the L2 a section's K/V must fit.
    pub share: f64,
    /// Blocks a section keeps at least, in waves of `compute_units` (0: the fewest sections).
    pub waves: f64,
}

impl SectionBudget {
    /// FlashAttention-3's budget: 32 MB of the H100's 50 (`prefill_l2_share`'s default).
    pub const SHARE: f64 = 0.625;
    /// The smaller footprint sections are cut down to while each keeps [`Self::WAVES`] waves.
    pub const SMALL_SHARE: f64 = 0.125;
    /// `prefill_section_waves`' default.
    pub const WAVES: f64 = 1.25;

    /// The budget of a device with `l2_bytes` of L2 and `compute_units` SMs, with the run
    /// configuration's `--set prefill_l2_share=F` and `prefill_section_waves=W` if set.
    pub fn new(l2_bytes: u64, compute_units: usize) -> Result<Self> {
        let rc = crate::run_config::get();
        let num = |key, name: &str, dflt: f64, ok: fn(f64) -> bool, want: &str| -> Result<f64> {
            match rc.get(key) {
                None => Ok(dflt),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(f) if ok(f) => Ok(f),
                    _ => Err(FdppError::InvalidArgument(format!("{name}={v}: expected {want}"))),
                },
            }
        };
        Ok(SectionBudget {
            l2_bytes,
            compute_units,
            share: num(
                crate::run_config::Key::PrefillL2Share,
                "prefill_l2_share",
                Self::SHARE,
                |f| f > 0.0 && f <= 1.0,
                "a fraction in (0, 1], e.g. 0.625",
            )?,
            waves: num(
                crate::run_config::Key::PrefillSectionWaves,
                "prefill_section_waves",
                Self::WAVES,
                |f| (0.0..=64.0).contains(&f),
                "a number of waves in [0, 64], e.g. 1.25 (0: the fewest sections that fit)",
            )?,
        })
    }
}

/// Sections of a prefill launch of `blocks` blocks (attn_common.cuh's tile_head), at most one
/// per KV head. At least the fewest that keep each one's K and V (every block of it reads its
/// KV heads' keys, each sequence's up to its end) within `share` of the L2 cache; then more, as
/// far as [`SectionBudget::SMALL_SHARE`] of it, while each section keeps `waves` waves of blocks.
///
/// Measured on the H100 (reports/NOTES.md, session 15): one section for all 32 heads gained
/// 19 % at batch 1 · 1024 tokens and lost 5 % at 1 · 16384 and 16-24 % at batch 8 (MHA; GQA,
/// whose heads share K/V, lost 2-3 %); sections of 15, 15 and 2 heads at 1 · 4096 lost 2 % to
/// the head-by-head order where one section gained 6 %: the small last section's longest tiles
/// ran alone at the end, hence sections of equal size. Session 20: at batch 8 smaller sections
/// gain (8 · 1024 +10 %, 8 · 2048 +4.5 % with a head per section, against 5/8 of the L2), at
/// batch 1 sections under ~1.25 waves lose (1 · 1024 −10 % at 85 blocks a section, 1 · 4096 −7 %
/// at 93).
pub fn prefill_sections(p: &PrefillParams, blocks: usize, b: &SectionBudget) -> usize {
    let g = p.geom;
    let kv_head_bytes: u64 = p
        .spans()
        .iter()
        .map(|&(_, prefix, n)| ((prefix + n) * g.head_dim * 2 * 2) as u64)
        .sum();
    let within = |share: f64| {
        let fit = (((b.l2_bytes as f64 * share) as u64 / kv_head_bytes.max(1)) as usize).max(1);
        g.num_kv_heads.div_ceil(fit)
    };
    let need = within(b.share);
    let waves = b.waves * b.compute_units as f64;
    let cap = if waves > 0.0 {
        (blocks as f64 / waves) as usize
    } else {
        0
    };
    need.max(within(SectionBudget::SMALL_SHARE.min(b.share)).min(cap))
        .clamp(1, g.num_kv_heads.max(1))
}

/// The block table and a list of `N`-int entries (the tiles, or the Hopper kernel's blocks) of
/// a prefill launch as one i32 upload: the table, padding (-1) to a multiple of `N` ints (the
/// kernels load an entry as int4s, which want 16-byte alignment; 32-byte entries stay within one
/// sector), then the entries at the returned index.
pub fn prefill_ints<const N: usize>(p: &PrefillParams, entries: &[[i32; N]]) -> (Vec<i32>, usize) {
    let mut host = p.tables.block_table.clone();
    while !host.len().is_multiple_of(N) {
        host.push(-1);
    }
    let at = host.len();
    host.extend(entries.iter().flatten());
    (host, at)
}

/// `--set prefill_entry_ahead=N` (FDPP_PREFILL_ENTRY_AHEAD): each Hopper prefill block
/// prefetches into L2 the block list's entry of the block N ahead in launch order, so that the
/// block that follows it on its SM finds its entry there (`compute_units`, one wave, when unset;
/// 0: none).
pub fn prefill_entry_ahead(compute_units: usize) -> Result<i32> {
    match crate::run_config::get()
        .get(crate::run_config::Key::PrefillEntryAhead)
        .map(str::trim)
    {
        None | Some("") => i32_of(compute_units, "SM count"),
        Some(v) => match v.parse::<i32>() {
            Ok(n) if (0..=65536).contains(&n) => Ok(n),
            _ => Err(FdppError::InvalidArgument(format!(
                "prefill_entry_ahead={v}: expected a block count from 0 to 65536 (0: no prefetch)"
            ))),
        },
    }
}

/// The (tile, head) of each block of a prefill launch over `ntiles` query tiles, in the order
/// the blocks start (attn_common.cuh's `tile_head`, which attn_prefill.cu computes itself): the
/// `groups` KV groups in `nsec` sections of consecutive groups, sizes differing by at most one
/// (the first ones larger); within a section, tile by tile, the section's heads side by side.
pub fn prefill_block_order(ntiles: usize, heads: usize, groups: usize, nsec: usize) -> Vec<(usize, usize)> {
    let gs = heads / groups.max(1);
    let nsec = nsec.clamp(1, groups.max(1));
    let mut order = Vec::with_capacity(ntiles * heads);
    let mut g0 = 0;
    for sec in 0..nsec {
        let size = groups / nsec + usize::from(sec < groups % nsec);
        for t in 0..ntiles {
            order.extend((g0 * gs..(g0 + size) * gs).map(|h| (t, h)));
        }
        g0 += size;
    }
    order
}

/// How the Hopper prefill's key tiles come by TMA, for [`prefill_blocks`]: the page size, the
/// rows of a box (0: every tile by cp.async) and whether a tile of consecutive pages is one box
/// (tma.rs's run maps are encoded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileBoxes {
    pub page_size: usize,
    pub tma_rows: usize,
    pub runs: bool,
}

/// The Hopper prefill's block list (attn_prefill_hopper.cu reads its entry as two int4s): per
/// block in [`prefill_block_order`], the tile's (sequence, first row, first position, rows), the
/// head, the pool slot of the block's first key tile when that tile comes as one box (-1
/// otherwise: the kernel looks its pages up), the KV head, and an int of padding.
/// With the slot in the entry the kernel requests K of that tile as soon as the entry is in,
/// where the page id was another dependent load (reports/NOTES.md, session 22). `bn` is the
/// kernel's keys per tile.
pub fn prefill_blocks(
    p: &PrefillParams,
    tiles: &[[i32; 4]],
    nsec: usize,
    boxes: TileBoxes,
    bn: usize,
) -> Result<Vec<[i32; 8]>> {
    let g = p.geom;
    let first_slot = |seq: usize, keys: usize| -> Result<i32> {
        // The kernel takes tile 0 by TMA only when every key of it lies before the block's end.
        if boxes.tma_rows == 0 || keys < bn || boxes.page_size == 0 {
            return Ok(-1);
        }
        let mp = p.tables.max_pages;
        let pages = p.tables.block_table.get(seq * mp..(seq + 1) * mp).unwrap_or(&[]);
        let Some(&p0) = pages.first() else { return Ok(-1) };
        let whole = boxes.tma_rows >= bn
            || (boxes.runs
                && (0..bn / boxes.page_size)
                    .all(|j| pages.get(j).is_some_and(|&pj| pj as i64 == p0 as i64 + j as i64)));
        if !whole || p0 < 0 {
            return Ok(-1);
        }
        i32_of(p0 as usize * boxes.page_size, "the first key tile's pool slot")
    };
    // Once per tile (every head of it shares the slot), then once per block.
    let slots = tiles
        .iter()
        .map(|&[seq, _, pos0, rows]| first_slot(seq as usize, (pos0 + rows) as usize))
        .collect::<Result<Vec<i32>>>()?;
    prefill_block_order(tiles.len(), g.num_heads, g.num_kv_heads, nsec)
        .into_iter()
        .map(|(t, h)| {
            let [seq, row0, pos0, rows] = tiles[t];
            let slot = slots[t];
            let kvh = h / g.group().max(1);
            Ok([
                seq,
                row0,
                pos0,
                rows,
                i32_of(h, "head")?,
                slot,
                i32_of(kvh, "kv head")?,
                0,
            ])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::kv::paged::{BlockTable, FlatBlockTables, PagedKvLayout};
    use crate::ops::attention::{AttnGeometry, MAX_SPLITS, MIN_SPLIT_TOKENS};
    use rand::{Rng, SeedableRng};

    fn tables(layout: &PagedKvLayout, lens: &[usize]) -> FlatBlockTables {
        let mut next = 0u32;
        let ts: Vec<BlockTable> = lens
            .iter()
            .map(|&len| {
                let n = layout.pages_for(len) as u32;
                let pages: Vec<u32> = (next..next + n).collect();
                next += n;
                BlockTable { pages, seq_len: len }
            })
            .collect();
        FlatBlockTables::new(layout, &ts).unwrap()
    }

    fn layout(kvh: usize, d: usize) -> PagedKvLayout {
        PagedKvLayout::new(16, 4096, kvh, d, DType::F16).unwrap()
    }

    fn decode(heads: usize, kvh: usize, lens: &[usize], splits: Option<usize>) -> DecodeParams {
        let l = layout(kvh, 128);
        DecodeParams {
            geom: AttnGeometry::new(heads, kvh, 128).unwrap(),
            dtype: DType::F16,
            scheme: SoftmaxScheme::Sync,
            tables: tables(&l, lens),
            num_splits: splits,
        }
    }

    fn prefill(lens: &[usize], new: &[i32]) -> PrefillParams {
        let l = layout(2, 64);
        PrefillParams {
            geom: AttnGeometry::new(8, 2, 64).unwrap(),
            dtype: DType::F16,
            scheme: SoftmaxScheme::Sync,
            tables: tables(&l, lens),
            new_lens: new.to_vec(),
        }
    }

    #[test]
    fn heads_per_block_chunks_every_gqa_group() {
        // Powers of two keep their HG and divide exactly.
        for (group, hg) in [(1usize, 1usize), (2, 2), (4, 4), (8, 4), (16, 4), (32, 4)] {
            assert_eq!(attn_heads_per_block(group), hg, "group {group}");
            assert!(group.is_multiple_of(hg));
        }
        // Other ratios: (group, hg, chunks); the last chunk partial where hg does not divide.
        for (group, hg, chunks) in [
            (3, 3, 1),
            (5, 3, 2),
            (6, 3, 2),
            (7, 4, 2),
            (9, 3, 3),
            (12, 4, 3),
            (14, 4, 4),
        ] {
            assert_eq!(
                (attn_heads_per_block(group), attn_chunks(group)),
                (hg, chunks),
                "group {group}"
            );
        }
        for group in 1..=64 {
            let (hg, chunks) = (attn_heads_per_block(group), attn_chunks(group));
            assert!(ATTN_HEADS_PER_BLOCK.contains(&hg), "group {group} hg {hg}");
            // Every head is served, and the last chunk holds at least one live head.
            assert!(hg * chunks >= group && hg * (chunks - 1) < group, "group {group}");
            // No fewer chunks exist at any HG the kernels are built for.
            assert_eq!(chunks, group.div_ceil(MAX_HEADS_PER_BLOCK));
        }
        assert_eq!(attn_heads_per_block(0), 1);
    }

    #[test]
    fn the_window_is_scaled_to_log2_units() {
        assert_eq!(window(SoftmaxScheme::Sync), (0.0, 0.0, 0.0));
        let (p, a, b) = window(SoftmaxScheme::Async {
            phi: 1.5,
            a: -10.0,
            b: 5.0,
        });
        // e^x = 2^(x·log2 e).
        assert!((p - 1.5 / std::f32::consts::LN_2).abs() < 1e-6);
        assert!((a + 10.0 / std::f32::consts::LN_2).abs() < 1e-5);
        assert!((b - 5.0 / std::f32::consts::LN_2).abs() < 1e-5);
    }

    #[test]
    fn decode_grid_and_workspaces_follow_the_shape() {
        // 32 query heads over 8 kv heads: group 4, one chunk; ragged batch of 3.
        let p = decode(32, 8, &[1, 4097, 97], None);
        let plan = DecodePlan::new(&p, 104, None);
        assert_eq!((plan.hg, plan.chunks, plan.rows, plan.max_len), (4, 1, 96, 4097));
        assert_eq!(plan.splits, num_splits(3, 8, 4097, 104));
        assert!(plan.splits > 1 && plan.splits <= MAX_SPLITS);
        assert!(4097 / plan.splits >= MIN_SPLIT_TOKENS);
        assert_eq!(plan.grid().unwrap(), (plan.splits as u32, 24, 1));
        assert_eq!(plan.partial_elems(), Some(96 * plan.splits * 130));
        assert_eq!(plan.accum_words(), 96 * 131 + 24);

        // GQA 16: four chunks of 4 heads per kv head; an explicit split count is kept.
        let p = decode(32, 2, &[300], Some(3));
        let plan = DecodePlan::new(&p, 104, None);
        assert_eq!((plan.hg, plan.chunks, plan.splits), (4, 4, 3));
        assert_eq!(plan.grid().unwrap(), (12, 2, 1));
        assert_eq!(plan.accum_words(), 32 * 131 + 2 * 4);

        // GQA 5 (40/8): two chunks of 3 heads, the second with one masked head; an arrival
        // counter per (sequence, kv head, chunk).
        let p = decode(40, 8, &[300, 97], Some(2));
        let plan = DecodePlan::new(&p, 104, None);
        assert_eq!((plan.hg, plan.chunks, plan.rows), (3, 2, 80));
        assert_eq!(plan.grid().unwrap(), (4, 16, 1));
        assert_eq!(plan.accum_words(), 80 * 131 + 16 * 2);
        assert_eq!(plan.partial_elems(), Some(80 * 2 * 130));

        // One split: no partials, the sync kernel writes out itself.
        let p = decode(4, 4, &[10], Some(1));
        let plan = DecodePlan::new(&p, 104, None);
        assert_eq!(plan.partial_elems(), None);
        assert_eq!(plan.hg, 1);
        assert_eq!(plan.grid().unwrap(), (1, 4, 1));
    }

    /// Every (row, split) of the partials and every arrival counter is addressed by exactly one
    /// block under the kernels' index arithmetic (`where()` and the chunk id).
    #[test]
    fn decode_blocks_cover_every_row_and_split_once() {
        for (heads, kvh, batch, splits) in [
            (32, 8, 3, 5),
            (32, 2, 2, 3),
            (8, 8, 4, 1),
            (16, 8, 1, 7),
            (9, 3, 2, 3),
            (15, 3, 2, 2),
            (12, 2, 3, 4),
            (28, 4, 2, 3),
            (14, 1, 1, 2),
        ] {
            let p = decode(heads, kvh, &vec![200; batch], Some(splits));
            let plan = DecodePlan::new(&p, 104, None);
            let (gx, gy, _) = plan.grid().unwrap();
            let group = heads / kvh;
            let mut seen = vec![0u8; plan.rows * splits];
            let mut arrivals = vec![0usize; batch * kvh * plan.chunks];
            for by in 0..gy as usize {
                for bx in 0..gx as usize {
                    let chunk = bx % plan.chunks;
                    let split = bx / plan.chunks;
                    let (b, kv) = (by / kvh, by % kvh);
                    let h0 = kv * group + chunk * plan.hg;
                    // The kernels' nh: the live heads of a partial last chunk.
                    let nh = plan.hg.min(group - chunk * plan.hg);
                    for h in 0..nh {
                        seen[(b * heads + h0 + h) * splits + split] += 1;
                    }
                    arrivals[by * plan.chunks + chunk] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "h{heads}/kv{kvh} b{batch} s{splits}");
            assert!(arrivals.iter().all(|&a| a == splits));
        }
    }

    #[test]
    fn the_latency_path_takes_small_async_batches_with_short_splits() {
        let a = SoftmaxScheme::ASYNC_DEFAULT;
        // Llama2-7B batch 1 (32 kv heads, 132 SMs): 16-17 splits of ≤ 68 keys up to kv_len 1152.
        for len in [1024, 1088, 1152] {
            let plan = DecodePlan::new(&decode(32, 32, &[len], None), 132, None);
            assert_eq!(DecodePath::by_shape(&plan, a, 132), DecodePath::Latency, "kv_len {len}");
            // The sync scheme keeps the bandwidth path.
            assert_eq!(
                DecodePath::by_shape(&plan, SoftmaxScheme::Sync, 132),
                DecodePath::Bandwidth
            );
        }
        // Long splits, or a batch that fills the device: the bandwidth path.
        let plan = DecodePlan::new(&decode(32, 32, &[4096], None), 132, None);
        assert_eq!(DecodePath::by_shape(&plan, a, 132), DecodePath::Bandwidth);
        let plan = DecodePlan::new(&decode(32, 32, &[1024; 8], None), 132, None);
        assert_eq!(DecodePath::by_shape(&plan, a, 132), DecodePath::Bandwidth);
        // A forced single split of a short sequence stays on the latency path.
        let plan = DecodePlan::new(&decode(8, 8, &[97], Some(1)), 132, None);
        assert_eq!(DecodePath::by_shape(&plan, a, 132), DecodePath::Latency);
        assert_ne!(DecodePath::Latency.entries(false), DecodePath::Bandwidth.entries(false));
        assert_ne!(DecodePath::Latency.entries(true), DecodePath::Bandwidth.entries(true));
        assert_ne!(
            DecodePath::Bandwidth.entries(true),
            DecodePath::Bandwidth.entries(false)
        );
    }

    #[test]
    fn an_mha_async_plan_moved_onto_the_latency_path_takes_that_kernels_occupancy() {
        let l = PagedKvLayout::new(16, 1 << 14, 32, 128, DType::F16).unwrap();
        let plan = |len: usize, scheme: SoftmaxScheme, kv: usize| {
            let p = DecodeParams {
                geom: AttnGeometry::new(32, kv, 128).unwrap(),
                dtype: DType::F16,
                scheme,
                tables: tables(&l, &[len]),
                num_splits: None,
            };
            let first = DecodePlan::new(&p, 132, None);
            let path0 = DecodePath::by_shape(&first, p.scheme, 132);
            let mut asked = Vec::new();
            // 6 per SM on the bandwidth path, 5 on the latency path (session 40's registers).
            let mut resident_of = |path: DecodePath| {
                asked.push(path);
                Ok(if path == DecodePath::Bandwidth { 6 } else { 5 })
            };
            let r0 = resident_of(path0).unwrap();
            let made = DecodePlan::with_max_heads(&p, 132, Some(r0), 8);
            let out = made.replanned(&p, 132, 8, (path0, r0), &mut resident_of).unwrap();
            (
                path0,
                out.splits,
                DecodePath::by_shape(&out, p.scheme, 132),
                asked.len(),
            )
        };
        let a = SoftmaxScheme::ASYNC_DEFAULT;
        // 3072 keys: 17 splits (bandwidth), one wave of 6 per SM is 24 splits of 128 keys
        // (latency, 5 per SM: 768 blocks over 660 slots), planned again at 5 per SM: 20.
        assert_eq!(plan(3072, a, 32), (DecodePath::Bandwidth, 20, DecodePath::Bandwidth, 2));
        // 4096 keys: 24 splits of 171 keys stay on the bandwidth path.
        assert_eq!(plan(4096, a, 32), (DecodePath::Bandwidth, 24, DecodePath::Bandwidth, 1));
        // 2048 keys: 17 splits of 121 (latency, 5 per SM): one wave of it, 20 splits, stays there.
        assert_eq!(plan(2048, a, 32), (DecodePath::Latency, 20, DecodePath::Latency, 1));
        // Sync stays on the bandwidth path (its count here is one wave of the 6 the test's
        // occupancy gives: 24), asked once; GQA is not planned again.
        assert_eq!(
            plan(3072, SoftmaxScheme::Sync, 32),
            (DecodePath::Bandwidth, 24, DecodePath::Bandwidth, 1)
        );
        assert_eq!(plan(3072, a, 8).3, 1);
    }

    #[test]
    fn a_known_occupancy_sizes_full_batches_by_waves_per_scheme() {
        // Batch 8 of 32 kv heads on 132 SMs at 6-7 resident blocks per SM: one wave, 3 splits.
        let mut p = decode(32, 32, &[1024; 8], None);
        assert_eq!(DecodePlan::new(&p, 132, Some(7)).splits, 3);
        assert_eq!(DecodePlan::new(&p, 132, None).splits, num_splits(8, 32, 1024, 132));
        // Batch 32 overfills a wave: sync aims for SYNC_WAVES waves, async keeps 8 per SM's count.
        p = decode(32, 32, &[1024; 32], None);
        assert_eq!(DecodePlan::new(&p, 132, Some(7)).splits, 8);
        p.scheme = SoftmaxScheme::ASYNC_DEFAULT;
        assert_eq!(DecodePlan::new(&p, 132, Some(6)).splits, 2);
        // A given split count wins.
        p.num_splits = Some(5);
        assert_eq!(DecodePlan::new(&p, 132, Some(6)).splits, 5);
    }

    /// head_dim 256 on CUDA's tensor-core pass (session 13): the same heads per block and chunks
    /// as at d128 (up to 8), and the split count from the occupancy the launcher measures for
    /// that entry (4 blocks per SM at 128 registers), not from `num_splits`' fixed count.
    #[test]
    fn head_dim_256_plans_like_128_with_the_measured_occupancy() {
        let l = PagedKvLayout::new(16, 1 << 14, 8, 256, DType::F16).unwrap();
        for (heads, hg) in [(32usize, 4usize), (64, 8), (40, 5), (128, 8)] {
            for (batch, len) in [(1usize, 32768usize), (4, 32768), (16, 4096)] {
                let p = DecodeParams {
                    geom: AttnGeometry::new(heads, 8, 256).unwrap(),
                    dtype: DType::F16,
                    scheme: SoftmaxScheme::Sync,
                    tables: tables(&l, &vec![len; batch]),
                    num_splits: None,
                };
                let plan = DecodePlan::with_max_heads(&p, 132, Some(4), 8);
                let group = heads / 8;
                assert_eq!((plan.hg, plan.chunks), (hg, group.div_ceil(hg)), "{heads}/8");
                let want = num_splits_resident(batch, 8, len, 132, 4, hg, plan.chunks, false);
                assert_eq!(plan.splits, want, "{heads}/8 batch {batch} kv_len {len}");
                // Never past one wave of 4 blocks per SM.
                assert!(plan.chunks * plan.splits * batch * 8 <= 4 * 132 || plan.splits == 1);
            }
        }
    }

    #[test]
    fn decode_ints_put_lengths_after_the_table() {
        let p = decode(8, 8, &[17, 40], None);
        let (host, at) = decode_ints(&p);
        assert_eq!(at, p.tables.block_table.len());
        assert_eq!(&host[at..], &[17, 40]);
        assert_eq!(&host[..at], p.tables.block_table.as_slice());
    }

    fn budget(l2_bytes: u64, share: f64, waves: f64) -> SectionBudget {
        SectionBudget {
            l2_bytes,
            compute_units: 4,
            share,
            waves,
        }
    }

    #[test]
    fn prefill_sections_fit_the_l2_share_and_keep_their_waves() {
        // 8 heads over 2 KV heads, d64: a KV head's K and V over 1000 keys is
        // 1000 · 64 · 2 · 2 = 256000 bytes.
        let p = prefill(&[1000], &[1000]);
        let s = SectionBudget::SHARE;
        // (blocks, L2 bytes, share, waves, sections, why)
        for (blocks, l2, share, waves, want, why) in [
            // waves 0: the fewest sections that fit.
            (64, 50 << 20, s, 0.0, 1, "both fit 5/8 of 50 MiB"),
            (64, 900_000, s, 0.0, 1, "562500 bytes hold 2"),
            (64, 600_000, s, 0.0, 2, "375000 bytes hold 1"),
            (64, 1000, s, 0.0, 2, "never more than one per KV head"),
            (64, 900_000, 0.5, 0.0, 2, "450000 bytes hold 1"),
            // 1/8 of 3 MB (375000 bytes) holds one KV head: split in two if each half keeps its
            // waves (4 SMs × 1.25 = 5 blocks a section).
            (10, 3_000_000, s, 1.25, 2, "5 blocks each"),
            (9, 3_000_000, s, 1.25, 1, "4.5 blocks each"),
            (1000, 50 << 20, s, 1.25, 1, "1/8 of 50 MiB holds both: nothing to gain"),
        ] {
            assert_eq!(prefill_sections(&p, blocks, &budget(l2, share, waves)), want, "{why}");
        }
        // Every sequence's K/V counts, each up to its end (prefix included).
        let two = prefill(&[1000, 700], &[1000, 100]);
        assert_eq!(
            prefill_sections(&two, 64, &budget(900_000, s, 0.0)),
            2,
            "(1000 + 700) keys: 435200 bytes a KV head"
        );
    }

    /// attn_common.cuh's tile_head(), written out.
    fn tile_head(blocks: usize, heads: usize, groups: usize, nsec: usize, b: usize) -> (usize, usize) {
        let (gs, ntiles) = (heads / groups, blocks / heads);
        let (q, r) = (groups / nsec, groups % nsec);
        let (big, small) = ((q + 1) * gs * ntiles, q * gs * ntiles);
        let sec = if b < r * big {
            b / big
        } else {
            r + (b - r * big) / small
        };
        let rem = b - if sec < r {
            sec * big
        } else {
            r * big + (sec - r) * small
        };
        let h0 = (sec * q + sec.min(r)) * gs;
        let hs = (q + usize::from(sec < r)) * gs;
        (rem / hs, h0 + rem % hs)
    }

    #[test]
    fn the_kernels_block_order_is_sections_of_whole_groups_tiles_first() {
        // (tiles, heads, KV heads, sections)
        for (ntiles, heads, groups, nsec) in [
            (8, 32, 32, 1),
            (32, 32, 32, 3),
            (8, 32, 32, 5),
            (5, 12, 4, 3),
            (1, 7, 7, 7),
            (3, 28, 4, 3),
            (9, 6, 6, 4),
        ] {
            let blocks = ntiles * heads;
            let order = prefill_block_order(ntiles, heads, groups, nsec);
            let got: Vec<(usize, usize)> = (0..blocks).map(|b| tile_head(blocks, heads, groups, nsec, b)).collect();
            let what = format!("{ntiles} tiles x {heads} heads / {groups} KV heads in {nsec} sections");
            // attn_prefill.cu computes its block's (tile, head) with tile_head; the Hopper kernel
            // reads it from the host's list: the same order.
            assert_eq!(got, order, "{what}");
            // Every (tile, head) once.
            let mut seen = order.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), blocks, "{what}");
            // Sections of whole KV groups, sizes differing by at most one, larger first; within
            // one, tile by tile with its heads side by side. (One tile: the heads in order, any
            // split into sections alike.)
            if ntiles == 1 {
                assert!(order.iter().enumerate().all(|(i, &th)| th == (0, i)), "{what}");
                continue;
            }
            let gs = heads / groups;
            let mut at = 0;
            let mut sizes = Vec::new();
            while at < blocks {
                let g0 = order[at].1 / gs;
                let span = order[at..].iter().take_while(|&&(t, _)| t == 0).count();
                assert!(span > 0 && span % gs == 0, "{what}: a section of whole groups");
                for (i, &(t, h)) in order[at..at + span * ntiles].iter().enumerate() {
                    assert_eq!((t, h), (i / span, g0 * gs + i % span), "{what}: block {}", at + i);
                }
                sizes.push(span / gs);
                at += span * ntiles;
            }
            assert_eq!(sizes.len(), nsec, "{what}");
            assert!(
                sizes.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1),
                "{what}: {sizes:?}"
            );
        }
    }

    #[test]
    fn prefill_tiles_cover_every_new_row_once_longest_first() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(rand::random());
        for _ in 0..50 {
            let b = rng.gen_range(1..5);
            let lens: Vec<usize> = (0..b).map(|_| rng.gen_range(1..700)).collect();
            let new: Vec<i32> = lens.iter().map(|&l| rng.gen_range(1..=l) as i32).collect();
            let p = prefill(&lens, &new);
            let bm = [64usize, 128][rng.gen_range(0..2)];
            let tiles = prefill_tiles(&p, bm).unwrap();
            let mut covered = vec![0u8; p.tokens()];
            for t in &tiles {
                let [seq, row0, pos0, rows] = t.map(|v| v as usize);
                assert!(rows >= 1 && rows <= bm);
                let (srow, prefix, n) = p.spans()[seq];
                assert!(row0 >= srow && row0 + rows <= srow + n);
                assert_eq!(pos0, prefix + (row0 - srow), "position follows the row");
                for c in &mut covered[row0..row0 + rows] {
                    *c += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1));
            assert!(tiles.windows(2).all(|w| w[0][2] + w[0][3] >= w[1][2] + w[1][3]));
        }
        assert!(prefill_tiles(&prefill(&[5], &[5]), 0).is_err());
    }

    #[test]
    fn prefill_blocks_carry_the_first_tiles_slot_only_where_it_is_one_box() {
        // Three sequences over pages of 16: 300 keys on pages 7.. (consecutive), 200 on
        // scattered pages, 60 (no whole key tile). Pages picked by hand.
        let l = PagedKvLayout::new(16, 4096, 2, 128, DType::F16).unwrap();
        let pages_a: Vec<u32> = (7..7 + 19).collect();
        let pages_b: Vec<u32> = vec![100, 101, 102, 50, 104, 105, 106, 107, 108, 109, 110, 111, 112];
        let pages_c: Vec<u32> = vec![200, 201, 202, 203];
        let ts = [(pages_a, 300), (pages_b, 200), (pages_c, 60)]
            .into_iter()
            .map(|(pages, seq_len)| BlockTable { pages, seq_len })
            .collect::<Vec<_>>();
        let p = PrefillParams {
            geom: AttnGeometry::new(4, 2, 128).unwrap(),
            dtype: DType::F16,
            scheme: SoftmaxScheme::Sync,
            tables: FlatBlockTables::new(&l, &ts).unwrap(),
            new_lens: vec![300, 200, 60],
        };
        let tiles = prefill_tiles(&p, 128).unwrap();
        let boxes = |tma_rows, runs| TileBoxes {
            page_size: 16,
            tma_rows,
            runs,
        };
        let runs = prefill_blocks(&p, &tiles, 2, boxes(16, true), 128).unwrap();
        assert_eq!(runs.len(), tiles.len() * 4);
        let order = prefill_block_order(tiles.len(), 4, 2, 2);
        for (e, &(t, h)) in runs.iter().zip(&order) {
            assert_eq!(&e[..4], &tiles[t]);
            assert_eq!(e[4], h as i32);
            let (seq, keys) = (tiles[t][0], tiles[t][2] + tiles[t][3]);
            let want = match seq {
                // Tile 0's pages 7..15 follow one another: one box from slot 7·16.
                0 if keys >= 128 => 7 * 16,
                // Page 3 of the second sequence is 50: not a run.
                _ => -1,
            };
            assert_eq!(e[5], want, "block of tile {t} (sequence {seq}, {keys} keys), head {h}");
            assert_eq!(&e[6..], &[h as i32 / 2, 0], "KV head of head {h} (4 heads over 2)");
        }
        // Without the run maps, pages of 16 never box a whole tile; without TMA, nothing does.
        for b in [boxes(16, false), boxes(0, true)] {
            let none = prefill_blocks(&p, &tiles, 2, b, 128).unwrap();
            assert!(none.iter().all(|e| e[5] == -1), "{b:?}");
        }
        // Pages that hold a whole tile box it from their first slot, scattered or not.
        let l = PagedKvLayout::new(128, 64, 2, 128, DType::F16).unwrap();
        let ts = vec![
            BlockTable {
                pages: vec![9, 4, 5],
                seq_len: 300,
            },
            BlockTable {
                pages: vec![1],
                seq_len: 100,
            },
        ];
        let p = PrefillParams {
            tables: FlatBlockTables::new(&l, &ts).unwrap(),
            new_lens: vec![300, 100],
            ..p
        };
        let tiles = prefill_tiles(&p, 128).unwrap();
        let whole = TileBoxes {
            page_size: 128,
            tma_rows: 128,
            runs: false,
        };
        for e in prefill_blocks(&p, &tiles, 1, whole, 128).unwrap() {
            let keys = e[2] + e[3];
            let want = if e[0] == 0 && keys >= 128 { 9 * 128 } else { -1 };
            assert_eq!(e[5], want, "{e:?}");
        }
    }

    #[test]
    fn prefill_ints_align_the_tiles_to_16_bytes() {
        let p = prefill(&[33, 5, 70], &[33, 2, 70]);
        let tiles = prefill_tiles(&p, 64).unwrap();
        let (host, at) = prefill_ints(&p, &tiles);
        assert!(at.is_multiple_of(4) && at >= p.tables.block_table.len());
        assert_eq!(&host[..p.tables.block_table.len()], p.tables.block_table.as_slice());
        assert!(host[p.tables.block_table.len()..at].iter().all(|&v| v == -1));
        assert_eq!(host.len(), at + 4 * tiles.len());
        assert_eq!(&host[at..at + 4], &tiles[0]);
    }
}
