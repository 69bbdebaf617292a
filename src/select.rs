//! Which GEMM implementation runs a [K, N] shape at M rows: the only place where implementation
//! thresholds live. The engine, `fdpp bench` and `fdpp profile show` all ask here.
//!
//! FlashDecoding++ §4 (heuristic dataflow): ImplA (GEMV) below M1, ImplB (flat GEMM) from M1,
//! ImplC (vendor GEMM) from M2, with M1/M2 measured per shape by `fdpp tune`. The regions are
//! applied in the order C, B, A (gemm if M ≥ M2, else flat_gemm if M ≥ M1, else gemv), so a
//! missing M1 or M2 (the implementation never won) simply removes its region, and M2 ≤ M1 means
//! flat_gemm is never chosen. The config (B_N) is the implementation's best verified one at the
//! grid M nearest to M.
//!
//! Without a profile, or without an entry for the shape, a built-in rule per backend runs
//! ([`Fallback`]) until `fdpp tune` has measured the machine: the vendor GEMM is correct at every
//! M but is the slowest choice at decode M on the CPU (the cache-blocked GEMM re-reads W per row
//! block), and slower than the GEMV at M ≤ 2 in every shape of the shipped H100 profiles.
//! `--set gemm_fallback=vendor` (FDPP_GEMM_FALLBACK) restores the vendor GEMM everywhere.

use crate::backend::BackendKind;
use crate::dtype::DType;
use crate::model::LinearShape;
use crate::ops::gemm::{GemmImpl, GemmSpec};
use crate::profile::{Profile, ShapeProfile};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub imp: GemmImpl,
    /// The tuned B_N (flat_gemm) or rows per block (gemv); None = the backend's default.
    pub block_n: Option<u32>,
    /// The tuned pipeline depth (flat_gemm); None = the backend's default.
    pub stages: Option<u32>,
    /// The tuned cuBLASLt algorithm rank (gemm on CUDA); None = cublasGemmEx's choice.
    pub algo: Option<u32>,
    /// Why, for logs and `fdpp profile show`.
    pub reason: String,
}

impl Plan {
    pub fn spec(&self, dtype: DType) -> GemmSpec {
        GemmSpec {
            imp: self.imp,
            dtype,
            block_n: self.block_n,
            stages: self.stages,
            algo: self.algo,
        }
    }
}

/// What runs a shape that no profile measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// The backend's built-in rule (see [`Fallback::plan`]).
    Builtin(BackendKind),
    /// The vendor GEMM at every M (`--set gemm_fallback=vendor`).
    Vendor,
}

/// The largest M at which the CPU's built-in rule runs the GEMV. Measured with `fdpp bench gemm
/// --backend cpu --m 8,16,24,32,64,128` on SmolLM2-135M's four shapes (release, 2 shared cores,
/// f16; reports/NOTES.md, "CPU engine (issue #21 items 5-6)"): the GEMV that widens W in
/// registers reads W once for every row of x and beat flat_gemm and the cache-blocked GEMM in
/// every shape up to M = 32 (by 1.1-2.4x at M = 8, 1.05-1.2x at M = 32); from M = 64 the
/// cache-blocked GEMM wins (1.4-1.9x at M = 128), where the op is bound by arithmetic, not by W.
/// (With the earlier widen-then-dot GEMV the crossover was M = 8-16.)
pub const CPU_GEMV_MAX_M: usize = 32;

/// The largest M at which CUDA's built-in rule runs the GEMV: at M ≤ 2 the GEMV beat cuBLAS in
/// all 12 shapes of the three shipped H100 profiles (by 5-50 %); at M = 3 cuBLAS won one of them.
pub const CUDA_GEMV_MAX_M: usize = 2;

impl Fallback {
    /// The built-in rule of `backend`, unless the run configuration's `gemm_fallback` says
    /// `vendor`.
    pub fn configured(backend: BackendKind) -> crate::Result<Fallback> {
        match crate::run_config::get().get(crate::run_config::Key::GemmFallback) {
            None | Some("rule") => Ok(Fallback::Builtin(backend)),
            Some("vendor") => Ok(Fallback::Vendor),
            Some(v) => Err(crate::FdppError::InvalidArgument(format!(
                "gemm_fallback '{v}' (--set gemm_fallback / FDPP_GEMM_FALLBACK): expected rule or vendor"
            ))),
        }
    }

    /// The rule in words, for the output ("built-in rule for the CPU (gemv for M ≤ 32, else the
    /// cache-blocked gemm)").
    pub fn describe(self) -> String {
        match self {
            Fallback::Builtin(BackendKind::Cpu) => {
                format!("built-in rule for the CPU (gemv for M ≤ {CPU_GEMV_MAX_M}, else the cache-blocked gemm)")
            }
            Fallback::Builtin(BackendKind::Cuda) => {
                format!("built-in rule for CUDA (gemv for M ≤ {CUDA_GEMV_MAX_M}, else cuBLAS)")
            }
            Fallback::Builtin(BackendKind::Rocm) => {
                "built-in rule for ROCm (rocBLAS at every M: nothing measured on ROCm yet)".into()
            }
            Fallback::Vendor => "the vendor gemm at every M".into(),
        }
    }

