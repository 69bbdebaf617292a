//! NCCL loaded at run time (issue #22 item 2), the way cudarc loads the CUDA libraries: the
//! binary builds and runs without NCCL, and `--tp` on CUDA finds libnccl.so.2 when it starts.
//! One thread per GPU in one process ([`crate::tp::ranks`]); each rank's communicator comes from
//! `ncclCommInitRank` over one unique id, and its collectives run on the rank's backend stream.
//!
//! Where the library is looked for: `$FDPP_NCCL_LIB` (a file), then the loader's own search
//! (LD_LIBRARY_PATH, ldconfig), then the `nvidia/nccl/lib` directory of the pip wheel
//! nvidia-nccl-cu12/13 that PyTorch installs, under the usual Python prefixes and the
//! environment of the `python3` on PATH.
//!
//! NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before the first
//! communicator is made, whatever the environment said (the device machines' KINDS.md: NVLS
//! needs the fabric manager's multicast objects, which these machines do not lend).
//!
//! The decode graph captures layers 1..'s all-reduces with their kernels (issue #22 item 2; NCCL
//! supports stream capture, and the backend's capture mode is thread-local, so ranks capture at
//! the same time); `--set tp_graphs=0` (FDPP_TP_GRAPHS=0) runs the collectives eagerly with
//! graphs off. On by default since session 14, after 4 × H200 gave --tp 1's tokens with it at 2
//! and 4 ranks and every run exited cleanly (reports/NOTES.md).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use libloading::Library;

use super::{CudaBackend, CudaBuffer};
use crate::backend::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::tp::Communicator;

/// The oldest NCCL with bf16 (ncclBfloat16 came in 2.10).
pub const MIN_VERSION: c_int = 21000;

type NcclResult = c_int;
type NcclComm = *mut c_void;

/// ncclUniqueId: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

// ncclDataType_t and ncclRedOp_t values (nccl.h).
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

/// The loaded library and the entry points fdpp calls.
pub struct Nccl {
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

fn unavailable(reason: String) -> FdppError {
    FdppError::BackendUnavailable {
        backend: "nccl",
        reason,
    }
}

/// Python prefixes under which pip puts `nvidia/nccl/lib/libnccl.so.2`.
fn wheel_candidates() -> Vec<PathBuf> {
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

/// The library names and paths tried, in order.
pub fn candidates() -> Vec<String> {
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os("FDPP_NCCL_LIB") {
        c.push(p.to_string_lossy().into_owned());
    }
    c.push("libnccl.so.2".into());
    c.extend(wheel_candidates().into_iter().map(|p| p.display().to_string()));
    c
}

/// A symbol of `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn sym<T: Copy>(lib: &Library, path: &str, name: &str) -> Result<T> {
    // SAFETY: the caller names the symbol's type; the pointer is copied out while `lib` lives
    // in the same `Nccl` as every copy.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| unavailable(format!("{path} has no {name}: {e}")))
}

impl Nccl {
    /// Load NCCL (see the module comment for where), check its version, and set
    /// NCCL_NVLS_ENABLE=0. Call it on the main thread before any rank starts.
    pub fn load() -> Result<Arc<Nccl>> {
        // NCCL reads the variable when a communicator is made; set before any rank thread
        // exists, so no other thread reads the environment meanwhile.
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
        let mut tried = Vec::new();
        for path in candidates() {
            // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
            match unsafe { Library::new(&path) } {
                Ok(lib) => return Self::from_lib(lib, path).map(Arc::new),
                Err(e) => tried.push(format!("{path} ({e})")),
            }
        }
        Err(unavailable(format!(
            "libnccl.so.2 not found; tried {}. Install NCCL (pip install nvidia-nccl-cu12 puts it under \
             site-packages/nvidia/nccl/lib) or set FDPP_NCCL_LIB to the file",
            tried.join(", ")
        )))
    }

