//! The product kernels: the subgroup fast path (when the adapter has fixed-size subgroups), its
//! `workgroup` shape without subgroups, the portable kernel and its `wide` forms agree with each
//! other and with the reference, and `wide` and `wide-subgroup` give the portable bits. CI also runs the whole suite with
//! KVDECODE_PORTABLE=1.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Gpu, GpuOptions, MatmulKernel, ModelConfig, WeightDtype};

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
        let w = model(&cfg, 171).quantized(kvdecode::model::quant::QuantKind::Q4_1).unwrap();
        let w = if cfg.mlp == kvdecode::MlpKind::SwiGlu { model(&cfg, 171) } else { w };
        let ids: Vec<u32> = (0..30).map(|i| (i * 13 + 2) % 96).collect();
        let run = |gpu: &Gpu| {
            let mut opts = EngineOptions::new(2, 40);
            // the subgroup kernel wherever the device has it (lavapipe's default is `wide`)
            opts.matmul = Some(gpu.subgroup_size().map_or(MatmulKernel::Portable, |_| MatmulKernel::Subgroup));
            let mut e = Engine::new(gpu, &w, opts).unwrap();
            e.append(&ids, 15, &[15, 11], None).unwrap()
        };
        let (a, b) = (run(&fast), run(&portable));
        // the subgroup kernel's shape without subgroups: a workgroup per output, a tree in memory
        let mut opts = EngineOptions::new(2, 40);
        opts.matmul = Some(MatmulKernel::Workgroup);
        let mut e = Engine::new(&portable, &w, opts).unwrap();
        assert_eq!(e.matmul_kernel(), MatmulKernel::Workgroup);
        let c = e.append(&ids, 15, &[15, 11], None).unwrap();
        for r in 0..2 {
            let n = [15, 11][r];
            let want = ref_last(&w, &ids[r * 15..r * 15 + n]);
            assert!(max_abs_diff(a.row(r).unwrap(), &want) <= 1e-4);
            assert!(max_abs_diff(b.row(r).unwrap(), &want) <= 1e-4);
            assert!(max_abs_diff(c.row(r).unwrap(), &want) <= 1e-4, "workgroup row {r}");
            assert!(max_abs_diff(a.row(r).unwrap(), b.row(r).unwrap()) <= 1e-4);
        }
    }
}

#[test]
fn mat_vec_steps_equal_blocked_steps_bit_for_bit() {
    // steps of fewer than 4 tokens run one token per thread (mat-vec), larger ones 4 per thread:
    // a token's logits must not change between the two, on every product kernel
    let portable = Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap();
    let fast = common::gpu();
    let mut kernels = vec![
        (&portable, MatmulKernel::Portable),
        (&portable, MatmulKernel::Wide),
        (&portable, MatmulKernel::Workgroup),
    ];
    if fast.subgroup_size().is_some() {
        kernels.push((&fast, MatmulKernel::Subgroup));
    }
    if fast.subgroup_size().is_some_and(|n| n >= 8) {
        kernels.push((&fast, MatmulKernel::WideSubgroup));
    }
    for (gpu, matmul) in kernels {
        let w = model(&llama_cfg(), 172).quantized(kvdecode::model::quant::QuantKind::Q4_1).unwrap();
        let prompt: Vec<u32> = (0..5 * 6).map(|i| (i * 11 + 5) % 96).collect();
        let mut runs = Vec::new();
        for rows_in_step in [1usize, 2, 5] {
            let mut opts = EngineOptions::new(5, 40);
            opts.matmul = Some(matmul);
            let mut e = Engine::new(gpu, &w, opts).unwrap();
            e.append(&prompt, 6, &[6; 5], None).unwrap();
            // row 0 decodes next to `rows_in_step - 1` others (1 and 2 tokens: mat-vec; 5: blocked)
            let rows: Vec<usize> = (0..rows_in_step).collect();
            let ids: Vec<u32> = (0..rows_in_step as u32).map(|r| 7 + r).collect();
            let out = e.append(&ids, 1, &vec![1; rows_in_step], Some(&rows)).unwrap();
            runs.push(out.row(0).unwrap().to_vec());
        }
        assert!(
            runs[0] == runs[1] && runs[1] == runs[2],
            "{} ({}): a row's logits depend on the step's size",
            gpu.describe(),
            matmul.name()
        );
    }
}

/// Logits of a ragged prefill (2 rows of 9 and 6 tokens: 4-token blocks), then three decode steps
/// of both rows (mat-vec), with the product kernel `matmul`.
fn logits_with(gpu: &Gpu, w: &kvdecode::ModelWeights, weights: WeightDtype, matmul: MatmulKernel) -> Vec<Vec<f32>> {
    let mut opts = EngineOptions::new(2, 32);
    opts.weights = weights;
    opts.matmul = Some(matmul);
    let mut e = Engine::new(gpu, w, opts).unwrap();
    assert_eq!(e.matmul_kernel(), matmul);
    prefill_then_decode(&mut e)
}

