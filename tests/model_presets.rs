//! Every preset: it validates, its shapes follow from its config, and its parameter count matches
//! the published size of the model (a check that the config values were copied right).

use fdpp::model::presets::{self, PRESETS, PRESET_NAMES};
use fdpp::model::{LinearKind, ModelArch, ModelConfig, ModelShapes};
use fdpp::FdppError;

fn shapes(name: &str) -> ModelShapes {
    ModelShapes::of(&presets::preset(name).unwrap())
}

fn kn(s: &ModelShapes, kind: LinearKind) -> (usize, usize) {
    let l = s.get(kind).unwrap();
    (l.k, l.n)
}

#[test]
fn llama2_7b_shapes_are_the_papers() {
    let s = shapes("llama2-7b");
    assert_eq!(kn(&s, LinearKind::Qkv), (4096, 12288));
    assert_eq!(kn(&s, LinearKind::O), (4096, 4096));
    assert_eq!(kn(&s, LinearKind::Ffn1), (4096, 22016));
    assert_eq!(kn(&s, LinearKind::Ffn2), (11008, 4096));
    assert!(s.ffn1_fused_gate_up);
    assert_eq!(s.num_layers, 32);
    assert_eq!(s.gqa_ratio, 1);
    assert_eq!(
        [s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_dim],
        [32, 32, 128]
    );
}

#[test]
fn llama3_8b_qkv_uses_grouped_kv_heads() {
    let s = shapes("llama3-8b");
    // 32 query heads + 2 × 8 KV heads, 128 wide each.
    assert_eq!(kn(&s, LinearKind::Qkv), (4096, 6144));
    assert_eq!(kn(&s, LinearKind::Ffn1), (4096, 2 * 14336));
    assert_eq!(s.gqa_ratio, 4);
    let cfg = presets::preset("llama3-8b").unwrap();
    assert_eq!(cfg.vocab_size, 128256);
    assert_eq!(cfg.rope_theta, 500000.0);
}

#[test]
fn every_preset_validates_and_resolves_to_itself() {
    assert_eq!(PRESET_NAMES.len(), 11);
    for name in PRESET_NAMES {
        let cfg = presets::preset(name).unwrap();
        cfg.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(cfg.name, *name);
        assert_eq!(ModelConfig::resolve(name).unwrap(), cfg, "{name}");
    }
}

#[test]
fn presets_table_and_names_agree() {
    let table: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
    assert_eq!(table, PRESET_NAMES);
    assert_eq!(presets::preset_source("opt-6.7b"), Some("facebook/opt-6.7b"));
    assert_eq!(presets::preset_source("gpt-5"), None);
}

#[test]
fn every_preset_has_sane_shapes() {
    for name in PRESET_NAMES {
        let cfg = presets::preset(name).unwrap();
        let s = ModelShapes::of(&cfg);
        let kinds: Vec<LinearKind> = s.linears.iter().map(|l| l.kind).collect();
        assert_eq!(kinds, LinearKind::ALL, "{name}");
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        assert_eq!(kn(&s, LinearKind::Qkv), (cfg.hidden_size, q + 2 * kv), "{name}");
        assert_eq!(kn(&s, LinearKind::O), (q, cfg.hidden_size), "{name}");
        let ffn1_n = if cfg.gated_ffn { 2 } else { 1 } * cfg.intermediate_size;
        assert_eq!(kn(&s, LinearKind::Ffn1), (cfg.hidden_size, ffn1_n), "{name}");
        assert_eq!(
            kn(&s, LinearKind::Ffn2),
            (cfg.intermediate_size, cfg.hidden_size),
            "{name}"
        );
        assert_eq!(s.ffn1_fused_gate_up, cfg.gated_ffn, "{name}");
        assert_eq!(s.gqa_ratio * cfg.num_kv_heads, cfg.num_heads, "{name}");
        // Every real model here has head_dim 128 and hidden = heads × head_dim.
        assert_eq!(cfg.head_dim, 128, "{name}");
        assert_eq!(q, cfg.hidden_size, "{name}");
        // Tensor-core GEMMs need K and N in multiples of 8 (16-byte rows of fp16).
        for l in &s.linears {
            assert!(l.k % 8 == 0 && l.n % 8 == 0, "{name}: {}", l.label());
        }
        let layer_bytes: u64 = s.linears.iter().map(|l| l.weight_bytes()).sum();
        let head_bytes = 2 * (cfg.vocab_size * cfg.hidden_size) as u64;
        assert_eq!(
            s.weight_bytes_per_token,
            layer_bytes * cfg.num_layers as u64 + head_bytes,
            "{name}"
        );
    }
}

