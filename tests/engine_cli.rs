//! `fdpp generate` end to end on the CPU backend with tiny models written by the tests: JSON
//! output, streaming text through a tokenizer, the profile (found, given, or `none`), reuse vs
//! no-reuse activation bytes, and every bad input as a clear message with a non-zero exit.

use std::path::Path;
use std::process::{Command, Output};

use fdpp::dtype::{random_bits, DType};
use fdpp::model::weights::checkpoint_tensors;
use fdpp::model::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 128,
  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256,
  "max_position_embeddings": 64, "eos_token_id": 2}"#;

fn fdpp(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("fdpp runs")
}

fn ok(out: &Output) -> (String, String) {
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "failed:\nstdout: {so}\nstderr: {se}");
    (so, se)
}

fn fails(out: &Output, needles: &[&str]) {
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {se}");
    assert!(!se.contains("panicked"), "{se}");
    for n in needles {
        assert!(se.contains(n), "stderr lacks {n:?}: {se}");
    }
}

fn model_dir(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("config.json"), config).expect("config");
    dir
}

fn word_tokenizer(dir: &Path) {
    let vocab: Vec<String> = (0..256).map(|i| format!("\"w{i}\": {i}")).collect();
    let json = format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {{"type": "WhitespaceSplit"}},
            "post_processor": null, "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "w0"}}}}"#,
        vocab.join(", ")
    );
    std::fs::write(dir.join("tokenizer.json"), json).expect("tokenizer");
}

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

const BASE: [&str; 4] = ["generate", "--backend", "cpu", "--random-weights"];

fn args<'a>(dir: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut v = BASE.to_vec();
    v.extend(["--model", dir]);
    v.extend(more);
    v
}

#[test]
fn json_output_has_tokens_timings_and_memory_and_reuse_saves_memory() {
    let dir = model_dir(CONFIG);
    let d = dir.path().to_str().expect("utf-8");
    let run = |extra: &[&str]| {
        let mut more = vec![
            "--token-ids",
            "5,6,7,8",
            "--token-ids",
            "9,10",
            "--max-tokens",
            "5",
            "--json",
        ];
        more.extend(extra);
        let (so, _) = ok(&fdpp(&args(d, &more), dir.path()));
        json(&so)
    };
    let v = run(&["--ignore-eos"]);
    let seqs = v["seqs"].as_array().expect("seqs");
    assert_eq!(seqs.len(), 2);
    for s in seqs {
        assert_eq!(s["tokens"].as_array().expect("tokens").len(), 5);
        assert_eq!(s["finish"], "max_tokens");
    }
    assert_eq!(seqs[0]["prompt"], serde_json::json!([5, 6, 7, 8]));
    let t = &v["timings"];
    assert!(t["first_token_ms"].as_f64().expect("ttft") > 0.0);
    assert!(t["per_token_ms"].as_f64().expect("tpot") > 0.0);
    assert!(t["decode_tok_per_s"].as_f64().expect("tok/s") > 0.0);
    assert_eq!(t["decode_steps"], 4);
    assert_eq!(v["profile"], serde_json::Value::Null);
    assert_eq!(v["gemm_plans"].as_array().expect("plans").len(), 10);
    let reuse = &v["memory"]["activations"];
    assert_eq!(reuse["reuse"], true);
    let no_reuse = run(&["--ignore-eos", "--no-reuse"]);
    let a = reuse["bytes"].as_u64().expect("bytes");
    let b = no_reuse["memory"]["activations"]["bytes"].as_u64().expect("bytes");
    assert!(a * 5 <= b * 4, "reuse {a} vs no reuse {b}: at most 80 %");
    // The same tokens either way.
    for i in 0..2 {
        assert_eq!(v["seqs"][i]["tokens"], no_reuse["seqs"][i]["tokens"]);
    }
    let w = v["memory"]["weights_bytes"].as_u64().expect("weights");
    assert_eq!(
        w,
        2 * (2 * 256 * 128 + 2 * (2 * 128 + 512 * 128 + 128 * 256 + 512 * 128 + 128 * 256) + 128)
    );
}

