//! kvdecode: incremental decoding of transformer language models on WebGPU compute shaders,
//! many sequences at once, with a small per-row KV cache.
//!
//! ```no_run
//! use kvdecode::{Engine, EngineOptions, Gpu, ModelConfig, ModelWeights};
//! let gpu = Gpu::new()?;
//! let cfg = ModelConfig::tiny_agent(256, 64, 4, 2, 16, 128, 4, 2, 8);
//! let weights = ModelWeights::random(&cfg, 7)?;
//! let mut engine = Engine::new(&gpu, &weights, EngineOptions::new(2, 128))?;
//! // two rows: a 3-token prompt and a 1-token prompt, right-padded to width 3
//! let logits = engine.append(&[5, 6, 7, 9, 0, 0], 3, &[3, 1], None)?;
//! let next = kvdecode::argmax(logits.row(0).unwrap());
//! # Ok::<(), kvdecode::Error>(())
//! ```
//!
//! See `ARCHITECTURE.md` for the layout of the crate and `docs/DESIGN.md` for the semantics and
//! invariants it keeps.

#![warn(missing_docs)]

// The crate in layers, each using only those above it in this list: errors; the model on the
// host (`model`); reading model files (`io`); the GPU runtime (`gpu`); the K/V cache (`cache`);
// the engine (`engine`); what runs on top of it (`serve`).
pub mod cache;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod io;
pub mod model;
pub mod serve;

// Every module keeps the path it had before the folders (`kvdecode::gguf`, ...).
pub use engine::{decode, sampling};
pub use gpu::{device, profile, shaders, variants};
pub use io::{gguf, hf, model_file, npy, tokenizer};
pub use model::{config, engram, family, quant, reference, tensor, weights};
pub use serve::{batching, rollout};
#[cfg(not(target_arch = "wasm32"))]
pub use serve::{compat, speculative};

pub use batching::{Completion, ConstraintFactory, Event, Finish, Request, Scheduler, TokenConstraint};
pub use cache::{BlockUsage, CacheOptions, KvCache, KvDtype, PromptCacheStats, RowOwner};
#[cfg(not(target_arch = "wasm32"))]
pub use compat::{PaddedBatch, SequenceCache};
pub use config::{EngramConfig, LayerSpec, MlpKind, ModelConfig, NormKind};
pub use device::{Gpu, GpuOptions};
pub use engine::{
    AttentionKernel, Engine, EngineOptions, Fusion, InFlight, Logits, MatmulKernel, MemoryReport, Sleep, Stats, Turn,
    TurnLimit, WeightUpdate, CHUNK, QUERY_TILE_MIN_WIDTH, TILED_MIN_TOKENS,
};
pub use error::{Error, Result};
pub use family::Family;
pub use gpu::kernels::WeightFormat;
pub use gpu::weights::WeightDtype;
pub use profile::Profile;
pub use rollout::{Episode, Rollouts};
pub use sampling::{argmax, sample_cpu, sample_cpu_full, Sampled, Sampler, TOP_LOGPROBS_MAX};
pub use tensor::{HostDtype, HostTensor};
pub use weights::{DiskDtype, EngramWeights, Half, LayerWeights, Matrix, ModelWeights, SplitMix64};
