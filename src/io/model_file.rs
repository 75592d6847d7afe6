//! Open what users point at: a GGUF file, a Hugging Face directory (`config.json` +
//! `*.safetensors`, `tokenizer.json` when present) or a kvdecode/TinyAgent `.safetensors` file.
//! One place decides which reader a path needs, for every example and application.
//!
//! [`ModelFile`] is a model opened for loading: its config and tokenizer read, its tensors mapped
//! (`io/mapped.rs`), not read. An engine loads from it tensor by tensor
//! ([`crate::Engine::from_file`]); [`ModelFile::weights`] reads the whole model onto the host for
//! the CPU reference, through the same plan and the same names.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{file_err, Error, Result};
use crate::io::gguf::GgufFile;
use crate::io::mapped::FileBytes;
use crate::io::safetensors::TensorFile;
use crate::io::tokenizer::Tokenizer;
use crate::model::config::ModelConfig;
use crate::model::family::{
    naming_norm, stream, tensor_names, FileTensor, Naming, Place, Stored, TensorName, WeightPlan, HF_PREFIXES,
};
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

/// Load the model at `path` onto the host, calling `progress(tensors_done, tensors)` as its
/// tensors are read ([`ModelFile::open`], then [`ModelFile::weights`]).
pub fn load(path: impl AsRef<Path>, progress: &mut dyn FnMut(usize, usize)) -> Result<LoadedModel> {
    let mut file = ModelFile::open(path)?;
    let weights = file.weights_with_progress(progress)?;
    Ok(LoadedModel { weights, tokenizer: file.tokenizer.take() })
}

/// Where a loader finds a file's tensors by the names of its naming.
pub(crate) trait TensorSource {
    /// The tensor `spec` names, as the file holds it (`None`: the file has no such tensor).
    fn find(&self, spec: &TensorName) -> Result<Option<FileTensor<'_>>>;
    /// How the file stores it and its shape there, from its header alone.
    fn stored(&self, spec: &TensorName) -> Result<Option<(Stored, Vec<usize>)>> {
        Ok(self.find(spec)?.map(|t| match t {
            FileTensor::View(t) => (Stored::of(t.dtype), t.shape),
            FileTensor::Made(_, shape, dtype, _) => (Stored::of(dtype), shape),
        }))
    }
    /// Engram's compressed ids, where the file has them.
    fn cid_map(&self) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
}

impl TensorSource for GgufFile {
    fn find(&self, spec: &TensorName) -> Result<Option<FileTensor<'_>>> {
        Ok(self.tensor(&spec.name).map(|t| FileTensor::View(self.host_tensor(t))))
    }
}

/// Safetensors files (one, or a Hugging Face directory's shards), mapped, with every tensor's
/// place in them.
pub(crate) struct SafetensorsFiles {
    files: Vec<(PathBuf, FileBytes)>,
    /// Each tensor's file, element type, shape and byte range.
    index: HashMap<String, (usize, safetensors::Dtype, Vec<usize>, Range<usize>)>,
}

impl SafetensorsFiles {
    /// Index `files` (each parsed and checked by the safetensors crate).
    pub(crate) fn new(files: Vec<(PathBuf, FileBytes)>) -> Result<Self> {
        let mut index = HashMap::new();
        for (k, (path, bytes)) in files.iter().enumerate() {
            let st = safetensors::SafeTensors::deserialize(bytes)
                .map_err(|e| file_err(path, format!("not a valid safetensors file: {e}")))?;
            for (name, view) in st.tensors() {
                let start = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
                let range = start..start + view.data().len();
                index.insert(name, (k, view.dtype(), view.shape().to_vec(), range));
            }
        }
        Ok(SafetensorsFiles { files, index })
    }

    /// The tensor called `name` (or `name.weight`: PyTorch modules add the suffix).
    fn view(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let with = format!("{name}.weight");
        let Some((name, (k, dtype, shape, range))) =
            self.index.get_key_value(name).or_else(|| self.index.get_key_value(&with))
        else {
            return Ok(None);
        };
        let dtype = match dtype {
            safetensors::Dtype::F32 => HostDtype::F32,
            safetensors::Dtype::F16 => HostDtype::F16,
            safetensors::Dtype::BF16 => HostDtype::BF16,
            other => {
                return Err(Error::Weights(format!("tensor `{name}` has dtype {other:?}; supported: F32, F16, BF16")))
            }
        };
        let bytes = &self.files[*k].1[range.clone()];
        Ok(Some(HostTensor { name: name.clone(), shape: shape.clone(), dtype, bytes }))
    }

