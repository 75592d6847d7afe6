//! Tokenizers from GGUF metadata (SentencePiece-style `llama` vocabularies with byte fallback) and
//! from `tokenizer.json` + `tokenizer_config.json`; chat templates rendered with minijinja.
//! (The gpt2-style path is tested on SmolLM2's real vocabulary in tests/smollm2.rs.)

mod common;

use common::gguf_writer::{write_llama_with, Meta, Store};
use common::*;
use kvdecode::io::gguf::GgufFile;
use kvdecode::io::tokenizer::{Message, TextStream, Tokenizer};

/// A small SentencePiece vocabulary: specials, the 256 byte pieces, and scored pieces.
fn spm_gguf() -> Vec<u8> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "ll", "lo", "▁he", "llo", "▁hello", "▁w", "or", "ld",
        "▁wor", "▁world", "▁t", "t", "he", "▁the",
    ];
    let first = tokens.len();
    for p in pieces {
        tokens.push(p.into());
        types.push(1);
    }
    // longer pieces score higher, like SentencePiece's log probabilities of merged pieces
    let scores: Vec<f32> = (0..tokens.len())
        .map(|i| if i < first { 0.0 } else { tokens[i].chars().count() as f32 - i as f32 * 1e-3 })
        .collect();
    let n = tokens.len();
    let w = model(&kvdecode::ModelConfig::llama(n, 32, 4, 2, 8, 48, 1, 10000.0, 1e-5, true), 151);
    write_llama_with(
        &w,
        Store::F32,
        vec![
            ("tokenizer.ggml.model", Meta::Str("llama")),
            ("tokenizer.ggml.tokens", Meta::StrArr(tokens)),
            ("tokenizer.ggml.scores", Meta::F32Arr(scores)),
            ("tokenizer.ggml.token_type", Meta::I32Arr(types)),
            ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
            ("tokenizer.ggml.eos_token_id", Meta::U32(2)),
            ("tokenizer.ggml.add_bos_token", Meta::Bool(true)),
            ("tokenizer.chat_template", Meta::Str("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")),
        ],
    )
}

#[test]
fn sentencepiece_vocabulary_with_byte_fallback() {
    let g = GgufFile::parse(spm_gguf()).unwrap();
    let t = Tokenizer::from_gguf(&g).unwrap();
    let id = |s: &str| t.token_id(s).unwrap();
    // BOS first (the model asks for it), whole-word pieces, spaces as ▁
    assert_eq!(t.encode("hello world").unwrap(), vec![1, id("▁hello"), id("▁world")]);
    assert_eq!(t.encode("the hello").unwrap(), vec![1, id("▁the"), id("▁hello")]);
    // characters outside the vocabulary fall back to their UTF-8 bytes
    let ids = t.encode("hé").unwrap();
    assert_eq!(ids, vec![1, id("▁h"), id("<0xC3>"), id("<0xA9>")]);
    for text in ["hello world", "héllo wörld", "  two  spaces", "emoji 🦀", "the\tend\n"] {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids, true).unwrap(), text, "round trip of {text:?}");
    }
    // special tokens written in the text are parsed as special
    assert!(t.encode("</s>hello").unwrap().contains(&2));
    let chat = t.apply_chat_template(&[Message::new("user", "  hi  ")], true).unwrap();
    assert_eq!(chat, "<s>[USER] hi\n[ASSISTANT]");
    assert!(t.end_of_turn().contains(&2));
}

