//! What a rank needs from its peers: the two collectives of a Megatron layer (an all-reduce
//! after O and after FFN2), an all-gather (each rank's slice of the vocabulary's logits, so
//! every rank samples from the same numbers) and a broadcast (rank 0's logits, where the LM
//! head is replicated), over the backend's own buffers.

use crate::backend::Backend;
use crate::error::Result;
use crate::ops::gemm::{GemmDims, GemmSpec};

/// One rank's handle on its group. Every rank calls the same collectives in the same order;
/// a rank that fails calls [`abort`](Communicator::abort) so that the others stop with its
/// error instead of waiting for it.
pub trait Communicator<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// buf[..elems] = Σ over ranks of buf[..elems] (16-bit data summed in f32, rounded once).
    fn all_reduce_sum(&self, b: &B, buf: &mut B::Buffer, elems: usize) -> Result<()>;
    /// y[..M·N] = Σ over ranks of x · Wᵀ: a row-parallel linear (O, FFN2) and its all-reduce.
    /// By default each rank's product is rounded to y's 16-bit type and those are summed (what
    /// a 16-bit NCCL all-reduce does: twice the roundings of one device); a communicator may
    /// sum the partials wider (the in-process one sums them in f32 and rounds once).
    fn row_parallel_gemm(
        &self,
        b: &B,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &B::Buffer,
        w: &B::Buffer,
        y: &mut B::Buffer,
    ) -> Result<()> {
        crate::engine::linear::gemm_or_fallback(b, spec, dims, x, w, y)?;
        self.all_reduce_sum(b, y, dims.m * dims.n)
    }
    /// buf[..elems] = rank `root`'s buf[..elems] on every rank.
    fn broadcast(&self, b: &B, buf: &mut B::Buffer, elems: usize, root: usize) -> Result<()>;
    /// dst[r·elems..(r+1)·elems] = rank r's src[..elems], for every rank r, on every rank.
    fn all_gather(&self, b: &B, src: &B::Buffer, dst: &mut B::Buffer, elems: usize) -> Result<()>;
    /// Stop the group: every rank waiting in a collective, and every later call, returns an
    /// error naming this rank and `why`.
    fn abort(&self, why: &str);
}
