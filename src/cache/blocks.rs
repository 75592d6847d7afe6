//! The block pool of global K/V: which fixed-size blocks each row's positions live in, which
//! blocks are free, and how many rows share each one. CPU only; the cache mirrors each row's
//! block table to the GPU when it changes.
//!
//! A block holds `block_len` consecutive positions of one row for every kv head of every global
//! group (one block index addresses the same positions in each group's pool). Block 0 of every
//! shard is the scratch block that padding tokens write; it is never handed out. A row holds
//! exactly `ceil(stored tokens / block_len)` blocks outside an append (the append reserves the
//! blocks of its new positions before it is submitted).
//!
//! Sharing: [`BlockPool::share`] gives a row another row's blocks by reference count (a fork);
//! a block is written only at positions beyond every sharer's length, so only a row's partly
//! filled last block can ever be written while shared, and [`BlockPool::reserve`] copies it
//! first (copy-on-write).
//!
//! The prompt cache: full blocks are registered under a hash chained over their tokens and the
//! previous block's hash, and the cache holds a reference of its own, so they outlive their rows.
//! A row starting a sequence adopts the cached blocks its tokens begin with
//! ([`BlockPool::adopt`]). Blocks only the cache holds are evicted least recently used first when
//! free blocks run out. Their K/V is what any row would compute for those tokens at those
//! positions, bit for bit: a row's results never depend on its batch or its chunking.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use crate::error::{Error, Result};

/// One block copy the GPU must make before the step that needs it: within `shard`, block
/// `from` to block `to` (every group, K and V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockCopy {
    pub(crate) from_shard: usize,
    pub(crate) from: u32,
    pub(crate) to_shard: usize,
    pub(crate) to: u32,
}

/// A full block in the prompt cache.
#[derive(Clone, Debug)]
struct Cached {
    /// Chained hash of its tokens (the index key).
    hash: u64,
    /// The previous block's hash (0 for a sequence's first block) and the block's tokens: a
    /// lookup compares both, so a hash collision can never hand out the wrong K/V.
    parent: u64,
    tokens: Box<[u32]>,
    /// When it was last adopted or registered (LRU order among the evictable).
    tick: u64,
}

/// Free list and reference counts of one shard (one storage binding) of the pool.
#[derive(Clone, Debug)]
struct Shard {
    /// Free blocks, handed out from the end (lowest index first).
    free: Vec<u32>,
    /// References to each block: rows holding it, plus one when the prompt cache holds it
    /// (block 0, the scratch block, is never counted).
    refs: Vec<u32>,
    /// Per block, its prompt cache entry.
    cached: Vec<Option<Cached>>,
    /// Cached blocks no row holds, by (tick, block): evicted oldest first when `free` is empty.
    evictable: BTreeSet<(u64, u32)>,
}

impl Shard {
    /// Blocks a call can take: free ones and cached ones no row holds.
    fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }
}

/// What the prompt cache did (see [`crate::Engine::reuse_prefix`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    /// Sequences that looked up their prompt.
    pub lookups: usize,
    /// Prompt tokens looked up.
    pub prompt_tokens: usize,
    /// Of those, tokens found in the cache (not computed again).
    pub hit_tokens: usize,
    /// Cached blocks evicted to make room.
    pub evicted: usize,
}

