//! CUDA graphs for the decode step (issue #5): the layers after the first are captured once and
//! replayed, so the host queues one graph launch instead of ~10 launches per layer.
//!
//! Which launches a decode step makes depends on host data (batch, split count, table stride,
//! the activation slots, the GEMM chosen at this M). Every layer makes the same launches with
//! the same per-step arguments and its own weights and KV pools, so the first layer's launches
//! identify the rest: the engine runs layer 0 eagerly while this module folds every kernel
//! launch and GEMM call into a signature, then hands layers 1.. to [`Graphs::run`] under that
//! signature. The first time a signature is seen the layers run eagerly; the second time they
//! are captured (the graph is then launched); after that the graph is replayed.
//!
//! What makes a replay correct: the step's host arrays (block tables, positions, KV slots) are
//! uploaded by layer 0, eagerly, into the same device buffers the graph reads (their addresses
//! are part of the signature), and the later layers upload nothing (their arrays equal layer
//! 0's, so `Upload::put` skips them). A capture in which anything would be copied or allocated
//! fails instead ([`Graphs::capturing`] is checked by those paths), and the layers then run
//! eagerly; the signature is marked so that it is not captured again.
//!
//! `FDPP_GRAPHS=0` turns graphs off.

use std::collections::{HashMap, HashSet};

use cudarc::driver::{sys, CudaGraph};

use super::{drv, CudaBackend};
use crate::backend::GraphCounts;
use crate::error::{FdppError, Result};

/// Graphs kept at once; a new signature beyond this clears the cache (a decode run uses a few).
const MAX_GRAPHS: usize = 16;

/// A host barrier across the ranks of a tensor-parallel group (NCCL's [`super::nccl`]).
pub type Fence = Box<dyn Fn() -> Result<()>>;

/// FNV-1a over the bytes that decide a launch.
#[derive(Clone, Copy)]
pub struct Signature(u64);

impl Signature {
    fn new() -> Self {
        Signature(0xcbf2_9ce4_8422_2325)
    }

