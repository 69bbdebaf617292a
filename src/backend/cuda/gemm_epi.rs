//! The prefill's fused layer on Hopper: fdpp's wgmma GEMM (kernels_cuda/gemm_hopper.cu) with the
//! small ops of a Llama layer as its epilogues, so that a prefill layer runs no add_rmsnorm, no
//! silu_mul and no qkv_rope (issue #20; reports/NOTES.md, sessions 30-33):
//! - O and FFN2 add their product into the residual in place and write each row's sum of squares
//!   over their column tile ([`residual_out`], EPI_RES_SS): the next norm's statistics;
//! - QKV and FFN1 run on the raw residual with the norm's γ folded into W (the fused decode's
//!   `fold_norms`) and scale row r by 1/rms from those partial sums ([`rms_in`], EPI_STORE_RS;
//!   [`rms_glu`], EPI_GLU_RS, which also writes silu(gate)·up; [`rms_rope_append`],
//!   EPI_QKV_ROPE, which also rotates q and k and writes k and v into the paged pools);
//! - the first layer's residual, which no epilogue summed, gets [`row_sumsq`].
//!
//! Each epilogue is its unfused pair bit for bit on the same tile (the same roundings; see the
//! kernel file), and the sums are deterministic (one partial per row and column tile, summed in
//! a fixed order by the reader). Why on Hopper only: the epilogues need the wgmma GEMM, which
//! cuBLAS's kernels (ImplC elsewhere) cannot take.
//!
//! The tile per op is chosen here by how full the last wave is (Llama2-7B's QKV fills 2.91 of 3
//! waves with 128 × 256 tiles, Llama-3.1-8B's 1.45 of 2), not by the profile: the profile's ImplC
//! pick times the plain product, and the fusion is worth more than the few % between tiles.

use std::cell::RefCell;
use std::collections::HashMap;

use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};

use super::launch::Launch;
use super::sources::{self, KernelSource};
use super::{drv, tma, CudaBackend, CudaBuffer};
use crate::backend::{Backend, DeviceBuffer, RowSums};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::gemm::GemmDims;
use crate::ops::layer::{KvAppendParams, RopeParams};

/// The epilogues of the fused prefill (gemm_hopper.cu's `Epi` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epi {
    /// y = round(acc · 1/rms) (QKV with a rotary the epilogue does not run, FFN1 unfused GLU).
    StoreRs = 4,
    /// y = silu(round(g · 1/rms)) · round(u · 1/rms) (FFN1).
    GluRs = 5,
    /// residual = round(residual + round(acc)), each row's Σ residual² per column tile (O, FFN2).
    ResSs = 6,
    /// QKV's whole tail: 1/rms, rotate-half of q and k, q stored, k and v to their pool slots.
    QkvRope = 7,
}

impl Epi {
    fn tag(self) -> &'static str {
        match self {
            Epi::StoreRs => "rs",
            Epi::GluRs => "glu_rs",
            Epi::ResSs => "res_ss",
            Epi::QkvRope => "qkv_rope",
        }
    }
    fn glu(self) -> bool {
        self == Epi::GluRs
    }
    /// Scales its rows by 1/rms (the kernel's `row_scaled`): producer warp 1 computes the scales
    /// into shared memory a tile ahead.
    fn row_scaled(self) -> bool {
        matches!(self, Epi::StoreRs | Epi::GluRs | Epi::QkvRope)
    }
}

/// A tile of the fused GEMM: 128 rows × `bn` W rows (for the GLU, bn/2 gate and bn/2 up rows),
/// `stages` K blocks in the ring, clusters of `cl` CTAs stacked along M sharing the W block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bn: u32,
    pub stages: u32,
    pub cl: u32,
}

