//! The CUDA backend (cudarc, loaded at run time). Filled in by issue #3.

use super::{Backend, BackendKind, BackendStatus, DeviceBuffer, DeviceInfo};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};

pub struct CudaBuffer {
    dtype: DType,
    len: usize,
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

pub struct CudaBackend {
    info: DeviceInfo,
}

fn unavailable() -> FdppError {
    FdppError::BackendUnavailable {
        backend: "cuda",
        reason: "not implemented yet".into(),
    }
}

pub fn probe() -> BackendStatus {
    BackendStatus {
        backend: BackendKind::Cuda,
        available: false,
        reason: Some(unavailable().to_string()),
        devices: vec![],
    }
}

impl CudaBackend {
    pub fn open(_ordinal: usize) -> Result<Self> {
        Err(unavailable())
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn kernel_hash(&self) -> String {
        String::new()
    }
    fn alloc(&self, _dtype: DType, _len: usize) -> Result<CudaBuffer> {
        Err(unavailable())
    }
    fn upload(&self, _dtype: DType, _bits: &[u16]) -> Result<CudaBuffer> {
        Err(unavailable())
    }
    fn download(&self, _buf: &CudaBuffer) -> Result<Vec<u16>> {
        Err(unavailable())
    }
    fn fill(&self, _buf: &mut CudaBuffer, _bits: u16) -> Result<()> {
        Err(unavailable())
    }
    fn gemm_candidates(&self, _dtype: DType, _n: usize, _k: usize) -> Vec<GemmSpec> {
        vec![]
    }
    fn gemm(
        &self,
        _spec: &GemmSpec,
        _dims: GemmDims,
        _x: &CudaBuffer,
        _w: &CudaBuffer,
        _y: &mut CudaBuffer,
    ) -> Result<()> {
        Err(unavailable())
    }
    fn synchronize(&self) -> Result<()> {
        Err(unavailable())
    }
    fn copy_gbps(&self) -> Result<f64> {
        Err(unavailable())
    }
    fn time_each(&self, _reps: usize, _f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        Err(unavailable())
    }
}
