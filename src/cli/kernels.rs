//! `fdpp kernels`: compile every kernel spec with NVRTC (no GPU needed) and list them.

use std::time::Instant;

use anyhow::bail;
use clap::{Args, Subcommand};

use crate::backend::cuda::{jit, sources};

#[derive(Args, Debug)]
pub struct KernelsArgs {
    #[command(subcommand)]
    pub cmd: KernelsCmd,
}

#[derive(Subcommand, Debug)]
pub enum KernelsCmd {
    /// Compile every CUDA kernel spec for each arch with NVRTC; fails if any does not compile.
    Check {
        /// Comma-separated NVRTC targets.
        #[arg(long, value_delimiter = ',', default_value = "sm_80,sm_89,sm_90a")]
        arch: Vec<String>,
    },
    /// List every kernel spec URI and the kernel source hash.
    List,
}

pub fn run(a: KernelsArgs) -> anyhow::Result<()> {
    match a.cmd {
        KernelsCmd::List => {
            println!("kernel source hash: {}", sources::kernel_hash());
            for s in sources::all_sources() {
                let d: Vec<String> = s.defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!("{}  ({})", s.uri, d.join(" "));
            }
            Ok(())
        }
        KernelsCmd::Check { arch } => check(&arch),
    }
}

fn check(archs: &[String]) -> anyhow::Result<()> {
    if !jit::nvrtc_present() {
        bail!(
            "NVRTC (libnvrtc.so) not found: install the CUDA toolkit, or `pip install nvidia-cuda-nvrtc==13.0.88` \
             and put its nvidia/cu13/lib on LD_LIBRARY_PATH"
        );
    }
    println!("NVRTC {}; kernel source hash {}", jit::nvrtc_version().unwrap_or_default(), sources::kernel_hash());
    let srcs = sources::all_sources();
    let mut failed = vec![];
    println!("| arch | spec | result | cubin bytes | seconds |\n|---|---|---|---|---|");
    for arch in archs {
        for s in &srcs {
            let t = Instant::now();
            match jit::compile_cubin(s, arch) {
                Ok(c) => println!("| {arch} | {} | ok | {} | {:.2} |", s.uri, c.len(), t.elapsed().as_secs_f64()),
                Err(e) => {
                    println!("| {arch} | {} | FAILED | - | {:.2} |", s.uri, t.elapsed().as_secs_f64());
                    eprintln!("{e}");
                    failed.push(format!("{} on {arch}", s.uri));
                }
            }
        }
    }
    if !failed.is_empty() {
        bail!("{} of {} kernel compiles failed: {}", failed.len(), srcs.len() * archs.len(), failed.join(", "));
    }
    println!("all {} kernel compiles succeeded", srcs.len() * archs.len());
    Ok(())
}
