//! Kernel variants, picked per adapter: which attention kernel, which product kernel, and which
//! neighbouring kernels run fused. Every variant keeps a row's results independent of the batch
//! and the chunking; they differ from one another in summation order (or, for the integer-dot
//! products, in rounding), so compare runs made with the same variants.

use crate::error::{Error, Result};
use crate::gpu::device::Gpu;

/// Kernels fused into their neighbours, each saving a dispatch per layer and step. On the
/// portable kernels fused and unfused runs give the same bits; the subgroup products sum a fused
/// norm in their own order (exact all the same: nothing depends on the batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fusion {
    /// A block's input RMS norm computed inside the products that read it.
    pub norm: bool,
    /// The MLP activation as the up projection's epilogue (where its matrix is one part).
    pub act: bool,
    /// The global K/V write done by RoPE (where the group's cache is one shard).
    pub kv_write: bool,
    /// RoPE (and its K/V write) done by split-group attention in steps of one token a row, on
    /// layers without qk-norm or local keys: a dispatch a layer fewer when decoding.
    pub rope: bool,
}

impl Fusion {
    /// Every fusion.
    pub const ALL: Fusion = Fusion { norm: true, act: true, kv_write: true, rope: true };
    /// None: every kernel its own dispatch.
    pub const NONE: Fusion = Fusion { norm: false, act: false, kv_write: false, rope: false };

    /// The default for an adapter and the product kernel that will run there: everything on
    /// GPUs, where each dispatch costs microseconds of launch and a kernel's work is small. On
    /// adapters that are really the CPU (lavapipe, llvmpipe, SwiftShader), where workgroup
    /// barriers are expensive, the norm fuses only into the `wide-subgroup` products of 8-lane
    /// subgroups, which sum it through shuffles without barriers (about as fast as its own
    /// dispatch on lavapipe, and 2 dispatches a layer fewer); the rest fuses everywhere.
    pub fn auto(info: &wgpu::AdapterInfo, matmul: MatmulKernel) -> Fusion {
        match info.device_type {
            wgpu::DeviceType::Cpu => {
                Fusion { norm: matmul == MatmulKernel::WideSubgroup && info.subgroup_min_size == 8, ..Fusion::ALL }
            }
            _ => Fusion::ALL,
        }
    }

    /// What `KVDECODE_FUSE` would say for it: `all`, `none`, or the list (`act,kv-write`).
    pub fn name(self) -> String {
        match self {
            Fusion::ALL => "all".into(),
            Fusion::NONE => "none".into(),
            f => [(f.norm, "norm"), (f.act, "act"), (f.kv_write, "kv-write"), (f.rope, "rope")]
                .iter()
                .filter(|(on, _)| *on)
                .map(|(_, n)| *n)
                .collect::<Vec<_>>()
                .join(","),
        }
    }

    /// The `KVDECODE_FUSE` environment variable, [`Fusion::parse`]d (unset: `None`).
    pub fn from_env() -> Result<Option<Fusion>> {
        std::env::var("KVDECODE_FUSE").map_or(Ok(None), |v| Fusion::parse(&v))
    }

    /// `all`, `none`, `auto` (`None`: the adapter's default), or a comma list of `norm`, `act`,
    /// `kv-write`, `rope`.
    pub fn parse(v: &str) -> Result<Option<Fusion>> {
        match v {
            "" | "auto" => return Ok(None),
            "all" => return Ok(Some(Fusion::ALL)),
            "none" => return Ok(Some(Fusion::NONE)),
            _ => {}
        }
        let mut f = Fusion::NONE;
        for part in v.split(',') {
            match part.trim() {
                "norm" => f.norm = true,
                "act" => f.act = true,
                "kv-write" => f.kv_write = true,
                "rope" => f.rope = true,
                other => {
                    return Err(Error::Config(format!(
                        "KVDECODE_FUSE={v:?}: {other:?} is not one of all, none, auto, norm, act, kv-write, rope"
                    )))
                }
            }
        }
        Ok(Some(f))
    }
}

