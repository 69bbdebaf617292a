//! A decoder-only architecture as data: what the forward pass ([`crate::engine::forward`]) and
//! the weight maps ([`crate::model::family`]) read instead of branching on the model's name.
//!
//! One [`Arch`] is derived from a [`ModelConfig`] plus the [`HfExtras`] of its config.json. A
//! preset has no extras, so every field a family's config may omit takes the default of that
//! family's HF config class (OPT: ReLU, biases, learned positions; ChatGLM2: RMSNorm, rotary on
//! half of each head, no bias on O and the MLP).

use super::config::{ModelArch, ModelConfig, RopeScaling};
use super::hf::HfExtras;
use crate::engine::rope;
use crate::error::{FdppError, Result};
use crate::ops::layer::{Activation, RopeLayout};

/// The families the forward pass runs, by the `ModelArch` their config names.
pub const SUPPORTED_ARCHS: [ModelArch; 5] = ModelArch::ALL;

/// How a layer normalizes its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// x / rms(x) · γ (Llama, ChatGLM2).
    Rms,
    /// (x − mean) / std · γ + β (OPT).
    Layer,
}

/// How a token's position enters the model.
#[derive(Clone, Debug, PartialEq)]
pub enum Positions {
    /// Rotary embedding of the first `rotary_dim` elements of every q and k head (the whole head
    /// for Llama, half of it for ChatGLM2), pairs joined as `layout` says.
    Rotary {
        rotary_dim: usize,
        layout: RopeLayout,
        theta: f64,
        scaling: Option<RopeScaling>,
    },
    /// A learned table added to the token embedding: row `position + offset` of `rows` (OPT keeps
    /// two rows before position 0, a leftover of fairseq's padding).
    Learned { offset: usize, rows: usize },
}

/// The MLP of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mlp {
    /// act(gate) · up with gate and up fused into one FFN1 of 2·inter rows, gate first
    /// (SwiGLU with SiLU: Llama, ChatGLM2).
    Gated(Activation),
    /// act(fc1 x) then fc2 (OPT with ReLU).
    Plain(Activation),
}

impl Mlp {
    pub fn activation(self) -> Activation {
        match self {
            Mlp::Gated(a) | Mlp::Plain(a) => a,
        }
    }
}

/// Everything the forward pass needs to know about a model beyond its weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Arch {
    pub family: ModelArch,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The MLP's inner width (one half of a gated FFN1).
    pub inter: usize,
    pub vocab: usize,
    pub norm: NormKind,
    pub eps: f64,
    pub positions: Positions,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp: Mlp,
    /// Bias on FFN1 and FFN2.
    pub ffn_bias: bool,
    pub tied_embeddings: bool,
    /// Width of the token embedding and of the LM head's input: `hidden` unless the model
    /// projects between them (OPT's word_embed_proj_dim: project_in, project_out).
    pub embed_dim: usize,
}

