//! The attention path's kernels: qk-norm and RoPE (with the fused pool write), the K/V write,
//! and attention itself, serial or split over partitions, heads, groups or query tiles.

use super::work::{levels, Work};
use super::{Overrides, Paging, Shard, Specialize};
use crate::gpu::shaders::{Constants, Kernel};
use crate::model::dtype::KvDtype;

use crate::model::config::QK_NORM_WHOLE_MAX_HEADS;

/// `qk_rope.wgsl`: qk-norm and RoPE of the queries and fresh keys, in place, and (fused) the
/// global pool write of the keys and values.
pub(crate) struct QkRope {
    pub heads: usize,
    pub head_dim: usize,
    /// Floats per token row of `t`.
    pub stride: usize,
    pub qk_norm: bool,
    /// The qk-norm spans all heads of q, and all of k (OLMo 2).
    pub qk_norm_whole: bool,
    /// Rotate (false on NoPE layers).
    pub rotate: bool,
    pub q_weight: bool,
    pub eps: f32,
    /// Key heads after the queries in each row of `t`.
    pub t_k_heads: usize,
    /// Key heads at the start of each row of the second key buffer.
    pub k_heads: usize,
    pub k_stride: usize,
    pub k_weight: bool,
    /// Write `t`'s keys and values to the global pool too (kv_write fused).
    pub kv_write: Option<(KvDtype, Paging)>,
}

impl QkRope {
    /// Heads of each token the dispatch touches: queries, `t`'s keys, the second buffer's keys,
    /// and the values the pool write copies.
    pub(crate) fn token_heads(&self) -> usize {
        let v_heads = if self.kv_write.is_some() { self.t_k_heads } else { 0 };
        self.heads + self.t_k_heads + self.k_heads + v_heads
    }
}

impl Specialize for QkRope {
    fn kernel(&self) -> Kernel {
        Kernel::QkRope
    }
    fn constants(&self) -> Constants {
        let mut o = Overrides::default()
            .count("HEADS", self.heads)
            .count("D", self.head_dim)
            .count("STRIDE", self.stride)
            .flag("NORM", self.qk_norm)
            .flag("NORM_WHOLE", self.qk_norm_whole)
            .flag("ROTATE", self.rotate)
            .flag("HAS_WEIGHT", self.q_weight)
            .float("EPS", self.eps)
            .count("T_K_HEADS", self.t_k_heads)
            .count("K_HEADS", self.k_heads)
            .count("K_STRIDE", self.k_stride)
            .flag("HAS_K_WEIGHT", self.k_weight);
        if let Some((kv, paging)) = self.kv_write {
            o = paging.add(o.flag("KV_WRITE", true).code("KV_FORMAT", kv.format()));
        }
        if self.qk_norm_whole {
            o = o.code("WG", self.workgroup_size());
        }
        o.0
    }
    /// 64, or with a whole-projection norm a workgroup per token: its heads rounded up to a
    /// power of two (at least 32).
    fn workgroup_size(&self) -> u32 {
        if self.qk_norm_whole {
            self.token_heads().next_power_of_two().clamp(32, QK_NORM_WHOLE_MAX_HEADS) as u32
        } else {
            self.kernel().workgroup_size()
        }
    }
    fn label(&self) -> String {
        let mut l = match (self.qk_norm, self.rotate) {
            (true, true) => "qk_norm_rope",
            (false, true) => "qk_rope",
            (true, false) => "qk_norm",
            (false, false) => "qk_nope",
        }
        .to_string();
        if self.qk_norm_whole {
            l = l.replacen("qk_norm", "qk_norm_whole", 1);
        }
        if let Some((kv, _)) = self.kv_write {
            l.push_str("_kv_write_");
            l.push_str(kv.name());
        }
        l
    }
    /// With qk-norm a thread per (token, head) sums the head's squares, then rotates its pairs;
    /// without, a thread rotates one or two pairs. The pool write copies the keys and values.
    fn work(&self) -> Work {
        let d = self.head_dim;
        let iters = match (self.qk_norm, self.qk_norm_whole) {
            (true, true) => 2 * d + levels(self.workgroup_size() as usize),
            (true, false) => 2 * d,
            (false, _) => 2,
        };
        let pool = self.kv_write.map_or(0, |(kv, _)| 2 * self.t_k_heads * d * kv.bytes());
        Work::flat(iters, 8 * (self.heads + self.t_k_heads + self.k_heads) * d + pool)
    }
}

/// `kv_write.wgsl`: scatter fresh K/V into a global pool (through the block tables) or a ring.
pub(crate) struct KvWrite {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Ring slots plus the scratch slot.
    pub ring_slots: usize,
    pub src_stride: usize,
    pub src_offset: usize,
    pub ring: bool,
    pub kv: KvDtype,
    pub shard: Shard,
    pub paging: Paging,
}

