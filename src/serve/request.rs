//! What a [`crate::Scheduler`] takes and gives: a [`Request`] (also parsed from a JSON line),
//! the [`Event`]s it streams while it runs and the [`Completion`] each request ends with.

use std::sync::Arc;
use std::time::Duration;

use crate::engine::sampling::{LogprobMode, Sampler};
use crate::error::{Error, Result};

/// One generation request.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub tokens: Vec<u32>,
    /// Most tokens to generate (at least 1: a request for no token is refused at submit).
    pub max_new: usize,
    /// Token ids that end the generation (returned, and not appended).
    pub stop: Vec<u32>,
    /// How to pick tokens (greedy, temperature + seed, top-k, top-p, top logprobs).
    pub sampler: Sampler,
    /// Added to the logits before every draw (OpenAI's `logit_bias`: token, bias).
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted from a token's logit once it has been generated (OpenAI's `presence_penalty`).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it has been generated
    /// (OpenAI's `frequency_penalty`).
    pub frequency_penalty: f32,
    /// Constrained decoding: which tokens may come next (a JSON schema, a grammar), applied by
    /// the GPU sampler to this request's row only. Each request of a group gets its own.
    pub constraint: Option<ConstraintFactory>,
    /// Return the experts every token was routed to ([`Completion::routes`]; a mixture of
    /// experts on an engine built with [`crate::EngineOptions::record_routes`]).
    pub return_routes: bool,
    /// The LoRA adapter the request decodes with ([`crate::Engine::load_lora`]), by name;
    /// `None`: the base model. It must stay loaded while the request is queued or runs
    /// ([`crate::Scheduler::uses_adapter`]).
    pub adapter: Option<String>,
}

/// Constrained decoding for one request: before each token the scheduler asks which tokens may
/// come next (a bitmask the GPU sampler applies to the request's row only) and afterwards says
/// which one came. `kvdecode serve` implements it with llguidance for JSON schemas; anything that
/// answers these two questions works.
pub trait TokenConstraint: Send {
    /// Write the tokens allowed next into `mask` (`ceil(vocab / 32)` words, bit `i % 32` of word
    /// `i / 32` for token `i`, all zero on entry). An error ends the request, with its message.
    fn allowed(&mut self, mask: &mut [u32]) -> Result<()>;
    /// `token` was sampled.
    fn consume(&mut self, token: u32) -> Result<()>;
}

/// Makes a fresh [`TokenConstraint`] for each request that uses it.
#[derive(Clone)]
pub struct ConstraintFactory(pub Arc<dyn Fn() -> Box<dyn TokenConstraint> + Send + Sync>);

impl std::fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintFactory")
    }
}

impl Request {
    pub(crate) fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A request as one JSON object (one line of a JSONL file), before tokenization.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    tokens: Option<Vec<u32>>,
    text: Option<String>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<u32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    logprobs_mode: Option<String>,
    seed: Option<u32>,
    stop: Option<Vec<u32>>,
}

impl Request {
    /// Most bytes of one JSON request line (a prompt of a million tokens is longer than any row).
    pub const MAX_JSON_BYTES: usize = 16 << 20;

