//! The model on the host: its configuration and layer plan, weights, block formats, and the CPU
//! reference forward that every GPU path is tested against. Nothing here touches the GPU.

pub mod config;
pub mod dtype;
pub mod engram;
pub mod family;
pub mod lora;
pub mod quant;
pub mod reference;
pub mod rope;
pub mod tensor;
pub mod weights;

pub use dtype::KvDtype;
pub use family::Family;
