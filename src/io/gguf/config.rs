//! A model's config from GGUF metadata, read as llama.cpp reads each architecture: the dimensions
//! and RoPE scaling here; the numerics switches and mixtures of experts in each family's file
//! (`model/family/`), from the keys handed over ([`GgufKeys`]).

use super::{GgufFile, Value};
use crate::error::{Error, Result};
use crate::model::config::{check_file_dims, ModelConfig};
use crate::model::family::{Family, GgufKeys};
use crate::model::rope::{yarn_mscale, RopeScaling};

/// A GGUF file's metadata and tensor table as a family reads them ([`GgufKeys`]).
struct MetaKeys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl GgufKeys for MetaKeys<'_> {
    fn arch(&self) -> &str {
        self.arch
    }
    fn u64(&self, key: &str) -> Option<u64> {
        self.file.get(&self.name(key)).and_then(Value::as_u64)
    }
    fn need_usize(&self, key: &str) -> Result<usize> {
        self.file.need_u(&self.name(key))
    }
    fn f64(&self, key: &str) -> Option<f64> {
        self.file.get(&self.name(key)).and_then(Value::as_f64)
    }
    fn bool(&self, key: &str) -> Option<bool> {
        match self.file.get(&self.name(key)) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }
    fn has_tensor(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }
}

impl GgufFile {
    /// The model config from the metadata: the dimensions, RoPE (and its per-pair factors from
    /// `rope_freqs.weight` (Llama 3.1) or `rope_factors_short/long.weight` (Phi-3's LongRoPE)
    /// where present) and the context here, the rest by the family's file ([`Family::spec`]) of
    /// `general.architecture`.
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self.arch()?;
        let family = Family::from_gguf_arch(arch).unwrap_or(Family::Llama);
        let facts = &family.spec().gguf;
        let p = |k: &str| format!("{arch}.{k}");
        let d = self.need_u(&p("embedding_length"))?;
        let heads = self.need_u(&p("attention.head_count"))?;
        let kv_heads = self.get(&p("attention.head_count_kv")).and_then(Value::as_u64).map_or(heads, |v| v as usize);
        // a partial rotary family's rope.dimension_count is no head size
        let rot_count = self.get(&p("rope.dimension_count")).filter(|_| !facts.partial_rotary);
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
        // every layer needs its tensors: a count the tensor table cannot back is a lie
        if layers * facts.layer_tensors > self.tensors.len() {
            return Err(Error::Config(format!(
                "block_count {layers} needs more tensors than the file's {}",
                self.tensors.len()
            )));
        }
        let mut rope_dims = None;
        if let Some(rot) = self.get(&p("rope.dimension_count")).and_then(Value::as_u64) {
            if facts.partial_rotary && (rot as usize) < head_dim {
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
        c.family = family;
        c.context_len = self
            .get(&p("context_length"))
            .and_then(Value::as_u64)
            .filter(|&n| n > 0 && n <= u32::MAX as u64)
            .map(|n| n as usize);
        (family.spec().from_gguf)(&mut c, &MetaKeys { file: self, arch })?;
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

    /// The architecture, if a family reads it.
    pub(super) fn arch(&self) -> Result<&str> {
        let arch = self.get("general.architecture").and_then(Value::as_str).unwrap_or("");
        match Family::from_gguf_arch(arch) {
            Some(_) => Ok(arch),
            None => Err(Error::Config(format!(
                "GGUF architecture {arch:?} is not supported (supported: {})",
                Family::gguf_arch_names().join(", ")
            ))),
        }
    }
}
