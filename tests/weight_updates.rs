//! Weights pushed in between steps (`Engine::update_weights`): after an update and a recompute a
//! row holds, bit for bit, what a fresh engine built from the new weights holds; a subset writes
//! just what it names; a transformers trainer's fused MoE names reach their rows; a bad update
//! changes nothing; the prompt cache is flushed.

mod common;

use common::*;
use kvdecode::model::family::{tensors_of, Naming};
use kvdecode::model::quant::QuantKind;
use kvdecode::{
    Engine, EngineOptions, Event, HostTensor, InFlight, ModelConfig, ModelWeights, Request, Rollouts, Sampler,
    Scheduler, Sleep, SplitMix64, TurnLimit, WeightDtype,
};

/// The tensors of `w` under `naming`, as a trainer would hand them over (f32).
fn named(w: &ModelWeights, naming: Naming) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    tensors_of(w, naming).into_iter().map(|(t, v)| (t.name.clone(), t.file_shape(), v)).collect()
}

fn host(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<HostTensor<'_>> {
    tensors.iter().map(|(n, s, v)| HostTensor::f32(n.clone(), s, v)).collect()
}

/// Three rows: two prompts, the second forked into row 2, each then fed some tokens of its own.
fn fill(e: &mut Engine, rng: &mut SplitMix64, vocab: usize) -> Vec<Vec<u32>> {
    let mut seqs: Vec<Vec<u32>> = (0..2).map(|k| (0..19 + 11 * k).map(|_| rng.below(vocab) as u32).collect()).collect();
    let ids: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied().chain(std::iter::repeat(0)).take(30)).collect();
    e.feed(&ids, 30, &[19, 30], Some(&[0, 1])).unwrap();
    e.fork(1, &[2]).unwrap();
    seqs.push(seqs[1].clone());
    for (r, s) in seqs.iter_mut().enumerate() {
        let more: Vec<u32> = (0..3 + 2 * r).map(|_| rng.below(vocab) as u32).collect();
        e.feed(&more, more.len(), &[more.len()], Some(&[r])).unwrap();
        s.extend(more);
    }
    seqs
}

/// Each row's logits after one more token, every row in one step.
fn next_logits(e: &mut Engine, tokens: &[u32]) -> Vec<Vec<f32>> {
    let l = e.append(tokens, 1, &vec![1; tokens.len()], None).unwrap();
    (0..tokens.len()).map(|r| l.row(r).unwrap().to_vec()).collect()
}

/// A fresh engine of `w` fed `seqs` (row by row, whole).
fn fresh(w: &ModelWeights, opts: &EngineOptions, seqs: &[Vec<u32>]) -> Engine {
    let mut e = Engine::new(&gpu(), w, *opts).unwrap();
    for (r, s) in seqs.iter().enumerate() {
        e.feed(s, s.len(), &[s.len()], Some(&[r])).unwrap();
    }
    e
}

