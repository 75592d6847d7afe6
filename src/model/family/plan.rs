//! What a model's weights are before any value is read ([`WeightPlan`]: each slot's shape and
//! how its elements are stored, from a file's header or a model in memory), the one writer of a
//! named tensor into a host model ([`ModelWeights::write_place`], the GPU's is
//! `GpuWeights::write_place`), and the model taken apart into named tensors again
//! ([`tensors_of`]), all through [`tensor_names`]'s places.

use std::collections::BTreeMap;

use super::names::{tensor_names, LayerSlot, Naming, Place, Slot, TensorName};
use crate::error::{Error, Result};
use crate::model::config::{ModelConfig, NormKind};
use crate::model::quant::{QuantData, QuantKind};
use crate::model::tensor::{HostDtype, HostTensor};
use crate::model::weights::{EngramWeights, Half, LayerWeights, Matrix, ModelWeights, SharedExpert};

/// How a matrix's elements are stored (in its file, or in memory): what the GPU keeps of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// f32 values (the GPU stores them as the engine's weight type says).
    Values,
    /// 16-bit values, kept 16-bit on the GPU.
    Half(Half),
    /// llama.cpp's blocks, kept as blocks on the GPU.
    Quant(QuantKind),
}

impl Stored {
    /// How a tensor of `dtype` is stored.
    pub fn of(dtype: HostDtype) -> Stored {
        match dtype {
            HostDtype::F32 => Stored::Values,
            HostDtype::F16 => Stored::Half(Half::F16),
            HostDtype::BF16 => Stored::Half(Half::BF16),
            HostDtype::Quant(k) => Stored::Quant(k),
        }
    }

    /// How `m` is stored.
    pub fn of_matrix(m: &Matrix) -> Stored {
        match (&m.quant, m.half) {
            (Some(q), _) => Stored::Quant(q.kind),
            (None, Some(h)) => Stored::Half(h),
            (None, None) => Stored::Values,
        }
    }
}

/// One weight: a matrix `[rows, cols]` stored as `stored`, or a vector of `rows` f32 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotPlan {
    /// Rows of a matrix, elements of a vector.
    pub rows: usize,
    /// Columns of a matrix; `None` for a vector.
    pub cols: Option<usize>,
    /// How its elements are stored (a vector's: [`Stored::Values`]).
    pub stored: Stored,
}

/// Every weight of a model before any value is read: each [`Slot`]'s shape and storage. Built
/// from a file's header ([`WeightPlan::from_names`]) or from a model in memory
/// ([`WeightPlan::of`]); the GPU allocates from it, then the tensors are written into it.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightPlan {
    /// The model's configuration.
    pub cfg: ModelConfig,
    /// Every weight the model has.
    pub slots: BTreeMap<Slot, SlotPlan>,
    /// Engram's compressed id of each token (`None`: identity).
    pub cid_map: Option<Vec<u32>>,
}

