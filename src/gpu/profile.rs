//! Where a step's GPU time goes: timestamp queries around every dispatch, summed per kernel class
//! (matmul, attention, other), and the device's own copy bandwidth as the yardstick. For
//! benchmarks only: a profiled step waits for its timestamps, so its wall time is not the
//! engine's. Where the device has `TIMESTAMP_QUERY_INSIDE_PASSES` the step runs as always, in one
//! compute pass, with a timestamp after each dispatch (a dispatch's time then includes the wait
//! for what it depends on, as in a real step); elsewhere each dispatch gets a pass of its own,
//! timed at its start and end, which adds the passes' own cost and keeps nothing overlapping.
//! Native only (the browser cannot wait); the wasm build keeps the types so the engine's
//! recording code is the same.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::shaders::Kernel;

/// GPU time of one profiled step, per kernel class, in seconds.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// Matrix products (projections, MLP, LM head).
    pub matmul: f64,
    /// Attention against the cache.
    pub attention: f64,
    /// Everything else: embedding, norms, RoPE, K/V writes, activations, sampling, bookkeeping.
    pub other: f64,
    /// Dispatches timed.
    pub dispatches: usize,
    /// Per kernel (its WGSL file, `entry` for a second entry point): seconds and dispatches, in
    /// the order the kernels first ran.
    pub kernels: Vec<(&'static str, f64, usize)>,
    /// Per pipeline variant (its label, as `kv_write_ring_f16`; the names a GPU capture shows):
    /// seconds and dispatches, in the order the variants first ran.
    pub variants: Vec<(String, f64, usize)>,
    /// Timed inside the step's one compute pass (`TIMESTAMP_QUERY_INSIDE_PASSES`), as it runs;
    /// otherwise each dispatch ran in a pass of its own.
    pub in_one_pass: bool,
}

impl Profile {
    /// Sum of the classes.
    pub fn total(&self) -> f64 {
        self.matmul + self.attention + self.other
    }

    /// Add another step's times.
    pub fn add(&mut self, o: &Profile) {
        self.matmul += o.matmul;
        self.in_one_pass |= o.in_one_pass;
        self.attention += o.attention;
        self.other += o.other;
        self.dispatches += o.dispatches;
        for &(name, seconds, n) in &o.kernels {
            self.charge_kernel(name, seconds, n);
        }
        for (label, seconds, n) in &o.variants {
            self.charge_variant(label, *seconds, *n);
        }
    }

    fn charge_variant(&mut self, label: &str, seconds: f64, n: usize) {
        match self.variants.iter_mut().find(|k| k.0 == label) {
            Some(k) => {
                k.1 += seconds;
                k.2 += n;
            }
            None => self.variants.push((label.to_string(), seconds, n)),
        }
    }

    fn charge_kernel(&mut self, name: &'static str, seconds: f64, n: usize) {
        match self.kernels.iter_mut().find(|k| k.0 == name) {
            Some(k) => {
                k.1 += seconds;
                k.2 += n;
            }
            None => self.kernels.push((name, seconds, n)),
        }
    }

    fn charge(&mut self, kernel: Kernel, label: &str, seconds: f64) {
        match kernel {
            // quantizing an integer-dot product's input is part of that product
            Kernel::Matmul
            | Kernel::MatmulWide
            | Kernel::MatmulNormed
            | Kernel::MatmulSubgroup
            | Kernel::MatmulWideSubgroup
            | Kernel::MatmulTiled
            | Kernel::MatmulReduce
            | Kernel::MatmulInt
            | Kernel::MatmulExperts
            | Kernel::Lora
            | Kernel::Quantize => self.matmul += seconds,
            Kernel::Attention | Kernel::AttentionSplit | Kernel::AttentionSplitHead | Kernel::AttentionQueryTiles => {
                self.attention += seconds
            }
            // no catch-all: a new kernel must be given its class
            Kernel::Embed
            | Kernel::RmsNorm
            | Kernel::QkRope
            | Kernel::KvWrite
            | Kernel::MlpAct
            | Kernel::Commit
            | Kernel::Sample
            | Kernel::SampleChunks
            | Kernel::SampleRadix
            | Kernel::SampleKept
            | Kernel::SampleMerge
            | Kernel::LogitBias
            | Kernel::EngramGather
            | Kernel::EngramMix
            | Kernel::MoeRoute
            | Kernel::Copy => self.other += seconds,
        }
        self.dispatches += 1;
        self.charge_kernel(kernel.label(), seconds, 1);
        self.charge_variant(label, seconds, 1);
    }
}

