//! `fdpp tune --model X --calibrate`: the asynchronous softmax's φ and [a, b] for a model
//! (FlashDecoding++ §3), from the scores x = q·k/√d its attention computes on calibration
//! prompts, checked on held-out prompts, stored in the profile's softmax section.
//!
//! Steps: run the calibration prompts (prefill, then greedy decode steps) with the engine's
//! statistics mode on and the sync softmax; choose the window from the histogram of every
//! layer's scores (and each layer's, for inspection) with [`choose_window`]; run the held-out
//! prompts with the sync softmax and with the chosen async one, and compare (recompute rate,
//! last-logit difference, greedy tokens); write the profile and the report.
//!
//! The GEMM sweep is not run: an existing profile at the path gets the section added (its GEMM
//! measurements are kept); without one, a profile with only the model's shapes and the softmax
//! section is written (select() then uses the vendor GEMM until `fdpp tune` adds the sweep, which
//! keeps the section).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use rand::{Rng, SeedableRng};

use super::tune::default_report_dir;
use super::tune::TuneArgs;
use crate::backend::{self, Backend};
use crate::cli::perplexity::score_on_engine;
use crate::engine::build::{build, layer_schemes, memory_plan, EngineOptions, WeightSource, WindowsChoice};
use crate::engine::runner::Engine;
use crate::kv::BlockTable;
use crate::model::llama::{check_supported, ModelSpec};
use crate::model::tokenizer::Tokenizer;
use crate::ops::attention::{AttnStats, SoftmaxScheme};
use crate::ops::scores::{HistSpec, ScoreHist, ScoreStatsParams};
use crate::profile::{self, LayerWindow, Profile, SoftmaxSection, WindowComparison};
use crate::report::softmax::{write_softmax_report, Marked, SoftmaxFiles, SoftmaxReport};
use crate::tune::softmax::{choose_window, Choice, DEFAULT_COVERAGE, MAX_WINDOW};

/// Async and sync last logits must agree to this, relative to the largest |sync| logit.
pub const LOGIT_TOLERANCE: f64 = 1e-3;
/// Prefill chunk of the second sync run that measures the fp16 noise floor.
pub const NOISE_FLOOR_CHUNK: usize = 64;

/// The calibration options of `fdpp tune` (used with `--calibrate`).
#[derive(Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// Calibrate the asynchronous softmax instead of sweeping the GEMMs: gather the softmax
    /// inputs on calibration prompts, choose φ, a, b, validate them on held-out prompts, and add
    /// them to the profile (an existing profile keeps its GEMM sweep; without one, a profile with
    /// only the softmax section is written and `fdpp tune` adds the sweep later, keeping it).
    #[arg(long)]
    pub calibrate: bool,
    /// Calibration prompts, one per line: text (needs the model's tokenizer.json) or
    /// comma-separated token ids. The last --held-out lines are the held-out set [default: a
    /// built-in set of varied text with a tokenizer, else seeded random token prompts].
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Share of the scores the window [φ + a, φ + b] must hold.
    #[arg(long, default_value_t = DEFAULT_COVERAGE)]
    pub coverage: f64,
    /// Held-out prompts for the validation (async vs sync, recompute rate).
    #[arg(long, default_value_t = 4)]
    pub held_out: usize,
    /// Random weights even when the model directory has safetensors.
    #[arg(long)]
    pub random_weights: bool,
    /// Seed of the random weights and the random prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Random calibration prompts (models without a tokenizer).
    #[arg(long, default_value_t = 8)]
    pub random_prompts: usize,
    /// Tokens of the longest random prompt (the others are shorter, down to half).
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    /// Greedy decode steps after each prefill (decode-time scores; the greedy tokens compared).
    #[arg(long, default_value_t = 8)]
    pub decode_steps: usize,
    /// A text whose perplexity the comparison of windows reports (sync, global, per-layer),
    /// scored as `fdpp perplexity` does [default: the held-out prompts, one window each].
    #[arg(long)]
    pub ppl_text: Option<PathBuf>,
    /// Tokens of --ppl-text scored (its first N; 0: all).
    #[arg(long, default_value_t = 1024)]
    pub ppl_tokens: usize,
    /// Window length of the --ppl-text perplexity.
    #[arg(long, default_value_t = crate::cli::perplexity::DEFAULT_CTX)]
    pub ppl_ctx: usize,
}

impl Default for CalibrateArgs {
    fn default() -> Self {
        CalibrateArgs {
            calibrate: false,
            prompts: None,
            coverage: DEFAULT_COVERAGE,
            held_out: 4,
            random_weights: false,
            seed: 0,
            random_prompts: 8,
            prompt_len: 256,
            decode_steps: 8,
            ppl_text: None,
            ppl_tokens: 1024,
            ppl_ctx: crate::cli::perplexity::DEFAULT_CTX,
        }
    }
}

