//! Launching the attention kernels (kernels_cuda/attn_decode.cu, attn_prefill.cu) on CUDA.
//!
//! The block tables and lengths arrive as host arrays (see [`crate::ops::attention`]); they are
//! copied into a grow-only device buffer on the launch stream, so back-to-back steps queue
//! without a host synchronisation. Rows the async scheme recomputes are counted on the device:
//! the counting entry points read that count back (one synchronisation), the enqueue entry
//! points add it to a running total read later.

use cudarc::driver::{sys, CudaSlice, LaunchConfig};

use super::decode_tc::{BwPipe, ClusterMode, TcMode};
use super::launch::Launch;
use super::sources::{
    attn_decode_source, attn_prefill_source, prefill_smem_bytes, tc_staged_smem_bytes, KernelSource, PREFILL_BM,
};
use super::tma::{PoolMaps, TmaMap};
use super::upload::{i32_bytes, Upload};
use super::{drv, CudaBackend, CudaBuffer};
use crate::backend::attn_plan::{self, i32_of, window, DecodePath, DecodePlan, LOG2E};
use crate::backend::{Backend, DeviceBuffer};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::attention::{plan_mha_async, AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};
use crate::ops::layer::KvAppendParams;

const THREADS: u32 = 128;
/// The async bandwidth entry with the pipelined loop (built at one head per block, head_dim 128+).
const PIPE_ENTRY: &str = "attn_decode_async_pipe";
/// Threads of a prefill block: 16 query rows per warp (attn_prefill.cu's WARPS).
const PREFILL_THREADS: u32 = (PREFILL_BM / 16 * 32) as u32;

/// Counter slots: the running total of the enqueue paths, and the per-call slot the counting
/// paths reset and read.
const RUNNING: usize = 0;
const PER_CALL: usize = 1;
/// The persistent Hopper prefill's next-block counters: a ring of slots, each used by one launch
/// and all zeroed together when the ring wraps. A memset between the QKV GEMM and the attention
/// would stand between the two chained launches and break their overlap (programmatic dependent
/// launch chains only adjacent kernels), so one memset serves SCHED_RING launches.
const SCHED: usize = 2;
const SCHED_RING: usize = 64;
const COUNTERS: usize = SCHED + SCHED_RING;

