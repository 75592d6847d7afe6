//! LoRA adapters in the engine: up to `max_loras` resident at once, loaded, updated by a trainer
//! and unloaded by name while the engine decodes; each row decodes with one adapter or none
//! (Punica's per-row adapter index: one step mixes them). Each adapted projection's
//! `scale * B (A x)` joins the base product's output unmerged, so the base weights never change
//! and a row without an adapter gives the base model's bits.
//!
//! The dispatches: `lora.wgsl` once per block and input (q/k/v; o; gate/up; down), before the
//! products that read that input, computes each token's `A x` of the input's targets; the
//! products add `scale * B (A x)` as their epilogue (`matmul_lora.wgsl`), before the MLP's
//! activation and after the residual add, so the norms and the activation stay fused. None of it
//! when `max_loras` is 0.

use std::hash::{Hash, Hasher};
use std::path::Path;

use crate::engine::builder::{Builder, LoraIo};
use crate::engine::dispatch::{Dispatch, Grid};
use crate::engine::update::InFlight;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gpu::kernels;
use crate::gpu::lora::{LoraGroup, NO_ADAPTER};
use crate::model::lora::{
    base_names, plan_modules, plan_update, BaseNames, LoraAdapter, LoraRanks, LoraTarget, ModuleUpdate,
};
use crate::model::tensor::HostTensor;

/// What [`Engine::update_lora`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoraUpdate {
    /// The adapter's version now: 0 when loaded, plus one per update.
    pub version: u64,
    /// Projections (block, target) whose `A` or `B` changed.
    pub modules: usize,
    /// Bytes written to the GPU.
    pub bytes: u64,
    /// Rows of that adapter recomputed or reset.
    pub rows: Vec<usize>,
}

/// An adapter in a slot. Its values live on the GPU only: an update writes the pushed bytes there
/// and nowhere else (a host copy would cost a second pass over them, and the memory of every
/// resident adapter).
struct Resident {
    name: String,
    ranks: LoraRanks,
    version: u64,
    /// Unique among every adapter this engine ever loaded: a name loaded again is another one.
    uid: u64,
}

/// Which adapters are resident, and which one each row decodes with.
pub(crate) struct LoraState {
    slots: Vec<Option<Resident>>,
    /// Per cache row: its adapter's slot.
    rows: Vec<Option<usize>>,
    next_uid: u64,
    /// The base weights' names an update's tensors are matched to, made at the first load.
    base_names: Option<BaseNames>,
    /// Mapped host memory an update's values are checked into before they are copied to their
    /// slot (`GpuLora::stage_update`): one slot's bytes, made at the first update and kept
    /// (a new buffer each time would be zeroed and faulted in each time); dropped by a sleep.
    pub(crate) staging: Option<wgpu::util::StagingBelt>,
    /// The last update's copies: the next update waits for them, so the staging memory they
    /// read is free again and one slot's worth of it is all there ever is.
    last_update: Option<wgpu::SubmissionIndex>,
}

impl LoraState {
    pub(crate) fn new(slots: usize, rows: usize) -> Self {
        LoraState {
            slots: (0..slots).map(|_| None).collect(),
            rows: vec![None; rows],
            next_uid: 1,
            base_names: None,
            staging: None,
            last_update: None,
        }
    }

    /// `RowInfo.lora` of cache row `row`.
    pub(crate) fn row_slot(&self, row: usize) -> u32 {
        self.rows[row].map_or(NO_ADAPTER, |s| s as u32)
    }

    fn slot_of(&self, name: &str) -> Result<usize> {
        self.slots.iter().position(|s| s.as_ref().is_some_and(|r| r.name == name)).ok_or_else(|| {
            let names: Vec<&str> = self.slots.iter().flatten().map(|r| r.name.as_str()).collect();
            Error::Input(format!("no LoRA adapter named {name:?} is loaded (loaded: {names:?})"))
        })
    }

    /// The prompt cache's root for rows of `slot` at its current version.
    fn salt(&self, slot: usize) -> u64 {
        let r = self.slots[slot].as_ref().expect("a loaded slot");
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (r.uid, r.version).hash(&mut h);
        h.finish().max(1)
    }

    /// The rows of `slot`.
    fn rows_of(&self, slot: usize) -> Vec<usize> {
        (0..self.rows.len()).filter(|&r| self.rows[r] == Some(slot)).collect()
    }

    /// `rows` back on the base model.
    pub(crate) fn clear_rows(&mut self, rows: &[usize]) {
        for &r in rows {
            self.rows[r] = None;
        }
    }

