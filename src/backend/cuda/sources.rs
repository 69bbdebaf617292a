//! The CUDA kernel sources, embedded in the binary, and the compile-time specialisations of each.
//!
//! A [`KernelSource`] names the file and the `-D` definitions of one specialisation; its URI
//! (e.g. `flat_gemm_f16_bn64`) names every compile-time parameter, as the on-disk cache key does.

use crate::backend::kernel_cache::{dtype_define, hash_files};
pub use crate::backend::kernel_cache::{hex16, KernelSource};

use crate::dtype::DType;
use crate::ops::gemm::{GemmImpl, GemmSpec};

const COMMON: &str = include_str!("../../../kernels_cuda/common.cuh");
const GEMV: &str = include_str!("../../../kernels_cuda/gemv.cu");
const FLAT_GEMM: &str = include_str!("../../../kernels_cuda/flat_gemm.cu");
const ATTN_DECODE: &str = include_str!("../../../kernels_cuda/attn_decode.cu");
const ATTN_DECODE_TC: &str = include_str!("../../../kernels_cuda/attn_decode_tc.cuh");
const ATTN_PREFILL: &str = include_str!("../../../kernels_cuda/attn_prefill.cu");
const ATTN_PREFILL_HOPPER: &str = include_str!("../../../kernels_cuda/attn_prefill_hopper.cu");
const ATTN_SCORES: &str = include_str!("../../../kernels_cuda/attn_scores.cu");
const ATTN_COMMON: &str = include_str!("../../../kernels_cuda/attn_common.cuh");
const HOPPER: &str = include_str!("../../../kernels_cuda/hopper.cuh");
const LAYER: &str = include_str!("../../../kernels_cuda/layer.cu");
const SAMPLE: &str = include_str!("../../../kernels_cuda/sample.cu");
const GEMV_ROPE: &str = include_str!("../../../kernels_cuda/gemv_rope.cu");
const GEMM_HOPPER: &str = include_str!("../../../kernels_cuda/gemm_hopper.cu");

/// The files of the GEMM kernels: their hash is the profiles' kernel hash (a profile holds GEMM
/// timings; an edit to another kernel does not invalidate it).
const FILES: &[(&str, &str)] = &[("common.cuh", COMMON), ("gemv.cu", GEMV), ("flat_gemm.cu", FLAT_GEMM)];

/// Rows per warp offered for gemv, and B_N offered for flat_gemm (FlashDecoding++ §4: B_N is
/// chosen per shape by the tuner).
/// gemv rows per block (4 warps): 1 and 2 split K over 4 or 2 warps per row, 4..16 give each warp
/// 1..4 whole rows.
pub const GEMV_ROWS_PER_BLOCK: &[u32] = &[1, 2, 4, 8, 16];
/// B_N = 256 was dropped: with 8 warps never the fastest on the H100 (1.1-5x slower than the best
/// B_N = 32..128 on every Llama2-7B shape at M = 8..64; flat_gemm v3 in reports/NOTES.md).
pub const FLAT_BN: &[u32] = &[32, 64, 128];
/// cp.async pipeline depths offered for flat_gemm: 2 is the paper's double buffering; deeper
/// pipelines keep more W tiles in flight, which pays where one block per SM must stream all of K
/// (N = 4096). A depth whose shared memory does not fit the device is skipped at run time.
pub const FLAT_STAGES: &[u32] = &[2, 3];
/// KiB of W per pipeline stage (B_K = this / (2·B_N)); measured against 16 KiB on the H100,
/// see reports/NOTES.md (with 4 warps, and again with 8 warps as 4- and 6-stage pipelines).
pub const FLAT_STAGE_KB: u32 = 32;
/// 16-byte weight loads in flight per gemv lane.
pub const GEMV_INFLIGHT: u32 = 8;
/// Warps per gemv block (must match WARPS in gemv.cu).
pub const GEMV_WARPS: u32 = 4;
/// Warps per flat_gemm block (must match FLAT_WARPS in flat_gemm.cu).
pub const FLAT_WARPS: u32 = 8;

