//! `fdpp tune`: sweep the GEMM candidates for a model's shapes, write the profile and a report
//! (`--calibrate`: the softmax calibration instead, see [`super::calibrate`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::Format;
use crate::backend::{self, Backend, BackendChoice};
use crate::bench::Stats;
use crate::dtype::DType;
use crate::error::FdppError;
use crate::model::{ModelConfig, ModelShapes};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::profile::{self, Measurement, Profile};
use crate::report::{self, GemmRecord, Mark, ReportFiles, RunContext};
use crate::tune::sweep::{self, SweepOpts};

#[derive(Args, Debug, Clone)]
// Negative numbers (`--temperature -1`, `--phi -3`) parse as values, then are validated.
#[command(allow_negative_numbers = true)]
pub struct TuneArgs {
    /// Preset name, a path to an HF config.json (or a directory holding one), or a GGUF file.
    #[arg(long)]
    pub model: String,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Device ordinal on a GPU backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    #[arg(long, value_enum, default_value_t = DType::F16)]
    pub dtype: DType,
    /// Largest M (rows) to tune for [default: 2048 on a GPU, 128 on the CPU].
    #[arg(long)]
    pub m_max: Option<usize>,
    /// Timed runs per candidate and M [default: 30 on a GPU, 3 on the CPU].
    #[arg(long)]
    pub reps: Option<usize>,
    /// Profile path [default: profiles/<device-slug>/<model>.json].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Report directory [default: reports/tune/<device-slug>, or <profile>-report/ beside --out].
    #[arg(long)]
    pub report_dir: Option<PathBuf>,
    /// Format of the table printed on stdout.
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
    /// Tune the per-rank GEMM shapes of tensor parallelism over N ranks (QKV and FFN1 with
    /// N/tp columns, O and FFN2 with K/tp; issue #22 item 3), into
    /// profiles/<device-slug>/<model>-tp<N>.json, which `generate|bench e2e --tp N` look up.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Softmax calibration (`--calibrate` and its options).
    #[command(flatten)]
    pub calibrate: super::calibrate::CalibrateArgs,
    /// Time only the decode attention's two main passes (models with one query head per kv
    /// head) into the existing profile at --out (or the default path), keeping its GEMM and
    /// softmax sections; a whole tune does this after its sweep.
    #[arg(long, conflicts_with = "calibrate")]
    pub decode_pass: bool,
}

/// Seconds between progress lines when stderr is not a terminal (the bar is not drawn there).
const PROGRESS_LINE_SECS: f64 = 10.0;

/// What a tune produced.
pub struct TuneOutcome {
    pub profile: Profile,
    pub profile_path: PathBuf,
    pub report: ReportFiles,
    /// The per-candidate table in the requested format.
    pub table: String,
    /// One line per shape: M1, M2 and rejected candidates.
    pub summary: Vec<String>,
}

/// Where a tune's report goes without --report-dir: beside the profile when --out names one, in
/// `<profile stem>-report/` (so that a tune to another file never overwrites the reports of the
/// default profile, and the report's own JSON never lands on the profile), else
/// reports/tune/<device>/.
pub fn default_report_dir(out: Option<&std::path::Path>, device_slug: &str) -> PathBuf {
    match out {
        Some(o) => {
            let stem = o
                .file_stem()
                .map_or("profile".into(), |s| s.to_string_lossy().into_owned());
            let dir = o
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            dir.join(format!("{stem}-report"))
        }
        None => PathBuf::from("reports/tune").join(profile::file_stem(device_slug)),
    }
}

/// `--model`: a preset, an HF config.json (or its directory) or a GGUF file (`ModelConfig::resolve`).
pub fn load_model(arg: &str) -> anyhow::Result<ModelConfig> {
    Ok(ModelConfig::resolve(arg)?)
}

