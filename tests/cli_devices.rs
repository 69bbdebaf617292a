//! `fdpp devices` lists every backend with a reason when it is unavailable, and never panics
//! when a GPU library is missing.

use std::process::Command;

fn fdpp(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .output()
        .expect("run fdpp")
}

#[test]
fn devices_lists_every_backend_with_a_reason() {
    let out = fdpp(&["devices"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.contains("cpu: available"), "{stdout}");
    let cuda = stdout.lines().find(|l| l.starts_with("cuda:")).expect("a cuda line");
    if cuda.starts_with("cuda: unavailable") {
        // No driver on this machine: the reason names the library that is missing or the cause.
        assert!(cuda.len() > "cuda: unavailable: ".len() + 10, "{cuda}");
    } else {
        assert!(
            stdout.contains("sm_"),
            "an available CUDA backend lists its devices: {stdout}"
        );
    }
    assert!(stdout.lines().any(|l| l.starts_with("rocm:")), "{stdout}");
}

#[test]
fn devices_json_is_machine_readable() {
    let out = fdpp(&["devices", "--format", "json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let arr = v.as_array().expect("array of backends");
    assert_eq!(arr.len(), 3);
    for b in arr {
        let available = b["available"].as_bool().expect("available flag");
        assert!(available || b["reason"].is_string(), "{b}");
    }
}

#[test]
fn asking_for_cuda_without_a_gpu_is_a_clean_error() {
    let out = fdpp(&["check", "--backend", "cuda", "--quick"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let probe = fdpp(&["devices"]);
    if String::from_utf8_lossy(&probe.stdout).contains("cuda: unavailable") {
        assert!(!out.status.success());
        assert!(stderr.contains("cuda"), "{stderr}");
    }
}
