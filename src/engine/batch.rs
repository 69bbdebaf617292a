//! Generation for a batch of prompts of different lengths: one chunked prefill of all of
//! them, then decode steps over the sequences still running; each sequence finishes on its own
//! (EOS, a stop string, --max-tokens, the model's context), gives its KV pages back at once,
//! and leaves the next steps' batch.

use std::collections::VecDeque;
use std::time::Instant;

use serde::Serialize;

use crate::backend::Backend;
use crate::engine::runner::Engine;
use crate::engine::sampler::{Sampler, SamplingParams};
use crate::error::{FdppError, Result};
use crate::kv::BlockTable;
use crate::model::tokenizer::{StreamText, Tokenizer};
use crate::ops::attention::AttnStats;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens generated per sequence.
    pub max_tokens: usize,
    pub eos_ids: Vec<u32>,
    /// Keep going past EOS (benchmarks want a fixed length).
    pub ignore_eos: bool,
    /// Stop when the generated text contains one of these (needs a tokenizer).
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// Tokens per prefill step.
    pub chunk: usize,
    /// Prompt plus generated tokens never exceed this.
    pub context_len: usize,
    /// Greedy decoding with the host a step ahead where the backend allows it
    /// ([`Backend::pipelined_greedy`]; `FDPP_PIPELINE=0` turns it off). The tokens are the same.
    pub pipeline: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Eos,
    Stop,
    MaxTokens,
    /// The model's context is full.
    Context,
}

#[derive(Clone, Debug, Serialize)]
pub struct SeqResult {
    pub prompt: Vec<u32>,
    /// Generated ids (an EOS that ended the sequence included).
    pub tokens: Vec<u32>,
    /// Generated text, when a tokenizer is given (cut before a stop string).
    pub text: Option<String>,
    pub finish: FinishReason,
    /// From the start of the run to this sequence's first token.
    pub first_token_ms: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    /// Until every prompt was prefilled and had its first token.
    pub prefill_ms: f64,
    /// Until the first token of the batch's last sequence (batch 1: the time to first token).
    pub first_token_ms: f64,
    pub decode_steps: usize,
    /// Tokens produced by decode steps (all sequences).
    pub decode_tokens: usize,
    pub decode_ms: f64,
    /// Mean decode step time: the per-token latency each running sequence sees.
    pub per_token_ms: f64,
    /// decode_tokens / decode time.
    pub decode_tok_per_s: f64,
    pub total_ms: f64,
    /// Every decode step's time, in order.
    pub step_ms: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    pub seqs: Vec<SeqResult>,
    pub timings: Timings,
    pub attention: AttnStats,
}

/// What a caller sees as tokens arrive: the sequence, the id, and the new text (empty without
/// a tokenizer or while a character is incomplete).
pub type OnToken<'a> = dyn FnMut(usize, u32, &str) + 'a;

struct Seq {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    sampler: Sampler,
    text: StreamText,
    full_text: String,
    finish: Option<FinishReason>,
    first_token_ms: f64,
}

impl Seq {
    /// The sequence so far, for the repetition penalty (the only sampler step that reads it;
    /// without it no copy is made).
    fn history(&self) -> Vec<u32> {
        if self.sampler.params().repetition_penalty == 1.0 {
            return Vec::new();
        }
        let mut h = self.prompt.clone();
        h.extend(&self.tokens);
        h
    }
}

/// Refuse prompts that cannot run, before anything runs.
pub fn check_prompts(prompts: &[Vec<u32>], vocab: usize, context_len: usize) -> Result<()> {
    if prompts.is_empty() {
        return Err(FdppError::InvalidArgument("no prompt given".into()));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(FdppError::InvalidArgument(format!(
                "prompt {i} has no tokens; give at least one"
            )));
        }
        if let Some(&id) = p.iter().find(|&&id| id as usize >= vocab) {
            return Err(FdppError::InvalidArgument(format!(
                "prompt {i}: token id {id} is outside the vocabulary (0..{vocab})"
            )));
        }
        if p.len() > context_len {
            return Err(FdppError::InvalidArgument(format!(
                "prompt {i} has {} tokens, longer than the model's context of {context_len} \
                 (max_position_embeddings, or the sliding window); shorten it",
                p.len()
            )));
        }
    }
    Ok(())
}

