//! The engine's parity tests inside a real browser (headless Chromium, WebGPU on SwiftShader):
//! cached incremental decoding equals the CPU reference, both layouts, f32, f16 and bf16 K/V
//! storage (16-bit storage against the reference that rounds K/V the same way); a lost device is an
//! error on every later call and a new engine works.
//! Run with scripts/web-test.sh (wasm-bindgen-test-runner + chromedriver).

use kvdecode::reference::{self, RefOptions};
use kvdecode::{argmax, Engine, EngineOptions, Error, Gpu, GpuOptions, KvDtype, ModelConfig, ModelWeights, SplitMix64};
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
        let out = e.append_async(&ids, width, &n_new, rows.as_deref()).await.unwrap();
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
    e.append_async(&[1, 2, 3, 4], 2, &[2, 2], None).await.unwrap();
    gpu.device.destroy();
    next_task().await;
    for what in ["append", "append again"] {
        let err = e.append_async(&[5, 6], 1, &[1, 1], None).await.err().unwrap_or_else(|| panic!("{what} succeeded"));
        assert!(matches!(err, Error::DeviceLost(_)), "{what}: {err}");
        assert!(err.to_string().contains("device lost"), "{err}");
    }
    assert!(matches!(e.reset(&[0]), Err(Error::DeviceLost(_))));
    assert_eq!(e.cache().lens(), &[2, 2], "nothing changed");
    drop(e);
    let gpu2 = Gpu::new_async(&GpuOptions::default()).await.unwrap();
    let mut e2 = Engine::new_async(&gpu2, &w, EngineOptions::new(2, 32)).await.unwrap();
    let out = e2.append_async(&[1, 2, 3, 0, 0, 0], 3, &[3, 0], None).await.unwrap();
    let want = reference::forward_with(&w, &[1, 2, 3], RefOptions::default()).unwrap();
    let d = max_abs_diff(out.row(0).unwrap(), &want[2 * cfg.vocab..]);
    assert!(d <= 1e-4, "rebuilt engine: {d}");
    web_sys_log(&format!("device lost, then rebuilt: worst |gpu - reference| = {d:e}"));
}
