//! Launching the small per-layer kernels (kernels_cuda/layer.cu) on CUDA.
//!
//! The launch path is kept short on the host, since these kernels run for microseconds: each
//! dtype's module is compiled (or read from the disk cache) and all its entry points are looked up
//! once, then found by [`LayerKernel::index`] with no string building or hashing per launch. The
//! host arrays a launch reads (token ids, positions and inverse frequencies, KV slots, gathered
//! rows) are packed into one reused host buffer and copied with one async upload into a grow-only
//! device scratch; stream order keeps a later upload from overwriting arrays an earlier kernel
//! still reads.

use cudarc::driver::{CudaFunction, LaunchConfig};

use super::launch::Launch;
use super::upload::Upload;
use super::{drv, sources, CudaBackend, CudaBuffer};
use crate::backend::layer_plan::{self as plan, i32_dim, ArgPack, LayerKernel, LayerLaunch};
use crate::backend::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::{PagedKv, PagedKvLayout};
use crate::ops::layer::{
    BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams, PositionParams,
    RmsNormParams, RopeParams, SiluMulParams,
};

/// What the backend keeps between launches of the layer kernels.
#[derive(Default)]
pub struct LayerState {
    /// Every entry point of each dtype's module (f16, bf16), by [`LayerKernel::index`].
    kernels: [Option<Vec<CudaFunction>>; 2],
    /// Device copies of `pack`, one per kind of argument list (a decode step repeats the same
    /// positions and KV slots in every layer; each slot skips an upload equal to its last).
    uploads: [Upload; 4],
    pack: ArgPack,
}

/// Which upload slot an op's arguments go to.
#[derive(Clone, Copy)]
enum Slot {
    Rope = 0,
    Rows = 1,
    KvSlots = 2,
    /// add_positions' table rows (a step's positions, like the rope's, once per step).
    Positions = 3,
}

fn dtype_slot(dt: DType) -> usize {
    match dt {
        DType::F16 => 0,
        DType::Bf16 => 1,
    }
}

/// The loaded entry point `k` of the `dt` module; the first call per dtype loads all of them.
fn kernel(b: &CudaBackend, st: &mut LayerState, dt: DType, k: LayerKernel) -> Result<CudaFunction> {
    let slot = &mut st.kernels[dtype_slot(dt)];
    if slot.is_none() {
        let src = sources::layer_source(dt);
        let module = b.module(&src)?;
        let fns = LayerKernel::ALL
            .iter()
            .map(|k| {
                module
                    .load_function(k.name())
                    .map_err(drv(&format!("{}: function {}", src.uri, k.name())))
            })
            .collect::<Result<Vec<_>>>()?;
        *slot = Some(fns);
    }
    slot.as_ref()
        .and_then(|f| f.get(k.index()))
        .cloned()
        .ok_or_else(|| FdppError::device("cuda", format!("layer kernel {} not loaded", k.name())))
}

/// Copy the packed host arrays into their slot (skipped when the slot holds the same bytes);
/// returns the device address of the pack's byte 0.
fn upload_pack(b: &CudaBackend, st: &mut LayerState, slot: Slot) -> Result<u64> {
    let LayerState { uploads, pack, .. } = st;
    uploads[slot as usize].put(b, pack.bytes(), "layer-op arguments")
}

