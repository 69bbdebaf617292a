//! The HIP runtime entry points fdpp calls, resolved from libamdhip64 at run time.
//!
//! Only the C ABI of a few dozen functions is declared here, with the HIP 5.x/6.x signatures
//! (unchanged between them for everything used). Handles are opaque pointers; errors are the
//! `hipError_t` enum as an i32. Every call goes through [`HipApi`], loaded once per process.

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

use super::loader::{candidates, Lib, LoadError};
use crate::error::{FdppError, Result};

pub type HipError = i32;
pub type Stream = *mut c_void;
pub type Event = *mut c_void;
pub type Module = *mut c_void;
pub type Function = *mut c_void;

pub const HIP_SUCCESS: HipError = 0;
/// hipMemcpyKind
pub const MEMCPY_HOST_TO_DEVICE: i32 = 1;
pub const MEMCPY_DEVICE_TO_HOST: i32 = 2;

/// hipDeviceAttribute_t values used (from HIP 5.2's hip_runtime_api.h; the CUDA-compatible
/// block of the enum has kept its order since). The probe cross-checks what it can (a warp size
/// that is not 32 or 64 falls back to the arch's).
pub mod attr {
    pub const L2_CACHE_SIZE: i32 = 19;
    pub const MULTIPROCESSOR_COUNT: i32 = 63;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 74;
    pub const WARP_SIZE: i32 = 87;
}

/// `hipDeviceProp_t` as HIP 5.x's `hipGetDeviceProperties` fills it. Only `gcnArchName` is read,
/// at this offset, checked to start with "gfx"; ROCm 6 changed the layout (hipDeviceProp_tR0600),
/// so when the field is not there the probe searches the struct for the arch string instead.
pub const PROP_BYTES: usize = 792;
pub const PROP_GCN_ARCH_NAME: usize = 396;
/// Bytes handed to hipGetDeviceProperties: well past any layout, so a newer runtime writing a
/// longer struct cannot overrun the buffer.
pub const PROP_BUFFER: usize = 8192;

type FnI32 = unsafe extern "C" fn(*mut i32) -> HipError;

pub struct HipApi {
    pub lib: Lib,
    pub init: unsafe extern "C" fn(u32) -> HipError,
    pub get_device_count: FnI32,
    pub driver_get_version: FnI32,
    pub runtime_get_version: FnI32,
    pub get_error_string: unsafe extern "C" fn(HipError) -> *const c_char,
    pub set_device: unsafe extern "C" fn(i32) -> HipError,
    pub device_get_name: unsafe extern "C" fn(*mut c_char, i32, i32) -> HipError,
    pub device_total_mem: unsafe extern "C" fn(*mut usize, i32) -> HipError,
    pub device_get_attribute: unsafe extern "C" fn(*mut i32, i32, i32) -> HipError,
    pub get_device_properties: unsafe extern "C" fn(*mut c_void, i32) -> HipError,
    pub malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError,
    pub free: unsafe extern "C" fn(*mut c_void) -> HipError,
    pub memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32) -> HipError,
    pub memcpy_dtod_async: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> HipError,
    /// From pageable host memory HIP copies synchronously, so the source may be reused at once.
    pub memcpy_htod_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, Stream) -> HipError,
    pub memset_d16_async: unsafe extern "C" fn(*mut c_void, u16, usize, Stream) -> HipError,
    pub stream_create: unsafe extern "C" fn(*mut Stream) -> HipError,
    pub stream_destroy: unsafe extern "C" fn(Stream) -> HipError,
    pub stream_synchronize: unsafe extern "C" fn(Stream) -> HipError,
    pub event_create: unsafe extern "C" fn(*mut Event) -> HipError,
    pub event_destroy: unsafe extern "C" fn(Event) -> HipError,
    pub event_record: unsafe extern "C" fn(Event, Stream) -> HipError,
    pub event_synchronize: unsafe extern "C" fn(Event) -> HipError,
    pub event_elapsed_time: unsafe extern "C" fn(*mut f32, Event, Event) -> HipError,
    pub module_load_data: unsafe extern "C" fn(*mut Module, *const c_void) -> HipError,
    pub module_unload: unsafe extern "C" fn(Module) -> HipError,
    pub module_get_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> HipError,
    #[allow(clippy::type_complexity)]
    pub module_launch_kernel: unsafe extern "C" fn(
        Function,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        Stream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> HipError,
}

/// The library names tried, newest first (the soname carries the major version).
pub const HIP_LIBS: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];

