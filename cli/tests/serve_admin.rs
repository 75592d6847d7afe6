//! `kvdecode serve --api-key`: every endpoint but /health and the admin ones needs the key;
//! `--admin-key` (another key) opens the admin endpoints (new weights from `--weights-dir`, pause,
//! resume, prompt-cache reset); every response says which weights made it. The model is the tiny
//! random GGUF of the other server tests.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::server::*;
use kvdecode::DiskDtype;
use serde_json::{json, Value};

const KEY: &str = "sekret-key-1";
const ADMIN: &str = "admin-key-7";

fn auth(key: &str) -> String {
    format!("Authorization: Bearer {key}\r\n")
}

/// POST with the key; (status, JSON body).
fn post_key(port: u16, path: &str, body: Value) -> (u16, Value) {
    post_with(port, path, body, KEY)
}

/// POST with the admin key.
fn post_admin(port: u16, path: &str, body: Value) -> (u16, Value) {
    post_with(port, path, body, ADMIN)
}

fn post_with(port: u16, path: &str, body: Value, key: &str) -> (u16, Value) {
    let (status, _, body) = http_with(port, "POST", path, &body.to_string(), &auth(key));
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

/// A fresh weights folder holding the test model (`model.gguf`); removed when dropped.
struct WeightsDir(std::path::PathBuf);

impl WeightsDir {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvdecode-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(MODEL, dir.join("model.gguf")).unwrap();
        WeightsDir(dir)
    }
    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for WeightsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// New random weights of the test model's shape in a safetensors file (kvdecode's names).
fn other_weights(dir: &std::path::Path, seed: u64) -> String {
    let w = kvdecode::io::gguf::GgufFile::open(MODEL).unwrap().weights().unwrap();
    let path = dir.join(format!("weights-{seed}.safetensors"));
    kvdecode::ModelWeights::random(&w.cfg, seed).unwrap().save_safetensors(&path, DiskDtype::F32).unwrap();
    path.to_string_lossy().into_owned()
}

fn request(i: usize) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": format!("question number {i}")}],
           "max_tokens": 16, "temperature": 0, "logit_bias": {"0": -100, "1": -100}})
}

#[test]
fn the_api_key_guards_every_endpoint_but_health() {
    let s = start(&["--api-key", KEY, "--admin-key", ADMIN]);
    let body = request(0).to_string();
    assert_eq!(http(s.port, "GET", "/health", "").0, 200, "/health stays open");
    for (headers, what) in
        [(String::new(), "no key"), (auth("sekret-key-2"), "a wrong key"), (auth(""), "an empty key")]
    {
        for (method, path, b) in
            [("POST", "/v1/chat/completions", body.as_str()), ("GET", "/v1/models", ""), ("GET", "/metrics", "")]
        {
            let (status, head, out) = http_with(s.port, method, path, b, &headers);
            assert_eq!(status, 401, "{what} on {path}: {out}");
            assert!(head.to_ascii_lowercase().contains("www-authenticate: bearer"), "{head}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        }
        let (status, _, _) = http_with(s.port, "POST", "/v1/pause", "{}", &headers);
        assert_eq!(status, 401, "{what} on an admin endpoint");
    }
    // the API key opens no admin endpoint, and the admin key no generation
    assert_eq!(post_key(s.port, "/v1/pause", json!({})).0, 401);
    assert_eq!(post_admin(s.port, "/v1/chat/completions", request(0)).0, 401);
    assert_eq!(post_admin(s.port, "/v1/resume", json!({})).0, 200);
    let (status, v) = post_key(s.port, "/v1/chat/completions", request(0));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["weights_version"].as_u64(), v["system_fingerprint"].as_str()),
        (Some(0), Some("kvdecode-weights-v0"))
    );
    // without --admin-key there are no admin endpoints, and the key comes from the environment too
    let open = start(&["--api-key", KEY]);
    assert_eq!(http_with(open.port, "POST", "/v1/pause", "{}", &auth(KEY)).0, 404);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvdecode"));
    child.env("KVDECODE_API_KEY", KEY);
    let env_server = start_command(child, MODEL, &[]);
    assert_eq!(http(env_server.port, "GET", "/v1/models", "").0, 401);
    assert_eq!(http_with(env_server.port, "GET", "/v1/models", "", &auth(KEY)).0, 200);
}

