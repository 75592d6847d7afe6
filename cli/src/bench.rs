//! `kvdecode bench`: prefill and decode throughput per K/V type, rows and context, and multi-step
//! decode (several steps per readback), printed as markdown tables.

use std::time::Instant;

use kvdecode::{Engine, EngineOptions, Gpu, KvDtype, Sampler, SplitMix64, WeightDtype};

use crate::common::{load_model, Result};

#[derive(clap::Args)]
pub struct Args {
    /// A model file (GGUF, Hugging Face directory, kvdecode safetensors) or `demo`.
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
}

pub fn run(a: Args) -> Result<()> {
    let (rows_list, ctx_list, steps) = (a.rows, a.ctx, a.steps);
    let kvs = a.kv.iter().map(|s| KvDtype::parse(s)).collect::<kvdecode::Result<Vec<_>>>()?;
    let gpu = Gpu::new()?;
    let (model, _) = load_model(&a.model)?;
    println!("adapter: {}", gpu.describe());
    println!(
        "model: {}, {} layers, d_model {}, {} heads / {} KV heads, window {}, vocab {}\n",
        a.model,
        model.cfg.n_layers(),
        model.cfg.d_model,
        model.cfg.n_heads,
        model.cfg.n_kv_heads,
        model.cfg.window,
        model.cfg.vocab
    );
    println!("| kv | rows | context | prefill tok/s | decode tok/s | ms / decode step | dispatches / step | submits / step | KV MiB | naive MiB |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut rng = SplitMix64(3);
    for &kv in &kvs {
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
                println!(
                    "| {kv:?} | {rows} | {ctx} | {:.0} | {:.1} | {:.1} | {} | {} | {:.2} | {:.2} |",
                    (rows * ctx) as f64 / prefill,
                    (rows * steps) as f64 / decode,
                    1000.0 * decode / steps as f64,
                    (after.dispatches - before.dispatches) / steps as u64,
                    (after.submits - before.submits) as f64 / steps as f64,
                    c.nbytes() as f64 / 1048576.0,
                    c.naive_nbytes() as f64 / 1048576.0
                );
            }
        }
    }
    // multi-step decode: the host enqueues `window` steps, then reads all their ids at once
    let windows = a.windows;
    let total = 32;
    println!("\nmulti-step decode (f32 K/V, context 128, {total} steps per row):\n");
    println!("| rows | steps per readback | decode tok/s | ms / step | readbacks |");
    println!("|---:|---:|---:|---:|---:|");
    for &rows in &rows_list {
        for &w in &windows {
            let opts = EngineOptions {
                rollback: w.max(1) - 1,
                weights: a.weights,
                beyond_trained_context: true,
                ..EngineOptions::new(rows, 128 + total + w)
            };
            let mut e = Engine::new(&gpu, &model, opts)?;
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