pub fn run(a: TuneArgs) -> anyhow::Result<()> {
    // Cheap checks first: a bad argument must not cost a backend start-up.
    if a.m_max == Some(0) {
        anyhow::bail!("--m-max must be at least 1 (it is the largest number of rows M to tune for)");
    }
    if a.reps == Some(0) {
        anyhow::bail!("--reps must be at least 1");
    }
    if a.calibrate.calibrate {
        if a.tp != 1 {
            anyhow::bail!(
                "--calibrate with --tp {}: the softmax windows do not depend on the split; calibrate without --tp \
                 (the tp profile's GEMM choices are tuned with --tp alone)",
                a.tp
            );
        }
        return super::calibrate::run(&a);
    }
    if a.decode_pass {
        return run_decode_pass(&a);
    }
    let whole = load_model(&a.model)?;
    // The shapes one rank runs: the engine looks its profile up by them.
    let cfg = crate::tp::rank_config(&whole, a.tp)?;
    if a.tp > 1 {
        let shapes: Vec<String> = ModelShapes::of(&cfg).linears.iter().map(|s| s.label()).collect();
        eprintln!(
            "tensor parallel --tp {}: tuning one rank's shapes as model '{}': {}",
            a.tp,
            cfg.name,
            shapes.join(", ")
        );
    }
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    let out = crate::with_backend!(&any, b => run_with_backend(b, &a, &cfg))?;
    print!("{}", out.table);
    for line in &out.summary {
        eprintln!("{line}");
    }
    eprintln!("profile: {}", out.profile_path.display());
    eprintln!("report: {}", out.report.csv.display());
    eprintln!("report: {}", out.report.json.display());
    for s in &out.report.svgs {
        eprintln!("report: {}", s.display());
    }
    Ok(())
}

