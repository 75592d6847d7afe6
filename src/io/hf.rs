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

use crate::error::{file_err, Error, Result};
use crate::io::safetensors::TensorFile;
use crate::model::config::{check_file_dims, MlpKind, ModelConfig, MoeConfig, NormKind, SWIGLU_ALPHA, SWIGLU_LIMIT};
use crate::model::family::{assemble, tensor_names, Naming, Tensor, HF_PREFIXES};
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

/// A layer type's RoPE: its base (`legacy_key` at the top level when the parameters name none)
/// and its scaling, if any. `scaled`: whether flat (not per-type) parameters' scaling applies to
/// this layer type (Gemma 3 scales only its global layers).
fn rope(
    cfg: &Value,
    layer_type: &str,
    legacy_key: &str,
    default: f32,
    scaled: bool,
) -> Result<(f32, Option<RopeScaling>)> {
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
        "su" | "yarn" if cfg.get("model_type").and_then(Value::as_str) == Some("phi3") => "longrope",
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

fn layer_type_flags(cfg: &Value, n_layers: usize) -> Result<Option<Vec<bool>>> {
    let Some(types) = cfg.get("layer_types").and_then(Value::as_array) else { return Ok(None) };
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

/// The mixture of experts of a MoE family's config: the experts, how many a token takes, each
/// one's size, which layers have them and whether their weights are renormalized, with each
/// config class's defaults (`None`: a dense model, as a Qwen3-MoE without experts is).
fn moe_config(cfg: &Value, family: Family, n_layers: usize, ffn: usize) -> Result<Option<MoeConfig>> {
    if !matches!(family, Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe | Family::Mixtral | Family::GptOss) {
        return Ok(None);
    }
    let qwen = matches!(family, Family::Qwen3Moe | Family::Qwen2Moe);
    // transformers 5 writes `num_local_experts` for every one of these (an alias of num_experts)
    let experts = match get_usize(cfg, "num_experts")?.or(get_usize(cfg, "num_local_experts")?) {
        Some(n) => n,
        None => return Err(Error::Config("config.json: `num_experts` (or `num_local_experts`) is missing".into())),
    };
    let top_k = need_usize(cfg, "num_experts_per_tok")?;
    // Qwen's experts have a size of their own; OLMoE's and Mixtral's are intermediate_size
    let expert_ffn = if qwen { need_usize(cfg, "moe_intermediate_size")? } else { ffn };
    // Qwen2-MoE's shared expert (none where its size is 0)
    let shared_ffn = match family {
        Family::Qwen2Moe => need_usize(cfg, "shared_expert_intermediate_size")?,
        _ => 0,
    };
    check_file_dims(
        n_layers,
        0,
        &[
            ("num_experts", experts),
            ("moe_intermediate_size", expert_ffn),
            ("shared_expert_intermediate_size", shared_ffn),
        ],
    )?;
    if experts == 0 {
        return Ok(None);
    }
    let layers: Vec<usize> = if qwen {
        // transformers: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer
        let step = get_usize(cfg, "decoder_sparse_step")?.unwrap_or(1).max(1);
        let dense: Vec<usize> = match cfg.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|l| l.as_u64().map(|l| l as usize)).collect::<Option<_>>())
                .ok_or_else(|| {
                    Error::Config(format!("config.json: mlp_only_layers must be a list of layers, got {v}"))
                })?,
        };
        (0..n_layers).filter(|i| !dense.contains(i) && (i + 1) % step == 0).collect()
    } else {
        (0..n_layers).collect()
    };
    if family == Family::Olmoe && cfg.get("clip_qkv").is_some_and(|v| !v.is_null()) {
        return Err(Error::Config("config.json: clip_qkv is not supported for olmoe".into()));
    }
    let norm_topk = match cfg.get("norm_topk_prob") {
        // Mixtral always renormalizes (its config has no such key); gpt-oss takes the softmax of
        // the top-k logits, the same weights
        _ if matches!(family, Family::Mixtral | Family::GptOss) => true,
        None | Some(Value::Null) => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| Error::Config(format!("config.json: norm_topk_prob must be true or false, got {v}")))?,
    };
    let shared_ffn = (shared_ffn > 0).then_some(shared_ffn);
    // gpt-oss's router and experts carry biases
    let bias = family == Family::GptOss;
    Ok((!layers.is_empty()).then_some(MoeConfig {
        experts,
        top_k,
        ffn: expert_ffn,
        layers,
        norm_topk,
        shared_ffn,
        bias,
    }))
}

