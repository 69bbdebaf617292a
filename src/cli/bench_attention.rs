//! `fdpp bench attention`: the attention variants side by side (sync and async softmax,
//! FlashDecoding++ §3; for decode also the split-free baseline) over batch × kv_len, each
//! checked against the f64 reference before it is timed, with its roofline, recompute rate and
//! ratio to sync measured in the same run.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::Format;
use crate::backend::{self, Backend, BackendChoice, BackendKind, DeviceInfo};
use crate::bench::attention::{
    attention_record, plan_copies, AttnBenchCase, AttnInputs, AttnPhase, AttnVariant, VariantRun,
};
use crate::bench::TimingOpts;
use crate::dtype::DType;
use crate::error::FdppError;
use crate::kv::DEFAULT_PAGE_SIZE;
use crate::ops::attention::{AttnGeometry, SoftmaxScheme};
use crate::provenance::BuildInfo;
use crate::report::attention::{
    annotate_attention, attention_table, read_attention_csv, write_attention_report, AttnRecord, AttnRoofline,
    PEER_VARIANT,
};
use crate::report::RunContext;
use crate::tune::sweep::TIMING_ROUNDS;

/// Dense fp16 tensor-core rate of an H100 SXM on random data (ANCHORS.md: about 790 TFLOP/s at
/// 8192³): the nominal peak of prefill's % column, since fdpp does not measure one.
pub const DEFAULT_PEAK_TFLOPS: f64 = 790.0;

#[derive(Args, Debug)]
// Negative numbers (`--temperature -1`, `--phi -3`) parse as values, then are validated.
#[command(allow_negative_numbers = true)]
pub struct AttnBenchArgs {
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Device ordinal within the backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// decode: one new query token per sequence over kv_len cached tokens; prefill: a prompt of
    /// kv_len tokens into an empty cache, causal.
    #[arg(long, value_enum, default_value_t = AttnPhase::Decode)]
    pub phase: AttnPhase,
    /// Sequences per batch, e.g. 1,8,64. Default: decode 1,8,64 on a GPU (1,4 on the CPU);
    /// prefill 1.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Decode: cached tokens per sequence; prefill: prompt length. Default: 1024,4096,16384 on a
    /// GPU; decode 256,1024 and prefill 128,512 on the CPU.
    #[arg(long = "kv-len", value_delimiter = ',')]
    pub kv_len: Vec<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// KV heads (GQA when fewer than --heads).
    #[arg(long = "kv-heads", default_value_t = 32)]
    pub kv_heads: usize,
    #[arg(long = "head-dim", default_value_t = 128)]
    pub head_dim: usize,
    #[arg(long, value_enum, default_value_t = DType::F16)]
    pub dtype: DType,
    /// Variants, timed interleaved in the same run: sync (running max, split-KV), async (unified
    /// max φ, rows leaving [a, b] recomputed), naive (decode only: sync with one split per row, no
    /// split-KV). Default: all three for decode, sync,async for prefill (prefill has no splits, so
    /// naive is refused there).
    #[arg(long, value_delimiter = ',')]
    pub variant: Vec<String>,

