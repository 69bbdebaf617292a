//! Launching the Hopper causal prefill (kernels_cuda/attn_prefill_hopper.cu: wgmma, a producer
//! warpgroup and two consumer warpgroups, FlashAttention-3's shape) and choosing between it and
//! the mma.sync kernel of attn_prefill.cu.
//!
//! The two kernels take the same tiles (the Hopper one as a list of its blocks) and have the same
//! semantics; `prefill` in attention.rs appends the new K and V to the cache, then asks
//! [`wanted`] which one attends.
//! `FDPP_PREFILL=mma` forces the mma.sync kernel, `FDPP_PREFILL=hopper` the Hopper one for every
//! head_dim it is built for (an error on other devices), for A/B comparisons in one build.
//! `FDPP_HOPPER_TMA=0` loads every K/V tile with cp.async instead of TMA (tma.rs), for the same
//! kind of comparison.

use super::attention::{launch_prefill, HopperArgs, PrefillKernel};
use super::sources::attn_prefill_hopper_source;
use super::tma::{q_tma_wanted, query_map, PoolMaps, TmaMap};
use super::{CudaBackend, CudaBuffer};
use crate::backend::Backend;
use crate::error::{FdppError, Result};
use crate::kv::paged::FlatBlockTables;
use crate::kv::PagedKv;
use crate::ops::attention::PrefillParams;
use crate::run_config::Key;

/// head_dims the Hopper kernel is built for (other head_dims use attn_prefill.cu).
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// The compile-time schedule of the kernel: K/V stages of the producer's ring (FDPP_STAGES) and
/// whether a consumer overlaps the softmax of a tile with P·V of the previous one (FDPP_OVERLAP,
/// FlashAttention-3 §3.2), and whether the two consumer warpgroups take turns issuing their GEMMs
/// (FDPP_PINGPONG, FA3 §3.1). `FDPP_HOPPER_STAGES=2|3`, `FDPP_HOPPER_OVERLAP=0|1` and
/// `FDPP_HOPPER_PINGPONG=0|1` pick another one for measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub stages: usize,
    pub overlap: bool,
    /// FA3 §3.1's ping-pong of the two consumer warpgroups (FDPP_PINGPONG; needs `overlap`).
    pub pingpong: bool,
    /// A whole key tile of consecutive pages comes as one TMA box (FDPP_RUN_BOXES;
    /// tma.rs's `k_run`/`v_run`). Compiled only into the schedule the host picks where such tiles
    /// dominate ([`Schedule::RUNS`]): in [`Schedule::DEFAULT`] the per-tile test cost 5 % with
    /// scattered pages (sync, 1 · 4096 and 1 · 16384, H100, session 19).
    pub runs: bool,
    /// Measurement-only diagnostics (FDPP_DIAG, `FDPP_HOPPER_DIAG=1|2|3`): 1 = no K/V copies,
    /// 2 = no exponentials (the results are garbage); 3 = a per-block timeline the kernel records
    /// and [`attend`] appends to a file (results correct; ~1 % slower, and a synchronisation after
    /// every launch). Never a default.
    pub diag: u8,
    /// A persistent kernel (FDPP_PERSIST, [`persistent`]): one block per SM walks the block
    /// list, the producer loading the next block's Q and first K/V tiles under the current one's
    /// end (FA3 §3.1's persistent scheduler); under async, a block the vote flags is walked
    /// again after the next one.
    pub persist: bool,
}

impl Schedule {
    /// Two stages, one tile at a time per consumer warpgroup (the two warpgroups still overlap
    /// each other). Session 4 made three stages with FA3's overlap and ping-pong the default
    /// (372 / 495 TFLOP/s sync at 4k / 16k against 334 / 440); since K and V come by TMA and
    /// the descriptors are computed in the uniform datapath, this one measured 387–389 / 503
    /// sync and 389–391 / 508–513 async against 373–376 / 482–489 and 368–370 / 480–488 for
    /// s3o1p1, three interleaved rounds in one call (reports/NOTES.md, session 7).
    pub const DEFAULT: Schedule = Schedule {
        stages: 2,
        overlap: false,
        pingpong: false,
        runs: false,
        diag: 0,
        persist: false,
    };

