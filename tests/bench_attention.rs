//! `fdpp bench attention` through the binary, on the CPU backend: rows, columns, files, the peer
//! merge, and clear refusals of bad input.

use std::path::Path;
use std::process::{Command, Output};

use fdpp::check::attention::attention_nmse_limit;
use fdpp::dtype::DType;
use fdpp::ops::attention::num_splits;
use fdpp::report::attention::{attention_csv_header, read_attention_csv, AttnRecord};

fn fdpp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
}

/// The tiny geometry of these tests: GQA ratio 2, head_dim 64.
const TINY: [&str; 6] = ["--heads", "4", "--kv-heads", "2", "--head-dim", "64"];

fn run_ok(args: &[&str], out_dir: &Path) -> (Vec<AttnRecord>, String) {
    let out: Output = fdpp()
        .args(["bench", "attention", "--backend", "cpu"])
        .args(TINY)
        .args(args)
        .args([
            "--format",
            "json",
            "--seed",
            &rand::random::<u32>().to_string(),
            "--out",
        ])
        .arg(out_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{args:?}\nstderr:\n{stderr}");
    // stdout is pure JSON (paths and notes go to stderr).
    let printed: Vec<AttnRecord> = serde_json::from_slice(&out.stdout).unwrap();
    (printed, stderr)
}

fn finite_pos(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// What every timed fdpp row must hold.
fn assert_common(r: &AttnRecord, phase: &str, reps: usize) {
    assert_eq!((r.phase.as_str(), r.dtype.as_str()), (phase, "f16"), "{r:?}");
    assert_eq!((r.heads, r.kv_heads, r.head_dim, r.page_size), (4, 2, 64, 16));
    assert_eq!(r.backend, "cpu");
    assert_eq!(r.fdpp_version, fdpp::VERSION);
    assert!(!r.git_commit.is_empty() && !r.device.is_empty());
    assert_eq!(r.samples, reps);
    assert!(
        finite_pos(r.min_us) && r.min_us <= r.median_us && r.median_us <= r.max_us,
        "{r:?}"
    );
    assert!(finite_pos(r.tbps) && finite_pos(r.tflops), "{r:?}");
    let secs = r.median_us * 1e-6;
    assert!((r.tbps - r.bytes / secs / 1e12).abs() <= 1e-9 * r.tbps, "{r:?}");
    assert!((r.tflops - r.flops / secs / 1e12).abs() <= 1e-9 * r.tflops, "{r:?}");
    assert!(r.roofline_pct.is_some_and(finite_pos), "{r:?}");
    assert!(
        r.nmse
            .is_some_and(|e| e.is_finite() && e <= attention_nmse_limit(DType::F16)),
        "{r:?}"
    );
    assert!(r.speedup_vs_sync.is_some_and(finite_pos), "{r:?}");
    if r.variant == "sync" {
        assert_eq!(r.speedup_vs_sync, Some(1.0));
    }
    assert_eq!(r.speedup_vs_sdpa, None);
    if phase == "decode" {
        assert_eq!(r.append_us, None, "{r:?}");
    }
    let rows = r.rows.unwrap();
    let queries = if phase == "decode" { r.batch } else { r.batch * r.kv_len };
    assert_eq!(rows, queries * 4, "one row per (query, head): {r:?}");
    let rate = r.recompute_rate.unwrap();
    assert_eq!(rate, r.recomputed.unwrap() as f64 / rows as f64);
}

#[test]
fn decode_bench_writes_every_variant_with_its_columns_and_files() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let (printed, stderr) = run_ok(
        &["--batch", "2,1", "--kv-len", "97,300", "--reps", "2", "--warmup", "0"],
        &out_dir,
    );
    let stems = ["md", "csv", "json", "svg"].map(|e| out_dir.join(format!("attention-decode.{e}")));
    for p in &stems {
        assert!(p.is_file(), "missing {}", p.display());
        assert!(
            stderr.contains(&p.display().to_string()),
            "path not printed: {}",
            p.display()
        );
    }
    let from_csv = read_attention_csv(&stems[1]).unwrap();
    assert_eq!(from_csv, printed, "the CSV holds the rows printed");

    // Every (batch, kv_len) × {sync, async, naive}.
    let mut seen: Vec<(usize, usize, String)> =
        printed.iter().map(|r| (r.batch, r.kv_len, r.variant.clone())).collect();
    seen.sort();
    let mut want = Vec::new();
    for b in [1, 2] {
        for l in [97, 300] {
            for v in ["async", "naive", "sync"] {
                want.push((b, l, v.to_string()));
            }
        }
    }
    assert_eq!(seen, want);
    let cpu_threads = {
        use fdpp::backend::Backend;
        fdpp::backend::cpu::CpuBackend::new().info().compute_units as usize
    };
    for r in &printed {
        assert_common(r, "decode", 2);
        assert!(
            r.roofline.starts_with("copy ") && r.roofline.ends_with("GB/s measured"),
            "{r:?}"
        );
        // K and V once (2 kv heads · 64), q and out once (4 heads · 64), 2 bytes each.
        let bytes = (2 * r.batch * r.kv_len * 128 + 2 * r.batch * 256) * 2;
        assert_eq!(r.bytes, bytes as f64);
        assert_eq!(r.flops, (4 * 4 * 64 * r.batch * r.kv_len) as f64);
        assert_eq!(
            r.recomputed,
            Some(0),
            "random scores stay inside the default window: {r:?}"
        );
        let splits = if r.variant == "naive" {
            1
        } else {
            num_splits(r.batch, 2, r.kv_len, cpu_threads)
        };
        assert_eq!(r.splits, Some(splits), "{r:?}");
        assert!(
            r.scheme
                == if r.variant == "async" {
                    "async(phi=0,a=-60,b=20)"
                } else {
                    "sync"
                },
            "{r:?}"
        );
    }

    let md = std::fs::read_to_string(&stems[0]).unwrap();
    assert!(
        md.starts_with("# fdpp bench attention decode, cpu f16 h4/kv2 d64 page 16"),
        "{md}"
    );
    assert!(
        md.contains("| batch | kv_len | variant") && md.contains("% copy BW"),
        "{md}"
    );
    let svg = std::fs::read_to_string(&stems[3]).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("attention decode h4/kv2 d64 f16 on "));
    assert!(svg.contains("naive b=2") && svg.contains("effective TB/s"));
}

