#![no_main]
//! Any bytes: the kvdecode safetensors loader returns Ok or an error, never panics.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvdecode::ModelWeights::from_safetensors_bytes(data);
});
