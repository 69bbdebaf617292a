//! HF config.json parsing: one hand-written fixture per family parses to the expected config,
//! field aliases and family defaults apply, and random valid configs round-trip.

use std::path::{Path, PathBuf};

use fdpp::model::{hf, LinearKind, ModelArch, ModelConfig, ModelShapes};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/configs")
        .join(rel)
}

fn resolve(rel: &str) -> ModelConfig {
    let p = fixture(rel);
    ModelConfig::resolve(p.to_str().unwrap()).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[test]
fn llama_directory_fixture() {
    let expected = ModelConfig {
        name: "tiny-llama".into(),
        arch: ModelArch::Llama,
        hidden_size: 256,
        num_layers: 3,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 32,
        intermediate_size: 688,
        vocab_size: 1000,
        max_position_embeddings: 512,
        rope_theta: 500000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        qkv_bias: false,
        gated_ffn: true,
    };
    // The directory and the file inside it are the same model, named after the directory.
    assert_eq!(resolve("tiny-llama"), expected);
    assert_eq!(resolve("tiny-llama/config.json"), expected);
    let s = ModelShapes::of(&expected);
    assert_eq!(s.get(LinearKind::Qkv).map(|l| (l.k, l.n)), Some((256, 256 + 2 * 64)));
}

#[test]
fn mistral_fixture_with_explicit_head_dim() {
    // head_dim 64 × 10 heads = 640 ≠ hidden 320: an explicit head_dim wins, as in Mistral-Nemo.
    let cfg = resolve("mistral.json");
    assert_eq!(
        cfg,
        ModelConfig {
            name: "mistral".into(),
            arch: ModelArch::Mistral,
            hidden_size: 320,
            num_layers: 4,
            num_heads: 10,
            num_kv_heads: 5,
            head_dim: 64,
            intermediate_size: 1120,
            vocab_size: 32768,
            max_position_embeddings: 32768,
            rope_theta: 1000000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            qkv_bias: false,
            gated_ffn: true,
        }
    );
    let s = ModelShapes::of(&cfg);
    assert_eq!(s.get(LinearKind::O).map(|l| (l.k, l.n)), Some((640, 320)));
}

#[test]
fn qwen2_fixture_always_has_qkv_bias() {
    assert_eq!(
        resolve("qwen2.json"),
        ModelConfig {
            name: "qwen2".into(),
            arch: ModelArch::Qwen2,
            hidden_size: 384,
            num_layers: 2,
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 64,
            intermediate_size: 1024,
            vocab_size: 151936,
            max_position_embeddings: 32768,
            rope_theta: 1000000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            qkv_bias: true,
            gated_ffn: true,
        }
    );
}

#[test]
fn opt_fixture_maps_ffn_dim_and_has_no_gate() {
    let cfg = resolve("opt.json");
    assert_eq!(
        cfg,
        ModelConfig {
            name: "opt".into(),
            arch: ModelArch::Opt,
            hidden_size: 512,
            num_layers: 6,
            num_heads: 16,
            num_kv_heads: 16,
            head_dim: 32,
            intermediate_size: 2048,
            vocab_size: 50272,
            max_position_embeddings: 2048,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            qkv_bias: true,
            gated_ffn: false,
        }
    );
    let s = ModelShapes::of(&cfg);
    assert!(!s.ffn1_fused_gate_up);
    assert_eq!(s.get(LinearKind::Ffn1).map(|l| (l.k, l.n)), Some((512, 2048)));
}

#[test]
fn chatglm_fixture_maps_its_own_names() {
    let cfg = resolve("chatglm.json");
    assert_eq!(
        cfg,
        ModelConfig {
            name: "chatglm".into(),
            arch: ModelArch::ChatGlm,
            hidden_size: 512,
            num_layers: 5,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 64,
            intermediate_size: 1712,
            vocab_size: 65024,
            max_position_embeddings: 8192,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            qkv_bias: true,
            gated_ffn: true,
        }
    );
    let s = ModelShapes::of(&cfg);
    assert_eq!(
        s.get(LinearKind::Qkv).map(|l| (l.k, l.n)),
        Some((512, 8 * 64 + 2 * 2 * 64))
    );
    assert_eq!(s.get(LinearKind::Ffn1).map(|l| l.n), Some(2 * 1712));
}

fn parse(json: &str) -> fdpp::Result<ModelConfig> {
    hf::parse(json, Path::new("inline/config.json"), "inline".into())
}

#[test]
fn chatglm_without_multi_query_attention_is_plain_mha() {
    let cfg = parse(
        r#"{"model_type": "chatglm", "hidden_size": 512, "ffn_hidden_size": 1024,
            "num_layers": 2, "num_attention_heads": 8, "multi_query_attention": false,
            "multi_query_group_num": 2, "padded_vocab_size": 1024, "rope_ratio": 50}"#,
    )
    .unwrap();
    assert_eq!(cfg.num_kv_heads, 8);
    assert_eq!(cfg.head_dim, 64);
    assert_eq!(cfg.rope_theta, 500000.0);
    assert!(!cfg.qkv_bias);
}

