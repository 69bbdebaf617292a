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
/// the first row's (the reference), and, when a row's label ends in " sync", "vs sync" is each
/// async row's difference to that one (the asynchronous softmax's cost).
pub fn table(rows: &[PplRow]) -> String {
    let base = rows.first().map(|r| r.ppl);
    let sync = rows.iter().find(|r| r.label.ends_with(" sync")).map(|r| r.ppl);
    let rel = |x: f64, b: Option<f64>| match b {
        Some(b) if b.is_finite() && b != 0.0 => format!("{:+.3} %", (x / b - 1.0) * 100.0),
        _ => "–".into(),
    };
    let mut header = vec!["run", "PPL", "vs first", "tokens", "tok/s", "recomputes"];
    if sync.is_some() {
        header.push("vs sync");
    }
    let body: Vec<Vec<String>> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut cells = vec![
                r.label.clone(),
                format!("{:.4}", r.ppl),
                if i > 0 { rel(r.ppl, base) } else { "–".into() },
                r.tokens_scored.to_string(),
                r.tokens_per_second.map_or("–".into(), |t| format!("{t:.1}")),
                r.recomputes.map_or("–".into(), |n| n.to_string()),
            ];
            if sync.is_some() {
                cells.push(if r.recomputes.is_some() {
                    rel(r.ppl, sync)
                } else {
                    "–".into()
                });
            }
            cells
        })
        .collect();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &body {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let padded: Vec<String> = cells
            .iter()
            .zip(&width)
            .map(|(c, &w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        format!("| {} |\n", padded.join(" | "))
    };
    let head: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = line(&head);
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
        assert!(!t.contains("vs sync"), "no sync row, no column: {t}");
        // With a sync row: async rows read against it too.
        let mut with_sync = rows.to_vec();
        with_sync.insert(
            1,
            PplRow {
                label: "fdpp cpu sync".into(),
                ppl: 16.7664 * 1.001,
                tokens_scored: 2219,
                tokens_per_second: Some(800.0),
                recomputes: None,
            },
        );
        let t = table(&with_sync);
        let lines: Vec<&str> = t.lines().collect();
        let last = |l: &str| {
            l.trim_end_matches('|')
                .rsplit('|')
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        };
        assert_eq!(last(lines[0]), "vs sync", "{t}");
        assert_eq!(last(lines[2]), "–", "the reference: {t}");
        assert_eq!(last(lines[3]), "–", "the sync row itself: {t}");
        assert_eq!(last(lines[4]), "+0.000 %", "{t}");
    }

    #[test]
    fn a_reference_is_read_and_checked_against_the_windows() {
        let path = std::path::Path::new("ref.json");
        let r = Reference::parse(
            r#"{"dtype":"float32","versions":{"transformers":"5"},"text":{"ppl":16.7,"ctx":4,"tokens_scored":8,"ids":[1,2,3]}}"#,
            path,
        )
        .unwrap();
        assert_eq!(
            (r.ctx, r.tokens_scored, r.label.as_str()),
            (4, 8, "HF transformers float32")
        );
        assert_eq!(r.ids, Some(vec![1, 2, 3]));
        // 11 tokens in windows of 4 score 3 + 3 + 2 = 8.
        let ids: Vec<u32> = (0..11).collect();
        assert!(check_reference(&r, path, &ids, 4).is_ok());
        let e = check_reference(&r, path, &ids, 8).unwrap_err().to_string();
        assert!(e.contains("--ctx 4") && e.contains("text.ctx"), "{e}");
        let e = Reference::parse(r#"{"text":{"ctx":4}}"#, path).unwrap_err().to_string();
        assert!(e.contains("text.ppl") && e.contains("ref.json"), "{e}");
    }
}

/// `fdpp perplexity`.
#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    /// An HF model directory (with its tokenizer.json) or a GGUF file: the text is tokenized by
    /// the model's own tokenizer, which a preset does not have.
    #[arg(long)]
    pub model: String,
    /// The text to score (tokenized whole, no special tokens).
    #[arg(long)]
    pub text: std::path::PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = DEFAULT_CTX)]
    pub ctx: usize,
    /// The softmax scheme, or both side by side (async once with the profile's global window
    /// and, when the profile has them, once with its per-layer windows).
    #[arg(long, value_enum, default_value_t = SoftmaxArg::Both)]
    pub softmax: SoftmaxArg,
    /// Score only the first N tokens of the text (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: usize,
    /// Tuning profile (its softmax section gives the async windows), or `none` [default: the
    /// device's profile for the model, as `generate` finds it].
    #[arg(long)]
    pub profile: Option<String>,
    /// A reference JSON with the same text scored by another implementation (the `text` object
    /// of scripts/smollm2_reference.py's output: ppl, ctx, tokens_scored, ids); its PPL is the
    /// table's first row, against which the others are read.
    #[arg(long)]
    pub reference: Option<std::path::PathBuf>,
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

