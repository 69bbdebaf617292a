//! The Llama-family forward pass over the [`Backend`] trait: one step runs every layer for the
//! new tokens of a batch of sequences (a prefill chunk or a decode step) and returns the logits
//! of the sequences that asked for them.
//!
//! Per layer: add_rmsnorm → QKV GEMM → qkv_rope → attention (prefill writes the new K/V into
//! the cache itself; decode appends them in the rotation's kernel, qkv_rope_append, then
//! attends) → O GEMM → add_rmsnorm (the residual add fused in) → FFN1 GEMM (gate and up fused)
//! → silu_mul → FFN2 GEMM. The FFN2 output is added to the residual by the next layer's
//! add_rmsnorm, and by the final norm after the last layer. Every GEMM's implementation comes
//! from the profile at this step's M (FlashDecoding++ §4); attention uses the profile's softmax
//! scheme (§3). On CUDA a decode step launches layer 0 and replays layers 1.. from a graph keyed
//! by layer 0's launches (backend/cuda/graph.rs).
//!
//! Fused decode layers: where the backend has fused gemv kernels ([`Backend::fused_gemv_ops`]),
//! the norms' γ are folded into W_qkv and W_ffn1 at load (and the norm weights become ones, so
//! the unfused path computes the same product). A step whose four GEMMs all run on gemv then
//! drops both add_rmsnorm launches of every layer: QKV and FFN1 read the raw residual and scale
//! by its 1/rms (`gemm_rms_in`), O and FFN2 add their output to the residual in their epilogue
//! (`gemm_residual_out`), and FFN1 writes silu(gate)·up itself (`gemm_rms_glu`, no silu_mul
//! launch). `FDPP_FUSED_GEMV=0` keeps the weights and the unfused launches; `FDPP_FUSED_GLU=0`
//! keeps silu_mul apart.

use std::cell::RefCell;

use super::op_times::OpTimes;
use super::score_stats::ScoreStats;
use crate::backend::Backend;
use crate::dtype::DType;
use crate::engine::activations::Activations;
use crate::engine::kv::KvCache;
use crate::engine::linear::{LinearPlanner, StepGemms};
use crate::engine::rope;
use crate::error::{FdppError, Result};
use crate::kv::{BlockTable, FlatBlockTables};
use crate::model::hf::HfExtras;
use crate::model::llama::{check_supported, LlamaWeights};
use crate::model::ModelConfig;
use crate::ops::attention::{AttnGeometry, AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::ops::layer::{
    EmbeddingParams, GatherParams, KvAppendParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};
use crate::ops::scores::ScoreStatsParams;

/// Block-table stride granularity of graph-replayed decode steps, in pages.
const GRAPH_STRIDE_PAGES: usize = 64;

/// A model ready to run on a backend.
pub struct Llama<'b, B: Backend> {
    b: &'b B,
    pub cfg: ModelConfig,
    pub dtype: DType,
    pub weights: LlamaWeights<B::Buffer>,
    pub geom: AttnGeometry,
    pub inv_freq: Vec<f32>,
    pub linears: LinearPlanner,
    pub scheme: SoftmaxScheme,
    /// Per-op device time when `FDPP_OP_TIMES` is set (see [`OpTimes`]).
    pub op_times: OpTimes,
    /// Softmax-input histograms, gathered while this is Some (see [`ScoreStats`]).
    pub score_stats: RefCell<Option<ScoreStats>>,
    /// The norms' γ are folded into W_qkv and W_ffn1 (see the module comment).
    folded: bool,
    /// A fused step runs FFN1 and silu_mul as one launch (`gemm_rms_glu`).
    fused_glu: bool,
}

/// Whether a step appends one token per sequence (decode) or attends over several new tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
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

