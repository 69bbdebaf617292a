//! The gemv layout at decode M is chosen by the fused op the engine runs with it, while the
//! choice between implementations (M1/M2) stays on the plain times.
//!
//! A CPU backend that claims fused gemv ops and reports synthetic times (a clock per op and
//! layout, so the sweep is deterministic) stands in for CUDA: plain, gemv bn16 is the fastest
//! layout; fused, bn8 is (the H200's case: the plain-fastest layout made the fused decode
//! slower).

use std::cell::{Cell, RefCell};

use fdpp::backend::cpu::{CpuBackend, CpuBuffer};
use fdpp::backend::{Backend, BackendKind, DeviceInfo};
use fdpp::dtype::DType;
use fdpp::error::{FdppError, Result};
use fdpp::model::{LinearKind, LinearShape, ModelArch, ModelConfig, ModelShapes};
use fdpp::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use fdpp::profile::{best_plain, DecodePassSection, FusedMeasurement, FusedOp, Profile, ShapeProfile};
use fdpp::select::select_in;
use fdpp::tune::fused::FUSED_MAX_M;
use fdpp::tune::inflection_points;
use fdpp::tune::sweep::{count_work, tune, SweepOpts};

/// hidden 64, 2 heads of 32, 1 KV head: QKV [K=64, N=128], O [64, 64], FFN1 [64, 192],
/// FFN2 [96, 64]; every K is a multiple of 8.
fn tiny() -> ModelConfig {
    ModelConfig {
        name: "tiny-fused".into(),
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

/// A fused call the backend saw: op, block_n, (M, N, K).
type Call = (FusedOp, Option<u32>, usize, usize, usize);

/// The CPU backend (real products, so verification passes) with a synthetic clock: each op sets
/// the time its run takes, and `time_each` reports it.
struct SynthClock {
    inner: CpuBackend,
    fused_ops: bool,
    /// Milliseconds of the last op run.
    last_ms: Cell<f64>,
    fused_calls: RefCell<Vec<Call>>,
    /// The fused runs of this (block_n, M) take 3x while `spike_runs` lasts.
    spike: Option<(u32, usize)>,
    spike_runs: Cell<usize>,
}

impl SynthClock {
    fn new(fused_ops: bool) -> Self {
        SynthClock {
            inner: CpuBackend::new(),
            fused_ops,
            last_ms: Cell::new(0.0),
            fused_calls: RefCell::new(Vec::new()),
            spike: None,
            spike_runs: Cell::new(0),
        }
    }
}

/// Plain times (µs) in every shape: gemv bn16 < bn1 < bn8, flat_gemm beats the fastest gemv
/// (by more than the 2 % margin) from M = 5 on, cuBLAS never wins. Had M1 been chosen on bn8's
/// plain time (the layout fused picks), flat_gemm would win from M = 4.
fn plain_us(spec: &GemmSpec, m: usize) -> f64 {
    let m = m as f64;
    match (spec.imp, spec.block_n) {
        (GemmImpl::Gemv, Some(16)) => 10.0 + 2.0 * m,
        (GemmImpl::Gemv, Some(1)) => 11.0 + 2.0 * m,
        (GemmImpl::Gemv, _) => 12.0 + 2.0 * m,
        (GemmImpl::FlatGemm, _) => 17.0 + 0.5 * m,
        (GemmImpl::Gemm, _) => 60.0,
    }
}

/// Fused times (µs): bn8 < bn1 < bn16, all slower than flat_gemm's plain time (so fused times
/// used for M1 would give M1 = 1).
fn fused_us(spec: &GemmSpec, m: usize) -> f64 {
    let m = m as f64;
    match spec.block_n {
        Some(16) => 30.0 + 2.0 * m,
        Some(1) => 29.0 + 2.0 * m,
        _ => 28.0 + 2.0 * m,
    }
}

impl SynthClock {
    fn fused_call(&self, op: FusedOp, spec: &GemmSpec, d: GemmDims, ins: usize, out: usize) -> Result<()> {
        // The sweep must hand the fused ops buffers of the sizes they read ([M, K]) and write
        // ([M, N]).
        if ins < d.m * d.k || out < d.m * d.n {
            return Err(FdppError::InvalidArgument(format!("{op}: buffers too small")));
        }
        self.fused_calls.borrow_mut().push((op, spec.block_n, d.m, d.n, d.k));
        let mut t = fused_us(spec, d.m);
        if self.spike == spec.block_n.map(|bn| (bn, d.m)) && self.spike_runs.get() > 0 {
            self.spike_runs.set(self.spike_runs.get() - 1);
            t *= 3.0;
        }
        self.last_ms.set(t / 1e3);
        Ok(())
    }
}

impl Backend for SynthClock {
    type Buffer = CpuBuffer;
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn kernel_hash(&self) -> String {
        self.inner.kernel_hash()
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        self.inner.alloc(dtype, len)
    }
    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<CpuBuffer> {
        self.inner.upload(dtype, bits)
    }
    fn download(&self, buf: &CpuBuffer) -> Result<Vec<u16>> {
        self.inner.download(buf)
    }
    fn fill(&self, buf: &mut CpuBuffer, bits: u16) -> Result<()> {
        self.inner.fill(buf, bits)
    }
    fn gemm_candidates(&self, dtype: DType, _n: usize, _k: usize) -> Vec<GemmSpec> {
        let gemv = GemmSpec::new(GemmImpl::Gemv, dtype);
        vec![
            gemv.with_block_n(1),
            gemv.with_block_n(8),
            gemv.with_block_n(16),
            GemmSpec::new(GemmImpl::FlatGemm, dtype).with_block_n(64),
            GemmSpec::new(GemmImpl::Gemm, dtype),
        ]
    }
    fn prepare_linear_weight(&self, w: &mut CpuBuffer, n: usize, k: usize) -> Result<()> {
        self.inner.prepare_linear_weight(w, n, k)
    }
    fn gemm(&self, spec: &GemmSpec, d: GemmDims, x: &CpuBuffer, w: &CpuBuffer, y: &mut CpuBuffer) -> Result<()> {
        self.last_ms.set(plain_us(spec, d.m) / 1e3);
        self.inner.gemm(spec, d, x, w, y)
    }
    fn fused_gemv_ops(&self) -> bool {
        self.fused_ops
    }
    fn gemm_rms_in(
        &self,
        spec: &GemmSpec,
        d: GemmDims,
        eps: f32,
        residual: &CpuBuffer,
        _w: &CpuBuffer,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        assert!(eps > 0.0);
        self.fused_call(FusedOp::GemmRmsIn, spec, d, residual.data.len(), y.data.len())
    }
    fn gemm_residual_out(
        &self,
        spec: &GemmSpec,
        d: GemmDims,
        x: &CpuBuffer,
        _w: &CpuBuffer,
        residual: &mut CpuBuffer,
    ) -> Result<()> {
        self.fused_call(FusedOp::GemmResidualOut, spec, d, x.data.len(), residual.data.len())
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn copy_gbps(&self) -> Result<f64> {
        self.inner.copy_gbps()
    }
    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        (0..reps)
            .map(|i| {
                f(i)?;
                Ok(self.last_ms.get())
            })
            .collect()
    }
}

fn opts(m_max: usize) -> SweepOpts {
    let mut o = SweepOpts::for_backend(BackendKind::Cpu, DType::F16, Some(m_max), Some(3)).unwrap();
    o.timing.warmup = 1;
    o
}

fn gemv_bn(sp: &ShapeProfile, m: usize) -> Option<u32> {
    sp.best_at(m).and_then(|b| b.gemv.as_ref()).and_then(|g| g.block_n)
}

#[test]
fn the_gemv_layout_at_decode_m_is_the_fastest_fused_and_m1_m2_stay_on_plain_times() {
    let (fused_on, fused_off) = (SynthClock::new(true), SynthClock::new(false));
    let o = opts(12);
    let mut work = 0u64;
    let p = tune(&fused_on, &tiny(), &o, &mut |s| work += s.work).unwrap();
    let plain = tune(&fused_off, &tiny(), &o, &mut |_| {}).unwrap();
    let shapes = ModelShapes::of(&tiny()).linears;
    // Progress: the fused timings are counted, and the total is what the steps add up to.
    assert_eq!(work, count_work(&fused_on, &shapes, &o));
    assert!(count_work(&fused_on, &shapes, &o) > count_work(&fused_off, &shapes, &o));

    for (sp, sp_plain) in p.shapes.iter().zip(&plain.shapes) {
        let label = sp.label();
        // The choice between implementations is the plain one: flat_gemm from M = 5.
        assert_eq!((sp.m1, sp.m2), (Some(5), None), "{label}");
        assert_eq!((sp.m1, sp.m2), (sp_plain.m1, sp_plain.m2), "{label}");
        // flat_gemm and gemm configs are untouched; gemv without fused ops is the plain-fastest.
        for (b, bp) in sp.best.iter().zip(&sp_plain.best) {
            assert_eq!((&b.flat_gemm, &b.gemm), (&bp.flat_gemm, &bp.gemm), "{label} M={}", b.m);
            assert_eq!(gemv_bn(sp_plain, b.m), Some(16), "{label} M={}", b.m);
        }
        let fused_kind = sp.kind != LinearKind::Ffn1;
        for &m in &sp.m_grid {
            let want = if fused_kind && m <= FUSED_MAX_M { 8 } else { 16 };
            assert_eq!(gemv_bn(sp, m), Some(want), "{label} M={m}");
            // The recorded time is the chosen layout's plain time, not its fused one.
            let t = sp
                .best_at(m)
                .and_then(|b| b.gemv.as_ref())
                .map(|g| g.median_us)
                .unwrap();
            let spec = GemmSpec::new(GemmImpl::Gemv, DType::F16).with_block_n(want);
            assert!((t - plain_us(&spec, m)).abs() < 1e-6, "{label} M={m}: {t}");
        }
        // What the engine asks for at decode in the gemv region (M < M1 = 5).
        for m in 1..5 {
            let plan = select_in(sp, m);
            assert_eq!(plan.imp, GemmImpl::Gemv, "{label} M={m}");
            assert_eq!(plan.block_n, Some(if fused_kind { 8 } else { 16 }), "{label} M={m}");
        }
        // Every gemv layout has a fused time at every M ≤ 8 in the fused kinds, none elsewhere.
        for c in &sp.candidates {
            let ms: Vec<usize> = c.fused.iter().map(FusedMeasurement::m).collect();
            if fused_kind && c.imp == GemmImpl::Gemv {
                assert_eq!(ms, (1..=FUSED_MAX_M).collect::<Vec<_>>(), "{label} {}", c.uri);
                let op = if sp.kind == LinearKind::Qkv {
                    FusedOp::GemmRmsIn
                } else {
                    FusedOp::GemmResidualOut
                };
                assert!(
                    c.fused
                        .iter()
                        .all(|f| matches!(f, FusedMeasurement::Ok { op: o, samples: 3, .. } if *o == op)),
                    "{label} {}: {:?}",
                    c.uri,
                    c.fused
                );
            } else {
                assert!(ms.is_empty(), "{label} {}: {:?}", c.uri, c.fused);
            }
        }
    }
    // The backend saw fused runs only of gemv layouts, at M ≤ 8, for QKV (rms_in: N = 128) and
    // O / FFN2 (residual_out: N = 64), never for FFN1 (N = 192).
    let calls = fused_on.fused_calls.borrow();
    assert!(!calls.is_empty());
    for &(op, bn, m, n, k) in calls.iter() {
        assert!(m <= FUSED_MAX_M && bn.is_some(), "{op} bn{bn:?} M={m}");
        match op {
            FusedOp::GemmRmsIn => assert_eq!((n, k), (128, 64)),
            FusedOp::GemmResidualOut => assert!((n, k) == (64, 64) || (n, k) == (64, 96), "{n} {k}"),
        }
    }
    assert!(fused_off.fused_calls.borrow().is_empty());
    // The profile keeps the fused times and reads them back.
    let back = Profile::from_json(&p.to_json().unwrap()).unwrap();
    assert_eq!(back, p);
    assert!(p.to_json().unwrap().contains(r#""op": "gemm_residual_out""#));
    assert!(!plain.to_json().unwrap().contains(r#""fused":"#));
}

/// A disturbed fused time (bn8 at M = 4 three times its neighbours in its first timing) gets a
/// second look like a disturbed plain one, so it does not hand M = 4 to another layout.
#[test]
fn a_spike_in_a_fused_time_is_timed_again() {
    let mut b = SynthClock::new(true);
    b.spike = Some((8, 4));
    // One warm-up and three timed runs: the whole first timing of bn8 at M = 4.
    b.spike_runs.set(4);
    let shape = LinearShape {
        kind: LinearKind::O,
        k: 64,
        n: 64,
    };
    let sp = fdpp::tune::sweep_shape(&b, &shape, &opts(12), &mut |_| {}).unwrap();
    assert_eq!(b.spike_runs.get(), 0, "the spike was seen");
    let bn8 = sp.candidates.iter().find(|c| c.block_n == Some(8)).unwrap();
    let spec = GemmSpec::new(GemmImpl::Gemv, DType::F16).with_block_n(8);
    let t = bn8.fused_us(4).unwrap();
    assert!((t - fused_us(&spec, 4)).abs() < 1e-6, "{t}");
    assert_eq!(gemv_bn(&sp, 4), Some(8));
}

#[test]
fn a_k_not_in_16_byte_chunks_is_not_timed_fused() {
    let b = SynthClock::new(true);
    let shape = LinearShape {
        kind: LinearKind::O,
        k: 60,
        n: 64,
    };
    let sp = fdpp::tune::sweep_shape(&b, &shape, &opts(4), &mut |_| {}).unwrap();
    assert!(sp.candidates.iter().all(|c| c.fused.is_empty()));
    assert!(b.fused_calls.borrow().is_empty());
    assert_eq!(gemv_bn(&sp, 1), Some(16), "plain-fastest where nothing ran fused");
}

/// The CPU backend has no fused ops: its tune records no fused time and chooses exactly as
/// before (best = each implementation's plain-fastest, M1/M2 from those times).
#[test]
fn a_cpu_tune_is_unchanged() {
    let b = CpuBackend::new();
    assert!(!b.fused_gemv_ops());
    let mut o = SweepOpts::for_backend(BackendKind::Cpu, DType::F16, Some(6), Some(1)).unwrap();
    o.timing.warmup = 0;
    let p = tune(&b, &tiny(), &o, &mut |_| {}).unwrap();
    for sp in &p.shapes {
        assert!(sp.candidates.iter().all(|c| c.fused.is_empty()), "{}", sp.label());
        assert_eq!(sp.best, best_plain(&sp.m_grid, &sp.candidates), "{}", sp.label());
        let inf = inflection_points(
            &sp.m_grid,
            &sp.times(GemmImpl::Gemv),
            &sp.times(GemmImpl::FlatGemm),
            &sp.times(GemmImpl::Gemm),
            o.margin,
        );
        assert_eq!((sp.m1, sp.m2), (inf.m1, inf.m2), "{}", sp.label());
    }
    assert!(!p.to_json().unwrap().contains(r#""fused":"#));
}

/// Every shipped profile loads, its shape entries write back exactly as they are in the file,
/// and the rule recomputed from its candidates picks what it holds (M1/M2 on the plain times,
/// the gemv layout at decode M on the fused ones where it has them). The H100 profiles predate
/// the fused timing (no `fused` key appears); the H200 ones (session 40) have fused times.
#[test]
fn shipped_profiles_are_unchanged() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles");
    for (device, want, fused) in [("nvidia-h100-80gb-hbm3", 3, false), ("nvidia-h200", 2, true)] {
        let dir = root.join(device);
        let mut seen = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let p = Profile::from_json(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(p.provenance.device.slug, device, "{}", path.display());
            let file: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                serde_json::to_value(&p.shapes).unwrap(),
                file["shapes"],
                "{}",
                path.display()
            );
            for sp in &p.shapes {
                let timed_fused = sp.candidates.iter().any(|c| !c.fused.is_empty());
                // Every shape but FFN1 (whose GLU kernel ignores block_n) has fused times.
                assert_eq!(
                    timed_fused,
                    fused && sp.kind != LinearKind::Ffn1,
                    "{} {}",
                    path.display(),
                    sp.label()
                );
                let again = ShapeProfile::from_measurements(
                    sp.kind,
                    sp.k,
                    sp.n,
                    sp.m_grid.clone(),
                    sp.candidates.clone(),
                    p.timing.margin,
                );
                assert_eq!(again.best, sp.best, "{} {}", path.display(), sp.label());
                assert_eq!(
                    (again.m1, again.m2),
                    (sp.m1, sp.m2),
                    "{} {}",
                    path.display(),
                    sp.label()
                );
            }
            // A decode-pass section holds what its own rows choose, and writes back unchanged.
            if let Some(dp) = &p.decode_pass {
                assert_eq!(
                    DecodePassSection::rule(&dp.rows),
                    dp.tensor_cores_up_to_batch,
                    "{}",
                    path.display()
                );
                assert_eq!(
                    serde_json::to_value(dp).unwrap(),
                    file["decode_pass"],
                    "{}",
                    path.display()
                );
            }
            seen += 1;
        }
        assert!(seen >= want, "{seen} profiles in {}", dir.display());
    }
}
