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
    refused(
        &["tune", "--model", c, "--backend", "cpu", "--m-max", "4"],
        &["GiB", "lower --m-max"],
    );
    refused(
        &["bench", "gemm", "--model", c, "--backend", "cpu", "--m", "1"],
        &["GiB", "lower --m"],
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
