//! The typed constants of `lora.wgsl` (each token's `A x` for one group of targets, the first
//! half of the adapters) and of the products' LoRA epilogue (`matmul_lora.wgsl`, the second: `B`
//! times that `A x`, added to each output). `src/gpu/lora.rs` holds the layout both index.

use super::{FusedNorm, Overrides, Specialize, Work};
use crate::gpu::shaders::{Constants, Kernel};

/// u32s per token of the `A x` buffer: a head of 8 (slot, 3 ranks, 3 scales' bits, the token at
/// this position of the wide products' order), then room for 3 targets of `stride_rank` values.
pub(crate) fn ax_stride(stride_rank: usize) -> usize {
    8 + 3 * stride_rank
}

/// `lora.wgsl` for one dispatch: `A x` of targets `0 .. targets` of a group, for every token on
/// an adapter (the host's token groups, `src/engine/step.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lora {
    pub k: usize,
    pub x_stride: usize,
    pub targets: usize,
    pub max_rank: usize,
    pub slot_floats: usize,
    pub meta0: usize,
    /// x is the residual stream: read its norm (the block's input norm, fused into the products).
    pub norm: Option<FusedNorm>,
    /// A and B as halves, two to a u32.
    pub half: bool,
    /// Lanes that split a row of A's inputs (1, or [`LORA_SLICES_GPU`] on GPUs).
    pub slices: usize,
}

/// Lanes that split each row of A's inputs on GPUs, where a step is bound by its longest chain
/// of loads: 8 rows of A a workgroup, each walked in eight strided slices.
pub(crate) const LORA_SLICES_GPU: usize = 8;

impl Lora {
    /// Workgroups along x per token (they share the rows of A): as many as the group's targets
    /// at the slots' largest rank fill (a lane takes four rows unsliced, one row's slice sliced).
    pub(crate) fn row_chunks(&self) -> usize {
        let lane_rows = if self.slices == 1 { 4 } else { 1 };
        let per_wg = self.workgroup_size() as usize / self.slices * lane_rows;
        (self.targets * self.max_rank).div_ceil(per_wg)
    }
}

impl Specialize for Lora {
    fn kernel(&self) -> Kernel {
        Kernel::Lora
    }
    fn constants(&self) -> Constants {
        let mut o = Overrides::default()
            .count("K", self.k)
            .count("X_STRIDE", self.x_stride)
            .count("TARGETS", self.targets)
            .count("MAX_RANK", self.max_rank)
            .count("SLOT_FLOATS", self.slot_floats)
            .count("META0", self.meta0)
            .count("AX_STRIDE", ax_stride(self.max_rank))
            .count("SLICES", self.slices)
            .flag("AB_HALF", self.half);
        if let Some(n) = self.norm {
            o = o.flag("NORM", true).flag("NORM_WEIGHT", n.weight).float("EPS", n.eps);
        }
        o.0
    }
    fn label(&self) -> String {
        let normed = if self.norm.is_some() { "_normed" } else { "" };
        let sliced = if self.slices > 1 { format!("_s{}", self.slices) } else { String::new() };
        format!(
            "lora_ax_{}x{}_r{}{normed}{sliced}{}",
            self.targets,
            self.k,
            self.max_rank,
            if self.half { "_f16" } else { "" }
        )
    }
    /// Per group of up to 4 tokens of one adapter, `row_chunks` workgroups (and the tokens'
    /// heads, a lane each), at the slots' largest rank: a lane per (row of A, slice) sums its
    /// slice of the inputs for the group's tokens, four inputs an iteration (after the norm's sums
    /// and tree), then the slices' tree; each load of A serves the group (so a token's share of
    /// A's bytes is a quarter, where rows share adapters).
    fn work(&self) -> Work {
        let wg = self.workgroup_size() as usize;
        let norm = if self.norm.is_some() { self.k.div_ceil(wg) + super::work::levels(wg) } else { 0 };
        let per_wg = wg / self.slices;
        let passes = (self.targets * self.max_rank).div_ceil(per_wg * self.row_chunks());
        let a = passes * (self.k.div_ceil(4).div_ceil(self.slices) + super::work::levels(self.slices));
        let value_bytes = if self.half { 2 } else { 4 };
        let reads = value_bytes * self.targets * self.max_rank * self.k / 4;
        Work::flat(a + norm, 4 * self.k + reads + 4 * ax_stride(self.max_rank))
    }
}

/// The LoRA epilogue of a product (`matmul_lora.wgsl`): which group rows its outputs are, and
/// where the group's values lie.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LoraEpilogue {
    /// The group's B row of the part's weight row 0.
    pub row0: usize,
    /// The group's first B row of targets 1 and 2 (0: no such target).
    pub t1: usize,
    pub t2: usize,
    pub max_rank: usize,
    pub slot_floats: usize,
    /// A slot's first value of B.
    pub b0: usize,
    pub half: bool,
}

impl LoraEpilogue {
    pub(super) fn overrides(&self, o: Overrides) -> Overrides {
        o.flag("LORA", true)
            .count("LORA_ROW0", self.row0)
            .count("LORA_T1", self.t1)
            .count("LORA_T2", self.t2)
            .count("LORA_RANK", self.max_rank)
            .count("LORA_SLOT", self.slot_floats)
            .count("LORA_B0", self.b0)
            .count("LORA_AX", ax_stride(self.max_rank))
            .flag("LORA_HALF", self.half)
    }

    /// Per output and token, at the largest rank: B's row and the token's `A x`, four ranks an
    /// iteration.
    pub(super) fn work(&self) -> (usize, u64) {
        let value_bytes = if self.half { 2 } else { 4 };
        (self.max_rank.div_ceil(4), (value_bytes * self.max_rank + 4 * self.max_rank) as u64)
    }
}
