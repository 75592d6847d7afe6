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

#[test]
fn hf_llama_tiny_left_padded_batch() {
    let dir = fixture_dir();
    let w = kvdecode::hf::load_dir(&dir).unwrap();
    let ids = npy::read(dir.join("batch_input_ids.npy")).unwrap();
    let mask = npy::read(dir.join("batch_attention_mask.npy")).unwrap().to_u32().unwrap();
    let want = npy::read(dir.join("batch_logits.npy")).unwrap().to_f32();
    let gen = npy::read(dir.join("batch_generate_ids.npy")).unwrap().to_u32().unwrap();
    let (b, t) = (ids.shape[0], ids.shape[1]);
    let ids = ids.to_u32().unwrap();
    let v = w.cfg.vocab;
    let pad_lens: Vec<usize> = (0..b).map(|r| mask[r * t..(r + 1) * t].iter().filter(|&&m| m == 0).count()).collect();
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(4, 80)).unwrap();
    // rows 3, 0, 1 on purpose: the batch is any set of cache rows
    let rows = [3usize, 0, 1];
    let mut batch = kvdecode::PaddedBatch::new(&mut engine, &rows, &pad_lens).unwrap();
    let got = batch.forward(&mut engine, &ids, t).unwrap();
    let mut worst = 0f32;
    for r in 0..b {
        for p in 0..t {
            let at = (r * t + p) * v;
            if mask[r * t + p] == 1 {
                worst = worst.max(max_abs_diff(&got[at..at + v], &want[at..at + v]));
            } else {
                assert!(got[at..at + v].iter().all(|&x| x == 0.0), "pad query logits must be zero (finite)");
            }
        }
    }
    println!("batch_logits (mask == 1): max |ours - hf| = {worst:e}");
    assert!(worst <= 1e-4, "batch_logits: {worst}");

    // batched greedy generation, 20 tokens
    let mut batch = kvdecode::PaddedBatch::new(&mut engine, &rows, &pad_lens).unwrap();
    let seqs = batch.generate_greedy(&mut engine, &ids, t, 20).unwrap();
    for r in 0..b {
        assert_eq!(seqs[r], gen[r * 67..(r + 1) * 67].to_vec(), "batch_generate_ids row {r}");
    }
}

#[test]
fn sequence_cache_guards() {
    let w = kvdecode::hf::load_dir(fixture_dir()).unwrap();
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(2, 12)).unwrap();
    let err = kvdecode::SequenceCache::new(&mut engine, &[0, 1], kvdecode::KvDtype::F16).err().unwrap();
    assert!(format!("{err}").contains("cache dtype F32 != requested dtype F16"), "{err}");
    let mut seq = kvdecode::SequenceCache::new(&mut engine, &[0, 1], kvdecode::KvDtype::F32).unwrap();
    seq.forward(&mut engine, &[1, 2, 3, 4, 5, 6, 7, 8], 2, 4).unwrap();
    let err = seq.forward(&mut engine, &[1, 2, 3], 3, 1).unwrap_err();
    assert!(format!("{err}").contains("batch 3 does not match cache batch 2"), "{err}");
    let err = seq.forward(&mut engine, &[1; 18], 2, 9).unwrap_err();
    assert!(format!("{err}").contains("KV cache overflow: 4 + 9 > max_len=12"), "{err}");
    assert_eq!(seq.len(), 4);
    assert_eq!(engine.cache().lens(), &[4, 4]);
    // and it decodes on correctly
    let out = seq.forward(&mut engine, &[9, 10], 2, 1).unwrap();
    let want = ref_last(&w, &[1, 2, 3, 4, 9]);
    assert!(max_abs_diff(out.row(0).unwrap(), &want) <= 1e-4);
}
