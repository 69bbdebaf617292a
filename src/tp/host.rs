//! The in-process communicator: ranks are threads of one process (the CPU backend, and tests),
//! meeting at each collective through one shared slot table.
//!
//! Reproducible: the last rank to arrive sums the contributions in rank order in f32 and rounds
//! once, so the result does not depend on arrival order and is the same on every rank. Never
//! hangs: a rank waits at most `timeout` for the others, then fails the whole group with an
//! error naming the ranks that did not arrive; a rank that fails elsewhere
//! ([`Communicator::abort`]) fails every waiting and later collective with its error.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::comm::Communicator;
use crate::backend::cpu::{CpuBackend, CpuBuffer};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};

/// How long a rank waits for the others at a collective unless told otherwise
/// (`FDPP_TP_TIMEOUT_S`): ranks run in lockstep, so a wait this long means a rank is stuck.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The timeout from `FDPP_TP_TIMEOUT_S` (seconds), else [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var("FDPP_TP_TIMEOUT_S") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            _ => Err(FdppError::InvalidArgument(format!(
                "FDPP_TP_TIMEOUT_S={v}: expected a positive number of seconds"
            ))),
        },
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Sum,
    /// f32 values, each carried as two 16-bit halves (low first), summed in f32 and not
    /// rounded further: a row-parallel GEMM's partial products.
    SumF32,
    Broadcast(usize),
    /// Every rank's contribution, one after the other in rank order.
    Gather,
}

struct State {
    /// Collectives completed so far.
    generation: u64,
    /// This collective's contributions, by rank.
    slots: Vec<Option<Vec<u16>>>,
    /// What the current collective is (every rank must agree).
    op: Option<(Op, DType, usize)>,
    /// The last completed collective's result.
    result: Arc<Vec<u16>>,
    /// The first failure: (rank, why).
    failed: Option<(usize, String)>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
}

