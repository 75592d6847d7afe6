//! Config validation and safetensors round trips (f32, f16, bf16 on disk).

mod common;

use common::*;
use kvdecode::{model::reference, DiskDtype, Error, LayerSpec, ModelConfig, ModelWeights};

#[test]
fn invalid_configs_are_named() {
    let mut c = tiny_agent_cfg();
    c.n_kv_heads = 3;
    assert!(format!("{}", c.validate().unwrap_err()).contains("not divisible by n_kv_heads"));
    let mut c = tiny_agent_cfg();
    c.head_dim = 7;
    assert!(format!("{}", c.validate().unwrap_err()).contains("head_dim 7 must be even"));
    let mut c = tiny_agent_cfg();
    c.window = 0;
    assert!(format!("{}", c.validate().unwrap_err()).contains("window must be >= 1"));
    let mut c = llama_cfg();
    c.layers[1] = LayerSpec { global_group: Some(2), writes_global: false, local: false };
    assert!(format!("{}", c.validate().unwrap_err()).contains("layer 1 reads group 2 before any layer wrote it"));
    let mut c = llama_cfg();
    c.layers[0] = LayerSpec { global_group: None, writes_global: false, local: false };
    assert!(matches!(c.validate(), Err(Error::Config(_))));
}

#[test]
fn safetensors_round_trip_every_dtype() {
    for cfg in [tiny_agent_cfg(), llama_cfg()] {
        let w = model(&cfg, 51);
        let tokens = [1u32, 5, 9, 2, 77];
        for dt in [DiskDtype::F32, DiskDtype::F16, DiskDtype::BF16] {
            let bytes = w.to_safetensors_bytes(dt).unwrap();
            let back = ModelWeights::from_safetensors_bytes(&bytes).unwrap();
            assert_eq!(back.cfg, w.cfg);
            if dt == DiskDtype::F32 {
                assert_eq!(back, w);
            }
            let tol = match dt {
                DiskDtype::F32 => 0.0,
                DiskDtype::F16 => 0.05,
                DiskDtype::BF16 => 0.5,
            };
            let a = reference::forward(&w, &tokens).unwrap();
            let b = reference::forward(&back, &tokens).unwrap();
            let d = max_abs_diff(&a, &b);
            assert!(d <= tol, "{dt:?}: {d}");
        }
    }
    // a mixture of experts' routers and stacked experts come back as they were
    for cfg in moe_cfgs() {
        let w = model(&cfg, 51);
        let back = ModelWeights::from_safetensors_bytes(&w.to_safetensors_bytes(DiskDtype::F32).unwrap()).unwrap();
        assert_eq!(back, w);
    }
}

#[test]
fn half_precision_weights_stay_16_bit_on_the_gpu() {
    let w = model(&llama_cfg(), 53);
    let gpu = gpu();
    let f32_bytes = kvdecode::Engine::new(&gpu, &w, kvdecode::EngineOptions::new(1, 16)).unwrap().weight_bytes();
    for dt in [DiskDtype::F16, DiskDtype::BF16] {
        let back = ModelWeights::from_safetensors_bytes(&w.to_safetensors_bytes(dt).unwrap()).unwrap();
        // f32 engine options, yet the 16-bit matrices are stored 16-bit (f16 / bf16 pairs)
        let mut e = kvdecode::Engine::new(&gpu, &back, kvdecode::EngineOptions::new(1, 16)).unwrap();
        assert_eq!(e.weight_bytes() * 2, f32_bytes, "{dt:?}");
        let ids = [3u32, 9, 27, 81, 50];
        let out = e.append(&ids, 5, &[5], None).unwrap();
        let d = max_abs_diff(out.row(0).unwrap(), &ref_last(&back, &ids));
        assert!(d <= 1e-4, "{dt:?}: {d}");
    }
}

#[test]
fn gemma_style_model_runs_on_the_engine() {
    // local-only and global-only layers alternating, 1 + w norms, post norms, gelu-tanh, softcap,
    // embedding scale, qk-norm with weights, a different RoPE base on local layers
    let mut c = ModelConfig::llama(96, 32, 4, 2, 8, 48, 4, 1e6, 1e-6, true);
    for (i, l) in c.layers.iter_mut().enumerate() {
        if i % 2 == 0 {
            *l = LayerSpec { global_group: None, writes_global: false, local: true };
        }
    }
    for (g, l) in c.layers.iter_mut().filter(|l| l.global_group.is_some()).enumerate() {
        l.global_group = Some(g);
    }
    c.window = 4;
    c.norm = kvdecode::NormKind::OnePlusWeight;
    c.post_norms = true;
    c.qk_norm = true;
    c.mlp = kvdecode::MlpKind::GeluTanhGated;
    c.logit_softcap = Some(30.0);
    c.embed_scale = (32f32).sqrt();
    c.rope_theta_local = 1e4;
    c.validate().unwrap();
    let w = model(&c, 52);
    let gpu = gpu();
    let mut e = kvdecode::Engine::new(&gpu, &w, kvdecode::EngineOptions::new(2, 40)).unwrap();
    let seq: Vec<u32> = (0..30).map(|i| (i * 11 % 96) as u32).collect();
    let mut ids = vec![0u32; 2 * 12];
    ids[..12].copy_from_slice(&seq[..12]);
    ids[12..17].copy_from_slice(&seq[..5]);
    e.append(&ids, 12, &[12, 5], None).unwrap();
    for p in 12..30 {
        let out = e.append(&[seq[p], seq[p - 7]], 1, &[1, 1], None).unwrap();
        for r in 0..2 {
            let want = ref_last(&w, e.cache().history(r));
            let d = max_abs_diff(out.row(r).unwrap(), &want);
            assert!(d <= 1e-4, "row {r} pos {p}: {d}");
        }
    }
}