    /// The parsed file holding tensor `name`.
    fn file_of(&self, name: &str) -> Result<Option<TensorFile<'_>>> {
        self.index.get(name).map(|(k, ..)| TensorFile::parse(&self.files[*k].1)).transpose()
    }

    /// gpt-oss's experts in OpenAI's MXFP4 checkpoints: `{name}_blocks` and `{name}_scales` in
    /// the stead of `name`.
    fn mxfp4_names(spec: &TensorName) -> Option<(String, String)> {
        spec.transposed_stack.map(|_| (format!("{}_blocks", spec.name), format!("{}_scales", spec.name)))
    }
}

impl TensorSource for SafetensorsFiles {
    fn find(&self, spec: &TensorName) -> Result<Option<FileTensor<'_>>> {
        if let Some(t) = self.view(&spec.name)? {
            return Ok(Some(FileTensor::View(t)));
        }
        let Some((blocks, scales)) = Self::mxfp4_names(spec) else { return Ok(None) };
        let Some(b) = self.file_of(&blocks)? else { return Ok(None) };
        let s = self.file_of(&scales)?.ok_or_else(|| Error::Weights(format!("tensor `{scales}` is missing")))?;
        let (rows, cols, bytes) = TensorFile::mxfp4_stack(&b, &s, &spec.name)?;
        if [rows, cols] != spec.shape[..] {
            return Err(Error::Weights(format!(
                "tensors `{blocks}` and `{scales}` hold [{rows}, {cols}], expected {:?}",
                spec.shape
            )));
        }
        let dtype = HostDtype::Quant(crate::model::quant::QuantKind::MXFP4);
        Ok(Some(FileTensor::Made(spec.name.clone(), vec![rows, cols], dtype, bytes)))
    }

    fn stored(&self, spec: &TensorName) -> Result<Option<(Stored, Vec<usize>)>> {
        if let Some(t) = self.view(&spec.name)? {
            return Ok(Some((Stored::of(t.dtype), t.shape)));
        }
        // MXFP4 blocks `[n, rows, groups, 16]`: the matrix `[n * rows, 32 * groups]`
        let blocks = Self::mxfp4_names(spec).and_then(|(blocks, _)| self.index.get(&blocks));
        Ok(blocks.and_then(|(_, _, shape, _)| match shape[..] {
            [n, rows, groups, 16] => {
                Some((Stored::Quant(crate::model::quant::QuantKind::MXFP4), vec![n * rows, 32 * groups]))
            }
            _ => None,
        }))
    }

    fn cid_map(&self) -> Result<Option<Vec<u32>>> {
        self.file_of("cid_map")?.map(|f| f.ids("cid_map")).transpose()
    }
}

/// A model's weights in a file: its config, the naming its tensors have there, and where they
/// are. The plan comes from the file's header; the values are read one tensor at a time.
pub(crate) struct FileWeights<'a> {
    pub cfg: ModelConfig,
    pub naming: Naming,
    pub source: &'a dyn TensorSource,
}

fn missing(name: &str) -> Error {
    Error::Weights(format!("tensor `{name}` is missing"))
}

