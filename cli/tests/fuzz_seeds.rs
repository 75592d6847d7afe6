//! The openai_request fuzz seeds (fuzz/seeds/openai_request, written by the root crate's
//! tests/fuzz_seeds.rs) are requests the server accepts, with the model and limits the fuzz target
//! uses: the campaign starts from the parser's accepting paths, not from its first error.

use kvdecode::io::gguf::GgufFile;
use kvdecode::io::tokenizer::Tokenizer;
use kvdecode_cli::serve::api::{parse, Kind, Limits};
use kvdecode_cli::serve::guide::Guide;

#[test]
fn openai_request_seeds_are_accepted_requests() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds");
    let g = GgufFile::open(format!("{root}/gguf/llama-f32-tools.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let guide = Guide::new(&tok, tok.vocab_size());
    let limits = Limits {
        max_len: 1024,
        max_n: 4,
        max_tokens: 1024,
        routes: Some((2, 2)),
        bias_slots: 2048,
        logprobs_mode: Default::default(),
    };
    let mut seen = 0;
    for entry in std::fs::read_dir(format!("{root}/openai_request")).unwrap() {
        let path = entry.unwrap().path();
        let body = std::fs::read(&path).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let kind = if v.get("messages").is_some() { Kind::Chat } else { Kind::Completion };
        let req = parse(&body, kind, &tok, &guide, &limits, 7)
            .unwrap_or_else(|e| panic!("{}: refused: {}", path.display(), e.message));
        assert!(!req.prompt.is_empty(), "{}", path.display());
        seen += 1;
    }
    assert_eq!(seen, 4, "the four seeds of tests/fuzz_seeds.rs");
}
