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

/// `logprobs_mode` on the wire. The same seeded request (top-k 2, top-p 0.9) asked for `raw` and
/// for `processed` logprobs draws the same tokens; the processed ones of the kept tokens (`kept`
/// per token) sum to 1, tokens not kept are -9999 (vLLM's -inf), and they equal, within 1e-6, the
/// renormalization of the raw ones over the kept tokens at the temperature, computed here in f64.
#[test]
fn logprob_modes_on_the_wire() {
    let s = start(&[]);
    let tok =
        kvdecode::io::tokenizer::Tokenizer::from_gguf(&kvdecode::io::gguf::GgufFile::open(MODEL).unwrap()).unwrap();
    let eot: serde_json::Map<String, Value> = tok.end_of_turn().iter().map(|t| (t.to_string(), json!(-100))).collect();
    let t = 0.9;
    let ask = |mode: &str| {
        let req = json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": t,
            "top_k": 2, "top_p": 0.9, "seed": 5, "logprobs": true, "top_logprobs": 3, "logprobs_mode": mode,
            "return_token_ids": true, "logit_bias": eot});
        let (status, v) = post(s.port, "/v1/chat/completions", req);
        assert_eq!(status, 200, "{v}");
        v["choices"][0].clone()
    };
    let (raw, processed) = (ask("raw"), ask("processed"));
    assert_eq!(raw["token_ids"], processed["token_ids"], "the mode changes what is reported, not what is drawn");
    let lp = |e: &Value| e["logprob"].as_f64().unwrap();
    let mut worst = 0f64;
    for (r, p) in
        raw["logprobs"]["content"].as_array().unwrap().iter().zip(processed["logprobs"]["content"].as_array().unwrap())
    {
        let kept = p["kept"].as_u64().unwrap() as usize;
        assert!((1..=2).contains(&kept), "top-k 2 keeps 1 or 2 tokens: {p}");
        let (rt, pt) = (r["top_logprobs"].as_array().unwrap(), p["top_logprobs"].as_array().unwrap());
        let sum: f64 = pt[..kept].iter().map(|e| lp(e).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-5, "processed probabilities of the kept tokens sum to {sum}: {p}");
        assert!(pt[kept..].iter().all(|e| lp(e) == -9999.0), "a token not kept is -9999: {p}");
        // from the raw logprobs: log softmax(raw / t) over the kept tokens
        let scaled: Vec<f64> = rt[..kept].iter().map(|e| lp(e) / t).collect();
        let m = scaled.iter().cloned().fold(f64::MIN, f64::max);
        let lz = m + scaled.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        for (e, x) in pt[..kept].iter().zip(&scaled) {
            worst = worst.max((lp(e) - (x - lz)).abs());
        }
        let chosen = pt[..kept].iter().find(|e| e["token"] == p["token"]).expect("the token drawn was kept");
        assert_eq!(lp(chosen), lp(p));
    }
    println!("processed logprobs within {worst:e} of the raw ones renormalized");
    assert!(worst < 1e-6, "processed logprobs are {worst} from the raw ones renormalized over the kept tokens");
    // a mode that does not exist is named
    let (status, e) = post(
        s.port,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "x"}], "logprobs_mode": "cooked"}),
    );
    assert_eq!(status, 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("not one of raw, scaled, processed"), "{e}");
}

