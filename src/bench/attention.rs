//! Timing the attention variants on one configuration (`fdpp bench attention`): the sync and the
//! async softmax of FlashDecoding++ §3 and, for decode, the split-free baseline, on fresh random
//! inputs in a paged cache whose pages are scattered through the pool.
//!
//! Each variant first runs once untimed on a poisoned output: every element must be written and
//! finite, and a few sampled rows must match the f64 reference (a variant that fails is not
//! timed). That run also gives the recompute count. The timed runs are then interleaved across
//! variants and rotate over several copies of the inputs, so that a small cache is not served
//! from L2 (FlashDecoding++'s decode cases are memory-bound: a cached K/V would be timed faster
//! than the hardware can stream it).

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::backend::{Backend, BackendKind, DeviceInfo};
use crate::bench::{Stats, TimingOpts};
use crate::check::attention::attention_nmse_limit;
use crate::dtype::{random_bits, DType};
use crate::error::{FdppError, Result};
use crate::kv::paged::{BlockTable, FlatBlockTables, PageAllocator, PagedKv, PagedKvLayout};
use crate::ops::attention::{num_splits, AttnGeometry, AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};
use crate::ops::layer::KvAppendParams;
use crate::reference::attention::decode_ref;
use crate::reference::gemm::nmse;
use crate::report::attention::AttnRecord;
use crate::report::RunContext;

/// Scale of the random q and k: uniform [−s, s) gives x = q·k/√d a standard deviation of
/// s²/3 ≈ 1.5 at any head_dim, so scores stay within about ±8 even over 64k keys: the spread
/// FlashDecoding++ §3 reports for Llama2-7B ([−16.8, 6.5]), far inside the default async window.
pub const QK_SCALE: f32 = 2.1;

/// Most copies of the inputs a timed rotation cycles through.
pub const MAX_COPIES: usize = 8;

/// Share of the device memory a configuration may plan to use; the rest is left to the runtime,
/// the kernels' workspaces (split partials) and fragmentation.
pub const USABLE_MEMORY: f64 = 0.9;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AttnPhase {
    /// One new query token per sequence over its cached keys.
    #[default]
    Decode,
    /// A prompt from an empty cache, causal.
    Prefill,
}

impl AttnPhase {
    pub fn name(self) -> &'static str {
        match self {
            AttnPhase::Decode => "decode",
            AttnPhase::Prefill => "prefill",
        }
    }
}

/// What is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnVariant {
    /// Running max with rescale, split-KV chosen from the shape (the FlashDecoding baseline).
    Sync,
    /// Unified max φ, no rescale, rows leaving [a, b] recomputed (FlashDecoding++ §3).
    Async,
    /// Decode only: sync with one split per row (no split-KV), the pre-Flash-Decoding kernel.
    Naive,
}

impl AttnVariant {
    pub const ALL: [AttnVariant; 3] = [AttnVariant::Sync, AttnVariant::Async, AttnVariant::Naive];

    pub fn name(self) -> &'static str {
        match self {
            AttnVariant::Sync => "sync",
            AttnVariant::Async => "async",
            AttnVariant::Naive => "naive",
        }
    }

    /// Every variant that means something for the phase: prefill has no split-KV, so no naive.
    pub fn defaults(phase: AttnPhase) -> Vec<AttnVariant> {
        match phase {
            AttnPhase::Decode => AttnVariant::ALL.to_vec(),
            AttnPhase::Prefill => vec![AttnVariant::Sync, AttnVariant::Async],
        }
    }

    /// `--variant`: names in any case, duplicates dropped; empty means [`Self::defaults`].
    pub fn parse_list(list: &[String], phase: AttnPhase) -> Result<Vec<AttnVariant>> {
        if list.is_empty() {
            return Ok(Self::defaults(phase));
        }
        let mut out = Vec::new();
        for s in list {
            let s = s.trim().to_ascii_lowercase();
            let v = AttnVariant::ALL
                .iter()
                .copied()
                .find(|v| v.name() == s)
                .ok_or_else(|| {
                    FdppError::InvalidArgument(format!("--variant: unknown variant '{s}'; valid: sync, async, naive"))
                })?;
            if v == AttnVariant::Naive && phase == AttnPhase::Prefill {
                return Err(FdppError::InvalidArgument(
                    "--variant naive is the decode baseline without split-KV (one block per row); prefill has \
                     no splits to remove, so it runs sync and async only"
                        .into(),
                ));
            }
            if !out.contains(&v) {
                out.push(v);
            }
        }
        Ok(out)
    }

    /// The softmax scheme this variant runs (`async_scheme` for async, sync otherwise).
    pub fn scheme(self, async_scheme: SoftmaxScheme) -> SoftmaxScheme {
        match self {
            AttnVariant::Async => async_scheme,
            AttnVariant::Sync | AttnVariant::Naive => SoftmaxScheme::Sync,
        }
    }
}