fn config(l: &LayerLaunch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: l.grid,
        block_dim: (l.block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Every buffer in `dt`, or an error naming the op and the buffer.
fn check_dtypes(op: &str, dt: DType, bufs: &[(&str, &CudaBuffer)]) -> Result<()> {
    match bufs.iter().find(|(_, b)| b.dtype() != dt) {
        Some((name, b)) => Err(FdppError::InvalidArgument(format!(
            "{op}: {name} is {}, the op runs in {dt}",
            b.dtype()
        ))),
        None => Ok(()),
    }
}

pub fn add_rmsnorm(
    b: &CudaBackend,
    p: &RmsNormParams,
    residual: &mut CudaBuffer,
    delta: Option<&CudaBuffer>,
    weight: &CudaBuffer,
    out: &mut CudaBuffer,
) -> Result<()> {
    p.validate(residual.len(), delta.map(|d| d.len()), weight.len(), out.len())?;
    check_dtypes(
        "add_rmsnorm",
        p.dtype,
        &[("residual", residual), ("weight", weight), ("out", out)],
    )?;
    if let Some(d) = delta {
        check_dtypes("add_rmsnorm", p.dtype, &[("delta", d)])?;
    }
    let l = plan::rmsnorm(p, 32)?;
    let hidden = i32_dim(p.hidden, "hidden", "add_rmsnorm")?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let (rp, dp, wp, op) = (
        b.ptr(residual),
        delta.map_or(0, |d| b.ptr(d)),
        b.ptr(weight),
        b.ptr(out),
    );
    let mut a = Launch::chained(b, &f);
    a.arg(&rp).arg(&dp).arg(&wp).arg(&op).arg(&hidden).arg(&p.eps);
    // SAFETY: validate() checked every buffer against rows × hidden; delta 0 is the kernel's "none".
    unsafe { a.launch(config(&l)) }.map_err(drv("launch add_rmsnorm"))?;
    b.check_launch("add_rmsnorm")
}

pub fn qkv_rope(
    b: &CudaBackend,
    p: &RopeParams,
    qkv: &CudaBuffer,
    bias: Option<&CudaBuffer>,
    q: &mut CudaBuffer,
    k: &mut CudaBuffer,
    v: &mut CudaBuffer,
) -> Result<()> {
    p.validate(qkv.len(), bias.map(|x| x.len()), q.len(), k.len(), v.len())?;
    check_dtypes("qkv_rope", p.dtype, &[("qkv", qkv), ("q", q), ("k", k), ("v", v)])?;
    let (kp, vp) = (b.ptr(k), b.ptr(v));
    launch_rope(b, p, qkv, bias, q, (kp, vp), None)
}

/// qkv_rope with the decode step's KV append fused in: the rotated k and the v of each token go
/// straight to its slot row of the pools (one launch instead of two; k and v stay untouched).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_append(
    b: &CudaBackend,
    rope: &RopeParams,
    append: &KvAppendParams,
    qkv: &CudaBuffer,
    bias: Option<&CudaBuffer>,
    q: &mut CudaBuffer,
    k: &CudaBuffer,
    v: &CudaBuffer,
    kv: &mut PagedKv<CudaBuffer>,
) -> Result<()> {
    rope.validate(qkv.len(), bias.map(|x| x.len()), q.len(), k.len(), v.len())?;
    let layout = kv.layout;
    layout.validate()?;
    append.validate(&layout, k.len(), v.len(), (kv.k.len(), kv.v.len()))?;
    if append.tokens() != rope.positions.len() || layout.token_elems() != rope.geom.num_kv_heads * rope.geom.head_dim {
        return Err(FdppError::InvalidArgument(format!(
            "qkv_rope_append: {} rotated tokens of {} kv heads × {} for {} appended tokens of width {}",
            rope.positions.len(),
            rope.geom.num_kv_heads,
            rope.geom.head_dim,
            append.tokens(),
            layout.token_elems()
        )));
    }
    check_dtypes(
        "qkv_rope_append",
        rope.dtype,
        &[("qkv", qkv), ("q", q), ("K pool", &kv.k), ("V pool", &kv.v)],
    )?;
    let slots = slot_rows(b, append, &layout)?;
    let pools = (b.ptr(&kv.k), b.ptr(&kv.v));
    launch_rope(b, rope, qkv, bias, q, pools, Some(slots))
}

/// The device address of the pool row of each appended token (uploaded when it changed).
pub(super) fn slot_rows(b: &CudaBackend, append: &KvAppendParams, layout: &PagedKvLayout) -> Result<u64> {
    let mut st = b.layer.borrow_mut();
    st.pack.clear();
    st.pack.push_i32s(plan::kv_slot_rows(append, layout)?);
    upload_pack(b, &mut st, Slot::KvSlots)
}

/// The device addresses of the tokens' positions and the inverse frequencies a rotary launch
/// reads (uploaded when they changed).
pub(super) fn rope_args(b: &CudaBackend, p: &RopeParams) -> Result<(u64, u64)> {
    let mut st = b.layer.borrow_mut();
    st.pack.clear();
    let pos_at = st.pack.push_i32s(p.positions.iter().copied());
    let freq_at = st.pack.push_f32s(&p.inv_freq);
    let base = upload_pack(b, &mut st, Slot::Rope)?;
    Ok((base + pos_at as u64, base + freq_at as u64))
}

/// The qkv_rope launch: k and v rows go to `kv.0` / `kv.1` at row t, or at row slots[t] when the
/// device array `slots` is given.
fn launch_rope(
    b: &CudaBackend,
    p: &RopeParams,
    qkv: &CudaBuffer,
    bias: Option<&CudaBuffer>,
    q: &mut CudaBuffer,
    kv: (u64, u64),
    slots: Option<u64>,
) -> Result<()> {
    if let Some(x) = bias {
        check_dtypes("qkv_rope", p.dtype, &[("bias", x)])?;
    }
    let l = plan::rope(p)?;
    let g = &p.geom;
    let dims = [
        i32_dim(g.num_heads, "num_heads", "qkv_rope")?,
        i32_dim(g.num_kv_heads, "num_kv_heads", "qkv_rope")?,
        i32_dim(g.head_dim, "head_dim", "qkv_rope")?,
    ];
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let (pos, freq) = rope_args(b, p)?;
    let (xp, bp, qp) = (b.ptr(qkv), bias.map_or(0, |x| b.ptr(x)), b.ptr(q));
    let (kp, vp) = kv;
    let sp = slots.unwrap_or(0);
    // The general kernel's two more arguments: rotary_dim (≤ head_dim, checked by the plan) and
    // the layout.
    let rot = [
        i32_dim(p.rotary_dim(), "rotary_dim", "qkv_rope")?,
        plan::rope_layout_code(p.layout),
    ];
    let mut a = Launch::chained(b, &f);
    a.arg(&xp).arg(&bp).arg(&qp).arg(&kp).arg(&vp).arg(&pos).arg(&freq);
    a.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&sp);
    if l.kernel == LayerKernel::QkvRopeG {
        a.arg(&rot[0]).arg(&rot[1]);
    }
    // SAFETY: the callers validated qkv, bias and q against tokens and the geometry, and k and v
    // (or, with slots, the pools and every slot row) against the tokens; positions (tokens i32)
    // and inv_freq (rotary_dim / 2 f32, 16-byte aligned) are in the scratch; the kernel's
    // parameters are these 11, and for qkv_rope_g the 2 more.
    unsafe { a.launch(config(&l)) }.map_err(drv("launch qkv_rope"))?;
    b.check_launch("qkv_rope")
}