/// `prompt_logprobs`: a sampled answer, sent back as a prompt, gets for each of its tokens the
/// logprob (and kept count and alternatives) it was sampled with, bit for bit; plain and streamed.
#[test]
fn prompt_logprobs_are_the_sampled_bits() {
    let s = start(&[]);
    let tok =
        kvdecode::io::tokenizer::Tokenizer::from_gguf(&kvdecode::io::gguf::GgufFile::open(MODEL).unwrap()).unwrap();
    let eot: serde_json::Map<String, Value> = tok.end_of_turn().iter().map(|t| (t.to_string(), json!(-100))).collect();
    let sampling = json!({"temperature": 0.8, "top_k": 6, "seed": 9, "logprobs_mode": "processed"});
    let mut req = json!({"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 10, "logprobs": true,
        "top_logprobs": 2, "return_token_ids": true, "logit_bias": eot});
    req.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
    let (status, a) = post(s.port, "/v1/chat/completions", req);
    assert_eq!(status, 200, "{a}");
    let (prompt, answer) = (ids(&a["prompt_token_ids"]), ids(&a["choices"][0]["token_ids"]));
    let drawn = a["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    // the prompt and the answer, as one prompt of ids
    let mut all = prompt.clone();
    all.extend(&answer);
    let mut req = json!({"prompt": all, "max_tokens": 1, "prompt_logprobs": 2});
    req.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
    for stream in [false, true] {
        req["stream"] = json!(stream);
        let v = if stream {
            let (status, _, body) = http(s.port, "POST", "/v1/completions", &req.to_string());
            assert_eq!(status, 200);
            let first: Value = serde_json::from_str(&sse(&body)[0]).unwrap();
            first
        } else {
            let (status, v) = post(s.port, "/v1/completions", req.clone());
            assert_eq!(status, 200, "{v}");
            v
        };
        let lp = v["prompt_logprobs"].as_array().unwrap_or_else(|| panic!("no prompt_logprobs (stream {stream}): {v}"));
        assert_eq!(lp.len(), all.len());
        assert!(lp[0].is_null(), "the first prompt token has none");
        for (k, d) in drawn.iter().enumerate() {
            let e = &lp[prompt.len() + k];
            assert_eq!(e["token_id"], json!(answer[k]));
            let bits = |x: &Value| (x.as_f64().unwrap() as f32).to_bits();
            assert_eq!(bits(&e["logprob"]), bits(&d["logprob"]), "answer token {k} (stream {stream}): {e} vs {d}");
            assert_eq!(e["kept"], d["kept"]);
            assert_eq!(e["top_logprobs"], d["top_logprobs"]);
        }
    }
    // completions' legacy `echo` with `logprobs`: the prompt's text leads, its tokens lead the
    // logprobs (the first with none), the answer's tokens with the bits they were sampled with
    let mut req = json!({"prompt": all, "max_tokens": 1, "echo": true, "logprobs": 2});
    req.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
    let (status, v) = post(s.port, "/v1/completions", req.clone());
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    let text = tok.decode(&all.iter().map(|&t| t as u32).collect::<Vec<_>>(), false).unwrap();
    assert!(choice["text"].as_str().unwrap().starts_with(&text), "{choice}");
    let lps = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), all.len() + 1, "the prompt's tokens and the one generated");
    assert!(lps[0].is_null());
    for (k, d) in drawn.iter().enumerate() {
        let bits = |x: &Value| (x.as_f64().unwrap() as f32).to_bits();
        assert_eq!(bits(&lps[prompt.len() + k]), bits(&d["logprob"]), "echoed answer token {k}");
    }
    req["stream"] = json!(true);
    let (status, e) = post(s.port, "/v1/completions", req);
    assert_eq!(status, 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("`echo` with `stream`"), "{e}");
}

