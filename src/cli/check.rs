//! `fdpp check`: every kernel of every requested backend against the f64 reference.

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use super::Format;
use crate::backend::{open, probe_all, Backend, BackendChoice, BackendKind};
use crate::check::{
    attention_cases, attention_cases_quick, check_attention, check_gemm, check_layer, gemm_cases, gemm_cases_quick,
    layer_cases, layer_cases_quick, tally, AttnCheckRow, CheckRow, LayerCheckRow, Status,
};

/// `--backend` of `fdpp check`: one backend, `auto`, or `all` present on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, ValueEnum)]
pub enum CheckBackend {
    #[default]
    Auto,
    Cpu,
    Cuda,
    Rocm,
    /// The CPU and every GPU backend found available.
    All,
}

/// `--op` of `fdpp check`: which op families to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, ValueEnum)]
pub enum CheckOp {
    /// GEMM, attention and the small layer ops.
    #[default]
    All,
    Gemm,
    /// Decode and prefill attention, sync and async softmax.
    Attention,
    /// The small ops of a layer: embedding, add_rmsnorm, qkv_rope, silu_mul, kv_append,
    /// gather_rows, fill_random.
    Layer,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Op families to check. With `all`, md and csv print the GEMM table, the attention table
    /// and the layer-op table (separated by blank lines), and json one array holding every kind
    /// of row (each row names its `op`).
    #[arg(long, value_enum, default_value_t = CheckOp::All)]
    pub op: CheckOp,
    #[arg(long, value_enum, default_value_t = CheckBackend::Auto)]
    pub backend: CheckBackend,
    /// Device ordinal of a GPU backend.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
    /// The reduced case list (odd sizes only) instead of the full one.
    #[arg(long)]
    pub quick: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5EED)]
    pub seed: u64,
    /// Only the cases whose key contains this text (repeatable: any of them), e.g.
    /// `--case force=underflow`, `--case "decode bf16"`, `--case "f16 M=1 "`, `--case qkv_rope`.
    /// Keys: `f16 M=1 N=1000 K=4097` (GEMM), `decode f16 h8/kv2 d128 kv=[..]` (attention),
    /// `qkv_rope bf16 tokens=..` (layer ops). For re-running one case without the whole list.
    #[arg(long = "case", value_name = "TEXT")]
    pub cases: Vec<String>,
}

/// The key `--case` matches for a GEMM case.
pub fn gemm_case_key(c: &crate::check::GemmCase) -> String {
    format!("{} {}", c.dtype, c.dims.label())
}

/// The key `--case` matches for an attention case.
pub fn attn_case_key(c: &crate::check::AttnCase) -> String {
    let kind = match c.kind {
        crate::check::attention::AttnKind::Decode => "decode",
        crate::check::attention::AttnKind::Prefill => "prefill",
    };
    format!("{kind} {} {}", c.dtype, c.label())
}

/// The key `--case` matches for a layer-op case.
pub fn layer_case_key(c: &crate::check::LayerCase) -> String {
    format!("{} {} {}", c.op_name(), c.dtype, c.label())
}

/// Whether `key` is kept by the `--case` patterns (all are kept without one).
pub fn case_selected(patterns: &[String], key: &str) -> bool {
    patterns.is_empty() || patterns.iter().any(|p| key.contains(p.as_str()))
}

