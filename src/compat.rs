//! The seeds' other cache modes as thin layers over the per-row engine (not second engines):
//!
//! - [`PaddedBatch`] (`tiny_llm_kv_cache.py`'s `KVCache` with `pad_lens`): rows share one position
//!   counter and prompts are left-padded to a common length. Keys before a row's first real token
//!   are never stored, so they can never be attended; each real token sits at position
//!   `index - pad_len` (Hugging Face's `cumsum(mask) - 1`). Pad queries attend to nothing and
//!   produce zero logits: finite, never NaN, and meaningless as in the seed.
//! - [`SequenceCache`] (`pycraft_kv_cache.py`): a batch of sequences sharing one length, with the
//!   seed's guards as clear errors: overflow, batch mismatch, dtype mismatch.

use crate::cache::KvDtype;
use crate::engine::{Engine, Logits};
use crate::error::{Error, Result};
use crate::sampling::argmax;

/// A left-padded, shared-position batch over cache rows.
pub struct PaddedBatch {
    rows: Vec<usize>,
    pad_lens: Vec<usize>,
    pos: usize,
}

impl PaddedBatch {
    /// Reset `rows` for a batch whose row `b` starts with `pad_lens[b]` pad tokens.
    pub fn new(engine: &mut Engine, rows: &[usize], pad_lens: &[usize]) -> Result<Self> {
        if rows.len() != pad_lens.len() {
            return Err(Error::Input(format!("{} rows but {} pad lengths", rows.len(), pad_lens.len())));
        }
        engine.reset(rows)?;
        Ok(PaddedBatch { rows: rows.to_vec(), pad_lens: pad_lens.to_vec(), pos: 0 })
    }

    /// The shared position (pads included) of the next token.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Append `t` tokens per row (`ids` is `[B, t]`, positions `pos..pos + t`, pads included);
    /// returns logits `[B, t, vocab]`, zeros at pad positions. Split into passes that fit the
    /// engine's all-position logits buffer.
    pub fn forward(&mut self, engine: &mut Engine, ids: &[u32], t: usize) -> Result<Vec<f32>> {
        let b_n = self.rows.len();
        if ids.len() != b_n * t {
            return Err(Error::Input(format!("ids has {} entries, expected batch {b_n} x {t}", ids.len())));
        }
        let v = engine.config().vocab;
        let mut out = vec![0f32; b_n * t * v];
        let per_pass = (engine.all_logits_tokens() / b_n.max(1)).min(engine.chunk_width()).max(1);
        let mut p0 = 0;
        while p0 < t {
            let p1 = (p0 + per_pass).min(t);
            // row b's real tokens in [p0, p1): absolute index >= pad_len
            let firsts: Vec<usize> =
                self.pad_lens.iter().map(|&pad| pad.saturating_sub(self.pos).clamp(p0, p1)).collect();
            let n_new: Vec<usize> = firsts.iter().map(|&f| p1 - f).collect();
            let width = p1 - p0;
            let mut chunk = vec![0u32; b_n * width];
            for b in 0..b_n {
                chunk[b * width..b * width + n_new[b]].copy_from_slice(&ids[b * t + firsts[b]..b * t + p1]);
            }
            let logits = engine.append_all_logits(&chunk, width, &n_new, Some(&self.rows))?;
            for b in 0..b_n {
                for (j, l) in logits[b].iter().enumerate() {
                    let at = (b * t + firsts[b] + j) * v;
                    out[at..at + v].copy_from_slice(l);
                }
            }
            p0 = p1;
        }
        self.pos += t;
        Ok(out)
    }

    /// Greedy generation as Hugging Face's `generate` does on a left-padded batch: feed the
    /// prompts `[B, t]`, then `steps` argmax tokens per row. Returns `[B, t + steps]`.
    pub fn generate_greedy(
        &mut self,
        engine: &mut Engine,
        ids: &[u32],
        t: usize,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let v = engine.config().vocab;
        let logits = self.forward(engine, ids, t)?;
        let b_n = self.rows.len();
        let mut seqs: Vec<Vec<u32>> = (0..b_n).map(|b| ids[b * t..(b + 1) * t].to_vec()).collect();
        let mut next: Vec<u32> =
            (0..b_n).map(|b| argmax(&logits[(b * t + t - 1) * v..(b * t + t) * v]) as u32).collect();
        for step in 0..steps {
            for b in 0..b_n {
                seqs[b].push(next[b]);
            }
            if step + 1 == steps {
                break;
            }
            let out = engine.append(&next, 1, &vec![1; b_n], Some(&self.rows))?;
            self.pos += 1;
            next = (0..b_n).map(|b| argmax(out.row(b).expect("every row got a token")) as u32).collect();
        }
        Ok(seqs)
    }
}

/// A batch of sequences that share one length, with the per-sequence cache's guards.
pub struct SequenceCache {
    rows: Vec<usize>,
    dtype: KvDtype,
    seq_len: usize,
}

impl SequenceCache {
    /// Use `rows` of `engine` as one batch; `dtype` must be the engine's K/V dtype (the seed
    /// refuses silent casts that would degrade precision every step).
    pub fn new(engine: &mut Engine, rows: &[usize], dtype: KvDtype) -> Result<Self> {
        if dtype != engine.cache().dtype() {
            return Err(Error::Input(format!("cache dtype {:?} != requested dtype {dtype:?}", engine.cache().dtype())));
        }
        engine.reset(rows)?;
        Ok(SequenceCache { rows: rows.to_vec(), dtype, seq_len: 0 })
    }

    /// Tokens stored per sequence.
    pub fn len(&self) -> usize {
        self.seq_len
    }

    /// Whether nothing is stored yet.
    pub fn is_empty(&self) -> bool {
        self.seq_len == 0
    }

    /// The K/V dtype.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Append `t` tokens to every sequence (`ids` is `[batch, t]`) and return the logits at the
    /// last one. Errors, changing nothing, on a batch mismatch or an overflow.
    pub fn forward(&mut self, engine: &mut Engine, ids: &[u32], batch: usize, t: usize) -> Result<Logits> {
        if batch != self.rows.len() {
            return Err(Error::Input(format!("batch {batch} does not match cache batch {}", self.rows.len())));
        }
        if self.seq_len + t > engine.cache().max_len() {
            return Err(Error::Input(format!(
                "KV cache overflow: {} + {t} > max_len={}. Allocate a larger cache or stop generating.",
                self.seq_len,
                engine.cache().max_len()
            )));
        }
        let out = engine.append(ids, t, &vec![t; batch], Some(&self.rows))?;
        self.seq_len += t;
        Ok(out)
    }

    /// Start over (no zeroing needed: old entries are masked by length).
    pub fn reset(&mut self, engine: &mut Engine) -> Result<()> {
        engine.reset(&self.rows)?;
        self.seq_len = 0;
        Ok(())
    }
}
