//! The forward pass over the [`Backend`] trait, for any [`Arch`]: one step runs every layer for
//! the new tokens of a batch of sequences (a prefill chunk or a decode step) and returns the
//! logits of the sequences that asked for them.
//!
//! A step: embedding (→ project_in, + learned positions, as the model has them) → layers →
//! final norm → gather of the wanted rows (→ project_out) → LM head. A layer: norm (RMSNorm, or
//! LayerNorm with bias; the residual add of the previous layer's output fused in) → QKV GEMM →
//! qkv_rope (bias, rotary over all, part or none of each head, in either pairing layout; a
//! decode step appends the new K/V to the cache in the same op, qkv_rope_append) → attention
//! (prefill writes the new K/V into the cache itself) → O GEMM (+ bias) → norm → FFN1 GEMM →
//! GLU (gated MLP) or bias + activation in place (plain MLP) → FFN2 GEMM (+ bias). The FFN2
//! output is added to the residual by the next layer's norm, and by the final norm after the
//! last layer. Every GEMM's implementation comes from the profile at this step's M
//! (FlashDecoding++ §4); attention uses the profile's softmax scheme (§3). On CUDA a decode
//! step launches layer 0 and replays layers 1.. from a graph keyed by layer 0's launches
//! (backend/cuda/graph.rs).
//!
//! Fused decode layers, where the architecture allows them ([`Arch::fusable`]: RMSNorm, SiLU
//! GLU, no bias after O or FFN2) and the backend has fused gemv kernels
//! ([`Backend::fused_gemv_ops`]): the norms' γ are folded into W_qkv and W_ffn1 at load (and
//! the norm weights become ones, so the unfused path computes the same product). A step whose
//! four GEMMs all run on gemv then drops both norm launches of every layer: QKV and FFN1 read
//! the raw residual and scale by its 1/rms (`gemm_rms_in`), O and FFN2 add their output to the
//! residual in their epilogue (`gemm_residual_out`), and FFN1 writes silu(gate)·up itself
//! (`gemm_rms_glu`, no GLU launch). `FDPP_FUSED_GEMV=0` keeps the weights and the unfused
//! launches; `FDPP_FUSED_GLU=0` keeps the GLU apart.
//!
//! Fused prefill layers (issue #20), where the same folded weights meet a backend with GEMMs that
//! take epilogues ([`Backend::prefill_fusion`]: fdpp's wgmma GEMM on sm_90a) and the step has at
//! least `fused_prefill_min` tokens (default 1024; below it the wgmma GEMM's 128-row tiles leave
//! SMs idle): the same hooks at prefill sizes, for either norm of a layer ([`PrefillPairs`]). The
//! GEMM before the norm adds into the residual and leaves each row's sum of squares
//! (`prefill_residual_out`: FFN2 for the attention norm, O for the MLP's); the GEMM after it
//! scales its product by the norm's 1/rms (`prefill_rms_in`; QKV also rotates q and k and writes
//! k and v to the cache, `prefill_rms_rope_append`, heads of 128 without a QKV bias; FFN1 also
//! applies the GLU, `prefill_rms_glu`); layer 0's statistics come from `prefill_row_sumsq`. The
//! default takes both norms (`fused_prefill=all`): a layer runs no add_rmsnorm, qkv_rope or
//! silu_mul. With the GLU epilogue's fast SiLU, `all` leads `attn` by 0.6-0.8 ms at 1024 tokens
//! and by 1-6 ms at 2048-4096 on the H200; before it, the GLU epilogue's cost left them level
//! (reports/NOTES.md, sessions 33-34). These GEMMs do not take the profile's ImplC pick (which
//! timed the plain product): the backend picks their tiles.
//!
//! Tensor parallelism ([`crate::tp`], issue #22): a rank's model is its share of the heads and
//! of the MLP; after O and after FFN2 the ranks' partial outputs are all-reduced (Megatron's two
//! collectives per layer) before the residual add. Each rank's embedding and LM head are its
//! slice of the vocabulary (Megatron's vocabulary-parallel layers): the lookup is all-reduced
//! (zeros from the ranks without the id) and the slices' logits all-gathered, so every rank
//! samples from the same full row (`tp_vocab=0`, or a vocabulary the ranks do not divide: both
//! are replicated and rank 0's logits broadcast). With tp the fused layer and the decode graphs
//! (the collectives captured) are on by default since session 14; `tp_fused=0` / `tp_graphs=0`
//! turn them off ([`Model::set_comm`]).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use super::op_times::OpTimes;
use super::score_stats::ScoreStats;
use crate::backend::{Backend, DeviceBuffer, RowSums};
use crate::dtype::DType;
use crate::engine::activations::Activations;
use crate::engine::kv::KvCache;
use crate::engine::linear::{gemm_or_fallback, LinearPlanner, StepGemms};
use crate::error::{FdppError, Result};
use crate::kv::{BlockTable, FlatBlockTables};
use crate::model::arch::{Arch, Mlp, NormKind, Positions};
use crate::model::hf::HfExtras;
use crate::model::spec::check_arch;
use crate::model::tensors::{ModelWeights, Norm};
use crate::model::ModelConfig;
use crate::ops::attention::{AttnGeometry, AttnStats, PrefillParams, SoftmaxScheme};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::ops::layer::{
    Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, LayerNormParams, PositionParams,
    RmsNormParams, RopeParams,
};
use crate::ops::scores::ScoreStatsParams;
use crate::run_config::Key;
use crate::tp::Communicator;

use super::step::{Attn, StepInputs};
pub use super::step::{StepKind, StepOut, StepSeq, StepWant};

/// Block-table stride granularity of graph-replayed decode steps, in pages.
const GRAPH_STRIDE_PAGES: usize = 64;