impl Arch {
    /// The description of `cfg`, or an error naming what the forward pass cannot run: an
    /// unsupported family (with the config field that named it), a config setting listed in
    /// `extras.unsupported`, or a rotary width the layout cannot split.
    pub fn of(cfg: &ModelConfig, extras: &HfExtras) -> Result<Arch> {
        let refuse = |what: String| FdppError::Unsupported {
            spec: format!("the engine (model '{}', architecture '{}')", cfg.name, cfg.arch),
            what,
        };
        if !SUPPORTED_ARCHS.contains(&cfg.arch) {
            return Err(refuse(format!(
                "model_type '{}' (from the config's architectures / model_type fields); it runs {}",
                cfg.arch,
                SUPPORTED_ARCHS.map(ModelArch::name).join(", ")
            )));
        }
        if let Some((field, value)) = extras.unsupported.first() {
            return Err(refuse(format!(
                "config field '{field}' = {value}: the {} forward pass runs only the variant of the \
                 published checkpoints{}",
                cfg.arch,
                if cfg.arch == ModelArch::Opt && field == "do_layer_norm_before" {
                    " (pre-LayerNorm; OPT-350m's post-LayerNorm is not run)"
                } else {
                    ""
                }
            )));
        }
        cfg.validate()?;
        let rotary = |rotary_dim: usize, layout| Positions::Rotary {
            rotary_dim,
            layout,
            theta: cfg.rope_theta,
            scaling: extras.rope_scaling,
        };
        let base = Arch {
            family: cfg.arch,
            hidden: cfg.hidden_size,
            layers: cfg.num_layers,
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            inter: cfg.intermediate_size,
            vocab: cfg.vocab_size,
            norm: NormKind::Rms,
            eps: cfg.rms_norm_eps,
            positions: rotary(cfg.head_dim, RopeLayout::Half),
            qkv_bias: cfg.qkv_bias,
            o_bias: false,
            mlp: Mlp::Gated(extras.hidden_act.unwrap_or(Activation::Silu)),
            ffn_bias: false,
            tied_embeddings: cfg.tie_word_embeddings,
            embed_dim: cfg.hidden_size,
        };
        let arch = match cfg.arch {
            // LlamaAttention puts `attention_bias` on o_proj as well; Qwen2 biases q/k/v only.
            ModelArch::Llama => Arch {
                o_bias: cfg.qkv_bias,
                ..base
            },
            ModelArch::Mistral | ModelArch::Qwen2 => base,
            ModelArch::Opt => {
                let bias = extras.linear_bias.unwrap_or(true);
                Arch {
                    norm: NormKind::Layer,
                    positions: Positions::Learned {
                        offset: OPT_POSITION_OFFSET,
                        rows: cfg.max_position_embeddings + OPT_POSITION_OFFSET,
                    },
                    o_bias: bias,
                    mlp: Mlp::Plain(extras.hidden_act.unwrap_or(Activation::Relu)),
                    ffn_bias: bias,
                    embed_dim: extras.embed_proj_dim.unwrap_or(cfg.hidden_size),
                    ..base
                }
            }
            ModelArch::ChatGlm => {
                let bias = extras.linear_bias.unwrap_or(false);
                Arch {
                    // ChatGLM2 rotates the first kv_channels / 2 elements of each head.
                    positions: rotary(cfg.head_dim / 2, RopeLayout::Interleaved),
                    o_bias: bias,
                    ffn_bias: bias,
                    ..base
                }
            }
        };
        if let Positions::Rotary { rotary_dim, .. } = arch.positions {
            if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
                return Err(refuse(format!(
                    "rotary over {rotary_dim} of the {} elements of a head: it must be a positive \
                     even number (head_dim / kv_channels)",
                    cfg.head_dim
                )));
            }
        }
        if arch.embed_dim == 0 {
            return Err(refuse("word_embed_proj_dim is 0".into()));
        }
        Ok(arch)
    }

    /// The description a preset (no config.json extras) runs with.
    pub fn from_config(cfg: &ModelConfig) -> Result<Arch> {
        Arch::of(cfg, &HfExtras::default())
    }

    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Rows of the fused QKV weight.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// Rows of FFN1: gate and up for a gated MLP, fc1 alone otherwise.
    pub fn ffn1_width(&self) -> usize {
        match self.mlp {
            Mlp::Gated(_) => 2 * self.inter,
            Mlp::Plain(_) => self.inter,
        }
    }

    /// The model projects its embedding to and from the hidden size.
    pub fn projects_embedding(&self) -> bool {
        self.embed_dim != self.hidden
    }

    /// The rotary inverse frequencies (rotary_dim / 2 of them; none for learned positions).
    pub fn inv_freq(&self) -> Vec<f32> {
        match &self.positions {
            Positions::Rotary {
                rotary_dim,
                theta,
                scaling,
                ..
            } => rope::inv_freq(*rotary_dim, *theta, scaling.as_ref()),
            Positions::Learned { .. } => Vec::new(),
        }
    }

    pub fn rope_layout(&self) -> RopeLayout {
        match self.positions {
            Positions::Rotary { layout, .. } => layout,
            Positions::Learned { .. } => RopeLayout::Half,
        }
    }

    /// Whether the fused decode layer of FlashDecoding++'s GEMV epilogues applies: RMSNorm (its
    /// γ folds into the next GEMM), a SiLU-gated MLP (`gemm_rms_glu`), and no bias after O or
    /// FFN2 (their outputs go straight into the residual in `gemm_residual_out`).
    pub fn fusable(&self) -> bool {
        self.norm == NormKind::Rms && self.mlp == Mlp::Gated(Activation::Silu) && !self.o_bias && !self.ffn_bias
    }

    /// One line for the user: `opt: LayerNorm, learned positions (+2), relu MLP, biases on qkv/o/ffn`.
    pub fn summary(&self) -> String {
        let pos = match &self.positions {
            Positions::Rotary { rotary_dim, layout, .. } => {
                format!("rotary over {rotary_dim}/{} ({layout:?})", self.head_dim)
            }
            Positions::Learned { offset, .. } => format!("learned positions (+{offset})"),
        };
        let mlp = match self.mlp {
            Mlp::Gated(a) => format!("gated {} MLP", a.name()),
            Mlp::Plain(a) => format!("{} MLP", a.name()),
        };
        let biases: Vec<&str> = [(self.qkv_bias, "qkv"), (self.o_bias, "o"), (self.ffn_bias, "ffn")]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect();
        format!(
            "{}: {:?}Norm, {pos}, {} heads / {} kv heads × {}, {mlp}, biases on [{}], {} embeddings{}",
            self.family,
            self.norm,
            self.heads,
            self.kv_heads,
            self.head_dim,
            biases.join(", "),
            if self.tied_embeddings { "tied" } else { "untied" },
            if self.projects_embedding() {
                format!(", embedding projected {} ↔ {}", self.embed_dim, self.hidden)
            } else {
                String::new()
            }
        )
    }
}