#[test]
fn an_update_and_a_recompute_give_the_bits_of_a_fresh_engine() {
    let s = seed(91);
    // (case, the engine's weights, the update's weights, what a fresh engine is built from,
    // the update's naming, the weights' dtype on the GPU)
    let llama = llama_cfg();
    let tiny = tiny_agent_cfg();
    let (l0, l1, t0, t1) = (model(&llama, s), model(&llama, s + 1), model(&tiny, s), model(&tiny, s + 1));
    let fam = families_cfg();
    let (f0, f1) = (model(&fam, s), model(&fam, s + 1));
    let phi3 = phi3_cfg();
    let (p0, p1) = (model(&phi3, s), model(&phi3, s + 1));
    let q4 = |w: &ModelWeights| w.quantized(QuantKind::Q4_1).unwrap();
    let [qwen_moe, olmoe, _, oss] = moe_cfgs();
    let (m0, m1, o0, o1) = (model(&qwen_moe, s), model(&qwen_moe, s + 1), model(&olmoe, s), model(&olmoe, s + 1));
    let (g0, g1) = (model(&oss, s), model(&oss, s + 1));
    let hf = Naming::HuggingFace("model.");
    let cases: Vec<(&str, ModelWeights, &ModelWeights, ModelWeights, Naming, WeightDtype)> = vec![
        ("llama f32, HF names", l0.clone(), &l1, l1.clone(), hf, WeightDtype::F32),
        ("llama f16, GGUF names", l0.clone(), &l1, l1.clone(), Naming::Gguf, WeightDtype::F16),
        // the engine quantizes the f32 values with the quantizer that made the fresh model
        ("llama Q4_1, HF names", q4(&l0), &l1, q4(&l1), hf, WeightDtype::F32),
        ("tiny agent (rings) f32, kvdecode names", t0, &t1, t1.clone(), Naming::Kvdecode, WeightDtype::F32),
        // q/k/v biases (fused beside q, and in the rings' K/V), a NoPE layer, scaled RoPE
        ("qwen2-style f16, HF names", f0, &f1, f1.clone(), hf, WeightDtype::F16),
        // q, k and v from one tensor, gate and up from another, q and k rows reordered for
        // partial rotary (the names' round trip in every naming: model::family's unit tests)
        ("phi3 Q4_1, GGUF names", q4(&p0), &p1, q4(&p1), Naming::Gguf, WeightDtype::F32),
        // each expert's tensors into the stacked experts' rows, the routers (kept f32)
        ("qwen3-moe Q4_1, HF names", q4(&m0), &m1, q4(&m1), hf, WeightDtype::F32),
        ("olmoe f16, kvdecode names", o0, &o1, o1.clone(), Naming::Kvdecode, WeightDtype::F16),
        // gpt-oss's experts as its files hold them (gate and up interleaved in one tensor, each
        // expert transposed), the biases of q/k/v/o, the router and the experts, the sinks
        ("gpt-oss Q4_1, HF names", q4(&g0), &g1, q4(&g1), hf, WeightDtype::F32),
    ];
    for (case, old, update, new, naming, dtype) in cases {
        let opts = EngineOptions { weights: dtype, prompt_cache: true, ..EngineOptions::new(3, 64) };
        let mut rng = SplitMix64(s);
        let mut e = Engine::new(&gpu(), &old, opts).unwrap();
        let seqs = fill(&mut e, &mut rng, old.cfg.vocab);
        let tensors = named(update, naming);
        let report = e.update_weights(&host(&tensors), InFlight::Recompute).unwrap();
        assert_eq!(report.version, 1, "{case}");
        assert_eq!(e.weights_version(), 1, "{case}");
        assert_eq!(report.rows, vec![0, 1, 2], "{case}");
        assert_eq!((0..3).map(|r| e.cache().history(r).to_vec()).collect::<Vec<_>>(), seqs, "{case}: histories kept");
        let next: Vec<u32> = (0..3).map(|_| rng.below(old.cfg.vocab) as u32).collect();
        let got = next_logits(&mut e, &next);
        let want = next_logits(&mut fresh(&new, &opts, &seqs), &next);
        assert_eq!(got, want, "{case}: logits after the recompute differ from a fresh engine's");
        // and they are the new weights' logits, not the old ones'
        assert_ne!(got, next_logits(&mut fresh(&old, &opts, &seqs), &next), "{case}");
    }
}

