//! OpenAI requests: strict parsing of `/v1/completions` and `/v1/chat/completions` bodies into
//! one [`Gen`] (every field checked, a parameter the server cannot honour is a 400 that names
//! it), and errors in OpenAI's JSON shape. What goes back is shaped in `response.rs`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvdecode::io::tokenizer::{Message, Tokenizer};
use kvdecode::{ConstraintFactory, LogprobMode, Sampler, TOP_LOGPROBS_MAX};
use serde_json::{json, Map, Value};

use super::guide;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: (!param.is_empty()).then(|| param.to_string()),
            retry_after: None,
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, retry_after: None }
    }

    /// OpenAI's error object, as a response body or a stream's error event.
    pub fn body(&self) -> Value {
        let kind = match self.status.as_u16() {
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": null}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Which endpoint a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// A validated generation request, whichever endpoint it came from.
pub struct Gen {
    pub kind: Kind,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub samplers: Vec<Sampler>,
    pub stop_strings: Vec<String>,
    pub stop_ids: Vec<u32>,
    pub logit_bias: Vec<(u32, f32)>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Report logprobs, with this many alternatives per token.
    pub logprobs: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    /// Constrained decoding (`response_format` json_object / json_schema, a forced tool call).
    pub constraint: Option<ConstraintFactory>,
    /// The parameter that asked for it (`response_format`, `structured_outputs` or `tools`).
    pub constrained_by: Option<&'static str>,
    /// Tools the model may call: its output is parsed for calls.
    pub tools: Option<Tools>,
    /// Return each choice's `routed_experts` (a mixture of experts served with
    /// `--enable-return-routed-experts`).
    pub return_routes: bool,
    /// `return_token_ids`: the prompt's ids and each choice's, so a multi-turn client never
    /// tokenizes text again.
    pub return_token_ids: bool,
    /// `prompt_logprobs` (vLLM's): every prompt token's logprob after the first, as a draw there
    /// would report it, with this many alternatives.
    pub prompt_logprobs: Option<u32>,
    /// Completions' `echo`: the prompt's text leads each choice's text (and with `logprobs`, its
    /// tokens lead the logprobs, the first with none).
    pub echo: bool,
    /// The request's `model`: a LoRA adapter's name picks it ([`super::lora::adapter_for`]).
    pub model: Option<String>,
}

/// The function tools of a chat request.
pub struct Tools {
    /// OpenAI's `tools` list, as the chat template takes it.
    pub list: Value,
    /// A Lark grammar for the call, when `tool_choice` requires one (or names one).
    pub forced: Option<String>,
    /// Look for calls in the reply (not with `tool_choice` none).
    pub parse: bool,
}

impl Gen {
    /// Whether replies are parsed for tool calls (they are then sent whole, not streamed piece
    /// by piece, and special tokens such as `<tool_call>` stay in the text).
    pub fn parses_tool_calls(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.parse)
    }
}

/// The markers a Hermes-style template (Qwen's, and most that take tools) puts around a call.
pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

fn parse_tools(tools: Option<Value>, choice: Option<Value>, tok: &Tokenizer) -> Result<Option<Tools>, ApiError> {
    let list = match tools {
        None => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::bad("tools", format!("`tools` must be an array, got {v}"))),
    };
    let mut named = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let f = t.get("function").filter(|_| t.get("type").and_then(Value::as_str) == Some("function"));
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str).filter(|n| !n.is_empty());
        let Some(name) = name else {
            return Err(ApiError::bad(
                "tools",
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        };
        let params = f.and_then(|f| f.get("parameters")).cloned().unwrap_or(json!({"type": "object"}));
        if !params.is_object() {
            return Err(ApiError::bad("tools", format!("tools[{i}].function.parameters must be a JSON schema object")));
        }
        named.push((name.to_string(), params));
    }
    let choice = match choice {
        None => {
            if named.is_empty() {
                "none".to_string()
            } else {
                "auto".to_string()
            }
        }
        Some(Value::String(s)) if ["none", "auto", "required"].contains(&s.as_str()) => s,
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(n) if named.iter().any(|(m, _)| m == n) => format!("function:{n}"),
            Some(n) => {
                return Err(ApiError::bad("tool_choice", format!("`tool_choice` names {n:?}, which is not in `tools`")))
            }
            None => {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("`tool_choice` must be none, auto, required or a named function, got {v}"),
                ))
            }
        },
    };
    if named.is_empty() {
        if choice != "none" && choice != "auto" {
            return Err(ApiError::bad("tool_choice", "`tool_choice` requires `tools`"));
        }
        return Ok(None);
    }
    if !tok.template_takes_tools() {
        return Err(ApiError::bad("tools", "this model's chat template does not take tools"));
    }
    // a required or named call: `<tool_call>` JSON `</tool_call>`, the JSON one call of one of
    // the allowed tools (special tokens are written as such when the vocabulary has them)
    let forced = match choice.as_str() {
        "none" | "auto" => None,
        c => {
            let allowed: Vec<&(String, Value)> =
                named.iter().filter(|(n, _)| c == "required" || c == format!("function:{n}")).collect();
            let calls: Vec<Value> = allowed
                .iter()
                .map(|(n, p)| {
                    json!({"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                                     "required": ["name", "arguments"], "additionalProperties": false})
                })
                .collect();
            let mut schema = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
            // compact JSON, as for response_format
            schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
            let marker = |m: &str| {
                if tok.token_id(m).is_some() {
                    m.to_string()
                } else {
                    serde_json::to_string(m).unwrap_or_default()
                }
            };
            Some(format!(
                "start: {} \"\\n\" call \"\\n\" {}\ncall: %json {}\n",
                marker(CALL_OPEN),
                marker(CALL_CLOSE),
                schema
            ))
        }
    };
    Ok(Some(Tools { list: Value::Array(list), forced, parse: choice != "none" }))
}

/// What the server's limits allow a request.
pub struct Limits {
    /// Tokens per cache row: prompt + completion must fit.
    pub max_len: usize,
    /// Most completions (`n`) in one request: the rows of the engine.
    pub max_n: usize,
    /// Largest `max_tokens` accepted.
    pub max_tokens: usize,
    /// `(MoE layers, top_k)` when the engine keeps routes (`--enable-return-routed-experts`).
    pub routes: Option<(usize, usize)>,
    /// The engine's logit-bias slots per row: `logit_bias` entries, plus one per distinct
    /// generated token when a penalty is on. The server sizes them so that every request within
    /// the other limits fits ([`bias_slots`]).
    pub bias_slots: usize,
    /// The logprobs mode of requests that name none (`--logprobs-mode`).
    pub logprobs_mode: LogprobMode,
}

/// Longest `stop` string, in bytes (each is matched against the text's tail at every token).
pub const STOP_MAX_BYTES: usize = 8192;

/// Most entries of a request's `logit_bias` object.
pub const LOGIT_BIAS_MAX: usize = 1024;

/// Logit-bias slots per row for requests of up to `max_tokens` tokens: a full `logit_bias`
/// object, plus a penalty entry for every token the request may generate.
pub fn bias_slots(max_tokens: usize, vocab: usize) -> usize {
    LOGIT_BIAS_MAX + max_tokens.min(vocab)
}

/// Fields accepted and ignored: they inform, they do not change generation.
const INFORMATIONAL: &[&str] = &["model", "user", "metadata", "store", "service_tier", "stream_options"];

/// A JSON object whose fields are taken one by one; what is left at the end is an error.
struct Fields(Map<String, Value>);

impl Fields {
    /// A request body's fields: it must be a JSON object.
    fn of(body: &[u8]) -> Result<Self, ApiError> {
        let v: Value =
            serde_json::from_slice(body).map_err(|e| ApiError::bad("", format!("the body is not valid JSON: {e}")))?;
        match v {
            Value::Object(map) => Ok(Fields(map)),
            _ => Err(ApiError::bad("", "the body must be a JSON object")),
        }
    }

    fn take(&mut self, k: &str) -> Option<Value> {
        self.0.remove(k).filter(|v| !v.is_null())
    }

    fn f32(&mut self, k: &str, default: f32, lo: f32, hi: f32) -> Result<f32, ApiError> {
        match self.take(k) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if (lo as f64..=hi as f64).contains(&x) => Ok(x as f32),
                _ => Err(ApiError::bad(k, format!("`{k}` must be a number in [{lo}, {hi}], got {v}"))),
            },
        }
    }

    fn uint(&mut self, k: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(ApiError::bad(k, format!("`{k}` must be an integer in [{lo}, {hi}], got {v}"))),
            },
        }
    }

    fn bool(&mut self, k: &str) -> Result<bool, ApiError> {
        match self.take(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(v) => Err(ApiError::bad(k, format!("`{k}` must be a boolean, got {v}"))),
        }
    }

    /// Whatever is left: informational fields are fine, anything else is refused by name.
    fn finish(self, unsupported: &[&str]) -> Result<(), ApiError> {
        for k in self.0.keys() {
            if INFORMATIONAL.contains(&k.as_str()) {
                continue;
            }
            let msg = if unsupported.contains(&k.as_str()) {
                format!("`{k}` is not supported by this server")
            } else {
                format!("Unrecognized request argument supplied: {k}")
            };
            return Err(ApiError::bad(k, msg));
        }
        Ok(())
    }
}

