//! The engine: a KV cache of `rows` rows on the GPU and the calls that feed and decode them.

use kvdecode::{Batch, StepOutput, Want};
use numpy::ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray2, PyArray3, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;

use crate::model::Model;
use crate::{default_gpu, indices, invalid, to_py, token_ids};

/// How a row picks its next token: greedy (temperature 0) or a seeded draw. A draw depends only on
/// (seed, position, token), so a row's tokens never depend on what else shares the batch.
#[pyclass(module = "kvdecode._kvdecode", frozen, from_py_object)]
#[derive(Clone, Copy)]
pub struct Sampler {
    pub(crate) inner: kvdecode::Sampler,
}

#[pymethods]
impl Sampler {
    #[new]
    #[pyo3(signature = (temperature=0.0, seed=0, top_k=0, top_p=1.0, min_p=0.0, logprobs="scaled"))]
    fn new(temperature: f32, seed: u32, top_k: u32, top_p: f32, min_p: f32, logprobs: &str) -> PyResult<Self> {
        let mode = kvdecode::LogprobMode::parse(logprobs).map_err(|e| invalid(format!("Sampler: {e}")))?;
        let inner =
            kvdecode::Sampler { temperature, seed, top_k, top_p, min_p, logprobs: mode, ..kvdecode::Sampler::GREEDY };
        // the check names a row; a sampler built on its own has none yet
        inner.check(0).map_err(|e| invalid(e.to_string().replace("invalid input: row 0: ", "Sampler: ")))?;
        Ok(Sampler { inner })
    }

    /// 0: greedy. Otherwise draws from softmax(logits / temperature).
    #[getter]
    fn temperature(&self) -> f32 {
        self.inner.temperature
    }

    /// Seed of the row's draws.
    #[getter]
    fn seed(&self) -> u32 {
        self.inner.seed
    }

    /// Keep the `top_k` most likely tokens (0: all).
    #[getter]
    fn top_k(&self) -> u32 {
        self.inner.top_k
    }

    /// Then the smallest set reaching probability `top_p` (1: all).
    #[getter]
    fn top_p(&self) -> f32 {
        self.inner.top_p
    }

    /// Then the tokens with at least `min_p` times the most likely one's probability (0: all).
    #[getter]
    fn min_p(&self) -> f32 {
        self.inner.min_p
    }

    /// Which distribution logprobs are of: "raw", "scaled" (the default) or "processed".
    #[getter]
    fn logprobs(&self) -> &'static str {
        self.inner.logprobs.name()
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "Sampler(temperature={}, seed={}, top_k={}, top_p={}, min_p={}, logprobs={:?})",
            s.temperature,
            s.seed,
            s.top_k,
            s.top_p,
            s.min_p,
            s.logprobs.name()
        )
    }
}

/// `None` (greedy for all), one `Sampler` for all `n` rows, or a sequence of `n` samplers.
pub(crate) fn samplers(obj: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Vec<kvdecode::Sampler>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(vec![kvdecode::Sampler::GREEDY; n]);
    };
    if let Ok(s) = obj.extract::<Sampler>() {
        return Ok(vec![s.inner; n]);
    }
    let v: Vec<Sampler> =
        obj.extract().map_err(|_| invalid("sampler: expected None, a Sampler or a sequence of Samplers"))?;
    if v.len() != n {
        return Err(invalid(format!("sampler: {} samplers for {n} rows", v.len())));
    }
    Ok(v.into_iter().map(|s| s.inner).collect())
}

