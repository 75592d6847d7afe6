//! Fused kernels (`EngineOptions::fusion`): the block's input norm inside its products, the MLP
//! activation as the up projection's epilogue, the global K/V write inside RoPE. On the portable
//! kernels every fusion gives the same bits as the unfused dispatches; on the subgroup products a
//! fused norm sums in its own order, and stays exact (a row alone equals the row in a crowd) and
//! close to the reference.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Fusion, Gpu, GpuOptions, KvDtype, MatmulKernel, ModelConfig, ModelWeights};

/// Llama (SwiGLU), Qwen3-like (qk-norm), Gemma-like (GELU, post norms, local rings and a global
/// layer), and the seed's TinyAgent (relu^2, no norm weights, rings in every layer).
fn families() -> Vec<(&'static str, ModelWeights)> {
    let llama = llama_cfg();
    let mut qwen = ModelConfig::llama(96, 32, 4, 2, 8, 48, 2, 1e6, 1e-6, false);
    qwen.qk_norm = true;
    let mut gemma = ModelConfig::llama(96, 32, 4, 2, 8, 48, 4, 1e6, 1e-6, true);
    gemma.qk_norm = true;
    gemma.layers = (0..4)
        .map(|i| kvdecode::LayerSpec { global_group: (i == 3).then_some(0), writes_global: i == 3, local: i != 3 })
        .collect();
    gemma.window = 4;
    gemma.post_norms = true;
    gemma.norm = kvdecode::NormKind::OnePlusWeight;
    gemma.mlp = kvdecode::MlpKind::GeluTanhGated;
    let q4 = |cfg: &ModelConfig, seed| model(cfg, seed).quantized(kvdecode::model::quant::QuantKind::Q4_1).unwrap();
    vec![
        ("llama q4_1", q4(&llama, 181)),
        ("qwen3-like", model(&qwen, 182)),
        ("gemma-like", model(&gemma, 183)),
        ("tiny agent", model(&tiny_agent_cfg(), 184)),
    ]
}

/// Logits of a prefill (two rows, one padded), then three decode steps of both rows, then one
/// of row 1 alone; with f16 K/V when `half`.
fn run(gpu: &Gpu, w: &ModelWeights, fusion: Fusion, half: bool) -> Vec<Vec<f32>> {
    run_counted(gpu, w, fusion, half, product_kernel(gpu)).0
}

/// The subgroup products where the device has them, else the portable ones.
fn product_kernel(gpu: &Gpu) -> MatmulKernel {
    gpu.subgroup_size().map_or(MatmulKernel::Portable, |_| MatmulKernel::Subgroup)
}

/// [`run`], and the engine's dispatches per chunk.
fn run_counted(
    gpu: &Gpu,
    w: &ModelWeights,
    fusion: Fusion,
    half: bool,
    matmul: MatmulKernel,
) -> (Vec<Vec<f32>>, usize) {
    let mut opts = EngineOptions::new(2, 40);
    opts.fusion = Some(fusion);
    opts.matmul = Some(matmul);
    if half {
        opts.kv = KvDtype::F16;
    }
    let mut e = Engine::new(gpu, w, opts).unwrap();
    assert_eq!(e.fusion(), fusion);
    let mut out = prefill_then_decode(&mut e);
    let l = e.append(&[33], 1, &[1], Some(&[1])).unwrap();
    out.push(l.row(0).unwrap().to_vec());
    (out, e.dispatches_per_chunk())
}

fn portable() -> Gpu {
    Gpu::with_options(&GpuOptions { portable: true, ..Default::default() }).unwrap()
}

#[test]
fn every_fusion_gives_the_unfused_bits_on_the_portable_kernels() {
    let gpu = portable();
    let singles = [
        Fusion { norm: true, ..Fusion::NONE },
        Fusion { act: true, ..Fusion::NONE },
        Fusion { kv_write: true, ..Fusion::NONE },
        Fusion::ALL,
    ];
    for (name, w) in families() {
        for half in [false, true] {
            let (plain, plain_dispatches) = run_counted(&gpu, &w, Fusion::NONE, half, MatmulKernel::Portable);
            for f in singles {
                // the fused runs with f16 K/V take the wide products: the portable bits too
                let matmul = if half { MatmulKernel::Wide } else { MatmulKernel::Portable };
                let (fused, dispatches) = run_counted(&gpu, &w, f, half, matmul);
                assert!(fused == plain, "{name} (f16 K/V: {half}): {f:?} changed the logits");
                // every family has norms, an MLP and a writer layer: each fusion has work
                assert!(dispatches < plain_dispatches, "{name}: {f:?} saved no dispatch");
                // the tiled products (the prefill's 18 tokens take the mat-mat kernel) fused
                let (tiled, _) = run_counted(&gpu, &w, f, half, MatmulKernel::Tiled);
                assert!(tiled == plain, "{name} (f16 K/V: {half}): tiled products with {f:?} changed the logits");
            }
            // the workgroup-reduced products sum in their own order: fused against their own unfused
            let (plain, _) = run_counted(&gpu, &w, Fusion::NONE, half, MatmulKernel::Workgroup);
            let (fused, _) = run_counted(&gpu, &w, Fusion::ALL, half, MatmulKernel::Workgroup);
            assert!(fused == plain, "{name} (f16 K/V: {half}): fusing changed the workgroup products' logits");
        }
    }
}

