//! Loading HF safetensors weights: a whole tiny Llama with GQA, a sharded checkpoint with its
//! index, f32 converted at load, and every bad input of issue #5 that concerns files (missing
//! tensor, wrong shape, truncated file, no weights) as a clean error naming the file and tensor.

use std::collections::HashMap;
use std::path::Path;

use fdpp::dtype::{random_bits, DType};
use fdpp::error::FdppError;
use fdpp::model::weights::{check_checkpoint, checkpoint_tensors, WeightStore};
use fdpp::model::{ModelArch, ModelConfig};
use safetensors::tensor::{Dtype, TensorView};

fn tiny(qkv_bias: bool, tied: bool) -> ModelConfig {
    ModelConfig {
        name: "tiny".into(),
        arch: ModelArch::Llama,
        hidden_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        intermediate_size: 96,
        vocab_size: 101,
        max_position_embeddings: 128,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        qkv_bias,
        gated_ffn: true,
    }
}

/// Raw little-endian bytes of random tensors for `names`, in `dtype` (F16, BF16 or F32).
fn tensors(names: &[(String, Vec<usize>)], dtype: Dtype, seed: u64) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    names
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let len: usize = s.iter().product();
            let bytes = match dtype {
                Dtype::F32 => random_bits(DType::F16, len, 1.0, seed + i as u64)
                    .iter()
                    .flat_map(|b| DType::F16.to_f32(*b).to_le_bytes())
                    .collect(),
                Dtype::BF16 => random_bits(DType::Bf16, len, 1.0, seed + i as u64)
                    .iter()
                    .flat_map(|b| b.to_le_bytes())
                    .collect(),
                _ => random_bits(DType::F16, len, 1.0, seed + i as u64)
                    .iter()
                    .flat_map(|b| b.to_le_bytes())
                    .collect(),
            };
            (n.clone(), s.clone(), bytes)
        })
        .collect()
}

fn write(path: &Path, ts: &[(String, Vec<usize>, Vec<u8>)], dtype: Dtype) {
    let views: Vec<(String, TensorView<'_>)> = ts
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).expect("view")))
        .collect();
    let bytes = safetensors::tensor::serialize(views, None).expect("serialize");
    std::fs::write(path, bytes).expect("write");
}

#[test]
fn a_complete_checkpoint_loads_and_round_trips_the_bits() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(true, false);
    let ts = tensors(&checkpoint_tensors(&cfg), Dtype::F16, 1);
    write(&dir.path().join("model.safetensors"), &ts, Dtype::F16);
    let store = WeightStore::open(dir.path()).unwrap();
    check_checkpoint(&store, &cfg).unwrap();
    for (name, shape, bytes) in &ts {
        let got = store.load(name, shape, DType::F16).unwrap();
        let want: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(got, want, "{name}");
    }
    // Qwen2-style biases are part of the expected set; tied embeddings drop lm_head.
    assert!(store.contains("model.layers.1.self_attn.k_proj.bias"));
    assert!(!checkpoint_tensors(&tiny(false, true))
        .iter()
        .any(|(n, _)| n == "lm_head.weight"));
}

#[test]
fn f32_and_bf16_files_are_converted_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let names = [("a".to_string(), vec![3, 5]), ("b".to_string(), vec![7])];
    let f32s = tensors(&names[..1], Dtype::F32, 7);
    let bf16s = tensors(&names[1..], Dtype::BF16, 8);
    write(&dir.path().join("a.safetensors"), &f32s, Dtype::F32);
    write(&dir.path().join("b.safetensors"), &bf16s, Dtype::BF16);
    let store = WeightStore::open(dir.path()).unwrap();
    let a = store.load("a", &[3, 5], DType::F16).unwrap();
    for (got, c) in a.iter().zip(f32s[0].2.chunks_exact(4)) {
        let want = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        assert_eq!(
            DType::F16.to_f32(*got),
            want,
            "f16-representable values survive exactly"
        );
    }
    let b = store.load("b", &[7], DType::F16).unwrap();
    for (got, c) in b.iter().zip(bf16s[0].2.chunks_exact(2)) {
        let want = DType::Bf16.to_f32(u16::from_le_bytes([c[0], c[1]]));
        let g = DType::F16.to_f32(*got);
        assert!((g - want).abs() <= want.abs() * 1e-3 + 1e-6, "{g} vs {want}");
    }
}

