//! hiprtc compilation of the HIP kernel sources to an AMD code object for one gfx arch, with an
//! on-disk cache like the CUDA one: `<cache>/<fdpp-version>/<arch>/<spec-uri>-<hash>.hsaco`.
//!
//! hiprtc lives inside libamdhip64 on ROCm 5.x and in its own libhiprtc on 6.x and later; both
//! are tried. ROCm 5.2's hiprtc aborts the whole process on a target its LLVM does not know
//! (gfx1100, gfx942), so `fdpp kernels check --backend rocm` runs each compile in a child process
//! (src/cli/kernels.rs); the backend compiles in-process only for the arch its own driver reports.

use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use super::loader::{candidates, Lib, LoadError};
use super::sources::KernelSource;
use crate::error::{FdppError, Result};

type Prog = *mut c_void;
type RtcResult = i32;
const HIPRTC_SUCCESS: RtcResult = 0;

pub struct HiprtcApi {
    pub lib: Lib,
    version: unsafe extern "C" fn(*mut i32, *mut i32) -> RtcResult,
    error_string: unsafe extern "C" fn(RtcResult) -> *const c_char,
    #[allow(clippy::type_complexity)]
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        i32,
        *const *const c_char,
        *const *const c_char,
    ) -> RtcResult,
    compile: unsafe extern "C" fn(Prog, i32, *const *const c_char) -> RtcResult,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> RtcResult,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> RtcResult,
    code_size: unsafe extern "C" fn(Prog, *mut usize) -> RtcResult,
    code: unsafe extern "C" fn(Prog, *mut c_char) -> RtcResult,
    destroy: unsafe extern "C" fn(*mut Prog) -> RtcResult,
}

