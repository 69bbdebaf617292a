//! `fdpp kernels`: compile every kernel spec with NVRTC (no GPU needed) and list them.

use std::time::Instant;

use anyhow::bail;
use clap::{Args, Subcommand};
use rayon::prelude::*;

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
    println!(
        "NVRTC {}; kernel source hash {}",
        jit::nvrtc_version().unwrap_or_default(),
        sources::kernel_hash()
    );
    let srcs = sources::all_sources();
    let jobs: Vec<(&String, &sources::KernelSource)> =
        archs.iter().flat_map(|a| srcs.iter().map(move |s| (a, s))).collect();
    // NVRTC compiles are independent: one per core.
    let results: Vec<_> = jobs
        .par_iter()
        .map(|(arch, s)| {
            let t = Instant::now();
            (arch, s, jit::compile_cubin(s, arch), t.elapsed().as_secs_f64())
        })
        .collect();
    let mut failed = vec![];
    println!("| arch | spec | result | cubin bytes | seconds |\n|---|---|---|---|---|");
    for (arch, s, r, secs) in results {
        match r {
            Ok(c) => println!("| {arch} | {} | ok | {} | {secs:.2} |", s.uri, c.len()),
            Err(e) => {
                println!("| {arch} | {} | FAILED | - | {secs:.2} |", s.uri);
                eprintln!("{e}");
                failed.push(format!("{} on {arch}", s.uri));
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} kernel compiles failed: {}",
            failed.len(),
            srcs.len() * archs.len(),
            failed.join(", ")
        );
    }
    println!("all {} kernel compiles succeeded", srcs.len() * archs.len());
    Ok(())
}
