//! Reports of `fdpp bench attention`: one self-describing row per (configuration, variant), the
//! derived columns (roofline share, ratio to sync and to a peer measured in the same run), and
//! the md/csv/json/svg files.
//!
//! The CSV columns are also what `scripts/torch_attention_peer.py` prints, so that torch SDPA
//! rows measured in the same device session can be read back with `--peer` and land in the same
//! table and chart.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chart::{line_chart_svg, LineChart, Series};
use super::write_atomic;
use crate::cli::Format;
use crate::error::{FdppError, Result};

/// Variant name of the rows of the torch SDPA peer script.
pub const PEER_VARIANT: &str = "sdpa";

/// One variant timed on one configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttnRecord {
    pub fdpp_version: String,
    pub git_commit: String,
    pub device: String,
    pub backend: String,
    /// decode | prefill
    pub phase: String,
    pub dtype: String,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV page; 0 for a contiguous cache (the SDPA peer).
    pub page_size: usize,
    pub batch: usize,
    /// Cached tokens per sequence (decode) or prompt length (prefill from an empty cache).
    pub kv_len: usize,
    /// sync | async | naive | sdpa
    pub variant: String,
    /// The softmax scheme with its parameters, e.g. `async(phi=0,a=-60,b=20)`.
    pub scheme: String,
    /// Split-KV count of a decode (1 for naive); none for prefill.
    pub splits: Option<usize>,
    pub samples: usize,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    /// Least bytes the call must move (`DecodeParams::min_bytes` / `PrefillParams::min_bytes`).
    pub bytes: f64,
    /// FLOPs of QKᵀ and PV (causal prefill counts the half square).
    pub flops: f64,
    /// Effective bandwidth: bytes over the median time, in TB/s.
    pub tbps: f64,
    /// flops over the median time, in TFLOP/s.
    pub tflops: f64,
    /// Share of the roofline named in `roofline`: decode, effective TB/s over the measured copy
    /// bandwidth; prefill, TFLOP/s over a nominal tensor-core peak (not measured). Filled by
    /// [`annotate_attention`].
    pub roofline_pct: Option<f64>,
    /// What `roofline_pct` is a share of, e.g. `copy 2980 GB/s measured`.
    pub roofline: String,
    /// (query, head) rows of the untimed run.
    pub rows: Option<usize>,
    /// Rows the async scheme flagged and recomputed with sync in the untimed run.
    pub recomputed: Option<usize>,
    /// recomputed / rows.
    pub recompute_rate: Option<f64>,
    /// NMSE against the f64 reference on the sampled rows (see `bench::attention`).
    pub nmse: Option<f64>,
    /// Median of `sync` on the same configuration in the same run over this median (async/sync
    /// speed-up for the async row). Filled by [`annotate_attention`].
    pub speedup_vs_sync: Option<f64>,
    /// Median of the `sdpa` peer row of the same configuration over this median.
    pub speedup_vs_sdpa: Option<f64>,
    /// Prefill: median µs of writing the new k and v into the paged cache (`kv_append`), timed
    /// beside the variants and not part of `median_us`: an SDPA peer is handed its k and v in
    /// place, and the engine writes them in its rotation kernel (`qkv_rope_append`).
    #[serde(default)]
    pub append_us: Option<f64>,
}

/// One configuration of one run (every variant of it shares the key), and whether the row is the
/// peer's. The device is not part of it: the rows annotated together come from one run, and a
/// peer's device name is spelled by torch, not by fdpp.
type ProblemKey = (String, String, usize, usize, usize, usize, usize, bool);

impl AttnRecord {
    fn problem(&self, peer: bool) -> ProblemKey {
        (
            self.phase.clone(),
            self.dtype.clone(),
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.batch,
            self.kv_len,
            peer,
        )
    }

    fn is_decode(&self) -> bool {
        self.phase == "decode"
    }
}

