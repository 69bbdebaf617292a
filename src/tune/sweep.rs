//! The sweep: for one shape, every (M, candidate) pair is verified, then timed.
//!
//! Inputs are built once per shape at the largest M (in enough copies to defeat the cache) and
//! smaller M use their leading rows, so every M sees the same data. A candidate that errors or
//! computes a wrong result at some M is recorded as rejected there, with the reason, and can
//! never be selected at that M; one that does not support the dims is recorded as skipped.
//!
//! Where the engine runs a gemv layout as a fused op (see [`super::fused`]), a verified layout
//! is also timed as that op; verification stays on the plain product.

use crate::backend::{Backend, BackendKind};
use crate::bench::{GemmInputs, TimingOpts};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::{LinearShape, ModelConfig, ModelShapes};
use crate::ops::gemm::{GemmImpl, GemmSpec};
use crate::profile::{
    CandidateResult, FusedMeasurement, Measurement, ModelSection, Profile, Provenance, ShapeProfile, TimingSection,
    SCHEMA_VERSION,
};

use super::fused::{fused_op, FusedTimer};
use super::inflection::{rule_text, DEFAULT_MARGIN};
use super::verify::{Verifier, DEFAULT_SAMPLE_COLS};

/// Used when a backend does not report its last-level cache size.
pub const FALLBACK_CACHE_BYTES: u64 = 32 << 20;

/// Fixed so that two tunes of the same build time the same data.
pub const DEFAULT_SEED: u64 = 0xFD99_2024;

#[derive(Clone, Debug)]
pub struct SweepOpts {
    pub dtype: DType,
    pub m_grid: Vec<usize>,
    pub timing: TimingOpts,
    pub margin: f64,
    pub seed: u64,
    pub verify_cols: usize,
}

/// Warm-up and repetitions per backend: many on a GPU (runs take microseconds), few on the CPU
/// (a llama2-7b-sized GEMM takes tens of milliseconds there, and the verification run just
/// before the timed ones already warms the caches and the thread pool).
pub fn default_timing(kind: BackendKind) -> TimingOpts {
    match kind {
        BackendKind::Cpu => TimingOpts { warmup: 0, reps: 3 },
        BackendKind::Cuda | BackendKind::Rocm => TimingOpts::default(),
    }
}

impl SweepOpts {
    /// Defaults for a backend, with the user's `--m-max` and `--reps` where given.
    pub fn for_backend(kind: BackendKind, dtype: DType, m_max: Option<usize>, reps: Option<usize>) -> Result<Self> {
        let m_grid = super::grid::m_grid(m_max.unwrap_or_else(|| super::grid::default_m_max(kind)))?;
        let mut timing = default_timing(kind);
        if let Some(r) = reps {
            if r == 0 {
                return Err(FdppError::InvalidArgument("--reps must be at least 1".into()));
            }
            timing.reps = r;
        }
        Ok(SweepOpts {
            dtype,
            m_grid,
            timing,
            margin: DEFAULT_MARGIN,
            seed: DEFAULT_SEED,
            verify_cols: DEFAULT_SAMPLE_COLS,
        })
    }
}

/// The backend's candidates for a shape, each URI once.
pub fn candidates<B: Backend>(b: &B, dtype: DType, shape: &LinearShape) -> Vec<GemmSpec> {
    let mut out: Vec<GemmSpec> = Vec::new();
    for c in b.gemm_candidates(dtype, shape.n, shape.k) {
        if !out.iter().any(|o| o.uri() == c.uri()) {
            out.push(c);
        }
    }
    out
}

/// One (shape, M, candidate) step of a sweep, as its progress callback sees it.
pub struct Step<'a> {
    pub label: &'a str,
    /// The step's share of the sweep's work: its GEMM FLOPs (2·M·N·K) plus a fixed
    /// [`STEP_OVERHEAD_FLOP`] for the launches and the verification around them; twice that for
    /// a gemv layout also timed as its fused op (as many runs again of about the same kernel).
    pub work: u64,
}

/// The work of a step besides its FLOPs, in FLOP-equivalents: small-M steps are dominated by
/// launches, copies and verification, not by arithmetic.
pub const STEP_OVERHEAD_FLOP: u64 = 50_000_000;

fn step_work(m: usize, shape: &LinearShape) -> u64 {
    (2 * m as u64)
        .saturating_mul(shape.weight_elems())
        .saturating_add(STEP_OVERHEAD_FLOP)
}

