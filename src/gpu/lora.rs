//! LoRA adapters on the GPU: room for `slots` adapters of rank up to `max_rank`, set at
//! `Engine::new`, as one buffer per block and input group (the targets that read one input: q, k
//! and v; o; gate and up; down) and one table of each slot's rank and scale per target. A slot's
//! `A` and `B` stay in f32 (or f16, `EngineOptions::lora_dtype`) beside the base weights, which
//! are never changed, so a quantized base stays quantized and exact. `lora.wgsl` (A) and the
//! products' epilogue (`matmul_lora.wgsl`, B) read this layout.

use crate::error::{Error, Result};
use crate::gpu::device::Gpu;
use crate::gpu::weights::WeightDtype;
use crate::model::config::ModelConfig;
use crate::model::lora::{adapts_mlp, LoraAdapter, LoraModule, LoraTarget, ModuleUpdate};
use crate::model::tensor::first_all_ones;

/// The slot index a row without an adapter carries in `RowInfo.lora`.
pub(crate) const NO_ADAPTER: u32 = u32::MAX;

/// The largest rank a slot can hold (the engine's `lora_ax` scratch keeps three targets' `A x` of
/// this rank for every token of a step).
pub const MAX_LORA_RANK: usize = 256;

/// Bytes a slot's value takes on the GPU.
fn value_bytes(dtype: WeightDtype) -> usize {
    match dtype {
        WeightDtype::F32 => 4,
        WeightDtype::F16 => 2,
    }
}

/// The targets that read one input, in [`LoraTarget::ALL`]'s order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoraGroup {
    /// q, k and v: the block's (normed) input.
    AttnIn,
    /// o: the attention's output.
    O,
    /// gate and up: the MLP's (normed) input.
    MlpIn,
    /// down: the MLP's activation.
    Down,
}

impl LoraGroup {
    pub(crate) const ALL: [LoraGroup; 4] = [LoraGroup::AttnIn, LoraGroup::O, LoraGroup::MlpIn, LoraGroup::Down];

    /// Its targets, in order.
    pub(crate) fn targets(self) -> &'static [LoraTarget] {
        match self {
            LoraGroup::AttnIn => &[LoraTarget::Q, LoraTarget::K, LoraTarget::V],
            LoraGroup::O => &[LoraTarget::O],
            LoraGroup::MlpIn => &[LoraTarget::Gate, LoraTarget::Up],
            LoraGroup::Down => &[LoraTarget::Down],
        }
    }

    /// The group of `target` and its index there.
    pub(crate) fn of(target: LoraTarget) -> (LoraGroup, usize) {
        LoraGroup::ALL
            .into_iter()
            .find_map(|g| g.targets().iter().position(|&t| t == target).map(|i| (g, i)))
            .expect("every target is in a group")
    }

    fn name(self) -> &'static str {
        match self {
            LoraGroup::AttnIn => "q/k/v",
            LoraGroup::O => "o",
            LoraGroup::MlpIn => "gate/up",
            LoraGroup::Down => "down",
        }
    }
}

/// One block's buffer for one group: per slot, `A [targets, max_rank, k]`, then each target's `B`
/// in room for `[its rows, max_rank]`, as PEFT stores it: `[its rows, rank]` at the module's own
/// rank (a module of a lower rank fills the first rows of each A and the start of each B, so both
/// go in with one write each, as they come).
pub(crate) struct GroupBuffer {
    pub(crate) buffer: wgpu::Buffer,
    /// Input features.
    pub(crate) k: usize,
    /// Output rows of each target.
    pub(crate) rows: Vec<usize>,
    /// Floats per slot.
    pub(crate) slot_floats: usize,
}

impl GroupBuffer {
    fn floats(k: usize, rows: &[usize], max_rank: usize) -> usize {
        max_rank * (rows.len() * k + rows.iter().sum::<usize>())
    }

    /// The first float of target `t`'s `A` in `slot`.
    fn a_at(&self, slot: usize, t: usize, max_rank: usize) -> usize {
        slot * self.slot_floats + t * max_rank * self.k
    }

