//! Paged global K/V: random schedules on a small block pool (ragged appends, sub-batches, resets,
//! forks sharing blocks, rollbacks into shared blocks, multi-step windows, speculative drafts,
//! the pool running out, prompt-cache hits) give logits bit-identical to an engine whose rows each
//! own one block as large as `max_len` (the layout without paging) and compute every prompt,
//! equal to the CPU reference, and leave the pool's bookkeeping exact after every step.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Error, ModelConfig, Sampler, SplitMix64};

const ROWS: usize = 4;
const MAX_LEN: usize = 96;

fn engines(w: &kvdecode::ModelWeights, pool_blocks: usize) -> (Engine, Engine) {
    let gpu = gpu();
    let base = EngineOptions { rollback: 6, ..EngineOptions::new(ROWS, MAX_LEN) };
    let paged = Engine::new(&gpu, w, EngineOptions { block_len: 4, pool_blocks: Some(pool_blocks), ..base }).unwrap();
    let flat = Engine::new(&gpu, w, EngineOptions { block_len: 128, prompt_cache: false, ..base }).unwrap();
    (paged, flat)
}

/// What one schedule saw, so the test can insist it exercised what it claims to.
#[derive(Default, Debug)]
struct Seen {
    out_of_blocks: usize,
    peak_shared: usize,
    forks: usize,
    rollbacks: usize,
    windows: usize,
    drafts: usize,
    reused_tokens: usize,
}