/// Parse the body of a request to `kind`'s endpoint.
pub fn parse(
    body: &[u8],
    kind: Kind,
    tok: &Tokenizer,
    guide: &Result<guide::Guide, String>,
    limits: &Limits,
    seed_source: u64,
) -> Result<Gen, ApiError> {
    let mut f = Fields::of(body)?;
    let include_usage = match f.0.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::bad("stream_options", format!("`include_usage` must be a boolean, got {v}")))
            }
        },
        Some(v) => return Err(ApiError::bad("stream_options", format!("`stream_options` must be an object, got {v}"))),
    };
    let stream = f.bool("stream")?;
    let return_routes = f.bool("return_routed_experts")?;
    let return_token_ids = f.bool("return_token_ids")?;
    let prompt_logprobs = f.uint("prompt_logprobs", 0, TOP_LOGPROBS_MAX as u64)?.map(|k| k as u32);
    let model = f.0.get("model").and_then(Value::as_str).map(str::to_string);
    if return_routes && limits.routes.is_none() {
        return Err(ApiError::bad(
            "return_routed_experts",
            "`return_routed_experts` needs a mixture-of-experts model served with --enable-return-routed-experts",
        ));
    }
    if include_usage && !stream {
        return Err(ApiError::bad("stream_options", "`stream_options` is only allowed when `stream` is true"));
    }
    // the prompt
    let mut tools: Option<Tools> = None;
    let mut echo = false;
    let (prompt, stop_ids) = match kind {
        Kind::Chat => {
            let msgs = messages(f.take("messages"))?;
            tools = parse_tools(f.take("tools"), f.take("tool_choice"), tok)?;
            let text = tok
                .apply_chat_template_with_tools(&msgs, tools.as_ref().map(|t| &t.list), true)
                .map_err(|e| ApiError::bad("messages", format!("the model's chat template failed: {e}")))?;
            let ids = tok.encode_rendered(&text).map_err(|e| ApiError::bad("messages", e.to_string()))?;
            (ids, tok.end_of_turn())
        }
        Kind::Completion => {
            let ids = completion_prompt(f.take("prompt"), tok)?;
            echo = f.bool("echo")?;
            if let Some(b) = f.uint("best_of", 0, u64::MAX)? {
                if b != 1 {
                    return Err(ApiError::bad("best_of", "`best_of` other than 1 is not supported by this server"));
                }
            }
            (ids, tok.eos.into_iter().collect())
        }
    };
    // structured output: a JSON schema, a grammar, a regex or a choice compiled by llguidance
    // (an invalid one is a 400); a required or named tool call is the same mechanism
    let asked = [
        ("response_format", f.take("response_format").map(guide::response_format).transpose()?.flatten()),
        ("structured_outputs", f.take("structured_outputs").map(guide::structured_outputs).transpose()?),
        ("tools", tools.as_ref().and_then(|t| t.forced.clone()).map(guide::Wanted::Lark)),
    ];
    let mut asked = asked.into_iter().filter_map(|(p, w)| Some(p).zip(w));
    let mut constrained_by = None;
    let constraint = match (asked.next(), asked.next()) {
        (Some((a, _)), Some((b, _))) => return Err(ApiError::bad(b, format!("`{a}` and `{b}` exclude each other"))),
        (Some((p, wanted)), None) => {
            let guide = guide
                .as_ref()
                .map_err(|e| ApiError::bad(p, format!("constrained decoding is not available for this model: {e}")))?;
            constrained_by = Some(p);
            let what = match p {
                "tools" => "the tools' parameters were",
                "response_format" => "the JSON schema was",
                _ => "the constraint was",
            };
            Some(
                guide
                    .compile(wanted, stop_ids.clone())
                    .map_err(|e| ApiError::bad(p, format!("{what} refused: {e}")))?,
            )
        }
        _ => None,
    };
    if prompt.is_empty() {
        return Err(ApiError::bad(if kind == Kind::Chat { "messages" } else { "prompt" }, "the prompt is empty"));
    }
    if prompt.len() >= limits.max_len {
        return Err(ApiError::bad(
            if kind == Kind::Chat { "messages" } else { "prompt" },
            format!(
                "the prompt is {} tokens; this server's rows hold {} tokens, prompt and completion together",
                prompt.len(),
                limits.max_len
            ),
        ));
    }
    // how much to generate
    let room = limits.max_len - prompt.len();
    let mut max_tokens = f.uint("max_tokens", 1, u64::MAX)?;
    if let Some(m) = f.uint("max_completion_tokens", 1, u64::MAX)? {
        max_tokens = Some(m);
    }
    let max_tokens = match max_tokens {
        Some(m) if m as usize > limits.max_tokens || m as usize > room => {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "`max_tokens` {m} is more than this request can have: {} tokens fit after the {}-token prompt (limit {})",
                    room.min(limits.max_tokens),
                    prompt.len(),
                    limits.max_tokens
                ),
            ))
        }
        Some(m) => m as usize,
        // OpenAI's defaults: 16 for completions, the rest of the context for chat
        None if kind == Kind::Completion => 16.min(room),
        None => room.min(limits.max_tokens),
    };
    // sampling
    let temperature = f.f32("temperature", 1.0, 0.0, 2.0)?;
    let top_p = f.f32("top_p", 1.0, 0.0, 1.0)?;
    if top_p <= 0.0 {
        return Err(ApiError::bad("top_p", "`top_p` must be greater than 0"));
    }
    let top_k = f.uint("top_k", 0, u32::MAX as u64)?.unwrap_or(0) as u32;
    let min_p = f.f32("min_p", 0.0, 0.0, 1.0)?;
    let logprobs_mode = match f.take("logprobs_mode") {
        None => limits.logprobs_mode,
        Some(Value::String(s)) => LogprobMode::parse(&s).map_err(|_| {
            ApiError::bad("logprobs_mode", format!("`logprobs_mode` {s:?} is not one of raw, scaled, processed"))
        })?,
        Some(v) => return Err(ApiError::bad("logprobs_mode", format!("`logprobs_mode` must be a string, got {v}"))),
    };
    let n = f.uint("n", 1, limits.max_n as u64)?.unwrap_or(1) as usize;
    let seed = f.take("seed").map(|v| match v.as_i64() {
        Some(s) => Ok(s as u64),
        None => Err(ApiError::bad("seed", format!("`seed` must be an integer, got {v}"))),
    });
    let seed = match seed {
        Some(s) => s?,
        None => seed_source,
    };
    let presence_penalty = f.f32("presence_penalty", 0.0, -2.0, 2.0)?;
    let frequency_penalty = f.f32("frequency_penalty", 0.0, -2.0, 2.0)?;
    let logprobs = match kind {
        Kind::Chat => {
            let on = f.bool("logprobs")?;
            let top = f.uint("top_logprobs", 0, TOP_LOGPROBS_MAX as u64)?;
            if top.is_some() && !on {
                return Err(ApiError::bad("top_logprobs", "`top_logprobs` needs `logprobs` set to true"));
            }
            on.then(|| top.unwrap_or(0) as u32)
        }
        Kind::Completion => f.uint("logprobs", 0, TOP_LOGPROBS_MAX as u64)?.map(|k| k as u32),
    };
    let logit_bias = match f.take("logit_bias") {
        None => Vec::new(),
        Some(Value::Object(o)) if o.len() > LOGIT_BIAS_MAX => {
            return Err(ApiError::bad(
                "logit_bias",
                format!("`logit_bias` has {} entries, more than the limit of {LOGIT_BIAS_MAX}", o.len()),
            ))
        }
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| {
                let t: u32 = k.parse().ok().filter(|&t: &u32| (t as usize) < tok.vocab_size()).ok_or_else(|| {
                    ApiError::bad("logit_bias", format!("`logit_bias` key {k:?} is not a token id of this model"))
                })?;
                let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                    ApiError::bad("logit_bias", format!("`logit_bias` value for {k} must be in [-100, 100], got {v}"))
                })?;
                Ok((t, b as f32))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(ApiError::bad("logit_bias", format!("`logit_bias` must be an object, got {v}"))),
    };
    // a penalty takes a bias slot per distinct generated token: refuse here what the engine would
    // (the server sizes the slots so that this holds for every request within the other limits)
    let penalized =
        if presence_penalty != 0.0 || frequency_penalty != 0.0 { max_tokens.min(tok.vocab_size()) } else { 0 };
    if logit_bias.len() + penalized > limits.bias_slots {
        let param = if presence_penalty != 0.0 { "presence_penalty" } else { "logit_bias" };
        return Err(ApiError::bad(
            param,
            format!(
                "{} `logit_bias` entries plus {penalized} penalized tokens need more than the {} bias slots a row has",
                logit_bias.len(),
                limits.bias_slots
            ),
        ));
    }
    let stop_strings = match f.take("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => {
            a.into_iter().filter_map(|s| s.as_str().map(str::to_string)).collect()
        }
        Some(v) => return Err(ApiError::bad("stop", format!("`stop` must be a string or up to 4 strings, got {v}"))),
    };
    if stop_strings.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop", "`stop` strings must not be empty"));
    }
    if let Some(s) = stop_strings.iter().find(|s| s.len() > STOP_MAX_BYTES) {
        return Err(ApiError::bad(
            "stop",
            format!("a `stop` string of {} bytes is longer than the limit of {STOP_MAX_BYTES}", s.len()),
        ));
    }
    const UNSUPPORTED: &[&str] = &[
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "suffix",
        "parallel_tool_calls",
    ];
    f.finish(UNSUPPORTED)?;
    let samplers = (0..n)
        .map(|i| Sampler {
            temperature,
            seed: (seed as u32).wrapping_add(i as u32),
            top_k,
            top_p,
            min_p,
            logprobs: logprobs_mode,
            top_logprobs: logprobs.unwrap_or(0),
        })
        .collect();
    if echo && stream {
        return Err(ApiError::bad("echo", "`echo` with `stream` is not supported by this server"));
    }
    Ok(Gen {
        kind,
        prompt,
        max_tokens,
        samplers,
        stop_strings,
        stop_ids,
        logit_bias,
        presence_penalty,
        frequency_penalty,
        logprobs,
        stream,
        include_usage,
        constraint,
        constrained_by,
        tools,
        return_routes,
        return_token_ids,
        // `echo` with `logprobs`: the prompt's tokens lead the logprobs, scored as `prompt_logprobs`
        prompt_logprobs: prompt_logprobs.or(logprobs.filter(|_| echo)),
        echo,
        model,
    })
}

