#![no_main]
//! Any bytes as an HTTP request to a running `kvdecode serve` router (the tiny tools model of the
//! seeds, its engine thread started once): the first byte picks the method and path, the second
//! the headers (content type, origin, host, an API key), the rest is the body. Whatever it is, the
//! server answers, and never with a 5xx: bad requests are 4xx that name the problem, and valid
//! ones generate (at most 8 tokens, so a run stays fast). Seeds: fuzz/seeds/server (the
//! openai_request seeds behind each path).
use std::sync::OnceLock;

use axum::body::Body;
use axum::http::Request;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const PATHS: &[(&str, &str)] = &[
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/weights"),
    ("POST", "/v1/load_lora_adapter"),
    ("GET", "/nothing/here"),
];

struct Server {
    router: axum::Router,
    rt: tokio::runtime::Runtime,
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/seeds/gguf/llama-f32-tools.gguf");
        // no admin key: the admin routes are not served (a fuzzed pause would stall every run)
        let flags = ["serve", "--model", model, "--rows", "2", "--max-len", "256", "--max-tokens", "8"];
        let args = kvdecode_cli::serve::args_from(&flags).expect("the fuzz server's flags");
        let (router, ..) = kvdecode_cli::serve::router(&args).expect("the fuzz server");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        Server { router, rt }
    })
}

fuzz_target!(|data: &[u8]| {
    let s = server();
    let (pick, rest) = data.split_first().unwrap_or((&0, &[]));
    let (flags, body) = rest.split_first().unwrap_or((&0, &[]));
    let (method, path) = PATHS[*pick as usize % PATHS.len()];
    let mut req = Request::builder().method(method).uri(path);
    req = req.header("host", if flags & 1 == 0 { "127.0.0.1" } else { "evil.example" });
    if flags & 2 == 0 {
        req = req.header("content-type", "application/json");
    }
    if flags & 4 != 0 {
        req = req.header("origin", "http://elsewhere.example");
    }
    if flags & 8 != 0 {
        req = req.header("authorization", "Bearer not-a-key");
    }
    let req = req.body(Body::from(body.to_vec())).expect("a request");
    let (status, answer) = s.rt.block_on(async {
        let res = s.router.clone().oneshot(req).await.expect("the router answers");
        let status = res.status();
        // a stream is read to its end, as a client would
        let answer = axum::body::to_bytes(res.into_body(), 1 << 24).await.unwrap_or_default();
        (status, answer)
    });
    let answer = String::from_utf8_lossy(&answer);
    assert!(!status.is_server_error(), "{method} {path}: {status}: {answer}");
});