    /// `dst` take `src`'s adapter (a fork).
    pub(crate) fn copy_row(&mut self, src: usize, dst: &[usize]) {
        for &d in dst {
            self.rows[d] = self.rows[src];
        }
    }
}

impl Engine {
    /// Adapters this engine can hold at once ([`crate::EngineOptions::max_loras`]).
    pub fn max_loras(&self) -> usize {
        self.lora.slots.len()
    }

    /// The resident adapters' names and versions, in slot order.
    pub fn loras(&self) -> Vec<(String, u64)> {
        self.lora.slots.iter().flatten().map(|r| (r.name.clone(), r.version)).collect()
    }

    /// The version of the resident adapter named `name` (0 when loaded, plus one per update), if
    /// one is loaded.
    pub fn lora_version(&self, name: &str) -> Option<u64> {
        self.lora.slots.iter().flatten().find(|r| r.name == name).map(|r| r.version)
    }

    /// Make `adapter` resident under `name` in a free slot. An engine built without adapter slots,
    /// a name already loaded, all slots taken, a module of a rank above
    /// [`crate::EngineOptions::max_lora_rank`], a shape that is not the model's or a value that
    /// is not finite is an error, and nothing changes.
    pub fn load_lora(&mut self, name: &str, adapter: &LoraAdapter) -> Result<()> {
        self.ready()?;
        let Some(gpu_lora) = self.weights.lora.as_ref() else {
            return Err(Error::Limit(format!(
                "adapter {name:?}: this engine holds no LoRA adapters (build it with EngineOptions::max_loras > 0)"
            )));
        };
        if name.is_empty() || self.lora.slot_of(name).is_ok() {
            return Err(Error::Input(format!("adapter name {name:?} is empty or already loaded")));
        }
        let slot = self.lora.slots.iter().position(Option::is_none).ok_or_else(|| {
            Error::Limit(format!(
                "adapter {name:?}: all {} LoRA slots are taken (EngineOptions::max_loras); unload one first",
                self.lora.slots.len()
            ))
        })?;
        gpu_lora.check(&self.cfg, adapter).map_err(|e| Error::Weights(format!("adapter {name:?}: {e}")))?;
        gpu_lora.write(&self.gpu, slot, adapter);
        self.gpu.queue.submit([]);
        let uid = self.lora.next_uid;
        self.lora.next_uid += 1;
        self.lora.slots[slot] = Some(Resident { name: name.into(), ranks: adapter.ranks(), version: 0, uid });
        if self.lora.base_names.is_none() {
            self.lora.base_names = Some(base_names(&self.cfg));
        }
        Ok(())
    }

    /// [`Engine::load_lora`] of a PEFT adapter folder (`adapter_config.json` and
    /// `adapter_model.safetensors`) or a GGUF LoRA file (llama.cpp's `convert_lora_to_gguf.py`):
    /// [`crate::io::model_file::open_lora`].
    pub fn load_lora_path(&mut self, name: &str, path: impl AsRef<Path>) -> Result<()> {
        let adapter = crate::io::model_file::open_lora(path, &self.cfg)?;
        self.load_lora(name, &adapter)
    }

    /// Free the slot of adapter `name`. Rows that decode with it are an error naming them (reset
    /// them first), and nothing changes.
    pub fn unload_lora(&mut self, name: &str) -> Result<()> {
        let slot = self.lora.slot_of(name)?;
        let rows = self.lora.rows_of(slot);
        if !rows.is_empty() {
            return Err(Error::Input(format!("adapter {name:?} is in use by rows {rows:?}; reset them first")));
        }
        if let Some(g) = &self.weights.lora {
            g.clear(&self.gpu, slot, self.cfg.layers.len());
        }
        self.lora.slots[slot] = None;
        Ok(())
    }

