//! Attention over a paged KV cache: split-KV decode (Flash-Decoding) and causal prefill, each with
//! two softmax schemes (FlashDecoding++ §3).
//!
//! Scores are x = q·k / √d. The `sync` scheme keeps a running maximum and rescales the partial
//! sums whenever it grows (the FlashDecoding baseline; the splits are then merged by a combine
//! step that rescales once more). The `async` scheme uses one unified φ for every split of every
//! row: each split accumulates Σ e^(x−φ)·v and Σ e^(x−φ) in fp32 with no maximum and no
//! rescale, so the splits need no synchronisation and the combine is a plain sum. That is exact
//! as long as no term overflows and the terms do not all vanish: a row (sequence, query head) is
//! *flagged* when any of its scores has x − φ > b (an overflow risk), when its largest score has
//! x − φ < a (every term underflows towards 0 and the ratio loses its precision), or when its
//! sums are not finite. Flagged rows are recomputed with the sync scheme; [`AttnStats`] counts
//! them.
//!
//! Buffer layouts (row-major, 16-bit elements of the cache's dtype):
//! - decode: q and out `[batch][num_heads][head_dim]`, one query token per sequence;
//! - prefill: q and out `[tokens][num_heads][head_dim]`, k and v `[tokens][num_kv_heads][head_dim]`,
//!   the new tokens of sequence 0 first, then those of sequence 1, …;
//! - the K and V pools as in [`crate::kv::paged`].
//!
//! Query head h reads kv head h / (num_heads / num_kv_heads) (GQA; MHA is a group of one).

use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::paged::{FlatBlockTables, PagedKvLayout};

/// head_dim values the attention kernels are written for.
pub const SUPPORTED_HEAD_DIMS: [usize; 3] = [64, 128, 256];
// Every GQA ratio num_heads / num_kv_heads runs (MHA, 2, 3, 5, 6, 7, 12, 14, …): prefill and the
// score histograms give each query head its own block, decode serves a group in chunks of up to
// four heads per block with the last chunk partial (src/backend/attn_plan.rs).
/// ln(f32::MAX) ≈ 88.72: e^t is finite in fp32 only for t below this.
pub const LN_F32_MAX: f32 = 88.0;

/// The head counts and size of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnGeometry {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnGeometry {
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Result<Self> {
        let g = AttnGeometry {
            num_heads,
            num_kv_heads,
            head_dim,
        };
        g.validate()?;
        Ok(g)
    }

    /// e.g. `h32/kv8 d128`.
    pub fn label(&self) -> String {
        format!("h{}/kv{} d{}", self.num_heads, self.num_kv_heads, self.head_dim)
    }

    /// Refuses a head_dim outside the supported set (naming it), zero heads, and a num_heads that
    /// is not a multiple of num_kv_heads. Any whole GQA ratio is supported.
    pub fn validate(&self) -> Result<()> {
        let spec = format!("attention {}", self.label());
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return Err(FdppError::Unsupported {
                spec,
                what: format!("head_dim {}; supported: {:?}", self.head_dim, SUPPORTED_HEAD_DIMS),
            });
        }
        if self.num_heads == 0 || self.num_kv_heads == 0 {
            return Err(FdppError::InvalidArgument(format!(
                "{spec}: num_heads and num_kv_heads must be at least 1"
            )));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(FdppError::InvalidArgument(format!(
                "{spec}: num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            )));
        }
        Ok(())
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads.max(1)
    }

    /// The softmax scale 1/√d.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The geometry must match the cache it reads.
    pub fn check_layout(&self, layout: &PagedKvLayout, dtype: DType) -> Result<()> {
        layout.validate()?;
        if layout.num_kv_heads != self.num_kv_heads || layout.head_dim != self.head_dim || layout.dtype != dtype {
            return Err(FdppError::Shape {
                what: format!("KV cache of attention {}", self.label()),
                expected: format!("kv_heads={} d={} {dtype}", self.num_kv_heads, self.head_dim),
                found: layout.label(),
            });
        }
        Ok(())
    }
}

/// How the softmax is accumulated (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SoftmaxScheme {
    /// Running maximum with rescale (FlashDecoding baseline).
    Sync,
    /// Unified max φ with no rescale; rows leaving [a, b] are recomputed with `Sync`.
    Async { phi: f32, a: f32, b: f32 },
}

impl SoftmaxScheme {
    /// The async scheme used when a profile has calibrated none: φ = 0 and a wide [−60, 20]
    /// window (e^20 · 2^20 tokens stays far from fp32's max; e^−60 is far above its smallest
    /// normal). FlashDecoding++ §3 reports Llama2-7B scores inside [−16.8, 6.5].
    pub const ASYNC_DEFAULT: SoftmaxScheme = SoftmaxScheme::Async {
        phi: 0.0,
        a: -60.0,
        b: 20.0,
    };