/// Varied text for models with a tokenizer: prose, dialogue, code, numbers, lists, other
/// languages (the score distribution depends on what the model reads).
pub const BUILTIN_PROMPTS: [&str; 12] = [
    "The river had been rising for three days, and by the fourth morning the villagers carried \
     their grain to the church on the hill, the only building old enough to have seen a flood like this.",
    "Q: Why does ice float on water?\nA: Because water expands as it freezes, so ice is less dense \
     than the liquid around it. Q: What would happen to lakes in winter if it did not?\nA:",
    "fn fibonacci(n: u64) -> u64 {\n    let (mut a, mut b) = (0, 1);\n    for _ in 0..n {\n        \
     let t = a + b;\n        a = b;\n        b = t;\n    }\n    a\n}\n\n// Tests for the function above:\n",
    "Quarterly results: revenue 41.7 million (+12 %), operating margin 18.3 %, 2,340 employees in \
     14 countries; the board proposes a dividend of 0.85 per share, payable on 15 May.",
    "Shopping list for the weekend:\n- two loaves of rye bread\n- a dozen eggs\n- olive oil\n- \
     tomatoes, basil, garlic\n- coffee beans (dark roast)\n- batteries for the kitchen clock\n-",
    "La ciudad despertó bajo una niebla espesa. Los tranvías avanzaban despacio y los vendedores \
     del mercado encendían lámparas aunque ya eran las ocho de la mañana.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        \
     if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n",
    "Dear Ms. Okafor, thank you for your letter of 3 March. I am sorry to hear that the parcel \
     arrived damaged; we will send a replacement today and you need not return the original.",
    "Theorem. For every prime p and integer a not divisible by p, a^(p-1) ≡ 1 (mod p). Proof. \
     Consider the p-1 numbers a, 2a, ..., (p-1)a taken modulo p.",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent FROM orders WHERE created_at >= \
     '2023-01-01' GROUP BY customer_id HAVING COUNT(*) > 5 ORDER BY spent DESC LIMIT 20;",
    "Der Zug nach München hatte zwanzig Minuten Verspätung, und auf dem Bahnsteig drängten sich \
     Reisende mit Koffern, Fahrrädern und einem Hund, der geduldig wartete.",
    "Once upon a time a fox found a bunch of grapes hanging from a high vine. He jumped and jumped \
     but could not reach them, and at last he walked away, saying",
];

/// What a calibration produced.
pub struct CalibrateOutcome {
    pub profile: Profile,
    pub profile_path: PathBuf,
    pub report: SoftmaxFiles,
    /// The report's text (every line printed) as markdown.
    pub report_md: PathBuf,
    /// The lines printed for the user.
    pub lines: Vec<String>,
}

/// `fdpp tune --calibrate`: resolve, open the backend, run.
pub fn run(a: &TuneArgs) -> anyhow::Result<()> {
    check_args(&a.calibrate)?;
    let spec = ModelSpec::resolve(&a.model)?;
    check_supported(&spec.cfg)?;
    let (any, note) = backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    let out = crate::with_backend!(&any, b => run_with_backend(b, a, &spec))?;
    for l in &out.lines {
        println!("{l}");
    }
    eprintln!("profile: {}", out.profile_path.display());
    eprintln!("report: {}", out.report.csv.display());
    eprintln!("report: {}", out.report.svg.display());
    eprintln!("report: {}", out.report_md.display());
    Ok(())
}

fn check_args(c: &CalibrateArgs) -> anyhow::Result<()> {
    if !(c.coverage > 0.0 && c.coverage <= 1.0) {
        bail!(
            "--coverage {}: must be in (0, 1], e.g. 0.9999 for 99.99 % of the scores",
            c.coverage
        );
    }
    if c.held_out == 0 {
        bail!("--held-out must be at least 1 (the validation runs the chosen window on held-out prompts)");
    }
    if c.random_prompts == 0 || c.prompt_len < 2 {
        bail!("--random-prompts must be at least 1 and --prompt-len at least 2");
    }
    if c.decode_steps == 0 {
        bail!("--decode-steps must be at least 1");
    }
    if c.ppl_ctx < 2 {
        bail!(
            "--ppl-ctx {}: a perplexity window needs at least 2 tokens (one to condition on, one scored)",
            c.ppl_ctx
        );
    }
    Ok(())
}

fn has_safetensors(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
    })
}

/// (calibration prompts, held-out prompts, a line saying what they are).
type PromptSets = (Vec<Vec<u32>>, Vec<Vec<u32>>, String);

