//! Continuous batching: a queue of requests served by the cache rows of one [`Engine`]. Free rows
//! admit queued requests (reset + prefill); every step decodes all active rows, and long prompts
//! are prefilled in chunks that share steps with the decoding rows. Tokens stream through a
//! callback. A request's tokens do not depend on what else shares the batch: rows are
//! independent and chunking does not change a bit, so greedy or seeded sampling gives exactly
//! what the request gets when run alone.
//!
//! Memory is global K/V blocks: a request is admitted when its row's pool shard has the blocks
//! for its prompt plus a watermark of one block per running row; it starts on whatever prefix of
//! its prompt the prompt cache holds. When blocks run out mid-generation the newest rows are
//! preempted: their blocks go back, and they resume later by recomputing their prompt and the
//! tokens they generated (often from the prompt cache), with output identical to an uninterrupted
//! run (sampling depends only on the seed, the position and the tokens).

use std::collections::VecDeque;
use std::time::Duration;

use web_time::Instant;

use crate::cache::RowOwner;
use crate::engine::sampling::Sampler;
use crate::engine::{Batch, Engine, StepOutput, Want};
use crate::error::{Error, Result};
use crate::serve::request::{Completion, Event, Finish, Request, RequestStats, TokenConstraint};

struct Active {
    id: usize,
    req: Request,
    /// What the row appends before it samples: the prompt, or after a preemption the prompt and
    /// every token generated so far.
    feed: Vec<u32>,
    /// Tokens of `feed` already appended.
    fed: usize,
    /// Admission order: preemption takes the newest first.
    admitted: usize,
    /// The token to append next once the prompt is in (the last one generated).
    next: Option<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    kept: Vec<u32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    weights_versions: Vec<u64>,
    adapter_versions: Vec<u64>,
    /// Members of a group that wait for this row's prefill, then fork from it (row, request).
    followers: Vec<(usize, Queued)>,
    /// Tokens generated so far (presence / frequency penalties).
    seen: std::collections::HashSet<u32>,
    /// The request's constrained decoding state.
    constraint: Option<Box<dyn TokenConstraint>>,
    submitted: Instant,
    first_token: Option<Duration>,
    queued_steps: usize,
    active_steps: usize,
}

/// A request waiting for a row: id, request, submission time, scheduler step at submission.
type Queued = (usize, Request, Instant, usize);

impl Active {
    fn new(id: usize, req: Request, submitted: Instant, queued_steps: usize, followers: Vec<(usize, Queued)>) -> Self {
        let constraint = req.constraint.as_ref().map(|f| (f.0)());
        Active {
            constraint,
            id,
            feed: req.tokens.clone(),
            req,
            fed: 0,
            admitted: 0,
            next: None,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            kept: Vec::new(),
            top_logprobs: Vec::new(),
            weights_versions: Vec::new(),
            adapter_versions: Vec::new(),
            followers,
            seen: Default::default(),
            submitted,
            first_token: None,
            queued_steps,
            active_steps: 0,
        }
    }

    /// What this row appends in the next step: the last token generated, or the next piece of
    /// its feed (a group's leader stops one token short: each member appends the last one).
    fn next_chunk(&self, prefill_chunk: usize) -> Vec<u32> {
        let until = self.feed.len() - usize::from(!self.followers.is_empty());
        match self.next {
            Some(t) => vec![t],
            None => self.feed[self.fed..(self.fed + prefill_chunk).min(until)].to_vec(),
        }
    }

    /// Blocks its row needs to hold everything it will have appended after this step's feed,
    /// plus one to grow into.
    fn blocks_to_resume(&self, block_len: usize) -> usize {
        self.feed.len().div_ceil(block_len) + 1
    }

    fn complete(self, finish: Finish) -> Completion {
        Completion {
            id: self.id,
            stats: RequestStats {
                prompt_tokens: self.req.tokens.len(),
                queued_steps: self.queued_steps,
                active_steps: self.active_steps,
                time_to_first_token: self.first_token.unwrap_or_default(),
                total_time: self.submitted.elapsed(),
            },
            tokens: self.tokens,
            logprobs: self.logprobs,
            kept: self.kept,
            top_logprobs: self.top_logprobs,
            weights_versions: self.weights_versions,
            adapter_versions: self.adapter_versions,
            finish,
            error: None,
            routes: None,
        }
    }
}

