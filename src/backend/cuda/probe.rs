//! Device discovery. cudarc panics when a CUDA library is missing, so every entry point checks
//! that the library loads before the first call into it.

use cudarc::driver::{sys, CudaContext};

use super::super::{slugify, BackendKind, BackendStatus, DeviceInfo};
use super::jit;
use crate::error::{FdppError, Result};

pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda by its candidate names.
    unsafe { sys::is_culib_present() }
}

fn no_driver() -> FdppError {
    FdppError::BackendUnavailable {
        backend: "cuda",
        reason: "no CUDA driver library found (libcuda.so); this machine has no NVIDIA GPU or driver".into(),
    }
}

pub fn driver_version() -> Option<String> {
    let mut v = 0;
    // SAFETY: out-parameter; only called once the library is known to load.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    (r == sys::CUresult::CUDA_SUCCESS).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(no_driver());
    }
    let n = CudaContext::device_count().map_err(|e| FdppError::BackendUnavailable {
        backend: "cuda",
        reason: format!("the CUDA driver found no usable device ({e:?})"),
    })?;
    Ok(n.max(0) as usize)
}

pub fn device_info(ctx: &CudaContext) -> Result<DeviceInfo> {
    let err = |e: cudarc::driver::DriverError| FdppError::device("cuda", format!("device query failed: {e:?}"));
    let name = ctx.name().map_err(err)?;
    let (major, minor) = ctx.compute_capability().map_err(err)?;
    let attr = |a| ctx.attribute(a).map_err(err);
    let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let l2 = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
    Ok(DeviceInfo {
        backend: BackendKind::Cuda,
        ordinal: ctx.ordinal(),
        slug: slugify(&name),
        name,
        arch: jit::arch_for_cc(major, minor),
        compute_units: sms as u32,
        memory_bytes: ctx.total_mem().map_err(err)? as u64,
        l2_bytes: l2 as u64,
        driver_version: driver_version(),
        runtime_version: jit::nvrtc_version().map(|v| format!("nvrtc {v}")),
    })
}

pub fn probe() -> BackendStatus {
    let mut st = BackendStatus {
        backend: BackendKind::Cuda,
        available: false,
        reason: None,
        devices: vec![],
    };
    match device_count() {
        Err(e) => st.reason = Some(reason_of(e)),
        Ok(0) => st.reason = Some("the CUDA driver reports no devices".into()),
        Ok(n) => {
            for i in 0..n {
                match CudaContext::new(i)
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|c| device_info(&c).map_err(|e| e.to_string()))
                {
                    Ok(d) => st.devices.push(d),
                    Err(e) => st.reason = Some(format!("device {i}: {e}")),
                }
            }
            st.available = !st.devices.is_empty();
            if st.available && !jit::nvrtc_present() {
                st.reason = Some("NVRTC (libnvrtc.so) not found: fdpp kernels cannot be compiled".into());
                st.available = false;
            }
        }
    }
    st
}

fn reason_of(e: FdppError) -> String {
    match e {
        FdppError::BackendUnavailable { reason, .. } => reason,
        other => other.to_string(),
    }
}
