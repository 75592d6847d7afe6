//! A checkpoint's config keys as the file readers hand them to a family: `io/hf.rs` finds a
//! `config.json`'s keys and parses its RoPE parameters, `io/gguf/config.rs` a GGUF file's
//! metadata and tensor table. What the keys mean for a family's numerics, and what it takes when
//! one is left out, is decided in the family's own file; the readings several families share are
//! here.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::config::{check_file_dims, ModelConfig, MoeConfig};

/// A Hugging Face `config.json` (its text model's part).
pub trait HfKeys {
    /// `model_type` as the file names it (Mistral's is Llama's family, with a window of its own).
    fn model_type(&self) -> &str;
    /// The value of a key, if written (a null included: an explicit null can turn a default off).
    fn value(&self, key: &str) -> Option<&Value>;
    /// An integer (`None`: left out or null); an error names a key holding anything else.
    fn usize(&self, key: &str) -> Result<Option<usize>>;
    /// A number, if the key holds one.
    fn f32(&self, key: &str) -> Option<f32>;
    /// A RoPE base and scaling ([`RopeRead`]).
    fn rope(&self, read: RopeRead) -> Result<(f32, Option<crate::model::rope::RopeScaling>)>;
    /// Whether RoPE parameters apply to a layer type (`rope_scaling` or `rope_parameters`).
    fn has_rope_params(&self, layer_type: &str) -> bool;
    /// `partial_rotary_factor` (at the top level or in the full layers' RoPE parameters), checked
    /// to lie in (0, 1].
    fn partial_rotary(&self) -> Result<Option<f64>>;
    /// `layer_types` as one flag per layer, true where it slides (`None`: not written).
    fn sliding_layer_types(&self, n_layers: usize) -> Result<Option<Vec<bool>>>;

    /// An integer that must be there.
    fn need_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| Error::Config(format!("config.json: `{key}` is missing")))
    }
    /// A true or false, if the key holds one.
    fn bool(&self, key: &str) -> Option<bool> {
        self.value(key).and_then(Value::as_bool)
    }
}

/// Which RoPE of a Hugging Face config to read: a layer type's parameters, or its base under
/// `theta_key` at the top level when they name none.
pub struct RopeRead<'a> {
    /// `full_attention` or `sliding_attention`.
    pub layer_type: &'a str,
    /// The top-level key of the base.
    pub theta_key: &'a str,
    /// The base where no key names one: the config class's default.
    pub default_theta: f32,
    /// Whether flat (not per layer type) parameters' scaling applies to this layer type (Gemma 3
    /// scales its global layers only).
    pub scaled: bool,
    /// Whether `su` and `yarn` mean LongRoPE (Phi-3's older configs, as transformers reads them).
    pub yarn_is_longrope: bool,
}

/// A GGUF file's metadata (keys after the `{arch}.` prefix) and tensor table.
pub trait GgufKeys {
    /// `general.architecture`.
    fn arch(&self) -> &str;
    /// A key's full name, for messages.
    fn name(&self, key: &str) -> String {
        format!("{}.{key}", self.arch())
    }
    /// An integer, if the key holds one.
    fn u64(&self, key: &str) -> Option<u64>;
    /// An integer that must be there.
    fn need_usize(&self, key: &str) -> Result<usize>;
    /// A number, if the key holds one.
    fn f64(&self, key: &str) -> Option<f64>;
    /// A boolean, if the key holds one.
    fn bool(&self, key: &str) -> Option<bool>;
    /// Whether the file has a tensor of this name.
    fn has_tensor(&self, name: &str) -> bool;
}

/// The RoPE of every family but Gemma's: the full layers' base (`theta` where the config names
/// none) and scaling, and the sliding layers' own where the config gives them (else the same).
pub(super) fn hf_rope(c: &mut ModelConfig, keys: &dyn HfKeys, theta: f32, yarn_is_longrope: bool) -> Result<()> {
    let read = |layer_type, default_theta| RopeRead {
        layer_type,
        theta_key: "rope_theta",
        default_theta,
        scaled: true,
        yarn_is_longrope,
    };
    (c.rope_theta, c.rope_scaling) = keys.rope(read("full_attention", theta))?;
    (c.rope_theta_local, c.rope_scaling_local) = keys.rope(read("sliding_attention", c.rope_theta))?;
    Ok(())
}

