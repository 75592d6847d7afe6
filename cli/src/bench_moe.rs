//! `kvdecode bench --tables moe`: a mixture of experts' decode step against a dense model of the
//! same active parameters (each MoE layer's MLP replaced by one of top_k x expert size, plus the
//! shared expert's), GPU time by timestamp queries, in one run; beside it how many distinct
//! experts the step's rows read per layer.

use kvdecode::{Engine, EngineOptions, Gpu, ModelWeights, Sampler, SplitMix64, WeightDtype, EXPERT_TOKEN_BLOCK};
use serde_json::json;

use crate::common::Result;

/// The dense model of `model`'s active parameters: its attention, and on every layer an MLP of
/// top_k x expert size (+ the shared expert's), in the experts' block format.
pub fn dense_twin(model: &ModelWeights) -> Result<ModelWeights> {
    let moe = model.cfg.moe.as_ref().ok_or("the moe table needs a mixture of experts (synthetic:qwen3-moe, ...)")?;
    let mut cfg = model.cfg.clone();
    cfg.ffn = moe.top_k * moe.ffn + moe.shared_ffn.unwrap_or(0);
    cfg.moe = None;
    let w = ModelWeights::random(&cfg, 0x5eed)?;
    let kind = model.layers[moe.layers[0]].mlp_in.quant.as_ref().map(|q| q.kind);
    Ok(match kind {
        Some(k) => w.quantized(k)?,
        None => w,
    })
}

/// Per MoE layer of the timed steps (means): the distinct experts the rows' tokens were routed to,
/// and the weight reads of the expert products, an expert's rows once per four of its (token,
/// slot) pairs in each block of [`EXPERT_TOKEN_BLOCK`] tokens (`matmul_experts.wgsl`).
struct ExpertReads {
    distinct: f64,
    reads: f64,
}

/// GPU ms per decode step (the median of `steps` profiled steps after two untimed ones) of
/// `rows` rows at context `ctx`, and with a MoE model the experts the timed steps read.
fn time_steps(
    gpu: &Gpu,
    w: &ModelWeights,
    dtype: WeightDtype,
    rows: usize,
    ctx: usize,
    steps: usize,
) -> Result<(f64, Option<ExpertReads>)> {
    let moe = w.cfg.moe.is_some();
    let opts = EngineOptions {
        weights: dtype,
        beyond_trained_context: true,
        record_routes: moe,
        ..EngineOptions::new(rows, ctx + steps + 3)
    };
    let mut e = Engine::new(gpu, w, opts)?;
    let mut rng = SplitMix64(11);
    let ids: Vec<u32> = (0..rows * ctx).map(|_| rng.below(w.cfg.vocab) as u32).collect();
    let greedy = vec![Sampler::GREEDY; rows];
    e.append_sample(&ids, ctx, &vec![ctx; rows], None, &greedy)?;
    let mut step = |e: &mut Engine| {
        let next: Vec<u32> = (0..rows).map(|_| rng.below(w.cfg.vocab) as u32).collect();
        e.profile_step(&next, 1, &vec![1; rows], None, Some(&greedy))
    };
    for _ in 0..2 {
        step(&mut e)?;
    }
    let mut ms = Vec::with_capacity(steps);
    for _ in 0..steps {
        ms.push(1e3 * step(&mut e)?.total());
    }
    ms.sort_by(f64::total_cmp);
    let distinct = match (&w.cfg.moe, moe) {
        (Some(m), true) => {
            // per timed step and MoE layer, the experts the rows' tokens were routed to (a decode
            // step's tokens are its rows, in order)
            let routes: Vec<Vec<u32>> = (0..rows).map(|r| e.routes(r)).collect::<kvdecode::Result<_>>()?;
            let (stride, layers) = (m.layers.len() * m.top_k, m.layers.len());
            let len = e.cache().lens()[0];
            let (mut distinct, mut reads) = (0usize, 0usize);
            for pos in len - steps..len {
                for l in 0..layers {
                    let at = pos * stride + l * m.top_k;
                    let mut pairs = vec![0usize; m.experts];
                    for block in routes.chunks(EXPERT_TOKEN_BLOCK) {
                        let mut in_block = vec![0usize; m.experts];
                        for &ex in block.iter().flat_map(|r| &r[at..at + m.top_k]) {
                            in_block[ex as usize] += 1;
                        }
                        reads += in_block.iter().map(|n| n.div_ceil(4)).sum::<usize>();
                        pairs.iter_mut().zip(&in_block).for_each(|(p, n)| *p += n);
                    }
                    distinct += pairs.iter().filter(|&&n| n > 0).count();
                }
            }
            let per_layer = (steps * layers) as f64;
            Some(ExpertReads { distinct: distinct as f64 / per_layer, reads: reads as f64 / per_layer })
        }
        _ => None,
    };
    Ok((ms[ms.len() / 2], distinct))
}

/// The table: per row count, the MoE step's GPU time, the dense twin's, their ratio, the distinct
/// experts read per layer (of the experts there are) and the weight reads of those experts' rows
/// per layer (rows x top_k pairs, four to a read where they share an expert).
pub fn moe_table(
    gpu: &Gpu,
    model: &ModelWeights,
    dtype: WeightDtype,
    rows_list: &[usize],
    ctx: usize,
    steps: usize,
) -> Result<Vec<serde_json::Value>> {
    let moe = model.cfg.moe.clone().ok_or("the moe table needs a mixture of experts (synthetic:qwen3-moe, ...)")?;
    let dense = dense_twin(model)?;
    println!(
        "\nMixture of experts vs dense of the same active parameters (context {ctx}; GPU ms per decode step by \
         timestamp queries, median of {steps}; dense twin: MLP of {} on every layer; {} experts, top {})",
        dense.cfg.ffn, moe.experts, moe.top_k
    );
    println!(
        "| rows | MoE ms / step | dense ms / step | MoE / dense | distinct experts read per layer | (token, expert) \
         pairs per layer | expert weight reads per layer |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let mut out = Vec::new();
    for &rows in rows_list {
        let (moe_ms, read) = time_steps(gpu, model, dtype, rows, ctx, steps)?;
        let (dense_ms, _) = time_steps(gpu, &dense, dtype, rows, ctx, steps)?;
        let read = read.ok_or("the MoE model kept no routes")?;
        println!(
            "| {rows} | {moe_ms:.2} | {dense_ms:.2} | {:.2} | {:.1} of {} | {} | {:.1} |",
            moe_ms / dense_ms,
            read.distinct,
            moe.experts,
            rows * moe.top_k,
            read.reads
        );
        out.push(json!({
            "rows": rows, "moe_ms": moe_ms, "dense_ms": dense_ms, "ratio": moe_ms / dense_ms,
            "distinct_experts_per_layer": read.distinct, "expert_weight_reads_per_layer": read.reads,
            "experts": moe.experts, "top_k": moe.top_k,
        }));
    }
    Ok(out)
}
