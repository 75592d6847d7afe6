//! Sampling parameters and the CPU twin of `shaders/sample.wgsl` (for tests and CPU fallbacks).

use crate::error::{Error, Result};

/// How one row picks its next token (on the GPU, `shaders/sample.wgsl`).
///
/// The reported log-probability of a sampled token is `log softmax(logits / temperature)` at that
/// token (`log softmax(logits)` when greedy), before top-k / top-p truncation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampler {
    /// 0 (or less): greedy argmax. Otherwise a draw from `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Seed of the row's draws. A draw depends on (seed, position, token id) only, so the same
    /// seed gives the same tokens whatever else shares the batch.
    pub seed: u32,
    /// Keep only the `top_k` most likely tokens (0: off).
    pub top_k: u32,
    /// Then keep the smallest set of tokens whose probability reaches `top_p` (1: off).
    pub top_p: f32,
}

impl Sampler {
    /// Greedy decoding.
    pub const GREEDY: Sampler = Sampler { temperature: 0.0, seed: 0, top_k: 0, top_p: 1.0 };

    /// Temperature sampling with a seed.
    pub fn temperature(temperature: f32, seed: u32) -> Self {
        Sampler { temperature, seed, top_k: 0, top_p: 1.0 }
    }

    /// With top-k truncation.
    pub fn with_top_k(self, top_k: u32) -> Self {
        Sampler { top_k, ..self }
    }

    /// With top-p (nucleus) truncation.
    pub fn with_top_p(self, top_p: f32) -> Self {
        Sampler { top_p, ..self }
    }

    pub(crate) fn check(&self, row: usize) -> Result<()> {
        if !self.temperature.is_finite() {
            return Err(Error::Input(format!("row {row}: temperature {} is not finite", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!("row {row}: top_p {} must be in (0, 1]", self.top_p)));
        }
        Ok(())
    }
}

/// GPU layout of one row's sampler (matches `struct Sampler` in `sample.wgsl`).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct SamplerGpu {
    temperature: f32,
    seed: u32,
    counter: u32,
    top_k: u32,
    top_p: f32,
    _pad: [u32; 3],
}

impl SamplerGpu {
    pub(crate) fn new(s: &Sampler, counter: u32) -> Self {
        SamplerGpu {
            temperature: s.temperature,
            seed: s.seed,
            counter,
            top_k: s.top_k,
            top_p: s.top_p.min(1.0),
            _pad: [0; 3],
        }
    }
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

/// What the GPU sampler picks for `logits` (same hash, same kept set, same tie rule), with its
/// log-probability: `counter` is the position the sampled token will take. Sums run in another
/// order than on the GPU, so a top-p boundary that is a near tie can fall differently.
pub fn sample_cpu(logits: &[f32], s: Sampler, counter: u32) -> (u32, f32) {
    let t = s.temperature;
    let score = |l: f32| if t > 0.0 { l / t } else { l };
    let v = logits.len();
    let (mut m, mut greedy) = (f32::NEG_INFINITY, 0usize);
    let mut mn = f32::INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        let x = score(l);
        if x > m {
            m = x;
            greedy = i;
        }
        mn = mn.min(x);
    }
    let z: f32 = logits.iter().map(|&l| (score(l) - m).exp()).sum();
    let mut thr = mn;
    if t > 0.0 && s.top_k > 0 && (s.top_k as usize) < v {
        let (mut lo, mut hi) = (mn, m);
        for _ in 0..32 {
            let mid = 0.5 * (lo + hi);
            let c = logits.iter().filter(|&&l| score(l) >= mid).count();
            if c as f32 >= s.top_k as f32 {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        thr = lo;
    }
    if t > 0.0 && s.top_p < 1.0 {
        let zk: f32 = logits.iter().map(|&l| score(l)).filter(|&x| x >= thr).map(|x| (x - m).exp()).sum();
        let (mut lo, mut hi) = (thr, m);
        for _ in 0..32 {
            let mid = 0.5 * (lo + hi);
            let p: f32 = logits.iter().map(|&l| score(l)).filter(|&x| x >= mid).map(|x| (x - m).exp()).sum();
            if p >= s.top_p * zk {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        thr = lo;
    }
    let mut chosen = greedy;
    if t > 0.0 {
        let mut best = f32::NEG_INFINITY;
        for (i, &l) in logits.iter().enumerate() {
            let x = score(l);
            if x >= thr {
                let g = x - (-(uniform01(s.seed, counter, i as u32)).ln()).ln();
                if g > best {
                    best = g;
                    chosen = i;
                }
            }
        }
    }
    (chosen as u32, score(logits[chosen]) - m - z.ln())
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
