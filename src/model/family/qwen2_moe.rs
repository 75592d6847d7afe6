//! Qwen2-MoE: Qwen2's attention with q/k/v biases, routed experts and a shared one behind a
//! sigmoid gate.

use super::keys::{gguf_moe, hf_finish, hf_moe, hf_rope, GgufKeys, GgufMoeRead, HfKeys, MoeRead};
use super::{Family, GgufFacts, HfFacts, HfType, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Qwen2Moe,
    hf_types: &[HfType { kv_heads: Some(16), ..HfType::plain("qwen2_moe") }],
    gguf_arch: Some("qwen2moe"),
    table: super::llama::TABLE,
    experts: super::qwen3_moe::EXPERTS,
    hf: HfFacts::PLAIN,
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    super::qwen3_moe::qwen_moe_sliding(c, keys)?;
    hf_rope(c, keys, 10000.0, false)?;
    c.qkv_bias = true;
    let read = MoeRead {
        own_size: true,
        qwen_layers: true,
        shared: Some("shared_expert_intermediate_size"),
        always_renormalize: false,
        bias: false,
    };
    c.moe = hf_moe(keys, c.layers.len(), c.ffn, read)?;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, keys: &dyn GgufKeys) -> Result<()> {
    // llama.cpp's graph does not renormalize Qwen2-MoE's top-k weights
    let read = GgufMoeRead { sparse: true, renormalize: false, shared: true, gating: None, bias: false };
    c.moe = gguf_moe(keys, c.layers.len(), c.ffn, read)?;
    c.qkv_bias = true;
    Ok(())
}
