//! `fdpp perplexity`: how well a model predicts a text, the check that the asynchronous softmax
//! (FlashDecoding++ §3) costs no quality and that fdpp matches HF on real weights.
//!
//! The whole file is tokenized without special tokens and cut into non-overlapping windows of
//! `ctx` tokens (the last, shorter window is kept when it has at least 2 tokens); within a window
//! every token after the first is scored against the logits of the position before it, so a
//! window of n tokens scores n − 1. PPL = exp(Σ NLL / tokens scored), accumulated in f64.
//!
//! The pure parts (windows, the stable log-softmax, accumulation, the table, teacher-forced
//! agreement) take the engine as a closure returning the logits of every position of a window;
//! [`run`] wires in the engine: the window's first token is prefilled and every later one is
//! fed teacher-forced as a decode step (so each position's logits come out of the same decode
//! attention kernels, sync or async, that generation uses).

use std::ops::Range;
use std::time::Instant;

use crate::error::{FdppError, Result};

/// Default window length (tokens).
pub const DEFAULT_CTX: usize = 512;

/// Non-overlapping windows of `ctx` tokens over `n` tokens; a last window shorter than 2 tokens
/// scores nothing and is dropped.
pub fn windows(n: usize, ctx: usize) -> Result<Vec<Range<usize>>> {
    if ctx < 2 {
        return Err(FdppError::InvalidArgument(format!(
            "--ctx {ctx}: a window needs at least 2 tokens (one to condition on, one to score)"
        )));
    }
    Ok((0..n)
        .step_by(ctx)
        .map(|s| s..(s + ctx).min(n))
        .filter(|r| r.len() >= 2)
        .collect())
}

/// −log softmax(logits)[target], computed stably in f64: log Σ exp(x − max) + max − x_target.
pub fn nll(logits: &[f32], target: u32) -> Result<f64> {
    let t = target as usize;
    if t >= logits.len() {
        return Err(FdppError::InvalidArgument(format!(
            "token id {target} is outside the logits' vocabulary of {}",
            logits.len()
        )));
    }
    let mut max = f64::NEG_INFINITY;
    for &x in logits {
        if !x.is_finite() {
            return Err(FdppError::InvalidArgument(format!(
                "a logit is {x}: the forward pass produced a non-finite value"
            )));
        }
        max = max.max(f64::from(x));
    }
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    Ok(sum.ln() + max - f64::from(logits[t]))
}

/// Index of the largest logit (the first of equals).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// One window's result.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowScore {
    pub start: usize,
    pub len: usize,
    pub nll: f64,
}

/// The result of scoring a text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PplReport {
    pub tokens_scored: usize,
    pub nll_sum: f64,
    pub windows: Vec<WindowScore>,
    /// Teacher-forced top-1 prediction at every scored position, in order.
    pub top1: Vec<u32>,
    /// Wall time spent in the forward closure.
    pub forward_seconds: f64,
}

impl PplReport {
    pub fn ppl(&self) -> f64 {
        if self.tokens_scored == 0 {
            return f64::NAN;
        }
        (self.nll_sum / self.tokens_scored as f64).exp()
    }

    /// Tokens through the model per second of forward time (every token of a window is
    /// processed, the first included).
    pub fn tokens_per_second(&self) -> f64 {
        let n: usize = self.windows.iter().map(|w| w.len).sum();
        n as f64 / self.forward_seconds.max(1e-12)
    }

    /// Add one window: `logits[i]` are the logits after `tokens[..=i]`; positions 0..n−1 score
    /// tokens 1..n.
    pub fn add_window(&mut self, start: usize, tokens: &[u32], logits: &[Vec<f32>]) -> Result<()> {
        if logits.len() != tokens.len() {
            return Err(FdppError::Shape {
                what: format!("logits of the window at token {start}"),
                expected: format!("{} rows (one per position)", tokens.len()),
                found: format!("{} rows", logits.len()),
            });
        }
        let vocab = logits.first().map_or(0, Vec::len);
        let mut w = 0.0;
        for (i, row) in logits.iter().enumerate().take(tokens.len().saturating_sub(1)) {
            if row.len() != vocab {
                return Err(FdppError::Shape {
                    what: format!("logits row {i} of the window at token {start}"),
                    expected: format!("{vocab}"),
                    found: format!("{}", row.len()),
                });
            }
            w += nll(row, tokens[i + 1])?;
            self.top1.push(argmax(row) as u32);
        }
        self.nll_sum += w;
        self.tokens_scored += tokens.len().saturating_sub(1);
        self.windows.push(WindowScore {
            start,
            len: tokens.len(),
            nll: w,
        });
        Ok(())
    }
}

