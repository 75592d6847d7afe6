//! The fuzzers' seed corpora (`fuzz/seeds/<target>/`, committed) are valid inputs: every seed
//! loads, builds, renders or parses, so a fuzz run starts from the formats' real shapes.
//! `KVDECODE_WRITE_FUZZ_SEEDS=1 cargo test --test fuzz_seeds` rewrites them.

mod common;

#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod fuzz_lib;

use std::path::{Path, PathBuf};

use common::gguf_writer::{write_arch, Meta, Store};
use common::*;
use kvdecode::io::gguf::GgufFile;
use kvdecode::io::tokenizer::{render_chat_template, Tokenizer};
use kvdecode::model::quant::QuantKind;
use kvdecode::{DiskDtype, ModelConfig, ModelWeights, Request};
use serde_json::json;

fn dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds").join(target)
}

/// A byte-level BPE vocabulary that can spell any text (so constrained decoding to JSON has
/// tokens to work with): ChatML specials, GPT-2's 256 byte characters, a few merges; 288 tokens.
fn gpt2_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = vec!["<|im_start|>".into(), "<|im_end|>".into()];
    let mut types = vec![3, 3];
    // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest map from U+0100 on
    let mut extra = 0u32;
    for b in 0..=255u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            char::from_u32(b).unwrap()
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap()
        };
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "\" :", "{ \""];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    while tokens.len() < 288 {
        tokens.push(format!("<extra_{}>", tokens.len()));
        types.push(4);
    }
    (tokens, merges.iter().map(|m| m.to_string()).collect(), types)
}

