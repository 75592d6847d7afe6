//! Continuous batching over an engine's rows: submit, step, stream, cancel.

use std::sync::Mutex;

use pyo3::prelude::*;

use crate::engine::{samplers, Engine};
use crate::{indices, invalid, to_py, token_ids, DeviceError};

/// A finished request.
#[pyclass(module = "kvdecode._kvdecode", frozen)]
pub struct Completion {
    /// The id `submit` returned.
    #[pyo3(get)]
    id: usize,
    /// Generated ids (the stop id included when it ended on one).
    #[pyo3(get)]
    tokens: Vec<u32>,
    /// Log-probability of each generated id.
    #[pyo3(get)]
    logprobs: Vec<f32>,
    /// The weights version each id was sampled under (`Engine.weights_version` then).
    #[pyo3(get)]
    weights_versions: Vec<u64>,
    /// Its adapter's version for each id (`Engine.update_lora`); empty on the base model.
    #[pyo3(get)]
    adapter_versions: Vec<u64>,
    /// Why it ended: `"stop"`, `"length"`, `"cancelled"` or `"constraint_error"`.
    #[pyo3(get)]
    finish: &'static str,
    /// Prompt tokens.
    #[pyo3(get)]
    prompt_tokens: usize,
    /// Seconds from submission to the first generated token.
    #[pyo3(get)]
    time_to_first_token: f64,
    /// Seconds from submission to the end.
    #[pyo3(get)]
    total_time: f64,
    /// With `return_routes`: the experts each fed token (the prompt and every generated id but
    /// the last) was routed to, flat; `numpy.reshape(routes, (-1, *Engine.route_shape))`.
    #[pyo3(get)]
    routes: Option<Vec<u32>>,
}

impl From<&kvdecode::Completion> for Completion {
    fn from(c: &kvdecode::Completion) -> Self {
        use kvdecode::Finish;
        Completion {
            id: c.id,
            tokens: c.tokens.clone(),
            logprobs: c.logprobs.clone(),
            weights_versions: c.weights_versions.clone(),
            adapter_versions: c.adapter_versions.clone(),
            finish: match c.finish {
                Finish::Stop => "stop",
                Finish::Length => "length",
                Finish::Cancelled => "cancelled",
                Finish::ConstraintError => "constraint_error",
            },
            prompt_tokens: c.stats.prompt_tokens,
            time_to_first_token: c.stats.time_to_first_token.as_secs_f64(),
            total_time: c.stats.total_time.as_secs_f64(),
            routes: c.routes.clone(),
        }
    }
}

#[pymethods]
impl Completion {
    fn __repr__(&self) -> String {
        format!("Completion(id={}, tokens={:?}, finish={:?})", self.id, self.tokens, self.finish)
    }
}

/// A generated token, streamed as it comes.
#[pyclass(module = "kvdecode._kvdecode", frozen)]
pub struct Token {
    /// The request.
    #[pyo3(get)]
    id: usize,
    /// The generated id.
    #[pyo3(get)]
    token: u32,
    /// Its log-probability.
    #[pyo3(get)]
    logprob: f32,
    /// The weights version it was sampled under.
    #[pyo3(get)]
    weights_version: u64,
}

#[pymethods]
impl Token {
    fn __repr__(&self) -> String {
        format!(
            "Token(id={}, token={}, logprob={}, weights_version={})",
            self.id, self.token, self.logprob, self.weights_version
        )
    }
}

/// What one step reported, in order (built with the GIL released, turned into objects after).
enum Reported {
    Token(usize, u32, f32, u64),
    Done(Box<kvdecode::Completion>),
}

/// Requests served by the rows of one engine (see `kvdecode.Scheduler`).
#[pyclass(module = "kvdecode._kvdecode")]
pub struct Scheduler {
    engine: Py<Engine>,
    /// In a mutex only because a Python object must be `Sync` and requests' constraints are only
    /// `Send`; every method takes `&mut self` or locks briefly, so it is never contended.
    inner: Mutex<kvdecode::Scheduler>,
}

impl Scheduler {
    fn sched(&mut self) -> PyResult<&mut kvdecode::Scheduler> {
        self.inner.get_mut().map_err(|_| DeviceError::new_err("the scheduler's lock is poisoned"))
    }

    fn locked(&self) -> PyResult<std::sync::MutexGuard<'_, kvdecode::Scheduler>> {
        self.inner.lock().map_err(|_| DeviceError::new_err("the scheduler's lock is poisoned"))
    }
}