#[test]
fn rows_longer_than_the_trained_context_need_an_explicit_opt_out() {
    let mut cfg = llama_cfg();
    cfg.context_len = Some(32);
    let w = model(&cfg, 91);
    let gpu = gpu();
    let err = kvdecode::Engine::new(&gpu, &w, kvdecode::EngineOptions::new(1, 33)).err().unwrap().to_string();
    assert!(err.contains("max_len 33") && err.contains("trained context of 32"), "{err}");
    assert!(err.contains("beyond_trained_context"), "the error names the opt-out: {err}");
    kvdecode::Engine::new(&gpu, &w, kvdecode::EngineOptions::new(1, 32)).unwrap();
    let opts = kvdecode::EngineOptions { beyond_trained_context: true, ..kvdecode::EngineOptions::new(1, 64) };
    kvdecode::Engine::new(&gpu, &w, opts).unwrap();
    // the config keeps it through a safetensors round trip
    let back =
        kvdecode::ModelWeights::from_safetensors_bytes(&w.to_safetensors_bytes(kvdecode::DiskDtype::F32).unwrap())
            .unwrap();
    assert_eq!(back.cfg.context_len, Some(32));
    // the examples' default: the trained context, capped by a K/V budget
    let kv = kvdecode::KvDtype::F16;
    assert_eq!(kvdecode::KvCache::fit_max_len(&gpu, &w.cfg, 4, kv, 1 << 30, 1024), 32);
    // 3 groups x K and V x 2 KV heads x 8 dims x 2 bytes = 192 bytes per position and row
    assert_eq!(kvdecode::KvCache::fit_max_len(&gpu, &w.cfg, 4, kv, 192 * 4 * 10, 1024), 10);
}

/// An engine streamed from a file (`Engine::from_file`: the plan from the header, then each
/// tensor written into its places as an update writes) holds what the engine of the same file's
/// host weights holds, bit for bit, in each format and its conversions: a GGUF of llama-quantize's
/// Q4_K_M mix (Llama's interleaved Q/K rows; K and V of different block types, so the fused K/V
/// is held as values), Hugging Face directories with biases (Qwen2) and with gpt-oss's MXFP4
/// `_blocks`/`_scales` experts, and a kvdecode file with Engram's tables and ids. The fixture
/// tests hold the streamed engines to transformers and llama.cpp; this test holds the two load
/// paths to each other, which those tolerances could not.
#[test]
fn an_engine_streamed_from_a_file_equals_the_engine_of_its_host_weights() {
    use kvdecode::io::model_file::ModelFile;
    use kvdecode::{Engine, EngineOptions};
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let demo = std::env::temp_dir().join(format!("kvdecode-streamed-{}.safetensors", std::process::id()));
    ModelWeights::demo().save_safetensors(&demo, DiskDtype::F32).unwrap();
    let gpu = gpu();
    for path in [
        root.join("llamacpp/mixes/llama.q4_k_m.gguf"),
        root.join("hf/qwen2"),
        root.join("hf/gpt_oss_mxfp4"),
        demo.clone(),
    ] {
        let file = ModelFile::open(&path).unwrap();
        let host = file.weights().unwrap();
        let tokens: Vec<u32> = (0..12).map(|i| (i * 37 % host.cfg.vocab) as u32).collect();
        let opts = EngineOptions::new(1, 32);
        let logits =
            |mut e: Engine| e.append(&tokens, tokens.len(), &[tokens.len()], None).unwrap().row(0).unwrap().to_vec();
        let streamed = logits(Engine::from_file(&gpu, &file, opts).unwrap());
        assert_eq!(streamed, logits(Engine::new(&gpu, &host, opts).unwrap()), "{}", path.display());
        println!("{}: {} logits equal", path.display(), streamed.len());
    }
    let _ = std::fs::remove_file(&demo);
}

/// A file that lacks a tensor, or holds one in another shape, is refused with the tensor's name
/// when it is opened: its header is checked against the model's plan before anything is read or
/// allocated.
#[test]
fn a_streamed_load_names_a_missing_or_misshapen_tensor() {
    use kvdecode::io::model_file::ModelFile;
    let w = model(&llama_cfg(), 3);
    let full = w.to_safetensors_bytes(DiskDtype::F32).unwrap();
    let st = safetensors::SafeTensors::deserialize(&full).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&full).unwrap();
    const VICTIM: &str = "blocks.1.attn.w_o.weight";
    // each tensor's new shape, or `None` to leave it out
    type Reshape = dyn Fn(&str, Vec<usize>) -> Option<Vec<usize>>;
    let rewrite = |f: &Reshape| {
        let kept: Vec<(String, Vec<usize>, Vec<u8>, safetensors::Dtype)> = st
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| {
                let shape = f(&n, v.shape().to_vec())?;
                let size = v.data().len() / v.shape().iter().product::<usize>();
                let bytes = v.data()[..shape.iter().product::<usize>() * size].to_vec();
                Some((n, shape, bytes, v.dtype()))
            })
            .collect();
        let views = kept
            .iter()
            .map(|(n, s, b, d)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()));
        safetensors::tensor::serialize(views, meta.metadata().clone()).unwrap()
    };
    let missing = rewrite(&|n, s| (n != VICTIM).then_some(s));
    let misshapen = rewrite(&|n, s| Some(if n == VICTIM { vec![s[0] / 2, s[1]] } else { s }));
    for (bytes, want) in [(missing, "is missing"), (misshapen, "shape")] {
        let err = ModelFile::from_safetensors_bytes(bytes).err().unwrap().to_string();
        assert!(err.contains(VICTIM) && err.contains(want), "{err}");
        println!("{err}");
    }
}