impl FileWeights<'_> {
    /// Every weight's shape and storage, from the file's header.
    pub fn plan(&self) -> Result<WeightPlan> {
        let names = tensor_names(&self.cfg, self.naming);
        let mut plan = WeightPlan::from_names(&self.cfg, &names, &mut |t| {
            let (stored, shape) = self.source.stored(t)?.ok_or_else(|| missing(&t.name))?;
            // the values a tensor holds, whatever shape it takes them in (`conform`)
            let count = |s: &[usize]| s.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if count(&shape) != count(&t.shape) {
                return Err(Error::Weights(format!(
                    "tensor `{}`: shape {shape:?}, this model's is {:?}",
                    t.name,
                    t.file_shape()
                )));
            }
            Ok(stored)
        })?;
        plan.cid_map = self.source.cid_map()?;
        if let Some(ids) = plan.cid_map.as_ref().filter(|ids| ids.len() != self.cfg.vocab) {
            return Err(Error::Weights(format!("cid_map: length {}, expected vocab {}", ids.len(), self.cfg.vocab)));
        }
        Ok(plan)
    }

    /// Each tensor, read from the file as it comes, handed to `write` for each of its places
    /// with how its norms hold their values; `progress(done, tensors)` after each.
    pub fn stream(
        &self,
        write: &mut dyn FnMut(&Place, crate::model::config::NormKind, &HostTensor) -> Result<()>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<()> {
        let norm = naming_norm(&self.cfg, self.naming);
        let names = tensor_names(&self.cfg, self.naming);
        stream(
            &names,
            &mut |t| self.source.find(t)?.ok_or_else(|| missing(&t.name)),
            &mut |p, t| write(p, norm, t),
            progress,
        )
    }

    /// The whole model on the host: `plan`'s weights zeroed, then every tensor written into
    /// them ([`ModelWeights::write_place`]).
    pub fn weights(&self, plan: &WeightPlan, progress: &mut dyn FnMut(usize, usize)) -> Result<ModelWeights> {
        let mut w = ModelWeights::zeroed(plan)?;
        self.stream(&mut |p, norm, t| w.write_place(p, norm, t), progress)?;
        w.check()?;
        Ok(w)
    }
}

/// Where a [`ModelFile`]'s tensors are.
enum Tensors {
    Gguf(GgufFile),
    Safetensors(SafetensorsFiles),
}

impl Tensors {
    fn source(&self) -> &dyn TensorSource {
        match self {
            Tensors::Gguf(g) => g,
            Tensors::Safetensors(s) => s,
        }
    }
}

/// `e`, naming the file at `path` where there is one (and the error names none yet).
fn at_path(path: Option<&Path>, e: Error) -> Error {
    match (path, e) {
        (_, e @ Error::File { .. }) | (None, e) => e,
        (Some(p), e) => file_err(p, e),
    }
}

/// A model file opened for loading: its config and tokenizer read, its tensors mapped, not read.
/// [`crate::Engine::from_file`] streams them onto the GPU one at a time; [`ModelFile::weights`]
/// reads them onto the host for the CPU reference.
pub struct ModelFile {
    cfg: ModelConfig,
    naming: Naming,
    /// Every weight's shape and storage, checked against the header at open.
    plan: WeightPlan,
    /// The tokenizer (GGUF metadata or `tokenizer.json`); kvdecode safetensors have none.
    pub tokenizer: Option<Tokenizer>,
    tensors: Tensors,
    /// What errors name (`None` for bytes in memory).
    path: Option<PathBuf>,
}