/// Generate for every prompt. `tok` decodes text (streamed through `on_token`, checked for
/// stop strings); without it only ids come out and stop strings are refused.
pub fn generate<B: Backend>(
    engine: &mut Engine<'_, B>,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    tok: Option<&Tokenizer>,
    on_token: &mut OnToken<'_>,
) -> Result<GenerateOutput> {
    opts.sampling.validate()?;
    check_prompts(prompts, engine.model.cfg.vocab_size, opts.context_len)?;
    if opts.max_tokens == 0 {
        return Err(FdppError::InvalidArgument("--max-tokens must be at least 1".into()));
    }
    if !opts.stop.is_empty() && tok.is_none() {
        return Err(FdppError::InvalidArgument(
            "--stop needs a tokenizer (the model directory's tokenizer.json) to read the text".into(),
        ));
    }
    let attn_before = engine.attn;
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Seq {
            prompt: p.clone(),
            tokens: Vec::new(),
            sampler: Sampler::new(opts.sampling, i as u64),
            text: StreamText::default(),
            full_text: String::new(),
            finish: None,
            first_token_ms: 0.0,
        })
        .collect();
    let mut tables = vec![BlockTable::default(); prompts.len()];
    let res = run_batch(engine, &mut seqs, &mut tables, prompts, opts, tok, on_token);
    // A failed run (out of pages, a refused op) leaves its sequences' pages behind: give them
    // back so the engine can serve another batch.
    for t in tables.iter_mut().filter(|t| !t.pages.is_empty()) {
        engine.release(t)?;
    }
    let timings = res?;
    let seqs = seqs
        .into_iter()
        .map(|s| SeqResult {
            prompt: s.prompt,
            tokens: s.tokens,
            text: tok.map(|_| s.full_text),
            finish: s.finish.unwrap_or(FinishReason::MaxTokens),
            first_token_ms: s.first_token_ms,
        })
        .collect();
    Ok(GenerateOutput {
        seqs,
        timings,
        attention: AttnStats {
            rows: engine.attn.rows - attn_before.rows,
            recomputed: engine.attn.recomputed - attn_before.recomputed,
            splits: 0,
        },
    })
}

/// The prefill and decode steps of [`generate`]; sequences give their pages back as they
/// finish.
fn run_batch<B: Backend>(
    engine: &mut Engine<'_, B>,
    seqs: &mut [Seq],
    tables: &mut [BlockTable],
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    tok: Option<&Tokenizer>,
    on_token: &mut OnToken<'_>,
) -> Result<Timings> {
    let t0 = Instant::now();
    let b = engine.model.backend();

    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    engine.prefill(tables, &refs, opts.chunk, &mut |s, logits| {
        let seq = &mut seqs[s];
        accept(seq, s, logits, opts, tok, on_token)?;
        seq.first_token_ms = ms(t0);
        Ok(())
    })?;
    b.synchronize()?;
    let prefill_ms = ms(t0);
    for (s, t) in seqs.iter().zip(tables.iter_mut()) {
        if s.finish.is_some() {
            engine.release(t)?;
        }
    }

    let t_decode = Instant::now();
    let pipelined = device_greedy(opts)
        && opts.pipeline
        && b.pipelined_greedy()
        && pipeline_wanted(crate::run_config::get().get(crate::run_config::Key::Pipeline));
    let mut d = DecodeLoop {
        seqs,
        tables,
        opts,
        tok,
        on_token,
        step_ms: Vec::new(),
        decode_tokens: 0,
    };
    if pipelined {
        decode_pipelined(engine, &mut d)?;
    } else {
        decode_step_by_step(engine, &mut d)?;
    }
    let (step_ms, decode_tokens) = (d.step_ms, d.decode_tokens);
    let decode_ms = t_decode.elapsed().as_secs_f64() * 1e3;
    let steps = step_ms.len();
    Ok(Timings {
        prefill_ms,
        first_token_ms: seqs.iter().map(|s| s.first_token_ms).fold(0.0, f64::max),
        decode_steps: steps,
        decode_tokens,
        decode_ms,
        per_token_ms: if steps > 0 { decode_ms / steps as f64 } else { 0.0 },
        decode_tok_per_s: if decode_ms > 0.0 {
            decode_tokens as f64 / (decode_ms / 1e3)
        } else {
            0.0
        },
        total_ms: ms(t0),
        step_ms,
    })
}

