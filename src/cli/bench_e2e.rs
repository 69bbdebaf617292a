//! `fdpp bench e2e`: the engine end to end over batch × prompt length — time to first token,
//! time per output token, decode and end-to-end throughput, peak memory — with the tuned
//! profile and with `--profile none` (vendor GEMM only) in the same run, activation memory with
//! and without buffer reuse, and the highest achievable throughput: the largest batch whose
//! memory plan fits (FlashDecoding++Next's measure of an engine).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::bail;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use super::model_setup::{default_profile_path, find_by_shape, find_profile, weight_source};
use super::Format;
use crate::backend::{self, slugify, Backend, BackendChoice, BackendKind};
use crate::bench::e2e::{case_plan, max_batch, memory_need, run_case, E2eCase, E2eMeasure, MemoryNeed};
use crate::dtype::DType;
use crate::engine::build::{
    build_model, build_rank_model, softmax_label, softmax_setup, EngineOptions, SoftmaxChoice, WeightSource,
};
use crate::engine::forward::Llama;
use crate::engine::linear::LinearPlanner;
use crate::engine::memory::{gib, MemoryPlan};
use crate::engine::runner::{Engine, DEFAULT_CHUNK};
use crate::kv::DEFAULT_PAGE_SIZE;
use crate::model::llama::{check_supported, ModelSpec};
use crate::ops::attention::SoftmaxScheme;
use crate::profile::Profile;
use crate::provenance::BuildInfo;
use crate::report::e2e::{
    annotate_e2e, e2e_table, highest_throughput, write_e2e_report, E2eRecord, KIND_MAX_BATCH, KIND_SWEEP, NO_PROFILE,
    STATUS_FAILED, STATUS_NO_FIT, STATUS_OK, STATUS_REFUSED, WITH_PROFILE,
};
use crate::tp::Communicator;

/// `--reuse`: activation buffers reused across layers, one per op, or both (for the ratio).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReuseChoice {
    Yes,
    No,
    Both,
}

#[derive(Args, Debug, Clone)]
// Negative numbers (`--temperature -1`, `--phi -3`) parse as values, then are validated.
#[command(allow_negative_numbers = true)]
pub struct E2eBenchArgs {
    /// A preset name (with --random-weights), an HF model directory or its config.json, or a
    /// GGUF file.
    #[arg(long)]
    pub model: String,
    /// Random weights generated on the device (no weight files needed).
    #[arg(long)]
    pub random_weights: bool,
    /// Seed of the random weights and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Device ordinal on a GPU backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    #[arg(long, value_enum, default_value_t = DType::F16)]
    pub dtype: DType,
    /// Sequences decoded together, e.g. 1,8,32. Default: 1,8,32 on a GPU, 1,2 on the CPU.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence, e.g. 128,1024. Default: 1024 on a GPU, 16 on the CPU.
    #[arg(long = "prompt-len", value_delimiter = ',')]
    pub prompt_len: Vec<usize>,
    /// Tokens generated per sequence (EOS ignored). Default: 128 on a GPU, 8 on the CPU.
    #[arg(long = "gen-len")]
    pub gen_len: Option<usize>,
    /// A profile file, `none` (the backend's built-in GEMM rule), or `both` (profiles/<device-slug>/<model>.json
    /// and none, in the same run) [default: both when that profile exists, else none].
    #[arg(long)]
    pub profile: Option<String>,
    /// With `--profile FILE`: also run every configuration with `none`, for the ratio.
    #[arg(long)]
    pub compare_none: bool,
    /// One activation buffer per op per layer (same as --reuse no).
    #[arg(long, conflicts_with = "reuse")]
    pub no_reuse: bool,
    /// Activation buffers reused across layers (yes), one per op (no), or both in the same run.
    #[arg(long, value_enum)]
    pub reuse: Option<ReuseChoice>,
    /// Attention softmax [default: async, with the profile's φ, a, b when it has them].
    #[arg(long, value_enum)]
    pub softmax: Option<SoftmaxChoice>,
    /// Also find the largest batch that fits memory for each prompt length (from the memory
    /// plan) and run it: the highest achievable throughput.
    #[arg(long)]
    pub max_batch_search: bool,
    /// The search stops at this batch.
    #[arg(long, default_value_t = 1024)]
    pub max_batch_limit: usize,
    /// Untimed runs (a prefill and one decode step) before each timed one.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Share of device memory for weights, KV cache and activations.
    #[arg(long, default_value_t = 0.9)]
    pub mem_fraction: f64,
    /// Tokens per KV page.
    #[arg(long, default_value_t = DEFAULT_PAGE_SIZE)]
    pub page_size: usize,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = DEFAULT_CHUNK)]
    pub chunk_size: usize,
    /// Format of the table on stdout.
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
    /// Tensor parallelism over N ranks (issue #22): one GPU per rank through NCCL on CUDA,
    /// ranks as threads on the CPU. Rows are named `<model>-tp<N>`.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// The ranks' GPUs, one per rank, e.g. 0,1 [default: 0..tp].
    #[arg(long)]
    pub devices: Option<String>,
    /// Directory for the md, CSV, JSON and SVG files. Default: reports/bench/<device-slug>.
    #[arg(long, visible_alias = "report-dir")]
    pub out: Option<PathBuf>,
}

