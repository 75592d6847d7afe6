//! Model weights on the host (f32) and seeded random init. Reading and writing them as files is
//! in [`crate::io`] (kvdecode's safetensors: `io/safetensors.rs`; Hugging Face: `io/hf.rs`).

use crate::error::{Error, Result};
use crate::model::config::{ModelConfig, NormKind};
use crate::model::quant::{dequantize, QuantData, QuantKind};

/// A dense f32 matrix in PyTorch layout `[rows, cols]` (`rows` = output features).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Row-major values (dequantized when the matrix is quantized).
    pub data: Vec<f32>,
    /// The quantized blocks `data` came from, kept so the GPU can read them directly.
    pub quant: Option<QuantData>,
    /// The 16-bit type `data` was read from (every value is exact in it): the GPU keeps such a
    /// matrix 16-bit, whatever `EngineOptions::weights` says.
    pub half: Option<Half>,
}

/// A 16-bit float type on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
}

impl Matrix {
    /// A matrix from row-major data; errors if the length does not match.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(Error::Weights(format!(
                "matrix [{rows}, {cols}] needs {} values, got {}",
                rows * cols,
                data.len()
            )));
        }
        Ok(Matrix { rows, cols, data, quant: None, half: None })
    }

    /// A matrix from quantized blocks (row-major, whole blocks per row); `data` is dequantized.
    pub fn quantized(rows: usize, cols: usize, kind: QuantKind, bytes: Vec<u8>) -> Result<Self> {
        if !cols.is_multiple_of(kind.block_len()) {
            return Err(Error::Weights(format!(
                "{kind:?} matrix [{rows}, {cols}]: rows are not whole blocks of {}",
                kind.block_len()
            )));
        }
        let n = rows.checked_mul(cols).ok_or_else(|| Error::Weights("matrix size overflows".into()))?;
        let data = dequantize(kind, &bytes, n)?;
        Ok(Matrix { rows, cols, data, quant: Some(QuantData { kind, bytes }), half: None })
    }

    /// Reorder or pick rows: row `i` of the result is row `order[i]` of `self` (quantized blocks
    /// too), so the result has `order.len()` rows.
    pub fn permute_rows(&self, order: &[usize]) -> Matrix {
        let data = order.iter().flat_map(|&r| self.row(r).iter().copied()).collect();
        let quant = self.quant.as_ref().map(|q| {
            let rb = self.cols / q.kind.block_len() * q.kind.block_bytes();
            QuantData {
                kind: q.kind,
                bytes: order.iter().flat_map(|&r| q.bytes[r * rb..(r + 1) * rb].iter().copied()).collect(),
            }
        });
        Matrix { rows: order.len(), cols: self.cols, data, quant, half: self.half }
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Stack matrices with equal `cols` on top of each other (fused projections).
    pub fn vstack(parts: &[Matrix]) -> Result<Matrix> {
        let cols = parts.first().map_or(0, |m| m.cols);
        if parts.iter().any(|m| m.cols != cols) {
            return Err(Error::Weights("fused projection parts have different input widths".into()));
        }
        let rows = parts.iter().map(|m| m.rows).sum();
        let data = parts.iter().flat_map(|m| m.data.iter().copied()).collect();
        let mut out = Matrix::new(rows, cols, data)?;
        // keep the blocks when every part has the same quantized format
        let kind = parts.first().and_then(|m| m.quant.as_ref()).map(|q| q.kind);
        if let Some(kind) = kind {
            if parts.iter().all(|m| m.quant.as_ref().is_some_and(|q| q.kind == kind)) {
                let bytes =
                    parts.iter().flat_map(|m| m.quant.as_ref().map(|q| q.bytes.clone()).unwrap_or_default()).collect();
                out.quant = Some(QuantData { kind, bytes });
            }
        }
        let half = parts.first().and_then(|m| m.half);
        if parts.iter().all(|m| m.half == half) {
            out.half = half;
        }
        Ok(out)
    }
}