/// What the decode loops read and add to.
struct DecodeLoop<'a, 'o> {
    seqs: &'a mut [Seq],
    tables: &'a mut [BlockTable],
    opts: &'a GenerateOptions,
    tok: Option<&'a Tokenizer>,
    on_token: &'a mut OnToken<'o>,
    step_ms: Vec<f64>,
    /// Tokens accepted (a token computed ahead and dropped is not counted).
    decode_tokens: usize,
}

impl DecodeLoop<'_, '_> {
    /// The sequences not finished yet.
    fn active(&self) -> Vec<usize> {
        (0..self.seqs.len())
            .filter(|&i| self.seqs[i].finish.is_none())
            .collect()
    }

    /// The newest token of each sequence of `set` (the input of its next step).
    fn last_tokens(&self, set: &[usize]) -> Vec<u32> {
        set.iter().map(|&i| *self.seqs[i].tokens.last().unwrap_or(&0)).collect()
    }

    /// Accept the greedy choice `id` for sequence `i`.
    fn accept_id(&mut self, i: usize, id: u32) -> Result<()> {
        self.decode_tokens += 1;
        accept_id(&mut self.seqs[i], i, id, self.opts, self.tok, self.on_token)
    }
}

/// One decode step at a time: each step's tokens are read back before the next is queued (any
/// sampler; the host-side ones need the logits).
fn decode_step_by_step<B: Backend>(engine: &mut Engine<'_, B>, d: &mut DecodeLoop<'_, '_>) -> Result<()> {
    let b = engine.model.backend();
    let device_greedy = device_greedy(d.opts);
    loop {
        let active = d.active();
        if active.is_empty() {
            return Ok(());
        }
        let tokens = d.last_tokens(&active);
        let t_step = Instant::now();
        let mut refs = tables_of(d.tables, &active);
        if device_greedy {
            let ids = engine.decode_greedy(&mut refs, &tokens)?;
            for (&i, &id) in active.iter().zip(&ids) {
                d.accept_id(i, id)?;
            }
        } else {
            let logits = engine.decode(&mut refs, &tokens)?;
            for (&i, l) in active.iter().zip(&logits) {
                let seq = &mut d.seqs[i];
                let id = seq.sampler.sample(l, &seq.history())?;
                d.accept_id(i, id)?;
            }
        }
        for &i in &active {
            if d.seqs[i].finish.is_some() {
                engine.release(&mut d.tables[i])?;
            }
        }
        b.synchronize()?;
        d.step_ms.push(t_step.elapsed().as_secs_f64() * 1e3);
    }
}

/// Greedy without a repetition penalty needs only each row's argmax: chosen on the device, so a
/// step reads back one index per sequence instead of vocab_size logits (the same token the host
/// sampler would choose, NaN refused alike).
fn device_greedy(opts: &GenerateOptions) -> bool {
    opts.sampling.is_greedy() && opts.sampling.repetition_penalty == 1.0
}

/// Whether the greedy decode may run pipelined: unless `FDPP_PIPELINE` is 0, off or false.
fn pipeline_wanted(env: Option<&str>) -> bool {
    !matches!(env.map(str::trim), Some("0") | Some("off") | Some("false"))
}

/// The block tables of the sequences `set`, in its order.
fn tables_of<'t>(tables: &'t mut [BlockTable], set: &[usize]) -> Vec<&'t mut BlockTable> {
    tables
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| set.contains(i))
        .map(|(_, t)| t)
        .collect()
}

/// Whether `seq` stops for certain once `more` tokens beyond those it has are accepted (max
/// tokens or the context; EOS and stop strings cannot be known ahead).
fn stops_within(seq: &Seq, more: usize, opts: &GenerateOptions) -> bool {
    seq.tokens.len() + more >= opts.max_tokens || seq.prompt.len() + seq.tokens.len() + more >= opts.context_len
}