/// Parameters implied by the preset (linears, LM head, input embedding when untied, OPT's learned
/// positions) against the published total, in billions. Norms and biases are ignored: they are
/// below 0.1 %.
#[test]
fn every_preset_matches_its_published_parameter_count() {
    let published: &[(&str, f64)] = &[
        ("llama2-7b", 6.738),
        ("llama2-13b", 13.016),
        ("llama2-70b", 68.977),
        ("llama3-8b", 8.030),
        ("llama3-70b", 70.554),
        ("qwen1.5-7b", 7.721),
        ("qwen1.5-72b", 72.288),
        ("mistral-7b", 7.242),
        ("codellama-34b", 33.744),
        ("opt-6.7b", 6.658),
        ("chatglm2-6b", 6.244),
    ];
    assert_eq!(published.len(), PRESET_NAMES.len());
    for (name, billions) in published {
        let cfg = presets::preset(name).unwrap();
        let s = ModelShapes::of(&cfg);
        let mut params = s.weight_bytes_per_token / 2;
        if !cfg.tie_word_embeddings {
            params += (cfg.vocab_size * cfg.hidden_size) as u64;
        }
        if cfg.arch == ModelArch::Opt {
            // OPT's learned position table has 2 extra rows (its offset of 2).
            params += ((cfg.max_position_embeddings + 2) * cfg.hidden_size) as u64;
        }
        let got = params as f64 / 1e9;
        let rel = (got - billions).abs() / billions;
        assert!(rel < 0.002, "{name}: {got:.3} B parameters vs published {billions} B");
    }
}

#[test]
fn family_traits_of_presets() {
    let qwen = presets::preset("qwen1.5-7b").unwrap();
    assert!(qwen.qkv_bias);
    assert_eq!(qwen.arch, ModelArch::Qwen2);
    let opt = presets::preset("opt-6.7b").unwrap();
    assert!(!opt.gated_ffn);
    assert_eq!(kn(&ModelShapes::of(&opt), LinearKind::Ffn1), (4096, 16384));
    let glm = presets::preset("chatglm2-6b").unwrap();
    assert_eq!(kn(&ModelShapes::of(&glm), LinearKind::Qkv), (4096, 4608));
    assert_eq!(kn(&ModelShapes::of(&glm), LinearKind::Ffn1), (4096, 27392));
    assert_eq!(glm.vocab_size, 65024);
    assert!(!presets::preset("llama2-70b").unwrap().qkv_bias);
}

#[test]
fn unknown_preset_lists_every_known_one() {
    let err = presets::preset("llama2-7x").unwrap_err();
    assert!(matches!(err, FdppError::UnknownPreset { .. }));
    let msg = err.to_string();
    assert!(msg.contains("'llama2-7x'"), "{msg}");
    for name in PRESET_NAMES {
        assert!(msg.contains(name), "{msg} lacks {name}");
    }
    assert!(msg.contains("config.json"), "{msg}");
    // resolve() gives the same answer for a bare word that is no file.
    let msg = ModelConfig::resolve("llama2-7x").unwrap_err().to_string();
    assert!(msg.contains("chatglm2-6b"), "{msg}");
}