/// Own library first (6.x+), then the HIP runtime that carried it in 5.x.
pub const HIPRTC_LIBS: &[&str] = &[
    "libhiprtc.so",
    "libhiprtc.so.6",
    "libhiprtc.so.7",
    "libamdhip64.so",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

impl HiprtcApi {
    pub fn load(candidates: &[String]) -> std::result::Result<HiprtcApi, LoadError> {
        // A libamdhip64 of 6.x opens but has no hiprtc symbols: keep looking past it.
        let mut last = None;
        for c in candidates {
            let lib = match Lib::open_first(std::slice::from_ref(c)) {
                Ok(l) => l,
                Err(e) => {
                    last.get_or_insert(e);
                    continue;
                }
            };
            if !lib.has("hiprtcCompileProgram") {
                last = Some(LoadError::MissingSymbol {
                    lib: lib.name.clone(),
                    symbol: "hiprtcCompileProgram".into(),
                    msg: "not exported".into(),
                });
                continue;
            }
            // SAFETY: each type is the C signature of the named hiprtc function.
            return unsafe {
                Ok(HiprtcApi {
                    version: lib.sym("hiprtcVersion")?,
                    error_string: lib.sym("hiprtcGetErrorString")?,
                    create: lib.sym("hiprtcCreateProgram")?,
                    compile: lib.sym("hiprtcCompileProgram")?,
                    log_size: lib.sym("hiprtcGetProgramLogSize")?,
                    log: lib.sym("hiprtcGetProgramLog")?,
                    code_size: lib.sym("hiprtcGetCodeSize")?,
                    code: lib.sym("hiprtcGetCode")?,
                    destroy: lib.sym("hiprtcDestroyProgram")?,
                    lib,
                })
            };
        }
        Err(last.unwrap_or(LoadError::NotFound { tried: vec![] }))
    }

    pub fn version(&self) -> Option<String> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: plain out-parameters.
        let r = unsafe { (self.version)(&mut a, &mut b) };
        (r == HIPRTC_SUCCESS).then(|| format!("{a}.{b}"))
    }

    fn err(&self, r: RtcResult) -> String {
        // SAFETY: hiprtcGetErrorString returns a static string or null.
        let p = unsafe { (self.error_string)(r) };
        if p.is_null() {
            return format!("hiprtc error {r}");
        }
        // SAFETY: non-null and NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

pub fn api() -> std::result::Result<&'static HiprtcApi, &'static LoadError> {
    static API: OnceLock<std::result::Result<HiprtcApi, LoadError>> = OnceLock::new();
    API.get_or_init(|| {
        let mut c = vec![];
        if let Some(p) = crate::run_config::get()
            .get(crate::run_config::Key::HiprtcLib)
            .map(str::to_string)
        {
            c.push(p);
        }
        c.extend(candidates(HIPRTC_LIBS));
        HiprtcApi::load(&c)
    })
    .as_ref()
}

pub fn api_or_unavailable() -> Result<&'static HiprtcApi> {
    api().map_err(|e| {
        e.clone().into_unavailable(
            "no hiprtc (libhiprtc.so, or libamdhip64.so on ROCm 5.x): install ROCm, or `apt-get install libamdhip64-dev` on Debian",
        )
    })
}

/// hiprtc options for a source on a gfx arch.
pub fn options(src: &KernelSource, arch: &str) -> Vec<String> {
    let mut o = vec![format!("--offload-arch={arch}"), "-O3".into(), "-std=c++17".into()];
    for (k, v) in &src.defines {
        o.push(format!("-D{k}={v}"));
    }
    o
}

pub fn cache_path(src: &KernelSource, arch: &str) -> Option<PathBuf> {
    src.cache_path(arch, "hiprtc", "hsaco")
}

/// Compile with hiprtc in this process. Errors carry the hiprtc log and the options.
pub fn compile_code_object(src: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    let api = api_or_unavailable()?;
    let fail = |log: String| FdppError::Compile {
        spec: src.uri.clone(),
        arch: arch.to_string(),
        log,
    };
    let text = CString::new(src.text.as_str()).map_err(|e| fail(e.to_string()))?;
    let name = CString::new(format!("{}.hip", src.uri)).map_err(|e| fail(e.to_string()))?;
    let opts = options(src, arch);
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| fail(e.to_string()))?;
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: Prog = std::ptr::null_mut();
    // SAFETY: text and name outlive the call; no headers are passed.
    let r = unsafe {
        (api.create)(
            &mut prog,
            text.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != HIPRTC_SUCCESS {
        return Err(fail(format!("hiprtcCreateProgram: {}", api.err(r))));
    }
    // SAFETY: prog is live until the destroy below; buffers are sized by the matching *Size call.
    let out = unsafe {
        let r = (api.compile)(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let log = program_log(api, prog);
        if r != HIPRTC_SUCCESS {
            Err(fail(format!("{}\noptions: {}\n{log}", api.err(r), opts.join(" "))))
        } else {
            let mut size = 0usize;
            let r = (api.code_size)(prog, &mut size);
            if r != HIPRTC_SUCCESS || size == 0 {
                Err(fail(format!("hiprtcGetCodeSize: {} (size {size})\n{log}", api.err(r))))
            } else {
                let mut buf = vec![0u8; size];
                let r = (api.code)(prog, buf.as_mut_ptr() as *mut c_char);
                if r != HIPRTC_SUCCESS {
                    Err(fail(format!("hiprtcGetCode: {}\n{log}", api.err(r))))
                } else {
                    Ok(buf)
                }
            }
        }
    };
    // SAFETY: prog was created above and is not used after this.
    unsafe { (api.destroy)(&mut prog) };
    out
}

/// # Safety
/// `prog` must be a live hiprtc program.
unsafe fn program_log(api: &HiprtcApi, prog: Prog) -> String {
    let mut n = 0usize;
    if (api.log_size)(prog, &mut n) != HIPRTC_SUCCESS || n == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; n];
    if (api.log)(prog, buf.as_mut_ptr() as *mut c_char) != HIPRTC_SUCCESS {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

pub use crate::backend::kernel_cache::CacheUse;

/// Code object from the cache, or compiled and stored; an unwritable cache costs one warning.
pub fn code_object_cached(src: &KernelSource, arch: &str, warn: &mut dyn FnMut(String)) -> Result<(Vec<u8>, CacheUse)> {
    crate::backend::kernel_cache::cached(cache_path(src, arch), || compile_code_object(src, arch), warn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::rocm::sources::all_sources;

    #[test]
    fn options_name_the_arch_and_every_define() {
        let s = &all_sources()[0];
        let o = options(s, "gfx90a");
        assert_eq!(o[0], "--offload-arch=gfx90a");
        for (k, v) in &s.defines {
            assert!(o.contains(&format!("-D{k}={v}")));
        }
    }

    #[test]
    fn the_cache_key_changes_with_arch_and_defines() {
        let all = all_sources();
        let (a, b) = (&all[0], &all[1]);
        std::env::set_var("FDPP_CACHE_DIR", "/tmp/fdpp-key-test");
        assert_ne!(cache_path(a, "gfx90a"), cache_path(a, "gfx940"));
        assert_ne!(cache_path(a, "gfx90a"), cache_path(b, "gfx90a"));
        assert_eq!(cache_path(a, "gfx90a"), cache_path(a, "gfx90a"));
        let mut edited = a.clone();
        edited.text.push(' ');
        assert_ne!(cache_path(a, "gfx90a"), cache_path(&edited, "gfx90a"));
    }

    #[test]
    fn a_library_without_hiprtc_is_a_clean_error() {
        let e = HiprtcApi::load(&["libfdpp_missing_hiprtc.so".into(), "libc.so.6".into()])
            .err()
            .unwrap();
        assert!(matches!(e, LoadError::MissingSymbol { ref symbol, .. } if symbol == "hiprtcCompileProgram"));
    }
}
