//! Models and their tokenizers.

use std::path::PathBuf;
use std::sync::Arc;

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::{invalid, to_py, token_ids, Weights};

/// Most parameters `Model.random` makes (1 GiB of f32 per 2^28): random models are for tests.
const RANDOM_MAX_PARAMS: usize = 1 << 28;

/// A model (and its tokenizer, when the files carry one): weights on the CPU, or a file whose
/// tensors an engine streams onto the GPU, read onto the CPU only where asked (`state_dict`,
/// `reference_logits`).
#[pyclass(module = "kvdecode._kvdecode", frozen)]
pub struct Model {
    source: Source,
    tokenizer: Option<Py<Tokenizer>>,
}

/// Where a [`Model`]'s weights are.
enum Source {
    Memory(Weights),
    /// The file, and its weights on the host once something asked for them.
    File(Arc<kvdecode::io::model_file::ModelFile>, std::sync::OnceLock<Weights>),
}

impl Model {
    fn memory(weights: kvdecode::ModelWeights) -> Model {
        Model { source: Source::Memory(Arc::new(weights)), tokenizer: None }
    }

    fn cfg(&self) -> &kvdecode::ModelConfig {
        match &self.source {
            Source::Memory(w) => &w.cfg,
            Source::File(f, _) => f.config(),
        }
    }

    /// The weights on the host (a file's read at the first call, then kept).
    fn host(&self, py: Python<'_>) -> PyResult<Weights> {
        match &self.source {
            Source::Memory(w) => Ok(w.clone()),
            Source::File(f, kept) => {
                if let Some(w) = kept.get() {
                    return Ok(w.clone());
                }
                let w = Arc::new(py.detach(|| f.weights()).map_err(to_py)?);
                Ok(kept.get_or_init(|| w).clone())
            }
        }
    }

    /// An engine of this model (a file's tensors streamed onto the GPU, no host copy).
    pub(crate) fn engine(
        &self,
        py: Python<'_>,
        gpu: &kvdecode::Gpu,
        opts: kvdecode::EngineOptions,
    ) -> PyResult<kvdecode::Engine> {
        match &self.source {
            Source::Memory(w) => py.detach(|| kvdecode::Engine::new(gpu, w, opts)).map_err(to_py),
            Source::File(f, _) => py.detach(|| kvdecode::Engine::from_file(gpu, f, opts)).map_err(to_py),
        }
    }
}

/// Open a GGUF file, a Hugging Face directory (`config.json`, `*.safetensors`, `tokenizer.json`)
/// or a kvdecode safetensors file: its config and tokenizer are read, its tensors mapped (an
/// engine streams them onto the GPU); the GIL is released while it reads.
#[pyfunction]
pub fn load(py: Python<'_>, path: PathBuf) -> PyResult<Model> {
    let mut file = py.detach(|| kvdecode::io::model_file::ModelFile::open(&path)).map_err(to_py)?;
    let tokenizer = match file.tokenizer.take() {
        Some(t) => Some(Py::new(py, Tokenizer { inner: Arc::new(t) })?),
        None => None,
    };
    Ok(Model { source: Source::File(Arc::new(file), std::sync::OnceLock::new()), tokenizer })
}

#[pymethods]
impl Model {
    /// The built-in demo model (seeded random weights, TinyAgent layout with Engram layers, vocab
    /// 512): no download, for tests and examples.
    #[staticmethod]
    fn demo() -> Model {
        Model::memory(kvdecode::ModelWeights::demo())
    }

