//! The typed constants of `lora.wgsl`: one dispatch adds the adapters' `scale * B (A x)` of one or
//! more targets that read the same input and write the same buffer (`src/gpu/lora.rs` holds the
//! layout they index).

use super::{Overrides, Specialize, Work};
use crate::gpu::shaders::{Constants, Kernel};

/// Outputs each lane of `lora.wgsl` sums: a workgroup covers `64 * 16` outputs of one token, so
/// the token's `A x`, which every workgroup of the token computes, is computed once for q/k/v, o
/// and down of SmolLM2's shape and three times for its gate/up (at 4 outputs a lane, SmolLM2's
/// steps at 16 rows over 4 adapters took 2.24x the base model's GPU time on lavapipe; at 48, one
/// tile for every dispatch, no less time than at 16).
pub(crate) const LORA_OUTS_PER_LANE: usize = 16;

/// `lora.wgsl` for one dispatch: targets `t_first .. t_first + targets` of a group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lora {
    pub k: usize,
    pub x_stride: usize,
    pub y_stride: usize,
    pub y_offset: usize,
    pub targets: usize,
    pub rows_first: usize,
    pub rows_rest: usize,
    pub t_first: usize,
    pub group_targets: usize,
    pub b_row0: usize,
    pub max_rank: usize,
    pub slot_floats: usize,
    pub meta0: usize,
    /// A and B as halves, two to a u32.
    pub half: bool,
}

impl Lora {
    /// Outputs of the dispatch.
    pub(crate) fn outs(&self) -> usize {
        self.rows_first + (self.targets - 1) * self.rows_rest
    }

    /// Workgroups per token.
    pub(crate) fn tiles(&self) -> usize {
        self.outs().div_ceil(self.workgroup_size() as usize * LORA_OUTS_PER_LANE)
    }
}

impl Specialize for Lora {
    fn kernel(&self) -> Kernel {
        Kernel::Lora
    }
    fn constants(&self) -> Constants {
        Overrides::default()
            .count("K", self.k)
            .count("X_STRIDE", self.x_stride)
            .count("Y_STRIDE", self.y_stride)
            .count("Y_OFFSET", self.y_offset)
            .count("TARGETS", self.targets)
            .count("ROWS_FIRST", self.rows_first)
            .count("ROWS_REST", self.rows_rest.max(1))
            .count("T_FIRST", self.t_first)
            .count("GROUP_TARGETS", self.group_targets)
            .count("B_ROW0", self.b_row0)
            .count("MAX_RANK", self.max_rank)
            .count("SLOT_FLOATS", self.slot_floats)
            .count("META0", self.meta0)
            .count("OUTS_PER_LANE", LORA_OUTS_PER_LANE)
            .flag("AB_HALF", self.half)
            .0
    }
    fn label(&self) -> String {
        format!("lora_{}x{}_r{}{}", self.targets, self.outs(), self.max_rank, if self.half { "_f16" } else { "" })
    }
    /// A workgroup per (token, tile of outputs), at the slots' largest rank: a lane per (target,
    /// rank) sums A x over the inputs, four an iteration; then each lane's outputs, four ranks an
    /// iteration (a rank a multiple of 4 assumed).
    fn work(&self) -> Work {
        let wg = self.workgroup_size() as usize;
        let a = (self.targets * self.max_rank).div_ceil(wg) * self.k.div_ceil(4);
        let value_bytes = if self.half { 2 } else { 4 };
        let reads = value_bytes * (self.targets * self.max_rank * self.k + self.outs() * self.max_rank);
        Work::flat(a + LORA_OUTS_PER_LANE * self.max_rank.div_ceil(4), 4 * self.k + 8 * self.outs() + reads)
    }
}