/// One way of running every configuration: with the profile or with none.
struct Variant {
    label: &'static str,
    profile: Option<Profile>,
    path: Option<PathBuf>,
    scheme: SoftmaxScheme,
    /// Each layer's window (empty: `scheme` for all).
    layer_schemes: Vec<SoftmaxScheme>,
    softmax: String,
}

pub fn list(flag: &str, given: &[usize], default: &[usize]) -> anyhow::Result<Vec<usize>> {
    if given.contains(&0) {
        bail!("{flag}: every value must be at least 1 (got {given:?})");
    }
    let mut v = if given.is_empty() {
        default.to_vec()
    } else {
        given.to_vec()
    };
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

fn reuse_list(a: &E2eBenchArgs) -> Vec<bool> {
    match (a.no_reuse, a.reuse) {
        (true, _) | (_, Some(ReuseChoice::No)) => vec![false],
        (_, Some(ReuseChoice::Both)) => vec![true, false],
        _ => vec![true],
    }
}

pub fn run(a: E2eBenchArgs) -> anyhow::Result<()> {
    // Cheap checks before a backend starts or a weight is made.
    if a.batch.contains(&0) {
        bail!("--batch: a batch needs at least 1 sequence (got {:?})", a.batch);
    }
    if a.prompt_len.contains(&0) {
        bail!("--prompt-len: a prompt needs at least 1 token (got {:?})", a.prompt_len);
    }
    if a.gen_len.is_some_and(|g| g < 2) {
        bail!("--gen-len must be at least 2 (the first token comes from the prefill; the time per output token needs a decode step)");
    }
    if a.max_batch_limit == 0 {
        bail!("--max-batch-limit must be at least 1");
    }
    if a.compare_none && matches!(a.profile.as_deref(), None | Some("none") | Some("both")) {
        bail!("--compare-none goes with --profile FILE (`--profile both` already runs none)");
    }
    let spec = ModelSpec::resolve(&a.model)?;
    check_supported(&spec.cfg)?;
    let source = weight_source(&spec, &a.model, a.random_weights, a.seed)?;
    if a.tp != 1 || a.devices.is_some() {
        if a.device != 0 {
            bail!("--device picks one GPU; with --tp give the ranks' GPUs with --devices");
        }
        let (kind, devices) = super::tp::prepare(&spec.cfg, a.tp, a.devices.as_deref(), a.backend)?;
        let job = BenchJob {
            a: &a,
            spec: &spec,
            source: &source,
        };
        return super::tp::run(kind, &devices, &job);
    }
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => bench_e2e(b, &a, &spec, &source, None))
}