/// Device scratch of the attention launches, grown on demand and kept.
#[derive(Default)]
pub struct Scratch {
    ints: Upload,
    /// Sync decode partials: acc [rows][splits][D], then (m, l) [rows][splits].
    partials: Option<CudaSlice<f32>>,
    /// Async decode accumulators; zero between launches (the kernel restores what it used).
    accum: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
    /// The next unused slot of the prefill's counter ring (0: the ring must be zeroed first).
    sched_next: usize,
    /// What is known of each decode entry, keyed by (dtype, head_dim, heads per block, entry) —
    /// the module's parameters, so a lookup on every launch allocates nothing.
    entries: std::collections::HashMap<(DType, usize, usize, &'static str), EntryState>,
}

#[derive(Clone, Copy, Debug, Default)]
struct EntryState {
    /// Resident blocks per SM, once asked.
    resident: Option<usize>,
    /// A staged tensor-core entry whose dynamic shared-memory limit has been raised.
    limit_raised: bool,
    /// Clusters of n blocks (index n) the device holds at once, once asked.
    clusters: [Option<usize>; CLUSTER_MAX_SPLITS + 1],
}

/// Decode entry `entry` of module `uri` with room for `smem` bytes of dynamic shared memory.
/// For the staged tensor-core entries (smem > 0) the limit is raised whatever the size, once per
/// entry: `function_of` raises it only past 48 KiB, but the default limit counts the static merge
/// area too (d64 at 3 stages: 48 KiB dynamic beside 8.8 KB static).
fn decode_function(
    b: &CudaBackend,
    sc: &mut Scratch,
    key: (DType, usize, usize),
    uri: &str,
    (entry, smem): (&'static str, u32),
    src: impl FnOnce() -> Result<KernelSource>,
) -> Result<cudarc::driver::CudaFunction> {
    let f = b.function_of(uri, entry, smem, src)?;
    let state = sc.entries.entry((key.0, key.1, key.2, entry)).or_default();
    if smem > 0 && !state.limit_raised {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(drv(&format!(
            "{uri} {entry}: raising the dynamic shared memory to {smem} bytes"
        )))?;
        state.limit_raised = true;
    }
    Ok(f)
}

/// Resident blocks per SM of decode entry `entry` of module `uri` (the driver's occupancy for
/// THREADS threads and `smem` bytes of dynamic shared memory: 0 but for the staged tensor-core
/// entries, whose names carry their stage count), asked once per entry; `key` names the module.
fn resident_blocks(
    b: &CudaBackend,
    sc: &mut Scratch,
    key: (DType, usize, usize),
    uri: &str,
    (entry, smem): (&'static str, u32),
    src: impl FnOnce() -> Result<KernelSource>,
) -> Result<usize> {
    let rkey = (key.0, key.1, key.2, entry);
    if let Some(r) = sc.entries.get(&rkey).and_then(|s| s.resident) {
        return Ok(r);
    }
    let f = decode_function(b, sc, key, uri, (entry, smem), src)?;
    let r = f
        .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem as usize, None)
        .map_err(drv(&format!("occupancy of {uri} {entry}")))? as usize;
    let r = r.max(1);
    sc.entries.entry(rkey).or_default().resident = Some(r);
    Ok(r)
}

/// Clusters of `n` blocks of decode entry `entry` the device holds at once
/// (`cuOccupancyMaxActiveClusters`).
fn resident_clusters(
    b: &CudaBackend,
    sc: &mut Scratch,
    key: (DType, usize, usize),
    uri: &str,
    (entry, smem): (&'static str, u32),
    n: u32,
    src: impl FnOnce() -> Result<KernelSource>,
) -> Result<usize> {
    let rkey = (key.0, key.1, key.2, entry);
    let slot = (n as usize).min(CLUSTER_MAX_SPLITS);
    if let Some(c) = sc.entries.get(&rkey).and_then(|s| s.clusters[slot]) {
        return Ok(c);
    }
    let f = decode_function(b, sc, key, uri, (entry, smem), src)?;
    let mut attr = super::launch::cluster_dim(n);
    let config = sys::CUlaunchConfig {
        gridDimX: n,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: THREADS,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: b.stream().cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut c: std::ffi::c_int = 0;
    b.context().bind_to_thread().map_err(drv("binding the CUDA context"))?;
    // SAFETY: `config` and `attr` outlive the call, which only reads them; `f` is a loaded kernel.
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut c, f.cu_function(), &config) }
        .result()
        .map_err(drv(&format!(
            "cluster occupancy of {uri} {entry} ({n} blocks a cluster)"
        )))?;
    let c = c.max(0) as usize;
    sc.entries.entry(rkey).or_default().clusters[slot] = Some(c);
    Ok(c)
}

fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    b: &CudaBackend,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
    what: &str,
) -> Result<()> {
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        if b.graphs.borrow().capturing() {
            return Err(super::graph::in_capture(&format!("allocating attention {what}")));
        }
        // Zeroed: the async accumulators and the counters rely on it.
        let s = b
            .stream()
            .alloc_zeros::<T>(len.max(1))
            .map_err(drv(&format!("allocating attention {what} ({len} elements)")))?;
        *slot = Some(s);
    }
    Ok(())
}

/// Device pointer of a scratch slot that `grow` has filled.
fn ptr_of<T>(b: &CudaBackend, slot: &Option<CudaSlice<T>>) -> Result<u64> {
    use cudarc::driver::DevicePtr;
    let s = slot
        .as_ref()
        .ok_or_else(|| FdppError::device("cuda", "attention scratch used before it was allocated"))?;
    let (p, _sync) = s.device_ptr(b.stream());
    Ok(p)
}

/// `host` on the device (copied after anything queued before it, unless unchanged since the
/// last call: every layer of a step reads the same tables) and its pointer.
pub(super) fn upload_ints(b: &CudaBackend, sc: &mut Scratch, host: &[i32]) -> Result<u64> {
    sc.ints.put(b, &i32_bytes(host), "block tables")
}

fn check_dtypes(what: &str, want: crate::dtype::DType, bufs: &[&CudaBuffer]) -> Result<()> {
    if bufs.iter().any(|x| x.dtype() != want) {
        return Err(FdppError::InvalidArgument(format!(
            "{what}: every buffer must be {want}"
        )));
    }
    Ok(())
}

/// Zero counters `slots` on the stream (allocating them first) and return the first one's
/// device address.
fn zero_counters(b: &CudaBackend, sc: &mut Scratch, slots: std::ops::Range<usize>, what: &str) -> Result<u64> {
    grow(b, &mut sc.counters, COUNTERS, "counters")?;
    let c = sc
        .counters
        .as_mut()
        .ok_or_else(|| FdppError::device("cuda", "attention counters missing"))?;
    let first = slots.start;
    b.stream()
        .memset_zeros(&mut c.slice_mut(slots))
        .map_err(drv(&format!("resetting the {what}")))?;
    Ok(ptr_of(b, &sc.counters)? + 4 * first as u64)
}

/// Zero counter `slot` on the stream and return its device address.
fn zeroed_counter(b: &CudaBackend, sc: &mut Scratch, slot: usize, what: &str) -> Result<u64> {
    zero_counters(b, sc, slot..slot + 1, what)
}

