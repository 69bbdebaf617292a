//! Launch parameters of the HIP kernels (grid, block, LDS, which entry point), as pure functions
//! of the spec, the dims and the device's wavefront width, so that they are unit-tested on the
//! CPU: no AMD GPU is needed to check that every row of N and M is covered exactly once.

use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec};

/// Wavefronts per block of gemv and flat_gemm (must match WAVES in kernels_hip/*.hip).
pub const GEMV_WAVES: u32 = 4;
pub const FLAT_WAVES: u32 = 4;
/// The MFMA lane layout of flat_gemm is written for wave64 (every CDNA part).
pub const FLAT_WAVE: u32 = 64;
/// 32-wide K chunks each flat_gemm lane loads before its MFMAs (FDPP_UNROLL in flat_gemm.hip).
pub const FLAT_UNROLL: usize = 2;
/// 16-byte weight loads in flight per gemv lane (FDPP_INFLIGHT, passed by sources.rs).
pub const GEMV_INFLIGHT: u32 = 8;
/// gemv keeps M rows of accumulators in registers: M is taken this many rows per launch.
pub const GEMV_MAX_M: usize = 8;

/// One kernel launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic LDS bytes.
    pub lds_bytes: u32,
    /// First row of x and y this launch covers (gemv splits M into passes).
    pub m0: usize,
    /// Rows of M this launch covers.
    pub m: usize,
}

/// The 16-byte vector paths need every row of x and W to start on a 16-byte boundary.
pub fn vec_ok(d: &GemmDims) -> bool {
    d.k.is_multiple_of(8)
}

/// Wavefront width the compiler uses by default for an arch: 64 on GCN/CDNA (gfx9xx), 32 on
/// RDNA (gfx10xx, gfx11xx, gfx12xx). None for a name that is not a gfx target.
pub fn default_wave_for_arch(arch: &str) -> Option<u32> {
    let digits = arch.strip_prefix("gfx")?;
    let base = arch_family(digits)?;
    Some(if base >= 10 { 32 } else { 64 })
}

/// 9 for gfx90a/gfx942, 10 for gfx1030, 11 for gfx1100.
fn arch_family(digits: &str) -> Option<u32> {
    // gfxNNN: one family digit (gfx9xx); gfxNNNN: two (gfx10xx, gfx11xx).
    let head: String = digits.chars().take_while(|c| c.is_ascii_digit()).collect();
    match head.len() {
        3 => head[..1].parse().ok(),
        4 => head[..2].parse().ok(),
        // gfx90a: "90" then a letter.
        2 => head[..1].parse().ok(),
        _ => None,
    }
}

/// Does fdpp's flat_gemm (MFMA, wave64) build for this arch? CDNA2 and CDNA3 only.
pub fn has_flat_gemm(arch: &str) -> bool {
    let base = arch.split(':').next().unwrap_or(arch);
    matches!(base, "gfx90a" | "gfx940" | "gfx941" | "gfx942")
}

fn u32_of(v: usize, what: &str, spec: &GemmSpec) -> Result<u32> {
    u32::try_from(v).map_err(|_| FdppError::Unsupported {
        spec: spec.uri(),
        what: format!("{what} = {v} (over u32)"),
    })
}

/// gemv: one wavefront per `rows` rows of W, [`GEMV_WAVES`] wavefronts per block; M in passes
/// of at most [`GEMV_MAX_M`] rows (`gemv_m{M}` on the vector path, `gemv_scalar` otherwise).
pub fn gemv_launches(spec: &GemmSpec, rows: u32, wave: u32, d: GemmDims) -> Result<Vec<Launch>> {
    if wave != 32 && wave != 64 {
        return Err(FdppError::Unsupported {
            spec: spec.uri(),
            what: format!("a wavefront of {wave} lanes (32 or 64 expected)"),
        });
    }
    let rows_per_block = (rows.max(1) * GEMV_WAVES) as usize;
    let grid_x = u32_of(d.n.div_ceil(rows_per_block), "N blocks", spec)?;
    let mut v = vec![];
    let mut m0 = 0;
    while m0 < d.m {
        let mm = (d.m - m0).min(GEMV_MAX_M);
        v.push(Launch {
            kernel: if vec_ok(&d) {
                format!("gemv_m{mm}")
            } else {
                "gemv_scalar".into()
            },
            grid: (grid_x, 1, 1),
            block: (GEMV_WAVES * wave, 1, 1),
            lds_bytes: 0,
            m0,
            m: mm,
        });
        m0 += mm;
    }
    Ok(v)
}

