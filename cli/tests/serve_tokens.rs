//! `kvdecode serve` speaks token ids: `return_token_ids` gives the prompt's ids and each
//! choice's (streamed too), `/tokenize` renders and encodes as the generation endpoints do, and
//! `/detokenize` gives the text back, so a multi-turn client never tokenizes text again.

mod common;

use common::server::*;
use serde_json::{json, Value};

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap_or_else(|| panic!("not ids: {v}")).iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn token_ids_in_and_out() {
    let s = start(&[]);
    let tok =
        kvdecode::io::tokenizer::Tokenizer::from_gguf(&kvdecode::io::gguf::GgufFile::open(MODEL).unwrap()).unwrap();
    let eot: serde_json::Map<String, Value> = tok.end_of_turn().iter().map(|t| (t.to_string(), json!(-100))).collect();
    let messages = json!([{"role": "user", "content": "hello there"}]);
    let req =
        json!({"messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": true, "logit_bias": eot});
    let (status, v) = post(s.port, "/v1/chat/completions", req.clone());
    assert_eq!(status, 200, "{v}");
    // the prompt's ids are what /tokenize renders; the choice's decode to its text
    let (_, t) = post(s.port, "/tokenize", json!({"messages": messages}));
    assert_eq!(ids(&v["prompt_token_ids"]), ids(&t["tokens"]));
    assert_eq!(t["count"], json!(ids(&t["tokens"]).len()));
    let answer = ids(&v["choices"][0]["token_ids"]);
    assert_eq!(answer.len(), 8);
    let (_, d) = post(s.port, "/detokenize", json!({"tokens": answer, "skip_special_tokens": true}));
    assert_eq!(d["prompt"], v["choices"][0]["message"]["content"], "{d} {v}");
    // streamed: the prompt's ids once, in the first chunk; the choice's ids across the chunks
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let (status, _, body) = http(s.port, "POST", "/v1/chat/completions", &sreq.to_string());
    assert_eq!(status, 200);
    let chunks: Vec<Value> =
        sse(&body).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let with_prompt: Vec<usize> = (0..chunks.len()).filter(|&i| chunks[i].get("prompt_token_ids").is_some()).collect();
    assert_eq!(with_prompt, [0]);
    assert_eq!(ids(&chunks[0]["prompt_token_ids"]), ids(&v["prompt_token_ids"]));
    let streamed: Vec<u64> = chunks.iter().filter_map(|c| c["choices"][0].get("token_ids")).flat_map(ids).collect();
    assert_eq!(streamed, answer);
    // completions: a prompt of ids in, the same ids back; /tokenize of text as completions encode it
    let (_, t) = post(s.port, "/tokenize", json!({"prompt": "hello there"}));
    let prompt = ids(&t["tokens"]);
    let (status, c) = post(
        s.port,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(ids(&c["prompt_token_ids"]), prompt);
    // bad input is named
    for (path, body, want) in [
        ("/tokenize", json!({}), "give `messages` or `prompt`"),
        ("/detokenize", json!({"tokens": [99999]}), "below the vocabulary size"),
        ("/detokenize", json!({"tokens": [1], "extra": 1}), "Unrecognized request argument supplied: extra"),
    ] {
        let (status, e) = post(s.port, path, body);
        assert_eq!(status, 400, "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(want), "{e}");
    }
}