/// The work of the step of a candidate of `imp` at `m` on a backend whose `fused_gemv_ops()` is
/// `fused_ops`.
fn candidate_work(fused_ops: bool, shape: &LinearShape, imp: GemmImpl, m: usize) -> u64 {
    let timings = if fused_op(fused_ops, shape, imp, m).is_some() {
        2
    } else {
        1
    };
    step_work(m, shape).saturating_mul(timings)
}

/// The work (see [`Step::work`]) a tune of `shapes` takes in all: a progress bar weighted by it
/// gives an honest time estimate although the large-M steps cost far more than the small.
pub fn count_work<B: Backend>(b: &B, shapes: &[LinearShape], opts: &SweepOpts) -> u64 {
    shapes
        .iter()
        .map(|s| {
            let specs = candidates(b, opts.dtype, s);
            opts.m_grid
                .iter()
                .flat_map(|&m| specs.iter().map(move |c| (m, c.imp)))
                .map(|(m, imp)| candidate_work(b.fused_gemv_ops(), s, imp, m))
                .sum::<u64>()
        })
        .sum()
}

/// Sweep one shape. `on_step` is called before each (M, candidate) step with a short label.
pub fn sweep_shape<B: Backend>(
    b: &B,
    shape: &LinearShape,
    opts: &SweepOpts,
    on_step: &mut dyn FnMut(&Step),
) -> Result<ShapeProfile> {
    let Some(&max_m) = opts.m_grid.last() else {
        return Err(FdppError::InvalidArgument("empty M grid".into()));
    };
    let backend = b.info().backend.name();
    let cache = match b.info().l2_bytes {
        0 => FALLBACK_CACHE_BYTES,
        c => c,
    };
    crate::interrupt::check(&format!("the sweep of {}", shape.label()))?;
    let seed = opts.seed.wrapping_add(0x1000 * (shape.kind as u64 + 1));
    let mut inputs = GemmInputs::new(b, opts.dtype, shape.n, shape.k, max_m, cache, seed).map_err(|e| {
        FdppError::device(
            backend,
            format!(
                "preparing inputs for {} at M={max_m} ({}): {e}",
                shape.label(),
                opts.dtype
            ),
        )
    })?;
    crate::interrupt::check(&format!("the sweep of {}", shape.label()))?;
    let verifier = Verifier::new(&inputs, max_m, opts.verify_cols)?;
    let specs = candidates(b, opts.dtype, shape);
    let fused_at = |m: usize| fused_op(b.fused_gemv_ops(), shape, GemmImpl::Gemv, m);
    // One output / residual buffer for the shape's fused timings, where it has any.
    let mut fused_timer = match opts.m_grid.iter().find_map(|&m| fused_at(m)) {
        Some(op) => Some(FusedTimer::new(b, opts.dtype, op, shape.n, max_m).map_err(|e| {
            FdppError::device(
                backend,
                format!("preparing the {op} timing of {} ({}): {e}", shape.label(), opts.dtype),
            )
        })?),
        None => None,
    };
    let mut results: Vec<Vec<Measurement>> = vec![Vec::with_capacity(opts.m_grid.len()); specs.len()];
    let mut fused: Vec<Vec<FusedMeasurement>> = vec![Vec::new(); specs.len()];
    for &m in &opts.m_grid {
        // Verify every candidate first, then time the verified ones interleaved (see
        // GemmInputs::time_interleaved): only a candidate that computed the right answer is timed.
        let mut verified: Vec<(usize, f64)> = Vec::new();
        let mut row: Vec<Option<Measurement>> = vec![None; specs.len()];
        for (i, spec) in specs.iter().enumerate() {
            // Ctrl-C stops the sweep within one step; nothing is written (src/interrupt.rs).
            crate::interrupt::check(&format!("the sweep of {} at M={m}", shape.label()))?;
            on_step(&Step {
                label: &format!("{} M={m} {spec}", shape.label()),
                work: candidate_work(b.fused_gemv_ops(), shape, spec.imp, m),
            });
            match verifier.check(b, &mut inputs, spec, m) {
                Ok(nmse) => verified.push((i, nmse)),
                Err(e) => row[i] = Some(classify(e, m, "")),
            }
        }
        let timed_specs: Vec<GemmSpec> = verified.iter().map(|&(i, _)| specs[i]).collect();
        let times = inputs.time_interleaved(b, &timed_specs, m, opts.timing, TIMING_ROUNDS);
        // Timing stops early on Ctrl-C: its partial times must not become a profile.
        crate::interrupt::check(&format!("the sweep of {} at M={m}", shape.label()))?;
        for (&(i, nmse), t) in verified.iter().zip(times) {
            row[i] = Some(match t {
                Ok(s) => Measurement::Ok {
                    m,
                    samples: s.samples,
                    median_us: s.median_us,
                    min_us: s.min_us,
                    max_us: s.max_us,
                    nmse,
                },
                Err(e) => classify(e, m, "failed while timed: "),
            });
        }
        // The gemv layouts that passed, timed as the fused op the engine runs with them here.
        if let Some(timer) = fused_timer.as_mut().filter(|_| fused_at(m).is_some()) {
            let gemvs: Vec<usize> = (0..specs.len())
                .filter(|&i| specs[i].imp == GemmImpl::Gemv && matches!(row[i], Some(Measurement::Ok { .. })))
                .collect();
            for (i, f) in time_fused(b, timer, &inputs, &specs, &gemvs, m, opts)? {
                fused[i].push(f);
            }
        }
        for (out, r) in results.iter_mut().zip(row) {
            if let Some(r) = r {
                out.push(r);
            }
        }
    }
    // A second look at disturbed rows: on the H100 a whole M row of one shape sometimes times
    // 1.5-6x its neighbours (cuBLAS at 99.8 µs between 19.6 and 16.7; seen in two tunes of
    // llama3-8b), and one such row moves M1/M2 far. Such rows are timed again and the new times
    // replace the old; a slowdown that is real shows again. The fused times are looked at too
    // (they choose the gemv layout), and a disturbed row gets both timed again.
    let mut series: Vec<Vec<Option<f64>>> = results
        .iter()
        .map(|r| r.iter().map(Measurement::median_us).collect())
        .collect();
    series.extend(fused.iter().filter(|f| !f.is_empty()).map(|f| {
        opts.m_grid
            .iter()
            .map(|&m| f.iter().find(|x| x.m() == m).and_then(FusedMeasurement::median_us))
            .collect()
    }));
    for j in disturbed(&series, SPIKE) {
        let m = opts.m_grid[j];
        let again: Vec<usize> = (0..specs.len())
            .filter(|&i| matches!(results[i].get(j), Some(Measurement::Ok { .. })))
            .collect();
        let timed_specs: Vec<GemmSpec> = again.iter().map(|&i| specs[i]).collect();
        let times = inputs.time_interleaved(b, &timed_specs, m, opts.timing, TIMING_ROUNDS);
        crate::interrupt::check(&format!("the second look at {} M={m}", shape.label()))?;
        for (&i, t) in again.iter().zip(times) {
            if let (Ok(st), Some(Measurement::Ok { nmse, .. })) = (t, results[i].get(j)) {
                let nmse = *nmse;
                results[i][j] = Measurement::Ok {
                    m,
                    samples: st.samples,
                    median_us: st.median_us,
                    min_us: st.min_us,
                    max_us: st.max_us,
                    nmse,
                };
            }
        }
        if let Some(timer) = fused_timer.as_mut().filter(|_| fused_at(m).is_some()) {
            let gemvs: Vec<usize> = (0..specs.len())
                .filter(|&i| fused[i].iter().any(|f| f.m() == m && f.median_us().is_some()))
                .collect();
            for (i, f) in time_fused(b, timer, &inputs, &specs, &gemvs, m, opts)? {
                if let (Some(old), true) = (fused[i].iter_mut().find(|x| x.m() == m), f.median_us().is_some()) {
                    *old = f;
                }
            }
        }
    }
    let candidates = specs
        .iter()
        .zip(results)
        .zip(fused)
        .map(|((s, results), fused)| CandidateResult {
            uri: s.uri(),
            imp: s.imp,
            block_n: s.block_n,
            stages: s.stages,
            algo: s.algo,
            results,
            fused,
        })
        .collect();
    Ok(ShapeProfile::from_measurements(
        shape.kind,
        shape.k,
        shape.n,
        opts.m_grid.clone(),
        candidates,
        opts.margin,
    ))
}

