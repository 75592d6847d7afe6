//! The engine's parity tests inside a real browser (headless Chromium, WebGPU on SwiftShader):
//! cached incremental decoding equals the CPU reference, both layouts, f32, f16 and bf16 K/V
//! storage (16-bit storage against the reference that rounds K/V the same way); a LoRA adapter's
//! row beside a base row follows the reference with and without it; a lost device is an error on
//! every later call and a new engine works.
//! Run with scripts/web-test.sh (wasm-bindgen-test-runner + chromedriver).

use kvdecode::model::reference::{self, RefOptions};
use kvdecode::{
    argmax, Batch, Engine, EngineOptions, Error, Gpu, GpuOptions, KvDtype, LoraAdapter, ModelConfig, ModelWeights,
    Sampler, SplitMix64, StepOutput, Want,
};
use wasm_bindgen::JsValue;
use wasm_bindgen_test::*;

wasm_bindgen_test_configure!(run_in_browser);

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A ragged prefill, single steps, a sub-batch, a reset: every returned row against the reference.
async fn parity(cfg: ModelConfig, kv: KvDtype, seed: u64, tol: f32) {
    let gpu = Gpu::new_async(&GpuOptions::default()).await.expect("a WebGPU adapter in the browser");
    let w = ModelWeights::random(&cfg, seed).unwrap();
    let mut e = Engine::new(&gpu, &w, EngineOptions { kv, ..EngineOptions::new(3, 48) }).unwrap();
    let mut rng = SplitMix64(seed);
    let v = cfg.vocab;
    let mut worst = 0f32;
    for step in 0..12 {
        if step == 6 {
            e.reset(&[1]).unwrap();
        }
        let (rows, n_new): (Option<Vec<usize>>, Vec<usize>) = match step {
            0 => (None, vec![13, 5, 9]),
            4 | 8 => (Some(vec![2, 0]), vec![7, 1]),
            6 => (Some(vec![1]), vec![11]),
            _ => (None, vec![1, 1, 1]),
        };
        let width = *n_new.iter().max().unwrap();
        let ids: Vec<u32> = (0..n_new.len() * width).map(|_| rng.below(v) as u32).collect();
        let out = e
            .step_async(&Batch::padded(&ids, width, &n_new, rows.as_deref()), Want::Logits)
            .await
            .and_then(StepOutput::into_logits)
            .unwrap();
        let cache_rows = rows.unwrap_or_else(|| (0..3).collect());
        for (r, &row) in cache_rows.iter().enumerate() {
            let hist = e.cache().history(row).to_vec();
            let all = reference::forward_with(&w, &hist, RefOptions { kv: Some(kv), ..Default::default() }).unwrap();
            let want = &all[(hist.len() - 1) * v..];
            let got = out.row(r).unwrap();
            let d = max_abs_diff(got, want);
            worst = worst.max(d);
            assert!(d <= tol, "{kv:?} step {step} row {row}: {d}");
            assert_eq!(argmax(got), argmax(want), "{kv:?} step {step} row {row}: top-1");
        }
    }
    web_sys_log(&format!("{:?} {kv:?}: worst |gpu - reference| = {worst:e}", cfg.mlp));
}

fn web_sys_log(s: &str) {
    wasm_bindgen_test::console_log!("{}", s);
}

fn tiny_agent() -> ModelConfig {
    ModelConfig::tiny_agent(96, 32, 4, 2, 8, 64, 4, 2, 5)
}

fn llama() -> ModelConfig {
    ModelConfig::llama(96, 32, 4, 2, 8, 48, 3, 10000.0, 1e-6, false)
}

#[wasm_bindgen_test]
async fn browser_tiny_agent_f32() {
    parity(tiny_agent(), KvDtype::F32, 11, 1e-4).await;
}

#[wasm_bindgen_test]
async fn browser_llama_f32() {
    parity(llama(), KvDtype::F32, 12, 1e-4).await;
}

#[wasm_bindgen_test]
async fn browser_tiny_agent_f16() {
    parity(tiny_agent(), KvDtype::F16, 13, 2e-3).await;
}

#[wasm_bindgen_test]
async fn browser_llama_f16() {
    parity(llama(), KvDtype::F16, 14, 2e-3).await;
}