    pub fn name(&self) -> &'static str {
        match self {
            SoftmaxScheme::Sync => "sync",
            SoftmaxScheme::Async { .. } => "async",
        }
    }

    /// `sync`, or `async(phi=0,a=-60,b=20)`.
    pub fn label(&self) -> String {
        match self {
            SoftmaxScheme::Sync => "sync".into(),
            SoftmaxScheme::Async { phi, a, b } => format!("async(phi={phi},a={a},b={b})"),
        }
    }

    /// φ, a and b finite, a < b, and every term e^(x−φ) with x − φ in [a, b] representable in
    /// fp32 together with the ratio of the largest to the smallest, e^(b−a): otherwise a row
    /// inside the window could still overflow or lose its smallest terms, and the scheme would
    /// be wrong without ever flagging a recompute.
    pub fn validate(&self) -> Result<()> {
        let SoftmaxScheme::Async { phi, a, b } = *self else {
            return Ok(());
        };
        let bad = |why: String| Err(FdppError::InvalidArgument(format!("softmax {}: {why}", self.label())));
        if !(phi.is_finite() && a.is_finite() && b.is_finite()) {
            return bad("phi, a and b must be finite".into());
        }
        if a >= b {
            return bad("a must be below b (the window [a, b] of x − phi that needs no recompute)".into());
        }
        if b - a >= LN_F32_MAX {
            return bad(format!(
                "e^(b−a) = e^{} overflows fp32 (e^{LN_F32_MAX} is about its maximum, 3.4e38); narrow [a, b]",
                b - a
            ));
        }
        if b >= LN_F32_MAX || a <= -LN_F32_MAX {
            return bad(format!(
                "e^b or e^a leaves the fp32 range (|a| and |b| must stay below {LN_F32_MAX}); narrow [a, b]"
            ));
        }
        Ok(())
    }
}

/// What an attention call did besides its output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AttnStats {
    /// (sequence or query token, head) rows computed.
    pub rows: usize,
    /// Rows the async scheme flagged and recomputed with the sync scheme (0 under `Sync`).
    pub recomputed: usize,
    /// Decode: the split count the call used (0 for prefill, and for sums over calls).
    pub splits: usize,
}

/// Minimum keys per split: a split shorter than this spends more on its combine entry and its
/// launch share than it saves (64 keys of d128 K and V are 32 KiB per kv head; the partial a
/// split writes is 0.5 KiB per query head).
pub const MIN_SPLIT_TOKENS: usize = 64;
/// Blocks per SM the split count aims for: a decode block is latency-bound (each token group
/// has a few 16-byte loads in flight), so it takes several resident blocks per SM, and several
/// waves of them, to keep enough bytes in flight for the copy bandwidth (measured on the H100:
/// 2 blocks per SM reached 0.74 TB/s at batch 1, kv_len 1024; see reports/NOTES.md).
pub const BLOCKS_PER_SM: usize = 8;
/// Blocks per SM when the batch has fewer (sequence, kv head) items than SMs: each row is split
/// many ways, and every split pays its partial's combine (or atomics) and its block's fixed
/// latency. Measured on the H100 (fp16, 32 heads, d128, batch 1, `bench attention --splits`):
/// async 36.7 → 32.6 µs at kv_len 4096 and 111 → 99 µs at 16384 going from 33 splits (8 per SM)
/// to 16-17 (4 per SM); at 1024 both give 16. Larger batches keep [`BLOCKS_PER_SM`]: there the
/// count of waves decides (blocks ≈ one wave of resident slots left a 10 % tail).
pub const SMALL_BATCH_BLOCKS_PER_SM: usize = 4;
/// Most splits of one row (the combine step reads all of them; kernels_cuda/attn_decode.cu
/// COMBINE_MAX_SPLITS). 64 until session 18, which is still the most a row takes unless its
/// splits stay [`LONG_SPLIT_TOKENS`] long.
pub const MAX_SPLITS: usize = 256;
/// Most splits of a row whose splits would be shorter than [`LONG_SPLIT_TOKENS`].
pub const SHORT_MAX_SPLITS: usize = 64;
/// Keys per split below which a row takes no more than [`SHORT_MAX_SPLITS`] splits. Measured on
/// the H100 at batch 1, d128, `bench attention --splits 64|132|256` (reports/NOTES.md, session 18):
/// GQA 32/2 at 131072 keys ran 12 % (async) and 6 % (sync) faster with 132 splits (993 keys each)
/// than with 64; 32/4 there +1.3 % async, −2 % sync; at 32768 (248 keys each) 132 splits were level
/// (async) or 6-10 % slower (sync), at 8192 (62 keys) 20-40 % slower.
pub const LONG_SPLIT_TOKENS: usize = 512;

/// The most splits a row of `kv_len` keys takes: [`SHORT_MAX_SPLITS`], more only while each split
/// keeps [`LONG_SPLIT_TOKENS`] keys, never past [`MAX_SPLITS`].
pub fn max_splits_for(kv_len: usize) -> usize {
    (kv_len / LONG_SPLIT_TOKENS).clamp(SHORT_MAX_SPLITS, MAX_SPLITS)
}

/// Waves of resident blocks the sync scheme aims for once the batch alone overfills one wave:
/// shorter splits make the last, partial wave a smaller share. Measured on the H100 (fp16,
/// 32 heads, d128, page 16, `bench attention --splits`, session 8): batch 32 at 1024-4096 keys,
/// sync 196-765 µs at 2 splits (2.2 waves), 185-717 µs at 8 (8.9 waves). The async scheme stays at
/// [`BLOCKS_PER_SM`]: each split adds its atomics and arrival round trip, and it measured flat
/// from 2 to 8 splits there (202-213, 729-739 µs).
pub const SYNC_WAVES: usize = 8;

/// Most waves of resident blocks the rule for several query heads per block looks at.
pub const GROUP_MAX_WAVES: usize = 4;

