//! ggml tensor types: their block geometry (elements and bytes per block, needed to check every
//! tensor's extent in the file) and dequantization of the ones fdpp reads to f32.
//!
//! The block layouts are those of ggml's `ggml-common.h` (all little-endian, half-precision scales):
//! - Q8_0: d, 32 × i8; x = d·q.
//! - Q4_0: d, 16 bytes of nibbles (low nibbles are elements 0..16, high 16..32); x = d·(q − 8).
//! - Q4_1: d, m, nibbles as Q4_0; x = d·q + m.
//! - Q5_0: d, a u32 of fifth bits, nibbles; x = d·(q − 16). Q5_1: d, m, bits, nibbles; x = d·q + m.
//! - K-quants, 256-element super-blocks of sub-blocks:
//!   Q4_K: d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes of
//!   nibbles; x = d·sc·q − dmin·m. Q5_K: as Q4_K plus 32 bytes of fifth bits.
//!   Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 i8 scales (sub-blocks of
//!   16), d; x = d·sc·(q − 32).

use half::{bf16, f16};

/// The ggml types a GGUF file may hold (ids as in ggml's `enum ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
}

/// (id, type, name, elements per block, bytes per block).
const TABLE: &[(u32, GgmlType, &str, usize, usize)] = &[
    (0, GgmlType::F32, "F32", 1, 4),
    (1, GgmlType::F16, "F16", 1, 2),
    (2, GgmlType::Q4_0, "Q4_0", 32, 18),
    (3, GgmlType::Q4_1, "Q4_1", 32, 20),
    (6, GgmlType::Q5_0, "Q5_0", 32, 22),
    (7, GgmlType::Q5_1, "Q5_1", 32, 24),
    (8, GgmlType::Q8_0, "Q8_0", 32, 34),
    (9, GgmlType::Q8_1, "Q8_1", 32, 36),
    (10, GgmlType::Q2K, "Q2_K", 256, 84),
    (11, GgmlType::Q3K, "Q3_K", 256, 110),
    (12, GgmlType::Q4K, "Q4_K", 256, 144),
    (13, GgmlType::Q5K, "Q5_K", 256, 176),
    (14, GgmlType::Q6K, "Q6_K", 256, 210),
    (15, GgmlType::Q8K, "Q8_K", 256, 292),
    (16, GgmlType::Iq2Xxs, "IQ2_XXS", 256, 66),
    (17, GgmlType::Iq2Xs, "IQ2_XS", 256, 74),
    (18, GgmlType::Iq3Xxs, "IQ3_XXS", 256, 98),
    (19, GgmlType::Iq1S, "IQ1_S", 256, 50),
    (20, GgmlType::Iq4Nl, "IQ4_NL", 32, 18),
    (21, GgmlType::Iq3S, "IQ3_S", 256, 110),
    (22, GgmlType::Iq2S, "IQ2_S", 256, 82),
    (23, GgmlType::Iq4Xs, "IQ4_XS", 256, 136),
    (24, GgmlType::I8, "I8", 1, 1),
    (25, GgmlType::I16, "I16", 1, 2),
    (26, GgmlType::I32, "I32", 1, 4),
    (27, GgmlType::I64, "I64", 1, 8),
    (28, GgmlType::F64, "F64", 1, 8),
    (29, GgmlType::Iq1M, "IQ1_M", 256, 56),
    (30, GgmlType::Bf16, "BF16", 1, 2),
    (34, GgmlType::Tq1_0, "TQ1_0", 256, 54),
    (35, GgmlType::Tq2_0, "TQ2_0", 256, 66),
];

impl GgmlType {
    /// The types fdpp dequantizes (the others parse, so that a file can be listed, but their
    /// tensors do not load).
    pub const SUPPORTED: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|r| r.0 == id).map(|r| r.1)
    }

    fn row(self) -> &'static (u32, GgmlType, &'static str, usize, usize) {
        // Every variant has a row in TABLE (checked by a unit test).
        TABLE.iter().find(|r| r.1 == self).unwrap_or(&TABLE[0])
    }

    pub fn id(self) -> u32 {
        self.row().0
    }
    pub fn name(self) -> &'static str {
        self.row().2
    }
    /// Elements per block.
    pub fn block_elems(self) -> usize {
        self.row().3
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.row().4
    }
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }
    /// "F32, F16, …": for messages.
    pub fn supported_list() -> String {
        let v: Vec<&str> = Self::SUPPORTED.iter().map(|t| t.name()).collect();
        v.join(", ")
    }
    /// Bytes of a row of `n` elements, None when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Dequantize one row: `src` holds exactly `out.len()` elements of type `ty` (the caller checked
