#![no_main]
//! Any bytes: the GGUF reader, the weight loader and the tokenizer return Ok or an error, never
//! panic, and never allocate more than the bytes justify.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = kvdecode::gguf::GgufFile::parse(data.to_vec()) {
        let _ = g.weights();
        let _ = kvdecode::tokenizer::Tokenizer::from_gguf(&g);
    }
});
