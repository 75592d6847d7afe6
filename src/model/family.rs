//! Model families and the one map from a checkpoint's tensor names to the weights they fill.
//!
//! Three namings reach kvdecode: Hugging Face (`model.layers.3.self_attn.q_proj.weight`), GGUF
//! (`blk.3.attn_q.weight`) and kvdecode's own safetensors (`blocks.3.attn.w_q.weight`). The HF
//! and GGUF loaders assemble [`crate::ModelWeights`] through [`tensor_names`], and
//! [`crate::Engine::update_weights`] finds the GPU rows a name fills through the same list, so a
//! name means the same rows everywhere. A name whose rows sit inside a fused matrix (k and v in
//! `kv_global`, gate and up in `mlp_in`) fills just those rows.
//!
//! A family is its per-layer table ([`Family::layer_tensors`]): what each tensor fills, under its
//! Hugging Face and its GGUF name. Adding a family means a table here and its config reading.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::config::{ModelConfig, NormKind};
use crate::model::weights::{EngramWeights, LayerWeights, Matrix, ModelWeights};

/// The architecture a model came from: it decides the Hugging Face and GGUF names of its tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Family {
    /// kvdecode's own layouts (TinyAgent, the demo model, Engram): only kvdecode's names.
    #[default]
    Kvdecode,
    /// Llama, SmolLM, Mistral-style dense models.
    Llama,
    /// Qwen3 (qk-norm with weights).
    Qwen3,
    /// Gemma 3 text (local/global layers, four norms per layer, `1 + w` norms).
    Gemma3,
    /// Qwen2 and Qwen2.5 (Llama with q/k/v biases).
    Qwen2,
    /// SmolLM3 (Llama's tensors, NoPE layers).
    SmolLM3,
    /// Gemma 2 (Gemma 3's tensors less the qk-norms; attention-logit softcap).
    Gemma2,
    /// OLMo 2 (norms on the attention's and the MLP's outputs only, qk-norm over the whole
    /// projection).
    Olmo2,
}

/// What one per-layer tensor of a checkpoint fills (the rows of a fused matrix, or a whole
/// weight).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// Norm before attention.
    AttnNorm,
    /// Query projection.
    Q,
    /// Key projection: the first half of the layer's K/V matrices.
    K,
    /// Value projection: their second half.
    V,
    /// qk-norm of the queries.
    QNorm,
    /// qk-norm of the keys.
    KNorm,
    /// Output projection.
    O,
    /// Norm of the attention output (Gemma).
    PostAttnNorm,
    /// Norm before the MLP.
    MlpNorm,
    /// Norm of the MLP output (Gemma).
    PostMlpNorm,
    /// Gate projection: the first half of `mlp_in`.
    Gate,
    /// Up projection: its second half.
    Up,
    /// Down projection.
    Down,
    /// Bias of the query projection.
    QBias,
    /// Bias of the key projection: the first half of the K/V bias.
    KBias,
    /// Bias of the value projection: its second half.
    VBias,
}

/// One row of a family's table: what a per-layer tensor fills, its Hugging Face name after
/// `model.layers.{i}.` and its GGUF name after `blk.{i}.`.
pub struct LayerTensor {
    /// What it fills.
    pub part: Part,
    /// Hugging Face name within the layer.
    pub hf: &'static str,
    /// GGUF name within the layer.
    pub gguf: &'static str,
}

const fn t(part: Part, hf: &'static str, gguf: &'static str) -> LayerTensor {
    LayerTensor { part, hf, gguf }
}

// Llama's layout: `post_attention_layernorm` is the MLP's input norm. Qwen3's qk-norms and
// Qwen2's biases are rows here too; `tensor_names` lists a row only where the config has that
// weight (`qk_norm`, `qkv_bias`), so one table serves Llama, Qwen2, Qwen3 and SmolLM3.
const LLAMA: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Q, "self_attn.q_proj.weight", "attn_q.weight"),
    t(Part::K, "self_attn.k_proj.weight", "attn_k.weight"),
    t(Part::V, "self_attn.v_proj.weight", "attn_v.weight"),
    t(Part::QBias, "self_attn.q_proj.bias", "attn_q.bias"),
    t(Part::KBias, "self_attn.k_proj.bias", "attn_k.bias"),
    t(Part::VBias, "self_attn.v_proj.bias", "attn_v.bias"),
    t(Part::QNorm, "self_attn.q_norm.weight", "attn_q_norm.weight"),
    t(Part::KNorm, "self_attn.k_norm.weight", "attn_k_norm.weight"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::MlpNorm, "post_attention_layernorm.weight", "ffn_norm.weight"),
    t(Part::Gate, "mlp.gate_proj.weight", "ffn_gate.weight"),
    t(Part::Up, "mlp.up_proj.weight", "ffn_up.weight"),
    t(Part::Down, "mlp.down_proj.weight", "ffn_down.weight"),
];