/// SHA-256 over the GEMM kernel sources ([`FILES`]) and the Rust-side constants their launches
/// are built from ([`gemm_launch_constants`]), hex, first 16 digits: the kernel hash a tuning
/// profile records. A profile measures what the kernels compute and how fast they run, and a
/// define such as the loads in flight or the warps per block changes that as much as an edit of
/// the .cu file does (issue #17, item 5).
pub fn kernel_hash() -> String {
    let constants = gemm_launch_constants();
    let mut files = FILES.to_vec();
    files.push(("launch constants", constants.as_str()));
    hash_files(&files)
}

/// SHA-256 over fdpp's Hopper GEMM (kernels_cuda/gemm_hopper.cu, the headers it includes and its
/// tiles), hex, first 16 digits: a profile made on sm_90a records it beside [`kernel_hash`], and
/// one that records another is refused as one with another kernel hash is. It is a hash of its
/// own so that the profiles made before the kernel existed (the shipped H100 ones), which never
/// timed it, stay valid; they name no spec of it.
pub fn hopper_gemm_hash() -> String {
    let tiles = format!("TILES={:?}", super::gemm_hopper::TILES);
    hash_files(&[
        ("common.cuh", COMMON),
        ("hopper.cuh", HOPPER),
        ("gemm_hopper.cu", GEMM_HOPPER),
        ("launch constants", tiles.as_str()),
    ])
}

/// The GEMM launch constants of this file, one `NAME=value` per line, in the order hashed.
pub fn gemm_launch_constants() -> String {
    [
        format!("GEMV_ROWS_PER_BLOCK={GEMV_ROWS_PER_BLOCK:?}"),
        format!("FLAT_BN={FLAT_BN:?}"),
        format!("FLAT_STAGES={FLAT_STAGES:?}"),
        format!("FLAT_STAGE_KB={FLAT_STAGE_KB}"),
        format!("GEMV_INFLIGHT={GEMV_INFLIGHT}"),
        format!("GEMV_WARPS={GEMV_WARPS}"),
        format!("FLAT_WARPS={FLAT_WARPS}"),
        format!("GEMV_GLU_LAYOUT={GEMV_GLU_LAYOUT:?}"),
    ]
    .join("\n")
}

fn expand(file: &str) -> String {
    file.replace("#include \"gemv.cu\"", GEMV)
        .replace("#include \"common.cuh\"", COMMON)
        .replace("#include \"attn_common.cuh\"", ATTN_COMMON)
        .replace("#include \"attn_decode_tc.cuh\"", ATTN_DECODE_TC)
        .replace("#include \"hopper.cuh\"", HOPPER)
}

/// Rows per warp and K-split of the gemv GLU entries (gemv.cu, RMS_GLU): a gate row and its up
/// row per warp group, K over 4 warps, the same 16-byte loads in flight per lane as the 1-row
/// layouts (UNROLL = FDPP_INFLIGHT / ROWS).
pub const GEMV_GLU_LAYOUT: (u32, u32) = (2, 4);

/// The gemv source built for the fused GLU entries (`gemv_rms_glu_m*`) in `dt`.
pub fn gemv_glu_source(dt: DType) -> KernelSource {
    let (rows, ksplit) = GEMV_GLU_LAYOUT;
    KernelSource {
        uri: format!("gemv_glu_{dt}"),
        text: expand(GEMV),
        defines: vec![
            dtype_define(dt),
            ("FDPP_ROWS".into(), rows.to_string()),
            ("FDPP_KSPLIT".into(), ksplit.to_string()),
            ("FDPP_INFLIGHT".into(), GEMV_INFLIGHT.to_string()),
            ("FDPP_GLU_OFF".into(), "0".into()),
        ],
    }
}

/// The QKV GEMV with the rotary and KV append (`gemv_rms_rope_m*`, kernels_cuda/gemv_rope.cu) in
/// `dt`: gemv.cu's helpers at the GLU layout, a row pair per block. Not part of the kernel hash:
/// no profile times it (it takes the QKV spec's place only in a fused decode step).
pub fn gemv_rope_source(dt: DType) -> KernelSource {
    let (rows, ksplit) = GEMV_GLU_LAYOUT;
    KernelSource {
        uri: format!("gemv_rope_{dt}"),
        text: expand(GEMV_ROPE),
        defines: vec![
            dtype_define(dt),
            ("FDPP_ROWS".into(), rows.to_string()),
            ("FDPP_KSPLIT".into(), ksplit.to_string()),
            ("FDPP_INFLIGHT".into(), GEMV_INFLIGHT.to_string()),
        ],
    }
}