#[test]
fn a_subset_update_writes_just_what_it_names() {
    let s = seed(92);
    let cfg = llama_cfg();
    let (old, other) = (model(&cfg, s), model(&cfg, s + 7));
    // one tensor whose rows live inside fused matrices: layer 1's v rows of [q; k; v]
    let name = "model.layers.1.self_attn.v_proj.weight";
    let tensors: Vec<_> = named(&other, Naming::HuggingFace("model.")).into_iter().filter(|t| t.0 == name).collect();
    assert_eq!(tensors.len(), 1);
    let mut want = old.clone();
    let kvd = cfg.n_kv_heads * cfg.head_dim;
    let kv = want.layers[1].kv_global.as_mut().unwrap();
    let cols = kv.cols;
    kv.data[kvd * cols..].copy_from_slice(&tensors[0].2);
    let opts = EngineOptions::new(3, 64);
    let mut rng = SplitMix64(s);
    let mut e = Engine::new(&gpu(), &old, opts).unwrap();
    let seqs = fill(&mut e, &mut rng, cfg.vocab);
    e.update_weights(&host(&tensors), InFlight::Recompute).unwrap();
    let next = [5, 6, 7];
    assert_eq!(next_logits(&mut e, &next), next_logits(&mut fresh(&want, &opts, &seqs), &next));

    // a bias whose elements sit inside a fused bias: layer 0's k bias of [q; k; v] (GGUF name)
    let cfg = families_cfg();
    let (old, other) = (model(&cfg, s), model(&cfg, s + 7));
    let tensors: Vec<_> = named(&other, Naming::Gguf).into_iter().filter(|t| t.0 == "blk.0.attn_k.bias").collect();
    assert_eq!(tensors.len(), 1);
    let mut want = old.clone();
    let kvd = cfg.n_kv_heads * cfg.head_dim;
    want.layers[0].kv_bias.as_mut().unwrap()[..kvd].copy_from_slice(&other.layers[0].kv_bias.as_ref().unwrap()[..kvd]);
    let mut e = Engine::new(&gpu(), &old, opts).unwrap();
    let seqs = fill(&mut e, &mut SplitMix64(s), cfg.vocab);
    e.update_weights(&host(&tensors), InFlight::Recompute).unwrap();
    let got = next_logits(&mut e, &next);
    assert_eq!(got, next_logits(&mut fresh(&want, &opts, &seqs), &next));
    assert_ne!(got, next_logits(&mut fresh(&old, &opts, &seqs), &next), "the bias changed nothing");
}

/// One expert's down projection and one layer's router, by their Hugging Face names: a MoE engine
/// updated and recomputed holds the bits of a fresh engine of the old weights with just those
/// two tensors replaced.
#[test]
fn a_moe_update_of_one_expert_and_one_router() {
    use kvdecode::model::family::tensor_names;
    let s = seed(94);
    let cfg = moe_cfgs()[0].clone();
    let (old, other) = (model(&cfg, s), model(&cfg, s + 7));
    let hf = Naming::HuggingFace("model.");
    let picked = ["model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.2.mlp.gate.weight"];
    let tensors: Vec<_> = named(&other, hf).into_iter().filter(|t| picked.contains(&t.0.as_str())).collect();
    assert_eq!(tensors.len(), 2);
    // the old weights with those two tensors written over them on the host, through the same
    // name map by the loaders' host writer
    let mut want = old.clone();
    for (name, shape, values) in &tensors {
        let spec = tensor_names(&cfg, hf).into_iter().find(|t| &t.name == name).unwrap();
        for p in &spec.places {
            let t = HostTensor::f32(name.clone(), shape, values);
            want.write_place(p, kvdecode::model::config::NormKind::Weight, &t).unwrap();
        }
    }
    assert_ne!(want, old);
    let opts = EngineOptions::new(3, 64);
    let mut e = Engine::new(&gpu(), &old, opts).unwrap();
    let seqs = fill(&mut e, &mut SplitMix64(s), cfg.vocab);
    e.update_weights(&host(&tensors), InFlight::Recompute).unwrap();
    let next = [5, 6, 7];
    let got = next_logits(&mut e, &next);
    assert_eq!(got, next_logits(&mut fresh(&want, &opts, &seqs), &next));
    assert_ne!(got, next_logits(&mut fresh(&old, &opts, &seqs), &next), "the update changed nothing");
}