/// `row_bytes`). Returns false for a type fdpp does not read.
pub fn dequant_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> bool {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let blocks = src.chunks_exact(bb).zip(out.chunks_exact_mut(be));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, o) in blocks {
                o[0] = h(b, 0);
            }
        }
        GgmlType::Bf16 => {
            for (b, o) in blocks {
                o[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in blocks {
                let d = h(b, 0);
                for (y, &q) in o.iter_mut().zip(&b[2..34]) {
                    *y = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (b, o) in blocks {
                let d = h(b, 0);
                let (lo, hi) = o.split_at_mut(16);
                for (j, &q) in b[2..18].iter().enumerate() {
                    lo[j] = d * (f32::from(q & 0x0f) - 8.0);
                    hi[j] = d * (f32::from(q >> 4) - 8.0);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, o) in blocks {
                let (d, m) = (h(b, 0), h(b, 2));
                let (lo, hi) = o.split_at_mut(16);
                for (j, &q) in b[4..20].iter().enumerate() {
                    lo[j] = d * f32::from(q & 0x0f) + m;
                    hi[j] = d * f32::from(q >> 4) + m;
                }
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let affine = ty == GgmlType::Q5_1;
            for (b, o) in blocks {
                let (d, m, at) = if affine {
                    (h(b, 0), h(b, 2), 4)
                } else {
                    (h(b, 0), 0.0, 2)
                };
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 20];
                let (lo, hi) = o.split_at_mut(16);
                for (j, &q) in qs.iter().enumerate() {
                    // Bit j of qh is the fifth bit of element j, bit j + 16 that of element j + 16.
                    let q0 = u32::from(q & 0x0f) | (((qh >> j) & 1) << 4);
                    let q1 = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
                    if affine {
                        lo[j] = d * q0 as f32 + m;
                        hi[j] = d * q1 as f32 + m;
                    } else {
                        lo[j] = d * (q0 as f32 - 16.0);
                        hi[j] = d * (q1 as f32 - 16.0);
                    }
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let five = ty == GgmlType::Q5K;
            for (b, o) in blocks {
                let (d, dmin) = (h(b, 0), h(b, 2));
                let scales = &b[4..16];
                let (qh, qs) = if five {
                    (&b[16..48], &b[48..176])
                } else {
                    (&b[0..0], &b[16..144])
                };
                // Four groups of 64 elements: the low nibbles of 32 bytes, then their high nibbles,
                // each half a sub-block of 32 with its own (scale, min).
                for g in 0..4 {
                    let (sc0, m0) = scale_min_k4(2 * g, scales);
                    let (sc1, m1) = scale_min_k4(2 * g + 1, scales);
                    let (d0, d1) = (d * f32::from(sc0), d * f32::from(sc1));
                    let (n0, n1) = (dmin * f32::from(m0), dmin * f32::from(m1));
                    let q = &qs[32 * g..32 * g + 32];
                    let y = &mut o[64 * g..64 * g + 64];
                    for l in 0..32 {
                        let (mut a, mut c) = (u32::from(q[l] & 0x0f), u32::from(q[l] >> 4));
                        if five {
                            // Fifth bits: bit 2g of qh[l] for the low half, bit 2g + 1 for the high.
                            a |= u32::from((qh[l] >> (2 * g)) & 1) << 4;
                            c |= u32::from((qh[l] >> (2 * g + 1)) & 1) << 4;
                        }
                        y[l] = d0 * a as f32 - n0;
                        y[l + 32] = d1 * c as f32 - n1;
                    }
                }
            }
        }
        GgmlType::Q6K => {
            for (b, o) in blocks {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = h(b, 208);
                // Two halves of 128 elements; in each, 64 bytes of low nibbles and 32 of high bits
                // give four runs of 32 elements.
                for n in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                    let y = &mut o[128 * n..128 * n + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let hb = qh[l];
                        let q1 = i32::from((ql[l] & 0x0f) | ((hb & 3) << 4)) - 32;
                        let q2 = i32::from((ql[l + 32] & 0x0f) | (((hb >> 2) & 3) << 4)) - 32;
                        let q3 = i32::from((ql[l] >> 4) | (((hb >> 4) & 3) << 4)) - 32;
                        let q4 = i32::from((ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4)) - 32;
                        let s = |k: usize| d * f32::from(sc[is + k] as i8);
                        y[l] = s(0) * q1 as f32;
                        y[l + 32] = s(2) * q2 as f32;
                        y[l + 64] = s(4) * q3 as f32;
                        y[l + 96] = s(6) * q4 as f32;
                    }
                }
            }
        }
        _ => return false,
    }
    true
}

/// The 6-bit (scale, min) of sub-block `j` (0..8) of a Q4_K/Q5_K block: sub-blocks 0..4 keep
/// theirs in the low 6 bits of bytes j and j + 4; sub-blocks 4..8 split theirs between a nibble
/// of byte j + 4 and the top 2 bits of bytes j − 4 and j.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        let sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        let m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (sc, m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_is_in_the_table_once() {
        for r in TABLE {
            assert_eq!(GgmlType::from_id(r.0), Some(r.1));
            assert_eq!(r.1.id(), r.0);
            assert_eq!(TABLE.iter().filter(|x| x.1 == r.1).count(), 1);
        }
        assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed from ggml");
    }

    #[test]
    fn q8_0_known_values() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16) as u8;
        }
        let mut out = [0f32; 32];
        assert!(dequant_row(GgmlType::Q8_0, &b, &mut out));
        for (j, v) in out.iter().enumerate() {
            assert_eq!(*v, 0.5 * (j as f32 - 16.0));
        }
    }

    #[test]
    fn q4_0_nibble_order() {
        // Byte j holds element j (low nibble) and element j + 16 (high nibble).
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(2.0).to_bits().to_le_bytes());
        b[2] = 0x9f; // element 0: 15 → 14; element 16: 9 → 2
        let mut out = [0f32; 32];
        dequant_row(GgmlType::Q4_0, &b, &mut out);
        assert_eq!(out[0], 14.0);
        assert_eq!(out[16], 2.0);
        assert_eq!(out[1], -16.0);
    }

    #[test]
    fn unsupported_types_decline() {
        let mut out = [0f32; 256];
        assert!(!dequant_row(GgmlType::Q2K, &[0u8; 84], &mut out));
        assert!(!GgmlType::Iq4Xs.is_supported());
        assert!(GgmlType::supported_list().contains("Q6_K"));
    }
}