pub fn run(a: CheckArgs) -> anyhow::Result<()> {
    let choices = match a.backend {
        CheckBackend::Auto => vec![BackendChoice::Auto],
        CheckBackend::Cpu => vec![BackendChoice::Cpu],
        CheckBackend::Cuda => vec![BackendChoice::Cuda],
        CheckBackend::Rocm => vec![BackendChoice::Rocm],
        CheckBackend::All => all_available(),
    };
    let (gemm, attn, layer) = match a.op {
        CheckOp::All => (true, true, true),
        CheckOp::Gemm => (true, false, false),
        CheckOp::Attention => (false, true, false),
        CheckOp::Layer => (false, false, true),
    };
    let cases = match (gemm, a.quick) {
        (false, _) => vec![],
        (true, true) => gemm_cases_quick(),
        (true, false) => gemm_cases(),
    };
    let attn_cases = match (attn, a.quick) {
        (false, _) => vec![],
        (true, true) => attention_cases_quick(),
        (true, false) => attention_cases(),
    };
    let layer_cases = match (layer, a.quick) {
        (false, _) => vec![],
        (true, true) => layer_cases_quick(),
        (true, false) => layer_cases(),
    };
    let keep = |key: String| case_selected(&a.cases, &key);
    let cases: Vec<_> = cases.into_iter().filter(|c| keep(gemm_case_key(c))).collect();
    let attn_cases: Vec<_> = attn_cases.into_iter().filter(|c| keep(attn_case_key(c))).collect();
    let layer_cases: Vec<_> = layer_cases.into_iter().filter(|c| keep(layer_case_key(c))).collect();
    if !a.cases.is_empty() && cases.is_empty() && attn_cases.is_empty() && layer_cases.is_empty() {
        bail!(
            "--case {}: no case of the {} list matches",
            a.cases.join(" --case "),
            if a.quick { "quick" } else { "full" }
        );
    }
    let mut rows = Vec::new();
    let mut attn_rows = Vec::new();
    let mut layer_rows = Vec::new();
    for choice in choices {
        let (any, note) = open(choice, a.device).context("fdpp check: opening the backend")?;
        eprintln!("{note}");
        let got = crate::with_backend!(&any, b => check_backend(b, &cases, a.seed))?;
        rows.extend(got);
        let got = crate::with_backend!(&any, b => check_backend_attention(b, &attn_cases, a.seed))?;
        attn_rows.extend(got);
        let got = crate::with_backend!(&any, b => check_backend_layer(b, &layer_cases, a.seed))?;
        layer_rows.extend(got);
    }
    let tables = Tables {
        gemm: gemm.then_some(&rows[..]),
        attention: attn.then_some(&attn_rows[..]),
        layer: layer.then_some(&layer_rows[..]),
    };
    println!("{}", render_all(&tables, a.format)?);
    let (passed, failed, skipped) = add3(add3(tally(&rows), attn_tally(&attn_rows)), layer_tally(&layer_rows));
    eprintln!("{passed} passed, {failed} failed, {skipped} skipped");
    if failed > 0 {
        bail!("{failed} of {} checks failed", passed + failed);
    }
    Ok(())
}

/// The CPU, then each GPU backend that `probe_all` reports available.
fn all_available() -> Vec<BackendChoice> {
    let mut out = vec![BackendChoice::Cpu];
    for s in probe_all() {
        match s.backend {
            BackendKind::Cpu => {}
            BackendKind::Cuda if s.available => out.push(BackendChoice::Cuda),
            BackendKind::Rocm if s.available => out.push(BackendChoice::Rocm),
            BackendKind::Cuda | BackendKind::Rocm => {
                eprintln!(
                    "{}: skipped ({})",
                    s.backend,
                    s.reason.as_deref().unwrap_or("unavailable")
                )
            }
        }
    }
    out
}

/// Every case with the candidates the backend offers for its shape.
fn check_backend<B: Backend>(b: &B, cases: &[crate::check::GemmCase], seed: u64) -> anyhow::Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    for case in cases {
        let specs = b.gemm_candidates(case.dtype, case.dims.n, case.dims.k);
        let got = check_gemm(b, &specs, std::slice::from_ref(case), seed)
            .with_context(|| format!("{} gemm {} {}", b.info().backend, case.dtype, case.dims.label()))?;
        print_failures(
            got.iter()
                .map(|r| (&r.status, format!("{} {} {}", r.spec, r.dtype, r.dims.label()))),
        );
        rows.extend(got);
    }
    Ok(rows)
}

/// Every attention case (sync and async softmax) on one backend.
fn check_backend_attention<B: Backend>(
    b: &B,
    cases: &[crate::check::AttnCase],
    seed: u64,
) -> anyhow::Result<Vec<AttnCheckRow>> {
    if cases.is_empty() {
        return Ok(vec![]);
    }
    let rows = check_attention(b, cases, seed).with_context(|| format!("{} attention", b.info().backend))?;
    print_failures(rows.iter().map(|r| (&r.status, format!("{} {}", r.spec, r.case))));
    Ok(rows)
}

/// Every small layer-op case on one backend.
fn check_backend_layer<B: Backend>(
    b: &B,
    cases: &[crate::check::LayerCase],
    seed: u64,
) -> anyhow::Result<Vec<LayerCheckRow>> {
    if cases.is_empty() {
        return Ok(vec![]);
    }
    let rows = check_layer(b, cases, seed).with_context(|| format!("{} layer ops", b.info().backend))?;
    print_failures(rows.iter().map(|r| (&r.status, format!("{} {}", r.spec, r.case))));
    Ok(rows)
}

/// One stderr line per failed row, as the rows come (the table follows at the end).
fn print_failures<'a>(rows: impl Iterator<Item = (&'a Status, String)>) {
    for (status, what) in rows {
        if let (true, Some(reason)) = (status.is_fail(), status.reason()) {
            eprintln!("FAIL {what}: {reason}");
        }
    }
}

