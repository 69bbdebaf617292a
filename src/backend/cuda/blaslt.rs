//! ImplC through cuBLASLt with a chosen algorithm ([`GemmSpec::algo`]): the rank-th of the
//! suggestions cuBLASLt's heuristic makes for the call's (dtype, M, N, K). cublasGemmEx runs the
//! heuristic's own pick; `fdpp tune` times the first [`LT_RANKS`] as candidates of their own and
//! the profile keeps the winner's rank per grid M. In a Llama2-7B tune on the H100 (reports/
//! NOTES.md, session 26) FFN1 ran 2.6 % faster than cublasGemmEx at M = 1024 and 3.6 % at 2048,
//! O and FFN2 6-11 % at M = 256; QKV and FFN2 were level at 1024-2048.
//! At an M between grid points the rank names that M's suggestion, as a flat_gemm tile width
//! carries over to the M near it.
//!
//! Same operation as gemm.rs `cublas`: row-major y[M,N] = x[M,K]·W[N,K]ᵀ is column-major
//! yᵀ[N,M] = op(A)·B with A = W (K×N, transposed), B = x (K×M); fp32 accumulation and scale.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::{drv, CudaBackend, CudaBuffer};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::ops::gemm::{GemmDims, GemmSpec, LT_RANKS};

/// The workspace every call may use: NVIDIA's recommendation for Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

/// One shape's descriptors and the heuristic's suggestions for it, in its order.
struct Shape {
    op: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    algos: Vec<lt::cublasLtMatmulAlgo_t>,
}

/// The backend's cuBLASLt handle, workspace and per-shape plans, created on first use (a run
/// whose profile names no rank never loads libcublasLt).
#[derive(Default)]
pub(crate) struct LtState {
    handle: Option<lt::cublasLtHandle_t>,
    workspace: Option<CudaSlice<u8>>,
    shapes: HashMap<(DType, usize, usize, usize), Shape>,
    /// A rank was missing once (warned once per backend).
    warned: bool,
}

impl Drop for Shape {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by make_shape for this Shape alone and is
        // destroyed once, here (also when make_shape fails part-way); statuses are ignored
        // (nothing to do about them while dropping).
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.op.is_null() {
                lt::cublasLtMatmulDescDestroy(self.op);
            }
        }
    }
}

impl Drop for LtState {
    fn drop(&mut self) {
        // The shapes' descriptors first, then the handle they were made beside.
        self.shapes.clear();
        if let Some(h) = self.handle.take() {
            // SAFETY: the handle was created by this state and is destroyed once.
            unsafe { lt::cublasLtDestroy(h) };
        }
    }
}

fn ok(status: lt::cublasStatus_t, what: &str) -> Result<()> {
    if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(FdppError::device("cuda", format!("{what}: {status:?}")))
    }
}

/// Whether libcublasLt can be loaded (`fdpp tune` offers the ranks only then).
pub(crate) fn present() -> bool {
    // SAFETY: probing only dlopens the library.
    unsafe { lt::is_culib_present() }
}

