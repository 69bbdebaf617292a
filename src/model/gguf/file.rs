//! The GGUF container (versions 2 and 3, little-endian): header, metadata, tensor infos and the
//! aligned data section, parsed from a memory map with every length and offset checked against
//! the bytes that are really there.
//!
//! Layout (GGUF spec): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; the
//! metadata (key string, u32 value type, value); the tensor infos (name, u32 dims, u64 dims with
//! the fastest-varying first, u32 ggml type, u64 offset into the data section); padding to
//! `general.alignment` (default 32); the data. Strings are a u64 length and UTF-8 bytes.
//!
//! Nothing here allocates in proportion to a count read from the file before checking that the
//! bytes such a count needs are present: a corrupted header is an error, never an abort.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;

use super::quant::{dequant_row, GgmlType};
use super::value::{MetaValue, Metadata, ValueType};
use crate::dtype::DType;
use crate::error::{FdppError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
/// Default data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are not something any writer produces.
const MAX_DEPTH: usize = 4;

/// One tensor as the file describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the fastest-varying (a row's length); HF order is the reverse.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset within the data section.
    pub offset: u64,
    /// Bytes the type and shape need.
    pub size: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Elements per row (`dims[0]`) and number of rows (the product of the others).
    pub fn rows(&self) -> (usize, usize) {
        let n0 = self.dims.first().copied().unwrap_or(1) as usize;
        let rows = self.dims.iter().skip(1).product::<u64>() as usize;
        (n0, rows)
    }
    /// The shape in HF (row-major, slowest first) order.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// Everything before the data: parsed from bytes, independent of where they came from.
#[derive(Clone, Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

/// A parse error, without the path (the caller adds it).
type PResult<T> = std::result::Result<T, String>;

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }
    fn take(&mut self, n: usize, what: &str) -> PResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {}, but the file ends at {}",
                self.pos,
                self.b.len()
            ));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> PResult<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// A count of items of at least `min_size` bytes each, refused when they cannot fit.
    fn count(&mut self, min_size: usize, what: &str) -> PResult<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = (self.remaining() / min_size.max(1)) as u64;
        if n > fits {
            return Err(format!(
                "{what} at offset {at} is {n}, but only {} bytes remain (room for at most {fits}): \
                 the file is truncated or corrupted",
                self.remaining()
            ));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> PResult<String> {
        let at = self.pos;
        let n = self.count(1, &format!("length of {what}"))?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|e| format!("{what} at offset {at} is not UTF-8: {e}"))
    }

    fn value(&mut self, ty: ValueType, depth: usize, key: &str) -> PResult<MetaValue> {
        use ValueType as T;
        Ok(match ty {
            T::U8 => MetaValue::U8(self.arr::<1>(key)?[0]),
            T::I8 => MetaValue::I8(self.arr::<1>(key)?[0] as i8),
            T::U16 => MetaValue::U16(u16::from_le_bytes(self.arr(key)?)),
            T::I16 => MetaValue::I16(i16::from_le_bytes(self.arr(key)?)),
            T::U32 => MetaValue::U32(self.u32(key)?),
            T::I32 => MetaValue::I32(i32::from_le_bytes(self.arr(key)?)),
            T::F32 => MetaValue::F32(f32::from_le_bytes(self.arr(key)?)),
            T::Bool => match self.arr::<1>(key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(format!("metadata '{key}': a bool holds {b} (expected 0 or 1)")),
            },
            T::Str => MetaValue::Str(self.string(&format!("metadata '{key}' string"))?),
            T::U64 => MetaValue::U64(self.u64(key)?),
            T::I64 => MetaValue::I64(i64::from_le_bytes(self.arr(key)?)),
            T::F64 => MetaValue::F64(f64::from_le_bytes(self.arr(key)?)),
            T::Array => {
                if depth >= MAX_DEPTH {
                    return Err(format!("metadata '{key}': arrays nested deeper than {MAX_DEPTH}"));
                }
                let t = self.u32(key)?;
                let et = ValueType::from_u32(t)
                    .ok_or_else(|| format!("metadata '{key}': unknown array element type {t}"))?;
                let n = self.count(et.min_size(), &format!("element count of metadata '{key}'"))?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1, key)?);
                }
                MetaValue::Array(v)
            }
        })
    }
}