    /// The default where most key tiles come as one TMA box (pages of 128 slots
    /// or more, or smaller pages that follow one another in the pool, [`run_share`]): three
    /// stages, the softmax overlapped with P·V (FA3 §3.2) and the ping-pong (§3.1). Measured on
    /// an H100 (reports/NOTES.md, session 19), pages of 128, sync: 608 TFLOP/s at 1 · 16384
    /// against 531 for [`Schedule::DEFAULT`]; with pages of 16 boxed one by one it is the slower
    /// one (489 against 517), its consumers then waiting on "K full" for the boxes of a tile
    /// (session 37: pages in pool order but boxed per page are as slow as scattered ones; a
    /// box then held one column block, 32 a tile at d128, now both: 16).
    /// `hopper_runs=0|1` overrides the choice.
    pub const RUNS: Schedule = Schedule {
        runs: true,
        ..Schedule::new(3, true, true)
    };

    /// Every schedule `fdpp kernels check` compiles.
    pub const ALL: [Schedule; 9] = [
        Schedule::DEFAULT.persistent(),
        Schedule::RUNS.persistent(),
        Schedule::DEFAULT,
        Schedule::RUNS,
        Schedule::new(3, true, true),
        Schedule::new(2, true, false),
        Schedule::new(3, false, false),
        Schedule::new(3, true, false),
        Schedule::new(2, true, true),
    ];

    pub const fn new(stages: usize, overlap: bool, pingpong: bool) -> Self {
        Schedule {
            stages,
            overlap,
            pingpong,
            runs: false,
            diag: 0,
            persist: false,
        }
    }

    /// This schedule as the persistent kernel.
    pub const fn persistent(self) -> Self {
        Schedule { persist: true, ..self }
    }

    /// Q tiles in shared memory (the kernel's QBUF): two for the persistent kernel where they
    /// fit the 227 KiB an sm_90a block may opt into, else one.
    pub fn q_buffers(&self, head_dim: usize) -> usize {
        if self.persist && smem_for(head_dim, self.stages, 2) <= 227 << 10 {
            2
        } else {
            1
        }
    }

    /// Dynamic shared memory of a block of this schedule.
    pub fn smem(&self, head_dim: usize) -> u32 {
        smem_for(head_dim, self.stages, self.q_buffers(head_dim))
    }

    /// The URI suffix, e.g. `s3o1p1` (`-diagN` appended for the measurement-only variants).
    pub fn tag(&self) -> String {
        let mut t = format!(
            "s{}o{}p{}",
            self.stages,
            u8::from(self.overlap),
            u8::from(self.pingpong)
        );
        if self.runs {
            t.push('r');
        }
        if self.persist {
            t.push_str("-persist");
        }
        if self.diag != 0 {
            t.push_str(&format!("-diag{}", self.diag));
        }
        t
    }

    fn parse(base: Schedule, stages: Option<&str>, overlap: Option<&str>, pingpong: Option<&str>) -> Result<Self> {
        let mut v = base;
        if let Some(s) = stages.map(str::trim).filter(|s| !s.is_empty()) {
            v.stages = match s {
                "2" => 2,
                "3" => 3,
                o => {
                    return Err(FdppError::InvalidArgument(format!(
                        "FDPP_HOPPER_STAGES={o}: expected 2 or 3"
                    )))
                }
            };
        }
        let flag = |name: &str, v: Option<&str>, dflt: bool| -> Result<bool> {
            match v.map(str::trim).filter(|s| !s.is_empty()) {
                None => Ok(dflt),
                Some("0") => Ok(false),
                Some("1") => Ok(true),
                Some(o) => Err(FdppError::InvalidArgument(format!("{name}={o}: expected 0 or 1"))),
            }
        };
        v.overlap = flag("FDPP_HOPPER_OVERLAP", overlap, v.overlap)?;
        // The default ping-pong needs the overlap: turning the overlap off turns it off too,
        // unless it is asked for explicitly (then the combination is refused below).
        v.pingpong = flag("FDPP_HOPPER_PINGPONG", pingpong, v.pingpong && v.overlap)?;
        if v.pingpong && !v.overlap {
            return Err(FdppError::InvalidArgument(
                "FDPP_HOPPER_PINGPONG=1 needs FDPP_HOPPER_OVERLAP=1".into(),
            ));
        }
        Ok(v)
    }

    /// `FDPP_HOPPER_DIAG=0|1|2|3` on top of [`Schedule::parse`].
    fn parse_diag(mut self, diag: Option<&str>) -> Result<Self> {
        self.diag = match diag.map(str::trim).filter(|s| !s.is_empty()) {
            None | Some("0") => 0,
            Some("1") => 1,
            Some("2") => 2,
            Some("3") => 3,
            Some(o) => {
                return Err(FdppError::InvalidArgument(format!(
                    "FDPP_HOPPER_DIAG={o}: expected 0, 1, 2 or 3"
                )))
            }
        };
        Ok(self)
    }

