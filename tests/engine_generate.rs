//! Generation on the CPU backend with a tiny random Llama: batching with independent finishes
//! (EOS, --max-tokens, context, stop strings), seeded sampling, the tokenizer, and the bad
//! inputs of issue #5 that concern a run (prompt longer than the context, out of KV pages, a
//! batch that cannot fit, a tokenizer.json that does not load).

use fdpp::backend::cpu::CpuBackend;
use fdpp::engine::batch::{generate, FinishReason, GenerateOptions, GenerateOutput};
use fdpp::engine::build::{build, memory_plan, EngineOptions, WeightSource};
use fdpp::engine::sampler::SamplingParams;
use fdpp::error::FdppError;
use fdpp::model::hf::HfExtras;
use fdpp::model::llama::ModelSpec;
use fdpp::model::tokenizer::Tokenizer;
use fdpp::model::{ModelArch, ModelConfig};

fn tiny() -> ModelSpec {
    ModelSpec {
        cfg: ModelConfig {
            name: "tiny".into(),
            arch: ModelArch::Llama,
            hidden_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            intermediate_size: 256,
            vocab_size: 256,
            max_position_embeddings: 512,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            qkv_bias: false,
            gated_ffn: true,
        },
        extras: HfExtras::default(),
        dir: None,
        gguf: None,
    }
}

fn gen_opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        eos_ids: Vec::new(),
        ignore_eos: false,
        stop: Vec::new(),
        sampling: SamplingParams::default(),
        chunk: 2048,
        context_len: 512,
        pipeline: true,
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 41 + salt * 97 + 3) % 256).collect()
}

fn run_with(
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    eng: &EngineOptions,
    tok: Option<&Tokenizer>,
) -> fdpp::Result<GenerateOutput> {
    let spec = tiny();
    let b = CpuBackend::new();
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + opts.max_tokens).collect();
    let total = prompts.iter().map(|p| p.len()).sum();
    let plan = memory_plan(&b, &spec, eng, &lens, total)?;
    let mut e = build(&b, &spec, &WeightSource::Random { seed: 3 }, None, eng, plan)?;
    generate(&mut e, prompts, opts, tok, &mut |_, _, _| {})
}

fn run(prompts: &[Vec<u32>], opts: &GenerateOptions) -> GenerateOutput {
    run_with(prompts, opts, &EngineOptions::default(), None).expect("generate")
}

#[test]
fn a_batch_generates_what_each_prompt_generates_alone() {
    let ps = [prompt(5, 1), prompt(17, 2), prompt(9, 3)];
    let opts = gen_opts(8);
    let together = run(&ps, &opts);
    for (i, p) in ps.iter().enumerate() {
        let alone = run(std::slice::from_ref(p), &opts);
        assert_eq!(together.seqs[i].tokens, alone.seqs[0].tokens, "sequence {i}");
        assert_eq!(together.seqs[i].finish, FinishReason::MaxTokens);
        assert_eq!(together.seqs[i].tokens.len(), 8);
    }
    // Different prompts lead somewhere different (the comparison above is not vacuous).
    assert_ne!(together.seqs[0].tokens, together.seqs[1].tokens);
    let t = &together.timings;
    assert_eq!(t.decode_steps, 7, "the first token comes from the prefill");
    assert_eq!(t.decode_tokens, 21);
    assert_eq!(t.step_ms.len(), 7);
    assert!(t.first_token_ms > 0.0 && t.per_token_ms > 0.0 && t.decode_tok_per_s > 0.0);
    assert!(together.attention.rows > 0);
}

#[test]
fn sequences_finish_independently_on_eos_and_the_rest_continue() {
    let ps = [prompt(6, 4), prompt(11, 5)];
    let free = run(&ps, &gen_opts(10));
    // Sequence 0 stops at its third token when that token is the EOS id (and it does not
    // occur earlier in either sequence's first tokens before it).
    let eos = free.seqs[0].tokens[2];
    let opts = GenerateOptions {
        eos_ids: vec![eos],
        ..gen_opts(10)
    };
    let got = run(&ps, &opts);
    let first_eos = free.seqs[0].tokens.iter().position(|&t| t == eos).expect("eos");
    assert_eq!(got.seqs[0].finish, FinishReason::Eos);
    assert_eq!(got.seqs[0].tokens, free.seqs[0].tokens[..=first_eos]);
    match free.seqs[1].tokens.iter().position(|&t| t == eos) {
        Some(at) => assert_eq!(got.seqs[1].tokens, free.seqs[1].tokens[..=at]),
        None => {
            assert_eq!(got.seqs[1].tokens, free.seqs[1].tokens);
            assert_eq!(got.seqs[1].finish, FinishReason::MaxTokens);
        }
    }
    // --ignore-eos runs to the limit.
    let ignore = GenerateOptions {
        ignore_eos: true,
        ..opts.clone()
    };
    assert_eq!(run(&ps, &ignore).seqs[0].tokens, free.seqs[0].tokens);
}

