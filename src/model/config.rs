//! Model configuration: dimensions, numerics switches, and the *layer plan* that says which K/V
//! each layer reads and writes (docs/DESIGN.md, "The layer plan and the small cache").

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::family::Family;
use crate::model::rope::{Rope, RopeScaling};

/// What a layer does with the cache.
///
/// Invariant (checked by [`ModelConfig::validate`]): groups are numbered `0..n_groups` in layer
/// order, and the first layer that names a group is its only writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSpec {
    /// The global K/V group this layer attends over, if any.
    pub global_group: Option<usize>,
    /// This layer projects K/V and appends them to its group's global cache.
    pub writes_global: bool,
    /// This layer owns a local ring of `window` slots (its own K/V projection) and attends over it.
    pub local: bool,
}

/// The normalization used everywhere in the model (block norms, final norm, qk-norm).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormKind {
    /// `x * rsqrt(mean(x^2) + eps)`, no parameters (the seed's `rms_norm`).
    Plain,
    /// `... * w` (Llama, Qwen).
    Weight,
    /// `... * (1 + w)` (Gemma).
    OnePlusWeight,
}

/// The feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MlpKind {
    /// `proj(relu(fc(x))^2)`: the seed's TinyAgent MLP (as in modded-nanogpt).
    ReluSquared,
    /// `down(silu(gate(x)) * up(x))`: Llama, Qwen.
    SwiGlu,
    /// `down(gelu_tanh(gate(x)) * up(x))`: Gemma.
    GeluTanhGated,
    /// gpt-oss's clamped SwiGLU: `down((clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g))` with
    /// `g = min(gate, 7)` ([`SWIGLU_LIMIT`], [`SWIGLU_ALPHA`]).
    ClampedSwiGlu,
}

/// The clamp of gpt-oss's SwiGLU (`swiglu_limit`): the gate is at most this, the up projection
/// within plus or minus it.
pub const SWIGLU_LIMIT: f32 = 7.0;
/// The sigmoid's gain in gpt-oss's SwiGLU (`swiglu_alpha`).
pub const SWIGLU_ALPHA: f32 = 1.702;

impl MlpKind {
    /// Rows of the fused input projection per FFN unit (gated kinds fuse gate and up).
    pub fn in_factor(self) -> usize {
        match self {
            MlpKind::ReluSquared => 1,
            _ => 2,
        }
    }
}

/// A transformer described by its dimensions and layer plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention: `n_heads % n_kv_heads == 0`).
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// Feed-forward size.
    pub ffn: usize,
    /// Per layer: which K/V it reads and writes.
    pub layers: Vec<LayerSpec>,
    /// Sliding window `W` of local layers (a query at `p` sees local keys `p - W < q <= p`).
    pub window: usize,
    /// Normalization kind.
    pub norm: NormKind,
    /// RMS norm epsilon.
    pub norm_eps: f32,
    /// Per-head RMS norm of q and k before RoPE (the seed, Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// The qk-norm spans the whole projection (all heads of q, all of k; OLMo 2), with weights
    /// `[n_heads * head_dim]` and `[n_kv_heads * head_dim]`, instead of each head.
    #[serde(default)]
    pub qk_norm_whole: bool,
    /// The attention and the MLP read the norm of the residual stream (every family but OLMo 2,
    /// whose blocks read the stream itself and norm only their outputs).
    #[serde(default = "yes")]
    pub pre_norms: bool,
    /// Gemma's extra norms after attention and after the MLP (before each residual add).
    pub post_norms: bool,
    /// RoPE base of layers that read a global K/V.
    pub rope_theta: f32,
    /// RoPE base of local-only layers (Gemma 3 uses 1e4 there, 1e6 on global layers).
    pub rope_theta_local: f32,
    /// How RoPE is stretched on layers that read a global K/V (Llama 3.1, YaRN, linear).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// How RoPE is stretched on local-only layers.
    #[serde(default)]
    pub rope_scaling_local: Option<RopeScaling>,
    /// Layers that rotate nothing (SmolLM3's NoPE layers): their queries and keys carry no
    /// position.
    #[serde(default)]
    pub nope_layers: Vec<usize>,
    /// Dimensions of each head that RoPE rotates (Phi's partial rotary), `None`: all `head_dim`.
    /// kvdecode keeps each query and key head's rows ordered so that the rotated pairs come
    /// first and the rest pair with each other, unrotated ([`crate::model::rope::Rope::dims`]).
    #[serde(default)]
    pub rope_dims: Option<usize>,
    /// The query, key and value projections add a bias (Qwen2).
    #[serde(default)]
    pub qkv_bias: bool,
    /// The attention's output projection adds a bias (gpt-oss).
    #[serde(default)]
    pub o_bias: bool,
    /// Each query head has a learned sink: a logit in its softmax's denominator that takes
    /// weight from the keys and gives no value (gpt-oss).
    #[serde(default)]
    pub attn_sinks: bool,
    /// MLP kind.
    pub mlp: MlpKind,
    /// Embeddings are multiplied by this (Gemma: `sqrt(d_model)`).
    pub embed_scale: f32,
    /// Attention score scale (usually `head_dim^-0.5`).
    pub attn_scale: f32,
    /// Final logits become `c * tanh(logits / c)` when set.
    pub logit_softcap: Option<f32>,
    /// Attention scores (after scaling) become `c * tanh(score / c)` when set (Gemma 2).
    #[serde(default)]
    pub attn_softcap: Option<f32>,
    /// The LM head shares the embedding matrix.
    pub tie_embeddings: bool,
    /// The Engram n-gram memory (docs/DESIGN.md, "Engram") on some layers.
    #[serde(default)]
    pub engram: Option<EngramConfig>,
    /// The context the model was trained for (Hugging Face `max_position_embeddings`, GGUF
    /// `<arch>.context_length`), when the file says. [`crate::Engine::new`] refuses rows longer
    /// than this unless [`crate::EngineOptions::beyond_trained_context`] is set.
    #[serde(default)]
    pub context_len: Option<usize>,
    /// The architecture the weights came from: it names their tensors in Hugging Face and GGUF
    /// files ([`crate::model::family`]). Files written before it existed read as
    /// [`Family::Kvdecode`], which has kvdecode's names only.
    #[serde(default)]
    pub family: Family,
    /// A mixture of experts in place of the dense MLP on some layers (Qwen3-MoE, OLMoE,
    /// Mixtral).
    #[serde(default)]
    pub moe: Option<MoeConfig>,
}

