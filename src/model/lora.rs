//! LoRA adapters on the host, read as PEFT saves them: per block and projection, `A` `[rank,
//! in]` and `B` `[out, rank]` in f32 and the scale, so a projection's output becomes
//! `W x + scale * B (A x)` with `W` untouched. Phi-3's fused `qkv_proj` and `gate_up_proj` are
//! split into their parts here (one `A`, the rows of `B` cut as the fused output is), so every
//! family's adapter has the same seven targets. What is not supported is refused by name: DoRA,
//! adapters on the embedding or the LM head, biases, `modules_to_save`, modules a family does not
//! have, and the experts of a mixture of experts.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::config::{MlpKind, ModelConfig};
use crate::model::family::{tensor_names, LayerSlot, Naming, Place, RowOrder, Slot, TensorName, HF_PREFIXES};
use crate::model::tensor::{check_all_values, HostDtype, HostTensor};

/// A projection of a block an adapter may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraTarget {
    /// The queries (`q_proj`, or the first rows of Phi-3's `qkv_proj`).
    Q,
    /// The keys.
    K,
    /// The values.
    V,
    /// The attention's output (`o_proj`).
    O,
    /// The MLP's gate (`gate_proj`, or the first half of `gate_up_proj`).
    Gate,
    /// The MLP's up projection.
    Up,
    /// The MLP's down projection.
    Down,
}

impl LoraTarget {
    /// Every target, in the order [`LoraAdapter`] keeps them.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// `(in, out)` features of this projection in block `layer` of `cfg`.
    pub fn dims(self, cfg: &ModelConfig, layer: usize) -> (usize, usize) {
        let (d, q, kv, f) =
            (cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.layer_ffn(layer));
        match self {
            LoraTarget::Q => (d, q),
            LoraTarget::K | LoraTarget::V => (d, kv),
            LoraTarget::O => (q, d),
            LoraTarget::Gate | LoraTarget::Up => (d, f),
            LoraTarget::Down => (f, d),
        }
    }

    /// Its module's path in a Llama-style Hugging Face block, as PEFT names it
    /// (`self_attn.q_proj`, ..., `mlp.down_proj`).
    pub fn llama_module(self) -> &'static str {
        match self {
            LoraTarget::Q => "self_attn.q_proj",
            LoraTarget::K => "self_attn.k_proj",
            LoraTarget::V => "self_attn.v_proj",
            LoraTarget::O => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
        }
    }
}

/// One adapted projection: `scale * B (A x)`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraModule {
    /// Its rank: the rows of `a`, the columns of `b`.
    pub rank: usize,
    /// `lora_alpha / rank` (`/ sqrt(rank)` with rsLoRA), per module where the patterns say.
    pub scale: f32,
    /// `[rank, in]`, row-major.
    pub a: Vec<f32>,
    /// `[out, rank]`, row-major.
    pub b: Vec<f32>,
}

impl LoraModule {
    /// `scale * B (A x)` for one input, summed in f64 (the CPU reference's precision).
    pub fn delta(&self, x: &[f32]) -> Vec<f64> {
        let ax: Vec<f64> =
            self.a.chunks(x.len()).map(|row| row.iter().zip(x).map(|(&a, &v)| a as f64 * v as f64).sum()).collect();
        self.b
            .chunks(self.rank)
            .map(|row| self.scale as f64 * row.iter().zip(&ax).map(|(&b, &a)| b as f64 * a).sum::<f64>())
            .collect()
    }
}

/// One half (A or B) of a module from an update, checked: a pushed f32 tensor as it came, or the
/// values made from another type or a fused tensor's rows.
pub(crate) enum HalfValues<'t> {
    F32(&'t HostTensor<'t>),
    Values(Vec<f32>),
}

impl HalfValues<'_> {
    /// Its values as little-endian f32 bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            HalfValues::F32(t) => &t.bytes[..t.elements() * 4],
            HalfValues::Values(v) => bytemuck::cast_slice(v),
        }
    }
}

