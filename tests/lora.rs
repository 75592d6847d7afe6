//! LoRA adapters as PEFT saves them, against transformers + PEFT applied unmerged (fp32, eager):
//! the adapter read from its directory and applied by the CPU reference, and by the GPU beside the
//! base products, gives PEFT's logits at every one of 300 positions, for each family's own naming
//! (Phi-3's fused q/k/v and gate/up among them), ranks 1, 8 and 64, rsLoRA with per-module rank
//! and alpha patterns, and an adapter on q and v only. On the GPU a batch mixes adapters with
//! each row's bits its own, a trainer's update equals a fresh load, and slots, rows and the
//! prompt cache keep adapters apart. What kvdecode does not support is refused by name.
//! Fixtures: scripts/fixtures/make_lora_fixtures.py.

mod common;

use std::path::PathBuf;

use common::max_abs_diff;
use kvdecode::io::npy;
use kvdecode::model::lora::{LoraAdapter, LoraTarget};
use kvdecode::model::reference::{self, RefOptions};
use kvdecode::{HostTensor, ModelWeights};
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn base(family: &str) -> ModelWeights {
    kvdecode::io::hf::load_dir(fixtures().join("hf").join(family)).unwrap()
}

#[test]
fn peft_adapters_match_transformers_at_every_position() {
    let mut cases: Vec<PathBuf> =
        std::fs::read_dir(fixtures().join("lora")).unwrap().map(|e| e.unwrap().path()).collect();
    cases.sort();
    assert_eq!(cases.len(), 17, "the fixtures of make_lora_fixtures.py");
    for dir in cases {
        let case = dir.file_name().unwrap().to_string_lossy().into_owned();
        let family = case.split('-').next().unwrap();
        let w = base(family);
        let adapter = LoraAdapter::from_peft_dir(&dir, &w.cfg).unwrap_or_else(|e| panic!("{case}: {e}"));
        let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
        let want = npy::read(dir.join("logits.npy")).unwrap().to_f32();
        let got =
            reference::forward_with(&w, &tokens, RefOptions { lora: Some(&adapter), ..Default::default() }).unwrap();
        let d = max_abs_diff(&got, &want);
        // the adapter matters: the base model alone is far from PEFT's logits
        let without = max_abs_diff(&reference::forward(&w, &tokens).unwrap(), &want);
        println!(
            "{case}: reference with the adapter vs PEFT {d:.1e} over {} positions (without it {without:.2})",
            tokens.len()
        );
        assert!(d <= 1e-4, "{case}: {d}");
        assert!(without > 0.5, "{case}: the adapter changes nothing ({without})");
    }
    // q and v only: nothing else is adapted; Phi-3's fused tensors become the seven targets
    let qv = LoraAdapter::from_peft_dir(fixtures().join("lora/qwen3-qv"), &base("qwen3").cfg).unwrap();
    let adapted: Vec<LoraTarget> = LoraTarget::ALL.into_iter().filter(|&t| qv.module(0, t).is_some()).collect();
    assert_eq!(adapted, [LoraTarget::Q, LoraTarget::V]);
    let phi3 = LoraAdapter::from_peft_dir(fixtures().join("lora/phi3-r8"), &base("phi3").cfg).unwrap();
    let ranks: Vec<Option<usize>> = LoraTarget::ALL.into_iter().map(|t| phi3.module(1, t).map(|m| m.rank)).collect();
    assert_eq!(ranks, [Some(8); 7], "phi3: q, k, v, o, gate, up, down");
}

/// A tensor by value: name, shape, elements.
type Owned = (String, Vec<usize>, Vec<f32>);

/// The fixture's config and tensors, with `edit` applied to the config.
fn llama_adapter(edit: impl Fn(&mut Value)) -> (Value, Vec<Owned>) {
    let dir = fixtures().join("lora/llama-r8");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    edit(&mut config);
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<Owned> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), bytemuck::pod_collect_to_vec::<u8, f32>(v.data())))
        .collect();
    // the file's order comes out of a hash map: sorted, the cases below see the same tensors
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    (config, tensors)
}