impl PromptCacheStats {
    /// Share of looked-up prompt tokens found in the cache.
    pub fn hit_rate(&self) -> f64 {
        self.hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// Blocks in use, at block granularity (see `BlockPool::usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockUsage {
    /// Positions per block.
    pub block_len: usize,
    /// Blocks rows can hold (the scratch blocks not counted).
    pub total: usize,
    /// Blocks no row references.
    pub free: usize,
    /// Blocks referenced by at least one row.
    pub used: usize,
    /// Of `used`, blocks referenced by more than one row (forks sharing a prefix).
    pub shared: usize,
    /// Block references summed over rows: what per-row copies would hold.
    pub referenced: usize,
    /// Blocks the prompt cache holds (some also held by rows).
    pub cached: usize,
    /// Of `cached`, blocks no row holds: evicted when free blocks run out (counted in `free`).
    pub evictable: usize,
}

/// Free lists, reference counts and the per-row block tables of the global K/V pool.
#[derive(Clone, Debug)]
pub(crate) struct BlockPool {
    block_len: usize,
    /// Table entries per row: `ceil(max_len / block_len)`.
    max_blocks: usize,
    shard_rows: usize,
    shards: Vec<Shard>,
    /// Per row, its blocks in position order (indices within the row's shard).
    tables: Vec<Vec<u32>>,
    /// Whether full blocks are registered in the prompt cache.
    prompt_cache: bool,
    /// Per row, the chained hashes of its first full blocks (those registered or found).
    hashes: Vec<Vec<u64>>,
    /// The prompt cache's index: (shard, chained hash) to block.
    index: HashMap<(usize, u64), u32>,
    /// Per row, whether its K/V came partly from weights since replaced
    /// ([`BlockPool::flush_prompt_cache`]): its blocks are never registered, until a reset.
    stale: Vec<bool>,
    /// Per row, the root of its hash chain: 0 on the base model, else its LoRA adapter's (and
    /// version's) own, so rows of different adapters never share a cached prefix.
    salt: Vec<u64>,
    tick: u64,
    stats: PromptCacheStats,
}

impl BlockPool {
    /// `rows` rows of at most `max_len` positions, `shard_rows` rows per shard, each shard
    /// `blocks_per_shard` blocks besides its scratch block.
    pub(crate) fn new(
        rows: usize,
        max_len: usize,
        shard_rows: usize,
        blocks_per_shard: usize,
        block_len: usize,
    ) -> Self {
        let n_shards = rows.div_ceil(shard_rows);
        let shard = Shard {
            free: (1..=blocks_per_shard as u32).rev().collect(),
            refs: vec![0; blocks_per_shard + 1],
            cached: vec![None; blocks_per_shard + 1],
            evictable: BTreeSet::new(),
        };
        BlockPool {
            block_len,
            max_blocks: max_len.div_ceil(block_len),
            shard_rows,
            shards: vec![shard; n_shards],
            tables: vec![Vec::new(); rows],
            prompt_cache: false,
            hashes: vec![Vec::new(); rows],
            index: HashMap::new(),
            stale: vec![false; rows],
            salt: vec![0; rows],
            tick: 0,
            stats: PromptCacheStats::default(),
        }
    }

    /// Root `row`'s hash chain at `salt` (0: the base model's); the row holds no blocks yet, or
    /// is recomputed from none.
    pub(crate) fn set_salt(&mut self, row: usize, salt: u64) {
        self.salt[row] = salt;
    }

    /// `rows` computed on with K/V from replaced weights (an adapter's update): none of their
    /// blocks is registered again until they are reset.
    pub(crate) fn mark_stale(&mut self, rows: &[usize]) {
        for &r in rows {
            self.stale[r] = !self.tables[r].is_empty();
        }
    }

    /// Keep full blocks for later sequences (off until turned on).
    pub(crate) fn set_prompt_cache(&mut self, on: bool) {
        self.prompt_cache = on;
    }

    pub(crate) fn prompt_cache(&self) -> bool {
        self.prompt_cache
    }

    pub(crate) fn prompt_cache_stats(&self) -> PromptCacheStats {
        self.stats
    }

    /// The chained hash of a block of `tokens` following a block whose hash is `parent`.
    fn chain(parent: u64, tokens: &[u32]) -> u64 {
        // SipHash with fixed keys: the same on every run and platform
        let mut h = std::collections::hash_map::DefaultHasher::new();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish().max(1)
    }