/// fdpp's Hopper GEMM built with epilogue `epi` (gemm_hopper.cu's `Epi`) on 128 × `bn` tiles,
/// `stages` stages, clusters of `cl`: the prefill's fused layer (gemm_epi.rs), sm_90a only (its
/// uri starts with the Hopper GEMM's prefix). The module also holds row_sumsq and rope_table.
pub fn gemm_epi_source(dt: DType, uri: &str, epi: u32, bn: u32, stages: u32, cl: u32) -> KernelSource {
    KernelSource {
        uri: uri.to_string(),
        text: expand(GEMM_HOPPER),
        defines: vec![
            dtype_define(dt),
            ("FDPP_EPI".into(), epi.to_string()),
            ("FDPP_BN".into(), bn.to_string()),
            ("FDPP_STAGES".into(), stages.to_string()),
            ("FDPP_CL".into(), cl.to_string()),
            // Launched chained (gemm_epi.rs): W prefetched before the wait on the previous kernel.
            ("FDPP_GEMM_PDL".into(), "1".into()),
        ],
    }
}

/// The source to compile for a GEMM spec, or None for ImplC through a library (nothing to
/// compile); ImplC with a tile (block_n, stages) is fdpp's Hopper GEMM (sm_90a only).
pub fn gemm_source(spec: &GemmSpec) -> Option<KernelSource> {
    match spec.imp {
        GemmImpl::Gemm if spec.is_hopper_gemm() => Some(KernelSource {
            uri: spec.uri(),
            text: expand(GEMM_HOPPER),
            defines: vec![
                dtype_define(spec.dtype),
                ("FDPP_BN".into(), spec.block_n.unwrap_or(256).to_string()),
                ("FDPP_STAGES".into(), spec.stages.unwrap_or(4).to_string()),
            ],
        }),
        GemmImpl::Gemv => {
            let (rows, ksplit) = gemv_layout(spec.block_n.unwrap_or(8));
            Some(KernelSource {
                uri: spec.uri(),
                text: expand(GEMV),
                defines: vec![
                    dtype_define(spec.dtype),
                    ("FDPP_ROWS".into(), rows.to_string()),
                    ("FDPP_KSPLIT".into(), ksplit.to_string()),
                    ("FDPP_INFLIGHT".into(), GEMV_INFLIGHT.to_string()),
                ],
            })
        }
        GemmImpl::FlatGemm => Some(KernelSource {
            uri: spec.uri(),
            text: expand(FLAT_GEMM),
            defines: vec![
                dtype_define(spec.dtype),
                ("FDPP_BN".into(), spec.block_n.unwrap_or(64).to_string()),
                ("FDPP_STAGES".into(), flat_stages(spec).to_string()),
                ("FDPP_STAGE_KB".into(), FLAT_STAGE_KB.to_string()),
            ],
        }),
        GemmImpl::Gemm => None,
    }
}

/// The compiled GEMM candidates (every B_N, both dtypes), for `fdpp kernels check`.
pub fn all_gemm_specs(dtype: DType) -> Vec<GemmSpec> {
    let mut v: Vec<GemmSpec> = GEMV_ROWS_PER_BLOCK
        .iter()
        .map(|&r| GemmSpec::new(GemmImpl::Gemv, dtype).with_block_n(r))
        .collect();
    for &bn in FLAT_BN {
        for &st in FLAT_STAGES {
            v.push(
                GemmSpec::new(GemmImpl::FlatGemm, dtype)
                    .with_block_n(bn)
                    .with_stages(st),
            );
        }
    }
    v
}

/// The small per-layer ops of one dtype (kernels_cuda/layer.cu): one module holds every entry
/// point, named by [`crate::backend::layer_plan::LayerKernel`].
pub fn layer_source(dtype: DType) -> KernelSource {
    KernelSource {
        uri: format!("layer_{dtype}"),
        text: expand(LAYER),
        defines: vec![dtype_define(dtype)],
    }
}