/// Split count for decode given the kernel's resident blocks per SM (its occupancy, from the
/// driver) and the query heads each block serves (`heads_per_block`). Measured on the H100,
/// fp16, d128, page 16, `bench attention --splits 1..8` (reports/NOTES.md, session 8).
///
/// One head per block (MHA; 6-7 resident blocks per SM): with fewer (sequence, kv head) items
/// than SMs, as many splits as fill one wave of resident blocks (within the split-length
/// bounds). [`num_splits`]' 4 per SM left a third of the kernels' slots empty (6 per SM async,
/// 7 sync). On the H200 (sessions 40-41, 32 heads, d128, µs at num_splits' count / one wave):
/// async 1 · 4096 27.6 / 25.3 (24 splits), 1 · 16384 82.6 / 70.3, 2 · 4096 45.3 / 40.3 (12),
/// 4 · 16384 255.6 / 248.6 (6); sync 1 · 4096 27.8 / 25.0 (28), 1 · 16384 83.0 / 70.5, 2 · 4096
/// 44.9 / 39.9 (14), 4 · 16384 255.3 / 246.9 (7). A wave and a third (32 splits) ran 84.8 async
/// at 1 · 16384, as the H100's 33 did against 17 in session 8; one wave was not measured on the
/// H100. Where the length cannot give a whole wave splits of 64+ keys (batch 1 below 1280 keys
/// async on the latency path's 5 blocks per SM, 1536 on the bandwidth path's 6, 1792 sync at
/// 7), the count stays [`num_splits`]', so Llama2-7B's decode at 1024 tokens is unchanged.
/// Otherwise, if the items fit one wave of resident blocks, as
/// many splits as keep them in one wave: [`num_splits`]'s 8 per SM (1056 blocks) gave 1.2-1.9
/// waves at batch 8-16 of 32 kv heads and measured 4-13 % slower (async at 8 · 1024 61.1 → 53.9
/// µs with 3 splits, 16 · 1024 106.5 → 95.7 with 1; sync 58.0 → 53.1, 98.7 → 96.6). Past one
/// wave, [`SYNC_WAVES`] waves for sync and [`num_splits`]'s count for async.
///
/// Several heads per block (GQA; 4 heads: 3 resident blocks per SM): with at least half as many
/// items as SMs, the split count whose last wave is fullest within [`GROUP_MAX_WAVES`] waves
/// (the fewest splits on a tie). At 32 heads / 8 kv heads that is 3 splits at batch 16, 32 and
/// 64 (0.97, 1.94 and 3.88 waves), the fastest of 1-8 for both schemes at each (batch 16 · 4096:
/// 139-143 µs at [`num_splits`]'s 5, 121-123 at 3); the one-wave rule above gave 1 split at
/// batch 32, 2 blocks per SM, and measured 11-14 % slower. Smaller batches (fewer blocks per
/// split than half the SMs, counting each kv head's `chunks` of heads) keep [`num_splits`],
/// capped at one wave of resident blocks.
#[allow(clippy::too_many_arguments)]
pub fn num_splits_resident(
    batch: usize,
    kv_heads: usize,
    kv_len: usize,
    sm_count: usize,
    resident_per_sm: usize,
    heads_per_block: usize,
    chunks: usize,
    async_scheme: bool,
) -> usize {
    let items = (batch * kv_heads).max(1);
    let sms = sm_count.max(1);
    let slots = resident_per_sm.max(1) * sms;
    let max = (kv_len / MIN_SPLIT_TOKENS).clamp(1, max_splits_for(kv_len));
    if heads_per_block > 1 {
        // Blocks per split: one per (sequence, kv head, head chunk).
        let units = items * chunks.max(1);
        if 2 * units < sms {
            // Never past one wave of resident blocks: the splits are of equal length, so a
            // second wave of a few blocks costs about as long as the first. num_splits aims at
            // 4 per SM whatever the occupancy: GQA 32/8 at batch 4 took 17 splits, 544 blocks
            // of a kernel with 528 slots (4 per SM on 132 SMs), and 32/4 at batch 16 took 9
            // (576); both ran at 0.82-0.86x SDPA (reports/NOTES.md, session 12).
            let one_wave = (slots / units).max(1);
            return num_splits(batch, kv_heads, kv_len, sm_count).min(one_wave);
        }
        let items = units;
        // Emptiness of the last wave in units of blocks·slots (exact integer arithmetic).
        let empty = |s: usize| (items * s).div_ceil(slots) * slots - items * s;
        return (1..=max)
            .filter(|&s| items * s <= GROUP_MAX_WAVES * slots)
            .min_by_key(|&s| (empty(s), s))
            .unwrap_or(1);
    }
    if items < sms {
        // One wave once the length allows splits of 64+ keys for all of it; below that
        // num_splits, whose count is already the length's bound there. (Taking the bound, a
        // count that moves every 64 keys, would make the decode graph's launches new at every
        // 64th step from 1088 to 1792 keys at batch 1; each new one runs eagerly, then is
        // captured.)
        let one_wave = (slots / items).clamp(1, MAX_SPLITS);
        return if max >= one_wave {
            one_wave
        } else {
            num_splits(batch, kv_heads, kv_len, sm_count)
        };
    }
    let want = if items <= slots {
        slots / items
    } else if async_scheme {
        (BLOCKS_PER_SM * sms).div_ceil(items)
    } else {
        (SYNC_WAVES * slots).div_ceil(items)
    };
    want.min(max).clamp(1, MAX_SPLITS)
}

