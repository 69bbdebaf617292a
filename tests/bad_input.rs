//! The bad-input catalogue of the hardening issue: each input a new user tried that aborted,
//! was accepted silently or gave a message that pointed the wrong way. Each case asserts a
//! failed exit (not an abort: no signal, no "panicked"), and that the message names the cause
//! and the flag or file to fix.

use std::path::Path;
use std::process::{Command, Output};

const FIXTURE: &str = "tests/fixtures/hf/llama-gqa";

fn fdpp(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("fdpp runs")
}

fn here() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Fails cleanly (exit code 1 or 2, no signal, no panic) with every needle in stderr.
fn refused(args: &[&str], needles: &[&str]) {
    let out = fdpp(args, here());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(1 | 2)),
        "{args:?}: expected a clean failure, got {:?}: {se}",
        out.status
    );
    assert!(!se.contains("panicked"), "{args:?}: {se}");
    for n in needles {
        assert!(se.contains(n), "{args:?}: stderr lacks {n:?}: {se}");
    }
}

fn generate(more: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["generate", "--backend", "cpu", "--model", FIXTURE, "--max-tokens", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(more.iter().map(|s| s.to_string()));
    v
}

fn refused_generate(more: &[&str], needles: &[&str]) {
    let v = generate(more);
    let args: Vec<&str> = v.iter().map(String::as_str).collect();
    refused(&args, needles);
}

#[test]
fn sizes_that_cannot_fit_are_refused_before_anything_is_allocated() {
    refused(
        &[
            "tune",
            "--model",
            "llama2-7b",
            "--backend",
            "cpu",
            "--m-max",
            "1000000000",
        ],
        &["--m-max 1000000000", "65536"],
    );
    refused(
        &[
            "bench",
            "gemm",
            "--model",
            "llama2-7b",
            "--backend",
            "cpu",
            "--m",
            "1000000000",
        ],
        &["--m", "1000000000"],
    );
    // A config that passes validation but whose GEMM inputs need more than the machine has.
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 1048576, "intermediate_size": 1048576,
            "num_hidden_layers": 1, "num_attention_heads": 8192, "num_key_value_heads": 8192,
            "vocab_size": 32000, "max_position_embeddings": 64}"#,
    )
    .expect("write");
    let c = cfg.to_str().expect("utf-8");
    // Fewer rows cannot help when the weight matrix alone is too big: the message says so.
    refused(
        &["tune", "--model", c, "--backend", "cpu", "--m-max", "4"],
        &["GiB", "even at M=1", "whatever --m-max is", "hidden_size"],
    );
    refused(
        &["bench", "gemm", "--model", c, "--backend", "cpu", "--m", "1"],
        &["GiB", "even at M=1", "whatever --m is"],
    );
    // A refused tune leaves nothing behind, not even an empty profiles/<device>/ directory.
    let work = tempfile::tempdir().expect("tmp");
    let out = fdpp(&["tune", "--model", c, "--backend", "cpu", "--m-max", "4"], work.path());
    assert_eq!(out.status.code(), Some(1));
    let left: Vec<_> = std::fs::read_dir(work.path()).expect("dir").collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_tune_past_the_largest_m_is_refused_with_the_bound() {
    // `tune --m-max 100000` ran past 120 s with no estimate: M has an upper bound with a reason.
    refused(
        &["tune", "--model", "llama2-7b", "--backend", "cpu", "--m-max", "100000"],
        &["--m-max 100000", "at most 65536", "vendor GEMM wins"],
    );
    refused(
        &["tune", "--model", "llama2-7b", "--backend", "cpu", "--reps", "0"],
        &["--reps"],
    );
}

