//! Launching the attention kernels (kernels_hip/attn_decode.hip, attn_prefill.hip) on ROCm, in
//! the shape of the CUDA backend's attention.rs: the block tables and lengths arrive as host
//! arrays and are copied into a grow-only device buffer on fdpp's stream (skipped when unchanged:
//! every layer of a step reads the same tables); rows the async scheme recomputes are counted on
//! the device, read back by the counting entry points (one synchronisation) or added to a running
//! total by the enqueue entry points. The split count, grids, workspace sizes and tile list come
//! from [`crate::backend::attn_plan`], shared with CUDA; the launch descriptions and their
//! argument lists are pure functions here, unit-tested on the CPU against the kernels' parameter
//! lists. Nothing here has run on an AMD GPU yet (see the README's ROCm section).

use std::ffi::c_void;

use super::hip::{self, HipApi};
use super::layer::{arg_f32, arg_i32};
use super::{launch, sources, RocmBackend, RocmBuffer, RocmDevice};
use crate::backend::attn_plan::{self, i32_of, window, DecodePlan, LOG2E};
use crate::backend::{Backend, DeviceBuffer};
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::attention::{AttnStats, DecodeParams, PrefillParams, SoftmaxScheme};
use crate::ops::layer::KvAppendParams;

/// Threads of a decode and a combine block (THREADS in attn_decode.hip).
pub const DECODE_THREADS: u32 = 128;
/// Wavefronts of a prefill block and their width (WAVES, WAVE in attn_prefill.hip): 16 query
/// rows per wavefront.
pub const PREFILL_WAVES: u32 = 4;
pub const PREFILL_WAVE: u32 = 64;
/// Query rows per prefill block (BM in attn_prefill.hip).
pub const PREFILL_BM: usize = 16 * PREFILL_WAVES as usize;

/// Keys per LDS tile of the prefill kernel (BN in attn_prefill.hip).
pub fn prefill_bn(head_dim: usize) -> usize {
    if head_dim == 256 {
        32
    } else {
        64
    }
}

/// Static LDS of a prefill block: K and V tiles of BN rows, each row padded by 8 elements.
pub fn prefill_lds_bytes(head_dim: usize) -> u32 {
    (2 * prefill_bn(head_dim) * (head_dim + 8) * 2) as u32
}

/// Counter slots: the running total of the enqueue paths, and the per-call slot the counting
/// paths reset and read.
const RUNNING: usize = 0;
const PER_CALL: usize = 1;
/// Most arguments an attention kernel takes (attn_decode_async: 17).
const MAX_ARGS: usize = 17;

/// One kernel argument, typed as the kernel's parameter is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

impl Arg {
    /// The 8-byte slot hipModuleLaunchKernel reads the argument from (little-endian: a 4-byte
    /// value in the low half; see layer.rs).
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I32(v) => arg_i32(v),
            Arg::F32(v) => arg_f32(v),
        }
    }
}

/// One attention kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnLaunch {
    pub kernel: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub args: Vec<Arg>,
}

/// Device addresses a decode launch reads and writes (0 where the scheme uses none).
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodePtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub tables: u64,
    pub lens: u64,
    /// Sync partials (splits > 1).
    pub part: u64,
    /// Async workspace, zero between launches.
    pub ws: u64,
    /// Recompute counter slot (async).
    pub counter: u64,
    pub out: u64,
}

/// What a launch needs besides pointers: the cache geometry and the scale in log2 units.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub max_pages: i32,
    pub page_size: i32,
    pub scale2: f32,
}

/// The launches of one decode step: `sync` is the split kernel then (with more than one split)
/// the combine; `async` is one kernel (the last split of a row normalises it).
pub fn decode_launches(
    plan: &DecodePlan,
    scheme: SoftmaxScheme,
    x: &DecodePtrs,
    dims: Dims,
) -> Result<Vec<AttnLaunch>> {
    let grid = plan.grid()?;
    let (h, g, s) = (
        i32_of(plan.heads, "heads")?,
        i32_of(plan.kv_heads, "kv heads")?,
        i32_of(plan.splits, "splits")?,
    );
    let mut args = vec![
        Arg::Ptr(x.q),
        Arg::Ptr(x.k),
        Arg::Ptr(x.v),
        Arg::Ptr(x.tables),
        Arg::Ptr(x.lens),
        Arg::I32(dims.max_pages),
        Arg::I32(dims.page_size),
        Arg::I32(h),
        Arg::I32(g),
        Arg::I32(s),
        Arg::F32(dims.scale2),
    ];
    Ok(match scheme {
        SoftmaxScheme::Sync => {
            args.extend([Arg::Ptr(x.part), Arg::Ptr(x.out)]);
            let mut v = vec![AttnLaunch {
                kernel: "attn_decode_sync",
                grid,
                block: DECODE_THREADS,
                args,
            }];
            if plan.splits > 1 {
                let rows = u32::try_from(plan.rows).map_err(|_| {
                    FdppError::InvalidArgument(format!("attention decode: {} rows over u32", plan.rows))
                })?;
                v.push(AttnLaunch {
                    kernel: "attn_combine",
                    grid: (rows, 1, 1),
                    block: DECODE_THREADS,
                    args: vec![
                        Arg::Ptr(x.part),
                        Arg::I32(i32_of(plan.rows, "rows")?),
                        Arg::I32(s),
                        Arg::Ptr(x.out),
                    ],
                });
            }
            v
        }
        SoftmaxScheme::Async { .. } => {
            let (phi2, a2, b2) = window(scheme);
            args.extend([
                Arg::F32(phi2),
                Arg::F32(a2),
                Arg::F32(b2),
                Arg::Ptr(x.ws),
                Arg::Ptr(x.counter),
                Arg::Ptr(x.out),
            ]);
            vec![AttnLaunch {
                kernel: "attn_decode_async",
                grid,
                block: DECODE_THREADS,
                args,
            }]
        }
    })
}