#[test]
fn prefill_bench_reports_tflops_against_the_nominal_peak() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, _) = run_ok(
        &[
            "--phase",
            "prefill",
            "--batch",
            "1",
            "--kv-len",
            "33,64",
            "--reps",
            "2",
            "--warmup",
            "0",
            "--peak-tflops",
            "100",
        ],
        dir.path(),
    );
    let mut seen: Vec<(usize, &str)> = rows.iter().map(|r| (r.kv_len, r.variant.as_str())).collect();
    seen.sort();
    assert_eq!(seen, [(33, "async"), (33, "sync"), (64, "async"), (64, "sync")]);
    for r in &rows {
        assert_common(r, "prefill", 2);
        assert_eq!(r.splits, None);
        // Causal from empty: 2 · B · H · L² · D.
        assert_eq!(r.flops, (2 * 4 * r.kv_len * r.kv_len * 64) as f64);
        assert_eq!(r.roofline, "100 TFLOP/s nominal");
        assert!((r.roofline_pct.unwrap() - r.tflops).abs() <= 1e-9 * r.tflops, "{r:?}");
        // The cache write is timed beside the attention, not inside its median.
        assert!(r.append_us.is_some_and(|u| u > 0.0 && u.is_finite()), "{r:?}");
    }
    let md = std::fs::read_to_string(dir.path().join("attention-prefill.md")).unwrap();
    assert!(md.contains("cache write µs (not in median)"), "{md}");
    assert!(dir.path().join("attention-prefill.svg").is_file());
}

/// `hopper_diag=1|2` builds the Hopper prefill without its loads or its exponentials (output
/// garbage by design): its variants are timed without the reference check, the run says so, and
/// the rows carry no NMSE. (The CPU ignores the switch; the unchecked path is the same.)
#[test]
fn a_diagnostic_build_is_timed_without_the_check_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--phase", "prefill", "--batch", "1", "--kv-len", "33", "--reps", "1", "--warmup", "0",
    ];
    let mut diag = args.to_vec();
    diag.extend(["--set", "hopper_diag=2"]);
    let (rows, stderr) = run_ok(&diag, dir.path());
    assert!(stderr.contains("timed without the reference check"), "{stderr}");
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r.nmse, None, "{r:?}");
        assert!(finite_pos(r.median_us) && finite_pos(r.tflops), "{r:?}");
    }
    // Without the switch the same run is checked.
    let (rows, stderr) = run_ok(&args, dir.path());
    assert!(!stderr.contains("reference check"), "{stderr}");
    assert!(rows.iter().all(|r| r.nmse.is_some()), "{rows:?}");
}

#[test]
fn a_window_that_every_score_leaves_recomputes_every_async_row() {
    let dir = tempfile::tempdir().unwrap();
    // Scores are about ±8; with φ = −20 every x − φ is above b = 1.
    let (rows, _) = run_ok(
        &[
            "--batch",
            "2",
            "--kv-len",
            "97",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--variant",
            "sync,async",
            "--phi",
            "-20",
            "--range",
            "-1,1",
        ],
        dir.path(),
    );
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_common(r, "decode", 1);
        let want = if r.variant == "async" { r.rows } else { Some(0) };
        assert_eq!(r.recomputed, want, "{r:?}");
    }
    let asy = rows.iter().find(|r| r.variant == "async").unwrap();
    assert_eq!(asy.scheme, "async(phi=-20,a=-1,b=1)");
    assert_eq!(asy.recompute_rate, Some(1.0));
}