/// One module's part of an update ([`LoraAdapter::plan_update`]): its new A and B, where given.
pub(crate) struct ModuleUpdate<'t> {
    pub layer: usize,
    pub target: LoraTarget,
    pub a: Option<HalfValues<'t>>,
    pub b: Option<HalfValues<'t>>,
}

/// An adapter: for every block, the projections it changes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraAdapter {
    /// `[layers][LoraTarget::ALL]`.
    pub layers: Vec<[Option<LoraModule>; 7]>,
}

/// The adapter's settings from `adapter_config.json` that decide each module's rank and scale.
struct Settings {
    r: usize,
    alpha: f64,
    rslora: bool,
    rank_pattern: Vec<(fancy_regex::Regex, f64)>,
    alpha_pattern: Vec<(fancy_regex::Regex, f64)>,
}

impl Settings {
    fn parse(config: &Value) -> Result<Self> {
        let bad = |m: String| Error::Config(format!("adapter_config.json: {m}"));
        let get = |k: &str| config.get(k).filter(|v| !v.is_null());
        if let Some(t) = get("peft_type").and_then(Value::as_str).filter(|t| *t != "LORA") {
            return Err(bad(format!("peft_type {t:?}: only LORA adapters are read")));
        }
        if get("use_dora").and_then(Value::as_bool) == Some(true) {
            return Err(bad("use_dora: DoRA adapters are not supported".into()));
        }
        if get("bias").and_then(Value::as_str).is_some_and(|b| b != "none")
            || get("lora_bias") == Some(&Value::Bool(true))
        {
            return Err(bad("LoRA biases (bias / lora_bias) are not supported".into()));
        }
        if get("modules_to_save").is_some_and(|m| m.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(bad("modules_to_save (full copies of modules) is not supported".into()));
        }
        if get("fan_in_fan_out").and_then(Value::as_bool) == Some(true) {
            return Err(bad("fan_in_fan_out (GPT-2's transposed layers) is not supported".into()));
        }
        let r = get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("`r` must be a positive integer".into()))?;
        let alpha = get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
        let rslora = get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
        // PEFT's get_pattern_key: a key matches a module's name if the name is `(.*\.)?key`
        let patterns = |k: &str| -> Result<Vec<(fancy_regex::Regex, f64)>> {
            let Some(m) = get(k) else { return Ok(Vec::new()) };
            let m = m.as_object().ok_or_else(|| bad(format!("{k} must be an object")))?;
            m.iter()
                .map(|(key, v)| {
                    let re = fancy_regex::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$"))
                        .map_err(|e| bad(format!("{k} key {key:?} is not a regular expression: {e}")))?;
                    let v =
                        v.as_f64().filter(|v| *v > 0.0).ok_or_else(|| bad(format!("{k}[{key:?}] must be positive")))?;
                    Ok((re, v))
                })
                .collect()
        };
        Ok(Settings {
            r: r as usize,
            alpha,
            rslora,
            rank_pattern: patterns("rank_pattern")?,
            alpha_pattern: patterns("alpha_pattern")?,
        })
    }

    /// `(rank, scale)` of the module named `name` (PEFT's module path, `model.layers.0.mlp.up_proj`).
    fn rank_scale(&self, name: &str) -> (usize, f32) {
        let find =
            |p: &[(fancy_regex::Regex, f64)]| p.iter().find(|(re, _)| re.is_match(name).unwrap_or(false)).map(|x| x.1);
        let r = find(&self.rank_pattern).map_or(self.r, |r| r as usize);
        let alpha = find(&self.alpha_pattern).unwrap_or(self.alpha);
        let scale = if self.rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 };
        (r, scale as f32)
    }
}

/// What one tensor name of a PEFT adapter holds.
struct TensorSlot {
    layer: usize,
    /// PEFT's module path, for the patterns and errors.
    module: String,
    /// The projection's name (`q_proj`, `qkv_proj`, ...).
    proj: String,
    is_b: bool,
}

