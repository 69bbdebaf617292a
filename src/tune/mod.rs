//! The autotuner: sweep every GEMM candidate over a grid of M for each of a model's four linear
//! shapes, verify each result against the f64 reference before timing it, and find the
//! inflection points M1/M2 (FlashDecoding++ §4) that `select` reads from the profile. Where the
//! engine runs a gemv layout as a fused op at decode, that layout is timed fused too (`fused`).

pub mod decode_pass;
pub mod fused;
pub mod grid;
pub mod inflection;
pub mod softmax;
pub mod sweep;
pub mod verify;

pub use grid::{default_m_max, m_grid};
pub use inflection::{inflection_points, Inflections, DEFAULT_MARGIN};
pub use sweep::{sweep_shape, tune, SweepOpts};
pub use verify::{verify_gemm, Verifier};
