//! The engine against an independent f64 Llama forward written here from HF's modeling code,
//! on tiny HF directories (config.json + safetensors) written by the test: Llama with GQA and
//! linear rope_scaling, Qwen2 with QKV bias and tied embeddings. This checks what the
//! self-consistency tests cannot: the q/k/v and gate/up fusion, the rotate-half RoPE, the
//! bias, the tied LM head and the HF loading path. Also the directory's bad inputs.

use std::collections::HashMap;
use std::path::Path;

use fdpp::backend::cpu::CpuBackend;
use fdpp::dtype::{random_bits, DType};
use fdpp::engine::build::{build, memory_plan, EngineOptions, WeightSource};
use fdpp::kv::BlockTable;
use fdpp::model::llama::ModelSpec;
use fdpp::model::weights::checkpoint_tensors;
use fdpp::model::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};

const LLAMA: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
  "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
  "tie_word_embeddings": false, "rope_scaling": {"type": "linear", "factor": 2.0},
  "eos_token_id": 2, "bos_token_id": 1
}"#;

const QWEN2: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"],
  "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 300,
  "max_position_embeddings": 512, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
  "tie_word_embeddings": true, "eos_token_id": [5, 7]
}"#;

/// Random f16 weights with scales that keep activations near unit size; norms near 1.
fn write_checkpoint(dir: &Path, config: &str) -> (ModelConfig, HashMap<String, Vec<f64>>) {
    std::fs::write(dir.join("config.json"), config).expect("config");
    let cfg = ModelConfig::resolve(dir.to_str().expect("utf-8")).expect("config parses");
    let mut host = HashMap::new();
    let mut blobs = Vec::new();
    for (i, (name, shape)) in checkpoint_tensors(&cfg).into_iter().enumerate() {
        let len: usize = shape.iter().product();
        let seed = 1000 + i as u64;
        let bits: Vec<u16> = if name.ends_with("norm.weight") {
            random_bits(DType::F16, len, 0.2, seed)
                .iter()
                .map(|&b| DType::F16.from_f32(1.0 + DType::F16.to_f32(b)))
                .collect()
        } else if name.ends_with("bias") {
            random_bits(DType::F16, len, 0.5, seed)
        } else if name.contains("embed") {
            random_bits(DType::F16, len, 1.0, seed)
        } else {
            random_bits(DType::F16, len, (3.0 / shape[1] as f32).sqrt() * 2.0, seed)
        };
        host.insert(
            name.clone(),
            bits.iter().map(|&b| DType::F16.to_f32(b) as f64).collect(),
        );
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        blobs.push((name, shape, bytes));
    }
    let views: Vec<(String, TensorView<'_>)> = blobs
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::F16, s.clone(), b).expect("view")))
        .collect();
    let bytes = safetensors::tensor::serialize(views, None).expect("serialize");
    std::fs::write(dir.join("model.safetensors"), bytes).expect("write");
    (cfg, host)
}

