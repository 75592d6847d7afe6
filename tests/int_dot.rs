//! The integer-dot products (`MatmulKernel::IntDot`): Q8_0 / Q4_0 / Q4_1 weights against
//! activations quantized per block of 32 to int8, summed with `dot4I8Packed`. Close to the
//! reference the way llama.cpp is (top-1 and mean |diff|, as f16 K/V is tested), and as exact
//! as every other variant: a row's logits never depend on the batch or the chunking.

mod common;

use common::*;
use kvdecode::model::quant::QuantKind;
use kvdecode::{Engine, EngineOptions, Fusion, MatmulKernel, ModelConfig, ModelWeights};

fn int_dot_engine(w: &ModelWeights, rows: usize) -> Engine {
    let mut opts = EngineOptions::new(rows, 48);
    opts.matmul = Some(MatmulKernel::IntDot);
    let e = Engine::new(&gpu(), w, opts).unwrap();
    assert_eq!(e.matmul_kernel(), MatmulKernel::IntDot);
    assert!(!e.fusion().norm, "the int-dot products read the normed input from its own dispatch");
    e
}

/// A model whose every matrix is in whole blocks of 32, quantized to `kind`: Llama's layout
/// (a gated MLP), or with `relu2` the seed's TinyAgent (relu^2, rings in every layer).
fn model_in(kind: QuantKind, relu2: bool) -> (String, ModelWeights) {
    let cfg = match relu2 {
        true => ModelConfig::tiny_agent(96, 64, 4, 2, 16, 128, 4, 2, 5),
        false => ModelConfig::llama(96, 64, 4, 2, 16, 96, 3, 10000.0, 1e-5, true),
    };
    (format!("{kind:?} {:?}", cfg.mlp), model(&cfg, 300 + relu2 as u64).quantized(kind).unwrap())
}

#[test]
fn int_dot_decode_is_close_to_the_reference() {
    // (pipelines of the int-dot products take lavapipe about 0.4 s each to build: few engines)
    let cases = [
        (QuantKind::Q8_0, false),
        (QuantKind::Q4_0, true),
        (QuantKind::Q4_1, false),
        (QuantKind::Q4_1, true),
        (QuantKind::Q5_0, false),
        (QuantKind::Q5_1, true),
        (QuantKind::IQ4NL, false),
    ];
    for (what, w) in cases.map(|(kind, relu2)| model_in(kind, relu2)) {
        let vocab = w.cfg.vocab as u32;
        let mut e = int_dot_engine(&w, 2);
        let seq: Vec<u32> = (0..40u32).map(|i| (i * 37 + 1) % vocab).collect();
        let mut ids = vec![0u32; 2 * 24];
        ids[..24].copy_from_slice(&seq[..24]);
        ids[24..24 + 11].copy_from_slice(&seq[..11]);
        e.append(&ids, 24, &[24, 11], None).unwrap();
        let (mut same_top, mut n, mut sum_diff, mut max_diff, mut scale) = (0, 0, 0.0f64, 0.0f32, 0.0f32);
        for p in 24..40 {
            let out = e.append(&[seq[p], seq[p - 13]], 1, &[1, 1], None).unwrap();
            for r in 0..2 {
                let got = out.row(r).unwrap();
                let want = ref_last(&w, e.cache().history(r));
                same_top += usize::from(kvdecode::argmax(got) == kvdecode::argmax(&want));
                n += 1;
                sum_diff += got.iter().zip(&want).map(|(a, b)| (a - b).abs() as f64).sum::<f64>();
                max_diff = max_diff.max(max_abs_diff(got, &want));
                scale = scale.max(want.iter().fold(0.0, |m, v| m.max(v.abs())));
            }
        }
        let mean = sum_diff / (n * w.cfg.vocab) as f64;
        println!("{what}: top-1 {same_top}/{n}, mean |diff| {mean:.2e}, max {max_diff:.2e}, logit scale {scale:.2}");
        assert!(same_top * 10 >= n * 9, "{what}: top-1 agrees at {same_top} of {n} steps");
        assert!(mean < 0.01 * scale as f64, "{what}: mean |diff| {mean} against logits up to {scale}");
        assert!(
            max_diff > 1e-3,
            "{what}: within {max_diff} of the reference, as the float products are: is the int-dot kernel running?"
        );
    }
}

#[test]
fn int_dot_rows_never_depend_on_the_batch_or_the_chunking() {
    for (what, w) in
        [model_in(QuantKind::Q4_1, false), model_in(QuantKind::Q8_0, true), model_in(QuantKind::Q5_0, false)]
    {
        let prompt: Vec<u32> = (0..13u32).map(|i| (i * 11 + 5) % 96).collect();
        // alone, prompt whole, then decode
        let mut alone = int_dot_engine(&w, 1);
        let mut want = vec![alone.append(&prompt, 13, &[13], None).unwrap().row(0).unwrap().to_vec()];
        for t in [7u32, 8, 9] {
            want.push(alone.append(&[t], 1, &[1], None).unwrap().row(0).unwrap().to_vec());
        }
        // row 2 of three, its prompt token by token beside other rows' prompts of 5 and 9
        let mut crowd = int_dot_engine(&w, 3);
        let others: Vec<u32> = (0..9u32).map(|i| (i * 5 + 2) % 96).collect();
        let mut got = Vec::new();
        for (j, &t) in prompt.iter().enumerate() {
            let ids = [others[j % 9], others[(j + 3) % 9], t];
            let out = crowd.append(&ids, 1, &[1, 1, 1], None).unwrap();
            if j == 12 {
                got.push(out.row(2).unwrap().to_vec());
            }
        }
        // then decode in a padded chunk of width 4 beside a row feeding 4 tokens (4-token blocks)
        for t in [7u32, 8, 9] {
            let ids = [1, 2, 3, 4, 0, 0, 0, 0, t, 0, 0, 0];
            let out = crowd.append(&ids, 4, &[4, 0, 1], None).unwrap();
            got.push(out.row(2).unwrap().to_vec());
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "{what} step {i}: the row in a crowd differs from the row alone by {}", max_abs_diff(g, w));
        }
    }
}

#[test]
fn matmul_variants_are_named_and_checked() {
    assert_eq!(MatmulKernel::parse("int-dot").unwrap(), MatmulKernel::IntDot);
    for k in MatmulKernel::ALL {
        assert_eq!(MatmulKernel::parse(k.name()).unwrap(), k);
    }
    let e = MatmulKernel::parse("int8").unwrap_err().to_string();
    assert!(e.contains("KVDECODE_MATMUL") && e.contains("int8"), "{e}");
    // the subgroup kernel on a device made without subgroups: an error that says why
    let portable = kvdecode::Gpu::with_options(&kvdecode::GpuOptions { portable: true, ..Default::default() }).unwrap();
    let w = model(&llama_cfg(), 7);
    let mut opts = EngineOptions::new(1, 16);
    opts.matmul = Some(MatmulKernel::Subgroup);
    let e = Engine::new(&portable, &w, opts).err().expect("subgroup kernel on a portable device").to_string();
    assert!(e.contains("subgroup"), "{e}");
    // f32 weights under int-dot take the float products: the reference's results within 1e-4
    opts.matmul = Some(MatmulKernel::IntDot);
    opts.fusion = Some(Fusion::ALL);
    let mut e = Engine::new(&portable, &w, opts).unwrap();
    let out = e.append(&[3, 4, 5], 3, &[3], None).unwrap();
    assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&w, &[3, 4, 5])) < 1e-4);
}
