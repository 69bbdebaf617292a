//! The CPU backend's worker threads: how many, on which cores, and a fork-join loop whose
//! workers keep spinning between ops instead of sleeping (issue #21 item 5: "threads pinned and
//! sized from the cores").
//!
//! Why not rayon for the ops: a layer is ~10 parallel loops a few tens of microseconds to a few
//! milliseconds long, back to back. Rayon's idle workers sleep on a futex after ~33 yields (tens
//! of microseconds), so nearly every loop began by waking a sleeping thread and ended with the
//! caller asleep on its latch: 1,391 futex calls in one 128-token SmolLM2 prefill, and in this
//! KVM guest a wake-up lands late. The same binary with rayon's idle workers spinning for ~2 ms
//! first (an experiment on a patched rayon-core, not shipped) made 95 futex calls and
//! prefilled at ~571 tok/s against ~490 over 8 interleaved rounds (reports/NOTES.md, "CPU
//! engine, session 17"). Here the caller publishes a loop of `n` tasks, takes tasks itself,
//! then spins until the workers have finished theirs; a worker spins for [`SPIN`] after its
//! last task before it parks on a condition variable.
//!
//! Sizing: one thread per physical core of the CPUs this process may run on (SMT siblings
//! share a core's FMA pipes, and the GEMMs are FMA-bound), or `--set cpu_threads=N`. Pinning:
//! worker i stays on the i + 1-th of those cores, so that a GEMM task's widened W block stays
//! in its core's L1/L2 and the scheduler never stacks two workers on one core; the command's
//! own thread, which takes part in every loop, is left to the OS and settles on the core the
//! busy workers leave free (pinning it too made the threads it starts, the CPU tensor-parallel
//! ranks, inherit its one CPU; it measured no faster, NOTES). `--set cpu_pin=0` leaves all
//! placement to the OS; where more threads are asked for than CPUs allowed, nothing is pinned.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::run_config::{self, Key};

/// How long an idle worker spins for the next loop before it parks: longer than the serial
/// gaps between a layer's ops (a few to a few hundred microseconds), short enough that an
/// idle process stops burning a core at once.
const SPIN: Duration = Duration::from_millis(2);

/// Past this much waiting (a worker for the next loop, the caller for the workers' last
/// tasks), each check also yields the core: free, where nothing else wants it, and where
/// something does (an oversubscribed machine) the descheduled thread being waited for, or
/// another process, gets to run instead of a spinner.
const PURE_SPIN: Duration = Duration::from_micros(50);

/// One step of a wait that began at `start`: a pause, and past [`PURE_SPIN`] a yield every
/// 64th step (the clock is read once per 64).
#[inline]
fn backoff(start: Instant, spins: &mut u32) -> Duration {
    std::hint::spin_loop();
    *spins = spins.wrapping_add(1);
    if !spins.is_multiple_of(64) {
        return Duration::ZERO;
    }
    let waited = start.elapsed();
    if waited > PURE_SPIN {
        std::thread::yield_now();
    }
    waited
}

/// The threads the CPU ops run on and where they are pinned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Threads per parallel loop, the caller included (≥ 1).
    pub threads: usize,
    /// One CPU per thread when pinned: the first is left to the caller, the others each
    /// hold a worker.
    pub cpus: Option<Vec<usize>>,
    /// For the user: how the count was chosen and why placement is (not) pinned.
    pub why: String,
}

