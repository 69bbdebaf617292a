//! One rank's view of a checkpoint: a [`TensorSource`] that answers with the rank's slice of
//! every split tensor, under the checkpoint's own names, so the families' loaders
//! ([`crate::model::family::load`]) read a rank's share without knowing about ranks.
//!
//! Row-split slots (QKV, FFN1 and their biases) take [`Split::qkv_rows`] / [`Split::ffn1_rows`]
//! of the slot; a slot stacked from several tensors (q, k, v; gate, up) is cut tensor by tensor,
//! and a fused one (ChatGLM2's query_key_value, dense_h_to_4h) by the same rows. Column-split
//! slots (O, FFN2) take [`Split::o_cols`] / [`Split::ffn2_cols`]. Everything else is read whole.

use std::collections::HashMap;
use std::ops::Range;

use super::split::Split;
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::arch::Arch;
use crate::model::family;
use crate::model::tensors::Stack;
use crate::model::weights::TensorSource;

/// How a rank reads one tensor.
#[derive(Clone, Debug)]
enum Cut {
    /// These rows of the full tensor (of `full` shape), in order.
    Rows { full: Vec<usize>, rows: Vec<Range<usize>> },
    /// These columns of every row of the full [rows, cols] tensor.
    Cols { full: Vec<usize>, cols: Range<usize> },
}

/// A rank's slices of `inner`, whose tensors are the full model's.
pub struct ShardSource<'a> {
    inner: &'a dyn TensorSource,
    split: Split,
    /// Name → (the rank's shape, how to cut).
    cuts: HashMap<String, (Vec<usize>, Cut)>,
}

impl<'a> ShardSource<'a> {
    /// The view of `split`'s rank on `inner`, a checkpoint of `full` (checked whole first, so
    /// that an error names the checkpoint's shapes); `rank` is the arch of the rank's config.
    pub fn new(inner: &'a dyn TensorSource, full: &Arch, rank: &Arch, split: Split) -> Result<Self> {
        family::check(inner, full)?;
        let (whole, part) = (family::names(full), family::names(rank));
        let mut cuts = HashMap::new();
        for (fl, pl) in whole.layers.iter().zip(&part.layers) {
            let rows = [
                (&fl.qkv, &pl.qkv, split.qkv_rows()),
                (&fl.ffn1, &pl.ffn1, split.ffn1_rows()),
            ];
            let bias_rows = [
                (&fl.qkv_bias, &pl.qkv_bias, split.qkv_rows()),
                (&fl.ffn1_bias, &pl.ffn1_bias, split.ffn1_rows()),
            ];
            for (f, p, sel) in rows {
                cut_rows(f, p, &sel, &mut cuts)?;
            }
            for (f, p, sel) in bias_rows {
                if let (Some(f), Some(p)) = (f, p) {
                    cut_rows(f, p, &sel, &mut cuts)?;
                }
            }
            cut_cols(&fl.o, &pl.o, split.o_cols(), &mut cuts)?;
            cut_cols(&fl.ffn2, &pl.ffn2, split.ffn2_cols(), &mut cuts)?;
        }
        Ok(ShardSource { inner, split, cuts })
    }
}

fn internal(what: String) -> FdppError {
    FdppError::InvalidArgument(format!("internal (tensor parallel split): {what}"))
}

