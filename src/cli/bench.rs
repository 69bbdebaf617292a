//! `fdpp bench ...`: the implementations of one op side by side on a model's shapes, each
//! verified against the f64 reference before it is timed, with its memory roofline beside it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use super::Format;
use crate::backend::{self, slugify, Backend, BackendChoice, BackendKind};
use crate::bench::{GemmInputs, TimingOpts};
use crate::dtype::DType;
use crate::error::FdppError;
use crate::model::{LinearKind, LinearShape, ModelConfig, ModelShapes};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::profile::Profile;
use crate::provenance::BuildInfo;
use crate::report::{self, GemmRecord, RunContext};
use crate::select::select;
use crate::tune::verify::{Verifier, DEFAULT_SAMPLE_COLS};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Every GEMM implementation on the model's linear shapes, at each M.
    Gemm(GemmBenchArgs),
    /// Attention variants (sync, async softmax; naive split-free decode) over batch × kv_len.
    Attention(super::bench_attention::AttnBenchArgs),
    /// The engine end to end: TTFT, TPOT, throughput and peak memory over batch × prompt length,
    /// with the profile and with none in the same run, and the largest batch that fits.
    E2e(super::bench_e2e::E2eBenchArgs),
}

#[derive(Args, Debug)]
pub struct GemmBenchArgs {
    /// Preset name (see `fdpp shapes`), a path to an HF config.json (or a directory holding
    /// one), or a GGUF file: only its shapes are used.
    #[arg(long)]
    pub model: String,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Device ordinal within the backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    #[arg(long, value_enum, default_value_t = DType::F16)]
    pub dtype: DType,
    /// Rows of x to measure, e.g. 1,2,4,8. Default: 1,2,4,...,128 on a GPU, 1,2,4,8,16 on the CPU.
    #[arg(long, value_delimiter = ',')]
    pub m: Vec<usize>,
    /// Implementations to measure: any of gemv, flat_gemm, gemm (default all), or `auto`
    /// (what select() picks from --profile).
    #[arg(long = "impl", value_delimiter = ',')]
    pub impls: Vec<String>,
    /// Linear shapes to measure: any of qkv, o, ffn1, ffn2 (default all four).
    #[arg(long, value_delimiter = ',')]
    pub shape: Vec<String>,
    /// Timed runs per candidate and M (the median is reported).
    #[arg(long, default_value_t = TimingOpts::default().reps)]
    pub reps: usize,
    /// Untimed runs before the timed ones.
    #[arg(long, default_value_t = TimingOpts::default().warmup)]
    pub warmup: usize,
    /// Tuning profile (for `--impl auto`).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Directory for the CSV, JSON and SVG files. Default: reports/bench/<device-slug>.
    #[arg(long)]
    pub report_dir: Option<PathBuf>,
    /// Format of the table on stdout.
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    match a.what {
        BenchCommand::Gemm(g) => run_gemm(g),
        BenchCommand::Attention(at) => super::bench_attention::run(at),
        BenchCommand::E2e(e) => super::bench_e2e::run(e),
    }
}

/// `--model`: a preset, an HF config.json (or its directory) or a GGUF file; only the shapes are used.
pub fn load_model(arg: &str) -> anyhow::Result<ModelConfig> {
    Ok(ModelConfig::resolve(arg)?)
}

/// `--impl`: None = every implementation; `auto` alone = only what select() picks.
pub struct ImplChoice {
    pub imps: Option<Vec<GemmImpl>>,
    pub auto: bool,
}

pub fn parse_impls(list: &[String]) -> anyhow::Result<ImplChoice> {
    if list.is_empty() {
        return Ok(ImplChoice {
            imps: None,
            auto: false,
        });
    }
    let mut out = Vec::new();
    let mut auto = false;
    for s in list {
        let s = s.trim().to_ascii_lowercase().replace('-', "_");
        if s == "auto" {
            auto = true;
            continue;
        }
        match GemmImpl::ALL.iter().find(|i| i.name() == s) {
            Some(i) if !out.contains(i) => out.push(*i),
            Some(_) => {}
            None => bail!("--impl: unknown implementation '{s}'; known: gemv, flat_gemm, gemm, auto"),
        }
    }
    Ok(ImplChoice {
        imps: if out.is_empty() && auto {
            Some(vec![])
        } else {
            Some(out)
        },
        auto,
    })
}

