//! The CUDA backend against the f64 reference: every kernel spec on the full odd-size case list
//! (the same harness as `fdpp check --backend cuda`), plus the JIT cache and bad-input paths.
//! Run on a GPU machine with `cargo test -- --ignored`.

use fdpp::backend::cuda::{jit, sources, CudaBackend};
use fdpp::backend::Backend;
use fdpp::check::{check_gemm, gemm_cases, Status};
use fdpp::dtype::DType;
use fdpp::error::FdppError;

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_cuda_gemm_spec_matches_the_reference() {
    let b = CudaBackend::open(0).expect("CUDA device 0");
    let mut failed = vec![];
    let mut passed = 0;
    for case in gemm_cases() {
        let specs = b.gemm_candidates(case.dtype, case.dims.n, case.dims.k);
        for r in check_gemm(&b, &specs, std::slice::from_ref(&case), 7).expect("check ran") {
            match r.status {
                Status::Pass => passed += 1,
                Status::Skipped(_) => {}
                Status::Fail(why) => failed.push(format!("{} {}: {why}", r.spec, r.dims.label())),
            }
        }
    }
    assert!(failed.is_empty(), "{} failures:\n{}", failed.len(), failed.join("\n"));
    assert!(passed > 100, "too few checks ran: {passed}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_device_that_does_not_exist_is_a_clean_error() {
    match CudaBackend::open(4096) {
        Err(FdppError::InvalidArgument(msg)) => assert!(msg.contains("4096"), "{msg}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("device 4096 opened"),
    }
}

#[test]
#[ignore = "needs NVRTC"]
fn nvrtc_rejects_an_unknown_arch_with_its_log() {
    let src = sources::all_sources().into_iter().next().expect("a source");
    match jit::compile_cubin(&src, "sm_7") {
        Err(FdppError::Compile { spec, log, .. }) => {
            assert_eq!(spec, src.uri);
            assert!(!log.is_empty());
        }
        other => panic!("expected a compile error, got {:?}", other.map(|c| c.len())),
    }
}

#[test]
#[ignore = "needs NVRTC"]
fn the_cubin_cache_hits_on_the_second_compile_and_misses_after_an_edit() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::env::set_var("FDPP_CACHE_DIR", dir.path());
    let src = sources::gemm_source(&sources::all_gemm_specs(DType::F16)[0]).expect("gemv source");
    let mut warns = vec![];
    let (_, first) = jit::cubin_cached(&src, "sm_90a", &mut |w| warns.push(w)).expect("compile");
    let (_, second) = jit::cubin_cached(&src, "sm_90a", &mut |w| warns.push(w)).expect("cached");
    assert_eq!(first, jit::CacheUse::Compiled);
    assert_eq!(second, jit::CacheUse::Hit);
    let mut edited = src.clone();
    edited.text.push_str("\n// edited\n");
    let (_, third) = jit::cubin_cached(&edited, "sm_90a", &mut |w| warns.push(w)).expect("recompile");
    assert_eq!(third, jit::CacheUse::Compiled);
    // An unwritable cache directory only costs a warning.
    std::env::set_var("FDPP_CACHE_DIR", "/proc/fdpp-no-such-dir");
    let (_, fourth) = jit::cubin_cached(&edited, "sm_90a", &mut |w| warns.push(w)).expect("in memory");
    assert_eq!(fourth, jit::CacheUse::CompiledUncached);
    assert_eq!(warns.len(), 1, "{warns:?}");
}

#[test]
#[ignore = "needs NVRTC"]
fn the_cubin_cache_is_filled_by_kernels_check() {
    // `kernels check --fill-cache` stores the CUBIN under the name the runtime looks up
    // (jit::cache_path: spec URI and a hash of its text, defines and arch).
    let dir = tempfile::tempdir().expect("tempdir");
    let src = sources::attn_decode_source(DType::F16, 64, 1);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args([
            "kernels",
            "check",
            "--arch",
            "sm_90a",
            "--only",
            &src.uri,
            "--fill-cache",
        ])
        .env("FDPP_CACHE_DIR", dir.path())
        .output()
        .expect("run fdpp");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all 1 kernel compiles succeeded"), "{stdout}");
    let want = jit::cache_path(&src, "sm_90a").expect("a cache path");
    let name = want.file_name().expect("a file name");
    let stored = dir.path().join(fdpp::VERSION).join("sm_90a").join(name);
    let bytes = std::fs::read(&stored).unwrap_or_else(|e| panic!("{}: {e}", stored.display()));
    assert!(bytes.starts_with(b"\x7fELF"), "{} is not a CUBIN", stored.display());
}

#[test]
#[ignore = "needs NVRTC"]
fn nvrtc_compiles_every_layer_kernel_entry_point() {
    use fdpp::backend::layer_plan::LayerKernel;
    for dt in [DType::F16, DType::Bf16] {
        let src = sources::layer_source(dt);
        for arch in ["sm_80", "sm_90a"] {
            let cubin = jit::compile_cubin(&src, arch).unwrap_or_else(|e| panic!("{e}"));
            for k in LayerKernel::ALL {
                // Entry points are exported symbols of the CUBIN (an ELF): their names are in it.
                let name = k.name().as_bytes();
                let nul_terminated: Vec<u8> = name.iter().copied().chain([0]).collect();
                assert!(
                    cubin
                        .windows(nul_terminated.len())
                        .any(|w| w == nul_terminated.as_slice()),
                    "{} on {arch}: no entry point {}",
                    src.uri,
                    k.name()
                );
            }
        }
    }
}
