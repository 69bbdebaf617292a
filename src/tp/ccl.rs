//! The NCCL API loaded at run time (issue #22 item 2): NCCL on CUDA, RCCL on ROCm (RCCL exports
//! the same `nccl*` entry points with the same C signatures and the same 128-byte unique id). The
//! binary builds and runs without either; `--tp` on a GPU finds the library when it starts, the
//! way cudarc and `backend/rocm/loader.rs` load the vendor libraries. One thread per GPU in one
//! process ([`crate::tp::ranks`]); each rank's communicator comes from `ncclCommInitRank` over one
//! unique id, and its collectives run on the rank's backend stream ([`CclBackend`]).
//!
//! Where each library is looked for ([`Flavor::candidates`]):
//! - NCCL: `$FDPP_NCCL_LIB` (a file), then the loader's own search (LD_LIBRARY_PATH, ldconfig),
//!   then the `nvidia/nccl/lib` directory of the pip wheel nvidia-nccl-cu12/13 that PyTorch
//!   installs, under the usual Python prefixes and the environment of the `python3` on PATH.
//! - RCCL: `$FDPP_RCCL_LIB`, then the loader's search for librccl.so.1 and librccl.so, then
//!   `$ROCM_PATH/lib` and /opt/rocm/lib.
//!
//! NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before the first communicator
//! is made, whatever the environment said (the device machines' KINDS.md: NVLS needs the fabric
//! manager's multicast objects, which these machines do not lend). RCCL ignores the variable.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use libloading::Library;

use crate::backend::{Backend, DeviceBuffer};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::tp::Communicator;

/// The oldest NCCL with bf16 (ncclBfloat16 came in 2.10; RCCL numbers its releases the same way).
pub const MIN_VERSION: c_int = 21000;

type NcclResult = c_int;
type NcclComm = *mut c_void;

/// ncclUniqueId: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

// ncclDataType_t and ncclRedOp_t values (nccl.h; rccl.h has the same).
const NCCL_FLOAT16: c_int = 6;
const NCCL_BFLOAT16: c_int = 9;
const NCCL_SUM: c_int = 0;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRank = unsafe extern "C" fn(*mut NcclComm, c_int, UniqueId, c_int) -> NcclResult;
type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult;
type Broadcast =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult;
type AllGather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, *mut c_void) -> NcclResult;
type CommDestroy = unsafe extern "C" fn(NcclComm) -> NcclResult;
type CommAbort = unsafe extern "C" fn(NcclComm) -> NcclResult;
type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;

/// Which library speaks the NCCL API here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// NCCL, for the CUDA backend.
    Nccl,
    /// RCCL, AMD's port of NCCL, for the ROCm backend.
    Rccl,
}

impl Flavor {
    /// The name errors and `fdpp devices` use ("nccl", "rccl").
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Nccl => "nccl",
            Flavor::Rccl => "rccl",
        }
    }

    /// The library file's name, what the loader is asked for first.
    fn lib_name(self) -> &'static str {
        match self {
            Flavor::Nccl => "libnccl.so.2",
            Flavor::Rccl => "librccl.so.1",
        }
    }

    /// The variable that names the library file.
    fn env(self) -> &'static str {
        match self {
            Flavor::Nccl => "FDPP_NCCL_LIB",
            Flavor::Rccl => "FDPP_RCCL_LIB",
        }
    }

    /// What to do when the library is missing.
    fn advice(self) -> &'static str {
        match self {
            Flavor::Nccl => {
                "Install NCCL (pip install nvidia-nccl-cu12 puts it under site-packages/nvidia/nccl/lib) \
                 or set FDPP_NCCL_LIB to the file"
            }
            Flavor::Rccl => {
                "Install ROCm's rccl package (it puts librccl.so.1 in /opt/rocm/lib) or set FDPP_RCCL_LIB to the file"
            }
        }
    }

    /// The library names and paths tried, in order.
    pub fn candidates(self) -> Vec<String> {
        let mut c = Vec::new();
        if let Some(p) = std::env::var_os(self.env()) {
            c.push(p.to_string_lossy().into_owned());
        }
        match self {
            Flavor::Nccl => {
                c.push(self.lib_name().into());
                c.extend(nccl_wheel_candidates().into_iter().map(|p| p.display().to_string()));
            }
            Flavor::Rccl => {
                c.push(self.lib_name().into());
                c.push("librccl.so".into());
                let mut roots: Vec<PathBuf> = std::env::var_os("ROCM_PATH").map(PathBuf::from).into_iter().collect();
                roots.push(PathBuf::from("/opt/rocm"));
                for r in roots {
                    let f = r.join("lib/librccl.so.1");
                    if f.is_file() {
                        c.push(f.display().to_string());
                    }
                }
            }
        }
        c.dedup();
        c
    }
}