pub fn pick_shapes(all: &[LinearShape], list: &[String]) -> anyhow::Result<Vec<LinearShape>> {
    if list.is_empty() {
        return Ok(all.to_vec());
    }
    let mut kinds = Vec::new();
    for s in list {
        let s = s.trim().to_ascii_lowercase();
        match LinearKind::ALL.iter().find(|k| k.name() == s) {
            Some(k) => kinds.push(*k),
            None => bail!("--shape: unknown shape '{s}'; known: qkv, o, ffn1, ffn2"),
        }
    }
    Ok(all.iter().filter(|l| kinds.contains(&l.kind)).copied().collect())
}

pub fn m_list(given: &[usize], kind: BackendKind) -> anyhow::Result<Vec<usize>> {
    let mut ms: Vec<usize> = if given.is_empty() {
        // The CPU's naive paths are slow enough that M past 16 only adds minutes.
        match kind {
            BackendKind::Cpu => vec![1, 2, 4, 8, 16],
            _ => vec![1, 2, 4, 8, 16, 32, 64, 128],
        }
    } else {
        given.to_vec()
    };
    if ms.contains(&0) {
        bail!("--m: M must be at least 1 (got {given:?})");
    }
    if let Some(big) = ms.iter().find(|&&m| m > crate::tune::grid::MAX_M) {
        bail!(
            "--m: M = {big} is above {}, past where any implementation but the vendor GEMM runs; give smaller M",
            crate::tune::grid::MAX_M
        );
    }
    ms.sort_unstable();
    ms.dedup();
    Ok(ms)
}

/// A candidate that was not timed, and why.
struct Rejected {
    what: String,
    reason: String,
    wrong: bool,
}

fn run_gemm(a: GemmBenchArgs) -> anyhow::Result<()> {
    let choice = parse_impls(&a.impls)?;
    if a.profile.is_some() && !choice.auto {
        bail!("--profile is used by --impl auto; add `auto` to --impl (e.g. --impl auto,gemv,flat_gemm,gemm)");
    }
    let cfg = load_model(&a.model)?;
    let shapes = pick_shapes(&ModelShapes::of(&cfg).linears, &a.shape)?;
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => {
        let profile = if choice.auto { Some(profile_for(b, &a, &cfg)?) } else { None };
        bench_gemm(b, &a, &cfg, &shapes, choice.imps.as_deref(), profile.as_ref())
    })
}

/// The profile `--impl auto` follows: --profile, else profiles/<device-slug>/<model>.json.
fn profile_for<B: Backend>(b: &B, a: &GemmBenchArgs, cfg: &ModelConfig) -> anyhow::Result<Profile> {
    let path = a
        .profile
        .clone()
        .unwrap_or_else(|| crate::profile::default_path(&b.info().slug, &cfg.name));
    if !path.exists() {
        bail!(
            "--impl auto: no profile at {}; run `fdpp tune --model {}` first or pass --profile",
            path.display(),
            a.model
        );
    }
    let (p, warnings) = crate::profile::load_for_use(&path, cfg, b.info(), &b.kernel_hash())?;
    for w in warnings {
        eprintln!("warning: {w}");
    }
    eprintln!("--impl auto follows {}", path.display());
    Ok(p)
}