/// The continuous-batching scheduler over an engine's rows.
pub struct Scheduler {
    /// Groups of requests sharing a prompt (one request is a group of one), in order.
    queue: VecDeque<Vec<Queued>>,
    /// Requests preempted to free blocks, in the order they resume (before the queue).
    preempted: VecDeque<Active>,
    rows: Vec<Option<Active>>,
    /// Rows held for group members until their leader's prefill is forked into them.
    reserved: Vec<bool>,
    next_id: usize,
    prefill_chunk: usize,
    max_len: usize,
    vocab: usize,
    bias_slots: usize,
    /// The engine keeps every token's routes (requests may ask for them).
    routes_recorded: bool,
    steps: usize,
    /// Positions per block, and positions one row can reach in its pool shard.
    block_len: usize,
    row_capacity: usize,
    admissions: usize,
    preemptions: usize,
    /// The rows it admits into are claimed under this owner (rows others hold are left alone).
    owner: RowOwner,
}

impl Scheduler {
    /// A scheduler for `engine`'s rows; prompts are prefilled `prefill_chunk` tokens per step.
    pub fn new(engine: &Engine, prefill_chunk: usize) -> Self {
        Scheduler {
            queue: VecDeque::new(),
            preempted: VecDeque::new(),
            rows: (0..engine.cache().rows()).map(|_| None).collect(),
            reserved: vec![false; engine.cache().rows()],
            next_id: 0,
            prefill_chunk: prefill_chunk.max(1),
            max_len: engine.cache().max_len(),
            vocab: engine.config().vocab,
            bias_slots: engine.logit_bias_slots(),
            routes_recorded: engine.records_routes(),
            steps: 0,
            block_len: engine.cache().block_len(),
            row_capacity: engine.cache().row_capacity(),
            admissions: 0,
            preemptions: 0,
            owner: RowOwner::new(),
        }
    }

    /// Queue a request; returns its id. A request that could never fit a row (prompt + max_new
    /// beyond max_len), asks for no token (`max_new` 0: the scheduler would have to prefill a row
    /// for nothing, and a sampled first token could not be withheld without special cases) or
    /// has bad tokens is refused here, so nothing fails mid-way.
    pub fn submit(&mut self, req: Request) -> Result<usize> {
        let id = self.next_id;
        self.check(id, &req)?;
        self.next_id += 1;
        self.queue.push_back(vec![(id, req, Instant::now(), self.steps)]);
        Ok(id)
    }

    /// Queue `n` requests that share `req`'s prompt, each with its own sampler (`samplers[i]`,
    /// say seeds `s, s + 1, ...`): the group waits until `n` rows are free, the prompt is
    /// prefilled once on the first and forked into the others on the GPU (OpenAI's `n`, GRPO
    /// groups). Returns the ids, in sampler order. Each member streams and finishes on its own.
    pub fn submit_group(&mut self, req: Request, samplers: &[Sampler]) -> Result<Vec<usize>> {
        if samplers.is_empty() || samplers.len() > self.rows.len() {
            return Err(Error::Input(format!(
                "request {}: a group of {} needs 1 to {} rows",
                self.next_id,
                samplers.len(),
                self.rows.len()
            )));
        }
        for (i, s) in samplers.iter().enumerate() {
            let member = Request { sampler: *s, ..req.clone() };
            self.check(self.next_id + i, &member)?;
        }
        let now = Instant::now();
        let group: Vec<Queued> = samplers
            .iter()
            .enumerate()
            .map(|(i, s)| (self.next_id + i, Request { sampler: *s, ..req.clone() }, now, self.steps))
            .collect();
        let ids = group.iter().map(|g| g.0).collect();
        self.next_id += samplers.len();
        self.queue.push_back(group);
        Ok(ids)
    }

    /// Whether a queued, preempted or running request names adapter `name`: it must stay
    /// loaded until they are done (a server refuses to unload it until then).
    pub fn uses_adapter(&self, name: &str) -> bool {
        let named = |r: &Request| r.adapter.as_deref() == Some(name);
        self.queue.iter().flatten().any(|q| named(&q.1))
            || self.preempted.iter().any(|a| named(&a.req))
            || self.rows.iter().flatten().any(|a| named(&a.req) || a.followers.iter().any(|f| named(&f.1 .1)))
    }

