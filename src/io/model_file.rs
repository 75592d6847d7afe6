//! Open what users point at: a GGUF file, a Hugging Face directory (`config.json` +
//! `*.safetensors`, `tokenizer.json` when present) or a kvdecode/TinyAgent `.safetensors` file.
//! One place decides which reader a path needs, for every example and application.

use std::path::Path;

use crate::error::{file_err, Error, Result};
use crate::io::gguf::{GgufFile, TensorType};
use crate::io::tokenizer::Tokenizer;
use crate::model::tensor::{HostDtype, HostTensor};
use crate::model::weights::ModelWeights;

/// A model's weights and, when the files carry one, its tokenizer.
pub struct LoadedModel {
    /// The weights.
    pub weights: ModelWeights,
    /// The tokenizer (GGUF metadata or `tokenizer.json`); kvdecode safetensors have none.
    pub tokenizer: Option<Tokenizer>,
}

fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gguf")
}

/// Load the model at `path`, calling `progress(layers_done, layers)` while a GGUF file's layers
/// are read.
pub fn load(path: impl AsRef<Path>, progress: &mut dyn FnMut(usize, usize)) -> Result<LoadedModel> {
    let path = path.as_ref();
    if path.is_dir() {
        let tj = path.join("tokenizer.json");
        let tokenizer = if tj.exists() { Some(Tokenizer::from_file(&tj)?) } else { None };
        Ok(LoadedModel { weights: crate::io::hf::load_dir(path)?, tokenizer })
    } else if is_gguf(path) {
        let g = GgufFile::open(path)?;
        Ok(LoadedModel { weights: g.weights_with_progress(progress)?, tokenizer: Tokenizer::from_gguf_if_any(&g)? })
    } else {
        Ok(LoadedModel { weights: ModelWeights::load_safetensors(path)?, tokenizer: None })
    }
}

/// Only the tokenizer of the model at `path` (no weights are read), if it has one.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Option<Tokenizer>> {
    let path = path.as_ref();
    if path.is_dir() {
        let tj = path.join("tokenizer.json");
        if tj.exists() {
            return Tokenizer::from_file(&tj).map(Some);
        }
        Ok(None)
    } else if is_gguf(path) {
        Tokenizer::from_gguf_if_any(&GgufFile::open(path)?)
    } else {
        Ok(None)
    }
}

/// The tensors of a file or directory, read for [`crate::Engine::update_weights_from_path`]: a
/// safetensors file, a Hugging Face directory (every `*.safetensors` in it) or a GGUF file.
pub enum TensorFiles {
    /// Safetensors files' bytes.
    Safetensors(Vec<(std::path::PathBuf, Vec<u8>)>),
    /// A parsed GGUF file.
    Gguf(GgufFile),
}

impl TensorFiles {
    /// Read the file or directory at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if is_gguf(path) {
            return GgufFile::open(path).map(TensorFiles::Gguf);
        }
        let mut files = vec![path.to_path_buf()];
        if path.is_dir() {
            files = std::fs::read_dir(path)
                .map_err(|e| file_err(path, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(file_err(path, "no *.safetensors file in the directory"));
            }
        }
        let read = |p: std::path::PathBuf| std::fs::read(&p).map_err(|e| file_err(&p, e)).map(|b| (p, b));
        files.into_iter().map(read).collect::<Result<_>>().map(TensorFiles::Safetensors)
    }

    /// A GGUF file's tensors by their names, in PyTorch's dimension order (quantized ones as
    /// their blocks; a 3-D tensor of stacked experts as one matrix of their rows).
    pub fn gguf_tensors(g: &GgufFile) -> Vec<HostTensor<'_>> {
        g.tensors
            .iter()
            .map(|t| {
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
                HostTensor { name: t.name.clone(), shape, dtype, bytes: g.tensor_bytes(t) }
            })
            .collect()
    }

    /// Every tensor, as views of the bytes read (GGUF's `[cols, rows]` dims as `[rows, cols]`).
    pub fn tensors(&self) -> Result<Vec<HostTensor<'_>>> {
        let mut out = Vec::new();
        match self {
            TensorFiles::Gguf(g) => out = Self::gguf_tensors(g),
            TensorFiles::Safetensors(files) => {
                for (path, bytes) in files {
                    let st = safetensors::SafeTensors::deserialize(bytes)
                        .map_err(|e| file_err(path, format!("not a valid safetensors file: {e}")))?;
                    for (name, view) in st.tensors() {
                        let dtype = match view.dtype() {
                            safetensors::Dtype::F32 => HostDtype::F32,
                            safetensors::Dtype::F16 => HostDtype::F16,
                            safetensors::Dtype::BF16 => HostDtype::BF16,
                            // Engram's compressed ids are not a weight an update can change
                            _ if name == "cid_map" => continue,
                            other => {
                                return Err(Error::Weights(format!(
                                    "tensor `{name}` has dtype {other:?}; an update takes F32, F16 or BF16"
                                )))
                            }
                        };
                        out.push(HostTensor { name, shape: view.shape().to_vec(), dtype, bytes: view.data() });
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A LoRA adapter for a model of `cfg` from `path`: a PEFT folder (`adapter_config.json` and
/// `adapter_model.safetensors`) or a GGUF LoRA file as llama.cpp's `convert_lora_to_gguf.py`
/// writes it (llama-server's `--lora`).
pub fn open_lora(
    path: impl AsRef<Path>,
    cfg: &crate::model::config::ModelConfig,
) -> Result<crate::model::lora::LoraAdapter> {
    let path = path.as_ref();
    if path.is_dir() {
        return crate::model::lora::LoraAdapter::from_peft_dir(path, cfg);
    }
    GgufFile::open(path)?.lora(cfg).map_err(|e| file_err(path, e))
}