/// Models for the bit-for-bit product tests: every weight format, and output counts that leave a
/// thread's (or a tile's) last outputs past the end (vocab 100, ffn 52).
fn product_cases() -> Vec<(String, kvdecode::ModelWeights, WeightDtype)> {
    use kvdecode::model::quant::QuantKind;
    let odd = ModelConfig::llama(100, 32, 4, 2, 8, 52, 2, 10000.0, 1e-5, false);
    let blocks = ModelConfig::llama(96, 64, 4, 2, 16, 96, 2, 10000.0, 1e-5, true);
    let k_blocks = ModelConfig::llama(96, 256, 4, 2, 64, 256, 1, 10000.0, 1e-5, false);
    let mut cases = vec![
        ("f32, odd sizes".to_string(), model(&odd, 190), WeightDtype::F32),
        ("f16, odd sizes".to_string(), model(&odd, 191), WeightDtype::F16),
        (
            "tiny agent q4_1".to_string(),
            model(&tiny_agent_cfg(), 192).quantized(QuantKind::Q4_1).unwrap(),
            WeightDtype::F32,
        ),
    ];
    for kind in BLOCK32_KINDS {
        cases.push((format!("{kind:?}"), model(&blocks, 193).quantized(kind).unwrap(), WeightDtype::F32));
    }
    // the blocks of 256 share their loops (a head, then one or two data words per 4 weights):
    // one format of each data-word count and head, Q3_K for the new ones, keeps this test's many
    // pipelines (each format is a pipeline per kernel) within CI's time; every format of them is
    // checked against the reference under each forced variant (tests/quantized.rs)
    for kind in [QuantKind::Q3K, QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K] {
        cases.push((format!("{kind:?}"), model(&k_blocks, 194).quantized(kind).unwrap(), WeightDtype::F32));
    }
    cases
}

#[test]
fn wide_products_give_the_portable_bits() {
    let gpu = Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap();
    let odd = ModelConfig::llama(100, 32, 4, 2, 8, 52, 2, 10000.0, 1e-5, false);
    let cases = product_cases();
    // wide-subgroup where the device, made with its optional features (whatever
    // KVDECODE_PORTABLE says), has subgroups of 8 lanes or more (lavapipe on Vulkan must),
    // against the portable kernel on that same device
    let fast = Gpu::with_options(&GpuOptions { portable: false, ..Default::default() }).unwrap();
    let shared_inputs = fast.subgroup_size().is_some_and(|n| n >= 8);
    if fast.info.backend == wgpu::Backend::Vulkan && fast.info.name.contains("llvmpipe") {
        assert!(shared_inputs, "lavapipe has 8-wide subgroups: wide-subgroup must run");
    }
    for (what, w, weights) in cases {
        let portable = logits_with(&gpu, &w, weights, MatmulKernel::Portable);
        let wide = logits_with(&gpu, &w, weights, MatmulKernel::Wide);
        for (i, (a, b)) in portable.iter().zip(&wide).enumerate() {
            assert!(a == b, "{what}, logits {i}: wide differs from portable by {}", max_abs_diff(a, b));
        }
        if weights == WeightDtype::F32 {
            // row 0 after the last step: its prompt of 9, then 10, 11, 12
            let want = ref_last(&w, &[3, 10, 17, 24, 31, 38, 45, 52, 59, 10, 11, 12]);
            assert!(max_abs_diff(&portable[6], &want) <= 1e-4, "{what}: portable against the reference");
        }
        if shared_inputs {
            let portable = logits_with(&fast, &w, weights, MatmulKernel::Portable);
            let shared = logits_with(&fast, &w, weights, MatmulKernel::WideSubgroup);
            for (i, (a, b)) in portable.iter().zip(&shared).enumerate() {
                assert!(a == b, "{what}, logits {i}: wide-subgroup differs from portable by {}", max_abs_diff(a, b));
            }
        }
    }
    if !shared_inputs {
        // a device without 8-lane subgroups refuses the kernel by name
        let w = model(&odd, 195);
        let mut opts = EngineOptions::new(1, 16);
        opts.matmul = Some(MatmulKernel::WideSubgroup);
        let e = Engine::new(&fast, &w, opts).err().expect("wide-subgroup without subgroups").to_string();
        assert!(e.contains("wide-subgroup") && e.contains("8 lanes"), "{e}");
    }
}

#[test]
fn tiled_products_give_the_portable_bits() {
    // the `tiled` variant takes the mat-mat kernel for products of 16 tokens or more and the
    // portable one below: a prefill of 2 x 9 (one tile, padded), three decode steps (mat-vec),
    // and a prefill of 3 x 21 tokens (two token tiles, the second partial), each against the
    // portable kernel bit for bit
    let gpu = Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap();
    assert_eq!(kvdecode::TILED_MIN_TOKENS, 16, "the prefills below are sized for this threshold");
    for (what, w, weights) in product_cases() {
        let portable = logits_with(&gpu, &w, weights, MatmulKernel::Portable);
        let tiled = logits_with(&gpu, &w, weights, MatmulKernel::Tiled);
        for (i, (a, b)) in portable.iter().zip(&tiled).enumerate() {
            assert!(a == b, "{what}, logits {i}: tiled differs from portable by {}", max_abs_diff(a, b));
        }
        let long = |matmul| {
            let mut opts = EngineOptions::new(3, 48);
            opts.weights = weights;
            opts.matmul = Some(matmul);
            let mut e = Engine::new(&gpu, &w, opts).unwrap();
            let vocab = e.config().vocab as u32;
            let prompt: Vec<u32> = (0..63u32).map(|i| (i * 5 + 1) % vocab).collect();
            let l = e.append(&prompt, 21, &[21, 17, 5], None).unwrap();
            (0..3).map(|r| l.row(r).unwrap().to_vec()).collect::<Vec<_>>()
        };
        let (a, b) = (long(MatmulKernel::Portable), long(MatmulKernel::Tiled));
        for r in 0..3 {
            assert!(a[r] == b[r], "{what}, long prefill row {r}: tiled differs by {}", max_abs_diff(&a[r], &b[r]));
        }
    }
}