/// The logits of every position of a window: rows[i] after tokens[..=i].
pub type WindowForward<'a> = dyn FnMut(&[u32]) -> Result<Vec<Vec<f32>>> + 'a;

/// Score `tokens` in windows of `ctx` with `forward` (each window is a fresh sequence: no cache
/// carried across windows).
pub fn score_text(tokens: &[u32], ctx: usize, forward: &mut WindowForward<'_>) -> Result<PplReport> {
    let mut report = PplReport::default();
    for r in windows(tokens.len(), ctx)? {
        let w = &tokens[r.clone()];
        let t0 = Instant::now();
        let logits = forward(w)?;
        report.forward_seconds += t0.elapsed().as_secs_f64();
        report.add_window(r.start, w, &logits)?;
    }
    Ok(report)
}

/// Teacher-forced top-1 agreement with a reference over the positions where the reference's
/// top-2 gap exceeds `min_gap` (a near-tie may flip under any rounding): (agreeing, counted).
pub fn top1_agreement(ours: &[u32], reference: &[u32], ref_gap: &[f64], min_gap: f64) -> (usize, usize) {
    let mut agree = 0;
    let mut counted = 0;
    for ((a, b), g) in ours.iter().zip(reference).zip(ref_gap) {
        if *g > min_gap {
            counted += 1;
            agree += usize::from(a == b);
        }
    }
    (agree, counted)
}

/// One line of the perplexity table.
#[derive(Clone, Debug, PartialEq)]
pub struct PplRow {
    /// What produced it: "HF fp32", "fdpp cpu sync", "fdpp cuda async (per-layer windows)".
    pub label: String,
    pub ppl: f64,
    pub tokens_scored: usize,
    /// None for a reference whose speed is not measured here.
    pub tokens_per_second: Option<f64>,
    /// Rows recomputed by the asynchronous softmax's fallback, for async rows.
    pub recomputes: Option<u64>,
}

