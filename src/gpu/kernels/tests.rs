//! The kernels' constant structs against their WGSL: every override set, every specialization a
//! valid module for each backend, labels that name the variant.

use super::*;
use crate::model::dtype::KvDtype;

/// The product sample: every switch on, Q4_1 weights, the wide shape.
fn wide_product() -> Product {
    Product {
        kernel: Kernel::MatmulWide,
        k: 64,
        x_stride: 64,
        out_rows: 96,
        out_stride: 96,
        out_offset: 0,
        format: WeightFormat::Q4_1,
        accumulate: true,
        softcap: 30.0,
        per_row: true,
        norm: Some(FusedNorm { weight: true, eps: 1e-6 }),
        act: Some(MlpKind::SwiGlu),
        bias: true,
        lanes: Lanes::Threads { outs: 8, wg: 8 },
        lora: Some(LoraEpilogue {
            row0: 32,
            t1: 96,
            t2: 0,
            max_rank: 16,
            slot_floats: 3 * 16 * 64,
            b0: 2 * 16 * 64,
            half: true,
        }),
    }
}

/// One of each kernel's constant structs, with every option on somewhere.
fn samples() -> Vec<Box<dyn Specialize>> {
    let paging = Paging { block_len: 16, max_blocks: 8 };
    let shard = Shard { row0: 0, rows: 4 };
    let shape = AttentionShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        q_stride: 128,
        kv: KvDtype::F16,
        scale: 0.25,
        softcap: 50.0,
        group_tokens: 64,
        span: 64,
        parts: 2,
        shard,
        paging,
    };
    let product = wide_product();
    // the experts' sum; the pairs' product below is the same with the weights read
    let sum = ExpertProduct {
        product: Product {
            kernel: Kernel::MatmulExperts,
            norm: None,
            per_row: false,
            softcap: 0.0,
            bias: false,
            lanes: Lanes::Fixed,
            lora: None,
            ..product
        },
        slots: RouteSlots { experts: 8, top_k: 2, stride: 4, offset: 2 },
        sum_slots: true,
        x_per_slot: true,
        token_block: 32,
        shared: true,
    };
    let (tile, query_tile, fused_rope) = (Some(64), None, None);
    let split = AttentionSplit { kernel: Kernel::AttentionSplit, shape, tile, query_tile, fused_rope };
    vec![
        Box::new(Embed { d: 64, part_start: 0, part_rows: 100, format: WeightFormat::F16, scale: 8.0 }),
        Box::new(RmsNorm {
            d: 64,
            eps: 1e-6,
            weight: true,
            accumulate: true,
            quantize: true,
            gather_last: true,
            lanes: FINAL_NORM_LANES,
        }),
        Box::new(product),
        Box::new(Product { kernel: Kernel::Matmul, norm: None, lanes: Lanes::Threads { outs: 1, wg: 64 }, ..product }),
        Box::new(Product { kernel: Kernel::MatmulNormed, lanes: Lanes::Fixed, ..product }),
        Box::new(Product { kernel: Kernel::MatmulWideSubgroup, ..product }),
        Box::new(Product { kernel: Kernel::MatmulSubgroup, lanes: Lanes::Subgroup(32), ..product }),
        Box::new(Product { kernel: Kernel::MatmulReduce, lanes: Lanes::Fixed, ..product }),
        Box::new(product.tiled()),
        Box::new(Product { kernel: Kernel::MatmulInt, norm: None, act: None, ..product }),
        Box::new(Quantize { k: 64, x_stride: 64, per_row: true }),
        Box::new(QkRope {
            heads: 4,
            head_dim: 16,
            stride: 128,
            qk_norm: true,
            qk_norm_whole: true,
            rotate: false,
            q_weight: true,
            eps: 1e-6,
            t_k_heads: 2,
            k_heads: 2,
            k_stride: 64,
            k_weight: true,
            kv_write: Some((KvDtype::BF16, paging)),
        }),
        Box::new(KvWrite {
            kv_heads: 2,
            head_dim: 16,
            ring_slots: 9,
            src_stride: 64,
            src_offset: 0,
            ring: true,
            kv: KvDtype::F16,
            shard,
            paging,
        }),
        Box::new(Attention { shape, window: 8, ring_slots: 9, global: true, local: true, split: true, sinks: true }),
        Box::new(AttentionSplit { fused_rope: Some(FusedRope { rotate: true, kv_write: true }), ..split }),
        Box::new(AttentionSplit { kernel: Kernel::AttentionSplitHead, tile: None, ..split }),
        Box::new(AttentionSplit { kernel: Kernel::AttentionQueryTiles, query_tile: Some(8), ..split }),
        Box::new(MlpAct { ffn: 64, act: MlpKind::GeluTanhGated }),
        Box::new(Commit { max_len: 32, ring_slots: 9, has_ring: true }),
        Box::new(Sample { vocab: 100, mask_words: 4, score: false, stat_rows: 2, stage: SampleStage::Whole }),
        Box::new(Sample { vocab: 100, mask_words: 4, score: true, stat_rows: 2, stage: SampleStage::Merge }),
        Box::new(Sample { vocab: 70000, mask_words: 2188, score: false, stat_rows: 2, stage: SampleStage::Chunks }),
        Box::new(Sample { vocab: 70000, mask_words: 2188, score: true, stat_rows: 2, stage: SampleStage::Radix(5) }),
        Box::new(Sample { vocab: 100, mask_words: 4, score: false, stat_rows: 2, stage: SampleStage::Kept }),
        Box::new(LogitBias { vocab: 100, slots: 16 }),
        Box::new(EngramGather { heads: 2, orders: 2, table_rows: 64, dim: 8, max_len: 32 }),
        Box::new(EngramMix { d: 64, eps: 1e-6 }),
        Box::new(Copy { n4: 1024 }),
        Box::new(MoeRoute {
            slots: RouteSlots { experts: 8, top_k: 2, stride: 4, offset: 2 },
            norm_topk: true,
            log_max_len: Some(32),
        }),
        Box::new(ExpertProduct {
            product: Product { act: Some(MlpKind::SwiGlu), lanes: Lanes::Threads { outs: 8, wg: 8 }, ..sum.product },
            sum_slots: false,
            x_per_slot: false,
            shared: false,
            ..sum
        }),
        Box::new(sum),
        Box::new(Lora {
            k: 64,
            x_stride: 64,
            targets: 3,
            max_rank: 16,
            slot_floats: 3 * 16 * 64 + 128 * 16,
            meta0: 0,
            norm: Some(FusedNorm { weight: true, eps: 1e-6 }),
            half: true,
            slices: 8,
        }),
    ]
}

