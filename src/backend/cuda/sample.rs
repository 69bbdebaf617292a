//! Greedy choice on the device (kernels_cuda/sample.cu): a decode step reads back one index per
//! sequence instead of its vocab_size logits.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::launch::Launch;
use super::{drv, sources, CudaBackend, CudaBuffer};
use crate::backend::{check_argmax_dims, nan_logit, DeviceBuffer};
use crate::error::{FdppError, Result};

/// What the kernel writes for a row that holds a NaN.
const NAN_ROW: u32 = u32::MAX;

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
    let counted = super::attention::stage_running_count(b, &mut out.slice_mut(rows..rows + 1))?;
    let mut ids = b
        .stream()
        .clone_dtoh(&out.slice(..rows + 1))
        .map_err(drv("downloading argmax indices"))?;
    let total = ids.pop().unwrap_or(0) as usize;
    if counted {
        b.fetched_recomputed
            .set(Some(b.fetched_recomputed.get().unwrap_or(0) + total));
    }
    match ids.iter().position(|&i| i == NAN_ROW || i as usize >= width) {
        Some(r) if ids[r] == NAN_ROW => Err(nan_logit(r, None)),
        Some(r) => Err(FdppError::device(
            "cuda",
            format!("argmax_rows: row {r} chose {} of {width} logits", ids[r]),
        )),
        None => Ok(ids),
    }
}
