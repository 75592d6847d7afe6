//! Every kernel is validated by naga and translated to SPIR-V, MSL, HLSL and GLSL (ES 3.1), with
//! its override constants resolved both at their defaults and with every bool flipped on, so a
//! shader that would break on Metal, DX12 or GL fails here first. No GPU needed.

use kvdecode::gpu::shaders::{Bind, Kernel};
use naga::back::PipelineConstants;
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Values for the overrides that have no default (a model-like configuration).
fn required(kernel: Kernel) -> &'static [(&'static str, f64)] {
    match kernel {
        Kernel::Embed => &[("D", 64.0), ("PART_ROWS", 100.0)],
        Kernel::RmsNorm => &[("D", 64.0), ("EPS", 1e-6)],
        Kernel::Matmul
        | Kernel::MatmulWide
        | Kernel::MatmulNormed
        | Kernel::MatmulWideSubgroup
        | Kernel::MatmulTiled
        | Kernel::MatmulReduce
        | Kernel::MatmulExperts => &[("K", 64.0), ("X_STRIDE", 64.0), ("O_ROWS", 96.0), ("OUT_STRIDE", 96.0)],
        Kernel::QkRope => &[("HEADS", 4.0), ("D", 16.0), ("STRIDE", 64.0)],
        Kernel::KvWrite => &[("HK", 2.0), ("D", 16.0), ("RING_SLOTS", 33.0), ("SRC_STRIDE", 128.0)],
        Kernel::Attention => &[("H", 4.0), ("HK", 2.0), ("D", 16.0), ("Q_STRIDE", 128.0), ("SCALE", 0.25)],
        Kernel::AttentionSplit | Kernel::AttentionSplitHead | Kernel::AttentionQueryTiles => &[
            ("H", 4.0),
            ("HK", 2.0),
            ("D", 16.0),
            ("Q_STRIDE", 128.0),
            ("SCALE", 0.25),
            ("BLOCK", 16.0),
            ("MAX_BLOCKS", 16.0),
            ("SPAN", 64.0),
            ("PARTS", 4.0),
        ],
        Kernel::MlpAct => &[("F", 64.0), ("ACT", 1.0)],
        Kernel::Commit => &[("MAX_LEN", 32.0)],
        Kernel::Sample | Kernel::SampleChunks | Kernel::SampleRadix | Kernel::SampleKept | Kernel::SampleMerge => {
            &[("V", 100.0), ("MASK_WORDS", 4.0)]
        }
        Kernel::LogitBias => &[("V", 100.0), ("SLOTS", 16.0)],
        Kernel::EngramGather => {
            &[("HEADS", 2.0), ("N_ORDERS", 2.0), ("TABLE_ROWS", 64.0), ("DIM", 8.0), ("MAX_LEN", 32.0)]
        }
        Kernel::EngramMix => &[("D", 64.0), ("EPS", 1e-6)],
        Kernel::MatmulSubgroup => {
            &[("K", 64.0), ("X_STRIDE", 64.0), ("O_ROWS", 96.0), ("OUT_STRIDE", 96.0), ("SG", 8.0)]
        }
        Kernel::Copy => &[("N4", 1024.0)],
        Kernel::Quantize => &[("K", 64.0), ("X_STRIDE", 96.0)],
        Kernel::MatmulInt => {
            &[("K", 64.0), ("X_STRIDE", 64.0), ("O_ROWS", 96.0), ("OUT_STRIDE", 96.0), ("W_FORMAT", 2.0)]
        }
        Kernel::MoeRoute => &[("EXPERTS", 8.0), ("TOP_K", 2.0), ("ROUTE_STRIDE", 4.0), ("ROUTE_OFFSET", 2.0)],
        Kernel::Lora => &[
            ("K", 64.0),
            ("X_STRIDE", 64.0),
            ("TARGETS", 3.0),
            ("MAX_RANK", 16.0),
            ("SLOT_FLOATS", 5120.0),
            ("META0", 0.0),
            ("AX_STRIDE", 56.0),
        ],
    }
}

/// Weight formats: f16, bf16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (f32 is the default).
const WEIGHT_FORMATS: [(&str, f64); 7] = [
    ("W_FORMAT", 1.0),
    ("W_FORMAT", 5.0),
    ("W_FORMAT", 2.0),
    ("W_FORMAT", 3.0),
    ("W_FORMAT", 4.0),
    ("W_FORMAT", 6.0),
    ("W_FORMAT", 7.0),
];

