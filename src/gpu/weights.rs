//! Model weights on the GPU: matrices split into row parts that each fit one storage binding,
//! f32 or f16 (packed two per u32), and norm weights with Gemma's `1 + w` folded in.

use crate::error::{Error, Result};
use crate::gpu::device::Gpu;
use crate::gpu::kernels::WeightFormat;
use crate::io::model_file::FileWeights;
use crate::model::config::{ModelConfig, NormKind};
use crate::model::family::{tensor_names, LayerSlot, Naming, Place, RowOrder, Slot, SlotPlan, Stored, WeightPlan};
use crate::model::quant::{quantize, repack_for_gpu, QuantKind};
use crate::model::reference::norm_multiplier;
use crate::model::tensor::{HostDtype, HostTensor};
use crate::model::weights::{Half, Matrix, ModelWeights};

/// Element type of matrices on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    /// 32-bit floats.
    F32,
    /// IEEE halves packed two per u32 (unpacked in the shader, no `shader-f16` needed).
    F16,
}

/// One row-range of a matrix in its own buffer.
pub(crate) struct MatrixPart {
    pub buffer: wgpu::Buffer,
    /// The bias of these rows, f32 (the product adds it), when the matrix has one.
    pub bias: Option<wgpu::Buffer>,
    pub row_start: usize,
    pub rows: usize,
}

/// A matrix `[rows, cols]` on the GPU.
pub(crate) struct GpuMatrix {
    pub cols: usize,
    /// How the rows are stored (the shaders' `W_FORMAT`).
    pub format: WeightFormat,
    pub parts: Vec<MatrixPart>,
}

/// How a matrix is stored on the GPU: its quantized blocks when the rows are whole blocks, else
/// 16-bit when it is 16-bit on disk or `dtype` asks, else f32; and the bytes of one row so.
struct Layout {
    format: WeightFormat,
    row_bytes: u64,
}

fn layout(m: &SlotPlan, dtype: WeightDtype) -> Layout {
    let cols = m.cols.unwrap_or(1);
    let quant = match m.stored {
        Stored::Quant(k) if cols.is_multiple_of(k.block_len()) => Some(k),
        _ => None,
    };
    // 16-bit on disk stays 16-bit on the GPU (bf16 as bf16); f32 follows `dtype`
    let half = match (m.stored, dtype) {
        (Stored::Half(h), _) => Some(h),
        (_, WeightDtype::F16) => Some(Half::F16),
        (_, WeightDtype::F32) => None,
    };
    let (format, row_bytes) = match (quant, half) {
        (Some(q), _) => (WeightFormat::from(q), (cols / q.block_len() * q.gpu_block_words() * 4) as u64),
        (None, None) => (WeightFormat::F32, (cols * 4) as u64),
        (None, Some(Half::F16)) => (WeightFormat::F16, (cols * 2) as u64),
        (None, Some(Half::BF16)) => (WeightFormat::BF16, (cols * 2) as u64),
    };
    Layout { format, row_bytes }
}

/// The weight type a slot's matrix takes on the GPU: the router and the shared expert's gate
/// stay f32 whatever the engine's (the routing decides which experts run; it is kept as exact
/// as the file has it), and so do Engram's tables (f32 values the gather reads).
fn slot_dtype(slot: Slot, dtype: WeightDtype) -> WeightDtype {
    match slot {
        Slot::Layer(_, LayerSlot::Router | LayerSlot::SharedGate | LayerSlot::EngramTable(_)) => WeightDtype::F32,
        _ => dtype,
    }
}

/// Bytes `plan`'s matrices, norms and tables take on the GPU as `dtype` (before anything is
/// allocated, so an engine the device cannot hold is refused up front).
pub(crate) fn bytes_needed(plan: &WeightPlan, dtype: WeightDtype) -> u64 {
    let cfg = &plan.cfg;
    let mut total = cfg.vocab as u64 * 4;
    for (&slot, m) in &plan.slots {
        total += match m.cols {
            Some(_) => layout(m, slot_dtype(slot, dtype)).row_bytes * m.rows as u64,
            // the K/V bias once per K/V matrix
            None if matches!(slot, Slot::Layer(i, LayerSlot::KvBias) if cfg.layers[i].writes_global && cfg.layers[i].local) => {
                2 * m.rows as u64 * 4
            }
            None => m.rows as u64 * 4,
        };
    }
    total
}

