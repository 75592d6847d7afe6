//! kvdecode's own safetensors files (the TinyAgent layout, config in the `kvdecode.config`
//! metadata): its config, writing whole [`ModelWeights`], and `TensorFile`, the by-name reader
//! of the parts the loader (`io/model_file.rs`) converts: MXFP4 blocks and Engram's ids.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{file_err, Error, Result};
use crate::model::config::ModelConfig;
use crate::model::family::{tensors_of, Naming};
use crate::model::weights::ModelWeights;

/// The [`ModelConfig`] in a kvdecode safetensors file's `kvdecode.config` metadata.
pub(crate) fn kvdecode_config(bytes: &[u8]) -> Result<ModelConfig> {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::Weights(format!("not a safetensors file: {e}")))?;
    let cfg_json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(CONFIG_KEY))
        .ok_or_else(|| Error::Weights(format!("no `{CONFIG_KEY}` metadata (is this a kvdecode model?)")))?;
    let cfg: ModelConfig =
        serde_json::from_str(cfg_json).map_err(|e| Error::Weights(format!("bad `{CONFIG_KEY}` metadata: {e}")))?;
    cfg.validate()?;
    Ok(cfg)
}

impl ModelWeights {
    /// Load a kvdecode/TinyAgent safetensors file (config in the `kvdecode.config` metadata)
    /// onto the host.
    pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Self> {
        crate::io::model_file::ModelFile::open(path)?.weights()
    }

    /// Parse a kvdecode/TinyAgent safetensors file from memory.
    pub fn from_safetensors_bytes(bytes: &[u8]) -> Result<Self> {
        crate::io::model_file::ModelFile::from_safetensors_bytes(bytes.to_vec())?.weights()
    }