/// A ChatML template that takes tools, Hermes-style (what Qwen's templates do): the tools as JSON
/// in a system turn, calls as `<tool_call>` blocks, results as `<tool_response>` blocks.
const TOOLS_TEMPLATE: &str = "{%- if tools %}<|im_start|>system\nYou may call these functions:\n\
{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\nTo call one, answer <tool_call>\n\
{\"name\": NAME, \"arguments\": ARGS}\n</tool_call><|im_end|>\n{% endif %}\
{%- for m in messages %}\
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\
{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": \
{% if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}{% endif %}}\
\n</tool_call>{%- endfor %}<|im_end|>\n\
{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n\
{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}\
{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn gguf_seeds() -> Vec<(String, Vec<u8>)> {
    let (tokens, merges, types) = gpt2_vocab();
    let tok_meta = |tpl: &'static str| -> Vec<(&'static str, Meta<'static>)> {
        vec![
            ("tokenizer.ggml.model", Meta::Str("gpt2")),
            ("tokenizer.ggml.pre", Meta::Str("smollm")),
            ("tokenizer.ggml.tokens", Meta::StrArr(tokens.clone())),
            ("tokenizer.ggml.merges", Meta::StrArr(merges.clone())),
            ("tokenizer.ggml.token_type", Meta::I32Arr(types.clone())),
            ("tokenizer.ggml.bos_token_id", Meta::U32(0)),
            ("tokenizer.ggml.eos_token_id", Meta::U32(1)),
            ("tokenizer.chat_template", Meta::Str(tpl)),
            ("llama.context_length", Meta::U32(2048)),
        ]
    };
    // small, so mutations land on headers and metadata often (quantized rows need 32 columns)
    let llama = ModelConfig::llama(288, 16, 2, 1, 8, 16, 1, 10000.0, 1e-5, false);
    let llama32 = ModelConfig::llama(288, 32, 4, 2, 8, 32, 1, 10000.0, 1e-5, false);
    let mut qwen = ModelConfig::llama(64, 32, 4, 2, 8, 32, 1, 1e6, 1e-6, true);
    qwen.qk_norm = true;
    let mut gemma = ModelConfig::llama(64, 16, 2, 1, 8, 16, 6, 1e6, 1e-6, true);
    gemma.qk_norm = true;
    gemma.layers = (0..6)
        .map(|i| kvdecode::LayerSpec { global_group: (i == 5).then_some(0), writes_global: i == 5, local: i != 5 })
        .collect();
    gemma.window = 4;
    gemma.post_norms = true;
    gemma.norm = kvdecode::NormKind::OnePlusWeight;
    gemma.mlp = kvdecode::MlpKind::GeluTanhGated;
    gemma.embed_scale = 16f32.sqrt();
    vec![
        (
            "llama-f32-chatml.gguf".into(),
            write_arch(&model(&llama, 1), Store::F32, "llama", tok_meta(fuzz_lib::CHATML)),
        ),
        ("llama-f32-tools.gguf".into(), write_arch(&model(&llama, 7), Store::F32, "llama", tok_meta(TOOLS_TEMPLATE))),
        (
            "llama-q4_1.gguf".into(),
            write_arch(
                &model(&llama32, 2).quantized(QuantKind::Q4_1).unwrap(),
                Store::Blocks,
                "llama",
                tok_meta("{{ messages[0].content }}"),
            ),
        ),
        (
            "qwen3-q8_0.gguf".into(),
            write_arch(&model(&qwen, 3).quantized(QuantKind::Q8_0).unwrap(), Store::Blocks, "qwen3", vec![]),
        ),
        ("gemma3-f16.gguf".into(), write_arch(&model(&gemma, 4), Store::F16, "gemma3", vec![])),
    ]
}

fn safetensors_seeds() -> Vec<(String, Vec<u8>)> {
    let mut agent = ModelConfig::tiny_agent(64, 16, 2, 1, 8, 32, 2, 2, 3);
    agent.engram = Some(kvdecode::model::config::EngramConfig {
        layers: vec![1],
        orders: vec![2],
        heads: 1,
        table_rows: 8,
        dim: 4,
    });
    let llama = ModelConfig::llama(64, 16, 2, 1, 8, 16, 1, 10000.0, 1e-6, true);
    vec![
        ("tinyagent-engram-f32.safetensors".into(), model(&agent, 5).to_safetensors_bytes(DiskDtype::F32).unwrap()),
        ("llama-bf16.safetensors".into(), model(&llama, 6).to_safetensors_bytes(DiskDtype::BF16).unwrap()),
    ]
}

fn text_seeds() -> Vec<(&'static str, String, String)> {
    let (tokens, merges, types) = gpt2_vocab();
    let mut gpt2 = "gpt2 smollm 0 0 1\n".to_string();
    for t in &tokens {
        gpt2 += &format!("t {t}\n");
    }
    for m in &merges {
        gpt2 += &format!("m {m}\n");
    }
    for y in &types {
        gpt2 += &format!("y {y}\n");
    }
    gpt2 += "x hello world!\nx <|im_start|>user\nx 12345 digits\n";
    let mut spm = "llama default 1 1 2\nt <unk>\nt <s>\nt </s>\ny 2\ny 3\ny 3\ns 0\ns 0\ns 0\n".to_string();
    for b in 0..256 {
        spm += &format!("t <0x{b:02X}>\ny 6\ns 0\n");
    }
    for (i, p) in ["▁", "h", "e", "l", "o", "▁h", "el", "ll", "lo", "▁he", "llo", "▁hello"].iter().enumerate() {
        spm += &format!("t {p}\ny 1\ns {}\n", p.chars().count() as f32 - i as f32 * 1e-3);
    }
    spm += "x hello hello\nx héllo ✓\n";
    let llama3 = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
    let macros = "{%- macro render(m) -%}[{{ m.role | upper }}]{{ m.content }}{%- endmacro -%}{%- set ns = namespace(sys='') -%}{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.sys = m.content -%}{%- elif loop.last and m.role != 'user' -%}{{ raise_exception('last message must be the user') }}{%- else -%}{{ render(m) }}{%- endif -%}{%- endfor -%}{{ ns.sys | length }}{% if add_generation_prompt %}<go>{% endif %}";
    let conv = "system: Be brief.\nuser: Hi!\nassistant: Hello.\nuser: 2+2?\n!";
    vec![
        ("tokenizer", "gpt2-bpe.txt".into(), gpt2),
        ("tokenizer", "llama-spm.txt".into(), spm),
        ("chat_template", "chatml.txt".into(), format!("{}\n---\n{conv}", fuzz_lib::CHATML)),
        ("chat_template", "llama3.txt".into(), format!("{llama3}\n---\n{conv}")),
        ("chat_template", "macros-namespace.txt".into(), format!("{macros}\n---\n{conv}")),
        ("jsonl", "tokens.json".into(), json!({"tokens": [1, 2, 3], "max_tokens": 8, "stop": [1]}).to_string()),
        ("openai_request", "chat-stream.json".into(), json!({"model": "m", "messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 3, "stop": ["\n\n"], "logprobs": true,
            "top_logprobs": 2, "logit_bias": {"5": -100}, "presence_penalty": 0.5, "user": "u"}).to_string()),
        ("openai_request", "chat-tools.json".into(), json!({"messages": [{"role": "user", "content": "add 2 and 3"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
            "tool_choice": "required"}).to_string()),
        ("openai_request", "chat-schema.json".into(), json!({"messages": [{"role": "user", "content": "json"}], "max_completion_tokens": 30,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
            "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
            "required": ["ok"]}}}}).to_string()),
        ("openai_request", "completion-ids.json".into(), json!({"prompt": [[3, 4, 5]], "max_tokens": 4, "logprobs": 3, "echo": false,
            "best_of": 1, "frequency_penalty": -0.5}).to_string()),
        (
            "jsonl",
            "text-sampled.json".into(),
            json!({"text": "hi", "temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 7}).to_string(),
        ),
    ]
}

fn write_or_check(target: &str, name: &str, bytes: &[u8]) {
    let path = dir(target).join(name);
    if std::env::var("KVDECODE_WRITE_FUZZ_SEEDS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(dir(target)).unwrap();
        std::fs::write(&path, bytes).unwrap();
    }
    let on_disk = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(on_disk, bytes, "{} is stale: rerun with KVDECODE_WRITE_FUZZ_SEEDS=1", path.display());
}

fn files(target: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir(target)).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

#[test]
fn model_file_seeds_load_and_run() {
    for (name, bytes) in gguf_seeds() {
        write_or_check("gguf", &name, &bytes);
    }
    for (name, bytes) in safetensors_seeds() {
        write_or_check("safetensors", &name, &bytes);
    }
    let gpu = gpu();
    for p in files("gguf") {
        let g = GgufFile::parse(read(&p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let w = g.weights().unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        if g.get("tokenizer.ggml.model").is_some() {
            let t = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            t.apply_chat_template(&fuzz_lib::sample_messages(), true).unwrap();
        }
        let mut e = kvdecode::Engine::new(&gpu, &w, kvdecode::EngineOptions::new(1, 8)).unwrap();
        e.append(&[1, 2], 2, &[2], None).unwrap();
    }
    for p in files("safetensors") {
        let w = ModelWeights::from_safetensors_bytes(&read(&p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        kvdecode::Engine::new(&gpu, &w, kvdecode::EngineOptions::new(1, 8)).unwrap();
    }
}

#[test]
fn text_seeds_build_render_and_parse() {
    for (target, name, text) in text_seeds() {
        write_or_check(target, &name, text.as_bytes());
    }
    for p in files("tokenizer") {
        let (meta, texts) = fuzz_lib::tokenizer_metadata(&read(&p));
        let t = Tokenizer::from_gguf_metadata(&meta).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!texts.is_empty());
        for text in texts {
            let ids = t.encode(&text).unwrap();
            assert!(!ids.is_empty(), "{}: {text:?}", p.display());
        }
    }
    for p in files("chat_template") {
        let (tpl, msgs, gen) = fuzz_lib::conversation(&read(&p));
        assert_eq!(msgs.len(), 4, "{}", p.display());
        let out =
            render_chat_template(&tpl, &msgs, gen, "<s>", "</s>").unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(out.contains("Hi!") || out.contains('4'), "{}: {out}", p.display());
    }
    for p in files("openai_request") {
        let v: serde_json::Value = serde_json::from_slice(&read(&p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(v.is_object(), "{}", p.display());
    }
    for p in files("jsonl") {
        let line = String::from_utf8(read(&p)).unwrap();
        Request::from_json(&line, Some(fuzz_lib::tokenizer())).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
}