/// The whole tune on an opened backend: sweep, save the profile atomically, write the report.
/// Nothing is written unless the sweep succeeds.
pub fn run_with_backend<B: Backend>(b: &B, a: &TuneArgs, cfg: &ModelConfig) -> anyhow::Result<TuneOutcome> {
    let info = b.info().clone();
    let opts = SweepOpts::for_backend(info.backend, a.dtype, a.m_max, a.reps)?;
    let profile_path = a
        .out
        .clone()
        .unwrap_or_else(|| profile::default_path(&info.slug, &cfg.name));
    let report_dir = a
        .report_dir
        .clone()
        .unwrap_or_else(|| default_report_dir(a.out.as_deref(), &info.slug));
    // Find inputs that cannot fit, or an unwritable output, before the sweep, not during it (and
    // the memory first: a refused tune leaves no empty profile directory behind).
    let dims: Vec<(usize, usize)> = ModelShapes::of(cfg).linears.iter().map(|s| (s.k, s.n)).collect();
    let max_m = opts.m_grid.last().copied().unwrap_or(1);
    let host = crate::backend::cpu::info::host_memory_bytes();
    crate::bench::timer::check_gemm_fits(&info, host, a.dtype, &dims, max_m, "--m-max")?;
    profile::check_writable(&profile_path)?;
    let report_dir_existed = report_dir.exists();
    std::fs::create_dir_all(&report_dir)
        .map_err(|e| FdppError::io(&report_dir, format!("cannot create the report directory: {e}")))?;

    let shapes = ModelShapes::of(cfg);
    // Weighted by each step's FLOPs: the bar's estimate then holds although the steps at large M
    // take far longer than those at small M.
    let total_work = sweep::count_work(b, &shapes.linears, &opts);
    let bar = ProgressBar::new(total_work);
    if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {percent}% (about {eta} left) {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    let steps: usize = shapes
        .linears
        .iter()
        .map(|s| sweep::candidates(b, a.dtype, s).len() * opts.m_grid.len())
        .sum();
    eprintln!(
        "tune: {} shapes × {} M (1..={max_m}) × their candidates = {steps} steps; Ctrl-C stops it and writes nothing",
        shapes.linears.len(),
        opts.m_grid.len()
    );
    // Without a terminal the bar is not drawn: a line with the estimate every few seconds.
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let started = std::time::Instant::now();
    let mut last_line = started;
    let mut done = 0u64;
    crate::interrupt::install();
    let swept = sweep::tune(b, cfg, &opts, &mut |step| {
        bar.set_message(step.label.to_string());
        bar.inc(step.work);
        done += step.work;
        if !tty && last_line.elapsed().as_secs_f64() >= PROGRESS_LINE_SECS && done > 0 {
            last_line = std::time::Instant::now();
            let t = started.elapsed().as_secs_f64();
            let left = t * (total_work.saturating_sub(done)) as f64 / done as f64;
            eprintln!(
                "tune: {:.0} % after {t:.0} s, about {left:.0} s left ({})",
                100.0 * done as f64 / total_work.max(1) as f64,
                step.label
            );
        }
    });
    bar.finish_and_clear();
    let profile = match swept {
        Ok(p) => p,
        Err(e) => {
            // Leave no trace of a run that wrote nothing: the report directory it made is empty.
            if !report_dir_existed {
                let _ = std::fs::remove_dir(&report_dir);
            }
            if matches!(e, FdppError::Interrupted(_)) {
                eprintln!(
                    "tune: interrupted after {:.1} s; {} is unchanged",
                    started.elapsed().as_secs_f64(),
                    profile_path.display()
                );
            }
            return Err(e).with_context(|| format!("tuning {} on {}", cfg.name, info.name));
        }
    };

    // The softmax calibration depends on the weights, not on the GEMM timings: keep the section
    // of the profile this one replaces (when it is for the same model).
    let mut profile = profile;
    let mut kept = None;
    if let Ok(old) = Profile::load(&profile_path) {
        if old.softmax.is_some() && old.check_model(cfg).is_ok() {
            profile.softmax = old.softmax;
            kept = Some(format!(
                "softmax: kept the calibrated section of the profile replaced at {}",
                profile_path.display()
            ));
        }
    }
    // The decode pass is an addition to the sweep: its failure costs the section (the engine
    // then keeps the built-in pass), not the sweep.
    let decode_lines = add_decode_pass(b, cfg, a.dtype, &mut profile).unwrap_or_else(|e| {
        vec![format!(
            "decode pass: not recorded ({e:#}); the engine keeps its built-in pass. `fdpp tune --model {} \
             --decode-pass` times it again into this profile",
            a.model
        )]
    });
    profile.save(&profile_path)?;

    let records = records_of(&profile, &cfg.name);
    let marks = marks_of(&profile);
    let title = format!("GEMM tune: {} on {} ({})", cfg.name, info.name, a.dtype);
    let report = report::write_gemm_report(&report_dir, &profile::file_stem(&cfg.name), &title, &records, &marks)?;
    let table = report::gemm_table(&records, a.format)?;
    let mut summary = summary_of(&profile);
    summary.extend(kept);
    summary.extend(decode_lines);
    Ok(TuneOutcome {
        summary,
        profile,
        profile_path,
        report,
        table,
    })
}

/// Time the decode attention's passes into `profile` (`tune::decode_pass`), with the softmax
/// scheme the engine runs from it; the lines to print (the reason where nothing was timed).
fn add_decode_pass<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    dtype: DType,
    profile: &mut Profile,
) -> anyhow::Result<Vec<String>> {
    use crate::tune::decode_pass;
    if let Some(why) = decode_pass::skip_reason(b, cfg) {
        return Ok(vec![why]);
    }
    let (scheme, _) = crate::engine::build::softmax_scheme(None, Some(profile))?;
    let grid = decode_pass::Grid::default();
    eprintln!(
        "decode pass: timing the CUDA-core and tensor-core passes at batch {:?} x {} keys",
        grid.batches, grid.kv_len
    );
    let section = decode_pass::measure(b, cfg, dtype, scheme, &grid, &mut |batch| {
        eprintln!("decode pass: batch {batch}");
    })
    .with_context(|| format!("timing the decode passes of {} on {}", cfg.name, b.info().name))?;
    let lines = decode_pass::describe(&section);
    profile.decode_pass = Some(section);
    Ok(lines)
}