/// One configuration: every sequence of the batch holds `kv_len` tokens (decode) or brings a
/// prompt of `kv_len` tokens to an empty cache (prefill).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnBenchCase {
    pub phase: AttnPhase,
    pub dtype: DType,
    pub geom: AttnGeometry,
    pub page_size: usize,
    /// Pages shuffled within aligned groups of this many pool pages, and the groups shuffled
    /// (1: every page anywhere in the pool; 0: no shuffle, each sequence's pages one after
    /// another, as a fresh engine allocates a prompt's).
    pub page_group: usize,
    pub batch: usize,
    pub kv_len: usize,
}

/// Bytes as GiB with two decimals, and the exact count.
fn gib(bytes: u128) -> String {
    format!("{:.2} GiB ({bytes} bytes)", bytes as f64 / (1u64 << 30) as f64)
}

impl AttnBenchCase {
    /// e.g. `decode b=1 kv_len=1024 h32/kv32 d128 f16 page=16` (`/N` after the page size when
    /// pages are shuffled within groups of N, `/seq` when they are in order).
    pub fn label(&self) -> String {
        format!(
            "{} b={} kv_len={} {} {} page={}{}",
            self.phase.name(),
            self.batch,
            self.kv_len,
            self.geom.label(),
            self.dtype,
            self.page_size,
            if self.page_group > 1 {
                format!("/{}", self.page_group)
            } else if self.page_group == 0 {
                "/seq".to_string()
            } else {
                String::new()
            }
        )
    }

    pub fn validate(&self) -> Result<()> {
        self.geom.validate()?;
        for (name, v) in [
            ("batch", self.batch),
            ("kv_len", self.kv_len),
            ("page_size", self.page_size),
        ] {
            if v == 0 {
                return Err(FdppError::InvalidArgument(format!(
                    "attention {}: {name} must be at least 1",
                    self.label()
                )));
            }
        }
        if self.kv_len > i32::MAX as usize {
            return Err(FdppError::InvalidArgument(format!(
                "attention {}: kv_len does not fit the kernels' i32 lengths",
                self.label()
            )));
        }
        Ok(())
    }

    /// Pages for the configuration only: ⌈kv_len / page_size⌉ per sequence.
    fn pages(&self) -> u128 {
        self.batch as u128 * self.kv_len.div_ceil(self.page_size.max(1)) as u128
    }

    /// The pool layout of the configuration.
    pub fn layout(&self) -> Result<PagedKvLayout> {
        let pages = usize::try_from(self.pages())
            .map_err(|_| FdppError::InvalidArgument(format!("attention {}: the page count overflows", self.label())))?;
        PagedKvLayout::new(
            self.page_size,
            pages,
            self.geom.num_kv_heads,
            self.geom.head_dim,
            self.dtype,
        )
    }

    /// Query rows: one per sequence (decode) or one per prompt token (prefill).
    pub fn tokens(&self) -> u128 {
        match self.phase {
            AttnPhase::Decode => self.batch as u128,
            AttnPhase::Prefill => self.batch as u128 * self.kv_len as u128,
        }
    }

    /// Bytes of one copy of the inputs: q, the K and V pools and (prefill) the new k and v.
    pub fn set_bytes(&self) -> u128 {
        let g = &self.geom;
        let es = self.dtype.size_bytes() as u128;
        let kvd = (g.num_kv_heads * g.head_dim) as u128;
        let pools = 2 * self.pages() * self.page_size as u128 * kvd;
        let q = self.tokens() * (g.num_heads * g.head_dim) as u128;
        let new_kv = match self.phase {
            AttnPhase::Decode => 0,
            AttnPhase::Prefill => 2 * self.tokens() * kvd,
        };
        (pools + q + new_kv) * es
    }

    /// Bytes of the output (one, shared by every copy).
    pub fn out_bytes(&self) -> u128 {
        self.tokens() * (self.geom.num_heads * self.geom.head_dim * self.dtype.size_bytes()) as u128
    }
}

/// How many copies of the inputs to rotate over: enough that the cycled set is at least three
/// times the last-level cache (at most [`MAX_COPIES`]), as many as fit. Refuses a configuration
/// whose single copy does not fit [`USABLE_MEMORY`] of the device, naming the bytes it needs.
/// A `memory_bytes` of 0 (unknown) skips the check. On the CPU backend the host staging copy
/// shares that memory and is counted too.
pub fn plan_copies(case: &AttnBenchCase, info: &DeviceInfo) -> Result<usize> {
    let set = case.set_bytes().max(1);
    let mut fixed = case.out_bytes();
    if info.backend == BackendKind::Cpu {
        fixed += set;
    }
    let cache = if info.l2_bytes > 0 { info.l2_bytes } else { 32 << 20 } as u128;
    let want = (3 * cache).div_ceil(set).clamp(1, MAX_COPIES as u128);
    if info.memory_bytes == 0 {
        return Ok(want as usize);
    }
    let usable = (info.memory_bytes as f64 * USABLE_MEMORY) as u128;
    if fixed + set > usable {
        return Err(FdppError::InvalidArgument(format!(
            "attention {}: needs {} of device memory for q, the K and V pools{} and the output, more than the \
             {} usable ({:.0}%) of {}'s {}; lower --batch or --kv-len",
            case.label(),
            gib(fixed + set),
            if case.phase == AttnPhase::Prefill {
                ", the new k and v"
            } else {
                ""
            },
            gib(usable),
            100.0 * USABLE_MEMORY,
            info.name,
            gib(info.memory_bytes as u128)
        )));
    }
    let fit = (usable - fixed) / set;
    Ok(want.min(fit).max(1) as usize)
}

