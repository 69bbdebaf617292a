//! The CUDA backend: cudarc with dynamic loading (the binary needs no CUDA to build), kernels
//! compiled at run time by NVRTC for the device's arch, cuBLAS as ImplC.

pub mod attention;
mod blaslt;
pub mod decode_tc;
#[cfg(test)]
mod decode_tc_model;
pub mod gemm;
pub mod gemm_epi;
pub mod gemm_hopper;
pub mod gemv_fused;
pub mod graph;
pub mod jit;
pub mod launch;
pub mod layer;
pub mod nccl;
pub mod peer;
pub mod prefill_hopper;
pub mod probe;
pub mod sample;
pub mod scores;
pub mod sources;
pub mod tma;
pub mod upload;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::Ptx;

use super::{Backend, BackendStatus, DeviceBuffer, DeviceInfo, RowSums};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::gemm::{GemmDims, GemmSpec};
use crate::ops::layer::{
    Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeParams, SiluMulParams,
};

pub use probe::probe as probe_status;

pub fn probe() -> BackendStatus {
    probe::probe()
}

pub struct CudaBuffer {
    dtype: DType,
    slice: CudaSlice<u16>,
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

pub(crate) fn drv(what: &str) -> impl Fn(cudarc::driver::DriverError) -> FdppError + '_ {
    move |e| FdppError::device("cuda", format!("{what}: {e:?}"))
}

/// The loaded functions of one spec uri by name, with the dynamic shared memory allowed.
type FunctionsOf = HashMap<String, (CudaFunction, u32)>;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Boxed, as `lt` and `layer` are: `AnyBackend`'s variants stay within clippy's size bound.
    info: Box<DeviceInfo>,
    blas: CudaBlas,
    /// cuBLASLt for the gemm specs that name one of its algorithms (blaslt.rs).
    lt: RefCell<Box<blaslt::LtState>>,
    modules: RefCell<HashMap<String, Arc<CudaModule>>>,
    /// Loaded functions by spec uri then name, with the shared-memory limit already raised.
    functions: RefCell<HashMap<String, FunctionsOf>>,
    /// Device scratch of the attention launches (block tables, partials, counters).
    attn: RefCell<attention::Scratch>,
    max_smem: u32,
    /// The small per-layer ops' loaded kernels and argument scratch (layer.rs).
    layer: RefCell<Box<layer::LayerState>>,
    /// Programmatic dependent launch for the chained kernels (launch.rs).
    pdl: bool,
    /// sm_90 and later: thread-block cluster launches (the decode finish, attention.rs).
    clusters: bool,
    /// Device indices of the greedy choice (sample.rs).
    argmax: RefCell<Option<CudaSlice<u32>>>,
    /// The running recompute total fetched with the last greedy choice (sample.rs), for the
    /// next `take_recomputed` (which then needs no device read of its own).
    fetched_recomputed: std::cell::Cell<Option<usize>>,
    /// One-head-per-block decode launches of up to this many sequences run the tensor-core pass
    /// (`Backend::set_decode_tensor_cores`; None: the built-in rule).
    decode_tc_up_to: std::cell::Cell<Option<usize>>,
    /// Decode-step graphs (graph.rs).
    graphs: RefCell<Box<graph::Graphs>>,
    /// Queued greedy choices of the pipelined decode (sample.rs).
    greedy: RefCell<sample::Greedy>,
    /// The fused prefill's rotary table and cluster occupancies (gemm_epi.rs).
    epi: gemm_epi::ScratchCell,
}