#[test]
fn wide_subgroup_products_give_the_unfused_portable_bits_fused_or_not() {
    // the fused norm of `main_wide_subgroup` sums through shuffles in 8-lane workgroups on CPU
    // adapters, in rmsnorm.wgsl's order; every fusion must leave the portable unfused bits (on a
    // device made with its optional features, whatever KVDECODE_PORTABLE says)
    let gpu = Gpu::with_options(&GpuOptions { portable: false, ..Default::default() }).unwrap();
    if gpu.info.backend == wgpu::Backend::Vulkan && gpu.info.name.contains("llvmpipe") {
        assert_eq!(gpu.subgroup_size(), Some(8), "lavapipe has 8-wide subgroups: wide-subgroup must run");
    }
    if gpu.subgroup_size().is_none_or(|n| n < 8) {
        // no such subgroups (GL): the kernel is refused by name
        let w = model(&llama_cfg(), 185);
        let mut opts = EngineOptions::new(1, 16);
        opts.matmul = Some(MatmulKernel::WideSubgroup);
        let e = Engine::new(&gpu, &w, opts).err().expect("wide-subgroup without subgroups").to_string();
        assert!(e.contains("wide-subgroup"), "{e}");
        return;
    }
    let fusions = [Fusion::NONE, Fusion { norm: true, ..Fusion::NONE }, Fusion::ALL];
    for (name, w) in families() {
        for half in [false, true] {
            let (plain, _) = run_counted(&gpu, &w, Fusion::NONE, half, MatmulKernel::Portable);
            for f in fusions {
                let (shared, _) = run_counted(&gpu, &w, f, half, MatmulKernel::WideSubgroup);
                for (i, (a, b)) in plain.iter().zip(&shared).enumerate() {
                    assert!(a == b, "{name} (f16 K/V: {half}, {f:?}), logits {i}: off by {}", max_abs_diff(a, b));
                }
            }
        }
    }
}

#[test]
fn fused_kernels_on_the_default_path_are_exact_and_close_to_the_reference() {
    let gpu = gpu();
    println!("{}: subgroup fast path {:?}", gpu.describe(), gpu.subgroup_size());
    for (name, w) in families() {
        let plain = run(&gpu, &w, Fusion::NONE, false);
        // the activation and the K/V write change no sum: the same bits on any path
        let f = Fusion { act: true, kv_write: true, ..Fusion::NONE };
        assert!(run(&gpu, &w, f, false) == plain, "{name}: act / kv-write fusion changed the logits");
        let fused = run(&gpu, &w, Fusion::ALL, false);
        for (a, b) in fused.iter().zip(&plain) {
            assert!(max_abs_diff(a, b) <= 1e-4, "{name}: fused norm off by {}", max_abs_diff(a, b));
        }
        // the prefill's row 0 against the reference
        let prompt: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % 96).collect();
        assert!(max_abs_diff(&fused[0], &ref_last(&w, &prompt)) <= 1e-4, "{name}: fused prefill vs reference");
        // exact: row 1's last step alone equals the same step in a crowd of rows
        let mut opts = EngineOptions::new(4, 40);
        opts.fusion = Some(Fusion::ALL);
        opts.matmul = Some(product_kernel(&gpu));
        let mut e = Engine::new(&gpu, &w, opts).unwrap();
        let prompt: Vec<u32> = (0..4 * 9).map(|i| (i * 7 + 3) % 96).collect();
        e.append(&prompt, 9, &[9, 6, 9, 9], None).unwrap();
        for step in 0..3u32 {
            e.append(&[10 + step, 20 + step, 1, 2], 1, &[1, 1, 1, 1], None).unwrap();
        }
        let crowd = e.append(&[5, 33, 6, 7], 1, &[1; 4], None).unwrap();
        assert!(crowd.row(1).unwrap() == fused[8].as_slice(), "{name}: fused norm depends on the batch");
    }
}