/// Rounds over which each candidate's timed runs are spread (GemmInputs::time_interleaved).
pub const TIMING_ROUNDS: usize = 5;

/// A time this many times both grid neighbours' (of the same candidate) marks its M row as
/// disturbed. Memory-bound GEMMs change smoothly with M; a step up (a second gemv launch past
/// M = 8, another flat tile) is followed by the next grid point, so it is never above both.
pub const SPIKE: f64 = 1.3;

/// Grid indices (not the first or last) where some candidate's median exceeds `spike` times both
/// of its neighbours' medians.
pub fn disturbed_rows(results: &[Vec<Measurement>], spike: f64) -> Vec<usize> {
    let series: Vec<Vec<Option<f64>>> = results
        .iter()
        .map(|r| r.iter().map(Measurement::median_us).collect())
        .collect();
    disturbed(&series, spike)
}

/// [`disturbed_rows`] over series of medians by grid index (None = no time there).
pub fn disturbed(series: &[Vec<Option<f64>>], spike: f64) -> Vec<usize> {
    let cols = series.iter().map(|r| r.len()).min().unwrap_or(0);
    (1..cols.saturating_sub(1))
        .filter(|&j| {
            series.iter().any(|r| match (r[j - 1], r[j], r[j + 1]) {
                (Some(a), Some(t), Some(c)) => t > spike * a.max(c),
                _ => false,
            })
        })
        .collect()
}