/// The tiles offered per epilogue, best first where the waves fill alike (session 31's H200
/// table: 128 × 256 with 4 stages for the plain, residual and rotary forms; the SwiGLU at
/// 128 × (128 + 128) in clusters of 2 at M = 4096 (1.01-1.03× cuBLAS + silu_mul, where 96 + 96
/// was 0.93-0.95×), and 128 × (96 + 96), 5 stages, where its waves fill better (Llama2-7B at
/// M = 1024: 0.99× against 0.88×; unclustered it was 0.90×)).
pub fn tiles(epi: Epi) -> &'static [Tile] {
    const WIDE: Tile = Tile {
        bn: 256,
        stages: 4,
        cl: 1,
    };
    const NARROW: Tile = Tile {
        bn: 128,
        stages: 6,
        cl: 1,
    };
    const GLU_128: Tile = Tile {
        bn: 256,
        stages: 4,
        cl: 2,
    };
    const GLU_96: Tile = Tile {
        bn: 192,
        stages: 5,
        cl: 2,
    };
    match epi {
        Epi::GluRs => &[GLU_128, GLU_96],
        _ => &[WIDE, NARROW],
    }
}

/// Every (epilogue, tile) the engine may launch: what `kernels check` compiles.
pub fn variants() -> Vec<(Epi, Tile)> {
    [Epi::StoreRs, Epi::GluRs, Epi::ResSs, Epi::QkvRope]
        .iter()
        .flat_map(|&e| tiles(e).iter().map(move |&t| (e, t)))
        .collect()
}

const BM: u32 = 128;
const BK: u32 = 64;
const THREADS: u32 = 384;
/// head_dim of the rotary epilogue (gemm_hopper.cu's HD).
pub const ROPE_HEAD_DIM: usize = 128;

/// Columns of y one tile writes.
fn out_n(epi: Epi, t: Tile) -> u32 {
    if epi.glu() {
        t.bn / 2
    } else {
        t.bn
    }
}

/// Columns of a staged chunk (a TMA store box): 64, or 32 where the tile's width is not a
/// multiple of 64.
fn chunk_cols(epi: Epi, t: Tile) -> u32 {
    if out_n(epi, t).is_multiple_of(64) {
        64
    } else {
        32
    }
}

/// gemm_hopper.cu's `smem_bytes`: the stages, four staging buffers, the barriers, the row
/// scales' barriers and two buffers (`row_scale_bytes`), the slack.
pub fn smem_bytes(epi: Epi, t: Tile) -> u32 {
    let row_scales = if epi.row_scaled() { 32 + 2 * BM * 4 } else { 0 };
    t.stages * (BM * BK * 2 + t.bn * BK * 2) + 4 * 64 * chunk_cols(epi, t) * 2 + 16 * t.stages + 32 + row_scales + 1024
}

/// The module of one (epilogue, tile) in `dt`.
pub fn source(dt: DType, epi: Epi, t: Tile) -> KernelSource {
    sources::gemm_epi_source(dt, &uri(dt, epi, t), epi as u32, t.bn, t.stages, t.cl)
}

fn uri(dt: DType, epi: Epi, t: Tile) -> String {
    format!("gemm_epi_{dt}_{}_bn{}_s{}_cl{}", epi.tag(), t.bn, t.stages, t.cl)
}

/// The tile for `epi` at [M, N]: the first of [`tiles`] unless another fills its last wave
/// better by more than 10 % (tiles / (waves · SMs), clusters counted as one unit of `cl` SMs).
pub fn pick_tile(epi: Epi, m: usize, n: usize, sms: u32) -> Tile {
    let fill = |t: &Tile| {
        let units = m.div_ceil((BM * t.cl) as usize) * n.div_ceil(out_n(epi, *t) as usize);
        let slots = (sms / t.cl).max(1) as usize;
        units as f64 / (units.div_ceil(slots) * slots) as f64
    };
    let all = tiles(epi);
    let first = all[0];
    all.iter()
        .copied()
        .skip(1)
        .filter(|t| fill(t) > 1.1 * fill(&first))
        .max_by(|a, b| fill(a).total_cmp(&fill(b)))
        .unwrap_or(first)
}

/// The kernel's `Args` (gemm_hopper.cu), field for field: pointers as u64, eps padded to 8.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Args {
    y: u64,
    res: u64,
    ss: u64,
    eps: f32,
    _pad: u32,
    cs: u64,
    q: u64,
    kpool: u64,
    vpool: u64,
    slots: u64,
    h: i32,
    g: i32,
    m: i32,
    n: i32,
    k: i32,
    tiles_m: i32,
    tiles_n: i32,
    nparts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), checked by a test).
