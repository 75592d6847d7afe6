//! Hugging Face directories of the Llama, Qwen3 and Gemma 3 families, in the config forms older
//! and newer transformers write: tiny random models are written in HF naming, loaded back, and
//! decoded on the GPU against the CPU reference (Gemma 3's sliding-window ring wraps many times).

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use kvdecode::io::hf::{config_from_json, load_dir, Family};
use kvdecode::{Engine, EngineOptions, Matrix, ModelWeights, NormKind};
use serde_json::json;

fn save_hf(dir: &Path, config: &serde_json::Value, w: &ModelWeights, prefix: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let c = &w.cfg;
    let mut t: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut m = |name: String, x: &Matrix| t.push((name, vec![x.rows, x.cols], x.data.clone()));
    let rows = |x: &Matrix, from: usize, n: usize| {
        Matrix::new(n, x.cols, x.data[from * x.cols..(from + n) * x.cols].to_vec()).unwrap()
    };
    m(format!("{prefix}embed_tokens.weight"), &w.embed);
    if let Some(h) = &w.head {
        m("lm_head.weight".into(), h);
    }
    let kvd = c.n_kv_heads * c.head_dim;
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("{prefix}layers.{i}");
        let kv = l.kv_global.as_ref().or(l.kv_local.as_ref()).unwrap();
        m(format!("{p}.self_attn.q_proj.weight"), &l.wq);
        m(format!("{p}.self_attn.k_proj.weight"), &rows(kv, 0, kvd));
        m(format!("{p}.self_attn.v_proj.weight"), &rows(kv, kvd, kvd));
        m(format!("{p}.self_attn.o_proj.weight"), &l.wo);
        m(format!("{p}.mlp.gate_proj.weight"), &rows(&l.mlp_in, 0, c.ffn));
        m(format!("{p}.mlp.up_proj.weight"), &rows(&l.mlp_in, c.ffn, c.ffn));
        m(format!("{p}.mlp.down_proj.weight"), &l.mlp_out);
    }
    let mut v = |name: String, x: &Option<Vec<f32>>| {
        if let Some(x) = x {
            t.push((name, vec![x.len()], x.clone()));
        }
    };
    v(format!("{prefix}norm.weight"), &w.final_norm);
    let gemma = c.post_norms;
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("{prefix}layers.{i}");
        v(format!("{p}.input_layernorm.weight"), &l.attn_norm);
        v(format!("{p}.self_attn.q_norm.weight"), &l.q_norm);
        v(format!("{p}.self_attn.k_norm.weight"), &l.k_norm);
        if gemma {
            v(format!("{p}.post_attention_layernorm.weight"), &l.post_attn_norm);
            v(format!("{p}.pre_feedforward_layernorm.weight"), &l.mlp_norm);
            v(format!("{p}.post_feedforward_layernorm.weight"), &l.post_mlp_norm);
        } else {
            v(format!("{p}.post_attention_layernorm.weight"), &l.mlp_norm);
        }
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        t.into_iter().map(|(n, s, d)| (n, s, d.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    let out = safetensors::tensor::serialize(views, None::<HashMap<String, String>>).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

fn decode_against_reference(w: &ModelWeights, tol: f32) {
    let mut e = Engine::new(&gpu(), w, EngineOptions::new(2, 64)).unwrap();
    let seq: Vec<u32> = (0..40).map(|i| (i * 19 + 7) % 96).collect();
    let mut ids = vec![0u32; 2 * 12];
    ids[..12].copy_from_slice(&seq[..12]);
    ids[12..17].copy_from_slice(&seq[20..25]);
    e.append(&ids, 12, &[12, 5], None).unwrap();
    for p in 12..40 {
        let out = e.append(&[seq[p], seq[(p + 13) % 40]], 1, &[1, 1], None).unwrap();
        for r in 0..2 {
            let d = max_abs_diff(out.row(r).unwrap(), &ref_last(w, e.cache().history(r)));
            assert!(d <= tol, "row {r} pos {p}: {d}");
        }
    }
}

fn base(model_type: &str) -> serde_json::Value {
    json!({"model_type": model_type, "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": false})
}

#[test]
fn qwen3_directory_matches_reference() {
    let mut cfg = base("qwen3");
    cfg["rope_theta"] = json!(1000000.0);
    let (c, fam) = config_from_json(&cfg.to_string()).unwrap();
    assert_eq!(fam, Family::Qwen3);
    assert!(c.qk_norm && c.norm == NormKind::Weight && c.rope_theta == 1e6);
    let w = model(&c, 141);
    let dir = std::env::temp_dir().join(format!("kvdecode-qwen3-{}", std::process::id()));
    save_hf(&dir, &cfg, &w, "model.");
    let back = load_dir(&dir).unwrap();
    assert_eq!(back, w);
    decode_against_reference(&back, 1e-4);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gemma3_directory_matches_reference_with_ring_wraparound() {
    // newer form: layer_types + per-layer-type rope_parameters, multimodal-style prefix
    let mut cfg = base("gemma3_text");
    cfg["layer_types"] = json!(["sliding_attention", "full_attention", "sliding_attention", "full_attention"]);
    cfg["sliding_window"] = json!(4);
    cfg["query_pre_attn_scalar"] = json!(16);
    cfg["final_logit_softcapping"] = json!(30.0);
    cfg["rope_parameters"] = json!({"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
    cfg["tie_word_embeddings"] = json!(true);
    let (c, fam) = config_from_json(&cfg.to_string()).unwrap();
    assert_eq!(fam, Family::Gemma3);
    assert_eq!((c.rope_theta, c.rope_theta_local, c.window), (1e6, 1e4, 4));
    assert!(c.layers[0].local && c.layers[0].global_group.is_none() && c.layers[1].writes_global);
    assert_eq!(c.attn_scale, 0.25);
    assert_eq!(c.embed_scale, 32f32.sqrt());
    let w = model(&c, 142);
    let dir = std::env::temp_dir().join(format!("kvdecode-gemma3-{}", std::process::id()));
    save_hf(&dir, &cfg, &w, "language_model.model.");
    let back = load_dir(&dir).unwrap();
    assert_eq!(back, w);
    decode_against_reference(&back, 1e-4);
    std::fs::remove_dir_all(&dir).ok();

    // older form: sliding_window_pattern + rope_theta / rope_local_base_freq
    let mut old = base("gemma3_text");
    old.as_object_mut().unwrap().remove("tie_word_embeddings");
    old["sliding_window_pattern"] = json!(2);
    old["sliding_window"] = json!(4);
    old["rope_theta"] = json!(1000000.0);
    old["rope_local_base_freq"] = json!(10000.0);
    let (c2, _) = config_from_json(&old.to_string()).unwrap();
    assert_eq!(c2.layers, c.layers);
    assert_eq!((c2.rope_theta, c2.rope_theta_local), (1e6, 1e4));
    assert!(c2.tie_embeddings, "gemma ties embeddings by default");
}

#[test]
fn llama_config_forms_and_unknown_architectures() {
    let mut a = base("llama");
    a["rope_theta"] = json!(500000.0);
    let mut b = base("llama");
    b["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 500000.0});
    assert_eq!(config_from_json(&a.to_string()).unwrap().0, config_from_json(&b.to_string()).unwrap().0);
    let mut scaled = base("llama");
    scaled["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 8.0});
    assert!(format!("{}", config_from_json(&scaled.to_string()).unwrap_err()).contains("rope_type \"dynamic\""));
    let mut other = base("mamba");
    other["architectures"] = json!(["MambaForCausalLM"]);
    let e = format!("{}", config_from_json(&other.to_string()).unwrap_err());
    assert!(e.contains("model_type=\"mamba\"") && e.contains("MambaForCausalLM"), "{e}");
    let mut huge = base("llama");
    huge["num_hidden_layers"] = json!(1u64 << 31);
    assert!(format!("{}", config_from_json(&huge.to_string()).unwrap_err()).contains("layers is more than"));
}

#[test]
fn qwen3_and_gemma3_gguf_match_reference() {
    use common::gguf_writer::{write_arch, Store};
    let mut q = base("qwen3");
    q["rope_theta"] = json!(1000000.0);
    let mut g = base("gemma3_text");
    g["num_hidden_layers"] = json!(6); // llama.cpp's Gemma 3: layers 6, 12, ... are global
    g["sliding_window"] = json!(4);
    g["tie_word_embeddings"] = json!(true);
    for (cfg, arch) in [(q, "qwen3"), (g, "gemma3")] {
        let (c, _) = config_from_json(&cfg.to_string()).unwrap();
        let w = model(&c, 143).quantized(kvdecode::model::quant::QuantKind::Q8_0).unwrap();
        let bytes = write_arch(&w, Store::Blocks, arch, Vec::new());
        let back = kvdecode::io::gguf::GgufFile::parse(bytes).unwrap().weights().unwrap();
        assert_eq!(back.cfg.layers, w.cfg.layers, "{arch}");
        // the same model (Gemma's 1 + w norms arrive pre-added): same reference logits
        let seq: Vec<u32> = (0..20).map(|i| (i * 11 + 5) % 96).collect();
        let a = kvdecode::model::reference::forward(&w, &seq).unwrap();
        let b = kvdecode::model::reference::forward(&back, &seq).unwrap();
        assert!(max_abs_diff(&a, &b) <= 1e-5, "{arch}: {}", max_abs_diff(&a, &b));
        decode_against_reference(&back, 1e-4);
    }
}

#[test]
fn newer_families_gguf_match_reference() {
    use common::gguf_writer::{write_arch, Store};
    use kvdecode::model::rope::{Rope, RopeScaling};
    // Qwen2 with biases and YaRN
    let mut q = base("qwen2");
    q["rope_scaling"] = json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16});
    q["rope_theta"] = json!(1000000.0);
    // SmolLM3: every fourth layer NoPE (llama.cpp's rule; its GGUF says nothing about it)
    let mut s = base("smollm3");
    s["num_hidden_layers"] = json!(8);
    // Llama 3.1's scaling, which GGUF files carry as per-pair divisors (rope_freqs.weight)
    let mut l = base("llama");
    l["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16});
    // Gemma 2: even layers slide, an attention softcap small enough to bend these scores
    let mut g = base("gemma2");
    g["sliding_window"] = json!(4);
    g["attn_logit_softcapping"] = json!(3.0);
    g["tie_word_embeddings"] = json!(true);
    // OLMo 2: post-norms only, qk-norm over the whole projection
    let o = base("olmo2");
    // each in one of the block formats llama.cpp's Q4_K_M files fall back to for narrow rows
    use kvdecode::model::quant::QuantKind::{IQ4NL, Q5_0, Q5_1, Q8_0};
    let cases =
        [(q, "qwen2", Q5_0), (s, "smollm3", Q5_1), (l, "llama", IQ4NL), (g, "gemma2", Q8_0), (o, "olmo2", Q5_0)];
    for (cfg, arch, kind) in cases {
        let (c, _) = config_from_json(&cfg.to_string()).unwrap();
        let w = model(&c, 144).quantized(kind).unwrap();
        let mut written = w.clone();
        if let Some(RopeScaling::Llama3 { .. }) = &c.rope_scaling {
            // what llama.cpp's converter stores: the default frequency over the scaled one
            let scaled =
                Rope { theta: c.rope_theta, scaling: c.rope_scaling.clone(), dims: None }.frequencies(c.head_dim, 1).0;
            let plain = Rope { theta: c.rope_theta, scaling: None, dims: None }.frequencies(c.head_dim, 1).0;
            let divisors = plain.iter().zip(&scaled).map(|(p, s)| (p / s) as f32).collect();
            written.cfg.rope_scaling = Some(RopeScaling::Divisors(divisors));
        }
        let bytes = write_arch(&written, Store::Blocks, arch, Vec::new());
        let back = kvdecode::io::gguf::GgufFile::parse(bytes).unwrap().weights().unwrap();
        assert_eq!(back.cfg.layers, w.cfg.layers, "{arch}");
        assert_eq!(back.cfg.nope_layers, w.cfg.nope_layers, "{arch}");
        assert_eq!(back.cfg.qkv_bias, w.cfg.qkv_bias, "{arch}");
        assert_eq!(back.cfg.attn_softcap, w.cfg.attn_softcap, "{arch}");
        assert_eq!((back.cfg.pre_norms, back.cfg.qk_norm_whole), (w.cfg.pre_norms, w.cfg.qk_norm_whole), "{arch}");
        // the same model: the same reference logits (Llama 3.1's divisors are f32-rounded)
        let seq: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 96).collect();
        let a = kvdecode::model::reference::forward(&w, &seq).unwrap();
        let b = kvdecode::model::reference::forward(&back, &seq).unwrap();
        assert!(max_abs_diff(&a, &b) <= 1e-4, "{arch}: {}", max_abs_diff(&a, &b));
        decode_against_reference(&back, 1e-4);
    }
}

#[test]
fn newer_family_configs_read_as_transformers_reads_them() {
    use kvdecode::model::rope::RopeScaling;
    // Qwen2: biases; the window from max_window_layers on, only with use_sliding_window
    let mut q = base("qwen2");
    q["sliding_window"] = json!(8);
    q["max_window_layers"] = json!(2);
    let (c, fam) = config_from_json(&q.to_string()).unwrap();
    assert_eq!(fam, Family::Qwen2);
    assert!(c.qkv_bias && !c.has_local(), "no window without use_sliding_window");
    q["use_sliding_window"] = json!(true);
    let (c, _) = config_from_json(&q.to_string()).unwrap();
    assert_eq!(c.layers.iter().map(|l| l.local).collect::<Vec<_>>(), [false, false, true, true]);
    assert_eq!(c.window, 8);
    // legacy rope_scaling wins over rope_parameters; YaRN's defaults
    q["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e4});
    q["rope_scaling"] = json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32});
    let (c, _) = config_from_json(&q.to_string()).unwrap();
    match c.rope_scaling {
        Some(RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, attention_factor, truncate }) => {
            assert_eq!((factor, original_context, beta_fast, beta_slow, truncate), (4.0, 32, 32.0, 1.0, true));
            assert!((attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        }
        ref other => panic!("{other:?}"),
    }
    // Mistral: every layer slides when the window is set, none when it is null
    let mut m = base("mistral");
    m["sliding_window"] = json!(6);
    let (c, fam) = config_from_json(&m.to_string()).unwrap();
    assert_eq!(fam, Family::Llama);
    assert!(c.layers.iter().all(|l| l.local && l.global_group.is_none()) && c.window == 6);
    m["sliding_window"] = serde_json::Value::Null;
    assert!(!config_from_json(&m.to_string()).unwrap().0.has_local());
    // SmolLM3: no_rope_layers flags (1 rotates), or every fourth by default; tied by default
    let mut s = base("smollm3");
    s.as_object_mut().unwrap().remove("tie_word_embeddings");
    let (c, fam) = config_from_json(&s.to_string()).unwrap();
    assert_eq!((fam, c.nope_layers.clone(), c.tie_embeddings, c.rope_theta), (Family::SmolLM3, vec![3], true, 2e6));
    s["no_rope_layers"] = json!([0, 1, 1, 0]);
    assert_eq!(config_from_json(&s.to_string()).unwrap().0.nope_layers, [0, 3]);
    s["no_rope_layers"] = json!([0, 1]);
    assert!(format!("{}", config_from_json(&s.to_string()).unwrap_err()).contains("2 no_rope_layers for 4 layers"));
    // Gemma 2: alternating windows, transformers' softcap defaults (an explicit null turns one off)
    let mut g = base("gemma2");
    g["sliding_window"] = json!(6);
    let (c, fam) = config_from_json(&g.to_string()).unwrap();
    assert_eq!(fam, Family::Gemma2);
    assert_eq!(c.layers.iter().map(|l| l.local).collect::<Vec<_>>(), [true, false, true, false]);
    assert_eq!(
        (c.attn_softcap, c.logit_softcap, c.qk_norm, c.norm),
        (Some(50.0), Some(30.0), false, NormKind::OnePlusWeight)
    );
    g["final_logit_softcapping"] = serde_json::Value::Null;
    assert_eq!(config_from_json(&g.to_string()).unwrap().0.logit_softcap, None);
    // head_dim and num_key_value_heads left out: each config class's default, not hidden / heads
    // everywhere (Qwen3's 128 and Gemma's 256; Mistral's 8 KV heads, Llama's as many as the heads)
    for (model_type, head_dim, kv_heads) in [
        ("qwen3", 128, 32),
        ("gemma2", 256, 4),
        ("gemma3_text", 256, 4),
        ("mistral", 8, 8),
        ("llama", 8, 32),
        ("phi3", 8, 32),
    ] {
        let mut c = base(model_type);
        (c["hidden_size"], c["num_attention_heads"], c["sliding_window"]) = (json!(256), json!(32), json!(6));
        c.as_object_mut().unwrap().remove("head_dim");
        c.as_object_mut().unwrap().remove("num_key_value_heads");
        let (c, _) = config_from_json(&c.to_string()).unwrap();
        assert_eq!((c.head_dim, c.n_kv_heads), (head_dim, kv_heads), "{model_type}: head_dim and KV heads left out");
    }
    // gpt-oss with only the keys a hand-written config has: GptOssConfig's defaults (head_dim 64,
    // 8 KV heads, attention biases, window 128 on every other layer from the first, theta 150000,
    // YaRN 32x over 4096 untruncated, eps 1e-5)
    let mut g = base("gpt_oss");
    for key in ["head_dim", "num_key_value_heads", "rms_norm_eps"] {
        g.as_object_mut().unwrap().remove(key);
    }
    (g["hidden_size"], g["num_attention_heads"], g["num_local_experts"]) = (json!(64), json!(8), json!(4));
    g["num_experts_per_tok"] = json!(2);
    let (c, fam) = config_from_json(&g.to_string()).unwrap();
    assert_eq!(fam, Family::GptOss);
    assert_eq!((c.head_dim, c.n_kv_heads, c.window, c.rope_theta, c.norm_eps), (64, 8, 128, 150000.0, 1e-5));
    assert_eq!(c.layers.iter().map(|l| l.local).collect::<Vec<_>>(), [true, false, true, false]);
    assert!(c.qkv_bias && c.o_bias && c.attn_sinks && c.moe.as_ref().is_some_and(|m| m.bias && m.norm_topk));
    match c.rope_scaling {
        Some(RopeScaling::Yarn { factor, original_context, truncate, .. }) => {
            assert_eq!((factor, original_context, truncate), (32.0, 4096, false))
        }
        ref other => panic!("{other:?}"),
    }
    g["swiglu_limit"] = json!(5.0);
    assert!(format!("{}", config_from_json(&g.to_string()).unwrap_err()).contains("swiglu_limit=5"));
    // OLMo 2: output norms only, qk-norm over the whole projection, transformers' eps default
    let mut o = base("olmo2");
    o.as_object_mut().unwrap().remove("rms_norm_eps");
    let (c, fam) = config_from_json(&o.to_string()).unwrap();
    assert_eq!(fam, Family::Olmo2);
    assert_eq!((c.pre_norms, c.post_norms, c.qk_norm, c.qk_norm_whole, c.norm_eps), (false, true, true, true, 1e-5));
    // Phi-3: LongRoPE with the original context at the top level (it wins), partial rotary, every
    // layer sliding when the window is shorter than the trained context; older configs say "su"
    let mut p = base("phi3");
    p["max_position_embeddings"] = json!(1024);
    p["original_max_position_embeddings"] = json!(64);
    p["sliding_window"] = json!(32);
    p["rope_scaling"] = json!({"type": "su", "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 4.0],
                               "original_max_position_embeddings": 9999});
    p["partial_rotary_factor"] = json!(0.75);
    let (c, fam) = config_from_json(&p.to_string()).unwrap();
    assert_eq!(fam, Family::Phi3);
    assert_eq!((c.rope_dims, c.window), (Some(6), 32));
    assert!(c.layers.iter().all(|l| l.local));
    match c.rope_scaling {
        Some(RopeScaling::LongRope { ref short, ref long, original_context, attention_factor }) => {
            assert_eq!(
                (short.as_slice(), long.as_slice(), original_context),
                (&[1.0, 1.5, 2.0][..], &[2.0, 3.0, 4.0][..], 64)
            );
            // transformers' default: sqrt(1 + ln(1024 / 64) / ln(64))
            assert!((attention_factor - (1.0 + 16f32.ln() / 64f32.ln()).sqrt()).abs() < 1e-6);
        }
        ref other => panic!("{other:?}"),
    }
    p["sliding_window"] = json!(1024);
    assert!(!config_from_json(&p.to_string()).unwrap().0.has_local(), "a window of the whole context hides nothing");
    p["rope_scaling"]["long_factor"] = json!([2.0, 3.0]);
    let e = format!("{}", config_from_json(&p.to_string()).unwrap_err());
    assert!(e.contains("2 long_factor values for 6 rotated dimensions"), "{e}");
    // partial rotary reorders a head's dimensions, which per-dimension qk-norm weights would not follow
    let mut q = base("qwen3");
    q["partial_rotary_factor"] = json!(0.5);
    let e = format!("{}", config_from_json(&q.to_string()).unwrap_err());
    assert!(e.contains("rope_dims 4 of head_dim 8 together with qk_norm"), "{e}");
    // what is still unsupported names the key and its value
    let mut bad = base("llama");
    bad["rope_scaling"] =
        json!({"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "long_factor": [1.0]});
    let e = format!("{}", config_from_json(&bad.to_string()).unwrap_err());
    assert!(e.contains("rope_type \"longrope\" needs `short_factor`"), "{e}");
    bad["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0});
    assert!(format!("{}", config_from_json(&bad.to_string()).unwrap_err()).contains("needs `low_freq_factor`"));
    let mut biased = base("llama");
    biased["attention_bias"] = json!(true);
    assert!(format!("{}", config_from_json(&biased.to_string()).unwrap_err()).contains("attention_bias=true"));
}