fn run_schedule(cfg: &ModelConfig, s: u64, steps: usize) -> Seen {
    let w = model(cfg, s);
    // 4 rows of up to 24 blocks: 40 blocks run out now and then
    let (mut paged, mut flat) = engines(&w, 40);
    let mut rng = SplitMix64(s);
    let mut seen = Seen::default();
    let v = cfg.vocab;
    for step in 0..steps {
        let ctx = format!("seed {s} step {step}");
        let lens: Vec<usize> = paged.cache().lens().to_vec();
        match rng.below(12) {
            // ragged append on a random sub-batch
            0..=3 => {
                let rows: Vec<usize> = (0..ROWS).filter(|_| rng.below(3) > 0).collect();
                if rows.is_empty() {
                    continue;
                }
                let n: Vec<usize> =
                    rows.iter().map(|&r| rng.below(13).min(MAX_LEN - paged.cache().position(r))).collect();
                let width = n.iter().copied().max().unwrap_or(0).max(1);
                let ids: Vec<u32> = (0..rows.len() * width).map(|_| rng.below(v) as u32).collect();
                match paged.append(&ids, width, &n, Some(&rows)) {
                    Ok(a) => {
                        let b = flat.append(&ids, width, &n, Some(&rows)).unwrap();
                        for (i, &k) in n.iter().enumerate() {
                            if k > 0 {
                                assert_eq!(a.row(i), b.row(i), "{ctx}: append, row {}", rows[i]);
                            }
                        }
                    }
                    Err(Error::OutOfBlocks { .. }) => {
                        seen.out_of_blocks += 1;
                        assert_eq!(paged.cache().lens(), &lens[..], "{ctx}: a failed append changed lengths");
                    }
                    Err(e) => panic!("{ctx}: {e}"),
                }
            }
            // reset a row
            4 => {
                let r = rng.below(ROWS);
                paged.reset(&[r]).unwrap();
                flat.reset(&[r]).unwrap();
            }
            // fork a row into one or two others
            5 => {
                let src = rng.below(ROWS);
                let dst: Vec<usize> = (0..ROWS).filter(|&r| r != src && rng.below(2) == 0).collect();
                if lens[src] == 0 || dst.is_empty() {
                    continue;
                }
                paged.fork(src, &dst).unwrap();
                flat.fork(src, &dst).unwrap();
                seen.forks += 1;
            }
            // roll back a row (into a shared block, often)
            6 => {
                let r = rng.below(ROWS);
                let k = rng.below(paged.cache().max_rollback(r) + 1);
                assert!(k <= flat.cache().max_rollback(r), "{ctx}");
                paged.rollback(&[r], &[k]).unwrap();
                flat.rollback(&[r], &[k]).unwrap();
                seen.rollbacks += (k > 0) as usize;
            }
            // a multi-step window on the rows that have room
            7 => {
                let steps = 1 + rng.below(paged.max_window());
                let rows: Vec<usize> =
                    (0..ROWS).filter(|&r| lens[r] > 0 && paged.cache().position(r) + steps <= MAX_LEN).collect();
                if rows.is_empty() {
                    continue;
                }
                let first: Vec<u32> = rows.iter().map(|_| rng.below(v) as u32).collect();
                let samplers = vec![Sampler::GREEDY; rows.len()];
                match paged.decode_steps(&rows, &first, &samplers, steps) {
                    Ok(a) => {
                        let b = flat.decode_steps(&rows, &first, &samplers, steps).unwrap();
                        assert_eq!(a, b, "{ctx}: window of {steps}");
                        seen.windows += 1;
                    }
                    Err(Error::OutOfBlocks { .. }) => seen.out_of_blocks += 1,
                    Err(e) => panic!("{ctx}: {e}"),
                }
            }
            // a new sequence in a row whose prompt starts with another row's tokens (or a finished
            // one's): the paged engine reuses cached blocks, the flat one computes everything
            10 | 11 => {
                let r = rng.below(ROWS);
                let from = paged.cache().history(rng.below(ROWS)).to_vec();
                let keep = rng.below(from.len() + 1);
                let mut prompt = from[..keep].to_vec();
                prompt.extend((0..1 + rng.below(6)).map(|_| rng.below(v) as u32));
                prompt.truncate(MAX_LEN);
                paged.reset(&[r]).unwrap();
                flat.reset(&[r]).unwrap();
                let n = paged.reuse_prefix(r, &prompt).unwrap();
                assert!(n < prompt.len(), "{ctx}: reused all {n} tokens");
                let rest = &prompt[n..];
                match paged.append(rest, rest.len(), &[rest.len()], Some(&[r])) {
                    Ok(a) => {
                        let b = flat.append(&prompt, prompt.len(), &[prompt.len()], Some(&[r])).unwrap();
                        assert_eq!(a.row(0), b.row(0), "{ctx}: prompt of {} tokens, {n} reused", prompt.len());
                        seen.reused_tokens += n;
                    }
                    Err(Error::OutOfBlocks { .. }) => {
                        seen.out_of_blocks += 1;
                        // the reused prefix stays; the flat engine holds it too
                        if n > 0 {
                            flat.append(&prompt[..n], n, &[n], Some(&[r])).unwrap();
                        }
                    }
                    Err(e) => panic!("{ctx}: {e}"),
                }
            }
            // a speculative draft: all-position logits for 3 tokens, then 2 of them rolled back
            _ => {
                let r = rng.below(ROWS);
                if paged.cache().position(r) + 3 > MAX_LEN || lens[r] == 0 {
                    continue;
                }
                let draft: Vec<u32> = (0..3).map(|_| rng.below(v) as u32).collect();
                match paged.append_all_logits(&draft, 3, &[3], Some(&[r])) {
                    Ok(a) => {
                        let b = flat.append_all_logits(&draft, 3, &[3], Some(&[r])).unwrap();
                        assert_eq!(a, b, "{ctx}: draft");
                        paged.rollback(&[r], &[2]).unwrap();
                        flat.rollback(&[r], &[2]).unwrap();
                        seen.drafts += 1;
                    }
                    Err(Error::OutOfBlocks { .. }) => seen.out_of_blocks += 1,
                    Err(e) => panic!("{ctx}: {e}"),
                }
            }
        }
        paged.cache().check_blocks().unwrap_or_else(|e| panic!("{ctx}: {e}"));
        flat.cache().check_blocks().unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(paged.cache().lens(), flat.cache().lens(), "{ctx}");
        seen.peak_shared = seen.peak_shared.max(paged.cache().block_usage().shared);
    }
    // every row against the CPU reference over its whole history
    for r in 0..ROWS {
        if paged.cache().position(r) >= MAX_LEN {
            continue;
        }
        let t = rng.below(v) as u32;
        let (a, b) = match paged.append(&[t], 1, &[1], Some(&[r])) {
            Ok(a) => (a, flat.append(&[t], 1, &[1], Some(&[r])).unwrap()),
            Err(Error::OutOfBlocks { .. }) => continue,
            Err(e) => panic!("seed {s} row {r}: {e}"),
        };
        assert_eq!(a.row(0), b.row(0), "seed {s} row {r}: final");
        let history = paged.cache().history(r).to_vec();
        let d = max_abs_diff(a.row(0).unwrap(), &ref_last(&w, &history));
        assert!(d <= 1e-4, "seed {s} row {r}: {d} from the reference");
    }
    // releasing every row returns every block (cached ones stay, evictable)
    paged.reset(&(0..ROWS).collect::<Vec<_>>()).unwrap();
    let u = paged.cache().block_usage();
    assert_eq!((u.used, u.free, u.evictable), (0, u.total, u.cached), "seed {s}: blocks leaked: {u:?}");
    paged.cache().check_blocks().unwrap();
    seen
}

