//! The decode step: one model, one cache, every GPU object built once, and `append`, which feeds
//! right-padded chunks of new tokens per row and returns logits (or sampled ids) at each row's
//! last real token. Each chunk is one command encoder, one compute pass, one submit.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cache::{CacheOptions, KvCache, KvDtype, RowOwner};
use crate::config::{MlpKind, ModelConfig};
pub use crate::decode::{Turn, TurnLimit};
use crate::device::Gpu;
use crate::error::{Error, Result};
use crate::gpu_weights::{GpuLayer, GpuMatrix, GpuWeights, QkvWeights, WeightDtype};
use crate::reference::rope_table;
use crate::sampling::{RowSampling, Sampled, Sampler, SamplerGpu, TOP_LOGPROBS_MAX};
use crate::shaders::{Constants, Kernel, Pipelines};
pub use crate::variants::{AttentionKernel, Fusion, MatmulKernel, QUERY_TILE_MIN_WIDTH, TILED_MIN_TOKENS};
use crate::weights::ModelWeights;

/// Most new tokens per row processed in one chunk (bounds activation memory during prefill,
/// like the seed's CHUNK). Longer appends are split into several chunks, one submit each.
pub const CHUNK: usize = 64;

/// How to build an [`Engine`].
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Cache rows (sequences decoded side by side).
    pub rows: usize,
    /// Capacity of each row, in tokens.
    pub max_len: usize,
    /// K/V storage type.
    pub kv: KvDtype,
    /// Weight storage type on the GPU.
    pub weights: WeightDtype,
    /// Tokens a row can roll back exactly (spare ring slots). It bounds the multi-step decode
    /// window (`rollback + 1` steps per readback) and speculative drafts (`rollback` tokens).
    pub rollback: usize,
    /// Tokens (rows x width) for which [`Engine::append_all_logits`] can return logits at once.
    pub all_logits_tokens: usize,
    /// Allow `max_len` beyond the model's trained context ([`ModelConfig::context_len`]). Off by
    /// default: positions the model never saw in training give output that only looks right.
    pub beyond_trained_context: bool,
    /// Logit bias entries each row can hold ([`Engine::set_logit_bias`]; penalties add one per
    /// distinct generated token).
    pub logit_bias_slots: usize,
    /// Which attention kernel to build. Defaults to the `KVDECODE_ATTENTION` environment variable
    /// (`serial`, `split-group` or `split-head`), else [`AttentionKernel::Serial`] when `KVDECODE_PORTABLE=1`, else
    /// [`AttentionKernel::Auto`].
    pub attention: AttentionKernel,
    /// Positions per block of the global K/V pool (a power of two; 16 by default). Smaller
    /// blocks waste less of a row's last block and share forks' prefixes more finely.
    pub block_len: usize,
    /// Blocks in the global K/V pool, shared by all rows; `None` (the default): enough for every
    /// row to reach `max_len` at once. A smaller pool holds more rows than it could fill at
    /// once: an append that finds too few free blocks is an [`Error::OutOfBlocks`] (the
    /// scheduler preempts rows instead).
    pub pool_blocks: Option<usize>,
    /// The pool's size in bytes instead of blocks (every global group's K and V): as many
    /// blocks as fit. Give this or `pool_blocks`, not both.
    pub pool_bytes: Option<u64>,
    /// Keep full blocks of global K/V for later sequences that begin with the same tokens (on
    /// by default; see [`Engine::reuse_prefix`]).
    pub prompt_cache: bool,
    /// Which neighbouring kernels run fused into one dispatch; `None` (the default): the
    /// `KVDECODE_FUSE` environment variable ([`Fusion::from_env`]), else [`Fusion::auto`] for
    /// the adapter.
    pub fusion: Option<Fusion>,
    /// Which product kernel to build; `None` (the default): the `KVDECODE_MATMUL` environment
    /// variable ([`MatmulKernel::from_env`]), else [`MatmulKernel::Auto`].
    pub matmul: Option<MatmulKernel>,
}

/// How attention runs in one engine: the variant, and for the split one its partition size and
/// how many tokens one dispatch handles (the partials scratch holds one group of tokens).
#[derive(Clone, Copy, Debug)]
struct AttentionPlan {
    kernel: AttentionKernel,
    /// Keys per tile inside a partition (scores of one tile sit in workgroup memory).
    tile: usize,
    /// Positions per partition (a multiple of `tile`).
    span: usize,
    /// Partitions per query: `ceil(max_len / span)`.
    parts: usize,
    /// Tokens per query tile (split-group's `query_tiles`, steps of several tokens a row); 1: none.
    query_tile: usize,
    /// Tokens per dispatch.
    group_tokens: usize,
    /// Token groups per chunk.
    groups: usize,
}

/// Most bytes of split-attention partials: one group of tokens at a time.
const PARTIALS_BYTES: usize = 16 << 20;

impl AttentionPlan {
    fn new(cfg: &ModelConfig, opts: &EngineOptions, gpu: &Gpu, tokens: usize) -> Result<Self> {
        // a misspelt variant must not quietly become the default
        if let Ok(v) = std::env::var("KVDECODE_ATTENTION") {
            if !["auto", "serial", "split-group", "split-head"].contains(&v.as_str()) {
                return Err(Error::Config(format!(
                    "KVDECODE_ATTENTION={v:?}: expected auto, serial, split-group or split-head"
                )));
            }
        }
        let g = cfg.n_heads / cfg.n_kv_heads;
        let fits = g <= 16 && g * cfg.head_dim <= 1024;
        let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
        let kernel = match opts.attention {
            AttentionKernel::Auto if cpu => AttentionKernel::SplitHead,
            AttentionKernel::Auto if fits => AttentionKernel::SplitGroup,
            AttentionKernel::Auto => AttentionKernel::Serial,
            AttentionKernel::SplitGroup if !fits => {
                return Err(Error::Config(format!(
                    "attention: split-group takes at most 16 query heads per kv head and 1024 for heads per kv head x \
                     head_dim; this model has {g} x {}",
                    cfg.head_dim
                )))
            }
            k => k,
        };
        if !kernel.is_split() || !cfg.layers.iter().any(|l| l.global_group.is_some()) {
            return Ok(AttentionPlan {
                kernel: AttentionKernel::Serial,
                tile: 1,
                span: 1,
                parts: 1,
                query_tile: 1,
                group_tokens: tokens,
                groups: 1,
            });
        }
        // Partitions of 64 positions, so even short contexts spread over many workgroups (split-group)
        // or threads (split-head); split-group folds a partition in tiles of 64 keys, one key per
        // lane (with tiles of 256 each lane walked 256 values alone: on an H200 the 6-layer demo
        // model spent 0.71 ms a step in attention at 512 positions, SmolLM2 5.27 ms). At most 64
        // partitions (longer ones beyond), so the partials stay small and the merge short.
        let tile = 64;
        let mut span = tile;
        while opts.max_len.div_ceil(span) > 64 {
            span *= 2;
        }
        let parts = opts.max_len.div_ceil(span);
        let per_token = cfg.n_heads * parts * (4 + cfg.head_dim) * 4;
        let group_tokens = (PARTIALS_BYTES.min(gpu.max_binding() as usize) / per_token).clamp(1, tokens);
        let query_tile = if kernel == AttentionKernel::SplitGroup { query_tile(g, cfg.head_dim) } else { 1 };
        Ok(AttentionPlan { kernel, tile, span, parts, query_tile, group_tokens, groups: tokens.div_ceil(group_tokens) })
    }
}

/// Tokens per query tile of split-group attention for `g` query heads per kv head of `head_dim`:
/// as many as `query_tiles`' workgroup memory holds (at most 16 tokens, 32 (token, head) pairs,
/// 1536 query floats: 14.5 KiB in all, under WebGPU's default 16 KiB) and its value step's 12
/// pairs per lane allow. 1: the model's heads leave no room for two tokens.
fn query_tile(g: usize, head_dim: usize) -> usize {
    // the value step's lanes hold one element (4 dims) of a value each: at most 64 of them
    if !(4..=256).contains(&head_dim) {
        return 1;
    }
    let lane_groups = 64 / (head_dim / 4);
    let mut qt = 16.min(32 / g).min(1536 / (g * head_dim));
    while qt > 1 && (qt * g).div_ceil(lane_groups) > 12 {
        qt -= 1;
    }
    qt.max(1)
}

impl EngineOptions {
    /// `rows` rows of `max_len` tokens, f32 everywhere.
    pub fn new(rows: usize, max_len: usize) -> Self {
        EngineOptions {
            rows,
            max_len,
            kv: KvDtype::F32,
            weights: WeightDtype::F32,
            rollback: 8,
            all_logits_tokens: 64,
            beyond_trained_context: false,
            logit_bias_slots: 1024,
            attention: AttentionKernel::from_env(),
            block_len: 16,
            pool_blocks: None,
            pool_bytes: None,
            prompt_cache: true,
            fusion: None,
            matmul: None,
        }
    }

    /// The shape of the cache these options build.
    pub fn cache(&self) -> CacheOptions {
        CacheOptions {
            rows: self.rows,
            max_len: self.max_len,
            dtype: self.kv,
            spare: self.rollback,
            block_len: self.block_len,
            pool_blocks: self.pool_blocks,
            pool_bytes: self.pool_bytes,
            prompt_cache: self.prompt_cache,
        }
    }
}

/// Logits at each chunk row's last real token, `[R, vocab]`.
#[derive(Clone, Debug)]
pub struct Logits {
    /// Vocabulary size.
    pub vocab: usize,
    /// Row-major `[R, vocab]`; rows that received no token hold stale values.
    pub data: Vec<f32>,
    /// Whether each row received at least one token in this call.
    pub valid: Vec<bool>,
}

impl Logits {
    /// Logits of chunk row `r`, or `None` if it received no token.
    pub fn row(&self, r: usize) -> Option<&[f32]> {
        self.valid.get(r).copied().unwrap_or(false).then(|| &self.data[r * self.vocab..(r + 1) * self.vocab])
    }
}

/// Counters for the benchmark.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Command buffers submitted.
    pub submits: u64,
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Chunks processed.
    pub chunks: u64,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct StepGpu {
    rows: u32,
    width: u32,
    tokens: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RowInfoGpu {
    cache_row: u32,
    n_new: u32,
    pos0: u32,
    rope_pos0: u32,
    global_from: u32,
    _pad: [u32; 3],
}

/// Where a matrix product reads and writes: `y[n, y_offset + o] (+)= x[n, ..K] . W[o]`, with rows
/// of `x_stride` floats in x and `y_stride` in y; `per_row`: x holds one row per chunk row (the LM
/// head); `softcap` > 0 caps the outputs.
struct Product<'a> {
    x: &'a wgpu::Buffer,
    x_stride: usize,
    y: &'a wgpu::Buffer,
    y_stride: usize,
    y_offset: usize,
    accumulate: bool,
    per_row: bool,
    softcap: f32,
    /// Fused RMS norm of x (over K) with this weight (`Some(None)`: no weight).
    norm: Option<Option<&'a wgpu::Buffer>>,
    /// Fused MLP activation (`mlp_act.wgsl`'s code); a gated one pairs output o with weight row
    /// `rows / 2 + o`, so the product has half as many outputs as the matrix has rows.
    act: Option<MlpKind>,
    /// `xq` already holds x quantized for the integer-dot products.
    quantized: bool,
}