/// A markdown table, padded for the terminal; "vs first" is each PPL's relative difference to
/// the first row's (the reference).
pub fn table(rows: &[PplRow]) -> String {
    let header = ["run", "PPL", "vs first", "tokens", "tok/s", "recomputes"];
    let base = rows.first().map(|r| r.ppl);
    let body: Vec<[String; 6]> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let rel = match base {
                Some(b) if i > 0 && b.is_finite() && b != 0.0 => format!("{:+.3} %", (r.ppl / b - 1.0) * 100.0),
                _ => "–".into(),
            };
            [
                r.label.clone(),
                format!("{:.4}", r.ppl),
                rel,
                r.tokens_scored.to_string(),
                r.tokens_per_second.map_or("–".into(), |t| format!("{t:.1}")),
                r.recomputes.map_or("–".into(), |n| n.to_string()),
            ]
        })
        .collect();
    let mut width = header.map(|h| h.chars().count());
    for row in &body {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let padded: Vec<String> = cells
            .iter()
            .zip(width)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        format!("| {} |\n", padded.join(" | "))
    };
    let mut out = line(&header.map(String::from));
    let rule: Vec<String> = width.iter().map(|&w| "-".repeat(w)).collect();
    out.push_str(&format!("|-{}-|\n", rule.join("-|-")));
    for row in &body {
        out.push_str(&line(row));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cut_and_keep_a_last_window_of_two() {
        assert_eq!(windows(10, 4).unwrap(), vec![0..4, 4..8, 8..10]);
        assert_eq!(
            windows(9, 4).unwrap(),
            vec![0..4, 4..8],
            "a last window of 1 scores nothing"
        );
        assert_eq!(windows(8, 4).unwrap(), vec![0..4, 4..8]);
        assert_eq!(windows(1, 512).unwrap(), Vec::<Range<usize>>::new());
        assert_eq!(windows(2224, 512).unwrap().len(), 5);
        assert_eq!(windows(2224, 512).unwrap()[4], 2048..2224);
        assert!(windows(10, 1).is_err());
    }

    #[test]
    fn nll_is_stable_and_exact() {
        // Uniform over 4: −log(1/4).
        assert!((nll(&[0.0; 4], 2).unwrap() - 4f64.ln()).abs() < 1e-12);
        // Huge logits do not overflow: softmax([1000, 0]) = [1/(1+e^-1000), …].
        let v = nll(&[1000.0, 0.0], 1).unwrap();
        assert!((v - 1000.0).abs() < 1e-9, "{v}");
        assert!(nll(&[1000.0, 0.0], 0).unwrap() < 1e-12);
        // Against a direct computation at a moderate scale.
        let l = [0.5f32, -1.25, 2.0, 0.0];
        let z: f64 = l.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((nll(&l, 1).unwrap() - (z.ln() + 1.25)).abs() < 1e-12);
        assert!(nll(&l, 4).is_err());
        assert!(nll(&[0.0, f32::NAN], 0).is_err());
    }

    #[test]
    fn accumulation_over_windows_and_ppl() {
        // A "model" that puts logit 3 on (previous token + 1) mod 5 and 0 elsewhere.
        let tokens: Vec<u32> = (0..11).map(|i| (i * 7 % 5) as u32).collect();
        let mut calls = Vec::new();
        let mut fwd = |w: &[u32]| -> Result<Vec<Vec<f32>>> {
            calls.push(w.len());
            Ok(w.iter()
                .map(|&t| (0..5).map(|j| if j == (t + 1) % 5 { 3.0 } else { 0.0 }).collect())
                .collect())
        };
        let r = score_text(&tokens, 4, &mut fwd).unwrap();
        assert_eq!(calls, vec![4, 4, 3]);
        assert_eq!(r.tokens_scored, 3 + 3 + 2);
        let (hit, miss) = {
            let z = 3f64.exp() + 4.0;
            (z.ln() - 3.0, z.ln())
        };
        let mut want = 0.0;
        let mut want_top1 = Vec::new();
        for r in windows(11, 4).unwrap() {
            for i in r.start..r.end - 1 {
                let pred = (tokens[i] + 1) % 5;
                want += if tokens[i + 1] == pred { hit } else { miss };
                want_top1.push(pred);
            }
        }
        assert!((r.nll_sum - want).abs() < 1e-12);
        assert!((r.ppl() - (want / 8.0).exp()).abs() < 1e-12);
        assert_eq!(r.top1, want_top1);
        let sum: f64 = r.windows.iter().map(|w| w.nll).sum();
        assert!((sum - r.nll_sum).abs() < 1e-12);
    }

    #[test]
    fn a_forward_with_the_wrong_rows_is_an_error() {
        let mut fwd = |w: &[u32]| -> Result<Vec<Vec<f32>>> { Ok(vec![vec![0.0; 3]; w.len() - 1]) };
        let e = score_text(&[0, 1, 2], 8, &mut fwd).unwrap_err().to_string();
        assert!(e.contains("3 rows") && e.contains("found 2 rows"), "{e}");
    }

    #[test]
    fn agreement_counts_only_clear_positions() {
        let (a, n) = top1_agreement(&[1, 2, 3, 4], &[1, 9, 3, 8], &[1.0, 0.01, 0.5, 0.2], 0.05);
        assert_eq!((a, n), (2, 3));
    }

    #[test]
    fn the_table_shows_relative_differences() {
        let rows = [
            PplRow {
                label: "HF fp32".into(),
                ppl: 16.7664,
                tokens_scored: 2219,
                tokens_per_second: None,
                recomputes: None,
            },
            PplRow {
                label: "fdpp cpu async".into(),
                ppl: 16.7832,
                tokens_scored: 2219,
                tokens_per_second: Some(812.34),
                recomputes: Some(3),
            },
        ];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("| run "));
        assert!(
            lines[3].contains("+0.100 %") && lines[3].contains("812.3") && lines[3].contains("| 3 "),
            "{t}"
        );
        assert!(lines[2].contains("| – "), "{t}");
        let widths: Vec<usize> = lines.iter().map(|l| l.chars().count()).collect();
        assert!(widths.windows(2).all(|w| w[0] == w[1]), "aligned: {t}");
    }
}

