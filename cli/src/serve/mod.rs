//! `kvdecode serve`: an OpenAI-compatible HTTP server (axum + tokio) in front of the
//! continuous-batching scheduler. One engine per process, driven by one thread
//! ([`engine::run`]); handlers parse and validate requests ([`api`]), admit at most rows +
//! `--queue` generations (past it: 429 with Retry-After), hand them over through a channel and
//! turn the engine's tokens into responses or server-sent events. A client that goes away
//! cancels its generation at once.

mod admin;
pub mod api;
mod engine;
mod gate;
pub mod guide;
mod listen;
mod lora;
mod metrics;
mod output;
pub mod response;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvdecode::io::tokenizer::Tokenizer;
use kvdecode::{Gpu, Request};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::common::{open_model, EngineArgs, Result};
use api::{ApiError, Gen, Kind, Limits};
use engine::{Job, Msg};
use metrics::Metrics;
use output::Output;

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
    /// Generations that may wait beyond the rows (queued, held during an update or waiting for a
    /// row) before requests get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body: usize,
    /// Seconds a request's headers may take to arrive (from the connection's first byte, or its
    /// previous response); the connection is closed past it.
    #[arg(long, default_value_t = 30.0)]
    header_timeout: f64,
    /// Seconds a request's body may take to arrive (408 past it).
    #[arg(long, default_value_t = 60.0)]
    body_timeout: f64,
    /// Open connections at most; more wait to be accepted.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
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
    /// Every endpoint but /health and the admin ones then needs `Authorization: Bearer KEY`
    /// (401 otherwise).
    #[arg(long, env = "KVDECODE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The admin endpoints exist, behind `Authorization: Bearer ADMIN_KEY` (not the API key):
    /// POST /v1/weights, /v1/pause, /v1/resume, /v1/reset_prefix_cache.
    #[arg(long, env = "KVDECODE_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// The folder POST /v1/weights reads from: a `path` must name a file or Hugging Face folder
    /// inside it (symlinks out of it, devices and FIFOs are refused). Without it no weights file
    /// is read.
    #[arg(long)]
    weights_dir: Option<std::path::PathBuf>,
    /// Largest weights file (or folder, or request body) POST /v1/weights reads, in bytes.
    #[arg(long, default_value_t = 64 << 30)]
    max_weights_bytes: u64,
    /// Origins whose cross-origin (browser) requests are served, comma-separated (`*`: any).
    /// Requests from other origins get 403; without it only this server's own pages (--web) may
    /// call it from a browser.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// A mixture of experts keeps the experts every token was routed to, and a request with
    /// `"return_routed_experts": true` gets them in each choice's `routed_experts` (vLLM's names).
    /// Turns the prompt cache off.
    #[arg(long)]
    enable_return_routed_experts: bool,
    /// The distribution logprobs are of when a request names none: raw (the model's), scaled
    /// (after temperature), processed (what the token was drawn from, after top-k/top-p/min-p).
    #[arg(long, default_value = "scaled", value_parser = |s: &str| kvdecode::LogprobMode::parse(s).map_err(|e| e.to_string()))]
    logprobs_mode: kvdecode::LogprobMode,
    /// For tests: destroy the GPU device after N engine steps, as a driver reset would (health
    /// turns 503, requests get the error).
    #[arg(long, hide = true)]
    lose_device_after: Option<u64>,
    /// A PEFT LoRA adapter folder served as model NAME (repeatable): requests pick it with
    /// `"model": "NAME"`, and /v1/models lists it.
    #[arg(long, value_name = "NAME=PATH")]
    lora: Vec<String>,
    /// Adapters resident at once (default: as many as --lora gives); with the admin key more can
    /// be loaded by POST /v1/load_lora_adapter up to this.
    #[arg(long)]
    max_loras: Option<usize>,
    /// The largest adapter rank a slot holds (default: 16, or the largest --lora's rank).
    #[arg(long)]
    max_lora_rank: Option<usize>,
    /// How the slots hold adapters' A and B: f32 (as given) or f16 (rounded to halves: half the
    /// memory and the bytes an update writes; the sums stay f32).
    #[arg(long, default_value = "f32", value_parser = crate::common::parse_weights)]
    lora_dtype: kvdecode::WeightDtype,
    #[command(flatten)]
    engine: EngineArgs,
}

