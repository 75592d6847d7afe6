//! Minimal `.npy` reading and writing (little-endian f32 / i64 / i32, C order): enough for the
//! fixtures and the `logits` example.

use std::path::Path;

use crate::error::{file_err, Error, Result};

/// An array read from a `.npy` file, converted to f64 values (exact for f32 and for the i64
/// token ids we use).
#[derive(Clone, Debug)]
pub struct NpyArray {
    /// Shape.
    pub shape: Vec<usize>,
    /// Values in C order.
    pub data: Vec<f64>,
}

impl NpyArray {
    /// Values as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        self.data.iter().map(|&v| v as f32).collect()
    }
    /// Values as u32 token ids; errors on negative or too large values.
    pub fn to_u32(&self) -> Result<Vec<u32>> {
        self.data
            .iter()
            .map(|&v| {
                if v >= 0.0 && v <= u32::MAX as f64 && v.fract() == 0.0 {
                    Ok(v as u32)
                } else {
                    Err(Error::Input(format!("value {v} is not a token id")))
                }
            })
            .collect()
    }
}

/// Read a `.npy` file.
pub fn read(path: impl AsRef<Path>) -> Result<NpyArray> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| file_err(path, e))?;
    parse(&bytes).map_err(|e| file_err(path, e))
}

/// Parse `.npy` bytes.
pub fn parse(bytes: &[u8]) -> Result<NpyArray> {
    let bad = |m: &str| Error::Input(format!("npy: {m}"));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("missing magic"));
    }
    let (hlen, hstart): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(bad(&format!("unsupported version {v}"))),
    };
    let header = bytes.get(hstart..hstart.saturating_add(hlen)).ok_or_else(|| bad("truncated header"))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("header is not text"))?;
    let field = |key: &str| -> Result<&str> {
        let at = header.find(&format!("'{key}'")).ok_or_else(|| bad(&format!("no '{key}' in header")))?;
        Ok(header[at + key.len() + 2..].trim_start_matches([':', ' ']))
    };
    let descr = field("descr")?;
    let descr = descr.trim_start_matches('\'').split('\'').next().unwrap_or("");
    if field("fortran_order")?.starts_with("True") {
        return Err(bad("fortran order is not supported"));
    }
    let shape_s = field("shape")?;
    let shape_s = shape_s.trim_start_matches('(').split(')').next().unwrap_or("");
    let shape = shape_s
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| bad("bad shape")))
        .collect::<Result<Vec<_>>>()?;
    let count = shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| bad("shape overflows"))?;
    let body = &bytes[hstart + hlen..];
    let (size, conv): (usize, fn(&[u8]) -> f64) = match descr {
        "<f4" => (4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64),
        "<f8" => (8, |b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8]))),
        "<i8" => (8, |b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f64),
        "<i4" => (4, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64),
        d => return Err(bad(&format!("dtype {d} is not supported (f4, f8, i4, i8)"))),
    };
    if body.len() < count.saturating_mul(size) {
        return Err(bad(&format!("body has {} bytes, shape {shape:?} needs {}", body.len(), count * size)));
    }
    let data = body[..count * size].chunks_exact(size).map(conv).collect();
    Ok(NpyArray { shape, data })
}

/// Write an f32 array.
pub fn write_f32(path: impl AsRef<Path>, shape: &[usize], data: &[f32]) -> Result<()> {
    let path = path.as_ref();
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_s}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, out).map_err(|e| file_err(path, e))
}
