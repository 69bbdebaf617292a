//! The CPU backend: the reference for every device kernel and the default without a GPU.

use std::time::Instant;

use rayon::prelude::*;

use super::{Backend, BackendKind, BackendStatus, DeviceBuffer, DeviceInfo};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};

pub struct CpuBuffer {
    pub dtype: DType,
    pub data: Vec<u16>,
}

impl DeviceBuffer for CpuBuffer {
    fn len(&self) -> usize {
        self.data.len()
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

pub struct CpuBackend {
    info: DeviceInfo,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend { info: cpu_info() }
    }
}

fn cpu_info() -> DeviceInfo {
    let threads = rayon::current_num_threads() as u32;
    let name = format!("CPU {} ({} threads)", std::env::consts::ARCH, threads);
    DeviceInfo {
        backend: BackendKind::Cpu,
        ordinal: 0,
        slug: format!("cpu-{}", std::env::consts::ARCH),
        name,
        arch: std::env::consts::ARCH.to_string(),
        compute_units: threads,
        memory_bytes: 0,
        l2_bytes: 0,
        driver_version: None,
        runtime_version: None,
    }
}

pub fn probe() -> BackendStatus {
    BackendStatus {
        backend: BackendKind::Cpu,
        available: true,
        reason: None,
        devices: vec![cpu_info()],
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn kernel_hash(&self) -> String {
        format!("cpu-{}", env!("CARGO_PKG_VERSION"))
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer {
            dtype,
            data: vec![dtype.poison(); len],
        })
    }

    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<CpuBuffer> {
        Ok(CpuBuffer {
            dtype,
            data: bits.to_vec(),
        })
    }

    fn download(&self, buf: &CpuBuffer) -> Result<Vec<u16>> {
        Ok(buf.data.clone())
    }

    fn fill(&self, buf: &mut CpuBuffer, bits: u16) -> Result<()> {
        buf.data.fill(bits);
        Ok(())
    }

    fn gemm_candidates(&self, dtype: DType, _n: usize, _k: usize) -> Vec<GemmSpec> {
        GemmImpl::ALL.iter().map(|&i| GemmSpec::new(i, dtype)).collect()
    }

    fn gemm(&self, spec: &GemmSpec, dims: GemmDims, x: &CpuBuffer, w: &CpuBuffer, y: &mut CpuBuffer) -> Result<()> {
        dims.check_lens(spec, x.len(), w.len(), y.len())?;
        if x.dtype != spec.dtype || w.dtype != spec.dtype || y.dtype != spec.dtype {
            return Err(FdppError::InvalidArgument(format!(
                "{spec}: buffers are not all {}",
                spec.dtype
            )));
        }
        naive_gemm(spec.dtype, dims, &x.data, &w.data, &mut y.data);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn copy_gbps(&self) -> Result<f64> {
        // 256 MiB, well past any LLC; copied in parallel chunks as the kernels read.
        let len = 128 << 20;
        let src = vec![1u16; len];
        let mut dst = vec![0u16; len];
        let ms = self.time_each(5, &mut |_| {
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
            Ok(())
        })?;
        let med = crate::bench::Stats::from_ms(&ms)
            .map(|s| s.median_us)
            .unwrap_or(f64::NAN);
        Ok((4 * len) as f64 / (med * 1e-6) / 1e9)
    }

    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        let mut out = Vec::with_capacity(reps);
        for i in 0..reps {
            let t = Instant::now();
            f(i)?;
            out.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(out)
    }
}

/// Placeholder kernel shared by the three paths until each gets its own.
fn naive_gemm(dt: DType, d: GemmDims, x: &[u16], w: &[u16], y: &mut [u16]) {
    let mut xf = vec![0f32; d.m * d.k];
    dt.widen(&x[..d.m * d.k], &mut xf);
    let cols: Vec<Vec<f32>> = (0..d.n)
        .into_par_iter()
        .map(|n| {
            let mut row = vec![0f32; d.k];
            dt.widen(&w[n * d.k..(n + 1) * d.k], &mut row);
            (0..d.m)
                .map(|m| xf[m * d.k..(m + 1) * d.k].iter().zip(&row).map(|(a, b)| a * b).sum())
                .collect()
        })
        .collect();
    for (n, col) in cols.iter().enumerate() {
        for (m, v) in col.iter().enumerate() {
            y[m * d.n + n] = dt.from_f32(*v);
        }
    }
}
