//! A small GGUF writer for the tests (the format as the GGUF spec lays it out), and a tiny
//! Llama-shaped model built with it. Shared by tests/gguf_*.rs.
#![allow(dead_code)]

use fdpp::model::gguf::MetaValue;

/// A tensor to write: name, ggml dims (fastest first), ggml type id, raw bytes.
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

pub struct Writer {
    pub version: u32,
    pub alignment: u64,
    pub kv: Vec<(String, MetaValue)>,
    pub tensors: Vec<RawTensor>,
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => b.push(*x),
        MetaValue::I8(x) => b.push(*x as u8),
        MetaValue::U16(x) => b.extend(x.to_le_bytes()),
        MetaValue::I16(x) => b.extend(x.to_le_bytes()),
        MetaValue::U32(x) => b.extend(x.to_le_bytes()),
        MetaValue::I32(x) => b.extend(x.to_le_bytes()),
        MetaValue::F32(x) => b.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => b.push(*x as u8),
        MetaValue::Str(s) => put_str(b, s),
        MetaValue::Array(items) => {
            // An empty array is written as one of u8.
            b.extend(items.first().map_or(0, type_id).to_le_bytes());
            b.extend((items.len() as u64).to_le_bytes());
            for it in items {
                put_value(b, it);
            }
        }
        MetaValue::U64(x) => b.extend(x.to_le_bytes()),
        MetaValue::I64(x) => b.extend(x.to_le_bytes()),
        MetaValue::F64(x) => b.extend(x.to_le_bytes()),
    }
}

impl Writer {
    pub fn new() -> Writer {
        Writer {
            version: 3,
            alignment: 32,
            kv: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub fn kv(&mut self, key: &str, v: MetaValue) -> &mut Self {
        self.kv.push((key.to_string(), v));
        self
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(RawTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
        });
        self
    }

    /// An f32 tensor from values.
    pub fn f32_tensor(&mut self, name: &str, dims: &[u64], vals: &[f32]) -> &mut Self {
        let data = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, 0, data)
    }

    /// The file's bytes: tensors laid out in order, each padded to the alignment.
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(self.version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut b, k);
            b.extend(type_id(v).to_le_bytes());
            put_value(&mut b, v);
        }
        let mut off = 0u64;
        for t in &self.tensors {
            put_str(&mut b, &t.name);
            b.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(t.ty.to_le_bytes());
            b.extend(off.to_le_bytes());
            off = (off + t.data.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        let pad = |b: &mut Vec<u8>, a: u64| {
            while !(b.len() as u64).is_multiple_of(a) {
                b.push(0);
            }
        };
        pad(&mut b, self.alignment);
        for t in &self.tensors {
            b.extend(&t.data);
            pad(&mut b, self.alignment);
        }
        b
    }

    pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.bytes()).expect("write the test file");
        p
    }
}

pub fn s(x: &str) -> MetaValue {
    MetaValue::Str(x.to_string())
}
pub fn strs(v: &[&str]) -> MetaValue {
    MetaValue::Array(v.iter().map(|x| s(x)).collect())
}

/// GPT-2's byte → printable-character map (bytes that print as themselves keep their
/// character; the others take code points from 256 up, in order).
pub fn byte_char(b: u8) -> char {
    let keeps = |c: u32| (0x21..=0x7e).contains(&c) || (0xa1..=0xac).contains(&c) || (0xae..=0xff).contains(&c);
    if keeps(b as u32) {
        return char::from(b);
    }
    let n = (0..b as u32).filter(|&c| !keeps(c)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// A deterministic pseudo-random f32 in [-1, 1).
pub fn rnd(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Geometry of the tiny model.
pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 16;
pub const FFN: usize = 96;
pub const LAYERS: usize = 2;

/// A byte-level BPE vocabulary: two control tokens, the 256 byte characters, and merges that
/// make " the", "he", " world".
pub fn gpt2_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into()];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
    }
    let merges: Vec<String> = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
        .iter()
        .map(|m| m.to_string())
        .collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1i32; tokens.len()];
    types[0] = 3;
    types[1] = 3;
    (tokens, merges, types)
}

/// A tiny `llama`-architecture model of F32 tensors (Q8_0 for the FFN down projection), with a
/// gpt2 vocabulary; `arch` may be "qwen2" (then Q/K/V biases are added) or anything else to
/// test the refusal. Returns the writer and the HF-layout values of every tensor written.
/// (HF name, HF shape, values in HF layout) of every tensor written.
pub type Expected = Vec<(String, Vec<usize>, Vec<f32>)>;

