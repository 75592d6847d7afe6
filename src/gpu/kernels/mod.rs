//! Typed override constants: one small struct per kernel, holding what its WGSL module's
//! `override` declarations take and a label naming the variant (`kv_write_ring_f16`) that
//! pipelines, dispatches, GPU captures and the profile carry; the pipeline cache keys on them.

pub use crate::gpu::format::WeightFormat;
use crate::gpu::shaders::{Constants, Kernel};
use crate::model::config::MlpKind;

mod attention;
mod engram;
mod lora;
mod moe;
mod sample;
mod work;
pub(crate) use attention::{Attention, AttentionShape, AttentionSplit, FusedRope, KvWrite, QkRope};
pub(crate) use engram::{EngramGather, EngramMix};
pub(crate) use lora::{ax_stride, Lora, LoraEpilogue, LORA_SLICES_GPU};
pub(crate) use moe::{ExpertProduct, MoeRoute, RouteSlots};
pub(crate) use sample::{LogitBias, Sample, SampleStage, RADIX_PASSES, SAMPLE_MAX_PER_THREAD};
pub(crate) use work::{At, Work};

/// A kernel specialized by its override constants.
pub(crate) trait Specialize {
    /// The kernel (WGSL module and entry point).
    fn kernel(&self) -> Kernel;
    /// The override constants in the form pipelines take (bools as 0/1).
    fn constants(&self) -> Constants;
    /// A name for the variant: the kernel and what sets it apart.
    fn label(&self) -> String;
    /// Threads per workgroup the dispatch grid counts with.
    fn workgroup_size(&self) -> u32 {
        self.kernel().workgroup_size()
    }
    /// What a dispatch's threads do: their longest serial path and the bytes moved, for the
    /// occupancy table ([`work`]'s module doc says what an iteration is). It follows the WGSL's loops.
    fn work(&self) -> Work;
}

/// Collects override constants by kind, so no call site writes a float for a count or a flag.
#[derive(Default)]
struct Overrides(Constants);

impl Overrides {
    fn count(mut self, name: &'static str, v: usize) -> Self {
        self.0.push((name, v as f64));
        self
    }
    fn float(mut self, name: &'static str, v: f32) -> Self {
        self.0.push((name, v as f64));
        self
    }
    fn flag(mut self, name: &'static str, v: bool) -> Self {
        self.0.push((name, if v { 1.0 } else { 0.0 }));
        self
    }
    fn code(mut self, name: &'static str, v: u32) -> Self {
        self.0.push((name, v as f64));
        self
    }
}

/// `mlp_act` in common.wgsl names the activations by these codes.
fn act_code(kind: MlpKind) -> u32 {
    match kind {
        MlpKind::ReluSquared => 0,
        MlpKind::SwiGlu => 1,
        MlpKind::GeluTanhGated => 2,
        MlpKind::ClampedSwiGlu => 3,
    }
}

fn act_name(kind: MlpKind) -> &'static str {
    match kind {
        MlpKind::ReluSquared => "relu2",
        MlpKind::SwiGlu => "swiglu",
        MlpKind::GeluTanhGated => "gelu_tanh",
        MlpKind::ClampedSwiGlu => "clamped_swiglu",
    }
}

/// The global K/V pool's addressing: positions per block, block table entries per row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Paging {
    pub block_len: usize,
    pub max_blocks: usize,
}

impl Paging {
    fn add(self, o: Overrides) -> Overrides {
        o.count("BLOCK", self.block_len).count("MAX_BLOCKS", self.max_blocks)
    }
}

/// The cache rows one shard's buffers hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shard {
    pub row0: usize,
    pub rows: usize,
}

impl Shard {
    fn add(self, o: Overrides) -> Overrides {
        o.count("ROW0", self.row0).count("SHARD_ROWS", self.rows)
    }
}

/// `embed.wgsl`: gather one part of the embedding table.
pub(crate) struct Embed {
    pub d: usize,
    pub part_start: usize,
    pub part_rows: usize,
    pub format: WeightFormat,
    pub scale: f32,
}

