//! A model's config from GGUF metadata, read as llama.cpp reads each architecture: dimensions,
//! numerics switches, RoPE scaling and mixtures of experts.

use super::{GgufFile, Value};
use crate::error::{Error, Result};
use crate::model::config::{check_file_dims, MlpKind, ModelConfig, MoeConfig};
use crate::model::family::Family;
use crate::model::rope::{yarn_mscale, RopeScaling};

impl GgufFile {
    /// The model config from the metadata (architectures `llama` (Mixtral where it has experts),
    /// `qwen2`, `qwen3`, `smollm3`, `olmo2`, `phi3`, `gemma2`, `gemma3`, `qwen3moe`, `qwen2moe`,
    /// `olmoe`), and RoPE's per-pair factors from `rope_freqs.weight`
    /// (Llama 3.1) or `rope_factors_short/long.weight` (Phi-3's LongRoPE) where present.
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self.arch()?;
        let p = |k: &str| format!("{arch}.{k}");
        let d = self.need_u(&p("embedding_length"))?;
        let heads = self.need_u(&p("attention.head_count"))?;
        let kv_heads = self.get(&p("attention.head_count_kv")).and_then(Value::as_u64).map_or(heads, |v| v as usize);
        // Phi-3 rotates fewer dimensions than a head has: its rope.dimension_count is no head size
        let rot_count = self.get(&p("rope.dimension_count")).filter(|_| arch != "phi3");
        let head_dim = match self.get(&p("attention.key_length")).or(rot_count).and_then(Value::as_u64) {
            Some(v) => v as usize,
            None => d.checked_div(heads).unwrap_or(0),
        };
        let vocab = match self.get(&p("vocab_size")).and_then(Value::as_u64) {
            Some(v) => v as usize,
            None => self.get("tokenizer.ggml.tokens").and_then(Value::as_array).map_or(0, |a| a.len()),
        };
        let theta = self.get(&p("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10000.0) as f32;
        let eps = self.get(&p("attention.layer_norm_rms_epsilon")).and_then(Value::as_f64).unwrap_or(1e-5) as f32;
        let tied = self.tensor("output.weight").is_none();
        let layers = self.need_u(&p("block_count"))?;
        let ffn = self.need_u(&p("feed_forward_length"))?;
        check_file_dims(
            layers,
            vocab,
            &[
                ("embedding_length", d),
                ("head_count", heads),
                ("head_count_kv", kv_heads),
                ("head_dim", head_dim),
                ("feed_forward_length", ffn),
            ],
        )?;
        // every layer needs its tensors (Phi-3's fused ones are 6, the rest at least 9): a count
        // the tensor table cannot back is a lie
        let per_layer = if arch == "phi3" { 6 } else { 9 };
        if layers * per_layer > self.tensors.len() {
            return Err(Error::Config(format!(
                "block_count {layers} needs more tensors than the file's {}",
                self.tensors.len()
            )));
        }
        let mut rope_dims = None;
        if let Some(rot) = self.get(&p("rope.dimension_count")).and_then(Value::as_u64) {
            if arch == "phi3" && (rot as usize) < head_dim {
                rope_dims = Some(rot as usize);
            } else if rot as usize != head_dim {
                return Err(Error::Config(format!(
                    "{}: {rot} rotated dimensions of head_dim {head_dim}: partial rotary is read for phi3 files only",
                    p("rope.dimension_count")
                )));
            }
        }
        let mut c = ModelConfig::llama(vocab, d, heads, kv_heads, head_dim, ffn, layers, theta, eps, tied);
        c.rope_dims = rope_dims;
        c.rope_scaling = self.rope_scaling(arch, rope_dims.unwrap_or(head_dim))?;
        c.rope_scaling_local = c.rope_scaling.clone();
        c.moe = self.moe(arch, layers, ffn)?;
        // llama.cpp's converter writes Mixtral as a Llama with experts
        c.family = match Family::from_gguf_arch(arch) {
            Some(Family::Llama) if c.moe.is_some() => Family::Mixtral,
            f => f.unwrap_or(Family::Llama),
        };
        c.context_len = self
            .get(&p("context_length"))
            .and_then(Value::as_u64)
            .filter(|&n| n > 0 && n <= u32::MAX as u64)
            .map(|n| n as usize);
        match arch {
            "qwen2" => c.qkv_bias = true,
            "qwen3" | "qwen3moe" => c.qk_norm = true,
            "qwen2moe" => c.qkv_bias = true,
            // OLMoE's q/k norms span the whole projection, as OLMo 2's
            "olmoe" => (c.qk_norm, c.qk_norm_whole) = (true, true),
            "olmo2" => (c.qk_norm, c.qk_norm_whole, c.pre_norms, c.post_norms) = (true, true, false, true),
            "gpt-oss" => {
                // llama.cpp's gpt-oss: even layers slide (its swa pattern 2), biases on q/k/v/o
                // and the experts, a sink per head, the clamped SwiGLU (SWIGLU_OAI: 1.702, 7)
                c.set_sliding(self.need_u(&p("attention.sliding_window"))?, |i| i % 2 == 0);
                if let Some(base) = self.get(&p("rope.freq_base_swa")).and_then(Value::as_f64) {
                    c.rope_theta_local = base as f32;
                }
                c.qkv_bias = self.tensor("blk.0.attn_q.bias").is_some();
                c.o_bias = self.tensor("blk.0.attn_output.bias").is_some();
                c.attn_sinks = true;
                c.mlp = MlpKind::ClampedSwiGlu;
            }
            // llama.cpp's SmolLM3: every fourth layer rotates nothing (no key says so)
            "smollm3" => c.nope_layers = (0..layers).filter(|i| (i + 1) % 4 == 0).collect(),
            "gemma3" | "gemma2" => {
                // llama.cpp's Gemma 3: every 6th layer global, the rest a sliding window with RoPE
                // base 1e4; Gemma 2: even layers slide, one RoPE; norms stored as 1 + w already
                // (the converter adds the 1), so plain `w`
                let gemma2 = arch == "gemma2";
                let period = if gemma2 { 2 } else { 6 };
                c.set_sliding(self.need_u(&p("attention.sliding_window"))?, |i| (i + 1) % period != 0);
                if !gemma2 {
                    c.rope_theta_local = 10000.0;
                    c.rope_scaling_local = None;
                }
                c.qk_norm = !gemma2;
                c.post_norms = true;
                c.mlp = MlpKind::GeluTanhGated;
                c.embed_scale = (d as f32).sqrt();
                // llama.cpp: Gemma 2 27B (46 layers) scales by (d / heads)^-0.5, others by head_dim's
                let scale_dim = if gemma2 && layers == 46 { d / heads } else { head_dim };
                c.attn_scale = (scale_dim as f32).powf(-0.5);
                let softcap = |key: &str, default: Option<f64>| {
                    self.get(&p(key)).and_then(Value::as_f64).or(default).map(|v| v as f32)
                };
                c.logit_softcap = softcap("final_logit_softcapping", gemma2.then_some(30.0));
                c.attn_softcap = if gemma2 { softcap("attn_logit_softcapping", Some(50.0)) } else { None };
            }
            _ => {}
        }
        c.validate()?;
        Ok(c)
    }

    /// RoPE scaling as llama.cpp reads it: `rope.scaling.type` (`none`, `linear`, `yarn`; linear when
    /// only a factor is given) with `rope.scaling.factor`, or `rope_freqs.weight` (Llama 3.1's
    /// per-pair divisors). YaRN takes llama.cpp's constants (beta 32 and 1, rounded ramp ends) and
    /// `rope.scaling.attn_factor` on top of its usual `0.1 ln(factor) + 1`.
    fn rope_scaling(&self, arch: &str, head_dim: usize) -> Result<Option<RopeScaling>> {
        let p = |k: &str| format!("{arch}.{k}");
        let factor = self.get(&p("rope.scaling.factor")).and_then(Value::as_f64).filter(|&f| f != 0.0 && f != 1.0);
        let kind = self.get(&p("rope.scaling.type")).and_then(Value::as_str);
        let scaling = match (kind, factor) {
            (None | Some("none"), None) | (Some("linear"), None) => None,
            (None | Some("linear"), Some(f)) => Some(RopeScaling::Linear { factor: f as f32 }),
            (Some("yarn"), Some(f)) => {
                let original = self
                    .get(&p("rope.scaling.original_context_length"))
                    .or_else(|| self.get(&p("context_length")))
                    .and_then(Value::as_u64)
                    .unwrap_or(0) as usize;
                let attn = self.get(&p("rope.scaling.attn_factor")).and_then(Value::as_f64).unwrap_or(1.0);
                Some(RopeScaling::Yarn {
                    factor: f as f32,
                    original_context: original,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    attention_factor: (yarn_mscale(f, 1.0) * attn) as f32,
                    truncate: true,
                })
            }
            (Some(k), _) => {
                return Err(Error::Config(format!(
                    "{}: {k:?}{} is not supported (none, linear, yarn)",
                    p("rope.scaling.type"),
                    if factor.is_none() { " without a factor" } else { "" }
                )))
            }
        };
        if self.tensor("rope_freqs.weight").is_some() {
            if scaling.is_some() {
                return Err(Error::Config("rope_freqs.weight together with rope.scaling is not supported".into()));
            }
            return Ok(Some(RopeScaling::Divisors(self.vector("rope_freqs.weight", head_dim / 2)?)));
        }
        // Phi-3's LongRoPE: short and long divisors per pair, and the attention factor llama.cpp's
        // converter computed (cos and sin are multiplied by it whichever set is used)
        let (short, long) = (self.tensor("rope_factors_short.weight"), self.tensor("rope_factors_long.weight"));
        if short.is_some() || long.is_some() {
            if scaling.is_some() {
                return Err(Error::Config("rope_factors_*.weight together with rope.scaling is not supported".into()));
            }
            let original = self
                .get(&p("rope.scaling.original_context_length"))
                .and_then(Value::as_u64)
                .filter(|&n| n > 0 && n <= u32::MAX as u64)
                .ok_or_else(|| Error::Config(format!("{} is missing", p("rope.scaling.original_context_length"))))?;
            return Ok(Some(RopeScaling::LongRope {
                short: self.vector("rope_factors_short.weight", head_dim / 2)?,
                long: self.vector("rope_factors_long.weight", head_dim / 2)?,
                original_context: original as usize,
                attention_factor: self.get(&p("rope.scaling.attn_factor")).and_then(Value::as_f64).unwrap_or(1.0)
                    as f32,
            }));
        }
        Ok(scaling)
    }

    /// The architecture, if supported.
    pub(super) fn arch(&self) -> Result<&str> {
        let arch = self.get("general.architecture").and_then(Value::as_str).unwrap_or("");
        match arch {
            "llama" | "qwen2" | "qwen3" | "smollm3" | "olmo2" | "phi3" | "gemma2" | "gemma3" | "qwen3moe" | "qwen2moe"
            | "olmoe" | "gpt-oss" => Ok(arch),
            _ => Err(Error::Config(format!(
                "GGUF architecture {arch:?} is not supported (supported: llama, qwen2, qwen3, smollm3, olmo2, phi3, gemma2, gemma3, qwen3moe, qwen2moe, olmoe, gpt-oss)"
            ))),
        }
    }

    /// The mixture of experts as llama.cpp reads it: `expert_count` and `expert_used_count`, each
    /// expert's size from `expert_feed_forward_length` (`feed_forward_length` where absent, as for
    /// OLMoE and Mixtral), Qwen2-MoE's shared expert from `expert_shared_feed_forward_length`. A
    /// layer is a mixture where the file has its router (`blk.N.ffn_gate_inp.weight`). The top-k
    /// weights are renormalized as llama.cpp's graph for the architecture does (Qwen3-MoE and
    /// Mixtral do, Qwen2-MoE and OLMoE don't), or as `expert_weights_norm` says.
    fn moe(&self, arch: &str, layers: usize, ffn: usize) -> Result<Option<MoeConfig>> {
        let p = |k: &str| format!("{arch}.{k}");
        let sparse = matches!(arch, "qwen3moe" | "qwen2moe" | "olmoe" | "gpt-oss");
        // the dense architectures other than llama (Mixtral's) have no experts whatever the keys say
        if !sparse && arch != "llama" {
            return Ok(None);
        }
        let Some(experts) = self.get(&p("expert_count")).and_then(Value::as_u64).filter(|&n| n > 0) else {
            if sparse {
                return Err(Error::Config(format!("{} is missing for a mixture of experts", p("expert_count"))));
            }
            return Ok(None);
        };
        let top_k = self.need_u(&p("expert_used_count"))?;
        let expert_ffn = self.get(&p("expert_feed_forward_length")).and_then(Value::as_u64).map_or(ffn, |v| v as usize);
        let shared_ffn = match arch {
            "qwen2moe" => self.need_u(&p("expert_shared_feed_forward_length"))?,
            _ => 0,
        };
        check_file_dims(
            layers,
            0,
            &[
                ("expert_count", experts as usize),
                ("expert_used_count", top_k),
                ("expert_feed_forward_length", expert_ffn),
                ("expert_shared_feed_forward_length", shared_ffn),
            ],
        )?;
        if let Some(scale) = self.get(&p("expert_weights_scale")).and_then(Value::as_f64) {
            if scale != 0.0 && scale != 1.0 {
                return Err(Error::Config(format!("{} {scale} is not supported (1)", p("expert_weights_scale"))));
            }
        }
        if let Some(gating) = self.get(&p("expert_gating_func")).and_then(Value::as_u64) {
            // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (gpt-oss's graph takes
            // SOFTMAX_WEIGHT, 3, whatever the key says: the same weights renormalized)
            if gating != 1 && !(arch == "gpt-oss" && gating == 3) {
                return Err(Error::Config(format!(
                    "{} {gating} is not supported (1, softmax)",
                    p("expert_gating_func")
                )));
            }
        }
        let norm_topk = match self.get(&p("expert_weights_norm")) {
            Some(Value::Bool(b)) => *b,
            _ => matches!(arch, "qwen3moe" | "llama" | "gpt-oss"),
        };
        let layers: Vec<usize> =
            (0..layers).filter(|i| self.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some()).collect();
        if layers.is_empty() {
            return Err(Error::Config(format!("{} is {experts} but no layer has a router", p("expert_count"))));
        }
        Ok(Some(MoeConfig {
            experts: experts as usize,
            top_k,
            ffn: expert_ffn,
            layers,
            norm_topk,
            shared_ffn: (shared_ffn > 0).then_some(shared_ffn),
            // gpt-oss's router and experts carry biases
            bias: arch == "gpt-oss",
        }))
    }
}
