//! GPU sampling: greedy is the argmax of the returned logits; temperature sampling draws what the
//! CPU twin draws from the same logits, and the same seed gives the same tokens.

mod common;

use common::*;
use kvdecode::{argmax, sample_cpu, Batch, Engine, EngineOptions, ModelWeights, Sampled, Sampler, Want};

/// One step that samples every row: [`Engine::step`] with [`Want::Sampled`].
fn sampled(e: &mut Engine, ids: &[u32], width: usize, n_new: &[usize], samplers: &[Sampler]) -> Vec<Option<Sampled>> {
    e.step(&Batch::padded(ids, width, n_new, None).samplers(samplers), Want::Sampled).unwrap().into_sampled().unwrap()
}

/// Decode `steps` tokens on 3 rows with the GPU sampler, returning each row's tokens.
fn decode(w: &ModelWeights, samplers: &[Sampler; 3], steps: usize) -> Vec<Vec<u32>> {
    let mut e = Engine::new(&gpu(), w, EngineOptions::new(3, 64)).unwrap();
    let prompt = [3u32, 4, 5, 6, 7, 8, 9, 10, 11];
    let mut next = e.append_sample(&prompt, 3, &[3, 2, 3], None, samplers).unwrap();
    let mut toks = vec![Vec::new(); 3];
    for _ in 0..steps {
        let ids: Vec<u32> = next.iter().map(|t| t.unwrap()).collect();
        for (r, &t) in ids.iter().enumerate() {
            toks[r].push(t);
        }
        next = e.append_sample(&ids, 1, &[1, 1, 1], None, samplers).unwrap();
    }
    toks
}

#[test]
#[allow(clippy::needless_range_loop)] // step indexes every row's token list
fn gpu_sampler_matches_cpu_twin_on_the_same_logits() {
    let w = model(&tiny_agent_cfg(), 41);
    let samplers = [Sampler::GREEDY, Sampler::temperature(1.0, 7), Sampler::temperature(0.7, 99)];
    let toks = decode(&w, &samplers, 12);
    // replay the same tokens with logits readback and sample on the CPU
    let mut e = Engine::new(&gpu(), &w, EngineOptions::new(3, 64)).unwrap();
    let prompt = [3u32, 4, 5, 6, 7, 8, 9, 10, 11];
    let mut out = e.append(&prompt, 3, &[3, 2, 3], None).unwrap();
    for step in 0..12 {
        for (r, s) in samplers.iter().enumerate() {
            let logits = out.row(r).unwrap();
            let counter = e.cache().lens()[r] as u32;
            assert_eq!(sample_cpu(logits, *s, counter).0, toks[r][step], "row {r} step {step}");
            if s.temperature == 0.0 {
                assert_eq!(argmax(logits) as u32, toks[r][step]);
            }
        }
        let ids: Vec<u32> = (0..3).map(|r| toks[r][step]).collect();
        out = e.append(&ids, 1, &[1, 1, 1], None).unwrap();
    }
}

#[test]
fn same_seed_same_tokens_other_seed_other_tokens() {
    let w = model(&tiny_agent_cfg(), 42);
    let s = [Sampler::temperature(1.5, 1), Sampler::temperature(1.5, 1), Sampler::temperature(1.5, 2)];
    let a = decode(&w, &s, 16);
    let b = decode(&w, &s, 16);
    assert_eq!(a, b, "same seeds, different tokens");
    // rows 0 and 1 have different prompts; row 2 has row 0's prompt but another seed
    assert_ne!(a[0], a[2], "different seeds gave identical 16-token samples");
}

#[test]
fn temperature_draws_follow_softmax() {
    // the Gumbel-max draw over many counters reproduces softmax(logits / T) frequencies
    let logits = [1.0f32, 0.0, -1.0, 2.0];
    let t = 0.8;
    let n = 20000;
    let mut counts = [0usize; 4];
    for c in 0..n {
        counts[sample_cpu(&logits, Sampler::temperature(t, 5), c).0 as usize] += 1;
    }
    let z: f32 = logits.iter().map(|l| (l / t).exp()).sum();
    for i in 0..4 {
        let p = (logits[i] / t).exp() / z;
        let f = counts[i] as f32 / n as f32;
        approx::assert_abs_diff_eq!(p, f, epsilon = 0.015);
    }
}

