//! The admin endpoints (`--admin-key`): new weights from files under `--weights-dir`, pause,
//! resume, prompt-cache reset. The admin key is not the API key: a client that may generate may
//! not replace the model. Weights are read on a blocking thread, never on the engine's, from
//! regular files inside the weights folder only (no symlink out of it, no device or FIFO), and a
//! path that is refused gets the same answer whether or not it exists.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request as HttpRequest, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvdecode::io::model_file::TensorFiles;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::api::ApiError;
use super::engine::{Admin, Msg, UpdateMode};
use super::{read_body, App};

/// Where weights may be read from, and how much.
pub struct WeightsDir {
    /// Canonical.
    pub dir: PathBuf,
    /// `--max-weights-bytes`.
    pub max_bytes: u64,
}

impl WeightsDir {
    pub fn new(dir: &Path, max_bytes: u64) -> std::io::Result<Self> {
        Ok(WeightsDir { dir: dir.canonicalize()?, max_bytes })
    }

    /// The canonical path of `given` (relative to the folder, or absolute inside it) if it is a
    /// regular file, or a folder whose `*.safetensors` are regular files, inside the folder and
    /// within the byte limit.
    pub fn resolve(&self, given: &str) -> Result<PathBuf, ApiError> {
        let refused = || {
            ApiError::bad(
                "path",
                format!("`path` {given:?} is not a weights file or Hugging Face folder inside --weights-dir"),
            )
        };
        let inside = |p: &Path| -> Result<(PathBuf, std::fs::Metadata), ApiError> {
            let c = p.canonicalize().map_err(|_| refused())?;
            let meta = std::fs::metadata(&c).map_err(|_| refused())?;
            if !c.starts_with(&self.dir) {
                return Err(refused());
            }
            Ok((c, meta))
        };
        let (path, meta) = inside(&self.dir.join(given))?;
        let bytes = if meta.is_file() {
            meta.len()
        } else if meta.is_dir() {
            let mut total = 0;
            for e in std::fs::read_dir(&path).map_err(|_| refused())?.flatten() {
                if e.path().extension().is_some_and(|x| x == "safetensors") {
                    let (_, m) = inside(&e.path())?;
                    if !m.is_file() {
                        return Err(refused());
                    }
                    total += m.len();
                }
            }
            total
        } else {
            return Err(refused());
        };
        if bytes > self.max_bytes {
            return Err(ApiError::bad(
                "path",
                format!("`path` {given:?} holds {bytes} bytes, more than --max-weights-bytes {}", self.max_bytes),
            ));
        }
        Ok(path)
    }
}

