//! The grid of M (rows of x, i.e. batch × tokens) a tune sweeps.
//!
//! Every M from 1 to 16 is measured: decode batches live there and M1 usually falls there
//! (FlashDecoding++ §4 finds the GEMV/flat-GEMM switch at a few rows). Above 16 the times change
//! slowly, so the grid is geometric: powers of two and their midpoints (24, 32, 48, 64, 96, …).

use crate::backend::BackendKind;
use crate::error::{FdppError, Result};

/// Default largest M: prefill-sized on a GPU; on the CPU 128, a 128-token prompt's M (the
/// prefill the CPU engine is measured at): with 64 a default-tuned profile carried no
/// measurement at the prefill's M and extended its M = 64 choice to it (one such tune chose
/// flat_gemm for FFN1 from M = 32 on, slower than the GEMM at M = 128). Still small enough that a
/// tune takes minutes.
pub fn default_m_max(backend: BackendKind) -> usize {
    match backend {
        BackendKind::Cpu => 128,
        BackendKind::Cuda | BackendKind::Rocm => 2048,
    }
}

/// The largest M a sweep takes. A decode batch or prefill chunk beyond this is far past M2 on
/// every device measured (the vendor GEMM wins from M of a few dozen), so larger M would only
/// time the vendor GEMM on inputs of tens of GB.
pub const MAX_M: usize = 1 << 16;

/// 1..=16, then 24, 32, 48, 64, 96, 128, … up to `m_max`; `m_max` itself is always the last
/// point, so the sweep reaches exactly the size asked for.
pub fn m_grid(m_max: usize) -> Result<Vec<usize>> {
    if m_max == 0 {
        return Err(FdppError::InvalidArgument(
            "--m-max must be at least 1 (it is the largest number of rows M to tune for)".into(),
        ));
    }
    if m_max > MAX_M {
        return Err(FdppError::InvalidArgument(format!(
            "--m-max {m_max} is above {MAX_M}: past a few dozen rows the vendor GEMM wins on every \
             device measured, and M = {m_max} would only time it on huge inputs; give at most {MAX_M}"
        )));
    }
    let mut g: Vec<usize> = (1..=m_max.min(16)).collect();
    let mut p = 16usize;
    loop {
        let mid = p + p / 2;
        let next = p * 2;
        for v in [mid, next] {
            if v <= m_max {
                g.push(v);
            }
        }
        if next >= m_max {
            break;
        }
        p = next;
    }
    if g.last() != Some(&m_max) {
        g.push(m_max);
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_an_error() {
        let e = m_grid(0).unwrap_err().to_string();
        assert!(e.contains("--m-max"), "{e}");
    }

    #[test]
    fn small_m_max_is_dense() {
        assert_eq!(m_grid(1).unwrap(), vec![1]);
        assert_eq!(m_grid(5).unwrap(), vec![1, 2, 3, 4, 5]);
        assert_eq!(m_grid(16).unwrap(), (1..=16).collect::<Vec<_>>());
    }

    #[test]
    fn geometric_above_16() {
        let g = m_grid(128).unwrap();
        let tail: Vec<usize> = g[16..].to_vec();
        assert_eq!(tail, vec![24, 32, 48, 64, 96, 128]);
        assert_eq!(m_grid(64).unwrap().len(), 20);
    }

    #[test]
    fn gpu_default_reaches_2048() {
        let g = m_grid(default_m_max(BackendKind::Cuda)).unwrap();
        assert_eq!(*g.last().unwrap(), 2048);
        assert!(g.contains(&1536) && g.contains(&1024) && g.contains(&768));
        assert_eq!(g.len(), 16 + 14);
    }

    #[test]
    fn off_grid_max_is_appended_and_grid_is_strictly_increasing() {
        for m_max in [17, 20, 33, 100, 1000, 2047, 2049, 5000] {
            let g = m_grid(m_max).unwrap();
            assert_eq!(*g.last().unwrap(), m_max, "m_max={m_max}");
            assert!(g.windows(2).all(|w| w[0] < w[1]), "m_max={m_max}: {g:?}");
            assert!(g.iter().all(|&m| m >= 1 && m <= m_max));
        }
        assert_eq!(m_grid(100).unwrap()[16..], [24, 32, 48, 64, 96, 100]);
    }

    #[test]
    fn cpu_default_covers_a_128_token_prompt() {
        assert_eq!(default_m_max(BackendKind::Cpu), 128);
    }
}
