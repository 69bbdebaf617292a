//! The compute backends. Every op a backend offers takes named dimensions; the CPU backend is
//! the reference the GPU backends are checked against and the default where no GPU is present.

pub mod attn_plan;
pub mod cpu;
pub mod cuda;
pub mod kernel_cache;
pub mod layer_plan;
pub mod rocm;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::attention::{AttnStats, DecodeParams, PrefillParams};
use crate::ops::gemm::{GemmDims, GemmSpec};
use crate::ops::layer::{
    Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeParams, SiluMulParams,
};

/// How the decode steps' layers after the first ran on a backend with graphs (cuda/graph.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphCounts {
    /// Replays of a captured graph.
    pub replayed: usize,
    /// Captures (each also launched).
    pub captured: usize,
    /// Eager runs: a signature's first sighting, or one whose capture failed.
    pub eager: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Cpu,
    Cuda,
    Rocm,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Rocm => "rocm",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `--backend`: a named backend, or `auto` (a GPU backend when one is present, else the CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BackendChoice {
    #[default]
    Auto,
    Cpu,
    Cuda,
    Rocm,
}

/// What a profile records about the machine it was made on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub backend: BackendKind,
    pub ordinal: usize,
    /// As the driver reports it, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Normalized name used in paths, e.g. "nvidia-h100-80gb-hbm3".
    pub slug: String,
    /// "sm_90", "gfx90a", or the CPU's target features summary.
    pub arch: String,
    /// SMs, CUs or CPU threads.
    pub compute_units: u32,
    pub memory_bytes: u64,
    pub l2_bytes: u64,
    pub driver_version: Option<String>,
    pub runtime_version: Option<String>,
}

/// The kernel hash a backend of `kind` built from this binary reports (no device needed): what
/// a profile's `kernel_hash` is compared with.
pub fn kernel_hash_of(kind: BackendKind) -> String {
    match kind {
        BackendKind::Cpu => cpu::kernel_source_hash(),
        BackendKind::Cuda => cuda::sources::kernel_hash(),
        BackendKind::Rocm => rocm::sources::kernel_hash(),
    }
}

/// The hash of fdpp's Hopper GEMM where this binary runs it (CUDA on sm_90a), else None: what a
/// profile's `hopper_gemm_hash` is compared with.
pub fn hopper_gemm_hash_of(info: &DeviceInfo) -> Option<String> {
    (info.backend == BackendKind::Cuda && info.arch == cuda::prefill_hopper::ARCH).then(cuda::sources::hopper_gemm_hash)
}

/// Lowercase, alphanumerics kept, every other run of characters becomes one '-'.
pub fn slugify(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    while out.ends_with('-') {
        out.pop();
    }
    out
}

/// A device buffer of 16-bit elements.
/// Row sums of squares a fused prefill op left in the backend's row-sum scratch: `parts`
/// partial sums for each of `rows` rows of a `cols`-wide residual, read by the next fused GEMM
/// (whose K must be `cols`) for its 1/rms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSums {
    pub rows: usize,
    pub cols: usize,
    pub parts: usize,
}