/// Every constant a struct sets is an override its module declares, and every override
/// without a default is set: a renamed or added `override` in a WGSL file fails here.
#[test]
fn typed_constants_match_the_wgsl_overrides() {
    let samples = samples();
    for kernel in Kernel::ALL {
        assert!(samples.iter().any(|s| s.kernel() == kernel), "{kernel:?} has no sample here");
    }
    for spec in &samples {
        let kernel = spec.kernel();
        let module = naga::front::wgsl::parse_str(&kernel.source()).expect("kernels parse");
        let declared: Vec<(&str, bool)> =
            module.overrides.iter().filter_map(|(_, o)| Some((o.name.as_deref()?, o.init.is_some()))).collect();
        let set = spec.constants();
        for (name, _) in &set {
            assert!(
                declared.iter().any(|d| d.0 == *name),
                "{} ({kernel:?}) sets {name}, which {} does not declare",
                spec.label(),
                kernel.file()
            );
        }
        for (name, _) in declared.iter().filter(|d| !d.1) {
            assert!(set.iter().any(|c| c.0 == *name), "{} leaves {name} (no default) unset", spec.label());
        }
    }
}

/// Every sample specializes (as each pipeline does natively: `gpu/specialize.rs`) into a
/// module that validates and translates for Vulkan, Metal, DX12 and GL, with no override
/// left; a product's module for f32 weights keeps no block decoder, and one for Q4_1 does.
#[test]
fn every_kernel_specializes_to_a_valid_module_without_dead_branches() {
    use naga::back::{glsl, hlsl, msl, spv};
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let samples = samples();
    let f32_product = Product { format: WeightFormat::F32, ..wide_product() };
    for spec in samples.iter().map(|s| s.as_ref()).chain([&f32_product as &dyn Specialize]) {
        let kernel = spec.kernel();
        let parsed = crate::gpu::specialize::Parsed::new(&kernel.source()).expect("kernels parse");
        let m = parsed.specialize(kernel.entry_point(), &spec.constants()).expect("specializes");
        let label = spec.label();
        assert!(m.overrides.is_empty(), "{label}: overrides left");
        let info = Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&m)
            .unwrap_or_else(|e| panic!("{label}: the specialized module is invalid: {e:?}"));
        spv::write_vec(&m, &info, &spv::Options::default(), None).unwrap_or_else(|e| panic!("{label}: SPIR-V: {e}"));
        msl::write_string(&m, &info, &msl::Options::default(), &msl::PipelineOptions::default())
            .unwrap_or_else(|e| panic!("{label}: MSL: {e}"));
        let mut hlsl_out = String::new();
        hlsl::Writer::new(&mut hlsl_out, &hlsl::Options::default(), &hlsl::PipelineOptions::default())
            .write(&m, &info, None)
            .unwrap_or_else(|e| panic!("{label}: HLSL: {e}"));
        if !kernel.needs_subgroups() && !kernel.int_dot() {
            let mut glsl_out = String::new();
            let options = glsl::Options { version: glsl::Version::new_gles(310), ..Default::default() };
            let pipeline = glsl::PipelineOptions {
                shader_stage: naga::ShaderStage::Compute,
                entry_point: kernel.entry_point().to_string(),
                multiview: None,
            };
            glsl::Writer::new(
                &mut glsl_out,
                &m,
                &info,
                &options,
                &pipeline,
                naga::proc::BoundsCheckPolicies::default(),
            )
            .and_then(|mut w| w.write())
            .unwrap_or_else(|e| panic!("{label}: GLSL: {e}"));
        }
        if matches!(kernel, Kernel::MatmulWide | Kernel::MatmulWideSubgroup) {
            let decoder = m.functions.iter().any(|(_, f)| f.name.as_deref() == Some("block_dequant"));
            let f32_weights = std::ptr::addr_eq(spec, &f32_product as &dyn Specialize);
            assert_eq!(decoder, !f32_weights, "{label}: block_dequant kept: {decoder}");
        }
    }
}

#[test]
fn labels_name_the_variant() {
    let labels: Vec<String> = samples().iter().map(|s| s.label()).collect();
    assert!(labels.contains(&"kv_write_ring_f16".to_string()), "{labels:?}");
    assert!(labels.contains(&"matmul_wide_q4_1_normed_swiglu_bias_add_softcap_rows_lora".to_string()), "{labels:?}");
    assert!(labels.contains(&"attention_query_tiles8_f16".to_string()), "{labels:?}");
    let mut unique = labels.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), labels.len(), "two variants share a label: {labels:?}");
}
