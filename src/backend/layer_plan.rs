//! Host-side planning of the small per-layer kernels (kernels_cuda/layer.cu and its HIP port
//! kernels_hip/layer.hip): which entry point, the grid and block of each launch, the destination
//! slots of a KV append, and the packing of the host arrays a launch reads (token ids,
//! positions, inverse frequencies, slots) into one upload. Pure functions of the params, shared
//! by the CUDA and ROCm backends and unit-tested on the CPU.

use crate::error::{FdppError, Result};
use crate::kv::paged::PagedKvLayout;
use crate::ops::layer::{
    Activation, BiasActParams, GluParams, KvAppendParams, LayerNormParams, PositionParams, RmsNormParams, RopeLayout,
    RopeParams, SiluMulParams,
};

/// Threads per block of the row copies (gather, KV scatter) and of qkv_rope (must match the
/// `__launch_bounds__` in the kernel files).
pub const COPY_THREADS: u32 = 128;
pub const ROPE_THREADS: u32 = 128;
/// Threads per block of the grid-stride kernels (silu_mul, glu, bias_act, fill_random).
pub const STREAM_THREADS: u32 = 256;
/// Most threads an add_rmsnorm block takes (its `__launch_bounds__`).
pub const RMS_MAX_THREADS: u32 = 1024;
/// Blocks a grid-stride kernel is launched with at most: past this each thread takes more steps.
pub const MAX_STREAM_BLOCKS: u64 = 1 << 16;
/// Largest grid.y a launch may have (CUDA and HIP).
const MAX_GRID_Y: u64 = 65_535;

/// Every entry point of the layer kernel files; `name()` is the symbol in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKernel {
    AddRmsNormV,
    AddRmsNormS,
    QkvRope,
    SiluMulV,
    SiluMulS,
    GatherV8,
    GatherV4,
    GatherV2,
    GatherV1,
    ScatterKvV8,
    ScatterKvV4,
    ScatterKvV2,
    ScatterKvV1,
    FillRandom,
    ScaleCols,
    AddLayerNormV,
    AddLayerNormS,
    BiasActV,
    BiasActS,
    GluV,
    GluS,
    AddPositionsV,
    AddPositionsS,
    QkvRopeG,
}

impl LayerKernel {
    /// In declaration order: `ALL[k.index()] == k`.
    pub const ALL: [LayerKernel; 24] = [
        LayerKernel::AddRmsNormV,
        LayerKernel::AddRmsNormS,
        LayerKernel::QkvRope,
        LayerKernel::SiluMulV,
        LayerKernel::SiluMulS,
        LayerKernel::GatherV8,
        LayerKernel::GatherV4,
        LayerKernel::GatherV2,
        LayerKernel::GatherV1,
        LayerKernel::ScatterKvV8,
        LayerKernel::ScatterKvV4,
        LayerKernel::ScatterKvV2,
        LayerKernel::ScatterKvV1,
        LayerKernel::FillRandom,
        LayerKernel::ScaleCols,
        LayerKernel::AddLayerNormV,
        LayerKernel::AddLayerNormS,
        LayerKernel::BiasActV,
        LayerKernel::BiasActS,
        LayerKernel::GluV,
        LayerKernel::GluS,
        LayerKernel::AddPositionsV,
        LayerKernel::AddPositionsS,
        LayerKernel::QkvRopeG,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            LayerKernel::AddRmsNormV => "add_rmsnorm_v",
            LayerKernel::AddRmsNormS => "add_rmsnorm_s",
            LayerKernel::QkvRope => "qkv_rope",
            LayerKernel::SiluMulV => "silu_mul_v",
            LayerKernel::SiluMulS => "silu_mul_s",
            LayerKernel::GatherV8 => "gather_rows_v8",
            LayerKernel::GatherV4 => "gather_rows_v4",
            LayerKernel::GatherV2 => "gather_rows_v2",
            LayerKernel::GatherV1 => "gather_rows_v1",
            LayerKernel::ScatterKvV8 => "scatter_kv_v8",
            LayerKernel::ScatterKvV4 => "scatter_kv_v4",
            LayerKernel::ScatterKvV2 => "scatter_kv_v2",
            LayerKernel::ScatterKvV1 => "scatter_kv_v1",
            LayerKernel::FillRandom => "fill_random",
            LayerKernel::ScaleCols => "scale_cols",
            LayerKernel::AddLayerNormV => "add_layernorm_v",
            LayerKernel::AddLayerNormS => "add_layernorm_s",
            LayerKernel::BiasActV => "bias_act_v",
            LayerKernel::BiasActS => "bias_act_s",
            LayerKernel::GluV => "glu_v",
            LayerKernel::GluS => "glu_s",
            LayerKernel::AddPositionsV => "add_positions_v",
            LayerKernel::AddPositionsS => "add_positions_s",
            LayerKernel::QkvRopeG => "qkv_rope_g",
        }
    }
}

