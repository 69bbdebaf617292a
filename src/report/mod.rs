//! Report writers: self-describing CSV rows, a JSON copy, markdown tables, SVG charts.

pub mod record;

pub use record::GemmRecord;
