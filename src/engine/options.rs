//! What an engine is built with and what its calls return: [`EngineOptions`], [`Logits`],
//! [`Stats`].

use crate::cache::{CacheOptions, KvDtype};
#[allow(unused_imports)] // named by the docs
use crate::engine::Engine;
#[allow(unused_imports)] // named by the docs
use crate::error::Error;
use crate::gpu::variants::{AttentionKernel, Fusion, MatmulKernel};
use crate::gpu::weights::WeightDtype;
#[allow(unused_imports)] // named by the docs
use crate::model::config::ModelConfig;

/// How to build an [`Engine`].
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Cache rows (sequences decoded side by side).
    pub rows: usize,
    /// Capacity of each row, in tokens.
    pub max_len: usize,
    /// K/V storage type.
    pub kv: KvDtype,
    /// Weight storage type on the GPU.
    pub weights: WeightDtype,
    /// Tokens a row can roll back exactly (spare ring slots). It bounds the multi-step decode
    /// window (`rollback + 1` steps per readback) and speculative drafts (`rollback` tokens).
    pub rollback: usize,
    /// Tokens (rows x width) for which [`Engine::append_all_logits`] can return logits at once.
    pub all_logits_tokens: usize,
    /// Allow `max_len` beyond the model's trained context ([`ModelConfig::context_len`]). Off by
    /// default: positions the model never saw in training give output that only looks right.
    pub beyond_trained_context: bool,
    /// Logit bias entries each row can hold ([`Engine::set_logit_bias`]; penalties add one per
    /// distinct generated token).
    pub logit_bias_slots: usize,
    /// Which attention kernel to build. Defaults to the `KVDECODE_ATTENTION` environment variable
    /// (`serial`, `split-group` or `split-head`), else [`AttentionKernel::Serial`] when `KVDECODE_PORTABLE=1`, else
    /// [`AttentionKernel::Auto`].
    pub attention: AttentionKernel,
    /// Positions per block of the global K/V pool (a power of two; 16 by default). Smaller
    /// blocks waste less of a row's last block and share forks' prefixes more finely.
    pub block_len: usize,
    /// Blocks in the global K/V pool, shared by all rows; `None` (the default): enough for every
    /// row to reach `max_len` at once. A smaller pool holds more rows than it could fill at
    /// once: an append that finds too few free blocks is an [`Error::OutOfBlocks`] (the
    /// scheduler preempts rows instead).
    pub pool_blocks: Option<usize>,
    /// The pool's size in bytes instead of blocks (every global group's K and V): as many
    /// blocks as fit. Give this or `pool_blocks`, not both.
    pub pool_bytes: Option<u64>,
    /// Keep full blocks of global K/V for later sequences that begin with the same tokens (on
    /// by default; see [`Engine::reuse_prefix`]).
    pub prompt_cache: bool,
    /// Which neighbouring kernels run fused into one dispatch; `None` (the default): the
    /// `KVDECODE_FUSE` environment variable ([`Fusion::from_env`]), else [`Fusion::auto`] for
    /// the adapter.
    pub fusion: Option<Fusion>,
    /// Which product kernel to build; `None` (the default): the `KVDECODE_MATMUL` environment
    /// variable ([`MatmulKernel::from_env`]), else [`MatmulKernel::Auto`].
    pub matmul: Option<MatmulKernel>,
    /// Keep the experts each token of a mixture of experts was routed to, every MoE layer's
    /// top-k at every position of every row ([`Engine::routes`]; vLLM's
    /// `return_routed_experts`), for a trainer to replay. Off by default: with it off, a step
    /// writes nothing more. On, it needs a model with MoE layers, a route log of rows x max_len x
    /// MoE layers x top_k u32 within one storage binding, and turns the prompt cache off (a
    /// reused prefix's tokens would hold no routes in their new row).
    pub record_routes: bool,
    /// LoRA adapters the engine can hold at once ([`Engine::load_lora`]); 0 (the default): none,
    /// and nothing is built for them. With slots, the norm before a block's products and the MLP's
    /// activation run as dispatches of their own (their bits are the same), and each block takes
    /// four more dispatches (five with a local layer's keys and values).
    pub max_loras: usize,
    /// The largest rank a slot holds (16 by default, at most [`crate::MAX_LORA_RANK`]): every
    /// slot takes room for this rank on every projection.
    pub max_lora_rank: usize,
    /// How the slots hold each adapter's A and B: [`WeightDtype::F32`] (the default: the values
    /// as given) or [`WeightDtype::F16`] (each value rounded to the nearest half, as the engine's
    /// f16 weights are: half the memory and half the bytes a step reads and an update writes;
    /// the products still add in f32).
    pub lora_dtype: WeightDtype,
    /// Split each chunk's GPU work into submissions of at most this many dispatches; 0 (the
    /// default): one submission. Inside a [`crate::Pending`], each poll then submits one part,
    /// so a window drawing on the same device gets its frames in between: a device that runs
    /// one submission at a time (a CPU adapter, or a GPU whose queue does not preempt) otherwise
    /// holds a frame back for a whole step. The same dispatches run in the same order: the bits
    /// do not change.
    pub dispatches_per_submit: usize,
    /// Whether rows (and scored positions) sample on the split path, a workgroup per chunk of the
    /// vocabulary in each stage (statistics, radix passes for top-k and top-p, the draw among the
    /// kept) and a merge, rather than one workgroup a row (the same tokens, kept counts and
    /// alternatives; logprobs from the same sums in another fixed order). Vocabularies past
    /// 2,097,152 tokens, and devices whose largest binding cannot hold the split path's work
    /// buffer (its histograms and top-N candidates, tens of KiB a row), take one workgroup a row
    /// ([`crate::Engine::split_sampling`] says which).
    /// `None` (the default): the `KVDECODE_SAMPLING` environment variable (`split`, `whole`),
    /// else on GPUs and off on adapters that are really the CPU
    /// ([`crate::gpu::variants::split_sampling_auto`]).
    pub split_sampling: Option<bool>,
}

