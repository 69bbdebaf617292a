//! RCCL for the ROCm backend's ranks (issue #22 item 2, "RCCL the same way on ROCm"): the
//! library and the communicator are [`crate::tp::ccl`]'s, shared with NCCL (RCCL exports the
//! same API); this module binds a rank to its HIP device and stream. ROCm has no decode graphs
//! in fdpp, so the collectives always run eagerly between the layers' kernels.
//!
//! Not yet run on AMD GPUs: the machines fdpp is tested on have none. What runs without them is
//! the loading (an error naming the library, the package and FDPP_RCCL_LIB) and every piece the
//! ranks share with the CUDA path (the split, the vocabulary slices, the rank threads).

use std::ffi::c_void;
use std::sync::Arc;

use super::{RocmBackend, RocmBuffer};
use crate::error::Result;
use crate::tp::ccl::{CclBackend, CclRank, Group, Nccl, UniqueId};

impl CclBackend for RocmBackend {
    fn ccl_ptr(&self, buf: &RocmBuffer) -> *mut c_void {
        buf.ptr
    }

    fn ccl_stream(&self) -> *mut c_void {
        self.stream
    }
}

/// Join the group of `id` as `rank` of `world` on `b`'s device. Every rank must call this at the
/// same time (it returns when all have joined).
pub fn init_rank(
    nccl: Arc<Nccl>,
    group: Arc<Group>,
    b: &RocmBackend,
    id: UniqueId,
    (rank, world): (usize, usize),
) -> Result<CclRank> {
    // RCCL takes the device from the calling thread's current one; the backend made it current
    // when it opened on this thread, and this says so again in case anything changed it since.
    // SAFETY: plain call with the ordinal the backend opened.
    b.api.check(
        unsafe { (b.api.set_device)(b.dev.info.ordinal as i32) },
        "hipSetDevice before ncclCommInitRank",
    )?;
    CclRank::init(nccl, group, id, (rank, world))
}