/// A model ready to run on a backend.
pub struct Model<'b, B: Backend> {
    b: &'b B,
    pub cfg: ModelConfig,
    pub arch: Arch,
    pub dtype: DType,
    pub weights: ModelWeights<B::Buffer>,
    pub geom: AttnGeometry,
    pub inv_freq: Vec<f32>,
    pub linears: LinearPlanner,
    pub scheme: SoftmaxScheme,
    /// Each layer's async window (FlashDecoding++ §3, calibrated per layer); empty: `scheme`
    /// for every layer. Read through [`Model::scheme_for`]: a sync `scheme` overrides them.
    pub layer_schemes: Vec<SoftmaxScheme>,
    /// Decode batches up to this one run their one-head-per-block attention on the tensor-core
    /// pass: the profile's `decode_pass` choice, timed on the device (`tune::decode_pass`). Set
    /// on the backend before each decode attention, so that models with other profiles can
    /// share it.
    pub decode_tc_up_to: Option<usize>,
    /// Per-op device time when `FDPP_OP_TIMES` is set (see [`OpTimes`]).
    pub op_times: OpTimes,
    /// Softmax-input histograms, gathered while this is Some (see [`ScoreStats`]).
    pub score_stats: RefCell<Option<ScoreStats>>,
    /// The norms' γ are folded into W_qkv and W_ffn1 (see the module comment).
    folded: bool,
    /// A fused step runs FFN1 and the GLU as one launch (`gemm_rms_glu`).
    fused_glu: bool,
    /// A fused decode step runs QKV, the rotary and the KV append as one launch
    /// (`gemm_rms_rope_append`): the switch is on and the rotary is whole-head rotate-half.
    fused_rope: bool,
    /// Steps of at least this many tokens run the fused prefill layer (see the module comment);
    /// None: never (the backend has no such GEMMs, the weights are not folded, or it is off).
    fused_prefill_min: Option<usize>,
    /// Which norms of a layer the fused prefill takes into its GEMMs (`fused_prefill`).
    prefill_pairs: PrefillPairs,
    /// A fused prefill step runs QKV, the rotary and the KV write as one launch
    /// (`prefill_rms_rope_append`): `fused_rope`, heads of 128 and no QKV bias.
    prefill_rope: bool,
    /// The fused prefill's row sums of squares (the backend's format), grown to the step.
    row_sums: RefCell<Option<B::Buffer>>,
    /// Tensor parallelism (issue #22, [`crate::tp`]): this rank's group, None on one device.
    comm: Option<Arc<dyn Communicator<B> + 'b>>,
    /// With tp: the vocabulary rows of this rank's embedding and LM head when it holds a slice
    /// (vocab / world), None when both are replicated.
    vocab_slice: Option<usize>,
    /// Where the ranks' slices of the logits are all-gathered ([world][rows][slice]); grown
    /// to the largest step's logits on first use (outside the decode graphs: the LM head is not
    /// captured).
    gathered_logits: RefCell<Option<B::Buffer>>,
}

/// The name the model had when the engine ran the Llama family only (other modules' imports).
pub type Llama<'b, B> = Model<'b, B>;

impl<'b, B: Backend> Model<'b, B> {
    /// The model of `cfg` and `extras` over `weights` (from [`crate::model::family`]).
    pub fn new(
        b: &'b B,
        cfg: ModelConfig,
        extras: &HfExtras,
        dtype: DType,
        weights: ModelWeights<B::Buffer>,
        linears: LinearPlanner,
        scheme: SoftmaxScheme,
    ) -> Result<Self> {
        let arch = check_arch(&cfg, extras)?;
        scheme.validate()?;
        let geom = AttnGeometry::new(arch.heads, arch.kv_heads, arch.head_dim)?;
        let inv_freq = arch.inv_freq();
        let mut weights = weights;
        let folded = arch.fusable() && b.fused_gemv_ops() && crate::run_config::get().on(Key::FusedGemv);
        if folded {
            fold_norms(b, &arch, dtype, &mut weights)?;
        }
        let mut model = Model {
            b,
            cfg,
            arch,
            dtype,
            weights,
            geom,
            inv_freq,
            linears,
            scheme,
            layer_schemes: Vec::new(),
            decode_tc_up_to: None,
            op_times: OpTimes::from_env(),
            score_stats: RefCell::new(None),
            folded,
            fused_glu: crate::run_config::get().on(Key::FusedGlu),
            fused_rope: false,
            fused_prefill_min: None,
            prefill_pairs: PrefillPairs::NONE,
            prefill_rope: false,
            row_sums: RefCell::new(None),
            comm: None,
            vocab_slice: None,
            gathered_logits: RefCell::new(None),
        };
        // Decided once: a rotary the fused kernel does not run (partial, interleaved, none) would
        // otherwise be offered to it, and declined, in every layer of every step.
        model.fused_rope = folded
            && crate::run_config::get().on(Key::FusedRope)
            && model.rope_params(Vec::new()).require_whole_half("gemv_rope").is_ok();
        model.prefill_pairs = PrefillPairs::from_config()?;
        if folded && b.prefill_fusion(dtype) && model.prefill_pairs != PrefillPairs::NONE {
            model.fused_prefill_min = Some(fused_prefill_min()?);
        }
        model.prefill_rope = model.fused_rope
            && model.arch.head_dim == PREFILL_ROPE_HEAD_DIM
            && model.weights.layers.iter().all(|l| l.qkv_bias.is_none());
        Ok(model)
    }

    /// Run as one rank of a tensor-parallel group (its weights already its shard,
    /// [`crate::tp::source`]). Every rank adds the whole bias after O and FFN2 once their
    /// partial products are summed, as one device adds it to the whole product.
    /// The embedding and the LM head are cut to the rank's rows of the vocabulary.
    /// A group of one changes nothing.
    pub fn set_comm(&mut self, comm: Arc<dyn Communicator<B> + 'b>) -> Result<()> {
        let (rank, world) = (comm.rank(), comm.world());
        if world <= 1 {
            return Ok(());
        }
        let vocab = self.arch.vocab;
        if crate::run_config::get().on(Key::TpVocab) && vocab.is_multiple_of(world) {
            // Megatron's vocabulary-parallel embedding and output layer (Shoeybi et al. 2019 §3):
            // the rank keeps rows rank·V/T .. (rank+1)·V/T of each (of the one table when
            // tied). Its LM head GEMM then reads 1/T of the head's bytes (at batch 1 the step's
            // largest single read after the layers), and the embedding holds 1/T of the table.
            let slice = vocab / world;
            let first = rank * slice;
            if let Some(head) = self.weights.lm_head.take() {
                self.weights.lm_head = Some(self.vocab_rows(&head, first, slice)?);
            }
            self.weights.embed = self.vocab_rows(&self.weights.embed, first, slice)?;
            self.vocab_slice = Some(slice);
            self.linears.set_lm_head_cols(slice);
        }
        self.comm = Some(comm);
        Ok(())
    }

    /// Rows first..first + n of a [vocab, embed_dim] table, as a new buffer (the old one is
    /// freed when the caller drops it).
    fn vocab_rows(&self, table: &B::Buffer, first: usize, n: usize) -> Result<B::Buffer> {
        let rows = (first..first + n)
            .map(i32::try_from)
            .collect::<std::result::Result<Vec<i32>, _>>()
            .map_err(|_| FdppError::InvalidArgument(format!("a vocabulary of {} rows exceeds i32", first + n)))?;
        let width = self.arch.embed_dim;
        let mut part = self.b.alloc(self.dtype, n * width)?;
        let p = GatherParams {
            rows,
            width,
            dtype: self.dtype,
        };
        self.b.gather_rows(&p, table, &mut part)?;
        Ok(part)
    }

