use clap::Parser;

fn main() {
    // Die quietly on a closed pipe (`fdpp ... | head`) as command-line tools do, instead of
    // panicking inside println!.
    // SAFETY: resetting a signal disposition at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = fdpp::cli::Cli::parse();
    // The command runs on a thread of rayon's pool rather than beside it. The CPU backend's
    // every op is a parallel loop, a few tens of microseconds long at decode (about 300 per
    // token); called from outside the pool, each one is handed over to the workers while the
    // caller sleeps on a lock until they finish, two thread wake-ups per op that cost more than
    // some ops (measured: FDPP_OP_TIMES, perf). Called from a worker, the caller takes part in
    // the loop and only idle workers are woken. The workers get the main thread's stack size,
    // as the command now runs on one of them.
    let pool = rayon::ThreadPoolBuilder::new().stack_size(8 << 20).build_global();
    let result = match pool {
        Ok(()) => rayon::scope(|_| fdpp::cli::run(cli)),
        // Only if a global pool already exists, which nothing before this line makes.
        Err(_) => fdpp::cli::run(cli),
    };
    if let Err(e) = result {
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