#[test]
fn fusion_names_parse_and_a_misspelt_one_is_an_error() {
    assert_eq!(Fusion::parse("all").unwrap(), Some(Fusion::ALL));
    assert_eq!(Fusion::parse("none").unwrap(), Some(Fusion::NONE));
    assert_eq!(Fusion::parse("auto").unwrap(), None);
    assert_eq!(Fusion::parse("act, kv-write").unwrap(), Some(Fusion { act: true, kv_write: true, ..Fusion::NONE }));
    assert_eq!(Fusion::parse("rope").unwrap(), Some(Fusion { rope: true, ..Fusion::NONE }));
    let e = Fusion::parse("norm,mlp").unwrap_err().to_string();
    assert!(e.contains("\"mlp\""), "{e}");
}

/// RoPE inside split-group attention in steps of one token a row (`Fusion::rope`): its decode
/// steps give the bits of RoPE's own dispatch (the prompts take it either way, beside the query
/// tiles), with a dispatch a layer fewer. Head shapes 8, 32, 64 and 128 wide, 1 to 4 query heads
/// per kv head, 3 kv heads, a NoPE layer and a layer that reads another's keys; f32 K/V, and f16
/// and bf16 at one shape; contexts across partitions of 64 positions (the partition that holds
/// the token stores its key).
#[test]
fn rope_inside_split_attention_gives_the_bits_of_its_own_dispatch() {
    let mut shared = ModelConfig::llama(96, 32, 4, 2, 8, 48, 3, 1e4, 1e-6, false);
    shared.layers[2] = kvdecode::LayerSpec { global_group: Some(0), writes_global: false, local: false };
    shared.nope_layers = vec![1];
    let shapes = [
        ("llama, 2 heads of 8 per kv head", llama_cfg()),
        ("3 heads of 64 per kv head", ModelConfig::llama(96, 64, 6, 2, 64, 96, 2, 1e4, 1e-6, false)),
        ("3 kv heads, 2 heads of 32 each", ModelConfig::llama(96, 64, 6, 3, 32, 96, 2, 1e4, 1e-6, false)),
        ("4 heads of 128 on 1 kv head", ModelConfig::llama(96, 64, 4, 1, 128, 96, 2, 1e4, 1e-6, false)),
        ("a NoPE layer, a layer reading layer 0's keys", shared),
    ];
    let gpu = gpu();
    let fused = Fusion { rope: true, kv_write: true, ..Fusion::NONE };
    for (i, (name, cfg)) in shapes.into_iter().enumerate() {
        let w = model(&cfg, 186);
        // 16-bit K/V stores pairs of words: one shape is enough for its packing
        let kvs: &[KvDtype] = if i == 1 { &[KvDtype::F32, KvDtype::F16, KvDtype::BF16] } else { &[KvDtype::F32] };
        for &kv in kvs {
            let run = |fusion: Fusion| {
                let mut opts = EngineOptions::new(2, 80);
                opts.fusion = Some(fusion);
                opts.kv = kv;
                opts.attention = kvdecode::AttentionKernel::SplitGroup;
                let mut e = Engine::new(&gpu, &w, opts).unwrap();
                assert!(e.attention_query_tile() > 1, "{name}: query tiles take the prompts");
                let prompt: Vec<u32> = (0..2 * 66u32).map(|i| (i * 7 + 3) % 96).collect();
                let mut out = vec![e.append(&prompt, 66, &[66, 61], None).unwrap().row(0).unwrap().to_vec()];
                for step in 0..4u32 {
                    let l = e.append(&[10 + step, 20 + step], 1, &[1, 1], None).unwrap();
                    out.extend((0..2).map(|r| l.row(r).unwrap().to_vec()));
                }
                (out, e.dispatches_per_chunk())
            };
            let (plain, plain_dispatches) = run(Fusion { kv_write: true, ..Fusion::NONE });
            let (got, dispatches) = run(fused);
            for (i, (a, b)) in plain.iter().zip(&got).enumerate() {
                assert!(a == b, "{name} ({kv:?}), logits {i}: off by {}", max_abs_diff(a, b));
            }
            assert_eq!(dispatches + cfg.n_layers(), plain_dispatches, "{name}: a dispatch a layer fewer");
        }
    }
}
