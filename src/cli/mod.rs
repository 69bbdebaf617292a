//! Command-line entry: one file per subcommand.

pub mod bench;
pub mod bench_attention;
pub mod bench_e2e;
pub mod calibrate;
pub mod check;
pub mod devices;
pub mod generate;
pub mod kernels;
pub mod kernels_rocm;
pub mod model_setup;
pub mod perplexity;
pub mod profile;
pub mod profile_list;
pub mod shapes;
pub mod tp;
pub mod tune;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "fdpp",
    version,
    about = "Benchmark and autotune LLM inference kernels (FlashDecoding++), and run prefill/decode with the tuned profile"
)]
#[command(after_long_help = crate::run_config::help())]
pub struct Cli {
    /// A run-configuration switch, NAME=VALUE (repeatable); `fdpp --help` lists them. Overrides
    /// the switch's FDPP_* environment variable.
    #[arg(long = "set", global = true, value_name = "NAME=VALUE")]
    pub set: Vec<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The four linear shapes [K, N] and the attention geometry of a model.
    Shapes(shapes::ShapesArgs),
    /// Every backend, whether it is available (and why not), and its devices.
    Devices(devices::DevicesArgs),
    /// Compile-check and list the GPU kernels (needs NVRTC, not a GPU).
    Kernels(kernels::KernelsArgs),
    /// Side-by-side benchmarks with tables, CSV/JSON and SVG charts.
    Bench(bench::BenchArgs),
    /// Check every kernel of a backend against the f64 reference (poison, guard, NMSE).
    Check(check::CheckArgs),
    /// Sweep the GEMM implementations over M for a model's shapes; write a profile and a report
    /// (--calibrate: choose the async softmax's φ, a, b instead).
    Tune(tune::TuneArgs),
    /// Show a tuning profile, or check it against this machine.
    Profile(profile::ProfileArgs),
    /// Prefill and decode a model with the tuned profile; stream text and report latencies.
    Generate(generate::GenerateArgs),
    /// Perplexity of a model on a text file, sync and async softmax side by side.
    Perplexity(perplexity::PerplexityArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    // Built once, before anything reads a switch.
    crate::run_config::init(crate::run_config::RunConfig::build(
        |v| std::env::var(v).ok(),
        &cli.set,
    )?)?;
    // The CPU threads' plan is part of the configuration: a bad count fails here, whatever
    // the command.
    crate::backend::cpu::pool::plan().map_err(anyhow::Error::msg)?;
    crate::backend::cpu::pool::start_workers();
    match cli.command {
        Command::Shapes(a) => shapes::run(a),
        Command::Devices(a) => devices::run(a),
        Command::Kernels(a) => kernels::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Check(a) => check::run(a),
        Command::Tune(a) => tune::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Perplexity(a) => perplexity::run(a),
    }
}

/// Output format of tables on stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    #[default]
    Md,
    Csv,
    Json,
}
