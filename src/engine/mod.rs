//! The decode step: one model, one cache, every GPU object built once, and `append`, which feeds
//! right-padded chunks of new tokens per row and returns logits (or sampled ids) at each row's
//! last real token. Each chunk is one command encoder, one compute pass, one submit.

//!
//! The parts, in the order a call meets them: [`options`] (what an engine is built with),
//! `build` (construction, once), `builder` (the dispatch order of a layer), `dispatch` (grids and
//! recording), `step` (checks, chunks, submits, readback), [`decode`] (multi-step windows and
//! turns), [`sampling`] (what a step samples with), `inspect` (profiles and test hooks).

pub mod batch;
mod build;
mod builder;
pub mod decode;
mod dispatch;
mod inspect;
pub mod lora;
mod moe;
mod occupancy;
pub mod options;
mod plan;
pub mod sampling;
pub mod sleep;
mod step;
pub mod update;

use crate::cache::{KvCache, RowOwner};
use crate::error::{Error, Result};
use crate::gpu::device::Gpu;
use crate::gpu::weights::GpuWeights;
use crate::model::config::ModelConfig;
use dispatch::{Dispatch, SampleDispatches};
use plan::{AttentionPlan, RopeTables};
use sampling::RowSampling;

pub use crate::gpu::variants::{
    resolve_matmul, AttentionKernel, Fusion, MatmulKernel, QUERY_TILE_MIN_WIDTH, TILED_MIN_TOKENS,
};
pub use batch::{Batch, StepOutput, Want};
pub use decode::{Turn, TurnLimit};
pub use lora::LoraUpdate;
pub use moe::EXPERT_TOKEN_BLOCK;
pub use occupancy::{Occupancy, OccupancyTable};
pub use options::{EngineOptions, Logits, Stats};
pub use sleep::{MemoryReport, Sleep};
pub(crate) use step::Output;
pub use update::{InFlight, WeightUpdate};

/// Most new tokens per row processed in one chunk (bounds activation memory during prefill,
/// like the seed's CHUNK). Longer appends are split into several chunks, one submit each.
pub const CHUNK: usize = 64;

/// Activation buffers, sized once for `rows * chunk` tokens.
pub(crate) struct Scratch {
    step: wgpu::Buffer,           // uniform Step
    row_info: wgpu::Buffer,       // [rows] RowInfo
    ids: wgpu::Buffer,            // [rows * chunk] u32
    x: wgpu::Buffer,              // [T, d] residual stream
    h: wgpu::Buffer,              // [T, d] normed input of a block
    qkv: wgpu::Buffer,            // [T, (H + 2 Hk) D] queries (then attention out), fresh global K, V
    kv_local: wgpu::Buffer,       // [T, 2 * Hk * D] fresh local K then V
    tmp: wgpu::Buffer,            // [T, d] projection output before a post-norm
    up: wgpu::Buffer,             // [T, in_factor * F]
    act: wgpu::Buffer,            // [T, F]
    engram_e: wgpu::Buffer,       // [T, orders * heads * dim] Engram lookups
    engram_kv: wgpu::Buffer,      // [T, 2, d] Engram k then v
    router_logits: wgpu::Buffer,  // [T, experts] a MoE layer's router logits
    routes: wgpu::Buffer,         // [T, MoE layers, top_k, 2] u32: each token's experts and their weights' bits
    expert_act: wgpu::Buffer,     // [T, top_k, moe ffn] the routed experts' activations
    expert_out: wgpu::Buffer,     // [T, top_k, d] the routed experts' outputs, before their sum
    shared_gate: wgpu::Buffer,    // [T] a shared expert's gate logit
    route_log: wgpu::Buffer,      // [rows, max_len, MoE layers, top_k] u32 (record_routes)
    route_log_read: wgpu::Buffer, // [max_len, MoE layers, top_k]: one row's routes, read back
    route_log_row: wgpu::Buffer,  // [max_len, MoE layers, top_k]: a fork's source row on its way (a
    // buffer is never its own copy's source and destination)
    last_h: wgpu::Buffer,       // [rows, d] final-normed hidden state of each row's last real token
    logits: wgpu::Buffer,       // [rows, vocab]
    samplers: wgpu::Buffer,     // [rows] Sampler
    sampled: wgpu::Buffer,      // [3, rows]: sampled ids, their logprobs (f32 bits), kept counts
    sample_stats: wgpu::Buffer, // [max(rows, all_logits_tokens), chunks, 8]: the split sampler's chunk results
    all_logits: wgpu::Buffer,   // [all_logits_tokens, vocab]
    lora_ax: wgpu::Buffer,      // [T, 8 + 3 * stride rank] u32: each token's LoRA head and A x (lora.wgsl)
    lora_groups: wgpu::Buffer,  // [1 + 2 T + T / 4] vec4<u32>: tokens by adapter; the products' order
    dummy: wgpu::Buffer,        // bound where a kernel's optional input is absent
    dummy_rw: wgpu::Buffer,     // the same for an optional output (one buffer may not be bound both ways)
    xq: wgpu::Buffer,           // int-dot products: [T, K / 32, Q8_BLOCK_WORDS] quantized input
    partials: wgpu::Buffer,     // split attention: [group tokens, H, parts, 4 + D] partial softmax states
    token_groups: Vec<wgpu::Buffer>, // uniform TokenGroup of each token group
    logits_read: wgpu::Buffer,
    pub(crate) sampled_read: wgpu::Buffer, // [max_window, 3, rows]: one slot per multi-step step
    all_logits_read: wgpu::Buffer,
    scored: wgpu::Buffer,     // [3, all_logits_tokens]: the next token, its logprob bits, kept count
    scored_top: wgpu::Buffer, // [all_logits_tokens, TOP_LOGPROBS_MAX, 2]: alternatives (id, logprob bits)
    scored_read: wgpu::Buffer,
    scored_top_read: wgpu::Buffer,
}

