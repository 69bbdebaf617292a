//! An [`Engine`]: a model with its KV cache and activation buffers, sized by a memory plan,
//! running chunked prefills and decode steps for sequences identified by their block tables.

use crate::backend::Backend;
use crate::engine::activations::Activations;
use crate::engine::forward::{Model, StepKind, StepOut, StepSeq, StepWant};
use crate::engine::kv::KvCache;
use crate::engine::memory::MemoryPlan;
use crate::engine::score_stats::ScoreStats;
use crate::error::{FdppError, Result};
use crate::kv::BlockTable;
use crate::ops::attention::AttnStats;
use crate::ops::scores::ScoreStatsParams;

/// Default tokens per prefill step: long prompts are prefilled in chunks of this many tokens
/// (over all sequences of the step), which bounds the activation buffers.
pub const DEFAULT_CHUNK: usize = 2048;

pub struct Engine<'b, B: Backend> {
    pub model: Model<'b, B>,
    pub kv: KvCache<B::Buffer>,
    pub acts: Activations<B::Buffer>,
    pub memory: MemoryPlan,
    /// Attention rows computed and recomputed (async softmax fallbacks) so far.
    pub attn: AttnStats,
}

/// One prefill step's share of a sequence: (sequence, first new position, new tokens).
pub type ChunkPart = (usize, usize, usize);

/// Split prompts of `lens` tokens into steps of at most `chunk` tokens, in sequence order,
/// each sequence's tokens in order (a sequence may span steps; a step may hold several
/// sequences).
pub fn prefill_chunks(lens: &[usize], chunk: usize) -> Vec<Vec<ChunkPart>> {
    let chunk = chunk.max(1);
    let mut steps = Vec::new();
    let mut cur: Vec<ChunkPart> = Vec::new();
    let mut room = chunk;
    for (s, &len) in lens.iter().enumerate() {
        let mut done = 0;
        while done < len {
            let n = room.min(len - done);
            cur.push((s, done, n));
            done += n;
            room -= n;
            if room == 0 {
                steps.push(std::mem::take(&mut cur));
                room = chunk;
            }
        }
    }
    if !cur.is_empty() {
        steps.push(cur);
    }
    steps
}

impl<'b, B: Backend> Engine<'b, B> {
    /// Allocate the KV pools and activation buffers the plan describes.
    pub fn new(model: Model<'b, B>, memory: MemoryPlan) -> Result<Self> {
        let b = model.backend();
        let kv = KvCache::new(b, &model.cfg, model.dtype, memory.kv.page_size, memory.kv.num_pages)?;
        let acts = Activations::new(b, memory.activations.clone(), model.dtype)?;
        Ok(Engine {
            model,
            kv,
            acts,
            memory,
            attn: AttnStats::default(),
        })
    }

    /// The largest prefill step the activation buffers hold.
    pub fn max_step_tokens(&self) -> usize {
        self.acts.plan.max_tokens
    }

    fn run(&mut self, kind: StepKind, seqs: &[StepSeq], want: StepWant) -> Result<StepOut> {
        let out = self.model.step(kind, seqs, want, &mut self.kv, &mut self.acts)?;
        self.attn.rows += out.attn.rows;
        self.attn.recomputed += out.attn.recomputed;
        Ok(out)
    }

    /// Prefill `prompts[i]` after what `tables[i]` already holds (empty tables for new
    /// sequences), in steps of at most `chunk` tokens; returns each sequence's logits at its
    /// last prompt token. `on_done(i, logits)` is called as each sequence's prompt completes
    /// (its first token can be sampled before the later chunks run).
    pub fn prefill(
        &mut self,
        tables: &mut [BlockTable],
        prompts: &[&[u32]],
        chunk: usize,
        on_done: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<Vec<Vec<f32>>> {
        if tables.len() != prompts.len() {
            return Err(FdppError::InvalidArgument(format!(
                "prefill: {} block tables for {} prompts",
                tables.len(),
                prompts.len()
            )));
        }
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(FdppError::InvalidArgument(format!(
                "prompt {i} is empty; give at least one token"
            )));
        }
        let chunk = chunk.min(self.max_step_tokens());
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let base: Vec<usize> = tables.iter().map(|t| t.seq_len).collect();
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
        for step in prefill_chunks(&lens, chunk) {
            for &(s, start, n) in &step {
                self.kv.extend(&mut tables[s], base[s] + start + n)?;
            }
            let seqs: Vec<StepSeq> = step
                .iter()
                .map(|&(s, start, n)| StepSeq {
                    table: &tables[s],
                    tokens: &prompts[s][start..start + n],
                    want_logits: start + n == lens[s],
                })
                .collect();
            let res = self.run(StepKind::Prefill, &seqs, StepWant::Logits)?;
            let done = step.iter().filter(|&&(s, start, n)| start + n == lens[s]).map(|p| p.0);
            for (s, logits) in done.zip(res.logits) {
                on_done(s, &logits)?;
                out[s] = logits;
            }
        }
        Ok(out)
    }

