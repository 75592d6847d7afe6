//! GGUF (llama.cpp's model format, versions 2 and 3): metadata, tensor table, alignment, and
//! tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K,
//! Q6_K and MXFP4.
//!
//! A model file is untrusted input: every count, length, shape and offset is checked against the
//! bytes actually present before anything is allocated or read, with checked arithmetic; errors
//! name the tensor or key and the problem.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{file_err, Error, Result};
use crate::io::mapped::FileBytes;
use crate::model::config::ModelConfig;
use crate::model::family::Naming;
use crate::model::lora::LoraAdapter;
use crate::model::quant::QuantKind;
use crate::model::tensor::{HostDtype, HostTensor};
use crate::model::weights::ModelWeights;

mod config;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Unsigned integer (u8, u16, u32, u64).
    U(u64),
    /// Signed integer (i8, i16, i32, i64).
    I(i64),
    /// Float (f32, f64).
    F(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string (invalid UTF-8 is replaced).
    Str(String),
    /// Array of values.
    Array(Vec<Value>),
}

impl Value {
    /// As an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U(v) => Some(v),
            Value::I(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    /// As a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::U(v) => Some(v as f64),
            Value::I(v) => Some(v as f64),
            Value::F(v) => Some(v),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// A block-quantized type.
    Quant(QuantKind),
}

/// ggml's name of a tensor type id (for errors).
fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16",
        "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

impl TensorType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            30 => TensorType::BF16,
            _ => TensorType::Quant(QuantKind::ALL.into_iter().find(|q| q.ggml_type() == id)?),
        })
    }
    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::BF16 => (1, 2),
            TensorType::Quant(q) => (q.block_len(), q.block_bytes()),
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// Dimensions, GGUF order (`dims[0]` varies fastest: the row length).
    pub dims: Vec<usize>,
    /// Element type.
    pub ty: TensorType,
    /// Byte range in the file.
    pub range: std::ops::Range<usize>,
}

impl TensorInfo {
    /// `[rows, cols]` as PyTorch orders them (GGUF's dims reversed). A 3-D tensor is llama.cpp's
    /// experts of a layer stacked (`[cols, rows of each, experts]`): one matrix of all their rows,
    /// the first expert's first, as the name map stacks them. Higher ranks have no matrix shape.
    pub fn matrix_shape(&self) -> Option<[usize; 2]> {
        // (the parse checked the element count fits in memory, so the product cannot overflow)
        match self.dims[..] {
            [cols, rows] => Some([rows, cols]),
            [cols, rows, stack] => Some([stack * rows, cols]),
            _ => None,
        }
    }
}

