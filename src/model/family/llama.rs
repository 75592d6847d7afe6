//! Llama (Llama 2 and 3.x, SmolLM and SmolLM2) and Mistral: the layout most families build on.

use super::keys::{gguf_moe, hf_finish, hf_rope, hf_sliding, GgufKeys, GgufMoeRead, HfKeys};
use super::{t, Family, GgufFacts, HfFacts, HfType, LayerTensor, Part, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Llama,
    // Mistral is Llama with a window: the same tensor names, in Hugging Face and in GGUF
    hf_types: &[HfType::plain("llama"), HfType { kv_heads: Some(8), ..HfType::plain("mistral") }],
    gguf_arch: Some("llama"),
    table: TABLE,
    experts: &[],
    hf: HfFacts::PLAIN,
    // llama.cpp's converter stores Q and K rows interleaved for its RoPE
    gguf: GgufFacts { interleaves_qk: true, ..GgufFacts::PLAIN },
    from_hf,
    from_gguf,
};

// Llama's layout: `post_attention_layernorm` is the MLP's input norm. Qwen3's qk-norms and
// Qwen2's biases are rows here too; `tensor_names` lists a row only where the config has that
// weight (`qk_norm`, `qkv_bias`), so one table serves Llama, Qwen2, Qwen3, SmolLM3 and the
// mixtures of experts' attention.
pub(super) const TABLE: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Q, "self_attn.q_proj.weight", "attn_q.weight"),
    t(Part::K, "self_attn.k_proj.weight", "attn_k.weight"),
    t(Part::V, "self_attn.v_proj.weight", "attn_v.weight"),
    t(Part::QBias, "self_attn.q_proj.bias", "attn_q.bias"),
    t(Part::KBias, "self_attn.k_proj.bias", "attn_k.bias"),
    t(Part::VBias, "self_attn.v_proj.bias", "attn_v.bias"),
    t(Part::QNorm, "self_attn.q_norm.weight", "attn_q_norm.weight"),
    t(Part::KNorm, "self_attn.k_norm.weight", "attn_k_norm.weight"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::MlpNorm, "post_attention_layernorm.weight", "ffn_norm.weight"),
    t(Part::Gate, "mlp.gate_proj.weight", "ffn_gate.weight"),
    t(Part::Up, "mlp.up_proj.weight", "ffn_up.weight"),
    t(Part::Down, "mlp.down_proj.weight", "ffn_down.weight"),
];

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    // Mistral's window covers every layer, where it is set
    let mistral = keys.model_type() == "mistral";
    hf_sliding(c, keys, None, |n, window| Ok(vec![mistral && window.is_some(); n]))?;
    hf_rope(c, keys, 10000.0, false)?;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, keys: &dyn GgufKeys) -> Result<()> {
    // llama.cpp's converter writes Mixtral as a Llama with experts
    let read = GgufMoeRead { sparse: false, renormalize: true, shared: false, gating: None, bias: false };
    c.moe = gguf_moe(keys, c.layers.len(), c.ffn, read)?;
    if c.moe.is_some() {
        c.family = Family::Mixtral;
    }
    Ok(())
}