/// Device addresses a prefill launch reads and writes.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub table: u64,
    pub tiles: u64,
    pub counter: u64,
    pub out: u64,
}

/// The prefill launch: one block per (query tile, head).
pub fn prefill_launch(
    ntiles: usize,
    heads: usize,
    kv_heads: usize,
    scheme: SoftmaxScheme,
    x: &PrefillPtrs,
    dims: Dims,
) -> Result<AttnLaunch> {
    let u = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| FdppError::InvalidArgument(format!("attention prefill: {what} = {v} over u32")))
    };
    let mut args = vec![
        Arg::Ptr(x.q),
        Arg::Ptr(x.k),
        Arg::Ptr(x.v),
        Arg::Ptr(x.table),
        Arg::Ptr(x.tiles),
        Arg::I32(dims.max_pages),
        Arg::I32(dims.page_size),
        Arg::I32(i32_of(heads, "heads")?),
        Arg::I32(i32_of(kv_heads, "kv heads")?),
        Arg::F32(dims.scale2),
    ];
    let kernel = match scheme {
        SoftmaxScheme::Sync => "attn_prefill_sync",
        SoftmaxScheme::Async { .. } => {
            let (phi2, a2, b2) = window(scheme);
            args.extend([Arg::F32(phi2), Arg::F32(a2), Arg::F32(b2), Arg::Ptr(x.counter)]);
            "attn_prefill_async"
        }
    };
    args.push(Arg::Ptr(x.out));
    Ok(AttnLaunch {
        kernel,
        grid: (u(ntiles, "query tiles")?, u(heads, "heads")?, 1),
        block: PREFILL_WAVES * PREFILL_WAVE,
        args,
    })
}

/// Can this device run the prefill kernel? MFMA with wave64 (CDNA2/3) and enough LDS.
pub fn prefill_supported(dev: &RocmDevice, head_dim: usize, uri: &str) -> Result<()> {
    let arch = &dev.info.arch;
    if !launch::has_flat_gemm(arch) || dev.wave != PREFILL_WAVE {
        return Err(FdppError::Unsupported {
            spec: uri.into(),
            what: format!(
                "{arch} (wave{}): the prefill kernel needs CDNA2/3 MFMA with wave64 (gfx90a, gfx94x)",
                dev.wave
            ),
        });
    }
    let lds = prefill_lds_bytes(head_dim);
    if lds > dev.lds_per_block {
        return Err(FdppError::Unsupported {
            spec: uri.into(),
            what: format!(
                "head_dim {head_dim} on this device ({lds} bytes of LDS needed, {} allowed)",
                dev.lds_per_block
            ),
        });
    }
    Ok(())
}

/// Device bytes freed on drop.
struct DevMem {
    api: &'static HipApi,
    ptr: *mut c_void,
    bytes: usize,
}

impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: ptr came from hipMalloc and is freed once; hipFree waits for the kernels that
        // may still use it.
        unsafe { (self.api.free)(self.ptr) };
    }
}

/// Device scratch of the attention launches, grown on demand and kept.
#[derive(Default)]
pub struct AttnState {
    /// Block tables, lengths and tile lists, and the bytes they hold now.
    ints: Option<DevMem>,
    ints_last: Vec<u8>,
    /// Sync decode partials.
    partials: Option<DevMem>,
    /// Async decode workspace; zero between launches (the kernel restores what it used).
    accum: Option<DevMem>,
    counters: Option<DevMem>,
}

