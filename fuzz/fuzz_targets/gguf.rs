#![no_main]
//! Any bytes as a GGUF file: the reader, the weights, the tokenizer and the file's own chat template
//! return Ok or an error, never panic, and never allocate more than the bytes justify; a model that
//! loads also builds an engine and decodes one step. The tokenizer and the engine are built once
//! per distinct tokenizer metadata and model shape (the fuzz lib's `first_time`).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = kvdecode::io::gguf::GgufFile::parse(data.to_vec()) else { return };
    let tok_meta: Vec<_> = g.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).collect();
    if kvdecode_fuzz::first_time(kvdecode_fuzz::key(&tok_meta)) {
        if let Ok(t) = kvdecode::io::tokenizer::Tokenizer::from_gguf(&g) {
            let _ = t.apply_chat_template(&kvdecode_fuzz::sample_messages(), true);
            if let Ok(ids) = t.encode("Hello, world! <|im_end|>") {
                let _ = t.decode(&ids, false);
            }
        }
    }
    if let Ok(w) = g.weights() {
        kvdecode_fuzz::engine_once(&w);
    }
});
