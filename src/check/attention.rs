//! Attention checks: decode and prefill, each under the sync and the async softmax, against the
//! f64 two-pass reference (`crate::reference::attention`).
//!
//! Per case: fresh random q, k, v and pools (every page, used or not, holds random values; the
//! pages of a sequence are scattered through the pool, so a kernel that reads the wrong page is
//! seen), the output poisoned and followed by a guard, the NMSE judged per dtype. On top:
//! - prefill must leave the pools exactly as the reference writes them (new K and V at their
//!   block-table positions, nothing else touched);
//! - async must agree with sync and recompute nothing on ordinary inputs, and must recompute at
//!   least one row (and still match the reference) on inputs built to leave [a, b].

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use super::{Status, GUARD_ELEMS};
use crate::backend::{Backend, BackendKind};
use crate::dtype::{random_bits, DType};
use crate::error::{FdppError, Result};
use crate::kv::paged::{write_tokens, BlockTable, FlatBlockTables, PagedKv, PagedKvLayout, DEFAULT_PAGE_SIZE};
use crate::ops::attention::{AttnGeometry, AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};
use crate::reference::attention::{decode_ref, prefill_ref};
use crate::reference::gemm::nmse;

/// The async window of the checks: φ = 0, [a, b] = [−12, 12]. Scores of the random inputs stay
/// within about ±6, so nothing is recomputed unless a case forces it.
pub const CHECK_ASYNC: SoftmaxScheme = SoftmaxScheme::Async {
    phi: 0.0,
    a: -12.0,
    b: 12.0,
};

/// Scale of the random q and k: uniform [−s, s) gives q·k/√d a standard deviation of s²/3 ≈ 1.5,
/// a realistic spread of attention scores.
const QK_SCALE: f32 = 2.1;

/// NMSE limit of an attention output against the f64 reference. Looser than a GEMM's: a GPU
/// kernel rounds the probabilities P to the 16-bit type before the PV product.
pub fn attention_nmse_limit(dt: DType) -> f64 {
    match dt {
        DType::F16 => 2e-5,
        DType::Bf16 => 2e-4,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnKind {
    Decode,
    Prefill,
}

/// Inputs built to make the async scheme recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Force {
    None,
    /// One score of one row has x − φ ≥ b + 2.
    Overflow,
    /// Every score of one row has x − φ ≤ a − 2.
    Underflow,
    /// Prefill: as `Underflow`, for every head's rows at every fifth new token of two query
    /// tiles in three (tiles 0, 2, 3, 5, …), every key made non-negative: flagged blocks spread
    /// through the list, several to a CTA of the persistent kernel, some back to back, clean ones
    /// between, and clean rows inside flagged blocks.
    Spread,
}

/// One attention case.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnCase {
    pub kind: AttnKind,
    pub dtype: DType,
    pub geom: AttnGeometry,
    /// kv_len of each sequence after the step.
    pub kv_lens: Vec<usize>,
    /// Prefill: new tokens of each sequence (the rest is the cached prefix). Empty for decode.
    pub new_lens: Vec<usize>,
    pub page_size: usize,
    /// Pages handed out in order, as a fresh allocator does, with one pair swapped (pages 12
    /// and 13 of the first sequence): whole key tiles of consecutive pages, which the Hopper
    /// prefill loads as one TMA box each, beside one that is not. Else scattered.
    pub runs: bool,
    pub force: Force,
}

impl AttnCase {
    fn new(
        kind: AttnKind,
        dtype: DType,
        hkd: (usize, usize, usize),
        kv_lens: &[usize],
        new_lens: &[usize],
        force: Force,
    ) -> Self {
        AttnCase {
            kind,
            dtype,
            geom: AttnGeometry {
                num_heads: hkd.0,
                num_kv_heads: hkd.1,
                head_dim: hkd.2,
            },
            kv_lens: kv_lens.to_vec(),
            new_lens: new_lens.to_vec(),
            page_size: DEFAULT_PAGE_SIZE,
            runs: false,
            force,
        }
    }

    /// The same case with pages in order but one pair ([`AttnCase::runs`]).
    fn in_runs(mut self) -> Self {
        self.runs = true;
        self
    }

    /// The same case on pages of `page_size` tokens.
    fn paged(mut self, page_size: usize) -> Self {
        self.page_size = page_size;
        self
    }

    /// e.g. `h8/kv2 d128 kv=[97,1000] new=[..] page=8 force=overflow` (the page size when it is
    /// not the default).
    pub fn label(&self) -> String {
        let list = |v: &[usize]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        let mut s = format!("{} kv=[{}]", self.geom.label(), list(&self.kv_lens));
        if self.kind == AttnKind::Prefill {
            s.push_str(&format!(" new=[{}]", list(&self.new_lens)));
        }
        if self.page_size != DEFAULT_PAGE_SIZE {
            s.push_str(&format!(" page={}", self.page_size));
        }
        if self.runs {
            s.push_str(" pages=runs");
        }
        match self.force {
            Force::None => {}
            Force::Overflow => s.push_str(" force=overflow"),
            Force::Underflow => s.push_str(" force=underflow"),
            Force::Spread => s.push_str(" force=spread"),
        }
        s
    }
}

/// One scheme on one case.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttnCheckRow {
    pub backend: BackendKind,
    /// "attention".
    pub op: String,
    /// e.g. `decode_async_f16`.
    pub spec: String,
    pub kind: AttnKind,
    pub case: String,
    pub dtype: DType,
    pub scheme: String,
    pub rows: Option<usize>,
    pub recomputed: Option<usize>,
    pub nmse: Option<f64>,
    pub max_rel_err: Option<f64>,
    #[serde(flatten)]
    pub status: Status,
}