#[test]
fn a_config_with_a_zero_size_names_the_field() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("config.json");
    let base = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 64}"#;
    let c = cfg.to_str().expect("utf-8");
    for (layers, vocab, named, not) in [
        ("0", "10", "num_hidden_layers", "vocab_size"),
        ("2", "0", "vocab_size", "num_hidden_layers"),
    ] {
        std::fs::write(&cfg, base.replace("LAYERS", layers).replace("VOCAB", vocab)).expect("write");
        let out = fdpp(&["shapes", "--model", c], here());
        let se = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{se}");
        assert!(se.contains(&format!("{named} is 0")), "{se}");
        assert!(!se.contains(not), "names only the field that is 0: {se}");
    }
}

#[test]
fn a_page_size_that_cannot_fit_names_page_size() {
    refused_generate(
        &["--token-ids", "1", "--page-size", "1000000000"],
        &["--page-size 1000000000", "whole pages", "lower --page-size"],
    );
    refused_generate(&["--token-ids", "1", "--page-size", "0"], &["--page-size"]);
}

#[test]
fn generate_says_why_it_stopped_before_max_tokens_without_json() {
    // The fixture with a context of 24 tokens: a 12-token prompt leaves room for 12.
    let dir = tempfile::tempdir().expect("tmp");
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(here().join(FIXTURE).join(f), dir.path().join(f)).expect("copy");
    }
    let cfg = std::fs::read_to_string(here().join(FIXTURE).join("config.json")).expect("read");
    let cfg = cfg.replace("\"max_position_embeddings\": 512", "\"max_position_embeddings\": 24");
    assert!(cfg.contains("\"max_position_embeddings\": 24"));
    std::fs::write(dir.path().join("config.json"), cfg).expect("write");
    let d = dir.path().to_str().expect("utf-8");
    let args = [
        "generate",
        "--backend",
        "cpu",
        "--model",
        d,
        "--random-prompt",
        "12",
        "--ignore-eos",
        "--max-tokens",
        "1000000000000",
    ];
    let out = fdpp(&args, here());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{se}");
    assert!(
        se.contains("stopped after 12 tokens at the end of the model's context") && se.contains("before --max-tokens"),
        "{se}"
    );
}

#[test]
fn a_random_prompt_longer_than_the_context_is_refused_without_printing_it() {
    let v = generate(&["--random-prompt", "600000"]);
    let args: Vec<&str> = v.iter().map(String::as_str).collect();
    let out = fdpp(&args, here());
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{se}");
    assert!(!se.contains("panicked"), "{se}");
    assert!(so.len() + se.len() < 4000, "{} bytes of output", so.len() + se.len());
    assert!(se.contains("600000") || se.contains("600001"), "{se}");
}

#[test]
fn generate_on_a_small_model_reports_the_memory_it_allocates() {
    // "pool: 21.19 GiB" for a 1 MB model on the CPU: the line now leads with what is allocated.
    let v = generate(&["--token-ids", "1,2,3"]);
    let args: Vec<&str> = v.iter().map(String::as_str).collect();
    let out = fdpp(&args, here());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{se}");
    let line = se.lines().find(|l| l.starts_with("pool: ")).expect("the pool line");
    let allocated = line
        .trim_start_matches("pool: ")
        .split(" allocated")
        .next()
        .expect("allocated first");
    assert!(allocated.ends_with("MiB"), "{line}");
    let mib: f64 = allocated.trim_end_matches(" MiB").parse().expect("a number");
    assert!(mib > 0.0 && mib < 4.0, "{line}");
}

#[test]
fn the_cpu_roofline_share_never_exceeds_100_percent() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = fdpp(
        &[
            "bench",
            "gemm",
            "--model",
            FIXTURE,
            "--backend",
            "cpu",
            "--m",
            "1,4",
            "--reps",
            "3",
            "--format",
            "json",
            "--report-dir",
            dir.path().to_str().expect("utf-8"),
        ],
        here(),
    );
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    let rows: serde_json::Value = serde_json::from_str(&so).expect("JSON rows");
    let rows = rows.as_array().expect("an array");
    assert!(!rows.is_empty());
    for r in rows {
        if let Some(p) = r["roofline_pct"].as_f64() {
            assert!(p > 0.0 && p <= 100.0, "{r}");
        }
    }
}