#[test]
fn the_pipelined_greedy_decode_gives_what_the_step_by_step_one_gives() {
    // One sequence stops on EOS (the step queued ahead of that is computed for it and dropped),
    // two on the context, one on max tokens (no step is queued past a certain stop).
    let ps = [prompt(6, 4), prompt(11, 5), prompt(9, 6), prompt(3, 7)];
    let step_by_step = |o: &GenerateOptions| {
        run(
            &ps,
            &GenerateOptions {
                pipeline: false,
                ..o.clone()
            },
        )
    };
    let eos = step_by_step(&gen_opts(10)).seqs[0].tokens[2];
    let opts = GenerateOptions {
        eos_ids: vec![eos],
        context_len: 16,
        ..gen_opts(10)
    };
    let (seq, pip) = (step_by_step(&opts), run(&ps, &opts));
    let finishes: Vec<FinishReason> = seq.seqs.iter().map(|s| s.finish).collect();
    assert_eq!(finishes[0], FinishReason::Eos);
    assert_eq!(
        finishes[1..],
        [FinishReason::Context, FinishReason::Context, FinishReason::MaxTokens]
    );
    for (i, (a, b)) in seq.seqs.iter().zip(&pip.seqs).enumerate() {
        assert_eq!(a.tokens, b.tokens, "sequence {i}");
        assert_eq!(a.finish, b.finish, "sequence {i}");
    }
    assert_eq!(seq.timings.decode_tokens, pip.timings.decode_tokens);
    // The pipelined run did queue a step ahead for the sequence that stopped on EOS: it
    // attended one row more per layer and head than the step-by-step run.
    assert!(
        pip.attention.rows > seq.attention.rows,
        "{} vs {}",
        pip.attention.rows,
        seq.attention.rows
    );
}

#[test]
fn the_context_ends_a_sequence_and_a_longer_prompt_is_refused() {
    let opts = GenerateOptions {
        context_len: 12,
        ..gen_opts(10)
    };
    let got = run(&[prompt(9, 6)], &opts);
    assert_eq!(got.seqs[0].tokens.len(), 3);
    assert_eq!(got.seqs[0].finish, FinishReason::Context);
    let e = run_with(&[prompt(13, 6)], &opts, &EngineOptions::default(), None).expect_err("13 > 12");
    assert!(
        e.to_string()
            .contains("13 tokens, longer than the model's context of 12"),
        "{e}"
    );
    let e = run_with(&[vec![3, 256]], &gen_opts(2), &EngineOptions::default(), None).expect_err("id 256");
    assert!(e.to_string().contains("token id 256 is outside the vocabulary"), "{e}");
}

