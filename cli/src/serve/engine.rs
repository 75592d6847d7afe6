//! The GPU side of the server: one thread owns the engine and the continuous-batching scheduler,
//! takes jobs from a bounded channel (the HTTP side's backpressure), and sends each job's tokens
//! back through the job's own channel. A job whose receiver is gone (its client disconnected) or
//! whose handler asked to stop a choice (a stop string matched) is cancelled at once, freeing its
//! rows for the queue. Admin commands (new weights, pause, resume, prompt-cache reset) come
//! through the same channel and are answered through their own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvdecode::io::model_file::TensorFiles;
use kvdecode::{Engine, Event, Finish, InFlight, Request, RowOwner, Sampled, Sampler, Scheduler};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::metrics::Metrics;

/// One HTTP request's generation: `samplers.len()` choices of one prompt.
pub struct Job {
    pub request: Request,
    pub samplers: Vec<Sampler>,
    /// Score the prompt first, with this many alternatives per token (`prompt_logprobs`).
    pub prompt_logprobs: Option<u32>,
    pub events: mpsc::UnboundedSender<JobEvent>,
    /// Per choice: set by the handler to stop it (a stop string matched).
    pub stop: Arc<Vec<AtomicBool>>,
    pub received: Instant,
}

/// What the engine thread reports about a job.
#[derive(Debug)]
pub enum JobEvent {
    /// `adapter_version`: the version of the request's LoRA adapter, if it names one.
    Token {
        choice: usize,
        sampled: Sampled,
        weights_version: u64,
        adapter_version: Option<u64>,
    },
    Done {
        choice: usize,
        finish: Finish,
        routes: Option<Vec<u32>>,
    },
    /// The prompt's tokens after its first, scored as draws there would report them: the first
    /// event of a job that asked for `prompt_logprobs`.
    PromptLogprobs(Vec<Sampled>),
    /// The request's constraint could not go on (llguidance's limits, or no token of the
    /// vocabulary continues it): the request's own doing, a 400.
    ConstraintFailed(String),
    /// The server could not serve the request: a 500.
    Error(String),
}

/// What reaches the engine thread.
pub enum Msg {
    Job(Job),
    Admin(Admin, oneshot::Sender<std::result::Result<Value, String>>),
}

/// What requests in flight do when new weights arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateMode {
    /// They finish on the old weights; requests that arrive meanwhile wait for the new ones.
    Wait,
    /// They end now (finish reason `abort`).
    Abort,
    /// They go on from their K/V with the new weights (their responses report both versions).
    Keep,
}

/// An admin command.
pub enum Admin {
    /// New weights, already read from disk (off this thread) and named by `source` in errors.
    Weights {
        files: Box<TensorFiles>,
        source: String,
        mode: UpdateMode,
    },
    Pause,
    Resume,
    ResetPrefixCache,
    /// A LoRA adapter, already read (off this thread), made resident under `name`.
    LoadLora {
        name: String,
        adapter: Box<kvdecode::LoraAdapter>,
    },
    /// Free adapter `name`'s slot, unless a request names it.
    UnloadLora {
        name: String,
    },
}

type Reply = oneshot::Sender<std::result::Result<Value, String>>;

struct Running {
    job: Arc<JobHandle>,
    choice: usize,
}

struct JobHandle {
    events: mpsc::UnboundedSender<JobEvent>,
    stop: Arc<Vec<AtomicBool>>,
    received: Instant,
    first_token: AtomicBool,
}

/// The engine thread's state besides the engine and the scheduler.
struct Loop {
    sched: Scheduler,
    running: HashMap<usize, Running>,
    last_token: HashMap<usize, Instant>,
    /// Prompt-cache hit tokens and preemptions already added to the counters.
    reported: (usize, usize),
    /// `POST /v1/pause`: no step runs until `/v1/resume`.
    paused: bool,
    /// An update (mode `wait`) waiting for the requests in flight to finish.
    waiting: Option<(Box<TensorFiles>, String, Reply)>,
    /// Jobs that arrived while an update waits: they run on the new weights.
    held: Vec<Job>,
    /// Jobs whose prompt waits for a free row to be scored on (`prompt_logprobs`).
    scoring: Vec<Job>,
    /// The owner of the row a prompt is scored on.
    scorer: RowOwner,
    metrics: Arc<Metrics>,
}