    /// Replace some of adapter `name`'s `A` and `B` in place (PEFT's names, as
    /// [`LoraAdapter::updated`] reads them; each module keeps its rank and scale), as a trainer
    /// pushes only its adapter after a step. Everything is checked before anything is written:
    /// a module the adapter does not have, a shape for another rank, a name given twice or a value
    /// that is not finite is an error, and nothing changes. Then the adapter's version rises, and
    /// its rows holding tokens are kept (and never register prompt-cache blocks again), recomputed
    /// or reset as `in_flight` says. Rows of other adapters and of the base model are left
    /// alone, and the prompt cache keeps their prefixes: a row's cached prefix is keyed by its
    /// adapter and version.
    pub fn update_lora(&mut self, name: &str, tensors: &[HostTensor], in_flight: InFlight) -> Result<LoraUpdate> {
        self.ready()?;
        let slot = self.lora.slot_of(name)?;
        let resident = self.lora.slots[slot].as_ref().expect("found above");
        let names = self.lora.base_names.as_ref().expect("made when an adapter was loaded");
        // names and shapes first; the values are checked as they are staged, and found again
        // in tensor order, as plan_update names them, only if one failed
        let plan = plan_modules(&resident.ranks, names, tensors, &self.cfg)?;
        let g = self.weights.lora.as_ref().expect("a loaded adapter has slots");
        // (in a browser polling does nothing: the page's event loop returns the memory)
        if let Some(last) = self.lora.last_update.take() {
            let wait = wgpu::PollType::Wait { submission_index: Some(last), timeout: None };
            self.gpu.device.poll(wait).map_err(|e| Error::Device(format!("waiting for the last LoRA update: {e}")))?;
        }
        let belt = self
            .lora
            .staging
            .get_or_insert_with(|| wgpu::util::StagingBelt::new(self.gpu.device.clone(), g.slot_bytes()));
        let Some((copies, bytes)) = g.stage_update(&self.gpu.device, belt, slot, &plan)? else {
            return Err(bad_value(&resident.ranks, names, tensors, &self.cfg, g, &plan));
        };
        self.lora.last_update = Some(self.gpu.queue.submit([copies]));
        belt.recall();
        let modules = plan.len();
        let resident = self.lora.slots[slot].as_mut().expect("found above");
        resident.version += 1;
        let version = resident.version;
        let held: Vec<usize> = self.lora.rows_of(slot).into_iter().filter(|&r| self.cache.position(r) > 0).collect();
        match in_flight {
            InFlight::Keep => self.cache.blocks.mark_stale(&held),
            InFlight::Reset => self.reset(&held)?,
            InFlight::Recompute => {
                let salt = self.lora.salt(slot);
                for &r in &held {
                    self.cache.blocks.set_salt(r, salt);
                }
                self.recompute(&held)?;
            }
        }
        // rows of the adapter that hold nothing yet start on the new version
        let salt = self.lora.salt(slot);
        for r in self.lora.rows_of(slot) {
            if self.cache.position(r) == 0 {
                self.cache.blocks.set_salt(r, salt);
            }
        }
        Ok(LoraUpdate { version, modules, bytes, rows: if in_flight == InFlight::Keep { Vec::new() } else { held } })
    }

    /// Make `row` decode with adapter `name`, or the base model (`None`). The row must hold no
    /// tokens (its K/V would be another model's), unless the adapter stays the same; a reset puts
    /// a row back on the base model, and a fork's rows take their source's adapter.
    pub fn set_adapter(&mut self, row: usize, name: Option<&str>) -> Result<()> {
        let slot = self.check_adapter(row, name)?;
        if slot != self.lora.rows[row] {
            self.put_adapter(row, slot);
        }
        Ok(())
    }

    /// The slot [`Engine::set_adapter`] would give `row`, or its error; nothing changes.
    pub(super) fn check_adapter(&self, row: usize, name: Option<&str>) -> Result<Option<usize>> {
        self.cache.check_rows(&[row])?;
        let slot = name.map(|n| self.lora.slot_of(n)).transpose()?;
        if slot != self.lora.rows[row] && self.cache.position(row) > 0 {
            return Err(Error::Input(format!(
                "row {row} holds tokens computed with another adapter; reset it before changing its adapter"
            )));
        }
        Ok(slot)
    }

    /// `row`'s adapter slot (`None`: the base model).
    pub(super) fn adapter_slot(&self, row: usize) -> Option<usize> {
        self.lora.rows[row]
    }

    /// Give `row` adapter slot `slot`, and its prompt-cache root with it.
    pub(super) fn put_adapter(&mut self, row: usize, slot: Option<usize>) {
        self.lora.rows[row] = slot;
        self.cache.blocks.set_salt(row, slot.map_or(0, |s| self.lora.salt(s)));
    }

    /// The adapter `row` decodes with and its version now, or `None` (the base model).
    pub fn adapter(&self, row: usize) -> Option<(&str, u64)> {
        let r = self.lora.slots[(*self.lora.rows.get(row)?)?].as_ref()?;
        Some((&r.name, r.version))
    }
}