impl Specialize for Embed {
    fn kernel(&self) -> Kernel {
        Kernel::Embed
    }
    fn constants(&self) -> Constants {
        Overrides::default()
            .count("D", self.d)
            .count("PART_START", self.part_start)
            .count("PART_ROWS", self.part_rows)
            .code("W_FORMAT", self.format.code())
            .float("EMBED_SCALE", self.scale)
            .0
    }
    fn label(&self) -> String {
        format!("embed_{}", self.format.name())
    }
    /// A thread per 4 features of a token: one table row read, one written.
    fn work(&self) -> Work {
        let row = self.format.row_bytes(self.d) as usize;
        Work::flat(4, 4 + row + 4 * self.d)
    }
}

/// `rmsnorm.wgsl`: `out (+)= norm(x) [* w]` per token, or at each row's last token.
pub(crate) struct RmsNorm {
    pub d: usize,
    pub eps: f32,
    pub weight: bool,
    pub accumulate: bool,
    /// Also write the output quantized for the integer-dot products.
    pub quantize: bool,
    /// Norm only each row's last real token, into one row per chunk row (the final norm).
    pub gather_last: bool,
    /// Lanes of the workgroup that norms a row: 64, or [`FINAL_NORM_LANES`] for the final norm.
    pub lanes: u32,
}

/// Lanes of the final norm before the LM head, in both its forms (a row's last token, every
/// token): at one row it is the step's only workgroup, so it spreads wider than a layer's norms.
pub(crate) const FINAL_NORM_LANES: u32 = 256;

impl Specialize for RmsNorm {
    fn kernel(&self) -> Kernel {
        Kernel::RmsNorm
    }
    fn constants(&self) -> Constants {
        Overrides::default()
            .count("D", self.d)
            .float("EPS", self.eps)
            .flag("HAS_WEIGHT", self.weight)
            .flag("ACCUMULATE", self.accumulate)
            .flag("QUANTIZE", self.quantize)
            .flag("GATHER_LAST", self.gather_last)
            .code("WG", self.lanes)
            .0
    }
    fn workgroup_size(&self) -> u32 {
        self.lanes
    }
    fn label(&self) -> String {
        let mut l = "rmsnorm".to_string();
        for (on, s) in [(self.gather_last, "_last"), (self.accumulate, "_add"), (self.quantize, "_quantize")] {
            if on {
                l.push_str(s);
            }
        }
        if self.lanes != Kernel::RmsNorm.workgroup_size() {
            l.push_str(&format!("_{}", self.lanes));
        }
        l
    }
    /// A workgroup per token: each lane sums and scales its share of the features, with one
    /// tree reduction between.
    fn work(&self) -> Work {
        let lanes = self.lanes as usize;
        let reads = if self.accumulate { 3 } else { 2 };
        Work {
            fixed_bytes: if self.weight { 4 * self.d as u64 } else { 0 },
            per_row: self.gather_last,
            ..Work::flat(2 * self.d.div_ceil(lanes) + work::levels(lanes), reads * 4 * self.d)
        }
    }
}

/// How a product kernel's lanes are set: the portable and wide shapes' outputs per thread and
/// workgroup size, the subgroup kernel's subgroup, or the kernel's own fixed shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lanes {
    /// The kernel's fixed shape (tiled, workgroup-reduced, one output per thread normed).
    Fixed,
    /// `OUTS` outputs per thread in workgroups of `WG`.
    Threads { outs: usize, wg: u32 },
    /// One subgroup of `SG` lanes per workgroup.
    Subgroup(u32),
}

/// The fused RMS norm of a product's input.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedNorm {
    pub weight: bool,
    pub eps: f32,
}

/// `matmul.wgsl` and its variants: `y[n, OUT_OFFSET + o] (+)= x[n, ..K] . W[o]` against one
/// weight part, with the fused epilogues and prologue a product can take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    pub kernel: Kernel,
    pub k: usize,
    pub x_stride: usize,
    pub out_rows: usize,
    pub out_stride: usize,
    pub out_offset: usize,
    pub format: WeightFormat,
    pub accumulate: bool,
    pub softcap: f32,
    pub per_row: bool,
    pub norm: Option<FusedNorm>,
    pub act: Option<MlpKind>,
    /// Add the part's bias (binding 5).
    pub bias: bool,
    pub lanes: Lanes,
    /// Add the LoRA adapters (bindings 6 and 7).
    pub lora: Option<LoraEpilogue>,
}