/// Row selection of a slot, tensor by tensor: the slot's rows are its tensors' rows one after
/// the other, in the full model and in the rank's.
fn cut_rows(
    full: &Stack,
    part: &Stack,
    sel: &[Range<usize>],
    cuts: &mut HashMap<String, (Vec<usize>, Cut)>,
) -> Result<()> {
    let rows: Vec<usize> = sel.iter().flat_map(Clone::clone).collect();
    let (mut f0, mut p0) = (0usize, 0usize);
    for ((name, fshape), (pname, pshape)) in full.iter().zip(part) {
        if name != pname {
            return Err(internal(format!("slot tensors differ: {name} and {pname}")));
        }
        let (fr, pr) = (
            fshape.first().copied().unwrap_or(1),
            pshape.first().copied().unwrap_or(1),
        );
        let mine = rows.get(p0..p0 + pr).ok_or_else(|| {
            internal(format!(
                "{name}: rows {p0}..{} of a selection of {}",
                p0 + pr,
                rows.len()
            ))
        })?;
        if let Some(r) = mine.iter().find(|r| !(f0..f0 + fr).contains(*r)) {
            return Err(internal(format!(
                "{name}: slot row {r} outside its rows {f0}..{}",
                f0 + fr
            )));
        }
        cuts.insert(
            name.clone(),
            (
                pshape.clone(),
                Cut::Rows {
                    full: fshape.clone(),
                    rows: ranges(mine.iter().map(|r| r - f0)),
                },
            ),
        );
        f0 += fr;
        p0 += pr;
    }
    Ok(())
}