/// A model on the GPU with its KV cache: the object that decodes.
pub struct Engine {
    gpu: Gpu,
    cfg: ModelConfig,
    /// Distinct pipelines this engine's dispatches use.
    pipeline_count: usize,
    pub(crate) cache: KvCache,
    chunk: usize,
    pub(crate) s: Scratch,
    pub(crate) weights: GpuWeights,
    /// The policy version: 0 at construction, plus one per weight update.
    weights_version: u64,
    /// The weights' names in every naming ([`Engine::update_weights`] builds it once).
    names: Option<update::NameIndex>,
    /// What [`Engine::sleep`] released and keeps on the host (`None`: awake).
    slept: Option<sleep::Slept>,
    _rope: RopeTables,
    /// Every dispatch of one chunk up to the final hidden states, in order.
    chunk_dispatches: Vec<Dispatch>,
    /// Final norm at each row's last token, then the LM head parts.
    head_dispatches: Vec<Dispatch>,
    /// Final norm at every token, then the LM head over all of them.
    all_head_dispatches: Vec<Dispatch>,
    all_logits_tokens: usize,
    /// Most dispatches per submission (0: a chunk is one submission; see
    /// [`EngineOptions::dispatches_per_submit`]).
    dispatches_per_submit: usize,
    /// Most steps per multi-step window: `rollback + 1`.
    pub(crate) max_window: usize,
    /// `sample.wgsl`: each row's next token.
    sample_dispatches: SampleDispatches,
    /// `sample.wgsl` over every position of the chunk ([`Engine::append_scored`]).
    score_dispatches: SampleDispatches,
    /// Per chunk row, the token after its last, for the next scored chunk (empty: none).
    score_next: Vec<u32>,
    /// Adds rows' logit biases to the logits of a sampling step (recorded only when one has some).
    bias_dispatch: Dispatch,
    /// Per-row logit bias and token mask.
    sampling: RowSampling,
    stats: Stats,
    /// Timestamp queries for [`Engine::profile_step`], made on its first call.
    profiler: Option<crate::gpu::profile::Profiler>,
    /// Whether the next submit is profiled (timestamps between its dispatches, see
    /// [`Engine::profile_step`]).
    profiling: bool,
    /// Bytes of buffers this engine counts against the device's memory budget.
    gpu_bytes: u64,
    /// The resident LoRA adapters and each row's.
    lora: lora::LoraState,
    attention: AttentionPlan,
    fusion: Fusion,
    matmul: MatmulKernel,
    /// Rows that truncate nothing sample on the split path ([`EngineOptions::split_sampling`]).
    split_sampling: bool,
    /// MoE layers keep every real token's routes in `s.route_log` ([`EngineOptions::record_routes`]).
    record_routes: bool,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.gpu.release(self.gpu_bytes);
    }
}