/// Timestamp queries for up to `capacity` dispatches of one submit, created once.
pub(crate) struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    capacity: usize,
    /// Timestamps go inside one pass ([`Profiler::stamp`]): dispatch `i` runs from stamp `i` to
    /// stamp `i + 1`. Otherwise [`Profiler::writes`] brackets a pass per dispatch.
    pub(crate) in_one_pass: bool,
    /// The kernel and variant label of each dispatch timed by the last recorded submit, in order.
    pub(crate) recorded: Vec<(Kernel, Arc<str>)>,
}

/// Most queries one query set may hold (wgpu's `QUERY_SET_MAX_QUERIES`).
const MAX_QUERIES: usize = 4096;

impl Profiler {
    /// Queries for `capacity` dispatches; an error when the device has no timestamp queries.
    pub(crate) fn new(device: &wgpu::Device, capacity: usize) -> Result<Self> {
        if !device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Err(Error::Device("this adapter has no timestamp queries (TIMESTAMP_QUERY)".into()));
        }
        if 2 * capacity > MAX_QUERIES {
            return Err(Error::Limit(format!(
                "profiling {capacity} dispatches needs {} timestamp queries, at most {MAX_QUERIES} fit a query set",
                2 * capacity
            )));
        }
        let n = 2 * capacity as u32;
        let bytes = u64::from(n) * 8;
        Ok(Profiler {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: n,
            }),
            resolve: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile resolve"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            read: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile read"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            capacity,
            // KVDECODE_PROFILE_PASSES=each: the pass per dispatch anyway, to compare the two
            in_one_pass: device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES)
                && std::env::var("KVDECODE_PROFILE_PASSES").as_deref() != Ok("each"),
            recorded: Vec::new(),
        })
    }

    /// In one pass: stamp `i`, before dispatch `i` (and after dispatch `i - 1`); nothing past
    /// capacity.
    pub(crate) fn stamp(&self, pass: &mut wgpu::ComputePass<'_>, i: usize) {
        if i <= self.capacity {
            pass.write_timestamp(&self.queries, i as u32);
        }
    }

    /// Queries the last recorded submit wrote for `n` dispatches.
    fn queries_for(&self, n: usize) -> usize {
        if self.in_one_pass {
            n + 1
        } else {
            2 * n
        }
    }

    /// Timestamp writes around dispatch `i` of the submit being recorded (`None` past capacity).
    pub(crate) fn writes(&self, i: usize) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        (i < self.capacity).then(|| wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(2 * i as u32),
            end_of_pass_write_index: Some(2 * i as u32 + 1),
        })
    }

    /// Resolve the recorded dispatches' timestamps into the readback buffer.
    pub(crate) fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        let n = self.recorded.len().min(self.capacity);
        if n > 0 {
            let q = self.queries_for(n) as u32;
            enc.resolve_query_set(&self.queries, 0..q, &self.resolve, 0);
            enc.copy_buffer_to_buffer(&self.resolve, 0, &self.read, 0, u64::from(q) * 8);
        }
    }

    /// The profile of the last submit (blocks until it finished).
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn read(&self, gpu: &crate::gpu::device::Gpu) -> Result<Profile> {
        let n = self.recorded.len().min(self.capacity);
        let mut p = Profile { in_one_pass: self.in_one_pass, ..Profile::default() };
        if n == 0 {
            return Ok(p);
        }
        let slice = self.read.slice(..(self.queries_for(n) * 8) as u64);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        gpu.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Device(format!("waiting for the GPU: {e}")))?;
        rx.recv()
            .map_err(|_| Error::Device("profile readback never ran".into()))?
            .map_err(|e| Error::Device(format!("profile readback: {e}")))?;
        let ticks: Vec<u64> = {
            let view = slice.get_mapped_range().map_err(|e| Error::Device(format!("profile map: {e}")))?;
            bytemuck::cast_slice(&view).to_vec()
        };
        self.read.unmap();
        let period = f64::from(gpu.queue.get_timestamp_period()) * 1e-9;
        for (i, (k, label)) in self.recorded.iter().take(n).enumerate() {
            let (start, end) = if self.in_one_pass { (i, i + 1) } else { (2 * i, 2 * i + 1) };
            p.charge(*k, label, ticks[end].saturating_sub(ticks[start]) as f64 * period);
        }
        Ok(p)
    }
}
