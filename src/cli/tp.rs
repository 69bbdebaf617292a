//! `--tp N [--devices 0,1,…]` of `generate` and `bench e2e` (issue #22 item 5): the checks
//! that need no device, then one thread per rank, each with its own backend (a CPU backend
//! over the shared core pool with the in-process communicator, a CUDA device with NCCL, or a
//! ROCm device with RCCL).

use std::sync::Arc;

use anyhow::bail;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::rocm::RocmBackend;
use crate::backend::{Backend, BackendChoice};
use crate::error::FdppError;
use crate::model::ModelConfig;
use crate::tp::ccl::{CclBackend, CclRank, Group, Nccl, UniqueId};
use crate::tp::fault::{FailAt, Failing};
use crate::tp::ranks::run_ranks;
use crate::tp::{Communicator, HostComm};

/// Where the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpKind {
    Cpu,
    Cuda,
    Rocm,
}

/// The ranks' backend for `--backend` (auto: CUDA, else ROCm, else the CPU, as for one device).
pub fn tp_kind(choice: BackendChoice) -> TpKind {
    match choice {
        BackendChoice::Cpu => TpKind::Cpu,
        BackendChoice::Cuda => TpKind::Cuda,
        BackendChoice::Rocm => TpKind::Rocm,
        BackendChoice::Auto if crate::backend::cuda::probe().available => TpKind::Cuda,
        BackendChoice::Auto if crate::backend::rocm::probe().available => TpKind::Rocm,
        BackendChoice::Auto => TpKind::Cpu,
    }
}