fn add3(a: (usize, usize, usize), b: (usize, usize, usize)) -> (usize, usize, usize) {
    (a.0 + b.0, a.1 + b.1, a.2 + b.2)
}

/// Counts of (passed, failed, skipped) attention rows.
fn attn_tally(rows: &[AttnCheckRow]) -> (usize, usize, usize) {
    rows.iter().fold((0, 0, 0), |(p, f, s), r| match r.status {
        Status::Pass => (p + 1, f, s),
        Status::Fail(_) => (p, f + 1, s),
        Status::Skipped(_) => (p, f, s + 1),
    })
}

/// Counts of (passed, failed, skipped) layer-op rows.
fn layer_tally(rows: &[LayerCheckRow]) -> (usize, usize, usize) {
    rows.iter().fold((0, 0, 0), |(p, f, s), r| match r.status {
        Status::Pass => (p + 1, f, s),
        Status::Fail(_) => (p, f + 1, s),
        Status::Skipped(_) => (p, f, s + 1),
    })
}

/// The rows of each op family that was checked (None: not asked for, no table).
struct Tables<'a> {
    gemm: Option<&'a [CheckRow]>,
    attention: Option<&'a [AttnCheckRow]>,
    layer: Option<&'a [LayerCheckRow]>,
}

/// The tables of the op families that were checked (see [`CheckArgs::op`]).
fn render_all(t: &Tables, format: Format) -> anyhow::Result<String> {
    if format == Format::Json {
        let mut all: Vec<serde_json::Value> = Vec::new();
        for r in t.gemm.unwrap_or_default() {
            all.push(serde_json::to_value(r)?);
        }
        for r in t.attention.unwrap_or_default() {
            all.push(serde_json::to_value(r)?);
        }
        for r in t.layer.unwrap_or_default() {
            all.push(serde_json::to_value(r)?);
        }
        return Ok(serde_json::to_string_pretty(&all)?);
    }
    let mut parts = Vec::new();
    if let Some(rows) = t.gemm {
        parts.push(render(rows, format)?);
    }
    if let Some(rows) = t.attention {
        parts.push(render_attention(rows, format)?);
    }
    if let Some(rows) = t.layer {
        parts.push(render_layer(rows, format)?);
    }
    Ok(parts.join("\n\n"))
}

/// Layer-op rows as md or csv (json goes through [`render_all`]).
fn render_layer(rows: &[LayerCheckRow], format: Format) -> anyhow::Result<String> {
    let num = |v: Option<f64>| v.map(|v| format!("{v:.3e}")).unwrap_or_else(|| "-".into());
    let count = |v: Option<usize>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    match format {
        Format::Json => Ok(serde_json::to_string_pretty(rows)?),
        Format::Csv => {
            let mut w = csv::Writer::from_writer(Vec::new());
            w.write_record([
                "backend",
                "op",
                "spec",
                "case",
                "dtype",
                "nmse",
                "max_rel_err",
                "mismatches",
                "status",
                "reason",
            ])?;
            for r in rows {
                w.write_record([
                    r.backend.name(),
                    &r.op,
                    &r.spec,
                    &r.case,
                    r.dtype.name(),
                    &num(r.nmse),
                    &num(r.max_rel_err),
                    &count(r.mismatches),
                    r.status.label(),
                    r.status.reason().unwrap_or(""),
                ])?;
            }
            Ok(String::from_utf8(w.into_inner()?)?.trim_end().to_string())
        }
        Format::Md => {
            let mut s = String::from(
                "| backend | spec | case | NMSE | max rel err | mismatches | status |\n\
                 |---|---|---|---:|---:|---:|---|\n",
            );
            for r in rows {
                let status = match r.status.reason() {
                    Some(reason) => format!("{}: {}", r.status.label(), reason.replace('|', "/")),
                    None => r.status.label().to_string(),
                };
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} |\n",
                    r.backend,
                    r.spec,
                    r.case,
                    num(r.nmse),
                    num(r.max_rel_err),
                    count(r.mismatches),
                    status
                ));
            }
            Ok(s.trim_end().to_string())
        }
    }
}

