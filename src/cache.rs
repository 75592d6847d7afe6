//! The small KV cache: one global K/V per layer group, one constant-size ring per local layer,
//! per-row lengths on the GPU mirrored on the CPU, and each row's token history.
//!
//! Layouts (all `[rows, ...]` so a row's entries never alias another row's):
//! - global K and V of group g: `[rows, n_kv_heads, max_len + 1, head_dim]`; position `max_len`
//!   is the scratch slot that padding tokens write.
//! - ring K and V of local layer l: `[rows, n_kv_heads, N + 1, head_dim]` with `N = W + spare`
//!   slots: the window plus `spare` slots that make a rollback of up to `spare` tokens exact.
//!   Position `p` lives in slot `p % N`, slot `N` is the scratch slot.
//! - `lpos`: `[rows, N + 1]` i32, the absolute position held by each ring slot (-1: empty); shared
//!   by every ring since all rings hold the same positions.
//! - caches larger than one storage binding (128 MiB under the WebGPU defaults) are split by rows
//!   into shards of `shard_rows` rows, one buffer each; kernels bind one shard per dispatch.
//! - `lens`: `[rows]` u32 and `history`: `[rows, max_len + 1]` u32 (token ids, for modules that look
//!   back over previous tokens).

use crate::config::ModelConfig;
use crate::device::Gpu;
use crate::error::{Error, Result};

/// Element type of the stored keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// 32-bit floats.
    F32,
    /// IEEE halves, packed two per u32 (no `shader-f16` needed).
    F16,
    /// bfloat16 (the seed's default), packed two per u32 and unpacked with a shift; rounded to
    /// nearest even like PyTorch's `.to(torch.bfloat16)`.
    BF16,
}

impl KvDtype {
    /// Every storage type, for options and benchmarks.
    pub const ALL: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::BF16];

    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
        }
    }

    /// The name options use: `f32`, `f16`, `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
        }
    }

    /// Parse an option value (`f32`, `f16`, `bf16`); anything else is an error that lists them.
    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::Input(format!("unknown K/V type {s:?}; expected f32, f16 or bf16")))
    }

    /// The shaders' `KV_FORMAT` code (common.wgsl: the weight format codes of the same layouts).
    pub(crate) fn format(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::BF16 => 5,
        }
    }
}

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
    /// Rows per shard: every K/V buffer holds rows `s * shard_rows ..` of shard `s`.
    pub(crate) shard_rows: usize,
    /// Per group, per shard: (K, V).
    pub(crate) global: Vec<Vec<(wgpu::Buffer, wgpu::Buffer)>>,
    /// Per layer, per shard: its ring (K, V) if the layer is local.
    pub(crate) ring: Vec<Option<Vec<(wgpu::Buffer, wgpu::Buffer)>>>,
    pub(crate) lpos: wgpu::Buffer,
    pub(crate) lens: wgpu::Buffer,
    pub(crate) history: wgpu::Buffer,
    /// CPU mirror of `lens`: the host knows every shape without reading the GPU.
    pub(crate) lens_cpu: Vec<usize>,
    /// CPU mirror of `history` (the first `lens_cpu[row]` ids of each row).
    pub(crate) history_cpu: Vec<Vec<u32>>,
    /// Per row, the largest length reached since the last reset: the ring holds positions
    /// `written - ring_slots ..`, so a rollback to `len` is exact while `written - len <= spare`.
    pub(crate) written: Vec<usize>,
    /// Per row, runs of positions skipped as padding ([`KvCache::skip`]) as (stored tokens at the
    /// time, count): the next token is rotated by RoPE as position `lens + skipped`, skipped
    /// positions count against `max_len`, and a rollback drops the runs it goes back past.
    pub(crate) skips: Vec<Vec<(usize, usize)>>,
    /// One row's largest region; `fork` copies through it (a buffer cannot be copied into itself).
    row_stage: wgpu::Buffer,
}