fn refusal(config: &Value, tensors: &[Owned]) -> String {
    let views: Vec<HostTensor> = tensors.iter().map(|(n, s, v)| HostTensor::f32(n.clone(), s, v)).collect();
    match LoraAdapter::from_peft(config, &views, &base("llama").cfg) {
        Ok(_) => "loaded".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_adapters_are_refused_by_name() {
    let (config, tensors) = llama_adapter(|_| {});
    let views: Vec<HostTensor> = tensors.iter().map(|(n, s, v)| HostTensor::f32(n.clone(), s, v)).collect();
    assert!(LoraAdapter::from_peft(&config, &views, &base("llama").cfg).is_ok(), "the unedited adapter loads");
    for (key, value, want) in [
        ("use_dora", json!(true), "DoRA adapters are not supported"),
        ("modules_to_save", json!(["lm_head"]), "modules_to_save"),
        ("bias", json!("all"), "LoRA biases"),
        ("peft_type", json!("IA3"), "only LORA adapters"),
        ("r", json!(4), "rank 4"),
        ("rank_pattern", json!({"q_proj": 2}), "rank 2"),
    ] {
        let (c, t) = llama_adapter(|c| c[key] = value.clone());
        let e = refusal(&c, &t);
        assert!(e.contains(want), "{key}: {e}");
    }
    // block 0's gate projection, A and B, renamed
    let module = "base_model.model.model.layers.0.mlp.gate_proj".to_string();
    assert!(tensors.iter().any(|t| t.0.starts_with(&format!("{module}.lora_A"))));
    let renamed = |from: &str, to: &str| {
        let mut t = tensors.clone();
        for x in t.iter_mut().filter(|x| x.0.starts_with(&format!("{module}.lora_"))) {
            x.0 = x.0.replace(from, to);
        }
        t
    };
    let layer = "0";
    for (t, want) in [
        (renamed(".lora_A.", ".lora_magnitude_vector."), "DoRA"),
        (renamed(&format!("layers.{layer}."), "embed_tokens."), "embedding or the LM head"),
        (renamed("_proj.lora", "_projx.lora"), "not a projection this Llama model has"),
        (renamed(&format!("layers.{layer}."), "layers.9."), "block 9 of a model with 2"),
        (renamed(&format!("layers.{layer}.mlp."), &format!("layers.{layer}.mlp.experts.0.")), "experts"),
        (tensors.iter().filter(|x| !x.0.starts_with(&format!("{module}.lora_A"))).cloned().collect(), "but no lora_A"),
    ] {
        let e = refusal(&config, &t);
        assert!(e.contains(want), "{want}: {e}");
    }
    let mut t = tensors.clone();
    t[0].2[3] = f32::NAN;
    assert!(refusal(&config, &t).contains("finite"), "{}", refusal(&config, &t));
    let mut t = tensors.clone();
    t.push(t[0].clone());
    assert!(refusal(&config, &t).contains("given twice"));
}

// ---- on the GPU -------------------------------------------------------------------------------

use common::gpu;
use kvdecode::model::quant::QuantKind;
use kvdecode::{Batch, Engine, EngineOptions, InFlight, Sleep, Want, WeightDtype};

/// An engine of `w` with `slots` adapter slots of rank up to 64, `rows` rows of 320 positions.
fn engine(w: &ModelWeights, rows: usize, slots: usize) -> Engine {
    engine_holding(w, rows, slots, WeightDtype::F32)
}

/// The same, its slots holding A and B as `dtype`.
fn engine_holding(w: &ModelWeights, rows: usize, slots: usize, dtype: WeightDtype) -> Engine {
    let opts = EngineOptions {
        max_loras: slots,
        max_lora_rank: 64,
        lora_dtype: dtype,
        beyond_trained_context: true,
        ..EngineOptions::new(rows, 320)
    };
    Engine::new(&gpu(), w, opts).unwrap()
}

/// Every position's logits of `tokens` fed to `row` in chunks of `chunk`.
fn all_positions(e: &mut Engine, row: usize, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for part in tokens.chunks(chunk) {
        let got = e.append_all_logits(part, part.len(), &[part.len()], Some(&[row])).unwrap();
        out.extend(got[0].iter().flatten());
    }
    out
}

fn case_dirs() -> Vec<PathBuf> {
    let mut cases: Vec<PathBuf> =
        std::fs::read_dir(fixtures().join("lora")).unwrap().map(|e| e.unwrap().path()).collect();
    cases.sort();
    cases
}

/// The GPU applies each adapter unmerged, beside the base products: PEFT's logits at every one of
/// 300 positions for every fixture (Gemma 3's and Phi-3's sliding layers put k and v in the local
/// buffer too), within 1e-4.
#[test]
fn adapters_on_the_gpu_match_peft_at_every_position() {
    for dir in case_dirs() {
        let case = dir.file_name().unwrap().to_string_lossy().into_owned();
        let w = base(case.split('-').next().unwrap());
        let mut e = engine(&w, 2, 1);
        e.load_lora_path("a", &dir).unwrap_or_else(|err| panic!("{case}: {err}"));
        e.set_adapter(1, Some("a")).unwrap();
        let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
        let want = npy::read(dir.join("logits.npy")).unwrap().to_f32();
        let got = all_positions(&mut e, 1, &tokens, 60);
        let d = max_abs_diff(&got, &want);
        println!("{case}: GPU with the adapter vs PEFT {d:.1e} over {} positions", tokens.len());
        assert!(d <= 1e-4, "{case}: {d}");
    }
}

/// Each row's logits at every position when `rows` take `prompts` side by side in chunks of up
/// to `width` tokens a row, one step a chunk, each naming the rows' `adapters` where given.
fn side_by_side(
    e: &mut Engine,
    rows: &[usize],
    prompts: &[Vec<u32>],
    width: usize,
    adapters: Option<&[Option<&str>]>,
) -> Vec<Vec<f32>> {
    let mut out = vec![Vec::new(); rows.len()];
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    for at in (0..longest).step_by(width) {
        let chunk = |p: &Vec<u32>| p[at.min(p.len())..(at + width).min(p.len())].to_vec();
        let mut batch = rows.iter().zip(prompts).fold(Batch::new(), |b, (&row, p)| b.row(row, &chunk(p)));
        if let Some(names) = adapters {
            batch = batch.adapters(names);
        }
        let got = e.step(&batch, Want::AllLogits).unwrap().into_all_logits().unwrap();
        for (r, g) in got.iter().enumerate() {
            out[r].extend(g.iter().flatten());
        }
    }
    out
}

const ADAPTERS: [Option<&str>; 4] = [None, Some("r1"), Some("r8"), Some("r64")];

fn load_three(e: &mut Engine) {
    for n in ADAPTERS.into_iter().flatten() {
        e.load_lora_path(n, fixtures().join(format!("lora/llama-{n}"))).unwrap();
    }
}

/// One step mixes rows of the base model and of three adapters (ranks 1, 8 and 64): each row's
/// logits at every position are its bits alone, whatever its neighbours and its chunking; a row
/// on the base model has the bits of an engine built without adapter slots; and the adapters
/// change what they should (each adapted row differs from the base).
#[test]
fn a_batch_mixing_adapters_gives_each_row_its_alone_bits() {
    let w = base("llama");
    let mut rng = kvdecode::SplitMix64(common::seed(36));
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| (0..30 + 7 * i).map(|_| rng.below(128) as u32).collect()).collect();
    let mut e = engine(&w, 4, 3);
    load_three(&mut e);
    for (row, a) in ADAPTERS.iter().enumerate() {
        e.set_adapter(row, *a).unwrap();
    }
    // alone: one row at a time, 31 tokens a chunk
    let alone: Vec<Vec<f32>> =
        (0..4).map(|r| side_by_side(&mut e, &[r], std::slice::from_ref(&prompts[r]), 31, None).remove(0)).collect();
    e.reset(&[0, 1, 2, 3]).unwrap();
    assert_eq!(e.adapter(1), None, "a reset puts the row back on the base model");
    // together, in another order and chunking: rows 3, 1, 0, 2, 13 tokens a chunk, each step's
    // batch naming the rows' adapters
    let order = [3, 1, 0, 2];
    let named: Vec<Option<&str>> = order.iter().map(|&r| ADAPTERS[r]).collect();
    let ordered: Vec<Vec<u32>> = order.iter().map(|&r| prompts[r].clone()).collect();
    let together = side_by_side(&mut e, &order, &ordered, 13, Some(&named));
    for (k, &row) in order.iter().enumerate() {
        assert!(together[k] == alone[row], "row {row} ({:?}): its logits depend on its batch", ADAPTERS[row]);
    }
    // a batch's adapters are checked with the rest before anything is written: an unknown one, or
    // another one for a row holding tokens, is refused and every row stays as it was
    let state = |e: &Engine| -> Vec<_> {
        order.iter().map(|&r| (e.cache().position(r), e.adapter(r).map(|a| a.0.to_string()))).collect()
    };
    let before = state(&e);
    let mut refused = |names: &[Option<&str>]| {
        let batch = order.iter().fold(Batch::new(), |b, &r| b.row(r, &[5])).adapters(names);
        e.step(&batch, Want::Logits).err().map(|err| err.to_string()).unwrap_or_default()
    };
    assert!(refused(&[named[0], Some("r2"), named[2], named[3]]).contains("no LoRA adapter named \"r2\""));
    assert!(refused(&[named[0], named[1], Some("r8"), named[3]]).contains("row 0 holds tokens"));
    assert!(refused(&named[..3]).contains("3 adapters for 4 batch rows"));
    assert_eq!(state(&e), before);
    // the base model's row: the bits of an engine with no adapter slots at all
    let mut plain =
        Engine::new(&gpu(), &w, EngineOptions { beyond_trained_context: true, ..EngineOptions::new(1, 320) }).unwrap();
    let base_bits = side_by_side(&mut plain, &[0], std::slice::from_ref(&prompts[0]), 64, None).remove(0);
    assert!(alone[0] == base_bits, "a row without an adapter must give the base model's bits");
    for row in 1..4 {
        let base_row = side_by_side(&mut plain, &[0], std::slice::from_ref(&prompts[row]), 64, None).remove(0);
        plain.reset(&[0]).unwrap();
        let d = max_abs_diff(&alone[row], &base_row);
        assert!(d > 0.1, "row {row}: the adapter changes nothing ({d})");
    }
}

/// Rows whose adapters interleave in the batch, decoding a token a step: the wide products take
/// the step's tokens in adapter order, a block of four tokens of one adapter loading B once for
/// them all (`matmul_lora.wgsl`'s `lora_tokens`; the tests above never have two rows of one adapter
/// in a step). Rows 0, 3, 5 and 6 on r8 fill a block. While row 8, a fifth on r8, has tokens, its
/// block holds row 2 (base) and two rows on r64, which must each take their own adapter; after it,
/// rows 1, 4 and 7 on r64 share a block with row 2, then (row 7 done) rows 1 and 4 do. Each row
/// keeps its bits alone, where a block is one token.
#[test]
fn rows_of_one_adapter_sharing_a_block_keep_their_alone_bits() {
    let w = base("llama");
    let mut rng = kvdecode::SplitMix64(common::seed(38));
    let names =
        [Some("r8"), Some("r64"), None, Some("r8"), Some("r64"), Some("r8"), Some("r8"), Some("r64"), Some("r8")];
    let lens = [9, 9, 9, 9, 9, 9, 9, 7, 4];
    let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| (0..n).map(|_| rng.below(128) as u32).collect()).collect();
    let rows: Vec<usize> = (0..names.len()).collect();
    let mut e = engine(&w, names.len(), 3);
    load_three(&mut e);
    let together = side_by_side(&mut e, &rows, &prompts, 1, Some(&names));
    e.reset(&rows).unwrap();
    for (r, name) in names.iter().enumerate() {
        let alone = side_by_side(&mut e, &[r], &prompts[r..=r], 1, Some(&[*name])).remove(0);
        assert!(alone == together[r], "row {r} ({name:?}): its logits depend on its block");
    }
}

