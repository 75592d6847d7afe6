//! Element types of stored keys and values: what the cache holds and what the reference rounds to.

use crate::error::{Error, Result};

/// Element type of the stored keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// 32-bit floats.
    F32,
    /// IEEE halves, packed two per u32 (no `shader-f16` needed).
    F16,
    /// bfloat16 (the seed's default), packed two per u32 and unpacked with a shift; rounded to
    /// nearest even like PyTorch's `.to(torch.bfloat16)`.
    BF16,
}

impl KvDtype {
    /// Every storage type, for options and benchmarks.
    pub const ALL: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::BF16];

    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
        }
    }

    /// The name options use: `f32`, `f16`, `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
        }
    }

    /// Parse an option value (`f32`, `f16`, `bf16`); anything else is an error that lists them.
    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::Input(format!("unknown K/V type {s:?}; expected f32, f16 or bf16")))
    }

    /// The shaders' `KV_FORMAT` code (common.wgsl: the weight format codes of the same layouts).
    pub(crate) fn format(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::BF16 => 5,
        }
    }
}