/// `max_new` (an int or one per row) and `stop` (None, ids shared by all rows, or one list per
/// row) as per-row turn limits.
pub(crate) fn turn_limits(
    max_new: &Bound<'_, PyAny>,
    stop: Option<&Bound<'_, PyAny>>,
    n: usize,
) -> PyResult<Vec<kvdecode::TurnLimit>> {
    let max_new: Vec<usize> = match max_new.extract::<i64>() {
        Ok(m) => indices(&vec![m; n], "max_new")?,
        Err(_) => {
            let v: Vec<i64> = max_new.extract().map_err(|_| invalid("max_new: expected an int or one int per row"))?;
            if v.len() != n {
                return Err(invalid(format!("max_new: {} values for {n} rows", v.len())));
            }
            indices(&v, "max_new")?
        }
    };
    let stop: Vec<Vec<u32>> = match stop.filter(|s| !s.is_none()) {
        None => vec![Vec::new(); n],
        Some(s) => match s.extract::<Vec<i64>>() {
            Ok(shared) => vec![token_ids(&shared, "stop")?; n],
            Err(_) => {
                let per_row: Vec<Vec<i64>> = s
                    .extract()
                    .map_err(|_| invalid("stop: expected None, a list of ids, or one list of ids per row"))?;
                if per_row.len() != n {
                    return Err(invalid(format!("stop: {} lists for {n} rows", per_row.len())));
                }
                per_row.iter().enumerate().map(|(i, s)| token_ids(s, &format!("stop[{i}]"))).collect::<PyResult<_>>()?
            }
        },
    };
    Ok(max_new.into_iter().zip(stop).map(|(max_new, stop)| kvdecode::TurnLimit { max_new, stop }).collect())
}

/// One decoded turn of a row: the sampled tokens (the stop token included when it stopped on
/// one), their log-probabilities, and whether it ended on a stop token.
#[pyclass(module = "kvdecode._kvdecode", frozen)]
pub struct Turn {
    /// Sampled token ids.
    #[pyo3(get)]
    tokens: Vec<u32>,
    /// Log-probability of each token under the distribution it was drawn from.
    #[pyo3(get)]
    logprobs: Vec<f32>,
    /// Whether the turn ended on a stop token (else on `max_new`).
    #[pyo3(get)]
    stopped: bool,
    /// The weights version its tokens were sampled under (`Engine.weights_version` then).
    #[pyo3(get)]
    weights_version: u64,
    /// The version of the LoRA adapter the row decoded with, or `None` on the base model.
    #[pyo3(get)]
    adapter_version: Option<u64>,
}

impl From<kvdecode::Turn> for Turn {
    fn from(t: kvdecode::Turn) -> Self {
        let kvdecode::Turn { tokens, logprobs, stopped, weights_version, adapter_version } = t;
        Turn { tokens, logprobs, stopped, weights_version, adapter_version }
    }
}

#[pymethods]
impl Turn {
    fn __repr__(&self) -> String {
        format!("Turn(tokens={:?}, stopped={}, weights_version={})", self.tokens, self.stopped, self.weights_version)
    }

    fn __len__(&self) -> usize {
        self.tokens.len()
    }
}

/// The engine: the model's weights on the GPU and a KV cache of `rows` rows of `max_len` tokens.
#[pyclass(module = "kvdecode._kvdecode")]
pub struct Engine {
    pub(crate) inner: kvdecode::Engine,
}

/// `(ids, width, n_new, rows)` of a right-padded chunk `[R, C]`: `n_new` defaults to `C` per row.
type Chunk = (Vec<u32>, usize, Vec<usize>, Option<Vec<usize>>);

fn chunk(ids: &PyReadonlyArray2<'_, i64>, n_new: Option<Vec<i64>>, rows: Option<Vec<i64>>) -> PyResult<Chunk> {
    let (r, c) = ids.as_array().dim();
    let flat = token_ids(ids.as_slice()?, "ids")?;
    let n_new = match n_new {
        Some(n) => {
            if n.len() != r {
                return Err(invalid(format!("n_new has {} entries, ids has {r} rows", n.len())));
            }
            indices(&n, "n_new")?
        }
        None => vec![c; r],
    };
    let rows = rows.map(|v| indices(&v, "rows")).transpose()?;
    Ok((flat, c, n_new, rows))
}

fn kv_dtype(name: &str) -> PyResult<kvdecode::KvDtype> {
    kvdecode::KvDtype::parse(name).map_err(to_py)
}

