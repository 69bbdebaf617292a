//! Launching the small per-layer kernels (kernels_hip/layer.hip) on ROCm, in the shape of the
//! CUDA backend's layer.rs: each dtype's module is loaded once with every entry point looked up,
//! the host arrays of a launch go up in one copy into a grow-only device scratch, and the launch
//! geometry comes from [`crate::backend::layer_plan`] (shared with CUDA, unit-tested on the CPU).

use std::ffi::{c_void, CString};

use super::hip::{Function, HipApi};
use super::{sources, RocmBackend, RocmBuffer};
use crate::backend::layer_plan::{self as plan, i32_dim, ArgPack, LayerKernel, LayerLaunch};
use crate::backend::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::layer::{
    BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams, PositionParams,
    RmsNormParams, RopeParams, SiluMulParams,
};

// Kernel arguments are passed as 8-byte slots holding each value in its low bytes (below).
const _: () = assert!(
    cfg!(target_endian = "little"),
    "kernel argument slots assume a little-endian host"
);

/// Block sizes of add_rmsnorm are rounded to this many threads: a multiple of both wavefront
/// widths, so the kernel's per-wavefront reduction sees whole wavefronts whatever the arch.
const RMS_WAVE: u32 = 64;
/// Most arguments a layer kernel takes (qkv_rope_g: 12).
const MAX_ARGS: usize = 12;

/// Device bytes freed on drop.
struct Scratch {
    api: &'static HipApi,
    ptr: *mut c_void,
    cap: usize,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: ptr came from hipMalloc and is freed once; hipFree waits for the kernels
        // that may still read it.
        unsafe { (self.api.free)(self.ptr) };
    }
}

/// What the backend keeps between launches of the layer kernels.
#[derive(Default)]
pub struct LayerState {
    /// Every entry point of each dtype's module (f16, bf16), by [`LayerKernel::index`].
    kernels: [Option<Vec<Function>>; 2],
    scratch: Option<Scratch>,
    pack: ArgPack,
}

fn dtype_slot(dt: DType) -> usize {
    match dt {
        DType::F16 => 0,
        DType::Bf16 => 1,
    }
}

fn kernel(b: &RocmBackend, st: &mut LayerState, dt: DType, k: LayerKernel) -> Result<Function> {
    let slot = &mut st.kernels[dtype_slot(dt)];
    if slot.is_none() {
        let src = sources::layer_source(dt);
        let module = b.module(&src)?;
        let mut fns = Vec::with_capacity(LayerKernel::ALL.len());
        for k in LayerKernel::ALL {
            let cname = CString::new(k.name()).map_err(|e| FdppError::device("rocm", e))?;
            let mut f: Function = std::ptr::null_mut();
            // SAFETY: module is loaded; cname is NUL-terminated.
            b.api.check(
                unsafe { (b.api.module_get_function)(&mut f, module, cname.as_ptr()) },
                &format!("{}: hipModuleGetFunction({})", src.uri, k.name()),
            )?;
            fns.push(f);
        }
        *slot = Some(fns);
    }
    slot.as_ref()
        .and_then(|f| f.get(k.index()))
        .copied()
        .ok_or_else(|| FdppError::device("rocm", format!("layer kernel {} not loaded", k.name())))
}

/// Copy the packed host arrays into the scratch (growing it first); returns its device address.
fn upload_pack(b: &RocmBackend, st: &mut LayerState) -> Result<u64> {
    let LayerState { scratch, pack, .. } = st;
    let need = pack.bytes().len();
    let have = scratch.as_ref().map_or(0, |s| s.cap);
    if need > have {
        *scratch = None;
        let cap = plan::scratch_capacity(have, need);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter; Scratch frees it.
        b.api.check(
            unsafe { (b.api.malloc)(&mut ptr, cap) },
            &format!("hipMalloc of the layer-op scratch ({cap} bytes)"),
        )?;
        *scratch = Some(Scratch { api: b.api, ptr, cap });
    }
    let s = scratch
        .as_ref()
        .ok_or_else(|| FdppError::device("rocm", "layer-op scratch missing"))?;
    if need > 0 {
        // SAFETY: the scratch holds cap ≥ need bytes; the copy is ordered on fdpp's stream after
        // every earlier kernel that reads the scratch.
        b.api.check(
            unsafe { (b.api.memcpy_htod_async)(s.ptr, pack.bytes().as_ptr().cast(), need, b.stream) },
            "hipMemcpyHtoDAsync (layer-op arguments)",
        )?;
    }
    Ok(s.ptr as u64)
}

