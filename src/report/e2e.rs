//! Reports of `fdpp bench e2e`: one self-describing row per (configuration, profile, reuse),
//! the ratios measured in the same run (with the profile vs `--profile none`; activation bytes
//! with reuse vs without), and the md/csv/json/svg files.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chart::{line_chart_svg, LineChart, Series};
use super::write_atomic;
use crate::cli::Format;
use crate::engine::memory::gib;
use crate::error::{FdppError, Result};

/// Profile label of the rows run with vendor GEMM only.
pub const NO_PROFILE: &str = "none";
/// Profile label of the rows run with the tuned profile.
pub const WITH_PROFILE: &str = "profile";

/// Row kind: a configuration of the sweep, or the largest batch that fits.
pub const KIND_SWEEP: &str = "sweep";
pub const KIND_MAX_BATCH: &str = "max_batch";

/// Row status.
pub const STATUS_OK: &str = "ok";
pub const STATUS_NO_FIT: &str = "does not fit";
pub const STATUS_REFUSED: &str = "refused";
pub const STATUS_FAILED: &str = "failed";

/// One configuration run one way.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct E2eRecord {
    pub fdpp_version: String,
    pub git_commit: String,
    pub device: String,
    pub backend: String,
    pub model: String,
    pub dtype: String,
    /// sweep | max_batch
    pub kind: String,
    /// profile | none
    pub profile: String,
    /// The profile file of `profile` rows.
    pub profile_path: Option<String>,
    /// The softmax scheme with its parameters.
    pub softmax: String,
    /// Activation buffers reused across layers (false: `--no-reuse`).
    pub reuse: bool,
    pub batch: usize,
    pub prompt_len: usize,
    pub gen_len: usize,
    /// ok | does not fit | refused | failed
    pub status: String,
    /// Why the row has no timings.
    pub error: Option<String>,
    /// Time to first token: prefill of the whole batch until every sequence has its first token.
    pub ttft_ms: Option<f64>,
    /// Time per output token: the median decode step.
    pub tpot_ms: Option<f64>,
    /// batch / TPOT.
    pub decode_tok_s: Option<f64>,
    /// batch · gen_len over the whole run, prefill included.
    pub e2e_tok_s: Option<f64>,
    pub total_ms: Option<f64>,
    pub decode_steps: Option<usize>,
    pub attn_rows: Option<usize>,
    /// Attention rows the async softmax recomputed with the sync scheme.
    pub recomputed: Option<usize>,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub act_bytes: u64,
    /// Weights + KV + activations (from the memory plan; what a row that does not fit needs).
    pub peak_bytes: u64,
    /// The same step's activations with a buffer per op.
    pub act_bytes_no_reuse: u64,
    /// act_bytes / act_bytes_no_reuse (FlashDecoding++Next's buffer reuse; ≤ 0.8 is the goal).
    pub act_vs_no_reuse: f64,
    /// This row's decode tok/s over the `none` row's of the same configuration (same run).
    pub decode_vs_none: Option<f64>,
    /// The `none` row's TTFT over this row's.
    pub ttft_vs_none: Option<f64>,
}

impl E2eRecord {
    pub fn is_ok(&self) -> bool {
        self.status == STATUS_OK
    }

    /// The configuration a row measures: rows that share it differ only in the profile.
    fn config(&self) -> ConfigKey {
        (self.kind.clone(), self.batch, self.prompt_len, self.gen_len, self.reuse)
    }
}

fn usable(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite() && *x > 0.0)
}

/// (kind, batch, prompt_len, gen_len, reuse).
type ConfigKey = (String, usize, usize, usize, bool);

/// Fill `decode_vs_none` and `ttft_vs_none` from the `none` row of the same configuration.
pub fn annotate_e2e(records: &mut [E2eRecord]) {
    let base: Vec<(ConfigKey, Option<f64>, Option<f64>)> = records
        .iter()
        .filter(|r| r.profile == NO_PROFILE && r.is_ok())
        .map(|r| (r.config(), usable(r.decode_tok_s), usable(r.ttft_ms)))
        .collect();
    for r in records.iter_mut() {
        let key = r.config();
        let none = base.iter().find(|x| x.0 == key);
        r.decode_vs_none = match (none.and_then(|n| n.1), usable(r.decode_tok_s)) {
            (Some(n), Some(me)) if r.is_ok() => Some(me / n),
            _ => None,
        };
        r.ttft_vs_none = match (none.and_then(|n| n.2), usable(r.ttft_ms)) {
            (Some(n), Some(me)) if r.is_ok() => Some(n / me),
            _ => None,
        };
    }
}