pub fn tiny_model(arch: &str) -> (Writer, Expected) {
    let (tokens, merges, types) = gpt2_vocab();
    let vocab = tokens.len();
    let mut w = Writer::new();
    let a = |k: &str| format!("{arch}.{k}");
    w.kv("general.architecture", s(arch))
        .kv("general.name", s("tiny"))
        .kv(&a("block_count"), MetaValue::U32(LAYERS as u32))
        .kv(&a("context_length"), MetaValue::U32(256))
        .kv(&a("embedding_length"), MetaValue::U32(HIDDEN as u32))
        .kv(&a("feed_forward_length"), MetaValue::U32(FFN as u32))
        .kv(&a("attention.head_count"), MetaValue::U32(HEADS as u32))
        .kv(&a("attention.head_count_kv"), MetaValue::U32(KV_HEADS as u32))
        .kv(&a("rope.freq_base"), MetaValue::F32(50000.0))
        .kv(&a("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5))
        .kv(&a("rope.dimension_count"), MetaValue::U32(HEAD_DIM as u32))
        .kv("tokenizer.ggml.model", s("gpt2"))
        .kv("tokenizer.ggml.pre", s("smollm"))
        .kv(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.iter().map(|t| s(t)).collect()),
        )
        .kv(
            "tokenizer.ggml.token_type",
            MetaValue::Array(types.iter().map(|&t| MetaValue::I32(t)).collect()),
        )
        .kv(
            "tokenizer.ggml.merges",
            MetaValue::Array(merges.iter().map(|t| s(t)).collect()),
        )
        .kv("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .kv("tokenizer.ggml.eos_token_id", MetaValue::U32(0))
        .kv("tokenizer.chat_template", s("{{ messages }}"));
    let mut seed = 7u64;
    let mut out = Vec::new();
    let mut add = |w: &mut Writer, gguf: &str, hf: &str, hf_shape: Vec<usize>, file_rows: Option<usize>| {
        let n: usize = hf_shape.iter().product();
        let hf_vals: Vec<f32> = (0..n).map(|_| rnd(&mut seed)).collect();
        // The file holds Q/K rows interleaved per head, as llama.cpp's converter writes them.
        let file_vals = match file_rows {
            Some(heads) if arch == "llama" => {
                let (rows, cols) = (hf_shape[0], n / hf_shape[0]);
                let d = rows / heads;
                let mut v = vec![0f32; n];
                for h in 0..heads {
                    for s in 0..2 {
                        for i in 0..d / 2 {
                            let (dst, src) = (h * d + 2 * i + s, h * d + s * d / 2 + i);
                            v[dst * cols..(dst + 1) * cols].copy_from_slice(&hf_vals[src * cols..(src + 1) * cols]);
                        }
                    }
                }
                v
            }
            _ => hf_vals.clone(),
        };
        let dims: Vec<u64> = hf_shape.iter().rev().map(|&d| d as u64).collect();
        w.f32_tensor(gguf, &dims, &file_vals);
        out.push((hf.to_string(), hf_shape, hf_vals));
    };
    add(
        &mut w,
        "token_embd.weight",
        "model.embed_tokens.weight",
        vec![vocab, HIDDEN],
        None,
    );
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let g = |x: &str| format!("blk.{l}.{x}");
        add(
            &mut w,
            &g("attn_norm.weight"),
            &format!("{p}.input_layernorm.weight"),
            vec![HIDDEN],
            None,
        );
        add(
            &mut w,
            &g("attn_q.weight"),
            &format!("{p}.self_attn.q_proj.weight"),
            vec![HEADS * HEAD_DIM, HIDDEN],
            Some(HEADS),
        );
        add(
            &mut w,
            &g("attn_k.weight"),
            &format!("{p}.self_attn.k_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            Some(KV_HEADS),
        );
        add(
            &mut w,
            &g("attn_v.weight"),
            &format!("{p}.self_attn.v_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            None,
        );
        if arch == "qwen2" {
            add(
                &mut w,
                &g("attn_q.bias"),
                &format!("{p}.self_attn.q_proj.bias"),
                vec![HEADS * HEAD_DIM],
                None,
            );
            add(
                &mut w,
                &g("attn_k.bias"),
                &format!("{p}.self_attn.k_proj.bias"),
                vec![KV_HEADS * HEAD_DIM],
                None,
            );
            add(
                &mut w,
                &g("attn_v.bias"),
                &format!("{p}.self_attn.v_proj.bias"),
                vec![KV_HEADS * HEAD_DIM],
                None,
            );
        }
        add(
            &mut w,
            &g("attn_output.weight"),
            &format!("{p}.self_attn.o_proj.weight"),
            vec![HIDDEN, HEADS * HEAD_DIM],
            None,
        );
        add(
            &mut w,
            &g("ffn_norm.weight"),
            &format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            None,
        );
        add(
            &mut w,
            &g("ffn_gate.weight"),
            &format!("{p}.mlp.gate_proj.weight"),
            vec![FFN, HIDDEN],
            None,
        );
        add(
            &mut w,
            &g("ffn_up.weight"),
            &format!("{p}.mlp.up_proj.weight"),
            vec![FFN, HIDDEN],
            None,
        );
        add(
            &mut w,
            &g("ffn_down.weight"),
            &format!("{p}.mlp.down_proj.weight"),
            vec![HIDDEN, FFN],
            None,
        );
    }
    add(&mut w, "output_norm.weight", "model.norm.weight", vec![HIDDEN], None);
    (w, out)
}