/// A gauge or counter of `/metrics`.
fn metric(port: u16, name: &str) -> u64 {
    let (_, _, m) = http_with(port, "GET", "/metrics", "", &auth(KEY));
    m.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap().parse().unwrap()
}

/// Poll `/metrics` until `ok` holds (the server's state, not a sleep, orders the test's steps).
fn until(port: u16, what: &str, ok: impl Fn(&dyn Fn(&str) -> u64) -> bool) {
    let t0 = std::time::Instant::now();
    while !ok(&|name: &str| metric(port, name)) {
        assert!(t0.elapsed() < Duration::from_secs(60), "the server never got to: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_update_while_sixteen_requests_run_gives_each_response_one_version() {
    let dir = WeightsDir::new("serve-admin");
    let new = other_weights(&dir.0, 77);
    let s = start(&["--api-key", KEY, "--admin-key", ADMIN, "--weights-dir", dir.arg(), "--rows", "4"]);
    let port = s.port;
    let (tx, rx) = mpsc::channel();
    let send = |i: usize, tx: mpsc::Sender<(usize, Value)>| {
        std::thread::spawn(move || {
            let (status, v) = post_key(port, "/v1/chat/completions", request(i));
            assert_eq!(status, 200, "{v}");
            tx.send((i, v)).unwrap();
        })
    };
    // 16 requests in flight (held by a pause so none can finish early), then an update with mode
    // wait (the default), then 8 more while it waits
    post_admin(port, "/v1/pause", json!({}));
    let mut threads: Vec<_> = (0..16).map(|i| send(i, tx.clone())).collect();
    let in_server = |m: &dyn Fn(&str) -> u64| m("kvdecode_queue_depth") + m("kvdecode_rows_in_use");
    until(port, "16 requests in flight", |m| in_server(m) == 16);
    let update = std::thread::spawn(move || post_admin(port, "/v1/weights", json!({"path": new})));
    until(port, "the update waiting", |m| m("kvdecode_update_waiting") == 1);
    threads.extend((16..24).map(|i| send(i, tx.clone())));
    until(port, "8 more queued", |m| in_server(m) == 24);
    post_admin(port, "/v1/resume", json!({}));
    let (status, v) = update.join().unwrap();
    assert_eq!((status, v["weights_version"].as_u64()), (200, Some(1)), "{v}");
    for t in threads {
        t.join().unwrap();
    }
    drop(tx);
    let mut got: Vec<(usize, Value)> = rx.iter().collect();
    got.sort_by_key(|g| g.0);
    let version = |v: &Value| {
        assert!(v.get("weights_versions").is_none(), "one version per response: {v}");
        v["weights_version"].as_u64().unwrap()
    };
    let versions: Vec<u64> = got.iter().map(|(_, v)| version(v)).collect();
    assert_eq!(versions, [[0; 16].as_slice(), &[1; 8]].concat(), "the 16 in flight finish on the old weights");
    // each equals the same request alone on its version's weights: first the new ones (the
    // server holds them now), then the old ones (loaded back as version 2)
    for (want_version, path) in [(1, None), (0, Some("model.gguf"))] {
        if let Some(p) = path {
            let (status, v) = post_admin(port, "/v1/weights", json!({"path": p}));
            assert_eq!((status, v["weights_version"].as_u64()), (200, Some(2)), "{v}");
        }
        for (i, v) in got.iter().filter(|(_, v)| version(v) == want_version) {
            let (_, alone) = post_key(port, "/v1/chat/completions", request(*i));
            assert_eq!(text(&alone, 0), text(v, 0), "request {i} on version {want_version}'s weights");
        }
    }
}

#[test]
fn pause_resume_keep_abort_and_the_prompt_cache_reset() {
    let dir = WeightsDir::new("serve-pause");
    let new = other_weights(&dir.0, 78);
    let s = start(&[
        "--api-key",
        KEY,
        "--admin-key",
        ADMIN,
        "--weights-dir",
        dir.arg(),
        "--rows",
        "2",
        "--max-len",
        "1024",
    ]);
    let port = s.port;
    // paused, a request waits; resumed, it answers
    assert_eq!(post_admin(port, "/v1/pause", json!({})).1["paused"], true);
    let (tx, rx) = mpsc::channel();
    let waiting = std::thread::spawn(move || tx.send(post_key(port, "/v1/chat/completions", request(1))).unwrap());
    until(port, "the request in", |m| m("kvdecode_queue_depth") + m("kvdecode_rows_in_use") == 1);
    std::thread::sleep(Duration::from_millis(100));
    assert!(rx.try_recv().is_err(), "a paused server answered");
    assert_eq!(post_admin(port, "/v1/resume", json!({})).1["paused"], false);
    waiting.join().unwrap();
    assert_eq!(rx.recv().unwrap().0, 200);
    // keep: a streamed answer in flight across the update goes on, its later chunks say version 1
    let long = json!({"model": "m", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 600,
                      "temperature": 0, "stream": true, "logit_bias": {"0": -100, "1": -100}});
    let streamed =
        std::thread::spawn(move || http_with(port, "POST", "/v1/chat/completions", &long.to_string(), &auth(KEY)));
    let done = metric(port, "kvdecode_completion_tokens_total");
    until(port, "some tokens of the long answer", |m| m("kvdecode_completion_tokens_total") >= done + 5);
    post_admin(port, "/v1/pause", json!({}));
    let (status, v) = post_admin(port, "/v1/weights", json!({"path": new, "mode": "keep"}));
    assert_eq!((status, v["weights_version"].as_u64()), (200, Some(1)), "{v}");
    post_admin(port, "/v1/resume", json!({}));
    let (status, _, body) = streamed.join().unwrap();
    assert_eq!(status, 200);
    let chunks: Vec<Value> =
        sse(&body).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let first = chunks.iter().find_map(|c| c["weights_version"].as_u64()).unwrap();
    let last = chunks.last().unwrap();
    assert_eq!(first, 0);
    assert_eq!(last["weights_versions"], json!([0, 1]), "{last}");
    // abort: the answer in flight ends now, with finish reason `abort`
    let long = json!({"model": "m", "prompt": "count", "max_tokens": 900, "temperature": 0,
                      "logit_bias": {"0": -100, "1": -100}});
    let aborted = std::thread::spawn(move || post_key(port, "/v1/completions", long));
    let done = metric(port, "kvdecode_completion_tokens_total");
    until(port, "some tokens of the long answer", |m| m("kvdecode_completion_tokens_total") >= done + 5);
    let (status, v) = post_admin(port, "/v1/weights", json!({"path": "model.gguf", "mode": "abort"}));
    assert_eq!((status, v["weights_version"].as_u64()), (200, Some(2)), "{v}");
    let (status, v) = aborted.join().unwrap();
    assert_eq!((status, v["choices"][0]["finish_reason"].as_str()), (200, Some("abort")), "{v}");
    // the prompt cache: a repeated prompt is cached, a reset forgets it
    for _ in 0..2 {
        post_key(port, "/v1/chat/completions", request(5));
    }
    assert!(metric(port, "kvdecode_kv_blocks_cached") > 0);
    assert_eq!(post_admin(port, "/v1/reset_prefix_cache", json!({})).1["reset"], true);
    assert_eq!(metric(port, "kvdecode_kv_blocks_cached"), 0);
    assert_eq!(metric(port, "kvdecode_weights_version"), 2);
    // bad admin requests are named
    let (status, v) = post_admin(port, "/v1/weights", json!({"path": "no-such-file.safetensors"}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("no-such-file"), "{v}");
    let (status, v) = post_admin(port, "/v1/weights", json!({"path": "model.gguf", "mode": "later"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("mode")), "{v}");
}

/// `POST /v1/weights` reads only regular files inside `--weights-dir`, within
/// `--max-weights-bytes`: a path outside it, a symlink out of it (to `/dev/zero`, which would
/// exhaust memory), a FIFO (which would stall the reader for good) and a file that does not exist
/// all get one answer, which tells nothing about what exists. Without `--weights-dir` no file is
/// read; the admin key may not be the API key.
#[test]
fn weights_come_only_from_the_weights_dir() {
    let dir = WeightsDir::new("serve-weights-dir");
    let size = std::fs::metadata(MODEL).unwrap().len();
    std::os::unix::fs::symlink("/dev/zero", dir.0.join("zero.gguf")).unwrap();
    std::os::unix::fs::symlink(MODEL, dir.0.join("outside.gguf")).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(dir.0.join("fifo.gguf")).status().unwrap().success());
    let big = dir.0.join("big");
    std::fs::create_dir(&big).unwrap();
    std::fs::write(big.join("a.safetensors"), vec![0u8; size as usize + 1]).unwrap();
    let max = size.to_string();
    let s = start(&["--admin-key", ADMIN, "--weights-dir", dir.arg(), "--max-weights-bytes", &max]);
    let refused = |path: &str| {
        let (status, v) = post_admin(s.port, "/v1/weights", json!({"path": path}));
        assert_eq!(status, 400, "{path}: {v}");
        let msg = v["error"]["message"].as_str().unwrap().to_string();
        msg.replace(path, "PATH")
    };
    let want = refused("no-such-file.gguf");
    assert!(want.contains("is not a weights file or Hugging Face folder inside --weights-dir"), "{want}");
    for path in ["/etc/passwd", "../../etc/passwd", "zero.gguf", "outside.gguf", "fifo.gguf", "/dev/zero", MODEL] {
        assert_eq!(refused(path), want, "{path}");
    }
    assert!(refused("big").contains(&format!("more than --max-weights-bytes {size}")));
    // what is inside is read, and the server serves on
    let (status, v) = post_admin(s.port, "/v1/weights", json!({"path": "model.gguf"}));
    assert_eq!((status, v["weights_version"].as_u64()), (200, Some(1)), "{v}");
    chat(s.port, json!({"max_tokens": 2}));
    // no --weights-dir: nothing is read
    let none = start(&["--admin-key", ADMIN]);
    let (status, v) = post_admin(none.port, "/v1/weights", json!({"path": MODEL}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("start it with --weights-dir"), "{v}");
    // one key for both is refused at start
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["serve", "--model", MODEL, "--port", "0", "--api-key", KEY, "--admin-key", KEY])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--admin-key must differ from --api-key"));
}

/// One POST with a binary body and the header lines given; (status, JSON body).
fn post_bytes(port: u16, path: &str, headers: &str, body: &[u8]) -> (u16, Value) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\n{}{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        auth(ADMIN),
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.into() };
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

/// Weights pushed in the request body (no shared disk): checked against their SHA-256 before
/// anything changes, bounded by --max-weights-bytes, and then the same as the file loaded by path.
#[test]
fn weights_in_the_body_are_checked_by_their_digest() {
    use sha2::{Digest, Sha256};
    let dir = WeightsDir::new("serve-body");
    let path = other_weights(&dir.0, 79);
    let bytes = std::fs::read(&path).unwrap();
    let digest: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    let max = (bytes.len() + 8).to_string();
    let s = start(&["--admin-key", ADMIN, "--weights-dir", dir.arg(), "--max-weights-bytes", &max]);
    let octet = "Content-Type: application/octet-stream\r\n";
    let answer = || text(&chat(s.port, json!({"temperature": 0, "max_tokens": 8})), 0);
    let before = answer();
    // a wrong digest, or none: refused, nothing changed
    let wrong = format!("{octet}X-Weights-SHA256: {}\r\n", "0".repeat(64));
    let (status, v) = post_bytes(s.port, "/v1/weights", &wrong, &bytes);
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("not the X-Weights-SHA256 given"), "{v}");
    let (status, v) = post_bytes(s.port, "/v1/weights", octet, &bytes);
    assert!(status == 400 && v["error"]["message"].as_str().unwrap().contains("X-Weights-SHA256"), "{v}");
    assert_eq!(answer(), before, "a refused body changed the model");
    // the right one: version 1, and the same answers as the same file loaded by path
    let right = format!("{octet}X-Weights-SHA256: {digest}\r\n");
    let (status, v) = post_bytes(s.port, "/v1/weights?mode=keep", &right, &bytes);
    assert_eq!((status, v["weights_version"].as_u64()), (200, Some(1)), "{v}");
    let pushed = answer();
    assert_ne!(pushed, before);
    let (status, v) = post_admin(s.port, "/v1/weights", json!({"path": path}));
    assert_eq!((status, v["weights_version"].as_u64()), (200, Some(2)), "{v}");
    assert_eq!(answer(), pushed);
    // larger than --max-weights-bytes
    let mut big = bytes.clone();
    big.extend_from_slice(&[0; 16]);
    let digest_big: String = Sha256::digest(&big).iter().map(|b| format!("{b:02x}")).collect();
    let (status, v) = post_bytes(s.port, "/v1/weights", &format!("{octet}X-Weights-SHA256: {digest_big}\r\n"), &big);
    assert_eq!(status, 413, "{v}");
}

/// A PEFT adapter folder for the test model: rank 4 on every projection, seeded values; returns
/// its path.
fn adapter_dir(dir: &std::path::Path, name: &str, seed: u64) -> String {
    let cfg = kvdecode::io::gguf::GgufFile::open(MODEL).unwrap().weights().unwrap().cfg;
    let adapter = kvdecode::LoraAdapter::random(&cfg, 4, 0.3, 2.0, seed);
    let (mut header, mut data) = (serde_json::Map::new(), Vec::<u8>::new());
    for t in adapter.peft_tensors() {
        let offsets = [data.len(), data.len() + t.bytes.len()];
        header.insert(t.name, json!({"dtype": "F32", "shape": t.shape, "data_offsets": offsets}));
        data.extend_from_slice(t.bytes);
    }
    let path = dir.join(name);
    std::fs::create_dir_all(&path).unwrap();
    let header = serde_json::to_vec(&Value::Object(header)).unwrap();
    let file = [&(header.len() as u64).to_le_bytes()[..], &header, &data].concat();
    std::fs::write(path.join("adapter_model.safetensors"), file).unwrap();
    // lora_alpha 8 over rank 4: the scale of 2 the values were drawn with
    let config = json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8});
    std::fs::write(path.join("adapter_config.json"), config.to_string()).unwrap();
    path.to_string_lossy().into_owned()
}

