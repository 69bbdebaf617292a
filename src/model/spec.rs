//! What `--model` names (a preset or an HF directory) and the checks that it can run.

use std::path::{Path, PathBuf};

use super::arch::Arch;
use super::config::ModelConfig;
use super::family;
use super::hf::{self, HfExtras};
use super::presets;
use super::shapes::ModelShapes;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::attention::AttnGeometry;

/// What `--model` names: the config, what the engine reads beside it, and the directory (None
/// for a preset, which has neither weights nor a tokenizer).
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub cfg: ModelConfig,
    pub extras: HfExtras,
    pub dir: Option<PathBuf>,
    /// A GGUF file holding the description, the tokenizer and the weights (then `dir` is None).
    pub gguf: Option<PathBuf>,
}

impl ModelSpec {
    /// A preset name, an HF directory, an HF config.json (its directory holds the weights), or
    /// a GGUF file.
    pub fn resolve(arg: &str) -> Result<ModelSpec> {
        let path = Path::new(arg);
        if super::gguf::is_gguf_path(path) && path.is_file() {
            let file = super::gguf::GgufFile::open(path)?;
            let (cfg, extras) = super::gguf::config::model_config(&file)?;
            return Ok(ModelSpec {
                cfg,
                extras,
                dir: None,
                gguf: Some(path.to_path_buf()),
            });
        }
        let cfg = ModelConfig::resolve(arg)?;
        if presets::PRESET_NAMES.contains(&arg) || !path.exists() {
            return Ok(ModelSpec {
                cfg,
                extras: HfExtras::default(),
                dir: None,
                gguf: None,
            });
        }
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("config.json"))
        } else {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            (dir.to_path_buf(), path.to_path_buf())
        };
        let text = std::fs::read_to_string(&file).map_err(|e| FdppError::io(&file, e))?;
        let mut extras = hf::parse_extras(&text, &file)?;
        let gen = dir.join("generation_config.json");
        if gen.is_file() {
            let text = std::fs::read_to_string(&gen).map_err(|e| FdppError::io(&gen, e))?;
            for id in hf::parse_generation_eos(&text, &gen)? {
                if !extras.eos_token_ids.contains(&id) {
                    extras.eos_token_ids.push(id);
                }
            }
        }
        Ok(ModelSpec {
            cfg,
            extras,
            dir: Some(dir),
            gguf: None,
        })
    }

    /// Where the tokenizer comes from: the directory's tokenizer.json or the GGUF vocabulary.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        match (&self.gguf, &self.dir) {
            (Some(g), _) => Some(g.clone()),
            (None, Some(d)) => super::tokenizer::Tokenizer::find(d),
            (None, None) => None,
        }
    }

    /// The tokenizer at [`tokenizer_path`](Self::tokenizer_path) (a tokenizer.json or a GGUF).
    pub fn load_tokenizer(path: &Path) -> Result<super::tokenizer::Tokenizer> {
        if super::gguf::is_gguf_path(path) {
            let file = super::gguf::GgufFile::open(path)?;
            let inner = super::gguf::tokenizer::build(&file)?;
            return Ok(super::tokenizer::Tokenizer::from_tokenizer(inner, path));
        }
        super::tokenizer::Tokenizer::load(path)
    }

    /// The model's chat template (`--chat`): the GGUF metadata's `tokenizer.chat_template`, or
    /// the HF directory's tokenizer_config.json `chat_template` (or chat_template.jinja). The
    /// BOS/EOS strings the template may use come from `tok`. A model without one is an error
    /// naming the file that was read and the flag.
    pub fn chat_template(&self, tok: Option<&super::tokenizer::Tokenizer>) -> Result<super::chat::ChatTemplate> {
        let token = |id: Option<u32>| id.and_then(|i| tok.and_then(|t| t.id_to_token(i))).unwrap_or_default();
        let (bos, eos) = (
            token(self.extras.bos_token_id),
            token(self.extras.eos_token_ids.first().copied()),
        );
        match (&self.gguf, &self.dir) {
            (Some(g), _) => {
                let file = super::gguf::GgufFile::open(g)?;
                let t = super::gguf::config::chat_template(&file);
                super::chat::ChatTemplate::from_gguf(g, t, bos, eos).ok_or_else(|| FdppError::Config {
                    path: g.clone(),
                    msg: "no chat template (metadata key 'tokenizer.chat_template' is absent or empty): --chat \
                          needs one; run without --chat and write the prompt in the model's format"
                        .into(),
                })
            }
            (None, Some(d)) => {
                let mut t = super::chat::ChatTemplate::from_hf_dir(d)?.ok_or_else(|| FdppError::Config {
                    path: d.join("tokenizer_config.json"),
                    msg: "no chat template (no field 'chat_template' here, no chat_template.jinja beside it): \
                          --chat needs one; run without --chat, or add the model's template"
                        .into(),
                })?;
                // tokenizer_config.json names its special tokens; else the ids of config.json.
                if t.bos_token.is_empty() {
                    t.bos_token = bos;
                }
                if t.eos_token.is_empty() {
                    t.eos_token = eos;
                }
                Ok(t)
            }
            (None, None) => Err(FdppError::InvalidArgument(format!(
                "--chat: '{}' is a preset, with no tokenizer and no chat template; give an HF model directory or a \
                 GGUF file",
                self.cfg.name
            ))),
        }
    }

    /// The longest sequence the model attends over correctly: max_position_embeddings, or
    /// Mistral's sliding window when smaller (the kernels attend to the whole prefix, which is
    /// the same computation only while the sequence fits in the window).
    pub fn context_len(&self) -> usize {
        let w = self.extras.sliding_window.unwrap_or(usize::MAX);
        self.cfg.max_position_embeddings.min(w)
    }

    /// The architecture the engine runs, or why it cannot ([`check_arch`]).
    pub fn arch(&self) -> Result<Arch> {
        check_arch(&self.cfg, &self.extras)
    }
}