/// A transformers 5 trainer's push to a mixture of experts, named as its `state_dict()` names it:
/// each MoE layer's experts fused in `mlp.experts.gate_up_proj` `[E, 2F, d]` and `down_proj`
/// `[E, d, F]`, Mixtral's router as `mlp.gate.weight` (tests/fixtures/trainer-update: new experts
/// and routers drawn in transformers, its logits and routes after them). The engine of each
/// family's checkpoint, updated from that file, gives transformers' logits and routes. The only
/// test of those names and of 3-D tensors taken as their stacked rows: a gate/up split or an
/// expert order other than transformers' moves logits by about their size.
#[test]
fn a_transformers_trainer_push_of_fused_experts_gives_its_logits() {
    use kvdecode::io::npy;
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let gpu = gpu();
    for family in ["qwen3_moe", "mixtral"] {
        let (model_dir, dir) = (root.join("hf").join(family), root.join("trainer-update").join(family));
        let w = kvdecode::io::hf::load_dir(&model_dir).unwrap();
        let want = npy::read(dir.join("logits.npy")).unwrap();
        let n = want.shape[0];
        let (want, routes) = (want.to_f32(), npy::read(dir.join("routes.npy")).unwrap().to_u32().unwrap());
        let tokens = &npy::read(model_dir.join("tokens.npy")).unwrap().to_u32().unwrap()[..n];
        let mut e = Engine::new(&gpu, &w, EngineOptions { record_routes: true, ..EngineOptions::new(1, 64) }).unwrap();
        let logits = |e: &mut Engine| -> Vec<f32> {
            e.reset(&[0]).unwrap();
            let chunks = tokens.chunks(16).map(|c| e.append_all_logits(c, c.len(), &[c.len()], None).unwrap());
            chunks.flat_map(|rows| rows.into_iter().next().unwrap()).flatten().collect()
        };
        let before = logits(&mut e);
        let u = e.update_weights_from_path(dir.join("update.safetensors"), InFlight::Keep).unwrap();
        let got = logits(&mut e);
        let (d, moved) = (max_abs_diff(&got, &want), max_abs_diff(&before, &want));
        println!("{family}: {} tensors pushed; engine vs transformers {d:e} (before the push {moved:e})", u.tensors);
        assert_eq!(u.tensors, 6, "{family}");
        assert!(d <= 1e-4, "{family}: updated engine vs transformers' updated model: {d}");
        assert!(moved > 0.1, "{family}: the push moved the logits by only {moved}");
        assert_eq!(e.routes(0).unwrap(), routes, "{family}: routes after the push");
    }
}

#[test]
fn a_bad_update_is_named_and_changes_nothing() {
    let s = seed(93);
    let cfg = llama_cfg();
    let (old, new) = (model(&cfg, s), model(&cfg, s + 1));
    let opts = EngineOptions { prompt_cache: true, ..EngineOptions::new(3, 64) };
    let mut rng = SplitMix64(s);
    let mut e = Engine::new(&gpu(), &old, opts).unwrap();
    let seqs = fill(&mut e, &mut rng, cfg.vocab);
    let good = named(&new, Naming::HuggingFace("model."));
    let other_model =
        named(&model(&ModelConfig::llama(96, 48, 4, 2, 12, 64, 3, 1e4, 1e-6, false), s), Naming::HuggingFace("model."));
    let wider = named(&model(&ModelConfig { vocab: 97, ..cfg.clone() }, s), Naming::HuggingFace("model."));
    let mut nan = good.clone();
    nan[5].2[3] = f32::NAN;
    let mut inf = good.clone();
    inf[2].2[0] = f32::INFINITY;
    let twice = [good[3].clone(), good[3].clone()];
    let gguf_embed = [named(&new, Naming::Gguf)[0].clone()];
    let f16_bytes: Vec<u8> = good[1].2.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
    let bad: Vec<(&str, Vec<HostTensor>, &str)> = vec![
        (
            "unknown name",
            vec![HostTensor::f32("model.layers.9.self_attn.q_proj.weight", &[64, 32], &good[1].2)],
            "not a weight",
        ),
        ("a tensor from another model", host(&other_model), "shape"),
        ("a wider vocabulary", host(&wider), "shape"),
        ("a NaN", host(&nan), "not finite"),
        ("an infinity", host(&inf), "not finite"),
        ("bytes of the wrong length", vec![HostTensor { bytes: &f16_bytes, ..host(&good)[1].clone() }], "bytes"),
        ("a name twice", host(&twice), "twice"),
        ("two names for the same rows", host(&gguf_embed), "both fill"),
    ];
    for (case, tensors, says) in bad {
        // the good tensors first: nothing of them may be written either
        let mut all = host(&good);
        all.retain(|t| !tensors.iter().any(|b| b.name == t.name));
        all.extend(tensors);
        let err = e.update_weights(&all, InFlight::Recompute).unwrap_err().to_string();
        assert!(err.contains(says), "{case}: {err}");
        assert_eq!(e.weights_version(), 0, "{case}");
    }
    // untouched: the same bits as a fresh engine of the old weights, and the prompt cache kept
    let next = [1, 2, 3];
    assert_eq!(next_logits(&mut e, &next), next_logits(&mut fresh(&old, &opts, &seqs), &next));
    assert!(e.cache().block_usage().cached > 0);
}

