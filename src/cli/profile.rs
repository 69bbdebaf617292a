//! `fdpp profile show|check`: read a tuning profile, or compare it with this machine.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use serde::Serialize;

use super::Format;
use crate::backend::{self, Backend, BackendChoice, BackendKind, DeviceInfo};
use crate::error::FdppError;
use crate::ops::gemm::GemmImpl;
use crate::profile::{classify_mismatches, Measurement, Mismatch, Profile, Severity, ShapeProfile};
use crate::select::select_in;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(subcommand)]
    pub cmd: ProfileCmd,
}

#[derive(Subcommand, Debug)]
pub enum ProfileCmd {
    /// Provenance, M1/M2 per shape, and each implementation's best time per M with the choice.
    Show(ShowArgs),
    /// Compare the profile's machine with this one: refuse on a hard mismatch, warn on a soft one.
    Check(CheckArgs),
    /// Every profile on disk: device, model, shapes, softmax; with --model, which one it runs with.
    List(super::profile_list::ListArgs),
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    pub file: PathBuf,
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    pub file: PathBuf,
    /// Backend to compare with [default: the profile's own].
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Also check that the profile was made for this model's shapes.
    #[arg(long)]
    pub model: Option<String>,
    /// Compare with a device described in a file instead of this machine's: the JSON that
    /// `fdpp devices --format json` prints on the target machine (or one device object of it).
    /// Without it, a machine that lacks the profile's backend is compared on the kernels alone.
    #[arg(long)]
    pub against: Option<PathBuf>,
}

pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    match a.cmd {
        ProfileCmd::Show(s) => {
            let p = Profile::load(&s.file)?;
            print!("{}", render(&p, s.format)?);
            Ok(())
        }
        ProfileCmd::Check(c) => check(c),
        ProfileCmd::List(l) => super::profile_list::run(l),
    }
}

fn check(c: CheckArgs) -> anyhow::Result<()> {
    let p = Profile::load(&c.file)?;
    if let Some(m) = &c.model {
        p.check_model(&super::tune::load_model(m)?)?;
    }
    let choice = c.backend.unwrap_or(match p.provenance.backend {
        BackendKind::Cpu => BackendChoice::Cpu,
        BackendKind::Cuda => BackendChoice::Cuda,
        BackendKind::Rocm => BackendChoice::Rocm,
    });
    let kind = match choice {
        BackendChoice::Cpu => BackendKind::Cpu,
        BackendChoice::Cuda => BackendKind::Cuda,
        BackendChoice::Rocm => BackendKind::Rocm,
        BackendChoice::Auto => p.provenance.backend,
    };
    let (info, hash) = match &c.against {
        Some(file) => (device_from_file(file, kind, c.device)?, backend::kernel_hash_of(kind)),
        None => match backend::open(choice, c.device) {
            Ok((any, note)) => {
                eprintln!("{note}");
                crate::with_backend!(&any, b => (b.info().clone(), b.kernel_hash()))
            }
            Err(e) => return check_kernels_only(&c, &p, kind, &e.to_string()),
        },
    };
    let mismatches = classify_mismatches(&p.provenance, &info, &hash);
    let verdict = verdict(&mismatches);
    for m in &mismatches {
        let tag = match m.severity {
            Severity::Hard => "mismatch",
            Severity::Soft => "warning",
        };
        eprintln!("{tag}: {m}");
    }
    let target = match &c.against {
        Some(f) => format!("the device of {}", f.display()),
        None => "this machine".to_string(),
    };
    match verdict {
        Verdict::Refuse(why) => Err(anyhow::anyhow!(
            "{}: made on {} ({}) and does not fit {target} ({}): {why}; re-run `fdpp tune --model {}`",
            c.file.display(),
            p.provenance.device.name,
            p.provenance.device.arch,
            info.name,
            p.model.name
        )),
        Verdict::Warn => {
            println!("{}: usable on {target}, with the warnings above", c.file.display());
            Ok(())
        }
        Verdict::Ok => {
            println!("{}: matches {target} ({})", c.file.display(), info.name);
            Ok(())
        }
    }
}

/// The device to compare with, from `fdpp devices --format json` output (the `ordinal`-th device
/// of the `kind` backend) or from one device object.
fn device_from_file(file: &std::path::Path, kind: BackendKind, ordinal: usize) -> anyhow::Result<DeviceInfo> {
    let text = std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("--against {}: {e}", file.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "--against {}: not JSON ({e}); give `fdpp devices --format json` output",
            file.display()
        )
    })?;
    if v.is_object() {
        return serde_json::from_value(v)
            .map_err(|e| anyhow::anyhow!("--against {}: not a device description ({e})", file.display()));
    }
    let backends: Vec<crate::backend::BackendStatus> = serde_json::from_value(v).map_err(|e| {
        anyhow::anyhow!(
            "--against {}: neither `fdpp devices --format json` output nor a device ({e})",
            file.display()
        )
    })?;
    backends
        .into_iter()
        .find(|s| s.backend == kind)
        .and_then(|s| s.devices.into_iter().nth(ordinal))
        .ok_or_else(|| anyhow::anyhow!("--against {}: no {kind} device {ordinal} in it", file.display()))
}

