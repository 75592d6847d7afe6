//! RoPE: the frequency of each rotated pair and the (cos, sin) table a layer rotates by.
//!
//! Every scaling scheme of the supported families (linear, Llama 3's, YaRN) only changes the
//! frequencies and, for YaRN, multiplies cos and sin by an attention factor; positions rotate
//! as usual. So one table per distinct [`Rope`] holds it all, computed on the host in f64 and
//! shared by the CPU reference and the GPU (GPU sin/cos of large arguments is not accurate on
//! every backend). The formulas follow Hugging Face transformers' `modeling_rope_utils.py`.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a model stretches RoPE past the context it was first trained for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Positions divided by `factor` (every frequency over `factor`).
    Linear {
        /// The stretch.
        factor: f32,
    },
    /// Llama 3.1's: low frequencies over `factor`, high ones kept, a smooth blend between.
    Llama3 {
        /// The stretch of the low frequencies.
        factor: f32,
        /// Wavelengths longer than `original_context / low_freq_factor` are stretched.
        low_freq_factor: f32,
        /// Wavelengths shorter than `original_context / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// The context the unscaled model was trained for.
        original_context: usize,
    },
    /// YaRN: frequencies blended between interpolated and kept by a linear ramp over the pairs,
    /// and cos and sin multiplied by `attention_factor`.
    Yarn {
        /// The stretch.
        factor: f32,
        /// The context the unscaled model was trained for.
        original_context: usize,
        /// Pairs that rotate more than this many times over `original_context` are kept.
        beta_fast: f32,
        /// Pairs that rotate fewer than this many times are interpolated.
        beta_slow: f32,
        /// Multiplies cos and sin (transformers' default `0.1 ln(factor) + 1`).
        attention_factor: f32,
        /// Round the ramp's ends to whole pairs (transformers' default).
        truncate: bool,
    },
    /// Each pair's frequency divided by its own factor: GGUF's `rope_freqs.weight`, which
    /// llama.cpp's converter computes from Llama 3.1's scaling.
    Divisors(Vec<f32>),
    /// Phi-3's LongRoPE: each pair's frequency divided by its own factor, from `long` when the
    /// table spans more than `original_context` positions and from `short` otherwise, and cos and
    /// sin multiplied by `attention_factor` either way.
    LongRope {
        /// Divisors within the original context.
        short: Vec<f32>,
        /// Divisors beyond it.
        long: Vec<f32>,
        /// The context the short factors serve.
        original_context: usize,
        /// Multiplies cos and sin (transformers' default `sqrt(1 + ln(s) / ln(original))`, `s` the
        /// trained context over the original).
        attention_factor: f32,
    },
}

/// What one layer's RoPE is.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The base: pair `i` of the `dims` rotated turns at `theta^(-2i / dims)` radians per position.
    pub theta: f32,
    /// A stretch of the frequencies, if any.
    pub scaling: Option<RopeScaling>,
    /// Dimensions of a head that rotate (Phi's partial rotary), `None`: all of them. The pairs past
    /// `dims / 2` of the table are the identity (cos 1, sin 0), so the dimensions they pair pass
    /// through unchanged; the loaders order each head's rows so that the rotated pairs come first
    /// ([`crate::model::family::RowOrder::PartialRotary`]).
    pub dims: Option<usize>,
}

/// YaRN's default attention factor for a stretch (transformers' `get_mscale`).
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