/// Three significant digits (ms on an H100 are 0.0x–10, tok/s on the CPU a few).
fn sig3(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        return "–".into();
    }
    if a == 0.0 {
        return "0".into();
    }
    if a < 1e-3 {
        return format!("{v:.2e}");
    }
    let digits = (2 - a.log10().floor() as i32).clamp(0, 5) as usize;
    format!("{v:.digits$}")
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.filter(|x| x.is_finite()).map(f).unwrap_or_else(|| "–".into())
}

fn ratio(v: f64) -> String {
    format!("{v:.2}×")
}

fn profile_rank(p: &str) -> usize {
    match p {
        WITH_PROFILE => 0,
        NO_PROFILE => 1,
        _ => 2,
    }
}

/// Rows in presentation order: the sweep by (prompt_len, batch), then the largest batches.
fn sorted(records: &[E2eRecord]) -> Vec<&E2eRecord> {
    let mut rs: Vec<&E2eRecord> = records.iter().collect();
    rs.sort_by_key(|r| {
        (
            r.kind == KIND_MAX_BATCH,
            r.prompt_len,
            r.batch,
            r.gen_len,
            !r.reuse,
            profile_rank(&r.profile),
        )
    });
    rs
}

/// A padded markdown table, one row per record.
pub fn e2e_markdown(records: &[E2eRecord]) -> String {
    let header = [
        "batch",
        "prompt",
        "gen",
        "profile",
        "reuse",
        "TTFT ms",
        "TPOT ms",
        "decode tok/s",
        "e2e tok/s",
        "vs none",
        "peak mem",
        "act mem",
        "act vs no-reuse",
        "recomputed",
        "status",
    ];
    let mut rows = Vec::new();
    for r in sorted(records) {
        let batch = if r.kind == KIND_MAX_BATCH {
            format!("max {}", r.batch)
        } else {
            r.batch.to_string()
        };
        rows.push(vec![
            batch,
            r.prompt_len.to_string(),
            r.gen_len.to_string(),
            r.profile.clone(),
            if r.reuse { "yes".into() } else { "no".into() },
            opt(r.ttft_ms, sig3),
            opt(r.tpot_ms, sig3),
            opt(r.decode_tok_s, sig3),
            opt(r.e2e_tok_s, sig3),
            opt(r.decode_vs_none, ratio),
            gib(r.peak_bytes),
            gib(r.act_bytes),
            format!("{:.1}%", 100.0 * r.act_vs_no_reuse),
            match (r.recomputed, r.attn_rows) {
                (Some(n), Some(rows)) => format!("{n}/{rows}"),
                _ => "–".into(),
            },
            r.status.clone(),
        ]);
    }
    let numeric: Vec<bool> = header
        .iter()
        .map(|h| !matches!(*h, "profile" | "reuse" | "status" | "recomputed"))
        .collect();
    super::md::padded_table(&header, &numeric, &rows)
}

/// The highest decode throughput among the `max_batch` rows (else all rows), as a sentence.
pub fn highest_throughput(records: &[E2eRecord]) -> Option<String> {
    let best = |kind: Option<&str>| {
        records
            .iter()
            .filter(|r| r.is_ok() && kind.is_none_or(|k| r.kind == k))
            .filter_map(|r| usable(r.decode_tok_s).map(|t| (t, r)))
            .max_by(|a, b| a.0.total_cmp(&b.0))
    };
    let (t, r) = best(Some(KIND_MAX_BATCH)).or_else(|| best(None))?;
    Some(format!(
        "highest achievable throughput: {} decode tok/s at batch {} (prompt {}, gen {}, {}{}){}",
        sig3(t),
        r.batch,
        r.prompt_len,
        r.gen_len,
        if r.profile == WITH_PROFILE {
            "with the profile"
        } else {
            "vendor GEMM only"
        },
        if r.reuse { "" } else { ", no reuse" },
        if r.kind == KIND_MAX_BATCH {
            ", the largest batch that fits"
        } else {
            "; no --max-batch-search row, so the best row of the sweep"
        }
    ))
}

pub fn e2e_csv(records: &[E2eRecord]) -> Result<String> {
    let mut w = ::csv::Writer::from_writer(Vec::new());
    for r in records {
        w.serialize(r).map_err(|e| {
            FdppError::InvalidArgument(format!(
                "CSV row for batch {} prompt {} {}: {e}",
                r.batch, r.prompt_len, r.profile
            ))
        })?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| FdppError::InvalidArgument(format!("CSV buffer: {e}")))?;
    String::from_utf8(bytes).map_err(|e| FdppError::InvalidArgument(format!("CSV text: {e}")))
}

