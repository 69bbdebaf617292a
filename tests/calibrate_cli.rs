//! `fdpp tune --calibrate` end to end on the CPU backend with tiny HF directories written by the
//! tests: the profile's softmax section (window, coverage, samples, per layer, held-out
//! validation), the report files, `profile show`, the GEMM sweep kept and keeping the section,
//! the engine running sync when the section disables async, and bad inputs.

use std::path::Path;
use std::process::{Command, Output};

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 128,
  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
  "max_position_embeddings": 256, "eos_token_id": 2}"#;

fn fdpp(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("fdpp runs")
}

fn ok(out: &Output) -> (String, String) {
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "failed:\nstdout: {so}\nstderr: {se}");
    (so, se)
}

fn fails(out: &Output, needles: &[&str]) {
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {se}");
    assert!(!se.contains("panicked"), "{se}");
    for n in needles {
        assert!(se.contains(n), "stderr lacks {n:?}: {se}");
    }
}

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("config.json"), CONFIG).expect("config");
    dir
}

/// A word-level tokenizer over "w0".."w255" plus a few words of the built-in prompts.
fn word_tokenizer(dir: &Path) {
    let vocab: Vec<String> = (0..256).map(|i| format!("\"w{i}\": {i}")).collect();
    let json = format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {{"type": "WhitespaceSplit"}},
            "post_processor": null, "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "w0"}}}}"#,
        vocab.join(", ")
    );
    std::fs::write(dir.join("tokenizer.json"), json).expect("tokenizer");
}

fn profile_json(work: &Path) -> (std::path::PathBuf, serde_json::Value) {
    let dir = work.join("profiles");
    let dev = std::fs::read_dir(&dir)
        .expect("profiles/")
        .next()
        .expect("a device")
        .expect("entry");
    let file = std::fs::read_dir(dev.path())
        .expect("dir")
        .next()
        .expect("a profile")
        .expect("entry");
    let text = std::fs::read_to_string(file.path()).expect("read");
    (file.path(), serde_json::from_str(&text).expect("json"))
}

const CAL: [&str; 6] = ["tune", "--backend", "cpu", "--calibrate", "--prompt-len", "48"];

#[test]
fn calibration_writes_the_section_the_report_and_profile_show_prints_it() {
    let dir = model_dir();
    let d = dir.path().to_str().expect("utf-8");
    let work = tempfile::tempdir().expect("work");
    let mut args = CAL.to_vec();
    args.extend(["--model", d]);
    let (so, se) = ok(&fdpp(&args, work.path()));
    assert!(so.contains("random weights, not of the trained model"), "{so}");
    assert!(so.contains("no GEMM sweep"), "{so}");
    assert!(so.contains("held-out (4 prompts"), "{so}");
    assert!(
        so.contains("(ok, ≤ 1e-3; sync vs sync with 64-token prefill chunks differs by"),
        "{so}"
    );
    assert!(so.contains("greedy tokens the same"), "{so}");
    let (path, p) = profile_json(work.path());
    let sm = &p["softmax"];
    assert_eq!(sm["enabled"], true);
    let (phi, a, b) = (
        sm["phi"].as_f64().expect("phi"),
        sm["a"].as_f64().expect("a"),
        sm["b"].as_f64().expect("b"),
    );
    assert!(a < 0.0 && b > 0.0 && b - a <= 60.0, "{sm}");
    let (min, max) = (sm["min"].as_f64().expect("min"), sm["max"].as_f64().expect("max"));
    assert!(
        phi + a <= min && phi + b >= max,
        "the random model's scores all fit: {sm}"
    );
    assert!(sm["coverage"].as_f64().expect("coverage") >= 0.9999);
    assert_eq!(sm["target_coverage"], 0.9999);
    assert!(sm["samples"].as_u64().expect("samples") > 10_000);
    assert_eq!(sm["per_layer"].as_array().expect("layers").len(), 2);
    assert_eq!(sm["recompute_rate"], 0.0, "every held-out score inside the window");
    assert!(sm["validated_logit_diff"].as_f64().expect("diff") <= 1e-3);
    assert_eq!(sm["validated_same_tokens"], true);
    assert_eq!(p["shapes"].as_array().expect("shapes").len(), 0);
    // The report.
    let report: Vec<&str> = se.lines().filter_map(|l| l.strip_prefix("report: ")).collect();
    assert_eq!(report.len(), 3, "{se}");
    let csv = std::fs::read_to_string(work.path().join(report[0])).expect("csv");
    assert!(csv.starts_with("bin_lo,bin_hi,count,in_window,layer0,layer1\n"));
    assert_eq!(csv.lines().count(), 1 + 1024 + 2);
    let svg = std::fs::read_to_string(work.path().join(report[1])).expect("svg");
    assert!(svg.contains("<svg") && svg.contains("φ+a = ") && svg.contains("φ+b = "));
    assert!(report[1].ends_with("-softmax.svg"));
    // The comparison of windows: sync, global, per-layer, side by side in the text report and
    // in the profile; the distribution against the paper's range.
    let md = std::fs::read_to_string(work.path().join(report[2])).expect("md");
    assert!(report[2].ends_with("-softmax.md"));
    for row in [
        "| sync |",
        "| async, global window |",
        "| async, per-layer windows |",
        "distribution: ",
    ] {
        assert!(md.contains(row), "report lacks {row:?}: {md}");
    }
    assert!(
        so.contains("held-out async vs sync, per-layer windows: logits max diff"),
        "{so}"
    );
    let cmp = sm["comparison"].as_array().expect("comparison");
    let kinds: Vec<&str> = cmp.iter().map(|r| r["windows"].as_str().expect("windows")).collect();
    assert_eq!(kinds, ["sync", "global", "per_layer"]);
    for r in &cmp[1..] {
        assert_eq!(r["same_tokens"], true, "{r}");
        assert!(r["logit_diff"].as_f64().expect("diff") <= 1e-3, "{r}");
        let (ppl, sync_ppl) = (r["ppl"].as_f64().expect("ppl"), cmp[0]["ppl"].as_f64().expect("ppl"));
        assert!((ppl / sync_ppl - 1.0).abs() < 1e-3, "{r}");
        assert!(r["ppl_tokens"].as_u64().expect("tokens") > 0);
    }
    // Random weights' scores sit near 0, inside the paper's Llama2-7B range.
    assert!(sm["paper_range_share"].as_f64().expect("share") > 0.999, "{sm}");
    // profile show.
    let (show, _) = ok(&fdpp(&["profile", "show", path.to_str().expect("utf-8")], work.path()));
    assert!(show.contains("## Softmax"), "{show}");
    assert!(show.contains(&format!("phi = {phi:.3}")), "{show}");
    assert!(show.contains("held-out validation: recompute rate 0.0000 %"), "{show}");
    assert!(show.contains("| layer | phi |"), "{show}");
    assert!(
        show.contains("| async, per-layer windows |") && show.contains("Llama2-7B range"),
        "{show}"
    );
    let (json, _) = ok(&fdpp(
        &["profile", "show", path.to_str().expect("utf-8"), "--format", "json"],
        work.path(),
    ));
    let j: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(j["softmax"]["phi"], sm["phi"]);

    // generate reads the window; a section that disables async makes it run sync, saying why.
    let gen = [
        "generate",
        "--backend",
        "cpu",
        "--random-weights",
        "--model",
        d,
        "--token-ids",
        "1,2,3",
    ];
    let mut g = gen.to_vec();
    g.extend(["--max-tokens", "2"]);
    let (_, se) = ok(&fdpp(&g, work.path()));
    assert!(se.contains("from the profile, coverage"), "{se}");
    let mut p2 = p.clone();
    p2["softmax"]["enabled"] = false.into();
    p2["softmax"]["reason"] = "99.99 % of the softmax inputs span [-70, 40]".into();
    std::fs::write(&path, serde_json::to_string(&p2).expect("json")).expect("write");
    let (_, se) = ok(&fdpp(&g, work.path()));
    assert!(
        se.contains("softmax: sync (the profile disables async for this model: 99.99 % of the softmax inputs span"),
        "{se}"
    );
    let (show, _) = ok(&fdpp(&["profile", "show", path.to_str().expect("utf-8")], work.path()));
    assert!(show.contains("async DISABLED: 99.99 %"), "{show}");
}