impl Specialize for Product {
    fn kernel(&self) -> Kernel {
        self.kernel
    }
    fn constants(&self) -> Constants {
        let mut o = Overrides::default()
            .count("K", self.k)
            .count("X_STRIDE", self.x_stride)
            .count("O_ROWS", self.out_rows)
            .count("OUT_STRIDE", self.out_stride)
            .count("OUT_OFFSET", self.out_offset)
            .code("W_FORMAT", self.format.code())
            .flag("ACCUMULATE", self.accumulate)
            .float("SOFTCAP", self.softcap)
            .flag("PER_ROW", self.per_row)
            .flag("BIAS", self.bias);
        if let Some(n) = self.norm {
            o = o.flag("NORM", true).flag("NORM_WEIGHT", n.weight).float("EPS", n.eps);
        }
        if let Some(act) = self.act {
            // 0 is "no activation"
            o = o.code("MLP_ACT", act_code(act) + 1);
        }
        if let Some(lora) = self.lora {
            o = lora.overrides(o);
        }
        match self.lanes {
            Lanes::Fixed => {}
            Lanes::Threads { outs, wg } => o = o.count("OUTS", outs).code("WG", wg),
            Lanes::Subgroup(sg) => o = o.code("SG", sg),
        }
        o.0
    }
    fn label(&self) -> String {
        let variant = match (self.kernel, self.lanes) {
            (Kernel::MatmulWide, _) => "matmul_wide",
            (Kernel::Matmul, _) => "matmul",
            (Kernel::MatmulNormed, _) => "matmul",
            (Kernel::MatmulSubgroup, _) => "matmul_subgroup",
            (Kernel::MatmulWideSubgroup, _) => "matmul_wide_subgroup",
            (Kernel::MatmulTiled, _) => "matmul_tiled",
            (Kernel::MatmulReduce, _) => "matmul_workgroup",
            (Kernel::MatmulInt, _) => "matmul_int",
            (Kernel::MatmulExperts, _) => "matmul",
            _ => "product",
        };
        let mut l = format!("{variant}_{}", self.format.name());
        if self.norm.is_some() {
            l.push_str("_normed");
        }
        if let Some(act) = self.act {
            l.push('_');
            l.push_str(act_name(act));
        }
        if self.bias {
            l.push_str("_bias");
        }
        if self.accumulate {
            l.push_str("_add");
        }
        if self.softcap > 0.0 {
            l.push_str("_softcap");
        }
        if self.per_row {
            l.push_str("_rows");
        }
        if self.lora.is_some() {
            l.push_str("_lora");
        }
        l
    }
    fn workgroup_size(&self) -> u32 {
        match self.lanes {
            Lanes::Threads { wg, .. } => wg,
            Lanes::Subgroup(sg) => sg,
            Lanes::Fixed => self.kernel.workgroup_size(),
        }
    }
    /// Iterations are weight vec4s (a thread's up to 4 tokens ride in one vec4 of sums): the
    /// weight rows a thread sums alone, times K / 4, or its lanes' share of one row and the
    /// reduction.
    fn work(&self) -> Work {
        let gated = if self.act.is_some_and(|a| a != MlpKind::ReluSquared) { 2 } else { 1 };
        let k4 = self.k / 4;
        let wg = self.workgroup_size() as usize;
        let norm = if self.norm.is_some() { self.k.div_ceil(wg) + work::levels(wg) } else { 0 };
        let iters = match (self.kernel, self.lanes) {
            (Kernel::MatmulSubgroup, _) => gated * k4.div_ceil(wg) + work::levels(wg) + norm,
            (Kernel::MatmulReduce, _) => gated * k4.div_ceil(wg) + work::levels(wg),
            // a 4 x 4 register block: 4 weight rows, the tokens riding in the vec4s
            (Kernel::MatmulTiled, _) => 4 * k4 + norm,
            (_, Lanes::Threads { outs, .. }) => gated * outs * k4 + norm,
            _ => gated * k4 + norm,
        };
        let rows = (gated * self.out_rows) as u64;
        let bias = if self.bias { 4 * self.out_rows as u64 } else { 0 };
        let norm_w = if self.norm.is_some_and(|n| n.weight) { 4 * self.k as u64 } else { 0 };
        let writes = if self.accumulate { 2 } else { 1 };
        // the adapters' epilogue: per output row of a thread and token (4 at most, one at a
        // time), a B row against A x
        let (lora_iters, lora_bytes) = self.lora.map_or((0, 0), |l| l.work());
        let outs = match self.lanes {
            Lanes::Threads { outs, .. } if self.kernel != Kernel::MatmulTiled => outs,
            _ => 1,
        };
        Work {
            fixed_bytes: rows * self.format.row_bytes(self.k) + bias + norm_w,
            per_row: self.per_row,
            ..Work::flat(
                iters + gated * outs * 4 * lora_iters,
                4 * self.k + writes * 4 * self.out_rows + rows as usize * lora_bytes as usize,
            )
        }
    }
}

