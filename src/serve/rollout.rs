//! Episodes for multi-turn RL rollouts, one per cache row: a prompt, then turns the model decodes
//! (each with its own stop condition), tool results appended mid-episode, per-turn tokens and
//! logprobs. `fork` lets k rows continue from one prompt without recomputing it.
//!
//! Each row keeps its last token un-appended ("the feed"): the next turn's first decode step
//! appends it and samples with that row's own sampler, so forked rows draw different answers from
//! the same prompt, and a turn's final token (its stop token) lands in the cache right before the
//! tool result that follows it.

use crate::cache::RowOwner;
use crate::engine::sampling::Sampler;
use crate::engine::{Engine, Turn, TurnLimit};
use crate::error::{Error, Result};

/// One row's episode.
#[derive(Clone, Debug, Default)]
pub struct Episode {
    /// Decoded turns so far.
    pub turns: Vec<Turn>,
    /// The row's sampler.
    pub sampler: Option<Sampler>,
    feed: Option<u32>,
}

/// Episodes over an engine's rows. Rows with episodes are claimed from the engine (so a
/// scheduler sharing it leaves them alone) and given back when their episode finishes.
pub struct Rollouts {
    rows: Vec<Option<Episode>>,
    owner: RowOwner,
}

impl Rollouts {
    /// No episodes yet.
    pub fn new(engine: &Engine) -> Self {
        Rollouts { rows: vec![None; engine.cache().rows()], owner: RowOwner::new() }
    }

    /// The episode in `row`, if any.
    pub fn episode(&self, row: usize) -> Option<&Episode> {
        self.rows.get(row).and_then(Option::as_ref)
    }

