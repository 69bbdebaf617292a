//! A candidate that computes wrong results cannot win, however fast it is; one that does not
//! support some M is skipped there; a tune that fails midway writes nothing.

use std::cell::Cell;
use std::fs;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use fdpp::backend::cpu::hooked::HookedCpu;
use fdpp::backend::{Backend, BackendChoice};
use fdpp::cli::tune::{run_with_backend, TuneArgs};
use fdpp::cli::Format;
use fdpp::dtype::DType;
use fdpp::error::FdppError;
use fdpp::model::{LinearKind, LinearShape, ModelArch, ModelConfig, ModelShapes};
use fdpp::ops::gemm::GemmImpl;
use fdpp::profile::{Measurement, Profile};
use fdpp::select::select;
use fdpp::tune::SweepOpts;

#[derive(Clone, Copy)]
enum Fault {
    /// flat_gemm skips the work and writes a constant: wrong, and faster than anything.
    FlatGemmGarbage,
    /// flat_gemm is right except for the last output column.
    FlatGemmLastColumn,
    /// gemv does not support M > 2.
    GemvUpTo2,
    /// An upload of this many elements fails (a device out of memory midway through a tune).
    UploadFailsForLen(usize),
}

/// The CPU backend with one fault; `uploads` counts the uploads it saw.
struct Faulty {
    b: HookedCpu,
    uploads: Rc<Cell<usize>>,
}

impl Faulty {
    fn new(fault: Fault) -> Self {
        let uploads = Rc::new(Cell::new(0));
        let seen = uploads.clone();
        let b = HookedCpu::new(move |inner, spec, d, x, w, y| match (fault, spec.imp) {
            (Fault::FlatGemmGarbage, GemmImpl::FlatGemm) => {
                y.data[..d.m * d.n].fill(spec.dtype.from_f32(0.25));
                Ok(())
            }
            (Fault::FlatGemmLastColumn, GemmImpl::FlatGemm) => {
                inner.gemm(spec, d, x, w, y)?;
                for r in 0..d.m {
                    y.data[r * d.n + d.n - 1] = spec.dtype.from_f32(7.0);
                }
                Ok(())
            }
            (Fault::GemvUpTo2, GemmImpl::Gemv) if d.m > 2 => Err(FdppError::Unsupported {
                spec: spec.uri(),
                what: format!("M={} (at most 2)", d.m),
            }),
            _ => inner.gemm(spec, d, x, w, y),
        })
        .with_upload_hook(move |_, bits| {
            seen.set(seen.get() + 1);
            match fault {
                Fault::UploadFailsForLen(len) if bits.len() == len => {
                    Err(FdppError::device("cpu", "out of memory (injected)"))
                }
                _ => Ok(()),
            }
        });
        Faulty { b, uploads }
    }
}

fn tiny() -> ModelConfig {
    ModelConfig {
        name: "tiny-reject".into(),
        arch: ModelArch::Llama,
        hidden_size: 64,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 32,
        intermediate_size: 96,
        vocab_size: 100,
        max_position_embeddings: 128,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        qkv_bias: false,
        gated_ffn: true,
    }
}

fn args(dir: &Path, m_max: usize) -> TuneArgs {
    TuneArgs {
        model: "tiny-reject".into(),
        backend: BackendChoice::Cpu,
        device: 0,
        dtype: DType::F16,
        m_max: Some(m_max),
        reps: Some(1),
        out: Some(dir.join("profile.json")),
        report_dir: Some(dir.join("report")),
        format: Format::Csv,
        tp: 1,
        calibrate: Default::default(),
        decode_pass: false,
    }
}

fn all_plans_avoid(p: &Profile, imp: GemmImpl, ms: impl Iterator<Item = usize> + Clone) {
    for shape in &ModelShapes::of(&tiny()).linears {
        for m in ms.clone() {
            let plan = select(shape, m, Some(p));
            assert_ne!(plan.imp, imp, "{} M={m}: {}", shape.label(), plan.reason);
        }
    }
}

