//! The HIP kernel sources (kernels_hip/), embedded in the binary, and the compile-time
//! specialisations of each, in the shape of the CUDA backend's `sources.rs`.

use super::launch::GEMV_WAVES;
pub use crate::backend::kernel_cache::KernelSource;
use crate::backend::kernel_cache::{dtype_define, hash_files};
use crate::dtype::DType;
use crate::ops::gemm::{GemmImpl, GemmSpec};

const COMMON: &str = include_str!("../../../kernels_hip/common.h");
const GEMV: &str = include_str!("../../../kernels_hip/gemv.hip");
const FLAT_GEMM: &str = include_str!("../../../kernels_hip/flat_gemm.hip");
const LAYER: &str = include_str!("../../../kernels_hip/layer.hip");
const ATTN_DECODE: &str = include_str!("../../../kernels_hip/attn_decode.hip");
const ATTN_PREFILL: &str = include_str!("../../../kernels_hip/attn_prefill.hip");

const FILES: &[(&str, &str)] = &[
    ("common.h", COMMON),
    ("gemv.hip", GEMV),
    ("flat_gemm.hip", FLAT_GEMM),
    ("layer.hip", LAYER),
    ("attn_decode.hip", ATTN_DECODE),
    ("attn_prefill.hip", ATTN_PREFILL),
];

/// Rows per wavefront offered for gemv, and B_N offered for flat_gemm (FlashDecoding++ §4: B_N
/// is chosen per shape by the tuner). No pipeline-depth axis: the AMD flat_gemm does not stage
/// through LDS (see kernels_hip/flat_gemm.hip).
pub const GEMV_ROWS: &[u32] = &[1, 2, 4];
pub const FLAT_BN: &[u32] = &[32, 64, 128, 256];
pub use super::launch::GEMV_INFLIGHT;

/// SHA-256 over all HIP kernel sources and the launch constants offered to the tuner, hex,
/// first 16 digits (as on CUDA: a profile measures both).
pub fn kernel_hash() -> String {
    let constants = format!("GEMV_ROWS={GEMV_ROWS:?}\nFLAT_BN={FLAT_BN:?}\nGEMV_INFLIGHT={GEMV_INFLIGHT}");
    let mut files = FILES.to_vec();
    files.push(("launch constants", constants.as_str()));
    hash_files(&files)
}

fn expand(file: &str) -> String {
    file.replace("#include \"common.h\"", COMMON)
}

/// The source of a GEMM spec, or None for ImplC (rocBLAS: nothing to compile).
pub fn gemm_source(spec: &GemmSpec) -> Option<KernelSource> {
    match spec.imp {
        GemmImpl::Gemv => Some(KernelSource {
            uri: spec.uri(),
            text: expand(GEMV),
            defines: vec![
                dtype_define(spec.dtype),
                ("FDPP_ROWS".into(), gemv_rows(spec).to_string()),
                ("FDPP_INFLIGHT".into(), GEMV_INFLIGHT.to_string()),
            ],
        }),
        GemmImpl::FlatGemm => Some(KernelSource {
            uri: spec.uri(),
            text: expand(FLAT_GEMM),
            defines: vec![
                dtype_define(spec.dtype),
                ("FDPP_BN".into(), spec.block_n.unwrap_or(64).to_string()),
            ],
        }),
        GemmImpl::Gemm => None,
    }
}

/// Rows of W per wavefront of a gemv spec (its block_n counts rows per block).
pub fn gemv_rows(spec: &GemmSpec) -> u32 {
    (spec.block_n.unwrap_or(2 * GEMV_WAVES) / GEMV_WAVES).max(1)
}

/// The compiled GEMM candidates of one dtype (every rows/B_N).
pub fn all_gemm_specs(dtype: DType) -> Vec<GemmSpec> {
    let mut v: Vec<GemmSpec> = GEMV_ROWS
        .iter()
        .map(|r| GemmSpec::new(GemmImpl::Gemv, dtype).with_block_n(r * GEMV_WAVES))
        .collect();
    v.extend(
        FLAT_BN
            .iter()
            .map(|&bn| GemmSpec::new(GemmImpl::FlatGemm, dtype).with_block_n(bn)),
    );
    v
}

/// The small per-layer ops of one dtype (kernels_hip/layer.hip), one module with every entry
/// point of [`crate::backend::layer_plan::LayerKernel`].
pub fn layer_source(dtype: DType) -> KernelSource {
    KernelSource {
        uri: format!("layer_{dtype}"),
        text: expand(LAYER),
        defines: vec![dtype_define(dtype)],
    }
}

