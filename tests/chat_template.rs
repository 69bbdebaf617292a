//! Chat templates (`fdpp generate --chat`): a template from a committed tokenizer_config.json
//! rendered exactly as Python's jinja2 renders it with HF's settings (trim_blocks,
//! lstrip_blocks; the expected strings below were produced by jinja2 3.1.6), the list form of
//! the field, the errors for a model without a template, and `generate --chat` end to end on
//! the CPU. The SmolLM2 GGUF's own template is tested in tests/gguf_smollm2.rs.

use std::path::{Path, PathBuf};
use std::process::Command;

use fdpp::model::chat::{ChatTemplate, Message};
use fdpp::model::llama::ModelSpec;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

/// A copy of the llama-gqa HF fixture, with `tokenizer_config` written beside it when given.
fn model_dir(tokenizer_config: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-gqa");
    for e in std::fs::read_dir(&src).expect("fixture") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copy");
    }
    if let Some(text) = tokenizer_config {
        std::fs::write(dir.path().join("tokenizer_config.json"), text).expect("write");
    }
    dir
}

fn committed() -> ChatTemplate {
    ChatTemplate::from_hf_dir(&fixture())
        .expect("reads")
        .expect("has a template")
}

#[test]
fn the_committed_template_renders_as_jinja2_does() {
    let t = committed();
    assert_eq!(t.bos_token, "<s>", "an object-valued bos_token gives its content");
    assert_eq!(t.eos_token, "</s>");
    assert!(t.source.contains("tokenizer_config.json") && t.source.contains("chat_template"));
    assert_eq!(
        t.prompt("  What is 2+2? ", None).unwrap(),
        "<s><|user|>\nWhat is 2+2?\n<|assistant|>\n"
    );
    let conv = [
        Message::new("system", "Answer briefly."),
        Message::new("user", "What is 2+2?"),
        Message::new("assistant", "4"),
        Message::new("user", "And 3+3?"),
    ];
    assert_eq!(
        t.render(&conv, true).unwrap(),
        "<s><|user|>\nAnswer briefly.\n\nWhat is 2+2?\n<|assistant|>\n4</s>\n<|user|>\nAnd 3+3?\n<|assistant|>\n"
    );
    assert_eq!(
        t.render(&[Message::new("user", "hi")], false).unwrap(),
        "<s><|user|>\nhi\n"
    );
    // --system goes first and is folded into the user turn by this template.
    assert_eq!(
        t.prompt("What is 2+2?", Some("Answer briefly.")).unwrap(),
        "<s><|user|>\nAnswer briefly.\n\nWhat is 2+2?\n<|assistant|>\n"
    );
}

#[test]
fn raise_exception_in_the_template_is_an_error_naming_the_file() {
    let e = committed()
        .render(&[Message::new("assistant", "x")], true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("turns must alternate") && e.contains("tokenizer_config.json") && e.contains("--chat"),
        "{e}"
    );
}

#[test]
fn the_list_form_uses_the_default_template_and_other_forms_are_refused() {
    let cfg = r#"{"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}{{ m.role }}: {{ m.content }}|{% endfor %}"}
    ]}"#;
    let dir = model_dir(Some(cfg));
    let t = ChatTemplate::from_hf_dir(dir.path()).unwrap().unwrap();
    assert_eq!(t.render(&[Message::new("user", "hi")], false).unwrap(), "user: hi|");

    let dir = model_dir(Some(r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#));
    let e = ChatTemplate::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("'default'") && e.contains("tokenizer_config.json"), "{e}");
    let dir = model_dir(Some(r#"{"chat_template": 3}"#));
    let e = ChatTemplate::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("a number"), "{e}");
    let dir = model_dir(Some("{not json"));
    let e = ChatTemplate::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn a_model_without_a_template_is_an_error_naming_the_file_and_the_flag() {
    let dir = model_dir(None);
    let spec = ModelSpec::resolve(dir.path().to_str().unwrap()).unwrap();
    let e = spec.chat_template(None).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("--chat"), "{e}");
    // A tokenizer_config.json without the field: the same.
    let dir = model_dir(Some(r#"{"eos_token": "</s>"}"#));
    let spec = ModelSpec::resolve(dir.path().to_str().unwrap()).unwrap();
    let e = spec.chat_template(None).unwrap_err().to_string();
    assert!(e.contains("no field 'chat_template'") && e.contains("--chat"), "{e}");
    // chat_template.jinja beside it serves.
    std::fs::write(dir.path().join("chat_template.jinja"), "[{{ messages[0].content }}]").unwrap();
    let t = ModelSpec::resolve(dir.path().to_str().unwrap())
        .unwrap()
        .chat_template(None)
        .unwrap();
    assert_eq!(t.prompt("hi", None).unwrap(), "[hi]");
    // A preset has none.
    let e = ModelSpec::resolve("llama2-7b")
        .unwrap()
        .chat_template(None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("preset") && e.contains("--chat"), "{e}");
}

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
fn generate_chat_templates_the_prompt_and_refuses_what_it_cannot() {
    let text = std::fs::read_to_string(fixture().join("tokenizer_config.json")).unwrap();
    let dir = model_dir(Some(&text));
    let m = dir.path().to_str().unwrap();
    let base = [
        "generate",
        "--backend",
        "cpu",
        "--model",
        m,
        "--max-tokens",
        "2",
        "--json",
    ];
    let run = |more: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(more);
        fdpp(&a)
    };
    let (ok, so, se) = run(&["--chat", "--prompt", "What is 2+2?"]);
    assert!(ok, "{se}");
    assert!(
        se.contains("chat template:") && se.contains("tokenizer_config.json"),
        "{se}"
    );
    let (ok2, so2, se2) = run(&["--prompt", "What is 2+2?"]);
    assert!(ok2, "{se2}");
    let prompt_len = |json: &str| -> usize {
        let v: serde_json::Value = serde_json::from_str(json).expect("json");
        v["seqs"][0]["prompt"].as_array().expect("prompt ids").len()
    };
    // The template adds the turn markers: a longer prompt than the bare text.
    assert!(prompt_len(&so) > prompt_len(&so2) + 10, "{so}\n{so2}");

    let (ok, _, se) = run(&["--chat", "--token-ids", "1,2,3"]);
    assert!(!ok && se.contains("--chat") && se.contains("--token-ids"), "{se}");
    let (ok, _, se) = run(&["--system", "be brief", "--prompt", "hi"]);
    assert!(!ok && se.contains("--system") && se.contains("--chat"), "{se}");

    let bare = model_dir(None);
    let (ok, _, se) = fdpp(&[
        "generate",
        "--backend",
        "cpu",
        "--model",
        bare.path().to_str().unwrap(),
        "--chat",
        "--prompt",
        "hi",
    ]);
    assert!(
        !ok && se.contains("tokenizer_config.json") && se.contains("--chat"),
        "{se}"
    );
}
