//! The CPU GEMM implementations against the f64 reference, through the same harness as
//! `fdpp check`; and the harness itself, against backends broken on purpose.

use fdpp::backend::cpu::hooked::HookedCpu;
use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::Backend;
use fdpp::check::{check_gemm, gemm_cases_quick, CheckRow, GemmCase, Status};
use fdpp::dtype::DType;
use fdpp::error::FdppError;
use fdpp::ops::gemm::{GemmDims, GemmImpl, GemmSpec};

fn assert_all_pass(rows: &[CheckRow], expected_rows: usize) {
    assert_eq!(rows.len(), expected_rows, "one row per spec and case of its dtype");
    let bad: Vec<String> = rows
        .iter()
        .filter(|r| r.status != Status::Pass)
        .map(|r| format!("{} {} {}: {:?}", r.spec, r.dtype, r.dims.label(), r.status))
        .collect();
    assert!(bad.is_empty(), "{} checks did not pass:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn every_cpu_candidate_passes_the_quick_cases() {
    let b = CpuBackend::new();
    let cases = gemm_cases_quick();
    let mut rows = Vec::new();
    let mut expected = 0;
    for case in &cases {
        let specs = b.gemm_candidates(case.dtype, case.dims.n, case.dims.k);
        let imps: Vec<GemmImpl> = specs.iter().map(|s| s.imp).collect();
        for imp in GemmImpl::ALL {
            assert!(imps.contains(&imp), "CPU candidates lack {imp}");
        }
        expected += specs.len();
        rows.extend(check_gemm(&b, &specs, std::slice::from_ref(case), 11).expect("check ran"));
    }
    assert_all_pass(&rows, expected);
}

#[test]
fn odd_block_sizes_pass() {
    // B_N that divide nothing, a B_N of 1, and blocks wider than N (one block of N rows).
    let b = CpuBackend::new();
    let dt = DType::Bf16;
    let case = GemmCase {
        dims: GemmDims::new(5, 133, 1031).expect("nonzero"),
        dtype: dt,
    };
    let specs: Vec<GemmSpec> = [
        (GemmImpl::Gemv, 7),
        (GemmImpl::FlatGemm, 1),
        (GemmImpl::FlatGemm, 5),
        (GemmImpl::FlatGemm, 1000),
        (GemmImpl::Gemm, 33),
        (GemmImpl::Gemm, 4096),
    ]
    .iter()
    .map(|&(imp, bn)| GemmSpec::new(imp, dt).with_block_n(bn))
    .collect();
    let rows = check_gemm(&b, &specs, &[case], 3).expect("check ran");
    assert_all_pass(&rows, specs.len());
}

#[test]
fn specs_of_another_dtype_get_no_rows() {
    let b = CpuBackend::new();
    let case = GemmCase {
        dims: GemmDims::new(2, 40, 70).expect("nonzero"),
        dtype: DType::F16,
    };
    let specs = [
        GemmSpec::new(GemmImpl::Gemv, DType::Bf16),
        GemmSpec::new(GemmImpl::Gemv, DType::F16),
    ];
    let rows = check_gemm(&b, &specs, &[case], 1).expect("check ran");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].spec, "gemv_f16");
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let b = CpuBackend::new();
    let dt = DType::F16;
    let d = GemmDims::new(2, 8, 16).expect("nonzero");
    let x = b.upload(dt, &[dt.from_f32(0.5); 2 * 16]).expect("upload");
    let w = b.upload(dt, &[dt.from_f32(0.25); 8 * 16]).expect("upload");
    let mut y = b.alloc(dt, 16).expect("alloc");
    let spec = GemmSpec::new(GemmImpl::FlatGemm, dt);

    let zero_bn = b.gemm(&spec.with_block_n(0), d, &x, &w, &mut y);
    assert!(matches!(zero_bn, Err(FdppError::InvalidArgument(m)) if m.contains("block_n")));

    let mut short_y = b.alloc(dt, 15).expect("alloc");
    assert!(matches!(
        b.gemm(&spec, d, &x, &w, &mut short_y),
        Err(FdppError::Shape { .. })
    ));

    let w_bf16 = b.upload(DType::Bf16, &[0x3f80; 8 * 16]).expect("upload");
    assert!(matches!(
        b.gemm(&spec, d, &x, &w_bf16, &mut y),
        Err(FdppError::InvalidArgument(_))
    ));

    // The valid call writes 0.5 · 0.25 · 16 = 2 everywhere.
    b.gemm(&spec, d, &x, &w, &mut y).expect("valid call");
    let out = b.download(&y).expect("download");
    assert!(out.iter().all(|&v| dt.to_f32(v) == 2.0), "{out:?}");
}