/// Logit bias, token masks and top logprobs on the GPU draw what the CPU twin draws from the
/// model's logits with the same bias and mask, and report the same alternatives.
#[test]
fn bias_mask_and_top_logprobs_match_the_cpu_twin() {
    use kvdecode::sample_cpu_full;
    let w = model(&tiny_agent_cfg(), 43);
    let v = w.cfg.vocab;
    let gpu = gpu();
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(3, 64)).unwrap();
    let mut replay = Engine::new(&gpu, &w, EngineOptions::new(3, 64)).unwrap();
    let samplers = [
        Sampler::GREEDY.with_top_logprobs(5),
        Sampler::temperature(1.0, 7).with_top_logprobs(20),
        Sampler::temperature(0.7, 99).with_top_k(12).with_top_p(0.9).with_top_logprobs(1),
    ];
    // row 0: a bias that makes token 5 a strong favourite; row 1: only even tokens; row 2: both
    let bias = [(5u32, 6.0f32), (6, -3.0), (5, 1.0)];
    e.set_logit_bias(0, &bias).unwrap();
    assert_eq!(e.logit_bias(0), &[(5, 7.0), (6, -3.0)], "entries for one token add up");
    let even: Vec<u32> = (0..v.div_ceil(32)).map(|_| 0x5555_5555).collect();
    e.set_token_mask(1, Some(&even)).unwrap();
    e.set_logit_bias(2, &[(11, 2.5)]).unwrap();
    e.set_token_mask(2, Some(&even)).unwrap();
    let masks: [Option<&[u32]>; 3] = [None, Some(&even), Some(&even)];
    let prompt = [3u32, 4, 5, 6, 7, 8, 9, 10, 11];
    let mut got = sampled(&mut e, &prompt, 3, &[3, 3, 3], &samplers);
    let mut logits = replay.append(&prompt, 3, &[3, 3, 3], None).unwrap();
    for step in 0..10 {
        let mut next = Vec::new();
        for r in 0..3 {
            let g = got[r].clone().unwrap();
            let counter = replay.cache().lens()[r] as u32;
            let want = sample_cpu_full(logits.row(r).unwrap(), samplers[r], counter, e.logit_bias(r), masks[r]);
            assert_eq!(g.token, want.token, "row {r} step {step}");
            assert!((g.logprob - want.logprob).abs() < 1e-4, "row {r} step {step}: {} vs {}", g.logprob, want.logprob);
            assert_eq!(g.top.len(), samplers[r].top_logprobs as usize);
            for (a, b) in g.top.iter().zip(&want.top) {
                assert!(a.0 == b.0 && (a.1 - b.1).abs() < 1e-4, "row {r} step {step}: {a:?} vs {b:?}");
            }
            if masks[r].is_some() {
                assert_eq!(g.token % 2, 0, "row {r}: a masked token was drawn");
            }
            next.push(g.token);
        }
        got = sampled(&mut e, &next, 1, &[1, 1, 1], &samplers);
        logits = replay.append(&next, 1, &[1, 1, 1], None).unwrap();
    }
    // the logits `append` returns are the model's: bias and mask change sampling only
    let a = e.append(&[1, 1, 1], 1, &[1, 1, 1], None).unwrap();
    let b = replay.append(&[1, 1, 1], 1, &[1, 1, 1], None).unwrap();
    assert_eq!(a.data, b.data);
    // a reset clears bias and mask; bad masks and biases are named errors
    e.reset(&[0, 1]).unwrap();
    assert!(e.logit_bias(0).is_empty());
    let m = e.set_token_mask(1, Some(&vec![0; v.div_ceil(32)])).unwrap_err().to_string();
    assert!(m.contains("row 1: token mask allows no token"), "{m}");
    let m = e.set_token_mask(1, Some(&[1])).unwrap_err().to_string();
    assert!(m.contains("token mask has 1 words, expected 3"), "{m}");
    let m = e.set_logit_bias(0, &[(96, 1.0)]).unwrap_err().to_string();
    assert!(m.contains("token 96, outside the vocabulary"), "{m}");
    let m = e.set_logit_bias(0, &[(1, f32::NAN)]).unwrap_err().to_string();
    assert!(m.contains("not finite"), "{m}");
    let m = e.decode_steps(&[0], &[1], &[Sampler::GREEDY.with_top_logprobs(2)], 2).unwrap_err().to_string();
    assert!(m.contains("top_logprobs"), "{m}");
}

