//! Kernel launches through `cuLaunchKernelEx`, with programmatic dependent launch (PDL) on
//! Hopper and later.
//!
//! A decode step is a chain of ~10 kernels per layer, most of them a few microseconds long; each
//! boundary costs the launch, the ramp of the next grid and the tail of the last one. With the
//! programmatic-stream-serialization attribute the next kernel's blocks may start while the
//! previous one is still finishing: they prefetch what does not depend on it (the weights, which
//! nothing writes during generation) and then execute `griddepcontrol.wait` (`pdl_wait()` in
//! common.cuh), which returns once the previous grid has completed and its writes are visible.
//!
//! The rule that keeps this correct: a kernel launched with the attribute must call `pdl_wait()`
//! in every thread before it reads anything an earlier kernel wrote or writes anything at all.
//! Only the entry points audited for that are launched through [`Launch::chained`]; the others
//! (prefill, histograms, fill_random) use [`Launch::plain`], which serialises as usual.
//! `FDPP_PDL=0` turns the attribute off everywhere (the kernels' waits then return at once), for
//! A/B runs and as an escape hatch.

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, DeviceRepr, DriverError, LaunchConfig};

use super::CudaBackend;

/// Whether programmatic dependent launch is used on a device of compute capability `major`:
/// sm_90 and later, unless `FDPP_PDL=0`.
pub fn pdl_wanted(major: u32, env: Option<&str>) -> bool {
    major >= 9 && !matches!(env.map(str::trim), Some("0") | Some("off") | Some("false"))
}

/// The arguments of one launch, borrowed until it is made.
pub(crate) struct Launch<'a> {
    b: &'a CudaBackend,
    f: &'a CudaFunction,
    args: Vec<*mut c_void>,
    /// Byte size of each argument (a launch is folded into a decode graph's signature: graph.rs).
    sizes: Vec<usize>,
    pdl: bool,
    /// Blocks per thread-block cluster along x (1: no cluster attribute).
    cluster_x: u32,
}

impl<'a> Launch<'a> {
    /// A launch that may overlap the previous kernel (when the device and `FDPP_PDL` allow):
    /// only for entry points that call `pdl_wait()` before touching dependent memory.
    pub fn chained(b: &'a CudaBackend, f: &'a CudaFunction) -> Self {
        Launch {
            b,
            f,
            args: Vec::with_capacity(16),
            sizes: Vec::with_capacity(16),
            pdl: b.pdl(),
            cluster_x: 1,
        }
    }

    /// A launch that starts after everything queued before it has completed.
    pub fn plain(b: &'a CudaBackend, f: &'a CudaFunction) -> Self {
        Launch {
            pdl: false,
            ..Launch::chained(b, f)
        }
    }

    /// Launch the grid as clusters of `n` consecutive blocks along x (sm_90 and later; the grid's
    /// x must be a multiple of `n`, and `n` at most 8, the portable cluster size).
    pub fn cluster_x(&mut self, n: u32) -> &mut Self {
        self.cluster_x = n.max(1);
        self
    }

    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(v as *const T as *mut c_void);
        self.sizes.push(std::mem::size_of::<T>());
        self
    }

    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// pointer among them must cover what the kernel reads and writes for `cfg`.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.b.context().bind_to_thread()?;
        self.b.graphs.borrow_mut().record(|s| {
            s.fold_u64(self.f.cu_function() as u64);
            for d in [cfg.grid_dim, cfg.block_dim] {
                for v in [d.0, d.1, d.2] {
                    s.fold(&v.to_le_bytes());
                }
            }
            s.fold(&cfg.shared_mem_bytes.to_le_bytes());
            s.fold(&[u8::from(self.pdl)]);
            s.fold(&self.cluster_x.to_le_bytes());
            for (&a, &n) in self.args.iter().zip(&self.sizes) {
                s.fold_u64(n as u64);
                // SAFETY: `a` points at a live `T` of `n` bytes, borrowed for 'a by `arg`.
                s.fold(unsafe { std::slice::from_raw_parts(a as *const u8, n) });
            }
        });
        let mut attrs = Vec::with_capacity(3);
        if self.pdl {
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            });
        }
        if self.cluster_x > 1 {
            attrs.push(cluster_dim(self.cluster_x));
            // The driver's load-balancing placement: with its default one, clusters of 3-8
            // blocks ran up to 3 % slower than the same blocks unclustered at 4096 keys and
            // 16-33 % near a full wave (the H100, reports/NOTES.md, session 29).
            attrs.push(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    clusterSchedulingPolicyPreference:
                        sys::CUclusterSchedulingPolicy::CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING,
                },
            });
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.b.stream().cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: the caller vouches for the arguments; `attrs` and the argument values outlive
        // the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.f.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

/// The launch attribute of clusters of `n` blocks along x.
pub(crate) fn cluster_dim(n: u32) -> sys::CUlaunchAttribute {
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: n, y: 1, z: 1 },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdl_only_on_hopper_and_later_and_not_when_turned_off() {
        assert!(!pdl_wanted(8, None));
        assert!(pdl_wanted(9, None));
        assert!(pdl_wanted(10, Some("1")));
        for off in ["0", "off", "false", " 0 "] {
            assert!(!pdl_wanted(9, Some(off)), "{off}");
        }
    }
}