/// `--devices` as ordinals, one per rank, checked against the `visible` GPUs of `vendor`
/// ("CUDA", "ROCm").
pub fn check_devices(arg: Option<&str>, world: usize, visible: usize, vendor: &str) -> anyhow::Result<Vec<usize>> {
    let ids: Vec<usize> = match arg {
        None => (0..world).collect(),
        Some(s) => s
            .split(',')
            .map(|t| {
                let t = t.trim();
                t.parse::<usize>()
                    .map_err(|_| anyhow::anyhow!("--devices '{s}': '{t}' is not a device ordinal (0, 1, …)"))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    if ids.len() != world {
        bail!(
            "--devices lists {} GPU(s) for --tp {world}: give one device per rank",
            ids.len()
        );
    }
    for (i, d) in ids.iter().enumerate() {
        if ids[..i].contains(d) {
            bail!("--devices lists GPU {d} twice: each rank needs a GPU of its own");
        }
    }
    if let Some(d) = ids.iter().find(|&&d| d >= visible) {
        bail!(
            "--tp {world} on GPU(s) {}: GPU {d} is not visible, this machine shows {visible} {vendor} device(s) \
             ({} may hide others); lower --tp or pick visible --devices",
            ids.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","),
            if vendor == "ROCm" {
                "HIP_VISIBLE_DEVICES"
            } else {
                "CUDA_VISIBLE_DEVICES"
            }
        );
    }
    Ok(ids)
}

/// The work of one rank: the same for every rank, on its backend with its communicator.
pub trait RankJob: Sync {
    fn run<B: Backend>(&self, b: &B, comm: Arc<dyn Communicator<B>>) -> anyhow::Result<()>;
}

/// The device-free checks of `--tp`/`--devices`: the split (heads, KV heads, intermediate
/// size) and the devices. Returns where the ranks run and their devices.
pub fn prepare(
    cfg: &ModelConfig,
    world: usize,
    devices: Option<&str>,
    choice: BackendChoice,
) -> anyhow::Result<(TpKind, Vec<usize>)> {
    crate::tp::check(cfg, world)?;
    let kind = tp_kind(choice);
    let devices = match kind {
        TpKind::Cpu if devices.is_some() => {
            bail!("--devices picks GPUs; on the CPU every rank runs on the shared cores (drop --devices)")
        }
        TpKind::Cpu => vec![0; world],
        TpKind::Cuda => {
            let visible = crate::backend::cuda::probe::device_count()?;
            check_devices(devices, world, visible, "CUDA")?
        }
        TpKind::Rocm => {
            let visible = crate::backend::rocm::probe::device_count()?;
            check_devices(devices, world, visible, "ROCm")?
        }
    };
    Ok((kind, devices))
}

/// The rank's failure as the library error the driver ranks by (another rank's echo or not).
fn to_fdpp(rank: usize, e: anyhow::Error) -> FdppError {
    e.downcast::<FdppError>().unwrap_or_else(|e| FdppError::Collective {
        rank,
        msg: format!("{e:#}"),
    })
}

/// `comm`, made to fail where `--set tp_fail_at=RANK:N` says (a diagnostic).
fn with_fault<B: Backend + 'static>(comm: Arc<dyn Communicator<B>>, at: Option<FailAt>) -> Arc<dyn Communicator<B>> {
    match at {
        Some(at) => Arc::new(Failing::new(comm, at)),
        None => comm,
    }
}

/// Run `job` on `world` ranks: threads of this process, stopped together by the first failure.
pub fn run<J: RankJob>(kind: TpKind, devices: &[usize], job: &J) -> anyhow::Result<()> {
    let world = devices.len();
    let fail_at = crate::run_config::get()
        .get(crate::run_config::Key::TpFailAt)
        .map(FailAt::parse)
        .transpose()?;
    if let Some(at) = fail_at.filter(|at| at.rank >= world) {
        bail!("--set tp_fail_at={}:{}: there are only {world} ranks", at.rank, at.call);
    }
    match kind {
        TpKind::Cpu => {
            let comms = HostComm::group(world, crate::tp::host::timeout_from_env()?);
            let abort = |r: usize, why: &str| comms[r].fail(why);
            eprintln!("tensor parallel: {world} ranks as threads on the CPU (in-process all-reduce)");
            run_ranks(world, &abort, |rank| {
                let b = CpuBackend::new();
                let comm = with_fault(Arc::new(comms[rank].clone()), fail_at);
                job.run(&b, comm).map_err(|e| to_fdpp(rank, e))
            })?;
        }
        TpKind::Cuda => {
            let nccl = Nccl::load()?;
            eprintln!(
                "tensor parallel: {world} ranks on CUDA devices {devices:?}, NCCL {} (NCCL_NVLS_ENABLE=0)",
                nccl.describe()
            );
            let open = |rank: usize| CudaBackend::open(devices[rank]);
            let bind = |b: &CudaBackend, g: Arc<Group>, id, rank, gate: &HostComm| {
                crate::backend::cuda::nccl::init_rank(nccl.clone(), g, b, id, (rank, world), gate.clone())
            };
            // The decode graphs go before the communicator (backend/cuda/graph.rs `release`).
            run_gpu_ranks(
                &nccl,
                world,
                job,
                fail_at,
                open,
                bind,
                crate::backend::cuda::graph::release,
            )?;
        }
        TpKind::Rocm => {
            let rccl = Nccl::load_rccl()?;
            eprintln!(
                "tensor parallel: {world} ranks on ROCm devices {devices:?}, RCCL {}",
                rccl.describe()
            );
            let open = |rank: usize| RocmBackend::open(devices[rank]);
            let bind = |b: &RocmBackend, g: Arc<Group>, id, rank, _: &HostComm| {
                crate::backend::rocm::rccl::init_rank(rccl.clone(), g, b, id, (rank, world))
            };
            // ROCm has no decode graphs: nothing to release before the communicator.
            run_gpu_ranks(&rccl, world, job, fail_at, open, bind, |_: &RocmBackend| Ok(()))?;
        }
    }
    Ok(())
}

/// The GPU ranks of one NCCL/RCCL group: `open` a rank's backend on its thread, meet the other
/// ranks at a host barrier, `bind` the communicator, run the job, then `release` what must go
/// before the communicator. ncclCommInitRank waits for every rank and has no timeout: the
/// barrier first means that a rank that cannot open its GPU stops the others there instead of
/// leaving them in the library's init.
fn run_gpu_ranks<B, J, O, I, R>(
    lib: &Arc<Nccl>,
    world: usize,
    job: &J,
    fail_at: Option<FailAt>,
    open: O,
    bind: I,
    release: R,
) -> anyhow::Result<()>
where
    B: CclBackend + 'static,
    J: RankJob,
    O: Fn(usize) -> crate::error::Result<B> + Sync,
    I: Fn(&B, Arc<Group>, UniqueId, usize, &HostComm) -> crate::error::Result<CclRank> + Sync,
    R: Fn(&B) -> crate::error::Result<()> + Sync,
{
    let id = lib.unique_id()?;
    let group = Group::new();
    let gate = HostComm::group(world, crate::tp::host::timeout_from_env()?);
    let abort = |r: usize, why: &str| {
        gate[r].fail(why);
        group.abort(lib, r, why);
    };
    run_ranks(world, &abort, |rank| {
        let b = open(rank)?;
        gate[rank].all_reduce_bits(crate::dtype::DType::F16, &mut [0])?;
        let comm: Arc<dyn Communicator<B>> =
            with_fault(Arc::new(bind(&b, group.clone(), id, rank, &gate[rank])?), fail_at);
        let ran = job.run(&b, comm.clone()).map_err(|e| to_fdpp(rank, e));
        let released = release(&b);
        drop(comm);
        ran.and_then(|v| released.map(|()| v))
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_one_per_rank_distinct_and_visible() {
        assert_eq!(check_devices(None, 2, 4, "CUDA").unwrap(), vec![0, 1]);
        assert_eq!(check_devices(Some("3, 1"), 2, 4, "CUDA").unwrap(), vec![3, 1]);
        let e = check_devices(Some("0,1,2"), 2, 4, "CUDA").unwrap_err().to_string();
        assert!(e.contains("3 GPU(s) for --tp 2"), "{e}");
        let e = check_devices(Some("1,1"), 2, 4, "CUDA").unwrap_err().to_string();
        assert!(e.contains("GPU 1 twice"), "{e}");
        let e = check_devices(None, 4, 2, "CUDA").unwrap_err().to_string();
        assert!(e.contains("shows 2 CUDA device(s)") && e.contains("--tp 4"), "{e}");
        let e = check_devices(None, 4, 2, "ROCm").unwrap_err().to_string();
        assert!(
            e.contains("shows 2 ROCm device(s)") && e.contains("HIP_VISIBLE_DEVICES"),
            "{e}"
        );
        let e = check_devices(Some("0,x"), 2, 4, "CUDA").unwrap_err().to_string();
        assert!(e.contains("'x' is not a device ordinal"), "{e}");
    }
}
