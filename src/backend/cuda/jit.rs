//! NVRTC compilation of kernel sources to CUBIN for one arch, with an on-disk cache keyed by fdpp
//! version, arch, spec URI and source hash:
//! `<cache>/<fdpp-version>/<arch>/<spec-uri>-<hash>.cubin`. A second run compiles nothing; an
//! edited kernel (or other defines) gets a new hash and recompiles. An unwritable cache directory
//! only costs a warning: the CUBIN is then kept in memory.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::sources::KernelSource;
use crate::error::{FdppError, Result};

/// Is libnvrtc loadable? Probed first because cudarc panics when a library is missing.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { nvrtc_sys::is_culib_present() }
}

pub fn nvrtc_version() -> Option<String> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    (r == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
}

/// Where the CUDA headers are, if anywhere (the kernels need none; passed on when found so that
/// a kernel that does include one still compiles).
pub fn cuda_include_dir() -> Option<PathBuf> {
    let mut c: Vec<PathBuf> = vec![];
    if let Some(p) = crate::run_config::get().get(crate::run_config::Key::CudaInclude) {
        c.push(p.into());
    }
    if let Ok(p) = std::env::var("CUDA_HOME") {
        c.push(Path::new(&p).join("include"));
    }
    c.push("/usr/local/cuda/include".into());
    c.into_iter().find(|p| p.join("cuda_fp16.h").is_file())
}

/// NVRTC options for a source on an arch ("sm_90a").
fn options(src: &KernelSource, arch: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".into(),
        "-lineinfo".into(),
    ];
    for (k, v) in &src.defines {
        o.push(format!("-D{k}={v}"));
    }
    if crate::run_config::get().set_on(crate::run_config::Key::PtxasVerbose) {
        o.push("--ptxas-options=-v".into());
    }
    if let Some(inc) = cuda_include_dir() {
        o.push(format!("-I{}", inc.display()));
    }
    o
}

pub fn cache_path(src: &KernelSource, arch: &str) -> Option<PathBuf> {
    src.cache_path(arch, "nvrtc", "cubin")
}

/// Compile with NVRTC to CUBIN. Errors carry the NVRTC log and the spec URI.
pub fn compile_cubin(src: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    if !nvrtc_present() {
        return Err(FdppError::BackendUnavailable {
            backend: "cuda",
            reason: "NVRTC library (libnvrtc.so) not found; install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and add its lib directory to LD_LIBRARY_PATH".into(),
        });
    }
    let fail = |log: String| FdppError::Compile {
        spec: src.uri.clone(),
        arch: arch.to_string(),
        log,
    };
    let text = CString::new(src.text.as_str()).map_err(|e| fail(e.to_string()))?;
    let name = CString::new(format!("{}.cu", src.uri)).map_err(|e| fail(e.to_string()))?;
    let prog = nvrtc::create_program(&text, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let opts = options(src, arch);
    // SAFETY: prog is a live program; it is destroyed on every path below.
    let out = unsafe {
        let compiled = nvrtc::compile_program(prog, &opts);
        let log = nvrtc::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        let res = match compiled {
            Err(e) => Err(fail(format!("{e:?}\noptions: {}\n{log}", opts.join(" ")))),
            Ok(()) if crate::run_config::get().set_on(crate::run_config::Key::PtxasVerbose) => {
                eprintln!("{} ({arch}):\n{log}", src.uri);
                get_cubin(prog).map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}\n{log}")))
            }
            Ok(()) => get_cubin(prog).map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}\n{log}"))),
        };
        let _ = nvrtc::destroy_program(prog);
        res
    };
    out
}

unsafe fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<u8>, nvrtc_sys::nvrtcResult> {
    let mut size = 0usize;
    let r = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size);
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(r);
    }
    let mut buf = vec![0u8; size];
    let r = nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _);
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(r);
    }
    Ok(buf)
}

pub use crate::backend::kernel_cache::CacheUse;

/// CUBIN from the cache, or compiled and stored. `warn` receives one message when the cache is
/// not writable.
pub fn cubin_cached(src: &KernelSource, arch: &str, warn: &mut dyn FnMut(String)) -> Result<(Vec<u8>, CacheUse)> {
    crate::backend::kernel_cache::cached(cache_path(src, arch), || compile_cubin(src, arch), warn)
}

/// "sm_90a" for compute capability (9, 0) (Hopper gets the arch-specific target), "sm_86" etc.
pub fn arch_for_cc(major: i32, minor: i32) -> String {
    if major == 9 && minor == 0 {
        "sm_90a".into()
    } else {
        format!("sm_{major}{minor}")
    }
}
