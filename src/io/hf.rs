//! Hugging Face checkpoints: a directory with `config.json` and one or more `*.safetensors`, for
//! the Llama (`llama`), Qwen3 (`qwen3`) and Gemma 3 (`gemma3_text`, or `gemma3` with a
//! `text_config`) families. Config forms of older and newer transformers versions are read:
//! `rope_theta` or `rope_parameters` (flat or per layer type), `layer_types` or
//! `sliding_window_pattern`. Any other architecture is a clear error naming it.

use std::path::Path;

use serde_json::Value;

use crate::error::{file_err, Error, Result};
use crate::model::config::{check_file_dims, LayerSpec, MlpKind, ModelConfig, NormKind};
use crate::model::family::{assemble, tensor_names, Naming, Tensor, HF_PREFIXES};
use crate::model::weights::{ModelWeights, TensorFile};

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

/// RoPE base for a layer type: `rope_parameters` (flat, or keyed by layer type as transformers 5
/// writes for Gemma 3), else the legacy top-level keys.
fn rope_theta(cfg: &Value, layer_type: &str, legacy_key: &str, default: f32) -> Result<f32> {
    let params = cfg.get("rope_parameters").or_else(|| cfg.get("rope_scaling")).filter(|p| !p.is_null());
    let scoped = params.and_then(|p| p.get(layer_type)).filter(|p| p.is_object());
    let flat =
        params.filter(|p| p.get("rope_theta").is_some() || p.get("rope_type").is_some() || p.get("type").is_some());
    for p in [scoped, flat].into_iter().flatten() {
        if let Some(kind) = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str) {
            if kind != "default" {
                return Err(Error::Config(format!("config.json: rope_type {kind:?} is not supported (only default)")));
            }
        }
        if let Some(t) = get_f32(p, "rope_theta") {
            return Ok(t);
        }
    }
    Ok(get_f32(cfg, legacy_key).unwrap_or(default))
}

/// Parse a Hugging Face `config.json` into a [`ModelConfig`] and its family.
pub fn config_from_json(text: &str) -> Result<(ModelConfig, Family)> {
    let root: Value = serde_json::from_str(text).map_err(|e| Error::Config(format!("config.json: {e}")))?;
    let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
    let (cfg, family) = match model_type {
        "llama" => (&root, Family::Llama),
        "qwen3" => (&root, Family::Qwen3),
        "gemma3_text" => (&root, Family::Gemma3),
        "gemma3" => match root.get("text_config") {
            Some(t) if t.is_object() => (t, Family::Gemma3),
            _ => return Err(Error::Config("config.json: gemma3 without a text_config".into())),
        },
        _ => {
            let arch = root.get("architectures").map(|a| a.to_string()).unwrap_or_default();
            return Err(Error::Config(format!(
                "unsupported architecture model_type={model_type:?} {arch}; supported: llama, qwen3, gemma3"
            )));
        }
    };
    if cfg.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Config("config.json: attention_bias=true is not supported".into()));
    }
    let d = need_usize(cfg, "hidden_size")?;
    let heads = need_usize(cfg, "num_attention_heads")?;
    let kv_heads = get_usize(cfg, "num_key_value_heads")?.unwrap_or(heads);
    let head_dim = get_usize(cfg, "head_dim")?.unwrap_or(d.checked_div(heads).unwrap_or(0));
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
    // which layers slide: `layer_types` (newer), else Gemma 3's `sliding_window_pattern`
    let sliding: Vec<bool> = match cfg.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
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
                .collect::<Result<_>>()?
        }
        None if family == Family::Gemma3 => {
            let pattern = get_usize(cfg, "sliding_window_pattern")?.unwrap_or(6).max(1);
            (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
        None => vec![false; n_layers],
    };
    let window = if sliding.iter().any(|&s| s) { need_usize(cfg, "sliding_window")? } else { 0 };
    let eps = get_f32(cfg, "rms_norm_eps").unwrap_or(1e-6);
    let tie_default = family == Family::Gemma3;
    let tied = cfg
        .get("tie_word_embeddings")
        .or_else(|| root.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(tie_default);
    let mut c = ModelConfig::llama(vocab, d, heads, kv_heads, head_dim, ffn, n_layers, 10000.0, eps, tied);
    c.family = family;
    let mut group = 0;
    c.layers = sliding
        .iter()
        .map(|&s| {
            if s {
                LayerSpec { global_group: None, writes_global: false, local: true }
            } else {
                group += 1;
                LayerSpec { global_group: Some(group - 1), writes_global: true, local: false }
            }
        })
        .collect();
    c.window = window;
    c.context_len = get_usize(cfg, "max_position_embeddings")?.filter(|&n| n > 0);
    match family {
        // (no config.json names kvdecode's own family)
        Family::Llama | Family::Qwen3 | Family::Kvdecode => {
            let theta = rope_theta(cfg, "full_attention", "rope_theta", 10000.0)?;
            c.rope_theta = theta;
            c.rope_theta_local = rope_theta(cfg, "sliding_attention", "rope_theta", theta)?;
            c.qk_norm = family == Family::Qwen3;
        }
        Family::Gemma3 => {
            c.rope_theta = rope_theta(cfg, "full_attention", "rope_theta", 1_000_000.0)?;
            c.rope_theta_local = rope_theta(cfg, "sliding_attention", "rope_local_base_freq", 10000.0)?;
            c.norm = NormKind::OnePlusWeight;
            c.qk_norm = true;
            c.post_norms = true;
            c.mlp = MlpKind::GeluTanhGated;
            c.embed_scale = (d as f32).sqrt();
            c.attn_scale = get_f32(cfg, "query_pre_attn_scalar").unwrap_or(head_dim as f32).powf(-0.5);
            c.logit_softcap = get_f32(cfg, "final_logit_softcapping");
            if get_f32(cfg, "attn_logit_softcapping").is_some() {
                return Err(Error::Config("config.json: attn_logit_softcapping is not supported".into()));
            }
            let act = cfg
                .get("hidden_activation")
                .or_else(|| cfg.get("hidden_act"))
                .and_then(Value::as_str)
                .unwrap_or("gelu_pytorch_tanh");
            if act != "gelu_pytorch_tanh" {
                return Err(Error::Config(format!(
                    "config.json: hidden_activation {act:?} is not supported for gemma3"
                )));
            }
        }
    }
    if family != Family::Gemma3 {
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
        let f = find(&t.name).ok_or_else(|| Error::Weights(format!("tensor `{}` is missing", t.name)))?;
        let value = match t.shape[..] {
            [_] => Tensor::Vector(f.vector(&t.name)?),
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
