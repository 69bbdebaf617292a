//! The ROCm backend: the HIP runtime, hiprtc and rocBLAS are loaded at run time (loader.rs), so
//! the binary builds without ROCm and one binary serves NVIDIA and AMD. Kernels (kernels_hip/)
//! are compiled by hiprtc for the device's gfx arch with an on-disk cache; ImplC is rocBLAS.
//!
//! Written and unit-tested on a machine without an AMD GPU: the FFI is compile-checked, the
//! launch arithmetic is tested on the CPU (launch.rs), and the kernels are compiled by hipcc and
//! hiprtc in CI. See the README's ROCm section for what has run on hardware (nothing yet).

pub mod attention;
pub mod blas;
pub mod hip;
pub mod hiprtc;
pub mod launch;
pub mod layer;
pub mod loader;
pub mod probe;
pub mod rccl;
pub mod sources;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};

use super::{Backend, BackendStatus, DeviceBuffer, DeviceInfo};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::attention::{AttnStats, DecodeParams, PrefillParams};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::ops::layer::{
    Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeParams, SiluMulParams,
};
use hip::{Function, HipApi, Module, Stream};

pub fn probe() -> BackendStatus {
    probe::probe()
}

/// What the probe learns about a device beyond [`DeviceInfo`].
#[derive(Clone, Debug)]
pub struct RocmDevice {
    pub info: DeviceInfo,
    /// Wavefront width (64 on CDNA, 32 on RDNA).
    pub wave: u32,
    /// LDS bytes one block may use.
    pub lds_per_block: u32,
}

/// A device allocation of 16-bit elements, freed on drop.
pub struct RocmBuffer {
    dtype: DType,
    len: usize,
    ptr: *mut c_void,
    api: &'static HipApi,
}

impl DeviceBuffer for RocmBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

impl Drop for RocmBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from hipMalloc and is freed once.
        unsafe { (self.api.free)(self.ptr) };
    }
}

/// fdpp's one stream, destroyed on drop. Declared after the rocBLAS handle in [`RocmBackend`]
/// so that it outlives it (fields drop in declaration order).
struct OwnedStream {
    api: &'static HipApi,
    s: Stream,
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: created by hipStreamCreate, destroyed once, after all work on it finished.
        unsafe {
            (self.api.stream_synchronize)(self.s);
            (self.api.stream_destroy)(self.s);
        }
    }
}

pub struct RocmBackend {
    api: &'static HipApi,
    dev: RocmDevice,
    blas: blas::BlasHandle,
    stream: Stream,
    modules: RefCell<HashMap<String, Module>>,
    functions: RefCell<HashMap<(String, String), Function>>,
    /// The small per-layer ops' loaded kernels and argument scratch (layer.rs).
    layer: RefCell<layer::LayerState>,
    /// The attention launches' device scratch and counters (attention.rs).
    attn: RefCell<attention::AttnState>,
    _owned_stream: OwnedStream,
}

impl RocmBackend {
    pub fn open(ordinal: usize) -> Result<Self> {
        let n = probe::device_count()?;
        if ordinal >= n {
            return Err(FdppError::InvalidArgument(format!(
                "ROCm device {ordinal} does not exist: this machine has {n} (valid: 0..{})",
                n.saturating_sub(1)
            )));
        }
        let api = hip::api_or_unavailable()?;
        hiprtc::api_or_unavailable()?;
        // SAFETY: plain call with a valid ordinal; the device stays current for this thread.
        api.check(unsafe { (api.set_device)(ordinal as i32) }, "hipSetDevice")?;
        let dev = probe::device(api, ordinal)?;
        let mut stream: Stream = std::ptr::null_mut();
        // SAFETY: out-parameter; OwnedStream destroys it.
        api.check(unsafe { (api.stream_create)(&mut stream) }, "hipStreamCreate")?;
        let owned = OwnedStream { api, s: stream };
        // SAFETY: the stream is live and is destroyed only after the handle (field order).
        let blas = blas::RocBlas::load_default().and_then(|b| unsafe { blas::BlasHandle::new(b, stream) })?;
        Ok(RocmBackend {
            api,
            dev,
            blas,
            stream,
            modules: RefCell::new(HashMap::new()),
            functions: RefCell::new(HashMap::new()),
            layer: RefCell::default(),
            attn: RefCell::default(),
            _owned_stream: owned,
        })
    }

