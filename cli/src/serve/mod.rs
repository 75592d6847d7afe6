//! `kvdecode serve`: an OpenAI-compatible HTTP server (axum + tokio) in front of the
//! continuous-batching scheduler. One engine per process, driven by one thread
//! ([`engine::run`]); handlers parse and validate requests ([`api`]), hand them over through a
//! bounded channel (full: 429 with Retry-After) and turn the engine's tokens into responses or
//! server-sent events. A client that goes away cancels its generation at once.

pub mod api;
mod engine;
pub mod guide;
mod metrics;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvdecode::tokenizer::Tokenizer;
use kvdecode::{Engine, Gpu, Request};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::common::{load_model, EngineArgs, Result};
use api::{ApiError, ChoiceText, Gen, Kind, Limits};
use engine::{Job, JobEvent};
use metrics::Metrics;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file, a Hugging Face directory or a kvdecode safetensors file (with a tokenizer).
    #[arg(long)]
    model: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Cache rows: generations decoded side by side.
    #[arg(long, default_value_t = 8)]
    rows: usize,
    /// Generations that may wait for a row before requests get 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body: usize,
    /// Largest `max_tokens` a request may ask for (default: the row length).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Prompt tokens prefilled per scheduler step (long prompts share steps with decoding rows).
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// The model's name in responses and /v1/models (default: the file name).
    #[arg(long)]
    model_name: Option<String>,
    /// Also serve this folder's static files at / (the browser page: scripts/web-build.sh, then
    /// --web examples/web).
    #[arg(long)]
    web: Option<std::path::PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

struct App {
    model: String,
    tok: Tokenizer,
    /// llguidance's view of the vocabulary (or why it could not be built).
    guide: std::result::Result<guide::Guide, String>,
    jobs: mpsc::Sender<Job>,
    metrics: Arc<Metrics>,
    limits: Limits,
    max_body: usize,
    created: u64,
    seeds: AtomicU64,
    next_id: AtomicU64,
}

pub fn run(a: Args) -> Result<()> {
    let (weights, tok) = load_model(&a.model)?;
    let tok = tok.ok_or(format!("{}: the model has no tokenizer to serve text with", a.model))?;
    let gpu = Gpu::new()?;
    let max_len = a.engine.max_len(&gpu, &weights, a.rows);
    let engine = Engine::new(&gpu, &weights, a.engine.options(a.rows, max_len))?;
    let guide = guide::Guide::new(&tok, weights.cfg.vocab);
    if let Err(e) = &guide {
        eprintln!("structured output is off: llguidance could not read the tokenizer: {e}");
    }
    drop(weights);
    let metrics = Arc::new(Metrics::new(a.rows, max_len));
    let (jobs_tx, jobs_rx) = mpsc::channel(a.queue.max(1));
    let m = metrics.clone();
    let chunk = a.prefill_chunk;
    std::thread::Builder::new().name("kvdecode-gpu".into()).spawn(move || engine::run(engine, chunk, jobs_rx, m))?;
    let model = a.model_name.clone().unwrap_or_else(|| {
        std::path::Path::new(&a.model).file_name().map_or(a.model.clone(), |f| f.to_string_lossy().into_owned())
    });
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let app = Arc::new(App {
        model,
        tok,
        guide,
        jobs: jobs_tx,
        metrics,
        limits: Limits { max_len, max_n: a.rows, max_tokens: a.max_tokens.unwrap_or(max_len) },
        max_body: a.max_body,
        created: now,
        seeds: AtomicU64::new(now.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        next_id: AtomicU64::new(1),
    });
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        // bodies are read (and bounded) by the handlers, which answer in OpenAI's error shape
        .layer(DefaultBodyLimit::disable())
        .with_state(app.clone());
    if let Some(dir) = &a.web {
        router = router.fallback_service(tower_http::services::ServeDir::new(dir));
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", a.host, a.port).parse()?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        eprintln!(
            "serving {} on http://{} ({} rows of {max_len} tokens, {} on {})",
            app.model,
            listener.local_addr()?,
            a.rows,
            a.engine.kv.name(),
            gpu.describe()
        );
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.metrics.healthy.load(Ordering::Relaxed) {
        Json(json!({"status": "ok"})).into_response()
    } else {
        let why = app.metrics.last_error.lock().map(|e| e.clone()).unwrap_or_default();
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "error", "error": why}))).into_response()
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render()).into_response()
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": app.model, "object": "model", "created": app.created, "owned_by": "kvdecode"}
    ]}))
}

async fn completions(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    serve(app, req, Kind::Completion).await
}

async fn chat_completions(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    serve(app, req, Kind::Chat).await
}