pub trait DeviceBuffer {
    fn len(&self) -> usize;
    fn dtype(&self) -> DType;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub trait Backend {
    type Buffer: DeviceBuffer;

    fn info(&self) -> &DeviceInfo;

    /// A hash of the kernel sources this backend compiles (profiles made with other kernels are
    /// refused). The CPU backend hashes its own version string.
    fn kernel_hash(&self) -> String;

    /// Whether decode attention with one query head per kv head (MHA) at `head_dim` has a second
    /// main pass here, the tensor-core one, for [`Backend::set_decode_tensor_cores`] to choose
    /// (the tune times both: `tune::decode_pass`).
    fn decode_pass_choice(&self, _head_dim: usize) -> bool {
        false
    }

    /// One-head-per-block decode launches of up to `up_to_batch` sequences run the tensor-core
    /// pass (None: the built-in rule, the CUDA-core pass); from a profile's `decode_pass`
    /// section. The run-configuration switch `decode_tc`, when set, wins over it.
    fn set_decode_tensor_cores(&self, _up_to_batch: Option<usize>) {}

    /// Uninitialised (or poisoned) buffer of `len` elements.
    fn alloc(&self, dtype: DType, len: usize) -> Result<Self::Buffer>;
    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<Self::Buffer>;
    fn download(&self, buf: &Self::Buffer) -> Result<Vec<u16>>;
    /// Set every element to `bits` (used to poison outputs before a run).
    fn fill(&self, buf: &mut Self::Buffer, bits: u16) -> Result<()>;

    /// The GEMM candidates this backend offers for a [K, N] shape (every B_N for flat_gemm).
    fn gemm_candidates(&self, dtype: DType, n: usize, k: usize) -> Vec<GemmSpec>;

    /// y = x · Wᵀ. A candidate that cannot run these dims returns `Unsupported` (it is skipped,
    /// never a crash).
    fn gemm(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &Self::Buffer,
        w: &Self::Buffer,
        y: &mut Self::Buffer,
    ) -> Result<()>;

    /// Put a linear's W ([N, K] row-major, as uploaded) into whatever layout this backend's
    /// GEMMs read fastest, once at load (issue #21 item 5). Afterwards the buffer is for
    /// [`gemm`](Self::gemm) at this [N, K] (and `download`, which gives the row-major values
    /// back); the engine calls it for the layer linears only (the LM head may be the tied
    /// embedding table, which the embedding op reads by rows). Default: nothing to do.
    fn prepare_linear_weight(&self, _w: &mut Self::Buffer, _n: usize, _k: usize) -> Result<()> {
        Ok(())
    }

    /// Whether [`gemm_rms_in`](Self::gemm_rms_in) and
    /// [`gemm_residual_out`](Self::gemm_residual_out) have kernels here (for the gemv
    /// implementation at small M; other cases still return `Unsupported`, and the caller then
    /// takes add_rmsnorm and a plain gemm).
    fn fused_gemv_ops(&self) -> bool {
        false
    }

    /// y = rmsnorm(residual) · Wᵀ over `dims.m` rows of `residual` [M, K] (eps as in
    /// [`add_rmsnorm`](Self::add_rmsnorm), hidden = K), with the norm's γ already folded into W
    /// by [`scale_cols`](Self::scale_cols): the product runs on the raw residual and each output
    /// is scaled by 1/rms of its row. The residual is only read. FlashDecoding++-style fusion:
    /// the norm runs inside the GEMV that consumes it.
    fn gemm_rms_in(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        eps: f32,
        residual: &Self::Buffer,
        w: &Self::Buffer,
        y: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (spec, dims, eps, residual, w, y);
        Err(op_unsupported(self.info(), "gemm_rms_in"))
    }

    /// y [M, N] = silu(g) · u with [g | u] = rmsnorm(residual) · Wᵀ, W [2N, K] the gate rows
    /// then the up rows with the norm's γ folded in (`dims.n` = N, the output width): what
    /// [`gemm_rms_in`](Self::gemm_rms_in) into [M, 2N] followed by
    /// [`silu_mul`](Self::silu_mul) computes, in one launch.
    fn gemm_rms_glu(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        eps: f32,
        residual: &Self::Buffer,
        w: &Self::Buffer,
        y: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (spec, dims, eps, residual, w, y);
        Err(op_unsupported(self.info(), "gemm_rms_glu"))
    }

    /// A decode step's QKV in one launch: [`gemm_rms_in`](Self::gemm_rms_in) into qkv [M, N]
    /// (N = the rotary's qkv width) followed by [`qkv_rope_append`](Self::qkv_rope_append):
    /// q [M, H·D] rotated, the new tokens' rotated k and their v written into the cache. For the
    /// whole-head rotate-half rotary at small M; `Unsupported` elsewhere (the caller then takes
    /// the two ops).
    #[allow(clippy::too_many_arguments)]
    fn gemm_rms_rope_append(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        eps: f32,
        residual: &Self::Buffer,
        w: &Self::Buffer,
        rope: &RopeParams,
        append: &KvAppendParams,
        bias: Option<&Self::Buffer>,
        q: &mut Self::Buffer,
        kv: &mut PagedKv<Self::Buffer>,
    ) -> Result<()> {
        let _ = (spec, dims, eps, residual, w, rope, append, bias, q, kv);
        Err(op_unsupported(self.info(), "gemm_rms_rope_append"))
    }

    /// w[n, k] = round(w[n, k] · scale[k]) in place, for w [rows, cols] and scale [cols]: folds
    /// an RMSNorm's γ into the weights of the GEMM that consumes the norm (for
    /// [`gemm_rms_in`](Self::gemm_rms_in)).
    fn scale_cols(&self, w: &mut Self::Buffer, scale: &Self::Buffer, rows: usize, cols: usize) -> Result<()> {
        let _ = (w, scale, rows, cols);
        Err(op_unsupported(self.info(), "scale_cols"))
    }

    /// residual[m, n] = round(residual[m, n] + round((x · Wᵀ)[m, n])) in place: bit for bit
    /// [`gemm`](Self::gemm) into a temporary followed by add_rmsnorm's residual add.
    fn gemm_residual_out(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &Self::Buffer,
        w: &Self::Buffer,
        residual: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (spec, dims, x, w, residual);
        Err(op_unsupported(self.info(), "gemm_residual_out"))
    }

    /// Whether this backend runs the prefill's fused layer in `dt` (the `prefill_*` ops below):
    /// GEMMs that take the layer's small ops as epilogues (fdpp's wgmma GEMM on sm_90a).
    fn prefill_fusion(&self, dt: DType) -> bool {
        let _ = dt;
        false
    }

    /// 16-bit elements of the scratch the `prefill_*` ops keep row sums of squares in, for `rows`
    /// rows of a `cols`-wide residual (the buffer's contents are this backend's own format).
    fn row_sums_len(&self, rows: usize, cols: usize) -> usize {
        let _ = (rows, cols);
        0
    }

    /// ss ← Σ x² of each of `rows` rows of x [rows, cols]: the norm statistics of a residual no
    /// fused GEMM has written (a prefill's first layer).
    fn prefill_row_sumsq(&self, rows: usize, cols: usize, x: &Self::Buffer, ss: &mut Self::Buffer) -> Result<RowSums> {
        let _ = (rows, cols, x, ss);
        Err(op_unsupported(self.info(), "prefill_row_sumsq"))
    }

    /// [`gemm_residual_out`](Self::gemm_residual_out) at prefill sizes, which also leaves the
    /// new residual's row sums of squares in ss for the next norm.
    fn prefill_residual_out(
        &self,
        dims: GemmDims,
        x: &Self::Buffer,
        w: &Self::Buffer,
        residual: &mut Self::Buffer,
        ss: &mut Self::Buffer,
    ) -> Result<RowSums> {
        let _ = (dims, x, w, residual, ss);
        Err(op_unsupported(self.info(), "prefill_residual_out"))
    }

    /// [`gemm_rms_in`](Self::gemm_rms_in) at prefill sizes, its 1/rms from the row sums `sums`
    /// in ss (of `residual`, which is x).
    #[allow(clippy::too_many_arguments)]
    fn prefill_rms_in(
        &self,
        dims: GemmDims,
        sums: RowSums,
        eps: f32,
        ss: &Self::Buffer,
        residual: &Self::Buffer,
        w: &Self::Buffer,
        y: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (dims, sums, eps, ss, residual, w, y);
        Err(op_unsupported(self.info(), "prefill_rms_in"))
    }

    /// [`gemm_rms_glu`](Self::gemm_rms_glu) at prefill sizes, its 1/rms from `sums` in ss.
    #[allow(clippy::too_many_arguments)]
    fn prefill_rms_glu(
        &self,
        dims: GemmDims,
        sums: RowSums,
        eps: f32,
        ss: &Self::Buffer,
        residual: &Self::Buffer,
        w: &Self::Buffer,
        y: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (dims, sums, eps, ss, residual, w, y);
        Err(op_unsupported(self.info(), "prefill_rms_glu"))
    }

    /// [`prefill_rms_in`](Self::prefill_rms_in) into qkv followed by
    /// [`qkv_rope_append`](Self::qkv_rope_append) (no bias), in one launch where the backend
    /// can; `Unsupported` otherwise (the caller then runs the two ops).
    #[allow(clippy::too_many_arguments)]
    fn prefill_rms_rope_append(
        &self,
        dims: GemmDims,
        sums: RowSums,
        eps: f32,
        ss: &Self::Buffer,
        residual: &Self::Buffer,
        w: &Self::Buffer,
        rope: &RopeParams,
        append: &KvAppendParams,
        q: &mut Self::Buffer,
        kv: &mut PagedKv<Self::Buffer>,
    ) -> Result<()> {
        let _ = (dims, sums, eps, ss, residual, w, rope, append, q, kv);
        Err(op_unsupported(self.info(), "prefill_rms_rope_append"))
    }

    /// One decode step of attention over the paged cache (split-KV, `p.scheme`): q and out
    /// `[batch][num_heads][head_dim]`. See [`crate::ops::attention`] for the layouts.
    ///
    /// The block tables and lengths travel in `p` as host i32 arrays: they are a few hundred
    /// bytes per step, so a GPU backend uploads them with the launch (or into a persistent
    /// device buffer it owns) instead of every caller managing an integer device buffer.
    /// Backends without attention kernels keep this default, which declines (`Unsupported`).
    fn attention_decode(
        &self,
        p: &DecodeParams,
        q: &Self::Buffer,
        kv: &PagedKv<Self::Buffer>,
        out: &mut Self::Buffer,
    ) -> Result<AttnStats> {
        let _ = (p, q, kv, out);
        Err(attention_unsupported(self.info(), "attention_decode"))
    }

    /// One prefill step: writes the new tokens' k and v (`[tokens][num_kv_heads][head_dim]`) into
    /// the pools at their block-table positions, then attends causally over the cached prefix
    /// and the new tokens; q and out `[tokens][num_heads][head_dim]`.
    fn attention_prefill(
        &self,
        p: &PrefillParams,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        kv: &mut PagedKv<Self::Buffer>,
        out: &mut Self::Buffer,
    ) -> Result<AttnStats> {
        let _ = (p, q, k, v, kv, out);
        Err(attention_unsupported(self.info(), "attention_prefill"))
    }

    /// As [`attention_decode`](Self::attention_decode), without waiting for the device to report
    /// the recompute count: the hot path of the engine and of timed loops. Flagged rows are still
    /// recomputed; their number is added to the running total [`take_recomputed`](Self::take_recomputed)
    /// returns.
    fn attention_decode_enqueue(
        &self,
        p: &DecodeParams,
        q: &Self::Buffer,
        kv: &PagedKv<Self::Buffer>,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (p, q, kv, out);
        Err(attention_unsupported(self.info(), "attention_decode"))
    }

    /// As [`attention_prefill`](Self::attention_prefill), counting as
    /// [`attention_decode_enqueue`](Self::attention_decode_enqueue) does.
    fn attention_prefill_enqueue(
        &self,
        p: &PrefillParams,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        kv: &mut PagedKv<Self::Buffer>,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (p, q, k, v, kv, out);
        Err(attention_unsupported(self.info(), "attention_prefill"))
    }

    /// As [`attention_prefill_enqueue`](Self::attention_prefill_enqueue) for new tokens whose k
    /// and v the cache already holds (written by [`qkv_rope_append`](Self::qkv_rope_append) or
    /// [`kv_append`](Self::kv_append)): attends only. The engine's prefill takes this path (one
    /// pass over the new k and v fewer), and `bench attention` times it, the work an SDPA peer
    /// is given (its k and v already in place).
    fn attention_prefill_cached_enqueue(
        &self,
        p: &PrefillParams,
        q: &Self::Buffer,
        kv: &PagedKv<Self::Buffer>,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (p, q, kv, out);
        Err(attention_unsupported(self.info(), "attention_prefill"))
    }

    /// Start folding the launches that follow into a decode-graph signature (CUDA, see
    /// cuda/graph.rs); false when this backend does not replay graphs.
    fn graph_begin(&self) -> bool {
        false
    }

    /// The signature of the launches since [`graph_begin`](Self::graph_begin).
    fn graph_end(&self) -> Option<u64> {
        None
    }

    /// Run `body` (the same launches as every earlier call under `sig`): eagerly, or captured
    /// into a graph, or as a replay of that graph without calling `body`.
    fn graph_run(&self, sig: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = sig;
        body()
    }

    /// How often graphs were replayed, captured or bypassed; None without graphs.
    fn graph_counts(&self) -> Option<GraphCounts> {
        None
    }

    /// Rows recomputed by the enqueue paths since the last call (waits for the device).
    fn take_recomputed(&self) -> Result<usize> {
        Ok(0)
    }

    /// Softmax-input statistics (calibration, FlashDecoding++ §3): histograms of x = q·k/√d over
    /// every new token of `p` against every cached key at or before its position (the K/V of the
    /// new tokens must already be in the cache). One histogram, or one per query head. Waits for
    /// the device; results do not depend on the backend beyond the scores' fp32 rounding.
    fn attention_score_hist(
        &self,
        p: &PrefillParams,
        s: &crate::ops::scores::ScoreStatsParams,
        q: &Self::Buffer,
        kv: &PagedKv<Self::Buffer>,
    ) -> Result<Vec<crate::ops::scores::ScoreHist>> {
        let _ = (p, s, q, kv);
        Err(attention_unsupported(self.info(), "attention_score_hist"))
    }

    // The small ops of a layer (see [`crate::ops::layer`] for the layouts). Backends without
    // kernels for them keep these defaults, which decline (`Unsupported`).

    /// out = table[ids].
    fn embedding(&self, p: &EmbeddingParams, table: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        let _ = (p, table, out);
        Err(op_unsupported(self.info(), "embedding"))
    }

    /// residual += delta (when given); out = rmsnorm(residual) · weight.
    fn add_rmsnorm(
        &self,
        p: &RmsNormParams,
        residual: &mut Self::Buffer,
        delta: Option<&Self::Buffer>,
        weight: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (p, residual, delta, weight, out);
        Err(op_unsupported(self.info(), "add_rmsnorm"))
    }

    /// Split the fused QKV output into q, k, v, adding the bias (Qwen) and rotating q and k.
    fn qkv_rope(
        &self,
        p: &RopeParams,
        qkv: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (p, qkv, bias, q, k, v);
        Err(op_unsupported(self.info(), "qkv_rope"))
    }

    /// out = silu(gate) · up over the fused FFN1 output.
    fn silu_mul(&self, p: &SiluMulParams, gate_up: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        let _ = (p, gate_up, out);
        Err(op_unsupported(self.info(), "silu_mul"))
    }

    /// residual += delta (when given); out = layernorm(residual) · weight + bias (OPT).
    #[allow(clippy::too_many_arguments)]
    fn add_layernorm(
        &self,
        p: &LayerNormParams,
        residual: &mut Self::Buffer,
        delta: Option<&Self::Buffer>,
        weight: &Self::Buffer,
        bias: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (p, residual, delta, weight, bias, out);
        Err(op_unsupported(self.info(), "add_layernorm"))
    }

    /// x = act(x + bias) in place (a GEMM output's bias and activation).
    fn bias_act(&self, p: &BiasActParams, x: &mut Self::Buffer, bias: Option<&Self::Buffer>) -> Result<()> {
        let _ = (p, x, bias);
        Err(op_unsupported(self.info(), "bias_act"))
    }

    /// out = act(gate) · up over the fused FFN1 output. SiLU runs [`silu_mul`](Self::silu_mul)
    /// unless a backend overrides this.
    fn glu(&self, p: &GluParams, gate_up: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        if p.act == Activation::Silu {
            return self.silu_mul(
                &SiluMulParams {
                    rows: p.rows,
                    inter: p.inter,
                    dtype: p.dtype,
                },
                gate_up,
                out,
            );
        }
        Err(op_unsupported(self.info(), &format!("glu with {}", p.act.name())))
    }

    /// out[t] += table[positions[t] + offset] (learned absolute positions, OPT).
    fn add_positions(&self, p: &PositionParams, table: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        let _ = (p, table, out);
        Err(op_unsupported(self.info(), "add_positions"))
    }

    /// Write new tokens' k and v into the paged cache (the decode step's append).
    fn kv_append(
        &self,
        p: &KvAppendParams,
        k: &Self::Buffer,
        v: &Self::Buffer,
        kv: &mut PagedKv<Self::Buffer>,
    ) -> Result<()> {
        let _ = (p, k, v, kv);
        Err(op_unsupported(self.info(), "kv_append"))
    }

    /// [`qkv_rope`](Self::qkv_rope), then [`kv_append`](Self::kv_append) of the rotated k and
    /// the v of the same tokens (a decode step). A GPU backend may do both in one kernel that
    /// writes k and v straight into the cache and leaves the `k` and `v` buffers as they were:
    /// after this call, read the new keys and values from the cache only.
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_append(
        &self,
        rope: &RopeParams,
        append: &KvAppendParams,
        qkv: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &mut Self::Buffer,
        kv: &mut PagedKv<Self::Buffer>,
    ) -> Result<()> {
        self.qkv_rope(rope, qkv, bias, q, k, v)?;
        self.kv_append(append, k, v, kv)
    }

    /// dst[i] = src[rows[i]].
    fn gather_rows(&self, p: &GatherParams, src: &Self::Buffer, dst: &mut Self::Buffer) -> Result<()> {
        let _ = (p, src, dst);
        Err(op_unsupported(self.info(), "gather_rows"))
    }

    /// Every element i set to [`crate::ops::layer::random_value`]`(seed, i, scale)` in the
    /// buffer's dtype, generated where the buffer lives (random-weight models never cross the bus).
    fn fill_random(&self, buf: &mut Self::Buffer, seed: u64, scale: f32) -> Result<()> {
        let _ = (buf, seed, scale);
        Err(op_unsupported(self.info(), "fill_random"))
    }

    /// Greedy choice: for each of the first `rows` rows of `width` logits in `logits`, the index
    /// of the largest value (the lowest among equals). A row holding a NaN is an error, as it is
    /// for the host sampler. The default reads the logits back and chooses on the host; a GPU
    /// backend chooses on the device and reads back `rows` indices instead of rows × width
    /// values (a decode step's largest transfer).
    fn argmax_rows(&self, logits: &Self::Buffer, rows: usize, width: usize) -> Result<Vec<u32>> {
        check_argmax_dims(logits.len(), rows, width)?;
        let bits = self.download(logits)?;
        host_argmax_rows(logits.dtype(), &bits, rows, width)
    }

    /// Whether [`greedy_enqueue`](Self::greedy_enqueue), [`greedy_take`](Self::greedy_take)
    /// and [`embedding_fed`](Self::embedding_fed) work here: the pipelined greedy decode, where
    /// the host queues step n + 1 before it reads step n's choice.
    fn pipelined_greedy(&self) -> bool {
        false
    }

    /// As [`argmax_rows`](Self::argmax_rows) without waiting: the indices stay on the device for
    /// [`embedding_fed`](Self::embedding_fed) and their copy to the host is queued;
    /// [`greedy_take`](Self::greedy_take) returns them, oldest first.
    fn greedy_enqueue(&self, logits: &Self::Buffer, rows: usize, width: usize) -> Result<()> {
        let _ = (logits, rows, width);
        Err(op_unsupported(self.info(), "greedy_enqueue"))
    }

    /// The oldest queued greedy choice (waits for its copy only); errors as `argmax_rows` does.
    fn greedy_take(&self) -> Result<Vec<u32>> {
        Err(op_unsupported(self.info(), "greedy_take"))
    }

    /// As [`embedding`](Self::embedding), the ids being the newest queued greedy choice, still on
    /// the device: `p.ids` gives only their number (the host does not know them yet).
    fn embedding_fed(&self, p: &EmbeddingParams, table: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> {
        let _ = (p, table, out);
        Err(op_unsupported(self.info(), "embedding_fed"))
    }

    fn synchronize(&self) -> Result<()>;

    /// Measured copy bandwidth in GB/s, counting bytes read plus bytes written (a large
    /// buffer-to-buffer copy, median of several). The memory roofline of every report. The CPU
    /// takes the faster of a copy and a read stream, each its best of several (a CPU copy moves
    /// 1.5x the bytes it counts, so a read-only kernel would seem to beat it).
    fn copy_gbps(&self) -> Result<f64>;

    /// Run `f(i)` for i in 0..reps and return each run's time in milliseconds. GPU backends queue
    /// all runs back to back between events and synchronize once (after one untimed lead-in call
    /// `f(reps)`); the CPU times with the clock.
    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>>;
}

/// The checks every backend's [`Backend::scale_cols`] makes: w holds rows × cols elements, scale
/// cols, both of one dtype.
pub fn check_scale_cols(
    w: (usize, crate::dtype::DType),
    scale: (usize, crate::dtype::DType),
    rows: usize,
    cols: usize,
) -> Result<()> {
    let want = rows.checked_mul(cols).filter(|_| cols > 0);
    if want != Some(w.0) || scale.0 != cols {
        return Err(FdppError::Shape {
            what: "scale_cols (w [rows, cols], scale [cols])".into(),
            expected: format!("w {rows} × {cols}, scale {cols}"),
            found: format!("w {} elements, scale {}", w.0, scale.0),
        });
    }
    if w.1 != scale.1 {
        return Err(FdppError::InvalidArgument(format!(
            "scale_cols: w is {} and scale {}; both must be one dtype",
            w.1, scale.1
        )));
    }
    Ok(())
}

fn op_unsupported(info: &DeviceInfo, op: &str) -> FdppError {
    FdppError::Unsupported {
        spec: format!("{op} on {} ({})", info.backend, info.name),
        what: "this op yet (no kernel for this backend)".into(),
    }
}

fn attention_unsupported(info: &DeviceInfo, op: &str) -> FdppError {
    FdppError::Unsupported {
        spec: format!("{op} on {} ({})", info.backend, info.name),
        what: "attention yet (no kernels for this backend)".into(),
    }
}

/// Availability of one backend on this machine, for `fdpp devices` and `--backend auto`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendStatus {
    pub backend: BackendKind,
    pub available: bool,
    /// Why not, when not available.
    pub reason: Option<String>,
    pub devices: Vec<DeviceInfo>,
}

pub fn probe_all() -> Vec<BackendStatus> {
    vec![cpu::probe(), cuda::probe(), rocm::probe()]
}

/// An opened backend of any kind. Generic code is reached through [`with_backend!`].
pub enum AnyBackend {
    Cpu(cpu::CpuBackend),
    Cuda(cuda::CudaBackend),
    Rocm(rocm::RocmBackend),
}

impl AnyBackend {
    pub fn kind(&self) -> BackendKind {
        match self {
            AnyBackend::Cpu(_) => BackendKind::Cpu,
            AnyBackend::Cuda(_) => BackendKind::Cuda,
            AnyBackend::Rocm(_) => BackendKind::Rocm,
        }
    }
}

/// Run a generic expression with the concrete backend inside an [`AnyBackend`].
#[macro_export]
macro_rules! with_backend {
    ($any:expr, $b:ident => $body:expr) => {
        match $any {
            $crate::backend::AnyBackend::Cpu($b) => $body,
            $crate::backend::AnyBackend::Cuda($b) => $body,
            $crate::backend::AnyBackend::Rocm($b) => $body,
        }
    };
}

/// Open the chosen backend. `Auto` takes CUDA when a device is present, then ROCm, else the CPU; the
/// returned note says which and why, for the user.
pub fn open(choice: BackendChoice, device: usize) -> Result<(AnyBackend, String)> {
    let cpu_device = || {
        if device != 0 {
            return Err(FdppError::InvalidArgument(format!(
                "--device {device}: the CPU backend has one device, 0 (all cores); --device picks a GPU"
            )));
        }
        Ok(())
    };
    match choice {
        BackendChoice::Cpu => cpu_device().map(|_| {
            (
                AnyBackend::Cpu(cpu::CpuBackend::new()),
                format!("backend: cpu (asked for); {}", cpu::pool::describe()),
            )
        }),
        BackendChoice::Cuda => Ok((
            AnyBackend::Cuda(cuda::CudaBackend::open(device)?),
            "backend: cuda (asked for)".into(),
        )),
        BackendChoice::Rocm => Ok((
            AnyBackend::Rocm(rocm::RocmBackend::open(device)?),
            "backend: rocm (asked for)".into(),
        )),
        BackendChoice::Auto => match cuda::CudaBackend::open(device) {
            Ok(b) => {
                let note = format!("backend: cuda (auto: found {})", b.info().name);
                Ok((AnyBackend::Cuda(b), note))
            }
            Err(cuda_err) => match rocm::RocmBackend::open(device) {
                Ok(b) => {
                    let note = format!("backend: rocm (auto: found {})", b.info().name);
                    Ok((AnyBackend::Rocm(b), note))
                }
                Err(rocm_err) => {
                    cpu_device()?;
                    Ok((
                        AnyBackend::Cpu(cpu::CpuBackend::new()),
                        format!("backend: cpu (auto: {cuda_err}; {rocm_err}); {}", cpu::pool::describe()),
                    ))
                }
            },
        },
    }
}

/// `rows` rows of `width` (≥ 1) must fit in a buffer of `len` elements.
pub fn check_argmax_dims(len: usize, rows: usize, width: usize) -> Result<()> {
    if width == 0 || rows.checked_mul(width).is_none_or(|n| n > len) {
        return Err(FdppError::InvalidArgument(format!(
            "argmax_rows: {rows} rows of {width} logits do not fit a buffer of {len} (width must be at least 1)"
        )));
    }
    Ok(())
}

/// The host side of [`Backend::argmax_rows`]: widen each row and take its argmax.
pub fn host_argmax_rows(dtype: DType, bits: &[u16], rows: usize, width: usize) -> Result<Vec<u32>> {
    check_argmax_dims(bits.len(), rows, width)?;
    let mut row = vec![0f32; width];
    (0..rows)
        .map(|r| {
            dtype.widen(&bits[r * width..(r + 1) * width], &mut row);
            if let Some(i) = row.iter().position(|v| v.is_nan()) {
                return Err(nan_logit(r, Some(i)));
            }
            Ok(crate::engine::sampler::argmax(&row) as u32)
        })
        .collect()
}

/// The error for a row of logits holding a NaN (`token` when known).
pub fn nan_logit(row: usize, token: Option<usize>) -> FdppError {
    let at = token.map_or(String::new(), |t| format!(" (token {t})"));
    FdppError::InvalidArgument(format!(
        "logits of row {row} hold a NaN{at}: the forward pass produced a non-number"
    ))
}

#[cfg(test)]
mod argmax_tests {
    use super::*;