/// Cases per dtype shared by both lists: kv_len 1, 97 and 4097, GQA ratios 1, 4 and 8, a ragged
/// batch, head_dim 64, 128 and 256, and one forced recompute of each kind for decode and prefill.
fn cases_for(dt: DType, full: bool) -> Vec<AttnCase> {
    use AttnKind::{Decode, Prefill};
    let n = Force::None;
    // (heads, kv_heads, head_dim): more heads in the full list.
    let (r1, r4, r8) = if full {
        ((8, 8, 128), (32, 8, 128), (32, 4, 64))
    } else {
        ((2, 2, 128), (4, 1, 128), (8, 1, 64))
    };
    vec![
        AttnCase::new(Decode, dt, r1, &[1], &[], n),
        AttnCase::new(Decode, dt, r4, &[97], &[], n),
        AttnCase::new(Decode, dt, r8, &[4097], &[], n),
        AttnCase::new(Decode, dt, r4, &[1, 97, 530, 4097], &[], n),
        AttnCase::new(Decode, dt, (4, 2, 256), &[300], &[], n),
        AttnCase::new(Decode, dt, r4, &[97, 1000], &[], Force::Overflow),
        AttnCase::new(Decode, dt, r1, &[33, 97], &[], Force::Underflow),
        AttnCase::new(Prefill, dt, r1, &[97], &[97], n),
        AttnCase::new(Prefill, dt, r8, &[40, 97, 1], &[40, 20, 1], n),
        AttnCase::new(Prefill, dt, r4, &[161], &[33], n),
        AttnCase::new(Prefill, dt, r4, &[50, 70], &[50, 9], Force::Overflow),
        AttnCase::new(Prefill, dt, r1, &[64, 30], &[16, 30], Force::Underflow),
        // Several key tiles of 128 behind a cached prefix, each sequence's last tile partial: the
        // Hopper kernel loads whole tiles by TMA (a box per page, or one per tile for pages of
        // 128 keys or more) and partial ones, or pages TMA cannot box (4), by cp.async.
        AttnCase::new(Prefill, dt, r4, &[700, 300], &[600, 300], n),
        AttnCase::new(Prefill, dt, r1, &[400], &[400], n).paged(8),
        AttnCase::new(Prefill, dt, r8, &[530, 260], &[530, 200], n).paged(256),
        AttnCase::new(Prefill, dt, r1, &[300], &[300], n).paged(4),
        // Pages in order, one pair swapped: whole tiles as one box, one tile box by box, and the
        // overlapped schedule these take by default (prefill_hopper.rs `run_share`).
        AttnCase::new(Prefill, dt, r4, &[700, 300], &[600, 300], n).in_runs(),
        AttnCase::new(Prefill, dt, r8, &[1000], &[1000], Force::Overflow).in_runs(),
        // Many flagged blocks, scattered pages and pages in order (one Q buffer under the
        // persistent kernel at d128 with three stages, two at d64).
        AttnCase::new(Prefill, dt, r8, &[1000, 700], &[1000, 600], Force::Spread),
        AttnCase::new(Prefill, dt, r4, &[1000, 700], &[1000, 600], Force::Spread).in_runs(),
    ]
}

/// GQA ratios that are not powers of two (issue #17): 3, 5, 6, 7, 12 and 14, each head_dim, odd
/// and ragged kv_lens, chunked prefill behind a cached prefix, a forced recompute of each kind.
/// Decode serves such a group in chunks whose last one is partial (attn_plan.rs): ratio 3, 5
/// and 6 take 3 heads per block (5: one head masked), 7 and 14 take 4 (one and two masked), 12
/// takes 4. The forced underflow targets the last head, the last live head of a partial chunk.
fn odd_ratio_cases(dt: DType, full: bool) -> Vec<AttnCase> {
    use AttnKind::{Decode, Prefill};
    let n = Force::None;
    // (full, quick) geometries: real models' head counts in the full list (SmolLM2-135M 9/3,
    // Llama-3.2-3B 24/8, Qwen2-1.5B 12/2, Qwen2.5-7B 28/4), one or two kv heads in the quick one.
    let g = |f: (usize, usize, usize), q: (usize, usize, usize)| if full { f } else { q };
    let r3_64 = g((9, 3, 64), (3, 1, 64));
    let r3_128 = g((24, 8, 128), (6, 2, 128));
    let r5_128 = g((40, 8, 128), (5, 1, 128));
    let r5_256 = g((15, 3, 256), (5, 1, 256));
    let r6_256 = g((12, 2, 256), (6, 1, 256));
    let r6_64 = g((48, 8, 64), (12, 2, 64));
    let r7_64 = g((28, 4, 64), (7, 1, 64));
    let r7_128 = g((56, 8, 128), (14, 2, 128));
    let r7_256 = g((28, 4, 256), (7, 1, 256));
    let r12_64 = g((24, 2, 64), (12, 1, 64));
    let r14_128 = g((28, 2, 128), (14, 1, 128));
    vec![
        AttnCase::new(Decode, dt, r3_64, &[1, 97, 4097], &[], n),
        AttnCase::new(Decode, dt, r3_128, &[4097], &[], n),
        AttnCase::new(Decode, dt, r5_128, &[97, 530], &[], n),
        AttnCase::new(Decode, dt, r5_256, &[300], &[], n),
        AttnCase::new(Decode, dt, r6_256, &[1, 97], &[], n),
        // The CPU suite's quick list keeps one 4097-key odd-ratio case (ratio 3 above).
        AttnCase::new(Decode, dt, r6_64, if full { &[4097, 33] } else { &[600, 33] }, &[], n),
        AttnCase::new(
            Decode,
            dt,
            r7_64,
            if full { &[97, 4097, 1] } else { &[97, 1000, 1] },
            &[],
            n,
        ),
        AttnCase::new(Decode, dt, r7_128, &[530], &[], n),
        AttnCase::new(Decode, dt, r7_256, &[97], &[], n),
        AttnCase::new(Decode, dt, r12_64, &[300], &[], n),
        AttnCase::new(Decode, dt, r14_128, &[1000, 97], &[], n),
        AttnCase::new(Decode, dt, r5_128, &[97, 1000], &[], Force::Overflow),
        AttnCase::new(Decode, dt, r7_64, &[33, 97], &[], Force::Underflow),
        AttnCase::new(Prefill, dt, r3_128, &[161], &[33], n),
        AttnCase::new(Prefill, dt, r5_128, &[97, 40], &[97, 20], n),
        AttnCase::new(Prefill, dt, r6_256, &[130], &[70], n),
        AttnCase::new(
            Prefill,
            dt,
            r7_128,
            if full { &[400, 300] } else { &[200, 150] },
            if full { &[300, 300] } else { &[150, 150] },
            n,
        ),
        AttnCase::new(Prefill, dt, r12_64, &[97], &[97], n),
        AttnCase::new(Prefill, dt, r7_64, &[50, 70], &[50, 9], Force::Overflow),
        AttnCase::new(Prefill, dt, r3_64, &[64, 30], &[16, 30], Force::Underflow),
    ]
}

