//! `kvdecode bench-serve`: a load test against a running `kvdecode serve` that checks every answer.
//!
//! First each distinct request runs alone, one at a time: those answers are the expectation.
//! Then `--requests` requests go out over `--concurrency` connections, mixed: non-streaming,
//! streaming, streaming cancelled after the first token, and malformed. Every greedy or seeded
//! answer must equal its answer alone (nothing lost, nothing mixed between requests), malformed
//! ones must get a 400 and nothing may get a 5xx. Prints throughput and p50 / p99 time to first
//! token and per-token latency (from the streams), and the server's RSS before and after when
//! `--server-pid` is given. Beside the load, optionally: clients that send their headers a byte
//! a second (`--slow-clients`), requests with a 4 KiB stop string (`--long-stops`), and a weights
//! push halfway (`--push-weights`: the served file again, so the answers stay the same). Exits
//! non-zero if any check fails, or the RSS grew by more than `--max-rss-growth-mib`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::Result;

#[derive(clap::Args)]
pub struct Args {
    /// The server, e.g. http://127.0.0.1:8080
    #[arg(long)]
    url: String,
    /// Requests in the concurrent phase.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Connections at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Distinct requests (prompts x sampling) the load is drawn from.
    #[arg(long, default_value_t = 16)]
    distinct: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// The server's process id, to report its resident memory before and after.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Print one JSON object of the figures at the end.
    #[arg(long)]
    json: bool,
    /// Connections that send a request's headers a byte a second, over and over, while the load
    /// runs (the server cuts each at its header deadline).
    #[arg(long, default_value_t = 0)]
    slow_clients: usize,
    /// The first N requests of the load carry a 4 KiB stop string (one that never matches, so
    /// their answers are still the ones alone).
    #[arg(long, default_value_t = 0)]
    long_stops: usize,
    /// Halfway through the load, push this weights file again (`POST /v1/weights`, a path under
    /// the server's --weights-dir), with `--admin-key`.
    #[arg(long)]
    push_weights: Option<String>,
    /// The server's admin key, for `--push-weights`.
    #[arg(long)]
    admin_key: Option<String>,
    /// Fail when the server's RSS grew by more than this over the load (with --server-pid).
    #[arg(long)]
    max_rss_growth_mib: Option<f64>,
}

const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "List two prime numbers.",
    "What does a cat say?",
    "Describe the sky in five words.",
];