/// Greedy choice on the device (kernels_cuda/sample.cu), one module per dtype.
pub fn sample_source(dtype: DType) -> KernelSource {
    KernelSource {
        uri: format!("sample_{dtype}"),
        text: expand(SAMPLE),
        defines: vec![dtype_define(dtype)],
    }
}

/// Every kernel source fdpp compiles.
pub fn all_sources() -> Vec<KernelSource> {
    let dtypes = [DType::F16, DType::Bf16];
    let mut v: Vec<KernelSource> = dtypes
        .iter()
        .flat_map(|&dt| all_gemm_specs(dt).into_iter().chain(super::gemm_hopper::specs(dt)))
        .filter_map(|s| gemm_source(&s))
        .collect();
    for dt in dtypes {
        v.extend(
            super::gemm_epi::variants()
                .into_iter()
                .map(|(e, t)| super::gemm_epi::source(dt, e, t)),
        );
    }
    v.extend(dtypes.iter().map(|&dt| gemv_glu_source(dt)));
    v.extend(dtypes.iter().map(|&dt| gemv_rope_source(dt)));
    v.extend(dtypes.iter().map(|&dt| layer_source(dt)));
    v.extend(dtypes.iter().map(|&dt| sample_source(dt)));
    for dt in dtypes {
        for &d in &crate::ops::attention::SUPPORTED_HEAD_DIMS {
            for hg in decode_heads_per_block(d) {
                v.push(attn_decode_source(dt, d, hg));
            }
            v.push(attn_prefill_source(dt, d));
            v.push(attn_scores_source(dt, d));
        }
        for &d in &super::prefill_hopper::HEAD_DIMS {
            for sched in super::prefill_hopper::Schedule::ALL {
                v.push(attn_prefill_hopper_source(dt, d, sched));
            }
        }
    }
    v
}

/// Whether `src` compiles for `arch`: the Hopper prefill and GEMM (wgmma, setmaxnreg) need
/// sm_90a, every other kernel compiles everywhere.
pub fn compiles_for(src: &KernelSource, arch: &str) -> bool {
    let hopper = src.uri.starts_with(HOPPER_PREFILL_PREFIX) || src.uri.starts_with(HOPPER_GEMM_PREFIX);
    !hopper || arch == "sm_90a"
}

/// ImplC's uri prefix: only fdpp's Hopper GEMM has a source under it (cuBLAS has none).
const HOPPER_GEMM_PREFIX: &str = "gemm_";

const HOPPER_PREFILL_PREFIX: &str = "attn_prefill_hopper_";

/// Causal prefill for Hopper (kernels_cuda/attn_prefill_hopper.cu, sm_90a only), sync and async,
/// for one dtype, head_dim and schedule (K/V stages, softmax overlapped with P·V or not).
pub fn attn_prefill_hopper_source(dtype: DType, head_dim: usize, v: super::prefill_hopper::Schedule) -> KernelSource {
    KernelSource {
        uri: format!("{HOPPER_PREFILL_PREFIX}{dtype}_d{head_dim}_{}", v.tag()),
        text: expand(ATTN_PREFILL_HOPPER),
        defines: vec![
            dtype_define(dtype),
            ("FDPP_D".into(), head_dim.to_string()),
            ("FDPP_STAGES".into(), v.stages.to_string()),
            ("FDPP_OVERLAP".into(), u8::from(v.overlap).to_string()),
            ("FDPP_PINGPONG".into(), u8::from(v.pingpong).to_string()),
            ("FDPP_RUN_BOXES".into(), u8::from(v.runs).to_string()),
            ("FDPP_DIAG".into(), v.diag.to_string()),
            ("FDPP_PERSIST".into(), u8::from(v.persist).to_string()),
        ],
    }
}

// Heads per decode block: shared with the ROCm port (src/backend/attn_plan.rs).
pub use crate::backend::attn_plan::{attn_heads_per_block, ATTN_HEADS_PER_BLOCK};

/// Most query heads per CUDA decode block with the tensor-core pass (attn_decode_tc.cuh): the
/// heads fill the n8 side of its mma, so a group of 5-8 is one block (K/V read once per kv head)
/// and 16 is two. The CUDA-core pass and the ROCm port stay at
/// [`crate::backend::attn_plan::MAX_HEADS_PER_BLOCK`].
pub const TC_MAX_HEADS_PER_BLOCK: usize = 8;