unsafe impl DeviceRepr for Args {}

/// Device scratch of the fused prefill: the rotary's (cos, sin) table of the step's positions,
/// and the resident clusters per kernel (the persistent grid's size).
#[derive(Default)]
pub struct Scratch {
    table: Option<CudaSlice<f32>>,
    /// What the table holds: the positions and inverse frequencies it was made from.
    table_of: (Vec<i32>, Vec<f32>),
    clusters: HashMap<String, u32>,
}

/// Boxed, as the backend's other scratch is: `AnyBackend`'s variants stay within clippy's size bound.
pub type ScratchCell = RefCell<Box<Scratch>>;

fn i32_of(v: usize, what: &str, op: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| FdppError::InvalidArgument(format!("{op}: {what} = {v} exceeds i32")))
}

fn unsupported(op: &str, what: String) -> FdppError {
    FdppError::Unsupported {
        spec: format!("{op} (fdpp's Hopper GEMM, fused prefill)"),
        what,
    }
}

/// Whether this device runs the fused prefill at all (sm_90a, the shared memory the tiles need).
pub fn available(b: &CudaBackend) -> bool {
    b.info().arch == super::prefill_hopper::ARCH
        && variants()
            .iter()
            .all(|&(e, t)| smem_bytes(e, t) <= b.max_smem_per_block())
}

/// What every fused GEMM needs: the arch, K and N multiples of 8 (16-byte TMA rows), 16-byte
/// aligned buffers, every buffer in the GEMM's dtype, and i32 dims.
fn check_gemm(b: &CudaBackend, op: &str, d: &GemmDims, bufs: &[(&str, &CudaBuffer)]) -> Result<DType> {
    if b.info().arch != super::prefill_hopper::ARCH {
        return Err(unsupported(
            op,
            format!(
                "arch {} (the wgmma GEMM needs {})",
                b.info().arch,
                super::prefill_hopper::ARCH
            ),
        ));
    }
    if !d.k.is_multiple_of(8) || !d.n.is_multiple_of(8) {
        return Err(unsupported(
            op,
            format!("{}: K and N must be multiples of 8 for TMA rows", d.label()),
        ));
    }
    let dt = bufs[0].1.dtype();
    for (name, x) in bufs {
        if x.dtype() != dt {
            return Err(FdppError::InvalidArgument(format!(
                "{op} at {}: {name} is {}, {} is {dt}",
                d.label(),
                x.dtype(),
                bufs[0].0
            )));
        }
        if !b.ptr(x).is_multiple_of(16) {
            return Err(unsupported(op, format!("{name} is not 16-byte aligned")));
        }
    }
    for (what, v) in [("M", d.m), ("N", d.n), ("K", d.k)] {
        i32_of(v, what, op)?;
    }
    Ok(dt)
}

/// `sums` describe the partial sums of squares in `ss` for this GEMM's rows and K.
fn check_sums(op: &str, d: &GemmDims, sums: RowSums, ss: &CudaBuffer) -> Result<()> {
    if sums.rows != d.m || sums.cols != d.k || sums.parts == 0 {
        return Err(FdppError::InvalidArgument(format!(
            "internal: {op} at {} reads row sums of {} rows × {} columns in {} parts",
            d.label(),
            sums.rows,
            sums.cols,
            sums.parts
        )));
    }
    if ss.len() < 2 * sums.rows * sums.parts {
        return Err(FdppError::Shape {
            what: format!("{op} row sums at {}", d.label()),
            expected: format!(">= {} elements", 2 * sums.rows * sums.parts),
            found: ss.len().to_string(),
        });
    }
    Ok(())
}

/// 16-bit elements the row-sum scratch needs for `rows` rows of a `cols`-wide residual: two per
/// f32 partial, one partial per column tile of the narrowest residual tile.
pub fn row_sums_len(rows: usize, cols: usize) -> usize {
    let narrowest = tiles(Epi::ResSs)
        .iter()
        .map(|&t| out_n(Epi::ResSs, t))
        .min()
        .unwrap_or(128) as usize;
    2 * rows * cols.div_ceil(narrowest).max(1)
}