/// A mixture of experts: on its layers a router picks `top_k` of `experts` gated MLPs per token
/// and the block's output is their weighted sum (docs/MODELS.md, "Mixtures of experts").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Each expert's feed-forward size (the dense layers keep [`ModelConfig::ffn`]).
    pub ffn: usize,
    /// The layers whose MLP is the mixture, ascending.
    pub layers: Vec<usize>,
    /// The top-k probabilities are divided by their sum (Qwen3-MoE's `norm_topk_prob`, Mixtral);
    /// else they weigh the experts as the softmax over all experts gave them (OLMoE).
    pub norm_topk: bool,
    /// A shared expert of this feed-forward size beside the routed ones, every token through
    /// it, weighed by `sigmoid(gate . x)` (Qwen2-MoE).
    #[serde(default)]
    pub shared_ffn: Option<usize>,
    /// The router and the experts' products add biases (gpt-oss): the router one per expert,
    /// each expert one per row of its gate, up and down projections.
    #[serde(default)]
    pub bias: bool,
}

/// The most heads (queries, keys, values) a token may have with a whole-projection qk-norm:
/// `qk_rope.wgsl` then runs one workgroup per token, a thread per head (its `MAX_TOKEN_HEADS`).
pub const QK_NORM_WHOLE_MAX_HEADS: usize = 256;

/// Most experts a MoE layer may have: the router's top-k runs one thread per token over them, and
/// the expert products keep a bit per expert (`MASK_WORDS` in matmul_experts.wgsl, 1024 / 32).
pub const MAX_EXPERTS: usize = 1024;
/// Most experts a token may be routed to.
pub const MAX_TOP_K: usize = 32;

fn yes() -> bool {
    true
}

/// The Engram module: hashed n-gram tables whose rows, gated by the hidden state, are added to
/// the residual stream before attention on the layers named here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngramConfig {
    /// Layers that have an Engram module.
    pub layers: Vec<usize>,
    /// N-gram orders, e.g. `[2, 3]`.
    pub orders: Vec<usize>,
    /// Hash heads per order.
    pub heads: usize,
    /// Rows of each table (`T`).
    pub table_rows: usize,
    /// Width of each table row (`d_e`).
    pub dim: usize,
}

impl EngramConfig {
    /// Width of the concatenated lookup `e_t`: orders x heads x dim.
    pub fn width(&self) -> usize {
        self.orders.len() * self.heads * self.dim
    }
    /// The largest order (how far back a token's address looks, plus one).
    pub fn max_order(&self) -> usize {
        self.orders.iter().copied().max().unwrap_or(1)
    }
}