    /// Save as safetensors in the TinyAgent naming, with the config in the metadata.
    pub fn save_safetensors(&self, path: impl AsRef<Path>, dtype: DiskDtype) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_safetensors_bytes(dtype)?;
        std::fs::write(path, bytes).map_err(|e| file_err(path, e))
    }

    /// Serialize as safetensors bytes (see [`ModelWeights::save_safetensors`]).
    pub fn to_safetensors_bytes(&self, dtype: DiskDtype) -> Result<Vec<u8>> {
        // every tensor by kvdecode's names from the one table the loader reads them back by
        // (model/family/names.rs), so a slot added there is saved without a second list here
        let named = tensors_of(self, Naming::Kvdecode);
        let mut encoded: Vec<(String, Vec<usize>, Vec<u8>, safetensors::Dtype)> =
            named.into_iter().map(|(t, values)| (t.name, t.shape, dtype.encode(&values), dtype.st())).collect();
        if let Some(c) = &self.cid_map {
            encoded.push((
                "cid_map".into(),
                vec![c.len()],
                c.iter().flat_map(|v| v.to_le_bytes()).collect(),
                safetensors::Dtype::U32,
            ));
        }
        let views = encoded
            .iter()
            .map(|(n, s, b, dt)| {
                safetensors::tensor::TensorView::new(*dt, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| Error::Weights(format!("{n}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let cfg = serde_json::to_string(&self.cfg).map_err(|e| Error::Weights(e.to_string()))?;
        let meta = HashMap::from([(CONFIG_KEY.to_string(), cfg)]);
        safetensors::tensor::serialize(views, Some(meta)).map_err(|e| Error::Weights(e.to_string()))
    }
}

/// Metadata key holding the JSON [`ModelConfig`] in kvdecode safetensors files.
pub const CONFIG_KEY: &str = "kvdecode.config";

/// Element type written to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
}

impl DiskDtype {
    fn st(self) -> safetensors::Dtype {
        match self {
            DiskDtype::F32 => safetensors::Dtype::F32,
            DiskDtype::F16 => safetensors::Dtype::F16,
            DiskDtype::BF16 => safetensors::Dtype::BF16,
        }
    }
    fn encode(self, x: &[f32]) -> Vec<u8> {
        match self {
            DiskDtype::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DiskDtype::F16 => x.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            DiskDtype::BF16 => x.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        }
    }
}

/// A parsed safetensors file whose tensors are read by name.
pub(crate) struct TensorFile<'a> {
    st: safetensors::SafeTensors<'a>,
}

impl<'a> TensorFile<'a> {
    pub(crate) fn parse(bytes: &'a [u8]) -> Result<Self> {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| Error::Weights(format!("not a valid safetensors file: {e}")))?;
        Ok(TensorFile { st })
    }

    /// A matrix stored in OpenAI's MXFP4 checkpoint layout (gpt-oss's experts): `{name}_blocks`
    /// `[n, rows, groups, 16]` u8, two E2M1 values a byte (element 2i in the low nibble, 2i + 1
    /// in the high one), and `{name}_scales` `[n, rows, groups]` u8 (E8M0: 2^(s - 127)), in
    /// `[out, in]` order (the same tensor unquantized is transposed). Kept in MXFP4 blocks as the
    /// GPU reads them, llama.cpp's layout (the scale byte, then element j in the low nibble of
    /// byte j and element j + 16 in its high nibble): the blocks of the matrix
    /// `[n * rows, 32 * groups]`, with those two dims. The two may sit in different files of a
    /// sharded checkpoint.
    pub(crate) fn mxfp4_stack(blocks: &TensorFile, scales: &TensorFile, name: &str) -> Result<(usize, usize, Vec<u8>)> {
        let (bn, sn) = (format!("{name}_blocks"), format!("{name}_scales"));
        let missing = |n: &str| Error::Weights(format!("tensor `{n}` is missing"));
        let (b, s) =
            (blocks.st.tensor(&bn).map_err(|_| missing(&bn))?, scales.st.tensor(&sn).map_err(|_| missing(&sn))?);
        for (n, t) in [(&bn, &b), (&sn, &s)] {
            if t.dtype() != safetensors::Dtype::U8 {
                return Err(Error::Weights(format!("tensor `{n}` has dtype {:?}, expected U8 (MXFP4)", t.dtype())));
            }
        }
        let &[n, rows, groups, 16] = b.shape() else {
            return Err(Error::Weights(format!(
                "tensor `{bn}` has shape {:?}, expected [n, rows, groups, 16]",
                b.shape()
            )));
        };
        if s.shape() != [n, rows, groups] {
            return Err(Error::Weights(format!(
                "tensor `{sn}` has shape {:?}, expected {:?}",
                s.shape(),
                [n, rows, groups]
            )));
        }
        let mut out = Vec::with_capacity(n * rows * groups * 17);
        for (blk, &scale) in b.data().chunks_exact(16).zip(s.data()) {
            out.push(scale);
            let nibble = |k: usize| (blk[k / 2] >> (4 * (k % 2))) & 0xF;
            out.extend((0..16).map(|j| nibble(j) | (nibble(j + 16) << 4)));
        }
        Ok((n * rows, 32 * groups, out))
    }

    /// A 1-D integer tensor (U32, I32 or I64 with values in u32) as u32 ids.
    pub(crate) fn ids(&self, name: &str) -> Result<Vec<u32>> {
        let t = self.st.tensor(name).map_err(|_| Error::Weights(format!("tensor `{name}` is missing")))?;
        if t.shape().len() != 1 {
            return Err(Error::Weights(format!("tensor `{name}` has shape {:?}, expected 1 dim", t.shape())));
        }
        let d = t.data();
        let vals: Vec<i64> = match t.dtype() {
            safetensors::Dtype::U32 => {
                d.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect()
            }
            safetensors::Dtype::I32 => {
                d.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect()
            }
            safetensors::Dtype::I64 => {
                d.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect()
            }
            other => {
                return Err(Error::Weights(format!("tensor `{name}` has dtype {other:?}; expected U32, I32 or I64")))
            }
        };
        vals.into_iter()
            .map(|v| {
                u32::try_from(v).map_err(|_| Error::Weights(format!("tensor `{name}`: value {v} is not a u32 id")))
            })
            .collect()
    }
}
