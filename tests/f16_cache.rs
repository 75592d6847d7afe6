//! f16 K/V storage: teacher-forced decoding keeps the reference's top-1 token at every position,
//! and logits stay within a stated tolerance (F16_TOL) of the f32 reference.

mod common;

use common::*;
use kvdecode::{argmax, reference, Engine, EngineOptions, KvDtype, ModelWeights, SplitMix64};

/// Absolute logit tolerance for f16 K/V storage (logits of magnitude ~5; f16 has 11 bits).
const F16_TOL: f32 = 5e-3;

fn teacher_forced(w: &ModelWeights, seed: u64) {
    let gpu = gpu();
    let opts = EngineOptions { kv: KvDtype::F16, ..EngineOptions::new(2, 96) };
    let mut e = Engine::new(&gpu, w, opts).unwrap();
    let mut rng = SplitMix64(seed);
    let v = w.cfg.vocab;
    let seqs: Vec<Vec<u32>> = (0..2).map(|_| (0..90).map(|_| rng.below(v) as u32).collect()).collect();
    let refs: Vec<Vec<f32>> = seqs.iter().map(|s| reference::forward(w, s).unwrap()).collect();
    // prefill 20 (row 0) and 7 (row 1), then one token per step on both rows
    let mut ids = vec![0u32; 2 * 20];
    ids[..20].copy_from_slice(&seqs[0][..20]);
    ids[20..27].copy_from_slice(&seqs[1][..7]);
    let mut out = e.append(&ids, 20, &[20, 7], None).unwrap();
    let mut pos = [19usize, 6];
    let (mut worst, mut top1_checked) = (0f32, 0);
    loop {
        for r in 0..2 {
            let got = out.row(r).unwrap();
            let want = &refs[r][pos[r] * v..(pos[r] + 1) * v];
            let diff = max_abs_diff(got, want);
            worst = worst.max(diff);
            assert!(diff <= F16_TOL, "seed {seed} row {r} pos {}: {diff}", pos[r]);
            // the same top-1 token at every position
            assert_eq!(argmax(got), argmax(want), "seed {seed} row {r} pos {}", pos[r]);
            top1_checked += 1;
        }
        if pos[0] + 1 >= 90 {
            break;
        }
        let next = [seqs[0][pos[0] + 1], seqs[1][pos[1] + 1]];
        out = e.append(&next, 1, &[1, 1], None).unwrap();
        pos = [pos[0] + 1, pos[1] + 1];
    }
    println!("f16 K/V: worst |gpu - ref| = {worst:e}, top-1 equal at all {top1_checked} positions");
}

#[test]
fn f16_cache_tiny_agent_teacher_forced() {
    let s = seed(31);
    teacher_forced(&model(&tiny_agent_cfg(), s), s);
}

#[test]
fn f16_cache_llama_teacher_forced() {
    let s = seed(32);
    teacher_forced(&model(&llama_cfg(), s), s);
}
