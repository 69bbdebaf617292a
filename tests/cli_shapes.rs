//! `fdpp shapes` through the binary: the tables, and bad input exiting non-zero with a message
//! that names the file and the field, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fdpp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .output()
        .expect("the fdpp binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(args: &[&str]) -> String {
    let o = fdpp(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/configs")
        .join(rel)
}

#[test]
fn llama2_7b_markdown() {
    let out = ok(&["shapes", "--model", "llama2-7b"]);
    for row in [
        "| qkv | 4096 | 12288 | 96.00 |",
        "| o | 4096 | 4096 | 32.00 |",
        "| ffn1 | 4096 | 22016 | 172.00 |",
        "| ffn2 | 11008 | 4096 | 86.00 |",
        "| heads | 32 |",
        "| kv heads | 32 |",
        "| head dim | 128 |",
        "| GQA ratio (heads per kv head) | 1 |",
        "| layers | 32 |",
        "| weight GB read per token (fp16, all layers + LM head) | 13.21 |",
        "FFN1 fuses gate+up into one GEMM: N = 2·intermediate = 2·11008 = 22016.",
    ] {
        assert!(out.contains(row), "missing {row:?} in\n{out}");
    }
    // The default format is markdown.
    assert_eq!(out, ok(&["shapes", "--model", "llama2-7b", "--format", "md"]));
}

#[test]
fn opt_says_ffn1_is_not_fused() {
    let out = ok(&["shapes", "--model", "opt-6.7b"]);
    assert!(out.contains("| ffn1 | 4096 | 16384 |"), "{out}");
    assert!(out.contains("no gate"), "{out}");
    assert!(!out.contains("fuses gate+up"), "{out}");
}

#[test]
fn llama3_8b_csv() {
    let out = ok(&["shapes", "--model", "llama3-8b", "--format", "csv"]);
    let mut rdr = csv::Reader::from_reader(out.as_bytes());
    let headers = rdr.headers().unwrap().clone();
    let col = |name: &str| headers.iter().position(|h| h == name).unwrap();
    let rows: Vec<csv::StringRecord> = rdr.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 4);
    let qkv = rows.iter().find(|r| &r[col("linear")] == "qkv").unwrap();
    assert_eq!((&qkv[col("k")], &qkv[col("n")]), ("4096", "6144"));
    assert_eq!(&qkv[col("gqa_ratio")], "4");
    assert_eq!(&qkv[col("num_kv_heads")], "8");
    assert!(rows.iter().all(|r| &r[col("model")] == "llama3-8b"));
}

#[test]
fn json_is_the_model_shapes_struct() {
    let out = ok(&["shapes", "--model", "llama3-8b", "--format", "json"]);
    let parsed: fdpp::model::ModelShapes = serde_json::from_str(&out).unwrap();
    let expected = fdpp::model::ModelShapes::of(&fdpp::model::ModelConfig::resolve("llama3-8b").unwrap());
    assert_eq!(parsed, expected);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["linears"][0]["n"], 6144);
    assert_eq!(v["gqa_ratio"], 4);
}

#[test]
fn every_preset_and_fixture_prints() {
    for name in fdpp::model::presets::PRESET_NAMES {
        let out = ok(&["shapes", "--model", name]);
        assert!(out.starts_with(&format!("## {name} (")), "{out}");
    }
    for rel in ["tiny-llama", "mistral.json", "qwen2.json", "opt.json", "chatglm.json"] {
        let p = fixture(rel);
        let out = ok(&["shapes", "--model", p.to_str().unwrap(), "--format", "csv"]);
        assert_eq!(out.lines().count(), 5, "{rel}: {out}");
    }
}

/// Runs a failing command; returns stderr after checking the exit code and that nothing panicked.
fn fails(args: &[&str], code: i32) -> String {
    let o = fdpp(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(stdout(&o).is_empty(), "{args:?} printed a table");
    err
}

#[test]
fn bad_config_files_exit_1_naming_file_and_field() {
    let cases: &[(&str, &[&str])] = &[
        ("malformed.json", &["line 5, column 3"]),
        ("missing_field.json", &["'intermediate_size'"]),
        ("wrong_type.json", &["'hidden_size'", "non-negative integer"]),
        ("unsupported_arch.json", &["'GPT2LMHeadModel'", "LlamaForCausalLM"]),
        ("zero_heads.json", &["'num_attention_heads' is 0"]),
        (
            "kv_not_dividing.json",
            &["'num_key_value_heads' (5)", "does not divide"],
        ),
        ("hidden_not_divisible.json", &["hidden_size (1000)", "not divisible"]),
    ];
    for (file, parts) in cases {
        let p = fixture(&format!("bad/{file}"));
        let err = fails(&["shapes", "--model", p.to_str().unwrap()], 1);
        assert!(err.starts_with("error: "), "{err}");
        assert!(err.contains(file), "{file}: {err}");
        for part in *parts {
            assert!(err.contains(part), "{file}: {err} lacks {part:?}");
        }
    }
}

#[test]
fn missing_unreadable_and_unknown_exit_1() {
    let err = fails(&["shapes", "--model", "/no/such/dir/config.json"], 1);
    assert!(
        err.contains("/no/such/dir/config.json") && err.contains("no such file"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let err = fails(&["shapes", "--model", dir.path().to_str().unwrap()], 1);
    assert!(err.contains("no config.json"), "{err}");

    let binary = dir.path().join("garbage.json");
    std::fs::write(&binary, [0xc3, 0x28, 0xa0, 0xa1]).unwrap();
    let err = fails(&["shapes", "--model", binary.to_str().unwrap()], 1);
    assert!(err.contains("garbage.json") && err.contains("cannot read"), "{err}");

    let err = fails(&["shapes", "--model", "llama9-1t"], 1);
    assert!(err.contains("'llama9-1t'") && err.contains("codellama-34b"), "{err}");
}

#[test]
fn usage_errors_exit_2() {
    fails(&["shapes", "--model", "llama2-7b", "--format", "xml"], 2);
    fails(&["shapes"], 2);
}
