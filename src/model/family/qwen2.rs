//! Qwen2 and Qwen2.5: Llama's layout with biases on q, k and v.

use super::keys::{hf_finish, hf_rope, hf_sliding, GgufKeys, HfKeys};
use super::{Family, GgufFacts, HfFacts, HfType, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Qwen2,
    hf_types: &[HfType { kv_heads: Some(32), ..HfType::plain("qwen2") }],
    gguf_arch: Some("qwen2"),
    table: super::llama::TABLE,
    experts: &[],
    hf: HfFacts::PLAIN,
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    // the layers from `max_window_layers` on slide, when `use_sliding_window`
    let use_window = keys.bool("use_sliding_window").unwrap_or(false);
    hf_sliding(c, keys, None, |n, window| {
        let from = keys.usize("max_window_layers")?.unwrap_or(28);
        Ok((0..n).map(|i| use_window && window.is_some() && i >= from).collect())
    })?;
    hf_rope(c, keys, 10000.0, false)?;
    c.qkv_bias = true;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, _: &dyn GgufKeys) -> Result<()> {
    c.qkv_bias = true;
    Ok(())
}
