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