/// How [`broken`] spoils the CPU's correct output.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Adds 8 to the last output element.
    Corrupt,
    /// Leaves the last output element as it was before the run.
    Unwritten,
    /// Writes one element past the end of the output.
    PastEnd,
    /// Declines every M above 4.
    DeclineLargeM,
}

/// The CPU backend with one deliberate fault, to prove the harness catches it.
fn broken(fault: Fault) -> HookedCpu {
    HookedCpu::new(move |inner, spec, dims, x, w, y| {
        let last = dims.m * dims.n - 1;
        let before = y.data[last];
        if matches!(fault, Fault::DeclineLargeM) && dims.m > 4 {
            return Err(FdppError::Unsupported {
                spec: spec.uri(),
                what: format!("M = {} > 4", dims.m),
            });
        }
        inner.gemm(spec, dims, x, w, y)?;
        let dt = spec.dtype;
        match fault {
            Fault::Corrupt => y.data[last] = dt.from_f32(dt.to_f32(y.data[last]) + 8.0),
            Fault::Unwritten => y.data[last] = before,
            Fault::PastEnd => y.data[last + 1] = dt.from_f32(1.0),
            Fault::DeclineLargeM => {}
        }
        Ok(())
    })
}

fn broken_cases() -> Vec<GemmCase> {
    [DType::F16, DType::Bf16]
        .iter()
        .flat_map(|&dtype| {
            [(1, 1000, 263), (17, 133, 1031)].map(|(m, n, k)| GemmCase {
                dims: GemmDims::new(m, n, k).expect("nonzero"),
                dtype,
            })
        })
        .collect()
}

fn rows_of(fault: Fault) -> Vec<CheckRow> {
    let b = broken(fault);
    let mut rows = Vec::new();
    for case in broken_cases() {
        let specs = b.gemm_candidates(case.dtype, case.dims.n, case.dims.k);
        rows.extend(check_gemm(&b, &specs, &[case], 5).expect("check ran"));
    }
    assert_eq!(rows.len(), broken_cases().len() * 4);
    rows
}

fn assert_all_fail(fault: Fault, reason_holds: &str) {
    for r in rows_of(fault) {
        match &r.status {
            Status::Fail(reason) => assert!(reason.contains(reason_holds), "{fault:?}: {reason}"),
            other => panic!(
                "{fault:?} on {} {}: {other:?}, expected a failure",
                r.spec,
                r.dims.label()
            ),
        }
    }
}

#[test]
fn a_corrupted_element_fails() {
    assert_all_fail(Fault::Corrupt, "NMSE");
}

#[test]
fn an_unwritten_element_fails() {
    assert_all_fail(Fault::Unwritten, "not finite");
}

#[test]
fn a_write_past_the_end_fails() {
    assert_all_fail(Fault::PastEnd, "guard");
}

#[test]
fn a_declined_case_is_skipped_not_failed() {
    for r in rows_of(Fault::DeclineLargeM) {
        if r.dims.m > 4 {
            assert!(
                matches!(&r.status, Status::Skipped(m) if m.contains("M = 17")),
                "{:?}",
                r.status
            );
            assert_eq!(r.nmse, None);
        } else {
            assert_eq!(r.status, Status::Pass);
        }
    }
}