fn unavailable(flavor: Flavor, reason: String) -> FdppError {
    FdppError::BackendUnavailable {
        backend: flavor.name(),
        reason,
    }
}

/// Python prefixes under which pip puts `nvidia/nccl/lib/libnccl.so.2`.
fn nccl_wheel_candidates() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    // The environment of the `python3` on PATH (a venv's bin/ beside its lib/): where PyTorch's
    // wheels put NCCL on a machine whose torch lives in a venv that is not activated.
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("python3").is_file() {
                if let Some(env) = dir.parent() {
                    roots.push(env.join("lib"));
                }
            }
        }
    }
    roots.dedup();
    let mut out = Vec::new();
    for root in roots {
        let Ok(rd) = std::fs::read_dir(&root) else { continue };
        let mut pythons: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            for site in ["site-packages", "dist-packages"] {
                let f = py.join(site).join("nvidia/nccl/lib/libnccl.so.2");
                if f.is_file() {
                    out.push(f);
                }
            }
        }
    }
    out
}

/// A symbol of `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn sym<T: Copy>(flavor: Flavor, lib: &Library, path: &str, name: &str) -> Result<T> {
    // SAFETY: the caller names the symbol's type; the pointer is copied out while `lib` lives
    // in the same `Nccl` as every copy.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| unavailable(flavor, format!("{path} has no {name}: {e}")))
}

/// The loaded library (NCCL or RCCL) and the entry points fdpp calls.
pub struct Nccl {
    flavor: Flavor,
    path: String,
    version: c_int,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    broadcast: Broadcast,
    all_gather: AllGather,
    comm_destroy: CommDestroy,
    comm_abort: CommAbort,
    error_string: ErrorString,
    /// Kept loaded while any function pointer above may be called.
    _lib: Library,
}

impl Nccl {
    /// Load NCCL (see the module comment for where), check its version, and set
    /// NCCL_NVLS_ENABLE=0. Call it on the main thread before any rank starts.
    pub fn load() -> Result<Arc<Nccl>> {
        Self::load_flavor(Flavor::Nccl)
    }

    /// Load RCCL, as [`load`](Self::load) loads NCCL.
    pub fn load_rccl() -> Result<Arc<Nccl>> {
        Self::load_flavor(Flavor::Rccl)
    }

    /// Load `flavor`'s library, as [`load`](Self::load) loads NCCL.
    pub fn load_flavor(flavor: Flavor) -> Result<Arc<Nccl>> {
        // NCCL reads the variable when a communicator is made; set before any rank thread
        // exists, so no other thread reads the environment meanwhile.
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
        let mut tried = Vec::new();
        let candidates = flavor.candidates();
        for path in &candidates {
            // SAFETY: loading the library runs its initialisers, which only set up its own state.
            match unsafe { Library::new(path) } {
                Ok(lib) => return Self::from_lib(flavor, lib, path.clone()).map(Arc::new),
                Err(e) => tried.push(format!("{path} ({e})")),
            }
        }
        Err(unavailable(
            flavor,
            format!(
                "{} not found; tried {}. {}",
                flavor.lib_name(),
                tried.join(", "),
                flavor.advice()
            ),
        ))
    }

    fn from_lib(flavor: Flavor, lib: Library, path: String) -> Result<Nccl> {
        // SAFETY: the signature nccl.h declares for the symbol.
        let get_version = unsafe { sym::<GetVersion>(flavor, &lib, &path, "ncclGetVersion")? };
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { get_version(&mut version) };
        if r != 0 {
            return Err(unavailable(flavor, format!("{path}: ncclGetVersion failed ({r})")));
        }
        if version < MIN_VERSION {
            return Err(unavailable(
                flavor,
                format!(
                    "{path} is {} {}, older than 2.10 (the first with bf16); install a newer one or set {}",
                    flavor.name().to_uppercase(),
                    version_text(version),
                    flavor.env()
                ),
            ));
        }
        // SAFETY: each type below is the signature nccl.h (and rccl.h) declares for the symbol.
        unsafe {
            Ok(Nccl {
                get_unique_id: sym::<GetUniqueId>(flavor, &lib, &path, "ncclGetUniqueId")?,
                comm_init_rank: sym::<CommInitRank>(flavor, &lib, &path, "ncclCommInitRank")?,
                all_reduce: sym::<AllReduce>(flavor, &lib, &path, "ncclAllReduce")?,
                broadcast: sym::<Broadcast>(flavor, &lib, &path, "ncclBroadcast")?,
                all_gather: sym::<AllGather>(flavor, &lib, &path, "ncclAllGather")?,
                comm_destroy: sym::<CommDestroy>(flavor, &lib, &path, "ncclCommDestroy")?,
                comm_abort: sym::<CommAbort>(flavor, &lib, &path, "ncclCommAbort")?,
                error_string: sym::<ErrorString>(flavor, &lib, &path, "ncclGetErrorString")?,
                flavor,
                path,
                version,
                _lib: lib,
            })
        }
    }