/// `bench e2e --tp N`: every rank runs the same cases in lockstep; rank 0 times and reports.
struct BenchJob<'a> {
    a: &'a E2eBenchArgs,
    spec: &'a ModelSpec,
    source: &'a WeightSource,
}

impl super::tp::RankJob for BenchJob<'_> {
    fn run<B: Backend>(&self, b: &B, comm: Arc<dyn Communicator<B>>) -> anyhow::Result<()> {
        bench_e2e(b, self.a, self.spec, self.source, Some(comm))
    }
}

/// The variants `--profile` asks for.
/// `lead`: this process prints the notes (rank 0 of a tensor-parallel group, or the only one).
fn variants<B: Backend>(b: &B, a: &E2eBenchArgs, spec: &ModelSpec, lead: bool) -> anyhow::Result<Vec<Variant>> {
    let with = |profile: Profile, path: PathBuf| -> anyhow::Result<Variant> {
        let (scheme, layer_schemes, softmax) = softmax_setup(a.softmax, Some(&profile), spec.cfg.num_layers)?;
        Ok(Variant {
            label: WITH_PROFILE,
            profile: Some(profile),
            path: Some(path),
            scheme,
            layer_schemes,
            softmax,
        })
    };
    let (none_scheme, _, none_softmax) = softmax_setup(a.softmax, None, spec.cfg.num_layers)?;
    let none = || Variant {
        label: NO_PROFILE,
        profile: None,
        path: None,
        scheme: none_scheme,
        layer_schemes: Vec::new(),
        softmax: none_softmax.clone(),
    };
    let out = match a.profile.as_deref() {
        Some("both") => {
            let (found, note) = find_by_shape(b, spec, &a.model, a.dtype)?;
            if lead {
                eprintln!("{note}");
            }
            let Some(f) = found else {
                bail!(
                    "--profile both: no profile at {} nor any of this model's shapes beside it; run `fdpp tune --model {}` first, or pass --profile FILE --compare-none",
                    default_profile_path(b, spec).display(),
                    a.model
                );
            };
            vec![with(f.profile, f.path)?, none()]
        }
        None => {
            let (found, note) = find_by_shape(b, spec, &a.model, a.dtype)?;
            if lead {
                eprintln!("{note}");
            }
            match found {
                Some(f) => vec![with(f.profile, f.path)?, none()],
                None => vec![none()],
            }
        }
        arg => {
            let (found, note) = find_profile(b, arg, spec, &a.model, a.dtype)?;
            if lead {
                eprintln!("{note}");
            }
            match found {
                Some(f) if a.compare_none => vec![with(f.profile, f.path)?, none()],
                Some(f) => vec![with(f.profile, f.path)?],
                None => vec![none()],
            }
        }
    };
    for v in out.iter().filter(|_| lead) {
        eprintln!(
            "variant {}: {}; {}",
            v.label,
            v.path
                .as_ref()
                .map_or("no profile: the backend's built-in GEMM rule".into(), |p| format!(
                    "profile {}",
                    p.display()
                )),
            v.softmax
        );
    }
    Ok(out)
}

/// What every row of this run shares.
struct RowBase<'a> {
    build: BuildInfo,
    device: String,
    backend: String,
    model: &'a str,
    dtype: DType,
}

