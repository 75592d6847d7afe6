//! `kvdecode rollout`: batched multi-turn rollouts, the main job. Rows hold episodes in GRPO-style
//! groups: one prompt is prefilled once and forked into the group's rows (copied on the GPU, not
//! recomputed), each row samples its own answers. An episode alternates decoded turns (each with
//! its own stop token and length limit) and tool results appended mid-episode; episodes end after
//! different numbers of turns, and a group's rows take the next prompt once all of them are done.
//! The model is the embedded demo model (no download).
//!
//! The forks share the prompt's global K/V blocks (copy-on-write): the run reports the peak of
//! blocks in use against what per-row copies would hold, and `--json` ends the output with one
//! JSON object of those figures for scripts.

use std::time::Instant;

use kvdecode::{Engine, EngineOptions, Gpu, KvDtype, ModelWeights, Rollouts, Sampler, SplitMix64, TurnLimit};

use crate::common::Result;

const END_OF_TURN: u32 = 0; // stop token of every turn
const MAX_TURN: usize = 24; // decoded tokens per turn at most
const MAX_TOOL: usize = 32; // tokens per tool result at most

#[derive(clap::Args)]
pub struct Args {
    /// Cache rows.
    #[arg(long, default_value_t = 16)]
    rows: usize,
    /// Rows per GRPO group (one prompt forked into them).
    #[arg(long, default_value_t = 4)]
    group: usize,
    /// Episodes to finish.
    #[arg(long, default_value_t = 48)]
    episodes: usize,
    /// Seed of prompts, turn counts and sampling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Decode steps per readback.
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// K/V storage: f32, f16 or bf16.
    #[arg(long, default_value = "f32", value_parser = |s: &str| KvDtype::parse(s).map_err(|e| e.to_string()))]
    kv: KvDtype,
    /// Prompt length in tokens (default: random, 16 to 64 per prompt).
    #[arg(long)]
    prompt_len: Option<usize>,
    /// Positions per block of the global K/V pool.
    #[arg(long, default_value_t = 16)]
    block_len: usize,
    /// End with one JSON object of the figures (memory at the peak, throughput).
    #[arg(long)]
    json: bool,
}

/// Global K/V in use at its peak (sampled after every engine call), against per-row copies.
#[derive(Default)]
struct Peak {
    /// Blocks held at the peak (a block forks share counts once).
    blocks: usize,
    /// Tokens beyond each row's prompt, summed over the rows, at that moment.
    tokens_beyond_prompt: usize,
    /// Prompt tokens of the groups alive at that moment (one prompt per group).
    prompt_tokens: usize,
    /// The most blocks per-row copies would have held (every reference its own block).
    unshared_blocks: usize,
}