    /// Decode: split-KV blocks per row for sync and async, instead of the count fdpp chooses from
    /// the batch, kv_len and SM count (1..=256), to measure that choice
    #[arg(long)]
    pub splits: Option<usize>,
    /// Unified max φ of the async scheme (default 0).
    #[arg(long, allow_hyphen_values = true)]
    pub phi: Option<f32>,
    /// Window a,b of x − φ inside which async needs no recompute, e.g. -60,20 (the default).
    #[arg(long, allow_hyphen_values = true)]
    pub range: Option<String>,
    /// Tokens per KV page.
    #[arg(long = "page-size", default_value_t = DEFAULT_PAGE_SIZE)]
    pub page_size: usize,
    /// Pages shuffled within aligned groups of N pool pages, the groups shuffled (1: every page
    /// anywhere in the pool, as a long-running server's cache ends up; with pages of 16 tokens
    /// and 32 KV heads d128, N = 16 keeps a tile's pages within one or two 2 MiB regions; 0: no
    /// shuffle, each sequence's pages one after another, as a fresh engine allocates a prompt's).
    #[arg(long = "page-group", default_value_t = 1)]
    pub page_group: usize,
    /// Timed runs per variant and configuration (the median is reported).
    #[arg(long, default_value_t = TimingOpts::default().reps)]
    pub reps: usize,
    /// Untimed runs before the timed ones.
    #[arg(long, default_value_t = TimingOpts::default().warmup)]
    pub warmup: usize,
    /// Nominal tensor-core peak in TFLOP/s for prefill's "% nominal peak" column (not measured;
    /// the default is an H100's dense fp16 rate).
    #[arg(long = "peak-tflops", default_value_t = DEFAULT_PEAK_TFLOPS)]
    pub peak_tflops: f64,
    /// Format of the table on stdout.
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
    /// Directory for the md, CSV, JSON and SVG files. Default: reports/bench/<device-slug>.
    #[arg(long, visible_alias = "report-dir")]
    pub out: Option<PathBuf>,
    /// CSV printed by scripts/torch_attention_peer.py on the same device: its rows for this run's
    /// configurations join the table and the chart, with a `vs sdpa` column.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
}

/// Everything checked from the arguments before a backend is opened.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnPlan {
    pub geom: AttnGeometry,
    pub variants: Vec<AttnVariant>,
    pub async_scheme: SoftmaxScheme,
    pub batches: Option<Vec<usize>>,
    pub kv_lens: Option<Vec<usize>>,
}

/// `--phi` and `--range`: the async scheme, validated (a window whose e^(b−a) overflows fp32 is
/// refused with the reason).
pub fn parse_scheme(phi: Option<f32>, range: Option<&str>) -> anyhow::Result<SoftmaxScheme> {
    let SoftmaxScheme::Async {
        phi: phi0,
        a: a0,
        b: b0,
    } = SoftmaxScheme::ASYNC_DEFAULT
    else {
        bail!("internal: SoftmaxScheme::ASYNC_DEFAULT is not an async scheme")
    };
    let (a, b) = match range {
        None => (a0, b0),
        Some(s) => {
            let parts: Vec<&str> = s.split(',').map(str::trim).collect();
            let num = |t: &str| -> anyhow::Result<f32> {
                t.parse::<f32>()
                    .with_context(|| format!("--range {s}: '{t}' is not a number (expected a,b such as -60,20)"))
            };
            match parts.as_slice() {
                [a, b] => (num(a)?, num(b)?),
                _ => bail!("--range {s}: expected two numbers a,b (such as -60,20)"),
            }
        }
    };
    let scheme = SoftmaxScheme::Async {
        phi: phi.unwrap_or(phi0),
        a,
        b,
    };
    scheme.validate()?;
    Ok(scheme)
}

/// A list option: None when not given (the per-backend default applies), sorted and deduplicated,
/// zeros refused.
pub fn positive_list(flag: &str, what: &str, given: &[usize]) -> anyhow::Result<Option<Vec<usize>>> {
    if given.is_empty() {
        return Ok(None);
    }
    if given.contains(&0) {
        bail!("{flag}: {what} must be at least 1 (got {given:?})");
    }
    let mut v = given.to_vec();
    v.sort_unstable();
    v.dedup();
    Ok(Some(v))
}

pub fn plan(a: &AttnBenchArgs) -> anyhow::Result<AttnPlan> {
    let variants = AttnVariant::parse_list(&a.variant, a.phase)?;
    let async_scheme = parse_scheme(a.phi, a.range.as_deref())?;
    if (a.phi.is_some() || a.range.is_some()) && !variants.contains(&AttnVariant::Async) {
        eprintln!("note: --phi/--range set the async scheme, but async is not among the variants");
    }
    let geom = AttnGeometry::new(a.heads, a.kv_heads, a.head_dim)?;
    if a.page_size == 0 {
        bail!("--page-size: a page must hold at least 1 token");
    }
    if a.reps == 0 {
        bail!("--reps: at least 1 timed run is needed");
    }
    if let Some(n) = a.splits {
        if a.phase != AttnPhase::Decode {
            bail!("--splits applies to --phase decode (prefill has no split-KV)");
        }
        if !(1..=crate::ops::attention::MAX_SPLITS).contains(&n) {
            bail!("--splits {n}: must be 1..={}", crate::ops::attention::MAX_SPLITS);
        }
    }
    if !(a.peak_tflops.is_finite() && a.peak_tflops > 0.0) {
        bail!(
            "--peak-tflops: must be a positive number of TFLOP/s (got {})",
            a.peak_tflops
        );
    }
    Ok(AttnPlan {
        geom,
        variants,
        async_scheme,
        batches: positive_list("--batch", "batch", &a.batch)?,
        kv_lens: positive_list("--kv-len", "kv_len", &a.kv_len)?,
    })
}

