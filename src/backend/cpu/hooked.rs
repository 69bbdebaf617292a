//! The CPU backend with its GEMM (and, optionally, its uploads) passed through a caller's hook:
//! the one fixture the tests use to plant faults (wrong or unwritten outputs, writes past the
//! end, refusals, failed uploads) and prove that the check harness, the tuner and the bench
//! catch them. Everything else is the plain CPU backend.

use super::{CpuBackend, CpuBuffer};
use crate::backend::{Backend, DeviceInfo};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::gemm::{GemmDims, GemmSpec};
use crate::ops::layer::{EmbeddingParams, GatherParams, KvAppendParams, RmsNormParams, RopeParams, SiluMulParams};

/// Runs one GEMM; receives the real CPU backend to delegate to.
pub type GemmHook = dyn Fn(&CpuBackend, &GemmSpec, GemmDims, &CpuBuffer, &CpuBuffer, &mut CpuBuffer) -> Result<()>;
/// Called before each upload; an error fails the upload.
pub type UploadHook = dyn Fn(DType, &[u16]) -> Result<()>;

pub struct HookedCpu {
    inner: CpuBackend,
    gemm: Box<GemmHook>,
    upload: Option<Box<UploadHook>>,
    /// False: the small layer ops decline (`Unsupported`) like a backend without them.
    layer_ops: bool,
}

impl HookedCpu {
    pub fn new(
        gemm: impl Fn(&CpuBackend, &GemmSpec, GemmDims, &CpuBuffer, &CpuBuffer, &mut CpuBuffer) -> Result<()> + 'static,
    ) -> Self {
        HookedCpu {
            inner: CpuBackend::new(),
            gemm: Box::new(gemm),
            upload: None,
            layer_ops: true,
        }
    }

    pub fn with_upload_hook(mut self, f: impl Fn(DType, &[u16]) -> Result<()> + 'static) -> Self {
        self.upload = Some(Box::new(f));
        self
    }

    /// The small layer ops (embedding, add_rmsnorm, …) decline with `Unsupported`, as on a
    /// backend that has no kernels for them.
    pub fn without_layer_ops(mut self) -> Self {
        self.layer_ops = false;
        self
    }

    fn layer_op(&self, op: &str) -> Result<()> {
        if self.layer_ops {
            return Ok(());
        }
        Err(FdppError::Unsupported {
            spec: format!("{op} on {} ({})", self.inner.info().backend, self.inner.info().name),
            what: "this op (declined by the test fixture)".into(),
        })
    }
}

impl Backend for HookedCpu {
    type Buffer = CpuBuffer;
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn kernel_hash(&self) -> String {
        self.inner.kernel_hash()
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        self.inner.alloc(dtype, len)
    }
    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<CpuBuffer> {
        if let Some(h) = &self.upload {
            h(dtype, bits)?;
        }
        self.inner.upload(dtype, bits)
    }
    fn download(&self, buf: &CpuBuffer) -> Result<Vec<u16>> {
        self.inner.download(buf)
    }
    fn fill(&self, buf: &mut CpuBuffer, bits: u16) -> Result<()> {
        self.inner.fill(buf, bits)
    }
    fn gemm_candidates(&self, dtype: DType, n: usize, k: usize) -> Vec<GemmSpec> {
        self.inner.gemm_candidates(dtype, n, k)
    }
    fn gemm(&self, spec: &GemmSpec, d: GemmDims, x: &CpuBuffer, w: &CpuBuffer, y: &mut CpuBuffer) -> Result<()> {
        (self.gemm)(&self.inner, spec, d, x, w, y)
    }
    fn embedding(&self, p: &EmbeddingParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        self.layer_op("embedding")?;
        self.inner.embedding(p, table, out)
    }
    fn add_rmsnorm(
        &self,
        p: &RmsNormParams,
        residual: &mut CpuBuffer,
        delta: Option<&CpuBuffer>,
        weight: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        self.layer_op("add_rmsnorm")?;
        self.inner.add_rmsnorm(p, residual, delta, weight, out)
    }
    fn qkv_rope(
        &self,
        p: &RopeParams,
        qkv: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        q: &mut CpuBuffer,
        k: &mut CpuBuffer,
        v: &mut CpuBuffer,
    ) -> Result<()> {
        self.layer_op("qkv_rope")?;
        self.inner.qkv_rope(p, qkv, bias, q, k, v)
    }
    fn silu_mul(&self, p: &SiluMulParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        self.layer_op("silu_mul")?;
        self.inner.silu_mul(p, gate_up, out)
    }
    fn kv_append(&self, p: &KvAppendParams, k: &CpuBuffer, v: &CpuBuffer, kv: &mut PagedKv<CpuBuffer>) -> Result<()> {
        self.layer_op("kv_append")?;
        self.inner.kv_append(p, k, v, kv)
    }
    fn gather_rows(&self, p: &GatherParams, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        self.layer_op("gather_rows")?;
        self.inner.gather_rows(p, src, dst)
    }
    fn fill_random(&self, buf: &mut CpuBuffer, seed: u64, scale: f32) -> Result<()> {
        self.layer_op("fill_random")?;
        self.inner.fill_random(buf, seed, scale)
    }
    fn scale_cols(&self, w: &mut CpuBuffer, scale: &CpuBuffer, rows: usize, cols: usize) -> Result<()> {
        self.layer_op("scale_cols")?;
        self.inner.scale_cols(w, scale, rows, cols)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn copy_gbps(&self) -> Result<f64> {
        self.inner.copy_gbps()
    }
    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        self.inner.time_each(reps, f)
    }
}