    pub fn device(&self) -> &RocmDevice {
        &self.dev
    }

    /// A kernel function, compiling (or reading the cache) and loading its module on first use.
    fn function(&self, src: &sources::KernelSource, name: &str) -> Result<Function> {
        let key = (src.uri.clone(), name.to_string());
        if let Some(f) = self.functions.borrow().get(&key) {
            return Ok(*f);
        }
        let module = self.module(src)?;
        let cname = CString::new(name).map_err(|e| FdppError::device("rocm", e))?;
        let mut f: Function = std::ptr::null_mut();
        // SAFETY: module is loaded; cname is NUL-terminated.
        self.api.check(
            unsafe { (self.api.module_get_function)(&mut f, module, cname.as_ptr()) },
            &format!("{}: hipModuleGetFunction({name})", src.uri),
        )?;
        self.functions.borrow_mut().insert(key, f);
        Ok(f)
    }

    fn module(&self, src: &sources::KernelSource) -> Result<Module> {
        if let Some(m) = self.modules.borrow().get(&src.uri) {
            return Ok(*m);
        }
        let (co, _) = hiprtc::code_object_cached(src, &self.dev.info.arch, &mut |w| eprintln!("warning: {w}"))?;
        let mut m: Module = std::ptr::null_mut();
        // SAFETY: co is a complete code object; HIP copies what it needs before returning.
        self.api.check(
            unsafe { (self.api.module_load_data)(&mut m, co.as_ptr().cast()) },
            &format!("hipModuleLoadData({})", src.uri),
        )?;
        self.modules.borrow_mut().insert(src.uri.clone(), m);
        Ok(m)
    }

    /// Launch `f` with the kernel arguments (x, w, y, then the i32s) the HIP kernels take.
    fn launch(&self, f: Function, l: &launch::Launch, ptrs: [*mut c_void; 3], ints: &[i32], what: &str) -> Result<()> {
        let mut p = ptrs;
        let mut i = ints.to_vec();
        // hipModuleLaunchKernel takes an array of pointers to each argument, in order.
        let mut args: Vec<*mut c_void> = p.iter_mut().map(|q| (q as *mut *mut c_void).cast()).collect();
        args.extend(i.iter_mut().map(|v| (v as *mut i32).cast::<c_void>()));
        // SAFETY: args point at live locals matching the kernel's parameter list; grid, block
        // and LDS come from launch.rs, which the kernel's layout was written against.
        let r = unsafe {
            (self.api.module_launch_kernel)(
                f,
                l.grid.0,
                l.grid.1,
                l.grid.2,
                l.block.0,
                l.block.1,
                l.block.2,
                l.lds_bytes,
                self.stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.api.check(r, &format!("launch {what}"))
    }

    fn gemm_kernel(
        &self,
        spec: &GemmSpec,
        d: GemmDims,
        x: &RocmBuffer,
        w: &RocmBuffer,
        y: &mut RocmBuffer,
    ) -> Result<()> {
        let src = sources::gemm_source(spec).ok_or_else(|| FdppError::device("rocm", format!("{spec}: no source")))?;
        let i32_of = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| FdppError::Unsupported {
                spec: spec.uri(),
                what: format!("{what} = {v} (over i32)"),
            })
        };
        let (n, k) = (i32_of(d.n, "N")?, i32_of(d.k, "K")?);
        match spec.imp {
            GemmImpl::Gemv => {
                for l in launch::gemv_launches(spec, sources::gemv_rows(spec), self.dev.wave, d)? {
                    let f = self.function(&src, &l.kernel)?;
                    // Device addresses, never dereferenced here: wrapping arithmetic, no
                    // in-bounds claim to the compiler. m0 + m ≤ M keeps them inside x and y.
                    let xo = x.ptr.cast::<u16>().wrapping_add(l.m0 * d.k).cast();
                    let yo = y.ptr.cast::<u16>().wrapping_add(l.m0 * d.n).cast();
                    let ints: Vec<i32> = if l.kernel == "gemv_scalar" {
                        vec![l.m as i32, n, k]
                    } else {
                        vec![n, k]
                    };
                    self.launch(f, &l, [xo, w.ptr, yo], &ints, &spec.uri())?;
                }
                Ok(())
            }
            GemmImpl::FlatGemm => {
                let l = launch::flat_launch(spec, &self.dev.info.arch, self.dev.wave, self.dev.lds_per_block, d)?;
                let f = self.function(&src, &l.kernel)?;
                self.launch(f, &l, [x.ptr, w.ptr, y.ptr], &[i32_of(d.m, "M")?, n, k], &spec.uri())
            }
            GemmImpl::Gemm => unreachable_gemm(spec),
        }
    }
}

