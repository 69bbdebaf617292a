//! The inference engine: memory plan, forward pass over a backend, batching and sampling.

pub mod activations;
pub mod batch;
pub mod build;
pub mod forward;
pub mod kv;
pub mod linear;
pub mod memory;
pub mod op_times;
pub mod rope;
pub mod runner;
pub mod sampler;
pub mod score_stats;
pub mod step;