/// Time the candidates `idx` of `specs` at `m` as the timer's fused op; their outcomes, by
/// candidate index.
fn time_fused<B: Backend>(
    b: &B,
    timer: &mut FusedTimer<B>,
    inputs: &GemmInputs<B>,
    specs: &[GemmSpec],
    idx: &[usize],
    m: usize,
    opts: &SweepOpts,
) -> Result<Vec<(usize, FusedMeasurement)>> {
    let op = timer.op();
    if idx.is_empty() {
        return Ok(Vec::new());
    }
    let timed: Vec<GemmSpec> = idx.iter().map(|&i| specs[i]).collect();
    let times = timer.time_interleaved(b, inputs, &timed, m, opts.timing, TIMING_ROUNDS);
    // As after the plain timing: partial times of an interrupted run must not become a profile.
    crate::interrupt::check(&format!("the {op} timing at M={m}"))?;
    Ok(idx
        .iter()
        .zip(times)
        .map(|(&i, t)| (i, super::fused::measurement(op, m, t)))
        .collect())
}

/// An error of a candidate at M: `Unsupported` skips it there, anything else rejects it.
fn classify(e: FdppError, m: usize, when: &str) -> Measurement {
    match e {
        FdppError::Unsupported { .. } => Measurement::Skipped {
            m,
            reason: e.to_string(),
        },
        e => Measurement::Rejected {
            m,
            reason: format!("{when}{e}"),
        },
    }
}