    /// The first float of target `t`'s `B` in `slot`.
    fn b_at(&self, slot: usize, t: usize, max_rank: usize) -> usize {
        slot * self.slot_floats + (self.rows.len() * self.k + self.rows[..t].iter().sum::<usize>()) * max_rank
    }
}

/// Every slot's adapters on the GPU.
pub(crate) struct GpuLora {
    pub(crate) slots: usize,
    /// The largest rank a module may have.
    pub(crate) max_rank: usize,
    /// Rows of A (and B's room per output) each slot holds per target: `max_rank` rounded up to a
    /// multiple of 8, so every slot, A row and target's `A x` starts on a whole vec4 of values
    /// (of halves too).
    pub(crate) stride_rank: usize,
    /// `[layers, slots, 7]` of (rank, scale bits); rank 0: the slot leaves that target alone.
    pub(crate) meta: wgpu::Buffer,
    /// A and B as halves, two to a u32 (`EngineOptions::lora_dtype`), else f32.
    pub(crate) half: bool,
    /// Per block, per [`LoraGroup::ALL`]: `None` where the block has no such projections to adapt
    /// (a mixture of experts' MLP).
    pub(crate) layers: Vec<[Option<GroupBuffer>; 4]>,
}

/// `(k, rows of each target)` of `group` in block `layer`, if it can be adapted.
fn group_shape(cfg: &ModelConfig, layer: usize, group: LoraGroup) -> Option<(usize, Vec<usize>)> {
    if matches!(group, LoraGroup::MlpIn | LoraGroup::Down) && !adapts_mlp(cfg, layer) {
        return None;
    }
    let targets = group.targets();
    Some((targets[0].dims(cfg, layer).0, targets.iter().map(|t| t.dims(cfg, layer).1).collect()))
}

impl GpuLora {
    /// Bytes `slots` adapters of `max_rank` take on the GPU, their values of `dtype`.
    pub(crate) fn bytes_needed(cfg: &ModelConfig, slots: usize, max_rank: usize, dtype: WeightDtype) -> u64 {
        let floats: usize = (0..cfg.layers.len())
            .flat_map(|l| LoraGroup::ALL.map(|g| group_shape(cfg, l, g)))
            .flatten()
            .map(|(k, rows)| slots * GroupBuffer::floats(k, &rows, max_rank.next_multiple_of(8)))
            .sum();
        (floats * value_bytes(dtype) + cfg.layers.len() * slots * 14 * 4) as u64
    }

    pub(crate) fn new(gpu: &Gpu, cfg: &ModelConfig, slots: usize, max_rank: usize, dtype: WeightDtype) -> Result<Self> {
        if max_rank == 0 || max_rank > MAX_LORA_RANK {
            return Err(Error::Limit(format!("max_lora_rank {max_rank}: it must be 1 to {MAX_LORA_RANK}")));
        }
        let meta = gpu.storage("LoRA ranks and scales", (cfg.layers.len() * slots * 14 * 4) as u64)?;
        let stride_rank = max_rank.next_multiple_of(8);
        let layers = (0..cfg.layers.len())
            .map(|l| {
                let group = |g: LoraGroup| -> Result<Option<GroupBuffer>> {
                    let Some((k, rows)) = group_shape(cfg, l, g) else { return Ok(None) };
                    let slot_floats = GroupBuffer::floats(k, &rows, stride_rank);
                    let label = format!("LoRA block {l} {} ({slots} slots of rank {max_rank})", g.name());
                    let buffer = gpu.storage(&label, (slots * slot_floats * value_bytes(dtype)) as u64)?;
                    Ok(Some(GroupBuffer { buffer, k, rows, slot_floats }))
                };
                Ok([group(LoraGroup::AttnIn)?, group(LoraGroup::O)?, group(LoraGroup::MlpIn)?, group(LoraGroup::Down)?])
            })
            .collect::<Result<_>>()?;
        Ok(GpuLora { slots, max_rank, stride_rank, meta, half: dtype == WeightDtype::F16, layers })
    }

