//! The one map from a checkpoint's tensor names to the weights and rows they fill
//! ([`tensor_names`]), for each [`Naming`].

use super::{Family, Part};
use crate::model::config::{ModelConfig, NormKind};

/// A weight of [`crate::ModelWeights`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Slot {
    /// The token embedding `[vocab, d]`.
    Embed,
    /// The LM head `[vocab, d]` (untied models).
    Head,
    /// The final norm `[d]`.
    FinalNorm,
    /// A weight of layer `.0`.
    Layer(usize, LayerSlot),
}

/// A weight of one layer ([`crate::model::weights::LayerWeights`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerSlot {
    /// `attn_norm`.
    AttnNorm,
    /// `wq`.
    Wq,
    /// `q_norm`.
    QNorm,
    /// `k_norm`.
    KNorm,
    /// `kv_global` (`[k; v]`).
    KvGlobal,
    /// `kv_local` (`[k; v]`).
    KvLocal,
    /// `q_bias`.
    QBias,
    /// `kv_bias` (`[k; v]`).
    KvBias,
    /// `wo`.
    Wo,
    /// `o_bias`.
    OBias,
    /// `sinks`.
    Sinks,
    /// `router_bias`.
    RouterBias,
    /// `mlp_in_bias` (a MoE layer's, in `mlp_in`'s row order).
    MlpInBias,
    /// `mlp_out_bias`.
    MlpOutBias,
    /// `post_attn_norm`.
    PostAttnNorm,
    /// `mlp_norm`.
    MlpNorm,
    /// `post_mlp_norm`.
    PostMlpNorm,
    /// `mlp_in` (`[gate; up]` when gated).
    MlpIn,
    /// `mlp_out`.
    MlpOut,
    /// `router` (MoE layers).
    Router,
    /// The shared expert's `mlp_in` (`[gate; up]`).
    SharedIn,
    /// The shared expert's `mlp_out`.
    SharedOut,
    /// The shared expert's gate (`[1, d]`).
    SharedGate,
    /// Engram `[W_k; W_v]`.
    EngramKv,
    /// Engram table `k` (orders first, then heads).
    EngramTable(usize),
}

/// How a tensor's rows are ordered on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowOrder {
    /// As kvdecode (and Hugging Face) keep them.
    AsIs,
    /// llama.cpp's interleaved RoPE order, `heads` heads: GGUF row `h*hd + 2i + j` holds row
    /// `h*hd + j*hd/2 + i`.
    Interleaved {
        /// Heads in the tensor.
        heads: usize,
    },
    /// Partial rotary (Phi): the file's heads rotate their first `rotated` dimensions in pairs
    /// `(i, i + rotated/2)` and pass the rest through. kvdecode orders each head so that those
    /// pairs are its pairs `(i, i + head_dim/2)`, `i < rotated/2`, and the dimensions passed
    /// through fill the pairs after them, in order, where RoPE's table leaves them unrotated.
    /// Scores are sums over a head's dimensions, so the order changes no result but its rounding.
    PartialRotary {
        /// Heads in the tensor.
        heads: usize,
        /// Dimensions of a head that rotate.
        rotated: usize,
    },
    /// Every `step`-th row from the place's first: kvdecode's row `i` is the file's row
    /// `step * i` after it (gpt-oss's gate and up projections, interleaved in one tensor).
    Every {
        /// Rows from one to the next.
        step: usize,
    },
}

impl RowOrder {
    /// The file's row (of `rows`) that holds kvdecode's row `row`.
    pub fn source(self, row: usize, rows: usize) -> usize {
        match self {
            RowOrder::AsIs => row,
            RowOrder::Interleaved { heads } => interleaved_source(row, rows, heads),
            RowOrder::PartialRotary { heads, rotated } => {
                let hd = rows / heads.max(1);
                let (head, j) = (row / hd.max(1), row % hd.max(1));
                let (half, rot_half) = (hd / 2, rotated / 2);
                let pass_half = half - rot_half;
                let within = if j < rot_half {
                    j
                } else if j < half {
                    rotated + (j - rot_half)
                } else if j < half + rot_half {
                    rot_half + (j - half)
                } else {
                    rotated + pass_half + (j - half - rot_half)
                };
                head * hd + within
            }
            RowOrder::Every { step } => step * row,
        }
    }
}

