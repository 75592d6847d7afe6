//! Bad input is a clear error and changes nothing; rows are independent; padding only ever lands
//! in the scratch slot.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Error, ModelWeights};

fn engine(w: &ModelWeights, rows: usize, max_len: usize) -> Engine {
    // a mixture of experts keeps its routes, so a test can compare them too
    let record_routes = w.cfg.moe.is_some();
    Engine::new(&gpu(), w, EngineOptions { record_routes, ..EngineOptions::new(rows, max_len) }).unwrap()
}

/// Decode `more` on every row and compare with the reference over each row's history.
fn assert_rows_match_reference(e: &mut Engine, w: &ModelWeights, more: &[u32]) {
    let rows = e.cache().rows();
    let out = e.append(more, 1, &vec![1; rows], None).unwrap();
    for r in 0..rows {
        let want = ref_last(w, e.cache().history(r));
        let diff = max_abs_diff(out.row(r).unwrap(), &want);
        assert!(diff <= 1e-4, "row {r}: {diff}");
    }
}

#[test]
fn overflow_and_bad_input_change_nothing() {
    let w = model(&tiny_agent_cfg(), 21);
    let mut e = engine(&w, 3, 12);
    e.append(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, &[4, 2, 3], None).unwrap();
    let lens_before = e.cache().lens().to_vec();
    let hist_before: Vec<Vec<u32>> = (0..3).map(|r| e.cache().history(r).to_vec()).collect();

    // row 1 would overflow: 2 + 11 > 12, while rows 0 and 2 fit
    let ids: Vec<u32> = (0..33).map(|i| i % 90).collect();
    match e.append(&ids, 11, &[1, 11, 1], None) {
        Err(Error::CacheFull { row: 1, len: 2, n_new: 11, max_len: 12 }) => {}
        other => panic!("expected CacheFull for row 1, got {other:?}"),
    }
    let msg = format!("{}", e.append(&ids, 11, &[1, 11, 1], None).unwrap_err());
    assert!(msg.contains("row 1"), "{msg}");
    // out-of-vocabulary id in a real position
    let err = e.append(&[1, 2, 96, 3], 2, &[1, 2], Some(&[0, 2])).unwrap_err();
    assert!(format!("{err}").contains("id 96"), "{err}");
    // n_new > width
    let err = e.append(&[1, 2, 3], 1, &[1, 2, 1], None).unwrap_err();
    assert!(format!("{err}").contains("n_new 2 > width 1"), "{err}");
    // repeated and out-of-range rows
    let err = e.append(&[1, 2], 1, &[1, 1], Some(&[2, 2])).unwrap_err();
    assert!(format!("{err}").contains("row 2 appears twice"), "{err}");
    let err = e.append(&[1], 1, &[1], Some(&[3])).unwrap_err();
    assert!(format!("{err}").contains("out of range"), "{err}");
    let err = e.reset(&[5]).unwrap_err();
    assert!(format!("{err}").contains("out of range"), "{err}");
    // wrong ids length and n_new length
    assert!(e.append(&[1, 2], 1, &[1, 1, 1], None).is_err());
    assert!(e.append(&[1, 2, 3], 1, &[1, 1], None).is_err());

    assert_eq!(e.cache().lens(), &lens_before[..]);
    for (r, hist) in hist_before.iter().enumerate() {
        assert_eq!(e.cache().history(r), &hist[..]);
    }
    // decoding on gives exactly what the reference says for the untouched histories
    assert_rows_match_reference(&mut e, &w, &[7, 8, 9]);
}

#[test]
fn rows_are_independent_bitwise() {
    // row 0 decodes the same tokens in two engines; in the second, the other rows are reset,
    // prefilled, decoded and sub-batched around it. Row 0's logits must be bit-identical. The seed's
    // layout, and the newer families' switches (biases, NoPE, scaled RoPE, softcap; OLMo 2's norms).
    // Mixtures of experts: the other rows route to other experts.
    for cfg in [tiny_agent_cfg(), families_cfg(), olmo2_cfg()].into_iter().chain(moe_cfgs()) {
        rows_are_independent_bitwise_for(&model(&cfg, 22));
    }
}

fn rows_are_independent_bitwise_for(w: &kvdecode::ModelWeights) {
    let seq: Vec<u32> = (0..20).map(|i| (i * 13 + 5) % 96).collect();
    let mut alone = engine(w, 1, 32);
    let mut busy = engine(w, 4, 32);
    let a = alone.append(&seq[..9], 9, &[9], None).unwrap();
    let mut ids = vec![0u32; 4 * 12];
    ids[..9].copy_from_slice(&seq[..9]);
    for (i, v) in ids.iter_mut().enumerate().skip(12) {
        *v = (i * 7 % 96) as u32;
    }
    let b = busy.append(&ids, 12, &[9, 12, 3, 0], None).unwrap();
    assert_eq!(a.row(0).unwrap(), b.row(0).unwrap(), "prefill");
    for (step, &t) in seq[9..].iter().enumerate() {
        let a = alone.append(&[t], 1, &[1], None).unwrap();
        if step % 3 == 0 {
            busy.reset(&[2]).unwrap();
            busy.append(&[1, 2, 3, 4, 5, 6], 3, &[3, 2], Some(&[2, 3])).unwrap();
        }
        let b = if step % 2 == 0 {
            busy.append(&[t, 4, 5, 6], 1, &[1, 1, 1, 1], None).unwrap()
        } else {
            busy.append(&[9, t], 1, &[1, 1], Some(&[3, 0])).unwrap()
        };
        let r0 = if step % 2 == 0 { 0 } else { 1 };
        assert_eq!(a.row(0).unwrap(), b.row(r0).unwrap(), "step {step}");
    }
    // a mixture of experts: row 0's experts at every position too, whatever the others picked
    if w.cfg.moe.is_some() {
        assert_eq!(alone.routes(0).unwrap(), busy.routes(0).unwrap(), "routes");
    }
}