/// A reference perplexity read from a JSON file (`text.ppl`, `text.ctx`, `text.tokens_scored`,
/// optionally `text.ids` and `dtype`).
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    pub label: String,
    pub ppl: f64,
    pub ctx: usize,
    pub tokens_scored: usize,
    pub ids: Option<Vec<u32>>,
}

impl Reference {
    pub fn load(path: &std::path::Path) -> Result<Reference> {
        let text = std::fs::read_to_string(path).map_err(|e| FdppError::io(path, e))?;
        Reference::parse(&text, path)
    }

    pub fn parse(text: &str, path: &std::path::Path) -> Result<Reference> {
        let bad = |msg: String| FdppError::Config {
            path: path.to_path_buf(),
            msg: format!("{msg} (--reference expects the output of scripts/smollm2_reference.py)"),
        };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
        let t = v.get("text").ok_or_else(|| bad("no field 'text'".into()))?;
        let num = |k: &str| {
            t.get(k)
                .and_then(serde_json::Value::as_f64)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad(format!("field 'text.{k}' is missing or not a positive number")))
        };
        let ids = t.get("ids").and_then(|a| {
            a.as_array()?
                .iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>()
        });
        let dtype = v
            .get("dtype")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("reference");
        let source = v
            .get("versions")
            .and_then(|x| x.get("transformers"))
            .map(|_| "HF transformers")
            .unwrap_or("reference");
        Ok(Reference {
            label: format!("{source} {dtype}"),
            ppl: num("ppl")?,
            ctx: num("ctx")? as usize,
            tokens_scored: num("tokens_scored")? as usize,
            ids,
        })
    }
}

/// Score `ids` in windows of `ctx` on an engine: each window's first token prefilled, every
/// later one fed teacher-forced as a decode step (so every position's logits come out of the
/// decode attention kernels, with the engine's softmax). Returns the report and the rows the
/// async softmax recomputed.
pub fn score_on_engine<B: crate::backend::Backend>(
    engine: &mut crate::engine::runner::Engine<'_, B>,
    ids: &[u32],
    ctx: usize,
) -> Result<(PplReport, u64)> {
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
    Ok((r, (engine.attn.recomputed - before) as u64))
}

pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    if a.ctx < 2 {
        anyhow::bail!(
            "--ctx {}: a window needs at least 2 tokens (one to condition on, one scored)",
            a.ctx
        );
    }
    let reference = a.reference.as_deref().map(Reference::load).transpose()?;
    let spec = crate::model::spec::ModelSpec::resolve(&a.model)?;
    let tok_path = spec.tokenizer_path().with_context(|| {
        format!(
            "'{}' has no tokenizer (tokenizer.json or a GGUF vocabulary): perplexity scores text; \
             give an HF model directory with tokenizer.json or a GGUF file",
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
    if let (Some(r), Some(path)) = (&reference, &a.reference) {
        // Both PPLs must score the same token sequence: where this tokenizer cuts the text
        // differently (the GGUF vocabulary's pre-tokenizer near digits), the reference's ids
        // are scored instead.
        if let Some(rids) = r.ids.as_ref().filter(|rids| **rids != ids) {
            let at = rids
                .iter()
                .zip(&ids)
                .position(|(x, y)| x != y)
                .unwrap_or(rids.len().min(ids.len()));
            eprintln!(
                "note: --reference {} tokenized the text into {} ids, this tokenizer into {} (first difference at \
                 position {at}); scoring the reference's ids (field text.ids) so that both score the same tokens",
                path.display(),
                rids.len(),
                ids.len()
            );
            ids = rids.clone();
            if a.max_tokens > 0 {
                ids.truncate(a.max_tokens);
            }
        }
        check_reference(r, path, &ids, a.ctx.min(spec.context_len()))?;
    }
    let source = super::model_setup::weight_source(&spec, &a.model, false, 0)?;
    let (any, note) = crate::backend::open(a.backend, a.device)?;
    eprintln!("{note}");
    crate::with_backend!(&any, b => run_on(b, &a, &spec, &source, &ids, reference.as_ref()))
}

/// The reference must have scored the same tokens in the same windows, or its PPL is not
/// comparable: the window length and the count must match.
fn check_reference(r: &Reference, path: &std::path::Path, ids: &[u32], ctx: usize) -> anyhow::Result<()> {
    let scored: usize = windows(ids.len(), ctx)?.iter().map(|w| w.len() - 1).sum();
    if r.ctx != ctx || r.tokens_scored != scored {
        anyhow::bail!(
            "--reference {}: it scored {} tokens in windows of {} (fields text.tokens_scored, text.ctx), this run \
             would score {scored} in windows of {ctx}: give --ctx {} and the whole text (no --max-tokens) to compare",
            path.display(),
            r.tokens_scored,
            r.ctx,
            r.ctx
        );
    }
    Ok(())
}

fn run_on<B: crate::backend::Backend>(
    b: &B,
    a: &PerplexityArgs,
    spec: &crate::model::spec::ModelSpec,
    source: &crate::engine::build::WeightSource,
    ids: &[u32],
    reference: Option<&Reference>,
) -> anyhow::Result<()> {
    use crate::engine::build::{build, memory_plan, softmax_scheme, softmax_setup, EngineOptions, SoftmaxChoice};
    use crate::ops::attention::SoftmaxScheme;
    let (found, note) = super::model_setup::find_profile(b, a.profile.as_deref(), spec, &a.model, a.dtype)?;
    eprintln!("{note}");
    let profile = found.map(|f| f.profile);
    let layers = spec.cfg.num_layers;
    // (label, scheme, per-layer windows) of every row.
    let mut runs: Vec<(String, SoftmaxScheme, Vec<SoftmaxScheme>)> = Vec::new();
    if a.softmax != SoftmaxArg::Async {
        runs.push(("sync".into(), SoftmaxScheme::Sync, Vec::new()));
    }
    if a.softmax != SoftmaxArg::Sync {
        let (scheme, per_layer, line) = softmax_setup(Some(SoftmaxChoice::Async), profile.as_ref(), layers)?;
        eprintln!("{line}");
        if per_layer.is_empty() || a.softmax == SoftmaxArg::Both {
            let (global, _) = softmax_scheme(Some(SoftmaxChoice::Async), profile.as_ref())?;
            runs.push((format!("{} (global window)", global.label()), global, Vec::new()));
        }
        if !per_layer.is_empty() {
            runs.push(("async (per-layer windows)".into(), scheme, per_layer));
        }
    }
    let ctx = a.ctx.min(spec.context_len());
    eprintln!(
        "{} tokens of {} in windows of {ctx}; weights: {}",
        ids.len(),
        a.text.display(),
        source.describe()
    );
    let opts = EngineOptions {
        dtype: a.dtype,
        ..EngineOptions::default()
    };
    let plan = memory_plan(b, spec, &opts, &[ctx], 1)?;
    let mut engine = build(b, spec, source, profile.clone(), &opts, plan)?;
    let mut rows = Vec::new();
    if let Some(r) = reference {
        rows.push(PplRow {
            label: r.label.clone(),
            ppl: r.ppl,
            tokens_scored: r.tokens_scored,
            tokens_per_second: None,
            recomputes: None,
        });
    }
    for (label, scheme, per_layer) in runs {
        engine.model.scheme = scheme;
        engine.model.set_layer_schemes(per_layer)?;
        let (r, recomputed) = score_on_engine(&mut engine, ids, ctx)?;
        eprintln!("{label}: PPL {:.4} over {} tokens", r.ppl(), r.tokens_scored);
        rows.push(PplRow {
            label: format!("fdpp {} {label}", b.info().backend),
            ppl: r.ppl(),
            tokens_scored: r.tokens_scored,
            tokens_per_second: Some(r.tokens_per_second()),
            recomputes: (scheme != SoftmaxScheme::Sync).then_some(recomputed),
        });
    }
    print!("{}", table(&rows));
    Ok(())
}
