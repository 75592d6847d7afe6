//! Continuous batching: a queue of requests served by the cache rows of one [`Engine`]. Free rows
//! admit queued requests (reset + prefill); every step decodes all active rows, and long prompts
//! are prefilled in chunks that share steps with the decoding rows. Tokens stream through a
//! callback. A request's tokens do not depend on what else shares the batch: rows are
//! independent and chunking does not change a bit, so greedy or seeded sampling gives exactly
//! what the request gets when run alone.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::sampling::Sampler;

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub tokens: Vec<u32>,
    /// Most tokens to generate (at least 1: a request for no token is refused at submit).
    pub max_new: usize,
    /// Token ids that end the generation (returned, and not appended).
    pub stop: Vec<u32>,
    /// How to pick tokens (greedy, temperature + seed, top-k, top-p).
    pub sampler: Sampler,
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
    seed: Option<u32>,
    stop: Option<Vec<u32>>,
}

impl Request {
    /// Most bytes of one JSON request line (a prompt of a million tokens is longer than any row).
    pub const MAX_JSON_BYTES: usize = 16 << 20;

    /// Parse one request from a JSON object (a line of a JSONL file):
    /// `{"tokens": [ids]}` or `{"text": "..."}` (tokenized with `tok`), and optionally
    /// `"max_tokens"` (default 32), `"temperature"` (0, the default, is greedy), `"top_k"`,
    /// `"top_p"`, `"seed"`, `"stop"` (token ids). Untrusted input: wrong types, unknown keys,
    /// text without a tokenizer and bad sampler values are errors that name the field.
    pub fn from_json(line: &str, tok: Option<&crate::tokenizer::Tokenizer>) -> Result<Request> {
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
        };
        sampler.check(0).map_err(|e| Error::Input(format!("request: {e}")))?;
        Ok(Request { tokens, max_new: j.max_tokens.unwrap_or(32), stop: j.stop.unwrap_or_default(), sampler })
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It sampled one of its stop tokens.
    Stop,
    /// It generated `max_new` tokens.
    Length,
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
    /// The id [`Scheduler::submit`] returned.
    pub id: usize,
    /// Generated tokens (the stop token included when it ended on one).
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish: Finish,
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
    },
    /// A request finished.
    Done(&'a Completion),
}

struct Active {
    id: usize,
    req: Request,
    /// Prompt tokens already appended.
    fed: usize,
    /// The token to append next once the prompt is in (the last one generated).
    next: Option<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    submitted: Instant,
    first_token: Option<Duration>,
    queued_steps: usize,
    active_steps: usize,
}

/// The continuous-batching scheduler over an engine's rows.
pub struct Scheduler {
    queue: VecDeque<(usize, Request, Instant, usize)>,
    rows: Vec<Option<Active>>,
    next_id: usize,
    prefill_chunk: usize,
    max_len: usize,
    vocab: usize,
    steps: usize,
}

impl Scheduler {
    /// A scheduler for `engine`'s rows; prompts are prefilled `prefill_chunk` tokens per step.
    pub fn new(engine: &Engine, prefill_chunk: usize) -> Self {
        Scheduler {
            queue: VecDeque::new(),
            rows: (0..engine.cache().rows()).map(|_| None).collect(),
            next_id: 0,
            prefill_chunk: prefill_chunk.max(1),
            max_len: engine.cache().max_len(),
            vocab: engine.config().vocab,
            steps: 0,
        }
    }

    /// Queue a request; returns its id. A request that could never fit a row (prompt + max_new
    /// beyond max_len), asks for no token (`max_new` 0: the scheduler would have to prefill a row
    /// for nothing, and a sampled first token could not be withheld without special cases) or
    /// has bad tokens is refused here, so nothing fails mid-way.
    pub fn submit(&mut self, req: Request) -> Result<usize> {
        let id = self.next_id;
        if req.tokens.is_empty() {
            return Err(Error::Input(format!("request {id}: empty prompt")));
        }
        if req.max_new == 0 {
            return Err(Error::Input(format!("request {id}: max_new is 0; ask for at least one token")));
        }
        if req.tokens.len().saturating_add(req.max_new) > self.max_len {
            return Err(Error::Input(format!(
                "request {id}: prompt {} + max_new {} exceeds the rows' max_len {}",
                req.tokens.len(),
                req.max_new,
                self.max_len
            )));
        }
        if let Some((i, t)) = req.tokens.iter().enumerate().find(|(_, &t)| t as usize >= self.vocab) {
            return Err(Error::Input(format!(
                "request {id}: token {i} = {t} is outside the vocabulary ({})",
                self.vocab
            )));
        }
        req.sampler.check(0).map_err(|e| Error::Input(format!("request {id}: {e}")))?;
        self.next_id += 1;
        self.queue.push_back((id, req, Instant::now(), self.steps));
        Ok(id)
    }