/// Values of integer overrides that pick a variant (each is translated too).
fn variants(kernel: Kernel) -> Vec<(&'static str, f64)> {
    match kernel {
        // K/V storage: f16 pairs, bf16 pairs (f32 is the default)
        Kernel::KvWrite | Kernel::Attention | Kernel::AttentionSplit | Kernel::AttentionSplitHead => {
            vec![("KV_FORMAT", 1.0), ("KV_FORMAT", 5.0)]
        }
        // and tiles of 8 tokens
        Kernel::AttentionQueryTiles => vec![("KV_FORMAT", 1.0), ("KV_FORMAT", 5.0), ("QT", 8.0)],
        // products: every weight format, and the fused activations (relu^2, a gated one)
        Kernel::Matmul
        | Kernel::MatmulNormed
        | Kernel::MatmulSubgroup
        | Kernel::MatmulTiled
        | Kernel::MatmulReduce
        | Kernel::MatmulExperts => [&WEIGHT_FORMATS[..], &[("MLP_ACT", 1.0), ("MLP_ACT", 3.0)]].concat(),
        // the wide shapes also at 8 outputs per thread and in 8-lane workgroups (the shuffled norm)
        Kernel::MatmulWide | Kernel::MatmulWideSubgroup => {
            [&WEIGHT_FORMATS[..], &[("MLP_ACT", 1.0), ("MLP_ACT", 3.0), ("OUTS", 8.0), ("WG", 8.0)]].concat()
        }
        Kernel::Embed => WEIGHT_FORMATS.to_vec(),
        // integer-dot products: Q4_0, Q4_1 (Q8_0 is required()'s), a gated activation
        Kernel::MatmulInt => vec![("W_FORMAT", 3.0), ("W_FORMAT", 4.0), ("MLP_ACT", 3.0)],
        // LoRA's A x with its rows' inputs split over 8 lanes (the GPUs' shape)
        Kernel::Lora => vec![("SLICES", 8.0)],
        _ => vec![],
    }
}

fn translate_all(kernel: Kernel, flip_bools: bool, variant: Option<(&str, f64)>) {
    let name = kernel.file();
    let src = kernel.source();
    let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
    // pack2x16float / unpack2x16float are core WGSL; naga gates them behind this capability
    let caps = if kernel.needs_subgroups() {
        Capabilities::SHADER_FLOAT16_IN_FLOAT32 | Capabilities::SUBGROUP
    } else {
        Capabilities::SHADER_FLOAT16_IN_FLOAT32
    };
    let info = Validator::new(ValidationFlags::all(), caps)
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: validation: {e:?}"));
    let mut constants = PipelineConstants::default();
    for (k, v) in required(kernel) {
        constants.insert((*k).to_string(), *v);
    }
    if let Some((k, v)) = variant {
        constants.insert(k.to_string(), v);
    }
    if flip_bools {
        for (_, o) in module.overrides.iter() {
            let is_bool =
                matches!(module.types[o.ty].inner, naga::TypeInner::Scalar(s) if s.kind == naga::ScalarKind::Bool);
            if is_bool {
                if let Some(n) = &o.name {
                    constants.insert(n.clone(), 1.0);
                }
            }
        }
    }
    let ep = (naga::ShaderStage::Compute, kernel.entry_point());
    let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, Some(ep), &constants)
        .unwrap_or_else(|e| panic!("{name}: overrides: {e:?}"));

    let spv = naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
        .unwrap_or_else(|e| panic!("{name}: SPIR-V: {e:?}"));
    assert!(!spv.is_empty());

    let msl_opts = naga::back::msl::Options { lang_version: (2, 1), ..Default::default() };
    let msl_pipe = naga::back::msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, kernel.entry_point().into())),
        ..Default::default()
    };
    let (msl, _) = naga::back::msl::write_string(&module, &info, &msl_opts, &msl_pipe)
        .unwrap_or_else(|e| panic!("{name}: MSL: {e:?}"));
    assert!(msl.contains("kernel"));

    let mut hlsl = String::new();
    let hlsl_opts = naga::back::hlsl::Options::default();
    let hlsl_pipe = naga::back::hlsl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, kernel.entry_point().into())),
    };
    naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_opts, &hlsl_pipe)
        .write(&module, &info, None)
        .unwrap_or_else(|e| panic!("{name}: HLSL: {e:?}"));
    assert!(hlsl.contains("numthreads"));

    let mut glsl = String::new();
    let glsl_opts =
        naga::back::glsl::Options { version: naga::back::glsl::Version::new_gles(310), ..Default::default() };
    let glsl_pipe = naga::back::glsl::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: kernel.entry_point().into(),
        multiview: None,
    };
    naga::back::glsl::Writer::new(
        &mut glsl,
        &module,
        &info,
        &glsl_opts,
        &glsl_pipe,
        naga::proc::BoundsCheckPolicies::default(),
    )
    .and_then(|mut w| w.write())
    .unwrap_or_else(|e| panic!("{name}: GLSL: {e:?}"));
    assert!(glsl.contains("local_size_x"));
}

#[test]
fn every_kernel_translates_to_every_backend() {
    for k in Kernel::ALL {
        translate_all(k, false, None);
        translate_all(k, true, None);
        for v in variants(k) {
            translate_all(k, false, Some(v));
            translate_all(k, true, Some(v));
        }
    }
}

