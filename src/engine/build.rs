//! Building an engine: the scratch buffers, the weights and cache on the GPU, and every dispatch
//! of a chunk (through [`Builder`]), all once, from the plan of `plan.rs`.

use crate::cache::KvCache;
use crate::engine::builder::{Builder, ProductIo};
use crate::engine::dispatch::{Dispatch, Grid, SampleDispatches, SplitSampling};
use crate::engine::options::{EngineOptions, Stats};
use crate::engine::plan::{AttentionPlan, RopeTables};
use crate::engine::sampling::{RowSampling, TOP_LOGPROBS_MAX};
use crate::engine::step::RowInfoGpu;
use crate::engine::{Engine, Scratch, CHUNK};
use crate::error::{Error, Result};
use crate::gpu::device::Gpu;
use crate::gpu::kernels::{self, SampleStage};
use crate::gpu::lora::GpuLora;
use crate::gpu::shaders::Kernel;
use crate::gpu::variants::{
    product_wg, resolve_matmul, split_sampling_auto, split_sampling_from_env, Fusion, MatmulKernel,
};
use crate::gpu::weights::{GpuWeights, WeightDtype};
use crate::io::model_file::ModelFile;
use crate::model::config::ModelConfig;
use crate::model::family::WeightPlan;
use crate::model::weights::ModelWeights;

/// Words per block of 32 quantized activations (quantize.wgsl): the scale d, d * sum(q), then
/// the 32 int8 q four to a word.
const Q8_BLOCK_WORDS: usize = 10;

/// Where an engine's weights come from.
pub(crate) enum WeightSource<'a> {
    /// Weights on the host (the CPU reference's, or seeded random ones).
    Memory(&'a ModelWeights),
    /// A model file's tensors, read one at a time, with a progress callback (tensors done,
    /// tensors).
    File(&'a ModelFile, &'a mut dyn FnMut(usize, usize)),
}

impl WeightSource<'_> {
    fn cfg(&self) -> &ModelConfig {
        match self {
            WeightSource::Memory(w) => &w.cfg,
            WeightSource::File(file, _) => file.config(),
        }
    }

    /// The weights on the GPU as `dtype` says.
    fn upload(self, gpu: &Gpu, dtype: WeightDtype) -> Result<GpuWeights> {
        match self {
            WeightSource::Memory(w) => GpuWeights::upload(gpu, w, dtype),
            WeightSource::File(file, progress) => {
                GpuWeights::load(gpu, &file.file_weights(), file.plan(), dtype, progress).map_err(|e| file.err(e))
            }
        }
    }
}

impl Engine {
    /// Upload `weights`, allocate the cache and every buffer, and build every pipeline and bind
    /// group. Nothing is allocated per step after this. An engine the device cannot hold is an
    /// error naming what it needs (error scopes catch out-of-memory and validation errors during
    /// creation), never a panic. (Natively this blocks on the scopes; in the browser use
    /// [`Engine::new_async`], or the first call reports what creation ran into.)
    pub fn new(gpu: &Gpu, weights: &ModelWeights, opts: EngineOptions) -> Result<Self> {
        Self::create(gpu, WeightSource::Memory(weights), opts)
    }

    /// [`Engine::new`] that awaits the device's verdict on creation (the browser's form).
    pub async fn new_async(gpu: &Gpu, weights: &ModelWeights, opts: EngineOptions) -> Result<Self> {
        Self::create_async(gpu, WeightSource::Memory(weights), opts).await
    }

    /// An engine for the model in `file`, loaded as an update writes: every weight allocated on
    /// the GPU from the plan the file's header gives, then each tensor read from the file
    /// (mapped, not copied) and written into its places, one at a time, so no host copy of the
    /// model is ever made. Every weight's rows must be written exactly once. Otherwise as
    /// [`Engine::new`], whose engine it equals bit for bit.
    pub fn from_file(gpu: &Gpu, file: &ModelFile, opts: EngineOptions) -> Result<Self> {
        Self::from_file_with_progress(gpu, file, opts, &mut |_, _| {})
    }