impl LtState {
    fn handle(&mut self, spec: &GemmSpec) -> Result<lt::cublasLtHandle_t> {
        if let Some(h) = self.handle {
            return Ok(h);
        }
        if !present() {
            return Err(FdppError::BackendUnavailable {
                backend: "cuda",
                reason: format!(
                    "cuBLASLt (libcublasLt.so) not found: {spec} names one of its algorithms; add the CUDA lib \
                     directory to LD_LIBRARY_PATH, or run with a profile tuned without it"
                ),
            });
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: h is an out-parameter.
        ok(unsafe { lt::cublasLtCreate(&mut h) }, "cublasLtCreate")?;
        self.handle = Some(h);
        Ok(h)
    }

    /// The workspace's device address, allocated on first use.
    fn workspace(&mut self, b: &CudaBackend) -> Result<u64> {
        if let Some(ws) = &self.workspace {
            return Ok(ws.device_ptr(b.stream()).0);
        }
        let ws = b
            .stream()
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(drv("allocating the cuBLASLt workspace"))?;
        let p = ws.device_ptr(b.stream()).0;
        self.workspace = Some(ws);
        Ok(p)
    }

    /// The descriptors and suggestions of (dtype, dims), made once.
    fn shape(&mut self, h: lt::cublasLtHandle_t, dtype: DType, d: GemmDims) -> Result<&Shape> {
        Ok(match self.shapes.entry((dtype, d.m, d.n, d.k)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(make_shape(h, dtype, d)?),
        })
    }
}

fn make_shape(h: lt::cublasLtHandle_t, dtype: DType, d: GemmDims) -> Result<Shape> {
    let ty = match dtype {
        DType::F16 => lt::cudaDataType_t::CUDA_R_16F,
        DType::Bf16 => lt::cudaDataType_t::CUDA_R_16BF,
    };
    let (m, n, k) = (d.m as u64, d.n as u64, d.k as u64);
    let mut s = Shape {
        op: std::ptr::null_mut(),
        layouts: [std::ptr::null_mut(); 3],
        algos: Vec::new(),
    };
    let mut pref = std::ptr::null_mut();
    // SAFETY: out-parameters and attribute buffers of the sizes cuBLASLt documents (int32 for the
    // transposes, u64 for the workspace size); the preference is destroyed below, the other
    // descriptors are owned by `s`, whose Drop destroys them on an early return too.
    unsafe {
        ok(
            lt::cublasLtMatmulDescCreate(
                &mut s.op,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType_t::CUDA_R_32F,
            ),
            "cublasLtMatmulDescCreate",
        )?;
        for (attr, v) in [
            (lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, 1i32),
            (lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, 0i32),
        ] {
            ok(
                lt::cublasLtMatmulDescSetAttribute(s.op, attr, &v as *const i32 as *const _, 4),
                "cublasLtMatmulDescSetAttribute",
            )?;
        }
        for (i, (rows, cols, ld)) in [(k, n, k), (k, m, k), (n, m, n)].into_iter().enumerate() {
            ok(
                lt::cublasLtMatrixLayoutCreate(&mut s.layouts[i], ty, rows, cols, ld as i64),
                "cublasLtMatrixLayoutCreate",
            )?;
        }
        ok(
            lt::cublasLtMatmulPreferenceCreate(&mut pref),
            "cublasLtMatmulPreferenceCreate",
        )?;
        let ws = WORKSPACE_BYTES as u64;
        let set = lt::cublasLtMatmulPreferenceSetAttribute(
            pref,
            lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const _,
            8,
        );
        let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(LT_RANKS as usize);
        let mut got = 0i32;
        let heur = if set == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            lt::cublasLtMatmulAlgoGetHeuristic(
                h,
                s.op,
                s.layouts[0],
                s.layouts[1],
                s.layouts[2],
                s.layouts[2],
                pref,
                LT_RANKS as i32,
                res.as_mut_ptr(),
                &mut got,
            )
        } else {
            set
        };
        lt::cublasLtMatmulPreferenceDestroy(pref);
        ok(heur, "cublasLtMatmulAlgoGetHeuristic")?;
        res.set_len(got.clamp(0, LT_RANKS as i32) as usize);
        s.algos = res
            .iter()
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
    }
    Ok(s)
}

/// y = x · Wᵀ with the `rank`-th suggestion for this shape; Ok(false), with nothing run, where
/// cuBLASLt makes fewer suggestions for it (a profile from another card or library version).
pub(crate) fn matmul(
    b: &CudaBackend,
    spec: &GemmSpec,
    rank: u32,
    d: GemmDims,
    x: &CudaBuffer,
    w: &CudaBuffer,
    y: &mut CudaBuffer,
) -> Result<bool> {
    let mut st = b.lt.borrow_mut();
    let h = st.handle(spec)?;
    let ws_ptr = st.workspace(b)?;
    let shape = st.shape(h, spec.dtype, d)?;
    let offered = shape.algos.len();
    let Some(algo) = shape.algos.get(rank as usize).copied() else {
        if !st.warned {
            st.warned = true;
            eprintln!(
                "warning: {spec} at {}: cuBLASLt suggests {} algorithms for this shape, so it has no rank {rank}; \
                 running cublasGemmEx's choice instead (re-run fdpp tune on this machine: the profile may come from \
                 another card or library version)",
                d.label(),
                offered
            );
        }
        return Ok(false);
    };
    let (alpha, beta) = (1f32, 0f32);
    let (xp, wp, yp) = (b.ptr(x), b.ptr(w), b.ptr(y));
    // SAFETY: the pointers cover [M, K], [N, K] and [M, N] (checked by gemm::run); the
    // descriptors describe exactly those; the workspace is WORKSPACE_BYTES long and stays
    // allocated with the backend; the scalars are host f32 as the scale type says.
    let status = unsafe {
        lt::cublasLtMatmul(
            h,
            shape.op,
            &alpha as *const f32 as *const _,
            wp as *const _,
            shape.layouts[0],
            xp as *const _,
            shape.layouts[1],
            &beta as *const f32 as *const _,
            yp as *const _,
            shape.layouts[2],
            yp as *mut _,
            shape.layouts[2],
            &algo,
            ws_ptr as *mut _,
            WORKSPACE_BYTES,
            b.stream().cu_stream() as lt::cudaStream_t,
        )
    };
    if status != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(FdppError::device(
            "cuda",
            format!("cublasLtMatmul {spec} at {}: {status:?}", d.label()),
        ));
    }
    Ok(true)
}
