//! Model descriptions: what the engine needs to know to derive shapes and run a forward pass.

pub mod arch;
pub mod chat;
pub mod config;
pub mod family;
pub mod gguf;
pub mod hf;
pub mod llama;
pub mod presets;
pub mod shapes;
pub mod spec;
pub mod tensors;
pub mod tokenizer;
pub mod weights;

pub use config::{ModelArch, ModelConfig};
pub use shapes::{AttentionGeometry, LinearKind, LinearShape, ModelShapes};
