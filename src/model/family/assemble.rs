//! Weights assembled from a checkpoint's tensors ([`assemble`]) and taken apart into named
//! tensors again ([`tensors_of`]), both through [`tensor_names`]'s places.

use std::collections::BTreeMap;

use super::names::{tensor_names, LayerSlot, Naming, Slot, TensorName};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use crate::model::weights::{EngramWeights, LayerWeights, Matrix, ModelWeights, SharedExpert};

/// A tensor as a checkpoint reader returns it.
pub enum Tensor {
    /// A matrix (quantized blocks and 16-bit types kept as the file has them).
    Matrix(Matrix),
    /// A vector, in f32.
    Vector(Vec<f32>),
}

impl Tensor {
    /// `t`'s tensor from its values as a file of its naming holds them (row-major in
    /// [`TensorName::file_shape`]): a vector, a matrix, or a stack of transposes turned back into
    /// the matrix of their rows.
    pub fn from_file_values(t: &TensorName, values: Vec<f32>) -> Result<Tensor> {
        match (t.transposed_stack, &t.shape[..]) {
            (_, &[_]) => Ok(Tensor::Vector(values)),
            (None, &[rows, cols]) => Matrix::new(rows, cols, values).map(Tensor::Matrix),
            (Some(n), &[rows, cols]) => {
                Matrix::new(rows, cols, transpose_stack(n, cols, rows / n.max(1), &values)).map(Tensor::Matrix)
            }
            _ => Err(Error::Weights(format!("tensor `{}`: shape {:?}", t.name, t.shape))),
        }
    }
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

/// Assemble `cfg`'s weights from the tensors `names` lists, each read by `read` (which checks
/// the shape it finds against [`TensorName::shape`]): interleaved rows are put back, and a fused
/// matrix is stacked from its parts in row order. [`ModelWeights::check`] runs on the result.
pub fn assemble(
    cfg: &ModelConfig,
    names: &[TensorName],
    read: &mut dyn FnMut(&TensorName) -> Result<Tensor>,
) -> Result<ModelWeights> {
    let mut mats = Mats::new();
    let mut vec_parts: BTreeMap<Slot, Vec<(usize, Vec<f32>)>> = BTreeMap::new();
    for t in names {
        match read(t)? {
            Tensor::Matrix(m) => {
                for p in &t.places {
                    // (a copy either way: a whole tensor in its order is the identity's rows)
                    let part = m.permute_rows(&(0..p.rows.len()).map(|i| p.source(i)).collect::<Vec<_>>());
                    mats.entry(p.slot).or_default().push((p.row0, part));
                }
            }
            Tensor::Vector(v) => {
                for p in &t.places {
                    let part = (0..p.rows.len()).map(|i| v[p.source(i)]).collect();
                    vec_parts.entry(p.slot).or_default().push((p.row0, part));
                }
            }
        }
    }
    // a vector from its parts, in row order (the K/V bias from k's and v's)
    let mut vecs: BTreeMap<Slot, Vec<f32>> = BTreeMap::new();
    for (slot, mut parts) in vec_parts {
        parts.sort_by_key(|p| p.0);
        let mut v = Vec::new();
        for (row0, p) in parts {
            if row0 != v.len() {
                return Err(Error::Weights(format!("{slot:?}: no tensor fills elements {}..{row0}", v.len())));
            }
            v.extend(p);
        }
        vecs.insert(slot, v);
    }
    let need = |mats: &mut Mats, slot: Slot| {
        take_matrix(mats, slot)?.ok_or_else(|| Error::Weights(format!("{slot:?}: no tensor fills it")))
    };
    let embed = need(&mut mats, Slot::Embed)?;
    let head = if cfg.tie_embeddings { None } else { Some(need(&mut mats, Slot::Head)?) };
    let mut layers = Vec::with_capacity(cfg.layers.len());
    for i in 0..cfg.layers.len() {
        let s = |x: LayerSlot| Slot::Layer(i, x);
        let engram = match cfg.engram.as_ref().filter(|e| e.layers.contains(&i)) {
            Some(e) => Some(EngramWeights {
                tables: (0..e.orders.len() * e.heads)
                    .map(|k| need(&mut mats, s(LayerSlot::EngramTable(k))))
                    .collect::<Result<_>>()?,
                w_kv: need(&mut mats, s(LayerSlot::EngramKv))?,
            }),
            None => None,
        };
        layers.push(LayerWeights {
            attn_norm: vecs.remove(&s(LayerSlot::AttnNorm)),
            wq: need(&mut mats, s(LayerSlot::Wq))?,
            q_norm: vecs.remove(&s(LayerSlot::QNorm)),
            k_norm: vecs.remove(&s(LayerSlot::KNorm)),
            kv_global: take_matrix(&mut mats, s(LayerSlot::KvGlobal))?,
            kv_local: take_matrix(&mut mats, s(LayerSlot::KvLocal))?,
            q_bias: vecs.remove(&s(LayerSlot::QBias)),
            kv_bias: vecs.remove(&s(LayerSlot::KvBias)),
            wo: need(&mut mats, s(LayerSlot::Wo))?,
            o_bias: vecs.remove(&s(LayerSlot::OBias)),
            sinks: vecs.remove(&s(LayerSlot::Sinks)),
            router_bias: vecs.remove(&s(LayerSlot::RouterBias)),
            mlp_in_bias: vecs.remove(&s(LayerSlot::MlpInBias)),
            mlp_out_bias: vecs.remove(&s(LayerSlot::MlpOutBias)),
            post_attn_norm: vecs.remove(&s(LayerSlot::PostAttnNorm)),
            mlp_norm: vecs.remove(&s(LayerSlot::MlpNorm)),
            post_mlp_norm: vecs.remove(&s(LayerSlot::PostMlpNorm)),
            mlp_in: need(&mut mats, s(LayerSlot::MlpIn))?,
            mlp_out: need(&mut mats, s(LayerSlot::MlpOut))?,
            router: take_matrix(&mut mats, s(LayerSlot::Router))?,
            shared_expert: match take_matrix(&mut mats, s(LayerSlot::SharedIn))? {
                Some(mlp_in) => Some(SharedExpert {
                    mlp_in,
                    mlp_out: need(&mut mats, s(LayerSlot::SharedOut))?,
                    // a matrix of one row (Hugging Face), or a vector (GGUF)
                    gate: match take_matrix(&mut mats, s(LayerSlot::SharedGate))? {
                        Some(m) => m,
                        None => match vecs.remove(&s(LayerSlot::SharedGate)) {
                            Some(v) => Matrix::new(1, v.len(), v)?,
                            None => {
                                return Err(Error::Weights(format!("layer {i}: the shared expert's gate is missing")))
                            }
                        },
                    },
                }),
                None => None,
            },
            engram,
        });
    }
    let w = ModelWeights {
        cfg: cfg.clone(),
        embed,
        layers,
        final_norm: vecs.remove(&Slot::FinalNorm),
        head,
        cid_map: None,
    };
    w.check()?;
    Ok(w)
}

/// The parts read so far of each matrix: (first row, rows).
type Mats = BTreeMap<Slot, Vec<(usize, Matrix)>>;

/// `slot`'s matrix from its parts, which must cover its rows from 0 in order (`None`: no part).
fn take_matrix(mats: &mut Mats, slot: Slot) -> Result<Option<Matrix>> {
    let Some(mut parts) = mats.remove(&slot) else { return Ok(None) };
    parts.sort_by_key(|p| p.0);
    let mut next = 0;
    for (row0, m) in &parts {
        if *row0 != next {
            return Err(Error::Weights(format!("{slot:?}: no tensor fills rows {next}..{row0}")));
        }
        next += m.rows;
    }
    let mut parts: Vec<Matrix> = parts.into_iter().map(|p| p.1).collect();
    if parts.len() == 1 {
        return Ok(parts.pop());
    }
    Matrix::vstack(&parts).map(Some)
}

/// The tensors of `w` under `naming`, the inverse of [`assemble`]: each name with its values in
/// f32 (dequantized), rows in the file's order, laid out as the file holds them
/// ([`TensorName::file_shape`]: a stack of transposes transposed). What a checkpoint in that naming would hold, for
/// tests and for pushing weights from one engine's model into another.
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

/// The matrix and vector weights of a [`ModelWeights`] by the [`Slot`] the name map gives them.
impl ModelWeights {
    /// The matrix `slot` names (`None`: a vector, or a weight this model lacks).
    pub(crate) fn slot_matrix(&self, slot: Slot) -> Option<&Matrix> {
        let Slot::Layer(i, s) = slot else {
            return match slot {
                Slot::Embed => Some(&self.embed),
                Slot::Head => self.head.as_ref(),
                _ => None,
            };
        };
        let l = self.layers.get(i)?;
        match s {
            LayerSlot::Wq => Some(&l.wq),
            LayerSlot::KvGlobal => l.kv_global.as_ref(),
            LayerSlot::KvLocal => l.kv_local.as_ref(),
            LayerSlot::Wo => Some(&l.wo),
            LayerSlot::MlpIn => Some(&l.mlp_in),
            LayerSlot::MlpOut => Some(&l.mlp_out),
            LayerSlot::Router => l.router.as_ref(),
            LayerSlot::SharedIn => l.shared_expert.as_ref().map(|s| &s.mlp_in),
            LayerSlot::SharedOut => l.shared_expert.as_ref().map(|s| &s.mlp_out),
            LayerSlot::SharedGate => l.shared_expert.as_ref().map(|s| &s.gate),
            LayerSlot::EngramKv => l.engram.as_ref().map(|e| &e.w_kv),
            LayerSlot::EngramTable(k) => l.engram.as_ref().and_then(|e| e.tables.get(k)),
            _ => None,
        }
    }
    /// The vector `slot` names (a norm, bias or sinks; the shared expert's gate as its values).
    pub(crate) fn slot_vector(&self, slot: Slot) -> Option<&Vec<f32>> {
        let Slot::Layer(i, s) = slot else { return self.final_norm.as_ref() };
        let l = self.layers.get(i)?;
        match s {
            LayerSlot::AttnNorm => l.attn_norm.as_ref(),
            LayerSlot::QNorm => l.q_norm.as_ref(),
            LayerSlot::KNorm => l.k_norm.as_ref(),
            LayerSlot::PostAttnNorm => l.post_attn_norm.as_ref(),
            LayerSlot::MlpNorm => l.mlp_norm.as_ref(),
            LayerSlot::PostMlpNorm => l.post_mlp_norm.as_ref(),
            LayerSlot::QBias => l.q_bias.as_ref(),
            LayerSlot::KvBias => l.kv_bias.as_ref(),
            LayerSlot::OBias => l.o_bias.as_ref(),
            LayerSlot::Sinks => l.sinks.as_ref(),
            LayerSlot::RouterBias => l.router_bias.as_ref(),
            LayerSlot::MlpInBias => l.mlp_in_bias.as_ref(),
            LayerSlot::MlpOutBias => l.mlp_out_bias.as_ref(),
            LayerSlot::SharedGate => l.shared_expert.as_ref().map(|s| &s.gate.data),
            _ => None,
        }
    }
}
