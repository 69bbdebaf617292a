//! Element types of weights and activations. Host copies keep the raw 16-bit patterns so that
//! what is uploaded is exactly what the reference reads.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F16,
    Bf16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
    pub fn size_bytes(self) -> usize {
        2
    }
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            DType::F16 => f16::from_bits(bits).to_f32(),
            DType::Bf16 => bf16::from_bits(bits).to_f32(),
        }
    }
    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            DType::F16 => f16::from_f32(v).to_bits(),
            DType::Bf16 => bf16::from_f32(v).to_bits(),
        }
    }
    /// Widen a slice; uses the vectorised conversions of `half` (F16C where present).
    pub fn widen(self, src: &[u16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        match self {
            DType::F16 => {
                let s: &[f16] = bytemuck_u16_as_f16(src);
                s.convert_to_f32_slice(dst)
            }
            DType::Bf16 => {
                let s: &[bf16] = bytemuck_u16_as_bf16(src);
                s.convert_to_f32_slice(dst)
            }
        }
    }
    /// Narrow a slice of f32 to this type (round to nearest even).
    pub fn narrow(self, src: &[f32], dst: &mut [u16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = self.from_f32(*s);
        }
    }
    /// A bit pattern that no kernel produces from finite inputs: written into outputs before a
    /// run so that an element the kernel never wrote is caught (NaN in both types).
    pub fn poison(self) -> u16 {
        0x7fff
    }
    /// NMSE limit for a result in this type against an f64 reference.
    pub fn nmse_limit(self) -> f64 {
        match self {
            DType::F16 => 1e-5,
            DType::Bf16 => 1e-4,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn bytemuck_u16_as_f16(s: &[u16]) -> &[f16] {
    half::slice::HalfBitsSliceExt::reinterpret_cast(s)
}
fn bytemuck_u16_as_bf16(s: &[u16]) -> &[bf16] {
    half::slice::HalfBitsSliceExt::reinterpret_cast(s)
}

/// Fresh random values in [-1, 1) scaled by `scale`, as bit patterns of `dtype`. Never zeros:
/// zeros hide unwritten outputs and wrong indexing.
pub fn random_bits(dtype: DType, len: usize, scale: f32, seed: u64) -> Vec<u16> {
    use rand::{Rng, SeedableRng};
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0u16; len];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for v in chunk.iter_mut() {
            *v = dtype.from_f32(rng.gen_range(-1.0f32..1.0) * scale);
        }
    });
    out
}