    /// From the run configuration: `--set hopper_stages=…` etc., else the FDPP_* variables,
    /// each switch left unset keeping `base`'s. (Read from the environment alone before session
    /// 15, which silently ignored the flags.)
    fn from_env(base: Schedule) -> Result<Self> {
        let rc = crate::run_config::get();
        Schedule::parse(
            base,
            rc.get(Key::HopperStages),
            rc.get(Key::HopperOverlap),
            rc.get(Key::HopperPingpong),
        )?
        .parse_diag(rc.get(Key::HopperDiag))
    }
}
/// Query rows per block (two consumer warpgroups of 64) and keys per tile (the kernel's BM, BN).
pub const BM: usize = 128;
pub const BN: usize = 128;
/// A producer warpgroup and two consumer warpgroups.
const THREADS: u32 = 384;
/// The arch the kernel is compiled for.
pub const ARCH: &str = "sm_90a";
/// Whether the Hopper kernel attends by default on sm_90a (when FDPP_PREFILL is unset): it passes
/// `fdpp check` and ran 2.2× / 2.8× / 2.9× the mma.sync kernel at 1k / 4k / 16k tokens on an H100
/// (reports/NOTES.md, "Attention prefill").
pub const DEFAULT_ON: bool = true;

/// Dynamic shared memory of a block: Q [BM, D], `stages` × (K and V [BN, D]), 256 bytes of
/// mbarriers and words, and 1024 bytes of slack to align the swizzle atoms.
pub fn smem_bytes(head_dim: usize, stages: usize) -> u32 {
    smem_for(head_dim, stages, 1)
}

/// [`smem_bytes`] with `q_buffers` Q tiles (the persistent kernel's QBUF).
fn smem_for(head_dim: usize, stages: usize, q_buffers: usize) -> u32 {
    ((q_buffers * BM * head_dim + 2 * stages * BN * head_dim) * 2 + 256 + 1024) as u32
}

/// An `auto|0|1` switch of the Hopper prefill: `prefill_persist` (FDPP_PREFILL_PERSIST: whether
/// the persistent kernel runs, [`persistent`]) and `hopper_runs` (FDPP_HOPPER_RUNS: whether the
/// run-box schedule does, [`attend`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutoSwitch {
    Auto,
    Off,
    On,
}

impl AutoSwitch {
    /// The value `v` of switch `name` (unset or empty: auto).
    pub fn parse(name: &str, v: Option<&str>) -> Result<Self> {
        match v.map(str::trim) {
            None | Some("") | Some("auto") => Ok(AutoSwitch::Auto),
            Some("0") => Ok(AutoSwitch::Off),
            Some("1") => Ok(AutoSwitch::On),
            Some(o) => Err(FdppError::InvalidArgument(format!("{name}={o}: expected auto, 0 or 1"))),
        }
    }
}

/// Under `auto`, a sync prefill runs persistent while no sequence attends over more keys than
/// this.
pub const PERSIST_AUTO_KEYS: usize = 8192;

/// The same bound for an async prefill.
pub const PERSIST_AUTO_KEYS_ASYNC: usize = 4096;

/// Whether the prefill runs the persistent kernel. Its producer loads Q by TMA, and it records no
/// timeline (`hopper_diag=3`). Under `auto`, while `max_keys` ≤ [`PERSIST_AUTO_KEYS`] (sync) or
/// [`PERSIST_AUTO_KEYS_ASYNC`]: there it hides the start of a short block under the previous
/// one's end. Sync measured 1.04-1.18× one block per tile at batch 8 · 1024 and up to 1.08× at
/// 4096; at 16384 level with pages of 128 (d128), 2-4 % slower with pages of 16 and at d64
/// (sessions 24-25). Async measured 1.08-1.14× at 8 · 1024, 1.03-1.05× at 8 · 2048, 1.00-1.10×
/// at 8 · 4096 (+1 % on average over 40 runs of one call, where that point moves ±5 % from run
/// to run), level at batch 1 up to 4096, and 2-7 % slower from 8192 keys on (H100,
/// reports/NOTES.md, sessions 25-26).
/// Forced on with Q by cp.async it is an error naming both switches; a trace under `1` quietly
/// runs one block per tile.
pub fn persistent(choice: AutoSwitch, sync: bool, q_tma: bool, sched: &Schedule, max_keys: usize) -> Result<bool> {
    if choice == AutoSwitch::On && !q_tma {
        return Err(FdppError::InvalidArgument(
            "prefill_persist=1 needs hopper_q_tma=1: the persistent kernel's producer loads every block's Q by TMA"
                .into(),
        ));
    }
    let able = q_tma && sched.diag != 3;
    let bound = if sync {
        PERSIST_AUTO_KEYS
    } else {
        PERSIST_AUTO_KEYS_ASYNC
    };
    Ok(able
        && match choice {
            AutoSwitch::Off => false,
            AutoSwitch::On => true,
            AutoSwitch::Auto => max_keys <= bound,
        })
}