/// Calibration and held-out prompts, and a line saying what they are.
fn prompts(c: &CalibrateArgs, tok: Option<&Tokenizer>, vocab: usize, max_len: usize) -> anyhow::Result<PromptSets> {
    let cut = |mut p: Vec<u32>| {
        p.truncate(max_len);
        p
    };
    let split = |all: Vec<Vec<u32>>, what: &str| -> anyhow::Result<PromptSets> {
        if all.len() <= c.held_out {
            bail!(
                "{what} holds {} prompts: need more than --held-out {} (the last {} are held out)",
                all.len(),
                c.held_out,
                c.held_out
            );
        }
        let mut calib: Vec<Vec<u32>> = all.into_iter().map(cut).collect();
        let held = calib.split_off(calib.len() - c.held_out);
        let line = format!("{what}: {} calibration prompts, {} held out", calib.len(), held.len());
        Ok((calib, held, line))
    };
    if let Some(path) = &c.prompts {
        let text = std::fs::read_to_string(path).with_context(|| format!("--prompts {}", path.display()))?;
        let mut all = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let ids: Option<Vec<u32>> = line.split(',').map(|t| t.trim().parse::<u32>().ok()).collect();
            let p = match (ids, tok) {
                (Some(ids), _) => ids,
                (None, Some(t)) => t.encode(line)?,
                (None, None) => bail!(
                    "--prompts {} line {}: text needs the model's tokenizer.json, which it has none of; \
                     give comma-separated token ids",
                    path.display(),
                    i + 1
                ),
            };
            if p.is_empty() {
                bail!("--prompts {} line {}: no tokens", path.display(), i + 1);
            }
            all.push(p);
        }
        return split(all, &format!("prompts from {}", path.display()));
    }
    if let Some(t) = tok {
        let all = BUILTIN_PROMPTS
            .iter()
            .map(|p| t.encode(p))
            .collect::<crate::Result<Vec<_>>>()?;
        return split(all, "built-in text prompts");
    }
    // Seeded random ids: lengths from half of --prompt-len up to it; the held-out set from
    // another seed.
    let random = |n: usize, seed: u64| -> Vec<Vec<u32>> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                let half = c.prompt_len / 2;
                let len = half + (c.prompt_len - half) * (i + 1) / n;
                cut((0..len.max(1)).map(|_| rng.gen_range(0..vocab as u32)).collect())
            })
            .collect()
    };
    let calib = random(c.random_prompts, c.seed ^ 0x6361_6c69_6272);
    let held = random(c.held_out, c.seed ^ 0x6865_6c64_6f75);
    let line = format!(
        "random token prompts (seed {}; no tokenizer): {} calibration prompts, {} held out (another seed)",
        c.seed,
        calib.len(),
        held.len()
    );
    Ok((calib, held, line))
}

/// One greedy run of a batch: the tokens, the logits of every step ([step][sequence]) and the
/// attention rows computed and recomputed.
struct GreedyRun {
    tokens: Vec<Vec<u32>>,
    logits: Vec<Vec<Vec<f32>>>,
    attn: AttnStats,
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill the prompts together (in steps of at most `chunk` tokens), then `steps` greedy decode
/// steps; the pages are given back.
fn greedy<B: Backend>(
    e: &mut Engine<'_, B>,
    prompts: &[Vec<u32>],
    steps: usize,
    chunk: usize,
) -> crate::Result<GreedyRun> {
    let before = e.attn;
    let mut tables = vec![BlockTable::default(); prompts.len()];
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut logits = vec![e.prefill(&mut tables, &refs, chunk, &mut |_, _| Ok(()))?];
    let mut tokens = vec![Vec::new(); prompts.len()];
    for _ in 0..steps {
        let next: Vec<u32> = logits
            .last()
            .map(|l| l.iter().map(|r| argmax(r)).collect())
            .unwrap_or_default();
        for (t, &n) in tokens.iter_mut().zip(&next) {
            t.push(n);
        }
        let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
        logits.push(e.decode(&mut refs, &next)?);
    }
    if let Some(last) = logits.last() {
        for (t, r) in tokens.iter_mut().zip(last) {
            t.push(argmax(r));
        }
    }
    for t in &mut tables {
        e.release(t)?;
    }
    Ok(GreedyRun {
        tokens,
        logits,
        attn: AttnStats {
            rows: e.attn.rows - before.rows,
            recomputed: e.attn.recomputed - before.recomputed,
            splits: 0,
        },
    })
}

/// Largest |a − s| over the largest |s|, over the steps where each sequence's tokens so far
/// agree (later logits follow other tokens and are not comparable).
fn logit_diff(asy: &GreedyRun, sync: &GreedyRun) -> f64 {
    let (mut diff, mut scale) = (0f64, 0f64);
    for (step, (la, ls)) in asy.logits.iter().zip(&sync.logits).enumerate() {
        for (s, (ra, rs)) in la.iter().zip(ls).enumerate() {
            if asy.tokens[s][..step] != sync.tokens[s][..step] {
                continue;
            }
            for (&x, &y) in ra.iter().zip(rs) {
                diff = diff.max((x as f64 - y as f64).abs());
                scale = scale.max((y as f64).abs());
            }
        }
    }
    diff / scale.max(f64::MIN_POSITIVE)
}

fn layer_window(l: usize, h: &ScoreHist, coverage: f64) -> crate::Result<LayerWindow> {
    Ok(match choose_window(h, coverage)? {
        Choice::Async(w) => LayerWindow {
            layer: l,
            phi: w.phi,
            a: w.a,
            b: w.b,
            coverage: w.coverage,
            samples: w.samples,
            min: w.min,
            max: w.max,
            reason: None,
        },
        Choice::TooWide {
            core,
            samples,
            min,
            max,
            reason,
        } => {
            let phi = (core.0 + core.1) / 2.0;
            LayerWindow {
                layer: l,
                phi,
                a: core.0 - phi,
                b: core.1 - phi,
                coverage,
                samples,
                min,
                max,
                reason: Some(reason),
            }
        }
    })
}

/// FlashDecoding++ §3's range for Llama2-7B: over 99.99 % of its softmax inputs lie here.
pub const PAPER_RANGE: (f64, f64) = (-16.8, 6.5);

/// Share of the histogram's scores in [lo, hi], a bin cut by an edge counted in proportion
/// (scores spread evenly within a bin); scores outside the bins count as outside.
pub fn share_within(h: &ScoreHist, lo: f64, hi: f64) -> f64 {
    let (start, w) = (h.spec.lo as f64, h.spec.width() as f64);
    let inside: f64 = h
        .counts
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let (l, r) = (start + i as f64 * w, start + (i + 1) as f64 * w);
            let overlap = (r.min(hi) - l.max(lo)).max(0.0);
            n as f64 * overlap / w
        })
        .sum();
    inside / h.count.max(1) as f64
}