    /// Register `row`'s full blocks beyond those already registered: `tokens` are the row's
    /// tokens (at least its full blocks' worth). A block whose tokens are cached already stays
    /// the row's own (its bits are the same; the cache keeps the first).
    pub(crate) fn register(&mut self, row: usize, tokens: &[u32]) {
        if !self.prompt_cache || self.stale[row] {
            return;
        }
        let b = self.block_len;
        let s = self.shard_of(row);
        let full = (tokens.len() / b).min(self.tables[row].len());
        while self.hashes[row].len() < full {
            let k = self.hashes[row].len();
            let parent = self.hashes[row].last().copied().unwrap_or(self.salt[row]);
            let hash = Self::chain(parent, &tokens[k * b..(k + 1) * b]);
            self.hashes[row].push(hash);
            let blk = self.tables[row][k];
            if self.index.contains_key(&(s, hash)) || self.shards[s].cached[blk as usize].is_some() {
                continue;
            }
            self.tick += 1;
            let tokens = tokens[k * b..(k + 1) * b].into();
            self.shards[s].cached[blk as usize] = Some(Cached { hash, parent, tokens, tick: self.tick });
            self.shards[s].refs[blk as usize] += 1;
            self.index.insert((s, hash), blk);
        }
    }

    /// Give the empty `row` the cached blocks `prompt` begins with, leaving at least one token of
    /// `prompt` to compute (its logits are wanted). Returns `(start, end)`: the row holds the
    /// blocks of positions `..end`, and computes from `start` on, `start` at least `replay`
    /// positions before `end` and on a block boundary (models with local layers recompute their
    /// rings there); (0, 0) when that leaves nothing to reuse.
    pub(crate) fn adopt(&mut self, row: usize, prompt: &[u32], replay: usize) -> (usize, usize) {
        if !self.prompt_cache || !self.tables[row].is_empty() {
            return (0, 0);
        }
        let b = self.block_len;
        let s = self.shard_of(row);
        self.stats.lookups += 1;
        self.stats.prompt_tokens += prompt.len();
        let mut parent = self.salt[row];
        for k in 0..prompt.len().saturating_sub(1) / b {
            let tokens = &prompt[k * b..(k + 1) * b];
            let hash = Self::chain(parent, tokens);
            let Some(&blk) = self.index.get(&(s, hash)) else { break };
            let hit = self.shards[s].cached[blk as usize]
                .as_ref()
                .is_some_and(|c| c.parent == parent && &c.tokens[..] == tokens);
            if !hit {
                break;
            }
            self.tick += 1;
            let shard = &mut self.shards[s];
            let entry = shard.cached[blk as usize].as_mut().expect("indexed blocks are cached");
            shard.evictable.remove(&(entry.tick, blk));
            entry.tick = self.tick;
            shard.refs[blk as usize] += 1;
            self.tables[row].push(blk);
            self.hashes[row].push(hash);
            parent = hash;
        }
        let end = self.tables[row].len() * b;
        let start = end.saturating_sub(replay) / b * b;
        if start == 0 {
            self.truncate(row, 0);
            return (0, 0);
        }
        self.stats.hit_tokens += start;
        (start, end)
    }

    pub(crate) fn block_len(&self) -> usize {
        self.block_len
    }

    pub(crate) fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    pub(crate) fn shard_of(&self, row: usize) -> usize {
        row / self.shard_rows
    }

    /// `row`'s blocks in position order.
    pub(crate) fn table(&self, row: usize) -> &[u32] {
        &self.tables[row]
    }

    /// Blocks `row`'s shard can hand out: free ones and evictable cached ones.
    pub(crate) fn available(&self, row: usize) -> usize {
        self.shards[self.shard_of(row)].available()
    }

    /// Blocks of one shard (its scratch block not counted).
    pub(crate) fn blocks_per_shard(&self) -> usize {
        self.shards[0].refs.len() - 1
    }

