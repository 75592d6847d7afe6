//! The episode API: forks equal recomputation, turns stop on their own conditions, the cache holds
//! exactly the transcript, and greedy turns equal the reference's argmax.

mod common;

use common::*;
use kvdecode::{argmax, Engine, EngineOptions, Rollouts, Sampler, TurnLimit};

#[test]
fn episodes_with_forks_tool_results_and_turns() {
    let w = model(&tiny_agent_cfg(), 91);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 11 + 4) % 96).collect();
    let tool: Vec<Vec<u32>> = vec![vec![5, 6, 7], vec![8, 9], vec![10, 11, 12, 13]];
    let samplers = [Sampler::GREEDY, Sampler::temperature(1.0, 21), Sampler::temperature(1.0, 22)];
    let limits = |stop: u32| vec![TurnLimit { max_new: 6, stop: vec![stop] }; 3];

    // A: one prompt, forked into rows 1 and 2
    let mut ea = Engine::new(&gpu(), &w, EngineOptions::new(3, 64)).unwrap();
    let mut ra = Rollouts::new(&ea);
    ra.start(&mut ea, &[0], std::slice::from_ref(&prompt), &samplers[..1]).unwrap();
    ra.fork(&mut ea, 0, &[1, 2], &samplers[1..]).unwrap();
    let t1 = ra.decode_turn(&mut ea, &[0, 1, 2], &limits(3), 4).unwrap();
    ra.tool_result(&mut ea, &[0, 1, 2], &tool).unwrap();
    let t2 = ra.decode_turn(&mut ea, &[2, 0, 1], &limits(7), 3).unwrap();

    // B: the same prompt prefilled separately in each row (no fork), window 1
    let mut eb = Engine::new(&gpu(), &w, EngineOptions::new(3, 64)).unwrap();
    let mut rb = Rollouts::new(&eb);
    rb.start(&mut eb, &[0, 1, 2], &[prompt.clone(), prompt.clone(), prompt.clone()], &samplers).unwrap();
    let u1 = rb.decode_turn(&mut eb, &[0, 1, 2], &limits(3), 1).unwrap();
    rb.tool_result(&mut eb, &[0, 1, 2], &tool).unwrap();
    let u2 = rb.decode_turn(&mut eb, &[2, 0, 1], &limits(7), 1).unwrap();
    assert_eq!(t1, u1, "fork vs recompute, turn 1");
    assert_eq!(t2, u2, "fork vs recompute, turn 2");
    assert_ne!(t1[1].tokens, t1[2].tokens, "forked rows with different seeds drew the same turn");

    for r in 0..3 {
        // the cache holds prompt, turn 1 (stop token included), tool result, turn 2 but its last token
        let k2 = [1usize, 2, 0][r]; // turn-2 order was rows [2, 0, 1]
        let mut want = prompt.clone();
        want.extend_from_slice(&t1[r].tokens);
        want.extend_from_slice(&tool[r]);
        want.extend_from_slice(&t2[k2].tokens[..t2[k2].tokens.len() - 1]);
        assert_eq!(ea.cache().history(r), &want[..], "row {r}");
        for (t, stop) in [(&t1[r], 3u32), (&t2[k2], 7)] {
            assert!(t.tokens.len() <= 6);
            assert_eq!(t.stopped, t.tokens.last() == Some(&stop));
            assert!(t.stopped || t.tokens.len() == 6);
            assert_eq!(t.logprobs.len(), t.tokens.len());
            assert!(t.logprobs.iter().all(|&l| l <= 0.0 && l.is_finite()));
        }
    }
    // the greedy row's turn equals the reference's argmax chain
    let mut seq = prompt.clone();
    for &tok in &t1[0].tokens {
        let l = ref_last(&w, &seq);
        assert_eq!(argmax(&l) as u32, tok);
        seq.push(tok);
    }
    let held = ea.cache().block_usage().used;
    let ep = ra.finish(&mut ea, 0).unwrap().unwrap();
    assert_eq!(ep.turns.len(), 2);
    assert!(ra.episode(0).is_none());
    // the finished row gave its blocks back
    assert_eq!(ea.cache().lens()[0], 0);
    assert!(ea.cache().block_usage().used < held);
    assert!(ra.finish(&mut ea, 0).unwrap().is_none());
}
