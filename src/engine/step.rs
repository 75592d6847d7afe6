//! One call's way through the GPU: checks before anything is written, chunks of at most
//! [`crate::CHUNK`] tokens per row, one encoder and one submit per chunk, and the readback of
//! logits, sampled ids or all-position logits.

use crate::engine::dispatch::Dispatch;
use crate::engine::options::Logits;
use crate::engine::sampling::{Sampled, Sampler, SamplerGpu, TOP_LOGPROBS_MAX};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gpu::lora::NO_ADAPTER;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct StepGpu {
    rows: u32,
    width: u32,
    tokens: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct RowInfoGpu {
    cache_row: u32,
    n_new: u32,
    pos0: u32,
    rope_pos0: u32,
    global_from: u32,
    lora: u32,
    /// `sample.wgsl`'s SCORE: the token after the row's last in this chunk (`u32::MAX`: none).
    next_id: u32,
    _pad: u32,
}

impl Engine {
    /// Feed a right-padded chunk `ids` (`[R, width]`, row-major); chunk row `r` has `n_new[r]` real
    /// tokens (0 leaves the row untouched). `rows`: the cache rows the chunk rows refer to (a
    /// sub-batch); `None` means all cache rows in order. Returns the logits at each row's last real
    /// token. Everything is checked before anything is written: on error no row changes.
    /// ([`Engine::step`] with [`Want::Logits`](crate::Want::Logits); blocks until the GPU is done.)
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append(&mut self, ids: &[u32], width: usize, n_new: &[usize], rows: Option<&[usize]>) -> Result<Logits> {
        crate::gpu::pending::block_on(self.run_logits(ids, width, n_new, rows))
    }

    /// [`Want::Logits`](crate::Want::Logits): run, then read back the logits at each row's last token.
    pub(super) async fn run_logits(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
    ) -> Result<Logits> {
        let mark = self.cache.mark();
        let any = self.run(ids, width, n_new, rows, None, Output::Logits).await?;
        let mut data = vec![0f32; n_new.len() * self.cfg.vocab];
        if any {
            let read = self.read_async(&self.s.logits_read, bytemuck::cast_slice_mut(&mut data)).await;
            self.undo_if_lost(read, &mark)?;
        }
        Ok(Logits { vocab: self.cfg.vocab, data, valid: n_new.iter().map(|&n| n > 0).collect() })
    }

    /// Like [`Engine::append`], but reads nothing back (prefill and tool results whose logits
    /// nobody needs): the call returns as soon as the work is submitted ([`Want::Nothing`](crate::Want::Nothing)).
    pub fn feed(&mut self, ids: &[u32], width: usize, n_new: &[usize], rows: Option<&[usize]>) -> Result<()> {
        crate::gpu::pending::now(self.run(ids, width, n_new, rows, None, Output::None)).map(|_| ())
    }

    /// Like [`Engine::append`], but samples on the GPU and reads back only the ids: `samplers[r]`
    /// picks chunk row `r`'s next token. Rows that received no token give `None`.
    /// ([`Engine::step`] with [`Want::Sampled`](crate::Want::Sampled) gives each token's log-probability and
    /// alternatives too.)
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_sample(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<u32>>> {
        let got = crate::gpu::pending::block_on(self.run_sampled(ids, width, n_new, rows, samplers))?;
        Ok(got.into_iter().map(|o| o.map(|s| s.token)).collect())
    }

    /// [`Want::Sampled`](crate::Want::Sampled): run, sampling each row's next token on the GPU, and read back each with
    /// its log-probability and, for samplers that ask (`top_logprobs`), the most likely
    /// alternatives.
    pub(super) async fn run_sampled(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
    ) -> Result<Vec<Option<Sampled>>> {
        let top = samplers.iter().any(|s| s.top_logprobs > 0);
        let mark = self.cache.mark();
        let any = self.run(ids, width, n_new, rows, Some(samplers), Output::Sampled { slot: 0, top }).await?;
        let r_n = n_new.len();
        let mut got = vec![0u32; 3 * r_n];
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
                    Sampled { token: got[r], logprob: f32::from_bits(got[r_n + r]), top, kept: got[2 * r_n + r] }
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
        self.ready()?;
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

    /// Write one chunk's shape, rows and ids, record every dispatch of `out` and submit them (in
    /// one submission, or in parts: [`crate::EngineOptions::dispatches_per_submit`]). `n_sub[r]`
    /// tokens of chunk row `r` start at `ids[r * stride + start]`; with `ids_from_sampled`, the
    /// ids are instead last step's sampled ids (one per row, on the GPU).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn submit_chunk(
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
            .enumerate()
            .map(|(r, (&row, &n))| RowInfoGpu {
                cache_row: row as u32,
                n_new: n as u32,
                pos0: self.cache.lens()[row] as u32,
                rope_pos0: self.cache.position(row) as u32,
                global_from: self.cache.replay_until[row] as u32,
                lora: self.lora.row_slot(row),
                next_id: self.score_next.get(r).copied().unwrap_or(u32::MAX),
                _pad: 0,
            })
            .collect();
        q.write_buffer(&self.s.step, 0, bytemuck::bytes_of(&step));
        q.write_buffer(&self.s.row_info, 0, bytemuck::cast_slice(&info));
        // the adapters' token groups (their count sizes lora.wgsl's grids) and the products' order
        let mut groups = 0;
        if self.weights.lora.is_some() {
            let list = lora_groups(&info, c);
            groups = list[0][0] as usize;
            q.write_buffer(&self.s.lora_groups, 0, bytemuck::cast_slice(&list));
        }
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
                    SamplerGpu::new(s, (self.cache.lens()[row] + n) as u32, self.sampling.masked[row])
                })
                .collect();
            q.write_buffer(&self.s.samplers, 0, bytemuck::cast_slice(&g));
        }
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("chunk") });
        self.cache.record_pending_copies(&mut enc);
        if ids_from_sampled {
            enc.copy_buffer_to_buffer(&self.s.sampled, 0, &self.s.ids, 0, (r_n * 4) as u64);
        }
        // finished parts of the chunk, when it is split into several submissions
        let mut parts: Vec<wgpu::CommandBuffer> = Vec::new();
        {
            let head = match out {
                Output::AllLogits | Output::Scored { .. } => &self.all_head_dispatches,
                _ => &self.head_dispatches,
            };
            let mut all: Vec<&Dispatch> = self
                .chunk_dispatches
                .iter()
                .chain(head)
                .filter(|d| d.live(r_n, c))
                .map(|d| d.for_chunk(r_n, c))
                .collect();
            let vocab = self.cfg.vocab;
            match (out, samplers) {
                (Output::Scored { .. }, Some(sm)) => all.extend(self.score_dispatches.for_samplers(sm, vocab)),
                (_, Some(sm)) => {
                    if self.sampling.any_bias(cache_rows) {
                        all.push(&self.bias_dispatch);
                    }
                    all.extend(self.sample_dispatches.for_samplers(sm, vocab));
                }
                _ => {}
            }
            match self.profiler.as_mut().filter(|_| self.profiling) {
                // profiled: one pass with a timestamp after each dispatch, or where the device
                // cannot write those, one pass per dispatch with timestamps around each
                Some(p) if p.in_one_pass => {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("profiled"),
                        timestamp_writes: None,
                    });
                    p.stamp(&mut pass, 0);
                    for (i, d) in all.iter().enumerate() {
                        d.record(&mut pass, r_n, c, groups);
                        p.stamp(&mut pass, i + 1);
                    }
                    drop(pass);
                    p.recorded = all.iter().map(|d| (d.kernel, d.label.clone())).collect();
                    p.resolve(&mut enc);
                }
                Some(p) => {
                    for (i, d) in all.iter().enumerate() {
                        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some("profiled"),
                            timestamp_writes: p.writes(i),
                        });
                        d.record(&mut pass, r_n, c, groups);
                    }
                    p.recorded = all.iter().map(|d| (d.kernel, d.label.clone())).collect();
                    p.resolve(&mut enc);
                }
                None => {
                    let per =
                        if self.dispatches_per_submit == 0 { all.len().max(1) } else { self.dispatches_per_submit };
                    let count = all.len().div_ceil(per).max(1);
                    for (i, part) in all.chunks(per).enumerate() {
                        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some("chunk"),
                            timestamp_writes: None,
                        });
                        for d in part {
                            d.record(&mut pass, r_n, c, groups);
                        }
                        drop(pass);
                        if i + 1 < count {
                            let next = self
                                .gpu
                                .device
                                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("chunk") });
                            parts.push(std::mem::replace(&mut enc, next).finish());
                        }
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
            Output::Scored { top } => {
                let tokens = (r_n * c) as u64;
                enc.copy_buffer_to_buffer(&self.s.scored, 0, &self.s.scored_read, 0, tokens * 12);
                if top {
                    let bytes = tokens * TOP_LOGPROBS_MAX as u64 * 8;
                    enc.copy_buffer_to_buffer(&self.s.scored_top, 0, &self.s.scored_top_read, 0, bytes);
                }
            }
            Output::Sampled { slot, top } => {
                let bytes = (r_n * 12) as u64;
                enc.copy_buffer_to_buffer(&self.s.sampled, 0, &self.s.sampled_read, slot as u64 * bytes, bytes);
                if top {
                    let bytes = (r_n * TOP_LOGPROBS_MAX as usize * 8) as u64;
                    enc.copy_buffer_to_buffer(&self.sampling.top, 0, &self.sampling.top_read, 0, bytes);
                }
            }
        }
        parts.push(enc.finish());
        let count = parts.len();
        for (i, part) in parts.into_iter().enumerate() {
            q.submit([part]);
            // inside a `Pending`, the next part goes in at the next poll: a frame drawn on this
            // device between two polls waits for one part, not for the whole chunk
            if i + 1 < count && !crate::gpu::pending::readbacks_wait() {
                crate::gpu::pending::yield_now().await;
            }
        }
        self.stats.submits += count as u64;
        self.stats.chunks += 1;
        for (r, &row) in cache_rows.iter().enumerate() {
            let n = n_sub[r];
            let tokens = (!ids_from_sampled).then(|| &ids[r * stride + start..r * stride + start + n]);
            self.cache.advance(row, n, tokens);
        }
    }

    /// Split an append into chunks of at most `chunk` tokens per row and submit them; only the
    /// last chunk copies `out` for readback. Returns whether any row had tokens.
    pub(super) async fn run(
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
            )
            .await;
        }
        Ok(true)
    }

    /// Like [`Engine::append`], but returns the logits at every real token of every row
    /// (`[row][token][vocab]`), for speculative verification. The whole call must fit one chunk:
    /// at most [`Engine::chunk_width`] tokens per row and `all_logits_tokens` (rows x width) in all.
    /// ([`Engine::step`] with [`Want::AllLogits`](crate::Want::AllLogits).)
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_all_logits(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        crate::gpu::pending::block_on(self.run_all_logits(ids, width, n_new, rows))
    }

    /// [`Want::AllLogits`](crate::Want::AllLogits): run in one chunk, then read back the logits at every token.
    pub(super) async fn run_all_logits(
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
        let any = self.run(ids, width, n_new, rows, None, Output::AllLogits).await?;
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

    /// Append like [`Engine::append`], and report every token after a row's first one in the
    /// chunk as a draw at its position would: its log-probability (of `samplers[r]`'s
    /// [`crate::LogprobMode`] at its temperature and truncation), the number of tokens kept and
    /// `top_logprobs` alternatives. Row `r` gets `n_new[r] - 1` entries, for tokens 1.. of its
    /// chunk, and one more for `next[r]`, the token that follows the chunk (`u32::MAX`: none;
    /// a long sequence goes chunk by chunk, each naming the next chunk's first token). A prompt's
    /// logprobs for scoring and distillation: the same bits as each token would report sampled
    /// there (no logit bias or token mask applies). The call must fit one chunk, as
    /// [`Engine::append_all_logits`].
    /// ([`Engine::step`] with [`Want::Scored`](crate::Want::Scored) and the batch's `next`.)
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append_scored(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
        next: Option<&[u32]>,
    ) -> Result<Vec<Vec<Sampled>>> {
        crate::gpu::pending::block_on(self.run_scored(ids, width, n_new, rows, samplers, next))
    }

    /// [`Want::Scored`](crate::Want::Scored): run in one chunk, then read back every token's score.
    pub(super) async fn run_scored(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: &[Sampler],
        next: Option<&[u32]>,
    ) -> Result<Vec<Vec<Sampled>>> {
        let next = next.map(<[u32]>::to_vec).unwrap_or_else(|| vec![u32::MAX; n_new.len()]);
        if next.len() != n_new.len() {
            return Err(Error::Input(format!("append_scored: {} next ids for {} rows", next.len(), n_new.len())));
        }
        if let Some((r, &id)) =
            next.iter().enumerate().find(|&(_, &id)| id != u32::MAX && id as usize >= self.cfg.vocab)
        {
            return Err(Error::Input(format!(
                "append_scored: row {r}'s next id {id} is outside the vocabulary ({})",
                self.cfg.vocab
            )));
        }
        let longest = n_new.iter().copied().max().unwrap_or(0);
        if longest > self.chunk || n_new.len() * longest > self.all_logits_tokens {
            return Err(Error::Limit(format!(
                "scoring {} rows x {longest} tokens exceeds one chunk ({} tokens per row, {} tokens in all: \
                 EngineOptions::all_logits_tokens)",
                n_new.len(),
                self.chunk,
                self.all_logits_tokens
            )));
        }
        let top = samplers.iter().any(|s| s.top_logprobs > 0);
        let mark = self.cache.mark();
        self.score_next = next.clone();
        let ran = self.run(ids, width, n_new, rows, Some(samplers), Output::Scored { top }).await;
        self.score_next.clear();
        let any = ran?;
        let tokens = n_new.len() * longest;
        let mut got = vec![0u32; 3 * tokens];
        let mut alts = vec![0u32; if top { tokens * TOP_LOGPROBS_MAX as usize * 2 } else { 0 }];
        if any {
            let read = self.read_async(&self.s.scored_read, bytemuck::cast_slice_mut(&mut got)).await;
            self.undo_if_lost(read, &mark)?;
            if top {
                let read = self.read_async(&self.s.scored_top_read, bytemuck::cast_slice_mut(&mut alts)).await;
                self.undo_if_lost(read, &mark)?;
            }
        }
        Ok(n_new
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                (0..(n + usize::from(next[r] != u32::MAX)).saturating_sub(1))
                    .map(|j| {
                        let p = r * longest + j;
                        let at = p * TOP_LOGPROBS_MAX as usize * 2;
                        let k = samplers[r].top_logprobs as usize;
                        let top = (0..k).map(|i| (alts[at + 2 * i], f32::from_bits(alts[at + 2 * i + 1]))).collect();
                        Sampled {
                            token: got[p],
                            logprob: f32::from_bits(got[tokens + p]),
                            top,
                            kept: got[2 * tokens + p],
                        }
                    })
                    .collect()
            })
            .collect())
    }

    /// Map a readback buffer and copy its first `out.len()` bytes. Natively the map completes
    /// inside `poll` (this one's, or a [`crate::gpu::pending::Pending`]'s); in the browser the
    /// event loop completes it while this awaits.
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

    pub(super) async fn read_raw(&self, buf: &wgpu::Buffer, out: &mut [u8]) -> Result<()> {
        let slice = buf.slice(..out.len() as u64);
        let (tx, rx) = futures_channel::oneshot::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        // natively a blocking call waits here; inside a `Pending` the app's next poll of the
        // device completes the map instead, so no frame waits for the GPU
        #[cfg(not(target_arch = "wasm32"))]
        if crate::gpu::pending::readbacks_wait() {
            self.gpu
                .device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| Error::Device(format!("waiting for the GPU: {e}")))?;
        }
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
    /// Each token's next token of the chunk, scored as a draw there would report it; with
    /// `top`, the alternatives too.
    Scored {
        top: bool,
    },
    /// Sampled ids and their logprobs, into window slot `slot`; with `top`, also the most
    /// likely alternatives (single steps only).
    Sampled {
        slot: usize,
        top: bool,
    },
}

