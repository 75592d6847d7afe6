//! Sleep and wake: give the GPU memory of the weights and/or the K/V cache back while a trainer
//! on the same GPU trains, keeping their contents (and every row's host state) on the host, and
//! bring them back exactly. As vLLM's sleep mode level 1 does for the weights.

use crate::engine::build::{build_dispatches, DispatchInputs};
use crate::engine::Engine;
use crate::error::{Error, Result};

/// What [`Engine::sleep`] releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sleep {
    /// The weights' buffers.
    pub weights: bool,
    /// The K/V cache's buffers (pools, rings, positions, lengths, token history).
    pub kv: bool,
}

impl Sleep {
    /// Both.
    pub const ALL: Sleep = Sleep { weights: true, kv: true };
}

/// A released buffer: what to make again, and what it held.
struct Saved {
    size: u64,
    usage: wgpu::BufferUsages,
    data: Vec<u8>,
}

/// What a sleeping engine keeps on the host.
pub(crate) struct Slept {
    what: Sleep,
    weights: Vec<Saved>,
    kv: Vec<Saved>,
}

/// Device memory as the engine and wgpu's allocator see it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes of GPU buffers this engine holds now (released ones not counted).
    pub engine_bytes: u64,
    /// Bytes every engine of the device holds ([`crate::Gpu::memory_in_use`]).
    pub device_bytes: u64,
    /// wgpu's allocator: bytes allocated and bytes reserved in memory blocks, where the backend
    /// reports them (Vulkan and DX12 do).
    pub allocator: Option<(u64, u64)>,
}

/// Bytes read back per copy: buffers are copied through a staging buffer of this size.
#[cfg(not(target_arch = "wasm32"))]
const STAGE: u64 = 64 << 20;

impl Engine {
    /// Whether the engine is asleep, and what it released.
    pub fn asleep(&self) -> Option<Sleep> {
        self.slept.as_ref().map(|s| s.what)
    }

    /// Device memory now: this engine's buffers, every engine's, and the allocator's report.
    pub fn memory_report(&self) -> MemoryReport {
        let allocator =
            self.gpu.device.generate_allocator_report().map(|r| (r.total_allocated_bytes, r.total_reserved_bytes));
        MemoryReport { engine_bytes: self.gpu_bytes, device_bytes: self.gpu.memory_in_use(), allocator }
    }