impl<'a> Product<'a> {
    fn new(x: &'a wgpu::Buffer, x_stride: usize, y: &'a wgpu::Buffer, y_stride: usize) -> Self {
        Product {
            x,
            x_stride,
            y,
            y_stride,
            y_offset: 0,
            accumulate: false,
            per_row: false,
            softcap: 0.0,
            norm: None,
            act: None,
            quantized: false,
        }
    }
}

/// What a block's products read: the normed input `h`, or the residual stream `x` normed inside
/// the product (`norm`: the fused norm's weight).
#[derive(Clone, Copy)]
struct BlockInput<'a> {
    x: &'a wgpu::Buffer,
    norm: Option<Option<&'a wgpu::Buffer>>,
    d_model: usize,
    /// `xq` already holds x quantized (the norm that wrote x did it).
    quantized: bool,
}

impl<'a> BlockInput<'a> {
    /// A product of this input into columns `y_offset..` of `y` (rows of `y_stride` floats).
    fn to(self, y: &'a wgpu::Buffer, y_stride: usize, y_offset: usize) -> Product<'a> {
        Product {
            y_offset,
            norm: self.norm,
            quantized: self.quantized,
            ..Product::new(self.x, self.d_model, y, y_stride)
        }
    }
}

/// `mlp_act` in common.wgsl names the activations by these codes.
fn act_code(kind: MlpKind) -> u32 {
    match kind {
        MlpKind::ReluSquared => 0,
        MlpKind::SwiGlu => 1,
        MlpKind::GeluTanhGated => 2,
    }
}

/// How many workgroups a dispatch needs, given the chunk shape (R rows, C width).
#[derive(Clone, Copy, Debug)]
enum Grid {
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
    /// One workgroup per chunk row.
    WorkgroupPerRow,
    /// `per_token` threads per token of token group `group` (`size` tokens per group), linear.
    TokenGroup { group: usize, size: usize, per_token: usize },
    /// Split attention's partials: one workgroup per (partition, kv head, token of the group).
    SplitPartials { group: usize, size: usize, parts: usize, kv_heads: usize },
    /// The same from query tiles: one workgroup per (partition, kv head, query tile of the group),
    /// a row's tokens cut into tiles of `tile` from its first.
    QueryTiles { group: usize, size: usize, parts: usize, kv_heads: usize, tile: usize },
}

struct Dispatch {
    kernel: Kernel,
    pipeline: Arc<wgpu::ComputePipeline>,
    bind: wgpu::BindGroup,
    grid: Grid,
    wg: u32,
    /// The form recorded instead for steps of many tokens, with the same bits, so a step may take
    /// either: a product's mat-mat kernel (`tiled` variant) from [`TILED_MIN_TOKENS`] tokens on,
    /// split-group attention's query tiles from [`QUERY_TILE_MIN_WIDTH`] tokens a row on.
    many_tokens: Option<Box<Dispatch>>,
}

/// Words per block of 32 quantized activations (quantize.wgsl): the scale d, d * sum(q), then
/// the 32 int8 q four to a word.
const Q8_BLOCK_WORDS: usize = 10;

/// The product kernel for `asked` on this device: `Auto` resolved, and a variant the device
/// cannot run refused by name (what [`Engine::matmul_kernel`] will say).
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
             (or the device was made portable: GpuOptions::portable / KVDECODE_PORTABLE=1)",
            gpu.info.name
        ))),
        MatmulKernel::WideSubgroup if sg.is_none_or(|n| n < 8) => Err(Error::Config(format!(
            "matmul: the wide-subgroup kernel needs subgroups of one fixed size of at least 8 lanes; {} offers {} \
             (or the device was made portable: GpuOptions::portable / KVDECODE_PORTABLE=1)",
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
fn product_wg(kernel: MatmulKernel, gpu: &Gpu) -> u32 {
    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
    match kernel {
        MatmulKernel::Wide if cpu => 8,
        MatmulKernel::WideSubgroup if cpu && gpu.subgroup_size() == Some(8) => 8,
        _ => 64,
    }
}

/// Blocks of tokens a matmul dispatch covers: one per 4 tokens, or one per token in steps of
/// fewer than 4 (`tokens_per_thread` in matmul.wgsl).
fn matmul_token_blocks(n: usize) -> u32 {
    (if n < 4 { n } else { n.div_ceil(4) }).max(1) as u32
}

impl Dispatch {
    fn workgroups(&self, rows: usize, width: usize) -> (u32, u32, u32) {
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
            Grid::WorkgroupPerRow => (rows as u32, 1, 1),
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
    /// chunk's tokens is not recorded).
    fn live(&self, rows: usize, width: usize) -> bool {
        match self.grid {
            Grid::TokenGroup { group, size, .. }
            | Grid::SplitPartials { group, size, .. }
            | Grid::QueryTiles { group, size, .. } => Self::group_count(rows * width, group, size) > 0,
            _ => true,
        }
    }

    /// The dispatch a chunk of `rows x width` tokens records: its form for many tokens where it
    /// has one and the chunk has enough tokens, else itself.
    fn for_chunk(&self, rows: usize, width: usize) -> &Dispatch {
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

    fn record(&self, pass: &mut wgpu::ComputePass<'_>, rows: usize, width: usize) {
        let (x, y, z) = self.workgroups(rows, width);
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        pass.dispatch_workgroups(x, y, z);
    }
}

/// Activation buffers, sized once for `rows * chunk` tokens.
pub(crate) struct Scratch {
    step: wgpu::Buffer,              // uniform Step
    row_info: wgpu::Buffer,          // [rows] RowInfo
    ids: wgpu::Buffer,               // [rows * chunk] u32
    x: wgpu::Buffer,                 // [T, d] residual stream
    h: wgpu::Buffer,                 // [T, d] normed input of a block
    qkv: wgpu::Buffer,               // [T, (H + 2 Hk) D] queries (then attention out), fresh global K, V
    kv_local: wgpu::Buffer,          // [T, 2 * Hk * D] fresh local K then V
    tmp: wgpu::Buffer,               // [T, d] projection output before a post-norm
    up: wgpu::Buffer,                // [T, in_factor * F]
    act: wgpu::Buffer,               // [T, F]
    engram_e: wgpu::Buffer,          // [T, orders * heads * dim] Engram lookups
    engram_kv: wgpu::Buffer,         // [T, 2, d] Engram k then v
    last_h: wgpu::Buffer,            // [rows, d] final-normed hidden state of each row's last real token
    logits: wgpu::Buffer,            // [rows, vocab]
    samplers: wgpu::Buffer,          // [rows] Sampler
    sampled: wgpu::Buffer,           // [2, rows]: sampled ids, then their logprobs (f32 bits)
    all_logits: wgpu::Buffer,        // [all_logits_tokens, vocab]
    dummy: wgpu::Buffer,             // bound where a kernel's optional input is absent
    dummy_rw: wgpu::Buffer,          // the same for an optional output (one buffer may not be bound both ways)
    xq: wgpu::Buffer,                // int-dot products: [T, K / 32, Q8_BLOCK_WORDS] quantized input
    partials: wgpu::Buffer,          // split attention: [group tokens, H, parts, 4 + D] partial softmax states
    token_groups: Vec<wgpu::Buffer>, // uniform TokenGroup of each token group
    logits_read: wgpu::Buffer,
    pub(crate) sampled_read: wgpu::Buffer, // [max_window, 2, rows]: one slot per multi-step step
    all_logits_read: wgpu::Buffer,
}

/// A model on the GPU with its KV cache: the object that decodes.
pub struct Engine {
    gpu: Gpu,
    cfg: ModelConfig,
    pipelines: Pipelines,
    pub(crate) cache: KvCache,
    chunk: usize,
    pub(crate) s: Scratch,
    _weights: GpuWeights,
    _rope: HashMap<u32, wgpu::Buffer>,
    /// Every dispatch of one chunk up to the final hidden states, in order.
    chunk_dispatches: Vec<Dispatch>,
    /// Final norm at each row's last token, then the LM head parts.
    head_dispatches: Vec<Dispatch>,
    /// Final norm at every token, then the LM head over all of them.
    all_head_dispatches: Vec<Dispatch>,
    all_logits_tokens: usize,
    /// Most steps per multi-step window: `rollback + 1`.
    pub(crate) max_window: usize,
    sample_dispatch: Dispatch,
    /// Adds rows' logit biases to the logits of a sampling step (recorded only when one has some).
    bias_dispatch: Dispatch,
    /// Per-row logit bias and token mask.
    sampling: RowSampling,
    stats: Stats,
    /// Timestamp queries for [`Engine::profile_step`], made on its first call.
    profiler: Option<crate::profile::Profiler>,
    /// Whether the next submit is profiled (one pass per dispatch, timestamps around each).
    profiling: bool,
    /// Bytes of buffers this engine counts against the device's memory budget.
    gpu_bytes: u64,
    attention: AttentionPlan,
    fusion: Fusion,
    matmul: MatmulKernel,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.gpu.release(self.gpu_bytes);
    }
}

/// Everything the per-layer builder needs to see while it builds dispatches.
struct Builder<'a> {
    cfg: &'a ModelConfig,
    pipelines: &'a Pipelines,
    cache: &'a KvCache,
    s: &'a Scratch,
    rope: &'a HashMap<u32, wgpu::Buffer>,
    gw: &'a GpuWeights,
    /// Subgroup size of the matmul fast path (`None`: the portable kernel).
    subgroup: Option<u32>,
    /// Q8_0 / Q4_0 / Q4_1 products take the integer-dot kernel.
    int_dot: bool,
    /// Outputs per thread of the portable product (`OUTS` in matmul.wgsl).
    outs_per_thread: usize,
    /// The wide products share each block's inputs through subgroups (`main_wide_subgroup`).
    wide_subgroup: bool,
    /// Products of many tokens take the mat-mat kernel (`main_tiled`, the `tiled` variant).
    tiled: bool,
    /// A workgroup per output sums its lanes in workgroup memory (`main_reduce`, `workgroup`).
    workgroup_reduce: bool,
    /// Lanes per workgroup of the products without a fused norm (`WG` in matmul.wgsl). With
    /// `wide_subgroup` and 8, a fused norm keeps them too: it sums through shuffles in the one
    /// 8-lane subgroup (inv_rms_lanes8); else a fused norm takes rmsnorm.wgsl's 64 lanes.
    product_wg: u32,
    attention: AttentionPlan,
    /// Which kernels run fused.
    fusion: Fusion,
}

impl Builder<'_> {
    /// Floats per token row of `qkv`: the queries, then the fresh global K and V.
    fn qkv_stride(&self) -> usize {
        let c = self.cfg;
        (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    }
}

fn b(v: bool) -> f64 {
    if v {
        1.0
    } else {
        0.0
    }
}

impl Builder<'_> {
    fn dispatch(&self, kernel: Kernel, constants: Constants, buffers: &[&wgpu::Buffer], grid: Grid) -> Dispatch {
        let wg = match (kernel, self.subgroup) {
            (Kernel::MatmulSubgroup, Some(sg)) => sg,
            // a kernel whose workgroup size was set through its `WG` constant
            _ => constants.iter().find(|(n, _)| *n == "WG").map_or(kernel.workgroup_size(), |(_, v)| *v as u32),
        };
        Dispatch {
            kernel,
            pipeline: self.pipelines.get(kernel, &constants),
            bind: self.pipelines.bind(kernel, buffers),
            grid,
            wg,
            many_tokens: None,
        }
    }

    /// `out (+)= norm(x) [* w]` over rows of d_model; a norm that writes (not adds) also
    /// quantizes its output for the integer-dot products when they run ([`Builder::norm_quantizes`]).
    fn norm(&self, x: &wgpu::Buffer, w: Option<&wgpu::Buffer>, out: &wgpu::Buffer, accumulate: bool) -> Dispatch {
        let c = self.cfg;
        let quantize = !accumulate && self.norm_quantizes();
        self.dispatch(
            Kernel::RmsNorm,
            vec![
                ("D", c.d_model as f64),
                ("EPS", c.norm_eps as f64),
                ("HAS_WEIGHT", b(w.is_some())),
                ("ACCUMULATE", b(accumulate)),
                ("QUANTIZE", b(quantize)),
            ],
            &[
                &self.s.step,
                &self.s.row_info,
                x,
                w.unwrap_or(&self.s.dummy),
                out,
                if quantize { &self.s.xq } else { &self.s.dummy_rw },
            ],
            Grid::Tokens(Kernel::RmsNorm.workgroup_size() as usize),
        )
    }

    /// Whether the norms before products write their output quantized too (integer-dot
    /// products, d_model in whole blocks of 32), sparing the products a quantize dispatch.
    fn norm_quantizes(&self) -> bool {
        self.int_dot && self.cfg.d_model.is_multiple_of(32)
    }

    /// The input of a block's products, `norm(x) * weight`: with fusion the products normalize
    /// the residual stream themselves; without, one norm dispatch writes it to `h` first.
    fn block_input<'b>(&'b self, out: &mut Vec<Dispatch>, weight: Option<&'b wgpu::Buffer>) -> BlockInput<'b> {
        let s = self.s;
        if self.fusion.norm {
            BlockInput { x: &s.x, norm: Some(weight), d_model: self.cfg.d_model, quantized: false }
        } else {
            out.push(self.norm(&s.x, weight, &s.h, false));
            BlockInput { x: &s.h, norm: None, d_model: self.cfg.d_model, quantized: self.norm_quantizes() }
        }
    }

    /// `y (+)= x W^T` over whole rows of x and y, one dispatch per weight part.
    fn matmul(
        &self,
        x: &wgpu::Buffer,
        w: &GpuMatrix,
        y: &wgpu::Buffer,
        y_stride: usize,
        accumulate: bool,
    ) -> Vec<Dispatch> {
        self.product(w, Product { accumulate, ..Product::new(x, w.cols, y, y_stride) })
    }

    /// `y[n, y_offset + o] (+)= x[n, ..K] . W[o]` as `io` says, one dispatch per weight part.
    /// Integer-dot products (Q8_0, Q4_0, Q4_1 weights) first quantize their input (`quantize`).
    fn product(&self, w: &GpuMatrix, io: Product) -> Vec<Dispatch> {
        // weight formats 2..=4: Q8_0, Q4_0, Q4_1 (common.wgsl)
        let int_dot = self.int_dot && (2..=4).contains(&w.format) && w.cols.is_multiple_of(32) && io.norm.is_none();
        let quantize = (int_dot && !io.quantized).then(|| self.quantize(io.x, io.x_stride, w.cols, io.per_row));
        quantize
            .into_iter()
            .chain(w.parts.iter().map(|p| {
                let per_row = io.per_row;
                let gated = io.act.is_some_and(|a| a.in_factor() == 2);
                let (out_rows, out_start) = if gated { (p.rows / 2, p.row_start / 2) } else { (p.rows, p.row_start) };
                let (kernel, grid, extra) = match (self.subgroup, io.norm.is_some()) {
                    _ if int_dot => {
                        // the wide shape's threads and workgroups (no barriers: any size will do)
                        let outs = self.outs_per_thread;
                        let consts = vec![("OUTS", outs as f64), ("WG", self.product_wg as f64)];
                        (Kernel::MatmulInt, Grid::Matmul { out_rows, per_row, outs }, consts)
                    }
                    (Some(sg), _) => {
                        (Kernel::MatmulSubgroup, Grid::MatmulPerOutput { out_rows, per_row }, vec![("SG", sg as f64)])
                    }
                    _ if self.workgroup_reduce => {
                        (Kernel::MatmulReduce, Grid::MatmulPerOutput { out_rows, per_row }, vec![])
                    }
                    // one output per thread stages the normed input (`main_normed`); the wide
                    // shape reads it straight from x, each value computed once per 4 outputs
                    (None, true) if self.outs_per_thread == 1 => {
                        (Kernel::MatmulNormed, Grid::Matmul { out_rows, per_row, outs: 1 }, vec![])
                    }
                    (None, norm) if self.wide_subgroup => {
                        let outs = self.outs_per_thread;
                        let wg = if norm && self.product_wg != 8 { 64 } else { self.product_wg };
                        let grid = Grid::Matmul { out_rows, per_row, outs };
                        (Kernel::MatmulWideSubgroup, grid, vec![("OUTS", outs as f64), ("WG", wg as f64)])
                    }
                    (None, norm) => {
                        let outs = self.outs_per_thread;
                        let wg = if norm { 64 } else { self.product_wg };
                        (
                            Kernel::Matmul,
                            Grid::Matmul { out_rows, per_row, outs },
                            vec![("OUTS", outs as f64), ("WG", wg as f64)],
                        )
                    }
                };
                let mut consts = vec![
                    ("K", w.cols as f64),
                    ("X_STRIDE", io.x_stride as f64),
                    ("O_ROWS", out_rows as f64),
                    ("OUT_STRIDE", io.y_stride as f64),
                    ("OUT_OFFSET", (io.y_offset + out_start) as f64),
                    ("W_FORMAT", w.format as f64),
                    ("ACCUMULATE", b(io.accumulate)),
                    ("SOFTCAP", io.softcap as f64),
                    ("PER_ROW", b(per_row)),
                ];
                if let Some(weight) = io.norm {
                    consts.extend([
                        ("NORM", 1.0),
                        ("NORM_WEIGHT", b(weight.is_some())),
                        ("EPS", self.cfg.norm_eps as f64),
                    ]);
                }
                if let Some(act) = io.act {
                    consts.push(("MLP_ACT", (act_code(act) + 1) as f64));
                }
                consts.extend(extra);
                let norm_w = io.norm.flatten().unwrap_or(&self.s.dummy);
                if int_dot {
                    let s = self.s;
                    return self.dispatch(kernel, consts, &[&s.step, &s.dummy, &p.buffer, io.y, &s.dummy, &s.xq], grid);
                }
                let buffers = [&self.s.step, io.x, &p.buffer, io.y, norm_w];
                // `tiled`: the mat-mat form beside the portable one (without OUTS: one shape)
                let tiled = self.tiled.then(|| {
                    let consts = consts.iter().filter(|(n, _)| *n != "OUTS" && *n != "WG").cloned().collect();
                    Box::new(self.dispatch(
                        Kernel::MatmulTiled,
                        consts,
                        &buffers,
                        Grid::MatmulTiled { out_rows, per_row, gated },
                    ))
                });
                Dispatch { many_tokens: tiled, ..self.dispatch(kernel, consts, &buffers, grid) }
            }))
            .collect()
    }

    /// `xq` = the first `k` features of each token (or row) of `x`, quantized per block of 32 for
    /// the integer-dot products.
    fn quantize(&self, x: &wgpu::Buffer, x_stride: usize, k: usize, per_row: bool) -> Dispatch {
        let grid = if per_row { Grid::Rows(k / 32) } else { Grid::Tokens(k / 32) };
        self.dispatch(
            Kernel::Quantize,
            vec![("K", k as f64), ("X_STRIDE", x_stride as f64), ("PER_ROW", b(per_row))],
            &[&self.s.step, x, &self.s.xq],
            grid,
        )
    }

    /// qk-norm (optional) and RoPE at each token's position, in place, in one dispatch: the
    /// queries and `t_keys` key heads after them in each row of `t` (`stride` floats), then the
    /// keys at the start of each row of `keys` (buffer, row floats), if any. `pool`: also write
    /// `t`'s keys and the values after them to this global pool (kv_write fused).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        t: &wgpu::Buffer,
        stride: usize,
        t_keys: usize,
        keys: Option<(&wgpu::Buffer, usize)>,
        q_norm: Option<&wgpu::Buffer>,
        k_norm: Option<&wgpu::Buffer>,
        theta: f32,
        pool: Option<&wgpu::Buffer>,
    ) -> Dispatch {
        let c = self.cfg;
        let k_heads = if keys.is_some() { c.n_kv_heads } else { 0 };
        let v_heads = if pool.is_some() { t_keys } else { 0 };
        let pairs_per_thread = if pool.is_some() { 2 } else { 1 };
        let mut consts = vec![
            ("HEADS", c.n_heads as f64),
            ("D", c.head_dim as f64),
            ("STRIDE", stride as f64),
            ("NORM", b(c.qk_norm)),
            ("HAS_WEIGHT", b(q_norm.is_some())),
            ("EPS", c.norm_eps as f64),
            ("T_K_HEADS", t_keys as f64),
            ("K_HEADS", k_heads as f64),
            ("K_STRIDE", keys.map_or(1, |k| k.1) as f64),
            ("HAS_K_WEIGHT", b(k_norm.is_some())),
        ];
        if pool.is_some() {
            consts.extend([("KV_WRITE", 1.0), ("KV_FORMAT", self.cache.dtype().format() as f64)]);
            consts.extend(self.paging());
        }
        self.dispatch(
            Kernel::QkRope,
            consts,
            &[
                &self.s.step,
                &self.s.row_info,
                t,
                q_norm.unwrap_or(&self.s.dummy),
                &self.rope[&theta.to_bits()],
                keys.map_or(&self.s.dummy_rw, |k| k.0),
                k_norm.unwrap_or(&self.s.dummy),
                pool.unwrap_or(&self.s.dummy_rw),
                &self.cache.block_tables,
            ],
            // a thread per head with qk-norm (it sums the head's squares), else per rotated pair
            // (two with the pool write)
            Grid::Tokens(
                (c.n_heads + t_keys + k_heads + v_heads)
                    * if c.qk_norm { 1 } else { c.head_dim / 2 / pairs_per_thread },
            ),
        )
    }

    /// Override constants naming cache shard `shard`'s rows.
    fn shard(&self, shard: usize) -> [(&'static str, f64); 2] {
        let n = self.cache.shard_rows();
        [("ROW0", (shard * n) as f64), ("SHARD_ROWS", n as f64)]
    }

    /// Override constants of the global K/V pool's addressing: positions per block, and block
    /// table entries per row.
    fn paging(&self) -> [(&'static str, f64); 2] {
        [("BLOCK", self.cache.block_len() as f64), ("MAX_BLOCKS", self.cache.blocks.max_blocks() as f64)]
    }

    /// Scatter fresh K/V into a global group's pool (through the block tables) or a local ring,
    /// one dispatch per cache shard.
    fn kv_write(
        &self,
        (fresh, fresh_stride, fresh_offset): (&wgpu::Buffer, usize, usize),
        kv: &[wgpu::Buffer],
        ring: bool,
    ) -> Vec<Dispatch> {
        let (c, cache) = (self.cfg, self.cache);
        kv.iter()
            .enumerate()
            .map(|(shard, kv)| {
                let mut consts = vec![
                    ("HK", c.n_kv_heads as f64),
                    ("D", c.head_dim as f64),
                    ("RING_SLOTS", (cache.ring_slots() + 1) as f64),
                    ("SRC_STRIDE", fresh_stride as f64),
                    ("SRC_OFFSET", fresh_offset as f64),
                    ("RING", b(ring)),
                    ("KV_FORMAT", cache.dtype().format() as f64),
                ];
                consts.extend(self.shard(shard));
                consts.extend(self.paging());
                self.dispatch(
                    Kernel::KvWrite,
                    consts,
                    &[&self.s.step, &self.s.row_info, fresh, kv, &cache.block_tables],
                    Grid::Tokens(c.n_kv_heads * c.head_dim / 2),
                )
            })
            .collect()
    }

    /// Attention of one layer against its global group and/or ring.
    fn attention(&self, group: Option<&Vec<wgpu::Buffer>>, ring: Option<&Vec<wgpu::Buffer>>) -> Vec<Dispatch> {
        let (c, s, cache, plan) = (self.cfg, self.s, self.cache, self.attention);
        let split = plan.kernel.is_split() && group.is_some();
        let size = plan.group_tokens;
        let mut out = Vec::new();
        for shard in 0..cache.rows().div_ceil(cache.shard_rows()) {
            let gkv = group.map_or(&s.dummy, |g| &g[shard]);
            let lkv = ring.map_or(&s.dummy, |r| &r[shard]);
            let mut shared = vec![
                ("H", c.n_heads as f64),
                ("HK", c.n_kv_heads as f64),
                ("D", c.head_dim as f64),
                ("Q_STRIDE", self.qkv_stride() as f64),
                ("KV_FORMAT", cache.dtype().format() as f64),
                ("SCALE", c.attn_scale as f64),
                ("GROUP_TOKENS", size as f64),
                ("SPAN", plan.span as f64),
                ("PARTS", plan.parts as f64),
            ];
            shared.extend(self.shard(shard));
            shared.extend(self.paging());
            let mut consts = shared.clone();
            consts.extend([
                ("W", cache.window().max(1) as f64),
                ("RING", cache.ring_slots().max(1) as f64),
                ("HAS_GLOBAL", b(group.is_some())),
                ("HAS_LOCAL", b(ring.is_some())),
                ("SPLIT", b(split)),
            ]);
            for (g, token_group) in s.token_groups.iter().enumerate() {
                if split {
                    let (kernel, grid, extra) = match plan.kernel {
                        AttentionKernel::SplitGroup => (
                            Kernel::AttentionSplit,
                            Grid::SplitPartials { group: g, size, parts: plan.parts, kv_heads: c.n_kv_heads },
                            vec![("TILE", plan.tile as f64)],
                        ),
                        _ => (
                            Kernel::AttentionSplitHead,
                            Grid::TokenGroup { group: g, size, per_token: c.n_heads * plan.parts },
                            vec![],
                        ),
                    };
                    let consts = [shared.clone(), extra].concat();
                    let buffers = [&s.step, token_group, &s.row_info, &s.qkv, gkv, &s.partials, &cache.block_tables];
                    // split-group: the query tiles beside it, for steps of several tokens a row
                    let many_tokens = (kernel == Kernel::AttentionSplit && plan.query_tile > 1).then(|| {
                        let tile = plan.query_tile;
                        Box::new(self.dispatch(
                            Kernel::AttentionQueryTiles,
                            [consts.clone(), vec![("QT", tile as f64)]].concat(),
                            &buffers,
                            Grid::QueryTiles { group: g, size, parts: plan.parts, kv_heads: c.n_kv_heads, tile },
                        ))
                    });
                    out.push(Dispatch { many_tokens, ..self.dispatch(kernel, consts, &buffers, grid) });
                }
                // split: binding 4 holds the partials instead of the keys
                let global = if split { &s.partials } else { gkv };
                out.push(self.dispatch(
                    Kernel::Attention,
                    consts.clone(),
                    &[
                        &s.step,
                        &s.row_info,
                        &s.qkv,
                        &cache.lpos,
                        global,
                        lkv,
                        &s.kv_local,
                        token_group,
                        &cache.block_tables,
                    ],
                    Grid::TokenGroup { group: g, size, per_token: c.n_heads },
                ));
            }
        }
        out
    }

    /// The dispatch order of one layer, top to bottom.
    fn layer(&self, i: usize, lw: &GpuLayer) -> Vec<Dispatch> {
        let (c, s, cache) = (self.cfg, self.s, self.cache);
        let spec = c.layers[i];
        let (hd, kvd) = (c.n_heads * c.head_dim, 2 * c.n_kv_heads * c.head_dim);
        let theta = c.layer_theta(i);
        let mut out = Vec::new();
        // 0. Engram layers: n-gram lookup (addresses from the token history), gated residual
        if let (Some(ge), Some(e)) = (&lw.engram, &c.engram) {
            let tables = e.orders.len() * e.heads;
            out.push(self.dispatch(
                Kernel::EngramGather,
                vec![
                    ("HEADS", e.heads as f64),
                    ("N_ORDERS", e.orders.len() as f64),
                    ("TABLE_ROWS", e.table_rows as f64),
                    ("DIM", e.dim as f64),
                    ("MAX_LEN", cache.max_len() as f64),
                ],
                &[
                    &s.step,
                    &s.row_info,
                    &s.ids,
                    &cache.history,
                    &self.gw.cid_map,
                    &self.gw.engram_orders,
                    &ge.tables,
                    &s.engram_e,
                ],
                Grid::Tokens(tables * e.dim / 4),
            ));
            out.extend(self.matmul(&s.engram_e, &ge.w_kv, &s.engram_kv, 2 * c.d_model, false));
            out.push(self.dispatch(
                Kernel::EngramMix,
                vec![("D", c.d_model as f64), ("EPS", c.norm_eps as f64)],
                &[&s.step, &s.row_info, &s.engram_kv, &s.x],
                Grid::Tokens(1),
            ));
        }
        // 1. h = norm(x): its own dispatch, or fused into each product that reads h
        let attn_in = self.block_input(&mut out, lw.attn_norm.as_ref());
        // 2. q = h Wq^T and, on writer layers, the fresh global K/V beside it in each row of qkv
        //    (one product when both matrices are stored alike); local layers: fresh local K/V
        let qkv = self.qkv_stride();
        let group = spec.global_group.map(|g| &cache.global[g]);
        let writes = group.filter(|_| spec.writes_global);
        match &lw.qkv {
            QkvWeights::Fused(w) => out.extend(self.product(w, attn_in.to(&s.qkv, qkv, 0))),
            QkvWeights::Apart { wq, kv_global } => {
                out.extend(self.product(wq, attn_in.to(&s.qkv, qkv, 0)));
                if let (Some(kvg), Some(_)) = (kv_global, writes) {
                    out.extend(self.product(kvg, attn_in.to(&s.qkv, qkv, hd)));
                }
            }
        }
        let ring = cache.ring[i].as_ref();
        let local = match (lw.kv_local.as_ref(), ring) {
            (Some(kvl), Some(_)) => {
                out.extend(self.product(kvl, attn_in.to(&s.kv_local, kvd, 0)));
                true
            }
            _ => false,
        };
        // 3. qk-norm and RoPE at each token's own position, the queries and all fresh keys in one
        //    dispatch (keys are rotated once, before they are stored).
        // 4. writer layers: scatter K/V into the group's cache now, so this layer and the group's
        //    later layers see the chunk's keys (padding -> scratch slot); RoPE does it when the
        //    cache is one shard and a thread can take two pairs; the ring is written after
        //    attention
        let t_keys = if writes.is_some() { c.n_kv_heads } else { 0 };
        let keys = local.then_some((&s.kv_local, kvd));
        let pool =
            writes.filter(|g| self.fusion.kv_write && g.len() == 1 && c.head_dim.is_multiple_of(4)).map(|g| &g[0]);
        out.push(self.rope(&s.qkv, qkv, t_keys, keys, lw.q_norm.as_ref(), lw.k_norm.as_ref(), theta, pool));
        if let (Some(g), None) = (writes, pool) {
            out.extend(self.kv_write((&s.qkv, qkv, hd), g, false));
        }
        // 5. attention over global keys + ring + the chunk's fresh local keys; output replaces q
        //    (per cache shard, each handling the rows its shard holds, and per token group).
        //    Split variants: the partitions of the global keys, then their merge in order.
        out.extend(self.attention(group, ring));
        // 6. ring write: the last W real tokens of each row survive, the rest go to the scratch slot
        if let Some(r) = ring {
            out.extend(self.kv_write((&s.kv_local, kvd, 0), r, true));
        }
        // 7. output projection and residual (Gemma: norm the projection before adding it)
        if c.post_norms {
            out.extend(self.product(&lw.wo, Product::new(&s.qkv, qkv, &s.tmp, c.d_model)));
            out.push(self.norm(&s.tmp, lw.post_attn_norm.as_ref(), &s.x, true));
        } else {
            out.extend(
                self.product(&lw.wo, Product { accumulate: true, ..Product::new(&s.qkv, qkv, &s.x, c.d_model) }),
            );
        }
        // 8. MLP and residual; the activation is the up projection's epilogue where its matrix is
        //    one part (a gated one pairs rows o and F + o)
        let f = c.ffn;
        let mlp_in = self.block_input(&mut out, lw.mlp_norm.as_ref());
        if self.fusion.act && lw.mlp_in.parts.len() == 1 {
            out.extend(self.product(&lw.mlp_in, Product { act: Some(c.mlp), ..mlp_in.to(&s.act, f, 0) }));
        } else {
            out.extend(self.product(&lw.mlp_in, mlp_in.to(&s.up, c.mlp.in_factor() * f, 0)));
            out.push(self.dispatch(
                Kernel::MlpAct,
                vec![("F", f as f64), ("ACT", act_code(c.mlp) as f64)],
                &[&s.step, &s.up, &s.act],
                Grid::Tokens(f),
            ));
        }
        if c.post_norms {
            out.extend(self.matmul(&s.act, &lw.mlp_out, &s.tmp, c.d_model, false));
            out.push(self.norm(&s.tmp, lw.post_mlp_norm.as_ref(), &s.x, true));
        } else {
            out.extend(self.matmul(&s.act, &lw.mlp_out, &s.x, c.d_model, true));
        }
        out
    }
}

impl Engine {
    /// Upload `weights`, allocate the cache and every buffer, and build every pipeline and bind
    /// group. Nothing is allocated per step after this. An engine the device cannot hold is an
    /// error naming what it needs (error scopes catch out-of-memory and validation errors during
    /// creation), never a panic. (Natively this blocks on the scopes; in the browser use
    /// [`Engine::new_async`], or the first call reports what creation ran into.)
    pub fn new(gpu: &Gpu, weights: &ModelWeights, opts: EngineOptions) -> Result<Self> {
        #[cfg(not(target_arch = "wasm32"))]
        return pollster::block_on(Self::new_async(gpu, weights, opts));
        #[cfg(target_arch = "wasm32")]
        Self::build(gpu, weights, opts)
    }

    /// [`Engine::new`] that awaits the device's verdict on creation (the browser's form).
    pub async fn new_async(gpu: &Gpu, weights: &ModelWeights, opts: EngineOptions) -> Result<Self> {
        gpu.check()?;
        let oom = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let built = Self::build(gpu, weights, opts);
        let invalid = invalid.pop().await;
        let oom = oom.pop().await;
        let engine = built?;
        let needs = || {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            format!(
                "the engine needs {:.1} MiB of weights and {:.1} MiB of K/V cache plus activations",
                mib(engine.weight_bytes()),
                mib(engine.cache.nbytes())
            )
        };
        if let Some(e) = oom {
            return Err(Error::Device(format!(
                "out of GPU memory creating the engine ({}; use fewer rows, a shorter max_len, 16-bit K/V or \
                 quantized weights): {e}",
                needs()
            )));
        }
        if let Some(e) = invalid {
            return Err(Error::Device(format!("the device refused the engine ({}): {e}", needs())));
        }
        gpu.check()?;
        Ok(engine)
    }

    /// Build, counting the buffers against the device's memory budget (given back on drop, or
    /// at once when building fails half-way).
    fn build(gpu: &Gpu, weights: &ModelWeights, opts: EngineOptions) -> Result<Self> {
        let before = gpu.memory_in_use();
        match Self::build_parts(gpu, weights, opts) {
            Ok(mut e) => {
                e.gpu_bytes = gpu.memory_in_use().saturating_sub(before);
                Ok(e)
            }
            Err(e) => {
                gpu.release(gpu.memory_in_use().saturating_sub(before));
                Err(e)
            }
        }
    }

    fn build_parts(gpu: &Gpu, weights: &ModelWeights, opts: EngineOptions) -> Result<Self> {
        weights.check()?;
        let cfg = weights.cfg.clone();
        if let Some(ctx) = cfg.context_len.filter(|&c| opts.max_len > c && !opts.beyond_trained_context) {
            return Err(Error::Limit(format!(
                "max_len {} is longer than the model's trained context of {ctx} tokens; use max_len <= {ctx} \
                 or set EngineOptions::beyond_trained_context to go past it",
                opts.max_len
            )));
        }
        // what the engine will hold, before anything is allocated (activations are small beside it)
        let weight_bytes = crate::gpu_weights::bytes_needed(weights, opts.weights);
        let kv_bytes = KvCache::bytes_needed(&cfg, &opts.cache());
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        gpu.check_budget(
            weight_bytes.saturating_add(kv_bytes),
            &format!(
                "an engine with {:.1} MiB of weights and a {:.1} MiB K/V cache ({} rows x {} positions, {} K/V)",
                mib(weight_bytes),
                mib(kv_bytes),
                opts.rows,
                opts.max_len,
                opts.kv.name()
            ),
        )?;
        let cache = KvCache::new(gpu, &cfg, opts.cache())?;
        let gw = GpuWeights::upload(gpu, weights, opts.weights)?;
        let rows = opts.rows;
        let (d, hd, kvd) = (cfg.d_model, cfg.n_heads * cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim);
        let engram_width = cfg.engram.as_ref().map_or(0, |e| e.width());
        let widest =
            [d, hd, kvd, cfg.mlp.in_factor() * cfg.ffn, engram_width, 2 * d].into_iter().max().unwrap_or(d) * 4;
        // chunk width: as many tokens per row as fit one binding for the widest activation
        let chunk = CHUNK.min(gpu.max_binding() as usize / (rows * widest));
        if chunk == 0 {
            return Err(Error::Limit(format!(
                "{rows} rows x {widest} bytes of activations per token exceed one storage binding; use fewer rows"
            )));
        }
        let t = rows * chunk;
        let attention = AttentionPlan::new(&cfg, &opts, gpu, t)?;
        let matmul = resolve_matmul(opts.matmul.map_or_else(MatmulKernel::from_env, Ok)?, gpu)?;
        let mut fusion = match opts.fusion {
            Some(f) => f,
            None => Fusion::from_env()?.unwrap_or_else(|| Fusion::auto(&gpu.info, matmul)),
        };
        // the integer-dot products read activations quantized by their own dispatch, which reads
        // the normed input: the norm stays a dispatch of its own
        fusion.norm &= matmul != MatmulKernel::IntDot;
        // all-position logits: as many tokens as asked, that one chunk and one binding can hold
        let all_tokens = opts.all_logits_tokens.min(t).min(gpu.max_binding() as usize / (cfg.vocab * 4)).max(1);
        let max_window = opts.rollback + 1;
        let f4 = |n: usize| (n * 4) as u64;
        let map_read = |label: &str, size: u64| {
            gpu.buffer(label, size, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)
        };
        let s = Scratch {
            step: gpu.buffer("step", 16, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST)?,
            row_info: gpu.storage("row info", (rows * std::mem::size_of::<RowInfoGpu>()) as u64)?,
            ids: gpu.storage("ids", f4(t))?,
            x: gpu.storage("x", f4(t * d))?,
            h: gpu.storage("h", f4(t * d))?,
            qkv: gpu.storage("q and fresh global kv", f4(t * (hd + kvd)))?,
            kv_local: gpu.storage("fresh local kv", f4(t * kvd))?,
            tmp: gpu.storage("tmp", f4(t * d))?,
            up: gpu.storage("mlp up", f4(t * cfg.mlp.in_factor() * cfg.ffn))?,
            act: gpu.storage("mlp act", f4(t * cfg.ffn))?,
            engram_e: gpu.storage("engram lookups", f4(if engram_width > 0 { t * engram_width } else { 4 }))?,
            engram_kv: gpu.storage("engram k/v", f4(if engram_width > 0 { t * 2 * d } else { 4 }))?,
            last_h: gpu.storage("last hidden", f4(rows * d))?,
            logits: gpu.storage("logits", f4(rows * cfg.vocab))?,
            samplers: gpu.storage("samplers", (rows * 32) as u64)?,
            sampled: gpu.storage("sampled ids", f4(2 * rows))?,
            all_logits: gpu.storage("all-position logits", f4(all_tokens * cfg.vocab))?,
            dummy: gpu.storage("dummy", 16)?,
            dummy_rw: gpu.storage("dummy output", 16)?,
            xq: match matmul {
                MatmulKernel::IntDot => {
                    gpu.storage("quantized activations", f4(t.max(rows) * (widest / 4).div_ceil(32) * Q8_BLOCK_WORDS))?
                }
                _ => gpu.storage("no quantized activations", 16)?,
            },
            partials: match attention.kernel.is_split() {
                true => gpu.storage(
                    "split attention partials",
                    f4(attention.group_tokens * cfg.n_heads * attention.parts * (4 + cfg.head_dim)),
                )?,
                false => gpu.storage("no partials", 16)?,
            },
            token_groups: (0..attention.groups)
                .map(|g| {
                    let buf =
                        gpu.buffer("token group", 16, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST)?;
                    gpu.queue.write_buffer(
                        &buf,
                        0,
                        bytemuck::cast_slice(&[(g * attention.group_tokens) as u32, 0, 0, 0]),
                    );
                    Ok(buf)
                })
                .collect::<Result<_>>()?,
            logits_read: map_read("logits readback", f4(rows * cfg.vocab))?,
            sampled_read: map_read("sampled readback", f4(2 * rows * max_window))?,
            all_logits_read: map_read("all-position logits readback", f4(all_tokens * cfg.vocab))?,
        };
        let mut rope = HashMap::new();
        for i in 0..cfg.n_layers() {
            let theta = cfg.layer_theta(i);
            if let std::collections::hash_map::Entry::Vacant(e) = rope.entry(theta.to_bits()) {
                let table = rope_table(theta, cfg.head_dim, opts.max_len);
                e.insert(gpu.storage_init(&format!("rope theta {theta}"), bytemuck::cast_slice(&table))?);
            }
        }
        let pipelines = Pipelines::new(&gpu.device, matmul == MatmulKernel::IntDot);
        // the products' float kernel (int-dot: for the formats it does not take, what `Auto` picks)
        let float_kernel =
            if matmul == MatmulKernel::IntDot { resolve_matmul(MatmulKernel::Auto, gpu)? } else { matmul };
        let bld = Builder {
            subgroup: gpu.subgroup_size().filter(|_| float_kernel == MatmulKernel::Subgroup),
            int_dot: matmul == MatmulKernel::IntDot,
            outs_per_thread: if matches!(float_kernel, MatmulKernel::Wide | MatmulKernel::WideSubgroup) {
                8
            } else {
                1
            },
            wide_subgroup: float_kernel == MatmulKernel::WideSubgroup,
            tiled: float_kernel == MatmulKernel::Tiled,
            workgroup_reduce: float_kernel == MatmulKernel::Workgroup,
            product_wg: product_wg(float_kernel, gpu),
            attention,
            fusion,
            cfg: &cfg,
            pipelines: &pipelines,
            cache: &cache,
            s: &s,
            rope: &rope,
            gw: &gw,
        };
        let mut chunk_dispatches = Vec::new();
        // embedding gather, one dispatch per table part
        for p in &gw.embed.parts {
            chunk_dispatches.push(bld.dispatch(
                Kernel::Embed,
                vec![
                    ("D", d as f64),
                    ("PART_START", p.row_start as f64),
                    ("PART_ROWS", p.rows as f64),
                    ("W_FORMAT", gw.embed.format as f64),
                    ("EMBED_SCALE", cfg.embed_scale as f64),
                ],
                &[&s.step, &s.ids, &p.buffer, &s.x],
                Grid::Tokens(d / 4),
            ));
        }
        for (i, lw) in gw.layers.iter().enumerate() {
            chunk_dispatches.extend(bld.layer(i, lw));
        }
        // bookkeeping once every layer has read the old ring positions
        chunk_dispatches.push(bld.dispatch(
            Kernel::Commit,
            vec![
                ("MAX_LEN", opts.max_len as f64),
                ("RING", cache.ring_slots().max(1) as f64),
                ("HAS_RING", b(cfg.has_local())),
            ],
            &[&s.step, &s.row_info, &s.ids, &cache.history, &cache.lpos, &cache.lens],
            Grid::Tokens(1),
        ));
        let mut head_dispatches = vec![bld.dispatch(
            Kernel::RmsNorm,
            vec![
                ("D", d as f64),
                ("EPS", cfg.norm_eps as f64),
                ("HAS_WEIGHT", b(gw.final_norm.is_some())),
                ("GATHER_LAST", 1.0),
            ],
            // no QUANTIZE: rows without tokens keep last_h, and xq is every product's scratch
            &[&s.step, &s.row_info, &s.x, gw.final_norm.as_ref().unwrap_or(&s.dummy), &s.last_h, &s.dummy_rw],
            Grid::Rows(Kernel::RmsNorm.workgroup_size() as usize),
        )];
        let head = gw.head.as_ref().unwrap_or(&gw.embed);
        let softcap = cfg.logit_softcap.unwrap_or(0.0);
        head_dispatches.extend(
            bld.product(head, Product { per_row: true, softcap, ..Product::new(&s.last_h, d, &s.logits, cfg.vocab) }),
        );
        // all-position logits (speculative verify): final norm of every token into h, LM head
        let mut all_head_dispatches = vec![bld.norm(&s.x, gw.final_norm.as_ref(), &s.h, false)];
        all_head_dispatches.extend(bld.product(
            head,
            Product { softcap, quantized: bld.norm_quantizes(), ..Product::new(&s.h, d, &s.all_logits, cfg.vocab) },
        ));
        let sampling = RowSampling::new(gpu, rows, cfg.vocab, opts.logit_bias_slots)?;
        let sample_dispatch = bld.dispatch(
            Kernel::Sample,
            vec![("V", cfg.vocab as f64), ("MASK_WORDS", sampling.words as f64)],
            &[&s.step, &s.row_info, &s.samplers, &s.logits, &s.sampled, &sampling.mask, &sampling.top],
            Grid::WorkgroupPerRow,
        );
        let bias_dispatch = bld.dispatch(
            Kernel::LogitBias,
            vec![("V", cfg.vocab as f64), ("SLOTS", sampling.slots.max(1) as f64)],
            &[&s.step, &s.row_info, &sampling.bias_n, &sampling.bias, &s.logits],
            Grid::Rows(sampling.slots.max(1)),
        );
        Ok(Engine {
            gpu: gpu.clone(),
            cfg,
            pipelines,
            cache,
            chunk,
            s,
            _weights: gw,
            _rope: rope,
            chunk_dispatches,
            head_dispatches,
            all_head_dispatches,
            all_logits_tokens: all_tokens,
            max_window,
            sample_dispatch,
            bias_dispatch,
            sampling,
            stats: Stats::default(),
            profiler: None,
            profiling: false,
            gpu_bytes: 0,
            attention,
            fusion,
            matmul,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The cache (lengths, history, sizes).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Most new tokens per row in one chunk (one submit).
    pub fn chunk_width(&self) -> usize {
        self.chunk
    }

    /// Dispatches recorded per decode step of one token when logits are returned (sampling adds
    /// one).
    pub fn dispatches_per_chunk(&self) -> usize {
        self.chunk_dispatches.iter().chain(&self.head_dispatches).filter(|d| d.live(1, 1)).count()
    }

    /// Which kernels this engine runs fused ([`EngineOptions::fusion`] resolved).
    pub fn fusion(&self) -> Fusion {
        self.fusion
    }

    /// The product kernel this engine built ([`EngineOptions::matmul`] resolved; never `Auto`).
    pub fn matmul_kernel(&self) -> MatmulKernel {
        self.matmul
    }

    /// The attention kernel this engine built ([`EngineOptions::attention`] resolved).
    pub fn attention_kernel(&self) -> AttentionKernel {
        self.attention.kernel
    }

    /// Token groups per full chunk in attention: the split kernel's scratch holds one group of
    /// tokens, so a chunk with more tokens records one (partials, merge) pair per group (1 for
    /// the serial kernel, and for every chunk that fits one group, as decode steps do).
    pub fn attention_token_groups(&self) -> usize {
        self.attention.groups
    }

    /// Tokens per query tile of split-group attention in steps of [`QUERY_TILE_MIN_WIDTH`] tokens a
    /// row or more (1: no query tiles; other variants, or heads too large for two tokens).
    pub fn attention_query_tile(&self) -> usize {
        self.attention.query_tile
    }

    /// Tokens (rows x width) [`Engine::append_all_logits`] can return at once.
    pub fn all_logits_tokens(&self) -> usize {
        self.all_logits_tokens
    }

    /// Most steps per [`Engine::decode_steps`] window (`rollback + 1`).
    pub fn max_window(&self) -> usize {
        self.max_window
    }

    /// Distinct compute pipelines built.
    pub fn pipeline_count(&self) -> usize {
        self.pipelines.len()
    }

    /// Bytes the model's matrices take on the GPU (quantized blocks stay quantized, 16-bit weights
    /// stay 16-bit).
    pub fn weight_bytes(&self) -> u64 {
        self._weights.matrix_bytes()
    }

    /// Counters since construction.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Empty these cache rows (new sequences start there).
    pub fn reset(&mut self, rows: &[usize]) -> Result<()> {
        self.gpu.check()?;
        self.cache.reset(&self.gpu, rows)?;
        self.sampling.clear(&self.gpu, rows);
        Ok(())
    }

    /// Remove the last `n[i]` tokens of `rows[i]` exactly (see [`KvCache::rollback`]).
    pub fn rollback(&mut self, rows: &[usize], n: &[usize]) -> Result<()> {
        self.gpu.check()?;
        self.cache.rollback(&self.gpu, rows, n)
    }

    /// Add `bias` (token, value; values for the same token add up) to `row`'s logits whenever the
    /// row is sampled, replacing its earlier bias (OpenAI's `logit_bias`). Only sampling sees it:
    /// the logits [`Engine::append`] returns are the model's. Cleared by a reset.
    pub fn set_logit_bias(&mut self, row: usize, bias: &[(u32, f32)]) -> Result<()> {
        self.cache.check_rows(&[row])?;
        self.sampling.set_bias(&self.gpu, row, bias)
    }

    /// Add `delta` to `row`'s bias of `token` (presence and frequency penalties, as tokens come).
    pub fn add_logit_bias(&mut self, row: usize, token: u32, delta: f32) -> Result<()> {
        self.cache.check_rows(&[row])?;
        self.sampling.add_bias(&self.gpu, row, token, delta)
    }

    /// Logit bias entries each row can hold.
    pub fn logit_bias_slots(&self) -> usize {
        self.sampling.slots
    }

    /// `row`'s logit bias, one entry per token.
    pub fn logit_bias(&self, row: usize) -> &[(u32, f32)] {
        self.sampling.bias(row)
    }

    /// Sample `row` only among the tokens whose bit is set in `allowed` (`ceil(vocab / 32)`
    /// words, bit `i % 32` of word `i / 32` for token `i`), or among all tokens (`None`):
    /// constrained decoding. A mask that allows no token is an error. Cleared by a reset.
    pub fn set_token_mask(&mut self, row: usize, allowed: Option<&[u32]>) -> Result<()> {
        self.cache.check_rows(&[row])?;
        self.sampling.set_mask(&self.gpu, row, allowed)
    }

    /// Advance the positions of `rows[i]` by `n[i]` without storing anything: padding that no later
    /// query sees (see [`KvCache::skip`]).
    pub fn skip(&mut self, rows: &[usize], n: &[usize]) -> Result<()> {
        self.gpu.check()?;
        self.cache.skip(rows, n)
    }

    /// Make `row` hold `tokens` but the last (which the caller feeds to the first decode step),
    /// computing as little as possible: the row keeps the longest prefix of `tokens` it already
    /// holds (rolling back what differs when that is within [`KvCache::max_rollback`], else
    /// starting over from the prompt cache's longest prefix), and prefills only the rest. A
    /// conversation continues on its row this way without recomputing earlier turns. Returns
    /// how many tokens were not computed again. Bad input (an empty `tokens`, a row out of
    /// range, a bad id, more than `max_len`) changes nothing; a pool out of blocks leaves the row
    /// holding the prefix it kept.
    pub fn continue_row(&mut self, row: usize, tokens: &[u32]) -> Result<usize> {
        self.gpu.check()?;
        self.cache.check_rows(&[row])?;
        let Some((_, head)) = tokens.split_last() else {
            return Err(Error::Input(format!("row {row}: continue_row needs at least one token")));
        };
        if tokens.len() > self.cache.max_len() {
            return Err(Error::CacheFull { row, len: 0, n_new: tokens.len(), max_len: self.cache.max_len() });
        }
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= self.cfg.vocab) {
            return Err(Error::Input(format!(
                "row {row}: token {i} = {t} is outside the vocabulary ({})",
                self.cfg.vocab
            )));
        }
        let held = self.cache.history(row);
        let common = held.iter().zip(head).take_while(|(a, b)| a == b).count();
        let back = held.len() - common;
        let mut kept = common;
        if self.cache.skips[row].is_empty() && back <= self.cache.max_rollback(row) {
            self.rollback(&[row], &[back])?;
        } else {
            self.reset(&[row])?;
            kept = self.reuse_prefix(row, tokens)?;
        }
        let rest = &head[kept..];
        if !rest.is_empty() {
            self.feed(rest, rest.len(), &[rest.len()], Some(&[row]))?;
        }
        Ok(kept)
    }

    /// Claim `rows` for `owner` ([`KvCache::claim`]): a scheduler, rollouts and direct callers
    /// sharing this engine take rows through here, so none takes another's.
    pub fn claim_rows(&mut self, owner: RowOwner, rows: &[usize]) -> Result<()> {
        self.cache.claim(owner, rows)
    }

    /// Claim `n` free rows for `owner`, lowest first ([`KvCache::claim_free`]).
    pub fn claim_free_rows(&mut self, owner: RowOwner, n: usize) -> Result<Vec<usize>> {
        self.cache.claim_free(owner, n)
    }

    /// Give back those of `rows` that `owner` holds (their contents stay until a reset).
    pub fn release_rows(&mut self, owner: RowOwner, rows: &[usize]) {
        self.cache.release(owner, rows)
    }

    /// Start the empty `row` on the longest prefix of `prompt` whose full blocks of global K/V
    /// the prompt cache holds (left by any row, finished or not), leaving at least one token to
    /// compute; returns the tokens it now holds, `n`: append `prompt[n..]` next. The row is then
    /// bit for bit as if it had computed them. Models with local layers also need each ring as it
    /// stands at the reuse point, which the pool does not hold: the row recomputes the last
    /// `local layers x W + rollback` positions before it (a few blocks) without writing their
    /// global K/V, since each local layer's window reaches that far back through the ones before
    /// it; a prefix shorter than that is not reused. 0 when nothing is reused. Errors when the
    /// row is out of range or not empty; nothing changes then.
    pub fn reuse_prefix(&mut self, row: usize, prompt: &[u32]) -> Result<usize> {
        self.gpu.check()?;
        let (start, end) = self.cache.adopt_prefix(&self.gpu, row, prompt)?;
        if end > start {
            self.cache.replay_until[row] = end;
            let replayed = self.feed(&prompt[start..end], end - start, &[end - start], Some(&[row]));
            self.cache.replay_until[row] = 0;
            if let Err(e) = replayed {
                self.reset(&[row])?;
                return Err(e);
            }
        }
        Ok(end)
    }

    /// Copy row `src` into rows `dst` on the GPU: they continue from the same prefix without
    /// recomputing it (GRPO-style k samples per prompt).
    ///
    /// The destinations' sampling state (logit bias, token mask) is cleared, not copied: each
    /// fork samples with what its caller sets.
    pub fn fork(&mut self, src: usize, dst: &[usize]) -> Result<()> {
        self.gpu.check()?;
        self.cache.fork(&self.gpu, src, dst)?;
        self.sampling.clear(&self.gpu, dst);
        Ok(())
    }

    /// Feed a right-padded chunk `ids` (`[R, width]`, row-major); chunk row `r` has `n_new[r]` real
    /// tokens (0 leaves the row untouched). `rows`: the cache rows the chunk rows refer to (a
    /// sub-batch); `None` means all cache rows in order. Returns the logits at each row's last real
    /// token. Everything is checked before anything is written: on error no row changes.
    /// (Blocks until the GPU is done; [`Engine::append_async`] is the same without blocking.)
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append(&mut self, ids: &[u32], width: usize, n_new: &[usize], rows: Option<&[usize]>) -> Result<Logits> {
        pollster::block_on(self.append_async(ids, width, n_new, rows))
    }

    /// [`Engine::append`] that awaits the readback instead of blocking (the browser's form).
    pub async fn append_async(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
    ) -> Result<Logits> {
        let mark = self.cache.mark();
        let any = self.run(ids, width, n_new, rows, None, Output::Logits)?;
        let mut data = vec![0f32; n_new.len() * self.cfg.vocab];
        if any {
            let read = self.read_async(&self.s.logits_read, bytemuck::cast_slice_mut(&mut data)).await;
            self.undo_if_lost(read, &mark)?;
        }
        Ok(Logits { vocab: self.cfg.vocab, data, valid: n_new.iter().map(|&n| n > 0).collect() })
    }

    /// Like [`Engine::append`], but reads nothing back (prefill and tool results whose logits
    /// nobody needs): the call returns as soon as the work is submitted.
    pub fn feed(&mut self, ids: &[u32], width: usize, n_new: &[usize], rows: Option<&[usize]>) -> Result<()> {
        self.run(ids, width, n_new, rows, None, Output::None).map(|_| ())
    }

    /// One append (at most [`Engine::chunk_width`] tokens per row, so one submit), with every
    /// dispatch timed by timestamp queries: GPU time per kernel class. The append itself is real
    /// (the rows advance); with `samplers` the step also samples, as a decode step does. For
    /// benchmarks: the dispatches run in separate passes and the call waits for the timestamps.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn profile_step(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: Option<&[Sampler]>,
    ) -> Result<crate::profile::Profile> {
        if width > self.chunk {
            return Err(Error::Input(format!(
                "profile_step: width {width} is more than one chunk ({} tokens per row)",
                self.chunk
            )));
        }
        if self.profiler.is_none() {
            let most = self.chunk_dispatches.len() + self.all_head_dispatches.len().max(self.head_dispatches.len()) + 2;
            self.profiler = Some(crate::profile::Profiler::new(&self.gpu.device, most)?);
        }
        self.profiling = true;
        let ran = self.run(ids, width, n_new, rows, samplers, Output::None);
        self.profiling = false;
        if !ran? {
            return Ok(Default::default());
        }
        let p = self.profiler.as_ref().expect("made above");
        let got = p.read(&self.gpu);
        self.gpu.check()?;
        got
    }

    /// The device's copy bandwidth in bytes per second (read plus write), from a plain copy
    /// kernel over `bytes` bytes timed with timestamp queries (best of 3): the limit the bench's
    /// effective weight bandwidth is a fraction of.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn copy_bandwidth(&self, bytes: u64) -> Result<f64> {
        let bytes = bytes.min(self.gpu.max_binding()) / 16 * 16;
        if bytes == 0 {
            return Err(Error::Input("copy_bandwidth: no bytes to copy".into()));
        }
        let mut p = crate::profile::Profiler::new(&self.gpu.device, 1)?;
        let usage = wgpu::BufferUsages::STORAGE;
        let buf = |label| {
            self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        let (src, dst) = (buf("copy src"), buf("copy dst"));
        let n4 = (bytes / 16) as usize;
        let wg = Kernel::Copy.workgroup_size() as usize;
        let pipeline = self.pipelines.get(Kernel::Copy, &vec![("N4", n4 as f64)]);
        let bind = self.pipelines.bind(Kernel::Copy, &[&src, &dst]);
        let groups = n4.div_ceil(wg);
        let (x, y) = (groups.min(65535), groups.div_ceil(65535));
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("copy bandwidth"),
                    timestamp_writes: p.writes(0),
                });
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &bind, &[]);
                pass.dispatch_workgroups(x as u32, y as u32, 1);
            }
            p.recorded = vec![Kernel::Copy];
            p.resolve(&mut enc);
            self.gpu.queue.submit([enc.finish()]);
            best = best.min(p.read(&self.gpu)?.total());
        }
        self.gpu.check()?;
        Ok(2.0 * bytes as f64 / best)
    }

    /// Like [`Engine::append`], but samples on the GPU and reads back only the ids: `samplers[r]`
    /// picks chunk row `r`'s next token. Rows that received no token give `None`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_sample(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<u32>>> {
        Ok(self
            .append_sample_logprobs(ids, width, n_new, rows, samplers)?
            .into_iter()
            .map(|o| o.map(|x| x.0))
            .collect())
    }

    /// [`Engine::append_sample`] that also returns each sampled token's log-probability.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_sample_logprobs(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<(u32, f32)>>> {
        pollster::block_on(self.append_sample_logprobs_async(ids, width, n_new, rows, samplers))
    }

    /// [`Engine::append_sample_logprobs`] that awaits the readback instead of blocking.
    pub async fn append_sample_logprobs_async(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<(u32, f32)>>> {
        let got = self.append_sample_full_async(ids, width, n_new, rows, samplers).await?;
        Ok(got.into_iter().map(|o| o.map(|s| (s.token, s.logprob))).collect())
    }

    /// [`Engine::append_sample`] that returns each sampled token with its log-probability and,
    /// for samplers that ask (`top_logprobs`), the most likely alternatives.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_sample_full(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<Sampled>>> {
        pollster::block_on(self.append_sample_full_async(ids, width, n_new, rows, samplers))
    }

    /// [`Engine::append_sample_full`] that awaits the readback instead of blocking.
    pub async fn append_sample_full_async(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<Sampled>>> {
        let top = samplers.iter().any(|s| s.top_logprobs > 0);
        let mark = self.cache.mark();
        let any = self.run(ids, width, n_new, rows, Some(samplers), Output::Sampled { slot: 0, top })?;
        let r_n = n_new.len();
        let mut got = vec![0u32; 2 * r_n];
        let mut alts = vec![0u32; if top { r_n * TOP_LOGPROBS_MAX as usize * 2 } else { 0 }];
        if any {
            let read = self.read_async(&self.s.sampled_read, bytemuck::cast_slice_mut(&mut got)).await;
            self.undo_if_lost(read, &mark)?;
            if top {
                let read = self.read_async(&self.sampling.top_read, bytemuck::cast_slice_mut(&mut alts)).await;
                self.undo_if_lost(read, &mark)?;
            }
        }
        Ok((0..r_n)
            .map(|r| {
                (n_new[r] > 0).then(|| {
                    let n = samplers[r].top_logprobs as usize;
                    let at = r * TOP_LOGPROBS_MAX as usize * 2;
                    let top = (0..n).map(|k| (alts[at + 2 * k], f32::from_bits(alts[at + 2 * k + 1]))).collect();
                    Sampled { token: got[r], logprob: f32::from_bits(got[r_n + r]), top }
                })
            })
            .collect())
    }

    /// Validate a call; the error names the row, index or limit.
    pub(crate) fn check(
        &self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
    ) -> Result<Vec<usize>> {
        self.gpu.check()?;
        let cache_rows: Vec<usize> = match rows {
            Some(r) => {
                self.cache.check_rows(r)?;
                r.to_vec()
            }
            None => (0..self.cache.rows()).collect(),
        };
        let r_n = cache_rows.len();
        if n_new.len() != r_n {
            return Err(Error::Input(format!("n_new has {} entries for {r_n} chunk rows", n_new.len())));
        }
        if ids.len() != r_n * width {
            return Err(Error::Input(format!(
                "ids has {} entries, expected rows {r_n} x width {width} = {}",
                ids.len(),
                r_n * width
            )));
        }
        for (r, (&n, &row)) in n_new.iter().zip(&cache_rows).enumerate() {
            if n > width {
                return Err(Error::Input(format!("chunk row {r} (cache row {row}): n_new {n} > width {width}")));
            }
            for j in 0..n {
                let id = ids[r * width + j];
                if id as usize >= self.cfg.vocab {
                    return Err(Error::Input(format!(
                        "chunk row {r} (cache row {row}), token {j}: id {id} is outside the vocabulary ({})",
                        self.cfg.vocab
                    )));
                }
            }
            let len = self.cache.position(row);
            if len + n > self.cache.max_len() {
                return Err(Error::CacheFull { row, len, n_new: n, max_len: self.cache.max_len() });
            }
        }
        Ok(cache_rows)
    }

    /// Reserve the global K/V blocks of `n_new[i]` tokens of `cache_rows[i]` (see
    /// [`KvCache::reserve`]): after every check of a call, before its first submit.
    pub(crate) fn reserve_blocks(&mut self, cache_rows: &[usize], n_new: &[usize]) -> Result<()> {
        self.cache.reserve(&self.gpu, cache_rows, n_new)
    }

    /// Write one chunk's shape, rows and ids, record every dispatch of `out` into one encoder and
    /// submit it. `n_sub[r]` tokens of chunk row `r` start at `ids[r * stride + start]`; with
    /// `ids_from_sampled`, the ids are instead last step's sampled ids (one per row, on the GPU).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn submit_chunk(
        &mut self,
        cache_rows: &[usize],
        n_sub: &[usize],
        ids: &[u32],
        stride: usize,
        start: usize,
        samplers: Option<&[Sampler]>,
        ids_from_sampled: bool,
        out: Output,
    ) {
        let r_n = cache_rows.len();
        let c = n_sub.iter().copied().max().unwrap_or(0);
        let q = &self.gpu.queue;
        let step = StepGpu { rows: r_n as u32, width: c as u32, tokens: (r_n * c) as u32, _pad: 0 };
        let info: Vec<RowInfoGpu> = cache_rows
            .iter()
            .zip(n_sub)
            .map(|(&row, &n)| RowInfoGpu {
                cache_row: row as u32,
                n_new: n as u32,
                pos0: self.cache.lens_cpu[row] as u32,
                rope_pos0: self.cache.position(row) as u32,
                global_from: self.cache.replay_until[row] as u32,
                _pad: [0; 3],
            })
            .collect();
        q.write_buffer(&self.s.step, 0, bytemuck::bytes_of(&step));
        q.write_buffer(&self.s.row_info, 0, bytemuck::cast_slice(&info));
        if !ids_from_sampled {
            let mut chunk_ids = vec![0u32; r_n * c];
            for r in 0..r_n {
                for j in 0..n_sub[r] {
                    chunk_ids[r * c + j] = ids[r * stride + start + j];
                }
            }
            q.write_buffer(&self.s.ids, 0, bytemuck::cast_slice(&chunk_ids));
        }
        if let Some(sm) = samplers {
            let g: Vec<SamplerGpu> = sm
                .iter()
                .zip(cache_rows)
                .zip(n_sub)
                .map(|((s, &row), &n)| {
                    SamplerGpu::new(s, (self.cache.lens_cpu[row] + n) as u32, self.sampling.masked[row])
                })
                .collect();
            q.write_buffer(&self.s.samplers, 0, bytemuck::cast_slice(&g));
        }
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("chunk") });
        self.cache.record_pending_copies(&mut enc);
        if ids_from_sampled {
            enc.copy_buffer_to_buffer(&self.s.sampled, 0, &self.s.ids, 0, (r_n * 4) as u64);
        }
        {
            let head = match out {
                Output::AllLogits => &self.all_head_dispatches,
                _ => &self.head_dispatches,
            };
            let mut all: Vec<&Dispatch> = self
                .chunk_dispatches
                .iter()
                .chain(head)
                .filter(|d| d.live(r_n, c))
                .map(|d| d.for_chunk(r_n, c))
                .collect();
            if samplers.is_some() {
                if self.sampling.any_bias(cache_rows) {
                    all.push(&self.bias_dispatch);
                }
                all.push(&self.sample_dispatch);
            }
            match self.profiler.as_mut().filter(|_| self.profiling) {
                // profiled: one pass per dispatch, timestamps around each
                Some(p) => {
                    for (i, d) in all.iter().enumerate() {
                        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some("profiled"),
                            timestamp_writes: p.writes(i),
                        });
                        d.record(&mut pass, r_n, c);
                    }
                    p.recorded = all.iter().map(|d| d.kernel).collect();
                    p.resolve(&mut enc);
                }
                None => {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("chunk"),
                        timestamp_writes: None,
                    });
                    for d in &all {
                        d.record(&mut pass, r_n, c);
                    }
                }
            }
            self.stats.dispatches += all.len() as u64;
        }
        match out {
            Output::None => {}
            Output::Logits => {
                let bytes = (r_n * self.cfg.vocab * 4) as u64;
                enc.copy_buffer_to_buffer(&self.s.logits, 0, &self.s.logits_read, 0, bytes);
            }
            Output::AllLogits => {
                let bytes = (r_n * c * self.cfg.vocab * 4) as u64;
                enc.copy_buffer_to_buffer(&self.s.all_logits, 0, &self.s.all_logits_read, 0, bytes);
            }
            Output::Sampled { slot, top } => {
                let bytes = (r_n * 8) as u64;
                enc.copy_buffer_to_buffer(&self.s.sampled, 0, &self.s.sampled_read, slot as u64 * bytes, bytes);
                if top {
                    let bytes = (r_n * TOP_LOGPROBS_MAX as usize * 8) as u64;
                    enc.copy_buffer_to_buffer(&self.sampling.top, 0, &self.sampling.top_read, 0, bytes);
                }
            }
        }
        q.submit([enc.finish()]);
        self.stats.submits += 1;
        self.stats.chunks += 1;
        for (r, &row) in cache_rows.iter().enumerate() {
            let n = n_sub[r];
            self.cache.lens_cpu[row] += n;
            self.cache.written[row] = self.cache.written[row].max(self.cache.lens_cpu[row]);
            if !ids_from_sampled {
                self.cache.history_cpu[row].extend_from_slice(&ids[r * stride + start..r * stride + start + n]);
            }
            self.cache.register_blocks(row);
        }
    }

    /// Split an append into chunks of at most `chunk` tokens per row and submit them; only the
    /// last chunk copies `out` for readback. Returns whether any row had tokens.
    fn run(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: Option<&[Sampler]>,
        out: Output,
    ) -> Result<bool> {
        let cache_rows = self.check(ids, width, n_new, rows)?;
        if let Some(samplers) = samplers {
            if samplers.len() != n_new.len() {
                return Err(Error::Input(format!("{} samplers for {} chunk rows", samplers.len(), n_new.len())));
            }
            for (r, s) in samplers.iter().enumerate() {
                s.check(r)?;
            }
        }
        let longest = n_new.iter().copied().max().unwrap_or(0);
        if longest == 0 {
            return Ok(false);
        }
        self.reserve_blocks(&cache_rows, n_new)?;
        let n_chunks = longest.div_ceil(self.chunk);
        for ci in 0..n_chunks {
            let start = ci * self.chunk;
            let n_sub: Vec<usize> = n_new.iter().map(|&n| n.saturating_sub(start).min(self.chunk)).collect();
            let last = ci + 1 == n_chunks;
            self.submit_chunk(
                &cache_rows,
                &n_sub,
                ids,
                width,
                start,
                samplers,
                false,
                if last { out } else { Output::None },
            );
        }
        Ok(true)
    }

    /// Like [`Engine::append`], but returns the logits at every real token of every row
    /// (`[row][token][vocab]`), for speculative verification. The whole call must fit one chunk:
    /// at most [`Engine::chunk_width`] tokens per row and `all_logits_tokens` (rows x width) in all.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_all_logits(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        pollster::block_on(self.append_all_logits_async(ids, width, n_new, rows))
    }

    /// [`Engine::append_all_logits`] that awaits the readback instead of blocking.
    pub async fn append_all_logits_async(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let longest = n_new.iter().copied().max().unwrap_or(0);
        if longest > self.chunk || n_new.len() * longest > self.all_logits_tokens {
            return Err(Error::Limit(format!(
                "all-position logits for {} rows x {longest} tokens exceed one chunk ({} tokens per row, {} tokens in all)",
                n_new.len(),
                self.chunk,
                self.all_logits_tokens
            )));
        }
        let mark = self.cache.mark();
        let any = self.run(ids, width, n_new, rows, None, Output::AllLogits)?;
        let v = self.cfg.vocab;
        let mut data = vec![0f32; n_new.len() * longest * v];
        if any {
            let read = self.read_async(&self.s.all_logits_read, bytemuck::cast_slice_mut(&mut data)).await;
            self.undo_if_lost(read, &mark)?;
        }
        Ok(n_new
            .iter()
            .enumerate()
            .map(|(r, &n)| (0..n).map(|j| data[(r * longest + j) * v..(r * longest + j + 1) * v].to_vec()).collect())
            .collect())
    }

    /// Test hook: group `g`'s global K and V as bytes of `[rows, n_kv_heads, max_len + 1,
    /// head_dim]` as the rows see them through their block tables: positions without a block
    /// read as zeros, and position `max_len` shows the row's shard's scratch block (where
    /// padding goes; its first position). Allocates; not for decoding.
    #[doc(hidden)]
    #[cfg(not(target_arch = "wasm32"))]
    pub fn debug_read_global(&self, g: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let cache = &self.cache;
        let shards = cache.global.get(g).ok_or_else(|| Error::Input(format!("no group {g}")))?;
        let (hk, d, bl) = (self.cfg.n_kv_heads, self.cfg.head_dim, cache.block_len());
        let es = cache.dtype().bytes();
        let slots = cache.max_len() + 1;
        let mut out = (vec![0u8; cache.rows() * hk * slots * d * es], vec![0u8; cache.rows() * hk * slots * d * es]);
        for (si, shard) in shards.iter().enumerate() {
            let pool = self.debug_read(shard)?;
            for (v, view) in [(0, &mut out.0), (1, &mut out.1)] {
                for row in (0..cache.rows()).filter(|&r| cache.blocks.shard_of(r) == si) {
                    let table = cache.blocks.table(row);
                    for h in 0..hk {
                        for p in 0..slots {
                            let (blk, off) = match table.get(p / bl) {
                                Some(&blk) if p < cache.max_len() => (blk as usize, p % bl),
                                _ if p == cache.max_len() => (0, 0),
                                _ => continue,
                            };
                            let from = (((blk * 2 + v) * hk + h) * bl + off) * d * es;
                            let to = ((row * hk + h) * slots + p) * d * es;
                            view[to..to + d * es].copy_from_slice(&pool[from..from + d * es]);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn debug_read(&self, src: &wgpu::Buffer) -> Result<Vec<u8>> {
        let size = src.size();
        let staging = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("debug readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, 0, &staging, 0, size);
        self.gpu.queue.submit([enc.finish()]);
        let mut out = vec![0u8; size as usize];
        pollster::block_on(self.read_async(&staging, &mut out))?;
        Ok(out)
    }

    /// Map a readback buffer and copy its first `out.len()` bytes. Natively the map completes
    /// inside `poll`; in the browser the event loop completes it while this awaits.
    pub(crate) async fn read_async(&self, buf: &wgpu::Buffer, out: &mut [u8]) -> Result<()> {
        let read = self.read_raw(buf, out).await;
        // a lost device (or an error the step raised) explains a failed read better than the read
        self.gpu.check()?;
        read
    }

    /// A readback's result; when the device was lost while the step was in flight, first put the
    /// rows' host-side state back to `mark`. A browser learns of a loss only asynchronously, so a
    /// step can be submitted to a device that is already gone: it still changes nothing.
    pub(crate) fn undo_if_lost(&mut self, read: Result<()>, mark: &crate::cache::HostMark) -> Result<()> {
        if let Err(Error::DeviceLost(_)) = &read {
            self.cache.restore_host(mark);
        }
        read
    }

    async fn read_raw(&self, buf: &wgpu::Buffer, out: &mut [u8]) -> Result<()> {
        let slice = buf.slice(..out.len() as u64);
        let (tx, rx) = futures_channel::oneshot::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        #[cfg(not(target_arch = "wasm32"))]
        self.gpu
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Device(format!("waiting for the GPU: {e}")))?;
        rx.await
            .map_err(|_| Error::Device("readback callback never ran".into()))?
            .map_err(|e| Error::Device(format!("readback failed: {e}")))?;
        {
            let view = slice.get_mapped_range().map_err(|e| Error::Device(format!("readback map: {e}")))?;
            out.copy_from_slice(&view);
        }
        buf.unmap();
        Ok(())
    }
}

/// What a chunk copies out for readback.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Output {
    None,
    /// Logits at each row's last real token.
    Logits,
    /// Logits at every token of the chunk.
    AllLogits,
    /// Sampled ids and their logprobs, into window slot `slot`; with `top`, also the most
    /// likely alternatives (single steps only).
    Sampled {
        slot: usize,
        top: bool,
    },
}