fn unreachable_gemm(spec: &GemmSpec) -> Result<()> {
    Err(FdppError::device("rocm", format!("{spec}: ImplC has no kernel source")))
}

impl Drop for RocmBackend {
    fn drop(&mut self) {
        // SAFETY: the modules were loaded by this backend and are unloaded once, after the
        // stream's work has finished; the handle and the stream (fields) drop after this body.
        unsafe {
            (self.api.stream_synchronize)(self.stream);
            for m in self.modules.borrow().values() {
                (self.api.module_unload)(*m);
            }
        }
    }
}

/// Events of one timed series, destroyed on drop (also on the error paths).
struct Events<'a> {
    api: &'a HipApi,
    ev: Vec<hip::Event>,
}

impl Drop for Events<'_> {
    fn drop(&mut self) {
        for e in &self.ev {
            // SAFETY: each event was created by hipEventCreate and is destroyed once.
            unsafe { (self.api.event_destroy)(*e) };
        }
    }
}

impl Backend for RocmBackend {
    type Buffer = RocmBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    fn kernel_hash(&self) -> String {
        sources::kernel_hash()
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<RocmBuffer> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter; the buffer frees it on drop.
        self.api.check(
            unsafe { (self.api.malloc)(&mut ptr, 2 * len.max(1)) },
            &format!("hipMalloc of {len} elements ({} MiB)", (2 * len) >> 20),
        )?;
        let mut b = RocmBuffer {
            dtype,
            len,
            ptr,
            api: self.api,
        };
        self.fill(&mut b, dtype.poison())?;
        Ok(b)
    }

    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<RocmBuffer> {
        let b = self.alloc(dtype, bits.len())?;
        // hipMemcpy is stream-ordered after the poison fill on the legacy default stream only,
        // so finish the fill first.
        self.synchronize()?;
        // SAFETY: the allocation holds bits.len() elements.
        self.api.check(
            unsafe { (self.api.memcpy)(b.ptr, bits.as_ptr().cast(), 2 * bits.len(), hip::MEMCPY_HOST_TO_DEVICE) },
            "hipMemcpy host to device",
        )?;
        Ok(b)
    }

    fn download(&self, buf: &RocmBuffer) -> Result<Vec<u16>> {
        self.synchronize()?;
        let mut out = vec![0u16; buf.len];
        // SAFETY: out holds buf.len elements, as does the allocation.
        self.api.check(
            unsafe {
                (self.api.memcpy)(
                    out.as_mut_ptr().cast(),
                    buf.ptr,
                    2 * buf.len,
                    hip::MEMCPY_DEVICE_TO_HOST,
                )
            },
            "hipMemcpy device to host",
        )?;
        Ok(out)
    }

    fn fill(&self, buf: &mut RocmBuffer, bits: u16) -> Result<()> {
        // SAFETY: the allocation holds buf.len elements.
        self.api.check(
            unsafe { (self.api.memset_d16_async)(buf.ptr, bits, buf.len, self.stream) },
            "hipMemsetD16Async",
        )
    }

    fn gemm_candidates(&self, dtype: DType, _n: usize, _k: usize) -> Vec<GemmSpec> {
        let mut v: Vec<GemmSpec> = sources::all_gemm_specs(dtype)
            .into_iter()
            .filter(|s| s.imp != GemmImpl::FlatGemm || launch::has_flat_gemm(&self.dev.info.arch))
            .collect();
        v.push(GemmSpec::new(GemmImpl::Gemm, dtype));
        v
    }