impl Specialize for KvWrite {
    fn kernel(&self) -> Kernel {
        Kernel::KvWrite
    }
    fn constants(&self) -> Constants {
        let o = Overrides::default()
            .count("HK", self.kv_heads)
            .count("D", self.head_dim)
            .count("RING_SLOTS", self.ring_slots)
            .count("SRC_STRIDE", self.src_stride)
            .count("SRC_OFFSET", self.src_offset)
            .flag("RING", self.ring)
            .code("KV_FORMAT", self.kv.format());
        self.paging.add(self.shard.add(o)).0
    }
    fn label(&self) -> String {
        format!("kv_write_{}_{}", if self.ring { "ring" } else { "global" }, self.kv.name())
    }
    /// A thread per pair of a token's keys or values.
    fn work(&self) -> Work {
        Work::flat(1, 2 * self.kv_heads * self.head_dim * (4 + self.kv.bytes()))
    }
}

/// What both halves of attention share: the heads, the K/V layout of one cache shard, the
/// partitions of the global keys and the token group a dispatch takes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub q_stride: usize,
    pub kv: KvDtype,
    pub scale: f32,
    /// Gemma 2's attention-logit softcap (0: none).
    pub softcap: f32,
    pub group_tokens: usize,
    pub span: usize,
    pub parts: usize,
    pub shard: Shard,
    pub paging: Paging,
}

impl AttentionShape {
    /// Bytes of K and V per key position of a row.
    fn key_bytes(&self) -> u64 {
        (2 * self.kv_heads * self.head_dim * self.kv.bytes()) as u64
    }

    /// Bytes of one token's partial states (each head's max, sum and values per partition).
    fn partial_bytes(&self) -> usize {
        4 * self.heads * self.parts * (4 + self.head_dim)
    }

    fn overrides(&self) -> Overrides {
        let o = Overrides::default()
            .count("H", self.heads)
            .count("HK", self.kv_heads)
            .count("D", self.head_dim)
            .count("Q_STRIDE", self.q_stride)
            .code("KV_FORMAT", self.kv.format())
            .float("SCALE", self.scale)
            .float("ATTN_SOFTCAP", self.softcap)
            .count("GROUP_TOKENS", self.group_tokens)
            .count("SPAN", self.span)
            .count("PARTS", self.parts);
        self.paging.add(self.shard.add(o))
    }
}

/// `attention.wgsl`: serial attention over the global keys, the ring and the fresh local keys;
/// with `split`, the merge of the partitions [`AttentionSplit`] wrote, then the local keys.
pub(crate) struct Attention {
    pub shape: AttentionShape,
    pub window: usize,
    pub ring_slots: usize,
    pub global: bool,
    pub local: bool,
    pub split: bool,
    /// Each head's sink joins its softmax (gpt-oss; binding 9).
    pub sinks: bool,
}

impl Attention {
    /// Threads per token: one per query head, or for the merge alone (split, no local keys) one
    /// per value vec4 of each head.
    pub(crate) fn threads_per_token(&self, heads: usize, head_dim: usize) -> usize {
        if self.global && self.split && !self.local {
            heads * head_dim / 4
        } else {
            heads
        }
    }
}

impl Specialize for Attention {
    fn kernel(&self) -> Kernel {
        Kernel::Attention
    }
    fn constants(&self) -> Constants {
        self.shape
            .overrides()
            .count("W", self.window)
            .count("RING", self.ring_slots)
            .flag("HAS_GLOBAL", self.global)
            .flag("HAS_LOCAL", self.local)
            .flag("SPLIT", self.split)
            .flag("SINKS", self.sinks)
            .0
    }
    fn label(&self) -> String {
        let keys = match (self.global, self.local) {
            (true, true) => "global_local",
            (true, false) => "global",
            (false, _) => "local",
        };
        let form = if self.split { "attention_merge" } else { "attention" };
        let sinks = if self.sinks { "_sinks" } else { "" };
        format!("{form}_{keys}_{}{sinks}", self.shape.kv.name())
    }
    /// A thread per (token, head) walks its keys in order, a vec4 of the dot and one of the
    /// values each; split, it walks the partitions instead (per value vec4 when the merge is
    /// alone); local keys add the window.
    fn work(&self) -> Work {
        let sh = &self.shape;
        let d4 = sh.head_dim / 4;
        let q_bytes = 8 * sh.heads * sh.head_dim;
        let local = if self.local { 2 * d4 * self.window } else { 0 };
        let local_bytes = if self.local { self.window as u64 * sh.key_bytes() } else { 0 };
        let mut w = Work::flat(local, q_bytes);
        w.token_bytes += local_bytes;
        match (self.global, self.split) {
            (true, true) => {
                w.per_part = if self.local { d4 } else { 1 };
                w.part_span = sh.span;
                w.token_bytes += sh.partial_bytes() as u64;
            }
            (true, false) => {
                w.per_key = 2 * d4;
                w.key_span = usize::MAX;
                w.key_bytes = sh.key_bytes();
            }
            _ => {}
        }
        w
    }
}