/// Parse `base_model.model.model.layers.N.{self_attn,mlp}.PROJ.lora_{A,B}[.ADAPTER].weight`.
fn parse_name(name: &str) -> Result<TensorSlot> {
    let unsupported = |what: &str| Error::Weights(format!("adapter tensor `{name}`: {what}"));
    if name.contains("lora_magnitude_vector") {
        return Err(unsupported("DoRA adapters are not supported"));
    }
    if name.contains("lora_embedding") || name.contains("embed_tokens") || name.contains("lm_head") {
        return Err(unsupported("adapters on the embedding or the LM head are not supported"));
    }
    let path = name.strip_prefix("base_model.model.").unwrap_or(name);
    let (module, rest) = path
        .split_once(".lora_A")
        .map(|(m, r)| (m, (false, r)))
        .or_else(|| path.split_once(".lora_B").map(|(m, r)| (m, (true, r))))
        .ok_or_else(|| unsupported("not a LoRA tensor (no lora_A or lora_B in its name)"))?;
    if !rest.1.ends_with(".weight") {
        return Err(unsupported("not a LoRA weight"));
    }
    let parts: Vec<&str> = module.split('.').collect();
    let at = parts.iter().position(|p| *p == "layers").ok_or_else(|| unsupported("not in a block (`layers.N`)"))?;
    let (layer, group, proj) = match &parts[at + 1..] {
        [n, g, p] => (n.parse::<usize>().map_err(|_| unsupported("no block number"))?, *g, *p),
        _ if parts.contains(&"experts") => {
            return Err(unsupported("adapters on a mixture of experts' experts are not supported"))
        }
        _ => return Err(unsupported("not a block's attention or MLP projection")),
    };
    if group != "self_attn" && group != "mlp" {
        return Err(unsupported("not a block's attention or MLP projection"));
    }
    Ok(TensorSlot { layer, module: module.to_string(), proj: proj.to_string(), is_b: rest.0 })
}

impl LoraAdapter {
    /// A seeded adapter of `rank` on every projection of `cfg` that adapters may change, its
    /// values normal with standard deviation `std` and every module's scale `scale` (for tests
    /// and benchmarks, as [`crate::ModelWeights::random`]).
    pub fn random(cfg: &ModelConfig, rank: usize, std: f32, scale: f32, seed: u64) -> Self {
        let mut rng = crate::model::weights::SplitMix64(seed);
        let mut values = |n: usize| (0..n).map(|_| std * rng.normal()).collect::<Vec<f32>>();
        let layers = (0..cfg.layers.len())
            .map(|l| {
                LoraTarget::ALL.map(|t| {
                    let (k, rows) = t.dims(cfg, l);
                    let mlp = matches!(t, LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down);
                    (!mlp || adapts_mlp(cfg, l)).then(|| LoraModule {
                        rank,
                        scale,
                        a: values(rank * k),
                        b: values(rows * rank),
                    })
                })
            })
            .collect();
        LoraAdapter { layers }
    }