/// The attention kernel family's variants. Each is exact on its own terms (a row's result never
/// depends on the batch or the chunking), but they sum in different orders, so their logits
/// differ in the last bits: compare runs made with the same variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Picked per adapter: [`AttentionKernel::SplitHead`] on adapters that are really the CPU
    /// (lavapipe, llvmpipe, SwiftShader), [`AttentionKernel::SplitGroup`] on GPUs where the model
    /// allows it, else serial.
    Auto,
    /// One thread per (token, query head) walks every key in order: the portable variant.
    Serial,
    /// Split along the keys (flash-decoding) into partitions of fixed positions merged in
    /// position order; one workgroup per (partition, kv head) scores a tile of keys for all the
    /// query heads of the kv head at once (K/V read once per group, V coalesced). Steps of
    /// [`QUERY_TILE_MIN_WIDTH`] tokens a row or more take query tiles: one workgroup folds a
    /// partition for several tokens of a row at once (each key read once per tile), with the
    /// same bits. Needs at most 16 query heads per kv head and `heads per kv head x head_dim` at
    /// most 1024.
    SplitGroup,
    /// The same partitions, one thread per (partition, query head) walking its keys alone: no
    /// workgroup memory or barriers, the shape that suits CPU adapters' SIMD lanes.
    SplitHead,
}

impl AttentionKernel {
    /// Every variant but `Auto`.
    pub const ALL: [AttentionKernel; 3] =
        [AttentionKernel::Serial, AttentionKernel::SplitGroup, AttentionKernel::SplitHead];

    /// Whether it is one of the split variants.
    pub fn is_split(self) -> bool {
        matches!(self, AttentionKernel::SplitGroup | AttentionKernel::SplitHead)
    }

    /// The variant the environment asks for (see [`crate::EngineOptions::attention`]).
    pub fn from_env() -> Self {
        match std::env::var("KVDECODE_ATTENTION").as_deref() {
            Ok("serial") => AttentionKernel::Serial,
            Ok("auto") => AttentionKernel::Auto,
            Ok("split-group") => AttentionKernel::SplitGroup,
            Ok("split-head") => AttentionKernel::SplitHead,
            _ if std::env::var("KVDECODE_PORTABLE").is_ok_and(|v| v == "1") => AttentionKernel::Serial,
            _ => AttentionKernel::Auto,
        }
    }

    /// Its name, as `KVDECODE_ATTENTION` spells it.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Auto => "auto",
            AttentionKernel::Serial => "serial",
            AttentionKernel::SplitGroup => "split-group",
            AttentionKernel::SplitHead => "split-head",
        }
    }
}

/// Whether rows that truncate nothing sample on the split path (`sample.wgsl`'s `chunks` and
/// `merge`, a workgroup per chunk of the vocabulary) rather than one workgroup a row: the
/// `KVDECODE_SAMPLING` environment variable, `split`, `whole` or `auto` (unset or `auto`:
/// `None`, the adapter's default, [`split_sampling_auto`]).
pub fn split_sampling_from_env() -> Result<Option<bool>> {
    match std::env::var("KVDECODE_SAMPLING").as_deref() {
        Err(_) | Ok("auto") => Ok(None),
        Ok("split") => Ok(Some(true)),
        Ok("whole") => Ok(Some(false)),
        Ok(v) => Err(Error::Config(format!("KVDECODE_SAMPLING={v:?}: expected split, whole or auto"))),
    }
}

/// The split sampling path by default on GPUs, where one workgroup walking the vocabulary leaves
/// the rest idle; not on adapters that are really the CPU, where each chunk's workgroup barriers
/// cost more than the passes they spread (lavapipe, SmolLM2's 49,152 logits, greedy: 13 ms a step
/// for the chunks against 0.9 to 1.5 ms for one workgroup a row; 207 to 276 ms against 6 at 16
/// rows).
pub fn split_sampling_auto(info: &wgpu::AdapterInfo) -> bool {
    info.device_type != wgpu::DeviceType::Cpu
}