#[test]
fn random_schedules_match_the_unpaged_layout_bit_for_bit() {
    let s = seed(91);
    let mut total = Seen::default();
    for (i, cfg) in [tiny_agent_cfg(), llama_cfg()].iter().enumerate() {
        for round in 0..2 {
            let seen = run_schedule(cfg, s.wrapping_add((i * 2 + round) as u64), 60);
            println!("config {i} round {round}: {seen:?}");
            total.out_of_blocks += seen.out_of_blocks;
            total.peak_shared = total.peak_shared.max(seen.peak_shared);
            total.forks += seen.forks;
            total.rollbacks += seen.rollbacks;
            total.windows += seen.windows;
            total.drafts += seen.drafts;
            total.reused_tokens += seen.reused_tokens;
        }
    }
    // the schedules exercised what they claim to
    assert!(total.out_of_blocks > 0, "the pool never ran out: {total:?}");
    assert!(total.peak_shared > 0 && total.forks > 0, "no blocks were shared: {total:?}");
    assert!(total.rollbacks > 0 && total.windows > 0 && total.drafts > 0, "{total:?}");
    assert!(total.reused_tokens > 0, "the prompt cache never hit: {total:?}");
}

#[test]
fn forks_share_the_prefix_and_copy_only_the_last_block() {
    let w = model(&llama_cfg(), 92);
    let gpu = gpu();
    let opts = EngineOptions { block_len: 16, ..EngineOptions::new(8, 128) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    let prompt: Vec<u32> = (0..50).map(|i| (i * 7 + 1) % 96).collect();
    e.append(&prompt, 50, &[50], Some(&[0])).unwrap();
    assert_eq!(e.cache().block_usage().used, 4);
    e.fork(0, &[1, 2, 3, 4, 5, 6, 7]).unwrap();
    // 8 rows, one copy of the prompt's 4 blocks
    let u = e.cache().block_usage();
    assert_eq!((u.used, u.shared, u.referenced), (4, 4, 32), "{u:?}");
    // each row writes its own token: the shared, partly filled fourth block is copied per writer
    let ids: Vec<u32> = (0..8).collect();
    let out = e.append(&ids, 1, &[1; 8], None).unwrap();
    let u = e.cache().block_usage();
    assert_eq!((u.used, u.shared), (3 + 8, 3), "{u:?}");
    // and each row equals the reference over its own sequence
    for r in 0..8 {
        let mut seq = prompt.clone();
        seq.push(r as u32);
        let d = max_abs_diff(out.row(r).unwrap(), &ref_last(&w, &seq));
        assert!(d <= 1e-4, "row {r}: {d}");
    }
    // bytes actually used: 11 blocks of K/V, not 8 prompts' worth
    let c = e.cache();
    assert_eq!(c.used_nbytes(), 11 * 16 * c.global_bytes_per_position());
    e.reset(&(0..8).collect::<Vec<_>>()).unwrap();
    assert_eq!(e.cache().block_usage().used, 0);
    e.cache().check_blocks().unwrap();
}

#[test]
fn out_of_blocks_is_a_clear_error_that_changes_nothing() {
    let w = model(&llama_cfg(), 93);
    let gpu = gpu();
    // two rows of up to 64 positions, 5 blocks of 16 between them
    let opts = EngineOptions { block_len: 16, pool_blocks: Some(5), ..EngineOptions::new(2, 64) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    let a: Vec<u32> = (0..40).map(|i| i % 96).collect();
    e.append(&a, 40, &[40], Some(&[0])).unwrap(); // 3 blocks
    let before = e.cache().block_usage();
    let err = e.append(&a, 40, &[40], Some(&[1])).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::OutOfBlocks { row: 1, needed: 3, free: 2, blocks: 5, .. }), "{msg}");
    assert!(msg.contains("row 1") && msg.contains("pool_blocks"), "{msg}");
    assert_eq!(e.cache().block_usage(), before);
    assert_eq!(e.cache().lens(), &[40, 0]);
    e.cache().check_blocks().unwrap();
    // the same pool given in bytes; both sizes at once is an error that names them
    let per_block = 16 * e.cache().global_bytes_per_position();
    let by_bytes = EngineOptions { block_len: 16, pool_bytes: Some(5 * per_block + 7), ..EngineOptions::new(2, 64) };
    assert_eq!(Engine::new(&gpu, &w, by_bytes).unwrap().cache().block_usage().total, 5);
    let both = EngineOptions { pool_blocks: Some(5), ..by_bytes };
    let err = Engine::new(&gpu, &w, both).err().expect("both sizes").to_string();
    assert!(err.contains("pool_blocks or pool_bytes, not both"), "{err}");
    // freeing row 0 makes room, and row 1 decodes as if nothing had happened
    e.reset(&[0]).unwrap();
    let out = e.append(&a, 40, &[40], Some(&[1])).unwrap();
    let d = max_abs_diff(out.row(0).unwrap(), &ref_last(&w, &a));
    assert!(d <= 1e-4, "{d}");
}