impl WeightPlan {
    /// The plan of `names` (a file's naming of `cfg`'s weights), each stored as `stored` says
    /// (read from the file's header). A weight filled by parts of different storage is held as
    /// values (K in Q4_K beside V in Q6_K). Every slot's rows must be filled exactly once, from
    /// its first row on, and the weights every model has must be there.
    pub fn from_names(
        cfg: &ModelConfig,
        names: &[TensorName],
        stored: &mut dyn FnMut(&TensorName) -> Result<Stored>,
    ) -> Result<Self> {
        let mut slots: BTreeMap<Slot, SlotPlan> = BTreeMap::new();
        let mut parts: BTreeMap<Slot, Vec<(usize, usize)>> = BTreeMap::new();
        for t in names {
            let s = stored(t)?;
            for p in &t.places {
                let (rows, cols) = (p.row0 + p.rows.len(), t.shape.get(1).copied());
                let e = slots.entry(p.slot).or_insert(SlotPlan { rows, cols, stored: s });
                if e.cols != cols {
                    return Err(Error::Weights(format!(
                        "`{}` fills {:?} with rows of {cols:?} values, another tensor with rows of {:?}",
                        t.name, p.slot, e.cols
                    )));
                }
                e.rows = e.rows.max(rows);
                if e.stored != s || cols.is_none() {
                    e.stored = Stored::Values;
                }
                parts.entry(p.slot).or_default().push((p.row0, p.rows.len()));
            }
        }
        for (slot, mut parts) in parts {
            parts.sort();
            let mut next = 0;
            for (row0, n) in parts {
                match row0.cmp(&next) {
                    std::cmp::Ordering::Greater => {
                        return Err(Error::Weights(format!("{slot:?}: no tensor fills rows {next}..{row0}")))
                    }
                    std::cmp::Ordering::Less => {
                        return Err(Error::Weights(format!("{slot:?}: rows {row0}..{next} are filled twice")))
                    }
                    std::cmp::Ordering::Equal => next += n,
                }
            }
        }
        let plan = WeightPlan { cfg: cfg.clone(), slots, cid_map: None };
        let mut required = vec![Slot::Embed];
        if !cfg.tie_embeddings {
            required.push(Slot::Head);
        }
        for i in 0..cfg.layers.len() {
            required
                .extend([LayerSlot::Wq, LayerSlot::Wo, LayerSlot::MlpIn, LayerSlot::MlpOut].map(|s| Slot::Layer(i, s)));
        }
        if let Some(slot) = required.into_iter().find(|s| plan.matrix(*s).is_none()) {
            return Err(Error::Weights(format!("{slot:?}: no tensor fills it")));
        }
        Ok(plan)
    }

    /// The plan of `w`: its matrices as they are stored in memory.
    pub fn of(w: &ModelWeights) -> Self {
        let mut slots = BTreeMap::new();
        for t in tensor_names(&w.cfg, Naming::Kvdecode) {
            for p in &t.places {
                let plan = match (w.slot_matrix(p.slot), w.slot_vector(p.slot)) {
                    (Some(m), _) => SlotPlan { rows: m.rows, cols: Some(m.cols), stored: Stored::of_matrix(m) },
                    (None, Some(v)) => SlotPlan { rows: v.len(), cols: None, stored: Stored::Values },
                    _ => continue,
                };
                slots.insert(p.slot, plan);
            }
        }
        WeightPlan { cfg: w.cfg.clone(), slots, cid_map: w.cid_map.clone() }
    }

    /// The matrix `slot` names, if the model has it.
    pub fn matrix(&self, slot: Slot) -> Option<&SlotPlan> {
        self.slots.get(&slot).filter(|s| s.cols.is_some())
    }

    /// The length of the vector `slot` names, if the model has it.
    pub fn vector(&self, slot: Slot) -> Option<usize> {
        self.slots.get(&slot).filter(|s| s.cols.is_none()).map(|s| s.rows)
    }
}