pub fn silu_mul(b: &CudaBackend, p: &SiluMulParams, gate_up: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
    p.validate(gate_up.len(), out.len())?;
    check_dtypes("silu_mul", p.dtype, &[("gate_up", gate_up), ("out", out)])?;
    let l = plan::silu_mul(p)?;
    let (rows, inter) = (
        i32_dim(p.rows, "rows", "silu_mul")?,
        i32_dim(p.inter, "inter", "silu_mul")?,
    );
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let (gp, op) = (b.ptr(gate_up), b.ptr(out));
    let mut a = Launch::chained(b, &f);
    a.arg(&gp).arg(&op).arg(&rows).arg(&inter);
    // SAFETY: validate() checked gate_up (rows × 2·inter) and out (rows × inter).
    unsafe { a.launch(config(&l)) }.map_err(drv("launch silu_mul"))?;
    b.check_launch("silu_mul")
}

pub fn add_layernorm(
    b: &CudaBackend,
    p: &LayerNormParams,
    residual: &mut CudaBuffer,
    delta: Option<&CudaBuffer>,
    (weight, bias): (&CudaBuffer, &CudaBuffer),
    out: &mut CudaBuffer,
) -> Result<()> {
    p.validate(
        residual.len(),
        delta.map(|d| d.len()),
        weight.len(),
        bias.len(),
        out.len(),
    )?;
    check_dtypes(
        "add_layernorm",
        p.dtype,
        &[("residual", residual), ("weight", weight), ("bias", bias), ("out", out)],
    )?;
    if let Some(d) = delta {
        check_dtypes("add_layernorm", p.dtype, &[("delta", d)])?;
    }
    let l = plan::layernorm(p, 32)?;
    let hidden = i32_dim(p.hidden, "hidden", "add_layernorm")?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let (rp, dp, wp, bp, op) = (
        b.ptr(residual),
        delta.map_or(0, |d| b.ptr(d)),
        b.ptr(weight),
        b.ptr(bias),
        b.ptr(out),
    );
    let mut a = Launch::chained(b, &f);
    a.arg(&rp).arg(&dp).arg(&wp).arg(&bp).arg(&op).arg(&hidden).arg(&p.eps);
    // SAFETY: validate() checked every buffer against rows × hidden (weight and bias: hidden);
    // delta 0 is the kernel's "none".
    unsafe { a.launch(config(&l)) }.map_err(drv("launch add_layernorm"))?;
    b.check_launch("add_layernorm")
}