/// The rooflines of one run: decode rows are judged against the measured copy bandwidth,
/// prefill rows against a nominal tensor-core peak (fdpp does not measure one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnRoofline {
    pub copy_gbps: Option<f64>,
    pub peak_tflops: f64,
}

impl AttnRoofline {
    pub fn decode_label(&self) -> String {
        match self.copy_gbps {
            Some(g) => format!("copy {g:.0} GB/s measured"),
            None => "copy bandwidth not measured".into(),
        }
    }

    pub fn prefill_label(&self) -> String {
        format!("{} TFLOP/s nominal", self.peak_tflops)
    }
}

fn usable(t: f64) -> bool {
    t.is_finite() && t > 0.0
}

/// Fills `roofline_pct`, `roofline`, `speedup_vs_sync` and `speedup_vs_sdpa` on every row, and
/// clears them where their basis is missing, so that values read from a peer file never survive
/// unchecked.
pub fn annotate_attention(records: &mut [AttnRecord], roof: AttnRoofline) {
    let mut base: HashMap<ProblemKey, f64> = HashMap::new();
    for r in records.iter() {
        let is_peer = r.variant == PEER_VARIANT;
        if (r.variant == "sync" || is_peer) && usable(r.median_us) {
            let e = base.entry(r.problem(is_peer)).or_insert(f64::INFINITY);
            *e = e.min(r.median_us);
        }
    }
    let copy = roof.copy_gbps.filter(|g| usable(*g));
    let peak = Some(roof.peak_tflops).filter(|p| usable(*p));
    for r in records.iter_mut() {
        let ok = usable(r.median_us);
        let sync = base.get(&r.problem(false)).copied().filter(|_| ok);
        let sdpa = base.get(&r.problem(true)).copied().filter(|_| ok);
        r.speedup_vs_sync = sync.map(|s| s / r.median_us);
        r.speedup_vs_sdpa = sdpa.map(|s| s / r.median_us);
        if r.is_decode() {
            r.roofline = roof.decode_label();
            r.roofline_pct = copy.filter(|_| ok).map(|g| 100.0 * r.tbps * 1e3 / g);
        } else {
            r.roofline = roof.prefill_label();
            r.roofline_pct = peak.filter(|_| ok).map(|p| 100.0 * r.tflops / p);
        }
    }
}

/// Numbers with three significant digits (TB/s on a CPU is 0.0x, on an H100 2.x).
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

/// A speed-up: two decimals, or three significant digits when far below 1.
fn ratio(s: f64) -> String {
    if s < 0.1 {
        format!("{}×", sig3(s))
    } else {
        format!("{s:.2}×")
    }
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.filter(|x| x.is_finite()).map(f).unwrap_or_else(|| "–".into())
}

/// Variants in the order they are presented: the paper's two schemes, the baseline, the peer.
fn variant_rank(v: &str) -> usize {
    match v {
        "sync" => 0,
        "async" => 1,
        "naive" => 2,
        PEER_VARIANT => 3,
        _ => 4,
    }
}

