//! The portable instantiation of the CPU kernels. On an AVX2 machine the CPU backend always runs
//! its AVX2 build, so this test binary (its own process, one test) asks for the portable one
//! through FDPP_CPU_ISA before anything reads it.

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::Backend;
use fdpp::check::{check_gemm, GemmCase, Status};
use fdpp::dtype::DType;
use fdpp::ops::gemm::GemmDims;

#[test]
fn portable_kernels_pass_the_odd_cases() {
    std::env::set_var("FDPP_CPU_ISA", "portable");
    let b = CpuBackend::new();
    if cfg!(target_arch = "x86_64") {
        assert!(b.info().arch.ends_with("+portable"), "arch {}", b.info().arch);
    }
    let mut rows = Vec::new();
    for dtype in [DType::F16, DType::Bf16] {
        for (m, n, k) in [(1, 1000, 263), (17, 133, 1031), (8, 67, 4097)] {
            let case = GemmCase {
                dims: GemmDims::new(m, n, k).expect("nonzero"),
                dtype,
            };
            let specs = b.gemm_candidates(dtype, n, k);
            rows.extend(check_gemm(&b, &specs, &[case], 21).expect("check ran"));
        }
    }
    assert_eq!(rows.len(), 6 * 4);
    for r in &rows {
        assert_eq!(r.status, Status::Pass, "{} {} {}", r.spec, r.dtype, r.dims.label());
    }
}