    /// [`Engine::from_file`], calling `progress(tensors_done, tensors)` as tensors reach the GPU.
    pub fn from_file_with_progress(
        gpu: &Gpu,
        file: &ModelFile,
        opts: EngineOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::create(gpu, WeightSource::File(file, progress), opts)
    }

    /// [`Engine::from_file`] that awaits the device's verdict on creation (the browser's form).
    pub async fn from_file_async(
        gpu: &Gpu,
        file: &ModelFile,
        opts: EngineOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::create_async(gpu, WeightSource::File(file, progress), opts).await
    }

    fn create(gpu: &Gpu, weights: WeightSource, opts: EngineOptions) -> Result<Self> {
        #[cfg(not(target_arch = "wasm32"))]
        return crate::gpu::pending::block_on(Self::create_async(gpu, weights, opts));
        #[cfg(target_arch = "wasm32")]
        Self::build(gpu, weights, opts)
    }

    async fn create_async(gpu: &Gpu, weights: WeightSource<'_>, opts: EngineOptions) -> Result<Self> {
        gpu.check()?;
        let oom = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let built = Self::build(gpu, weights, opts);
        let invalid = invalid.pop().await;
        let oom = oom.pop().await;
        let engine = built?;
        let needs = || {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            format!(
                "the engine needs {:.1} MiB of weights and {:.1} MiB of K/V cache plus activations",
                mib(engine.weight_bytes()),
                mib(engine.cache.nbytes())
            )
        };
        if let Some(e) = oom {
            return Err(Error::Device(format!(
                "out of GPU memory creating the engine ({}; use fewer rows, a shorter max_len, 16-bit K/V or \
                 quantized weights): {e}",
                needs()
            )));
        }
        if let Some(e) = invalid {
            return Err(Error::Device(format!("the device refused the engine ({}): {e}", needs())));
        }
        gpu.check()?;
        Ok(engine)
    }

    /// Build, counting the buffers against the device's memory budget (given back on drop, or
    /// at once when building fails half-way).
    pub(super) fn build(gpu: &Gpu, weights: WeightSource, opts: EngineOptions) -> Result<Self> {
        let before = gpu.memory_in_use();
        match Self::build_parts(gpu, weights, opts) {
            Ok(mut e) => {
                e.gpu_bytes = gpu.memory_in_use().saturating_sub(before);
                Ok(e)
            }
            Err(e) => {
                gpu.release(gpu.memory_in_use().saturating_sub(before));
                Err(e)
            }
        }
    }

