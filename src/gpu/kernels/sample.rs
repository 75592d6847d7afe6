//! Sampling's kernels: `sample.wgsl` in its dispatches, and the logit bias before it.

use super::work::{self, Work};
use super::{Overrides, Specialize};
use crate::gpu::shaders::{Constants, Kernel};

/// Which of sampling's dispatches: the whole-vocabulary kernel, or one of the split path's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SampleStage {
    Whole,
    Chunks,
    /// Radix pass `0..RADIX_PASSES` (top-k's four digits, then top-p's).
    Radix(usize),
    Kept,
    Merge,
}

/// Radix passes of the split path: four 8-bit digits of top-k's threshold, four of top-p's
/// (`PASSES` in sample.wgsl).
pub(crate) const RADIX_PASSES: usize = 8;

/// `sample.wgsl`: each row samples its next token (`score`: each token of the chunk reports the
/// chunk's next token, as a draw there would), one workgroup a row (`Whole`), or on the split path
/// a workgroup per chunk of its vocabulary (`Chunks`, `Radix`, `Kept`) and one to merge them
/// (`Merge`).
pub(crate) struct Sample {
    pub vocab: usize,
    pub mask_words: usize,
    pub score: bool,
    /// Rows of the split path's work buffer: the engine's rows, or its all-position tokens when
    /// more.
    pub stat_rows: usize,
    pub stage: SampleStage,
}

/// The split path's most entries of a chunk per thread (a thread marks the ones its top-N took
/// in one u32): vocabularies up to 32 * 256 * 256 tokens.
pub(crate) const SAMPLE_MAX_PER_THREAD: usize = 32;

/// Alternatives a row's top-N list holds (`TOP_MAX` in sample.wgsl; the engine's
/// `TOP_LOGPROBS_MAX`).
const TOP_MAX: usize = 20;
/// Words of a chunk's statistics (`STATS`).
const STATS: usize = 9;
/// Words of a sampled row's histograms and radix states (`HIST_WORDS + STATE_WORDS`).
const ROW_SELECT_WORDS: usize = RADIX_PASSES * 256 * 2 + (RADIX_PASSES + 1) * 4;

impl Sample {
    /// Split path: entries of a chunk per thread, so that a row has at most one chunk per lane of
    /// the merge (256 chunks).
    pub(crate) fn per_thread(vocab: usize) -> usize {
        let lanes = Kernel::Sample.workgroup_size() as usize;
        vocab.div_ceil(lanes * lanes).max(1)
    }

    /// Split path: chunks per row.
    pub(crate) fn chunks(vocab: usize) -> usize {
        vocab.div_ceil(Kernel::Sample.workgroup_size() as usize * Sample::per_thread(vocab))
    }

    /// Split path: words of the work buffer, for `stat_rows` rows (or scored positions) of
    /// chunk statistics, histograms, radix states and top-N candidates.
    pub(crate) fn work_words(vocab: usize, stat_rows: usize) -> usize {
        let chunks = Sample::chunks(vocab);
        stat_rows * (chunks * STATS + ROW_SELECT_WORDS + chunks * TOP_MAX * 2)
    }
}

