//! `fdpp kernels`: compile every kernel spec with NVRTC or hiprtc (no GPU needed) and list them.

use std::time::Instant;

use anyhow::bail;
use clap::{Args, Subcommand, ValueEnum};
use rayon::prelude::*;

use super::kernels_rocm as rocm_check;
use crate::backend::cuda::{jit, sources};
use crate::backend::rocm::sources as rocm_sources;

#[derive(Args, Debug)]
pub struct KernelsArgs {
    #[command(subcommand)]
    pub cmd: KernelsCmd,
}

#[derive(Subcommand, Debug)]
pub enum KernelsCmd {
    /// Compile every kernel spec for each arch (CUDA: NVRTC; ROCm: hiprtc, one child process per
    /// compile); fails if any does not compile.
    Check {
        /// Comma-separated targets [default: sm_80,sm_89,sm_90a for cuda, gfx90a for rocm].
        #[arg(long, value_delimiter = ',')]
        arch: Vec<String>,
        #[arg(long, value_enum, default_value_t = KernelBackend::Cuda)]
        backend: KernelBackend,
        /// Compile only the CUDA specs whose URI contains this text (e.g. `attn_prefill_hopper`),
        /// for a quick check of the kernel being edited; fails if none matches.
        #[arg(long)]
        only: Option<String>,
        /// Also write each CUDA CUBIN to DIR/<spec>.<arch>.cubin, to read its SASS with
        /// `nvdisasm` or `cuobjdump -sass` (no GPU needed).
        #[arg(long, value_name = "DIR")]
        emit: Option<std::path::PathBuf>,
        /// Also store each CUDA CUBIN in the kernel cache (FDPP_CACHE_DIR), where the first run
        /// of a command would compile it one spec at a time: here the compiles run one per core.
        /// Run-configuration switches that change a kernel's defines (`--set`) are not applied.
        #[arg(long)]
        fill_cache: bool,
    },
    /// List every kernel spec URI and the kernel source hash.
    List {
        #[arg(long, value_enum, default_value_t = KernelBackend::Cuda)]
        backend: KernelBackend,
    },
    /// Internal: compile one HIP spec with hiprtc in this process (run by `check --backend rocm`
    /// as a child, because ROCm 5.2's hiprtc aborts on targets it does not know).
    #[command(hide = true)]
    HiprtcChild {
        #[arg(long)]
        arch: String,
        #[arg(long)]
        uri: String,
    },
}

/// Which kernel set `kernels` works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KernelBackend {
    Cuda,
    Rocm,
}

pub fn run(a: KernelsArgs) -> anyhow::Result<()> {
    match a.cmd {
        KernelsCmd::List {
            backend: KernelBackend::Rocm,
        } => {
            println!("HIP kernel source hash: {}", rocm_sources::kernel_hash());
            for s in rocm_sources::all_sources() {
                let d: Vec<String> = s.defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!("{}  ({})", s.uri, d.join(" "));
            }
            Ok(())
        }
        KernelsCmd::List {
            backend: KernelBackend::Cuda,
        } => {
            println!("kernel source hash: {}", sources::kernel_hash());
            println!("Hopper GEMM hash (sm_90a profiles): {}", sources::hopper_gemm_hash());
            for s in sources::all_sources() {
                let d: Vec<String> = s.defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!("{}  ({})", s.uri, d.join(" "));
            }
            Ok(())
        }
        KernelsCmd::Check {
            arch,
            backend: KernelBackend::Cuda,
            only,
            emit,
            fill_cache,
        } => check(
            &or_default(arch, "sm_80,sm_89,sm_90a"),
            only.as_deref(),
            emit.as_deref(),
            fill_cache,
        ),
        KernelsCmd::Check {
            backend: KernelBackend::Rocm,
            only,
            emit,
            fill_cache,
            ..
        } if only.is_some() || emit.is_some() || fill_cache => {
            bail!("kernels check --only, --emit and --fill-cache work on the CUDA specs; drop them with --backend rocm")
        }
        KernelsCmd::Check {
            arch,
            backend: KernelBackend::Rocm,
            ..
        } => rocm_check::check(&or_default(arch, "gfx90a")),
        KernelsCmd::HiprtcChild { arch, uri } => rocm_check::child(&arch, &uri),
    }
}

fn or_default(arch: Vec<String>, default: &str) -> Vec<String> {
    if arch.is_empty() {
        default.split(',').map(String::from).collect()
    } else {
        arch
    }
}

fn check(archs: &[String], only: Option<&str>, emit: Option<&std::path::Path>, fill_cache: bool) -> anyhow::Result<()> {
    if let Some(dir) = emit {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("--emit {}: cannot create the directory: {e}", dir.display()))?;
    }
    if !jit::nvrtc_present() {
        bail!(
            "NVRTC (libnvrtc.so) not found: install the CUDA toolkit, or `pip install nvidia-cuda-nvrtc==13.0.88` \
             and put its nvidia/cu13/lib on LD_LIBRARY_PATH"
        );
    }
    println!(
        "NVRTC {}; kernel source hash {}; Hopper GEMM hash {}",
        jit::nvrtc_version().unwrap_or_default(),
        sources::kernel_hash(),
        sources::hopper_gemm_hash()
    );
    let srcs = sources::all_sources();
    // Arch-specific kernels (the sm_90a prefill) are skipped on the other archs.
    let jobs: Vec<(&String, &sources::KernelSource)> = archs
        .iter()
        .flat_map(|a| srcs.iter().filter(|s| sources::compiles_for(s, a)).map(move |s| (a, s)))
        .filter(|(_, s)| only.is_none_or(|o| s.uri.contains(o)))
        .collect();
    if let (Some(o), true) = (only, jobs.is_empty()) {
        bail!(
            "no CUDA kernel spec for {} matches --only {o:?}; `fdpp kernels list` shows the URIs",
            archs.join(",")
        );
    }
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
            Ok(c) => {
                println!("| {arch} | {} | ok | {} | {secs:.2} |", s.uri, c.len());
                if let Some(dir) = emit {
                    let path = dir.join(format!("{}.{arch}.cubin", s.uri));
                    if let Err(e) = std::fs::write(&path, &c) {
                        eprintln!("--emit: cannot write {}: {e}", path.display());
                        failed.push(format!("{} on {arch} (not written)", s.uri));
                    }
                }
                if fill_cache {
                    // The path the runtime looks up (jit::cubin_cached), keyed by text, defines
                    // and arch.
                    let stored = jit::cache_path(s, arch)
                        .ok_or_else(|| "no cache directory (HOME unset; set FDPP_CACHE_DIR)".to_string())
                        .and_then(|p| {
                            crate::profile::write_atomic(&p, &c).map_err(|e| format!("{}: {e}", p.display()))
                        });
                    if let Err(e) = stored {
                        eprintln!("--fill-cache: {} on {arch}: {e}", s.uri);
                        failed.push(format!("{} on {arch} (not cached)", s.uri));
                    }
                }
            }
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
            jobs.len(),
            failed.join(", ")
        );
    }
    println!("all {} kernel compiles succeeded", jobs.len());
    Ok(())
}
