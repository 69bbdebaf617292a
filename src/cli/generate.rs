//! `fdpp generate`: prefill and decode a model with the tuned profile, streaming the text (or
//! the ids) and reporting first-token latency, per-token latency and throughput.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::model_setup::{find_profile, weight_source};
use crate::backend::{self, Backend, BackendChoice};
use crate::dtype::DType;
use crate::engine::batch::{generate, GenerateOptions, GenerateOutput};
use crate::engine::build::{
    build, build_rank_model, memory_plan, softmax_label, softmax_setup, EngineOptions, SoftmaxChoice, WeightSource,
};
use crate::engine::memory::MemoryPlan;
use crate::engine::runner::{Engine, DEFAULT_CHUNK};
use crate::engine::sampler::SamplingParams;
use crate::kv::DEFAULT_PAGE_SIZE;
use crate::model::chat::ChatTemplate;
use crate::model::llama::{check_supported, ModelSpec};
use crate::model::tokenizer::Tokenizer;
use crate::tp::Communicator;

/// Tokens of the random prompt used when a model has no tokenizer and no prompt is given.
const DEFAULT_RANDOM_PROMPT: usize = 16;

#[derive(Args, Debug, Clone)]
// Negative numbers (`--temperature -1`, `--phi -3`) parse as values, then are validated.
#[command(allow_negative_numbers = true)]
pub struct GenerateArgs {
    /// An HF model directory (config.json, *.safetensors, tokenizer.json), a GGUF file, or a
    /// preset name (with --random-weights).
    #[arg(long)]
    pub model: String,
    /// Random weights generated on the device (any preset or config), for benchmarks.
    #[arg(long)]
    pub random_weights: bool,
    /// Seed of the random weights, the random prompts and the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tuning profile, or `none` for the backend's built-in GEMM rule [default:
    /// profiles/<device-slug>/<model>.json when it exists].
    #[arg(long)]
    pub profile: Option<String>,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Device ordinal on a GPU backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    #[arg(long, value_enum, default_value_t = DType::F16)]
    pub dtype: DType,
    /// A prompt (needs the model's tokenizer.json); repeat for a batch.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A file whose whole text is one prompt; repeat for a batch.
    #[arg(long)]
    pub prompt_file: Vec<PathBuf>,
    /// Apply the model's chat template (GGUF `tokenizer.chat_template`, or tokenizer_config.json's
    /// `chat_template`) to every --prompt and --prompt-file, as one user turn followed by the
    /// start of the assistant's reply: the input an instruction-tuned model was trained on.
    #[arg(long)]
    pub chat: bool,
    /// A system message before the user turn (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Comma-separated token ids of one prompt, e.g. 1,15043,29892; repeat for a batch.
    #[arg(long)]
    pub token_ids: Vec<String>,
    /// A random prompt of this many tokens; repeat for a batch.
    #[arg(long)]
    pub random_prompt: Vec<usize>,
    /// Most tokens generated per sequence.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Stop a sequence when its text contains this; repeatable.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Do not stop at EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 = no limit.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Attention softmax [default: async, with the profile's φ, a, b when it has them].
    #[arg(long, value_enum)]
    pub softmax: Option<SoftmaxChoice>,
    /// Share of device memory for weights, KV cache and activations.
    #[arg(long, default_value_t = 0.9)]
    pub mem_fraction: f64,
    /// Cap the KV cache at this many tokens [default: all the pool holds on a GPU, what the
    /// request needs on the CPU].
    #[arg(long)]
    pub max_kv_tokens: Option<usize>,
    /// Tokens per KV page.
    #[arg(long, default_value_t = DEFAULT_PAGE_SIZE)]
    pub page_size: usize,
    /// Tokens per prefill step (longer prompts are prefilled in chunks).
    #[arg(long, default_value_t = DEFAULT_CHUNK)]
    pub chunk_size: usize,
    /// One activation buffer per op per layer instead of three reused ones (for comparison).
    #[arg(long)]
    pub no_reuse: bool,
    /// Print one JSON object (tokens, text, timings, memory) instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Tensor parallelism over N ranks (Megatron split of heads and MLP, issue #22): one GPU
    /// per rank through NCCL on CUDA, ranks as threads on the CPU.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// The ranks' GPUs, one per rank, e.g. 0,1 [default: 0..tp].
    #[arg(long)]
    pub devices: Option<String>,
}

