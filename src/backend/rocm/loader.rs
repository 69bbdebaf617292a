//! Run-time loading of the ROCm libraries (libamdhip64, hiprtc, rocBLAS) with libloading, the way
//! cudarc loads CUDA: the binary links against no ROCm library, so it builds and runs on machines
//! without ROCm and one binary serves both vendors. A missing library or symbol is an error
//! value, never an abort: every entry point below returns `Result`.

use std::path::PathBuf;

use libloading::Library;

use crate::error::FdppError;

/// An opened shared library and the name it was found under (for messages).
pub struct Lib {
    lib: Library,
    pub name: String,
}

impl std::fmt::Debug for Lib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lib({})", self.name)
    }
}

/// Why a library could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// None of the candidate names opened; each with the loader's message.
    NotFound { tried: Vec<(String, String)> },
    /// The library opened but lacks a symbol fdpp calls.
    MissingSymbol { lib: String, symbol: String, msg: String },
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::NotFound { tried } => {
                let names: Vec<&str> = tried.iter().map(|(n, _)| n.as_str()).collect();
                write!(f, "none of {} could be loaded", names.join(", "))?;
                // The first message usually says it best ("cannot open shared object file").
                if let Some((n, m)) = tried.first() {
                    write!(f, " ({n}: {m})")?;
                }
                Ok(())
            }
            LoadError::MissingSymbol { lib, symbol, msg } => {
                write!(
                    f,
                    "{lib} has no symbol {symbol} ({msg}): the library is too old or not ROCm's"
                )
            }
        }
    }
}

impl LoadError {
    pub fn into_unavailable(self, what: &str) -> FdppError {
        FdppError::BackendUnavailable {
            backend: "rocm",
            reason: format!("{what}: {self}"),
        }
    }
}

/// Candidate paths for a ROCm library: `$ROCM_PATH/lib`, `/opt/rocm/lib`, then the bare names
/// (the dynamic loader's search path, LD_LIBRARY_PATH included). `names` are file names such as
/// "libamdhip64.so.6".
pub fn candidates(names: &[&str]) -> Vec<String> {
    let mut dirs: Vec<PathBuf> = vec![];
    if let Some(p) = std::env::var_os("ROCM_PATH") {
        dirs.push(PathBuf::from(p).join("lib"));
    }
    dirs.push("/opt/rocm/lib".into());
    let mut out = vec![];
    for d in &dirs {
        for n in names {
            let p = d.join(n);
            if p.is_file() {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    out.extend(names.iter().map(|n| n.to_string()));
    out
}

impl Lib {
    /// Open the first candidate that loads.
    pub fn open_first(candidates: &[String]) -> Result<Lib, LoadError> {
        let mut tried = vec![];
        for c in candidates {
            // SAFETY: loading a library runs its initialisers; the ROCm libraries' initialisers
            // only register the runtime (no GPU is touched until hipInit).
            match unsafe { Library::new(c) } {
                Ok(lib) => return Ok(Lib { lib, name: c.clone() }),
                Err(e) => tried.push((c.clone(), e.to_string())),
            }
        }
        Err(LoadError::NotFound { tried })
    }

    /// A function pointer of type `T` for `symbol`.
    ///
    /// # Safety
    /// `T` must be the `extern "C" fn` type matching the C declaration of `symbol`.
    pub unsafe fn sym<T: Copy>(&self, symbol: &str) -> Result<T, LoadError> {
        match self.lib.get::<T>(symbol.as_bytes()) {
            Ok(s) => Ok(*s),
            Err(e) => Err(LoadError::MissingSymbol {
                lib: self.name.clone(),
                symbol: symbol.to_string(),
                msg: e.to_string(),
            }),
        }
    }

    pub fn has(&self, symbol: &str) -> bool {
        // SAFETY: the pointer is looked up, never called.
        unsafe { self.lib.get::<*const ()>(symbol.as_bytes()).is_ok() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_every_candidate() {
        let c = vec![
            "libfdpp_no_such_lib_a.so".to_string(),
            "libfdpp_no_such_lib_b.so.6".to_string(),
        ];
        let e = Lib::open_first(&c).unwrap_err();
        let LoadError::NotFound { tried } = &e else {
            panic!("expected NotFound, got {e:?}");
        };
        assert_eq!(tried.len(), 2);
        let msg = e.to_string();
        assert!(
            msg.contains("libfdpp_no_such_lib_a.so") && msg.contains("libfdpp_no_such_lib_b.so.6"),
            "{msg}"
        );
    }

    #[test]
    fn a_missing_symbol_is_an_error_not_an_abort() {
        // libc is always there; the symbol is not.
        let lib = Lib::open_first(&["libc.so.6".to_string()]).unwrap();
        type F = unsafe extern "C" fn() -> i32;
        // SAFETY: the symbol does not exist, so nothing is ever called.
        let e = unsafe { lib.sym::<F>("fdpp_hipNoSuchFunction") }.unwrap_err();
        assert!(matches!(e, LoadError::MissingSymbol { ref symbol, .. } if symbol == "fdpp_hipNoSuchFunction"));
        assert!(e.to_string().contains("libc.so.6"));
        assert!(!lib.has("fdpp_hipNoSuchFunction"));
        assert!(lib.has("strlen"));
    }

    #[test]
    fn a_found_symbol_is_callable() {
        let lib = Lib::open_first(&["libfdpp_missing.so".to_string(), "libc.so.6".to_string()]).unwrap();
        assert_eq!(lib.name, "libc.so.6");
        type Strlen = unsafe extern "C" fn(*const std::ffi::c_char) -> usize;
        // SAFETY: strlen's C signature; the argument is NUL-terminated.
        let n = unsafe { lib.sym::<Strlen>("strlen").unwrap()(c"gfx90a".as_ptr()) };
        assert_eq!(n, 6);
    }

    #[test]
    fn bare_names_come_last_in_the_candidates() {
        let c = candidates(&["libfdpp_x.so"]);
        assert_eq!(c.last().map(String::as_str), Some("libfdpp_x.so"));
    }
}
