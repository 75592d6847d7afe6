//! `kvdecode serve` over real HTTP (plain sockets, so the wire format itself is checked): the
//! OpenAI shapes, streaming, `n` forks, stop strings, logprobs, logit bias, seeded determinism
//! under concurrent load, cancellation on disconnect, backpressure and every error case.
//! The model is a tiny random GGUF with a ChatML template (fuzz/seeds), so tests are fast.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::server::*;

#[test]
fn shapes_streaming_and_the_small_endpoints() {
    let s = start(&[]);
    let (st, _, body) = http(s.port, "GET", "/health", "");
    assert_eq!((st, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (st, _, body) = http(s.port, "GET", "/v1/models", "");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((st, v["data"][0]["id"].as_str()), (200, Some("llama-f32-chatml.gguf")));

    // chat, greedy: the usual shape and usage
    let v = chat(s.port, json!({"temperature": 0}));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let u = &v["usage"];
    assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());
    assert!(["length", "stop"].contains(&v["choices"][0]["finish_reason"].as_str().unwrap()));

    // the same request streamed: role first, deltas that add up to the same text, finish, usage, [DONE]
    let body = json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (st, head, raw) = http(s.port, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(st, 200);
    assert!(head.to_ascii_lowercase().contains("content-type: text/event-stream"), "{head}");
    let events = sse(&raw);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(streamed, text(&v, 0), "streamed and non-streamed greedy answers differ");
    let last = &chunks[chunks.len() - 1];
    assert!(last["choices"].as_array().unwrap().is_empty());
    assert_eq!(last["usage"], v["usage"]);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], v["choices"][0]["finish_reason"]);

    // completions: string and token-id prompts, logprobs with alternatives
    let (st, v) =
        post(s.port, "/v1/completions", json!({"prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 3}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let lp = &v["choices"][0]["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert!(n >= 1 && lp["token_logprobs"].as_array().unwrap().len() == n);
    assert!(lp["top_logprobs"].as_array().unwrap().iter().all(|t| t.as_object().unwrap().len() <= 3));
    let (st, v2) = post(s.port, "/v1/completions", json!({"prompt": [49, 54], "max_tokens": 6, "temperature": 0}));
    assert_eq!(st, 200, "{v2}");

    // metrics: Prometheus text with the counters moving
    let (st, _, m) = http(s.port, "GET", "/metrics", "");
    assert_eq!(st, 200);
    for name in [
        "kvdecode_requests_total{outcome=\"ok\"}",
        "kvdecode_completion_tokens_total",
        "kvdecode_queue_depth",
        "kvdecode_rows_in_use",
        "kvdecode_kv_tokens_in_use",
        "kvdecode_time_to_first_token_seconds_bucket",
        "kvdecode_time_per_output_token_seconds_count",
    ] {
        assert!(m.contains(name), "/metrics lacks {name}:\n{m}");
    }
    let ok: u64 = m
        .lines()
        .find(|l| l.starts_with("kvdecode_requests_total{outcome=\"ok\"}"))
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(ok >= 4, "{ok}");
}

#[test]
fn sampling_parameters_are_honoured() {
    let s = start(&[]);
    // seeded sampling is reproducible; another seed differs
    let a = chat(s.port, json!({"temperature": 1.0, "seed": 11, "max_tokens": 16}));
    let b = chat(s.port, json!({"temperature": 1.0, "seed": 11, "max_tokens": 16}));
    let c = chat(s.port, json!({"temperature": 1.0, "seed": 12, "max_tokens": 16}));
    assert_eq!(text(&a, 0), text(&b, 0));
    assert_ne!(text(&a, 0), text(&c, 0));
    // n: the prompt prefilled once and forked; choice i is what seed + i gives alone
    let n3 = chat(s.port, json!({"temperature": 1.0, "seed": 11, "max_tokens": 16, "n": 3}));
    assert_eq!(n3["choices"].as_array().unwrap().len(), 3);
    assert_eq!(text(&n3, 0), text(&a, 0));
    assert_eq!(text(&n3, 1), text(&c, 0));
    // stop strings: the greedy answer cut before the first match, across token boundaries
    let g = chat(s.port, json!({"temperature": 0, "max_tokens": 16}));
    let full = text(&g, 0);
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 6, "{full:?}");
    let stop: String = chars[3..5].iter().collect();
    let cut = chat(s.port, json!({"temperature": 0, "max_tokens": 16, "stop": [stop.clone(), "\u{1}never"]}));
    assert_eq!(text(&cut, 0), full[..full.find(&stop).unwrap()].to_string());
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    // streamed, the stop string never shows up either
    let body = json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16, "temperature": 0,
                      "stop": stop, "stream": true});
    let (_, _, raw) = http(s.port, "POST", "/v1/chat/completions", &body.to_string());
    let streamed: String = sse(&raw)
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, text(&cut, 0));
    // logit_bias: +100 on one token makes greedy decoding repeat it
    let tokens = |extra: Value| -> Vec<String> {
        let mut body = json!({"prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, v) = post(s.port, "/v1/completions", body);
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    let biased = tokens(json!({"logit_bias": {"40": 100}}));
    assert_eq!(biased.len(), 8);
    assert!(biased.iter().all(|t| *t == biased[0]), "{biased:?}");
    let plain = tokens(json!({}));
    assert!(plain.iter().any(|t| *t != biased[0]), "{plain:?}");
    // frequency penalty: each time token 40 comes out, its +8 bias shrinks by 2, so it stops
    // repeating; without the penalty it fills all 8 tokens
    let count = |v: &[String]| v.iter().filter(|t| **t == biased[0]).count();
    assert_eq!(count(&tokens(json!({"logit_bias": {"40": 8}}))), 8);
    let penalized = tokens(json!({"logit_bias": {"40": 8}, "frequency_penalty": 2.0}));
    assert!((1..=5).contains(&count(&penalized)), "{penalized:?}");
    // presence penalty: the smallest bias that makes token 40 fill all 8 tokens no longer does
    // once its first appearance costs 2
    let b = [0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0]
        .into_iter()
        .find(|b| count(&tokens(json!({"logit_bias": {"40": b}}))) == 8)
        .expect("a bias of 8 fills the answer");
    let presence = tokens(json!({"logit_bias": {"40": b}, "presence_penalty": 2.0}));
    assert!(count(&presence) < 8, "bias {b}: {presence:?}");
    // chat logprobs with top alternatives: the greedy token is the most likely one
    let lp = chat(s.port, json!({"temperature": 0, "max_tokens": 4, "logprobs": true, "top_logprobs": 2}));
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], e["token"]);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }
}

