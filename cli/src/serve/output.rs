//! A generation's events turned into the endpoint's response shapes: one JSON response, or
//! server-sent events as the text is released.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{ApiError, Gen, Kind};
use super::engine::JobEvent;
use super::response::{self, ChoiceText};
use super::{Admission, App};

/// What only a stream's first chunk carries.
struct First {
    pending: bool,
    prompt_logprobs: Option<Value>,
}

/// Turns a job's events into the endpoint's response shapes.
pub(super) struct Output {
    pub(super) app: Arc<App>,
    pub(super) g: Gen,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) stop: Arc<Vec<AtomicBool>>,
    /// Counted among the generations in the server until this response is done or dropped.
    pub(super) _admitted: Admission,
}

impl Output {
    /// The `model` responses name: the request's adapter, or the served model.
    fn model(&self) -> &str {
        self.g.model.as_deref().unwrap_or(&self.app.model)
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.g.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// The weights versions the choices' tokens were sampled under (the server's version now
    /// when none was sampled yet), each once, in order.
    fn versions(&self, choices: &[ChoiceText]) -> Vec<u64> {
        let mut v: Vec<u64> = choices.iter().flat_map(|c| c.versions.iter().copied()).collect();
        v.sort_unstable();
        v.dedup();
        if v.is_empty() {
            v.push(self.app.metrics.weights_version.get());
        }
        v
    }

    /// Every response and chunk says which weights made it: `system_fingerprint` names the
    /// version, `weights_version` is its number (a response that spans an update made with mode
    /// `keep` reports its first version, and all of them in `weights_versions`). A request on a
    /// LoRA adapter also gets `adapter_version` (and `adapter_versions`) the same way, once a
    /// token was sampled.
    fn stamp(&self, v: &mut Value, choices: &[ChoiceText]) {
        let versions = self.versions(choices);
        v["system_fingerprint"] = json!(format!("kvdecode-weights-v{}", versions[0]));
        v["weights_version"] = json!(versions[0]);
        if versions.len() > 1 {
            v["weights_versions"] = json!(versions);
        }
        let mut adapter: Vec<u64> = choices.iter().flat_map(|c| c.adapter_versions.iter().copied()).collect();
        adapter.sort_unstable();
        adapter.dedup();
        if let Some(first) = adapter.first() {
            v["adapter_version"] = json!(first);
            if adapter.len() > 1 {
                v["adapter_versions"] = json!(adapter);
            }
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
            JobEvent::Token { choice, sampled, weights_version, adapter_version } => {
                let c = &mut choices[choice];
                if c.versions.last() != Some(&weights_version) {
                    c.versions.push(weights_version);
                }
                if let Some(a) = adapter_version.filter(|a| c.adapter_versions.last() != Some(a)) {
                    c.adapter_versions.push(a);
                }
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
            JobEvent::Done { choice, finish, routes } => {
                let c = &mut choices[choice];
                let was_done = c.finish.is_some();
                let text = c.done(&self.app.tok, finish);
                c.routes = routes;
                Ok(Some((choice, text, !was_done)))
            }
            JobEvent::ConstraintFailed(e) => {
                let param = self.g.constrained_by.unwrap_or("response_format");
                Err(ApiError::bad(param, format!("`{param}` could not be followed after {generated} tokens: {e}")))
            }
            JobEvent::Error(e) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e)),
            // taken by `collect` and `stream` before they apply events
            JobEvent::PromptLogprobs(_) => Ok(None),
        }
    }

    fn logprobs_of(&self, c: &ChoiceText, from: usize) -> Value {
        if self.g.logprobs.is_none() {
            return Value::Null;
        }
        let entries = &c.logprobs[from.min(c.logprobs.len())..];
        match self.g.kind {
            Kind::Chat => response::chat_logprobs(&self.app.tok, entries),
            Kind::Completion => response::completion_logprobs(&self.app.tok, entries, 0),
        }
    }

