//! Model families and the one map from a checkpoint's tensor names to the weights they fill.
//!
//! Three namings reach kvdecode: Hugging Face (`model.layers.3.self_attn.q_proj.weight`), GGUF
//! (`blk.3.attn_q.weight`) and kvdecode's own safetensors (`blocks.3.attn.w_q.weight`). The HF
//! and GGUF loaders assemble [`crate::ModelWeights`] through [`tensor_names`], and
//! [`crate::Engine::update_weights`] finds the GPU rows a name fills through the same list, so a
//! name means the same rows everywhere. A name whose rows sit inside a fused matrix (k and v in
//! `kv_global`, gate and up in `mlp_in`) fills just those rows, and a fused tensor of a file
//! (Phi-3's `qkv_proj`) fills a row range of each weight it holds ([`Place`]).
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
    /// Phi-3, 3.5 and 4-mini (Llama with fused q/k/v and gate/up tensors, partial rotary,
    /// LongRoPE).
    Phi3,
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
    /// The query, key and value projections in one tensor, `[q; k; v]` (Phi-3).
    Qkv,
    /// The gate and up projections in one tensor, `[gate; up]` (Phi-3): `mlp_in` itself.
    GateUp,
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

// Phi-3's layout: Llama's norms, q, k and v fused in one tensor, gate and up in another (GGUF
// keeps both fused; its `ffn_up` holds gate and up).
const PHI3: &[LayerTensor] = &[
    t(Part::AttnNorm, "input_layernorm.weight", "attn_norm.weight"),
    t(Part::Qkv, "self_attn.qkv_proj.weight", "attn_qkv.weight"),
    t(Part::O, "self_attn.o_proj.weight", "attn_output.weight"),
    t(Part::MlpNorm, "post_attention_layernorm.weight", "ffn_norm.weight"),
    t(Part::GateUp, "mlp.gate_up_proj.weight", "ffn_up.weight"),
    t(Part::Down, "mlp.down_proj.weight", "ffn_down.weight"),
];

/// Where Hugging Face checkpoints keep the text model's tensors: text-only checkpoints under
/// `model.`, multimodal ones under a language-model prefix.
pub const HF_PREFIXES: [&str; 3] = ["model.", "language_model.model.", "model.language_model."];

impl Family {
    /// Every family.
    pub const ALL: [Family; 9] = [
        Family::Kvdecode,
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::SmolLM3,
        Family::Gemma2,
        Family::Gemma3,
        Family::Olmo2,
        Family::Phi3,
    ];

