//! The inputs and outputs of one forward step: which sequences it runs, what it returns, the
//! host-side arrays gathered from them, and the attention parameters every layer shares.

use crate::dtype::DType;
use crate::engine::memory::ActPlan;
use crate::error::{FdppError, Result};
use crate::kv::{BlockTable, FlatBlockTables};
use crate::ops::attention::{AttnGeometry, AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};
use crate::ops::layer::KvAppendParams;

/// Whether a step appends one token per sequence (decode) or attends over several new tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
}

impl StepKind {
    pub(crate) fn tag(self) -> &'static str {
        match self {
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
        }
    }
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct StepSeq<'a> {
    /// The sequence's pages, already grown to hold the new tokens (seq_len counts them).
    pub table: &'a BlockTable,
    /// The new tokens, at positions seq_len − len .. seq_len.
    pub tokens: &'a [u32],
    /// Return the logits of the last new token.
    pub want_logits: bool,
}

/// What a step returns for the sequences that want its last token's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepWant {
    /// The logits, read back to the host (any sampler).
    Logits,
    /// The greedy token chosen on the device ([`Backend::argmax_rows`]): one index per
    /// sequence is read back instead of vocab_size logits.
    Greedy,
    /// The greedy choice queued, not read ([`Backend::greedy_enqueue`]; the step returns no
    /// tokens). `fed`: the step's input tokens are the previous queued choice, still on the
    /// device ([`Backend::embedding_fed`]); the tokens of its sequences are placeholders.
    Queued { fed: bool },
}

#[derive(Clone, Debug, Default)]
pub struct StepOut {
    /// With [`StepWant::Logits`]: one row of vocab_size logits per sequence that wanted them, in
    /// step order.
    pub logits: Vec<Vec<f32>>,
    /// With [`StepWant::Greedy`]: the chosen token of each of those sequences, in step order.
    pub tokens: Vec<u32>,
    pub attn: AttnStats,
}

/// The host-side inputs of a step, gathered from its sequences.
pub(crate) struct StepInputs {
    pub ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub new_lens: Vec<i32>,
    /// Rows (tokens of the step) whose logits are wanted, in step order.
    pub wanted_rows: Vec<i32>,
}

impl StepInputs {
    pub fn of(kind: StepKind, seqs: &[StepSeq]) -> Result<StepInputs> {
        if seqs.is_empty() {
            return Err(FdppError::InvalidArgument("a step needs at least one sequence".into()));
        }
        let mut inp = StepInputs {
            ids: Vec::new(),
            positions: Vec::new(),
            new_lens: Vec::with_capacity(seqs.len()),
            wanted_rows: Vec::new(),
        };
        for (i, s) in seqs.iter().enumerate() {
            let n = s.tokens.len();
            if n == 0 || n > s.table.seq_len {
                return Err(FdppError::InvalidArgument(format!(
                    "step sequence {i}: {n} new tokens for a sequence of {} (must be 1..=its length)",
                    s.table.seq_len
                )));
            }
            if kind == StepKind::Decode && n != 1 {
                return Err(FdppError::InvalidArgument(format!(
                    "decode step sequence {i}: {n} new tokens; a decode step appends exactly one"
                )));
            }
            let start = s.table.seq_len - n;
            inp.ids.extend(s.tokens.iter().map(|&t| t as i32));
            inp.positions.extend((start..start + n).map(|p| p as i32));
            inp.new_lens.push(n as i32);
            if s.want_logits {
                inp.wanted_rows.push((inp.ids.len() - 1) as i32);
            }
        }
        Ok(inp)
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// The step fits the memory plan the buffers were made for.
    pub fn check_plan(&self, plan: &ActPlan, projects: bool) -> Result<()> {
        let (t, rows) = (self.tokens(), self.wanted_rows.len());
        if t > plan.max_tokens || rows > plan.max_batch {
            return Err(FdppError::InvalidArgument(format!(
                "internal: a step of {t} tokens and {rows} logit rows exceeds the memory plan ({} tokens, {} rows)",
                plan.max_tokens, plan.max_batch
            )));
        }
        if projects != plan.globals.embedded.is_some() {
            return Err(FdppError::InvalidArgument(
                "internal: the memory plan was made for another architecture (embedding projection)".into(),
            ));
        }
        Ok(())
    }
}

/// A step's attention: the same tables and lengths serve every layer.
pub(crate) enum Attn {
    Prefill(KvAppendParams, PrefillParams),
    Decode(KvAppendParams, DecodeParams),
}

impl Attn {
    pub fn new(
        kind: StepKind,
        geom: AttnGeometry,
        dtype: DType,
        scheme: SoftmaxScheme,
        tables: FlatBlockTables,
        new_lens: Vec<i32>,
    ) -> Attn {
        match kind {
            StepKind::Prefill => Attn::Prefill(
                KvAppendParams {
                    tables: tables.clone(),
                    new_lens: new_lens.clone(),
                },
                PrefillParams {
                    geom,
                    dtype,
                    scheme,
                    tables,
                    new_lens,
                },
            ),
            StepKind::Decode => Attn::Decode(
                KvAppendParams {
                    tables: tables.clone(),
                    new_lens,
                },
                DecodeParams {
                    geom,
                    dtype,
                    scheme,
                    tables,
                    num_splits: None,
                },
            ),
        }
    }

    /// Run this layer's softmax (the tables and lengths stay the step's).
    pub fn set_scheme(&mut self, scheme: SoftmaxScheme) {
        match self {
            Attn::Prefill(_, p) => p.scheme = scheme,
            Attn::Decode(_, p) => p.scheme = scheme,
        }
    }

    /// The step's attention as a prefill of its new tokens (for the score statistics).
    pub fn as_prefill(&self) -> PrefillParams {
        match self {
            Attn::Prefill(_, p) => p.clone(),
            Attn::Decode(ap, p) => PrefillParams {
                geom: p.geom,
                dtype: p.dtype,
                scheme: p.scheme,
                tables: p.tables.clone(),
                new_lens: ap.new_lens.clone(),
            },
        }
    }
}