/// Upper bounds on dimensions read from model files, checked before anything is sized by them
/// (a hostile header must not make us allocate what it merely claims).
pub const MAX_LAYERS: usize = 4096;
/// Largest vocabulary accepted from a file.
pub const MAX_VOCAB: usize = 1 << 22;
/// Largest hidden / FFN / head dimension accepted from a file.
pub const MAX_DIM: usize = 1 << 18;

/// Check dimensions read from a model file against [`MAX_LAYERS`], [`MAX_VOCAB`], [`MAX_DIM`].
pub fn check_file_dims(layers: usize, vocab: usize, dims: &[(&str, usize)]) -> Result<()> {
    if layers > MAX_LAYERS {
        return Err(Error::Config(format!("{layers} layers is more than the {MAX_LAYERS} supported")));
    }
    if vocab > MAX_VOCAB {
        return Err(Error::Config(format!("vocabulary of {vocab} is larger than the {MAX_VOCAB} supported")));
    }
    for (name, v) in dims {
        if *v > MAX_DIM {
            return Err(Error::Config(format!("{name} {v} is larger than the {MAX_DIM} supported")));
        }
    }
    Ok(())
}

impl ModelConfig {
    /// The seed's TinyAgent layout: `n_layers` layers in groups of `kv_group`; the first layer of
    /// each group writes the group's global K/V; every layer has its own local ring of `window`
    /// slots; one softmax over global + local. Parameter-free norms, qk-norm, relu^2 MLP, softcap.
    #[allow(clippy::too_many_arguments)]
    pub fn tiny_agent(
        vocab: usize,
        d_model: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        ffn: usize,
        n_layers: usize,
        kv_group: usize,
        window: usize,
    ) -> Self {
        let layers = (0..n_layers)
            .map(|i| LayerSpec {
                global_group: Some(i / kv_group.max(1)),
                writes_global: i % kv_group.max(1) == 0,
                local: true,
            })
            .collect();
        ModelConfig {
            vocab,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            layers,
            window,
            norm: NormKind::Plain,
            norm_eps: 1e-6,
            qk_norm: true,
            qk_norm_whole: false,
            pre_norms: true,
            post_norms: false,
            rope_theta: 10000.0,
            rope_theta_local: 10000.0,
            rope_scaling: None,
            rope_scaling_local: None,
            nope_layers: Vec::new(),
            rope_dims: None,
            qkv_bias: false,
            o_bias: false,
            attn_sinks: false,
            mlp: MlpKind::ReluSquared,
            embed_scale: 1.0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            logit_softcap: Some(15.0),
            attn_softcap: None,
            tie_embeddings: false,
            engram: None,
            context_len: None,
            family: Family::Kvdecode,
            moe: None,
        }
    }