/// `slot` with at least `bytes` bytes (zeroed when newly allocated and `zero`); its address.
fn grow(b: &RocmBackend, slot: &mut Option<DevMem>, bytes: usize, zero: bool, what: &str) -> Result<u64> {
    let have = slot.as_ref().map_or(0, |m| m.bytes);
    if bytes > have || slot.is_none() {
        // The old allocation is freed first; hipFree waits for the kernels still using it.
        *slot = None;
        let cap = crate::backend::layer_plan::scratch_capacity(have, bytes.max(4)).next_multiple_of(4);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter; DevMem frees it.
        b.api.check(
            unsafe { (b.api.malloc)(&mut ptr, cap) },
            &format!("hipMalloc of the attention {what} ({cap} bytes)"),
        )?;
        *slot = Some(DevMem {
            api: b.api,
            ptr,
            bytes: cap,
        });
        if zero {
            // SAFETY: the allocation holds cap bytes = cap / 2 16-bit words; ordered on fdpp's
            // stream before any kernel that reads it.
            b.api.check(
                unsafe { (b.api.memset_d16_async)(ptr, 0, cap / 2, b.stream) },
                &format!("zeroing the attention {what}"),
            )?;
        }
    }
    slot.as_ref()
        .map(|m| m.ptr as u64)
        .ok_or_else(|| FdppError::device("rocm", format!("attention {what} missing")))
}

/// `host` on the device (copied after anything queued before it, unless unchanged since the
/// last call) and its address. The bytes stay in the state until the next upload.
fn upload_ints(b: &RocmBackend, st: &mut AttnState, host: &[i32]) -> Result<u64> {
    let bytes: Vec<u8> = host.iter().flat_map(|x| x.to_le_bytes()).collect();
    if bytes.len() > st.ints.as_ref().map_or(0, |m| m.bytes) {
        // A new allocation holds nothing yet.
        st.ints_last.clear();
    }
    let base = grow(b, &mut st.ints, bytes.len(), false, "block tables")?;
    if !bytes.is_empty() && st.ints_last != bytes {
        st.ints_last = bytes;
        // SAFETY: the scratch holds at least ints_last.len() bytes; the copy is ordered on
        // fdpp's stream after every kernel queued before that reads the scratch.
        b.api.check(
            unsafe {
                (b.api.memcpy_htod_async)(
                    base as *mut c_void,
                    st.ints_last.as_ptr().cast(),
                    st.ints_last.len(),
                    b.stream,
                )
            },
            "hipMemcpyHtoDAsync (attention block tables)",
        )?;
    }
    Ok(base)
}

/// The counter slot a launch adds its recomputed rows to: the per-call slot (reset first) when
/// counting, the running total otherwise.
fn counter_ptr(b: &RocmBackend, st: &mut AttnState, counting: bool) -> Result<u64> {
    let base = grow(b, &mut st.counters, 8, true, "counters")?;
    if !counting {
        return Ok(base + 4 * RUNNING as u64);
    }
    let at = base + 4 * PER_CALL as u64;
    reset_counter(b, at)?;
    Ok(at)
}

fn reset_counter(b: &RocmBackend, at: u64) -> Result<()> {
    // SAFETY: `at` is one u32 slot of the counters (two 16-bit words).
    b.api.check(
        unsafe { (b.api.memset_d16_async)(at as *mut c_void, 0, 2, b.stream) },
        "resetting the recompute counter",
    )
}

fn read_counter(b: &RocmBackend, st: &AttnState, slot: usize) -> Result<usize> {
    let base = st
        .counters
        .as_ref()
        .ok_or_else(|| FdppError::device("rocm", "attention counters missing"))?
        .ptr as u64;
    b.synchronize()?;
    let mut v = 0u32;
    // SAFETY: one u32 from a live allocation of at least two; the stream is idle.
    b.api.check(
        unsafe {
            (b.api.memcpy)(
                (&mut v as *mut u32).cast(),
                (base + 4 * slot as u64) as *const c_void,
                4,
                hip::MEMCPY_DEVICE_TO_HOST,
            )
        },
        "reading the recompute counter",
    )?;
    Ok(v as usize)
}

/// Read and reset the running recompute total of the enqueue paths.
pub fn take_recomputed(b: &RocmBackend) -> Result<usize> {
    let st = b.attn.borrow();
    let Some(c) = st.counters.as_ref() else {
        return Ok(0);
    };
    let base = c.ptr as u64;
    let n = read_counter(b, &st, RUNNING)?;
    reset_counter(b, base + 4 * RUNNING as u64)?;
    Ok(n)
}