/// The params of one call, decode or prefill.
#[derive(Clone, Debug, PartialEq)]
pub enum AttnParams {
    Decode(DecodeParams),
    Prefill(PrefillParams),
}

impl AttnParams {
    pub fn flops(&self) -> f64 {
        match self {
            AttnParams::Decode(p) => p.flops(),
            AttnParams::Prefill(p) => p.flops(),
        }
    }

    pub fn min_bytes(&self) -> f64 {
        match self {
            AttnParams::Decode(p) => p.min_bytes(),
            AttnParams::Prefill(p) => p.min_bytes(),
        }
    }

    pub fn scheme(&self) -> SoftmaxScheme {
        match self {
            AttnParams::Decode(p) => p.scheme,
            AttnParams::Prefill(p) => p.scheme,
        }
    }
}

/// One variant ready to run on one configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct VariantRun {
    pub variant: AttnVariant,
    pub params: AttnParams,
    /// The split-KV count the call uses (decode): `num_splits` as given, or
    /// [`num_splits`] of the shape and the device's compute units when left to the backend.
    pub splits: Option<usize>,
}

impl VariantRun {
    /// The same run with `splits` split-KV blocks per row (decode sync and async; the naive
    /// variant stays at one split, prefill has none).
    pub fn with_splits(mut self, splits: usize) -> Self {
        if let AttnParams::Decode(p) = &mut self.params {
            if self.variant != AttnVariant::Naive {
                p.num_splits = Some(splits);
                self.splits = Some(splits);
            }
        }
        self
    }
}

/// What the untimed run of a variant showed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Checked {
    pub stats: AttnStats,
    /// NMSE of the sampled rows against the f64 reference.
    pub nmse: f64,
}

/// One sampled output row: where it lies in the output, and its f64 reference.
struct Sample {
    at: usize,
    reference: Vec<f64>,
}

/// One copy of the inputs on the device.
struct InputSet<Buf> {
    q: Buf,
    kv: PagedKv<Buf>,
    /// Prefill: the prompt's k and v, written into the pools by every call.
    new_kv: Option<(Buf, Buf)>,
}

/// Inputs of one configuration on a backend, in [`plan_copies`] copies (one shared block table:
/// the copies differ in where they live, which is what defeats the cache).
pub struct AttnInputs<B: Backend> {
    pub case: AttnBenchCase,
    pub layout: PagedKvLayout,
    pub tables: FlatBlockTables,
    sets: Vec<InputSet<B::Buffer>>,
    out: B::Buffer,
    samples: Vec<Sample>,
    /// Prefill: the write of the prompt's k and v into a copy's cache (built once, not per
    /// timed call).
    append: Option<KvAppendParams>,
    /// The copy the next timed run uses; one cursor across variants, so that consecutive calls
    /// never read the same copy.
    cursor: usize,
}

impl<B: Backend> AttnInputs<B> {
    /// Random q, k, v (never zeros) and pools; the pages of every sequence drawn from a
    /// [`PageAllocator`] and shuffled, so that no sequence reads consecutive pages (with a
    /// `page_group` of N: shuffled within aligned groups of N pool pages, the groups shuffled,
    /// so that a sequence's pages stay scattered but come from few regions of the pool; with 0,
    /// not shuffled: each sequence reads its pages in pool order).
    pub fn new(b: &B, case: &AttnBenchCase, copies: usize, seed: u64) -> Result<Self> {
        case.validate()?;
        let layout = case.layout()?;
        let (g, dt) = (case.geom, case.dtype);
        let ids = PageAllocator::new(&layout).alloc(layout.num_pages)?;
        let rng = &mut rand::rngs::SmallRng::seed_from_u64(seed);
        let ids: Vec<u32> = if case.page_group == 0 {
            ids
        } else {
            let mut groups: Vec<Vec<u32>> = ids.chunks(case.page_group).map(<[u32]>::to_vec).collect();
            groups.shuffle(rng);
            for g in &mut groups {
                g.shuffle(rng);
            }
            groups.concat()
        };
        let per_seq = layout.pages_for(case.kv_len);
        let tables: Vec<BlockTable> = ids
            .chunks(per_seq)
            .map(|pages| BlockTable {
                pages: pages.to_vec(),
                seq_len: case.kv_len,
            })
            .collect();
        let tables = FlatBlockTables::new(&layout, &tables)?;
        let tokens = case.tokens() as usize;
        let kvd = g.num_kv_heads * g.head_dim;
        let q = random_bits(dt, tokens * g.num_heads * g.head_dim, QK_SCALE, seed ^ 1);
        let k_pool = random_bits(dt, layout.pool_elems(), QK_SCALE, seed ^ 2);
        let v_pool = random_bits(dt, layout.pool_elems(), 1.0, seed ^ 3);
        let new_kv = (case.phase == AttnPhase::Prefill).then(|| {
            (
                random_bits(dt, tokens * kvd, QK_SCALE, seed ^ 4),
                random_bits(dt, tokens * kvd, 1.0, seed ^ 5),
            )
        });
        let samples = match &new_kv {
            None => decode_samples(case, &layout, &tables, &q, (&k_pool, &v_pool))?,
            Some((k, v)) => prefill_samples(case, &q, (k, v))?,
        };
        let mut sets = Vec::with_capacity(copies.max(1));
        for _ in 0..copies.max(1) {
            sets.push(InputSet {
                q: b.upload(dt, &q)?,
                kv: PagedKv {
                    layout,
                    k: b.upload(dt, &k_pool)?,
                    v: b.upload(dt, &v_pool)?,
                },
                new_kv: match &new_kv {
                    Some((k, v)) => Some((b.upload(dt, k)?, b.upload(dt, v)?)),
                    None => None,
                },
            });
        }
        let out = b.alloc(dt, q.len())?;
        let append = (case.phase == AttnPhase::Prefill).then(|| KvAppendParams {
            tables: tables.clone(),
            new_lens: vec![case.kv_len as i32; case.batch],
        });
        Ok(AttnInputs {
            case: case.clone(),
            layout,
            tables,
            sets,
            out,
            samples,
            append,
            cursor: 0,
        })
    }

