//! One error type for the crate: every variant names what was wrong (which row, tensor, limit).

use thiserror::Error;

/// Everything that can go wrong in kvdecode. Nothing here is a panic: bad input, model files
/// included, comes back as one of these and leaves all state as it was.
#[derive(Debug, Error)]
pub enum Error {
    /// No usable GPU adapter or device, or the device reported an error (out of memory, validation).
    #[error("GPU: {0}")]
    Device(String),
    /// The GPU device was lost (driver reset, destroyed, reclaimed by the browser). Nothing on it
    /// can be used any more; create a new `Gpu` and `Engine`.
    #[error("GPU device lost ({0}); create a new Gpu and Engine")]
    DeviceLost(String),
    /// The model configuration is inconsistent.
    #[error("invalid model config: {0}")]
    Config(String),
    /// A weight tensor is missing, has the wrong shape, or an unsupported dtype.
    #[error("weights: {0}")]
    Weights(String),
    /// A model or data file could not be read or parsed.
    #[error("{path}: {msg}")]
    File {
        /// The file.
        path: String,
        /// What was wrong with it.
        msg: String,
    },
    /// The arguments of a call (an append, a reset, sampling parameters) are invalid.
    #[error("invalid input: {0}")]
    Input(String),
    /// A row would grow beyond the cache's `max_len`.
    #[error("KV cache full: row {row} holds {len} tokens, appending {n_new} would exceed max_len {max_len}")]
    CacheFull {
        /// The cache row.
        row: usize,
        /// Tokens already stored in the row.
        len: usize,
        /// Tokens the call wanted to append.
        n_new: usize,
        /// The cache capacity per row.
        max_len: usize,
    },
    /// The global K/V block pool has too few free blocks for what a call needs (an append, a
    /// fork across shards). The scheduler preempts rows instead; direct callers free rows (reset,
    /// rollback) or build the engine with a larger pool ([`crate::EngineOptions::pool_blocks`]).
    #[error(
        "K/V block pool full: row {row} needs {needed} more blocks of {block_len} positions in shard {shard}, \
         {free} of its {blocks} blocks are free (EngineOptions::pool_blocks or pool_bytes sets the pool's size)"
    )]
    OutOfBlocks {
        /// A row of the call that needs blocks from that shard.
        row: usize,
        /// The pool shard (one storage binding) the blocks would come from.
        shard: usize,
        /// Blocks the call needs from it.
        needed: usize,
        /// Its free blocks.
        free: usize,
        /// Its size in blocks.
        blocks: usize,
        /// Positions per block.
        block_len: usize,
    },
    /// A buffer would exceed a device limit (and cannot be split further).
    #[error("limit: {0}")]
    Limit(String),
}

/// Result with [`enum@Error`].
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn file_err(path: impl AsRef<std::path::Path>, msg: impl std::fmt::Display) -> Error {
    Error::File { path: path.as_ref().display().to_string(), msg: msg.to_string() }
}