/// A markdown table, padded so that it reads well in a terminal: one row per (batch, kv_len,
/// variant), the fastest variant of each configuration in bold. Decode shows effective TB/s and
/// the share of the copy bandwidth, prefill TFLOP/s and the share of the nominal peak.
pub fn attention_markdown(records: &[AttnRecord]) -> String {
    let decode = records.iter().all(AttnRecord::is_decode);
    let with_sdpa = records.iter().any(|r| r.speedup_vs_sdpa.is_some());
    let mut header: Vec<&str> = vec!["batch", if decode { "kv_len" } else { "len" }, "variant"];
    if decode {
        header.push("splits");
    }
    header.extend(["median µs", "min µs"]);
    if decode {
        header.extend(["TB/s", "% copy BW"]);
    } else {
        header.extend(["TFLOP/s", "% nominal peak"]);
    }
    header.extend(["recomputed", "vs sync"]);
    if with_sdpa {
        header.push("vs sdpa");
    }
    let with_append = records.iter().any(|r| r.append_us.is_some());
    if with_append {
        header.push("cache write µs (not in median)");
    }

    let mut rs: Vec<&AttnRecord> = records.iter().collect();
    rs.sort_by(|a, b| {
        (a.batch, a.kv_len, variant_rank(&a.variant))
            .cmp(&(b.batch, b.kv_len, variant_rank(&b.variant)))
            .then(a.median_us.total_cmp(&b.median_us))
    });
    let mut fastest: HashMap<(usize, usize), f64> = HashMap::new();
    for r in &rs {
        let e = fastest.entry((r.batch, r.kv_len)).or_insert(f64::INFINITY);
        *e = e.min(r.median_us);
    }
    let mut rows: Vec<Vec<String>> = Vec::new();
    let mut last = None;
    for r in rs {
        let first = last != Some((r.batch, r.kv_len));
        last = Some((r.batch, r.kv_len));
        let best = fastest.get(&(r.batch, r.kv_len)) == Some(&r.median_us);
        let mut row = vec![
            if first { r.batch.to_string() } else { String::new() },
            if first { r.kv_len.to_string() } else { String::new() },
            if best {
                format!("**{}**", r.variant)
            } else {
                r.variant.clone()
            },
        ];
        if decode {
            row.push(r.splits.map(|s| s.to_string()).unwrap_or_else(|| "–".into()));
        }
        row.push(format!("{:.2}", r.median_us));
        row.push(format!("{:.2}", r.min_us));
        if decode {
            row.push(sig3(r.tbps));
        } else {
            row.push(sig3(r.tflops));
        }
        row.push(opt(r.roofline_pct, |p| format!("{}%", sig3(p))));
        row.push(match (r.recomputed, r.rows, r.recompute_rate) {
            (Some(n), Some(rows), Some(rate)) => format!("{n}/{rows} ({:.2}%)", 100.0 * rate),
            _ => "–".into(),
        });
        row.push(opt(r.speedup_vs_sync, ratio));
        if with_sdpa {
            row.push(opt(r.speedup_vs_sdpa, ratio));
        }
        if with_append {
            row.push(opt(r.append_us, |u| format!("{u:.2}")));
        }
        rows.push(row);
    }
    let numeric: Vec<bool> = header.iter().map(|h| !matches!(*h, "variant" | "recomputed")).collect();
    super::md::padded_table(&header, &numeric, &rows)
}

pub fn attention_csv(records: &[AttnRecord]) -> Result<String> {
    let mut w = ::csv::Writer::from_writer(Vec::new());
    for r in records {
        w.serialize(r).map_err(|e| {
            FdppError::InvalidArgument(format!(
                "CSV row for {} b={} kv_len={}: {e}",
                r.variant, r.batch, r.kv_len
            ))
        })?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| FdppError::InvalidArgument(format!("CSV buffer: {e}")))?;
    String::from_utf8(bytes).map_err(|e| FdppError::InvalidArgument(format!("CSV text: {e}")))
}

/// The CSV header row (the column names `scripts/torch_attention_peer.py` must print).
pub fn attention_csv_header() -> Result<String> {
    let csv = attention_csv(&[AttnRecord::example()])?;
    Ok(csv.lines().next().unwrap_or_default().to_string())
}

impl AttnRecord {
    /// A filled-in row (for the header and for tests).
    pub fn example() -> Self {
        AttnRecord {
            fdpp_version: crate::VERSION.into(),
            git_commit: "0000000".into(),
            device: "example".into(),
            backend: "cpu".into(),
            phase: "decode".into(),
            dtype: "f16".into(),
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            page_size: 16,
            batch: 1,
            kv_len: 1024,
            variant: "sync".into(),
            scheme: "sync".into(),
            splits: Some(4),
            samples: 30,
            median_us: 20.0,
            min_us: 19.0,
            max_us: 25.0,
            bytes: 16_785_408.0,
            flops: 16_777_216.0,
            tbps: 0.84,
            tflops: 0.84,
            roofline_pct: Some(28.0),
            roofline: "copy 2980 GB/s measured".into(),
            rows: Some(32),
            recomputed: Some(0),
            recompute_rate: Some(0.0),
            nmse: Some(1e-7),
            speedup_vs_sync: Some(1.0),
            speedup_vs_sdpa: None,
            append_us: None,
        }
    }
}