#[wasm_bindgen_test]
async fn browser_tiny_agent_bf16() {
    parity(tiny_agent(), KvDtype::BF16, 15, 2e-3).await;
}

#[wasm_bindgen_test]
async fn browser_llama_bf16() {
    parity(llama(), KvDtype::BF16, 16, 2e-3).await;
}

/// A LoRA adapter (rank 4 on every projection) on one row of a batch of two, in the browser's
/// WebGPU: that row follows the CPU reference with the adapter, the other the reference without,
/// f32; the adapter moves the logits well past the tolerance.
#[wasm_bindgen_test]
async fn browser_lora_row_beside_a_base_row() {
    let cfg = llama();
    let w = ModelWeights::random(&cfg, 18).unwrap();
    let adapter = LoraAdapter::random(&cfg, 4, 0.1, 2.0, 19);
    let mut rng = SplitMix64(20);
    let gpu = Gpu::new_async(&GpuOptions::default()).await.unwrap();
    let opts = EngineOptions { max_loras: 1, max_lora_rank: 4, ..EngineOptions::new(2, 32) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    e.load_lora("a", &adapter).unwrap();
    e.set_adapter(0, Some("a")).unwrap();
    let v = cfg.vocab;
    let ids: Vec<u32> = (0..18).map(|_| rng.below(v) as u32).collect();
    let out = e
        .step_async(&Batch::padded(&ids, 9, &[9, 9], None), Want::Logits)
        .await
        .and_then(StepOutput::into_logits)
        .unwrap();
    let base = reference::forward_with(&w, &ids[..9], RefOptions::default()).unwrap();
    web_sys_log(&format!("LoRA row 0 vs the base model: {:e}", max_abs_diff(out.row(0).unwrap(), &base[8 * v..])));
    for (row, lora) in [(0, Some(&adapter)), (1, None)] {
        let hist = &ids[row * 9..row * 9 + 9];
        let want = reference::forward_with(&w, hist, RefOptions { lora, ..Default::default() }).unwrap();
        let d = max_abs_diff(out.row(row).unwrap(), &want[8 * v..]);
        web_sys_log(&format!("LoRA row {row} (adapter: {}): |gpu - reference| = {d:e}", lora.is_some()));
        assert!(d <= 1e-4, "row {row}: {d}");
    }
    assert!(max_abs_diff(out.row(0).unwrap(), &base[8 * v..]) > 1e-2, "the adapter changes the logits");
}

/// Let the browser's event loop run once: the device's `lost` promise settles there.
async fn next_task() {
    let wait = js_sys::Promise::new(&mut |resolve, _| {
        let set_timeout = js_sys::Reflect::get(&js_sys::global(), &"setTimeout".into()).unwrap();
        js_sys::Function::from(set_timeout).call2(&JsValue::NULL, &resolve, &JsValue::from(0)).unwrap();
    });
    wasm_bindgen_futures::JsFuture::from(wait).await.unwrap();
}

/// A lost device (as when the browser reclaims a background tab's GPU) makes every later call an
/// error that says so, changes nothing, and a new `Gpu` + `Engine` decode correctly afterwards.
#[wasm_bindgen_test]
async fn browser_device_lost_then_rebuilt() {
    let cfg = tiny_agent();
    let w = ModelWeights::random(&cfg, 17).unwrap();
    let gpu = Gpu::new_async(&GpuOptions::default()).await.unwrap();
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(2, 32)).unwrap();
    e.step_async(&Batch::padded(&[1, 2, 3, 4], 2, &[2, 2], None), Want::Logits)
        .await
        .and_then(StepOutput::into_logits)
        .unwrap();
    gpu.device.destroy();
    next_task().await;
    for what in ["append", "append again"] {
        let err = e
            .step_async(&Batch::padded(&[5, 6], 1, &[1, 1], None), Want::Logits)
            .await
            .and_then(StepOutput::into_logits)
            .err()
            .unwrap_or_else(|| panic!("{what} succeeded"));
        assert!(matches!(err, Error::DeviceLost(_)), "{what}: {err}");
        assert!(err.to_string().contains("device lost"), "{err}");
    }
    assert!(matches!(e.reset(&[0]), Err(Error::DeviceLost(_))));
    assert_eq!(e.cache().lens(), &[2, 2], "nothing changed");
    drop(e);
    let gpu2 = Gpu::new_async(&GpuOptions::default()).await.unwrap();
    let mut e2 = Engine::new_async(&gpu2, &w, EngineOptions::new(2, 32)).await.unwrap();
    let out = e2
        .step_async(&Batch::padded(&[1, 2, 3, 0, 0, 0], 3, &[3, 0], None), Want::Logits)
        .await
        .and_then(StepOutput::into_logits)
        .unwrap();
    let want = reference::forward_with(&w, &[1, 2, 3], RefOptions::default()).unwrap();
    let d = max_abs_diff(out.row(0).unwrap(), &want[2 * cfg.vocab..]);
    assert!(d <= 1e-4, "rebuilt engine: {d}");
    web_sys_log(&format!("device lost, then rebuilt: worst |gpu - reference| = {d:e}"));
}

