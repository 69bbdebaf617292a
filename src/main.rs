use clap::Parser;

fn main() {
    // Die quietly on a closed pipe (`fdpp ... | head`) as command-line tools do, instead of
    // panicking inside println!.
    // SAFETY: resetting a signal disposition at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = fdpp::cli::Cli::parse();
    if let Err(e) = fdpp::cli::run(cli) {
        eprintln!("error: {e:#}");
        // Ctrl-C of a sweep: the shell's status for an interrupted command.
        let interrupted = e.chain().any(|c| {
            matches!(
                c.downcast_ref::<fdpp::FdppError>(),
                Some(fdpp::FdppError::Interrupted(_))
            )
        });
        std::process::exit(if interrupted {
            fdpp::interrupt::EXIT_INTERRUPTED
        } else {
            1
        });
    }
}