#[derive(Serialize)]
struct JsonReport<'a> {
    model: &'a str,
    backend: String,
    device: String,
    dtype: DType,
    /// Tensor-parallel ranks (1: one device).
    tp: usize,
    profile: Option<String>,
    softmax: String,
    load_ms: f64,
    /// Every linear op's implementation at the prefill and decode M, with the reason.
    gemm_plans: Vec<String>,
    memory: &'a MemoryPlan,
    /// How the decode steps' layers after the first ran (CUDA graphs); absent without graphs.
    decode_graphs: Option<crate::backend::GraphCounts>,
    #[serde(flatten)]
    output: &'a GenerateOutput,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    // Cheap checks before a backend starts or a weight is read.
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed,
    };
    sampling.validate()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.max_kv_tokens == Some(0) {
        bail!("--max-kv-tokens must be at least 1 (it caps the KV cache, in tokens); leave it out to size the cache from the prompts");
    }
    if let Some(i) = a.stop.iter().position(String::is_empty) {
        bail!(
            "--stop (number {}) is empty: it would end every sequence at once; give the text to stop at",
            i + 1
        );
    }
    if let Some(i) = a.prompt.iter().position(|p| p.is_empty()) {
        bail!(
            "--prompt (number {}) is empty: give the text to continue, or --token-ids / --random-prompt",
            i + 1
        );
    }
    let spec = ModelSpec::resolve(&a.model)?;
    check_supported(&spec.cfg)?;
    let tp = if a.tp != 1 || a.devices.is_some() {
        if a.device != 0 {
            bail!("--device picks one GPU; with --tp give the ranks' GPUs with --devices");
        }
        Some(super::tp::prepare(&spec.cfg, a.tp, a.devices.as_deref(), a.backend)?)
    } else {
        None
    };
    let source = weight_source(&spec, &a.model, a.random_weights, a.seed)?;
    // A tokenizer that does not load is an error only where text must be encoded; with token ids
    // the output is shown as ids.
    let needs_text = !a.prompt.is_empty() || !a.prompt_file.is_empty();
    let tok = match spec.tokenizer_path() {
        Some(p) => match ModelSpec::load_tokenizer(&p) {
            Ok(t) => Some(t),
            Err(e) if !needs_text => {
                eprintln!(
                    "warning: {} does not load ({e}); generating from the token ids given, output shown as ids",
                    p.display()
                );
                None
            }
            Err(e) => return Err(e.into()),
        },
        None => None,
    };
    let chat = if a.chat {
        if !a.token_ids.is_empty() || !a.random_prompt.is_empty() {
            bail!("--chat templates text prompts only; --token-ids and --random-prompt are ids already (drop --chat, or give the text with --prompt)");
        }
        if !needs_text {
            bail!("--chat applies the model's chat template to --prompt or --prompt-file text; give one of them");
        }
        let t = spec.chat_template(tok.as_ref())?;
        eprintln!("chat template: {}", t.source);
        Some(t)
    } else {
        if a.system.is_some() {
            bail!("--system is a message of the chat template: add --chat");
        }
        None
    };
    let prompts = collect_prompts(&a, tok.as_ref(), chat.as_ref(), spec.cfg.vocab_size)?;
    if let Some((kind, devices)) = tp {
        let job = GenerateJob {
            a: &a,
            spec: &spec,
            source: &source,
            tok: tok.as_ref(),
            prompts: &prompts,
            sampling,
        };
        return super::tp::run(kind, &devices, &job);
    }
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => run_on(b, &a, &spec, &source, tok.as_ref(), &prompts, sampling, None))
}

