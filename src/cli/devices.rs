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
    // Tensor parallelism on CUDA needs NCCL (loaded at run time, like the CUDA libraries).
    match crate::backend::cuda::nccl::Nccl::load() {
        Ok(n) => println!("nccl: available: {} (for --tp on CUDA)", n.describe()),
        Err(crate::error::FdppError::BackendUnavailable { reason, .. }) => println!("nccl: unavailable: {reason}"),
        Err(e) => println!("nccl: unavailable: {e}"),
    }
    Ok(())
}
