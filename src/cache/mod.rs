//! The small KV cache: global K/V per layer group in a pool of fixed-size blocks addressed through
//! per-row block tables, one constant-size ring per local layer, per-row lengths on the GPU
//! mirrored on the CPU, and each row's token history.
//!
//! Layouts:
//! - global K/V of group g: a pool `[blocks, 2, n_kv_heads, block_len, head_dim]` per shard (a
//!   block's keys, then its values); position `p` of row `r` lives in block
//!   `table[r][p / block_len]` at `p % block_len`. Block 0
//!   of each shard is the scratch block that padding tokens write. `blocks.rs` owns which block is
//!   whose (free list, reference counts, copy-on-write forks); the tables are mirrored to the GPU
//!   as `block_tables: [rows, max_blocks]` u32 whenever a row's table changes.
//! - ring K/V of local layer l: `[rows, 2, n_kv_heads, N + 1, head_dim]` with `N = W + spare`
//!   slots: the window plus `spare` slots that make a rollback of up to `spare` tokens exact.
//!   Position `p` lives in slot `p % N`, slot `N` is the scratch slot.
//! - `lpos`: `[rows, N + 1]` i32, the absolute position held by each ring slot (-1: empty); shared
//!   by every ring since all rings hold the same positions.
//! - caches larger than one storage binding (128 MiB under the WebGPU defaults) are split by rows
//!   into shards of `shard_rows` rows, one buffer each (rings), one pool each (global K/V: a row
//!   takes blocks from its own shard's pool); kernels bind one shard per dispatch. K and V share
//!   one buffer so that attention stays within the WebGPU default of 8 storage buffers.
//! - `lens`: `[rows]` u32 and `history`: `[rows, max_len + 1]` u32 (token ids, for modules that look
//!   back over previous tokens).

mod blocks;
mod rows;

use blocks::{BlockCopy, BlockPool};
pub use blocks::{BlockUsage, PromptCacheStats};

use crate::error::{Error, Result};
use crate::gpu::device::Gpu;
use crate::model::config::ModelConfig;
pub use crate::model::KvDtype;

/// The shape of a cache: what [`KvCache::new`] allocates.
#[derive(Clone, Copy, Debug)]
pub struct CacheOptions {
    /// Rows (sequences side by side).
    pub rows: usize,
    /// Most positions one row can reach.
    pub max_len: usize,
    /// K/V storage type.
    pub dtype: KvDtype,
    /// Spare ring slots: tokens a row can roll back exactly.
    pub spare: usize,
    /// Positions per block of the global K/V pool (a power of two).
    pub block_len: usize,
    /// Blocks in the pool; `None`: enough for every row to reach `max_len` at once (`rows x
    /// ceil(max_len / block_len)`), the memory a cache without paging reserves.
    pub pool_blocks: Option<usize>,
    /// The pool's size in bytes instead (every global group's K and V): as many blocks as fit.
    /// Give this or `pool_blocks`, not both.
    pub pool_bytes: Option<u64>,
    /// Keep full blocks of finished sequences for later ones that start with the same tokens
    /// (see [`crate::Engine::reuse_prefix`]).
    pub prompt_cache: bool,
}

impl CacheOptions {
    /// Blocks the pool holds for `cfg` (scratch blocks not counted); an error names a size given
    /// twice or too small for one block.
    pub fn pool_blocks(&self, cfg: &ModelConfig) -> Result<usize> {
        let per_block =
            (cfg.n_groups() * 2 * cfg.n_kv_heads * cfg.head_dim * self.dtype.bytes() * self.block_len) as u64;
        match (self.pool_blocks, self.pool_bytes) {
            (Some(_), Some(_)) => {
                Err(Error::Input("give the K/V pool's size as pool_blocks or pool_bytes, not both".into()))
            }
            (Some(n), None) => Ok(n),
            (None, Some(bytes)) if per_block > 0 && bytes < per_block => Err(Error::Input(format!(
                "pool_bytes {bytes} is less than one block of {} positions ({per_block} bytes)",
                self.block_len
            ))),
            (None, Some(bytes)) => Ok((bytes / per_block.max(1)) as usize),
            (None, None) => Ok(self.rows * self.max_len.div_ceil(self.block_len.max(1))),
        }
    }
}