    /// The plan at `m` rows; `why` says why no profile entry applies ("no profile").
    pub fn plan(self, m: usize, why: &str) -> Plan {
        let gemv_max = match self {
            Fallback::Builtin(BackendKind::Cpu) => CPU_GEMV_MAX_M,
            Fallback::Builtin(BackendKind::Cuda) => CUDA_GEMV_MAX_M,
            Fallback::Builtin(BackendKind::Rocm) | Fallback::Vendor => 0,
        };
        Plan {
            imp: if m <= gemv_max { GemmImpl::Gemv } else { GemmImpl::Gemm },
            block_n: None,
            stages: None,
            algo: None,
            reason: format!("{why}: {}", self.describe()),
        }
    }
}

/// The plan for `shape` at `m` rows (see the module docs for the rule), the vendor GEMM where
/// the profile has nothing (`fdpp bench --impl auto`, which compares against the profile alone).
pub fn select(shape: &LinearShape, m: usize, profile: Option<&Profile>) -> Plan {
    select_or(shape, m, profile, Fallback::Vendor)
}

/// The plan for `shape` at `m` rows, `fallback` where the profile has nothing for the shape.
pub fn select_or(shape: &LinearShape, m: usize, profile: Option<&Profile>, fallback: Fallback) -> Plan {
    let Some(p) = profile else {
        return fallback.plan(m, "no profile");
    };
    match p.shape_for(shape) {
        Some(sp) => select_in(sp, m),
        None => fallback.plan(m, &format!("no profile entry for {}", shape.label())),
    }
}

fn vendor(reason: &str) -> Plan {
    Plan {
        imp: GemmImpl::Gemm,
        block_n: None,
        stages: None,
        algo: None,
        reason: reason.to_string(),
    }
}

fn fmt_point(name: &str, v: Option<usize>) -> String {
    match v {
        Some(x) => format!("{name}={x}"),
        None => format!("{name}=never"),
    }
}

/// The plan from one shape's profile entry.
pub fn select_in(sp: &ShapeProfile, m: usize) -> Plan {
    let (imp, why) = match (sp.m1, sp.m2) {
        (_, Some(m2)) if m >= m2 => (GemmImpl::Gemm, format!("M={m} >= M2={m2}")),
        (Some(m1), m2) if m >= m1 => (
            GemmImpl::FlatGemm,
            format!("M1={m1} <= M={m} < {}", fmt_point("M2", m2)),
        ),
        (m1, m2) => (
            GemmImpl::Gemv,
            format!("M={m} below {} and {}", fmt_point("M1", m1), fmt_point("M2", m2)),
        ),
    };
    let Some(gm) = nearest_grid_m(&sp.m_grid, m) else {
        return vendor(&format!("empty M grid for {}", sp.label()));
    };
    let row = sp.best_at(gm);
    if let Some(best) = row.and_then(|r| r.get(imp)) {
        return Plan {
            imp,
            block_n: best.block_n,
            stages: best.stages,
            algo: best.algo,
            reason: format!("{why}: {imp} ({} at grid M={gm})", best.uri),
        };
    }
    // The region's implementation has no verified config at this M (rejected or unsupported
    // there): never run something unverified; take the fastest verified one instead.
    let fastest = row.and_then(|r| {
        GemmImpl::ALL
            .iter()
            .filter_map(|&i| r.get(i).map(|b| (i, b)))
            .min_by(|a, b| a.1.median_us.total_cmp(&b.1.median_us))
    });
    match fastest {
        Some((i, b)) => Plan {
            imp: i,
            block_n: b.block_n,
            stages: b.stages,
            algo: b.algo,
            reason: format!(
                "{why}, but {imp} has no verified config at grid M={gm}: fastest verified is {i} ({})",
                b.uri
            ),
        },
        None => vendor(&format!("{why}, but nothing was verified at grid M={gm}: vendor gemm")),
    }
}

