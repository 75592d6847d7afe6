//! Against outputs of independent implementations, committed under `tests/fixtures/` and made by
//! `scripts/fixtures/make.sh`:
//! - `hf/{family}`: Hugging Face transformers on tiny random models of each family (full and
//!   incremental logits, greedy generation, a left-padded batch): Llama, Qwen3 and Gemma 3 over 48
//!   positions; Qwen2 (biases, YaRN), Llama 3.1's RoPE scaling, Mistral (every layer slides over
//!   40 keys), SmolLM3 (a NoPE layer, linear RoPE scaling), Gemma 2 (attention softcap, sliding
//!   and global layers alternating), OLMo 2 (output norms, whole-projection qk-norm) and Phi-3
//!   (fused tensors, LongRoPE, partial rotary, every layer sliding) over 300, past the scaled
//!   RoPE's original context of 128 and seven times round the window; and the mixtures of experts
//!   Qwen3-MoE (a dense layer among sparse ones, top-k renormalized), OLMoE (top-k as the softmax
//!   weighs it, whole-projection qk-norm), Mixtral (every layer slides), Qwen2-MoE (a shared
//!   expert, q/k/v biases) and gpt-oss (sinks, biases, the clamped SwiGLU, fused transposed
//!   experts, YaRN) over 300, with the experts transformers routed every token to; and gpt-oss
//!   with MXFP4 experts as OpenAI ships them (`gpt_oss_mxfp4`);
//! - `seed-tinyagent`: the TinyAgent layout with Engram (`cid_map[0] != 0`) under a random schedule
//!   of ragged appends, sub-batches and resets, by full recomputation in PyTorch (the seed's own
//!   `append` agrees with it to about 2e-6; see the fixture's meta.json).

mod common;

use std::path::PathBuf;

use common::*;
use kvdecode::{io::npy, model::reference, Engine, EngineOptions, ModelWeights};

const FAMILIES: [&str; 15] = [
    "llama",
    "qwen3",
    "gemma3",
    "qwen2",
    "llama3",
    "mistral",
    "smollm3",
    "gemma2",
    "olmo2",
    "phi3",
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
];

/// Cache positions for a fixture's longest sequence.
fn max_len(tokens: usize) -> usize {
    tokens.next_multiple_of(16).max(64)
}

fn fixture_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    assert!(d.exists(), "fixture directory {} is missing (scripts/fixtures/make.sh makes it)", d.display());
    d
}

fn load(family: &str) -> (PathBuf, ModelWeights) {
    let dir = fixture_dir(&format!("hf/{family}"));
    let w = kvdecode::io::hf::load_dir(&dir).unwrap_or_else(|e| panic!("load HF {family} directory: {e}"));
    (dir, w)
}

