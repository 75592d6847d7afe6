//! Reading model files and their tokenizers: GGUF, Hugging Face directories, kvdecode's own
//! safetensors, `tokenizer.json` and chat templates, and `.npy` for fixtures. Every byte read here
//! is untrusted input; readers build the host types of [`crate::model`].

pub mod gguf;
pub mod hf;
pub mod mapped;
pub mod model_file;
pub mod npy;
pub mod safetensors;
pub mod tokenizer;