#[test]
fn an_existing_gemm_profile_is_kept_and_a_later_sweep_keeps_the_section() {
    let dir = model_dir();
    word_tokenizer(dir.path());
    let d = dir.path().to_str().expect("utf-8");
    let work = tempfile::tempdir().expect("work");
    let sweep = ["tune", "--model", d, "--backend", "cpu", "--m-max", "2", "--reps", "1"];
    ok(&fdpp(&sweep, work.path()));
    let (_, before) = profile_json(work.path());
    let shapes = before["shapes"].as_array().expect("shapes").len();
    assert!(shapes > 0);
    let mut args = CAL.to_vec();
    args.extend(["--model", d, "--decode-steps", "2", "--coverage", "0.999"]);
    let (so, _) = ok(&fdpp(&args, work.path()));
    assert!(so.contains("GEMM sweep skipped"), "{so}");
    assert!(
        so.contains("built-in text prompts: 8 calibration prompts, 4 held out"),
        "{so}"
    );
    let (_, p) = profile_json(work.path());
    assert_eq!(p["shapes"], before["shapes"]);
    assert_eq!(p["softmax"]["target_coverage"], 0.999);
    let section = p["softmax"].clone();
    let (_, se) = ok(&fdpp(&sweep, work.path()));
    assert!(se.contains("kept the calibrated section"), "{se}");
    let (_, after) = profile_json(work.path());
    assert_eq!(after["softmax"], section);
}

#[test]
fn prompt_files_and_bad_inputs() {
    let dir = model_dir();
    let d = dir.path().to_str().expect("utf-8");
    let work = tempfile::tempdir().expect("work");
    let run = |more: &[&str]| {
        let mut args = CAL.to_vec();
        args.extend(["--model", d]);
        args.extend(more);
        fdpp(&args, work.path())
    };
    fails(&run(&["--coverage", "0"]), &["--coverage 0", "(0, 1]"]);
    fails(&run(&["--held-out", "0"]), &["--held-out must be at least 1"]);
    let f = work.path().join("p.txt");
    std::fs::write(&f, "hello there\n").expect("write");
    let fs = f.to_str().expect("utf-8");
    fails(&run(&["--prompts", fs]), &["line 1", "tokenizer.json", "token ids"]);
    std::fs::write(&f, "1,2,3\n4,5,6,7\n").expect("write");
    fails(&run(&["--prompts", fs]), &["holds 2 prompts", "--held-out 4"]);
    std::fs::write(&f, "1,2,3\n4,5,6,7\n\n9,300\n").expect("write");
    fails(
        &run(&["--prompts", fs, "--held-out", "1"]),
        &["token id 300", "vocabulary"],
    );
    let ids: Vec<String> = (0..5)
        .map(|i| {
            (0..20)
                .map(|t| ((t * 7 + i * 13) % 256).to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    std::fs::write(&f, ids.join("\n")).expect("write");
    let (so, _) = ok(&run(&["--prompts", fs, "--held-out", "2", "--decode-steps", "1"]));
    assert!(so.contains(": 3 calibration prompts, 2 held out"), "{so}");
    assert!(work.path().join("profiles").read_dir().expect("dir").next().is_some());
}