/// Rows of one named tensor and where they go: its rows `rows`, in `order`, fill rows
/// `row0 .. row0 + rows.len()` of `slot` (a vector's elements are its rows).
#[derive(Clone, Debug, PartialEq)]
pub struct Place {
    /// The weight they fill.
    pub slot: Slot,
    /// Its first row they fill.
    pub row0: usize,
    /// The tensor's rows (all of them, or one part of a fused tensor such as Phi-3's q/k/v).
    pub rows: std::ops::Range<usize>,
    /// How those rows are ordered in the file.
    pub order: RowOrder,
}

impl Place {
    /// The tensor's row that fills row `row0 + i` of the slot.
    pub fn source(&self, i: usize) -> usize {
        self.rows.start + self.order.source(i, self.rows.len())
    }
}

/// One named tensor of a checkpoint and the rows it fills.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorName {
    /// The name in the file.
    pub name: String,
    /// `[rows, cols]` of a matrix, `[n]` of a vector.
    pub shape: Vec<usize>,
    /// Where its rows go (a tensor may fill the same rows of several slots, as a key projection
    /// fills both K/V matrices of a layer that has two).
    pub places: Vec<Place>,
    /// `Some(n)`: the file holds the matrix as `n` stacked transposes, `[n, cols, rows / n]`
    /// (gpt-oss's experts, kept for `x @ W`): each is transposed back, and the rows they give are
    /// the ones `places` speak of.
    pub transposed_stack: Option<usize>,
}

impl TensorName {
    /// The shape the file holds this tensor in.
    pub fn file_shape(&self) -> Vec<usize> {
        match (self.transposed_stack, &self.shape[..]) {
            (Some(n), &[rows, cols]) => vec![n, cols, rows / n.max(1)],
            _ => self.shape.clone(),
        }
    }
}

/// The namings kvdecode reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// kvdecode's safetensors (`blocks.{i}.attn.w_q.weight`, fused K/V and MLP input).
    Kvdecode,
    /// Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`), with this prefix for the text
    /// model (one of [`HF_PREFIXES`](super::HF_PREFIXES)).
    HuggingFace(&'static str),
    /// GGUF (`blk.{i}.attn_q.weight`).
    Gguf,
}

/// The (slot, first row) pairs a tensor's rows fill.
type Places = Vec<(Slot, usize)>;