#[test]
fn model_type_is_used_when_architectures_is_unknown_or_absent() {
    let body = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "vocab_size": 100"#;
    let cfg = parse(&format!(r#"{{"model_type": "llama", {body}}}"#)).unwrap();
    assert_eq!(cfg.arch, ModelArch::Llama);
    let cfg = parse(&format!(
        r#"{{"architectures": ["LlamaForSequenceClassification"], "model_type": "qwen2", {body}}}"#
    ))
    .unwrap();
    assert_eq!(cfg.arch, ModelArch::Qwen2);
    assert!(cfg.qkv_bias);
}

#[test]
fn absent_optional_fields_take_the_family_defaults() {
    let cfg = parse(
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100,
            "head_dim": null, "attention_bias": true}"#,
    )
    .unwrap();
    assert_eq!(cfg.num_kv_heads, 4);
    assert_eq!(cfg.head_dim, 16);
    assert_eq!(cfg.rope_theta, 10000.0);
    assert_eq!(cfg.rms_norm_eps, 1e-6);
    assert_eq!(cfg.max_position_embeddings, 2048);
    assert!(!cfg.tie_word_embeddings);
    assert!(cfg.qkv_bias);
    // transformers 5 keeps rope_theta in rope_parameters.
    let cfg = parse(
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000}}"#,
    )
    .unwrap();
    assert_eq!(cfg.rope_theta, 500000.0);
}

/// Random valid Llama-family configs, written as JSON the way HF does, parse back to themselves.
#[test]
fn random_configs_round_trip() {
    let mut rng = StdRng::from_entropy();
    for _ in 0..200 {
        let kv = rng.gen_range(1..=8usize);
        let heads = kv * rng.gen_range(1..=8usize);
        let head_dim = 8 * rng.gen_range(1..=32usize);
        let explicit = rng.gen_bool(0.5);
        let hidden = if explicit {
            8 * rng.gen_range(1..=512usize)
        } else {
            heads * head_dim
        };
        let arch = [ModelArch::Llama, ModelArch::Mistral, ModelArch::Qwen2][rng.gen_range(0..3)];
        let arch_name = match arch {
            ModelArch::Llama => "LlamaForCausalLM",
            ModelArch::Mistral => "MistralForCausalLM",
            _ => "Qwen2ForCausalLM",
        };
        let expected = ModelConfig {
            name: "random".into(),
            arch,
            hidden_size: hidden,
            num_layers: rng.gen_range(1..=100),
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            intermediate_size: rng.gen_range(1..=60000),
            vocab_size: rng.gen_range(1..=300000),
            max_position_embeddings: rng.gen_range(1..=1 << 20),
            rope_theta: rng.gen_range(1.0..1e7),
            rms_norm_eps: rng.gen_range(1e-8..1e-3),
            tie_word_embeddings: rng.gen_bool(0.5),
            qkv_bias: arch == ModelArch::Qwen2,
            gated_ffn: true,
        };
        let mut json = serde_json::json!({
            "architectures": [arch_name],
            "hidden_size": expected.hidden_size,
            "num_hidden_layers": expected.num_layers,
            "num_attention_heads": expected.num_heads,
            "num_key_value_heads": expected.num_kv_heads,
            "intermediate_size": expected.intermediate_size,
            "vocab_size": expected.vocab_size,
            "max_position_embeddings": expected.max_position_embeddings,
            "rope_theta": expected.rope_theta,
            "rms_norm_eps": expected.rms_norm_eps,
            "tie_word_embeddings": expected.tie_word_embeddings,
        });
        if explicit {
            json["head_dim"] = head_dim.into();
        }
        let got = hf::parse(&json.to_string(), Path::new("random.json"), "random".into())
            .unwrap_or_else(|e| panic!("{json}: {e}"));
        // serde_json's default float parser may land one ulp off the shortest repr; configs
        // need nowhere near that precision.
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-14 * b.abs();
        assert!(close(got.rope_theta, expected.rope_theta), "{json}");
        assert!(close(got.rms_norm_eps, expected.rms_norm_eps), "{json}");
        let expected = ModelConfig {
            rope_theta: got.rope_theta,
            rms_norm_eps: got.rms_norm_eps,
            ..expected
        };
        assert_eq!(got, expected, "{json}");
        let s = ModelShapes::of(&got);
        assert_eq!(s.get(LinearKind::Qkv).map(|l| l.n), Some((heads + 2 * kv) * head_dim));
    }
}