fn views(t: &[Owned]) -> Vec<HostTensor<'_>> {
    t.iter().map(|(n, s, v)| HostTensor::f32(n.clone(), s, v)).collect()
}

/// A trainer's push: `update_lora` with two of llama-r8's tensors changed gives the bits of a fresh
/// engine loaded with the changed adapter, on an f32 and a Q4_1 base: for a row recomputed in
/// flight and for a row started after. Another adapter's row is left alone, and every bad update
/// is refused with nothing changed.
#[test]
fn update_lora_equals_a_fresh_load_and_bad_updates_change_nothing() {
    let (config, tensors) = llama_adapter(|_| {});
    let pushed_names = ["layers.1.self_attn.q_proj.lora_A", "layers.0.mlp.down_proj.lora_B"];
    let pushed: Vec<Owned> = tensors
        .iter()
        .filter(|t| pushed_names.iter().any(|n| t.0.contains(n)))
        .map(|(n, s, v)| (n.clone(), s.clone(), v.iter().map(|x| 0.01 - 1.5 * x).collect()))
        .collect();
    assert_eq!(pushed.len(), 2);
    let merged: Vec<Owned> = tensors.iter().map(|t| pushed.iter().find(|p| p.0 == t.0).unwrap_or(t).clone()).collect();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 128) as u32).collect();
    let edited = |f: &dyn Fn(&mut Owned)| {
        let mut t = pushed.clone();
        f(&mut t[0]);
        t
    };
    let bad: Vec<(Vec<Owned>, &str)> = vec![
        (edited(&|t| t.1 = vec![8, 32]), "shape"),
        (edited(&|t| t.1 = vec![4, 64]), "rank 8, as loaded"),
        (edited(&|t| t.0 = t.0.replace("_proj.", "_projx.")), "not a projection"),
        (edited(&|t| t.2[5] = f32::INFINITY), "not finite"),
        ([pushed.clone(), pushed[..1].to_vec()].concat(), "given twice"),
    ];
    let cases = [
        ("f32", base("llama"), WeightDtype::F32),
        ("q4_1", base("llama").quantized(QuantKind::Q4_1).unwrap(), WeightDtype::F32),
        ("f16 adapters", base("llama"), WeightDtype::F16),
    ];
    for (label, w, dtype) in cases {
        let old = LoraAdapter::from_peft(&config, &views(&tensors), &w.cfg).unwrap();
        let new = LoraAdapter::from_peft(&config, &views(&merged), &w.cfg).unwrap();
        let mut fresh = engine_holding(&w, 1, 1, dtype);
        fresh.load_lora("a", &new).unwrap();
        fresh.set_adapter(0, Some("a")).unwrap();
        let want = all_positions(&mut fresh, 0, &prompt, 40);
        let mut e = engine_holding(&w, 4, 2, dtype);
        e.load_lora("a", &old).unwrap();
        e.load_lora("b", &old).unwrap();
        for (row, a) in [(0, "a"), (1, "b"), (2, "a"), (3, "b")] {
            e.set_adapter(row, Some(a)).unwrap();
        }
        let half = side_by_side(&mut e, &[0, 1], &[prompt[..20].to_vec(), prompt[..20].to_vec()], 20, None);
        assert!(half[0] == half[1], "{label}: two slots of one adapter give the same bits");
        let probe = all_positions(&mut e, 2, &prompt, 40);
        // halves hold at most 65504: beyond, an f16 engine refuses the value (an f32 one takes it)
        let beyond_half = (edited(&|t| t.2[5] = 1e5), "beyond the largest half");
        for (tensors, want_err) in bad.iter().chain(std::iter::once(&beyond_half).filter(|_| dtype == WeightDtype::F16))
        {
            let err = e.update_lora("a", &views(tensors), InFlight::Recompute).unwrap_err().to_string();
            assert!(err.contains(want_err), "{label}: {want_err}: {err}");
        }
        assert_eq!(
            (e.adapter(0), e.lora_version("a")),
            (Some(("a", 0)), Some(0)),
            "{label}: a refused update changed it"
        );
        e.reset(&[2]).unwrap();
        e.set_adapter(2, Some("a")).unwrap();
        assert!(all_positions(&mut e, 2, &prompt, 40) == probe, "{label}: a refused update changed the GPU's adapter");
        let up = e.update_lora("a", &views(&pushed), InFlight::Recompute).unwrap();
        assert_eq!((up.version, up.modules, up.rows.clone()), (1, 2, vec![0, 2]), "{label}");
        assert_eq!(e.adapter(0), Some(("a", 1)));
        // row 0 was recomputed from its 20 tokens: going on gives the fresh engine's bits
        let vocab = w.cfg.vocab;
        let rest = all_positions(&mut e, 0, &prompt[20..], 20);
        assert!(rest[..] == want[20 * vocab..], "{label}: a recomputed row differs from a fresh engine");
        e.reset(&[2]).unwrap();
        e.set_adapter(2, Some("a")).unwrap();
        assert!(all_positions(&mut e, 2, &prompt, 40) == want, "{label}: a new row differs from a fresh engine");
        // adapter b's row goes on with b's values, as row 3 (b, from the start) computes them
        let b_rest = all_positions(&mut e, 1, &prompt[20..], 20);
        assert!(b_rest[..] == all_positions(&mut e, 3, &prompt, 40)[20 * vocab..], "{label}: b's row changed");
        assert!(max_abs_diff(&b_rest, &rest) > 1e-3, "{label}: the update changed nothing");
    }
    // an update names only modules the adapter has
    let qwen3 = base("qwen3").cfg;
    let qv = LoraAdapter::from_peft_dir(fixtures().join("lora/qwen3-qv"), &qwen3).unwrap();
    let k =
        [("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight".to_string(), vec![8, 64], vec![0.0; 512])];
    let err = qv.updated(&views(&k), &qwen3).unwrap_err().to_string();
    assert!(err.contains("is not in this adapter"), "{err}");
}

