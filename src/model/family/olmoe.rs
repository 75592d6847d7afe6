//! OLMoE: Llama's norms, queries and keys normed over their whole projection, routed experts on
//! every layer.

use super::keys::{
    gguf_moe, hf_finish, hf_moe, hf_rope, hf_sliding, no_sliding, GgufKeys, GgufMoeRead, HfKeys, MoeRead,
};
use super::{Family, GgufFacts, HfFacts, HfType, Spec};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Olmoe,
    hf_types: &[HfType::plain("olmoe")],
    gguf_arch: Some("olmoe"),
    table: super::llama::TABLE,
    experts: super::qwen3_moe::EXPERTS,
    hf: HfFacts { eps: 1e-5, ..HfFacts::PLAIN },
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    hf_sliding(c, keys, None, no_sliding)?;
    hf_rope(c, keys, 10000.0, false)?;
    (c.qk_norm, c.qk_norm_whole) = (true, true);
    let read = MoeRead { own_size: false, qwen_layers: false, shared: None, always_renormalize: false, bias: false };
    c.moe = hf_moe(keys, c.layers.len(), c.ffn, read)?;
    if c.moe.is_some() && keys.value("clip_qkv").is_some_and(|v| !v.is_null()) {
        return Err(Error::Config("config.json: clip_qkv is not supported for olmoe".into()));
    }
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, keys: &dyn GgufKeys) -> Result<()> {
    // llama.cpp's graph does not renormalize OLMoE's top-k weights
    let read = GgufMoeRead { sparse: true, renormalize: false, shared: false, gating: None, bias: false };
    c.moe = gguf_moe(keys, c.layers.len(), c.ffn, read)?;
    (c.qk_norm, c.qk_norm_whole) = (true, true);
    Ok(())
}
