//! JSON copy of a report: the same rows as the CSV, as a pretty array (easy to load anywhere).

use std::path::Path;

use super::GemmRecord;
use crate::error::{FdppError, Result};

pub fn to_json_string(records: &[GemmRecord]) -> Result<String> {
    let mut s =
        serde_json::to_string_pretty(records).map_err(|e| FdppError::InvalidArgument(format!("JSON report: {e}")))?;
    s.push('\n');
    Ok(s)
}

pub fn parse_json(text: &str, origin: &Path) -> Result<Vec<GemmRecord>> {
    serde_json::from_str(text).map_err(|e| FdppError::io(origin, format!("JSON report: {e}")))
}

pub fn read_json(path: &Path) -> Result<Vec<GemmRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| FdppError::io(path, e))?;
    parse_json(&text, path)
}
