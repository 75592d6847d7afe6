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
    ra.start(&mut ea, &[0], std::slice::from_ref(&prompt), &samplers[..1], None).unwrap();
    ra.fork(&mut ea, 0, &[1, 2], &samplers[1..]).unwrap();
    let t1 = ra.decode_turn(&mut ea, &[0, 1, 2], &limits(3), 4).unwrap();
    ra.tool_result(&mut ea, &[0, 1, 2], &tool).unwrap();
    let t2 = ra.decode_turn(&mut ea, &[2, 0, 1], &limits(7), 3).unwrap();

    // B: the same prompt prefilled separately in each row (no fork), window 1
    let mut eb = Engine::new(&gpu(), &w, EngineOptions::new(3, 64)).unwrap();
    let mut rb = Rollouts::new(&eb);
    rb.start(&mut eb, &[0, 1, 2], &[prompt.clone(), prompt.clone(), prompt.clone()], &samplers, None).unwrap();
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

/// A scheduler and rollouts on one engine: each takes rows through the engine, so neither
/// touches the other's.
#[test]
fn a_scheduler_and_rollouts_share_an_engine_without_taking_each_others_rows() {
    use kvdecode::{Request, RowOwner, Scheduler};
    let w = model(&llama_cfg(), 74);
    let mut e = Engine::new(&gpu(), &w, EngineOptions::new(4, 64)).unwrap();
    let mut ro = Rollouts::new(&e);
    let prompts = vec![vec![3, 4, 5, 6], vec![7, 8, 9]];
    ro.start(&mut e, &[0, 1], &prompts, &[Sampler::GREEDY; 2], None).unwrap();
    let lens = e.cache().lens().to_vec();
    let history: Vec<Vec<u32>> = (0..2).map(|r| e.cache().history(r).to_vec()).collect();
    let mut sched = Scheduler::new(&e, 8);
    for i in 0..5u32 {
        sched.submit(Request { tokens: vec![1 + i, 2, 3], max_new: 6, ..Default::default() }).unwrap();
    }
    // mid-run, the scheduler's rows are not the rollouts' to take
    sched.step(&mut e, &mut |_| {}).unwrap();
    assert_eq!(sched.active(), 2, "only the two rows the rollouts left free");
    let err = ro.start(&mut e, &[2], &[vec![1, 2]], &[Sampler::GREEDY], None).unwrap_err().to_string();
    assert!(err.contains("row 2 is held by another"), "{err}");
    let done = sched.run(&mut e, &mut |_| {}).unwrap();
    assert_eq!(done.len(), 5);
    // the rollouts' rows are as they were
    assert_eq!(&e.cache().lens()[..2], &lens[..2]);
    for (r, h) in history.iter().enumerate() {
        assert_eq!(e.cache().history(r), &h[..]);
    }
    // a direct caller claims what is free
    let me = RowOwner::new();
    assert_eq!(e.claim_free_rows(me, 2).unwrap(), vec![2, 3]);
    assert!(e.claim_free_rows(me, 1).is_err());
    ro.finish(&mut e, 0).unwrap();
    assert_eq!(e.claim_free_rows(me, 1).unwrap(), vec![0]);
}