/// Parse a Hugging Face `config.json` into a [`ModelConfig`] and its family.
pub fn config_from_json(text: &str) -> Result<(ModelConfig, Family)> {
    let root: Value = serde_json::from_str(text).map_err(|e| Error::Config(format!("config.json: {e}")))?;
    let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
    let (cfg, family) = match model_type {
        // Mistral is Llama with a window: the same tensor names, in HF and in GGUF
        "llama" | "mistral" => (&root, Family::Llama),
        "qwen2" => (&root, Family::Qwen2),
        "qwen3" => (&root, Family::Qwen3),
        "smollm3" => (&root, Family::SmolLM3),
        "gemma2" => (&root, Family::Gemma2),
        "olmo2" => (&root, Family::Olmo2),
        "phi3" => (&root, Family::Phi3),
        "qwen3_moe" => (&root, Family::Qwen3Moe),
        "olmoe" => (&root, Family::Olmoe),
        "mixtral" => (&root, Family::Mixtral),
        "qwen2_moe" => (&root, Family::Qwen2Moe),
        "gpt_oss" => (&root, Family::GptOss),
        "gemma3_text" => (&root, Family::Gemma3),
        "gemma3" => match root.get("text_config") {
            Some(t) if t.is_object() => (t, Family::Gemma3),
            _ => return Err(Error::Config("config.json: gemma3 without a text_config".into())),
        },
        _ => {
            let arch = root.get("architectures").map(|a| a.to_string()).unwrap_or_default();
            return Err(Error::Config(format!(
                "unsupported architecture model_type={model_type:?} {arch}; supported: llama, mistral, qwen2, qwen3, smollm3, gemma2, gemma3, olmo2, phi3, qwen3_moe, qwen2_moe, olmoe, mixtral, gpt_oss"
            )));
        }
    };
    // quantized checkpoints: gpt-oss's MXFP4 experts only (read as their blocks)
    if let Some(q) = root.get("quantization_config").filter(|q| !q.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        if !(family == Family::GptOss && method == "mxfp4") {
            return Err(Error::Config(format!(
                "config.json: quantization_config with quant_method {method:?} is not supported for {model_type} \
                 (gpt_oss's mxfp4 is)"
            )));
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        // (gpt-oss's attention biases are its own: read below)
        if cfg.get(key).and_then(Value::as_bool) == Some(true) && !(family == Family::GptOss && key == "attention_bias")
        {
            return Err(Error::Config(format!("config.json: {key}=true is not supported for {model_type}")));
        }
    }
    let d = need_usize(cfg, "hidden_size")?;
    let heads = need_usize(cfg, "num_attention_heads")?;
    // a key left out takes the config class's default; an explicit null, the derived value
    let (default_head_dim, default_kv_heads) = crate::model::family::hf_config_defaults(model_type);
    let left_out = |key: &str| cfg.get(key).is_none();
    let kv_heads = match get_usize(cfg, "num_key_value_heads")? {
        Some(n) => n,
        None if left_out("num_key_value_heads") => default_kv_heads.unwrap_or(heads),
        None => heads,
    };
    let derived_head_dim = d.checked_div(heads).unwrap_or(0);
    let head_dim = match get_usize(cfg, "head_dim")? {
        Some(n) => n,
        None if left_out("head_dim") => default_head_dim.unwrap_or(derived_head_dim),
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
    // SmolLM3's NoPE layers: `no_rope_layers[i]` is 1 where layer i rotates (default: all but
    // every `no_rope_layer_interval`-th)
    let rotates: Vec<bool> = match (family, cfg.get("no_rope_layers").and_then(Value::as_array)) {
        (Family::SmolLM3, Some(flags)) => {
            if flags.len() != n_layers {
                return Err(Error::Config(format!(
                    "config.json: {} no_rope_layers for {n_layers} layers",
                    flags.len()
                )));
            }
            flags
                .iter()
                .map(|f| match f.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(Error::Config(format!("config.json: no_rope_layers holds {f}, expected 0 or 1"))),
                })
                .collect::<Result<_>>()?
        }
        (Family::SmolLM3, None) => {
            let every = get_usize(cfg, "no_rope_layer_interval")?.unwrap_or(4).max(1);
            (0..n_layers).map(|i| (i + 1) % every != 0).collect()
        }
        _ => vec![true; n_layers],
    };
    // which layers slide: `layer_types` (newer), else each family's own keys
    let window_key = get_usize(cfg, "sliding_window")?;
    let use_window = cfg.get("use_sliding_window").and_then(Value::as_bool).unwrap_or(false);
    let sliding: Vec<bool> = match layer_type_flags(cfg, n_layers)? {
        Some(flags) => flags,
        None => match family {
            // Gemma 3: five local layers, then a global one; Gemma 2: they alternate
            Family::Gemma3 | Family::Gemma2 => {
                let default = if family == Family::Gemma2 { 2 } else { 6 };
                let pattern = get_usize(cfg, "sliding_window_pattern")?.unwrap_or(default).max(1);
                (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
            }
            // gpt-oss: sliding and full layers alternating, from a sliding one
            Family::GptOss => (0..n_layers).map(|i| i % 2 == 0).collect(),
            // Mistral and Mixtral: every layer, when the window is set
            Family::Llama => vec![model_type == "mistral" && window_key.is_some(); n_layers],
            Family::Mixtral => vec![window_key.is_some(); n_layers],
            Family::Qwen3Moe | Family::Qwen2Moe if use_window => {
                return Err(Error::Config(format!(
                    "config.json: use_sliding_window=true is not supported for {model_type}"
                )))
            }
            // Qwen2: layers from `max_window_layers` on, when `use_sliding_window`
            Family::Qwen2 => {
                let from = get_usize(cfg, "max_window_layers")?.unwrap_or(28);
                (0..n_layers).map(|i| use_window && window_key.is_some() && i >= from).collect()
            }
            // SmolLM3: its NoPE layers, when `use_sliding_window`
            Family::SmolLM3 => rotates.iter().map(|&r| use_window && window_key.is_some() && !r).collect(),
            // Phi-3: every layer, when the window is shorter than the trained context (Phi-3.5's
            // 262144 of 131072 hides nothing, and a ring that long would only take memory)
            Family::Phi3 => {
                let trained = get_usize(cfg, "max_position_embeddings")?.unwrap_or(usize::MAX);
                vec![window_key.is_some_and(|w| w < trained); n_layers]
            }
            _ => vec![false; n_layers],
        },
    };
    let window = match sliding.iter().any(|&s| s) {
        false => 0,
        // GptOssConfig's default window
        true if family == Family::GptOss => get_usize(cfg, "sliding_window")?.unwrap_or(128),
        true => need_usize(cfg, "sliding_window")?,
    };
    let eps_default =
        if matches!(family, Family::Olmo2 | Family::Olmoe | Family::Mixtral | Family::GptOss) { 1e-5 } else { 1e-6 };
    let eps = get_f32(cfg, "rms_norm_eps").unwrap_or(eps_default);
    let tie_default = matches!(family, Family::Gemma3 | Family::Gemma2 | Family::SmolLM3);
    let tied = cfg
        .get("tie_word_embeddings")
        .or_else(|| root.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(tie_default);
    let mut c = ModelConfig::llama(vocab, d, heads, kv_heads, head_dim, ffn, n_layers, 10000.0, eps, tied);
    c.family = family;
    c.set_sliding(window, |i| sliding[i]);
    c.nope_layers = (0..n_layers).filter(|&i| !rotates[i]).collect();
    c.context_len = get_usize(cfg, "max_position_embeddings")?.filter(|&n| n > 0);
    match family {
        // (no config.json names kvdecode's own family)
        Family::Llama
        | Family::Qwen2
        | Family::Qwen3
        | Family::SmolLM3
        | Family::Olmo2
        | Family::Phi3
        | Family::Qwen3Moe
        | Family::Olmoe
        | Family::Mixtral
        | Family::Qwen2Moe
        | Family::GptOss
        | Family::Kvdecode => {
            let default = match family {
                Family::SmolLM3 => 2_000_000.0,
                Family::Mixtral => 1_000_000.0,
                Family::GptOss => 150_000.0,
                _ => 10000.0,
            };
            (c.rope_theta, c.rope_scaling) = rope(cfg, "full_attention", "rope_theta", default, true)?;
            (c.rope_theta_local, c.rope_scaling_local) =
                rope(cfg, "sliding_attention", "rope_theta", c.rope_theta, true)?;
            c.qk_norm = matches!(family, Family::Qwen3 | Family::Olmo2 | Family::Qwen3Moe | Family::Olmoe);
            c.qkv_bias = matches!(family, Family::Qwen2 | Family::Qwen2Moe);
            if family == Family::GptOss {
                // attention_bias (default true) puts biases on q, k, v and o alike
                let biased = cfg.get("attention_bias").and_then(Value::as_bool).unwrap_or(true);
                (c.qkv_bias, c.o_bias, c.attn_sinks) = (biased, biased, true);
                c.mlp = MlpKind::ClampedSwiGlu;
                // no rope keys at all: GptOssConfig's own default, YaRN 32x over 4096 positions
                if rope_params(cfg, "full_attention").is_none() {
                    c.rope_scaling = Some(RopeScaling::Yarn {
                        factor: 32.0,
                        original_context: 4096,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        attention_factor: yarn_mscale(32.0, 1.0) as f32,
                        truncate: false,
                    });
                    c.rope_scaling_local = c.rope_scaling.clone();
                }
                for (key, want) in [("swiglu_limit", SWIGLU_LIMIT), ("swiglu_alpha", SWIGLU_ALPHA)] {
                    if let Some(v) = get_f32(cfg, key).filter(|&v| v != want) {
                        return Err(Error::Config(format!(
                            "config.json: {key}={v} is not supported for gpt_oss (only {want})"
                        )));
                    }
                }
            }
            if family == Family::Olmo2 {
                // norms on the blocks' outputs only; q and k normed over their whole projection
                (c.pre_norms, c.post_norms, c.qk_norm_whole) = (false, true, true);
            }
            // OLMoE: Llama's norms, q and k normed over their whole projection
            c.qk_norm_whole |= family == Family::Olmoe;
            c.moe = moe_config(cfg, family, n_layers, ffn)?;
            // Phi's partial rotary: the first `int(head_dim * factor)` dimensions of a head rotate
            let partial = rope_params(cfg, "full_attention")
                .and_then(|p| p.get("partial_rotary_factor"))
                .or_else(|| cfg.get("partial_rotary_factor"))
                .filter(|v| !v.is_null());
            if let Some(v) = partial {
                let factor = v.as_f64().filter(|f| *f > 0.0 && *f <= 1.0).ok_or_else(|| {
                    Error::Config(format!("config.json: partial_rotary_factor must be in (0, 1], got {v}"))
                })?;
                let dims = (head_dim as f64 * factor) as usize;
                if dims < head_dim {
                    c.rope_dims = Some(dims);
                }
            }
        }
        Family::Gemma3 | Family::Gemma2 => {
            let gemma2 = family == Family::Gemma2;
            (c.rope_theta, c.rope_scaling) =
                rope(cfg, "full_attention", "rope_theta", if gemma2 { 10000.0 } else { 1_000_000.0 }, true)?;
            // Gemma 3: flat parameters scale the global layers only, local ones have their own
            // base; Gemma 2: one RoPE for both
            (c.rope_theta_local, c.rope_scaling_local) = if gemma2 {
                (c.rope_theta, c.rope_scaling.clone())
            } else {
                rope(cfg, "sliding_attention", "rope_local_base_freq", 10000.0, false)?
            };
            c.norm = NormKind::OnePlusWeight;
            c.qk_norm = !gemma2;
            c.post_norms = true;
            c.mlp = MlpKind::GeluTanhGated;
            c.embed_scale = (d as f32).sqrt();
            c.attn_scale = get_f32(cfg, "query_pre_attn_scalar").unwrap_or(head_dim as f32).powf(-0.5);
            // Gemma2Config's defaults are 30 and 50 (an explicit null turns them off)
            let softcap = |key: &str, default: Option<f32>| match cfg.get(key) {
                None => default,
                Some(v) => v.as_f64().map(|c| c as f32),
            };
            c.logit_softcap = softcap("final_logit_softcapping", gemma2.then_some(30.0));
            c.attn_softcap = softcap("attn_logit_softcapping", gemma2.then_some(50.0));
            let act = cfg
                .get("hidden_activation")
                .or_else(|| cfg.get("hidden_act"))
                .and_then(Value::as_str)
                .unwrap_or("gelu_pytorch_tanh");
            if act != "gelu_pytorch_tanh" {
                return Err(Error::Config(format!(
                    "config.json: hidden_activation {act:?} is not supported for {model_type}"
                )));
            }
        }
    }
    if !matches!(family, Family::Gemma3 | Family::Gemma2) {
        let act = cfg.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(Error::Config(format!("config.json: hidden_act {act:?} is not supported (silu)")));
        }
    }
    c.validate()?;
    Ok((c, family))
}

/// Load a Hugging Face directory (`config.json` + `*.safetensors`).
pub fn load_dir(dir: impl AsRef<Path>) -> Result<ModelWeights> {
    let dir = dir.as_ref();
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| file_err(&cfg_path, e))?;
    let (cfg, _) = config_from_json(&text).map_err(|e| file_err(&cfg_path, e))?;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| file_err(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(file_err(dir, "no *.safetensors file in the directory"));
    }
    let blobs = files.iter().map(|p| std::fs::read(p).map_err(|e| file_err(p, e))).collect::<Result<Vec<_>>>()?;
    let parsed = blobs
        .iter()
        .zip(&files)
        .map(|(b, p)| TensorFile::parse(b).map_err(|e| file_err(p, e)))
        .collect::<Result<Vec<_>>>()?;
    let find = |name: &str| parsed.iter().find(|f| f.has(name));
    // text weights live under `model.` (text-only checkpoints) or a language-model prefix
    let prefix =
        HF_PREFIXES.into_iter().find(|p| find(&format!("{p}embed_tokens.weight")).is_some()).unwrap_or(HF_PREFIXES[0]);
    let names = tensor_names(&cfg, Naming::HuggingFace(prefix));
    assemble(&cfg, &names, &mut |t| {
        // gpt-oss's experts in OpenAI's MXFP4 checkpoints: `_blocks` and `_scales` in their stead
        let (blocks, scales) = (format!("{}_blocks", t.name), format!("{}_scales", t.name));
        if let (Some(_), None, Some(b)) = (t.transposed_stack, find(&t.name), find(&blocks)) {
            let s = find(&scales).ok_or_else(|| Error::Weights(format!("tensor `{scales}` is missing")))?;
            let m = TensorFile::mxfp4_stack(b, s, &t.name)?;
            if [m.rows, m.cols] != t.shape[..] {
                return Err(Error::Weights(format!(
                    "tensors `{blocks}` and `{scales}` hold [{}, {}], expected {:?}",
                    m.rows, m.cols, t.shape
                )));
            }
            return Ok(Tensor::Matrix(m));
        }
        let f = find(&t.name).ok_or_else(|| Error::Weights(format!("tensor `{}` is missing", t.name)))?;
        let value = match (t.transposed_stack, &t.shape[..]) {
            (Some(n), _) => Tensor::Matrix(f.transposed_stack(&t.name, n)?),
            (None, &[len]) => Tensor::Vector(f.flat_vector(&t.name, len)?),
            _ => Tensor::Matrix(f.matrix(&t.name)?),
        };
        let found = match &value {
            Tensor::Vector(v) => vec![v.len()],
            Tensor::Matrix(m) => vec![m.rows, m.cols],
        };
        if found != t.shape {
            return Err(Error::Weights(format!("tensor `{}` has shape {found:?}, expected {:?}", t.name, t.shape)));
        }
        Ok(value)
    })
    .map_err(|e| file_err(dir, e))
}