    /// Parse one request from a JSON object (a line of a JSONL file):
    /// `{"tokens": [ids]}` or `{"text": "..."}` (tokenized with `tok`), and optionally
    /// `"max_tokens"` (default 32), `"temperature"` (0, the default, is greedy), `"top_k"`,
    /// `"top_p"`, `"min_p"`, `"logprobs_mode"` (`raw`, `scaled`, `processed`), `"seed"`, `"stop"`
    /// (token ids). Untrusted input: wrong types, unknown keys,
    /// text without a tokenizer and bad sampler values are errors that name the field.
    pub fn from_json(line: &str, tok: Option<&crate::io::tokenizer::Tokenizer>) -> Result<Request> {
        if line.len() > Self::MAX_JSON_BYTES {
            return Err(Error::Input(format!(
                "request of {} bytes is larger than the {} accepted",
                line.len(),
                Self::MAX_JSON_BYTES
            )));
        }
        let j: JsonRequest = serde_json::from_str(line).map_err(|e| Error::Input(format!("request: {e}")))?;
        let tokens = match (j.tokens, j.text, tok) {
            (Some(_), Some(_), _) => return Err(Error::Input("request: give \"tokens\" or \"text\", not both".into())),
            (Some(t), None, _) => t,
            (None, Some(text), Some(tok)) => tok.encode(&text)?,
            (None, Some(_), None) => {
                return Err(Error::Input(
                    "request: \"text\" needs a tokenizer, which this model does not have; give \"tokens\"".into(),
                ))
            }
            (None, None, _) => return Err(Error::Input("request: needs \"tokens\" (or \"text\")".into())),
        };
        if tokens.is_empty() {
            return Err(Error::Input("request: empty prompt".into()));
        }
        let sampler = Sampler {
            temperature: j.temperature.unwrap_or(0.0),
            seed: j.seed.unwrap_or(0),
            top_k: j.top_k.unwrap_or(0),
            top_p: j.top_p.unwrap_or(1.0),
            min_p: j.min_p.unwrap_or(0.0),
            logprobs: j.logprobs_mode.as_deref().map(LogprobMode::parse).transpose()?.unwrap_or_default(),
            top_logprobs: 0,
        };
        sampler.check(0).map_err(|e| Error::Input(format!("request: {e}")))?;
        Ok(Request {
            tokens,
            max_new: j.max_tokens.unwrap_or(32),
            stop: j.stop.unwrap_or_default(),
            sampler,
            ..Default::default()
        })
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It sampled one of its stop tokens.
    Stop,
    /// It generated `max_new` tokens.
    Length,
    /// [`Scheduler::cancel`](crate::Scheduler::cancel) ended it.
    Cancelled,
    /// Its [`TokenConstraint`] failed ([`Completion::error`] says why).
    ConstraintError,
}

/// Per-request measurements.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Scheduler steps spent in the queue before admission.
    pub queued_steps: usize,
    /// Scheduler steps from admission to the end.
    pub active_steps: usize,
    /// Time from submission to the first generated token.
    pub time_to_first_token: Duration,
    /// Time from submission to the end.
    pub total_time: Duration,
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The id [`Scheduler::submit`](crate::Scheduler::submit) returned.
    pub id: usize,
    /// Generated tokens (the stop token included when it ended on one).
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token (of the distribution [`Sampler::logprobs`] names).
    pub logprobs: Vec<f32>,
    /// Per generated token, how many tokens its draw was among ([`crate::Sampled::kept`]).
    pub kept: Vec<u32>,
    /// Per generated token, the most likely alternatives (when the sampler asks for them).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Per generated token, the weights version it was sampled under: a request in flight
    /// across an update kept with [`crate::InFlight::Keep`] has tokens of both.
    pub weights_versions: Vec<u64>,
    /// Per generated token, its adapter's version ([`crate::Engine::update_lora`]); empty on the
    /// base model.
    pub adapter_versions: Vec<u64>,
    /// Why it ended.
    pub finish: Finish,
    /// What went wrong, when `finish` is [`Finish::ConstraintError`].
    pub error: Option<String>,
    /// With [`Request::return_routes`]: the experts each token that went through the model was
    /// routed to, `[prompt + generated - 1, MoE layers, top_k]` flattened (the last generated
    /// token is returned, never fed), as [`crate::Engine::routes`] gives them.
    pub routes: Option<Vec<u32>>,
    /// Measurements.
    pub stats: RequestStats,
}

/// What the scheduler reports while it runs.
#[derive(Debug)]
pub enum Event<'a> {
    /// Request `id` generated `token`.
    Token {
        /// The request.
        id: usize,
        /// The token.
        token: u32,
        /// Its log-probability.
        logprob: f32,
        /// How many tokens its draw was among ([`crate::Sampled::kept`]).
        kept: u32,
        /// The most likely alternatives, when the request's sampler asks for them.
        top: &'a [(u32, f32)],
        /// The weights version it was sampled under.
        weights_version: u64,
        /// Its adapter's version, when the request has an adapter.
        adapter_version: Option<u64>,
    },
    /// A request finished.
    Done(&'a Completion),
}
