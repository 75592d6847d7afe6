//! The optional fast path (subgroup matmul, when the adapter has fixed-size subgroups) and the
//! forced-portable path agree with each other and with the reference. CI also runs the whole suite
//! with KVDECODE_PORTABLE=1.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Gpu, GpuOptions};

#[test]
fn fast_and_portable_paths_agree() {
    let fast = Gpu::with_options(&GpuOptions { portable: false, ..Default::default() }).unwrap();
    let portable = Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap();
    assert_eq!(portable.subgroup_size(), None, "portable mode must request no optional feature");
    println!("{}: subgroup fast path {:?}", fast.describe(), fast.subgroup_size());
    if fast.info.backend == wgpu::Backend::Vulkan && fast.info.name.contains("llvmpipe") {
        assert_eq!(fast.subgroup_size(), Some(8), "lavapipe has fixed 8-wide subgroups: the fast path must be on");
    }
    for cfg in [tiny_agent_cfg(), llama_cfg()] {
        let w = model(&cfg, 171).quantized(kvdecode::quant::QuantKind::Q4_1).unwrap();
        let w = if cfg.mlp == kvdecode::MlpKind::SwiGlu { model(&cfg, 171) } else { w };
        let ids: Vec<u32> = (0..30).map(|i| (i * 13 + 2) % 96).collect();
        let run = |gpu: &Gpu| {
            let mut e = Engine::new(gpu, &w, EngineOptions::new(2, 40)).unwrap();
            e.append(&ids, 15, &[15, 11], None).unwrap()
        };
        let (a, b) = (run(&fast), run(&portable));
        for r in 0..2 {
            let n = [15, 11][r];
            let want = ref_last(&w, &ids[r * 15..r * 15 + n]);
            assert!(max_abs_diff(a.row(r).unwrap(), &want) <= 1e-4);
            assert!(max_abs_diff(b.row(r).unwrap(), &want) <= 1e-4);
            assert!(max_abs_diff(a.row(r).unwrap(), b.row(r).unwrap()) <= 1e-4);
        }
    }
}

#[test]
fn mat_vec_steps_equal_blocked_steps_bit_for_bit() {
    // steps of fewer than 4 tokens run one token per thread (mat-vec), larger ones 4 per thread:
    // a token's logits must not change between the two, on both kernel paths
    for gpu in [common::gpu(), Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap()] {
        let w = model(&llama_cfg(), 172).quantized(kvdecode::quant::QuantKind::Q4_1).unwrap();
        let prompt: Vec<u32> = (0..5 * 6).map(|i| (i * 11 + 5) % 96).collect();
        let mut runs = Vec::new();
        for rows_in_step in [1usize, 2, 5] {
            let mut e = Engine::new(&gpu, &w, EngineOptions::new(5, 40)).unwrap();
            e.append(&prompt, 6, &[6; 5], None).unwrap();
            // row 0 decodes next to `rows_in_step - 1` others (1 and 2 tokens: mat-vec; 5: blocked)
            let rows: Vec<usize> = (0..rows_in_step).collect();
            let ids: Vec<u32> = (0..rows_in_step as u32).map(|r| 7 + r).collect();
            let out = e.append(&ids, 1, &vec![1; rows_in_step], Some(&rows)).unwrap();
            runs.push(out.row(0).unwrap().to_vec());
        }
        assert!(
            runs[0] == runs[1] && runs[1] == runs[2],
            "{}: a row's logits depend on the step's size",
            gpu.describe()
        );
    }
}