/// One kernel argument as the 8-byte slot hipModuleLaunchKernel reads it from: the runtime reads
/// each argument's own size from the pointer it is given, so a 4-byte value sits in the low half.
pub fn arg_i32(v: i32) -> u64 {
    v as u32 as u64
}

pub fn arg_f32(v: f32) -> u64 {
    v.to_bits() as u64
}

pub fn arg_ptr(b: &RocmBuffer) -> u64 {
    b.ptr as u64
}

/// The pointer-per-argument array for `args` (slots in `vals`).
fn arg_pointers(vals: &mut [u64; MAX_ARGS], n: usize) -> [*mut c_void; MAX_ARGS] {
    let mut ptrs = [std::ptr::null_mut(); MAX_ARGS];
    for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()).take(n) {
        *p = (v as *mut u64).cast();
    }
    ptrs
}

fn launch(b: &RocmBackend, f: Function, l: &LayerLaunch, args: &[u64], what: &str) -> Result<()> {
    if args.len() > MAX_ARGS {
        return Err(FdppError::device(
            "rocm",
            format!("{what}: {} kernel arguments", args.len()),
        ));
    }
    let mut vals = [0u64; MAX_ARGS];
    vals[..args.len()].copy_from_slice(args);
    let mut ptrs = arg_pointers(&mut vals, args.len());
    // SAFETY: ptrs point at live slots matching the kernel's parameter list in order; grid and
    // block come from layer_plan, which the kernel's indexing was written against.
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
    b.api.check(r, what)
}

fn check_dtypes(op: &str, dt: DType, bufs: &[(&str, &RocmBuffer)]) -> Result<()> {
    match bufs.iter().find(|(_, b)| b.dtype() != dt) {
        Some((name, b)) => Err(FdppError::InvalidArgument(format!(
            "{op}: {name} is {}, the op runs in {dt}",
            b.dtype()
        ))),
        None => Ok(()),
    }
}

pub fn add_rmsnorm(
    b: &RocmBackend,
    p: &RmsNormParams,
    residual: &mut RocmBuffer,
    delta: Option<&RocmBuffer>,
    weight: &RocmBuffer,
    out: &mut RocmBuffer,
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
    let l = plan::rmsnorm(p, RMS_WAVE)?;
    let hidden = i32_dim(p.hidden, "hidden", "add_rmsnorm")?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let args = [
        arg_ptr(residual),
        delta.map_or(0, arg_ptr),
        arg_ptr(weight),
        arg_ptr(out),
        arg_i32(hidden),
        arg_f32(p.eps),
    ];
    launch(b, f, &l, &args, "launch add_rmsnorm")
}

pub fn qkv_rope(
    b: &RocmBackend,
    p: &RopeParams,
    qkv: &RocmBuffer,
    bias: Option<&RocmBuffer>,
    q: &mut RocmBuffer,
    k: &mut RocmBuffer,
    v: &mut RocmBuffer,
) -> Result<()> {
    p.validate(qkv.len(), bias.map(|x| x.len()), q.len(), k.len(), v.len())?;
    check_dtypes("qkv_rope", p.dtype, &[("qkv", qkv), ("q", q), ("k", k), ("v", v)])?;
    if let Some(x) = bias {
        check_dtypes("qkv_rope", p.dtype, &[("bias", x)])?;
    }
    let l = plan::rope(p)?;
    let g = &p.geom;
    let mut st = b.layer.borrow_mut();
    let f = kernel(b, &mut st, p.dtype, l.kernel)?;
    st.pack.clear();
    let pos_at = st.pack.push_i32s(p.positions.iter().copied());
    let freq_at = st.pack.push_f32s(&p.inv_freq);
    let base = upload_pack(b, &mut st)?;
    let args = [
        arg_ptr(qkv),
        bias.map_or(0, arg_ptr),
        arg_ptr(q),
        arg_ptr(k),
        arg_ptr(v),
        base + pos_at as u64,
        base + freq_at as u64,
        arg_i32(i32_dim(g.num_heads, "num_heads", "qkv_rope")?),
        arg_i32(i32_dim(g.num_kv_heads, "num_kv_heads", "qkv_rope")?),
        arg_i32(i32_dim(g.head_dim, "head_dim", "qkv_rope")?),
        // qkv_rope_g's two more: rotary_dim and the layout (the whole-half kernel takes 10).
        arg_i32(i32_dim(p.rotary_dim(), "rotary_dim", "qkv_rope")?),
        arg_i32(plan::rope_layout_code(p.layout)),
    ];
    let n = if l.kernel == LayerKernel::QkvRopeG { 12 } else { 10 };
    launch(b, f, &l, &args[..n], "launch qkv_rope")
}

