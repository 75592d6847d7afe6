//! Arbitrary key-padding masks (the seed's `build_attn_mask`): `SequenceCache::forward_masked`
//! against the seed's rule computed by the CPU reference over the whole padded sequence (a query
//! at i sees real keys at positions <= i and always itself; RoPE positions are the absolute
//! index), on random masks, in several calls; and the seed's checks as clear errors that change
//! nothing.

mod common;

use common::*;
use kvdecode::model::reference::{self, RefOptions};
use kvdecode::{Engine, EngineOptions, KvDtype, ModelWeights, SequenceCache, SplitMix64};

/// `calls` appends of the given widths under a random mask per row (`interior`: padding may sit
/// between real tokens; else only before the first and after the last real token).
fn random_masks(w: &ModelWeights, seed: u64, widths: &[usize], interior: bool) {
    let (batch, total): (usize, usize) = (3, widths.iter().sum());
    let v = w.cfg.vocab;
    let mut rng = SplitMix64(seed);
    let ids: Vec<Vec<u32>> = (0..batch).map(|_| (0..total).map(|_| rng.below(v) as u32).collect()).collect();
    let mask: Vec<Vec<bool>> = (0..batch)
        .map(|b| {
            if interior {
                (0..total).map(|p| p == 0 && b == 0 || rng.below(3) > 0).collect()
            } else {
                let (lead, trail) = (rng.below(total / 2), rng.below(4));
                (0..total).map(|p| p >= lead && p + trail < total).collect()
            }
        })
        .collect();
    let gpu = gpu();
    let mut e = Engine::new(&gpu, w, EngineOptions::new(4, total + 4)).unwrap();
    // rows 2, 0, 3: any set of cache rows
    let mut seq = SequenceCache::new(&mut e, &[2, 0, 3], KvDtype::F32).unwrap();
    let mut worst = 0f32;
    let mut at = 0;
    for &t in widths {
        let chunk: Vec<u32> = (0..batch).flat_map(|b| ids[b][at..at + t].to_vec()).collect();
        let pm: Vec<bool> = (0..batch).flat_map(|b| mask[b][..at + t].to_vec()).collect();
        let got = seq.forward_masked(&mut e, &chunk, batch, t, &pm).unwrap();
        for b in 0..batch {
            let key_mask = &mask[b][..at + t];
            let want = reference::forward_with(
                w,
                &ids[b][..at + t],
                RefOptions { key_mask: Some(key_mask), ..Default::default() },
            )
            .unwrap();
            for j in 0..t {
                let g = &got[(b * t + j) * v..(b * t + j + 1) * v];
                if mask[b][at + j] {
                    let d = max_abs_diff(g, &want[(at + j) * v..(at + j + 1) * v]);
                    worst = worst.max(d);
                    assert!(d <= 1e-4, "seed {seed} row {b} position {}: {d}", at + j);
                } else {
                    assert!(g.iter().all(|&x| x == 0.0), "padding query logits must be zero");
                }
            }
        }
        at += t;
    }
    assert_eq!(seq.len(), total);
    for (b, &row) in [2usize, 0, 3].iter().enumerate() {
        let real = mask[b].iter().filter(|&&m| m).count();
        assert_eq!(e.cache().lens()[row], real, "row {row} stores only its real tokens");
        assert_eq!(e.cache().position(row), total, "row {row}: positions count the padding");
    }
    println!("seed {seed}: max |engine - seed rule| = {worst:e} over {total} positions x {batch} rows");
}

#[test]
fn random_masks_with_interior_padding_match_the_seed_rule() {
    let s = seed(81);
    let w = model(&llama_cfg(), s);
    for k in 0..4 {
        random_masks(&w, s + k, &[9, 1, 14, 1, 1, 6], true);
    }
}

#[test]
fn left_and_right_padding_on_sliding_window_models() {
    let s = seed(82);
    let w = model(&tiny_agent_cfg(), s); // window 5: the ring wraps
    for k in 0..3 {
        random_masks(&w, s + k, &[12, 1, 1, 9], false);
    }
}

