//! Greedy choice on the device (kernels_cuda/sample.cu): a decode step reads back one index per
//! sequence instead of its vocab_size logits.
//!
//! Two ways to read them: `argmax_rows` waits for them; `greedy_enqueue` only starts their copy
//! into pinned host memory and leaves them on the device, where the next step's embedding reads
//! them (`embedding_fed`), so that the host queues step n + 1 before it reads step n's choice and
//! the device never waits for the host between steps. `greedy_take` then reads the oldest.

use std::collections::VecDeque;

use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PinnedHostSlice};

use super::launch::Launch;
use super::{drv, sources, CudaBackend, CudaBuffer};
use crate::backend::{check_argmax_dims, nan_logit, DeviceBuffer};
use crate::error::{FdppError, Result};

/// What the kernel writes for a row that holds a NaN.
const NAN_ROW: u32 = u32::MAX;

/// Launch the argmax of `rows` rows into `slot` (grown as needed), with the running recompute
/// total staged at entry `rows`; returns whether a total was staged.
fn launch_argmax(
    b: &CudaBackend,
    slot: &mut Option<CudaSlice<u32>>,
    logits: &CudaBuffer,
    rows: usize,
    width: usize,
) -> Result<bool> {
    let w = i32::try_from(width)
        .map_err(|_| FdppError::InvalidArgument(format!("argmax_rows: width {width} is over i32")))?;
    let grid =
        u32::try_from(rows).map_err(|_| FdppError::InvalidArgument(format!("argmax_rows: {rows} rows is over u32")))?;
    let dt = logits.dtype();
    let uri = format!("sample_{dt}");
    let f = b.function_of(&uri, "argmax_rows", 0, || Ok(sources::sample_source(dt)))?;
    // One entry past the rows: the step's recompute total rides along with the indices.
    if slot.as_ref().is_none_or(|s| s.len() < rows + 1) {
        // SAFETY: the kernel writes every one of the first `rows` entries, and the counter copy
        // entry `rows`, before they are read.
        *slot =
            Some(unsafe { b.stream().alloc::<u32>((rows + 1).next_power_of_two()) }.map_err(drv("argmax scratch"))?);
    }
    let out = slot
        .as_mut()
        .ok_or_else(|| FdppError::device("cuda", "argmax scratch missing"))?;
    let (lp, op) = (b.ptr(logits), {
        use cudarc::driver::DevicePtr;
        let (p, _sync) = out.device_ptr(b.stream());
        p
    });
    let mut l = Launch::chained(b, &f);
    l.arg(&lp).arg(&op).arg(&w);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: check_argmax_dims bounds rows × width by the buffer; out holds ≥ rows entries.
    unsafe { l.launch(cfg) }.map_err(drv("launch argmax_rows"))?;
    b.check_launch("argmax_rows")?;
    // The running recompute total is read with the indices (one device-to-host copy and one
    // host wait per step instead of two: take_recomputed then returns it).
    super::attention::stage_running_count(b, &mut out.slice_mut(rows..rows + 1))
}

/// The indices read back (`rows` of them, then the staged total): the total goes to the
/// backend's fetched count, and a NaN row or an index past the row is an error.
fn finish(b: &CudaBackend, read: &[u32], rows: usize, width: usize, counted: bool) -> Result<Vec<u32>> {
    let ids = &read[..rows];
    if counted {
        let total = read[rows] as usize;
        b.fetched_recomputed
            .set(Some(b.fetched_recomputed.get().unwrap_or(0) + total));
    }
    match ids.iter().position(|&i| i == NAN_ROW || i as usize >= width) {
        Some(r) if ids[r] == NAN_ROW => Err(nan_logit(r, None)),
        Some(r) => Err(FdppError::device(
            "cuda",
            format!("argmax_rows: row {r} chose {} of {width} logits", ids[r]),
        )),
        None => Ok(ids.to_vec()),
    }
}

pub fn argmax_rows(
    b: &CudaBackend,
    slot: &mut Option<CudaSlice<u32>>,
    logits: &CudaBuffer,
    rows: usize,
    width: usize,
) -> Result<Vec<u32>> {
    check_argmax_dims(logits.len(), rows, width)?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let counted = launch_argmax(b, slot, logits, rows, width)?;
    let out = slot
        .as_ref()
        .ok_or_else(|| FdppError::device("cuda", "argmax scratch missing"))?;
    let read = b
        .stream()
        .clone_dtoh(&out.slice(..rows + 1))
        .map_err(drv("downloading argmax indices"))?;
    finish(b, &read, rows, width, counted)
}