/// What every family but Gemma reads last: Phi's partial rotary where a config gives it, and the
/// MLP's activation, SiLU.
pub(super) fn hf_finish(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    hf_partial_rotary(c, keys)?;
    hf_silu(keys)
}

/// The sliding-layer rule of a family without a window: no layer slides.
pub(super) fn no_sliding(n_layers: usize, _window: Option<usize>) -> Result<Vec<bool>> {
    Ok(vec![false; n_layers])
}

/// Phi's partial rotary, where a config gives it: the first `int(head_dim * factor)` dimensions of
/// a head rotate.
fn hf_partial_rotary(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    if let Some(factor) = keys.partial_rotary()? {
        let dims = (c.head_dim as f64 * factor) as usize;
        if dims < c.head_dim {
            c.rope_dims = Some(dims);
        }
    }
    Ok(())
}

/// The sliding layers (`layer_types` where the config has it, else what `otherwise` makes of the
/// layer count and `sliding_window`) and their window: `sliding_window`, or `default` where the
/// config class has one.
pub(super) fn hf_sliding(
    c: &mut ModelConfig,
    keys: &dyn HfKeys,
    default: Option<usize>,
    otherwise: impl FnOnce(usize, Option<usize>) -> Result<Vec<bool>>,
) -> Result<()> {
    let n = c.layers.len();
    let window_key = keys.usize("sliding_window")?;
    let sliding = match keys.sliding_layer_types(n)? {
        Some(flags) => flags,
        None => otherwise(n, window_key)?,
    };
    let window = match (sliding.iter().any(|&s| s), default) {
        (false, _) => 0,
        (true, Some(d)) => keys.usize("sliding_window")?.unwrap_or(d),
        (true, None) => keys.need_usize("sliding_window")?,
    };
    c.set_sliding(window, |i| sliding[i]);
    Ok(())
}

/// The MLP's activation every family but Gemma's takes: SiLU.
fn hf_silu(keys: &dyn HfKeys) -> Result<()> {
    let act = keys.value("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    if act != "silu" {
        return Err(Error::Config(format!("config.json: hidden_act {act:?} is not supported (silu)")));
    }
    Ok(())
}

/// How a family's config places and sizes its experts.
pub(super) struct MoeRead {
    /// Each expert's size under `moe_intermediate_size` (Qwen's), else `intermediate_size`.
    pub own_size: bool,
    /// Which layers have experts: transformers' Qwen rule (`mlp_only_layers`,
    /// `decoder_sparse_step`), else every layer.
    pub qwen_layers: bool,
    /// The shared expert's size key (Qwen2-MoE's).
    pub shared: Option<&'static str>,
    /// Whether the top-k weights are renormalized whatever the config says (Mixtral has no key;
    /// gpt-oss takes the softmax of the top-k logits, the same weights), else `norm_topk_prob`.
    pub always_renormalize: bool,
    /// Biases on the router and the experts (gpt-oss).
    pub bias: bool,
}