/// A zeroed block counter for one persistent prefill launch (its blocks take list entries from
/// it past the first wave): the ring's next slot, the whole ring zeroed when it wraps. Inside a
/// capture the slot is zeroed on its own, as a replay must zero it again.
fn sched_counter_ptr(b: &CudaBackend, sc: &mut Scratch) -> Result<u64> {
    if b.graphs.borrow().capturing() {
        return zeroed_counter(b, sc, SCHED, "prefill block counter");
    }
    let ring = if sc.sched_next == 0 {
        zero_counters(b, sc, SCHED..SCHED + SCHED_RING, "prefill block counters")?
    } else {
        ptr_of(b, &sc.counters)? + 4 * SCHED as u64
    };
    let slot = sc.sched_next;
    sc.sched_next = (slot + 1) % SCHED_RING;
    Ok(ring + 4 * slot as u64)
}

pub(super) fn counter_ptr(b: &CudaBackend, sc: &mut Scratch, counting: bool) -> Result<u64> {
    if counting {
        // The per-call slot, zeroed for this call.
        zeroed_counter(b, sc, PER_CALL, "recompute counter")
    } else {
        grow(b, &mut sc.counters, COUNTERS, "counters")?;
        Ok(ptr_of(b, &sc.counters)? + 4 * RUNNING as u64)
    }
}

fn read_counter(b: &CudaBackend, sc: &Scratch, slot: usize) -> Result<usize> {
    let c = sc
        .counters
        .as_ref()
        .ok_or_else(|| FdppError::device("cuda", "attention counters missing"))?;
    let v = b
        .stream()
        .clone_dtoh(&c.slice(slot..slot + 1))
        .map_err(drv("reading the recompute counter"))?;
    Ok(v.first().copied().unwrap_or(0) as usize)
}

/// The rows this call recomputed (a device wait) when counting, else 0 (the running total keeps
/// them).
pub(super) fn per_call_count(b: &CudaBackend, sc: &Scratch, counting: bool) -> Result<usize> {
    if counting {
        read_counter(b, sc, PER_CALL)
    } else {
        Ok(0)
    }
}

/// Copy the running recompute total of the enqueue paths into `dst` and reset it, both in stream
/// order (no host wait): the caller downloads `dst` with what it reads back anyway. false when
/// no enqueue path has counted yet (nothing copied).
pub(super) fn stage_running_count(b: &CudaBackend, dst: &mut cudarc::driver::CudaViewMut<u32>) -> Result<bool> {
    let mut sc = b.attn.borrow_mut();
    let Some(c) = sc.counters.as_mut() else {
        return Ok(false);
    };
    b.stream()
        .memcpy_dtod(&c.slice(RUNNING..RUNNING + 1), dst)
        .map_err(drv("copying the recompute counter"))?;
    b.stream()
        .memset_zeros(&mut c.slice_mut(RUNNING..RUNNING + 1))
        .map_err(drv("resetting the recompute counter"))?;
    Ok(true)
}

/// Read and reset the running recompute total of the enqueue paths.
pub fn take_recomputed(b: &CudaBackend) -> Result<usize> {
    let mut sc = b.attn.borrow_mut();
    if sc.counters.is_none() {
        return Ok(0);
    }
    let n = read_counter(b, &sc, RUNNING)?;
    if let Some(c) = sc.counters.as_mut() {
        b.stream()
            .memset_zeros(&mut c.slice_mut(RUNNING..RUNNING + 1))
            .map_err(drv("resetting the recompute counter"))?;
    }
    Ok(n)
}

/// Most splits of a row one thread-block cluster holds (kernels_cuda/attn_decode.cu CLUSTER_MAX:
/// the portable cluster size).
pub const CLUSTER_MAX_SPLITS: usize = 8;

/// Blocks per cluster of an async decode launch: its splits where a row's
/// 2..=[`CLUSTER_MAX_SPLITS`] splits are one head chunk (then cluster rank = split, and the
/// kernel finishes the row through distributed shared memory: attn_decode.cu `cluster_gather`);
/// else 1, the global atomics. Measured on the H100 with the driver's load-balancing placement
/// (reports/NOTES.md, session 29, MHA d128, µs against unclustered in the same call): 8 · 1024
/// (2 splits) 51.1-51.6 → 50.0-50.1, 4 · 1024 (5) 32.2-32.6 → 30.7, 12 · 1024 / 2048 (2)
/// 1.6-3.1 % faster, from 4096 keys level (±0.8 %).
fn cluster_splits(device_clusters: bool, mode: ClusterMode, plan: &DecodePlan) -> u32 {
    let fits = plan.chunks == 1 && (2..=CLUSTER_MAX_SPLITS).contains(&plan.splits);
    if device_clusters && mode != ClusterMode::Off && fits {
        plan.splits as u32
    } else {
        1
    }
}