impl Engine {
    /// Whether the engine can run: its device is alive and it is awake.
    pub(crate) fn ready(&self) -> Result<()> {
        if let Some(what) = self.asleep() {
            return Err(Error::Input(format!("the engine is asleep ({what:?} released); call wake() first")));
        }
        self.gpu.check()
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The cache (lengths, history, sizes).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Most new tokens per row in one chunk (one submit).
    pub fn chunk_width(&self) -> usize {
        self.chunk
    }

    /// Dispatches recorded per decode step of one token when logits are returned (sampling adds
    /// one).
    pub fn dispatches_per_chunk(&self) -> usize {
        self.chunk_dispatches.iter().chain(&self.head_dispatches).filter(|d| d.live(1, 1)).count()
    }

    /// Which kernels this engine runs fused ([`EngineOptions::fusion`] resolved).
    pub fn fusion(&self) -> Fusion {
        self.fusion
    }

    /// Whether rows that truncate nothing sample on the split path
    /// ([`EngineOptions::split_sampling`] resolved).
    pub fn split_sampling(&self) -> bool {
        self.split_sampling
    }

    /// The product kernel this engine built ([`EngineOptions::matmul`] resolved; never `Auto`).
    pub fn matmul_kernel(&self) -> MatmulKernel {
        self.matmul
    }

    /// The attention kernel this engine built ([`EngineOptions::attention`] resolved).
    pub fn attention_kernel(&self) -> AttentionKernel {
        self.attention.kernel
    }

    /// Token groups per full chunk in attention: the split kernel's scratch holds one group of
    /// tokens, so a chunk with more tokens records one (partials, merge) pair per group (1 for
    /// the serial kernel, and for every chunk that fits one group, as decode steps do).
    pub fn attention_token_groups(&self) -> usize {
        self.attention.groups
    }

    /// Tokens per query tile of split-group attention in steps of [`QUERY_TILE_MIN_WIDTH`] tokens a
    /// row or more (1: no query tiles; other variants, or heads too large for two tokens).
    pub fn attention_query_tile(&self) -> usize {
        self.attention.query_tile
    }

    /// Tokens (rows x width) [`Engine::append_all_logits`] can return at once.
    pub fn all_logits_tokens(&self) -> usize {
        self.all_logits_tokens
    }

    /// Most steps per [`Engine::decode_steps`] window (`rollback + 1`).
    pub fn max_window(&self) -> usize {
        self.max_window
    }

    /// Distinct compute pipelines this engine's dispatches use (built once per device: a second
    /// engine of the same shape shares them).
    pub fn pipeline_count(&self) -> usize {
        self.pipeline_count
    }

    /// Bytes the model's matrices take on the GPU (quantized blocks stay quantized, 16-bit weights
    /// stay 16-bit).
    pub fn weight_bytes(&self) -> u64 {
        self.weights.matrix_bytes()
    }

    /// Counters since construction.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Empty these cache rows (new sequences start there).
    pub fn reset(&mut self, rows: &[usize]) -> Result<()> {
        self.ready()?;
        self.cache.reset(&self.gpu, rows)?;
        self.sampling.clear(&self.gpu, rows);
        self.lora.clear_rows(rows);
        for &r in rows {
            self.cache.blocks.set_salt(r, 0);
        }
        Ok(())
    }

    /// Remove the last `n[i]` tokens of `rows[i]` exactly (see [`KvCache::rollback`]).
    pub fn rollback(&mut self, rows: &[usize], n: &[usize]) -> Result<()> {
        self.ready()?;
        self.cache.rollback(&self.gpu, rows, n)
    }

    /// Add `bias` (token, value; values for the same token add up) to `row`'s logits whenever the
    /// row is sampled, replacing its earlier bias (OpenAI's `logit_bias`). Only sampling sees it:
    /// the logits [`Engine::append`] returns are the model's. Cleared by a reset.
    pub fn set_logit_bias(&mut self, row: usize, bias: &[(u32, f32)]) -> Result<()> {
        self.cache.check_rows(&[row])?;
        self.sampling.set_bias(&self.gpu, row, bias)
    }

    /// Add `delta` to `row`'s bias of `token` (presence and frequency penalties, as tokens come).
    pub fn add_logit_bias(&mut self, row: usize, token: u32, delta: f32) -> Result<()> {
        self.cache.check_rows(&[row])?;
        self.sampling.add_bias(&self.gpu, row, token, delta)
    }

    /// Logit bias entries each row can hold.
    pub fn logit_bias_slots(&self) -> usize {
        self.sampling.slots
    }

    /// `row`'s logit bias, one entry per token.
    pub fn logit_bias(&self, row: usize) -> &[(u32, f32)] {
        self.sampling.bias(row)
    }

    /// Sample `row` only among the tokens whose bit is set in `allowed` (`ceil(vocab / 32)`
    /// words, bit `i % 32` of word `i / 32` for token `i`), or among all tokens (`None`):
    /// constrained decoding. A mask that allows no token is an error. Cleared by a reset.
    pub fn set_token_mask(&mut self, row: usize, allowed: Option<&[u32]>) -> Result<()> {
        self.cache.check_rows(&[row])?;
        self.sampling.set_mask(&self.gpu, row, allowed)
    }

    /// Advance the positions of `rows[i]` by `n[i]` without storing anything: padding that no later
    /// query sees (see [`KvCache::skip`]).
    pub fn skip(&mut self, rows: &[usize], n: &[usize]) -> Result<()> {
        self.ready()?;
        self.cache.skip(rows, n)
    }

    /// Make `row` hold `tokens` but the last (which the caller feeds to the first decode step),
    /// computing as little as possible: the row keeps the longest prefix of `tokens` it already
    /// holds (rolling back what differs when that is within [`KvCache::max_rollback`], else
    /// starting over, on the row's LoRA adapter, from the prompt cache's longest prefix), and
    /// prefills only the rest. A conversation continues on its row this way without recomputing
    /// earlier turns. Returns
    /// how many tokens were not computed again. Bad input (an empty `tokens`, a row out of
    /// range, a bad id, more than `max_len`) changes nothing; a pool out of blocks leaves the row
    /// holding the prefix it kept.
    pub fn continue_row(&mut self, row: usize, tokens: &[u32]) -> Result<usize> {
        self.ready()?;
        self.cache.check_rows(&[row])?;
        let Some((_, head)) = tokens.split_last() else {
            return Err(Error::Input(format!("row {row}: continue_row needs at least one token")));
        };
        if tokens.len() > self.cache.max_len() {
            return Err(Error::CacheFull { row, len: 0, n_new: tokens.len(), max_len: self.cache.max_len() });
        }
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= self.cfg.vocab) {
            return Err(Error::Input(format!(
                "row {row}: token {i} = {t} is outside the vocabulary ({})",
                self.cfg.vocab
            )));
        }
        let held = self.cache.history(row);
        let common = held.iter().zip(head).take_while(|(a, b)| a == b).count();
        let back = held.len() - common;
        let mut kept = common;
        if self.cache.skips(row).is_empty() && back <= self.cache.max_rollback(row) {
            self.rollback(&[row], &[back])?;
        } else {
            // the row starts over on the adapter it had (a reset alone puts it on the base model)
            let adapter = self.adapter(row).map(|(name, _)| name.to_string());
            self.reset(&[row])?;
            self.set_adapter(row, adapter.as_deref())?;
            kept = self.reuse_prefix(row, tokens)?;
        }
        let rest = &head[kept..];
        if !rest.is_empty() {
            self.feed(rest, rest.len(), &[rest.len()], Some(&[row]))?;
        }
        Ok(kept)
    }

