//! Report writers: self-describing CSV rows, a JSON copy, markdown tables, SVG charts.
//! Every tune and bench run writes its files through [`write_gemm_report`].

pub mod annotate;
pub mod attention;
pub mod chart;
pub mod csv;
pub mod e2e;
pub mod json;
pub mod md;
pub mod record;
pub mod softmax;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

pub use annotate::{annotate, roofline_us};
pub use record::{GemmRecord, RunContext};

use crate::backend::slugify;
use crate::cli::Format;
use crate::error::{FdppError, Result};

/// A vertical marker on a chart (M1, M2).
#[derive(Clone, Debug, PartialEq)]
pub struct Mark {
    pub label: String,
    pub m: usize,
}

#[derive(Clone, Debug, Default)]
pub struct ReportFiles {
    pub csv: PathBuf,
    pub json: PathBuf,
    pub svgs: Vec<PathBuf>,
}

impl ReportFiles {
    pub fn all(&self) -> Vec<&Path> {
        let mut v = vec![self.csv.as_path(), self.json.as_path()];
        v.extend(self.svgs.iter().map(|p| p.as_path()));
        v
    }
}

/// The rows of one problem shape (one model on one device), in the order shapes first appear.
#[derive(Clone, Debug)]
pub struct ShapeGroup<'a> {
    pub model: &'a str,
    pub device: &'a str,
    pub shape: &'a str,
    pub k: usize,
    pub n: usize,
    pub rows: Vec<&'a GemmRecord>,
}

pub fn shape_groups(records: &[GemmRecord]) -> Vec<ShapeGroup<'_>> {
    let mut groups: Vec<ShapeGroup<'_>> = Vec::new();
    for r in records {
        let found = groups
            .iter_mut()
            .find(|g| g.model == r.model && g.device == r.device && g.shape == r.shape && g.k == r.k && g.n == r.n);
        match found {
            Some(g) => g.rows.push(r),
            None => groups.push(ShapeGroup {
                model: &r.model,
                device: &r.device,
                shape: &r.shape,
                k: r.k,
                n: r.n,
                rows: vec![r],
            }),
        }
    }
    groups
}

/// Order of the implementation families: the paper's A, B, C.
pub fn imp_rank(imp: &str) -> usize {
    match imp {
        "gemv" => 0,
        "flat_gemm" => 1,
        "gemm" => 2,
        _ => 3,
    }
}

/// Reports are written the way profiles are: through a sibling temporary file, fsync and
/// rename, so a reader never sees half a file and an interrupted run leaves the old one intact.
pub use crate::profile::write_atomic;

/// Writes `<dir>/<stem>.csv`, `<dir>/<stem>.json` and one `<dir>/<stem>-<shape>.svg` per shape
/// (time against M, one line per implementation, `marks[shape]` drawn as vertical lines).
/// `title` is drawn under each chart's own caption (model, shape, [K, N], device).
pub fn write_gemm_report(
    dir: &Path,
    stem: &str,
    title: &str,
    records: &[GemmRecord],
    marks: &BTreeMap<String, Vec<Mark>>,
) -> Result<ReportFiles> {
    std::fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, format!("cannot create the report directory: {e}")))?;
    let csv_path = dir.join(format!("{stem}.csv"));
    let json_path = dir.join(format!("{stem}.json"));
    write_atomic(&csv_path, csv::to_csv_string(records)?.as_bytes())?;
    write_atomic(&json_path, json::to_json_string(records)?.as_bytes())?;

    let mut svgs = Vec::new();
    let mut used = HashSet::new();
    for g in shape_groups(records) {
        // Two groups with one shape name (several models or devices in one table) must not
        // overwrite each other's chart.
        let mut name = format!("{stem}-{}", slugify(g.shape));
        if !used.insert(name.clone()) {
            name = format!("{name}-{}-{}", slugify(g.model), slugify(g.device));
            used.insert(name.clone());
        }
        let path = dir.join(format!("{name}.svg"));
        let shape_marks = marks.get(g.shape).map(Vec::as_slice).unwrap_or(&[]);
        let svg = chart::shape_chart_svg(title, &g, shape_marks).map_err(|e| FdppError::io(&path, e))?;
        if let Some(svg) = svg {
            write_atomic(&path, svg.as_bytes())?;
            svgs.push(path);
        }
    }
    Ok(ReportFiles {
        csv: csv_path,
        json: json_path,
        svgs,
    })
}

/// The records as a table for stdout: markdown grouped by shape and M, or the full CSV, or a
/// pretty JSON array.
pub fn gemm_table(records: &[GemmRecord], format: Format) -> Result<String> {
    match format {
        Format::Md => Ok(md::to_markdown(records)),
        Format::Csv => csv::to_csv_string(records),
        Format::Json => json::to_json_string(records),
    }
}