fn logits_full_and_incremental(family: &str) {
    let (dir, w) = load(family);
    let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
    let n = tokens.len();
    let v = w.cfg.vocab;
    let full = npy::read(dir.join("logits_full.npy")).unwrap().to_f32();
    let incr = npy::read(dir.join("logits_incremental.npy")).unwrap().to_f32();

    // the CPU reference against transformers' full forward, and its routes against transformers'
    let (ours, routes) = reference::forward_routed(&w, &tokens, Default::default()).unwrap();
    let d_ref = max_abs_diff(&ours, &full);
    println!("{family}: reference vs logits_full: {d_ref:e}");
    assert!(d_ref <= 1e-4, "{family}: reference vs logits_full: {d_ref}");
    if w.cfg.moe.is_some() {
        let want = npy::read(dir.join("routes.npy")).unwrap().to_u32().unwrap();
        assert_eq!(routes, want, "{family}: the reference's routes differ from transformers'");
    }

    // the GPU engine, streamed from the directory's files as applications load it
    // (`Engine::from_file`), against transformers: all tokens as one append (last logits), then
    // teacher-forced: prefill 16,
    // single-token steps up to SINGLE_STEPS_UNTIL (the decode kernels, past every fixture's
    // 40-key window so the ring wraps), then the rest in appends of 16 with every position's
    // logits (the prefill kernels over the long context: RoPE scaling past its original 128).
    // Every position is checked against both of transformers' outputs. One token at a time all
    // the way would check nothing more: a step's bits do not depend on how the tokens before it
    // were chunked (tests/rollback_fork.rs `chunking_does_not_change_a_single_bit`,
    // tests/attention_variants.rs `query_tiles_give_the_bits_of_one_token_at_a_time`).
    const SINGLE_STEPS_UNTIL: usize = 48;
    let gpu = gpu();
    let moe = w.cfg.moe.is_some();
    let opts = EngineOptions { record_routes: moe, ..EngineOptions::new(1, max_len(n)) };
    let file = kvdecode::io::model_file::ModelFile::open(&dir).unwrap();
    let mut engine = Engine::from_file(&gpu, &file, opts).unwrap();
    let out = engine.append(&tokens, n, &[n], None).unwrap();
    let d_last = max_abs_diff(out.row(0).unwrap(), &full[(n - 1) * v..]);
    assert!(d_last <= 1e-4, "{family}: {n}-token append vs logits_full[{}]: {d_last}", n - 1);
    // the experts of every token and MoE layer, as transformers' routers chose them
    let routes_want = moe.then(|| npy::read(dir.join("routes.npy")).unwrap().to_u32().unwrap());
    if let Some(want) = &routes_want {
        assert_eq!(&engine.routes(0).unwrap(), want, "{family}: routes of one {n}-token append");
    }

    engine.reset(&[0]).unwrap();
    let (mut worst_full, mut worst_incr) = (0f32, 0f32);
    let first = engine.append(&tokens[..16], 16, &[16], None).unwrap();
    let mut check = |pos: usize, got: &[f32]| {
        worst_full = worst_full.max(max_abs_diff(got, &full[pos * v..(pos + 1) * v]));
        worst_incr = worst_incr.max(max_abs_diff(got, &incr[pos * v..(pos + 1) * v]));
    };
    check(15, first.row(0).unwrap());
    for (pos, &t) in tokens.iter().enumerate().take(SINGLE_STEPS_UNTIL).skip(16) {
        let out = engine.append(&[t], 1, &[1], None).unwrap();
        check(pos, out.row(0).unwrap());
    }
    for start in (SINGLE_STEPS_UNTIL.min(n)..n).step_by(16) {
        let chunk = &tokens[start..(start + 16).min(n)];
        let rows = engine.append_all_logits(chunk, chunk.len(), &[chunk.len()], None).unwrap();
        for (i, got) in rows[0].iter().enumerate() {
            check(start + i, got);
        }
    }
    if let Some(want) = &routes_want {
        assert_eq!(&engine.routes(0).unwrap(), want, "{family}: routes token by token and in chunks");
        // the fixture's nearest tie: the smallest gap between a token's k-th and (k+1)-th router
        // logit, far above the engine's differences from transformers (a few 1e-6)
        let (k, logits) = (w.cfg.moe.as_ref().unwrap().top_k, npy::read(dir.join("router_logits.npy")).unwrap());
        let experts = *logits.shape.last().unwrap();
        let margin = logits
            .to_f32()
            .chunks(experts)
            .map(|l| {
                let mut l = l.to_vec();
                l.sort_by(|a, b| b.total_cmp(a));
                l[k - 1] - l[k]
            })
            .fold(f32::INFINITY, f32::min);
        println!(
            "{family}: routes equal transformers' at {} (token, layer) decisions; nearest tie {margin:e}",
            want.len() / k
        );
        assert!(margin > 1e-4, "{family}: the fixture's routers have a near-tie ({margin}): a flip would be noise");
    }
    println!("{family}: engine vs logits_full: {worst_full:e}, vs logits_incremental: {worst_incr:e}");
    assert!(worst_full <= 1e-4, "{family}: engine vs logits_full: {worst_full}");
    assert!(worst_incr <= 1e-4, "{family}: engine vs logits_incremental: {worst_incr}");
}