/// Admin endpoints need `Authorization: Bearer ADMIN_KEY`.
pub async fn authorize(State(app): State<Arc<App>>, req: HttpRequest, next: Next) -> Response {
    if app.admin_key.as_ref().is_some_and(|k| k.matches(super::gate::bearer(req.headers()))) {
        return next.run(req).await;
    }
    app.metrics.client_errors.inc();
    let body = json!({"error": {"message": "an admin endpoint: send `Authorization: Bearer <admin key>`",
                                "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
    (StatusCode::UNAUTHORIZED, [(axum::http::header::WWW_AUTHENTICATE, "Bearer")], Json(body)).into_response()
}

/// Send an admin command to the engine thread and answer with what it says.
pub(super) async fn command(app: &App, cmd: Admin) -> Result<Value, ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if app.jobs.send(Msg::Admin(cmd, tx)).await.is_err() {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"));
    }
    match rx.await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ApiError::bad("", e)),
        Err(_) => Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")),
    }
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/weights {"path": ..., "mode": "wait" | "abort" | "keep"}`: new weights from a file
/// or folder under `--weights-dir` (safetensors, a Hugging Face folder or GGUF with the model's
/// shapes); answers with the new version. `wait` (the default): requests in flight finish on the
/// old weights while new ones queue; `abort`: they end now (finish reason `abort`); `keep`: they
/// go on from their K/V with the new weights.
pub async fn update_weights(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    answer(weights(app, req).await)
}

async fn weights(app: Arc<App>, req: HttpRequest) -> Result<Value, ApiError> {
    let ct = req.headers().get(axum::http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if ct.starts_with("application/octet-stream") {
        return weights_in_body(app, req).await;
    }
    let body = read_body(&app, req.into_body()).await?;
    let v: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad("", format!("the body is not JSON: {e}")))?;
    let Some(given) = v.get("path").and_then(Value::as_str).map(str::to_string) else {
        return Err(ApiError::bad("path", "`path` (a file or folder under --weights-dir) is required"));
    };
    let mode = update_mode(v.get("mode").and_then(Value::as_str))?;
    let Some(dir) = &app.weights_dir else {
        return Err(ApiError::bad("path", "this server reads no weights files: start it with --weights-dir"));
    };
    let path = dir.resolve(&given)?;
    let t0 = Instant::now();
    let read = tokio::task::spawn_blocking(move || TensorFiles::open(&path)).await;
    let files = match read {
        Ok(Ok(f)) => f,
        // what the reader says names the file and its format, never the OS's view of other paths
        Ok(Err(e)) => return Err(ApiError::bad("path", format!("`path` {given:?} could not be read as weights: {e}"))),
        Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "reading the weights failed")),
    };
    let read_seconds = t0.elapsed().as_secs_f64();
    let mut v = command(&app, Admin::Weights { files: Box::new(files), source: given, mode }).await?;
    v["read_seconds"] = json!(read_seconds);
    Ok(v)
}

/// `POST /v1/weights?mode=...` with `Content-Type: application/octet-stream` and
/// `X-Weights-SHA256: <hex>`: a safetensors file (all of the model's tensors or a subset, any
/// name and dtype an update takes) in the body, so a trainer on another machine needs no shared
/// disk. At most `--max-weights-bytes`, within `--body-timeout`; the digest must match, or nothing
/// is changed.
async fn weights_in_body(app: Arc<App>, req: HttpRequest) -> Result<Value, ApiError> {
    let mode = update_mode(req.uri().query().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix("mode=")))?;
    let want = req
        .headers()
        .get("x-weights-sha256")
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase)
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| ApiError::bad("", "a weights body needs `X-Weights-SHA256`: its SHA-256 in hex"))?;
    let limit = app.max_weights_bytes;
    let t0 = Instant::now();
    let bytes = match tokio::time::timeout(app.body_timeout, axum::body::to_bytes(req.into_body(), limit)).await {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the weights body is larger than --max-weights-bytes {limit}"),
            ))
        }
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "the weights body did not arrive within --body-timeout",
            ))
        }
    };
    let got: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    if got != want {
        return Err(ApiError::bad("", format!("the body's SHA-256 is {got}, not the X-Weights-SHA256 given ({want})")));
    }
    let files = TensorFiles::Safetensors(vec![(PathBuf::from("the request body"), bytes.to_vec().into())]);
    let read_seconds = t0.elapsed().as_secs_f64();
    let source = format!("the request body ({} bytes)", bytes.len());
    let mut v = command(&app, Admin::Weights { files: Box::new(files), source, mode }).await?;
    v["read_seconds"] = json!(read_seconds);
    Ok(v)
}

/// An update's `mode` (`wait` when not given).
fn update_mode(mode: Option<&str>) -> Result<UpdateMode, ApiError> {
    match mode.unwrap_or("wait") {
        "wait" => Ok(UpdateMode::Wait),
        "abort" => Ok(UpdateMode::Abort),
        "keep" => Ok(UpdateMode::Keep),
        other => Err(ApiError::bad("mode", format!("`mode` {other:?}: expected wait, abort or keep"))),
    }
}

/// `POST /v1/pause`: no step runs (requests keep their rows; new ones queue) until `/v1/resume`.
pub async fn pause(State(app): State<Arc<App>>) -> Response {
    answer(command(&app, Admin::Pause).await)
}

/// `POST /v1/resume`.
pub async fn resume(State(app): State<Arc<App>>) -> Response {
    answer(command(&app, Admin::Resume).await)
}

/// `POST /v1/reset_prefix_cache`: forget every block the prompt cache holds.
pub async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    answer(command(&app, Admin::ResetPrefixCache).await)
}