#[test]
fn tune_out_writes_beside_its_profile_only() {
    let work = tempfile::tempdir().expect("tmp");
    let out = fdpp(
        &[
            "tune",
            "--model",
            &here().join(FIXTURE).to_string_lossy(),
            "--backend",
            "cpu",
            "--m-max",
            "2",
            "--reps",
            "1",
            "--out",
            "mine/p.json",
        ],
        work.path(),
    );
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{se}");
    // The sweep's size is said before it starts (with a line per few seconds without a terminal).
    assert!(se.contains("tune: 4 shapes × 2 M (1..=2)"), "{se}");
    assert!(work.path().join("mine/p.json").is_file());
    assert!(work.path().join("mine/p-report/llama-gqa.csv").is_file(), "{se}");
    assert!(
        !work.path().join("reports").exists(),
        "the default reports are not touched"
    );
    assert!(
        !work.path().join("profiles").exists(),
        "the default profile is not touched"
    );
}

#[test]
fn profiles_that_are_not_profiles_say_so() {
    let dir = tempfile::tempdir().expect("tmp");
    let arr = dir.path().join("array.json");
    std::fs::write(&arr, "[1, 2, 3]").expect("write");
    refused(
        &["profile", "show", arr.to_str().expect("utf-8")],
        &["array.json", "an array, not a JSON object", "not an fdpp profile"],
    );
    let bytes = dir.path().join("bytes.json");
    std::fs::write(&bytes, [0xff, 0xfe, 0x00, 0x9c, 0x80, 0x41]).expect("write");
    refused(
        &["profile", "show", bytes.to_str().expect("utf-8")],
        &["bytes.json", "not UTF-8", "not an fdpp profile"],
    );
}

#[test]
fn generate_arguments_that_make_no_sense_are_refused_with_the_flag() {
    refused_generate(&["--token-ids", "1,,2"], &["--token-ids '1,,2'", "entry 2 is empty"]);
    refused_generate(&["--token-ids", ","], &["--token-ids", "empty"]);
    refused_generate(&["--prompt", ""], &["--prompt", "empty"]);
    refused_generate(&["--token-ids", "1", "--max-kv-tokens", "0"], &["--max-kv-tokens"]);
    refused_generate(&["--token-ids", "1", "--stop", ""], &["--stop", "empty"]);
    refused_generate(
        &["--token-ids", "1", "--device", "5"],
        &["--device 5", "CPU backend has one device"],
    );
    // A negative number as a separate argument parses, and is then validated by name.
    refused_generate(&["--token-ids", "1", "--temperature", "-1"], &["--temperature -1"]);
    refused(
        &[
            "bench",
            "gemm",
            "--model",
            "llama2-7b",
            "--backend",
            "cpu",
            "--reps",
            "0",
        ],
        &["--reps"],
    );
}

#[test]
fn a_tokenizer_that_does_not_load_is_only_an_error_where_text_is_encoded() {
    let dir = tempfile::tempdir().expect("tmp");
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        let src = here().join(FIXTURE).join(f);
        if src.exists() {
            std::fs::copy(&src, dir.path().join(f)).expect("copy");
        }
    }
    std::fs::write(dir.path().join("tokenizer.json"), "{ not a tokenizer").expect("write");
    let d = dir.path().to_str().expect("utf-8");
    let out = fdpp(
        &[
            "generate",
            "--backend",
            "cpu",
            "--model",
            d,
            "--max-tokens",
            "2",
            "--token-ids",
            "1,2,3",
        ],
        here(),
    );
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "token ids need no tokenizer: {se}");
    assert!(se.contains("tokenizer.json does not load"), "{se}");
    refused(
        &["generate", "--backend", "cpu", "--model", d, "--prompt", "hello"],
        &["tokenizer.json", "does not load"],
    );
}