    /// A seeded random TinyAgent-layout model: `layers` layers in groups of `group` (one global
    /// layer per group, the rest sliding-window layers of `window` tokens).
    #[staticmethod]
    #[pyo3(signature = (*, vocab=256, d_model=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=4, group=2, window=8, seed=7))]
    #[allow(clippy::too_many_arguments)]
    fn random(
        vocab: usize,
        d_model: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        ffn: usize,
        layers: usize,
        group: usize,
        window: usize,
        seed: u64,
    ) -> PyResult<Model> {
        // checked before anything is allocated: a failed allocation would abort the interpreter
        let dims = [("d_model", d_model), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)];
        let dims = [dims.as_slice(), &[("ffn", ffn), ("window", window)]].concat();
        kvdecode::model::config::check_file_dims(layers, vocab, &dims).map_err(to_py)?;
        let per_layer = d_model.saturating_mul((heads + 4 * kv_heads).saturating_mul(head_dim) + 2 * ffn);
        let params = per_layer.saturating_mul(layers).saturating_add(vocab.saturating_mul(d_model).saturating_mul(2));
        if params > RANDOM_MAX_PARAMS {
            return Err(invalid(format!(
                "a random model of about {params} parameters is more than the {RANDOM_MAX_PARAMS} allowed"
            )));
        }
        let cfg =
            kvdecode::ModelConfig::tiny_agent(vocab, d_model, heads, kv_heads, head_dim, ffn, layers, group, window);
        let weights = kvdecode::ModelWeights::random(&cfg, seed).map_err(to_py)?;
        Ok(Model::memory(weights))
    }

    /// The weights by name, as f32 numpy arrays: `naming` is `"kvdecode"` (every model), `"hf"`
    /// (Hugging Face names) or `"gguf"` (GGUF names; Llama's q and k rows in llama.cpp's order),
    /// the latter two for the families that have them. What `Engine.load_weights` takes.
    #[pyo3(signature = (naming="kvdecode"))]
    fn state_dict<'py>(&self, py: Python<'py>, naming: &str) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        use kvdecode::model::family::Naming;
        let naming = match naming {
            "kvdecode" => Naming::Kvdecode,
            "hf" => Naming::HuggingFace("model."),
            "gguf" => Naming::Gguf,
            other => return Err(invalid(format!("naming {other:?}: expected kvdecode, hf or gguf"))),
        };
        let out = pyo3::types::PyDict::new(py);
        let weights = self.host(py)?;
        for (t, values) in kvdecode::model::family::tensors_of(&weights, naming) {
            let array = numpy::ndarray::ArrayD::from_shape_vec(t.file_shape(), values)
                .map_err(|e| invalid(format!("tensor `{}`: {e}", t.name)))?;
            out.set_item(t.name, array.into_pyarray(py))?;
        }
        Ok(out)
    }

    /// The tokenizer, or `None` (kvdecode safetensors files and the demo model have none).
    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> Option<Py<Tokenizer>> {
        self.tokenizer.as_ref().map(|t| t.clone_ref(py))
    }

    /// The model's configuration as JSON (the Python layer exposes it as a dict).
    #[getter]
    fn config_json(&self) -> PyResult<String> {
        serde_json::to_string(self.cfg()).map_err(|e| invalid(format!("config: {e}")))
    }

    /// Vocabulary size (rows of the logits).
    #[getter]
    fn vocab(&self) -> usize {
        self.cfg().vocab
    }

    /// Logits `[len(tokens), vocab]` of the crate's CPU reference (f32, one sequence, no cache):
    /// what the engine is tested against.
    fn reference_logits<'py>(
        &self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids = token_ids(tokens.as_slice()?, "tokens")?;
        let w = self.host(py)?;
        let data = py.detach(|| kvdecode::model::reference::forward(&w, &ids)).map_err(to_py)?;
        let v = w.cfg.vocab;
        let arr = Array2::from_shape_vec((ids.len(), v), data).map_err(|e| invalid(format!("reference: {e}")))?;
        Ok(arr.into_pyarray(py))
    }

    fn __repr__(&self) -> String {
        let c = self.cfg();
        format!(
            "Model(vocab={}, d_model={}, layers={}, heads={}/{}, head_dim={}, window={})",
            c.vocab,
            c.d_model,
            c.layers.len(),
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.window
        )
    }
}

/// A model's tokenizer and chat template.
#[pyclass(module = "kvdecode._kvdecode", frozen)]
pub struct Tokenizer {
    inner: Arc<kvdecode::io::tokenizer::Tokenizer>,
}

#[pymethods]
impl Tokenizer {
    /// Token ids of `text` (special tokens written in it are parsed; BOS when the model wants it).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        self.inner.encode(text).map_err(to_py)
    }

    /// Text of `ids`.
    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(&self, ids: Vec<i64>, skip_special_tokens: bool) -> PyResult<String> {
        self.inner.decode(&token_ids(&ids, "ids")?, skip_special_tokens).map_err(to_py)
    }

    /// Render the model's chat template for `messages_json` (a JSON list of `{role, content}`);
    /// `tools_json` is the OpenAI-style tools list, when given. `tokenize` returns ids instead of
    /// text (BOS not doubled when the template writes it).
    #[pyo3(signature = (messages_json, add_generation_prompt=true, tools_json=None, tokenize=false))]
    fn apply_chat_template_json(
        &self,
        py: Python<'_>,
        messages_json: &str,
        add_generation_prompt: bool,
        tools_json: Option<&str>,
        tokenize: bool,
    ) -> PyResult<Py<PyAny>> {
        let messages: Vec<kvdecode::io::tokenizer::Message> =
            serde_json::from_str(messages_json).map_err(|e| invalid(format!("messages: {e}")))?;
        let tools: Option<serde_json::Value> = match tools_json {
            Some(t) => Some(serde_json::from_str(t).map_err(|e| invalid(format!("tools: {e}")))?),
            None => None,
        };
        let text = self
            .inner
            .apply_chat_template_with_tools(&messages, tools.as_ref(), add_generation_prompt)
            .map_err(to_py)?;
        if tokenize {
            Ok(self.inner.encode_rendered(&text).map_err(to_py)?.into_pyobject(py)?.into_any().unbind())
        } else {
            Ok(text.into_pyobject(py)?.into_any().unbind())
        }
    }

    /// The id of a token string, or `None`.
    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_id(token)
    }

    /// Vocabulary size, added tokens included.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Tokens that end an assistant turn (EOS and the usual end-of-turn markers).
    #[getter]
    fn end_of_turn(&self) -> Vec<u32> {
        self.inner.end_of_turn()
    }

    fn __repr__(&self) -> String {
        format!("Tokenizer(vocab_size={})", self.inner.vocab_size())
    }
}
