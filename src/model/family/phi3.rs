//! Phi-3, 3.5 and 4-mini: Llama's norms with q, k and v fused in one tensor and gate and up in
//! another, partial rotary and LongRoPE.

use super::keys::{hf_finish, hf_rope, hf_sliding, GgufKeys, HfKeys};
use super::{t, Family, GgufFacts, HfFacts, HfType, LayerTensor, Part, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Phi3,
    hf_types: &[HfType::plain("phi3")],
    gguf_arch: Some("phi3"),
    table: TABLE,
    experts: &[],
    hf: HfFacts::PLAIN,
    // its rope.dimension_count is the rotated part of a head, not a head's size; six tensors a
    // layer (the fused ones)
    gguf: GgufFacts { partial_rotary: true, layer_tensors: 6, ..GgufFacts::PLAIN },
    from_hf,
    from_gguf,
};

// Phi-3's layout: Llama's norms, q, k and v fused in one tensor, gate and up in another (GGUF
// keeps both fused; its `ffn_up` holds gate and up).
const TABLE: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Qkv, "self_attn.qkv_proj.weight", "attn_qkv.weight"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::MlpNorm, "post_attention_layernorm.weight", "ffn_norm.weight"),
    t(Part::GateUp, "mlp.gate_up_proj.weight", "ffn_up.weight"),
    t(Part::Down, "mlp.down_proj.weight", "ffn_down.weight"),
];

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    // every layer slides when the window is shorter than the trained context (Phi-3.5's 262144
    // of 131072 hides nothing, and a ring that long would only take memory)
    hf_sliding(c, keys, None, |n, window| {
        let trained = keys.usize("max_position_embeddings")?.unwrap_or(usize::MAX);
        Ok(vec![window.is_some_and(|w| w < trained); n])
    })?;
    // older configs name LongRoPE `su` or `yarn`
    hf_rope(c, keys, 10000.0, true)?;
    hf_finish(c, keys)
}

fn from_gguf(_: &mut ModelConfig, _: &dyn GgufKeys) -> Result<()> {
    Ok(())
}