/// y[n] = Σ_k x[k] · w[n][k] (+ b[n]).
fn linear(x: &[f64], w: &[f64], b: Option<&[f64]>, n: usize) -> Vec<f64> {
    let k = x.len();
    (0..n)
        .map(|r| {
            let dot: f64 = w[r * k..(r + 1) * k].iter().zip(x).map(|(a, b)| a * b).sum();
            dot + b.map_or(0.0, |b| b[r])
        })
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// HF's rotate_half: x·cos + rotate_half(x)·sin, pairs (i, i + D/2).
fn rope(head: &mut [f64], pos: usize, inv_freq: &[f64]) {
    let half = head.len() / 2;
    for i in 0..half {
        let (s, c) = (pos as f64 * inv_freq[i]).sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * c - b * s;
        head[i + half] = b * c + a * s;
    }
}

/// Logits of the last token of `ids`, in f64.
fn reference(cfg: &ModelConfig, w: &HashMap<String, Vec<f64>>, ids: &[u32], rope_factor: f64) -> Vec<f64> {
    let (h, d, nh, nkv) = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
    let eps = cfg.rms_norm_eps;
    let inv_freq: Vec<f64> = (0..d / 2)
        .map(|i| cfg.rope_theta.powf(-((2 * i) as f64) / d as f64) / rope_factor)
        .collect();
    let t = |n: &str| w.get(n).map(|v| v.as_slice()).unwrap_or_else(|| panic!("{n}"));
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| t("model.embed_tokens.weight")[id as usize * h..(id as usize + 1) * h].to_vec())
        .collect();
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        let bias = |n: &str| cfg.qkv_bias.then(|| t(&format!("{p}.self_attn.{n}_proj.bias")));
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let hn = rmsnorm(x, t(&format!("{p}.input_layernorm.weight")), eps);
            let mut q = linear(&hn, t(&format!("{p}.self_attn.q_proj.weight")), bias("q"), nh * d);
            let mut k = linear(&hn, t(&format!("{p}.self_attn.k_proj.weight")), bias("k"), nkv * d);
            let v = linear(&hn, t(&format!("{p}.self_attn.v_proj.weight")), bias("v"), nkv * d);
            q.chunks_mut(d).for_each(|hd| rope(hd, pos, &inv_freq));
            k.chunks_mut(d).for_each(|hd| rope(hd, pos, &inv_freq));
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (i, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0.0; nh * d];
            for head in 0..nh {
                let kvh = head / (nh / nkv);
                let q = &qs[i][head * d..(head + 1) * d];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &ks[j][kvh * d..(kvh + 1) * d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for c in 0..d {
                        attn[head * d + c] += ej / z * vs[j][kvh * d + c];
                    }
                }
            }
            let o = linear(&attn, t(&format!("{p}.self_attn.o_proj.weight")), None, h);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hn = rmsnorm(x, t(&format!("{p}.post_attention_layernorm.weight")), eps);
            let inter = cfg.intermediate_size;
            let g = linear(&hn, t(&format!("{p}.mlp.gate_proj.weight")), None, inter);
            let u = linear(&hn, t(&format!("{p}.mlp.up_proj.weight")), None, inter);
            let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let f = linear(&a, t(&format!("{p}.mlp.down_proj.weight")), None, h);
            x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        }
    }
    let last = rmsnorm(xs.last().expect("tokens"), t("model.norm.weight"), eps);
    let head = if cfg.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    linear(&last, t(head), None, cfg.vocab_size)
}

fn check(config: &str, rope_factor: f64) {
    let dir = tempfile::tempdir().expect("tmp");
    let (cfg, host) = write_checkpoint(dir.path(), config);
    let spec = ModelSpec::resolve(dir.path().to_str().expect("utf-8")).expect("spec");
    let prompt: Vec<u32> = (0..11u32).map(|i| (i * 53 + 7) % cfg.vocab_size as u32).collect();
    let b = CpuBackend::new();
    let opts = EngineOptions::default();
    let plan = memory_plan(&b, &spec, &opts, &[prompt.len() + 1], prompt.len()).expect("plan");
    let source = WeightSource::Dir(dir.path().to_path_buf());
    let mut e = build(&b, &spec, &source, None, &opts, plan).expect("engine");
    let mut tables = vec![BlockTable::default()];
    let got = e
        .prefill(&mut tables, &[&prompt], opts.chunk, &mut |_, _| Ok(()))
        .expect("prefill")
        .remove(0);
    let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
    let after = e.decode(&mut refs, &[3]).expect("decode").remove(0);
    let mut longer = prompt.clone();
    longer.push(3);
    for (got, ids) in [(got, &prompt), (after, &longer)] {
        let want = reference(&cfg, &host, ids, rope_factor);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
            / scale;
        assert!(scale > 1.0, "logits too small to compare: {scale}");
        // fp16 activations rounded at every op against f64 throughout.
        assert!(err < 1e-2, "{}: max relative error {err}", cfg.name);
        let argmax = |v: &[f64]| (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b });
        let got64: Vec<f64> = got.iter().map(|&v| v as f64).collect();
        assert_eq!(argmax(&got64), argmax(&want), "greedy token");
    }
}

#[test]
fn llama_with_gqa_and_linear_rope_scaling_matches_the_f64_reference() {
    check(LLAMA, 2.0);
}

#[test]
fn qwen2_with_bias_and_tied_embeddings_matches_the_f64_reference() {
    check(QWEN2, 1.0);
}