#[test]
fn bad_requests_are_named_and_the_server_keeps_serving() {
    let s = start(&["--max-body", "2000"]);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "foo": 1}).to_string(), 400, "Unrecognized request argument supplied: foo"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}).to_string(), 400, "`temperature` must be a number in [0, 2]"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}).to_string(), 400, "`top_p` must be greater than 0"),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400, "`messages` must be a non-empty array"),
        ("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string(), 400, "unknown role"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000}).to_string(), 400, "`max_tokens` 1000000 is more than"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "n": 99}).to_string(), 400, "`n` must be an integer in [1, 8]"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}).to_string(), 400, "`response_format` {\"type\":\"xml\"} is not supported"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}).to_string(), 400, "the JSON schema was refused"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}).to_string(), 400, "`json_schema.schema` must be"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}).to_string(), 400, "this model's chat template does not take tools"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}).to_string(), 400, "needs `logprobs`"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}).to_string(), 400, "not a token id"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}).to_string(), 400, "`stop` must be a string or up to 4 strings"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "functions": []}).to_string(), 400, "`functions` is not supported"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}).to_string(), 400, "only allowed when `stream` is true"),
        ("/v1/completions", json!({"prompt": "hi", "echo": true, "stream": true}).to_string(), 400, "`echo` with `stream` is not supported"),
        ("/v1/completions", json!({"prompt": ["a", "b"]}).to_string(), 400, "several prompts"),
        ("/v1/completions", json!({"prompt": [1, 99999]}).to_string(), 400, "below the vocabulary size"),
        ("/v1/completions", json!({"prompt": ""}).to_string(), 400, "the prompt is empty"),
        ("/v1/completions", "{not json".to_string(), 400, "not valid JSON"),
        ("/v1/completions", "[1, 2]".to_string(), 400, "must be a JSON object"),
        ("/v1/completions", json!({"prompt": "x".repeat(3000)}).to_string(), 413, "larger than 2000 bytes"),
    ];
    for (path, body, want_status, want) in &cases {
        let (st, _, raw) = http(s.port, "POST", path, body);
        let v: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{e}: {raw}"));
        assert_eq!(st, *want_status, "{body:.80}: {raw}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(want), "{body:.80}: {msg}");
        assert!(v["error"]["type"].is_string());
    }
    // long prompts: more tokens than a row holds
    let long = json!({ "prompt": vec![5; 3000] }).to_string();
    let s2 = start(&["--max-len", "64"]);
    let (st, _, raw) = http(s2.port, "POST", "/v1/completions", &long);
    assert_eq!(st, 400, "{raw}");
    assert!(raw.contains("rows hold 64 tokens"), "{raw}");
    let bias: serde_json::Map<_, _> = (0..1025).map(|t| (t.to_string(), json!(1))).collect();
    let (st, _, raw) =
        http(s2.port, "POST", "/v1/completions", &json!({"prompt": "hi", "logit_bias": bias}).to_string());
    assert_eq!(st, 400, "{raw}");
    assert!(raw.contains("more than the limit of 1024"), "{raw}");
    let long_stop = json!({"prompt": "hi", "stop": ["x".repeat(8193)]}).to_string();
    let (st, _, raw) = http(s2.port, "POST", "/v1/completions", &long_stop);
    assert_eq!(st, 400, "{raw}");
    assert!(raw.contains("8193 bytes is longer than the limit of 8192"), "{raw}");
    // and everyone still gets answers
    let (st, _, _) = http(s.port, "GET", "/health", "");
    assert_eq!(st, 200);
    chat(s.port, json!({"temperature": 0, "max_tokens": 2}));
    // a penalty with no max_tokens: one bias slot per token of the rest of the row (more than the
    // engine's default 1024 slots), which once came back as a 500; the end of turn ends it at once
    let tok =
        kvdecode::io::tokenizer::Tokenizer::from_gguf(&kvdecode::io::gguf::GgufFile::open(MODEL).unwrap()).unwrap();
    let eot = tok.end_of_turn()[0].to_string();
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5, "logit_bias": {eot: 100}});
    let (status, v) = post(s.port, "/v1/chat/completions", body);
    assert_eq!((status, &v["choices"][0]["finish_reason"]), (200, &json!("stop")), "{v}");
    let (_, _, m) = http(s.port, "GET", "/metrics", "");
    assert!(m.contains(&format!("kvdecode_requests_total{{outcome=\"client_error\"}} {}", cases.len())), "{m}");
}