fn bench_gemm<B: Backend>(
    b: &B,
    a: &GemmBenchArgs,
    cfg: &ModelConfig,
    shapes: &[LinearShape],
    imps: Option<&[GemmImpl]>,
    profile: Option<&Profile>,
) -> anyhow::Result<()> {
    let info = b.info().clone();
    if a.reps == 0 {
        bail!("--reps: at least 1 timed run is needed");
    }
    let ms = m_list(&a.m, info.backend)?;
    let opts = TimingOpts {
        warmup: a.warmup,
        reps: a.reps,
    };
    let host = crate::backend::cpu::info::host_memory_bytes();
    let dims: Vec<(usize, usize)> = shapes.iter().map(|s| (s.k, s.n)).collect();
    crate::bench::timer::check_gemm_fits(&info, host, a.dtype, &dims, ms.last().copied().unwrap_or(1), "--m")?;
    // Weights must not be served from cache between timed runs; the CPU backend reports no
    // L2, so assume a large LLC.
    let cache_bytes = if info.l2_bytes > 0 { info.l2_bytes } else { 32 << 20 };

    let mut plan: Vec<(LinearShape, Vec<GemmSpec>)> = Vec::new();
    for s in shapes {
        let cands: Vec<GemmSpec> = b
            .gemm_candidates(a.dtype, s.n, s.k)
            .into_iter()
            .filter(|c| imps.is_none_or(|l| l.contains(&c.imp)))
            .collect();
        if cands.is_empty() && profile.is_none() {
            bail!(
                "{} backend offers no {} candidate for {} {}; try --impl gemv,flat_gemm,gemm",
                info.backend,
                a.dtype,
                cfg.name,
                s.label()
            );
        }
        plan.push((*s, cands));
    }

    eprintln!("measuring copy bandwidth (memory roofline) on {} ...", info.name);
    let copy_gbps = match b.copy_gbps() {
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
    };

    let ctx = RunContext {
        build: BuildInfo::current(),
        device: info.name.clone(),
        backend: info.backend.name().to_string(),
        model: cfg.name.clone(),
    };
    let auto_steps = if profile.is_some() { plan.len() * ms.len() } else { 0 };
    let steps: usize = plan.iter().map(|(_, c)| c.len() * ms.len()).sum::<usize>() + auto_steps;
    let pb = ProgressBar::new(steps as u64);
    if let Ok(style) = ProgressStyle::with_template("{bar:32} {pos}/{len} [{elapsed_precise}] {msg}") {
        pb.set_style(style);
    }

    let sweep_opts = SweepOpts {
        dtype: a.dtype,
        ms: &ms,
        timing: opts,
        cache_bytes,
        seed: a.seed,
        profile,
    };
    eprintln!(
        "bench gemm: {} shape(s) × {} M × their candidates, {steps} steps; Ctrl-C stops it and writes no report",
        plan.len(),
        ms.len()
    );
    crate::interrupt::install();
    let (mut records, rejected) = sweep(b, &ctx, &plan, &sweep_opts, &pb)?;
    pb.finish_and_clear();

    report::annotate(&mut records, copy_gbps);
    let over = report::annotate::over_roofline(&records, copy_gbps);
    if over > 0 {
        eprintln!(
            "roofline: {over} row(s) ran faster than the measured memory bandwidth allows (their inputs fit in a \
             cache); their % roofline is left empty"
        );
    }
    if profile.is_some() {
        eprint!("{}", auto_summary(&records));
    }
    let machine_readable = a.format != Format::Md;
    print!("{}", report::gemm_table(&records, a.format)?);
    if !rejected.is_empty() {
        eprintln!("\nnot timed ({}):", rejected.len());
        for r in &rejected {
            eprintln!("  {}: {}", r.what, r.reason);
        }
    }

    let dir = a
        .report_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("reports").join("bench").join(&info.slug));
    let stem = format!("gemm-{}", slugify(&cfg.name));
    let title = format!(
        "fdpp bench gemm, {} {}, fdpp {} ({}), median of {} runs{}",
        info.backend,
        a.dtype,
        ctx.build.fdpp_version,
        ctx.build.git_commit,
        opts.reps,
        copy_gbps.map(|g| format!(", copy {g:.0} GB/s")).unwrap_or_default()
    );
    let files = report::write_gemm_report(&dir, &stem, &title, &records, &BTreeMap::new())?;
    let listing: String = files.all().iter().map(|p| format!("  {}\n", p.display())).collect();
    // Keep stdout parseable when it carries CSV or JSON.
    if machine_readable {
        eprint!("report files:\n{listing}");
    } else {
        print!("\nreport files:\n{listing}");
    }

    let wrong = rejected.iter().filter(|r| r.wrong).count();
    if wrong > 0 {
        bail!("{wrong} candidate(s) gave wrong results (listed above); they were not timed and are not in the report");
    }
    Ok(())
}

struct SweepOpts<'a> {
    dtype: DType,
    ms: &'a [usize],
    timing: TimingOpts,
    cache_bytes: u64,
    seed: u64,
    /// Time select()'s choice too (`--impl auto`).
    profile: Option<&'a Profile>,
}

