//! The inference engine: memory plan, forward pass over a backend, batching and sampling.

pub mod rope;
pub mod sampler;
