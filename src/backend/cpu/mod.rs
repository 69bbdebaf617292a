//! The CPU backend: the reference for every device kernel and the default without a GPU.
//!
//! The three GEMM implementations of FlashDecoding++ §4 have real, multithreaded CPU versions
//! (one file each) so that the selection logic, the tuner and the engine run end to end without
//! a GPU. All three share the same frame: x is widened to f32 once, every implementation writes
//! fp32 sums into y transposed ([N, M], so that a task owning a run of rows of W owns a
//! contiguous run of the output), and the result is narrowed into y at the end.
//!
//! A layer linear's W is prepared once at load ([`Backend::prepare_linear_weight`]) into
//! panels of 16 rows interleaved along K (`panel.rs`); all three implementations then run the
//! one panel kernel, which serves every M, and differ only in their task sizes. The row-major
//! kernels remain for a W that is not prepared (the LM head, which may be the tied embedding).

mod attention;
mod flat_gemm;
mod gemm;
mod gemv;
pub mod hooked;
pub mod info;
pub mod layer;
mod panel;
pub mod pool;
mod scores;
mod simd;

use std::time::Instant;

use rayon::prelude::*;

use super::{Backend, BackendKind, BackendStatus, DeviceBuffer, DeviceInfo};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::attention::{AttnStats, DecodeParams, PrefillParams};
use crate::ops::gemm::{GemmDims, GemmImpl, GemmSpec};
use crate::ops::layer::{
    BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams, PositionParams,
    RmsNormParams, RopeParams, SiluMulParams,
};

pub struct CpuBuffer {
    pub dtype: DType,
    pub data: Vec<u16>,
    /// Set once a linear's W has been prepared for the GEMMs
    /// ([`Backend::prepare_linear_weight`]): `data` then holds W in panels (see `panel.rs`),
    /// not row-major, and is read only by `gemm` (and `download`, which gives the row-major
    /// values back).
    pub panels: Option<PanelShape>,
}

/// The [N, K] of a W held in panels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PanelShape {
    pub n: usize,
    pub k: usize,
}

