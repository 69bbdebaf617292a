//! `FDPP_OP_TIMES=1`: the forward waits for the device after every op and adds the op's wall
//! time to a per-op total, which `fdpp generate` prints at the end. A diagnostic, not a
//! benchmark: the waits add a host round trip per op and hide the launch overlap of a normal
//! run, so the totals tell where device time goes, not what a step costs.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

use crate::backend::Backend;
use crate::error::Result;

/// (step kind, op).
type StepOp = (&'static str, &'static str);

pub struct OpTimes {
    last: Option<RefCell<Instant>>,
    /// The step kind the following laps belong to ("prefill" or "decode").
    tag: std::cell::Cell<&'static str>,
    totals: RefCell<BTreeMap<StepOp, (f64, usize)>>,
}

impl OpTimes {
    /// On when `FDPP_OP_TIMES` is set to anything but `0`.
    pub fn from_env() -> Self {
        let on = crate::run_config::get().set_on(crate::run_config::Key::OpTimes);
        OpTimes {
            last: on.then(|| RefCell::new(Instant::now())),
            tag: std::cell::Cell::new(""),
            totals: RefCell::default(),
        }
    }

    /// Whether per-op timing is on (it waits after every op).
    pub fn on(&self) -> bool {
        self.last.is_some()
    }

    /// Start of a step of kind `tag`: the device is idle, the clock restarts.
    pub fn start<B: Backend>(&self, b: &B, tag: &'static str) -> Result<()> {
        self.tag.set(tag);
        if let Some(last) = &self.last {
            b.synchronize()?;
            *last.borrow_mut() = Instant::now();
        }
        Ok(())
    }

    /// The op just queued is `name`: wait for it and add its time.
    pub fn lap<B: Backend>(&self, b: &B, name: &'static str) -> Result<()> {
        if let Some(last) = &self.last {
            b.synchronize()?;
            let now = Instant::now();
            let ms = now.duration_since(*last.borrow()).as_secs_f64() * 1e3;
            *last.borrow_mut() = now;
            let mut t = self.totals.borrow_mut();
            let e = t.entry((self.tag.get(), name)).or_insert((0.0, 0));
            e.0 += ms;
            e.1 += 1;
        }
        Ok(())
    }

    /// ("step kind/op", total ms, calls), by step kind then largest total first; empty when off.
    pub fn report(&self) -> Vec<(String, f64, usize)> {
        let mut v: Vec<_> = self
            .totals
            .borrow()
            .iter()
            .map(|(&(tag, op), &(ms, n))| (tag, op, ms, n))
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0).then(b.2.total_cmp(&a.2)));
        let v = v
            .into_iter()
            .map(|(tag, op, ms, n)| (format!("{tag}/{op}"), ms, n))
            .collect();
        v
    }
}
