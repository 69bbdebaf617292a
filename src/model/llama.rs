//! The old home of [`ModelSpec`] (when the engine ran the Llama family only): these re-exports
//! keep other modules' imports compiling; new code uses [`crate::model::spec`].

pub use super::spec::{check_supported, weights_bytes, ModelSpec};
