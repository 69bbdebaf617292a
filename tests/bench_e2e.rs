//! `fdpp bench e2e` on the CPU backend with a tiny random-weight model: every row and column
//! present, positive and finite; the report files; the profile vs `none` ratio (with a profile
//! tuned by the test); activations with reuse vs without; the largest-batch search; and every
//! bad input as a clear message with a non-zero exit.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// A small Llama with GQA; its context of 64 tokens makes "too long" easy to ask for.
const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 128,
  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
  "max_position_embeddings": 64, "eos_token_id": 2}"#;

struct Fixture {
    _tmp: tempfile::TempDir,
    /// The model directory (config.json only: weights are random).
    model: String,
    /// Working directory of the runs (profiles/ is looked up here).
    cwd: std::path::PathBuf,
    out: std::path::PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("tiny-e2e");
    std::fs::create_dir_all(&model).expect("model dir");
    std::fs::write(model.join("config.json"), CONFIG).expect("config");
    let cwd = tmp.path().join("cwd");
    std::fs::create_dir_all(&cwd).expect("cwd");
    Fixture {
        model: model.to_str().expect("utf-8").to_string(),
        out: tmp.path().join("out"),
        cwd,
        _tmp: tmp,
    }
}

impl Fixture {
    fn run(&self, more: &[&str]) -> Output {
        let out = self.out.to_str().expect("utf-8");
        let mut args = vec![
            "bench",
            "e2e",
            "--backend",
            "cpu",
            "--random-weights",
            "--model",
            &self.model,
            "--out",
            out,
            "--seed",
        ];
        let seed = rand::random::<u32>().to_string();
        args.push(&seed);
        args.extend(more);
        Command::new(env!("CARGO_BIN_EXE_fdpp"))
            .args(&args)
            .current_dir(&self.cwd)
            .output()
            .expect("fdpp runs")
    }
}

fn ok(out: &Output) -> String {
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "failed:\nstdout: {so}\nstderr: {se}");
    so
}

fn fails(out: &Output, needles: &[&str]) -> String {
    let se = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "should fail: {se}");
    assert!(!se.contains("panicked"), "{se}");
    for n in needles {
        assert!(se.contains(n), "stderr lacks {n:?}: {se}");
    }
    se
}

fn rows(stdout: &str) -> Vec<Value> {
    let v: Value = serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    v.as_array().expect("an array of rows").clone()
}

