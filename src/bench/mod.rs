//! Measuring device work: warm-up, many runs, median; inputs rotated so that weights are not
//! served from L2. Benchmarks report; tests assert.

pub mod attention;
pub mod e2e;
pub mod timer;

pub use timer::{GemmInputs, Stats, TimingOpts};