/// Slots are bounded and named in every refusal; a row's adapter is fixed while it holds tokens,
/// follows its forks, survives `continue_row` starting over and is cleared by a reset; the prompt
/// cache shares a prefix only between rows of one adapter; sleep and wake keep the adapters.
#[test]
fn slots_rows_and_the_prompt_cache_keep_adapters_apart() {
    let w = base("llama");
    let dir = |n: &str| fixtures().join(format!("lora/llama-{n}"));
    let plain = EngineOptions { beyond_trained_context: true, ..EngineOptions::new(1, 320) };
    let mut none = Engine::new(&gpu(), &w, plain).unwrap();
    let err = none.load_lora_path("r8", dir("r8")).unwrap_err().to_string();
    assert!(err.contains("max_loras"), "{err}");
    let mut low = Engine::new(&gpu(), &w, EngineOptions { max_loras: 1, max_lora_rank: 8, ..plain }).unwrap();
    let err = low.load_lora_path("r64", dir("r64")).unwrap_err().to_string();
    assert!(err.contains("rank 64") && err.contains("max_lora_rank"), "{err}");
    let mut e = engine(&w, 4, 2);
    e.load_lora_path("r1", dir("r1")).unwrap();
    assert!(e.load_lora_path("r1", dir("r8")).unwrap_err().to_string().contains("already loaded"));
    e.load_lora_path("r8", dir("r8")).unwrap();
    let err = e.load_lora_path("r64", dir("r64")).unwrap_err().to_string();
    assert!(err.contains("all 2 LoRA slots are taken"), "{err}");
    assert!(e.set_adapter(0, Some("r64")).unwrap_err().to_string().contains("no LoRA adapter named"));
    assert_eq!(e.loras(), [("r1".to_string(), 0), ("r8".to_string(), 0)]);
    // three blocks of 16 positions and a tail
    let prompt: Vec<u32> = (0..53).map(|i| (i * 11 % 128) as u32).collect();
    e.set_adapter(0, Some("r1")).unwrap();
    let first = e.append(&prompt, prompt.len(), &[prompt.len()], Some(&[0])).unwrap();
    assert!(e.set_adapter(0, Some("r8")).unwrap_err().to_string().contains("reset it"));
    e.set_adapter(1, Some("r8")).unwrap();
    assert_eq!(e.reuse_prefix(1, &prompt).unwrap(), 0, "another adapter's prefix is not this row's");
    assert_eq!(e.reuse_prefix(2, &prompt).unwrap(), 0, "an adapter's prefix is not the base model's");
    e.set_adapter(3, Some("r1")).unwrap();
    let kept = e.reuse_prefix(3, &prompt).unwrap();
    assert_eq!(kept, 48, "the same adapter shares the prefix");
    let again = e.append(&prompt[kept..], prompt.len() - kept, &[prompt.len() - kept], Some(&[3])).unwrap();
    assert!(again.row(0) == first.row(0), "a reused prefix gives the row's own bits");
    let err = e.unload_lora("r1").unwrap_err().to_string();
    assert!(err.contains("in use by rows [0, 3]"), "{err}");
    // forks take their source's adapter; a sleep keeps the adapters on the host and back
    e.reset(&[1, 2, 3]).unwrap();
    e.fork(0, &[3]).unwrap();
    assert_eq!(e.adapter(3), Some(("r1", 0)));
    let step = e.append(&[7], 1, &[1], Some(&[3])).unwrap();
    e.sleep(Sleep::ALL).unwrap();
    e.wake().unwrap();
    let woken = e.append(&[7], 1, &[1], Some(&[0])).unwrap();
    assert!(woken.row(0) == step.row(0), "sleep and wake keep the adapter");
    e.reset(&[0, 3]).unwrap();
    e.unload_lora("r1").unwrap();
    e.load_lora_path("r64", dir("r64")).unwrap();
    assert_eq!(e.loras(), [("r64".to_string(), 0), ("r8".to_string(), 0)], "the freed slot is taken again");
    // a conversation that turns elsewhere further back than a windowed row can roll back starts
    // over, on its row's adapter: the bits of a fresh row of that adapter
    let g = base("gemma3");
    let mut e = engine(&g, 2, 1);
    e.load_lora_path("g", fixtures().join("lora/gemma3-r8")).unwrap();
    e.set_adapter(0, Some("g")).unwrap();
    e.append(&prompt[..40], 40, &[40], Some(&[0])).unwrap();
    let turned: Vec<u32> = prompt[..10].iter().copied().chain([99, 98, 97]).collect();
    e.continue_row(0, &turned).unwrap();
    assert_eq!(e.adapter(0), Some(("g", 0)), "continue_row keeps the row's adapter");
    let continued = e.append(&turned[12..], 1, &[1], Some(&[0])).unwrap();
    e.set_adapter(1, Some("g")).unwrap();
    let fresh = e.append(&turned, 13, &[13], Some(&[1])).unwrap();
    assert!(continued.row(0) == fresh.row(0), "a row that started over decodes on its adapter");
}

