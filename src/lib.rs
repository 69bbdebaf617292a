//! fdpp: benchmark and autotune the kernels of LLM inference (FlashDecoding++), keep what was
//! learned in a tuning profile, and run prefill/decode with it.

pub mod backend;
pub mod bench;
pub mod check;
pub mod cli;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod interrupt;
pub mod kv;
pub mod model;
pub mod ops;
pub mod profile;
pub mod provenance;
pub mod reference;
pub mod report;
pub mod run_config;
pub mod select;
pub mod tp;
pub mod tune;

pub use error::{FdppError, Result};

/// The version written into profiles and report rows.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