/// A server on a port browsers can reach: other Host names (DNS rebinding: bound to loopback
/// without a key), other origins (unless --allowed-origins names them) and bodies that are not
/// JSON (a text/plain POST needs no preflight) are refused before anything runs.
#[test]
fn hosts_origins_and_content_types_are_checked() {
    let s = start(&["--allowed-origins", "http://app.example"]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string();
    let json_ct = "Content-Type: application/json\r\n";
    let chat = "/v1/chat/completions";
    let cases = [
        ("Host: evil.example\r\n", "POST", json_ct, 403, "is not served"),
        ("Host: evil.example:8080\r\n", "GET", "", 403, "is not served"),
        ("Host: localhost\r\nOrigin: http://evil.example\r\n", "POST", json_ct, 403, "cross-origin"),
        ("Host: localhost\r\n", "POST", "Content-Type: text/plain\r\n", 415, "application/json"),
        ("Host: localhost\r\n", "POST", "", 415, "application/json"),
    ];
    for (host, method, ct, want, msg) in cases {
        let path = if method == "GET" { "/v1/models" } else { chat };
        let (status, _, out) = http_raw(s.port, method, path, &body, &format!("{host}{ct}"));
        assert_eq!(status, want, "{host:?} {ct:?}: {out}");
        assert!(out.contains(msg), "{out}");
    }
    // allowed: loopback names, this server's own pages, the named origin (with CORS headers)
    for headers in ["Host: 127.0.0.1:9\r\n", "Host: [::1]\r\n", "Host: localhost:9\r\nOrigin: http://localhost:9\r\n"] {
        let (status, _, out) = http_raw(s.port, "POST", chat, &body, &format!("{headers}{json_ct}"));
        assert_eq!(status, 200, "{headers:?}: {out}");
    }
    let app = "Host: localhost\r\nOrigin: http://app.example\r\n";
    let (status, head, _) = http_raw(s.port, "POST", chat, &body, &format!("{app}{json_ct}"));
    assert_eq!(status, 200);
    assert!(head.to_ascii_lowercase().contains("access-control-allow-origin: http://app.example"), "{head}");
    let (status, head, _) = http_raw(s.port, "OPTIONS", chat, "", app);
    assert_eq!(status, 204);
    assert!(head.to_ascii_lowercase().contains("access-control-allow-methods"), "{head}");
    // nothing refused reached the engine: one generation per allowed POST
    let (_, _, m) = http(s.port, "GET", "/metrics", "");
    assert!(m.contains("kvdecode_requests_total{outcome=\"ok\"} 4"), "{m}");
}

#[test]
fn a_client_that_disconnects_frees_its_row() {
    let s = start(&["--rows", "2", "--max-len", "2000"]);
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1900, "temperature": 1.0,
                      "stream": true, "logit_bias": {"0": -100, "1": -100}});
    let mut sock = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    let b = body.to_string();
    write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len())
        .unwrap();
    let mut buf = [0u8; 512];
    let n = sock.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    drop(sock);
    // within a few steps the generation is cancelled and its row is free
    let t0 = Instant::now();
    loop {
        let (_, _, m) = http(s.port, "GET", "/metrics", "");
        let get = |name: &str| -> u64 {
            m.lines().find(|l| l.starts_with(name)).and_then(|l| l.split(' ').nth(1)).unwrap().parse().unwrap()
        };
        if get("kvdecode_generations_cancelled_total") >= 1 && get("kvdecode_rows_in_use ") == 0 {
            assert!(get("kvdecode_completion_tokens_total") < 1900, "it ran to the end");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "not cancelled:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_full_queue_is_429_with_retry_after() {
    // paused, nothing finishes: the engine thread still takes every request from the channel, so
    // only a count of what is in the server (rows + --queue = 3) bounds it
    let admin = "Authorization: Bearer admin-9\r\n";
    let s = start(&["--rows", "1", "--queue", "2", "--admin-key", "admin-9"]);
    let port = s.port;
    assert_eq!(http_with(port, "POST", "/v1/pause", "{}", admin).0, 200);
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let (b, tx) = (short.clone(), tx.clone());
            std::thread::spawn(move || tx.send(http(port, "POST", "/v1/chat/completions", &b)).unwrap())
        })
        .collect();
    // five are refused at once, while the server holds three
    let at_once = || rx.recv_timeout(Duration::from_secs(30)).expect("the server refuses what it cannot hold at once");
    let rejected: Vec<(u16, String, String)> = (0..5).map(|_| at_once()).collect();
    for r in &rejected {
        assert_eq!(r.0, 429, "{}", r.2);
        assert!(r.1.to_ascii_lowercase().contains("retry-after: 1"), "{}", r.1);
        assert!(r.2.contains("queue is full"));
    }
    assert_eq!(http_with(port, "POST", "/v1/resume", "{}", admin).0, 200);
    for h in handles {
        h.join().unwrap();
    }
    let answered: Vec<u16> = rx.try_iter().map(|r| r.0).collect();
    assert_eq!(answered, [200; 3]);
    // and once they are done there is room again
    chat(port, json!({"max_tokens": 1}));
}