/// `threads` from `cpu_threads` (a positive count) or one per core of `allowed` (`core_of`
/// maps a CPU to its (package, core) where the OS says), pinned unless `pin` is false or more
/// threads are asked for than CPUs allowed.
fn plan_from(
    asked: Option<&str>,
    pin: bool,
    allowed: &[usize],
    core_of: impl Fn(usize) -> Option<(u32, u32)>,
) -> Result<Plan, String> {
    // One CPU per core first (the lowest-numbered sibling), then the other siblings.
    let mut firsts: Vec<usize> = Vec::new();
    let mut rest: Vec<usize> = Vec::new();
    let mut seen: Vec<(u32, u32)> = Vec::new();
    for &c in allowed {
        match core_of(c) {
            Some(id) if seen.contains(&id) => rest.push(c),
            Some(id) => {
                seen.push(id);
                firsts.push(c);
            }
            None => firsts.push(c),
        }
    }
    let cores = firsts.len().max(1);
    let (threads, how) = match asked {
        Some(v) => {
            let n: usize = v
                .trim()
                .parse()
                .ok()
                .filter(|n| (1..=MAX_THREADS).contains(n))
                .ok_or_else(|| format!("cpu_threads={v}: give a thread count from 1 to {MAX_THREADS} (--set cpu_threads=N or FDPP_CPU_THREADS)"))?;
            (n, "asked for")
        }
        None => (cores, "one per physical core"),
    };
    let order: Vec<usize> = firsts.iter().chain(&rest).copied().collect();
    let (cpus, placed) = if !pin {
        (None, "not pinned (cpu_pin=0)".to_string())
    } else if allowed.is_empty() {
        (
            None,
            "not pinned (the OS did not list the CPUs this process may use)".to_string(),
        )
    } else if threads > order.len() {
        (
            None,
            format!("not pinned ({threads} threads > {} CPUs allowed)", order.len()),
        )
    } else {
        let c = order[..threads].to_vec();
        let list = c[1..].iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",");
        let placed = match threads {
            1 => "no workers to pin".to_string(),
            2 => format!("the worker pinned to CPU {list}, the command's thread left to the OS"),
            _ => format!("workers pinned to CPUs {list}, the command's thread left to the OS"),
        };
        (Some(c), placed)
    };
    Ok(Plan {
        threads,
        cpus,
        why: format!(
            "{threads} threads ({how}; {cores} cores of {} CPUs allowed), {placed}",
            allowed.len()
        ),
    })
}

/// Upper bound of `cpu_threads` (a typo guard; no machine this runs on has more cores).
const MAX_THREADS: usize = 1024;

/// The CPUs this process may run on (sched_getaffinity), ascending; empty where unknown.
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most
        // size_of::<cpu_set_t>() bytes into it, and CPU_ISSET reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                return (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect();
            }
        }
    }
    Vec::new()
}