pub fn silu_mul(b: &RocmBackend, p: &SiluMulParams, gate_up: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
    p.validate(gate_up.len(), out.len())?;
    check_dtypes("silu_mul", p.dtype, &[("gate_up", gate_up), ("out", out)])?;
    let l = plan::silu_mul(p)?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let args = [
        arg_ptr(gate_up),
        arg_ptr(out),
        arg_i32(i32_dim(p.rows, "rows", "silu_mul")?),
        arg_i32(i32_dim(p.inter, "inter", "silu_mul")?),
    ];
    launch(b, f, &l, &args, "launch silu_mul")
}

pub fn add_layernorm(
    b: &RocmBackend,
    p: &LayerNormParams,
    residual: &mut RocmBuffer,
    delta: Option<&RocmBuffer>,
    (weight, bias): (&RocmBuffer, &RocmBuffer),
    out: &mut RocmBuffer,
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
    let l = plan::layernorm(p, RMS_WAVE)?;
    let hidden = i32_dim(p.hidden, "hidden", "add_layernorm")?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let args = [
        arg_ptr(residual),
        delta.map_or(0, arg_ptr),
        arg_ptr(weight),
        arg_ptr(bias),
        arg_ptr(out),
        arg_i32(hidden),
        arg_f32(p.eps),
    ];
    launch(b, f, &l, &args, "launch add_layernorm")
}

pub fn bias_act(b: &RocmBackend, p: &BiasActParams, x: &mut RocmBuffer, bias: Option<&RocmBuffer>) -> Result<()> {
    p.validate(x.len(), bias.map(|v| v.len()))?;
    check_dtypes("bias_act", p.dtype, &[("x", x)])?;
    if let Some(v) = bias {
        check_dtypes("bias_act", p.dtype, &[("bias", v)])?;
    }
    let l = plan::bias_act(p)?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let args = [
        arg_ptr(x),
        bias.map_or(0, arg_ptr),
        arg_i32(i32_dim(p.rows, "rows", "bias_act")?),
        arg_i32(i32_dim(p.width, "width", "bias_act")?),
        arg_i32(plan::act_code(p.act)),
    ];
    launch(b, f, &l, &args, "launch bias_act")
}

/// act(gate) · up for any activation but SiLU, which the dispatch sends to [`silu_mul`].
pub fn glu(b: &RocmBackend, p: &GluParams, gate_up: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
    p.validate(gate_up.len(), out.len())?;
    check_dtypes("glu", p.dtype, &[("gate_up", gate_up), ("out", out)])?;
    let l = plan::glu(p)?;
    let f = kernel(b, &mut b.layer.borrow_mut(), p.dtype, l.kernel)?;
    let args = [
        arg_ptr(gate_up),
        arg_ptr(out),
        arg_i32(i32_dim(p.rows, "rows", "glu")?),
        arg_i32(i32_dim(p.inter, "inter", "glu")?),
        arg_i32(plan::act_code(p.act)),
    ];
    launch(b, f, &l, &args, "launch glu")
}

pub fn add_positions(b: &RocmBackend, p: &PositionParams, table: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
    p.validate(table.len(), out.len())?;
    check_dtypes("add_positions", p.dtype, &[("table", table), ("out", out)])?;
    let l = plan::add_positions(p)?;
    let hidden = i32_dim(p.hidden, "hidden", "add_positions")?;
    let mut st = b.layer.borrow_mut();
    let f = kernel(b, &mut st, p.dtype, l.kernel)?;
    st.pack.clear();
    st.pack.push_i32s(plan::position_rows(p)?);
    let rp = upload_pack(b, &mut st)?;
    launch(
        b,
        f,
        &l,
        &[arg_ptr(out), arg_ptr(table), rp, arg_i32(hidden)],
        "launch add_positions",
    )
}