#[test]
fn mask_errors_name_the_problem_and_change_nothing() {
    let gpu = gpu();
    let w = model(&llama_cfg(), 83);
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(2, 16)).unwrap();
    let mut seq = SequenceCache::new(&mut e, &[0, 1], KvDtype::F32).unwrap();
    seq.forward_masked(&mut e, &[1, 2, 3, 4, 5, 6], 2, 3, &[false, true, true, true, true, false]).unwrap();
    let lens = e.cache().lens().to_vec();
    let pos: Vec<usize> = (0..2).map(|r| e.cache().position(r)).collect();
    let err = |r: kvdecode::Result<Vec<f32>>| r.unwrap_err().to_string();
    // the seed's shape check, in its words
    let m = err(seq.forward_masked(&mut e, &[1, 2], 2, 1, &[true; 6]));
    assert!(m.contains("padding_mask covers 3 positions but the key length is 4 (offset 3 + q_len 1)"), "{m}");
    // a cached position cannot change
    let m = err(seq.forward_masked(&mut e, &[1, 2], 2, 1, &[true, true, true, true, true, true, true, true]));
    assert!(m.contains("row 0 marks position 0 as real") && m.contains("stored it as padding"), "{m}");
    // out of vocabulary (a real token); a padding token's id is never read
    let ok_mask = [false, true, true, true, true, true, false, true];
    let m = err(seq.forward_masked(&mut e, &[1, 96], 2, 1, &ok_mask));
    assert!(m.contains("row 1, token 0: id 96 is outside the vocabulary"), "{m}");
    // overflow, as the seed words it
    let m = err(seq.forward_masked(&mut e, &[1; 28], 2, 14, &[true; 34]));
    assert!(m.contains("KV cache overflow: 3 + 14 > max_len=16"), "{m}");
    assert_eq!(e.cache().lens(), &lens[..]);
    assert_eq!((0..2).map(|r| e.cache().position(r)).collect::<Vec<_>>(), pos);
    assert_eq!(seq.len(), 3);
    let pad_new = [false, true, true, false, true, true, false, true];
    seq.forward_masked(&mut e, &[96, 2], 2, 1, &pad_new).unwrap();
    assert_eq!(e.cache().lens(), &[2, 3]);

    // interior padding on a sliding-window model is refused, naming why
    let wl = model(&tiny_agent_cfg(), 84);
    let mut e = Engine::new(&gpu, &wl, EngineOptions::new(1, 16)).unwrap();
    let mut seq = SequenceCache::new(&mut e, &[0], KvDtype::F32).unwrap();
    let m = err(seq.forward_masked(&mut e, &[1, 2, 3], 1, 3, &[true, false, true]));
    assert!(m.contains("padding between real tokens") && m.contains("sliding-window"), "{m}");
    assert_eq!(e.cache().lens(), &[0]);
}

#[test]
fn rollback_drops_the_padding_it_goes_back_past() {
    let gpu = gpu();
    let w = model(&llama_cfg(), 85);
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(2, 32)).unwrap();
    // row 0: 4 tokens, 3 skipped positions, 2 tokens; rolled back by 2, it continues at position 7
    e.append(&[1, 2, 3, 4], 4, &[4], Some(&[0])).unwrap();
    e.skip(&[0], &[3]).unwrap();
    e.append(&[5, 6], 2, &[2], Some(&[0])).unwrap();
    assert_eq!(e.cache().position(0), 9);
    e.rollback(&[0], &[2]).unwrap();
    assert_eq!(e.cache().position(0), 7);
    let a = e.append(&[7], 1, &[1], Some(&[0])).unwrap();
    // row 1 built without the detour gives the same bits
    e.append(&[1, 2, 3, 4], 4, &[4], Some(&[1])).unwrap();
    e.skip(&[1], &[3]).unwrap();
    let b = e.append(&[7], 1, &[1], Some(&[1])).unwrap();
    assert_eq!(a.row(0).unwrap(), b.row(0).unwrap());
    // one more token back drops the skipped run: as if it never happened
    e.rollback(&[0], &[2]).unwrap();
    assert_eq!(e.cache().position(0), 3);
    // skipping past max_len is refused, naming the row
    let m = e.skip(&[1], &[30]).unwrap_err().to_string();
    assert!(m.contains("row 1"), "{m}");
}