    pub fn fold(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    pub fn fold_u64(&mut self, v: u64) {
        self.fold(&v.to_le_bytes());
    }
}

pub struct Graphs {
    enabled: bool,
    /// Some while layer 0's launches are being folded.
    recording: Option<Signature>,
    capturing: bool,
    cache: HashMap<u64, CudaGraph>,
    seen: HashSet<u64>,
    /// Signatures whose capture failed: they run eagerly from then on.
    refused: HashSet<u64>,
    pub counts: GraphCounts,
    /// With tensor parallelism: every rank meets here, its device idle, before a capture and
    /// again before launching what it captured (see [`capture`]).
    pub fence: Option<Fence>,
}

/// Whether graphs are wanted: on unless `FDPP_GRAPHS` is 0, off or false.
pub fn graphs_wanted(env: Option<&str>) -> bool {
    !matches!(env.map(str::trim), Some("0") | Some("off") | Some("false"))
}

impl Graphs {
    pub fn new(enabled: bool) -> Self {
        Graphs {
            enabled,
            recording: None,
            capturing: false,
            cache: HashMap::new(),
            seen: HashSet::new(),
            refused: HashSet::new(),
            counts: GraphCounts::default(),
            fence: None,
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Inside a capture: uploads and allocations must not happen (they would be captured with
    /// this step's host data or addresses).
    pub fn capturing(&self) -> bool {
        self.capturing
    }

    /// Start folding launches into a signature.
    pub fn begin(&mut self) {
        self.recording = Some(Signature::new());
    }

    /// The signature of what was launched since [`begin`](Self::begin).
    pub fn end(&mut self) -> Option<u64> {
        self.recording.take().map(|s| s.0)
    }

    /// Fold a launch or call into the signature being recorded (no-op otherwise).
    pub fn record(&mut self, f: impl FnOnce(&mut Signature)) {
        if let Some(s) = self.recording.as_mut() {
            f(s);
        }
    }
}

/// The error a copy or allocation inside a capture returns (the capture is then abandoned).
pub fn in_capture(what: &str) -> FdppError {
    FdppError::device(
        "cuda",
        format!("{what} inside a CUDA graph capture: the captured layers must reuse layer 0's arrays"),
    )
}

/// Run `body` (the decode step's layers after the first) under signature `sig`: replay its graph,
/// capture one, or run eagerly (see the module comment).
pub fn run(b: &CudaBackend, sig: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
    let state = {
        let g = b.graphs.borrow();
        if !g.enabled || g.refused.contains(&sig) {
            None
        } else if g.cache.contains_key(&sig) {
            Some(true)
        } else {
            Some(false)
        }
    };
    match state {
        Some(true) => {
            let mut g = b.graphs.borrow_mut();
            g.counts.replayed += 1;
            let graph = g.cache.get(&sig).ok_or_else(|| in_capture("graph lookup"))?;
            graph.launch().map_err(drv("launching the decode graph"))
        }
        Some(false) if b.graphs.borrow().seen.contains(&sig) => capture(b, sig, body),
        _ => {
            let mut g = b.graphs.borrow_mut();
            g.seen.insert(sig);
            g.counts.eager += 1;
            drop(g);
            body()
        }
    }
}

/// With tensor parallelism, wait for this device's queued work, then for every rank (a no-op on
/// one GPU). A precaution: capturing NCCL collectives allocates (NCCL's persistent plans, the
/// graph's own memory), and NCCL's documentation warns that an allocation in a process whose
/// other GPUs run collectives can wait on them while their kernels wait on this rank. Fenced, no
/// rank allocates for a capture while any collective is in flight. Captures are rare (once per
/// signature), so the waits cost nothing measurable.
fn fenced(b: &CudaBackend) -> Result<()> {
    if b.graphs.borrow().fence.is_none() {
        return Ok(());
    }
    b.stream()
        .synchronize()
        .map_err(drv("synchronizing before a tensor-parallel capture"))?;
    let g = b.graphs.borrow();
    g.fence.as_ref().map_or(Ok(()), |f| f())
}

/// Wait for the device, then destroy every cached graph. With tensor parallelism, called before
/// the NCCL communicator is destroyed: a graph that captured collectives holds NCCL resources of
/// that communicator. Runs with `tp_graphs` at 2 and 4 ranks printed their results and then hung
/// at exit, where each rank destroyed its communicator before its graphs; with this order they
/// exit cleanly (4 × H200, session 14; reports/NOTES.md).
pub fn release(b: &CudaBackend) -> Result<()> {
    b.stream()
        .synchronize()
        .map_err(drv("synchronizing before releasing the decode graphs"))?;
    b.graphs.borrow_mut().cache.clear();
    Ok(())
}

fn capture(b: &CudaBackend, sig: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
    fenced(b)?;
    let stream = b.stream();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv("beginning a graph capture"))?;
    b.graphs.borrow_mut().capturing = true;
    let ran = body();
    b.graphs.borrow_mut().capturing = false;
    // The capture must be ended whatever happened inside it, or the stream stays in capture mode.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    // Every rank has instantiated (or abandoned) its graph before any launches one.
    fenced(b)?;
    let mut g = b.graphs.borrow_mut();
    match (ran, ended) {
        (Ok(()), Ok(Some(graph))) => {
            if g.cache.len() >= MAX_GRAPHS {
                g.cache.clear();
            }
            g.counts.captured += 1;
            graph.launch().map_err(drv("launching the decode graph"))?;
            g.cache.insert(sig, graph);
            Ok(())
        }
        (ran, ended) => {
            // Nothing was executed: run the layers eagerly, and never capture this signature
            // again. A real error shows up again in the eager run.
            if crate::run_config::get().set_on(crate::run_config::Key::GraphsDebug) {
                eprintln!(
                    "decode graph capture abandoned: body {ran:?}, end {:?}",
                    ended.as_ref().map(|o| o.is_some())
                );
            }
            g.refused.insert(sig);
            g.counts.eager += 1;
            drop(g);
            // A failed capture can leave a sticky "invalidated" status on the stream's last
            // call; the context itself stays usable.
            body()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_are_on_unless_turned_off() {
        assert!(graphs_wanted(None));
        assert!(graphs_wanted(Some("1")));
        for off in ["0", "off", "false", " 0 "] {
            assert!(!graphs_wanted(Some(off)), "{off}");
        }
    }

    #[test]
    fn a_signature_depends_on_every_byte_and_their_order() {
        let sig = |parts: &[&[u8]]| {
            let mut s = Signature::new();
            for p in parts {
                s.fold(p);
            }
            s.0
        };
        assert_eq!(sig(&[b"ab", b"c"]), sig(&[b"abc"]));
        assert_ne!(sig(&[b"abc"]), sig(&[b"acb"]));
        assert_ne!(sig(&[b"abc"]), sig(&[b"abd"]));
    }

    #[test]
    fn only_a_recording_folds() {
        let mut g = Graphs::new(true);
        g.record(|s| s.fold(b"x"));
        assert_eq!(g.end(), None);
        g.begin();
        g.record(|s| s.fold(b"x"));
        let a = g.end();
        g.begin();
        g.record(|s| s.fold(b"y"));
        assert_ne!(a, g.end());
    }
}