    /// Requests waiting for a row.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests holding a row.
    pub fn active(&self) -> usize {
        self.rows.iter().flatten().count()
    }

    /// Tokens stored for running requests.
    pub fn used_tokens(&self, engine: &Engine) -> usize {
        self.rows.iter().enumerate().filter(|(_, a)| a.is_some()).map(|(r, _)| engine.cache().lens()[r]).sum()
    }

    /// KV positions claimed by running requests (a whole row each).
    pub fn allocated_tokens(&self) -> usize {
        self.active() * self.max_len
    }

    /// KV positions the cache holds in all.
    pub fn reserved_tokens(&self) -> usize {
        self.rows.len() * self.max_len
    }

    /// One step: admit queued requests into free rows, append one chunk for every active row
    /// (a prompt piece or the last generated token), sample, stream, release finished rows.
    /// Returns the requests that finished in this step; `false` in `.1` when there is no work.
    pub fn step(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(Event)) -> Result<(Vec<Completion>, bool)> {
        // admission: a free row is all a request needs (its fit was checked at submit)
        let mut admitted = Vec::new();
        for r in 0..self.rows.len() {
            if self.rows[r].is_some() {
                continue;
            }
            let Some((id, req, submitted, at_step)) = self.queue.pop_front() else { break };
            admitted.push(r);
            self.rows[r] = Some(Active {
                id,
                req,
                fed: 0,
                next: None,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                submitted,
                first_token: None,
                queued_steps: self.steps - at_step,
                active_steps: 0,
            });
        }
        engine.reset(&admitted)?;
        let active: Vec<usize> = (0..self.rows.len()).filter(|&r| self.rows[r].is_some()).collect();
        if active.is_empty() {
            return Ok((Vec::new(), false));
        }
        self.steps += 1;
        let chunks: Vec<Vec<u32>> = active
            .iter()
            .map(|&r| {
                let a = self.rows[r].as_ref().expect("active");
                match a.next {
                    Some(t) => vec![t],
                    None => a.req.tokens[a.fed..(a.fed + self.prefill_chunk).min(a.req.tokens.len())].to_vec(),
                }
            })
            .collect();
        let width = chunks.iter().map(Vec::len).max().unwrap_or(1);
        let mut ids = vec![0u32; active.len() * width];
        for (i, c) in chunks.iter().enumerate() {
            ids[i * width..i * width + c.len()].copy_from_slice(c);
        }
        let n_new: Vec<usize> = chunks.iter().map(Vec::len).collect();
        let samplers: Vec<Sampler> =
            active.iter().map(|&r| self.rows[r].as_ref().expect("active").req.sampler).collect();
        let sampled = engine.append_sample_logprobs(&ids, width, &n_new, Some(&active), &samplers)?;
        let mut finished = Vec::new();
        for (i, &r) in active.iter().enumerate() {
            let a = self.rows[r].as_mut().expect("active");
            a.active_steps += 1;
            if a.next.is_none() {
                a.fed += n_new[i];
                if a.fed < a.req.tokens.len() {
                    continue; // still prefilling: this step's sample is not a token yet
                }
            }
            let (token, logprob) = sampled[i].expect("every active row appended tokens");
            a.first_token.get_or_insert_with(|| a.submitted.elapsed());
            a.tokens.push(token);
            a.logprobs.push(logprob);
            on_event(Event::Token { id: a.id, token, logprob });
            let finish = if a.req.stop.contains(&token) {
                Some(Finish::Stop)
            } else if a.tokens.len() >= a.req.max_new {
                Some(Finish::Length)
            } else {
                a.next = Some(token);
                None
            };
            if let Some(finish) = finish {
                let a = self.rows[r].take().expect("active");
                let done = Completion {
                    id: a.id,
                    stats: RequestStats {
                        prompt_tokens: a.req.tokens.len(),
                        queued_steps: a.queued_steps,
                        active_steps: a.active_steps,
                        time_to_first_token: a.first_token.unwrap_or_default(),
                        total_time: a.submitted.elapsed(),
                    },
                    tokens: a.tokens,
                    logprobs: a.logprobs,
                    finish,
                };
                on_event(Event::Done(&done));
                finished.push(done);
            }
        }
        Ok((finished, true))
    }

    /// Step until every submitted request has finished; completions in id order.
    pub fn run(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(Event)) -> Result<Vec<Completion>> {
        let mut all = Vec::new();
        loop {
            let (done, more) = self.step(engine, on_event)?;
            all.extend(done);
            if !more && self.queue.is_empty() {
                break;
            }
        }
        all.sort_by_key(|c| c.id);
        Ok(all)
    }
}
