//! Soak: many decode steps over many rows with random resets, forks, rollbacks, tool results and
//! sub-batches, checked against the CPU reference at checkpoints, with host memory (RSS) and GPU
//! memory (wgpu's allocator report, and kvdecode's own buffer count) at the start and the end.
//!
//! `cargo run --release --example soak [-- --steps 100000 --rows 8 --seed 1 --check-every 500 --kv f32 --json]`
//!
//! `tests/soak.rs` runs a short version of the same loop in CI.

use std::time::Instant;

use kvdecode::model::config::EngramConfig;
use kvdecode::{
    model::reference, Engine, EngineOptions, Gpu, KvDtype, ModelConfig, ModelWeights, Sampler, SplitMix64, TurnLimit,
};

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct SoakOptions {
    /// Decode steps in all (one step = one token on every row of the decoding sub-batch).
    pub steps: usize,
    /// Cache rows.
    pub rows: usize,
    /// Seed of the schedule and the model.
    pub seed: u64,
    /// Reference checkpoint every this many steps.
    pub check_every: usize,
    /// K/V storage.
    pub kv: KvDtype,
}

/// What the run saw.
#[derive(Clone, Debug, Default)]
pub struct SoakReport {
    /// Decode steps run.
    pub steps: usize,
    /// Operations by kind: decoded turns, tool results, prompts (after a reset), forks, rollbacks.
    pub turns: usize,
    pub tool_results: usize,
    pub prompts: usize,
    pub forks: usize,
    pub rollbacks: usize,
    /// Reference checkpoints passed, and the largest |engine - reference| seen at them.
    pub checks: usize,
    pub worst_diff: f32,
    /// Host RSS and GPU memory after warm-up and at the end, in bytes.
    pub rss_start: u64,
    pub rss_end: u64,
    pub gpu_allocated_start: Option<u64>,
    pub gpu_allocated_end: Option<u64>,
    pub engine_bytes: u64,
    pub engine_bytes_end: u64,
    /// Wall time.
    pub seconds: f64,
}

/// Resident set size of this process (Linux), 0 where unknown.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

/// A small TinyAgent-layout model with Engram (fast steps, every cache feature in play).
pub fn soak_model(seed: u64) -> ModelWeights {
    let mut cfg = ModelConfig::tiny_agent(96, 32, 4, 2, 8, 64, 4, 2, 5);
    cfg.engram = Some(EngramConfig { layers: vec![1, 3], orders: vec![2, 3], heads: 2, table_rows: 64, dim: 8 });
    ModelWeights::random(&cfg, seed).expect("valid soak model")
}