    fn build_parts(gpu: &Gpu, weights: WeightSource, mut opts: EngineOptions) -> Result<Self> {
        let memory_plan;
        let plan = match &weights {
            WeightSource::Memory(w) => {
                w.check()?;
                memory_plan = WeightPlan::of(w);
                &memory_plan
            }
            WeightSource::File(file, _) => file.plan(),
        };
        let cfg = weights.cfg().clone();
        // the route log: every MoE layer's top-k at every position of every row
        let route_stride = cfg.moe.as_ref().map_or(0, |m| m.layers.len() * m.top_k);
        if opts.record_routes {
            if route_stride == 0 {
                return Err(Error::Input("record_routes: the model has no mixture-of-experts layers".into()));
            }
            let bytes = (opts.rows * opts.max_len * route_stride * 4) as u64;
            if bytes > gpu.max_binding() {
                return Err(Error::Limit(format!(
                    "record_routes: a route log of {} rows x {} positions x {route_stride} routes ({bytes} bytes) \
                     exceeds one storage binding ({} bytes); use fewer rows or a shorter max_len",
                    opts.rows,
                    opts.max_len,
                    gpu.max_binding()
                )));
            }
            opts.prompt_cache = false;
        }
        if let Some(ctx) = cfg.context_len.filter(|&c| opts.max_len > c && !opts.beyond_trained_context) {
            return Err(Error::Limit(format!(
                "max_len {} is longer than the model's trained context of {ctx} tokens; use max_len <= {ctx} \
                 or set EngineOptions::beyond_trained_context to go past it",
                opts.max_len
            )));
        }
        // what the engine will hold, before anything is allocated (activations are small beside it)
        let weight_bytes = crate::gpu::weights::bytes_needed(plan, opts.weights)
            + if opts.max_loras > 0 {
                GpuLora::bytes_needed(&cfg, opts.max_loras, opts.max_lora_rank, opts.lora_dtype)
            } else {
                0
            };
        let kv_bytes = KvCache::bytes_needed(&cfg, &opts.cache());
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        gpu.check_budget(
            weight_bytes.saturating_add(kv_bytes),
            &format!(
                "an engine with {:.1} MiB of weights and a {:.1} MiB K/V cache ({} rows x {} positions, {} K/V)",
                mib(weight_bytes),
                mib(kv_bytes),
                opts.rows,
                opts.max_len,
                opts.kv.name()
            ),
        )?;
        let cache = KvCache::new(gpu, &cfg, opts.cache())?;
        let mut gw = weights.upload(gpu, opts.weights)?;
        if opts.max_loras > 0 {
            gw.lora = Some(GpuLora::new(gpu, &cfg, opts.max_loras, opts.max_lora_rank, opts.lora_dtype)?);
        }
        let rows = opts.rows;
        let (d, hd, kvd) = (cfg.d_model, cfg.n_heads * cfg.head_dim, 2 * cfg.n_kv_heads * cfg.head_dim);
        let engram_width = cfg.engram.as_ref().map_or(0, |e| e.width());
        // a MoE layer's per-token activations: router logits, routes of every MoE layer (an expert
        // id and its weight each), and the routed experts' activations and outputs (top_k of each)
        let (moe_logits, moe_routes, moe_act, moe_out) =
            cfg.moe.as_ref().map_or((0, 0, 0, 0), |m| (m.experts, 2 * route_stride, m.top_k * m.ffn, m.top_k * d));
        // the dense MLPs' size: the dense layers' and a MoE layer's shared expert's
        let shared_ffn = cfg.moe.as_ref().and_then(|m| m.shared_ffn);
        let dense_ffn = cfg.ffn.max(shared_ffn.unwrap_or(0));
        let widest = [
            d,
            hd,
            kvd,
            cfg.mlp.in_factor() * dense_ffn,
            engram_width,
            2 * d,
            moe_logits,
            moe_routes,
            moe_act,
            moe_out,
            // the LoRA adapters' head and A x (lora.wgsl)
            gw.lora.as_ref().map_or(0, |l| kernels::ax_stride(l.stride_rank)),
        ]
        .into_iter()
        .max()
        .unwrap_or(d)
            * 4;
        // chunk width: as many tokens per row as fit one binding for the widest activation
        let chunk = CHUNK.min(gpu.max_binding() as usize / (rows * widest));
        if chunk == 0 {
            return Err(Error::Limit(format!(
                "{rows} rows x {widest} bytes of activations per token exceed one storage binding; use fewer rows"
            )));
        }
        let t = rows * chunk;
        let attention = AttentionPlan::new(&cfg, &opts, gpu, t)?;
        let matmul = resolve_matmul(opts.matmul.map_or_else(MatmulKernel::from_env, Ok)?, gpu)?;
        let mut fusion = match opts.fusion {
            Some(f) => f,
            None => Fusion::from_env()?.unwrap_or_else(|| Fusion::auto(&gpu.info, matmul)),
        };
        // the integer-dot products read activations quantized by their own dispatch, which reads
        // the normed input: the norm stays a dispatch of its own
        fusion.norm &= matmul != MatmulKernel::IntDot;
        let split_sampling = match opts.split_sampling {
            Some(on) => on,
            None => split_sampling_from_env()?.unwrap_or_else(|| split_sampling_auto(&gpu.info)),
        };
        // all-position logits: as many tokens as asked, that one chunk and one binding can hold
        let all_tokens = opts.all_logits_tokens.min(t).min(gpu.max_binding() as usize / (cfg.vocab * 4)).max(1);
        // the split path's limits: its per-thread marks, and its work buffer in one binding
        let split_sampling = split_sampling
            && kernels::Sample::per_thread(cfg.vocab) <= kernels::SAMPLE_MAX_PER_THREAD
            && 4 * kernels::Sample::work_words(cfg.vocab, rows.max(all_tokens)) as u64 <= gpu.max_binding();
        let max_window = opts.rollback + 1;
        let f4 = |n: usize| (n * 4) as u64;
        let map_read = |label: &str, size: u64| {
            gpu.buffer(label, size, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)
        };
        let s = Scratch {
            step: gpu.buffer("step", 16, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST)?,
            row_info: gpu.storage("row info", (rows * std::mem::size_of::<RowInfoGpu>()) as u64)?,
            ids: gpu.storage("ids", f4(t))?,
            x: gpu.storage("x", f4(t * d))?,
            h: gpu.storage("h", f4(t * d))?,
            qkv: gpu.storage("q and fresh global kv", f4(t * (hd + kvd)))?,
            kv_local: gpu.storage("fresh local kv", f4(t * kvd))?,
            tmp: gpu.storage("tmp", f4(t * d))?,
            up: gpu.storage("mlp up", f4(t * cfg.mlp.in_factor() * dense_ffn))?,
            act: gpu.storage("mlp act", f4(t * dense_ffn))?,
            engram_e: gpu.storage("engram lookups", f4(if engram_width > 0 { t * engram_width } else { 4 }))?,
            engram_kv: gpu.storage("engram k/v", f4(if engram_width > 0 { t * 2 * d } else { 4 }))?,
            router_logits: gpu.storage("router logits", f4((t * moe_logits).max(4)))?,
            routes: gpu.storage("routes", f4((t * moe_routes).max(4)))?,
            expert_act: gpu.storage("expert activations", f4((t * moe_act).max(4)))?,
            expert_out: gpu.storage("expert outputs", f4((t * moe_out).max(4)))?,
            shared_gate: gpu.storage("shared expert gate", f4(if shared_ffn.is_some() { t } else { 4 }))?,
            route_log: match opts.record_routes {
                true => gpu.storage("route log", f4(rows * opts.max_len * route_stride))?,
                false => gpu.storage("no route log", 16)?,
            },
            route_log_row: match opts.record_routes {
                true => gpu.storage("route log row", f4(opts.max_len * route_stride))?,
                false => gpu.storage("no route log row", 16)?,
            },
            route_log_read: match opts.record_routes {
                true => map_read("route log readback", f4(opts.max_len * route_stride))?,
                false => map_read("no route log readback", 16)?,
            },
            last_h: gpu.storage("last hidden", f4(rows * d))?,
            logits: gpu.storage("logits", f4(rows * cfg.vocab))?,
            samplers: gpu
                .storage("samplers", (rows * std::mem::size_of::<crate::engine::sampling::SamplerGpu>()) as u64)?,
            sampled: gpu.storage("sampled ids", f4(3 * rows))?,
            sample_stats: match split_sampling {
                true => gpu.storage(
                    "split sampling's work",
                    f4(kernels::Sample::work_words(cfg.vocab, rows.max(all_tokens))),
                )?,
                false => gpu.storage("no split sampling", 16)?,
            },
            all_logits: gpu.storage("all-position logits", f4(all_tokens * cfg.vocab))?,
            lora_ax: match gw.lora.as_ref() {
                Some(l) => gpu.storage("LoRA A x", f4(t * kernels::ax_stride(l.stride_rank)))?,
                None => gpu.storage("no LoRA A x", 16)?,
            },
            lora_groups: match gw.lora.as_ref() {
                // the count, two vec4s a group of up to 4 tokens, then the order, 4 tokens a vec4
                Some(_) => gpu.storage("LoRA token groups", 16 * (1 + 2 * t as u64 + (t as u64).div_ceil(4)))?,
                None => gpu.storage("no LoRA token groups", 16)?,
            },
            dummy: gpu.storage("dummy", 16)?,
            dummy_rw: gpu.storage("dummy output", 16)?,
            xq: match matmul {
                MatmulKernel::IntDot => {
                    gpu.storage("quantized activations", f4(t.max(rows) * (widest / 4).div_ceil(32) * Q8_BLOCK_WORDS))?
                }
                _ => gpu.storage("no quantized activations", 16)?,
            },
            partials: match attention.kernel.is_split() {
                true => gpu.storage(
                    "split attention partials",
                    f4(attention.group_tokens * cfg.n_heads * attention.parts * (4 + cfg.head_dim)),
                )?,
                false => gpu.storage("no partials", 16)?,
            },
            token_groups: (0..attention.groups)
                .map(|g| {
                    let buf =
                        gpu.buffer("token group", 16, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST)?;
                    gpu.queue.write_buffer(
                        &buf,
                        0,
                        bytemuck::cast_slice(&[(g * attention.group_tokens) as u32, 0, 0, 0]),
                    );
                    Ok(buf)
                })
                .collect::<Result<_>>()?,
            logits_read: map_read("logits readback", f4(rows * cfg.vocab))?,
            sampled_read: map_read("sampled readback", f4(3 * rows * max_window))?,
            all_logits_read: map_read("all-position logits readback", f4(all_tokens * cfg.vocab))?,
            scored: gpu.storage("scored tokens", f4(3 * all_tokens))?,
            scored_top: gpu.storage("scored alternatives", f4(all_tokens * TOP_LOGPROBS_MAX as usize * 2))?,
            scored_read: map_read("scored readback", f4(3 * all_tokens))?,
            scored_top_read: map_read("scored alternatives readback", f4(all_tokens * TOP_LOGPROBS_MAX as usize * 2))?,
        };
        let rope = RopeTables::new(gpu, &cfg, opts.max_len)?;
        let sampling = RowSampling::new(gpu, rows, cfg.vocab, opts.logit_bias_slots)?;
        let d = build_dispatches(&DispatchInputs {
            gpu,
            cfg: &cfg,
            max_len: opts.max_len,
            matmul,
            fusion,
            attention,
            cache: &cache,
            s: &s,
            rope: &rope,
            gw: &gw,
            sampling: &sampling,
            route_log: opts.record_routes,
            split_sampling,
            all_logits_tokens: all_tokens,
        })?;
        Ok(Engine {
            gpu: gpu.clone(),
            cfg,
            pipeline_count: d.pipelines,
            cache,
            chunk,
            s,
            weights: gw,
            weights_version: 0,
            names: None,
            slept: None,
            _rope: rope,
            chunk_dispatches: d.chunk,
            head_dispatches: d.head,
            all_head_dispatches: d.all_head,
            all_logits_tokens: all_tokens,
            dispatches_per_submit: opts.dispatches_per_submit,
            max_window,
            sample_dispatches: d.sample,
            score_dispatches: d.score,
            score_next: Vec::new(),
            bias_dispatch: d.bias,
            sampling,
            stats: Stats::default(),
            profiler: None,
            profiling: false,
            gpu_bytes: 0,
            attention,
            fusion,
            matmul,
            split_sampling,
            record_routes: opts.record_routes,
            lora: super::lora::LoraState::new(opts.max_loras, rows),
        })
    }
}

