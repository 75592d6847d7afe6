#![no_main]
//! Any bytes as the body of a `/v1/chat/completions` or `/v1/completions` request to `kvdecode
//! serve`: the parser (messages through a chat template that takes tools, tools and tool_choice,
//! response_format schemas compiled by llguidance, logit_bias, stop, limits) returns a request or
//! an error that names the problem, never panics. The model is the fuzz seeds' tiny tools model.
use std::sync::OnceLock;

use kvdecode::io::tokenizer::Tokenizer;
use kvdecode_cli::serve::api::{parse, Kind, Limits};
use kvdecode_cli::serve::guide::Guide;
use libfuzzer_sys::fuzz_target;

struct Setup {
    tok: Tokenizer,
    guide: Result<Guide, String>,
    limits: Limits,
}

fn setup() -> &'static Setup {
    static S: OnceLock<Setup> = OnceLock::new();
    S.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/seeds/gguf/llama-f32-tools.gguf");
        let g = kvdecode::io::gguf::GgufFile::open(path).expect("the tools seed model");
        let tok = Tokenizer::from_gguf(&g).expect("its tokenizer");
        let guide = Guide::new(&tok, tok.vocab_size());
        assert!(guide.is_ok(), "llguidance reads the seed tokenizer");
        Setup { tok, guide, limits: Limits { max_len: 1024, max_n: 4, max_tokens: 1024, routes: Some((2, 2)), bias_slots: 2048, logprobs_mode: Default::default() } }
    })
}

fuzz_target!(|data: &[u8]| {
    let s = setup();
    for kind in [Kind::Chat, Kind::Completion] {
        if let Ok(g) = parse(data, kind, &s.tok, &s.guide, &s.limits, 7) {
            assert!(!g.prompt.is_empty() && g.prompt.len() < s.limits.max_len);
            assert!(g.max_tokens >= 1 && g.prompt.len() + g.max_tokens <= s.limits.max_len);
            assert!(!g.samplers.is_empty() && g.samplers.len() <= s.limits.max_n);
        }
    }
});