/// 16-row M tiles per flat_gemm block: M padded to 16 (MFMA 16x16x16), 1, 2 or 4 tiles; larger
/// M takes more blocks along y (each re-reads W, which is where ImplC takes over).
pub fn flat_m_tiles(m: usize) -> u32 {
    if m <= 16 {
        1
    } else if m <= 32 {
        2
    } else {
        4
    }
}

/// (wavefronts along N, wavefronts splitting K) of a flat_gemm block for B_N.
pub fn flat_wave_split(bn: u32) -> (u32, u32) {
    let wn = (bn / 16).min(FLAT_WAVES);
    (wn, FLAT_WAVES / wn.max(1))
}

/// LDS for the K-split reduction: (WK-1)·WN wavefronts each park 64 lanes × NT·MT·4 floats.
pub fn flat_lds_bytes(bn: u32, mt: u32) -> u32 {
    let (wn, wk) = flat_wave_split(bn);
    let nt = bn / wn / 16;
    (wk - 1) * wn * FLAT_WAVE * nt * mt * 4 * 4
}

/// flat_gemm: B_N rows of W per block along x, 16·MT rows of M per block along y.
pub fn flat_launch(spec: &GemmSpec, arch: &str, wave: u32, max_lds: u32, d: GemmDims) -> Result<Launch> {
    let bn = spec.block_n.unwrap_or(64);
    if !matches!(bn, 32 | 64 | 128 | 256) {
        return Err(FdppError::Unsupported {
            spec: spec.uri(),
            what: format!("B_N = {bn} (32, 64, 128 or 256)"),
        });
    }
    if !has_flat_gemm(arch) || wave != FLAT_WAVE {
        return Err(FdppError::Unsupported {
            spec: spec.uri(),
            what: format!("{arch} (wave{wave}): flat_gemm needs CDNA2/3 MFMA with wave64 (gfx90a, gfx94x)"),
        });
    }
    let mt = flat_m_tiles(d.m);
    let lds = flat_lds_bytes(bn, mt);
    if lds > max_lds {
        return Err(FdppError::Unsupported {
            spec: spec.uri(),
            what: format!("M = {} ({lds} bytes of LDS, the device allows {max_lds})", d.m),
        });
    }
    Ok(Launch {
        kernel: format!("flat_gemm_mt{mt}_{}", if vec_ok(&d) { "v" } else { "s" }),
        grid: (
            u32_of(d.n.div_ceil(bn as usize), "N blocks", spec)?,
            u32_of(d.m.div_ceil(16 * mt as usize), "M blocks", spec)?,
            1,
        ),
        block: (FLAT_WAVES * FLAT_WAVE, 1, 1),
        lds_bytes: lds,
        m0: 0,
        m: d.m,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::ops::gemm::GemmImpl;
    use rand::{Rng, SeedableRng};

    fn dims(m: usize, n: usize, k: usize) -> GemmDims {
        GemmDims::new(m, n, k).unwrap()
    }

    #[test]
    fn wave_width_follows_the_arch_family() {
        assert_eq!(default_wave_for_arch("gfx90a"), Some(64));
        assert_eq!(default_wave_for_arch("gfx942"), Some(64));
        assert_eq!(default_wave_for_arch("gfx908"), Some(64));
        assert_eq!(default_wave_for_arch("gfx1030"), Some(32));
        assert_eq!(default_wave_for_arch("gfx1100"), Some(32));
        assert_eq!(default_wave_for_arch("sm_90a"), None);
        assert!(has_flat_gemm("gfx90a") && has_flat_gemm("gfx942") && has_flat_gemm("gfx90a:sramecc+:xnack-"));
        assert!(!has_flat_gemm("gfx1100") && !has_flat_gemm("gfx908"));
    }

    #[test]
    fn gemv_covers_every_row_of_n_and_m_exactly_once() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for _ in 0..200 {
            let d = dims(rng.gen_range(1..40), rng.gen_range(1..5000), rng.gen_range(1..300));
            let rows = [1u32, 2, 4][rng.gen_range(0..3)];
            let wave = [32u32, 64][rng.gen_range(0..2)];
            let spec = GemmSpec::new(GemmImpl::Gemv, DType::F16).with_block_n(rows * GEMV_WAVES);
            let ls = gemv_launches(&spec, rows, wave, d).unwrap();
            let mut next = 0;
            for l in &ls {
                assert_eq!(l.m0, next);
                assert!(l.m >= 1 && l.m <= GEMV_MAX_M);
                next += l.m;
                assert_eq!(l.block.0, GEMV_WAVES * wave);
                let rows_covered = l.grid.0 as usize * (GEMV_WAVES * rows) as usize;
                assert!(rows_covered >= d.n && rows_covered < d.n + (GEMV_WAVES * rows) as usize);
                let want = if d.k.is_multiple_of(8) {
                    format!("gemv_m{}", l.m)
                } else {
                    "gemv_scalar".into()
                };
                assert_eq!(l.kernel, want);
            }
            assert_eq!(next, d.m);
        }
        let spec = GemmSpec::new(GemmImpl::Gemv, DType::F16);
        assert!(gemv_launches(&spec, 1, 48, dims(1, 8, 8)).is_err());
    }

    #[test]
    fn flat_gemm_pads_m_to_16_and_tiles_n_by_block_n() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        for _ in 0..200 {
            let d = dims(rng.gen_range(1..200), rng.gen_range(1..9000), rng.gen_range(1..200));
            let bn = [32u32, 64, 128, 256][rng.gen_range(0..4)];
            let spec = GemmSpec::new(GemmImpl::FlatGemm, DType::Bf16).with_block_n(bn);
            let l = flat_launch(&spec, "gfx90a", 64, 64 * 1024, d).unwrap();
            let mt = flat_m_tiles(d.m) as usize;
            assert_eq!(l.block, (256, 1, 1));
            assert_eq!(l.grid.0 as usize, d.n.div_ceil(bn as usize));
            let m_cov = l.grid.1 as usize * 16 * mt;
            assert!(m_cov >= d.m && m_cov < d.m + 16 * mt, "M={} covered {m_cov}", d.m);
            assert!(l.kernel.starts_with(&format!("flat_gemm_mt{mt}_")));
            assert_eq!(l.kernel.ends_with("_v"), d.k.is_multiple_of(8));
            assert_eq!(l.lds_bytes, flat_lds_bytes(bn, mt as u32));
        }
    }

    #[test]
    fn lds_is_used_only_where_wavefronts_split_k() {
        assert_eq!(flat_wave_split(32), (2, 2));
        assert_eq!(flat_wave_split(64), (4, 1));
        assert_eq!(flat_wave_split(256), (4, 1));
        // B_N = 32: 2 wavefronts along N × 2 along K; one of each pair parks 64 lanes × MT·4 floats.
        assert_eq!(flat_lds_bytes(32, 1), 2 * 64 * 4 * 4);
        assert_eq!(flat_lds_bytes(32, 4), 2 * 64 * 16 * 4);
        for bn in [64, 128, 256] {
            for mt in [1, 2, 4] {
                assert_eq!(flat_lds_bytes(bn, mt), 0);
            }
        }
        assert_eq!(
            (flat_m_tiles(1), flat_m_tiles(16), flat_m_tiles(17), flat_m_tiles(33)),
            (1, 1, 2, 4)
        );
    }

    #[test]
    fn flat_gemm_refuses_what_it_cannot_run() {
        let d = dims(8, 4096, 4096);
        let spec = GemmSpec::new(GemmImpl::FlatGemm, DType::F16).with_block_n(32);
        let e = flat_launch(&spec, "gfx1100", 32, 65536, d).unwrap_err();
        assert!(matches!(e, FdppError::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains("gfx1100"));
        let e = flat_launch(&spec, "gfx90a", 64, 1024, dims(64, 4096, 4096)).unwrap_err();
        assert!(e.to_string().contains("LDS"), "{e}");
        let bad = GemmSpec::new(GemmImpl::FlatGemm, DType::F16).with_block_n(48);
        assert!(flat_launch(&bad, "gfx90a", 64, 65536, d).is_err());
    }

    /// A CPU model of flat_gemm.hip's index arithmetic: every block, wavefront and lane loads
    /// exactly what the kernel loads, the MFMA 16x16x16 step is applied with the ISA's lane
    /// layout (A: lane l gives row l%16, K slice 4·(l/16); B: column l%16, same K slice; D: lane l
    /// holds rows 4·(l/16)..+3 of column l%16), the K-split partials are summed as through LDS,
    /// and each lane stores what the kernel stores. Checked against a plain product, this tests
    /// that the tiling covers every (m, n, k) exactly once, for every B_N and M tiling.
    // Index loops on purpose: they mirror the kernel's loops one to one.
    #[allow(clippy::needless_range_loop)]
    fn emulate_flat_gemm(bn: u32, d: GemmDims, x: &[f32], w: &[f32]) -> Vec<f32> {
        let l = flat_launch(
            &GemmSpec::new(GemmImpl::FlatGemm, DType::F16).with_block_n(bn),
            "gfx90a",
            64,
            65536,
            d,
        )
        .unwrap();
        let mt = flat_m_tiles(d.m) as usize;
        let (wn_count, wk_count) = flat_wave_split(bn);
        let (wn_count, wk_count) = (wn_count as usize, wk_count as usize);
        let wrows = bn as usize / wn_count;
        let nt = wrows / 16;
        let chunks = d.k.div_ceil(32);
        let load8 = |p: &[f32], row: usize, rows: usize, k: usize| -> [f32; 8] {
            let mut e = [0f32; 8];
            if row < rows {
                for (i, v) in e.iter_mut().enumerate() {
                    if k + i < d.k {
                        *v = p[row * d.k + k + i];
                    }
                }
            }
            e
        };
        let mut y = vec![f32::NAN; d.m * d.n];
        for bx in 0..l.grid.0 as usize {
            for by in 0..l.grid.1 as usize {
                // acc[wave][i][j][lane][e]
                let mut acc = vec![vec![vec![[[0f32; 4]; 64]; mt]; nt]; FLAT_WAVES as usize];
                for wave in 0..FLAT_WAVES as usize {
                    let (wn, wk) = (wave % wn_count, wave / wn_count);
                    let n0 = bx * bn as usize + wn * wrows;
                    let m0 = by * 16 * mt;
                    let mut c0 = wk;
                    while c0 < chunks {
                        for u in 0..FLAT_UNROLL {
                            for i in 0..nt {
                                for j in 0..mt {
                                    // Per lane: its 8 K elements of A (W) and B (x).
                                    let mut a = [[0f32; 8]; 64];
                                    let mut b = [[0f32; 8]; 64];
                                    for lane in 0..64 {
                                        let (r16, q) = (lane % 16, lane / 16);
                                        let k = 32 * (c0 + wk_count * u) + 8 * q;
                                        a[lane] = load8(w, n0 + 16 * i + r16, d.n, k);
                                        b[lane] = load8(x, m0 + 16 * j + r16, d.m, k);
                                    }
                                    // Two MFMA steps: elements 0..3, then 4..7.
                                    for half in 0..2 {
                                        let mut dm = [[0f32; 16]; 16];
                                        for (row, drow) in dm.iter_mut().enumerate() {
                                            for (col, dv) in drow.iter_mut().enumerate() {
                                                for kk in 0..16 {
                                                    let (q, t) = (kk / 4, kk % 4);
                                                    *dv +=
                                                        a[q * 16 + row][4 * half + t] * b[q * 16 + col][4 * half + t];
                                                }
                                            }
                                        }
                                        for lane in 0..64 {
                                            for e in 0..4 {
                                                acc[wave][i][j][lane][e] += dm[4 * (lane / 16) + e][lane % 16];
                                            }
                                        }
                                    }
                                }
                            }
                        }
                        c0 += wk_count * FLAT_UNROLL;
                    }
                }
                // K-split partials summed into the wk = 0 wavefronts, which store.
                for wave in 0..wn_count {
                    for s in 1..wk_count {
                        for i in 0..nt {
                            for j in 0..mt {
                                for lane in 0..64 {
                                    for e in 0..4 {
                                        let v = acc[s * wn_count + wave][i][j][lane][e];
                                        acc[wave][i][j][lane][e] += v;
                                    }
                                }
                            }
                        }
                    }
                    let n0 = bx * bn as usize + wave * wrows;
                    let m0 = by * 16 * mt;
                    for i in 0..nt {
                        for j in 0..mt {
                            for lane in 0..64 {
                                let m = m0 + 16 * j + lane % 16;
                                for e in 0..4 {
                                    let n = n0 + 16 * i + 4 * (lane / 16) + e;
                                    if m < d.m && n < d.n {
                                        assert!(y[m * d.n + n].is_nan(), "({m}, {n}) stored twice");
                                        y[m * d.n + n] = acc[wave][i][j][lane][e];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        y
    }

    #[test]
    fn the_flat_gemm_tiling_computes_every_output_once() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(rand::random());
        // Odd sizes: partial N blocks, partial M tiles, K not a multiple of 8 or 32, each B_N.
        for (bn, m, n, k) in [
            (32, 3, 70, 97),
            (64, 17, 130, 64),
            (128, 40, 129, 200),
            (256, 1, 300, 33),
            (32, 33, 48, 300),
        ] {
            let d = dims(m, n, k);
            let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let y = emulate_flat_gemm(bn, d, &x, &w);
            for mi in 0..m {
                for ni in 0..n {
                    let want: f64 = (0..k).map(|ki| x[mi * k + ki] as f64 * w[ni * k + ki] as f64).sum();
                    let got = y[mi * n + ni];
                    assert!(
                        (got as f64 - want).abs() < 1e-3,
                        "B_N={bn} M={m} N={n} K={k} at ({mi},{ni}): {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A CPU model of gemv.hip's index arithmetic (vector and scalar entry points): each lane of
    /// each wavefront accumulates what the kernel's lane accumulates, the wavefront sum is
    /// taken, and lane 0 stores. Tests the K striding over 64 or 32 lanes × UNROLL and the row
    /// clamping at the edge of N.
    #[allow(clippy::needless_range_loop)]
    fn emulate_gemv(rows: u32, wave: u32, d: GemmDims, x: &[f32], w: &[f32]) -> Vec<f32> {
        let spec = GemmSpec::new(GemmImpl::Gemv, DType::F16).with_block_n(rows * GEMV_WAVES);
        let (rows, wave) = (rows as usize, wave as usize);
        let unroll = (GEMV_INFLIGHT as usize / rows).max(1);
        let mut y = vec![f32::NAN; d.m * d.n];
        for l in gemv_launches(&spec, rows as u32, wave as u32, d).unwrap() {
            let vec_path = l.kernel != "gemv_scalar";
            for bx in 0..l.grid.0 as usize {
                for wv in 0..GEMV_WAVES as usize {
                    let row0 = (bx * GEMV_WAVES as usize + wv) * rows;
                    if row0 >= d.n {
                        continue;
                    }
                    // acc[r][m] summed over lanes (the wave_sum).
                    let mut acc = vec![vec![0f64; l.m]; rows];
                    for lane in 0..wave {
                        if vec_path {
                            let k8 = d.k / 8;
                            let mut c0 = lane;
                            while c0 < k8 {
                                for u in 0..unroll {
                                    let c = c0 + wave * u;
                                    if c >= k8 {
                                        continue;
                                    }
                                    for r in 0..rows {
                                        let n = (row0 + r).min(d.n - 1);
                                        for m in 0..l.m {
                                            for e in 0..8 {
                                                let k = 8 * c + e;
                                                acc[r][m] += (w[n * d.k + k] * x[(l.m0 + m) * d.k + k]) as f64;
                                            }
                                        }
                                    }
                                }
                                c0 += wave * unroll;
                            }
                        } else {
                            for r in 0..rows {
                                let n = row0 + r;
                                if n >= d.n {
                                    break;
                                }
                                let mut k = lane;
                                while k < d.k {
                                    for m in 0..l.m {
                                        acc[r][m] += (w[n * d.k + k] * x[(l.m0 + m) * d.k + k]) as f64;
                                    }
                                    k += wave;
                                }
                            }
                        }
                    }
                    for r in 0..rows {
                        if row0 + r < d.n {
                            for m in 0..l.m {
                                let at = (l.m0 + m) * d.n + row0 + r;
                                assert!(y[at].is_nan(), "stored twice");
                                y[at] = acc[r][m] as f32;
                            }
                        }
                    }
                }
            }
        }
        y
    }

    #[test]
    fn the_gemv_striding_computes_every_output_once() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(rand::random());
        for (rows, wave, m, n, k) in [
            (1, 64, 1, 37, 1032),
            (2, 64, 9, 50, 4096),
            (4, 32, 17, 23, 520),
            (2, 32, 3, 9, 97),
            (4, 64, 8, 130, 33),
        ] {
            let d = dims(m, n, k);
            let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let y = emulate_gemv(rows, wave, d, &x, &w);
            for mi in 0..m {
                for ni in 0..n {
                    let want: f64 = (0..k).map(|ki| x[mi * k + ki] as f64 * w[ni * k + ki] as f64).sum();
                    let got = y[mi * n + ni];
                    assert!(
                        (got as f64 - want).abs() < 1e-3,
                        "rows={rows} wave{wave} M={m} N={n} K={k} at ({mi},{ni}): {got} vs {want}"
                    );
                }
            }
        }
    }
}