/// `t` in the shape `spec` (its name's) gives it, where its values are those rows in that
/// order: a one-row matrix or any 2-D shape of `m` values fills a vector `[m]` (llama.cpp's
/// converter writes Qwen2-MoE's shared-expert gate as `[1, d]`, gpt-oss's expert biases as
/// `[experts, rows]`), a vector `[m]` the matrix `[1, m]`, a stack `[a, b, c]` the matrix
/// `[a * b, c]` (a transformers trainer's fused experts), and a matrix its files hold as stacked
/// transposes (gpt-oss's experts) is transposed back (16-bit elements moved as they are).
/// `None`: `t` is as it is.
pub(crate) fn conform(spec: &TensorName, t: &HostTensor) -> Result<Option<Conformed>> {
    if t.shape == spec.shape {
        return Ok(None);
    }
    if let Some(n) = spec.transposed_stack {
        let want = spec.file_shape();
        let size = match t.dtype {
            HostDtype::F32 => 4,
            HostDtype::F16 | HostDtype::BF16 => 2,
            HostDtype::Quant(k) => {
                return Err(Error::Weights(format!("tensor `{}`: {k:?} blocks cannot be transposed", t.name)))
            }
        };
        let (cols, r) = (want[1], want[2]);
        if t.shape != want || t.bytes.len() != n * cols * r * size {
            return Err(Error::Weights(format!(
                "tensor `{}`: shape {:?} in {} bytes, this model's is {want:?} in {:?}",
                t.name,
                t.shape,
                t.bytes.len(),
                t.dtype
            )));
        }
        // elements as byte arrays of their width: one transposition, whatever the type
        fn back<const W: usize>(n: usize, cols: usize, r: usize, bytes: &[u8]) -> Vec<u8> {
            let elements: Vec<[u8; W]> = bytes.chunks_exact(W).map(|e| e.try_into().unwrap_or([0; W])).collect();
            transpose_stack(n, cols, r, &elements).concat()
        }
        let out = if size == 4 { back::<4>(n, cols, r, t.bytes) } else { back::<2>(n, cols, r, t.bytes) };
        return Ok(Some(Conformed { shape: spec.shape.clone(), bytes: Some(out) }));
    }
    let shape = match (&t.shape[..], &spec.shape[..]) {
        (&[a, b], &[m]) if a.checked_mul(b) == Some(m) => vec![m],
        (&[m], &[1, cols]) if m == cols => vec![1, m],
        (&[a, b, c], &[rows, cols]) if a.checked_mul(b) == Some(rows) && c == cols => vec![rows, cols],
        _ => return Ok(None),
    };
    Ok(Some(Conformed { shape, bytes: None }))
}

/// A tensor taken in its name's shape ([`conform`]).
pub(crate) struct Conformed {
    shape: Vec<usize>,
    /// Its elements, where they moved (a stack of transposes transposed back).
    bytes: Option<Vec<u8>>,
}

impl Conformed {
    /// `t` as this says.
    pub(crate) fn apply<'a>(&'a self, t: &HostTensor<'a>) -> HostTensor<'a> {
        let bytes = self.bytes.as_deref().unwrap_or(t.bytes);
        HostTensor { name: t.name.clone(), shape: self.shape.clone(), dtype: t.dtype, bytes }
    }
}

impl ModelWeights {
    /// Zeroed weights of `plan`'s shapes and storage, to be written through
    /// [`ModelWeights::write_place`].
    pub fn zeroed(plan: &WeightPlan) -> Result<Self> {
        let matrix = |slot: Slot| -> Result<Option<Matrix>> {
            let Some(&SlotPlan { rows, cols: Some(cols), stored }) = plan.matrix(slot) else { return Ok(None) };
            let n = rows.checked_mul(cols).ok_or_else(|| Error::Weights(format!("{slot:?}: size overflows")))?;
            let mut m = Matrix::new(rows, cols, vec![0.0; n])?;
            match stored {
                Stored::Values => {}
                Stored::Half(h) => m.half = Some(h),
                Stored::Quant(kind) => {
                    let row = HostDtype::Quant(kind).row_bytes(cols).ok_or_else(|| {
                        Error::Weights(format!("{slot:?}: rows of {cols} are not whole {kind:?} blocks"))
                    })?;
                    m.quant = Some(QuantData { kind, bytes: vec![0; rows * row] });
                }
            }
            Ok(Some(m))
        };
        let need = |slot: Slot| matrix(slot)?.ok_or_else(|| Error::Weights(format!("{slot:?}: no tensor fills it")));
        let vector = |slot: Slot| plan.vector(slot).map(|n| vec![0.0; n]);
        let cfg = &plan.cfg;
        let mut layers = Vec::with_capacity(cfg.layers.len());
        for i in 0..cfg.layers.len() {
            let s = |x: LayerSlot| Slot::Layer(i, x);
            let engram = match cfg.engram.as_ref().filter(|e| e.layers.contains(&i)) {
                Some(e) => Some(EngramWeights {
                    tables: (0..e.orders.len() * e.heads)
                        .map(|k| need(s(LayerSlot::EngramTable(k))))
                        .collect::<Result<_>>()?,
                    w_kv: need(s(LayerSlot::EngramKv))?,
                }),
                None => None,
            };
            let shared_expert = match matrix(s(LayerSlot::SharedIn))? {
                Some(mlp_in) => Some(SharedExpert {
                    mlp_in,
                    mlp_out: need(s(LayerSlot::SharedOut))?,
                    gate: need(s(LayerSlot::SharedGate))?,
                }),
                None => None,
            };
            layers.push(LayerWeights {
                attn_norm: vector(s(LayerSlot::AttnNorm)),
                wq: need(s(LayerSlot::Wq))?,
                q_norm: vector(s(LayerSlot::QNorm)),
                k_norm: vector(s(LayerSlot::KNorm)),
                kv_global: matrix(s(LayerSlot::KvGlobal))?,
                kv_local: matrix(s(LayerSlot::KvLocal))?,
                q_bias: vector(s(LayerSlot::QBias)),
                kv_bias: vector(s(LayerSlot::KvBias)),
                wo: need(s(LayerSlot::Wo))?,
                o_bias: vector(s(LayerSlot::OBias)),
                sinks: vector(s(LayerSlot::Sinks)),
                router_bias: vector(s(LayerSlot::RouterBias)),
                mlp_in_bias: vector(s(LayerSlot::MlpInBias)),
                mlp_out_bias: vector(s(LayerSlot::MlpOutBias)),
                post_attn_norm: vector(s(LayerSlot::PostAttnNorm)),
                mlp_norm: vector(s(LayerSlot::MlpNorm)),
                post_mlp_norm: vector(s(LayerSlot::PostMlpNorm)),
                mlp_in: need(s(LayerSlot::MlpIn))?,
                mlp_out: need(s(LayerSlot::MlpOut))?,
                router: matrix(s(LayerSlot::Router))?,
                shared_expert,
                engram,
            });
        }
        Ok(ModelWeights {
            cfg: cfg.clone(),
            embed: need(Slot::Embed)?,
            layers,
            final_norm: vector(Slot::FinalNorm),
            head: matrix(Slot::Head)?,
            cid_map: plan.cid_map.clone(),
        })
    }