pub fn run(a: Args) -> Result<()> {
    let (rows, group, episodes, seed, window, kv) = (a.rows, a.group, a.episodes, a.seed, a.window, a.kv);
    if group == 0 || !rows.is_multiple_of(group) {
        return Err(format!("--rows {rows} must be a multiple of --group {group}").into());
    }
    let gpu = Gpu::new()?;
    let model = ModelWeights::demo();
    let vocab = model.cfg.vocab;
    let max_turns = 4;
    let max_len = a.prompt_len.unwrap_or(64) + max_turns * (MAX_TURN + MAX_TOOL);
    let opts = EngineOptions {
        kv,
        rollback: window.max(1) - 1,
        block_len: a.block_len,
        beyond_trained_context: true,
        ..EngineOptions::new(rows, max_len)
    };
    let mut engine = Engine::new(&gpu, &model, opts)?;
    let mut eps = Rollouts::new(&engine);
    println!("adapter: {}", gpu.describe());
    println!(
        "model: demo TinyAgent layout ({} layers, d_model {}, window {}); {rows} rows in groups of {group}, max_len {max_len}, kv {kv:?}, {window} steps per readback",
        model.cfg.n_layers(),
        model.cfg.d_model,
        model.cfg.window
    );

    let mut rng = SplitMix64(seed);
    let tokens = |rng: &mut SplitMix64, lo: usize, hi: usize| -> Vec<u32> {
        (0..lo + rng.below(hi - lo + 1)).map(|_| 1 + rng.below(vocab - 1) as u32).collect()
    };
    // per row: turns this episode will take (0 = no episode)
    let mut target = vec![0usize; rows];
    // per row: the length of its episode's prompt
    let mut prompt_of = vec![0usize; rows];
    let mut peak = Peak::default();
    let sample_peak = |engine: &Engine, prompt_of: &[usize], target: &[usize], peak: &mut Peak| {
        let u = engine.cache().block_usage();
        if u.used > peak.blocks {
            let live = |r: &usize| target[*r] > 0;
            let lens = engine.cache().lens();
            peak.blocks = u.used;
            peak.tokens_beyond_prompt = (0..rows).filter(live).map(|r| lens[r] - prompt_of[r]).sum();
            // a group's prompt is held while any of its rows runs (the leader may have finished)
            let group_live = |&l: &usize| (l..l + group).any(|r| live(&r));
            peak.prompt_tokens = (0..rows).step_by(group).filter(group_live).map(|l| prompt_of[l]).sum();
        }
        peak.unshared_blocks = peak.unshared_blocks.max(u.referenced);
    };
    let mut busy_blocks = vec![false; rows / group];
    let (mut started, mut finished, mut round) = (0usize, 0usize, 0usize);
    let (mut decoded, mut appended) = (0usize, 0usize);
    let t0 = Instant::now();
    while finished < episodes {
        round += 1;
        // 1. free blocks take the next prompt: prefill the leaders in one append, then fork
        let mut leaders = Vec::new();
        let mut prompts = Vec::new();
        for (b, busy) in busy_blocks.iter_mut().enumerate() {
            if !*busy && started < episodes {
                *busy = true;
                leaders.push(b * group);
                prompts.push(match a.prompt_len {
                    Some(n) => tokens(&mut rng, n, n),
                    None => tokens(&mut rng, 16, 64),
                });
                started += group.min(episodes - started);
            }
        }
        if !leaders.is_empty() {
            let samplers: Vec<Sampler> = leaders
                .iter()
                .map(|&r| Sampler::temperature(0.9, (seed * 7919) as u32 + (round * rows + r) as u32))
                .collect();
            eps.start(&mut engine, &leaders, &prompts, &samplers, None)?;
            appended += prompts.iter().map(Vec::len).sum::<usize>();
            for &l in &leaders {
                let dst: Vec<usize> = (l + 1..l + group).collect();
                let s: Vec<Sampler> = dst
                    .iter()
                    .map(|&r| Sampler::temperature(0.9, (seed * 7919) as u32 + (round * rows + r) as u32))
                    .collect();
                eps.fork(&mut engine, l, &dst, &s)?;
                for t in &mut target[l..l + group] {
                    *t = 2 + rng.below(max_turns - 1);
                }
                prompt_of[l..l + group].fill(engine.cache().lens()[l]);
            }
            sample_peak(&engine, &prompt_of, &target, &mut peak);
        }
        // 2. every live episode decodes its next turn, all rows in one batch
        let live: Vec<usize> = (0..rows).filter(|&r| target[r] > 0 && eps.episode(r).is_some()).collect();
        if live.is_empty() {
            continue;
        }
        let limits = vec![TurnLimit { max_new: MAX_TURN, stop: vec![END_OF_TURN] }; live.len()];
        let turns = eps.decode_turn(&mut engine, &live, &limits, window)?;
        sample_peak(&engine, &prompt_of, &target, &mut peak);
        let round_tokens: usize = turns.iter().map(|t| t.tokens.len()).sum();
        decoded += round_tokens;
        // 3. finished episodes leave; the others get a tool result
        let (mut tool_rows, mut tool_chunks) = (Vec::new(), Vec::new());
        let mut ended = 0;
        for &r in &live {
            let ep = eps.episode(r).expect("live");
            if ep.turns.len() >= target[r] {
                let cached = engine.cache().lens()[r];
                let ep = eps.finish(&mut engine, r)?.expect("live");
                target[r] = 0;
                ended += 1;
                let lp: f32 = ep.turns.iter().flat_map(|t| &t.logprobs).sum();
                let n: usize = ep.turns.iter().map(|t| t.tokens.len()).sum();
                say(
                    a.json,
                    &format!(
                        "  row {r:2}: episode done, {} turns, {n} tokens, sum logprob {lp:.1}, {} cached",
                        ep.turns.len(),
                        cached
                    ),
                );
            } else {
                tool_rows.push(r);
                tool_chunks.push(tokens(&mut rng, 4, MAX_TOOL));
            }
        }
        if !tool_rows.is_empty() {
            appended += tool_chunks.iter().map(Vec::len).sum::<usize>();
            eps.tool_result(&mut engine, &tool_rows, &tool_chunks)?;
            sample_peak(&engine, &prompt_of, &target, &mut peak);
        }
        finished += ended;
        for (b, busy) in busy_blocks.iter_mut().enumerate() {
            if *busy && (b * group..(b + 1) * group).all(|r| target[r] == 0) {
                *busy = false;
            }
        }
        say(
            a.json,
            &format!(
            "round {round:3}: {} turns decoded ({round_tokens} tokens), {} tool results, {ended} episodes done; {finished}/{episodes} done, {:.1} tokens/s so far",
            live.len(),
            tool_rows.len(),
            (decoded + appended) as f64 / t0.elapsed().as_secs_f64()
            ),
        );
    }
    let secs = t0.elapsed().as_secs_f64();
    let c = engine.cache();
    let st = engine.stats();
    println!("---");
    println!("{episodes} episodes in {round} rounds: {decoded} tokens decoded, {appended} prompt/tool tokens appended in {secs:.2} s");
    println!(
        "throughput: {:.1} decoded tokens/s, {:.1} total tokens/s; {} submits, {} dispatches",
        decoded as f64 / secs,
        (decoded + appended) as f64 / secs,
        st.submits,
        st.dispatches
    );
    println!(
        "KV cache: {:.2} MiB vs {:.2} MiB for a naive cache (every layer its own full-length K/V): {:.1}x smaller",
        c.nbytes() as f64 / 1048576.0,
        c.naive_nbytes() as f64 / 1048576.0,
        c.naive_nbytes() as f64 / c.nbytes() as f64
    );
    let per_position = c.global_bytes_per_position();
    let block_bytes = per_position * c.block_len() as u64;
    let bound = peak.prompt_tokens + peak.tokens_beyond_prompt + rows * c.block_len();
    println!(
        "global K/V at its peak: {} blocks of {} positions ({:.2} MiB); per-row copies would hold {} ({:.2} MiB): {:.1}x",
        peak.blocks,
        c.block_len(),
        (peak.blocks as u64 * block_bytes) as f64 / 1048576.0,
        peak.unshared_blocks,
        (peak.unshared_blocks as u64 * block_bytes) as f64 / 1048576.0,
        peak.unshared_blocks as f64 / peak.blocks.max(1) as f64
    );
    println!(
        "  at the peak: {} prompt tokens (one prompt per group) + {} tokens beyond the prompts + {rows} rows x {} = {bound} positions at most; {} held",
        peak.prompt_tokens,
        peak.tokens_beyond_prompt,
        c.block_len(),
        peak.blocks * c.block_len()
    );
    if a.json {
        let v = serde_json::json!({
            "rows": rows,
            "group": group,
            "episodes": episodes,
            "prompt_len": a.prompt_len,
            "block_size": c.block_len(),
            "global_kv_bytes_per_position": per_position,
            "peak_blocks": peak.blocks,
            "peak_global_kv_bytes": peak.blocks as u64 * block_bytes,
            "peak_tokens_beyond_prompt": peak.tokens_beyond_prompt,
            "peak_prompt_tokens": peak.prompt_tokens,
            "unshared_peak_global_kv_bytes": peak.unshared_blocks as u64 * block_bytes,
            "kv_cache_bytes": c.nbytes(),
            "decoded_tokens": decoded,
            "appended_tokens": appended,
            "seconds": secs,
            "decoded_tok_s": decoded as f64 / secs,
        });
        println!("{v}");
    }
    Ok(())
}

/// Progress lines, left out of `--json` runs (whose output ends with the figures).
fn say(json: bool, line: &str) {
    if !json {
        println!("{line}");
    }
}