/// Greedy decode with the host one step ahead of the device: step n + 1 is queued, its input
/// tokens taken on the device from step n's choice, before step n's choice is read back, so the
/// device does not idle while the host waits for a choice, streams it and prepares the next
/// step (about 0.05 ms of a 5 ms batch-1 Llama2-7B step on the H100: reports/NOTES.md). A step is
/// queued ahead only for the same sequences as the step in flight and only when none of them must
/// stop at that step; one that stops there anyway (EOS, a stop string) has the token computed for
/// it in the step ahead dropped.
fn decode_pipelined<B: Backend>(engine: &mut Engine<'_, B>, d: &mut DecodeLoop<'_, '_>) -> Result<()> {
    // The sequences of each queued step, oldest first (at most two).
    let mut queued: VecDeque<Vec<usize>> = VecDeque::new();
    let ran = pipeline(engine, d, &mut queued);
    if ran.is_err() {
        // A step left queued would be read by the next generate on this engine as its own.
        for _ in 0..queued.len() {
            let _ = engine.greedy_take();
        }
    }
    ran
}

fn pipeline<B: Backend>(
    engine: &mut Engine<'_, B>,
    d: &mut DecodeLoop<'_, '_>,
    queued: &mut VecDeque<Vec<usize>>,
) -> Result<()> {
    let mut t_step = Instant::now();
    loop {
        let active = d.active();
        if queued.is_empty() {
            if active.is_empty() {
                return Ok(());
            }
            let tokens = d.last_tokens(&active);
            engine.decode_greedy_queue(&mut tables_of(d.tables, &active), Some(&tokens))?;
            queued.push_back(active.clone());
        }
        // One step ahead, fed on the device from the step in flight.
        if queued.len() == 1 && queued[0] == active && !active.iter().any(|&i| stops_within(&d.seqs[i], 1, d.opts)) {
            match engine.decode_greedy_queue(&mut tables_of(d.tables, &active), None) {
                Ok(()) => queued.push_back(active),
                // Out of pages a step early (the step-by-step loop might not have needed them):
                // read the step in flight first; a real shortage shows again then.
                Err(FdppError::OutOfKvPages { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let Some(set) = queued.pop_front() else {
            return Ok(());
        };
        let ids = engine.greedy_take()?;
        d.step_ms.push(t_step.elapsed().as_secs_f64() * 1e3);
        t_step = Instant::now();
        for (&i, &id) in set.iter().zip(&ids) {
            // Stopped at the step before: this token was computed ahead and is dropped.
            if d.seqs[i].finish.is_none() {
                d.accept_id(i, id)?;
            }
        }
        // Pages go back once no queued step reads them.
        for i in set {
            if d.seqs[i].finish.is_some() && !queued.iter().any(|q| q.contains(&i)) && !d.tables[i].pages.is_empty() {
                engine.release(&mut d.tables[i])?;
            }
        }
    }
}

/// Sample the next token of `seq`, stream it, and decide whether the sequence is done.
fn accept(
    seq: &mut Seq,
    index: usize,
    logits: &[f32],
    opts: &GenerateOptions,
    tok: Option<&Tokenizer>,
    on_token: &mut OnToken<'_>,
) -> Result<()> {
    let id = seq.sampler.sample(logits, &seq.history())?;
    accept_id(seq, index, id, opts, tok, on_token)
}

/// Stream the chosen token `id` of `seq` and decide whether the sequence is done.
fn accept_id(
    seq: &mut Seq,
    index: usize,
    id: u32,
    opts: &GenerateOptions,
    tok: Option<&Tokenizer>,
    on_token: &mut OnToken<'_>,
) -> Result<()> {
    seq.tokens.push(id);
    let piece = match tok {
        Some(t) => seq.text.push(t, id)?,
        None => String::new(),
    };
    seq.full_text.push_str(&piece);
    on_token(index, id, &piece);
    let stop_at = opts.stop.iter().filter_map(|s| seq.full_text.find(s.as_str())).min();
    seq.finish = if !opts.ignore_eos && opts.eos_ids.contains(&id) {
        Some(FinishReason::Eos)
    } else if let Some(at) = stop_at {
        seq.full_text.truncate(at);
        Some(FinishReason::Stop)
    } else if seq.tokens.len() >= opts.max_tokens {
        Some(FinishReason::MaxTokens)
    } else if seq.prompt.len() + seq.tokens.len() >= opts.context_len {
        Some(FinishReason::Context)
    } else {
        None
    };
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