/// Split-KV decode. `counting`: wait for the device and return the exact recompute count.
pub fn decode(
    b: &CudaBackend,
    p: &DecodeParams,
    q: &CudaBuffer,
    kv: &PagedKv<CudaBuffer>,
    out: &mut CudaBuffer,
    counting: bool,
) -> Result<AttnStats> {
    p.validate(&kv.layout, q.len(), out.len(), (kv.k.len(), kv.v.len()))?;
    check_dtypes("decode attention", p.dtype, &[q, &kv.k, &kv.v, out])?;
    let g = p.geom;
    let (bsz, heads, kvh, d) = (p.batch(), g.num_heads, g.num_kv_heads, g.head_dim);
    let cus = b.info().compute_units as usize;
    let is_async = matches!(p.scheme, SoftmaxScheme::Async { .. });
    // The main pass (decode_tc.rs): the tensor-core one serves up to 8 heads per block.
    let mode = TcMode::for_launch(b.decode_tc_up_to(), g.group(), bsz)?;
    let first = DecodePlan::with_max_heads(p, cus, None, mode.max_heads_per_block(d));
    let hg = first.hg;
    let tc = mode.uses_tc(d, hg);
    // The staged form of the tensor-core pass (FDPP_DECODE_TC_STAGES), bandwidth path only.
    let stages = if tc { super::decode_tc::staged_stages()? } else { None };
    let smem_staged = match stages {
        Some(st) => {
            let need = tc_staged_smem_bytes(d, st);
            // Beside the block's static merge area: 4 warps × hg heads × d floats, plus at most
            // 4 KiB (the d256 exchange and the per-head values).
            let merge = (4 * hg * d * 4 + 4096) as u32;
            if need + merge > b.max_smem_per_block() {
                return Err(FdppError::Unsupported {
                    spec: format!("attn_decode_{}_d{d}_hg{hg}", p.dtype),
                    what: format!(
                        "FDPP_DECODE_TC_STAGES={st} on this device: {need} bytes of staged K/V plus about {merge} of merge area per block, more than its {} bytes of shared memory per block",
                        b.max_smem_per_block()
                    ),
                });
            }
            need
        }
        None => 0,
    };
    // (sync entry, async entry, dynamic shared memory) of a path.
    let entries_of = |path: DecodePath| match (path, stages.and_then(DecodePath::staged_entries)) {
        (DecodePath::Bandwidth, Some((s, a))) => (s, a, smem_staged),
        _ => {
            let (s, a) = path.entries(tc);
            (s, a, 0)
        }
    };
    let uri = format!("attn_decode_{}_d{d}_hg{hg}", p.dtype);
    let prefetch = super::decode_tc::prefetch_keys()?;
    let pipe_mode = super::decode_tc::bw_pipe()?;
    let src = || {
        let mut s = attn_decode_source(p.dtype, d, hg);
        if let Some(n) = prefetch {
            s.defines.push(("FDPP_DECODE_PREFETCH".into(), n.to_string()));
        }
        Ok(s)
    };

    let mut sc = b.attn.borrow_mut();
    // The split count from the occupancy of the kernel the shape's first plan takes
    // (`num_splits_resident`). Then the path of the final plan: latency-bound async launches
    // (small batch, short splits) take the latency path's entries. Where the two plans' paths
    // differ (GQA 32/8 at batch 9-16 with splits near 128 keys) the occupancy was the other
    // kernel's (2 blocks per SM on the latency path, 3 on the bandwidth path at four heads per
    // block): a less exact count, not a wrong result. MHA at small batch fills one wave of the
    // occupancy, so there an async change of path to a kernel with fewer slots would overfill it
    // (batch 1 at 2177-3072 keys: 24 splits of the bandwidth kernel's 6 per SM are ≤ 128 keys,
    // the latency path's, whose kernel holds 5): planned again with that kernel's occupancy.
    let plan = if p.num_splits.is_none() {
        let path0 = DecodePath::for_plan(&first, p.scheme, cus);
        let mut resident_of = |path: DecodePath| {
            let (sync_e, async_e, smem_e) = entries_of(path);
            let entry = if is_async { async_e } else { sync_e };
            resident_blocks(b, &mut sc, (p.dtype, d, hg), &uri, (entry, smem_e), src)
        };
        let resident = resident_of(path0)?;
        let max_hg = mode.max_heads_per_block(d);
        DecodePlan::with_max_heads(p, cus, Some(resident), max_hg).replanned(
            p,
            cus,
            max_hg,
            (path0, resident),
            &mut resident_of,
        )?
    } else {
        first
    };
    let path = DecodePath::for_plan(&plan, p.scheme, cus);
    let (sync_entry, mut async_entry, smem) = entries_of(path);
    // The pipelined async loop (one head per block, head_dim 128+, the CUDA-core pass's bandwidth
    // path), planned with its split count (`plan_mha_async`).
    let mut plan = plan;
    let mut piped = false;
    if is_async && path == DecodePath::Bandwidth && !tc && hg == 1 && d >= 128 {
        let forced = p.num_splits.is_some();
        let loop_entry = (async_entry, smem);
        let pipe_entry = (PIPE_ENTRY, 0);
        let choice = match pipe_mode {
            BwPipe::Off => None,
            BwPipe::Auto if forced => None,
            BwPipe::Auto => {
                let r_loop = resident_blocks(b, &mut sc, (p.dtype, d, hg), &uri, loop_entry, src)?;
                let r_pipe = resident_blocks(b, &mut sc, (p.dtype, d, hg), &uri, pipe_entry, src)?;
                let items = plan.batch * plan.kv_heads;
                match plan_mha_async(items, plan.max_len, cus, r_loop, plan.splits, r_pipe) {
                    (true, splits) => Some(splits),
                    (false, splits) => {
                        plan.splits = splits;
                        None
                    }
                }
            }
            BwPipe::On if forced => Some(plan.splits),
            BwPipe::On => {
                let r_pipe = resident_blocks(b, &mut sc, (p.dtype, d, hg), &uri, pipe_entry, src)?;
                let own = DecodePlan::with_max_heads(p, cus, Some(r_pipe), mode.max_heads_per_block(d));
                (DecodePath::for_plan(&own, p.scheme, cus) == DecodePath::Bandwidth).then_some(own.splits)
            }
        };
        if let Some(splits) = choice {
            plan.splits = splits;
            async_entry = PIPE_ENTRY;
            piped = true;
        }
    }
    let (splits, rows, max_len) = (plan.splits, plan.rows, plan.max_len);
    let mut cluster = if is_async {
        cluster_splits(b.clusters(), super::decode_tc::cluster_mode()?, &plan)
    } else {
        1
    };
    if cluster > 1 {
        // Only where every cluster of the launch is resident at once: without the load-balancing
        // placement, clusters of 3-8 blocks near a full wave ran 16-33 % slower on the H100 than
        // the same blocks unclustered (reports/NOTES.md, session 29).
        let (gx, gy, gz) = plan.grid()?;
        let blocks = gx as usize * gy as usize * gz as usize;
        let held = resident_clusters(b, &mut sc, (p.dtype, d, hg), &uri, (async_entry, smem), cluster, src)?;
        if blocks > held * cluster as usize {
            cluster = 1;
        }
    }
    let (host, lens_at) = attn_plan::decode_ints(p);
    let tables = upload_ints(b, &mut sc, &host)?;
    let lens = tables + 4 * lens_at as u64;
    let (max_pages, page_size) = (
        i32_of(p.tables.max_pages, "max_pages")?,
        i32_of(kv.layout.page_size, "page_size")?,
    );
    let (h32, g32, s32) = (
        i32_of(heads, "heads")?,
        i32_of(kvh, "kv heads")?,
        i32_of(splits, "splits")?,
    );
    let scale2 = g.scale() * LOG2E;
    let cfg = LaunchConfig {
        grid_dim: plan.grid()?,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let (qp, kp, vp, op) = (b.ptr(q), b.ptr(&kv.k), b.ptr(&kv.v), b.ptr(out));
    let pass = match (tc, smem) {
        (false, _) if piped => "CUDA-core, pipelined".to_string(),
        (false, _) => "CUDA-core".to_string(),
        (true, 0) => "tensor-core".to_string(),
        (true, _) => format!("tensor-core, {} cp.async stages", stages.unwrap_or(0)),
    };
    let finish = if cluster > 1 { " in clusters" } else { "" };
    let what =
        format!("{uri} ({path:?} path, {pass} pass) at batch {bsz}, kv_len ≤ {max_len}, {splits} splits{finish}");
    let recomputed = match p.scheme {
        SoftmaxScheme::Sync => {
            let part = if splits > 1 {
                grow(b, &mut sc.partials, plan.partial_elems().unwrap_or(0), "partials")?;
                ptr_of(b, &sc.partials)?
            } else {
                0
            };
            let f = decode_function(b, &mut sc, (p.dtype, d, hg), &uri, (sync_entry, smem), src)?;
            let mut l = Launch::chained(b, &f);
            l.arg(&qp).arg(&kp).arg(&vp).arg(&tables).arg(&lens);
            l.arg(&max_pages)
                .arg(&page_size)
                .arg(&h32)
                .arg(&g32)
                .arg(&s32)
                .arg(&scale2);
            l.arg(&part).arg(&op);
            // SAFETY: buffer lengths and tables are validated above; part covers rows·splits·(D+2).
            unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {what}")))?;
            if splits > 1 {
                let f = b.function_of(&uri, "attn_combine", 0, src)?;
                let r32 = i32_of(rows, "rows")?;
                let mut l = Launch::chained(b, &f);
                l.arg(&part).arg(&r32).arg(&s32).arg(&op);
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: as above.
                unsafe { l.launch(cfg) }.map_err(drv(&format!("launch combine of {what}")))?;
            }
            0
        }
        SoftmaxScheme::Async { .. } => {
            let (phi2, a2, b2) = window(p.scheme);
            grow(b, &mut sc.accum, plan.accum_words(), "accumulators")?;
            let ws = ptr_of(b, &sc.accum)?;
            let counter = counter_ptr(b, &mut sc, counting)?;
            let f = decode_function(b, &mut sc, (p.dtype, d, hg), &uri, (async_entry, smem), src)?;
            let mut l = Launch::chained(b, &f);
            l.arg(&qp).arg(&kp).arg(&vp).arg(&tables).arg(&lens);
            l.arg(&max_pages)
                .arg(&page_size)
                .arg(&h32)
                .arg(&g32)
                .arg(&s32)
                .arg(&scale2);
            l.arg(&phi2).arg(&a2).arg(&b2).arg(&ws).arg(&counter).arg(&op);
            l.cluster_x(cluster);
            // SAFETY: as above; the accumulators are zero and cover rows·(D+3) + arrival counters.
            unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {what}")))?;
            b.check_launch(&what)?;
            per_call_count(b, &sc, counting)?
        }
    };
    b.check_launch(&what)?;
    Ok(AttnStats {
        rows,
        recomputed,
        splits,
    })
}

/// Causal prefill: append the new K and V to the cache, then attend.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    b: &CudaBackend,
    p: &PrefillParams,
    q: &CudaBuffer,
    k: &CudaBuffer,
    v: &CudaBuffer,
    kv: &mut PagedKv<CudaBuffer>,
    out: &mut CudaBuffer,
    counting: bool,
) -> Result<AttnStats> {
    p.validate(
        &kv.layout,
        (q.len(), out.len()),
        (k.len(), v.len()),
        (kv.k.len(), kv.v.len()),
    )?;
    check_dtypes("prefill attention", p.dtype, &[q, k, v, &kv.k, &kv.v, out])?;
    b.kv_append(
        &KvAppendParams {
            tables: p.tables.clone(),
            new_lens: p.new_lens.clone(),
        },
        k,
        v,
        kv,
    )?;
    attend(b, p, q, kv, out, counting)
}