fn gather(
    b: &RocmBackend,
    dt: DType,
    rows: &[i32],
    width: usize,
    src: &RocmBuffer,
    dst: &mut RocmBuffer,
    op: &'static str,
) -> Result<()> {
    let l = plan::gather(rows.len(), width)?;
    let w = i32_dim(width, "row width", op)?;
    let mut st = b.layer.borrow_mut();
    let f = kernel(b, &mut st, dt, l.kernel)?;
    st.pack.clear();
    st.pack.push_i32s(rows.iter().copied());
    let rp = upload_pack(b, &mut st)?;
    launch(b, f, &l, &[arg_ptr(src), arg_ptr(dst), rp, arg_i32(w)], op)
}

pub fn embedding(b: &RocmBackend, p: &EmbeddingParams, table: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
    p.validate(table.len(), out.len())?;
    check_dtypes("embedding", p.dtype, &[("table", table), ("out", out)])?;
    // A rank's vocabulary slice (--tp): ids of other ranks' slices as -1, zero rows.
    gather(b, p.dtype, &p.local_rows(), p.hidden, table, out, "launch embedding")
}

pub fn gather_rows(b: &RocmBackend, p: &GatherParams, src: &RocmBuffer, dst: &mut RocmBuffer) -> Result<()> {
    p.validate(src.len(), dst.len())?;
    check_dtypes("gather_rows", p.dtype, &[("src", src), ("dst", dst)])?;
    gather(b, p.dtype, &p.rows, p.width, src, dst, "launch gather_rows")
}

pub fn kv_append(
    b: &RocmBackend,
    p: &KvAppendParams,
    k: &RocmBuffer,
    v: &RocmBuffer,
    kv: &mut PagedKv<RocmBuffer>,
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
    let sp = upload_pack(b, &mut st)?;
    let args = [arg_ptr(k), arg_ptr(v), arg_ptr(&kv.k), arg_ptr(&kv.v), sp, arg_i32(w)];
    launch(b, f, &l, &args, "launch kv_append")
}

pub fn fill_random(b: &RocmBackend, buf: &mut RocmBuffer, seed: u64, scale: f32) -> Result<()> {
    if buf.len() == 0 {
        return Ok(());
    }
    let l = plan::fill_random(buf.len());
    let f = kernel(b, &mut b.layer.borrow_mut(), buf.dtype(), l.kernel)?;
    let args = [arg_ptr(buf), buf.len() as u64, seed, arg_f32(scale)];
    launch(b, f, &l, &args, "launch fill_random")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_slots_read_back_as_the_kernel_parameter_types() {
        let mut vals = [0u64; MAX_ARGS];
        let args = [arg_i32(-7), arg_f32(1.5e-5), 0xdead_beef_0000_1234, arg_i32(i32::MAX)];
        vals[..4].copy_from_slice(&args);
        let ptrs = arg_pointers(&mut vals, 4);
        // SAFETY: each pointer points at a live u64 slot; 4-byte reads of its low half.
        unsafe {
            assert_eq!(*(ptrs[0] as *const i32), -7);
            assert_eq!(*(ptrs[1] as *const f32), 1.5e-5);
            assert_eq!(*(ptrs[2] as *const u64), 0xdead_beef_0000_1234);
            assert_eq!(*(ptrs[3] as *const i32), i32::MAX);
        }
        assert!(ptrs[4..].iter().all(|p| p.is_null()));
    }

    #[test]
    fn rmsnorm_blocks_are_whole_wavefronts_of_either_width() {
        for hidden in [8, 100, 4096, 5120, 1001] {
            let l = plan::rmsnorm(
                &RmsNormParams {
                    rows: 1,
                    hidden,
                    eps: 1e-6,
                    dtype: DType::F16,
                },
                RMS_WAVE,
            )
            .unwrap();
            assert!(l.block.is_multiple_of(64), "hidden {hidden}: {}", l.block);
        }
    }
}
