//! Sampling parameters and the CPU twin of `shaders/sample.wgsl` (for tests and CPU fallbacks).

use crate::error::{Error, Result};

/// How one row picks its next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampler {
    /// 0 (or less): greedy argmax. Otherwise a draw from `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Seed of the row's draws. A draw depends on (seed, position, token id) only, so the same
    /// seed gives the same tokens whatever else shares the batch.
    pub seed: u32,
}

impl Sampler {
    /// Greedy decoding.
    pub const GREEDY: Sampler = Sampler { temperature: 0.0, seed: 0 };

    /// Temperature sampling with a seed.
    pub fn temperature(temperature: f32, seed: u32) -> Self {
        Sampler { temperature, seed }
    }

    pub(crate) fn check(&self, row: usize) -> Result<()> {
        if !self.temperature.is_finite() {
            return Err(Error::Input(format!("row {row}: temperature {} is not finite", self.temperature)));
        }
        Ok(())
    }
}

/// GPU layout of one row's sampler (matches `struct Sampler` in `sample.wgsl`).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct SamplerGpu {
    pub temperature: f32,
    pub seed: u32,
    pub counter: u32,
    pub _pad: u32,
}

fn pcg(v: u32) -> u32 {
    let s = v.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let w = ((s >> ((s >> 28) + 4)) ^ s).wrapping_mul(277_803_737);
    (w >> 22) ^ w
}

fn uniform01(seed: u32, counter: u32, id: u32) -> f32 {
    let h = pcg(pcg(pcg(seed) ^ counter) ^ id);
    ((h >> 8) as f32 + 0.5) / 16_777_216.0
}

/// What the GPU sampler picks for `logits` (same hash, same tie rule): `counter` is the position
/// the sampled token will take.
pub fn sample_cpu(logits: &[f32], s: Sampler, counter: u32) -> u32 {
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for (i, &l) in logits.iter().enumerate() {
        let mut v = l;
        if s.temperature > 0.0 {
            v = v / s.temperature - (-(uniform01(s.seed, counter, i as u32)).ln()).ln();
        }
        if v > best.0 {
            best = (v, i as u32);
        }
    }
    best.1
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}
