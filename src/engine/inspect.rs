//! Looking inside a running engine, for benchmarks and tests: a profiled step, the device's copy
//! bandwidth, and a group's global K/V as the rows see it.
#![cfg(not(target_arch = "wasm32"))]

use crate::engine::sampling::Sampler;
use crate::engine::step::Output;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gpu::kernels;
use crate::gpu::shaders::Kernel;

impl Engine {
    /// One append (at most [`Engine::chunk_width`] tokens per row, so one submit), with every
    /// dispatch timed by timestamp queries: GPU time per kernel class. The append itself is real
    /// (the rows advance); with `samplers` the step also samples, as a decode step does. For
    /// benchmarks: the call waits for the timestamps. Where the device has
    /// `TIMESTAMP_QUERY_INSIDE_PASSES` the dispatches run in one pass as in any step, a timestamp
    /// after each ([`crate::Profile::in_one_pass`]); elsewhere each runs in a pass of its own.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn profile_step(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        samplers: Option<&[Sampler]>,
    ) -> Result<crate::gpu::profile::Profile> {
        if width > self.chunk {
            return Err(Error::Input(format!(
                "profile_step: width {width} is more than one chunk ({} tokens per row)",
                self.chunk
            )));
        }
        if self.profiler.is_none() {
            // then the logit bias and sampling's dispatches, both paths: the whole kernel, the
            // split path's chunks, radix passes, kept draw and merge
            let sampling = 1 + 1 + 3 + crate::gpu::kernels::RADIX_PASSES;
            let most =
                self.chunk_dispatches.len() + self.all_head_dispatches.len().max(self.head_dispatches.len()) + sampling;
            self.profiler = Some(crate::gpu::profile::Profiler::new(&self.gpu.device, most)?);
        }
        self.profiling = true;
        let ran = crate::gpu::pending::now(self.run(ids, width, n_new, rows, samplers, Output::None));
        self.profiling = false;
        if !ran? {
            return Ok(Default::default());
        }
        let p = self.profiler.as_ref().expect("made above");
        let got = p.read(&self.gpu);
        self.ready()?;
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
        let mut p = crate::gpu::profile::Profiler::new(&self.gpu.device, 1)?;
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
        let copy = kernels::Copy { n4 };
        let pipeline = self.gpu.pipelines.get(&copy);
        let bind = self.gpu.pipelines.bind(Kernel::Copy, "copy", &[&src, &dst]);
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
            p.recorded = vec![(Kernel::Copy, "copy".into())];
            p.resolve(&mut enc);
            self.gpu.queue.submit([enc.finish()]);
            best = best.min(p.read(&self.gpu)?.total());
        }
        self.ready()?;
        Ok(2.0 * bytes as f64 / best)
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
        crate::gpu::pending::block_on(self.read_async(&staging, &mut out))?;
        Ok(out)
    }
}
