//! Model weights from an HF directory: one or many `*.safetensors` files (with
//! `model.safetensors.index.json` when sharded), memory-mapped, never copied whole into memory.
//! Every error names the file and the tensor; shapes are checked against what the config says.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};

use super::arch::Arch;
use super::config::ModelConfig;
use super::family;
use crate::dtype::DType;
use crate::error::{FdppError, Result};

/// Where one tensor lives.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range within the file.
    start: usize,
    end: usize,
}

/// The tensors of a model directory, memory-mapped.
pub struct WeightStore {
    files: Vec<(PathBuf, Mmap)>,
    entries: HashMap<String, Entry>,
}

fn cfg_err(path: &Path, msg: impl std::fmt::Display) -> FdppError {
    FdppError::Config {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

impl WeightStore {
    /// Open every `*.safetensors` file of `dir` (the shards named by the index when there is
    /// one). A truncated or malformed file is an error naming it.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let mut paths: Vec<PathBuf> = if index.is_file() {
            shard_paths(&index)?
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| FdppError::io(dir, e))?;
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        };
        paths.dedup();
        if paths.is_empty() {
            return Err(cfg_err(
                dir,
                "no *.safetensors file here; use --random-weights for a preset without weights",
            ));
        }
        let mut store = WeightStore {
            files: Vec::new(),
            entries: HashMap::new(),
        };
        for p in paths {
            store.add_file(p)?;
        }
        Ok(store)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<()> {
        let f = File::open(&path).map_err(|e| FdppError::io(&path, e))?;
        // SAFETY: the map is read-only; fdpp does not modify weight files while they are open, and
        // a file changed underneath by another process is outside what a loader can guard.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| FdppError::io(&path, format!("cannot map: {e}")))?;
        // Full validation once (header, offsets, data length: a truncated file fails here).
        SafeTensors::deserialize(&map).map_err(|e| cfg_err(&path, format!("not a valid safetensors file: {e}")))?;
        let (header_len, meta): (usize, Metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| cfg_err(&path, format!("bad header: {e}")))?;
        let base = 8 + header_len;
        let idx = self.files.len();
        for (name, info) in meta.tensors() {
            let (a, b) = info.data_offsets;
            let entry = Entry {
                file: idx,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: base + a,
                end: base + b,
            };
            if self.entries.insert(name.clone(), entry).is_some() {
                return Err(cfg_err(&path, format!("tensor '{name}' appears in more than one file")));
            }
        }
        self.files.push((path, map));
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| {
            let files: Vec<String> = self.files.iter().map(|(p, _)| p.display().to_string()).collect();
            FdppError::Config {
                path: self.files.first().map(|(p, _)| p.clone()).unwrap_or_default(),
                msg: format!("missing tensor '{name}' (searched {})", files.join(", ")),
            }
        })
    }

    /// The tensor's shape.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.entry(name)?.shape)
    }

    /// The tensor, checked against `shape` and converted to `dtype` (f16, bf16 and f32 files are
    /// read; other float types are converted at load as the issue asks, integers refused).
    pub fn load(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Vec<u16>> {
        let e = self.entry(name)?;
        let path = &self.files[e.file].0;
        if e.shape != shape {
            return Err(FdppError::Shape {
                what: format!("tensor '{name}' in {}", path.display()),
                expected: format!("{shape:?}"),
                found: format!("{:?}", e.shape),
            });
        }
        let bytes = &self.files[e.file].1[e.start..e.end];
        let n: usize = shape.iter().product();
        let mut out = vec![0u16; n];
        match e.dtype {
            Dtype::F16 | Dtype::BF16 => {
                let src_is = if e.dtype == Dtype::F16 { DType::F16 } else { DType::Bf16 };
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    let bits = u16::from_le_bytes([c[0], c[1]]);
                    *o = if src_is == dtype {
                        bits
                    } else {
                        dtype.from_f32(src_is.to_f32(bits))
                    };
                }
            }
            Dtype::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = dtype.from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                }
            }
            other => {
                return Err(cfg_err(
                    path,
                    format!("tensor '{name}' has dtype {other:?}; fdpp reads F16, BF16 and F32"),
                ))
            }
        }
        Ok(out)
    }
}

/// Where a model's tensors come from, by their HF checkpoint names (`model.layers.0.self_attn.
/// q_proj.weight`, shapes as HF stores them): an HF directory's safetensors ([`WeightStore`]) or a
/// GGUF file (`model::gguf`), which maps its own names and layouts onto these. The model families'
/// loaders read through this trait only.
pub trait TensorSource {
    /// The file or directory, for messages.
    fn describe(&self) -> String;
    /// Every tensor name, sorted.
    fn names(&self) -> Vec<String>;
    /// The tensor's shape; a missing tensor is an error naming it and the source.
    fn shape(&self, name: &str) -> Result<Vec<usize>>;
    /// The tensor, checked against `shape` and converted to `dtype` (16-bit bits).
    fn load(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Vec<u16>>;
}

impl TensorSource for WeightStore {
    fn describe(&self) -> String {
        let files: Vec<String> = self.files.iter().map(|(p, _)| p.display().to_string()).collect();
        files.join(", ")
    }

    fn names(&self) -> Vec<String> {
        WeightStore::names(self).into_iter().map(str::to_string).collect()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        WeightStore::shape(self, name).map(<[usize]>::to_vec)
    }

    fn load(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Vec<u16>> {
        WeightStore::load(self, name, shape, dtype)
    }
}

/// The shard files named by `model.safetensors.index.json` (its `weight_map` values).
fn shard_paths(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| FdppError::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        cfg_err(
            index,
            format!("malformed JSON at line {} column {}: {e}", e.line(), e.column()),
        )
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| cfg_err(index, "missing field 'weight_map'"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    // Shards live beside the index: a name with a directory part (absolute, `..`) would map
    // files from elsewhere.
    for f in map.values().filter_map(|f| f.as_str()) {
        let p = Path::new(f);
        if p.components().count() != 1 || !matches!(p.components().next(), Some(std::path::Component::Normal(_))) {
            return Err(cfg_err(
                index,
                format!("weight_map names '{f}', which is not a plain file name beside the index"),
            ));
        }
    }
    let mut files: Vec<PathBuf> = map.values().filter_map(|f| f.as_str()).map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    for f in &files {
        if !f.is_file() {
            return Err(cfg_err(
                index,
                format!("weight_map names {} which does not exist", f.display()),
            ));
        }
    }
    Ok(files)
}

/// Every checkpoint tensor the model of `cfg` (a preset's description, no config.json extras)
/// needs, with its HF name and shape ([out, in] for projections, as HF stores them), in the
/// order of [`crate::model::tensors::Tensors::try_map`]; empty for a config the engine cannot
/// describe.
pub fn checkpoint_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    Arch::from_config(cfg).map_or_else(|_| Vec::new(), |a| family::names(&a).names())
}

/// Check that `store` holds every tensor `cfg` needs with the right shape, before anything is
/// allocated on a device ([`family::check`]).
pub fn check_checkpoint(store: &dyn TensorSource, cfg: &ModelConfig) -> Result<()> {
    family::check(store, &Arch::from_config(cfg)?)
}