/// Tokens of one adapter that `lora.wgsl` takes together, sharing each load of A.
const LORA_GROUP: usize = 4;

/// The chunk's real tokens on adapters (`info`: its rows, `width` token slots each), by slot, in
/// groups of up to [`LORA_GROUP`], and the order the wide products take the chunk's tokens in
/// (`lora.wgsl`'s `groups`): their count and the order's first vec4, then per group
/// `(slot, tokens, 0, 0)` and its tokens, then the order, four tokens a vec4. A token's sums do
/// not depend on its group or its place in the order.
///
/// The order puts each whole group in a block of the products' four tokens, then each partial
/// group, filled up with tokens on no adapter (padding included) while there are any, then the
/// rest: a block whose tokens share an adapter loads its B once for all four
/// (`matmul_lora.wgsl`'s `lora_tokens`), where a batch's rows need not come in adapter order.
fn lora_groups(info: &[RowInfoGpu], width: usize) -> Vec<[u32; 4]> {
    let mut by_slot: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
    let mut others = Vec::new();
    for (r, row) in info.iter().enumerate() {
        for j in 0..width as u32 {
            let n = (r * width) as u32 + j;
            match row.lora != NO_ADAPTER && j < row.n_new {
                true => by_slot.entry(row.lora).or_default().push(n),
                false => others.push(n),
            }
        }
    }
    let groups: Vec<(u32, &[u32])> =
        by_slot.iter().flat_map(|(&slot, tokens)| tokens.chunks(LORA_GROUP).map(move |g| (slot, g))).collect();
    let mut out = vec![[groups.len() as u32, (1 + 2 * groups.len()) as u32, 0, 0]];
    for &(slot, group) in &groups {
        let mut t = [0u32; 4];
        t[..group.len()].copy_from_slice(group);
        out.extend([[slot, group.len() as u32, 0, 0], t]);
    }
    let (whole, partial): (Vec<_>, Vec<_>) = groups.iter().map(|g| g.1).partition(|g| g.len() == LORA_GROUP);
    let mut order: Vec<u32> = whole.concat();
    let mut others = others.into_iter();
    for group in partial {
        order.extend(group);
        order.extend(others.by_ref().take(LORA_GROUP - group.len()));
    }
    order.extend(others);
    out.extend(order.chunks(4).map(|c| {
        let mut t = [0u32; 4];
        t[..c.len()].copy_from_slice(c);
        t
    }));
    out
}