/// Causal prefill of new tokens whose K and V the cache already holds: attend only.
pub fn prefill_cached(
    b: &CudaBackend,
    p: &PrefillParams,
    q: &CudaBuffer,
    kv: &PagedKv<CudaBuffer>,
    out: &mut CudaBuffer,
    counting: bool,
) -> Result<AttnStats> {
    p.validate_cached(&kv.layout, (q.len(), out.len()), (kv.k.len(), kv.v.len()))?;
    check_dtypes("prefill attention", p.dtype, &[q, &kv.k, &kv.v, out])?;
    attend(b, p, q, kv, out, counting)
}

/// The attention of [`prefill`] and [`prefill_cached`], whose callers validated the params and
/// buffers.
fn attend(
    b: &CudaBackend,
    p: &PrefillParams,
    q: &CudaBuffer,
    kv: &PagedKv<CudaBuffer>,
    out: &mut CudaBuffer,
    counting: bool,
) -> Result<AttnStats> {
    let g = p.geom;
    let (heads, d) = (g.num_heads, g.head_dim);
    // sm_90a: the wgmma kernel (prefill_hopper.rs), unless FDPP_PREFILL says otherwise.
    if super::prefill_hopper::wanted(b, p)? {
        let recomputed = super::prefill_hopper::attend(b, p, q, kv, out, counting)?;
        return Ok(AttnStats {
            rows: p.tokens() * heads,
            recomputed,
            splits: 0,
        });
    }
    let src = || Ok(attn_prefill_source(p.dtype, d));
    let recomputed = launch_prefill(
        b,
        p,
        q,
        kv,
        out,
        counting,
        &PrefillKernel {
            uri: format!("attn_prefill_{}_d{d}", p.dtype),
            source: &src,
            entries: ["attn_prefill_sync", "attn_prefill_async"],
            threads: PREFILL_THREADS,
            tile_rows: PREFILL_BM,
            smem: prefill_smem_bytes(d),
            hopper: None,
        },
    )?;
    Ok(AttnStats {
        rows: p.tokens() * heads,
        recomputed,
        splits: 0,
    })
}

