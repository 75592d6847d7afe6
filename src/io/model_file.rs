//! Open what users point at: a GGUF file, a Hugging Face directory (`config.json` +
//! `*.safetensors`, `tokenizer.json` when present) or a kvdecode/TinyAgent `.safetensors` file.
//! One place decides which reader a path needs, for every example and application.

use std::path::Path;

use crate::error::Result;
use crate::io::gguf::GgufFile;
use crate::io::tokenizer::Tokenizer;
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
        Ok(LoadedModel { weights: g.weights_with_progress(progress)?, tokenizer: Some(Tokenizer::from_gguf(&g)?) })
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
        Tokenizer::from_gguf(&GgufFile::open(path)?).map(Some)
    } else {
        Ok(None)
    }
}
