//! One prebuilt dispatch and its grid: how many workgroups it needs for a chunk's shape, the form
//! it takes for steps of many tokens, and recording it into a pass.

use std::sync::Arc;

use crate::engine::sampling::Sampler;
use crate::gpu::kernels::{At, Work};
use crate::gpu::shaders::{Bind, Kernel};
use crate::gpu::variants::{QUERY_TILE_MIN_WIDTH, TILED_MIN_TOKENS};

/// How many workgroups a dispatch needs, given the chunk shape (R rows, C width).
#[derive(Clone, Copy, Debug)]
pub(super) enum Grid {
    /// `k` threads per token of the chunk (R * C tokens), linear.
    Tokens(usize),
    /// `k` threads per chunk row, linear.
    Rows(usize),
    /// Matmul over the chunk's tokens (or rows): one thread per `outs` outputs and 4 tokens.
    Matmul { out_rows: usize, per_row: bool, outs: usize },
    /// Subgroup and workgroup-reduced matmul: one workgroup per output and 4 tokens.
    MatmulPerOutput { out_rows: usize, per_row: bool },
    /// Tiled matmul: one workgroup per 32 tokens and 32 weight rows (16 outputs when `gated`).
    MatmulTiled { out_rows: usize, per_row: bool, gated: bool },
    /// A MoE layer's expert products: one workgroup row per expert a token block can route to
    /// (its pairs, at most all experts), `outs` outputs a thread, one workgroup layer (z) per
    /// `token_block` tokens.
    ExpertPairs { out_rows: usize, outs: usize, experts: usize, top_k: usize, token_block: usize },
    /// A MoE layer's sum of each token's experts: one thread per output, one token per workgroup
    /// row (past 65535 tokens, on in z).
    ExpertSums { out_rows: usize },
    /// The LoRA adapters' `A x` (`lora.wgsl`): a row of `tiles` workgroups per token group of
    /// the step (the host's, up to 4 tokens of one adapter), and at least one row per 64 tokens
    /// (which write their heads; past 65535 rows, on in z). With `spread` (a CPU adapter's
    /// threads), a step of fewer groups than that takes more workgroups a row, so each thread
    /// gets a share of the rows of A.
    LoraGroups { tiles: usize, spread: usize },
    /// One workgroup per chunk row.
    WorkgroupPerRow,
    /// `chunks` workgroups per chunk row (per token with `per_token`), one row or token per
    /// workgroup row (past 65535, on in z): the split sampler's chunks.
    Chunks { chunks: usize, per_token: bool },
    /// `per_token` threads per token of token group `group` (`size` tokens per group), linear.
    TokenGroup { group: usize, size: usize, per_token: usize },
    /// Split attention's partials: one workgroup per (partition, kv head, token of the group).
    SplitPartials { group: usize, size: usize, parts: usize, kv_heads: usize },
    /// The same from query tiles: one workgroup per (partition, kv head, query tile of the group),
    /// a row's tokens cut into tiles of `tile` from its first.
    QueryTiles { group: usize, size: usize, parts: usize, kv_heads: usize, tile: usize },
}

/// A dispatch built once: its pipeline and bind group, its grid, and its variant's label.
pub(super) struct Dispatch {
    pub(super) kernel: Kernel,
    /// The variant's name (`kv_write_ring_f16`), as the pipeline and bind group are labelled.
    pub(super) label: Arc<str>,
    pub(super) pipeline: Arc<wgpu::ComputePipeline>,
    pub(super) bind: wgpu::BindGroup,
    pub(super) grid: Grid,
    pub(super) wg: u32,
    /// What its threads do, for the occupancy table.
    pub(super) work: Work,
    /// The form recorded instead for steps of many tokens, with the same bits, so a step may take
    /// either: a product's mat-mat kernel (`tiled` variant) from [`TILED_MIN_TOKENS`] tokens on,
    /// split-group attention's query tiles from [`QUERY_TILE_MIN_WIDTH`] tokens a row on.
    pub(super) many_tokens: Option<Box<Dispatch>>,
    /// The buffers it binds and how, in binding order: what wgpu's usage tracking sees, for the
    /// barriers the occupancy table counts.
    pub(super) uses: Vec<(wgpu::Buffer, Bind)>,
    /// Tokens a row a step needs before the dispatch runs: 2 for RoPE where split-group
    /// attention does its work at one token a row (`Fusion::rope`), else 1.
    pub(super) min_width: usize,
}

