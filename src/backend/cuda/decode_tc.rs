//! Which main pass a CUDA decode launch runs: the tensor-core pass (kernels_cuda/attn_decode_tc.cuh)
//! or the CUDA-core one, and so how many query heads one block serves.
//!
//! The tensor-core pass costs the same at 2 heads as at 8 (the heads fill the n8 side of its mma),
//! and the CUDA-core pass is issue-bound above two heads per block (reports/NOTES.md, sessions 9
//! and 10). So by default (`decode_tc=auto`) grouped decode at head_dim ≤ 128 takes the
//! tensor-core pass with up to 8 heads per block, and MHA (one head per block, where the
//! CUDA-core kernel streams at ~3 TB/s) keeps the CUDA-core pass. Since session 14 that includes
//! head_dim 256 (two warps per key step, one per half of the dims): on the H200 it ran GQA 32/8 and
//! 16/4 at 1.19-1.32x SDPA where the CUDA-core pass ran at 0.67-0.82x (reports/NOTES.md, session
//! 14). `decode_tc=0`
//! is the CUDA-core pass with at most 4 heads per block (the kernels of session 10), `decode_tc=1`
//! the tensor-core pass wherever it exists (also at one head per block), so that one binary can
//! time both.

use super::sources::{TC_MAX_HEADS_PER_BLOCK, TC_MAX_HEAD_DIM};
use crate::backend::attn_plan::MAX_HEADS_PER_BLOCK;
use crate::error::{FdppError, Result};
use crate::run_config::{self, Key};

/// Stages per warp of the tensor-core pass's staged form (kernels_cuda/attn_decode_tc.cuh, "The
/// staged form": K/V copied into shared memory by cp.async, fragments by ldmatrix) that the
/// bandwidth path takes, from `decode_tc_stages` (`FDPP_DECODE_TC_STAGES`): unset, empty or `0`
/// = the register pass (the default until the GPU has measured the staged one), `2` or `3`. An
/// experiment switch, so that one binary can time both forms in one device call.
pub fn staged_stages() -> Result<Option<usize>> {
    parse_stages(run_config::get().get(Key::DecodeTcStages)).map_err(FdppError::InvalidArgument)
}

/// The value of `FDPP_DECODE_TC_STAGES`, or the message refusing it.
fn parse_stages(v: Option<&str>) -> std::result::Result<Option<usize>, String> {
    match v.map(str::trim) {
        None | Some("") | Some("0") => Ok(None),
        Some("2") => Ok(Some(2)),
        Some("3") => Ok(Some(3)),
        Some(other) => Err(format!(
            "decode_tc_stages (FDPP_DECODE_TC_STAGES) = '{other}': expected 0 (the register pass), 2 or 3 (cp.async stages per warp)"
        )),
    }
}

/// Keys per block whose K/V lines a decode kernel requests into L2 before its `pdl_wait()`
/// (kernels_cuda/attn_decode.cu `prefetch_first`), from `decode_prefetch`
/// (`FDPP_DECODE_PREFETCH`): `None` when unset (the kernel's default, 64, async kernels with
/// splits of 512+ keys: reports/NOTES.md, session 23), else the define's value (0: off).
pub fn prefetch_keys() -> Result<Option<usize>> {
    parse_prefetch(run_config::get().get(Key::DecodePrefetch)).map_err(FdppError::InvalidArgument)
}

/// `decode_bw_pipe` (`FDPP_DECODE_BW_PIPE=auto|0|1`): which async bandwidth loop a launch with one
/// head per block (MHA, head_dim 128+) runs: the software-pipelined one (kernels_cuda/attn_decode.cu
/// `attn_decode_async_pipe`, 4 blocks per SM) or the plain one (6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwPipe {
    /// Picked per launch with the split count (`ops::attention::plan_mha_async`; measured at
    /// head_dim 128 and 256, reports/NOTES.md session 28).
    Auto,
    Off,
    /// Wherever the kernel is built, with the split count planned from its own occupancy.
    On,
}

pub fn bw_pipe() -> Result<BwPipe> {
    parse_bw_pipe(run_config::get().get(Key::DecodeBwPipe)).map_err(FdppError::InvalidArgument)
}

fn parse_bw_pipe(v: Option<&str>) -> std::result::Result<BwPipe, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(BwPipe::Auto),
        Some("0") => Ok(BwPipe::Off),
        Some("1") => Ok(BwPipe::On),
        Some(o) => Err(format!(
            "decode_bw_pipe (FDPP_DECODE_BW_PIPE) = '{o}': expected auto, 0 or 1"
        )),
    }
}

/// The `decode_cluster` switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterMode {
    /// An async row's 2..=8 splits in one thread-block cluster wherever they are one head chunk
    /// and every cluster of the launch is resident at once (sm_90 and later), placed by the
    /// driver's load-balancing policy.
    Auto,
    Off,
}

pub fn cluster_mode() -> Result<ClusterMode> {
    parse_cluster(run_config::get().get(Key::DecodeCluster)).map_err(FdppError::InvalidArgument)
}