/// The grid M nearest to `m` by ratio (the grid is geometric above 16); ties go to the smaller.
/// M beyond the grid maps to its ends.
pub fn nearest_grid_m(grid: &[usize], m: usize) -> Option<usize> {
    let m = m.max(1);
    let mut best: Option<(usize, f64)> = None;
    for &g in grid {
        if g == 0 {
            continue;
        }
        let r = if g >= m {
            g as f64 / m as f64
        } else {
            m as f64 / g as f64
        };
        if best.is_none_or(|(bg, br)| r < br || (r == br && g < bg)) {
            best = Some((g, r));
        }
    }
    best.map(|(g, _)| g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LinearKind;
    use crate::profile::{BestAtM, BestConfig};

    fn cfg(uri: &str, bn: Option<u32>, t: f64) -> Option<BestConfig> {
        Some(BestConfig {
            uri: uri.into(),
            block_n: bn,
            stages: None,
            algo: None,
            median_us: t,
        })
    }

    /// Grid 1, 2, 4, …, 256, every implementation verified everywhere; flat_gemm's best B_N is
    /// 32 below M=16 and 64 from there.
    fn sp(m1: Option<usize>, m2: Option<usize>) -> ShapeProfile {
        let grid: Vec<usize> = (0..9).map(|i| 1 << i).collect();
        let best = grid
            .iter()
            .map(|&m| BestAtM {
                m,
                gemv: cfg("gemv_f16", None, 10.0),
                flat_gemm: if m < 16 {
                    cfg("flat_gemm_f16_bn32", Some(32), 9.0)
                } else {
                    cfg("flat_gemm_f16_bn64", Some(64), 9.0)
                },
                gemm: cfg("gemm_f16", None, 8.0),
            })
            .collect();
        ShapeProfile {
            kind: LinearKind::O,
            k: 4096,
            n: 4096,
            m_grid: grid,
            candidates: vec![],
            best,
            m1,
            m2,
        }
    }

    fn shape() -> LinearShape {
        LinearShape {
            kind: LinearKind::O,
            k: 4096,
            n: 4096,
        }
    }

    #[test]
    fn three_regions_and_their_boundaries() {
        let s = sp(Some(4), Some(64));
        assert_eq!(select_in(&s, 1).imp, GemmImpl::Gemv);
        assert_eq!(select_in(&s, 3).imp, GemmImpl::Gemv);
        assert_eq!(select_in(&s, 4).imp, GemmImpl::FlatGemm, "M1 itself is flat_gemm");
        assert_eq!(select_in(&s, 63).imp, GemmImpl::FlatGemm);
        assert_eq!(select_in(&s, 64).imp, GemmImpl::Gemm, "M2 itself is gemm");
        assert_eq!(select_in(&s, 65).imp, GemmImpl::Gemm);
    }

    #[test]
    fn block_n_comes_from_the_nearest_grid_m() {
        let s = sp(Some(2), Some(128));
        let p = select_in(&s, 8);
        assert_eq!((p.imp, p.block_n), (GemmImpl::FlatGemm, Some(32)));
        let p = select_in(&s, 13); // nearest grid M is 16 (16/13 < 13/8)
        assert_eq!(p.block_n, Some(64));
        assert!(p.reason.contains("grid M=16"), "{}", p.reason);
        assert_eq!(select_in(&s, 11).block_n, Some(32)); // nearest is 8
        assert_eq!(select_in(&s, 100).spec(DType::Bf16).block_n, Some(64));
    }

    #[test]
    fn the_cublaslt_rank_comes_with_the_gemm_config() {
        let mut s = sp(Some(2), Some(128));
        for b in &mut s.best {
            if let Some(g) = b.gemm.as_mut() {
                g.algo = Some(if b.m >= 256 { 4 } else { 1 });
                g.uri = format!("gemm_f16_lt{}", g.algo.unwrap_or(0));
            }
        }
        let p = select_in(&s, 300);
        assert_eq!((p.imp, p.algo), (GemmImpl::Gemm, Some(4)));
        assert_eq!(p.spec(DType::F16).uri(), "gemm_f16_lt4");
        assert_eq!(select_in(&s, 150).algo, Some(1)); // nearest grid M is 128
        assert_eq!(select_in(&s, 8).algo, None); // flat_gemm there
    }

    #[test]
    fn beyond_the_grid() {
        let s = sp(Some(4), Some(64));
        let p = select_in(&s, 100_000);
        assert_eq!(p.imp, GemmImpl::Gemm);
        assert!(p.reason.contains("grid M=256"), "{}", p.reason);
        // With no M2, flat_gemm keeps going past the grid.
        let s = sp(Some(4), None);
        let p = select_in(&s, 100_000);
        assert_eq!((p.imp, p.block_n), (GemmImpl::FlatGemm, Some(64)));
    }

    #[test]
    fn missing_m1_means_gemv_until_m2() {
        let s = sp(None, Some(32));
        assert_eq!(select_in(&s, 1).imp, GemmImpl::Gemv);
        assert_eq!(select_in(&s, 31).imp, GemmImpl::Gemv);
        assert_eq!(select_in(&s, 32).imp, GemmImpl::Gemm);
        assert!(select_in(&s, 1).reason.contains("M1=never"));
    }

    #[test]
    fn missing_both_means_gemv_everywhere() {
        let s = sp(None, None);
        for m in [1, 7, 256, 5000] {
            assert_eq!(select_in(&s, m).imp, GemmImpl::Gemv, "M={m}");
        }
    }

    #[test]
    fn missing_m2_means_flat_gemm_from_m1() {
        let s = sp(Some(8), None);
        assert_eq!(select_in(&s, 7).imp, GemmImpl::Gemv);
        assert_eq!(select_in(&s, 8).imp, GemmImpl::FlatGemm);
        assert!(select_in(&s, 8).reason.contains("never"));
    }

    #[test]
    fn m2_below_m1_skips_flat_gemm() {
        let s = sp(Some(16), Some(4));
        assert_eq!(select_in(&s, 3).imp, GemmImpl::Gemv);
        for m in [4, 15, 16, 17, 300] {
            assert_eq!(select_in(&s, m).imp, GemmImpl::Gemm, "M={m}");
        }
    }

    #[test]
    fn m_zero_is_treated_as_the_smallest() {
        let s = sp(Some(4), Some(64));
        assert_eq!(select_in(&s, 0).imp, GemmImpl::Gemv);
    }

    #[test]
    fn unverified_region_falls_back_to_fastest_verified() {
        let mut s = sp(Some(2), None);
        // flat_gemm rejected at M=8; gemm (8.0) is faster than gemv (10.0) there.
        s.best[3].flat_gemm = None;
        let p = select_in(&s, 8);
        assert_eq!(p.imp, GemmImpl::Gemm);
        assert!(p.reason.contains("no verified config"), "{}", p.reason);
        // Nothing verified at M=8 at all: the vendor GEMM.
        s.best[3].gemv = None;
        s.best[3].gemm = None;
        let p = select_in(&s, 8);
        assert_eq!((p.imp, p.block_n), (GemmImpl::Gemm, None));
        assert!(p.reason.contains("nothing was verified"), "{}", p.reason);
    }

    #[test]
    fn nearest_grid_points() {
        let g = [1, 2, 3, 16, 24, 32];
        assert_eq!(nearest_grid_m(&g, 1), Some(1));
        assert_eq!(nearest_grid_m(&g, 0), Some(1));
        assert_eq!(nearest_grid_m(&g, 20), Some(24)); // 24/20 = 1.2 < 20/16 = 1.25
        assert_eq!(nearest_grid_m(&g, 7), Some(16)); // 16/7 = 2.29 < 7/3 = 2.33
        assert_eq!(nearest_grid_m(&g, 1000), Some(32));
        assert_eq!(nearest_grid_m(&[2, 8], 4), Some(2), "ties go to the smaller");
        assert_eq!(nearest_grid_m(&[], 4), None);
    }

    fn profile(shapes: Vec<ShapeProfile>) -> Profile {
        use crate::backend::cpu::CpuBackend;
        use crate::profile::{ModelSection, Provenance, TimingSection, SCHEMA_VERSION};
        let config = crate::model::presets::preset("llama2-7b").unwrap();
        Profile {
            schema_version: SCHEMA_VERSION,
            provenance: Provenance::of(&CpuBackend::new()),
            model: ModelSection {
                name: config.name.clone(),
                shapes: crate::model::ModelShapes::of(&config).linears,
                config,
            },
            dtype: DType::F16,
            timing: TimingSection {
                warmup: 1,
                reps: 1,
                verify_cols: 256,
                margin: 0.02,
                rule: String::new(),
            },
            shapes,
            softmax: None,
            decode_pass: None,
        }
    }

    #[test]
    fn no_profile_or_no_entry_means_vendor_gemm() {
        let p = select(&shape(), 1, None);
        assert_eq!((p.imp, p.block_n), (GemmImpl::Gemm, None));
        assert!(p.reason.starts_with("no profile: "), "{}", p.reason);
        let other = LinearShape {
            kind: LinearKind::Ffn2,
            k: 11008,
            n: 4096,
        };
        let prof = profile(vec![sp(Some(4), Some(64))]);
        let p = select(&other, 1, Some(&prof));
        assert_eq!((p.imp, p.block_n), (GemmImpl::Gemm, None));
        assert!(
            p.reason.contains("no profile entry") && p.reason.contains("K=11008"),
            "{}",
            p.reason
        );
        // The entry is found by K and N.
        assert_eq!(select(&shape(), 1, Some(&prof)).imp, GemmImpl::Gemv);
        assert_eq!(select(&shape(), 8, Some(&prof)).imp, GemmImpl::FlatGemm);
        let same_kn_other_kind = LinearShape {
            kind: LinearKind::Qkv,
            ..shape()
        };
        assert_eq!(select(&same_kn_other_kind, 8, Some(&prof)).imp, GemmImpl::FlatGemm);
    }
}