/// Blocks of tokens a matmul dispatch covers: one per 4 tokens, or one per token in steps of
/// fewer than 4 (`tokens_per_thread` in matmul.wgsl).
fn matmul_token_blocks(n: usize) -> u32 {
    (if n < 4 { n } else { n.div_ceil(4) }).max(1) as u32
}

impl Dispatch {
    /// The grid for a chunk of `rows x width` tokens whose adapter rows make `lora_groups` token
    /// groups.
    pub(super) fn workgroups(&self, rows: usize, width: usize, lora_groups: usize) -> (u32, u32, u32) {
        let linear = |threads: usize| {
            let groups = threads.div_ceil(self.wg as usize).max(1);
            let x = groups.min(65535);
            (x as u32, groups.div_ceil(x) as u32, 1)
        };
        match self.grid {
            Grid::Tokens(k) => linear(rows * width * k),
            Grid::Rows(k) => linear(rows * k),
            Grid::Matmul { out_rows, per_row, outs } => {
                let n = if per_row { rows } else { rows * width };
                (out_rows.div_ceil(self.wg as usize * outs) as u32, matmul_token_blocks(n), 1)
            }
            Grid::MatmulPerOutput { out_rows, per_row } => {
                let n = if per_row { rows } else { rows * width };
                let x = out_rows.clamp(1, 65535);
                (x as u32, out_rows.div_ceil(x) as u32, matmul_token_blocks(n))
            }
            Grid::MatmulTiled { out_rows, per_row, gated } => {
                let n = if per_row { rows } else { rows * width };
                (out_rows.div_ceil(if gated { 16 } else { 32 }) as u32, n.div_ceil(32).max(1) as u32, 1)
            }
            Grid::ExpertPairs { out_rows, outs, experts, top_k, token_block } => {
                let n = (rows * width).max(1);
                let routed = experts.min(n.min(token_block) * top_k);
                (out_rows.div_ceil(self.wg as usize * outs) as u32, routed as u32, n.div_ceil(token_block) as u32)
            }
            Grid::ExpertSums { out_rows } => {
                let n = (rows * width).max(1);
                (out_rows.div_ceil(self.wg as usize) as u32, n.min(65535) as u32, n.div_ceil(65535) as u32)
            }
            Grid::LoraGroups { tiles, spread } => {
                // a workgroup writes the heads of as many tokens as it has lanes
                let n = lora_groups.max((rows * width).div_ceil(self.wg as usize)).max(1);
                let x = tiles.max(spread.div_ceil(lora_groups.max(1)));
                (x as u32, n.min(65535) as u32, n.div_ceil(65535) as u32)
            }
            Grid::WorkgroupPerRow => (rows as u32, 1, 1),
            Grid::Chunks { chunks, per_token } => {
                let n = (if per_token { rows * width } else { rows }).max(1);
                (chunks as u32, n.min(65535) as u32, n.div_ceil(65535) as u32)
            }
            Grid::TokenGroup { group, size, per_token } => {
                linear(Self::group_count(rows * width, group, size) * per_token)
            }
            Grid::SplitPartials { group, size, parts, kv_heads } => {
                (parts as u32, kv_heads as u32, Self::group_count(rows * width, group, size) as u32)
            }
            Grid::QueryTiles { group, size, parts, kv_heads, tile } => {
                // the tiles from the one of the group's first token to the one of its last
                let first = group * size;
                let last = (first + Self::group_count(rows * width, group, size)).max(first + 1) - 1;
                let tiles_per_row = width.div_ceil(tile);
                let tile_of = |n: usize| (n / width) * tiles_per_row + (n % width) / tile;
                (parts as u32, kv_heads as u32, (tile_of(last) + 1 - tile_of(first)) as u32)
            }
        }
    }