/// `fdpp perplexity`.
#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    /// A preset with --random-weights, an HF directory or a GGUF file.
    #[arg(long)]
    pub model: String,
    /// The text to score (tokenized whole, no special tokens).
    #[arg(long)]
    pub text: std::path::PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = DEFAULT_CTX)]
    pub ctx: usize,
    /// The softmax scheme, or both side by side.
    #[arg(long, value_enum, default_value_t = SoftmaxArg::Both)]
    pub softmax: SoftmaxArg,
    /// Score only the first N tokens of the text (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: usize,
    #[arg(long, value_enum, default_value_t = crate::backend::BackendChoice::Auto)]
    pub backend: crate::backend::BackendChoice,
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    #[arg(long, value_enum, default_value_t = crate::dtype::DType::F16)]
    pub dtype: crate::dtype::DType,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SoftmaxArg {
    Sync,
    Async,
    Both,
}

pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    if a.ctx < 2 {
        anyhow::bail!(
            "--ctx {}: a window needs at least 2 tokens (one to condition on, one scored)",
            a.ctx
        );
    }
    let spec = crate::model::spec::ModelSpec::resolve(&a.model)?;
    let tok_path = spec.tokenizer_path().with_context(|| {
        format!(
            "'{}' has no tokenizer (tokenizer.json or a GGUF vocabulary): perplexity scores text",
            a.model
        )
    })?;
    let tok = crate::model::spec::ModelSpec::load_tokenizer(&tok_path)?;
    let text = std::fs::read_to_string(&a.text).with_context(|| format!("--text {}", a.text.display()))?;
    let mut ids = tok.encode_plain(&text)?;
    if a.max_tokens > 0 {
        ids.truncate(a.max_tokens);
    }
    if ids.len() < 2 {
        anyhow::bail!(
            "--text {}: {} tokens; at least 2 are needed",
            a.text.display(),
            ids.len()
        );
    }
    let source = super::model_setup::weight_source(&spec, &a.model, false, 0)?;
    let (any, note) = crate::backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => run_on(b, &a, &spec, &source, &ids))
}

fn run_on<B: crate::backend::Backend>(
    b: &B,
    a: &PerplexityArgs,
    spec: &crate::model::spec::ModelSpec,
    source: &crate::engine::build::WeightSource,
    ids: &[u32],
) -> anyhow::Result<()> {
    use crate::engine::build::{build, memory_plan, softmax_scheme, EngineOptions, SoftmaxChoice};
    let (found, note) = super::model_setup::find_profile(b, None, spec, &a.model, a.dtype)?;
    eprintln!("{note}");
    let profile = found.map(|f| f.profile);
    let choices: &[SoftmaxChoice] = match a.softmax {
        SoftmaxArg::Sync => &[SoftmaxChoice::Sync],
        SoftmaxArg::Async => &[SoftmaxChoice::Async],
        SoftmaxArg::Both => &[SoftmaxChoice::Sync, SoftmaxChoice::Async],
    };
    let ctx = a.ctx.min(spec.context_len());
    eprintln!(
        "{} tokens of {} in windows of {ctx}; weights: {}",
        ids.len(),
        a.text.display(),
        source.describe()
    );
    let mut rows = Vec::new();
    for &choice in choices {
        let (scheme, line) = softmax_scheme(Some(choice), profile.as_ref())?;
        eprintln!("{line}");
        let opts = EngineOptions {
            dtype: a.dtype,
            scheme,
            ..EngineOptions::default()
        };
        let plan = memory_plan(b, spec, &opts, &[ctx], 1)?;
        let mut engine = build(b, spec, source, profile.clone(), &opts, plan)?;
        let before = engine.attn.recomputed;
        let mut forward = |w: &[u32]| -> Result<Vec<Vec<f32>>> {
            let mut table = crate::kv::BlockTable::default();
            let mut rows = engine.prefill(std::slice::from_mut(&mut table), &[&w[..1]], 1, &mut |_, _| Ok(()))?;
            for &t in &w[1..] {
                rows.extend(engine.decode(&mut [&mut table], &[t])?);
            }
            engine.release(&mut table)?;
            Ok(rows)
        };
        let r = score_text(ids, ctx, &mut forward)?;
        rows.push(PplRow {
            label: format!("fdpp {} {}", b.info().backend, scheme.label()),
            ppl: r.ppl(),
            tokens_scored: r.tokens_scored,
            tokens_per_second: Some(r.tokens_per_second()),
            recomputes: Some((engine.attn.recomputed - before) as u64),
        });
    }
    print!("{}", table(&rows));
    Ok(())
}
