//! Qwen3-MoE: Qwen3's attention, routed experts of their own size, dense layers among them where
//! the config says.

use super::keys::{
    gguf_moe, hf_finish, hf_moe, hf_rope, hf_sliding, no_sliding, GgufKeys, GgufMoeRead, HfKeys, MoeRead,
};
use super::{t, Family, GgufFacts, HfFacts, HfType, LayerTensor, Part, Spec};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Qwen3Moe,
    hf_types: &[HfType { kv_heads: Some(4), ..HfType::plain("qwen3_moe") }],
    gguf_arch: Some("qwen3moe"),
    table: super::llama::TABLE,
    experts: EXPERTS,
    hf: HfFacts::PLAIN,
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

// The routed experts' rows after Llama's (a dense layer's MLP keeps Llama's names): the router and
// each expert `{e}` on MoE layers, and Qwen2-MoE's shared expert with its sigmoid gate where the
// config has one (Qwen3-MoE, Qwen2-MoE, OLMoE). GGUF keeps each layer's experts stacked in one
// tensor per projection (llama.cpp's `_exps`).
pub(super) const EXPERTS: &[LayerTensor] = &[
    t(Part::Router, "mlp.gate.weight", "ffn_gate_inp.weight"),
    t(Part::ExpertGate, "mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight"),
    t(Part::ExpertUp, "mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight"),
    t(Part::ExpertDown, "mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight"),
    t(Part::SharedGateProj, "mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    t(Part::SharedUpProj, "mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    t(Part::SharedDownProj, "mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    t(Part::SharedMix, "mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
];

/// Qwen's MoE configs (Qwen3-MoE's and Qwen2-MoE's) take no sliding window.
pub(super) fn qwen_moe_sliding(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    let use_window = keys.bool("use_sliding_window").unwrap_or(false);
    hf_sliding(c, keys, None, |n, _| match use_window {
        true => Err(Error::Config(format!(
            "config.json: use_sliding_window=true is not supported for {}",
            keys.model_type()
        ))),
        false => no_sliding(n, None),
    })
}

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    qwen_moe_sliding(c, keys)?;
    hf_rope(c, keys, 10000.0, false)?;
    c.qk_norm = true;
    let read = MoeRead { own_size: true, qwen_layers: true, shared: None, always_renormalize: false, bias: false };
    c.moe = hf_moe(keys, c.layers.len(), c.ffn, read)?;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, keys: &dyn GgufKeys) -> Result<()> {
    // llama.cpp's graph renormalizes Qwen3-MoE's top-k weights
    let read = GgufMoeRead { sparse: true, renormalize: true, shared: false, gating: None, bias: false };
    c.moe = gguf_moe(keys, c.layers.len(), c.ffn, read)?;
    c.qk_norm = true;
    Ok(())
}
