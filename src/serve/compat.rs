//! The seeds' other cache modes as thin layers over the per-row engine (not second engines):
//!
//! - [`PaddedBatch`] (`tiny_llm_kv_cache.py`'s `KVCache` with `pad_lens`): rows share one position
//!   counter and prompts are left-padded to a common length. Keys before a row's first real token
//!   are never stored, so they can never be attended; each real token sits at position
//!   `index - pad_len` (Hugging Face's `cumsum(mask) - 1`). Pad queries attend to nothing and
//!   produce zero logits: finite, never NaN, and meaningless as in the seed.
//! - [`SequenceCache`] (`pycraft_kv_cache.py`): a batch of sequences sharing one length, with the
//!   seed's guards as clear errors: overflow, batch mismatch, dtype mismatch; and any boolean
//!   key-padding mask ([`SequenceCache::forward_masked`], the seed's `build_attn_mask`): pad
//!   positions keep their place (later tokens' positions count them) but are never stored.

use crate::cache::KvDtype;
use crate::engine::sampling::argmax;
use crate::engine::{Engine, Logits};
use crate::error::{Error, Result};

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
    /// Per sequence, which positions so far hold real tokens (false: padding, never stored).
    real: Vec<Vec<bool>>,
}

impl SequenceCache {
    /// Use `rows` of `engine` as one batch; `dtype` must be the engine's K/V dtype (the seed
    /// refuses silent casts that would degrade precision every step).
    pub fn new(engine: &mut Engine, rows: &[usize], dtype: KvDtype) -> Result<Self> {
        if dtype != engine.cache().dtype() {
            return Err(Error::Input(format!("cache dtype {:?} != requested dtype {dtype:?}", engine.cache().dtype())));
        }
        engine.reset(rows)?;
        Ok(SequenceCache { rows: rows.to_vec(), dtype, seq_len: 0, real: vec![Vec::new(); rows.len()] })
    }