    /// `echo`: the prompt's text and the choice's; with logprobs, the prompt's tokens first (the
    /// first with no logprob), then the choice's, in the legacy completion form.
    fn echoed(&self, c: &ChoiceText, scored: Option<&[kvdecode::Sampled]>) -> (String, Value) {
        let tok = &self.app.tok;
        let prompt_text = tok.decode(&self.g.prompt, false).unwrap_or_default();
        let text = format!("{prompt_text}{}", c.text);
        let Some(scored) = scored.filter(|_| self.g.logprobs.is_some()) else { return (text, Value::Null) };
        let first = self.g.prompt[..1.min(self.g.prompt.len())].to_vec();
        let head = tok.decode(&first, false).unwrap_or_default();
        let prompt = response::completion_logprobs(tok, scored, head.len());
        let answer = response::completion_logprobs(tok, &c.logprobs, prompt_text.len());
        let mut lp = json!({"tokens": [head], "token_logprobs": [null], "top_logprobs": [null], "text_offset": [0], "kept": [null]});
        for part in [prompt, answer] {
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset", "kept"] {
                if let (Some(all), Some(more)) = (lp[key].as_array_mut(), part[key].as_array()) {
                    all.extend(more.iter().cloned());
                }
            }
        }
        (text, lp)
    }

    /// A finished chat choice's message and finish reason: with tools, the calls it makes.
    fn message(&self, i: usize, c: &ChoiceText) -> (Value, Value) {
        if !self.g.parses_tool_calls() {
            return (json!({"role": "assistant", "content": c.text}), json!(c.finish));
        }
        let (content, calls) = response::split_tool_calls(&c.text, &format!("{}-{i}", self.id));
        let content = if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) };
        if calls.is_empty() {
            (json!({"role": "assistant", "content": content}), json!(c.finish))
        } else {
            (json!({"role": "assistant", "content": content, "tool_calls": calls}), json!("tool_calls"))
        }
    }

    pub(super) async fn collect(
        self,
        mut rx: mpsc::UnboundedReceiver<JobEvent>,
    ) -> std::result::Result<Response, ApiError> {
        let n = self.g.samplers.len();
        let mut choices: Vec<ChoiceText> = (0..n).map(|_| ChoiceText::default()).collect();
        let mut done = vec![false; n];
        let mut generated = 0;
        let mut scored = None;
        while done.iter().any(|d| !d) {
            let Some(ev) = rx.recv().await else {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request"));
            };
            if let JobEvent::PromptLogprobs(p) = &ev {
                scored = Some(p.clone());
            }
            let is_done = matches!(ev, JobEvent::Done { .. });
            if let Some((i, _, _)) = self.apply(&mut choices, &mut generated, ev)? {
                done[i] |= is_done;
            }
        }
        let list: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut choice = match self.g.kind {
                    Kind::Chat => {
                        let (message, finish) = self.message(i, c);
                        json!({"index": i, "message": message, "logprobs": self.logprobs_of(c, 0), "finish_reason": finish})
                    }
                    Kind::Completion if self.g.echo => {
                        let (text, logprobs) = self.echoed(c, scored.as_deref());
                        json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish})
                    }
                    Kind::Completion => json!({
                        "index": i, "text": c.text, "logprobs": self.logprobs_of(c, 0), "finish_reason": c.finish,
                    }),
                };
                self.add_routes(&mut choice, c);
                if self.g.return_token_ids {
                    choice["token_ids"] = json!(c.tokens);
                }
                choice
            })
            .collect();
        self.app.metrics.ok.inc();
        let mut v = json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model(),
            "choices": list, "usage": self.usage(generated),
        });
        if self.g.return_token_ids {
            v["prompt_token_ids"] = json!(self.g.prompt);
        }
        if let Some(p) = scored.filter(|_| self.g.prompt_logprobs.is_some() && !self.g.echo) {
            v["prompt_logprobs"] = response::prompt_logprobs(&self.app.tok, &p);
        }
        self.stamp(&mut v, &choices);
        Ok(Json(v).into_response())
    }

    /// With `return_routed_experts`: the choice's `routed_experts`, `[tokens][MoE layers][top_k]`
    /// for every token that went through the model (the prompt and the completion but its last).
    fn add_routes(&self, choice: &mut Value, c: &ChoiceText) {
        if let (true, Some((layers, k)), Some(routes)) = (self.g.return_routes, self.app.limits.routes, &c.routes) {
            let per_token: Vec<Vec<&[u32]>> = routes.chunks(layers * k).map(|t| t.chunks(k).collect()).collect();
            choice["routed_experts"] = json!(per_token);
        }
    }

    /// With `return_token_ids`: the choice's ids not sent yet (from `sent` on) as the chunk's
    /// `token_ids`.
    fn add_ids(&self, choice: &mut Value, c: &ChoiceText, sent: &mut usize) {
        if self.g.return_token_ids {
            choice["token_ids"] = json!(c.tokens[(*sent).min(c.tokens.len())..]);
            *sent = c.tokens.len();
        }
    }

    /// One server-sent event; `of` is the choices so far (its versions stamp the chunk).
    fn chunk(&self, choices: Value, usage: Option<Value>, of: &[ChoiceText], first: &mut First) -> SseEvent {
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model(),
            "choices": choices,
        });
        // with `return_token_ids`, the prompt's ids come once, in the first chunk, as do
        // `prompt_logprobs`
        if std::mem::take(&mut first.pending) && self.g.return_token_ids {
            v["prompt_token_ids"] = json!(self.g.prompt);
        }
        if let Some(p) = first.prompt_logprobs.take() {
            v["prompt_logprobs"] = p;
        }
        self.stamp(&mut v, of);
        if self.g.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(v.to_string())
    }

    /// Server-sent events: a first chunk per choice (chat: the role), text deltas as they are
    /// released, a last chunk per choice with its finish reason, the usage chunk if asked, and
    /// `[DONE]`. The events are produced by a task; if the client goes away the task's sends
    /// fail, it drops the job's receiver and the engine cancels the generation.
    pub(super) fn stream(self, mut rx: mpsc::UnboundedReceiver<JobEvent>) -> Response {
        let (sse_tx, sse_rx) = mpsc::channel::<std::result::Result<SseEvent, std::convert::Infallible>>(64);
        tokio::spawn(async move {
            let n = self.g.samplers.len();
            let mut choices: Vec<ChoiceText> = (0..n).map(|_| ChoiceText::default()).collect();
            let mut sent_lp = vec![0usize; n];
            // with `return_token_ids`: each choice's ids ride on its chunks, those not sent yet
            let mut sent_ids = vec![0usize; n];
            let mut first = First { pending: true, prompt_logprobs: None };
            let mut done = vec![false; n];
            let mut generated = 0;
            // prompt logprobs come first (or an error in their place): they ride on the first chunk
            let mut early = None;
            if self.g.prompt_logprobs.is_some() {
                match rx.recv().await {
                    Some(JobEvent::PromptLogprobs(p)) => {
                        first.prompt_logprobs = Some(response::prompt_logprobs(&self.app.tok, &p))
                    }
                    Some(ev) => early = Some(ev),
                    None => return,
                }
            }
            if self.g.kind == Kind::Chat {
                for i in 0..n {
                    let c = json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                    if sse_tx.send(Ok(self.chunk(c, None, &choices, &mut first))).await.is_err() {
                        return;
                    }
                }
            }
            while done.iter().any(|d| !d) {
                let ev = match early.take() {
                    Some(ev) => ev,
                    None => match rx.recv().await {
                        Some(ev) => ev,
                        None => return,
                    },
                };
                let is_done = matches!(ev, JobEvent::Done { .. });
                let (i, text, finished) = match self.apply(&mut choices, &mut generated, ev) {
                    Ok(Some(x)) => x,
                    Ok(None) => continue,
                    Err(e) => {
                        self.app.metrics.count_error(e.status);
                        let _ = sse_tx.send(Ok(SseEvent::default().data(e.body().to_string()))).await;
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
                        let mut delta = json!({"index": i, "delta": message, "logprobs": lp, "finish_reason": null});
                        self.add_ids(&mut delta, c, &mut sent_ids[i]);
                        let delta = json!([delta]);
                        let last = json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": finish}]);
                        for ch in [delta, last] {
                            if sse_tx.send(Ok(self.chunk(ch, None, &choices, &mut first))).await.is_err() {
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
                    let mut delta = match self.g.kind {
                        Kind::Chat => {
                            json!({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
                        }
                        Kind::Completion => json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null}),
                    };
                    self.add_ids(&mut delta, c, &mut sent_ids[i]);
                    let delta = json!([delta]);
                    if sse_tx.send(Ok(self.chunk(delta, None, &choices, &mut first))).await.is_err() {
                        return;
                    }
                }
                if finished {
                    let mut last = match self.g.kind {
                        Kind::Chat => json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": c.finish}),
                        Kind::Completion => {
                            json!({"index": i, "text": "", "logprobs": null, "finish_reason": c.finish})
                        }
                    };
                    self.add_routes(&mut last, c);
                    self.add_ids(&mut last, c, &mut sent_ids[i]);
                    let last = json!([last]);
                    if sse_tx.send(Ok(self.chunk(last, None, &choices, &mut first))).await.is_err() {
                        return;
                    }
                }
            }
            if self.g.include_usage {
                let u = self.usage(generated);
                if sse_tx.send(Ok(self.chunk(json!([]), Some(u), &choices, &mut first))).await.is_err() {
                    return;
                }
            }
            self.app.metrics.ok.inc();
            let _ = sse_tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        });
        Sse::new(tokio_stream::wrappers::ReceiverStream::new(sse_rx)).keep_alive(KeepAlive::default()).into_response()
    }
}