/// Tokens a row from which split-group attention takes query tiles (`query_tiles` in
/// attention_split.wgsl) instead of one workgroup per token: from two on, a tile reads each key
/// once for all its tokens. (Reasoned, not measured on a GPU: none was at hand.)
pub const QUERY_TILE_MIN_WIDTH: usize = 2;

/// Tokens from which a product of the `tiled` variant takes the mat-mat kernel: half a tile, where
/// reading each weight once per 32 tokens instead of once per 4 already outweighs the idle lanes.
/// (Reasoned, not measured on a GPU: none was at hand.)
pub const TILED_MIN_TOKENS: usize = 16;

/// The product kernel family's variants (every `x W^T` of the model: projections, MLP, LM head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulKernel {
    /// Picked per adapter: on adapters that are really the CPU (lavapipe, llvmpipe, SwiftShader)
    /// [`MatmulKernel::WideSubgroup`] where the device has subgroups of 8 lanes or more, else
    /// [`MatmulKernel::Wide`]; on GPUs [`MatmulKernel::Subgroup`] where the device has subgroups of
    /// a fixed size, else [`MatmulKernel::Workgroup`]. Never the integer-dot variant, whose
    /// rounding is not the reference's.
    Auto,
    /// One thread per output and 4 tokens (one in steps of fewer than 4 tokens), each summing its
    /// weight row in order: the reference of the GPU kernels, needs no optional feature.
    Portable,
    /// The portable kernel with 8 neighbouring outputs per thread, so each input load feeds 8
    /// products (CPU adapters, where every per-lane load is a gather). The same sums in the same
    /// order: the portable kernel's bits.
    Wide,
    /// `Wide` with each block of 32 inputs loaded once per subgroup and passed around by
    /// `subgroupShuffle` (Q8_0, Q4_0, Q4_1 weights; other formats as `Wide`). The portable bits.
    /// Needs the device's `subgroups` feature with at least 8 lanes.
    WideSubgroup,
    /// The portable kernel for steps of fewer than [`TILED_MIN_TOKENS`] tokens, and for larger
    /// ones (prefill, big batches) a mat-mat kernel: tiles of 32 tokens x 32 weight rows staged in
    /// workgroup memory, each thread a 4 x 4 register block, so a weight is read once per 32
    /// tokens. Every sum in the portable order: the portable bits, whichever kernel a step takes.
    Tiled,
    /// One subgroup per output and 4 tokens: the lanes read neighbouring weights and
    /// `subgroupAdd` sums them. Needs the device's `subgroups` feature.
    Subgroup,
    /// `Subgroup`'s shape without subgroups: one workgroup of 64 lanes per output and 4 tokens,
    /// the lanes reading neighbouring weights, their sums meeting in one fixed tree in workgroup
    /// memory. Its own order (not the portable bits), the same for every batch and chunking.
    Workgroup,
    /// Q8_0, Q4_0 and Q4_1 weights stay integers and meet activations quantized per block of 32
    /// to int8 in `dot4I8Packed` (llama.cpp's scheme); other formats take the `Auto` kernel.
    /// One thread per output and 4 tokens.
    /// Opt-in: rounding the activations costs accuracy like llama.cpp's (about 1e-2 of the
    /// logits' scale), though a row still never depends on the batch or the chunking.
    IntDot,
}

impl MatmulKernel {
    /// Every variant but `Auto`.
    pub const ALL: [MatmulKernel; 7] = [
        MatmulKernel::Portable,
        MatmulKernel::Wide,
        MatmulKernel::WideSubgroup,
        MatmulKernel::Tiled,
        MatmulKernel::Subgroup,
        MatmulKernel::Workgroup,
        MatmulKernel::IntDot,
    ];