/// The CI variant of the load run: mixed streaming / non-streaming / cancelled / malformed
/// requests over many connections, every answer checked against the same request alone, no 5xx,
/// nothing lost, the server's memory flat.
#[test]
fn load_run_checks_every_answer() {
    let s = start(&["--rows", "8", "--queue", "512"]);
    let out = Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["bench-serve", "--url", &format!("http://127.0.0.1:{}", s.port), "--requests", "400"])
        .args(["--concurrency", "32", "--max-tokens", "12", "--json", "--server-pid", &s.child.id().to_string()])
        .output()
        .expect("run bench-serve");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!((v["server_5xx"].as_u64(), v["lost"].as_u64(), v["mismatched"].as_u64()), (Some(0), Some(0), Some(0)));
    assert_eq!(v["answered"], 320);
    let (before, after) = (v["rss_kib_before"].as_u64().unwrap(), v["rss_kib_after"].as_u64().unwrap());
    assert!(after < before + 64 * 1024, "server RSS grew from {before} to {after} KiB");
    println!("{stdout}");
}

#[test]
fn greedy_answers_do_not_depend_on_concurrent_traffic() {
    let s = start(&["--rows", "4"]);
    let prompts = ["hello there", "what is this", "a b c", "tell me more", "why", "x y z w"];
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            text(
                &chat(
                    s.port,
                    json!({"temperature": 0, "max_tokens": 10, "messages": [{"role": "user", "content": p}]}),
                ),
                0,
            )
        })
        .collect();
    let port = s.port;
    let handles: Vec<_> = (0..3)
        .flat_map(|_| prompts.iter().enumerate())
        .map(|(i, p)| {
            let p = p.to_string();
            std::thread::spawn(move || {
                (
                    i,
                    text(
                        &chat(
                            port,
                            json!({"temperature": 0, "max_tokens": 10, "messages": [{"role": "user", "content": p}]}),
                        ),
                        0,
                    ),
                )
            })
        })
        .collect();
    for h in handles {
        let (i, got) = h.join().unwrap();
        assert_eq!(got, alone[i], "prompt {i} batched vs alone");
    }
}