impl Product {
    /// The same product with the mat-mat kernel (`tiled`): one shape, so no lane constants.
    pub(crate) fn tiled(self) -> Product {
        Product { kernel: Kernel::MatmulTiled, lanes: Lanes::Fixed, ..self }
    }
}

/// `quantize.wgsl`: the first `k` features of each token (or row) quantized per block of 32.
pub(crate) struct Quantize {
    pub k: usize,
    pub x_stride: usize,
    pub per_row: bool,
}

impl Specialize for Quantize {
    fn kernel(&self) -> Kernel {
        Kernel::Quantize
    }
    fn constants(&self) -> Constants {
        Overrides::default().count("K", self.k).count("X_STRIDE", self.x_stride).flag("PER_ROW", self.per_row).0
    }
    fn label(&self) -> String {
        if self.per_row { "quantize_rows" } else { "quantize" }.into()
    }
    /// A thread per block of 32: 8 vec4s in, 9 words out.
    fn work(&self) -> Work {
        Work { per_row: self.per_row, ..Work::flat(8, 4 * self.k + 36 * self.k / 32) }
    }
}

/// `mlp_act.wgsl`: the MLP activation as a dispatch of its own.
pub(crate) struct MlpAct {
    pub ffn: usize,
    pub act: MlpKind,
}

impl Specialize for MlpAct {
    fn kernel(&self) -> Kernel {
        Kernel::MlpAct
    }
    fn constants(&self) -> Constants {
        Overrides::default().count("F", self.ffn).code("ACT", act_code(self.act)).0
    }
    fn label(&self) -> String {
        format!("mlp_act_{}", act_name(self.act))
    }
    /// A thread per feature: gate and up in, one out.
    fn work(&self) -> Work {
        Work::flat(1, 12 * self.ffn)
    }
}

/// `commit.wgsl`: lens, ring positions and token history at the end of a chunk.
pub(crate) struct Commit {
    pub max_len: usize,
    pub ring_slots: usize,
    pub has_ring: bool,
}

impl Specialize for Commit {
    fn kernel(&self) -> Kernel {
        Kernel::Commit
    }
    fn constants(&self) -> Constants {
        Overrides::default()
            .count("MAX_LEN", self.max_len)
            .count("RING", self.ring_slots)
            .flag("HAS_RING", self.has_ring)
            .0
    }
    fn label(&self) -> String {
        "commit".into()
    }
    /// A thread per token: its id into the history, its row's length and ring position.
    fn work(&self) -> Work {
        Work::flat(1, 16)
    }
}

/// `copy.wgsl`: `n4` vec4s copied, the bench's bandwidth yardstick (native only).
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
pub(crate) struct Copy {
    pub n4: usize,
}

impl Specialize for Copy {
    fn kernel(&self) -> Kernel {
        Kernel::Copy
    }
    fn constants(&self) -> Constants {
        Overrides::default().count("N4", self.n4).0
    }
    fn label(&self) -> String {
        "copy".into()
    }
    fn work(&self) -> Work {
        Work { fixed_bytes: 32 * self.n4 as u64, ..Work::flat(1, 0) }
    }
}

#[cfg(test)]
mod tests;