impl RowBase<'_> {
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        kind: &str,
        v: &Variant,
        reuse: bool,
        case: &E2eCase,
        need: &MemoryNeed,
        plan: Option<&MemoryPlan>,
        outcome: Result<&E2eMeasure, (&str, String)>,
    ) -> E2eRecord {
        let (weights, kv, act, peak) = match plan {
            Some(p) => (p.weights_bytes, p.kv.bytes, p.activations.bytes, p.total_bytes),
            None => (need.weights, need.kv, need.activations, need.total()),
        };
        let m = outcome.as_ref().ok();
        let (status, error) = match &outcome {
            Ok(_) => (STATUS_OK.to_string(), None),
            Err((s, e)) => (s.to_string(), Some(e.clone())),
        };
        E2eRecord {
            fdpp_version: self.build.fdpp_version.clone(),
            git_commit: self.build.git_commit.clone(),
            device: self.device.clone(),
            backend: self.backend.clone(),
            model: self.model.to_string(),
            dtype: self.dtype.name().to_string(),
            kind: kind.into(),
            profile: v.label.into(),
            profile_path: v.path.as_ref().map(|p| p.display().to_string()),
            softmax: softmax_label(v.scheme, &v.layer_schemes),
            reuse,
            batch: case.batch,
            prompt_len: case.prompt_len,
            gen_len: case.gen_len,
            status,
            error,
            ttft_ms: m.map(|m| m.ttft_ms),
            tpot_ms: m.map(|m| m.tpot_ms),
            decode_tok_s: m.map(|m| m.decode_tok_s),
            e2e_tok_s: m.map(|m| m.e2e_tok_s),
            total_ms: m.map(|m| m.total_ms),
            decode_steps: m.map(|m| m.decode_steps),
            attn_rows: m.map(|m| m.attn_rows),
            recomputed: m.map(|m| m.recomputed),
            weights_bytes: weights,
            kv_bytes: kv,
            act_bytes: act,
            peak_bytes: peak,
            act_bytes_no_reuse: need.activations_no_reuse,
            act_vs_no_reuse: act as f64 / need.activations_no_reuse.max(1) as f64,
            decode_vs_none: None,
            ttft_vs_none: None,
        }
    }
}

/// The model is built once (weights made or read once) and moved into an engine per
/// configuration, whose KV pages and activation buffers are sized by that configuration's plan.
struct Runner<'b, 'a, B: Backend> {
    b: &'b B,
    /// The model one rank runs (the whole model without --tp).
    spec: &'a ModelSpec,
    /// The whole model, and this rank's group with --tp.
    whole: &'a ModelSpec,
    comm: Option<Arc<dyn Communicator<B>>>,
    source: &'a WeightSource,
    variants: &'a [Variant],
    base: RowBase<'a>,
    model: Option<Llama<'b, B>>,
    seed: u64,
    warmup: usize,
    pb: ProgressBar,
    records: Vec<E2eRecord>,
}

impl<'b, B: Backend> Runner<'b, '_, B> {
    fn model(&mut self, opts: &EngineOptions) -> anyhow::Result<Llama<'b, B>> {
        match self.model.take() {
            Some(m) => Ok(m),
            None => {
                self.pb.set_message("making the weights");
                Ok(match &self.comm {
                    Some(c) => build_rank_model(self.b, self.whole, self.source, None, opts, c.clone())?,
                    None => build_model(self.b, self.spec, self.source, None, opts)?,
                })
            }
        }
    }

    /// Run `case` with every variant and push a row for each; a configuration that cannot run
    /// gets rows saying why.
    fn case(&mut self, kind: &str, case: &E2eCase, opts: &EngineOptions) -> anyhow::Result<()> {
        let need = memory_need(self.spec, opts, case);
        let reuse = opts.reuse;
        let refuse = |me: &mut Self, status: &str, why: String| {
            for v in me.variants {
                let r = me
                    .base
                    .record(kind, v, reuse, case, &need, None, Err((status, why.clone())));
                me.records.push(r);
                me.pb.inc(1);
            }
        };
        if let Err(e) = case.validate(self.spec.context_len()) {
            refuse(self, STATUS_REFUSED, e.to_string());
            return Ok(());
        }
        let plan = match case_plan(self.b, self.spec, opts, case) {
            Ok(p) => p,
            Err(e) => {
                refuse(self, STATUS_NO_FIT, e.to_string());
                return Ok(());
            }
        };
        let model = self.model(opts)?;
        let mut engine = match Engine::new(model, plan.clone()) {
            Ok(e) => e,
            Err(e) => {
                refuse(
                    self,
                    STATUS_FAILED,
                    format!("allocating the KV cache and activations: {e}"),
                );
                return Ok(());
            }
        };
        for v in self.variants {
            self.pb.set_message(format!(
                "{} {}{}",
                case.label(),
                v.label,
                if reuse { "" } else { " no-reuse" }
            ));
            let fallback = engine.model.linears.fallback();
            engine.model.linears =
                LinearPlanner::new(&self.spec.cfg, opts.dtype, v.profile.clone()).with_fallback(fallback);
            engine.model.scheme = v.scheme;
            engine.model.set_layer_schemes(v.layer_schemes.clone())?;
            // One seed per configuration: every variant sees the same prompts.
            let seed = self.seed ^ ((case.batch as u64) << 32) ^ case.prompt_len as u64;
            let res = run_case(&mut engine, case, self.spec.context_len(), seed, self.warmup);
            let r = match &res {
                Ok(m) => self.base.record(kind, v, reuse, case, &need, Some(&plan), Ok(m)),
                Err(e) => self.base.record(
                    kind,
                    v,
                    reuse,
                    case,
                    &need,
                    Some(&plan),
                    Err((STATUS_FAILED, e.to_string())),
                ),
            };
            self.records.push(r);
            self.pb.inc(1);
        }
        self.model = Some(engine.model);
        Ok(())
    }
}