    /// Stop request `id` now: a queued request leaves the queue, a running one frees its row at
    /// once (its completion, with the tokens so far, comes back with [`Finish::Cancelled`]).
    /// `None` if no such request is queued or running.
    pub fn cancel(&mut self, engine: &mut Engine, id: usize) -> Option<Completion> {
        for g in &mut self.queue {
            if let Some(k) = g.iter().position(|q| q.0 == id) {
                let (id, req, submitted, _) = g.remove(k);
                let prompt_tokens = req.tokens.len();
                self.queue.retain(|g| !g.is_empty());
                return Some(Completion {
                    id,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    kept: Vec::new(),
                    top_logprobs: Vec::new(),
                    weights_versions: Vec::new(),
                    adapter_versions: Vec::new(),
                    finish: Finish::Cancelled,
                    error: None,
                    routes: None,
                    stats: RequestStats { prompt_tokens, total_time: submitted.elapsed(), ..Default::default() },
                });
            }
        }
        if let Some(k) = self.preempted.iter().position(|a| a.id == id) {
            let a = self.preempted.remove(k).expect("found");
            return Some(a.complete(Finish::Cancelled));
        }
        let r = self.rows.iter().position(|a| a.as_ref().is_some_and(|a| a.id == id))?;
        let mut a = self.rows[r].take().expect("found");
        // followers waiting on this row's prefill start over in the queue, as a group of their own
        if !a.followers.is_empty() {
            let followers = std::mem::take(&mut a.followers);
            for &(row, _) in &followers {
                self.reserved[row] = false;
                engine.release_rows(self.owner, &[row]);
            }
            self.queue.push_front(followers.into_iter().map(|f| f.1).collect());
        }
        let _ = engine.reset(&[r]);
        engine.release_rows(self.owner, &[r]);
        Some(a.complete(Finish::Cancelled))
    }

    /// Refuse what could never run, before it is queued.
    fn check(&self, id: usize, req: &Request) -> Result<()> {
        if req.tokens.is_empty() {
            return Err(Error::Input(format!("request {id}: empty prompt")));
        }
        if req.return_routes && !self.routes_recorded {
            return Err(Error::Input(format!(
                "request {id}: return_routes needs a mixture of experts on an engine built with record_routes"
            )));
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
        if req.tokens.len().saturating_add(req.max_new) > self.row_capacity {
            return Err(Error::Input(format!(
                "request {id}: prompt {} + max_new {} exceeds the {} positions of a K/V pool shard \
                 (EngineOptions::pool_blocks)",
                req.tokens.len(),
                req.max_new,
                self.row_capacity
            )));
        }
        if let Some((i, t)) = req.tokens.iter().enumerate().find(|(_, &t)| t as usize >= self.vocab) {
            return Err(Error::Input(format!(
                "request {id}: token {i} = {t} is outside the vocabulary ({})",
                self.vocab
            )));
        }
        req.sampler.check(0).map_err(|e| Error::Input(format!("request {id}: {e}")))?;
        for (what, p) in [("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&p) {
                return Err(Error::Input(format!("request {id}: {what} {p} must be in [-2, 2]")));
            }
        }
        if let Some(&(t, b)) = req.logit_bias.iter().find(|(t, b)| *t as usize >= self.vocab || !b.is_finite()) {
            return Err(Error::Input(format!(
                "request {id}: logit_bias {b} for token {t} (tokens below {}, finite biases)",
                self.vocab
            )));
        }
        // penalties add one bias entry per distinct generated token: make sure they all fit
        let penalized = if req.has_penalties() { req.max_new.min(self.vocab) } else { 0 };
        let entries = req.logit_bias.len() + penalized;
        if entries > self.bias_slots {
            return Err(Error::Input(format!(
                "request {id}: {} logit_bias entries{} need more than the engine's {} bias slots \
                 (EngineOptions::logit_bias_slots)",
                req.logit_bias.len(),
                if req.has_penalties() { format!(" plus up to {penalized} penalized tokens") } else { String::new() },
                self.bias_slots
            )));
        }
        Ok(())
    }

    /// Requests waiting for a row (preempted ones included).
    pub fn queued(&self) -> usize {
        self.queue.iter().map(Vec::len).sum::<usize>() + self.preempted.len()
    }

    /// Rows preempted so far to free K/V blocks.
    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    /// Requests holding a row.
    pub fn active(&self) -> usize {
        self.rows.iter().flatten().count()
    }

    /// Tokens stored for running requests.
    pub fn used_tokens(&self, engine: &Engine) -> usize {
        self.rows.iter().enumerate().filter(|(_, a)| a.is_some()).map(|(r, _)| engine.cache().lens()[r]).sum()
    }

    /// KV positions claimed by running requests: their rows' blocks, a block shared by forks
    /// counted for each row that holds it (what per-row copies would take).
    pub fn allocated_tokens(&self, engine: &Engine) -> usize {
        let c = engine.cache();
        self.rows.iter().enumerate().filter(|(_, a)| a.is_some()).map(|(r, _)| c.row_blocks(r) * c.block_len()).sum()
    }

    /// KV positions taken from the block pool: blocks held by rows, each once (at most the
    /// tokens used plus one block per row; blocks only the prompt cache holds are free to evict
    /// and not counted).
    pub fn reserved_tokens(&self, engine: &Engine) -> usize {
        let c = engine.cache();
        c.block_usage().used * c.block_len()
    }

    /// One step: admit queued requests into free rows, append one chunk for every active row
    /// (a prompt piece or the last generated token), sample, stream, release finished rows.
    /// Returns the requests that finished in this step; `false` in `.1` when there is no work.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(Event)) -> Result<(Vec<Completion>, bool)> {
        crate::gpu::pending::block_on(self.step_async(engine, on_event))
    }

