//! How weights are stored on the GPU: the shaders' `W_FORMAT` codes and names. The decoding of
//! each block format lives in `common.wgsl`.

use crate::model::quant::QuantKind;

/// How weights are stored on the GPU (`W_FORMAT`; the block decoding lives in `common.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// f32 bits.
    F32,
    /// IEEE halves, two per word.
    F16,
    /// bfloat16, two per word.
    BF16,
    /// Blocks of 32: f16 scale, 32 int8.
    Q8_0,
    /// Blocks of 32: f16 scale, 32 nibbles.
    Q4_0,
    /// Blocks of 32: f16 scale and min, 32 nibbles.
    Q4_1,
    /// llama.cpp's K-quant blocks of 256, 4 bits.
    Q4K,
    /// llama.cpp's K-quant blocks of 256, 6 bits.
    Q6K,
    /// Blocks of 32: f16 scale, the fifth bits, 32 nibbles.
    Q5_0,
    /// Blocks of 32: f16 scale and min, the fifth bits, 32 nibbles.
    Q5_1,
    /// Blocks of 32: f16 scale, 32 indices into the IQ4_NL table.
    IQ4NL,
    /// llama.cpp's K-quant blocks of 256, 5 bits.
    Q5K,
    /// llama.cpp's K-quant blocks of 256, 3 bits.
    Q3K,
    /// llama.cpp's K-quant blocks of 256, 2 bits.
    Q2K,
    /// Blocks of 256: IQ4_NL's table indices with a 6-bit scale per 32.
    IQ4XS,
    /// Blocks of 32: a power-of-two scale (as f32 bits), 32 indices into MXFP4's E2M1 values.
    MXFP4,
}

impl WeightFormat {
    /// The shaders' `W_FORMAT` code (common.wgsl).
    pub(crate) fn code(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::F16 => 1,
            WeightFormat::Q8_0 => 2,
            WeightFormat::Q4_0 => 3,
            WeightFormat::Q4_1 => 4,
            WeightFormat::BF16 => 5,
            WeightFormat::Q4K => 6,
            WeightFormat::Q6K => 7,
            WeightFormat::Q5_0 => 8,
            WeightFormat::Q5_1 => 9,
            WeightFormat::IQ4NL => 10,
            WeightFormat::Q5K => 11,
            WeightFormat::Q3K => 12,
            WeightFormat::Q2K => 13,
            WeightFormat::IQ4XS => 14,
            WeightFormat::MXFP4 => 15,
        }
    }

    /// The name in labels.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::BF16 => "bf16",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q4K => "q4_k",
            WeightFormat::Q6K => "q6_k",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q5_1 => "q5_1",
            WeightFormat::IQ4NL => "iq4_nl",
            WeightFormat::Q5K => "q5_k",
            WeightFormat::Q3K => "q3_k",
            WeightFormat::Q2K => "q2_k",
            WeightFormat::IQ4XS => "iq4_xs",
            WeightFormat::MXFP4 => "mxfp4",
        }
    }

    /// Whether the integer-dot products take this format (blocks of 32 whose weights are small
    /// integers times one scale, plus one min: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL's table).
    pub(crate) fn int_dot(self) -> bool {
        matches!(
            self,
            WeightFormat::Q8_0
                | WeightFormat::Q4_0
                | WeightFormat::Q4_1
                | WeightFormat::Q5_0
                | WeightFormat::Q5_1
                | WeightFormat::IQ4NL
        )
    }

    /// Bytes of one weight row of `k` features as the GPU holds it (blocks as repacked).
    pub(crate) fn row_bytes(self, k: usize) -> u64 {
        let kind = QuantKind::ALL.into_iter().find(|&q| WeightFormat::from(q) == self);
        match (self, kind) {
            (_, Some(q)) => (k.div_ceil(q.block_len()) * q.gpu_block_words() * 4) as u64,
            (WeightFormat::F32, _) => 4 * k as u64,
            _ => 2 * k as u64,
        }
    }
}

impl From<QuantKind> for WeightFormat {
    /// The GPU reads every block format in its own blocks.
    fn from(kind: QuantKind) -> Self {
        match kind {
            QuantKind::Q8_0 => WeightFormat::Q8_0,
            QuantKind::Q4_0 => WeightFormat::Q4_0,
            QuantKind::Q4_1 => WeightFormat::Q4_1,
            QuantKind::Q4K => WeightFormat::Q4K,
            QuantKind::Q6K => WeightFormat::Q6K,
            QuantKind::Q5_0 => WeightFormat::Q5_0,
            QuantKind::Q5_1 => WeightFormat::Q5_1,
            QuantKind::IQ4NL => WeightFormat::IQ4NL,
            QuantKind::Q5K => WeightFormat::Q5K,
            QuantKind::Q3K => WeightFormat::Q3K,
            QuantKind::Q2K => WeightFormat::Q2K,
            QuantKind::IQ4XS => WeightFormat::IQ4XS,
            QuantKind::MXFP4 => WeightFormat::MXFP4,
        }
    }
}