#[allow(clippy::too_many_arguments)] // Python keyword arguments
fn request(
    tokens: Vec<i64>,
    max_new: i64,
    stop: Vec<i64>,
    logit_bias: Vec<(i64, f32)>,
    presence_penalty: f32,
    frequency_penalty: f32,
) -> PyResult<kvdecode::Request> {
    let max_new = indices(&[max_new], "max_new")?[0];
    let bias_ids = token_ids(&logit_bias.iter().map(|b| b.0).collect::<Vec<_>>(), "logit_bias")?;
    Ok(kvdecode::Request {
        tokens: token_ids(&tokens, "tokens")?,
        max_new,
        stop: token_ids(&stop, "stop")?,
        logit_bias: bias_ids.into_iter().zip(logit_bias.iter().map(|b| b.1)).collect(),
        presence_penalty,
        frequency_penalty,
        ..Default::default()
    })
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (engine, prefill_chunk=32))]
    fn new(py: Python<'_>, engine: Py<Engine>, prefill_chunk: usize) -> Self {
        let inner = kvdecode::Scheduler::new(&engine.borrow(py).inner, prefill_chunk);
        Scheduler { engine, inner: Mutex::new(inner) }
    }

    /// Queue a request; returns its id.
    #[pyo3(signature = (tokens, max_new, stop, sampler, logit_bias, presence_penalty, frequency_penalty, return_routes=false, adapter=None))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    fn submit(
        &mut self,
        tokens: Vec<i64>,
        max_new: i64,
        stop: Vec<i64>,
        sampler: Option<&Bound<'_, PyAny>>,
        logit_bias: Vec<(i64, f32)>,
        presence_penalty: f32,
        frequency_penalty: f32,
        return_routes: bool,
        adapter: Option<String>,
    ) -> PyResult<usize> {
        let mut req = request(tokens, max_new, stop, logit_bias, presence_penalty, frequency_penalty)?;
        req.sampler = samplers(sampler, 1)?[0];
        req.return_routes = return_routes;
        req.adapter = adapter;
        self.sched()?.submit(req).map_err(to_py)
    }

    /// Queue requests sharing one prompt, one per sampler; returns their ids.
    #[pyo3(signature = (tokens, max_new, stop, samplers, logit_bias, presence_penalty, frequency_penalty, return_routes=false, adapter=None))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    fn submit_group(
        &mut self,
        tokens: Vec<i64>,
        max_new: i64,
        stop: Vec<i64>,
        samplers: &Bound<'_, PyAny>,
        logit_bias: Vec<(i64, f32)>,
        presence_penalty: f32,
        frequency_penalty: f32,
        return_routes: bool,
        adapter: Option<String>,
    ) -> PyResult<Vec<usize>> {
        let mut req = request(tokens, max_new, stop, logit_bias, presence_penalty, frequency_penalty)?;
        req.return_routes = return_routes;
        req.adapter = adapter;
        let n = samplers.len().map_err(|_| invalid("samplers: expected a sequence of Samplers"))?;
        let s = crate::engine::samplers(Some(samplers), n)?;
        self.sched()?.submit_group(req, &s).map_err(to_py)
    }

    /// One step; returns the tokens and completions it produced (in order) and whether there was
    /// work.
    fn step(&mut self, py: Python<'_>) -> PyResult<(Vec<Py<PyAny>>, bool)> {
        let engine = self.engine.clone_ref(py);
        let mut engine = engine.bind(py).try_borrow_mut()?;
        let (sched, e) = (self.sched()?, &mut engine.inner);
        let (reported, more) = py
            .detach(|| {
                let mut reported = Vec::new();
                let (_, more) = sched.step(e, &mut |ev| match ev {
                    kvdecode::Event::Token { id, token, logprob, weights_version, .. } => {
                        reported.push(Reported::Token(id, token, logprob, weights_version))
                    }
                    kvdecode::Event::Done(c) => reported.push(Reported::Done(Box::new(c.clone()))),
                })?;
                Ok::<_, kvdecode::Error>((reported, more))
            })
            .map_err(to_py)?;
        let events = reported
            .into_iter()
            .map(|r| match r {
                Reported::Token(id, token, logprob, weights_version) => {
                    Ok(Py::new(py, Token { id, token, logprob, weights_version })?.into_any())
                }
                Reported::Done(c) => Ok(Py::new(py, Completion::from(&*c))?.into_any()),
            })
            .collect::<PyResult<_>>()?;
        Ok((events, more))
    }

    /// Stop request `id` now; its completion (tokens so far, finish `"cancelled"`), or `None`.
    fn cancel(&mut self, py: Python<'_>, id: usize) -> PyResult<Option<Completion>> {
        let engine = self.engine.clone_ref(py);
        let mut engine = engine.bind(py).try_borrow_mut()?;
        Ok(self.sched()?.cancel(&mut engine.inner, id).as_ref().map(Completion::from))
    }

    /// Requests waiting for a row.
    #[getter]
    fn queued(&self) -> PyResult<usize> {
        Ok(self.locked()?.queued())
    }

    /// Requests holding a row.
    #[getter]
    fn active(&self) -> PyResult<usize> {
        Ok(self.locked()?.active())
    }

    /// The seed's accounting in tokens, at block granularity: used (stored for running
    /// requests), allocated (their rows' blocks, shared ones counted per row) and reserved
    /// (blocks taken from the pool, each once).
    fn accounting(&self, py: Python<'_>) -> PyResult<(usize, usize, usize)> {
        let s = self.locked()?;
        let e = &self.engine.borrow(py).inner;
        Ok((s.used_tokens(e), s.allocated_tokens(e), s.reserved_tokens(e)))
    }
}
