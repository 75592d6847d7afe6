//! Against outputs of an independent implementation: Hugging Face transformers on a tiny random
//! Llama (`../shared/fixtures/hf-llama-tiny`).

mod common;

use std::path::PathBuf;

use common::*;
use kvdecode::{npy, reference, Engine, EngineOptions};

fn fixture_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/hf-llama-tiny");
    assert!(d.exists(), "fixture directory {} is missing", d.display());
    d
}

#[test]
fn hf_llama_tiny_logits_full_and_incremental() {
    let dir = fixture_dir();
    let w = kvdecode::hf::load_dir(&dir).expect("load HF Llama directory");
    let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
    assert_eq!(tokens.len(), 80);
    let v = w.cfg.vocab;
    let full = npy::read(dir.join("logits_full.npy")).unwrap().to_f32();
    let incr = npy::read(dir.join("logits_incremental.npy")).unwrap().to_f32();

    // the CPU reference against transformers' full forward
    let ours = reference::forward(&w, &tokens).unwrap();
    let d_ref = max_abs_diff(&ours, &full);
    println!("reference vs logits_full: {d_ref:e}");
    assert!(d_ref <= 1e-4, "reference vs logits_full: {d_ref}");

    // the GPU engine: every position, first as one 80-token append (CHUNK splits it), keeping
    // only the last logits, then teacher-forced: prefill 30, then 50 single-token steps
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(1, 96)).unwrap();
    let out = engine.append(&tokens, 80, &[80], None).unwrap();
    let d_last = max_abs_diff(out.row(0).unwrap(), &full[79 * v..]);
    assert!(d_last <= 1e-4, "80-token append vs logits_full[79]: {d_last}");

    engine.reset(&[0]).unwrap();
    let mut worst_full = 0f32;
    let mut worst_incr = 0f32;
    let first = engine.append(&tokens[..30], 30, &[30], None).unwrap();
    let mut check = |pos: usize, got: &[f32]| {
        worst_full = worst_full.max(max_abs_diff(got, &full[pos * v..(pos + 1) * v]));
        worst_incr = worst_incr.max(max_abs_diff(got, &incr[pos * v..(pos + 1) * v]));
    };
    check(29, first.row(0).unwrap());
    for (pos, &t) in tokens.iter().enumerate().skip(30) {
        let out = engine.append(&[t], 1, &[1], None).unwrap();
        check(pos, out.row(0).unwrap());
    }
    println!("engine vs logits_full: {worst_full:e}, vs logits_incremental: {worst_incr:e}");
    assert!(worst_full <= 1e-4, "engine vs logits_full: {worst_full}");
    assert!(worst_incr <= 1e-4, "engine vs logits_incremental: {worst_incr}");
}

#[test]
fn hf_llama_tiny_greedy_generation() {
    let dir = fixture_dir();
    let w = kvdecode::hf::load_dir(&dir).unwrap();
    let ids = npy::read(dir.join("generate_b1_ids.npy")).unwrap().to_u32().unwrap();
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(1, 64)).unwrap();
    let mut next = engine.append_sample(&ids[..30], 30, &[30], None, &[kvdecode::Sampler::GREEDY]).unwrap()[0].unwrap();
    let mut got = Vec::new();
    for _ in 0..20 {
        got.push(next);
        next = engine.append_sample(&[next], 1, &[1], None, &[kvdecode::Sampler::GREEDY]).unwrap()[0].unwrap();
    }
    assert_eq!(got, ids[30..].to_vec(), "greedy tokens differ from transformers' generate");
}
