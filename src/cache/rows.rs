//! What happens to a row's cache: its blocks reserved ahead of a step, a prompt-cache prefix
//! adopted, the copy-on-write block copies recorded, and reset, rollback and fork.

use super::blocks::BlockCopy;
use super::{HostMark, KvCache, STAGE_BLOCKS};
use crate::error::{Error, Result};
use crate::gpu::device::Gpu;

impl KvCache {
    /// Give the empty `row` the prompt cache's blocks of the longest prefix of `prompt` it holds
    /// (from any row, finished or not), leaving at least one token to compute. Returns
    /// `(start, end)`: the row holds `prompt[..start]` and the blocks up to `end`; the engine
    /// replays `prompt[start..end]` without writing global K/V (models with local layers: their
    /// rings), see [`crate::Engine::reuse_prefix`]. (0, 0) when nothing is reused.
    pub(crate) fn adopt_prefix(&mut self, gpu: &Gpu, row: usize, prompt: &[u32]) -> Result<(usize, usize)> {
        self.check_rows(&[row])?;
        if self.position(row) != 0 {
            return Err(Error::Input(format!(
                "row {row} holds {} positions; reset it before reusing a cached prefix",
                self.position(row)
            )));
        }
        let (start, end) = self.blocks.adopt(row, prompt, self.replay);
        if end > 0 {
            self.upload_table(gpu, row);
            self.lens_cpu[row] = start;
            self.written[row] = start;
            self.history_cpu[row] = prompt[..start].to_vec();
            gpu.queue.write_buffer(&self.lens, (row * 4) as u64, &(start as u32).to_le_bytes());
            let at = (row * (self.max_len + 1) * 4) as u64;
            gpu.queue.write_buffer(&self.history, at, bytemuck::cast_slice(&prompt[..start]));
        }
        Ok((start, end))
    }

    /// Put `row`'s full blocks in the prompt cache (those before any skipped positions: a skip
    /// moves the positions of what follows).
    /// A step stored `n` more tokens of `row`: its length and high-water mark move on, the
    /// history takes `tokens` (`None`: ids sampled on the GPU and fed back, not known yet; see
    /// [`KvCache::record_sampled`]), and its full blocks enter the prompt cache. The engine calls
    /// this once per row after it submits a chunk; nothing else writes the CPU mirror.
    pub(crate) fn advance(&mut self, row: usize, n: usize, tokens: Option<&[u32]>) {
        self.lens_cpu[row] += n;
        self.written[row] = self.written[row].max(self.lens_cpu[row]);
        if let Some(tokens) = tokens {
            self.history_cpu[row].extend_from_slice(tokens);
        }
        self.register_blocks(row);
    }

    /// The ids a multi-step window sampled and fed back on the GPU, once they are read back: the
    /// history catches up with the length [`KvCache::advance`] already counted.
    pub(crate) fn record_sampled(&mut self, row: usize, ids: &[u32]) {
        self.history_cpu[row].extend_from_slice(ids);
        self.register_blocks(row);
    }

    /// Positions `row` skipped as padding: (tokens stored before the skip, positions skipped).
    pub(crate) fn skips(&self, row: usize) -> &[(usize, usize)] {
        &self.skips[row]
    }

    fn register_blocks(&mut self, row: usize) {
        let stored = self.skips[row].first().map_or(self.lens_cpu[row], |s| s.0).min(self.history_cpu[row].len());
        self.blocks.register(row, &self.history_cpu[row][..stored]);
    }

    /// Reserve the global K/V blocks of `n[i]` new tokens of `rows[i]` for the next step: new
    /// blocks from the row's shard, and a private copy of a partly filled block the row shares
    /// (copy-on-write; the copy runs at the start of the next step). Updated tables are written
    /// to the GPU now (they travel with the step's submit). All or nothing: when the pool lacks
    /// blocks, [`Error::OutOfBlocks`] names the row and shard, and nothing changes.
    pub(crate) fn reserve(&mut self, gpu: &Gpu, rows: &[usize], n: &[usize]) -> Result<()> {
        if self.global.is_empty() {
            return Ok(()); // only local layers: nothing is paged
        }
        let lens: Vec<usize> = rows.iter().map(|&r| self.lens_cpu[r]).collect();
        let new_lens: Vec<usize> = lens.iter().zip(n).map(|(l, k)| l + k).collect();
        let (copies, changed) = self.blocks.reserve(rows, &lens, &new_lens)?;
        self.pending_copies.extend(copies);
        for r in changed {
            self.upload_table(gpu, r);
        }
        Ok(())
    }

