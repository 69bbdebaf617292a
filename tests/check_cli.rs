//! `fdpp check` from the command line.

use std::process::Command;

#[test]
fn quick_cpu_check_passes_and_prints_every_row() {
    let out = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args([
            "check",
            "--backend",
            "cpu",
            "--quick",
            "--op",
            "gemm",
            "--format",
            "json",
        ])
        .output()
        .expect("run fdpp");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fdpp check failed: {stderr}");
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = rows.as_array().expect("an array of rows");
    // 8 cases in 2 dtypes, 4 CPU candidates each.
    assert_eq!(rows.len(), 64);
    for r in rows {
        assert_eq!(r["status"], "pass", "{r}");
        assert_eq!(r["backend"], "cpu");
        assert!(r["nmse"].as_f64().is_some_and(|e| e < 1e-4), "{r}");
        assert!(r["m"].as_u64().is_some() && r["n"].as_u64().is_some() && r["k"].as_u64().is_some());
    }
    assert!(stderr.contains("64 passed, 0 failed"), "{stderr}");
}

#[test]
fn an_unavailable_backend_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(["check", "--backend", "rocm", "--quick"])
        .output()
        .expect("run fdpp");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rocm backend unavailable"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
