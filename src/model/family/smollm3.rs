//! SmolLM3: Llama's tensors, every fourth layer without RoPE (NoPE).

use serde_json::Value;

use super::keys::{hf_finish, hf_rope, hf_sliding, GgufKeys, HfKeys};
use super::{Family, GgufFacts, HfFacts, HfType, Spec};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;

pub(super) const SPEC: Spec = Spec {
    family: Family::SmolLM3,
    hf_types: &[HfType { kv_heads: Some(4), ..HfType::plain("smollm3") }],
    gguf_arch: Some("smollm3"),
    table: super::llama::TABLE,
    experts: &[],
    hf: HfFacts { tied: true, ..HfFacts::PLAIN },
    // llama.cpp's converter interleaves Q and K rows as for Llama
    gguf: GgufFacts { interleaves_qk: true, ..GgufFacts::PLAIN },
    from_hf,
    from_gguf,
};

fn from_hf(c: &mut ModelConfig, keys: &dyn HfKeys) -> Result<()> {
    let n_layers = c.layers.len();
    // `no_rope_layers[i]` is 1 where layer i rotates (default: all but every
    // `no_rope_layer_interval`-th)
    let rotates: Vec<bool> = match keys.value("no_rope_layers").and_then(Value::as_array) {
        Some(flags) => {
            if flags.len() != n_layers {
                return Err(Error::Config(format!(
                    "config.json: {} no_rope_layers for {n_layers} layers",
                    flags.len()
                )));
            }
            flags
                .iter()
                .map(|f| match f.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(Error::Config(format!("config.json: no_rope_layers holds {f}, expected 0 or 1"))),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let every = keys.usize("no_rope_layer_interval")?.unwrap_or(4).max(1);
            (0..n_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    // the NoPE layers slide, when `use_sliding_window`
    let use_window = keys.bool("use_sliding_window").unwrap_or(false);
    hf_sliding(c, keys, None, |_, window| Ok(rotates.iter().map(|&r| use_window && window.is_some() && !r).collect()))?;
    c.nope_layers = (0..n_layers).filter(|&i| !rotates[i]).collect();
    hf_rope(c, keys, 2_000_000.0, false)?;
    hf_finish(c, keys)
}

fn from_gguf(c: &mut ModelConfig, _: &dyn GgufKeys) -> Result<()> {
    // llama.cpp's SmolLM3: every fourth layer rotates nothing (no key says so)
    c.nope_layers = (0..c.layers.len()).filter(|i| (i + 1) % 4 == 0).collect();
    Ok(())
}
