//! Hugging Face checkpoints: a directory with `config.json` and one or more `*.safetensors`, for
//! the Llama (`llama`, Llama 3.x included), Mistral (`mistral`), Qwen2 and 2.5 (`qwen2`), Qwen3
//! (`qwen3`), SmolLM3 (`smollm3`), OLMo 2 (`olmo2`), Phi-3, 3.5 and 4-mini (`phi3`), Gemma 2
//! (`gemma2`) and Gemma 3 (`gemma3_text`, or `gemma3` with a `text_config`) families, and the
//! mixtures of experts Qwen3-MoE (`qwen3_moe`), Qwen2-MoE (`qwen2_moe`, with its shared expert),
//! OLMoE (`olmoe`) and Mixtral (`mixtral`). Config forms
//! of older and newer transformers versions are read: `rope_theta` and `rope_scaling`, or
//! `rope_parameters` (flat or per layer type), with RoPE scaling of types `linear`, `llama3`,
//! `yarn` and `longrope` and a `partial_rotary_factor`; `layer_types` or each family's window
//! keys. Any other architecture, or a key outside what is supported, is a clear error naming it.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::config::{check_file_dims, ModelConfig};
use crate::model::family::{HfKeys, RopeRead};
use crate::model::rope::{yarn_mscale, RopeScaling};
use crate::model::weights::ModelWeights;

pub use crate::model::family::Family;

fn get_usize(cfg: &Value, key: &str) -> Result<Option<usize>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= u32::MAX as u64)
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::Config(format!("config.json: `{key}` must be a non-negative integer, got {v}"))),
    }
}

fn need_usize(cfg: &Value, key: &str) -> Result<usize> {
    get_usize(cfg, key)?.ok_or_else(|| Error::Config(format!("config.json: `{key}` is missing")))
}

fn get_f32(cfg: &Value, key: &str) -> Option<f32> {
    cfg.get(key).and_then(Value::as_f64).map(|v| v as f32)
}

/// The RoPE parameters that apply to a layer type: legacy `rope_scaling` when set (it wins, as
/// transformers reads it), else `rope_parameters`, each flat or keyed by layer type (transformers 5
/// writes Gemma 3's per type). `None`: neither says anything for this type.
fn rope_params<'a>(cfg: &'a Value, layer_type: &str) -> Option<&'a Value> {
    let params = [cfg.get("rope_scaling"), cfg.get("rope_parameters")]
        .into_iter()
        .flatten()
        .find(|p| p.is_object() && p.as_object().is_some_and(|o| !o.is_empty()))?;
    match params.get(layer_type) {
        Some(scoped) if scoped.is_object() => Some(scoped),
        // keyed by layer type, but not this one
        _ if params.get("full_attention").is_some() || params.get("sliding_attention").is_some() => None,
        _ => Some(params),
    }
}

fn param_f32(p: &Value, key: &str) -> Result<Option<f32>> {
    match p.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| Error::Config(format!("config.json: rope `{key}` must be a number, got {v}"))),
    }
}

fn need_param(p: &Value, kind: &str, key: &str) -> Result<f32> {
    param_f32(p, key)?.ok_or_else(|| Error::Config(format!("config.json: rope_type {kind:?} needs `{key}`")))
}

