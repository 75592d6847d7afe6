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
        self.check_shape(want)?;
        self.check_values(0..self.elements())
    }

    /// Elements in the tensor (its bytes hold that many once [`HostTensor::check_shape`] passed).
    pub(crate) fn elements(&self) -> usize {
        self.rows() * self.cols()
    }

    /// [`HostTensor::check`] without the values: dims, byte length, whole blocks.
    pub(crate) fn check_shape(&self, want: &[usize]) -> Result<()> {
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
        Ok(())
    }

    /// That the elements in `range` are finite (quantized tensors: all of them, whatever the
    /// range says); the error names the tensor and the element. The shape has been checked.
    pub(crate) fn check_values(&self, range: std::ops::Range<usize>) -> Result<()> {
        // an exponent of all ones is an infinity or a NaN
        let (mask, size) = match self.dtype {
            HostDtype::F32 => (0x7f80_0000, 4),
            HostDtype::F16 => (0x7c00, 2),
            HostDtype::BF16 => (0x7f80, 2),
            HostDtype::Quant(k) => {
                let bad = dequantize(k, self.bytes, self.elements())?.iter().position(|v| !v.is_finite());
                return bad.map_or(Ok(()), |i| self.not_finite(i));
            }
        };
        let bytes = &self.bytes[range.start * size..range.end * size];
        // f32 values where they lie aligned (a trainer's arrays do): a fold the compiler vectorizes
        if let (HostDtype::F32, Ok(values)) = (self.dtype, bytemuck::try_cast_slice::<u8, f32>(bytes)) {
            if !values.iter().fold(false, |bad, v| bad | !v.is_finite()) {
                return Ok(());
            }
        }
        match first_all_ones(bytes, mask, size) {
            Some(i) => self.not_finite(range.start + i),
            None => Ok(()),
        }
    }

    fn not_finite(&self, i: usize) -> Result<()> {
        Err(Error::Weights(format!("tensor `{}`: element {i} is not finite", self.name)))
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
        if self.dtype == HostDtype::F32 {
            // one copy at memory speed (a LoRA push is mostly this)
            return bytemuck::pod_collect_to_vec(&self.bytes[..self.elements() * 4]);
        }
        let mut out = Vec::with_capacity(self.elements());
        for r in 0..self.rows() {
            out.extend(self.row_f32(r));
        }
        out
    }
}

/// The index of the first little-endian element of `size` bytes (2 or 4) whose bits under `mask`
/// are all set, if any.
pub(crate) fn first_all_ones(bytes: &[u8], mask: u32, size: usize) -> Option<usize> {
    match size {
        2 => first_all_ones_of::<2>(bytes, mask),
        _ => first_all_ones_of::<4>(bytes, mask),
    }
}

/// [`first_all_ones`] for elements of `N` bytes: blocks are checked with no branch per element
/// (a fold the compiler vectorizes: a trainer's push is checked at memory speed), and only a
/// block with a hit is searched element by element.
fn first_all_ones_of<const N: usize>(bytes: &[u8], mask: u32) -> Option<usize> {
    const BLOCK: usize = 4096;
    let hit = |b: &[u8]| {
        let mut v = 0u32;
        for (k, &byte) in b.iter().enumerate().take(N) {
            v |= (byte as u32) << (8 * k);
        }
        v & mask == mask
    };
    for (i, block) in bytes.chunks(BLOCK).enumerate() {
        if block.chunks_exact(N).fold(false, |any, b| any | hit(b)) {
            return block.chunks_exact(N).position(hit).map(|k| i * (BLOCK / N) + k);
        }
    }
    None
}

/// Every value of `tensors` finite (a weight update's, an adapter update's), checked in slices of about 4 MiB spread over the CPU's
/// threads (a trainer's push is checked at memory speed, not one core's): the first bad element,
/// in tensor order, is the error.
pub(crate) fn check_all_values(tensors: &[&HostTensor]) -> Result<()> {
    const SLICE: usize = 4 << 20;
    let mut work = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let n = t.elements();
        // quantized tensors are checked whole, by dequantizing them
        let step = match t.dtype {
            HostDtype::Quant(_) => n.max(1),
            _ => (SLICE / (t.bytes.len() / n.max(1)).max(1)).max(1),
        };
        work.extend((0..n).step_by(step).map(|a| (i, a..(a + step).min(n))));
    }
    // a thread per 8 MiB at most: spawning one costs about 0.2 ms here, as long as checking
    // 1.5 MiB does
    #[cfg(not(target_arch = "wasm32"))]
    let threads = {
        let bytes: usize = tensors.iter().map(|t| t.bytes.len()).sum();
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(bytes >> 23).max(1)
    };
    #[cfg(target_arch = "wasm32")]
    let threads = 1;
    let run = |k: usize| -> Option<((usize, usize), Error)> {
        let mut mine = work.iter().skip(k).step_by(threads);
        mine.find_map(|(i, r)| tensors[*i].check_values(r.clone()).err().map(|e| ((*i, r.start), e)))
    };
    let mut bad: Vec<((usize, usize), Error)> = if threads > 1 {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads).map(|k| s.spawn(move || run(k))).collect();
            handles.into_iter().filter_map(|h| h.join().ok().flatten()).collect()
        })
    } else {
        run(0).into_iter().collect()
    };
    bad.sort_by_key(|b| b.0);
    bad.into_iter().next().map_or(Ok(()), |(_, e)| Err(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_found_where_they_are() {
        let f32s: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 1, 5, 31, 32, 36] {
                let mut v = f32s.clone();
                v[at] = bad;
                assert_eq!(first_all_ones(bytemuck::cast_slice(&v), 0x7f80_0000, 4), Some(at));
                let h: Vec<u8> = v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
                assert_eq!(first_all_ones(&h, 0x7c00, 2), Some(at));
                let b: Vec<u8> = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
                assert_eq!(first_all_ones(&b, 0x7f80, 2), Some(at));
            }
        }
        // the largest finite values and subnormals are finite
        let edge = [f32::MAX, f32::MIN, 1e-40, -0.0];
        assert_eq!(first_all_ones(bytemuck::cast_slice(&edge), 0x7f80_0000, 4), None);
        let h: Vec<u8> =
            [65504.0f32, -65504.0, 6e-8, 0.0].iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
        assert_eq!(first_all_ones(&h, 0x7c00, 2), None);
        assert_eq!(first_all_ones(bytemuck::cast_slice(&f32s), 0x7f80_0000, 4), None);
    }
}