/// Parse everything up to the data section and check every tensor's extent against `bytes`
/// (the whole file). Errors say what is wrong, without the path.
pub fn parse_header(bytes: &[u8]) -> PResult<Header> {
    let mut c = Cursor { b: bytes, pos: 0 };
    let magic = c.arr::<4>("the magic number")?;
    if &magic != MAGIC {
        return Err(format!(
            "not a GGUF file: the magic number is {magic:02x?} (\"{}\"), expected \"GGUF\"",
            String::from_utf8_lossy(&magic).escape_debug()
        ));
    }
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(
                "GGUF version 1 (32-bit counts, 2023) is not read; fdpp reads versions 2 and \
                        3: convert the model again with a current llama.cpp"
                    .into(),
            )
        }
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(format!(
                "big-endian GGUF (version {}) is not read; fdpp reads little-endian GGUF",
                v.swap_bytes()
            ))
        }
        v => {
            return Err(format!(
                "GGUF version {v} is not supported (fdpp reads versions 2 and 3)"
            ))
        }
    }
    // Each tensor info is at least a name length, a dimension count, a type and an offset; each
    // metadata pair at least a key length, a type and one byte of value.
    let n_tensors = c.count(8 + 4 + 4 + 8, "the tensor count")?;
    let n_kv = c.count(8 + 4 + 1, "the metadata count")?;

    let mut metadata = Metadata::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let t = c.u32(&key)?;
        let ty = ValueType::from_u32(t).ok_or_else(|| format!("metadata '{key}': unknown value type {t}"))?;
        let v = c.value(ty, 0, &key)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(format!("metadata key '{key}' appears twice"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(MetaValue::U32(a)) if *a > 0 && a.is_power_of_two() => u64::from(*a),
        Some(v) => {
            return Err(format!(
                "general.alignment is {} ({}); it must be a u32 power of two",
                v.summary(),
                v.type_name()
            ))
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor name #{i}"))?;
        let nd = c.u32(&name)?;
        if nd == 0 || nd > MAX_DIMS {
            return Err(format!(
                "tensor '{name}' has {nd} dimensions (1 to {MAX_DIMS} are valid)"
            ));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            dims.push(c.u64(&name)?);
        }
        let t = c.u32(&name)?;
        let ty = GgmlType::from_id(t).ok_or_else(|| {
            format!(
                "tensor '{name}' has ggml type {t}, which is not a known quantization type (fdpp \
                 reads {})",
                GgmlType::supported_list()
            )
        })?;
        let offset = c.u64(&name)?;
        if dims.contains(&0) {
            return Err(format!("tensor '{name}' has a zero dimension (shape {dims:?})"));
        }
        if dims[0] % ty.block_elems() as u64 != 0 {
            return Err(format!(
                "tensor '{name}' ({ty}, shape {dims:?}): rows of {} elements are not whole {ty} blocks of {}",
                dims[0],
                ty.block_elems()
            ));
        }
        // Checked products: a shape whose byte size overflows is as wrong as one past the end.
        let size = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| (n / ty.block_elems() as u64).checked_mul(ty.block_bytes() as u64))
            .ok_or_else(|| format!("tensor '{name}' ({ty}): shape {dims:?} overflows a 64-bit byte count"))?;
        if seen.insert(name.clone(), i).is_some() {
            return Err(format!("tensor '{name}' appears twice"));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size,
        });
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).checked_sub(data_offset).ok_or_else(|| {
        format!(
            "truncated: the data section would start at offset {data_offset}, past the end of the \
             file ({} bytes)",
            bytes.len()
        )
    })?;
    // Writers lay the tensors out in info order, each padded to the alignment; llama.cpp's loader
    // requires exactly that, and it is what makes a wrong byte size detectable.
    let mut expected = 0u64;
    for t in &tensors {
        if t.offset != expected {
            return Err(format!(
                "tensor '{}' ({}, shape {:?}, {} bytes) starts at data offset {}, but the tensors \
                 before it end at {expected}: a tensor's byte size disagrees with its type and shape",
                t.name, t.ty, t.dims, t.size, t.offset
            ));
        }
        // Saturating: a size near 2^64 must not wrap around to a small end.
        let end = t.offset.saturating_add(t.size);
        if end > data_len {
            return Err(format!(
                "tensor '{}' ({}, shape {:?}) needs {} bytes at data offset {}, past the end of the \
                 file (the data section holds {data_len} bytes): truncated",
                t.name, t.ty, t.dims, t.size, t.offset
            ));
        }
        expected = end.div_ceil(alignment) * alignment;
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// f32 → 16-bit bits through `half`'s slice conversion (vectorized where the CPU has F16C),
/// several times faster than element by element on a 7B load.
fn narrow(dtype: DType, src: &[f32], dst: &mut [u16]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    match dtype {
        DType::F16 => dst.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(src),
        DType::Bf16 => dst.reinterpret_cast_mut::<half::bf16>().convert_from_f32_slice(src),
    }
}

/// A GGUF file, memory-mapped, its header parsed and checked.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    header: Header,
    index: HashMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let f = File::open(path).map_err(|e| FdppError::io(path, e))?;
        // SAFETY: read-only map; a file changed underneath by another process is outside what a
        // loader can guard (the same contract as the safetensors store).
        let map = unsafe { Mmap::map(&f) }.map_err(|e| FdppError::io(path, format!("cannot map: {e}")))?;
        let header = parse_header(&map).map_err(|msg| FdppError::Config {
            path: path.to_path_buf(),
            msg,
        })?;
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            header,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn header(&self) -> &Header {
        &self.header
    }
    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.header.metadata.get(key)
    }
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.header.tensors[i])
    }

    pub(crate) fn err(&self, msg: impl std::fmt::Display) -> FdppError {
        FdppError::Config {
            path: self.path.clone(),
            msg: msg.to_string(),
        }
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name)
            .ok_or_else(|| self.err(format!("no tensor '{name}' in the file")))
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + t.offset) as usize;
        &self.map[start..start + t.size as usize]
    }

    fn check_supported(&self, t: &TensorInfo) -> Result<()> {
        if t.ty.is_supported() {
            return Ok(());
        }
        Err(self.err(format!(
            "tensor '{}' is {}, which fdpp does not dequantize; supported: {}",
            t.name,
            t.ty,
            GgmlType::supported_list()
        )))
    }

    /// A tensor dequantized to f32 in file order (ggml rows), for checks and tools.
    pub fn dequantize_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.info(name)?;
        self.check_supported(t)?;
        let (n0, rows) = t.rows();
        let rb = t.size as usize / rows.max(1);
        let src = self.bytes(t);
        let mut out = vec![0f32; n0 * rows];
        out.par_chunks_mut(n0.max(1)).enumerate().for_each(|(r, o)| {
            dequant_row(t.ty, &src[r * rb..(r + 1) * rb], o);
        });
        Ok(out)
    }

    /// A tensor dequantized to `dtype`, its rows reordered: output row `r` is file row
    /// `row_of(r)` (identity, or the inverse of llama.cpp's Q/K permutation). Rows are split over
    /// threads; each converts through a row-sized f32 buffer, so no f32 copy of the whole tensor
    /// is ever made.
    pub fn dequantize_rows(
        &self,
        name: &str,
        dtype: DType,
        row_of: &(dyn Fn(usize) -> usize + Sync),
    ) -> Result<Vec<u16>> {
        let t = self.info(name)?;
        self.check_supported(t)?;
        let (n0, rows) = t.rows();
        let rb = t.size as usize / rows.max(1);
        let src = self.bytes(t);
        let order: Vec<usize> = (0..rows).map(row_of).collect();
        if let Some(bad) = order.iter().find(|&&r| r >= rows) {
            return Err(self.err(format!(
                "tensor '{name}': row {bad} of {rows} asked for (a bug in the row map)"
            )));
        }
        let mut out = vec![0u16; n0 * rows];
        // Chunks of rows big enough to amortize the scheduling, small enough to balance.
        let per = (1 << 16) / n0.max(1) + 1;
        out.par_chunks_mut(n0.max(1) * per).enumerate().for_each(|(c, chunk)| {
            let mut buf = vec![0f32; n0];
            for (k, o) in chunk.chunks_mut(n0.max(1)).enumerate() {
                let r = order[c * per + k];
                dequant_row(t.ty, &src[r * rb..(r + 1) * rb], &mut buf);
                narrow(dtype, &buf, o);
            }
        });
        Ok(out)
    }
}