    fn bits(dt: DType, v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| dt.from_f32(x)).collect()
    }

    #[test]
    fn each_row_gives_its_largest_the_lowest_index_on_ties() {
        for dt in [DType::F16, DType::Bf16] {
            let b = bits(dt, &[0.5, 2.0, 2.0, -1.0, -3.0, -2.0, -2.5, -2.0, 7.0, 7.0, 7.0, 7.0]);
            assert_eq!(host_argmax_rows(dt, &b, 3, 4).expect("argmax"), vec![1, 1, 0]);
            assert_eq!(host_argmax_rows(dt, &b, 2, 4).expect("two rows"), vec![1, 1]);
            let inf = bits(dt, &[f32::NEG_INFINITY, f32::NEG_INFINITY]);
            assert_eq!(host_argmax_rows(dt, &inf, 1, 2).expect("all -inf"), vec![0]);
        }
    }

    #[test]
    fn a_nan_or_rows_past_the_buffer_are_errors() {
        let b = bits(DType::F16, &[1.0, f32::NAN, 0.0, 3.0]);
        let e = host_argmax_rows(DType::F16, &b, 2, 2).expect_err("nan").to_string();
        assert!(e.contains("row 0") && e.contains("token 1") && e.contains("NaN"), "{e}");
        let e = host_argmax_rows(DType::F16, &b, 3, 2)
            .expect_err("too many rows")
            .to_string();
        assert!(e.contains("3 rows of 2"), "{e}");
        assert!(host_argmax_rows(DType::F16, &b, 1, 0).is_err());
    }
}