fn parse_cluster(v: Option<&str>) -> std::result::Result<ClusterMode, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(ClusterMode::Auto),
        Some("0") => Ok(ClusterMode::Off),
        Some(o) => Err(format!(
            "decode_cluster (FDPP_DECODE_CLUSTER) = '{o}': expected auto or 0"
        )),
    }
}

fn parse_prefetch(v: Option<&str>) -> std::result::Result<Option<usize>, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(t) => match t.parse::<usize>() {
            Ok(n) if n <= 1024 => Ok(Some(n)),
            _ => Err(format!(
                "decode_prefetch (FDPP_DECODE_PREFETCH) = '{t}': expected a key count from 0 to 1024 (0: no prefetch)"
            )),
        },
    }
}

/// The `decode_tc` switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcMode {
    /// The tensor-core pass for two or more heads per block.
    Auto,
    /// Never (at most 4 heads per block).
    Off,
    /// Wherever the head_dim allows, one head per block included.
    On,
}

impl TcMode {
    /// The switch's value: unset or `auto`, `0`/`off`/`false`, `1`/`on`/`true`.
    pub fn parse(v: Option<&str>) -> Result<Self> {
        match v.map(str::trim) {
            None | Some("") | Some("auto") => Ok(TcMode::Auto),
            Some("0") | Some("off") | Some("false") => Ok(TcMode::Off),
            Some("1") | Some("on") | Some("true") => Ok(TcMode::On),
            Some(other) => Err(FdppError::InvalidArgument(format!(
                "decode_tc (FDPP_DECODE_TC) = '{other}': expected auto, 0 or 1"
            ))),
        }
    }

    /// The mode of one decode launch of `batch` sequences with `group` query heads per kv head:
    /// the `decode_tc` switch's value when it is set; otherwise the tensor-core pass for one
    /// head per kv head (MHA) up to `tc_up_to` sequences (a profile's `decode_pass` section,
    /// `Backend::set_decode_tensor_cores`), and `Auto` elsewhere.
    pub fn for_launch(tc_up_to: Option<usize>, group: usize, batch: usize) -> Result<Self> {
        match run_config::get().get(Key::DecodeTc).map(str::trim) {
            Some(v) if !v.is_empty() => Self::parse(Some(v)),
            _ => Ok(Self::by_profile(tc_up_to, group, batch)),
        }
    }

    /// [`Self::for_launch`] without the switch.
    pub fn by_profile(tc_up_to: Option<usize>, group: usize, batch: usize) -> Self {
        match tc_up_to {
            Some(n) if group == 1 && batch <= n => TcMode::On,
            _ => TcMode::Auto,
        }
    }

    /// Most query heads per block the launcher may give a block at `head_dim`.
    pub fn max_heads_per_block(self, head_dim: usize) -> usize {
        let tc = match self {
            TcMode::Off => false,
            TcMode::On | TcMode::Auto => head_dim <= TC_MAX_HEAD_DIM,
        };
        if tc {
            TC_MAX_HEADS_PER_BLOCK
        } else {
            MAX_HEADS_PER_BLOCK
        }
    }

    /// Whether a block of `hg` heads at `head_dim` runs the tensor-core pass. Blocks of more than
    /// [`MAX_HEADS_PER_BLOCK`] heads exist only on it.
    pub fn uses_tc(self, head_dim: usize, hg: usize) -> bool {
        head_dim <= TC_MAX_HEAD_DIM
            && match self {
                TcMode::Off => false,
                TcMode::On => true,
                TcMode::Auto => hg >= 2,
            }
    }
}