pub fn bias_act(b: &CudaBackend, p: &BiasActParams, x: &mut CudaBuffer, bias: Option<&CudaBuffer>) -> Result<()> {
    p.validate(x.len(), bias.map(|v| v.len()))?;
    check_dtypes("bias_act", p.dtype, &[("x", x)])?;
    if let Some(v) = bias {
        check_dtypes("bias_act", p.dtype, &[("bias", v)])?;
    }
    let l = plan::bias_act(p)?;
    let (rows, width, act) = (
        i32_dim(p.rows, "rows", "bias_act")?,
        i32_dim(p.width, "width", "bias_act")?,
        plan::act_code(p.act),
    );
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let (xp, bp) = (b.ptr(x), bias.map_or(0, |v| b.ptr(v)));
    let mut a = Launch::chained(b, &f);
    a.arg(&xp).arg(&bp).arg(&rows).arg(&width).arg(&act);
    // SAFETY: validate() checked x (rows × width) and bias (width); bias 0 is "none".
    unsafe { a.launch(config(&l)) }.map_err(drv("launch bias_act"))?;
    b.check_launch("bias_act")
}

/// act(gate) · up for any activation but SiLU, which the dispatch sends to [`silu_mul`].
pub fn glu(b: &CudaBackend, p: &GluParams, gate_up: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
    p.validate(gate_up.len(), out.len())?;
    check_dtypes("glu", p.dtype, &[("gate_up", gate_up), ("out", out)])?;
    let l = plan::glu(p)?;
    let (rows, inter, act) = (
        i32_dim(p.rows, "rows", "glu")?,
        i32_dim(p.inter, "inter", "glu")?,
        plan::act_code(p.act),
    );
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let (gp, op) = (b.ptr(gate_up), b.ptr(out));
    let mut a = Launch::chained(b, &f);
    a.arg(&gp).arg(&op).arg(&rows).arg(&inter).arg(&act);
    // SAFETY: validate() checked gate_up (rows × 2·inter) and out (rows × inter).
    unsafe { a.launch(config(&l)) }.map_err(drv("launch glu"))?;
    b.check_launch("glu")
}

/// out[t] += table[positions[t] + offset]. The table rows go up through their own upload slot,
/// skipped when equal to the last (the uploads of a decode step, graph.rs).
pub fn add_positions(b: &CudaBackend, p: &PositionParams, table: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
    p.validate(table.len(), out.len())?;
    check_dtypes("add_positions", p.dtype, &[("table", table), ("out", out)])?;
    let l = plan::add_positions(p)?;
    let hidden = i32_dim(p.hidden, "hidden", "add_positions")?;
    let mut st = b.layer.borrow_mut();
    let f = kernel(b, &mut st, p.dtype, l.kernel)?;
    st.pack.clear();
    st.pack.push_i32s(plan::position_rows(p)?);
    let rp = upload_pack(b, &mut st, Slot::Positions)?;
    let (op, tp) = (b.ptr(out), b.ptr(table));
    let mut a = Launch::chained(b, &f);
    a.arg(&op).arg(&tp).arg(&rp).arg(&hidden);
    // SAFETY: validate() checked out (tokens × hidden), the table (table_rows × hidden) and
    // every position + offset against table_rows.
    unsafe { a.launch(config(&l)) }.map_err(drv("launch add_positions"))?;
    b.check_launch("add_positions")
}