fn messages(v: Option<Value>) -> Result<Vec<Message>, ApiError> {
    let Some(Value::Array(a)) = v else {
        return Err(ApiError::bad("messages", "`messages` must be a non-empty array"));
    };
    if a.is_empty() {
        return Err(ApiError::bad("messages", "`messages` must be a non-empty array"));
    }
    a.iter()
        .enumerate()
        .map(|(i, m)| {
            let p = format!("messages[{i}]");
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(&p, format!("{p} needs a `role`")))?;
            let role = match role {
                "system" | "user" | "assistant" | "tool" => role,
                "developer" => "system",
                other => return Err(ApiError::bad(&p, format!("{p}: unknown role {other:?}"))),
            };
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::bad(
                                    &p,
                                    format!("{p}: only text content parts are supported, got {part}"),
                                ))
                            }
                        }
                    }
                    text
                }
                Some(other) => {
                    return Err(ApiError::bad(&p, format!("{p}: `content` must be a string or parts, got {other}")))
                }
            };
            if let Some(k) = ["function_call", "audio"].iter().find(|k| m.get(**k).is_some_and(|v| !v.is_null())) {
                return Err(ApiError::bad(&p, format!("{p}: `{k}` is not supported by this server")));
            }
            let mut msg = Message::new(role, &content);
            msg.tool_calls = m.get("tool_calls").filter(|v| !v.is_null()).cloned();
            if msg.tool_calls.as_ref().is_some_and(|c| !c.is_array()) {
                return Err(ApiError::bad(&p, format!("{p}: `tool_calls` must be an array")));
            }
            msg.tool_call_id = m.get("tool_call_id").and_then(Value::as_str).map(str::to_string);
            Ok(msg)
        })
        .collect()
}