impl EngineOptions {
    /// `rows` rows of `max_len` tokens, f32 everywhere.
    pub fn new(rows: usize, max_len: usize) -> Self {
        EngineOptions {
            rows,
            max_len,
            kv: KvDtype::F32,
            weights: WeightDtype::F32,
            rollback: 8,
            all_logits_tokens: 64,
            beyond_trained_context: false,
            logit_bias_slots: 1024,
            attention: AttentionKernel::from_env(),
            block_len: 16,
            pool_blocks: None,
            pool_bytes: None,
            prompt_cache: true,
            fusion: None,
            matmul: None,
            record_routes: false,
            max_loras: 0,
            max_lora_rank: 16,
            lora_dtype: WeightDtype::F32,
            dispatches_per_submit: 0,
            split_sampling: None,
        }
    }

    /// The shape of the cache these options build.
    pub fn cache(&self) -> CacheOptions {
        CacheOptions {
            rows: self.rows,
            max_len: self.max_len,
            dtype: self.kv,
            spare: self.rollback,
            block_len: self.block_len,
            pool_blocks: self.pool_blocks,
            pool_bytes: self.pool_bytes,
            prompt_cache: self.prompt_cache,
        }
    }
}

/// Logits at each chunk row's last real token, `[R, vocab]`.
#[derive(Clone, Debug)]
pub struct Logits {
    /// Vocabulary size.
    pub vocab: usize,
    /// Row-major `[R, vocab]`; rows that received no token hold stale values.
    pub data: Vec<f32>,
    /// Whether each row received at least one token in this call.
    pub valid: Vec<bool>,
}

impl Logits {
    /// Logits of chunk row `r`, or `None` if it received no token.
    pub fn row(&self, r: usize) -> Option<&[f32]> {
        self.valid.get(r).copied().unwrap_or(false).then(|| &self.data[r * self.vocab..(r + 1) * self.vocab])
    }
}

/// Counters for the benchmark.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Command buffers submitted.
    pub submits: u64,
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Chunks processed.
    pub chunks: u64,
}
