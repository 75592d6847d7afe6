//! What runs on top of the engine: continuous batching (`Scheduler`), rollouts, speculative
//! decoding, and the seeds' other modes as thin layers. These own rows of an [`crate::Engine`]
//! and never reach below its public calls and the cache it exposes.

pub mod batching;
#[cfg(not(target_arch = "wasm32"))]
pub mod compat;
pub mod request;
pub mod rollout;
#[cfg(not(target_arch = "wasm32"))]
pub mod speculative;
