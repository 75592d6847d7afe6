//! Cached incremental decoding on the GPU equals full recomputation by the CPU reference, over
//! seeded random schedules of appends: ragged rows, rows with n_new = 0, sub-batches, resets,
//! chunks longer than the ring and than CHUNK, many ring wraps, rows filled to exactly max_len.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, KvDtype, ModelWeights, SplitMix64, WeightDtype};

/// Run a random schedule and check every returned row against the reference.
fn random_schedule(w: &ModelWeights, rows: usize, max_len: usize, steps: usize, seed: u64, tol: f32) {
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, w, EngineOptions::new(rows, max_len)).expect("engine");
    let mut rng = SplitMix64(seed);
    let vocab = w.cfg.vocab;
    let mut worst = 0f32;
    for step in 0..steps {
        // occasionally reset some rows
        if rng.below(6) == 0 {
            let r = rng.below(rows);
            engine.reset(&[r]).unwrap();
        }
        // full batch or a random sub-batch in random order
        let sub: Option<Vec<usize>> = if rng.below(3) == 0 {
            let mut all: Vec<usize> = (0..rows).collect();
            for i in (1..all.len()).rev() {
                all.swap(i, rng.below(i + 1));
            }
            all.truncate(1 + rng.below(rows));
            Some(all)
        } else {
            None
        };
        let chunk_rows: Vec<usize> = sub.clone().unwrap_or_else(|| (0..rows).collect());
        // lengths: mostly decode steps, sometimes long chunks (prefill, tool results)
        let mut n_new = Vec::new();
        for &row in &chunk_rows {
            let room = max_len - engine.cache().lens()[row];
            let want = match rng.below(5) {
                0 => 0,
                1 => rng.below(3 * max_len / 4 + 1),
                2 => rng.below(12),
                _ => 1,
            };
            n_new.push(want.min(room));
        }
        let width = n_new.iter().copied().max().unwrap_or(0).max(1);
        let mut ids = vec![0u32; chunk_rows.len() * width];
        for (r, &n) in n_new.iter().enumerate() {
            for j in 0..width {
                // padding gets random ids too: it must never matter
                ids[r * width + j] = rng.below(vocab) as u32;
                let _ = n;
            }
        }
        let out = engine.append(&ids, width, &n_new, sub.as_deref()).expect("append");
        for (r, &row) in chunk_rows.iter().enumerate() {
            match out.row(r) {
                Some(got) => {
                    assert!(n_new[r] > 0);
                    let hist = engine.cache().history(row).to_vec();
                    assert_eq!(hist.len(), engine.cache().lens()[row]);
                    let want = ref_last(w, &hist);
                    let diff = max_abs_diff(got, &want);
                    worst = worst.max(diff);
                    assert!(
                        diff <= tol,
                        "seed {seed} step {step}: chunk row {r} (cache row {row}, len {}): max |gpu - ref| = {diff}",
                        hist.len()
                    );
                }
                None => assert_eq!(n_new[r], 0),
            }
        }
    }
    println!("worst |gpu - reference| over the schedule: {worst:e}");
}

#[test]
fn tiny_agent_random_schedules_match_reference() {
    let s = seed(11);
    let w = model(&tiny_agent_cfg(), s);
    random_schedule(&w, 4, 40, 40, s, 1e-4);
}

#[test]
fn llama_random_schedules_match_reference() {
    let s = seed(12);
    let w = model(&llama_cfg(), s);
    random_schedule(&w, 3, 40, 40, s, 1e-4);
}

#[test]
fn families_random_schedules_match_reference() {
    // biases in every product variant, a NoPE layer, scaled RoPE, a ring beside global layers,
    // the attention softcap
    let s = seed(14);
    let w = model(&families_cfg(), s);
    random_schedule(&w, 3, 40, 40, s, 1e-4);
    // OLMo 2: no pre-norms, qk-norm over the whole projection
    let w = model(&olmo2_cfg(), s);
    random_schedule(&w, 3, 40, 40, s, 1e-4);
}

#[test]
fn moe_random_schedules_match_reference() {
    // the router, each token's top-k and the routed experts' products, against the reference's
    // routing and sums, in every layout of rows and chunks
    let s = seed(15);
    for cfg in moe_cfgs() {
        random_schedule(&model(&cfg, s), 3, 40, 30, s, 1e-4);
    }
}

#[test]
fn chunks_longer_than_chunk_and_ring_match_reference() {
    // max_len above CHUNK so one append is split into several submits, and the ring (W = 5)
    // wraps dozens of times
    let s = seed(13);
    let w = model(&tiny_agent_cfg(), s);
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(2, 150)).unwrap();
    let mut rng = SplitMix64(s);
    let prompt: Vec<u32> = (0..2 * 140).map(|_| rng.below(96) as u32).collect();
    // row 0: 140 tokens (3 chunks), row 1: 67 tokens, padded to 140
    let out = engine.append(&prompt, 140, &[140, 67], None).unwrap();
    for (r, n) in [(0usize, 140usize), (1, 67)] {
        let want = ref_last(&w, &prompt[r * 140..r * 140 + n]);
        let diff = max_abs_diff(out.row(r).unwrap(), &want);
        assert!(diff <= 1e-4, "row {r}: {diff}");
    }
    // then fill both rows to exactly max_len with single-token steps and one chunk
    let out = engine.append(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5, &[5, 5], None).unwrap();
    for r in 0..2 {
        let want = ref_last(&w, engine.cache().history(r));
        assert!(max_abs_diff(out.row(r).unwrap(), &want) <= 1e-4);
    }
    let need = 150 - engine.cache().lens()[1];
    let ids: Vec<u32> = (0..need as u32).map(|i| i % 96).collect();
    let out = engine.append(&ids, need, &[need], Some(&[1])).unwrap();
    assert_eq!(engine.cache().lens()[1], 150);
    let want = ref_last(&w, engine.cache().history(1));
    assert!(max_abs_diff(out.row(0).unwrap(), &want) <= 1e-4);
    // row 1 is full: one more token is refused
    assert!(engine.append(&[3], 1, &[1], Some(&[1])).is_err());
}