/// Streaming a byte-fallback vocabulary token by token (the server's events, `kvdecode chat`):
/// emoji and CJK arrive as 3 and 4 byte tokens, and no released piece holds a U+FFFD or splits a
/// character; what a stream releases in all is the whole sequence's text, invalid bytes included
/// (held at most a few tokens, then released as U+FFFD).
#[test]
fn byte_fallback_text_streams_whole_characters() {
    let g = GgufFile::parse(spm_gguf()).unwrap();
    let t = Tokenizer::from_gguf(&g).unwrap();
    let byte = |b: u8| t.token_id(&format!("<0x{b:02X}>")).unwrap();
    for text in ["hello 🦀 world", "中文 hello 日本語", "héllo wörld 🦀🦀", "🦀", "the\tend\n"] {
        let ids = t.encode(text).unwrap();
        assert!(ids.len() > text.chars().count() / 2, "{text:?} goes in byte tokens: {ids:?}");
        let mut s = TextStream::new(true);
        let pieces: Vec<String> = ids.iter().map(|&id| s.push(&t, id).unwrap()).collect();
        assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{text:?}: {pieces:?}");
        assert_eq!(pieces.concat() + &s.finish(&t).unwrap(), t.decode(&ids, true).unwrap(), "{text:?}");
        assert_eq!(pieces.concat(), text, "{text:?}: every character released by its last byte");
    }
    // invalid bytes: a lead byte, then bytes that are never UTF-8
    let mut ids = vec![t.token_id("▁hello").unwrap(), byte(0xF0)];
    ids.extend(std::iter::repeat_n(byte(0xFF), 20));
    ids.push(t.token_id("▁world").unwrap());
    let mut s = TextStream::new(true);
    let pieces: Vec<String> = ids.iter().map(|&id| s.push(&t, id).unwrap()).collect();
    let all = pieces.concat() + &s.finish(&t).unwrap();
    assert_eq!(all, t.decode(&ids, true).unwrap());
    assert_eq!(all, format!("hello{} world", "\u{fffd}".repeat(21)));
    // released while the run went on, not held to its end
    let last = pieces.len() - 1;
    assert!(pieces[..last].iter().any(|p| p.contains('\u{fffd}')), "{pieces:?}");
    // valid characters before bytes that turn out invalid stay as released (a whole-sequence
    // decode turns the whole run of byte tokens into U+FFFDs, those characters too)
    let ids: Vec<u32> = "日本".bytes().chain([0xF0]).map(byte).chain([t.token_id("▁world").unwrap()]).collect();
    let mut s = TextStream::new(true);
    let all: String = ids.iter().map(|&id| s.push(&t, id).unwrap()).collect::<String>() + &s.finish(&t).unwrap();
    assert!(all.starts_with("日本\u{fffd}") && all.ends_with("\u{fffd} world"), "{all:?}");
    // an unfinished character at the end comes out at finish
    let mut s = TextStream::new(true);
    assert_eq!(s.push(&t, byte(0xF0)).unwrap(), "");
    assert_eq!(s.finish(&t).unwrap(), "\u{fffd}");
}

#[test]
fn tokenizer_json_with_config() {
    let dir = std::env::temp_dir().join(format!("kvdecode-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // a small byte-level BPE in Hugging Face's format
    let mut vocab = serde_json::Map::new();
    let bytes: Vec<char> = (b'!'..=b'~').map(|b| b as char).chain(['Ġ', 'Ċ']).collect();
    for (i, c) in bytes.iter().enumerate() {
        vocab.insert(c.to_string(), serde_json::json!(i));
    }
    let n = vocab.len();
    for (i, m) in ["Ġt", "he", "Ġthe", "Ġw", "or", "ld"].iter().enumerate() {
        vocab.insert(m.to_string(), serde_json::json!(n + i));
    }
    vocab.insert("<|end|>".into(), serde_json::json!(n + 6));
    let tj = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": n + 6, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                  "merges": ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "l d"]}
    });
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"eos_token": "<|end|>", "chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"}).to_string(),
    )
    .unwrap();
    let t = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(t.eos, Some((n + 6) as u32));
    let ids = t.encode("a the world<|end|>").unwrap();
    assert_eq!(*ids.last().unwrap(), (n + 6) as u32);
    assert!(ids.contains(&t.token_id("Ġthe").unwrap()));
    assert_eq!(t.decode(&ids, false).unwrap(), "a the world<|end|>");
    assert_eq!(t.apply_chat_template(&[Message::new("user", "x")], false).unwrap(), "x<|end|>");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gguf_version_2_reads_like_3() {
    let mut bytes = spm_gguf();
    bytes[4] = 2;
    let g = GgufFile::parse(bytes).unwrap();
    assert_eq!(g.version, 2);
    assert!(g.weights().is_ok());
}