impl GpuMatrix {
    /// A zeroed `[rows, cols]` matrix stored as `format`, split into row parts that each fit one
    /// binding, with a bias of `rows` values (added by every product) where `bias` says.
    pub(crate) fn allocate(
        gpu: &Gpu,
        label: &str,
        (rows, cols): (usize, usize),
        format: WeightFormat,
        bias: bool,
    ) -> Result<Self> {
        let mut m = GpuMatrix { cols, format, parts: Vec::new() };
        let row_bytes = m.row_bytes() as u64;
        let rows_per_part = (gpu.max_binding() / row_bytes.max(1)) as usize;
        if rows_per_part == 0 {
            return Err(Error::Limit(format!("{label}: one row of {row_bytes} bytes exceeds a storage binding")));
        }
        let mut start = 0;
        while start < rows {
            let n = rows_per_part.min(rows - start);
            let part = |what: &str, bytes: u64| gpu.storage(&format!("{label}{what} {start}..{}", start + n), bytes);
            let buffer = part(" rows", n as u64 * row_bytes)?;
            let bias = if bias { Some(part(" bias", n as u64 * 4)?) } else { None };
            m.parts.push(MatrixPart { buffer, bias, row_start: start, rows: n });
            start += n;
        }
        Ok(m)
    }
}

impl GpuMatrix {
    /// The block format of a quantized matrix.
    fn quant_kind(&self) -> Option<QuantKind> {
        QuantKind::ALL.into_iter().find(|&k| WeightFormat::from(k) == self.format)
    }

    /// Bytes of one row as stored.
    fn row_bytes(&self) -> usize {
        match (self.format, self.quant_kind()) {
            (_, Some(k)) => self.cols / k.block_len() * k.gpu_block_words() * 4,
            (WeightFormat::F32, _) => self.cols * 4,
            _ => self.cols * 2,
        }
    }

    /// Overwrite rows `row0 .. row0 + n` with rows of `t` (row `i` from `t`'s row `source(i)`),
    /// converted to this matrix's format as [`GpuMatrix::upload`] would store them: 16-bit by
    /// rounding, quantized formats by this crate's quantizer unless `t` already has those blocks.
    /// `t` has been checked ([`HostTensor::check`]) against `[rows, self.cols]`.
    /// Returns the bytes written.
    pub(crate) fn write_rows(
        &self,
        gpu: &Gpu,
        row0: usize,
        n: usize,
        t: &HostTensor,
        source: &dyn Fn(usize) -> usize,
    ) -> u64 {
        let rb = self.row_bytes();
        let quant = self.quant_kind();
        // the trainer's common case: the tensor's rows are the stored bytes
        let same = matches!(
            (self.format, t.dtype),
            (WeightFormat::F32, HostDtype::F32)
                | (WeightFormat::F16, HostDtype::F16)
                | (WeightFormat::BF16, HostDtype::BF16)
        );
        // rows in the file's order: one copy of their bytes
        let first = source(0);
        let in_order = (0..n).all(|i| source(i) == first + i);
        for p in &self.parts {
            let (a, b) = (row0.max(p.row_start), (row0 + n).min(p.row_start + p.rows));
            let Some(size) = wgpu::BufferSize::new(((b.max(a) - a) * rb) as u64) else { continue };
            let Some(mut view) = gpu.queue.write_buffer_with(&p.buffer, ((a - p.row_start) * rb) as u64, size) else {
                continue; // a validation error: the device's error scope reports it
            };
            if same && in_order {
                view.copy_from_slice(&t.bytes[(first + a - row0) * rb..(first + b - row0) * rb]);
                continue;
            }
            for r in a..b {
                let src = source(r - row0);
                let bytes: Vec<u8> = match (self.format, quant) {
                    _ if same => t.row_raw(src).to_vec(),
                    (_, Some(k)) => {
                        let blocks = match t.dtype {
                            HostDtype::Quant(have) if have == k => t.row_raw(src).to_vec(),
                            // whole blocks by construction: quantizing cannot fail
                            _ => quantize(k, &t.row_f32(src)).unwrap_or_default(),
                        };
                        bytemuck::cast_slice(&repack_for_gpu(k, &blocks)).to_vec()
                    }
                    (WeightFormat::F32, _) => bytemuck::cast_slice(&t.row_f32(src)).to_vec(),
                    (WeightFormat::BF16, _) => {
                        t.row_f32(src).iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect()
                    }
                    _ => t.row_f32(src).iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                };
                let at = (r - a) * rb;
                view.slice(at..at + rb).copy_from_slice(&bytes);
            }
        }
        (n * rb) as u64
    }