#[test]
fn padding_lands_in_the_scratch_slot_only() {
    let w = model(&llama_cfg(), 23);
    let mut e = engine(&w, 2, 16);
    e.append(&[1, 2, 3, 4, 5, 6], 3, &[3, 3], None).unwrap();
    let (k0, v0) = e.debug_read_global(0).unwrap();
    // row 0 gets 1 real token and 3 padding tokens (the chunk is as wide as its longest row, 4),
    // row 1 gets 4 real tokens
    e.append(&[7, 50, 51, 52, 60, 61, 62, 63], 4, &[1, 4], None).unwrap();
    let (k1, v1) = e.debug_read_global(0).unwrap();
    let (hk, d, slots) = (2usize, 8usize, 17usize);
    let slot_bytes = d * 4;
    for (name, before, after) in [("K", &k0, &k1), ("V", &v0, &v1)] {
        for row in 0..2 {
            for h in 0..hk {
                for slot in 0..slots {
                    let at = ((row * hk + h) * slots + slot) * slot_bytes;
                    let same = before[at..at + slot_bytes] == after[at..at + slot_bytes];
                    // slot 16 shows the scratch block, which the rows of a pool shard share: the
                    // kv_write dispatch sends padding there, RoPE with the write fused skips it
                    if slot == 16 {
                        continue;
                    }
                    let expect_change = match row {
                        0 => slot == 3,
                        _ => (3..7).contains(&slot),
                    };
                    assert_eq!(!same, expect_change, "{name} row {row} head {h} slot {slot}: changed = {}", !same);
                }
            }
        }
    }
    // and the padding did not change the result: same logits as an unpadded append
    let mut e2 = engine(&w, 2, 16);
    e2.append(&[1, 2, 3, 4, 5, 6], 3, &[3, 3], None).unwrap();
    let a = e.append(&[8, 0], 1, &[1, 0], None).unwrap();
    let b = {
        e2.append(&[60, 61, 62, 63], 4, &[4], Some(&[1])).unwrap();
        e2.append(&[7], 1, &[1], Some(&[0])).unwrap();
        e2.append(&[8], 1, &[1], Some(&[0])).unwrap()
    };
    assert_eq!(a.row(0).unwrap(), b.row(0).unwrap());
}

#[test]
fn bad_samplers_windows_and_episodes_change_nothing() {
    use kvdecode::{Rollouts, Sampler};
    let w = model(&tiny_agent_cfg(), 22);
    let mut e = engine(&w, 2, 32);
    e.append(&[1, 2, 3, 4], 2, &[2, 2], None).unwrap();
    let lens = e.cache().lens().to_vec();
    let bad = [
        (Sampler::temperature(f32::NAN, 1), "temperature NaN is not finite"),
        (Sampler::temperature(f32::INFINITY, 1), "temperature inf is not finite"),
        (Sampler::GREEDY.with_top_p(0.0), "top_p 0 must be in (0, 1]"),
        (Sampler::GREEDY.with_top_p(1.5), "top_p 1.5 must be in (0, 1]"),
        (Sampler::GREEDY.with_top_p(f32::NAN), "top_p NaN must be in (0, 1]"),
    ];
    for (s, want) in bad {
        let m = e.append_sample(&[5], 1, &[1], Some(&[1]), &[s]).unwrap_err().to_string();
        assert!(m.contains(want), "{m}");
        let m = e.decode_steps(&[0], &[5], &[s], 2).unwrap_err().to_string();
        assert!(m.contains(want), "{m}");
    }
    // multi-step windows: 1..=rollback + 1 steps
    let m = e.decode_steps(&[0], &[5], &[Sampler::GREEDY], 0).unwrap_err().to_string();
    assert!(m.contains("steps 0 must be in 1..=9"), "{m}");
    let m = e.decode_steps(&[0], &[5], &[Sampler::GREEDY], 10).unwrap_err().to_string();
    assert!(m.contains("steps 10 must be in 1..=9"), "{m}");
    // episodes: an empty prompt, an id outside the vocabulary, a bad sampler; rows keep their state
    let mut eps = Rollouts::new(&e);
    let m = eps.start(&mut e, &[0], &[vec![]], &[Sampler::GREEDY], None).unwrap_err().to_string();
    assert!(m.contains("prompt 0 (row 0) is empty"), "{m}");
    let m = eps.start(&mut e, &[0, 1], &[vec![1], vec![1, 500]], &[Sampler::GREEDY; 2], None).unwrap_err().to_string();
    assert!(m.contains("prompt 1 (row 1): id 500 is outside the vocabulary"), "{m}");
    let m = eps.start(&mut e, &[1], &[vec![1; 40]], &[Sampler::GREEDY], None).unwrap_err().to_string();
    assert!(m.contains("40 tokens, more than max_len 32"), "{m}");
    let m = eps.start(&mut e, &[1], &[vec![1]], &[Sampler::GREEDY.with_top_p(2.0)], None).unwrap_err().to_string();
    assert!(m.contains("top_p 2 must be in (0, 1]"), "{m}");
    assert_eq!(e.cache().lens(), &lens[..]);
    assert_rows_match_reference(&mut e, &w, &[7, 8]);
}