/// GQA ratios the CUDA tensor-core decode pass serves (kernels_cuda/attn_decode_tc.cuh, up to 8
/// heads per block): 2-8 in one block, 16 in two of 8.
pub const TC_RATIOS: [usize; 8] = [2, 3, 4, 5, 6, 7, 8, 16];

/// Decode at every ratio of [`TC_RATIOS`] and head_dim 64, 128 and 256 (where the tensor-core
/// pass runs under `decode_tc=auto|1`; at 256 as teams of two warps, one per half of the dims,
/// that exchange their partial scores every step), two kv heads each: odd and ragged kv_lens (a key count that
/// is no multiple of a warp's 16 or a block's 64, one split and several, sequences of 1 key
/// beside long ones, page sizes other than 16), forced recomputes of both kinds, which the
/// async kernel redoes with the same pass, and two long contexts. Only in the full list (`fdpp check`): their CPU
/// reference is the cost, not the kernel.
fn tc_cases(dt: DType) -> Vec<AttnCase> {
    use AttnKind::Decode;
    let lens: [&[usize]; 8] = [
        &[1, 17, 4097],
        &[63, 2000],
        &[4097, 1],
        &[97, 530, 1],
        &[33],
        &[1000, 65, 3],
        &[129, 4096],
        &[300, 17],
    ];
    let mut v = Vec::new();
    for (i, &r) in TC_RATIOS.iter().enumerate() {
        for (j, d) in [64usize, 128, 256].into_iter().enumerate() {
            let l = lens[(i + 3 * j) % lens.len()];
            let c = AttnCase::new(Decode, dt, (2 * r, 2, d), l, &[], Force::None);
            v.push(if (i + j) % 4 == 1 { c.paged(8) } else { c });
        }
    }
    for (r, d, f) in [
        (5, 64, Force::Overflow),
        (6, 128, Force::Overflow),
        (8, 64, Force::Underflow),
        (16, 128, Force::Underflow),
        (2, 128, Force::Overflow),
        (7, 64, Force::Underflow),
        (8, 256, Force::Overflow),
        (5, 256, Force::Underflow),
        (4, 256, Force::Overflow),
    ] {
        v.push(AttnCase::new(Decode, dt, (2 * r, 2, d), &[97, 1000], &[], f));
    }
    // head_dim 256 at ratios 1 (the tensor-core pass under decode_tc=1 only; the CUDA-core one
    // under auto), 4 and 8 (one block per kv head), Llama-like head counts: odd kv_lens (no
    // multiple of a team's 16 keys or a block's 32), one split and many, a 1-key sequence beside
    // long ones, pages of 8 and 16, and a long context split 64 ways.
    v.push(AttnCase::new(Decode, dt, (8, 8, 256), &[1, 33, 4097], &[], Force::None));
    v.push(AttnCase::new(Decode, dt, (8, 8, 256), &[1001], &[], Force::None).paged(8));
    v.push(AttnCase::new(
        Decode,
        dt,
        (32, 8, 256),
        &[97, 1001, 1],
        &[],
        Force::None,
    ));
    v.push(AttnCase::new(Decode, dt, (32, 8, 256), &[4099], &[], Force::None).paged(8));
    v.push(AttnCase::new(Decode, dt, (32, 4, 256), &[63, 4097], &[], Force::None));
    v.push(AttnCase::new(Decode, dt, (16, 2, 256), &[1, 2049, 17], &[], Force::None).paged(8));
    v.push(AttnCase::new(Decode, dt, (32, 8, 256), &[32771], &[], Force::None));
    // Long contexts (issue #19): Llama-3's 32/8 at 131072 keys (66 splits of 1986 at batch 1 on
    // an H100) and 32/4 with a ragged batch of 1, 100000 and 4097 keys (the splits sized by the
    // longest row, the short rows' blocks mostly empty). Batch 1 of few kv heads splits past 64
    // (the combine's limit until session 18) where the splits stay long: 32/4 at 131072 keys
    // (132 splits on an H100), 16/2 at 140000 (256, MAX_SPLITS) and SmolLM2's 9/3 at d64, 65536
    // keys (128).
    v.push(AttnCase::new(Decode, dt, (32, 8, 128), &[131072], &[], Force::None));
    v.push(AttnCase::new(
        Decode,
        dt,
        (32, 4, 128),
        &[1, 100_000, 4097],
        &[],
        Force::None,
    ));
    v.push(AttnCase::new(Decode, dt, (32, 4, 128), &[131072], &[], Force::None));
    v.push(AttnCase::new(Decode, dt, (16, 2, 128), &[140_000], &[], Force::None));
    v.push(AttnCase::new(Decode, dt, (9, 3, 64), &[65536], &[], Force::None));
    v
}

/// MHA batches that the CUDA async decode runs on its pipelined loop (`plan_mha_async` on an
/// H100's 132 SMs: 256 (sequence, head) items of at most 1000 keys take two splits of at most 500,
/// at head_dim 128 and 256; 512 items of at most 1100 keys one split), ragged, with sequences of
/// a few keys among them (a split with no keys at all).
fn mha_wave_cases(dt: DType) -> Vec<AttnCase> {
    use AttnKind::Decode;
    let n = Force::None;
    let eight: &[usize] = &[1000, 1, 640, 999, 333, 1000, 97, 800];
    let sixteen: &[usize] = &[
        1100, 1024, 1, 1100, 517, 1100, 64, 1099, 1100, 2, 900, 1100, 1100, 300, 1023, 1100,
    ];
    vec![
        AttnCase::new(Decode, dt, (32, 32, 128), eight, &[], n),
        AttnCase::new(Decode, dt, (32, 32, 128), sixteen, &[], n),
        AttnCase::new(Decode, dt, (16, 16, 256), &[eight, eight].concat(), &[], n),
    ]
}