    pub fn copies(&self) -> usize {
        self.sets.len()
    }

    /// The params of `variant`; `compute_units` is what the backend chooses splits from.
    pub fn variant(&self, variant: AttnVariant, async_scheme: SoftmaxScheme, compute_units: usize) -> VariantRun {
        let c = &self.case;
        let scheme = variant.scheme(async_scheme);
        match c.phase {
            AttnPhase::Decode => {
                let given = (variant == AttnVariant::Naive).then_some(1);
                let splits = given.unwrap_or_else(|| num_splits(c.batch, c.geom.num_kv_heads, c.kv_len, compute_units));
                VariantRun {
                    variant,
                    params: AttnParams::Decode(DecodeParams {
                        geom: c.geom,
                        dtype: c.dtype,
                        scheme,
                        tables: self.tables.clone(),
                        num_splits: given,
                    }),
                    splits: Some(splits),
                }
            }
            AttnPhase::Prefill => VariantRun {
                variant,
                params: AttnParams::Prefill(PrefillParams {
                    geom: c.geom,
                    dtype: c.dtype,
                    scheme,
                    tables: self.tables.clone(),
                    new_lens: vec![c.kv_len as i32; c.batch],
                }),
                splits: None,
            },
        }
    }

    /// One call on copy `j`.
    fn run(&mut self, b: &B, p: &AttnParams, j: usize) -> Result<AttnStats> {
        let set = &mut self.sets[j];
        let out = &mut self.out;
        match (p, &set.new_kv) {
            (AttnParams::Decode(p), _) => b.attention_decode(p, &set.q, &set.kv, out),
            (AttnParams::Prefill(p), Some((k, v))) => b.attention_prefill(p, &set.q, k, v, &mut set.kv, out),
            (AttnParams::Prefill(_), None) => Err(FdppError::InvalidArgument(format!(
                "attention {}: prefill params on decode inputs",
                self.case.label()
            ))),
        }
    }

    /// One timed call on the next copy, through the enqueue entry points: a GPU backend then
    /// queues back-to-back calls without reading the recompute count back each time. A prefill
    /// attends over the new k and v [`Self::write_new_kv`] put in the copy's cache: the work an
    /// SDPA peer is timed on; the cache write is timed on its own ([`Self::append_next`]).
    fn run_next(&mut self, b: &B, p: &AttnParams) -> Result<()> {
        let j = self.cursor % self.copies();
        self.cursor = self.cursor.wrapping_add(1);
        let set = &self.sets[j];
        let out = &mut self.out;
        match p {
            AttnParams::Decode(p) => b.attention_decode_enqueue(p, &set.q, &set.kv, out),
            AttnParams::Prefill(p) => b.attention_prefill_cached_enqueue(p, &set.q, &set.kv, out),
        }
    }

    /// The append of the prompt's k and v into copy `j`'s cache (the first half of a prefill
    /// call); an error for decode inputs.
    fn append(&mut self, b: &B, j: usize) -> Result<()> {
        let set = &mut self.sets[j];
        let (Some((k, v)), Some(p)) = (&set.new_kv, &self.append) else {
            return Err(FdppError::InvalidArgument(format!(
                "attention {}: a cache write on decode inputs",
                self.case.label()
            )));
        };
        b.kv_append(p, k, v, &mut set.kv)
    }

    /// One timed cache write, on the next copy.
    fn append_next(&mut self, b: &B) -> Result<()> {
        let j = self.cursor % self.copies();
        self.cursor = self.cursor.wrapping_add(1);
        self.append(b, j)
    }

    /// Prefill: every copy's cache gets the prompt's k and v (untimed), as a prefill call's
    /// append would have written them.
    fn write_new_kv(&mut self, b: &B) -> Result<()> {
        for j in 0..self.copies() {
            self.append(b, j)?;
        }
        b.synchronize()
    }