/// Blocks per SM from which a wave of one-head async decode blocks streams at the card's rate:
/// a last wave with fewer takes about as long as one with this many. Measured on the H100 (fp16,
/// 32 heads, d128, `bench attention --splits 1`, reports/NOTES.md, session 28): 1024 keys, the
/// 6-per-SM kernel 1.13 waves (0.8 blocks per SM left for the second) 2.27 TB/s, 1.29 (1.8)
/// 2.59, 1.45 (2.7) 2.84, 1.62 (3.7) 2.96, one full wave 2.99.
pub const TAIL_SATURATING_BLOCKS: f64 = 3.0;
/// The pipelined async loop's streaming rate over the plain loop's in full waves (the same
/// calls: 2.97-3.00 TB/s against 3.03-3.05 at batch 64 of 1024-16384 keys).
pub const PIPELINED_RATE: f64 = 1.015;
/// What a wave costs beyond its keys (its blocks' start and end), in keys of one block slot: a
/// split of 1024 keys into two ran 8-10 % slower on the H100 in both kernels (session 28, batch
/// 28-64, one split against two); 200 keys a wave separates the measured choices best.
pub const WAVE_OVERHEAD_KEYS: f64 = 200.0;
/// Longest split for which a batch within one wave of the plain loop takes the pipelined kernel
/// at two splits, where two of its waves' worth fit one wave: measured on the H100 (session 28,
/// three rounds, 200 warm-ups), 2 splits of 512 keys ran 2.61 TB/s at batch 8 against the plain
/// loop's 3 splits at 2.46-2.48 and 2.47-2.50 at batch 7 against 2.36-2.37; splits of 1024 keys
/// were level at batch 8 (2.81 against 2.80) and 1.5 % slower at batch 7, 8192 keys 1 % slower;
/// at batch 5 three pipelined splits of 342 or 683 keys ran 2 % slower than four plain ones.
/// Shorter splits were not measured: the candidate takes splits of more than three quarters of
/// this (contexts of 769-1024 keys).
pub const PIPE_SHORT_SPLIT_KEYS: usize = 512;
/// Shortest split, and most splits, that a launch past one wave of the plain loop also weighs
/// for either kernel: more, shorter blocks fill the last wave better where the blocks stay long
/// (36 · 8192: one split 2.88 TB/s, two 3.01; 56 · 8192: 2.89, pipelined with two 3.01).
pub const MHA_LONG_SPLIT_KEYS: usize = 2048;
/// See [`MHA_LONG_SPLIT_KEYS`].
pub const MHA_MAX_WAVE_SPLITS: usize = 6;

/// Time of a one-head decode launch in keys of one block slot, up to a constant: every full
/// wave of `resident_per_sm · sm_count` blocks costs `resident_per_sm` blocks' keys per SM, a last
/// partial wave its blocks per SM but at least [`TAIL_SATURATING_BLOCKS`] (fewer stream slower),
/// divided by the kernel's relative `rate`, and each wave [`WAVE_OVERHEAD_KEYS`] more.
pub fn wave_cost(
    items: usize,
    splits: usize,
    kv_len: usize,
    sm_count: usize,
    resident_per_sm: usize,
    rate: f64,
) -> f64 {
    let sms = sm_count.max(1);
    let r = resident_per_sm.max(1);
    let blocks = items.max(1) * splits.max(1);
    let (full, tail) = (blocks / (r * sms), blocks % (r * sms));
    let (waves, tail) = if tail == 0 {
        (full, 0.0)
    } else {
        (full + 1, (tail as f64 / sms as f64).max(TAIL_SATURATING_BLOCKS))
    };
    kv_len.div_ceil(splits.max(1)) as f64 * (full as f64 * r as f64 + tail) / rate + waves as f64 * WAVE_OVERHEAD_KEYS
}

/// The kernel and split count of an async one-head decode launch (MHA): the plain loop with
/// `loop_splits` ([`num_splits_resident`] of its `loop_resident` blocks per SM), or the pipelined
/// loop (`pipe_resident`), whichever [`wave_cost`] finds cheaper among
/// - the plain loop's plan (kept on a tie);
/// - once the (sequence, head) items reach the SM count, the pipelined loop with one split:
///   where the plain loop needs two splits to fill its waves, one split of the pipelined kernel
///   (fewer slots) often fills them instead (session 28, 32 heads, d128, TB/s: 28 · 1024 2.54 →
///   2.93, 32 · 1024 2.72 → 3.00, 64 · 4096 2.97 → 3.05; at 24 · 1024, 0.97 waves of the plain
///   loop, it stays: the pipelined kernel ran 2.68 against 2.99);
/// - within one wave of the plain loop, the pipelined loop with two splits where two (not three)
///   fit its own wave and they are at most [`PIPE_SHORT_SPLIT_KEYS`] long (and more than three
///   quarters of it);
/// - past one wave of the plain loop, either kernel at 2..=[`MHA_MAX_WAVE_SPLITS`] splits of at
///   least [`MHA_LONG_SPLIT_KEYS`] keys.
///
/// Returns (pipelined, splits).
pub fn plan_mha_async(
    items: usize,
    kv_len: usize,
    sm_count: usize,
    loop_resident: usize,
    loop_splits: usize,
    pipe_resident: usize,
) -> (bool, usize) {
    let sms = sm_count.max(1);
    let loop_slots = loop_resident.max(1) * sms;
    let cost = |pipe: bool, s: usize| {
        let (r, rate) = if pipe {
            (pipe_resident, PIPELINED_RATE)
        } else {
            (loop_resident, 1.0)
        };
        wave_cost(items, s, kv_len, sms, r, rate)
    };
    let mut best = (false, loop_splits.max(1));
    let mut best_cost = cost(best.0, best.1);
    let mut consider = |pipe: bool, s: usize| {
        let c = cost(pipe, s);
        if c < best_cost {
            (best, best_cost) = ((pipe, s), c);
        }
    };
    if items >= sms {
        consider(true, 1);
        let half = kv_len.div_ceil(2);
        let short = 4 * half > 3 * PIPE_SHORT_SPLIT_KEYS && half <= PIPE_SHORT_SPLIT_KEYS;
        if items <= loop_slots && pipe_resident.max(1) * sms / items == 2 && short {
            consider(true, 2);
        }
        if items > loop_slots {
            for s in (2..=MHA_MAX_WAVE_SPLITS).filter(|&s| kv_len / s >= MHA_LONG_SPLIT_KEYS) {
                consider(false, s);
                consider(true, s);
            }
        }
    }
    best
}

