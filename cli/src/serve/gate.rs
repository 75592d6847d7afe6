//! What a server on an open port refuses before any handler runs: browsers' requests from other
//! origins (unless `--allowed-origins` names them), bodies that are not JSON, Host names other
//! than loopback's where loopback without a key is all that guards the server (DNS rebinding),
//! and keys compared in a time that depends on them.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::api::ApiError;

/// The policy, fixed at start.
pub struct Gate {
    /// `--allowed-origins`: origins whose cross-origin requests are served (`*`: any).
    pub allowed_origins: Vec<String>,
    /// Bound to a loopback address without `--api-key`: only loopback Host names are answered.
    pub loopback_hosts_only: bool,
}

impl Gate {
    pub fn new(allowed_origins: Vec<String>, bind: &str, keyed: bool) -> Self {
        let loopback = bind == "localhost" || bind.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        Gate { allowed_origins, loopback_hosts_only: loopback && !keyed }
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        self.allowed_origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    }
}

/// The host name of a Host header, without its port (`[::1]:8080` -> `[::1]`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map_or(host, |(h, _)| &host[..h.len() + 1]);
    }
    host.rsplit_once(':').map_or(host, |(h, _)| h)
}

fn refuse(status: StatusCode, msg: String) -> Response {
    ApiError::new(status, msg).into_response()
}

/// The middleware: Host, Origin (and CORS preflights), then the body's content type.
pub async fn check(State(gate): State<Arc<Gate>>, req: HttpRequest, next: Next) -> Response {
    let headers = req.headers();
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    if gate.loopback_hosts_only {
        let name = host_name(&host).to_ascii_lowercase();
        if !matches!(name.as_str(), "localhost" | "127.0.0.1" | "[::1]") {
            return refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "Host {host:?} is not served: bound to loopback without --api-key, this server answers only \
                     localhost, 127.0.0.1 and [::1]"
                ),
            );
        }
    }
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()).map(str::to_string);
    let cross_origin = match &origin {
        // a page of this server (--web) is same-origin: its origin names the Host it was fetched from
        Some(o) => !o.split_once("://").is_some_and(|(_, h)| h.eq_ignore_ascii_case(&host)),
        None => false,
    };
    if let (true, Some(o)) = (cross_origin, &origin) {
        if !gate.origin_allowed(o) {
            return refuse(
                StatusCode::FORBIDDEN,
                format!("cross-origin requests from {o:?} are refused (--allowed-origins names the origins served)"),
            );
        }
        if req.method() == Method::OPTIONS {
            let mut r = StatusCode::NO_CONTENT.into_response();
            cors_headers(r.headers_mut(), o);
            let h = r.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, HeaderValue::from_static("authorization, content-type"));
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
            return r;
        }
    }
    // a form or text/plain POST from any page needs no preflight: only JSON bodies are read
    // (a weights body is octet-stream: admin-keyed, and not a content type a page sends unasked)
    let weights_body =
        req.uri().path() == "/v1/weights" && content_type(headers).starts_with("application/octet-stream");
    if req.method() == Method::POST && !is_empty_body(headers) && !is_json(headers) && !weights_body {
        let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("none");
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("the request body must be `Content-Type: application/json`, got {ct:?}"),
        );
    }
    let mut r = next.run(req).await;
    if let (true, Some(o)) = (cross_origin, &origin) {
        cors_headers(r.headers_mut(), o);
    }
    r
}

fn cors_headers(h: &mut HeaderMap, origin: &str) {
    if let Ok(v) = HeaderValue::from_str(origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
}

fn content_type(h: &HeaderMap) -> &str {
    h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("")
}

fn is_json(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

fn is_empty_body(h: &HeaderMap) -> bool {
    match h.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()) {
        Some(n) => n.trim() == "0",
        None => !h.contains_key(header::TRANSFER_ENCODING),
    }
}

/// The key an `Authorization: Bearer KEY` header carries ("" without one).
pub fn bearer(h: &HeaderMap) -> &str {
    h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("")
}

/// A key held as its SHA-256: a guess is hashed and the two digests compared in constant time,
/// so the time taken depends neither on how much of a guess was right nor on the key's length.
pub struct Key([u8; 32]);

impl Key {
    pub fn new(key: &str) -> Self {
        Key(Sha256::digest(key.as_bytes()).into())
    }

    pub fn matches(&self, given: &str) -> bool {
        let d: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        bool::from(d.ct_eq(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_and_keys() {
        for (h, want) in [("localhost:8080", "localhost"), ("[::1]:80", "[::1]"), ("[::1]", "[::1]"), ("a.b", "a.b")] {
            assert_eq!(host_name(h), want);
        }
        let k = Key::new("sekret");
        assert!(k.matches("sekret") && !k.matches("sekre") && !k.matches("sekret1") && !k.matches(""));
        assert!(Gate::new(vec![], "127.0.0.1", false).loopback_hosts_only);
        assert!(Gate::new(vec![], "::1", false).loopback_hosts_only);
        assert!(!Gate::new(vec![], "127.0.0.1", true).loopback_hosts_only);
        assert!(!Gate::new(vec![], "0.0.0.0", false).loopback_hosts_only);
    }
}