    /// The untimed run of a diagnostic build (`hopper_diag=1|2`: the Hopper prefill without its
    /// K/V loads or its exponentials, whose output is garbage by design): run once, no reference
    /// check, no NMSE (NaN, left out of the report).
    pub fn run_unchecked(&mut self, b: &B, v: &VariantRun) -> Result<Checked> {
        let stats = self.run(b, &v.params, 0)?;
        b.synchronize()?;
        Ok(Checked { stats, nmse: f64::NAN })
    }

    /// The untimed run: output poisoned first; every element must come back finite and the
    /// sampled rows within the dtype's attention NMSE limit of the f64 reference
    /// (`WrongResult` otherwise). Returns the call's stats (the recompute count).
    pub fn check(&mut self, b: &B, v: &VariantRun) -> Result<Checked> {
        let dt = self.case.dtype;
        b.fill(&mut self.out, dt.poison())?;
        let stats = self.run(b, &v.params, 0)?;
        b.synchronize()?;
        let out = b.download(&self.out)?;
        let spec = format!("{}_{}_{}", self.case.phase.name(), v.variant.name(), dt);
        let limit = attention_nmse_limit(dt);
        let wrong = |what: String, err: f64| FdppError::WrongResult {
            spec: spec.clone(),
            shape: format!("{}{what}", self.case.label()),
            nmse: err,
            limit,
        };
        let hd = self.case.geom.num_heads * self.case.geom.head_dim;
        if let Some(i) = out.iter().position(|&x| !dt.to_f32(x).is_finite()) {
            return Err(wrong(
                format!(
                    " (output row {} head {} element {} not finite: never written?)",
                    i / hd,
                    (i % hd) / self.case.geom.head_dim,
                    i % self.case.geom.head_dim
                ),
                f64::INFINITY,
            ));
        }
        let mut got = Vec::new();
        let mut want = Vec::new();
        for s in &self.samples {
            let row = out.get(s.at..s.at + s.reference.len()).ok_or_else(|| {
                FdppError::device(
                    "attention bench",
                    format!("output of {spec} is shorter than {}", s.at + hd),
                )
            })?;
            got.extend(row.iter().map(|&x| dt.to_f32(x) as f64));
            want.extend_from_slice(&s.reference);
        }
        let err = nmse(&got, &want);
        if err.is_nan() || err > limit {
            return Err(wrong(" (sampled rows against the f64 reference)".into(), err));
        }
        Ok(Checked { stats, nmse: err })
    }

    /// Time one decode run `n` ways, interleaved as [`time_interleaved`] does, each call on the
    /// next copy; `set(i)` runs before every call of candidate i (a backend setting that makes
    /// the candidates differ: `tune::decode_pass` times the two main passes this way).
    pub fn time_settings(
        &mut self,
        b: &B,
        run: &VariantRun,
        n: usize,
        opts: TimingOpts,
        rounds: usize,
        set: &mut dyn FnMut(usize),
    ) -> Vec<Result<Stats>> {
        let t = time_interleaved(b, n, opts, rounds, &mut |i| {
            set(i);
            self.run_next(b, &run.params)
        });
        let _ = b.take_recomputed();
        t
    }

    /// Time every variant, interleaved as [`time_interleaved`] does, each run on the next copy;
    /// for a prefill also the cache write, as one more candidate (the second value).
    pub fn time(
        &mut self,
        b: &B,
        runs: &[VariantRun],
        opts: TimingOpts,
        rounds: usize,
    ) -> (Vec<Result<Stats>>, Option<Result<Stats>>) {
        let prefill = self.case.phase == AttnPhase::Prefill;
        if prefill {
            if let Err(e) = self.write_new_kv(b) {
                let fail = |e: &FdppError| FdppError::device("attention bench", format!("writing the caches: {e}"));
                return (runs.iter().map(|_| Err(fail(&e))).collect(), Some(Err(e)));
            }
        }
        let n = runs.len();
        let mut t = time_interleaved(b, n + usize::from(prefill), opts, rounds, &mut |i| match runs.get(i) {
            Some(r) => self.run_next(b, &r.params),
            None => self.append_next(b),
        });
        // The timed calls' recomputes were counted by the untimed check; drop the running total.
        let _ = b.take_recomputed();
        let append = prefill.then(|| t.pop()).flatten();
        (t, append)
    }
}

/// Reference rows of a decode: sequence 0 and the last sequence (each over its scattered pages).
fn decode_samples(
    case: &AttnBenchCase,
    layout: &PagedKvLayout,
    tables: &FlatBlockTables,
    q: &[u16],
    pools: (&[u16], &[u16]),
) -> Result<Vec<Sample>> {
    let hd = case.geom.num_heads * case.geom.head_dim;
    let mut seqs = vec![0, case.batch - 1];
    seqs.dedup();
    seqs.into_iter()
        .map(|s| {
            let p = DecodeParams {
                geom: case.geom,
                dtype: case.dtype,
                scheme: SoftmaxScheme::Sync,
                tables: FlatBlockTables::new(layout, &[tables.table(s)])?,
                num_splits: None,
            };
            let qs = &q[s * hd..(s + 1) * hd];
            p.validate(layout, qs.len(), hd, (pools.0.len(), pools.1.len()))?;
            Ok(Sample {
                at: s * hd,
                reference: decode_ref(&p, layout, qs, pools.0, pools.1),
            })
        })
        .collect()
}

