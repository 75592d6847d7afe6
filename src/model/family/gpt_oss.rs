//! gpt-oss: attention sinks, biases on q/k/v/o, the router and the experts, the clamped SwiGLU,
//! sliding and full layers alternating, experts stored fused and transposed (and in OpenAI's
//! checkpoints as MXFP4 blocks).

use super::keys::{gguf_moe, hf_finish, hf_moe, hf_rope, hf_sliding, GgufKeys, GgufMoeRead, HfKeys, MoeRead};
use super::{t, Family, GgufFacts, HfFacts, HfType, LayerTensor, Part, Spec};
use crate::error::{Error, Result};
use crate::model::config::{MlpKind, ModelConfig, SWIGLU_ALPHA, SWIGLU_LIMIT};
use crate::model::rope::{yarn_mscale, RopeScaling};

pub(super) const SPEC: Spec = Spec {
    family: Family::GptOss,
    hf_types: &[HfType { head_dim: Some(64), kv_heads: Some(8), ..HfType::plain("gpt_oss") }],
    gguf_arch: Some("gpt-oss"),
    table: TABLE,
    experts: &[],
    // its attention biases are read below; its MXFP4 experts are read as their blocks
    hf: HfFacts { eps: 1e-5, attention_bias: true, quant: Some("mxfp4"), ..HfFacts::PLAIN },
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

// gpt-oss's layout: Llama's norms and biased q/k/v, a biased output projection, a sink per head,
// and on every layer a biased router and the experts: in Hugging Face two fused, transposed
// tensors (gate and up interleaved); llama.cpp's converter splits them into the `_exps` tensors
// and their biases. llama.cpp names the MLP's input norm `post_attention_norm`.
const TABLE: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Q, "self_attn.q_proj.weight", "attn_q.weight"),
    t(Part::K, "self_attn.k_proj.weight", "attn_k.weight"),
    t(Part::V, "self_attn.v_proj.weight", "attn_v.weight"),
    t(Part::QBias, "self_attn.q_proj.bias", "attn_q.bias"),
    t(Part::KBias, "self_attn.k_proj.bias", "attn_k.bias"),
    t(Part::VBias, "self_attn.v_proj.bias", "attn_v.bias"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::OBias, "self_attn.o_proj.bias", "attn_output.bias"),
    t(Part::Sinks, "self_attn.sinks", "attn_sinks.weight"),
    t(Part::MlpNorm, "post_attention_layernorm.weight", "post_attention_norm.weight"),
    t(Part::Router, "mlp.router.weight", "ffn_gate_inp.weight"),
    t(Part::RouterBias, "mlp.router.bias", "ffn_gate_inp.bias"),
    t(Part::ExpertsGateUpT, "mlp.experts.gate_up_proj", ""),
    t(Part::ExpertsGateUpBias, "mlp.experts.gate_up_proj_bias", ""),
    t(Part::ExpertsDownT, "mlp.experts.down_proj", ""),
    t(Part::ExpertsDownBias, "mlp.experts.down_proj_bias", "ffn_down_exps.bias"),
    t(Part::ExpertGate, "", "ffn_gate_exps.weight"),
    t(Part::ExpertUp, "", "ffn_up_exps.weight"),
    t(Part::ExpertDown, "", "ffn_down_exps.weight"),
    t(Part::ExpertGateBias, "", "ffn_gate_exps.bias"),
    t(Part::ExpertUpBias, "", "ffn_up_exps.bias"),
];

/// A sink per head and the clamped SwiGLU, in both formats.
fn switches(c: &mut ModelConfig) {
    c.attn_sinks = true;
    c.mlp = MlpKind::ClampedSwiGlu;
}

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    // sliding and full layers alternating, from a sliding one; GptOssConfig's window is 128
    hf_sliding(c, keys, Some(128), |n, _| Ok((0..n).map(|i| i % 2 == 0).collect()))?;
    hf_rope(c, keys, 150_000.0, false)?;
    // attention_bias (default true) puts biases on q, k, v and o alike
    let biased = keys.bool("attention_bias").unwrap_or(true);
    (c.qkv_bias, c.o_bias) = (biased, biased);
    switches(c);
    // no rope keys at all: GptOssConfig's own default, YaRN 32x over 4096 positions
    if !keys.has_rope_params("full_attention") {
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
        if let Some(v) = keys.f32(key).filter(|&v| v != want) {
            return Err(Error::Config(format!("config.json: {key}={v} is not supported for gpt_oss (only {want})")));
        }
    }
    // the router takes the softmax of the top-k logits: renormalized weights
    let read = MoeRead { own_size: false, qwen_layers: false, shared: None, always_renormalize: true, bias: true };
    c.moe = hf_moe(keys, c.layers.len(), c.ffn, read)?;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, keys: &dyn GgufKeys) -> Result<()> {
    // llama.cpp's graph takes SOFTMAX_WEIGHT (3) whatever the key says: the same weights,
    // renormalized
    let read = GgufMoeRead { sparse: true, renormalize: true, shared: false, gating: Some(3), bias: true };
    c.moe = gguf_moe(keys, c.layers.len(), c.ffn, read)?;
    // llama.cpp's gpt-oss: even layers slide (its swa pattern 2), biases on q/k/v/o and the
    // experts, the clamped SwiGLU (SWIGLU_OAI: 1.702, 7)
    c.set_sliding(keys.need_usize("attention.sliding_window")?, |i| i % 2 == 0);
    if let Some(base) = keys.f64("rope.freq_base_swa") {
        c.rope_theta_local = base as f32;
    }
    c.qkv_bias = keys.has_tensor("blk.0.attn_q.bias");
    c.o_bias = keys.has_tensor("blk.0.attn_output.bias");
    switches(c);
    Ok(())
}
