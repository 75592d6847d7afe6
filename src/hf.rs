//! Hugging Face checkpoints: a directory with `config.json` and one or more `*.safetensors`.
//! Llama-family for now (`LlamaForCausalLM`); other architectures are a clear error.

use std::path::Path;

use serde_json::Value;

use crate::config::{check_file_dims, ModelConfig};
use crate::error::{file_err, Error, Result};
use crate::weights::{LayerWeights, Matrix, ModelWeights, TensorFile};

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

/// Parse a Hugging Face `config.json` into a [`ModelConfig`].
pub fn config_from_json(text: &str) -> Result<ModelConfig> {
    let cfg: Value = serde_json::from_str(text).map_err(|e| Error::Config(format!("config.json: {e}")))?;
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    if model_type != "llama" {
        let arch = cfg.get("architectures").map(|a| a.to_string()).unwrap_or_default();
        return Err(Error::Config(format!(
            "unsupported architecture model_type={model_type:?} {arch}; supported: llama"
        )));
    }
    let d = need_usize(&cfg, "hidden_size")?;
    let heads = need_usize(&cfg, "num_attention_heads")?;
    let kv_heads = get_usize(&cfg, "num_key_value_heads")?.unwrap_or(heads);
    let head_dim = get_usize(&cfg, "head_dim")?.unwrap_or(d.checked_div(heads).unwrap_or(0));
    // transformers >= 5 writes rope_parameters {rope_theta}, older versions rope_theta at the top
    let theta = cfg
        .get("rope_parameters")
        .and_then(|p| get_f32(p, "rope_theta"))
        .or_else(|| get_f32(&cfg, "rope_theta"))
        .unwrap_or(10000.0);
    if let Some(kind) = cfg
        .get("rope_parameters")
        .or_else(|| cfg.get("rope_scaling"))
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
    {
        if kind != "default" {
            return Err(Error::Config(format!("config.json: rope_type {kind:?} is not supported (only default)")));
        }
    }
    let (vocab, ffn, layers) = (
        need_usize(&cfg, "vocab_size")?,
        need_usize(&cfg, "intermediate_size")?,
        need_usize(&cfg, "num_hidden_layers")?,
    );
    check_file_dims(
        layers,
        vocab,
        &[
            ("hidden_size", d),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
            ("intermediate_size", ffn),
        ],
    )?;
    let c = ModelConfig::llama(
        vocab,
        d,
        heads,
        kv_heads,
        head_dim,
        ffn,
        layers,
        theta,
        get_f32(&cfg, "rms_norm_eps").unwrap_or(1e-6),
        cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
    );
    if cfg.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Config("config.json: attention_bias=true is not supported".into()));
    }
    c.validate()?;
    Ok(c)
}

/// Load a Hugging Face Llama directory (`config.json` + `*.safetensors`).
pub fn load_dir(dir: impl AsRef<Path>) -> Result<ModelWeights> {
    let dir = dir.as_ref();
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| file_err(&cfg_path, e))?;
    let cfg = config_from_json(&text).map_err(|e| file_err(&cfg_path, e))?;
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
    let matrix = |name: &str| match find(name) {
        Some(f) => f.matrix(name),
        None => Err(Error::Weights(format!("tensor `{name}` is missing"))),
    };
    let vector = |name: &str| match find(name) {
        Some(f) => f.vector(name),
        None => Err(Error::Weights(format!("tensor `{name}` is missing"))),
    };
    let build = || -> Result<ModelWeights> {
        let mut layers = Vec::new();
        for i in 0..cfg.n_layers() {
            let p = format!("model.layers.{i}");
            let kv = Matrix::vstack(&[
                matrix(&format!("{p}.self_attn.k_proj.weight"))?,
                matrix(&format!("{p}.self_attn.v_proj.weight"))?,
            ])?;
            let gate_up = Matrix::vstack(&[
                matrix(&format!("{p}.mlp.gate_proj.weight"))?,
                matrix(&format!("{p}.mlp.up_proj.weight"))?,
            ])?;
            layers.push(LayerWeights {
                attn_norm: Some(vector(&format!("{p}.input_layernorm.weight"))?),
                wq: matrix(&format!("{p}.self_attn.q_proj.weight"))?,
                q_norm: None,
                k_norm: None,
                kv_global: Some(kv),
                kv_local: None,
                wo: matrix(&format!("{p}.self_attn.o_proj.weight"))?,
                post_attn_norm: None,
                mlp_norm: Some(vector(&format!("{p}.post_attention_layernorm.weight"))?),
                post_mlp_norm: None,
                mlp_in: gate_up,
                mlp_out: matrix(&format!("{p}.mlp.down_proj.weight"))?,
            });
        }
        let head = if cfg.tie_embeddings { None } else { Some(matrix("lm_head.weight")?) };
        let w = ModelWeights {
            embed: matrix("model.embed_tokens.weight")?,
            final_norm: Some(vector("model.norm.weight")?),
            head,
            layers,
            cfg: cfg.clone(),
        };
        w.check()?;
        Ok(w)
    };
    build().map_err(|e| file_err(dir, e))
}
