//! Engram's kernels (the TinyAgent's n-gram memory): the table gather and the gated residual.

use super::{Overrides, Specialize, Work};
use crate::gpu::shaders::{Constants, Kernel};

/// `engram_gather.wgsl`: n-gram addresses from the token history and their table rows.
pub(crate) struct EngramGather {
    pub heads: usize,
    pub orders: usize,
    pub table_rows: usize,
    pub dim: usize,
    pub max_len: usize,
}

impl Specialize for EngramGather {
    fn kernel(&self) -> Kernel {
        Kernel::EngramGather
    }
    fn constants(&self) -> Constants {
        Overrides::default()
            .count("HEADS", self.heads)
            .count("N_ORDERS", self.orders)
            .count("TABLE_ROWS", self.table_rows)
            .count("DIM", self.dim)
            .count("MAX_LEN", self.max_len)
            .0
    }
    fn label(&self) -> String {
        "engram_gather".into()
    }
    /// A thread per (token, head, order): the n-gram's tokens hashed, its table row gathered.
    fn work(&self) -> Work {
        Work::flat(self.orders + self.dim / 4, 4 * self.heads * self.orders * (self.dim + self.orders))
    }
}

/// `engram_mix.wgsl`: the Engram gated residual.
pub(crate) struct EngramMix {
    pub d: usize,
    pub eps: f32,
}

impl Specialize for EngramMix {
    fn kernel(&self) -> Kernel {
        Kernel::EngramMix
    }
    fn constants(&self) -> Constants {
        Overrides::default().count("D", self.d).float("EPS", self.eps).0
    }
    fn label(&self) -> String {
        "engram_mix".into()
    }
    /// A thread per token walks its features twice (the gate's dot product, then the mix).
    fn work(&self) -> Work {
        Work::flat(2 * self.d, 16 * self.d)
    }
}