/// Split-KV count for decode (Flash-Decoding): enough (batch · kv_heads · splits) work items for
/// [`BLOCKS_PER_SM`] per SM ([`SMALL_BATCH_BLOCKS_PER_SM`] when there are fewer items than SMs;
/// one item is one thread block serving a whole GQA head group), with every split at least
/// [`MIN_SPLIT_TOKENS`] keys long and at most [`max_splits_for`] the length. Large batches get one split
/// (the batch alone fills the device).
pub fn num_splits(batch: usize, kv_heads: usize, kv_len: usize, sm_count: usize) -> usize {
    let items = (batch * kv_heads).max(1);
    let sms = sm_count.max(1);
    let per_sm = if items < sms {
        SMALL_BATCH_BLOCKS_PER_SM
    } else {
        BLOCKS_PER_SM
    };
    let target = per_sm * sms;
    let want = target.div_ceil(items);
    let by_len = (kv_len / MIN_SPLIT_TOKENS).max(1);
    want.min(by_len).clamp(1, max_splits_for(kv_len))
}

/// One decode step: one new query token per sequence over its cached keys (the token's own K and
/// V must already be in the cache).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeParams {
    pub geom: AttnGeometry,
    pub dtype: DType,
    pub scheme: SoftmaxScheme,
    pub tables: FlatBlockTables,
    /// Split-KV count; None: [`num_splits`] from the batch, the longest sequence and the device.
    pub num_splits: Option<usize>,
}

impl DecodeParams {
    pub fn batch(&self) -> usize {
        self.tables.batch()
    }

    /// Every check a backend runs before launching: geometry, scheme, cache shape, block tables,
    /// buffer lengths (q, out at least batch · heads · head_dim; pools at least the layout's).
    pub fn validate(
        &self,
        layout: &PagedKvLayout,
        q_len: usize,
        out_len: usize,
        pool_lens: (usize, usize),
    ) -> Result<()> {
        self.geom.validate()?;
        self.scheme.validate()?;
        self.geom.check_layout(layout, self.dtype)?;
        self.tables.validate(layout)?;
        if let Some(n) = self.num_splits {
            if !(1..=MAX_SPLITS).contains(&n) {
                return Err(FdppError::InvalidArgument(format!(
                    "decode: num_splits {n} is outside 1..={MAX_SPLITS} (leave it out to choose it from the shape)"
                )));
            }
        }
        let need = self.batch() * self.geom.num_heads * self.geom.head_dim;
        check_len("decode q", need, q_len)?;
        check_len("decode out", need, out_len)?;
        check_len("K pool", layout.pool_elems(), pool_lens.0)?;
        check_len("V pool", layout.pool_elems(), pool_lens.1)?;
        Ok(())
    }

    /// Multiply-adds of QKᵀ and PV, 2 FLOPs each: 4 · H · D · Σ kv_len.
    pub fn flops(&self) -> f64 {
        let keys: f64 = self.tables.seq_lens.iter().map(|&l| l.max(0) as f64).sum();
        4.0 * self.geom.num_heads as f64 * self.geom.head_dim as f64 * keys
    }

    /// Least bytes moved: every cached K and V element read once (once per kv head, not per
    /// query head: a block serves the whole group), q read and out written.
    pub fn min_bytes(&self) -> f64 {
        let keys: f64 = self.tables.seq_lens.iter().map(|&l| l.max(0) as f64).sum();
        let g = &self.geom;
        let kv = 2.0 * keys * (g.num_kv_heads * g.head_dim) as f64;
        let qo = 2.0 * (self.batch() * g.num_heads * g.head_dim) as f64;
        (kv + qo) * self.dtype.size_bytes() as f64
    }
}

/// A prefill (or chunked-prefill) step: `new_lens[b]` new tokens of sequence b, at positions
/// `seq_lens[b] − new_lens[b] ..  seq_lens[b]` (the tables already hold pages for them). Their
/// K and V are written into the pools, then every new token attends causally to every cached
/// token before it and to itself.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillParams {
    pub geom: AttnGeometry,
    pub dtype: DType,
    pub scheme: SoftmaxScheme,
    /// The tables after this step: seq_lens count the new tokens.
    pub tables: FlatBlockTables,
    pub new_lens: Vec<i32>,
}

impl PrefillParams {
    pub fn batch(&self) -> usize {
        self.tables.batch()
    }

    /// New tokens in all (the rows of q, k, v and out).
    pub fn tokens(&self) -> usize {
        self.new_lens.iter().map(|&n| n.max(0) as usize).sum()
    }

    /// (first row in q/k/v/out, prefix length, new tokens) of each sequence.
    pub fn spans(&self) -> Vec<(usize, usize, usize)> {
        let mut row = 0;
        (0..self.batch())
            .map(|b| {
                let n = self.new_lens[b].max(0) as usize;
                // Saturating: counts may be asked of params not yet validated.
                let prefix = self.tables.seq_len(b).saturating_sub(n);
                let s = (row, prefix, n);
                row += n;
                s
            })
            .collect()
    }