struct App {
    model: String,
    /// The model's shapes (adapters are read against them).
    cfg: kvdecode::ModelConfig,
    /// The LoRA adapters requests may name, as the engine holds them.
    loras: std::sync::Mutex<Vec<String>>,
    /// `--max-loras`: 0 means the server takes no adapters.
    max_loras: usize,
    tok: Tokenizer,
    /// llguidance's view of the vocabulary (or why it could not be built).
    guide: std::result::Result<guide::Guide, String>,
    jobs: mpsc::Sender<Msg>,
    /// `--api-key`: what `Authorization: Bearer` must carry.
    api_key: Option<gate::Key>,
    /// `--admin-key`: what the admin endpoints' `Authorization: Bearer` must carry.
    admin_key: Option<gate::Key>,
    /// `--weights-dir`.
    weights_dir: Option<admin::WeightsDir>,
    metrics: Arc<Metrics>,
    limits: Limits,
    max_body: usize,
    /// `--body-timeout`.
    body_timeout: std::time::Duration,
    /// `--max-weights-bytes`: a weights file or body at most.
    max_weights_bytes: usize,
    created: u64,
    seeds: AtomicU64,
    next_id: AtomicU64,
    /// Generations in the server ([`Admission`]), and how many may be: rows + `--queue`.
    admitted: Arc<AtomicUsize>,
    admit_limit: usize,
}

/// Room in the jobs' channel beyond the admitted generations, for admin commands (which wait for
/// room rather than fail): admission bounds the jobs, so a job's send never finds it full.
const ADMIN_SLACK: usize = 8;

/// Run the server: [`router`], then listen on `--host`:`--port` until stopped.
pub fn run(a: Args) -> Result<()> {
    let (router, model, gpu, max_len) = router(&a)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", a.host, a.port).parse()?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        eprintln!(
            "serving {} on http://{} ({} rows of {max_len} tokens, {} on {})",
            model,
            listener.local_addr()?,
            a.rows,
            a.engine.kv.name(),
            gpu.describe()
        );
        let limits = listen::ConnLimits {
            max_connections: a.max_connections,
            header_timeout: std::time::Duration::from_secs_f64(a.header_timeout),
        };
        listen::serve(listener, router, limits).await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

/// The server's flags from a command line (`serve` and its flags), for the fuzz target and
/// tests that build the router without a process.
pub fn args_from(flags: &[&str]) -> Result<Args> {
    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        args: Args,
    }
    Ok(<Command as clap::Parser>::try_parse_from(flags)?.args)
}

