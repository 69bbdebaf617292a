//! Which GEMM runs each linear op of a step: the four layer shapes through
//! [`crate::select::select_or`] with the profile (FlashDecoding++ §4's heuristic dataflow), and
//! the LM head through its profile entry when the profile has its [K, N]; what the profile does
//! not cover follows the planner's [`Fallback`] (the engine sets the backend's built-in rule).

use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::{LinearKind, LinearShape, ModelConfig, ModelShapes};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::profile::Profile;
use crate::select::{select_in, select_or, Fallback, Plan};

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
    fallback: Fallback,
}

impl LinearPlanner {
    pub fn new(cfg: &ModelConfig, dtype: DType, profile: Option<Profile>) -> Self {
        LinearPlanner {
            profile,
            shapes: ModelShapes::of(cfg),
            lm_head: (cfg.hidden_size, cfg.vocab_size),
            dtype,
            fallback: Fallback::Vendor,
        }
    }

    /// What runs the ops the profile does not cover (the vendor GEMM unless set).
    pub fn with_fallback(mut self, fallback: Fallback) -> Self {
        self.fallback = fallback;
        self
    }

    /// The LM head's N when a rank holds a slice of the vocabulary (tensor parallelism), so
    /// that a per-rank profile's entry for that shape is the one looked up.
    pub fn set_lm_head_cols(&mut self, n: usize) {
        self.lm_head.1 = n;
    }

    pub fn fallback(&self) -> Fallback {
        self.fallback
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
            Linear::Layer(kind) => select_or(&self.shape(kind), m, self.profile.as_ref(), self.fallback),
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
                    (None, None) => self.fallback.plan(
                        m,
                        &format!(
                            "lm_head [K={k},N={n}] is not in {}",
                            if self.profile.is_some() {
                                "the profile"
                            } else {
                                "a profile (no profile)"
                            }
                        ),
                    ),
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

/// y = x · Wᵀ with `spec`; an implementation the backend lacks for this shape falls back to
/// its GEMM.
pub fn gemm_or_fallback<B: Backend>(
    b: &B,
    spec: &GemmSpec,
    dims: GemmDims,
    x: &B::Buffer,
    w: &B::Buffer,
    y: &mut B::Buffer,
) -> Result<()> {
    match b.gemm(spec, dims, x, w, y) {
        Err(FdppError::Unsupported { .. }) if spec.imp != GemmImpl::Gemm => {
            b.gemm(&GemmSpec::new(GemmImpl::Gemm, spec.dtype), dims, x, w, y)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;
    use crate::ops::gemm::GemmImpl;

    #[test]
    fn without_a_profile_every_op_is_the_vendor_gemm() {
        let cfg = preset("llama2-7b").expect("preset");
        let p = LinearPlanner::new(&cfg, DType::F16, None);
        let s = p.step(1, 1);
        for spec in [s.qkv, s.o, s.ffn1, s.ffn2, s.lm_head] {
            assert_eq!(spec.imp, GemmImpl::Gemm);
        }
        assert!(p
            .plan(Linear::LmHead, 4)
            .reason
            .contains("is not in a profile (no profile)"));
        assert_eq!(p.describe(8).len(), 5);
        assert_eq!(
            p.summary(1),
            "qkv=gemm_f16 o=gemm_f16 ffn1=gemm_f16 ffn2=gemm_f16 lm_head=gemm_f16"
        );
    }

    #[test]
    fn without_a_profile_the_backends_built_in_rule_runs_and_says_so() {
        use crate::backend::BackendKind;
        use crate::select::{CPU_GEMV_MAX_M, CUDA_GEMV_MAX_M};
        let cfg = preset("llama2-7b").expect("preset");
        let cpu = LinearPlanner::new(&cfg, DType::F16, None).with_fallback(Fallback::Builtin(BackendKind::Cpu));
        for (m, imp) in [
            (1, GemmImpl::Gemv),
            (CPU_GEMV_MAX_M, GemmImpl::Gemv),
            (CPU_GEMV_MAX_M + 1, GemmImpl::Gemm),
            (512, GemmImpl::Gemm),
        ] {
            let s = cpu.step(m, m);
            for spec in [s.qkv, s.o, s.ffn1, s.ffn2, s.lm_head] {
                assert_eq!(spec.imp, imp, "M={m}");
            }
        }
        let why = cpu.plan(Linear::Layer(LinearKind::O), 1).reason;
        assert!(
            why.starts_with("no profile: built-in rule for the CPU (gemv for M ≤"),
            "{why}"
        );
        assert!(cpu.plan(Linear::LmHead, 1).reason.contains("built-in rule"));
        assert!(cpu.describe(1).iter().all(|l| l.contains("built-in rule")));
        let cuda = LinearPlanner::new(&cfg, DType::F16, None).with_fallback(Fallback::Builtin(BackendKind::Cuda));
        assert_eq!(cuda.step(CUDA_GEMV_MAX_M, 1).qkv.imp, GemmImpl::Gemv);
        assert_eq!(cuda.step(CUDA_GEMV_MAX_M + 1, 1).qkv.imp, GemmImpl::Gemm);
        let rocm = LinearPlanner::new(&cfg, DType::F16, None).with_fallback(Fallback::Builtin(BackendKind::Rocm));
        assert_eq!(rocm.step(1, 1).qkv.imp, GemmImpl::Gemm);
        // A profile's own entries win over the rule; the shapes it lacks follow the rule.
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/nvidia-h100-80gb-hbm3/llama2-7b.json");
        let mut profile = Profile::load(&path).expect("the committed llama2-7b profile");
        profile.shapes.retain(|s| s.kind != LinearKind::Ffn2);
        let p = LinearPlanner::new(&cfg, DType::F16, Some(profile)).with_fallback(Fallback::Builtin(BackendKind::Cpu));
        let ffn2 = p.plan(Linear::Layer(LinearKind::Ffn2), 1);
        assert_eq!(ffn2.imp, GemmImpl::Gemv);
        assert!(ffn2.reason.starts_with("no profile entry for ffn2"), "{}", ffn2.reason);
        assert!(!p.plan(Linear::Layer(LinearKind::O), 1).reason.contains("built-in"));
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
