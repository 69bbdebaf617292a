//! Op descriptions: parameters, FLOP and byte counts, validation. One file per op family.

pub mod attention;
pub mod gemm;
pub mod layer;
pub mod scores;