/// Every family with its own naming at the three attention shapes of tests/fixtures/hf-shapes:
/// 3 KV heads with head_dim left out of the config, 8 heads over 2 (GQA 4) with head_dim 64, and
/// head_dim 128 over one KV head. A rank-8 adapter on every linear layer, drawn from its names as
/// scripts/fixtures/make_lora_shape_fixtures.py draws it: the CPU reference, and the GPU fed in
/// chunks of 7, give PEFT's logits at every position.
#[test]
fn adapters_at_every_attention_shape_match_peft() {
    let mut cases: Vec<PathBuf> =
        std::fs::read_dir(fixtures().join("lora-shapes")).unwrap().map(|e| e.unwrap().path()).collect();
    cases.sort();
    assert_eq!(cases.len(), 15, "five families at three shapes");
    for dir in cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let read = |f: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap() };
        let shapes = fixtures().join("hf-shapes").join(&name);
        let base_meta: Value =
            serde_json::from_str(&std::fs::read_to_string(shapes.join("meta.json")).unwrap()).unwrap();
        let model = common::drawn_model_dir(&shapes, &base_meta);
        let w = kvdecode::io::hf::load_dir(&model);
        std::fs::remove_dir_all(&model).unwrap();
        let w = w.unwrap();
        let tensors: Vec<Owned> = read("meta.json")["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(n, s)| {
                let shape: Vec<usize> = s.as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
                let scale = if n.contains("lora_B") { 0.25 } else { 1.0 };
                let values = common::draw(n, &shape).iter().map(|v| v * scale).collect();
                (n.clone(), shape, values)
            })
            .collect();
        let adapter = LoraAdapter::from_peft(&read("adapter_config.json"), &views(&tensors), &w.cfg).unwrap();
        let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
        let want = npy::read(dir.join("logits.npy")).unwrap().to_f32();
        let reference = reference::forward_with(&w, &tokens, RefOptions { lora: Some(&adapter), ..Default::default() });
        let d_ref = max_abs_diff(&reference.unwrap(), &want);
        // max_len within Phi-3's original context, as transformers' short LongRoPE factors for 40
        // tokens (the engine picks its factors by max_len)
        let opts = EngineOptions { max_loras: 1, max_lora_rank: 8, ..EngineOptions::new(2, 64) };
        let mut e = Engine::new(&gpu(), &w, opts).unwrap();
        e.load_lora("a", &adapter).unwrap();
        e.set_adapter(1, Some("a")).unwrap();
        let d_gpu = max_abs_diff(&all_positions(&mut e, 1, &tokens, 7), &want);
        println!(
            "{name} (head_dim {}, {} / {} heads): vs PEFT, reference {d_ref:.1e}, GPU {d_gpu:.1e}",
            w.cfg.head_dim, w.cfg.n_heads, w.cfg.n_kv_heads
        );
        // Gemma 3 at head_dim 256: transformers' own f32 rounding reaches 1.5e-4 there without an
        // adapter (tests/hf_shapes.rs holds it to 3e-4); everywhere else 1e-4
        let tolerance = if w.cfg.head_dim == 256 { 3e-4 } else { 1e-4 };
        assert!(d_ref <= tolerance && d_gpu <= tolerance, "{name}: reference {d_ref}, GPU {d_gpu}");
    }
}