/// The engine thread's loop; returns when every sender is gone or the device fails.
/// `lose_device_after`: for tests, destroy the device after that many steps.
pub fn run(
    mut engine: Engine,
    prefill_chunk: usize,
    mut rx: mpsc::Receiver<Msg>,
    metrics: Arc<Metrics>,
    lose_device_after: Option<u64>,
) {
    let mut steps = 0u64;
    let mut l = Loop {
        sched: Scheduler::new(&engine, prefill_chunk),
        running: HashMap::new(),
        last_token: HashMap::new(),
        reported: (0, 0),
        paused: false,
        waiting: None,
        held: Vec::new(),
        scoring: Vec::new(),
        scorer: RowOwner::new(),
        metrics,
    };
    loop {
        if l.running.is_empty() {
            if let Some((files, source, reply)) = l.waiting.take() {
                l.metrics.update_waiting.set(0);
                l.update(&mut engine, &files, &source, InFlight::Keep, reply);
                for job in std::mem::take(&mut l.held) {
                    l.submit(&mut engine, job);
                }
            }
        }
        // take new messages: wait when there is nothing to step, else only what is already there
        let mut new = Vec::new();
        // (jobs waiting to score their prompt retry each turn: they wait for a row, not a message)
        if (l.running.is_empty() && l.scoring.is_empty()) || l.paused {
            match rx.blocking_recv() {
                Some(m) => new.push(m),
                None => return,
            }
        }
        while let Ok(m) = rx.try_recv() {
            new.push(m);
        }
        for job in std::mem::take(&mut l.scoring) {
            l.submit(&mut engine, job);
        }
        for m in new {
            match m {
                Msg::Job(job) if l.waiting.is_some() => l.held.push(job),
                Msg::Job(job) => l.submit(&mut engine, job),
                Msg::Admin(cmd, reply) => l.admin(&mut engine, cmd, reply),
            }
        }
        l.cancel_gone(&mut engine);
        l.metrics.queue_depth.set(l.sched.queued() as u64 + rx.len() as u64 + l.held.len() as u64);
        l.metrics.rows_in_use.set(l.sched.active() as u64);
        report_memory(&engine, &l.sched, &l.metrics, &mut l.reported);
        if l.paused || l.running.is_empty() {
            continue;
        }
        let version = engine.weights_version();
        let (running, last_token, metrics) = (&mut l.running, &mut l.last_token, &l.metrics);
        let step = l.sched.step(&mut engine, &mut |ev| match ev {
            Event::Token { id, token, logprob, kept, top, weights_version, adapter_version } => {
                if let Some(r) = running.get(&id) {
                    let now = Instant::now();
                    if !r.job.first_token.swap(true, Ordering::Relaxed) {
                        metrics.time_to_first_token.observe((now - r.job.received).as_secs_f64());
                    }
                    if let Some(prev) = last_token.insert(id, now) {
                        metrics.time_per_output_token.observe((now - prev).as_secs_f64());
                    }
                    metrics.completion_tokens.inc();
                    let sampled = Sampled { token, logprob, top: top.to_vec(), kept };
                    let choice = r.choice;
                    let _ = r.job.events.send(JobEvent::Token { choice, sampled, weights_version, adapter_version });
                }
            }
            Event::Done(c) => {
                if let Some(r) = running.remove(&c.id) {
                    last_token.remove(&c.id);
                    let ev = match &c.error {
                        // only a request's own constraint ends it with an error
                        Some(e) => JobEvent::ConstraintFailed(e.clone()),
                        None => JobEvent::Done { choice: r.choice, finish: c.finish, routes: c.routes.clone() },
                    };
                    let _ = r.job.events.send(ev);
                }
            }
        });
        debug_assert_eq!(version, engine.weights_version(), "no update lands inside a step");
        steps += 1;
        if lose_device_after == Some(steps) {
            engine.gpu().device.destroy();
        }
        report_memory(&engine, &l.sched, &l.metrics, &mut l.reported);
        if let Err(e) = step {
            // the device failed: every job gets the error, and the server reports itself unhealthy
            let msg = format!("the engine failed: {e}");
            // unhealthy first: a client that gets the error and then asks /health sees the loss
            *l.metrics.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg.clone());
            l.metrics.healthy.store(false, Ordering::SeqCst);
            for (_, r) in l.running.drain() {
                let _ = r.job.events.send(JobEvent::Error(msg.clone()));
            }
            // keep answering queued jobs with the error until the process is restarted
            while let Some(m) = rx.blocking_recv() {
                match m {
                    Msg::Job(j) => {
                        let _ = j.events.send(JobEvent::Error(e.to_string()));
                    }
                    Msg::Admin(_, reply) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            return;
        }
    }
}

impl Loop {
    fn submit(&mut self, engine: &mut Engine, mut job: Job) {
        // an adapter unloaded after the handler picked it (the unload came first)
        if let Some(name) = job.request.adapter.as_deref().filter(|n| engine.lora_version(n).is_none()) {
            let _ = job.events.send(JobEvent::Error(format!("the LoRA adapter {name:?} was unloaded")));
            return;
        }
        if let Some(top) = job.prompt_logprobs {
            match score_prompt(engine, self.scorer, &job, top) {
                // no free row yet: the job waits for one, ahead of the scheduler's queue
                Ok(None) => return self.scoring.push(job),
                Ok(Some(scored)) => {
                    let _ = job.events.send(JobEvent::PromptLogprobs(scored));
                    job.prompt_logprobs = None;
                }
                Err(e) => {
                    let _ = job.events.send(JobEvent::Error(format!("scoring the prompt: {e}")));
                    return;
                }
            }
        }
        let handle = Arc::new(JobHandle {
            events: job.events,
            stop: job.stop,
            received: job.received,
            first_token: AtomicBool::new(false),
        });
        match self.sched.submit_group(job.request, &job.samplers) {
            Ok(ids) => {
                for (choice, id) in ids.into_iter().enumerate() {
                    self.running.insert(id, Running { job: handle.clone(), choice });
                }
            }
            Err(e) => {
                let _ = handle.events.send(JobEvent::Error(e.to_string()));
            }
        }
    }

    /// Cancel what nobody waits for any more.
    fn cancel_gone(&mut self, engine: &mut Engine) {
        let gone: Vec<usize> = self
            .running
            .iter()
            .filter(|(_, r)| r.job.events.is_closed() || r.job.stop[r.choice].load(Ordering::Relaxed))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.cancel(engine, id);
        }
    }

    fn cancel(&mut self, engine: &mut Engine, id: usize) {
        if let Some(r) = self.running.remove(&id) {
            self.sched.cancel(engine, id);
            self.last_token.remove(&id);
            let _ = r.job.events.send(JobEvent::Done { choice: r.choice, finish: Finish::Cancelled, routes: None });
            self.metrics.cancelled.inc();
        }
    }

    fn admin(&mut self, engine: &mut Engine, cmd: Admin, reply: Reply) {
        match cmd {
            Admin::Pause | Admin::Resume => {
                self.paused = matches!(cmd, Admin::Pause);
                let _ = reply.send(Ok(json!({"paused": self.paused, "weights_version": engine.weights_version()})));
            }
            Admin::ResetPrefixCache => {
                let r = engine.reset_prefix_cache().map(|_| json!({"reset": true})).map_err(|e| e.to_string());
                // /metrics shows the emptied cache by the time the client has its answer
                report_memory(engine, &self.sched, &self.metrics, &mut self.reported);
                let _ = reply.send(r);
            }
            Admin::LoadLora { name, adapter } => {
                let r = engine.load_lora(&name, &adapter).map(|_| json!({"lora_name": name, "version": 0}));
                let _ = reply.send(r.map_err(|e| e.to_string()));
            }
            Admin::UnloadLora { name } => {
                let named = |j: &Job| j.request.adapter.as_deref() == Some(name.as_str());
                let r = if self.sched.uses_adapter(&name) || self.held.iter().any(named) {
                    Err(format!("the LoRA adapter {name:?} is in use by requests in flight; retry once they end"))
                } else {
                    engine.unload_lora(&name).map(|_| json!({"lora_name": name})).map_err(|e| e.to_string())
                };
                let _ = reply.send(r);
            }
            Admin::Weights { .. } if self.waiting.is_some() => {
                let _ = reply.send(Err("an update is already waiting for the requests in flight".into()));
            }
            // past a pause too: the requests finish once resumed
            Admin::Weights { files, source, mode: UpdateMode::Wait } if !self.running.is_empty() => {
                self.metrics.update_waiting.set(1);
                self.waiting = Some((files, source, reply));
            }
            Admin::Weights { files, source, mode: UpdateMode::Abort } => {
                for id in self.running.keys().copied().collect::<Vec<_>>() {
                    self.cancel(engine, id);
                }
                self.update(engine, &files, &source, InFlight::Reset, reply);
            }
            Admin::Weights { files, source, .. } => self.update(engine, &files, &source, InFlight::Keep, reply),
        }
    }

    fn update(&mut self, engine: &mut Engine, files: &TensorFiles, source: &str, in_flight: InFlight, reply: Reply) {
        let t0 = Instant::now();
        let r = files.tensors().and_then(|t| engine.update_weights(&t, in_flight));
        let r = r.map_err(|e| format!("{source}: {e}"));
        let r = r.map(|u| {
            self.metrics.weights_version.set(u.version);
            json!({
                "weights_version": u.version, "tensors": u.tensors, "bytes": u.bytes,
                "ignored": u.ignored, "seconds": t0.elapsed().as_secs_f64(),
            })
        });
        let _ = reply.send(r);
    }
}

