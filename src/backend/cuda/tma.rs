//! TMA tensor maps over the paged KV pool, for the Hopper prefill's producer
//! (kernels_cuda/attn_prefill_hopper.cu, `produce`), and over a prefill step's query rows (the
//! block's Q tile, `load_q_tma`).
//!
//! The pool holds K (or V) as [slots][kv heads][head_dim] 16-bit values, slot = page ·
//! page_size + offset. One 5-D map covers all of it; a box is every 64-column block of `rows`
//! slots of one kv head (one page, or the 128-key tile when pages are larger), landing as the
//! kernel's 8-row atoms of 128-byte lines with the 128-byte swizzle that the wgmma descriptors
//! read (`encode`). Where pages are smaller than
//! the tile, a second pair of maps boxes a whole tile (128 slots): the kernel takes it for a tile
//! whose pages lie one after another in the pool (a prompt's pages from a fresh allocator do),
//! one box instead of one per page. The kernel reads the maps from its
//! parameters (by value, `__grid_constant__`).

use cudarc::driver::{sys, DeviceRepr};

use crate::error::{FdppError, Result};
use crate::kv::PagedKvLayout;

/// Keys of the kernel's tile (attn_prefill_hopper.cu's BN).
const TILE_KEYS: usize = 128;
/// Query rows of the kernel's block (attn_prefill_hopper.cu's BM).
const QUERY_ROWS: usize = 128;
/// Columns of a box: 128 bytes of 16-bit values, the span of the 128-byte swizzle.
const BOX_COLS: u32 = 64;

/// A CUtensorMap as a kernel argument (the kernel's `TmaMap`: 128 bytes, 64-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TmaMap([u64; 16]);

impl TmaMap {
    /// A map the kernel is told not to read.
    pub const NONE: TmaMap = TmaMap([0; 16]);
}

// SAFETY: plain bytes with the layout of the kernel's parameter type.
unsafe impl DeviceRepr for TmaMap {}

/// The K and V maps and the rows of a box; `rows == 0` tells the kernel to load every tile with
/// cp.async (the maps are then zeros and never read). `k_run` and `v_run` box a whole tile of
/// consecutive slots; they are encoded for a schedule with run boxes when `0 < rows < 128` (else
/// zeros, never read: with pages of 128 slots or more `k` and `v` already box a tile).
pub struct PoolMaps {
    pub k: TmaMap,
    pub v: TmaMap,
    pub rows: i32,
    pub k_run: TmaMap,
    pub v_run: TmaMap,
    /// Whether `k_run` and `v_run` are encoded (the kernel may then take a tile of consecutive
    /// pages as one box).
    pub runs: bool,
}

/// Rows of a TMA box for this page size, or None where a box cannot hold a whole run of a tile's
/// keys: a tile of 128 keys must split into whole pages (page_size divides 128) or lie inside
/// one (128 divides page_size), and a box of fewer than 8 rows would break the swizzle's
/// 1024-byte atoms.
pub fn box_rows(page_size: usize) -> Option<usize> {
    let rows = page_size.min(TILE_KEYS);
    let whole = TILE_KEYS.is_multiple_of(page_size) || page_size.is_multiple_of(TILE_KEYS);
    (whole && rows >= 8).then_some(rows)
}

impl PoolMaps {
    /// cp.async for every tile.
    pub fn off() -> Self {
        PoolMaps {
            k: TmaMap::NONE,
            v: TmaMap::NONE,
            rows: 0,
            k_run: TmaMap::NONE,
            v_run: TmaMap::NONE,
            runs: false,
        }
    }

    /// Maps over the K and V pools at device addresses `k` and `v`, or [`PoolMaps::off`] when the
    /// page size does not box or `FDPP_HOPPER_TMA=0` asks for cp.async (A/B measurements).
    /// `runs`: the kernel's schedule takes a tile of consecutive pages as one box (the run maps
    /// are encoded only then: two driver calls per prefill step saved elsewhere).
    pub fn new(layout: &PagedKvLayout, k: u64, v: u64, runs: bool) -> Result<Self> {
        let rows = match box_rows(layout.page_size) {
            Some(r) if tma_wanted()? => r,
            _ => return Ok(PoolMaps::off()),
        };
        // (A pool of fewer slots than a tile has no whole tile to box.)
        let runs = runs && rows < TILE_KEYS && layout.num_pages * layout.page_size >= TILE_KEYS;
        let (k_run, v_run) = if runs {
            (encode(layout, k, TILE_KEYS, "K")?, encode(layout, v, TILE_KEYS, "V")?)
        } else {
            (TmaMap::NONE, TmaMap::NONE)
        };
        Ok(PoolMaps {
            k: encode(layout, k, rows, "K")?,
            v: encode(layout, v, rows, "V")?,
            rows: rows as i32,
            k_run,
            v_run,
            runs,
        })
    }
}