    /// Copy what `what` names to the host and release its GPU memory. Rows keep their host
    /// state (lengths, histories, owners, sampling state); every call that would use the GPU
    /// is an error until [`Engine::wake`]. Asleep already is an error.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn sleep(&mut self, what: Sleep) -> Result<()> {
        self.ready()?;
        let stage = self.gpu.buffer(
            "sleep staging",
            STAGE.min(self.gpu.max_binding()),
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )?;
        let stage_size = stage.size();
        let result = (|| {
            let mut buffers: Vec<(bool, wgpu::Buffer)> = Vec::new();
            if what.weights {
                buffers.extend(self.weights.buffers_mut().into_iter().map(|b| (true, b.clone())));
            }
            if what.kv {
                buffers.extend(self.cache.buffers_mut().into_iter().map(|b| (false, b.clone())));
            }
            // read everything first: a failed read releases nothing
            let mut slept = Slept { what, weights: Vec::new(), kv: Vec::new() };
            for (is_weight, b) in &buffers {
                let saved = Saved { size: b.size(), usage: b.usage(), data: self.read_back(b, &stage)? };
                if *is_weight { &mut slept.weights } else { &mut slept.kv }.push(saved);
            }
            let bytes: u64 = buffers.iter().map(|(_, b)| b.size()).sum();
            for (_, b) in &buffers {
                b.destroy();
            }
            self.gpu.release(bytes);
            self.gpu_bytes = self.gpu_bytes.saturating_sub(bytes);
            self.slept = Some(slept);
            if what.weights {
                // an adapter update's staging memory (host-visible) is made again when needed
                self.lora.staging = None;
            }
            Ok(())
        })();
        stage.destroy();
        self.gpu.release(stage_size);
        result
    }

    /// Bring back what [`Engine::sleep`] released, byte for byte, and rebuild the bind groups
    /// over the new buffers (pipelines come from the device's cache). Decoding then continues
    /// exactly where it stopped. When the device cannot hold it yet (the memory budget, or out of
    /// memory), the error says so and the engine stays asleep. Awake already: nothing to do.
    pub fn wake(&mut self) -> Result<()> {
        self.gpu.check()?;
        let Some(slept) = self.slept.take() else { return Ok(()) };
        let weight_bytes: u64 = slept.weights.iter().map(|s| s.size).sum();
        let kv_bytes: u64 = slept.kv.iter().map(|s| s.size).sum();
        if let Err(e) = self.gpu.check_budget(weight_bytes + kv_bytes, "waking the engine") {
            self.slept = Some(slept);
            return Err(e);
        }
        let make = |label: &str, s: &Saved| -> Result<wgpu::Buffer> {
            let b = self.gpu.buffer(label, s.size, s.usage)?;
            self.gpu.queue.write_buffer(&b, 0, &s.data);
            Ok(b)
        };
        let weights = slept.weights.iter().map(|s| make("weights (woken)", s)).collect::<Result<Vec<_>>>();
        let kv = slept.kv.iter().map(|s| make("K/V cache (woken)", s)).collect::<Result<Vec<_>>>();
        let (weights, kv) = match (weights, kv) {
            (Ok(w), Ok(k)) => (w, k),
            (w, k) => {
                for b in w.iter().flatten().chain(k.iter().flatten()) {
                    b.destroy();
                    self.gpu.release(b.size());
                }
                self.slept = Some(slept);
                return Err(Error::Device("waking the engine: could not create its buffers".into()));
            }
        };
        // the same buffers in the same order as `sleep` read them
        for (old, new) in self.weights.buffers_mut().into_iter().zip(weights) {
            *old = new;
        }
        for (old, new) in self.cache.buffers_mut().into_iter().zip(kv) {
            *old = new;
        }
        self.gpu_bytes += weight_bytes + kv_bytes;
        let d = build_dispatches(&DispatchInputs {
            gpu: &self.gpu,
            cfg: &self.cfg,
            max_len: self.cache.max_len(),
            matmul: self.matmul,
            fusion: self.fusion,
            attention: self.attention,
            cache: &self.cache,
            s: &self.s,
            rope: &self._rope,
            gw: &self.weights,
            sampling: &self.sampling,
            route_log: self.record_routes,
            split_sampling: self.split_sampling,
            all_logits_tokens: self.all_logits_tokens,
        })?;
        self.chunk_dispatches = d.chunk;
        self.head_dispatches = d.head;
        self.all_head_dispatches = d.all_head;
        self.sample_dispatches = d.sample;
        self.score_dispatches = d.score;
        self.bias_dispatch = d.bias;
        self.gpu.queue.submit([]);
        // natively, wait for the writes: their staging memory is freed once they are done
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.gpu.device.poll(wgpu::PollType::wait_indefinitely());
        self.gpu.check()
    }

    /// The contents of `b`, through `stage`.
    #[cfg(not(target_arch = "wasm32"))]
    fn read_back(&self, b: &wgpu::Buffer, stage: &wgpu::Buffer) -> Result<Vec<u8>> {
        let mut out = vec![0u8; b.size() as usize];
        let mut at = 0;
        while at < b.size() {
            let n = (b.size() - at).min(stage.size());
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(b, at, stage, 0, n);
            self.gpu.queue.submit([enc.finish()]);
            crate::gpu::pending::block_on(self.read_raw(stage, &mut out[at as usize..(at + n) as usize]))?;
            at += n;
        }
        Ok(out)
    }
}