/// The maps and launch of one fused GEMM.
struct Gemm<'a> {
    op: &'a str,
    epi: Epi,
    dt: DType,
    d: GemmDims,
    /// x [M, K]; W [N_w, K]; y or the residual [M, N_out] (unused by the rotary).
    x: u64,
    w: u64,
    y: u64,
    args: Args,
}

impl Gemm<'_> {
    fn run(mut self, b: &CudaBackend) -> Result<RowSums> {
        let (epi, d) = (self.epi, self.d);
        let t = pick_tile(epi, d.m, d.n, b.info().compute_units);
        let smem = smem_bytes(epi, t);
        if smem > b.max_smem_per_block() {
            return Err(unsupported(
                self.op,
                format!(
                    "{} KiB of shared memory (the device allows {} KiB)",
                    smem >> 10,
                    b.max_smem_per_block() >> 10
                ),
            ));
        }
        let on = out_n(epi, t);
        let w_box = if epi.glu() || t.cl == 2 { t.bn / 2 } else { t.bn };
        let xm = tma::matrix_map(self.x, d.m, d.k, BM, BK, "x")?;
        let wm = tma::matrix_map(self.w, d.n, d.k, w_box, BK, "W")?;
        // The GLU's up rows follow its N gate rows.
        let um = if epi.glu() {
            tma::matrix_map(self.w + (d.n * d.k * 2) as u64, d.n, d.k, w_box, BK, "W (up rows)")?
        } else {
            wm
        };
        let cw = chunk_cols(epi, t);
        let ym = if epi == Epi::QkvRope {
            xm
        } else {
            tma::matrix_map(self.y, d.m, d.n, 64, cw, "y")?
        };
        let tiles_m = d.m.div_ceil(BM as usize);
        let tiles_n = d.n.div_ceil(on as usize);
        let a = &mut self.args;
        a.m = i32_of(d.m, "M", self.op)?;
        a.n = i32_of(d.n, "N", self.op)?;
        a.k = i32_of(d.k, "K", self.op)?;
        a.tiles_m = i32_of(tiles_m, "tiles", self.op)?;
        a.tiles_n = i32_of(tiles_n, "tiles", self.op)?;
        let uri = uri(self.dt, epi, t);
        let (dt, op) = (self.dt, self.op);
        let f = b.function_of(&uri, "gemm_hopper_epi", smem, || Ok(source(dt, epi, t)))?;
        let units = tiles_m.div_ceil(t.cl as usize) * tiles_n;
        let resident = if t.cl == 1 {
            b.info().compute_units
        } else {
            resident_clusters(b, &uri, &f, t, smem)?
        };
        let cfg = LaunchConfig {
            grid_dim: (t.cl * (units.min(resident as usize) as u32), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let args = self.args;
        // Chained: every thread waits (pdl_wait) before it touches an activation; only the W
        // boxes of the first stages are read before (gemm_hopper.cu, FDPP_GEMM_PDL).
        let mut l = Launch::chained(b, &f);
        l.cluster_x(t.cl);
        l.arg(&xm).arg(&wm).arg(&um).arg(&ym).arg(&ym).arg(&args);
        // SAFETY: the maps cover x [M, K], W [N (2N for the GLU), K] and y / the residual
        // [M, N] (lengths checked by the callers); ss holds nparts · M partials for the row-scaled
        // forms and tiles_n · M for EPI_RES_SS (row_sums_len); the rotary's table, q, the pools
        // and the slots are checked in rms_rope_append; smem and the block match the kernel.
        unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {op} ({uri})")))?;
        b.check_launch(&format!("{op} ({uri}) at {}", d.label()))?;
        Ok(RowSums {
            rows: d.m,
            cols: d.n,
            parts: tiles_n,
        })
    }
}

/// Clusters of `t.cl` CTAs of `f` resident at once (cuOccupancyMaxActiveClusters), cached per
/// kernel: the persistent grid launches no more, so that none waits for a whole cluster to leave.
fn resident_clusters(b: &CudaBackend, uri: &str, f: &cudarc::driver::CudaFunction, t: Tile, smem: u32) -> Result<u32> {
    if let Some(&n) = b.epi.borrow().clusters.get(uri) {
        return Ok(n);
    }
    let attr = super::launch::cluster_dim(t.cl);
    let mut attrs = [attr];
    let config = sys::CUlaunchConfig {
        gridDimX: b.info().compute_units.max(t.cl) / t.cl * t.cl,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: THREADS,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: b.stream().cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: 1,
    };
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `config` and its one attribute are live locals; the driver only writes `n`.
    let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
    if r != sys::CUresult::CUDA_SUCCESS || n < 1 {
        return Err(FdppError::device(
            "cuda",
            format!(
                "{uri}: no cluster of {} CTAs with {} KiB of shared memory fits ({r:?})",
                t.cl,
                smem >> 10
            ),
        ));
    }
    let n = n as u32;
    b.epi.borrow_mut().clusters.insert(uri.to_string(), n);
    Ok(n)
}

/// ss = Σ_c x[r, c]² of `rows` rows of x [rows, cols] (one part per row).
pub fn row_sumsq(b: &CudaBackend, rows: usize, cols: usize, x: &CudaBuffer, ss: &mut CudaBuffer) -> Result<RowSums> {
    const OP: &str = "prefill row_sumsq";
    let d = GemmDims::new(rows, cols, cols)?;
    let dt = check_gemm(b, OP, &d, &[("x", x), ("ss", ss)])?;
    if x.len() < rows * cols {
        return Err(FdppError::Shape {
            what: format!("{OP} x at {}", d.label()),
            expected: format!(">= {} elements", rows * cols),
            found: x.len().to_string(),
        });
    }
    if ss.len() < 2 * rows {
        return Err(FdppError::Shape {
            what: format!("{OP} row sums of {rows} rows"),
            expected: format!(">= {} elements", 2 * rows),
            found: ss.len().to_string(),
        });
    }
    let t = tiles(Epi::ResSs)[0];
    let f = b.function_of(&uri(dt, Epi::ResSs, t), "row_sumsq", 0, || {
        Ok(source(dt, Epi::ResSs, t))
    })?;
    let c = i32_of(cols, "cols", OP)?;
    let (xp, sp) = (b.ptr(x), b.ptr(ss));
    let cfg = LaunchConfig {
        grid_dim: (i32_of(rows, "rows", OP)? as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::plain(b, &f);
    l.arg(&xp).arg(&sp).arg(&c);
    // SAFETY: x covers [rows, cols] (cols % 8 == 0, 16-byte aligned), ss rows f32 (checked).
    unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {OP}")))?;
    b.check_launch(OP)?;
    Ok(RowSums { rows, cols, parts: 1 })
}

/// residual = round(residual + round(x · Wᵀ)) in place, and each row's Σ residual² per column
/// tile into ss.
pub fn residual_out(
    b: &CudaBackend,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    residual: &mut CudaBuffer,
    ss: &mut CudaBuffer,
) -> Result<RowSums> {
    const OP: &str = "prefill gemm_residual_out";
    let dt = check_gemm(b, OP, &d, &[("x", x), ("w", w), ("residual", residual), ("ss", ss)])?;
    check_lens(OP, &d, x.len(), w.len(), d.n, residual.len())?;
    // Whatever tile `run` picks writes at most the parts row_sums_len allows for.
    if ss.len() < row_sums_len(d.m, d.n) {
        return Err(FdppError::Shape {
            what: format!("{OP} row sums at {}", d.label()),
            expected: format!(">= {} elements (row_sums_len)", row_sums_len(d.m, d.n)),
            found: ss.len().to_string(),
        });
    }
    let rp = b.ptr(residual);
    let args = Args {
        y: rp,
        res: rp,
        ss: b.ptr(ss),
        ..Args::default()
    };
    Gemm {
        op: OP,
        epi: Epi::ResSs,
        dt,
        d,
        x: b.ptr(x),
        w: b.ptr(w),
        y: rp,
        args,
    }
    .run(b)
}

/// x, W [w_rows, K] and y lengths for a product of `d` (the GLU's W has 2N rows).
fn check_lens(op: &str, d: &GemmDims, x: usize, w: usize, w_rows: usize, y: usize) -> Result<()> {
    for (name, need, have) in [("x", d.m * d.k, x), ("w", w_rows * d.k, w), ("y", d.m * d.n, y)] {
        if have < need {
            return Err(FdppError::Shape {
                what: format!("{op} {name} at {}", d.label()),
                expected: format!(">= {need} elements"),
                found: have.to_string(),
            });
        }
    }
    Ok(())
}

fn scaled_args(b: &CudaBackend, eps: f32, sums: RowSums, ss: &CudaBuffer, op: &str) -> Result<Args> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(FdppError::InvalidArgument(format!(
            "{op}: eps = {eps} (must be finite and > 0)"
        )));
    }
    Ok(Args {
        ss: b.ptr(ss),
        eps,
        nparts: i32_of(sums.parts, "row-sum parts", op)?,
        ..Args::default()
    })
}

/// y = rmsnorm(x) · W'ᵀ (W' with the norm's γ folded in): the product scaled per row by 1/rms
/// from `sums`.
#[allow(clippy::too_many_arguments)]
pub fn rms_in(
    b: &CudaBackend,
    d: GemmDims,
    sums: RowSums,
    eps: f32,
    ss: &CudaBuffer,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    scaled(b, "prefill gemm_rms_in", Epi::StoreRs, d, sums, eps, ss, x, w, y)
}

/// y [M, N] = silu(g) · u, [g | u] = rmsnorm(x) · W'ᵀ with W' [2N, K] (gate rows, then up rows,
/// γ folded in); `d.n` = N.
#[allow(clippy::too_many_arguments)]
pub fn rms_glu(
    b: &CudaBackend,
    d: GemmDims,
    sums: RowSums,
    eps: f32,
    ss: &CudaBuffer,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    scaled(b, "prefill gemm_rms_glu", Epi::GluRs, d, sums, eps, ss, x, w, y)
}

/// A row-scaled product with a stored output (`rms_in`, `rms_glu`; the GLU's W has 2N rows).
#[allow(clippy::too_many_arguments)]
fn scaled(
    b: &CudaBackend,
    op: &str,
    epi: Epi,
    d: GemmDims,
    sums: RowSums,
    eps: f32,
    ss: &CudaBuffer,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<()> {
    let dt = check_gemm(b, op, &d, &[("x", x), ("w", w), ("y", y), ("ss", ss)])?;
    let w_rows = if epi.glu() { 2 * d.n } else { d.n };
    check_lens(op, &d, x.len(), w.len(), w_rows, y.len())?;
    check_sums(op, &d, sums, ss)?;
    let yp = b.ptr(y);
    let args = Args {
        y: yp,
        ..scaled_args(b, eps, sums, ss, op)?
    };
    Gemm {
        op,
        epi,
        dt,
        d,
        x: b.ptr(x),
        w: b.ptr(w),
        y: yp,
        args,
    }
    .run(b)
    .map(|_| ())
}

/// QKV in one launch: rmsnorm(x) · W'ᵀ, q and k heads rotated (HF's rotate-half over the whole
/// head of 128), q into `q` [M, H·128], k and v into the pools at the tokens' slots: `rms_in`
/// followed by `qkv_rope_append`, bit for bit on the same tile. `Unsupported` for another
/// head_dim, a partial or interleaved rotary, or a QKV bias (the caller then runs the two ops).
#[allow(clippy::too_many_arguments)]
pub fn rms_rope_append(
    b: &CudaBackend,
    d: GemmDims,
    sums: RowSums,
    eps: f32,
    ss: &CudaBuffer,
    x: &CudaBuffer,
    w: &CudaBuffer,
    rope: &RopeParams,
    append: &KvAppendParams,
    q: &mut CudaBuffer,
    kv: &mut PagedKv<CudaBuffer>,
) -> Result<()> {
    const OP: &str = "prefill gemm_rms_rope_append";
    let g = rope.geom;
    rope.require_whole_half(OP)?;
    if g.head_dim != ROPE_HEAD_DIM {
        return Err(unsupported(
            OP,
            format!(
                "head_dim {} (the epilogue rotates heads of {ROPE_HEAD_DIM})",
                g.head_dim
            ),
        ));
    }
    let dt = check_gemm(
        b,
        OP,
        &d,
        &[
            ("x", x),
            ("w", w),
            ("q", q),
            ("K pool", &kv.k),
            ("V pool", &kv.v),
            ("ss", ss),
        ],
    )?;
    if d.n != rope.qkv_width() || d.m != rope.tokens() {
        return Err(FdppError::InvalidArgument(format!(
            "{OP} at {}: the rotary is over {} tokens of width {}",
            d.label(),
            rope.tokens(),
            rope.qkv_width()
        )));
    }
    check_lens(OP, &d, x.len(), w.len(), d.n, d.m * d.n)?;
    check_sums(OP, &d, sums, ss)?;
    let kv_elems = d.m * g.num_kv_heads * g.head_dim;
    rope.validate(d.m * d.n, None, q.len(), kv_elems, kv_elems)?;
    let layout = kv.layout;
    layout.validate()?;
    append.validate(&layout, kv_elems, kv_elems, (kv.k.len(), kv.v.len()))?;
    if append.tokens() != d.m || layout.token_elems() != g.num_kv_heads * g.head_dim {
        return Err(FdppError::InvalidArgument(format!(
            "{OP} at {}: {} appended tokens of width {} for {} rotated tokens of {} kv heads × {}",
            d.label(),
            append.tokens(),
            layout.token_elems(),
            d.m,
            g.num_kv_heads,
            g.head_dim
        )));
    }
    let slots = super::layer::slot_rows(b, append, &layout)?;
    let cs = rope_table(b, dt, rope)?;
    let args = Args {
        cs,
        q: b.ptr(q),
        kpool: b.ptr(&kv.k),
        vpool: b.ptr(&kv.v),
        slots,
        h: i32_of(g.num_heads, "heads", OP)?,
        g: i32_of(g.num_kv_heads, "kv heads", OP)?,
        ..scaled_args(b, eps, sums, ss, OP)?
    };
    Gemm {
        op: OP,
        epi: Epi::QkvRope,
        dt,
        d,
        x: b.ptr(x),
        w: b.ptr(w),
        y: 0,
        args,
    }
    .run(b)
    .map(|_| ())
}

/// The device address of the (cos, sin) table of the rotary's positions, [M][64] float2: made by
/// rope_table when the positions or frequencies differ from the last table's (once per step:
/// every layer rotates at the same positions).
fn rope_table(b: &CudaBackend, dt: DType, rope: &RopeParams) -> Result<u64> {
    const OP: &str = "prefill rope_table";
    let m = rope.tokens();
    let half = ROPE_HEAD_DIM / 2;
    if rope.inv_freq.len() < half {
        return Err(FdppError::InvalidArgument(format!(
            "{OP}: {} inverse frequencies for heads of {ROPE_HEAD_DIM}",
            rope.inv_freq.len()
        )));
    }
    {
        let st = b.epi.borrow();
        if let Some(t) = &st.table {
            if st.table_of.0 == rope.positions && st.table_of.1 == rope.inv_freq && t.len() >= 2 * m * half {
                let (p, _sync) = t.device_ptr(b.stream());
                return Ok(p);
            }
        }
    }
    let (pos, freq) = super::layer::rope_args(b, rope)?;
    let t = tiles(Epi::QkvRope)[0];
    let f = b.function_of(&uri(dt, Epi::QkvRope, t), "rope_table", 0, || {
        Ok(source(dt, Epi::QkvRope, t))
    })?;
    let mut st = b.epi.borrow_mut();
    if st.table.as_ref().is_none_or(|t| t.len() < 2 * m * half) {
        // SAFETY: every element is written by rope_table before any kernel reads it.
        st.table = Some(unsafe { b.stream().alloc::<f32>(2 * m * half) }.map_err(drv("rope table"))?);
    }
    let tp = {
        let table = st
            .table
            .as_ref()
            .ok_or_else(|| FdppError::device("cuda", "rope table missing after its allocation"))?;
        let (p, _sync) = table.device_ptr(b.stream());
        p
    };
    let mi = i32_of(m, "tokens", OP)?;
    let cfg = LaunchConfig {
        grid_dim: ((m * half).div_ceil(256).min(65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = Launch::plain(b, &f);
    l.arg(&pos).arg(&freq).arg(&tp).arg(&mi);
    // SAFETY: positions (M i32) and inv_freq (≥ 64 f32) are in the layer scratch; the table
    // holds M · 64 float2.
    unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {OP}")))?;
    b.check_launch(OP)?;
    st.table_of = (rope.positions.clone(), rope.inv_freq.clone());
    Ok(tp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_are_laid_out_as_the_kernels_struct() {
        // u16* y, res; float* ss; float eps (+4 of padding); float2* cs; u16* q, kpool, vpool;
        // int* slots; int H, G, M, N, K, tiles_m, tiles_n, nparts.
        assert_eq!(std::mem::size_of::<Args>(), 6 * 8 + 8 + 2 * 8 + 8 * 4);
        assert_eq!(std::mem::offset_of!(Args, cs), 32);
        assert_eq!(std::mem::offset_of!(Args, h), 72);
        assert_eq!(std::mem::offset_of!(Args, nparts), 100);
    }

    #[test]
    fn every_variant_fits_the_227_kib_of_an_sm90a_block() {
        for (e, t) in variants() {
            assert!(smem_bytes(e, t) <= 227 * 1024, "{e:?} {t:?}: {}", smem_bytes(e, t));
        }
        // The GLU's 96-column tile stages 32-column chunks.
        let glu96 = tiles(Epi::GluRs)[1];
        assert_eq!(chunk_cols(Epi::GluRs, glu96), 32);
        assert_eq!(
            smem_bytes(Epi::GluRs, glu96),
            5 * (16384 + 24576) + 4 * 4096 + 80 + 32 + (32 + 1024) + 1024
        );
        // The residual form keeps no row scales.
        let res = tiles(Epi::ResSs)[0];
        assert_eq!(
            smem_bytes(Epi::ResSs, res),
            4 * (16384 + 32768) + 4 * 8192 + 64 + 32 + 1024
        );
    }

    #[test]
    fn tiles_follow_the_last_waves_fill() {
        // Llama2-7B at M = 1024 on 132 SMs: QKV 384 tiles of 256 (2.91 of 3 waves) stays wide;
        // Llama-3.1-8B's QKV (6144) 192 of 256 (1.45 of 2) goes to 128 (384: 2.91 of 3).
        assert_eq!(pick_tile(Epi::QkvRope, 1024, 12288, 132).bn, 256);
        assert_eq!(pick_tile(Epi::QkvRope, 1024, 6144, 132).bn, 128);
        // O and FFN2 (4096): 128 tiles of 256, 0.97 of a wave.
        assert_eq!(pick_tile(Epi::ResSs, 1024, 4096, 132).bn, 256);
        // FFN1 (11008) in clusters of 2 on 66 cluster slots: at M = 1024 128 + 128 makes 344
        // units (5.21 of 6 waves), 96 + 96 460 (6.97 of 7); at 4096 the first fills 20.85 of 21
        // and is kept. Llama-3.1-8B's 14336 at 1024: 448 units, 6.79 of 7 waves.
        assert_eq!(pick_tile(Epi::GluRs, 1024, 11008, 132).bn, 192);
        assert_eq!(pick_tile(Epi::GluRs, 4096, 11008, 132).bn, 256);
        assert_eq!(pick_tile(Epi::GluRs, 1024, 14336, 132).bn, 256);
    }

    #[test]
    fn the_row_sum_scratch_holds_a_partial_per_narrowest_tile() {
        // 4096 columns in residual tiles of 128 (the narrowest) = 32 parts.
        assert_eq!(row_sums_len(1024, 4096), 2 * 1024 * 32);
        assert_eq!(row_sums_len(3, 8), 2 * 3);
    }
}