/// Tune every linear shape of `cfg` and assemble the profile (not yet written anywhere).
pub fn tune<B: Backend>(b: &B, cfg: &ModelConfig, opts: &SweepOpts, on_step: &mut dyn FnMut(&Step)) -> Result<Profile> {
    let shapes = ModelShapes::of(cfg);
    let mut out = Vec::with_capacity(shapes.linears.len());
    for s in &shapes.linears {
        out.push(sweep_shape(b, s, opts, on_step)?);
    }
    Ok(Profile {
        schema_version: SCHEMA_VERSION,
        provenance: Provenance::of(b),
        model: ModelSection {
            name: cfg.name.clone(),
            config: cfg.clone(),
            shapes: shapes.linears.clone(),
        },
        dtype: opts.dtype,
        timing: TimingSection {
            warmup: opts.timing.warmup,
            reps: opts.timing.reps,
            verify_cols: opts.verify_cols,
            margin: opts.margin,
            rule: rule_text(opts.margin),
        },
        shapes: out,
        softmax: None,
        decode_pass: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::LinearKind;
    use crate::ops::gemm::GemmImpl;

    fn opts(m_max: usize) -> SweepOpts {
        let mut o = SweepOpts::for_backend(BackendKind::Cpu, DType::F16, Some(m_max), Some(1)).unwrap();
        o.timing.warmup = 0;
        o
    }

    fn ok(m: usize, us: f64) -> Measurement {
        Measurement::Ok {
            m,
            samples: 30,
            median_us: us,
            min_us: us,
            max_us: us,
            nmse: 0.0,
        }
    }

    #[test]
    fn a_row_above_both_neighbours_is_disturbed_a_step_up_is_not() {
        let grid = [8usize, 12, 16, 24, 32, 48, 64, 96, 128, 192];
        // cuBLAS of llama3-8b O (µs, run B3): 49.2 at M=128 between 17.1 and 19.2.
        let gemm = [16.3, 17.9, 18.6, 16.4, 16.7, 16.9, 17.2, 17.1, 49.2, 19.2];
        // A gemv that doubles past M = 8 and grows: steps up, never a spike.
        let gemv = [26.1, 41.6, 52.3, 73.4, 97.4, 140.8, 186.5, 284.8, 382.2, 579.6];
        let row = |t: &[f64]| grid.iter().zip(t).map(|(&m, &u)| ok(m, u)).collect::<Vec<_>>();
        assert_eq!(disturbed_rows(&[row(&gemm), row(&gemv)], SPIKE), vec![8]);
        assert!(disturbed_rows(&[row(&gemv)], SPIKE).is_empty());
        // A rejected neighbour hides the point; the ends are never judged.
        let mut r = row(&gemm);
        r[9] = Measurement::Rejected {
            m: 192,
            reason: "x".into(),
        };
        assert!(disturbed_rows(&[r], SPIKE).is_empty());
        let ends = [90.0, 17.0, 18.0, 17.5, 95.0];
        assert!(disturbed_rows(&[row(&ends)], SPIKE).is_empty());
        assert!(disturbed_rows(&[], SPIKE).is_empty());
    }

    #[test]
    fn options_from_the_command_line() {
        assert!(SweepOpts::for_backend(BackendKind::Cpu, DType::F16, Some(0), None).is_err());
        assert!(SweepOpts::for_backend(BackendKind::Cpu, DType::F16, None, Some(0)).is_err());
        let o = SweepOpts::for_backend(BackendKind::Cpu, DType::Bf16, None, None).unwrap();
        assert_eq!(*o.m_grid.last().unwrap(), 128);
        assert_eq!(o.timing.reps, 3);
        let o = SweepOpts::for_backend(BackendKind::Cuda, DType::F16, None, Some(7)).unwrap();
        assert_eq!(*o.m_grid.last().unwrap(), 2048);
        assert_eq!((o.timing.warmup, o.timing.reps), (5, 7));
    }

    #[test]
    fn sweep_on_cpu_times_every_candidate_at_every_m() {
        let b = CpuBackend::new();
        let shape = LinearShape {
            kind: LinearKind::O,
            k: 96,
            n: 80,
        };
        let o = opts(5);
        let mut steps = Vec::new();
        let mut work = 0u64;
        let sp = sweep_shape(&b, &shape, &o, &mut |s| {
            steps.push(s.label.to_string());
            work += s.work;
        })
        .unwrap();
        // The progress bar's total is the sum of the steps' work, and large M weigh more.
        assert_eq!(work, count_work(&b, &[shape], &o));
        assert_eq!(steps.len(), 5 * b.gemm_candidates(o.dtype, shape.n, shape.k).len());
        assert!(step_work(5, &shape) > step_work(1, &shape));
        assert!(steps[0].contains("o[K=96,N=80] M=1"), "{}", steps[0]);
        assert_eq!(sp.m_grid, vec![1, 2, 3, 4, 5]);
        assert_eq!(sp.candidates.len(), b.gemm_candidates(o.dtype, shape.n, shape.k).len());
        for c in &sp.candidates {
            assert_eq!(c.results.len(), 5, "{}", c.uri);
            // The CPU backend has no fused gemv ops: nothing is timed fused.
            assert!(c.fused.is_empty(), "{}: {:?}", c.uri, c.fused);
            for r in &c.results {
                match r {
                    Measurement::Ok {
                        nmse,
                        median_us,
                        samples,
                        ..
                    } => {
                        assert!(*nmse < DType::F16.nmse_limit());
                        assert!(*median_us > 0.0);
                        assert_eq!(*samples, 1);
                    }
                    other => panic!("{}: {other:?}", c.uri),
                }
            }
        }
        for imp in GemmImpl::ALL {
            assert!(sp.times(imp).iter().all(|t| t.is_some()), "{imp}");
        }
    }
}
