//! Sampling parameters and the CPU twin of `shaders/sample.wgsl` (for tests and CPU fallbacks).

use crate::error::{Error, Result};

/// How one row picks its next token (on the GPU, `shaders/sample.wgsl`).
///
/// The reported log-probability of a sampled token (and of its alternatives) is that of the
/// distribution [`Sampler::logprobs`] names, always after the row's logit bias and token mask:
/// by default `log softmax(logits / temperature)` at that token (`log softmax(logits)` when
/// greedy), before top-k / top-p / min-p truncation.
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
    /// Then keep only the tokens whose probability is at least `min_p` times the most likely
    /// one's (0: off; in [0, 1]).
    pub min_p: f32,
    /// Which distribution the reported log-probabilities are of ([`LogprobMode`]).
    pub logprobs: LogprobMode,
    /// Also report this many most likely tokens with their log-probabilities (0 to
    /// [`TOP_LOGPROBS_MAX`]; single-step sampling only).
    pub top_logprobs: u32,
}

/// Which distribution a sampled token's reported log-probability is of (vLLM's `logprobs_mode`).
/// Importance sampling in RL wants [`LogprobMode::Processed`] when the rollout truncates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogprobMode {
    /// `log softmax(logits / temperature)` over the whole vocabulary, before truncation.
    #[default]
    Scaled,
    /// `log softmax(logits)`: the model's own distribution, before temperature and truncation.
    Raw,
    /// The distribution the token was drawn from: `softmax(logits / temperature)` over the kept
    /// tokens only (after top-k, top-p and min-p), renormalized; a token not kept has `-inf`.
    /// Greedy rows report [`LogprobMode::Raw`]'s.
    Processed,
}

impl LogprobMode {
    /// `scaled`, `raw` or `processed` (vLLM's `raw_logprobs` and `processed_logprobs` too).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "scaled" => Ok(LogprobMode::Scaled),
            "raw" | "raw_logprobs" => Ok(LogprobMode::Raw),
            "processed" | "processed_logprobs" => Ok(LogprobMode::Processed),
            _ => Err(Error::Input(format!("logprobs mode {s:?}: expected raw, scaled or processed"))),
        }
    }

    /// Its name, as [`LogprobMode::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            LogprobMode::Scaled => "scaled",
            LogprobMode::Raw => "raw",
            LogprobMode::Processed => "processed",
        }
    }
}

/// Most alternatives a sampler can report per token.
pub const TOP_LOGPROBS_MAX: u32 = 20;

impl Default for Sampler {
    fn default() -> Self {
        Sampler::GREEDY
    }
}

/// A sampled token, its log-probability, and the most likely alternatives when asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its log-probability (see [`Sampler`]).
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens, most likely first, with their log-probabilities.
    pub top: Vec<(u32, f32)>,
    /// How many tokens the draw was among: those top-k, top-p and min-p kept (every token the
    /// row's mask allows, when nothing truncates or the row is greedy).
    pub kept: u32,
}

impl Sampler {
    /// Greedy decoding.
    pub const GREEDY: Sampler = Sampler {
        temperature: 0.0,
        seed: 0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        logprobs: LogprobMode::Scaled,
        top_logprobs: 0,
    };

    /// Temperature sampling with a seed.
    pub fn temperature(temperature: f32, seed: u32) -> Self {
        Sampler { temperature, seed, ..Sampler::GREEDY }
    }

    /// With min-p truncation.
    pub fn with_min_p(self, min_p: f32) -> Self {
        Sampler { min_p, ..self }
    }

    /// Reporting log-probabilities of `mode`'s distribution.
    pub fn with_logprobs(self, mode: LogprobMode) -> Self {
        Sampler { logprobs: mode, ..self }
    }

    /// Also report the `n` most likely tokens with their log-probabilities.
    pub fn with_top_logprobs(self, n: u32) -> Self {
        Sampler { top_logprobs: n, ..self }
    }