#[test]
fn peer_rows_join_the_table_with_a_ratio() {
    let dir = tempfile::tempdir().unwrap();
    let header = attention_csv_header().unwrap();
    // As the peer script prints it: a preamble, then rows with the optional columns empty.
    let peer = format!(
        "device NVIDIA H100 80GB HBM3, torch 2.11\n{header}\n\
         torch-2.11,cuda-13.0,NVIDIA H100,torch,decode,f16,4,2,64,0,1,97,sdpa,sdpa(enable_gqa),,30,7.5,7.0,9.0,50688.0,99328.0,0.0068,0.013,0.2,copy 2980 GB/s measured,,,,,,,\n\
         torch-2.11,cuda-13.0,NVIDIA H100,torch,decode,f16,4,2,64,0,8,97,sdpa,sdpa(enable_gqa),,30,7.5,7.0,9.0,50688.0,99328.0,0.0068,0.013,0.2,copy 2980 GB/s measured,,,,,,,\n"
    );
    let peer_path = dir.path().join("sdpa.csv");
    std::fs::write(&peer_path, peer).unwrap();
    let (rows, stderr) = run_ok(
        &[
            "--batch",
            "1",
            "--kv-len",
            "97",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--peer",
            peer_path.to_str().unwrap(),
        ],
        &dir.path().join("out"),
    );
    assert!(stderr.contains("--peer: 1 of 2 rows match"), "{stderr}");
    assert!(stderr.contains("compares different devices"), "{stderr}");
    let sdpa = rows.iter().find(|r| r.variant == "sdpa").expect("sdpa row");
    assert_eq!(sdpa.speedup_vs_sdpa, Some(1.0));
    assert_eq!(sdpa.rows, None);
    // Judged against this run's copy bandwidth, not the file's.
    assert!(!sdpa.roofline.contains("2980"), "{sdpa:?}");
    for r in rows.iter().filter(|r| r.variant != "sdpa") {
        assert_eq!(r.speedup_vs_sdpa, Some(7.5 / r.median_us), "{r:?}");
    }
}

#[test]
fn the_peer_script_prints_the_report_columns() {
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/torch_attention_peer.py")).unwrap();
    let start = script.find("COLUMNS = [").expect("COLUMNS list in the script");
    let body = &script[start..];
    let body = &body[..body.find(']').unwrap()];
    let cols: Vec<&str> = body.split('"').skip(1).step_by(2).collect();
    assert_eq!(cols.join(","), attention_csv_header().unwrap());
}

fn fails_with(extra: &[&str], needle: &str) {
    let out = fdpp()
        .args(["bench", "attention", "--backend", "cpu", "--reps", "1"])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{extra:?} succeeded");
    assert!(stderr.contains(needle), "{extra:?}: stderr {stderr:?} lacks {needle:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn forced_splits_reach_sync_and_async_and_stay_correct() {
    let dir = tempfile::tempdir().unwrap();
    let (printed, _) = run_ok(
        &[
            "--batch", "2", "--kv-len", "300", "--splits", "7", "--reps", "2", "--warmup", "0",
        ],
        &dir.path().join("out"),
    );
    assert_eq!(printed.len(), 3);
    for r in &printed {
        // Every row was checked against the reference before it was timed (assert_common).
        assert_common(r, "decode", 2);
        let want = if r.variant == "naive" { 1 } else { 7 };
        assert_eq!(r.splits, Some(want), "{r:?}");
    }
}

#[test]
fn bad_input_is_refused_with_the_reason() {
    let most = fdpp::ops::attention::MAX_SPLITS;
    fails_with(&["--splits", "0"], &format!("--splits 0: must be 1..={most}"));
    let over = (most + 1).to_string();
    fails_with(&["--splits", &over], &format!("--splits {over}: must be 1..={most}"));
    fails_with(
        &["--phase", "prefill", "--splits", "2"],
        "--splits applies to --phase decode",
    );
    fails_with(&["--head-dim", "96"], "head_dim 96; supported: [64, 128, 256]");
    fails_with(
        &["--heads", "20", "--kv-heads", "8"],
        "num_heads 20 is not a multiple of num_kv_heads 8",
    );
    fails_with(&["--kv-len", "97,0"], "--kv-len: kv_len must be at least 1");
    fails_with(&["--batch", "0"], "--batch: batch must be at least 1");
    fails_with(&["--range", "0,100"], "e^(b−a) = e^100 overflows fp32");
    fails_with(&["--range", "5,1"], "a must be below b");
    fails_with(&["--range", "-5"], "expected two numbers a,b");
    fails_with(
        &["--variant", "sync,flash"],
        "unknown variant 'flash'; valid: sync, async, naive",
    );
    fails_with(&["--phase", "prefill", "--variant", "naive"], "prefill has no splits");
    fails_with(&["--page-size", "0"], "--page-size");
    fails_with(&["--peer", "/nonexistent/sdpa.csv"], "/nonexistent/sdpa.csv");
    fails_with(&["--batch", "4096", "--kv-len", "1048576"], "lower --batch or --kv-len");
}