    /// Every module of `adapter` fits a slot and block `cfg` has its projection; every value is
    /// finite.
    pub(crate) fn check(&self, cfg: &ModelConfig, adapter: &LoraAdapter) -> Result<()> {
        if adapter.layers.len() != cfg.layers.len() {
            return Err(Error::Weights(format!(
                "the adapter has {} blocks, the model {}",
                adapter.layers.len(),
                cfg.layers.len()
            )));
        }
        for (l, modules) in adapter.layers.iter().enumerate() {
            for (&target, m) in LoraTarget::ALL.iter().zip(modules) {
                if let Some(m) = m {
                    self.check_module(cfg, l, target, m)?;
                    if let Some(v) = m.a.iter().chain(&m.b).chain([&m.scale]).find(|v| !v.is_finite()) {
                        return Err(Error::Weights(format!(
                            "adapter module {target:?} of block {l}: the value {v} is not finite"
                        )));
                    }
                    self.check_half_range(
                        &format!("adapter module {target:?} of block {l}"),
                        m.a.iter().chain(&m.b).copied(),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Where the slots hold halves, every one of `values` rounds to a finite half (at most
    /// 65504 in magnitude, else the GPU would sum an infinity): `what` names them in the error.
    pub(crate) fn check_half_range(&self, what: &str, mut values: impl Iterator<Item = f32>) -> Result<()> {
        if !self.half {
            return Ok(());
        }
        match values.find(|v| !half::f16::from_f32(*v).is_finite()) {
            Some(v) => Err(Error::Weights(format!(
                "{what}: the value {v} is beyond the largest half (65504), and this engine holds adapters \
                 in f16 (EngineOptions::lora_dtype)"
            ))),
            None => Ok(()),
        }
    }

    /// Module `m` of `target` in block `l` fits a slot and the block has its projection (its
    /// values are checked where they come from: [`GpuLora::check`], or the tensors of an update).
    pub(crate) fn check_module(&self, cfg: &ModelConfig, l: usize, target: LoraTarget, m: &LoraModule) -> Result<()> {
        let what = || format!("adapter module {target:?} of block {l}");
        if m.rank == 0 || m.rank > self.max_rank {
            return Err(Error::Limit(format!(
                "{}: rank {}; this engine's adapters have ranks 1 to {} (EngineOptions::max_lora_rank)",
                what(),
                m.rank,
                self.max_rank
            )));
        }
        if self.layers.get(l).is_none_or(|g| g[LoraGroup::of(target).0 as usize].is_none()) {
            return Err(Error::Weights(format!("{}: block {l} has no such projection to adapt", what())));
        }
        let (k, rows) = target.dims(cfg, l);
        if m.a.len() != m.rank * k || m.b.len() != rows * m.rank {
            return Err(Error::Weights(format!(
                "{}: A has {} values and B {}, for rank {} they need {} and {}",
                what(),
                m.a.len(),
                m.b.len(),
                m.rank,
                m.rank * k,
                rows * m.rank
            )));
        }
        Ok(())
    }

    /// Write `adapter` ([`GpuLora::check`]ed) into `slot`. Returns the bytes written.
    pub(crate) fn write(&self, gpu: &Gpu, slot: usize, adapter: &LoraAdapter) -> u64 {
        let mut bytes = 0;
        for (l, modules) in adapter.layers.iter().enumerate() {
            for (&target, m) in LoraTarget::ALL.iter().zip(modules) {
                if let Some(m) = m {
                    bytes += self.write_module(gpu, slot, l, target, m);
                }
            }
            bytes += self.write_meta(gpu, slot, l, modules);
        }
        bytes
    }

    /// Write module `m` ([`GpuLora::check_module`]ed) of `target` in block `l` into `slot`'s A
    /// and B (its rank and scale: [`GpuLora::write_meta`]). Returns the bytes written.
    pub(crate) fn write_module(&self, gpu: &Gpu, slot: usize, l: usize, target: LoraTarget, m: &LoraModule) -> u64 {
        let r = self.stride_rank;
        let (g, i) = LoraGroup::of(target);
        let Some(buf) = &self.layers[l][g as usize] else { return 0 };
        let mut bytes = 0;
        for (values, at) in [(&m.a, buf.a_at(slot, i, r)), (&m.b, buf.b_at(slot, i, r))] {
            bytes += self.write_values(gpu, &buf.buffer, at, bytemuck::cast_slice(values));
        }
        bytes
    }

    /// Write little-endian f32 `values` from float `at` of `buffer` on, as the slots hold them
    /// (f32 as they come, or rounded to halves). Returns the bytes written.
    fn write_values(&self, gpu: &Gpu, buffer: &wgpu::Buffer, at: usize, values: &[u8]) -> u64 {
        if !self.half {
            gpu.queue.write_buffer(buffer, at as u64 * 4, values);
            return values.len() as u64;
        }
        // every A and B starts on an even float and holds an even count (a multiple of 4 input
        // widths or output rows, times the rank), so the halves fill whole u32s
        let halves: Vec<u8> = values
            .chunks_exact(4)
            .flat_map(|v| half::f16::from_f32(f32::from_le_bytes([v[0], v[1], v[2], v[3]])).to_le_bytes())
            .collect();
        gpu.queue.write_buffer(buffer, at as u64 * 2, &halves);
        halves.len() as u64
    }

    /// Bytes one slot takes in every block: the most an update writes.
    pub(crate) fn slot_bytes(&self) -> u64 {
        let floats: usize = self.layers.iter().flatten().flatten().map(|g| g.slot_floats).sum();
        (floats * if self.half { 2 } else { 4 }) as u64
    }

    /// Stage an update's new halves for `slot` (`plan`: little-endian f32 values whose names and
    /// shapes [`crate::model::lora::plan_modules`] checked against the modules' ranks) in
    /// `belt`'s mapped memory, as the slots hold them, each value checked as it is copied:
    /// finite, and within a half's range where the slots hold halves. Returns the commands that
    /// copy them into place and the bytes they write, or `None` where a value failed: then no
    /// command exists and the slots are as they were. An error: the staging memory could not be
    /// mapped.
    ///
    /// Why stage: an update is checked whole before anything is written, and `queue.write_buffer`
    /// cannot be taken back once called, so the values were read twice (the check, then the
    /// copy); staged, they are read once, and the copies run only if every value passed.
    pub(crate) fn stage_update(
        &self,
        device: &wgpu::Device,
        belt: &mut wgpu::util::StagingBelt,
        slot: usize,
        plan: &[ModuleUpdate],
    ) -> Result<Option<(wgpu::CommandBuffer, u64)>> {
        let r = self.stride_rank;
        let out_bytes = |src: &[u8]| if self.half { src.len() / 2 } else { src.len() };
        // (values, their buffer, the byte they start at there)
        let mut writes: Vec<(&[u8], &wgpu::Buffer, u64)> = Vec::new();
        for u in plan {
            let (g, i) = LoraGroup::of(u.target);
            let Some(buf) = &self.layers[u.layer][g as usize] else { continue };
            for (values, at) in [(&u.a, buf.a_at(slot, i, r)), (&u.b, buf.b_at(slot, i, r))] {
                if let Some(v) = values {
                    writes.push((v.bytes(), &buf.buffer, (at * if self.half { 2 } else { 4 }) as u64));
                }
            }
        }
        let total: usize = writes.iter().map(|w| out_bytes(w.0)).sum();
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("LoRA update") });
        // every A and B holds a multiple of 4 inputs or outputs times the rank, so every size and
        // place is a whole number of u32s, as copies need
        let Some(size) = wgpu::BufferSize::new(total as u64) else { return Ok(Some((encoder.finish(), 0))) };
        let stage = belt.allocate(size, wgpu::BufferSize::new(4).expect("4 is not 0"));
        let (stage_buffer, stage_at) = (stage.buffer().clone(), stage.offset());
        let mut view = stage
            .get_mapped_range_mut()
            .map_err(|e| Error::Device(format!("a LoRA update's staging memory could not be mapped: {e}")))?;
        // mapped memory may be write-combined: written, never read (wgpu's WriteOnly)
        let mut parts: Vec<(&[u8], wgpu::WriteOnly<[u8]>)> = Vec::with_capacity(writes.len());
        let mut rest = view.slice(..);
        for (src, _, _) in &writes {
            let (part, tail) = rest.split_at(out_bytes(src));
            parts.push((src, part));
            rest = tail;
        }
        // one thread: wgpu's WriteOnly of a slice cannot be sent to another (`kvdecode bench
        // --tables lora` puts the whole update at about the write_buffer floor's time anyway)
        let ok = parts.into_iter().all(|(src, dst)| copy_checked(src, dst, self.half));
        drop(view);
        if !ok {
            belt.finish();
            belt.recall();
            return Ok(None);
        }
        let mut from = stage_at;
        for (src, buffer, at) in &writes {
            let n = out_bytes(src) as u64;
            encoder.copy_buffer_to_buffer(&stage_buffer, from, buffer, *at, n);
            from += n;
        }
        belt.finish();
        Ok(Some((encoder.finish(), total as u64)))
    }

    /// Write the rank and scale of `slot`'s `modules` of block `l`. Returns the bytes written.
    pub(crate) fn write_meta(&self, gpu: &Gpu, slot: usize, l: usize, modules: &[Option<LoraModule>; 7]) -> u64 {
        let mut meta = [0u32; 14];
        for (t, m) in modules.iter().enumerate() {
            if let Some(m) = m {
                meta[2 * t] = m.rank as u32;
                meta[2 * t + 1] = m.scale.to_bits();
            }
        }
        gpu.queue.write_buffer(&self.meta, ((l * self.slots + slot) * 14 * 4) as u64, bytemuck::cast_slice(&meta));
        56
    }

    /// Leave `slot` empty: every target's rank 0.
    pub(crate) fn clear(&self, gpu: &Gpu, slot: usize, layers: usize) {
        for l in 0..layers {
            gpu.queue.write_buffer(&self.meta, ((l * self.slots + slot) * 14 * 4) as u64, &[0u8; 56]);
        }
    }

    /// Its buffers, for sleep and wake.
    pub(crate) fn buffers_mut(&mut self) -> Vec<&mut wgpu::Buffer> {
        let mut out = vec![&mut self.meta];
        out.extend(self.layers.iter_mut().flatten().flatten().map(|g| &mut g.buffer));
        out
    }
}

/// Copy little-endian f32 `src` into `dst` as the slots hold values (f32 as they are, or halves),
/// checking each on the way: false, and the copy left unfinished, at the first block with a value
/// that is not finite or (as a half) beyond the largest half. A block is checked with no branch
/// per value (a fold the compiler vectorizes) while it is in the cache for its copy.
fn copy_checked(src: &[u8], mut dst: wgpu::WriteOnly<[u8]>, half: bool) -> bool {
    const BLOCK: usize = 4096;
    if half {
        let mut halves = [0u8; BLOCK / 2];
        for (i, s) in src.chunks(BLOCK).enumerate() {
            let mut bad = false;
            for (v, h) in s.chunks_exact(4).zip(halves.chunks_exact_mut(2)) {
                let x = half::f16::from_f32(f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
                bad |= !x.is_finite();
                h.copy_from_slice(&x.to_le_bytes());
            }
            if bad {
                return false;
            }
            let at = i * BLOCK / 2;
            dst.slice(at..at + s.len() / 2).copy_from_slice(&halves[..s.len() / 2]);
        }
        return true;
    }
    for (i, s) in src.chunks(BLOCK).enumerate() {
        // an exponent of all ones is an infinity or a NaN (HostTensor::check_values' test)
        if first_all_ones(s, 0x7f80_0000, 4).is_some() {
            return false;
        }
        dst.slice(i * BLOCK..i * BLOCK + s.len()).copy_from_slice(s);
    }
    true
}
