//! Gemma 2 and Gemma 3 text: four norms a layer applied as `1 + w`, the embedding scaled by
//! `sqrt(d)`, the tanh-approximated GELU gate, sliding layers among global ones (Gemma 3: five to
//! one, with their own RoPE base; Gemma 2: alternating, with softcaps on the attention's scores
//! and the final logits). One file for both: Gemma 3 is Gemma 2 with qk-norms, another pattern
//! and another RoPE, each a switch below.

use serde_json::Value;

use super::keys::{hf_sliding, GgufKeys, HfKeys, RopeRead};
use super::{t, Family, GgufFacts, HfFacts, HfType, LayerTensor, Part, Spec};
use crate::error::{Error, Result};
use crate::model::config::{MlpKind, ModelConfig, NormKind};

/// Gemma2Config's and Gemma3TextConfig's head_dim defaults to 256 whatever the hidden size.
const fn gemma(name: &'static str) -> HfType {
    HfType { head_dim: Some(256), kv_heads: Some(4), ..HfType::plain(name) }
}

// Hugging Face's Gemma norms hold `w`, applied as `1 + w` (GGUF's hold the multiplier itself:
// llama.cpp's converter adds the 1)
const HF: HfFacts = HfFacts { tied: true, norm_one_plus: true, ..HfFacts::PLAIN };

pub(super) const GEMMA2: Spec = Spec {
    family: Family::Gemma2,
    hf_types: &[gemma("gemma2")],
    gguf_arch: Some("gemma2"),
    table: TABLE,
    experts: &[],
    hf: HF,
    gguf: GgufFacts::PLAIN,
    from_hf: |c, keys| from_hf(c, keys, true),
    from_gguf: |c, keys| from_gguf(c, keys, true),
};

pub(super) const GEMMA3: Spec = Spec {
    family: Family::Gemma3,
    // a multimodal checkpoint keeps the text model's config under `text_config`
    hf_types: &[gemma("gemma3_text"), HfType { nested: Some("text_config"), ..gemma("gemma3") }],
    gguf_arch: Some("gemma3"),
    table: TABLE,
    experts: &[],
    hf: HF,
    gguf: GgufFacts::PLAIN,
    from_hf: |c, keys| from_hf(c, keys, false),
    from_gguf: |c, keys| from_gguf(c, keys, false),
};

// Gemma's layout: `post_attention_layernorm` is the norm of the attention output, not the MLP's
// input. Gemma 2 lists no qk-norm rows (`qk_norm` is off) and OLMo 2 no input norms
// (`pre_norms` is off), so one table serves Gemma 2, Gemma 3 and OLMo 2.
pub(super) const TABLE: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Q, "self_attn.q_proj.weight", "attn_q.weight"),
    t(Part::K, "self_attn.k_proj.weight", "attn_k.weight"),
    t(Part::V, "self_attn.v_proj.weight", "attn_v.weight"),
    t(Part::QNorm, "self_attn.q_norm.weight", "attn_q_norm.weight"),
    t(Part::KNorm, "self_attn.k_norm.weight", "attn_k_norm.weight"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::PostAttnNorm, "post_attention_layernorm.weight", "post_attention_norm.weight"),
    t(Part::MlpNorm, "pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    t(Part::PostMlpNorm, "post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    t(Part::Gate, "mlp.gate_proj.weight", "ffn_gate.weight"),
    t(Part::Up, "mlp.up_proj.weight", "ffn_up.weight"),
    t(Part::Down, "mlp.down_proj.weight", "ffn_down.weight"),
];

/// What both formats say alike: the norms after each block, the gated GELU, the embedding's scale
/// and Gemma 3's qk-norms.
fn switches(c: &mut ModelConfig, gemma2: bool) {
    c.qk_norm = !gemma2;
    c.post_norms = true;
    c.mlp = MlpKind::GeluTanhGated;
    c.embed_scale = (c.d_model as f32).sqrt();
}

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys, gemma2: bool) -> Result<()> {
    // Gemma 3: five local layers, then a global one; Gemma 2: they alternate
    hf_sliding(c, keys, None, |n, _| {
        let pattern = keys.usize("sliding_window_pattern")?.unwrap_or(if gemma2 { 2 } else { 6 }).max(1);
        Ok((0..n).map(|i| (i + 1) % pattern != 0).collect())
    })?;
    let read = |layer_type, theta_key, default_theta, scaled| RopeRead {
        layer_type,
        theta_key,
        default_theta,
        scaled,
        yarn_is_longrope: false,
    };
    (c.rope_theta, c.rope_scaling) =
        keys.rope(read("full_attention", "rope_theta", if gemma2 { 10000.0 } else { 1_000_000.0 }, true))?;
    // Gemma 3: flat parameters scale the global layers only, local ones have their own base;
    // Gemma 2: one RoPE for both
    (c.rope_theta_local, c.rope_scaling_local) = if gemma2 {
        (c.rope_theta, c.rope_scaling.clone())
    } else {
        keys.rope(read("sliding_attention", "rope_local_base_freq", 10000.0, false))?
    };
    c.norm = NormKind::OnePlusWeight;
    switches(c, gemma2);
    c.attn_scale = keys.f32("query_pre_attn_scalar").unwrap_or(c.head_dim as f32).powf(-0.5);
    // Gemma2Config's defaults are 30 and 50 (an explicit null turns them off)
    let softcap = |key: &str, default: Option<f32>| match keys.value(key) {
        None => default,
        Some(v) => v.as_f64().map(|c| c as f32),
    };
    c.logit_softcap = softcap("final_logit_softcapping", gemma2.then_some(30.0));
    c.attn_softcap = softcap("attn_logit_softcapping", gemma2.then_some(50.0));
    let act = keys
        .value("hidden_activation")
        .or_else(|| keys.value("hidden_act"))
        .and_then(Value::as_str)
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(Error::Config(format!(
            "config.json: hidden_activation {act:?} is not supported for {}",
            keys.model_type()
        )));
    }
    Ok(())
}

fn from_gguf(c: &mut ModelConfig, keys: &dyn GgufKeys, gemma2: bool) -> Result<()> {
    // llama.cpp's Gemma 3: every 6th layer global, the rest a sliding window with RoPE base 1e4;
    // Gemma 2: even layers slide, one RoPE
    let period = if gemma2 { 2 } else { 6 };
    c.set_sliding(keys.need_usize("attention.sliding_window")?, |i| (i + 1) % period != 0);
    if !gemma2 {
        c.rope_theta_local = 10000.0;
        c.rope_scaling_local = None;
    }
    switches(c, gemma2);
    // llama.cpp: Gemma 2 27B (46 layers) scales by (d / heads)^-0.5, others by head_dim's
    let scale_dim = if gemma2 && c.layers.len() == 46 { c.d_model / c.n_heads } else { c.head_dim };
    c.attn_scale = (scale_dim as f32).powf(-0.5);
    let softcap = |key: &str, default: Option<f64>| keys.f64(key).or(default).map(|v| v as f32);
    c.logit_softcap = softcap("final_logit_softcapping", gemma2.then_some(30.0));
    c.attn_softcap = if gemma2 { softcap("attn_logit_softcapping", Some(50.0)) } else { None };
    Ok(())
}
