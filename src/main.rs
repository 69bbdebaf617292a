use clap::Parser;

fn main() {
    let cli = fdpp::cli::Cli::parse();
    if let Err(e) = fdpp::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