/// One launch: the entry point, grid and (1-D) block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLaunch {
    pub kernel: LayerKernel,
    pub grid: (u32, u32, u32),
    pub block: u32,
}

/// A dimension as the i32 the kernels take, or `Unsupported` naming the op.
pub fn i32_dim(v: usize, what: &str, op: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| FdppError::Unsupported {
        spec: op.into(),
        what: format!("{what} = {v} (over i32)"),
    })
}

fn u32_grid(v: u64, what: &str, op: &str, max: u64) -> Result<u32> {
    if v > max {
        return Err(FdppError::Unsupported {
            spec: op.into(),
            what: format!("{what} = {v} blocks (the grid allows {max})"),
        });
    }
    Ok(v as u32)
}

/// add_rmsnorm: one block per row; the vector path when hidden % 8 == 0, with one thread per
/// 16-byte vector (rounded up to whole wavefronts of `wave` lanes, at most 1024; wider rows loop).
pub fn rmsnorm(p: &RmsNormParams, wave: u32) -> Result<LayerLaunch> {
    row_norm(
        p.rows,
        p.hidden,
        wave,
        "add_rmsnorm",
        [LayerKernel::AddRmsNormV, LayerKernel::AddRmsNormS],
    )
}

/// add_layernorm: the same geometry as [`rmsnorm`] (one block per row, the same register cache
/// of the row; the kernel makes one more pass over it for the centred variance).
pub fn layernorm(p: &LayerNormParams, wave: u32) -> Result<LayerLaunch> {
    row_norm(
        p.rows,
        p.hidden,
        wave,
        "add_layernorm",
        [LayerKernel::AddLayerNormV, LayerKernel::AddLayerNormS],
    )
}

/// One block per row; `kernels` is (vector path, scalar path).
fn row_norm(rows: usize, hidden: usize, wave: u32, op: &str, kernels: [LayerKernel; 2]) -> Result<LayerLaunch> {
    i32_dim(hidden, "hidden", op)?;
    let vec = hidden.is_multiple_of(8);
    let per_row = if vec { hidden / 8 } else { hidden } as u64;
    let wave = wave.max(1) as u64;
    let block = per_row.div_ceil(wave) * wave;
    Ok(LayerLaunch {
        kernel: if vec { kernels[0] } else { kernels[1] },
        grid: (u32_grid(rows as u64, "rows", op, i32::MAX as u64)?, 1, 1),
        block: block.clamp(wave, RMS_MAX_THREADS as u64) as u32,
    })
}

/// Items of one token of qkv_rope: 8 rotation pairs of a q or k head, or 8 elements of a v head
/// (the whole-head rotate-half kernel); 8 consecutive elements of any head (the general one).
pub fn rope_items(p: &RopeParams) -> usize {
    let g = &p.geom;
    if rope_is_whole_half(p) {
        (g.num_heads + g.num_kv_heads) * (g.head_dim / 16) + g.num_kv_heads * (g.head_dim / 8)
    } else {
        (g.num_heads + 2 * g.num_kv_heads) * (g.head_dim / 8)
    }
}

/// Llama's form (rotate-half over whole heads), which keeps its own kernel: each thread rotates
/// 8 pairs with one sine per pair. Everything else (partial rotary, the interleaved layout, no
/// rotation) runs the general kernel, one thread per 8 output elements.
pub fn rope_is_whole_half(p: &RopeParams) -> bool {
    p.layout == RopeLayout::Half && p.rotary_dim() == p.geom.head_dim
}

/// The general rotary kernel's layout flag (0 rotate-half, 1 interleaved).
pub fn rope_layout_code(layout: RopeLayout) -> i32 {
    match layout {
        RopeLayout::Half => 0,
        RopeLayout::Interleaved => 1,
    }
}

