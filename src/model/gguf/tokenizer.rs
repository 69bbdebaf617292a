//! A `tokenizers::Tokenizer` from the vocabulary a GGUF file carries (`tokenizer.ggml.*`).
//!
//! Two models, as llama.cpp names them:
//! - `gpt2`: byte-level BPE. The token strings are already in the byte-to-unicode alphabet
//!   (`Ġ` for a space), `tokenizer.ggml.merges` holds the merges by rank, and
//!   `tokenizer.ggml.pre` names how text is split before BPE (each name is a regex or a sequence
//!   fixed by the model family; the ones fdpp knows are in [`PRE_TOKENIZERS`]).
//! - `llama`: SentencePiece BPE. Pieces use `▁` for a space and carry scores; SentencePiece
//!   merges the adjacent pair whose joined piece scores highest, which is BPE with the merges
//!   ranked by the joined piece's score. Bytes outside the vocabulary fall back to `<0xNN>`.
//!
//! The tokenizer is assembled as the JSON of an HF tokenizer.json and deserialized, so that it
//! behaves exactly as the same tokenizer would from a model directory.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::file::GgufFile;
use super::value::MetaValue;
use crate::error::Result;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split: case-insensitive contractions, digits in runs of at most three.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: as Llama 3's, but every digit alone.
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values fdpp builds, and how each splits text.
pub const PRE_TOKENIZERS: &[&str] = &[
    "default",
    "gpt-2",
    "smollm",
    "starcoder",
    "refact",
    "codeshell",
    "llama-bpe",
    "llama3",
    "smaug-bpe",
    "qwen2",
];

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(regex: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

fn gpt2_pre_tokenizer(pre: &str) -> Option<Value> {
    Some(match pre {
        // GPT-2's own split is ByteLevel's built-in regex.
        "default" | "gpt-2" => byte_level(true),
        // StarCoder-family vocabularies (SmolLM's among them) split every digit first.
        "smollm" | "starcoder" | "refact" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
        }),
        "llama-bpe" | "llama3" | "smaug-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]})
        }
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}),
        _ => return None,
    })
}

/// What a GGUF vocabulary says, read once.
struct Vocab<'a> {
    tokens: Vec<&'a str>,
    types: Vec<i64>,
}

fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(v) = file.get(key) else { return Ok(None) };
    let arr = v.as_array().ok_or_else(|| {
        file.err(format!(
            "metadata '{key}' is a {}, expected an array of strings",
            v.type_name()
        ))
    })?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_str().ok_or_else(|| {
                file.err(format!(
                    "metadata '{key}'[{i}] is a {}, expected a string",
                    x.type_name()
                ))
            })
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn number_array(file: &GgufFile, key: &str, len: usize) -> Result<Option<Vec<f64>>> {
    let Some(v) = file.get(key) else { return Ok(None) };
    let arr = v
        .as_array()
        .ok_or_else(|| file.err(format!("metadata '{key}' is a {}, expected an array", v.type_name())))?;
    if arr.len() != len {
        return Err(file.err(format!(
            "metadata '{key}' has {} entries but the vocabulary has {len} tokens",
            arr.len()
        )));
    }
    arr.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_f64().ok_or_else(|| {
                file.err(format!(
                    "metadata '{key}'[{i}] is a {}, expected a number",
                    x.type_name()
                ))
            })
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn token_id(file: &GgufFile, key: &str, n: usize) -> Result<Option<usize>> {
    match file.get(key).map(MetaValue::as_u64) {
        None => Ok(None),
        Some(Some(id)) if (id as usize) < n => Ok(Some(id as usize)),
        Some(_) => Err(file.err(format!(
            "metadata '{key}' is not a token id of the vocabulary ({n} tokens)"
        ))),
    }
}

/// The tokenizer of a GGUF file.
pub fn build(file: &GgufFile) -> Result<tokenizers::Tokenizer> {
    let model = file
        .get("tokenizer.ggml.model")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| file.err("metadata 'tokenizer.ggml.model' is missing: the file has no tokenizer"))?;
    let tokens = string_array(file, "tokenizer.ggml.tokens")?
        .ok_or_else(|| file.err("metadata 'tokenizer.ggml.tokens' is missing"))?;
    let n = tokens.len();
    let types = match number_array(file, "tokenizer.ggml.token_type", n)? {
        Some(t) => t.into_iter().map(|x| x as i64).collect(),
        None => vec![1; n],
    };
    let v = Vocab { tokens, types };

    let mut vocab = serde_json::Map::with_capacity(n);
    for (i, t) in v.tokens.iter().enumerate() {
        // A duplicated piece keeps its first id (the later one can still be decoded by id
        // through the added tokens when it is special, and is unreachable by BPE otherwise).
        vocab.entry(t.to_string()).or_insert(json!(i));
    }
    let added: Vec<Value> = (0..n)
        .filter(|&i| v.types[i] == TYPE_CONTROL || v.types[i] == TYPE_USER_DEFINED)
        .map(|i| {
            json!({
                "id": i, "content": v.tokens[i], "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": v.types[i] == TYPE_CONTROL
            })
        })
        .collect();

    let bool_meta = |key: &str| file.get(key).and_then(MetaValue::as_bool);
    let (model_json, normalizer, pre_tokenizer, decoder, default_bos) = match model {
        "gpt2" => {
            let pre = file
                .get("tokenizer.ggml.pre")
                .and_then(MetaValue::as_str)
                .unwrap_or("default");
            let pre_tokenizer = gpt2_pre_tokenizer(pre).ok_or_else(|| {
                file.err(format!(
                    "tokenizer.ggml.pre '{pre}' (how text is split before BPE) is not one fdpp \
                     builds; supported: {}",
                    PRE_TOKENIZERS.join(", ")
                ))
            })?;
            let merges = string_array(file, "tokenizer.ggml.merges")?
                .ok_or_else(|| file.err("metadata 'tokenizer.ggml.merges' is missing (a gpt2 tokenizer needs it)"))?;
            let mut pairs = Vec::with_capacity(merges.len());
            for (i, m) in merges.iter().enumerate() {
                let (a, b) = m.split_once(' ').ok_or_else(|| {
                    file.err(format!(
                        "tokenizer.ggml.merges[{i}] ({m:?}) is not two pieces separated by a space"
                    ))
                })?;
                pairs.push(json!([a, b]));
            }
            let model_json = json!({
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": false, "vocab": Value::Object(vocab), "merges": pairs
            });
            let decoder =
                json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
            (model_json, Value::Null, pre_tokenizer, decoder, false)
        }
        "llama" => {
            let scores = number_array(file, "tokenizer.ggml.scores", n)?
                .ok_or_else(|| file.err("metadata 'tokenizer.ggml.scores' is missing (a llama tokenizer needs it)"))?;
            let merges = spm_merges(&v, &scores);
            let unk = token_id(file, "tokenizer.ggml.unknown_token_id", n)?
                .or_else(|| (0..n).find(|&i| v.types[i] == TYPE_UNKNOWN))
                .map(|i| v.tokens[i].to_string());
            let model_json = json!({
                "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                "ignore_merges": false, "vocab": Value::Object(vocab), "merges": merges
            });
            let prefix = bool_meta("tokenizer.ggml.add_space_prefix").unwrap_or(true);
            let mut norm = vec![];
            if prefix {
                norm.push(json!({"type": "Prepend", "prepend": "▁"}));
            }
            norm.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
            let mut dec = vec![
                json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if prefix {
                dec.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            (
                model_json,
                json!({"type": "Sequence", "normalizers": norm}),
                Value::Null,
                json!({"type": "Sequence", "decoders": dec}),
                true,
            )
        }
        other => {
            return Err(file.err(format!(
                "tokenizer.ggml.model '{other}' is not supported (gpt2 and llama are)"
            )))
        }
    };

    // BOS/EOS added to every encoded text, as the file says (llama.cpp's defaults otherwise).
    let mut single = vec![];
    let mut specials = serde_json::Map::new();
    let mut special = |key: &str, flag: &str, default: bool| -> Result<Option<Value>> {
        if !bool_meta(flag).unwrap_or(default) {
            return Ok(None);
        }
        let Some(id) = token_id(file, key, n)? else {
            return Ok(None);
        };
        let t = v.tokens[id];
        specials.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
        Ok(Some(json!({"SpecialToken": {"id": t, "type_id": 0}})))
    };
    let bos = special(
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.add_bos_token",
        default_bos,
    )?;
    let eos = special("tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_eos_token", false)?;
    single.extend(bos.clone());
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    single.extend(eos.clone());
    let post = if specials.is_empty() {
        Value::Null
    } else {
        let mut pair = single.clone();
        pair.extend(bos);
        pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
        pair.extend(eos);
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
    };

    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": post,
        "decoder": decoder, "model": model_json
    });
    serde_json::from_value(tj).map_err(|e| file.err(format!("the GGUF vocabulary does not make a tokenizer: {e}")))
}

/// SentencePiece's merges as BPE merges: every split of a normal piece into two pieces of the
/// vocabulary, ranked by the joined piece's score (highest first; ties by id).
fn spm_merges(v: &Vocab, scores: &[f64]) -> Vec<Value> {
    let ids: HashMap<&str, usize> = v.tokens.iter().enumerate().rev().map(|(i, t)| (*t, i)).collect();
    let mut m: Vec<(f64, usize, &str, &str)> = Vec::new();
    for (i, t) in v.tokens.iter().enumerate() {
        if v.types[i] != 1 {
            continue;
        }
        for (k, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(k);
            if ids.contains_key(a) && ids.contains_key(b) {
                m.push((scores[i], i, a, b));
            }
        }
    }
    m.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    m.into_iter().map(|(_, _, a, b)| json!([a, b])).collect()
}