impl DeviceBuffer for CpuBuffer {
    fn len(&self) -> usize {
        self.data.len()
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

pub struct CpuBackend {
    info: DeviceInfo,
    /// Rows recomputed by the enqueue attention paths since the last `take_recomputed`.
    recomputed: std::sync::atomic::AtomicUsize,
    /// The pipelined greedy decode's queued choices, oldest first, and the newest (what
    /// `embedding_fed` reads). The CPU chooses at once; the queue gives the engine's pipelined
    /// loop the same behaviour here as on a GPU, where it is tested without one.
    greedy: std::sync::Mutex<CpuGreedy>,
    /// The last step's RoPE cos/sin, shared by its layers.
    rope: layer::RopeCache,
}

#[derive(Default)]
struct CpuGreedy {
    queued: std::collections::VecDeque<Vec<u32>>,
    newest: Option<Vec<u32>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    fn greedy_queue(&self) -> Result<std::sync::MutexGuard<'_, CpuGreedy>> {
        self.greedy
            .lock()
            .map_err(|_| FdppError::InvalidArgument("the greedy queue's lock was poisoned".into()))
    }

    pub fn new() -> Self {
        CpuBackend {
            info: info::cpu_info(),
            recomputed: Default::default(),
            greedy: Default::default(),
            rope: Default::default(),
        }
    }

    /// x · Wᵀ in f32, not rounded, transposed ([N, M]): one rank's partial product of a
    /// row-parallel linear, which the in-process communicator sums over the ranks and rounds
    /// once ([`crate::tp::host`]), as one device rounds the whole product once. `y` is only
    /// checked (its dtype and length), for [`CpuBackend::narrow_partial`] to write. A W laid out
    /// in panels at load runs the panel kernel's f32 form; a row-major W the GEMV or the flat
    /// GEMM (the row-major Gemm rounds inside its tile loop, so the flat GEMM stands in for it).
    pub fn gemm_partial(
        &self,
        spec: &GemmSpec,
        dims: GemmDims,
        x: &CpuBuffer,
        w: &CpuBuffer,
        y: &CpuBuffer,
    ) -> Result<Vec<f32>> {
        check_gemm_buffers(spec, dims, x, w, y)?;
        let wide = match spec.imp {
            GemmImpl::Gemm => GemmSpec::new(GemmImpl::FlatGemm, spec.dtype),
            _ => *spec,
        };
        let block = block_rows(&wide, dims)?;
        let dt = spec.dtype;
        if check_panels(w, dims)? {
            let mut out_t = vec![0f32; dims.n * dims.m];
            let rows = panel_rows(spec, dims, block_rows(spec, dims)?);
            panel::gemm_wide(dt, dims, &x.data[..dims.m * dims.k], &w.data, &mut out_t, rows);
            return Ok(out_t);
        }
        let mut xf = vec![0f32; dims.m * dims.k];
        simd::widen(dt, &x.data[..dims.m * dims.k], &mut xf);
        let w = &w.data[..dims.n * dims.k];
        let mut out_t = vec![0f32; dims.n * dims.m];
        if wide.imp == GemmImpl::Gemv {
            gemv::gemv(dt, dims, &xf, w, &mut out_t, block);
        } else {
            flat_gemm::flat_gemm(dt, dims, &xf, w, &mut out_t, block);
        }
        Ok(out_t)
    }

    /// y[..M·N] = the [N, M] f32 `out_t` transposed and rounded to y's dtype.
    pub fn narrow_partial(&self, dims: GemmDims, out_t: &[f32], y: &mut CpuBuffer) -> Result<()> {
        let need = dims.m * dims.n;
        if out_t.len() != need || y.data.len() < need {
            return Err(FdppError::Shape {
                what: format!("a row-parallel GEMM's summed partials at {}", dims.label()),
                expected: format!("{need} values into a buffer of at least {need}"),
                found: format!("{} values into {}", out_t.len(), y.data.len()),
            });
        }
        narrow_transposed(y.dtype, dims, out_t, &mut y.data[..need]);
        Ok(())
    }
}

/// Whether W is held in panels, which must then be of exactly `dims`' [N, K].
fn check_panels(w: &CpuBuffer, dims: GemmDims) -> Result<bool> {
    match w.panels {
        None => Ok(false),
        Some(p) if p.n == dims.n && p.k == dims.k => Ok(true),
        Some(p) => Err(FdppError::Shape {
            what: format!("a GEMM's prepared W at {}", dims.label()),
            expected: format!("W [{}, {}]", dims.n, dims.k),
            found: format!("W prepared as [{}, {}]", p.n, p.k),
        }),
    }
}

/// Rows of W per task of the panel kernel. All three implementations run the same kernel on
/// a prepared W (it serves every M, see `panel.rs`); what still differs is the task size:
/// the GEMV's (≥ 32 KiB of W a task, ~16 tasks per thread), flat_gemm's B_N and the GEMM's
/// (~8 tasks per thread), each rounded up to whole panels of 16 rows.
fn panel_rows(spec: &GemmSpec, dims: GemmDims, block: usize) -> usize {
    match (spec.imp, spec.block_n) {
        // The row-major GEMM's default is a multiple of its 6-row tile, capped at 252 rows.
        (GemmImpl::Gemm, None) => panel::task_rows(dims.n.div_ceil(8 * pool::threads())).min(256),
        _ => panel::task_rows(block),
    }
}

/// A GEMM's buffers: long enough for `dims` and all of the spec's dtype.
fn check_gemm_buffers(spec: &GemmSpec, dims: GemmDims, x: &CpuBuffer, w: &CpuBuffer, y: &CpuBuffer) -> Result<()> {
    dims.check_lens(spec, x.len(), w.len(), y.len())?;
    if x.dtype != spec.dtype || w.dtype != spec.dtype || y.dtype != spec.dtype {
        return Err(FdppError::InvalidArgument(format!(
            "{spec} at {}: buffers are x {}, w {}, y {}; all must be {}",
            dims.label(),
            x.dtype,
            w.dtype,
            y.dtype,
            spec.dtype
        )));
    }
    Ok(())
}

pub fn probe() -> BackendStatus {
    BackendStatus {
        backend: BackendKind::Cpu,
        available: true,
        reason: None,
        devices: vec![info::cpu_info()],
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn kernel_hash(&self) -> String {
        kernel_source_hash()
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
        let mut data = huge_page_vec(len);
        data.resize(len, dtype.poison());
        Ok(CpuBuffer {
            dtype,
            data,
            panels: None,
        })
    }

    fn upload(&self, dtype: DType, bits: &[u16]) -> Result<CpuBuffer> {
        let mut data = huge_page_vec(bits.len());
        data.extend_from_slice(bits);
        Ok(CpuBuffer {
            dtype,
            data,
            panels: None,
        })
    }

    fn download(&self, buf: &CpuBuffer) -> Result<Vec<u16>> {
        Ok(match buf.panels {
            Some(p) => panel::unpack(&buf.data, p.n, p.k),
            None => buf.data.clone(),
        })
    }

    /// W into panels of 16 rows interleaved along K (`panel.rs`), which every CPU GEMM
    /// implementation reads at every M: the GEMM no longer widens W per call, the GEMV reads it
    /// as one sequential stream.
    fn prepare_linear_weight(&self, w: &mut CpuBuffer, n: usize, k: usize) -> Result<()> {
        match w.panels {
            Some(p) if p == (PanelShape { n, k }) => return Ok(()),
            Some(p) => {
                return Err(FdppError::InvalidArgument(format!(
                    "prepare_linear_weight: W is already prepared as [{}, {}], asked for [{n}, {k}]",
                    p.n, p.k
                )))
            }
            None => {}
        }
        if w.data.len() < n * k {
            return Err(FdppError::Shape {
                what: "a linear's W to prepare".into(),
                expected: format!("[{n}, {k}] = {} values", n * k),
                found: format!("{} values", w.data.len()),
            });
        }
        let len = panel::packed_len(n, k);
        let mut data = huge_page_vec(len);
        data.resize(len, 0);
        panel::pack(&w.data, n, k, &mut data);
        w.data = data;
        w.panels = Some(PanelShape { n, k });
        Ok(())
    }

    fn fill(&self, buf: &mut CpuBuffer, bits: u16) -> Result<()> {
        buf.data.fill(bits);
        Ok(())
    }

    fn gemm_candidates(&self, dtype: DType, _n: usize, _k: usize) -> Vec<GemmSpec> {
        // Every implementation runs every shape on the CPU; flat_gemm is offered with two B_N
        // (wider B_N reuse each x vector more; narrower give more tasks and fewer streams).
        vec![
            GemmSpec::new(GemmImpl::Gemv, dtype),
            GemmSpec::new(GemmImpl::FlatGemm, dtype).with_block_n(FLAT_GEMM_NARROW_BLOCK_N),
            GemmSpec::new(GemmImpl::FlatGemm, dtype).with_block_n(flat_gemm::DEFAULT_BLOCK_N as u32),
            GemmSpec::new(GemmImpl::Gemm, dtype),
        ]
    }

    fn gemm(&self, spec: &GemmSpec, dims: GemmDims, x: &CpuBuffer, w: &CpuBuffer, y: &mut CpuBuffer) -> Result<()> {
        spec.refuse_cuda_only("cpu")?;
        check_gemm_buffers(spec, dims, x, w, y)?;
        let block = block_rows(spec, dims)?;
        if check_panels(w, dims)? {
            let (x, y) = (&x.data[..dims.m * dims.k], &mut y.data[..dims.m * dims.n]);
            panel::gemm(spec.dtype, dims, x, &w.data, y, panel_rows(spec, dims, block));
        } else {
            run_gemm(spec, dims, block, &x.data, &w.data, &mut y.data);
        }
        Ok(())
    }

    fn attention_decode(
        &self,
        p: &DecodeParams,
        q: &CpuBuffer,
        kv: &PagedKv<CpuBuffer>,
        out: &mut CpuBuffer,
    ) -> Result<AttnStats> {
        p.validate(&kv.layout, q.len(), out.len(), (kv.k.len(), kv.v.len()))?;
        check_dtypes("attention_decode", p.dtype, &[q, &kv.k, &kv.v, out])?;
        let units = self.info.compute_units as usize;
        attention::decode(p, &kv.layout, units, &q.data, (&kv.k.data, &kv.v.data), &mut out.data)
    }

    fn attention_decode_enqueue(
        &self,
        p: &DecodeParams,
        q: &CpuBuffer,
        kv: &PagedKv<CpuBuffer>,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let s = self.attention_decode(p, q, kv, out)?;
        self.recomputed
            .fetch_add(s.recomputed, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn attention_prefill_enqueue(
        &self,
        p: &PrefillParams,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        kv: &mut PagedKv<CpuBuffer>,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let s = self.attention_prefill(p, q, k, v, kv, out)?;
        self.recomputed
            .fetch_add(s.recomputed, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn attention_prefill_cached_enqueue(
        &self,
        p: &PrefillParams,
        q: &CpuBuffer,
        kv: &PagedKv<CpuBuffer>,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        p.validate_cached(&kv.layout, (q.len(), out.len()), (kv.k.len(), kv.v.len()))?;
        check_dtypes("attention_prefill", p.dtype, &[q, &kv.k, &kv.v, out])?;
        let pools = (&kv.k.data[..], &kv.v.data[..]);
        let s = attention::prefill_cached(p, &kv.layout, &q.data, pools, &mut out.data)?;
        self.recomputed
            .fetch_add(s.recomputed, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn take_recomputed(&self) -> Result<usize> {
        Ok(self.recomputed.swap(0, std::sync::atomic::Ordering::Relaxed))
    }

    fn attention_prefill(
        &self,
        p: &PrefillParams,
        q: &CpuBuffer,
        k: &CpuBuffer,
        v: &CpuBuffer,
        kv: &mut PagedKv<CpuBuffer>,
        out: &mut CpuBuffer,
    ) -> Result<AttnStats> {
        p.validate(
            &kv.layout,
            (q.len(), out.len()),
            (k.len(), v.len()),
            (kv.k.len(), kv.v.len()),
        )?;
        check_dtypes("attention_prefill", p.dtype, &[q, k, v, &kv.k, &kv.v, out])?;
        let pools = (&mut kv.k.data[..], &mut kv.v.data[..]);
        attention::prefill(p, &kv.layout, &q.data, (&k.data, &v.data), pools, &mut out.data)
    }

    fn attention_score_hist(
        &self,
        p: &PrefillParams,
        s: &crate::ops::scores::ScoreStatsParams,
        q: &CpuBuffer,
        kv: &PagedKv<CpuBuffer>,
    ) -> Result<Vec<crate::ops::scores::ScoreHist>> {
        // There are no out, k or v buffers here: their required lengths stand in for them, so
        // that the params, the tables, q and the pools get the checks attention_prefill runs.
        let g = p.geom;
        let t = p.tokens();
        let (qo, kvn) = (t * g.num_heads * g.head_dim, t * g.num_kv_heads * g.head_dim);
        p.validate(&kv.layout, (q.len(), qo), (kvn, kvn), (kv.k.len(), kv.v.len()))?;
        s.spec.validate()?;
        check_dtypes("attention_score_hist", p.dtype, &[q, &kv.k])?;
        Ok(scores::score_hist(p, s, &kv.layout, &q.data, &kv.k.data))
    }

    fn embedding(&self, p: &EmbeddingParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        layer::embedding(p, table, out)
    }

    fn pipelined_greedy(&self) -> bool {
        true
    }

    fn argmax_rows(&self, logits: &CpuBuffer, rows: usize, width: usize) -> Result<Vec<u32>> {
        // What the trait's host path does, without its copy of the logits and with the F16C
        // widening (`half`'s slice conversion went one value per call): ~0.14 ms of a
        // SmolLM2-135M decode step (49 152 logits).
        super::check_argmax_dims(logits.data.len(), rows, width)?;
        let mut row = vec![0f32; width];
        (0..rows)
            .map(|r| {
                simd::widen(logits.dtype, &logits.data[r * width..(r + 1) * width], &mut row);
                if let Some(i) = row.iter().position(|v| v.is_nan()) {
                    return Err(super::nan_logit(r, Some(i)));
                }
                Ok(crate::engine::sampler::argmax(&row) as u32)
            })
            .collect()
    }

    fn greedy_enqueue(&self, logits: &CpuBuffer, rows: usize, width: usize) -> Result<()> {
        let ids = self.argmax_rows(logits, rows, width)?;
        let mut q = self.greedy_queue()?;
        q.queued.push_back(ids.clone());
        q.newest = Some(ids);
        Ok(())
    }

    fn greedy_take(&self) -> Result<Vec<u32>> {
        self.greedy_queue()?
            .queued
            .pop_front()
            .ok_or_else(|| FdppError::InvalidArgument("greedy_take: no greedy choice is queued".into()))
    }

    fn embedding_fed(&self, p: &EmbeddingParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        let ids = match &self.greedy_queue()?.newest {
            Some(ids) if ids.len() == p.ids.len() => ids.iter().map(|&i| i as i32).collect(),
            newest => {
                return Err(FdppError::InvalidArgument(format!(
                    "embedding_fed: {} rows asked for, but the newest queued greedy choice holds {}",
                    p.ids.len(),
                    newest.as_ref().map_or("none".to_string(), |n| n.len().to_string())
                )))
            }
        };
        layer::embedding(&EmbeddingParams { ids, ..p.clone() }, table, out)
    }

    fn add_rmsnorm(
        &self,
        p: &RmsNormParams,
        residual: &mut CpuBuffer,
        delta: Option<&CpuBuffer>,
        weight: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        layer::add_rmsnorm(p, residual, delta, weight, out)
    }

    fn qkv_rope(
        &self,
        p: &RopeParams,
        qkv: &CpuBuffer,
        bias: Option<&CpuBuffer>,
        q: &mut CpuBuffer,
        k: &mut CpuBuffer,
        v: &mut CpuBuffer,
    ) -> Result<()> {
        let table = self.rope.get(&p.positions, &p.inv_freq);
        layer::qkv_rope_with(p, &table, qkv, bias, q, k, v)
    }

    fn silu_mul(&self, p: &SiluMulParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        layer::silu_mul(p, gate_up, out)
    }

    fn add_layernorm(
        &self,
        p: &LayerNormParams,
        residual: &mut CpuBuffer,
        delta: Option<&CpuBuffer>,
        weight: &CpuBuffer,
        bias: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        layer::add_layernorm(p, residual, delta, weight, bias, out)
    }

    fn bias_act(&self, p: &BiasActParams, x: &mut CpuBuffer, bias: Option<&CpuBuffer>) -> Result<()> {
        layer::bias_act(p, x, bias)
    }

    fn glu(&self, p: &GluParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        layer::glu(p, gate_up, out)
    }

    fn add_positions(&self, p: &PositionParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        layer::add_positions(p, table, out)
    }

    fn kv_append(&self, p: &KvAppendParams, k: &CpuBuffer, v: &CpuBuffer, kv: &mut PagedKv<CpuBuffer>) -> Result<()> {
        layer::kv_append(p, k, v, kv)
    }

    fn gather_rows(&self, p: &GatherParams, src: &CpuBuffer, dst: &mut CpuBuffer) -> Result<()> {
        layer::gather_rows(p, src, dst)
    }

    fn fill_random(&self, buf: &mut CpuBuffer, seed: u64, scale: f32) -> Result<()> {
        layer::fill_random(buf, seed, scale)
    }

    fn scale_cols(&self, w: &mut CpuBuffer, scale: &CpuBuffer, rows: usize, cols: usize) -> Result<()> {
        layer::scale_cols(w, scale, rows, cols)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn copy_gbps(&self) -> Result<f64> {
        // The memory roofline of the CPU kernels, which mostly read (a GEMV streams W). A
        // buffer-to-buffer copy undercounts what the memory delivers: each written line is first
        // read for ownership, so 2 bytes counted move 3, and a read-only kernel then appears to
        // beat the "roofline" (up to 1.5x). So the roofline is the faster of a parallel read
        // stream (a sum) and the copy, each the fastest of several runs after a warm-up that
        // also faults the pages in: the machine's attainable rate, which noise only lowers.
        let len = 128 << 20; // 256 MiB of u16, well past any LLC.
        let src = vec![1u16; len];
        let mut dst = vec![0u16; len];
        let copy = |dst: &mut Vec<u16>| {
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
        };
        let read = || -> u64 {
            src.par_chunks(1 << 16)
                .map(|c| {
                    // SAFETY: every bit pattern is a valid u128; align_to leaves the unaligned
                    // ends in the outer slices, which are skipped (at most 30 bytes a chunk).
                    let (_, words, _) = unsafe { c.align_to::<u128>() };
                    words.iter().fold(0u128, |a, &w| a ^ w) as u64
                })
                .fold(|| 0u64, |a, x| a ^ x)
                .reduce(|| 0u64, |a, x| a ^ x)
        };
        copy(&mut dst);
        let mut checksum = read();
        let copy_ms = self.time_each(5, &mut |_| {
            copy(&mut dst);
            Ok(())
        })?;
        let read_ms = self.time_each(5, &mut |_| {
            checksum ^= read();
            Ok(())
        })?;
        std::hint::black_box(checksum);
        let best = |ms: &[f64]| ms.iter().copied().fold(f64::INFINITY, f64::min);
        let bytes = (2 * len) as f64;
        let copy_gbps = 2.0 * bytes / (best(&copy_ms) * 1e-3) / 1e9;
        let read_gbps = bytes / (best(&read_ms) * 1e-3) / 1e9;
        Ok(copy_gbps.max(read_gbps))
    }

    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
        let mut out = Vec::with_capacity(reps);
        for i in 0..reps {
            let t = Instant::now();
            f(i)?;
            out.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(out)
    }
}

/// An empty vector with room for `len` values whose pages, where the buffer is large, the kernel
/// is asked to back with 2 MiB pages (`madvise(MADV_HUGEPAGE)`, which the default
/// `transparent_hugepage=madvise` honours) before anything touches them. Weights are streamed
/// once per token (the GEMV at decode reads all of them): with 4 KiB pages that is a TLB miss
/// every 64 cache lines, a page walk the hardware prefetcher cannot run ahead of, since it
/// stops at page boundaries. Best effort: where the advice is refused, the buffer is the same,
/// on small pages.
fn huge_page_vec(len: usize) -> Vec<u16> {
    let v: Vec<u16> = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (start, bytes) = (v.as_ptr() as usize, len * std::mem::size_of::<u16>());
        let (lo, hi) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if bytes >= 2 * HUGE && hi > lo {
            // SAFETY: [lo, hi) lies inside the allocation just made for `v` (rounded inwards
            // to whole huge pages), and MADV_HUGEPAGE changes how its pages are backed, never
            // what they hold; its result is ignored (advice only).
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

/// Every buffer of an attention call must hold the params' dtype.
fn check_dtypes(op: &str, dtype: DType, bufs: &[&CpuBuffer]) -> Result<()> {
    match bufs.iter().find(|b| b.dtype != dtype) {
        Some(b) => Err(FdppError::InvalidArgument(format!(
            "{op}: a buffer holds {}, the call is {dtype}; every buffer must be {dtype}",
            b.dtype
        ))),
        None => Ok(()),
    }
}

/// SHA-256 (first 16 hex digits) of the kernel sources compiled into this binary, so that a
/// profile timed with other CPU kernels is recognised as such.
pub fn kernel_source_hash() -> String {
    let files = [
        ("simd.rs", include_str!("simd.rs")),
        ("panel.rs", include_str!("panel.rs")),
        ("gemv.rs", include_str!("gemv.rs")),
        ("flat_gemm.rs", include_str!("flat_gemm.rs")),
        ("gemm.rs", include_str!("gemm.rs")),
        ("attention.rs", include_str!("attention.rs")),
        // How the loops are spread over the threads is part of every timing.
        ("pool.rs", include_str!("pool.rs")),
    ];
    format!("cpu-{}", crate::backend::kernel_cache::hash_files(&files))
}

/// The narrow B_N offered besides [`flat_gemm::DEFAULT_BLOCK_N`]: twice the tasks, half the
/// prefetch streams per task, which pays at M = 1 where the op only streams W.
const FLAT_GEMM_NARROW_BLOCK_N: u32 = 8;

/// Rows of W per task: the spec's block_n where it names one, else the implementation's default.
fn block_rows(spec: &GemmSpec, dims: GemmDims) -> Result<usize> {
    let default = match spec.imp {
        GemmImpl::Gemv => gemv::default_rows_per_task(dims.n, dims.k),
        GemmImpl::FlatGemm => flat_gemm::DEFAULT_BLOCK_N,
        GemmImpl::Gemm => gemm::default_block_rows(dims.n),
    };
    match spec.block_n {
        None => Ok(default.min(dims.n)),
        Some(0) => Err(FdppError::InvalidArgument(format!(
            "{spec}: block_n must be at least 1 (leave it out for the default of {default})"
        ))),
        // A block wider than N is one block of N rows.
        Some(bn) => Ok((bn as usize).min(dims.n)),
    }
}

/// y[..M·N] = narrow(x · Wᵀ) with the implementation the spec names; lengths already checked.
fn run_gemm(spec: &GemmSpec, d: GemmDims, block: usize, x: &[u16], w: &[u16], y: &mut [u16]) {
    let dt = spec.dtype;
    let x = &x[..d.m * d.k];
    let w = &w[..d.n * d.k];
    let y = &mut y[..d.m * d.n];
    match spec.imp {
        // The GEMM widens x while it packs it and rounds into y itself (see gemm.rs).
        GemmImpl::Gemm => gemm::gemm(dt, d, x, w, y, block),
        // The GEMV and flat GEMM read x widened and write yᵀ in f32 ([N, M]), rounded here.
        GemmImpl::Gemv | GemmImpl::FlatGemm => {
            let mut xf = vec![0f32; d.m * d.k];
            simd::widen(dt, x, &mut xf);
            let mut out_t = vec![0f32; d.n * d.m];
            if spec.imp == GemmImpl::Gemv {
                gemv::gemv(dt, d, &xf, w, &mut out_t, block);
            } else {
                flat_gemm::flat_gemm(dt, d, &xf, w, &mut out_t, block);
            }
            narrow_transposed(dt, d, &out_t, y);
        }
    }
}

/// Rows of y per task of [`narrow_transposed`]: a 64-byte line of `out_t` holds 16 values of
/// one column of y.
const TRANSPOSE_ROWS: usize = 16;
/// Columns of y per step of [`narrow_transposed`].
const TRANSPOSE_COLS: usize = 64;

/// y[m, n] = narrow(out_t[n, m]). One task per 16 rows of y: it reads each line of `out_t` it
/// needs once (16 consecutive m of one n), a block of 64 columns at a time, and rounds each
/// row's 64 values with the vector narrowing. Gathering one row of y at a time instead touched
/// every line of `out_t` (1.5 MiB at M = 128 for FFN1, beyond L2) 16 times.
fn narrow_transposed(dt: DType, d: GemmDims, out_t: &[f32], y: &mut [u16]) {
    if d.m == 1 {
        simd::narrow(dt, out_t, y);
        return;
    }
    let (m, n) = (d.m, d.n);
    pool::chunks_mut(y, TRANSPOSE_ROWS * n, |blk, y_rows| {
        let mut tmp = vec![0f32; TRANSPOSE_ROWS * TRANSPOSE_COLS];
        let m0 = blk * TRANSPOSE_ROWS;
        let rows = y_rows.len() / n;
        let mut c0 = 0;
        while c0 < n {
            let cols = TRANSPOSE_COLS.min(n - c0);
            for c in 0..cols {
                let col = &out_t[(c0 + c) * m + m0..(c0 + c) * m + m0 + rows];
                for (j, &v) in col.iter().enumerate() {
                    tmp[j * TRANSPOSE_COLS + c] = v;
                }
            }
            for j in 0..rows {
                let src = &tmp[j * TRANSPOSE_COLS..j * TRANSPOSE_COLS + cols];
                simd::narrow(dt, src, &mut y_rows[j * n + c0..j * n + c0 + cols]);
            }
            c0 += cols;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocked transpose against the plain one at odd M and N (partial row blocks and
    /// column blocks), NaN-poisoned output.
    #[test]
    fn narrow_transposed_matches_a_plain_transpose_at_odd_sizes() {
        for dt in [DType::F16, DType::Bf16] {
            for (m, n) in [(1, 5), (2, 1), (3, 64), (17, 65), (33, 130), (16, 200)] {
                let out_t: Vec<f32> = (0..m * n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173).collect();
                let mut y = vec![dt.poison(); m * n];
                narrow_transposed(dt, GemmDims { m, n, k: 1 }, &out_t, &mut y);
                for i in 0..m {
                    for j in 0..n {
                        assert_eq!(
                            y[i * n + j],
                            dt.from_f32(out_t[j * m + i]),
                            "{dt} m {m} n {n} [{i}, {j}]"
                        );
                    }
                }
            }
        }
    }
}