/// What the dispatches are made of: the engine's buffers and the variants it picked.
pub(super) struct DispatchInputs<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) cfg: &'a ModelConfig,
    pub(super) max_len: usize,
    pub(super) matmul: MatmulKernel,
    pub(super) fusion: Fusion,
    pub(super) attention: AttentionPlan,
    pub(super) cache: &'a KvCache,
    pub(super) s: &'a Scratch,
    pub(super) rope: &'a RopeTables,
    pub(super) gw: &'a GpuWeights,
    pub(super) sampling: &'a RowSampling,
    /// MoE layers keep real tokens' routes in the route log.
    pub(super) route_log: bool,
    /// Rows sample on the split path ([`crate::engine::sampling::Sampler::splits`]).
    pub(super) split_sampling: bool,
    /// Positions an all-position step scores.
    pub(super) all_logits_tokens: usize,
}

/// Every dispatch of an engine.
pub(super) struct Dispatches {
    pub(super) chunk: Vec<Dispatch>,
    pub(super) head: Vec<Dispatch>,
    pub(super) all_head: Vec<Dispatch>,
    pub(super) sample: SampleDispatches,
    pub(super) score: SampleDispatches,
    pub(super) bias: Dispatch,
    /// Distinct pipelines among them.
    pub(super) pipelines: usize,
}