/// No device of the profile's backend here: compare what this binary can, its kernels, and say
/// that the device itself was not compared.
fn check_kernels_only(c: &CheckArgs, p: &Profile, kind: BackendKind, why: &str) -> anyhow::Result<()> {
    let hash = backend::kernel_hash_of(kind);
    eprintln!(
        "note: no {kind} device here ({why}); comparing the kernels only (give --against FILE to compare a device)"
    );
    if hash != p.provenance.kernel_hash {
        anyhow::bail!(
            "{}: its kernels (hash {}) are not this build's ({hash}): refused on any machine; re-run `fdpp tune --model {}`",
            c.file.display(),
            p.provenance.kernel_hash,
            p.model.name
        );
    }
    println!(
        "{}: its kernels are this build's; usable on a machine with {} ({} {}), not checked here",
        c.file.display(),
        p.provenance.device.name,
        kind,
        p.provenance.device.arch
    );
    Ok(())
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    Warn,
    /// With the hard mismatches, joined.
    Refuse(String),
}

/// Hard mismatches refuse; soft ones only warn.
pub fn verdict(mismatches: &[Mismatch]) -> Verdict {
    let hard: Vec<String> = mismatches
        .iter()
        .filter(|m| m.severity == Severity::Hard)
        .map(|m| m.to_string())
        .collect();
    if !hard.is_empty() {
        Verdict::Refuse(hard.join("; "))
    } else if mismatches.is_empty() {
        Verdict::Ok
    } else {
        Verdict::Warn
    }
}

/// One row of `profile show`: each implementation's best time at a grid M and the choice.
#[derive(Serialize, Debug)]
struct Row {
    m: usize,
    gemv_us: Option<f64>,
    flat_gemm_us: Option<f64>,
    flat_gemm_block_n: Option<u32>,
    gemm_us: Option<f64>,
    /// "rejected" / "skipped" where an implementation has no time at this M.
    gemv_note: Option<&'static str>,
    flat_gemm_note: Option<&'static str>,
    gemm_note: Option<&'static str>,
    chosen: GemmImpl,
    chosen_block_n: Option<u32>,
    reason: String,
}

#[derive(Serialize, Debug)]
struct ShapeView {
    kind: String,
    k: usize,
    n: usize,
    m1: Option<usize>,
    m2: Option<usize>,
    rows: Vec<Row>,
}

/// Why an implementation has no verified time at M, if any candidate says so.
fn note(sp: &ShapeProfile, imp: GemmImpl, m: usize) -> Option<&'static str> {
    let mut out = None;
    for c in sp.candidates.iter().filter(|c| c.imp == imp) {
        match c.results.iter().find(|r| r.m() == m) {
            Some(Measurement::Rejected { .. }) => return Some("rejected"),
            Some(Measurement::Skipped { .. }) => out = Some("skipped"),
            _ => {}
        }
    }
    out
}

fn view(sp: &ShapeProfile) -> ShapeView {
    let rows = sp
        .m_grid
        .iter()
        .map(|&m| {
            let best = sp.best_at(m);
            let t = |imp| best.and_then(|b| b.get(imp)).map(|c| c.median_us);
            let plan = select_in(sp, m);
            Row {
                m,
                gemv_us: t(GemmImpl::Gemv),
                flat_gemm_us: t(GemmImpl::FlatGemm),
                flat_gemm_block_n: best.and_then(|b| b.get(GemmImpl::FlatGemm)).and_then(|c| c.block_n),
                gemm_us: t(GemmImpl::Gemm),
                gemv_note: t(GemmImpl::Gemv).map_or_else(|| note(sp, GemmImpl::Gemv, m), |_| None),
                flat_gemm_note: t(GemmImpl::FlatGemm).map_or_else(|| note(sp, GemmImpl::FlatGemm, m), |_| None),
                gemm_note: t(GemmImpl::Gemm).map_or_else(|| note(sp, GemmImpl::Gemm, m), |_| None),
                chosen: plan.imp,
                chosen_block_n: plan.block_n,
                reason: plan.reason,
            }
        })
        .collect();
    ShapeView {
        kind: sp.kind.name().into(),
        k: sp.k,
        n: sp.n,
        m1: sp.m1,
        m2: sp.m2,
        rows,
    }
}

fn point(v: Option<usize>) -> String {
    v.map_or("never".into(), |x| x.to_string())
}