/// One layer's weights. Norm weights are raw (`w`); [`NormKind`] says how they apply.
/// Fused layouts: `kv_*` is `[k; v]` (`2 * n_kv_heads * head_dim` rows), gated `mlp_in` is
/// `[gate; up]` (`2 * ffn` rows).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// Norm before attention (`None` for [`NormKind::Plain`]).
    pub attn_norm: Option<Vec<f32>>,
    /// Query projection `[n_heads * head_dim, d_model]`.
    pub wq: Matrix,
    /// qk-norm weight for queries `[head_dim]`.
    pub q_norm: Option<Vec<f32>>,
    /// qk-norm weight for keys `[head_dim]`.
    pub k_norm: Option<Vec<f32>>,
    /// Fused K/V projection into the group's global cache (writer layers).
    pub kv_global: Option<Matrix>,
    /// Fused K/V projection into this layer's ring (local layers).
    pub kv_local: Option<Matrix>,
    /// Bias of the query projection `[n_heads * head_dim]` (Qwen2).
    pub q_bias: Option<Vec<f32>>,
    /// Bias of the K/V projection `[2 * n_kv_heads * head_dim]`, `[k; v]` as the matrices' rows
    /// (both matrices of a layer that has two).
    pub kv_bias: Option<Vec<f32>>,
    /// Output projection `[d_model, n_heads * head_dim]`.
    pub wo: Matrix,
    /// Bias of the output projection `[d_model]` (gpt-oss).
    pub o_bias: Option<Vec<f32>>,
    /// Each query head's attention sink logit `[n_heads]` (gpt-oss).
    pub sinks: Option<Vec<f32>>,
    /// Gemma: norm of the attention output before the residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    /// Norm before the MLP.
    pub mlp_norm: Option<Vec<f32>>,
    /// Gemma: norm of the MLP output before the residual add.
    pub post_mlp_norm: Option<Vec<f32>>,
    /// MLP input projection `[in_factor * ffn, d_model]`. On a MoE layer every expert's:
    /// `[gate_0; ..; gate_{E-1}; up_0; ..; up_{E-1}]`, `[2 * experts * moe.ffn, d_model]`.
    pub mlp_in: Matrix,
    /// MLP output projection `[d_model, ffn]`. On a MoE layer every expert's stacked,
    /// `[experts * d_model, moe.ffn]`.
    pub mlp_out: Matrix,
    /// The router of a MoE layer, `[experts, d_model]`: one logit per expert.
    pub router: Option<Matrix>,
    /// The router's bias `[experts]` (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// The biases of `mlp_in`'s rows on a MoE layer, in its row order (gpt-oss).
    pub mlp_in_bias: Option<Vec<f32>>,
    /// The biases of `mlp_out`'s rows on a MoE layer, `[experts * d_model]` (gpt-oss).
    pub mlp_out_bias: Option<Vec<f32>>,
    /// A MoE layer's shared expert (Qwen2-MoE).
    pub shared_expert: Option<SharedExpert>,
    /// The Engram module, on the layers the config names.
    pub engram: Option<EngramWeights>,
}

/// A MoE layer's shared expert: a gated MLP every token goes through, its output weighed by
/// `sigmoid(gate . x)` and added to the routed experts' sum.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedExpert {
    /// `[gate; up]`, `[2 * shared_ffn, d_model]`.
    pub mlp_in: Matrix,
    /// `[d_model, shared_ffn]`.
    pub mlp_out: Matrix,
    /// `[1, d_model]`: the logit of the expert's sigmoid weight.
    pub gate: Matrix,
}

/// One layer's Engram module (docs/DESIGN.md, "Engram").
#[derive(Clone, Debug, PartialEq)]
pub struct EngramWeights {
    /// `E[n][j]` for each order `n` (in config order) and head `j`, each `[table_rows, dim]`,
    /// flattened order-major.
    pub tables: Vec<Matrix>,
    /// `[W_k; W_v]`, `[2 * d_model, orders * heads * dim]`.
    pub w_kv: Matrix,
}

/// A whole model: its config and f32 weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelWeights {
    /// The configuration these weights follow.
    pub cfg: ModelConfig,
    /// Token embedding `[vocab, d_model]`.
    pub embed: Matrix,
    /// Per-layer weights.
    pub layers: Vec<LayerWeights>,
    /// Final norm weight.
    pub final_norm: Option<Vec<f32>>,
    /// LM head `[vocab, d_model]`; `None` when tied to the embedding.
    pub head: Option<Matrix>,
    /// Engram's compressed id of each token (`None`: identity).
    pub cid_map: Option<Vec<u32>>,
}