#[test]
fn a_long_random_prompt_is_not_printed_whole() {
    let v = generate(&["--random-prompt", "200"]);
    let args: Vec<&str> = v.iter().map(String::as_str).collect();
    let out = fdpp(&args, here());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{se}");
    let line = se
        .lines()
        .find(|l| l.starts_with("random prompt of 200 tokens"))
        .expect("the prompt line");
    assert!(line.contains("the first and last 8 shown"), "{line}");
    assert!(line.split(',').count() < 20, "{line}");
}

#[test]
fn profile_check_of_a_gpu_profile_works_without_that_gpu() {
    let p = "profiles/nvidia-h100-80gb-hbm3/llama2-7b.json";
    let out = fdpp(&["profile", "check", p], here());
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    // Without a CUDA device the kernels are compared; with one, the device.
    assert!(
        so.contains("its kernels are this build's") || so.contains("this machine"),
        "{so}{se}"
    );
    // Against a described device: the H100 it was made on, with another driver (a soft mismatch).
    let dir = tempfile::tempdir().expect("tmp");
    let dev = dir.path().join("h100.json");
    std::fs::write(
        &dev,
        r#"{"backend": "cuda", "ordinal": 0, "name": "NVIDIA H100 80GB HBM3", "slug": "nvidia-h100-80gb-hbm3",
            "arch": "sm_90a", "compute_units": 132, "memory_bytes": 85017493504, "l2_bytes": 52428800,
            "driver_version": "0.0", "runtime_version": "nvrtc 13.0"}"#,
    )
    .expect("write");
    let out = fdpp(
        &["profile", "check", p, "--against", dev.to_str().expect("utf-8")],
        here(),
    );
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    assert!(so.contains("usable on the device of"), "{so}");
    assert!(se.contains("driver version"), "{se}");
    // Another arch is a hard mismatch.
    std::fs::write(
        &dev,
        std::fs::read_to_string(&dev).expect("read").replace("sm_90a", "sm_80"),
    )
    .expect("write");
    refused(
        &["profile", "check", p, "--against", dev.to_str().expect("utf-8")],
        &["does not fit the device of", "arch"],
    );
}

/// Ctrl-C during a long sweep: the process ends within a few seconds with status 130, says so,
/// and leaves neither the profile, nor a temporary file, nor the report directory it made.
#[test]
fn ctrl_c_stops_a_sweep_promptly_and_writes_nothing() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    for cmd in ["tune", "bench"] {
        let work = tempfile::tempdir().expect("tmp");
        let model = here().join(FIXTURE);
        let model = model.to_str().expect("utf-8");
        // Enough work that the sweep is still running when the signal comes (minutes).
        let args: Vec<&str> = if cmd == "tune" {
            vec![
                "tune",
                "--model",
                model,
                "--backend",
                "cpu",
                "--m-max",
                "64",
                "--reps",
                "20000",
                "--out",
                "p.json",
            ]
        } else {
            vec![
                "bench",
                "gemm",
                "--model",
                model,
                "--backend",
                "cpu",
                "--m",
                "1,2,4,8,16,32,64",
                "--reps",
                "20000",
                "--report-dir",
                "rep",
            ]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_fdpp"))
            .args(&args)
            .current_dir(work.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        // The handler is installed once the sweep says it starts.
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            if err.read_line(&mut line).expect("read") == 0 {
                panic!("{cmd}: ended before the sweep started: {seen}");
            }
            seen.push_str(&line);
            if line.contains("Ctrl-C stops it") {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: a signal to the child this test spawned (its pid, still running or a zombie).
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break s;
            }
            if t.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                panic!("{cmd}: still running 10 s after Ctrl-C");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut rest);
        seen.push_str(&rest);
        assert_eq!(status.code(), Some(130), "{cmd}: {status:?}: {seen}");
        assert!(
            seen.contains("interrupted (Ctrl-C)") && seen.contains("nothing was written"),
            "{seen}"
        );
        assert!(!seen.contains("panicked"), "{seen}");
        let left: Vec<_> = std::fs::read_dir(work.path())
            .expect("dir")
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        assert!(left.is_empty(), "{cmd} left {left:?} behind: {seen}");
    }
}