    /// Write tensor `t`'s rows into place `p` of these weights (`t` checked against the place's
    /// tensor shape; its norms held as `norm` says): values always, a matrix's blocks too where
    /// it keeps `t`'s blocks. The host side of `GpuWeights::write_place`.
    pub fn write_place(&mut self, p: &Place, norm: NormKind, t: &HostTensor) -> Result<()> {
        let (n, slot) = (p.rows.len(), p.slot);
        let missing = || Error::Weights(format!("`{}`: the model has no {slot:?}", t.name));
        if let Some(m) = self.slot_matrix_mut(slot) {
            if p.row0 + n > m.rows || t.cols() != m.cols {
                return Err(Error::Weights(format!("`{}` does not fit {slot:?} at row {}", t.name, p.row0)));
            }
            let cols = m.cols;
            for i in 0..n {
                let (src, dst) = (p.source(i), p.row0 + i);
                m.data[dst * cols..(dst + 1) * cols].copy_from_slice(&t.row_f32(src));
                if let Some(q) = &mut m.quant {
                    if t.dtype != HostDtype::Quant(q.kind) {
                        return Err(Error::Weights(format!(
                            "`{}`: {:?} rows for {slot:?}, which holds {:?} blocks",
                            t.name, t.dtype, q.kind
                        )));
                    }
                    let rb = t.row_bytes();
                    q.bytes[dst * rb..(dst + 1) * rb].copy_from_slice(t.row_raw(src));
                }
            }
            return Ok(());
        }
        let own = self.cfg.norm;
        let v = self.slot_vector_mut(slot).ok_or_else(missing)?;
        let values = t.values_f32();
        if p.row0 + n > v.len() || p.rows.end > values.len() {
            return Err(Error::Weights(format!("`{}` does not fit {slot:?} at element {}", t.name, p.row0)));
        }
        for i in 0..n {
            v[p.row0 + i] = values[p.source(i)];
        }
        // a norm held another way than this model's config says (Gemma's `1 + w` against the
        // multiplier itself)
        let is_norm = matches!(
            slot,
            Slot::FinalNorm
                | Slot::Layer(
                    _,
                    LayerSlot::AttnNorm
                        | LayerSlot::QNorm
                        | LayerSlot::KNorm
                        | LayerSlot::PostAttnNorm
                        | LayerSlot::MlpNorm
                        | LayerSlot::PostMlpNorm
                )
        );
        let shift = match (norm, own) {
            (NormKind::OnePlusWeight, NormKind::Weight) => 1.0,
            (NormKind::Weight, NormKind::OnePlusWeight) => -1.0,
            _ => 0.0,
        };
        if is_norm && shift != 0.0 {
            v[p.row0..p.row0 + n].iter_mut().for_each(|x| *x += shift);
        }
        Ok(())
    }
}