/// SplitMix64: a tiny, well-known seeded generator for reproducible weights and tests.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

impl ModelWeights {
    /// Seeded random weights for `cfg` (projections `N(0, 1/fan_in)`, embeddings `N(0, 1)`,
    /// norm weights random around their identity so a `w` / `1 + w` mix-up shows).
    pub fn random(cfg: &ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let mut rng = SplitMix64(seed);
        let mut mat = |rows: usize, cols: usize, gain: f32| {
            let s = gain / (cols as f32).sqrt();
            let data = (0..rows * cols).map(|_| rng.normal() * s).collect();
            Matrix { rows, cols, data, quant: None, half: None }
        };
        let (d, hd, kvd) = (cfg.d_model, cfg.n_heads * cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim);
        let mut engrams = Vec::new();
        for i in 0..cfg.layers.len() {
            engrams.push(match &cfg.engram {
                Some(e) if e.layers.contains(&i) => Some(EngramWeights {
                    tables: (0..e.orders.len() * e.heads)
                        .map(|_| mat(e.table_rows, e.dim, (e.dim as f32).sqrt()))
                        .collect(),
                    w_kv: mat(2 * d, e.width(), 1.0),
                }),
                _ => None,
            });
        }
        // A many-to-one map (about two tokens per compressed id, as a tokenizer's case and space
        // variants fold together) whose ids start at 1: `cid_map[0] != 0`, so the ids of positions
        // before a row's start (token 0, mapped) differ from a raw 0 and tests can tell them apart.
        let cid_map = cfg.engram.as_ref().map(|_| {
            let mut rng = SplitMix64(seed ^ 0x0C1D_0AA9);
            let distinct = (cfg.vocab / 2).max(1);
            (0..cfg.vocab).map(|_| 1 + rng.below(distinct) as u32).collect()
        });
        let mut layer_mats = Vec::new();
        for (i, l) in cfg.layers.iter().enumerate() {
            let wq = mat(hd, d, 1.0);
            let kv_global = l.writes_global.then(|| mat(kvd, d, 1.0));
            let kv_local = l.local.then(|| mat(kvd, d, 1.0));
            let wo = mat(d, hd, 0.5);
            let (experts, f) = (cfg.layer_experts(i), cfg.layer_ffn(i));
            let mlp_in = mat(experts * cfg.mlp.in_factor() * f, d, 1.0);
            let mlp_out = mat(experts * d, f, 0.5);
            layer_mats.push((wq, kv_global, kv_local, wo, mlp_in, mlp_out));
        }
        // routers from a generator of their own (dense models draw as before), with a gain that
        // keeps a token's top-k clear of ties
        let mut rng = SplitMix64(seed ^ 0x0E0E_7E75);
        let mut routers: Vec<Option<Matrix>> = (0..cfg.layers.len())
            .map(|i| {
                let e = cfg.layer_moe(i)?.experts;
                let s = 4.0 / (d as f32).sqrt();
                Some(Matrix {
                    rows: e,
                    cols: d,
                    data: (0..e * d).map(|_| rng.normal() * s).collect(),
                    quant: None,
                    half: None,
                })
            })
            .collect();
        let mut shared: Vec<Option<SharedExpert>> = (0..cfg.layers.len())
            .map(|i| {
                let f = cfg.layer_moe(i)?.shared_ffn?;
                let mut mat = |rows: usize, cols: usize, gain: f32| {
                    let s = gain / (cols as f32).sqrt();
                    Matrix::new(rows, cols, (0..rows * cols).map(|_| rng.normal() * s).collect()).expect("sized")
                };
                Some(SharedExpert { mlp_in: mat(2 * f, d, 1.0), mlp_out: mat(d, f, 0.5), gate: mat(1, d, 1.0) })
            })
            .collect();
        let embed = mat(cfg.vocab, d, (d as f32).sqrt());
        let head = (!cfg.tie_embeddings).then(|| mat(cfg.vocab, d, 2.0));
        let mut rng = SplitMix64(seed ^ 0x05EE_D0F4_E0A3);
        let mut norm = |n: usize| -> Option<Vec<f32>> {
            match cfg.norm {
                NormKind::Plain => None,
                NormKind::Weight => Some((0..n).map(|_| 1.0 + 0.2 * rng.normal()).collect()),
                NormKind::OnePlusWeight => Some((0..n).map(|_| 0.2 * rng.normal()).collect()),
            }
        };
        // biases from a generator of their own, so models without them draw as before
        let mut rng = SplitMix64(seed ^ 0x00B1_A5E5);
        let mut bias = |n: usize| cfg.qkv_bias.then(|| (0..n).map(|_| 0.5 * rng.normal()).collect::<Vec<f32>>());
        // gpt-oss's biases and sinks from one more, for the same reason
        let mut rng_oss = SplitMix64(seed ^ 0x0055_1245);
        let mut oss =
            |on: bool, n: usize, gain: f32| on.then(|| (0..n).map(|_| gain * rng_oss.normal()).collect::<Vec<f32>>());
        let mut layers = Vec::new();
        for (i, ((wq, kv_global, kv_local, wo, mlp_in, mlp_out), engram)) in
            layer_mats.into_iter().zip(engrams).enumerate()
        {
            let qk = cfg.qk_norm;
            let (q_len, k_len) = cfg.qk_norm_lens();
            let pre = cfg.pre_norms;
            let moe_bias = cfg.layer_moe(i).is_some_and(|m| m.bias);
            let (experts, f) = (cfg.layer_experts(i), cfg.layer_ffn(i));
            layers.push(LayerWeights {
                q_bias: bias(hd),
                kv_bias: bias(kvd),
                o_bias: oss(cfg.o_bias, d, 0.2),
                sinks: oss(cfg.attn_sinks, cfg.n_heads, 1.0),
                router_bias: oss(moe_bias, experts, 0.5),
                mlp_in_bias: oss(moe_bias, experts * 2 * f, 0.2),
                mlp_out_bias: oss(moe_bias, experts * d, 0.2),
                attn_norm: if pre { norm(d) } else { None },
                wq,
                q_norm: if qk { norm(q_len) } else { None },
                k_norm: if qk { norm(k_len) } else { None },
                kv_global,
                kv_local,
                wo,
                post_attn_norm: if cfg.post_norms { norm(d) } else { None },
                mlp_norm: if pre { norm(d) } else { None },
                post_mlp_norm: if cfg.post_norms { norm(d) } else { None },
                mlp_in,
                mlp_out,
                router: routers[i].take(),
                shared_expert: shared[i].take(),
                engram,
            });
        }
        let w = ModelWeights { cfg: cfg.clone(), embed, layers, final_norm: norm(d), head, cid_map };
        w.check()?;
        Ok(w)
    }