/// Every kernel source fdpp compiles for ROCm.
pub fn all_sources() -> Vec<KernelSource> {
    let dtypes = [DType::F16, DType::Bf16];
    let mut v: Vec<KernelSource> = dtypes
        .iter()
        .flat_map(|&dt| all_gemm_specs(dt))
        .filter_map(|s| gemm_source(&s))
        .collect();
    v.extend(dtypes.iter().map(|&dt| layer_source(dt)));
    for dt in dtypes {
        for &d in &crate::ops::attention::SUPPORTED_HEAD_DIMS {
            for &hg in ATTN_HEADS_PER_BLOCK {
                v.push(attn_decode_source(dt, d, hg));
            }
            v.push(attn_prefill_source(dt, d));
        }
    }
    v
}

pub use crate::backend::attn_plan::ATTN_HEADS_PER_BLOCK;

/// Split-KV decode (sync, combine, async; kernels_hip/attn_decode.hip) for one dtype, head_dim
/// and heads-per-block; the same URIs as the CUDA specs, compiled for a gfx arch.
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

/// Causal prefill on MFMA (sync and async; kernels_hip/attn_prefill.hip) for one dtype and
/// head_dim. CDNA2/3 only.
pub fn attn_prefill_source(dtype: DType, head_dim: usize) -> KernelSource {
    KernelSource {
        uri: format!("attn_prefill_{dtype}_d{head_dim}"),
        text: expand(ATTN_PREFILL),
        defines: vec![dtype_define(dtype), ("FDPP_D".into(), head_dim.to_string())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_is_self_contained_and_uniquely_named() {
        let all = all_sources();
        let attn = crate::ops::attention::SUPPORTED_HEAD_DIMS.len() * (ATTN_HEADS_PER_BLOCK.len() + 1);
        assert_eq!(all.len(), 2 * (GEMV_ROWS.len() + FLAT_BN.len() + 1 + attn));
        let mut uris: Vec<&str> = all.iter().map(|s| s.uri.as_str()).collect();
        uris.sort();
        uris.dedup();
        assert_eq!(uris.len(), all.len());
        for s in &all {
            assert!(!s.text.contains("#include \"common.h\""), "{}", s.uri);
            assert!(s.text.contains("wave_sum") || s.text.contains("mfma"), "{}", s.uri);
        }
    }

    #[test]
    fn gemv_block_n_maps_to_rows_per_wave() {
        for &r in GEMV_ROWS {
            let s = GemmSpec::new(GemmImpl::Gemv, DType::Bf16).with_block_n(r * GEMV_WAVES);
            assert_eq!(gemv_rows(&s), r);
            let src = gemm_source(&s).unwrap();
            assert!(src.defines.contains(&("FDPP_ROWS".into(), r.to_string())));
            assert!(src.defines.contains(&("FDPP_BF16".into(), "1".into())));
        }
        assert!(gemm_source(&GemmSpec::new(GemmImpl::Gemm, DType::F16)).is_none());
    }

    #[test]
    fn each_dtype_has_one_layer_module() {
        for dt in [DType::F16, DType::Bf16] {
            let s = layer_source(dt);
            assert_eq!(s.uri, format!("layer_{dt}"));
            assert_eq!(s.defines, vec![dtype_define(dt)]);
            assert!(s.text.contains("add_rmsnorm_v") && s.text.contains("wave_sum"));
            assert!(all_sources().contains(&s));
        }
    }

    #[test]
    fn attention_specs_name_every_parameter_and_keep_the_cuda_uris() {
        for dt in [DType::F16, DType::Bf16] {
            for d in [64, 128, 256] {
                for hg in [1, 2, 4] {
                    let s = attn_decode_source(dt, d, hg);
                    assert_eq!(s.uri, crate::backend::cuda::sources::attn_decode_source(dt, d, hg).uri);
                    assert!(s.defines.contains(&("FDPP_D".into(), d.to_string())));
                    assert!(s.defines.contains(&("FDPP_HG".into(), hg.to_string())));
                    assert!(s.text.contains("attn_decode_async") && s.text.contains("attn_combine"));
                    assert!(!s.text.contains("asm"), "no inline assembly in the HIP port");
                }
                let s = attn_prefill_source(dt, d);
                assert_eq!(s.uri, crate::backend::cuda::sources::attn_prefill_source(dt, d).uri);
                assert!(s.text.contains("attn_prefill_async") && s.text.contains("__builtin_amdgcn_mfma"));
                assert!(all_sources().contains(&s));
            }
        }
    }

    #[test]
    fn the_hash_differs_from_the_cuda_kernels() {
        assert_eq!(kernel_hash().len(), 16);
        assert_ne!(kernel_hash(), crate::backend::cuda::sources::kernel_hash());
    }
}