    /// [`Scheduler::step`] that awaits the readback instead of blocking (the browser's form).
    pub async fn step_async(
        &mut self,
        engine: &mut Engine,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<(Vec<Completion>, bool)> {
        self.admit(engine)?;
        // leaders whose shared part of the prompt is in: fork it into the followers' rows, then
        // every member appends the last prompt token and samples its own first token
        for r in 0..self.rows.len() {
            let ready = self.rows[r].as_ref().is_some_and(|a| !a.followers.is_empty() && a.fed + 1 == a.feed.len());
            if !ready {
                continue;
            }
            let followers = std::mem::take(&mut self.rows[r].as_mut().expect("ready").followers);
            let dst: Vec<usize> = followers.iter().map(|f| f.0).collect();
            engine.fork(r, &dst)?;
            let fed = self.rows[r].as_ref().expect("ready").fed;
            for (row, (id, req, submitted, at_step)) in followers {
                self.reserved[row] = false;
                if !req.logit_bias.is_empty() {
                    engine.set_logit_bias(row, &req.logit_bias)?;
                }
                let mut a = Active::new(id, req, submitted, self.steps - at_step, Vec::new());
                a.fed = fed;
                a.admitted = self.admissions;
                self.admissions += 1;
                self.rows[row] = Some(a);
            }
        }
        let active: Vec<usize> = (0..self.rows.len()).filter(|&r| self.rows[r].is_some()).collect();
        if active.is_empty() {
            return Ok((Vec::new(), false));
        }
        self.steps += 1;
        let mut chunks: Vec<Vec<u32>> =
            active.iter().map(|&r| self.rows[r].as_ref().expect("active").next_chunk(self.prefill_chunk)).collect();
        // constrained rows that sample a token in this step get their mask first; a constraint
        // that fails ends its request here, with the reason
        let mut finished = Vec::new();
        let words = engine.config().vocab.div_ceil(32);
        for (i, &r) in active.iter().enumerate() {
            let a = self.rows[r].as_mut().expect("active");
            let samples = a.next.is_some() || a.fed + chunks[i].len() == a.feed.len();
            let Some(c) = a.constraint.as_mut().filter(|_| samples) else { continue };
            let mut mask = vec![0u32; words];
            if let Err(e) = c.allowed(&mut mask).and_then(|()| engine.set_token_mask(r, Some(&mask))) {
                engine.set_token_mask(r, None)?;
                engine.reset(&[r])?; // its blocks go back to the pool now
                engine.release_rows(self.owner, &[r]);
                let mut done = self.rows[r].take().expect("active").complete(Finish::ConstraintError);
                done.error = Some(e.to_string());
                on_event(Event::Done(&done));
                finished.push(done);
                chunks[i].clear();
            }
        }
        let (mut active, mut chunks): (Vec<usize>, Vec<Vec<u32>>) =
            active.into_iter().zip(chunks).filter(|(r, _)| self.rows[*r].is_some()).unzip();
        // out of blocks: preempt the newest row and try again with the others
        let (sampled, n_new) = loop {
            if active.is_empty() {
                return Ok((finished, true));
            }
            let batch = active.iter().zip(&chunks).fold(Batch::new(), |b, (&r, c)| b.row(r, c));
            let samplers: Vec<Sampler> =
                active.iter().map(|&r| self.rows[r].as_ref().expect("active").req.sampler).collect();
            let n_new: Vec<usize> = chunks.iter().map(Vec::len).collect();
            match engine.step_async(&batch.samplers(samplers), Want::Sampled).await.and_then(StepOutput::into_sampled) {
                Ok(sampled) => break (sampled, n_new),
                Err(Error::OutOfBlocks { .. }) if active.len() > 1 => {
                    let newest = (0..active.len())
                        .max_by_key(|&i| self.rows[active[i]].as_ref().expect("active").admitted)
                        .expect("not empty");
                    self.preempt(engine, active[newest])?;
                    active.remove(newest);
                    chunks.remove(newest);
                }
                Err(e) => return Err(e),
            }
        };
        for (i, (&r, got)) in active.iter().zip(sampled).enumerate() {
            let a = self.rows[r].as_mut().expect("active");
            a.active_steps += 1;
            if a.next.is_none() {
                a.fed += n_new[i];
                if a.fed < a.feed.len() {
                    continue; // still prefilling: this step's sample is not a token yet
                }
            }
            let got = got.expect("every row that finished its prompt appended tokens");
            let token = got.token;
            a.first_token.get_or_insert_with(|| a.submitted.elapsed());
            let weights_version = engine.weights_version();
            let adapter_version = engine.adapter(r).map(|a| a.1);
            let top = &got.top;
            let (logprob, kept) = (got.logprob, got.kept);
            on_event(Event::Token { id: a.id, token, logprob, kept, top, weights_version, adapter_version });
            a.tokens.push(token);
            a.logprobs.push(logprob);
            a.kept.push(kept);
            a.weights_versions.push(weights_version);
            a.adapter_versions.extend(adapter_version);
            if a.req.sampler.top_logprobs > 0 {
                a.top_logprobs.push(got.top);
            }
            let consumed = a.constraint.as_mut().map_or(Ok(()), |c| c.consume(token));
            let mut error = None;
            let finish = if let Err(e) = consumed {
                error = Some(e.to_string());
                Some(Finish::ConstraintError)
            } else if a.req.stop.contains(&token) {
                Some(Finish::Stop)
            } else if a.tokens.len() >= a.req.max_new {
                Some(Finish::Length)
            } else {
                a.next = Some(token);
                if a.req.has_penalties() {
                    let first = a.seen.insert(token);
                    let delta = -a.req.frequency_penalty - if first { a.req.presence_penalty } else { 0.0 };
                    engine.add_logit_bias(r, token, delta)?;
                }
                None
            };
            if let Some(finish) = finish {
                // the routes the row holds, before the reset empties it
                let routes = if a.req.return_routes { Some(engine.routes_async(r).await?) } else { None };
                engine.reset(&[r])?; // its blocks go back to the pool now (full ones stay cached)
                engine.release_rows(self.owner, &[r]);
                let mut done = self.rows[r].take().expect("active").complete(finish);
                (done.error, done.routes) = (error, routes);
                on_event(Event::Done(&done));
                finished.push(done);
            }
        }
        Ok((finished, true))
    }

    /// Admission: preempted requests first, then the queue in order. A group takes as many free
    /// rows as it has members; the first row prefills (from the prompt cache's longest prefix
    /// on), the others wait to be forked. Each admission needs its prompt's blocks plus one per
    /// running row free in the row's pool shard, unless nothing runs at all.
    fn admit(&mut self, engine: &mut Engine) -> Result<()> {
        loop {
            let owner = self.owner;
            let free: Vec<usize> = (0..self.rows.len())
                .filter(|&r| self.rows[r].is_none() && !self.reserved[r])
                .filter(|&r| engine.cache().row_owner(r).is_none_or(|o| o == owner))
                .collect();
            let (members, needed) = match (self.preempted.front(), self.queue.front()) {
                (Some(a), _) => (1, a.blocks_to_resume(self.block_len)),
                (None, Some(g)) => (g.len(), g[0].1.tokens.len().div_ceil(self.block_len) + g.len()),
                (None, None) => break,
            };
            if members > free.len() {
                break;
            }
            let running = self.active();
            let room = engine.cache().available_blocks(free[0]);
            if running > 0 && room < needed + running + members {
                break;
            }
            let leader = free[0];
            engine.claim_rows(owner, &free[..members])?;
            let mut a = match self.preempted.pop_front() {
                Some(a) => a,
                None => {
                    let mut group = self.queue.pop_front().expect("checked").into_iter();
                    let (id, req, submitted, at_step) = group.next().expect("groups are not empty");
                    let followers: Vec<(usize, Queued)> = free[1..].iter().copied().zip(group).collect();
                    for &(r, _) in &followers {
                        self.reserved[r] = true;
                    }
                    Active::new(id, req, submitted, self.steps - at_step, followers)
                }
            };
            engine.reset(&[leader])?;
            // its group's followers take the adapter with the fork
            engine.set_adapter(leader, a.req.adapter.as_deref())?;
            if !a.req.logit_bias.is_empty() {
                engine.set_logit_bias(leader, &a.req.logit_bias)?;
            }
            // a resumed request's penalties, added again in the order they came (same sums)
            if a.req.has_penalties() {
                let mut seen = std::collections::HashSet::new();
                for &t in &a.tokens {
                    let first = seen.insert(t);
                    let delta = -a.req.frequency_penalty - if first { a.req.presence_penalty } else { 0.0 };
                    engine.add_logit_bias(leader, t, delta)?;
                }
            }
            a.fed = engine.reuse_prefix(leader, &a.feed)?;
            a.admitted = self.admissions;
            self.admissions += 1;
            self.rows[leader] = Some(a);
        }
        Ok(())
    }

    /// Free `row`'s blocks and queue its request to resume (first among the waiting) by
    /// recomputing its prompt and what it generated; followers waiting on its prefill go back to
    /// the queue as a group of their own.
    fn preempt(&mut self, engine: &mut Engine, row: usize) -> Result<()> {
        let mut a = self.rows[row].take().expect("preempting a running row");
        engine.release_rows(self.owner, &[row]);
        if !a.followers.is_empty() {
            let followers = std::mem::take(&mut a.followers);
            for &(r, _) in &followers {
                self.reserved[r] = false;
                engine.release_rows(self.owner, &[r]);
            }
            self.queue.push_front(followers.into_iter().map(|f| f.1).collect());
        }
        engine.reset(&[row])?;
        a.feed = [&a.req.tokens[..], &a.tokens[..]].concat();
        a.fed = 0;
        a.next = None;
        self.preempted.push_back(a);
        self.preemptions += 1;
        Ok(())
    }

    /// Step until every submitted request has finished; completions in id order.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(Event)) -> Result<Vec<Completion>> {
        crate::gpu::pending::block_on(self.run_async(engine, on_event))
    }

    /// [`Scheduler::run`] that awaits each step instead of blocking.
    pub async fn run_async(&mut self, engine: &mut Engine, on_event: &mut dyn FnMut(Event)) -> Result<Vec<Completion>> {
        let mut all = Vec::new();
        loop {
            let (done, more) = self.step_async(engine, on_event).await?;
            all.extend(done);
            if !more && self.queue.is_empty() && self.preempted.is_empty() {
                break;
            }
        }
        all.sort_by_key(|c| c.id);
        Ok(all)
    }
}
