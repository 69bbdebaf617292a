//! Timing of one GEMM candidate on any backend.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, BackendKind, DeviceInfo};
use crate::dtype::{random_bits, DType};
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};

#[derive(Clone, Copy, Debug)]
pub struct TimingOpts {
    pub warmup: usize,
    pub reps: usize,
}

impl Default for TimingOpts {
    fn default() -> Self {
        TimingOpts { warmup: 5, reps: 30 }
    }
}

/// Summary of the timed runs, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub samples: usize,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Stats {
    /// From per-run milliseconds. Returns None for an empty slice.
    pub fn from_ms(ms: &[f64]) -> Option<Stats> {
        if ms.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = ms.iter().map(|t| t * 1e3).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            0.5 * (v[n / 2 - 1] + v[n / 2])
        };
        Some(Stats {
            samples: n,
            median_us: median,
            min_us: v[0],
            max_us: v[n - 1],
        })
    }
}

/// Share of a memory that a sweep may take (the rest is the runtime's, the OS's, other buffers').
const USABLE_MEMORY: f64 = 0.9;

/// The memory one [`GemmInputs`] copy of a [K, N] shape at up to `max_m` rows takes: (device,
/// host). The device holds x, W and y; the host keeps x and W for the verifier and builds each
/// copy before its upload (twice x and W at the peak).
pub fn gemm_inputs_bytes(dtype: DType, n: usize, k: usize, max_m: usize) -> (u128, u128) {
    let e = dtype.size_bytes() as u128;
    let (n, k, m) = (n as u128, k as u128, max_m as u128);
    let device = (m * k + n * k + m * n) * e;
    let host = 2 * (m * k + n * k) * e;
    (device, host)
}

/// Refuses a GEMM sweep whose inputs would not fit, before anything is allocated: the bytes it
/// needs, the memory it has, and `flag`, the option that sets the rows (`--m-max`, `--m`). On the
/// CPU the device is the host, so both needs add up. A memory size of 0 (unknown) is not checked.
pub fn check_gemm_fits(
    info: &DeviceInfo,
    host_bytes: u64,
    dtype: DType,
    shapes: &[(usize, usize)],
    max_m: usize,
    flag: &str,
) -> Result<()> {
    let gib = |b: u128| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    // (device, host) bytes of one shape at M rows, each against what that memory has.
    let needs_at = |k: usize, n: usize, m: usize| {
        let (device, host) = gemm_inputs_bytes(dtype, n, k, m);
        if info.backend == BackendKind::Cpu {
            vec![("host", device + host, info.memory_bytes as u128)]
        } else {
            vec![
                ("device", device, info.memory_bytes as u128),
                ("host", host, host_bytes as u128),
            ]
        }
    };
    let too_big = |need: u128, have: u128| have > 0 && need > (have as f64 * USABLE_MEMORY) as u128;
    for &(k, n) in shapes {
        for (what, need, have) in needs_at(k, n, max_m) {
            let usable = (have as f64 * USABLE_MEMORY) as u128;
            if too_big(need, have) {
                // Fewer rows help only when the weight matrix itself fits.
                let at_one = needs_at(k, n, 1)
                    .into_iter()
                    .find(|&(w, _, _)| w == what)
                    .map_or(0, |(_, b, _)| b);
                let advice = if too_big(at_one, have) {
                    format!(
                        "even at M=1 it needs {}: this model's weight matrix [K={k}, N={n}] cannot be \
                         timed on this machine whatever {flag} is; check the config's sizes \
                         (hidden_size, intermediate_size) or use a machine with more memory",
                        gib(at_one)
                    )
                } else {
                    format!("lower {flag}")
                };
                return Err(FdppError::InvalidArgument(format!(
                    "GEMM [K={k}, N={n}] at M={max_m} ({dtype}) needs {} of {what} memory for x, W and y, \
                     more than the {} usable of {}'s {}; {advice}",
                    gib(need),
                    gib(usable),
                    if what == "host" && info.backend != BackendKind::Cpu {
                        "the host"
                    } else {
                        &info.name
                    },
                    gib(have)
                )));
            }
        }
    }
    Ok(())
}

/// Random inputs for one [K, N] shape at the largest M of a sweep, in several copies so that a
/// timed run does not find the weights in L2 (H100: 50 MB). Smaller M reuse the leading rows.
pub struct GemmInputs<B: Backend> {
    pub dtype: DType,
    pub n: usize,
    pub k: usize,
    pub max_m: usize,
    pub xs: Vec<B::Buffer>,
    pub ws: Vec<B::Buffer>,
    /// Host copies of the first x and W, for verification against the reference.
    pub x0: Vec<u16>,
    pub w0: Vec<u16>,
    pub y: B::Buffer,
    /// The copy the next run uses. One cursor across every candidate and every call, so that two
    /// consecutive kernels never read the same copy (a candidate that started on the copy its
    /// predecessor just read would find it in L2 and time faster than the roofline).
    cursor: usize,
}

