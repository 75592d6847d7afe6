//! `kvdecode serve` against clients that hold connections: headers that trickle in a byte a
//! second, a connection that sends nothing, a body that never completes. Each is cut at its
//! deadline (`--header-timeout`, `--body-timeout`), and the server serves on.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::server::*;
use serde_json::json;

/// Read until the server closes the connection (or `limit` passes); what it sent, and when.
fn until_closed(s: &mut TcpStream, limit: Duration) -> (String, Duration) {
    let t0 = Instant::now();
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), t0.elapsed())
}

#[test]
fn slow_and_silent_clients_are_cut_at_their_deadlines() {
    let s = start(&["--header-timeout", "1", "--body-timeout", "1"]);
    let limit = Duration::from_secs(20);
    // headers a byte at a time, slower than the deadline allows
    let mut trickle = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n";
    let t0 = Instant::now();
    for b in head {
        if trickle.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(150));
        if t0.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    let (_, _) = until_closed(&mut trickle, limit);
    assert!(t0.elapsed() < Duration::from_secs(10), "a trickle of headers held the connection {:?}", t0.elapsed());
    // a connection that sends nothing
    let mut silent = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    silent.write_all(b"G").unwrap();
    let (_, took) = until_closed(&mut silent, limit);
    assert!(took < Duration::from_secs(10), "a silent connection was held {took:?}");
    // a body that never completes: 408
    let mut body = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    write!(body, "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"mess").unwrap();
    let (answer, took) = until_closed(&mut body, limit);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1 s") && took < Duration::from_secs(10), "{answer} after {took:?}");
    // and the server answers as before
    let v = chat(s.port, json!({"max_tokens": 2}));
    assert_eq!(v["object"], "chat.completion");
}

/// The engine thread's death (here a lost device, as a driver reset makes it) turns `/health` to
/// 503 with the reason, the request in flight gets the error, and so does every later one.
#[test]
fn a_lost_device_turns_health_to_503_and_requests_get_the_error() {
    let s = start(&["--lose-device-after", "2"]);
    let (status, _, body) = http(s.port, "GET", "/health", "");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    let ask = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8});
    let (status, v) = post(s.port, "/v1/chat/completions", ask.clone());
    assert_eq!(status, 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("the engine failed") && msg.contains("lost"), "{msg}");
    let (status, _, body) = http(s.port, "GET", "/health", "");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("lost"), "/health names the loss: {body}");
    let (status, v) = post(s.port, "/v1/chat/completions", ask);
    assert_eq!(status, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("lost"), "{v}");
}