    /// `2.21.5 (/path/libnccl.so.2)`.
    pub fn describe(&self) -> String {
        format!("{} ({})", version_text(self.version), self.path)
    }

    fn check(&self, what: &str, r: NcclResult) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: the library returns a static string for any result code.
        let text = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy();
        Err(FdppError::device(self.flavor.name(), format!("{what}: {text} ({r})")))
    }

    /// The id every rank of one group joins with.
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }
}

/// NCCL's version code as text (2.x.y; codes before 2.9 were x·1000 + y·100 + z).
pub fn version_text(v: c_int) -> String {
    if v >= 20900 {
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
    }
}

/// The communicators of one group, so that a failing rank can abort them all (a rank waiting
/// in a collective for a dead peer would otherwise wait for ever).
#[derive(Default)]
pub struct Group {
    comms: Mutex<Vec<(usize, usize)>>,
    failed: Mutex<Option<(usize, String)>>,
}

impl Group {
    pub fn new() -> Arc<Group> {
        Arc::new(Group::default())
    }

    /// Abort every communicator of the group; every later collective fails with `why`.
    pub fn abort(&self, nccl: &Nccl, rank: usize, why: &str) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some((rank, why.to_string()));
        }
        drop(f);
        for &(_, comm) in self.comms.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            // SAFETY: ncclCommAbort may be called from any thread on a live communicator; the
            // pointer was registered by a rank whose CclRank has not been dropped (it removes
            // itself first).
            let _ = unsafe { (nccl.comm_abort)(comm as NcclComm) };
        }
        self.comms.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What a backend gives its rank's collectives: the device address of a buffer and the stream
/// (a `CUstream` or `hipStream_t`) they are ordered on.
pub trait CclBackend: Backend {
    fn ccl_ptr(&self, buf: &Self::Buffer) -> *mut c_void;
    fn ccl_stream(&self) -> *mut c_void;
}

/// One rank's communicator (NCCL or RCCL), bound to its backend's device and stream.
pub struct CclRank {
    nccl: Arc<Nccl>,
    group: Arc<Group>,
    comm: NcclComm,
    rank: usize,
    world: usize,
}

// SAFETY: a communicator may be used from the thread that owns the rank and aborted from another
// (ncclCommAbort is documented as safe for that); fdpp calls its collectives from the rank's own
// thread only.
unsafe impl Send for CclRank {}
// SAFETY: as above; the shared state (the group) is behind mutexes.
unsafe impl Sync for CclRank {}

impl CclRank {
    /// Join the group of `id` as `rank` of `world` on the device current on this thread (the
    /// caller makes its backend's device current first: the library takes it from there).
    /// Every rank must call this at the same time (it returns when all have joined).
    pub fn init(nccl: Arc<Nccl>, group: Arc<Group>, id: UniqueId, (rank, world): (usize, usize)) -> Result<Self> {
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is passed by value.
        let r = unsafe { (nccl.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        nccl.check(&format!("ncclCommInitRank (rank {rank} of {world})"), r)?;
        group
            .comms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rank, comm as usize));
        Ok(CclRank {
            nccl,
            group,
            comm,
            rank,
            world,
        })
    }

    fn ready(&self) -> Result<()> {
        match self.group.failure() {
            Some((by, why)) if by != self.rank => Err(FdppError::Collective {
                rank: self.rank,
                msg: format!("stopped because rank {by} failed: {why}"),
            }),
            Some((_, why)) => Err(FdppError::Collective {
                rank: self.rank,
                msg: format!("stopped: {why}"),
            }),
            None => Ok(()),
        }
    }

    fn dtype_of(buf: &impl DeviceBuffer) -> c_int {
        match buf.dtype() {
            DType::F16 => NCCL_FLOAT16,
            DType::Bf16 => NCCL_BFLOAT16,
        }
    }