    /// Overwrite the bias of rows `row0 .. row0 + n` with `values` (element `i` from
    /// `values[source(i)]`).
    /// Returns the bytes written.
    pub(crate) fn write_bias(
        &self,
        gpu: &Gpu,
        row0: usize,
        n: usize,
        values: &[f32],
        source: &dyn Fn(usize) -> usize,
    ) -> u64 {
        for p in &self.parts {
            let (a, b) = (row0.max(p.row_start), (row0 + n).min(p.row_start + p.rows));
            let Some(bias) = p.bias.as_ref().filter(|_| a < b) else { continue };
            let part: Vec<f32> = (a..b).map(|r| values[source(r - row0)]).collect();
            gpu.queue.write_buffer(bias, ((a - p.row_start) * 4) as u64, bytemuck::cast_slice(&part));
        }
        n as u64 * 4
    }
}

/// Where one weight lives on the GPU.
pub(crate) enum GpuPlace<'a> {
    /// Rows `row0 ..` of a matrix.
    Rows { matrix: &'a GpuMatrix, row0: usize },
    /// The bias of rows `row0 ..` of a matrix.
    Bias { matrix: &'a GpuMatrix, row0: usize },
    /// A norm's multipliers (`1 + w` for Gemma's norms, see [`norm_multiplier`]).
    Norm(&'a wgpu::Buffer),
    /// f32 values at this element offset (Engram tables).
    Floats { buffer: &'a wgpu::Buffer, offset: usize },
}

/// A layer's query projection and, on writer layers, its global K/V projection: one matrix
/// `[wq; kv_global]` (one product a step) when both are stored alike, else apart.
pub(crate) enum QkvWeights {
    Fused(GpuMatrix),
    Apart { wq: GpuMatrix, kv_global: Option<GpuMatrix> },
}

impl QkvWeights {
    fn matrices(&self) -> Vec<&GpuMatrix> {
        match self {
            QkvWeights::Fused(m) => vec![m],
            QkvWeights::Apart { wq, kv_global } => std::iter::once(wq).chain(kv_global).collect(),
        }
    }
}

/// Per-layer GPU weights.
pub(crate) struct GpuLayer {
    pub attn_norm: Option<wgpu::Buffer>,
    pub qkv: QkvWeights,
    pub q_norm: Option<wgpu::Buffer>,
    pub k_norm: Option<wgpu::Buffer>,
    pub kv_local: Option<GpuMatrix>,
    pub wo: GpuMatrix,
    /// Each query head's attention sink, `[n_heads]` f32 (gpt-oss).
    pub sinks: Option<wgpu::Buffer>,
    pub post_attn_norm: Option<wgpu::Buffer>,
    pub mlp_norm: Option<wgpu::Buffer>,
    pub post_mlp_norm: Option<wgpu::Buffer>,
    pub mlp_in: GpuMatrix,
    pub mlp_out: GpuMatrix,
    /// A MoE layer's router, f32 whatever the engine's weight type (the routing decides which
    /// experts run; it is kept as exact as the file has it).
    pub router: Option<GpuMatrix>,
    /// A MoE layer's shared expert (its gate f32, as the router).
    pub shared: Option<GpuShared>,
    pub engram: Option<GpuEngram>,
}

/// A MoE layer's shared expert on the GPU.
pub(crate) struct GpuShared {
    pub mlp_in: GpuMatrix,
    pub mlp_out: GpuMatrix,
    pub gate: GpuMatrix,
}

/// One layer's Engram module on the GPU.
pub(crate) struct GpuEngram {
    /// All tables, `[orders * heads, table_rows, dim]` f32.
    pub tables: wgpu::Buffer,
    /// `[W_k; W_v]`.
    pub w_kv: GpuMatrix,
}

/// All model weights on the GPU.
pub(crate) struct GpuWeights {
    pub embed: GpuMatrix,
    /// `None` when tied: the LM head reads `embed`.
    pub head: Option<GpuMatrix>,
    pub final_norm: Option<wgpu::Buffer>,
    pub layers: Vec<GpuLayer>,
    /// Engram: compressed id per token (identity when the model has none) and the orders.
    pub cid_map: wgpu::Buffer,
    pub engram_orders: wgpu::Buffer,
    /// LoRA adapter slots (`EngineOptions::max_loras` > 0).
    pub lora: Option<crate::gpu::lora::GpuLora>,
}

impl GpuWeights {
    /// Where rows `row0 ..` of `slot` live (`None`: this engine holds no such weight).
    pub(crate) fn place(&self, cfg: &ModelConfig, slot: Slot, row0: usize) -> Option<GpuPlace<'_>> {
        fn rows(matrix: &GpuMatrix, row0: usize) -> GpuPlace<'_> {
            GpuPlace::Rows { matrix, row0 }
        }
        let Slot::Layer(i, s) = slot else {
            return match slot {
                Slot::Embed => Some(rows(&self.embed, row0)),
                Slot::Head => self.head.as_ref().map(|h| rows(h, row0)),
                _ => self.final_norm.as_ref().map(GpuPlace::Norm),
            };
        };
        let l = self.layers.get(i)?;
        let hd = cfg.n_heads * cfg.head_dim;
        Some(match s {
            LayerSlot::Wq => match &l.qkv {
                QkvWeights::Fused(m) | QkvWeights::Apart { wq: m, .. } => rows(m, row0),
            },
            LayerSlot::KvGlobal => match &l.qkv {
                QkvWeights::Fused(m) => rows(m, hd + row0),
                QkvWeights::Apart { kv_global, .. } => rows(kv_global.as_ref()?, row0),
            },
            LayerSlot::KvLocal => rows(l.kv_local.as_ref()?, row0),
            LayerSlot::Wo => rows(&l.wo, row0),
            LayerSlot::MlpIn => rows(&l.mlp_in, row0),
            LayerSlot::MlpOut => rows(&l.mlp_out, row0),
            LayerSlot::Router => rows(l.router.as_ref()?, row0),
            LayerSlot::SharedIn => rows(&l.shared.as_ref()?.mlp_in, row0),
            LayerSlot::SharedOut => rows(&l.shared.as_ref()?.mlp_out, row0),
            LayerSlot::SharedGate => rows(&l.shared.as_ref()?.gate, row0),
            LayerSlot::EngramKv => rows(&l.engram.as_ref()?.w_kv, row0),
            LayerSlot::Sinks => GpuPlace::Floats { buffer: l.sinks.as_ref()?, offset: 0 },
            LayerSlot::OBias | LayerSlot::RouterBias | LayerSlot::MlpInBias | LayerSlot::MlpOutBias => {
                let matrix = match s {
                    LayerSlot::OBias => &l.wo,
                    LayerSlot::RouterBias => l.router.as_ref()?,
                    LayerSlot::MlpInBias => &l.mlp_in,
                    _ => &l.mlp_out,
                };
                matrix.parts.iter().any(|p| p.bias.is_some()).then_some(GpuPlace::Bias { matrix, row0 })?
            }
            LayerSlot::EngramTable(k) => {
                let e = cfg.engram.as_ref()?;
                GpuPlace::Floats { buffer: &l.engram.as_ref()?.tables, offset: k * e.table_rows * e.dim }
            }
            LayerSlot::AttnNorm => GpuPlace::Norm(l.attn_norm.as_ref()?),
            LayerSlot::QNorm => GpuPlace::Norm(l.q_norm.as_ref()?),
            LayerSlot::KNorm => GpuPlace::Norm(l.k_norm.as_ref()?),
            LayerSlot::PostAttnNorm => GpuPlace::Norm(l.post_attn_norm.as_ref()?),
            LayerSlot::MlpNorm => GpuPlace::Norm(l.mlp_norm.as_ref()?),
            LayerSlot::PostMlpNorm => GpuPlace::Norm(l.post_mlp_norm.as_ref()?),
            // the engine's q/K/V bias: where its matrices' rows are
            LayerSlot::QBias | LayerSlot::KvBias => {
                let (matrix, row0) = match (&l.qkv, s) {
                    (QkvWeights::Fused(m), LayerSlot::QBias) | (QkvWeights::Apart { wq: m, .. }, LayerSlot::QBias) => {
                        (m, row0)
                    }
                    (QkvWeights::Fused(m), _) if cfg.layers[i].writes_global => (m, hd + row0),
                    (QkvWeights::Apart { kv_global: Some(m), .. }, _) => (m, row0),
                    _ => (l.kv_local.as_ref()?, row0),
                };
                matrix.parts.iter().any(|p| p.bias.is_some()).then_some(GpuPlace::Bias { matrix, row0 })?
            }
        })
    }

    /// Every GPU buffer of the weights, in a fixed order ([`crate::Engine::sleep`] releases and
    /// replaces them).
    pub(crate) fn buffers_mut(&mut self) -> Vec<&mut wgpu::Buffer> {
        fn parts(m: &mut GpuMatrix) -> impl Iterator<Item = &mut wgpu::Buffer> {
            m.parts.iter_mut().flat_map(|p| std::iter::once(&mut p.buffer).chain(p.bias.as_mut()))
        }
        let mut out: Vec<&mut wgpu::Buffer> = parts(&mut self.embed).collect();
        out.extend(self.head.iter_mut().flat_map(parts));
        out.extend(self.final_norm.iter_mut());
        out.extend([&mut self.cid_map, &mut self.engram_orders]);
        for l in &mut self.layers {
            match &mut l.qkv {
                QkvWeights::Fused(m) => out.extend(parts(m)),
                QkvWeights::Apart { wq, kv_global } => {
                    out.extend(parts(wq));
                    out.extend(kv_global.iter_mut().flat_map(parts));
                }
            }
            out.extend(l.kv_local.iter_mut().flat_map(parts));
            out.extend(parts(&mut l.wo));
            out.extend(parts(&mut l.mlp_in));
            out.extend(parts(&mut l.mlp_out));
            out.extend(l.router.iter_mut().flat_map(parts));
            if let Some(s) = &mut l.shared {
                out.extend(parts(&mut s.mlp_in));
                out.extend(parts(&mut s.mlp_out));
                out.extend(parts(&mut s.gate));
            }
            for n in [&mut l.attn_norm, &mut l.q_norm, &mut l.k_norm, &mut l.post_attn_norm, &mut l.mlp_norm] {
                out.extend(n.iter_mut());
            }
            out.extend(l.post_mlp_norm.iter_mut());
            out.extend(l.sinks.iter_mut());
            if let Some(e) = &mut l.engram {
                out.push(&mut e.tables);
                out.extend(parts(&mut e.w_kv));
            }
        }
        out.extend(self.lora.iter_mut().flat_map(|l| l.buffers_mut()));
        out
    }

    /// Bytes of all matrices on the GPU (norm vectors and tables aside).
    pub(crate) fn matrix_bytes(&self) -> u64 {
        let m = |g: &GpuMatrix| g.parts.iter().map(|p| p.buffer.size()).sum::<u64>();
        let mut total = m(&self.embed) + self.head.as_ref().map_or(0, m);
        for l in &self.layers {
            total += l.qkv.matrices().into_iter().map(m).sum::<u64>();
            total += m(&l.wo) + m(&l.mlp_in) + m(&l.mlp_out) + l.kv_local.as_ref().map_or(0, m);
            total += l.router.as_ref().map_or(0, m);
            total += l.shared.as_ref().map_or(0, |s| m(&s.mlp_in) + m(&s.mlp_out) + m(&s.gate));
            total += l.engram.as_ref().map_or(0, |e| m(&e.w_kv));
        }
        total
    }

    /// `w` on the GPU: every weight allocated in its format ([`layout`]: the blocks or halves it
    /// holds, else `dtype`), then written through the places the name map gives it
    /// ([`GpuWeights::write_place`]), as a weight update writes: loading and updating are one path,
    /// so an update equals a fresh engine by construction.
    pub(crate) fn upload(gpu: &Gpu, w: &ModelWeights, dtype: WeightDtype) -> Result<Self> {
        w.check()?;
        let weights = Self::allocate(gpu, &WeightPlan::of(w), dtype)?;
        weights.fill(gpu, w)?;
        Ok(weights)
    }

    /// A model file's weights on the GPU: allocated from its `plan` (its header), then each
    /// tensor read from the file and written into its places as it comes, as an update writes,
    /// with no host copy of the model; every slot's rows must be written exactly once.
    /// `progress(tensors_done, tensors)` after each tensor.
    pub(crate) fn load(
        gpu: &Gpu,
        file: &FileWeights,
        plan: &WeightPlan,
        dtype: WeightDtype,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let weights = Self::allocate(gpu, plan, dtype)?;
        let cfg = &plan.cfg;
        let mut written: std::collections::BTreeMap<Slot, usize> = std::collections::BTreeMap::new();
        file.stream(
            &mut |p, norm, t| {
                weights
                    .write_place(gpu, cfg, p, norm, t)
                    .ok_or_else(|| Error::Weights(format!("`{}`: the engine has no place for {:?}", t.name, p.slot)))?;
                *written.entry(p.slot).or_default() += p.rows.len();
                Ok(())
            },
            &mut |done, total| {
                // staging memory is freed as each tensor's writes reach the GPU
                gpu.queue.submit([]);
                progress(done, total);
            },
        )?;
        for (slot, s) in &plan.slots {
            let rows = written.get(slot).copied().unwrap_or(0);
            if rows != s.rows {
                return Err(Error::Weights(format!("{slot:?}: {rows} of its {} rows were written", s.rows)));
            }
        }
        Ok(weights)
    }

    /// Zeroed GPU weights of `plan`'s shapes, each matrix in the format [`layout`] gives it; the
    /// query and global K/V projections in one matrix where they are stored alike.
    fn allocate(gpu: &Gpu, plan: &WeightPlan, dtype: WeightDtype) -> Result<Self> {
        let cfg: &ModelConfig = &plan.cfg;
        let vector = |label: String, slot: Slot| -> Result<Option<wgpu::Buffer>> {
            plan.vector(slot).map(|n| gpu.storage(&label, n as u64 * 4)).transpose()
        };
        let has = |slot: Slot| plan.slots.contains_key(&slot);
        let format = |slot: Slot| plan.matrix(slot).map(|m| layout(m, slot_dtype(slot, dtype)).format);
        let alloc = |label: String, slot: Slot, bias: bool| -> Result<Option<GpuMatrix>> {
            let Some(m) = plan.matrix(slot) else { return Ok(None) };
            let format = layout(m, slot_dtype(slot, dtype)).format;
            GpuMatrix::allocate(gpu, &label, (m.rows, m.cols.unwrap_or(1)), format, bias).map(Some)
        };
        let need = |label: String, slot: Slot, bias: bool| -> Result<GpuMatrix> {
            alloc(label, slot, bias)?.ok_or_else(|| Error::Weights(format!("{slot:?}: no tensor fills it")))
        };
        let mut layers = Vec::new();
        for i in 0..cfg.layers.len() {
            let p = |s: &str| format!("layer {i} {s}");
            let s = |x: LayerSlot| Slot::Layer(i, x);
            let (q_bias, kv_bias) = (has(s(LayerSlot::QBias)), has(s(LayerSlot::KvBias)));
            let qkv = match (format(s(LayerSlot::Wq)), plan.matrix(s(LayerSlot::KvGlobal))) {
                (Some(q), Some(kv)) if Some(q) == format(s(LayerSlot::KvGlobal)) => {
                    let wq = plan.matrix(s(LayerSlot::Wq)).map_or(0, |m| m.rows);
                    let cols = kv.cols.unwrap_or(1);
                    let m = GpuMatrix::allocate(gpu, &p("wq + kv_global"), (wq + kv.rows, cols), q, q_bias && kv_bias)?;
                    QkvWeights::Fused(m)
                }
                _ => QkvWeights::Apart {
                    wq: need(p("wq"), s(LayerSlot::Wq), q_bias)?,
                    kv_global: alloc(p("kv_global"), s(LayerSlot::KvGlobal), kv_bias)?,
                },
            };
            layers.push(GpuLayer {
                attn_norm: vector(p("attn_norm"), s(LayerSlot::AttnNorm))?,
                qkv,
                q_norm: vector(p("q_norm"), s(LayerSlot::QNorm))?,
                k_norm: vector(p("k_norm"), s(LayerSlot::KNorm))?,
                kv_local: alloc(p("kv_local"), s(LayerSlot::KvLocal), kv_bias)?,
                wo: need(p("wo"), s(LayerSlot::Wo), has(s(LayerSlot::OBias)))?,
                sinks: vector(p("sinks"), s(LayerSlot::Sinks))?,
                post_attn_norm: vector(p("post_attn_norm"), s(LayerSlot::PostAttnNorm))?,
                mlp_norm: vector(p("mlp_norm"), s(LayerSlot::MlpNorm))?,
                post_mlp_norm: vector(p("post_mlp_norm"), s(LayerSlot::PostMlpNorm))?,
                mlp_in: need(p("mlp_in"), s(LayerSlot::MlpIn), has(s(LayerSlot::MlpInBias)))?,
                mlp_out: need(p("mlp_out"), s(LayerSlot::MlpOut), has(s(LayerSlot::MlpOutBias)))?,
                shared: match alloc(p("shared expert mlp_in"), s(LayerSlot::SharedIn), false)? {
                    Some(mlp_in) => Some(GpuShared {
                        mlp_in,
                        mlp_out: need(p("shared expert mlp_out"), s(LayerSlot::SharedOut), false)?,
                        gate: need(p("shared expert gate"), s(LayerSlot::SharedGate), false)?,
                    }),
                    None => None,
                },
                router: alloc(p("router"), s(LayerSlot::Router), has(s(LayerSlot::RouterBias)))?,
                engram: match cfg.engram.as_ref().filter(|e| e.layers.contains(&i)) {
                    Some(e) => Some(GpuEngram {
                        tables: gpu.storage(
                            &p("engram tables"),
                            (e.orders.len() * e.heads * e.table_rows * e.dim) as u64 * 4,
                        )?,
                        w_kv: need(p("engram w_kv"), s(LayerSlot::EngramKv), false)?,
                    }),
                    None => None,
                },
            });
        }
        // the expert products index a MoE layer's experts in one binding
        for (i, l) in layers.iter().enumerate().filter(|(i, _)| cfg.moe_layer(*i).is_some()) {
            for (name, m) in [("mlp_in", &l.mlp_in), ("mlp_out", &l.mlp_out)] {
                if m.parts.len() > 1 {
                    return Err(Error::Limit(format!(
                        "layer {i} {name}: the experts' matrix is larger than one storage binding ({} bytes on this \
                         device), and the expert products read every expert from one",
                        gpu.max_binding()
                    )));
                }
            }
        }
        Ok(GpuWeights {
            embed: need("embed".into(), Slot::Embed, false)?,
            head: alloc("head".into(), Slot::Head, false)?,
            final_norm: vector("final_norm".into(), Slot::FinalNorm)?,
            layers,
            cid_map: {
                let ids: Vec<u32> = plan.cid_map.clone().unwrap_or_else(|| (0..cfg.vocab as u32).collect());
                gpu.storage_init("cid_map", bytemuck::cast_slice(&ids))?
            },
            engram_orders: {
                let o: Vec<u32> =
                    cfg.engram.as_ref().map(|e| e.orders.iter().map(|&n| n as u32).collect()).unwrap_or_default();
                gpu.storage_init("engram orders", bytemuck::cast_slice(&o))?
            },
            lora: None,
        })
    }

    /// Write every weight of `w` into its place: each place kvdecode's names give, once, from the
    /// slot's own rows as `w` stores them (a matrix's blocks where its format keeps them, else its
    /// values), through [`GpuWeights::write_place`].
    fn fill(&self, gpu: &Gpu, w: &ModelWeights) -> Result<()> {
        let cfg = &w.cfg;
        let mut filled = std::collections::HashSet::new();
        for name in tensor_names(cfg, Naming::Kvdecode) {
            for p in &name.places {
                if !filled.insert((p.slot, p.row0)) {
                    return Err(Error::Weights(format!(
                        "`{}`: {:?} row {} is filled twice",
                        name.name, p.slot, p.row0
                    )));
                }
                let missing = || Error::Weights(format!("`{}`: the model has no {:?}", name.name, p.slot));
                // the slot's rows row0.. themselves: a place over the whole slot, in order
                let n = p.rows.len();
                let whole = Place { slot: p.slot, row0: p.row0, rows: p.row0..p.row0 + n, order: RowOrder::AsIs };
                let format = match self.place(cfg, p.slot, p.row0) {
                    Some(GpuPlace::Rows { matrix, .. }) => Some(matrix.format),
                    _ => None,
                };
                let t = match (w.slot_matrix(p.slot), w.slot_vector(p.slot)) {
                    (Some(m), _) => matrix_tensor(&name.name, m, format),
                    (None, Some(v)) => HostTensor::f32(name.name.clone(), &[v.len()], v),
                    _ => return Err(missing()),
                };
                self.write_place(gpu, cfg, &whole, cfg.norm, &t).ok_or_else(missing)?;
            }
            // staging memory is freed as each tensor's writes reach the GPU
            gpu.queue.submit([]);
        }
        Ok(())
    }

    /// Write tensor `t`'s rows into place `p` (`t` checked against the place's shape; norms
    /// stored as `norm` says), converted to how the place stores them. Returns the bytes written,
    /// or `None` where this engine holds no such weight.
    pub(crate) fn write_place(
        &self,
        gpu: &Gpu,
        cfg: &ModelConfig,
        p: &Place,
        norm: NormKind,
        t: &HostTensor,
    ) -> Option<u64> {
        let (n, source) = (p.rows.len(), |i: usize| p.source(i));
        Some(match self.place(cfg, p.slot, p.row0)? {
            GpuPlace::Rows { matrix, row0 } => matrix.write_rows(gpu, row0, n, t, &source),
            GpuPlace::Bias { matrix, row0 } => matrix.write_bias(gpu, row0, n, &t.values_f32(), &source),
            GpuPlace::Norm(buffer) => {
                let values = norm_multiplier(norm, &t.values_f32());
                gpu.queue.write_buffer(buffer, 0, bytemuck::cast_slice(&values));
                values.len() as u64 * 4
            }
            GpuPlace::Floats { buffer, offset } => {
                let values = t.values_f32();
                gpu.queue.write_buffer(buffer, offset as u64 * 4, bytemuck::cast_slice(&values));
                values.len() as u64 * 4
            }
        })
    }
}

/// Matrix `m` as a host tensor: its blocks where the GPU keeps that format, else its values.
fn matrix_tensor<'a>(name: &str, m: &'a Matrix, gpu_format: Option<WeightFormat>) -> HostTensor<'a> {
    match m.quant.as_ref().filter(|q| Some(WeightFormat::from(q.kind)) == gpu_format) {
        Some(q) => HostTensor {
            name: name.to_string(),
            shape: vec![m.rows, m.cols],
            dtype: HostDtype::Quant(q.kind),
            bytes: &q.bytes,
        },
        None => HostTensor::f32(name, &[m.rows, m.cols], &m.data),
    }
}
