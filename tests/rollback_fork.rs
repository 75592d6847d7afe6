//! Rollback is exact (also in the local ring), fork continues from the same prefix, and results
//! do not depend on how tokens were chunked.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, SplitMix64};

#[test]
fn chunking_does_not_change_a_single_bit() {
    // one append of 37 tokens vs one token per append vs uneven chunks: identical logits
    for cfg in [tiny_agent_cfg(), llama_cfg(), families_cfg(), olmo2_cfg()].into_iter().chain(moe_cfgs()) {
        let w = model(&cfg, 61);
        let seq: Vec<u32> = (0..37).map(|i| (i * 29 + 3) % 96).collect();
        let mut a = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
        let whole = a.append(&seq, 37, &[37], None).unwrap();
        let mut b = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
        let mut last = None;
        for &t in &seq {
            last = Some(b.append(&[t], 1, &[1], None).unwrap());
        }
        assert_eq!(whole.row(0).unwrap(), last.unwrap().row(0).unwrap());
        let mut c = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
        let mut at = 0;
        let mut out = None;
        for n in [3usize, 11, 1, 9, 13] {
            out = Some(c.append(&seq[at..at + n], n, &[n], None).unwrap());
            at += n;
        }
        assert_eq!(whole.row(0).unwrap(), out.unwrap().row(0).unwrap());
    }
}

#[test]
fn rollback_is_exact_in_the_ring_too() {
    let s = seed(62);
    let w = model(&tiny_agent_cfg(), s); // window 5
    let opts = EngineOptions { rollback: 6, ..EngineOptions::new(2, 80) };
    let mut e = Engine::new(&gpu(), &w, opts).unwrap();
    let mut rng = SplitMix64(s);
    let mut seq: Vec<Vec<u32>> = vec![(0..20).map(|_| rng.below(96) as u32).collect(); 2];
    seq[1] = (0..20).map(|_| rng.below(96) as u32).collect();
    let ids: Vec<u32> = seq.iter().flatten().copied().collect();
    e.append(&ids, 20, &[20, 20], None).unwrap();
    for round in 0..6 {
        // append junk (a chunk on row 0, single steps on row 1), roll it back, continue
        let k0 = 1 + rng.below(6);
        let junk: Vec<u32> = (0..k0).map(|_| rng.below(96) as u32).collect();
        e.append(&junk, k0, &[k0], Some(&[0])).unwrap();
        let k1 = 1 + rng.below(3);
        for _ in 0..k1 {
            e.append(&[rng.below(96) as u32], 1, &[1], Some(&[1])).unwrap();
        }
        e.rollback(&[0, 1], &[k0, k1]).unwrap();
        assert_eq!(e.cache().history(0), &seq[0][..]);
        let next = [rng.below(96) as u32, rng.below(96) as u32];
        let out = e.append(&next, 1, &[1, 1], None).unwrap();
        for r in 0..2 {
            seq[r].push(next[r]);
            let want = ref_last(&w, &seq[r]);
            let d = max_abs_diff(out.row(r).unwrap(), &want);
            assert!(d <= 1e-4, "seed {s} round {round} row {r}: {d}");
        }
    }
    // deeper than the spare slots allow: a clear error, nothing changes
    e.append(&[1, 2, 3, 4, 5, 6, 7], 7, &[7], Some(&[0])).unwrap();
    let err = e.rollback(&[0], &[7]).unwrap_err();
    assert!(format!("{err}").contains("row 0: cannot roll back 7"), "{err}");
    e.rollback(&[0], &[6]).unwrap();
}

#[test]
fn llama_rolls_back_any_depth() {
    let w = model(&llama_cfg(), 63);
    let mut e = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
    let seq: Vec<u32> = (0..40).map(|i| (i * 7) % 96).collect();
    e.append(&seq, 40, &[40], None).unwrap();
    e.rollback(&[0], &[25]).unwrap();
    let out = e.append(&[5], 1, &[1], None).unwrap();
    let mut want_seq = seq[..15].to_vec();
    want_seq.push(5);
    assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&w, &want_seq)) <= 1e-4);
}

/// A mixture of experts' route log follows a row through forks, appends in chunks, rollbacks
/// and resets: every position's experts are what the CPU reference routes the row's history to.
#[test]
fn moe_routes_follow_forks_rollbacks_and_resets() {
    let s = seed(65);
    let w = model(&moe_cfgs()[0], s);
    let opts = EngineOptions { record_routes: true, ..EngineOptions::new(3, 48) };
    let mut e = Engine::new(&gpu(), &w, opts).unwrap();
    assert_eq!(e.route_stride(), Some(2 * 2));
    let mut rng = SplitMix64(s);
    let mut draw = |n: usize| (0..n).map(|_| rng.below(96) as u32).collect::<Vec<u32>>();
    let prompt = draw(13);
    e.append(&prompt, 13, &[13], Some(&[0])).unwrap();
    e.fork(0, &[1, 2]).unwrap();
    let (a, b) = (draw(7), draw(3));
    e.append(&[a.clone(), b.iter().copied().chain([0; 4]).collect()].concat(), 7, &[7, 3], Some(&[1, 2])).unwrap();
    e.rollback(&[1], &[4]).unwrap();
    e.append(&draw(2), 2, &[2], Some(&[1])).unwrap();
    e.reset(&[0]).unwrap();
    e.append(&draw(5), 5, &[5], Some(&[0])).unwrap();
    for row in 0..3 {
        let history = e.cache().history(row).to_vec();
        let (_, want) = kvdecode::model::reference::forward_routed(&w, &history, Default::default()).unwrap();
        assert_eq!(e.routes(row).unwrap(), want, "seed {s}: row {row}");
    }
    // a dense model has no routes to keep
    let dense = EngineOptions { record_routes: true, ..EngineOptions::new(1, 16) };
    assert!(Engine::new(&gpu(), &model(&llama_cfg(), s), dense).is_err());
}

#[test]
fn fork_continues_from_the_same_prefix() {
    let w = model(&tiny_agent_cfg(), 64);
    // 5 rows with a lowered binding limit so rows live in different cache shards
    let opts = kvdecode::GpuOptions { max_storage_binding: Some(8192), ..Default::default() };
    let gpu = kvdecode::Gpu::with_options(&opts).unwrap();
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(5, 40)).unwrap();
    assert!(e.cache().shard_rows() < 5);
    let prompt: Vec<u32> = (0..17).map(|i| (i * 5 + 1) % 96).collect();
    e.append(&prompt, 17, &[17], Some(&[1])).unwrap();
    e.append(&[9, 9, 9], 3, &[3], Some(&[3])).unwrap(); // rows 3 gets overwritten by the fork
    e.fork(1, &[0, 3, 4]).unwrap();
    for r in [0, 3, 4] {
        assert_eq!(e.cache().history(r), &prompt[..]);
    }
    // each row continues with its own token: same as the reference over prompt + token
    let next = [11u32, 12, 13, 14, 15];
    let out = e.append(&next, 1, &[1, 1, 0, 1, 1], None).unwrap();
    for r in [0usize, 1, 3, 4] {
        let mut s = prompt.clone();
        s.push(next[r]);
        let d = max_abs_diff(out.row(r).unwrap(), &ref_last(&w, &s));
        assert!(d <= 1e-4, "row {r}: {d}");
    }
    assert!(e.fork(2, &[2]).is_err());
}