/// The bind group layouts are made from `Kernel::bindings()`; naga's reflection of each module
/// says what its WGSL declares. They must agree binding for binding (group 0, in order, uniform
/// or storage, read-only or read-write), so neither can change without the other.
#[test]
fn kernel_bindings_match_the_wgsl_declarations() {
    use naga::{AddressSpace, StorageAccess};
    for k in Kernel::ALL {
        let module = naga::front::wgsl::parse_str(&k.source()).unwrap_or_else(|e| panic!("{}: {e}", k.file()));
        let mut declared: Vec<(u32, Bind, String)> = module
            .global_variables
            .iter()
            .filter_map(|(_, g)| {
                let rb = g.binding.as_ref()?;
                assert_eq!(rb.group, 0, "{}: {:?} is outside group 0", k.file(), g.name);
                let bind = match g.space {
                    AddressSpace::Uniform => Bind::Uniform,
                    AddressSpace::Storage { access } if access.contains(StorageAccess::STORE) => Bind::ReadWrite,
                    AddressSpace::Storage { .. } => Bind::Read,
                    other => panic!("{}: {:?} binds {other:?}", k.file(), g.name),
                };
                Some((rb.binding, bind, g.name.clone().unwrap_or_default()))
            })
            .collect();
        declared.sort_by_key(|d| d.0);
        let indices: Vec<u32> = declared.iter().map(|d| d.0).collect();
        assert_eq!(indices, (0..declared.len() as u32).collect::<Vec<_>>(), "{}: bindings are not 0..n", k.file());
        let kinds: Vec<Bind> = declared.iter().map(|d| d.1).collect();
        // WebGPU's default limit, which browsers keep: a ninth storage buffer is refused there
        let storage = kinds.iter().filter(|&&b| b != Bind::Uniform).count();
        assert!(storage <= 8, "{}: {storage} storage buffers, WebGPU allows 8 per stage", k.file());
        let names: Vec<&str> = declared.iter().map(|d| d.2.as_str()).collect();
        assert_eq!(
            k.bindings(),
            &kinds[..],
            "{:?} ({}): Kernel::bindings() disagrees with the WGSL, which declares {names:?}",
            k,
            k.file()
        );
    }
}

#[test]
fn every_binding_has_a_shape_comment() {
    for k in Kernel::ALL {
        for line in k.source().lines().filter(|l| l.contains("@binding(") && !l.contains("var<uniform>")) {
            assert!(line.contains("// ["), "{}: binding without a shape comment: {line}", k.file());
        }
    }
}

/// Bitwise exactness on GPU compilers: a float multiply feeding an add (or a subtract) may be
/// compiled to one fused multiply-add or to two rounded operations, and the compiler may choose
/// per code instance and per pipeline, so one value computed in two places could differ in its
/// last bit (WGSL allows the fusion; the one H200 failure seen so far was another fold, f16
/// rounding: common.wgsl's `f16_bits`). The kernels
/// write every such multiply-add as an explicit `fma`, and use no `dot` (a sum of products in an
/// order of the compiler's choosing). This finds a multiply or dot that feeds an add directly or
/// through a `let`; one stored in a `var` first is beyond its sight.
#[test]
fn no_float_multiply_feeds_an_add() {
    use naga::{BinaryOperator as Op, Expression as E, MathFunction, ScalarKind, TypeInner};
    let mut found = Vec::new();
    for kernel in Kernel::ALL {
        let src = kernel.source();
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32 | Capabilities::SUBGROUP;
        let info = Validator::new(ValidationFlags::all(), caps)
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(naga::valid::SubgroupOperationSet::all())
            .validate(&module)
            .unwrap();
        let functions = module.functions.iter().map(|(h, f)| (f, &info[h]));
        let entries = module.entry_points.iter().enumerate().map(|(i, ep)| (&ep.function, info.get_entry_point(i)));
        for (f, fi) in functions.chain(entries) {
            let is_float = |h: naga::Handle<naga::Expression>| match fi[h].ty.inner_with(&module.types) {
                TypeInner::Scalar(s) | TypeInner::Vector { scalar: s, .. } => s.kind == ScalarKind::Float,
                _ => false,
            };
            let is_product = |h: naga::Handle<naga::Expression>| {
                matches!(f.expressions[h], E::Binary { op: Op::Multiply, .. } | E::Math { fun: MathFunction::Dot, .. })
            };
            for (h, e) in f.expressions.iter() {
                if let E::Binary { op: Op::Add | Op::Subtract, left, right } = *e {
                    if is_float(h) && (is_product(left) || is_product(right)) {
                        found.push(format!("{} fn {}", kernel.file(), f.name.as_deref().unwrap_or("?")));
                    }
                }
            }
        }
    }
    found.dedup();
    assert!(found.is_empty(), "a float multiply feeds an add (write it as fma): {found:#?}");
}