    /// Its tensors by PEFT's names for a Llama-style model
    /// (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, ...), f32: A
    /// `[rank, in]`, B `[out, rank]` ([`LoraAdapter::from_peft`] reads them back).
    pub fn peft_tensors(&self) -> Vec<HostTensor<'_>> {
        let mut out = Vec::new();
        for (l, modules) in self.layers.iter().enumerate() {
            for (t, m) in LoraTarget::ALL.iter().zip(modules) {
                let Some(m) = m else { continue };
                let prefix = format!("base_model.model.model.layers.{l}.{}", t.llama_module());
                out.push(HostTensor::f32(format!("{prefix}.lora_A.weight"), &[m.rank, m.a.len() / m.rank], &m.a));
                out.push(HostTensor::f32(format!("{prefix}.lora_B.weight"), &[m.b.len() / m.rank, m.rank], &m.b));
            }
        }
        out
    }

    /// A PEFT adapter directory (`adapter_config.json` and `adapter_model.safetensors`) for a
    /// model of `cfg`.
    pub fn from_peft_dir(dir: impl AsRef<Path>, cfg: &ModelConfig) -> Result<Self> {
        let dir = dir.as_ref();
        let file = |n: &str| dir.join(n);
        let config = std::fs::read_to_string(file("adapter_config.json"))
            .map_err(|e| crate::error::file_err(file("adapter_config.json"), e))?;
        let config: Value = serde_json::from_str(&config)
            .map_err(|e| Error::Config(format!("{}: not JSON: {e}", file("adapter_config.json").display())))?;
        let path = file("adapter_model.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| crate::error::file_err(&path, e))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| crate::error::file_err(&path, format!("not a valid safetensors file: {e}")))?;
        let mut tensors = Vec::new();
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => HostDtype::F32,
                safetensors::Dtype::F16 => HostDtype::F16,
                safetensors::Dtype::BF16 => HostDtype::BF16,
                other => {
                    return Err(Error::Weights(format!("adapter tensor `{name}`: dtype {other:?} (F32, F16 or BF16)")))
                }
            };
            tensors.push(HostTensor { name, shape: view.shape().to_vec(), dtype, bytes: view.data() });
        }
        Self::from_peft(&config, &tensors, cfg)
    }

    /// An adapter from PEFT's config (the `adapter_config.json` object) and its tensors, by
    /// PEFT's names (`base_model.model.` in front or not; an adapter name before `.weight` is
    /// allowed, as `peft_model.state_dict()` writes it). Every tensor is checked before the
    /// adapter is made.
    pub fn from_peft(config: &Value, tensors: &[HostTensor], cfg: &ModelConfig) -> Result<Self> {
        let settings = Settings::parse(config)?;
        let names = base_names(cfg);
        let mut adapter = LoraAdapter { layers: vec![Default::default(); cfg.layers.len()] };
        for ((layer, module), pair) in &halves(tensors, cfg)? {
            let [Some(a), Some(b)] = pair else {
                let (have, miss) = if pair[0].is_some() { ("lora_A", "lora_B") } else { ("lora_B", "lora_A") };
                return Err(Error::Weights(format!("adapter module `{module}` has {have} but no {miss}")));
            };
            let (parts, out) = module_parts(cfg, &names, module)?;
            let (rank, scale) = settings.rank_scale(module);
            let inputs = parts[0].0.dims(cfg, *layer).0;
            let hint = |e| rank_hint(e, module, &format!("rank {rank} by adapter_config.json's r / rank_pattern"));
            a.check(&[rank, inputs]).map_err(hint)?;
            b.check(&[out, rank]).map_err(hint)?;
            let (av, bv) = (a.values_f32(), b.values_f32());
            for (target, place) in parts {
                let module = LoraModule { rank, scale, a: av.clone(), b: rows_of(&place, &bv, rank) };
                adapter.layers[*layer][target as usize] = Some(module);
            }
        }
        Ok(adapter)
    }

    /// An adapter from a GGUF LoRA file's tensors, as llama.cpp's `convert_lora_to_gguf.py` writes
    /// them (the file itself: [`crate::io::gguf::GgufFile::lora`]): `blk.N.attn_q.weight.lora_a`
    /// `[rank, in]` and `.lora_b` `[out, rank]` by the base model's GGUF names (so B's rows come in
    /// the GGUF order, Llama's permuted q and k included, and go where the base's rows went), and
    /// `adapter.lora.alpha`: each module's scale is `alpha / rank`, or 1 with no alpha (llama.cpp's
    /// rule). Adapters on the embedding or the output, and names that are not a block's
    /// projection, are refused by name.
    pub fn from_gguf_tensors(alpha: f32, tensors: &[HostTensor], cfg: &ModelConfig) -> Result<Self> {
        let names: std::collections::HashMap<String, TensorName> =
            tensor_names(cfg, Naming::Gguf).into_iter().map(|t| (t.name.clone(), t)).collect();
        let mut pairs: std::collections::BTreeMap<&str, [Option<&HostTensor>; 2]> = Default::default();
        for t in tensors {
            let (base, is_b) = match (t.name.strip_suffix(".lora_a"), t.name.strip_suffix(".lora_b")) {
                (Some(base), _) => (base, false),
                (_, Some(base)) => (base, true),
                _ => {
                    return Err(Error::Weights(format!(
                        "adapter tensor `{}`: not a LoRA tensor (.lora_a, .lora_b)",
                        t.name
                    )))
                }
            };
            if base.starts_with("token_embd") || base.starts_with("output.") {
                return Err(Error::Weights(format!(
                    "adapter tensor `{}`: adapters on the embedding or the LM head are not supported",
                    t.name
                )));
            }
            let pair = pairs.entry(base).or_default();
            if pair[usize::from(is_b)].replace(t).is_some() {
                return Err(Error::Weights(format!("adapter tensor `{}` is given twice", t.name)));
            }
        }
        let mut adapter = LoraAdapter { layers: vec![Default::default(); cfg.layers.len()] };
        for (base, pair) in pairs {
            let [Some(a), Some(b)] = pair else {
                let (have, miss) = if pair[0].is_some() { ("lora_a", "lora_b") } else { ("lora_b", "lora_a") };
                return Err(Error::Weights(format!("adapter module `{base}` has {have} but no {miss}")));
            };
            let t = names.get(base);
            let parts = t.map(|t| targets(cfg, t)).unwrap_or_default();
            let (Some(t), Some((first, _))) = (t, parts.first()) else {
                return Err(Error::Weights(format!(
                    "adapter module `{base}`: not a block projection this {:?} model has to adapt",
                    cfg.family
                )));
            };
            let Some(Slot::Layer(layer, _)) = t.places.first().map(|p| p.slot) else {
                unreachable!("targets are blocks'")
            };
            if a.shape.len() != 2 || a.shape[0] == 0 {
                return Err(Error::Weights(format!(
                    "adapter tensor `{}`: shape {:?}, not [rank, in]",
                    a.name, a.shape
                )));
            }
            let rank = a.shape[0];
            let inputs = first.dims(cfg, layer).0;
            if matches!(first, LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down) && !adapts_mlp(cfg, layer) {
                return Err(Error::Weights(format!(
                    "adapter module `{base}`: block {layer}'s MLP is not one kvdecode adapts"
                )));
            }
            let hint = |e| rank_hint(e, base, &format!("rank {rank} by its lora_a"));
            a.check(&[rank, inputs]).map_err(hint)?;
            b.check(&[t.shape[0], rank]).map_err(hint)?;
            let scale = if alpha == 0.0 { 1.0 } else { alpha / rank as f32 };
            let (av, bv) = (a.values_f32(), b.values_f32());
            for (target, place) in parts {
                let module = LoraModule { rank, scale, a: av.clone(), b: rows_of(&place, &bv, rank) };
                adapter.layers[layer][target as usize] = Some(module);
            }
        }
        Ok(adapter)
    }

    /// This adapter with some of its modules' `A` and/or `B` replaced by `tensors` (PEFT's names,
    /// as [`LoraAdapter::from_peft`] reads them), as a trainer pushes them after a step: each
    /// module keeps its rank and scale. Returns the new adapter and the (block, target) pairs
    /// that changed. A module this adapter does not have, a shape for another rank, a name given
    /// twice or a value that is not finite is an error, checked before anything is made.
    pub fn updated(&self, tensors: &[HostTensor], cfg: &ModelConfig) -> Result<(Self, Vec<(usize, LoraTarget)>)> {
        let mut adapter = self.clone();
        let changes = self.changes(tensors, cfg)?;
        let changed = changes.iter().map(|(l, t, _)| (*l, *t)).collect();
        for (l, t, m) in changes {
            adapter.layers[l][t as usize] = Some(m);
        }
        Ok((adapter, changed))
    }

    /// The modules [`LoraAdapter::updated`] would replace, made from `tensors`, without copying
    /// the rest: (block, target, new module).
    pub fn changes(&self, tensors: &[HostTensor], cfg: &ModelConfig) -> Result<Vec<(usize, LoraTarget, LoraModule)>> {
        let half = |new: Option<HalfValues>, old: &Vec<f32>| match new {
            Some(HalfValues::F32(t)) => t.values_f32(),
            Some(HalfValues::Values(v)) => v,
            None => old.clone(),
        };
        let plan = plan_update(&self.ranks(), &base_names(cfg), tensors, cfg)?;
        Ok(plan
            .into_iter()
            .map(|u| {
                let old = self.module(u.layer, u.target).expect("planned against this adapter's modules");
                let (a, b) = (half(u.a, &old.a), half(u.b, &old.b));
                (u.layer, u.target, LoraModule { rank: old.rank, scale: old.scale, a, b })
            })
            .collect())
    }

    /// Each module's rank: what an update is checked against.
    pub(crate) fn ranks(&self) -> LoraRanks {
        LoraRanks(self.layers.iter().map(|l| l.each_ref().map(|m| m.as_ref().map(|m| m.rank))).collect())
    }

    /// The module that changes `target` of block `layer`, if any.
    pub fn module(&self, layer: usize, target: LoraTarget) -> Option<&LoraModule> {
        self.layers.get(layer).and_then(|l| l[target as usize].as_ref())
    }

    /// Add the adapter's change of `target` in block `layer` to each output (f64 sums, rounded
    /// once), for the CPU reference.
    pub(crate) fn add_to(&self, layer: usize, target: LoraTarget, xs: &[Vec<f32>], ys: &mut [Vec<f32>], at: usize) {
        let Some(m) = self.module(layer, target) else { return };
        for (x, y) in xs.iter().zip(ys) {
            for (o, d) in y[at..].iter_mut().zip(m.delta(x)) {
                *o = (*o as f64 + d) as f32;
            }
        }
    }
}