/// Long prompts (issue #20's verify list): a fresh 4097- and a 16384-token prefill, a 4096-token
/// chunk against 12288 cached keys beside a 1-token and a fresh 4097-token sequence (the engine's
/// chunked long prompts in one ragged batch), head_dim 64 and 256 behind a cached prefix, and
/// the async recompute spread over a 4097-token prompt. Pages of 16 scattered, and in order as
/// a fresh allocator hands them out (whole key tiles as one TMA box); few heads, since the f64
/// reference of 16384 tokens is quadratic. Only in the full list.
fn long_prefill_cases(dt: DType) -> Vec<AttnCase> {
    use AttnKind::Prefill;
    let n = Force::None;
    vec![
        AttnCase::new(Prefill, dt, (8, 2, 128), &[4097], &[4097], n),
        AttnCase::new(Prefill, dt, (8, 2, 128), &[4097], &[4097], n).in_runs(),
        AttnCase::new(Prefill, dt, (4, 1, 128), &[16384], &[16384], n).in_runs(),
        AttnCase::new(Prefill, dt, (8, 2, 128), &[16384, 1, 4097], &[4096, 1, 4097], n),
        AttnCase::new(Prefill, dt, (8, 1, 64), &[4097, 97], &[1025, 97], n).in_runs(),
        AttnCase::new(Prefill, dt, (4, 2, 256), &[4097], &[2049], n),
        AttnCase::new(Prefill, dt, (8, 2, 128), &[4097], &[4097], Force::Spread).in_runs(),
    ]
}

/// Every case of `fdpp check`, in f16 and bf16.
pub fn attention_cases() -> Vec<AttnCase> {
    [DType::F16, DType::Bf16]
        .iter()
        .flat_map(|&dt| {
            [
                cases_for(dt, true),
                odd_ratio_cases(dt, true),
                tc_cases(dt),
                mha_wave_cases(dt),
                long_prefill_cases(dt),
            ]
            .concat()
        })
        .collect()
}

/// The same shapes with fewer heads, for `cargo test` and `fdpp check --quick`. The odd GQA
/// ratios only in f16 here (their code paths do not depend on the dtype; the full list has both),
/// to keep the CPU suite's time.
pub fn attention_cases_quick() -> Vec<AttnCase> {
    let mut v: Vec<AttnCase> = [DType::F16, DType::Bf16]
        .iter()
        .flat_map(|&dt| cases_for(dt, false))
        .collect();
    v.extend(odd_ratio_cases(DType::F16, false));
    // Ratios 2 and 16, which the lists above lack (the tensor-core pass: one block of 2, two of
    // 8), small enough for the CPU suite.
    let n = Force::None;
    v.push(AttnCase::new(
        AttnKind::Decode,
        DType::F16,
        (2, 1, 64),
        &[33, 1],
        &[],
        n,
    ));
    v.push(AttnCase::new(
        AttnKind::Decode,
        DType::F16,
        (16, 1, 128),
        &[97, 300],
        &[],
        n,
    ));
    v
}

/// Host inputs of one case.
struct Inputs {
    layout: PagedKvLayout,
    tables: FlatBlockTables,
    q: Vec<u16>,
    /// Prefill only: the new tokens' k and v.
    k_new: Vec<u16>,
    v_new: Vec<u16>,
    k_pool: Vec<u16>,
    v_pool: Vec<u16>,
}

fn build_inputs(c: &AttnCase, seed: u64) -> Result<Inputs> {
    let g = c.geom;
    g.validate()?;
    let dt = c.dtype;
    // Scattered pages (unless `runs`): a shuffled pool with 3 spare pages that no sequence owns.
    let need: usize = c.kv_lens.iter().map(|&l| l.div_ceil(c.page_size)).sum();
    let layout = PagedKvLayout::new(c.page_size, need + 3, g.num_kv_heads, g.head_dim, dt)?;
    let mut ids: Vec<u32> = (0..layout.num_pages as u32).collect();
    if c.runs {
        if ids.len() > 13 {
            ids.swap(12, 13);
        }
    } else {
        ids.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
    }
    let mut next = ids.into_iter();
    let tables: Vec<BlockTable> = c
        .kv_lens
        .iter()
        .map(|&l| BlockTable {
            pages: next.by_ref().take(l.div_ceil(c.page_size)).collect(),
            seq_len: l,
        })
        .collect();
    let tables = FlatBlockTables::new(&layout, &tables)?;
    let tokens = match c.kind {
        AttnKind::Decode => c.kv_lens.len(),
        AttnKind::Prefill => c.new_lens.iter().sum(),
    };
    let kvd = g.num_kv_heads * g.head_dim;
    let mut inp = Inputs {
        layout,
        tables,
        q: random_bits(dt, tokens * g.num_heads * g.head_dim, QK_SCALE, seed ^ 1),
        k_new: random_bits(dt, tokens * kvd, QK_SCALE, seed ^ 2),
        v_new: random_bits(dt, tokens * kvd, 1.0, seed ^ 3),
        k_pool: random_bits(dt, layout.pool_elems(), QK_SCALE, seed ^ 4),
        v_pool: random_bits(dt, layout.pool_elems(), 1.0, seed ^ 5),
    };
    if c.kind == AttnKind::Decode {
        inp.k_new.clear();
        inp.v_new.clear();
    }
    force(c, &mut inp);
    Ok(inp)
}

/// Where the key of position t of (sequence b, kv head) lives: in the pool, or (prefill, new
/// tokens) in k_new.
fn key_at<'a>(c: &AttnCase, inp: &'a mut Inputs, b: usize, kvh: usize, t: usize) -> &'a mut [u16] {
    let d = c.geom.head_dim;
    if c.kind == AttnKind::Prefill {
        let prefix = c.kv_lens[b] - c.new_lens[b];
        if t >= prefix {
            let row = c.new_lens[..b].iter().sum::<usize>() + t - prefix;
            let at = (row * c.geom.num_kv_heads + kvh) * d;
            return &mut inp.k_new[at..at + d];
        }
    }
    let table = inp.tables.table(b);
    let page = table.pages[t / c.page_size] as usize;
    let at = inp.layout.offset(page, t % c.page_size, kvh);
    &mut inp.k_pool[at..at + d]
}