/// Where a gather's row indices come from: the host (uploaded with the launch) or the device.
enum RowIds<'a> {
    Host(&'a [i32]),
    /// `n` indices at this device address (the newest queued greedy choice).
    Device(u64, usize),
}

/// dst[i] = src[rows[i] - offset] over rows of `width` (a zero row outside src), for the
/// embedding lookup and gather_rows.
#[allow(clippy::too_many_arguments)]
fn gather(
    b: &CudaBackend,
    dt: DType,
    rows: RowIds,
    offset: usize,
    width: usize,
    src: &CudaBuffer,
    dst: &mut CudaBuffer,
    op: &'static str,
) -> Result<()> {
    let n = match rows {
        RowIds::Host(r) => r.len(),
        RowIds::Device(_, n) => n,
    };
    let l = plan::gather(n, width)?;
    let w = i32_dim(width, "row width", op)?;
    let limit = i32_dim(src.len() / width.max(1), "source rows", op)?;
    let offset = i32_dim(offset, "first row id", op)?;
    let mut st = b.layer.borrow_mut();
    let f = kernel(b, &mut st, dt, l.kernel)?;
    let rp = match rows {
        RowIds::Host(r) => {
            st.pack.clear();
            st.pack.push_i32s(r.iter().copied());
            upload_pack(b, &mut st, Slot::Rows)?
        }
        RowIds::Device(p, _) => p,
    };
    let (sp, dp) = (b.ptr(src), b.ptr(dst));
    let mut a = Launch::chained(b, &f);
    a.arg(&sp).arg(&dp).arg(&rp).arg(&w).arg(&limit).arg(&offset);
    // SAFETY: the caller validated dst against rows × width; the kernel bounds every row index
    // (less `offset`) by `limit`, the rows src holds.
    unsafe { a.launch(config(&l)) }.map_err(drv(op))?;
    b.check_launch(op)
}

pub fn embedding(b: &CudaBackend, p: &EmbeddingParams, table: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
    p.validate(table.len(), out.len())?;
    check_dtypes("embedding", p.dtype, &[("table", table), ("out", out)])?;
    gather(
        b,
        p.dtype,
        RowIds::Host(&p.local_rows()),
        0,
        p.hidden,
        table,
        out,
        "launch embedding",
    )
}

/// The embedding of `p.ids.len()` tokens whose ids are at device address `ids` (u32, read as
/// i32: an id of 2³¹ or more, like the NaN mark, gives a zero row).
pub fn embedding_fed(
    b: &CudaBackend,
    p: &EmbeddingParams,
    ids: u64,
    table: &CudaBuffer,
    out: &mut CudaBuffer,
) -> Result<()> {
    p.validate(table.len(), out.len())?;
    check_dtypes("embedding", p.dtype, &[("table", table), ("out", out)])?;
    let n = p.ids.len();
    gather(
        b,
        p.dtype,
        RowIds::Device(ids, n),
        p.held.map_or(0, |(first, _)| first),
        p.hidden,
        table,
        out,
        "launch embedding (fed)",
    )
}

pub fn gather_rows(b: &CudaBackend, p: &GatherParams, src: &CudaBuffer, dst: &mut CudaBuffer) -> Result<()> {
    p.validate(src.len(), dst.len())?;
    check_dtypes("gather_rows", p.dtype, &[("src", src), ("dst", dst)])?;
    gather(
        b,
        p.dtype,
        RowIds::Host(&p.rows),
        0,
        p.width,
        src,
        dst,
        "launch gather_rows",
    )
}

