//! What every subcommand shares: loading a model with a progress bar, and the engine options.

use indicatif::{ProgressBar, ProgressStyle};
use kvdecode::io::tokenizer::Tokenizer;
use kvdecode::{EngineOptions, KvDtype, ModelConfig, ModelWeights, WeightDtype};

/// A model of a real shape with seeded random weights in Q4_1 blocks (`synthetic:smollm2`:
/// SmolLM2-135M's dimensions; `synthetic:1b`: a Llama-3.2-1B-like shape). It runs at the speed of
/// the real weights, so benchmarks can run where the real files cannot travel. `synthetic:tiny`
/// is the demo model's size in the Llama layout (every layer global, no sliding window).
/// Mixtures of experts: `synthetic:olmoe` (OLMoE-1B-7B: 64 experts, top 8, about 1.3B active; its
/// f32 draw needs about 60 GB of host memory), `synthetic:qwen3-moe` (a Qwen3-MoE of 32 experts,
/// top 4, 12 layers: about 0.7B parameters, 0.14B active), and `-dense` after either name for
/// the dense model of the same active parameters. `:float` after the name keeps the weights in
/// floats (on the GPU as `--weights` says) instead of Q4_1 blocks: the base an RL trainer's
/// rollouts decode with (`synthetic:smollm2:float`).
fn synthetic(spec: &str) -> Result<ModelWeights> {
    let (name, float) = match spec.strip_suffix(":float") {
        Some(name) => (name, true),
        None => (spec, false),
    };
    use kvdecode::model::config::MoeConfig;
    let moe = |mut c: ModelConfig, experts, top_k, ffn, norm_topk, family| {
        let layers = (0..c.n_layers()).collect();
        c.moe = Some(MoeConfig { experts, top_k, ffn, layers, norm_topk, shared_ffn: None, bias: false });
        c.family = family;
        c
    };
    let mut qwen3_moe = ModelConfig::llama(32000, 1024, 16, 4, 64, 2048, 12, 1_000_000.0, 1e-6, false);
    qwen3_moe.qk_norm = true;
    let mut olmoe = ModelConfig::llama(50304, 2048, 16, 16, 128, 8192, 16, 10_000.0, 1e-5, false);
    (olmoe.qk_norm, olmoe.qk_norm_whole) = (true, true);
    let cfg = match name {
        "smollm2" => ModelConfig::llama(49152, 576, 9, 3, 64, 1536, 30, 100_000.0, 1e-5, true),
        "1b" => ModelConfig::llama(128_256, 2048, 32, 8, 64, 8192, 16, 500_000.0, 1e-5, true),
        "tiny" => ModelConfig::llama(512, 128, 4, 2, 32, 384, 6, 10_000.0, 1e-5, false),
        "qwen3-moe" => moe(qwen3_moe, 32, 4, 512, true, kvdecode::Family::Qwen3Moe),
        "qwen3-moe-dense" => qwen3_moe,
        "olmoe" => moe(olmoe, 64, 8, 1024, false, kvdecode::Family::Olmoe),
        "olmoe-dense" => olmoe,
        _ => {
            return Err(format!(
                "unknown synthetic model {name:?} (smollm2, 1b, tiny, qwen3-moe, qwen3-moe-dense, olmoe, olmoe-dense; \
                 :float after one keeps its weights in floats)"
            )
            .into())
        }
    };
    let weights = ModelWeights::random(&cfg, 0x5eed)?;
    Ok(if float { weights } else { weights.quantized(kvdecode::model::quant::QuantKind::Q4_1)? })
}

/// Errors of a subcommand, printed as `error: ...`.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Options that say how a model sits on the GPU.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// K/V cache storage: f32, f16 or bf16.
    #[arg(long, default_value = "f16", value_parser = parse_kv)]
    pub kv: KvDtype,
    /// Weights on the GPU (quantized blocks stay quantized either way): f32 or f16.
    #[arg(long, default_value = "f16", value_parser = parse_weights)]
    pub weights: WeightDtype,
    /// Tokens per row; default: the model's trained context, capped so the K/V fits in 1 GiB.
    #[arg(long)]
    pub max_len: Option<usize>,
    /// Allow --max-len beyond the model's trained context.
    #[arg(long)]
    pub beyond_trained_context: bool,
}