/// Each module's rank per block, `[layers][LoraTarget::ALL]` (`None`: the adapter leaves that
/// projection alone): what an update of a resident adapter is checked against, the engine's values
/// being on the GPU only.
#[derive(Debug)]
pub(crate) struct LoraRanks(Vec<[Option<usize>; 7]>);

impl LoraRanks {
    fn of(&self, layer: usize, target: LoraTarget) -> Option<usize> {
        self.0.get(layer).and_then(|l| l[target as usize])
    }
}

/// An update's new halves per module, every tensor checked (names, shapes for the modules'
/// ranks, every value finite) and nothing copied that can go as it came: an f32 tensor stays the
/// pushed bytes, which go to the GPU as they came.
pub(crate) fn plan_update<'t>(
    ranks: &LoraRanks,
    names: &BaseNames,
    tensors: &'t [HostTensor],
    cfg: &ModelConfig,
) -> Result<Vec<ModuleUpdate<'t>>> {
    // the values of every tensor whose bytes fit its own shape (the plan refuses the others) are
    // checked on another thread while this one matches names and shapes: an update costs the
    // longer of the two, not their sum
    let whole: Vec<&HostTensor> = tensors.iter().filter(|t| t.check_shape(&t.shape).is_ok()).collect();
    #[cfg(not(target_arch = "wasm32"))]
    let (plan, values) = std::thread::scope(|s| {
        let values = s.spawn(|| check_all_values(&whole));
        let plan = plan_modules(ranks, names, tensors, cfg);
        (plan, values.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    });
    #[cfg(target_arch = "wasm32")]
    let (plan, values) = (plan_modules(ranks, names, tensors, cfg), check_all_values(&whole));
    let plan = plan?;
    values?;
    Ok(plan)
}