#[test]
fn forks_across_pool_shards_copy_the_blocks() {
    // 16 KiB bindings: a row's 64 positions of K/V (2 kv heads x 8 x f32, keys and values) take
    // 8 KiB, so the 4 rows' pool is cut into shards and rows 0 and 3 live in different ones
    let small = kvdecode::Gpu::with_options(&kvdecode::GpuOptions {
        max_storage_binding: Some(16 << 10),
        ..Default::default()
    })
    .unwrap();
    let w = model(&llama_cfg(), 94);
    let mut e = Engine::new(&small, &w, EngineOptions { block_len: 8, ..EngineOptions::new(4, 64) }).unwrap();
    assert!(e.cache().shard_rows() < 4, "pool not sharded: {} rows per shard", e.cache().shard_rows());
    let prompt: Vec<u32> = (0..21).map(|i| (i * 5 + 2) % 96).collect();
    e.append(&prompt, 21, &[21], Some(&[0])).unwrap();
    e.fork(0, &[1, 3]).unwrap();
    e.cache().check_blocks().unwrap();
    let out = e.append(&[7, 8, 9], 1, &[1, 1, 1], Some(&[0, 1, 3])).unwrap();
    for (i, t) in [7u32, 8, 9].into_iter().enumerate() {
        let mut seq = prompt.clone();
        seq.push(t);
        let d = max_abs_diff(out.row(i).unwrap(), &ref_last(&w, &seq));
        assert!(d <= 1e-4, "row {i}: {d}");
    }
}