#[test]
fn an_update_flushes_the_prompt_cache_and_keep_or_reset_decide_the_rows() {
    let s = seed(94);
    let cfg = llama_cfg();
    let (old, new) = (model(&cfg, s), model(&cfg, s + 1));
    let opts = EngineOptions { prompt_cache: true, block_len: 8, ..EngineOptions::new(3, 64) };
    let mut rng = SplitMix64(s);
    let prompt: Vec<u32> = (0..40).map(|_| rng.below(cfg.vocab) as u32).collect();
    let mut e = Engine::new(&gpu(), &old, opts).unwrap();
    e.feed(&prompt, 40, &[40], Some(&[0])).unwrap();
    assert_eq!(e.reuse_prefix(1, &prompt).unwrap(), 32, "the prompt's full blocks are cached");
    e.reset(&[1]).unwrap();
    e.update_weights(&host(&named(&new, Naming::HuggingFace("model."))), InFlight::Keep).unwrap();
    assert_eq!(e.cache().block_usage().cached, 0, "flushed");
    assert_eq!(e.reuse_prefix(1, &prompt).unwrap(), 0, "old K/V is never reused");
    // row 0 kept its K/V (of the old weights): it goes on, and never enters the prompt cache
    assert_eq!(e.cache().history(0), &prompt[..]);
    e.feed(&prompt[..16], 16, &[16], Some(&[0])).unwrap();
    assert_eq!(e.cache().block_usage().cached, 0, "a kept row registers nothing");
    // new K/V is cached again, and reusing it gives a fresh engine's bits
    e.feed(&prompt, 40, &[40], Some(&[2])).unwrap();
    e.reset(&[1]).unwrap();
    assert_eq!(e.reuse_prefix(1, &prompt).unwrap(), 32);
    e.feed(&prompt[32..39], 7, &[7], Some(&[1])).unwrap();
    let got = e.append(&prompt[39..], 1, &[1], Some(&[1])).unwrap().row(0).unwrap().to_vec();
    let mut f = fresh(&new, &opts, &[prompt[..39].to_vec()]);
    assert_eq!(got, f.append(&prompt[39..], 1, &[1], Some(&[0])).unwrap().row(0).unwrap());
    // reset empties every row that held tokens
    let report = e.update_weights(&host(&named(&old, Naming::HuggingFace("model."))), InFlight::Reset).unwrap();
    assert_eq!((report.version, report.rows), (2, vec![0, 1, 2]));
    assert!((0..3).all(|r| e.cache().lens()[r] == 0));
}

