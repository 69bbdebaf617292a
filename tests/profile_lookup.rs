//! Profiles are found by the shapes a model needs (profile::lookup): another model's profile of
//! the same four shapes serves it, a partial match says which shapes fall back, the softmax
//! window comes only from the model's own profile, and a profile of other kernels is refused.

use std::path::Path;

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::{Backend, BackendKind};
use fdpp::dtype::DType;
use fdpp::model::{ModelArch, ModelConfig};
use fdpp::profile::lookup::find;
use fdpp::profile::{Profile, SoftmaxSection};
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

fn made(cfg: &ModelConfig, softmax: Option<f64>) -> Profile {
    let mut o = SweepOpts::for_backend(BackendKind::Cpu, DType::F16, Some(2), Some(1)).unwrap();
    o.timing.warmup = 0;
    let mut p = tune(&CpuBackend::new(), cfg, &o, &mut |_| {}).unwrap();
    p.softmax = softmax.map(|phi| SoftmaxSection::window(phi, phi - 10.0, phi + 10.0, Some(0.999)));
    p
}

fn save(dir: &Path, file: &str, p: &Profile) {
    p.save(&dir.join(file)).unwrap();
}

fn lookup(dir: &Path, cfg: &ModelConfig) -> Result<fdpp::profile::lookup::Found, String> {
    let b = CpuBackend::new();
    find(dir, cfg, DType::F16, b.info(), &b.kernel_hash())
}

#[test]
fn another_models_profile_of_the_same_shapes_serves_without_its_softmax() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), "base.json", &made(&tiny("base", 64, 96), Some(1.5)));
    let f = lookup(dir.path(), &tiny("base-instruct", 64, 96)).unwrap();
    assert!(f.path.ends_with("base.json"));
    assert!(!f.own);
    assert_eq!(f.coverage.covered.len(), 4);
    assert!(f.coverage.missing.is_empty());
    assert!(
        f.profile.softmax.is_none(),
        "the window belongs to the other model's weights"
    );
    let notes = f.notes.join("\n");
    assert!(notes.starts_with("profile: "), "{notes}");
    assert!(notes.contains("found by shape") && notes.contains("'base'"), "{notes}");
    assert!(notes.contains("not used"), "{notes}");
    // The model's own profile keeps its softmax.
    let own = lookup(dir.path(), &tiny("base", 64, 96)).unwrap();
    assert!(own.own && own.profile.softmax.is_some());
}

#[test]
fn gemm_entries_by_shape_and_the_softmax_from_the_models_own_profile() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny("mine", 64, 96);
    save(dir.path(), "other.json", &made(&tiny("other", 64, 96), Some(-3.0)));
    // The model's own profile holds a calibration only (no sweep), as `tune --calibrate` makes.
    let mut own = Profile::without_gemm(&CpuBackend::new(), &cfg, DType::F16);
    own.softmax = Some(SoftmaxSection::window(2.0, -8.0, 12.0, Some(0.999)));
    save(dir.path(), "mine.json", &own);
    let f = lookup(dir.path(), &cfg).unwrap();
    assert!(f.path.ends_with("other.json"), "the sweep covers all four shapes");
    assert_eq!(f.profile.softmax.as_ref().map(|s| s.phi), Some(2.0));
    assert!(f.softmax_from.as_ref().is_some_and(|p| p.ends_with("mine.json")));
}

#[test]
fn a_partial_match_names_the_shapes_that_fall_back_and_no_match_is_none() {
    let dir = tempfile::tempdir().unwrap();
    // Same hidden size, other intermediate size: QKV and O match, FFN1 and FFN2 do not.
    save(dir.path(), "narrow.json", &made(&tiny("narrow", 64, 96), None));
    let f = lookup(dir.path(), &tiny("wide", 64, 128)).unwrap();
    assert_eq!(f.coverage.covered.len(), 2);
    let notes = f.notes.join("\n");
    assert!(
        notes.contains("ffn1[K=64,N=256]") && notes.contains("ffn2[K=128,N=64]"),
        "{notes}"
    );
    assert!(notes.contains("they follow the built-in rule for the CPU"), "{notes}");
    // A model none of whose shapes is measured gets no profile, and the reason lists them.
    let e = lookup(dir.path(), &tiny("other", 128, 160)).err().expect("no match");
    assert!(
        e.contains("measures any of other's shapes") && e.contains("qkv[K=128"),
        "{e}"
    );
    // The fuller match wins over the partial one.
    save(dir.path(), "wide-twin.json", &made(&tiny("wide-twin", 64, 128), None));
    let f = lookup(dir.path(), &tiny("wide", 64, 128)).unwrap();
    assert!(f.path.ends_with("wide-twin.json"), "{}", f.path.display());
}

#[test]
fn profiles_of_other_kernels_or_that_do_not_load_are_skipped_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = made(&tiny("old", 64, 96), None);
    p.provenance.kernel_hash = "cpu-0000000000000000".into();
    save(dir.path(), "old.json", &p);
    std::fs::write(dir.path().join("broken.json"), "{\"schema_version\": 1").unwrap();
    let e = lookup(dir.path(), &tiny("new", 64, 96)).err().expect("nothing usable");
    assert!(e.contains("old.json") && e.contains("kernel_hash"), "{e}");
    assert!(e.contains("broken.json") && e.contains("truncated"), "{e}");
    assert!(lookup(&dir.path().join("absent"), &tiny("new", 64, 96)).is_err());
}