/// Which prefill kernel `FDPP_PREFILL` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Unset: the Hopper kernel where it runs and [`DEFAULT_ON`], else mma.sync.
    Default,
    Mma,
    Hopper,
}

impl Choice {
    pub fn parse(v: Option<&str>) -> Result<Self> {
        match v.map(str::trim) {
            None | Some("") => Ok(Choice::Default),
            Some("mma") => Ok(Choice::Mma),
            Some("hopper") => Ok(Choice::Hopper),
            Some(o) => Err(FdppError::InvalidArgument(format!(
                "FDPP_PREFILL={o}: expected `mma` or `hopper`"
            ))),
        }
    }

    /// From the run configuration: `--set prefill=…`, else FDPP_PREFILL.
    fn from_env() -> Result<Self> {
        Choice::parse(crate::run_config::get().get(Key::Prefill))
    }
}

/// Whether the Hopper kernel attends: `arch` the device's, `smem_limit` its opt-in shared memory
/// per block. A forced `hopper` on a device where it cannot run is an error, not a silent
/// fallback; head_dims it is not built for (256) stay on the mma.sync kernel even when forced, so
/// that a forced `fdpp check` covers every case.
pub fn decide(choice: Choice, arch: &str, head_dim: usize, smem_limit: u32) -> Result<bool> {
    let device = arch == ARCH && smem_bytes(128, Schedule::DEFAULT.stages) <= smem_limit;
    let shape = HEAD_DIMS.contains(&head_dim);
    match choice {
        Choice::Mma => Ok(false),
        Choice::Default => Ok(DEFAULT_ON && device && shape),
        Choice::Hopper if device => Ok(shape),
        Choice::Hopper => Err(FdppError::Unsupported {
            spec: format!("attn_prefill_hopper_d{head_dim}"),
            what: format!(
                "FDPP_PREFILL=hopper on {arch} (needs {ARCH} and {} KiB of shared memory per block)",
                smem_bytes(128, Schedule::DEFAULT.stages) >> 10
            ),
        }),
    }
}

/// Whether this prefill goes to the Hopper kernel on `b`.
/// With FDPP_PREFILL set, the first decision of the process is printed to stderr, so that an
/// A/B measurement shows which kernel it measured.
pub fn wanted(b: &CudaBackend, p: &PrefillParams) -> Result<bool> {
    let choice = Choice::from_env()?;
    let arch = &b.info().arch;
    let hopper = decide(choice, arch, p.geom.head_dim, b.max_smem_per_block())?;
    static SAID: std::sync::Once = std::sync::Once::new();
    if choice != Choice::Default {
        SAID.call_once(|| {
            let tag = |base: Schedule| Schedule::from_env(base).map(|s| s.tag()).unwrap_or_default();
            let sched = format!(
                "{} (scattered pages) or {} (tiles of consecutive pages)",
                tag(Schedule::DEFAULT),
                tag(Schedule::RUNS)
            );
            eprintln!(
                "fdpp: FDPP_PREFILL={choice:?} on {arch}, head_dim {}: {}",
                p.geom.head_dim,
                if hopper {
                    format!("attn_prefill_hopper ({sched})")
                } else {
                    "attn_prefill (mma.sync)".to_string()
                }
            )
        });
    }
    Ok(hopper)
}

