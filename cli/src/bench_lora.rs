//! `kvdecode bench --tables lora`: LoRA adapters on every linear layer (rank `--lora-rank`),
//! in one run: the GPU time of a decode step with rows spread over 4 adapters (held in f32, then
//! in f16) against the base model (an engine without adapter slots) and against an engine with
//! slots whose rows use none;
//! then an adapter update (every A and B by PEFT's names) against `queue.write_buffer` of the
//! same bytes. With `--lora-variants`, also each engine's GPU ms per pipeline variant (where a
//! step's time goes: `lora.wgsl`'s dispatches, each product's epilogue against the base's). With
//! `--lora-sets N`, N sets of the four engines are made one after another and each figure is the
//! median of the sets': two identical engines made side by side can differ by a few percent.

use std::time::Instant;

use kvdecode::{
    Engine, EngineOptions, Gpu, InFlight, LoraAdapter, ModelWeights, Profile, Sampler, SplitMix64, WeightDtype,
};
use serde_json::json;

use crate::bench_weights::median;
use crate::common::Result;

const ADAPTERS: usize = 4;

/// One engine of the table, `rows` rows at context 128, its prompts in: `slots` adapter slots
/// (their A and B as `lora_dtype`); with all of [`ADAPTERS`], rows spread over them in turn, else
/// every row on the base model.
struct Contender {
    engine: Engine,
    rows: usize,
    rng: SplitMix64,
    /// Per timed step: GPU ms of the step, and of its adapters' `A x` dispatches (`lora.wgsl`;
    /// their `B (A x)` is the products' epilogue).
    ms: Vec<(f64, f64)>,
    /// The timed steps' profiles, summed (per pipeline variant: `--lora-variants`).
    sum: Profile,
}

impl Contender {
    fn new(
        gpu: &Gpu,
        model: &ModelWeights,
        dtype: WeightDtype,
        rows: usize,
        slots: &[LoraAdapter],
        lora_dtype: WeightDtype,
        steps: usize,
    ) -> Result<Self> {
        let ctx = 128;
        let rank = slots.iter().flat_map(|a| a.layers.iter().flatten().flatten().map(|m| m.rank)).max().unwrap_or(16);
        let opts = EngineOptions {
            weights: dtype,
            beyond_trained_context: true,
            max_loras: slots.len(),
            max_lora_rank: rank,
            lora_dtype,
            ..EngineOptions::new(rows, ctx + steps + 3)
        };
        let mut engine = Engine::new(gpu, model, opts)?;
        for (i, a) in slots.iter().enumerate() {
            engine.load_lora(&format!("a{i}"), a)?;
        }
        if slots.len() == ADAPTERS {
            for r in 0..rows {
                engine.set_adapter(r, Some(&format!("a{}", r % ADAPTERS)))?;
            }
        }
        let mut rng = SplitMix64(11);
        let vocab = model.cfg.vocab;
        let ids: Vec<u32> = (0..rows * ctx).map(|_| rng.below(vocab) as u32).collect();
        engine.append_sample(&ids, ctx, &vec![ctx; rows], None, &vec![Sampler::GREEDY; rows])?;
        let mut c = Contender { engine, rows, rng, ms: Vec::new(), sum: Profile::default() };
        for _ in 0..2 {
            c.step()?;
        }
        c.ms.clear();
        c.sum = Profile::default();
        Ok(c)
    }

    /// One profiled decode step of every row.
    fn step(&mut self) -> Result<()> {
        let vocab = self.engine.config().vocab;
        let next: Vec<u32> = (0..self.rows).map(|_| self.rng.below(vocab) as u32).collect();
        let greedy = vec![Sampler::GREEDY; self.rows];
        let p = self.engine.profile_step(&next, 1, &vec![1; self.rows], None, Some(&greedy))?;
        let lora: f64 = p.kernels.iter().filter(|k| k.0 == "lora.wgsl").map(|k| k.1).sum();
        self.ms.push((1e3 * p.total(), 1e3 * lora));
        self.sum.add(&p);
        Ok(())
    }

    /// Medians of the step's and its `A x` dispatches' ms.
    fn medians(&self) -> (f64, f64) {
        (median(self.ms.iter().map(|m| m.0).collect()), median(self.ms.iter().map(|m| m.1).collect()))
    }
}