fn bench_e2e<B: Backend>(
    b: &B,
    a: &E2eBenchArgs,
    whole: &ModelSpec,
    source: &WeightSource,
    comm: Option<Arc<dyn Communicator<B>>>,
) -> anyhow::Result<()> {
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
    // With --tp every rank runs the rank's model (its shapes, KV cache, profile lookup).
    let rank_spec = crate::tp::rank_spec(whole, world)?;
    let spec = &rank_spec;
    let info = b.info().clone();
    let cpu = info.backend == BackendKind::Cpu;
    let batches = list("--batch", &a.batch, if cpu { &[1, 2] } else { &[1, 8, 32] })?;
    let prompt_lens = list("--prompt-len", &a.prompt_len, if cpu { &[16] } else { &[1024] })?;
    let gen_len = a.gen_len.unwrap_or(if cpu { 8 } else { 128 });
    let variants = variants(b, a, spec, rank == 0)?;
    let reuses = reuse_list(a);
    let opts_for = |reuse: bool| EngineOptions {
        dtype: a.dtype,
        mem_fraction: a.mem_fraction,
        page_size: a.page_size,
        chunk: a.chunk_size,
        reuse,
        max_kv_tokens: None,
        scheme: variants[0].scheme,
        layer_schemes: variants[0].layer_schemes.clone(),
    };
    // Refuse bad engine options (mem fraction, page size, chunk) before any weight is made.
    if let Err(e) = case_plan(
        b,
        spec,
        &opts_for(reuses[0]),
        &E2eCase {
            batch: 1,
            prompt_len: 1,
            gen_len: 1,
        },
    ) {
        if !e.to_string().contains("does not fit") {
            bail!("{e}");
        }
    }

    let cases: Vec<E2eCase> = prompt_lens
        .iter()
        .flat_map(|&prompt_len| {
            batches.iter().map(move |&batch| E2eCase {
                batch,
                prompt_len,
                gen_len,
            })
        })
        .collect();
    let searches = if a.max_batch_search { prompt_lens.len() } else { 0 };
    let total = (cases.len() + searches) * variants.len() * reuses.len();
    let pb = if rank == 0 {
        ProgressBar::new(total as u64)
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) = ProgressStyle::with_template("{bar:32} {pos}/{len} [{elapsed_precise}] {msg}") {
        pb.set_style(style);
    }
    let mut runner = Runner {
        b,
        spec,
        whole,
        comm,
        source,
        variants: &variants,
        base: RowBase {
            build: BuildInfo::current(),
            device: info.name.clone(),
            backend: info.backend.name().to_string(),
            model: &spec.cfg.name,
            dtype: a.dtype,
        },
        model: None,
        seed: a.seed,
        warmup: a.warmup,
        pb,
        records: Vec::new(),
    };
    let mut notes = Vec::new();
    for &reuse in &reuses {
        let opts = opts_for(reuse);
        for case in &cases {
            runner.case(KIND_SWEEP, case, &opts)?;
        }
        if a.max_batch_search {
            for &prompt_len in &prompt_lens {
                let found = max_batch(b, spec, &opts, prompt_len, gen_len, a.max_batch_limit);
                let case = E2eCase {
                    batch: found.unwrap_or(1),
                    prompt_len,
                    gen_len,
                };
                match found {
                    Some(n) => notes.push(format!(
                        "largest batch that fits at prompt {prompt_len} + gen {gen_len}{}: {n}{}",
                        if reuse { "" } else { " (no reuse)" },
                        if n == a.max_batch_limit {
                            " (the --max-batch-limit; more may fit)"
                        } else {
                            ""
                        }
                    )),
                    None => notes.push(format!(
                        "not even one sequence of prompt {prompt_len} + gen {gen_len} fits"
                    )),
                }
                // A batch of 1 that does not fit is run anyway: its rows say how much it needs.
                runner.case(KIND_MAX_BATCH, &case, &opts)?;
            }
        }
    }
    runner.pb.finish_and_clear();
    if rank != 0 {
        // Rank 0 reports for the group.
        return Ok(());
    }
    let mut records = runner.records;
    annotate_e2e(&mut records);

    let machine_readable = a.format != Format::Md;
    print!("{}", e2e_table(&records, a.format)?);
    let mut summary: Vec<String> = notes;
    summary.extend(highest_throughput(&records));
    for (reuse_row, no_reuse_row) in records
        .iter()
        .filter(|r| r.reuse && r.is_ok())
        .filter_map(|r| {
            records
                .iter()
                .find(|o| !o.reuse && o.kind == r.kind && o.batch == r.batch && o.prompt_len == r.prompt_len)
                .map(|o| (r, o))
        })
        .take(1)
    {
        summary.push(format!(
            "activations with reuse: {} vs {} without ({:.1}%; the goal is ≤ 80%)",
            gib(reuse_row.act_bytes),
            gib(no_reuse_row.act_bytes),
            100.0 * reuse_row.act_bytes as f64 / no_reuse_row.act_bytes.max(1) as f64
        ));
    }
    for s in &summary {
        if machine_readable {
            eprintln!("{s}");
        } else {
            println!("{s}");
        }
    }

    let dir = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("reports").join("bench").join(&info.slug));
    let stem = format!("e2e-{}", slugify(&spec.cfg.name));
    let build = BuildInfo::current();
    let title = format!(
        "fdpp bench e2e, {} {} {}, gen {}, {} weights, fdpp {} ({})",
        spec.cfg.name,
        info.backend,
        a.dtype,
        gen_len,
        match source {
            WeightSource::Random { .. } => "random",
            WeightSource::Dir(_) => "loaded",
            WeightSource::Gguf(_) => "gguf",
        },
        build.fdpp_version,
        build.git_commit
    );
    let files = write_e2e_report(&dir, &stem, &title, &records)?;
    let listing: String = files.all().iter().map(|p| format!("  {}\n", p.display())).collect();
    // Keep stdout parseable when it carries CSV or JSON.
    if machine_readable {
        eprint!("report files:\n{listing}");
    } else {
        print!("\nreport files:\n{listing}");
    }

    let bad: Vec<&E2eRecord> = records.iter().filter(|r| !r.is_ok()).collect();
    if !bad.is_empty() {
        eprintln!("\nnot measured ({} row(s)):", bad.len());
        for r in &bad {
            eprintln!(
                "  batch {} prompt {} gen {} ({}{}): {}: {}",
                r.batch,
                r.prompt_len,
                r.gen_len,
                r.profile,
                if r.reuse { "" } else { ", no reuse" },
                r.status,
                r.error.as_deref().unwrap_or("")
            );
        }
        bail!(
            "{} of {} row(s) could not be measured (listed above; the others are in the report)",
            bad.len(),
            records.len()
        );
    }
    Ok(())
}
