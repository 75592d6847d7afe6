//! GGUF: a model written the way llama.cpp writes it (permuted Q/K rows, quantized blocks) loads
//! back to the same model; malformed and hostile files are clear errors, never panics.

mod common;

use common::gguf_writer::{write_llama, Store};
use common::*;
use kvdecode::io::gguf::GgufFile;
use kvdecode::model::quant::QuantKind;
use kvdecode::{model::reference, Engine, EngineOptions, ModelConfig, SplitMix64};

fn tiny() -> ModelConfig {
    ModelConfig::llama(96, 64, 4, 2, 16, 96, 2, 10000.0, 1e-5, false)
}

#[test]
fn gguf_round_trip_float_and_quantized() {
    let w = model(&tiny(), 121);
    let tokens: Vec<u32> = (0..20).map(|i| (i * 5 + 3) % 96).collect();
    for (wq, store) in [
        (w.clone(), Store::F32),
        (w.quantized(QuantKind::Q8_0).unwrap(), Store::Blocks),
        (w.quantized(QuantKind::Q4_1).unwrap(), Store::Blocks),
        (w.quantized(QuantKind::Q4_0).unwrap(), Store::Blocks),
    ] {
        let bytes = write_llama(&wq, store);
        let g = GgufFile::parse(bytes).unwrap();
        let back = g.weights().unwrap();
        // Q/K rows are back in Hugging Face order: the same model, bit for bit
        assert_eq!(back.cfg, wq.cfg);
        assert_eq!(back.layers[0].wq.data, wq.layers[0].wq.data);
        assert_eq!(back.layers[1].kv_global.as_ref().unwrap().data, wq.layers[1].kv_global.as_ref().unwrap().data);
        assert_eq!(reference::forward(&back, &tokens).unwrap(), reference::forward(&wq, &tokens).unwrap());
        // and on the GPU the quantized blocks are read directly
        let mut e = Engine::new(&gpu(), &back, EngineOptions::new(1, 32)).unwrap();
        let out = e.append(&tokens, 20, &[20], None).unwrap();
        assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&wq, &tokens)) <= 1e-4);
    }
    // F16 storage loads as the f16-rounded model
    let g = GgufFile::parse(write_llama(&w, Store::F16)).unwrap();
    assert_eq!(g.weights().unwrap().layers[0].wo.data, w.rounded_to_f16().layers[0].wo.data);
}

#[test]
fn gguf_errors_name_the_problem() {
    let w = model(&tiny(), 122);
    let good = write_llama(&w, Store::F32);
    let err = |b: Vec<u8>| format!("{}", GgufFile::parse(b).err().expect("must fail"));
    assert!(err(b"GGML....".to_vec()).contains("bad magic"));
    let mut v1 = good.clone();
    v1[4] = 1;
    assert!(err(v1).contains("version 1 is not supported"));
    assert!(err(good[..good.len() - 10].to_vec()).contains("run past the end"));
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    assert!(err(huge).contains("larger than the file"));
    // a missing tensor is named
    let mut cfg = tiny();
    cfg.tie_embeddings = true;
    let mut tied = model(&tiny(), 122);
    tied.head = None;
    tied.cfg = cfg;
    let g = GgufFile::parse(write_llama(&tied, Store::F32)).unwrap();
    assert!(g.weights().unwrap().cfg.tie_embeddings);
    // an unsupported architecture is named
    let mut arch = good.clone();
    let at = arch.windows(5).position(|x| x == b"llama").unwrap();
    arch[at..at + 5].copy_from_slice(b"mamba");
    let g = GgufFile::parse(arch).unwrap();
    assert!(format!("{}", g.weights().err().unwrap()).contains("architecture \"mamba\""));
}

#[test]
fn corrupted_tiny_gguf_never_panics() {
    let s = seed(123);
    let w = model(&tiny(), s).quantized(QuantKind::Q4_1).unwrap();
    let bytes = write_llama(&w, Store::Blocks);
    common::corrupt_and_load(&bytes, 400, s, 2048, Some(&gpu()));
}

#[test]
fn corrupted_safetensors_never_panic() {
    let s = seed(124);
    let mut rng = SplitMix64(s);
    let w = model(&tiny_agent_cfg(), s);
    let good = w.to_safetensors_bytes(kvdecode::DiskDtype::F16).unwrap();
    for _ in 0..400 {
        let mut b = good.clone();
        match rng.below(3) {
            0 => {
                let i = rng.below(b.len().min(4096));
                b[i] ^= 1 << rng.below(8);
            }
            1 => b.truncate(rng.below(b.len())),
            _ => b[..8].copy_from_slice(&(rng.next_u64() >> rng.below(64)).to_le_bytes()),
        }
        let _ = kvdecode::ModelWeights::from_safetensors_bytes(&b);
    }
}