/// qkv_rope: grid (tokens, item blocks). Needs head_dim % 16 == 0 (8 pairs per item), which
/// every supported head_dim meets.
pub fn rope(p: &RopeParams) -> Result<LayerLaunch> {
    let d = p.geom.head_dim;
    if !d.is_multiple_of(16) {
        return Err(FdppError::Unsupported {
            spec: format!("qkv_rope {}", p.geom.label()),
            what: format!("head_dim {d} (a multiple of 16 is needed)"),
        });
    }
    if p.rotary_dim() > d {
        return Err(FdppError::Unsupported {
            spec: format!("qkv_rope {}", p.geom.label()),
            what: format!("rotary_dim {} past head_dim {d}", p.rotary_dim()),
        });
    }
    i32_dim(p.tokens() * p.qkv_width(), "tokens × qkv width", "qkv_rope")?;
    Ok(LayerLaunch {
        kernel: if rope_is_whole_half(p) {
            LayerKernel::QkvRope
        } else {
            LayerKernel::QkvRopeG
        },
        grid: (
            u32_grid(p.tokens() as u64, "tokens", "qkv_rope", i32::MAX as u64)?,
            u32_grid(
                rope_items(p).div_ceil(ROPE_THREADS as usize) as u64,
                "item blocks",
                "qkv_rope",
                MAX_GRID_Y,
            )?,
            1,
        ),
        block: ROPE_THREADS,
    })
}

fn stream_blocks(items: u64) -> u32 {
    items.div_ceil(STREAM_THREADS as u64).clamp(1, MAX_STREAM_BLOCKS) as u32
}

/// silu_mul: grid-stride, 8 outputs per step when inter % 8 == 0.
pub fn silu_mul(p: &SiluMulParams) -> Result<LayerLaunch> {
    i32_dim(p.rows, "rows", "silu_mul")?;
    i32_dim(p.inter, "inter", "silu_mul")?;
    let vec = p.inter.is_multiple_of(8);
    let items = (p.rows * p.inter / if vec { 8 } else { 1 }) as u64;
    Ok(LayerLaunch {
        kernel: if vec {
            LayerKernel::SiluMulV
        } else {
            LayerKernel::SiluMulS
        },
        grid: (stream_blocks(items), 1, 1),
        block: STREAM_THREADS,
    })
}

/// The activation's code in the kernels' `act` argument (their `act_f<ACT>` switch).
pub fn act_code(act: Activation) -> i32 {
    match act {
        Activation::None => 0,
        Activation::Relu => 1,
        Activation::Silu => 2,
        Activation::Gelu => 3,
        Activation::GeluTanh => 4,
    }
}

/// bias_act: grid-stride, 8 elements per step when width % 8 == 0 (every row and the bias then
/// start on a 16-byte boundary).
pub fn bias_act(p: &BiasActParams) -> Result<LayerLaunch> {
    i32_dim(p.rows, "rows", "bias_act")?;
    i32_dim(p.width, "width", "bias_act")?;
    let vec = p.width.is_multiple_of(8);
    let items = (p.rows * p.width / if vec { 8 } else { 1 }) as u64;
    Ok(LayerLaunch {
        kernel: if vec {
            LayerKernel::BiasActV
        } else {
            LayerKernel::BiasActS
        },
        grid: (stream_blocks(items), 1, 1),
        block: STREAM_THREADS,
    })
}

/// glu: as [`silu_mul`], any activation.
pub fn glu(p: &GluParams) -> Result<LayerLaunch> {
    i32_dim(p.rows, "rows", "glu")?;
    i32_dim(p.inter, "inter", "glu")?;
    let vec = p.inter.is_multiple_of(8);
    let items = (p.rows * p.inter / if vec { 8 } else { 1 }) as u64;
    Ok(LayerLaunch {
        kernel: if vec { LayerKernel::GluV } else { LayerKernel::GluS },
        grid: (stream_blocks(items), 1, 1),
        block: STREAM_THREADS,
    })
}

/// add_positions: grid (tokens, column blocks) like a row copy, 8 elements per thread when
/// hidden % 8 == 0, else 1.
pub fn add_positions(p: &PositionParams) -> Result<LayerLaunch> {
    i32_dim(p.hidden, "hidden", "add_positions")?;
    let vec = p.hidden.is_multiple_of(8);
    let per_thread = if vec { 8 } else { 1 };
    let cols = (p.hidden as u64).div_ceil(per_thread * COPY_THREADS as u64);
    Ok(LayerLaunch {
        kernel: if vec {
            LayerKernel::AddPositionsV
        } else {
            LayerKernel::AddPositionsS
        },
        grid: (
            u32_grid(p.positions.len() as u64, "tokens", "add_positions", i32::MAX as u64)?,
            u32_grid(cols, "column blocks", "add_positions", MAX_GRID_Y)?,
            1,
        ),
        block: COPY_THREADS,
    })
}

/// The table row of each token of a validated add_positions (position + offset), as the kernel
/// reads them: the offset is applied here, once, rather than per thread.
pub fn position_rows(p: &PositionParams) -> Result<impl Iterator<Item = i32> + '_> {
    i32_dim(p.table_rows, "table_rows", "add_positions")?;
    // In range after validate(): position + offset < table_rows ≤ i32::MAX.
    Ok(p.positions.iter().map(move |&x| (x as usize + p.offset) as i32))
}