/// (package, core id) of a CPU from sysfs, where readable.
fn core_of(cpu: usize) -> Option<(u32, u32)> {
    let read = |f: &str| -> Option<u32> {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some((read("physical_package_id")?, read("core_id")?))
}

/// The plan of this process (from the run configuration, read once).
pub fn plan() -> Result<&'static Plan, String> {
    static PLAN: OnceLock<Result<Plan, String>> = OnceLock::new();
    PLAN.get_or_init(|| {
        let cfg = run_config::get();
        let pin = match cfg.get(Key::CpuPin).map(str::trim) {
            None | Some("1") => true,
            Some("0") => false,
            Some(v) => return Err(format!("cpu_pin={v}: give 1 or 0 (--set cpu_pin=0 or FDPP_CPU_PIN=0)")),
        };
        plan_from(cfg.get(Key::CpuThreads), pin, &allowed_cpus(), core_of)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The plan in words, for the backend line of a command's output.
pub fn describe() -> String {
    match plan() {
        Ok(p) => format!("CPU threads: {}", p.why),
        Err(e) => format!("CPU threads: 1 ({e})"),
    }
}

/// Threads per parallel loop (1 where the plan is refused: the command reports that itself).
pub fn threads() -> usize {
    plan().map(|p| p.threads).unwrap_or(1)
}

/// Pin the calling thread to `cpu` (best effort: placement is a hint to the OS).
fn pin(cpu: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: as in allowed_cpus; CPU_SET writes inside the set for cpu < CPU_SETSIZE.
    unsafe {
        if cpu < libc::CPU_SETSIZE as usize {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
}

/// Start the workers now, from the command's thread while nothing pins it: a thread starts on
/// its creator's CPUs, and one started from a thread pinned to a core that a real-time
/// spinner holds would never run to pin itself.
pub fn start_workers() {
    pool();
}

type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// One published loop. `f` is only called for an index claimed under this `epoch`, and the
/// caller returns only after all `n` claimed tasks have finished, so the pointer (whose
/// lifetime is erased) is never used after the closure is gone.
#[derive(Clone, Copy)]
struct Desc {
    epoch: u64,
    f: *const Task<'static>,
    n: usize,
}

// SAFETY: the closure behind `f` is Sync, and `Desc` only travels to threads that call it
// while the caller keeps it alive (see Desc).
unsafe impl Send for Desc {}

struct State {
    desc: Option<Desc>,
    sleepers: usize,
}

struct Shared {
    /// The last published epoch; workers spin on it.
    epoch: AtomicU64,
    state: Mutex<State>,
    wake: Condvar,
    /// The low 32 bits of the current epoch above the next unclaimed index.
    claim: AtomicU64,
    /// Tasks of the current loop finished (by anyone).
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    panicked: AtomicBool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held; poisoning would only mean that.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claim and run tasks of `d` until none is left.
    fn run_claims(&self, d: Desc) {
        let tag = (d.epoch & 0xffff_ffff) << 32;
        loop {
            let cur = self.claim.load(Ordering::Acquire);
            let i = (cur & 0xffff_ffff) as usize;
            if cur & !0xffff_ffff != tag || i >= d.n {
                return;
            }
            if self
                .claim
                .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: index i was claimed under d's epoch, so d's caller is still waiting for
            // it and its closure is alive (see Desc).
            let f = unsafe { &*d.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
                self.panicked.store(true, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Pool {
    shared: Arc<Shared>,
    /// Held by the caller of a loop: a second caller (another thread, or a task's own nested
    /// loop) runs its loop serially instead of waiting.
    busy: Mutex<()>,
    workers: usize,
}

fn worker(sh: Arc<Shared>, cpu: Option<usize>) {
    if let Some(c) = cpu {
        pin(c);
    }
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while sh.epoch.load(Ordering::Acquire) == seen {
            if backoff(start, &mut spins) > SPIN {
                let mut g = sh.state();
                while sh.epoch.load(Ordering::Acquire) == seen {
                    g.sleepers += 1;
                    g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                    g.sleepers -= 1;
                }
                break;
            }
        }
        let d = sh.state().desc;
        if let Some(d) = d {
            seen = d.epoch;
            sh.run_claims(d);
        }
    }
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let plan = plan().ok();
        let threads = plan.map(|p| p.threads).unwrap_or(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            state: Mutex::new(State {
                desc: None,
                sleepers: 0,
            }),
            wake: Condvar::new(),
            claim: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            panicked: AtomicBool::new(false),
        });
        let mut workers = 0;
        for w in 1..threads {
            let cpu = plan.and_then(|p| p.cpus.as_ref()).map(|c| c[w]);
            let sh = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("fdpp-cpu-{w}"))
                .spawn(move || worker(sh, cpu));
            // A thread the OS refuses only makes the loops narrower.
            if spawned.is_ok() {
                workers += 1;
            }
        }
        Pool {
            shared,
            busy: Mutex::new(()),
            workers,
        }
    })
}

/// `f(i)` for every i in 0..n, spread over the plan's threads; returns when all are done.
/// A panic in a task is raised again here once every task has finished.
pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let p = pool();
    if n <= 1 || p.workers == 0 || n > u32::MAX as usize {
        return serial(n, f);
    }
    let Ok(busy) = p.busy.try_lock() else {
        return serial(n, f);
    };
    let sh = &p.shared;
    // SAFETY: only the lifetime is erased; see Desc for why the pointer never outlives `f`.
    let fp: *const Task<'static> = unsafe { std::mem::transmute::<*const Task<'_>, *const Task<'static>>(f) };
    let d = {
        let mut g = sh.state();
        let epoch = sh.epoch.load(Ordering::Relaxed) + 1;
        let d = Desc { epoch, f: fp, n };
        g.desc = Some(d);
        sh.done.store(0, Ordering::Relaxed);
        sh.claim.store((epoch & 0xffff_ffff) << 32, Ordering::Release);
        sh.epoch.store(epoch, Ordering::Release);
        if g.sleepers > 0 {
            sh.wake.notify_all();
        }
        d
    };
    sh.run_claims(d);
    let start = Instant::now();
    let mut spins = 0u32;
    while sh.done.load(Ordering::Acquire) < n {
        backoff(start, &mut spins);
    }
    drop(busy);
    if sh.panicked.swap(false, Ordering::AcqRel) {
        let p = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        resume_unwind(p.unwrap_or_else(|| Box::new("a CPU kernel task panicked")));
    }
}

/// The loop on the calling thread alone, with the parallel loop's rule for panics: every task
/// runs, then the first panic is raised.
fn serial(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let mut first = None;
    for i in 0..n {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
            first.get_or_insert(p);
        }
    }
    if let Some(p) = first {
        resume_unwind(p);
    }
}

/// Tasks per thread of [`for_ranges`]: enough that a thread slowed down (by the OS, or by
/// the causal imbalance of attention's rows) leaves its last range to the others.
const RANGES_PER_THREAD: usize = 4;

/// `f(range)` for contiguous ranges covering 0..n (about [`RANGES_PER_THREAD`] per thread,
/// near-equal), in parallel: per-row ops group their rows so that a task is more than one
/// short row. n ≤ 1 runs on the caller.
pub fn for_ranges(n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let tasks = n.min(threads() * RANGES_PER_THREAD).max(1);
    for_each(tasks, &|t| f(t * n / tasks..(t + 1) * n / tasks));
}

/// `f(first, block)` for blocks of whole `width`-long rows of `data` (about
/// [`RANGES_PER_THREAD`] per thread; `first` the block's first row), in parallel: the safe
/// form of [`for_ranges`] where each row has one output.
pub fn for_row_blocks_mut<T: Send>(data: &mut [T], width: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let width = width.max(1);
    let all = Rows::new(data, width);
    let rows = all.rows;
    for_ranges(rows, |rs| {
        // SAFETY: the ranges are disjoint, so these rows are this task's alone.
        f(rs.start, unsafe { all.span(rs.start * width, rs.end * width) })
    });
}

/// A slice seen as rows of `width` that parallel tasks reach one row each.
pub struct Rows<'a, T> {
    ptr: *mut T,
    width: usize,
    rows: usize,
    _data: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: a task only reaches the rows `row`'s contract gives it alone.
unsafe impl<T: Send> Sync for Rows<'_, T> {}

impl<'a, T> Rows<'a, T> {
    /// `data` as ⌊len / width⌋ rows (width ≥ 1), borrowed mutably while this lives.
    pub fn new(data: &'a mut [T], width: usize) -> Self {
        let width = width.max(1);
        Rows {
            ptr: data.as_mut_ptr(),
            width,
            rows: data.len() / width,
            _data: std::marker::PhantomData,
        }
    }

    /// Row `r` (panics past the last row).
    ///
    /// # Safety
    /// No other reference to row `r` may be live: each row belongs to one task of a loop.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn row(&self, r: usize) -> &mut [T] {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        // SAFETY: row r lies inside the borrowed slice; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r * self.width), self.width) }
    }

    /// Elements a..z of the whole slice (panics past its rows).
    ///
    /// # Safety
    /// No other reference to any of them may be live.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn span(&self, a: usize, z: usize) -> &mut [T] {
        assert!(
            a <= z && z <= self.rows * self.width,
            "span {a}..{z} of {}",
            self.rows * self.width
        );
        // SAFETY: inside the borrowed slice; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(a), z - a) }
    }
}

/// `f(i, piece)` for the `chunk`-long pieces of `data` in order (the last may be shorter), one
/// task each, in parallel.
pub fn chunks_mut<T: Send>(data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, chunk) = (data.len(), chunk.max(1));
    let all = Rows::new(data, 1);
    for_each(len.div_ceil(chunk), &|i| {
        // SAFETY: piece i is task i's alone.
        f(i, unsafe { all.span(i * chunk, ((i + 1) * chunk).min(len)) })
    });
}