    fn from_lib(lib: Library, path: String) -> Result<Nccl> {
        // SAFETY: the signature nccl.h declares for the symbol.
        let get_version = unsafe { sym::<GetVersion>(&lib, &path, "ncclGetVersion")? };
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { get_version(&mut version) };
        if r != 0 {
            return Err(unavailable(format!("{path}: ncclGetVersion failed ({r})")));
        }
        if version < MIN_VERSION {
            return Err(unavailable(format!(
                "{path} is NCCL {}, older than 2.10 (the first with bf16); install a newer one or set FDPP_NCCL_LIB",
                version_text(version)
            )));
        }
        // SAFETY: each type below is the signature nccl.h declares for the symbol.
        unsafe {
            Ok(Nccl {
                get_unique_id: sym::<GetUniqueId>(&lib, &path, "ncclGetUniqueId")?,
                comm_init_rank: sym::<CommInitRank>(&lib, &path, "ncclCommInitRank")?,
                all_reduce: sym::<AllReduce>(&lib, &path, "ncclAllReduce")?,
                broadcast: sym::<Broadcast>(&lib, &path, "ncclBroadcast")?,
                all_gather: sym::<AllGather>(&lib, &path, "ncclAllGather")?,
                comm_destroy: sym::<CommDestroy>(&lib, &path, "ncclCommDestroy")?,
                comm_abort: sym::<CommAbort>(&lib, &path, "ncclCommAbort")?,
                error_string: sym::<ErrorString>(&lib, &path, "ncclGetErrorString")?,
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
        // SAFETY: NCCL returns a static string for any result code.
        let text = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy();
        Err(FdppError::device("nccl", format!("{what}: {text} ({r})")))
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
            // pointer was registered by a rank whose NcclRank has not been dropped (it removes
            // itself first).
            let _ = unsafe { (nccl.comm_abort)(comm as NcclComm) };
        }
        self.comms.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One rank's NCCL communicator, bound to its backend's device and stream.
pub struct NcclRank {
    nccl: Arc<Nccl>,
    group: Arc<Group>,
    comm: NcclComm,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from the thread that owns the rank and aborted from
// another (ncclCommAbort is documented as safe for that); fdpp calls its collectives from the
// rank's own thread only.
unsafe impl Send for NcclRank {}
// SAFETY: as above; the shared state (the group) is behind mutexes.
unsafe impl Sync for NcclRank {}

impl NcclRank {
    /// Join the group of `id` as `rank` of `world` on `b`'s device. Every rank must call this
    /// at the same time (it returns when all have joined). `gate` is this rank's end of a host
    /// group of the same ranks: `b`'s decode-graph captures are fenced by it
    /// ([`super::graph`]'s `fenced`).
    pub fn init(
        nccl: Arc<Nccl>,
        group: Arc<Group>,
        b: &CudaBackend,
        id: UniqueId,
        (rank, world): (usize, usize),
        gate: crate::tp::HostComm,
    ) -> Result<Self> {
        // NCCL takes the device from the calling thread's current context.
        b.ctx.bind_to_thread().map_err(super::drv("cuCtxSetCurrent"))?;
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is passed by value.
        let r = unsafe { (nccl.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        nccl.check(&format!("ncclCommInitRank (rank {rank} of {world})"), r)?;
        group
            .comms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rank, comm as usize));
        b.graphs.borrow_mut().fence = Some(Box::new(move || {
            gate.all_reduce_bits(DType::F16, &mut [0])
                .map_err(|e| FdppError::device("cuda", format!("fence of a tensor-parallel graph capture: {e}")))
        }));
        Ok(NcclRank {
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

    fn dtype_of(buf: &CudaBuffer) -> c_int {
        match buf.dtype() {
            DType::F16 => NCCL_FLOAT16,
            DType::Bf16 => NCCL_BFLOAT16,
        }
    }

    fn bounds(&self, buf: &CudaBuffer, elems: usize) -> Result<()> {
        if elems > buf.len() {
            return Err(FdppError::Collective {
                rank: self.rank,
                msg: format!("a collective over {elems} elements of a buffer of {}", buf.len()),
            });
        }
        Ok(())
    }
}

impl Communicator<CudaBackend> for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, b: &CudaBackend, buf: &mut CudaBuffer, elems: usize) -> Result<()> {
        self.ready()?;
        self.bounds(buf, elems)?;
        let p = b.ptr(buf) as *mut c_void;
        // SAFETY: in place over `elems` elements of a live device buffer, on the rank's stream
        // (stream order serialises it with the GEMM that wrote it and the norm that reads it).
        let r = unsafe {
            (self.nccl.all_reduce)(
                p,
                p,
                elems,
                Self::dtype_of(buf),
                NCCL_SUM,
                self.comm,
                b.stream.cu_stream() as *mut c_void,
            )
        };
        self.nccl.check("ncclAllReduce", r)
    }

    fn broadcast(&self, b: &CudaBackend, buf: &mut CudaBuffer, elems: usize, root: usize) -> Result<()> {
        self.ready()?;
        self.bounds(buf, elems)?;
        let p = b.ptr(buf) as *mut c_void;
        // SAFETY: as all_reduce_sum.
        let r = unsafe {
            (self.nccl.broadcast)(
                p,
                p,
                elems,
                Self::dtype_of(buf),
                root as c_int,
                self.comm,
                b.stream.cu_stream() as *mut c_void,
            )
        };
        self.nccl.check("ncclBroadcast", r)
    }

    fn all_gather(&self, b: &CudaBackend, src: &CudaBuffer, dst: &mut CudaBuffer, elems: usize) -> Result<()> {
        self.ready()?;
        self.bounds(src, elems)?;
        self.bounds(dst, elems * self.world)?;
        if src.dtype() != dst.dtype() {
            return Err(FdppError::Collective {
                rank: self.rank,
                msg: format!("an all-gather from {:?} into {:?}", src.dtype(), dst.dtype()),
            });
        }
        let (s, d) = (b.ptr(src) as *const c_void, b.ptr(dst) as *mut c_void);
        // SAFETY: `elems` elements read from a live buffer, world × elems written to another
        // (bounds checked above), on the rank's stream, which orders it after the LM head's GEMM
        // and before the reads of the gathered logits.
        let r = unsafe {
            (self.nccl.all_gather)(
                s,
                d,
                elems,
                Self::dtype_of(src),
                self.comm,
                b.stream.cu_stream() as *mut c_void,
            )
        };
        self.nccl.check("ncclAllGather", r)
    }

    fn abort(&self, why: &str) {
        self.group.abort(&self.nccl, self.rank, why);
    }
}

impl Drop for NcclRank {
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
}