/// Elements one thread of a row copy moves at once: the largest of 8, 4, 2, 1 dividing the width,
/// so that every row of the source and destination starts aligned for that vector.
pub fn copy_vec(width: usize) -> u32 {
    [8, 4, 2, 1]
        .into_iter()
        .find(|&v| width.is_multiple_of(v as usize))
        .unwrap_or(1)
}

fn copy_grid(rows: usize, width: usize, op: &str) -> Result<((u32, u32, u32), u32)> {
    i32_dim(width, "row width", op)?;
    let v = copy_vec(width);
    let cols = (width as u64).div_ceil(v as u64 * COPY_THREADS as u64);
    Ok((
        (
            u32_grid(rows as u64, "rows", op, i32::MAX as u64)?,
            u32_grid(cols, "column blocks", op, MAX_GRID_Y)?,
            1,
        ),
        v,
    ))
}

/// gather_rows (and the embedding lookup): grid (rows, column blocks).
pub fn gather(rows: usize, width: usize) -> Result<LayerLaunch> {
    let (grid, v) = copy_grid(rows, width, "gather_rows")?;
    let kernel = match v {
        8 => LayerKernel::GatherV8,
        4 => LayerKernel::GatherV4,
        2 => LayerKernel::GatherV2,
        _ => LayerKernel::GatherV1,
    };
    Ok(LayerLaunch {
        kernel,
        grid,
        block: COPY_THREADS,
    })
}

/// kv_append's scatter: grid (new tokens, column blocks) over rows of `num_kv_heads · head_dim`.
pub fn scatter_kv(tokens: usize, width: usize) -> Result<LayerLaunch> {
    let (grid, v) = copy_grid(tokens, width, "kv_append")?;
    let kernel = match v {
        8 => LayerKernel::ScatterKvV8,
        4 => LayerKernel::ScatterKvV4,
        2 => LayerKernel::ScatterKvV2,
        _ => LayerKernel::ScatterKvV1,
    };
    Ok(LayerLaunch {
        kernel,
        grid,
        block: COPY_THREADS,
    })
}

/// fill_random: grid-stride over 8-element chunks.
pub fn fill_random(len: usize) -> LayerLaunch {
    LayerLaunch {
        kernel: LayerKernel::FillRandom,
        grid: (stream_blocks((len as u64).div_ceil(8)), 1, 1),
        block: STREAM_THREADS,
    }
}

/// scale_cols: grid-stride over the elements.
pub fn scale_cols(len: usize) -> LayerLaunch {
    LayerLaunch {
        kernel: LayerKernel::ScaleCols,
        grid: (stream_blocks(len as u64), 1, 1),
        block: STREAM_THREADS,
    }
}

/// The slot row (`page · page_size + slot`, in units of one token's `num_kv_heads · head_dim`
/// run) each new token of a validated append goes to, in token order: token j of sequence b is
/// at position `seq_lens[b] − new_lens[b] + j`. Computed here rather than on the device: it is one
/// integer per new token (the batch size in decode), and it keeps the kernel a plain scatter.
pub fn kv_slot_rows<'a>(p: &'a KvAppendParams, layout: &'a PagedKvLayout) -> Result<impl Iterator<Item = i32> + 'a> {
    let slots = layout.num_pages as u64 * layout.page_size as u64;
    if slots > i32::MAX as u64 {
        return Err(FdppError::Unsupported {
            spec: format!("kv_append ({})", layout.label()),
            what: format!("a pool of {slots} token slots (over i32)"),
        });
    }
    let t = &p.tables;
    let ps = layout.page_size;
    Ok(p.new_lens.iter().enumerate().flat_map(move |(b, &n)| {
        let len = t.seq_len(b);
        let first = len - n.max(0) as usize;
        (first..len).map(move |pos| {
            // In range after validate(): the used entries are pages inside the pool.
            let page = t.block_table[b * t.max_pages + pos / ps];
            page * ps as i32 + (pos % ps) as i32
        })
    }))
}

/// The host arrays of one launch, packed into one buffer for a single upload; every array starts
/// on a 16-byte boundary (the kernels read inv_freq as float4). Kept by the backend and reused,
/// so a launch allocates nothing once it has grown.
#[derive(Debug, Default)]
pub struct ArgPack {
    bytes: Vec<u8>,
}

impl ArgPack {
    pub fn clear(&mut self) {
        self.bytes.clear();
    }