/// Structured output: with a JSON schema every answer (greedy, sampled, streamed, several
/// choices) is JSON that validates against it, and ends on its own.
#[test]
fn json_schema_answers_validate() {
    let s = start(&[]);
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                        "tag": {"type": "string", "maxLength": 5}},
                        "required": ["ok", "n", "tag"], "additionalProperties": false});
    let validate = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["ok"].is_boolean() && [1, 2, 3].contains(&o["n"].as_i64().unwrap()), "{text}");
        assert!(o["tag"].as_str().unwrap().chars().count() <= 5, "{text}");
    };
    let fmt = json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}});
    for (t, seed) in [(0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3)] {
        let v = chat(s.port, json!({"temperature": t, "seed": seed, "max_tokens": 60, "n": 2, "response_format": fmt}));
        for i in 0..2 {
            validate(&text(&v, i));
            assert_eq!(v["choices"][i]["finish_reason"], "stop");
        }
    }
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 60, "temperature": 1.0,
                      "seed": 9, "stream": true, "response_format": fmt});
    let (_, _, raw) = http(s.port, "POST", "/v1/chat/completions", &body.to_string());
    let streamed: String = sse(&raw)
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect();
    validate(&streamed);
    // and rows without a schema in the same batch are untouched: greedy alone equals greedy now
    let plain = chat(s.port, json!({"temperature": 0, "max_tokens": 8}));
    assert!(serde_json::from_str::<Value>(&text(&plain, 0)).is_err() || !text(&plain, 0).starts_with('{'));
}