/// Refuse what the forward pass cannot run (a preset's description: no config.json extras),
/// naming what it can.
pub fn check_supported(cfg: &ModelConfig) -> Result<()> {
    check_arch(cfg, &HfExtras::default()).map(|_| ())
}

/// The description of the model, or why the engine cannot run it: the architecture or a config
/// setting it does not run, or an attention geometry the kernels do not take.
pub fn check_arch(cfg: &ModelConfig, extras: &HfExtras) -> Result<Arch> {
    let arch = Arch::of(cfg, extras)?;
    AttnGeometry::new(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim).map_err(|e| FdppError::Unsupported {
        spec: format!("the engine (model '{}')", cfg.name),
        what: format!("its attention: {e}"),
    })?;
    Ok(arch)
}

/// Bytes of the weights in a 16-bit type (a tied LM head counted once), from a config alone;
/// a config the engine cannot describe counts the four linear shapes and the embeddings.
pub fn weights_bytes(cfg: &ModelConfig, dtype: DType) -> u64 {
    match Arch::from_config(cfg) {
        Ok(arch) => family::weights_bytes(&arch, dtype),
        Err(_) => {
            let s = ModelShapes::of(cfg);
            let heads = if cfg.tie_word_embeddings { 1 } else { 2 };
            s.weight_bytes_per_token / 2 * dtype.size_bytes() as u64
                + ((heads - 1) * cfg.vocab_size * cfg.hidden_size * dtype.size_bytes()) as u64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_runs_and_a_bad_geometry_is_named() {
        for name in presets::PRESET_NAMES {
            let cfg = presets::preset(name).expect("preset");
            check_supported(&cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let mut cfg = presets::preset("llama2-7b").expect("preset");
        cfg.head_dim = 96;
        cfg.hidden_size = 96 * 32;
        let msg = check_supported(&cfg).expect_err("head_dim 96").to_string();
        assert!(msg.contains("attention"), "{msg}");
    }
}