/// A mixture of experts of a Hugging Face config (`None`: no experts, as a Qwen3-MoE without
/// them is a dense model).
pub(super) fn hf_moe(keys: &dyn HfKeys, n_layers: usize, ffn: usize, read: MoeRead) -> Result<Option<MoeConfig>> {
    // transformers 5 writes `num_local_experts` for every one of these (an alias of num_experts)
    let experts = match keys.usize("num_experts")?.or(keys.usize("num_local_experts")?) {
        Some(n) => n,
        None => return Err(Error::Config("config.json: `num_experts` (or `num_local_experts`) is missing".into())),
    };
    let top_k = keys.need_usize("num_experts_per_tok")?;
    let expert_ffn = if read.own_size { keys.need_usize("moe_intermediate_size")? } else { ffn };
    let shared_ffn = match read.shared {
        Some(key) => keys.need_usize(key)?,
        None => 0,
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
    let layers: Vec<usize> = if read.qwen_layers {
        // transformers: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer
        let step = keys.usize("decoder_sparse_step")?.unwrap_or(1).max(1);
        let dense: Vec<usize> = match keys.value("mlp_only_layers") {
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
    Ok(Some(MoeConfig {
        experts,
        top_k,
        ffn: expert_ffn,
        layers,
        norm_topk: read.always_renormalize || hf_norm_topk(keys)?,
        shared_ffn: (shared_ffn > 0).then_some(shared_ffn),
        bias: read.bias,
    })
    .filter(|m| !m.layers.is_empty()))
}

fn hf_norm_topk(keys: &dyn HfKeys) -> Result<bool> {
    match keys.value("norm_topk_prob") {
        None | Some(Value::Null) => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| Error::Config(format!("config.json: norm_topk_prob must be true or false, got {v}"))),
    }
}

/// How llama.cpp's graph for an architecture takes its experts.
pub(super) struct GgufMoeRead {
    /// Whether the architecture is a mixture by name (a `llama` file is one only where it has
    /// experts: Mixtral).
    pub sparse: bool,
    /// Whether the top-k weights are renormalized where `expert_weights_norm` is not written.
    pub renormalize: bool,
    /// Qwen2-MoE's shared expert.
    pub shared: bool,
    /// Gating functions besides softmax (1) that mean the same weights here (gpt-oss's 3).
    pub gating: Option<u64>,
    /// Biases on the router and the experts (gpt-oss).
    pub bias: bool,
}

/// A mixture of experts as llama.cpp reads it: `expert_count` and `expert_used_count`, each
/// expert's size from `expert_feed_forward_length` (`feed_forward_length` where absent, as for
/// OLMoE and Mixtral), the shared expert from `expert_shared_feed_forward_length`. A layer is a
/// mixture where the file has its router (`blk.N.ffn_gate_inp.weight`).
pub(super) fn gguf_moe(keys: &dyn GgufKeys, layers: usize, ffn: usize, read: GgufMoeRead) -> Result<Option<MoeConfig>> {
    let Some(experts) = keys.u64("expert_count").filter(|&n| n > 0) else {
        if read.sparse {
            return Err(Error::Config(format!("{} is missing for a mixture of experts", keys.name("expert_count"))));
        }
        return Ok(None);
    };
    let top_k = keys.need_usize("expert_used_count")?;
    let expert_ffn = keys.u64("expert_feed_forward_length").map_or(ffn, |v| v as usize);
    let shared_ffn = if read.shared { keys.need_usize("expert_shared_feed_forward_length")? } else { 0 };
    check_file_dims(
        layers,
        0,
        &[
            ("expert_count", experts as usize),
            ("expert_used_count", top_k),
            ("expert_feed_forward_length", expert_ffn),
            ("expert_shared_feed_forward_length", shared_ffn),
        ],
    )?;
    if let Some(scale) = keys.f64("expert_weights_scale") {
        if scale != 0.0 && scale != 1.0 {
            return Err(Error::Config(format!("{} {scale} is not supported (1)", keys.name("expert_weights_scale"))));
        }
    }
    if let Some(gating) = keys.u64("expert_gating_func") {
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        if gating != 1 && Some(gating) != read.gating {
            return Err(Error::Config(format!(
                "{} {gating} is not supported (1, softmax)",
                keys.name("expert_gating_func")
            )));
        }
    }
    let norm_topk = keys.bool("expert_weights_norm").unwrap_or(read.renormalize);
    let layers: Vec<usize> = (0..layers).filter(|i| keys.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight"))).collect();
    if layers.is_empty() {
        return Err(Error::Config(format!("{} is {experts} but no layer has a router", keys.name("expert_count"))));
    }
    Ok(Some(MoeConfig {
        experts: experts as usize,
        top_k,
        ffn: expert_ffn,
        layers,
        norm_topk,
        shared_ffn: (shared_ffn > 0).then_some(shared_ffn),
        bias: read.bias,
    }))
}