fn cell(t: Option<f64>, bn: Option<u32>, note: Option<&str>) -> String {
    match (t, note) {
        (Some(t), _) => match bn {
            Some(bn) => format!("{t:.2} (bn{bn})"),
            None => format!("{t:.2}"),
        },
        (None, Some(n)) => n.to_string(),
        (None, None) => "-".into(),
    }
}

fn chosen(r: &Row) -> String {
    match r.chosen_block_n {
        Some(bn) => format!("{} (bn{bn})", r.chosen),
        None => r.chosen.to_string(),
    }
}

/// The profile for people (md), spreadsheets (csv) or programs (json).
pub fn render(p: &Profile, format: Format) -> crate::Result<String> {
    let shapes: Vec<ShapeView> = p.shapes.iter().map(view).collect();
    let pv = &p.provenance;
    let d = &pv.device;
    match format {
        Format::Json => {
            #[derive(Serialize)]
            struct Show<'a> {
                provenance: &'a crate::profile::Provenance,
                model: &'a str,
                dtype: crate::dtype::DType,
                rule: &'a str,
                shapes: &'a [ShapeView],
                softmax: Option<&'a crate::profile::SoftmaxSection>,
                #[serde(skip_serializing_if = "Option::is_none")]
                decode_pass: Option<&'a crate::profile::DecodePassSection>,
            }
            let s = Show {
                provenance: pv,
                model: &p.model.name,
                dtype: p.dtype,
                rule: &p.timing.rule,
                shapes: &shapes,
                softmax: p.softmax.as_ref(),
                decode_pass: p.decode_pass.as_ref(),
            };
            let mut j = serde_json::to_string_pretty(&s).map_err(|e| FdppError::InvalidArgument(e.to_string()))?;
            j.push('\n');
            Ok(j)
        }
        Format::Csv => {
            let mut w = csv::Writer::from_writer(Vec::new());
            let err = |e: csv::Error| FdppError::InvalidArgument(e.to_string());
            w.write_record([
                "shape",
                "k",
                "n",
                "m1",
                "m2",
                "m",
                "gemv_us",
                "flat_gemm_us",
                "flat_gemm_block_n",
                "gemm_us",
                "chosen",
                "chosen_block_n",
            ])
            .map_err(err)?;
            let f = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x:.3}"));
            let u = |v: Option<usize>| v.map_or(String::new(), |x| x.to_string());
            let b = |v: Option<u32>| v.map_or(String::new(), |x| x.to_string());
            for s in &shapes {
                for r in &s.rows {
                    w.write_record([
                        s.kind.clone(),
                        s.k.to_string(),
                        s.n.to_string(),
                        u(s.m1),
                        u(s.m2),
                        r.m.to_string(),
                        f(r.gemv_us),
                        f(r.flat_gemm_us),
                        b(r.flat_gemm_block_n),
                        f(r.gemm_us),
                        r.chosen.to_string(),
                        b(r.chosen_block_n),
                    ])
                    .map_err(err)?;
                }
            }
            let bytes = w.into_inner().map_err(|e| FdppError::InvalidArgument(e.to_string()))?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
        Format::Md => {
            let mut s = format!("# Profile: {} on {} ({})\n\n", p.model.name, d.name, p.dtype);
            s += &format!(
                "- device: {} (slug {}), backend {}, arch {}, {} compute units, {:.1} GiB memory, L2 {:.1} MiB\n",
                d.name,
                d.slug,
                pv.backend,
                d.arch,
                d.compute_units,
                d.memory_bytes as f64 / (1u64 << 30) as f64,
                d.l2_bytes as f64 / (1u64 << 20) as f64
            );
            s += &format!(
                "- driver {}, runtime {}\n",
                d.driver_version.as_deref().unwrap_or("-"),
                d.runtime_version.as_deref().unwrap_or("-")
            );
            s += &format!(
                "- fdpp {} (commit {}), kernel hash {}, created {}\n",
                pv.fdpp_version, pv.git_commit, pv.kernel_hash, pv.created
            );
            s += &format!(
                "- timing: {} warm-up, {} reps, {} verified columns; rule: {}\n",
                p.timing.warmup, p.timing.reps, p.timing.verify_cols, p.timing.rule
            );
            for v in &shapes {
                s += &format!(
                    "\n## {} [K={}, N={}]: M1 = {}, M2 = {}\n\n",
                    v.kind,
                    v.k,
                    v.n,
                    point(v.m1),
                    point(v.m2)
                );
                s += "| M | gemv µs | flat_gemm µs | gemm µs | chosen |\n|---:|---:|---:|---:|:---|\n";
                for r in &v.rows {
                    s += &format!(
                        "| {} | {} | {} | {} | {} |\n",
                        r.m,
                        cell(r.gemv_us, None, r.gemv_note),
                        cell(r.flat_gemm_us, r.flat_gemm_block_n, r.flat_gemm_note),
                        cell(r.gemm_us, None, r.gemm_note),
                        chosen(r)
                    );
                }
            }
            s += &softmax_md(p.softmax.as_ref());
            if let Some(dp) = &p.decode_pass {
                s += "\n## Decode attention pass\n\n```\n";
                for l in crate::tune::decode_pass::describe(dp) {
                    s += &l;
                    s.push('\n');
                }
                s += "```\n";
            }
            Ok(s)
        }
    }
}