/// [`plan_update`]'s names and shapes, the values unchecked: the caller checks them
/// (`Engine::update_lora` as it stages them for the GPU, `GpuLora::stage_update`).
pub(crate) fn plan_modules<'t>(
    ranks: &LoraRanks,
    names: &BaseNames,
    tensors: &'t [HostTensor],
    cfg: &ModelConfig,
) -> Result<Vec<ModuleUpdate<'t>>> {
    let mut out = Vec::new();
    for ((layer, module), [a, b]) in &halves(tensors, cfg)? {
        let (parts, rows) = module_parts(cfg, names, module)?;
        let old = parts.iter().map(|(t, _)| ranks.of(*layer, *t)).collect::<Option<Vec<_>>>().ok_or_else(|| {
            Error::Weights(format!(
                "update: adapter module `{module}` is not in this adapter (an update replaces modules it has)"
            ))
        })?;
        let (rank, inputs) = (old[0], parts[0].0.dims(cfg, *layer).0);
        let hint = |e| rank_hint(e, module, &format!("rank {rank}, as loaded"));
        a.map(|a| a.check_shape(&[rank, inputs])).transpose().map_err(hint)?;
        b.map(|b| b.check_shape(&[rows, rank])).transpose().map_err(hint)?;
        let of = |t: &'t HostTensor<'t>| match t.dtype {
            HostDtype::F32 => HalfValues::F32(t),
            _ => HalfValues::Values(t.values_f32()),
        };
        for (target, place) in &parts {
            let whole = place.rows == (0..rows) && place.order == RowOrder::AsIs;
            let b = b.map(|b| match whole {
                true => of(b),
                false => HalfValues::Values(rows_of(place, &b.values_f32(), rank)),
            });
            out.push(ModuleUpdate { layer: *layer, target: *target, a: a.map(of), b });
        }
    }
    Ok(out)
}