/// The model loaded, its engine thread started, and every route behind its checks: the router a
/// listener serves (the fuzz target calls it directly). Also the served model's name, the device
/// and the rows' length.
pub fn router(a: &Args) -> Result<(Router, String, Gpu, usize)> {
    for (flag, secs) in [("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout)] {
        if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
            return Err(format!("{flag} {secs}: a positive number of seconds").into());
        }
    }
    let api_key = a.api_key.as_deref().filter(|k| !k.is_empty());
    let admin_key = a.admin_key.as_deref().filter(|k| !k.is_empty());
    if admin_key.is_some() && admin_key == api_key {
        return Err(
            "--admin-key must differ from --api-key: a client that may generate may not replace the model".into()
        );
    }
    let weights_dir = match &a.weights_dir {
        Some(d) => Some(
            admin::WeightsDir::new(d, a.max_weights_bytes)
                .map_err(|e| format!("--weights-dir {}: {e}", d.display()))?,
        ),
        None => None,
    };
    let (model, tok) = open_model(&a.model)?;
    let tok = tok.ok_or(format!("{}: the model has no tokenizer to serve text with", a.model))?;
    let gpu = Gpu::new()?;
    let cfg = model.cfg().clone();
    let max_len = a.engine.max_len(&gpu, &cfg, a.rows);
    let max_tokens = a.max_tokens.unwrap_or(max_len);
    // every request within the other limits fits its bias and penalties (api::bias_slots)
    let bias_slots = api::bias_slots(max_tokens, cfg.vocab);
    let adapters = lora::read_flags(&a.lora, &cfg)?;
    let opts = kvdecode::EngineOptions {
        record_routes: a.enable_return_routed_experts,
        logit_bias_slots: bias_slots,
        max_loras: a.max_loras.unwrap_or(adapters.len()),
        max_lora_rank: a.max_lora_rank.unwrap_or(lora::largest_rank(&adapters).max(16)),
        lora_dtype: a.lora_dtype,
        ..a.engine.options(a.rows, max_len)
    };
    let mut engine = model.engine(&gpu, opts)?;
    for (name, adapter) in &adapters {
        engine.load_lora(name, adapter).map_err(|e| format!("--lora {name}: {e}"))?;
    }
    let routes = cfg.moe.as_ref().filter(|_| a.enable_return_routed_experts).map(|m| (m.layers.len(), m.top_k));
    let guide = guide::Guide::new(&tok, cfg.vocab);
    if let Err(e) = &guide {
        eprintln!("structured output is off: llguidance could not read the tokenizer: {e}");
    }
    drop(model);
    let metrics = Arc::new(Metrics::new(a.rows, max_len));
    let (jobs_tx, jobs_rx) = mpsc::channel(a.rows + a.queue + ADMIN_SLACK);
    let m = metrics.clone();
    let (chunk, lose) = (a.prefill_chunk, a.lose_device_after);
    std::thread::Builder::new()
        .name("kvdecode-gpu".into())
        .spawn(move || engine::run(engine, chunk, jobs_rx, m, lose))?;
    let model = a.model_name.clone().unwrap_or_else(|| {
        std::path::Path::new(&a.model).file_name().map_or(a.model.clone(), |f| f.to_string_lossy().into_owned())
    });
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let app = Arc::new(App {
        model,
        cfg,
        loras: std::sync::Mutex::new(adapters.into_iter().map(|(n, _)| n).collect()),
        max_loras: opts.max_loras,
        tok,
        guide,
        jobs: jobs_tx,
        api_key: api_key.map(gate::Key::new),
        admin_key: admin_key.map(gate::Key::new),
        weights_dir,
        metrics,
        limits: Limits { max_len, max_n: a.rows, max_tokens, routes, bias_slots, logprobs_mode: a.logprobs_mode },
        max_body: a.max_body,
        body_timeout: std::time::Duration::from_secs_f64(a.body_timeout),
        max_weights_bytes: usize::try_from(a.max_weights_bytes).unwrap_or(usize::MAX),
        created: now,
        seeds: AtomicU64::new(now.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        next_id: AtomicU64::new(1),
        admitted: Arc::new(AtomicUsize::new(0)),
        admit_limit: a.rows + a.queue,
    });
    let mut guarded = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    if let Some(dir) = &a.web {
        guarded = guarded.fallback_service(tower_http::services::ServeDir::new(dir));
    }
    let mut router = guarded.layer(axum::middleware::from_fn_with_state(app.clone(), authorize));
    if app.admin_key.is_some() {
        let admin = Router::new()
            .route("/v1/weights", post(admin::update_weights))
            .route("/v1/pause", post(admin::pause))
            .route("/v1/resume", post(admin::resume))
            .route("/v1/reset_prefix_cache", post(admin::reset_prefix_cache))
            .route("/v1/load_lora_adapter", post(lora::load))
            .route("/v1/unload_lora_adapter", post(lora::unload))
            .layer(axum::middleware::from_fn_with_state(app.clone(), admin::authorize));
        router = router.merge(admin);
    }
    let router = router
        .route("/health", get(health))
        // bodies are read (and bounded) by the handlers, which answer in OpenAI's error shape
        .layer(DefaultBodyLimit::disable())
        .with_state(app.clone())
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(gate::Gate::new(a.allowed_origins.clone(), &a.host, app.api_key.is_some())),
            gate::check,
        ));
    Ok((router, app.model.clone(), gpu, max_len))
}