    /// Give each `rows[i]` the blocks of positions `..new_lens[i]`, where it now holds the blocks
    /// of `..lens[i]`, and make the block its next position falls in its own (copy-on-write).
    /// All or nothing: if a shard lacks free blocks, an error names it and nothing changes.
    /// Returns the copies to make before the step, and the rows whose table changed.
    pub(crate) fn reserve(
        &mut self,
        rows: &[usize],
        lens: &[usize],
        new_lens: &[usize],
    ) -> Result<(Vec<BlockCopy>, Vec<usize>)> {
        let b = self.block_len;
        let mut needed = vec![0usize; self.shards.len()];
        // writers per shared partly filled block: all but the last sharer to write it copy it
        let mut writers: HashMap<(usize, u32), usize> = HashMap::new();
        for ((&row, &len), &new_len) in rows.iter().zip(lens).zip(new_lens) {
            if new_len <= len {
                continue;
            }
            let s = self.shard_of(row);
            needed[s] += new_len.div_ceil(b) - self.tables[row].len();
            if self.shared_tail(row, len) {
                *writers.entry((s, self.tables[row][len / b])).or_default() += 1;
            }
        }
        for (&(s, blk), &k) in &writers {
            needed[s] += if k as u32 == self.shards[s].refs[blk as usize] { k - 1 } else { k };
        }
        self.check_available(&needed, &vec![0; self.shards.len()], rows)?;
        let (mut copies, mut changed) = (Vec::new(), Vec::new());
        for ((&row, &len), &new_len) in rows.iter().zip(lens).zip(new_lens) {
            if new_len <= len {
                continue;
            }
            let s = self.shard_of(row);
            let mut row_changed = false;
            if self.shared_tail(row, len) {
                row_changed = true;
                let at = len / b;
                let from = self.tables[row][at];
                let to = self.take(s);
                self.release(s, from);
                self.tables[row][at] = to;
                copies.push(BlockCopy { from_shard: s, from, to_shard: s, to });
            }
            while self.tables[row].len() < new_len.div_ceil(b) {
                row_changed = true;
                let blk = self.take(s);
                self.tables[row].push(blk);
            }
            if row_changed {
                changed.push(row);
            }
        }
        Ok((copies, changed))
    }

    /// An error naming the first shard (and a row of `rows` in it) whose available blocks, plus
    /// `returned[s]` that the call frees before it takes any, are fewer than `needed[s]`.
    fn check_available(&self, needed: &[usize], returned: &[usize], rows: &[usize]) -> Result<()> {
        for (s, (&n, &back)) in needed.iter().zip(returned).enumerate() {
            let free = self.shards[s].available();
            if n > free + back {
                return Err(Error::OutOfBlocks {
                    row: rows.iter().copied().find(|&r| self.shard_of(r) == s).unwrap_or(0),
                    shard: s,
                    needed: n,
                    free,
                    blocks: self.blocks_per_shard(),
                    block_len: self.block_len,
                });
            }
        }
        Ok(())
    }

    /// Whether `row`'s next position (`len`) falls in a partly filled block another row shares.
    fn shared_tail(&self, row: usize, len: usize) -> bool {
        !len.is_multiple_of(self.block_len)
            && self.tables[row]
                .get(len / self.block_len)
                .is_some_and(|&blk| self.shards[self.shard_of(row)].refs[blk as usize] > 1)
    }

    /// Keep only the blocks of `row`'s first `len` positions; returns whether its table changed.
    pub(crate) fn truncate(&mut self, row: usize, len: usize) -> bool {
        if len == 0 {
            self.stale[row] = false;
        }
        let keep = len.div_ceil(self.block_len);
        if self.tables[row].len() <= keep {
            return false;
        }
        let s = self.shard_of(row);
        for blk in self.tables[row].split_off(keep) {
            self.release(s, blk);
        }
        self.hashes[row].truncate(len / self.block_len);
        true
    }

    /// Free blocks `dst` would need to share `src`'s blocks (when they live in different shards,
    /// `dst` gets copies).
    fn share_cost(&self, src: usize, dst: usize) -> usize {
        if self.shard_of(src) == self.shard_of(dst) {
            0
        } else {
            self.tables[src].len()
        }
    }

