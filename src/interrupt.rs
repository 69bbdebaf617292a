//! Ctrl-C for long sweeps (`fdpp tune`, `fdpp bench gemm`): the first SIGINT (or SIGTERM) sets a
//! flag that the sweep checks between its steps and between timed runs, so it stops within one
//! step, writes nothing and exits with 130; a second one ends the process at once (the handler
//! is installed with `SA_RESETHAND`). Every file fdpp writes goes through a temporary file and
//! a rename ([`crate::profile::write_atomic`]), so even the second Ctrl-C leaves no half file.
//!
//! Commands that do not install the handler keep the default disposition: Ctrl-C ends them.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{FdppError, Result};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Install the handler for SIGINT and SIGTERM (idempotent). Returns whether it was installed.
pub fn install() -> bool {
    let mut ok = true;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a plain handler that only stores to an atomic; the
        // mask is emptied before use, and the old action is not needed.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            ok &= libc::sigaction(sig, &act, std::ptr::null_mut()) == 0;
        }
    }
    ok
}

/// Whether an interruption was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// `Err(Interrupted)` once Ctrl-C was pressed; `what` names the work that stopped.
pub fn check(what: &str) -> Result<()> {
    if requested() {
        Err(FdppError::Interrupted(what.to_string()))
    } else {
        Ok(())
    }
}

/// For tests: as if Ctrl-C had been pressed (`true`), or clear it.
pub fn set_requested(v: bool) {
    REQUESTED.store(v, Ordering::SeqCst);
}

/// The exit status of a process ended by Ctrl-C (128 + SIGINT), as shells report it.
pub const EXIT_INTERRUPTED: i32 = 130;