/// A tensor as a file gives it: a view of the file's bytes, or bytes made from it (OpenAI's
/// MXFP4 checkpoint layout turned into llama.cpp's blocks).
pub(crate) enum FileTensor<'a> {
    /// The file's own bytes.
    View(HostTensor<'a>),
    /// Bytes made from the file's: (name, shape, element type, bytes).
    Made(String, Vec<usize>, HostDtype, Vec<u8>),
}

impl FileTensor<'_> {
    fn view(&self) -> HostTensor<'_> {
        match self {
            FileTensor::View(t) => t.clone(),
            FileTensor::Made(name, shape, dtype, bytes) => {
                HostTensor { name: name.clone(), shape: shape.clone(), dtype: *dtype, bytes }
            }
        }
    }
}

/// Each tensor of `names` (a file's naming of a model), one at a time: found by `find`, taken in
/// its name's shape ([`conform`]), checked against it, and handed to `write` for each of its
/// places; `progress(done, names.len())` after each. No more than one tensor's bytes are held
/// here at a time beyond what `find` holds.
pub(crate) fn stream<'a>(
    names: &[TensorName],
    find: &mut dyn FnMut(&TensorName) -> Result<FileTensor<'a>>,
    write: &mut dyn FnMut(&Place, &HostTensor) -> Result<()>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    for (k, spec) in names.iter().enumerate() {
        let found = find(spec)?;
        let t = found.view();
        let moved = conform(spec, &t)?;
        let t = moved.as_ref().map_or(t.clone(), |c| c.apply(&t));
        t.check_shape(&spec.shape)?;
        for p in &spec.places {
            write(p, &t)?;
        }
        progress(k + 1, names.len());
    }
    Ok(())
}

/// `n` stacked row-major `[a, b]` matrices, each transposed to `[b, a]` (a stack of transposes
/// and the stack of their rows are each other's).
pub fn transpose_stack<T: Copy>(n: usize, a: usize, b: usize, values: &[T]) -> Vec<T> {
    // (every element is written below: the copy only sizes the result)
    let mut out = values.to_vec();
    for (e, m) in values.chunks_exact((a * b).max(1)).take(n).enumerate() {
        for (i, row) in m.chunks_exact(b.max(1)).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                out[e * a * b + j * a + i] = v;
            }
        }
    }
    out
}

/// The tensors of `w` under `naming`, the inverse of loading: each name with its values in f32
/// (dequantized), rows in the file's order, laid out as the file holds them
/// ([`TensorName::file_shape`]: a stack of transposes transposed). What a checkpoint in that
/// naming would hold, for tests and for pushing weights from one engine's model into another.
pub fn tensors_of(w: &ModelWeights, naming: Naming) -> Vec<(TensorName, Vec<f32>)> {
    let mut out = Vec::new();
    for t in tensor_names(&w.cfg, naming) {
        // file row f of each place holds the slot's row g where the place's source(g) == f
        let mut file_rows: Vec<Option<(Slot, usize)>> = vec![None; t.shape[0]];
        for p in &t.places {
            for g in 0..p.rows.len() {
                file_rows[p.source(g)] = Some((p.slot, p.row0 + g));
            }
        }
        let values: Option<Vec<f32>> = match t.shape[..] {
            [_] => file_rows.iter().map(|at| at.and_then(|(slot, g)| w.slot_vector(slot)?.get(g).copied())).collect(),
            [_, cols] => file_rows
                .iter()
                .map(|at| at.and_then(|(slot, g)| w.slot_matrix(slot).map(|m| m.row(g)[..cols].to_vec())))
                .collect::<Option<Vec<_>>>()
                .map(|rows| rows.concat()),
            _ => None,
        };
        if let Some(mut v) = values {
            if let (Some(n), &[rows, cols]) = (t.transposed_stack, &t.shape[..]) {
                v = transpose_stack(n, rows / n.max(1), cols, &v);
            }
            out.push((t, v));
        }
    }
    out
}

