#![no_main]
//! Any bytes as a kvdecode (TinyAgent) safetensors file: Ok or an error, never a panic; a model that
//! loads also builds an engine and decodes one step (once per model shape).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(w) = kvdecode::ModelWeights::from_safetensors_bytes(data) {
        kvdecode_fuzz::engine_once(&w);
    }
});