/// `generate --tp N`: every rank runs the same generation; rank 0 prints.
struct GenerateJob<'a> {
    a: &'a GenerateArgs,
    spec: &'a ModelSpec,
    source: &'a WeightSource,
    tok: Option<&'a Tokenizer>,
    prompts: &'a [Vec<u32>],
    sampling: SamplingParams,
}

impl super::tp::RankJob for GenerateJob<'_> {
    fn run<B: Backend>(&self, b: &B, comm: Arc<dyn Communicator<B>>) -> anyhow::Result<()> {
        run_on(
            b,
            self.a,
            self.spec,
            self.source,
            self.tok,
            self.prompts,
            self.sampling,
            Some(comm),
        )
    }
}

/// Prompts from --prompt, --prompt-file, --token-ids and --random-prompt, in that order; a
/// model without a tokenizer and no prompt gets one random prompt (its ids are printed). With
/// `chat`, each text is rendered as a user turn and encoded as it is (the template writes the
/// special tokens, BOS included where the model wants it, as HF's apply_chat_template does).
fn collect_prompts(
    a: &GenerateArgs,
    tok: Option<&Tokenizer>,
    chat: Option<&ChatTemplate>,
    vocab: usize,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let need_tok = |what: &str| {
        tok.with_context(|| {
            format!(
                "{what} needs the model's tokenizer.json, and '{}' has none; give --token-ids or --random-prompt",
                a.model
            )
        })
    };
    let encode = |what: &str, text: &str| -> anyhow::Result<Vec<u32>> {
        let t = need_tok(what)?;
        Ok(match chat {
            Some(c) => t.encode_plain(&c.prompt(text, a.system.as_deref())?)?,
            None => t.encode(text)?,
        })
    };
    let mut out = Vec::new();
    for p in &a.prompt {
        out.push(encode("--prompt", p)?);
    }
    for f in &a.prompt_file {
        let text = std::fs::read_to_string(f).with_context(|| format!("--prompt-file {}", f.display()))?;
        out.push(encode("--prompt-file", &text)?);
    }
    for s in &a.token_ids {
        out.push(parse_ids(s)?);
    }
    let mut random = a.random_prompt.clone();
    if out.is_empty() && random.is_empty() {
        if tok.is_some() {
            bail!("give a prompt: --prompt TEXT, --prompt-file FILE, --token-ids 1,2,3 or --random-prompt N");
        }
        random.push(DEFAULT_RANDOM_PROMPT);
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(a.seed ^ 0x7072_6f6d_7074);
    for &n in &random {
        if n == 0 {
            bail!("--random-prompt must be at least 1 token");
        }
        let ids: Vec<u32> = (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect();
        // A long prompt's ids would bury the output: the first and last few say which it was.
        const SHOWN: usize = 8;
        if n <= 4 * SHOWN {
            eprintln!("random prompt of {n} tokens: {}", join_ids(&ids));
        } else {
            eprintln!(
                "random prompt of {n} tokens: {},…,{} (seed {}; the first and last {SHOWN} shown)",
                join_ids(&ids[..SHOWN]),
                join_ids(&ids[n - SHOWN..]),
                a.seed
            );
        }
        out.push(ids);
    }
    Ok(out)
}

pub fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    if s.trim().is_empty() {
        bail!("--token-ids '{s}' holds no ids; give e.g. --token-ids 1,2,3");
    }
    let ids = s
        .split(',')
        .map(|t| t.trim())
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                bail!(
                    "--token-ids '{s}': entry {} is empty (two commas in a row, or one at an end)",
                    i + 1
                );
            }
            t.parse::<u32>()
                .with_context(|| format!("--token-ids '{s}': '{t}' is not a token id (a non-negative integer)"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--token-ids '{s}' holds no ids; give e.g. --token-ids 1,2,3");
    }
    Ok(ids)
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// One generation on `b`; with `comm`, as one rank of a tensor-parallel group (its share of
/// the model, its profile by the per-rank shapes; only rank 0 prints).
#[allow(clippy::too_many_arguments)]
fn run_on<B: Backend>(
    b: &B,
    a: &GenerateArgs,
    whole: &ModelSpec,
    source: &WeightSource,
    tok: Option<&Tokenizer>,
    prompts: &[Vec<u32>],
    sampling: SamplingParams,
    comm: Option<Arc<dyn Communicator<B>>>,
) -> anyhow::Result<()> {
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
    let lead = rank == 0;
    // Rank 0 speaks for the group: the ranks' notes are the same but for their device.
    macro_rules! say {
        ($($t:tt)*) => {
            if lead {
                eprintln!($($t)*);
            }
        };
    }
    let rank_spec = crate::tp::rank_spec(whole, world)?;
    let spec = &rank_spec;
    let (found, profile_note) = find_profile(b, a.profile.as_deref(), spec, &a.model, a.dtype)?;
    say!("{profile_note}");
    let profile_path = found.as_ref().map(|f| f.path.display().to_string());
    let profile = found.map(|f| f.profile);
    let (scheme, layer_schemes, softmax_note) = softmax_setup(a.softmax, profile.as_ref(), spec.cfg.num_layers)?;
    say!("{softmax_note}");
    let softmax = softmax_label(scheme, &layer_schemes);
    let opts = EngineOptions {
        dtype: a.dtype,
        mem_fraction: a.mem_fraction,
        page_size: a.page_size,
        chunk: a.chunk_size,
        reuse: !a.no_reuse,
        max_kv_tokens: a.max_kv_tokens,
        scheme,
        layer_schemes,
    };
    let context = spec.context_len();
    crate::engine::batch::check_prompts(prompts, spec.cfg.vocab_size, context)?;
    let seq_tokens: Vec<usize> = prompts.iter().map(|p| (p.len() + a.max_tokens).min(context)).collect();
    let prompt_tokens = prompts.iter().map(|p| p.len()).sum();
    let plan = memory_plan(b, spec, &opts, &seq_tokens, prompt_tokens)?;
    for line in plan.summary() {
        say!("{line}");
    }
    let t_load = Instant::now();
    let mut engine = match comm {
        Some(c) => Engine::new(build_rank_model(b, whole, source, profile, &opts, c)?, plan)?,
        None => build(b, spec, source, profile, &opts, plan)?,
    };
    b.synchronize()?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    say!("weights: {} in {load_ms:.0} ms", source.describe());
    if world > 1 {
        say!(
            "tensor parallel: rank 0 of {world} holds {} of {} heads, {} KV heads, intermediate {} of {}{}",
            spec.cfg.num_heads,
            whole.cfg.num_heads,
            spec.cfg.num_kv_heads,
            spec.cfg.intermediate_size,
            whole.cfg.intermediate_size,
            if spec.cfg.num_kv_heads * world > whole.cfg.num_kv_heads {
                " (KV heads replicated over ranks)"
            } else {
                ""
            }
        );
    }
    let steps = [("prefill", prompt_tokens.min(opts.chunk)), ("decode", prompts.len())];
    let mut gemm_plans = Vec::new();
    for (what, m) in steps {
        say!("gemm at {what} M={m}: {}", engine.model.linears.summary(m));
        gemm_plans.extend(
            engine
                .model
                .linears
                .describe(m)
                .into_iter()
                .map(|l| l.trim().to_string()),
        );
    }
    let gen = GenerateOptions {
        max_tokens: a.max_tokens,
        eos_ids: spec.extras.eos_token_ids.clone(),
        ignore_eos: a.ignore_eos,
        stop: a.stop.clone(),
        sampling,
        chunk: opts.chunk,
        context_len: context,
        pipeline: true,
    };
    let stream = lead && !a.json && prompts.len() == 1;
    let mut stdout = std::io::stdout();
    let mut on_token = |_: usize, id: u32, piece: &str| {
        if !stream {
            return;
        }
        // A closed pipe ends the process through SIGPIPE (see main); other write errors are
        // not worth failing a generation for.
        let _ = match tok {
            Some(_) => write!(stdout, "{piece}"),
            None => write!(stdout, "{id} "),
        };
        let _ = stdout.flush();
    };
    let out = generate(&mut engine, prompts, &gen, tok, &mut on_token)?;
    if !lead {
        return Ok(());
    }
    for (op, ms, calls) in engine.model.op_times.report() {
        eprintln!("op time (FDPP_OP_TIMES, with a wait after every op): {op:<24} {ms:10.2} ms in {calls} calls");
    }
    if a.json {
        let report = JsonReport {
            model: &spec.cfg.name,
            backend: b.info().backend.to_string(),
            device: b.info().name.clone(),
            dtype: a.dtype,
            tp: world,
            profile: profile_path,
            softmax,
            load_ms,
            gemm_plans,
            memory: &engine.memory,
            decode_graphs: b.graph_counts(),
            output: &out,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        if stream {
            println!();
        } else {
            print_batch(&out, tok.is_some());
        }
        print_timings(&out);
        if let Some(g) = b.graph_counts() {
            eprintln!(
                "decode graphs (layers 1..): {} replayed, {} captured, {} eager",
                g.replayed, g.captured, g.eager
            );
        }
    }
    Ok(())
}

fn print_batch(out: &GenerateOutput, text: bool) {
    for (i, s) in out.seqs.iter().enumerate() {
        println!(
            "--- sequence {i} ({} prompt tokens, {:?}) ---",
            s.prompt.len(),
            s.finish
        );
        match (&s.text, text) {
            (Some(t), true) => println!("{t}"),
            _ => println!("{}", join_ids(&s.tokens)),
        }
    }
}

fn print_timings(out: &GenerateOutput) {
    let t = &out.timings;
    eprintln!(
        "first token: {:.2} ms; per token: {:.2} ms ({} decode steps); decode: {:.1} tok/s ({} tokens); total {:.1} ms",
        t.first_token_ms, t.per_token_ms, t.decode_steps, t.decode_tok_per_s, t.decode_tokens, t.total_ms
    );
    for (i, s) in out.seqs.iter().enumerate() {
        if out.seqs.len() > 1 {
            eprintln!(
                "  sequence {i}: {} tokens, first after {:.2} ms, finished by {:?}",
                s.tokens.len(),
                s.first_token_ms,
                s.finish
            );
        }
        // Running out of context is not what --max-tokens asked for: say so, not only in --json.
        if s.finish == crate::engine::batch::FinishReason::Context {
            eprintln!(
                "note: sequence {i} stopped after {} tokens at the end of the model's context ({} prompt + {} generated), before --max-tokens",
                s.tokens.len(),
                s.prompt.len(),
                s.tokens.len()
            );
        } else if s.finish != crate::engine::batch::FinishReason::MaxTokens && out.seqs.len() == 1 {
            // Why it stopped before --max-tokens, without --json.
            let why = match s.finish {
                crate::engine::batch::FinishReason::Eos => "at the end-of-sequence token (--ignore-eos goes on)",
                _ => "at a --stop text",
            };
            eprintln!(
                "note: sequence {i} stopped after {} tokens {why}, before --max-tokens",
                s.tokens.len()
            );
        }
    }
    if out.attention.recomputed > 0 {
        eprintln!(
            "async softmax: {} of {} attention rows recomputed with the sync scheme",
            out.attention.recomputed, out.attention.rows
        );
    }
}