/// `attention_split.wgsl`: the partitions of the global keys, one workgroup per (partition, kv
/// head) (`main`), with query tiles (`query_tiles`, `query_tile` tokens), or a thread per
/// (partition, query head) (`per_head`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionSplit {
    pub kernel: Kernel,
    pub shape: AttentionShape,
    /// Keys per tile (split-group and query tiles).
    pub tile: Option<usize>,
    /// Tokens per query tile.
    pub query_tile: Option<usize>,
    /// `main` at one token a row does RoPE's work ([`FusedRope`]).
    pub fused_rope: Option<FusedRope>,
}

/// What split-group attention's `main` does of `qk_rope.wgsl`'s work when it runs in its place
/// (`Fusion::rope`): rotate the queries (unless a NoPE layer), and on writer layers store the
/// token's rotated key and its value in the pool.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedRope {
    pub rotate: bool,
    pub kv_write: bool,
}

impl Specialize for AttentionSplit {
    fn kernel(&self) -> Kernel {
        self.kernel
    }
    fn constants(&self) -> Constants {
        let mut o = self.shape.overrides();
        if let Some(t) = self.tile {
            o = o.count("TILE", t);
        }
        if let Some(qt) = self.query_tile {
            o = o.count("QT", qt);
        }
        if let Some(f) = self.fused_rope {
            o = o.flag("FUSED_ROPE", true).flag("ROTATE", f.rotate).flag("KV_WRITE", f.kv_write);
        }
        o.0
    }
    fn label(&self) -> String {
        let form = match self.kernel {
            Kernel::AttentionSplitHead => "attention_split_head".to_string(),
            Kernel::AttentionQueryTiles => format!("attention_query_tiles{}", self.query_tile.unwrap_or(1)),
            _ => match self.fused_rope {
                Some(FusedRope { kv_write: true, .. }) => "attention_split_group_rope_kv_write".to_string(),
                Some(_) => "attention_split_group_rope".to_string(),
                None => "attention_split_group".to_string(),
            },
        };
        format!("{form}_{}", self.shape.kv.name())
    }
    /// The keys of one partition (`span`). Per head: a thread walks them alone, as the serial
    /// kernel. Per group (256 lanes): per tile of keys, a lane scores (head, key) pairs, two
    /// trees over the tile's keys (max, sum) run for all heads at once, and each lane folds its
    /// key range of one value slot. Query tiles (64 lanes): a lane scores its key for every pair,
    /// a lane per pair finds the max, the weights spread over the lanes, a lane folds its
    /// value element of its pairs over the tile, and the sum's tree runs over all pairs.
    fn work(&self) -> Work {
        let sh = &self.shape;
        let d4 = sh.head_dim / 4;
        let g = sh.heads / sh.kv_heads.max(1);
        let io = Work { key_span: sh.span, key_bytes: sh.key_bytes(), ..Work::flat(0, 4 * sh.heads * sh.head_dim) };
        let io = Work { token_bytes: io.token_bytes + sh.partial_bytes() as u64, ..io };
        if self.kernel == Kernel::AttentionSplitHead {
            return Work { per_key: 2 * d4, ..Work { iters: d4, ..io } };
        }
        let tile = self.tile.unwrap_or(64);
        let lanes = Kernel::AttentionSplit.workgroup_size() as usize;
        let slots = g * d4;
        if let Some(qt) = self.query_tile {
            let (lanes, pairs) = (64, g * qt);
            let values = tile * pairs.div_ceil(lanes / d4);
            let per_tile = pairs * d4 + tile + (pairs * tile).div_ceil(lanes) + tree_iters(pairs, tile, lanes) + values;
            return Work { per_tile, key_tile: tile, ..Work { iters: (pairs * d4).div_ceil(lanes), ..io } };
        }
        let ranges = (lanes / slots.max(1)).max(1);
        let values = if ranges > 1 { tile.div_ceil(ranges) + ranges } else { tile };
        let pairs = (g * tile).div_ceil(lanes);
        let per_tile = pairs * d4 + 2 * tree_iters(g, tile, lanes) + pairs + values;
        // fused RoPE: a query vec4 rotated as it loads, a key and a value vec4 stored
        let rope = if self.fused_rope.is_some() { 2 } else { 0 };
        Work { per_tile, key_tile: tile, ..Work { iters: slots.div_ceil(lanes) + rope, ..io } }
    }
}

/// Iterations of a lane in `attention_split.wgsl`'s tile trees: `rows` rows of `tile` entries
/// halved until one, spread over `lanes` lanes.
fn tree_iters(rows: usize, tile: usize, lanes: usize) -> usize {
    let mut stride = tile / 2;
    let mut iters = 0;
    while stride > 0 {
        iters += (rows * stride).div_ceil(lanes);
        stride /= 2;
    }
    iters
}
