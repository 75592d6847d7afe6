//! Multi-step decode (ids stay on the GPU between steps) equals one step per readback; rows that
//! stop inside a window end exactly as if they had stopped on time; all-position logits match the
//! reference; top-k / top-p / logprobs match the CPU twin.

mod common;

use common::*;
use kvdecode::{argmax, model::reference, sample_cpu, Engine, EngineOptions, Sampler};

#[test]
fn multi_step_equals_single_steps() {
    let w = model(&tiny_agent_cfg(), 71);
    let samplers = [Sampler::GREEDY, Sampler::temperature(1.0, 3), Sampler::temperature(0.8, 4).with_top_k(20)];
    let prompt: Vec<u32> = (0..3 * 6).map(|i| (i * 17 % 96) as u32).collect();
    let run = |window: usize| {
        let mut e = Engine::new(&gpu(), &w, EngineOptions::new(3, 64)).unwrap();
        let first = e.append_sample(&prompt, 6, &[6, 4, 5], None, &samplers).unwrap();
        let mut feed: Vec<u32> = first.iter().map(|t| t.unwrap()).collect();
        let mut toks = vec![Vec::new(); 3];
        let mut lps = vec![Vec::new(); 3];
        for _ in 0..(24 / window) {
            let got = e.decode_steps_logprobs(&[0, 1, 2], &feed, &samplers, window).unwrap();
            for r in 0..3 {
                toks[r].extend_from_slice(&got[r].0);
                lps[r].extend_from_slice(&got[r].1);
                feed[r] = *got[r].0.last().unwrap();
            }
        }
        let hist: Vec<Vec<u32>> = (0..3).map(|r| e.cache().history(r).to_vec()).collect();
        (toks, lps, hist)
    };
    let (a, la, ha) = run(1);
    for window in [3, 8] {
        let (b, lb, hb) = run(window);
        assert_eq!(a, b, "window {window}: tokens differ");
        assert_eq!(la, lb, "window {window}: logprobs differ");
        assert_eq!(ha, hb, "window {window}: histories differ");
    }
    // the GPU history and the returned tokens agree: history = prompt, first sample, tokens[..-1]
    assert_eq!(ha[0].len(), 6 + 24);
}

#[test]
fn stop_inside_a_window_rolls_back_exactly() {
    let w = model(&tiny_agent_cfg(), 72);
    let prompt: Vec<u32> = (0..2 * 7).map(|i| (i * 13 % 96) as u32).collect();
    // reference run: greedy one token at a time, record the tokens
    let mut e = Engine::new(&gpu(), &w, EngineOptions::new(2, 64)).unwrap();
    let first: Vec<u32> =
        e.append_sample(&prompt, 7, &[7, 7], None, &[Sampler::GREEDY; 2]).unwrap().iter().map(|t| t.unwrap()).collect();
    let plain = e.decode_until(&[0, 1], &first, &[Sampler::GREEDY; 2], 20, 1, |_| false).unwrap();
    // pick, for each row, a "stop token" that first appears mid-sequence
    let stops: Vec<u32> = plain.iter().map(|t| t[5]).collect();
    for window in [1, 4, 9] {
        let mut e = Engine::new(&gpu(), &w, EngineOptions::new(2, 64)).unwrap();
        e.append_sample(&prompt, 7, &[7, 7], None, &[Sampler::GREEDY; 2]).unwrap();
        let got = e.decode_until(&[0, 1], &first, &[Sampler::GREEDY; 2], 20, window, |t| stops.contains(&t)).unwrap();
        // a row stops at the first stop token of either row's set
        for r in 0..2 {
            let cut = plain[r].iter().position(|t| stops.contains(t)).unwrap();
            assert_eq!(got[r], plain[r][..=cut].to_vec(), "window {window} row {r}");
            // the cache holds prompt + first + tokens before the stop, exactly
            let mut hist = prompt[r * 7..r * 7 + 7].to_vec();
            hist.push(first[r]);
            hist.extend_from_slice(&got[r][..got[r].len() - 1]);
            assert_eq!(e.cache().history(r), &hist[..], "window {window} row {r}");
            assert_eq!(e.cache().lens()[r], hist.len());
        }
        // a turn that asks for no token returns none and leaves the row alone
        let lens = e.cache().lens().to_vec();
        let none = kvdecode::TurnLimit { max_new: 0, stop: vec![] };
        let turns = e.decode_turns(&[0], &[5], &[Sampler::GREEDY], &[none], window, &|_, _| false).unwrap();
        assert!(turns[0].tokens.is_empty() && !turns[0].stopped);
        assert_eq!(e.cache().lens(), &lens[..]);
        // and decoding on matches the reference
        let out = e.append(&[1, 2], 1, &[1, 1], None).unwrap();
        for r in 0..2 {
            let d = max_abs_diff(out.row(r).unwrap(), &ref_last(&w, e.cache().history(r)));
            assert!(d <= 1e-4, "window {window} row {r}: {d}");
        }
    }
}