#[test]
fn text_streams_through_the_tokenizer_and_weights_load_from_safetensors() {
    let dir = model_dir(CONFIG);
    word_tokenizer(dir.path());
    let cfg = ModelConfig::resolve(dir.path().to_str().expect("utf-8")).expect("config");
    let mut blobs = Vec::new();
    for (i, (name, shape)) in checkpoint_tensors(&cfg).into_iter().enumerate() {
        let len: usize = shape.iter().product();
        let scale = if name.contains("norm") { 0.0 } else { 0.3 };
        let bits: Vec<u16> = random_bits(DType::F16, len, scale, i as u64)
            .iter()
            .map(|&b| {
                if name.contains("norm") {
                    DType::F16.from_f32(1.0)
                } else {
                    b
                }
            })
            .collect();
        blobs.push((
            name,
            shape,
            bits.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>(),
        ));
    }
    let views: Vec<(String, TensorView<'_>)> = blobs
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::F16, s.clone(), b).expect("view")))
        .collect();
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors::tensor::serialize(views, None).expect("serialize"),
    )
    .expect("write");
    let d = dir.path().to_str().expect("utf-8");
    let run = [
        "generate",
        "--backend",
        "cpu",
        "--model",
        d,
        "--max-tokens",
        "6",
        "--ignore-eos",
    ];
    let mut with_prompt = run.to_vec();
    with_prompt.extend(["--prompt", "w3 w4 w5"]);
    let (so, se) = ok(&fdpp(&with_prompt, dir.path()));
    assert!(se.contains("loaded from"), "{se}");
    let words: Vec<&str> = so.split_whitespace().collect();
    assert_eq!(words.len(), 6, "{so}");
    assert!(words.iter().all(|w| w.starts_with('w')), "{so}");
    // The same prompt from a file and as ids gives the same text.
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "w3 w4 w5").expect("prompt file");
    let mut from_file = run.to_vec();
    from_file.extend(["--prompt-file", file.to_str().expect("utf-8")]);
    assert_eq!(ok(&fdpp(&from_file, dir.path())).0, so);
    let mut json_run = run.to_vec();
    json_run.extend(["--token-ids", "3,4,5", "--json"]);
    let v = json(&ok(&fdpp(&json_run, dir.path())).0);
    assert_eq!(v["seqs"][0]["text"].as_str().map(str::trim), Some(so.trim()));
    // A stop string cuts the text.
    let mut stop = run.to_vec();
    stop.extend(["--prompt", "w3 w4 w5", "--stop", words[1], "--json"]);
    let v = json(&ok(&fdpp(&stop, dir.path())).0);
    assert_eq!(v["seqs"][0]["finish"], "stop");
    // A broken tokenizer.json is named.
    std::fs::write(dir.path().join("tokenizer.json"), "{ not json").expect("write");
    fails(&fdpp(&with_prompt, dir.path()), &["tokenizer.json", "does not load"]);
}