    /// The embedded default model: a seeded random TinyAgent-layout model (vocab 512, d_model 128,
    /// 4 heads, 2 KV heads, head_dim 32, FFN 384, 6 layers in groups of 3, window 32, Engram on
    /// layers 1 and 4 with orders 2 and 3, 2 heads, 4096 x 16 tables). It needs no download, so
    /// examples, benchmarks and the browser page run anywhere.
    pub fn demo() -> Self {
        let mut cfg = ModelConfig::tiny_agent(512, 128, 4, 2, 32, 384, 6, 3, 32);
        cfg.engram = Some(crate::model::config::EngramConfig {
            layers: vec![1, 4],
            orders: vec![2, 3],
            heads: 2,
            table_rows: 4096,
            dim: 16,
        });
        Self::random(&cfg, 0x6b76_6465_636f_6465).expect("the demo config is valid")
    }

    /// A copy with every matrix whose rows are whole blocks quantized to `kind`; `data` becomes
    /// the dequantized values. For tests and for shrinking models.
    pub fn quantized(&self, kind: QuantKind) -> Result<Self> {
        let mut w = self.clone();
        let q = |m: &mut Matrix| -> Result<()> {
            if m.cols.is_multiple_of(kind.block_len()) {
                *m = Matrix::quantized(m.rows, m.cols, kind, crate::model::quant::quantize(kind, &m.data)?)?;
            }
            Ok(())
        };
        q(&mut w.embed)?;
        if let Some(h) = &mut w.head {
            q(h)?;
        }
        for l in &mut w.layers {
            for m in [&mut l.wq, &mut l.wo, &mut l.mlp_in, &mut l.mlp_out] {
                q(m)?;
            }
            if let Some(s) = &mut l.shared_expert {
                q(&mut s.mlp_in)?;
                q(&mut s.mlp_out)?;
            }
            for m in [&mut l.kv_global, &mut l.kv_local].into_iter().flatten() {
                q(m)?;
            }
        }
        Ok(w)
    }