/// The matrix and vector weights of a [`ModelWeights`] by the [`Slot`] the name map gives them:
/// the shared and the mutable accessors from one body (`$as` is `as_ref` or `as_mut`, `$get`
/// `get` or `get_mut`).
macro_rules! slot_accessors {
    ($matrix:ident, $vector:ident, $as:ident, $get:ident $(, $m:ident)?) => {
        /// The matrix `slot` names (`None`: a vector, or a weight this model lacks).
        pub(crate) fn $matrix(&$($m)? self, slot: Slot) -> Option<&$($m)? Matrix> {
            let Slot::Layer(i, s) = slot else {
                return match slot {
                    Slot::Embed => Some(&$($m)? self.embed),
                    Slot::Head => self.head.$as(),
                    _ => None,
                };
            };
            let l = self.layers.$get(i)?;
            match s {
                LayerSlot::Wq => Some(&$($m)? l.wq),
                LayerSlot::KvGlobal => l.kv_global.$as(),
                LayerSlot::KvLocal => l.kv_local.$as(),
                LayerSlot::Wo => Some(&$($m)? l.wo),
                LayerSlot::MlpIn => Some(&$($m)? l.mlp_in),
                LayerSlot::MlpOut => Some(&$($m)? l.mlp_out),
                LayerSlot::Router => l.router.$as(),
                LayerSlot::SharedIn => l.shared_expert.$as().map(|s| &$($m)? s.mlp_in),
                LayerSlot::SharedOut => l.shared_expert.$as().map(|s| &$($m)? s.mlp_out),
                LayerSlot::SharedGate => l.shared_expert.$as().map(|s| &$($m)? s.gate),
                LayerSlot::EngramKv => l.engram.$as().map(|e| &$($m)? e.w_kv),
                LayerSlot::EngramTable(k) => l.engram.$as().and_then(|e| e.tables.$get(k)),
                _ => None,
            }
        }

        /// The vector `slot` names (a norm, bias or sinks).
        pub(crate) fn $vector(&$($m)? self, slot: Slot) -> Option<&$($m)? Vec<f32>> {
            let Slot::Layer(i, s) = slot else {
                return match slot {
                    Slot::FinalNorm => self.final_norm.$as(),
                    _ => None,
                };
            };
            let l = self.layers.$get(i)?;
            match s {
                LayerSlot::AttnNorm => l.attn_norm.$as(),
                LayerSlot::QNorm => l.q_norm.$as(),
                LayerSlot::KNorm => l.k_norm.$as(),
                LayerSlot::PostAttnNorm => l.post_attn_norm.$as(),
                LayerSlot::MlpNorm => l.mlp_norm.$as(),
                LayerSlot::PostMlpNorm => l.post_mlp_norm.$as(),
                LayerSlot::QBias => l.q_bias.$as(),
                LayerSlot::KvBias => l.kv_bias.$as(),
                LayerSlot::OBias => l.o_bias.$as(),
                LayerSlot::Sinks => l.sinks.$as(),
                LayerSlot::RouterBias => l.router_bias.$as(),
                LayerSlot::MlpInBias => l.mlp_in_bias.$as(),
                LayerSlot::MlpOutBias => l.mlp_out_bias.$as(),
                _ => None,
            }
        }
    };
}

impl ModelWeights {
    slot_accessors!(slot_matrix, slot_vector, as_ref, get);
    slot_accessors!(slot_matrix_mut, slot_vector_mut, as_mut, get_mut, mut);
}