/// A layer type's RoPE: its base (`read.theta_key` at the top level when the parameters name
/// none) and its scaling, if any.
fn rope(cfg: &Value, read: &RopeRead) -> Result<(f32, Option<RopeScaling>)> {
    let RopeRead { layer_type, theta_key: legacy_key, default_theta: default, scaled, yarn_is_longrope } = *read;
    let scoped = cfg
        .get("rope_parameters")
        .or_else(|| cfg.get("rope_scaling"))
        .and_then(|p| p.get(layer_type))
        .is_some_and(Value::is_object);
    let params = rope_params(cfg, layer_type);
    let theta = match params.map(|p| param_f32(p, "rope_theta")).transpose()?.flatten() {
        Some(t) if scoped || scaled => t,
        _ => get_f32(cfg, legacy_key).unwrap_or(default),
    };
    let Some(p) = params.filter(|_| scoped || scaled) else { return Ok((theta, None)) };
    let kind = match p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default") {
        // Phi-3's older configs name LongRoPE `su` or `yarn` (transformers reads both as longrope)
        "su" | "yarn" if yarn_is_longrope => "longrope",
        k => k,
    };
    let original = |key: &str| -> Result<usize> {
        match get_usize(p, key)?.or(get_usize(cfg, "max_position_embeddings")?) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(Error::Config(format!("config.json: rope_type {kind:?} needs `{key}`"))),
        }
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: need_param(p, kind, "factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need_param(p, kind, "factor")?,
            low_freq_factor: need_param(p, kind, "low_freq_factor")?,
            high_freq_factor: need_param(p, kind, "high_freq_factor")?,
            original_context: original("original_max_position_embeddings")?,
        }),
        "yarn" => {
            let factor = need_param(p, kind, "factor")?;
            // transformers' default: 0.1 ln(factor) + 1, or the ratio of two such with mscales
            let attention_factor = match param_f32(p, "attention_factor")? {
                Some(a) => a,
                None => match (param_f32(p, "mscale")?, param_f32(p, "mscale_all_dim")?) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        (yarn_mscale(factor as f64, m as f64) / yarn_mscale(factor as f64, all as f64)) as f32
                    }
                    _ => yarn_mscale(factor as f64, 1.0) as f32,
                },
            };
            Some(RopeScaling::Yarn {
                factor,
                original_context: original("original_max_position_embeddings")?,
                beta_fast: param_f32(p, "beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: param_f32(p, "beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                attention_factor,
                truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            })
        }
        "longrope" => {
            // Phi-3 keeps the original context at the top level, and it wins (as in transformers)
            let original = match get_usize(cfg, "original_max_position_embeddings")? {
                Some(n) if n > 0 => n,
                _ => original("original_max_position_embeddings")?,
            };
            // the trained context over the original sets the default attention factor
            let factor = match param_f32(p, "factor")? {
                Some(f) => f as f64,
                None => get_usize(cfg, "max_position_embeddings")?.unwrap_or(original) as f64 / original as f64,
            };
            let attention_factor = match param_f32(p, "attention_factor")? {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt() as f32,
            };
            let factors = |key: &str| -> Result<Vec<f32>> {
                let bad =
                    || Error::Config(format!("config.json: rope_type \"longrope\" needs `{key}`, a list of numbers"));
                p.get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(bad)?
                    .iter()
                    .map(|v| v.as_f64().map(|x| x as f32).ok_or_else(bad))
                    .collect()
            };
            Some(RopeScaling::LongRope {
                short: factors("short_factor")?,
                long: factors("long_factor")?,
                original_context: original,
                attention_factor,
            })
        }
        _ => {
            return Err(Error::Config(format!(
                "config.json: rope_type {kind:?} is not supported (default, linear, llama3, yarn, longrope)"
            )))
        }
    };
    if let Some(s) = scaling.as_ref().filter(|s| !matches!(s, RopeScaling::LongRope { .. })) {
        // (Divisors, the one kind that needs the rotated dimensions, never comes from config.json;
        // LongRoPE's factor lists are checked against them by `ModelConfig::validate`)
        s.validate(0).map_err(|e| Error::Config(format!("config.json: {e}")))?;
    }
    Ok((theta, scaling))
}

/// A `config.json`'s text model as a family reads it ([`HfKeys`]).
struct JsonKeys<'a> {
    model_type: &'a str,
    cfg: &'a Value,
}

impl HfKeys for JsonKeys<'_> {
    fn model_type(&self) -> &str {
        self.model_type
    }
    fn value(&self, key: &str) -> Option<&Value> {
        self.cfg.get(key)
    }
    fn usize(&self, key: &str) -> Result<Option<usize>> {
        get_usize(self.cfg, key)
    }
    fn f32(&self, key: &str) -> Option<f32> {
        get_f32(self.cfg, key)
    }
    fn rope(&self, read: RopeRead) -> Result<(f32, Option<RopeScaling>)> {
        rope(self.cfg, &read)
    }
    fn has_rope_params(&self, layer_type: &str) -> bool {
        rope_params(self.cfg, layer_type).is_some()
    }
    fn partial_rotary(&self) -> Result<Option<f64>> {
        let partial = rope_params(self.cfg, "full_attention")
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| self.cfg.get("partial_rotary_factor"))
            .filter(|v| !v.is_null());
        partial
            .map(|v| {
                v.as_f64().filter(|f| *f > 0.0 && *f <= 1.0).ok_or_else(|| {
                    Error::Config(format!("config.json: partial_rotary_factor must be in (0, 1], got {v}"))
                })
            })
            .transpose()
    }
    fn sliding_layer_types(&self, n_layers: usize) -> Result<Option<Vec<bool>>> {
        let Some(types) = self.cfg.get("layer_types").and_then(Value::as_array) else { return Ok(None) };
        if types.len() != n_layers {
            return Err(Error::Config(format!("config.json: {} layer_types for {n_layers} layers", types.len())));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(Error::Config(format!("config.json: unknown layer type {t}"))),
            })
            .collect::<Result<_>>()
            .map(Some)
    }
}

