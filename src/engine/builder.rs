//! The per-layer builder: every dispatch of a chunk, built once at `Engine::new` from the typed
//! constants of each kernel. [`Builder::layer`] reads as one layer's dispatch order.

use std::sync::Arc;

use crate::cache::KvCache;
use crate::engine::dispatch::{Dispatch, Grid};
use crate::engine::plan::{AttentionPlan, RopeTables};
use crate::engine::Scratch;
use crate::gpu::kernels::{self, Lanes, Paging, Shard, Specialize};
use crate::gpu::lora::{GroupBuffer, LoraGroup};
use crate::gpu::shaders::{Kernel, Pipelines};
use crate::gpu::variants::{AttentionKernel, Fusion, QUERY_TILE_MIN_WIDTH};
use crate::gpu::weights::{GpuLayer, GpuMatrix, GpuWeights, QkvWeights};
use crate::model::config::{MlpKind, ModelConfig};

/// Where a matrix product reads and writes: `y[n, y_offset + o] (+)= x[n, ..K] . W[o]`, with rows
/// of `x_stride` floats in x and `y_stride` in y; `per_row`: x holds one row per chunk row (the LM
/// head); `softcap` > 0 caps the outputs.
pub(super) struct ProductIo<'a> {
    pub(super) x: &'a wgpu::Buffer,
    pub(super) x_stride: usize,
    pub(super) y: &'a wgpu::Buffer,
    pub(super) y_stride: usize,
    pub(super) y_offset: usize,
    pub(super) accumulate: bool,
    pub(super) per_row: bool,
    pub(super) softcap: f32,
    /// Fused RMS norm of x (over K) with this weight (`Some(None)`: no weight).
    pub(super) norm: Option<Option<&'a wgpu::Buffer>>,
    /// Fused MLP activation (`mlp_act.wgsl`'s code); a gated one pairs output o with weight row
    /// `rows / 2 + o`, so the product has half as many outputs as the matrix has rows.
    pub(super) act: Option<MlpKind>,
    /// `xq` already holds x quantized for the integer-dot products.
    pub(super) quantized: bool,
    /// The LoRA adapters' epilogue: their `B (A x)` added to each output.
    pub(super) lora: Option<LoraIo<'a>>,
}

/// A product's LoRA epilogue: its group's adapters (whose `A x` the group's `lora.wgsl` dispatch
/// wrote to `lora_ax` just before) and the group's B row of the matrix's row 0.
#[derive(Clone, Copy)]
pub(super) struct LoraIo<'a> {
    pub(super) group: &'a GroupBuffer,
    pub(super) row0: usize,
}

