//! Tensors on the host as a trainer or a file hands them over: a name, a shape and little-endian
//! elements in f32, f16, bf16 or llama.cpp's quantized blocks. [`crate::Engine::update_weights`]
//! takes them; nothing here is trusted until [`HostTensor::check`] has passed.

use crate::error::{Error, Result};
use crate::model::quant::{dequantize, QuantKind};

/// The element type of a [`HostTensor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostDtype {
    /// 32-bit floats.
    F32,
    /// IEEE halves.
    F16,
    /// bfloat16.
    BF16,
    /// llama.cpp's blocks (a GGUF file's quantized tensors); rows are whole blocks.
    Quant(QuantKind),
}

impl HostDtype {
    /// The name a user writes (`"f32"`, `"f16"`, `"bf16"`), also accepted in PyTorch's and
    /// numpy's spellings (`"float32"`, `"torch.bfloat16"`, ...).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim_start_matches("torch.") {
            "f32" | "float32" | "float" => Ok(HostDtype::F32),
            "f16" | "float16" | "half" => Ok(HostDtype::F16),
            "bf16" | "bfloat16" => Ok(HostDtype::BF16),
            other => Err(Error::Input(format!("tensor dtype {other:?} is not supported (f32, f16 or bf16)"))),
        }
    }

    /// Bytes of a row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            HostDtype::F32 => cols.checked_mul(4),
            HostDtype::F16 | HostDtype::BF16 => cols.checked_mul(2),
            HostDtype::Quant(k) => cols.is_multiple_of(k.block_len()).then(|| cols / k.block_len() * k.block_bytes()),
        }
    }
}

/// A named tensor on the host: row-major, little-endian. Vectors have one dimension; matrices
/// `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct HostTensor<'a> {
    /// The tensor's name in any naming kvdecode reads (Hugging Face, GGUF, kvdecode's).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element type.
    pub dtype: HostDtype,
    /// Its elements.
    pub bytes: &'a [u8],
}

impl<'a> HostTensor<'a> {
    /// A tensor of f32 values.
    pub fn f32(name: impl Into<String>, shape: &[usize], values: &'a [f32]) -> Self {
        HostTensor {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: HostDtype::F32,
            bytes: bytemuck::cast_slice(values),
        }
    }

    /// Rows (the length of a vector).
    pub(crate) fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    /// Elements per row (1 for a vector).
    pub(crate) fn cols(&self) -> usize {
        self.shape.get(1).copied().unwrap_or(1)
    }

    /// Bytes of one row.
    pub(crate) fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols()).unwrap_or(0)
    }

    /// Check the tensor against the shape its name has in the model: dims, byte length, whole
    /// blocks, and that every value is finite. The error names the tensor.
    pub fn check(&self, want: &[usize]) -> Result<()> {
        let name = &self.name;
        if self.shape != want {
            return Err(Error::Weights(format!("tensor `{name}`: shape {:?}, this model's is {want:?}", self.shape)));
        }
        let Some(row) = self.dtype.row_bytes(self.cols()) else {
            return Err(Error::Weights(format!(
                "tensor `{name}`: {:?} rows of {} values are not whole blocks",
                self.dtype,
                self.cols()
            )));
        };
        let len = row.checked_mul(self.rows());
        if len != Some(self.bytes.len()) {
            return Err(Error::Weights(format!(
                "tensor `{name}`: {} bytes for shape {:?} in {:?} (expected {})",
                self.bytes.len(),
                self.shape,
                self.dtype,
                len.map_or("more than memory holds".into(), |n| n.to_string())
            )));
        }
        let bad = match self.dtype {
            // an exponent of all ones is an infinity or a NaN
            HostDtype::F32 => self.bytes.chunks_exact(4).position(|b| b[3] & 0x7f == 0x7f && b[2] & 0x80 != 0),
            HostDtype::F16 => self.bytes.chunks_exact(2).position(|b| b[1] & 0x7c == 0x7c),
            HostDtype::BF16 => self.bytes.chunks_exact(2).position(|b| b[1] & 0x7f == 0x7f && b[0] & 0x80 != 0),
            HostDtype::Quant(k) => {
                dequantize(k, self.bytes, self.rows() * self.cols())?.iter().position(|v| !v.is_finite())
            }
        };
        match bad {
            Some(i) => Err(Error::Weights(format!("tensor `{name}`: element {i} is not finite"))),
            None => Ok(()),
        }
    }

    /// The raw bytes of row `r`.
    pub(crate) fn row_raw(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes[r * rb..(r + 1) * rb]
    }

    /// Row `r` as f32 (quantized blocks dequantized).
    pub(crate) fn row_f32(&self, r: usize) -> Vec<f32> {
        let raw = self.row_raw(r);
        match self.dtype {
            HostDtype::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            HostDtype::F16 => raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            HostDtype::BF16 => raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            // `check` dequantized every block already: this cannot fail on a checked tensor
            HostDtype::Quant(k) => dequantize(k, raw, self.cols()).unwrap_or_default(),
        }
    }

    /// Every value as f32 (vectors).
    pub(crate) fn values_f32(&self) -> Vec<f32> {
        (0..self.rows()).flat_map(|r| self.row_f32(r)).collect()
    }
}