/// What the scores look like, in one plain line, against the paper's Llama2-7B range.
fn distribution_line(
    h: &ScoreHist,
    per_layer: &[LayerWindow],
    paper_share: f64,
    coverage: f64,
) -> crate::Result<String> {
    let core = match choose_window(h, coverage)? {
        Choice::Async(w) => w.core,
        Choice::TooWide { core, .. } => core,
    };
    let (plo, phi) = per_layer.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, r), w| {
        (l.min(w.phi), r.max(w.phi))
    });
    let layers = if per_layer.is_empty() {
        String::new()
    } else {
        format!(
            "; each layer's scores sit elsewhere: per-layer phi from {plo:.2} to {phi:.2}, layer cores {:.1} to {:.1} wide",
            per_layer.iter().map(|w| w.b - w.a).fold(f64::INFINITY, f64::min),
            per_layer.iter().map(|w| w.b - w.a).fold(0.0, f64::max)
        )
    };
    Ok(format!(
        "distribution: {:.4} % of the scores lie in FlashDecoding++'s Llama2-7B range [{}, {}] (the paper: > 99.99 %); \
         {:.2} % of them lie in [{:.2}, {:.2}], {:.1} wide (the paper's range is {:.1} wide), extremes [{:.2}, {:.2}]{layers}",
        paper_share * 100.0,
        PAPER_RANGE.0,
        PAPER_RANGE.1,
        coverage * 100.0,
        core.0,
        core.1,
        core.1 - core.0,
        PAPER_RANGE.1 - PAPER_RANGE.0,
        h.min,
        h.max
    ))
}

/// The perplexity the comparison reports: windows of token ids, each scored as `fdpp
/// perplexity` scores a window, and what they are.
struct PplInput {
    windows: Vec<(Vec<u32>, usize)>,
    what: String,
    line: String,
}

fn ppl_input(a: &TuneArgs, tok: Option<&Tokenizer>, held: &[Vec<u32>], context: usize) -> anyhow::Result<PplInput> {
    let c = &a.calibrate;
    let Some(path) = &c.ppl_text else {
        let n: usize = held.iter().map(|p| p.len().saturating_sub(1)).sum();
        return Ok(PplInput {
            windows: held.iter().map(|p| (p.clone(), p.len())).collect(),
            what: format!("perplexity over the held-out prompts, {n} tokens scored"),
            line: format!(
                "perplexity: over the held-out prompts ({n} tokens scored; --ppl-text FILE scores a longer text)"
            ),
        });
    };
    let t = tok.with_context(|| {
        format!(
            "--ppl-text {}: scoring a text needs the model's tokenizer, and '{}' has none",
            path.display(),
            a.model
        )
    })?;
    let text = std::fs::read_to_string(path).with_context(|| format!("--ppl-text {}", path.display()))?;
    let mut ids = t.encode_plain(&text)?;
    if c.ppl_tokens > 0 {
        ids.truncate(c.ppl_tokens);
    }
    if ids.len() < 2 {
        bail!(
            "--ppl-text {}: {} tokens; at least 2 are needed",
            path.display(),
            ids.len()
        );
    }
    let ctx = c.ppl_ctx.min(context);
    let what = format!(
        "perplexity over {} tokens of {} in windows of {ctx}",
        ids.len(),
        path.display()
    );
    Ok(PplInput {
        line: format!(
            "perplexity: {} tokens of {} in windows of {ctx}",
            ids.len(),
            path.display()
        ),
        windows: vec![(ids, ctx)],
        what,
    })
}