    fn bounds(&self, buf: &impl DeviceBuffer, elems: usize) -> Result<()> {
        if elems > buf.len() {
            return Err(FdppError::Collective {
                rank: self.rank,
                msg: format!("a collective over {elems} elements of a buffer of {}", buf.len()),
            });
        }
        Ok(())
    }
}

impl<B: CclBackend> Communicator<B> for CclRank
where
    B::Buffer: DeviceBuffer,
{
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, b: &B, buf: &mut B::Buffer, elems: usize) -> Result<()> {
        self.ready()?;
        self.bounds(buf, elems)?;
        let p = b.ccl_ptr(buf);
        // SAFETY: in place over `elems` elements of a live device buffer, on the rank's stream
        // (stream order serialises it with the GEMM that wrote it and the norm that reads it).
        let r =
            unsafe { (self.nccl.all_reduce)(p, p, elems, Self::dtype_of(buf), NCCL_SUM, self.comm, b.ccl_stream()) };
        self.nccl.check("ncclAllReduce", r)
    }

    fn broadcast(&self, b: &B, buf: &mut B::Buffer, elems: usize, root: usize) -> Result<()> {
        self.ready()?;
        self.bounds(buf, elems)?;
        let p = b.ccl_ptr(buf);
        // SAFETY: as all_reduce_sum.
        let r = unsafe {
            (self.nccl.broadcast)(
                p,
                p,
                elems,
                Self::dtype_of(buf),
                root as c_int,
                self.comm,
                b.ccl_stream(),
            )
        };
        self.nccl.check("ncclBroadcast", r)
    }

    fn all_gather(&self, b: &B, src: &B::Buffer, dst: &mut B::Buffer, elems: usize) -> Result<()> {
        self.ready()?;
        self.bounds(src, elems)?;
        self.bounds(dst, elems * self.world)?;
        if src.dtype() != dst.dtype() {
            return Err(FdppError::Collective {
                rank: self.rank,
                msg: format!("an all-gather from {:?} into {:?}", src.dtype(), dst.dtype()),
            });
        }
        let (s, d) = (b.ccl_ptr(src) as *const c_void, b.ccl_ptr(dst));
        // SAFETY: `elems` elements read from a live buffer, world × elems written to another
        // (bounds checked above), on the rank's stream, which orders it after the LM head's GEMM
        // and before the reads of the gathered logits.
        let r = unsafe { (self.nccl.all_gather)(s, d, elems, Self::dtype_of(src), self.comm, b.ccl_stream()) };
        self.nccl.check("ncclAllGather", r)
    }

    fn abort(&self, why: &str) {
        self.group.abort(&self.nccl, self.rank, why);
    }
}

impl Drop for CclRank {
    fn drop(&mut self) {
        let mut comms = self.group.comms.lock().unwrap_or_else(|p| p.into_inner());
        let mine = comms.iter().position(|&(r, _)| r == self.rank);
        if let Some(i) = mine {
            comms.swap_remove(i);
            drop(comms);
            // SAFETY: the communicator is live (not aborted: abort clears the list) and no
            // other thread can reach it any more.
            let _ = unsafe { (self.nccl.comm_destroy)(self.comm) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_text(22105), "2.21.5");
        assert_eq!(version_text(2804), "2.8.4");
    }

    #[test]
    fn without_nccl_the_error_says_where_it_looked_and_what_to_do() {
        // CI has no NCCL; where it has one, loading must work and report a version.
        match Nccl::load() {
            Ok(n) => assert!(n.describe().starts_with("2.")),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("libnccl.so.2") && e.contains("FDPP_NCCL_LIB"), "{e}");
            }
        }
        assert_eq!(std::env::var("NCCL_NVLS_ENABLE").as_deref(), Ok("0"));
    }

    #[test]
    fn without_rccl_the_error_names_the_library_the_package_and_the_variable() {
        match Nccl::load_rccl() {
            Ok(n) => assert!(n.describe().starts_with("2.")),
            Err(e) => {
                let e = e.to_string();
                assert!(e.starts_with("rccl") || e.contains("rccl"), "{e}");
                assert!(
                    e.contains("librccl.so.1") && e.contains("FDPP_RCCL_LIB") && e.contains("rccl package"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn rccl_is_looked_for_under_its_own_names() {
        let c = Flavor::Rccl.candidates();
        assert!(
            c.iter().any(|p| p == "librccl.so.1") && c.iter().any(|p| p == "librccl.so"),
            "{c:?}"
        );
        assert!(!c.iter().any(|p| p.contains("nccl")), "{c:?}");
    }
}