/// Attend with the Hopper kernel (the new K and V are already in the cache); returns the rows
/// the async scheme recomputed when `counting`, else 0.
pub fn attend(
    b: &CudaBackend,
    p: &PrefillParams,
    q: &CudaBuffer,
    kv: &PagedKv<CudaBuffer>,
    out: &mut CudaBuffer,
    counting: bool,
) -> Result<usize> {
    let d = p.geom.head_dim;
    let fits = smem_bytes(d, Schedule::RUNS.stages) <= b.max_smem_per_block();
    let runs = match AutoSwitch::parse("hopper_runs", crate::run_config::get().get(Key::HopperRuns))? {
        AutoSwitch::Auto => run_share(&p.tables, kv.layout.page_size) >= 0.5,
        AutoSwitch::On => true,
        AutoSwitch::Off => false,
    };
    let base = if fits && runs {
        Schedule::RUNS
    } else {
        Schedule::DEFAULT
    };
    let mut sched = Schedule::from_env(base)?;
    let q_tma = q_tma_wanted()?;
    let max_keys = p.spans().iter().map(|&(_, prefix, n)| prefix + n).max().unwrap_or(0);
    sched.persist = persistent(
        AutoSwitch::parse("prefill_persist", crate::run_config::get().get(Key::PrefillPersist))?,
        matches!(p.scheme, crate::ops::attention::SoftmaxScheme::Sync),
        q_tma,
        &sched,
        max_keys,
    )?;
    let src = || Ok(attn_prefill_hopper_source(p.dtype, d, sched));
    let maps = PoolMaps::new(&kv.layout, b.ptr(&kv.k), b.ptr(&kv.v), sched.runs)?;
    let hopper = HopperArgs {
        pool: &maps,
        q: if q_tma {
            query_map(b.ptr(q), p.tokens(), p.geom.num_heads, d)?
        } else {
            TmaMap::NONE
        },
        q_tma: i32::from(q_tma),
        entry_ahead: crate::backend::attn_plan::prefill_entry_ahead(b.info().compute_units as usize)?,
        persistent_grid: if sched.persist {
            Some(b.info().compute_units)
        } else {
            None
        },
    };
    let recomputed = launch_prefill(
        b,
        p,
        q,
        kv,
        out,
        counting,
        &PrefillKernel {
            uri: format!("attn_prefill_hopper_{}_d{d}_{}", p.dtype, sched.tag()),
            source: &src,
            entries: ["attn_prefill_hopper_sync", "attn_prefill_hopper_async"],
            threads: THREADS,
            tile_rows: BM,
            smem: sched.smem(d),
            hopper: Some(&hopper),
        },
    )?;
    if sched.diag == 3 {
        dump_trace(b, &src()?)?;
    }
    Ok(recomputed)
}

/// `hopper_diag=3`: append the launch's timeline records (the kernel's `fdpp_trace`, eleven words
/// per consumer warpgroup and block; the kernel's FDPP_DIAG comment) to the file named by
/// FDPP_HOPPER_TRACE_OUT (default `prefill-trace.tsv`) as tab-separated lines, then clear them
/// for the next launch (`scripts/prefill_trace.py` summarises the file). Blocks past the kernel's
/// TRACE_CAP / 2 (16384) are not recorded.
/// Measurement only: it synchronises after every launch.
fn dump_trace(b: &CudaBackend, src: &super::sources::KernelSource) -> Result<()> {
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static LAUNCH: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::var("FDPP_HOPPER_TRACE_OUT").unwrap_or_else(|_| "prefill-trace.tsv".into());
    let fail = |e: &dyn std::fmt::Debug| FdppError::device("cuda", format!("hopper_diag=3 trace ({path}): {e:?}"));
    let module = b.module(src)?;
    let mut g = module.get_global("fdpp_trace", b.stream()).map_err(|e| fail(&e))?;
    let bytes: Vec<u8> = b.stream().clone_dtoh(&g).map_err(|e| fail(&e))?;
    b.stream().memset_zeros(&mut g).map_err(|e| fail(&e))?;
    let launch = LAUNCH.fetch_add(1, Ordering::Relaxed);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| fail(&e))?;
    let mut text = String::new();
    for rec in bytes.chunks_exact(88) {
        let w: Vec<u64> = rec
            .chunks_exact(8)
            .map(|x| u64::from_le_bytes(x.try_into().unwrap_or([0; 8])))
            .collect();
        if w[0] >> 56 != 1 {
            continue;
        }
        // launch block sm wg tiles head pos0 t_global, then SM clocks from entry: Q in, the
        // first K request, first K in, walk done, stored, the producer's page ids in, block
        // entry in, block entry asked for (signed: the producer's readings are its own warp's
        // of the same SM counter).
        text.push_str(&format!(
            "{launch}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            w[0] & 0xffff_ffff,
            (w[0] >> 32) & 0xffff,
            (w[0] >> 48) & 0xff,
            w[1] & 0xffff,
            (w[1] >> 16) & 0xffff,
            w[1] >> 32,
            w[2],
            w[3] as i64,
            w[4] as i64,
            w[5] as i64,
            w[6] as i64,
            w[7] as i64,
            w[8] as i64,
            w[9] as i64,
            w[10] as i64
        ));
    }
    f.write_all(text.as_bytes()).map_err(|e| fail(&e))
}