#[test]
fn running_out_of_kv_pages_is_a_clear_error() {
    // 2 pages of 16 tokens; the prompt takes 20 tokens, decode needs a third page at 33.
    let eng = EngineOptions {
        max_kv_tokens: Some(32),
        ..EngineOptions::default()
    };
    let e = run_with(&[prompt(20, 7)], &gen_opts(30), &eng, None).expect_err("out of pages");
    assert!(
        matches!(
            e,
            FdppError::OutOfKvPages {
                needed: 1,
                free: 0,
                total: 2
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("out of KV pages"), "{e}");
    // The failed batch gave its pages back: the same engine serves a batch that fits.
    let spec = tiny();
    let b = CpuBackend::new();
    let plan = memory_plan(&b, &spec, &eng, &[50], 20).expect("plan");
    let mut e = build(&b, &spec, &WeightSource::Random { seed: 3 }, None, &eng, plan).expect("engine");
    let err = generate(&mut e, &[prompt(20, 7)], &gen_opts(30), None, &mut |_, _, _| {}).expect_err("pages");
    assert!(matches!(err, FdppError::OutOfKvPages { .. }), "{err:?}");
    assert_eq!(e.kv.pages.free_pages(), 2);
    let ok = generate(&mut e, &[prompt(20, 7)], &gen_opts(12), None, &mut |_, _, _| {}).expect("fits");
    assert_eq!(ok.seqs[0].tokens.len(), 12);
    assert_eq!(e.kv.pages.free_pages(), 2, "finished sequences give their pages back");
    // A prompt that does not fit at all fails in the prefill with the same error.
    let e = run_with(&[prompt(40, 7)], &gen_opts(2), &eng, None).expect_err("prompt of 3 pages");
    assert!(matches!(e, FdppError::OutOfKvPages { .. }), "{e:?}");
}

#[test]
fn a_batch_that_cannot_fit_says_how_much_it_needs() {
    let eng = EngineOptions {
        mem_fraction: 1e-9,
        ..EngineOptions::default()
    };
    let e = run_with(&[prompt(8, 1)], &gen_opts(4), &eng, None).expect_err("no room");
    let msg = e.to_string();
    assert!(msg.contains("does not fit: it needs") && msg.contains("MiB"), "{msg}");
}

#[test]
fn seeded_sampling_repeats_and_differs_from_greedy() {
    let ps = [prompt(7, 8)];
    let sampled = GenerateOptions {
        sampling: SamplingParams {
            temperature: 1.5,
            top_k: 50,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: 11,
        },
        ..gen_opts(24)
    };
    let a = run(&ps, &sampled);
    let b = run(&ps, &sampled);
    assert_eq!(a.seqs[0].tokens, b.seqs[0].tokens);
    let greedy = run(&ps, &gen_opts(24));
    assert_ne!(a.seqs[0].tokens, greedy.seqs[0].tokens);
}

/// A word-level tokenizer over "w0" … "w255", words separated by spaces.
fn word_tokenizer(dir: &std::path::Path) -> Tokenizer {
    let vocab: Vec<String> = (0..256).map(|i| format!("\"w{i}\": {i}")).collect();
    let json = format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {{"type": "WhitespaceSplit"}},
            "post_processor": null, "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "w0"}}}}"#,
        vocab.join(", ")
    );
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).expect("write");
    Tokenizer::load(&path).expect("tokenizer loads")
}

#[test]
fn text_is_streamed_and_a_stop_string_ends_the_sequence() {
    let dir = tempfile::tempdir().expect("tmp");
    let tok = word_tokenizer(dir.path());
    let ids = tok.encode("w5 w17 w200").expect("encode");
    assert_eq!(ids, vec![5, 17, 200]);
    assert_eq!(tok.decode(&ids).expect("decode"), "w5 w17 w200");
    let p = prompt(6, 9);
    let free = run_with(
        std::slice::from_ref(&p),
        &gen_opts(8),
        &EngineOptions::default(),
        Some(&tok),
    )
    .expect("run");
    let text = free.seqs[0].text.clone().expect("text");
    let words: Vec<&str> = text.split(' ').collect();
    assert_eq!(words.len(), 8, "{text}");
    // Stop at the third word: the text ends before it.
    let stop = format!(" {}", words[2]);
    let opts = GenerateOptions {
        stop: vec![stop.clone()],
        ..gen_opts(8)
    };
    let got = run_with(&[p], &opts, &EngineOptions::default(), Some(&tok)).expect("run");
    let s = &got.seqs[0];
    assert_eq!(s.finish, FinishReason::Stop);
    let cut = text.find(&stop).expect("stop occurs");
    assert_eq!(s.text.as_deref(), Some(&text[..cut]));
    assert!(s.tokens.len() <= 3);
    // Stop strings need a tokenizer.
    let e = run_with(&[prompt(3, 1)], &opts, &EngineOptions::default(), None).expect_err("no tokenizer");
    assert!(e.to_string().contains("--stop needs a tokenizer"), "{e}");
}

#[test]
fn a_tokenizer_json_that_does_not_load_names_the_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, r#"{"version": "1.0", "model": {"type": "Nonsense"}}"#).expect("write");
    let e = Tokenizer::load(&path).err().expect("bad tokenizer");
    let msg = e.to_string();
    assert!(msg.contains("tokenizer.json") && msg.contains("does not load"), "{msg}");
    assert!(Tokenizer::find(dir.path()).is_some());
    assert!(Tokenizer::find(&dir.path().join("nowhere")).is_none());
}
