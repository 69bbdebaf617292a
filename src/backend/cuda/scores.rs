//! Launching the softmax-input histogram kernel (kernels_cuda/attn_scores.cu) for calibration.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::sources::attn_scores_source;
use super::{drv, CudaBackend, CudaBuffer};
use crate::backend::DeviceBuffer;
use crate::error::{FdppError, Result};
use crate::kv::PagedKv;
use crate::ops::attention::PrefillParams;
use crate::ops::scores::{ScoreHist, ScoreStatsParams};

/// Query rows per block (one block walks every key of each of its rows).
const ROWS_PER_BLOCK: usize = 64;
const THREADS: u32 = 128;
/// Bins the kernel keeps in shared memory (attn_scores.cu's MAX_BINS).
pub const MAX_BINS: usize = 4096;

/// Inverse of the kernel's ordered key (attn_common.cuh's fkey); key 0 means "none".
fn unkey(k: u32) -> Option<f32> {
    if k == 0 {
        return None;
    }
    Some(f32::from_bits(if k & 0x8000_0000 != 0 { k & 0x7fff_ffff } else { !k }))
}

pub fn score_hist(
    b: &CudaBackend,
    p: &PrefillParams,
    s: &ScoreStatsParams,
    q: &CudaBuffer,
    kv: &PagedKv<CudaBuffer>,
) -> Result<Vec<ScoreHist>> {
    let g = p.geom;
    let kv_new = p.tokens() * g.num_kv_heads * g.head_dim;
    // No k, v or out buffers here: only q and the cache are read.
    p.validate(
        &kv.layout,
        (q.len(), q.len()),
        (kv_new, kv_new),
        (kv.k.len(), kv.v.len()),
    )?;
    s.spec.validate()?;
    if s.spec.bins > MAX_BINS {
        return Err(FdppError::Unsupported {
            spec: "attn_score_hist".into(),
            what: format!("{} bins (at most {MAX_BINS} on CUDA)", s.spec.bins),
        });
    }
    if q.dtype() != p.dtype || kv.k.dtype() != p.dtype {
        return Err(FdppError::InvalidArgument(format!(
            "attention_score_hist: q and the K pool must be {}",
            p.dtype
        )));
    }
    let nh = if s.per_head { g.num_heads } else { 1 };
    let bins = s.spec.bins;
    let tiles = crate::backend::attn_plan::prefill_tiles(p, ROWS_PER_BLOCK)?;
    let (host, tiles_at) = crate::backend::attn_plan::prefill_ints(p, &tiles);
    let st = b.stream();
    let ints = st.clone_htod(&host).map_err(drv("uploading score-histogram tables"))?;
    let mut hist = st
        .alloc_zeros::<u32>(nh * (bins + 2))
        .map_err(drv("allocating score histograms"))?;
    let ext_init: Vec<u32> = (0..nh).flat_map(|_| [u32::MAX, 0]).collect();
    let mut ext = st.clone_htod(&ext_init).map_err(drv("uploading score extremes"))?;
    let mut counts = st.alloc_zeros::<u64>(nh).map_err(drv("allocating score counts"))?;

    let uri = format!("attn_scores_{}_d{}", p.dtype, g.head_dim);
    let f = b.function_of(&uri, "attn_score_hist", 0, || {
        Ok(attn_scores_source(p.dtype, g.head_dim))
    })?;
    let i32_of = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| FdppError::InvalidArgument(format!("attention_score_hist: {what} = {v} over i32")))
    };
    let (max_pages, page_size) = (
        i32_of(p.tables.max_pages, "max_pages")?,
        i32_of(kv.layout.page_size, "page_size")?,
    );
    let (h32, g32, bins32, per_head) = (
        i32_of(g.num_heads, "heads")?,
        i32_of(g.num_kv_heads, "kv heads")?,
        i32_of(bins, "bins")?,
        s.per_head as i32,
    );
    let (scale, lo, hi, width) = (g.scale(), s.spec.lo, s.spec.hi, s.spec.width());
    let (qp, kp) = (b.ptr(q), b.ptr(&kv.k));
    let cfg = LaunchConfig {
        grid_dim: (tiles.len() as u32, g.num_heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        use cudarc::driver::DevicePtr;
        let (table, _s1) = ints.device_ptr(st);
        let tiles_ptr = table + 4 * tiles_at as u64;
        let mut l = st.launch_builder(&f);
        l.arg(&qp)
            .arg(&kp)
            .arg(&table)
            .arg(&tiles_ptr)
            .arg(&max_pages)
            .arg(&page_size);
        l.arg(&h32)
            .arg(&g32)
            .arg(&scale)
            .arg(&lo)
            .arg(&hi)
            .arg(&width)
            .arg(&bins32)
            .arg(&per_head);
        l.arg(&mut hist).arg(&mut ext).arg(&mut counts);
        // SAFETY: p validated against q and the pools; the tile list covers every new row; the
        // histograms hold nh · (bins + 2) bins, nh extreme pairs and nh counts.
        unsafe { l.launch(cfg) }.map_err(drv(&format!("launch {uri}")))?;
    }
    b.check_launch(&uri)?;
    let hist = st.clone_dtoh(&hist).map_err(drv("reading score histograms"))?;
    let ext = st.clone_dtoh(&ext).map_err(drv("reading score extremes"))?;
    let counts = st.clone_dtoh(&counts).map_err(drv("reading score counts"))?;
    Ok((0..nh)
        .map(|i| {
            let row = &hist[i * (bins + 2)..(i + 1) * (bins + 2)];
            ScoreHist {
                spec: s.spec,
                counts: row[1..=bins].iter().map(|&c| c as u64).collect(),
                under: row[0] as u64,
                over: row[bins + 1] as u64,
                min: unkey(ext[2 * i])
                    .filter(|_| ext[2 * i] != u32::MAX)
                    .unwrap_or(f32::INFINITY),
                max: unkey(ext[2 * i + 1]).unwrap_or(f32::NEG_INFINITY),
                count: counts[i],
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_keys_decode_back_to_the_float() {
        // fkey in attn_common.cuh, written out in Rust for the test.
        let fkey = |f: f32| {
            let u = f.to_bits();
            if u & 0x8000_0000 != 0 {
                !u
            } else {
                u | 0x8000_0000
            }
        };
        for x in [-3.5f32, -0.0, 0.0, 1e-30, 7.25, f32::MAX, -f32::MAX] {
            assert_eq!(unkey(fkey(x)).map(f32::to_bits), Some(x.to_bits()), "{x}");
        }
        assert!(fkey(-1.0) < fkey(-0.5) && fkey(-0.5) < fkey(0.25));
        assert_eq!(unkey(0), None);
    }
}
