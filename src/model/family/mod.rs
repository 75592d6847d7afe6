//! Model families, each in a file of its own, and the one map from a checkpoint's tensor names to
//! the weights they fill.
//!
//! Three namings reach kvdecode: Hugging Face (`model.layers.3.self_attn.q_proj.weight`), GGUF
//! (`blk.3.attn_q.weight`) and kvdecode's own safetensors (`blocks.3.attn.w_q.weight`). Loading
//! a file (onto the GPU, or into [`crate::ModelWeights`] for the CPU reference) and
//! [`crate::Engine::update_weights`] find the rows a name fills through the same list
//! ([`tensor_names`]), and the same [`WeightPlan`] says what each weight is before its values are
//! read, so a name means the same rows everywhere. A name whose rows sit inside a fused matrix (k and v in
//! `kv_global`, gate and up in `mlp_in`) fills just those rows, and a fused tensor of a file
//! (Phi-3's `qkv_proj`) fills a row range of each weight it holds ([`Place`]).
//!
//! A family is one file (`llama.rs`, `gemma.rs`, `qwen3_moe.rs`, ...) holding its [`Spec`]: its
//! `model_type`s and GGUF architecture, its per-layer table ([`Family::layer_tensors`]: what each
//! tensor fills, under its Hugging Face and its GGUF name), and how it reads a config: which keys
//! it takes, the defaults of its config class, its numerics switches. The readers (`io/hf.rs`,
//! `io/gguf/config.rs`) find the keys and hand them over ([`HfKeys`], [`GgufKeys`]); they decide
//! no family's numerics. Adding a family means one file here, its variant in [`Family`] (and
//! `Family::ALL`), its line in [`Family::spec`], and its fixtures.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::model::config::ModelConfig;

mod gemma;
mod gpt_oss;
mod keys;
mod kvdecode;
mod llama;
mod mixtral;
mod names;
mod olmo2;
mod olmoe;
mod phi3;
mod plan;
mod qwen2;
mod qwen2_moe;
mod qwen3;
mod qwen3_moe;
mod smollm3;
pub use keys::{GgufKeys, HfKeys, RopeRead};
pub use names::{
    interleaved_source, naming_norm, tensor_names, trainer_names, LayerSlot, Naming, Place, RowOrder, Slot, TensorName,
};
pub(crate) use plan::{conform, stream, FileTensor};
pub use plan::{tensors_of, transpose_stack, SlotPlan, Stored, WeightPlan};

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
    /// Qwen3-MoE (Qwen3's attention; routed experts, dense layers among them where the config
    /// says).
    Qwen3Moe,
    /// OLMoE (Llama's norms, qk-norm over the whole projection, routed experts on every layer).
    Olmoe,
    /// Mixtral (Mistral's attention, routed experts on every layer under `block_sparse_moe`).
    Mixtral,
    /// Qwen2-MoE (Qwen2's attention with q/k/v biases; routed experts and a shared one).
    Qwen2Moe,
    /// gpt-oss (attention sinks, biases on q/k/v/o, the router and the experts, the clamped
    /// SwiGLU, sliding and full layers alternating; experts stored fused and transposed).
    GptOss,
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
    /// A MoE layer's router, `[experts, d]`.
    Router,
    /// Expert `{e}`'s gate projection: rows `e * F ..` of the layer's stacked `mlp_in`.
    ExpertGate,
    /// Expert `{e}`'s up projection: rows `(experts + e) * F ..` of `mlp_in`.
    ExpertUp,
    /// Expert `{e}`'s down projection: rows `e * d ..` of the stacked `mlp_out`.
    ExpertDown,
    /// The shared expert's gate projection: the first half of its `mlp_in`.
    SharedGateProj,
    /// The shared expert's up projection: the second half.
    SharedUpProj,
    /// The shared expert's down projection.
    SharedDownProj,
    /// The shared expert's sigmoid gate, `[1, d]`.
    SharedMix,
    /// Bias of the output projection (gpt-oss).
    OBias,
    /// Each query head's attention sink (gpt-oss).
    Sinks,
    /// Bias of the router (gpt-oss).
    RouterBias,
    /// All experts' gate and up projections in one tensor as gpt-oss stores them: `[E, d, 2F]`,
    /// each expert's transposed (`x @ W`), gate and up interleaved (gate `j` at column `2j`, up
    /// `j` at `2j + 1`).
    ExpertsGateUpT,
    /// Their biases, `[E, 2F]`, interleaved as the columns.
    ExpertsGateUpBias,
    /// All experts' down projections, `[E, F, d]`, each transposed.
    ExpertsDownT,
    /// Their biases, `[E, d]`.
    ExpertsDownBias,
    /// The stacked experts' gate biases, `[E, F]` (GGUF's gpt-oss).
    ExpertGateBias,
    /// Their up biases.
    ExpertUpBias,
}

