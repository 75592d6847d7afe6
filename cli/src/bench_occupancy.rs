//! `kvdecode bench --tables occupancy`: every dispatch of one decode step with the workgroups it
//! launches, its threads, the longest serial loop any thread runs and the bytes it moves, from
//! the engine's grids and the kernels' constants; nothing runs. By default on a dry-run GPU (wgpu's
//! noop backend posing as a discrete GPU with 32-lane subgroups, so the kernels are the ones an
//! NVIDIA card gets), or on the bench's own adapter.

use kvdecode::{Engine, EngineOptions, Gpu, LogprobMode, OccupancyTable, Sampler};
use serde_json::json;

use crate::common::{load_model, Result};

/// What the table covers (the bench's `--occupancy-*` flags).
pub struct Shapes<'a> {
    pub models: &'a [String],
    pub rows: &'a [usize],
    pub ctx: &'a [usize],
    /// Workgroups that fill the GPU (its SMs or CUs): below it, a long loop walks alone.
    pub sms: u64,
    /// Serial iterations a thread may run in a dispatch below `sms` workgroups.
    pub max_alone: usize,
    /// Engines with 4 LoRA slots of this rank (0: none).
    pub lora_rank: usize,
}

/// The two samplers of the table: greedy, and a draw with top-p and the 5 most likely tokens
/// (also the profile table's `--sampler`).
pub(crate) fn samplers() -> [(&'static str, Sampler); 2] {
    let top_p = Sampler::temperature(0.8, 1).with_top_p(0.9).with_top_logprobs(5).with_logprobs(LogprobMode::Processed);
    [("greedy", Sampler::GREEDY), ("top-p + 5 logprobs", top_p)]
}

/// The table for each model, rows, context and sampler, each on an engine of just that many rows
/// and that context (as a user would build it: its cache shards and attention partitions follow
/// them): the whole table of the first rows and context with top-p (a layer's dispatches once,
/// with how many times they repeat), then a summary line for every configuration. Returns the JSON entries: `occupancy` (a row per
/// dispatch, tagged with its configuration), `dispatches_per_layer` per model, and the summaries.
pub fn occupancy_table(gpu: &Gpu, s: &Shapes) -> Result<serde_json::Map<String, serde_json::Value>> {
    if s.rows.is_empty() || s.ctx.is_empty() {
        return Err("--occupancy-rows and --occupancy-ctx need one value or more".into());
    }
    let (mut rows_json, mut per_layer, mut summaries) = (Vec::new(), serde_json::Map::new(), Vec::new());
    println!(
        "\nOccupancy of one decode step on {} (computed from the grids and the kernels' constants; nothing runs)",
        gpu.describe()
    );
    for name in s.models {
        let (model, _) = load_model(name)?;
        let engine = |rows: usize, ctx: usize| {
            let opts = EngineOptions {
                beyond_trained_context: true,
                max_loras: if s.lora_rank > 0 { 4 } else { 0 },
                max_lora_rank: s.lora_rank.max(1),
                ..EngineOptions::new(rows, ctx)
            };
            Engine::new(gpu, &model, opts)
        };
        let first = engine(s.rows[0], s.ctx[0])?;
        println!(
            "\n{name}{}: matmul {}, attention {}, fused: {}, sampling: {}",
            if s.lora_rank > 0 { format!(" with 4 LoRA slots of rank {}", s.lora_rank) } else { String::new() },
            first.matmul_kernel().name(),
            first.attention_kernel().name(),
            first.fusion().name(),
            if first.split_sampling() { "split" } else { "whole" }
        );
        let table = first.occupancy(s.rows[0], s.ctx[0], Some(&samplers()[1].1))?;
        drop(first);
        print_dispatches(&table, s.rows[0], s.ctx[0], s.sms);
        per_layer.insert(name.clone(), table.dispatches_per_layer.into());
        println!("\n| rows | context | sampler | fewest workgroups | longest serial loop | below {} workgroups | walk alone (< {} workgroups, > {} iterations) | after a barrier |", s.sms, s.sms, s.max_alone);
        println!("|---:|---:|---|---|---|---:|---|---:|");
        for &rows in s.rows {
            for &ctx in s.ctx {
                let engine = engine(rows, ctx)?;
                for (sampler_name, sampler) in samplers() {
                    let t = engine.occupancy(rows, ctx, Some(&sampler))?;
                    let few = t.fewest_workgroups().ok_or("no dispatches")?;
                    let long = t.longest_loop().ok_or("no dispatches")?;
                    let alone: Vec<&str> = dedup(t.walking_alone(s.sms, s.max_alone).iter().map(|d| d.label.as_str()));
                    println!(
                        "| {rows} | {ctx} | {sampler_name} | {} ({}) | {} ({}) | {} of {} | {} | {} |",
                        few.label,
                        few.workgroups,
                        long.label,
                        long.serial_iters,
                        t.below(s.sms),
                        t.dispatches.len(),
                        if alone.is_empty() { "none".to_string() } else { alone.join(", ") },
                        t.barriers()
                    );
                    let tag = json!({ "model": name, "rows": rows, "context": ctx, "sampler": sampler_name });
                    for (i, d) in t.dispatches.iter().enumerate() {
                        let mut row = tag.clone();
                        let fields = json!({
                            "index": i, "label": d.label, "workgroups": d.workgroups, "threads": d.threads,
                            "serial_iters": d.serial_iters, "bytes": d.bytes,
                        });
                        row.as_object_mut().expect("an object").extend(fields.as_object().expect("an object").clone());
                        rows_json.push(row);
                    }
                    let mut summary = tag.clone();
                    summary.as_object_mut().expect("an object").extend(
                        json!({
                            "dispatches": t.dispatches.len(),
                            "dispatches_per_layer": t.dispatches_per_layer,
                            "barriers": t.barriers(),
                            "fewest_workgroups": { "label": few.label, "workgroups": few.workgroups },
                            "longest_loop": { "label": long.label, "serial_iters": long.serial_iters },
                            "below_sms": t.below(s.sms),
                            "walking_alone": alone,
                        })
                        .as_object()
                        .expect("an object")
                        .clone(),
                    );
                    summaries.push(summary);
                }
            }
        }
    }
    let mut out = serde_json::Map::new();
    out.insert("occupancy".into(), rows_json.into());
    out.insert("dispatches_per_layer".into(), per_layer.into());
    out.insert("occupancy_summary".into(), summaries.into());
    out.insert("occupancy_sms".into(), s.sms.into());
    Ok(out)
}

/// Labels in first-seen order, each once.
fn dedup<'a>(labels: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for l in labels {
        if !out.contains(&l) {
            out.push(l);
        }
    }
    out
}

/// The step's dispatches in recording order, a run of layers that repeat the same dispatches
/// printed once with its count.
fn print_dispatches(t: &OccupancyTable, rows: usize, ctx: usize, sms: u64) {
    println!(
        "\n{rows} row(s), context {ctx}, top-p + 5 logprobs: {} dispatches, {:.2} per layer, {} after a barrier (* below \
         {sms} workgroups)",
        t.dispatches.len(),
        t.dispatches_per_layer,
        t.barriers()
    );
    println!("| dispatch | times | workgroups | threads | serial iterations | KiB |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut seen: Vec<(&kvdecode::Occupancy, usize)> = Vec::new();
    for d in &t.dispatches {
        match seen.iter_mut().find(|(s, _)| *s == d) {
            Some((_, n)) => *n += 1,
            None => seen.push((d, 1)),
        }
    }
    for (d, n) in seen {
        let mark = if d.workgroups < sms { " *" } else { "" };
        println!(
            "| {}{mark} | {n} | {} | {} | {} | {:.1} |",
            d.label,
            d.workgroups,
            d.threads,
            d.serial_iters,
            d.bytes as f64 / 1024.0
        );
    }
}