/// The targets a base weight's places fill (a key projection fills the global and the local
/// K/V alike: once).
fn targets(cfg: &ModelConfig, t: &TensorName) -> Vec<(LoraTarget, Place)> {
    let kv = cfg.n_kv_heads * cfg.head_dim;
    let mut out: Vec<(LoraTarget, Place)> = Vec::new();
    // a place that fills both halves of a stacked weight ([k; v], [gate; up]) is two targets
    let halves = |p: &Place, half: usize| -> Vec<Place> {
        if p.row0 == 0 && p.rows.len() == 2 * half && p.order == RowOrder::AsIs {
            let (s, m) = (p.rows.start, p.rows.start + half);
            let first = Place { rows: s..m, ..p.clone() };
            vec![first, Place { row0: half, rows: m..p.rows.end, ..p.clone() }]
        } else {
            vec![p.clone()]
        }
    };
    let places = t.places.iter().flat_map(|p| match p.slot {
        Slot::Layer(_, LayerSlot::KvGlobal | LayerSlot::KvLocal) => halves(p, kv),
        Slot::Layer(layer, LayerSlot::MlpIn) => halves(p, cfg.layer_ffn(layer)),
        _ => vec![p.clone()],
    });
    for p in places {
        let Slot::Layer(layer, slot) = p.slot else { continue };
        let target = match slot {
            LayerSlot::Wq => LoraTarget::Q,
            LayerSlot::KvGlobal | LayerSlot::KvLocal if p.row0 == 0 => LoraTarget::K,
            LayerSlot::KvGlobal | LayerSlot::KvLocal if p.row0 == kv => LoraTarget::V,
            LayerSlot::Wo => LoraTarget::O,
            LayerSlot::MlpIn if p.row0 == 0 => LoraTarget::Gate,
            LayerSlot::MlpIn if p.row0 == cfg.layer_ffn(layer) => LoraTarget::Up,
            LayerSlot::MlpOut => LoraTarget::Down,
            _ => continue,
        };
        if !out.iter().any(|(t, _)| *t == target) {
            out.push((target, p));
        }
    }
    out
}