/// Every (shape, M, candidate) of the plan: verify against the reference, then time. Wrong or
/// failing candidates are collected, never timed, never reported as valid rows.
fn sweep<B: Backend>(
    b: &B,
    ctx: &RunContext,
    plan: &[(LinearShape, Vec<GemmSpec>)],
    o: &SweepOpts<'_>,
    pb: &ProgressBar,
) -> anyhow::Result<(Vec<GemmRecord>, Vec<Rejected>)> {
    let max_m = o.ms.iter().copied().max().unwrap_or(1);
    let mut records: Vec<GemmRecord> = Vec::new();
    let mut rejected: Vec<Rejected> = Vec::new();
    for (s, cands) in plan {
        pb.set_message(format!("{}: uploading inputs", s.label()));
        let mut inputs = GemmInputs::new(b, o.dtype, s.n, s.k, max_m, o.cache_bytes, o.seed)
            .with_context(|| format!("inputs for {} {}", ctx.model, s.label()))?;
        // The same verification as the tuner: f64 reference on sampled columns, poisoned output,
        // nothing written past M rows.
        crate::interrupt::check(&format!("the benchmark of {}", s.label()))?;
        let verifier = Verifier::new(&inputs, max_m, DEFAULT_SAMPLE_COLS)?;
        for &m in o.ms {
            let dims = GemmDims::new(m, s.n, s.k)?;
            let auto_spec = o.profile.map(|p| select(s, m, Some(p)).spec(o.dtype));
            // Verify every candidate (and select()'s choice) first; then time the verified ones
            // interleaved, so a transient slowdown does not favour one of them.
            let mut verified: Vec<(GemmSpec, bool, f64)> = Vec::new();
            for (spec, is_auto) in cands
                .iter()
                .map(|c| (c, false))
                .chain(auto_spec.iter().map(|c| (c, true)))
            {
                // Ctrl-C stops the sweep within one step; no report is written.
                crate::interrupt::check(&format!("the benchmark of {} at M={m}", s.label()))?;
                pb.set_message(format!("{} M={m} {spec}", s.kind));
                let what = format!("{spec} at {} M={m}", s.label());
                match verifier.check(b, &mut inputs, spec, m) {
                    Err(e) => rejected.push(Rejected {
                        what,
                        wrong: matches!(e, FdppError::WrongResult { .. }),
                        reason: e.to_string(),
                    }),
                    Ok(err) => verified.push((*spec, is_auto, err)),
                }
                pb.inc(1);
            }
            let specs: Vec<GemmSpec> = verified.iter().map(|v| v.0).collect();
            let times = inputs.time_interleaved(b, &specs, m, o.timing, crate::tune::sweep::TIMING_ROUNDS);
            crate::interrupt::check(&format!("the benchmark of {} at M={m}", s.label()))?;
            for ((spec, is_auto, err), t) in verified.into_iter().zip(times) {
                match t {
                    Ok(stats) => {
                        let mut r = GemmRecord::new(ctx, s.kind.name(), &spec, dims, stats, err);
                        if is_auto {
                            r.implementation = format!("auto={}", r.implementation);
                            r.imp = "auto".into();
                        }
                        records.push(r)
                    }
                    Err(e) => rejected.push(Rejected {
                        what: format!("{spec} at {} M={m}", s.label()),
                        wrong: false,
                        reason: format!("timing failed: {e}"),
                    }),
                }
            }
        }
    }
    Ok((records, rejected))
}