impl<B: Backend> GemmInputs<B> {
    /// `cache_bytes`: the last-level cache to defeat (device L2, or a CPU's LLC estimate).
    pub fn new(b: &B, dtype: DType, n: usize, k: usize, max_m: usize, cache_bytes: u64, seed: u64) -> Result<Self> {
        // A clean error, not the allocator's abort, when one copy does not fit (the callers check
        // first with their own flag's name; this guards every other path).
        let host = crate::backend::cpu::info::host_memory_bytes();
        check_gemm_fits(b.info(), host, dtype, &[(k, n)], max_m, "the number of rows M")?;
        let w_bytes = (n * k * 2) as u64;
        // Enough copies that the set being cycled through is at least 3x the cache.
        let mut copies = (3 * cache_bytes).div_ceil(w_bytes.max(1)).clamp(1, 8) as usize;
        // As many copies as fit the device beside y (one always does: checked above).
        let mem = b.info().memory_bytes as u128;
        if mem > 0 {
            let (one, _) = gemm_inputs_bytes(dtype, n, k, max_m);
            let y = (max_m * n * dtype.size_bytes()) as u128;
            let usable = (mem as f64 * USABLE_MEMORY) as u128;
            let fit = usable.saturating_sub(y) / (one - y).max(1);
            copies = copies.min(fit.max(1) as usize);
        }
        // Scale x by 1/sqrt(K) so outputs stay O(1) in fp16 at any K.
        let xs_scale = 1.0 / (k as f32).sqrt();
        let mut xs = Vec::with_capacity(copies);
        let mut ws = Vec::with_capacity(copies);
        let mut x0 = Vec::new();
        let mut w0 = Vec::new();
        for c in 0..copies {
            let x = random_bits(dtype, max_m * k, xs_scale, seed.wrapping_add(2 * c as u64));
            let w = random_bits(dtype, n * k, 1.0, seed.wrapping_add(2 * c as u64 + 1));
            xs.push(b.upload(dtype, &x)?);
            // W as the engine holds a linear's W: in the backend's prepared layout.
            let mut wb = b.upload(dtype, &w)?;
            b.prepare_linear_weight(&mut wb, n, k)?;
            ws.push(wb);
            if c == 0 {
                x0 = x;
                w0 = w;
            }
        }
        let y = b.alloc(dtype, max_m * n)?;
        Ok(GemmInputs {
            dtype,
            n,
            k,
            max_m,
            xs,
            ws,
            x0,
            w0,
            y,
            cursor: 0,
        })
    }

    pub fn copies(&self) -> usize {
        self.ws.len()
    }

    /// Time several candidates at M rows, interleaved: warm-up each, then `rounds` rounds in each
    /// of which every candidate runs its share of `opts.reps` back to back. A transient slowdown
    /// of the device (seen on the H100: a whole ~1 ms window 3× slower) then lands on every
    /// candidate alike instead of on whichever was being timed, so the comparison between
    /// candidates, which is what the tuner needs, stays fair. One result per spec, in order.
    pub fn time_interleaved(
        &mut self,
        b: &B,
        specs: &[GemmSpec],
        m: usize,
        opts: TimingOpts,
        rounds: usize,
    ) -> Vec<Result<Stats>> {
        let dims = match GemmDims::new(m, self.n, self.k) {
            Ok(d) => d,
            Err(e) => {
                return specs
                    .iter()
                    .map(|_| Err(crate::error::FdppError::InvalidArgument(e.to_string())))
                    .collect()
            }
        };
        let rounds = rounds.clamp(1, opts.reps.max(1));
        let per_round = opts.reps.max(1).div_ceil(rounds);
        let mut out: Vec<Result<Vec<f64>>> = specs.iter().map(|_| Ok(Vec::new())).collect();
        for (spec, slot) in specs.iter().zip(out.iter_mut()) {
            for _ in 0..opts.warmup {
                if let Err(e) = crate::interrupt::check("warm-up").and_then(|()| self.run_next(b, spec, dims)) {
                    *slot = Err(e);
                    break;
                }
            }
        }
        for r in 0..rounds {
            // A new order every round: what ran just before a candidate changes its time (seen on
            // the H100: a gemv block right after a cuBLAS block ran ~10 % slower, lead-in run or
            // not), so no candidate may always follow the same one. A rotation keeps neighbours;
            // a seeded shuffle does not, and stays reproducible.
            let mut order: Vec<usize> = (0..specs.len()).collect();
            order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(0x5eed ^ r as u64));
            for idx in order {
                let (spec, slot) = (&specs[idx], &mut out[idx]);
                let Ok(samples) = slot else { continue };
                // Ctrl-C ends the timing at the next run (the caller checks and writes nothing).
                let mut run = |_| {
                    crate::interrupt::check("timing")?;
                    self.run_next(b, spec, dims)
                };
                match b.time_each(per_round, &mut run) {
                    Ok(ms) => samples.extend(ms),
                    Err(e) => *slot = Err(e),
                }
            }
        }
        out.into_iter()
            .zip(specs)
            .map(|(r, spec)| {
                r.and_then(|ms| {
                    Stats::from_ms(&ms).ok_or_else(|| {
                        crate::error::FdppError::device("timer", format!("{spec}: no timed runs came back"))
                    })
                })
            })
            .collect()
    }

    /// One run of `spec` on the next copy of the inputs.
    fn run_next(&mut self, b: &B, spec: &GemmSpec, dims: GemmDims) -> Result<()> {
        let j = self.cursor % self.copies();
        self.cursor = self.cursor.wrapping_add(1);
        b.gemm(spec, dims, &self.xs[j], &self.ws[j], &mut self.y)
    }

    /// Time `spec` at M rows: warm-up, then `opts.reps` runs rotating over the copies.
    pub fn time(&mut self, b: &B, spec: &GemmSpec, m: usize, opts: TimingOpts) -> Result<Stats> {
        let dims = GemmDims::new(m, self.n, self.k)?;
        for _ in 0..opts.warmup {
            self.run_next(b, spec, dims)?;
        }
        let ms = b.time_each(opts.reps.max(1), &mut |_| self.run_next(b, spec, dims))?;
        Stats::from_ms(&ms)
            .ok_or_else(|| crate::error::FdppError::device("timer", format!("{spec}: no timed runs came back")))
    }
}