#[test]
fn the_profile_is_found_given_or_refused_and_drives_the_gemm_choice() {
    let dir = model_dir(CONFIG);
    let d = dir.path().to_str().expect("utf-8");
    let work = tempfile::tempdir().expect("work");
    let (_, se) = ok(&fdpp(
        &args(d, &["--token-ids", "1,2,3", "--max-tokens", "2"]),
        work.path(),
    ));
    assert!(se.contains("profile: none found at profiles/"), "{se}");
    let (_, se) = ok(&fdpp(
        &args(d, &["--token-ids", "1,2,3", "--max-tokens", "2", "--profile", "none"]),
        work.path(),
    ));
    // Without a profile the CPU's built-in rule runs, and says so; gemm_fallback=vendor restores
    // the vendor GEMM everywhere.
    assert!(
        se.contains("profile: none (asked for): built-in rule for the CPU"),
        "{se}"
    );
    assert!(se.contains("gemm at decode M=1: qkv=gemv_f16"), "{se}");
    let (_, se) = ok(&fdpp(
        &args(
            d,
            &[
                "--token-ids",
                "1,2,3",
                "--max-tokens",
                "2",
                "--profile",
                "none",
                "--set",
                "gemm_fallback=vendor",
            ],
        ),
        work.path(),
    ));
    assert!(se.contains("the vendor gemm at every M"), "{se}");
    assert!(se.contains("gemm at decode M=1: qkv=gemm_f16"), "{se}");
    // Tune the tiny model on the CPU into the default path, then generate finds it.
    let (_, tse) = ok(&fdpp(
        &["tune", "--model", d, "--backend", "cpu", "--m-max", "4", "--reps", "1"],
        work.path(),
    ));
    assert!(tse.contains("profile: profiles/"), "{tse}");
    let (_, se) = ok(&fdpp(
        &args(d, &["--token-ids", "1,2,3", "--max-tokens", "2"]),
        work.path(),
    ));
    let line = se.lines().find(|l| l.starts_with("profile: ")).expect("profile line");
    assert!(
        line.starts_with("profile: profiles/") && line.ends_with(".json"),
        "{se}"
    );
    assert!(se.contains("the profile has no softmax section"), "{se}");
    let (_, se) = ok(&fdpp(
        &args(d, &["--token-ids", "1,2,3", "--max-tokens", "2", "--softmax", "sync"]),
        work.path(),
    ));
    assert!(se.contains("softmax: sync (asked for)"), "{se}");
    // A profile that measures some of another model's shapes serves those and says which
    // fall back to the vendor GEMM; one that measures none of them is refused.
    let path = line.trim_start_matches("profile: ");
    let abs = work.path().join(path);
    let given = |config: &str| {
        let other = model_dir(config);
        fdpp(
            &args(
                other.path().to_str().expect("utf-8"),
                &[
                    "--token-ids",
                    "1,2",
                    "--max-tokens",
                    "1",
                    "--profile",
                    abs.to_str().expect("utf-8"),
                ],
            ),
            work.path(),
        )
    };
    let (_, se) = ok(&given(
        &CONFIG.replace("\"intermediate_size\": 256", "\"intermediate_size\": 384"),
    ));
    assert!(se.contains("no entry for ffn1[K=128,N=768], ffn2[K=384,N=128]"), "{se}");
    let out = given(&CONFIG.replace("\"hidden_size\": 128", "\"hidden_size\": 192"));
    fails(&out, &["other shapes"]);
    // Without --profile, a model of the same shapes under another name finds it by shape.
    let twin = tempfile::tempdir().expect("twin");
    let twin_dir = twin.path().join("twin-model");
    std::fs::create_dir(&twin_dir).expect("mkdir");
    std::fs::copy(dir.path().join("config.json"), twin_dir.join("config.json")).expect("copy");
    let (_, se) = ok(&fdpp(
        &args(
            twin_dir.to_str().expect("utf-8"),
            &["--token-ids", "1,2", "--max-tokens", "1"],
        ),
        work.path(),
    ));
    assert!(se.contains("found by shape"), "{se}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = model_dir(CONFIG);
    let d = dir.path().to_str().expect("utf-8");
    let here = dir.path();
    // A preset has no weights without --random-weights.
    fails(
        &fdpp(&["generate", "--backend", "cpu", "--model", "llama2-7b"], here),
        &["is a preset", "--random-weights"],
    );
    // A directory without config.json.
    let empty = tempfile::tempdir().expect("tmp");
    fails(
        &fdpp(&args(empty.path().to_str().expect("utf-8"), &[]), here),
        &["no config.json"],
    );
    // A directory without weights.
    fails(
        &fdpp(
            &["generate", "--backend", "cpu", "--model", d, "--token-ids", "1"],
            here,
        ),
        &["no *.safetensors"],
    );
    // An architecture the engine does not run names the field that said so and the supported
    // ones.
    let gpt2 = model_dir(
        r#"{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 256}"#,
    );
    fails(
        &fdpp(&args(gpt2.path().to_str().expect("utf-8"), &["--token-ids", "1"]), here),
        &[
            "architecture 'GPT2LMHeadModel' (model_type 'gpt2')",
            "OPTForCausalLM",
            "ChatGLMModel",
            "llama, mistral, qwen2, opt, chatglm",
        ],
    );
    // A prompt longer than the context (max_position_embeddings 64).
    let long: Vec<String> = (0..70).map(|i| (i % 200).to_string()).collect();
    let long = long.join(",");
    fails(
        &fdpp(&args(d, &["--token-ids", &long]), here),
        &["70 tokens, longer than the model's context of 64"],
    );
    // A batch that cannot fit says how much it needs.
    fails(
        &fdpp(
            &args(d, &["--token-ids", "1,2", "--mem-fraction", "0.0000000001"]),
            here,
        ),
        &["does not fit: it needs"],
    );
    // Running out of KV pages.
    fails(
        &fdpp(
            &args(
                d,
                &[
                    "--token-ids",
                    "1,2,3,4,5,6,7,8,9,10",
                    "--max-tokens",
                    "20",
                    "--max-kv-tokens",
                    "16",
                    "--ignore-eos",
                ],
            ),
            here,
        ),
        &["out of KV pages"],
    );
    // Bad ids and sampling parameters.
    fails(
        &fdpp(&args(d, &["--token-ids", "1,x"]), here),
        &["'x' is not a token id"],
    );
    fails(
        &fdpp(&args(d, &["--token-ids", "1,300"]), here),
        &["token id 300 is outside"],
    );
    fails(
        &fdpp(&args(d, &["--top-p", "0"]), here),
        &["--top-p 0 must be in (0, 1]"],
    );
    fails(
        &fdpp(&args(d, &["--prompt", "hello"]), here),
        &["needs the model's tokenizer.json"],
    );
    let yarn = model_dir(&CONFIG.replace(
        "\"eos_token_id\": 2",
        "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4}",
    ));
    fails(
        &fdpp(&args(yarn.path().to_str().expect("utf-8"), &[]), here),
        &["'yarn' is not supported; supported: default, linear, llama3"],
    );
}

/// `fdpp generate --random-weights` runs OPT and ChatGLM2 (tiny configs with their own field
/// names) on the CPU; an OPT with post-LayerNorm is refused naming the field.
#[test]
fn generate_runs_opt_and_chatglm_configs_and_names_what_it_refuses() {
    let opt = r#"{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 128,
        "ffn_dim": 256, "word_embed_proj_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64, "activation_function": "relu",
        "do_layer_norm_before": true, "enable_bias": true, "eos_token_id": 2}"#;
    let glm = r#"{"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 128,
        "num_layers": 2, "num_attention_heads": 4, "kv_channels": 64, "multi_query_attention": true,
        "multi_query_group_num": 2, "ffn_hidden_size": 256, "padded_vocab_size": 256,
        "seq_length": 64, "layernorm_epsilon": 1e-5, "rmsnorm": true, "post_layer_norm": true,
        "add_qkv_bias": true, "add_bias_linear": false, "eos_token_id": 2}"#;
    for (name, config) in [("opt", opt), ("chatglm", glm)] {
        let dir = model_dir(config);
        let d = dir.path().to_str().expect("utf-8");
        let (so, _) = ok(&fdpp(
            &args(
                d,
                &["--token-ids", "5,6,7,8", "--max-tokens", "6", "--ignore-eos", "--json"],
            ),
            dir.path(),
        ));
        let v = json(&so);
        let tokens = v["seqs"][0]["tokens"].as_array().expect("tokens");
        assert_eq!(tokens.len(), 6, "{name}: {so}");
        assert!(
            tokens.iter().all(|t| t.as_u64().is_some_and(|t| t < 256)),
            "{name}: {so}"
        );
    }
    let post_ln = opt.replace(r#""do_layer_norm_before": true"#, r#""do_layer_norm_before": false"#);
    let dir = model_dir(&post_ln);
    let d = dir.path().to_str().expect("utf-8");
    fails(
        &fdpp(&args(d, &["--token-ids", "5,6", "--max-tokens", "2"]), dir.path()),
        &["do_layer_norm_before", "post-LayerNorm"],
    );
}
