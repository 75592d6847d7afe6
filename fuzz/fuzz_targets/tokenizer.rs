#![no_main]
//! Tokenizer metadata as a GGUF file would carry it (vocabulary, merges, scores, types, pre-tokenizer,
//! special ids), built from fuzz bytes: building it, encoding text and decoding the ids return Ok or
//! an error, never panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (meta, texts) = kvdecode_fuzz::tokenizer_metadata(data);
    let Ok(t) = kvdecode::io::tokenizer::Tokenizer::from_gguf_metadata(&meta) else { return };
    for text in texts {
        if let Ok(ids) = t.encode(&text) {
            let _ = t.decode(&ids, false);
            let _ = t.decode(&ids, true);
        }
    }
});
