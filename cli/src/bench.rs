//! `kvdecode bench`: prefill and decode throughput per K/V type, rows and context, GPU time per
//! kernel class (timestamp queries) against the device's copy bandwidth, the attention variants
//! side by side, multi-step decode (several steps per readback), and requests sharing a long
//! system prompt with the prompt cache on and off, printed as markdown tables; `--json` ends with
//! one JSON object of the figures for scripts.

use std::time::Instant;

use kvdecode::{
    AttentionKernel, Engine, EngineOptions, Gpu, KvDtype, ModelWeights, Profile, Request, Sampler, Scheduler,
    SplitMix64, WeightDtype,
};

use crate::common::{load_model, Result};

#[derive(clap::Args)]
pub struct Args {
    /// A model file (GGUF, Hugging Face directory, kvdecode safetensors), `demo`, or a synthetic
    /// model of a real shape in Q4_1 blocks: `synthetic:smollm2` or `synthetic:1b`.
    #[arg(long, default_value = "demo")]
    model: String,
    /// Rows to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    rows: Vec<usize>,
    /// Contexts (prompt tokens per row) to measure.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    ctx: Vec<usize>,
    /// Decode steps timed per configuration.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// K/V types to measure.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,bf16")]
    kv: Vec<String>,
    /// Steps per readback in the multi-step table.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    windows: Vec<usize>,
    /// Weights on the GPU: f32 or f16 (quantized blocks stay quantized).
    #[arg(long, default_value = "f32", value_parser = |s: &str| match s { "f32" => Ok(WeightDtype::F32), "f16" => Ok(WeightDtype::F16), _ => Err(format!("unknown weight type {s:?}")) })]
    weights: WeightDtype,
    /// Contexts of the attention-variant table (serial vs split, same run).
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    attention_ctx: Vec<usize>,
    /// Rows of the attention-variant table.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    attention_rows: Vec<usize>,
    /// Rows of the MoE table.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    moe_rows: Vec<usize>,
    /// Context (prompt positions) of the MoE table's rows.
    #[arg(long, default_value_t = 128)]
    moe_ctx: usize,
    /// Rows of the LoRA table.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    lora_rows: Vec<usize>,
    /// Rank of the LoRA table's adapters.
    #[arg(long, default_value_t = 16)]
    lora_rank: usize,
    /// With the LoRA table, each engine's GPU ms per pipeline variant.
    #[arg(long)]
    lora_variants: bool,
    /// LoRA table: sets of its four engines made one after another, each set anew (a line gives
    /// the median of the sets' ratios): two identical engines can differ by a few percent.
    #[arg(long, default_value_t = 1)]
    lora_sets: usize,
    /// Models of the occupancy table (it ignores `--model`).
    #[arg(long, value_delimiter = ',', default_value = "synthetic:smollm2,synthetic:1b")]
    occupancy_models: Vec<String>,
    /// Rows of the occupancy table.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    occupancy_rows: Vec<usize>,
    /// Contexts of the occupancy table.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    occupancy_ctx: Vec<usize>,
    /// The occupancy table's device: `dry-run` (wgpu's noop backend posing as a discrete GPU
    /// with 32-lane subgroups: the kernels an NVIDIA card gets) or `adapter` (the bench's own).
    #[arg(long, default_value = "dry-run", value_parser = ["dry-run", "adapter"])]
    occupancy_on: String,
    /// Workgroups that fill the GPU (SMs or CUs; an H100's and H200's 132): the occupancy
    /// table's bar, below which a dispatch's loop must be short.
    #[arg(long, default_value_t = 132)]
    occupancy_sms: u64,
    /// The occupancy table's engines hold 4 LoRA adapter slots of this rank (0: none): their
    /// `A x` dispatches and the products' epilogue join the step.
    #[arg(long, default_value_t = 0)]
    occupancy_lora_rank: usize,
    /// Tables to print: throughput, profile, attention, multistep, prefix; and, only when named,
    /// weights (a full weight update against `queue.write_buffer` of the same bytes, memory over
    /// many updates and sleep/wake cycles), formats (the model's weights in each block format:
    /// GPU time of the products per decode step against Q4_1's, same run) and moe (a mixture of
    /// experts' decode step against the dense model of its active parameters, and the distinct
    /// experts the rows read), lora (adapters on every linear layer, rows spread over 4, against
    /// the base model; an adapter update against `queue.write_buffer` of its bytes), occupancy
    /// (every dispatch of a decode step: workgroups, threads, longest serial loop, bytes;
    /// computed, needs no GPU), load (`--model` from its file onto the GPU: time and peak host
    /// memory; alone, the model is not loaded for other tables first).
    #[arg(long, value_delimiter = ',', default_value = "throughput,profile,attention,multistep,prefix")]
    tables: Vec<String>,
    /// Prefix table: tokens of the system prompt every request shares.
    #[arg(long, default_value_t = 1000)]
    prefix_len: usize,
    /// Prefix table: requests (each the system prompt plus its own 16 to 48 tokens, 8 generated).
    #[arg(long, default_value_t = 16)]
    prefix_requests: usize,
    /// Prefix table: rows serving them.
    #[arg(long, default_value_t = 4)]
    prefix_rows: usize,
    /// Weights and load tables: timed rounds of each (the median is printed).
    #[arg(long, default_value_t = 5)]
    weight_rounds: usize,
    /// Formats table: rounds over all formats (each format's median is printed; the rounds
    /// interleave the formats, so a slow spell of a shared machine touches them all alike).
    #[arg(long, default_value_t = 3)]
    format_rounds: usize,
    /// Weights table: updates before the memory is read again.
    #[arg(long, default_value_t = 500)]
    weight_updates: usize,
    /// Weights table: sleep/wake cycles before the memory is read again.
    #[arg(long, default_value_t = 50)]
    sleep_cycles: usize,
    /// The profile table's sampler: `greedy`, or `top-p` (temperature 0.8, top-p 0.9 and the 5
    /// most likely tokens with their logprobs: the sampler's longest path).
    #[arg(long, default_value = "greedy", value_parser = ["greedy", "top-p"])]
    sampler: String,
    /// End with one JSON object of the figures (one line), for scripts.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let (rows_list, ctx_list, steps) = (a.rows.clone(), a.ctx.clone(), a.steps);
    for t in &a.tables {
        let known = [
            "throughput",
            "profile",
            "attention",
            "multistep",
            "prefix",
            "weights",
            "formats",
            "moe",
            "lora",
            "occupancy",
            "load",
        ];
        if !known.contains(&t.as_str()) {
            return Err(format!(
                "--tables: unknown table {t:?} (throughput, profile, attention, multistep, prefix, weights, formats, moe, \
                 lora, occupancy, load)"
            )
            .into());
        }
    }
    let table = |name: &str| a.tables.iter().any(|t| t == name);
    let mut json = serde_json::Map::new();
    let kvs = a.kv.iter().map(|s| KvDtype::parse(s)).collect::<kvdecode::Result<Vec<_>>>()?;
    let gpu = Gpu::new()?;
    if table("load") {
        let rows = crate::bench_load::load_table(&gpu, &a.model, a.weights, a.weight_rounds)?;
        json.insert("load".into(), rows.into());
        if a.tables.len() == 1 {
            if a.json {
                println!("{}", serde_json::Value::Object(json));
            }
            return Ok(());
        }
    }
    let (model, _) = load_model(&a.model)?;
    println!("adapter: {}", gpu.describe());
    println!(
        "model: {}, {} layers, d_model {}, {} heads / {} KV heads, window {}, vocab {}",
        a.model,
        model.cfg.n_layers(),
        model.cfg.d_model,
        model.cfg.n_heads,
        model.cfg.n_kv_heads,
        model.cfg.window,
        model.cfg.vocab
    );
    // what Engine::new will pick (EngineOptions::matmul and ::fusion resolved the same way)
    let matmul = kvdecode::engine::resolve_matmul(kvdecode::MatmulKernel::from_env()?, &gpu)?;
    let mut fusion = kvdecode::Fusion::from_env()?.unwrap_or_else(|| kvdecode::Fusion::auto(&gpu.info, matmul));
    fusion.norm &= matmul != kvdecode::MatmulKernel::IntDot;
    let matmul = match (matmul, gpu.subgroup_size()) {
        (kvdecode::MatmulKernel::Subgroup, Some(sg)) => format!("subgroup ({sg} lanes)"),
        (k, _) => k.name().to_string(),
    };
    let split = kvdecode::gpu::variants::split_sampling_from_env()?
        .unwrap_or_else(|| kvdecode::gpu::variants::split_sampling_auto(&gpu.info));
    println!(
        "kernels: matmul {matmul} (KVDECODE_MATMUL), fused: {} (KVDECODE_FUSE), sampling: {} (KVDECODE_SAMPLING)\n",
        fusion.name(),
        if split { "split" } else { "whole" }
    );
    json.insert("fusion".into(), fusion.name().into());
    json.insert("matmul".into(), matmul.into());
    let mut rng = SplitMix64(3);
    let mut throughput = Vec::new();
    if table("throughput") {
        println!("| kv | rows | context | prefill tok/s | decode tok/s | ms / decode step | dispatches / step | submits / step | KV MiB | KV used MiB | naive MiB |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    }
    for &kv in kvs.iter().filter(|_| table("throughput")) {
        for &rows in &rows_list {
            for &ctx in &ctx_list {
                let max_len = ctx + steps;
                let mut e = Engine::new(
                    &gpu,
                    &model,
                    EngineOptions {
                        kv,
                        weights: a.weights,
                        beyond_trained_context: true,
                        ..EngineOptions::new(rows, max_len)
                    },
                )?;
                let ids: Vec<u32> = (0..rows * ctx).map(|_| rng.below(model.cfg.vocab) as u32).collect();
                let greedy = vec![Sampler::GREEDY; rows];
                // warm up the pipelines on a throwaway row state
                e.append_sample(&ids[..rows], 1, &vec![1; rows], None, &greedy)?;
                e.reset(&(0..rows).collect::<Vec<_>>())?;
                let t = Instant::now();
                let mut next = e.append_sample(&ids, ctx, &vec![ctx; rows], None, &greedy)?;
                let prefill = t.elapsed().as_secs_f64();
                let before = e.stats();
                let t = Instant::now();
                for _ in 0..steps {
                    let step_ids: Vec<u32> = next.iter().map(|x| x.unwrap_or(0)).collect();
                    next = e.append_sample(&step_ids, 1, &vec![1; rows], None, &greedy)?;
                }
                let decode = t.elapsed().as_secs_f64();
                let after = e.stats();
                let c = e.cache();
                throughput.push(serde_json::json!({
                    "kv": format!("{kv:?}"),
                    "rows": rows,
                    "context": ctx,
                    "prefill_tok_s": (rows * ctx) as f64 / prefill,
                    "decode_tok_s": (rows * steps) as f64 / decode,
                    "dispatches_per_step": (after.dispatches - before.dispatches) / steps as u64,
                    "kv_bytes": c.nbytes(),
                    "kv_used_bytes": c.used_nbytes(),
                    "naive_kv_bytes": c.naive_nbytes(),
                    "attention": e.attention_kernel().name(),
                }));
                println!(
                    "| {kv:?} | {rows} | {ctx} | {:.0} | {:.1} | {:.1} | {} | {} | {:.2} | {:.2} | {:.2} |",
                    (rows * ctx) as f64 / prefill,
                    (rows * steps) as f64 / decode,
                    1000.0 * decode / steps as f64,
                    (after.dispatches - before.dispatches) / steps as u64,
                    (after.submits - before.submits) as f64 / steps as f64,
                    c.nbytes() as f64 / 1048576.0,
                    c.used_nbytes() as f64 / 1048576.0,
                    c.naive_nbytes() as f64 / 1048576.0
                );
            }
        }
    }
    json.insert("adapter".into(), gpu.describe().into());
    json.insert("model".into(), a.model.clone().into());
    json.insert("throughput".into(), throughput.into());
    if table("profile") {
        let sampler = crate::bench_occupancy::samplers()[usize::from(a.sampler == "top-p")];
        profile_table(&gpu, &model, &a.weights, &rows_list, &ctx_list, steps, sampler)?;
    }
    if table("attention") {
        let rows = attention_table(&gpu, &model, &a.weights, &a.attention_rows, &a.attention_ctx, steps)?;
        json.insert("attention".into(), rows.into());
    }
    if table("multistep") {
        multistep_table(&gpu, &model, &a.weights, &rows_list, &a.windows)?;
    }
    if table("prefix") {
        let rows = prefix_table(&gpu, &model, &a)?;
        if let Some(on) = rows.iter().find(|r| r["prompt_cache"] == true) {
            json.insert("prefix_hit_rate".into(), on["hit_rate"].clone());
        }
        json.insert("prefix".into(), rows.into());
    }
    if table("weights") {
        let w = crate::bench_weights::weights_table(&gpu, &model, a.weight_rounds, a.weight_updates, a.sleep_cycles)?;
        json.insert("weights".into(), w);
    }
    if table("formats") {
        json.insert(
            "formats".into(),
            crate::bench_formats::formats_table(&gpu, &model, steps, a.format_rounds.max(1))?.into(),
        );
    }
    if table("moe") {
        let rows = crate::bench_moe::moe_table(&gpu, &model, a.weights, &a.moe_rows, a.moe_ctx, steps)?;
        json.insert("moe".into(), rows.into());
    }
    if table("lora") {
        let b = crate::bench_lora::LoraBench {
            rows: &a.lora_rows,
            rank: a.lora_rank,
            steps,
            rounds: a.weight_rounds,
            variants: a.lora_variants,
            sets: a.lora_sets.max(1),
        };
        let l = crate::bench_lora::lora_table(&gpu, &model, a.weights, &b)?;
        json.insert("lora".into(), l);
    }
    if table("occupancy") {
        let shapes = crate::bench_occupancy::Shapes {
            models: &a.occupancy_models,
            rows: &a.occupancy_rows,
            ctx: &a.occupancy_ctx,
            sms: a.occupancy_sms,
            max_alone: 64,
            lora_rank: a.occupancy_lora_rank,
        };
        let on = if a.occupancy_on == "adapter" { gpu.clone() } else { Gpu::dry_run(32)? };
        json.extend(crate::bench_occupancy::occupancy_table(&on, &shapes)?);
    }
    if a.json {
        println!("{}", serde_json::Value::Object(json));
    }
    Ok(())
}

/// Requests sharing a long system prompt through the scheduler, the prompt cache on and off:
/// time to first token, prompt tokens computed, hit rate, and global K/V per running row
/// against the per-row reservation of a cache without paging (`max_len` positions each).
fn prefix_table(gpu: &Gpu, model: &ModelWeights, a: &Args) -> Result<Vec<serde_json::Value>> {
    let (n, rows) = (a.prefix_requests, a.prefix_rows.max(1));
    let mut rng = SplitMix64(11);
    let vocab = model.cfg.vocab;
    let system: Vec<u32> = (0..a.prefix_len).map(|_| rng.below(vocab) as u32).collect();
    let reqs: Vec<Request> = (0..n)
        .map(|_| {
            let own = 16 + rng.below(33);
            let tokens = system.iter().copied().chain((0..own).map(|_| rng.below(vocab) as u32)).collect();
            Request { tokens, max_new: 8, ..Default::default() }
        })
        .collect();
    let max_len = a.prefix_len + 48 + 8;
    println!(
        "\n{n} requests sharing a {}-token system prompt (+16 to 48 tokens each, 8 generated), {rows} rows\n",
        a.prefix_len
    );
    println!("| prompt cache | mean time to first token (ms) | prompt tokens computed | hit rate | global K/V per running row (KiB) | per-row reservation (KiB) | wall s |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut out = Vec::new();
    for cache_on in [false, true] {
        let opts = EngineOptions {
            kv: KvDtype::F16,
            weights: a.weights,
            prompt_cache: cache_on,
            beyond_trained_context: true,
            ..EngineOptions::new(rows, max_len)
        };
        let mut e = Engine::new(gpu, model, opts)?;
        let mut sched = Scheduler::new(&e, 256);
        for r in &reqs {
            sched.submit(r.clone())?;
        }
        let t = Instant::now();
        let (mut done, mut per_row, mut samples) = (Vec::new(), 0.0, 0usize);
        loop {
            let (d, more) = sched.step(&mut e, &mut |_| {})?;
            done.extend(d);
            let active = sched.active();
            if active > 0 {
                per_row += e.cache().block_usage().used as f64
                    * (e.cache().block_len() as u64 * e.cache().global_bytes_per_position()) as f64
                    / active as f64;
                samples += 1;
            }
            if !more && sched.queued() == 0 {
                break;
            }
        }
        let wall = t.elapsed().as_secs_f64();
        let ttft =
            done.iter().map(|c| c.stats.time_to_first_token.as_secs_f64()).sum::<f64>() / done.len().max(1) as f64;
        let pc = e.cache().prompt_cache_stats();
        let prompt_tokens: usize = reqs.iter().map(|r| r.tokens.len()).sum();
        let computed = prompt_tokens - pc.hit_tokens;
        let per_row = per_row / samples.max(1) as f64 / 1024.0;
        let reservation = (max_len as u64 * e.cache().global_bytes_per_position()) as f64 / 1024.0;
        println!(
            "| {} | {:.1} | {computed} of {prompt_tokens} | {:.3} | {per_row:.1} | {reservation:.1} | {wall:.2} |",
            if cache_on { "on" } else { "off" },
            1000.0 * ttft,
            pc.hit_rate()
        );
        out.push(serde_json::json!({
            "prompt_cache": cache_on,
            "requests": n,
            "rows": rows,
            "prefix_len": a.prefix_len,
            "mean_ttft_ms": 1000.0 * ttft,
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_computed": computed,
            "hit_rate": pc.hit_rate(),
            "global_kv_kib_per_running_row": per_row,
            "per_row_reservation_kib": reservation,
            "seconds": wall,
        }));
    }
    Ok(out)
}

/// Multi-step decode: the host enqueues `window` steps, then reads all their ids at once.
fn multistep_table(
    gpu: &Gpu,
    model: &ModelWeights,
    weights: &WeightDtype,
    rows_list: &[usize],
    windows: &[usize],
) -> Result<()> {
    let mut rng = SplitMix64(9);
    let total = 32;
    println!("\nmulti-step decode (f32 K/V, context 128, {total} steps per row):\n");
    println!("| rows | steps per readback | decode tok/s | ms / step | readbacks |");
    println!("|---:|---:|---:|---:|---:|");
    for &rows in rows_list {
        for &w in windows {
            let opts = EngineOptions {
                rollback: w.max(1) - 1,
                weights: *weights,
                beyond_trained_context: true,
                ..EngineOptions::new(rows, 128 + total + w)
            };
            let mut e = Engine::new(gpu, model, opts)?;
            let ids: Vec<u32> = (0..rows * 128).map(|_| rng.below(model.cfg.vocab) as u32).collect();
            let greedy = vec![Sampler::GREEDY; rows];
            let all: Vec<usize> = (0..rows).collect();
            let first = e.append_sample(&ids, 128, &vec![128; rows], None, &greedy)?;
            let mut feed: Vec<u32> = first.iter().map(|x| x.unwrap_or(0)).collect();
            // warm-up window
            let got = e.decode_steps(&all, &feed, &greedy, w)?;
            feed = got.iter().map(|g| *g.last().unwrap_or(&0)).collect();
            let t = Instant::now();
            for _ in 0..total / w {
                let got = e.decode_steps(&all, &feed, &greedy, w)?;
                feed = got.iter().map(|g| *g.last().unwrap_or(&0)).collect();
            }
            let secs = t.elapsed().as_secs_f64();
            let steps = (total / w) * w;
            println!(
                "| {rows} | {w} | {:.1} | {:.2} | {} |",
                (rows * steps) as f64 / secs,
                1000.0 * secs / steps as f64,
                total / w
            );
        }
    }
    Ok(())
}

/// GPU time of a decode step per kernel class, from timestamp queries around every dispatch (f32
/// K/V), with the weights' effective bandwidth as a fraction of the device's copy bandwidth.
fn profile_table(
    gpu: &Gpu,
    model: &ModelWeights,
    weights: &WeightDtype,
    rows_list: &[usize],
    ctx_list: &[usize],
    steps: usize,
    (sampler_name, sampler): (&str, Sampler),
) -> Result<()> {
    let layers = model.cfg.n_layers();
    let mut rng = SplitMix64(5);
    let mut copy_bw = None;
    let mut printed_head = false;
    let mut per_kernel = Vec::new();
    for &rows in rows_list {
        for &ctx in ctx_list {
            let opts = EngineOptions {
                weights: *weights,
                beyond_trained_context: true,
                ..EngineOptions::new(rows, ctx + steps + 1)
            };
            let mut e = Engine::new(gpu, model, opts)?;
            let bw = match copy_bw {
                Some(bw) => bw,
                None => match e.copy_bandwidth(64 << 20) {
                    Ok(bw) => *copy_bw.insert(bw),
                    Err(err) => {
                        println!("\nno GPU time per kernel class: {err}");
                        return Ok(());
                    }
                },
            };
            if !printed_head {
                let how = if gpu.device.features().contains(kvdecode::wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES)
                    && std::env::var("KVDECODE_PROFILE_PASSES").as_deref() != Ok("each")
                {
                    "a timestamp after each dispatch inside the step's one pass"
                } else {
                    "each dispatch in a pass of its own, timestamps around it"
                };
                println!(
                    "\nGPU time per decode step by kernel class (timestamp queries: {how}; f32 K/V; sampler: \
                     {sampler_name}; device copy bandwidth {:.1} GB/s, read + write):\n",
                    bw / 1e9
                );
                println!("| rows | context | matmul ms | attention ms | other ms | GPU ms / step | dispatches / layer | weights GB/s | of copy bandwidth |");
                println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
                printed_head = true;
            }
            let ids: Vec<u32> = (0..rows * ctx).map(|_| rng.below(model.cfg.vocab) as u32).collect();
            let samplers = vec![sampler; rows];
            let mut next = e.append_sample(&ids, ctx, &vec![ctx; rows], None, &samplers)?;
            let mut total = Profile::default();
            for _ in 0..steps {
                let step_ids: Vec<u32> = next.iter().map(|x| x.unwrap_or(0)).collect();
                total.add(&e.profile_step(&step_ids, 1, &vec![1; rows], None, Some(&samplers))?);
                // the profiled step samples on the GPU without reading back; feed fresh ids
                next = (0..rows).map(|_| Some(rng.below(model.cfg.vocab) as u32)).collect();
            }
            let n = steps as f64;
            // by pipeline variant: the labels the pipelines carry (`kv_write_ring_f16`)
            let mut variants = total.variants.clone();
            variants.sort_by(|a, b| b.1.total_cmp(&a.1));
            let kernels: Vec<String> = variants
                .iter()
                .map(|(name, seconds, count)| format!("{name} {:.3} ms ({:.0}x)", 1e3 * seconds / n, *count as f64 / n))
                .collect();
            per_kernel.push(format!("- {rows} rows, context {ctx}: {}", kernels.join(", ")));
            // every matrix is read once per decode step
            let weights_bw = e.weight_bytes() as f64 / (total.matmul / n);
            println!(
                "| {rows} | {ctx} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.0}% |",
                1e3 * total.matmul / n,
                1e3 * total.attention / n,
                1e3 * total.other / n,
                1e3 * total.total() / n,
                total.dispatches as f64 / n / layers as f64,
                weights_bw / 1e9,
                100.0 * weights_bw / bw
            );
        }
    }
    if !per_kernel.is_empty() {
        println!("\nGPU time per decode step by pipeline variant (ms, dispatches per step), slowest first:\n");
        for line in per_kernel {
            println!("{line}");
        }
    }
    Ok(())
}

/// The attention kernel's variants side by side in one run: GPU time of attention and of the rest
/// of a decode step (timestamp queries), and the wall time of whole steps, each variant against
/// the serial (portable) kernel.
fn attention_table(
    gpu: &Gpu,
    model: &ModelWeights,
    weights: &WeightDtype,
    rows_list: &[usize],
    ctx_list: &[usize],
    steps: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    println!(
        "\nattention variants per decode step, and in the prompt's last chunk (f32 K/V; GPU ms from timestamp \
         queries, step ms wall clock):\n"
    );
    println!(
        "| attention | rows | context | attention ms | rest ms | step ms | attention speedup | step speedup | \
         last chunk tokens | chunk attention ms | chunk attention speedup |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut rng = SplitMix64(7);
    for &rows in rows_list {
        for &ctx in ctx_list {
            let ids: Vec<u32> = (0..rows * ctx).map(|_| rng.below(model.cfg.vocab) as u32).collect();
            let greedy = vec![Sampler::GREEDY; rows];
            let mut serial: Option<(f64, f64, f64)> = None;
            for kernel in AttentionKernel::ALL {
                let opts = EngineOptions {
                    weights: *weights,
                    attention: kernel,
                    beyond_trained_context: true,
                    ..EngineOptions::new(rows, ctx + 2 * steps + 1)
                };
                let mut e = Engine::new(gpu, model, opts)?;
                if e.attention_kernel() != kernel {
                    continue;
                }
                // the prompt, its last chunk timed per kernel (split-group takes query tiles there)
                let last = ctx.min(e.chunk_width());
                let part = |from: usize, to: usize| -> Vec<u32> {
                    (0..rows).flat_map(|r| ids[r * ctx + from..r * ctx + to].iter().copied()).collect()
                };
                if ctx > last {
                    e.feed(&part(0, ctx - last), ctx - last, &vec![ctx - last; rows], None)?;
                }
                let chunk = match e.profile_step(&part(ctx - last, ctx), last, &vec![last; rows], None, None) {
                    Ok(p) => p.attention,
                    Err(err) => {
                        println!("no GPU times: {err}");
                        return Ok(out);
                    }
                };
                let mut next: Vec<Option<u32>> = (0..rows).map(|_| Some(rng.below(model.cfg.vocab) as u32)).collect();
                let t = std::time::Instant::now();
                for _ in 0..steps {
                    let step_ids: Vec<u32> = next.iter().map(|x| x.unwrap_or(0)).collect();
                    next = e.append_sample(&step_ids, 1, &vec![1; rows], None, &greedy)?;
                }
                let step = t.elapsed().as_secs_f64() / steps as f64;
                let mut total = Profile::default();
                for _ in 0..steps {
                    let step_ids: Vec<u32> = (0..rows).map(|_| rng.below(model.cfg.vocab) as u32).collect();
                    match e.profile_step(&step_ids, 1, &vec![1; rows], None, Some(&greedy)) {
                        Ok(p) => total.add(&p),
                        Err(err) => {
                            println!("no GPU times: {err}");
                            return Ok(out);
                        }
                    }
                }
                let n = steps as f64;
                let attn = total.attention / n;
                let (base_attn, base_step, base_chunk) = *serial.get_or_insert((attn, step, chunk));
                out.push(serde_json::json!({
                    "attention": kernel.name(),
                    "rows": rows,
                    "context": ctx,
                    "attention_ms": 1e3 * attn,
                    "step_ms": 1e3 * step,
                    "attention_speedup": base_attn / attn,
                    "last_chunk_tokens": last,
                    "chunk_attention_ms": 1e3 * chunk,
                    "chunk_attention_speedup": base_chunk / chunk,
                }));
                println!(
                    "| {} | {rows} | {ctx} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.2}x | {last} | {:.2} | {:.2}x |",
                    kernel.name(),
                    1e3 * attn,
                    1e3 * (total.total() / n - attn),
                    1e3 * step,
                    base_attn / attn,
                    base_step / step,
                    1e3 * chunk,
                    base_chunk / chunk
                );
            }
        }
    }
    Ok(out)
}