    /// One decode step: `tokens[i]` appended to the sequence of `tables[i]`; returns each
    /// sequence's next-token logits. Running out of KV pages is `OutOfKvPages`, with every
    /// table as it was.
    pub fn decode(&mut self, tables: &mut [&mut BlockTable], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        Ok(self.decode_step(tables, tokens, StepWant::Logits)?.logits)
    }

    /// As [`decode`](Self::decode), returning each sequence's greedy next token, chosen on the
    /// device (the logits stay there).
    pub fn decode_greedy(&mut self, tables: &mut [&mut BlockTable], tokens: &[u32]) -> Result<Vec<u32>> {
        Ok(self.decode_step(tables, tokens, StepWant::Greedy)?.tokens)
    }

    /// The pipelined greedy decode (the device never waits for the host between steps):
    /// queue a decode step of `tables` whose input tokens are `tokens`, or, with `None`, the
    /// previous queued step's choices, still on the device (the same sequences in the same
    /// order). Nothing is read back; [`greedy_take`](Self::greedy_take) returns each queued
    /// step's choices, oldest first. Needs [`Backend::pipelined_greedy`].
    pub fn decode_greedy_queue(&mut self, tables: &mut [&mut BlockTable], tokens: Option<&[u32]>) -> Result<()> {
        let placeholders;
        let (tokens, fed) = match tokens {
            Some(t) => (t, false),
            None => {
                placeholders = vec![0; tables.len()];
                (placeholders.as_slice(), true)
            }
        };
        self.decode_step(tables, tokens, StepWant::Queued { fed }).map(|_| ())
    }

    /// The choices of the oldest step queued by [`decode_greedy_queue`](Self::decode_greedy_queue)
    /// (waits for that step only).
    pub fn greedy_take(&mut self) -> Result<Vec<u32>> {
        let b = self.model.backend();
        let ids = b.greedy_take()?;
        self.attn.recomputed += b.take_recomputed()?;
        Ok(ids)
    }

    fn decode_step(&mut self, tables: &mut [&mut BlockTable], tokens: &[u32], want: StepWant) -> Result<StepOut> {
        if tables.len() != tokens.len() || tables.is_empty() {
            return Err(FdppError::InvalidArgument(format!(
                "decode: {} block tables for {} tokens",
                tables.len(),
                tokens.len()
            )));
        }
        let need: usize = tables
            .iter()
            .map(|t| self.kv.layout.pages_for(t.seq_len + 1).saturating_sub(t.pages.len()))
            .sum();
        if need > self.kv.pages.free_pages() {
            return Err(FdppError::OutOfKvPages {
                needed: need,
                free: self.kv.pages.free_pages(),
                total: self.kv.layout.num_pages,
            });
        }
        for t in tables.iter_mut() {
            let len = t.seq_len + 1;
            self.kv.extend(t, len)?;
        }
        let seqs: Vec<StepSeq> = tables
            .iter()
            .zip(tokens)
            .map(|(t, tok)| StepSeq {
                table: t,
                tokens: std::slice::from_ref(tok),
                want_logits: true,
            })
            .collect();
        self.run(StepKind::Decode, &seqs, want)
    }

    /// Statistics mode on (`Some`, starting from empty histograms) or off (`None`): while on,
    /// every step also gathers the softmax inputs of every layer (see
    /// [`crate::engine::score_stats`]); results are unchanged.
    pub fn set_score_stats(&mut self, params: Option<ScoreStatsParams>) -> Result<()> {
        let stats = match params {
            Some(p) => Some(ScoreStats::new(p, self.model.cfg.num_layers, self.model.cfg.num_heads)?),
            None => None,
        };
        *self.model.score_stats.borrow_mut() = stats;
        Ok(())
    }

    /// The histograms gathered so far (statistics mode stays on, from empty ones).
    pub fn take_score_stats(&mut self) -> Option<ScoreStats> {
        let mut cell = self.model.score_stats.borrow_mut();
        let fresh = cell
            .as_ref()
            .and_then(|s| ScoreStats::new(s.params, s.layers.len(), self.model.cfg.num_heads).ok());
        std::mem::replace(&mut *cell, fresh)
    }

    /// Give a finished sequence's pages back.
    pub fn release(&mut self, table: &mut BlockTable) -> Result<()> {
        self.kv.release(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_token_once_in_order() {
        assert_eq!(prefill_chunks(&[3, 2], 8), vec![vec![(0, 0, 3), (1, 0, 2)]]);
        assert_eq!(
            prefill_chunks(&[5, 4], 3),
            vec![vec![(0, 0, 3)], vec![(0, 3, 2), (1, 0, 1)], vec![(1, 1, 3)],]
        );
        for (lens, chunk) in [(vec![7, 1, 9, 4], 4), (vec![100], 7), (vec![1; 5], 2)] {
            let steps = prefill_chunks(&lens, chunk);
            let mut next = vec![0; lens.len()];
            for step in &steps {
                assert!(step.iter().map(|p| p.2).sum::<usize>() <= chunk);
                for &(s, start, n) in step {
                    assert_eq!(start, next[s]);
                    assert!(n > 0);
                    next[s] += n;
                }
            }
            assert_eq!(next, lens);
        }
    }
}