/// Build every dispatch of a chunk, the head and sampling over `inputs`' buffers: once in
/// `Engine::new`, and again when [`Engine::wake`] brings back buffers that were released (the
/// pipelines come from the device's cache; only bind groups are new).
pub(super) fn build_dispatches(inputs: &DispatchInputs) -> Result<Dispatches> {
    let DispatchInputs {
        gpu,
        cfg,
        max_len,
        matmul,
        fusion,
        attention,
        cache,
        s,
        rope,
        gw,
        sampling,
        route_log,
        split_sampling,
        all_logits_tokens,
    } = *inputs;
    let d = cfg.d_model;
    let pipelines = &gpu.pipelines;
    // the products' float kernel (int-dot: for the formats it does not take, what `Auto` picks)
    let float_kernel = if matmul == MatmulKernel::IntDot { resolve_matmul(MatmulKernel::Auto, gpu)? } else { matmul };
    let bld = Builder {
        subgroup: gpu.subgroup_size().filter(|_| float_kernel == MatmulKernel::Subgroup),
        int_dot: matmul == MatmulKernel::IntDot,
        outs_per_thread: if matches!(float_kernel, MatmulKernel::Wide | MatmulKernel::WideSubgroup) { 8 } else { 1 },
        wide_subgroup: float_kernel == MatmulKernel::WideSubgroup,
        tiled: float_kernel == MatmulKernel::Tiled,
        workgroup_reduce: float_kernel == MatmulKernel::Workgroup,
        product_wg: product_wg(float_kernel, gpu),
        attention,
        fusion,
        route_log,
        cfg,
        pipelines,
        built: Default::default(),
        cache,
        s,
        rope,
        gw,
    };
    let mut chunk_dispatches = Vec::new();
    // embedding gather, one dispatch per table part
    for p in &gw.embed.parts {
        let spec = kernels::Embed {
            d,
            part_start: p.row_start,
            part_rows: p.rows,
            format: gw.embed.format,
            scale: cfg.embed_scale,
        };
        chunk_dispatches.push(bld.dispatch(&spec, &[&s.step, &s.ids, &p.buffer, &s.x], Grid::Tokens(d / 4)));
    }
    for (i, lw) in gw.layers.iter().enumerate() {
        chunk_dispatches.extend(bld.layer(i, lw));
    }
    // bookkeeping once every layer has read the old ring positions
    let commit = kernels::Commit { max_len, ring_slots: cache.ring_slots().max(1), has_ring: cfg.has_local() };
    chunk_dispatches.push(bld.dispatch(
        &commit,
        &[&s.step, &s.row_info, &s.ids, &cache.history, &cache.lpos, &cache.lens],
        Grid::Tokens(1),
    ));
    let final_norm = kernels::RmsNorm {
        d,
        eps: cfg.norm_eps,
        weight: gw.final_norm.is_some(),
        accumulate: false,
        quantize: false,
        gather_last: true,
        lanes: kernels::FINAL_NORM_LANES,
    };
    let mut head_dispatches = vec![bld.dispatch(
        &final_norm,
        // no QUANTIZE: rows without tokens keep last_h, and xq is every product's scratch
        &[&s.step, &s.row_info, &s.x, gw.final_norm.as_ref().unwrap_or(&s.dummy), &s.last_h, &s.dummy_rw],
        Grid::Rows(kernels::FINAL_NORM_LANES as usize),
    )];
    let head = gw.head.as_ref().unwrap_or(&gw.embed);
    let softcap = cfg.logit_softcap.unwrap_or(0.0);
    head_dispatches.extend(
        bld.product(head, ProductIo { per_row: true, softcap, ..ProductIo::new(&s.last_h, d, &s.logits, cfg.vocab) }),
    );
    // all-position logits (speculative verify): final norm of every token into h, LM head
    let mut all_head_dispatches =
        vec![bld.norm_lanes(&s.x, gw.final_norm.as_ref(), &s.h, false, kernels::FINAL_NORM_LANES)];
    all_head_dispatches.extend(bld.product(
        head,
        ProductIo { softcap, quantized: bld.norm_quantizes(), ..ProductIo::new(&s.h, d, &s.all_logits, cfg.vocab) },
    ));
    let sampler = |score: bool| {
        let (logits, out, top) = match score {
            false => (&s.logits, &s.sampled, &sampling.top),
            true => (&s.all_logits, &s.scored, &s.scored_top),
        };
        let buffers = [&s.step, &s.row_info, &s.samplers, logits, out, &sampling.mask, top, &s.ids, &s.sample_stats];
        let spec = |stage| kernels::Sample {
            vocab: cfg.vocab,
            mask_words: sampling.words,
            score,
            stat_rows: cache.rows().max(all_logits_tokens),
            stage,
        };
        let per_workgroup = match score {
            false => Grid::WorkgroupPerRow,
            true => Grid::Tokens(Kernel::Sample.workgroup_size() as usize),
        };
        let chunks = Grid::Chunks { chunks: kernels::Sample::chunks(cfg.vocab), per_token: score };
        SampleDispatches {
            whole: bld.dispatch(&spec(SampleStage::Whole), &buffers, per_workgroup),
            split: split_sampling.then(|| SplitSampling {
                chunks: bld.dispatch(&spec(SampleStage::Chunks), &buffers, chunks),
                radix: (0..kernels::RADIX_PASSES)
                    .map(|pass| bld.dispatch(&spec(SampleStage::Radix(pass)), &buffers, chunks))
                    .collect(),
                kept: bld.dispatch(&spec(SampleStage::Kept), &buffers, chunks),
                merge: bld.dispatch(&spec(SampleStage::Merge), &buffers, per_workgroup),
            }),
        }
    };
    let (sample_dispatches, score_dispatches) = (sampler(false), sampler(true));
    let bias_dispatch = bld.dispatch(
        &kernels::LogitBias { vocab: cfg.vocab, slots: sampling.slots.max(1) },
        &[&s.step, &s.row_info, &sampling.bias_n, &sampling.bias, &s.logits],
        Grid::Rows(sampling.slots.max(1)),
    );
    let pipeline_count = bld.built.borrow().len();
    Ok(Dispatches {
        chunk: chunk_dispatches,
        head: head_dispatches,
        all_head: all_head_dispatches,
        sample: sample_dispatches,
        score: score_dispatches,
        bias: bias_dispatch,
        pipelines: pipeline_count,
    })
}