/// exp(mean NLL) over every window, and the tokens scored.
fn ppl_of<B: Backend>(e: &mut Engine<'_, B>, windows: &[(Vec<u32>, usize)]) -> crate::Result<(f64, u64)> {
    let (mut nll, mut n) = (0.0, 0usize);
    for (ids, ctx) in windows {
        let (r, _) = score_on_engine(e, ids, *ctx)?;
        nll += r.nll_sum;
        n += r.tokens_scored;
    }
    let ppl = if n == 0 { f64::NAN } else { (nll / n as f64).exp() };
    Ok((ppl, n as u64))
}

/// One async run against the sync one, with its perplexity (the engine's scheme as it is).
fn compare<B: Backend>(
    windows: &str,
    asy: &GreedyRun,
    sync: &GreedyRun,
    e: &mut Engine<'_, B>,
    ppl_windows: &[(Vec<u32>, usize)],
) -> anyhow::Result<WindowComparison> {
    let (ppl, tokens) =
        ppl_of(e, ppl_windows).with_context(|| format!("perplexity, async softmax, {windows} windows"))?;
    Ok(WindowComparison {
        windows: windows.into(),
        recompute_rate: Some(asy.attn.recomputed as f64 / asy.attn.rows.max(1) as f64),
        logit_diff: Some(logit_diff(asy, sync)),
        same_tokens: Some(asy.tokens == sync.tokens),
        ppl: Some(ppl),
        ppl_tokens: tokens,
    })
}

/// ok within [`LOGIT_TOLERANCE`]; else ok when within twice the fp16 rounding floor measured by
/// moving φ (the difference is then rounding, not the window); else FAIL.
fn verdict(what: &str, r: &WindowComparison, floor: f64, async_floor: f64) -> String {
    let diff = r.logit_diff.unwrap_or(f64::NAN);
    format!(
        "held-out async vs sync, {what}: logits max diff {diff:.2e} of the largest logit ({}; sync vs sync with \
         {NOISE_FLOOR_CHUNK}-token prefill chunks differs by {floor:.2e}: the fp16 floor), greedy tokens {}",
        if diff <= LOGIT_TOLERANCE {
            format!("ok, ≤ {LOGIT_TOLERANCE:e}")
        } else if diff <= 2.0 * async_floor {
            format!(
                "ok: above {LOGIT_TOLERANCE:e} but within twice the fp16 rounding floor {async_floor:.2e} of async vs \
                 async with phi moved by 0.5, so rounding and not the window"
            )
        } else {
            format!("FAIL, > {LOGIT_TOLERANCE:e} and > twice the fp16 rounding floor {async_floor:.2e}")
        },
        if r.same_tokens == Some(true) {
            "the same"
        } else {
            "DIFFER (a near-tie flipped; the phi-moved run is compared in the line above)"
        }
    )
}

/// `floor`: sync vs sync in other prefill chunks; `async_floor`: async vs async with φ moved.
pub fn comparison_table(rows: &[WindowComparison], floor: f64, async_floor: Option<f64>) -> String {
    let sync_ppl = rows.iter().find(|r| r.windows == "sync").and_then(|r| r.ppl);
    let mut out = String::from(
        "| softmax | recompute rate | async − sync max logit diff | greedy tokens | PPL | PPL vs sync |\n\
         |---|---|---|---|---|---|\n",
    );
    for r in rows {
        let name = match r.windows.as_str() {
            "sync" => "sync".to_string(),
            "global" => "async, global window".to_string(),
            "per_layer" => "async, per-layer windows".to_string(),
            other => other.to_string(),
        };
        let rel = match (r.ppl, sync_ppl) {
            (Some(p), Some(s)) if r.windows != "sync" && s > 0.0 => format!("{:+.4} %", (p / s - 1.0) * 100.0),
            _ => "–".into(),
        };
        out.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {rel} |\n",
            r.recompute_rate.map_or("–".into(), |x| format!("{:.4} %", x * 100.0)),
            r.logit_diff.map_or(
                format!(
                    "(floors: sync chunks {floor:.2e}{})",
                    async_floor.map_or(String::new(), |f| format!(", async phi+0.5 {f:.2e}"))
                ),
                |x| format!("{x:.2e}")
            ),
            r.same_tokens
                .map_or("–".into(), |x| if x { "same".into() } else { "DIFFER".to_string() }),
            r.ppl.map_or("–".into(), |x| format!("{x:.4}")),
        ));
    }
    out
}