fn run(b: &RocmBackend, f: hip::Function, l: &AttnLaunch, what: &str) -> Result<()> {
    if l.args.len() > MAX_ARGS {
        return Err(FdppError::device(
            "rocm",
            format!("{what}: {} kernel arguments", l.args.len()),
        ));
    }
    let mut vals = [0u64; MAX_ARGS];
    for (v, a) in vals.iter_mut().zip(&l.args) {
        *v = a.slot();
    }
    let mut ptrs: Vec<*mut c_void> = vals[..l.args.len()]
        .iter_mut()
        .map(|v| (v as *mut u64).cast())
        .collect();
    // SAFETY: ptrs point at live slots matching the kernel's parameter list in order (checked
    // against the sources by the tests below); grid and block come from the plan the kernel's
    // indexing was written against; all LDS is static.
    let r = unsafe {
        (b.api.module_launch_kernel)(
            f,
            l.grid.0,
            l.grid.1,
            l.grid.2,
            l.block,
            1,
            1,
            0,
            b.stream,
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    b.api.check(r, &format!("launch {what}"))
}

fn check_dtypes(what: &str, want: crate::dtype::DType, bufs: &[&RocmBuffer]) -> Result<()> {
    if bufs.iter().any(|x| x.dtype() != want) {
        return Err(FdppError::InvalidArgument(format!(
            "{what}: every buffer must be {want}"
        )));
    }
    Ok(())
}

fn addr(x: &RocmBuffer) -> u64 {
    x.ptr as u64
}

/// Split-KV decode. `counting`: wait for the device and return the exact recompute count.
pub fn decode(
    b: &RocmBackend,
    p: &DecodeParams,
    q: &RocmBuffer,
    kv: &PagedKv<RocmBuffer>,
    out: &mut RocmBuffer,
    counting: bool,
) -> Result<AttnStats> {
    p.validate(&kv.layout, q.len(), out.len(), (kv.k.len(), kv.v.len()))?;
    check_dtypes("decode attention", p.dtype, &[q, &kv.k, &kv.v, out])?;
    let plan = DecodePlan::new(p, b.dev.info.compute_units as usize, None);
    let src = sources::attn_decode_source(p.dtype, plan.head_dim, plan.hg);
    if b.dev.wave != 32 && b.dev.wave != 64 {
        return Err(FdppError::Unsupported {
            spec: src.uri,
            what: format!("a wavefront of {} lanes (32 or 64 expected)", b.dev.wave),
        });
    }
    let mut st = b.attn.borrow_mut();
    let (host, lens_at) = attn_plan::decode_ints(p);
    let tables = upload_ints(b, &mut st, &host)?;
    let mut x = DecodePtrs {
        q: addr(q),
        k: addr(&kv.k),
        v: addr(&kv.v),
        tables,
        lens: tables + 4 * lens_at as u64,
        out: addr(out),
        ..Default::default()
    };
    let asynch = matches!(p.scheme, SoftmaxScheme::Async { .. });
    if asynch {
        x.ws = grow(b, &mut st.accum, 4 * plan.accum_words(), true, "accumulators")?;
        x.counter = counter_ptr(b, &mut st, counting)?;
    } else if let Some(n) = plan.partial_elems() {
        x.part = grow(b, &mut st.partials, 4 * n, false, "partials")?;
    }
    let dims = Dims {
        max_pages: i32_of(p.tables.max_pages, "max_pages")?,
        page_size: i32_of(kv.layout.page_size, "page_size")?,
        scale2: p.geom.scale() * LOG2E,
    };
    let what = format!(
        "{} at batch {}, kv_len ≤ {}, {} splits",
        src.uri, plan.batch, plan.max_len, plan.splits
    );
    for l in decode_launches(&plan, p.scheme, &x, dims)? {
        let f = b.function(&src, l.kernel)?;
        run(b, f, &l, &format!("{} of {what}", l.kernel))?;
    }
    let recomputed = if asynch && counting {
        read_counter(b, &st, PER_CALL)?
    } else {
        0
    };
    Ok(AttnStats {
        rows: plan.rows,
        recomputed,
        splits: plan.splits,
    })
}

/// Causal prefill: append the new K and V to the cache, then attend.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    b: &RocmBackend,
    p: &PrefillParams,
    q: &RocmBuffer,
    k: &RocmBuffer,
    v: &RocmBuffer,
    kv: &mut PagedKv<RocmBuffer>,
    out: &mut RocmBuffer,
    counting: bool,
) -> Result<AttnStats> {
    p.validate(
        &kv.layout,
        (q.len(), out.len()),
        (k.len(), v.len()),
        (kv.k.len(), kv.v.len()),
    )?;
    check_dtypes("prefill attention", p.dtype, &[q, k, v, &kv.k, &kv.v, out])?;
    let g = p.geom;
    let src = sources::attn_prefill_source(p.dtype, g.head_dim);
    // Declined before the append: a device that cannot attend leaves the cache as it was.
    prefill_supported(&b.dev, g.head_dim, &src.uri)?;
    b.kv_append(
        &KvAppendParams {
            tables: p.tables.clone(),
            new_lens: p.new_lens.clone(),
        },
        k,
        v,
        kv,
    )?;
    attend(b, p, q, kv, out, counting, &src)
}

/// Causal prefill of new tokens whose K and V the cache already holds: attend only.
pub fn prefill_cached(
    b: &RocmBackend,
    p: &PrefillParams,
    q: &RocmBuffer,
    kv: &PagedKv<RocmBuffer>,
    out: &mut RocmBuffer,
    counting: bool,
) -> Result<AttnStats> {
    p.validate_cached(&kv.layout, (q.len(), out.len()), (kv.k.len(), kv.v.len()))?;
    check_dtypes("prefill attention", p.dtype, &[q, &kv.k, &kv.v, out])?;
    let src = sources::attn_prefill_source(p.dtype, p.geom.head_dim);
    prefill_supported(&b.dev, p.geom.head_dim, &src.uri)?;
    attend(b, p, q, kv, out, counting, &src)
}

/// The attention of [`prefill`] and [`prefill_cached`], whose callers validated the params and
/// buffers and checked that the device runs `src`.
fn attend(
    b: &RocmBackend,
    p: &PrefillParams,
    q: &RocmBuffer,
    kv: &PagedKv<RocmBuffer>,
    out: &mut RocmBuffer,
    counting: bool,
    src: &sources::KernelSource,
) -> Result<AttnStats> {
    let g = p.geom;
    let tiles = attn_plan::prefill_tiles(p, PREFILL_BM)?;
    let mut st = b.attn.borrow_mut();
    let (host, tiles_at) = attn_plan::prefill_ints(p, &tiles);
    let table = upload_ints(b, &mut st, &host)?;
    let asynch = matches!(p.scheme, SoftmaxScheme::Async { .. });
    let x = PrefillPtrs {
        q: addr(q),
        k: addr(&kv.k),
        v: addr(&kv.v),
        table,
        tiles: table + 4 * tiles_at as u64,
        counter: if asynch { counter_ptr(b, &mut st, counting)? } else { 0 },
        out: addr(out),
    };
    let dims = Dims {
        max_pages: i32_of(p.tables.max_pages, "max_pages")?,
        page_size: i32_of(kv.layout.page_size, "page_size")?,
        scale2: g.scale() * LOG2E,
    };
    let l = prefill_launch(tiles.len(), g.num_heads, g.num_kv_heads, p.scheme, &x, dims)?;
    let f = b.function(src, l.kernel)?;
    let what = format!(
        "{} of {} at {} new tokens of {} sequences",
        l.kernel,
        src.uri,
        p.tokens(),
        p.batch()
    );
    run(b, f, &l, &what)?;
    let recomputed = if asynch && counting {
        read_counter(b, &st, PER_CALL)?
    } else {
        0
    };
    Ok(AttnStats {
        rows: p.tokens() * g.num_heads,
        recomputed,
        splits: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendKind, DeviceInfo};
    use crate::dtype::DType;
    use crate::kv::paged::{BlockTable, FlatBlockTables, PagedKvLayout};
    use crate::ops::attention::AttnGeometry;
    use rand::{Rng, SeedableRng};

    #[derive(Debug, PartialEq)]
    enum Kind {
        Ptr,
        I32,
        F32,
    }

    /// The parameter kinds of `name` as declared in a kernel source.
    fn params(src: &str, name: &str) -> Vec<Kind> {
        let at = src
            .find(&format!("\n{name}("))
            .unwrap_or_else(|| panic!("no entry point {name}"));
        let rest = &src[at + name.len() + 2..];
        let list = &rest[..rest.find(')').unwrap()];
        list.split(',')
            .map(|p| {
                let p = p.trim();
                if p.contains('*') {
                    Kind::Ptr
                } else if p.starts_with("int ") {
                    Kind::I32
                } else if p.starts_with("float ") {
                    Kind::F32
                } else {
                    panic!("{name}: unexpected parameter {p}")
                }
            })
            .collect()
    }

    fn kinds(l: &AttnLaunch) -> Vec<Kind> {
        l.args
            .iter()
            .map(|a| match a {
                Arg::Ptr(_) => Kind::Ptr,
                Arg::I32(_) => Kind::I32,
                Arg::F32(_) => Kind::F32,
            })
            .collect()
    }

    fn decode_params(heads: usize, kvh: usize, lens: &[usize], splits: Option<usize>) -> DecodeParams {
        let layout = PagedKvLayout::new(16, 2048, kvh, 128, DType::F16).unwrap();
        let mut next = 0u32;
        let ts: Vec<BlockTable> = lens
            .iter()
            .map(|&len| {
                let n = layout.pages_for(len) as u32;
                let t = BlockTable {
                    pages: (next..next + n).collect(),
                    seq_len: len,
                };
                next += n;
                t
            })
            .collect();
        DecodeParams {
            geom: AttnGeometry::new(heads, kvh, 128).unwrap(),
            dtype: DType::F16,
            scheme: SoftmaxScheme::Sync,
            tables: FlatBlockTables::new(&layout, &ts).unwrap(),
            num_splits: splits,
        }
    }

    const DIMS: Dims = Dims {
        max_pages: 7,
        page_size: 16,
        scale2: 0.125,
    };

    #[test]
    fn decode_arguments_match_the_kernel_parameter_lists() {
        let src = sources::attn_decode_source(DType::F16, 128, 4).text;
        let x = DecodePtrs {
            q: 1,
            k: 2,
            v: 3,
            tables: 4,
            lens: 5,
            part: 6,
            ws: 7,
            counter: 8,
            out: 9,
        };
        let p = decode_params(32, 8, &[1000, 3000], Some(4));
        let plan = DecodePlan::new(&p, 104, None);
        let ls = decode_launches(&plan, SoftmaxScheme::Sync, &x, DIMS).unwrap();
        assert_eq!(
            ls.iter().map(|l| l.kernel).collect::<Vec<_>>(),
            ["attn_decode_sync", "attn_combine"]
        );
        for l in &ls {
            assert_eq!(kinds(l), params(&src, l.kernel), "{}", l.kernel);
            assert_eq!(l.block, DECODE_THREADS);
        }
        assert_eq!(ls[0].grid, (4, 16, 1));
        assert_eq!(ls[0].args[9], Arg::I32(4));
        assert_eq!(ls[0].args[10], Arg::F32(0.125));
        assert_eq!(ls[0].args[11], Arg::Ptr(6));
        assert_eq!(ls[0].args[12], Arg::Ptr(9));
        assert_eq!(ls[1].grid, (64, 1, 1));
        assert_eq!(ls[1].args, vec![Arg::Ptr(6), Arg::I32(64), Arg::I32(4), Arg::Ptr(9)]);

        // One split: no combine.
        let p1 = decode_params(32, 8, &[100], Some(1));
        let ls = decode_launches(&DecodePlan::new(&p1, 104, None), SoftmaxScheme::Sync, &x, DIMS).unwrap();
        assert_eq!(ls.len(), 1);

        let a = SoftmaxScheme::Async {
            phi: 2.0,
            a: -30.0,
            b: 10.0,
        };
        let ls = decode_launches(&plan, a, &x, DIMS).unwrap();
        assert_eq!(ls.len(), 1);
        assert_eq!(ls[0].kernel, "attn_decode_async");
        assert_eq!(kinds(&ls[0]), params(&src, "attn_decode_async"));
        assert!(ls[0].args.len() <= MAX_ARGS);
        let (phi2, a2, b2) = window(a);
        assert_eq!(
            &ls[0].args[11..],
            &[
                Arg::F32(phi2),
                Arg::F32(a2),
                Arg::F32(b2),
                Arg::Ptr(7),
                Arg::Ptr(8),
                Arg::Ptr(9)
            ]
        );
    }

    #[test]
    fn prefill_arguments_match_the_kernel_parameter_lists() {
        let src = sources::attn_prefill_source(DType::Bf16, 64).text;
        let x = PrefillPtrs {
            q: 1,
            k: 2,
            v: 3,
            table: 4,
            tiles: 5,
            counter: 6,
            out: 7,
        };
        let l = prefill_launch(9, 32, 8, SoftmaxScheme::Sync, &x, DIMS).unwrap();
        assert_eq!(l.kernel, "attn_prefill_sync");
        assert_eq!(kinds(&l), params(&src, l.kernel));
        assert_eq!((l.grid, l.block), ((9, 32, 1), 256));
        assert_eq!(l.args.last(), Some(&Arg::Ptr(7)));
        let l = prefill_launch(9, 32, 8, SoftmaxScheme::ASYNC_DEFAULT, &x, DIMS).unwrap();
        assert_eq!(l.kernel, "attn_prefill_async");
        assert_eq!(kinds(&l), params(&src, l.kernel));
        assert_eq!(&l.args[l.args.len() - 2..], &[Arg::Ptr(6), Arg::Ptr(7)]);
    }

    #[test]
    fn launch_constants_match_the_kernel_sources() {
        let dec = sources::attn_decode_source(DType::F16, 64, 1).text;
        assert!(dec.contains(&format!("constexpr int THREADS = {DECODE_THREADS};")));
        let pre = sources::attn_prefill_source(DType::F16, 64).text;
        assert!(pre.contains(&format!("constexpr int WAVE = {PREFILL_WAVE};")));
        assert!(pre.contains(&format!("constexpr int WAVES = {PREFILL_WAVES};")));
        assert!(pre.contains("constexpr int BN = D == 256 ? 32 : 64;"));
        assert!(pre.contains("constexpr int KSTR = D + 8;"));
        assert_eq!(PREFILL_BM, 64);
        // K and V tiles fit the 64 KiB of LDS a CDNA block may use, at every head_dim.
        for d in [64, 128, 256] {
            assert!(prefill_lds_bytes(d) <= 64 * 1024, "d{d}");
        }
        assert_eq!(prefill_lds_bytes(128), 2 * 64 * 136 * 2);
        assert_eq!(prefill_lds_bytes(256), 2 * 32 * 264 * 2);
    }

    fn device(arch: &str, wave: u32, lds: u32) -> RocmDevice {
        RocmDevice {
            info: DeviceInfo {
                backend: BackendKind::Rocm,
                ordinal: 0,
                name: "test".into(),
                slug: "test".into(),
                arch: arch.into(),
                compute_units: 104,
                memory_bytes: 0,
                l2_bytes: 0,
                driver_version: None,
                runtime_version: None,
            },
            wave,
            lds_per_block: lds,
        }
    }

    #[test]
    fn prefill_is_declined_where_the_kernel_cannot_run() {
        assert!(prefill_supported(&device("gfx90a:sramecc+:xnack-", 64, 65536), 256, "u").is_ok());
        assert!(prefill_supported(&device("gfx942", 64, 65536), 128, "u").is_ok());
        let e = prefill_supported(&device("gfx1100", 32, 65536), 128, "attn_prefill_f16_d128").unwrap_err();
        assert!(matches!(e, FdppError::Unsupported { .. }));
        assert!(
            e.to_string().contains("gfx1100") && e.to_string().contains("MFMA"),
            "{e}"
        );
        let e = prefill_supported(&device("gfx90a", 64, 16384), 128, "u").unwrap_err();
        assert!(e.to_string().contains("LDS"), "{e}");
    }

    type Frag = [[f32; 4]; 64];

    /// v_mfma_f32_16x16x16 as the ISA lays it out on a wave64: lane l gives A[l%16][4·(l/16)+i]
    /// and B[4·(l/16)+i][l%16] (i = 0..3), and holds D[4·(l/16)+e][l%16] (e = 0..3); c += A·B.
    fn mfma(a: &Frag, b: &Frag, c: &mut Frag) {
        let mut am = [[0f32; 16]; 16];
        let mut bm = [[0f32; 16]; 16];
        for l in 0..64 {
            for i in 0..4 {
                am[l % 16][4 * (l / 16) + i] = a[l][i];
                bm[4 * (l / 16) + i][l % 16] = b[l][i];
            }
        }
        for (l, cl) in c.iter_mut().enumerate() {
            for (e, ce) in cl.iter_mut().enumerate() {
                let (r, col) = (4 * (l / 16) + e, l % 16);
                *ce += (0..16).map(|k| am[r][k] * bm[k][col]).sum::<f32>();
            }
        }
    }

    /// The four lanes l, l^16, l^32, l^48 that share a query row, combined as the two
    /// __shfl_xor steps (16, 32) combine them.
    fn quad(v: &[f32; 64], f: fn(f32, f32) -> f32) -> [f32; 64] {
        std::array::from_fn(|l| f(f(v[l], v[l ^ 16]), f(v[l ^ 32], v[l ^ 48])))
    }

    /// A CPU model of attn_prefill.hip's `walk` + `store` for one block of one head (the first
    /// walk, no recompute): every wavefront and lane loads, masks, reduces and stores what the
    /// kernel's does, with MFMA applied in its lane layout. `phi2`: the async scheme's φ (log2
    /// units), None for sync. Rows [rows][d] of the output; each stored exactly once.
    #[allow(clippy::needless_range_loop)]
    fn emulate_prefill(d: usize, rows: usize, pos0: usize, x: (&[f32], &[f32], &[f32]), phi2: Option<f32>) -> Vec<f32> {
        let (q, k, v) = x;
        let ninf = f32::NEG_INFINITY;
        let scale2 = LOG2E / (d as f32).sqrt();
        let bn = prefill_bn(d);
        let (jt, kst, dt) = (bn / 16, d / 16, d / 16);
        let kv_end = pos0 + rows;
        let mut out = vec![f32::NAN; rows * d];
        for w in 0..PREFILL_WAVES as usize {
            let mut qb = vec![[[0f32; 4]; 64]; kst];
            for l in 0..64 {
                let row = w * 16 + l % 16;
                if row < rows {
                    for ks in 0..kst {
                        for i in 0..4 {
                            qb[ks][l][i] = q[row * d + 16 * ks + 4 * (l / 16) + i];
                        }
                    }
                }
            }
            let mut o = vec![[[0f32; 4]; 64]; dt];
            let mut m = [phi2.unwrap_or(ninf); 64];
            let mut lsum = [0f32; 64];
            for n in 0..kv_end.div_ceil(bn) {
                // The LDS tile: keys past kv_end are zero.
                let tile = |src: &[f32], r: usize, c: usize| {
                    let key = n * bn + r;
                    if key < kv_end {
                        src[key * d + c]
                    } else {
                        0.0
                    }
                };
                let mut s = vec![[[0f32; 4]; 64]; jt];
                for j in 0..jt {
                    for ks in 0..kst {
                        let a: Frag = std::array::from_fn(|l| {
                            std::array::from_fn(|i| tile(k, 16 * j + l % 16, 16 * ks + 4 * (l / 16) + i))
                        });
                        mfma(&a, &qb[ks], &mut s[j]);
                    }
                }
                let mut tm = [ninf; 64];
                for l in 0..64 {
                    let qpos = pos0 + w * 16 + l % 16;
                    for j in 0..jt {
                        for e in 0..4 {
                            let key = n * bn + 16 * j + 4 * (l / 16) + e;
                            let xv = if key > qpos { ninf } else { s[j][l][e] * scale2 };
                            s[j][l][e] = xv;
                            tm[l] = tm[l].max(xv);
                        }
                    }
                }
                let tm = quad(&tm, f32::max);
                let mut pb = vec![[[0f32; 4]; 64]; jt];
                for l in 0..64 {
                    let mut corr = 1.0;
                    if phi2.is_none() {
                        let mn = m[l].max(tm[l]);
                        corr = if mn == ninf { 1.0 } else { (m[l] - mn).exp2() };
                        m[l] = mn;
                    }
                    let mut ls = 0.0;
                    for j in 0..jt {
                        for e in 0..4 {
                            let p = if s[j][l][e] == ninf {
                                0.0
                            } else {
                                (s[j][l][e] - m[l]).exp2()
                            };
                            ls += p;
                            pb[j][l][e] = p;
                        }
                    }
                    lsum[l] = lsum[l] * corr + ls;
                    for od in o.iter_mut() {
                        for e in 0..4 {
                            od[l][e] *= corr;
                        }
                    }
                }
                for j in 0..jt {
                    for (dd, od) in o.iter_mut().enumerate() {
                        let a: Frag = std::array::from_fn(|l| {
                            std::array::from_fn(|i| tile(v, 16 * j + 4 * (l / 16) + i, 16 * dd + l % 16))
                        });
                        mfma(&a, &pb[j], od);
                    }
                }
            }
            let lsum = quad(&lsum, |a, b| a + b);
            for l in 0..64 {
                let row = w * 16 + l % 16;
                if row >= rows {
                    continue;
                }
                for (dd, od) in o.iter().enumerate() {
                    for e in 0..4 {
                        let at = row * d + 16 * dd + 4 * (l / 16) + e;
                        assert!(out[at].is_nan(), "row {row} col {} stored twice", at % d);
                        out[at] = od[l][e] / lsum[l];
                    }
                }
            }
        }
        out
    }

    /// The MFMA lane layout (Sᵀ = K·Qᵀ, Oᵀ += Vᵀ·Pᵀ with P kept in registers), the causal mask
    /// and the tiling of attn_prefill.hip, checked against an exact causal softmax: a partial
    /// tile of rows, a cached prefix, every head_dim (so both key-tile sizes), both schemes.
    #[test]
    fn the_prefill_mfma_layout_computes_causal_attention() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(rand::random());
        for (d, rows, pos0) in [(64, 64, 0), (128, 37, 100), (256, 50, 13), (64, 1, 70)] {
            let keys = pos0 + rows;
            let mut gen = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
            let (q, k, v) = (gen(rows * d), gen(keys * d), gen(keys * d));
            let scale = 1.0 / (d as f64).sqrt();
            for phi2 in [None, Some(0.5f32)] {
                let got = emulate_prefill(d, rows, pos0, (&q, &k, &v), phi2);
                for r in 0..rows {
                    let qpos = pos0 + r;
                    let sc: Vec<f64> = (0..=qpos)
                        .map(|t| (0..d).map(|c| q[r * d + c] as f64 * k[t * d + c] as f64).sum::<f64>() * scale)
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = w.iter().sum();
                    for c in 0..d {
                        let want: f64 = w
                            .iter()
                            .enumerate()
                            .map(|(t, wt)| wt * v[t * d + c] as f64)
                            .sum::<f64>()
                            / z;
                        let g = got[r * d + c] as f64;
                        assert!(
                            (g - want).abs() < 1e-4,
                            "d{d} rows {rows} pos0 {pos0} {phi2:?} at ({r}, {c}): {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