#[test]
fn the_prompt_cache_reuses_blocks_bit_for_bit_and_evicts_the_oldest() {
    let s = seed(95);
    let w = model(&llama_cfg(), s);
    let gpu = gpu();
    let mut rng = SplitMix64(s);
    let system: Vec<u32> = (0..40).map(|_| rng.below(96) as u32).collect();
    // 2 rows, 7 blocks of 16 positions: a 96-token sequence (6 blocks) needs the cached ones
    let opts = EngineOptions { block_len: 16, pool_blocks: Some(7), ..EngineOptions::new(2, 96) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    let mut alone = Engine::new(&gpu, &w, EngineOptions { prompt_cache: false, ..opts }).unwrap();
    assert!(e.cache().prompt_cache() && !alone.cache().prompt_cache());
    // a first request computes everything and leaves its 2 full blocks in the cache
    assert_eq!(e.reuse_prefix(0, &system).unwrap(), 0);
    e.append(&system, 40, &[40], Some(&[0])).unwrap();
    e.reset(&[0]).unwrap();
    let u = e.cache().block_usage();
    assert_eq!((u.used, u.cached, u.evictable), (0, 2, 2), "{u:?}");
    // the next request with the same system prompt and its own question reuses 32 tokens
    let mut prompt = system.clone();
    prompt.extend([5, 6, 7]);
    let n = e.reuse_prefix(1, &prompt).unwrap();
    assert_eq!(n, 32);
    let a = e.append(&prompt[n..], prompt.len() - n, &[prompt.len() - n], Some(&[1])).unwrap();
    let b = alone.append(&prompt, prompt.len(), &[prompt.len()], Some(&[1])).unwrap();
    assert_eq!(a.row(0), b.row(0), "a prompt-cache hit changed the logits");
    let d = max_abs_diff(a.row(0).unwrap(), &ref_last(&w, &prompt));
    assert!(d <= 1e-4, "{d}");
    // decoding on from the reused prefix stays identical too
    let a = e.append(&[9], 1, &[1], Some(&[1])).unwrap();
    let b = alone.append(&[9], 1, &[1], Some(&[1])).unwrap();
    assert_eq!(a.row(0), b.row(0));
    let st = e.cache().prompt_cache_stats();
    assert_eq!((st.lookups, st.hit_tokens, st.prompt_tokens), (2, 32, 83), "{st:?}");
    // a long unrelated sequence needs the cached blocks: the least recently used are evicted
    e.reset(&[1]).unwrap();
    let other: Vec<u32> = (0..96).map(|i| (i * 11 + 3) % 96).collect();
    e.append(&other, 96, &[96], Some(&[0])).unwrap();
    assert!(e.cache().prompt_cache_stats().evicted > 0);
    e.cache().check_blocks().unwrap();
    e.reset(&[0]).unwrap();
}

/// Models with local layers: a hit recomputes `local layers x W + rollback` positions before the
/// reuse point (their rings) without writing global K/V, and the row then decodes, rolls back and
/// decodes again bit for bit like one that computed everything.
#[test]
fn a_prompt_cache_hit_on_a_model_with_rings_recomputes_them_exactly() {
    let s = seed(96);
    let cfg = tiny_agent_cfg(); // 4 local layers, window 5; rollback 6: replays 26 positions
    let w = model(&cfg, s);
    let gpu = gpu();
    let mut rng = SplitMix64(s);
    let system: Vec<u32> = (0..70).map(|_| rng.below(96) as u32).collect();
    let opts = EngineOptions { block_len: 8, rollback: 6, ..EngineOptions::new(2, 128) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    let mut alone = Engine::new(&gpu, &w, EngineOptions { prompt_cache: false, ..opts }).unwrap();
    e.append(&system, 70, &[70], Some(&[0])).unwrap();
    e.reset(&[0]).unwrap();
    // the prompt ends right after the reuse point, so what follows leans on the recomputed rings
    let mut prompt = system[..64].to_vec();
    prompt.push(5);
    // 8 blocks of 8 cached (64 positions); 26 to replay: from position 32 (a block boundary)
    let n = e.reuse_prefix(1, &prompt).unwrap();
    assert_eq!(n, 64);
    assert_eq!(e.cache().prompt_cache_stats().hit_tokens, 32);
    let a = e.append(&prompt[n..], prompt.len() - n, &[prompt.len() - n], Some(&[1])).unwrap();
    let b = alone.append(&prompt, prompt.len(), &[prompt.len()], Some(&[1])).unwrap();
    assert_eq!(a.row(0), b.row(0), "seed {s}: the recomputed rings changed the logits");
    // roll back into the reused region as far as the rings allow: the next token reads ring
    // entries of the deepest local layer written during the replay
    let k = e.cache().max_rollback(1);
    assert_eq!((k, alone.cache().max_rollback(1)), (6, 6));
    e.rollback(&[1], &[k]).unwrap();
    alone.rollback(&[1], &[k]).unwrap();
    // decode, roll back as far as the rings allow, decode again: identical throughout
    for round in 0..3 {
        let t: Vec<u32> = (0..4).map(|_| rng.below(96) as u32).collect();
        let a = e.append(&t, 4, &[4], Some(&[1])).unwrap();
        let b = alone.append(&t, 4, &[4], Some(&[1])).unwrap();
        assert_eq!(a.row(0), b.row(0), "seed {s} round {round}");
        let k = e.cache().max_rollback(1);
        assert_eq!(k, alone.cache().max_rollback(1));
        e.rollback(&[1], &[k]).unwrap();
        alone.rollback(&[1], &[k]).unwrap();
    }
    let a = e.append(&[9], 1, &[1], Some(&[1])).unwrap();
    let b = alone.append(&[9], 1, &[1], Some(&[1])).unwrap();
    assert_eq!(a.row(0), b.row(0));
    let d = max_abs_diff(a.row(0).unwrap(), &ref_last(&w, e.cache().history(1)));
    assert!(d <= 1e-4, "seed {s}: {d} from the reference");
    e.cache().check_blocks().unwrap();
    // a prefix shorter than the replay is not reused
    e.reset(&[1]).unwrap();
    assert_eq!(e.reuse_prefix(1, &prompt[..30]).unwrap(), 0);
}