fn greedy_generation(family: &str) {
    let (dir, w) = load(family);
    let ids = npy::read(dir.join("generate_ids.npy")).unwrap().to_u32().unwrap();
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(1, max_len(ids.len()))).unwrap();
    let greedy = [kvdecode::Sampler::GREEDY];
    let mut next = engine.append_sample(&ids[..16], 16, &[16], None, &greedy).unwrap()[0].unwrap();
    let mut got = Vec::new();
    while 16 + got.len() < ids.len() {
        got.push(next);
        next = engine.append_sample(&[next], 1, &[1], None, &greedy).unwrap()[0].unwrap();
    }
    assert_eq!(got, ids[16..].to_vec(), "{family}: greedy tokens differ from transformers' generate");
}

fn left_padded_batch(family: &str) {
    let (dir, w) = load(family);
    let ids = npy::read(dir.join("batch_input_ids.npy")).unwrap();
    let mask = npy::read(dir.join("batch_attention_mask.npy")).unwrap().to_u32().unwrap();
    let want = npy::read(dir.join("batch_logits.npy")).unwrap().to_f32();
    let gen = npy::read(dir.join("batch_generate_ids.npy")).unwrap();
    let (b, t) = (ids.shape[0], ids.shape[1]);
    let gen_len = gen.shape[1];
    let (ids, gen) = (ids.to_u32().unwrap(), gen.to_u32().unwrap());
    let v = w.cfg.vocab;
    let pad_lens: Vec<usize> = (0..b).map(|r| mask[r * t..(r + 1) * t].iter().filter(|&&m| m == 0).count()).collect();
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(4, max_len(gen_len))).unwrap();
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
    println!("{family}: batch_logits (mask == 1): max |ours - hf| = {worst:e}");
    assert!(worst <= 1e-4, "{family}: batch_logits: {worst}");

    let mut batch = kvdecode::PaddedBatch::new(&mut engine, &rows, &pad_lens).unwrap();
    let seqs = batch.generate_greedy(&mut engine, &ids, t, gen_len - t).unwrap();
    for r in 0..b {
        assert_eq!(seqs[r], gen[r * gen_len..(r + 1) * gen_len].to_vec(), "{family}: batch_generate_ids row {r}");
    }
}

#[test]
fn hf_logits_full_and_incremental() {
    for f in FAMILIES {
        logits_full_and_incremental(f);
    }
}

/// gpt-oss as OpenAI ships it: the experts in MXFP4 `_blocks` and `_scales` (OpenAI's nibble order,
/// `[out, in]`), the rest f32, made by `make_mxfp4_fixtures.py` and run by transformers after its
/// own unpacking. The engine keeps the experts in MXFP4 blocks on the GPU and gives transformers'
/// logits and routes: the only test of that checkpoint layout.
#[test]
fn hf_gpt_oss_mxfp4_checkpoint() {
    let (dir, w) = load("gpt_oss_mxfp4");
    for (i, l) in w.layers.iter().enumerate() {
        for m in [&l.mlp_in, &l.mlp_out] {
            let kind = m.quant.as_ref().map(|q| q.kind);
            assert_eq!(kind, Some(kvdecode::model::quant::QuantKind::MXFP4), "layer {i}: experts kept in MXFP4");
        }
    }
    let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
    let want = npy::read(dir.join("logits_full.npy")).unwrap().to_f32();
    let n = tokens.len();
    let opts = EngineOptions { record_routes: true, ..EngineOptions::new(1, max_len(n)) };
    let mut engine = Engine::new(&gpu(), &w, opts).unwrap();
    let mut got = Vec::new();
    for chunk in tokens.chunks(16) {
        got.extend(engine.append_all_logits(chunk, chunk.len(), &[chunk.len()], None).unwrap().remove(0).concat());
    }
    let d = max_abs_diff(&got, &want);
    println!("gpt_oss_mxfp4: engine vs transformers over {n} positions: {d:e}");
    assert!(d <= 1e-4, "gpt_oss_mxfp4: engine vs transformers: {d}");
    let routes = npy::read(dir.join("routes.npy")).unwrap().to_u32().unwrap();
    assert_eq!(engine.routes(0).unwrap(), routes, "gpt_oss_mxfp4: routes");
}