/// The calibration on an opened backend. Nothing is written unless every run succeeds.
pub fn run_with_backend<B: Backend>(b: &B, a: &TuneArgs, spec: &ModelSpec) -> anyhow::Result<CalibrateOutcome> {
    let c = &a.calibrate;
    check_args(c)?;
    let cfg = &spec.cfg;
    let info = b.info().clone();
    let mut lines = vec![format!(
        "softmax calibration: {} on {} ({}, {})",
        cfg.name, info.name, info.backend, a.dtype
    )];

    // Weights and prompts.
    let trained = (spec.dir.as_deref().is_some_and(has_safetensors) || spec.gguf.is_some()) && !c.random_weights;
    let source = match (&spec.dir, &spec.gguf, trained) {
        (_, Some(g), true) => WeightSource::Gguf(g.clone()),
        (Some(dir), _, true) => WeightSource::Dir(dir.clone()),
        _ => WeightSource::Random { seed: c.seed },
    };
    let weights_line = match &source {
        WeightSource::Dir(d) | WeightSource::Gguf(d) => format!("weights: {}", d.display()),
        WeightSource::Random { seed } => format!(
            "weights: random (seed {seed}): the score distribution below is that of random weights, not of the trained model"
        ),
    };
    lines.push(weights_line.clone());
    let tok = match spec.tokenizer_path() {
        Some(p) => Some(ModelSpec::load_tokenizer(&p)?),
        None => None,
    };
    let context = spec.context_len();
    if context <= c.decode_steps {
        bail!(
            "--decode-steps {} leaves no room for a prompt in the model's context of {context}",
            c.decode_steps
        );
    }
    let (calib, held, prompt_line) = prompts(c, tok.as_ref(), cfg.vocab_size, context - c.decode_steps)?;
    lines.push(prompt_line.clone());
    crate::engine::batch::check_prompts(&calib, cfg.vocab_size, context)?;
    crate::engine::batch::check_prompts(&held, cfg.vocab_size, context)?;
    let ppl_input = ppl_input(a, tok.as_ref(), &held, context)?;
    lines.push(ppl_input.line.clone());

    // The profile: the existing one (its GEMM sweep kept) or one without a sweep.
    let profile_path = a
        .out
        .clone()
        .unwrap_or_else(|| profile::default_path(&info.slug, &cfg.name));
    let report_dir = a
        .report_dir
        .clone()
        .unwrap_or_else(|| default_report_dir(a.out.as_deref(), &info.slug));
    let mut prof = if profile_path.exists() {
        let (p, warnings) = profile::load_for_use(&profile_path, cfg, &info, &b.kernel_hash())?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        lines.push(format!(
            "profile: {} exists: GEMM sweep skipped, its measurements kept; the softmax section is {}",
            profile_path.display(),
            if p.softmax.is_some() { "replaced" } else { "added" }
        ));
        p
    } else {
        let dir = profile_path.parent().map(PathBuf::from).unwrap_or_default();
        match profile::lookup::find(&dir, cfg, a.dtype, &info, &b.kernel_hash()) {
            // The GEMM sweep of a profile found by shape serves this model too (the module docs
            // of profile::lookup); the softmax section written here is this model's own.
            Ok(found) if !found.coverage.covered.is_empty() => {
                lines.push(format!(
                    "profile: none at {}: writing one with the GEMM entries of {} (found by shape: {} of 4 \
                     shapes) and this model's softmax section",
                    profile_path.display(),
                    found.path.display(),
                    found.coverage.covered.len()
                ));
                let mut p = found.profile;
                let own = Profile::without_gemm(b, cfg, a.dtype);
                p.model = own.model;
                p.softmax = None;
                p
            }
            _ => {
                lines.push(format!(
                    "profile: none at {}: writing one with the softmax section only (no GEMM sweep: the vendor \
                     gemm everywhere until `fdpp tune --model {}` adds it, keeping this section)",
                    profile_path.display(),
                    a.model
                ));
                Profile::without_gemm(b, cfg, a.dtype)
            }
        }
    };
    profile::check_writable(&profile_path)?;

    // One engine for every run: sized for all prompts at once.
    let opts = EngineOptions {
        dtype: a.dtype,
        scheme: SoftmaxScheme::Sync,
        ..EngineOptions::default()
    };
    let mut seq_tokens: Vec<usize> = calib.iter().chain(&held).map(|p| p.len() + c.decode_steps).collect();
    // The perplexity text's windows run one at a time beside nothing else.
    if let Some(w) = ppl_input.windows.iter().map(|(_, ctx)| *ctx).max() {
        seq_tokens.push(w);
    }
    let prompt_tokens: usize = calib.iter().chain(&held).map(Vec::len).sum();
    let plan = memory_plan(b, spec, &opts, &seq_tokens, prompt_tokens)?;
    let mut engine = build(b, spec, &source, None, &opts, plan)?;

    // Calibration: statistics on, sync softmax.
    engine.set_score_stats(Some(ScoreStatsParams {
        spec: HistSpec::DEFAULT,
        per_head: false,
    }))?;
    let chunk = engine.max_step_tokens();
    greedy(&mut engine, &calib, c.decode_steps, chunk).context("calibration run")?;
    let stats = engine
        .take_score_stats()
        .context("internal: statistics mode was off after the calibration run")?;
    engine.set_score_stats(None)?;
    let global = stats.global()?;
    let layers: Vec<ScoreHist> = (0..stats.layers.len())
        .map(|l| stats.layer(l))
        .collect::<crate::Result<_>>()?;
    let calib_tokens: usize = calib.iter().map(Vec::len).sum();
    lines.push(format!(
        "gathered {} scores over {} layers in {} steps ({} prompt tokens, {} decode steps per prompt); \
         min {:.3}, max {:.3}",
        global.count,
        layers.len(),
        stats.steps,
        calib_tokens,
        c.decode_steps,
        global.min,
        global.max
    ));
    let per_layer = layers
        .iter()
        .enumerate()
        .map(|(l, h)| layer_window(l, h, c.coverage))
        .collect::<crate::Result<Vec<_>>>()?;
    let paper_share = share_within(&global, PAPER_RANGE.0, PAPER_RANGE.1);
    lines.push(distribution_line(&global, &per_layer, paper_share, c.coverage)?);
    let mut section = SoftmaxSection::window(0.0, 0.0, 0.0, None);
    section.target_coverage = Some(c.coverage);
    section.samples = global.count;
    section.min = Some(global.min as f64);
    section.max = Some(global.max as f64);
    section.source = Some(format!("{weights_line}; {prompt_line}"));
    section.per_layer = per_layer;
    section.paper_range_share = Some(paper_share);

    let marked = match choose_window(&global, c.coverage)? {
        Choice::Async(w) => {
            section.phi = w.phi;
            section.a = w.a;
            section.b = w.b;
            section.coverage = Some(w.coverage);
            lines.push(format!(
                "window: phi = {:.3}, a = {:.3}, b = {:.3}: [phi+a, phi+b] = [{:.3}, {:.3}] holds {:.5} % of \
                 the scores ({:.2} % asked; narrowest such interval [{:.3}, {:.3}]; width {:.1} ≤ {MAX_WINDOW})",
                w.phi,
                w.a,
                w.b,
                w.lo(),
                w.hi(),
                w.coverage * 100.0,
                c.coverage * 100.0,
                w.core.0,
                w.core.1,
                w.b - w.a
            ));
            // Validation on the held-out prompts: sync, then async with the window.
            let chunk = engine.max_step_tokens();
            engine.model.scheme = SoftmaxScheme::Sync;
            let sync = greedy(&mut engine, &held, c.decode_steps, chunk).context("held-out run, sync softmax")?;
            // The noise floor: sync again with the prompts prefilled in small chunks (other
            // tiles, other GEMM shapes, the same maths).
            let sync_small = greedy(&mut engine, &held, c.decode_steps, NOISE_FLOOR_CHUNK.min(chunk))
                .context("held-out run, sync softmax in small prefill chunks")?;
            let floor = logit_diff(&sync_small, &sync);
            section.sync_noise_floor = Some(floor);
            let (sync_ppl, sync_ppl_tokens) =
                ppl_of(&mut engine, &ppl_input.windows).context("perplexity, sync softmax")?;
            let mut comparison = vec![WindowComparison {
                windows: "sync".into(),
                recompute_rate: None,
                logit_diff: None,
                same_tokens: None,
                ppl: Some(sync_ppl),
                ppl_tokens: sync_ppl_tokens,
            }];
            engine.model.scheme = w.scheme();
            let asy = greedy(&mut engine, &held, c.decode_steps, chunk).context("held-out run, async softmax")?;
            // How far a change that is exact in real arithmetic moves the logits: the global
            // window moved by 0.5 with φ (every e^(x − φ) scaled by e^−0.5; a flagged row is
            // recomputed either way). Its difference is the fp16 rounding of the attention outputs, amplified
            // through the layers; an async − sync difference of the same size is that rounding,
            // not the window.
            engine.model.scheme = SoftmaxScheme::Async {
                phi: (w.phi + 0.5) as f32,
                a: w.a as f32,
                b: w.b as f32,
            };
            let shifted = greedy(&mut engine, &held, c.decode_steps, chunk)
                .context("held-out run, async softmax with phi moved by 0.5")?;
            let async_floor = logit_diff(&shifted, &asy);
            engine.model.scheme = w.scheme();
            section.async_rounding_floor = Some(async_floor);
            lines.push(format!(
                "held-out async vs async with phi moved by 0.5 (exact in real arithmetic): logits max diff \
                 {async_floor:.2e}, greedy tokens {}: the fp16 rounding floor that async − sync differences are read \
                 against",
                if shifted.tokens == asy.tokens {
                    "the same"
                } else {
                    "DIFFER"
                }
            ));
            let global = compare("global", &asy, &sync, &mut engine, &ppl_input.windows)?;
            section.recompute_rate = global.recompute_rate;
            section.validated_logit_diff = global.logit_diff;
            section.validated_same_tokens = global.same_tokens;
            lines.push(format!(
                "held-out ({} prompts, {} decode steps), global window: recompute rate {:.4} % ({} of {} attention \
                 rows; the paper reports 0.45 % for Llama2-7B)",
                held.len(),
                c.decode_steps,
                global.recompute_rate.unwrap_or(0.0) * 100.0,
                asy.attn.recomputed,
                asy.attn.rows
            ));
            lines.push(verdict("global window", &global, floor, async_floor));
            comparison.push(global);
            // The same held-out prompts with each layer's own window (FlashDecoding++ §3 per
            // layer): what the engine runs by default when the profile has them.
            let (per, _) = layer_schemes(w.scheme(), Some(&section), cfg.num_layers, WindowsChoice::PerLayer)?;
            if per.is_empty() {
                lines.push(
                    "per-layer windows: none usable (every layer too wide alone): the engine runs the global window"
                        .into(),
                );
            } else {
                engine.model.set_layer_schemes(per)?;
                let asy = greedy(&mut engine, &held, c.decode_steps, chunk)
                    .context("held-out run, async softmax with per-layer windows")?;
                let row = compare("per_layer", &asy, &sync, &mut engine, &ppl_input.windows);
                engine.model.set_layer_schemes(Vec::new())?;
                let row = row?;
                lines.push(format!(
                    "held-out, per-layer windows: recompute rate {:.4} % ({} of {} attention rows)",
                    row.recompute_rate.unwrap_or(0.0) * 100.0,
                    asy.attn.recomputed,
                    asy.attn.rows
                ));
                lines.push(verdict("per-layer windows", &row, floor, async_floor));
                comparison.push(row);
            }
            lines.push(String::new());
            lines.push(format!(
                "global vs per-layer windows on the held-out prompts ({}):",
                ppl_input.what
            ));
            lines.extend(
                comparison_table(&comparison, floor, Some(async_floor))
                    .lines()
                    .map(str::to_string),
            );
            section.comparison = comparison;
            Marked::Window {
                phi: w.phi,
                a: w.a,
                b: w.b,
            }
        }
        Choice::TooWide { core, reason, .. } => {
            section.enabled = false;
            section.reason = Some(reason.clone());
            let phi = (core.0 + core.1) / 2.0;
            section.phi = phi;
            section.a = core.0 - phi;
            section.b = core.1 - phi;
            section.coverage = Some(c.coverage);
            lines.push(format!(
                "async softmax disabled for this model: {reason}; the engine will use the sync softmax"
            ));
            Marked::TooWide { lo: core.0, hi: core.1 }
        }
    };
    for lw in &section.per_layer {
        lines.push(format!(
            "  layer {:>3}: [{:.3}, {:.3}] (phi {:.3}), {} scores in [{:.3}, {:.3}]{}",
            lw.layer,
            lw.phi + lw.a,
            lw.phi + lw.b,
            lw.phi,
            lw.samples,
            lw.min,
            lw.max,
            if lw.reason.is_some() { " (too wide alone)" } else { "" }
        ));
    }

    prof.softmax = Some(section);
    prof.save(&profile_path)?;
    let title = format!("Softmax inputs: {} on {} ({})", cfg.name, info.name, a.dtype);
    let subtitle = format!(
        "{} scores, {}{}",
        global.count,
        match &source {
            WeightSource::Random { seed } => format!("random weights (seed {seed})"),
            WeightSource::Dir(_) | WeightSource::Gguf(_) => "checkpoint weights".into(),
        },
        match &marked {
            Marked::Window { .. } => format!(
                "; window holds {:.4} % (coverage asked {})",
                prof.softmax.as_ref().and_then(|s| s.coverage).unwrap_or(0.0) * 100.0,
                c.coverage
            ),
            Marked::TooWide { .. } => "; too wide: async disabled".into(),
        }
    );
    let report = write_softmax_report(
        &report_dir,
        &profile::file_stem(&cfg.name),
        &SoftmaxReport {
            title: &title,
            subtitle: &subtitle,
            global: &global,
            layers: &layers,
            marked,
        },
    )?;
    // The whole report as text beside the histogram (the lines printed, the comparison table
    // among them).
    let md = report_dir.join(format!("{}-softmax.md", profile::file_stem(&cfg.name)));
    let mut text = format!("# {title}\n\n");
    for l in &lines {
        text.push_str(l);
        text.push('\n');
    }
    profile::write_atomic(&md, text.as_bytes())?;
    Ok(CalibrateOutcome {
        profile: prof,
        profile_path,
        report,
        report_md: md,
        lines,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_diff_compares_only_steps_whose_tokens_agree() {
        let run = |tokens: Vec<Vec<u32>>, logits: Vec<Vec<Vec<f32>>>| GreedyRun {
            tokens,
            logits,
            attn: AttnStats::default(),
        };
        let sync = run(
            vec![vec![1, 2, 3]],
            vec![vec![vec![10.0, 1.0]], vec![vec![0.0, 5.0]], vec![vec![3.0, 3.0]]],
        );
        // Step 0 differs by 0.01; step 1 agrees; step 2 follows another token 2 (not compared).
        let asy = run(
            vec![vec![1, 9, 3]],
            vec![vec![vec![10.01, 1.0]], vec![vec![0.0, 5.0]], vec![vec![100.0, 3.0]]],
        );
        let d = logit_diff(&asy, &sync);
        assert!((d - 0.001).abs() < 1e-6, "{d}");
        assert_eq!(argmax(&[0.5, 2.0, 2.0, -1.0]), 1);
    }
}