/// The share of the batch's whole key tiles (BN slots) that a BN-row TMA box covers: all of them
/// with pages of BN slots or more; with smaller pages that divide BN, those whose pages follow one
/// another in the pool (the kernel's `tile_is_run`); none otherwise.
pub fn run_share(tables: &FlatBlockTables, page_size: usize) -> f64 {
    if page_size >= BN {
        return 1.0;
    }
    if page_size == 0 || !BN.is_multiple_of(page_size) {
        return 0.0;
    }
    let per = BN / page_size;
    let (mut runs, mut whole) = (0usize, 0usize);
    for b in 0..tables.batch() {
        let row = &tables.block_table[b * tables.max_pages..(b + 1) * tables.max_pages];
        let tiles = (tables.seq_len(b) / BN).min(row.len() / per);
        for t in row.chunks_exact(per).take(tiles) {
            whole += 1;
            runs += usize::from(t.windows(2).all(|w| w[1] == w[0] + 1));
        }
    }
    if whole == 0 {
        0.0
    } else {
        runs as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::sources;

    #[test]
    fn fdpp_prefill_parses_and_forced_hopper_refuses_other_devices() {
        assert_eq!(Choice::parse(None).unwrap(), Choice::Default);
        assert_eq!(Choice::parse(Some("mma")).unwrap(), Choice::Mma);
        assert_eq!(Choice::parse(Some(" hopper")).unwrap(), Choice::Hopper);
        assert!(Choice::parse(Some("wgmma")).is_err());
        let lim = 227 << 10;
        assert!(!decide(Choice::Mma, ARCH, 128, lim).unwrap());
        assert!(decide(Choice::Hopper, ARCH, 128, lim).unwrap());
        assert!(decide(Choice::Hopper, ARCH, 64, lim).unwrap());
        assert_eq!(decide(Choice::Default, ARCH, 128, lim).unwrap(), DEFAULT_ON);
        // Elsewhere the default falls back quietly; a forced Hopper kernel is an error.
        assert!(!decide(Choice::Default, "sm_89", 128, lim).unwrap());
        assert!(!decide(Choice::Default, ARCH, 256, lim).unwrap());
        assert!(decide(Choice::Hopper, "sm_80", 128, lim).is_err());
        assert!(decide(Choice::Hopper, ARCH, 128, smem_bytes(128, 2) - 1).is_err());
        // head_dim 256 has only the mma.sync kernel, forced or not.
        assert!(!decide(Choice::Hopper, ARCH, 256, lim).unwrap());
    }

    #[test]
    fn shared_memory_fits_hopper_and_the_sources_are_sm90a_only() {
        // 227 KiB opt-in per block on the H100, three stages included.
        assert!(smem_bytes(128, 3) <= 227 << 10);
        assert_eq!(BM, sources::PREFILL_BM, "same tile list as the mma.sync kernel");
        for &d in &HEAD_DIMS {
            let s = attn_prefill_hopper_source(crate::dtype::DType::F16, d, Schedule::DEFAULT);
            assert!(sources::all_sources().contains(&s));
            assert!(sources::compiles_for(&s, ARCH));
            assert!(!sources::compiles_for(&s, "sm_80") && !sources::compiles_for(&s, "sm_89"));
            assert_eq!(
                s.uri,
                format!("attn_prefill_hopper_f16_d{d}_{}", Schedule::DEFAULT.tag())
            );
        }
        assert_eq!(
            Schedule::parse(Schedule::DEFAULT, None, None, None).unwrap(),
            Schedule::DEFAULT
        );
        let v = Schedule::parse(Schedule::DEFAULT, Some("3"), Some("1"), Some("1")).unwrap();
        assert_eq!(v, Schedule::new(3, true, true));
        assert_eq!(v.tag(), "s3o1p1");
        assert_eq!(Schedule::RUNS.tag(), "s3o1p1r");
        // Switches left unset keep the base's; the run boxes stay with the base.
        let r = Schedule::parse(Schedule::RUNS, Some("2"), Some("0"), None).unwrap();
        assert_eq!(r.tag(), "s2o0p0r");
        assert!(Schedule::parse(Schedule::DEFAULT, Some("4"), None, None).is_err());
        assert!(Schedule::parse(Schedule::DEFAULT, None, Some("yes"), None).is_err());
        assert!(
            Schedule::parse(Schedule::DEFAULT, None, Some("0"), Some("1")).is_err(),
            "ping-pong needs the overlap"
        );
        let d = Schedule::DEFAULT;
        assert_eq!(d.parse_diag(None).unwrap(), d);
        let l = d.parse_diag(Some("1")).unwrap();
        assert_eq!(l.diag, 1);
        assert_eq!(l.tag(), "s2o0p0-diag1");
        assert_eq!(
            Schedule::parse(Schedule::DEFAULT, Some("2"), Some("0"), None)
                .unwrap()
                .tag(),
            "s2o0p0",
            "the overlap off takes the default ping-pong with it"
        );
        assert_eq!(d.parse_diag(Some("3")).unwrap().diag, 3);
        assert!(d.parse_diag(Some("4")).is_err());
        let other = sources::attn_prefill_source(crate::dtype::DType::F16, 128);
        assert!(sources::compiles_for(&other, "sm_80"));
    }

    #[test]
    fn the_persistent_kernel_takes_q_by_tma_and_auto_follows_the_measurements() {
        assert_eq!(AutoSwitch::parse("prefill_persist", None).unwrap(), AutoSwitch::Auto);
        assert_eq!(
            AutoSwitch::parse("prefill_persist", Some(" auto")).unwrap(),
            AutoSwitch::Auto
        );
        assert_eq!(
            AutoSwitch::parse("prefill_persist", Some("0")).unwrap(),
            AutoSwitch::Off
        );
        assert_eq!(AutoSwitch::parse("prefill_persist", Some("1")).unwrap(), AutoSwitch::On);
        assert!(AutoSwitch::parse("prefill_persist", Some("yes")).is_err());
        let (d, r) = (Schedule::DEFAULT, Schedule::RUNS);
        let long = PERSIST_AUTO_KEYS + 1;
        let on = |c, q_tma, s: &Schedule, keys| persistent(c, true, q_tma, s, keys).unwrap();
        // auto: up to the bound of the softmax, whatever the schedule; 1 and 0 for either.
        assert!(on(AutoSwitch::Auto, true, &r, PERSIST_AUTO_KEYS));
        assert!(on(AutoSwitch::Auto, true, &d, PERSIST_AUTO_KEYS));
        assert!(!on(AutoSwitch::Auto, true, &d, long));
        assert!(!on(AutoSwitch::Auto, true, &r, long));
        assert!(on(AutoSwitch::On, true, &d, long));
        assert!(!on(AutoSwitch::Off, true, &r, 1024));
        let on_async = |c, keys| persistent(c, false, true, &r, keys).unwrap();
        assert!(on_async(AutoSwitch::Auto, PERSIST_AUTO_KEYS_ASYNC));
        assert!(!on_async(AutoSwitch::Auto, PERSIST_AUTO_KEYS_ASYNC + 1));
        assert!(on_async(AutoSwitch::On, long));
        assert!(!on_async(AutoSwitch::Off, 1024));
        // Never when tracing, whatever was asked; auto without Q by TMA stays off, forced on it
        // is an error naming both switches.
        for c in [AutoSwitch::Auto, AutoSwitch::On] {
            assert!(!on(c, true, &d.parse_diag(Some("3")).unwrap(), 1024), "trace");
        }
        assert!(!on(AutoSwitch::Auto, false, &r, 1024));
        let e = persistent(AutoSwitch::On, true, false, &r, 1024)
            .unwrap_err()
            .to_string();
        assert!(e.contains("prefill_persist=1") && e.contains("hopper_q_tma=1"), "{e}");
        assert!(on(AutoSwitch::On, true, &d.parse_diag(Some("1")).unwrap(), 1024));
        // Two Q tiles where they fit 227 KiB: d128 with two stages, d64 with three.
        assert_eq!(d.persistent().q_buffers(128), 2);
        assert_eq!(r.persistent().q_buffers(128), 1);
        assert_eq!(r.persistent().q_buffers(64), 2);
        assert_eq!(d.q_buffers(128), 1);
        assert!(r.persistent().smem(128) <= 227 << 10 && d.persistent().smem(128) <= 227 << 10);
        assert_eq!(d.persistent().smem(128), smem_bytes(128, 2) + (BM * 128 * 2) as u32);
        assert_eq!(d.persistent().tag(), "s2o0p0-persist");
    }

    #[test]
    fn run_share_counts_whole_tiles_of_consecutive_pages() {
        let layout = crate::kv::paged::PagedKvLayout::new(16, 64, 1, 64, crate::dtype::DType::F16).unwrap();
        let table = |pages: Vec<u32>, seq_len: usize| crate::kv::BlockTable { pages, seq_len };
        // Sequence 0: 20 pages (320 keys, 2 whole tiles): tile 0 in order, tile 1 broken at page 12.
        let mut p0: Vec<u32> = (0..20).collect();
        p0.swap(12, 13);
        // Sequence 1: 100 keys, no whole tile.
        let p1: Vec<u32> = (40..47).collect();
        let t = FlatBlockTables::new(&layout, &[table(p0, 320), table(p1, 100)]).unwrap();
        assert_eq!(run_share(&t, 16), 0.5);
        // Pages of a whole tile or more box every tile; pages that straddle tiles box none.
        assert_eq!(run_share(&t, 128), 1.0);
        assert_eq!(run_share(&t, 48), 0.0);
        let scattered: Vec<u32> = (0..16).rev().collect();
        let t = FlatBlockTables::new(&layout, &[table(scattered, 256)]).unwrap();
        assert_eq!(run_share(&t, 16), 0.0);
    }

    /// The swizzled layouts of attn_prefill_hopper.cu (swz for Q, kv_at for K and V) against the
    /// hardware's 128-byte swizzle (XOR of byte-address bits 4–6 with bits 7–9) applied to the
    /// unswizzled offsets the descriptors describe: every element lands where the wgmma reads
    /// it, once; and K/V's layout is where the pool map's 5-D box (tma.rs `encode`: 64 columns,
    /// 8 rows, the column blocks, 1 kv head, groups of 8 rows) puts each element.
    #[test]
    fn swizzle_matches_the_wgmma_descriptors() {
        // swz and kv_at of the kernel, transcribed.
        let swz = |r: usize, c: usize, rows: usize| (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        let hw = |logical: usize| logical ^ (((logical >> 7) & 7) << 4);
        for &d in &HEAD_DIMS {
            let atoms = d / 64 * 1024; // KV_ATOMS
            let kv_at =
                |r: usize, c: usize| (r >> 3) * atoms + (c >> 3) * 1024 + (r & 7) * 128 + (((c & 7) ^ (r & 7)) << 4);
            let rows = BN;
            let (mut seen_q, mut seen_kv) = (vec![false; rows * d * 2 / 16], vec![false; rows * d * 2 / 16]);
            for r in 0..rows {
                for c in 0..d / 8 {
                    // Q [BM, D] (K-major A): row r, k-step ks = c / 2 within column block c / 8:
                    // descriptor start = block + (ks % 4)·32, rows 128 bytes apart, 8-row groups
                    // 1024 apart (SBO); the chunk sits (c % 2)·16 past the k-step start.
                    let at = swz(r, c, rows);
                    assert!(!seen_q[at / 16]);
                    seen_q[at / 16] = true;
                    let ks = c / 2;
                    let start = (ks >> 2) * rows * 128 + (ks & 3) * 32;
                    let logical = start + (r / 8) * 1024 + (r % 8) * 128 + (c % 2) * 16;
                    assert_eq!(hw(logical), at, "Q d{d} r{r} c{c}");
                    // K (K-major B): the k-step's start is its column block's 1024 bytes within
                    // the first 8-row group, + (ks % 4)·32; 8-row groups SBO = KV_ATOMS apart.
                    let at = kv_at(r, c);
                    assert!(!seen_kv[at / 16]);
                    seen_kv[at / 16] = true;
                    let start = (ks >> 2) * 1024 + (ks & 3) * 32;
                    let logical = start + (r / 8) * atoms + (r % 8) * 128 + (c % 2) * 16;
                    assert_eq!(hw(logical), at, "K d{d} r{r} c{c}");
                    // V (N-major B): k-step kk = r / 16 starts at kk·2·KV_ATOMS; key groups of 8
                    // SBO = KV_ATOMS apart, 64-column blocks LBO = 1024 apart, chunk c % 8 in its
                    // row.
                    let kk = r / 16;
                    let logical =
                        kk * 2 * atoms + ((r % 16) / 8) * atoms + (c / 8) * 1024 + (r % 8) * 128 + (c % 8) * 16;
                    assert_eq!(hw(logical), at, "V d{d} r{r} c{c}");
                    // The 5-D box (innermost first: column, row in its group of 8, column block,
                    // kv head, group) lays elements out densely, then swizzles by address.
                    let dense = ((((r / 8) * (d / 64) + c / 8) * 8 + r % 8) * 64 + (c % 8) * 8) * 2;
                    assert_eq!(hw(dense), at, "TMA box d{d} r{r} c{c}");
                }
            }
            assert!(seen_q.iter().all(|&s| s) && seen_kv.iter().all(|&s| s));
        }
    }
}
