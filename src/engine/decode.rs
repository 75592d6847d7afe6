//! Decoding beyond one append: multi-step windows whose ids stay on the GPU, turns that stop on
//! their own conditions with exact rollback of what a window decoded past the stop.

use crate::engine::sampling::Sampler;
use crate::engine::{Engine, Output};
use crate::error::{Error, Result};

/// When a decoded turn ends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TurnLimit {
    /// Most tokens in the turn.
    pub max_new: usize,
    /// Token ids that end the turn (returned, not appended).
    pub stop: Vec<u32>,
}

/// One decoded turn of a row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Turn {
    /// Sampled tokens, the stop token included when the turn stopped on one.
    pub tokens: Vec<u32>,
    /// Log-probability of each token (see [`Sampler`]).
    pub logprobs: Vec<f32>,
    /// Whether the turn ended on a stop token (else on `max_new`).
    pub stopped: bool,
    /// The weights version every token was sampled under ([`Engine::weights_version`]: a turn
    /// is decoded in calls that hold the engine, so no update lands inside one).
    pub weights_version: u64,
    /// The version of the LoRA adapter the row decoded with ([`Engine::adapter`]), or `None` on
    /// the base model.
    pub adapter_version: Option<u64>,
}

impl Engine {
    /// Multi-step decode: enqueue `steps` single-token steps on `rows` before reading anything
    /// back. Step 0 feeds `first[r]`; every later step feeds the id sampled by the step before,
    /// straight from GPU memory. Returns the `steps` sampled ids of each row (the last one is not
    /// yet appended: feed it next). One readback for the whole window; `steps` is at most
    /// `rollback + 1`, so a row that should have stopped early can be rolled back exactly
    /// (see [`Engine::decode_until`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_steps(
        &mut self,
        rows: &[usize],
        first: &[u32],
        samplers: &[Sampler],
        steps: usize,
    ) -> Result<Vec<Vec<u32>>> {
        Ok(self.decode_steps_logprobs(rows, first, samplers, steps)?.into_iter().map(|r| r.0).collect())
    }

    /// [`Engine::decode_steps`] that also returns each sampled token's log-probability under the
    /// distribution it was drawn from (see [`Sampler`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_steps_logprobs(
        &mut self,
        rows: &[usize],
        first: &[u32],
        samplers: &[Sampler],
        steps: usize,
    ) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        crate::gpu::pending::block_on(self.decode_steps_async(rows, first, samplers, steps))
    }

    /// [`Engine::decode_steps_logprobs`] that awaits the readback instead of blocking.
    pub async fn decode_steps_async(
        &mut self,
        rows: &[usize],
        first: &[u32],
        samplers: &[Sampler],
        steps: usize,
    ) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let r_n = rows.len();
        if first.len() != r_n || samplers.len() != r_n {
            return Err(Error::Input(format!(
                "decode_steps: {r_n} rows, {} first ids, {} samplers",
                first.len(),
                samplers.len()
            )));
        }
        if steps == 0 || steps > self.max_window {
            return Err(Error::Input(format!("decode_steps: steps {steps} must be in 1..={}", self.max_window)));
        }
        for (r, s) in samplers.iter().enumerate() {
            s.check(r)?;
            if s.top_logprobs > 0 {
                return Err(Error::Input(format!(
                    "decode_steps: row {r} asks for top_logprobs, which single-step sampling \
                     (Engine::step with Want::Sampled) reports"
                )));
            }
        }
        // the window's capacity is checked up front: every row must have room for all its steps
        let n_new = vec![steps; r_n];
        let pad: Vec<u32> = (0..r_n * steps).map(|i| if i % steps == 0 { first[i / steps] } else { 0 }).collect();
        let cache_rows = self.check(&pad, steps, &n_new, Some(rows))?;
        self.reserve_blocks(&cache_rows, &n_new)?;
        let ones = vec![1usize; r_n];
        let mark = self.cache.mark();
        for step in 0..steps {
            let from_gpu = step > 0;
            self.submit_chunk(
                &cache_rows,
                &ones,
                first,
                1,
                0,
                Some(samplers),
                from_gpu,
                Output::Sampled { slot: step, top: false },
            )
            .await;
        }
        let mut raw = vec![0u32; steps * r_n * 3];
        let read = self.read_async(&self.s.sampled_read, bytemuck::cast_slice_mut(&mut raw)).await;
        self.undo_if_lost(read, &mark)?;
        let mut out = vec![(Vec::with_capacity(steps), Vec::with_capacity(steps)); r_n];
        for step in 0..steps {
            for (r, o) in out.iter_mut().enumerate() {
                o.0.push(raw[step * r_n * 3 + r]);
                o.1.push(f32::from_bits(raw[step * r_n * 3 + r_n + r]));
            }
        }
        // step 0 recorded `first`; the ids fed from the GPU are known now: all sampled but the last
        for (r, &row) in cache_rows.iter().enumerate() {
            self.cache.record_sampled(row, &out[r].0[..steps - 1]);
        }
        Ok(out)
    }

    /// Decode until each row samples a stop token (`is_stop`) or `max_new` tokens, enqueueing
    /// `window` steps per readback. A row that stops inside a window is rolled back, so it ends
    /// exactly as if it had stopped on time: its stop token is returned but not appended.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_until(
        &mut self,
        rows: &[usize],
        first: &[u32],
        samplers: &[Sampler],
        max_new: usize,
        window: usize,
        is_stop: impl Fn(u32) -> bool,
    ) -> Result<Vec<Vec<u32>>> {
        let limits = vec![TurnLimit { max_new, stop: Vec::new() }; rows.len()];
        let turns = self.decode_turns(rows, first, samplers, &limits, window, &|_, t| is_stop(t))?;
        Ok(turns.into_iter().map(|t| t.tokens).collect())
    }

    /// Decode one turn on each row: feed `first[i]`, then sampled tokens, until row `i` samples
    /// one of `limits[i].stop` (or `extra_stop(i, token)` says so) or has `limits[i].max_new`
    /// tokens. `window` steps are enqueued per readback (at most `rollback + 1`); rows that
    /// stopped inside a window are rolled back exactly. The stop token is returned (with its
    /// logprob) but not appended, so the next append continues right after the turn.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_turns(
        &mut self,
        rows: &[usize],
        first: &[u32],
        samplers: &[Sampler],
        limits: &[TurnLimit],
        window: usize,
        extra_stop: &dyn Fn(usize, u32) -> bool,
    ) -> Result<Vec<Turn>> {
        crate::gpu::pending::block_on(self.decode_turns_async(rows, first, samplers, limits, window, extra_stop))
    }

    /// [`Engine::decode_turns`] that awaits each window's readback instead of blocking.
    pub async fn decode_turns_async(
        &mut self,
        rows: &[usize],
        first: &[u32],
        samplers: &[Sampler],
        limits: &[TurnLimit],
        window: usize,
        extra_stop: &dyn Fn(usize, u32) -> bool,
    ) -> Result<Vec<Turn>> {
        if limits.len() != rows.len() {
            return Err(Error::Input(format!("decode_turns: {} rows, {} limits", rows.len(), limits.len())));
        }
        let window = window.clamp(1, self.max_window);
        let mut out: Vec<Turn> = rows
            .iter()
            .map(|&r| Turn {
                weights_version: self.weights_version(),
                adapter_version: self.adapter(r).map(|(_, v)| v),
                ..Turn::default()
            })
            .collect();
        let mut live: Vec<usize> = (0..rows.len()).filter(|&i| limits[i].max_new > 0).collect();
        let mut feed: Vec<u32> = first.to_vec();
        while !live.is_empty() {
            let room = live.iter().map(|&i| limits[i].max_new - out[i].tokens.len()).min().unwrap_or(1);
            let steps = window.min(room).max(1);
            let live_rows: Vec<usize> = live.iter().map(|&i| rows[i]).collect();
            let live_feed: Vec<u32> = live.iter().map(|&i| feed[i]).collect();
            let live_samplers: Vec<Sampler> = live.iter().map(|&i| samplers[i]).collect();
            let got = self.decode_steps_async(&live_rows, &live_feed, &live_samplers, steps).await?;
            let mut still = Vec::new();
            let (mut back_rows, mut back_n) = (Vec::new(), Vec::new());
            for (k, &i) in live.iter().enumerate() {
                let (toks, lps) = &got[k];
                let is_stop = |t: u32| limits[i].stop.contains(&t) || extra_stop(i, t);
                // tokens kept: up to and including the first stop, and at most max_new in all
                let mut keep = toks.len().min(limits[i].max_new - out[i].tokens.len());
                if let Some(p) = toks[..keep].iter().position(|&t| is_stop(t)) {
                    keep = p + 1;
                    out[i].stopped = true;
                }
                out[i].tokens.extend_from_slice(&toks[..keep]);
                out[i].logprobs.extend_from_slice(&lps[..keep]);
                // this window appended feed + toks[..steps - 1]; a finished row keeps
                // feed + toks[..keep - 1]: its last sampled token is returned, not appended
                if out[i].stopped || out[i].tokens.len() >= limits[i].max_new {
                    if steps > keep {
                        back_rows.push(rows[i]);
                        back_n.push(steps - keep);
                    }
                } else {
                    feed[i] = toks[keep - 1];
                    still.push(i);
                }
            }
            self.rollback(&back_rows, &back_n)?;
            live = still;
        }
        Ok(out)
    }
}