    /// (rank, world) of a tensor-parallel model; (0, 1) on one device.
    pub fn tp_rank(&self) -> (usize, usize) {
        self.comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()))
    }

    /// Sum a row-parallel GEMM's partial output over the ranks (nothing on one device).
    fn all_reduce(&self, elems: usize, acts: &mut Activations<B::Buffer>, slot: usize) -> Result<()> {
        if let Some(c) = &self.comm {
            c.all_reduce_sum(self.b, acts.get_mut(slot), elems)?;
            self.op_times.lap(self.b, "all_reduce")?;
        }
        Ok(())
    }

    pub fn backend(&self) -> &'b B {
        self.b
    }

    /// Give each layer its own async window (empty: `scheme` for all); one per layer, each a
    /// valid window.
    pub fn set_layer_schemes(&mut self, schemes: Vec<SoftmaxScheme>) -> Result<()> {
        if !schemes.is_empty() && schemes.len() != self.arch.layers {
            return Err(FdppError::InvalidArgument(format!(
                "internal: {} per-layer softmax windows for a model of {} layers",
                schemes.len(),
                self.arch.layers
            )));
        }
        for s in &schemes {
            s.validate()?;
        }
        self.layer_schemes = schemes;
        Ok(())
    }

    /// The softmax layer `l` runs: sync when the model runs sync, else its own window when it
    /// has one, else the global `scheme`.
    pub fn scheme_for(&self, l: usize) -> SoftmaxScheme {
        match self.scheme {
            SoftmaxScheme::Sync => SoftmaxScheme::Sync,
            global => self.layer_schemes.get(l).copied().unwrap_or(global),
        }
    }

    /// Folds the windows of layers 1.. into a decode-graph signature: the graph is keyed by
    /// layer 0's launches (backend/cuda/graph.rs), and layers 1.. pass their own φ, a, b as
    /// kernel arguments, so two window sets that agree on layer 0 must not share a graph.
    fn windows_signature(&self, sig: u64) -> u64 {
        let mut h = sig;
        for l in 1..self.arch.layers {
            let bits = match self.scheme_for(l) {
                SoftmaxScheme::Sync => [u32::MAX; 3],
                SoftmaxScheme::Async { phi, a, b } => [phi.to_bits(), a.to_bits(), b.to_bits()],
            };
            for v in bits {
                // FNV-1a step per word (the signature's own hash is FNV-1a over bytes).
                h ^= u64::from(v);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
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
        let inp = StepInputs::of(kind, seqs)?;
        inp.check_plan(&acts.plan, self.arch.projects_embedding())?;
        let t = inp.tokens();
        let graphs = self.graphs_on(kind);
        let tables = self.block_tables(kv, seqs, graphs)?;
        let gemms = self.linears.step(t, inp.wanted_rows.len().max(1));
        // The fused layer adds O and FFN2 into the residual inside the GEMV. With tp that needs
        // the residual itself all-reduced (`residual_out`), as `tp_fused` (default on since
        // session 14) does; with tp_fused=0 the layers run unfused and the O/FFN2 outputs are
        // reduced before the norm's add.
        let tp_fused = self.comm.is_none() || crate::run_config::get().on(Key::TpFused);
        let fused = self.folded && tp_fused && self.fusable(&gemms, t);
        // Not in a graph-replayed step (a decode batch of hundreds): the fused prefill's
        // rotary table is rebuilt when the positions change, which a replay would not do.
        let prefill = if !fused && !graphs && self.comm.is_none() && self.prefill_fusable(t) {
            self.prefill_pairs
        } else {
            PrefillPairs::NONE
        };
        if prefill != PrefillPairs::NONE {
            self.grow_row_sums(t)?;
        }
        self.op_times.start(self.b, kind.tag())?;
        self.embed(&inp, want, acts)?;
        let attn = Attn::new(kind, self.geom, self.dtype, self.scheme, tables, inp.new_lens.clone());
        let mut la = LayerArgs {
            rope: self.rope_params(inp.positions.clone()),
            stats_params: self.stats_params(&attn),
            attn,
            gemms,
            tokens: t,
            residual: acts.plan.globals.residual,
            fused,
            prefill,
            sums: Cell::new(None),
        };
        self.run_layers(&mut la, graphs, kv, acts)?;
        self.final_norm(&la, acts)?;
        let mut attn_stats = AttnStats {
            rows: self.arch.layers * t * self.arch.heads,
            ..AttnStats::default()
        };
        let out = self.output(&la, inp.wanted_rows, want, acts)?;
        attn_stats.recomputed += out.attn.recomputed;
        Ok(StepOut {
            attn: attn_stats,
            ..out
        })
    }

    /// Decode steps replay their layers from a CUDA graph unless a diagnostic mode is on.
    fn graphs_on(&self, kind: StepKind) -> bool {
        kind == StepKind::Decode
            && self.score_stats.borrow().is_none()
            && !self.op_times.on()
            && self.b.graph_counts().is_some()
            // With tp the graph captures the collectives too (NCCL ops are capturable; the
            // capture is thread-local per rank), unless tp_graphs=0 runs them eagerly.
            && (self.comm.is_none() || crate::run_config::get().on(Key::TpGraphs))
    }

    /// The step's block tables; in a graph-replayed step the stride is rounded up (it is a
    /// kernel argument, so one graph then serves many steps).
    fn block_tables(&self, kv: &KvCache<B::Buffer>, seqs: &[StepSeq], graphs: bool) -> Result<FlatBlockTables> {
        let tables: Vec<BlockTable> = seqs.iter().map(|s| s.table.clone()).collect();
        let flat = FlatBlockTables::new(&kv.layout, &tables)?;
        if !graphs {
            return Ok(flat);
        }
        let stride = flat.max_pages.div_ceil(GRAPH_STRIDE_PAGES) * GRAPH_STRIDE_PAGES;
        Ok(flat.with_stride(stride))
    }

    fn rope_params(&self, positions: Vec<i32>) -> RopeParams {
        RopeParams {
            geom: self.geom,
            dtype: self.dtype,
            positions,
            inv_freq: self.inv_freq.clone(),
            layout: self.arch.rope_layout(),
        }
    }

    /// Statistics mode: the scores of this step as a prefill of its new tokens (a decode step
    /// is one new token per sequence over the same tables).
    fn stats_params(&self, attn: &Attn) -> Option<(PrefillParams, ScoreStatsParams)> {
        self.score_stats
            .borrow()
            .as_ref()
            .map(|st| (attn.as_prefill(), st.params))
    }

    /// Token embedding into the residual: through project_in when the embedding is narrower,
    /// plus the learned positions when the model has them.
    fn embed(&self, inp: &StepInputs, want: StepWant, acts: &mut Activations<B::Buffer>) -> Result<()> {
        let (b, a, w, dt) = (self.b, &self.arch, &self.weights, self.dtype);
        let g = acts.plan.globals;
        let rank = self.tp_rank().0;
        let ep = EmbeddingParams {
            ids: inp.ids.clone(),
            vocab: a.vocab,
            hidden: a.embed_dim,
            dtype: dt,
            held: self.vocab_slice.map(|s| (rank * s, s)),
        };
        let dst = g.embedded.unwrap_or(g.residual);
        if want == (StepWant::Queued { fed: true }) {
            b.embedding_fed(&ep, &w.embed, acts.get_mut(dst))?;
        } else {
            b.embedding(&ep, &w.embed, acts.get_mut(dst))?;
        }
        self.op_times.lap(b, "embedding")?;
        if self.vocab_slice.is_some() {
            // Each id's row came from the one rank that holds it; every other rank wrote zeros.
            self.all_reduce(inp.tokens() * a.embed_dim, acts, dst)?;
        }
        if let (Some(e), Some(proj)) = (g.embedded, &w.project_in) {
            let vendor = GemmSpec::new(GemmImpl::Gemm, dt);
            self.gemm(&vendor, inp.tokens(), a.hidden, a.embed_dim, acts, e, proj, g.residual)?;
            self.op_times.lap(b, "gemm project_in")?;
        }
        if let (Positions::Learned { offset, rows }, Some(table)) = (&a.positions, &w.positions) {
            let p = PositionParams {
                positions: inp.positions.clone(),
                offset: *offset,
                table_rows: *rows,
                hidden: a.hidden,
                dtype: dt,
            };
            b.add_positions(&p, table, acts.get_mut(g.residual))?;
            self.op_times.lap(b, "add_positions")?;
        }
        Ok(())
    }

    /// Every layer. Decode steps replay layers 1.. from a CUDA graph keyed by layer 0's
    /// launches (backend/cuda/graph.rs); other backends, prefill and the diagnostic modes run
    /// eagerly.
    fn run_layers(
        &self,
        la: &mut LayerArgs,
        graphs: bool,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<()> {
        let (b, n) = (self.b, self.weights.layers.len());
        let slots = acts.plan.layers.clone();
        let sig = if n == 0 {
            None
        } else if graphs && b.graph_begin() {
            // The recording ends whatever layer 0 returns.
            let ran = self.layer(la, 0, None, kv, acts);
            let sig = b.graph_end();
            ran?;
            sig
        } else {
            self.layer(la, 0, None, kv, acts)?;
            None
        };
        let mut rest = || (1..n).try_for_each(|l| self.layer(la, l, Some(slots[l - 1].ffn2), kv, acts));
        match sig {
            Some(sig) => b.graph_run(self.windows_signature(sig), &mut rest),
            None => rest(),
        }
    }

    /// The final norm, adding the last layer's FFN2 output to the residual (a fused step's
    /// FFN2 added it already).
    fn final_norm(&self, la: &LayerArgs, acts: &mut Activations<B::Buffer>) -> Result<()> {
        let g = acts.plan.globals;
        let prev_ffn2 = acts
            .plan
            .layers
            .last()
            .filter(|_| !la.fused && !la.prefill.attn)
            .map(|s| s.ffn2);
        self.add_norm(
            la.tokens,
            acts,
            la.residual,
            prev_ffn2,
            &self.weights.final_norm,
            g.final_normed,
        )?;
        if la.stats_params.is_some() {
            if let Some(st) = self.score_stats.borrow_mut().as_mut() {
                st.steps += 1;
            }
        }
        self.op_times.lap(self.b, self.norm_tag())
    }

    /// The wanted rows through project_out (if any) and the LM head, returned as `want` says.
    fn output(
        &self,
        la: &LayerArgs,
        wanted_rows: Vec<i32>,
        want: StepWant,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<StepOut> {
        let (b, a, dt) = (self.b, &self.arch, self.dtype);
        let g = acts.plan.globals;
        let rows = wanted_rows.len();
        // The recompute count is read after the step's own readback: reading it here would make
        // the host wait for every layer before it could queue the LM head.
        if rows == 0 {
            return Ok(StepOut {
                attn: self.recomputed()?,
                ..StepOut::default()
            });
        }
        // Every row wanted in order (a decode step): the LM head reads the normed rows as they
        // are; otherwise the last token of each sequence is gathered first.
        let mut src = g.final_normed;
        if rows != la.tokens {
            let [from, to] = acts.many([g.final_normed, g.gathered])?;
            let p = GatherParams {
                rows: wanted_rows,
                width: a.hidden,
                dtype: dt,
            };
            b.gather_rows(&p, from, to)?;
            src = g.gathered;
            self.op_times.lap(b, "gather_rows")?;
        }
        if let (Some(dst), Some(proj)) = (g.projected, &self.weights.project_out) {
            let vendor = GemmSpec::new(GemmImpl::Gemm, dt);
            self.gemm(&vendor, rows, a.embed_dim, a.hidden, acts, src, proj, dst)?;
            src = dst;
            self.op_times.lap(b, "gemm project_out")?;
        }
        let cols = self.vocab_slice.unwrap_or(a.vocab);
        let dims = GemmDims::new(rows, cols, a.embed_dim)?;
        {
            let [x, y] = acts.many([src, g.logits])?;
            gemm_or_fallback(b, &la.gemms.lm_head, dims, x, self.weights.lm_head(), y)?;
        }
        self.op_times.lap(b, "gemm lm_head")?;
        match (&self.comm, self.vocab_slice) {
            (Some(c), Some(slice)) => return self.gather_logits(c.as_ref(), rows, slice, want, acts),
            (Some(c), None) => {
                // The LM head is replicated; rank 0's logits go to every rank so that all of
                // them choose the same tokens whatever the devices' rounding.
                c.broadcast(b, acts.get_mut(g.logits), rows * a.vocab, 0)?;
                self.op_times.lap(b, "broadcast logits")?;
            }
            (None, _) => {}
        }
        self.read_out(rows, want, acts.get(g.logits))
    }

    /// Each rank's [rows, slice] logits (in the logits slot) all-gathered into
    /// [world][rows][slice], then, for more than one row, put back in [rows][world·slice] order
    /// in the logits slot; every rank then holds the same full rows and samples the same tokens.
    fn gather_logits(
        &self,
        c: &dyn Communicator<B>,
        rows: usize,
        slice: usize,
        want: StepWant,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<StepOut> {
        let (b, g, world) = (self.b, acts.plan.globals, c.world());
        let need = rows * slice * world;
        let mut cell = self.gathered_logits.borrow_mut();
        if cell.as_ref().is_none_or(|buf| buf.len() < need) {
            let elems = need.max(acts.get(g.logits).len());
            *cell = Some(b.alloc(self.dtype, elems)?);
        }
        let gathered = cell
            .as_mut()
            .ok_or_else(|| FdppError::InvalidArgument("internal: gathered logits not allocated".into()))?;
        c.all_gather(b, acts.get(g.logits), gathered, rows * slice)?;
        self.op_times.lap(b, "all_gather logits")?;
        if rows == 1 {
            return self.read_out(rows, want, gathered);
        }
        // Row i of the whole logits is slice i of every rank in rank order: gathered rows
        // r·rows + i (each `slice` wide) go to rows i·world + r.
        let order = (0..rows)
            .flat_map(|i| (0..world).map(move |r| r * rows + i))
            .map(|r| i32::try_from(r).map_err(|_| FdppError::InvalidArgument(format!("{rows} logit rows"))))
            .collect::<Result<Vec<i32>>>()?;
        let p = GatherParams {
            rows: order,
            width: slice,
            dtype: self.dtype,
        };
        b.gather_rows(&p, gathered, acts.get_mut(g.logits))?;
        self.op_times.lap(b, "gather_rows logits")?;
        drop(cell);
        self.read_out(rows, want, acts.get(g.logits))
    }

    /// The logits of `rows` rows, as `want` says: queued greedy choice, greedy tokens, or
    /// the logits themselves.
    fn read_out(&self, rows: usize, want: StepWant, logits: &B::Buffer) -> Result<StepOut> {
        let (b, vocab) = (self.b, self.arch.vocab);
        let mut out = StepOut::default();
        match want {
            StepWant::Queued { .. } => {
                // The recompute total comes back with the choice (Engine::greedy_take).
                b.greedy_enqueue(logits, rows, vocab)?;
                self.op_times.lap(b, "argmax")?;
                return Ok(out);
            }
            StepWant::Greedy => {
                out.tokens = b.argmax_rows(logits, rows, vocab)?;
                out.attn = self.recomputed()?;
                self.op_times.lap(b, "argmax")?;
            }
            StepWant::Logits => {
                let bits = b.download(logits)?;
                out.attn = self.recomputed()?;
                self.op_times.lap(b, "logits download")?;
                out.logits = bits
                    .chunks_exact(vocab)
                    .take(rows)
                    .map(|r| {
                        let mut row = vec![0f32; vocab];
                        self.dtype.widen(r, &mut row);
                        row
                    })
                    .collect();
            }
        }
        Ok(out)
    }

    fn recomputed(&self) -> Result<AttnStats> {
        Ok(AttnStats {
            recomputed: self.b.take_recomputed()?,
            ..AttnStats::default()
        })
    }

    /// One layer's launches (see the module comment for the order). `prev_ffn2`: the slot of
    /// the previous layer's FFN2 output, added to the residual by this layer's first norm (not
    /// read in a fused step, whose FFN2 added it already).
    fn layer(
        &self,
        a: &mut LayerArgs,
        l: usize,
        prev_ffn2: Option<usize>,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<()> {
        // The step's attention params serve every layer; only the softmax window is per layer.
        a.attn.set_scheme(self.scheme_for(l));
        let roped = self.attn_in(a, l, prev_ffn2, kv, acts)?;
        self.attend(a, l, roped, kv, acts)?;
        self.attn_out(a, l, acts)?;
        self.mlp_in(a, l, acts)?;
        self.mlp_act(a, l, acts)?;
        self.mlp_out(a, l, acts)
    }

    /// Norm (with the previous layer's residual add) and the QKV GEMM; fused: one GEMV that
    /// normalizes its input, and in a decode step also rotates q and k and appends k and v to
    /// the cache where the backend can (`fused_rope`; returns true when it did: the layer's
    /// rotary is then done).
    fn attn_in(
        &self,
        a: &LayerArgs,
        l: usize,
        prev_ffn2: Option<usize>,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<bool> {
        let (w, s, h, t) = (&self.weights.layers[l], acts.plan.layers[l], self.arch.hidden, a.tokens);
        let n = self.arch.qkv_width();
        if a.prefill.attn {
            return self.prefill_attn_in(a, l, kv, acts);
        }
        if let (true, true, Attn::Decode(ap, _)) = (a.fused, self.fused_rope, &a.attn) {
            let dims = GemmDims::new(t, n, h)?;
            let [r, q] = acts.many([a.residual, s.q])?;
            let eps = self.arch.eps as f32;
            let bias = w.qkv_bias.as_ref();
            let cache = &mut kv.layers[l];
            match self
                .b
                .gemm_rms_rope_append(&a.gemms.qkv, dims, eps, r, &w.qkv, &a.rope, ap, bias, q, cache)
            {
                Ok(()) => {
                    self.op_times.lap(self.b, "gemm qkv + rope")?;
                    return Ok(true);
                }
                // A backend or a shape without the kernel: the two ops.
                Err(FdppError::Unsupported { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if a.fused {
            self.gemm_rms_in(&a.gemms.qkv, t, n, h, acts, a.residual, &w.qkv, s.qkv)?;
        } else {
            self.add_norm(t, acts, a.residual, prev_ffn2, &w.attn_norm, s.normed_attn)?;
            self.op_times.lap(self.b, self.norm_tag())?;
            self.gemm(&a.gemms.qkv, t, n, h, acts, s.normed_attn, &w.qkv, s.qkv)?;
        }
        self.op_times.lap(self.b, "gemm qkv")?;
        Ok(false)
    }

    /// QKV split with bias and rotary, the KV append of a decode step (unless `roped`: the QKV
    /// GEMV did both), attention, and the softmax statistics when they are gathered.
    fn attend(
        &self,
        a: &LayerArgs,
        l: usize,
        roped: bool,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<()> {
        let (b, w, s) = (self.b, &self.weights.layers[l], acts.plan.layers[l]);
        let cache = &mut kv.layers[l];
        if !roped {
            let [qkv, q, k, v] = acts.many([s.qkv, s.q, s.k, s.v])?;
            // The new tokens' k and v go to the cache in the same kernel as the rotation (one
            // launch and one pass over them fewer per layer on a GPU); attention reads them there.
            let (Attn::Prefill(ap, _) | Attn::Decode(ap, _)) = &a.attn;
            b.qkv_rope_append(&a.rope, ap, qkv, w.qkv_bias.as_ref(), q, k, v, cache)?;
            self.op_times.lap(b, "qkv_rope")?;
        }
        // The enqueue entry points: a GPU backend counts recomputed rows on the device and
        // the step reads the count once, after its last layer, instead of waiting for the
        // device in every layer.
        match &a.attn {
            Attn::Prefill(_, p) => {
                let [q, out] = acts.many([s.q, s.attn])?;
                b.attention_prefill_cached_enqueue(p, q, cache, out)?
            }
            Attn::Decode(_, p) => {
                let [q, out] = acts.many([s.q, s.attn])?;
                b.set_decode_tensor_cores(self.decode_tc_up_to);
                b.attention_decode_enqueue(p, q, cache, out)?
            }
        };
        self.op_times.lap(b, "attention")?;
        if let Some((sp, params)) = &a.stats_params {
            let hists = b.attention_score_hist(sp, params, acts.get(s.q), cache)?;
            if let Some(st) = self.score_stats.borrow_mut().as_mut() {
                st.add(l, &hists)?;
            }
            self.op_times.lap(b, "score_hist")?;
        }
        Ok(())
    }

    /// The O GEMM and its bias; fused: added to the residual in the GEMV's epilogue.
    fn attn_out(&self, a: &LayerArgs, l: usize, acts: &mut Activations<B::Buffer>) -> Result<()> {
        let (w, s, t) = (&self.weights.layers[l], acts.plan.layers[l], a.tokens);
        let (h, qd) = (self.arch.hidden, self.arch.q_width());
        if a.prefill.mlp {
            self.prefill_residual_out(a, t, h, qd, acts, s.attn, &w.o)?;
        } else if a.fused {
            self.residual_out(&a.gemms.o, t, h, qd, acts, s.attn, &w.o, a.residual)?;
        } else {
            self.row_gemm(&a.gemms.o, t, h, qd, acts, s.attn, &w.o, s.o)?;
            self.bias_act(t, h, Activation::None, acts, s.o, w.o_bias.as_ref())?;
        }
        self.op_times.lap(self.b, "gemm o")
    }

    /// Norm (with the attention output's residual add) and the FFN1 GEMM; fused: one GEMV that
    /// normalizes its input, and writes the GLU itself when `fused_glu`.
    fn mlp_in(&self, a: &LayerArgs, l: usize, acts: &mut Activations<B::Buffer>) -> Result<()> {
        let (b, w, s, t) = (self.b, &self.weights.layers[l], acts.plan.layers[l], a.tokens);
        let (h, n) = (self.arch.hidden, self.arch.ffn1_width());
        if a.prefill.mlp {
            let sums = self.sums_of(a)?;
            let mut cell = self.row_sums.borrow_mut();
            let ss = row_sums_buf(&mut cell)?;
            let eps = self.arch.eps as f32;
            if self.fused_glu {
                let dims = GemmDims::new(t, self.arch.inter, h)?;
                let [r, y] = acts.many([a.residual, s.act])?;
                b.prefill_rms_glu(dims, sums, eps, ss, r, &w.ffn1, y)?;
            } else {
                let dims = GemmDims::new(t, n, h)?;
                let [r, y] = acts.many([a.residual, s.ffn1])?;
                b.prefill_rms_in(dims, sums, eps, ss, r, &w.ffn1, y)?;
            }
        } else if a.fused && self.fused_glu {
            // FFN1 and the GLU in one launch: the gate/up output never leaves the GEMV.
            let dims = GemmDims::new(t, self.arch.inter, h)?;
            let [r, out] = acts.many([a.residual, s.act])?;
            b.gemm_rms_glu(&a.gemms.ffn1, dims, self.arch.eps as f32, r, &w.ffn1, out)?;
        } else if a.fused {
            self.gemm_rms_in(&a.gemms.ffn1, t, n, h, acts, a.residual, &w.ffn1, s.ffn1)?;
        } else {
            self.add_norm(t, acts, a.residual, Some(s.o), &w.ffn_norm, s.normed_ffn)?;
            self.op_times.lap(b, self.norm_tag())?;
            self.gemm(&a.gemms.ffn1, t, n, h, acts, s.normed_ffn, &w.ffn1, s.ffn1)?;
        }
        self.op_times.lap(b, "gemm ffn1")
    }

    /// FFN1's bias and the activation: act(gate)·up into `act` (gated), or act(x + bias) in
    /// place (plain: the `act` slot is FFN1's own).
    fn mlp_act(&self, a: &LayerArgs, l: usize, acts: &mut Activations<B::Buffer>) -> Result<()> {
        let (b, w, s, t) = (self.b, &self.weights.layers[l], acts.plan.layers[l], a.tokens);
        let (inter, dt) = (self.arch.inter, self.dtype);
        match self.arch.mlp {
            Mlp::Gated(_) if (a.fused || a.prefill.mlp) && self.fused_glu => Ok(()),
            Mlp::Gated(act) => {
                self.bias_act(t, 2 * inter, Activation::None, acts, s.ffn1, w.ffn1_bias.as_ref())?;
                let [gate_up, out] = acts.many([s.ffn1, s.act])?;
                let p = GluParams {
                    rows: t,
                    inter,
                    act,
                    dtype: dt,
                };
                b.glu(&p, gate_up, out)?;
                self.op_times
                    .lap(b, if act == Activation::Silu { "silu_mul" } else { "glu" })
            }
            Mlp::Plain(act) => {
                self.bias_act(t, inter, act, acts, s.ffn1, w.ffn1_bias.as_ref())?;
                self.op_times.lap(b, "bias_act")
            }
        }
    }

    /// The FFN2 GEMM and its bias; fused: added to the residual in the GEMV's epilogue.
    fn mlp_out(&self, a: &LayerArgs, l: usize, acts: &mut Activations<B::Buffer>) -> Result<()> {
        let (w, s, t) = (&self.weights.layers[l], acts.plan.layers[l], a.tokens);
        let (h, inter) = (self.arch.hidden, self.arch.inter);
        if a.prefill.attn {
            self.prefill_residual_out(a, t, h, inter, acts, s.act, &w.ffn2)?;
        } else if a.fused {
            self.residual_out(&a.gemms.ffn2, t, h, inter, acts, s.act, &w.ffn2, a.residual)?;
        } else {
            self.row_gemm(&a.gemms.ffn2, t, h, inter, acts, s.act, &w.ffn2, s.ffn2)?;
            self.bias_act(t, h, Activation::None, acts, s.ffn2, w.ffn2_bias.as_ref())?;
        }
        self.op_times.lap(self.b, "gemm ffn2")
    }

    /// The op-times label of a norm launch (the op's name, as reports before the general
    /// executor named it).
    fn norm_tag(&self) -> &'static str {
        match self.arch.norm {
            NormKind::Rms => "add_rmsnorm",
            NormKind::Layer => "add_layernorm",
        }
    }

    /// x = act(x + bias) in place; nothing to do without a bias and an activation.
    fn bias_act(
        &self,
        rows: usize,
        width: usize,
        act: Activation,
        acts: &mut Activations<B::Buffer>,
        x: usize,
        bias: Option<&B::Buffer>,
    ) -> Result<()> {
        if bias.is_none() && act == Activation::None {
            return Ok(());
        }
        let p = BiasActParams {
            rows,
            width,
            act,
            dtype: self.dtype,
        };
        self.b.bias_act(&p, acts.get_mut(x), bias)
    }

    /// Whether a step of `t` tokens with these GEMMs runs the fused layer: all four on gemv,
    /// at most the fused kernels' M, every K a whole number of 16-byte chunks.
    fn fusable(&self, gemms: &StepGemms, t: usize) -> bool {
        let a = &self.arch;
        let ks = [a.hidden, a.q_width(), a.inter];
        t <= FUSED_MAX_M
            && [&gemms.qkv, &gemms.o, &gemms.ffn1, &gemms.ffn2]
                .iter()
                .all(|s| s.imp == GemmImpl::Gemv)
            && ks.iter().all(|k| k.is_multiple_of(8))
    }

    /// Whether a step of `t` tokens runs the fused prefill layer: on for this model, at least
    /// `fused_prefill_min` tokens, and every K and N a whole number of 16-byte rows.
    fn prefill_fusable(&self, t: usize) -> bool {
        let a = &self.arch;
        self.fused_prefill_min.is_some_and(|min| t >= min)
            && [a.hidden, a.q_width(), a.inter, a.qkv_width(), a.ffn1_width()]
                .iter()
                .all(|k| k.is_multiple_of(8))
    }

    /// The row-sum scratch, grown to hold a step of `t` tokens.
    fn grow_row_sums(&self, t: usize) -> Result<()> {
        let need = self.b.row_sums_len(t, self.arch.hidden);
        let mut cell = self.row_sums.borrow_mut();
        if cell.as_ref().is_none_or(|buf| buf.len() < need) {
            *cell = None; // the old buffer goes before the new one is allocated
            *cell = Some(self.b.alloc(self.dtype, need)?);
        }
        Ok(())
    }

    /// The row sums the last fused op of this step left (the next norm's statistics).
    fn sums_of(&self, a: &LayerArgs) -> Result<RowSums> {
        a.sums.get().ok_or_else(|| {
            FdppError::InvalidArgument("internal: a fused prefill norm before any op summed its rows".into())
        })
    }

    /// A fused prefill layer's QKV: the norm's statistics (layer 0: from the residual itself),
    /// then QKV scaled by 1/rms, with the rotary and the KV write where `prefill_rope` (returns
    /// true: the rotary is done).
    fn prefill_attn_in(
        &self,
        a: &LayerArgs,
        l: usize,
        kv: &mut KvCache<B::Buffer>,
        acts: &mut Activations<B::Buffer>,
    ) -> Result<bool> {
        let (b, w, s, t) = (self.b, &self.weights.layers[l], acts.plan.layers[l], a.tokens);
        let (h, n, eps) = (self.arch.hidden, self.arch.qkv_width(), self.arch.eps as f32);
        let mut cell = self.row_sums.borrow_mut();
        let ss = row_sums_buf(&mut cell)?;
        let sums = match a.sums.get() {
            Some(sums) => sums,
            None => {
                let sums = b.prefill_row_sumsq(t, h, acts.get(a.residual), ss)?;
                self.op_times.lap(b, "row_sumsq")?;
                sums
            }
        };
        let dims = GemmDims::new(t, n, h)?;
        if self.prefill_rope {
            let (Attn::Prefill(ap, _) | Attn::Decode(ap, _)) = &a.attn;
            let [r, q] = acts.many([a.residual, s.q])?;
            b.prefill_rms_rope_append(dims, sums, eps, ss, r, &w.qkv, &a.rope, ap, q, &mut kv.layers[l])?;
            self.op_times.lap(b, "gemm qkv + rope")?;
            return Ok(true);
        }
        let [r, y] = acts.many([a.residual, s.qkv])?;
        b.prefill_rms_in(dims, sums, eps, ss, r, &w.qkv, y)?;
        self.op_times.lap(b, "gemm qkv")?;
        Ok(false)
    }

    /// residual += x · Wᵀ of a fused prefill layer (O, FFN2), its row sums kept for the next norm.
    #[allow(clippy::too_many_arguments)]
    fn prefill_residual_out(
        &self,
        a: &LayerArgs,
        m: usize,
        n: usize,
        k: usize,
        acts: &mut Activations<B::Buffer>,
        x: usize,
        w: &B::Buffer,
    ) -> Result<()> {
        let dims = GemmDims::new(m, n, k)?;
        let mut cell = self.row_sums.borrow_mut();
        let ss = row_sums_buf(&mut cell)?;
        let [x, r] = acts.many([x, a.residual])?;
        a.sums.set(Some(self.b.prefill_residual_out(dims, x, w, r, ss)?));
        Ok(())
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
        self.b.gemm_rms_in(spec, dims, self.arch.eps as f32, r, w, y)
    }

    /// residual += x · Wᵀ over the whole group (a fused step). With tp, rank 0 adds its partial
    /// product into the residual and the other ranks overwrite theirs with their partials, so
    /// the sum over ranks of that buffer is residual + Σ partials: one all-reduce of the
    /// residual, and the next fused GEMV reads it as it is.
    #[allow(clippy::too_many_arguments)]
    fn residual_out(
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
        match &self.comm {
            None => self.gemm_residual_out(spec, m, n, k, acts, x, w, residual),
            Some(c) => {
                if c.rank() == 0 {
                    self.gemm_residual_out(spec, m, n, k, acts, x, w, residual)?;
                } else {
                    self.gemm(spec, m, n, k, acts, x, w, residual)?;
                }
                self.all_reduce(m * n, acts, residual)
            }
        }
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

    /// residual += delta (when given); out = norm(residual) as the architecture's norm kind.
    fn add_norm(
        &self,
        rows: usize,
        acts: &mut Activations<B::Buffer>,
        residual: usize,
        delta: Option<usize>,
        norm: &Norm<B::Buffer>,
        out: usize,
    ) -> Result<()> {
        let (b, a) = (self.b, &self.arch);
        let rms = RmsNormParams {
            rows,
            hidden: a.hidden,
            eps: a.eps as f32,
            dtype: self.dtype,
        };
        let ln = LayerNormParams {
            rows,
            hidden: a.hidden,
            eps: a.eps as f32,
            dtype: self.dtype,
        };
        let run = |r: &mut B::Buffer, d: Option<&B::Buffer>, o: &mut B::Buffer| match (a.norm, &norm.bias) {
            (NormKind::Rms, _) => b.add_rmsnorm(&rms, r, d, &norm.weight, o),
            (NormKind::Layer, Some(bias)) => b.add_layernorm(&ln, r, d, &norm.weight, bias, o),
            (NormKind::Layer, None) => Err(FdppError::InvalidArgument(
                "internal: a LayerNorm without its bias weight".into(),
            )),
        };
        match delta {
            Some(d) => {
                let [r, d, o] = acts.many([residual, d, out])?;
                run(r, Some(d), o)
            }
            None => {
                let [r, o] = acts.many([residual, out])?;
                run(r, None, o)
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
        gemm_or_fallback(self.b, spec, dims, x, w, y)
    }

    /// y = x · Wᵀ of a row-parallel linear (O, FFN2): with tp, each rank's partial product
    /// summed over the group ([`Communicator::row_parallel_gemm`]).
    #[allow(clippy::too_many_arguments)]
    fn row_gemm(
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
        let Some(c) = &self.comm else {
            return self.gemm(spec, m, n, k, acts, x, w, y);
        };
        let dims = GemmDims::new(m, n, k)?;
        let [x, y] = acts.many([x, y])?;
        c.row_parallel_gemm(self.b, spec, dims, x, w, y)?;
        self.op_times.lap(self.b, "gemm + all_reduce")
    }
}

/// What every layer of one step shares.
struct LayerArgs {
    rope: RopeParams,
    attn: Attn,
    gemms: StepGemms,
    tokens: usize,
    residual: usize,
    stats_params: Option<(PrefillParams, ScoreStatsParams)>,
    /// Run the fused layer (see the module comment).
    fused: bool,
    /// The norms this step's fused prefill layer takes (see the module comment).
    prefill: PrefillPairs,
    /// The row sums the last fused prefill op left for the next norm (None before layer 0's).
    sums: Cell<Option<RowSums>>,
}

/// The most rows the fused gemv kernels take (backend/cuda/gemv_fused.rs).
const FUSED_MAX_M: usize = 8;

/// The head_dim the fused prefill's rotary epilogue rotates (backend/cuda/gemm_epi.rs).
const PREFILL_ROPE_HEAD_DIM: usize = 128;

/// Tokens from which a step runs the fused prefill layer, unless `fused_prefill_min` says.
/// Session 33 on the H200 (reports/NOTES.md, Llama2-7B): at 512 tokens the fused layer's TTFT was
/// 11.4 ms against 10.9 unfused (the wgmma GEMM's 128-row tiles fill few SMs), at 1024 20.1-20.2
/// against 20.5-20.7.
const FUSED_PREFILL_MIN: usize = 1024;

/// The two norms of a layer the fused prefill can take into GEMMs, each with the GEMM before it
/// (which adds into the residual and leaves its row sums) and the one after (which scales by
/// 1/rms): `attn`, the previous layer's FFN2 with this layer's QKV (and its rotary and KV
/// write); `mlp`, O with FFN1 (and the GLU).
///
/// Default `attn` alone: on the H200 (reports/NOTES.md, session 33, Llama2-7B at 1024 tokens, a
/// layer's share of the timeline) the attention pair took 120.8 + 152.5 µs (FFN2, QKV) where
/// cuBLAS + add_rmsnorm + cuBLAS + qkv_rope took 120.4 + 9.5 + 138.0 + 16.1; the MLP pair took
/// 49.6 + 279.1 (O, the SwiGLU FFN1) against 46.0 + 9.5 + 239.9 + 19.7 (cuBLAS, add_rmsnorm,
/// cuBLAS's 192x128, silu_mul): the fused FFN1 runs at 0.86× cuBLAS's rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PrefillPairs {
    attn: bool,
    mlp: bool,
}

impl PrefillPairs {
    const NONE: PrefillPairs = PrefillPairs {
        attn: false,
        mlp: false,
    };

    /// `fused_prefill`: all (default, also 1), attn, mlp, or 0 / off / false.
    fn from_config() -> Result<Self> {
        let v = crate::run_config::get().get(Key::FusedPrefill).unwrap_or("all");
        let (attn, mlp) = match v.trim() {
            "all" | "1" | "on" | "true" => (true, true),
            "attn" => (true, false),
            "mlp" => (false, true),
            "0" | "off" | "false" => (false, false),
            other => {
                return Err(FdppError::InvalidArgument(format!(
                    "fused_prefill = {other:?}: expected all, attn, mlp or 0 (--set fused_prefill=all)"
                )))
            }
        };
        Ok(PrefillPairs { attn, mlp })
    }
}

/// The `fused_prefill_min` switch: a token count of at least 1.
fn fused_prefill_min() -> Result<usize> {
    match crate::run_config::get().get(Key::FusedPrefillMin) {
        None => Ok(FUSED_PREFILL_MIN),
        Some(v) => v.trim().parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| {
            FdppError::InvalidArgument(format!(
                "fused_prefill_min = {v:?}: expected a number of tokens, at least 1 (--set fused_prefill_min=1024)"
            ))
        }),
    }
}

/// The row-sum scratch of a fused prefill step (allocated by `grow_row_sums` before the layers).
fn row_sums_buf<Buf>(cell: &mut Option<Buf>) -> Result<&mut Buf> {
    cell.as_mut()
        .ok_or_else(|| FdppError::InvalidArgument("internal: the fused prefill's row sums were not allocated".into()))
}

/// Folds each layer's two norm weights into the GEMM that reads the norm (W_qkv by attn_norm,
/// W_ffn1 by ffn_norm: W' = W·diag(γ)) and sets those norm weights to ones, so the unfused path
/// (the norm, then the GEMM) computes rmsnorm(x)·γ·Wᵀ as before and the fused one can skip
/// the norm. The final norm is left as it is (the LM head may be the tied embedding). Only for
/// an RMSNorm without bias ([`Arch::fusable`]).
fn fold_norms<B: Backend>(b: &B, a: &Arch, dt: DType, w: &mut ModelWeights<B::Buffer>) -> Result<()> {
    let h = a.hidden;
    let ones = vec![dt.from_f32(1.0); h];
    for l in w.layers.iter_mut() {
        b.scale_cols(&mut l.qkv, &l.attn_norm.weight, a.qkv_width(), h)?;
        b.scale_cols(&mut l.ffn1, &l.ffn_norm.weight, a.ffn1_width(), h)?;
        l.attn_norm.weight = b.upload(dt, &ones)?;
        l.ffn_norm.weight = b.upload(dt, &ones)?;
    }
    Ok(())
}