impl<'a> ProductIo<'a> {
    pub(super) fn new(x: &'a wgpu::Buffer, x_stride: usize, y: &'a wgpu::Buffer, y_stride: usize) -> Self {
        ProductIo {
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
            lora: None,
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
    fn to(self, y: &'a wgpu::Buffer, y_stride: usize, y_offset: usize) -> ProductIo<'a> {
        ProductIo {
            y_offset,
            norm: self.norm,
            quantized: self.quantized,
            ..ProductIo::new(self.x, self.d_model, y, y_stride)
        }
    }
}

/// Everything the per-layer builder needs to see while it builds dispatches.
pub(super) struct Builder<'a> {
    pub(super) cfg: &'a ModelConfig,
    pub(super) pipelines: &'a Pipelines,
    /// The distinct pipelines the dispatches built so far use (by address).
    pub(super) built: std::cell::RefCell<std::collections::HashSet<usize>>,
    pub(super) cache: &'a KvCache,
    pub(super) s: &'a Scratch,
    pub(super) rope: &'a RopeTables,
    pub(super) gw: &'a GpuWeights,
    /// Subgroup size of the matmul fast path (`None`: the portable kernel).
    pub(super) subgroup: Option<u32>,
    /// Q8_0 / Q4_0 / Q4_1 products take the integer-dot kernel.
    pub(super) int_dot: bool,
    /// Outputs per thread of the portable product (`OUTS` in matmul.wgsl).
    pub(super) outs_per_thread: usize,
    /// The wide products share each block's inputs through subgroups (`main_wide_subgroup`).
    pub(super) wide_subgroup: bool,
    /// Products of many tokens take the mat-mat kernel (`main_tiled`, the `tiled` variant).
    pub(super) tiled: bool,
    /// A workgroup per output sums its lanes in workgroup memory (`main_reduce`, `workgroup`).
    pub(super) workgroup_reduce: bool,
    /// Lanes per workgroup of the products without a fused norm (`WG` in matmul.wgsl). With
    /// `wide_subgroup` and 8, a fused norm keeps them too: it sums through shuffles in the one
    /// 8-lane subgroup (inv_rms_lanes8); else a fused norm takes rmsnorm.wgsl's 64 lanes.
    pub(super) product_wg: u32,
    pub(super) attention: AttentionPlan,
    /// Which kernels run fused.
    pub(super) fusion: Fusion,
    /// MoE layers keep each real token's experts in `route_log` ([`crate::EngineOptions::record_routes`]).
    pub(super) route_log: bool,
}

impl Builder<'_> {
    /// Floats per token row of `qkv`: the queries, then the fresh global K and V.
    fn qkv_stride(&self) -> usize {
        let c = self.cfg;
        (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    }

    /// The dispatch of `spec` over `buffers` (in binding order), its pipeline and bind group
    /// built now and labelled with the variant's name.
    pub(super) fn dispatch(&self, spec: &dyn Specialize, buffers: &[&wgpu::Buffer], grid: Grid) -> Dispatch {
        let (kernel, label) = (spec.kernel(), spec.label());
        let pipeline = self.pipelines.get(spec);
        self.built.borrow_mut().insert(Arc::as_ptr(&pipeline) as usize);
        Dispatch {
            kernel,
            pipeline,
            bind: self.pipelines.bind(kernel, &label, buffers),
            label: label.into(),
            grid,
            wg: spec.workgroup_size(),
            work: spec.work(),
            many_tokens: None,
            uses: buffers.iter().zip(kernel.bindings()).map(|(b, &how)| ((*b).clone(), how)).collect(),
            min_width: 1,
        }
    }

    /// `out (+)= norm(x) [* w]` over rows of d_model; a norm that writes (not adds) also
    /// quantizes its output for the integer-dot products when they run ([`Builder::norm_quantizes`]).
    pub(super) fn norm(
        &self,
        x: &wgpu::Buffer,
        w: Option<&wgpu::Buffer>,
        out: &wgpu::Buffer,
        accumulate: bool,
    ) -> Dispatch {
        self.norm_lanes(x, w, out, accumulate, Kernel::RmsNorm.workgroup_size())
    }

    /// [`Builder::norm`] with `lanes` lanes a token (the final norm's wider workgroup).
    pub(super) fn norm_lanes(
        &self,
        x: &wgpu::Buffer,
        w: Option<&wgpu::Buffer>,
        out: &wgpu::Buffer,
        accumulate: bool,
        lanes: u32,
    ) -> Dispatch {
        let c = self.cfg;
        let quantize = !accumulate && self.norm_quantizes();
        let spec = kernels::RmsNorm {
            d: c.d_model,
            eps: c.norm_eps,
            weight: w.is_some(),
            accumulate,
            quantize,
            gather_last: false,
            lanes,
        };
        self.dispatch(
            &spec,
            &[
                &self.s.step,
                &self.s.row_info,
                x,
                w.unwrap_or(&self.s.dummy),
                out,
                if quantize { &self.s.xq } else { &self.s.dummy_rw },
            ],
            Grid::Tokens(lanes as usize),
        )
    }

    /// Whether the norms before products write their output quantized too (integer-dot
    /// products, d_model in whole blocks of 32), sparing the products a quantize dispatch.
    pub(super) fn norm_quantizes(&self) -> bool {
        self.int_dot && self.cfg.d_model.is_multiple_of(32)
    }

    /// The input of a block's products, `norm(x) * weight`: with fusion the products normalize
    /// the residual stream themselves; without, one norm dispatch writes it to `h` first.
    fn block_input<'b>(&'b self, out: &mut Vec<Dispatch>, weight: Option<&'b wgpu::Buffer>) -> BlockInput<'b> {
        let s = self.s;
        if !self.cfg.pre_norms {
            // OLMo 2: the block reads the stream itself
            return BlockInput { x: &s.x, norm: None, d_model: self.cfg.d_model, quantized: false };
        }
        if self.fusion.norm {
            BlockInput { x: &s.x, norm: Some(weight), d_model: self.cfg.d_model, quantized: false }
        } else {
            out.push(self.norm(&s.x, weight, &s.h, false));
            BlockInput { x: &s.h, norm: None, d_model: self.cfg.d_model, quantized: self.norm_quantizes() }
        }
    }

    /// `y (+)= x W^T` over whole rows of x and y, one dispatch per weight part.
    pub(super) fn matmul(
        &self,
        x: &wgpu::Buffer,
        w: &GpuMatrix,
        y: &wgpu::Buffer,
        y_stride: usize,
        accumulate: bool,
    ) -> Vec<Dispatch> {
        self.product(w, ProductIo { accumulate, ..ProductIo::new(x, w.cols, y, y_stride) })
    }

    /// The product kernel and its lanes for a product (`normed`: with a fused norm), and the
    /// grid it needs for `out_rows` outputs.
    fn product_kernel(&self, int_dot: bool, normed: bool, out_rows: usize, per_row: bool) -> (Kernel, Lanes, Grid) {
        let outs = self.outs_per_thread;
        let threads = Grid::Matmul { out_rows, per_row, outs };
        match self.subgroup {
            // the wide shape's threads and workgroups (no barriers: any size will do)
            _ if int_dot => (Kernel::MatmulInt, Lanes::Threads { outs, wg: self.product_wg }, threads),
            Some(sg) => (Kernel::MatmulSubgroup, Lanes::Subgroup(sg), Grid::MatmulPerOutput { out_rows, per_row }),
            _ if self.workgroup_reduce => {
                (Kernel::MatmulReduce, Lanes::Fixed, Grid::MatmulPerOutput { out_rows, per_row })
            }
            // one output per thread stages the normed input (`main_normed`); the wide shape
            // reads it straight from x, each value computed once per 4 outputs
            None if normed && outs == 1 => {
                (Kernel::MatmulNormed, Lanes::Fixed, Grid::Matmul { out_rows, per_row, outs: 1 })
            }
            None if self.wide_subgroup => {
                let wg = if normed && self.product_wg != 8 { 64 } else { self.product_wg };
                (Kernel::MatmulWideSubgroup, Lanes::Threads { outs, wg }, threads)
            }
            None => {
                let wg = if normed { 64 } else { self.product_wg };
                let kernel = if outs > 1 { Kernel::MatmulWide } else { Kernel::Matmul };
                (kernel, Lanes::Threads { outs, wg }, threads)
            }
        }
    }

    /// `y[n, y_offset + o] (+)= x[n, ..K] . W[o]` as `io` says, one dispatch per weight part.
    /// Integer-dot products (Q8_0, Q4_0, Q4_1 weights) first quantize their input (`quantize`).
    pub(super) fn product(&self, w: &GpuMatrix, io: ProductIo) -> Vec<Dispatch> {
        let int_dot = self.int_dot && w.format.int_dot() && w.cols.is_multiple_of(32) && io.norm.is_none();
        let quantize = (int_dot && !io.quantized).then(|| self.quantize(io.x, io.x_stride, w.cols, io.per_row));
        quantize
            .into_iter()
            .chain(w.parts.iter().map(|p| {
                let per_row = io.per_row;
                let gated = io.act.is_some_and(|a| a.in_factor() == 2);
                let (out_rows, out_start) = if gated { (p.rows / 2, p.row_start / 2) } else { (p.rows, p.row_start) };
                let (kernel, lanes, grid) = self.product_kernel(int_dot, io.norm.is_some(), out_rows, per_row);
                let spec = kernels::Product {
                    kernel,
                    k: w.cols,
                    x_stride: io.x_stride,
                    out_rows,
                    out_stride: io.y_stride,
                    out_offset: io.y_offset + out_start,
                    format: w.format,
                    accumulate: io.accumulate,
                    softcap: io.softcap,
                    per_row,
                    norm: io.norm.map(|weight| kernels::FusedNorm { weight: weight.is_some(), eps: self.cfg.norm_eps }),
                    act: io.act,
                    bias: p.bias.is_some(),
                    lanes,
                    lora: io.lora.map(|l| self.lora_epilogue(l, p.row_start)),
                };
                let norm_w = io.norm.flatten().unwrap_or(&self.s.dummy);
                let bias = p.bias.as_ref().unwrap_or(&self.s.dummy);
                let (ax, ab) = match io.lora {
                    Some(l) => (&self.s.lora_ax, &l.group.buffer),
                    None => (&self.s.dummy, &self.s.dummy),
                };
                if int_dot {
                    let s = self.s;
                    return self.dispatch(
                        &spec,
                        &[&s.step, &s.dummy, &p.buffer, io.y, &s.dummy, bias, ax, ab, &s.xq],
                        grid,
                    );
                }
                let buffers = [&self.s.step, io.x, &p.buffer, io.y, norm_w, bias, ax, ab];
                // `tiled`: the mat-mat form beside the portable one
                let tiled = self.tiled.then(|| {
                    Box::new(self.dispatch(&spec.tiled(), &buffers, Grid::MatmulTiled { out_rows, per_row, gated }))
                });
                Dispatch { many_tokens: tiled, ..self.dispatch(&spec, &buffers, grid) }
            }))
            .collect()
    }

    /// `xq` = the first `k` features of each token (or row) of `x`, quantized per block of 32 for
    /// the integer-dot products.
    fn quantize(&self, x: &wgpu::Buffer, x_stride: usize, k: usize, per_row: bool) -> Dispatch {
        let grid = if per_row { Grid::Rows(k / 32) } else { Grid::Tokens(k / 32) };
        self.dispatch(&kernels::Quantize { k, x_stride, per_row }, &[&self.s.step, x, &self.s.xq], grid)
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
        table: Option<&wgpu::Buffer>,
        pool: Option<&wgpu::Buffer>,
    ) -> Dispatch {
        let c = self.cfg;
        let k_heads = if keys.is_some() { c.n_kv_heads } else { 0 };
        let pairs_per_thread = if pool.is_some() { 2 } else { 1 };
        let spec = kernels::QkRope {
            heads: c.n_heads,
            head_dim: c.head_dim,
            stride,
            qk_norm: c.qk_norm,
            qk_norm_whole: c.qk_norm_whole,
            rotate: table.is_some(),
            q_weight: q_norm.is_some(),
            eps: c.norm_eps,
            t_k_heads: t_keys,
            k_heads,
            k_stride: keys.map_or(1, |k| k.1),
            k_weight: k_norm.is_some(),
            kv_write: pool.map(|_| (self.cache.dtype(), self.paging())),
        };
        // a workgroup per token with a whole-projection norm (its heads meet in workgroup
        // memory), a thread per head with qk-norm (it sums the head's squares), else per rotated
        // pair (two with the pool write)
        let per_token = if c.qk_norm_whole {
            spec.workgroup_size() as usize
        } else if c.qk_norm {
            spec.token_heads()
        } else {
            spec.token_heads() * c.head_dim / 2 / pairs_per_thread
        };
        self.dispatch(
            &spec,
            &[
                &self.s.step,
                &self.s.row_info,
                t,
                q_norm.unwrap_or(&self.s.dummy),
                table.unwrap_or(&self.s.dummy),
                keys.map_or(&self.s.dummy_rw, |k| k.0),
                k_norm.unwrap_or(&self.s.dummy),
                pool.unwrap_or(&self.s.dummy_rw),
                &self.cache.block_tables,
            ],
            Grid::Tokens(per_token),
        )
    }

    /// The rows cache shard `shard` holds.
    fn shard(&self, shard: usize) -> Shard {
        let n = self.cache.shard_rows();
        Shard { row0: shard * n, rows: n }
    }

    /// The global K/V pool's addressing: positions per block, block table entries per row.
    fn paging(&self) -> Paging {
        Paging { block_len: self.cache.block_len(), max_blocks: self.cache.blocks.max_blocks() }
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
                let spec = kernels::KvWrite {
                    kv_heads: c.n_kv_heads,
                    head_dim: c.head_dim,
                    ring_slots: cache.ring_slots() + 1,
                    src_stride: fresh_stride,
                    src_offset: fresh_offset,
                    ring,
                    kv: cache.dtype(),
                    shard: self.shard(shard),
                    paging: self.paging(),
                };
                self.dispatch(
                    &spec,
                    &[&self.s.step, &self.s.row_info, fresh, kv, &cache.block_tables],
                    Grid::Tokens(c.n_kv_heads * c.head_dim / 2),
                )
            })
            .collect()
    }