fn completion_prompt(v: Option<Value>, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|x| x.as_u64().filter(|&t| (t as usize) < tok.vocab_size()).map(|t| t as u32)).collect()
    };
    match v {
        Some(Value::String(s)) => tok.encode(&s).map_err(|e| ApiError::bad("prompt", e.to_string())),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => ids(&a)
            .ok_or_else(|| ApiError::bad("prompt", "`prompt` token ids must be integers below the vocabulary size")),
        Some(Value::Array(a)) if a.len() == 1 => completion_prompt(a.into_iter().next(), tok),
        Some(Value::Array(_)) => {
            Err(ApiError::bad("prompt", "several prompts in one request are not supported; send one per request"))
        }
        _ => Err(ApiError::bad("prompt", "`prompt` must be a string or an array of token ids")),
    }
}

/// `POST /tokenize`: `{"prompt": ...}` encoded as a completion's prompt is, or `{"messages":
/// [...], "tools": [...]}` rendered as a chat completion's prompt is (the chat template with the
/// assistant's turn opened, unless `"add_generation_prompt": false`); the ids that request would
/// decode from.
pub fn tokenize(body: &[u8], tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let mut f = Fields::of(body)?;
    let ids = match (f.take("messages"), f.take("prompt")) {
        (Some(m), None) => {
            let msgs = messages(Some(m))?;
            let tools = parse_tools(f.take("tools"), None, tok)?;
            let open_turn = !matches!(f.take("add_generation_prompt"), Some(Value::Bool(false)));
            let text = tok
                .apply_chat_template_with_tools(&msgs, tools.as_ref().map(|t| &t.list), open_turn)
                .map_err(|e| ApiError::bad("messages", format!("the model's chat template failed: {e}")))?;
            tok.encode_rendered(&text).map_err(|e| ApiError::bad("messages", e.to_string()))?
        }
        (None, Some(p)) => completion_prompt(Some(p), tok)?,
        _ => return Err(ApiError::bad("", "give `messages` or `prompt` (one of them)")),
    };
    f.finish(&[])?;
    Ok(ids)
}

/// `POST /detokenize`: `{"tokens": [...], "skip_special_tokens": false}` -> their text.
pub fn detokenize(body: &[u8], tok: &Tokenizer) -> Result<String, ApiError> {
    let mut f = Fields::of(body)?;
    let ids: Vec<u32> = match f.take("tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().filter(|&t| (t as usize) < tok.vocab_size()).map(|t| t as u32))
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::bad("tokens", "`tokens` must be token ids below the vocabulary size"))?,
        _ => return Err(ApiError::bad("tokens", "`tokens` (an array of token ids) is required")),
    };
    let skip = f.bool("skip_special_tokens")?;
    f.finish(&[])?;
    tok.decode(&ids, skip).map_err(|e| ApiError::bad("tokens", e.to_string()))
}