fn num(r: &Value, key: &str) -> f64 {
    r[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {r}"))
}

/// The timing and memory columns of a measured row: present, positive, finite.
const POSITIVE: [&str; 12] = [
    "ttft_ms",
    "tpot_ms",
    "decode_tok_s",
    "e2e_tok_s",
    "total_ms",
    "attn_rows",
    "weights_bytes",
    "kv_bytes",
    "act_bytes",
    "peak_bytes",
    "act_bytes_no_reuse",
    "act_vs_no_reuse",
];

fn check_measured(r: &Value) {
    assert_eq!(r["status"], "ok", "{r}");
    for k in POSITIVE {
        let v = num(r, k);
        assert!(v.is_finite() && v > 0.0, "{k} = {v} in {r}");
    }
    assert!(num(r, "recomputed") >= 0.0);
    let (b, g) = (num(r, "batch"), num(r, "gen_len"));
    assert_eq!(num(r, "decode_steps"), g - 1.0, "{r}");
    // decode tok/s = batch / TPOT; peak = weights + KV + activations.
    let want = b / (num(r, "tpot_ms") / 1e3);
    assert!((num(r, "decode_tok_s") / want - 1.0).abs() < 1e-9, "{r}");
    assert_eq!(
        num(r, "peak_bytes"),
        num(r, "weights_bytes") + num(r, "kv_bytes") + num(r, "act_bytes")
    );
    for k in ["fdpp_version", "git_commit", "device", "backend", "model", "softmax"] {
        assert!(r[k].as_str().is_some_and(|s| !s.is_empty()), "{k} in {r}");
    }
    assert_eq!(r["backend"], "cpu");
}

#[test]
fn every_configuration_has_every_column_and_the_report_files_are_written() {
    let f = fixture();
    let stdout = ok(&f.run(&[
        "--batch",
        "1,2",
        "--prompt-len",
        "8,16",
        "--gen-len",
        "4",
        "--profile",
        "none",
        "--format",
        "json",
    ]));
    let rs = rows(&stdout);
    let mut configs: Vec<(u64, u64)> = rs
        .iter()
        .map(|r| {
            (
                r["batch"].as_u64().expect("batch"),
                r["prompt_len"].as_u64().expect("prompt"),
            )
        })
        .collect();
    configs.sort_unstable();
    assert_eq!(configs, [(1, 8), (1, 16), (2, 8), (2, 16)]);
    for r in &rs {
        check_measured(r);
        assert_eq!(r["profile"], "none");
        assert_eq!(r["kind"], "sweep");
        assert_eq!(r["reuse"], true);
        assert_eq!(r["gen_len"], 4);
        // Every attention row of the prefill and the 3 decode steps: tokens × heads × layers.
        let (b, p) = (num(r, "batch"), num(r, "prompt_len"));
        assert_eq!(num(r, "attn_rows"), b * (p + 3.0) * 4.0 * 2.0, "{r}");
    }
    // More sequences need more KV and activations.
    let kv = |b: u64| {
        rs.iter()
            .find(|r| r["batch"] == b && r["prompt_len"] == 16)
            .map(|r| num(r, "kv_bytes"))
            .expect("row")
    };
    assert!(kv(2) > kv(1));

    let stem = f.out.join("e2e-tiny-e2e");
    for ext in ["md", "csv", "json", "svg"] {
        let p = stem.with_extension(ext);
        assert!(p.is_file(), "{} missing", p.display());
    }
    let csv = std::fs::read_to_string(stem.with_extension("csv")).expect("csv");
    assert_eq!(csv.lines().count(), 1 + 4, "{csv}");
    assert!(csv.starts_with("fdpp_version,git_commit,device,backend,model"), "{csv}");
    let md = std::fs::read_to_string(stem.with_extension("md")).expect("md");
    assert!(md.contains("| TTFT ms |") && md.contains("decode tok/s"), "{md}");
    let svg = std::fs::read_to_string(stem.with_extension("svg")).expect("svg");
    assert!(
        svg.contains("prompt 8, none") && svg.contains("prompt 16, none"),
        "{}",
        &svg[..200]
    );
    let json: Vec<Value> = rows(&std::fs::read_to_string(stem.with_extension("json")).expect("json"));
    assert_eq!(json.len(), 4);
}

#[test]
fn reuse_both_reports_activation_memory_with_and_without_reuse() {
    let f = fixture();
    let stdout = ok(&f.run(&[
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--profile",
        "none",
        "--reuse",
        "both",
        "--format",
        "json",
    ]));
    let rs = rows(&stdout);
    assert_eq!(rs.len(), 2);
    let with = rs.iter().find(|r| r["reuse"] == true).expect("reuse row");
    let without = rs.iter().find(|r| r["reuse"] == false).expect("no-reuse row");
    check_measured(with);
    check_measured(without);
    let ratio = num(with, "act_vs_no_reuse");
    assert!(ratio <= 0.8, "reuse uses {ratio} of the no-reuse activations");
    assert_eq!(num(with, "act_bytes") / num(without, "act_bytes"), ratio);
    assert_eq!(num(without, "act_vs_no_reuse"), 1.0);
    assert_eq!(num(with, "kv_bytes"), num(without, "kv_bytes"));
}

#[test]
fn with_a_tuned_profile_both_variants_run_and_the_ratio_is_reported() {
    let f = fixture();
    let tune = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args([
            "tune",
            "--backend",
            "cpu",
            "--model",
            &f.model,
            "--m-max",
            "4",
            "--reps",
            "1",
        ])
        .current_dir(&f.cwd)
        .output()
        .expect("tune runs");
    ok(&tune);
    // No --profile: the default path exists now, so both variants run.
    let stdout = ok(&f.run(&[
        "--batch",
        "1,2",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--format",
        "json",
    ]));
    let rs = rows(&stdout);
    assert_eq!(rs.len(), 4);
    for r in &rs {
        check_measured(r);
        let ratio = num(r, "decode_vs_none");
        assert!(ratio.is_finite() && ratio > 0.0);
        if r["profile"] == "profile" {
            assert!(
                r["profile_path"].as_str().is_some_and(|p| p.ends_with("tiny-e2e.json")),
                "{r}"
            );
            let none = rs
                .iter()
                .find(|o| o["profile"] == "none" && o["batch"] == r["batch"])
                .expect("none row");
            let want = num(r, "decode_tok_s") / num(none, "decode_tok_s");
            assert!((ratio / want - 1.0).abs() < 1e-9);
        } else {
            assert_eq!(r["profile"], "none");
            assert!(r["profile_path"].is_null());
        }
    }
    // `--profile both` says so when there is no profile to compare.
    let g = fixture();
    fails(
        &g.run(&[
            "--batch",
            "1",
            "--prompt-len",
            "8",
            "--gen-len",
            "3",
            "--profile",
            "both",
        ]),
        &["--profile both: no profile at", "fdpp tune"],
    );
}

#[test]
fn max_batch_search_runs_the_largest_batch_that_fits() {
    let f = fixture();
    let stdout = ok(&f.run(&[
        "--batch",
        "1",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--profile",
        "none",
        "--max-batch-search",
        "--max-batch-limit",
        "3",
    ]));
    assert!(stdout.contains("| max 3 |"), "{stdout}");
    assert!(
        stdout.contains("largest batch that fits at prompt 8 + gen 3: 3"),
        "{stdout}"
    );
    assert!(stdout.contains("highest achievable throughput:"), "{stdout}");
    let json = std::fs::read_to_string(f.out.join("e2e-tiny-e2e.json")).expect("json");
    let rs = rows(&json);
    let max = rs.iter().find(|r| r["kind"] == "max_batch").expect("max_batch row");
    check_measured(max);
    assert_eq!(max["batch"], 3);
}

#[test]
fn bad_inputs_fail_clearly_and_other_configurations_still_run() {
    let f = fixture();
    let base = ["--profile", "none", "--gen-len", "3"];
    let with = |more: &[&str]| {
        let mut v = base.to_vec();
        v.extend(more);
        f.run(&v)
    };
    fails(
        &with(&["--batch", "0", "--prompt-len", "8"]),
        &["--batch", "at least 1"],
    );
    fails(
        &with(&["--batch", "1", "--prompt-len", "8,0"]),
        &["--prompt-len", "at least 1"],
    );
    fails(
        &f.run(&[
            "--profile",
            "none",
            "--batch",
            "1",
            "--prompt-len",
            "8",
            "--gen-len",
            "1",
        ]),
        &["--gen-len must be at least 2"],
    );
    let preset = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args([
            "bench",
            "e2e",
            "--backend",
            "cpu",
            "--model",
            "llama2-7b",
            "--batch",
            "1",
        ])
        .current_dir(&f.cwd)
        .output()
        .expect("runs");
    fails(&preset, &["is a preset", "--random-weights"]);

    // 62 + 3 tokens exceed the context of 64: that configuration is refused, prompt 8 runs, the
    // report has both, the exit is non-zero.
    let out = with(&["--batch", "1", "--prompt-len", "8,62", "--format", "json"]);
    let se = fails(
        &out,
        &["65 tokens", "context of 64", "1 of 2 row(s) could not be measured"],
    );
    assert!(se.contains("refused"), "{se}");
    let rs = rows(&String::from_utf8_lossy(&out.stdout));
    let short = rs.iter().find(|r| r["prompt_len"] == 8).expect("prompt 8 row");
    check_measured(short);
    let long = rs.iter().find(|r| r["prompt_len"] == 62).expect("prompt 62 row");
    assert_eq!(long["status"], "refused");
    assert!(long["ttft_ms"].is_null() && long["error"].as_str().is_some_and(|e| e.contains("context")));

    // Ten million sequences cannot fit any host: the row says how much they need, batch 1 runs.
    let out = with(&["--batch", "1,10000000", "--prompt-len", "8", "--format", "json"]);
    fails(&out, &["does not fit", "it needs", "GiB"]);
    let rs = rows(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rs.len(), 2);
    check_measured(rs.iter().find(|r| r["batch"] == 1).expect("batch 1"));
    let huge = rs.iter().find(|r| r["batch"] == 10_000_000).expect("huge row");
    assert_eq!(huge["status"], "does not fit");
    assert!(num(huge, "peak_bytes") > 1e11, "{huge}");
    assert!(Path::new(&f.out.join("e2e-tiny-e2e.md")).is_file());
}