    /// The family's per-layer tensors (empty for [`Family::Kvdecode`], which has only kvdecode's
    /// names).
    pub fn layer_tensors(self) -> &'static [LayerTensor] {
        match self {
            Family::Kvdecode => &[],
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::SmolLM3 => LLAMA,
            Family::Gemma2 | Family::Gemma3 | Family::Olmo2 => GEMMA,
            Family::Phi3 => PHI3,
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
            Family::Phi3 => Some("phi3"),
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
    // a tensor whose every row fills `places` (none: the config has no such weight)
    fn push(out: &mut Vec<TensorName>, name: String, shape: Vec<usize>, places: Vec<(Slot, usize)>, order: RowOrder) {
        let rows = 0..shape[0];
        let places: Vec<Place> =
            places.into_iter().map(|(slot, row0)| Place { slot, row0, rows: rows.clone(), order }).collect();
        if !places.is_empty() {
            out.push(TensorName { name, shape, places })
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
        if naming == Naming::Kvdecode {
            let b = format!("blocks.{i}");
            push(
                &mut out,
                format!("{b}.attn_norm.weight"),
                vec![d],
                norm(cfg.pre_norms, LayerSlot::AttnNorm),
                RowOrder::AsIs,
            );
            push(&mut out, format!("{b}.attn.w_q.weight"), vec![hd, d], whole(slot(LayerSlot::Wq)), RowOrder::AsIs);
            push(
                &mut out,
                format!("{b}.attn.q_norm.weight"),
                vec![q_norm_len],
                norm(cfg.qk_norm, LayerSlot::QNorm),
                RowOrder::AsIs,
            );
            push(
                &mut out,
                format!("{b}.attn.k_norm.weight"),
                vec![k_norm_len],
                norm(cfg.qk_norm, LayerSlot::KNorm),
                RowOrder::AsIs,
            );
            if spec.writes_global {
                push(
                    &mut out,
                    format!("{b}.attn.w_kv_global.weight"),
                    vec![2 * kvd, d],
                    whole(slot(LayerSlot::KvGlobal)),
                    RowOrder::AsIs,
                );
            }
            if spec.local {
                push(
                    &mut out,
                    format!("{b}.attn.w_kv_local.weight"),
                    vec![2 * kvd, d],
                    whole(slot(LayerSlot::KvLocal)),
                    RowOrder::AsIs,
                );
            }
            push(&mut out, format!("{b}.attn.w_o.weight"), vec![d, hd], whole(slot(LayerSlot::Wo)), RowOrder::AsIs);
            push(&mut out, format!("{b}.attn.w_q.bias"), vec![hd], bias(slot(LayerSlot::QBias), 0), RowOrder::AsIs);
            push(
                &mut out,
                format!("{b}.attn.w_kv.bias"),
                vec![2 * kvd],
                bias(slot(LayerSlot::KvBias), 0),
                RowOrder::AsIs,
            );
            push(
                &mut out,
                format!("{b}.post_attn_norm.weight"),
                vec![d],
                norm(cfg.post_norms, LayerSlot::PostAttnNorm),
                RowOrder::AsIs,
            );
            push(
                &mut out,
                format!("{b}.mlp_norm.weight"),
                vec![d],
                norm(cfg.pre_norms, LayerSlot::MlpNorm),
                RowOrder::AsIs,
            );
            push(
                &mut out,
                format!("{b}.post_mlp_norm.weight"),
                vec![d],
                norm(cfg.post_norms, LayerSlot::PostMlpNorm),
                RowOrder::AsIs,
            );
            push(
                &mut out,
                format!("{b}.mlp.fc.weight"),
                vec![cfg.mlp.in_factor() * cfg.ffn, d],
                whole(slot(LayerSlot::MlpIn)),
                RowOrder::AsIs,
            );
            push(
                &mut out,
                format!("{b}.mlp.proj.weight"),
                vec![d, cfg.ffn],
                whole(slot(LayerSlot::MlpOut)),
                RowOrder::AsIs,
            );
            if let Some(e) = cfg.engram.as_ref().filter(|e| e.layers.contains(&i)) {
                let mut k = 0;
                for n in &e.orders {
                    for j in 0..e.heads {
                        let name = format!("{b}.engram.tables.{n}.{j}");
                        push(
                            &mut out,
                            name,
                            vec![e.table_rows, e.dim],
                            whole(slot(LayerSlot::EngramTable(k))),
                            RowOrder::AsIs,
                        );
                        k += 1;
                    }
                }
                let w = e.width();
                push(
                    &mut out,
                    format!("{b}.engram.w_k"),
                    vec![d, w],
                    vec![(slot(LayerSlot::EngramKv), 0)],
                    RowOrder::AsIs,
                );
                push(
                    &mut out,
                    format!("{b}.engram.w_v"),
                    vec![d, w],
                    vec![(slot(LayerSlot::EngramKv), d)],
                    RowOrder::AsIs,
                );
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
            let name = match naming {
                Naming::HuggingFace(p) => format!("{p}layers.{i}.{}", lt.hf),
                _ => format!("blk.{i}.{}", lt.gguf),
            };
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
                Part::Gate => (vec![cfg.ffn, d], whole(slot(LayerSlot::MlpIn)), RowOrder::AsIs),
                Part::Up => (vec![cfg.ffn, d], vec![(slot(LayerSlot::MlpIn), cfg.ffn)], RowOrder::AsIs),
                Part::Down => (vec![d, cfg.ffn], whole(slot(LayerSlot::MlpOut)), RowOrder::AsIs),
                Part::QBias => (vec![hd], bias(slot(LayerSlot::QBias), 0), qk_order(cfg.n_heads)),
                Part::KBias => (vec![kvd], bias(slot(LayerSlot::KvBias), 0), qk_order(cfg.n_kv_heads)),
                Part::VBias => (vec![kvd], bias(slot(LayerSlot::KvBias), kvd), RowOrder::AsIs),
                Part::Qkv => {
                    // rows [q; k; v] of one tensor: q fills wq, k and v each K/V matrix
                    let (q_order, k_order) = (qk_order(cfg.n_heads), qk_order(cfg.n_kv_heads));
                    let mut places = vec![Place { slot: slot(LayerSlot::Wq), row0: 0, rows: 0..hd, order: q_order }];
                    for &s in &kv {
                        places.push(Place { slot: slot(s), row0: 0, rows: hd..hd + kvd, order: k_order });
                        places.push(Place {
                            slot: slot(s),
                            row0: kvd,
                            rows: hd + kvd..hd + 2 * kvd,
                            order: RowOrder::AsIs,
                        });
                    }
                    out.push(TensorName { name, shape: vec![hd + 2 * kvd, d], places });
                    continue;
                }
                Part::GateUp => (vec![2 * cfg.ffn, d], whole(slot(LayerSlot::MlpIn)), RowOrder::AsIs),
            };
            push(&mut out, name, shape, places, order);
        }
    }
    push(&mut out, final_norm, vec![d], if has_w { whole(Slot::FinalNorm) } else { vec![] }, RowOrder::AsIs);
    if !cfg.tie_embeddings {
        push(&mut out, head, vec![cfg.vocab, d], whole(Slot::Head), RowOrder::AsIs);
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
        // file row f of each place holds the slot's row g where the place's source(g) == f
        let mut file_rows: Vec<Option<(Slot, usize)>> = vec![None; t.shape[0]];
        for p in &t.places {
            for g in 0..p.rows.len() {
                file_rows[p.source(g)] = Some((p.slot, p.row0 + g));
            }
        }
        let values: Option<Vec<f32>> = match t.shape[..] {
            [_] => file_rows.iter().map(|at| at.and_then(|(slot, g)| slot_vector(slot)?.get(g).copied())).collect(),
            [_, cols] => file_rows
                .iter()
                .map(|at| at.and_then(|(slot, g)| slot_matrix(slot).map(|m| m.row(g)[..cols].to_vec())))
                .collect::<Option<Vec<_>>>()
                .map(|rows| rows.concat()),
            _ => None,
        };
        if let Some(v) = values {
            out.push((t, v));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rope::RopeScaling;

    /// Phi-3's shape: fused q/k/v and gate/up in its files, 12 of 16 dimensions rotated.
    fn phi3() -> ModelConfig {
        let mut c = ModelConfig::llama(64, 32, 2, 1, 16, 24, 2, 10000.0, 1e-6, false);
        c.rope_dims = Some(12);
        c.rope_scaling = Some(RopeScaling::LongRope {
            short: vec![1.0; 6],
            long: vec![2.0; 6],
            original_context: 8,
            attention_factor: 1.1,
        });
        c.family = Family::Phi3;
        c
    }

    #[test]
    fn partial_rotary_order_puts_the_rotated_pairs_first() {
        // one head of 8, 4 rotated: file pairs (0, 2), (1, 3) rotate, 4..8 pass through
        let order = RowOrder::PartialRotary { heads: 2, rotated: 4 };
        let src: Vec<usize> = (0..16).map(|r| order.source(r, 16)).collect();
        assert_eq!(src, [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]);
    }

    #[test]
    fn every_naming_round_trips_fused_and_reordered_rows() {
        let cfg = phi3();
        cfg.validate().unwrap();
        let w = ModelWeights::random(&cfg, 7).unwrap();
        for naming in [Naming::Kvdecode, Naming::HuggingFace("model."), Naming::Gguf] {
            let names = tensor_names(&cfg, naming);
            let values = tensors_of(&w, naming);
            assert_eq!(values.len(), names.len(), "{naming:?}: every name has its values");
            if naming != Naming::Kvdecode {
                let qkv =
                    names.iter().find(|t| t.name.ends_with("qkv_proj.weight") || t.name.ends_with("attn_qkv.weight"));
                assert_eq!(qkv.map(|t| t.places.len()), Some(3), "{naming:?}: q, k and v of one tensor");
            }
            let back = assemble(&cfg, &names, &mut |t| {
                let v = &values.iter().find(|(n, _)| n.name == t.name).unwrap().1;
                Ok(match t.shape[..] {
                    [_] => Tensor::Vector(v.clone()),
                    _ => Tensor::Matrix(Matrix::new(t.shape[0], t.shape[1], v.clone())?),
                })
            })
            .unwrap();
            assert_eq!(back, w, "{naming:?}");
        }
        // file dimension 6 pairs with 0 (rot/2 = 6 apart); kvdecode keeps it at 8 (head_dim/2 apart)
        let hf = tensors_of(&w, Naming::HuggingFace("model."));
        let qkv = &hf.iter().find(|(t, _)| t.name == "model.layers.0.self_attn.qkv_proj.weight").unwrap().1;
        assert_eq!(&qkv[6 * 32..7 * 32], w.layers[0].wq.row(8));
    }
}
