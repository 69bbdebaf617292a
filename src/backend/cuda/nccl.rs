//! NCCL for the CUDA backend's ranks (issue #22 item 2): the library and the communicator are
//! [`crate::tp::ccl`]'s (shared with RCCL on ROCm); this module binds a rank to its CUDA device
//! and stream.
//!
//! The decode graph captures layers 1..'s all-reduces with their kernels (NCCL supports stream
//! capture, and the backend's capture mode is thread-local, so ranks capture at the same time);
//! `--set tp_graphs=0` (FDPP_TP_GRAPHS=0) runs the collectives eagerly with graphs off. On by
//! default since session 14, after 4 × H200 gave --tp 1's tokens with it at 2 and 4 ranks and
//! every run exited cleanly (reports/NOTES.md).

use std::ffi::c_void;
use std::sync::Arc;

use super::{CudaBackend, CudaBuffer};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::tp::ccl::{CclBackend, CclRank, Group, Nccl, UniqueId};

impl CclBackend for CudaBackend {
    fn ccl_ptr(&self, buf: &CudaBuffer) -> *mut c_void {
        self.ptr(buf) as *mut c_void
    }

    fn ccl_stream(&self) -> *mut c_void {
        self.stream.cu_stream() as *mut c_void
    }
}

/// Join the group of `id` as `rank` of `world` on `b`'s device. Every rank must call this at the
/// same time (it returns when all have joined). `gate` is this rank's end of a host group of the
/// same ranks: `b`'s decode-graph captures are fenced by it ([`super::graph`]'s `fenced`).
pub fn init_rank(
    nccl: Arc<Nccl>,
    group: Arc<Group>,
    b: &CudaBackend,
    id: UniqueId,
    (rank, world): (usize, usize),
    gate: crate::tp::HostComm,
) -> Result<CclRank> {
    // NCCL takes the device from the calling thread's current context.
    b.ctx.bind_to_thread().map_err(super::drv("cuCtxSetCurrent"))?;
    let comm = CclRank::init(nccl, group, id, (rank, world))?;
    b.graphs.borrow_mut().fence = Some(Box::new(move || {
        gate.all_reduce_bits(DType::F16, &mut [0])
            .map_err(|e| FdppError::device("cuda", format!("fence of a tensor-parallel graph capture: {e}")))
    }));
    Ok(comm)
}
