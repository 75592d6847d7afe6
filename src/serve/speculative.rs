//! Speculative decoding with n-gram prompt lookup: propose the tokens that followed the last
//! occurrence of the current n-gram, verify them all in one pass (logits at every drafted
//! position), keep the longest agreeing prefix plus the model's own next token, and roll back the
//! rest. Chunking does not change a bit in this engine, so the output equals plain greedy decoding.

use crate::engine::sampling::argmax;
use crate::engine::Engine;
use crate::error::{Error, Result};

/// Counters of one speculative run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verification passes (one submit + readback each).
    pub passes: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
}

/// The up to `k` tokens that followed the most recent earlier occurrence of the last `n` tokens
/// of `seq` (empty when there is none).
pub fn ngram_draft(seq: &[u32], n: usize, k: usize) -> Vec<u32> {
    if n == 0 || seq.len() <= n {
        return Vec::new();
    }
    let tail = &seq[seq.len() - n..];
    for start in (0..seq.len() - n).rev() {
        if &seq[start..start + n] == tail {
            let from = start + n;
            return seq[from..(from + k).min(seq.len())].to_vec();
        }
    }
    Vec::new()
}

/// Greedy decoding of up to `max_new` tokens after `prompt` in cache row `row` (which is reset),
/// with drafts of at most `k` tokens (bounded by the engine's rollback) from `n`-gram lookup.
/// Stops after a token in `stop` (returned, not appended, as in [`Engine::decode_turns`]).
/// Returns the generated tokens and the counters.
pub fn greedy_speculative(
    engine: &mut Engine,
    row: usize,
    prompt: &[u32],
    max_new: usize,
    k: usize,
    n: usize,
    stop: &[u32],
) -> Result<(Vec<u32>, SpecStats)> {
    let (&first, head) = prompt.split_last().ok_or_else(|| Error::Input("empty prompt".into()))?;
    engine.reset(&[row])?;
    engine.feed(head, head.len(), &[head.len()], Some(&[row]))?;
    let k = k.min(engine.max_window() - 1);
    let mut seq = prompt.to_vec(); // the sequence so far, the un-appended `last` included
    let mut last = first;
    let mut out = Vec::new();
    let mut stats = SpecStats::default();
    while out.len() < max_new {
        let room = engine.cache().max_len() - engine.cache().lens()[row];
        let draft = ngram_draft(&seq, n, k.min(max_new - out.len() - 1).min(room.saturating_sub(1)));
        // verify: append last + draft, logits at every one of those positions
        let mut chunk = vec![last];
        chunk.extend_from_slice(&draft);
        let logits = engine.append_all_logits(&chunk, chunk.len(), &[chunk.len()], Some(&[row]))?;
        stats.passes += 1;
        stats.drafted += draft.len();
        let mut accepted = 0;
        let mut next = argmax(&logits[0][0]) as u32;
        while accepted < draft.len() && draft[accepted] == next {
            accepted += 1;
            next = argmax(&logits[0][accepted]) as u32;
        }
        stats.accepted += accepted;
        // produced: the accepted draft (appended) and the model's own next token (not appended)
        let mut produced = draft[..accepted].to_vec();
        produced.push(next);
        // where greedy decoding would have stopped inside `produced`, if anywhere
        let room_left = max_new - out.len();
        let cut = produced.iter().position(|t| stop.contains(t)).map_or(produced.len(), |i| i + 1).min(room_left);
        // keep last + produced[..cut - 1] appended: roll back the rest of the draft
        engine.rollback(&[row], &[draft.len() - (cut - 1)])?;
        out.extend_from_slice(&produced[..cut]);
        seq.extend_from_slice(&produced[..cut]);
        if cut < produced.len() || stop.contains(&produced[cut - 1]) {
            break;
        }
        last = next;
    }
    Ok((out, stats))
}
