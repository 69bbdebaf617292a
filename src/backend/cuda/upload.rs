//! Host arrays a launch reads (block tables, positions, KV slots), copied into device memory.
//!
//! A decode step makes the same small uploads for every layer (the block tables and positions do
//! not change between layers), and a copy from pageable host memory may make the driver wait for
//! the stream: an upload whose bytes equal the slot's last ones is skipped, so a step uploads
//! each array once instead of once per layer.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::{drv, CudaBackend};
use crate::error::Result;

/// One grow-only device copy and the bytes it holds.
#[derive(Default)]
pub struct Upload {
    dev: Option<CudaSlice<u8>>,
    last: Vec<u8>,
}

impl Upload {
    /// The device address of `bytes`, copied there (in stream order, after every kernel queued
    /// before) unless the slot already holds exactly these bytes.
    pub fn put(&mut self, b: &CudaBackend, bytes: &[u8], what: &str) -> Result<u64> {
        let have = self.dev.as_ref().map_or(0, |s| s.len());
        let changed = self.last.as_slice() != bytes;
        if b.graphs.borrow().capturing() && (bytes.len() > have || (changed && !bytes.is_empty())) {
            return Err(super::graph::in_capture(&format!("uploading {what}")));
        }
        if bytes.len() > have {
            // The old copy is freed in stream order, after the kernels that read it.
            self.dev = None;
            let cap = crate::backend::layer_plan::scratch_capacity(have, bytes.len());
            // SAFETY: written by the copy below before any kernel reads it.
            self.dev = Some(unsafe { b.stream().alloc::<u8>(cap) }.map_err(drv(&format!("allocating {what}")))?);
            self.last.clear();
        }
        let Some(dev) = self.dev.as_mut() else {
            return Err(crate::FdppError::device("cuda", format!("{what}: upload slot missing")));
        };
        if !bytes.is_empty() && changed {
            b.stream()
                .memcpy_htod(bytes, &mut dev.slice_mut(..bytes.len()))
                .map_err(drv(&format!("uploading {what}")))?;
            self.last.clear();
            self.last.extend_from_slice(bytes);
        }
        let (p, _sync) = dev.device_ptr(b.stream());
        Ok(p)
    }
}

/// The bytes of an i32 array, as the kernels read them (little-endian, like the device).
pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
