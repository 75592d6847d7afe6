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
/// [`Kernel::MatmulExperts`], its `out_rows` one expert's rows); `sum_slots`: the experts' MLP
/// out, summed into one row per token by the routes' weights.
pub(crate) struct ExpertProduct {
    pub product: Product,
    pub slots: RouteSlots,
    pub sum_slots: bool,
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
        o.0
    }
    fn label(&self) -> String {
        let what = if self.sum_slots { "out" } else { "in" };
        let shared = if self.shared { "_shared" } else { "" };
        format!("{}_experts_{what}_top{}{shared}", self.product.label(), self.slots.top_k)
    }
    /// A thread per (token, output) sums its output row of each of the token's experts; the
    /// weights read are the token's experts' (at most all of them, shared by the tokens).
    fn work(&self) -> Work {
        let p = &self.product;
        let gated =
            if self.sum_slots || p.act.is_none_or(|a| a == crate::model::config::MlpKind::ReluSquared) { 1 } else { 2 };
        let k = self.slots.top_k;
        let weights = (k * gated * p.out_rows) as u64 * p.format.row_bytes(p.k);
        Work { token_bytes: weights + (4 * k * (p.k + p.out_rows)) as u64, ..Work::flat(k * gated * p.k / 4, 0) }
    }
}