#[test]
fn all_position_logits_match_reference() {
    let w = model(&tiny_agent_cfg(), 73);
    let mut e = Engine::new(&gpu(), &w, EngineOptions::new(2, 64)).unwrap();
    let seq: Vec<u32> = (0..30).map(|i| (i * 7 + 2) % 96).collect();
    e.append(&seq[..20], 20, &[20], Some(&[0])).unwrap();
    let ids: Vec<u32> = [&seq[20..30], &seq[..10]].concat();
    let all = e.append_all_logits(&ids, 10, &[10, 6], None).unwrap();
    let r0 = reference::forward(&w, &seq).unwrap();
    let r1 = reference::forward(&w, &seq[..6]).unwrap();
    let v = w.cfg.vocab;
    for j in 0..10 {
        let d = max_abs_diff(&all[0][j], &r0[(20 + j) * v..(21 + j) * v]);
        assert!(d <= 1e-4, "row 0 token {j}: {d}");
    }
    assert_eq!(all[1].len(), 6);
    for j in 0..6 {
        assert!(max_abs_diff(&all[1][j], &r1[j * v..(j + 1) * v]) <= 1e-4);
    }
}

#[test]
fn top_k_top_p_and_logprobs_match_cpu_twin() {
    let w = model(&tiny_agent_cfg(), 74);
    let samplers = [
        Sampler::temperature(1.0, 11).with_top_k(5),
        Sampler::temperature(0.7, 12).with_top_p(0.8),
        Sampler::temperature(1.3, 13).with_top_k(40).with_top_p(0.5),
        Sampler::GREEDY,
    ];
    let mut e = Engine::new(&gpu(), &w, EngineOptions::new(4, 64)).unwrap();
    let mut e2 = Engine::new(&gpu(), &w, EngineOptions::new(4, 64)).unwrap();
    let mut ids: Vec<u32> = (0..4 * 5).map(|i| (i * 3 % 96) as u32).collect();
    let mut width = 5;
    for step in 0..15 {
        let n = vec![width; 4];
        let logits = e2.append(&ids, width, &n, None).unwrap();
        let counters: Vec<u32> = (0..4).map(|r| e2.cache().lens()[r] as u32).collect();
        let got = e.decode_or_sample(&ids, width, &samplers);
        for r in 0..4 {
            let (want, lp) = sample_cpu(logits.row(r).unwrap(), samplers[r], counters[r]);
            assert_eq!(got[r].0, want, "step {step} row {r}");
            assert!((got[r].1 - lp).abs() < 1e-4, "step {step} row {r}: logprob {} vs {lp}", got[r].1);
            if samplers[r].top_k > 0 {
                // the draw is among the top k
                let l = logits.row(r).unwrap();
                let mut sorted: Vec<f32> = l.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                assert!(l[want as usize] >= sorted[samplers[r].top_k as usize - 1]);
            }
            if samplers[r].temperature == 0.0 {
                assert_eq!(want as usize, argmax(logits.row(r).unwrap()));
            }
        }
        ids = got.iter().map(|g| g.0).collect();
        width = 1;
    }
}

trait DecodeOrSample {
    fn decode_or_sample(&mut self, ids: &[u32], width: usize, s: &[Sampler]) -> Vec<(u32, f32)>;
}

impl DecodeOrSample for Engine {
    /// Append a chunk and sample, returning ids and logprobs (through a one-step window when the
    /// chunk is a single token per row, else `append_sample` + logprob from the window API).
    fn decode_or_sample(&mut self, ids: &[u32], width: usize, s: &[Sampler]) -> Vec<(u32, f32)> {
        let rows: Vec<usize> = (0..s.len()).collect();
        if width == 1 {
            self.decode_steps_logprobs(&rows, ids, s, 1).unwrap().into_iter().map(|(t, l)| (t[0], l[0])).collect()
        } else {
            // prefill all but the last token, then one step through the window API
            let pre: Vec<u32> = (0..s.len()).flat_map(|r| ids[r * width..r * width + width - 1].to_vec()).collect();
            self.append(&pre, width - 1, &vec![width - 1; s.len()], None).unwrap();
            let last: Vec<u32> = (0..s.len()).map(|r| ids[r * width + width - 1]).collect();
            self.decode_steps_logprobs(&rows, &last, s, 1).unwrap().into_iter().map(|(t, l)| (t[0], l[0])).collect()
        }
    }
}