/// Consecutive indices joined into ranges.
fn ranges(idx: impl Iterator<Item = usize>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for i in idx {
        match out.last_mut() {
            Some(r) if r.end == i => r.end += 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

fn cut_cols(
    full: &Stack,
    part: &Stack,
    cols: Range<usize>,
    cuts: &mut HashMap<String, (Vec<usize>, Cut)>,
) -> Result<()> {
    match (full.as_slice(), part.as_slice()) {
        ([(name, fshape)], [(_, pshape)]) if fshape.len() == 2 && cols.end <= fshape[1] => {
            cuts.insert(
                name.clone(),
                (
                    pshape.clone(),
                    Cut::Cols {
                        full: fshape.clone(),
                        cols,
                    },
                ),
            );
            Ok(())
        }
        _ => Err(internal(format!(
            "a row-parallel slot of {} tensors (one [rows, cols] expected) for columns {cols:?}",
            full.len()
        ))),
    }
}

impl TensorSource for ShardSource<'_> {
    fn describe(&self) -> String {
        format!(
            "{} (rank {} of {})",
            self.inner.describe(),
            self.split.rank,
            self.split.world
        )
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        match self.cuts.get(name) {
            Some((shape, _)) => Ok(shape.clone()),
            None => self.inner.shape(name),
        }
    }

    fn load(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Vec<u16>> {
        let Some((mine, cut)) = self.cuts.get(name) else {
            return self.inner.load(name, shape, dtype);
        };
        if mine.as_slice() != shape {
            return Err(FdppError::Shape {
                what: format!("tensor '{name}' in {}", self.describe()),
                expected: format!("{shape:?}"),
                found: format!("{mine:?}"),
            });
        }
        let mut out = Vec::with_capacity(shape.iter().product());
        match cut {
            Cut::Rows { full, rows } => {
                let data = self.inner.load(name, full, dtype)?;
                let width: usize = full.iter().skip(1).product();
                for r in rows {
                    out.extend_from_slice(&data[r.start * width..r.end * width]);
                }
            }
            Cut::Cols { full, cols } => {
                let data = self.inner.load(name, full, dtype)?;
                for row in data.chunks_exact(full[1]) {
                    out.extend_from_slice(&row[cols.clone()]);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;
    use crate::model::ModelConfig;

    /// Every tensor of `cfg` with element i of each tensor = i (so a slice shows where it came
    /// from).
    struct Counting(Vec<(String, Vec<usize>)>);

    impl TensorSource for Counting {
        fn describe(&self) -> String {
            "counting".into()
        }
        fn names(&self) -> Vec<String> {
            self.0.iter().map(|(n, _)| n.clone()).collect()
        }
        fn shape(&self, name: &str) -> Result<Vec<usize>> {
            self.0
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
                .ok_or_else(|| internal(format!("no {name}")))
        }
        fn load(&self, name: &str, shape: &[usize], _: DType) -> Result<Vec<u16>> {
            assert_eq!(self.shape(name)?, shape);
            Ok((0..shape.iter().product::<usize>()).map(|i| i as u16).collect())
        }
    }

    fn small() -> ModelConfig {
        let mut c = preset("llama2-7b").expect("preset");
        c.hidden_size = 8;
        c.num_layers = 1;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.head_dim = 2;
        c.intermediate_size = 6;
        c.vocab_size = 16;
        c
    }

    #[test]
    fn a_rank_reads_its_heads_rows_and_columns() {
        let cfg = small();
        let full = Arch::from_config(&cfg).expect("arch");
        let src = Counting(family::names(&full).names());
        let rc = super::super::split::rank_config(&cfg, 2).expect("rank config");
        let part = Arch::from_config(&rc).expect("arch");
        let split = Split::new(&cfg, 1, 2).expect("split");
        let s = ShardSource::new(&src, &full, &part, split).expect("source");
        // q: heads 2, 3 of 2 elements → rows 4..8 of [8, 8].
        let q = s
            .load("model.layers.0.self_attn.q_proj.weight", &[4, 8], DType::F16)
            .expect("q");
        assert_eq!(q, (32..64).collect::<Vec<u16>>());
        // k: KV head 1 → rows 2..4 of [4, 8].
        let k = s
            .load("model.layers.0.self_attn.k_proj.weight", &[2, 8], DType::F16)
            .expect("k");
        assert_eq!(k, (16..32).collect::<Vec<u16>>());
        // O: columns 4..8 of [8, 8].
        let o = s
            .load("model.layers.0.self_attn.o_proj.weight", &[8, 4], DType::F16)
            .expect("o");
        assert_eq!(&o[..8], &[4, 5, 6, 7, 12, 13, 14, 15]);
        // up: rows 3..6 of [6, 8]; down: columns 3..6 of [8, 6].
        let up = s
            .load("model.layers.0.mlp.up_proj.weight", &[3, 8], DType::F16)
            .expect("up");
        assert_eq!(up, (24..48).collect::<Vec<u16>>());
        let down = s
            .load("model.layers.0.mlp.down_proj.weight", &[8, 3], DType::F16)
            .expect("down");
        assert_eq!(&down[..6], &[3, 4, 5, 9, 10, 11]);
        // Replicated: the embedding whole.
        assert_eq!(s.shape("model.embed_tokens.weight").expect("embed"), vec![16, 8]);
        // The loader reads the rank's model through it.
        family::check(&s, &part).expect("the rank's shapes");
        // A fused slot (ChatGLM2's query_key_value) is cut by the same rows.
        let mut glm = cfg.clone();
        glm.arch = crate::model::ModelArch::ChatGlm;
        // ChatGLM2 rotates half of each head: a head of 4 (2 rotated).
        glm.head_dim = 4;
        let gfull = Arch::from_config(&glm).expect("arch");
        let gsrc = Counting(family::names(&gfull).names());
        let grc = super::super::split::rank_config(&glm, 2).expect("rank config");
        let gpart = Arch::from_config(&grc).expect("arch");
        let gs = ShardSource::new(&gsrc, &gfull, &gpart, Split::new(&glm, 1, 2).expect("split")).expect("source");
        let name = "transformer.encoder.layers.0.self_attention.query_key_value.weight";
        let qkv = gs.load(name, &[16, 8], DType::F16).expect("qkv");
        // Full rows: q 0..16, k 16..24, v 24..32; rank 1: q 8..16, k 20..24, v 28..32.
        let want: Vec<u16> = [8..16, 20..24, 28..32]
            .into_iter()
            .flat_map(|r| (r.start * 8..r.end * 8).map(|i| i as u16))
            .collect();
        assert_eq!(qkv, want);
        let ffn1 = gs
            .load(
                "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight",
                &[6, 8],
                DType::F16,
            )
            .expect("ffn1");
        let want: Vec<u16> = [3..6, 9..12]
            .into_iter()
            .flat_map(|r| (r.start * 8..r.end * 8).map(|i| i as u16))
            .collect();
        assert_eq!(ffn1, want);
    }
}
