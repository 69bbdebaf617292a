//! `fdpp kernels check --backend rocm`: compile every HIP kernel spec with hiprtc, each compile in
//! a child process (this binary re-run with the hidden `kernels hiprtc-child` subcommand). ROCm
//! 5.2's hiprtc aborts the process on targets its LLVM does not know (gfx1100, gfx942); in a child
//! that abort is one failed row with the child's stderr, not the end of the check.

use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{bail, Context};
use rayon::prelude::*;

use crate::backend::rocm::{hiprtc, sources};

/// One compile's outcome as the parent sees it.
#[derive(Debug)]
pub enum ChildResult {
    Ok { bytes: usize },
    Failed { status: String, stderr: String },
}

/// Interpret a finished child: success is exit 0 with "bytes N" on stdout.
pub fn interpret(out: &Output) -> ChildResult {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        if let Some(n) = stdout
            .lines()
            .find_map(|l| l.strip_prefix("bytes ")?.trim().parse().ok())
        {
            return ChildResult::Ok { bytes: n };
        }
        return ChildResult::Failed {
            status: "exited 0 without a code object size".into(),
            stderr,
        };
    }
    let status = match out.status.code() {
        Some(c) => format!("exited with status {c}"),
        None => {
            use std::os::unix::process::ExitStatusExt;
            match out.status.signal() {
                Some(6) => "aborted (SIGABRT; ROCm 5.2's hiprtc does this on targets it cannot compile, e.g. gfx940 and gfx1100)".into(),
                Some(s) => format!("killed by signal {s}"),
                None => "ended without a status".into(),
            }
        }
    };
    ChildResult::Failed { status, stderr }
}

/// The child side: compile one spec in this process and print its size.
pub fn child(arch: &str, uri: &str) -> anyhow::Result<()> {
    let src = sources::all_sources()
        .into_iter()
        .find(|s| s.uri == uri)
        .with_context(|| format!("no HIP kernel spec named {uri}; see `fdpp kernels list --backend rocm`"))?;
    let co = hiprtc::compile_code_object(&src, arch)?;
    println!("bytes {}", co.len());
    Ok(())
}

pub fn check(archs: &[String]) -> anyhow::Result<()> {
    let api = hiprtc::api_or_unavailable()?;
    let exe = std::env::current_exe().context("cannot find this executable to run hiprtc children")?;
    println!(
        "hiprtc {} from {}; HIP kernel source hash {}",
        api.version().unwrap_or_default(),
        api.lib.name,
        sources::kernel_hash()
    );
    let srcs = sources::all_sources();
    let jobs: Vec<(&String, &sources::KernelSource)> =
        archs.iter().flat_map(|a| srcs.iter().map(move |s| (a, s))).collect();
    let results: Vec<_> = jobs
        .par_iter()
        .map(|(arch, s)| {
            let t = Instant::now();
            let r = Command::new(&exe)
                .args([
                    "kernels",
                    "hiprtc-child",
                    "--arch",
                    arch.as_str(),
                    "--uri",
                    s.uri.as_str(),
                ])
                .output()
                .map(|o| interpret(&o))
                .unwrap_or_else(|e| ChildResult::Failed {
                    status: format!("could not start {}: {e}", exe.display()),
                    stderr: String::new(),
                });
            (arch, s, r, t.elapsed().as_secs_f64())
        })
        .collect();
    let mut failed = vec![];
    println!("| arch | spec | result | code object bytes | seconds |\n|---|---|---|---|---|");
    for (arch, s, r, secs) in results {
        match r {
            ChildResult::Ok { bytes } => println!("| {arch} | {} | ok | {bytes} | {secs:.2} |", s.uri),
            ChildResult::Failed { status, stderr } => {
                println!("| {arch} | {} | FAILED | - | {secs:.2} |", s.uri);
                eprintln!("{} on {arch}: hiprtc child {status}\n{}", s.uri, tail(&stderr, 4000));
                failed.push(format!("{} on {arch}", s.uri));
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} HIP kernel compiles failed: {}",
            failed.len(),
            jobs.len(),
            failed.join(", ")
        );
    }
    println!("all {} HIP kernel compiles succeeded", jobs.len());
    Ok(())
}

/// The last `n` bytes of a log, cut at a character boundary.
fn tail(s: &str, n: usize) -> &str {
    let mut i = s.len().saturating_sub(n);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Output {
        Command::new("sh").args(["-c", script]).output().unwrap()
    }

    #[test]
    fn an_aborting_child_is_a_failed_row_with_its_stderr() {
        let r = interpret(&sh("echo 'LLVM ERROR: unknown target' >&2; kill -ABRT $$"));
        let ChildResult::Failed { status, stderr } = r else {
            panic!("an abort must be a failure");
        };
        assert!(status.contains("SIGABRT"), "{status}");
        assert!(stderr.contains("unknown target"), "{stderr}");
    }

    #[test]
    fn exit_codes_and_sizes_are_read_from_the_child() {
        assert!(matches!(
            interpret(&sh("echo 'bytes 4242'")),
            ChildResult::Ok { bytes: 4242 }
        ));
        let r = interpret(&sh("echo compile error >&2; exit 1"));
        assert!(matches!(r, ChildResult::Failed { ref status, .. } if status.contains("status 1")));
        let r = interpret(&sh("exit 0"));
        assert!(matches!(r, ChildResult::Failed { ref status, .. } if status.contains("without a code object")));
    }

    #[test]
    fn tails_cut_on_character_boundaries() {
        assert_eq!(tail("abcdef", 3), "def");
        assert_eq!(tail("ab", 10), "ab");
        assert_eq!(tail("xé", 1), "");
    }
}
