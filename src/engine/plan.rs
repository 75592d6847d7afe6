//! An engine's plan, decided once from the model, the options and the adapter before anything
//! is built: how attention runs (variant, partitions, token groups, query tiles) and the RoPE
//! tables each layer reads. `build.rs` and `builder.rs` both read it.

use crate::engine::options::EngineOptions;
use crate::error::{Error, Result};
use crate::gpu::device::Gpu;
use crate::gpu::variants::AttentionKernel;
use crate::model::config::ModelConfig;
use crate::model::rope::Rope;

/// How attention runs in one engine: the variant, and for the split one its partition size and
/// how many tokens one dispatch handles (the partials scratch holds one group of tokens).
#[derive(Clone, Copy, Debug)]
pub(super) struct AttentionPlan {
    pub(super) kernel: AttentionKernel,
    /// Keys per tile inside a partition (scores of one tile sit in workgroup memory).
    pub(super) tile: usize,
    /// Positions per partition (a multiple of `tile`).
    pub(super) span: usize,
    /// Partitions per query: `ceil(max_len / span)`.
    pub(super) parts: usize,
    /// Tokens per query tile (split-group's `query_tiles`, steps of several tokens a row); 1: none.
    pub(super) query_tile: usize,
    /// Tokens per dispatch.
    pub(super) group_tokens: usize,
    /// Token groups per chunk.
    pub(super) groups: usize,
}

/// Most bytes of split-attention partials: one group of tokens at a time.
const PARTIALS_BYTES: usize = 16 << 20;

impl AttentionPlan {
    pub(super) fn new(cfg: &ModelConfig, opts: &EngineOptions, gpu: &Gpu, tokens: usize) -> Result<Self> {
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

/// The RoPE (cos, sin) tables `[max_len, head_dim / 2]`: one buffer per distinct [`Rope`] of the
/// layers, and the one each layer reads.
pub(crate) struct RopeTables {
    buffers: Vec<wgpu::Buffer>,
    /// Per layer: index into `buffers` (`None`: a NoPE layer).
    of_layer: Vec<Option<usize>>,
}

impl RopeTables {
    pub(super) fn new(gpu: &Gpu, cfg: &ModelConfig, max_len: usize) -> Result<Self> {
        let mut made: Vec<Rope> = Vec::new();
        let mut tables = RopeTables { buffers: Vec::new(), of_layer: Vec::new() };
        for i in 0..cfg.n_layers() {
            let Some(rope) = cfg.layer_rope(i) else {
                tables.of_layer.push(None);
                continue;
            };
            let k = match made.iter().position(|r| *r == rope) {
                Some(k) => k,
                None => {
                    let table = rope.table(cfg.head_dim, max_len);
                    let label =
                        format!("rope theta {}{}", rope.theta, if rope.scaling.is_some() { " scaled" } else { "" });
                    tables.buffers.push(gpu.storage_init(&label, bytemuck::cast_slice(&table))?);
                    made.push(rope);
                    made.len() - 1
                }
            };
            tables.of_layer.push(Some(k));
        }
        Ok(tables)
    }

    /// The table layer `i` rotates by (`None`: it rotates nothing).
    pub(super) fn layer(&self, i: usize) -> Option<&wgpu::Buffer> {
        self.of_layer[i].map(|k| &self.buffers[k])
    }
}