/// Largest head_dim of the tensor-core pass: every supported one. A warp holds TC_DW/2 fp32
/// accumulators, TC_DW/8 q registers and TC_DW/2 registers of K/V rows per lane with TC_DW =
/// min(head_dim, 128); at 256 two warps share each key step, one per half of the dims
/// (attn_decode_tc.cuh).
pub const TC_MAX_HEAD_DIM: usize = 256;

/// Dynamic shared memory of a block of the tensor-core pass's staged form (attn_decode_tc.cuh):
/// 4 warps × `stages` × (K and V of 16 keys over the warp's min(head_dim, 128) dims, 16-bit).
pub fn tc_staged_smem_bytes(head_dim: usize, stages: usize) -> u32 {
    (4 * stages * 2 * 16 * head_dim.min(128) * 2) as u32
}

/// The decode modules compiled for one head_dim: HG 1..=4 (both passes), and 5..=8 (the
/// tensor-core pass only) where that pass exists.
pub fn decode_heads_per_block(head_dim: usize) -> Vec<usize> {
    let max = if head_dim <= TC_MAX_HEAD_DIM {
        TC_MAX_HEADS_PER_BLOCK
    } else {
        crate::backend::attn_plan::MAX_HEADS_PER_BLOCK
    };
    (1..=max).collect()
}

/// Split-KV decode (sync, combine, async) for one dtype, head_dim and heads-per-block.
pub fn attn_decode_source(dtype: DType, head_dim: usize, hg: usize) -> KernelSource {
    KernelSource {
        uri: format!("attn_decode_{dtype}_d{head_dim}_hg{hg}"),
        text: expand(ATTN_DECODE),
        defines: vec![
            dtype_define(dtype),
            ("FDPP_D".into(), head_dim.to_string()),
            ("FDPP_HG".into(), hg.to_string()),
        ],
    }
}

/// Causal tiled prefill (sync and async) for one dtype and head_dim.
pub fn attn_prefill_source(dtype: DType, head_dim: usize) -> KernelSource {
    KernelSource {
        uri: format!("attn_prefill_{dtype}_d{head_dim}"),
        text: expand(ATTN_PREFILL),
        defines: vec![dtype_define(dtype), ("FDPP_D".into(), head_dim.to_string())],
    }
}

/// Softmax-input histograms (calibration) for one dtype and head_dim.
pub fn attn_scores_source(dtype: DType, head_dim: usize) -> KernelSource {
    KernelSource {
        uri: format!("attn_scores_{dtype}_d{head_dim}"),
        text: expand(ATTN_SCORES),
        defines: vec![dtype_define(dtype), ("FDPP_D".into(), head_dim.to_string())],
    }
}

/// Query rows per prefill block and keys per tile (must match attn_prefill.cu).
pub const PREFILL_BM: usize = 128;
pub fn prefill_bn(head_dim: usize) -> usize {
    if head_dim == 256 {
        32
    } else {
        64
    }
}

/// Dynamic shared memory of a prefill block: Q, and two stages of K and V.
pub fn prefill_smem_bytes(head_dim: usize) -> u32 {
    ((PREFILL_BM * head_dim + 4 * prefill_bn(head_dim) * head_dim) * 2) as u32
}

/// (rows per warp, warps per row) of a gemv block with `rows_per_block` rows and GEMV_WARPS warps.
pub fn gemv_layout(rows_per_block: u32) -> (u32, u32) {
    let r = rows_per_block.clamp(1, 4 * GEMV_WARPS);
    if r >= GEMV_WARPS {
        (r / GEMV_WARPS, 1)
    } else {
        (1, GEMV_WARPS / r)
    }
}

/// Shared memory a flat_gemm block needs for MT n8-tiles of M (must match the kernel's layout:
/// STAGES × (B_N + 8·MT) rows of B_K; the K-split reduction reuses it, a static_assert there).
pub fn flat_smem_bytes(bn: u32, mt: u32, stages: u32) -> u32 {
    let bk = FLAT_STAGE_KB * 512 / bn;
    stages * (bn * bk + 8 * mt * bk) * 2
}