/// For each (shape, M): select()'s choice against the fastest candidate timed in the same run.
fn auto_summary(records: &[GemmRecord]) -> String {
    let mut out = String::from("\n--impl auto (profile's choice) vs the fastest implementation in this run:\n");
    let mut worst: f64 = 0.0;
    for r in records.iter().filter(|r| r.imp == "auto") {
        let best = records
            .iter()
            .filter(|o| o.imp != "auto" && o.shape == r.shape && o.m == r.m)
            .min_by(|x, y| x.median_us.total_cmp(&y.median_us));
        if let Some(best) = best {
            let over = r.median_us / best.median_us - 1.0;
            worst = worst.max(over);
            out.push_str(&format!(
                "  {:5} M={:<5} {:32} {:8.2} µs   fastest {:28} {:8.2} µs   {:+.1}%\n",
                r.shape,
                r.m,
                r.implementation,
                r.median_us,
                best.implementation,
                best.median_us,
                100.0 * over
            ));
        }
    }
    out.push_str(&format!("  worst: {:+.1}% over the fastest\n", 100.0 * worst));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn impl_list_parses_names_and_rejects_others() {
        let none = parse_impls(&[]).unwrap();
        assert_eq!((none.imps, none.auto), (None, false));
        let three = parse_impls(&strings(&["gemm", "flat-gemm", "gemv", "gemm"])).unwrap();
        assert_eq!(
            three.imps,
            Some(vec![GemmImpl::Gemm, GemmImpl::FlatGemm, GemmImpl::Gemv])
        );
        assert!(!three.auto);
        let auto_only = parse_impls(&strings(&["auto"])).unwrap();
        assert_eq!((auto_only.imps, auto_only.auto), (Some(vec![]), true));
        let mixed = parse_impls(&strings(&["gemv", "auto"])).unwrap();
        assert_eq!((mixed.imps, mixed.auto), (Some(vec![GemmImpl::Gemv]), true));
        assert!(parse_impls(&strings(&["tensor"])).is_err());
    }

    #[test]
    fn shape_filter_keeps_model_order() {
        let all = ModelShapes::of(&crate::model::presets::preset("llama2-7b").unwrap()).linears;
        let got = pick_shapes(&all, &strings(&["ffn2", "qkv"])).unwrap();
        assert_eq!(
            got.iter().map(|s| s.kind).collect::<Vec<_>>(),
            [LinearKind::Qkv, LinearKind::Ffn2]
        );
        assert_eq!(pick_shapes(&all, &[]).unwrap(), all);
        assert!(pick_shapes(&all, &strings(&["down"])).is_err());
    }

    #[test]
    fn m_list_defaults_per_backend_and_is_sorted() {
        assert_eq!(m_list(&[], BackendKind::Cpu).unwrap(), [1, 2, 4, 8, 16]);
        assert_eq!(m_list(&[], BackendKind::Cuda).unwrap().last(), Some(&128));
        assert_eq!(m_list(&[8, 1, 8, 3], BackendKind::Cuda).unwrap(), [1, 3, 8]);
        assert!(m_list(&[0], BackendKind::Cpu).is_err());
    }

    /// The CPU backend with two bugs planted: gemv's outputs are 5% off, and flat_gemm refuses
    /// M > 1. The sweep must time neither where they fail.
    fn faulty() -> crate::backend::cpu::hooked::HookedCpu {
        crate::backend::cpu::hooked::HookedCpu::new(|inner, spec, dims, x, w, y| {
            if spec.imp == GemmImpl::FlatGemm && dims.m > 1 {
                return Err(FdppError::Unsupported {
                    spec: spec.uri(),
                    what: format!("M={}", dims.m),
                });
            }
            inner.gemm(spec, dims, x, w, y)?;
            if spec.imp == GemmImpl::Gemv {
                for v in &mut y.data[..dims.m * dims.n] {
                    *v = spec.dtype.from_f32(spec.dtype.to_f32(*v) * 1.05);
                }
            }
            Ok(())
        })
    }

    #[test]
    fn wrong_and_unsupported_candidates_are_rejected_not_timed() {
        let b = faulty();
        let ctx = RunContext {
            build: BuildInfo::current(),
            device: "faulty".into(),
            backend: "cpu".into(),
            model: "tiny".into(),
        };
        let shape = LinearShape {
            kind: LinearKind::O,
            k: 97,
            n: 130,
        };
        for dtype in [DType::F16, DType::Bf16] {
            // One candidate per implementation (the CPU offers several flat_gemm block sizes).
            let mut one_each = b.gemm_candidates(dtype, shape.n, shape.k);
            one_each.dedup_by_key(|s| s.imp);
            let plan = vec![(shape, one_each)];
            let o = SweepOpts {
                dtype,
                ms: &[1, 3],
                timing: TimingOpts { warmup: 0, reps: 2 },
                cache_bytes: 1 << 16,
                seed: rand::random(),
                profile: None,
            };
            let (records, rejected) = sweep(&b, &ctx, &plan, &o, &ProgressBar::hidden()).unwrap();
            let timed: Vec<(GemmImpl, usize)> = records
                .iter()
                .map(|r| (plan[0].1.iter().find(|s| s.uri() == r.implementation).unwrap().imp, r.m))
                .collect();
            assert_eq!(
                timed,
                [(GemmImpl::FlatGemm, 1), (GemmImpl::Gemm, 1), (GemmImpl::Gemm, 3)],
                "{dtype}"
            );
            assert!(records.iter().all(|r| r.nmse <= dtype.nmse_limit()));
            assert_eq!(rejected.len(), 3);
            let wrong: Vec<&Rejected> = rejected.iter().filter(|r| r.wrong).collect();
            assert_eq!(wrong.len(), 2, "gemv at M=1 and M=3");
            assert!(wrong
                .iter()
                .all(|r| r.what.starts_with("gemv") && r.reason.contains("wrong result")));
            let unsupported = rejected.iter().find(|r| !r.wrong).unwrap();
            assert!(unsupported.what.starts_with("flat_gemm") && unsupported.what.ends_with("M=3"));
            assert!(
                unsupported.reason.contains("does not support M=3"),
                "{}",
                unsupported.reason
            );
        }
    }
}
