//! Batched multi-turn rollouts, the main job: 16 rows, each an episode of a prompt, decoded turns
//! and tool results appended mid-episode. Episodes end at different times and new ones start in
//! the freed rows (reset + prefill), all inside the same batched appends.
//!
//! `cargo run --release --example rollout [-- --rows 16 --episodes 48 --seed 1 --kv f16]`

use std::time::Instant;

use kvdecode::{Engine, EngineOptions, Gpu, KvDtype, ModelWeights, Sampler, SplitMix64};

const STOP: u32 = 0; // end-of-turn token id
const MAX_TURN: usize = 24; // decoded tokens per turn at most

/// What a row is doing.
#[derive(Clone, Debug)]
enum Phase {
    Free,
    /// Tokens waiting to be appended (a prompt or a tool result), then the model decodes.
    Feed(Vec<u32>),
    /// Decoding a turn: the token to feed next and the tokens of the turn so far.
    Decode {
        next: u32,
        turn: Vec<u32>,
    },
}

struct Episode {
    id: usize,
    turns_left: usize,
    turns: Vec<Vec<u32>>,
    sampler: Sampler,
}

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.into())
}

fn main() -> kvdecode::Result<()> {
    let rows: usize = arg("--rows", "16").parse().expect("--rows");
    let episodes: usize = arg("--episodes", "48").parse().expect("--episodes");
    let seed: u64 = arg("--seed", "1").parse().expect("--seed");
    let kv = if arg("--kv", "f32") == "f16" { KvDtype::F16 } else { KvDtype::F32 };
    let gpu = Gpu::new()?;
    let model = ModelWeights::demo();
    let vocab = model.cfg.vocab;
    let max_len = 64 + 4 * (MAX_TURN + 32);
    let mut engine = Engine::new(&gpu, &model, EngineOptions { kv, ..EngineOptions::new(rows, max_len) })?;
    println!("adapter: {}", gpu.describe());
    println!(
        "model: demo TinyAgent layout ({} layers, d_model {}, window {}), {rows} rows x max_len {max_len}, kv {kv:?}",
        model.cfg.n_layers(),
        model.cfg.d_model,
        model.cfg.window
    );

    let mut rng = SplitMix64(seed);
    let random_tokens = |rng: &mut SplitMix64, lo: usize, hi: usize| -> Vec<u32> {
        let n = lo + rng.below(hi - lo + 1);
        (0..n).map(|_| 1 + rng.below(vocab - 1) as u32).collect()
    };
    let mut phase = vec![Phase::Free; rows];
    let mut slot: Vec<Option<Episode>> = (0..rows).map(|_| None).collect();
    let (mut started, mut finished) = (0usize, 0usize);
    let (mut decoded, mut appended, mut steps) = (0usize, 0usize, 0usize);
    let t0 = Instant::now();
    while finished < episodes {
        // admit new episodes into free rows: reset, then their prompt goes into this step's append
        let free: Vec<usize> = (0..rows).filter(|&r| matches!(phase[r], Phase::Free)).collect();
        let mut reset = Vec::new();
        for r in free {
            if started == episodes {
                break;
            }
            reset.push(r);
            phase[r] = Phase::Feed(random_tokens(&mut rng, 16, 64));
            slot[r] = Some(Episode {
                id: started,
                turns_left: 2 + rng.below(3),
                turns: Vec::new(),
                sampler: Sampler::temperature(0.9, seed as u32 * 1000 + started as u32),
            });
            started += 1;
        }
        engine.reset(&reset)?;
        // one batched append: prompts and tool results as chunks, decoding rows one token each
        let active: Vec<usize> = (0..rows).filter(|&r| !matches!(phase[r], Phase::Free)).collect();
        let chunks: Vec<Vec<u32>> = active
            .iter()
            .map(|&r| match &phase[r] {
                Phase::Feed(t) => t.clone(),
                Phase::Decode { next, .. } => vec![*next],
                Phase::Free => unreachable!(),
            })
            .collect();
        let width = chunks.iter().map(Vec::len).max().unwrap_or(1);
        let mut ids = vec![0u32; active.len() * width];
        for (i, c) in chunks.iter().enumerate() {
            ids[i * width..i * width + c.len()].copy_from_slice(c);
        }
        let n_new: Vec<usize> = chunks.iter().map(Vec::len).collect();
        let samplers: Vec<Sampler> = active.iter().map(|&r| slot[r].as_ref().unwrap().sampler).collect();
        let next = engine.append_sample(&ids, width, &n_new, Some(&active), &samplers)?;
        steps += 1;
        for (i, &r) in active.iter().enumerate() {
            let tok = next[i].expect("every active row appended tokens");
            match &mut phase[r] {
                Phase::Feed(t) => {
                    appended += t.len();
                    phase[r] = Phase::Decode { next: tok, turn: Vec::new() };
                }
                Phase::Decode { next, turn } => {
                    decoded += 1;
                    turn.push(*next);
                    let room = engine.cache().lens()[r] + 1 + 32 + MAX_TURN <= max_len;
                    if *next == STOP || turn.len() >= MAX_TURN || !room {
                        let ep = slot[r].as_mut().unwrap();
                        println!(
                            "step {steps:4}: episode {:3} row {r:2} turn {}: {:2} tokens ({})",
                            ep.id,
                            ep.turns.len() + 1,
                            turn.len(),
                            if *next == STOP { "stop token" } else { "turn limit" }
                        );
                        ep.turns.push(std::mem::take(turn));
                        ep.turns_left -= 1;
                        if ep.turns_left == 0 || !room {
                            let ep = slot[r].take().unwrap();
                            finished += 1;
                            println!(
                                "step {steps:4}: episode {:3} done in row {r:2}: {} turns, {} tokens decoded, {} cached; {finished}/{episodes} done",
                                ep.id,
                                ep.turns.len(),
                                ep.turns.iter().map(Vec::len).sum::<usize>(),
                                engine.cache().lens()[r]
                            );
                            phase[r] = Phase::Free;
                        } else {
                            // the tool answers: its result is appended mid-episode as a chunk
                            phase[r] = Phase::Feed(random_tokens(&mut rng, 4, 32));
                        }
                    } else {
                        *next = tok;
                    }
                }
                Phase::Free => {}
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let c = engine.cache();
    let st = engine.stats();
    println!("---");
    println!(
        "{episodes} episodes, {steps} batched steps, {decoded} tokens decoded, {appended} prompt/tool tokens appended in {secs:.2} s"
    );
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
    Ok(())
}