/// Attention rows as md or csv (json goes through [`render_all`]).
fn render_attention(rows: &[AttnCheckRow], format: Format) -> anyhow::Result<String> {
    let num = |v: Option<f64>| v.map(|v| format!("{v:.3e}")).unwrap_or_else(|| "-".into());
    let count = |v: Option<usize>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    match format {
        Format::Json => Ok(serde_json::to_string_pretty(rows)?),
        Format::Csv => {
            let mut w = csv::Writer::from_writer(Vec::new());
            w.write_record([
                "backend",
                "op",
                "spec",
                "case",
                "dtype",
                "scheme",
                "rows",
                "recomputed",
                "nmse",
                "max_rel_err",
                "status",
                "reason",
            ])?;
            for r in rows {
                w.write_record([
                    r.backend.name(),
                    &r.op,
                    &r.spec,
                    &r.case,
                    r.dtype.name(),
                    &r.scheme,
                    &count(r.rows),
                    &count(r.recomputed),
                    &num(r.nmse),
                    &num(r.max_rel_err),
                    r.status.label(),
                    r.status.reason().unwrap_or(""),
                ])?;
            }
            Ok(String::from_utf8(w.into_inner()?)?.trim_end().to_string())
        }
        Format::Md => {
            let mut s = String::from(
                "| backend | spec | case | recomputed / rows | NMSE | max rel err | status |\n\
                 |---|---|---|---:|---:|---:|---|\n",
            );
            for r in rows {
                let status = match r.status.reason() {
                    Some(reason) => format!("{}: {}", r.status.label(), reason.replace('|', "/")),
                    None => r.status.label().to_string(),
                };
                s.push_str(&format!(
                    "| {} | {} | {} | {} / {} | {} | {} | {} |\n",
                    r.backend,
                    r.spec,
                    r.case,
                    count(r.recomputed),
                    count(r.rows),
                    num(r.nmse),
                    num(r.max_rel_err),
                    status
                ));
            }
            Ok(s.trim_end().to_string())
        }
    }
}