#[test]
fn f16_weights_match_reference_on_rounded_weights() {
    let s = seed(14);
    let w = model(&tiny_agent_cfg(), s);
    let gpu = gpu();
    let opts = EngineOptions { weights: WeightDtype::F16, ..EngineOptions::new(2, 32) };
    let mut engine = Engine::new(&gpu, &w, opts).unwrap();
    let w16 = w.rounded_to_f16();
    let ids: Vec<u32> = (0..20).map(|i| (i * 7 % 96) as u32).collect();
    let out = engine.append(&ids, 10, &[10, 7], None).unwrap();
    for (r, n) in [(0usize, 10usize), (1, 7)] {
        let want = ref_last(&w16, &ids[r * 10..r * 10 + n]);
        let diff = max_abs_diff(out.row(r).unwrap(), &want);
        assert!(diff <= 1e-4, "row {r}: {diff}");
    }
    let _ = KvDtype::F16;
}

#[test]
fn tiny_binding_limit_forces_every_split_and_still_matches() {
    // 8 KiB per storage binding: the embedding and LM head are split into row parts, the cache
    // into row shards, and chunks narrow to fit the activations. Results must not change.
    let s = seed(15);
    let w = model(&tiny_agent_cfg(), s);
    let opts = kvdecode::GpuOptions { max_storage_binding: Some(8192), ..Default::default() };
    let gpu = kvdecode::Gpu::with_options(&opts).expect("GPU with a lowered binding limit");
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(4, 40)).unwrap();
    assert!(engine.cache().shard_rows() < 4, "cache not sharded: {} rows per shard", engine.cache().shard_rows());
    assert!(engine.chunk_width() < kvdecode::CHUNK, "chunk not narrowed");
    // split weights and shards mean more dispatches than on a default device
    let plain = Engine::new(&common::gpu(), &w, EngineOptions::new(4, 40)).unwrap();
    assert!(engine.dispatches_per_chunk() > plain.dispatches_per_chunk());
    let mut rng = SplitMix64(s);
    for step in 0..12 {
        let n_new: Vec<usize> = (0..4).map(|r| if step == 0 { 9 + 4 * r } else { rng.below(3) }).collect();
        let width = *n_new.iter().max().unwrap();
        let width = width.max(1);
        let ids: Vec<u32> = (0..4 * width).map(|_| rng.below(96) as u32).collect();
        let out = engine.append(&ids, width, &n_new, None).unwrap();
        for r in 0..4 {
            if let Some(got) = out.row(r) {
                let want = ref_last(&w, engine.cache().history(r));
                let d = max_abs_diff(got, &want);
                assert!(d <= 1e-4, "seed {s} step {step} row {r}: {d}");
            }
        }
    }
}

fn engram_cfg() -> kvdecode::ModelConfig {
    let mut c = tiny_agent_cfg();
    c.engram = Some(kvdecode::model::config::EngramConfig {
        layers: vec![1, 2],
        orders: vec![2, 3],
        heads: 2,
        table_rows: 64,
        dim: 8,
    });
    c
}

#[test]
fn engram_random_schedules_match_reference() {
    // addresses read the token history across chunk boundaries, sub-batches and resets
    let s = seed(16);
    let w = model(&engram_cfg(), s);
    assert!(w.layers[1].engram.is_some() && w.cid_map.is_some());
    // positions before a row's start hold token 0, whose compressed id is not 0 here: the map
    // decides a row's first addresses (the seed's rule), so a GPU that used 0 would differ
    let cid0 = w.cid_map.as_ref().unwrap()[0];
    assert_ne!(cid0, 0);
    assert_ne!(ModelWeights::demo().cid_map.unwrap()[0], 0);
    let fnv = |ids: &[u32]| ids.iter().fold(0x811C_9DC5u32, |h, &c| (h ^ c).wrapping_mul(0x0100_0193));
    assert_eq!(
        kvdecode::model::engram::address(&[5], cid0, 0, 3, 0, 1 << 30),
        (fnv(&[cid0, cid0, 5]) % (1 << 30)) as usize
    );
    random_schedule(&w, 4, 40, 40, s, 1e-4);
    // and with chunks longer than CHUNK
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(1, 100)).unwrap();
    let ids: Vec<u32> = (0..90).map(|i| (i * 7 % 96) as u32).collect();
    let out = engine.append(&ids, 90, &[90], None).unwrap();
    assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&w, &ids)) <= 1e-4);
}

#[test]
fn engram_survives_safetensors_round_trip() {
    let w = model(&engram_cfg(), 17);
    let back =
        kvdecode::ModelWeights::from_safetensors_bytes(&w.to_safetensors_bytes(kvdecode::DiskDtype::F32).unwrap())
            .unwrap();
    assert_eq!(back, w);
}
