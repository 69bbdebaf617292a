//! y[M, N] = x[M, K] · W[N, K]ᵀ, W stored [N, K] row-major as in HF checkpoints.
//!
//! Three implementations (FlashDecoding++ §4, "heuristic dataflow"):
//! A `gemv` on CUDA cores, B `flat_gemm` on tensor cores with M padded to 8, C `gemm` (cuBLAS).

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{FdppError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum GemmImpl {
    /// ImplA: CUDA-core GEMV, each weight reused for every row of x.
    Gemv,
    /// ImplB: flat GEMM, tensor cores, M padded to 8, tiles on N and K only.
    FlatGemm,
    /// ImplC: the vendor library (cuBLAS / hipBLAS) or a cache-blocked GEMM on the CPU.
    Gemm,
}

impl GemmImpl {
    pub const ALL: [GemmImpl; 3] = [GemmImpl::Gemv, GemmImpl::FlatGemm, GemmImpl::Gemm];
    pub fn name(self) -> &'static str {
        match self {
            GemmImpl::Gemv => "gemv",
            GemmImpl::FlatGemm => "flat_gemm",
            GemmImpl::Gemm => "gemm",
        }
    }
    /// The paper's letter for it.
    pub fn letter(self) -> char {
        match self {
            GemmImpl::Gemv => 'A',
            GemmImpl::FlatGemm => 'B',
            GemmImpl::Gemm => 'C',
        }
    }
}

impl std::fmt::Display for GemmImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One runnable candidate: an implementation and its compile-time configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GemmSpec {
    pub imp: GemmImpl,
    pub dtype: DType,
    /// Tile width along N (flat_gemm; ImplC: fdpp's Hopper GEMM instead of the library, on
    /// sm_90a); rows per block (gemv). None where it does not apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_n: Option<u32>,
    /// cp.async pipeline depth (flat_gemm): 2 is the paper's double buffering; TMA stages of
    /// fdpp's Hopper GEMM (ImplC with block_n).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<u32>,
    /// ImplC on CUDA: the rank of the cuBLASLt algorithm among its heuristic's suggestions for the
    /// call's shape (0 = its first); None = cublasGemmEx's own choice. `fdpp tune` times the first
    /// [`LT_RANKS`] as candidates of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algo: Option<u32>,
}

/// How many of cuBLASLt's suggestions per shape `fdpp tune` times on CUDA. At M = 1024 and 4096
/// on Llama2-7B's and Llama-3.1-8B's linears the fastest was among the first six in every shape
/// (scripts/cublaslt_algos.cu, H100, reports/NOTES.md session 26).
pub const LT_RANKS: u32 = 6;

impl GemmSpec {
    pub fn new(imp: GemmImpl, dtype: DType) -> Self {
        GemmSpec {
            imp,
            dtype,
            block_n: None,
            stages: None,
            algo: None,
        }
    }
    pub fn with_block_n(mut self, bn: u32) -> Self {
        self.block_n = Some(bn);
        self
    }
    pub fn with_stages(mut self, stages: u32) -> Self {
        self.stages = Some(stages);
        self
    }
    pub fn with_algo(mut self, rank: u32) -> Self {
        self.algo = Some(rank);
        self
    }
    /// Whether this is fdpp's Hopper GEMM: ImplC with a tile width and a stage count (on the CPU
    /// an ImplC block_n alone is its rows per task).
    pub fn is_hopper_gemm(&self) -> bool {
        self.imp == GemmImpl::Gemm && self.block_n.is_some() && self.stages.is_some()
    }
    /// The error for a spec only the CUDA backend runs (a cuBLASLt algorithm, fdpp's Hopper GEMM)
    /// on a backend that has none.
    pub fn refuse_cuda_only(&self, backend: &str) -> Result<()> {
        let what = match self.algo {
            Some(r) => {
                format!("cuBLASLt algorithm rank {r} is a CUDA choice and the {backend} backend has no cuBLASLt")
            }
            None if self.is_hopper_gemm() => {
                format!("fdpp's Hopper GEMM is a CUDA sm_90a kernel, which the {backend} backend does not run")
            }
            None => return Ok(()),
        };
        Err(FdppError::InvalidArgument(format!(
            "{self}: {what}; use a profile tuned on this backend (fdpp tune --backend {backend})"
        )))
    }
    /// A name that carries every compile-time parameter, e.g. `flat_gemm_f16_bn64_s2`.
    pub fn uri(&self) -> String {
        let mut s = format!("{}_{}", self.imp, self.dtype);
        if let Some(bn) = self.block_n {
            s.push_str(&format!("_bn{bn}"));
        }
        if let Some(st) = self.stages {
            s.push_str(&format!("_s{st}"));
        }
        if let Some(a) = self.algo {
            s.push_str(&format!("_lt{a}"));
        }
        s
    }
}

