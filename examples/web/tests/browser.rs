//! The engine's parity tests inside a real browser (headless Chromium, WebGPU on SwiftShader):
//! cached incremental decoding equals the CPU reference, both layouts, f32, f16 and bf16 K/V
//! storage (16-bit storage against the reference that rounds K/V the same way).
//! Run with scripts/web-test.sh (wasm-bindgen-test-runner + chromedriver).

use kvdecode::reference::{self, RefOptions};
use kvdecode::{argmax, Engine, EngineOptions, Gpu, GpuOptions, KvDtype, ModelConfig, ModelWeights, SplitMix64};
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
