//! Sampling's kernels: `sample.wgsl` in its three dispatches, and the logit bias before it.

use super::work::{self, Work};
use super::{Overrides, Specialize};
use crate::gpu::shaders::{Constants, Kernel};

/// Which of sampling's dispatches: the whole-vocabulary kernel, or the split path's two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SampleStage {
    Whole,
    Chunks,
    Merge,
}

/// `sample.wgsl`: each row samples its next token (`score`: each token of the chunk reports the
/// chunk's next token, as a draw there would), one workgroup a row (`Whole`), or on the split path
/// a workgroup per chunk of its vocabulary (`Chunks`) and one to merge them (`Merge`).
pub(crate) struct Sample {
    pub vocab: usize,
    pub mask_words: usize,
    pub score: bool,
    /// The split path is on: `Whole` leaves the rows it takes to `Chunks` and `Merge`.
    pub split: bool,
    pub stage: SampleStage,
}

/// Alternatives a row's top-N list holds (`TOP_MAX` in sample.wgsl; the engine's
/// `TOP_LOGPROBS_MAX`).
const TOP_MAX: usize = 20;

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
}

impl Specialize for Sample {
    fn kernel(&self) -> Kernel {
        match self.stage {
            SampleStage::Whole => Kernel::Sample,
            SampleStage::Chunks => Kernel::SampleChunks,
            SampleStage::Merge => Kernel::SampleMerge,
        }
    }
    fn constants(&self) -> Constants {
        let o = Overrides::default()
            .count("V", self.vocab)
            .count("MASK_WORDS", self.mask_words)
            .flag("SCORE", self.score)
            .flag("SPLIT", self.split);
        match self.stage {
            SampleStage::Whole => o.0,
            _ => o.count("PER_THREAD", Sample::per_thread(self.vocab)).count("CHUNKS", Sample::chunks(self.vocab)).0,
        }
    }
    fn label(&self) -> String {
        let form = if self.score { "score" } else { "sample" };
        match self.stage {
            SampleStage::Whole => form.into(),
            SampleStage::Chunks => format!("{form}_chunks"),
            SampleStage::Merge => format!("{form}_merge"),
        }
    }
    /// One workgroup of 256 per row (a token, scoring): a pass over the vocabulary is
    /// ceil(V / 256) entries a thread; how many passes and reductions the row's sampler runs is
    /// `Sampler::vocabulary_passes`.
    /// The split path: a chunk is `per_thread` entries a thread, read twice, and six trees (the
    /// argmax, the Gumbel-max, the raw max, the kept count and two sums); the merge the same over
    /// its chunks.
    fn work(&self) -> Work {
        let lanes = Kernel::Sample.workgroup_size() as usize;
        let trees = 6 * work::levels(lanes);
        let stats = 32 * Sample::chunks(self.vocab);
        let per_row = !self.score;
        match self.stage {
            SampleStage::Whole => Work {
                per_pass: self.vocab.div_ceil(lanes),
                per_reduction: work::levels(lanes),
                per_row,
                // the logits, the row's mask, and the top-N list
                ..Work::flat(0, 4 * self.vocab + 4 * self.mask_words + 8 * TOP_MAX + 12)
            },
            SampleStage::Chunks => Work {
                per_row,
                ..Work::flat(2 * Sample::per_thread(self.vocab) + trees, 4 * self.vocab + 4 * self.mask_words + stats)
            },
            SampleStage::Merge => {
                Work { per_row, ..Work::flat(2 * Sample::chunks(self.vocab).div_ceil(lanes) + trees, stats + 12) }
            }
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