/// A chat template comes from the model file: a hostile one hits a limit and is a clear error,
/// quickly, and the tokenizer keeps working with its real template afterwards.
#[test]
fn hostile_chat_templates_hit_their_limits() {
    let g = GgufFile::parse(spm_gguf()).unwrap();
    let mut t = Tokenizer::from_gguf(&g).unwrap();
    let good = t.chat_template.clone();
    let msgs = [Message::new("user", "hi")];
    let lim = kvdecode::io::tokenizer::TEMPLATE_LIMITS;
    let cases: Vec<(String, &str)> = vec![
        // an endless loop (minijinja caps each range at 100k items, nesting multiplies them)
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}".into(), "ran out of fuel"),
        // unbounded recursion through a macro
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}".into(), "recursion"),
        // a prompt larger than any context
        ("{{ 'x' * 50000000 }}".into(), "output is larger than"),
        ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}".into(), "output is larger than"),
        // a template larger than any real one
        ("x".repeat(lim.source_bytes + 1), "more than the"),
        // and plain errors name the template
        ("{{ raise_exception('no tools here') }}".into(), "no tools here"),
        ("{% for %}".into(), "chat template"),
    ];
    for (tpl, want) in cases {
        t.chat_template = Some(tpl.clone());
        let start = std::time::Instant::now();
        let err = t.apply_chat_template(&msgs, true).err().unwrap_or_else(|| panic!("{:.60} rendered", tpl));
        let msg = err.to_string();
        assert!(msg.contains(want), "{:.60}: {msg}", tpl);
        println!("{:.50} -> {msg:.120} ({:?})", tpl, start.elapsed());
    }
    t.chat_template = good;
    assert!(t.apply_chat_template(&msgs, true).unwrap().ends_with("[ASSISTANT]"));
}

#[test]
fn llama3_vocabularies_take_a_whole_pre_token_before_merging() {
    // llama.cpp (and Llama 3's tokenizer.json, `ignore_merges`) emit a pre-token that is itself
    // in the vocabulary as that one token; other gpt2-style vocabularies merge. With merges
    // that only join "b c", "abc" is [a, bc] by merges and [abc] whole.
    use kvdecode::io::gguf::Value;
    let meta = |pre: &str| {
        let s = |v: &str| Value::Str(v.into());
        std::collections::BTreeMap::from([
            ("tokenizer.ggml.model".to_string(), s("gpt2")),
            ("tokenizer.ggml.pre".to_string(), s(pre)),
            ("tokenizer.ggml.tokens".to_string(), Value::Array(["a", "b", "c", "bc", "abc"].map(s).to_vec())),
            ("tokenizer.ggml.merges".to_string(), Value::Array(vec![s("b c")])),
        ])
    };
    for (pre, want) in [("gpt2", vec![0, 3]), ("qwen2", vec![0, 3]), ("llama-bpe", vec![4])] {
        let t = Tokenizer::from_gguf_metadata(&meta(pre)).unwrap();
        assert_eq!(t.encode("abc").unwrap(), want, "pre-tokenizer {pre}");
    }
    // gpt-oss's `gpt-4o` (o200k): a word splits where lower case turns to upper, so "aB" is two
    // pre-tokens and the merge never applies (transformers' tokenizers library splits
    // "HelloWorld's" into "Hello" and "World's" with gpt-oss's regex)
    let mut m = meta("gpt-4o");
    m.insert("tokenizer.ggml.tokens".into(), Value::Array(["a", "B", "aB"].map(|v| Value::Str(v.into())).to_vec()));
    m.insert("tokenizer.ggml.merges".into(), Value::Array(vec![Value::Str("a B".into())]));
    assert_eq!(Tokenizer::from_gguf_metadata(&m).unwrap().encode("aB").unwrap(), vec![0, 1]);
    m.insert("tokenizer.ggml.pre".into(), Value::Str("qwen2".into()));
    assert_eq!(Tokenizer::from_gguf_metadata(&m).unwrap().encode("aB").unwrap(), vec![2]);
    // llama.cpp's other names of the GPT-2 pre-tokenizer read as it
    for pre in ["gpt-2", "olmo", "phi-2"] {
        assert_eq!(Tokenizer::from_gguf_metadata(&meta(pre)).unwrap().encode("abc").unwrap(), vec![0, 3], "{pre}");
    }
}