/// A greedy choice whose copy to the host was started and not yet read.
struct Pending {
    host: PinnedHostSlice<u32>,
    /// Recorded after the copy. (The slice's own event is not: the backend turns cudarc's event
    /// tracking off, mod.rs.)
    copied: CudaEvent,
    rows: usize,
    width: usize,
    counted: bool,
}

/// The queued greedy choices (oldest first), pinned buffers to reuse, and how many rows the
/// device indices of the newest choice hold (what `embedding_fed` may read).
#[derive(Default)]
pub struct Greedy {
    pending: VecDeque<Pending>,
    spare: Vec<(PinnedHostSlice<u32>, CudaEvent)>,
    fed_rows: Option<usize>,
}

impl Greedy {
    /// The device indices no longer hold the newest queued choice.
    pub fn unfeed(&mut self) {
        self.fed_rows = None;
    }
}

pub fn greedy_enqueue(
    b: &CudaBackend,
    slot: &mut Option<CudaSlice<u32>>,
    q: &mut Greedy,
    logits: &CudaBuffer,
    rows: usize,
    width: usize,
) -> Result<()> {
    check_argmax_dims(logits.len(), rows, width)?;
    if rows == 0 {
        return Err(FdppError::InvalidArgument("greedy_enqueue: a step with no rows".into()));
    }
    let counted = launch_argmax(b, slot, logits, rows, width)?;
    let out = slot
        .as_ref()
        .ok_or_else(|| FdppError::device("cuda", "argmax scratch missing"))?;
    // Exactly rows + 1 entries: a copy into pinned memory fills the whole destination.
    let (mut host, copied) = match q.spare.iter().position(|(h, _)| h.len() == rows + 1) {
        Some(i) => q.spare.swap_remove(i),
        None => (
            // Cached (not write-combined) pinned memory: the host reads it.
            // SAFETY: the copy below fills every entry before any is read.
            unsafe { b.context().alloc_pinned_with_flags::<u32>(rows + 1, 0) }
                .map_err(drv("pinned memory for the greedy choice"))?,
            b.context()
                .new_event(None)
                .map_err(drv("an event for the greedy choice"))?,
        ),
    };
    // Asynchronous: the destination is pinned.
    b.stream()
        .memcpy_dtoh(&out.slice(..rows + 1), &mut host)
        .map_err(drv("copying argmax indices"))?;
    copied.record(b.stream()).map_err(drv("recording the greedy copy"))?;
    q.pending.push_back(Pending {
        host,
        copied,
        rows,
        width,
        counted,
    });
    q.fed_rows = Some(rows);
    Ok(())
}

pub fn greedy_take(b: &CudaBackend, q: &mut Greedy) -> Result<Vec<u32>> {
    let p = q
        .pending
        .pop_front()
        .ok_or_else(|| FdppError::InvalidArgument("greedy_take: no greedy choice is queued".into()))?;
    p.copied.synchronize().map_err(drv("waiting for the greedy choice"))?;
    let read = p.host.as_slice().map_err(drv("reading the greedy choice"))?;
    let ids = finish(b, read, p.rows, p.width, p.counted);
    // A few buffers serve every batch size a run meets.
    if q.spare.len() < 8 {
        q.spare.push((p.host, p.copied));
    }
    if ids.is_err() {
        // A failed choice ends the pipeline: the device indices are not tokens.
        q.fed_rows = None;
    }
    ids
}

/// The device address of the newest queued choice's indices, for `rows` rows.
pub fn fed_ids(b: &CudaBackend, slot: &Option<CudaSlice<u32>>, q: &Greedy, rows: usize) -> Result<u64> {
    match (q.fed_rows, slot.as_ref()) {
        (Some(n), Some(s)) if n == rows => {
            use cudarc::driver::DevicePtr;
            let (p, _sync) = s.device_ptr(b.stream());
            Ok(p)
        }
        (n, _) => Err(FdppError::InvalidArgument(format!(
            "embedding_fed: {rows} rows asked for, but the newest queued greedy choice holds {}",
            n.map_or("none".to_string(), |n| n.to_string())
        ))),
    }
}
