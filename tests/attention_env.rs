//! A misspelt `KVDECODE_ATTENTION` is an error naming the value, never a quiet fallback to the
//! default. Its own test binary: it sets the variable for the whole process.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions};

#[test]
fn unknown_attention_variant_is_named() {
    std::env::set_var("KVDECODE_ATTENTION", "split");
    let w = model(&llama_cfg(), 3);
    let e = Engine::new(&gpu(), &w, EngineOptions::new(1, 32)).err().expect("no engine for an unknown variant");
    let msg = e.to_string();
    assert!(msg.contains("KVDECODE_ATTENTION=\"split\"") && msg.contains("split-group"), "{msg}");
}