// Gemma's layout: `post_attention_layernorm` is the norm of the attention output, not the MLP's
// input. Gemma 2 lists no qk-norm rows (`qk_norm` is off) and OLMo 2 no input norms
// (`pre_norms` is off), so one table serves Gemma 2, Gemma 3 and OLMo 2.
const GEMMA: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Q, "self_attn.q_proj.weight", "attn_q.weight"),
    t(Part::K, "self_attn.k_proj.weight", "attn_k.weight"),
    t(Part::V, "self_attn.v_proj.weight", "attn_v.weight"),
    t(Part::QNorm, "self_attn.q_norm.weight", "attn_q_norm.weight"),
    t(Part::KNorm, "self_attn.k_norm.weight", "attn_k_norm.weight"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::PostAttnNorm, "post_attention_layernorm.weight", "post_attention_norm.weight"),
    t(Part::MlpNorm, "pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    t(Part::PostMlpNorm, "post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    t(Part::Gate, "mlp.gate_proj.weight", "ffn_gate.weight"),
    t(Part::Up, "mlp.up_proj.weight", "ffn_up.weight"),
    t(Part::Down, "mlp.down_proj.weight", "ffn_down.weight"),
];

/// Where Hugging Face checkpoints keep the text model's tensors: text-only checkpoints under
/// `model.`, multimodal ones under a language-model prefix.
pub const HF_PREFIXES: [&str; 3] = ["model.", "language_model.model.", "model.language_model."];

impl Family {
    /// Every family.
    pub const ALL: [Family; 8] = [
        Family::Kvdecode,
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::SmolLM3,
        Family::Gemma2,
        Family::Gemma3,
        Family::Olmo2,
    ];

    /// The family's per-layer tensors (empty for [`Family::Kvdecode`], which has only kvdecode's
    /// names).
    pub fn layer_tensors(self) -> &'static [LayerTensor] {
        match self {
            Family::Kvdecode => &[],
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::SmolLM3 => LLAMA,
            Family::Gemma2 | Family::Gemma3 | Family::Olmo2 => GEMMA,
        }
    }

    /// `general.architecture` in GGUF files.
    pub fn gguf_arch(self) -> Option<&'static str> {
        match self {
            Family::Kvdecode => None,
            Family::Llama => Some("llama"),
            Family::Qwen3 => Some("qwen3"),
            Family::Gemma3 => Some("gemma3"),
            Family::Qwen2 => Some("qwen2"),
            Family::SmolLM3 => Some("smollm3"),
            Family::Gemma2 => Some("gemma2"),
            Family::Olmo2 => Some("olmo2"),
        }
    }

    /// The family of a GGUF `general.architecture`.
    pub fn from_gguf_arch(arch: &str) -> Option<Self> {
        Family::ALL.into_iter().find(|f| f.gguf_arch() == Some(arch))
    }

    /// llama.cpp's converter stores this family's Q and K rows interleaved for its RoPE.
    fn gguf_interleaves_qk(self) -> bool {
        matches!(self, Family::Llama | Family::SmolLM3)
    }
}

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
}

/// One named tensor of a checkpoint and the rows it fills (a vector's elements are its rows).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorName {
    /// The name in the file.
    pub name: String,
    /// `[rows, cols]` of a matrix, `[n]` of a vector.
    pub shape: Vec<usize>,
    /// Rows `row0 .. row0 + shape[0]` of each slot.
    pub places: Vec<(Slot, usize)>,
    /// How the rows are ordered in the file.
    pub order: RowOrder,
}