#[test]
fn every_sampled_token_reports_its_weights_version() {
    let s = seed(95);
    let cfg = llama_cfg();
    let (w0, w1) = (model(&cfg, s), model(&cfg, s + 1));
    let update = named(&w1, Naming::HuggingFace("model."));
    let mut e = Engine::new(&gpu(), &w0, EngineOptions::new(3, 64)).unwrap();
    let hot = Sampler { temperature: 1.0, seed: 3, ..Sampler::GREEDY };
    // turns (engine and rollouts)
    e.feed(&[1, 2, 3], 3, &[3], Some(&[0])).unwrap();
    let limits = [TurnLimit { max_new: 4, stop: vec![] }];
    let t = e.decode_turns(&[0], &[4], &[hot], &limits, 2, &|_, _| false).unwrap();
    assert_eq!(t[0].weights_version, 0);
    e.update_weights(&host(&update), InFlight::Keep).unwrap();
    let t = e.decode_turns(&[0], &[5], &[hot], &limits, 2, &|_, _| false).unwrap();
    assert_eq!((t[0].tokens.len(), t[0].weights_version), (4, 1));
    e.reset(&[0]).unwrap();
    let mut ro = Rollouts::new(&e);
    ro.start(&mut e, &[1], &[vec![7, 8, 9]], &[hot], None).unwrap();
    let t = ro.decode_turn(&mut e, &[1], &limits, 2).unwrap();
    assert_eq!(t[0].weights_version, 1);
    ro.finish(&mut e, 1).unwrap();
    // a scheduled request in flight across an update kept with `keep`: its tokens before it say
    // 1, after it 2, in the stream and in the completion
    let mut sched = Scheduler::new(&e, 8);
    sched.submit(Request { tokens: vec![3, 4, 5], max_new: 6, sampler: hot, ..Request::default() }).unwrap();
    let mut streamed = Vec::new();
    let mut done = Vec::new();
    let mut on = |ev: Event| match ev {
        Event::Token { weights_version, .. } => streamed.push(weights_version),
        Event::Done(c) => done.push(c.clone()),
    };
    for _ in 0..3 {
        sched.step(&mut e, &mut on).unwrap();
    }
    e.update_weights(&host(&named(&w0, Naming::HuggingFace("model."))), InFlight::Keep).unwrap();
    sched.run(&mut e, &mut on).unwrap();
    let c = &done[0];
    assert_eq!(c.weights_versions, streamed);
    assert_eq!(c.weights_versions.len(), c.tokens.len());
    assert!(c.weights_versions.contains(&1) && c.weights_versions.contains(&2), "{:?}", c.weights_versions);
    assert!(c.weights_versions.windows(2).all(|v| v[0] <= v[1]));
}

#[test]
fn sleep_and_wake_are_exact_and_give_the_memory_back() {
    let s = seed(96);
    // a device of its own: the allocator's report covers every engine on the device
    let gpu = own_gpu();
    // (the newer families' biases are buffers of their own, released and restored too)
    for cfg in [llama_cfg(), tiny_agent_cfg(), families_cfg()] {
        let w = model(&cfg, s);
        for what in [Sleep { weights: true, kv: false }, Sleep { weights: false, kv: true }, Sleep::ALL] {
            let opts = EngineOptions::new(3, 64);
            let mut rng = SplitMix64(s);
            let mut e = Engine::new(&gpu, &w, opts).unwrap();
            let seqs = fill(&mut e, &mut rng, cfg.vocab);
            let mut twin = fresh(&w, &opts, &seqs);
            let before = e.memory_report();
            e.sleep(what).unwrap();
            let asleep = e.memory_report();
            println!("{what:?}: {before:?} -> {asleep:?}");
            assert!(asleep.engine_bytes < before.engine_bytes, "{what:?}");
            if let (Some(b), Some(a)) = (before.allocator, asleep.allocator) {
                assert!(a.0 < b.0, "{what:?}: the allocator still holds {} of {} bytes", a.0, b.0);
            }
            assert_eq!(e.asleep(), Some(what));
            // asleep, every call that needs the GPU is refused and changes nothing
            let err = e.append(&[1], 1, &[1], Some(&[0])).unwrap_err().to_string();
            assert!(err.contains("asleep"), "{err}");
            assert!(e.reset(&[0]).is_err() && e.sleep(what).is_err());
            assert_eq!(e.cache().history(0), &seqs[0][..]);
            e.wake().unwrap();
            let after = e.memory_report();
            println!("{what:?}: awake again {after:?}");
            assert_eq!(after.engine_bytes, before.engine_bytes, "{what:?}");
            let next = [4, 5, 6];
            assert_eq!(next_logits(&mut e, &next), next_logits(&mut twin, &next), "{what:?}");
            let hot = [Sampler { temperature: 0.8, seed: 9, ..Sampler::GREEDY }; 3];
            let limits = vec![TurnLimit { max_new: 6, stop: vec![] }; 3];
            let a = e.decode_turns(&[0, 1, 2], &[7, 8, 9], &hot, &limits, 3, &|_, _| false).unwrap();
            let b = twin.decode_turns(&[0, 1, 2], &[7, 8, 9], &hot, &limits, 3, &|_, _| false).unwrap();
            assert_eq!(a, b, "{what:?}");
        }
    }
}
