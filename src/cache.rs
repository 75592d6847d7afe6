//! The small KV cache: one global K/V per layer group, one constant-size ring per local layer,
//! per-row lengths on the GPU mirrored on the CPU, and each row's token history.
//!
//! Layouts (all `[rows, ...]` so a row's entries never alias another row's):
//! - global K and V of group g: `[rows, n_kv_heads, max_len + 1, head_dim]`; position `max_len`
//!   is the scratch slot that padding tokens write.
//! - ring K and V of local layer l: `[rows, n_kv_heads, W + 1, head_dim]`; position `p` lives in
//!   slot `p % W`, slot `W` is the scratch slot.
//! - `lpos`: `[rows, W + 1]` i32, the absolute position held by each ring slot (-1: empty); shared
//!   by every ring since all rings hold the same positions.
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
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

/// The per-row KV cache (GPU buffers plus the CPU mirror of what is in them).
pub struct KvCache {
    rows: usize,
    max_len: usize,
    window: usize,
    dtype: KvDtype,
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Per group: (K, V).
    pub(crate) global: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    /// Per layer: its ring (K, V) if the layer is local.
    pub(crate) ring: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
    pub(crate) lpos: wgpu::Buffer,
    pub(crate) lens: wgpu::Buffer,
    pub(crate) history: wgpu::Buffer,
    /// CPU mirror of `lens`: the host knows every shape without reading the GPU.
    pub(crate) lens_cpu: Vec<usize>,
    /// CPU mirror of `history` (the first `lens_cpu[row]` ids of each row).
    pub(crate) history_cpu: Vec<Vec<u32>>,
}

impl KvCache {
    /// Allocate an empty cache of `rows` rows of capacity `max_len` for `cfg`.
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, rows: usize, max_len: usize, dtype: KvDtype) -> Result<Self> {
        cfg.validate()?;
        if rows == 0 || max_len == 0 {
            return Err(Error::Input(format!("cache needs rows >= 1 and max_len >= 1, got {rows} and {max_len}")));
        }
        if max_len >= i32::MAX as usize / 2 || rows > u32::MAX as usize / 2 {
            return Err(Error::Input(format!("max_len {max_len} or rows {rows} is too large")));
        }
        let (hk, d) = (cfg.n_kv_heads, cfg.head_dim);
        let w = cfg.window;
        let bytes = |slots: usize| (rows * hk * slots * d * dtype.bytes()) as u64;
        let mut global = Vec::new();
        for g in 0..cfg.n_groups() {
            global.push((
                gpu.storage(&format!("global K of group {g}"), bytes(max_len + 1))?,
                gpu.storage(&format!("global V of group {g}"), bytes(max_len + 1))?,
            ));
        }
        let mut ring = Vec::new();
        for (i, l) in cfg.layers.iter().enumerate() {
            ring.push(if l.local {
                Some((
                    gpu.storage(&format!("ring K of layer {i}"), bytes(w + 1))?,
                    gpu.storage(&format!("ring V of layer {i}"), bytes(w + 1))?,
                ))
            } else {
                None
            });
        }
        let lpos = gpu.storage_init("lpos", bytemuck::cast_slice(&vec![-1i32; rows * (w + 1)]))?;
        let lens = gpu.storage("lens", (rows * 4) as u64)?;
        let history = gpu.storage("token history", (rows * (max_len + 1) * 4) as u64)?;
        Ok(KvCache {
            rows,
            max_len,
            window: w,
            dtype,
            n_layers: cfg.n_layers(),
            n_kv_heads: hk,
            head_dim: d,
            global,
            ring,
            lpos,
            lens,
            history,
            lens_cpu: vec![0; rows],
            history_cpu: vec![Vec::new(); rows],
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Capacity of each row in tokens.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Ring window `W`.
    pub fn window(&self) -> usize {
        self.window
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

    /// Bytes of K/V storage (global caches and rings, scratch slots included).
    pub fn nbytes(&self) -> u64 {
        let per = (self.rows * self.n_kv_heads * self.head_dim * self.dtype.bytes()) as u64;
        let g = self.global.len() as u64 * 2 * (self.max_len as u64 + 1) * per;
        let r = self.ring.iter().flatten().count() as u64 * 2 * (self.window as u64 + 1) * per;
        g + r
    }

    /// Bytes a naive cache would take: every layer its own full-length K and V.
    pub fn naive_nbytes(&self) -> u64 {
        (self.n_layers * 2 * self.rows * self.n_kv_heads * self.max_len * self.head_dim * self.dtype.bytes()) as u64
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
        let empty_ring = vec![-1i32; self.window + 1];
        for &r in rows {
            self.lens_cpu[r] = 0;
            self.history_cpu[r].clear();
            gpu.queue.write_buffer(&self.lens, (r * 4) as u64, &0u32.to_le_bytes());
            gpu.queue.write_buffer(&self.lpos, (r * (self.window + 1) * 4) as u64, bytemuck::cast_slice(&empty_ring));
        }
        Ok(())
    }
}