impl Specialize for Sample {
    fn kernel(&self) -> Kernel {
        match self.stage {
            SampleStage::Whole => Kernel::Sample,
            SampleStage::Chunks => Kernel::SampleChunks,
            SampleStage::Radix(_) => Kernel::SampleRadix,
            SampleStage::Kept => Kernel::SampleKept,
            SampleStage::Merge => Kernel::SampleMerge,
        }
    }
    fn constants(&self) -> Constants {
        let o =
            Overrides::default().count("V", self.vocab).count("MASK_WORDS", self.mask_words).flag("SCORE", self.score);
        let chunks = Sample::chunks(self.vocab);
        let o = match self.stage {
            SampleStage::Whole => return o.0,
            _ => o
                .count("PER_THREAD", Sample::per_thread(self.vocab))
                .count("CHUNKS", chunks)
                .count("STAT_WORDS", self.stat_rows * chunks * STATS),
        };
        match self.stage {
            SampleStage::Radix(pass) => o.count("PASS", pass).0,
            _ => o.0,
        }
    }
    fn label(&self) -> String {
        let form = if self.score { "score" } else { "sample" };
        match self.stage {
            SampleStage::Whole => form.into(),
            SampleStage::Chunks => format!("{form}_chunks"),
            SampleStage::Radix(pass) => format!("{form}_radix_{}{}", ["k", "p"][pass / 4], pass % 4),
            SampleStage::Kept => format!("{form}_kept"),
            SampleStage::Merge => format!("{form}_merge"),
        }
    }
    /// One workgroup of 256 per row (a token, scoring): a pass over the vocabulary is
    /// ceil(V / 256) entries a thread; how many passes and reductions the row's sampler runs is
    /// `Sampler::vocabulary_passes`.
    /// The split path: a chunk is `per_thread` entries a thread. `Chunks` reads them twice and
    /// runs two trees (the argmaxes, raw max and kept count in one; the two sums), then a round
    /// per top-N entry (its entries and a tree). A radix pass or `Kept` reads them once after at
    /// most two radix choices (a suffix scan of 8 levels and the uniform load) and the row's max
    /// (a tree); `Kept` adds one tree. The merge reads its chunks twice, two trees, then a round
    /// per top-N entry: the head of a chunk's candidate list a lane, and a tree.
    fn work(&self) -> Work {
        let lanes = Kernel::Sample.workgroup_size() as usize;
        let levels = work::levels(lanes);
        let per_thread = Sample::per_thread(self.vocab);
        let chunks = Sample::chunks(self.vocab);
        let stats = 4 * STATS * chunks;
        let per_row = !self.score;
        let choice = levels + 1;
        // a row's histogram of one pass, its states and its top-N candidates
        let hist = 4 * 256 * 2;
        let candidates = 4 * chunks * TOP_MAX * 2;
        let logits = 4 * self.vocab + 4 * self.mask_words;
        match self.stage {
            SampleStage::Whole => Work {
                per_pass: self.vocab.div_ceil(lanes),
                per_reduction: levels,
                per_row,
                // the logits, the row's mask, and the top-N list
                ..Work::flat(0, logits + 8 * TOP_MAX + 12)
            },
            SampleStage::Chunks => Work {
                per_row,
                per_top: per_thread + levels,
                ..Work::flat(2 * per_thread + 2 * levels, logits + stats + hist * RADIX_PASSES + candidates)
            },
            SampleStage::Radix(_) => {
                Work { per_row, ..Work::flat(2 * choice + levels + per_thread, logits + stats / STATS + 2 * hist) }
            }
            SampleStage::Kept => {
                Work { per_row, ..Work::flat(choice + 2 * levels + per_thread, logits + stats / STATS * 5 + hist) }
            }
            SampleStage::Merge => Work {
                per_row,
                per_top: 1 + levels,
                ..Work::flat(2 * chunks.div_ceil(lanes) + 2 * levels, stats + candidates + 8 * TOP_MAX + 12)
            },
        }
    }
}

/// `logit_bias.wgsl`: rows' sparse biases added to their logits.
pub(crate) struct LogitBias {
    pub vocab: usize,
    pub slots: usize,
}

impl Specialize for LogitBias {
    fn kernel(&self) -> Kernel {
        Kernel::LogitBias
    }
    fn constants(&self) -> Constants {
        Overrides::default().count("V", self.vocab).count("SLOTS", self.slots).0
    }
    fn label(&self) -> String {
        "logit_bias".into()
    }
    /// A thread per (row, bias slot).
    fn work(&self) -> Work {
        Work { per_row: true, ..Work::flat(1, 12 * self.slots) }
    }
}
