//! `kvdecode bench --tables formats`: the model's weights in each block format, GPU time of the
//! products per decode step against Q4_1's, same run.

use kvdecode::{Engine, EngineOptions, Gpu, ModelWeights, Profile, Sampler, SplitMix64};

use crate::common::Result;

/// The model's weights requantized to each block format (matrices whose rows are not whole
/// blocks stay as they are): GPU time of the products and of the whole step per decode step (1
/// row, context 128, timestamp queries, after two untimed steps), the median of `rounds` rounds
/// that each visit every format, and the products' time against Q4_1's.
pub fn formats_table(gpu: &Gpu, model: &ModelWeights, steps: usize, rounds: usize) -> Result<Vec<serde_json::Value>> {
    use kvdecode::model::quant::QuantKind;
    let kinds = [
        QuantKind::Q4_1,
        QuantKind::Q4_0,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::IQ4NL,
        QuantKind::Q8_0,
        QuantKind::IQ4XS,
        QuantKind::Q2K,
        QuantKind::Q3K,
        QuantKind::Q4K,
        QuantKind::Q5K,
        QuantKind::Q6K,
        QuantKind::MXFP4,
    ];
    let ctx = 128;
    let mut rng = SplitMix64(7);
    let ids: Vec<u32> = (0..ctx).map(|_| rng.below(model.cfg.vocab) as u32).collect();
    let mut seen = vec![FormatRounds::default(); kinds.len()];
    for _ in 0..rounds {
        for (k, &kind) in kinds.iter().enumerate() {
            let w = model.quantized(kind)?;
            let mats = std::iter::once(&w.embed)
                .chain(w.head.iter())
                .chain(w.layers.iter().flat_map(|l| {
                    [&l.wq, &l.wo, &l.mlp_in, &l.mlp_out].into_iter().chain(l.kv_global.iter()).chain(l.kv_local.iter())
                }))
                .collect::<Vec<_>>();
            let inside = mats.iter().filter(|m| m.quant.as_ref().is_some_and(|q| q.kind == kind)).count();
            let mut e = Engine::new(
                gpu,
                &w,
                EngineOptions { beyond_trained_context: true, ..EngineOptions::new(1, ctx + steps + 3) },
            )?;
            let greedy = [Sampler::GREEDY];
            e.append_sample(&ids, ctx, &[ctx], None, &greedy)?;
            for _ in 0..2 {
                e.profile_step(&[rng.below(model.cfg.vocab) as u32], 1, &[1], None, Some(&greedy))?;
            }
            let mut total = Profile::default();
            for _ in 0..steps {
                let id = rng.below(model.cfg.vocab) as u32;
                total.add(&e.profile_step(&[id], 1, &[1], None, Some(&greedy))?);
            }
            let n = steps as f64;
            let f = &mut seen[k];
            (f.inside, f.of, f.bytes) = (inside, mats.len(), e.weight_bytes());
            f.products_ms.push(1e3 * total.matmul / n);
            f.step_ms.push(1e3 * total.total() / n);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "\nBlock formats (1 row, context {ctx}; GPU ms per decode step by timestamp queries, median of {rounds} rounds;"
    );
    println!("the rows of a matrix that are not whole blocks of a format stay in their previous format):\n");
    println!("| format | matrices in it | weights MiB | products ms / step | GPU ms / step | products vs Q4_1 |");
    println!("|---|---:|---:|---:|---:|---:|");
    let base = median(&seen[0].products_ms);
    let mut out = Vec::new();
    for (kind, f) in kinds.iter().zip(&seen) {
        let (inside, of, bytes) = (f.inside, f.of, f.bytes);
        let (products, step) = (median(&f.products_ms), median(&f.step_ms));
        let name = kvdecode::WeightFormat::from(*kind).name();
        println!(
            "| {name} | {inside} of {of} | {:.1} | {products:.2} | {step:.2} | {:.2}x |",
            bytes as f64 / 1048576.0,
            products / base
        );
        out.push(serde_json::json!({
            "format": name, "matrices": inside, "of": of, "weight_bytes": bytes,
            "products_ms": products, "step_ms": step, "vs_q4_1": products / base,
        }));
    }
    Ok(out)
}

/// One format's figures over the rounds of [`formats_table`].
#[derive(Clone, Default)]
struct FormatRounds {
    /// Matrices in the format, of all.
    inside: usize,
    of: usize,
    /// GPU bytes of the weights.
    bytes: u64,
    /// Products' and the whole step's GPU ms per decode step, one entry per round.
    products_ms: Vec<f64>,
    step_ms: Vec<f64>,
}