/// A parsed GGUF file held in memory.
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor table, in file order.
    pub tensors: Vec<TensorInfo>,
    bytes: FileBytes,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            Error::Weights(format!("truncated while reading {what} at byte {} ({n} bytes wanted)", self.at))
        })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn remaining(&self) -> usize {
        self.b.len() - self.at
    }
    /// A count that must be possible given at least `min_each` bytes per item.
    fn count(&mut self, min_each: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        if n > (self.remaining() / min_each.max(1)) as u64 {
            return Err(Error::Weights(format!("{what} {n} is larger than the file could hold")));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(1, what)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = format!("value of `{key}`");
        Ok(match ty {
            0 => Value::U(self.take(1, &what)?[0] as u64),
            1 => Value::I(self.take(1, &what)?[0] as i8 as i64),
            2 => Value::U(u16::from_le_bytes(self.take(2, &what)?.try_into().expect("2")) as u64),
            3 => Value::I(i16::from_le_bytes(self.take(2, &what)?.try_into().expect("2")) as i64),
            4 => Value::U(self.u32(&what)? as u64),
            5 => Value::I(self.u32(&what)? as i32 as i64),
            6 => Value::F(f32::from_bits(self.u32(&what)?) as f64),
            7 => Value::Bool(self.take(1, &what)?[0] != 0),
            8 => Value::Str(self.string(&what)?),
            9 => {
                if depth > 2 {
                    return Err(Error::Weights(format!("`{key}`: arrays nested too deep")));
                }
                let ety = self.u32(&what)?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    _ => return Err(Error::Weights(format!("`{key}`: unknown array element type {ety}"))),
                };
                let n = self.count(min, &format!("length of `{key}`"))?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U(self.u64(&what)?),
            11 => Value::I(self.u64(&what)? as i64),
            12 => Value::F(f64::from_bits(self.u64(&what)?)),
            t => return Err(Error::Weights(format!("`{key}`: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Map and parse a GGUF file (its tensors' bytes are read when they are used).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = FileBytes::open(path)?;
        Self::parse_bytes(bytes).map_err(|e| file_err(path, e))
    }

    /// Parse GGUF bytes.
    pub fn parse(bytes: Vec<u8>) -> Result<Self> {
        Self::parse_bytes(bytes.into())
    }

    /// Parse GGUF bytes, mapped or in memory.
    pub(crate) fn parse_bytes(bytes: FileBytes) -> Result<Self> {
        let mut r = Reader { b: &bytes, at: 0 };
        if r.take(4, "magic")? != b"GGUF" {
            return Err(Error::Weights("not a GGUF file (bad magic)".into()));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::Weights(format!("GGUF version {version} is not supported (2 or 3)")));
        }
        // a tensor entry takes at least 8 + 4 + 8 + 4 + 8 bytes, a key/value at least 8 + 4 + 1
        let n_tensors = r.count(32, "tensor count")?;
        let n_kv = r.count(13, "metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let v = r.value(ty, &key, 0)?;
            metadata.insert(key, v);
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a <= 1 << 20 && a.is_power_of_two() => a as usize,
                _ => return Err(Error::Weights(format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        let mut raw = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor {i}"))?;
            let n_dims = r.u32(&format!("dims of `{name}`"))? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::Weights(format!("tensor `{name}`: {n_dims} dimensions (1 to 4 supported)")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                let d = r.u64(&format!("dims of `{name}`"))?;
                dims.push(
                    usize::try_from(d)
                        .map_err(|_| Error::Weights(format!("tensor `{name}`: dimension {d} too large")))?,
                );
            }
            let tid = r.u32(&format!("type of `{name}`"))?;
            let ty = TensorType::from_id(tid).ok_or_else(|| {
                Error::Weights(format!(
                    "tensor `{name}`: type {tid} ({}) is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4)",
                    ggml_type_name(tid)
                ))
            })?;
            let off = r.u64(&format!("offset of `{name}`"))?;
            raw.push((name, dims, ty, off));
        }
        let data_start = r.at.next_multiple_of(align);
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty, off) in raw {
            let n = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| Error::Weights(format!("tensor `{name}`: element count overflows")))?;
            let (bl, bb) = ty.block();
            if dims[0] % bl != 0 {
                return Err(Error::Weights(format!(
                    "tensor `{name}`: rows of {} are not whole blocks of {bl}",
                    dims[0]
                )));
            }
            let size =
                (n / bl).checked_mul(bb).ok_or_else(|| Error::Weights(format!("tensor `{name}`: size overflows")))?;
            if !(off as usize).is_multiple_of(align) {
                return Err(Error::Weights(format!("tensor `{name}`: offset {off} is not aligned to {align}")));
            }
            let start = usize::try_from(off).ok().and_then(|o| data_start.checked_add(o));
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(s), Some(e)) if e <= bytes.len() => tensors.push(TensorInfo { name, dims, ty, range: s..e }),
                _ => {
                    return Err(Error::Weights(format!(
                        "tensor `{name}`: {size} bytes at offset {off} run past the end of the file ({} bytes)",
                        bytes.len()
                    )))
                }
            }
        }
        Ok(GgufFile { version, metadata, tensors, bytes })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn need_u(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(Value::as_u64)
            .filter(|&v| v <= u32::MAX as u64)
            .map(|v| v as usize)
            .ok_or_else(|| Error::Config(format!("GGUF metadata `{key}` is missing or not an integer")))
    }

    /// The bytes of a tensor of this file's table.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        self.bytes.get(t.range.clone()).unwrap_or_default()
    }

    /// A tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Tensor `t` of this file as a host tensor in PyTorch's dimension order (quantized ones
    /// as their blocks; a 3-D tensor of stacked experts as one matrix of their rows), a view of
    /// the file's bytes.
    pub fn host_tensor(&self, t: &TensorInfo) -> HostTensor<'_> {
        let dtype = match t.ty {
            TensorType::F32 => HostDtype::F32,
            TensorType::F16 => HostDtype::F16,
            TensorType::BF16 => HostDtype::BF16,
            TensorType::Quant(k) => HostDtype::Quant(k),
        };
        let shape = match t.matrix_shape() {
            Some(rows_cols) => rows_cols.to_vec(),
            None => t.dims.iter().rev().copied().collect(),
        };
        HostTensor { name: t.name.clone(), shape, dtype, bytes: self.tensor_bytes(t) }
    }

    /// A 1-D f32/f16/bf16 tensor of length `n` (or `[n, 1]`).
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name).ok_or_else(|| Error::Weights(format!("tensor `{name}` is missing")))?;
        // any shape of n values: llama.cpp's converter writes Qwen2-MoE's shared-expert gate as a
        // one-row matrix `[n, 1]` (llama-quantize then stores it as a vector), gpt-oss's expert
        // biases as `[rows, experts]`
        let vector = t.dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) == Some(n);
        if !vector || matches!(t.ty, TensorType::Quant(_)) {
            return Err(Error::Weights(format!(
                "tensor `{name}`: {:?} {:?}, expected a float vector of {n}",
                t.ty, t.dims
            )));
        }
        Ok(floats(t.ty, &self.bytes[t.range.clone()]))
    }

    /// The LoRA adapter this file holds for a model of `cfg`, as llama.cpp's
    /// `convert_lora_to_gguf.py` writes one (`general.type` `adapter`, `adapter.type` `lora`,
    /// `adapter.lora.alpha`): [`LoraAdapter::from_gguf_tensors`]. A model file is refused by name.
    pub fn lora(&self, cfg: &ModelConfig) -> Result<LoraAdapter> {
        let kind = (self.get("general.type").and_then(Value::as_str), self.get("adapter.type").and_then(Value::as_str));
        if kind != (Some("adapter"), Some("lora")) {
            return Err(Error::Weights(format!(
                "not a LoRA adapter GGUF (general.type {:?}, adapter.type {:?}; a LoRA file has \"adapter\" and \"lora\")",
                kind.0, kind.1
            )));
        }
        let alpha = self.get("adapter.lora.alpha").and_then(Value::as_f64).unwrap_or(0.0) as f32;
        if !alpha.is_finite() {
            return Err(Error::Weights(format!("adapter.lora.alpha is {alpha}, not a finite number")));
        }
        let tensors = crate::io::model_file::TensorFiles::gguf_tensors(self);
        LoraAdapter::from_gguf_tensors(alpha, &tensors, cfg)
    }

    /// The model's weights on the host (for the CPU reference; an engine loads from
    /// [`crate::io::model_file::ModelFile`] without them). For `llama`, llama.cpp stores Q and K
    /// rows permuted for its interleaved RoPE; they are put back in the half-split order kvdecode
    /// (and Hugging Face) rotate in.
    pub fn weights(&self) -> Result<ModelWeights> {
        let cfg = self.config()?;
        let file = crate::io::model_file::FileWeights { cfg, naming: Naming::Gguf, source: self };
        file.weights(&file.plan()?, &mut |_, _| {})
    }
}

fn floats(ty: TensorType, b: &[u8]) -> Vec<f32> {
    match ty {
        TensorType::F32 => b.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect(),
        TensorType::F16 => b.chunks_exact(2).map(|x| half::f16::from_le_bytes([x[0], x[1]]).to_f32()).collect(),
        TensorType::BF16 => b.chunks_exact(2).map(|x| half::bf16::from_le_bytes([x[0], x[1]]).to_f32()).collect(),
        TensorType::Quant(_) => Vec::new(),
    }
}