/// GGUF LoRA files as llama.cpp's `convert_lora_to_gguf.py` writes them (made from two PEFT
/// fixtures with llama.cpp's gguf-py: scripts/fixtures/make_lora_gguf_fixtures.py): Llama's, whose
/// q and k B rows come permuted as the converter permutes the base's, and Qwen3's read into exactly
/// the adapter of the PEFT folder beside them, and give PEFT's logits on the GPU. A model file is
/// not an adapter.
#[test]
fn gguf_lora_files_read_as_the_peft_adapter() {
    use kvdecode::io::model_file::open_lora;
    for case in ["llama-r8", "qwen3-r8"] {
        let dir = fixtures().join("lora").join(case);
        let w = base(case.split('-').next().unwrap());
        let from_gguf = open_lora(dir.join("adapter.gguf"), &w.cfg).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert!(from_gguf == open_lora(&dir, &w.cfg).unwrap(), "{case}: the GGUF file's adapter is not PEFT's");
        let mut e = engine(&w, 1, 1);
        e.load_lora_path("g", dir.join("adapter.gguf")).unwrap();
        e.set_adapter(0, Some("g")).unwrap();
        let tokens = npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap();
        let d =
            max_abs_diff(&all_positions(&mut e, 0, &tokens, 60), &npy::read(dir.join("logits.npy")).unwrap().to_f32());
        println!("{case} from GGUF: GPU vs PEFT {d:.1e} over {} positions", tokens.len());
        assert!(d <= 1e-4, "{case}: {d}");
    }
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/gguf/llama-f32-chatml.gguf");
    let err = open_lora(&model, &base("llama").cfg).unwrap_err().to_string();
    assert!(err.contains("not a LoRA adapter GGUF"), "{err}");
}

