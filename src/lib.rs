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

// One path for each module (`kvdecode::io::gguf`); what a user names most is re-exported here.
pub use cache::{BlockUsage, CacheOptions, KvCache, KvDtype, PromptCacheStats, RowOwner};
pub use engine::sampling::{argmax, sample_cpu, sample_cpu_full, LogprobMode, Sampled, Sampler, TOP_LOGPROBS_MAX};
pub use engine::{
    AttentionKernel, Batch, Engine, EngineOptions, Fusion, InFlight, Logits, LoraUpdate, MatmulKernel, MemoryReport,
    Occupancy, OccupancyTable, Sleep, Stats, StepOutput, Turn, TurnLimit, Want, WeightUpdate, CHUNK,
    EXPERT_TOKEN_BLOCK, QUERY_TILE_MIN_WIDTH, TILED_MIN_TOKENS,
};
pub use error::{Error, Result};
pub use gpu::device::{AppHandlers, Gpu, GpuOptions};
pub use gpu::kernels::WeightFormat;
pub use gpu::lora::MAX_LORA_RANK;
pub use gpu::pending::Pending;
pub use gpu::profile::Profile;
pub use gpu::weights::WeightDtype;
pub use io::safetensors::DiskDtype;
pub use model::config::{EngramConfig, LayerSpec, MlpKind, ModelConfig, NormKind};
pub use model::family::Family;
pub use model::lora::LoraAdapter;
pub use model::tensor::{HostDtype, HostTensor};
pub use model::weights::{EngramWeights, Half, LayerWeights, Matrix, ModelWeights, SplitMix64};
pub use serve::batching::Scheduler;
#[cfg(not(target_arch = "wasm32"))]
pub use serve::compat::{PaddedBatch, SequenceCache};
pub use serve::request::{Completion, ConstraintFactory, Event, Finish, Request, RequestStats, TokenConstraint};
pub use serve::rollout::{Episode, Rollouts};
/// The wgpu kvdecode is built on, for apps that hand it their device ([`Gpu::from_device`]).
pub use wgpu;