/// `tune --decode-pass`: the decode pass section alone, into the existing profile.
fn run_decode_pass(a: &TuneArgs) -> anyhow::Result<()> {
    if a.tp != 1 {
        anyhow::bail!("--decode-pass with --tp {}: time the decode passes without --tp", a.tp);
    }
    let cfg = load_model(&a.model)?;
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => {
        let path = a.out.clone().unwrap_or_else(|| profile::default_path(&b.info().slug, &cfg.name));
        let mut p = Profile::load(&path).with_context(|| {
            format!(
                "--decode-pass adds to an existing profile, and {} cannot be read; run `fdpp tune --model {}` \
                 first (it times the decode passes too)",
                path.display(),
                a.model
            )
        })?;
        p.check_model(&cfg)
            .with_context(|| format!("{} is not a profile of {}", path.display(), cfg.name))?;
        profile::check_writable(&path)?;
        let lines = add_decode_pass(b, &cfg, a.dtype, &mut p)?;
        p.save(&path)?;
        for l in &lines {
            eprintln!("{l}");
        }
        eprintln!("profile: {}", path.display());
        Ok::<(), anyhow::Error>(())
    })
}

/// One report row per verified, timed (shape, M, candidate).
pub fn records_of(p: &Profile, model: &str) -> Vec<GemmRecord> {
    let ctx = RunContext {
        build: crate::provenance::BuildInfo::current(),
        device: p.provenance.device.name.clone(),
        backend: p.provenance.backend.to_string(),
        model: model.to_string(),
    };
    let mut out = Vec::new();
    for sp in &p.shapes {
        for c in &sp.candidates {
            let spec = GemmSpec {
                imp: c.imp,
                dtype: p.dtype,
                block_n: c.block_n,
                stages: c.stages,
                algo: c.algo,
            };
            for r in &c.results {
                if let Measurement::Ok {
                    m,
                    samples,
                    median_us,
                    min_us,
                    max_us,
                    nmse,
                } = *r
                {
                    let dims = GemmDims { m, n: sp.n, k: sp.k };
                    let stats = Stats {
                        samples,
                        median_us,
                        min_us,
                        max_us,
                    };
                    out.push(GemmRecord::new(&ctx, sp.kind.name(), &spec, dims, stats, nmse));
                }
            }
        }
    }
    out
}

/// M1 and M2 of each shape, keyed by shape name, for the charts.
pub fn marks_of(p: &Profile) -> BTreeMap<String, Vec<Mark>> {
    p.shapes
        .iter()
        .map(|sp| {
            let marks = [("M1", sp.m1), ("M2", sp.m2)]
                .into_iter()
                .filter_map(|(label, m)| m.map(|m| Mark { label: label.into(), m }))
                .collect();
            (sp.kind.name().to_string(), marks)
        })
        .collect()
}

fn summary_of(p: &Profile) -> Vec<String> {
    let show = |v: Option<usize>| v.map_or("never".to_string(), |x| x.to_string());
    let mut out = Vec::new();
    for sp in &p.shapes {
        out.push(format!("{}: M1={} M2={}", sp.label(), show(sp.m1), show(sp.m2)));
        for c in &sp.candidates {
            let rejected: Vec<&Measurement> = c
                .results
                .iter()
                .filter(|r| matches!(r, Measurement::Rejected { .. }))
                .collect();
            if let Some(Measurement::Rejected { reason, .. }) = rejected.first() {
                out.push(format!(
                    "  {} rejected at {} of {} M (first: {reason})",
                    c.uri,
                    rejected.len(),
                    c.results.len()
                ));
            }
        }
        if GemmImpl::ALL.iter().all(|&i| sp.times(i).iter().all(|t| t.is_none())) {
            out.push("  no candidate was verified for this shape: select() will use the vendor gemm".into());
        }
    }
    out
}