/// One rank's end of an in-process group.
#[derive(Clone)]
pub struct HostComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl HostComm {
    /// A group of `world` ranks; element r is rank r's handle.
    pub fn group(world: usize, timeout: Duration) -> Vec<HostComm> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                slots: vec![None; world],
                op: None,
                result: Arc::new(Vec::new()),
                failed: None,
            }),
            arrived: Condvar::new(),
        });
        (0..world)
            .map(|rank| HostComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.shared.world
    }

    /// The first failure of the group, if any: (rank, why).
    pub fn failure(&self) -> Option<(usize, String)> {
        self.lock().failed.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock left consistent data (every update is
        // one assignment); the panic itself reaches the driver through the thread's join.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, msg: String) -> FdppError {
        FdppError::Collective { rank: self.rank, msg }
    }

    fn stopped(&self, by: usize, why: &str) -> FdppError {
        if by == self.rank {
            self.err(format!("stopped: {why}"))
        } else {
            self.err(format!("stopped because rank {by} failed: {why}"))
        }
    }

    /// Record a failure of this rank (the first one wins) and wake every waiting rank.
    pub fn fail(&self, why: &str) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some((self.rank, why.to_string()));
        }
        drop(st);
        self.shared.arrived.notify_all();
    }

    /// Sum `bits` (Σ in rank order, in f32, rounded once), take rank `root`'s, or gather every
    /// rank's, into `out` on every rank (`out` is `bits` itself except for a gather).
    fn collective(&self, op: Op, dtype: DType, bits: &[u16], out: &mut [u16]) -> Result<()> {
        let world = self.shared.world;
        if world == 1 {
            return Ok(());
        }
        let mut st = self.lock();
        if let Some((by, why)) = &st.failed {
            return Err(self.stopped(*by, why));
        }
        let this = (op, dtype, bits.len());
        match st.op {
            None => st.op = Some(this),
            Some(other) if other != this => {
                let why = format!(
                    "collectives out of step: this rank called {this:?} (op, dtype, elements) while another called \
                     {other:?}"
                );
                st.failed = Some((self.rank, why.clone()));
                drop(st);
                self.shared.arrived.notify_all();
                return Err(self.err(why));
            }
            Some(_) => {}
        }
        st.slots[self.rank] = Some(bits.to_vec());
        let gen = st.generation;
        if st.slots.iter().all(Option::is_some) {
            let slots: Vec<Vec<u16>> = st.slots.iter_mut().filter_map(Option::take).collect();
            st.result = Arc::new(combine(op, dtype, &slots));
            st.op = None;
            st.generation += 1;
            out.copy_from_slice(&st.result);
            drop(st);
            self.shared.arrived.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some((by, why)) = &st.failed {
                return Err(self.stopped(*by, why));
            }
            if st.generation != gen {
                // The next collective cannot complete without this rank, so the result is
                // still this one's.
                out.copy_from_slice(&st.result);
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (0..world)
                    .filter(|r| st.slots[*r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                let why = format!(
                    "rank(s) {} did not reach the collective within {:.1} s (FDPP_TP_TIMEOUT_S sets the wait)",
                    missing.join(", "),
                    self.shared.timeout.as_secs_f64()
                );
                st.failed = Some((self.rank, why.clone()));
                drop(st);
                self.shared.arrived.notify_all();
                return Err(self.err(why));
            }
            st = self
                .shared
                .arrived
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// In-place sum over the group of 16-bit data of `dtype`.
    pub fn all_reduce_bits(&self, dtype: DType, bits: &mut [u16]) -> Result<()> {
        let mine = bits.to_vec();
        self.collective(Op::Sum, dtype, &mine, bits)
    }

    /// In-place sum over the group of f32 values (Σ in rank order, in f32).
    pub fn all_reduce_f32(&self, dtype: DType, v: &mut [f32]) -> Result<()> {
        let bits: Vec<u16> = v
            .iter()
            .flat_map(|x| {
                let b = x.to_bits();
                [b as u16, (b >> 16) as u16]
            })
            .collect();
        let mut out = bits.clone();
        self.collective(Op::SumF32, dtype, &bits, &mut out)?;
        for (x, pair) in v.iter_mut().zip(out.chunks_exact(2)) {
            *x = f32_of(pair);
        }
        Ok(())
    }

    /// `out` = every rank's `bits`, in rank order (`out` holds world × bits.len()).
    pub fn all_gather_bits(&self, dtype: DType, bits: &[u16], out: &mut [u16]) -> Result<()> {
        if out.len() != bits.len() * self.shared.world {
            return Err(self.err(format!(
                "an all-gather of {} elements per rank over {} ranks into {} elements",
                bits.len(),
                self.shared.world,
                out.len()
            )));
        }
        if self.shared.world == 1 {
            out.copy_from_slice(bits);
            return Ok(());
        }
        self.collective(Op::Gather, dtype, bits, out)
    }

    /// Rank `root`'s `bits` on every rank.
    pub fn broadcast_bits(&self, dtype: DType, bits: &mut [u16], root: usize) -> Result<()> {
        if root >= self.shared.world {
            return Err(self.err(format!("broadcast from rank {root} of {}", self.shared.world)));
        }
        let mine = bits.to_vec();
        self.collective(Op::Broadcast(root), dtype, &mine, bits)
    }
}

/// The collective's result from every rank's contribution, in rank order.
fn combine(op: Op, dtype: DType, slots: &[Vec<u16>]) -> Vec<u16> {
    match op {
        Op::Broadcast(root) => slots[root].clone(),
        Op::Gather => slots.concat(),
        Op::Sum => {
            let n = slots.first().map_or(0, Vec::len);
            (0..n)
                .map(|i| dtype.from_f32(slots.iter().map(|s| dtype.to_f32(s[i])).sum()))
                .collect()
        }
        Op::SumF32 => {
            let n = slots.first().map_or(0, Vec::len) / 2;
            (0..n)
                .flat_map(|i| {
                    let b = slots
                        .iter()
                        .map(|s| f32_of(&s[2 * i..2 * i + 2]))
                        .sum::<f32>()
                        .to_bits();
                    [b as u16, (b >> 16) as u16]
                })
                .collect()
        }
    }
}

/// The f32 carried as two 16-bit halves, low first.
fn f32_of(pair: &[u16]) -> f32 {
    f32::from_bits(u32::from(pair[0]) | (u32::from(pair[1]) << 16))
}

fn prefix<'a>(comm: &HostComm, buf: &'a mut CpuBuffer, elems: usize) -> Result<&'a mut [u16]> {
    let len = buf.data.len();
    buf.data
        .get_mut(..elems)
        .ok_or_else(|| comm.err(format!("a collective over {elems} elements of a buffer of {len}")))
}

impl Communicator<CpuBackend> for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, _b: &CpuBackend, buf: &mut CpuBuffer, elems: usize) -> Result<()> {
        let dtype = buf.dtype;
        self.all_reduce_bits(dtype, prefix(self, buf, elems)?)
    }

    /// The partial products stay in f32 through the sum and are rounded once, so the result
    /// is one device's up to the order of an f32 sum (issue #22 item 4: logits within 1e-3
    /// of `--tp 1`; 16-bit partials gave up to 5e-3 in bf16).
    fn row_parallel_gemm(
        &self,
        b: &CpuBackend,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &CpuBuffer,
        w: &CpuBuffer,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        let mut part = b.gemm_partial(spec, dims, x, w, y)?;
        self.all_reduce_f32(y.dtype, &mut part)?;
        b.narrow_partial(dims, &part, y)
    }

    fn broadcast(&self, _b: &CpuBackend, buf: &mut CpuBuffer, elems: usize, root: usize) -> Result<()> {
        let dtype = buf.dtype;
        self.broadcast_bits(dtype, prefix(self, buf, elems)?, root)
    }

    fn all_gather(&self, _b: &CpuBackend, src: &CpuBuffer, dst: &mut CpuBuffer, elems: usize) -> Result<()> {
        if src.dtype != dst.dtype {
            return Err(self.err(format!("an all-gather from {:?} into {:?}", src.dtype, dst.dtype)));
        }
        let mine = src.data.get(..elems).ok_or_else(|| {
            self.err(format!(
                "a collective over {elems} elements of a buffer of {}",
                src.data.len()
            ))
        })?;
        let dtype = dst.dtype;
        let world = self.shared.world;
        self.all_gather_bits(dtype, mine, prefix(self, dst, elems * world)?)
    }

    fn abort(&self, why: &str) {
        self.fail(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(world: usize, timeout: Duration, f: impl Fn(HostComm) -> T + Sync) -> Vec<T> {
        let comms = HostComm::group(world, timeout);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn the_sum_is_in_rank_order_in_f32_rounded_once_and_the_same_everywhere() {
        let dt = DType::F16;
        let outs = run(4, Duration::from_secs(10), |c| {
            let r = c.rank() as f32;
            // 2048 + 1 + 1 + 1: f16 rounding after each add would stay at 2048.
            let first = if c.rank() == 0 { 2048.0 } else { 1.0 };
            let mut bits = vec![dt.from_f32(first), dt.from_f32(r), dt.from_f32(-r)];
            for _ in 0..50 {
                let mut again = bits.clone();
                c.all_reduce_bits(dt, &mut again).expect("sum");
            }
            c.all_reduce_bits(dt, &mut bits).expect("sum");
            bits
        });
        for o in &outs {
            assert_eq!(o, &outs[0]);
        }
        assert_eq!(dt.to_f32(outs[0][0]), 2052.0);
        assert_eq!(dt.to_f32(outs[0][1]), 6.0);
        assert_eq!(dt.to_f32(outs[0][2]), -6.0);
    }

    #[test]
    fn a_broadcast_gives_every_rank_the_roots_data() {
        let dt = DType::Bf16;
        let outs = run(3, Duration::from_secs(10), |c| {
            let mut bits = vec![dt.from_f32(c.rank() as f32 + 0.5); 5];
            c.broadcast_bits(dt, &mut bits, 2).expect("broadcast");
            bits
        });
        assert!(outs.iter().all(|o| o.iter().all(|&b| dt.to_f32(b) == 2.5)));
    }

    #[test]
    fn an_all_gather_lays_the_ranks_out_in_order_on_every_rank() {
        let dt = DType::F16;
        let outs = run(3, Duration::from_secs(10), |c| {
            let r = c.rank() as f32;
            let mine = [dt.from_f32(r), dt.from_f32(10.0 + r)];
            let mut out = vec![0u16; 6];
            c.all_gather_bits(dt, &mine, &mut out).expect("gather");
            // A wrong output size is refused, not truncated.
            assert!(c.all_gather_bits(dt, &mine, &mut [0u16; 5]).is_err());
            out.iter().map(|&b| dt.to_f32(b)).collect::<Vec<f32>>()
        });
        for o in &outs {
            assert_eq!(o, &[0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number_and_nobody_hangs() {
        let t0 = Instant::now();
        let outs = run(3, Duration::from_millis(200), |c| {
            if c.rank() == 1 {
                return Ok(());
            }
            c.all_reduce_bits(DType::F16, &mut [0u16; 4])
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
        let errs: Vec<String> = outs
            .iter()
            .filter_map(|o| o.as_ref().err())
            .map(|e| e.to_string())
            .collect();
        assert_eq!(errs.len(), 2);
        assert!(errs.iter().any(|e| e.contains("rank(s) 1 did not reach")), "{errs:?}");
    }

    #[test]
    fn a_failed_rank_stops_every_other_rank_with_its_error() {
        let outs = run(4, Duration::from_secs(30), |c| {
            if c.rank() == 2 {
                c.fail("out of memory loading layer 3");
                return Err(c.err("out of memory loading layer 3".into()));
            }
            c.all_reduce_bits(DType::F16, &mut [0u16; 4])
        });
        for (r, o) in outs.iter().enumerate() {
            let e = o.as_ref().expect_err("every rank fails").to_string();
            assert!(e.contains("out of memory loading layer 3"), "rank {r}: {e}");
            if r != 2 {
                assert!(e.contains("rank 2 failed"), "{e}");
            }
        }
    }

    #[test]
    fn collectives_out_of_step_are_an_error_not_a_wrong_sum() {
        let outs = run(2, Duration::from_secs(30), |c| {
            let mut bits = vec![0u16; 2 + c.rank()];
            c.all_reduce_bits(DType::F16, &mut bits)
        });
        assert!(outs
            .iter()
            .all(|o| o.as_ref().is_err_and(|e| e.to_string().contains("out of step"))));
    }
}
