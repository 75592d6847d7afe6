//! The typed constants of a mixture of experts' kernels: the router's top-k (`moe.wgsl`) and the
//! routed experts' products (`matmul_experts.wgsl`).

use super::{Overrides, Product, Specialize, Work};
use crate::gpu::shaders::{Constants, Kernel};

/// Where a MoE layer's routes live: each token's entries of the routes and their weights hold
/// every MoE layer's `top_k` in turn.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RouteSlots {
    pub experts: usize,
    pub top_k: usize,
    /// Entries per token: MoE layers x top_k.
    pub stride: usize,
    /// This layer's first entry.
    pub offset: usize,
}

impl RouteSlots {
    fn add(self, o: Overrides) -> Overrides {
        o.count("EXPERTS", self.experts)
            .count("TOP_K", self.top_k)
            .count("ROUTE_STRIDE", self.stride)
            .count("ROUTE_OFFSET", self.offset)
    }
}

/// `moe.wgsl`: each token's top-k experts from its router logits, and their weights.
pub(crate) struct MoeRoute {
    pub slots: RouteSlots,
    pub norm_topk: bool,
    /// Keep real tokens' routes in the route log of this many positions per row.
    pub log_max_len: Option<usize>,
}

impl Specialize for MoeRoute {
    fn kernel(&self) -> Kernel {
        Kernel::MoeRoute
    }
    fn constants(&self) -> Constants {
        let o = self.slots.add(Overrides::default()).flag("NORM_TOPK", self.norm_topk);
        match self.log_max_len {
            Some(n) => o.flag("LOG", true).count("MAX_LEN", n).0,
            None => o.0,
        }
    }
    fn label(&self) -> String {
        let norm = if self.norm_topk { "_norm" } else { "" };
        let log = if self.log_max_len.is_some() { "_log" } else { "" };
        format!("moe_route_top{}{norm}{log}", self.slots.top_k)
    }
    /// A thread per token: the softmax over the experts, then one pass over them per slot.
    fn work(&self) -> Work {
        let (e, k) = (self.slots.experts, self.slots.top_k);
        Work::flat(e * (2 + k), 4 * e + 8 * k)
    }
}

/// `matmul_experts.wgsl`: the routed experts' products of a MoE layer (`product`'s kernel is
/// [`Kernel::MatmulExperts`], its `out_rows` one expert's rows, its lanes the threads' outputs):
/// a workgroup per (expert, output tile, block of `token_block` tokens) runs the (token, slot)
/// pairs routed to its expert, four at a time, into one row per pair; with `sum_slots` instead
/// (no weights) each token's pairs' rows summed by the routes' weights.
pub(crate) struct ExpertProduct {
    pub product: Product,
    pub slots: RouteSlots,
    pub sum_slots: bool,
    /// The input row of a pair is its own (the experts' MLP out), not its token's (their MLP in).
    pub x_per_slot: bool,
    /// Tokens a workgroup walks for its expert's pairs.
    pub token_block: usize,
    /// Add the shared expert's output, weighed by the sigmoid of its gate (with `sum_slots`).
    pub shared: bool,
}

impl Specialize for ExpertProduct {
    fn kernel(&self) -> Kernel {
        Kernel::MatmulExperts
    }
    fn constants(&self) -> Constants {
        let mut o = Overrides(self.product.constants());
        o = self.slots.add(o).flag("SUM_SLOTS", self.sum_slots).flag("SHARED", self.shared);
        o = o.flag("X_PER_SLOT", self.x_per_slot).count("TOKEN_BLOCK", self.token_block);
        o.0
    }
    fn label(&self) -> String {
        let what = match (self.sum_slots, self.x_per_slot) {
            (true, _) => "sum",
            (false, true) => "out",
            (false, false) => "in",
        };
        let shared = if self.shared { "_shared" } else { "" };
        format!("{}_experts_{what}_top{}{shared}", self.product.label(), self.slots.top_k)
    }
    fn workgroup_size(&self) -> u32 {
        self.product.workgroup_size()
    }
    /// The pairs: a thread walks its token block's routes twice (at most `token_block` tokens: the
    /// experts they picked, then its own expert's pairs) and sums
    /// its outputs' weight rows for one call of four pairs (a step of at most four tokens on one
    /// expert; more tokens on one expert run more calls). The sum: a thread per (token, output) walks the token's slots.
    /// Only routed experts' weights are read, each once per call.
    fn work(&self) -> Work {
        let p = &self.product;
        let k = self.slots.top_k;
        if self.sum_slots {
            let shared = if self.shared { 4 * p.out_rows + 4 } else { 0 };
            return Work::flat(k, 4 * (k + 1) * p.out_rows + 8 * k + shared);
        }
        let gated = if p.act.is_none_or(|a| a == crate::model::config::MlpKind::ReluSquared) { 1 } else { 2 };
        let outs = match p.lanes {
            super::Lanes::Threads { outs, .. } => outs,
            _ => 1,
        };
        let weights = (k * gated * p.out_rows) as u64 * p.format.row_bytes(p.k);
        Work {
            token_bytes: weights + (4 * k * (p.k + p.out_rows) + 8 * k) as u64,
            ..Work::flat(gated * outs * p.k / 4 + 2 * self.token_block * k, 0)
        }
    }
}