impl Part {
    /// Whether a MoE layer has this tensor and a dense one does not (the router and experts), or
    /// the reverse (the dense MLP's), or both have it (`None`).
    fn moe_only(self) -> Option<bool> {
        match self {
            Part::Router
            | Part::ExpertGate
            | Part::ExpertUp
            | Part::ExpertDown
            | Part::SharedGateProj
            | Part::SharedUpProj
            | Part::SharedDownProj
            | Part::SharedMix
            | Part::RouterBias
            | Part::ExpertsGateUpT
            | Part::ExpertsGateUpBias
            | Part::ExpertsDownT
            | Part::ExpertsDownBias
            | Part::ExpertGateBias
            | Part::ExpertUpBias => Some(true),
            Part::Gate | Part::Up | Part::Down | Part::GateUp => Some(false),
            _ => None,
        }
    }
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

/// Where Hugging Face checkpoints keep the text model's tensors: text-only checkpoints under
/// `model.`, multimodal ones under a language-model prefix.
pub const HF_PREFIXES: [&str; 3] = ["model.", "language_model.model.", "model.language_model."];

impl Family {
    /// Every family.
    pub const ALL: [Family; 14] = [
        Family::Kvdecode,
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::SmolLM3,
        Family::Gemma2,
        Family::Gemma3,
        Family::Olmo2,
        Family::Phi3,
        Family::Qwen3Moe,
        Family::Olmoe,
        Family::Mixtral,
        Family::Qwen2Moe,
        Family::GptOss,
    ];

    /// The family's file: its names, table and config reading.
    pub fn spec(self) -> &'static Spec {
        match self {
            Family::Kvdecode => &kvdecode::SPEC,
            Family::Llama => &llama::SPEC,
            Family::Qwen2 => &qwen2::SPEC,
            Family::Qwen3 => &qwen3::SPEC,
            Family::SmolLM3 => &smollm3::SPEC,
            Family::Gemma2 => &gemma::GEMMA2,
            Family::Gemma3 => &gemma::GEMMA3,
            Family::Olmo2 => &olmo2::SPEC,
            Family::Phi3 => &phi3::SPEC,
            Family::Qwen3Moe => &qwen3_moe::SPEC,
            Family::Olmoe => &olmoe::SPEC,
            Family::Mixtral => &mixtral::SPEC,
            Family::Qwen2Moe => &qwen2_moe::SPEC,
            Family::GptOss => &gpt_oss::SPEC,
        }
    }

    /// The family's per-layer tensors (none for [`Family::Kvdecode`], which has only kvdecode's
    /// names): its table, and a mixture of experts' rows after it.
    pub fn layer_tensors(self) -> impl Iterator<Item = &'static LayerTensor> {
        let spec = self.spec();
        spec.table.iter().chain(spec.experts)
    }

    /// `general.architecture` in GGUF files (none for Mixtral, which llama.cpp writes as `llama`
    /// with experts).
    pub fn gguf_arch(self) -> Option<&'static str> {
        self.spec().gguf_arch
    }

    /// The family of a GGUF `general.architecture`.
    pub fn from_gguf_arch(arch: &str) -> Option<Self> {
        Family::ALL.into_iter().find(|f| f.gguf_arch() == Some(arch))
    }

    /// The family of a Hugging Face `model_type`, with that type's config class.
    pub fn from_hf_type(model_type: &str) -> Option<(Self, &'static HfType)> {
        Family::ALL.into_iter().find_map(|f| f.spec().hf_types.iter().find(|t| t.name == model_type).map(|t| (f, t)))
    }

    /// Every supported `model_type`, for messages.
    pub fn hf_type_names() -> Vec<&'static str> {
        Family::ALL.into_iter().flat_map(|f| f.spec().hf_types.iter().map(|t| t.name)).collect()
    }

    /// Every supported GGUF architecture, for messages.
    pub fn gguf_arch_names() -> Vec<&'static str> {
        Family::ALL.into_iter().filter_map(Family::gguf_arch).collect()
    }

    /// llama.cpp's converter stores this family's Q and K rows interleaved for its RoPE.
    fn gguf_interleaves_qk(self) -> bool {
        self.spec().gguf.interleaves_qk
    }
}