impl Builder<'_> {
    /// The adapters' first half for `group` in block `layer`: each token's `A x` of the group's
    /// first `targets` targets, from `x` (rows of `x_stride`; `norm`: x is the residual stream,
    /// read normed with this weight, as the products read it), into `lora_ax`. `None` when the
    /// engine holds no adapters or the block has no such projections.
    pub(super) fn lora(
        &self,
        layer: usize,
        group: LoraGroup,
        targets: usize,
        x: &wgpu::Buffer,
        x_stride: usize,
        norm: Option<Option<&wgpu::Buffer>>,
    ) -> Option<Dispatch> {
        let g = self.gw.lora.as_ref()?;
        let buf = g.layers[layer][group as usize].as_ref()?;
        let spec = kernels::Lora {
            k: buf.k,
            x_stride,
            targets: targets.min(buf.rows.len()),
            max_rank: g.stride_rank,
            slot_floats: buf.slot_floats,
            meta0: layer * g.slots * LoraTarget::ALL.len() + group.targets()[0] as usize,
            norm: norm.map(|w| kernels::FusedNorm { weight: w.is_some(), eps: self.cfg.norm_eps }),
            half: g.half,
            // the GPU shapes' products (subgroup, workgroup) say a GPU: there a row of A walked
            // by one lane would be the step's longest chain of loads; a CPU adapter's lanes run
            // one after another, and take whole rows
            slices: if self.subgroup.is_some() || self.workgroup_reduce { kernels::LORA_SLICES_GPU } else { 1 },
        };
        // a CPU adapter runs a dispatch's workgroups on its threads (lavapipe: one per core): a
        // step with fewer groups than threads spreads each group's rows of A over more
        // workgroups, so one row's `A x` does not run on one core alone (GPUs fill x themselves;
        // in a browser the count is unknown: 1)
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spread = if spec.slices == 1 { threads } else { 1 };
        let s = self.s;
        let norm_w = norm.flatten().unwrap_or(&s.dummy);
        Some(self.dispatch(
            &spec,
            &[&s.step, &s.row_info, x, &s.lora_ax, &buf.buffer, &g.meta, norm_w, &s.lora_groups],
            Grid::LoraGroups { tiles: spec.row_chunks(), spread },
        ))
    }

    /// The adapters' second half for the products of `group` in block `layer` whose matrix
    /// starts at the group's target `first`: `B (A x)` as their epilogue.
    pub(super) fn lora_io(&self, layer: usize, group: LoraGroup, first: usize) -> Option<LoraIo<'_>> {
        let buf = self.gw.lora.as_ref()?.layers[layer][group as usize].as_ref()?;
        Some(LoraIo { group: buf, row0: buf.rows[..first].iter().sum() })
    }

    /// The epilogue's constants for a part of a matrix starting at its row `row_start` (a gated
    /// product's one part starts at 0: its up rows follow its gate rows, as the group's do).
    pub(super) fn lora_epilogue(&self, l: LoraIo, row_start: usize) -> kernels::LoraEpilogue {
        let g = self.gw.lora.as_ref().expect("an epilogue comes from the engine's adapters");
        let rows = &l.group.rows;
        let (row0, t1, t2) =
            (l.row0 + row_start, rows.get(1).map_or(0, |_| rows[0]), rows.get(2).map_or(0, |_| rows[0] + rows[1]));
        // the wide products' epilogue adds four rows at a time within one target
        // (matmul_lora.wgsl's store_outs4); head_dim and every width are multiples of 4 (config.rs)
        assert!(
            row0 % 4 == 0 && t1 % 4 == 0 && t2 % 4 == 0,
            "LoRA targets start on multiples of 4 ({row0}, {t1}, {t2})"
        );
        kernels::LoraEpilogue {
            row0,
            t1,
            t2,
            max_rank: g.stride_rank,
            slot_floats: l.group.slot_floats,
            b0: rows.len() * l.group.k * g.stride_rank,
            half: g.half,
        }
    }
}

/// The error of an update whose staging found a bad value: the first such value in tensor order
/// as [`plan_update`] names it, else the first module with a value beyond a half's range.
fn bad_value(
    ranks: &LoraRanks,
    names: &BaseNames,
    tensors: &[HostTensor],
    cfg: &crate::model::config::ModelConfig,
    g: &crate::gpu::lora::GpuLora,
    plan: &[ModuleUpdate],
) -> Error {
    if let Err(e) = plan_update(ranks, names, tensors, cfg) {
        return e;
    }
    for u in plan {
        for values in u.a.iter().chain(&u.b) {
            let what = format!("update: adapter module {:?} of block {}", u.target, u.layer);
            let floats = values.bytes().chunks_exact(4).map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
            if let Err(e) = g.check_half_range(&what, floats) {
                return e;
            }
        }
    }
    Error::Weights("update: a value failed its check while staged, and none does when checked again".into())
}
