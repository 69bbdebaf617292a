//! GPU kernel sources and the on-disk cache of their compiled code, shared by the CUDA (NVRTC →
//! CUBIN) and ROCm (hiprtc → code object) backends:
//! `<cache>/<fdpp-version>/<arch>/<spec-uri>-<hash>.<ext>`. A second run compiles nothing; an
//! edited kernel (or other defines) gets a new hash and recompiles; an unwritable cache directory
//! costs one warning and the code is kept in memory.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::dtype::DType;
use crate::error::Result;

/// One compile-time specialisation of a kernel file. The URI (e.g. `flat_gemm_f16_bn64_s2`)
/// names every compile-time parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSource {
    pub uri: String,
    /// The file with its common header expanded in place (the runtime compilers get one string).
    pub text: String,
    pub defines: Vec<(String, String)>,
}

impl KernelSource {
    /// Where this source's compiled code for `arch` is cached; `compiler` and `ext` keep NVRTC's
    /// and hiprtc's outputs apart.
    pub fn cache_path(&self, arch: &str, compiler: &str, ext: &str) -> Option<PathBuf> {
        let mut h = Sha256::new();
        h.update(self.text.as_bytes());
        for (k, v) in &self.defines {
            h.update(format!("\0{k}={v}").as_bytes());
        }
        h.update(format!("\0{compiler}\0{arch}").as_bytes());
        let key = hex16(&h.finalize());
        cache_root().map(|r| {
            r.join(crate::VERSION)
                .join(arch)
                .join(format!("{}-{key}.{ext}", self.uri))
        })
    }
}

/// `$FDPP_CACHE_DIR`, else `$XDG_CACHE_HOME/fdpp`, else `~/.cache/fdpp`.
pub fn cache_root() -> Option<PathBuf> {
    if let Some(p) = crate::run_config::get().get(crate::run_config::Key::CacheDir) {
        return Some(p.into());
    }
    if let Ok(p) = std::env::var("XDG_CACHE_HOME") {
        return Some(Path::new(&p).join("fdpp"));
    }
    std::env::var("HOME")
        .ok()
        .map(|h| Path::new(&h).join(".cache").join("fdpp"))
}

/// SHA-256 over (name, text) pairs, hex, first 16 digits: the kernel hash profiles record.
pub fn hash_files(files: &[(&str, &str)]) -> String {
    let mut h = Sha256::new();
    for (name, text) in files {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(text.as_bytes());
        h.update([0]);
    }
    hex16(&h.finalize())
}

pub fn hex16(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The `-D` that selects bf16 over f16 in every kernel file.
pub fn dtype_define(dt: DType) -> (String, String) {
    ("FDPP_BF16".into(), if dt == DType::Bf16 { "1" } else { "0" }.into())
}

/// Outcome of a cached compile, for messages and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheUse {
    Hit,
    Compiled,
    /// Compiled, but the cache could not be written (kept in memory).
    CompiledUncached,
}

/// The bytes at `path` if present, else `compile()`'s, stored at `path` when possible.
pub fn cached(
    path: Option<PathBuf>,
    compile: impl FnOnce() -> Result<Vec<u8>>,
    warn: &mut dyn FnMut(String),
) -> Result<(Vec<u8>, CacheUse)> {
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok((bytes, CacheUse::Hit));
            }
        }
    }
    let code = compile()?;
    let Some(p) = path else {
        warn("no cache directory (HOME unset): kernels are compiled in memory every run".into());
        return Ok((code, CacheUse::CompiledUncached));
    };
    match crate::profile::write_atomic(&p, &code) {
        Ok(()) => Ok((code, CacheUse::Compiled)),
        Err(e) => {
            warn(format!("kernel cache not writable ({e}); compiled in memory"));
            Ok((code, CacheUse::CompiledUncached))
        }
    }
}
