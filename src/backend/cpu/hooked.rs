//! The CPU backend with its GEMM (and, optionally, its uploads) passed through a caller's hook:
//! the one fixture the tests use to plant faults (wrong or unwritten outputs, writes past the
//! end, refusals, failed uploads) and prove that the check harness, the tuner and the bench
//! catch them. Everything else is the plain CPU backend.

use super::{CpuBackend, CpuBuffer};
use crate::backend::{Backend, DeviceInfo};
use crate::dtype::DType;
use crate::error::Result;
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
}

impl HookedCpu {
    pub fn new(
        gemm: impl Fn(&CpuBackend, &GemmSpec, GemmDims, &CpuBuffer, &CpuBuffer, &mut CpuBuffer) -> Result<()> + 'static,
    ) -> Self {
        HookedCpu {
            inner: CpuBackend::new(),
            gemm: Box::new(gemm),
            upload: None,
        }
    }

    pub fn with_upload_hook(mut self, f: impl Fn(DType, &[u16]) -> Result<()> + 'static) -> Self {
        self.upload = Some(Box::new(f));
        self
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
        self.inner.qkv_rope(p, qkv, bias, q, k, v)
    }
    fn silu_mul(&self, p: &SiluMulParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        self.inner.silu_mul(p, gate_up, out)
    }
    fn kv_append(&self, p: &KvAppendParams, k: &CpuBuffer, v: &CpuBuffer, kv: &mut PagedKv<CpuBuffer>) -> Result<()> {
        self.inner.kv_append(p, k, v, kv)
    }
    fn gather_rows(&self, p: &GatherParams, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        self.inner.gather_rows(p, src, dst)
    }
    fn fill_random(&self, buf: &mut CpuBuffer, seed: u64, scale: f32) -> Result<()> {
        self.inner.fill_random(buf, seed, scale)
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
