//! Quantized weights stay quantized on the GPU (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K,
//! Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4 read in the shader); every
//! kernel that reads them (embedding gather, matrix products, LM head) matches the CPU
//! dequantize-then-multiply reference.

mod common;

use common::*;
use kvdecode::model::quant::{dequantize, quantize, QuantKind};
use kvdecode::{Engine, EngineOptions, ModelConfig, SplitMix64};

#[test]
fn quantize_dequantize_round_trip_is_close() {
    let mut rng = SplitMix64(5);
    let x: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
    for (kind, tol) in [
        (QuantKind::Q8_0, 0.02),
        (QuantKind::Q4_0, 0.35),
        (QuantKind::Q4_1, 0.25),
        (QuantKind::Q4K, 0.35),
        (QuantKind::Q6K, 0.1),
        (QuantKind::Q5_0, 0.15),
        (QuantKind::Q5_1, 0.12),
        (QuantKind::IQ4NL, 0.35),
        (QuantKind::Q5K, 0.2),
        (QuantKind::Q3K, 0.7),
        (QuantKind::Q2K, 1.1),
        (QuantKind::IQ4XS, 0.35),
        // E2M1's steps are coarse (8 to 12 of the scale) and the scale is the largest magnitude's
        // power of two, so the largest weights clip
        (QuantKind::MXFP4, 1.0),
    ] {
        let q = quantize(kind, &x).unwrap();
        assert_eq!(q.len(), 256 / kind.block_len() * kind.block_bytes());
        let y = dequantize(kind, &q, 256).unwrap();
        let err = max_abs_diff(&x, &y);
        assert!(err < tol, "{kind:?}: {err}");
    }
    assert!(dequantize(QuantKind::Q4_0, &[0; 17], 32).is_err());
}

/// Two rows of one sequence, `lag` tokens apart: a ragged prefill (`width` and `width - lag`
/// tokens), then decode steps up to position `end`, every row's logits within 1e-4 of the CPU
/// reference on the same (dequantized) weights.
fn decode_matches_reference(w: &kvdecode::ModelWeights, width: usize, lag: usize, end: usize, what: &str) {
    let vocab = w.cfg.vocab as u32;
    let mut e = Engine::new(&gpu(), w, EngineOptions::new(2, 48)).unwrap();
    let seq: Vec<u32> = (0..end as u32).map(|i| (i * 37 + 1) % vocab).collect();
    let mut ids = vec![0u32; 2 * width];
    ids[..width].copy_from_slice(&seq[..width]);
    ids[width..2 * width - lag].copy_from_slice(&seq[..width - lag]);
    e.append(&ids, width, &[width, width - lag], None).unwrap();
    for p in width..end {
        let out = e.append(&[seq[p], seq[p - lag]], 1, &[1, 1], None).unwrap();
        for r in 0..2 {
            let d = max_abs_diff(out.row(r).unwrap(), &ref_last(w, e.cache().history(r)));
            assert!(d <= 1e-4, "{what} row {r} pos {p}: {d}");
        }
    }
}

#[test]
fn quantized_models_match_dequantized_reference() {
    // dimensions in whole blocks of 32: every matrix quantizes
    let cfgs = [
        ModelConfig::tiny_agent(96, 64, 4, 2, 16, 128, 4, 2, 5),
        ModelConfig::llama(96, 64, 4, 2, 16, 96, 3, 10000.0, 1e-5, true),
    ];
    for cfg in cfgs {
        for kind in BLOCK32_KINDS {
            let w = model(&cfg, 111).quantized(kind).unwrap();
            assert!(w.embed.quant.is_some() && w.layers[0].wq.quant.is_some());
            decode_matches_reference(&w, 30, 13, 40, &format!("{kind:?} {:?}", cfg.mlp));
        }
    }
}

#[test]
fn k_quant_models_match_dequantized_reference() {
    // the formats in blocks of 256 stay in them on the GPU: every matrix here has rows of 256 or
    // 512 weights; embedding, projections, MLP and the LM head read them in the shader
    let cfg = ModelConfig::llama(96, 256, 4, 2, 64, 256, 2, 10000.0, 1e-5, false);
    for kind in [QuantKind::Q2K, QuantKind::Q3K, QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K, QuantKind::IQ4XS] {
        let w = model(&cfg, 112).quantized(kind).unwrap();
        let quantized = [&w.embed, w.head.as_ref().unwrap(), &w.layers[0].wq, &w.layers[1].mlp_out];
        assert!(quantized.iter().all(|m| m.quant.as_ref().is_some_and(|q| q.kind == kind)));
        decode_matches_reference(&w, 16, 7, 24, &format!("{kind:?}"));
    }
}

#[test]
fn dequantizers_match_llama_cpp() {
    // random blocks (sane f16 scales) and their values as llama.cpp dequantizes them: gguf-py's,
    // which scripts/fixtures/make_quant_blocks.py checked against ggml's own C dequantizers
    // (equal bits) when it wrote tests/data/*.blocks, *.f32
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    for kind in QuantKind::ALL {
        let name = kvdecode::WeightFormat::from(kind).name();
        let blocks = std::fs::read(dir.join(format!("{name}.blocks"))).unwrap();
        let want: Vec<f32> = std::fs::read(dir.join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got = dequantize(kind, &blocks, want.len()).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs {w}, not the same bits");
        }
    }
}
