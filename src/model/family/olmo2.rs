//! OLMo 2: norms on the attention's and the MLP's outputs only (none before them), queries and
//! keys normed over their whole projection.

use super::keys::{hf_finish, hf_rope, hf_sliding, no_sliding, GgufKeys, HfKeys};
use super::{Family, GgufFacts, HfFacts, HfType, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Olmo2,
    hf_types: &[HfType::plain("olmo2")],
    gguf_arch: Some("olmo2"),
    // Gemma's names: `post_attention_layernorm` is the attention output's norm
    table: super::gemma::TABLE,
    experts: &[],
    hf: HfFacts { eps: 1e-5, ..HfFacts::PLAIN },
    gguf: GgufFacts::PLAIN,
    from_hf,
    from_gguf,
};

fn switches(c: &mut ModelConfig) {
    (c.qk_norm, c.qk_norm_whole, c.pre_norms, c.post_norms) = (true, true, false, true);
}

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    hf_sliding(c, keys, None, no_sliding)?;
    hf_rope(c, keys, 10000.0, false)?;
    switches(c);
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, _: &dyn GgufKeys) -> Result<()> {
    switches(c);
    Ok(())
}
