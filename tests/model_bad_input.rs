//! Bad model input gives a clear FdppError that names the file and the field, never a panic.

use std::path::{Path, PathBuf};

use fdpp::model::arch::Arch;
use fdpp::model::weights::WeightStore;
use fdpp::model::{family, hf, presets, ModelConfig};
use fdpp::FdppError;

fn bad(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/configs/bad")
        .join(rel)
}

/// The error of resolving `path`, which must be a Config error about that very path.
fn config_err(path: &Path) -> String {
    let err = ModelConfig::resolve(path.to_str().unwrap()).unwrap_err();
    match &err {
        FdppError::Config { path: p, .. } => {
            assert!(p.ends_with(path.file_name().unwrap()), "{err} names {p:?}")
        }
        other => panic!("expected a Config error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(path.file_name().unwrap().to_str().unwrap()), "{msg}");
    msg
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
}

#[test]
fn missing_file() {
    let p = bad("no-such-model/config.json");
    let msg = config_err(&p);
    assert_has(&msg, &["no-such-model", "no such file"]);
    // The same for a path that only looks like one.
    let msg = ModelConfig::resolve("./nothing-here.json").unwrap_err().to_string();
    assert_has(&msg, &["nothing-here.json", "no such file"]);
    // A bare GGUF file name that is not there is a missing file, not an unknown preset, and the
    // message lists the forms --model takes.
    let msg = ModelConfig::resolve("nothing-here.gguf").unwrap_err().to_string();
    assert_has(&msg, &["nothing-here.gguf", "no such file", "GGUF file"]);
    assert!(!msg.contains("unknown model preset"), "{msg}");
    let msg = fdpp::model::spec::ModelSpec::resolve("Nothing-Here.GGUF")
        .unwrap_err()
        .to_string();
    assert_has(&msg, &["Nothing-Here.GGUF", "no such file"]);
}

#[test]
fn directory_without_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelConfig::resolve(dir.path().to_str().unwrap()).unwrap_err();
    let msg = err.to_string();
    assert_has(&msg, &[dir.path().to_str().unwrap(), "no config.json"]);
}

#[test]
fn unreadable_files() {
    let dir = tempfile::tempdir().unwrap();
    // Not UTF-8: read_to_string fails (this also works when the tests run as root, where
    // permission bits do not stop a read).
    let binary = dir.path().join("binary.json");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x7b, 0x80]).unwrap();
    assert_has(&config_err(&binary), &["cannot read", "UTF-8"]);
    // A directory where the file should be.
    let model = dir.path().join("model");
    std::fs::create_dir_all(model.join("config.json")).unwrap();
    let err = ModelConfig::resolve(model.to_str().unwrap()).unwrap_err().to_string();
    assert_has(&err, &["config.json", "cannot read"]);
}

#[test]
fn malformed_json_gives_line_and_column() {
    let msg = config_err(&bad("malformed.json"));
    assert_has(&msg, &["malformed JSON", "line 5", "column"]);
    let msg = hf::parse("[1, 2]", Path::new("list.json"), "list".into())
        .unwrap_err()
        .to_string();
    assert_has(&msg, &["list.json", "JSON object", "an array"]);
    let msg = hf::parse("", Path::new("empty.json"), "empty".into())
        .unwrap_err()
        .to_string();
    assert_has(&msg, &["empty.json", "malformed JSON", "line 1"]);
}

#[test]
fn missing_required_field_is_named() {
    let msg = config_err(&bad("missing_field.json"));
    assert_has(&msg, &["missing required field 'intermediate_size'"]);
    // A ChatGLM config names its own spelling and the accepted alias.
    let msg = hf::parse(
        r#"{"model_type": "chatglm", "hidden_size": 64, "num_layers": 1,
            "num_attention_heads": 4, "padded_vocab_size": 100}"#,
        Path::new("glm/config.json"),
        "glm".into(),
    )
    .unwrap_err()
    .to_string();
    assert_has(&msg, &["glm/config.json", "'ffn_hidden_size'", "'intermediate_size'"]);
}