impl<'b, B: Backend> Llama<'b, B> {
    pub fn new(
        b: &'b B,
        cfg: ModelConfig,
        extras: &HfExtras,
        dtype: DType,
        weights: LlamaWeights<B::Buffer>,
        linears: LinearPlanner,
        scheme: SoftmaxScheme,
    ) -> Result<Self> {
        check_supported(&cfg)?;
        scheme.validate()?;
        let geom = AttnGeometry::new(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)?;
        let inv_freq = rope::inv_freq(cfg.head_dim, cfg.rope_theta, extras.rope_scaling.as_ref());
        let mut weights = weights;
        let folded = b.fused_gemv_ops() && env_on("FDPP_FUSED_GEMV");
        if folded {
            fold_norms(b, &cfg, dtype, &mut weights)?;
        }
        Ok(Llama {
            b,
            cfg,
            dtype,
            weights,
            geom,
            inv_freq,
            linears,
            scheme,
            op_times: OpTimes::from_env(),
            score_stats: RefCell::new(None),
            folded,
            fused_glu: env_on("FDPP_FUSED_GLU"),
        })
    }

    pub fn backend(&self) -> &'b B {
        self.b
    }

    /// Run one step. The activation buffers must have been planned for at least this many
    /// tokens and logit rows.
    pub fn step(
        &self,
        kind: StepKind,
        seqs: &[StepSeq],
        want: StepWant,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<StepOut> {
        let b = self.b;
        let cfg = &self.cfg;
        let dt = self.dtype;
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        if seqs.is_empty() {
            return Err(FdppError::InvalidArgument("a step needs at least one sequence".into()));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut new_lens = Vec::with_capacity(seqs.len());
        let mut wanted_rows = Vec::new();
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
            ids.extend(s.tokens.iter().map(|&t| t as i32));
            positions.extend((start..start + n).map(|p| p as i32));
            new_lens.push(n as i32);
            if s.want_logits {
                wanted_rows.push((ids.len() - 1) as i32);
            }
        }
        let t = ids.len();
        let plan = &acts.plan;
        if t > plan.max_tokens || wanted_rows.len() > plan.max_batch {
            return Err(FdppError::InvalidArgument(format!(
                "internal: a step of {t} tokens and {} logit rows exceeds the memory plan ({} tokens, {} rows)",
                wanted_rows.len(),
                plan.max_tokens,
                plan.max_batch
            )));
        }
        let g = plan.globals;
        let layer_slots = plan.layers.clone();
        let tables: Vec<BlockTable> = seqs.iter().map(|s| s.table.clone()).collect();
        let flat = FlatBlockTables::new(&kv.layout, &tables)?;
        let graphs = kind == StepKind::Decode
            && self.score_stats.borrow().is_none()
            && !self.op_times.on()
            && b.graph_counts().is_some();
        // The table stride is a kernel argument: rounded up, one decode graph serves many steps.
        let flat = if graphs {
            let stride = flat.max_pages.div_ceil(GRAPH_STRIDE_PAGES) * GRAPH_STRIDE_PAGES;
            flat.with_stride(stride)
        } else {
            flat
        };
        let gemms = self.linears.step(t, wanted_rows.len().max(1));
        let fused = self.folded && self.fusable(&gemms, t);
        let mut stats = AttnStats::default();

        self.op_times.start(
            b,
            match kind {
                StepKind::Prefill => "prefill",
                StepKind::Decode => "decode",
            },
        )?;
        let ep = EmbeddingParams {
            ids,
            vocab,
            hidden: h,
            dtype: dt,
        };
        if want == (StepWant::Queued { fed: true }) {
            b.embedding_fed(&ep, &self.weights.embed, acts.get_mut(g.residual))?;
        } else {
            b.embedding(&ep, &self.weights.embed, acts.get_mut(g.residual))?;
        }
        self.op_times.lap(b, "embedding")?;
        let norm = RmsNormParams {
            rows: t,
            hidden: h,
            eps: cfg.rms_norm_eps as f32,
            dtype: dt,
        };
        let rope = RopeParams {
            geom: self.geom,
            dtype: dt,
            positions,
            inv_freq: self.inv_freq.clone(),
            layout: RopeLayout::Half,
        };
        // The same tables and lengths serve every layer.
        let attn = match kind {
            StepKind::Prefill => Attn::Prefill(PrefillParams {
                geom: self.geom,
                dtype: dt,
                scheme: self.scheme,
                tables: flat,
                new_lens,
            }),
            StepKind::Decode => Attn::Decode(
                KvAppendParams {
                    tables: flat.clone(),
                    new_lens,
                },
                DecodeParams {
                    geom: self.geom,
                    dtype: dt,
                    scheme: self.scheme,
                    tables: flat,
                    num_splits: None,
                },
            ),
        };
        // Statistics mode: the scores of this step as a prefill of its new tokens (a decode step
        // is one new token per sequence over the same tables).
        let stats_params = self.score_stats.borrow().as_ref().map(|st| {
            let p = match &attn {
                Attn::Prefill(p) => p.clone(),
                Attn::Decode(ap, p) => PrefillParams {
                    geom: p.geom,
                    dtype: p.dtype,
                    scheme: p.scheme,
                    tables: p.tables.clone(),
                    new_lens: ap.new_lens.clone(),
                },
            };
            (p, st.params)
        });
        let la = LayerArgs {
            norm: &norm,
            rope: &rope,
            attn: &attn,
            gemms: &gemms,
            tokens: t,
            residual: g.residual,
            stats_params: &stats_params,
            fused,
        };
        let n = self.weights.layers.len();
        stats.rows += n * t * cfg.num_heads;
        // Decode steps replay layers 1.. from a CUDA graph keyed by layer 0's launches
        // (backend/cuda/graph.rs); other backends, prefill and the diagnostic modes run eagerly.
        let sig = if n == 0 {
            None
        } else if graphs && b.graph_begin() {
            // The recording ends whatever layer 0 returns.
            let ran = self.layer(&la, 0, None, kv, acts);
            let sig = b.graph_end();
            ran?;
            sig
        } else {
            self.layer(&la, 0, None, kv, acts)?;
            None
        };
        let mut rest = || (1..n).try_for_each(|l| self.layer(&la, l, Some(layer_slots[l - 1].ffn2), kv, acts));
        match sig {
            Some(sig) => b.graph_run(sig, &mut rest)?,
            None => rest()?,
        }
        // A fused step's FFN2 already added its output to the residual.
        let prev_ffn2 = layer_slots.last().filter(|_| !fused).map(|s| s.ffn2);
        self.add_rmsnorm(
            &norm,
            acts,
            g.residual,
            prev_ffn2,
            &self.weights.final_norm,
            g.final_normed,
        )?;
        if stats_params.is_some() {
            if let Some(st) = self.score_stats.borrow_mut().as_mut() {
                st.steps += 1;
            }
        }
        self.op_times.lap(b, "add_rmsnorm")?;
        let rows = wanted_rows.len();
        // The recompute count is read after the step's own readback: reading it here would make
        // the host wait for every layer before it could queue the LM head.
        if rows == 0 {
            stats.recomputed += b.take_recomputed()?;
            return Ok(StepOut {
                attn: stats,
                ..StepOut::default()
            });
        }
        // Every row wanted in order (a decode step): the LM head reads the normed rows as they
        // are; otherwise the last token of each sequence is gathered first.
        let all_rows = rows == t;
        let src = if all_rows {
            g.final_normed
        } else {
            let [src, dst] = acts.many([g.final_normed, g.gathered])?;
            b.gather_rows(
                &GatherParams {
                    rows: wanted_rows,
                    width: h,
                    dtype: dt,
                },
                src,
                dst,
            )?;
            g.gathered
        };
        self.op_times.lap(b, "gather_rows")?;
        self.lm_head(&gemms, rows, acts, src, g.logits)?;
        self.op_times.lap(b, "gemm lm_head")?;
        if let StepWant::Queued { .. } = want {
            // The recompute total comes back with the choice (Engine::greedy_take).
            b.greedy_enqueue(acts.get(g.logits), rows, vocab)?;
            self.op_times.lap(b, "argmax")?;
            return Ok(StepOut {
                attn: stats,
                ..StepOut::default()
            });
        }
        if want == StepWant::Greedy {
            let tokens = b.argmax_rows(acts.get(g.logits), rows, vocab)?;
            stats.recomputed += b.take_recomputed()?;
            self.op_times.lap(b, "argmax")?;
            return Ok(StepOut {
                tokens,
                attn: stats,
                ..StepOut::default()
            });
        }
        let bits = b.download(acts.get(g.logits))?;
        stats.recomputed += b.take_recomputed()?;
        self.op_times.lap(b, "logits download")?;
        let mut row = vec![0f32; vocab];
        let logits = (0..rows)
            .map(|r| {
                dt.widen(&bits[r * vocab..(r + 1) * vocab], &mut row);
                row.clone()
            })
            .collect();
        Ok(StepOut {
            logits,
            attn: stats,
            ..StepOut::default()
        })
    }

    /// One layer's launches (see the module comment for the order). `prev_ffn2`: the slot of
    /// the previous layer's FFN2 output, added to the residual by this layer's first norm (not
    /// read in a fused step, whose FFN2 added it already).
    fn layer(
        &self,
        a: &LayerArgs,
        l: usize,
        prev_ffn2: Option<usize>,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<()> {
        let b = self.b;
        let cfg = &self.cfg;
        let (h, t, dt) = (cfg.hidden_size, a.tokens, self.dtype);
        let (w, s) = (&self.weights.layers[l], acts.plan.layers[l]);
        let (norm, rope, gemms) = (a.norm, a.rope, a.gemms);
        if a.fused {
            self.gemm_rms_in(&gemms.qkv, t, self.qkv_n(), h, acts, a.residual, &w.qkv, s.qkv)?;
        } else {
            self.add_rmsnorm(norm, acts, a.residual, prev_ffn2, &w.attn_norm, s.normed_attn)?;
            self.op_times.lap(b, "add_rmsnorm")?;
            self.gemm(&gemms.qkv, t, self.qkv_n(), h, acts, s.normed_attn, &w.qkv, s.qkv)?;
        }
        self.op_times.lap(b, "gemm qkv")?;
        let cache = &mut kv.layers[l];
        {
            let [qkv, q, k, v] = acts.many([s.qkv, s.q, s.k, s.v])?;
            match a.attn {
                Attn::Prefill(_) => b.qkv_rope(rope, qkv, w.qkv_bias.as_ref(), q, k, v)?,
                // A decode step appends its token's k and v to the cache in the same kernel
                // as the rotation (one launch fewer per layer on a GPU).
                Attn::Decode(ap, _) => b.qkv_rope_append(rope, ap, qkv, w.qkv_bias.as_ref(), q, k, v, cache)?,
            }
        }
        self.op_times.lap(b, "qkv_rope")?;
        // The enqueue entry points: a GPU backend counts recomputed rows on the device and
        // the step reads the count once, after its last layer, instead of waiting for the
        // device in every layer.
        match a.attn {
            Attn::Prefill(p) => {
                let [q, k, v, out] = acts.many([s.q, s.k, s.v, s.attn])?;
                b.attention_prefill_enqueue(p, q, k, v, cache, out)?
            }
            Attn::Decode(_, p) => {
                let [q, out] = acts.many([s.q, s.attn])?;
                b.attention_decode_enqueue(p, q, cache, out)?
            }
        };
        self.op_times.lap(b, "attention")?;
        if let Some((sp, params)) = a.stats_params {
            let hists = b.attention_score_hist(sp, params, acts.get(s.q), cache)?;
            if let Some(st) = self.score_stats.borrow_mut().as_mut() {
                st.add(l, &hists)?;
            }
            self.op_times.lap(b, "score_hist")?;
        }
        let qd = cfg.num_heads * cfg.head_dim;
        let inter = cfg.intermediate_size;
        if a.fused {
            self.gemm_residual_out(&gemms.o, t, h, qd, acts, s.attn, &w.o, a.residual)?;
            self.op_times.lap(b, "gemm o")?;
            if self.fused_glu {
                // FFN1 and silu_mul in one launch: the gate/up output never leaves the GEMV.
                let dims = GemmDims::new(t, inter, h)?;
                let [r, out] = acts.many([a.residual, s.act])?;
                b.gemm_rms_glu(&gemms.ffn1, dims, self.cfg.rms_norm_eps as f32, r, &w.ffn1, out)?;
            } else {
                self.gemm_rms_in(&gemms.ffn1, t, 2 * inter, h, acts, a.residual, &w.ffn1, s.ffn1)?;
            }
        } else {
            self.gemm(&gemms.o, t, h, qd, acts, s.attn, &w.o, s.o)?;
            self.op_times.lap(b, "gemm o")?;
            self.add_rmsnorm(norm, acts, a.residual, Some(s.o), &w.ffn_norm, s.normed_ffn)?;
            self.op_times.lap(b, "add_rmsnorm")?;
            self.gemm(&gemms.ffn1, t, 2 * inter, h, acts, s.normed_ffn, &w.ffn1, s.ffn1)?;
        }
        self.op_times.lap(b, "gemm ffn1")?;
        if !(a.fused && self.fused_glu) {
            let [gate_up, out] = acts.many([s.ffn1, s.act])?;
            b.silu_mul(
                &SiluMulParams {
                    rows: t,
                    inter,
                    dtype: dt,
                },
                gate_up,
                out,
            )?;
            self.op_times.lap(b, "silu_mul")?;
        }
        if a.fused {
            self.gemm_residual_out(&gemms.ffn2, t, h, inter, acts, s.act, &w.ffn2, a.residual)?;
        } else {
            self.gemm(&gemms.ffn2, t, h, inter, acts, s.act, &w.ffn2, s.ffn2)?;
        }
        self.op_times.lap(b, "gemm ffn2")?;
        Ok(())
    }

    /// Whether a step of `t` tokens with these GEMMs runs the fused layer: all four on gemv,
    /// at most the fused kernels' M, every K a whole number of 16-byte chunks.
    fn fusable(&self, gemms: &StepGemms, t: usize) -> bool {
        let c = &self.cfg;
        let ks = [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size];
        t <= FUSED_MAX_M
            && [&gemms.qkv, &gemms.o, &gemms.ffn1, &gemms.ffn2]
                .iter()
                .all(|s| s.imp == GemmImpl::Gemv)
            && ks.iter().all(|k| k.is_multiple_of(8))
    }

    /// y = rmsnorm(residual) · Wᵀ with W holding the norm's γ (a fused step).
    #[allow(clippy::too_many_arguments)]
    fn gemm_rms_in(
        &self,
        spec: &GemmSpec,
        m: usize,
        n: usize,
        k: usize,
        acts: &mut Activations<B::Buffer>,
        residual: usize,
        w: &B::Buffer,
        y: usize,
    ) -> Result<()> {
        let dims = GemmDims::new(m, n, k)?;
        let [r, y] = acts.many([residual, y])?;
        self.b.gemm_rms_in(spec, dims, self.cfg.rms_norm_eps as f32, r, w, y)
    }

    /// residual += x · Wᵀ (a fused step).
    #[allow(clippy::too_many_arguments)]
    fn gemm_residual_out(
        &self,
        spec: &GemmSpec,
        m: usize,
        n: usize,
        k: usize,
        acts: &mut Activations<B::Buffer>,
        x: usize,
        w: &B::Buffer,
        residual: usize,
    ) -> Result<()> {
        let dims = GemmDims::new(m, n, k)?;
        let [x, r] = acts.many([x, residual])?;
        self.b.gemm_residual_out(spec, dims, x, w, r)
    }

    fn qkv_n(&self) -> usize {
        (self.cfg.num_heads + 2 * self.cfg.num_kv_heads) * self.cfg.head_dim
    }

    fn add_rmsnorm(
        &self,
        p: &RmsNormParams,
        acts: &mut Activations<B::Buffer>,
        residual: usize,
        delta: Option<usize>,
        weight: &B::Buffer,
        out: usize,
    ) -> Result<()> {
        match delta {
            Some(d) => {
                let [r, d, o] = acts.many([residual, d, out])?;
                self.b.add_rmsnorm(p, r, Some(d), weight, o)
            }
            None => {
                let [r, o] = acts.many([residual, out])?;
                self.b.add_rmsnorm(p, r, None, weight, o)
            }
        }
    }

    /// y[m, n] = x[m, k] · Wᵀ with the step's spec; a spec the backend declines for these dims
    /// falls back to the vendor GEMM (correct at every M) rather than failing the generation.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        spec: &GemmSpec,
        m: usize,
        n: usize,
        k: usize,
        acts: &mut Activations<B::Buffer>,
        x: usize,
        w: &B::Buffer,
        y: usize,
    ) -> Result<()> {
        let dims = GemmDims::new(m, n, k)?;
        let [x, y] = acts.many([x, y])?;
        run_gemm(self.b, spec, dims, x, w, y)
    }

    fn lm_head(
        &self,
        gemms: &StepGemms,
        rows: usize,
        acts: &mut Activations<B::Buffer>,
        x: usize,
        y: usize,
    ) -> Result<()> {
        let dims = GemmDims::new(rows, self.cfg.vocab_size, self.cfg.hidden_size)?;
        let [x, y] = acts.many([x, y])?;
        run_gemm(self.b, &gemms.lm_head, dims, x, self.weights.lm_head(), y)
    }
}