/// With `--api-key`, a request must carry `Authorization: Bearer KEY`; the key is compared by
/// its digest in constant time ([`gate::Key`]), so the time taken says nothing about the key.
async fn authorize(State(app): State<Arc<App>>, req: HttpRequest, next: Next) -> Response {
    let Some(key) = &app.api_key else { return next.run(req).await };
    let given = gate::bearer(req.headers());
    if key.matches(given) {
        return next.run(req).await;
    }
    app.metrics.client_errors.inc();
    let msg = if given.is_empty() {
        "this server needs an API key: send `Authorization: Bearer <key>`"
    } else {
        "the API key is not valid"
    };
    let body =
        json!({"error": {"message": msg, "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
    (StatusCode::UNAUTHORIZED, [(axum::http::header::WWW_AUTHENTICATE, "Bearer")], Json(body)).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    // the engine thread gone (device lost, or a panic) drops the jobs' receiver
    if app.jobs.is_closed() {
        let body = json!({"status": "error", "error": "the engine thread has stopped"});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    if app.metrics.healthy.load(Ordering::SeqCst) {
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
    let base = json!({"id": app.model, "object": "model", "created": app.created, "owned_by": "kvdecode"});
    let data: Vec<Value> = std::iter::once(base).chain(lora::model_entries(&app)).collect();
    Json(json!({"object": "list", "data": data}))
}

async fn completions(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    serve(app, req, Kind::Completion).await
}

async fn chat_completions(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    serve(app, req, Kind::Chat).await
}

/// `POST /tokenize` ([`api::tokenize`]): `{"tokens", "count", "max_model_len"}`.
async fn tokenize(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    let r = async {
        let body = read_body(&app, req.into_body()).await?;
        let a = app.clone();
        let ids = tokio::task::spawn_blocking(move || api::tokenize(&body, &a.tok))
            .await
            .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "tokenizing failed"))??;
        Ok::<_, ApiError>(json!({"tokens": ids, "count": ids.len(), "max_model_len": app.limits.max_len}))
    }
    .await;
    r.map_or_else(IntoResponse::into_response, |v| Json(v).into_response())
}

/// `POST /detokenize` ([`api::detokenize`]): `{"prompt": text}`.
async fn detokenize(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    let r = async {
        let body = read_body(&app, req.into_body()).await?;
        let text = api::detokenize(&body, &app.tok)?;
        Ok::<_, ApiError>(json!({ "prompt": text }))
    }
    .await;
    r.map_or_else(IntoResponse::into_response, |v| Json(v).into_response())
}

/// Read, validate and run one generation request; every failure is an OpenAI-shaped error and
/// is counted.
async fn serve(app: Arc<App>, req: HttpRequest, kind: Kind) -> Response {
    let result = async {
        let body = read_body(&app, req.into_body()).await?;
        let seed = app.seeds.fetch_add(0x6A09_E667, Ordering::Relaxed);
        // tokenizing, the chat template and a JSON schema's grammar can take a while on long
        // input: on the blocking pool, not on the workers that serve every other connection
        let a = app.clone();
        let g = tokio::task::spawn_blocking(move || api::parse(&body, kind, &a.tok, &a.guide, &a.limits, seed))
            .await
            .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "reading the request failed"))??;
        run_gen(app.clone(), g).await
    }
    .await;
    match result {
        Ok(r) => r,
        Err(e) => {
            app.metrics.count_error(e.status);
            e.into_response()
        }
    }
}

/// The request body, at most `app.max_body` bytes, arrived within `--body-timeout`.
async fn read_body(app: &App, body: Body) -> std::result::Result<Bytes, ApiError> {
    let limit = app.max_body;
    match tokio::time::timeout(app.body_timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(_)) => {
            Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is larger than {limit} bytes")))
        }
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", app.body_timeout.as_secs_f64()),
        )),
    }
}

/// Hand the generation to the engine thread and answer: one JSON response, or server-sent events.
async fn run_gen(app: Arc<App>, mut g: Gen) -> std::result::Result<Response, ApiError> {
    let adapter = lora::adapter_for(&app, g.model.as_deref())?;
    // from here on `model` is what the response names: the adapter, or the base model (None)
    g.model = adapter.clone();
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
            return_routes: g.return_routes,
            adapter,
        },
        samplers: g.samplers.clone(),
        prompt_logprobs: g.prompt_logprobs,
        events: tx,
        stop: stop.clone(),
        received: Instant::now(),
    };
    let queue_full = || {
        let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "the server's queue is full; retry shortly");
        e.retry_after = Some(1);
        e
    };
    let Some(admitted) = Admission::take(&app.admitted, n, app.admit_limit) else {
        return Err(queue_full());
    };
    match app.jobs.try_send(Msg::Job(job)) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) => return Err(queue_full()),
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
    let out = Output { app, g, id, created, stop, _admitted: admitted };
    if out.g.stream {
        Ok(out.stream(rx))
    } else {
        out.collect(rx).await
    }
}

/// Generations admitted into the server (queued, held during an update, waiting for a row or
/// decoding), counted from admission until their response ends or its client goes: `--queue`
/// bounds what waits beyond the rows, whatever the engine thread has taken from the channel.
struct Admission {
    count: Arc<AtomicUsize>,
    n: usize,
}

impl Admission {
    /// `n` more generations, if `limit` allows them. The count only ever holds admitted
    /// generations: a refused request never adds itself, even for a moment (an add-then-undo let
    /// concurrent refusals push an admissible request over the limit).
    fn take(count: &Arc<AtomicUsize>, n: usize, limit: usize) -> Option<Self> {
        let mut now = count.load(Ordering::Acquire);
        loop {
            if now + n > limit {
                return None;
            }
            match count.compare_exchange_weak(now, now + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(Admission { count: count.clone(), n }),
                Err(seen) => now = seen,
            }
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.count.fetch_sub(self.n, Ordering::AcqRel);
    }
}