fn render(rows: &[CheckRow], format: Format) -> anyhow::Result<String> {
    let num = |v: Option<f64>| v.map(|v| format!("{v:.3e}")).unwrap_or_else(|| "-".into());
    match format {
        Format::Json => Ok(serde_json::to_string_pretty(rows)?),
        Format::Csv => {
            let mut w = csv::Writer::from_writer(Vec::new());
            w.write_record([
                "backend",
                "op",
                "spec",
                "m",
                "n",
                "k",
                "dtype",
                "nmse",
                "max_rel_err",
                "status",
                "reason",
            ])?;
            for r in rows {
                w.write_record([
                    r.backend.name(),
                    &r.op,
                    &r.spec,
                    &r.dims.m.to_string(),
                    &r.dims.n.to_string(),
                    &r.dims.k.to_string(),
                    r.dtype.name(),
                    &num(r.nmse),
                    &num(r.max_rel_err),
                    r.status.label(),
                    r.status.reason().unwrap_or(""),
                ])?;
            }
            Ok(String::from_utf8(w.into_inner()?)?)
        }
        Format::Md => {
            let mut s = String::from(
                "| backend | op | spec | M | N | K | dtype | NMSE | max rel err | status |\n\
                 |---|---|---|---:|---:|---:|---|---:|---:|---|\n",
            );
            for r in rows {
                let status = match r.status.reason() {
                    Some(reason) => format!("{}: {}", r.status.label(), reason.replace('|', "/")),
                    None => r.status.label().to_string(),
                };
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    r.backend,
                    r.op,
                    r.spec,
                    r.dims.m,
                    r.dims.n,
                    r.dims.k,
                    r.dtype,
                    num(r.nmse),
                    num(r.max_rel_err),
                    status
                ));
            }
            Ok(s.trim_end().to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Status;
    use crate::dtype::DType;
    use crate::ops::gemm::GemmDims;

    fn rows() -> Vec<CheckRow> {
        let row = |spec: &str, status| CheckRow {
            backend: BackendKind::Cpu,
            op: "gemm".into(),
            spec: spec.into(),
            dims: GemmDims { m: 3, n: 1000, k: 4097 },
            dtype: DType::F16,
            nmse: Some(2.5e-8),
            max_rel_err: Some(1e-3),
            status,
        };
        vec![
            row("gemv_f16", Status::Pass),
            row("flat_gemm_f16_bn8", Status::Fail("NMSE 1e-2 > 1e-5, a|b".into())),
            row("gemm_f16", Status::Skipped("M too large".into())),
        ]
    }

    #[test]
    fn csv_has_a_header_and_one_line_per_row() {
        let s = render(&rows(), Format::Csv).expect("csv");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "backend,op,spec,m,n,k,dtype,nmse,max_rel_err,status,reason");
        assert_eq!(lines[1], "cpu,gemm,gemv_f16,3,1000,4097,f16,2.500e-8,1.000e-3,pass,");
        assert!(lines[2].ends_with(",fail,\"NMSE 1e-2 > 1e-5, a|b\""), "{}", lines[2]);
        assert!(lines[3].ends_with(",skipped,M too large"), "{}", lines[3]);
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn markdown_keeps_one_cell_per_column() {
        let s = render(&rows(), Format::Md).expect("md");
        for line in s.lines() {
            // 10 columns: 11 pipes, even when a reason holds one.
            assert_eq!(line.matches('|').count(), 11, "{line}");
        }
        assert!(s.contains("fail: NMSE"));
    }

    #[test]
    fn json_rows_are_flat() {
        let v: serde_json::Value = serde_json::from_str(&render(&rows(), Format::Json).expect("json")).expect("parse");
        assert_eq!(v[1]["status"], "fail");
        assert_eq!(v[1]["m"], 3);
        assert!(v[1]["reason"].as_str().is_some_and(|r| r.starts_with("NMSE")));
        assert!(v[0].get("reason").is_none());
    }

    #[test]
    fn attention_rows_render_in_every_format() {
        use crate::check::attention::AttnKind;
        let row = AttnCheckRow {
            backend: BackendKind::Cpu,
            op: "attention".into(),
            spec: "decode_async_f16".into(),
            kind: AttnKind::Decode,
            case: "h4/kv1 d128 kv=[97,1000] force=overflow".into(),
            dtype: DType::F16,
            scheme: "async(phi=0,a=-12,b=12)".into(),
            rows: Some(8),
            recomputed: Some(1),
            nmse: Some(5e-8),
            max_rel_err: Some(2e-4),
            status: Status::Pass,
        };
        let csv = render_attention(std::slice::from_ref(&row), Format::Csv).expect("csv");
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(
            lines[1].contains("\"h4/kv1 d128 kv=[97,1000] force=overflow\""),
            "{}",
            lines[1]
        );
        assert!(lines[1].contains(",8,1,"), "{}", lines[1]);
        let md = render_attention(std::slice::from_ref(&row), Format::Md).expect("md");
        for line in md.lines() {
            assert_eq!(line.matches('|').count(), 8, "{line}");
        }
        assert!(md.contains("| 1 / 8 |"));
        let gemm_rows = rows();
        let tables = Tables {
            gemm: Some(&gemm_rows),
            attention: Some(std::slice::from_ref(&row)),
            layer: None,
        };
        let all = render_all(&tables, Format::Json).expect("json");
        let v: serde_json::Value = serde_json::from_str(&all).expect("parse");
        assert_eq!(v.as_array().map(|a| a.len()), Some(4));
        assert_eq!(v[3]["op"], "attention");
        assert_eq!(v[3]["recomputed"], 1);
    }

    #[test]
    fn layer_rows_render_in_every_format() {
        let row = |spec: &str, status| LayerCheckRow {
            backend: BackendKind::Cpu,
            op: "layer".into(),
            spec: spec.into(),
            case: "rows=3 hidden=4097 +delta eps=1e-5".into(),
            dtype: DType::Bf16,
            nmse: Some(3e-6),
            max_rel_err: Some(4e-3),
            mismatches: Some(0),
            status,
        };
        let rows = vec![
            row("add_rmsnorm_bf16", Status::Pass),
            row(
                "gather_rows_bf16",
                Status::Fail("dst: 2 of 9 elements differ, a|b".into()),
            ),
        ];
        let csv = render_layer(&rows, Format::Csv).expect("csv");
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0],
            "backend,op,spec,case,dtype,nmse,max_rel_err,mismatches,status,reason"
        );
        assert_eq!(
            lines[1],
            "cpu,layer,add_rmsnorm_bf16,rows=3 hidden=4097 +delta eps=1e-5,bf16,3.000e-6,4.000e-3,0,pass,"
        );
        assert!(
            lines[2].ends_with(",fail,\"dst: 2 of 9 elements differ, a|b\""),
            "{}",
            lines[2]
        );
        let md = render_layer(&rows, Format::Md).expect("md");
        for line in md.lines() {
            assert_eq!(line.matches('|').count(), 8, "{line}");
        }
        let tables = Tables {
            gemm: None,
            attention: Some(&[]),
            layer: Some(&rows),
        };
        let v: serde_json::Value =
            serde_json::from_str(&render_all(&tables, Format::Json).expect("json")).expect("parse");
        assert_eq!(v.as_array().map(|a| a.len()), Some(2));
        assert_eq!(v[1]["op"], "layer");
        assert_eq!(v[1]["mismatches"], 0);
        assert_eq!(v[1]["status"], "fail");
        // md with two families: two tables, one blank line between them.
        let both = render_all(&tables, Format::Md).expect("md");
        assert_eq!(both.matches("| backend | spec | case |").count(), 2, "{both}");
    }
}
