//! CSV: one self-describing row per measured candidate (version, commit, device, shape, ...), so
//! rows from different runs can be concatenated and still be told apart.

use std::path::Path;

use super::GemmRecord;
use crate::error::{FdppError, Result};

/// The records as CSV text with a header row.
pub fn to_csv_string(records: &[GemmRecord]) -> Result<String> {
    let mut w = ::csv::Writer::from_writer(Vec::new());
    for r in records {
        w.serialize(r)
            .map_err(|e| FdppError::InvalidArgument(format!("CSV row for {}: {e}", r.implementation)))?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| FdppError::InvalidArgument(format!("CSV buffer: {e}")))?;
    String::from_utf8(bytes).map_err(|e| FdppError::InvalidArgument(format!("CSV text: {e}")))
}

/// Parse CSV text written by [`to_csv_string`]. `origin` names the source in errors.
pub fn parse_csv(text: &str, origin: &Path) -> Result<Vec<GemmRecord>> {
    let mut rd = ::csv::Reader::from_reader(text.as_bytes());
    rd.deserialize()
        .enumerate()
        .map(|(i, row)| row.map_err(|e| FdppError::io(origin, format!("CSV data row {}: {e}", i + 1))))
        .collect()
}

pub fn read_csv(path: &Path) -> Result<Vec<GemmRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| FdppError::io(path, e))?;
    parse_csv(&text, path)
}