    /// Start episodes: reset `rows`, put them on LoRA adapter `adapter` (`None`: the base model)
    /// and prefill their prompts in one batched append.
    pub fn start(
        &mut self,
        engine: &mut Engine,
        rows: &[usize],
        prompts: &[Vec<u32>],
        samplers: &[Sampler],
        adapter: Option<&str>,
    ) -> Result<()> {
        if prompts.len() != rows.len() || samplers.len() != rows.len() {
            return Err(Error::Input("start: rows, prompts and samplers differ in length".into()));
        }
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(Error::Input(format!("start: prompt {i} (row {}) is empty", rows[i])));
        }
        engine.cache().check_rows(rows)?;
        // everything the prefill could refuse is checked before the rows are reset
        let (vocab, max_len) = (engine.config().vocab, engine.cache().max_len());
        for (i, (p, s)) in prompts.iter().zip(samplers).enumerate() {
            if let Some(t) = p.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::Input(format!(
                    "start: prompt {i} (row {}): id {t} is outside the vocabulary ({vocab})",
                    rows[i]
                )));
            }
            if p.len() > max_len {
                return Err(Error::Input(format!(
                    "start: prompt {i} (row {}) has {} tokens, more than max_len {max_len}",
                    rows[i],
                    p.len()
                )));
            }
            s.check(i)?;
        }
        if let Some(name) = adapter.filter(|n| engine.lora_version(n).is_none()) {
            return Err(Error::Input(format!("start: no LoRA adapter named {name:?} is loaded")));
        }
        engine.claim_rows(self.owner, rows)?;
        engine.reset(rows)?;
        for &r in rows {
            engine.set_adapter(r, adapter)?;
        }
        // each row starts on what the prompt cache holds of its prompt, then prefills the rest
        // but the last token (the feed)
        let mut heads = Vec::with_capacity(rows.len());
        for (&r, p) in rows.iter().zip(prompts) {
            let n = engine.reuse_prefix(r, p)?;
            heads.push(p[n..p.len() - 1].to_vec());
        }
        append_batch(engine, rows, &heads)?;
        for ((&r, p), s) in rows.iter().zip(prompts).zip(samplers) {
            self.rows[r] = Some(Episode { turns: Vec::new(), sampler: Some(*s), feed: p.last().copied() });
        }
        Ok(())
    }

    /// Copy `src`'s episode (cache and state) into each row of `dst` with its own sampler.
    pub fn fork(&mut self, engine: &mut Engine, src: usize, dst: &[usize], samplers: &[Sampler]) -> Result<()> {
        if samplers.len() != dst.len() {
            return Err(Error::Input("fork: one sampler per destination row".into()));
        }
        let ep = self.episode(src).cloned().ok_or_else(|| Error::Input(format!("fork: row {src} has no episode")))?;
        engine.claim_rows(self.owner, dst)?;
        engine.fork(src, dst)?;
        for (&d, s) in dst.iter().zip(samplers) {
            self.rows[d] = Some(Episode { sampler: Some(*s), ..ep.clone() });
        }
        Ok(())
    }

    /// Append tool results (one chunk per row, batched) after each row's last turn.
    pub fn tool_result(&mut self, engine: &mut Engine, rows: &[usize], chunks: &[Vec<u32>]) -> Result<()> {
        if chunks.len() != rows.len() {
            return Err(Error::Input("tool_result: one chunk per row".into()));
        }
        let mut seqs = Vec::new();
        for (&r, c) in rows.iter().zip(chunks) {
            let ep = self.episode(r).ok_or_else(|| Error::Input(format!("tool_result: row {r} has no episode")))?;
            if c.is_empty() {
                return Err(Error::Input(format!("tool_result: empty chunk for row {r}")));
            }
            // the feed (last turn's final token) goes in first; the chunk's last token becomes the feed
            let mut s: Vec<u32> = ep.feed.into_iter().collect();
            s.extend_from_slice(&c[..c.len() - 1]);
            seqs.push(s);
        }
        append_batch(engine, rows, &seqs)?;
        for (&r, c) in rows.iter().zip(chunks) {
            if let Some(ep) = self.rows[r].as_mut() {
                ep.feed = c.last().copied();
            }
        }
        Ok(())
    }

    /// Decode the next turn on each row (batched, `window` steps per readback), each with its own
    /// limit. Returns the turns and records them in the episodes.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_turn(
        &mut self,
        engine: &mut Engine,
        rows: &[usize],
        limits: &[TurnLimit],
        window: usize,
    ) -> Result<Vec<Turn>> {
        crate::gpu::pending::block_on(self.decode_turn_async(engine, rows, limits, window))
    }

    /// [`Rollouts::decode_turn`] that awaits the readbacks instead of blocking.
    pub async fn decode_turn_async(
        &mut self,
        engine: &mut Engine,
        rows: &[usize],
        limits: &[TurnLimit],
        window: usize,
    ) -> Result<Vec<Turn>> {
        let mut first = Vec::new();
        let mut samplers = Vec::new();
        for &r in rows {
            let ep = self.episode(r).ok_or_else(|| Error::Input(format!("decode_turn: row {r} has no episode")))?;
            first.push(ep.feed.ok_or_else(|| Error::Input(format!("decode_turn: row {r} has nothing to feed")))?);
            samplers.push(ep.sampler.unwrap_or(Sampler::GREEDY));
        }
        let turns = engine.decode_turns_async(rows, &first, &samplers, limits, window, &|_, _| false).await?;
        for (&r, t) in rows.iter().zip(&turns) {
            if let Some(ep) = self.rows[r].as_mut() {
                if let Some(&last) = t.tokens.last() {
                    ep.feed = Some(last);
                }
                ep.turns.push(t.clone());
            }
        }
        Ok(turns)
    }

    /// End the episode in `row` and return it (`None` when the row had none); the row is reset,
    /// so its K/V blocks go back to the pool (a fork's shared prefix stays while other rows hold
    /// it) and the row is free for a new episode.
    pub fn finish(&mut self, engine: &mut Engine, row: usize) -> Result<Option<Episode>> {
        let Some(ep) = self.rows.get_mut(row).and_then(Option::take) else {
            return Ok(None);
        };
        engine.reset(&[row])?;
        engine.release_rows(self.owner, &[row]);
        Ok(Some(ep))
    }
}

/// Append right-padded sequences to `rows` in one call (rows with empty sequences untouched).
fn append_batch(engine: &mut Engine, rows: &[usize], seqs: &[Vec<u32>]) -> Result<()> {
    let width = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if width == 0 {
        return Ok(());
    }
    let mut ids = vec![0u32; rows.len() * width];
    for (i, s) in seqs.iter().enumerate() {
        ids[i * width..i * width + s.len()].copy_from_slice(s);
    }
    let n_new: Vec<usize> = seqs.iter().map(Vec::len).collect();
    engine.feed(&ids, width, &n_new, Some(rows))
}