/// `turns[c]`: conversation c's user messages (token ids), one per turn, sampled with seed
/// `seeds[c]`. Conversations decode `answer` tokens a turn on `rows` of `e` (several at once: one
/// batched step for all), each continuing on its row. Returns each conversation's answers and,
/// per turn, the tokens kept.
async fn converse(
    e: &mut Engine,
    rows: &[usize],
    turns: &[Vec<Vec<u32>>],
    seeds: &[u32],
    answer: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<usize>>) {
    let n = rows.len();
    let mut convo: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut answers = vec![Vec::new(); n];
    let mut kept = vec![Vec::new(); n];
    let samplers: Vec<Sampler> = seeds.iter().map(|&s| Sampler::temperature(0.9, s)).collect();
    let n_turns = turns.iter().map(Vec::len).min().unwrap_or(0);
    for turn in 0..n_turns {
        let mut next = Vec::new();
        for (c, user) in turns.iter().map(|t| &t[turn]).enumerate() {
            convo[c].extend(user);
            kept[c].push(e.continue_row(rows[c], &convo[c]).unwrap());
            next.push(*convo[c].last().unwrap());
        }
        for _ in 0..answer {
            let ones = vec![1; n];
            let batch = Batch::padded(&next, 1, &ones, Some(rows)).samplers(&samplers[..]);
            let got = e.step_async(&batch, Want::Sampled).await.unwrap().into_sampled().unwrap();
            for c in 0..n {
                let tok = got[c].as_ref().unwrap().token;
                answers[c].push(tok);
                convo[c].push(tok);
                next[c] = tok;
            }
        }
    }
    (answers, kept)
}

/// Two conversations side by side, each continuing on its row across turns and decoding in one
/// batch with the other, sample exactly what each samples alone, and a new turn prefills only
/// what is new.
#[wasm_bindgen_test]
async fn two_conversations_at_once_equal_each_alone() {
    let gpu = Gpu::new_async(&GpuOptions::default()).await.unwrap();
    for cfg in [tiny_agent(), llama()] {
        let w = ModelWeights::random(&cfg, 18).unwrap();
        let turns = vec![
            vec![vec![5, 6, 7, 8, 9], vec![11, 12], vec![13, 14, 15]],
            vec![vec![20, 21, 22], vec![23, 24, 25, 26], vec![27]],
        ];
        let opts = |rows| EngineOptions { kv: KvDtype::F16, ..EngineOptions::new(rows, 64) };
        let mut both = Engine::new_async(&gpu, &w, opts(2)).await.unwrap();
        let (together, kept) = converse(&mut both, &[0, 1], &turns, &[100, 101], 6).await;
        for c in 0..2 {
            let mut one = Engine::new_async(&gpu, &w, opts(1)).await.unwrap();
            let (alone, _) = converse(&mut one, &[0], &turns[c..c + 1], &[100 + c as u32], 6).await;
            assert_eq!(together[c], alone[0], "{:?} conversation {c}", cfg.mlp);
            // turn 2 kept turn 1's prompt and answer (all but the answer's last token, which was
            // sampled, never appended)
            assert_eq!(kept[c][1], turns[c][0].len() + 6 - 1, "{:?} conversation {c}", cfg.mlp);
        }
        web_sys_log(&format!("{:?}: two conversations together equal each alone", cfg.mlp));
    }
}