    /// [`Self::validate`] for a call without k and v buffers (the new tokens' k and v already
    /// in the cache): their required lengths stand in for them.
    pub fn validate_cached(
        &self,
        layout: &PagedKvLayout,
        q_out: (usize, usize),
        pool_lens: (usize, usize),
    ) -> Result<()> {
        let kvn = self.tokens() * self.geom.num_kv_heads * self.geom.head_dim;
        self.validate(layout, q_out, (kvn, kvn), pool_lens)
    }

    /// As [`DecodeParams::validate`], plus: one new_len per sequence, each in 1..=seq_len; lens
    /// are (q/out, k/v new) lengths.
    pub fn validate(
        &self,
        layout: &PagedKvLayout,
        q_out: (usize, usize),
        kv_new: (usize, usize),
        pool_lens: (usize, usize),
    ) -> Result<()> {
        self.geom.validate()?;
        self.scheme.validate()?;
        self.geom.check_layout(layout, self.dtype)?;
        self.tables.validate(layout)?;
        if self.new_lens.len() != self.batch() {
            return Err(FdppError::Shape {
                what: "prefill new_lens".into(),
                expected: format!("one per sequence ({})", self.batch()),
                found: self.new_lens.len().to_string(),
            });
        }
        for (b, &n) in self.new_lens.iter().enumerate() {
            if n < 1 || n as usize > self.tables.seq_len(b) {
                return Err(FdppError::InvalidArgument(format!(
                    "prefill sequence {b}: {n} new tokens, must be 1..={} (its kv_len after the step)",
                    self.tables.seq_len(b)
                )));
            }
        }
        let g = &self.geom;
        let t = self.tokens();
        check_len("prefill q", t * g.num_heads * g.head_dim, q_out.0)?;
        check_len("prefill out", t * g.num_heads * g.head_dim, q_out.1)?;
        check_len("prefill k", t * g.num_kv_heads * g.head_dim, kv_new.0)?;
        check_len("prefill v", t * g.num_kv_heads * g.head_dim, kv_new.1)?;
        check_len("K pool", layout.pool_elems(), pool_lens.0)?;
        check_len("V pool", layout.pool_elems(), pool_lens.1)?;
        Ok(())
    }

    /// 4 · H · D per (query, key) pair, counting the causal square as half (n²/2 pairs, as the
    /// usual 2·B·H·L²·D for a prefill from empty) plus prefix · n pairs over the cached prefix.
    pub fn flops(&self) -> f64 {
        let g = &self.geom;
        let pairs: f64 = self
            .spans()
            .iter()
            .map(|&(_, prefix, n)| prefix as f64 * n as f64 + (n * n) as f64 / 2.0)
            .sum();
        4.0 * (g.num_heads * g.head_dim) as f64 * pairs
    }

    /// Least bytes moved: q, k, v read; out written; new k, v written to the pools; the cached
    /// prefix's K and V read once.
    pub fn min_bytes(&self) -> f64 {
        let g = &self.geom;
        let t = self.tokens() as f64;
        let prefix: f64 = self.spans().iter().map(|&(_, p, _)| p as f64).sum();
        let kvd = (g.num_kv_heads * g.head_dim) as f64;
        let qo = 2.0 * t * (g.num_heads * g.head_dim) as f64;
        (qo + 4.0 * t * kvd + 2.0 * prefix * kvd) * self.dtype.size_bytes() as f64
    }
}

