//! The native part of the `kvdecode` Python package: PyO3 classes over the Rust engine.
//!
//! The Python layer (`python/kvdecode/__init__.py`) turns array-likes (numpy, torch, anything
//! with `__array__` or DLPack) into contiguous int64 numpy arrays and re-exports these classes
//! with their docs; everything here takes those arrays and plain Python ints. Every call that
//! waits for the GPU releases the GIL, so a training loop's other threads keep running.

use std::sync::{Arc, Mutex};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

mod engine;
mod model;
mod rollouts;
mod scheduler;

create_exception!(_kvdecode, Error, PyException, "Every error kvdecode raises; the message names what was wrong.");
create_exception!(_kvdecode, InvalidInput, Error, "The arguments of a call are invalid (which row, id, length).");
create_exception!(_kvdecode, CacheFull, Error, "A row would grow beyond the engine's max_len.");
create_exception!(
    _kvdecode,
    OutOfBlocks,
    CacheFull,
    "The K/V block pool has too few free blocks for the call (free rows, or a larger pool_blocks)."
);
create_exception!(
    _kvdecode,
    ModelFileError,
    Error,
    "A model file or configuration could not be read or is inconsistent."
);
create_exception!(_kvdecode, DeviceError, Error, "No usable GPU, a device limit, or an error the device reported.");
create_exception!(_kvdecode, DeviceLost, DeviceError, "The GPU device was lost; create a new Engine.");

/// The engine's error as the matching Python exception, with the engine's message.
pub(crate) fn to_py(e: kvdecode::Error) -> PyErr {
    use kvdecode::Error as E;
    let msg = e.to_string();
    match e {
        E::Input(_) => InvalidInput::new_err(msg),
        E::CacheFull { .. } => CacheFull::new_err(msg),
        E::OutOfBlocks { .. } => OutOfBlocks::new_err(msg),
        E::Config(_) | E::Weights(_) | E::File { .. } => ModelFileError::new_err(msg),
        E::DeviceLost(_) => DeviceLost::new_err(msg),
        E::Device(_) | E::Limit(_) => DeviceError::new_err(msg),
    }
}

/// `InvalidInput` with `msg`, worded like the engine's own input errors.
pub(crate) fn invalid(msg: impl std::fmt::Display) -> PyErr {
    InvalidInput::new_err(format!("invalid input: {msg}"))
}

/// Python ints as indices (rows, counts), each checked to be non-negative; the error names the
/// argument and the position.
pub(crate) fn indices(v: &[i64], what: &str) -> PyResult<Vec<usize>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| usize::try_from(x).map_err(|_| invalid(format!("{what}[{i}] = {x} is negative"))))
        .collect()
}

/// Token ids as u32, each checked to fit; the error names the argument and the position.
pub(crate) fn token_ids(v: &[i64], what: &str) -> PyResult<Vec<u32>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| u32::try_from(x).map_err(|_| invalid(format!("{what}[{i}] = {x} is not a token id"))))
        .collect()
}

/// One GPU device per process, shared by every engine: creating a device is slow, and engines
/// on one device share its memory budget. A lost device is replaced on the next engine.
static DEVICE: Mutex<Option<kvdecode::Gpu>> = Mutex::new(None);

pub(crate) fn default_gpu(py: Python<'_>) -> PyResult<kvdecode::Gpu> {
    let live = || -> PyResult<Option<kvdecode::Gpu>> {
        let slot = DEVICE.lock().map_err(|_| DeviceError::new_err("the device lock is poisoned"))?;
        Ok(slot.as_ref().filter(|g| !g.is_lost()).cloned())
    };
    if let Some(g) = live()? {
        return Ok(g);
    }
    // made without the lock: holding it while the GIL is released would deadlock against a
    // thread that holds the GIL and waits for the lock
    let gpu = py.detach(kvdecode::Gpu::new).map_err(to_py)?;
    let mut slot = DEVICE.lock().map_err(|_| DeviceError::new_err("the device lock is poisoned"))?;
    match slot.as_ref().filter(|g| !g.is_lost()) {
        Some(other) => Ok(other.clone()), // another thread made one meanwhile: share it
        None => {
            *slot = Some(gpu.clone());
            Ok(gpu)
        }
    }
}

/// The adapter the engines run on, in one line (for logs).
#[pyfunction]
fn device(py: Python<'_>) -> PyResult<String> {
    Ok(default_gpu(py)?.describe())
}

/// Bytes of buffers the engines on the shared device hold now, and the budget (`None`: none).
/// An engine's buffers are returned when it is garbage-collected.
#[pyfunction]
fn device_memory(py: Python<'_>) -> PyResult<(u64, Option<u64>)> {
    let gpu = default_gpu(py)?;
    Ok((gpu.memory_in_use(), gpu.memory_budget()))
}

/// Shared ownership of loaded weights between a `Model` and the Python objects made from it.
pub(crate) type Weights = Arc<kvdecode::ModelWeights>;

#[pymodule]
fn _kvdecode(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("InvalidInput", py.get_type::<InvalidInput>())?;
    m.add("CacheFull", py.get_type::<CacheFull>())?;
    m.add("OutOfBlocks", py.get_type::<OutOfBlocks>())?;
    m.add("ModelFileError", py.get_type::<ModelFileError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("DeviceLost", py.get_type::<DeviceLost>())?;
    m.add("CHUNK", kvdecode::CHUNK)?;
    m.add_function(wrap_pyfunction!(device, m)?)?;
    m.add_function(wrap_pyfunction!(device_memory, m)?)?;
    m.add_function(wrap_pyfunction!(model::load, m)?)?;
    m.add_class::<model::Model>()?;
    m.add_class::<model::Tokenizer>()?;
    m.add_class::<engine::Sampler>()?;
    m.add_class::<engine::Turn>()?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<rollouts::Rollouts>()?;
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<scheduler::Completion>()?;
    m.add_class::<scheduler::Token>()?;
    Ok(())
}
