//! A GGUF file as a [`TensorSource`]: HF names and shapes in, dequantized 16-bit tensors out.

use std::collections::BTreeMap;

use super::file::GgufFile;
use super::names::{gguf_name, hf_name, qk_kind, unpermute_row, QK};
use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::weights::TensorSource;

struct Entry {
    /// Index into the file's tensor infos.
    index: usize,
    /// Heads of a Q or K projection whose rows llama.cpp interleaved.
    permuted_heads: Option<usize>,
}

/// The tensors of a GGUF file under HF names.
pub struct GgufStore {
    file: GgufFile,
    entries: BTreeMap<String, Entry>,
}

impl GgufStore {
    /// `permute`: the file is of the `llama` architecture, whose converter interleaved the rows
    /// of Q (`heads` heads) and K (`kv_heads`); other architectures (qwen2) are stored as HF has
    /// them.
    pub fn new(file: GgufFile, permute: bool, heads: usize, kv_heads: usize) -> Result<GgufStore> {
        let mut entries = BTreeMap::new();
        for (index, t) in file.tensors().iter().enumerate() {
            let name = hf_name(&t.name).unwrap_or_else(|| t.name.clone());
            let permuted_heads = match (permute, qk_kind(&t.name)) {
                (true, Some(QK::Q)) => Some(heads),
                (true, Some(QK::K)) => Some(kv_heads),
                _ => None,
            };
            if let Some(n) = permuted_heads {
                // The output dimension (the last ggml dim) must split into heads of even size.
                let out = *t.dims.last().unwrap_or(&0) as usize;
                if n == 0 || !out.is_multiple_of(n) || !(out / n).is_multiple_of(2) {
                    return Err(file.err(format!(
                        "tensor '{}' has {out} output rows, which do not split into {n} heads of \
                         an even size (the metadata's head counts disagree with the tensor)",
                        t.name
                    )));
                }
            }
            if entries.insert(name.clone(), Entry { index, permuted_heads }).is_some() {
                return Err(file.err(format!("two tensors map to the HF name '{name}'")));
            }
        }
        Ok(GgufStore { file, entries })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    fn entry(&self, name: &str) -> Result<(&Entry, &super::file::TensorInfo)> {
        let e = self.entries.get(name).ok_or_else(|| {
            self.file
                .err(format!("missing tensor '{name}' (GGUF name {})", gguf_name_hint(name)))
        })?;
        Ok((e, &self.file.tensors()[e.index]))
    }
}

fn gguf_name_hint(hf: &str) -> String {
    gguf_name(hf).map_or_else(|| "unknown".into(), |g| format!("'{g}'"))
}

impl TensorSource for GgufStore {
    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }

    fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.entry(name)?.1.hf_shape())
    }

    fn load(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Vec<u16>> {
        let (e, t) = self.entry(name)?;
        let found = t.hf_shape();
        if found != shape {
            return Err(FdppError::Shape {
                what: format!("tensor '{name}' ('{}', {}) in {}", t.name, t.ty, self.describe()),
                expected: format!("{shape:?}"),
                found: format!("{found:?}"),
            });
        }
        let (n0, rows) = t.rows();
        match e.permuted_heads {
            None => self.file.dequantize_rows(&t.name, dtype, &|r| r),
            Some(heads) if rows > 1 => self
                .file
                .dequantize_rows(&t.name, dtype, &|r| unpermute_row(r, rows, heads)),
            Some(heads) => {
                // A bias: one row whose elements carry the interleaving.
                let flat = self.file.dequantize_rows(&t.name, dtype, &|r| r)?;
                Ok((0..n0).map(|i| flat[unpermute_row(i, n0, heads)]).collect())
            }
        }
    }
}