/// A family's file (`model/family/{name}.rs`): its names in each format, its tensor table, and how
/// it reads a config, its numerics switches and defaults.
pub struct Spec {
    /// The family.
    pub family: Family,
    /// Its Hugging Face `model_type`s.
    pub hf_types: &'static [HfType],
    /// Its GGUF `general.architecture`.
    pub gguf_arch: Option<&'static str>,
    /// Its per-layer tensors.
    pub table: &'static [LayerTensor],
    /// A mixture of experts' rows, after the table's.
    pub experts: &'static [LayerTensor],
    /// Facts of its Hugging Face configs and checkpoints.
    pub hf: HfFacts,
    /// Facts of its GGUF files.
    pub gguf: GgufFacts,
    /// The rest of its config from a `config.json`, after the reader has set the dimensions, the
    /// norm's epsilon, tying and the trained context: the layer plan, RoPE, the numerics switches,
    /// the experts, the activation.
    pub from_hf: fn(&mut ModelConfig, &dyn HfKeys) -> Result<()>,
    /// The same from GGUF metadata, after the reader has set the dimensions, RoPE and the context.
    pub from_gguf: fn(&mut ModelConfig, &dyn GgufKeys) -> Result<()>,
}

/// A Hugging Face `model_type` of a family, with what its config class takes for a key the
/// config.json leaves out (`None`: the class derives it: hidden / heads, as many as the heads).
/// Qwen3's and Gemma's classes default head_dim to 128 and 256 whatever the hidden size, so hidden
/// / heads would read a different model than transformers does.
pub struct HfType {
    /// The `model_type`.
    pub name: &'static str,
    /// The key under which its text model's config sits (Gemma 3's multimodal `text_config`).
    pub nested: Option<&'static str>,
    /// `head_dim` where left out.
    pub head_dim: Option<usize>,
    /// `num_key_value_heads` where left out.
    pub kv_heads: Option<usize>,
}

impl HfType {
    /// A type whose class derives what is left out.
    pub const fn plain(name: &'static str) -> HfType {
        HfType { name, nested: None, head_dim: None, kv_heads: None }
    }
}

/// What a family's Hugging Face configs and checkpoints hold.
pub struct HfFacts {
    /// `rms_norm_eps` where left out.
    pub eps: f32,
    /// `tie_word_embeddings` where left out.
    pub tied: bool,
    /// Its norm tensors hold `w`, applied as `1 + w` (Gemma).
    pub norm_one_plus: bool,
    /// The one `quantization_config.quant_method` it reads (gpt-oss's MXFP4 experts).
    pub quant: Option<&'static str>,
    /// Whether `attention_bias` is its own key, read by its file (elsewhere `true` is refused).
    pub attention_bias: bool,
}

impl HfFacts {
    /// Llama's: epsilon 1e-6, untied, norms of `w`, nothing quantized, no attention biases.
    pub const PLAIN: HfFacts =
        HfFacts { eps: 1e-6, tied: false, norm_one_plus: false, quant: None, attention_bias: false };
}

/// What a family's GGUF files hold.
pub struct GgufFacts {
    /// llama.cpp's converter stores Q and K rows interleaved for its RoPE.
    pub interleaves_qk: bool,
    /// `rope.dimension_count` is the rotated part of a head, not its size (Phi-3).
    pub partial_rotary: bool,
    /// Tensors every layer has at least (a block count the file's table cannot back is a lie).
    pub layer_tensors: usize,
}