pub fn attention_json(records: &[AttnRecord]) -> Result<String> {
    let mut s =
        serde_json::to_string_pretty(records).map_err(|e| FdppError::InvalidArgument(format!("JSON report: {e}")))?;
    s.push('\n');
    Ok(s)
}

/// Rows of a CSV written by fdpp or by the peer script. `origin` names the source in errors.
pub fn parse_attention_csv(text: &str, origin: &Path) -> Result<Vec<AttnRecord>> {
    // The peer script prints a few lines about the device before its CSV: start at the header.
    let start = text
        .lines()
        .position(|l| l.starts_with("fdpp_version,"))
        .ok_or_else(|| FdppError::io(origin, "no CSV header (a line starting with `fdpp_version,`)"))?;
    let body: String = text.lines().skip(start).map(|l| format!("{l}\n")).collect();
    let mut rd = ::csv::Reader::from_reader(body.as_bytes());
    rd.deserialize()
        .enumerate()
        .map(|(i, row)| row.map_err(|e| FdppError::io(origin, format!("CSV data row {}: {e}", i + 1))))
        .collect()
}

pub fn read_attention_csv(path: &Path) -> Result<Vec<AttnRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| FdppError::io(path, e))?;
    parse_attention_csv(&text, path)
}

/// The rows as a table for stdout.
pub fn attention_table(records: &[AttnRecord], format: Format) -> Result<String> {
    match format {
        Format::Md => Ok(attention_markdown(records)),
        Format::Csv => attention_csv(records),
        Format::Json => attention_json(records),
    }
}

/// The files one `bench attention` run writes.
#[derive(Clone, Debug, Default)]
pub struct AttnReportFiles {
    pub md: PathBuf,
    pub csv: PathBuf,
    pub json: PathBuf,
    /// None when no row had a usable time to plot.
    pub svg: Option<PathBuf>,
}

impl AttnReportFiles {
    pub fn all(&self) -> Vec<&Path> {
        let mut v = vec![self.md.as_path(), self.csv.as_path(), self.json.as_path()];
        v.extend(self.svg.as_deref());
        v
    }
}

