//! The activation buffers of the memory plan, allocated on the backend, and borrowed by slot
//! index: several slots name the same buffer when the plan reuses buffers, so borrows are
//! checked to be disjoint at run time (the plan guarantees that no op reads the buffer it
//! writes; a violation is an error, never aliasing).

use crate::backend::Backend;
use crate::dtype::DType;
use crate::engine::memory::ActPlan;
use crate::error::{FdppError, Result};

pub struct Activations<Buf> {
    pub plan: ActPlan,
    bufs: Vec<Buf>,
}

impl<Buf> Activations<Buf> {
    pub fn new<B: Backend<Buffer = Buf>>(b: &B, plan: ActPlan, dtype: DType) -> Result<Self> {
        let bufs = plan
            .buffers
            .iter()
            .map(|a| b.alloc(dtype, a.elems))
            .collect::<Result<Vec<_>>>()?;
        Ok(Activations { plan, bufs })
    }

    pub fn get(&self, slot: usize) -> &Buf {
        &self.bufs[slot]
    }

    pub fn get_mut(&mut self, slot: usize) -> &mut Buf {
        &mut self.bufs[slot]
    }

    /// N distinct buffers at once, for an op that reads some and writes others.
    pub fn many<const N: usize>(&mut self, slots: [usize; N]) -> Result<[&mut Buf; N]> {
        let plan = &self.plan;
        self.bufs.get_disjoint_mut(slots).map_err(|_| {
            let names: Vec<&str> = slots
                .iter()
                .filter_map(|&s| plan.buffers.get(s).map(|b| b.name.as_str()))
                .collect();
            FdppError::InvalidArgument(format!(
                "internal: activation slots {slots:?} ({}) overlap or are out of range",
                names.join(", ")
            ))
        })
    }
}