    /// Plain Llama: every layer writes and reads its own global K/V, no ring.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        vocab: usize,
        d_model: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        ffn: usize,
        n_layers: usize,
        rope_theta: f32,
        norm_eps: f32,
        tie_embeddings: bool,
    ) -> Self {
        let layers =
            (0..n_layers).map(|i| LayerSpec { global_group: Some(i), writes_global: true, local: false }).collect();
        ModelConfig {
            vocab,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            layers,
            window: 0,
            norm: NormKind::Weight,
            norm_eps,
            qk_norm: false,
            qk_norm_whole: false,
            pre_norms: true,
            post_norms: false,
            rope_theta,
            rope_theta_local: rope_theta,
            rope_scaling: None,
            rope_scaling_local: None,
            nope_layers: Vec::new(),
            rope_dims: None,
            qkv_bias: false,
            o_bias: false,
            attn_sinks: false,
            mlp: MlpKind::SwiGlu,
            embed_scale: 1.0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            logit_softcap: None,
            attn_softcap: None,
            tie_embeddings,
            engram: None,
            context_len: None,
            family: Family::Llama,
            moe: None,
        }
    }

    /// Elements of the q-norm's and the k-norm's weights.
    pub fn qk_norm_lens(&self) -> (usize, usize) {
        if self.qk_norm_whole {
            (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        } else {
            (self.head_dim, self.head_dim)
        }
    }

    /// Layer `i`'s place among the MoE layers, if its MLP is the mixture.
    pub fn moe_layer(&self, i: usize) -> Option<usize> {
        self.moe.as_ref()?.layers.iter().position(|&l| l == i)
    }

    /// The mixture of experts of layer `i`, if its MLP is one.
    pub fn layer_moe(&self, i: usize) -> Option<&MoeConfig> {
        self.moe.as_ref().filter(|m| m.layers.contains(&i))
    }

    /// Experts of layer `i`'s MLP: 1 on a dense layer.
    pub fn layer_experts(&self, i: usize) -> usize {
        self.layer_moe(i).map_or(1, |m| m.experts)
    }

    /// Feed-forward size of layer `i`'s MLP (of each expert on a MoE layer).
    pub fn layer_ffn(&self, i: usize) -> usize {
        match &self.moe {
            Some(m) if m.layers.contains(&i) => m.ffn,
            _ => self.ffn,
        }
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of global K/V groups.
    pub fn n_groups(&self) -> usize {
        self.layers.iter().filter(|l| l.writes_global).count()
    }

    /// The layer plan of a model whose layers either slide over `window` keys (`sliding(i)`) or
    /// attend globally, each global layer its own K/V group (Gemma, Mistral, gpt-oss, ...).
    pub fn set_sliding(&mut self, window: usize, sliding: impl Fn(usize) -> bool) {
        let mut group = 0;
        for (i, l) in self.layers.iter_mut().enumerate() {
            *l = if sliding(i) {
                LayerSpec { global_group: None, writes_global: false, local: true }
            } else {
                group += 1;
                LayerSpec { global_group: Some(group - 1), writes_global: true, local: false }
            };
        }
        self.window = window;
    }

    /// Whether any layer owns a local ring.
    pub fn has_local(&self) -> bool {
        self.layers.iter().any(|l| l.local)
    }

    /// RoPE of layer `i` (global layers use `rope_theta` and `rope_scaling`, local-only ones
    /// their `_local` twins; `None` for a NoPE layer).
    pub fn layer_rope(&self, i: usize) -> Option<Rope> {
        if self.nope_layers.contains(&i) {
            None
        } else if self.layers[i].global_group.is_some() {
            Some(Rope { theta: self.rope_theta, scaling: self.rope_scaling.clone(), dims: self.rope_dims })
        } else {
            Some(Rope { theta: self.rope_theta_local, scaling: self.rope_scaling_local.clone(), dims: self.rope_dims })
        }
    }

    /// Check every constraint the engine relies on; the error names the first violated one.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::Config(m));
        let pos = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("layers", self.layers.len()),
        ];
        for (name, v) in pos {
            if v == 0 {
                return err(format!("{name} must be >= 1"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return err(format!("n_heads {} is not divisible by n_kv_heads {}", self.n_heads, self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return err(format!("head_dim {} must be even (RoPE rotates pairs)", self.head_dim));
        }
        // vec4 kernels: every matrix input width is a multiple of 4
        if !self.head_dim.is_multiple_of(4) || self.head_dim > 256 {
            return err(format!("head_dim {} must be a multiple of 4 and at most 256", self.head_dim));
        }
        for (name, v) in [("d_model", self.d_model), ("ffn", self.ffn)] {
            if !v.is_multiple_of(4) {
                return err(format!("{name} {v} must be a multiple of 4"));
            }
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return err(format!("norm_eps {} must be positive", self.norm_eps));
        }
        if !(self.rope_theta > 1.0 && self.rope_theta_local > 1.0) {
            return err("rope theta must be > 1".into());
        }
        if let Some(r) = self.rope_dims {
            if r == 0 || r > self.head_dim || !r.is_multiple_of(2) {
                return err(format!("rope_dims {r} must be even and within head_dim {}", self.head_dim));
            }
            // the qk-norm weights are in the file's order of a head's dimensions, which partial
            // rotary reorders
            if r < self.head_dim && self.qk_norm {
                return err(format!(
                    "rope_dims {r} of head_dim {} together with qk_norm is not supported",
                    self.head_dim
                ));
            }
        }
        for s in [&self.rope_scaling, &self.rope_scaling_local].into_iter().flatten() {
            s.validate(self.rope_dims.unwrap_or(self.head_dim))?;
        }
        if let Some(i) = self.layers.iter().position(|l| self.qkv_bias && l.writes_global && l.local) {
            return err(format!("layer {i} has two K/V projections; qkv_bias supports one per layer"));
        }
        if self.qk_norm_whole && !self.qk_norm {
            return err("qk_norm_whole needs qk_norm".into());
        }
        let token_heads = self.n_heads + 3 * self.n_kv_heads;
        if self.qk_norm_whole && token_heads > QK_NORM_WHOLE_MAX_HEADS {
            return err(format!(
                "qk_norm_whole with {} heads and {} KV heads: a token's heads (queries, keys of two kinds, \
                 values: {token_heads}) are one workgroup, of at most {}",
                self.n_heads, self.n_kv_heads, QK_NORM_WHOLE_MAX_HEADS
            ));
        }
        if !self.pre_norms && !self.post_norms {
            return err("a model without pre_norms needs post_norms (its blocks would norm nothing)".into());
        }
        if let Some(&l) = self.nope_layers.iter().find(|&&l| l >= self.layers.len()) {
            return err(format!("NoPE layer {l} does not exist ({} layers)", self.layers.len()));
        }
        if let Some(c) = self.logit_softcap {
            if !(c > 0.0 && c.is_finite()) {
                return err(format!("logit_softcap {c} must be positive"));
            }
        }
        if let Some(c) = self.attn_softcap {
            if !(c > 0.0 && c.is_finite()) {
                return err(format!("attn_softcap {c} must be positive"));
            }
        }
        if !(self.attn_scale > 0.0 && self.attn_scale.is_finite()) {
            return err(format!("attn_scale {} must be positive", self.attn_scale));
        }
        if self.has_local() && self.window == 0 {
            return err("window must be >= 1 when a layer is local".into());
        }
        if let Some(e) = &self.engram {
            if let Some(&l) = e.layers.iter().find(|&&l| l >= self.layers.len()) {
                return err(format!("engram layer {l} does not exist ({} layers)", self.layers.len()));
            }
            if e.orders.is_empty() || e.orders.iter().any(|&n| n == 0 || n > 8) {
                return err(format!("engram orders {:?} must be 1..=8", e.orders));
            }
            if e.heads == 0 || e.table_rows == 0 || e.dim == 0 || !e.dim.is_multiple_of(4) {
                return err(format!(
                    "engram needs heads, table_rows >= 1 and dim a multiple of 4 (got {}, {}, {})",
                    e.heads, e.table_rows, e.dim
                ));
            }
            if e.heads * e.orders.len() > 64 || e.table_rows > 1 << 24 || e.dim > 1024 {
                return err("engram tables are larger than supported".into());
            }
        }
        if let Some(m) = &self.moe {
            if m.experts == 0 || m.experts > MAX_EXPERTS {
                return err(format!("moe experts {} must be 1..={MAX_EXPERTS}", m.experts));
            }
            if m.top_k == 0 || m.top_k > m.experts.min(MAX_TOP_K) {
                return err(format!(
                    "moe top_k {} must be 1..={} (experts {}, at most {MAX_TOP_K})",
                    m.top_k,
                    m.experts.min(MAX_TOP_K),
                    m.experts
                ));
            }
            if m.ffn == 0 || !m.ffn.is_multiple_of(4) {
                return err(format!("moe ffn {} must be a positive multiple of 4", m.ffn));
            }
            if m.layers.windows(2).any(|w| w[0] >= w[1]) {
                return err(format!("moe layers {:?} must be ascending, each once", m.layers));
            }
            if let Some(&l) = m.layers.iter().find(|&&l| l >= self.layers.len()) {
                return err(format!("moe layer {l} does not exist ({} layers)", self.layers.len()));
            }
            if !matches!(self.mlp, MlpKind::SwiGlu | MlpKind::GeluTanhGated | MlpKind::ClampedSwiGlu) {
                return err(format!("moe experts are gated MLPs; {:?} is not gated", self.mlp));
            }
            if let Some(f) = m.shared_ffn {
                if f == 0 || !f.is_multiple_of(4) {
                    return err(format!("moe shared_ffn {f} must be a positive multiple of 4"));
                }
                if self.post_norms {
                    return err("a shared expert together with post_norms is not supported".into());
                }
            }
        }
        let mut next_group = 0usize;
        for (i, l) in self.layers.iter().enumerate() {
            if l.global_group.is_none() && !l.local {
                return err(format!("layer {i} reads neither a global K/V nor a local ring"));
            }
            if l.writes_global && l.global_group.is_none() {
                return err(format!("layer {i} writes a global K/V but names no group"));
            }
            if let Some(g) = l.global_group {
                if l.writes_global {
                    if g != next_group {
                        return err(format!(
                            "layer {i} writes group {g}, expected group {next_group} (groups are numbered in layer order, one writer each)"
                        ));
                    }
                    next_group += 1;
                } else if g >= next_group {
                    return err(format!("layer {i} reads group {g} before any layer wrote it"));
                }
            }
        }
        Ok(())
    }
}
