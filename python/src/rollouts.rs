//! Multi-turn episodes over an engine's rows: prompts, forks, tool results, turns with stops.

use pyo3::prelude::*;

use crate::engine::{samplers, turn_limits, Engine, Turn};
use crate::{indices, to_py, token_ids};

/// Episodes for RL rollouts, one per engine row (see `kvdecode.Rollouts`).
#[pyclass(module = "kvdecode._kvdecode")]
pub struct Rollouts {
    engine: Py<Engine>,
    inner: kvdecode::Rollouts,
}

fn sequences(v: &[Vec<i64>], what: &str) -> PyResult<Vec<Vec<u32>>> {
    v.iter().enumerate().map(|(i, s)| token_ids(s, &format!("{what}[{i}]"))).collect()
}

impl Rollouts {
    /// Run `f` on the episodes and the engine with the GIL released.
    fn with_engine<T: Send>(
        &mut self,
        py: Python<'_>,
        f: impl FnOnce(&mut kvdecode::Rollouts, &mut kvdecode::Engine) -> kvdecode::Result<T> + Send,
    ) -> PyResult<T> {
        let mut engine = self.engine.bind(py).try_borrow_mut()?;
        let (ro, e) = (&mut self.inner, &mut engine.inner);
        py.detach(|| f(ro, e)).map_err(to_py)
    }
}

fn turns(v: &[kvdecode::Turn]) -> Vec<Turn> {
    v.iter().cloned().map(Turn::from).collect()
}

#[pymethods]
impl Rollouts {
    #[new]
    fn new(py: Python<'_>, engine: Py<Engine>) -> Self {
        let inner = kvdecode::Rollouts::new(&engine.borrow(py).inner);
        Rollouts { engine, inner }
    }

    /// The engine the episodes live on.
    #[getter]
    fn engine(&self, py: Python<'_>) -> Py<Engine> {
        self.engine.clone_ref(py)
    }

    /// Start episodes: reset `rows`, put them on LoRA adapter `adapter` (`None`: the base model)
    /// and prefill their prompts in one batched append.
    #[pyo3(signature = (rows, prompts, sampler=None, adapter=None))]
    fn start(
        &mut self,
        py: Python<'_>,
        rows: Vec<i64>,
        prompts: Vec<Vec<i64>>,
        sampler: Option<&Bound<'_, PyAny>>,
        adapter: Option<&str>,
    ) -> PyResult<()> {
        let rows = indices(&rows, "rows")?;
        let prompts = sequences(&prompts, "prompts")?;
        let samplers = samplers(sampler, rows.len())?;
        self.with_engine(py, |ro, e| ro.start(e, &rows, &prompts, &samplers, adapter))
    }

    /// Continue `src`'s episode in each row of `dst` (its cache copied, its own sampler).
    #[pyo3(signature = (src, dst, sampler=None))]
    fn fork(&mut self, py: Python<'_>, src: i64, dst: Vec<i64>, sampler: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let src = indices(&[src], "src")?[0];
        let dst = indices(&dst, "dst")?;
        let samplers = samplers(sampler, dst.len())?;
        self.with_engine(py, |ro, e| ro.fork(e, src, &dst, &samplers))
    }

    /// Append tool results (one list of ids per row, batched) after each row's last turn.
    fn tool_result(&mut self, py: Python<'_>, rows: Vec<i64>, chunks: Vec<Vec<i64>>) -> PyResult<()> {
        let rows = indices(&rows, "rows")?;
        let chunks = sequences(&chunks, "chunks")?;
        self.with_engine(py, |ro, e| ro.tool_result(e, &rows, &chunks))
    }

    /// Decode the next turn on each row (batched), each stopping on its own stop ids or max_new.
    #[pyo3(signature = (rows, max_new, stop=None, window=None))]
    fn decode_turn(
        &mut self,
        py: Python<'_>,
        rows: Vec<i64>,
        max_new: &Bound<'_, PyAny>,
        stop: Option<&Bound<'_, PyAny>>,
        window: Option<usize>,
    ) -> PyResult<Vec<Turn>> {
        let rows = indices(&rows, "rows")?;
        let limits = turn_limits(max_new, stop, rows.len())?;
        let window = match window {
            Some(w) => w,
            None => self.engine.borrow(py).inner.max_window(),
        };
        let got = self.with_engine(py, |ro, e| ro.decode_turn(e, &rows, &limits, window))?;
        Ok(turns(&got))
    }

    /// The turns of the episode in `row` so far, or `None` when the row has no episode.
    fn episode(&self, row: usize) -> Option<Vec<Turn>> {
        self.inner.episode(row).map(|ep| turns(&ep.turns))
    }

    /// End the episode in `row` and return its turns (`None` when it had none); the row is reset
    /// (its K/V blocks go back to the pool) and free for a new episode.
    fn finish(&mut self, py: Python<'_>, row: usize) -> PyResult<Option<Vec<Turn>>> {
        let ep = self.with_engine(py, |ro, e| ro.finish(e, row))?;
        Ok(ep.map(|ep| turns(&ep.turns)))
    }
}