#[test]
fn extras_come_from_config_and_generation_config() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("config.json"), QWEN2).expect("config");
    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": [7, 9]}"#).expect("gen");
    let spec = ModelSpec::resolve(dir.path().to_str().expect("utf-8")).expect("spec");
    assert_eq!(spec.extras.eos_token_ids, vec![5, 7, 9]);
    assert_eq!(spec.context_len(), 512);
    assert_eq!(spec.dir.as_deref(), Some(dir.path()));
}

#[test]
fn bad_directories_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tmp");
    let arg = dir.path().to_str().expect("utf-8");
    let e = ModelSpec::resolve(arg).expect_err("no config.json");
    assert!(e.to_string().contains("no config.json"), "{e}");
    // An unknown rope_scaling type names the supported ones.
    let yarn = LLAMA.replace(r#""type": "linear""#, r#""type": "yarn""#);
    std::fs::write(dir.path().join("config.json"), yarn).expect("config");
    let e = ModelSpec::resolve(arg).expect_err("yarn");
    assert!(
        e.to_string()
            .contains("'yarn' is not supported; supported: default, linear, llama3"),
        "{e}"
    );
    // A variant of a family the forward pass does not run (OPT-350m's post-LayerNorm): the
    // memory plan already names the config field.
    let opt = r#"{"architectures": ["OPTForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "ffn_dim": 512, "vocab_size": 256, "do_layer_norm_before": false}"#;
    std::fs::write(dir.path().join("config.json"), opt).expect("config");
    let spec = ModelSpec::resolve(arg).expect("parses: OPT has shapes");
    let b = CpuBackend::new();
    let opts = EngineOptions::default();
    let e = memory_plan(&b, &spec, &opts, &[4], 4).expect_err("post-LN OPT");
    assert!(
        e.to_string().contains("'do_layer_norm_before' = false") && e.to_string().contains("post-LayerNorm"),
        "{e}"
    );
    // Weights missing from the directory.
    std::fs::write(dir.path().join("config.json"), LLAMA).expect("config");
    let spec = ModelSpec::resolve(arg).expect("spec");
    let plan = memory_plan(&b, &spec, &opts, &[4], 4).expect("plan");
    let e = build(&b, &spec, &WeightSource::Dir(dir.path().into()), None, &opts, plan)
        .err()
        .expect("no safetensors");
    assert!(e.to_string().contains("no *.safetensors"), "{e}");
}

#[test]
fn rope_scaling_of_llama3_and_transformers5_configs_parses() {
    use fdpp::model::config::RopeScaling;
    use fdpp::model::hf::parse_extras;
    let p = Path::new("config.json");
    let llama31 = r#"{"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000}"#;
    let x = parse_extras(llama31, p).expect("llama 3.1");
    assert_eq!(
        x.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    assert_eq!(x.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(x.bos_token_id, Some(128000));
    // transformers 5: rope_parameters with the default type is no scaling.
    let v5 = r#"{"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}"#;
    assert_eq!(parse_extras(v5, p).expect("v5").rope_scaling, None);
    let lin = r#"{"rope_scaling": {"type": "linear", "factor": 4}}"#;
    assert_eq!(
        parse_extras(lin, p).expect("linear").rope_scaling,
        Some(RopeScaling::Linear { factor: 4.0 })
    );
    // Mistral's window counts; Qwen2's only with use_sliding_window.
    assert_eq!(
        parse_extras(r#"{"sliding_window": 4096}"#, p)
            .expect("w")
            .sliding_window,
        Some(4096)
    );
    let qwen = r#"{"sliding_window": 4096, "use_sliding_window": false}"#;
    assert_eq!(parse_extras(qwen, p).expect("q").sliding_window, None);
    for (bad, needle) in [
        (
            r#"{"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}"#,
            "needs 'low_freq_factor'",
        ),
        (r#"{"rope_scaling": {"type": "linear"}}"#, "needs a 'factor'"),
        (r#"{"rope_scaling": {"type": "linear", "factor": -1}}"#, "positive"),
        (
            r#"{"rope_scaling": {"type": "dynamic", "factor": 2}}"#,
            "'dynamic' is not supported",
        ),
        (r#"{"rope_scaling": {"factor": 2}}"#, "no 'rope_type'"),
        (r#"{"eos_token_id": "x"}"#, "must hold token ids"),
    ] {
        let e = parse_extras(bad, p).expect_err(bad);
        assert!(e.to_string().contains(needle), "{bad}: {e}");
        assert!(e.to_string().contains("config.json"), "{e}");
    }
}