#[test]
fn a_sharded_checkpoint_is_read_through_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false, true);
    let all = checkpoint_tensors(&cfg);
    let (first, second) = all.split_at(all.len() / 2);
    let (t1, t2) = (tensors(first, Dtype::BF16, 3), tensors(second, Dtype::BF16, 4));
    write(&dir.path().join("model-00001-of-00002.safetensors"), &t1, Dtype::BF16);
    write(&dir.path().join("model-00002-of-00002.safetensors"), &t2, Dtype::BF16);
    let mut map = HashMap::new();
    for (n, _, _) in &t1 {
        map.insert(n.clone(), "model-00001-of-00002.safetensors");
    }
    for (n, _, _) in &t2 {
        map.insert(n.clone(), "model-00002-of-00002.safetensors");
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let store = WeightStore::open(dir.path()).unwrap();
    check_checkpoint(&store, &cfg).unwrap();
    assert_eq!(store.names().len(), all.len());
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false, false);
    let mut names = checkpoint_tensors(&cfg);
    names.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight");
    write(
        &dir.path().join("model.safetensors"),
        &tensors(&names, Dtype::F16, 5),
        Dtype::F16,
    );
    let store = WeightStore::open(dir.path()).unwrap();
    let e = check_checkpoint(&store, &cfg).unwrap_err().to_string();
    assert!(e.contains("missing tensor 'model.layers.1.mlp.up_proj.weight'"), "{e}");
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn a_tensor_of_the_wrong_shape_says_expected_and_found() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false, false);
    let mut names = checkpoint_tensors(&cfg);
    for (n, s) in names.iter_mut() {
        if n == "model.layers.0.self_attn.k_proj.weight" {
            *s = vec![64, 64]; // as if kv heads were 4, not 2
        }
    }
    write(
        &dir.path().join("model.safetensors"),
        &tensors(&names, Dtype::F16, 6),
        Dtype::F16,
    );
    let store = WeightStore::open(dir.path()).unwrap();
    match check_checkpoint(&store, &cfg) {
        Err(FdppError::Shape { what, expected, found }) => {
            assert!(what.contains("model.layers.0.self_attn.k_proj.weight"), "{what}");
            assert_eq!((expected.as_str(), found.as_str()), ("[32, 64]", "[64, 64]"));
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    let e = store
        .load("model.layers.0.self_attn.k_proj.weight", &[32, 64], DType::F16)
        .unwrap_err();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
}

#[test]
fn a_truncated_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny(false, false);
    let path = dir.path().join("model.safetensors");
    write(&path, &tensors(&checkpoint_tensors(&cfg), Dtype::F16, 9), Dtype::F16);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = WeightStore::open(dir.path())
        .err()
        .expect("truncated file refused")
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors file"),
        "{e}"
    );
    // A header cut in the middle, too.
    std::fs::write(&path, &bytes[..20]).unwrap();
    assert!(WeightStore::open(dir.path()).is_err());
}

#[test]
fn a_directory_without_weights_or_with_a_broken_index_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = WeightStore::open(dir.path()).err().expect("no weights").to_string();
    assert!(e.contains("no *.safetensors file"), "{e}");
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"weight_map\": {\"a\": \"gone.safetensors\"}}",
    )
    .unwrap();
    let e = WeightStore::open(dir.path()).err().expect("dangling shard").to_string();
    assert!(e.contains("gone.safetensors") && e.contains("does not exist"), "{e}");
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{\"weight_map\": ").unwrap();
    let e = WeightStore::open(dir.path()).err().expect("bad json").to_string();
    assert!(e.contains("malformed JSON"), "{e}");
}