/// Adapters held in f16 (`EngineOptions::lora_dtype`): the GPU gives the CPU reference of the
/// adapter's values rounded to halves, at every position and whatever the batch beside it (the
/// products add in f32 either way), and a value beyond the largest half is refused at load.
#[test]
fn half_adapters_give_the_reference_of_their_rounded_values() {
    let w = base("llama");
    let dir = fixtures().join("lora/llama-r8");
    let adapter = LoraAdapter::from_peft_dir(&dir, &w.cfg).unwrap();
    let mut rounded = adapter.clone();
    for m in rounded.layers.iter_mut().flatten().flatten() {
        for v in m.a.iter_mut().chain(&mut m.b) {
            *v = half::f16::from_f32(*v).to_f32();
        }
    }
    let tokens = &npy::read(dir.join("tokens.npy")).unwrap().to_u32().unwrap()[..80];
    let want = reference::forward_with(&w, tokens, RefOptions { lora: Some(&rounded), ..Default::default() }).unwrap();
    let unrounded =
        reference::forward_with(&w, tokens, RefOptions { lora: Some(&adapter), ..Default::default() }).unwrap();
    let mut e = engine_holding(&w, 2, 2, WeightDtype::F16);
    e.load_lora("a", &adapter).unwrap();
    e.set_adapter(1, Some("a")).unwrap();
    let d = max_abs_diff(&all_positions(&mut e, 1, tokens, 30), &want);
    println!(
        "f16 adapter vs the reference of its rounded values {d:.1e} (the rounding moves the reference {:.1e})",
        max_abs_diff(&want, &unrounded)
    );
    assert!(d <= 1e-4, "{d}");
    let mut huge = adapter.clone();
    huge.layers[1][0].as_mut().unwrap().b[3] = -7e4;
    let err = e.load_lora("huge", &huge).unwrap_err().to_string();
    assert!(err.contains("beyond the largest half") && err.contains("block 1"), "{err}");
    assert_eq!(e.loras(), [("a".to_string(), 0)], "a refused load takes no slot");
}

