//! GGUF files (llama.cpp / Ollama): a model in one file — the description in metadata, the
//! tokenizer's vocabulary, and the tensors, often quantized.
//!
//! [`open`] reads everything fdpp needs from one path: the [`ModelConfig`] and [`HfExtras`], a
//! [`TensorSource`](crate::model::weights::TensorSource) that serves the tensors under HF names
//! and shapes, dequantized to the compute dtype as they are loaded (the file stays
//! memory-mapped), the tokenizer and the chat template.
//!
//! - `file`: the container (header, metadata, tensor infos), every extent checked.
//! - `value`: metadata values. `quant`: ggml types and dequantization.
//! - `names`: GGUF → HF names and the Q/K row order. `store`: the tensor source.
//! - `config`: metadata → model description. `tokenizer`: vocabulary → tokenizer.

pub mod config;
pub mod file;
pub mod names;
pub mod quant;
pub mod store;
pub mod tokenizer;
pub mod value;

use std::path::Path;

pub use file::{GgufFile, Header, TensorInfo};
pub use quant::GgmlType;
pub use store::GgufStore;
pub use value::{MetaValue, Metadata};

use crate::error::Result;
use crate::model::config::{ModelArch, ModelConfig};
use crate::model::hf::HfExtras;
use crate::model::tokenizer::Tokenizer;

/// Everything a GGUF file gives the engine.
pub struct GgufModel {
    pub cfg: ModelConfig,
    pub extras: HfExtras,
    /// The tensors under HF names (`model.layers.N.self_attn.q_proj.weight`, [out, in]).
    pub store: GgufStore,
    pub tokenizer: Tokenizer,
    /// `tokenizer.chat_template` (Jinja), for `--chat`.
    pub chat_template: Option<String>,
}

/// Whether a `--model` argument names a GGUF file (by its extension; the magic is checked when
/// it is opened).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Open a GGUF model: parse and check the file, read the model description and the tokenizer.
/// No tensor is dequantized here; [`GgufStore`] does that per tensor on `load`.
pub fn open(path: &Path) -> Result<GgufModel> {
    let file = GgufFile::open(path)?;
    let (cfg, extras) = config::model_config(&file)?;
    let inner = tokenizer::build(&file)?;
    let tokenizer = Tokenizer::from_tokenizer(inner, path);
    let chat_template = config::chat_template(&file);
    // llama.cpp interleaves Q and K rows for the `llama` architecture only.
    let permute = cfg.arch == ModelArch::Llama;
    let store = GgufStore::new(file, permute, cfg.num_heads, cfg.num_kv_heads)?;
    Ok(GgufModel {
        cfg,
        extras,
        store,
        tokenizer,
        chat_template,
    })
}
