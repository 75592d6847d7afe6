//! LoRA adapters on the server, by vLLM's conventions: `--lora NAME=PATH` (repeatable) loads PEFT
//! adapter folders (or GGUF LoRA files) at start, a request picks one with `"model": "NAME"`,
//! `/v1/models` lists them beside the base model, and the admin endpoints
//! `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` change them while the server runs
//! (paths under `--weights-dir` only, read off the engine thread). An adapter named by a request in flight cannot be unloaded.

use std::sync::Arc;

use axum::extract::{Request as HttpRequest, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvdecode::io::model_file::open_lora;
use kvdecode::{LoraAdapter, ModelConfig};
use serde_json::{json, Value};

use super::api::ApiError;
use super::engine::Admin;
use super::{read_body, App};

/// `--lora NAME=PATH` values read as adapters for a model of `cfg`.
pub fn read_flags(flags: &[String], cfg: &ModelConfig) -> Result<Vec<(String, LoraAdapter)>, String> {
    let mut out: Vec<(String, LoraAdapter)> = Vec::new();
    for f in flags {
        let (name, path) = f
            .split_once('=')
            .filter(|(n, p)| !n.is_empty() && !p.is_empty())
            .ok_or_else(|| format!("--lora {f:?}: expected NAME=PATH (a PEFT adapter folder)"))?;
        if out.iter().any(|(n, _)| n == name) {
            return Err(format!("--lora: the name {name:?} is given twice"));
        }
        let adapter = open_lora(path, cfg).map_err(|e| format!("--lora {name}={path}: {e}"))?;
        out.push((name.to_string(), adapter));
    }
    Ok(out)
}

/// The largest rank of any module of `adapters`.
pub fn largest_rank(adapters: &[(String, LoraAdapter)]) -> usize {
    adapters.iter().flat_map(|(_, a)| a.layers.iter().flatten().flatten().map(|m| m.rank)).max().unwrap_or(0)
}

/// The adapter a request's `model` names: `None` for the base model (its served name, or no
/// `model`). On a server with adapter slots any other name is a 404, as vLLM answers; without
/// slots every name is the base model, as before adapters existed.
pub fn adapter_for(app: &App, model: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(m) = model.filter(|m| *m != app.model) else { return Ok(None) };
    let loaded = app.loras.lock().unwrap_or_else(|e| e.into_inner());
    if loaded.iter().any(|n| n == m) {
        return Ok(Some(m.to_string()));
    }
    if app.max_loras == 0 {
        return Ok(None);
    }
    let mut e = ApiError::new(StatusCode::NOT_FOUND, format!("The model `{m}` does not exist (adapters: {loaded:?})"));
    e.param = Some("model".into());
    Err(e)
}

/// `/v1/models`' entries for the adapters.
pub fn model_entries(app: &App) -> Vec<Value> {
    let loaded = app.loras.lock().unwrap_or_else(|e| e.into_inner()).clone();
    loaded
        .into_iter()
        .map(|n| json!({"id": n, "object": "model", "created": app.created, "owned_by": "kvdecode", "parent": app.model}))
        .collect()
}

fn name_of(v: &Value) -> Result<String, ApiError> {
    match v.get("lora_name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() && n.len() <= 256 => Ok(n.to_string()),
        _ => Err(ApiError::bad("lora_name", "`lora_name` (1 to 256 characters) is required")),
    }
}

/// `POST /v1/load_lora_adapter {"lora_name": NAME, "lora_path": PATH}`: a PEFT adapter folder (or
/// a GGUF LoRA file) under `--weights-dir`, made resident under NAME; requests then pick it with
/// `"model": NAME`.
pub async fn load(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    let r = async {
        let body = read_body(&app, req.into_body()).await?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad("", format!("not JSON: {e}")))?;
        let name = name_of(&v)?;
        if name == app.model {
            return Err(ApiError::bad("lora_name", "`lora_name` is the base model's name"));
        }
        let given = v.get("lora_path").and_then(Value::as_str).map(str::to_string);
        let given = given.ok_or_else(|| ApiError::bad("lora_path", "`lora_path` (a folder under --weights-dir)"))?;
        let Some(dir) = &app.weights_dir else {
            return Err(ApiError::bad("lora_path", "this server reads no adapters: start it with --weights-dir"));
        };
        let path = dir.resolve(&given)?;
        let a = app.clone();
        let read = tokio::task::spawn_blocking(move || open_lora(&path, &a.cfg)).await;
        let adapter = match read {
            Ok(Ok(adapter)) => adapter,
            Ok(Err(e)) => return Err(ApiError::bad("lora_path", format!("{given:?} is not an adapter for it: {e}"))),
            Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "reading the adapter failed")),
        };
        let v = super::admin::command(&app, Admin::LoadLora { name: name.clone(), adapter: Box::new(adapter) }).await?;
        app.loras.lock().unwrap_or_else(|e| e.into_inner()).push(name);
        Ok(v)
    }
    .await;
    r.map_or_else(IntoResponse::into_response, |v| Json(v).into_response())
}

/// `POST /v1/unload_lora_adapter {"lora_name": NAME}`: free its slot (refused while a request
/// names it).
pub async fn unload(State(app): State<Arc<App>>, req: HttpRequest) -> Response {
    let r = async {
        let body = read_body(&app, req.into_body()).await?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad("", format!("not JSON: {e}")))?;
        let name = name_of(&v)?;
        // the name leaves the list first, so no new request picks it while the engine unloads it
        let at = {
            let mut loaded = app.loras.lock().unwrap_or_else(|e| e.into_inner());
            let at = loaded.iter().position(|n| *n == name);
            at.map(|i| (i, loaded.remove(i)))
        };
        let Some((i, _)) = at else {
            return Err(ApiError::new(StatusCode::NOT_FOUND, format!("no adapter named {name:?} is loaded")));
        };
        let r = super::admin::command(&app, Admin::UnloadLora { name: name.clone() }).await;
        if r.is_err() {
            app.loras.lock().unwrap_or_else(|e| e.into_inner()).insert(i, name);
        }
        r
    }
    .await;
    r.map_or_else(IntoResponse::into_response, |v| Json(v).into_response())
}