    fn align(&mut self) -> usize {
        let at = self.bytes.len().next_multiple_of(16);
        self.bytes.resize(at, 0);
        at
    }

    /// Append i32s; returns their byte offset.
    pub fn push_i32s(&mut self, vals: impl IntoIterator<Item = i32>) -> usize {
        let at = self.align();
        for v in vals {
            self.bytes.extend_from_slice(&v.to_ne_bytes());
        }
        at
    }

    /// Append f32s; returns their byte offset.
    pub fn push_f32s(&mut self, vals: &[f32]) -> usize {
        let at = self.align();
        for v in vals {
            self.bytes.extend_from_slice(&v.to_ne_bytes());
        }
        at
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Capacity a grow-only device scratch takes to hold `need` bytes: the next power of two, at
/// least 4 KiB, so that a growing batch reallocates a handful of times, not every step.
pub fn scratch_capacity(have: usize, need: usize) -> usize {
    if need <= have {
        have
    } else {
        need.next_power_of_two().max(4096)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::kv::paged::{BlockTable, FlatBlockTables};
    use crate::ops::attention::AttnGeometry;
    use crate::ops::layer::RopeLayout;
    use rand::{Rng, SeedableRng};

    const CUDA_SOURCE: &str = include_str!("../../kernels_cuda/layer.cu");
    const HIP_SOURCE: &str = include_str!("../../kernels_hip/layer.hip");

    #[test]
    fn kernel_indices_follow_the_table_and_every_name_is_an_entry_point_of_both_files() {
        for (i, k) in LayerKernel::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
        let mut names: Vec<&str> = LayerKernel::ALL.iter().map(|k| k.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), LayerKernel::ALL.len(), "names are unique");
        for src in [CUDA_SOURCE, HIP_SOURCE] {
            for k in LayerKernel::ALL {
                let name = k.name();
                // The row copies are stamped out by a macro per vector width.
                let found = match name.rsplit_once("_v") {
                    Some((stem @ ("gather_rows" | "scatter_kv"), v)) => {
                        src.contains(&format!("{stem}_v##V(")) && src.contains(&format!("FDPP_ROW_COPIES({v})"))
                    }
                    _ => src.contains(&format!("\n    {name}(")),
                };
                assert!(found, "{name} is not an entry point");
            }
            assert!(src.matches("extern \"C\" __global__").count() >= 8);
        }
    }

    fn rms(rows: usize, hidden: usize) -> RmsNormParams {
        RmsNormParams {
            rows,
            hidden,
            eps: 1e-5,
            dtype: DType::Bf16,
        }
    }

    #[test]
    fn rmsnorm_takes_one_block_per_row_and_whole_wavefronts() {
        let l = rmsnorm(&rms(3, 4096), 32).unwrap();
        assert_eq!((l.kernel, l.grid, l.block), (LayerKernel::AddRmsNormV, (3, 1, 1), 512));
        // Rows wider than 1024 vectors loop; the register cache covers 4 per thread.
        assert_eq!(rmsnorm(&rms(1, 16384), 32).unwrap().block, 1024);
        assert_eq!(rmsnorm(&rms(1, 8), 32).unwrap().block, 32);
        assert_eq!(rmsnorm(&rms(1, 8), 64).unwrap().block, 64);
        let s = rmsnorm(&rms(5, 1001), 64).unwrap();
        assert_eq!((s.kernel, s.grid.0, s.block), (LayerKernel::AddRmsNormS, 5, 1024));
        assert_eq!(rmsnorm(&rms(5, 100), 64).unwrap().block, 128);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        for _ in 0..500 {
            let (h, wave) = (rng.gen_range(1..40_000), [32u32, 64][rng.gen_range(0..2)]);
            let l = rmsnorm(&rms(1, h), wave).unwrap();
            assert!(l.block.is_multiple_of(wave) && l.block <= RMS_MAX_THREADS && l.block >= wave);
            // Every thread but the last wavefront has work on the first pass.
            let per_row = if h % 8 == 0 { h / 8 } else { h } as u32;
            assert!(l.block < per_row + wave, "h={h} block={}", l.block);
        }
    }

    fn rope_params(h: usize, g: usize, d: usize, tokens: usize) -> RopeParams {
        RopeParams {
            geom: AttnGeometry::new(h, g, d).unwrap(),
            dtype: DType::F16,
            positions: (0..tokens as i32).collect(),
            inv_freq: vec![0.5; d / 2],
            layout: RopeLayout::Half,
        }
    }

    #[test]
    fn rope_items_cover_every_element_of_a_token_row_exactly_once() {
        for (h, g, d) in [(32, 8, 128), (4, 4, 64), (8, 1, 256), (16, 4, 128), (2, 2, 64)] {
            let p = rope_params(h, g, d, 7);
            let l = rope(&p).unwrap();
            assert_eq!(l.grid.0, 7);
            assert!(l.grid.1 as usize * ROPE_THREADS as usize >= rope_items(&p));
            // Mirror the kernel's item decode: each element of the row touched once.
            let width = p.qkv_width();
            let mut seen = vec![0u8; width];
            let (half, hc) = (d / 2, d / 16);
            let rot = (h + g) * hc;
            for item in 0..l.grid.1 as usize * ROPE_THREADS as usize {
                if item < rot {
                    let (head, i0) = (item / hc, (item % hc) * 8);
                    for e in 0..8 {
                        seen[head * d + i0 + e] += 1;
                        seen[head * d + i0 + half + e] += 1;
                    }
                } else if item < rope_items(&p) {
                    let c = 8 * (item - rot);
                    for e in 0..8 {
                        seen[(h + g) * d + c + e] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "h{h} g{g} d{d}");
        }
    }

    #[test]
    fn the_llama_form_keeps_its_kernel_and_every_other_rotary_takes_the_general_one() {
        let mut p = rope_params(32, 8, 128, 3);
        assert_eq!(rope(&p).unwrap().kernel, LayerKernel::QkvRope);
        for (n_freq, layout) in [
            (32, RopeLayout::Half),
            (0, RopeLayout::Half),
            (64, RopeLayout::Interleaved),
            (32, RopeLayout::Interleaved),
        ] {
            p.inv_freq = vec![0.5; n_freq];
            p.layout = layout;
            let l = rope(&p).unwrap();
            assert_eq!(l.kernel, LayerKernel::QkvRopeG, "{n_freq} {layout:?}");
            assert_eq!(l.grid.1 as usize, rope_items(&p).div_ceil(ROPE_THREADS as usize));
        }
        assert_eq!(
            (
                rope_layout_code(RopeLayout::Half),
                rope_layout_code(RopeLayout::Interleaved)
            ),
            (0, 1)
        );
    }

    #[test]
    fn general_rope_items_cover_every_element_of_a_token_row_exactly_once() {
        for (h, g, d) in [(32, 2, 128), (4, 4, 64), (8, 1, 256)] {
            let mut p = rope_params(h, g, d, 2);
            p.inv_freq = vec![0.5; d / 4];
            p.layout = RopeLayout::Interleaved;
            let l = rope(&p).unwrap();
            // Mirror qkv_rope_g's decode: item → (head, 8 consecutive elements).
            let dc = d / 8;
            let mut seen = vec![0u8; p.qkv_width()];
            for item in 0..l.grid.1 as usize * ROPE_THREADS as usize {
                if item < (h + 2 * g) * dc {
                    let (head, c0) = (item / dc, (item % dc) * 8);
                    for e in 0..8 {
                        seen[head * d + c0 + e] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "h{h} g{g} d{d}");
        }
    }

    #[test]
    fn the_new_elementwise_ops_pick_their_vector_path_by_width() {
        let dt = DType::Bf16;
        let ba = |width| BiasActParams {
            rows: 3,
            width,
            act: Activation::Relu,
            dtype: dt,
        };
        let l = bias_act(&ba(4096)).unwrap();
        assert_eq!(
            (l.kernel, l.grid.0 as usize),
            (LayerKernel::BiasActV, (3 * 4096 / 8usize).div_ceil(256))
        );
        assert_eq!(bias_act(&ba(4097)).unwrap().kernel, LayerKernel::BiasActS);
        let gl = |inter| GluParams {
            rows: 17,
            inter,
            act: Activation::Gelu,
            dtype: dt,
        };
        assert_eq!(glu(&gl(11008)).unwrap().kernel, LayerKernel::GluV);
        assert_eq!(glu(&gl(133)).unwrap().kernel, LayerKernel::GluS);
        let ln = LayerNormParams {
            rows: 5,
            hidden: 768,
            eps: 1e-5,
            dtype: dt,
        };
        let l = layernorm(&ln, 32).unwrap();
        assert_eq!((l.kernel, l.grid.0, l.block), (LayerKernel::AddLayerNormV, 5, 96));
        let l = layernorm(&LayerNormParams { hidden: 133, ..ln }, 64).unwrap();
        assert_eq!((l.kernel, l.block), (LayerKernel::AddLayerNormS, 192));
        let codes: Vec<i32> = [
            Activation::None,
            Activation::Relu,
            Activation::Silu,
            Activation::Gelu,
            Activation::GeluTanh,
        ]
        .map(act_code)
        .to_vec();
        assert_eq!(codes, vec![0, 1, 2, 3, 4], "the kernels' FDPP_ACT_SWITCH cases");
    }

    #[test]
    fn add_positions_reads_offset_rows_over_column_blocks() {
        let p = PositionParams {
            positions: vec![0, 5, 2047],
            offset: 2,
            table_rows: 2050,
            hidden: 4096,
            dtype: DType::F16,
        };
        let l = add_positions(&p).unwrap();
        assert_eq!(
            (l.kernel, l.grid, l.block),
            (LayerKernel::AddPositionsV, (3, 4, 1), 128)
        );
        assert_eq!(position_rows(&p).unwrap().collect::<Vec<_>>(), vec![2, 7, 2049]);
        let odd = PositionParams { hidden: 1001, ..p };
        let l = add_positions(&odd).unwrap();
        assert_eq!((l.kernel, l.grid.1), (LayerKernel::AddPositionsS, 8));
    }

    #[test]
    fn silu_mul_and_fill_random_grids_stride_over_everything() {
        let l = silu_mul(&SiluMulParams {
            rows: 3,
            inter: 11008,
            dtype: DType::F16,
        })
        .unwrap();
        assert_eq!(l.kernel, LayerKernel::SiluMulV);
        assert_eq!(l.grid.0 as usize, (3 * 11008 / 8usize).div_ceil(256));
        let s = silu_mul(&SiluMulParams {
            rows: 2,
            inter: 1001,
            dtype: DType::F16,
        })
        .unwrap();
        assert_eq!((s.kernel, s.grid.0), (LayerKernel::SiluMulS, 8));
        let big = silu_mul(&SiluMulParams {
            rows: 16384,
            inter: 28672,
            dtype: DType::F16,
        })
        .unwrap();
        assert_eq!(big.grid.0 as u64, MAX_STREAM_BLOCKS);
        assert_eq!(fill_random(1).grid.0, 1);
        assert_eq!(fill_random(8 * 256 + 1).grid.0, 2);
        assert_eq!(fill_random(0).grid.0, 1);
    }

    #[test]
    fn row_copies_use_the_widest_vector_that_keeps_rows_aligned() {
        assert_eq!([4096, 4100, 4098, 4097, 1].map(copy_vec), [8, 4, 2, 1, 1]);
        let l = gather(5, 4096).unwrap();
        assert_eq!((l.kernel, l.grid, l.block), (LayerKernel::GatherV8, (5, 4, 1), 128));
        let l = gather(2, 4097).unwrap();
        assert_eq!((l.kernel, l.grid.1), (LayerKernel::GatherV1, 33));
        assert_eq!(gather(1, 6).unwrap().kernel, LayerKernel::GatherV2);
        assert_eq!(scatter_kv(3, 1024).unwrap().kernel, LayerKernel::ScatterKvV8);
        assert_eq!(scatter_kv(3, 12).unwrap().kernel, LayerKernel::ScatterKvV4);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        for _ in 0..500 {
            let w = rng.gen_range(1..100_000);
            let l = gather(1, w).unwrap();
            let per_block = copy_vec(w) as usize * COPY_THREADS as usize;
            let covered = l.grid.1 as usize * per_block;
            assert!(covered >= w && covered < w + per_block, "w={w}");
        }
        // 2^31 rows of a grid do not fit.
        assert!(gather(1 << 31, 8).is_err());
        assert!(matches!(
            gather(1, 9_000_001).unwrap_err(),
            FdppError::Unsupported { .. }
        ));
    }

    #[test]
    fn kv_slots_follow_the_block_tables() {
        let layout = PagedKvLayout::new(4, 16, 2, 64, DType::F16).unwrap();
        // Sequence 0: 6 tokens in pages [3, 9], appends 1 (position 5: page 9, slot 1).
        // Sequence 1: 9 tokens in pages [0, 15, 2], appends 4 (positions 5..9).
        let tables = FlatBlockTables::new(
            &layout,
            &[
                BlockTable {
                    pages: vec![3, 9],
                    seq_len: 6,
                },
                BlockTable {
                    pages: vec![0, 15, 2],
                    seq_len: 9,
                },
            ],
        )
        .unwrap();
        let p = KvAppendParams {
            tables,
            new_lens: vec![1, 4],
        };
        p.validate(&layout, 5 * 128, 5 * 128, (layout.pool_elems(), layout.pool_elems()))
            .unwrap();
        let slots: Vec<i32> = kv_slot_rows(&p, &layout).unwrap().collect();
        assert_eq!(slots, vec![9 * 4 + 1, 15 * 4 + 1, 15 * 4 + 2, 15 * 4 + 3, 2 * 4]);
        assert_eq!(slots.len(), p.tokens());
        // The slot row times the token width is the layout's offset of (page, slot, head 0).
        assert_eq!(slots[0] as usize * layout.token_elems(), layout.offset(9, 1, 0));
        let huge = PagedKvLayout::new(1 << 16, 1 << 16, 1, 64, DType::F16).unwrap();
        assert!(kv_slot_rows(&p, &huge).is_err());
    }

    #[test]
    fn packed_arrays_start_aligned_and_read_back() {
        let mut pack = ArgPack::default();
        let a = pack.push_i32s([1, -2, 3]);
        let b = pack.push_f32s(&[0.5, 1.5]);
        let c = pack.push_i32s(std::iter::empty());
        let d = pack.push_i32s([7]);
        assert_eq!((a, b, c, d), (0, 16, 32, 32));
        let bytes = pack.bytes();
        let i32_at = |o: usize| i32::from_ne_bytes(bytes[o..o + 4].try_into().unwrap());
        let f32_at = |o: usize| f32::from_ne_bytes(bytes[o..o + 4].try_into().unwrap());
        assert_eq!((i32_at(0), i32_at(4), i32_at(8)), (1, -2, 3));
        assert_eq!((f32_at(16), f32_at(20)), (0.5, 1.5));
        assert_eq!(i32_at(32), 7);
        pack.clear();
        assert_eq!(pack.push_f32s(&[2.0]), 0);
        assert_eq!(pack.bytes().len(), 4);
    }

    #[test]
    fn scratch_grows_by_powers_of_two_and_never_shrinks() {
        assert_eq!(scratch_capacity(0, 1), 4096);
        assert_eq!(scratch_capacity(4096, 100), 4096);
        assert_eq!(scratch_capacity(4096, 4097), 8192);
        assert_eq!(scratch_capacity(1 << 20, 5000), 1 << 20);
        let mut have = 0;
        let mut grows = 0;
        for need in (1..200_000).step_by(997) {
            let next = scratch_capacity(have, need);
            assert!(next >= need);
            if next != have {
                grows += 1;
            }
            have = next;
        }
        assert!(grows <= 7, "{grows} reallocations");
    }

    /// The random fill's device function, compiled as plain C with the system compiler, against
    /// [`crate::ops::layer::random_value`] bit for bit (seeds and indices past 2^32, scales that
    /// round).
    #[test]
    fn the_kernels_random_value_is_bit_exact_with_the_rust_one() {
        let body = CUDA_SOURCE
            .split("// BEGIN random_value")
            .nth(1)
            .and_then(|s| s.split("// END random_value").next())
            .expect("markers in layer.cu");
        let hip_body = HIP_SOURCE
            .split("// BEGIN random_value")
            .nth(1)
            .and_then(|s| s.split("// END random_value").next())
            .expect("markers in layer.hip");
        assert_eq!(body, hip_body, "the CUDA and HIP ports must be the same text");
        let cases: [(u64, u64, f32); 6] = [
            (0, 0, 1.0),
            (7, 123, 0.5),
            (u64::MAX, 1 << 40, 0.02),
            (0x1234_5678_9abc_def0, u64::MAX - 1, 3.3),
            (42, 4_000_000_123, 1e-3),
            (99, 17, 0.1),
        ];
        let dir = tempfile::tempdir().unwrap();
        let mut c = String::from("#include <stdio.h>\n#include <string.h>\n#define FDPP_HD static\n");
        c.push_str(body.split_once('\n').map(|x| x.1).unwrap_or(body));
        c.push_str("int main(void) {\n");
        for (s, i, sc) in cases {
            c.push_str(&format!(
                "  {{ float f = fdpp_random_value({s}ull, {i}ull, {sc:e}f); unsigned u; memcpy(&u, &f, 4); printf(\"%u\\n\", u); }}\n"
            ));
        }
        c.push_str("  return 0;\n}\n");
        let src = dir.path().join("rv.c");
        let exe = dir.path().join("rv");
        std::fs::write(&src, c).unwrap();
        let out = std::process::Command::new("cc")
            .args(["-O2", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("cc (the C compiler Rust links with) runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let run = std::process::Command::new(&exe).output().unwrap();
        let got: Vec<u32> = String::from_utf8_lossy(&run.stdout)
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        let want: Vec<u32> = cases
            .iter()
            .map(|&(s, i, sc)| crate::ops::layer::random_value(s, i, sc).to_bits())
            .collect();
        assert_eq!(got, want);
    }
}