/// Reference rows of a causal prefill from an empty cache: the last and the middle token of
/// sequence 0 and the last token of the last sequence. Token t attends to tokens 0..=t, which is
/// a decode over the sequence's own new k and v (laid out as one page of the prompt's length),
/// so the reference costs O(kv_len) per row instead of O(kv_len²) for the whole prefill.
fn prefill_samples(case: &AttnBenchCase, q: &[u16], new_kv: (&[u16], &[u16])) -> Result<Vec<Sample>> {
    let g = case.geom;
    let (n, hd, kvd) = (case.kv_len, g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim);
    let one_page = PagedKvLayout::new(n, 1, g.num_kv_heads, g.head_dim, case.dtype)?;
    let mut picks = vec![(0, n - 1), (0, n / 2), (case.batch - 1, n - 1)];
    picks.sort_unstable();
    picks.dedup();
    picks
        .into_iter()
        .map(|(s, t)| {
            let (k, v) = (&new_kv.0[s * n * kvd..][..n * kvd], &new_kv.1[s * n * kvd..][..n * kvd]);
            let table = BlockTable {
                pages: vec![0],
                seq_len: t + 1,
            };
            let p = DecodeParams {
                geom: g,
                dtype: case.dtype,
                scheme: SoftmaxScheme::Sync,
                tables: FlatBlockTables::new(&one_page, &[table])?,
                num_splits: None,
            };
            let row = s * n + t;
            let qs = &q[row * hd..(row + 1) * hd];
            p.validate(&one_page, qs.len(), hd, (k.len(), v.len()))?;
            Ok(Sample {
                at: row * hd,
                reference: decode_ref(&p, &one_page, qs, k, v),
            })
        })
        .collect()
}

/// Time `n` candidates, `run(i)` being one call of candidate i: warm-up each, then `rounds`
/// rounds in each of which every candidate runs its share of `opts.reps` back to back, in a new
/// seeded order per round. The policy of [`crate::bench::GemmInputs::time_interleaved`]: a
/// transient slowdown of the device lands on every candidate alike, and no candidate always
/// follows the same one, so ratios measured in one run stay fair. One result per candidate; a
/// candidate whose call fails keeps its error and is not run again.
pub fn time_interleaved<B: Backend>(
    b: &B,
    n: usize,
    opts: TimingOpts,
    rounds: usize,
    run: &mut dyn FnMut(usize) -> Result<()>,
) -> Vec<Result<Stats>> {
    let reps = opts.reps.max(1);
    let rounds = rounds.clamp(1, reps);
    let per_round = reps.div_ceil(rounds);
    let mut out: Vec<Result<Vec<f64>>> = (0..n).map(|_| Ok(Vec::new())).collect();
    for (i, slot) in out.iter_mut().enumerate() {
        for _ in 0..opts.warmup {
            if let Err(e) = run(i) {
                *slot = Err(e);
                break;
            }
        }
    }
    for r in 0..rounds {
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(0xa77e ^ r as u64));
        for i in order {
            let Ok(samples) = &mut out[i] else { continue };
            match b.time_each(per_round, &mut |_| run(i)) {
                Ok(ms) => samples.extend(ms),
                Err(e) => out[i] = Err(e),
            }
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.and_then(|ms| {
                Stats::from_ms(&ms)
                    .ok_or_else(|| FdppError::device("timer", format!("candidate {i}: no timed runs came back")))
            })
        })
        .collect()
}