/// LoRA on the server, as vLLM serves it: `--lora NAME=PATH` at start, `"model": NAME` picks the
/// adapter (an unknown name is a 404), /v1/models lists the adapters, the admin key loads and
/// unloads them while the server runs (folders under --weights-dir only), 8 concurrent requests
/// over the base model and two adapters each get their alone answer, and a response on an
/// adapter says its version.
#[test]
fn adapters_are_picked_by_model_name_and_loaded_while_serving() {
    let wd = WeightsDir::new("lora");
    let a = adapter_dir(&wd.0, "a", 1);
    let b = adapter_dir(&wd.0, "b", 2);
    let lora_a = format!("a={a}");
    let s = start(&["--lora", &lora_a, "--max-loras", "3", "--admin-key", ADMIN, "--weights-dir", wd.arg()]);
    let ids = |port| {
        let (_, _, body) = http(port, "GET", "/v1/models", "");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    let served = ids(s.port);
    assert_eq!(served[1..], ["a"]);
    let ask = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hello there"}],
                          "max_tokens": 8, "temperature": 0, "logprobs": true});
        let (status, v) = post(s.port, "/v1/chat/completions", body);
        assert_eq!(status, 200, "{model}: {v}");
        let on_adapter = ["a", "b"].contains(&model);
        assert_eq!(v["adapter_version"].as_u64(), on_adapter.then_some(0), "{model}: {v}");
        let lp: Vec<f64> = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        (v["model"].as_str().unwrap().to_string(), text(&v, 0), lp)
    };
    let base = ask(&served[0]);
    let with_a = ask("a");
    assert_eq!(with_a.0, "a", "the response names the adapter");
    assert_ne!(base.2, with_a.2, "the adapter changes the logprobs");
    let (status, v) =
        post(s.port, "/v1/chat/completions", json!({"model": "zzz", "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!((status, v["error"]["param"].as_str()), (404, Some("model")), "{v}");
    // load b while serving; outside the weights folder is refused
    let (status, v) = post_admin(s.port, "/v1/load_lora_adapter", json!({"lora_name": "b", "lora_path": "/etc"}));
    assert_eq!(status, 400, "{v}");
    let (status, v) = post_key(s.port, "/v1/load_lora_adapter", json!({"lora_name": "b", "lora_path": b}));
    assert_eq!(status, 401, "the API key is not the admin key: {v}");
    let (status, v) = post_admin(s.port, "/v1/load_lora_adapter", json!({"lora_name": "b", "lora_path": b}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(s.port)[1..], ["a", "b"]);
    let with_b = ask("b");
    assert_ne!(with_b.2, with_a.2);
    // 8 at once over three models: each its alone answer
    let models = [&served[0], "a", "b", "a", &served[0], "b", "b", "a"];
    let got: Vec<_> = std::thread::scope(|sc| {
        let handles: Vec<_> = models.iter().map(|m| sc.spawn(move || ask(m))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (m, g) in models.iter().zip(&got) {
        let alone = match *m {
            "a" => &with_a,
            "b" => &with_b,
            _ => &base,
        };
        assert_eq!((&g.1, &g.2), (&alone.1, &alone.2), "{m}: its answer depends on the other requests");
    }
    let (status, v) = post_admin(s.port, "/v1/unload_lora_adapter", json!({"lora_name": "a"}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(s.port)[1..], ["b"]);
    let (status, _) =
        post(s.port, "/v1/chat/completions", json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(status, 404, "an unloaded adapter is gone");
}

/// `--lora-dtype f16` holds the adapters as halves (the engine's `lora_dtype`): an adapter's
/// answer moves from its f32 answer by the rounding of its values, the base model's answer is the
/// same bits, and a type the engine does not hold adapters in is refused at start by the flag's
/// name. The only test of the flag; the f16 slots themselves are held to the CPU reference in
/// tests/lora.rs.
#[test]
fn lora_dtype_f16_holds_the_adapters_as_halves() {
    let wd = WeightsDir::new("lora-dtype");
    let lora_a = format!("a={}", adapter_dir(&wd.0, "a", 1));
    let answers = |dtype: &str| {
        let s = start(&["--lora", &lora_a, "--lora-dtype", dtype]);
        let (_, _, body) = http(s.port, "GET", "/v1/models", "");
        let models: Value = serde_json::from_str(&body).unwrap();
        let base = models["data"][0]["id"].as_str().unwrap().to_string();
        [base, "a".to_string()].map(|model| {
            let body = json!({"model": model, "messages": [{"role": "user", "content": "hello there"}],
                              "max_tokens": 8, "temperature": 0, "logprobs": true});
            let (status, v) = post(s.port, "/v1/chat/completions", body);
            assert_eq!(status, 200, "{dtype} {model}: {v}");
            let tokens = v["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
            tokens.iter().map(|t| t["logprob"].as_f64().unwrap()).collect::<Vec<f64>>()
        })
    };
    let [base32, a32] = answers("f32");
    let [base16, a16] = answers("f16");
    assert_eq!(base16, base32, "the base model does not depend on how adapters are held");
    assert_ne!(a16, a32, "f16 adapters are the f32 ones rounded");
    let moved = a16.iter().zip(&a32).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    println!("f16 adapter logprobs within {moved:.2e} of f32's");
    assert!(moved < 1e-2, "the rounding moved a logprob by {moved}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["serve", "--model", MODEL, "--port", "0", "--lora-dtype", "bf16"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--lora-dtype"), "{stderr}");
}