    /// Its name, as `KVDECODE_MATMUL` spells it.
    pub fn name(self) -> &'static str {
        match self {
            MatmulKernel::Auto => "auto",
            MatmulKernel::Portable => "portable",
            MatmulKernel::Wide => "wide",
            MatmulKernel::WideSubgroup => "wide-subgroup",
            MatmulKernel::Tiled => "tiled",
            MatmulKernel::Subgroup => "subgroup",
            MatmulKernel::Workgroup => "workgroup",
            MatmulKernel::IntDot => "int-dot",
        }
    }

    /// `auto`, `portable`, `wide`, `wide-subgroup`, `tiled`, `subgroup`, `workgroup` or `int-dot`.
    pub fn parse(v: &str) -> Result<MatmulKernel> {
        std::iter::once(MatmulKernel::Auto).chain(MatmulKernel::ALL).find(|k| k.name() == v).ok_or_else(|| {
            Error::Config(format!(
                "KVDECODE_MATMUL={v:?}: expected auto, portable, wide, wide-subgroup, tiled, subgroup, workgroup or \
                 int-dot"
            ))
        })
    }

    /// The `KVDECODE_MATMUL` environment variable, parsed; unset: `Portable` when
    /// `KVDECODE_PORTABLE=1`, else `Auto`.
    pub fn from_env() -> Result<MatmulKernel> {
        match std::env::var("KVDECODE_MATMUL") {
            Ok(v) => MatmulKernel::parse(&v),
            Err(_) if std::env::var("KVDECODE_PORTABLE").is_ok_and(|v| v == "1") => Ok(MatmulKernel::Portable),
            Err(_) => Ok(MatmulKernel::Auto),
        }
    }
}

/// The product kernel for `asked` on this device: `Auto` resolved, and a variant the device
/// cannot run refused by name (what [`crate::Engine::matmul_kernel`] will say).
pub fn resolve_matmul(asked: MatmulKernel, gpu: &Gpu) -> Result<MatmulKernel> {
    let sg = gpu.subgroup_size();
    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
    match asked {
        MatmulKernel::Auto if cpu && sg.is_some_and(|n| n >= 8) => Ok(MatmulKernel::WideSubgroup),
        MatmulKernel::Auto if cpu => Ok(MatmulKernel::Wide),
        MatmulKernel::Auto if sg.is_some() => Ok(MatmulKernel::Subgroup),
        MatmulKernel::Auto => Ok(MatmulKernel::Workgroup),
        MatmulKernel::Subgroup if sg.is_none() => Err(Error::Config(format!(
            "matmul: the subgroup kernel needs subgroups of one fixed size, which {} does not offer here \
             (or the device was made portable: GpuOptions::portable / KVDECODE_PORTABLE=1, or created \
             without wgpu::Features::SUBGROUP)",
            gpu.info.name
        ))),
        MatmulKernel::WideSubgroup if sg.is_none_or(|n| n < 8) => Err(Error::Config(format!(
            "matmul: the wide-subgroup kernel needs subgroups of one fixed size of at least 8 lanes; {} offers {} \
             (or the device was made portable: GpuOptions::portable / KVDECODE_PORTABLE=1, or created \
             without wgpu::Features::SUBGROUP)",
            gpu.info.name,
            sg.map_or("none".to_string(), |n| format!("{n}"))
        ))),
        k => Ok(k),
    }
}

/// Lanes per workgroup of the wide products: 8 on adapters that are really the CPU, where a
/// workgroup of one SIMD vector spreads a small product (SmolLM2's 576 outputs are 72 threads) over
/// the cores evenly (9 workgroups instead of 2: `wide`'s products went 78 -> 70 ms a decode step
/// on lavapipe, 2 cores, when it came in); with subgroups that is one subgroup of exactly 8 lanes.
/// 64 elsewhere.
pub(crate) fn product_wg(kernel: MatmulKernel, gpu: &Gpu) -> u32 {
    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
    match kernel {
        MatmulKernel::Wide if cpu => 8,
        MatmulKernel::WideSubgroup if cpu && gpu.subgroup_size() == Some(8) => 8,
        _ => 64,
    }
}