/// The dtype `name` of the keyword `what` (`weights`, `lora_dtype`).
fn weight_dtype(what: &str, name: &str) -> PyResult<kvdecode::WeightDtype> {
    match name {
        "f32" => Ok(kvdecode::WeightDtype::F32),
        "f16" => Ok(kvdecode::WeightDtype::F16),
        other => Err(invalid(format!("{what}: {other:?} is not f32 or f16"))),
    }
}

impl Engine {
    /// `row` when it is a row of the cache, else an error naming the call and the row count.
    fn row(&self, row: usize, call: &str) -> PyResult<usize> {
        let rows = self.inner.cache().rows();
        if row >= rows {
            return Err(invalid(format!("{call}: row {row} is outside the cache ({rows} rows)")));
        }
        Ok(row)
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model, rows, max_len, *, kv="f32", weights="f32", rollback=8, beyond_trained_context=false,
        block_len=16, pool_blocks=None, prompt_cache=true, record_routes=false, max_loras=0, max_lora_rank=16, lora_dtype="f32"))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    fn new(
        py: Python<'_>,
        model: &Model,
        rows: usize,
        max_len: usize,
        kv: &str,
        weights: &str,
        rollback: usize,
        beyond_trained_context: bool,
        block_len: usize,
        pool_blocks: Option<usize>,
        prompt_cache: bool,
        record_routes: bool,
        max_loras: usize,
        max_lora_rank: usize,
        lora_dtype: &str,
    ) -> PyResult<Self> {
        let opts = kvdecode::EngineOptions {
            kv: kv_dtype(kv)?,
            weights: weight_dtype("weights", weights)?,
            rollback,
            beyond_trained_context,
            block_len,
            pool_blocks,
            prompt_cache,
            record_routes,
            max_loras,
            max_lora_rank,
            lora_dtype: weight_dtype("lora_dtype", lora_dtype)?,
            ..kvdecode::EngineOptions::new(rows, max_len)
        };
        let gpu = default_gpu(py)?;
        let inner = model.engine(py, &gpu, opts)?;
        Ok(Engine { inner })
    }

    /// Feed a right-padded chunk (native form of `Engine.append`).
    #[pyo3(signature = (ids, n_new=None, rows=None))]
    fn append<'py>(
        &mut self,
        py: Python<'py>,
        ids: PyReadonlyArray2<'py, i64>,
        n_new: Option<Vec<i64>>,
        rows: Option<Vec<i64>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (ids, width, n_new, rows) = chunk(&ids, n_new, rows)?;
        let e = &mut self.inner;
        let logits = py.detach(|| e.append(&ids, width, &n_new, rows.as_deref())).map_err(to_py)?;
        let (n, vocab) = (logits.valid.len(), logits.vocab);
        let mut data = logits.data;
        // rows that received no token hold stale values in the engine's buffer: NaN says so
        for (r, _) in logits.valid.iter().enumerate().filter(|(_, &v)| !v) {
            data[r * vocab..(r + 1) * vocab].fill(f32::NAN);
        }
        let arr = Array2::from_shape_vec((n, vocab), data).map_err(|e| invalid(format!("logits: {e}")))?;
        Ok(arr.into_pyarray(py))
    }

    /// Feed a right-padded chunk and sample each row's next token on the GPU (native form).
    #[pyo3(signature = (ids, n_new=None, rows=None, sampler=None))]
    #[allow(clippy::type_complexity)]
    fn append_sample(
        &mut self,
        py: Python<'_>,
        ids: PyReadonlyArray2<'_, i64>,
        n_new: Option<Vec<i64>>,
        rows: Option<Vec<i64>>,
        sampler: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<Option<u32>>, Vec<Option<f32>>)> {
        let (ids, width, n_new, rows) = chunk(&ids, n_new, rows)?;
        let samplers = samplers(sampler, n_new.len())?;
        let e = &mut self.inner;
        let batch = Batch::padded(&ids, width, &n_new, rows.as_deref()).samplers(&samplers[..]);
        let got = py.detach(|| e.step(&batch, Want::Sampled).and_then(StepOutput::into_sampled)).map_err(to_py)?;
        Ok(got.into_iter().map(|o| (o.as_ref().map(|x| x.token), o.map(|x| x.logprob))).unzip())
    }

    /// Append a chunk and report every token after each row's first as a draw there would:
    /// per row, (logprobs, kept counts, top alternatives) (native form of `Engine.score`).
    #[pyo3(signature = (ids, n_new=None, rows=None, sampler=None, top=0))]
    #[allow(clippy::type_complexity)]
    fn score(
        &mut self,
        py: Python<'_>,
        ids: PyReadonlyArray2<'_, i64>,
        n_new: Option<Vec<i64>>,
        rows: Option<Vec<i64>>,
        sampler: Option<&Bound<'_, PyAny>>,
        top: u32,
    ) -> PyResult<Vec<(Vec<f32>, Vec<u32>, Vec<Vec<(u32, f32)>>)>> {
        let (ids, width, n_new, rows) = chunk(&ids, n_new, rows)?;
        let samplers: Vec<kvdecode::Sampler> =
            samplers(sampler, n_new.len())?.into_iter().map(|s| s.with_top_logprobs(top)).collect();
        let e = &mut self.inner;
        let got =
            py.detach(|| e.append_scored(&ids, width, &n_new, rows.as_deref(), &samplers, None)).map_err(to_py)?;
        Ok(got
            .into_iter()
            .map(|row| {
                let lps = row.iter().map(|s| s.logprob).collect();
                let kept = row.iter().map(|s| s.kept).collect();
                (lps, kept, row.into_iter().map(|s| s.top).collect())
            })
            .collect())
    }

    /// Multi-step decode: `steps` tokens per row with one readback (native form).
    #[pyo3(signature = (rows, first, steps, sampler=None))]
    #[allow(clippy::type_complexity)]
    fn decode_steps<'py>(
        &mut self,
        py: Python<'py>,
        rows: Vec<i64>,
        first: Vec<i64>,
        steps: usize,
        sampler: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyArray2<i64>>, Bound<'py, PyArray2<f32>>)> {
        let rows = indices(&rows, "rows")?;
        let first = token_ids(&first, "first")?;
        let samplers = samplers(sampler, rows.len())?;
        let e = &mut self.inner;
        let got = py.detach(|| e.decode_steps_logprobs(&rows, &first, &samplers, steps)).map_err(to_py)?;
        let n = got.len();
        let ids: Vec<i64> = got.iter().flat_map(|(t, _)| t.iter().map(|&x| x as i64)).collect();
        let lps: Vec<f32> = got.into_iter().flat_map(|(_, l)| l).collect();
        let ids = Array2::from_shape_vec((n, steps), ids).map_err(|e| invalid(format!("decode_steps: {e}")))?;
        let lps = Array2::from_shape_vec((n, steps), lps).map_err(|e| invalid(format!("decode_steps: {e}")))?;
        Ok((ids.into_pyarray(py), lps.into_pyarray(py)))
    }

    /// Decode one turn per row until a stop token or `max_new` (native form).
    #[pyo3(signature = (rows, first, max_new, stop=None, window=None, sampler=None))]
    #[allow(clippy::too_many_arguments)]
    fn decode_turns(
        &mut self,
        py: Python<'_>,
        rows: Vec<i64>,
        first: Vec<i64>,
        max_new: &Bound<'_, PyAny>,
        stop: Option<&Bound<'_, PyAny>>,
        window: Option<usize>,
        sampler: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Turn>> {
        let rows = indices(&rows, "rows")?;
        let first = token_ids(&first, "first")?;
        let limits = turn_limits(max_new, stop, rows.len())?;
        let samplers = samplers(sampler, rows.len())?;
        let window = window.unwrap_or(self.inner.max_window());
        let e = &mut self.inner;
        let turns =
            py.detach(|| e.decode_turns(&rows, &first, &samplers, &limits, window, &|_, _| false)).map_err(to_py)?;
        Ok(turns.into_iter().map(Turn::from).collect())
    }

    /// Copy row `src` (its K/V, ring and history) into each row of `dst`.
    fn fork(&mut self, py: Python<'_>, src: i64, dst: Vec<i64>) -> PyResult<()> {
        let src = indices(&[src], "src")?[0];
        let dst = indices(&dst, "dst")?;
        let e = &mut self.inner;
        py.detach(|| e.fork(src, &dst)).map_err(to_py)
    }

    /// Drop the last `n[i]` tokens of row `rows[i]` (exact, up to `max_rollback(row)` tokens).
    fn rollback(&mut self, py: Python<'_>, rows: Vec<i64>, n: Vec<i64>) -> PyResult<()> {
        let rows = indices(&rows, "rows")?;
        let n = indices(&n, "n")?;
        let e = &mut self.inner;
        py.detach(|| e.rollback(&rows, &n)).map_err(to_py)
    }

    /// Empty `rows` (all rows when `None`).
    #[pyo3(signature = (rows=None))]
    fn reset(&mut self, py: Python<'_>, rows: Option<Vec<i64>>) -> PyResult<()> {
        let rows = match rows {
            Some(r) => indices(&r, "rows")?,
            None => (0..self.inner.cache().rows()).collect(),
        };
        let e = &mut self.inner;
        py.detach(|| e.reset(&rows)).map_err(to_py)
    }

    /// Tokens held by each row.
    #[getter]
    fn lens(&self) -> Vec<usize> {
        self.inner.cache().lens().to_vec()
    }

    /// The token ids row `row` holds, in order.
    fn history(&self, row: usize) -> PyResult<Vec<u32>> {
        Ok(self.inner.cache().history(self.row(row, "history")?).to_vec())
    }

    /// The experts every position of row `row` was routed to, `[len, MoE layers, top_k]`
    /// (`record_routes`).
    fn routes<'py>(&self, py: Python<'py>, row: usize) -> PyResult<Bound<'py, PyArray3<u32>>> {
        let row = self.row(row, "routes")?;
        let e = &self.inner;
        let stride = e.route_stride().unwrap_or(1);
        let top_k = e.config().moe.as_ref().map_or(1, |m| m.top_k);
        let routes = py.detach(|| e.routes(row)).map_err(to_py)?;
        let shape = (routes.len() / stride, stride / top_k, top_k);
        let arr = Array3::from_shape_vec(shape, routes).map_err(|e| invalid(format!("routes: {e}")))?;
        Ok(arr.into_pyarray(py))
    }

    /// `(MoE layers, top_k)` of a mixture of experts' routes (`None`: a dense model).
    #[getter]
    fn route_shape(&self) -> Option<(usize, usize)> {
        let m = self.inner.config().moe.as_ref()?;
        Some((m.layers.len(), m.top_k))
    }

    /// Tokens row `row` can roll back exactly now.
    fn max_rollback(&self, row: usize) -> PyResult<usize> {
        Ok(self.inner.cache().max_rollback(self.row(row, "max_rollback")?))
    }

    /// Bytes of the KV cache on the GPU.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.cache().nbytes()
    }

    /// Bytes a cache that kept every layer's K/V for every position would take.
    #[getter]
    fn naive_nbytes(&self) -> u64 {
        self.inner.cache().naive_nbytes()
    }

    /// Bytes of K/V the rows use now: global K/V blocks held by at least one row (once each,
    /// however many forks share them) plus the rings.
    #[getter]
    fn used_nbytes(&self) -> u64 {
        self.inner.cache().used_nbytes()
    }

    /// The global K/V block pool now, as a dict: block_len, total, free, used, shared,
    /// referenced, cached, evictable (see `kvdecode::BlockUsage`).
    fn block_usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let u = self.inner.cache().block_usage();
        let d = pyo3::types::PyDict::new(py);
        for (k, v) in [
            ("block_len", u.block_len),
            ("total", u.total),
            ("free", u.free),
            ("used", u.used),
            ("shared", u.shared),
            ("referenced", u.referenced),
            ("cached", u.cached),
            ("evictable", u.evictable),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Start the empty `row` on the longest prefix of `prompt` the prompt cache holds; returns the
    /// tokens it now holds (append the rest of the prompt next).
    fn reuse_prefix(&mut self, py: Python<'_>, row: usize, prompt: Vec<i64>) -> PyResult<usize> {
        let row = self.row(row, "reuse_prefix")?;
        let ids = token_ids(&prompt, "prompt")?;
        let e = &mut self.inner;
        py.detach(|| e.reuse_prefix(row, &ids)).map_err(to_py)
    }

    /// What the prompt cache did: (lookups, prompt tokens looked up, tokens found, evictions).
    fn prompt_cache_stats(&self) -> (usize, usize, usize, usize) {
        let s = self.inner.cache().prompt_cache_stats();
        (s.lookups, s.prompt_tokens, s.hit_tokens, s.evicted)
    }

    /// Cache rows.
    #[getter]
    fn rows(&self) -> usize {
        self.inner.cache().rows()
    }

    /// Capacity of each row, in tokens.
    #[getter]
    fn max_len(&self) -> usize {
        self.inner.cache().max_len()
    }

    /// Vocabulary size (columns of the logits).
    #[getter]
    fn vocab(&self) -> usize {
        self.inner.config().vocab
    }

    /// Most steps one `decode_steps` call (or one readback of `decode_turns`) can take.
    #[getter]
    fn max_window(&self) -> usize {
        self.inner.max_window()
    }

    /// K/V storage type (`f32`, `f16` or `bf16`).
    #[getter]
    fn kv(&self) -> &'static str {
        self.inner.cache().dtype().name()
    }

    /// Replace weights in place (`Engine.load_weights` in the Python layer): one
    /// `(name, dtype, shape, bytes as a 1-D uint8 array)` per tensor; `in_flight` is `"keep"`,
    /// `"recompute"` or `"reset"`. Returns (version, tensors written, bytes written, names
    /// ignored). The GIL is released while the weights are checked and uploaded.
    #[pyo3(signature = (tensors, in_flight="keep"))]
    fn load_weights(
        &mut self,
        py: Python<'_>,
        tensors: Vec<(String, String, Vec<usize>, PyReadonlyArray1<'_, u8>)>,
        in_flight: &str,
    ) -> PyResult<(u64, usize, u64, Vec<String>)> {
        let mode = kvdecode::InFlight::parse(in_flight).map_err(to_py)?;
        let host = host_tensors(&tensors)?;
        let e = &mut self.inner;
        let r = py.detach(|| e.update_weights(&host, mode)).map_err(to_py)?;
        Ok((r.version, r.tensors, r.bytes, r.ignored))
    }

    /// Make a PEFT adapter resident under `name`: from `config_json` (adapter_config.json's
    /// object) and its tensors by PEFT's names, as `load_weights` takes them.
    fn load_lora(
        &mut self,
        py: Python<'_>,
        name: &str,
        config_json: &str,
        tensors: Vec<(String, String, Vec<usize>, PyReadonlyArray1<'_, u8>)>,
    ) -> PyResult<()> {
        let config: serde_json::Value =
            serde_json::from_str(config_json).map_err(|e| invalid(format!("adapter config: not JSON: {e}")))?;
        let host = host_tensors(&tensors)?;
        let e = &mut self.inner;
        py.detach(|| {
            let adapter = kvdecode::LoraAdapter::from_peft(&config, &host, e.config())?;
            e.load_lora(name, &adapter)
        })
        .map_err(to_py)
    }

    /// Make the PEFT adapter folder `path` resident under `name`.
    fn load_lora_path(&mut self, py: Python<'_>, name: &str, path: std::path::PathBuf) -> PyResult<()> {
        let e = &mut self.inner;
        py.detach(|| e.load_lora_path(name, &path)).map_err(to_py)
    }

    /// Replace some of adapter `name`'s tensors in place; returns (version, modules, bytes, rows).
    #[pyo3(signature = (name, tensors, in_flight="keep"))]
    fn update_lora(
        &mut self,
        py: Python<'_>,
        name: &str,
        tensors: Vec<(String, String, Vec<usize>, PyReadonlyArray1<'_, u8>)>,
        in_flight: &str,
    ) -> PyResult<(u64, usize, u64, Vec<usize>)> {
        let mode = kvdecode::InFlight::parse(in_flight).map_err(to_py)?;
        let host = host_tensors(&tensors)?;
        let e = &mut self.inner;
        let r = py.detach(|| e.update_lora(name, &host, mode)).map_err(to_py)?;
        Ok((r.version, r.modules, r.bytes, r.rows))
    }

    /// Free adapter `name`'s slot (an error while rows use it).
    fn unload_lora(&mut self, name: &str) -> PyResult<()> {
        self.inner.unload_lora(name).map_err(to_py)
    }

    /// Make the empty `row` decode with adapter `name`, or the base model (`None`).
    #[pyo3(signature = (row, name=None))]
    fn set_adapter(&mut self, row: usize, name: Option<&str>) -> PyResult<()> {
        self.inner.set_adapter(row, name).map_err(to_py)
    }

    /// `(name, version)` of `row`'s adapter, or `None`.
    fn adapter(&self, row: usize) -> Option<(String, u64)> {
        self.inner.adapter(row).map(|(n, v)| (n.to_string(), v))
    }

    /// The resident adapters' `(name, version)`.
    #[getter]
    fn loras(&self) -> Vec<(String, u64)> {
        self.inner.loras()
    }

    /// Replace weights from a file or directory (safetensors, a Hugging Face directory, GGUF).
    #[pyo3(signature = (path, in_flight="keep"))]
    fn load_weights_from_path(&mut self, py: Python<'_>, path: std::path::PathBuf, in_flight: &str) -> PyResult<u64> {
        let mode = kvdecode::InFlight::parse(in_flight).map_err(to_py)?;
        let e = &mut self.inner;
        py.detach(|| e.update_weights_from_path(&path, mode)).map(|r| r.version).map_err(to_py)
    }

    /// The policy version: 0 for the weights the engine was built with, plus one per update.
    #[getter]
    fn weights_version(&self) -> u64 {
        self.inner.weights_version()
    }

    /// Release the GPU memory of the weights and/or the K/V cache, keeping them on the host.
    #[pyo3(signature = (weights=true, kv=true))]
    fn sleep(&mut self, py: Python<'_>, weights: bool, kv: bool) -> PyResult<()> {
        let e = &mut self.inner;
        py.detach(|| e.sleep(kvdecode::Sleep { weights, kv })).map_err(to_py)
    }

    /// Bring back what `sleep` released.
    fn wake(&mut self, py: Python<'_>) -> PyResult<()> {
        let e = &mut self.inner;
        py.detach(|| e.wake()).map_err(to_py)
    }

    /// `(weights, kv)` released by `sleep`, or `None` when awake.
    #[getter]
    fn asleep(&self) -> Option<(bool, bool)> {
        self.inner.asleep().map(|s| (s.weights, s.kv))
    }

    /// Device memory: this engine's buffers, every engine's on the device, and wgpu's allocator
    /// (allocated, reserved) where the backend reports it.
    fn memory_report(&self) -> (u64, u64, Option<(u64, u64)>) {
        let r = self.inner.memory_report();
        (r.engine_bytes, r.device_bytes, r.allocator)
    }

    fn __repr__(&self) -> String {
        let c = self.inner.cache();
        format!("Engine(rows={}, max_len={}, kv={:?}, nbytes={})", c.rows(), c.max_len(), c.dtype().name(), c.nbytes())
    }
}

/// `(name, dtype, shape, bytes)` from the Python layer as host tensors (no copy).
fn host_tensors<'a>(
    tensors: &'a [(String, String, Vec<usize>, PyReadonlyArray1<'_, u8>)],
) -> PyResult<Vec<kvdecode::HostTensor<'a>>> {
    let mut host = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, data) in tensors {
        let dtype = kvdecode::HostDtype::parse(dtype).map_err(|e| invalid(format!("tensor `{name}`: {e}")))?;
        let bytes = data.as_slice().map_err(|_| invalid(format!("tensor `{name}`: its bytes are not contiguous")))?;
        host.push(kvdecode::HostTensor { name: name.clone(), shape: shape.clone(), dtype, bytes });
    }
    Ok(host)
}
