//! `kvdecode serve` over plain sockets: start the command on a free port, send HTTP/1.1
//! requests, read JSON and server-sent events.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

pub const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/gguf/llama-f32-chatml.gguf");
/// The tiny model whose ChatML template takes tools (Hermes-style `<tool_call>` blocks).
pub const TOOLS_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/gguf/llama-f32-tools.gguf");

pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start(extra: &[&str]) -> Server {
    start_with(MODEL, extra)
}

pub fn start_model(model: &str) -> Server {
    start_with(model, &[])
}

pub fn start_with(model: &str, extra: &[&str]) -> Server {
    start_command(Command::new(env!("CARGO_BIN_EXE_kvdecode")), model, extra)
}

/// `kvdecode serve` from a prepared command (its environment, say).
pub fn start_command(mut command: Command, model: &str, extra: &[&str]) -> Server {
    let mut child = command
        .args(["serve", "--model", model, "--port", "0"])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvdecode serve");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let port = loop {
        let line = lines.next().expect("the server printed its address").expect("stderr line");
        if let Some(rest) = line.split("http://127.0.0.1:").nth(1) {
            break rest.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
        }
    };
    // keep draining stderr so the server never blocks on it
    std::thread::spawn(move || for _ in lines {});
    Server { child, port }
}

/// One HTTP/1.1 request; returns (status, headers, body).
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String, String) {
    http_with(port, method, path, body, "")
}

/// [`http`] with extra header lines (each ending in `\r\n`).
pub fn http_with(port: u16, method: &str, path: &str, body: &str, headers: &str) -> (u16, String, String) {
    http_raw(port, method, path, body, &format!("Host: localhost\r\nContent-Type: application/json\r\n{headers}"))
}

/// One request with exactly the header lines given (Host and Content-Type included, or not).
pub fn http_raw(port: u16, method: &str, path: &str, body: &str, headers: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
        .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a full response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    (status, head.to_string(), body)
}

pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

pub fn post(port: u16, path: &str, body: Value) -> (u16, Value) {
    let (status, _, body) = http(port, "POST", path, &body.to_string());
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

pub fn chat(port: u16, extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = post(port, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

pub fn text(v: &Value, i: usize) -> String {
    let c = &v["choices"][i];
    c["message"]["content"].as_str().or(c["text"].as_str()).unwrap().to_string()
}

/// The `data:` payloads of a server-sent event stream.
pub fn sse(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}