    /// Make each row of `dst` hold `src`'s blocks, dropping its own: by reference within a shard,
    /// by copy across shards. All or nothing. Returns the copies to make.
    pub(crate) fn share(&mut self, src: usize, dst: &[usize]) -> Result<Vec<BlockCopy>> {
        let mut needed = vec![0usize; self.shards.len()];
        for &d in dst {
            needed[self.shard_of(d)] += self.share_cost(src, d);
        }
        // the destinations' own blocks are dropped first: those no other table (or only the
        // prompt cache) holds afterwards can be taken again
        let mut drops: HashMap<(usize, u32), u32> = HashMap::new();
        for &d in dst {
            for &blk in &self.tables[d] {
                *drops.entry((self.shard_of(d), blk)).or_default() += 1;
            }
        }
        let mut returned = vec![0usize; self.shards.len()];
        for (&(s, blk), &k) in &drops {
            let left = self.shards[s].refs[blk as usize] - k;
            returned[s] += usize::from(left == u32::from(self.shards[s].cached[blk as usize].is_some()));
        }
        self.check_available(&needed, &returned, dst)?;
        for &d in dst {
            self.truncate(d, 0);
            self.hashes[d].clear();
        }
        let mut copies = Vec::new();
        let from_shard = self.shard_of(src);
        for &d in dst {
            let to_shard = self.shard_of(d);
            let table = self.tables[src].clone();
            if to_shard == from_shard {
                for &blk in &table {
                    self.shards[from_shard].refs[blk as usize] += 1;
                }
                self.tables[d] = table;
                self.hashes[d] = self.hashes[src].clone();
                self.stale[d] = self.stale[src];
                self.salt[d] = self.salt[src];
            } else {
                self.tables[d] = table
                    .iter()
                    .map(|&from| {
                        let to = self.take(to_shard);
                        copies.push(BlockCopy { from_shard, from, to_shard, to });
                        to
                    })
                    .collect();
                self.stale[d] = self.stale[src];
                self.salt[d] = self.salt[src];
            }
        }
        Ok(copies)
    }

    /// Forget every cached block, because the weights that computed their K/V were replaced:
    /// blocks only the cache held become free, rows keep theirs. With `stale`, rows that hold
    /// blocks now are stale: what they compute next still attends to the old K/V, so none of
    /// their blocks is registered again until the row is reset.
    pub(crate) fn flush_prompt_cache(&mut self, stale: bool) {
        for s in 0..self.shards.len() {
            let shard = &mut self.shards[s];
            shard.evictable.clear();
            for blk in 0..shard.cached.len() {
                if shard.cached[blk].take().is_some() {
                    shard.refs[blk] -= 1;
                    if shard.refs[blk] == 0 {
                        shard.free.push(blk as u32);
                    }
                }
            }
            // lowest index first, as a new pool hands them out
            shard.free.sort_unstable_by(|a, b| b.cmp(a));
        }
        self.index.clear();
        for (row, table) in self.tables.iter().enumerate() {
            self.hashes[row].clear();
            self.stale[row] = stale && !table.is_empty();
        }
    }

    /// A free block, or else the cached block no row holds that was used least recently.
    fn take(&mut self, s: usize) -> u32 {
        let shard = &mut self.shards[s];
        let blk = match shard.free.pop() {
            Some(blk) => blk,
            None => {
                let (_, blk) = shard.evictable.pop_first().expect("available blocks were counted before taking");
                let entry = shard.cached[blk as usize].take().expect("evictable blocks are cached");
                self.index.remove(&(s, entry.hash));
                self.stats.evicted += 1;
                blk
            }
        };
        self.shards[s].refs[blk as usize] = 1;
        blk
    }

