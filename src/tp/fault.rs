//! A rank that fails on purpose (`--set tp_fail_at=RANK:N`): the check that a failure in one
//! rank stops every rank with that rank's error, on the real communicator (NCCL included),
//! instead of leaving the others waiting in a collective. Tests use it on the CPU.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::comm::Communicator;
use crate::backend::Backend;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};

/// Which rank fails, and before which of its collectives (0 = the first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailAt {
    pub rank: usize,
    pub call: usize,
}

impl FailAt {
    /// `RANK:N`, as `--set tp_fail_at` takes it.
    pub fn parse(text: &str) -> Result<FailAt> {
        let bad = || {
            FdppError::InvalidArgument(format!(
                "tp_fail_at={text}: expected RANK:N (rank RANK fails at its N-th collective, counted from 0)"
            ))
        };
        let (r, n) = text.split_once(':').ok_or_else(bad)?;
        Ok(FailAt {
            rank: r.trim().parse().map_err(|_| bad())?,
            call: n.trim().parse().map_err(|_| bad())?,
        })
    }
}

/// `inner`, except that rank `at.rank` returns an error at its `at.call`-th collective, as a
/// device fault there would.
pub struct Failing<B: Backend> {
    inner: Arc<dyn Communicator<B>>,
    at: FailAt,
    calls: AtomicUsize,
}

impl<B: Backend> Failing<B> {
    pub fn new(inner: Arc<dyn Communicator<B>>, at: FailAt) -> Self {
        Failing {
            inner,
            at,
            calls: AtomicUsize::new(0),
        }
    }

    fn tick(&self) -> Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if self.inner.rank() == self.at.rank && n == self.at.call {
            return Err(FdppError::Collective {
                rank: self.at.rank,
                msg: format!("injected failure at collective {n} (tp_fail_at)"),
            });
        }
        Ok(())
    }
}

impl<B: Backend> Communicator<B> for Failing<B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn all_reduce_sum(&self, b: &B, buf: &mut B::Buffer, elems: usize) -> Result<()> {
        self.tick()?;
        self.inner.all_reduce_sum(b, buf, elems)
    }

    fn row_parallel_gemm(
        &self,
        b: &B,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &B::Buffer,
        w: &B::Buffer,
        y: &mut B::Buffer,
    ) -> Result<()> {
        self.tick()?;
        self.inner.row_parallel_gemm(b, spec, dims, x, w, y)
    }

    fn broadcast(&self, b: &B, buf: &mut B::Buffer, elems: usize, root: usize) -> Result<()> {
        self.tick()?;
        self.inner.broadcast(b, buf, elems, root)
    }

    fn all_gather(&self, b: &B, src: &B::Buffer, dst: &mut B::Buffer, elems: usize) -> Result<()> {
        self.tick()?;
        self.inner.all_gather(b, src, dst, elems)
    }

    fn abort(&self, why: &str) {
        self.inner.abort(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_reads_rank_and_call_and_refuses_anything_else() {
        assert_eq!(FailAt::parse("1:40").unwrap(), FailAt { rank: 1, call: 40 });
        for bad in ["1", "a:2", "1:-3", ""] {
            let e = FailAt::parse(bad).unwrap_err().to_string();
            assert!(e.contains("expected RANK:N"), "{bad}: {e}");
        }
    }
}
