use clap::Args;

use super::Format;
use crate::backend::probe_all;

#[derive(Args, Debug)]
pub struct DevicesArgs {
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
}

pub fn run(a: DevicesArgs) -> anyhow::Result<()> {
    let all = probe_all();
    if a.format == Format::Json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    for s in &all {
        match &s.reason {
            None => println!("{}: available", s.backend),
            Some(r) => println!("{}: unavailable: {r}", s.backend),
        }
        for d in &s.devices {
            println!(
                "  [{}] {} (arch {}, {} compute units, {:.1} GiB)",
                d.ordinal,
                d.name,
                d.arch,
                d.compute_units,
                d.memory_bytes as f64 / (1u64 << 30) as f64
            );
        }
    }
    // Which GPUs reach each other's memory directly (what the tp all-reduce travels over).
    if all
        .iter()
        .any(|s| s.backend == crate::backend::BackendKind::Cuda && s.devices.len() > 1)
    {
        match crate::backend::cuda::peer::peer_matrix() {
            Ok(m) => {
                println!("cuda peer access (row reads column):");
                for l in crate::backend::cuda::peer::matrix_lines(&m) {
                    println!("{l}");
                }
            }
            Err(e) => println!("cuda peer access: unknown ({e})"),
        }
    }
    // Tensor parallelism needs NCCL on CUDA and RCCL on ROCm (loaded at run time, like the
    // vendor libraries). RCCL is looked for only where a ROCm device is.
    use crate::tp::ccl::{Flavor, Nccl};
    let rocm = all
        .iter()
        .any(|s| s.backend == crate::backend::BackendKind::Rocm && s.reason.is_none());
    let flavors: &[(Flavor, &str)] = if rocm {
        &[(Flavor::Nccl, "CUDA"), (Flavor::Rccl, "ROCm")]
    } else {
        &[(Flavor::Nccl, "CUDA")]
    };
    for &(flavor, vendor) in flavors {
        let name = flavor.name();
        match Nccl::load_flavor(flavor) {
            Ok(n) => println!("{name}: available: {} (for --tp on {vendor})", n.describe()),
            Err(crate::error::FdppError::BackendUnavailable { reason, .. }) => {
                println!("{name}: unavailable: {reason}")
            }
            Err(e) => println!("{name}: unavailable: {e}"),
        }
    }
    Ok(())
}
