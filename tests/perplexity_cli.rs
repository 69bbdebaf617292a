//! `fdpp perplexity` end to end on a small HF fixture: both schemes scored on the same windows,
//! finite and close to each other (the async softmax costs no quality), and bad input refused.

use std::path::Path;
use std::process::Command;

fn fdpp(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("fdpp runs");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn sync_and_async_score_the_same_windows_and_agree() {
    let dir = tempfile::tempdir().expect("tmp");
    let text = dir.path().join("t.txt");
    std::fs::write(
        &text,
        "The engine reads the weights of a small model and runs it one token at a time. ".repeat(3),
    )
    .expect("write");
    let model = Path::new("tests/fixtures/hf/llama-gqa");
    let (ok, so, se) = fdpp(&[
        "perplexity",
        "--backend",
        "cpu",
        "--model",
        model.to_str().expect("utf-8"),
        "--text",
        text.to_str().expect("utf-8"),
        "--ctx",
        "16",
    ]);
    assert!(ok, "{se}");
    let ppl = |label: &str| -> (f64, usize) {
        let line = so
            .lines()
            .find(|l| l.contains(label))
            .unwrap_or_else(|| panic!("no {label} row: {so}"));
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        (cells[2].parse().expect("ppl"), cells[4].parse().expect("tokens"))
    };
    let (s, ns) = ppl("fdpp cpu sync");
    let (a, na) = ppl("fdpp cpu async");
    assert_eq!(ns, na, "the same tokens scored");
    assert!(ns > 0 && s.is_finite() && s > 1.0, "{so}");
    assert!((a / s - 1.0).abs() < 1e-3, "async {a} vs sync {s}");
}

#[test]
fn a_window_of_one_token_and_a_missing_text_are_refused() {
    let (ok, _, se) = fdpp(&[
        "perplexity",
        "--model",
        "tests/fixtures/hf/llama-gqa",
        "--text",
        "x",
        "--ctx",
        "1",
    ]);
    assert!(!ok && se.contains("--ctx 1"), "{se}");
    let (ok, _, se) = fdpp(&[
        "perplexity",
        "--backend",
        "cpu",
        "--model",
        "tests/fixtures/hf/llama-gqa",
        "--text",
        "/no/such/file.txt",
    ]);
    assert!(
        !ok && se.contains("--text /no/such/file.txt") && !se.contains("panicked"),
        "{se}"
    );
}