/// One causal prefill kernel (attn_prefill.cu or attn_prefill_hopper.cu): one launcher serves
/// both. They differ in the list they read (attn_prefill.cu: the tiles, with the section count
/// to order its blocks; the Hopper kernel: an entry per block, attn_plan.rs `prefill_blocks`)
/// and in the Hopper kernel's trailing TMA arguments.
pub(super) struct PrefillKernel<'a> {
    pub uri: String,
    pub source: &'a dyn Fn() -> Result<KernelSource>,
    /// The sync and the async entry point.
    pub entries: [&'static str; 2],
    pub threads: u32,
    /// Query rows per block (the tile list's granularity).
    pub tile_rows: usize,
    pub smem: u32,
    /// The Hopper kernel's own arguments (attn_prefill.cu takes none). Present: the kernel reads
    /// per-block entries instead of the tiles and the section count.
    pub hopper: Option<&'a HopperArgs<'a>>,
}

/// What the Hopper prefill takes beyond attn_prefill.cu's arguments.
pub(super) struct HopperArgs<'a> {
    /// TMA maps over the K and V pools, the rows of a box, and the maps that box a tile of
    /// consecutive pages.
    pub pool: &'a PoolMaps,
    /// A TMA map over the query rows, read when `q_tma` is 1 (else the block copies them with
    /// cp.async).
    pub q: TmaMap,
    pub q_tma: i32,
    /// Blocks ahead whose list entry a block prefetches into L2 (attn_plan.rs
    /// `prefill_entry_ahead`).
    pub entry_ahead: i32,
    /// The persistent kernel's grid (blocks, at most one per SM: past its first block each takes
    /// list entries from a counter); None: one block per entry.
    pub persistent_grid: Option<u32>,
}

