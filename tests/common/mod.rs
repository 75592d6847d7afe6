//! Shared test helpers: the adapter (a missing one fails the test, never skips it), small models,
//! and comparisons against the CPU reference.
#![allow(dead_code)]

use kvdecode::{Gpu, ModelConfig, ModelWeights};

/// The adapter for this test run. No adapter is a failure with the reason, never a skip.
pub fn gpu() -> Gpu {
    match Gpu::new() {
        Ok(g) => g,
        Err(e) => panic!("no GPU adapter for the tests: {e}"),
    }
}

/// The seed's layout: 4 layers in groups of 2, every layer a ring of 5 slots.
pub fn tiny_agent_cfg() -> ModelConfig {
    ModelConfig::tiny_agent(96, 32, 4, 2, 8, 64, 4, 2, 5)
}

/// Plain Llama layout: every layer its own global K/V.
pub fn llama_cfg() -> ModelConfig {
    ModelConfig::llama(96, 32, 4, 2, 8, 48, 3, 10000.0, 1e-6, false)
}

pub fn model(cfg: &ModelConfig, seed: u64) -> ModelWeights {
    ModelWeights::random(cfg, seed).expect("random weights")
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Reference logits at the last position of `tokens`.
pub fn ref_last(w: &ModelWeights, tokens: &[u32]) -> Vec<f32> {
    let all = kvdecode::reference::forward(w, tokens).expect("reference forward");
    all[(tokens.len() - 1) * w.cfg.vocab..].to_vec()
}

/// The seed of a random test: `KVDECODE_SEED` if set, else `default`. Printed so a failure can be
/// replayed.
pub fn seed(default: u64) -> u64 {
    let s = std::env::var("KVDECODE_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    println!("seed = {s} (replay with KVDECODE_SEED={s})");
    s
}