pub fn kv_append(
    b: &CudaBackend,
    p: &KvAppendParams,
    k: &CudaBuffer,
    v: &CudaBuffer,
    kv: &mut PagedKv<CudaBuffer>,
) -> Result<()> {
    let layout = kv.layout;
    layout.validate()?;
    p.validate(&layout, k.len(), v.len(), (kv.k.len(), kv.v.len()))?;
    check_dtypes(
        "kv_append",
        layout.dtype,
        &[("k", k), ("v", v), ("K pool", &kv.k), ("V pool", &kv.v)],
    )?;
    let l = plan::scatter_kv(p.tokens(), layout.token_elems())?;
    let w = i32_dim(layout.token_elems(), "kv_heads × head_dim", "kv_append")?;
    let mut st = b.layer.borrow_mut();
    let f = kernel(b, &mut st, layout.dtype, l.kernel)?;
    st.pack.clear();
    st.pack.push_i32s(plan::kv_slot_rows(p, &layout)?);
    let sp = upload_pack(b, &mut st, Slot::KvSlots)?;
    let (kp, vp, kpool, vpool) = (b.ptr(k), b.ptr(v), b.ptr(&kv.k), b.ptr(&kv.v));
    let mut a = Launch::chained(b, &f);
    a.arg(&kp).arg(&vp).arg(&kpool).arg(&vpool).arg(&sp).arg(&w);
    // SAFETY: validate() checked k and v against the new tokens and every used block-table entry
    // against the pool, so each slot row lies inside both pools.
    unsafe { a.launch(config(&l)) }.map_err(drv("launch kv_append"))?;
    b.check_launch("kv_append")
}

pub fn fill_random(b: &CudaBackend, buf: &mut CudaBuffer, seed: u64, scale: f32) -> Result<()> {
    let len = buf.len() as u64;
    if len == 0 {
        return Ok(());
    }
    let l = plan::fill_random(buf.len());
    let f = kernel(b, &mut b.layer.borrow_mut(), buf.dtype(), l.kernel)?;
    let p = b.ptr(buf);
    let mut a = Launch::plain(b, &f);
    a.arg(&p).arg(&len).arg(&seed).arg(&scale);
    // SAFETY: the kernel writes elements 0..len of buf.
    unsafe { a.launch(config(&l)) }.map_err(drv("launch fill_random"))?;
    b.check_launch("fill_random")
}

/// w[n, k] = round(w[n, k] · scale[k]) (see [`crate::backend::Backend::scale_cols`]).
pub fn scale_cols(b: &CudaBackend, w: &mut CudaBuffer, scale: &CudaBuffer, rows: usize, cols: usize) -> Result<()> {
    crate::backend::check_scale_cols((w.len(), w.dtype()), (scale.len(), scale.dtype()), rows, cols)?;
    let c = i32_dim(cols, "cols", "scale_cols")?;
    let len = w.len() as u64;
    let l = plan::scale_cols(w.len());
    let f = kernel(b, &mut b.layer.borrow_mut(), w.dtype(), l.kernel)?;
    let (wp, sp) = (b.ptr(w), b.ptr(scale));
    let mut a = Launch::plain(b, &f);
    a.arg(&wp).arg(&sp).arg(&len).arg(&c);
    // SAFETY: w holds len = rows · cols elements and scale cols (checked above).
    unsafe { a.launch(config(&l)) }.map_err(drv("launch scale_cols"))?;
    b.check_launch("scale_cols")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dtype_has_one_self_contained_layer_module_in_the_compiled_set() {
        for dt in [DType::F16, DType::Bf16] {
            let s = sources::layer_source(dt);
            assert_eq!(s.uri, format!("layer_{dt}"));
            assert_eq!(s.defines, vec![crate::backend::kernel_cache::dtype_define(dt)]);
            assert!(
                !s.text.contains("#include \"common.cuh\""),
                "common.cuh is expanded in place"
            );
            assert!(s.text.contains("__device__ __forceinline__ float warp_sum"));
            assert!(sources::all_sources().contains(&s), "fdpp kernels check compiles it");
        }
        assert_eq!((dtype_slot(DType::F16), dtype_slot(DType::Bf16)), (0, 1));
    }

    #[test]
    fn a_layer_state_starts_empty() {
        let st = LayerState::default();
        assert!(st.kernels.iter().all(|k| k.is_none()));
        assert!(st.pack.bytes().is_empty());
    }
}