    /// Claim `rows` for `owner` ([`KvCache::claim`]): a scheduler, rollouts and direct callers
    /// sharing this engine take rows through here, so none takes another's.
    pub fn claim_rows(&mut self, owner: RowOwner, rows: &[usize]) -> Result<()> {
        self.cache.claim(owner, rows)
    }

    /// Claim `n` free rows for `owner`, lowest first ([`KvCache::claim_free`]).
    pub fn claim_free_rows(&mut self, owner: RowOwner, n: usize) -> Result<Vec<usize>> {
        self.cache.claim_free(owner, n)
    }

    /// Give back those of `rows` that `owner` holds (their contents stay until a reset).
    pub fn release_rows(&mut self, owner: RowOwner, rows: &[usize]) {
        self.cache.release(owner, rows)
    }

    /// Start the empty `row` on the longest prefix of `prompt` whose full blocks of global K/V
    /// the prompt cache holds (left by any row, finished or not), leaving at least one token to
    /// compute; returns the tokens it now holds, `n`: append `prompt[n..]` next. The row is then
    /// bit for bit as if it had computed them. Models with local layers also need each ring as it
    /// stands at the reuse point, which the pool does not hold: the row recomputes the last
    /// `local layers x W + rollback` positions before it (a few blocks) without writing their
    /// global K/V, since each local layer's window reaches that far back through the ones before
    /// it; a prefix shorter than that is not reused. 0 when nothing is reused. Errors when the
    /// row is out of range or not empty; nothing changes then.
    pub fn reuse_prefix(&mut self, row: usize, prompt: &[u32]) -> Result<usize> {
        self.ready()?;
        let (start, end) = self.cache.adopt_prefix(&self.gpu, row, prompt)?;
        if end > start {
            self.cache.replay_until[row] = end;
            let replayed = self.feed(&prompt[start..end], end - start, &[end - start], Some(&[row]));
            self.cache.replay_until[row] = 0;
            if let Err(e) = replayed {
                self.reset(&[row])?;
                return Err(e);
            }
        }
        Ok(end)
    }

    /// Copy row `src` into rows `dst` on the GPU: they continue from the same prefix without
    /// recomputing it (GRPO-style k samples per prompt).
    ///
    /// The destinations' sampling state (logit bias, token mask) is cleared, not copied: each
    /// fork samples with what its caller sets.
    pub fn fork(&mut self, src: usize, dst: &[usize]) -> Result<()> {
        self.ready()?;
        self.cache.fork(&self.gpu, src, dst)?;
        self.sampling.clear(&self.gpu, dst);
        self.lora.copy_row(src, dst);
        self.copy_routes(src, dst);
        Ok(())
    }
}