/// Whether block `layer`'s MLP is one adapters may change: a dense gated MLP.
pub(crate) fn adapts_mlp(cfg: &ModelConfig, layer: usize) -> bool {
    cfg.layer_moe(layer).is_none() && cfg.mlp != MlpKind::ReluSquared
}

/// A shape error of `module`'s tensors also names the rank it must have and why.
fn rank_hint(e: Error, module: &str, why: &str) -> Error {
    Error::Weights(format!("{e} (adapter module `{module}`: {why})"))
}

/// A module's `A` and `B` by (block, PEFT module path).
type Halves<'t> = std::collections::BTreeMap<(usize, String), [Option<&'t HostTensor<'t>>; 2]>;

/// `tensors` by module, each name parsed and checked against `cfg`'s blocks.
fn halves<'t>(tensors: &'t [HostTensor], cfg: &ModelConfig) -> Result<Halves<'t>> {
    let mut halves = Halves::default();
    for t in tensors {
        let slot = parse_name(&t.name)?;
        if slot.layer >= cfg.layers.len() {
            return Err(Error::Weights(format!(
                "adapter tensor `{}`: block {} of a model with {}",
                t.name,
                slot.layer,
                cfg.layers.len()
            )));
        }
        let is_mlp = ["gate_proj", "up_proj", "down_proj", "gate_up_proj"].contains(&slot.proj.as_str());
        if is_mlp && !adapts_mlp(cfg, slot.layer) {
            return Err(Error::Weights(format!(
                "adapter tensor `{}`: block {}'s MLP is not one kvdecode adapts (a mixture of experts, or no gate)",
                t.name, slot.layer
            )));
        }
        let pair = halves.entry((slot.layer, slot.module.clone())).or_default();
        let i = usize::from(slot.is_b);
        if pair[i].is_some() {
            return Err(Error::Weights(format!("adapter tensor `{}` is given twice", t.name)));
        }
        pair[i] = Some(t);
    }
    Ok(halves)
}

/// The base weights by their Hugging Face names ([`base_names`]).
pub(crate) type BaseNames = std::collections::HashMap<String, TensorName>;

/// The base weights' Hugging Face names: the family's own tables, so fused tensors split and
/// rows reorder (Phi-3's partial rotary) as the base's did. (An engine makes them once: for
/// SmolLM2's 30 blocks they take longer to make than an update's check of 19.5 MB.)
pub(crate) fn base_names(cfg: &ModelConfig) -> BaseNames {
    HF_PREFIXES.iter().flat_map(|p| tensor_names(cfg, Naming::HuggingFace(p))).map(|t| (t.name.clone(), t)).collect()
}

/// The targets PEFT module `module` changes, with where its `B` rows go, and its output rows.
fn module_parts(cfg: &ModelConfig, names: &BaseNames, module: &str) -> Result<(Vec<(LoraTarget, Place)>, usize)> {
    let base = names.get(&format!("{module}.weight"));
    let parts = base.map(|t| targets(cfg, t)).unwrap_or_default();
    match base {
        Some(t) if !parts.is_empty() => Ok((parts, t.shape[0])),
        _ => Err(Error::Weights(format!(
            "adapter module `{module}`: not a projection this {:?} model has (q, k, v, o, gate, up, down; Phi-3's \
             qkv_proj and gate_up_proj)",
            cfg.family
        ))),
    }
}

/// The rows of `b` (`[rows, rank]`) that `place` takes, in its order.
fn rows_of(place: &Place, b: &[f32], rank: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(place.rows.len() * rank);
    for i in 0..place.rows.len() {
        out.extend_from_slice(&b[place.source(i) * rank..][..rank]);
    }
    out
}
