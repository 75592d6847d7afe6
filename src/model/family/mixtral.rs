//! Mixtral: Mistral's attention, routed experts on every layer under `block_sparse_moe`.

use super::keys::{hf_finish, hf_moe, hf_rope, hf_sliding, GgufKeys, HfKeys, MoeRead};
use super::{t, Family, GgufFacts, HfFacts, HfType, LayerTensor, Part, Spec};
use crate::error::Result;
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::Mixtral,
    hf_types: &[HfType { kv_heads: Some(8), ..HfType::plain("mixtral") }],
    // llama.cpp writes Mixtral as `llama` with experts: `llama.rs` reads those files
    gguf_arch: None,
    table: super::llama::TABLE,
    experts: EXPERTS,
    hf: HfFacts { eps: 1e-5, ..HfFacts::PLAIN },
    gguf: GgufFacts { interleaves_qk: true, ..GgufFacts::PLAIN },
    from_hf,
    from_gguf,
};

// Mixtral's experts after Llama's rows: under `block_sparse_moe` as w1 (gate), w3 (up) and w2
// (down).
const EXPERTS: &[LayerTensor] = &[
    t(Part::Router, "block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    t(Part::ExpertGate, "block_sparse_moe.experts.{e}.w1.weight", "ffn_gate_exps.weight"),
    t(Part::ExpertUp, "block_sparse_moe.experts.{e}.w3.weight", "ffn_up_exps.weight"),
    t(Part::ExpertDown, "block_sparse_moe.experts.{e}.w2.weight", "ffn_down_exps.weight"),
];

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    // every layer slides, when the window is set
    hf_sliding(c, keys, None, |n, window| Ok(vec![window.is_some(); n]))?;
    hf_rope(c, keys, 1_000_000.0, false)?;
    // Mixtral always renormalizes its top-k weights (its config has no key for it)
    let read = MoeRead { own_size: false, qwen_layers: false, shared: None, always_renormalize: true, bias: false };
    c.moe = hf_moe(keys, c.layers.len(), c.ffn, read)?;
    hf_finish(c, keys)
}

// (no GGUF architecture names Mixtral: `llama.rs` reads its files and sets the family)
fn from_gguf(_: &mut ModelConfig, _: &dyn GgufKeys) -> Result<()> {
    Ok(())
}