    /// Attention of one layer against its global group and/or ring; `rope`: split-group's `main`
    /// does RoPE's work at one token a row, with the layer's table (none: NoPE).
    fn attention(
        &self,
        group: Option<&Vec<wgpu::Buffer>>,
        ring: Option<&Vec<wgpu::Buffer>>,
        rope: Option<(kernels::FusedRope, Option<&wgpu::Buffer>)>,
        sinks: Option<&wgpu::Buffer>,
    ) -> Vec<Dispatch> {
        let (c, s, cache, plan) = (self.cfg, self.s, self.cache, self.attention);
        let split = plan.kernel.is_split() && group.is_some();
        let size = plan.group_tokens;
        let mut out = Vec::new();
        for shard in 0..cache.rows().div_ceil(cache.shard_rows()) {
            let gkv = group.map_or(&s.dummy, |g| &g[shard]);
            let lkv = ring.map_or(&s.dummy, |r| &r[shard]);
            let shape = kernels::AttentionShape {
                heads: c.n_heads,
                kv_heads: c.n_kv_heads,
                head_dim: c.head_dim,
                q_stride: self.qkv_stride(),
                kv: cache.dtype(),
                scale: c.attn_scale,
                softcap: c.attn_softcap.unwrap_or(0.0),
                group_tokens: size,
                span: plan.span,
                parts: plan.parts,
                shard: self.shard(shard),
                paging: self.paging(),
            };
            let merge = kernels::Attention {
                shape,
                window: cache.window().max(1),
                ring_slots: cache.ring_slots().max(1),
                global: group.is_some(),
                local: ring.is_some(),
                split,
                sinks: sinks.is_some(),
            };
            for (g, token_group) in s.token_groups.iter().enumerate() {
                if split {
                    let (spec, grid) = match plan.kernel {
                        AttentionKernel::SplitGroup => (
                            kernels::AttentionSplit {
                                kernel: Kernel::AttentionSplit,
                                shape,
                                tile: Some(plan.tile),
                                query_tile: None,
                                fused_rope: rope.map(|r| r.0),
                            },
                            Grid::SplitPartials { group: g, size, parts: plan.parts, kv_heads: c.n_kv_heads },
                        ),
                        _ => (
                            kernels::AttentionSplit {
                                kernel: Kernel::AttentionSplitHead,
                                shape,
                                tile: None,
                                query_tile: None,
                                fused_rope: None,
                            },
                            Grid::TokenGroup { group: g, size, per_token: c.n_heads * plan.parts },
                        ),
                    };
                    let table = rope.and_then(|r| r.1).unwrap_or(&s.dummy);
                    let buffers =
                        [&s.step, token_group, &s.row_info, &s.qkv, gkv, &s.partials, &cache.block_tables, table];
                    // split-group: the query tiles beside it, for steps of several tokens a row
                    let many_tokens = (spec.kernel == Kernel::AttentionSplit && plan.query_tile > 1).then(|| {
                        let tile = plan.query_tile;
                        let tiles = kernels::AttentionSplit {
                            kernel: Kernel::AttentionQueryTiles,
                            query_tile: Some(tile),
                            fused_rope: None,
                            ..spec
                        };
                        Box::new(self.dispatch(
                            &tiles,
                            &buffers,
                            Grid::QueryTiles { group: g, size, parts: plan.parts, kv_heads: c.n_kv_heads, tile },
                        ))
                    });
                    out.push(Dispatch { many_tokens, ..self.dispatch(&spec, &buffers, grid) });
                }
                // split: binding 4 holds the partials instead of the keys
                let global = if split { &s.partials } else { gkv };
                out.push(self.dispatch(
                    &merge,
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
                        sinks.unwrap_or(&s.dummy),
                    ],
                    // the merge alone takes a thread per value vec4 of each head (attention.wgsl)
                    Grid::TokenGroup { group: g, size, per_token: merge.threads_per_token(c.n_heads, c.head_dim) },
                ));
            }
        }
        out
    }

    /// The dispatch order of one layer, top to bottom.
    pub(super) fn layer(&self, i: usize, lw: &GpuLayer) -> Vec<Dispatch> {
        let (c, s, cache) = (self.cfg, self.s, self.cache);
        let spec = c.layers[i];
        let (hd, kvd) = (c.n_heads * c.head_dim, 2 * c.n_kv_heads * c.head_dim);
        let mut out = Vec::new();
        // 0. Engram layers: n-gram lookup (addresses from the token history), gated residual
        if let (Some(ge), Some(e)) = (&lw.engram, &c.engram) {
            let tables = e.orders.len() * e.heads;
            let gather = kernels::EngramGather {
                heads: e.heads,
                orders: e.orders.len(),
                table_rows: e.table_rows,
                dim: e.dim,
                max_len: cache.max_len(),
            };
            out.push(self.dispatch(
                &gather,
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
                &kernels::EngramMix { d: c.d_model, eps: c.norm_eps },
                &[&s.step, &s.row_info, &s.engram_kv, &s.x],
                Grid::Tokens(1),
            ));
        }
        // 1. h = norm(x): its own dispatch, or fused into each product that reads h
        let attn_in = self.block_input(&mut out, lw.attn_norm.as_ref());
        // 2. q = h Wq^T and, on writer layers, the fresh global K/V beside it in each row of qkv
        //    (one product when both matrices are stored alike); local layers: fresh local K/V.
        //    LoRA adapters: each token's A x of q (and k and v, where the layer makes them) first,
        //    then each product adds its B (A x) as its epilogue
        let qkv = self.qkv_stride();
        let group = spec.global_group.map(|g| &cache.global[g]);
        let writes = group.filter(|_| spec.writes_global);
        let ring = cache.ring[i].as_ref();
        let kv_local = lw.kv_local.as_ref().filter(|_| ring.is_some());
        let targets = if writes.is_some() || kv_local.is_some() { 3 } else { 1 };
        out.extend(self.lora(i, LoraGroup::AttnIn, targets, attn_in.x, c.d_model, attn_in.norm));
        let lora = |first| self.lora_io(i, LoraGroup::AttnIn, first);
        match &lw.qkv {
            QkvWeights::Fused(w) => {
                out.extend(self.product(w, ProductIo { lora: lora(0), ..attn_in.to(&s.qkv, qkv, 0) }))
            }
            QkvWeights::Apart { wq, kv_global } => {
                out.extend(self.product(wq, ProductIo { lora: lora(0), ..attn_in.to(&s.qkv, qkv, 0) }));
                if let (Some(kvg), Some(_)) = (kv_global, writes) {
                    out.extend(self.product(kvg, ProductIo { lora: lora(1), ..attn_in.to(&s.qkv, qkv, hd) }));
                }
            }
        }
        if let Some(kvl) = kv_local {
            out.extend(self.product(kvl, ProductIo { lora: lora(1), ..attn_in.to(&s.kv_local, kvd, 0) }));
        }
        let local = kv_local.is_some();
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
        let table = self.rope.layer(i);
        let rope = self.rope(&s.qkv, qkv, t_keys, keys, lw.q_norm.as_ref(), lw.k_norm.as_ref(), table, pool);
        // split-group attention does RoPE's work in steps of one token a row (decoding), where
        // steps of more take query tiles, and the layer has no qk-norm, local keys or separate
        // K/V write: RoPE's dispatch then runs only in steps of two tokens a row or more
        // (the fused `main` is exact at one token a row only: a row's other tokens, in other
        // workgroups, would read the keys it stores; from two on, query tiles take the step)
        const _: () = assert!(QUERY_TILE_MIN_WIDTH == 2);
        let plan = self.attention;
        let fused = (self.fusion.rope
            && plan.kernel == AttentionKernel::SplitGroup
            && plan.query_tile > 1
            && group.is_some()
            && ring.is_none()
            && !c.qk_norm
            && c.head_dim.is_multiple_of(8)
            && (writes.is_none() || pool.is_some()))
        .then_some((kernels::FusedRope { rotate: table.is_some(), kv_write: pool.is_some() }, table));
        out.push(Dispatch { min_width: if fused.is_some() { 2 } else { 1 }, ..rope });
        if let (Some(g), None) = (writes, pool) {
            out.extend(self.kv_write((&s.qkv, qkv, hd), g, false));
        }
        // 5. attention over global keys + ring + the chunk's fresh local keys; output replaces q
        //    (per cache shard, each handling the rows its shard holds, and per token group).
        //    Split variants: the partitions of the global keys, then their merge in order.
        out.extend(self.attention(group, ring, fused, lw.sinks.as_ref()));
        // 6. ring write: the last W real tokens of each row survive, the rest go to the scratch slot
        if let Some(r) = ring {
            out.extend(self.kv_write((&s.kv_local, kvd, 0), r, true));
        }
        // 7. output projection (and its adapters) and residual (Gemma: norm the projection before
        //    adding it)
        out.extend(self.lora(i, LoraGroup::O, 1, &s.qkv, qkv, None));
        let o_io =
            |y| ProductIo { lora: self.lora_io(i, LoraGroup::O, 0), ..ProductIo::new(&s.qkv, qkv, y, c.d_model) };
        if c.post_norms {
            out.extend(self.product(&lw.wo, o_io(&s.tmp)));
            out.push(self.norm(&s.tmp, lw.post_attn_norm.as_ref(), &s.x, true));
        } else {
            out.extend(self.product(&lw.wo, ProductIo { accumulate: true, ..o_io(&s.x) }));
        }
        // 8. MLP and residual; the activation is the up projection's epilogue where its matrix is
        //    one part (a gated one pairs rows o and F + o). MoE layers: the router and the routed
        //    experts instead.
        if let (Some(moe), Some(ordinal), Some(router)) = (&c.moe, c.moe_layer(i), lw.router.as_ref()) {
            self.moe_mlp(&mut out, moe, ordinal, router, lw);
            return out;
        }
        let mlp_in = self.block_input(&mut out, lw.mlp_norm.as_ref());
        out.extend(self.lora(i, LoraGroup::MlpIn, 2, mlp_in.x, c.d_model, mlp_in.norm));
        let mlp_io = ProductIo { lora: self.lora_io(i, LoraGroup::MlpIn, 0), ..mlp_in.to(&s.act, c.ffn, 0) };
        out.extend(self.mlp_in(&lw.mlp_in, mlp_io, c.ffn));
        out.extend(self.lora(i, LoraGroup::Down, 1, &s.act, c.ffn, None));
        let down_io =
            |y| ProductIo { lora: self.lora_io(i, LoraGroup::Down, 0), ..ProductIo::new(&s.act, c.ffn, y, c.d_model) };
        if c.post_norms {
            out.extend(self.product(&lw.mlp_out, down_io(&s.tmp)));
            out.push(self.norm(&s.tmp, lw.post_mlp_norm.as_ref(), &s.x, true));
        } else {
            out.extend(self.product(&lw.mlp_out, ProductIo { accumulate: true, ..down_io(&s.x) }));
        }
        out
    }

    /// `act = act(x W^T)` for an MLP of `f` outputs, x as `io` reads it (with its adapters, added
    /// before the activation): the activation as the product's epilogue where the matrix is one
    /// part (a gated one pairs rows o and F + o), else the product into `up`, then `mlp_act.wgsl`.
    pub(super) fn mlp_in(&self, w: &GpuMatrix, io: ProductIo, f: usize) -> Vec<Dispatch> {
        let (c, s) = (self.cfg, self.s);
        if self.fusion.act && w.parts.len() == 1 {
            return self.product(w, ProductIo { y: &s.act, y_stride: f, y_offset: 0, act: Some(c.mlp), ..io });
        }
        let mut out = self.product(w, ProductIo { y: &s.up, y_stride: c.mlp.in_factor() * f, y_offset: 0, ..io });
        out.push(self.dispatch(&kernels::MlpAct { ffn: f, act: c.mlp }, &[&s.step, &s.up, &s.act], Grid::Tokens(f)));
        out
    }
}