/// The softmax section for people: the window, its coverage and samples, the validation, each
/// layer's window (FlashDecoding++ §3).
fn softmax_md(sm: Option<&crate::profile::SoftmaxSection>) -> String {
    let Some(sm) = sm else {
        return "\n## Softmax\n\nNo softmax section: the engine uses the default async window; \
                `fdpp tune --model <model> --calibrate` makes one.\n"
            .into();
    };
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("-".to_string(), f);
    let mut s = String::from("\n## Softmax\n\n");
    if sm.enabled {
        s += &format!(
            "- async: phi = {:.3}, a = {:.3}, b = {:.3}: window [phi+a, phi+b] = [{:.3}, {:.3}]\n",
            sm.phi,
            sm.a,
            sm.b,
            sm.phi + sm.a,
            sm.phi + sm.b
        );
    } else {
        s += &format!(
            "- async DISABLED: {} (the engine uses sync)\n",
            sm.reason.as_deref().unwrap_or("no reason recorded")
        );
    }
    s += &format!(
        "- coverage: {} of the scores inside (asked: {}); {} samples, min {}, max {}\n",
        opt(sm.coverage, &|c| format!("{:.5} %", c * 100.0)),
        opt(sm.target_coverage, &|c| format!("{:.4} %", c * 100.0)),
        sm.samples,
        opt(sm.min, &|v| format!("{v:.3}")),
        opt(sm.max, &|v| format!("{v:.3}"))
    );
    if let Some(src) = &sm.source {
        s += &format!("- calibrated on: {src}\n");
    }
    if sm.recompute_rate.is_some() || sm.validated_logit_diff.is_some() {
        s += &format!(
            "- held-out validation: recompute rate {}, async vs sync logits max diff {} (sync vs sync with \
             other prefill chunks: {}), greedy tokens {}\n",
            opt(sm.recompute_rate, &|r| format!("{:.4} %", r * 100.0)),
            opt(sm.validated_logit_diff, &|d| format!("{d:.2e}")),
            opt(sm.sync_noise_floor, &|d| format!("{d:.2e}")),
            match sm.validated_same_tokens {
                Some(true) => "the same",
                Some(false) => "DIFFER",
                None => "-",
            }
        );
    }
    if let Some(share) = sm.paper_range_share {
        s += &format!(
            "- {:.4} % of the scores inside FlashDecoding++'s Llama2-7B range [-16.8, 6.5] (the paper: > 99.99 %)\n",
            share * 100.0
        );
    }
    if !sm.comparison.is_empty() {
        let floor = sm.sync_noise_floor.unwrap_or(f64::NAN);
        s += "\nGlobal vs per-layer windows on the held-out prompts (the engine runs per-layer unless \
              softmax_windows=global):\n\n";
        s += &crate::cli::calibrate::comparison_table(&sm.comparison, floor, sm.async_rounding_floor);
    }
    if !sm.per_layer.is_empty() {
        s += "\n| layer | phi | a | b | window | coverage | samples | min | max |\n\
              |---:|---:|---:|---:|:---|---:|---:|---:|---:|\n";
        for l in &sm.per_layer {
            s += &format!(
                "| {} | {:.3} | {:.3} | {:.3} | [{:.3}, {:.3}]{} | {:.5} % | {} | {:.3} | {:.3} |\n",
                l.layer,
                l.phi,
                l.a,
                l.b,
                l.phi + l.a,
                l.phi + l.b,
                if l.reason.is_some() { " too wide" } else { "" },
                l.coverage * 100.0,
                l.samples,
                l.min,
                l.max
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mm(severity: Severity) -> Mismatch {
        Mismatch {
            severity,
            field: "arch",
            profile: "sm_90".into(),
            current: "sm_80".into(),
        }
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(&[]), Verdict::Ok);
        assert_eq!(verdict(&[mm(Severity::Soft)]), Verdict::Warn);
        match verdict(&[mm(Severity::Soft), mm(Severity::Hard)]) {
            Verdict::Refuse(why) => assert!(why.contains("sm_90") && why.contains("sm_80"), "{why}"),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn cells() {
        assert_eq!(cell(Some(1.234), Some(64), None), "1.23 (bn64)");
        assert_eq!(cell(Some(1.0), None, None), "1.00");
        assert_eq!(cell(None, None, Some("rejected")), "rejected");
        assert_eq!(cell(None, None, None), "-");
    }
}