/// n8-tiles of M per flat_gemm block (FlashDecoding++ §4 pads M to 8): M up to 64 in one block,
/// so that W is read from memory once; larger M takes more blocks along y, each re-reading W
/// (the tuner's M2 shows where ImplC takes over).
pub fn flat_mt(m: usize) -> u32 {
    match m {
        0..=8 => 1,
        9..=16 => 2,
        17..=32 => 4,
        _ => 8,
    }
}

pub fn flat_stages(spec: &GemmSpec) -> u32 {
    spec.stages.unwrap_or(FLAT_STAGES[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC gets one text per spec: every repository header it includes must have been pasted
    /// in by `expand` (a header added to a kernel but not there fails only at compile time, in
    /// CI's `kernels check` or on the GPU).
    #[test]
    fn every_kernel_source_has_its_headers_expanded() {
        for src in all_sources() {
            assert!(
                !src.text.contains("#include \""),
                "{}: an #include \"...\" left unexpanded",
                src.uri
            );
        }
    }

    #[test]
    fn the_kernel_hash_covers_every_gemm_launch_constant() {
        let c = gemm_launch_constants();
        for name in [
            "GEMV_ROWS_PER_BLOCK",
            "FLAT_BN",
            "FLAT_STAGES",
            "FLAT_STAGE_KB",
            "GEMV_INFLIGHT",
            "GEMV_WARPS",
            "FLAT_WARPS",
            "GEMV_GLU_LAYOUT",
        ] {
            assert!(c.contains(&format!("{name}=")), "{name} missing from {c}");
        }
        assert_ne!(kernel_hash(), hash_files(FILES), "the constants must enter the hash");
    }

    /// The shipped H100 profiles were measured with these sources and constants: a change to
    /// either must come with a re-tune (`fdpp tune` on the H100), or they are refused at load.
    #[test]
    fn the_shipped_h100_profiles_record_this_builds_kernel_hash() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/nvidia-h100-80gb-hbm3");
        let want = kernel_hash();
        let mut seen = 0;
        for e in std::fs::read_dir(&dir).expect("profiles dir") {
            let path = e.expect("entry").path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("profile");
            let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
            let got = v["provenance"]["kernel_hash"].as_str().unwrap_or_default();
            assert_eq!(got, want, "{}", path.display());
            seen += 1;
        }
        assert!(seen >= 3, "{seen} profiles in {}", dir.display());
    }

    #[test]
    fn m_up_to_64_takes_one_block_along_m() {
        let tiles = |m: usize| 8 * flat_mt(m) as usize;
        for m in 1..=64 {
            assert!(tiles(m) >= m, "M = {m} needs more than one block along M");
            assert!(tiles(m) < 2 * m.max(8), "M = {m} pads past twice its rows");
        }
        assert_eq!(flat_mt(65), 8);
        assert_eq!(flat_mt(8), 1);
        assert_eq!(flat_mt(9), 2);
        assert_eq!(flat_mt(17), 4);
        assert_eq!(flat_mt(33), 8);
    }

    #[test]
    fn double_buffering_fits_the_h100_at_every_m_tile() {
        // 227 KiB of shared memory per block on sm_90 (and on sm_80): every B_N must run with
        // two stages at every M tiling, so that M = 64 never leaves the tuner without ImplB.
        for &bn in FLAT_BN {
            for mt in [1, 2, 4, 8] {
                assert!(flat_smem_bytes(bn, mt, 2) <= 227 * 1024, "B_N {bn}, MT {mt}");
            }
        }
        // The stage layout: W tile of FLAT_STAGE_KB KiB plus 8·MT rows of x, per stage.
        assert_eq!(flat_smem_bytes(32, 8, 2), 2 * (32 + 64) * 512 * 2);
    }

    #[test]
    fn every_flat_candidate_is_offered_in_both_dtypes() {
        for dt in [DType::F16, DType::Bf16] {
            let flat = all_gemm_specs(dt)
                .into_iter()
                .filter(|s| s.imp == GemmImpl::FlatGemm)
                .count();
            assert_eq!(flat, FLAT_BN.len() * FLAT_STAGES.len());
        }
    }
}