/// The adapters' `B (A x)` is the epilogue of every product kernel (`matmul_lora.wgsl`), and
/// their `A x` reads the block's norm as the fused products do: under each kernel the GPU can
/// run, with every fusion (and with none, for the portable and wide-subgroup kernels: the norm
/// and the activation then dispatches of their own), on a Q4_1 base, a step mixing the base
/// model and three adapters (ranks 1, 8 and 64) gives each adapted row the CPU reference's logits
/// at every position, and the base row the bits of the same kernel without adapter slots. Rows
/// are fed 13 tokens a step (the tiled kernel's many-token steps), then one (decoding). The
/// kernels that give the portable bits (wide, wide-subgroup, tiled) give them with adapters too,
/// and under the GPU shapes (subgroup, workgroup: `A x` split over lanes) a row alone has its
/// bits in the batch. (tests/fast_paths.rs and fusion.rs hold the base products of each kernel
/// to each other; this test is the epilogue's.)
#[test]
fn every_product_kernel_adds_the_adapters_as_its_epilogue() {
    use kvdecode::{Fusion, Gpu, GpuOptions, MatmulKernel};
    let w = base("llama").quantized(QuantKind::Q4_1).unwrap();
    let mut rng = kvdecode::SplitMix64(common::seed(37));
    let prompts: Vec<Vec<u32>> = (0..4).map(|_| (0..34).map(|_| rng.below(128) as u32).collect()).collect();
    let adapters: Vec<LoraAdapter> = ADAPTERS
        .iter()
        .flatten()
        .map(|n| LoraAdapter::from_peft_dir(fixtures().join(format!("lora/llama-{n}")), &w.cfg).unwrap())
        .collect();
    let want: Vec<Vec<f32>> = (0..4usize)
        .map(|r| {
            let lora = r.checked_sub(1).map(|i| &adapters[i]);
            reference::forward_with(&w, &prompts[r], RefOptions { lora, ..Default::default() }).unwrap()
        })
        .collect();
    let fast = gpu();
    let portable = Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap();
    let mut kernels = vec![
        (&portable, MatmulKernel::Portable, Fusion::ALL),
        (&portable, MatmulKernel::Portable, Fusion::NONE),
        (&portable, MatmulKernel::Wide, Fusion::ALL),
        (&portable, MatmulKernel::Tiled, Fusion::ALL),
        (&portable, MatmulKernel::Workgroup, Fusion::ALL),
        (&portable, MatmulKernel::IntDot, Fusion::ALL),
    ];
    if fast.subgroup_size().is_some() {
        kernels.push((&fast, MatmulKernel::Subgroup, Fusion::ALL));
    }
    if fast.subgroup_size().is_some_and(|n| n >= 8) {
        kernels.push((&fast, MatmulKernel::WideSubgroup, Fusion::ALL));
        kernels.push((&fast, MatmulKernel::WideSubgroup, Fusion::NONE));
    }
    // rows `rows` (of the 4 prompts, each on its adapter of ADAPTERS) fed together
    let run = |gpu: &Gpu, matmul, fusion, slots: usize, rows: &[usize]| {
        let opts = EngineOptions {
            matmul: Some(matmul),
            fusion: Some(fusion),
            max_loras: slots,
            max_lora_rank: 64,
            ..EngineOptions::new(4, 64)
        };
        let mut e = Engine::new(gpu, &w, opts).unwrap();
        assert_eq!(e.matmul_kernel(), matmul);
        if slots > 0 {
            for (name, a) in ADAPTERS.iter().flatten().zip(&adapters) {
                e.load_lora(name, a).unwrap();
            }
        }
        let names: Vec<Option<&str>> = rows.iter().map(|&r| ADAPTERS[r]).collect();
        let names = (slots > 0).then_some(&names[..]);
        let head: Vec<Vec<u32>> = rows.iter().map(|&r| prompts[r][..26].to_vec()).collect();
        let tail: Vec<Vec<u32>> = rows.iter().map(|&r| prompts[r][26..].to_vec()).collect();
        let mut got = side_by_side(&mut e, rows, &head, 13, names);
        for (g, more) in got.iter_mut().zip(side_by_side(&mut e, rows, &tail, 1, None)) {
            g.extend(more);
        }
        got
    };
    let mut portable_bits = None;
    for (gpu, matmul, fusion) in kernels {
        let got = run(gpu, matmul, fusion, 3, &[0, 1, 2, 3]);
        let plain = run(gpu, matmul, fusion, 0, &[0, 1, 2, 3]);
        let name = format!("{matmul:?} fusing {}", fusion.name());
        assert!(got[0] == plain[0], "{name}: the base row differs from the engine without slots");
        // integer-dot products round the activations to 8 bits (llama.cpp's accuracy): their
        // adapted rows are held to the reference as their base row is, within its own distance
        let tolerance = match matmul {
            MatmulKernel::IntDot => 4.0 * max_abs_diff(&got[0], &want[0]).max(1e-3),
            _ => 1e-4,
        };
        for r in 0..4 {
            let d = max_abs_diff(&got[r], &want[r]);
            println!("{name}: row {r} ({:?}) vs the reference {d:.1e}", ADAPTERS[r]);
            assert!(d <= tolerance, "{name}: row {r} ({:?}) {d} > {tolerance}", ADAPTERS[r]);
        }
        // the GPU shapes split A's rows over lanes (lora.wgsl's SLICES): a row alone has its bits
        // in the batch there too (the default kernels' are tests above)
        if matches!(matmul, MatmulKernel::Subgroup | MatmulKernel::Workgroup) {
            let alone = run(gpu, matmul, fusion, 3, &[3]).remove(0);
            assert!(alone == got[3], "{name}: row 3 alone differs from row 3 in the batch");
        }
        match matmul {
            MatmulKernel::Portable if fusion == Fusion::ALL => portable_bits = Some(got),
            MatmulKernel::Wide | MatmulKernel::WideSubgroup | MatmulKernel::Tiled => {
                assert!(Some(&got) == portable_bits.as_ref(), "{name}: adapted rows are not the portable bits");
            }
            _ => {}
        }
    }
}