    fn release(&mut self, s: usize, blk: u32) {
        let shard = &mut self.shards[s];
        let refs = &mut shard.refs[blk as usize];
        *refs -= 1;
        match (&shard.cached[blk as usize], *refs) {
            (_, 0) => shard.free.push(blk),
            (Some(c), 1) => {
                shard.evictable.insert((c.tick, blk));
            }
            _ => {}
        }
    }

    /// Blocks in use and free, over all shards.
    pub(crate) fn usage(&self) -> BlockUsage {
        let mut u = BlockUsage { block_len: self.block_len, ..BlockUsage::default() };
        for s in &self.shards {
            u.total += s.refs.len() - 1;
            u.free += s.available();
            u.evictable += s.evictable.len();
            for (blk, &r) in s.refs.iter().enumerate().skip(1) {
                // the cache's own reference is not a row's
                let rows = r as usize - s.cached[blk].is_some() as usize;
                u.cached += s.cached[blk].is_some() as usize;
                u.used += (rows > 0) as usize;
                u.shared += (rows > 1) as usize;
                u.referenced += rows;
            }
        }
        u
    }

    /// Check the bookkeeping: every block's count equals the tables referencing it, and every
    /// block is either referenced or free, once. Describes the first inconsistency.
    pub(crate) fn audit(&self) -> std::result::Result<(), String> {
        for (si, s) in self.shards.iter().enumerate() {
            let mut refs = vec![0u32; s.refs.len()];
            for (row, t) in self.tables.iter().enumerate().filter(|(r, _)| self.shard_of(*r) == si) {
                for &blk in t {
                    if blk == 0 || blk as usize >= refs.len() {
                        return Err(format!("row {row} holds block {blk}, outside shard {si}'s pool"));
                    }
                    refs[blk as usize] += 1;
                }
            }
            let mut free = vec![false; s.refs.len()];
            for &blk in &s.free {
                if std::mem::replace(&mut free[blk as usize], true) {
                    return Err(format!("shard {si}: block {blk} is free twice"));
                }
            }
            let mut evictable = 0;
            for (blk, c) in s.cached.iter().enumerate() {
                if let Some(c) = c {
                    evictable += usize::from(refs[blk] == 0);
                    if self.index.get(&(si, c.hash)) != Some(&(blk as u32)) {
                        return Err(format!("shard {si}: cached block {blk} is not in the index"));
                    }
                    if (refs[blk] == 0) != s.evictable.contains(&(c.tick, blk as u32)) {
                        return Err(format!(
                            "shard {si}: cached block {blk} held by {} rows, evictable wrong",
                            refs[blk]
                        ));
                    }
                    refs[blk] += 1;
                }
            }
            if evictable != s.evictable.len() {
                return Err(format!("shard {si}: {} evictable blocks listed, {evictable} found", s.evictable.len()));
            }
            for blk in 1..refs.len() {
                if refs[blk] != s.refs[blk] {
                    return Err(format!(
                        "shard {si}: block {blk} counts {} references, tables hold {}",
                        s.refs[blk], refs[blk]
                    ));
                }
                if (refs[blk] == 0) != free[blk] {
                    return Err(format!(
                        "shard {si}: block {blk} has {} references and free = {}",
                        refs[blk], free[blk]
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_share_and_copy_on_write() {
        // 3 rows in one shard of 6 blocks of 4 positions
        let mut p = BlockPool::new(3, 16, 3, 6, 4);
        let (copies, changed) = p.reserve(&[0], &[0], &[6]).unwrap();
        assert!(copies.is_empty());
        assert_eq!(changed, vec![0]);
        assert_eq!(p.table(0), &[1, 2]);
        // forks share both blocks
        assert!(p.share(0, &[1, 2]).unwrap().is_empty());
        assert_eq!(p.usage().used, 2);
        assert_eq!(p.usage().shared, 2);
        assert_eq!(p.usage().referenced, 6);
        // row 1 writes position 6: its partly filled block 2 is copied first
        let (copies, _) = p.reserve(&[1], &[6], &[7]).unwrap();
        assert_eq!(copies, vec![BlockCopy { from_shard: 0, from: 2, to_shard: 0, to: 3 }]);
        assert_eq!(p.table(1), &[1, 3]);
        // row 0 grows into a new block: its block 2 (still shared with row 2) is copied first
        let (copies, _) = p.reserve(&[0], &[6], &[9]).unwrap();
        assert_eq!(copies.len(), 1);
        assert_eq!(p.table(0).len(), 3);
        p.audit().unwrap();
        // 5 blocks used: row 2 needs 2 more, 1 is free: a clear error, nothing changes
        let before = p.usage();
        let err = p.reserve(&[2], &[6], &[16]).unwrap_err();
        assert!(format!("{err}").contains("shard 0"), "{err}");
        assert_eq!(p.usage(), before);
        // release everything
        for r in 0..3 {
            p.truncate(r, 0);
        }
        p.audit().unwrap();
        assert_eq!(p.usage().free, 6);
    }

    #[test]
    fn a_flushed_prompt_cache_frees_its_blocks_and_stale_rows_register_nothing() {
        // 2 rows in one shard of 6 blocks of 4 positions
        let mut p = BlockPool::new(2, 16, 2, 6, 4);
        p.set_prompt_cache(true);
        let tokens: Vec<u32> = (0..12).collect();
        p.reserve(&[0], &[0], &[12]).unwrap();
        p.register(0, &tokens);
        p.truncate(0, 0); // the cache alone holds the 3 blocks now
        p.reserve(&[1], &[0], &[8]).unwrap();
        p.register(1, &tokens[..8]);
        assert_eq!(p.usage().cached, 3);
        p.flush_prompt_cache(true);
        p.audit().unwrap();
        let u = p.usage();
        assert_eq!((u.cached, u.used, u.free), (0, 2, 4), "{u:?}");
        // row 1 holds K/V of the old weights: growing it registers nothing
        p.reserve(&[1], &[8], &[12]).unwrap();
        p.register(1, &tokens);
        assert_eq!(p.usage().cached, 0);
        assert_eq!(p.adopt(0, &tokens, 0), (0, 0), "nothing to adopt");
        // a reset row is fresh again
        p.truncate(1, 0);
        p.reserve(&[1], &[0], &[8]).unwrap();
        p.register(1, &tokens[..8]);
        assert_eq!(p.usage().cached, 2);
        p.audit().unwrap();
    }

    #[test]
    fn forks_across_shards_copy() {
        let mut p = BlockPool::new(4, 8, 2, 4, 4);
        p.reserve(&[0], &[0], &[5]).unwrap();
        let copies = p.share(0, &[1, 2]).unwrap();
        assert_eq!(copies.len(), 2, "row 2 lives in shard 1: both blocks copied");
        assert_eq!(p.shard_of(2), 1);
        p.audit().unwrap();
    }

    #[test]
    fn a_fork_counts_only_blocks_that_really_come_back() {
        // shards of 2 rows and 3 blocks: rows 0 and 1 share 2 blocks, row 2 (shard 1) holds 2
        let mut p = BlockPool::new(4, 16, 2, 3, 4);
        p.reserve(&[0, 2], &[0, 0], &[8, 8]).unwrap();
        p.share(0, &[1]).unwrap();
        // forking row 2 into row 1 copies 2 blocks into shard 0, where 1 is free: row 1's own
        // blocks stay held by row 0, so nothing comes back and it is an error, not a panic
        let before = p.usage();
        let err = p.share(2, &[1]).unwrap_err();
        assert!(matches!(err, Error::OutOfBlocks { row: 1, shard: 0, needed: 2, free: 1, .. }), "{err}");
        assert_eq!(p.usage(), before);
        // once row 0 lets go, row 1's blocks come back and the fork fits
        p.truncate(0, 0);
        assert_eq!(p.share(2, &[1]).unwrap().len(), 2);
        p.audit().unwrap();
    }
}
