//! Tensor parallelism (issue #22): one model over several devices, Megatron-LM style.
//!
//! - [`split`]: what each rank keeps (heads, KV heads, intermediate slice) and the per-rank
//!   config the engine runs; every `--tp` the model cannot take is refused there.
//! - [`source`]: a rank's slices of a checkpoint under the checkpoint's own names.
//! - [`comm`]: the collectives a rank needs; [`host`]: ranks as threads of one process (the
//!   CPU backend, CI); NCCL on CUDA lives in `backend/cuda/nccl.rs`.
//! - [`ranks`]: one thread per rank, each with its own backend, every rank stopped by the
//!   first failure; [`fault`]: a rank made to fail, to check that.
//!
//! The engine ([`crate::engine::forward`]) all-reduces the O and FFN2 outputs (their biases on
//! rank 0 only) before the residual add. The LM head is split by vocabulary and its logits
//! all-gathered (or, where the ranks do not divide the vocabulary, replicated with rank 0's
//! logits broadcast), so every rank feeds the same tokens to the next step. The embedding
//! stays whole on every rank: a lookup reads one row per token, so splitting it would save
//! memory (1/T of vocab × hidden) at the cost of one more all-reduce per step.

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
