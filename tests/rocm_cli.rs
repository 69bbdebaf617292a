//! The ROCm backend on a machine without an AMD GPU: `fdpp devices` says why ROCm is unavailable,
//! the HIP kernel list matches what CI compiles, and (ignored unless hiprtc is installed, run by
//! .ci/run) every kernel compiles through hiprtc in child processes, an aborting hiprtc target
//! fails one row instead of the whole check, compile errors carry the log, and the code-object
//! cache hits on the second compile.

use std::process::Command;

use fdpp::backend::rocm::{hiprtc, sources};

fn fdpp(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .output()
        .expect("run fdpp")
}

#[test]
fn devices_says_why_rocm_is_unavailable() {
    let out = fdpp(&["devices"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let rocm = stdout.lines().find(|l| l.starts_with("rocm:")).expect("a rocm line");
    if let Some(reason) = rocm.strip_prefix("rocm: unavailable: ") {
        // Either the runtime is missing, or it loaded and found no GPU: both name the library.
        assert!(reason.contains("libamdhip64"), "{reason}");
        assert!(
            reason.contains("could be loaded") || reason.contains("hipInit failed"),
            "{reason}"
        );
    } else {
        assert!(
            stdout.contains("arch gfx"),
            "an available ROCm backend lists gfx devices: {stdout}"
        );
    }
}

#[test]
fn devices_json_carries_the_rocm_reason() {
    let out = fdpp(&["devices", "--format", "json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rocm = v
        .as_array()
        .and_then(|a| a.iter().find(|b| b["backend"] == "rocm"))
        .expect("a rocm entry");
    if rocm["available"] == false {
        assert!(
            rocm["reason"].as_str().is_some_and(|r| r.contains("libamdhip64")),
            "{rocm}"
        );
    }
}

#[test]
fn opening_rocm_without_a_gpu_is_a_clean_error() {
    let out = fdpp(&["check", "--backend", "rocm", "--quick"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        assert!(stderr.contains("rocm backend unavailable"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn kernels_list_names_every_hip_spec() {
    let out = fdpp(&["kernels", "list", "--backend", "rocm"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(&sources::kernel_hash()), "{stdout}");
    for s in sources::all_sources() {
        assert!(stdout.contains(&s.uri), "{} missing from\n{stdout}", s.uri);
    }
}

#[test]
fn the_hipcc_script_compiles_the_specs_fdpp_uses() {
    let script = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/hip_compile_check.sh"))
        .expect("scripts/hip_compile_check.sh");
    let rows: Vec<String> = sources::GEMV_ROWS.iter().map(|r| r.to_string()).collect();
    let bns: Vec<String> = sources::FLAT_BN.iter().map(|b| b.to_string()).collect();
    assert!(
        script.contains(&format!("for rows in {}; do", rows.join(" "))),
        "gemv rows drifted"
    );
    assert!(
        script.contains(&format!("for bn in {}; do", bns.join(" "))),
        "flat_gemm B_N drifted"
    );
    assert!(script.contains("gfx90a gfx940"), "CI targets");
    assert!(script.contains(&format!("-DFDPP_INFLIGHT={}", sources::GEMV_INFLIGHT)));
}

#[test]
fn the_hiprtc_child_rejects_an_unknown_spec() {
    let out = fdpp(&["kernels", "hiprtc-child", "--arch", "gfx90a", "--uri", "gemv_f16_bn999"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no HIP kernel spec named gemv_f16_bn999"), "{stderr}");
}

#[test]
#[ignore = "needs hiprtc (Debian: apt-get install libamdhip64-dev); run by .ci/run"]
fn hiprtc_compiles_every_kernel_for_gfx90a_in_children() {
    let out = fdpp(&["kernels", "check", "--backend", "rocm", "--arch", "gfx90a"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n = sources::all_sources().len();
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.starts_with("| gfx90a |") && l.contains("| ok |"))
            .count(),
        n
    );
    assert!(stdout.contains(&format!("all {n} HIP kernel compiles succeeded")));
}

#[test]
#[ignore = "needs hiprtc; ROCm 5.2's hiprtc aborts on gfx1100, newer ones compile it"]
fn an_unknown_target_fails_its_rows_without_killing_the_check() {
    let out = fdpp(&["kernels", "check", "--backend", "rocm", "--arch", "gfx1100"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Every spec has a row: the parent outlived each child.
    let rows = stdout.lines().filter(|l| l.starts_with("| gfx1100 |")).count();
    assert_eq!(rows, sources::all_sources().len(), "{stdout}");
    if !out.status.success() {
        // flat_gemm has no RDNA path, so at least it fails; with 5.2 every child aborts.
        assert!(stderr.contains("hiprtc child"), "{stderr}");
        assert!(stderr.contains("HIP kernel compiles failed"), "{stderr}");
    }
}

#[test]
#[ignore = "needs hiprtc; run by .ci/run"]
fn hiprtc_errors_carry_the_log_and_the_cache_hits_the_second_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::env::set_var("FDPP_CACHE_DIR", dir.path());
    let mut bad = sources::all_sources().remove(0);
    bad.uri = "broken_kernel".into();
    bad.text
        .push_str("\n__global__ void fdpp_broken() { this_is_not_declared(); }\n");
    let e = hiprtc::compile_code_object(&bad, "gfx90a").expect_err("must not compile");
    let msg = e.to_string();
    assert!(
        msg.contains("broken_kernel") && msg.contains("this_is_not_declared"),
        "{msg}"
    );

    let good = sources::all_sources().remove(0);
    let mut warnings = vec![];
    let (a, first) = hiprtc::code_object_cached(&good, "gfx90a", &mut |w| warnings.push(w)).expect("compiles");
    let (b, second) = hiprtc::code_object_cached(&good, "gfx90a", &mut |w| warnings.push(w)).expect("cached");
    assert_eq!(first, hiprtc::CacheUse::Compiled, "{warnings:?}");
    assert_eq!(second, hiprtc::CacheUse::Hit);
    assert_eq!(a, b);
    let path = hiprtc::cache_path(&good, "gfx90a").expect("a cache path");
    assert!(path.starts_with(dir.path()) && path.is_file());
    // An AMD code object is an ELF file.
    assert_eq!(&a[..4], b"\x7fELF");
}