/// The namings kvdecode reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// kvdecode's safetensors (`blocks.{i}.attn.w_q.weight`, fused K/V and MLP input).
    Kvdecode,
    /// Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`), with this prefix for the text
    /// model (one of [`HF_PREFIXES`]).
    HuggingFace(&'static str),
    /// GGUF (`blk.{i}.attn_q.weight`).
    Gguf,
}

/// Every tensor of `cfg`'s weights under `naming`, in load order (empty when the family has no
/// such names, as kvdecode's own layouts have no Hugging Face or GGUF names).
pub fn tensor_names(cfg: &ModelConfig, naming: Naming) -> Vec<TensorName> {
    let (d, hd, kvd) = (cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
    let has_w = cfg.norm != NormKind::Plain;
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, places: Vec<(Slot, usize)>, order: RowOrder| {
        if !places.is_empty() {
            out.push(TensorName { name, shape, places, order })
        }
    };
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
    push(embed, vec![cfg.vocab, d], whole(Slot::Embed), RowOrder::AsIs);
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
        if naming == Naming::Kvdecode {
            let b = format!("blocks.{i}");
            push(format!("{b}.attn_norm.weight"), vec![d], norm(cfg.pre_norms, LayerSlot::AttnNorm), RowOrder::AsIs);
            push(format!("{b}.attn.w_q.weight"), vec![hd, d], whole(slot(LayerSlot::Wq)), RowOrder::AsIs);
            push(
                format!("{b}.attn.q_norm.weight"),
                vec![q_norm_len],
                norm(cfg.qk_norm, LayerSlot::QNorm),
                RowOrder::AsIs,
            );
            push(
                format!("{b}.attn.k_norm.weight"),
                vec![k_norm_len],
                norm(cfg.qk_norm, LayerSlot::KNorm),
                RowOrder::AsIs,
            );
            if spec.writes_global {
                push(
                    format!("{b}.attn.w_kv_global.weight"),
                    vec![2 * kvd, d],
                    whole(slot(LayerSlot::KvGlobal)),
                    RowOrder::AsIs,
                );
            }
            if spec.local {
                push(
                    format!("{b}.attn.w_kv_local.weight"),
                    vec![2 * kvd, d],
                    whole(slot(LayerSlot::KvLocal)),
                    RowOrder::AsIs,
                );
            }
            push(format!("{b}.attn.w_o.weight"), vec![d, hd], whole(slot(LayerSlot::Wo)), RowOrder::AsIs);
            push(format!("{b}.attn.w_q.bias"), vec![hd], bias(slot(LayerSlot::QBias), 0), RowOrder::AsIs);
            push(format!("{b}.attn.w_kv.bias"), vec![2 * kvd], bias(slot(LayerSlot::KvBias), 0), RowOrder::AsIs);
            push(
                format!("{b}.post_attn_norm.weight"),
                vec![d],
                norm(cfg.post_norms, LayerSlot::PostAttnNorm),
                RowOrder::AsIs,
            );
            push(format!("{b}.mlp_norm.weight"), vec![d], norm(cfg.pre_norms, LayerSlot::MlpNorm), RowOrder::AsIs);
            push(
                format!("{b}.post_mlp_norm.weight"),
                vec![d],
                norm(cfg.post_norms, LayerSlot::PostMlpNorm),
                RowOrder::AsIs,
            );
            push(
                format!("{b}.mlp.fc.weight"),
                vec![cfg.mlp.in_factor() * cfg.ffn, d],
                whole(slot(LayerSlot::MlpIn)),
                RowOrder::AsIs,
            );
            push(format!("{b}.mlp.proj.weight"), vec![d, cfg.ffn], whole(slot(LayerSlot::MlpOut)), RowOrder::AsIs);
            if let Some(e) = cfg.engram.as_ref().filter(|e| e.layers.contains(&i)) {
                let mut k = 0;
                for n in &e.orders {
                    for j in 0..e.heads {
                        let name = format!("{b}.engram.tables.{n}.{j}");
                        push(name, vec![e.table_rows, e.dim], whole(slot(LayerSlot::EngramTable(k))), RowOrder::AsIs);
                        k += 1;
                    }
                }
                let w = e.width();
                push(format!("{b}.engram.w_k"), vec![d, w], vec![(slot(LayerSlot::EngramKv), 0)], RowOrder::AsIs);
                push(format!("{b}.engram.w_v"), vec![d, w], vec![(slot(LayerSlot::EngramKv), d)], RowOrder::AsIs);
            }
            continue;
        }
        let interleaved = |heads: usize| match naming {
            Naming::Gguf if cfg.family.gguf_interleaves_qk() => RowOrder::Interleaved { heads },
            _ => RowOrder::AsIs,
        };
        for lt in cfg.family.layer_tensors() {
            let name = match naming {
                Naming::HuggingFace(p) => format!("{p}layers.{i}.{}", lt.hf),
                _ => format!("blk.{i}.{}", lt.gguf),
            };
            let (shape, places, order) = match lt.part {
                Part::AttnNorm => (vec![d], norm(cfg.pre_norms, LayerSlot::AttnNorm), RowOrder::AsIs),
                Part::Q => (vec![hd, d], whole(slot(LayerSlot::Wq)), interleaved(cfg.n_heads)),
                Part::K => (vec![kvd, d], kv.iter().map(|&s| (slot(s), 0)).collect(), interleaved(cfg.n_kv_heads)),
                Part::V => (vec![kvd, d], kv.iter().map(|&s| (slot(s), kvd)).collect(), RowOrder::AsIs),
                Part::QNorm => (vec![q_norm_len], norm(cfg.qk_norm, LayerSlot::QNorm), RowOrder::AsIs),
                Part::KNorm => (vec![k_norm_len], norm(cfg.qk_norm, LayerSlot::KNorm), RowOrder::AsIs),
                Part::O => (vec![d, hd], whole(slot(LayerSlot::Wo)), RowOrder::AsIs),
                Part::PostAttnNorm => (vec![d], norm(cfg.post_norms, LayerSlot::PostAttnNorm), RowOrder::AsIs),
                Part::MlpNorm => (vec![d], norm(cfg.pre_norms, LayerSlot::MlpNorm), RowOrder::AsIs),
                Part::PostMlpNorm => (vec![d], norm(cfg.post_norms, LayerSlot::PostMlpNorm), RowOrder::AsIs),
                Part::Gate => (vec![cfg.ffn, d], whole(slot(LayerSlot::MlpIn)), RowOrder::AsIs),
                Part::Up => (vec![cfg.ffn, d], vec![(slot(LayerSlot::MlpIn), cfg.ffn)], RowOrder::AsIs),
                Part::Down => (vec![d, cfg.ffn], whole(slot(LayerSlot::MlpOut)), RowOrder::AsIs),
                Part::QBias => (vec![hd], bias(slot(LayerSlot::QBias), 0), interleaved(cfg.n_heads)),
                Part::KBias => (vec![kvd], bias(slot(LayerSlot::KvBias), 0), interleaved(cfg.n_kv_heads)),
                Part::VBias => (vec![kvd], bias(slot(LayerSlot::KvBias), kvd), RowOrder::AsIs),
            };
            push(name, shape, places, order);
        }
    }
    push(final_norm, vec![d], if has_w { whole(Slot::FinalNorm) } else { vec![] }, RowOrder::AsIs);
    if !cfg.tie_embeddings {
        push(head, vec![cfg.vocab, d], whole(Slot::Head), RowOrder::AsIs);
    }
    out
}