    /// With top-k truncation.
    pub fn with_top_k(self, top_k: u32) -> Self {
        Sampler { top_k, ..self }
    }

    /// With top-p (nucleus) truncation.
    pub fn with_top_p(self, top_p: f32) -> Self {
        Sampler { top_p, ..self }
    }

    /// `Ok` when the parameters are usable; otherwise an error naming the parameter and `row`
    /// (the row the sampler is for, in the message).
    pub fn check(&self, row: usize) -> Result<()> {
        if !self.temperature.is_finite() {
            return Err(Error::Input(format!("row {row}: temperature {} is not finite", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!("row {row}: top_p {} must be in (0, 1]", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::Input(format!("row {row}: min_p {} must be in [0, 1]", self.min_p)));
        }
        if self.top_logprobs > TOP_LOGPROBS_MAX {
            return Err(Error::Input(format!(
                "row {row}: top_logprobs {} is more than the {TOP_LOGPROBS_MAX} supported",
                self.top_logprobs
            )));
        }
        Ok(())
    }

    /// Whether top-k truncates a vocabulary of `vocab` (`sample.wgsl`'s `has_top_k`).
    pub(crate) fn has_top_k(&self, vocab: usize) -> bool {
        self.temperature > 0.0 && self.top_k > 0 && (self.top_k as usize) < vocab
    }

    /// Whether top-p truncates (`has_top_p`).
    pub(crate) fn has_top_p(&self) -> bool {
        self.temperature > 0.0 && self.top_p < 1.0
    }

    /// Whether anything truncates: top-k, top-p or min-p (`truncates`).
    pub(crate) fn truncates(&self, vocab: usize) -> bool {
        self.has_top_k(vocab) || self.has_top_p() || (self.temperature > 0.0 && self.min_p > 0.0)
    }

    /// Passes over a vocabulary of `vocab` and workgroup reductions `sample.wgsl`'s `main` runs
    /// for a row with this sampler, following its stages (the occupancy table's sampler row). A
    /// radix pass is a pass and a choice of digit (a scan, counted as a reduction). A pass of
    /// the top-N search `k` counts `1 + k`: each entry is checked against the `k` found.
    pub(crate) fn vocabulary_passes(&self, vocab: usize) -> (usize, usize) {
        const DIGITS: usize = 4;
        let drawn = self.temperature > 0.0;
        // max and min (two argmax reductions), the normalizer; then the kept count
        let (mut passes, mut reductions) = (3, 4);
        if self.has_top_k(vocab) {
            passes += DIGITS;
            reductions += DIGITS;
        }
        if self.has_top_p() {
            passes += DIGITS;
            reductions += DIGITS;
        }
        if drawn {
            // the Gumbel-max draw, and the normalizer of the logprob mode
            passes += 1;
            reductions += 1;
            match self.logprobs {
                LogprobMode::Processed => reductions += 1,
                LogprobMode::Raw => {
                    passes += 2;
                    reductions += 2;
                }
                LogprobMode::Scaled => {}
            }
        }
        let n = self.top_logprobs.min(TOP_LOGPROBS_MAX) as usize;
        (passes + n * (n + 1) / 2, reductions + n)
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
    masked: u32,
    top_n: u32,
    min_p: f32,
    mode: u32,
    _pad: [u32; 2],
}

impl SamplerGpu {
    pub(crate) fn new(s: &Sampler, counter: u32, masked: bool) -> Self {
        SamplerGpu {
            temperature: s.temperature,
            seed: s.seed,
            counter,
            top_k: s.top_k,
            top_p: s.top_p.min(1.0),
            masked: masked as u32,
            top_n: s.top_logprobs.min(TOP_LOGPROBS_MAX),
            min_p: s.min_p,
            mode: match s.logprobs {
                LogprobMode::Scaled => 0,
                LogprobMode::Raw => 1,
                LogprobMode::Processed => 2,
            },
            _pad: [0; 2],
        }
    }
}

/// Per cache row, what shapes sampling beyond the [`Sampler`]: a sparse logit bias (OpenAI's
/// `logit_bias`; presence and frequency penalties as the tokens come) and a token mask
/// (constrained decoding). GPU buffers with a CPU mirror; `logit_bias.wgsl` adds the bias to the
/// logits of sampling steps only (the logits `append` returns are the model's), `sample.wgsl`
/// reads the mask.
pub(crate) struct RowSampling {
    /// `[rows, slots]` (token id, bias bits).
    pub(crate) bias: wgpu::Buffer,
    /// `[rows]` entries in use.
    pub(crate) bias_n: wgpu::Buffer,
    /// `[rows, words]` allowed-token bits.
    pub(crate) mask: wgpu::Buffer,
    /// `[rows, TOP_LOGPROBS_MAX, 2]` the last step's top tokens (id, logprob bits).
    pub(crate) top: wgpu::Buffer,
    pub(crate) top_read: wgpu::Buffer,
    pub(crate) slots: usize,
    pub(crate) words: usize,
    vocab: usize,
    entries: Vec<Vec<(u32, f32)>>,
    pub(crate) masked: Vec<bool>,
}

impl RowSampling {
    pub(crate) fn new(gpu: &crate::gpu::device::Gpu, rows: usize, vocab: usize, slots: usize) -> Result<Self> {
        let words = vocab.div_ceil(32);
        // as many slots as asked, or as one binding holds for every row
        let slots = slots.min((gpu.max_binding() / (rows as u64 * 8)) as usize);
        let top_bytes = (rows * TOP_LOGPROBS_MAX as usize * 8) as u64;
        Ok(RowSampling {
            bias: gpu.storage("logit bias", (rows * slots.max(1) * 8) as u64)?,
            bias_n: gpu.storage("logit bias counts", (rows * 4) as u64)?,
            mask: gpu.storage("token masks", (rows * words * 4) as u64)?,
            top: gpu.storage("top logprobs", top_bytes)?,
            top_read: gpu.buffer(
                "top logprobs readback",
                top_bytes,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?,
            slots,
            words,
            vocab,
            entries: vec![Vec::new(); rows],
            masked: vec![false; rows],
        })
    }

    /// Whether any of `rows` has a bias (the bias dispatch is recorded only then).
    pub(crate) fn any_bias(&self, rows: &[usize]) -> bool {
        rows.iter().any(|&r| !self.entries[r].is_empty())
    }

    pub(crate) fn bias(&self, row: usize) -> &[(u32, f32)] {
        &self.entries[row]
    }

    fn upload(&self, gpu: &crate::gpu::device::Gpu, row: usize) {
        let e = &self.entries[row];
        let words: Vec<u32> = e.iter().flat_map(|&(t, b)| [t, b.to_bits()]).collect();
        if !words.is_empty() {
            gpu.queue.write_buffer(&self.bias, (row * self.slots * 8) as u64, bytemuck::cast_slice(&words));
        }
        gpu.queue.write_buffer(&self.bias_n, (row * 4) as u64, &(e.len() as u32).to_le_bytes());
    }

    fn check_entry(&self, row: usize, t: u32, b: f32) -> Result<()> {
        if t as usize >= self.vocab {
            return Err(Error::Input(format!(
                "row {row}: logit bias for token {t}, outside the vocabulary ({})",
                self.vocab
            )));
        }
        if !b.is_finite() {
            return Err(Error::Input(format!("row {row}: logit bias {b} for token {t} is not finite")));
        }
        Ok(())
    }

    /// Replace `row`'s bias (entries for the same token are summed).
    pub(crate) fn set_bias(&mut self, gpu: &crate::gpu::device::Gpu, row: usize, bias: &[(u32, f32)]) -> Result<()> {
        let mut merged: Vec<(u32, f32)> = Vec::new();
        for &(t, b) in bias {
            self.check_entry(row, t, b)?;
            match merged.iter_mut().find(|e| e.0 == t) {
                Some(e) => e.1 += b,
                None => merged.push((t, b)),
            }
        }
        if merged.len() > self.slots {
            return Err(Error::Limit(format!(
                "row {row}: {} logit bias entries, more than the {} slots (EngineOptions::logit_bias_slots)",
                merged.len(),
                self.slots
            )));
        }
        self.entries[row] = merged;
        self.upload(gpu, row);
        Ok(())
    }

    /// Add `delta` to `row`'s bias of `token` (a new entry if it has none).
    pub(crate) fn add_bias(&mut self, gpu: &crate::gpu::device::Gpu, row: usize, token: u32, delta: f32) -> Result<()> {
        self.check_entry(row, token, delta)?;
        let e = &mut self.entries[row];
        let k = match e.iter().position(|x| x.0 == token) {
            Some(k) => {
                e[k].1 += delta;
                k
            }
            None if e.len() < self.slots => {
                e.push((token, delta));
                e.len() - 1
            }
            None => {
                return Err(Error::Limit(format!(
                    "row {row}: no logit bias slot left for token {token} ({} in use, EngineOptions::logit_bias_slots)",
                    self.slots
                )))
            }
        };
        let (t, b) = e[k];
        gpu.queue.write_buffer(
            &self.bias,
            ((row * self.slots + k) * 8) as u64,
            bytemuck::cast_slice(&[t, b.to_bits()]),
        );
        gpu.queue.write_buffer(&self.bias_n, (row * 4) as u64, &(e.len() as u32).to_le_bytes());
        Ok(())
    }

    /// Allow only the tokens whose bit is set in `allowed` (`ceil(vocab / 32)` words), or all.
    pub(crate) fn set_mask(
        &mut self,
        gpu: &crate::gpu::device::Gpu,
        row: usize,
        allowed: Option<&[u32]>,
    ) -> Result<()> {
        match allowed {
            None => self.masked[row] = false,
            Some(words) => {
                if words.len() != self.words {
                    return Err(Error::Input(format!(
                        "row {row}: token mask has {} words, expected {} (vocabulary {})",
                        words.len(),
                        self.words,
                        self.vocab
                    )));
                }
                let allows_one = (0..self.vocab).any(|i| words[i / 32] >> (i % 32) & 1 == 1);
                if !allows_one {
                    return Err(Error::Input(format!("row {row}: token mask allows no token")));
                }
                gpu.queue.write_buffer(&self.mask, (row * self.words * 4) as u64, bytemuck::cast_slice(words));
                self.masked[row] = true;
            }
        }
        Ok(())
    }

    /// No bias and no mask on `rows` (a reset).
    pub(crate) fn clear(&mut self, gpu: &crate::gpu::device::Gpu, rows: &[usize]) {
        for &r in rows {
            if !self.entries[r].is_empty() {
                self.entries[r].clear();
                self.upload(gpu, r);
            }
            self.masked[r] = false;
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
/// log-probability: `counter` is the position the sampled token will take. The GPU's `exp` may
/// differ from the CPU's in its last bits, so a top-p boundary that is a near tie can fall
/// differently.
pub fn sample_cpu(logits: &[f32], s: Sampler, counter: u32) -> (u32, f32) {
    let got = sample_cpu_full(logits, s, counter, &[], None);
    (got.token, got.logprob)
}

/// [`sample_cpu`] with a row's logit bias and token mask (`ceil(vocab / 32)` words of allowed
/// bits), reporting `s.top_logprobs` alternatives: the twin of a GPU sampling step.
pub fn sample_cpu_full(logits: &[f32], s: Sampler, counter: u32, bias: &[(u32, f32)], mask: Option<&[u32]>) -> Sampled {
    let mut adjusted = logits.to_vec();
    for &(tok, b) in bias {
        adjusted[tok as usize] += b;
    }
    let logits = &adjusted[..];
    let t = s.temperature;
    const MASKED: f32 = -3.0e38;
    let allowed = |i: usize| mask.is_none_or(|m| m[i / 32] >> (i % 32) & 1 == 1);
    let scores: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            if !allowed(i) {
                MASKED
            } else if t > 0.0 {
                l / t
            } else {
                l
            }
        })
        .collect();
    let v = scores.len();
    let (mut m, mut greedy) = (f32::NEG_INFINITY, 0usize);
    let mut mn = f32::INFINITY;
    for (i, &x) in scores.iter().enumerate() {
        if x > m {
            m = x;
            greedy = i;
        }
        mn = mn.min(x);
    }
    let z: f32 = scores.iter().map(|&x| (x - m).exp()).sum();
    let mut thr = mn;
    // top-k: the top_k-th largest score; top-p: the largest score whose tokens at or above it (of
    // those top-k keeps) hold top_p of their fixed-point mass (`sample.wgsl`'s radix select)
    let mut desc: Vec<f32> = scores.clone();
    desc.sort_by(|a, b| b.total_cmp(a));
    if s.has_top_k(v) {
        thr = desc[s.top_k as usize - 1];
    }
    if s.has_top_p() {
        let mass = |x: f32| ((x - m).exp() * 2_147_483_648.0).round_ties_even() as u64;
        let wide =
            |q: u64| (q >> 32) as f32 * 4_294_967_296.0 + (((q >> 16) & 0xffff) as f32 * 65536.0 + (q & 0xffff) as f32);
        let kept = &desc[..desc.iter().take_while(|&&x| x >= thr).count()];
        let target = s.top_p * wide(kept.iter().map(|&x| mass(x)).sum());
        let mut cum = 0u64;
        for (i, &x) in kept.iter().enumerate() {
            cum += mass(x);
            if kept.get(i + 1) != Some(&x) && wide(cum) >= target {
                thr = x;
                break;
            }
        }
    }
    if t > 0.0 && s.min_p > 0.0 {
        thr = thr.max(m + s.min_p.ln());
    }
    let mut chosen = greedy;
    if t > 0.0 {
        let mut best = f32::NEG_INFINITY;
        for (i, &x) in scores.iter().enumerate() {
            if x >= thr {
                let g = x - (-(uniform01(s.seed, counter, i as u32)).ln()).ln();
                if g > best {
                    best = g;
                    chosen = i;
                }
            }
        }
    }
    let kept_scores = || scores.iter().filter(|&&x| x >= thr && x > MASKED);
    let kept = kept_scores().count() as u32;
    // the reported distribution: its scores (`of`), log-normalizer and which tokens it has
    let raw = |i: usize| if allowed(i) { logits[i] } else { MASKED };
    let scaled = |i: usize| scores[i];
    let (of, lz, cut): (&dyn Fn(usize) -> f32, f32, f32) = match s.logprobs {
        LogprobMode::Processed if t > 0.0 => {
            (&scaled, m + kept_scores().map(|&x| (x - m).exp()).sum::<f32>().ln(), thr)
        }
        LogprobMode::Raw if t > 0.0 => {
            let mr = (0..v).map(raw).fold(f32::NEG_INFINITY, f32::max);
            (&raw, mr + (0..v).map(|i| (raw(i) - mr).exp()).sum::<f32>().ln(), mn)
        }
        _ => (&scaled, m + z.ln(), mn),
    };
    // the most likely tokens, ties to the lowest id (the GPU's rounds of argmax)
    let n = (s.top_logprobs.min(TOP_LOGPROBS_MAX) as usize).min(v);
    let mut top = Vec::with_capacity(n);
    if n > 0 {
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        top.extend(
            order[..n].iter().map(|&i| (i as u32, if scores[i] >= cut { of(i) - lz } else { f32::NEG_INFINITY })),
        );
    }
    Sampled { token: chosen as u32, logprob: of(chosen) - lz, top, kept }
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
