//! Slow, obviously correct oracles with f64 accumulation. Every fast path is checked against these.

pub mod attention;
pub mod gemm;
pub mod layer;