#[test]
fn hf_greedy_generation() {
    for f in FAMILIES {
        greedy_generation(f);
    }
}

#[test]
fn hf_left_padded_batch() {
    for f in FAMILIES {
        left_padded_batch(f);
    }
}

#[test]
fn hf_trained_context_is_read() {
    for (f, want) in [("llama", 256), ("qwen3", 512), ("gemma3", 1024), ("qwen2", 512), ("llama3", 512)] {
        assert_eq!(load(f).1.cfg.context_len, Some(want), "{f}: max_position_embeddings");
    }
}

/// The TinyAgent + Engram schedule: every append's logits (rows that received tokens) within 1e-4
/// of PyTorch's full recomputation, f32 K/V. The model's `cid_map[0]` is not 0, so a row's first
/// positions use `cid_map[0]` for the ids before the row's start, as the seed does.
#[test]
fn seed_tinyagent_engram_schedule() {
    let dir = fixture_dir("seed-tinyagent");
    let w = ModelWeights::load_safetensors(dir.join("model.safetensors")).unwrap();
    let cid0 = w.cid_map.as_ref().expect("the fixture has a cid_map")[0];
    assert_ne!(cid0, 0, "the fixture must tell cid_map[0] from 0");
    let sched: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("schedule.json")).unwrap()).unwrap();
    let rows = sched["rows"].as_u64().unwrap() as usize;
    let max_len = sched["max_len"].as_u64().unwrap() as usize;
    let want = npy::read(dir.join("logits.npy")).unwrap().to_f32();
    let v = w.cfg.vocab;
    let gpu = gpu();
    let mut engine = Engine::new(&gpu, &w, EngineOptions::new(rows, max_len)).unwrap();
    let as_usize = |x: &serde_json::Value| x.as_u64().unwrap() as usize;
    let (mut worst, mut checked) = (0f32, 0);
    for (s, step) in sched["steps"].as_array().unwrap().iter().enumerate() {
        if let Some(reset) = step.get("reset") {
            let r: Vec<usize> = reset.as_array().unwrap().iter().map(as_usize).collect();
            engine.reset(&r).unwrap();
            continue;
        }
        let sub: Option<Vec<usize>> = step["rows"].as_array().map(|a| a.iter().map(as_usize).collect());
        let n_new: Vec<usize> = step["n_new"].as_array().unwrap().iter().map(as_usize).collect();
        let chunk: Vec<Vec<u32>> = step["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
            .collect();
        let width = chunk[0].len();
        let ids: Vec<u32> = chunk.concat();
        let out = engine.append(&ids, width, &n_new, sub.as_deref()).unwrap();
        let target: Vec<usize> = sub.clone().unwrap_or_else(|| (0..rows).collect());
        for (i, &r) in target.iter().enumerate() {
            if n_new[i] == 0 {
                continue;
            }
            let at = (s * rows + r) * v;
            let d = max_abs_diff(out.row(i).unwrap(), &want[at..at + v]);
            worst = worst.max(d);
            checked += 1;
            assert!(d <= 1e-4, "step {s} row {r}: |engine - fixture| = {d}");
        }
    }
    println!("seed-tinyagent: {checked} appended rows, max |engine - fixture| = {worst:e}");
    assert!(checked > 60);
}

#[test]
fn sequence_cache_guards() {
    let (_, w) = load("llama");
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
