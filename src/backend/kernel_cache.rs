//! The on-disk cache of compiled GPU code, shared by the CUDA (NVRTC → CUBIN) and ROCm (hiprtc →
//! code object) backends. A second run compiles nothing; an edited kernel gets a new key and
//! recompiles; an unwritable cache directory costs one warning and the code is kept in memory.

use std::path::PathBuf;

use crate::error::Result;

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