/// Read, validate and run one generation request; every failure is an OpenAI-shaped error and
/// is counted.
async fn serve(app: Arc<App>, req: HttpRequest, kind: Kind) -> Response {
    let result = async {
        let body = read_body(req.into_body(), app.max_body).await?;
        let seed = app.seeds.fetch_add(0x6A09_E667, Ordering::Relaxed);
        let g = api::parse(&body, kind, &app.tok, &app.guide, &app.limits, seed)?;
        run_gen(app.clone(), g).await
    }
    .await;
    match result {
        Ok(r) => r,
        Err(e) => {
            match e.status.as_u16() {
                429 | 503 => app.metrics.rejected.inc(),
                400..=499 => app.metrics.client_errors.inc(),
                _ => app.metrics.server_errors.inc(),
            }
            e.into_response()
        }
    }
}

async fn read_body(body: Body, limit: usize) -> std::result::Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than {limit} bytes"))
    })
}

/// Hand the generation to the engine thread and answer: one JSON response, or server-sent events.
async fn run_gen(app: Arc<App>, g: Gen) -> std::result::Result<Response, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let n = g.samplers.len();
    let stop = Arc::new((0..n).map(|_| AtomicBool::new(false)).collect::<Vec<_>>());
    let job = Job {
        request: Request {
            tokens: g.prompt.clone(),
            max_new: g.max_tokens,
            stop: g.stop_ids.clone(),
            sampler: g.samplers[0],
            logit_bias: g.logit_bias.clone(),
            presence_penalty: g.presence_penalty,
            frequency_penalty: g.frequency_penalty,
            constraint: g.constraint.clone(),
        },
        samplers: g.samplers.clone(),
        events: tx,
        stop: stop.clone(),
        received: Instant::now(),
    };
    match app.jobs.try_send(job) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) => {
            let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "the server's queue is full; retry shortly");
            e.retry_after = Some(1);
            return Err(e);
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"));
        }
    }
    app.metrics.prompt_tokens.add(g.prompt.len() as u64);
    let id = format!(
        "{}-{}",
        if g.kind == Kind::Chat { "chatcmpl" } else { "cmpl" },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let out = Output { app, g, id, created, stop };
    if out.g.stream {
        Ok(out.stream(rx))
    } else {
        out.collect(rx).await
    }
}

/// Turns a job's events into the endpoint's response shapes.
struct Output {
    app: Arc<App>,
    g: Gen,
    id: String,
    created: u64,
    stop: Arc<Vec<AtomicBool>>,
}

impl Output {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.g.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn usage(&self, generated: usize) -> Value {
        let p = self.g.prompt.len();
        json!({"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated})
    }

    /// Feed one event into the choices; returns (choice, newly released text, finished now).
    fn apply(
        &self,
        choices: &mut [ChoiceText],
        generated: &mut usize,
        ev: JobEvent,
    ) -> std::result::Result<Option<(usize, String, bool)>, ApiError> {
        match ev {
            JobEvent::Token { choice, sampled } => {
                let c = &mut choices[choice];
                let was_done = c.finish.is_some();
                // tokens still in flight after a stop string are not part of the answer
                *generated += usize::from(!was_done);
                let text = c.push(&self.g, &self.app.tok, sampled);
                let now_done = !was_done && c.finish.is_some();
                if now_done {
                    // a stop string or token ended it here: stop generating at once
                    self.stop[choice].store(true, Ordering::Relaxed);
                }
                Ok(Some((choice, text, now_done)))
            }
            JobEvent::Done { choice, finish } => {
                let c = &mut choices[choice];
                let was_done = c.finish.is_some();
                let text = c.done(finish);
                Ok(Some((choice, text, !was_done)))
            }
            JobEvent::Error(e) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e)),
        }
    }

    fn logprobs_of(&self, c: &ChoiceText, from: usize) -> Value {
        if self.g.logprobs.is_none() {
            return Value::Null;
        }
        let entries = &c.logprobs[from.min(c.logprobs.len())..];
        match self.g.kind {
            Kind::Chat => api::chat_logprobs(&self.app.tok, entries),
            Kind::Completion => api::completion_logprobs(&self.app.tok, entries, 0),
        }
    }