impl RopeScaling {
    /// Check the parameters for `head_dim` rotated dimensions (a config outside them gets an
    /// error naming the key).
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let err = |m: String| Err(Error::Config(format!("rope scaling: {m}")));
        let positive = |name: &str, v: f32| {
            if v > 0.0 && v.is_finite() {
                Ok(())
            } else {
                err(format!("{name} {v} must be positive"))
            }
        };
        match *self {
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return err(format!(
                        "high_freq_factor {high_freq_factor} must be larger than low_freq_factor {low_freq_factor}"
                    ));
                }
                if original_context == 0 {
                    return err("original_max_position_embeddings must be >= 1".into());
                }
                Ok(())
            }
            RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, attention_factor, .. } => {
                positive("factor", factor)?;
                positive("beta_fast", beta_fast)?;
                positive("beta_slow", beta_slow)?;
                positive("attention_factor", attention_factor)?;
                if original_context == 0 {
                    return err("original_max_position_embeddings must be >= 1".into());
                }
                Ok(())
            }
            RopeScaling::Divisors(ref d) => {
                if d.len() != head_dim / 2 {
                    return err(format!("{} rope_freqs for head_dim {head_dim} (expected {})", d.len(), head_dim / 2));
                }
                d.iter().enumerate().try_for_each(|(i, &v)| positive(&format!("rope_freqs[{i}]"), v))
            }
            RopeScaling::LongRope { ref short, ref long, original_context, attention_factor } => {
                positive("attention_factor", attention_factor)?;
                if original_context == 0 {
                    return err("original_max_position_embeddings must be >= 1".into());
                }
                for (name, f) in [("short_factor", short), ("long_factor", long)] {
                    if f.len() != head_dim / 2 {
                        return err(format!(
                            "{} {name} values for {head_dim} rotated dimensions (expected {})",
                            f.len(),
                            head_dim / 2
                        ));
                    }
                    f.iter().enumerate().try_for_each(|(i, &v)| positive(&format!("{name}[{i}]"), v))?;
                }
                Ok(())
            }
        }
    }
}

impl Rope {
    /// The radians per position of each rotated pair of a head of `head_dim` (its first
    /// `dims / 2` pairs), and the factor on cos and sin, in f64 (transformers works in f32: the
    /// difference is its rounding), for a table of `n_pos` positions (LongRoPE's factors depend
    /// on it).
    pub fn frequencies(&self, head_dim: usize, n_pos: usize) -> (Vec<f64>, f64) {
        let head_dim = self.dims.unwrap_or(head_dim).min(head_dim);
        let half = head_dim / 2;
        let base = self.theta as f64;
        let default: Vec<f64> = (0..half).map(|i| base.powf(-((2 * i) as f64) / head_dim as f64)).collect();
        match self.scaling.as_ref() {
            None => (default, 1.0),
            Some(&RopeScaling::Linear { factor }) => (default.iter().map(|f| f / factor as f64).collect(), 1.0),
            Some(&RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context }) => {
                let (factor, low, high) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
                let old = original_context as f64;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                let freqs = default
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (freqs, 1.0)
            }
            Some(&RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, attention_factor, truncate }) => {
                let (dim, factor) = (head_dim as f64, factor as f64);
                // the pair index at which a frequency turns `rotations` times over the context
                let correction =
                    |rotations: f64| dim * (original_context as f64 / (rotations * 2.0 * PI)).ln() / (2.0 * base.ln());
                let (mut low, mut high) = (correction(beta_fast as f64), correction(beta_slow as f64));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let freqs = default
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        // 1 keeps the frequency (extrapolation), 0 divides it by the factor
                        let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        f / factor * (1.0 - keep) + f * keep
                    })
                    .collect();
                (freqs, attention_factor as f64)
            }
            Some(RopeScaling::Divisors(d)) => (default.iter().zip(d).map(|(f, &by)| f / by as f64).collect(), 1.0),
            Some(RopeScaling::LongRope { short, long, original_context, attention_factor }) => {
                let by = if n_pos > *original_context { long } else { short };
                (default.iter().zip(by).map(|(f, &by)| f / by as f64).collect(), *attention_factor as f64)
            }
        }
    }

    /// (cos, sin) for positions `0..n_pos`, `[n_pos, head_dim / 2]`: the angles in f64, rounded
    /// to f32 once. Pairs past the rotated ones are (1, 0), which leaves their dimensions as they
    /// are, bit for bit.
    pub fn table(&self, head_dim: usize, n_pos: usize) -> Vec<[f32; 2]> {
        let (freqs, scale) = self.frequencies(head_dim, n_pos);
        let mut out = Vec::with_capacity(n_pos * head_dim / 2);
        for p in 0..n_pos {
            for &f in &freqs {
                let a = p as f64 * f;
                out.push([(a.cos() * scale) as f32, (a.sin() * scale) as f32]);
            }
            out.extend(std::iter::repeat_n([1.0, 0.0], head_dim / 2 - freqs.len()));
        }
        out
    }
}