    fn gemm(&self, spec: &GemmSpec, dims: GemmDims, x: &RocmBuffer, w: &RocmBuffer, y: &mut RocmBuffer) -> Result<()> {
        spec.refuse_cuda_only("rocm")?;
        dims.check_lens(spec, x.len(), w.len(), y.len())?;
        if x.dtype() != spec.dtype || w.dtype() != spec.dtype || y.dtype() != spec.dtype {
            return Err(FdppError::InvalidArgument(format!(
                "{spec}: buffers are not all {}",
                spec.dtype
            )));
        }
        if spec.imp != GemmImpl::Gemm {
            return self.gemm_kernel(spec, dims, x, w, y);
        }
        let too_big = |v: usize| {
            i32::try_from(v).map_err(|_| FdppError::Unsupported {
                spec: spec.uri(),
                what: format!("dimension {v} (over i32)"),
            })
        };
        let (m, n, k) = (too_big(dims.m)?, too_big(dims.n)?, too_big(dims.k)?);
        // SAFETY: the buffers cover [M,K], [N,K], [M,N] (checked above).
        unsafe { self.blas.gemm(spec.dtype, m, n, k, x.ptr, w.ptr, y.ptr) }.map_err(|s| {
            FdppError::device(
                "rocm",
                format!("rocblas_gemm_ex {spec} at {}: status {s}", dims.label()),
            )
        })
    }

    fn attention_decode(
        &self,
        p: &DecodeParams,
        q: &RocmBuffer,
        kv: &PagedKv<RocmBuffer>,
        out: &mut RocmBuffer,
    ) -> Result<AttnStats> {
        attention::decode(self, p, q, kv, out, true)
    }

    fn attention_decode_enqueue(
        &self,
        p: &DecodeParams,
        q: &RocmBuffer,
        kv: &PagedKv<RocmBuffer>,
        out: &mut RocmBuffer,
    ) -> Result<()> {
        attention::decode(self, p, q, kv, out, false).map(|_| ())
    }

    fn attention_prefill(
        &self,
        p: &PrefillParams,
        q: &RocmBuffer,
        k: &RocmBuffer,
        v: &RocmBuffer,
        kv: &mut PagedKv<RocmBuffer>,
        out: &mut RocmBuffer,
    ) -> Result<AttnStats> {
        attention::prefill(self, p, q, k, v, kv, out, true)
    }

    fn attention_prefill_enqueue(
        &self,
        p: &PrefillParams,
        q: &RocmBuffer,
        k: &RocmBuffer,
        v: &RocmBuffer,
        kv: &mut PagedKv<RocmBuffer>,
        out: &mut RocmBuffer,
    ) -> Result<()> {
        attention::prefill(self, p, q, k, v, kv, out, false).map(|_| ())
    }

    fn attention_prefill_cached_enqueue(
        &self,
        p: &PrefillParams,
        q: &RocmBuffer,
        kv: &PagedKv<RocmBuffer>,
        out: &mut RocmBuffer,
    ) -> Result<()> {
        attention::prefill_cached(self, p, q, kv, out, false).map(|_| ())
    }

    fn take_recomputed(&self) -> Result<usize> {
        attention::take_recomputed(self)
    }

    fn embedding(&self, p: &EmbeddingParams, table: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
        layer::embedding(self, p, table, out)
    }

    fn add_rmsnorm(
        &self,
        p: &RmsNormParams,
        residual: &mut RocmBuffer,
        delta: Option<&RocmBuffer>,
        weight: &RocmBuffer,
        out: &mut RocmBuffer,
    ) -> Result<()> {
        layer::add_rmsnorm(self, p, residual, delta, weight, out)
    }

    fn qkv_rope(
        &self,
        p: &RopeParams,
        qkv: &RocmBuffer,
        bias: Option<&RocmBuffer>,
        q: &mut RocmBuffer,
        k: &mut RocmBuffer,
        v: &mut RocmBuffer,
    ) -> Result<()> {
        layer::qkv_rope(self, p, qkv, bias, q, k, v)
    }

    fn silu_mul(&self, p: &SiluMulParams, gate_up: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
        layer::silu_mul(self, p, gate_up, out)
    }