fn distinct_request(i: usize, max_tokens: usize) -> Value {
    let p = PROMPTS[i % PROMPTS.len()];
    // half greedy, half seeded sampling: both must be reproducible
    let sampling = if (i / PROMPTS.len()).is_multiple_of(2) {
        json!({"temperature": 0})
    } else {
        json!({"temperature": 0.8, "seed": i})
    };
    let mut v = json!({"model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens});
    for (k, x) in sampling.as_object().expect("object") {
        v[k] = x.clone();
    }
    v
}

struct Reply {
    status: u16,
    text: String,
    /// Seconds from sending to the first content, and between later contents (streams only).
    ttft: Option<f64>,
    gaps: Vec<f64>,
}

async fn request(addr: &str, body: &str, stream: bool, cancel_after_first: bool) -> std::io::Result<Reply> {
    raw_request(addr, "/v1/chat/completions", "", body, stream, cancel_after_first).await
}

/// A 4 KiB stop string no 16-token answer holds.
fn long_stop(k: usize) -> String {
    (0..4096).map(|i| char::from(b'a' + ((i * 7 + k * 13) % 26) as u8)).collect()
}

/// A client that sends a request's headers a byte a second until the server cuts it, then again,
/// until `done`; returns how many times it was cut.
async fn slow_client(addr: String, done: Arc<std::sync::atomic::AtomicBool>) -> usize {
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n";
    let mut cut = 0;
    while !done.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(&addr).await else { break };
        for b in head.iter().cycle() {
            if done.load(Ordering::Relaxed) || s.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        cut += usize::from(!done.load(Ordering::Relaxed));
    }
    cut
}

async fn raw_request(
    addr: &str,
    path: &str,
    headers: &str,
    body: &str,
    stream: bool,
    cancel_after_first: bool,
) -> std::io::Result<Reply> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let t0 = Instant::now();
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 16384];
    let (mut ttft, mut gaps, mut last) = (None, Vec::new(), None::<Instant>);
    let mut seen = 0;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if stream {
            // count content deltas as they arrive (a delta never spans two reads in practice;
            // timing only needs arrival times)
            let text = String::from_utf8_lossy(&raw);
            let contents = text.matches("\"content\":\"").count();
            if contents > seen {
                let now = Instant::now();
                if ttft.is_none() && contents > 1 {
                    ttft = Some((now - t0).as_secs_f64());
                } else if let Some(l) = last {
                    gaps.push((now - l).as_secs_f64());
                }
                last = Some(now);
                seen = contents;
                if cancel_after_first && contents > 1 {
                    return Ok(Reply { status: 200, text: String::new(), ttft, gaps });
                }
            }
        }
    }
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    let text = if stream {
        body.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
            .collect()
    } else {
        serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["choices"][0]["message"]["content"].as_str().map(str::to_string))
            .unwrap_or(body)
    };
    Ok(Reply { status, text, ttft, gaps })
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest.get(n + 2..).unwrap_or("");
    }
    out
}

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(a: Args) -> Result<()> {
    let addr = a.url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        // 1. every distinct request alone: the expected answers
        let mut expected = Vec::new();
        for i in 0..a.distinct {
            let r = request(&addr, &distinct_request(i, a.max_tokens).to_string(), false, false).await?;
            if r.status != 200 {
                return Err(format!("request {i} alone: status {}", r.status).into());
            }
            expected.push(r.text);
        }
        let rss0 = a.server_pid.and_then(rss_kib);
        eprintln!("{} distinct requests answered alone; now {} requests over {} connections", a.distinct, a.requests, a.concurrency);
        // 2. the mixed load
        let next = Arc::new(AtomicUsize::new(0));
        let expected = Arc::new(expected);
        let results = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(Mutex::new(Vec::<String>::new()));
        let t0 = Instant::now();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let slow: Vec<_> = (0..a.slow_clients).map(|_| tokio::spawn(slow_client(addr.clone(), done.clone()))).collect();
        // the weights push, once half the load has started
        let push = a.push_weights.clone().map(|path| {
            let (next, addr, key, half) = (next.clone(), addr.clone(), a.admin_key.clone().unwrap_or_default(), a.requests / 2);
            tokio::spawn(async move {
                while next.load(Ordering::Relaxed) < half {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let body = json!({"path": path}).to_string();
                let auth = format!("Authorization: Bearer {key}\r\n");
                raw_request(&addr, "/v1/weights", &auth, &body, false, false).await
            })
        });
        let mut tasks = Vec::new();
        for _ in 0..a.concurrency {
            let (next, expected, results, failures, addr) =
                (next.clone(), expected.clone(), results.clone(), failures.clone(), addr.clone());
            let (n, distinct, max_tokens, long_stops) = (a.requests, a.distinct, a.max_tokens, a.long_stops);
            tasks.push(tokio::spawn(async move {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= n {
                        break;
                    }
                    let i = k % distinct;
                    let kind = k % 10;
                    let mut body = distinct_request(i, max_tokens);
                    let (stream, cancel) = match kind {
                        0..=4 => (false, false),
                        5..=7 => (true, false),
                        8 => (true, true),
                        _ => {
                            body["temperature"] = json!("hot");
                            (false, false)
                        }
                    };
                    if stream {
                        body["stream"] = json!(true);
                    }
                    if k < long_stops {
                        body["stop"] = json!([long_stop(k)]);
                    }
                    let r = match request(&addr, &body.to_string(), stream, cancel).await {
                        Ok(r) => r,
                        Err(e) => {
                            failures.lock().unwrap().push(format!("request {k}: {e}"));
                            continue;
                        }
                    };
                    let bad = match kind {
                        9 => (r.status != 400).then(|| format!("request {k} (malformed): status {}", r.status)),
                        8 => (r.status != 200).then(|| format!("request {k} (cancelled): status {}", r.status)),
                        _ if r.status != 200 => Some(format!("request {k}: status {}", r.status)),
                        _ if r.text != expected[i] => {
                            Some(format!("request {k}: {:?} differs from the same request alone {:?}", r.text, expected[i]))
                        }
                        _ => None,
                    };
                    if let Some(b) = bad {
                        failures.lock().unwrap().push(b);
                    }
                    results.lock().unwrap().push((kind, r));
                }
            }));
        }
        for t in tasks {
            t.await?;
        }
        let secs = t0.elapsed().as_secs_f64();
        done.store(true, Ordering::Relaxed);
        let mut slow_cut = 0;
        for t in slow {
            slow_cut += t.await?;
        }
        let pushed = match push {
            Some(t) => Some(t.await?.map_err(|e| format!("the weights push: {e}"))?),
            None => None,
        };
        // let the server settle, then its memory
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rss1 = a.server_pid.and_then(rss_kib);
        let results = results.lock().unwrap();
        let failures = failures.lock().unwrap();
        let answered = results.iter().filter(|(k, r)| *k < 8 && r.status == 200).count();
        let tokens: usize = results.iter().filter(|(k, _)| *k < 8).map(|(_, r)| r.gaps.len() + 1).sum();
        let mut ttft: Vec<f64> = results.iter().filter_map(|(_, r)| r.ttft).collect();
        let mut gaps: Vec<f64> = results.iter().filter(|(k, _)| *k < 8).flat_map(|(_, r)| r.gaps.clone()).collect();
        let fivexx = results.iter().filter(|(_, r)| r.status >= 500).count();
        let lost = a.requests - results.len();
        println!("| requests | concurrency | seconds | answered | requests/s | p50 TTFT ms | p99 TTFT ms | p50 per-token ms | p99 per-token ms | 5xx | lost | mismatched |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let (p50t, p99t, p50g, p99g) = (pct(&mut ttft, 0.5) * 1e3, pct(&mut ttft, 0.99) * 1e3, pct(&mut gaps, 0.5) * 1e3, pct(&mut gaps, 0.99) * 1e3);
        let mismatched = failures.iter().filter(|f| f.contains("differs")).count();
        println!(
            "| {} | {} | {secs:.1} | {answered} | {:.2} | {p50t:.0} | {p99t:.0} | {p50g:.0} | {p99g:.0} | {fivexx} | {lost} | {mismatched} |",
            a.requests,
            a.concurrency,
            results.len() as f64 / secs
        );
        if let (Some(r0), Some(r1)) = (rss0, rss1) {
            println!("server RSS: {:.1} MiB before the load, {:.1} MiB after", r0 as f64 / 1024.0, r1 as f64 / 1024.0);
        }
        let growth = rss0.zip(rss1).map(|(r0, r1)| (r1 as f64 - r0 as f64) / 1024.0);
        let mut extra = Vec::new();
        if a.slow_clients > 0 {
            println!("{} slow clients, cut {slow_cut} times at the header deadline", a.slow_clients);
        }
        if a.long_stops > 0 {
            println!("{} requests carried a 4 KiB stop string", a.long_stops.min(a.requests));
        }
        if let Some(p) = &pushed {
            println!("weights pushed halfway: status {} {}", p.status, p.text.trim());
            if p.status != 200 {
                extra.push(format!("the weights push: status {}: {}", p.status, p.text));
            }
        }
        if let (Some(max), Some(g)) = (a.max_rss_growth_mib, growth) {
            if g > max {
                extra.push(format!("the server's RSS grew by {g:.1} MiB, more than {max} MiB"));
            }
        }
        if a.json {
            println!(
                "{}",
                json!({"requests": a.requests, "concurrency": a.concurrency, "seconds": secs, "answered": answered,
                       "stream_tokens": tokens, "p50_ttft_ms": p50t, "p99_ttft_ms": p99t, "p50_token_ms": p50g,
                       "p99_token_ms": p99g, "server_5xx": fivexx, "lost": lost, "mismatched": mismatched,
                       "failures": failures.len(), "rss_kib_before": rss0, "rss_kib_after": rss1,
                       "slow_clients": a.slow_clients, "slow_cut": slow_cut, "long_stops": a.long_stops.min(a.requests),
                       "weights_push_status": pushed.as_ref().map(|p| p.status)})
            );
        }
        for f in failures.iter().chain(&extra).take(10) {
            eprintln!("FAILED: {f}");
        }
        if !failures.is_empty() || !extra.is_empty() || fivexx > 0 || lost > 0 {
            return Err(format!("{} checks failed", failures.len() + extra.len() + fivexx + lost).into());
        }
        Ok(())
    })
}