/// The report row of one timed variant.
pub fn attention_record(
    ctx: &RunContext,
    case: &AttnBenchCase,
    v: &VariantRun,
    checked: &Checked,
    stats: Stats,
) -> AttnRecord {
    let secs = stats.median_us * 1e-6;
    let (bytes, flops) = (v.params.min_bytes(), v.params.flops());
    let rows = checked.stats.rows;
    AttnRecord {
        fdpp_version: ctx.build.fdpp_version.clone(),
        git_commit: ctx.build.git_commit.clone(),
        device: ctx.device.clone(),
        backend: ctx.backend.clone(),
        phase: case.phase.name().into(),
        dtype: case.dtype.name().into(),
        heads: case.geom.num_heads,
        kv_heads: case.geom.num_kv_heads,
        head_dim: case.geom.head_dim,
        page_size: case.page_size,
        batch: case.batch,
        kv_len: case.kv_len,
        variant: v.variant.name().into(),
        scheme: v.params.scheme().label(),
        // What the backend chose (it may size splits from its kernel's occupancy), else the
        // variant's count.
        splits: if checked.stats.splits > 0 {
            Some(checked.stats.splits)
        } else {
            v.splits
        },
        samples: stats.samples,
        median_us: stats.median_us,
        min_us: stats.min_us,
        max_us: stats.max_us,
        bytes,
        flops,
        tbps: bytes / secs / 1e12,
        tflops: flops / secs / 1e12,
        roofline_pct: None,
        roofline: String::new(),
        rows: Some(rows),
        recomputed: Some(checked.stats.recomputed),
        recompute_rate: (rows > 0).then(|| checked.stats.recomputed as f64 / rows as f64),
        nmse: Some(checked.nmse).filter(|e| !e.is_nan()),
        speedup_vs_sync: None,
        speedup_vs_sdpa: None,
        append_us: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    fn case(phase: AttnPhase, batch: usize, kv_len: usize) -> AttnBenchCase {
        AttnBenchCase {
            phase,
            dtype: DType::F16,
            geom: AttnGeometry::new(4, 2, 64).unwrap(),
            page_size: 16,
            page_group: 1,
            batch,
            kv_len,
        }
    }

    fn device(memory_bytes: u64, l2_bytes: u64) -> DeviceInfo {
        DeviceInfo {
            backend: BackendKind::Cuda,
            ordinal: 0,
            name: "Test GPU".into(),
            slug: "test-gpu".into(),
            arch: "sm_90".into(),
            compute_units: 132,
            memory_bytes,
            l2_bytes,
            driver_version: None,
            runtime_version: None,
        }
    }

    #[test]
    fn variant_lists_parse_and_refuse_with_the_valid_names() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            AttnVariant::parse_list(&[], AttnPhase::Decode).unwrap(),
            AttnVariant::ALL
        );
        assert_eq!(
            AttnVariant::parse_list(&[], AttnPhase::Prefill).unwrap(),
            [AttnVariant::Sync, AttnVariant::Async]
        );
        assert_eq!(
            AttnVariant::parse_list(&s(&["Async", "sync", "async"]), AttnPhase::Decode).unwrap(),
            [AttnVariant::Async, AttnVariant::Sync]
        );
        let e = AttnVariant::parse_list(&s(&["flash"]), AttnPhase::Decode).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown variant 'flash'; valid: sync, async, naive"),
            "{e}"
        );
        let e = AttnVariant::parse_list(&s(&["naive"]), AttnPhase::Prefill).unwrap_err();
        assert!(e.to_string().contains("prefill has no splits"), "{e}");
    }

    #[test]
    fn sizes_count_the_pools_for_the_configuration_only() {
        // 2 sequences × ⌈97/16⌉ = 7 pages × 16 slots × 2 kv heads × 64, K and V, 2 bytes; q 2 × 4 × 64.
        let c = case(AttnPhase::Decode, 2, 97);
        assert_eq!(c.layout().unwrap().num_pages, 14);
        assert_eq!(c.set_bytes(), (2 * 14 * 16 * 128 + 2 * 256) * 2);
        assert_eq!(c.out_bytes(), 2 * 256 * 2);
        let p = case(AttnPhase::Prefill, 1, 97);
        assert_eq!(p.tokens(), 97);
        assert_eq!(p.set_bytes(), (2 * 7 * 16 * 128 + 97 * 256 + 2 * 97 * 128) * 2);
    }

    #[test]
    fn copies_defeat_the_cache_and_refuse_what_does_not_fit() {
        let c = case(AttnPhase::Decode, 2, 97);
        assert_eq!(plan_copies(&c, &device(80 << 30, 50 << 20)).unwrap(), MAX_COPIES);
        // 32 heads d128, batch 1, 16k tokens: 2 × 16384 × 4096 × 2 = 256 MiB of K and V, one copy
        // already beats a 50 MB L2 three times over.
        let big = AttnBenchCase {
            geom: AttnGeometry::new(32, 32, 128).unwrap(),
            batch: 1,
            kv_len: 16384,
            ..c.clone()
        };
        assert_eq!(plan_copies(&big, &device(80 << 30, 50 << 20)).unwrap(), 1);
        // 1k tokens: 16 MiB per copy, 150 MB to cover → 9 wanted, 8 at most.
        let small = AttnBenchCase {
            kv_len: 1024,
            ..big.clone()
        };
        assert_eq!(plan_copies(&small, &device(80 << 30, 50 << 20)).unwrap(), 8);
        // Only 3 copies fit in 64 MiB · 0.9.
        assert_eq!(plan_copies(&small, &device(64 << 20, 50 << 20)).unwrap(), 3);
        let huge = AttnBenchCase {
            batch: 64,
            kv_len: 1 << 20,
            ..big
        };
        let e = plan_copies(&huge, &device(80 << 30, 50 << 20)).unwrap_err().to_string();
        assert!(
            e.contains("b=64 kv_len=1048576") && e.contains("needs 1024.00 GiB (1099512676352 bytes)"),
            "{e}"
        );
        assert!(e.contains("Test GPU") && e.contains("lower --batch or --kv-len"), "{e}");
        // Unknown memory: no refusal.
        assert_eq!(plan_copies(&huge, &device(0, 50 << 20)).unwrap(), 1);
    }

    #[test]
    fn pages_are_scattered_and_the_naive_variant_has_one_split() {
        let b = CpuBackend::new();
        let c = case(AttnPhase::Decode, 2, 300);
        let inp = AttnInputs::new(&b, &c, 2, 7).unwrap();
        assert_eq!(inp.copies(), 2);
        let used: Vec<i32> = inp.tables.block_table.clone();
        assert_eq!(used.len(), 2 * 19);
        let identity: Vec<i32> = (0..38).collect();
        assert_ne!(used, identity, "pages must not be handed out in order");
        let mut sorted = used.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, identity, "every page used once");
        let naive = inp.variant(AttnVariant::Naive, SoftmaxScheme::ASYNC_DEFAULT, 132);
        assert_eq!(naive.splits, Some(1));
        let AttnParams::Decode(p) = &naive.params else {
            panic!("decode params")
        };
        assert_eq!((p.num_splits, p.scheme), (Some(1), SoftmaxScheme::Sync));
        let sync = inp.variant(AttnVariant::Sync, SoftmaxScheme::ASYNC_DEFAULT, 132);
        assert_eq!(sync.splits, Some(num_splits(2, 2, 300, 132)));
        let asy = inp.variant(AttnVariant::Async, SoftmaxScheme::ASYNC_DEFAULT, 132);
        let forced = asy.clone().with_splits(5);
        assert_eq!(forced.splits, Some(5));
        assert!(matches!(&forced.params, AttnParams::Decode(p) if p.num_splits == Some(5)));
        let naive_forced = inp
            .variant(AttnVariant::Naive, SoftmaxScheme::ASYNC_DEFAULT, 132)
            .with_splits(5);
        assert_eq!(naive_forced.splits, Some(1), "naive keeps one split");
        assert_eq!(asy.params.scheme(), SoftmaxScheme::ASYNC_DEFAULT);
    }

    #[test]
    fn page_groups_keep_their_pages_together_and_scatter_them_inside() {
        let b = CpuBackend::new();
        let c = AttnBenchCase {
            page_group: 4,
            ..case(AttnPhase::Decode, 2, 300)
        };
        assert!(c.label().ends_with("page=16/4"), "{}", c.label());
        let inp = AttnInputs::new(&b, &c, 1, 7).unwrap();
        let used = inp.tables.block_table.clone();
        let mut sorted = used.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..38).collect::<Vec<i32>>(), "every page used once");
        // Each aligned group of 4 pool pages (the last one has 2) is one stretch of the tables,
        // in shuffled order inside.
        let mut groups: Vec<i32> = used.iter().map(|p| p / 4).collect();
        groups.dedup();
        assert_eq!(groups.len(), 10, "{used:?}");
        groups.sort_unstable();
        groups.dedup();
        assert_eq!(groups.len(), 10, "a group split over two stretches: {used:?}");
        assert!(
            used.windows(2).any(|w| w[0] / 4 == w[1] / 4 && w[1] != w[0] + 1),
            "{used:?}"
        );
        // 0: in order, every sequence's pages consecutive.
        let seq = AttnBenchCase { page_group: 0, ..c };
        assert!(seq.label().ends_with("page=16/seq"), "{}", seq.label());
        let inp = AttnInputs::new(&b, &seq, 1, 7).unwrap();
        let used = inp.tables.block_table.clone();
        assert!(used.windows(2).all(|w| w[1] == w[0] + 1), "{used:?}");
    }

    #[test]
    fn every_variant_checks_against_the_reference_and_a_wrong_one_is_caught() {
        let b = CpuBackend::new();
        for phase in [AttnPhase::Decode, AttnPhase::Prefill] {
            let c = case(phase, 2, 97);
            let mut inp = AttnInputs::new(&b, &c, 1, rand::random()).unwrap();
            for v in AttnVariant::defaults(phase) {
                let run = inp.variant(v, SoftmaxScheme::ASYNC_DEFAULT, 4);
                let got = inp.check(&b, &run).unwrap();
                let rows = c.tokens() as usize * 4;
                assert_eq!(got.stats.rows, rows, "{phase:?} {v:?}");
                assert_eq!(got.stats.recomputed, 0, "{phase:?} {v:?}");
                assert!(
                    got.nmse < attention_nmse_limit(DType::F16),
                    "{phase:?} {v:?}: {}",
                    got.nmse
                );
            }
            // Corrupt a sampled row's reference: the same output must now be refused.
            inp.samples[0].reference.iter_mut().for_each(|r| *r = -*r + 0.5);
            let run = inp.variant(AttnVariant::Sync, SoftmaxScheme::ASYNC_DEFAULT, 4);
            let e = inp.check(&b, &run).unwrap_err();
            assert!(
                matches!(e, FdppError::WrongResult { .. }) && e.to_string().contains("f64 reference"),
                "{e}"
            );
        }
    }

    #[test]
    fn interleaved_timing_gives_every_candidate_its_reps_and_keeps_errors() {
        let b = CpuBackend::new();
        let mut calls = [0usize; 3];
        let got = time_interleaved(&b, 3, TimingOpts { warmup: 2, reps: 7 }, 3, &mut |i| {
            calls[i] += 1;
            if i == 2 && calls[i] > 3 {
                return Err(FdppError::InvalidArgument("boom".into()));
            }
            Ok(())
        });
        // 7 reps over 3 rounds: 3 per round, 9 timed runs.
        assert_eq!(got[0].as_ref().unwrap().samples, 9);
        assert_eq!(got[1].as_ref().unwrap().samples, 9);
        assert!(got[2].as_ref().is_err_and(|e| e.to_string().contains("boom")));
        assert_eq!(calls[0], 2 + 9);
    }
}