/// `[f(0), f(1), …, f(n − 1)]`, computed in parallel.
pub fn map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let slots = Rows::new(&mut out, 1);
    for_each(n, &|i| {
        // SAFETY: slot i is task i's alone.
        unsafe { slots.row(i)[0] = Some(f(i)) };
    });
    out.into_iter().map(|v| v.expect("every index runs once")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_takes_one_thread_per_core_and_pins_siblings_last() {
        // Two cores with two siblings each: CPUs 0/2 on core 0, 1/3 on core 1.
        let core = |c: usize| Some((0, (c % 2) as u32));
        let p = plan_from(None, true, &[0, 1, 2, 3], core).unwrap();
        assert_eq!((p.threads, p.cpus.clone()), (2, Some(vec![0, 1])), "{}", p.why);
        let p = plan_from(Some("3"), true, &[0, 1, 2, 3], core).unwrap();
        assert_eq!(p.cpus, Some(vec![0, 1, 2]), "{}", p.why);
        let p = plan_from(Some("5"), true, &[0, 1, 2, 3], core).unwrap();
        assert_eq!((p.threads, p.cpus.clone()), (5, None));
        assert!(p.why.contains("5 threads > 4 CPUs"), "{}", p.why);
        let p = plan_from(None, false, &[0, 1, 2, 3], core).unwrap();
        assert!(p.cpus.is_none() && p.why.contains("cpu_pin=0"), "{}", p.why);
        // Unknown topology: each CPU its own core; unknown CPU set: one thread, unpinned.
        let p = plan_from(None, true, &[4, 7], |_| None).unwrap();
        assert_eq!((p.threads, p.cpus.clone()), (2, Some(vec![4, 7])));
        let p = plan_from(None, true, &[], |_| None).unwrap();
        assert_eq!((p.threads, p.cpus.clone()), (1, None));
    }

    #[test]
    fn plan_refuses_counts_that_make_no_sense() {
        for bad in ["0", "-1", "two", "", "100000"] {
            let e = plan_from(Some(bad), true, &[0, 1], |_| None).unwrap_err();
            assert!(e.contains("cpu_threads") && e.contains("1 to 1024"), "{bad}: {e}");
        }
    }

    #[test]
    fn every_index_runs_exactly_once_from_many_callers() {
        // Callers from several threads at once (one holds the pool, the others run serially)
        // and loops of every small size: each index is seen exactly once.
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for n in 0..200usize {
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        for_each(n, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "caller {t}, n {n}");
                    }
                });
            }
        });
    }

    #[test]
    fn ranges_rows_and_map_cover_the_data_and_nested_loops_run() {
        for n in [0usize, 1, 2, 7, 8, 9, 1001] {
            let mut v = vec![usize::MAX; n * 3];
            let rows = Rows::new(&mut v, 3);
            for_ranges(n, |rs| {
                // A nested loop inside a task runs serially on the task's thread.
                let inner = map(3, |j| j + 1);
                for r in rs {
                    // SAFETY: the ranges are disjoint.
                    let row = unsafe { rows.row(r) };
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = r * 3 + j + inner.iter().sum::<usize>() - 6;
                    }
                }
            });
            assert!(v.iter().enumerate().all(|(i, &x)| x == i), "n {n}");
        }
        for (n, w) in [(0usize, 3usize), (1, 1), (9, 2), (1001, 5)] {
            let mut v = vec![usize::MAX; n * w];
            for_row_blocks_mut(&mut v, w, |r0, block| {
                for (r, row) in (r0..).zip(block.chunks_exact_mut(w)) {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = r * w + j;
                    }
                }
            });
            assert!(v.iter().enumerate().all(|(i, &x)| x == i), "n {n} w {w}");
        }
        assert_eq!(map(50, |i| i * i), (0..50).map(|i| i * i).collect::<Vec<_>>());
    }

    #[test]
    fn a_panicking_task_is_raised_in_the_caller_after_the_others_finish() {
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each(64, &|i| {
                ran.fetch_add(1, Ordering::Relaxed);
                if i == 17 {
                    panic!("task 17");
                }
            })
        }));
        let msg = r.unwrap_err();
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 17"));
        assert_eq!(ran.load(Ordering::Relaxed), 64);
        // The pool still works.
        assert_eq!(map(10, |i| i).len(), 10);
    }
}
