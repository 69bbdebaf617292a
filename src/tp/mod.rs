//! Tensor parallelism (issue #22): one model over several devices, Megatron-LM style.
//!
//! - [`split`]: what each rank keeps (heads, KV heads, intermediate slice) and the per-rank
//!   config the engine runs; every `--tp` the model cannot take is refused there.
//! - [`source`]: a rank's slices of a checkpoint under the checkpoint's own names.
//! - [`comm`]: the collectives a rank needs; [`host`]: ranks as threads of one process (the
//!   CPU backend, CI); [`ccl`]: NCCL (CUDA) and RCCL (ROCm) loaded at run time, bound to a
//!   device by `backend/cuda/nccl.rs` and `backend/rocm/rccl.rs`.
//! - [`ranks`]: one thread per rank, each with its own backend, every rank stopped by the
//!   first failure; [`fault`]: a rank made to fail, to check that.
//!
//! The engine ([`crate::engine::forward`]) sums the O and FFN2 partial products over the ranks
//! ([`Communicator::row_parallel_gemm`]: 16-bit on NCCL/RCCL, f32 in the in-process group),
//! then every rank adds the whole bias, before the residual add. The embedding and the LM head are split by
//! vocabulary: the lookup is all-reduced and the logits all-gathered (or, where the ranks do
//! not divide the vocabulary or `tp_vocab=0`, both are replicated and rank 0's logits
//! broadcast), so every rank feeds the same tokens to the next step.

pub mod ccl;
pub mod comm;
pub mod fault;
pub mod host;
pub mod ranks;
pub mod source;
pub mod split;

pub use comm::Communicator;
pub use host::HostComm;
pub use split::{check, rank_config, Split};

use crate::error::Result;
use crate::model::spec::ModelSpec;

/// The model one rank of `world` runs ([`rank_config`]); `spec` itself when world is 1.
pub fn rank_spec(spec: &ModelSpec, world: usize) -> Result<ModelSpec> {
    Ok(ModelSpec {
        cfg: rank_config(&spec.cfg, world)?,
        ..spec.clone()
    })
}
