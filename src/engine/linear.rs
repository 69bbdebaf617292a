//! Which GEMM runs each linear op of a step: the four layer shapes through
//! [`crate::select::select`] with the profile (FlashDecoding++ §4's heuristic dataflow), and the
//! LM head through its profile entry when the profile has its [K, N], else the vendor GEMM.

use crate::dtype::DType;
use crate::model::{LinearKind, LinearShape, ModelConfig, ModelShapes};
use crate::ops::gemm::{GemmImpl, GemmSpec};
use crate::profile::Profile;
use crate::select::{select, select_in, Plan};

/// The linear ops of a forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Linear {
    Layer(LinearKind),
    LmHead,
}

impl Linear {
    pub fn name(self) -> &'static str {
        match self {
            Linear::Layer(k) => k.name(),
            Linear::LmHead => "lm_head",
        }
    }
}

/// The specs of one step's GEMMs.
#[derive(Clone, Debug, PartialEq)]
pub struct StepGemms {
    pub m: usize,
    pub qkv: GemmSpec,
    pub o: GemmSpec,
    pub ffn1: GemmSpec,
    pub ffn2: GemmSpec,
    /// The LM head runs at M = the rows whose logits are wanted.
    pub lm_head_m: usize,
    pub lm_head: GemmSpec,
}

pub struct LinearPlanner {
    profile: Option<Profile>,
    shapes: ModelShapes,
    lm_head: (usize, usize),
    dtype: DType,
}

impl LinearPlanner {
    pub fn new(cfg: &ModelConfig, dtype: DType, profile: Option<Profile>) -> Self {
        LinearPlanner {
            profile,
            shapes: ModelShapes::of(cfg),
            lm_head: (cfg.hidden_size, cfg.vocab_size),
            dtype,
        }
    }

    pub fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    fn shape(&self, kind: LinearKind) -> LinearShape {
        self.shapes
            .get(kind)
            .copied()
            .unwrap_or(LinearShape { kind, k: 0, n: 0 })
    }

    /// The plan (with its reason) for one op at M rows.
    pub fn plan(&self, op: Linear, m: usize) -> Plan {
        match op {
            Linear::Layer(kind) => select(&self.shape(kind), m, self.profile.as_ref()),
            Linear::LmHead => {
                let (k, n) = self.lm_head;
                let entry = self
                    .profile
                    .as_ref()
                    .and_then(|p| p.shapes.iter().find(|s| s.k == k && s.n == n));
                // Without its own entry the LM head takes the choice of the widest profiled
                // shape with its K (FFN1 in the Llama family): at decode M the weight stream
                // decides, as it does for FFN1 (N = 22016 against the LM head's 32000).
                let widest = || {
                    self.profile
                        .as_ref()?
                        .shapes
                        .iter()
                        .filter(|s| s.k == k)
                        .max_by_key(|s| s.n)
                };
                match (entry, widest()) {
                    (Some(sp), _) => select_in(sp, m),
                    (None, Some(sp)) => {
                        let plan = select_in(sp, m);
                        Plan {
                            reason: format!(
                                "lm_head [K={k},N={n}] is not in the profile: the choice of [K={},N={}] ({})",
                                sp.k, sp.n, plan.reason
                            ),
                            ..plan
                        }
                    }
                    (None, None) => Plan {
                        imp: GemmImpl::Gemm,
                        block_n: None,
                        stages: None,
                        reason: format!("lm_head [K={k},N={n}] is not in the profile: vendor gemm"),
                    },
                }
            }
        }
    }

    pub fn step(&self, m: usize, lm_head_m: usize) -> StepGemms {
        let spec = |op, m| self.plan(op, m).spec(self.dtype);
        StepGemms {
            m,
            qkv: spec(Linear::Layer(LinearKind::Qkv), m),
            o: spec(Linear::Layer(LinearKind::O), m),
            ffn1: spec(Linear::Layer(LinearKind::Ffn1), m),
            ffn2: spec(Linear::Layer(LinearKind::Ffn2), m),
            lm_head_m,
            lm_head: spec(Linear::LmHead, lm_head_m),
        }
    }

    /// The specs at M rows on one line: `qkv=gemv_f16 o=gemv_f16 … lm_head=gemm_f16`.
    pub fn summary(&self, m: usize) -> String {
        LinearKind::ALL
            .into_iter()
            .map(Linear::Layer)
            .chain([Linear::LmHead])
            .map(|op| format!("{}={}", op.name(), self.plan(op, m).spec(self.dtype)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// One line per op at M rows, with the reason for its choice.
    pub fn describe(&self, m: usize) -> Vec<String> {
        LinearKind::ALL
            .into_iter()
            .map(Linear::Layer)
            .chain([Linear::LmHead])
            .map(|op| {
                let p = self.plan(op, m);
                format!("  {} at M={m}: {} ({})", op.name(), p.spec(self.dtype), p.reason)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    #[test]
    fn without_a_profile_every_op_is_the_vendor_gemm() {
        let cfg = preset("llama2-7b").expect("preset");
        let p = LinearPlanner::new(&cfg, DType::F16, None);
        let s = p.step(1, 1);
        for spec in [s.qkv, s.o, s.ffn1, s.ffn2, s.lm_head] {
            assert_eq!(spec.imp, GemmImpl::Gemm);
        }
        assert!(p.plan(Linear::LmHead, 4).reason.contains("not in the profile"));
        assert_eq!(p.describe(8).len(), 5);
        assert_eq!(
            p.summary(1),
            "qkv=gemm_f16 o=gemm_f16 ffn1=gemm_f16 ffn2=gemm_f16 lm_head=gemm_f16"
        );
    }

    #[test]
    fn the_lm_head_takes_the_widest_profiled_shape_of_its_k() {
        let cfg = preset("llama2-7b").expect("preset");
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/nvidia-h100-80gb-hbm3/llama2-7b.json");
        let profile = Profile::load(&path).expect("the committed llama2-7b profile");
        let p = LinearPlanner::new(&cfg, DType::F16, Some(profile));
        for m in [1, 4, 16, 64, 512] {
            let (head, ffn1) = (p.plan(Linear::LmHead, m), p.plan(Linear::Layer(LinearKind::Ffn1), m));
            assert_eq!(head.spec(DType::F16), ffn1.spec(DType::F16), "M={m}");
            assert!(
                head.reason.contains("the choice of [K=4096,N=22016]"),
                "{}",
                head.reason
            );
        }
    }
}