    /// Tokens of `tokens` that fall in token group `group` of `size`.
    fn group_count(tokens: usize, group: usize, size: usize) -> usize {
        tokens.saturating_sub(group * size).min(size)
    }

    /// Whether the dispatch has work in a chunk of `rows x width` tokens (a token group past the
    /// chunk's tokens is not recorded, nor one that needs a wider chunk).
    pub(super) fn live(&self, rows: usize, width: usize) -> bool {
        if width < self.min_width {
            return false;
        }
        match self.grid {
            Grid::TokenGroup { group, size, .. }
            | Grid::SplitPartials { group, size, .. }
            | Grid::QueryTiles { group, size, .. } => Self::group_count(rows * width, group, size) > 0,
            _ => true,
        }
    }

    /// The dispatch a chunk of `rows x width` tokens records: its form for many tokens where it
    /// has one and the chunk has enough tokens, else itself.
    pub(super) fn for_chunk(&self, rows: usize, width: usize) -> &Dispatch {
        match (&self.many_tokens, self.grid) {
            (Some(t), Grid::Matmul { per_row, .. })
                if (if per_row { rows } else { rows * width }) >= TILED_MIN_TOKENS =>
            {
                t
            }
            (Some(t), Grid::SplitPartials { .. }) if width >= QUERY_TILE_MIN_WIDTH => t,
            _ => self,
        }
    }

    /// Workgroups launched, threads in them, the longest serial loop of a thread and the bytes
    /// moved, in a chunk of `at.rows x width` tokens (each token on its own adapter: the most
    /// token groups).
    pub(super) fn occupancy(&self, width: usize, at: &At) -> (u64, u64, usize, u64) {
        let (x, y, z) = self.workgroups(at.rows, width, at.rows * width);
        let groups = x as u64 * y as u64 * z as u64;
        let (serial, bytes) = self.work.at(at);
        (groups, groups * self.wg as u64, serial, bytes)
    }

    /// Records the dispatch for a chunk of `rows x width` tokens with `lora_groups` token groups
    /// on adapters.
    pub(super) fn record(&self, pass: &mut wgpu::ComputePass<'_>, rows: usize, width: usize, lora_groups: usize) {
        let (x, y, z) = self.workgroups(rows, width, lora_groups);
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        pass.dispatch_workgroups(x, y, z);
    }
}

/// Sampling's dispatches of one form (each row's next token, or every position's score): `whole`,
/// a workgroup a row; or with the split path on ([`crate::EngineOptions::split_sampling`]),
/// `split`. Each split stage leaves the rows that do not need it alone, so a step records only
/// what its rows need and a row's bits never depend on the others'.
pub(super) struct SampleDispatches {
    pub(super) whole: Dispatch,
    pub(super) split: Option<SplitSampling>,
}

/// The split path's dispatches, in recording order: the chunks' statistics, the radix passes of
/// top-k's threshold then top-p's, the draw among the kept tokens, the merge.
pub(super) struct SplitSampling {
    pub(super) chunks: Dispatch,
    pub(super) radix: Vec<Dispatch>,
    pub(super) kept: Dispatch,
    pub(super) merge: Dispatch,
}

impl SampleDispatches {
    /// The dispatches a step whose rows sample with `samplers` records, in order.
    pub(super) fn for_samplers<'a>(&'a self, samplers: &[Sampler], vocab: usize) -> Vec<&'a Dispatch> {
        let Some(split) = &self.split else { return vec![&self.whole] };
        let mut out = vec![&split.chunks];
        let (k, p) = split.radix.split_at(split.radix.len() / 2);
        if samplers.iter().any(|s| s.has_top_k(vocab)) {
            out.extend(k);
        }
        if samplers.iter().any(|s| s.has_top_p()) {
            out.extend(p);
        }
        if samplers.iter().any(|s| s.truncates(vocab)) {
            out.push(&split.kept);
        }
        out.push(&split.merge);
        out
    }
}