    /// A finished chat choice's message and finish reason: with tools, the calls it makes.
    fn message(&self, i: usize, c: &ChoiceText) -> (Value, Value) {
        if !self.g.parses_tool_calls() {
            return (json!({"role": "assistant", "content": c.text}), json!(c.finish));
        }
        let (content, calls) = api::split_tool_calls(&c.text, &format!("{}-{i}", self.id));
        let content = if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) };
        if calls.is_empty() {
            (json!({"role": "assistant", "content": content}), json!(c.finish))
        } else {
            (json!({"role": "assistant", "content": content, "tool_calls": calls}), json!("tool_calls"))
        }
    }

    async fn collect(self, mut rx: mpsc::UnboundedReceiver<JobEvent>) -> std::result::Result<Response, ApiError> {
        let n = self.g.samplers.len();
        let mut choices: Vec<ChoiceText> = (0..n).map(|_| ChoiceText::default()).collect();
        let mut done = vec![false; n];
        let mut generated = 0;
        while done.iter().any(|d| !d) {
            let Some(ev) = rx.recv().await else {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request"));
            };
            let is_done = matches!(ev, JobEvent::Done { .. });
            if let Some((i, _, _)) = self.apply(&mut choices, &mut generated, ev)? {
                done[i] |= is_done;
            }
        }
        let list: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| match self.g.kind {
                Kind::Chat => {
                    let (message, finish) = self.message(i, c);
                    json!({"index": i, "message": message, "logprobs": self.logprobs_of(c, 0), "finish_reason": finish})
                }
                Kind::Completion => json!({
                    "index": i, "text": c.text, "logprobs": self.logprobs_of(c, 0), "finish_reason": c.finish,
                }),
            })
            .collect();
        self.app.metrics.ok.inc();
        Ok(Json(json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.app.model,
            "choices": list, "usage": self.usage(generated), "system_fingerprint": null,
        }))
        .into_response())
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.app.model,
            "choices": choices, "system_fingerprint": null,
        });
        if self.g.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(v.to_string())
    }

    /// Server-sent events: a first chunk per choice (chat: the role), text deltas as they are
    /// released, a last chunk per choice with its finish reason, the usage chunk if asked, and
    /// `[DONE]`. The events are produced by a task; if the client goes away the task's sends
    /// fail, it drops the job's receiver and the engine cancels the generation.
    fn stream(self, mut rx: mpsc::UnboundedReceiver<JobEvent>) -> Response {
        let (sse_tx, sse_rx) = mpsc::channel::<std::result::Result<SseEvent, std::convert::Infallible>>(64);
        tokio::spawn(async move {
            let n = self.g.samplers.len();
            let mut choices: Vec<ChoiceText> = (0..n).map(|_| ChoiceText::default()).collect();
            let mut sent_lp = vec![0usize; n];
            let mut done = vec![false; n];
            let mut generated = 0;
            if self.g.kind == Kind::Chat {
                for i in 0..n {
                    let c = json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                    if sse_tx.send(Ok(self.chunk(c, None))).await.is_err() {
                        return;
                    }
                }
            }
            while done.iter().any(|d| !d) {
                let Some(ev) = rx.recv().await else { return };
                let is_done = matches!(ev, JobEvent::Done { .. });
                let (i, text, finished) = match self.apply(&mut choices, &mut generated, ev) {
                    Ok(Some(x)) => x,
                    Ok(None) => continue,
                    Err(e) => {
                        self.app.metrics.server_errors.inc();
                        let err = json!({"error": {"message": e.message, "type": "server_error", "param": null, "code": null}});
                        let _ = sse_tx.send(Ok(SseEvent::default().data(err.to_string()))).await;
                        return;
                    }
                };
                done[i] |= is_done;
                let c = &choices[i];
                if self.g.parses_tool_calls() {
                    // replies that may hold tool calls go out whole: text and calls in one delta
                    if finished {
                        let (mut message, finish) = self.message(i, c);
                        if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            for (k, call) in calls.iter_mut().enumerate() {
                                call["index"] = json!(k);
                            }
                        }
                        message.as_object_mut().map(|m| m.remove("role"));
                        let lp = self.logprobs_of(c, 0);
                        let delta = json!([{"index": i, "delta": message, "logprobs": lp, "finish_reason": null}]);
                        let last = json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": finish}]);
                        for ch in [delta, last] {
                            if sse_tx.send(Ok(self.chunk(ch, None))).await.is_err() {
                                return;
                            }
                        }
                    }
                    continue;
                }
                let lp = self.logprobs_of(c, sent_lp[i]);
                let lp_changed = c.logprobs.len() > sent_lp[i];
                if !text.is_empty() || (lp_changed && self.g.logprobs.is_some()) {
                    sent_lp[i] = c.logprobs.len();
                    let delta = match self.g.kind {
                        Kind::Chat => {
                            json!([{"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}])
                        }
                        Kind::Completion => json!([{"index": i, "text": text, "logprobs": lp, "finish_reason": null}]),
                    };
                    if sse_tx.send(Ok(self.chunk(delta, None))).await.is_err() {
                        return;
                    }
                }
                if finished {
                    let last = match self.g.kind {
                        Kind::Chat => json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": c.finish}]),
                        Kind::Completion => {
                            json!([{"index": i, "text": "", "logprobs": null, "finish_reason": c.finish}])
                        }
                    };
                    if sse_tx.send(Ok(self.chunk(last, None))).await.is_err() {
                        return;
                    }
                }
            }
            if self.g.include_usage {
                let u = self.usage(generated);
                if sse_tx.send(Ok(self.chunk(json!([]), Some(u)))).await.is_err() {
                    return;
                }
            }
            self.app.metrics.ok.inc();
            let _ = sse_tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        });
        Sse::new(tokio_stream::wrappers::ReceiverStream::new(sse_rx)).keep_alive(KeepAlive::default()).into_response()
    }
}
