//! `fdpp bench gemm` through the binary, on the CPU backend.

use std::process::Command;

use fdpp::report::{csv, json, GemmRecord};

fn fdpp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
}

#[test]
fn bench_gemm_on_cpu_writes_csv_json_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let seed: u32 = rand::random();
    let out = fdpp()
        .args([
            "bench",
            "gemm",
            "--model",
            // The HF fixture's O [K=256, N=128]: llama2-7b's 4096 × 4096 took ~40 s of a debug
            // `cargo test` for the same code paths.
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama-gqa"),
            "--backend",
            "cpu",
            "--shape",
            "o",
        ])
        .args(["--m", "2,1", "--reps", "2", "--warmup", "0", "--format", "json"])
        .args(["--seed", &seed.to_string(), "--report-dir"])
        .arg(&out_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr:\n{stderr}");

    // stdout is pure JSON (paths and notes go to stderr), the same rows as the file.
    let stdout = String::from_utf8(out.stdout).unwrap();
    let printed: Vec<GemmRecord> = serde_json::from_str(&stdout).unwrap();
    let csv_path = out_dir.join("gemm-llama-gqa.csv");
    let json_path = out_dir.join("gemm-llama-gqa.json");
    let svg_path = out_dir.join("gemm-llama-gqa-o.svg");
    for p in [&csv_path, &json_path, &svg_path] {
        assert!(p.is_file(), "missing {}", p.display());
        assert!(
            stderr.contains(&p.display().to_string()),
            "path not printed: {}",
            p.display()
        );
    }
    let from_csv = csv::read_csv(&csv_path).unwrap();
    let from_json = json::read_json(&json_path).unwrap();
    use fdpp::backend::Backend;
    let rows = 2 * fdpp::backend::cpu::CpuBackend::new()
        .gemm_candidates(fdpp::dtype::DType::F16, 128, 256)
        .len();
    assert_eq!(from_csv.len(), rows, "every CPU candidate × 2 M");
    assert_eq!(from_json.len(), rows);
    assert_eq!(printed.len(), rows);

    let mut seen = Vec::new();
    for r in &from_csv {
        assert_eq!(
            (r.model.as_str(), r.shape.as_str(), r.k, r.n),
            ("llama-gqa", "o", 256, 128)
        );
        assert_eq!(r.backend, "cpu");
        assert_eq!(r.fdpp_version, fdpp::VERSION);
        assert!(!r.git_commit.is_empty() && !r.device.is_empty());
        assert_eq!(r.samples, 2);
        assert!(
            r.min_us > 0.0 && r.min_us <= r.median_us && r.median_us <= r.max_us,
            "{r:?}"
        );
        assert!(
            r.nmse.is_finite() && r.nmse <= fdpp::dtype::DType::F16.nmse_limit(),
            "{r:?}"
        );
        assert!(r.gbps > 0.0 && r.gflops > 0.0);
        // A share of the memory roofline, never above it (a row served from a cache has none).
        assert!(r.roofline_pct.is_none_or(|p| p > 0.0 && p <= 100.0), "{r:?}");
        assert!(r.speedup_vs_gemm.is_some_and(|s| s > 0.0), "{r:?}");
        if r.imp == "gemm" {
            assert!(r.speedup_vs_gemm.is_some_and(|s| (s - 1.0).abs() < 1e-12));
        }
        seen.push((r.imp.clone(), r.m));
    }
    seen.sort();
    seen.dedup();
    let mut want: Vec<(String, usize)> = ["flat_gemm", "gemm", "gemv"]
        .iter()
        .flat_map(|i| [1, 2].map(|m| (i.to_string(), m)))
        .collect();
    want.sort();
    assert_eq!(seen, want);

    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.starts_with("<svg"));
    assert!(svg.contains("llama-gqa o [K=256, N=128] on "));
}

fn fails_with(args: &[&str], needle: &str) {
    let out = fdpp().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(stderr.contains(needle), "{args:?}: stderr {stderr:?} lacks {needle:?}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let base = ["bench", "gemm", "--model", "llama2-7b", "--backend", "cpu"];
    let with = |extra: &[&'static str]| base.iter().copied().chain(extra.iter().copied()).collect::<Vec<_>>();
    fails_with(
        &with(&["--impl", "auto", "--profile", "/nonexistent/p.json"]),
        "no profile at /nonexistent/p.json",
    );
    fails_with(&with(&["--impl", "gemv,cutlass"]), "unknown implementation 'cutlass'");
    fails_with(&with(&["--shape", "lm_head"]), "unknown shape 'lm_head'");
    fails_with(&with(&["--m", "0,4"]), "M must be at least 1");
    fails_with(
        &["bench", "gemm", "--model", "no-such-model", "--backend", "cpu"],
        "unknown model preset 'no-such-model'",
    );
    fails_with(
        &with(&["--profile", "/nonexistent/p.json"]),
        "--profile is used by --impl auto",
    );
}