/// The chart: effective TB/s (decode) or TFLOP/s (prefill) against kv_len, one line per
/// (variant, batch), the roofline as a dashed horizontal line when it is within reach of the data.
pub fn attention_chart_svg(title: &str, records: &[AttnRecord], roof: AttnRoofline) -> Result<Option<String>, String> {
    let Some(first) = records.first() else {
        return Ok(None);
    };
    let decode = first.is_decode();
    let value = |r: &AttnRecord| if decode { r.tbps } else { r.tflops };
    let mut keys: Vec<(usize, usize, String)> = records
        .iter()
        .map(|r| (variant_rank(&r.variant), r.batch, r.variant.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    let batches = records
        .iter()
        .map(|r| r.batch)
        .collect::<std::collections::BTreeSet<_>>();
    let series: Vec<Series> = keys
        .iter()
        .map(|(_, batch, variant)| {
            let mut points: Vec<(f64, f64)> = records
                .iter()
                .filter(|r| &r.variant == variant && r.batch == *batch && usable(value(r)))
                .map(|r| (r.kv_len as f64, value(r)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                label: if batches.len() > 1 {
                    format!("{variant} b={batch}")
                } else {
                    variant.clone()
                },
                family: variant.clone(),
                points,
            }
        })
        .collect();
    let hline = if decode {
        roof.copy_gbps
            .filter(|g| usable(*g))
            .map(|g| (format!("copy bandwidth {:.2} TB/s (measured)", g / 1e3), g / 1e3))
    } else {
        Some((format!("nominal peak {} TFLOP/s", roof.peak_tflops), roof.peak_tflops))
    };
    let caption = format!(
        "attention {} h{}/kv{} d{} {} on {}",
        first.phase, first.heads, first.kv_heads, first.head_dim, first.dtype, first.device
    );
    let chart = LineChart {
        caption: &caption,
        subtitle: title,
        x_desc: if decode {
            "kv_len (cached tokens per sequence), log2 scale"
        } else {
            "prompt length (causal, from an empty cache), log2 scale"
        },
        y_desc: if decode {
            "effective TB/s (least bytes / median time)"
        } else {
            "TFLOP/s (2·B·H·L²·D / median time)"
        },
        series,
        hlines: hline.into_iter().collect(),
    };
    line_chart_svg(&chart)
}

/// Writes `<dir>/<stem>.{md,csv,json,svg}`; `title` heads the markdown file and subtitles the chart.
pub fn write_attention_report(
    dir: &Path,
    stem: &str,
    title: &str,
    records: &[AttnRecord],
    roof: AttnRoofline,
) -> Result<AttnReportFiles> {
    std::fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, format!("cannot create the report directory: {e}")))?;
    let files = AttnReportFiles {
        md: dir.join(format!("{stem}.md")),
        csv: dir.join(format!("{stem}.csv")),
        json: dir.join(format!("{stem}.json")),
        svg: None,
    };
    let roof_note = match records.first().map(AttnRecord::is_decode) {
        Some(false) => format!(
            "% nominal peak: TFLOP/s over {} (a nominal tensor-core rate, not measured by fdpp).",
            roof.prefill_label()
        ),
        _ => format!("% copy BW: effective TB/s over the {}.", roof.decode_label()),
    };
    let md = format!(
        "# {title}\n\n{}\n{roof_note} `vs sync`: sync's median over this row's, same run.\n",
        attention_markdown(records)
    );
    write_atomic(&files.md, md.as_bytes())?;
    write_atomic(&files.csv, attention_csv(records)?.as_bytes())?;
    write_atomic(&files.json, attention_json(records)?.as_bytes())?;
    let svg_path = dir.join(format!("{stem}.svg"));
    let svg = attention_chart_svg(title, records, roof).map_err(|e| FdppError::io(&svg_path, e))?;
    let svg = match svg {
        Some(text) => {
            write_atomic(&svg_path, text.as_bytes())?;
            Some(svg_path)
        }
        None => None,
    };
    Ok(AttnReportFiles { svg, ..files })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(variant: &str, batch: usize, kv_len: usize, median_us: f64) -> AttnRecord {
        let mut r = AttnRecord::example();
        r.variant = variant.into();
        r.batch = batch;
        r.kv_len = kv_len;
        r.median_us = median_us;
        r.bytes = 3e6 * kv_len as f64;
        r.tbps = r.bytes / (median_us * 1e-6) / 1e12;
        r.tflops = r.flops / (median_us * 1e-6) / 1e12;
        r.roofline_pct = Some(-1.0);
        r.speedup_vs_sync = Some(-1.0);
        r
    }

    #[test]
    fn ratios_are_against_sync_and_sdpa_of_the_same_configuration() {
        let mut rs = vec![
            row("sync", 1, 1024, 20.0),
            row("async", 1, 1024, 16.0),
            row("naive", 1, 1024, 40.0),
            row("sdpa", 1, 1024, 50.0),
            row("sync", 1, 4096, 60.0),
            row("async", 8, 4096, 30.0),
        ];
        annotate_attention(
            &mut rs,
            AttnRoofline {
                copy_gbps: Some(3000.0),
                peak_tflops: 790.0,
            },
        );
        assert_eq!(rs[0].speedup_vs_sync, Some(1.0));
        assert_eq!(rs[1].speedup_vs_sync, Some(20.0 / 16.0));
        assert_eq!(rs[2].speedup_vs_sync, Some(0.5));
        assert_eq!(rs[1].speedup_vs_sdpa, Some(50.0 / 16.0));
        assert_eq!(rs[4].speedup_vs_sdpa, None, "no sdpa row at kv_len 4096");
        assert_eq!(rs[5].speedup_vs_sync, None, "no sync row at batch 8");
        // 100 · TB/s / (copy GB/s / 1000).
        let want = 100.0 * rs[0].tbps / 3.0;
        assert!((rs[0].roofline_pct.unwrap() - want).abs() < 1e-9);
        assert_eq!(rs[0].roofline, "copy 3000 GB/s measured");

        let md = attention_markdown(&rs);
        assert!(
            md.contains("| **async** |") && md.contains("1.25×") && md.contains("vs sdpa"),
            "{md}"
        );

        let mut no_copy = rs.clone();
        annotate_attention(
            &mut no_copy,
            AttnRoofline {
                copy_gbps: None,
                peak_tflops: 790.0,
            },
        );
        assert!(no_copy.iter().all(|r| r.roofline_pct.is_none()));
    }

    #[test]
    fn prefill_rows_are_judged_against_the_nominal_peak() {
        let mut r = row("sync", 1, 1024, 100.0);
        r.phase = "prefill".into();
        r.splits = None;
        r.flops = 790e12 * 1e-4 / 2.0;
        r.tflops = r.flops / 1e-4 / 1e12;
        let mut rs = vec![r];
        annotate_attention(
            &mut rs,
            AttnRoofline {
                copy_gbps: Some(3000.0),
                peak_tflops: 790.0,
            },
        );
        assert!((rs[0].roofline_pct.unwrap() - 50.0).abs() < 1e-9);
        assert_eq!(rs[0].roofline, "790 TFLOP/s nominal");
        let md = attention_markdown(&rs);
        assert!(md.contains("% nominal peak") && !md.contains("splits"), "{md}");
    }

    #[test]
    fn csv_round_trips_and_skips_the_peer_script_preamble() {
        let rs = vec![row("sync", 1, 97, 3.0), row("sdpa", 2, 300, 4.0)];
        let csv = attention_csv(&rs).unwrap();
        let text = format!("device NVIDIA H100, torch 2.11\ncopy 2980 GB/s\n{csv}");
        let back = parse_attention_csv(&text, Path::new("peer.csv")).unwrap();
        assert_eq!(back, rs);
        assert!(csv.starts_with(&attention_csv_header().unwrap()));
        let e = parse_attention_csv("a,b\n1,2\n", Path::new("x.csv")).unwrap_err();
        assert!(e.to_string().contains("x.csv: no CSV header"), "{e}");
    }

    #[test]
    fn the_chart_draws_a_line_per_variant_and_batch_and_a_roofline_within_reach() {
        let rs = vec![
            row("sync", 1, 1024, 20.0),
            row("sync", 1, 4096, 60.0),
            row("async", 8, 4096, 30.0),
        ];
        let near = AttnRoofline {
            copy_gbps: Some(1e3 * rs[2].tbps * 1.5),
            peak_tflops: 790.0,
        };
        let svg = attention_chart_svg("run title", &rs, near).unwrap().unwrap();
        assert!(svg.contains("sync b=1") && svg.contains("async b=8") && svg.contains("run title"));
        assert!(svg.contains("copy bandwidth"), "a roofline 1.5× the best rate is drawn");
        let far = AttnRoofline {
            copy_gbps: Some(1e3 * rs[2].tbps * 10.0),
            peak_tflops: 790.0,
        };
        let svg = attention_chart_svg("run title", &rs, far).unwrap().unwrap();
        assert!(
            !svg.contains("copy bandwidth"),
            "a roofline 10× away would flatten the data"
        );
        assert_eq!(attention_chart_svg("t", &[], near), Ok(None));
    }
}