#[test]
fn wrong_fast_candidate_is_rejected_and_never_selected() {
    let dir = tempfile::tempdir().unwrap();
    let a = args(dir.path(), 20);
    let out = run_with_backend(&Faulty::new(Fault::FlatGemmGarbage).b, &a, &tiny()).unwrap();
    // What is on disk is what select reads.
    let p = Profile::load(a.out.as_ref().unwrap()).unwrap();
    assert_eq!(p, out.profile);
    for sp in &p.shapes {
        let flat: Vec<_> = sp.candidates.iter().filter(|c| c.imp == GemmImpl::FlatGemm).collect();
        assert!(!flat.is_empty());
        for c in flat {
            assert_eq!(c.results.len(), sp.m_grid.len());
            for r in &c.results {
                match r {
                    Measurement::Rejected { reason, .. } => {
                        assert!(reason.contains("NMSE") && reason.contains(&c.uri), "{reason}")
                    }
                    other => panic!("{}: {other:?} should be rejected", sp.label()),
                }
            }
        }
        assert!(sp.best.iter().all(|b| b.flat_gemm.is_none()));
        assert_eq!(sp.m1, None, "{}", sp.label());
        // The correct candidates were still measured.
        assert!(sp.times(GemmImpl::Gemv).iter().all(|t| t.is_some()));
        assert!(sp.times(GemmImpl::Gemm).iter().all(|t| t.is_some()));
    }
    all_plans_avoid(&p, GemmImpl::FlatGemm, 0..=100);
    all_plans_avoid(&p, GemmImpl::FlatGemm, [1000, 1 << 20].into_iter());
    // No report row for a rejected candidate, and the summary says why it is missing.
    assert!(!out.table.contains("flat_gemm"), "{}", out.table);
    assert!(out.table.contains("gemv_f16") && out.table.contains("gemm_f16"));
    let csv = fs::read_to_string(&out.report.csv).unwrap();
    assert!(!csv.contains("flat_gemm") && csv.contains("gemv_f16"));
    assert!(out
        .summary
        .iter()
        .any(|l| l.contains("flat_gemm_f16") && l.contains("rejected at 17 of 17 M")));
    // `profile show` marks it.
    let shown = fdpp::cli::profile::render(&p, Format::Md).unwrap();
    assert!(shown.contains("| rejected |"), "{shown}");
}

#[test]
fn a_wrong_last_column_alone_is_caught() {
    let b = Faulty::new(Fault::FlatGemmLastColumn).b;
    let shape = LinearShape {
        kind: LinearKind::Ffn1,
        k: 40,
        n: 1000,
    };
    let mut o = SweepOpts::for_backend(b.info().backend, DType::F16, Some(4), Some(1)).unwrap();
    o.timing.warmup = 0;
    let sp = fdpp::tune::sweep_shape(&b, &shape, &o, &mut |_| {}).unwrap();
    let flat = sp.candidates.iter().find(|c| c.imp == GemmImpl::FlatGemm).unwrap();
    assert!(flat.results.iter().all(|r| matches!(r, Measurement::Rejected { .. })));
    let gemv = sp.candidates.iter().find(|c| c.imp == GemmImpl::Gemv).unwrap();
    assert!(gemv.results.iter().all(|r| matches!(r, Measurement::Ok { .. })));
}

#[test]
fn unsupported_m_is_skipped_not_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let a = args(dir.path(), 5);
    let out = run_with_backend(&Faulty::new(Fault::GemvUpTo2).b, &a, &tiny()).unwrap();
    let p = out.profile;
    for sp in &p.shapes {
        let gemv = sp.candidates.iter().find(|c| c.imp == GemmImpl::Gemv).unwrap();
        for r in &gemv.results {
            match (r.m(), r) {
                (1 | 2, Measurement::Ok { .. }) => {}
                (_, Measurement::Skipped { reason, .. }) if r.m() > 2 => {
                    assert!(reason.contains("at most 2"), "{reason}")
                }
                (m, other) => panic!("M={m}: {other:?}"),
            }
        }
        assert_eq!(sp.times(GemmImpl::Gemv)[2..], [None, None, None]);
    }
    all_plans_avoid(&p, GemmImpl::Gemv, 3..=64);
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

#[test]
fn failed_tune_leaves_the_previous_profile_intact() {
    let dir = tempfile::tempdir().unwrap();
    let a = args(dir.path(), 3);
    let path = a.out.clone().unwrap();
    fs::write(&path, "previous profile\n").unwrap();
    // Fails while preparing the third shape (ffn1's weights, [N=192, K=64]), after two shapes
    // were measured.
    let b = Faulty::new(Fault::UploadFailsForLen(192 * 64));
    let e = match run_with_backend(&b.b, &a, &tiny()) {
        Ok(_) => panic!("the tune should fail"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("injected") && e.contains("ffn1"), "{e}");
    assert!(
        b.uploads.get() >= 4,
        "the first shapes were measured before the failure"
    );
    assert_eq!(fs::read_to_string(&path).unwrap(), "previous profile\n");
    // No report from a failed tune, not even the (empty) report directory it made.
    assert_eq!(files_in(dir.path()), vec![path.clone()]);
}