/// The Hopper prefill is launched chained: its entries call pdl_wait() before anything else
/// (attn_prefill_hopper.cu), so that the boundaries with the QKV GEMM before and the O GEMM after
/// overlap; attn_prefill.cu has no wait and serialises as usual.
fn prefill_launch<'a>(b: &'a CudaBackend, f: &'a cudarc::driver::CudaFunction, k: &PrefillKernel) -> Launch<'a> {
    if k.hopper.is_some() {
        Launch::chained(b, f)
    } else {
        Launch::plain(b, f)
    }
}

/// Attend causally over the cache with `k` (the new K and V are already in it); returns the rows
/// the async scheme recomputed when `counting`, else 0.
pub(super) fn launch_prefill(
    b: &CudaBackend,
    p: &PrefillParams,
    q: &CudaBuffer,
    kv: &PagedKv<CudaBuffer>,
    out: &mut CudaBuffer,
    counting: bool,
    k: &PrefillKernel,
) -> Result<usize> {
    if k.smem > b.max_smem_per_block() {
        return Err(FdppError::Unsupported {
            spec: k.uri.clone(),
            what: format!(
                "head_dim {} on this device ({} KiB of shared memory needed, {} KiB allowed)",
                p.geom.head_dim,
                k.smem >> 10,
                b.max_smem_per_block() >> 10
            ),
        });
    }
    let tiles = attn_plan::prefill_tiles(p, k.tile_rows)?;
    if tiles.is_empty() {
        return Ok(0);
    }
    let g = p.geom;
    let (max_pages, page_size) = (
        i32_of(p.tables.max_pages, "max_pages")?,
        i32_of(kv.layout.page_size, "page_size")?,
    );
    let (h32, g32) = (i32_of(g.num_heads, "heads")?, i32_of(g.num_kv_heads, "kv heads")?);
    let scale2 = g.scale() * LOG2E;
    let what = format!("{} at {} new tokens of {} sequences", k.uri, p.tokens(), p.batch());
    // One block per (tile, head), in the order of attn_common.cuh's tile_head().
    let blocks = u32::try_from(tiles.len() * g.num_heads).map_err(|_| {
        FdppError::InvalidArgument(format!(
            "{what}: {} query tiles of {} rows × {} heads exceed one launch; prefill the prompt in chunks \
             (generate --chunk-size)",
            tiles.len(),
            k.tile_rows,
            g.num_heads
        ))
    })?;
    let budget = attn_plan::SectionBudget::new(b.info().l2_bytes, b.info().compute_units as usize)?;
    let sections = attn_plan::prefill_sections(p, blocks as usize, &budget);
    let nsec = i32_of(sections, "sections")?;
    let mut sc = b.attn.borrow_mut();
    // The list follows the table, aligned for its int4 loads: the tiles (attn_prefill.cu orders
    // its blocks itself), or the Hopper kernel's per-block entries in that order.
    let (host, list_at) = match k.hopper {
        None => attn_plan::prefill_ints(p, &tiles),
        Some(h) => {
            let boxes = attn_plan::TileBoxes {
                page_size: kv.layout.page_size,
                tma_rows: h.pool.rows.max(0) as usize,
                runs: h.pool.runs,
            };
            let entries = attn_plan::prefill_blocks(p, &tiles, sections, boxes, super::prefill_hopper::BN)?;
            attn_plan::prefill_ints(p, &entries)
        }
    };
    let table = upload_ints(b, &mut sc, &host)?;
    let list_ptr = table + 4 * list_at as u64;
    let nblocks = i32_of(blocks as usize, "blocks")?;
    let (grid, sched) = match k.hopper.and_then(|h| h.persistent_grid) {
        Some(cap) => (blocks.min(cap.max(1)), sched_counter_ptr(b, &mut sc)?),
        None => (blocks, 0u64),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (k.threads, 1, 1),
        shared_mem_bytes: k.smem,
    };
    let (qp, kp, vp, op) = (b.ptr(q), b.ptr(&kv.k), b.ptr(&kv.v), b.ptr(out));
    let recomputed = match p.scheme {
        SoftmaxScheme::Sync => {
            let f = b.function_of(&k.uri, k.entries[0], k.smem, k.source)?;
            let mut l = prefill_launch(b, &f, k);
            l.arg(&qp).arg(&kp).arg(&vp).arg(&table).arg(&list_ptr);
            l.arg(&max_pages).arg(&page_size).arg(&h32).arg(&g32);
            match k.hopper {
                None => l.arg(&nsec),
                Some(h) => l.arg(&h.entry_ahead).arg(&h.q_tma).arg(&nblocks).arg(&sched),
            };
            l.arg(&scale2).arg(&op);
            if let Some(h) = k.hopper {
                let t = h.pool;
                l.arg(&t.k).arg(&t.v).arg(&t.rows).arg(&t.k_run).arg(&t.v_run).arg(&h.q);
            }
            // SAFETY: the caller validated lengths and tables; the tile list covers every new row
            // once; the shared memory is what the kernel lays out.
            unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {what}")))?;
            0
        }
        SoftmaxScheme::Async { .. } => {
            let (phi2, a2, b2) = window(p.scheme);
            let counter = counter_ptr(b, &mut sc, counting)?;
            let f = b.function_of(&k.uri, k.entries[1], k.smem, k.source)?;
            let mut l = prefill_launch(b, &f, k);
            l.arg(&qp).arg(&kp).arg(&vp).arg(&table).arg(&list_ptr);
            l.arg(&max_pages).arg(&page_size).arg(&h32).arg(&g32);
            match k.hopper {
                None => l.arg(&nsec),
                Some(h) => l.arg(&h.entry_ahead).arg(&h.q_tma).arg(&nblocks).arg(&sched),
            };
            l.arg(&scale2);
            l.arg(&phi2).arg(&a2).arg(&b2).arg(&counter).arg(&op);
            if let Some(h) = k.hopper {
                let t = h.pool;
                l.arg(&t.k).arg(&t.v).arg(&t.rows).arg(&t.k_run).arg(&t.v_run).arg(&h.q);
            }
            // SAFETY: as above.
            unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {what}")))?;
            b.check_launch(&what)?;
            per_call_count(b, &sc, counting)?
        }
    };
    b.check_launch(&what)?;
    Ok(recomputed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(chunks: usize, splits: usize) -> DecodePlan {
        DecodePlan {
            batch: 8,
            heads: 32,
            kv_heads: 32 / chunks.max(1),
            head_dim: 128,
            hg: 1,
            chunks,
            splits,
            rows: 256,
            max_len: 1024,
        }
    }

    #[test]
    fn a_rows_splits_share_a_cluster_only_where_they_are_one_chunk_of_two_to_eight() {
        let on = |p: &DecodePlan| cluster_splits(true, ClusterMode::Auto, p);
        assert_eq!(on(&plan(1, 1)), 1);
        for s in 2..=CLUSTER_MAX_SPLITS {
            assert_eq!(on(&plan(1, s)), s as u32);
        }
        assert_eq!(on(&plan(1, CLUSTER_MAX_SPLITS + 1)), 1);
        // Two head chunks of a kv head: blocks along x alternate chunks, not splits.
        assert_eq!(on(&plan(2, 4)), 1);
        // Switched off, or a device without clusters.
        assert_eq!(cluster_splits(true, ClusterMode::Off, &plan(1, 4)), 1);
        assert_eq!(cluster_splits(false, ClusterMode::Auto, &plan(1, 4)), 1);
    }
}