    /// The LM head matrix (the embedding when tied).
    pub fn head(&self) -> &Matrix {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// A copy with every matrix rounded to f16 (what the GPU computes with f16 weights); matrices
    /// the GPU reads as quantized blocks stay exact.
    pub fn rounded_to_f16(&self) -> Self {
        let mut w = self.clone();
        let r = |m: &mut Matrix| {
            if m.half.is_some() || m.quant.is_some() {
                return;
            }
            for v in &mut m.data {
                *v = half::f16::from_f32(*v).to_f32();
            }
        };
        r(&mut w.embed);
        if let Some(h) = &mut w.head {
            r(h);
        }
        for l in &mut w.layers {
            if let Some(e) = &mut l.engram {
                r(&mut e.w_kv);
            }
            r(&mut l.wq);
            r(&mut l.wo);
            r(&mut l.mlp_in);
            r(&mut l.mlp_out);
            if let Some(s) = &mut l.shared_expert {
                r(&mut s.mlp_in);
                r(&mut s.mlp_out);
            }
            if let Some(m) = &mut l.kv_global {
                r(m);
            }
            if let Some(m) = &mut l.kv_local {
                r(m);
            }
        }
        w
    }

    /// Check every tensor against the config; the error names the tensor.
    pub fn check(&self) -> Result<()> {
        let c = &self.cfg;
        c.validate()?;
        let (d, hd, kvd) = (c.d_model, c.n_heads * c.head_dim, 2 * c.n_kv_heads * c.head_dim);
        let shape = |name: &str, m: &Matrix, rows: usize, cols: usize| {
            if m.rows != rows || m.cols != cols || m.data.len() != rows * cols {
                Err(Error::Weights(format!("{name}: shape [{}, {}], expected [{rows}, {cols}]", m.rows, m.cols)))
            } else {
                Ok(())
            }
        };
        let vec = |name: &str, v: &Option<Vec<f32>>, n: usize, want: bool| match (v, want) {
            (Some(v), true) if v.len() == n => Ok(()),
            (Some(v), true) => Err(Error::Weights(format!("{name}: length {}, expected {n}", v.len()))),
            (None, false) => Ok(()),
            (None, true) => Err(Error::Weights(format!("{name}: missing"))),
            (Some(_), false) => Err(Error::Weights(format!("{name}: present but the config has none"))),
        };
        let has_w = c.norm != NormKind::Plain;
        shape("embed", &self.embed, c.vocab, d)?;
        if let Some(h) = &self.head {
            shape("head", h, c.vocab, d)?;
        } else if !c.tie_embeddings {
            return Err(Error::Weights("head: missing (and embeddings are not tied)".into()));
        }
        vec("final_norm", &self.final_norm, d, has_w)?;
        if let Some(m) = &self.cid_map {
            if m.len() != c.vocab {
                return Err(Error::Weights(format!("cid_map: length {}, expected vocab {}", m.len(), c.vocab)));
            }
        }
        if self.layers.len() != c.layers.len() {
            return Err(Error::Weights(format!(
                "{} layers of weights for {} layers in the config",
                self.layers.len(),
                c.layers.len()
            )));
        }
        for (i, (l, spec)) in self.layers.iter().zip(&c.layers).enumerate() {
            let p = |s: &str| format!("layer {i} {s}");
            let (q_len, k_len) = c.qk_norm_lens();
            vec(&p("attn_norm"), &l.attn_norm, d, has_w && c.pre_norms)?;
            vec(&p("mlp_norm"), &l.mlp_norm, d, has_w && c.pre_norms)?;
            vec(&p("q_norm"), &l.q_norm, q_len, has_w && c.qk_norm)?;
            vec(&p("k_norm"), &l.k_norm, k_len, has_w && c.qk_norm)?;
            vec(&p("post_attn_norm"), &l.post_attn_norm, d, has_w && c.post_norms)?;
            vec(&p("post_mlp_norm"), &l.post_mlp_norm, d, has_w && c.post_norms)?;
            vec(&p("q_bias"), &l.q_bias, hd, c.qkv_bias)?;
            vec(&p("kv_bias"), &l.kv_bias, kvd, c.qkv_bias)?;
            vec(&p("o_bias"), &l.o_bias, d, c.o_bias)?;
            vec(&p("sinks"), &l.sinks, c.n_heads, c.attn_sinks)?;
            let moe_bias = c.layer_moe(i).is_some_and(|m| m.bias);
            let (experts_here, f_here) = (c.layer_experts(i), c.layer_ffn(i));
            vec(&p("router_bias"), &l.router_bias, experts_here, moe_bias)?;
            vec(&p("mlp_in_bias"), &l.mlp_in_bias, experts_here * 2 * f_here, moe_bias)?;
            vec(&p("mlp_out_bias"), &l.mlp_out_bias, experts_here * d, moe_bias)?;
            shape(&p("wq"), &l.wq, hd, d)?;
            shape(&p("wo"), &l.wo, d, hd)?;
            let (experts, f) = (c.layer_experts(i), c.layer_ffn(i));
            shape(&p("mlp_in"), &l.mlp_in, experts * c.mlp.in_factor() * f, d)?;
            shape(&p("mlp_out"), &l.mlp_out, experts * d, f)?;
            match (&l.router, c.layer_moe(i)) {
                (Some(m), Some(_)) => shape(&p("router"), m, experts, d)?,
                (None, None) => {}
                (None, Some(_)) => return Err(Error::Weights(p("router: missing on a MoE layer"))),
                (Some(_), None) => return Err(Error::Weights(p("router: present on a dense layer"))),
            }
            let shared_ffn = c.layer_moe(i).and_then(|m| m.shared_ffn);
            match (&l.shared_expert, shared_ffn) {
                (Some(s), Some(f)) => {
                    shape(&p("shared expert mlp_in"), &s.mlp_in, 2 * f, d)?;
                    shape(&p("shared expert mlp_out"), &s.mlp_out, d, f)?;
                    shape(&p("shared expert gate"), &s.gate, 1, d)?;
                }
                (None, None) => {}
                (None, Some(_)) => return Err(Error::Weights(p("shared expert: missing"))),
                (Some(_), None) => return Err(Error::Weights(p("shared expert: present but the config has none"))),
            }
            match (&l.kv_global, spec.writes_global) {
                (Some(m), true) => shape(&p("kv_global"), m, kvd, d)?,
                (None, false) => {}
                (None, true) => return Err(Error::Weights(p("kv_global: missing"))),
                (Some(_), false) => return Err(Error::Weights(p("kv_global: present on a non-writer layer"))),
            }
            let want_engram = c.engram.as_ref().filter(|e| e.layers.contains(&i));
            match (&l.engram, want_engram) {
                (None, None) => {}
                (Some(ew), Some(e)) => {
                    if ew.tables.len() != e.orders.len() * e.heads {
                        return Err(Error::Weights(p(&format!(
                            "engram: {} tables, expected {}",
                            ew.tables.len(),
                            e.orders.len() * e.heads
                        ))));
                    }
                    for (k, t) in ew.tables.iter().enumerate() {
                        shape(&p(&format!("engram table {k}")), t, e.table_rows, e.dim)?;
                    }
                    shape(&p("engram w_kv"), &ew.w_kv, 2 * d, e.width())?;
                }
                (None, Some(_)) => return Err(Error::Weights(p("engram: missing"))),
                (Some(_), None) => {
                    return Err(Error::Weights(p("engram: present on a layer the config does not name")))
                }
            }
            match (&l.kv_local, spec.local) {
                (Some(m), true) => shape(&p("kv_local"), m, kvd, d)?,
                (None, false) => {}
                (None, true) => return Err(Error::Weights(p("kv_local: missing"))),
                (Some(_), false) => return Err(Error::Weights(p("kv_local: present on a non-local layer"))),
            }
        }
        Ok(())
    }
}
