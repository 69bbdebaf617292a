//! `fdpp tune` and `fdpp profile` through the binary: bad input, a small CPU tune end to end,
//! bad profiles, machine checks, and an interrupted tune.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fdpp(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run fdpp")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// An HF-style config.json for a model small enough to tune in a test.
fn write_model(dir: &Path, name: &str, hidden: usize, inter: usize) -> PathBuf {
    let d = dir.join(name);
    fs::create_dir_all(&d).unwrap();
    let cfg = format!(
        r#"{{"model_type": "llama", "hidden_size": {hidden}, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": {inter},
            "vocab_size": 100}}"#
    );
    fs::write(d.join("config.json"), cfg).unwrap();
    d
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn m_max_zero_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let o = fdpp(
        dir.path(),
        &["tune", "--model", "llama2-7b", "--backend", "cpu", "--m-max", "0"],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("--m-max must be at least 1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        listing(dir.path()).is_empty(),
        "nothing written: {:?}",
        listing(dir.path())
    );
}

#[test]
fn decode_pass_without_a_profile_names_the_file_and_the_tune_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("none.json");
    let o = fdpp(
        dir.path(),
        &[
            "tune",
            "--model",
            "llama2-7b",
            "--backend",
            "cpu",
            "--decode-pass",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("none.json") && err.contains("fdpp tune --model llama2-7b"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));
}

#[test]
fn unknown_model_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let o = fdpp(dir.path(), &["tune", "--model", "no-such-model", "--backend", "cpu"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("no-such-model") && err.contains("llama2-7b"), "{err}");
}

#[test]
fn unwritable_out_fails_before_the_sweep_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(dir.path(), "tiny", 64, 96);
    fs::write(dir.path().join("plain"), "x").unwrap();
    let o = fdpp(
        dir.path(),
        &[
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--backend",
            "cpu",
            "--m-max",
            "2",
            "--out",
            "plain/sub/p.json",
        ],
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("plain") && err.contains("cannot create the directory"),
        "{err}"
    );
    assert_eq!(
        listing(dir.path()),
        vec!["plain", "tiny"],
        "no partial profile or report"
    );
    assert_eq!(fs::read_to_string(dir.path().join("plain")).unwrap(), "x");
}