/// Parse a Hugging Face `config.json` into a [`ModelConfig`] and its family: the dimensions here,
/// the rest by the family's file ([`Family::spec`]).
pub fn config_from_json(text: &str) -> Result<(ModelConfig, Family)> {
    let root: Value = serde_json::from_str(text).map_err(|e| Error::Config(format!("config.json: {e}")))?;
    let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
    let Some((family, class)) = Family::from_hf_type(model_type) else {
        let arch = root.get("architectures").map(|a| a.to_string()).unwrap_or_default();
        return Err(Error::Config(format!(
            "unsupported architecture model_type={model_type:?} {arch}; supported: {}",
            Family::hf_type_names().join(", ")
        )));
    };
    let cfg = match class.nested {
        None => &root,
        Some(key) => match root.get(key) {
            Some(t) if t.is_object() => t,
            _ => return Err(Error::Config(format!("config.json: {model_type} without a {key}"))),
        },
    };
    let facts = &family.spec().hf;
    if let Some(q) = root.get("quantization_config").filter(|q| !q.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        if facts.quant != Some(method) {
            return Err(Error::Config(format!(
                "config.json: quantization_config with quant_method {method:?} is not supported for {model_type} \
                 (gpt_oss's mxfp4 is)"
            )));
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if cfg.get(key).and_then(Value::as_bool) == Some(true) && !(facts.attention_bias && key == "attention_bias") {
            return Err(Error::Config(format!("config.json: {key}=true is not supported for {model_type}")));
        }
    }
    let d = need_usize(cfg, "hidden_size")?;
    let heads = need_usize(cfg, "num_attention_heads")?;
    // a key left out takes the config class's default; an explicit null, the derived value
    let left_out = |key: &str| cfg.get(key).is_none();
    let kv_heads = match get_usize(cfg, "num_key_value_heads")? {
        Some(n) => n,
        None if left_out("num_key_value_heads") => class.kv_heads.unwrap_or(heads),
        None => heads,
    };
    let derived_head_dim = d.checked_div(heads).unwrap_or(0);
    let head_dim = match get_usize(cfg, "head_dim")? {
        Some(n) => n,
        None if left_out("head_dim") => class.head_dim.unwrap_or(derived_head_dim),
        None => derived_head_dim,
    };
    let (vocab, ffn, n_layers) =
        (need_usize(cfg, "vocab_size")?, need_usize(cfg, "intermediate_size")?, need_usize(cfg, "num_hidden_layers")?);
    check_file_dims(
        n_layers,
        vocab,
        &[
            ("hidden_size", d),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
            ("intermediate_size", ffn),
        ],
    )?;
    let eps = get_f32(cfg, "rms_norm_eps").unwrap_or(facts.eps);
    let tied = cfg
        .get("tie_word_embeddings")
        .or_else(|| root.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(facts.tied);
    let mut c = ModelConfig::llama(vocab, d, heads, kv_heads, head_dim, ffn, n_layers, 10000.0, eps, tied);
    c.family = family;
    c.context_len = get_usize(cfg, "max_position_embeddings")?.filter(|&n| n > 0);
    (family.spec().from_hf)(&mut c, &JsonKeys { model_type, cfg })?;
    c.validate()?;
    Ok((c, family))
}

/// Load a Hugging Face directory (`config.json` + `*.safetensors`) onto the host.
pub fn load_dir(dir: impl AsRef<Path>) -> Result<ModelWeights> {
    crate::io::model_file::ModelFile::open(dir)?.weights()
}