    /// Positions used per sequence (padding included).
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
        self.check_call(engine, batch, t)?;
        let out = engine.append(ids, t, &vec![t; batch], Some(&self.rows))?;
        self.seq_len += t;
        for r in &mut self.real {
            r.resize(self.seq_len, true);
        }
        Ok(out)
    }

    fn check_call(&self, engine: &Engine, batch: usize, t: usize) -> Result<()> {
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
        Ok(())
    }

    /// Append `t` tokens to every sequence (`ids` is `[batch, t]`) under a boolean key-padding
    /// mask, as the seed's `build_attn_mask(q_len, offset, padding_mask)`: `padding_mask` is
    /// `[batch, offset + t]` (`offset` = [`SequenceCache::len`], padding included), true where
    /// the token is real. A query at position `i` sees the real keys at positions `<= i`, and
    /// always its own key (the seed forces the diagonal so no query is fully masked). Positions
    /// count padding (RoPE positions are the absolute index), but a padding token is never
    /// stored, so no later query can see it. Returns logits `[batch, t, vocab]`; padding queries
    /// get zeros (finite; the seed discards them).
    ///
    /// Errors, changing nothing: a mask of the wrong shape (the seed's message), a mask that
    /// changes a position an earlier call already stored, padding between real tokens on a model
    /// with sliding-window layers (its window counts stored tokens, so it would differ from a
    /// window over positions), tokens outside the vocabulary, overflow, a batch mismatch.
    pub fn forward_masked(
        &mut self,
        engine: &mut Engine,
        ids: &[u32],
        batch: usize,
        t: usize,
        padding_mask: &[bool],
    ) -> Result<Vec<f32>> {
        self.check_call(engine, batch, t)?;
        if ids.len() != batch * t {
            return Err(Error::Input(format!("ids has {} entries, expected batch {batch} x {t}", ids.len())));
        }
        let kv_len = self.seq_len + t;
        if padding_mask.len() != batch * kv_len {
            let covers = if padding_mask.len().is_multiple_of(batch.max(1)) {
                format!("covers {} positions", padding_mask.len() / batch.max(1))
            } else {
                format!("has {} entries (not a multiple of the batch {batch})", padding_mask.len())
            };
            return Err(Error::Input(format!(
                "padding_mask {covers} but the key length is {kv_len} (offset {} + q_len {t})",
                self.seq_len
            )));
        }
        let vocab = engine.config().vocab;
        for b in 0..batch {
            let mask = &padding_mask[b * kv_len..(b + 1) * kv_len];
            if let Some(p) = (0..self.seq_len).find(|&p| mask[p] != self.real[b][p]) {
                return Err(Error::Input(format!(
                    "padding_mask row {b} marks position {p} as {}, but an earlier call stored it as {}; \
                     a cached position cannot change",
                    if mask[p] { "real" } else { "padding" },
                    if self.real[b][p] { "real" } else { "padding" }
                )));
            }
            if engine.config().has_local() {
                let first_real = mask.iter().position(|&m| m).unwrap_or(kv_len);
                let last_real = mask.iter().rposition(|&m| m).unwrap_or(0);
                if (first_real..last_real).any(|p| !mask[p]) {
                    return Err(Error::Input(format!(
                        "padding_mask row {b} has padding between real tokens, which a model with \
                         sliding-window layers cannot honour (its window counts stored tokens); \
                         left or right padding only"
                    )));
                }
            }
            for j in 0..t {
                let id = ids[b * t + j];
                if mask[self.seq_len + j] && id as usize >= vocab {
                    return Err(Error::Input(format!(
                        "row {b}, token {j}: id {id} is outside the vocabulary ({vocab})"
                    )));
                }
            }
        }
        let real = |b: usize, j: usize| padding_mask[b * kv_len + self.seq_len + j];
        let mut out = vec![0f32; batch * t * vocab];
        let per_pass = (engine.all_logits_tokens() / batch.max(1)).min(engine.chunk_width()).max(1);
        let mut next = vec![0usize; batch]; // next new position of each sequence
        while next.iter().any(|&j| j < t) {
            // padding first: it only moves the positions on
            let mut pads = vec![0usize; batch];
            for b in 0..batch {
                while next[b] < t && !real(b, next[b]) {
                    pads[b] += 1;
                    next[b] += 1;
                }
            }
            engine.skip(&self.rows, &pads)?;
            // then each sequence's next run of real tokens, all in one ragged append
            let mut n_new = vec![0usize; batch];
            for b in 0..batch {
                while next[b] + n_new[b] < t && n_new[b] < per_pass && real(b, next[b] + n_new[b]) {
                    n_new[b] += 1;
                }
            }
            let width = n_new.iter().copied().max().unwrap_or(0);
            if width == 0 {
                continue;
            }
            let mut chunk = vec![0u32; batch * width];
            for b in 0..batch {
                chunk[b * width..b * width + n_new[b]]
                    .copy_from_slice(&ids[b * t + next[b]..b * t + next[b] + n_new[b]]);
            }
            let logits = engine.append_all_logits(&chunk, width, &n_new, Some(&self.rows))?;
            for (b, row_logits) in logits.iter().enumerate() {
                for (k, l) in row_logits.iter().enumerate() {
                    let at = (b * t + next[b] + k) * vocab;
                    out[at..at + vocab].copy_from_slice(l);
                }
                next[b] += n_new[b];
            }
        }
        self.seq_len = kv_len;
        for b in 0..batch {
            self.real[b].extend_from_slice(&padding_mask[b * kv_len + kv_len - t..(b + 1) * kv_len]);
        }
        Ok(out)
    }

    /// Start over (no zeroing needed: old entries are masked by length).
    pub fn reset(&mut self, engine: &mut Engine) -> Result<()> {
        engine.reset(&self.rows)?;
        self.seq_len = 0;
        for r in &mut self.real {
            r.clear();
        }
        Ok(())
    }
}