/// The default sweep: what the targets and ANCHORS.md's SDPA rows are stated at on a
/// GPU; sizes the CPU backend finishes in seconds.
fn default_lists(phase: AttnPhase, kind: BackendKind) -> (Vec<usize>, Vec<usize>) {
    match (phase, kind) {
        (AttnPhase::Decode, BackendKind::Cpu) => (vec![1, 4], vec![256, 1024]),
        (AttnPhase::Prefill, BackendKind::Cpu) => (vec![1], vec![128, 512]),
        (AttnPhase::Decode, _) => (vec![1, 8, 64], vec![1024, 4096, 16384]),
        (AttnPhase::Prefill, _) => (vec![1], vec![1024, 4096, 16384]),
    }
}

pub fn run(a: AttnBenchArgs) -> anyhow::Result<()> {
    let p = plan(&a)?;
    // A bad peer file fails before minutes of measuring.
    let peer = match &a.peer {
        Some(path) => read_attention_csv(path)?,
        None => Vec::new(),
    };
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => bench_attention(b, &a, &p, peer))
}

/// The copy bandwidth (the decode roofline), or None with a warning.
fn measure_copy<B: Backend>(b: &B) -> Option<f64> {
    eprintln!("measuring copy bandwidth (memory roofline) on {} ...", b.info().name);
    match b.copy_gbps() {
        Ok(g) if g.is_finite() && g > 0.0 => {
            eprintln!("copy bandwidth: {g:.1} GB/s (read + write)");
            Some(g)
        }
        Ok(g) => {
            eprintln!("warning: copy bandwidth measured as {g}; the roofline column is left empty");
            None
        }
        Err(e) => {
            eprintln!("warning: copy bandwidth not measured ({e}); the roofline column is left empty");
            None
        }
    }
}

/// A variant that was not timed, and why.
struct Rejected {
    what: String,
    reason: String,
    wrong: bool,
}

/// The peer's rows for this run's configurations; the rest is counted and said.
fn peer_rows(peer: Vec<AttnRecord>, cases: &[AttnBenchCase], info: &DeviceInfo) -> Vec<AttnRecord> {
    let total = peer.len();
    let kept: Vec<AttnRecord> = peer
        .into_iter()
        .filter(|r| {
            r.variant == PEER_VARIANT
                && cases.iter().any(|c| {
                    r.phase == c.phase.name()
                        && r.dtype == c.dtype.name()
                        && (r.heads, r.kv_heads, r.head_dim) == (c.geom.num_heads, c.geom.num_kv_heads, c.geom.head_dim)
                        && (r.batch, r.kv_len) == (c.batch, c.kv_len)
                })
        })
        .collect();
    if total > 0 {
        eprintln!("--peer: {} of {total} rows match this run's configurations", kept.len());
    }
    if let Some(r) = kept.iter().find(|r| r.device != info.name) {
        eprintln!(
            "warning: the peer rows were measured on '{}', this run is on '{}': `vs sdpa` compares different devices",
            r.device, info.name
        );
    }
    kept
}