impl GgufFacts {
    /// Llama's: Q and K as they are, whole heads rotated, at least 9 tensors a layer.
    pub const PLAIN: GgufFacts = GgufFacts { interleaves_qk: false, partial_rotary: false, layer_tensors: 9 };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;
    use crate::model::rope::RopeScaling;
    use crate::model::weights::ModelWeights;

    /// `w`'s tensors under each naming, as a file of it holds them (`tensors_of`), loaded back
    /// into `w` through the loaders' plan and writer: every name has its values and every value
    /// its place.
    fn round_trips(w: &ModelWeights, namings: &[Naming]) {
        for &naming in namings {
            let names = tensor_names(&w.cfg, naming);
            let values = tensors_of(w, naming);
            assert_eq!(values.len(), names.len(), "{naming:?}: every name has its values");
            let mut plan = WeightPlan::from_names(&w.cfg, &names, &mut |_| Ok(Stored::Values)).unwrap();
            plan.cid_map = w.cid_map.clone();
            let mut back = ModelWeights::zeroed(&plan).unwrap();
            let norm = naming_norm(&w.cfg, naming);
            let find = &mut |t: &TensorName| {
                let (spec, v) = values.iter().find(|(n, _)| n.name == t.name).unwrap();
                let bytes = bytemuck::cast_slice::<f32, u8>(v).to_vec();
                Ok(FileTensor::Made(spec.name.clone(), spec.file_shape(), crate::model::tensor::HostDtype::F32, bytes))
            };
            stream(&names, find, &mut |p, t| back.write_place(p, norm, t), &mut |_, _| {}).unwrap();
            back.check().unwrap();
            assert_eq!(&back, w, "{naming:?}");
        }
    }

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
    fn every_family_file_is_its_own_and_its_names_lead_to_it() {
        // (a swapped line in Family::spec would read one family's config by another's file)
        for f in Family::ALL {
            assert_eq!(f.spec().family, f);
            for t in f.spec().hf_types {
                assert_eq!(Family::from_hf_type(t.name).map(|(g, _)| g), Some(f), "{}", t.name);
            }
            if let Some(arch) = f.gguf_arch() {
                assert_eq!(Family::from_gguf_arch(arch), Some(f), "{arch}");
            }
        }
        assert_eq!(Family::hf_type_names().len(), 15);
    }

    #[test]
    fn partial_rotary_order_puts_the_rotated_pairs_first() {
        // one head of 8, 4 rotated: file pairs (0, 2), (1, 3) rotate, 4..8 pass through
        let order = RowOrder::PartialRotary { heads: 2, rotated: 4 };
        let src: Vec<usize> = (0..16).map(|r| order.source(r, 16)).collect();
        assert_eq!(src, [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]);
    }

    /// Qwen2-MoE's shape: 4 experts of 8 and a shared expert of 12 on layers 0 and 2, a dense
    /// layer between, q/k/v biases.
    fn qwen2_moe() -> ModelConfig {
        let mut c = ModelConfig::llama(64, 32, 2, 1, 16, 24, 3, 10000.0, 1e-6, false);
        c.qkv_bias = true;
        c.moe = Some(crate::model::config::MoeConfig {
            experts: 4,
            top_k: 2,
            ffn: 8,
            layers: vec![0, 2],
            norm_topk: true,
            shared_ffn: Some(12),
            bias: false,
        });
        c.family = Family::Qwen2Moe;
        c
    }

    #[test]
    fn a_moe_model_round_trips_per_expert_and_stacked_names() {
        let cfg = qwen2_moe();
        let w = ModelWeights::random(&cfg, 7).unwrap();
        round_trips(&w, &[Naming::Kvdecode, Naming::HuggingFace("model."), Naming::Gguf]);
        // expert 3's up projection of layer 2 is rows (4 + 3) * 8 .. of its stacked mlp_in
        let hf = tensors_of(&w, Naming::HuggingFace("model."));
        let up = &hf.iter().find(|(t, _)| t.name == "model.layers.2.mlp.experts.3.up_proj.weight").unwrap().1;
        assert_eq!(&up[..32], w.layers[2].mlp_in.row(7 * 8));
        // the dense layer keeps the dense MLP's names; the shared expert's gate is [1, d] in GGUF
        // too (a vector of d is taken as that row)
        assert!(hf.iter().any(|(t, _)| t.name == "model.layers.1.mlp.gate_proj.weight"));
        let gguf = tensor_names(&cfg, Naming::Gguf);
        assert_eq!(
            gguf.iter().find(|t| t.name == "blk.2.ffn_gate_inp_shexp.weight").map(|t| &t.shape[..]),
            Some(&[1, 32][..])
        );
    }

