//! The GPU side of the server: one thread owns the engine and the continuous-batching scheduler,
//! takes jobs from a bounded channel (the HTTP side's backpressure), and sends each job's tokens
//! back through the job's own channel. A job whose receiver is gone (its client disconnected) or
//! whose handler asked to stop a choice (a stop string matched) is cancelled at once, freeing its
//! rows for the queue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvdecode::{Engine, Event, Finish, Request, Sampled, Sampler, Scheduler};
use tokio::sync::mpsc;

use super::metrics::Metrics;

/// One HTTP request's generation: `samplers.len()` choices of one prompt.
pub struct Job {
    pub request: Request,
    pub samplers: Vec<Sampler>,
    pub events: mpsc::UnboundedSender<JobEvent>,
    /// Per choice: set by the handler to stop it (a stop string matched).
    pub stop: Arc<Vec<AtomicBool>>,
    pub received: Instant,
}

/// What the engine thread reports about a job.
#[derive(Debug)]
pub enum JobEvent {
    Token { choice: usize, sampled: Sampled },
    Done { choice: usize, finish: Finish },
    Error(String),
}

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

/// The engine thread's loop; returns when every sender is gone or the device fails.
pub fn run(mut engine: Engine, prefill_chunk: usize, mut jobs: mpsc::Receiver<Job>, metrics: Arc<Metrics>) {
    let mut sched = Scheduler::new(&engine, prefill_chunk);
    let mut running: HashMap<usize, Running> = HashMap::new();
    let mut last_token: HashMap<usize, Instant> = HashMap::new();
    // prompt-cache hit tokens and preemptions already added to the counters
    let mut reported = (0, 0);
    loop {
        // take new jobs: wait when there is nothing to do, else only what is already there
        let mut new = Vec::new();
        if running.is_empty() {
            match jobs.blocking_recv() {
                Some(j) => new.push(j),
                None => return,
            }
        }
        while let Ok(j) = jobs.try_recv() {
            new.push(j);
        }
        for job in new {
            let handle = Arc::new(JobHandle {
                events: job.events,
                stop: job.stop,
                received: job.received,
                first_token: AtomicBool::new(false),
            });
            match sched.submit_group(job.request, &job.samplers) {
                Ok(ids) => {
                    for (choice, id) in ids.into_iter().enumerate() {
                        running.insert(id, Running { job: handle.clone(), choice });
                    }
                }
                Err(e) => {
                    let _ = handle.events.send(JobEvent::Error(e.to_string()));
                }
            }
        }
        // cancel what nobody waits for any more
        let gone: Vec<usize> = running
            .iter()
            .filter(|(_, r)| r.job.events.is_closed() || r.job.stop[r.choice].load(Ordering::Relaxed))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(r) = running.remove(&id) {
                sched.cancel(&mut engine, id);
                last_token.remove(&id);
                let _ = r.job.events.send(JobEvent::Done { choice: r.choice, finish: Finish::Cancelled });
                metrics.cancelled.inc();
            }
        }
        metrics.queue_depth.set(sched.queued() as u64 + jobs.len() as u64);
        metrics.rows_in_use.set(sched.active() as u64);
        report_memory(&engine, &sched, &metrics, &mut reported);
        let step = sched.step(&mut engine, &mut |ev| match ev {
            Event::Token { id, token, logprob, top } => {
                if let Some(r) = running.get(&id) {
                    let now = Instant::now();
                    if !r.job.first_token.swap(true, Ordering::Relaxed) {
                        metrics.time_to_first_token.observe((now - r.job.received).as_secs_f64());
                    }
                    if let Some(prev) = last_token.insert(id, now) {
                        metrics.time_per_output_token.observe((now - prev).as_secs_f64());
                    }
                    metrics.completion_tokens.inc();
                    let sampled = Sampled { token, logprob, top: top.to_vec() };
                    let _ = r.job.events.send(JobEvent::Token { choice: r.choice, sampled });
                }
            }
            Event::Done(c) => {
                if let Some(r) = running.remove(&c.id) {
                    last_token.remove(&c.id);
                    let ev = match &c.error {
                        Some(e) => JobEvent::Error(e.clone()),
                        None => JobEvent::Done { choice: r.choice, finish: c.finish },
                    };
                    let _ = r.job.events.send(ev);
                }
            }
        });
        report_memory(&engine, &sched, &metrics, &mut reported);
        if let Err(e) = step {
            // the device failed: every job gets the error, and the server reports itself unhealthy
            let msg = format!("the engine failed: {e}");
            for (_, r) in running.drain() {
                let _ = r.job.events.send(JobEvent::Error(msg.clone()));
            }
            metrics.healthy.store(false, Ordering::Relaxed);
            *metrics.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
            // keep answering queued jobs with the error until the process is restarted
            while let Some(j) = jobs.blocking_recv() {
                let _ = j.events.send(JobEvent::Error(e.to_string()));
            }
            return;
        }
    }
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