/// A five-turn tool-calling conversation kept as token ids, as an RL client keeps it (Part 2's
/// done-when): the template is rendered once through `/tokenize`; each turn the engine writes a
/// `<tool_call>` block from the ids so far (`/v1/completions` with a prompt of ids, the call's
/// Lark grammar as vLLM's `structured_outputs`, `return_token_ids`), and the tool's answer is
/// rendered and appended as ids. Every turn's `prompt_token_ids` are the ids sent, as sent, and
/// each answer's ids end with the end-of-turn id the engine sampled, so the conversation ends
/// holding every id the engine decoded, as decoded. Its text is the text the template renders
/// for the same messages, which tokenized again gives other ids: the drift this avoids (printed).
#[test]
fn a_five_turn_tool_conversation_keeps_the_decoded_ids() {
    let s = start_model(TOOLS_MODEL);
    let tokenize = |body: Value| {
        let (status, t) = post(s.port, "/tokenize", body);
        assert_eq!(status, 200, "{t}");
        ids(&t["tokens"])
    };
    let detokenize = |tokens: &[u64]| {
        let (status, d) = post(s.port, "/detokenize", json!({"tokens": tokens}));
        assert_eq!(status, 200, "{d}");
        d["prompt"].as_str().unwrap().to_string()
    };
    let end_of_turn = tokenize(json!({"prompt": "<|im_end|>"}));
    assert_eq!(end_of_turn.len(), 1, "<|im_end|> is one special token: {end_of_turn:?}");
    let number = json!({"type": "integer", "minimum": 0, "maximum": 99});
    let arguments = json!({"type": "object", "properties": {"a": number, "b": number},
        "required": ["a", "b"], "additionalProperties": false});
    let tools = json!([{"type": "function", "function": {"name": "add", "parameters": arguments}}]);
    let call = json!({"type": "object", "properties": {"name": {"const": "add"}, "arguments": arguments},
        "required": ["name", "arguments"], "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}});
    let grammar = format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {call}\n");
    let mut messages = vec![json!({"role": "user", "content": "add two numbers, five times"})];
    let mut convo = tokenize(json!({"messages": messages, "tools": tools}));
    let mut calls = Vec::new(); // where each answer's ids sit in the conversation, and the ids
    for turn in 0..5 {
        let req = json!({"prompt": convo, "max_tokens": 80, "temperature": 1.0, "seed": turn,
            "return_token_ids": true, "structured_outputs": {"grammar": grammar}});
        let (status, v) = post(s.port, "/v1/completions", req);
        assert_eq!(status, 200, "turn {turn}: {v}");
        assert_eq!(ids(&v["prompt_token_ids"]), convo, "turn {turn}: the prompt is the ids sent, as sent");
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "turn {turn}: the call ends its turn: {v}");
        let answer = ids(&choice["token_ids"]);
        assert_eq!(answer.last(), end_of_turn.last(), "turn {turn}: the end-of-turn id is among the ids");
        let text = choice["text"].as_str().unwrap();
        let args = text
            .strip_prefix("<tool_call>\n{\"name\": \"add\", \"arguments\": ")
            .and_then(|t| t.strip_suffix("}\n</tool_call>"))
            .unwrap_or_else(|| panic!("turn {turn}: not a call of add: {text:?}"));
        let parsed: Value = serde_json::from_str(args).unwrap();
        let sum = parsed["a"].as_u64().unwrap() + parsed["b"].as_u64().unwrap();
        calls.push((convo.len(), answer.clone()));
        convo.extend(&answer);
        // the tool's answer and the next turn opened, rendered (this template puts nothing
        // between one turn's end and the next)
        let result = json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": sum.to_string()});
        convo.extend(tokenize(json!({"messages": [result], "add_generation_prompt": true})));
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{turn}"),
            "type": "function", "function": {"name": "add", "arguments": args}}]}));
        messages.push(result);
    }
    for (at, answer) in &calls {
        assert_eq!(&convo[*at..*at + answer.len()], answer, "an answer's ids, as decoded");
    }
    // the same conversation as messages, rendered and tokenized again: the same text but for the
    // newline the generation prompt ends with, which the template drops before a call in history
    // (the kind of drift re-rendering brings)
    let again = tokenize(json!({"messages": messages, "tools": tools}));
    let kept = detokenize(&convo).replace("<|im_start|>assistant\n<tool_call>", "<|im_start|>assistant<tool_call>");
    assert_eq!(kept, detokenize(&again), "the ids say what the messages say");
    let same = (0..convo.len().min(again.len())).take_while(|&i| convo[i] == again[i]).count();
    println!(
        "5 turns, {} ids kept as decoded; the messages tokenized again: {} ids, the same for the first {same}",
        convo.len(),
        again.len()
    );
}