fn check_len(what: &str, need: usize, found: usize) -> Result<()> {
    if found < need {
        return Err(FdppError::Shape {
            what: what.into(),
            expected: format!("at least {need} elements"),
            found: found.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_head_dim_is_refused_and_every_whole_ratio_accepted() {
        let e = AttnGeometry::new(8, 8, 96).expect_err("96");
        assert!(e.to_string().contains("head_dim 96; supported: [64, 128, 256]"), "{e}");
        // SmolLM2-135M 9/3, Llama-3.2-3B 24/8, SmolLM2-360M 15/5, Qwen2-1.5B 12/2, Qwen2.5-7B
        // 28/4, and 12, 14, 32.
        for (h, kv, ratio) in [
            (9, 3, 3),
            (24, 8, 3),
            (15, 3, 5),
            (12, 2, 6),
            (28, 4, 7),
            (24, 2, 12),
            (14, 1, 14),
            (32, 1, 32),
        ] {
            assert_eq!(AttnGeometry::new(h, kv, 64).expect("whole ratio").group(), ratio);
        }
        let e = AttnGeometry::new(10, 4, 64).expect_err("10/4");
        assert!(e.to_string().contains("not a multiple of num_kv_heads 4"), "{e}");
        assert!(AttnGeometry::new(0, 1, 64).is_err());
        assert_eq!(AttnGeometry::new(32, 8, 128).expect("ok").group(), 4);
    }

    #[test]
    fn scheme_windows_that_overflow_fp32_are_refused_with_the_reason() {
        let s = |phi, a, b| SoftmaxScheme::Async { phi, a, b }.validate();
        s(0.0, -60.0, 20.0).expect("default window");
        SoftmaxScheme::ASYNC_DEFAULT.validate().expect("default");
        let e = s(0.0, -70.0, 20.0).expect_err("b-a = 90");
        assert!(e.to_string().contains("e^(b−a) = e^90 overflows fp32"), "{e}");
        let e = s(0.0, 3.0, 2.0).expect_err("a > b");
        assert!(e.to_string().contains("a must be below b"), "{e}");
        assert!(s(f32::NAN, -1.0, 1.0).is_err());
        assert!(s(0.0, 50.0, 100.0).is_err(), "e^100 alone overflows");
    }

    #[test]
    fn splits_fill_the_device_and_respect_the_minimum_length() {
        // 1 sequence, 32 kv heads (fewer items than SMs), 132 SMs: 528 / 32 = 17 splits wanted,
        // 16384 / 64 allowed; at 1024 tokens the 64-token minimum gives 16.
        assert_eq!(num_splits(1, 32, 16384, 132), 17);
        assert_eq!(num_splits(1, 32, 1024, 132), 16);
        assert_eq!(num_splits(32, 32, 1024, 132), 2);
        // Short context: limited by the 64-token minimum.
        assert_eq!(num_splits(1, 8, 1000, 132), 15);
        assert_eq!(num_splits(1, 8, 97, 132), 1);
        // A large batch fills the device alone, a middling one takes a few splits.
        assert_eq!(num_splits(64, 32, 16384, 132), 1);
        assert_eq!(num_splits(64, 8, 16384, 132), 3);
        // Never more than MAX_SPLITS, nor past SHORT_MAX_SPLITS with splits under
        // LONG_SPLIT_TOKENS keys.
        assert_eq!(num_splits(1, 1, 1 << 20, 132), MAX_SPLITS);
        assert_eq!(num_splits(1, 1, 20000, 132), SHORT_MAX_SPLITS);
        assert_eq!(num_splits(1, 4, 40000, 132), 78);
        assert_eq!(max_splits_for(0), SHORT_MAX_SPLITS);
        assert_eq!(num_splits(0, 0, 0, 0), 1);
    }

    #[test]
    fn the_mha_async_plan_takes_the_kernel_and_splits_whose_waves_fill_best() {
        // 32 heads, 132 SMs, the plain loop at 6 blocks per SM with its planner's splits, the
        // pipelined one at 4: the choices that measured fastest (or within 1 %) in session 28.
        let pick = |batch: usize, kv: usize| {
            let splits = num_splits_resident(batch, 32, kv, 132, 6, 1, 1, true);
            plan_mha_async(batch * 32, kv, 132, 6, splits, 4)
        };
        let cases = [
            ((8, 1024), (true, 2)),
            ((7, 1024), (true, 2)),
            ((8, 800), (true, 2)),
            ((8, 700), (false, 3)),
            ((8, 2048), (false, 3)),
            ((5, 1024), (false, 4)),
            ((7, 2048), (false, 3)),
            ((8, 4096), (false, 3)),
            ((8, 16384), (false, 3)),
            ((12, 1024), (false, 2)),
            ((16, 1024), (true, 1)),
            ((20, 1024), (false, 1)),
            ((24, 1024), (false, 1)),
            ((28, 1024), (true, 1)),
            ((32, 1024), (true, 1)),
            ((36, 1024), (false, 1)),
            ((40, 4096), (false, 1)),
            ((36, 4096), (false, 2)),
            ((36, 8192), (false, 2)),
            ((40, 8192), (true, 2)),
            ((56, 1024), (true, 1)),
            ((64, 1024), (true, 1)),
            ((64, 16384), (true, 1)),
        ];
        for ((batch, kv), want) in cases {
            assert_eq!(pick(batch, kv), want, "{batch} x {kv}");
        }
        // Fewer items than SMs: the plain loop's plan whatever it is.
        assert_eq!(plan_mha_async(100, 1 << 20, 132, 6, 7, 4), (false, 7));
        // A last wave below TAIL_SATURATING_BLOCKS per SM counts as that many.
        let h = WAVE_OVERHEAD_KEYS;
        assert_eq!(wave_cost(132, 1, 100, 132, 6, 1.0), 100.0 * TAIL_SATURATING_BLOCKS + h);
        assert_eq!(wave_cost(792, 1, 100, 132, 6, 1.0), 600.0 + h);
        assert_eq!(wave_cost(660, 2, 200, 132, 6, 1.0), 100.0 * (6.0 + 4.0) + 2.0 * h);
    }

    #[test]
    fn resident_split_counts_fill_one_wave_or_many() {
        // Fewer items than SMs: one wave of resident blocks (792 slots at 6 per SM, 924 at 7),
        // where num_splits aims at 4 per SM; the 64-key minimum split still bounds it.
        assert_eq!(num_splits(1, 32, 4096, 132), 17);
        assert_eq!(num_splits_resident(1, 32, 4096, 132, 6, 1, 1, true), 24);
        assert_eq!(num_splits_resident(1, 32, 16384, 132, 6, 1, 1, true), 24);
        assert_eq!(num_splits_resident(1, 32, 16384, 132, 7, 1, 1, false), 28);
        assert_eq!(num_splits_resident(2, 32, 4096, 132, 7, 1, 1, false), 14);
        assert_eq!(num_splits_resident(4, 32, 16384, 132, 7, 1, 1, false), 7);
        assert_eq!(num_splits_resident(1, 32, 1024, 132, 7, 1, 1, false), 16);
        // Between 1088 and 1792 keys sync cannot make 28 splits of 64+ keys: num_splits' 17.
        assert_eq!(num_splits_resident(1, 32, 1280, 132, 7, 1, 1, false), 17);
        assert_eq!(num_splits_resident(1, 32, 1791, 132, 7, 1, 1, false), 17);
        assert_eq!(num_splits_resident(1, 32, 1792, 132, 7, 1, 1, false), 28);
        assert_eq!(num_splits_resident(2, 32, 16384, 132, 6, 1, 1, true), 12);
        assert_eq!(num_splits_resident(4, 32, 4096, 132, 6, 1, 1, true), 6);
        assert_eq!(num_splits_resident(1, 32, 1088, 132, 6, 1, 1, true), 17);
        assert_eq!(num_splits_resident(1, 32, 1024, 132, 6, 1, 1, true), 16);
        // Batch 8 and 16 of 32 kv heads at 6 (async) and 7 (sync) resident blocks per SM: one wave.
        assert_eq!(num_splits_resident(8, 32, 1024, 132, 6, 1, 1, true), 3);
        assert_eq!(num_splits_resident(8, 32, 1024, 132, 7, 1, 1, false), 3);
        assert_eq!(num_splits_resident(16, 32, 4096, 132, 6, 1, 1, true), 1);
        assert_eq!(num_splits_resident(16, 32, 4096, 132, 7, 1, 1, false), 1);
        // Batch 32 overfills a wave: async keeps 8 per SM's count, sync aims for 8 waves.
        assert_eq!(num_splits_resident(32, 32, 4096, 132, 6, 1, 1, true), 2);
        assert_eq!(num_splits_resident(32, 32, 4096, 132, 7, 1, 1, false), 8);
        // Short sequences still bound the split length, and MAX_SPLITS bounds the count.
        assert_eq!(num_splits_resident(8, 32, 100, 132, 7, 1, 1, false), 1);
        assert_eq!(num_splits_resident(132, 1, 1 << 20, 132, 1000, 1, 1, false), MAX_SPLITS);
        assert_eq!(num_splits_resident(0, 0, 0, 0, 0, 1, 1, true), 1);
        // Four heads per block, 3 resident per SM (396 slots), 8 kv heads: batch 16, 32 and 64
        // all take 3 splits (0.97, 1.94 and 3.88 waves), either scheme.
        for batch in [16, 32, 64] {
            for a in [true, false] {
                assert_eq!(num_splits_resident(batch, 8, 4096, 132, 3, 4, 1, a), 3, "batch {batch}");
            }
        }
        // Batch 1-8 of 8 kv heads: the small-batch rule, capped at one wave of resident blocks.
        assert_eq!(num_splits(1, 8, 4096, 132), 64);
        assert_eq!(num_splits_resident(1, 8, 4096, 132, 3, 4, 1, true), 49);
        // Batch 1 of 8, 4 and 2 kv heads on the tensor-core pass (8 heads per block, 4 resident
        // per SM): one wave of 528 blocks, 66 / 132 / 256 (MAX_SPLITS) splits at 131072 keys;
        // at 32768 keys the splits would be shorter than LONG_SPLIT_TOKENS: 64.
        assert_eq!(num_splits_resident(1, 8, 131072, 132, 4, 4, 1, true), 66);
        assert_eq!(num_splits_resident(1, 4, 131072, 132, 4, 8, 1, false), 132);
        assert_eq!(num_splits_resident(1, 2, 131072, 132, 4, 8, 1, true), MAX_SPLITS);
        assert_eq!(num_splits_resident(1, 4, 32768, 132, 4, 8, 1, true), SHORT_MAX_SPLITS);
        assert_eq!(num_splits_resident(1, 4, 65536, 132, 4, 8, 1, true), 128);
        assert_eq!(num_splits_resident(1, 8, 4096, 132, 4, 8, 1, true), 64);
        assert_eq!(num_splits_resident(8, 8, 4096, 132, 3, 4, 1, true), 6);
        // The tensor-core pass (4 resident per SM, 528 slots): GQA 32/8 at batch 4 takes 16
        // splits (512 blocks), not num_splits' 17 (544: a second wave of 16 blocks); 32/4 at
        // batch 16, 8 not 9; two head chunks per kv head halve the count.
        assert_eq!(num_splits(4, 8, 32768, 132), 17);
        assert_eq!(num_splits_resident(4, 8, 32768, 132, 4, 4, 1, false), 16);
        assert_eq!(num_splits_resident(16, 4, 32768, 132, 4, 8, 1, true), 8);
        assert_eq!(num_splits_resident(4, 8, 32768, 132, 4, 8, 2, true), 8);
        // Short sequences bound it too.
        assert_eq!(num_splits_resident(32, 8, 100, 132, 3, 4, 1, true), 1);
    }

    #[test]
    fn flop_counts_match_the_usual_formulas() {
        let layout = PagedKvLayout::new(16, 64, 2, 64, DType::F16).expect("layout");
        let t = crate::kv::BlockTable {
            pages: (0..32).collect(),
            seq_len: 512,
        };
        let tables = FlatBlockTables::new(&layout, &[t]).expect("tables");
        let geom = AttnGeometry::new(8, 2, 64).expect("geom");
        let p = PrefillParams {
            geom,
            dtype: DType::F16,
            scheme: SoftmaxScheme::Sync,
            tables: tables.clone(),
            new_lens: vec![512],
        };
        // From empty: 2 · B · H · L² · D.
        assert_eq!(p.flops(), 2.0 * 8.0 * 512.0 * 512.0 * 64.0);
        let d = DecodeParams {
            geom,
            dtype: DType::F16,
            scheme: SoftmaxScheme::Sync,
            tables,
            num_splits: None,
        };
        assert_eq!(d.flops(), 4.0 * 8.0 * 64.0 * 512.0);
        // K and V: 512 tokens · 2 kv heads · 64 · 2 bytes each; q and out: 8 · 64 · 2 bytes each.
        assert_eq!(d.min_bytes(), 2.0 * 512.0 * 128.0 * 2.0 + 2.0 * 512.0 * 2.0);
    }
}