impl CudaBackend {
    pub fn open(ordinal: usize) -> Result<Self> {
        let n = probe::device_count()?;
        if ordinal >= n {
            return Err(FdppError::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist: this machine has {n} (valid: 0..{})",
                n.saturating_sub(1)
            )));
        }
        if !jit::nvrtc_present() {
            return Err(FdppError::BackendUnavailable {
                backend: "cuda",
                reason: "NVRTC (libnvrtc.so) not found; add the CUDA lib directory to LD_LIBRARY_PATH".into(),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuCtxCreate"))?;
        // Per-buffer event tracking would add event records between back-to-back kernels; fdpp
        // uses one stream, so stream order is all the synchronisation it needs.
        // SAFETY: no buffers exist yet; every op below runs on `stream`.
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default one: a decode graph is captured from this
        // stream (graph.rs), and the legacy stream cannot be captured.
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let info = Box::new(probe::device_info(&ctx)?);
        // SAFETY: probing only dlopens libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(FdppError::BackendUnavailable {
                backend: "cuda",
                reason: "cuBLAS (libcublas.so) not found: ImplC needs it".into(),
            });
        }
        let (major, _) = ctx.compute_capability().map_err(drv("compute capability"))?;
        let pdl = launch::pdl_wanted(major as u32, crate::run_config::get().get(crate::run_config::Key::Pdl));
        let clusters = major >= 9;
        let max_smem = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("device attribute"))? as u32;
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| FdppError::device("cuda", format!("cublasCreate: {e:?}")))?;
        Ok(CudaBackend {
            ctx,
            stream,
            info,
            blas,
            lt: RefCell::default(),
            modules: RefCell::new(HashMap::new()),
            functions: RefCell::new(HashMap::new()),
            attn: RefCell::new(attention::Scratch::default()),
            max_smem,
            layer: RefCell::default(),
            pdl,
            clusters,
            argmax: RefCell::new(None),
            fetched_recomputed: std::cell::Cell::new(None),
            decode_tc_up_to: std::cell::Cell::new(None),
            graphs: RefCell::new(Box::new(graph::Graphs::new(graph::graphs_wanted(
                crate::run_config::get().get(crate::run_config::Key::Graphs),
            )))),
            greedy: RefCell::default(),
            epi: RefCell::default(),
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether chained kernels are launched with programmatic dependent launch.
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Whether the device launches thread-block clusters (sm_90 and later).
    pub fn clusters(&self) -> bool {
        self.clusters
    }

    /// The profile's batch bound for the tensor-core pass of MHA decode (`set_decode_tensor_cores`).
    pub fn decode_tc_up_to(&self) -> Option<usize> {
        self.decode_tc_up_to.get()
    }

    /// Load (compiling or from the disk cache) the module of a kernel source.
    pub(crate) fn module(&self, src: &sources::KernelSource) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules.borrow().get(&src.uri) {
            return Ok(m.clone());
        }
        let (cubin, _) = jit::cubin_cached(src, &self.info.arch, &mut |w| eprintln!("warning: {w}"))?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(drv(&format!("loading {}", src.uri)))?;
        self.modules.borrow_mut().insert(src.uri.clone(), module.clone());
        Ok(module)
    }

    /// A kernel function, with its dynamic shared-memory limit raised to at least `smem` bytes.
    /// The source is built only on the first call for this (uri, name): a launch of a loaded
    /// kernel costs a hash lookup, not a source expansion.
    pub(crate) fn function_of(
        &self,
        uri: &str,
        name: &str,
        smem: u32,
        source: impl FnOnce() -> Result<sources::KernelSource>,
    ) -> Result<CudaFunction> {
        if let Some(per_uri) = self.functions.borrow().get(uri) {
            if let Some((f, have)) = per_uri.get(name) {
                if *have >= smem {
                    return Ok(f.clone());
                }
            }
        }
        let src = source()?;
        let f = self
            .module(&src)?
            .load_function(name)
            .map_err(drv(&format!("{}: function {name}", src.uri)))?;
        gemm::set_smem(&f, smem)?;
        self.functions
            .borrow_mut()
            .entry(uri.to_string())
            .or_default()
            .insert(name.to_string(), (f.clone(), smem));
        Ok(f)
    }

    pub(crate) fn ptr(&self, b: &CudaBuffer) -> u64 {
        let (p, _sync) = b.slice.device_ptr(&self.stream);
        p
    }

    /// Opt-in dynamic shared memory per block (227 KiB on Hopper).
    pub(crate) fn max_smem_per_block(&self) -> u32 {
        self.max_smem
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// Check the last launch's error (an illegal address surfaces here, not as a crash).
    pub fn check_launch(&self, what: &str) -> Result<()> {
        self.ctx.check_err().map_err(drv(what))
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn kernel_hash(&self) -> String {
        sources::kernel_hash()
    }

    fn decode_pass_choice(&self, head_dim: usize) -> bool {
        decode_tc::tc_pass_available(head_dim)
    }

    fn set_decode_tensor_cores(&self, up_to_batch: Option<usize>) {
        self.decode_tc_up_to.set(up_to_batch);
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<CudaBuffer> {
        // SAFETY: the buffer is poisoned right away; fdpp never reads uninitialised memory.
        let slice = unsafe { self.stream.alloc::<u16>(len.max(1)) }
            .map_err(drv(&format!("allocating {len} elements ({} MiB)", (2 * len) >> 20)))?;
        let mut b = CudaBuffer { dtype, slice };
        self.fill(&mut b, dtype.poison())?;
        Ok(b)
    }

    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<CudaBuffer> {
        let slice = self.stream.clone_htod(bits).map_err(drv("upload"))?;
        Ok(CudaBuffer { dtype, slice })
    }

    fn download(&self, buf: &CudaBuffer) -> Result<Vec<u16>> {
        self.stream.clone_dtoh(&buf.slice).map_err(drv("download"))
    }

    fn fill(&self, buf: &mut CudaBuffer, bits: u16) -> Result<()> {
        let p = self.ptr(buf);
        // SAFETY: p points at buf.len() u16 elements owned by buf.
        let r = unsafe { sys::cuMemsetD16Async(p, bits, buf.len(), self.stream.cu_stream()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(FdppError::device("cuda", format!("cuMemsetD16Async: {r:?}")));
        }
        Ok(())
    }

    fn gemm_candidates(&self, dtype: DType, _n: usize, _k: usize) -> Vec<GemmSpec> {
        let mut v = sources::all_gemm_specs(dtype);
        let vendor = GemmSpec::new(crate::ops::gemm::GemmImpl::Gemm, dtype);
        v.push(vendor);
        if blaslt::present() {
            v.extend((0..crate::ops::gemm::LT_RANKS).map(|r| vendor.with_algo(r)));
        }
        if self.info.arch == prefill_hopper::ARCH {
            v.extend(gemm_hopper::specs(dtype));
        }
        v
    }

    fn gemm(&self, spec: &GemmSpec, dims: GemmDims, x: &CudaBuffer, w: &CudaBuffer, y: &mut CudaBuffer) -> Result<()> {
        // cuBLAS launches what it chooses: a graph signature takes the call itself.
        self.graphs.borrow_mut().record(|s| {
            s.fold(format!("{spec:?} {dims:?}").as_bytes());
            for p in [self.ptr(x), self.ptr(w), self.ptr(y)] {
                s.fold_u64(p);
            }
        });
        gemm::run(self, spec, dims, x, w, y)
    }

    fn fused_gemv_ops(&self) -> bool {
        true
    }

    fn gemm_rms_in(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        eps: f32,
        residual: &CudaBuffer,
        w: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        gemv_fused::rms_in(self, spec, dims, eps, residual, w, y)
    }

    fn gemm_rms_glu(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        eps: f32,
        residual: &CudaBuffer,
        w: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        gemv_fused::rms_glu(self, spec, dims, eps, residual, w, y)
    }

    fn gemm_rms_rope_append(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        eps: f32,
        residual: &CudaBuffer,
        w: &CudaBuffer,
        rope: &RopeParams,
        append: &KvAppendParams,
        bias: Option<&CudaBuffer>,
        q: &mut CudaBuffer,
        kv: &mut PagedKv<CudaBuffer>,
    ) -> Result<()> {
        gemv_fused::rms_rope_append(self, spec, dims, eps, residual, w, rope, append, bias, q, kv)
    }

    fn gemm_residual_out(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &CudaBuffer,
        w: &CudaBuffer,
        residual: &mut CudaBuffer,
    ) -> Result<()> {
        gemv_fused::residual_out(self, spec, dims, x, w, residual)
    }

    fn prefill_fusion(&self, dt: DType) -> bool {
        let _ = dt;
        gemm_epi::available(self)
    }

    fn row_sums_len(&self, rows: usize, cols: usize) -> usize {
        gemm_epi::row_sums_len(rows, cols)
    }

    fn prefill_row_sumsq(&self, rows: usize, cols: usize, x: &CudaBuffer, ss: &mut CudaBuffer) -> Result<RowSums> {
        gemm_epi::row_sumsq(self, rows, cols, x, ss)
    }

    fn prefill_residual_out(
        &self,
        dims: GemmDims,
        x: &CudaBuffer,
        w: &CudaBuffer,
        residual: &mut CudaBuffer,
        ss: &mut CudaBuffer,
    ) -> Result<RowSums> {
        gemm_epi::residual_out(self, dims, x, w, residual, ss)
    }

    fn prefill_rms_in(
        &self,
        dims: GemmDims,
        sums: RowSums,
        eps: f32,
        ss: &CudaBuffer,
        residual: &CudaBuffer,
        w: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        gemm_epi::rms_in(self, dims, sums, eps, ss, residual, w, y)
    }

    fn prefill_rms_glu(
        &self,
        dims: GemmDims,
        sums: RowSums,
        eps: f32,
        ss: &CudaBuffer,
        residual: &CudaBuffer,
        w: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        gemm_epi::rms_glu(self, dims, sums, eps, ss, residual, w, y)
    }

    fn prefill_rms_rope_append(
        &self,
        dims: GemmDims,
        sums: RowSums,
        eps: f32,
        ss: &CudaBuffer,
        residual: &CudaBuffer,
        w: &CudaBuffer,
        rope: &RopeParams,
        append: &KvAppendParams,
        q: &mut CudaBuffer,
        kv: &mut PagedKv<CudaBuffer>,
    ) -> Result<()> {
        gemm_epi::rms_rope_append(self, dims, sums, eps, ss, residual, w, rope, append, q, kv)
    }

    fn attention_decode(
        &self,
        p: &crate::ops::attention::DecodeParams,
        q: &CudaBuffer,
        kv: &crate::kv::PagedKv<CudaBuffer>,
        out: &mut CudaBuffer,
    ) -> Result<crate::ops::attention::AttnStats> {
        attention::decode(self, p, q, kv, out, true)
    }

    fn attention_decode_enqueue(
        &self,
        p: &crate::ops::attention::DecodeParams,
        q: &CudaBuffer,
        kv: &crate::kv::PagedKv<CudaBuffer>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        attention::decode(self, p, q, kv, out, false).map(|_| ())
    }

    fn attention_prefill(
        &self,
        p: &crate::ops::attention::PrefillParams,
        q: &CudaBuffer,
        k: &CudaBuffer,
        v: &CudaBuffer,
        kv: &mut crate::kv::PagedKv<CudaBuffer>,
        out: &mut CudaBuffer,
    ) -> Result<crate::ops::attention::AttnStats> {
        attention::prefill(self, p, q, k, v, kv, out, true)
    }

    fn attention_prefill_enqueue(
        &self,
        p: &crate::ops::attention::PrefillParams,
        q: &CudaBuffer,
        k: &CudaBuffer,
        v: &CudaBuffer,
        kv: &mut crate::kv::PagedKv<CudaBuffer>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        attention::prefill(self, p, q, k, v, kv, out, false).map(|_| ())
    }

    fn attention_prefill_cached_enqueue(
        &self,
        p: &crate::ops::attention::PrefillParams,
        q: &CudaBuffer,
        kv: &crate::kv::PagedKv<CudaBuffer>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        attention::prefill_cached(self, p, q, kv, out, false).map(|_| ())
    }

    fn graph_begin(&self) -> bool {
        let mut g = self.graphs.borrow_mut();
        if g.enabled() {
            g.begin();
        }
        g.enabled()
    }

    fn graph_end(&self) -> Option<u64> {
        self.graphs.borrow_mut().end()
    }

    fn graph_run(&self, sig: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        graph::run(self, sig, body)
    }

    fn graph_counts(&self) -> Option<super::GraphCounts> {
        let g = self.graphs.borrow();
        g.enabled().then_some(g.counts)
    }

    fn take_recomputed(&self) -> Result<usize> {
        match self.fetched_recomputed.take() {
            Some(n) => Ok(n),
            None => attention::take_recomputed(self),
        }
    }

    fn attention_score_hist(
        &self,
        p: &crate::ops::attention::PrefillParams,
        s: &crate::ops::scores::ScoreStatsParams,
        q: &CudaBuffer,
        kv: &crate::kv::PagedKv<CudaBuffer>,
    ) -> Result<Vec<crate::ops::scores::ScoreHist>> {
        scores::score_hist(self, p, s, q, kv)
    }

    fn embedding(&self, p: &EmbeddingParams, table: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        layer::embedding(self, p, table, out)
    }

    fn add_rmsnorm(
        &self,
        p: &RmsNormParams,
        residual: &mut CudaBuffer,
        delta: Option<&CudaBuffer>,
        weight: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        layer::add_rmsnorm(self, p, residual, delta, weight, out)
    }

    fn qkv_rope(
        &self,
        p: &RopeParams,
        qkv: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        q: &mut CudaBuffer,
        k: &mut CudaBuffer,
        v: &mut CudaBuffer,
    ) -> Result<()> {
        layer::qkv_rope(self, p, qkv, bias, q, k, v)
    }

    fn qkv_rope_append(
        &self,
        rope: &RopeParams,
        append: &KvAppendParams,
        qkv: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        q: &mut CudaBuffer,
        k: &mut CudaBuffer,
        v: &mut CudaBuffer,
        kv: &mut PagedKv<CudaBuffer>,
    ) -> Result<()> {
        layer::qkv_rope_append(self, rope, append, qkv, bias, q, k, v, kv)
    }

    fn silu_mul(&self, p: &SiluMulParams, gate_up: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        layer::silu_mul(self, p, gate_up, out)
    }

    fn add_layernorm(
        &self,
        p: &LayerNormParams,
        residual: &mut CudaBuffer,
        delta: Option<&CudaBuffer>,
        weight: &CudaBuffer,
        bias: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        layer::add_layernorm(self, p, residual, delta, (weight, bias), out)
    }

    fn bias_act(&self, p: &BiasActParams, x: &mut CudaBuffer, bias: Option<&CudaBuffer>) -> Result<()> {
        layer::bias_act(self, p, x, bias)
    }

    fn glu(&self, p: &GluParams, gate_up: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        if p.act == Activation::Silu {
            // Llama's SwiGLU keeps its own kernel.
            let sp = SiluMulParams {
                rows: p.rows,
                inter: p.inter,
                dtype: p.dtype,
            };
            return layer::silu_mul(self, &sp, gate_up, out);
        }
        layer::glu(self, p, gate_up, out)
    }

    fn add_positions(&self, p: &PositionParams, table: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        layer::add_positions(self, p, table, out)
    }

    fn kv_append(
        &self,
        p: &KvAppendParams,
        k: &CudaBuffer,
        v: &CudaBuffer,
        kv: &mut PagedKv<CudaBuffer>,
    ) -> Result<()> {
        layer::kv_append(self, p, k, v, kv)
    }

    fn gather_rows(&self, p: &GatherParams, src: &CudaBuffer, dst: &mut CudaBuffer) -> Result<()> {
        layer::gather_rows(self, p, src, dst)
    }

    fn fill_random(&self, buf: &mut CudaBuffer, seed: u64, scale: f32) -> Result<()> {
        layer::fill_random(self, buf, seed, scale)
    }

    fn scale_cols(&self, w: &mut CudaBuffer, scale: &CudaBuffer, rows: usize, cols: usize) -> Result<()> {
        layer::scale_cols(self, w, scale, rows, cols)
    }

    fn argmax_rows(&self, logits: &CudaBuffer, rows: usize, width: usize) -> Result<Vec<u32>> {
        // The indices a queued choice left on the device are overwritten here.
        self.greedy.borrow_mut().unfeed();
        sample::argmax_rows(self, &mut self.argmax.borrow_mut(), logits, rows, width)
    }

    fn pipelined_greedy(&self) -> bool {
        true
    }

    fn greedy_enqueue(&self, logits: &CudaBuffer, rows: usize, width: usize) -> Result<()> {
        let mut q = self.greedy.borrow_mut();
        sample::greedy_enqueue(self, &mut self.argmax.borrow_mut(), &mut q, logits, rows, width)
    }

    fn greedy_take(&self) -> Result<Vec<u32>> {
        sample::greedy_take(self, &mut self.greedy.borrow_mut())
    }

    fn embedding_fed(&self, p: &EmbeddingParams, table: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        let ids = sample::fed_ids(self, &self.argmax.borrow(), &self.greedy.borrow(), p.ids.len())?;
        layer::embedding_fed(self, p, ids, table, out)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }

    fn copy_gbps(&self) -> Result<f64> {
        // 1 GiB each way: far past L2; bytes counted are read + written.
        let len = 512usize << 20;
        let src = self.alloc(DType::F16, len)?;
        let mut dst = self.alloc(DType::F16, len)?;
        let s = &self.stream;
        for _ in 0..2 {
            s.memcpy_dtod(&src.slice, &mut dst.slice).map_err(drv("copy"))?;
        }
        let ms = self.time_each(10, &mut |_| {
            s.memcpy_dtod(&src.slice, &mut dst.slice).map_err(drv("copy"))
        })?;
        let med = crate::bench::Stats::from_ms(&ms)
            .map(|s| s.median_us)
            .unwrap_or(f64::NAN);
        Ok((4 * len) as f64 / (med * 1e-6) / 1e9)
    }

    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::with_capacity(reps + 1);
        for _ in 0..=reps {
            events.push(self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?);
        }
        // Back to back: the end event of run i is the start of run i+1, so launch latency is
        // hidden behind the previous kernel as it is in a real decode step. One untimed lead-in
        // run keeps the device busy when the first start event is recorded; otherwise the
        // first interval would include the launch from an idle device.
        if reps > 0 {
            f(reps)?;
        }
        events[0].record(&self.stream).map_err(drv("cuEventRecord"))?;
        for i in 0..reps {
            f(i)?;
            events[i + 1].record(&self.stream).map_err(drv("cuEventRecord"))?;
        }
        events[reps].synchronize().map_err(drv("cuEventSynchronize"))?;
        self.check_launch("timed runs")?;
        let mut out = Vec::with_capacity(reps);
        for i in 0..reps {
            out.push(
                events[i]
                    .elapsed_ms(&events[i + 1])
                    .map_err(drv("cuEventElapsedTime"))? as f64,
            );
        }
        Ok(out)
    }
}