/// Score `job`'s prompt on a row of its own (`None`: no row is free now), chunk by chunk, each
/// chunk naming the next one's first token; then reset the row (its blocks stay in the prompt
/// cache, so the scheduler's prefill of the same prompt reuses them) and give it back.
fn score_prompt(engine: &mut Engine, scorer: RowOwner, job: &Job, top: u32) -> kvdecode::Result<Option<Vec<Sampled>>> {
    let Ok(rows) = engine.claim_free_rows(scorer, 1) else { return Ok(None) };
    let row = rows[0];
    let sampler = job.samplers[0].with_top_logprobs(top);
    let prompt = &job.request.tokens;
    let per = engine.chunk_width().min(engine.all_logits_tokens()).max(1);
    let mut scored = Vec::with_capacity(prompt.len());
    let mut run = || -> kvdecode::Result<()> {
        engine.set_adapter(row, job.request.adapter.as_deref())?;
        for (k, chunk) in prompt.chunks(per).enumerate() {
            let next = prompt.get((k + 1) * per).copied().unwrap_or(u32::MAX);
            let got =
                engine.append_scored(chunk, chunk.len(), &[chunk.len()], Some(&[row]), &[sampler], Some(&[next]))?;
            scored.extend(got.into_iter().flatten());
        }
        Ok(())
    };
    let result = run();
    let reset = engine.reset(&[row]);
    engine.release_rows(scorer, &[row]);
    result.and(reset).map(|()| Some(scored))
}

/// The K/V figures of `/metrics`: tokens and blocks in use, cached blocks, and what the prompt
/// cache and preemption did since `reported`.
fn report_memory(engine: &Engine, sched: &Scheduler, metrics: &Metrics, reported: &mut (usize, usize)) {
    metrics.kv_tokens_in_use.set(sched.used_tokens(engine) as u64);
    let blocks = engine.cache().block_usage();
    metrics.kv_blocks_in_use.set(blocks.used as u64);
    metrics.kv_blocks_cached.set(blocks.cached as u64);
    let hits = engine.cache().prompt_cache_stats().hit_tokens;
    metrics.prompt_cache_hit_tokens.add((hits - reported.0) as u64);
    metrics.preemptions.add((sched.preemptions() - reported.1) as u64);
    *reported = (hits, sched.preemptions());
}