    /// gpt-oss's shape: biases, sinks, 4 experts of 8 on every layer, a sliding layer.
    fn gpt_oss() -> ModelConfig {
        let mut c = ModelConfig::llama(64, 32, 2, 1, 16, 24, 2, 10000.0, 1e-5, false);
        (c.qkv_bias, c.o_bias, c.attn_sinks) = (true, true, true);
        c.mlp = crate::model::config::MlpKind::ClampedSwiGlu;
        c.layers[0] = crate::model::config::LayerSpec { global_group: None, writes_global: false, local: true };
        c.layers[1].global_group = Some(0);
        c.window = 4;
        c.moe = Some(crate::model::config::MoeConfig {
            experts: 4,
            top_k: 2,
            ffn: 8,
            layers: vec![0, 1],
            norm_topk: true,
            shared_ffn: None,
            bias: true,
        });
        c.family = Family::GptOss;
        c
    }

    #[test]
    fn gpt_oss_round_trips_its_transposed_interleaved_experts() {
        let cfg = gpt_oss();
        let w = ModelWeights::random(&cfg, 7).unwrap();
        // (no GGUF: llama.cpp's converter splits the experts; tests/llamacpp.rs reads its files)
        round_trips(&w, &[Naming::Kvdecode, Naming::HuggingFace("model.")]);
        // layer 1, expert 2: file [E, d, 2F]; its column 2j is gate j (mlp_in row 2 * 8 + j), 2j + 1
        // up j (row (4 + 2) * 8 + j)
        let hf = tensors_of(&w, Naming::HuggingFace("model."));
        let (t, v) = hf.iter().find(|(t, _)| t.name == "model.layers.1.mlp.experts.gate_up_proj").unwrap();
        assert_eq!(t.file_shape(), [4, 32, 16]);
        let at = |c: usize, col: usize| v[(2 * 32 + c) * 16 + col];
        let (gate, up) = (w.layers[1].mlp_in.row(2 * 8 + 3), w.layers[1].mlp_in.row(6 * 8 + 3));
        assert!((0..32).all(|c| at(c, 6) == gate[c] && at(c, 7) == up[c]));
        let (_, bias) = hf.iter().find(|(t, _)| t.name == "model.layers.1.mlp.experts.gate_up_proj_bias").unwrap();
        let mlp_in_bias = w.layers[1].mlp_in_bias.as_ref().unwrap();
        assert_eq!((bias[2 * 16 + 6], bias[2 * 16 + 7]), (mlp_in_bias[2 * 8 + 3], mlp_in_bias[6 * 8 + 3]));
    }

    #[test]
    fn every_naming_round_trips_fused_and_reordered_rows() {
        let cfg = phi3();
        cfg.validate().unwrap();
        let w = ModelWeights::random(&cfg, 7).unwrap();
        round_trips(&w, &[Naming::Kvdecode, Naming::HuggingFace("model."), Naming::Gguf]);
        for naming in [Naming::HuggingFace("model."), Naming::Gguf] {
            let names = tensor_names(&cfg, naming);
            let qkv = names.iter().find(|t| t.name.ends_with("qkv_proj.weight") || t.name.ends_with("attn_qkv.weight"));
            assert_eq!(qkv.map(|t| t.places.len()), Some(3), "{naming:?}: q, k and v of one tensor");
        }
        // file dimension 6 pairs with 0 (rot/2 = 6 apart); kvdecode keeps it at 8 (head_dim/2 apart)
        let hf = tensors_of(&w, Naming::HuggingFace("model."));
        let qkv = &hf.iter().find(|(t, _)| t.name == "model.layers.0.self_attn.qkv_proj.weight").unwrap().1;
        assert_eq!(&qkv[6 * 32..7 * 32], w.layers[0].wq.row(8));
    }
}