/// Every tensor of `cfg`'s weights under `naming`, in load order (empty when the family has no
/// such names, as kvdecode's own layouts have no Hugging Face or GGUF names).
pub fn tensor_names(cfg: &ModelConfig, naming: Naming) -> Vec<TensorName> {
    let (d, hd, kvd) = (cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
    let has_w = cfg.norm != NormKind::Plain;
    let mut out = Vec::new();
    // a tensor whose every row fills `places` (none: the config has no such weight)
    fn push(out: &mut Vec<TensorName>, name: String, shape: Vec<usize>, places: Places, order: RowOrder) {
        let rows = 0..shape[0];
        let places: Vec<Place> =
            places.into_iter().map(|(slot, row0)| Place { slot, row0, rows: rows.clone(), order }).collect();
        if !places.is_empty() {
            out.push(TensorName { name, shape, places, transposed_stack: None })
        }
    }
    let whole = |slot: Slot| vec![(slot, 0)];
    let (embed, head, final_norm) = match naming {
        Naming::Kvdecode => ("embed.weight".to_string(), "head.weight".to_string(), "final_norm.weight".to_string()),
        Naming::HuggingFace(p) => {
            (format!("{p}embed_tokens.weight"), "lm_head.weight".into(), format!("{p}norm.weight"))
        }
        Naming::Gguf => ("token_embd.weight".into(), "output.weight".into(), "output_norm.weight".into()),
    };
    if naming != Naming::Kvdecode && cfg.family == Family::Kvdecode {
        return out;
    }
    push(&mut out, embed, vec![cfg.vocab, d], whole(Slot::Embed), RowOrder::AsIs);
    for (i, spec) in cfg.layers.iter().enumerate() {
        let slot = |s: LayerSlot| Slot::Layer(i, s);
        // the K/V matrices this layer holds: k fills their first kvd rows, v the next
        let kv: Vec<LayerSlot> = [(spec.writes_global, LayerSlot::KvGlobal), (spec.local, LayerSlot::KvLocal)]
            .into_iter()
            .filter_map(|(has, s)| has.then_some(s))
            .collect();
        let norm = |on: bool, s: LayerSlot| if has_w && on { vec![(slot(s), 0)] } else { vec![] };
        let bias = |s: Slot, row0: usize| if cfg.qkv_bias { vec![(s, row0)] } else { vec![] };
        let (q_norm_len, k_norm_len) = cfg.qk_norm_lens();
        let moe = cfg.layer_moe(i);
        let (experts, f) = (moe.map_or(1, |m| m.experts), cfg.layer_ffn(i));
        let moe_bias = moe.is_some_and(|m| m.bias);
        if naming == Naming::Kvdecode {
            // kvdecode's own names: the engine's slots as they are (K/V and a MoE layer's
            // experts stacked, fc [gates; ups] and proj one [d, ffn] per expert); a row whose
            // places are empty is a weight this config does not have
            let on = |has: bool, s: LayerSlot| if has { whole(slot(s)) } else { vec![] };
            let (e, ffn_in) = (experts, experts * cfg.mlp.in_factor() * f);
            let router = moe.map_or(0, |m| m.experts);
            let shared = moe.and_then(|m| m.shared_ffn);
            let fs = shared.unwrap_or(0);
            let table: [(&str, Vec<usize>, Places); 23] = [
                ("attn_norm.weight", vec![d], norm(cfg.pre_norms, LayerSlot::AttnNorm)),
                ("attn.w_q.weight", vec![hd, d], whole(slot(LayerSlot::Wq))),
                ("attn.q_norm.weight", vec![q_norm_len], norm(cfg.qk_norm, LayerSlot::QNorm)),
                ("attn.k_norm.weight", vec![k_norm_len], norm(cfg.qk_norm, LayerSlot::KNorm)),
                ("attn.w_kv_global.weight", vec![2 * kvd, d], on(spec.writes_global, LayerSlot::KvGlobal)),
                ("attn.w_kv_local.weight", vec![2 * kvd, d], on(spec.local, LayerSlot::KvLocal)),
                ("attn.w_o.weight", vec![d, hd], whole(slot(LayerSlot::Wo))),
                ("attn.w_q.bias", vec![hd], bias(slot(LayerSlot::QBias), 0)),
                ("attn.w_kv.bias", vec![2 * kvd], bias(slot(LayerSlot::KvBias), 0)),
                // gpt-oss's: the output projection's bias, the heads' sinks
                ("attn.w_o.bias", vec![d], on(cfg.o_bias, LayerSlot::OBias)),
                ("attn.sinks", vec![cfg.n_heads], on(cfg.attn_sinks, LayerSlot::Sinks)),
                ("post_attn_norm.weight", vec![d], norm(cfg.post_norms, LayerSlot::PostAttnNorm)),
                ("mlp_norm.weight", vec![d], norm(cfg.pre_norms, LayerSlot::MlpNorm)),
                ("post_mlp_norm.weight", vec![d], norm(cfg.post_norms, LayerSlot::PostMlpNorm)),
                ("mlp.fc.weight", vec![ffn_in, d], whole(slot(LayerSlot::MlpIn))),
                ("mlp.proj.weight", vec![e * d, f], whole(slot(LayerSlot::MlpOut))),
                ("mlp.shared.fc.weight", vec![2 * fs, d], on(shared.is_some(), LayerSlot::SharedIn)),
                ("mlp.shared.proj.weight", vec![d, fs], on(shared.is_some(), LayerSlot::SharedOut)),
                ("mlp.shared.gate.weight", vec![1, d], on(shared.is_some(), LayerSlot::SharedGate)),
                ("mlp.router.weight", vec![router, d], on(moe.is_some(), LayerSlot::Router)),
                // gpt-oss's: the router's and the experts' biases, in their matrices' row order
                ("mlp.router.bias", vec![router], on(moe_bias, LayerSlot::RouterBias)),
                ("mlp.fc.bias", vec![e * 2 * f], on(moe_bias, LayerSlot::MlpInBias)),
                ("mlp.proj.bias", vec![e * d], on(moe_bias, LayerSlot::MlpOutBias)),
            ];
            for (name, shape, places) in table {
                push(&mut out, format!("blocks.{i}.{name}"), shape, places, RowOrder::AsIs);
            }
            if let Some(eg) = cfg.engram.as_ref().filter(|eg| eg.layers.contains(&i)) {
                let tables = eg.orders.iter().flat_map(|n| (0..eg.heads).map(move |j| format!("tables.{n}.{j}")));
                for (k, name) in tables.enumerate() {
                    let shape = vec![eg.table_rows, eg.dim];
                    push(
                        &mut out,
                        format!("blocks.{i}.engram.{name}"),
                        shape,
                        whole(slot(LayerSlot::EngramTable(k))),
                        RowOrder::AsIs,
                    );
                }
                let kv = |row0| vec![(slot(LayerSlot::EngramKv), row0)];
                push(&mut out, format!("blocks.{i}.engram.w_k"), vec![d, eg.width()], kv(0), RowOrder::AsIs);
                push(&mut out, format!("blocks.{i}.engram.w_v"), vec![d, eg.width()], kv(d), RowOrder::AsIs);
            }
            continue;
        }
        // how a file orders the rows of q and k (and their biases), `heads` heads of them
        let qk_order = |heads: usize| match (naming, cfg.rope_dims) {
            (_, Some(rotated)) if rotated < cfg.head_dim => RowOrder::PartialRotary { heads, rotated },
            (Naming::Gguf, _) if cfg.family.gguf_interleaves_qk() => RowOrder::Interleaved { heads },
            _ => RowOrder::AsIs,
        };
        for lt in cfg.family.layer_tensors() {
            if lt.part.moe_only().is_some_and(|m| m != moe.is_some()) {
                continue;
            }
            // a row of one naming only (gpt-oss's fused experts are Hugging Face's alone)
            if (if matches!(naming, Naming::HuggingFace(_)) { lt.hf } else { lt.gguf }).is_empty() {
                continue;
            }
            // Hugging Face names each expert's tensors (`{e}`); GGUF stacks a layer's experts
            let per_expert = lt.hf.contains("{e}") && matches!(naming, Naming::HuggingFace(_));
            for e in 0..if per_expert { experts } else { 1 } {
                let name = match naming {
                    Naming::HuggingFace(p) => format!("{p}layers.{i}.{}", lt.hf.replace("{e}", &e.to_string())),
                    _ => format!("blk.{i}.{}", lt.gguf),
                };
                // a stacked GGUF tensor holds all experts: it starts at expert 0's rows
                let (stack, e) = if per_expert { (1, e) } else { (experts, 0) };
                let (shape, places, order) = match lt.part {
                    Part::AttnNorm => (vec![d], norm(cfg.pre_norms, LayerSlot::AttnNorm), RowOrder::AsIs),
                    Part::Q => (vec![hd, d], whole(slot(LayerSlot::Wq)), qk_order(cfg.n_heads)),
                    Part::K => (vec![kvd, d], kv.iter().map(|&s| (slot(s), 0)).collect(), qk_order(cfg.n_kv_heads)),
                    Part::V => (vec![kvd, d], kv.iter().map(|&s| (slot(s), kvd)).collect(), RowOrder::AsIs),
                    Part::QNorm => (vec![q_norm_len], norm(cfg.qk_norm, LayerSlot::QNorm), RowOrder::AsIs),
                    Part::KNorm => (vec![k_norm_len], norm(cfg.qk_norm, LayerSlot::KNorm), RowOrder::AsIs),
                    Part::O => (vec![d, hd], whole(slot(LayerSlot::Wo)), RowOrder::AsIs),
                    Part::PostAttnNorm => (vec![d], norm(cfg.post_norms, LayerSlot::PostAttnNorm), RowOrder::AsIs),
                    Part::MlpNorm => (vec![d], norm(cfg.pre_norms, LayerSlot::MlpNorm), RowOrder::AsIs),
                    Part::PostMlpNorm => (vec![d], norm(cfg.post_norms, LayerSlot::PostMlpNorm), RowOrder::AsIs),
                    Part::Gate => (vec![f, d], whole(slot(LayerSlot::MlpIn)), RowOrder::AsIs),
                    Part::Up => (vec![f, d], vec![(slot(LayerSlot::MlpIn), f)], RowOrder::AsIs),
                    Part::Down => (vec![d, f], whole(slot(LayerSlot::MlpOut)), RowOrder::AsIs),
                    Part::Router => (vec![experts, d], whole(slot(LayerSlot::Router)), RowOrder::AsIs),
                    Part::ExpertGate => (vec![stack * f, d], vec![(slot(LayerSlot::MlpIn), e * f)], RowOrder::AsIs),
                    Part::ExpertUp => {
                        (vec![stack * f, d], vec![(slot(LayerSlot::MlpIn), (experts + e) * f)], RowOrder::AsIs)
                    }
                    Part::ExpertDown => (vec![stack * d, f], vec![(slot(LayerSlot::MlpOut), e * d)], RowOrder::AsIs),
                    Part::SharedGateProj | Part::SharedUpProj | Part::SharedDownProj | Part::SharedMix => {
                        let Some(fs) = moe.and_then(|m| m.shared_ffn) else { continue };
                        match lt.part {
                            Part::SharedGateProj => (vec![fs, d], whole(slot(LayerSlot::SharedIn)), RowOrder::AsIs),
                            Part::SharedUpProj => (vec![fs, d], vec![(slot(LayerSlot::SharedIn), fs)], RowOrder::AsIs),
                            Part::SharedDownProj => (vec![d, fs], whole(slot(LayerSlot::SharedOut)), RowOrder::AsIs),
                            // a matrix [1, d] (llama.cpp's converter writes it so; llama-quantize
                            // stores a vector of d, which loading and updates take as that row)
                            _ => (vec![1, d], whole(slot(LayerSlot::SharedGate)), RowOrder::AsIs),
                        }
                    }
                    Part::QBias => (vec![hd], bias(slot(LayerSlot::QBias), 0), qk_order(cfg.n_heads)),
                    Part::KBias => (vec![kvd], bias(slot(LayerSlot::KvBias), 0), qk_order(cfg.n_kv_heads)),
                    Part::VBias => (vec![kvd], bias(slot(LayerSlot::KvBias), kvd), RowOrder::AsIs),
                    Part::Qkv => {
                        // rows [q; k; v] of one tensor: q fills wq, k and v each K/V matrix
                        let (q_order, k_order) = (qk_order(cfg.n_heads), qk_order(cfg.n_kv_heads));
                        let mut places =
                            vec![Place { slot: slot(LayerSlot::Wq), row0: 0, rows: 0..hd, order: q_order }];
                        for &s in &kv {
                            places.push(Place { slot: slot(s), row0: 0, rows: hd..hd + kvd, order: k_order });
                            places.push(Place {
                                slot: slot(s),
                                row0: kvd,
                                rows: hd + kvd..hd + 2 * kvd,
                                order: RowOrder::AsIs,
                            });
                        }
                        out.push(TensorName { name, shape: vec![hd + 2 * kvd, d], places, transposed_stack: None });
                        continue;
                    }
                    Part::GateUp => (vec![2 * f, d], whole(slot(LayerSlot::MlpIn)), RowOrder::AsIs),
                    Part::OBias => {
                        let places = if cfg.o_bias { whole(slot(LayerSlot::OBias)) } else { vec![] };
                        (vec![d], places, RowOrder::AsIs)
                    }
                    Part::Sinks => {
                        let places = if cfg.attn_sinks { whole(slot(LayerSlot::Sinks)) } else { vec![] };
                        (vec![cfg.n_heads], places, RowOrder::AsIs)
                    }
                    Part::RouterBias => {
                        let places = if moe_bias { whole(slot(LayerSlot::RouterBias)) } else { vec![] };
                        (vec![experts], places, RowOrder::AsIs)
                    }
                    Part::ExpertGateBias | Part::ExpertUpBias => {
                        let row0 = if lt.part == Part::ExpertUpBias { experts * f } else { 0 };
                        let places = if moe_bias { vec![(slot(LayerSlot::MlpInBias), row0)] } else { vec![] };
                        (vec![experts * f], places, RowOrder::AsIs)
                    }
                    Part::ExpertsDownBias => {
                        let places = if moe_bias { whole(slot(LayerSlot::MlpOutBias)) } else { vec![] };
                        (vec![experts * d], places, RowOrder::AsIs)
                    }
                    Part::ExpertsGateUpT | Part::ExpertsGateUpBias | Part::ExpertsDownT => {
                        // expert e's gate j at its row 2j of 2F, up j at 2j + 1: mlp_in's rows
                        // e * F + j and (E + e) * F + j
                        let interleaved = |s: LayerSlot| -> Vec<Place> {
                            (0..experts)
                                .flat_map(|e| {
                                    [(e * f, 0), ((experts + e) * f, 1)].map(|(row0, at)| Place {
                                        slot: slot(s),
                                        row0,
                                        rows: e * 2 * f + at..e * 2 * f + at + f,
                                        order: RowOrder::Every { step: 2 },
                                    })
                                })
                                .collect()
                        };
                        let (shape, places, stack) = match lt.part {
                            Part::ExpertsGateUpT => {
                                (vec![experts * 2 * f, d], interleaved(LayerSlot::MlpIn), Some(experts))
                            }
                            Part::ExpertsDownT => {
                                let all = Place {
                                    slot: slot(LayerSlot::MlpOut),
                                    row0: 0,
                                    rows: 0..experts * d,
                                    order: RowOrder::AsIs,
                                };
                                (vec![experts * d, f], vec![all], Some(experts))
                            }
                            _ if moe_bias => (vec![experts * 2 * f], interleaved(LayerSlot::MlpInBias), None),
                            _ => continue,
                        };
                        out.push(TensorName { name, shape, places, transposed_stack: stack });
                        continue;
                    }
                };
                push(&mut out, name, shape, places, order);
            }
        }
    }
    push(&mut out, final_norm, vec![d], if has_w { whole(Slot::FinalNorm) } else { vec![] }, RowOrder::AsIs);
    if !cfg.tie_embeddings {
        push(&mut out, head, vec![cfg.vocab, d], whole(Slot::Head), RowOrder::AsIs);
    }
    out
}

/// The names a transformers 5 trainer's `state_dict()` (or `named_parameters()`) gives a mixture
/// of experts' weights where they differ from its checkpoints' ([`Naming::HuggingFace`]):
/// transformers keeps each MoE layer's experts fused in memory, and converts them to and from the
/// per-expert names of a checkpoint when it loads and saves. Under `prefix`, per MoE layer `i`:
/// - `layers.{i}.mlp.experts.gate_up_proj`, `[E, 2F, d]`: expert `e`'s gate rows then its up
///   rows (its forward `chunk(2)`s them in that order), taken as the matrix `[E * 2F, d]`;
/// - `layers.{i}.mlp.experts.down_proj`, `[E, d, F]`: the experts' down projections stacked as
///   kvdecode stacks them, the matrix `[E * d, F]`;
/// - Mixtral's router as `layers.{i}.mlp.gate.weight` (its checkpoints say `block_sparse_moe`).
///
/// Every other tensor of such a model has its checkpoint's name in memory too.
pub fn trainer_names(cfg: &ModelConfig, prefix: &str) -> Vec<TensorName> {
    let d = cfg.d_model;
    let mut out = Vec::new();
    // (gpt-oss's in-memory names are its checkpoints', whose own fused layout its table reads)
    if matches!(cfg.family, Family::Kvdecode | Family::GptOss) {
        return out;
    }
    for i in 0..cfg.layers.len() {
        let Some(moe) = cfg.layer_moe(i) else { continue };
        let (experts, f) = (moe.experts, moe.ffn);
        let slot = |s: LayerSlot| Slot::Layer(i, s);
        let name = |n: &str| format!("{prefix}layers.{i}.{n}");
        let whole =
            |s: LayerSlot, rows: usize| vec![Place { slot: slot(s), row0: 0, rows: 0..rows, order: RowOrder::AsIs }];
        let gate_up = (0..experts)
            .flat_map(|e| {
                let file = e * 2 * f;
                [(e * f, file), ((experts + e) * f, file + f)].map(|(row0, at)| Place {
                    slot: slot(LayerSlot::MlpIn),
                    row0,
                    rows: at..at + f,
                    order: RowOrder::AsIs,
                })
            })
            .collect();
        out.push(TensorName {
            name: name("mlp.experts.gate_up_proj"),
            shape: vec![experts * 2 * f, d],
            places: gate_up,
            transposed_stack: None,
        });
        out.push(TensorName {
            name: name("mlp.experts.down_proj"),
            shape: vec![experts * d, f],
            places: whole(LayerSlot::MlpOut, experts * d),
            transposed_stack: None,
        });
        if cfg.family == Family::Mixtral {
            out.push(TensorName {
                name: name("mlp.gate.weight"),
                shape: vec![experts, d],
                places: whole(LayerSlot::Router, experts),
                transposed_stack: None,
            });
        }
    }
    out
}

/// How `naming`'s norm tensors hold a norm of `cfg`: kvdecode's names hold what the config says;
/// Hugging Face's Gemma holds `w`, applied as `1 + w`; GGUF files hold the multiplier itself
/// (llama.cpp's converter adds Gemma's 1); every other family's norms multiply by `w`.
pub fn naming_norm(cfg: &ModelConfig, naming: Naming) -> NormKind {
    match naming {
        Naming::Kvdecode => cfg.norm,
        Naming::HuggingFace(_) if cfg.family.spec().hf.norm_one_plus => NormKind::OnePlusWeight,
        _ => NormKind::Weight,
    }
}

/// Rows of llama.cpp's interleaved RoPE order put back: row `i` of the result is row
/// `interleaved_source(i)` of the file's tensor.
pub fn interleaved_source(row: usize, rows: usize, heads: usize) -> usize {
    let hd = rows / heads.max(1);
    let half = hd / 2;
    let (j, i) = ((row % hd) / half.max(1), (row % hd) % half.max(1));
    (row / hd.max(1)) * hd + 2 * i + j
}