pub fn e2e_json(records: &[E2eRecord]) -> Result<String> {
    let mut s =
        serde_json::to_string_pretty(records).map_err(|e| FdppError::InvalidArgument(format!("JSON report: {e}")))?;
    s.push('\n');
    Ok(s)
}

pub fn parse_e2e_csv(text: &str, origin: &Path) -> Result<Vec<E2eRecord>> {
    let mut rd = ::csv::Reader::from_reader(text.as_bytes());
    rd.deserialize()
        .enumerate()
        .map(|(i, row)| row.map_err(|e| FdppError::io(origin, format!("CSV data row {}: {e}", i + 1))))
        .collect()
}

/// The rows as a table for stdout.
pub fn e2e_table(records: &[E2eRecord], format: Format) -> Result<String> {
    match format {
        Format::Md => Ok(e2e_markdown(records)),
        Format::Csv => e2e_csv(records),
        Format::Json => e2e_json(records),
    }
}

/// Decode tok/s against batch: one line per (prompt_len, profile) — and per reuse when both
/// were run — so the profile's effect reads as the gap between two lines of one hue.
pub fn e2e_chart_svg(title: &str, records: &[E2eRecord]) -> Result<Option<String>, String> {
    let ok: Vec<&E2eRecord> = records.iter().filter(|r| r.is_ok()).collect();
    let Some(first) = ok.first() else {
        return Ok(None);
    };
    let both_reuse = ok.iter().any(|r| r.reuse) && ok.iter().any(|r| !r.reuse);
    let keys: BTreeSet<(usize, usize, bool, String)> = ok
        .iter()
        .map(|r| (r.prompt_len, profile_rank(&r.profile), !r.reuse, r.profile.clone()))
        .collect();
    let series = keys
        .iter()
        .map(|(prompt_len, _, no_reuse, profile)| {
            let mut points: Vec<(f64, f64)> = ok
                .iter()
                .filter(|r| r.prompt_len == *prompt_len && r.reuse != *no_reuse && &r.profile == profile)
                .filter_map(|r| usable(r.decode_tok_s).map(|t| (r.batch as f64, t)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            points.dedup_by(|a, b| a.0 == b.0);
            Series {
                label: format!(
                    "prompt {prompt_len}, {profile}{}",
                    if both_reuse && *no_reuse { ", no reuse" } else { "" }
                ),
                family: format!("prompt {prompt_len}"),
                points,
            }
        })
        .collect();
    let caption = format!(
        "e2e decode throughput, {} {} on {}",
        first.model, first.dtype, first.device
    );
    let chart = LineChart {
        caption: &caption,
        subtitle: title,
        x_desc: "batch (sequences decoded together), log2 scale",
        y_desc: "decode tok/s (batch / median step time)",
        series,
        hlines: Vec::new(),
    };
    line_chart_svg(&chart)
}

/// The files one `bench e2e` run writes.
#[derive(Clone, Debug, Default)]
pub struct E2eReportFiles {
    pub md: PathBuf,
    pub csv: PathBuf,
    pub json: PathBuf,
    /// None when no row had a usable throughput to plot.
    pub svg: Option<PathBuf>,
}

impl E2eReportFiles {
    pub fn all(&self) -> Vec<&Path> {
        let mut v = vec![self.md.as_path(), self.csv.as_path(), self.json.as_path()];
        v.extend(self.svg.as_deref());
        v
    }
}

/// Writes `<dir>/<stem>.{md,csv,json,svg}`; `title` heads the markdown file and subtitles the chart.
pub fn write_e2e_report(dir: &Path, stem: &str, title: &str, records: &[E2eRecord]) -> Result<E2eReportFiles> {
    std::fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, format!("cannot create the report directory: {e}")))?;
    let files = E2eReportFiles {
        md: dir.join(format!("{stem}.md")),
        csv: dir.join(format!("{stem}.csv")),
        json: dir.join(format!("{stem}.json")),
        svg: None,
    };
    let best = highest_throughput(records)
        .map(|s| format!("\n{s}.\n"))
        .unwrap_or_default();
    let md = format!(
        "# {title}\n\n{}{best}\nTTFT: prefill of the whole batch until every sequence has its first token. \
         TPOT: the median decode step. decode tok/s = batch / TPOT; e2e tok/s = batch · gen / total time. \
         `vs none`: decode tok/s over the `--profile none` row of the same configuration, same run. \
         Memory from the plan: peak = weights + KV + activations.\n",
        e2e_markdown(records)
    );
    write_atomic(&files.md, md.as_bytes())?;
    write_atomic(&files.csv, e2e_csv(records)?.as_bytes())?;
    write_atomic(&files.json, e2e_json(records)?.as_bytes())?;
    let svg_path = dir.join(format!("{stem}.svg"));
    let svg = e2e_chart_svg(title, records).map_err(|e| FdppError::io(&svg_path, e))?;
    let svg = match svg {
        Some(text) => {
            write_atomic(&svg_path, text.as_bytes())?;
            Some(svg_path)
        }
        None => None,
    };
    Ok(E2eReportFiles { svg, ..files })
}