    fn add_layernorm(
        &self,
        p: &LayerNormParams,
        residual: &mut RocmBuffer,
        delta: Option<&RocmBuffer>,
        weight: &RocmBuffer,
        bias: &RocmBuffer,
        out: &mut RocmBuffer,
    ) -> Result<()> {
        layer::add_layernorm(self, p, residual, delta, (weight, bias), out)
    }

    fn bias_act(&self, p: &BiasActParams, x: &mut RocmBuffer, bias: Option<&RocmBuffer>) -> Result<()> {
        layer::bias_act(self, p, x, bias)
    }

    fn glu(&self, p: &GluParams, gate_up: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
        if p.act == Activation::Silu {
            let sp = SiluMulParams {
                rows: p.rows,
                inter: p.inter,
                dtype: p.dtype,
            };
            return layer::silu_mul(self, &sp, gate_up, out);
        }
        layer::glu(self, p, gate_up, out)
    }

    fn add_positions(&self, p: &PositionParams, table: &RocmBuffer, out: &mut RocmBuffer) -> Result<()> {
        layer::add_positions(self, p, table, out)
    }

    fn kv_append(
        &self,
        p: &KvAppendParams,
        k: &RocmBuffer,
        v: &RocmBuffer,
        kv: &mut PagedKv<RocmBuffer>,
    ) -> Result<()> {
        layer::kv_append(self, p, k, v, kv)
    }

    fn gather_rows(&self, p: &GatherParams, src: &RocmBuffer, dst: &mut RocmBuffer) -> Result<()> {
        layer::gather_rows(self, p, src, dst)
    }

    fn fill_random(&self, buf: &mut RocmBuffer, seed: u64, scale: f32) -> Result<()> {
        layer::fill_random(self, buf, seed, scale)
    }

    fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream is live.
        self.api.check(
            unsafe { (self.api.stream_synchronize)(self.stream) },
            "hipStreamSynchronize",
        )
    }

    fn copy_gbps(&self) -> Result<f64> {
        // 1 GiB each way: far past the L2 and Infinity Cache; bytes counted are read + written.
        let len = 512usize << 20;
        let src = self.alloc(DType::F16, len)?;
        let dst = self.alloc(DType::F16, len)?;
        let copy = || {
            // SAFETY: both allocations hold len elements.
            self.api.check(
                unsafe { (self.api.memcpy_dtod_async)(dst.ptr, src.ptr, 2 * len, self.stream) },
                "hipMemcpyDtoDAsync",
            )
        };
        copy()?;
        copy()?;
        let ms = self.time_each(10, &mut |_| copy())?;
        let med = crate::bench::Stats::from_ms(&ms)
            .map(|s| s.median_us)
            .unwrap_or(f64::NAN);
        Ok((4 * len) as f64 / (med * 1e-6) / 1e9)
    }

    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        let mut events = Events {
            api: self.api,
            ev: Vec::with_capacity(reps + 1),
        };
        for _ in 0..=reps {
            let mut e: hip::Event = std::ptr::null_mut();
            // SAFETY: out-parameter; destroyed by Events' drop.
            self.api
                .check(unsafe { (self.api.event_create)(&mut e) }, "hipEventCreate")?;
            events.ev.push(e);
        }
        let ev = &events.ev;
        // Back to back, as on CUDA: the end event of run i is the start of run i+1.
        // SAFETY (all event calls): events and stream are live.
        self.api
            .check(unsafe { (self.api.event_record)(ev[0], self.stream) }, "hipEventRecord")?;
        for i in 0..reps {
            f(i)?;
            self.api.check(
                unsafe { (self.api.event_record)(ev[i + 1], self.stream) },
                "hipEventRecord",
            )?;
        }
        self.api
            .check(unsafe { (self.api.event_synchronize)(ev[reps]) }, "hipEventSynchronize")?;
        let mut out = Vec::with_capacity(reps);
        for i in 0..reps {
            let mut ms = 0f32;
            self.api.check(
                unsafe { (self.api.event_elapsed_time)(&mut ms, ev[i], ev[i + 1]) },
                "hipEventElapsedTime",
            )?;
            out.push(ms as f64);
        }
        Ok(out)
    }
}