#[test]
fn wrong_type_is_named_with_the_value() {
    let msg = config_err(&bad("wrong_type.json"));
    assert_has(&msg, &["'hidden_size'", "non-negative integer", "a string", "\"256\""]);
    let base = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "vocab_size": 100"#;
    for (extra, parts) in [
        (r#""num_key_value_heads": -2"#, &["'num_key_value_heads'", "-2"][..]),
        (r#""num_hidden_layers": 2.5"#, &["'num_hidden_layers'", "2.5"][..]),
        (r#""rope_theta": "1e4""#, &["'rope_theta'", "must be a number"][..]),
        (
            r#""tie_word_embeddings": 1"#,
            &["'tie_word_embeddings'", "true or false"][..],
        ),
        (r#""model_type": 7"#, &["'model_type'", "must be a string"][..]),
    ] {
        // Later keys win in serde_json maps, so `extra` overrides the base value.
        let json = format!(r#"{{"architectures": ["LlamaForCausalLM"], {base}, {extra}}}"#);
        let msg = hf::parse(&json, Path::new("typed.json"), "typed".into())
            .unwrap_err()
            .to_string();
        assert_has(&msg, &["typed.json"]);
        assert_has(&msg, parts);
    }
    let msg = hf::parse(
        r#"{"architectures": "LlamaForCausalLM"}"#,
        Path::new("arch.json"),
        "arch".into(),
    )
    .unwrap_err()
    .to_string();
    assert_has(&msg, &["'architectures'", "array of strings"]);
}

#[test]
fn unsupported_architecture_lists_supported_ones() {
    let msg = config_err(&bad("unsupported_arch.json"));
    assert_has(
        &msg,
        &[
            "unsupported architecture 'GPT2LMHeadModel'",
            "gpt2",
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "OPTForCausalLM",
            "ChatGLMModel",
        ],
    );
    let msg = hf::parse(r#"{"hidden_size": 64}"#, Path::new("anon.json"), "anon".into())
        .unwrap_err()
        .to_string();
    assert_has(&msg, &["anon.json", "model family is unknown", "LlamaForCausalLM"]);
}

#[test]
fn zero_heads() {
    let msg = config_err(&bad("zero_heads.json"));
    assert_has(&msg, &["'num_attention_heads' is 0"]);
    let msg = hf::parse(
        r#"{"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 0,
            "vocab_size": 100}"#,
        Path::new("kv0.json"),
        "kv0".into(),
    )
    .unwrap_err()
    .to_string();
    assert_has(&msg, &["kv0.json", "'num_key_value_heads' is 0"]);
}

#[test]
fn kv_heads_not_dividing_heads() {
    let msg = config_err(&bad("kv_not_dividing.json"));
    assert_has(&msg, &["'num_key_value_heads' (5)", "does not divide", "(12)"]);
}

#[test]
fn hidden_not_divisible_by_heads_without_head_dim() {
    let msg = config_err(&bad("hidden_not_divisible.json"));
    assert_has(
        &msg,
        &[
            "hidden_size (1000)",
            "not divisible",
            "num_attention_heads (12)",
            "head_dim",
        ],
    );
}

#[test]
fn zero_sizes_are_rejected_with_the_file() {
    let msg = hf::parse(
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 0,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}"#,
        Path::new("zero.json"),
        "zero".into(),
    )
    .unwrap_err()
    .to_string();
    assert_has(&msg, &["zero.json", "intermediate_size"]);
}

/// OPT-350m's narrower embedding parses (project_in/project_out run); its post-LayerNorm
/// (do_layer_norm_before = false) is refused by the engine, naming the field.
#[test]
fn opt_projection_runs_and_post_layernorm_is_refused_by_name() {
    let text = r#"{"model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096, "word_embed_proj_dim": 512,
        "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 50272,
        "do_layer_norm_before": false}"#;
    let path = Path::new("opt-350m/config.json");
    let cfg = hf::parse(text, path, "opt-350m".into()).expect("parses");
    let extras = hf::parse_extras(text, path).expect("extras");
    assert_eq!(extras.embed_proj_dim, Some(512));
    let msg = Arch::of(&cfg, &extras).unwrap_err().to_string();
    assert_has(&msg, &["opt-350m", "do_layer_norm_before", "post-LayerNorm"]);
    let pre = text.replace(r#""do_layer_norm_before": false"#, r#""do_layer_norm_before": true"#);
    let arch = Arch::of(&cfg, &hf::parse_extras(&pre, path).expect("extras")).expect("pre-LN OPT runs");
    assert_eq!((arch.embed_dim, arch.hidden), (512, 1024));
}

#[test]
fn settings_the_engine_does_not_run_name_their_field() {
    let glm = r#"{"architectures": ["ChatGLMModel"], "hidden_size": 256, "num_layers": 2,
        "num_attention_heads": 4, "kv_channels": 64, "ffn_hidden_size": 512,
        "padded_vocab_size": 1000, "multi_query_attention": true, "multi_query_group_num": 2,
        "rmsnorm": false}"#;
    let path = Path::new("glm/config.json");
    let cfg = hf::parse(glm, path, "glm".into()).expect("parses");
    let msg = Arch::of(&cfg, &hf::parse_extras(glm, path).expect("extras"))
        .unwrap_err()
        .to_string();
    assert_has(&msg, &["glm", "chatglm", "'rmsnorm' = false"]);
    let llama = r#"{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100, "hidden_act": "quick_gelu"}"#;
    let msg = hf::parse_extras(llama, Path::new("act.json")).unwrap_err().to_string();
    assert_has(
        &msg,
        &["act.json", "hidden_act", "quick_gelu", "silu", "gelu_pytorch_tanh"],
    );
}

/// A checkpoint whose weight names belong to another family: the error names the family tried,
/// the first missing names and how many are missing.
#[test]
fn a_checkpoint_of_other_names_lists_the_missing_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    // An OPT-shaped checkpoint read as a Llama.
    let data = vec![0u8; 2 * 4];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![4], &data).expect("view");
    let bytes =
        safetensors::tensor::serialize(vec![("model.decoder.embed_tokens.weight", view)], None).expect("serialize");
    std::fs::write(dir.path().join("model.safetensors"), bytes).expect("write");
    let store = WeightStore::open(dir.path()).expect("open");
    let cfg = presets::preset("llama2-7b").unwrap();
    let arch = Arch::from_config(&cfg).unwrap();
    let msg = family::check(&store, &arch).unwrap_err().to_string();
    assert_has(
        &msg,
        &[
            "match no family",
            "llama (Llama, Mistral, Qwen2 names)",
            "'model.embed_tokens.weight'",
            "'model.layers.0.input_layernorm.weight'",
            "…",
            "the first named 'model.decoder.embed_tokens.weight'",
        ],
    );
    assert!(
        msg.contains(&format!("{} of its {} tensors are missing", 291, 291)),
        "{msg}"
    );
}

#[test]
fn validate_rejects_what_the_engine_cannot_run() {
    let ok = presets::preset("llama2-7b").unwrap();
    let cases: Vec<(ModelConfig, &str)> = vec![
        (
            ModelConfig {
                num_heads: 0,
                ..ok.clone()
            },
            "num_attention_heads is 0",
        ),
        (
            ModelConfig {
                num_kv_heads: 0,
                ..ok.clone()
            },
            "num_key_value_heads is 0",
        ),
        (
            ModelConfig {
                num_kv_heads: 5,
                ..ok.clone()
            },
            "does not divide",
        ),
        (
            ModelConfig {
                head_dim: 0,
                ..ok.clone()
            },
            "head_dim",
        ),
        (
            ModelConfig {
                vocab_size: 0,
                ..ok.clone()
            },
            "vocab_size",
        ),
        (
            ModelConfig {
                max_position_embeddings: 0,
                ..ok.clone()
            },
            "max_position_embeddings",
        ),
        (
            ModelConfig {
                rope_theta: -1.0,
                ..ok.clone()
            },
            "rope_theta",
        ),
        (
            ModelConfig {
                rms_norm_eps: f64::NAN,
                ..ok.clone()
            },
            "rms_norm_eps",
        ),
        (
            ModelConfig {
                hidden_size: 1 << 40,
                ..ok.clone()
            },
            "corrupted",
        ),
        (
            ModelConfig {
                head_dim: usize::MAX,
                ..ok.clone()
            },
            "corrupted",
        ),
        (
            ModelConfig {
                num_layers: 1 << 30,
                ..ok.clone()
            },
            "num_hidden_layers",
        ),
    ];
    for (cfg, part) in cases {
        let err = cfg.validate().unwrap_err();
        assert!(matches!(err, FdppError::InvalidModel { .. }), "{err:?}");
        let msg = err.to_string();
        assert_has(&msg, &["llama2-7b", part]);
        // Shapes of a config that skipped validation still do not panic.
        let _ = fdpp::model::ModelShapes::of(&cfg);
    }
}
