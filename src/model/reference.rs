//! The CPU reference forward: full recomputation of every position's logits, no cache.
//! It is the oracle for every GPU path. f32 weights and activations, f64 accumulation.

use crate::error::{Error, Result};
use crate::model::config::{MlpKind, ModelConfig, MoeConfig, NormKind, SWIGLU_ALPHA, SWIGLU_LIMIT};
use crate::model::dtype::KvDtype;
use crate::model::lora::{LoraAdapter, LoraTarget};
use crate::model::rope::Rope;
use crate::model::weights::{Matrix, ModelWeights};

/// RoPE (cos, sin) of plain RoPE with base `theta` for positions `0..n_pos`, `[n_pos,
/// head_dim / 2]` ([`Rope::table`]).
pub fn rope_table(theta: f32, head_dim: usize, n_pos: usize) -> Vec<[f32; 2]> {
    Rope { theta, scaling: None, dims: None }.table(head_dim, n_pos)
}

/// The multiplier a stored norm weight stands for under `kind`.
pub fn norm_multiplier(kind: NormKind, w: &[f32]) -> Vec<f32> {
    match kind {
        NormKind::OnePlusWeight => w.iter().map(|v| 1.0 + v).collect(),
        _ => w.to_vec(),
    }
}

fn rms_norm(x: &[f32], w: Option<&[f32]>, kind: NormKind, eps: f32) -> Vec<f32> {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = 1.0 / (ss / x.len() as f64 + eps as f64).sqrt();
    let mult = w.map(|w| norm_multiplier(kind, w));
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let y = v as f64 * inv;
            match &mult {
                Some(m) => (y * m[i] as f64) as f32,
                None => y as f32,
            }
        })
        .collect()
}

/// `m x` for every `x` of `xs`, each output an f64 sum over the row in column order, rounded
/// once. Tokens go through a weight row eight at a time: eight independent sums in flight instead
/// of one chain of dependent adds, and the row read once for all eight (SmolLM2's 128 positions
/// in less than half the time). Each sum is the same one, in the same order, as a token alone.
fn matmat(m: &Matrix, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    const BLOCK: usize = 8;
    let cols = m.cols;
    // a sum runs over the shorter of the row and the input, as `zip` would; a partial block's
    // missing inputs are zeros whose sums are dropped
    let zeros = vec![0f32; cols];
    let mut out = vec![vec![0f32; m.rows]; xs.len()];
    for (b, block) in xs.chunks(BLOCK).enumerate() {
        let n = block.iter().map(|x| x.len()).min().unwrap_or(0).min(cols);
        let inputs: [&[f32]; BLOCK] = std::array::from_fn(|j| block.get(j).map_or(&zeros[..n], |x| &x[..n]));
        for (r, row) in (0..m.rows).map(|r| &m.row(r)[..n]).enumerate() {
            let mut sums = [-0.0f64; BLOCK];
            for (k, &a) in row.iter().enumerate() {
                for (sum, x) in sums.iter_mut().zip(&inputs) {
                    *sum += a as f64 * x[k] as f64;
                }
            }
            for (j, sum) in sums.iter().take(block.len()).enumerate() {
                out[b * BLOCK + j][r] = *sum as f32;
            }
        }
        // an input longer than the block's shortest (no model makes one) is summed alone, over
        // its own length
        for (j, x) in block.iter().enumerate().filter(|(_, x)| x.len().min(cols) > n) {
            for (y, r) in out[b * BLOCK + j].iter_mut().zip(0..m.rows) {
                *y = m.row(r).iter().zip(x).map(|(&a, &v)| a as f64 * v as f64).sum::<f64>() as f32;
            }
        }
    }
    out
}

