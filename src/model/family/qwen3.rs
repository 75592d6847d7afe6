//! Qwen3: Llama's layout with an RMS norm of each query and key head (qk-norm).

use super::keys::{hf_finish, hf_rope, hf_sliding, no_sliding, GgufKeys, HfKeys};
use super::{Family, GgufFacts, HfFacts, HfType, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Qwen3,
    // Qwen3Config's head_dim defaults to 128 whatever the hidden size
    hf_types: &[HfType { head_dim: Some(128), kv_heads: Some(32), ..HfType::plain("qwen3") }],
    gguf_arch: Some("qwen3"),
    table: super::llama::TABLE,
    experts: &[],
    hf: HfFacts::PLAIN,
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    hf_sliding(c, keys, None, no_sliding)?;
    hf_rope(c, keys, 10000.0, false)?;
    c.qk_norm = true;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, _: &dyn GgufKeys) -> Result<()> {
    c.qk_norm = true;
    Ok(())
}