/// Rows of OPT's learned position table before position 0.
pub const OPT_POSITION_OFFSET: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    #[test]
    fn presets_describe_their_families() {
        let llama = Arch::from_config(&preset("llama2-7b").expect("preset")).expect("llama");
        assert!(llama.fusable());
        assert_eq!(llama.inv_freq().len(), 64);
        assert_eq!(llama.ffn1_width(), 2 * 11008);

        let opt = Arch::from_config(&preset("opt-6.7b").expect("preset")).expect("opt");
        assert_eq!(opt.norm, NormKind::Layer);
        assert_eq!(opt.mlp, Mlp::Plain(Activation::Relu));
        assert!(opt.o_bias && opt.ffn_bias && opt.qkv_bias && opt.tied_embeddings);
        assert_eq!(opt.positions, Positions::Learned { offset: 2, rows: 2050 });
        assert!(opt.inv_freq().is_empty() && !opt.fusable());
        assert_eq!(opt.ffn1_width(), 16384);

        let glm = Arch::from_config(&preset("chatglm2-6b").expect("preset")).expect("glm");
        assert_eq!(glm.rope_layout(), RopeLayout::Interleaved);
        // kv_channels 128: rotary over 64 elements, 32 frequencies 10000^(-2i/64).
        let f = glm.inv_freq();
        assert_eq!(f.len(), 32);
        assert!((f[1] as f64 - 10000f64.powf(-2.0 / 64.0)).abs() < 1e-7);
        assert!(glm.fusable() && !glm.o_bias);
    }

    #[test]
    fn unsupported_settings_name_their_field() {
        let cfg = preset("opt-6.7b").expect("preset");
        let extras = HfExtras {
            unsupported: vec![("do_layer_norm_before".into(), "false".into())],
            ..HfExtras::default()
        };
        let msg = Arch::of(&cfg, &extras).expect_err("post-LN").to_string();
        assert!(
            msg.contains("do_layer_norm_before") && msg.contains("post-LayerNorm"),
            "{msg}"
        );
    }
}
