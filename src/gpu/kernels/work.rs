//! What a dispatch's threads do, for the occupancy table ([`crate::Engine::occupancy`]): the
//! longest serial path any one thread runs and the bytes the dispatch moves, as the kernel's
//! constants and the step's shape make them. Computed, never measured: it needs no GPU.
//!
//! An *iteration* is one trip of a thread's innermost loop: one vec4 multiply-add of a product or of
//! attention, one element of a norm, RoPE or copy, one vocabulary entry of the sampler, one level
//! of a workgroup or subgroup reduction. A thread's serial iterations are what a GPU's latency
//! pays for when a dispatch has too few workgroups to fill it.

/// A kernel's work in iterations and bytes; see the module doc. Built by each kernel's
/// [`super::Specialize::work`], evaluated by [`Work::at`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Work {
    /// Iterations every thread runs, whatever the step's shape.
    pub iters: usize,
    /// Keys of a row's context a thread walks: at most `key_span` of them (a partition; 0: the
    /// kernel walks no keys), `per_key` iterations each, and `per_tile` per tile of `key_tile`
    /// keys (a workgroup's shared tile: its reductions and staging).
    pub per_key: usize,
    pub key_span: usize,
    pub per_tile: usize,
    pub key_tile: usize,
    /// Iterations per partition of `part_span` positions a row's context spans (split attention's
    /// merge walks the partitions, not the keys).
    pub per_part: usize,
    pub part_span: usize,
    /// The sampler: iterations per pass over the vocabulary and per workgroup reduction; how many of
    /// each a row runs depends on its sampler ([`At::vocab_passes`]).
    pub per_pass: usize,
    pub per_reduction: usize,
    /// The split sampler's top-N: iterations per entry found.
    pub per_top: usize,
    /// Bytes read once a dispatch (weights).
    pub fixed_bytes: u64,
    /// Bytes read and written per token of the step (per chunk row with `per_row`).
    pub token_bytes: u64,
    pub per_row: bool,
    /// Bytes of K/V read per key position of a row's context.
    pub key_bytes: u64,
}

/// The step a dispatch's work is evaluated at.
#[derive(Clone, Copy, Debug)]
pub(crate) struct At {
    pub rows: usize,
    pub tokens: usize,
    /// Keys each row's queries see: its length after the step.
    pub context: usize,
    /// Passes over the vocabulary and workgroup reductions the longest row's sampler runs.
    pub vocab_passes: usize,
    pub reductions: usize,
    /// Alternatives the longest row lists (its top-N).
    pub top_n: usize,
}

impl Work {
    /// `iters` serial iterations a thread, `token_bytes` per token.
    pub(crate) fn flat(iters: usize, token_bytes: usize) -> Work {
        Work { iters, token_bytes: token_bytes as u64, ..Work::default() }
    }

    /// The longest serial path of a thread, in iterations, and the bytes read and written.
    pub(crate) fn at(&self, at: &At) -> (usize, u64) {
        let keys = at.context.min(self.key_span);
        let mut serial = self.iters + self.per_key * keys + self.per_pass * at.vocab_passes;
        serial += self.per_reduction * at.reductions;
        serial += at.top_n * self.per_top;
        if self.key_tile > 0 {
            serial += self.per_tile * keys.div_ceil(self.key_tile);
        }
        if self.part_span > 0 {
            serial += self.per_part * at.context.div_ceil(self.part_span);
        }
        let per = if self.per_row { at.rows } else { at.tokens } as u64;
        let bytes = self.fixed_bytes + self.token_bytes * per + self.key_bytes * (at.context * at.rows) as u64;
        (serial, bytes)
    }
}

/// Levels of a tree reduction over `lanes` lanes.
pub(crate) fn levels(lanes: usize) -> usize {
    lanes.max(1).next_power_of_two().trailing_zeros() as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys cap at a partition's span, tiles round up, partitions follow the whole context.
    #[test]
    fn keys_tiles_and_partitions_follow_the_context() {
        let w = Work { per_key: 2, key_span: 256, per_tile: 10, key_tile: 64, key_bytes: 8, ..Work::default() };
        let at = At { rows: 2, tokens: 2, context: 100, vocab_passes: 0, reductions: 0, top_n: 0 };
        assert_eq!(w.at(&at), (2 * 100 + 10 * 2, 8 * 200));
        assert_eq!(w.at(&At { context: 1000, ..at }).0, 2 * 256 + 10 * 4);
        let merge = Work { per_part: 3, part_span: 256, ..Work::default() };
        assert_eq!(merge.at(&At { context: 1000, ..at }).0, 3 * 4);
        assert_eq!(levels(256), 8);
        assert_eq!(levels(9), 4);
    }
}
