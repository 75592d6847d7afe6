//! The GPU runtime below the engine: the device (ours or an app's) and its health, calls that
//! never block a frame, weights on the GPU, the WGSL
//! modules with their typed constants and pipeline cache, the kernel variants picked per adapter,
//! and the timestamp profiler.

pub mod device;
pub mod format;
pub mod kernels;
pub(crate) mod lora;
pub mod pending;
pub mod profile;
pub mod shaders;
#[cfg(not(target_arch = "wasm32"))]
pub(crate) mod specialize;
pub mod variants;
pub(crate) mod weights;