#[test]
fn llama_cpp_vocabulary_tests_pass() {
    // llama.cpp's own tokenizer test for Phi-3's vocabulary (models/ggml-vocab-phi-3.gguf with its
    // .inp texts and .out ids, copied from llama.cpp's repository; tokenized there without BOS)
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llamacpp/vocab");
    let vocab = dir.join("ggml-vocab-phi-3.gguf");
    let t = Tokenizer::from_gguf(&GgufFile::parse(std::fs::read(&vocab).unwrap()).unwrap()).unwrap();
    let read = |ext: &str| std::fs::read_to_string(dir.join(format!("ggml-vocab-phi-3.gguf.{ext}"))).unwrap();
    let (inp, out) = (read("inp"), read("out"));
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let wants: Vec<&str> = out.split('\n').collect();
    assert!(texts.len() >= 40 && wants.len() >= texts.len(), "{} texts, {} answers", texts.len(), wants.len());
    for (text, want) in texts.iter().zip(&wants) {
        let want: Vec<u32> = want.split_whitespace().map(|v| v.parse().unwrap()).collect();
        let mut got = t.encode(text).unwrap();
        assert_eq!(got.first(), Some(&1), "Phi-3 asks for BOS");
        got.remove(0);
        assert_eq!(got, want, "{text:?}");
    }
    // Phi-3's file names <|endoftext|> as EOS, but its turns end with <|end|>: a chat stops there
    let end = t.token_id("<|end|>").expect("Phi-3 has <|end|>");
    assert!(t.end_of_turn().contains(&end), "{:?} lacks <|end|> = {end}", t.end_of_turn());
}

#[test]
fn family_chat_templates_render_as_transformers_renders_them() {
    // each family's own template (tests/fixtures/templates, from llama.cpp's repository) against
    // transformers' apply_chat_template rendering of the same conversations
    // (scripts/fixtures/make_template_fixtures.py): Gemma 2 refuses a system role, Phi-3.5 ends
    // turns with <|end|>, Qwen2.5 and Llama 3.2 list the tools, SmolLM3 and Mistral Nemo their own
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let mut checked = 0;
    for (model, want) in expected["models"].as_object().unwrap() {
        let tpl = std::fs::read_to_string(dir.join(format!("{model}.jinja"))).unwrap();
        let (bos, eos) = (want["bos_token"].as_str().unwrap(), want["eos_token"].as_str().unwrap());
        for (name, rendered) in want["rendered"].as_object().unwrap() {
            let conv = &expected["conversations"][name];
            let messages: Vec<Message> = serde_json::from_value(conv["messages"].clone()).unwrap();
            let tools = conv["tools"].as_array().map(|_| &conv["tools"]);
            let got = kvdecode::io::tokenizer::render_chat_template_with_tools(&tpl, &messages, tools, true, bos, eos);
            match (rendered.as_str(), got) {
                (Some(text), Ok(got)) => assert_eq!(got, text, "{model}, {name}"),
                (None, Err(e)) => {
                    let why = rendered["error"].as_str().unwrap();
                    assert!(e.to_string().contains(why), "{model}, {name}: {e} (transformers: {why})");
                }
                (want, got) => panic!("{model}, {name}: transformers {want:?}, kvdecode {got:?}"),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 18);
}

#[test]
fn tojson_writes_what_pythons_json_dumps_writes() {
    // the keyword arguments no family template in tests/fixtures/templates uses; the expected
    // strings are Python 3.11's json.dumps of the same value
    let value = serde_json::json!({"b": [1, 2.5, null, true], "a": "é<&>'", "c": {}});
    let tpl = format!(
        "{{% set v = {value} %}}{{{{ v | tojson(ensure_ascii=true, sort_keys=true, separators=[',', ':']) }}}}|\
         {{{{ v | tojson(indent=2) }}}}"
    );
    let got = kvdecode::io::tokenizer::render_chat_template(&tpl, &[Message::new("user", "x")], false, "", "").unwrap();
    let (compact, indented) = got.split_once('|').unwrap();
    assert_eq!(compact, r#"{"a":"\u00e9<&>'","b":[1,2.5,null,true],"c":{}}"#);
    assert_eq!(
        indented,
        "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"é<&>'\",\n  \"c\": {}\n}"
    );
}
