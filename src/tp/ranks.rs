//! One thread per rank, in one process (FlashDecoding++Next and Megatron run one process per
//! GPU; threads keep fdpp one binary with no launcher). Each rank builds its own backend and
//! engine inside its thread and runs the same program; the collectives keep them in lockstep.
//!
//! A rank that fails (an error or a panic) aborts its group, so the others, waiting in a
//! collective or reaching the next one, stop too; the caller gets the first failure, not the
//! others' "stopped because rank r failed".

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use crate::error::{FdppError, Result};

/// Whether `e` only reports another rank's failure.
fn is_echo(e: &FdppError) -> bool {
    matches!(e, FdppError::Collective { msg, .. } if msg.starts_with("stopped because rank"))
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Run `f(rank)` for ranks 0..world, each on its own thread. A failing rank calls
/// `abort(rank, why)` (which must wake its peers: [`crate::tp::Communicator::abort`]). Returns
/// every rank's value in rank order, or the first failure.
pub fn run_ranks<T: Send>(
    world: usize,
    abort: &(dyn Fn(usize, &str) + Sync),
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let failures: Mutex<Vec<FdppError>> = Mutex::new(Vec::new());
    let outs: Vec<Option<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, failures) = (&f, &failures);
                std::thread::Builder::new()
                    .name(format!("fdpp-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let res = catch_unwind(AssertUnwindSafe(|| f(rank))).unwrap_or_else(|p| {
                            Err(FdppError::Collective {
                                rank,
                                msg: format!("panicked: {}", panic_text(p.as_ref())),
                            })
                        });
                        match res {
                            Ok(v) => Some(v),
                            Err(e) => {
                                let why = e.to_string();
                                failures.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                                abort(rank, &why);
                                None
                            }
                        }
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().ok().flatten(),
                Err(e) => {
                    failures
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(FdppError::InvalidArgument(format!("cannot start a rank thread: {e}")));
                    abort(0, "a rank thread did not start");
                    None
                }
            })
            .collect()
    });
    let mut failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = failures
        .iter()
        .position(|e| !is_echo(e))
        .or((!failures.is_empty()).then_some(0))
    {
        return Err(failures.swap_remove(i));
    }
    outs.into_iter()
        .enumerate()
        .map(|(rank, o)| {
            o.ok_or_else(|| FdppError::Collective {
                rank,
                msg: "ended without a result".into(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::tp::HostComm;
    use std::time::Duration;

    #[test]
    fn the_first_failure_is_returned_and_no_rank_hangs() {
        let comms = HostComm::group(3, Duration::from_secs(30));
        let abort = |r: usize, why: &str| comms[r].fail(why);
        let res = run_ranks(3, &abort, |rank| {
            if rank == 1 {
                return Err(FdppError::InvalidArgument("rank 1 cannot load its weights".into()));
            }
            comms[rank].all_reduce_bits(DType::F16, &mut [0u16; 8])?;
            Ok(rank)
        });
        let e = res.expect_err("a rank failed").to_string();
        assert!(
            e.contains("rank 1 cannot load") && !e.contains("stopped because"),
            "{e}"
        );
        // A panic is a failure like any other.
        let comms = HostComm::group(2, Duration::from_secs(30));
        let abort = |r: usize, why: &str| comms[r].fail(why);
        let res: Result<Vec<()>> = run_ranks(2, &abort, |rank| {
            if rank == 0 {
                panic!("boom in rank 0");
            }
            comms[rank].all_reduce_bits(DType::F16, &mut [0u16; 8])
        });
        let e = res.expect_err("a rank panicked").to_string();
        assert!(e.contains("panicked: boom in rank 0"), "{e}");
        let ok = run_ranks(2, &|_, _| {}, Ok).expect("no failure");
        assert_eq!(ok, vec![0, 1]);
    }
}