impl std::fmt::Display for GemmSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GemmDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl GemmDims {
    pub fn new(m: usize, n: usize, k: usize) -> Result<Self> {
        if m == 0 || n == 0 || k == 0 {
            return Err(FdppError::InvalidArgument(format!(
                "GEMM with a zero dimension: M={m} N={n} K={k}"
            )));
        }
        Ok(GemmDims { m, n, k })
    }
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    /// The fewest bytes the op must move: W and x read once, y written once (16-bit types).
    pub fn min_bytes(&self) -> f64 {
        2.0 * (self.n * self.k + self.m * self.k + self.m * self.n) as f64
    }
    pub fn label(&self) -> String {
        format!("M={} N={} K={}", self.m, self.n, self.k)
    }
    /// Element counts the buffers must hold.
    pub fn check_lens(&self, spec: &GemmSpec, x: usize, w: usize, y: usize) -> Result<()> {
        let want = [
            ("x", self.m * self.k, x),
            ("w", self.n * self.k, w),
            ("y", self.m * self.n, y),
        ];
        for (name, need, have) in want {
            if have < need {
                return Err(FdppError::Shape {
                    what: format!("{spec} {name} at {}", self.label()),
                    expected: format!(">= {need} elements"),
                    found: have.to_string(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cublaslt_rank_is_part_of_the_spec() {
        let v = GemmSpec::new(GemmImpl::Gemm, DType::F16);
        let r = v.with_algo(3);
        assert_eq!(v.uri(), "gemm_f16");
        assert_eq!(r.uri(), "gemm_f16_lt3");
        assert_ne!(v, r);
        // Profiles written before the field load as cublasGemmEx's choice, and a spec without a
        // rank is written without the field.
        let old: GemmSpec = serde_json::from_str(r#"{"imp":"gemm","dtype":"f16"}"#).unwrap();
        assert_eq!(old, v);
        assert!(!serde_json::to_string(&v).unwrap().contains("algo"));
        let back: GemmSpec = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.algo, Some(3));
    }

    #[test]
    fn backends_without_cublaslt_refuse_a_rank() {
        let r = GemmSpec::new(GemmImpl::Gemm, DType::Bf16).with_algo(1);
        let e = r.refuse_cuda_only("cpu").unwrap_err().to_string();
        assert!(
            e.contains("gemm_bf16_lt1") && e.contains("rank 1") && e.contains("fdpp tune --backend cpu"),
            "{e}"
        );
        assert!(GemmSpec::new(GemmImpl::Gemm, DType::Bf16)
            .refuse_cuda_only("cpu")
            .is_ok());
        // fdpp's Hopper GEMM is refused too; the CPU's ImplC rows per task (block_n alone) is not.
        let h = GemmSpec::new(GemmImpl::Gemm, DType::F16)
            .with_block_n(256)
            .with_stages(4);
        let e = h.refuse_cuda_only("rocm").unwrap_err().to_string();
        assert!(
            e.contains("gemm_f16_bn256_s4") && e.contains("sm_90a") && e.contains("--backend rocm"),
            "{e}"
        );
        assert!(GemmSpec::new(GemmImpl::Gemm, DType::F16)
            .with_block_n(64)
            .refuse_cuda_only("cpu")
            .is_ok());
    }
}
