//! GGUF metadata values: the thirteen value types of the format (GGUF spec, "Standardized
//! key-value pairs"), arrays of any of them included, and typed getters whose errors say which
//! key held what.

use std::collections::BTreeMap;

/// One metadata value as stored in the file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// Elements of one type (possibly arrays themselves).
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// The type tags of the format, with the smallest number of bytes one value of each occupies
/// (used to reject counts that cannot fit in the bytes that remain before allocating anything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    Str = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_u32(t: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match t {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => Str,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of the smallest value of this type: a string is at least its u64 length, an array
    /// at least its u32 type and u64 count.
    pub fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | Str => 8,
            Array => 12,
        }
    }
}

impl MetaValue {
    /// The value's type name, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::Str(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }

    /// Any integer type that holds a non-negative value, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any signed or unsigned integer, as i64 (u64 above i64::MAX is None).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Any float or integer, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }

    /// A short rendering for listings: arrays show their length and first elements.
    pub fn summary(&self) -> String {
        match self {
            MetaValue::Str(s) if s.chars().count() > 60 => {
                let head: String = s.chars().take(60).collect();
                format!("{head:?}… ({} bytes)", s.len())
            }
            MetaValue::Str(s) => format!("{s:?}"),
            MetaValue::Array(v) => {
                let head: Vec<String> = v.iter().take(3).map(MetaValue::summary).collect();
                let more = if v.len() > 3 { ", …" } else { "" };
                format!("[{}{more}] ({} elements)", head.join(", "), v.len())
            }
            MetaValue::F32(x) => format!("{x}"),
            MetaValue::F64(x) => format!("{x}"),
            MetaValue::Bool(b) => format!("{b}"),
            other => other.as_i64().map_or_else(|| format!("{other:?}"), |v| v.to_string()),
        }
    }
}

/// The metadata of a file, by key (keys are unique; the reader rejects duplicates).
pub type Metadata = BTreeMap<String, MetaValue>;