/// What the table measures.
pub struct LoraBench<'a> {
    /// Rows of each line (over 4 adapters).
    pub rows: &'a [usize],
    /// The adapters' rank.
    pub rank: usize,
    /// Timed decode steps of each engine.
    pub steps: usize,
    /// Timed update rounds.
    pub rounds: usize,
    /// Also print each engine's GPU ms per pipeline variant.
    pub variants: bool,
    /// Sets of the four engines, made one after another (at least 1).
    pub sets: usize,
}

/// The table; its figures as JSON.
pub fn lora_table(gpu: &Gpu, model: &ModelWeights, dtype: WeightDtype, b: &LoraBench) -> Result<serde_json::Value> {
    let LoraBench { rows: rows_list, rank, steps, rounds, variants, sets } = *b;
    let random = |seed| LoraAdapter::random(&model.cfg, rank, 0.02, 2.0, seed);
    let adapters: Vec<LoraAdapter> = (0..ADAPTERS as u64).map(|s| random(100 + s)).collect();
    let params: usize = adapters[0].layers.iter().flatten().flatten().map(|m| m.a.len() + m.b.len()).sum();
    println!(
        "\nLoRA on every linear layer, rank {rank} ({params} parameters an adapter; context 128; GPU ms per decode step by \
         timestamp queries, median of {steps}, the four engines stepping in turn; rows spread over {ADAPTERS} adapters{})",
        match sets {
            1 => String::new(),
            n => format!("; {n} sets of engines made one after another, each figure the median of the sets'"),
        }
    );
    println!(
        "| rows | base ms / step | slots, no adapter ms | {ADAPTERS} adapters ms | of it lora.wgsl ms | adapters / base \
         | {ADAPTERS} adapters in f16 ms | of it lora.wgsl ms | f16 adapters / base | adapters / base, each set |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut steps_out = Vec::new();
    let mut variant_tables = Vec::new();
    let f32 = WeightDtype::F32;
    for &rows in rows_list {
        // per set: base, idle, with, with_lora, half, half_lora, and the two ratios
        let mut figures: Vec<[f64; 8]> = Vec::new();
        let mut variant_sets = Vec::new();
        for _ in 0..sets {
            // the base model; one slot, unused (what having slots costs: each A x dispatch finds
            // no adapter, each product's epilogue reads a head saying so); rows over 4 adapters
            // in f32, then in f16. They take their steps in turn, so a slow spell of a shared
            // machine falls on all four alike; a set is dropped before the next is made.
            let mut engines = [
                Contender::new(gpu, model, dtype, rows, &[], f32, steps)?,
                Contender::new(gpu, model, dtype, rows, &adapters[..1], f32, steps)?,
                Contender::new(gpu, model, dtype, rows, &adapters, f32, steps)?,
                Contender::new(gpu, model, dtype, rows, &adapters, WeightDtype::F16, steps)?,
            ];
            for _ in 0..steps {
                for c in &mut engines {
                    c.step()?;
                }
            }
            let [(base, _), (idle, _), (with, with_lora), (half, half_lora)] =
                engines.each_ref().map(Contender::medians);
            figures.push([base, idle, with, with_lora, half, half_lora, with / base, half / base]);
            if variants {
                variant_sets.push(variant_ms(&engines));
            }
        }
        let m: Vec<f64> = (0..8).map(|i| median(figures.iter().map(|f| f[i]).collect())).collect();
        let each: Vec<f64> = figures.iter().map(|f| f[6]).collect();
        println!(
            "| {rows} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            m[0],
            m[1],
            m[2],
            m[3],
            m[6],
            m[4],
            m[5],
            m[7],
            each.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ")
        );
        steps_out.push(json!({"rows": rows, "base_ms": m[0], "slots_idle_ms": m[1], "adapters_ms": m[2],
            "adapters_lora_ms": m[3], "ratio": m[6], "adapters_f16_ms": m[4],
            "adapters_f16_lora_ms": m[5], "ratio_f16": m[7], "ratio_each_set": each}));
        if variants {
            variant_tables.push((rows, mean_variants(variant_sets)));
        }
    }
    for (rows, table) in &variant_tables {
        println!(
            "\n| pipeline variant, {rows} rows (GPU ms a step, mean of {steps}{}) | base | slots, no adapter | \
             {ADAPTERS} adapters | in f16 |",
            if sets > 1 { format!(", then of the {sets} sets") } else { String::new() }
        );
        println!("|---|---:|---:|---:|---:|");
        for (label, ms) in table {
            println!("| {label} | {:.2} | {:.2} | {:.2} | {:.2} |", ms[0], ms[1], ms[2], ms[3]);
        }
    }
    // an update of every tensor against the floor: write_buffer of the same bytes
    let pushed = random(7);
    let host = pushed.peft_tensors();
    let bytes: usize = host.iter().map(|t| t.bytes.len()).sum();
    let mut e = Engine::new(
        gpu,
        model,
        EngineOptions { weights: dtype, max_loras: 1, max_lora_rank: rank, ..EngineOptions::new(1, 64) },
    )?;
    e.load_lora("a", &adapters[0])?;
    let scratch = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("bench: LoRA write_buffer floor"),
        size: (bytes as u64).next_multiple_of(4),
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let wait = || gpu.device.poll(wgpu::PollType::wait_indefinitely()).map(|_| ()).map_err(|e| format!("{e}"));
    let (mut update, mut floor) = (Vec::new(), Vec::new());
    for round in 0..=rounds {
        let t = Instant::now();
        e.update_lora("a", &host, InFlight::Keep)?;
        wait()?;
        let u = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let mut at = 0;
        for t in &host {
            gpu.queue.write_buffer(&scratch, at, t.bytes);
            at += t.bytes.len() as u64;
        }
        gpu.queue.submit([]);
        wait()?;
        if round > 0 {
            update.push(u);
            floor.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let (u, f) = (median(update), median(floor));
    println!(
        "\n| adapter update ({} tensors, {:.1} MB, f32; {rounds} rounds) | median ms | x floor |",
        host.len(),
        bytes as f64 / 1e6
    );
    println!("|---|---:|---:|");
    println!("| update_lora | {u:.2} | {:.2}x |", u / f);
    println!("| queue.write_buffer of the same bytes (floor) | {f:.2} | 1.00x |");
    let variants_json: Vec<_> = variant_tables
        .iter()
        .map(|(rows, t)| json!({"rows": rows, "variants": t.iter().map(|(l, ms)| json!({"label": l, "ms": ms})).collect::<Vec<_>>()}))
        .collect();
    Ok(json!({"rank": rank, "steps": steps_out, "update_ms": u, "floor_ms": f, "update_ratio": u / f, "bytes": bytes,
        "variants": variants_json}))
}

/// The sets' variant tables merged: each variant's mean ms over the sets (0 in a set that did
/// not run it).
fn mean_variants(sets: Vec<Vec<(String, [f64; 4])>>) -> Vec<(String, [f64; 4])> {
    let n = sets.len().max(1) as f64;
    let mut out: Vec<(String, [f64; 4])> = Vec::new();
    for (label, ms) in sets.into_iter().flatten() {
        let at = match out.iter().position(|(l, _)| *l == label) {
            Some(at) => at,
            None => {
                out.push((label, [0.0; 4]));
                out.len() - 1
            }
        };
        for (sum, v) in out[at].1.iter_mut().zip(ms) {
            *sum += v / n;
        }
    }
    out
}

/// Each pipeline variant any of the engines ran (in the order they first ran), with every
/// engine's mean GPU ms a timed step in it (0 where it ran none).
fn variant_ms(engines: &[Contender; 4]) -> Vec<(String, [f64; 4])> {
    let mut out: Vec<(String, [f64; 4])> = Vec::new();
    for (i, c) in engines.iter().enumerate() {
        let steps = c.ms.len().max(1) as f64;
        for (label, seconds, _) in &c.sum.variants {
            let at = match out.iter().position(|(l, _)| l == label) {
                Some(at) => at,
                None => {
                    out.push((label.clone(), [0.0; 4]));
                    out.len() - 1
                }
            };
            out[at].1[i] = 1e3 * seconds / steps;
        }
    }
    out
}