/// How `naming`'s norm tensors hold a norm of `cfg`: kvdecode's names hold what the config says;
/// Hugging Face's Gemma holds `w`, applied as `1 + w`; GGUF files hold the multiplier itself
/// (llama.cpp's converter adds Gemma's 1); every other family's norms multiply by `w`.
pub fn naming_norm(cfg: &ModelConfig, naming: Naming) -> NormKind {
    match naming {
        Naming::Kvdecode => cfg.norm,
        Naming::HuggingFace(_) if matches!(cfg.family, Family::Gemma3 | Family::Gemma2) => NormKind::OnePlusWeight,
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

/// A tensor as a checkpoint reader returns it.
pub enum Tensor {
    /// A matrix (quantized blocks and 16-bit types kept as the file has them).
    Matrix(Matrix),
    /// A vector, in f32.
    Vector(Vec<f32>),
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
                let m = match t.order {
                    RowOrder::AsIs => m,
                    RowOrder::Interleaved { heads } => {
                        m.permute_rows(&(0..m.rows).map(|r| interleaved_source(r, m.rows, heads)).collect::<Vec<_>>())
                    }
                };
                for &(slot, row0) in &t.places {
                    mats.entry(slot).or_default().push((row0, m.clone()));
                }
            }
            Tensor::Vector(v) => {
                let v = match t.order {
                    RowOrder::AsIs => v,
                    RowOrder::Interleaved { heads } => {
                        (0..v.len()).map(|r| v[interleaved_source(r, v.len(), heads)]).collect()
                    }
                };
                for &(slot, row0) in &t.places {
                    vec_parts.entry(slot).or_default().push((row0, v.clone()));
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
            post_attn_norm: vecs.remove(&s(LayerSlot::PostAttnNorm)),
            mlp_norm: vecs.remove(&s(LayerSlot::MlpNorm)),
            post_mlp_norm: vecs.remove(&s(LayerSlot::PostMlpNorm)),
            mlp_in: need(&mut mats, s(LayerSlot::MlpIn))?,
            mlp_out: need(&mut mats, s(LayerSlot::MlpOut))?,
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
/// f32 (dequantized), rows in the file's order. What a checkpoint in that naming would hold, for
/// tests and for pushing weights from one engine's model into another.
pub fn tensors_of(w: &ModelWeights, naming: Naming) -> Vec<(TensorName, Vec<f32>)> {
    let slot_matrix = |slot: Slot| -> Option<&Matrix> {
        let Slot::Layer(i, s) = slot else {
            return match slot {
                Slot::Embed => Some(&w.embed),
                Slot::Head => w.head.as_ref(),
                _ => None,
            };
        };
        let l = w.layers.get(i)?;
        match s {
            LayerSlot::Wq => Some(&l.wq),
            LayerSlot::KvGlobal => l.kv_global.as_ref(),
            LayerSlot::KvLocal => l.kv_local.as_ref(),
            LayerSlot::Wo => Some(&l.wo),
            LayerSlot::MlpIn => Some(&l.mlp_in),
            LayerSlot::MlpOut => Some(&l.mlp_out),
            LayerSlot::EngramKv => l.engram.as_ref().map(|e| &e.w_kv),
            LayerSlot::EngramTable(k) => l.engram.as_ref().and_then(|e| e.tables.get(k)),
            _ => None,
        }
    };
    let slot_vector = |slot: Slot| -> Option<&Vec<f32>> {
        let Slot::Layer(i, s) = slot else { return w.final_norm.as_ref() };
        let l = w.layers.get(i)?;
        match s {
            LayerSlot::AttnNorm => l.attn_norm.as_ref(),
            LayerSlot::QNorm => l.q_norm.as_ref(),
            LayerSlot::KNorm => l.k_norm.as_ref(),
            LayerSlot::PostAttnNorm => l.post_attn_norm.as_ref(),
            LayerSlot::MlpNorm => l.mlp_norm.as_ref(),
            LayerSlot::PostMlpNorm => l.post_mlp_norm.as_ref(),
            LayerSlot::QBias => l.q_bias.as_ref(),
            LayerSlot::KvBias => l.kv_bias.as_ref(),
            _ => None,
        }
    };
    let mut out = Vec::new();
    for t in tensor_names(&w.cfg, naming) {
        let (slot, row0) = t.places[0];
        let values = match t.shape[..] {
            [n] => slot_vector(slot).and_then(|v| v.get(row0..row0 + n)).map(|v| {
                let mut from = (0..n).collect::<Vec<_>>();
                if let RowOrder::Interleaved { heads } = t.order {
                    for g in 0..n {
                        from[interleaved_source(g, n, heads)] = g;
                    }
                }
                from.iter().map(|&g| v[g]).collect()
            }),
            [rows, cols] => slot_matrix(slot).map(|m| {
                // file row f holds model row g where interleaved_source(g) == f
                let mut from = (0..rows).collect::<Vec<_>>();
                if let RowOrder::Interleaved { heads } = t.order {
                    for g in 0..rows {
                        from[interleaved_source(g, rows, heads)] = g;
                    }
                }
                from.iter().flat_map(|&g| m.row(row0 + g)[..cols].iter().copied()).collect()
            }),
            _ => None,
        };
        if let Some(v) = values {
            out.push((t, v));
        }
    }
    out
}