fn rope(x: &mut [f32], cs: &[[f32; 2]]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        let [c, s] = cs[i];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// Per-token K and V after norm and RoPE, `[T][n_kv_heads * head_dim]` each.
struct Kv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// What the reference models beyond the weights and tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct RefOptions<'a> {
    /// Round keys and values to the values a cache of this type stores (`None`: exact f32).
    pub kv: Option<KvDtype>,
    /// Key-padding mask over positions: the key at position `s` is seen by later queries only
    /// where `key_mask[s]`; every query always sees its own key (the seed's forced diagonal, which
    /// keeps a padding query's softmax finite).
    pub key_mask: Option<&'a [bool]>,
    /// A LoRA adapter applied unmerged: every projection it changes gives `W x + scale B (A x)`.
    pub lora: Option<&'a LoraAdapter>,
}

/// `x` as stored in a K/V cache of type `kv` (round to nearest even).
pub fn round_kv(kv: Option<KvDtype>, x: f32) -> f32 {
    match kv {
        Some(KvDtype::F16) => half::f16::from_f32(x).to_f32(),
        Some(KvDtype::BF16) => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `m x (+ bias)` for every `x` of `xs`.
fn project(m: &Matrix, bias: Option<&[f32]>, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let mut ys = matmat(m, xs);
    for y in &mut ys {
        for (y, b) in y.iter_mut().zip(bias.unwrap_or(&[])) {
            *y += b;
        }
    }
    ys
}

#[allow(clippy::too_many_arguments)]
fn project_kv(
    cfg: &ModelConfig,
    w: &Matrix,
    bias: Option<&[f32]>,
    k_norm: Option<&[f32]>,
    h: &[Vec<f32>],
    rope_t: Option<&[[f32; 2]]>,
    kv_type: Option<KvDtype>,
    lora: Option<(&LoraAdapter, usize)>,
) -> Kv {
    let (hk, d) = (cfg.n_kv_heads, cfg.head_dim);
    let half = d / 2;
    let mut kv = Kv { k: Vec::new(), v: Vec::new() };
    let mut outs = project(w, bias, h);
    if let Some((l, layer)) = lora {
        l.add_to(layer, LoraTarget::K, h, &mut outs, 0);
        l.add_to(layer, LoraTarget::V, h, &mut outs, hk * d);
    }
    for (t, out) in outs.into_iter().enumerate() {
        let mut k = out[..hk * d].to_vec();
        if cfg.qk_norm_whole {
            k = rms_norm(&k, k_norm, cfg.norm, cfg.norm_eps);
        }
        for head in k.chunks_mut(d) {
            if cfg.qk_norm && !cfg.qk_norm_whole {
                let n = rms_norm(head, k_norm, cfg.norm, cfg.norm_eps);
                head.copy_from_slice(&n);
            }
            if let Some(r) = rope_t {
                rope(head, &r[t * half..(t + 1) * half]);
            }
        }
        kv.k.push(k.iter().map(|&x| round_kv(kv_type, x)).collect());
        kv.v.push(out[hk * d..].iter().map(|&x| round_kv(kv_type, x)).collect());
    }
    kv
}

/// Logits `[T, vocab]` at every position of `tokens` (position `t` sees tokens `0..=t`).
pub fn forward(w: &ModelWeights, tokens: &[u32]) -> Result<Vec<f32>> {
    forward_with(w, tokens, RefOptions::default())
}

/// [`forward`] with K/V rounded as a 16-bit cache stores them and/or a key-padding mask.
pub fn forward_with(w: &ModelWeights, tokens: &[u32], opts: RefOptions<'_>) -> Result<Vec<f32>> {
    forward_routed(w, tokens, opts).map(|(logits, _)| logits)
}

/// [`forward_with`], and the experts each token was routed to: `[T, moe layers, top_k]`, each
/// token's experts in the router's order (empty for a dense model).
pub fn forward_routed(w: &ModelWeights, tokens: &[u32], opts: RefOptions<'_>) -> Result<(Vec<f32>, Vec<u32>)> {
    let cfg = &w.cfg;
    if let Some(m) = opts.key_mask {
        if m.len() != tokens.len() {
            return Err(Error::Input(format!(
                "key_mask covers {} positions but there are {} tokens",
                m.len(),
                tokens.len()
            )));
        }
    }
    let visible = |t: usize, s: usize| s == t || opts.key_mask.is_none_or(|m| m[s]);
    for (i, &t) in tokens.iter().enumerate() {
        if t as usize >= cfg.vocab {
            return Err(Error::Input(format!("token {i} = {t} is outside the vocabulary ({})", cfg.vocab)));
        }
    }
    let n = tokens.len();
    let (h_n, hk, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let rep = h_n / hk;
    let half = d / 2;
    let mut x: Vec<Vec<f32>> =
        tokens.iter().map(|&t| w.embed.row(t as usize).iter().map(|v| v * cfg.embed_scale).collect()).collect();
    let mut groups: Vec<Kv> = Vec::new();
    let cid = |t: u32| w.cid_map.as_ref().map_or(t, |m| m[t as usize]);
    let cids: Vec<u32> = tokens.iter().map(|&t| cid(t)).collect();
    let before_start = cid(0);
    // per token, per MoE layer, its experts
    let mut routes: Vec<Vec<u32>> = vec![Vec::new(); n];
    for (li, (lw, spec)) in w.layers.iter().zip(&cfg.layers).enumerate() {
        if let (Some(ew), Some(e)) = (&lw.engram, &cfg.engram) {
            let add: Vec<Vec<f32>> = (0..n)
                .map(|t| {
                    crate::model::engram::residual(e, &ew.tables, &ew.w_kv, &x[t], &cids, before_start, t, cfg.norm_eps)
                })
                .collect();
            for (xt, a) in x.iter_mut().zip(add) {
                for (v, av) in xt.iter_mut().zip(a) {
                    *v += av;
                }
            }
        }
        let rope_t = cfg.layer_rope(li).map(|r| r.table(d, n.max(1)));
        let rope_t = rope_t.as_deref();
        // the block's input: the stream's norm, or (OLMo 2) the stream itself
        let block_in = |xt: &Vec<f32>, w: Option<&[f32]>| {
            if cfg.pre_norms {
                rms_norm(xt, w, cfg.norm, cfg.norm_eps)
            } else {
                xt.clone()
            }
        };
        let h: Vec<Vec<f32>> = x.iter().map(|xt| block_in(xt, lw.attn_norm.as_deref())).collect();
        let lora = opts.lora.map(|l| (l, li));
        let add_lora = |target, xs: &[Vec<f32>], ys: &mut [Vec<f32>], at| {
            if let Some(l) = opts.lora {
                l.add_to(li, target, xs, ys, at);
            }
        };
        if spec.writes_global {
            let kv_global = lw.kv_global.as_ref().expect("checked");
            let (bias, norm) = (lw.kv_bias.as_deref(), lw.k_norm.as_deref());
            groups.push(project_kv(cfg, kv_global, bias, norm, &h, rope_t, opts.kv, lora));
        }
        let local = spec.local.then(|| {
            let kv_local = lw.kv_local.as_ref().expect("checked");
            project_kv(cfg, kv_local, lw.kv_bias.as_deref(), lw.k_norm.as_deref(), &h, rope_t, opts.kv, lora)
        });
        let global = spec.global_group.map(|g| &groups[g]);
        let mut ys = Vec::with_capacity(n);
        let mut qs = project(&lw.wq, lw.q_bias.as_deref(), &h);
        add_lora(LoraTarget::Q, &h, &mut qs, 0);
        for (t, mut q) in qs.into_iter().enumerate() {
            if cfg.qk_norm_whole {
                q = rms_norm(&q, lw.q_norm.as_deref(), cfg.norm, cfg.norm_eps);
            }
            for head in q.chunks_mut(d) {
                if cfg.qk_norm && !cfg.qk_norm_whole {
                    let nq = rms_norm(head, lw.q_norm.as_deref(), cfg.norm, cfg.norm_eps);
                    head.copy_from_slice(&nq);
                }
                if let Some(r) = rope_t {
                    rope(head, &r[t * half..(t + 1) * half]);
                }
            }
            let mut y = vec![0f32; h_n * d];
            for head in 0..h_n {
                let kh = head / rep;
                let qh = &q[head * d..(head + 1) * d];
                // (score, cache, position) for every visible key: global then local, one softmax
                let mut keys: Vec<(f64, &Kv, usize)> = Vec::new();
                let score = |kv: &Kv, s: usize| -> f64 {
                    let k = &kv.k[s][kh * d..(kh + 1) * d];
                    let s = qh.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * cfg.attn_scale as f64;
                    match cfg.attn_softcap {
                        Some(c) => c as f64 * (s / c as f64).tanh(),
                        None => s,
                    }
                };
                if let Some(g) = global {
                    keys.extend((0..=t).filter(|&s| visible(t, s)).map(|s| (score(g, s), g, s)));
                }
                if let Some(l) = &local {
                    let first = (t + 1).saturating_sub(cfg.window);
                    keys.extend((first..=t).filter(|&s| visible(t, s)).map(|s| (score(l, s), l, s)));
                }
                // a sink (gpt-oss) is one more logit in the denominator, with no value
                let sink = lw.sinks.as_ref().map(|s| s[head] as f64);
                let m = keys.iter().map(|k| k.0).chain(sink).fold(f64::NEG_INFINITY, f64::max);
                let denom: f64 = keys.iter().map(|k| k.0).chain(sink).map(|s| (s - m).exp()).sum();
                for &(s, kv, at) in &keys {
                    let p = (s - m).exp() / denom;
                    let v = &kv.v[at][kh * d..(kh + 1) * d];
                    for (o, &vv) in y[head * d..(head + 1) * d].iter_mut().zip(v) {
                        *o += (p * vv as f64) as f32;
                    }
                }
            }
            ys.push(y);
        }
        // every token's attention read h, so the residuals can all be added now
        let mut os = project(&lw.wo, lw.o_bias.as_deref(), &ys);
        add_lora(LoraTarget::O, &ys, &mut os, 0);
        for (xt, mut o) in x.iter_mut().zip(os) {
            if cfg.post_norms {
                o = rms_norm(&o, lw.post_attn_norm.as_deref(), cfg.norm, cfg.norm_eps);
            }
            for (a, b) in xt.iter_mut().zip(&o) {
                *a += b;
            }
        }
        let h2: Vec<Vec<f32>> = x.iter().map(|xt| block_in(xt, lw.mlp_norm.as_deref())).collect();
        let f = cfg.layer_ffn(li);
        let mlp_outs = match (&cfg.moe, &lw.router) {
            (Some(moe), Some(router)) => {
                let mut outs = Vec::with_capacity(n);
                // a product's rows `r0 ..` with their biases, where the layer has them (gpt-oss)
                let biased = |m: &Matrix, bias: Option<&Vec<f32>>, r0: usize, n: usize, x: &[f32]| {
                    let mut y = rows_dot(m, r0, n, x);
                    if let Some(b) = bias {
                        y.iter_mut().zip(&b[r0..r0 + n]).for_each(|(v, b)| *v += b);
                    }
                    y
                };
                for (t, (h, logits)) in h2.iter().zip(project(router, lw.router_bias.as_deref(), &h2)).enumerate() {
                    let (experts, weights) = route(moe, &logits);
                    let mut sum = vec![0f64; cfg.d_model];
                    for (&e, &wt) in experts.iter().zip(&weights) {
                        let e = e as usize;
                        let gate = biased(&lw.mlp_in, lw.mlp_in_bias.as_ref(), e * f, f, h);
                        let up = biased(&lw.mlp_in, lw.mlp_in_bias.as_ref(), (moe.experts + e) * f, f, h);
                        let a: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| gated(cfg.mlp, g, u)).collect();
                        let y = biased(&lw.mlp_out, lw.mlp_out_bias.as_ref(), e * cfg.d_model, cfg.d_model, &a);
                        for (s, y) in sum.iter_mut().zip(y) {
                            *s += wt * y as f64;
                        }
                    }
                    routes[t].extend(experts);
                    let mut out: Vec<f32> = sum.into_iter().map(|v| v as f32).collect();
                    // the shared expert, weighed by the sigmoid of its gate, beside the routed sum
                    if let Some(s) = &lw.shared_expert {
                        let fs = s.mlp_out.cols;
                        let (gate, up) = (rows_dot(&s.mlp_in, 0, fs, h), rows_dot(&s.mlp_in, fs, fs, h));
                        let a: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| gated(cfg.mlp, g, u)).collect();
                        let g = rows_dot(&s.gate, 0, 1, h)[0];
                        let weight = 1.0 / (1.0 + (-g as f64).exp());
                        for (o, y) in out.iter_mut().zip(rows_dot(&s.mlp_out, 0, cfg.d_model, &a)) {
                            *o = (*o as f64 + weight * y as f64) as f32;
                        }
                    }
                    outs.push(out);
                }
                outs
            }
            _ => {
                let mut us = matmat(&lw.mlp_in, &h2);
                add_lora(LoraTarget::Gate, &h2, &mut us, 0);
                add_lora(LoraTarget::Up, &h2, &mut us, f);
                let acts: Vec<Vec<f32>> = us
                    .into_iter()
                    .map(|u| match cfg.mlp {
                        MlpKind::ReluSquared => u.iter().map(|&v| v.max(0.0) * v.max(0.0)).collect(),
                        kind => (0..f).map(|i| gated(kind, u[i], u[f + i])).collect(),
                    })
                    .collect();
                let mut downs = matmat(&lw.mlp_out, &acts);
                add_lora(LoraTarget::Down, &acts, &mut downs, 0);
                downs
            }
        };
        for (xt, mut mo) in x.iter_mut().zip(mlp_outs) {
            if cfg.post_norms {
                mo = rms_norm(&mo, lw.post_mlp_norm.as_deref(), cfg.norm, cfg.norm_eps);
            }
            for (a, b) in xt.iter_mut().zip(&mo) {
                *a += b;
            }
        }
    }
    let mut logits = Vec::with_capacity(n * cfg.vocab);
    let normed: Vec<Vec<f32>> =
        x.iter().map(|xt| rms_norm(xt, w.final_norm.as_deref(), cfg.norm, cfg.norm_eps)).collect();
    for mut l in matmat(w.head(), &normed) {
        if let Some(c) = cfg.logit_softcap {
            for v in &mut l {
                *v = c * (*v / c).tanh();
            }
        }
        logits.extend(l);
    }
    Ok((logits, routes.concat()))
}

/// A MoE router's choice for one token from its logits: the `top_k` experts of the highest
/// logits (the highest probabilities: softmax keeps their order), ties to the lower expert id,
/// and their weights, the softmax over all experts (f64), renormalized over the chosen ones with
/// `norm_topk`.
pub fn route(moe: &MoeConfig, logits: &[f32]) -> (Vec<u32>, Vec<f64>) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // a stable sort: equal logits keep ascending ids
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let top: Vec<u32> = order[..moe.top_k].iter().map(|&e| e as u32).collect();
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let denom: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let mut weights: Vec<f64> = top.iter().map(|&e| (logits[e as usize] as f64 - max).exp() / denom).collect();
    if moe.norm_topk {
        let total: f64 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= total);
    }
    (top, weights)
}

/// Rows `r0 .. r0 + n` of `m` times `x`, each an f64 sum in column order, rounded once.
fn rows_dot(m: &Matrix, r0: usize, n: usize, x: &[f32]) -> Vec<f32> {
    (r0..r0 + n).map(|r| m.row(r).iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32).collect()
}

/// A gated MLP's activation of a gate `g` and its up projection `u` (common.wgsl's `mlp_act`).
fn gated(kind: MlpKind, g: f32, u: f32) -> f32 {
    match kind {
        MlpKind::GeluTanhGated => gelu_tanh(g) * u,
        MlpKind::SwiGlu => silu(g) * u,
        MlpKind::ReluSquared => g.max(0.0) * g.max(0.0) * u,
        MlpKind::ClampedSwiGlu => {
            let g = g.min(SWIGLU_LIMIT);
            let u = u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT);
            (u + 1.0) * (g / (1.0 + (-SWIGLU_ALPHA * g).exp()))
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())
}