fn bench_attention<B: Backend>(b: &B, a: &AttnBenchArgs, p: &AttnPlan, peer: Vec<AttnRecord>) -> anyhow::Result<()> {
    let info = b.info().clone();
    let (def_b, def_l) = default_lists(a.phase, info.backend);
    let batches = p.batches.clone().unwrap_or(def_b);
    let kv_lens = p.kv_lens.clone().unwrap_or(def_l);
    let cases: Vec<AttnBenchCase> = batches
        .iter()
        .flat_map(|&batch| {
            kv_lens.iter().map(move |&kv_len| AttnBenchCase {
                phase: a.phase,
                dtype: a.dtype,
                geom: p.geom,
                page_size: a.page_size,
                page_group: a.page_group,
                batch,
                kv_len,
            })
        })
        .collect();
    // Every configuration is sized before anything is measured: one that cannot fit is refused
    // now, not after minutes of the others.
    let copies: Vec<usize> = cases
        .iter()
        .map(|c| c.validate().and_then(|_| plan_copies(c, &info)))
        .collect::<Result<_, FdppError>>()?;
    let peer = peer_rows(peer, &cases, &info);

    let copy_gbps = measure_copy(b);
    let roof = AttnRoofline {
        copy_gbps,
        peak_tflops: a.peak_tflops,
    };
    let ctx = RunContext {
        build: BuildInfo::current(),
        device: info.name.clone(),
        backend: info.backend.name().to_string(),
        model: p.geom.label(),
    };
    let opts = TimingOpts {
        warmup: a.warmup,
        reps: a.reps.max(1),
    };

    let pb = ProgressBar::new((cases.len() * p.variants.len()) as u64);
    if let Ok(style) = ProgressStyle::with_template("{bar:32} {pos}/{len} [{elapsed_precise}] {msg}") {
        pb.set_style(style);
    }
    // `hopper_diag=1|2` builds the Hopper prefill without its K/V loads or its exponentials: the
    // bounds of what loads and softmax cost (reports/NOTES.md, session 7). Its output is garbage
    // by design, so its variants are timed without the reference check, and the run says so.
    // (`hopper_diag=3`, the kernel's timeline, computes correct results and is checked.)
    let diag = crate::run_config::get()
        .get(crate::run_config::Key::HopperDiag)
        .is_some_and(|v| matches!(v.trim(), "1" | "2"));
    if diag {
        eprintln!(
            "hopper_diag is set: a diagnostic build whose results are wrong by design; timed without the reference check (no NMSE)"
        );
    }
    let mut records: Vec<AttnRecord> = Vec::new();
    let mut rejected: Vec<Rejected> = Vec::new();
    for (ci, (case, &n_copies)) in cases.iter().zip(&copies).enumerate() {
        pb.set_message(format!("{}: uploading inputs", case.label()));
        let seed = a
            .seed
            .wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(ci as u64 + 1));
        let mut inputs = AttnInputs::new(b, case, n_copies, seed)
            .with_context(|| format!("inputs for attention {}", case.label()))?;
        let runs: Vec<VariantRun> = p
            .variants
            .iter()
            .map(|&v| {
                let run = inputs.variant(v, p.async_scheme, info.compute_units as usize);
                match a.splits {
                    Some(n) => run.with_splits(n),
                    None => run,
                }
            })
            .collect();
        // Check every variant first; then time the ones that passed, interleaved.
        let mut passed = Vec::new();
        for run in runs {
            pb.set_message(format!("{} {}", case.label(), run.variant.name()));
            let checked = if diag {
                inputs.run_unchecked(b, &run)
            } else {
                inputs.check(b, &run)
            };
            match checked {
                Ok(c) => passed.push((run, c)),
                Err(e) => rejected.push(Rejected {
                    what: format!("{} at {}", run.variant.name(), case.label()),
                    wrong: matches!(e, FdppError::WrongResult { .. }),
                    reason: e.to_string(),
                }),
            }
            pb.inc(1);
        }
        let timed: Vec<VariantRun> = passed.iter().map(|(r, _)| r.clone()).collect();
        pb.set_message(format!("{}: timing {} variant(s)", case.label(), timed.len()));
        let (times, append) = inputs.time(b, &timed, opts, TIMING_ROUNDS);
        let append_us = match append {
            Some(Ok(s)) => Some(s.median_us),
            Some(Err(e)) => {
                eprintln!("warning: {}: the cache write was not timed ({e})", case.label());
                None
            }
            None => None,
        };
        for ((run, checked), t) in passed.iter().zip(times) {
            match t {
                Ok(stats) => records.push(AttnRecord {
                    append_us,
                    ..attention_record(&ctx, case, run, checked, stats)
                }),
                Err(e) => rejected.push(Rejected {
                    what: format!("{} at {}", run.variant.name(), case.label()),
                    wrong: false,
                    reason: format!("timing failed: {e}"),
                }),
            }
        }
    }
    pb.finish_and_clear();

    if !rejected.is_empty() {
        eprintln!("\nnot timed ({}):", rejected.len());
        for r in &rejected {
            eprintln!("  {}: {}", r.what, r.reason);
        }
    }
    if records.is_empty() {
        bail!(
            "no attention variant could be timed on {} ({}); see the reasons above",
            info.backend,
            info.name
        );
    }
    records.extend(peer);
    annotate_attention(&mut records, roof);

    let machine_readable = a.format != Format::Md;
    print!("{}", attention_table(&records, a.format)?);
    let dir = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("reports").join("bench").join(&info.slug));
    let stem = format!("attention-{}", a.phase.name());
    let title = format!(
        "fdpp bench attention {}, {} {} {} page {}, {}, fdpp {} ({}), median of {} runs{}",
        a.phase.name(),
        info.backend,
        a.dtype,
        p.geom.label(),
        a.page_size,
        p.async_scheme.label(),
        ctx.build.fdpp_version,
        ctx.build.git_commit,
        opts.reps,
        copy_gbps.map(|g| format!(", copy {g:.0} GB/s")).unwrap_or_default()
    );
    let files = write_attention_report(&dir, &stem, &title, &records, roof)?;
    let listing: String = files.all().iter().map(|p| format!("  {}\n", p.display())).collect();
    // Keep stdout parseable when it carries CSV or JSON.
    if machine_readable {
        eprint!("report files:\n{listing}");
    } else {
        print!("\nreport files:\n{listing}");
    }

    let wrong = rejected.iter().filter(|r| r.wrong).count();
    if wrong > 0 {
        bail!("{wrong} variant(s) gave wrong results (listed above); they were not timed and are not in the report");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheme_options_default_validate_and_parse_negative_numbers() {
        assert_eq!(parse_scheme(None, None).unwrap(), SoftmaxScheme::ASYNC_DEFAULT);
        assert_eq!(
            parse_scheme(Some(-1.5), Some(" -12, 12")).unwrap(),
            SoftmaxScheme::Async {
                phi: -1.5,
                a: -12.0,
                b: 12.0
            }
        );
        assert_eq!(
            parse_scheme(Some(2.0), None).unwrap(),
            SoftmaxScheme::Async {
                phi: 2.0,
                a: -60.0,
                b: 20.0
            }
        );
        let e = parse_scheme(None, Some("0,100")).unwrap_err().to_string();
        assert!(
            e.contains("overflows fp32") || e.contains("leaves the fp32 range"),
            "{e}"
        );
        let e = parse_scheme(None, Some("5,1")).unwrap_err().to_string();
        assert!(e.contains("a must be below b"), "{e}");
        let e = format!("{:#}", parse_scheme(None, Some("x,1")).unwrap_err());
        assert!(e.contains("'x' is not a number"), "{e}");
        assert!(parse_scheme(None, Some("1")).is_err());
    }

    #[test]
    fn lists_are_sorted_deduplicated_and_zero_is_refused() {
        assert_eq!(positive_list("--batch", "batch", &[]).unwrap(), None);
        assert_eq!(positive_list("--batch", "batch", &[8, 1, 8]).unwrap(), Some(vec![1, 8]));
        let e = positive_list("--kv-len", "kv_len", &[97, 0]).unwrap_err().to_string();
        assert!(e.contains("--kv-len: kv_len must be at least 1"), "{e}");
        assert_eq!(default_lists(AttnPhase::Decode, BackendKind::Cuda).0, [1, 8, 64]);
        assert_eq!(default_lists(AttnPhase::Prefill, BackendKind::Cpu).1, [128, 512]);
    }
}