fn parse_kv(s: &str) -> std::result::Result<KvDtype, String> {
    KvDtype::parse(s).map_err(|e| e.to_string())
}

/// `f32` or `f16`, for the weights and the adapters' values.
pub(crate) fn parse_weights(s: &str) -> std::result::Result<WeightDtype, String> {
    match s {
        "f32" => Ok(WeightDtype::F32),
        "f16" => Ok(WeightDtype::F16),
        _ => Err(format!("unknown weight type {s:?}; expected f32 or f16")),
    }
}

impl EngineArgs {
    /// Rows of `max_len` tokens: the option, else the trained context capped by a 1 GiB K/V budget.
    pub fn max_len(&self, gpu: &kvdecode::Gpu, cfg: &ModelConfig, rows: usize) -> usize {
        self.max_len.unwrap_or_else(|| kvdecode::KvCache::fit_max_len(gpu, cfg, rows, self.kv, 1 << 30, 4096))
    }

    /// Engine options for `rows` rows of `max_len` tokens.
    pub fn options(&self, rows: usize, max_len: usize) -> EngineOptions {
        EngineOptions {
            kv: self.kv,
            weights: self.weights,
            beyond_trained_context: self.beyond_trained_context,
            ..EngineOptions::new(rows, max_len)
        }
    }
}

/// A model to build engines from: weights in memory (`demo`, `synthetic:`), or a file whose
/// tensors each engine reads onto the GPU as it is built.
pub enum Model {
    /// Weights on the host.
    Memory(Box<ModelWeights>),
    /// A model file, opened (config and tokenizer read, tensors mapped).
    File(String, Box<kvdecode::io::model_file::ModelFile>),
}

impl Model {
    /// The model's configuration.
    pub fn cfg(&self) -> &ModelConfig {
        match self {
            Model::Memory(w) => &w.cfg,
            Model::File(_, f) => f.config(),
        }
    }

    /// An engine of this model, showing a bar on stderr while a file's tensors reach the GPU.
    pub fn engine(&self, gpu: &kvdecode::Gpu, opts: EngineOptions) -> kvdecode::Result<kvdecode::Engine> {
        match self {
            Model::Memory(w) => kvdecode::Engine::new(gpu, w, opts),
            Model::File(path, f) => {
                let bar = ProgressBar::new(1);
                if let Ok(style) = ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors") {
                    bar.set_style(style);
                }
                bar.set_message(path.clone());
                let engine = kvdecode::Engine::from_file_with_progress(gpu, f, opts, &mut |done, total| {
                    bar.set_length(total as u64);
                    bar.set_position(done as u64);
                });
                bar.finish_and_clear();
                engine
            }
        }
    }
}

/// Open `path` (a GGUF file, a Hugging Face directory, a kvdecode safetensors file, or `demo`,
/// or `synthetic:NAME`) for engines to load from, with its tokenizer.
pub fn open_model(path: &str) -> Result<(Model, Option<Tokenizer>)> {
    if path == "demo" || path.starts_with("synthetic:") {
        let (w, tok) = load_model(path)?;
        return Ok((Model::Memory(Box::new(w)), tok));
    }
    let mut file = kvdecode::io::model_file::ModelFile::open(path)?;
    let tok = file.tokenizer.take();
    Ok((Model::File(path.to_string(), Box::new(file)), tok))
}

/// Load `path` (a GGUF file, a Hugging Face directory, a kvdecode safetensors file, `demo`, or
/// `synthetic:NAME`) onto the host, with a progress bar on stderr: the benches' models.
pub fn load_model(path: &str) -> Result<(ModelWeights, Option<Tokenizer>)> {
    if path == "demo" {
        return Ok((ModelWeights::demo(), None));
    }
    if let Some(name) = path.strip_prefix("synthetic:") {
        return Ok((synthetic(name)?, None));
    }
    let bar = ProgressBar::new(1);
    bar.set_style(ProgressStyle::with_template("reading {msg} [{bar:30}] {pos}/{len} tensors")?);
    bar.set_message(path.to_string());
    let loaded = kvdecode::io::model_file::load(path, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    Ok((loaded.weights, loaded.tokenizer))
}
