//! Which CUDA devices can read each other's memory directly (NVLink or PCIe peer access): what
//! tensor parallelism's all-reduce travels over, shown by `fdpp devices` (issue #22 item 5).

use cudarc::driver::sys;

use super::probe;
use crate::error::{FdppError, Result};

/// `matrix[i][j]`: device i can access device j's memory (true on the diagonal).
pub fn peer_matrix() -> Result<Vec<Vec<bool>>> {
    // device_count initialises the driver (cuInit) or says why it cannot.
    let n = probe::device_count()?;
    let fail = |what: &str, r: sys::CUresult| FdppError::device("cuda", format!("{what}: {r:?}"));
    let mut devs = Vec::with_capacity(n);
    for i in 0..n {
        let mut d: sys::CUdevice = 0;
        // SAFETY: out-parameter; the driver is loaded and initialised.
        let r = unsafe { sys::cuDeviceGet(&mut d, i as i32) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(fail("cuDeviceGet", r));
        }
        devs.push(d);
    }
    let mut m = vec![vec![false; n]; n];
    for (i, &a) in devs.iter().enumerate() {
        for (j, &b) in devs.iter().enumerate() {
            if i == j {
                m[i][j] = true;
                continue;
            }
            let mut can = 0;
            // SAFETY: out-parameter over two valid device handles.
            let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(fail("cuDeviceCanAccessPeer", r));
            }
            m[i][j] = can != 0;
        }
    }
    Ok(m)
}

/// The matrix as lines: a header of device ordinals, then one row per device (`y` peer access,
/// `-` none, `·` itself).
pub fn matrix_lines(m: &[Vec<bool>]) -> Vec<String> {
    let mut out = vec![format!(
        "      {}",
        (0..m.len()).map(|j| format!("{j:>3}")).collect::<String>()
    )];
    for (i, row) in m.iter().enumerate() {
        let cells: String = row
            .iter()
            .enumerate()
            .map(|(j, &p)| {
                format!(
                    "{:>3}",
                    if i == j {
                        "·"
                    } else if p {
                        "y"
                    } else {
                        "-"
                    }
                )
            })
            .collect();
        out.push(format!("  {i:>3} {cells}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_prints_one_row_per_device() {
        let lines = matrix_lines(&[vec![true, true], vec![false, true]]);
        assert_eq!(lines, vec!["        0  1", "    0   ·  y", "    1   -  ·"]);
    }
}