    /// Record the block copies pending for this step (copy-on-write) at the start of `enc`.
    pub(crate) fn record_pending_copies(&mut self, enc: &mut wgpu::CommandEncoder) {
        let copies = std::mem::take(&mut self.pending_copies);
        self.record_copies(enc, &copies);
    }

    /// Copy whole blocks (every group's K and V), through the stage where source and destination
    /// share a buffer.
    fn record_copies(&self, enc: &mut wgpu::CommandEncoder, copies: &[BlockCopy]) {
        let bb = self.block_bytes();
        for batch in copies.chunks(STAGE_BLOCKS) {
            for pools in &self.global {
                for (i, c) in batch.iter().enumerate() {
                    enc.copy_buffer_to_buffer(
                        &pools[c.from_shard],
                        c.from as u64 * bb,
                        &self.block_stage,
                        i as u64 * bb,
                        bb,
                    );
                }
                for (i, c) in batch.iter().enumerate() {
                    enc.copy_buffer_to_buffer(
                        &self.block_stage,
                        i as u64 * bb,
                        &pools[c.to_shard],
                        c.to as u64 * bb,
                        bb,
                    );
                }
            }
        }
    }

    /// Write `row`'s block table to the GPU copy (entries past its blocks are left as they were:
    /// no query reaches them).
    fn upload_table(&self, gpu: &Gpu, row: usize) {
        let t = self.blocks.table(row);
        if !t.is_empty() {
            let at = (row * self.blocks.max_blocks() * 4) as u64;
            gpu.queue.write_buffer(&self.block_tables, at, bytemuck::cast_slice(t));
        }
    }

    /// Keep only the blocks of `row`'s stored tokens, freeing the rest.
    fn release_beyond_len(&mut self, gpu: &Gpu, row: usize) {
        if self.blocks.truncate(row, self.lens_cpu[row]) {
            self.upload_table(gpu, row);
        }
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
            // the GPU is gone: only the CPU's tables matter, and its entries past a row's
            // blocks are never read
            self.blocks.truncate(r, len);
        }
    }

    /// Every GPU buffer of the cache, in a fixed order ([`crate::Engine::sleep`] releases and
    /// replaces them).
    pub(crate) fn buffers_mut(&mut self) -> Vec<&mut wgpu::Buffer> {
        let mut out: Vec<&mut wgpu::Buffer> = self.global.iter_mut().flatten().collect();
        out.extend(self.ring.iter_mut().flatten().flatten());
        out.extend([
            &mut self.block_tables,
            &mut self.lpos,
            &mut self.lens,
            &mut self.history,
            &mut self.row_stage,
            &mut self.block_stage,
        ]);
        out
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
            self.blocks.truncate(r, 0);
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
            self.release_beyond_len(gpu, r);
            gpu.queue.write_buffer(&self.lens, (r * 4) as u64, &(self.lens_cpu[r] as u32).to_le_bytes());
        }
        Ok(())
    }

    /// Make each row of `dst` continue from row `src`'s prefix without recomputing it: the
    /// destinations share `src`'s global K/V blocks by reference count (copied only across pool
    /// shards; a shared partly filled block is copied when a row first writes it), and get copies
    /// of its ring, ring positions, history and length. What the destinations held is released.
    /// Errors (naming the row) when a copy across shards finds no free blocks; then nothing changes.
    pub fn fork(&mut self, gpu: &Gpu, src: usize, dst: &[usize]) -> Result<()> {
        self.check_rows(dst)?;
        self.check_rows(&[src])?;
        if dst.contains(&src) {
            return Err(Error::Input(format!("fork: row {src} is both the source and a destination")));
        }
        let block_copies = self.blocks.share(src, dst)?;
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("fork") });
        self.record_copies(&mut enc, &block_copies);
        let ring_row = (2 * self.n_kv_heads * self.head_dim * self.dtype.bytes() * (self.ring_slots + 1)) as u64;
        let sr = self.shard_rows;
        let mut regions: Vec<(Vec<(wgpu::Buffer, u64)>, u64)> = Vec::new();
        for shards in self.ring.iter().flatten() {
            let per_row = (0..self.rows).map(|r| (shards[r / sr].clone(), (r % sr) as u64 * ring_row)).collect();
            regions.push((per_row, ring_row));
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
        for &d in dst {
            self.upload_table(gpu, d);
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