impl E2eRecord {
    /// A filled-in row (for tests).
    pub fn example() -> Self {
        E2eRecord {
            fdpp_version: crate::VERSION.into(),
            git_commit: "0000000".into(),
            device: "example".into(),
            backend: "cpu".into(),
            model: "tiny".into(),
            dtype: "f16".into(),
            kind: KIND_SWEEP.into(),
            profile: NO_PROFILE.into(),
            profile_path: None,
            softmax: "sync".into(),
            reuse: true,
            batch: 1,
            prompt_len: 8,
            gen_len: 4,
            status: STATUS_OK.into(),
            error: None,
            ttft_ms: Some(2.0),
            tpot_ms: Some(1.0),
            decode_tok_s: Some(1000.0),
            e2e_tok_s: Some(800.0),
            total_ms: Some(5.0),
            decode_steps: Some(3),
            attn_rows: Some(100),
            recomputed: Some(0),
            weights_bytes: 1 << 20,
            kv_bytes: 1 << 16,
            act_bytes: 1 << 12,
            peak_bytes: (1 << 20) + (1 << 16) + (1 << 12),
            act_bytes_no_reuse: 1 << 14,
            act_vs_no_reuse: 0.25,
            decode_vs_none: None,
            ttft_vs_none: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(profile: &str, batch: usize, tpot: f64) -> E2eRecord {
        let mut r = E2eRecord::example();
        r.profile = profile.into();
        r.batch = batch;
        r.tpot_ms = Some(tpot);
        r.decode_tok_s = Some(batch as f64 / (tpot / 1e3));
        r.ttft_ms = Some(2.0 * tpot);
        r
    }

    #[test]
    fn ratios_compare_with_the_none_row_of_the_same_configuration() {
        let mut no_fit = row(WITH_PROFILE, 64, 1.0);
        no_fit.status = STATUS_NO_FIT.into();
        no_fit.decode_tok_s = None;
        let mut rs = vec![
            row(WITH_PROFILE, 1, 1.0),
            row(NO_PROFILE, 1, 1.25),
            row(WITH_PROFILE, 8, 2.0),
            no_fit,
        ];
        annotate_e2e(&mut rs);
        let r = rs[0].decode_vs_none.unwrap();
        assert!((r - 1.25).abs() < 1e-12, "{r}");
        assert_eq!(rs[1].decode_vs_none, Some(1.0));
        assert!((rs[0].ttft_vs_none.unwrap() - 1.25).abs() < 1e-12);
        assert_eq!(rs[2].decode_vs_none, None, "no none row at batch 8");
        assert_eq!(rs[3].decode_vs_none, None);
        let md = e2e_markdown(&rs);
        assert!(md.contains("1.25×") && md.contains("does not fit"), "{md}");
        // The profile row of a configuration comes before its none row.
        assert!(md.find("| profile ").unwrap() < md.find("| none ").unwrap(), "{md}");
    }

    #[test]
    fn csv_round_trips_and_the_chart_has_a_line_per_prompt_and_profile() {
        let mut rs = vec![
            row(WITH_PROFILE, 1, 1.0),
            row(NO_PROFILE, 1, 1.2),
            row(WITH_PROFILE, 4, 1.5),
            row(NO_PROFILE, 4, 1.6),
        ];
        rs[2].prompt_len = 16;
        rs[3].prompt_len = 16;
        let csv = e2e_csv(&rs).unwrap();
        assert_eq!(parse_e2e_csv(&csv, Path::new("x.csv")).unwrap(), rs);
        let svg = e2e_chart_svg("run", &rs).unwrap().unwrap();
        for l in [
            "prompt 8, profile",
            "prompt 8, none",
            "prompt 16, profile",
            "prompt 16, none",
        ] {
            assert!(svg.contains(l), "{l}");
        }
        assert_eq!(e2e_chart_svg("run", &[]), Ok(None));
        let best = highest_throughput(&rs).unwrap();
        assert!(
            best.contains("batch 4") && best.contains("best row of the sweep"),
            "{best}"
        );
    }
}