/// Rewrites one row's q or keys so that the async scheme must flag it. The target row is the
/// last query of sequence 0 (overflow) or of the last sequence (underflow), head 0 or the last
/// head; it attends to positions 0..=its own.
fn force(c: &AttnCase, inp: &mut Inputs) {
    let SoftmaxScheme::Async { phi, a, b: hi } = CHECK_ASYNC else {
        return;
    };
    let (g, dt) = (c.geom, c.dtype);
    let d = g.head_dim;
    let sqrt_d = (d as f32).sqrt();
    let (seq, head) = match c.force {
        Force::None => return,
        Force::Spread => return force_spread(c, inp, phi + a - 2.0),
        Force::Overflow => (0, 0),
        Force::Underflow => (c.kv_lens.len() - 1, g.num_heads - 1),
    };
    let kvh = head / g.group();
    // The q row of the target: the sequence's row (decode) or its last new token (prefill).
    let qrow = match c.kind {
        AttnKind::Decode => seq,
        AttnKind::Prefill => c.new_lens[..=seq].iter().sum::<usize>() - 1,
    };
    let qat = (qrow * g.num_heads + head) * d;
    let keys = c.kv_lens[seq];
    match c.force {
        Force::None | Force::Spread => {}
        Force::Overflow => {
            // k_t = c · sign(q) for the middle key: q·k_t/√d = c · Σ|q| / √d = φ + b + 2.
            let qv: Vec<f32> = inp.q[qat..qat + d].iter().map(|&x| dt.to_f32(x)).collect();
            let l1: f32 = qv.iter().map(|x| x.abs()).sum();
            let mag = (phi + hi + 2.0) * sqrt_d / l1.max(1e-3);
            let k = key_at(c, inp, seq, kvh, keys / 2);
            for (kk, &qq) in k.iter_mut().zip(&qv) {
                *kk = dt.from_f32(if qq < 0.0 { -mag } else { mag });
            }
        }
        Force::Underflow => {
            let m = underflow_scale(c, inp, seq, kvh, phi + a - 2.0);
            for x in &mut inp.q[qat..qat + d] {
                *x = dt.from_f32(-m);
            }
        }
    }
}

/// Makes every key of (`seq`, `kvh`) non-negative (sign bit cleared) and returns the m for which
/// q = −m·(1, …, 1) puts every score, −m·Σ|k|/√d, at or below `top`.
fn underflow_scale(c: &AttnCase, inp: &mut Inputs, seq: usize, kvh: usize, top: f32) -> f32 {
    let mut min_l1 = f32::INFINITY;
    for t in 0..c.kv_lens[seq] {
        let k = key_at(c, inp, seq, kvh, t);
        k.iter_mut().for_each(|x| *x &= 0x7fff);
        min_l1 = min_l1.min(k.iter().map(|&x| c.dtype.to_f32(x)).sum());
    }
    -top * (c.geom.head_dim as f32).sqrt() / min_l1.max(1e-3)
}

/// The new tokens (within their sequence) whose rows [`Force::Spread`] flags.
fn spread_rows(new_len: usize) -> impl Iterator<Item = usize> {
    (0..new_len).filter(|i| (i / 128) % 3 != 1 && i % 5 == 0)
}

/// Rows [`Force::Spread`] flags, over every head.
fn spread_count(c: &AttnCase) -> usize {
    c.new_lens.iter().map(|&n| spread_rows(n).count()).sum::<usize>() * c.geom.num_heads
}

/// [`Force::Spread`]: the flagged rows' scores all at or below `top` ([`underflow_scale`]).
fn force_spread(c: &AttnCase, inp: &mut Inputs, top: f32) {
    let (g, dt) = (c.geom, c.dtype);
    let d = g.head_dim;
    for seq in 0..c.new_lens.len() {
        let row0: usize = c.new_lens[..seq].iter().sum();
        for kvh in 0..g.num_kv_heads {
            let m = underflow_scale(c, inp, seq, kvh, top);
            for i in spread_rows(c.new_lens[seq]) {
                for head in kvh * g.group()..(kvh + 1) * g.group() {
                    let at = ((row0 + i) * g.num_heads + head) * d;
                    inp.q[at..at + d].iter_mut().for_each(|x| *x = dt.from_f32(-m));
                }
            }
        }
    }
}

