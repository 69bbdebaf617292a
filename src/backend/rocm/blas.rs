//! ImplC on ROCm: rocBLAS `rocblas_gemm_ex`, loaded at run time like the HIP runtime (hipBLAS is
//! a thin layer over it; calling rocBLAS directly saves a library).

use std::ffi::c_void;

use super::hip::Stream;
use super::loader::{candidates, Lib, LoadError};
use crate::dtype::DType;
use crate::error::{FdppError, Result};

pub type Handle = *mut c_void;

/// rocblas_operation
pub const OP_NONE: i32 = 111;
pub const OP_TRANSPOSE: i32 = 112;
/// rocblas_datatype
pub const DT_F16: i32 = 150;
pub const DT_F32: i32 = 151;
pub const DT_BF16: i32 = 168;
/// rocblas_gemm_algo_standard
pub const ALGO_STANDARD: i32 = 0;

pub const ROCBLAS_LIBS: &[&str] = &["librocblas.so", "librocblas.so.5", "librocblas.so.4", "librocblas.so.0"];

pub fn datatype(dt: DType) -> i32 {
    match dt {
        DType::F16 => DT_F16,
        DType::Bf16 => DT_BF16,
    }
}

type GemmEx = unsafe extern "C" fn(
    Handle,
    i32,
    i32,
    i32,
    i32,
    i32,
    *const c_void,
    *const c_void,
    i32,
    i32,
    *const c_void,
    i32,
    i32,
    *const c_void,
    *const c_void,
    i32,
    i32,
    *mut c_void,
    i32,
    i32,
    i32,
    i32,
    i32,
    u32,
) -> i32;

pub struct RocBlas {
    pub lib: Lib,
    create: unsafe extern "C" fn(*mut Handle) -> i32,
    destroy: unsafe extern "C" fn(Handle) -> i32,
    set_stream: unsafe extern "C" fn(Handle, Stream) -> i32,
    gemm_ex: GemmEx,
}

impl RocBlas {
    pub fn load(candidates: &[String]) -> std::result::Result<RocBlas, LoadError> {
        let lib = Lib::open_first(candidates)?;
        // SAFETY: the types are the C signatures of the named rocBLAS functions.
        unsafe {
            Ok(RocBlas {
                create: lib.sym("rocblas_create_handle")?,
                destroy: lib.sym("rocblas_destroy_handle")?,
                set_stream: lib.sym("rocblas_set_stream")?,
                gemm_ex: lib.sym("rocblas_gemm_ex")?,
                lib,
            })
        }
    }

    pub fn load_default() -> Result<RocBlas> {
        let mut c = vec![];
        if let Some(p) = crate::run_config::get()
            .get(crate::run_config::Key::RocblasLib)
            .map(str::to_string)
        {
            c.push(p);
        }
        c.extend(candidates(ROCBLAS_LIBS));
        RocBlas::load(&c).map_err(|e| e.into_unavailable("rocBLAS (librocblas.so) is needed for ImplC"))
    }
}

/// A rocBLAS handle bound to fdpp's stream.
pub struct BlasHandle {
    api: RocBlas,
    h: Handle,
}

impl BlasHandle {
    /// # Safety
    /// `stream` must be a live HIP stream that outlives the handle.
    pub unsafe fn new(api: RocBlas, stream: Stream) -> Result<BlasHandle> {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: out-parameter; the handle is destroyed in Drop.
        let r = unsafe { (api.create)(&mut h) };
        if r != 0 {
            return Err(FdppError::device("rocm", format!("rocblas_create_handle: status {r}")));
        }
        let b = BlasHandle { api, h };
        // SAFETY: both handles are live.
        let r = unsafe { (b.api.set_stream)(b.h, stream) };
        if r != 0 {
            return Err(FdppError::device("rocm", format!("rocblas_set_stream: status {r}")));
        }
        Ok(b)
    }

    /// Row-major y[M,N] = x[M,K]·W[N,K]ᵀ is, in rocBLAS's column-major terms, yᵀ[N,M] = W·xᵀ:
    /// op(A) = Aᵀ with A = W (K×N, ld K), B = x (K×M, ld K), fp32 accumulation.
    ///
    /// # Safety
    /// x, w, y must be device pointers covering [M,K], [N,K], [M,N] elements of `dt`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        dt: DType,
        m: i32,
        n: i32,
        k: i32,
        x: *const c_void,
        w: *const c_void,
        y: *mut c_void,
    ) -> std::result::Result<(), i32> {
        let (alpha, beta) = (1f32, 0f32);
        let t = datatype(dt);
        let r = (self.api.gemm_ex)(
            self.h,
            OP_TRANSPOSE,
            OP_NONE,
            n,
            m,
            k,
            (&alpha as *const f32).cast(),
            w,
            t,
            k,
            x,
            t,
            k,
            (&beta as *const f32).cast(),
            y,
            t,
            n,
            y,
            t,
            n,
            DT_F32,
            ALGO_STANDARD,
            0,
            0,
        );
        if r == 0 {
            Ok(())
        } else {
            Err(r)
        }
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once.
        unsafe { (self.api.destroy)(self.h) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_rocblas_is_a_clean_error() {
        let e = RocBlas::load(&["librocblas_fdpp_missing.so".into()]).err().unwrap();
        assert!(matches!(e, LoadError::NotFound { .. }));
        let e = RocBlas::load(&["libc.so.6".into()]).err().unwrap();
        assert!(matches!(e, LoadError::MissingSymbol { ref symbol, .. } if symbol == "rocblas_create_handle"));
    }

    #[test]
    fn datatypes_match_rocblas_enum() {
        assert_eq!(datatype(DType::F16), 150);
        assert_eq!(datatype(DType::Bf16), 168);
    }
}