impl KvCache {
    /// Allocate an empty cache of `rows` rows of capacity `max_len` for `cfg`; local rings get
    /// `spare` extra slots so that rolling back up to `spare` tokens is exact.
    pub fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        rows: usize,
        max_len: usize,
        dtype: KvDtype,
        spare: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        if rows == 0 || max_len == 0 {
            return Err(Error::Input(format!("cache needs rows >= 1 and max_len >= 1, got {rows} and {max_len}")));
        }
        if max_len >= i32::MAX as usize / 2 || rows > u32::MAX as usize / 2 {
            return Err(Error::Input(format!("max_len {max_len} or rows {rows} is too large")));
        }
        let (hk, d) = (cfg.n_kv_heads, cfg.head_dim);
        let w = if cfg.has_local() { cfg.window + spare } else { 0 };
        let row_bytes = |slots: usize| (hk * slots * d * dtype.bytes()) as u64;
        // the widest per-row buffer decides how many rows one binding holds
        let widest = if cfg.n_groups() > 0 { row_bytes(max_len + 1) } else { row_bytes(w + 1) };
        let shard_rows = ((gpu.max_binding() / widest) as usize).min(rows);
        if shard_rows == 0 {
            return Err(Error::Limit(format!(
                "one row of K/V ({widest} bytes for max_len {max_len}) exceeds a storage binding ({} bytes); lower max_len or use f16 K/V",
                gpu.max_binding()
            )));
        }
        let shards: Vec<(usize, usize)> =
            (0..rows).step_by(shard_rows).map(|r0| (r0, shard_rows.min(rows - r0))).collect();
        let pair = |what: &str, slots: usize| -> Result<Vec<(wgpu::Buffer, wgpu::Buffer)>> {
            shards
                .iter()
                .map(|&(r0, n)| {
                    let tag = format!("{what} rows {r0}..{}", r0 + n);
                    Ok((
                        gpu.storage(&format!("K {tag}"), n as u64 * row_bytes(slots))?,
                        gpu.storage(&format!("V {tag}"), n as u64 * row_bytes(slots))?,
                    ))
                })
                .collect()
        };
        let global = (0..cfg.n_groups())
            .map(|g| pair(&format!("global of group {g}"), max_len + 1))
            .collect::<Result<Vec<_>>>()?;
        let ring = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| if l.local { pair(&format!("ring of layer {i}"), w + 1).map(Some) } else { Ok(None) })
            .collect::<Result<Vec<_>>>()?;
        let lpos = gpu.storage_init("lpos", bytemuck::cast_slice(&vec![-1i32; rows * (w + 1)]))?;
        let lens = gpu.storage("lens", (rows * 4) as u64)?;
        let history = gpu.storage("token history", (rows * (max_len + 1) * 4) as u64)?;
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
            ring,
            lpos,
            lens,
            history,
            lens_cpu: vec![0; rows],
            history_cpu: vec![Vec::new(); rows],
            written: vec![0; rows],
            skips: vec![Vec::new(); rows],
            row_stage: gpu.buffer(
                "fork row stage",
                widest.max((max_len as u64 + 1) * 4).max((w as u64 + 1) * 4).next_multiple_of(4),
                wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            )?,
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
        let by_binding = gpu.max_binding() / per_position.max(1) - 1;
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
        let per = (self.rows * self.n_kv_heads * self.head_dim * self.dtype.bytes()) as u64;
        let g = self.global.len() as u64 * 2 * (self.max_len as u64 + 1) * per;
        let r = self.ring.iter().flatten().count() as u64 * 2 * (self.ring_slots as u64 + 1) * per;
        g + r
    }

    /// Bytes a cache of these dimensions allocates on the GPU (K/V, ring positions, lengths, token
    /// history), computed before allocating anything.
    pub fn bytes_needed(cfg: &ModelConfig, rows: usize, max_len: usize, dtype: KvDtype, spare: usize) -> u64 {
        let ring_slots = if cfg.has_local() { cfg.window + spare } else { 0 } as u64;
        let per = (rows * cfg.n_kv_heads * cfg.head_dim * dtype.bytes()) as u64;
        let locals = cfg.layers.iter().filter(|l| l.local).count() as u64;
        let kv = cfg.n_groups() as u64 * 2 * (max_len as u64 + 1) * per + locals * 2 * (ring_slots + 1) * per;
        kv + rows as u64 * ((ring_slots + 1) + 1 + (max_len as u64 + 1)) * 4
    }

    /// Bytes a naive cache would take: every layer its own full-length K and V.
    pub fn naive_nbytes(&self) -> u64 {
        (self.n_layers * 2 * self.rows * self.n_kv_heads * self.max_len * self.head_dim * self.dtype.bytes()) as u64
    }

    /// The host-side bookkeeping of every row, taken before a step whose results are awaited.
    pub(crate) fn mark(&self) -> HostMark {
        HostMark(
            (0..self.rows)
                .map(|r| (self.lens_cpu[r], self.written[r], self.skips[r].len(), self.history_cpu[r].len()))
                .collect(),
        )
    }

    /// Put the host-side bookkeeping back to `mark` (a step only ever adds to it). For a device
    /// lost while a step was in flight: the GPU's copy is gone anyway, and the rows read as the
    /// caller last saw them.
    pub(crate) fn restore_host(&mut self, mark: &HostMark) {
        for (r, &(len, written, skips, history)) in mark.0.iter().enumerate() {
            self.lens_cpu[r] = len;
            self.written[r] = written;
            self.skips[r].truncate(skips);
            self.history_cpu[r].truncate(history);
        }
    }

    /// Check a list of cache rows: in range and not repeated. Names the offending row.
    pub(crate) fn check_rows(&self, rows: &[usize]) -> Result<()> {
        let mut seen = vec![false; self.rows];
        for (i, &r) in rows.iter().enumerate() {
            if r >= self.rows {
                return Err(Error::Input(format!("rows[{i}] = {r} is out of range (cache has {} rows)", self.rows)));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::Input(format!("row {r} appears twice in rows")));
            }
        }
        Ok(())
    }

    /// Empty these rows so new sequences can start there (old K/V is masked by length and lpos).
    pub fn reset(&mut self, gpu: &Gpu, rows: &[usize]) -> Result<()> {
        self.check_rows(rows)?;
        let empty_ring = vec![-1i32; self.ring_slots + 1];
        for &r in rows {
            self.lens_cpu[r] = 0;
            self.written[r] = 0;
            self.skips[r].clear();
            self.history_cpu[r].clear();
            gpu.queue.write_buffer(&self.lens, (r * 4) as u64, &0u32.to_le_bytes());
            gpu.queue.write_buffer(
                &self.lpos,
                (r * (self.ring_slots + 1) * 4) as u64,
                bytemuck::cast_slice(&empty_ring),
            );
        }
        Ok(())
    }

    /// Remove the last `n[i]` tokens of `rows[i]`, exactly as if they had never been appended.
    /// Global K/V beyond the new length is masked by length; ring slots rolled back are ignored by
    /// position checks, and the spare slots keep the window intact. Errors (naming the row) if a
    /// row cannot roll back that far; then nothing changes.
    pub fn rollback(&mut self, gpu: &Gpu, rows: &[usize], n: &[usize]) -> Result<()> {
        self.check_rows(rows)?;
        if rows.len() != n.len() {
            return Err(Error::Input(format!("rollback: {} rows but {} counts", rows.len(), n.len())));
        }
        for (&r, &k) in rows.iter().zip(n) {
            if k > self.max_rollback(r) {
                return Err(Error::Input(format!(
                    "row {r}: cannot roll back {k} tokens exactly (at most {}: length {}, {} spare ring slots)",
                    self.max_rollback(r),
                    self.lens_cpu[r],
                    self.ring_slots - self.window
                )));
            }
        }
        for (&r, &k) in rows.iter().zip(n) {
            self.lens_cpu[r] -= k;
            self.history_cpu[r].truncate(self.lens_cpu[r]);
            let len = self.lens_cpu[r];
            self.skips[r].retain(|&(at, _)| at <= len);
            gpu.queue.write_buffer(&self.lens, (r * 4) as u64, &(self.lens_cpu[r] as u32).to_le_bytes());
        }
        Ok(())
    }

    /// Copy row `src` (K/V, ring, positions, history, length) into each row of `dst` on the GPU,
    /// so they continue from the same prefix without recomputing it.
    pub fn fork(&mut self, gpu: &Gpu, src: usize, dst: &[usize]) -> Result<()> {
        self.check_rows(dst)?;
        self.check_rows(&[src])?;
        if dst.contains(&src) {
            return Err(Error::Input(format!("fork: row {src} is both the source and a destination")));
        }
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("fork") });
        let per_slot = (self.n_kv_heads * self.head_dim * self.dtype.bytes()) as u64;
        let sr = self.shard_rows;
        let sharded = |bufs: &[(wgpu::Buffer, wgpu::Buffer)], slots: usize, v: bool| {
            let row_bytes = per_slot * slots as u64;
            let owned: Vec<(wgpu::Buffer, u64)> = (0..self.rows)
                .map(|r| {
                    let pair = &bufs[r / sr];
                    ((if v { &pair.1 } else { &pair.0 }).clone(), (r % sr) as u64 * row_bytes)
                })
                .collect();
            (owned, row_bytes)
        };
        let mut regions: Vec<(Vec<(wgpu::Buffer, u64)>, u64)> = Vec::new();
        for g in &self.global {
            regions.push(sharded(g, self.max_len + 1, false));
            regions.push(sharded(g, self.max_len + 1, true));
        }
        for r in self.ring.iter().flatten() {
            regions.push(sharded(r, self.ring_slots + 1, false));
            regions.push(sharded(r, self.ring_slots + 1, true));
        }
        for (buf, row_bytes) in [
            (&self.lpos, (self.ring_slots as u64 + 1) * 4),
            (&self.history, (self.max_len as u64 + 1) * 4),
            (&self.lens, 4),
        ] {
            regions.push(((0..self.rows).map(|r| (buf.clone(), r as u64 * row_bytes)).collect(), row_bytes));
        }
        // every region: src row -> stage -> each destination row
        for (per_row, bytes) in &regions {
            enc.copy_buffer_to_buffer(&per_row[src].0, per_row[src].1, &self.row_stage, 0, *bytes);
            for &d in dst {
                enc.copy_buffer_to_buffer(&self.row_stage, 0, &per_row[d].0, per_row[d].1, *bytes);
            }
        }
        gpu.queue.submit([enc.finish()]);
        for &d in dst {
            self.lens_cpu[d] = self.lens_cpu[src];
            self.written[d] = self.written[src];
            self.skips[d] = self.skips[src].clone();
            self.history_cpu[d] = self.history_cpu[src].clone();
        }
        Ok(())
    }
}

/// Each row's (length, positions written, skips, history length) at some moment; see
/// [`KvCache::mark`].
#[derive(Clone, Debug)]
pub(crate) struct HostMark(Vec<(usize, usize, usize, usize)>);