/// vLLM's `structured_outputs`: a regex, a choice and a Lark grammar each hold for every sampled
/// answer; a shape that is not exactly one of the four, or two constraints at once, is a 400
/// naming it; and a grammar that names the end-of-turn token partway ends the answer there.
#[test]
fn structured_outputs_regex_choice_and_grammar() {
    let s = start(&[]);
    let ask = |so: Value, seed: u64| {
        let body =
            json!({"prompt": "hi", "max_tokens": 24, "temperature": 1.0, "seed": seed, "structured_outputs": so});
        post(s.port, "/v1/completions", body)
    };
    let answer = |(st, v): (u16, Value)| {
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    for seed in 0..3 {
        let t = answer(ask(json!({"regex": "[0-9]{3}-[a-c]+"}), seed));
        let (digits, letters) = t.split_once('-').unwrap_or_else(|| panic!("{t:?}"));
        assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{t:?}");
        assert!(!letters.is_empty() && letters.bytes().all(|b| (b'a'..=b'c').contains(&b)), "{t:?}");
        let t = answer(ask(json!({"choice": ["yes", "no", "maybe so"]}), seed));
        assert!(["yes", "no", "maybe so"].contains(&t.as_str()), "{t:?}");
        let t = answer(ask(json!({"grammar": "start: \"(\" num \"+\" num \")\"\nnum: /[1-9][0-9]?/\n"}), seed));
        let inner = t.strip_prefix('(').and_then(|t| t.strip_suffix(')')).unwrap_or_else(|| panic!("{t:?}"));
        assert!(inner.split('+').all(|n| n.parse::<u32>().is_ok_and(|n| (1..100).contains(&n))), "{t:?}");
    }
    for (so, want) in [
        (json!("a"), "`structured_outputs` must be an object"),
        (json!({"json": {"type": "object"}, "regex": "a"}), "takes exactly one of json, grammar, regex, choice"),
        (json!({"ebnf": "x"}), "`structured_outputs.ebnf` is not supported"),
        (json!({"choice": []}), "`structured_outputs.choice` has the wrong type"),
        (json!({"regex": "("}), "the constraint was refused"),
    ] {
        let (st, v) = ask(so.clone(), 0);
        assert_eq!(st, 400, "{so}: {v}");
        assert_eq!(v["error"]["param"], "structured_outputs", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(want), "{so}: {v}");
    }
    let body =
        json!({"prompt": "hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}});
    let (st, v) = post(s.port, "/v1/completions", body);
    assert!(st == 400 && v["error"]["message"].as_str().unwrap().contains("exclude each other"), "{v}");
    // a grammar that names the end-of-turn token partway ends there: the answer so far, stopped
    let (st, v) = ask(json!({"grammar": "start: \"a\" <|im_end|> \"b\"\n"}), 0);
    assert_eq!(
        (st, v["choices"][0]["text"].clone(), v["choices"][0]["finish_reason"].clone()),
        (200, json!("a"), json!("stop"))
    );
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                         "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

/// A call's arguments obey its tool's parameters.
fn check_call(call: &Value, only: Option<&str>) {
    let f = &call["function"];
    let name = f["name"].as_str().unwrap();
    let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(call["type"], "function");
    match name {
        "get_weather" => {
            assert!(args["city"].as_str().unwrap().chars().count() <= 12, "{args}");
            assert!(["c", "f"].contains(&args["unit"].as_str().unwrap()), "{args}");
        }
        "add" => assert!(
            (0..=99).contains(&args["a"].as_i64().unwrap()) && (0..=99).contains(&args["b"].as_i64().unwrap()),
            "{args}"
        ),
        other => panic!("called {other}"),
    }
    if let Some(n) = only {
        assert_eq!(name, n);
    }
}

#[test]
fn tools_through_the_template_and_forced_calls() {
    let srv = start_model(TOOLS_MODEL);
    let port = srv.port;
    let ask = json!([{"role": "user", "content": "weather in Paris?"}]);
    for (choice, only) in
        [(json!("required"), None), (json!({"type": "function", "function": {"name": "add"}}), Some("add"))]
    {
        for seed in 0..3 {
            let (st, v) = post(
                port,
                "/v1/chat/completions",
                json!({"messages": ask, "max_tokens": 80, "temperature": 1.0,
                "seed": seed, "tools": tools(), "tool_choice": choice}),
            );
            assert_eq!(st, 200, "{v}");
            let c = &v["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{v}");
            assert!(c["message"]["content"].is_null());
            let calls = c["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1);
            check_call(&calls[0], only);
        }
    }
    // streamed: the call arrives whole in one delta, then finish_reason tool_calls
    let body = json!({"messages": ask, "max_tokens": 80, "temperature": 0, "stream": true, "tools": tools(),
                      "tool_choice": "required"});
    let (_, _, raw) = http(port, "POST", "/v1/chat/completions", &body.to_string());
    let chunks: Vec<Value> =
        sse(&raw).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let call =
        chunks.iter().find_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0).cloned()).expect("a tool call delta");
    assert_eq!(call["index"], 0);
    check_call(&call, None);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // the conversation goes on with the call and its result in the template
    let (st, v) = post(
        port,
        "/v1/chat/completions",
        json!({"max_tokens": 4, "temperature": 0, "tools": tools(), "messages": [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]}),
    );
    assert_eq!(st, 200, "{v}");
    // errors: a named tool that is not there, tool_choice without tools, a template without tools
    let (st, v) = post(
        port,
        "/v1/chat/completions",
        json!({"messages": ask, "tools": tools(),
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    );
    assert!(st == 400 && v["error"]["message"].as_str().unwrap().contains("\"nope\", which is not in `tools`"), "{v}");
    let (st, v) = post(port, "/v1/chat/completions", json!({"messages": ask, "tool_choice": "required"}));
    assert!(st == 400 && v["error"]["message"].as_str().unwrap().contains("requires `tools`"), "{v}");
    let plain = start(&[]);
    let (st, v) = post(plain.port, "/v1/chat/completions", json!({"messages": ask, "tools": tools()}));
    assert!(st == 400 && v["error"]["message"].as_str().unwrap().contains("does not take tools"), "{v}");
}

#[test]
fn the_page_is_served_beside_the_api() {
    let web = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/web");
    let s = start(&["--web", web]);
    let (st, head, body) = http(s.port, "GET", "/", "");
    assert_eq!(st, 200, "{head}");
    assert!(body.contains("main.js"), "{body:.200}");
    let (st, _, _) = http(s.port, "GET", "/main.js", "");
    assert_eq!(st, 200);
    // the API still answers on the same port
    let (st, _, _) = http(s.port, "GET", "/v1/models", "");
    assert_eq!(st, 200);
}

/// The counter `name` in a Prometheus text exposition.
fn metric(m: &str, name: &str) -> u64 {
    m.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("/metrics lacks {name}:\n{m}"))
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_conversation_that_continues_hits_the_prompt_cache() {
    let s = start(&[]);
    let first = json!([{"role": "user", "content": "Name three colours of the rainbow."}]);
    let a = chat(s.port, json!({"messages": first, "max_tokens": 24, "temperature": 0}));
    let (_, _, m) = http(s.port, "GET", "/metrics", "");
    let before = metric(&m, "kvdecode_prompt_cache_hit_tokens_total");
    // the next turn's prompt is the first prompt, the answer, and a new question
    let next = json!([
        {"role": "user", "content": "Name three colours of the rainbow."},
        {"role": "assistant", "content": text(&a, 0)},
        {"role": "user", "content": "And two more?"}
    ]);
    chat(s.port, json!({"messages": next, "max_tokens": 8, "temperature": 0}));
    // the engine thread updates the counters right after its step: poll briefly
    let mut after = before;
    for _ in 0..50 {
        let (_, _, m) = http(s.port, "GET", "/metrics", "");
        after = metric(&m, "kvdecode_prompt_cache_hit_tokens_total");
        assert!(m.contains("kvdecode_kv_blocks_cached"), "{m}");
        if after > before {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(40));
    }
    assert!(after >= before + 16, "no prompt-cache hit for the continued conversation: {before} -> {after}");
}

#[test]
fn newer_families_serve_transformers_greedy_answers() {
    // each newer family's transformers fixture (tests/fixtures/hf) served from its Hugging Face
    // directory with a word-level tokenizer of its 128 ids ("t0" .. "t127"): the greedy completion
    // of the fixture's 16-token prompt is transformers' own greedy continuation
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf");
    let vocab: serde_json::Map<String, Value> = (0..128).map(|i| (format!("t{i}"), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    // the mixtures of experts also return the experts every token went to (vLLM's
    // return_routed_experts): the prompt's are transformers' routes of those positions
    let moe = ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"];
    for family in ["qwen2", "llama3", "mistral", "smollm3", "gemma2", "olmo2", "phi3"].into_iter().chain(moe) {
        let dir = std::env::temp_dir().join(format!("kvdecode-serve-{family}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixtures.join(family).join(f), dir.join(f)).unwrap();
        }
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let ids = kvdecode::io::npy::read(fixtures.join(family).join("generate_ids.npy")).unwrap().to_u32().unwrap();
        let (prompt, want) = ids.split_at(16);
        // rows of 128 positions: Phi-3's LongRoPE takes its short factors, as transformers does
        // for a generation this short
        let is_moe = moe.contains(&family);
        let flags: &[&str] =
            if is_moe { &["--max-len", "128", "--enable-return-routed-experts"] } else { &["--max-len", "128"] };
        let s = start_with(dir.to_str().unwrap(), flags);
        let body =
            json!({"prompt": prompt, "max_tokens": want.len(), "temperature": 0, "return_routed_experts": is_moe});
        let (st, v) = post(s.port, "/v1/completions", body.clone());
        if !is_moe && family == "qwen2" {
            // a dense model has no routes to return: named, not ignored
            let (st, e) = post(s.port, "/v1/completions", json!({"prompt": prompt, "return_routed_experts": true}));
            assert_eq!(st, 400, "{e}");
            assert_eq!(e["error"]["param"], "return_routed_experts", "{e}");
        }
        assert_eq!(st, 200, "{family}: {v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        let got: Vec<u32> = text.split_whitespace().map(|t| t.trim_start_matches('t').parse().unwrap()).collect();
        assert_eq!(got, want, "{family}: served greedy tokens against transformers' generate");
        if is_moe {
            let routes = &v["choices"][0]["routed_experts"];
            let routes: Vec<u32> = routes
                .as_array()
                .unwrap_or_else(|| panic!("{family}: no routed_experts: {v}"))
                .iter()
                .flat_map(|t| t.as_array().unwrap().iter().flat_map(|l| l.as_array().unwrap().iter()))
                .map(|e| e.as_u64().unwrap() as u32)
                .collect();
            let want_routes =
                kvdecode::io::npy::read(fixtures.join(family).join("routes.npy")).unwrap().to_u32().unwrap();
            let per_token = want_routes.len() / 300;
            assert_eq!(
                routes.len(),
                (prompt.len() + want.len() - 1) * per_token,
                "{family}: routes of every fed token"
            );
            assert_eq!(routes[..16 * per_token], want_routes[..16 * per_token], "{family}: the prompt's routes");
            // streamed: the choice's last chunk carries the same routes
            let mut body = body;
            body["stream"] = json!(true);
            let (st, _, raw) = http(s.port, "POST", "/v1/completions", &body.to_string());
            assert_eq!(st, 200);
            let events = sse(&raw);
            let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
            assert_eq!(last["choices"][0]["routed_experts"], v["choices"][0]["routed_experts"], "{family}: streamed");
        }
        drop(s);
        std::fs::remove_dir_all(&dir).ok();
    }
}