enum Attn {
    Prefill(PrefillParams),
    Decode(KvAppendParams, DecodeParams),
}

/// What every layer of one step shares.
struct LayerArgs<'x> {
    norm: &'x RmsNormParams,
    rope: &'x RopeParams,
    attn: &'x Attn,
    gemms: &'x StepGemms,
    tokens: usize,
    residual: usize,
    stats_params: &'x Option<(PrefillParams, ScoreStatsParams)>,
    /// Run the fused layer (see the module comment).
    fused: bool,
}

/// A switch for A/B runs: on unless the variable is "0".
fn env_on(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v != "0")
}

/// The most rows the fused gemv kernels take (backend/cuda/gemv_fused.rs).
const FUSED_MAX_M: usize = 8;

/// Folds each layer's two norm weights into the GEMM that reads the norm (W_qkv by attn_norm,
/// W_ffn1 by ffn_norm: W' = W·diag(γ)) and sets those norm weights to ones, so the unfused path
/// (add_rmsnorm, then the GEMM) computes rmsnorm(x)·γ·Wᵀ as before and the fused one can skip
/// the norm. The final norm is left as it is (the LM head may be the tied embedding).
fn fold_norms<B: Backend>(b: &B, cfg: &ModelConfig, dt: DType, w: &mut LlamaWeights<B::Buffer>) -> Result<()> {
    let h = cfg.hidden_size;
    let qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim;
    let ones = vec![dt.from_f32(1.0); h];
    for l in w.layers.iter_mut() {
        b.scale_cols(&mut l.qkv, &l.attn_norm, qkv_n, h)?;
        b.scale_cols(&mut l.ffn1, &l.ffn_norm, 2 * cfg.intermediate_size, h)?;
        l.attn_norm = b.upload(dt, &ones)?;
        l.ffn_norm = b.upload(dt, &ones)?;
    }
    Ok(())
}

fn run_gemm<B: Backend>(
    b: &B,
    spec: &GemmSpec,
    dims: GemmDims,
    x: &B::Buffer,
    w: &B::Buffer,
    y: &mut B::Buffer,
) -> Result<()> {
    match b.gemm(spec, dims, x, w, y) {
        Err(FdppError::Unsupported { .. }) if spec.imp != GemmImpl::Gemm => {
            b.gemm(&GemmSpec::new(GemmImpl::Gemm, spec.dtype), dims, x, w, y)
        }
        other => other,
    }
}