#[test]
fn small_cpu_tune_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(dir.path(), "tiny", 64, 96);
    let o = fdpp(
        dir.path(),
        &[
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--backend",
            "cpu",
            "--m-max",
            "3",
            "--reps",
            "1",
            "--format",
            "csv",
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("backend: cpu"), "{err}");
    // Default paths: profiles/<device-slug>/<model>.json and reports/tune/<device-slug>/.
    let slug = fdpp::backend::cpu::probe().devices[0].slug.clone();
    let profile = dir.path().join("profiles").join(&slug).join("tiny.json");
    assert!(err.contains(&format!("profile: profiles/{slug}/tiny.json")), "{err}");
    assert!(dir.path().join("reports/tune").join(&slug).join("tiny.csv").exists());
    assert!(dir.path().join("reports/tune").join(&slug).join("tiny.json").exists());
    // 4 shapes × 3 M × every CPU candidate, each a CSV row.
    use fdpp::backend::Backend;
    let cands = fdpp::backend::cpu::CpuBackend::new()
        .gemm_candidates(fdpp::dtype::DType::F16, 64, 64)
        .len();
    let rows = out.lines().filter(|l| l.contains("_f16")).count();
    assert_eq!(rows, 4 * 3 * cands, "{out}");
    for s in ["M1=", "M2=", "qkv[K=64,N=128]", "ffn2[K=96,N=64]"] {
        assert!(err.contains(s), "missing {s}: {err}");
    }
    let p = fdpp::profile::Profile::load(&profile).unwrap();
    assert_eq!(p.model.name, "tiny");
    assert_eq!(p.timing.reps, 1);
    // Grouped heads: no decode pass to choose, and the tune says why.
    assert!(
        err.contains("decode pass: tiny groups 2 query heads per kv head"),
        "{err}"
    );
    assert!(p.decode_pass.is_none());
    // --decode-pass alone: the same reason, the profile left as it was.
    let before = fs::read(&profile).unwrap();
    let o = fdpp(
        dir.path(),
        &[
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--backend",
            "cpu",
            "--decode-pass",
        ],
    );
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("query heads per kv head"), "{err}");
    assert_eq!(fs::read(&profile).unwrap(), before);

    let path = profile.to_str().unwrap();
    // show: md, csv, json.
    let o = fdpp(dir.path(), &["profile", "show", path]);
    let (md, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for s in [
        "# Profile: tiny",
        "kernel hash",
        "## ffn1 [K=64, N=192]",
        "| M | gemv µs",
    ] {
        assert!(md.contains(s), "missing {s}: {md}");
    }
    let o = fdpp(dir.path(), &["profile", "show", path, "--format", "csv"]);
    let (csv, _) = text(&o);
    assert!(csv.starts_with("shape,k,n,m1,m2,m,"), "{csv}");
    assert_eq!(csv.lines().count(), 1 + 4 * 3);
    let o = fdpp(dir.path(), &["profile", "show", path, "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["shapes"].as_array().unwrap().len(), 4);
    assert_eq!(v["shapes"][0]["rows"].as_array().unwrap().len(), 3);

    // check: same machine.
    let o = fdpp(dir.path(), &["profile", "check", path]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("matches this machine"), "{out}");
    // check with --model: the same model passes, another is refused.
    let o = fdpp(
        dir.path(),
        &["profile", "check", path, "--model", model.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", text(&o).1);
    let o = fdpp(dir.path(), &["profile", "check", path, "--model", "llama2-7b"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("made for model 'tiny'") && err.contains("fdpp tune --model llama2-7b"),
        "{err}"
    );

    bad_profiles(dir.path(), &fs::read_to_string(&profile).unwrap());
}

/// Variants of a good profile's JSON, each read by `profile show` or `profile check`.
fn bad_profiles(dir: &Path, good: &str) {
    let write = |name: &str, s: &str| {
        let p = dir.join(name);
        fs::write(&p, s).unwrap();
        p.to_str().unwrap().to_string()
    };
    // Truncated.
    let p = write("cut.json", &good[..good.len() * 2 / 3]);
    let o = fdpp(dir, &["profile", "show", &p]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("cut.json") && err.contains("truncated") && err.contains("line "),
        "{err}"
    );
    // Another schema version.
    let p = write(
        "v9.json",
        &good.replace("\"schema_version\": 1,", "\"schema_version\": 9,"),
    );
    let o = fdpp(dir, &["profile", "show", &p]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("v9.json") && err.contains("newer fdpp") && err.contains("fdpp tune"),
        "{err}"
    );
    // Missing.
    let o = fdpp(dir, &["profile", "check", "nope.json"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("nope.json") && err.contains("no such file"), "{err}");
    // Hard mismatch: other kernels.
    let hash = fdpp::backend::Backend::kernel_hash(&fdpp::backend::cpu::CpuBackend::new());
    let p = write(
        "hard.json",
        &good.replace(&format!("\"kernel_hash\": \"{hash}\""), "\"kernel_hash\": \"other\""),
    );
    let o = fdpp(dir, &["profile", "check", &p]);
    let (_, err) = text(&o);
    assert!(!o.status.success(), "a hard mismatch must refuse");
    assert!(
        err.contains("kernel_hash") && err.contains("re-run `fdpp tune"),
        "{err}"
    );
    // Soft mismatch: another driver version is a warning only.
    let p = write(
        "soft.json",
        &good.replacen("\"driver_version\": null", "\"driver_version\": \"1.2.3\"", 1),
    );
    let o = fdpp(dir, &["profile", "check", &p]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning: driver version: profile has 1.2.3"), "{err}");
    assert!(out.contains("usable on this machine"), "{out}");
}

#[test]
fn interrupted_tune_leaves_the_previous_profile_intact() {
    let dir = tempfile::tempdir().unwrap();
    // Large enough that the tune runs for many seconds in a debug build.
    let model = write_model(dir.path(), "mid", 1024, 2048);
    let out = dir.path().join("p.json");
    fs::write(&out, "previous\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args([
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--backend",
            "cpu",
            "--out",
            "p.json",
        ])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the backend is open (the sweep starts right after), then kill it.
    // The reader (and so the pipe) lives until the child is gone.
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.contains("backend: cpu"), "{line}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the tune must not have finished");
    drop(stderr);
    assert_eq!(fs::read_to_string(&out).unwrap(), "previous\n");
    assert_eq!(
        listing(dir.path()),
        vec!["mid", "p-report", "p.json"],
        "no temp file left (the report directory beside --out is made before the sweep)"
    );
}

#[test]
fn a_tune_to_another_file_writes_its_report_beside_it_not_over_the_default_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let model = write_model(tmp.path(), "elsewhere", 64, 96);
    let out = tmp.path().join("mine/elsewhere.json");
    let o = fdpp(
        tmp.path(),
        &[
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--backend",
            "cpu",
            "--m-max",
            "2",
            "--reps",
            "1",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let (_, se) = text(&o);
    assert!(o.status.success(), "{se}");
    assert!(!tmp.path().join("reports").exists(), "nothing under reports/: {se}");
    let report = tmp.path().join("mine/elsewhere-report");
    assert!(report.join("elsewhere.csv").is_file(), "{se}");
    // The report's JSON sits in its own folder: the profile of the same stem is intact.
    assert!(fdpp_profile_loads(&out), "{}", out.display());
}

fn fdpp_profile_loads(path: &Path) -> bool {
    fdpp(Path::new("."), &["profile", "show", path.to_str().unwrap()])
        .status
        .success()
}
