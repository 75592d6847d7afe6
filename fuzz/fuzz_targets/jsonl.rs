#![no_main]
//! Any bytes as one line of a JSONL request file: a request or an error naming the problem, never a
//! panic; with and without a tokenizer for `"text"`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else { return };
    let _ = kvdecode::Request::from_json(line, None);
    if let Ok(r) = kvdecode::Request::from_json(line, Some(kvdecode_fuzz::tokenizer())) {
        assert!(!r.tokens.is_empty(), "an empty prompt must be refused");
    }
});