/// Whether a one-head-per-block decode at `head_dim` can run the tensor-core pass (what
/// `decode_tc=1` gives it), so that a tune can time it against the CUDA-core pass.
pub fn tc_pass_available(head_dim: usize) -> bool {
    TcMode::On.uses_tc(head_dim, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::attn_plan::attn_heads_per_block_max;
    use crate::backend::cuda::sources::decode_heads_per_block;

    #[test]
    fn a_profiles_choice_moves_mha_launches_up_to_its_batch_only() {
        // MHA up to the profile's batch: the tensor-core pass; past it, and GQA, the built-in rule.
        assert_eq!(TcMode::by_profile(Some(16), 1, 1), TcMode::On);
        assert_eq!(TcMode::by_profile(Some(16), 1, 16), TcMode::On);
        assert_eq!(TcMode::by_profile(Some(16), 1, 17), TcMode::Auto);
        assert_eq!(TcMode::by_profile(Some(16), 4, 1), TcMode::Auto);
        assert_eq!(TcMode::by_profile(None, 1, 1), TcMode::Auto);
        // On a one-head block, On is the tensor-core pass and Auto the CUDA-core one.
        assert!(TcMode::On.uses_tc(128, 1) && !TcMode::Auto.uses_tc(128, 1));
        assert!(tc_pass_available(64) && tc_pass_available(128));
    }

    #[test]
    fn the_stage_switch_parses_and_refuses_other_values() {
        assert_eq!(parse_stages(None), Ok(None));
        assert_eq!(parse_stages(Some("0")), Ok(None));
        assert_eq!(parse_stages(Some(" 3 ")), Ok(Some(3)));
        assert_eq!(parse_stages(Some("2")), Ok(Some(2)));
        for bad in ["1", "4", "yes"] {
            let e = parse_stages(Some(bad)).unwrap_err();
            assert!(e.contains("FDPP_DECODE_TC_STAGES") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_prefetch_switch_parses_and_refuses_other_values() {
        assert_eq!(parse_prefetch(None), Ok(None));
        assert_eq!(parse_prefetch(Some("")), Ok(None));
        assert_eq!(parse_prefetch(Some(" 0 ")), Ok(Some(0)));
        assert_eq!(parse_prefetch(Some("128")), Ok(Some(128)));
        for bad in ["-1", "1025", "lots"] {
            let e = parse_prefetch(Some(bad)).unwrap_err();
            assert!(e.contains("FDPP_DECODE_PREFETCH") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_cluster_switch_parses_and_refuses_other_values() {
        assert_eq!(parse_cluster(None), Ok(ClusterMode::Auto));
        assert_eq!(parse_cluster(Some(" auto")), Ok(ClusterMode::Auto));
        assert_eq!(parse_cluster(Some("0")), Ok(ClusterMode::Off));
        for bad in ["1", "on", "8"] {
            let e = parse_cluster(Some(bad)).unwrap_err();
            assert!(e.contains("FDPP_DECODE_CLUSTER") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_pipelined_loop_switch_parses_and_refuses_other_values() {
        assert_eq!(parse_bw_pipe(None), Ok(BwPipe::Auto));
        assert_eq!(parse_bw_pipe(Some(" ")), Ok(BwPipe::Auto));
        assert_eq!(parse_bw_pipe(Some("auto")), Ok(BwPipe::Auto));
        assert_eq!(parse_bw_pipe(Some("1")), Ok(BwPipe::On));
        assert_eq!(parse_bw_pipe(Some(" 0")), Ok(BwPipe::Off));
        for bad in ["2", "yes", "-1"] {
            let e = parse_bw_pipe(Some(bad)).unwrap_err();
            assert!(e.contains("FDPP_DECODE_BW_PIPE") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_switch_parses_and_refuses_other_values() {
        assert_eq!(TcMode::parse(None).unwrap(), TcMode::Auto);
        assert_eq!(TcMode::parse(Some("auto")).unwrap(), TcMode::Auto);
        assert_eq!(TcMode::parse(Some("0")).unwrap(), TcMode::Off);
        assert_eq!(TcMode::parse(Some(" 1 ")).unwrap(), TcMode::On);
        let e = TcMode::parse(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("FDPP_DECODE_TC") && e.contains("'yes'"), "{e}");
    }

    /// Every (mode, ratio, head_dim) lands on a module that is compiled and an entry it holds:
    /// blocks past 4 heads only where the tensor-core pass runs, and groups of 5-8 in one chunk.
    #[test]
    fn every_group_gets_a_compiled_module_and_pass() {
        for mode in [TcMode::Auto, TcMode::Off, TcMode::On] {
            for d in crate::ops::attention::SUPPORTED_HEAD_DIMS {
                for group in 1..=64 {
                    let hg = attn_heads_per_block_max(group, mode.max_heads_per_block(d));
                    assert!(decode_heads_per_block(d).contains(&hg), "{mode:?} d{d} group {group}");
                    if hg > MAX_HEADS_PER_BLOCK {
                        assert!(mode.uses_tc(d, hg), "{mode:?} d{d} group {group}: hg {hg} without TC");
                    }
                }
            }
        }
        let auto = TcMode::Auto;
        for (group, hg) in [
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 4),
            (5, 5),
            (6, 6),
            (7, 7),
            (8, 8),
            (12, 6),
            (16, 8),
        ] {
            assert_eq!(
                attn_heads_per_block_max(group, auto.max_heads_per_block(128)),
                hg,
                "group {group}"
            );
        }
        // head_dim 256 takes the pass by default too (session 14), MHA still the CUDA-core one.
        assert!(!auto.uses_tc(128, 1) && auto.uses_tc(64, 2) && auto.uses_tc(256, 4) && !auto.uses_tc(256, 1));
        assert!(TcMode::On.uses_tc(128, 1) && TcMode::On.uses_tc(256, 1) && !TcMode::Off.uses_tc(128, 8));
        assert!(!TcMode::Off.uses_tc(256, 4));
        assert_eq!(TcMode::Off.max_heads_per_block(128), 4);
        assert_eq!(TcMode::Off.max_heads_per_block(256), 4);
        // head_dim 256 on the pass (asked for, or by default since session 14): ratios 5-8 in one
        // block, as at 64 and 128.
        assert_eq!(TcMode::On.max_heads_per_block(256), 8);
        assert_eq!(attn_heads_per_block_max(8, TcMode::On.max_heads_per_block(256)), 8);
        assert_eq!(auto.max_heads_per_block(256), 8);
    }
}