/// `--set hopper_tma=0|1` or `FDPP_HOPPER_TMA` (default 1).
fn tma_wanted() -> Result<bool> {
    switch_01(crate::run_config::Key::HopperTma, "FDPP_HOPPER_TMA")
}

/// `--set hopper_q_tma=0|1` or `FDPP_HOPPER_Q_TMA` (default 1): whether thread 0 requests the
/// block's query rows with TMA ([`query_map`]), where its consumer threads otherwise copy them
/// with cp.async.
pub fn q_tma_wanted() -> Result<bool> {
    switch_01(crate::run_config::Key::HopperQTma, "FDPP_HOPPER_Q_TMA")
}

/// A 0|1 switch that defaults to 1; any other value is an error naming the switch.
fn switch_01(key: crate::run_config::Key, name: &str) -> Result<bool> {
    match crate::run_config::get().get(key).map(str::trim) {
        None | Some("") | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(o) => Err(FdppError::InvalidArgument(format!("{name}={o}: expected 0 or 1"))),
    }
}

/// A map over the query rows of a prefill step, [tokens][heads][head_dim] 16-bit values at `q`:
/// a box is 64 columns × 1 head × 128 rows (the kernel's query tile, BM), swizzled as the pool's
/// boxes; rows past `tokens` read as zeros.
pub fn query_map(q: u64, tokens: usize, heads: usize, head_dim: usize) -> Result<TmaMap> {
    if tokens == 0 {
        // No rows, no block to read it (the driver refuses an empty dimension).
        return Ok(TmaMap::NONE);
    }
    encode_rows(q, head_dim, heads, tokens, QUERY_ROWS, "the query rows")
}

/// The pool's 5-D map: dims (innermost first) 64 columns, 8 slots (the slot stride), head_dim/64
/// column blocks (128 bytes), kv heads (head_dim · 2 bytes), groups of 8 slots; a box is every
/// column block of `rows` slots of one kv head, landing as the kernel's K/V layout (`kv_at`:
/// 8-row atoms of 1024 bytes, a group's column blocks side by side), so that a page of 16 slots
/// is one box where it was one per column block (reports/NOTES.md, session 37). The kernel's
/// coordinates are (0, 0, 0, kv head, slot / 8).
fn encode(l: &PagedKvLayout, base: u64, rows: usize, what: &str) -> Result<TmaMap> {
    let spec = || format!("tma map of the {what} pool");
    let (d, heads, slots) = (
        l.head_dim as u64,
        l.num_kv_heads as u64,
        (l.num_pages * l.page_size) as u64,
    );
    if !d.is_multiple_of(BOX_COLS as u64) || !slots.is_multiple_of(8) || !rows.is_multiple_of(8) {
        return Err(FdppError::Unsupported {
            spec: spec(),
            what: format!(
                "head_dim {d} and {slots} slots in boxes of {rows} (multiples of {BOX_COLS}, 8 and 8 are needed)"
            ),
        });
    }
    let slot_stride = heads * d * 2;
    encode_tiled(
        base,
        [BOX_COLS as u64, 8, d / BOX_COLS as u64, heads, slots / 8],
        &[slot_stride, 128, d * 2, 8 * slot_stride],
        [BOX_COLS, 8, (d / BOX_COLS as u64) as u32, 1, (rows / 8) as u32],
        &spec(),
    )
}

