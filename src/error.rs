//! The library's error type. Every message names what failed (file, shape, kernel spec) and,
//! where there is one, what the user can do about it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FdppError {
    #[error("unknown model preset '{name}'; known presets: {known}")]
    UnknownPreset { name: String, known: String },

    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },

    #[error("invalid model '{model}': {msg}")]
    InvalidModel { model: String, msg: String },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },

    #[error("profile {path}: {msg}")]
    Profile { path: PathBuf, msg: String },

    #[error("{backend} backend unavailable: {reason}")]
    BackendUnavailable { backend: &'static str, reason: String },

    #[error("{backend}: {msg}")]
    Device { backend: &'static str, msg: String },

    #[error("kernel {spec}: compile failed for {arch}:\n{log}")]
    Compile { spec: String, arch: String, log: String },

    #[error("{spec} does not support {what}")]
    Unsupported { spec: String, what: String },

    #[error("shape mismatch in {what}: expected {expected}, found {found}")]
    Shape {
        what: String,
        expected: String,
        found: String,
    },

    #[error("out of KV pages: {needed} needed, {free} of {total} free; shorten the sequences, lower the batch or give the cache more pages")]
    OutOfKvPages { needed: usize, free: usize, total: usize },

    #[error("{spec} at {shape}: wrong result (NMSE {nmse:.3e} > {limit:.1e})")]
    WrongResult {
        spec: String,
        shape: String,
        nmse: f64,
        limit: f64,
    },

    #[error("{spec} at {shape}: wrote outside its output ({what})")]
    WroteOutside { spec: String, shape: String, what: String },

    /// A collective of tensor parallelism failed, timed out, or stopped because another rank
    /// failed ([`crate::tp`]).
    #[error("tensor parallelism, rank {rank}: {msg}")]
    Collective { rank: usize, msg: String },

    /// Ctrl-C during a long sweep ([`crate::interrupt`]).
    #[error("interrupted (Ctrl-C) during {0}; nothing was written")]
    Interrupted(String),
}

pub type Result<T, E = FdppError> = std::result::Result<T, E>;

impl FdppError {
    pub fn io(path: impl Into<PathBuf>, err: impl std::fmt::Display) -> Self {
        FdppError::Io {
            path: path.into(),
            msg: err.to_string(),
        }
    }
    pub fn device(backend: &'static str, msg: impl std::fmt::Display) -> Self {
        FdppError::Device {
            backend,
            msg: msg.to_string(),
        }
    }
}