impl HipApi {
    /// Open the first of `candidates` and resolve every symbol; any missing one is an error.
    pub fn load(candidates: &[String]) -> std::result::Result<HipApi, LoadError> {
        let lib = Lib::open_first(candidates)?;
        // SAFETY: each type below is the C signature of the named HIP function.
        unsafe {
            Ok(HipApi {
                init: lib.sym("hipInit")?,
                get_device_count: lib.sym("hipGetDeviceCount")?,
                driver_get_version: lib.sym("hipDriverGetVersion")?,
                runtime_get_version: lib.sym("hipRuntimeGetVersion")?,
                get_error_string: lib.sym("hipGetErrorString")?,
                set_device: lib.sym("hipSetDevice")?,
                device_get_name: lib.sym("hipDeviceGetName")?,
                device_total_mem: lib.sym("hipDeviceTotalMem")?,
                device_get_attribute: lib.sym("hipDeviceGetAttribute")?,
                // ROCm 6 exports the 6.x-layout function under its versioned name.
                get_device_properties: lib
                    .sym("hipGetDevicePropertiesR0600")
                    .or_else(|_| lib.sym("hipGetDeviceProperties"))?,
                malloc: lib.sym("hipMalloc")?,
                free: lib.sym("hipFree")?,
                memcpy: lib.sym("hipMemcpy")?,
                memcpy_dtod_async: lib.sym("hipMemcpyDtoDAsync")?,
                memcpy_htod_async: lib.sym("hipMemcpyHtoDAsync")?,
                memset_d16_async: lib.sym("hipMemsetD16Async")?,
                stream_create: lib.sym("hipStreamCreate")?,
                stream_destroy: lib.sym("hipStreamDestroy")?,
                stream_synchronize: lib.sym("hipStreamSynchronize")?,
                event_create: lib.sym("hipEventCreate")?,
                event_destroy: lib.sym("hipEventDestroy")?,
                event_record: lib.sym("hipEventRecord")?,
                event_synchronize: lib.sym("hipEventSynchronize")?,
                event_elapsed_time: lib.sym("hipEventElapsedTime")?,
                module_load_data: lib.sym("hipModuleLoadData")?,
                module_unload: lib.sym("hipModuleUnload")?,
                module_get_function: lib.sym("hipModuleGetFunction")?,
                module_launch_kernel: lib.sym("hipModuleLaunchKernel")?,
                lib,
            })
        }
    }

    /// The error's name as HIP spells it, e.g. "hipErrorNoDevice".
    pub fn error_string(&self, e: HipError) -> String {
        // SAFETY: hipGetErrorString returns a static NUL-terminated string (or null).
        let p = unsafe { (self.get_error_string)(e) };
        if p.is_null() {
            return format!("hipError {e}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Ok for hipSuccess, else a device error naming the call.
    pub fn check(&self, r: HipError, what: &str) -> Result<()> {
        if r == HIP_SUCCESS {
            Ok(())
        } else {
            Err(FdppError::device(
                "rocm",
                format!("{what}: {} ({r})", self.error_string(r)),
            ))
        }
    }
}

/// The process's HIP runtime, loaded on first use; the error is kept so that every later call
/// reports the same reason without retrying the load.
pub fn api() -> std::result::Result<&'static HipApi, &'static LoadError> {
    static API: OnceLock<std::result::Result<HipApi, LoadError>> = OnceLock::new();
    API.get_or_init(|| {
        let mut c = vec![];
        if let Some(p) = crate::run_config::get()
            .get(crate::run_config::Key::HipLib)
            .map(str::to_string)
        {
            c.push(p);
        }
        c.extend(candidates(HIP_LIBS));
        HipApi::load(&c)
    })
    .as_ref()
}

/// [`api`] as a `BackendUnavailable` error with what to do about it.
pub fn api_or_unavailable() -> Result<&'static HipApi> {
    api().map_err(|e| {
        e.clone().into_unavailable(
            "no ROCm HIP runtime (libamdhip64.so): this machine has no ROCm; install ROCm or set ROCM_PATH / FDPP_HIP_LIB",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loading_from_missing_libraries_is_an_error() {
        let e = HipApi::load(&["libfdpp_missing_amdhip64.so".to_string()])
            .err()
            .unwrap();
        assert!(matches!(e, LoadError::NotFound { .. }));
    }

    #[test]
    fn a_library_without_the_hip_symbols_is_a_missing_symbol_error() {
        // libc loads, but has no hipInit: the first lookup fails cleanly.
        let e = HipApi::load(&["libc.so.6".to_string()]).err().unwrap();
        assert!(
            matches!(e, LoadError::MissingSymbol { ref symbol, .. } if symbol == "hipInit"),
            "{e:?}"
        );
        let msg = e.into_unavailable("HIP runtime").to_string();
        assert!(
            msg.contains("rocm backend unavailable") && msg.contains("hipInit"),
            "{msg}"
        );
    }
}