/// Run the soak; panics (naming the seed, step and row) if a checkpoint differs from the
/// reference, since a soak that goes wrong should stop where it went wrong.
pub fn soak(gpu: &Gpu, o: SoakOptions, progress: &mut dyn FnMut(&SoakReport)) -> kvdecode::Result<SoakReport> {
    let w = soak_model(o.seed);
    let (vocab, max_len) = (w.cfg.vocab, 160);
    let mut e = Engine::new(gpu, &w, EngineOptions { kv: o.kv, rollback: 7, ..EngineOptions::new(o.rows, max_len) })?;
    let tol = if o.kv == KvDtype::F32 { 1e-4 } else { 2e-3 };
    let mut rng = SplitMix64(o.seed);
    let mut rep = SoakReport::default();
    let mut next_check = o.check_every;
    let mut next_progress = o.steps / 10;
    let warmup = (o.steps / 50).max(1);
    let t0 = Instant::now();
    let tokens =
        |rng: &mut SplitMix64, n: usize| -> Vec<u32> { (0..n).map(|_| 1 + rng.below(vocab - 1) as u32).collect() };
    let subset = |rng: &mut SplitMix64, from: &[usize]| -> Vec<usize> {
        let mut v: Vec<usize> = from.iter().copied().filter(|_| rng.below(3) > 0).collect();
        if v.is_empty() && !from.is_empty() {
            v.push(from[rng.below(from.len())]);
        }
        v
    };
    while rep.steps < o.steps {
        // rows close to capacity (or empty) start over with a new prompt, prefilled in one append
        let full: Vec<usize> =
            (0..o.rows).filter(|&r| e.cache().lens()[r] + 40 > max_len || e.cache().lens()[r] == 0).collect();
        if !full.is_empty() {
            e.reset(&full)?;
            let prompts: Vec<Vec<u32>> = full
                .iter()
                .map(|_| {
                    let n = 3 + rng.below(18);
                    tokens(&mut rng, n)
                })
                .collect();
            let width = prompts.iter().map(Vec::len).max().unwrap_or(1);
            let mut ids = vec![0u32; full.len() * width];
            for (i, p) in prompts.iter().enumerate() {
                ids[i * width..i * width + p.len()].copy_from_slice(p);
            }
            let n: Vec<usize> = prompts.iter().map(Vec::len).collect();
            e.feed(&ids, width, &n, Some(&full))?;
            rep.prompts += full.len();
        }
        let all: Vec<usize> = (0..o.rows).collect();
        match rng.below(10) {
            // a decoded turn on a sub-batch: multi-step windows, per-row stops and lengths
            0..=4 => {
                let rows = subset(&mut rng, &all);
                let first: Vec<u32> = rows.iter().map(|_| 1 + rng.below(vocab - 1) as u32).collect();
                let samplers: Vec<Sampler> = rows
                    .iter()
                    .map(|&r| Sampler::temperature(0.9, (o.seed as u32) ^ (r as u32 * 7919)).with_top_k(20))
                    .collect();
                let limits: Vec<TurnLimit> = rows
                    .iter()
                    .map(|_| TurnLimit { max_new: 1 + rng.below(12), stop: vec![rng.below(vocab) as u32] })
                    .collect();
                let window = 1 + rng.below(e.max_window());
                let turns = e.decode_turns(&rows, &first, &samplers, &limits, window, &|_, _| false)?;
                rep.steps += turns.iter().map(|t| t.tokens.len()).max().unwrap_or(0);
                rep.turns += rows.len();
            }
            // tool results: a ragged chunk on a sub-batch, nothing read back
            5 | 6 => {
                let rows = subset(&mut rng, &all);
                let n: Vec<usize> = rows.iter().map(|_| rng.below(13)).collect();
                let width = n.iter().copied().max().unwrap_or(0).max(1);
                let ids = tokens(&mut rng, rows.len() * width);
                e.feed(&ids, width, &n, Some(&rows))?;
                rep.tool_results += rows.iter().zip(&n).filter(|(_, &k)| k > 0).count();
            }
            // a fork (GRPO-style: one row continues in another)
            7 => {
                let (src, dst) = (rng.below(o.rows), rng.below(o.rows));
                if src != dst {
                    e.fork(src, &[dst])?;
                    rep.forks += 1;
                }
            }
            // a rollback as deep as the ring's spare slots allow
            8 => {
                let row = rng.below(o.rows);
                let k = rng.below(e.cache().max_rollback(row) + 1);
                e.rollback(&[row], &[k])?;
                rep.rollbacks += 1;
            }
            // a reset of a random row
            _ => {
                e.reset(&[rng.below(o.rows)])?;
            }
        }
        if rep.steps >= warmup && rep.rss_start == 0 {
            rep.rss_start = rss_bytes();
            rep.gpu_allocated_start = gpu.device.generate_allocator_report().map(|r| r.total_allocated_bytes);
            rep.engine_bytes = gpu.memory_in_use();
        }
        if rep.steps >= next_check {
            next_check += o.check_every;
            // two rows: one more token each, logits against full recomputation of the history
            let rows: Vec<usize> =
                (0..2).map(|_| rng.below(o.rows)).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
            let ids = tokens(&mut rng, rows.len());
            let out = e.append(&ids, 1, &vec![1; rows.len()], Some(&rows))?;
            for (i, &r) in rows.iter().enumerate() {
                let hist = e.cache().history(r);
                let want = reference::forward(&w, hist)?;
                let want = &want[(hist.len() - 1) * vocab..];
                let d =
                    out.row(i).expect("one token").iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(d <= tol, "seed {} step {} row {r}: |engine - reference| = {d}", o.seed, rep.steps);
                rep.worst_diff = rep.worst_diff.max(d);
                rep.checks += 1;
            }
        }
        if rep.steps >= next_progress {
            next_progress += (o.steps / 10).max(1);
            rep.seconds = t0.elapsed().as_secs_f64();
            progress(&rep);
        }
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    rep.rss_end = rss_bytes();
    rep.gpu_allocated_end = gpu.device.generate_allocator_report().map(|r| r.total_allocated_bytes);
    rep.engine_bytes_end = gpu.memory_in_use();
    Ok(rep)
}

/// Every argument is a known flag (and its value): a misspelt flag is an error, not ignored.
pub fn check_flags(args: &[String]) -> Result<(), String> {
    let known = ["--steps", "--rows", "--seed", "--check-every", "--kv"];
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        match a.as_str() {
            "--json" => {}
            f if known.contains(&f) && rest.next().is_some() => {}
            f => {
                return Err(format!(
                    "unknown argument or missing value: {f:?} (flags: {} VALUE, --json)",
                    known.join(" VALUE, ")
                ))
            }
        }
    }
    Ok(())
}

