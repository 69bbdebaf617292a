//! The CPU backend with its GEMM (and, optionally, its uploads) passed through a caller's hook:
//! the one fixture the tests use to plant faults (wrong or unwritten outputs, writes past the
//! end, refusals, failed uploads) and prove that the check harness, the tuner and the bench
//! catch them. Everything else is the plain CPU backend.

use super::{CpuBackend, CpuBuffer};
use crate::backend::{Backend, DeviceInfo};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::gemm::{GemmDims, GemmSpec};

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