/// Runs every case under `Sync` and [`CHECK_ASYNC`]. A backend that declines (`Unsupported`)
/// gives skipped rows; errors moving data end the check (`Err`).
pub fn check_attention<B: Backend>(b: &B, cases: &[AttnCase], seed: u64) -> Result<Vec<AttnCheckRow>> {
    let mut rows = Vec::new();
    for (ci, c) in cases.iter().enumerate() {
        let case_seed = mix(seed.wrapping_add(0xA77E_0000 + ci as u64));
        let inp = build_inputs(c, case_seed)?;
        let reference = match c.kind {
            AttnKind::Decode => {
                let p = decode_params(c, &inp, SoftmaxScheme::Sync);
                decode_ref(&p, &inp.layout, &inp.q, &inp.k_pool, &inp.v_pool)
            }
            AttnKind::Prefill => {
                let p = prefill_params(c, &inp, SoftmaxScheme::Sync);
                prefill_ref(
                    &p,
                    &inp.layout,
                    (&inp.q, &inp.k_new, &inp.v_new),
                    &inp.k_pool,
                    &inp.v_pool,
                )
            }
        };
        let mut sync_out: Option<Vec<f64>> = None;
        for scheme in [SoftmaxScheme::Sync, CHECK_ASYNC] {
            let mut row = AttnCheckRow {
                backend: b.info().backend,
                op: "attention".into(),
                spec: format!(
                    "{}_{}_{}",
                    if c.kind == AttnKind::Decode {
                        "decode"
                    } else {
                        "prefill"
                    },
                    scheme.name(),
                    c.dtype
                ),
                kind: c.kind,
                case: c.label(),
                dtype: c.dtype,
                scheme: scheme.label(),
                rows: None,
                recomputed: None,
                nmse: None,
                max_rel_err: None,
                status: Status::Pass,
            };
            match run_one(b, c, &inp, scheme) {
                Err(e @ FdppError::Unsupported { .. }) => row.status = Status::Skipped(e.to_string()),
                Err(e) => row.status = Status::Fail(format!("run failed: {e}")),
                Ok(Ran { stats, out, pools_ok }) => {
                    row.rows = Some(stats.rows);
                    row.recomputed = Some(stats.recomputed);
                    judge(c, &out, &reference, &mut row);
                    let out_f: Vec<f64> = out[..reference.len()]
                        .iter()
                        .map(|&x| c.dtype.to_f32(x) as f64)
                        .collect();
                    if row.status == Status::Pass {
                        row.status = extra_checks(c, scheme, stats, &out_f, sync_out.as_deref(), pools_ok);
                    }
                    if scheme == SoftmaxScheme::Sync {
                        sync_out = Some(out_f);
                    }
                }
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// SplitMix64's finaliser: unrelated input streams for consecutive case indices.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn decode_params(c: &AttnCase, inp: &Inputs, scheme: SoftmaxScheme) -> DecodeParams {
    DecodeParams {
        geom: c.geom,
        dtype: c.dtype,
        scheme,
        tables: inp.tables.clone(),
        num_splits: None,
    }
}

fn prefill_params(c: &AttnCase, inp: &Inputs, scheme: SoftmaxScheme) -> PrefillParams {
    PrefillParams {
        geom: c.geom,
        dtype: c.dtype,
        scheme,
        tables: inp.tables.clone(),
        new_lens: c.new_lens.iter().map(|&n| n as i32).collect(),
    }
}

struct Ran {
    stats: AttnStats,
    /// Output then guard.
    out: Vec<u16>,
    /// Prefill: None when the pools were left as the reference writes them and the attend-only
    /// entry point (`attention_prefill_cached_enqueue`, the engine's) gave the same output bit
    /// for bit; else why not.
    pools_ok: Option<String>,
}

fn run_one<B: Backend>(b: &B, c: &AttnCase, inp: &Inputs, scheme: SoftmaxScheme) -> Result<Ran> {
    let dt = c.dtype;
    let mut kv = PagedKv {
        layout: inp.layout,
        k: b.upload(dt, &inp.k_pool)?,
        v: b.upload(dt, &inp.v_pool)?,
    };
    let q = b.upload(dt, &inp.q)?;
    let mut out = b.alloc(dt, inp.q.len() + GUARD_ELEMS)?;
    b.fill(&mut out, dt.poison())?;
    match c.kind {
        AttnKind::Decode => {
            let p = decode_params(c, inp, scheme);
            let stats = b.attention_decode(&p, &q, &kv, &mut out)?;
            b.synchronize()?;
            Ok(Ran {
                stats,
                out: b.download(&out)?,
                pools_ok: None,
            })
        }
        AttnKind::Prefill => {
            let p = prefill_params(c, inp, scheme);
            let k = b.upload(dt, &inp.k_new)?;
            let v = b.upload(dt, &inp.v_new)?;
            let stats = b.attention_prefill(&p, &q, &k, &v, &mut kv, &mut out)?;
            b.synchronize()?;
            let pools_ok = expected_pools(&p, inp).and_then(|(ek, ev)| {
                let gk = b.download(&kv.k)?;
                let gv = b.download(&kv.v)?;
                Ok(first_diff(&ek, &gk)
                    .map(|i| format!("K pool differs from the expected write at element {i}"))
                    .or_else(|| {
                        first_diff(&ev, &gv).map(|i| format!("V pool differs from the expected write at element {i}"))
                    }))
            })?;
            let out_full = b.download(&out)?;
            // The engine's path: the same attention over the cache the call above wrote.
            b.fill(&mut out, dt.poison())?;
            b.attention_prefill_cached_enqueue(&p, &q, &kv, &mut out)?;
            b.synchronize()?;
            let _ = b.take_recomputed()?;
            let cached = first_diff(&out_full, &b.download(&out)?).map(|i| {
                format!(
                    "the attend-only entry point (cache already written) differs from the full prefill at element {i}"
                )
            });
            Ok(Ran {
                stats,
                out: out_full,
                pools_ok: pools_ok.or(cached),
            })
        }
    }
}

/// The pools after a prefill: the new tokens written at their positions, every other element
/// as before.
fn expected_pools(p: &PrefillParams, inp: &Inputs) -> Result<(Vec<u16>, Vec<u16>)> {
    let (mut k, mut v) = (inp.k_pool.clone(), inp.v_pool.clone());
    let kvd = inp.layout.token_elems();
    for (b, &(row0, prefix, n)) in p.spans().iter().enumerate() {
        let t = p.tables.table(b);
        write_tokens(
            &inp.layout,
            &mut k,
            &t,
            prefix,
            &inp.k_new[row0 * kvd..(row0 + n) * kvd],
        )?;
        write_tokens(
            &inp.layout,
            &mut v,
            &t,
            prefix,
            &inp.v_new[row0 * kvd..(row0 + n) * kvd],
        )?;
    }
    Ok((k, v))
}

fn first_diff(a: &[u16], b: &[u16]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Output finite (no poison left), guard intact, NMSE within [`attention_nmse_limit`].
fn judge(c: &AttnCase, out: &[u16], reference: &[f64], row: &mut AttnCheckRow) {
    let (dt, len, d) = (c.dtype, reference.len(), c.geom.head_dim);
    if out.len() != len + GUARD_ELEMS {
        row.status = Status::Fail(format!(
            "download returned {} elements, expected {}",
            out.len(),
            len + GUARD_ELEMS
        ));
        return;
    }
    let (y, guard) = out.split_at(len);
    let y: Vec<f64> = y.iter().map(|&b| dt.to_f32(b) as f64).collect();
    let err = nmse(&y, reference);
    row.nmse = Some(err);
    let scale = reference.iter().fold(0f64, |a, r| a.max(r.abs()));
    let worst = y.iter().zip(reference).map(|(o, r)| (o - r).abs()).fold(0f64, f64::max);
    let non_finite = y.iter().position(|v| !v.is_finite());
    row.max_rel_err = Some(if non_finite.is_none() {
        worst / scale.max(f64::MIN_POSITIVE)
    } else {
        f64::INFINITY
    });
    let per_row = c.geom.num_heads * d;
    row.status = if let Some(i) = non_finite {
        Status::Fail(format!(
            "output not finite (never written?) at query row {} head {} element {}",
            i / per_row,
            (i % per_row) / d,
            i % d
        ))
    } else if let Some(i) = guard.iter().position(|&g| g != dt.poison()) {
        Status::Fail(format!("wrote past the end of the output: guard element {i} changed"))
    } else if err > attention_nmse_limit(dt) {
        let at = y
            .iter()
            .zip(reference)
            .map(|(o, r)| (o - r).abs())
            .enumerate()
            .fold((0, -1f64), |best, (i, e)| if e > best.1 { (i, e) } else { best })
            .0;
        Status::Fail(format!(
            "NMSE {err:.3e} > {:.1e}; worst at query row {} head {}: {} vs reference {:.6}",
            attention_nmse_limit(dt),
            at / per_row,
            (at % per_row) / d,
            y[at],
            reference[at]
        ))
    } else {
        Status::Pass
    };
}

/// Pool writes, recompute counts and async/sync agreement.
fn extra_checks(
    c: &AttnCase,
    scheme: SoftmaxScheme,
    stats: AttnStats,
    out: &[f64],
    sync_out: Option<&[f64]>,
    pools: Option<String>,
) -> Status {
    if let Some(why) = pools {
        return Status::Fail(why);
    }
    let want_rows = out.len() / c.geom.head_dim;
    if stats.rows != want_rows {
        return Status::Fail(format!("reported {} rows, computed {want_rows}", stats.rows));
    }
    match (scheme, c.force) {
        (SoftmaxScheme::Sync, _) if stats.recomputed != 0 => {
            Status::Fail(format!("sync scheme reported {} recomputed rows", stats.recomputed))
        }
        (SoftmaxScheme::Async { .. }, Force::None) if stats.recomputed != 0 => Status::Fail(format!(
            "async recomputed {} of {} rows on inputs inside [a, b]",
            stats.recomputed, stats.rows
        )),
        (SoftmaxScheme::Async { .. }, Force::Overflow | Force::Underflow | Force::Spread) if stats.recomputed == 0 => {
            Status::Fail("inputs built to leave [a, b] were not recomputed".into())
        }
        // Every forced row once: a block redone twice, or a row of it missed, shows here.
        (SoftmaxScheme::Async { .. }, Force::Spread) if stats.recomputed != spread_count(c) => Status::Fail(format!(
            "recomputed {} rows, {} were built to leave [a, b]",
            stats.recomputed,
            spread_count(c)
        )),
        (SoftmaxScheme::Async { .. }, _) => match sync_out {
            Some(s) if nmse(out, s) > attention_nmse_limit(c.dtype) => {
                Status::Fail(format!("async and sync outputs differ: NMSE {:.3e}", nmse(out, s)))
            }
            _ => Status::Pass,
        },
        _ => Status::Pass,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_lists_hold_what_the_issue_asks_for() {
        for list in [attention_cases(), attention_cases_quick()] {
            for dt in [DType::F16, DType::Bf16] {
                let of: Vec<_> = list.iter().filter(|c| c.dtype == dt).collect();
                for len in [1, 97, 4097] {
                    assert!(of.iter().any(|c| c.kv_lens.contains(&len)), "{dt}: no kv_len {len}");
                }
                for ratio in [1, 4, 8] {
                    assert!(of.iter().any(|c| c.geom.group() == ratio), "{dt}: no GQA ratio {ratio}");
                }
                c_odd_ratios(&list, dt);
                for kind in [AttnKind::Decode, AttnKind::Prefill] {
                    for f in [Force::Overflow, Force::Underflow] {
                        assert!(
                            of.iter().any(|c| c.kind == kind && c.force == f),
                            "{dt}: {kind:?} {f:?}"
                        );
                    }
                    if kind == AttnKind::Prefill {
                        assert!(of.iter().any(|c| c.kind == kind && c.force == Force::Spread));
                    }
                    assert!(
                        of.iter()
                            .any(|c| c.kind == kind && c.kv_lens.windows(2).any(|w| w[0] != w[1])),
                        "{dt}: no ragged {kind:?} batch"
                    );
                }
                for c in &of {
                    c.geom.validate().expect("supported geometry");
                }
            }
        }
    }

    /// Ratios 3, 5, 6, 7 at every head_dim across decode, 12 and 14 too, both kinds, odd
    /// kv_lens, a prefill behind a cached prefix and forced recomputes (the full list in both
    /// dtypes, the quick one in f16).
    fn c_odd_ratios(list: &[AttnCase], dt: DType) {
        let full = list.len() == attention_cases().len();
        if !full && dt != DType::F16 {
            return;
        }
        let of: Vec<_> = list
            .iter()
            .filter(|c| c.dtype == dt && !c.geom.group().is_power_of_two())
            .collect();
        for ratio in [3, 5, 6, 7, 12, 14] {
            assert!(of.iter().any(|c| c.geom.group() == ratio), "{dt}: no GQA ratio {ratio}");
        }
        for d in [64, 128, 256] {
            for hg in [3, 4] {
                assert!(
                    of.iter().any(|c| c.kind == AttnKind::Decode
                        && c.geom.head_dim == d
                        && crate::backend::attn_plan::attn_heads_per_block(c.geom.group()) == hg),
                    "{dt}: no odd-ratio decode at d{d} with {hg} heads per block"
                );
            }
        }
        for len in [1, 97, 4097] {
            assert!(
                of.iter().any(|c| c.kv_lens.contains(&len)),
                "{dt}: no odd-ratio kv_len {len}"
            );
        }
        assert!(of
            .iter()
            .any(|c| c.kind == AttnKind::Prefill && c.kv_lens.iter().zip(&c.new_lens).any(|(k, n)| k > n)));
        for kind in [AttnKind::Decode, AttnKind::Prefill] {
            assert!(
                of.iter().any(|c| c.kind == kind && c.force != Force::None),
                "{dt}: {kind:?}"
            );
        }
    }

    /// Issue #19: decode at 131072 keys and a ragged batch that mixes 1 and 100000 keys, in
    /// both dtypes, in the full list only (the CPU reference of 131072 keys is the cost).
    #[test]
    fn the_full_list_has_long_and_ragged_decode() {
        let full = attention_cases();
        for dt in [DType::F16, DType::Bf16] {
            let dec = |f: &dyn Fn(&AttnCase) -> bool| {
                full.iter().any(|c| c.dtype == dt && c.kind == AttnKind::Decode && f(c))
            };
            assert!(dec(&|c| c.kv_lens.contains(&131072) && c.geom.group() == 4), "{dt}");
            assert!(
                dec(&|c| c.kv_lens.contains(&1) && c.kv_lens.iter().any(|&l| l >= 100_000)),
                "{dt}"
            );
        }
        assert!(attention_cases_quick()
            .iter()
            .all(|c| c.kv_lens.iter().all(|&l| l <= 4097)));
    }

    /// Issue #20: prefills of 4097 and 16384 new tokens, a chunk behind a long cached prefix in
    /// a ragged batch with a 1-token sequence, in both dtypes (the quick list stays at 4097 keys:
    /// `the_full_list_has_long_and_ragged_decode`).
    #[test]
    fn the_full_list_has_long_and_chunked_prefill() {
        let full = attention_cases();
        for dt in [DType::F16, DType::Bf16] {
            let pre = |f: &dyn Fn(&AttnCase) -> bool| {
                full.iter()
                    .any(|c| c.dtype == dt && c.kind == AttnKind::Prefill && f(c))
            };
            for len in [1, 97, 4097, 16384] {
                assert!(pre(&|c| c.new_lens.contains(&len)), "{dt}: no prefill of {len} tokens");
            }
            assert!(
                pre(&|c| c.kv_lens.len() > 1
                    && c.new_lens.contains(&1)
                    && c.kv_lens.iter().zip(&c.new_lens).any(|(&k, &n)| k >= 16384 && n < k)),
                "{dt}: no chunk behind a long prefix in a ragged batch"
            );
            assert!(pre(&|c| c.new_lens.contains(&16384) && c.runs), "{dt}");
            assert!(
                pre(&|c| c.new_lens.iter().any(|&n| n > 4000) && c.force == Force::Spread),
                "{dt}"
            );
        }
    }

    /// The full list covers the tensor-core pass: every ratio of TC_RATIOS at head_dim 64, 128
    /// and 256 in both dtypes, ragged and odd kv_lens, forced recomputes of both kinds at every
    /// head_dim, and ratios 1, 4 and 8 at d256 with odd kv_lens.
    #[test]
    fn the_full_list_covers_the_tensor_core_pass() {
        let list = attention_cases();
        for dt in [DType::F16, DType::Bf16] {
            let dec: Vec<_> = list
                .iter()
                .filter(|c| c.dtype == dt && c.kind == AttnKind::Decode)
                .collect();
            for r in TC_RATIOS {
                for d in [64, 128, 256] {
                    assert!(
                        dec.iter().any(|c| c.geom.group() == r && c.geom.head_dim == d),
                        "{dt}: no ratio {r} at d{d}"
                    );
                }
            }
            for d in [64, 128, 256] {
                for f in [Force::Overflow, Force::Underflow] {
                    assert!(
                        dec.iter()
                            .any(|c| c.geom.head_dim == d && c.geom.group() > 4 && c.force == f),
                        "{dt}: no {f:?} at d{d} with more than 4 heads per group"
                    );
                }
            }
            assert!(dec.iter().any(|c| c.kv_lens.iter().any(|&l| l % 16 != 0 && l > 64)));
            for r in [1, 4, 8] {
                assert!(
                    dec.iter().any(|c| c.geom.head_dim == 256
                        && c.geom.group() == r
                        && c.kv_lens.iter().any(|&l| l % 2 == 1 && l > 16)),
                    "{dt}: no odd kv_len at d256 ratio {r}"
                );
            }
            assert!(dec.iter().any(|c| c.kv_lens.contains(&1) && c.kv_lens.len() > 1));
        }
        let quick = attention_cases_quick();
        for r in [2, 16] {
            assert!(quick.iter().any(|c| c.kind == AttnKind::Decode && c.geom.group() == r));
        }
    }

    #[test]
    fn forced_inputs_leave_the_window() {
        let SoftmaxScheme::Async { phi, a, b } = CHECK_ASYNC else {
            panic!("CHECK_ASYNC is async")
        };
        for c in attention_cases_quick().iter().filter(|c| c.force != Force::None) {
            let inp = build_inputs(c, 7).expect("inputs");
            let g = c.geom;
            let d = g.head_dim;
            let (seq, head) = match c.force {
                Force::Overflow | Force::Spread => (0, 0),
                _ => (c.kv_lens.len() - 1, g.num_heads - 1),
            };
            let qrow = match (c.kind, c.force) {
                (AttnKind::Prefill, Force::Spread) => 0,
                (AttnKind::Decode, _) => seq,
                (AttnKind::Prefill, _) => c.new_lens[..=seq].iter().sum::<usize>() - 1,
            };
            let q: Vec<f32> = inp.q[(qrow * g.num_heads + head) * d..][..d]
                .iter()
                .map(|&x| c.dtype.to_f32(x))
                .collect();
            let mut inp = inp;
            let scores: Vec<f32> = (0..c.kv_lens[seq])
                .map(|t| {
                    let k = key_at(c, &mut inp, seq, head / g.group(), t);
                    q.iter().zip(k.iter()).map(|(x, &y)| x * c.dtype.to_f32(y)).sum::<f32>() / (d as f32).sqrt()
                })
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            match c.force {
                Force::Overflow => assert!(max - phi >= b + 1.0, "{}: max {max}", c.label()),
                _ => assert!(max - phi <= a - 1.0, "{}: max {max}", c.label()),
            }
        }
    }
}