/// Who holds a row: a [`crate::Scheduler`], a [`crate::Rollouts`], or a caller that claimed rows
/// for itself ([`crate::Engine::claim_rows`]). Rows are claimed and released through the engine,
/// so two components sharing one engine never take the same row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowOwner(u64);

impl RowOwner {
    /// A new owner, different from every other.
    pub fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        RowOwner(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Default for RowOwner {
    fn default() -> Self {
        Self::new()
    }
}

/// Copies of a few blocks go through one staging buffer (a buffer cannot be copied into itself):
/// at most this many blocks at a time.
const STAGE_BLOCKS: usize = 32;

/// The per-row KV cache (GPU buffers plus the CPU mirror of what is in them).
pub struct KvCache {
    rows: usize,
    max_len: usize,
    window: usize,
    /// Ring slots per local layer: `window + spare` (0 without local layers).
    ring_slots: usize,
    dtype: KvDtype,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Rows per shard: ring buffers and global pools of shard `s` serve rows `s * shard_rows ..`.
    pub(crate) shard_rows: usize,
    /// Per group, per shard: the pool of K/V blocks.
    pub(crate) global: Vec<Vec<wgpu::Buffer>>,
    /// Which block holds which row's positions (the CPU copy, authoritative).
    pub(crate) blocks: BlockPool,
    /// The GPU copy of the block tables: `[rows, max_blocks]` u32, block indices within the
    /// row's shard.
    pub(crate) block_tables: wgpu::Buffer,
    /// Block copies (copy-on-write) the next step makes before its first dispatch.
    pending_copies: Vec<BlockCopy>,
    /// Who holds each row (`None`: free).
    owners: Vec<Option<RowOwner>>,
    /// Positions a prompt-cache hit recomputes before its reuse point on models with local
    /// layers: each local layer reaches `W` positions further back than the one before it, so
    /// its ring at position R is exact when recomputed from `R - layers x W - spare` on (0
    /// without local layers).
    replay: usize,
    /// Per row, the position global K/V is written from in the step being recorded (a replay
    /// over cached blocks writes none of it; 0 otherwise).
    pub(crate) replay_until: Vec<usize>,
    /// Per layer, per shard: its ring K/V if the layer is local.
    pub(crate) ring: Vec<Option<Vec<wgpu::Buffer>>>,
    pub(crate) lpos: wgpu::Buffer,
    pub(crate) lens: wgpu::Buffer,
    pub(crate) history: wgpu::Buffer,
    /// CPU mirror of `lens`: the host knows every shape without reading the GPU. Only the cache
    /// writes these mirrors (`advance` after a step, `reset`, `rollback`, `fork`, `skip`).
    lens_cpu: Vec<usize>,
    /// CPU mirror of `history` (the first `lens_cpu[row]` ids of each row).
    history_cpu: Vec<Vec<u32>>,
    /// Per row, the largest length reached since the last reset: the ring holds positions
    /// `written - ring_slots ..`, so a rollback to `len` is exact while `written - len <= spare`.
    written: Vec<usize>,
    /// Per row, runs of positions skipped as padding ([`KvCache::skip`]) as (stored tokens at the
    /// time, count): the next token is rotated by RoPE as position `lens + skipped`, skipped
    /// positions count against `max_len`, and a rollback drops the runs it goes back past.
    skips: Vec<Vec<(usize, usize)>>,
    /// One row's largest per-row region; `fork` copies rings, positions and history through it.
    row_stage: wgpu::Buffer,
    /// `STAGE_BLOCKS` blocks: copy-on-write copies within one pool go through it.
    block_stage: wgpu::Buffer,
}

/// How a cache is cut into shards that each fit one storage binding: (rows per shard, blocks per
/// shard besides its scratch block).
fn shard_plan(cfg: &ModelConfig, o: &CacheOptions, max_binding: u64) -> Result<(usize, usize)> {
    let per_position = 2 * (cfg.n_kv_heads * cfg.head_dim * o.dtype.bytes()) as u64;
    let block_bytes = per_position * o.block_len as u64;
    let ring_row = if cfg.has_local() { per_position * (cfg.window + o.spare + 1) as u64 } else { 0 };
    let pool = o.pool_blocks(cfg)?;
    for n_shards in 1..=o.rows {
        let shard_rows = o.rows.div_ceil(n_shards);
        let blocks = if cfg.n_groups() > 0 { (pool * shard_rows).div_ceil(o.rows) } else { 0 };
        if (blocks as u64 + 1) * block_bytes <= max_binding && shard_rows as u64 * ring_row <= max_binding {
            return Ok((shard_rows, blocks));
        }
    }
    Err(Error::Limit(format!(
        "the K/V cache does not fit storage bindings of {max_binding} bytes even with one row per shard \
         ({} blocks of {block_bytes} bytes, ring rows of {ring_row} bytes); lower max_len, the pool size, or use f16 K/V",
        pool.div_ceil(o.rows) + 1
    )))
}

impl KvCache {
    /// Allocate an empty cache for `cfg` of the shape `o`.
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, o: CacheOptions) -> Result<Self> {
        cfg.validate()?;
        let CacheOptions { rows, max_len, dtype, spare, block_len, .. } = o;
        if rows == 0 || max_len == 0 {
            return Err(Error::Input(format!("cache needs rows >= 1 and max_len >= 1, got {rows} and {max_len}")));
        }
        if max_len >= i32::MAX as usize / 2 || rows > u32::MAX as usize / 2 {
            return Err(Error::Input(format!("max_len {max_len} or rows {rows} is too large")));
        }
        if !block_len.is_power_of_two() || block_len > 1024 {
            return Err(Error::Input(format!("block_len {block_len}: expected a power of two up to 1024")));
        }
        let pool = o.pool_blocks(cfg)?;
        if pool >= u32::MAX as usize / 2 {
            return Err(Error::Input(format!("pool of {pool} blocks is too large")));
        }
        let (hk, d) = (cfg.n_kv_heads, cfg.head_dim);
        let w = if cfg.has_local() { cfg.window + spare } else { 0 };
        let per_position = 2 * (hk * d * dtype.bytes()) as u64; // K and V
        let (shard_rows, shard_blocks) = shard_plan(cfg, &o, gpu.max_binding())?;
        let shards: Vec<(usize, usize)> =
            (0..rows).step_by(shard_rows).map(|r0| (r0, shard_rows.min(rows - r0))).collect();
        let pair = |tag: &str, bytes: u64| gpu.storage(&format!("K/V {tag}"), bytes);
        let global = (0..cfg.n_groups())
            .map(|g| {
                (0..shards.len())
                    .map(|s| {
                        let bytes = (shard_blocks as u64 + 1) * o.block_len as u64 * per_position;
                        pair(&format!("pool of group {g} shard {s}"), bytes)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let ring = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if !l.local {
                    return Ok(None);
                }
                let per_shard = shards.iter().map(|&(r0, n)| {
                    pair(&format!("ring of layer {i} rows {r0}..{}", r0 + n), n as u64 * per_position * (w as u64 + 1))
                });
                per_shard.collect::<Result<Vec<_>>>().map(Some)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut blocks = BlockPool::new(rows, max_len, shard_rows, shard_blocks, block_len);
        blocks.set_prompt_cache(o.prompt_cache);
        let lpos = gpu.storage_init("lpos", bytemuck::cast_slice(&vec![-1i32; rows * (w + 1)]))?;
        let lens = gpu.storage("lens", (rows * 4) as u64)?;
        let history = gpu.storage("token history", (rows * (max_len + 1) * 4) as u64)?;
        let block_tables = gpu.storage("block tables", (rows * blocks.max_blocks() * 4) as u64)?;
        let copy = wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let widest = (per_position * (w as u64 + 1)).max((max_len as u64 + 1) * 4);
        Ok(KvCache {
            rows,
            max_len,
            window: cfg.window,
            ring_slots: w,
            dtype,
            n_layers: cfg.n_layers(),
            n_kv_heads: hk,
            head_dim: d,
            shard_rows,
            global,
            blocks,
            block_tables,
            pending_copies: Vec::new(),
            owners: vec![None; rows],
            replay: if cfg.has_local() {
                cfg.layers.iter().filter(|l| l.local).count() * cfg.window + spare
            } else {
                0
            },
            replay_until: vec![0; rows],
            ring,
            lpos,
            lens,
            history,
            lens_cpu: vec![0; rows],
            history_cpu: vec![Vec::new(); rows],
            written: vec![0; rows],
            skips: vec![Vec::new(); rows],
            row_stage: gpu.buffer("fork row stage", widest.next_multiple_of(4), copy)?,
            block_stage: gpu.buffer("block copy stage", STAGE_BLOCKS as u64 * per_position * block_len as u64, copy)?,
        })
    }

    /// The default `max_len` of a program that does not know how long its rows will get: the
    /// model's trained context (`fallback` when the file does not say), capped so that the global
    /// K/V of `rows` rows fits in `kv_budget` bytes and one row's K/V fits one storage binding of
    /// `gpu`.
    pub fn fit_max_len(
        gpu: &Gpu,
        cfg: &ModelConfig,
        rows: usize,
        dtype: KvDtype,
        kv_budget: u64,
        fallback: usize,
    ) -> usize {
        let per_position = (cfg.n_kv_heads * cfg.head_dim * dtype.bytes()) as u64;
        // one row's keys and values share a pool shard (one binding)
        let by_binding = gpu.max_binding() / (2 * per_position).max(1) - 1;
        let by_budget = kv_budget / (per_position * 2 * cfg.n_groups().max(1) as u64 * rows.max(1) as u64);
        (cfg.context_len.unwrap_or(fallback) as u64).min(by_binding).min(by_budget).max(1) as usize
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Capacity of each row in tokens.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Sliding window `W` of local layers.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Slots of each ring: `W` plus the rollback spares (0 without local layers).
    pub fn ring_slots(&self) -> usize {
        self.ring_slots
    }

    /// How many tokens `row` can roll back exactly right now.
    pub fn max_rollback(&self, row: usize) -> usize {
        let len = self.lens_cpu[row];
        if self.ring.iter().all(Option::is_none) {
            return len;
        }
        let spare = self.ring_slots - self.window;
        len.min(spare.saturating_sub(self.written[row] - len))
    }

    /// Storage element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Tokens stored in each row (the CPU mirror; equal to the GPU copy after every step).
    pub fn lens(&self) -> &[usize] {
        &self.lens_cpu
    }

    /// Token ids stored in `row`, oldest first.
    pub fn history(&self, row: usize) -> &[u32] {
        &self.history_cpu[row]
    }

    /// Positions used by `row`: stored tokens plus positions skipped as padding. The next token
    /// of the row sits at this position (its RoPE angle), and it may not exceed `max_len`.
    pub fn position(&self, row: usize) -> usize {
        self.lens_cpu[row] + self.skips[row].iter().map(|s| s.1).sum::<usize>()
    }

    /// Advance the position of each row's next token by `n[i]` without storing anything: padding
    /// that no later query can see (a key-padding mask; the seeds' `padding_mask`). The next
    /// token's RoPE position moves on; its storage slot does not. Checked like an append: nothing
    /// changes if a row would pass `max_len`.
    pub fn skip(&mut self, rows: &[usize], n: &[usize]) -> Result<()> {
        self.check_rows(rows)?;
        if rows.len() != n.len() {
            return Err(Error::Input(format!("skip: {} rows but {} counts", rows.len(), n.len())));
        }
        for (&row, &k) in rows.iter().zip(n) {
            if self.position(row) + k > self.max_len {
                return Err(Error::CacheFull { row, len: self.position(row), n_new: k, max_len: self.max_len });
            }
        }
        for (&row, &k) in rows.iter().zip(n).filter(|(_, &k)| k > 0) {
            self.skips[row].push((self.lens_cpu[row], k));
        }
        Ok(())
    }

    /// Rows per cache shard (all rows, unless the cache is larger than one storage binding).
    pub fn shard_rows(&self) -> usize {
        self.shard_rows
    }

    /// Bytes of K/V storage (global caches and rings, scratch slots included).
    pub fn nbytes(&self) -> u64 {
        let shards = self.rows.div_ceil(self.shard_rows) as u64;
        let pool = shards * (self.blocks.blocks_per_shard() as u64 + 1) * self.block_bytes();
        self.global.len() as u64 * pool + self.ring_nbytes()
    }

    /// Bytes of K/V the rows use now: the global K/V blocks referenced by at least one row (a
    /// block shared by forks counts once) plus the rings.
    pub fn used_nbytes(&self) -> u64 {
        self.global.len() as u64 * self.blocks.usage().used as u64 * self.block_bytes() + self.ring_nbytes()
    }

    fn ring_nbytes(&self) -> u64 {
        let per = (self.rows * self.n_kv_heads * self.head_dim * self.dtype.bytes()) as u64; // K or V
        self.ring.iter().flatten().count() as u64 * 2 * (self.ring_slots as u64 + 1) * per
    }

    /// Bytes of one block of one group's pool (its keys and values).
    fn block_bytes(&self) -> u64 {
        (2 * self.n_kv_heads * self.head_dim * self.dtype.bytes() * self.blocks.block_len()) as u64
    }

    /// Bytes of global K/V per position: one position of every global group's K and V.
    pub fn global_bytes_per_position(&self) -> u64 {
        (self.global.len() * 2 * self.n_kv_heads * self.head_dim * self.dtype.bytes()) as u64
    }

    /// Positions per block of the global K/V pool.
    pub fn block_len(&self) -> usize {
        self.blocks.block_len()
    }

    /// Blocks of the global K/V pool in use and free (block granularity: a row of `len` tokens
    /// holds `ceil(len / block_len)` blocks; forks share blocks).
    pub fn block_usage(&self) -> BlockUsage {
        self.blocks.usage()
    }

    /// Who holds `row` (`None`: nobody claimed it).
    pub fn row_owner(&self, row: usize) -> Option<RowOwner> {
        self.owners.get(row).copied().flatten()
    }

    /// Claim `rows` for `owner` (rows it holds already stay its own). All or nothing: a row out
    /// of range, repeated or held by another owner is an error naming it.
    pub fn claim(&mut self, owner: RowOwner, rows: &[usize]) -> Result<()> {
        self.check_rows(rows)?;
        if let Some(&r) = rows.iter().find(|&&r| self.owners[r].is_some_and(|o| o != owner)) {
            return Err(Error::Input(format!(
                "row {r} is held by another user of this engine (a scheduler, rollouts or a claim); \
                 take a free row"
            )));
        }
        for &r in rows {
            self.owners[r] = Some(owner);
        }
        Ok(())
    }

    /// Claim `n` free rows for `owner`, lowest first; an error (changing nothing) when fewer
    /// are free.
    pub fn claim_free(&mut self, owner: RowOwner, n: usize) -> Result<Vec<usize>> {
        let free: Vec<usize> = (0..self.rows).filter(|&r| self.owners[r].is_none()).take(n).collect();
        if free.len() < n {
            return Err(Error::Input(format!("{n} rows asked for, {} of {} are free", free.len(), self.rows)));
        }
        self.claim(owner, &free)?;
        Ok(free)
    }

    /// Give back those of `rows` that `owner` holds.
    pub fn release(&mut self, owner: RowOwner, rows: &[usize]) {
        for &r in rows {
            if self.owners.get(r).copied().flatten() == Some(owner) {
                self.owners[r] = None;
            }
        }
    }

    /// Blocks `row` holds (shared ones included).
    pub fn row_blocks(&self, row: usize) -> usize {
        self.blocks.table(row).len()
    }

    /// Blocks `row` could still take: free blocks of its pool shard, and cached ones no row
    /// holds (evicted on demand).
    pub fn available_blocks(&self, row: usize) -> usize {
        self.blocks.available(row)
    }

    /// Positions one row can reach: `max_len`, or less when its pool shard is smaller (a model
    /// without global layers, every layer a ring, has no pool to run out of).
    pub fn row_capacity(&self) -> usize {
        if self.global.is_empty() {
            return self.max_len;
        }
        self.max_len.min(self.blocks.blocks_per_shard() * self.blocks.block_len())
    }

    /// Check the block pool's bookkeeping: each block's reference count equals the rows holding
    /// it, every block is held or free, and each row holds exactly the blocks of its tokens.
    /// The error describes the first inconsistency (a leak, a double free).
    pub fn check_blocks(&self) -> Result<()> {
        self.blocks.audit().map_err(Error::Input)?;
        for r in 0..self.rows {
            let paged = !self.global.is_empty();
            let want = if paged { self.lens_cpu[r].div_ceil(self.blocks.block_len()) } else { 0 };
            if self.blocks.table(r).len() != want {
                return Err(Error::Input(format!(
                    "row {r} holds {} blocks for {} tokens (expected {want})",
                    self.blocks.table(r).len(),
                    self.lens_cpu[r]
                )));
            }
        }
        Ok(())
    }

    /// Bytes a cache of this shape allocates on the GPU (K/V pools and rings, ring positions,
    /// lengths, token history, block tables), computed before allocating anything.
    pub fn bytes_needed(cfg: &ModelConfig, o: &CacheOptions) -> u64 {
        let ring_slots = if cfg.has_local() { cfg.window + o.spare } else { 0 } as u64;
        let per_position = (cfg.n_kv_heads * cfg.head_dim * o.dtype.bytes()) as u64;
        let locals = cfg.layers.iter().filter(|l| l.local).count() as u64;
        // the shards' scratch blocks are a few blocks more: count one per row, an upper bound
        let blocks = (o.pool_blocks(cfg).unwrap_or(0) + o.rows) as u64;
        let kv = cfg.n_groups() as u64 * 2 * blocks * o.block_len as u64 * per_position
            + locals * 2 * (ring_slots + 1) * per_position * o.rows as u64;
        let max_blocks = o.max_len.div_ceil(o.block_len.max(1)) as u64;
        kv + o.rows as u64 * ((ring_slots + 1) + 1 + (o.max_len as u64 + 1) + max_blocks) * 4
    }

    /// Whether the prompt cache is on.
    pub fn prompt_cache(&self) -> bool {
        self.blocks.prompt_cache()
    }

    /// What the prompt cache did so far: lookups, prompt tokens looked up and found, evictions.
    pub fn prompt_cache_stats(&self) -> PromptCacheStats {
        self.blocks.prompt_cache_stats()
    }
}

/// Each row's (length, positions written, skips, history length) at some moment; see
/// [`KvCache::mark`].
#[derive(Clone, Debug)]
pub(crate) struct HostMark(Vec<(usize, usize, usize, usize)>);