impl ModelFile {
    /// Open the model at `path`: a GGUF file, a Hugging Face directory or a kvdecode
    /// safetensors file. Reads the config, the tokenizer and the tensors' headers.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let at = |e| at_path(Some(path), e);
        if is_gguf(path) {
            let g = GgufFile::open(path)?;
            return Self::new(g.config().map_err(at)?, Naming::Gguf, Tensors::Gguf(g), Some(path.into()));
        }
        let (cfg, naming, tokenizer, files) = if path.is_dir() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| file_err(&cfg_path, e))?;
            let (cfg, _) = crate::io::hf::config_from_json(&text).map_err(|e| file_err(&cfg_path, e))?;
            let tj = path.join("tokenizer.json");
            let tokenizer = if tj.exists() { Some(Tokenizer::from_file(&tj)?) } else { None };
            let files = SafetensorsFiles::new(safetensors_in(path, FileBytes::open)?)?;
            // text weights live under `model.` (text-only checkpoints) or a language-model prefix
            let prefix = HF_PREFIXES
                .into_iter()
                .find(|p| files.index.contains_key(&format!("{p}embed_tokens.weight")))
                .unwrap_or(HF_PREFIXES[0]);
            (cfg, Naming::HuggingFace(prefix), tokenizer, files)
        } else {
            let bytes = FileBytes::open(path)?;
            let cfg = crate::io::safetensors::kvdecode_config(&bytes).map_err(at)?;
            (cfg, Naming::Kvdecode, None, SafetensorsFiles::new(vec![(path.into(), bytes)])?)
        };
        let mut f = Self::new(cfg, naming, Tensors::Safetensors(files), Some(path.into()))?;
        f.tokenizer = tokenizer;
        Ok(f)
    }

    /// A model file of these tensors, its plan read from their header (what every tensor is,
    /// and that each is there in its shape).
    fn new(cfg: ModelConfig, naming: Naming, tensors: Tensors, path: Option<PathBuf>) -> Result<Self> {
        let weights = FileWeights { cfg: cfg.clone(), naming, source: tensors.source() };
        let plan = weights.plan().map_err(|e| at_path(path.as_deref(), e))?;
        let tokenizer = match &tensors {
            Tensors::Gguf(g) => Tokenizer::from_gguf_if_any(g)?,
            Tensors::Safetensors(_) => None,
        };
        Ok(ModelFile { cfg, naming, plan, tokenizer, tensors, path })
    }

    /// A parsed GGUF file (the browser's bytes, or [`GgufFile::open`]'s mapping).
    pub fn from_gguf(g: GgufFile) -> Result<Self> {
        Self::new(g.config()?, Naming::Gguf, Tensors::Gguf(g), None)
    }

    /// A kvdecode safetensors file's bytes (config in its `kvdecode.config` metadata).
    pub fn from_safetensors_bytes(bytes: Vec<u8>) -> Result<Self> {
        let cfg = crate::io::safetensors::kvdecode_config(&bytes)?;
        let files = SafetensorsFiles::new(vec![(PathBuf::from("<memory>"), bytes.into())])?;
        Self::new(cfg, Naming::Kvdecode, Tensors::Safetensors(files), None)
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The weights as the loaders see them.
    pub(crate) fn file_weights(&self) -> FileWeights<'_> {
        FileWeights { cfg: self.cfg.clone(), naming: self.naming, source: self.tensors.source() }
    }

    /// An error of reading this file, naming it.
    pub(crate) fn err(&self, e: Error) -> Error {
        at_path(self.path.as_deref(), e)
    }

    /// Every weight's shape and storage, from the file's header.
    pub fn plan(&self) -> &WeightPlan {
        &self.plan
    }

    /// The whole model on the host (the CPU reference's input; an engine needs none of it).
    pub fn weights(&self) -> Result<ModelWeights> {
        self.weights_with_progress(&mut |_, _| {})
    }

    /// [`ModelFile::weights`], calling `progress(tensors_done, tensors)` as tensors are read.
    pub fn weights_with_progress(&self, progress: &mut dyn FnMut(usize, usize)) -> Result<ModelWeights> {
        self.file_weights().weights(&self.plan, progress).map_err(|e| self.err(e))
    }
}

/// Every `*.safetensors` file in `dir`, sorted by name, each opened by `open` (mapped or read).
fn safetensors_in(dir: &Path, open: fn(&Path) -> Result<FileBytes>) -> Result<Vec<(PathBuf, FileBytes)>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| file_err(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(file_err(dir, "no *.safetensors file in the directory"));
    }
    files.into_iter().map(|p| open(&p).map(|b| (p, b))).collect()
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
    Safetensors(Vec<(std::path::PathBuf, FileBytes)>),
    /// A parsed GGUF file.
    Gguf(GgufFile),
}

impl TensorFiles {
    /// Read the file or directory at `path` into memory (not mapped: a trainer may rewrite a
    /// checkpoint in place for its next step while this update is still reading it, and a
    /// mapping of a truncated file faults where bytes in memory only fail to parse).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if is_gguf(path) {
            let bytes = FileBytes::read(path)?;
            return GgufFile::parse_bytes(bytes).map(TensorFiles::Gguf).map_err(|e| file_err(path, e));
        }
        if path.is_dir() {
            return safetensors_in(path, FileBytes::read).map(TensorFiles::Safetensors);
        }
        Ok(TensorFiles::Safetensors(vec![(path.to_path_buf(), FileBytes::read(path)?)]))
    }

    /// A GGUF file's tensors by their names, in PyTorch's dimension order (quantized ones as
    /// their blocks; a 3-D tensor of stacked experts as one matrix of their rows).
    pub fn gguf_tensors(g: &GgufFile) -> Vec<HostTensor<'_>> {
        g.tensors.iter().map(|t| g.host_tensor(t)).collect()
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
    // read, not mapped: adapters are what a trainer rewrites between steps (`TensorFiles::open`)
    let g = GgufFile::parse_bytes(FileBytes::read(path)?).map_err(|e| file_err(path, e))?;
    g.lora(cfg).map_err(|e| file_err(path, e))
}