/// The three logprob modes and min-p, each on its own row of one batch (one row masked; two rows
/// on the split path): the GPU
/// draws and reports what the CPU twin does; `processed` logprobs are a distribution over the
/// kept tokens (they sum to 1, a token not kept is -inf); `raw` ones are the model's own
/// log-softmax of the logits `append` returns; min-p keeps what its definition keeps.
#[test]
fn logprob_modes_and_min_p_match_the_cpu_twin() {
    for split in [false, true] {
        logprob_modes_and_min_p(split);
    }
}

/// The body of `logprob_modes_and_min_p_match_the_cpu_twin`, with the split sampling path on or off.
fn logprob_modes_and_min_p(split: bool) {
    use kvdecode::{sample_cpu_full, LogprobMode};
    println!("split sampling: {split}");
    let w = model(&tiny_agent_cfg(), 45);
    let v = w.cfg.vocab;
    let gpu = gpu();
    let opts = EngineOptions { split_sampling: Some(split), ..EngineOptions::new(7, 64) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    assert_eq!(e.split_sampling(), split);
    let mut replay = Engine::new(&gpu, &w, opts).unwrap();
    let processed = LogprobMode::Processed;
    let samplers = [
        Sampler::temperature(0.8, 3).with_top_k(2).with_top_p(0.9).with_logprobs(processed).with_top_logprobs(3),
        Sampler::temperature(0.5, 4).with_min_p(0.1).with_logprobs(processed).with_top_logprobs(20),
        Sampler::temperature(0.7, 5).with_logprobs(LogprobMode::Raw).with_top_logprobs(4),
        Sampler::temperature(1.3, 6).with_min_p(0.2).with_top_logprobs(2),
        Sampler::GREEDY.with_logprobs(processed).with_top_logprobs(2),
        // the split path: nothing truncated, no alternatives
        Sampler::temperature(0.9, 8).with_logprobs(processed),
        Sampler::temperature(1.1, 9).with_logprobs(LogprobMode::Raw),
    ];
    let even: Vec<u32> = (0..v.div_ceil(32)).map(|_| 0x5555_5555).collect();
    e.set_token_mask(2, Some(&even)).unwrap();
    let masks: [Option<&[u32]>; 7] = [None, None, Some(&even), None, None, None, None];
    let prompt: Vec<u32> = (3..24).collect();
    let mut got = sampled(&mut e, &prompt, 3, &[3; 7], &samplers);
    let mut logits = replay.append(&prompt, 3, &[3; 7], None).unwrap();
    let (mut worst_raw, mut worst_sum) = (0f64, 0f64);
    for step in 0..8 {
        let mut next = Vec::new();
        for r in 0..7 {
            let (g, s) = (got[r].clone().unwrap(), samplers[r]);
            let l = logits.row(r).unwrap();
            let want = sample_cpu_full(l, s, replay.cache().lens()[r] as u32, &[], masks[r]);
            let at = format!("row {r} step {step}");
            assert_eq!((g.token, g.kept), (want.token, want.kept), "{at}: token and kept count");
            assert!((g.logprob - want.logprob).abs() < 1e-5, "{at}: {} vs {}", g.logprob, want.logprob);
            for (a, b) in g.top.iter().zip(&want.top) {
                assert!(a.0 == b.0 && (a.1 == b.1 || (a.1 - b.1).abs() < 1e-5), "{at}: {a:?} vs {b:?}");
            }
            match r {
                // processed: the kept tokens' probabilities sum to 1 (row 0: top-k 2 keeps at most 2,
                // all within its top 3; row 1's min-p keeps up to 20 here), the rest are -inf
                0 | 1 => {
                    assert!(r == 1 || g.kept <= 2, "{at}: top-k 2 kept {}", g.kept);
                    assert!(g.kept as usize <= g.top.len(), "{at}: {} kept, more than the top {}", g.kept, g.top.len());
                    let kept = &g.top[..g.kept as usize];
                    let sum: f64 = kept.iter().map(|t| (t.1 as f64).exp()).sum();
                    worst_sum = worst_sum.max((sum - 1.0).abs());
                    assert!((sum - 1.0).abs() < 1e-5, "{at}: processed probabilities of the kept sum to {sum}");
                    assert!(g.top[g.kept as usize..].iter().all(|t| t.1 == f32::NEG_INFINITY), "{at}: {:?}", g.top);
                    assert!(kept.iter().any(|t| t.0 == g.token), "{at}: the token drawn was not kept");
                }
                // raw: the model's log-softmax (of the allowed tokens), whatever the temperature
                2 => {
                    let m = (0..v).filter(|i| i % 2 == 0).map(|i| l[i] as f64).fold(f64::MIN, f64::max);
                    let lz = m + (0..v).filter(|i| i % 2 == 0).map(|i| (l[i] as f64 - m).exp()).sum::<f64>().ln();
                    let d = (g.logprob as f64 - (l[g.token as usize] as f64 - lz)).abs();
                    worst_raw = worst_raw.max(d);
                    assert!(d < 1e-6, "{at}: raw logprob {} is {d} from the f64 log-softmax", g.logprob);
                    assert_eq!(g.kept as usize, v / 2, "{at}: every allowed token is kept");
                }
                // min-p 0.2 at temperature 1.3: the tokens within a factor 5 of the most likely
                3 => {
                    let sc: Vec<f64> = l.iter().map(|&x| x as f64 / 1.3).collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let within = sc.iter().filter(|&&x| x >= m + 0.2f64.ln()).count();
                    assert_eq!(g.kept as usize, within, "{at}: min-p kept count");
                }
                // greedy (processed is raw), and the split path's draws: every token is kept
                _ => assert_eq!(g.kept as usize, v, "{at}"),
            }
            next.push(g.token);
        }
        got = sampled(&mut e, &next, 1, &[1; 7], &samplers);
        logits = replay.append(&next, 1, &[1; 7], None).unwrap();
    }
    println!("processed sums within {worst_sum:e} of 1; raw within {worst_raw:e} of the f64 log-softmax");
    let bad = Sampler::temperature(1.0, 1).with_min_p(1.5);
    let m = e.append_sample(&[1; 7], 1, &[1; 7], None, &[bad; 7]).unwrap_err().to_string();
    assert!(m.contains("min_p 1.5 must be in [0, 1]"), "{m}");
}

/// Prompt logprobs (`append_scored`) are the bits a draw reports: tokens sampled one at a time on
/// one engine, then the whole sequence scored in one append on another, each row with its own
/// sampler and logprob mode, on both sampling paths (one workgroup a row, and split in chunks);
/// every scored token's logprob, kept count and alternatives equal, bit for bit, what it reported
/// when it was drawn at that position.
#[test]
fn scored_tokens_are_the_bits_of_sampled_ones() {
    for split in [false, true] {
        scored_tokens_are_drawn_bits(split);
    }
}

/// The body of `scored_tokens_are_the_bits_of_sampled_ones`, with the split sampling path on or
/// off.
fn scored_tokens_are_drawn_bits(split: bool) {
    use kvdecode::LogprobMode;
    println!("split sampling: {split}");
    let w = model(&llama_cfg(), 47);
    let gpu = gpu();
    let samplers = [
        Sampler::temperature(0.8, 3).with_top_k(5).with_logprobs(LogprobMode::Processed).with_top_logprobs(3),
        Sampler::temperature(1.2, 4).with_top_p(0.8).with_logprobs(LogprobMode::Raw).with_top_logprobs(2),
        Sampler::temperature(0.6, 5).with_min_p(0.05).with_top_logprobs(1),
        Sampler::GREEDY.with_top_logprobs(4),
        // the split path (nothing truncated, no alternatives): scored in the same batch
        Sampler::GREEDY,
        Sampler::temperature(0.9, 7).with_logprobs(LogprobMode::Raw),
    ];
    let prompt = [5u32, 9, 2, 40];
    let mut e =
        Engine::new(&gpu, &w, EngineOptions { split_sampling: Some(split), ..EngineOptions::new(6, 40) }).unwrap();
    let ids: Vec<u32> = prompt.iter().cycle().take(24).copied().collect();
    let mut got = sampled(&mut e, &ids, 4, &[4; 6], &samplers);
    let mut drawn: Vec<Vec<kvdecode::Sampled>> = vec![Vec::new(); 6];
    for _ in 0..10 {
        let next: Vec<u32> = got.iter().map(|g| g.as_ref().unwrap().token).collect();
        for (r, g) in got.into_iter().enumerate() {
            drawn[r].push(g.unwrap());
        }
        got = sampled(&mut e, &next, 1, &[1; 6], &samplers);
    }
    // the prompt and the 10 drawn tokens, scored in one append (a row each)
    // six rows of 14 tokens: more than the default 64 all-position logits of one chunk
    let opts = EngineOptions { all_logits_tokens: 96, split_sampling: Some(split), ..EngineOptions::new(6, 40) };
    let mut scorer = Engine::new(&gpu, &w, opts).unwrap();
    let width = prompt.len() + 10;
    let seqs: Vec<u32> = (0..6)
        .flat_map(|r| prompt.iter().copied().chain(drawn[r].iter().map(|s| s.token)).collect::<Vec<_>>())
        .collect();
    let scored = scorer.append_scored(&seqs, width, &[width; 6], None, &samplers, None).unwrap();
    for r in 0..6 {
        assert_eq!(scored[r].len(), width - 1, "row {r}: every token after the first");
        for (k, d) in drawn[r].iter().enumerate() {
            let s = &scored[r][prompt.len() - 1 + k];
            let bits = |x: &kvdecode::Sampled| {
                (x.token, x.logprob.to_bits(), x.kept, x.top.iter().map(|t| (t.0, t.1.to_bits())).collect::<Vec<_>>())
            };
            assert_eq!(bits(s), bits(d), "row {r}, token {k} drawn: scored {s:?}, drawn {d:?}");
        }
    }
    // the scorer's rows hold the sequences, as an append leaves them
    assert_eq!(scorer.cache().lens(), &[width; 6]);
    // in two chunks, the first naming the second's first token: the same entries, bit for bit
    let mut halves = Engine::new(&gpu, &w, opts).unwrap();
    let cut = 7;
    let part =
        |a: usize, b: usize| -> Vec<u32> { (0..6).flat_map(|r| seqs[r * width + a..r * width + b].to_vec()).collect() };
    let next: Vec<u32> = (0..6).map(|r| seqs[r * width + cut]).collect();
    let mut two = halves.append_scored(&part(0, cut), cut, &[cut; 6], None, &samplers, Some(&next)).unwrap();
    let rest = halves.append_scored(&part(cut, width), width - cut, &[width - cut; 6], None, &samplers, None).unwrap();
    for (r, more) in rest.into_iter().enumerate() {
        two[r].extend(more);
        assert_eq!(two[r], scored[r], "row {r}: scored in two chunks");
    }
    // beyond one chunk's all-position budget is a named limit, and nothing was appended
    let big = vec![1u32; 6 * 30];
    let m = scorer.append_scored(&big, 30, &[30; 6], None, &samplers, None).unwrap_err().to_string();
    assert!(m.contains("EngineOptions::all_logits_tokens"), "{m}");
    assert_eq!(scorer.cache().lens(), &[width; 6]);
}

/// At a vocabulary of 70,000 (two entries a thread, 137 chunks on the split path) every kind of
/// truncation and list, on rows that mix them: the split path reports what one workgroup a row
/// does (the token, kept count and alternatives exactly; logprobs to 1e-5), the CPU twin draws the
/// same tokens and keeps the same counts, and each row's bits are those it gets alone in an
/// engine of one row. Top-k past the tokens a mask allows ends on the masked scores' tie.
#[test]
fn split_sampling_is_whole_sampling_at_a_real_vocabulary() {
    use kvdecode::{model::config::ModelConfig, sample_cpu_full, LogprobMode, Sampled};
    let w = model(&ModelConfig::llama(70_000, 32, 4, 2, 8, 48, 1, 10000.0, 1e-6, true), 48);
    let v = w.cfg.vocab;
    let gpu = gpu();
    let samplers = [
        Sampler::temperature(9.0, 1)
            .with_top_k(400)
            .with_top_p(0.9)
            .with_logprobs(LogprobMode::Processed)
            .with_top_logprobs(20),
        Sampler::temperature(12.0, 2).with_top_p(0.5).with_logprobs(LogprobMode::Raw).with_top_logprobs(5),
        Sampler::temperature(0.7, 3).with_top_k(1),
        Sampler::temperature(6.0, 4).with_min_p(0.05).with_top_logprobs(3),
        Sampler::GREEDY.with_top_logprobs(20),
        Sampler::temperature(8.0, 5).with_top_k(30_000).with_logprobs(LogprobMode::Processed),
    ];
    let thirds: Vec<u32> = (0..v.div_ceil(32))
        .map(|word| (0..32).filter(|b| (word * 32 + b) % 3 == 0).fold(0u32, |m, b| m | 1 << b))
        .collect();
    let masks: [Option<&[u32]>; 6] = [None, None, None, None, None, Some(&thirds)];
    let n = samplers.len();
    let prompt: Vec<u32> = (0..n as u32 * 3).map(|i| i * 7919 % v as u32).collect();
    // `steps` draws on rows `rows` of an engine of `split`, and the logits each was drawn from
    let run = |split: bool, rows: &[usize], steps: usize| -> (Vec<Vec<Sampled>>, Vec<Vec<Vec<f32>>>) {
        let opts = EngineOptions { split_sampling: Some(split), ..EngineOptions::new(rows.len(), 16) };
        let (mut e, mut replay) = (Engine::new(&gpu, &w, opts).unwrap(), Engine::new(&gpu, &w, opts).unwrap());
        assert_eq!(e.split_sampling(), split);
        for (i, &r) in rows.iter().enumerate() {
            e.set_token_mask(i, masks[r]).unwrap();
        }
        let sm: Vec<Sampler> = rows.iter().map(|&r| samplers[r]).collect();
        let ids: Vec<u32> = rows.iter().flat_map(|&r| prompt[r * 3..r * 3 + 3].to_vec()).collect();
        let k = rows.len();
        let mut got = sampled(&mut e, &ids, 3, &vec![3; k], &sm);
        let mut logits = replay.append(&ids, 3, &vec![3; k], None).unwrap();
        let (mut drawn, mut seen) = (vec![Vec::new(); k], vec![Vec::new(); k]);
        for _ in 0..steps {
            let next: Vec<u32> = got.iter().map(|g| g.as_ref().unwrap().token).collect();
            for (i, g) in got.into_iter().enumerate() {
                drawn[i].push(g.unwrap());
                seen[i].push(logits.row(i).unwrap().to_vec());
            }
            got = sampled(&mut e, &next, 1, &vec![1; k], &sm);
            logits = replay.append(&next, 1, &vec![1; k], None).unwrap();
        }
        (drawn, seen)
    };
    let all: Vec<usize> = (0..n).collect();
    let (split, logits) = run(true, &all, 3);
    let (whole, _) = run(false, &all, 3);
    let bits = |x: &Sampled| {
        (x.token, x.logprob.to_bits(), x.kept, x.top.iter().map(|t| (t.0, t.1.to_bits())).collect::<Vec<_>>())
    };
    for r in 0..n {
        let (alone, _) = run(true, &[r], 3);
        for step in 0..3 {
            let (s, wh) = (&split[r][step], &whole[r][step]);
            let at = format!("row {r} step {step}");
            assert_eq!(bits(s), bits(&alone[0][step]), "{at}: alone in its engine");
            assert_eq!((s.token, s.kept), (wh.token, wh.kept), "{at}: split against whole");
            assert!((s.logprob - wh.logprob).abs() < 1e-5, "{at}: {} vs {}", s.logprob, wh.logprob);
            let ids = |x: &Sampled| x.top.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(ids(s), ids(wh), "{at}: alternatives");
            for (a, b) in s.top.iter().zip(&wh.top) {
                assert!(a.1 == b.1 || (a.1 - b.1).abs() < 1e-5, "{at}: {a:?} vs {b:?}");
            }
            let counter = (3 + step) as u32;
            let want = sample_cpu_full(&logits[r][step], samplers[r], counter, &[], masks[r]);
            assert_eq!((s.token, s.kept, ids(s)), (want.token, want.kept, ids(&want)), "{at}: the CPU twin");
            println!("{at}: token {} kept {} logprob {}", s.token, s.kept, s.logprob);
        }
    }
    // top-k 1 keeps one token; top-k 30,000 over the 23,334 allowed keeps them all
    assert!(split[2].iter().all(|s| s.kept == 1));
    assert!(split[5].iter().all(|s| s.kept as usize == v.div_ceil(3)));
}