/// A map over `n` rows of `heads` × `d` 16-bit values at `base`, boxes of 64 columns × 1 head ×
/// `rows` rows with the 128-byte swizzle.
fn encode_rows(base: u64, d: usize, heads: usize, n: usize, rows: usize, what: &str) -> Result<TmaMap> {
    let spec = || format!("tma map of {what}");
    let d = d as u64;
    if !d.is_multiple_of(BOX_COLS as u64) {
        return Err(FdppError::Unsupported {
            spec: spec(),
            what: format!("head_dim {d} (a multiple of {BOX_COLS} is needed)"),
        });
    }
    // Byte strides of dims 1 and 2 (dim 0 is contiguous).
    let strides = [d * 2, heads as u64 * d * 2];
    encode_tiled(
        base,
        [d, heads as u64, n as u64],
        &strides,
        [BOX_COLS, 1, rows as u32],
        &spec(),
    )
}

/// A 2-D map over a row-major [rows, cols] matrix of 16-bit values at `base` (cols a multiple of
/// 8: rows start on 16-byte boundaries), boxes of `box_cols` × `box_rows`: 64 columns with the
/// 128-byte swizzle (one 128-byte row), or 32 with the 64-byte swizzle (the staging chunks of a
/// tile whose output width is not a multiple of 64: the SwiGLU tile's 96 columns) — fdpp's
/// Hopper GEMM (gemm_hopper.rs, gemm_epi.rs). Boxes past the edges read as zeros and store
/// nothing there.
pub fn matrix_map(base: u64, rows: usize, cols: usize, box_rows: u32, box_cols: u32, what: &str) -> Result<TmaMap> {
    let spec = || format!("tma map of {what} [{rows}, {cols}]");
    let swizzle = match box_cols {
        64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        _ => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    if rows == 0
        || !cols.is_multiple_of(8)
        || swizzle == sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
        || box_rows == 0
        || box_rows > 256
    {
        return Err(FdppError::Unsupported {
            spec: spec(),
            what: format!(
                "a box of {box_cols} × {box_rows} (64 or 32 columns, 1-256 rows, and columns a multiple of 8)"
            ),
        });
    }
    encode_tiled_swizzled(
        base,
        [cols as u64, rows as u64],
        &[cols as u64 * 2],
        [box_cols, box_rows],
        swizzle,
        &spec(),
    )
}

/// cuTensorMapEncodeTiled over 16-bit values at `base`: `dims` innermost first, the byte
/// strides of dims 1.. (dim 0 is contiguous), boxes of `boxes`, the 128-byte swizzle, zeros
/// past the edges; `spec` names the map in an error.
fn encode_tiled<const R: usize>(
    base: u64,
    dims: [u64; R],
    strides: &[u64],
    boxes: [u32; R],
    spec: &str,
) -> Result<TmaMap> {
    let sw = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
    encode_tiled_swizzled(base, dims, strides, boxes, sw, spec)
}

/// [`encode_tiled`] with another swizzle.
fn encode_tiled_swizzled<const R: usize>(
    base: u64,
    dims: [u64; R],
    strides: &[u64],
    boxes: [u32; R],
    swizzle: sys::CUtensorMapSwizzle,
    spec: &str,
) -> Result<TmaMap> {
    debug_assert_eq!(strides.len() + 1, R);
    let elem = [1u32; R];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is to a live local array of the rank given (strides: R - 1); the
    // driver only writes `map`. The address, dims and strides are the caller's allocation
    // (checked by the driver).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            R as u32,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(FdppError::device(
            "cuda",
            format!("{spec}: cuTensorMapEncodeTiled({dims:?}, strides {strides:?}, box {boxes:?}) failed: {r:?}"),
        ));
    }
    Ok(TmaMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_cover_whole_pages_of_a_tile_or_none() {
        assert_eq!(box_rows(16), Some(16));
        assert_eq!(box_rows(8), Some(8));
        assert_eq!(box_rows(128), Some(128));
        assert_eq!(box_rows(256), Some(128));
        // Too few rows for a swizzle atom, or pages that straddle tiles.
        assert_eq!(box_rows(4), None);
        assert_eq!(box_rows(1), None);
        assert_eq!(box_rows(48), None);
        assert_eq!(box_rows(192), None);
    }

    #[test]
    fn the_map_is_the_kernels_parameter_size_and_alignment() {
        assert_eq!(std::mem::size_of::<TmaMap>(), 128);
        assert_eq!(std::mem::align_of::<TmaMap>(), 64);
    }
}
