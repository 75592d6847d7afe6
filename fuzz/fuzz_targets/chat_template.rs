#![no_main]
//! A hostile chat template (as a model file may carry) and conversation: rendering returns Ok or an
//! error within its limits (fuel, recursion, output size), never panics or hangs.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (tpl, msgs, gen) = kvdecode_fuzz::conversation(data);
    if let Ok(text) = kvdecode::io::tokenizer::render_chat_template(&tpl, &msgs, gen, "<s>", "</s>") {
        assert!(text.len() <= kvdecode::io::tokenizer::TEMPLATE_LIMITS.output_bytes);
    }
});