#[allow(dead_code)]
fn main() -> kvdecode::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Err(e) = check_flags(&args[1..]) {
        eprintln!("{e}");
        std::process::exit(2);
    }
    let arg = |name: &str, default: &str| -> String {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.into())
    };
    let num = |name: &str, default: &str| -> usize {
        arg(name, default).parse().unwrap_or_else(|_| panic!("{name}: not a number"))
    };
    let o = SoakOptions {
        steps: num("--steps", "100000"),
        rows: num("--rows", "8"),
        seed: num("--seed", "1") as u64,
        check_every: num("--check-every", "500"),
        kv: KvDtype::parse(&arg("--kv", "f32"))?,
    };
    let gpu = Gpu::new()?;
    println!("adapter: {}; {o:?}", gpu.describe());
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let rep = soak(&gpu, o, &mut |r| {
        println!(
            "{:>7} steps  {:>7.1} s  {:>5} checks (worst {:.1e})  RSS {:.1} MiB  GPU {:.1} MiB",
            r.steps,
            r.seconds,
            r.checks,
            r.worst_diff,
            mib(rss_bytes()),
            mib(gpu.device.generate_allocator_report().map_or(0, |a| a.total_allocated_bytes))
        )
    })?;
    println!("\n| | start (after warm-up) | end |");
    println!("| --- | --- | --- |");
    println!("| host RSS | {:.1} MiB | {:.1} MiB |", mib(rep.rss_start), mib(rep.rss_end));
    let gpu_mib = |b: Option<u64>| b.map_or("n/a".to_string(), |b| format!("{:.1} MiB", mib(b)));
    println!(
        "| GPU allocated (wgpu report) | {} | {} |",
        gpu_mib(rep.gpu_allocated_start),
        gpu_mib(rep.gpu_allocated_end)
    );
    println!("| engine buffers (kvdecode) | {:.1} MiB | {:.1} MiB |", mib(rep.engine_bytes), mib(rep.engine_bytes_end));
    println!(
        "\n{} decode steps in {:.0} s ({:.0} steps/s): {} turns, {} tool results, {} prompts, {} forks, {} rollbacks; \
         {} reference checks passed, worst |engine - reference| {:.1e}",
        rep.steps,
        rep.seconds,
        rep.steps as f64 / rep.seconds,
        rep.turns,
        rep.tool_results,
        rep.prompts,
        rep.forks,
        rep.rollbacks,
        rep.checks,
        rep.worst_diff
    );
    if args.iter().any(|a| a == "--json") {
        println!(
            "{}",
            serde_json::json!({
                "steps": rep.steps, "seconds": rep.seconds, "turns": rep.turns, "tool_results": rep.tool_results,
                "prompts": rep.prompts, "forks": rep.forks, "rollbacks": rep.rollbacks, "checks": rep.checks,
                "worst_diff": rep.worst_diff, "rss_start": rep.rss_start, "rss_end": rep.rss_end,
                "gpu_allocated_start": rep.gpu_allocated_start, "gpu_allocated_end": rep.gpu_allocated_end,
                "engine_bytes": rep.engine_bytes, "engine_bytes_end": rep.engine_bytes_end,
            })
        );
    }
    Ok(())
}
