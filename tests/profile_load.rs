//! Profile files: round trip, atomic writes, and clean errors for every kind of bad file.

use std::fs;
use std::path::Path;

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::BackendKind;
use fdpp::dtype::DType;
use fdpp::model::{ModelArch, ModelConfig};
use fdpp::profile::{Profile, SCHEMA_VERSION};
use fdpp::tune::{tune, SweepOpts};

fn tiny(name: &str, hidden: usize, inter: usize) -> ModelConfig {
    ModelConfig {
        name: name.into(),
        arch: ModelArch::Llama,
        hidden_size: hidden,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: hidden / 2,
        intermediate_size: inter,
        vocab_size: 100,
        max_position_embeddings: 128,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        qkv_bias: false,
        gated_ffn: true,
    }
}

fn made_profile(cfg: &ModelConfig) -> Profile {
    let mut o = SweepOpts::for_backend(BackendKind::Cpu, DType::F16, Some(3), Some(1)).unwrap();
    o.timing.warmup = 0;
    tune(&CpuBackend::new(), cfg, &o, &mut |_| {}).unwrap()
}

fn others_in(dir: &Path, keep: &str) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n != keep)
        .collect()
}

#[test]
fn round_trip_and_no_temp_files_left() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/p.json");
    let p = made_profile(&tiny("t", 64, 96));
    assert_eq!(p.schema_version, SCHEMA_VERSION);
    assert_eq!(p.shapes.len(), 4);
    p.save(&path).unwrap();
    assert_eq!(Profile::load(&path).unwrap(), p);
    // Overwrite: the new content replaces the old, and no temp file remains.
    let mut p2 = p.clone();
    p2.provenance.created = "2000-01-01T00:00:00Z".into();
    p2.save(&path).unwrap();
    assert_eq!(Profile::load(&path).unwrap().provenance.created, "2000-01-01T00:00:00Z");
    assert!(others_in(path.parent().unwrap(), "p.json").is_empty());
}

#[test]
fn missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.json");
    let e = Profile::load(&path).unwrap_err().to_string();
    assert!(
        e.contains("nope.json") && e.contains("no such file") && e.contains("fdpp tune"),
        "{e}"
    );
}

#[test]
fn truncated_profile_names_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.json");
    let json = made_profile(&tiny("t", 64, 96)).to_json().unwrap();
    fs::write(&path, &json[..json.len() / 2]).unwrap();
    let e = Profile::load(&path).unwrap_err().to_string();
    assert!(e.contains("cut.json") && e.contains("truncated"), "{e}");
    assert!(e.contains("line ") && e.contains("column "), "{e}");
}

#[test]
fn malformed_profile() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.json");
    fs::write(&path, "{\n \"schema_version\": 1\n \"x\": 2}").unwrap();
    let e = Profile::load(&path).unwrap_err().to_string();
    assert!(
        e.contains("bad.json") && e.contains("malformed") && e.contains("line 3"),
        "{e}"
    );
}

#[test]
fn other_schema_versions() {
    let dir = tempfile::tempdir().unwrap();
    let json = made_profile(&tiny("t", 64, 96)).to_json().unwrap();
    let needle = format!("\"schema_version\": {SCHEMA_VERSION}");
    assert!(json.contains(&needle));
    for (v, word) in [(SCHEMA_VERSION + 1, "newer"), (0, "older")] {
        let path = dir.path().join(format!("v{v}.json"));
        fs::write(&path, json.replace(&needle, &format!("\"schema_version\": {v}"))).unwrap();
        let e = Profile::load(&path).unwrap_err().to_string();
        assert!(
            e.contains(&format!("v{v}.json")) && e.contains(word) && e.contains("fdpp tune"),
            "{e}"
        );
    }
}

#[test]
fn profile_for_another_model_is_refused() {
    let p = made_profile(&tiny("small", 64, 96));
    p.check_model(&tiny("small", 64, 96)).unwrap();
    // Same shapes under another name: the same GEMMs, accepted.
    p.check_model(&tiny("small-copy", 64, 96)).unwrap();
    let e = p.check_model(&tiny("wider", 64, 128)).unwrap_err().to_string();
    assert!(e.contains("small") && e.contains("wider") && e.contains("ffn1"), "{e}");
    assert!(!e.contains("qkv is"), "qkv is the same in both: {e}");
    assert!(e.contains("fdpp tune --model wider"), "{e}");
}

#[test]
fn save_under_a_regular_file_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain");
    fs::write(&file, "x").unwrap();
    let path = file.join("p.json");
    let e = made_profile(&tiny("t", 64, 96)).save(&path).unwrap_err().to_string();
    assert!(e.contains("plain"), "{e}");
    assert_eq!(fs::read_to_string(&file).unwrap(), "x");
    assert!(others_in(dir.path(), "plain").is_empty());
}

#[test]
fn failed_save_keeps_the_previous_profile() {
    // The target is a directory: the rename fails after the temp file was written.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("p.json");
    fs::create_dir(&target).unwrap();
    fs::write(target.join("inside"), "keep").unwrap();
    assert!(made_profile(&tiny("t", 64, 96)).save(&target).is_err());
    assert_eq!(fs::read_to_string(target.join("inside")).unwrap(), "keep");
    assert!(others_in(dir.path(), "p.json").is_empty(), "temp file left behind");
}

#[test]
fn every_candidate_timing_is_kept() {
    let p = made_profile(&tiny("t", 64, 96));
    for sp in &p.shapes {
        assert_eq!(sp.m_grid, vec![1, 2, 3]);
        assert_eq!(sp.best.len(), 3);
        for c in &sp.candidates {
            assert_eq!(c.results.len(), 3, "{}", c.uri);
            assert!(c.results.iter().all(|r| r.median_us().is_some()), "{}", c.uri);
        }
    }
    assert!(p.timing.rule.contains("0.02"));
    assert!(p.softmax.is_none());
    assert_eq!(
        p.provenance.kernel_hash,
        fdpp::backend::Backend::kernel_hash(&CpuBackend::new())
    );
}
