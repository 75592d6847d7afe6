//! Continuous batching: every request gets exactly the tokens it gets when run alone.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Event, Finish, Request, Sampler, Scheduler, SplitMix64};

fn random_requests(n: usize, seed: u64) -> Vec<Request> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|i| {
            let mut r = Request {
                tokens: (0..1 + rng.below(40)).map(|_| 1 + rng.below(95) as u32).collect(),
                max_new: 1 + rng.below(14),
                stop: vec![rng.below(96) as u32, rng.below(96) as u32],
                sampler: match i % 3 {
                    0 => Sampler::GREEDY,
                    1 => Sampler::temperature(1.0, rng.below(1000) as u32),
                    _ => Sampler::temperature(0.8, rng.below(1000) as u32).with_top_k(10).with_top_p(0.9),
                },
                ..Default::default()
            };
            // logit bias and penalties on some, top logprobs on others
            if i % 5 == 3 {
                r.logit_bias = (0..4).map(|_| (rng.below(96) as u32, rng.uniform() as f32 * 8.0 - 4.0)).collect();
                r.presence_penalty = 0.8;
                r.frequency_penalty = 0.5;
            }
            if i % 5 == 4 {
                r.sampler = r.sampler.with_top_logprobs(3);
            }
            r
        })
        .collect()
}

#[test]
fn batched_requests_equal_requests_run_alone() {
    let s = seed(81);
    let w = model(&tiny_agent_cfg(), s);
    let reqs = random_requests(14, s);
    // 4 rows for 14 requests: they queue, join and leave; prompts prefill 7 tokens per step
    let mut engine = Engine::new(&gpu(), &w, EngineOptions::new(4, 64)).unwrap();
    let mut sched = Scheduler::new(&engine, 7);
    for r in &reqs {
        sched.submit(r.clone()).unwrap();
    }
    let mut streamed = vec![Vec::new(); reqs.len()];
    let done = sched
        .run(&mut engine, &mut |ev| {
            if let Event::Token { id, token, .. } = ev {
                streamed[id].push(token);
            }
        })
        .unwrap();
    assert_eq!(done.len(), reqs.len());
    assert_eq!(sched.active(), 0);
    for c in &done {
        assert_eq!(streamed[c.id], c.tokens, "request {}: streamed tokens differ", c.id);
        // alone: a one-row engine, the whole prompt in one append
        let mut alone = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
        let mut one = Scheduler::new(&alone, 64);
        one.submit(reqs[c.id].clone()).unwrap();
        let a = one.run(&mut alone, &mut |_| {}).unwrap();
        assert_eq!(a[0].tokens, c.tokens, "seed {s} request {}: batched vs alone", c.id);
        assert_eq!(a[0].logprobs, c.logprobs, "seed {s} request {}: logprobs", c.id);
        assert_eq!(a[0].finish, c.finish);
        assert_eq!(a[0].top_logprobs, c.top_logprobs, "seed {s} request {}: top logprobs", c.id);
        match c.finish {
            Finish::Stop => assert!(reqs[c.id].stop.contains(c.tokens.last().unwrap())),
            Finish::Length => assert_eq!(c.tokens.len(), reqs[c.id].max_new),
            Finish::Cancelled | Finish::ConstraintError => panic!("nothing was cancelled or constrained"),
        }
        if reqs[c.id].sampler.top_logprobs > 0 {
            assert_eq!(c.top_logprobs.len(), c.tokens.len());
            for (k, top) in c.top_logprobs.iter().enumerate() {
                assert_eq!(top.len(), 3);
                assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "most likely first");
                // greedy tokens are the most likely one
                if reqs[c.id].sampler.temperature == 0.0 {
                    assert_eq!(top[0], (c.tokens[k], c.logprobs[k]));
                }
            }
        }
    }
}

/// `n` completions of one prompt: prefilled once, forked into the group's rows; each member gets
/// exactly what its request gets alone.
#[test]
fn groups_prefill_once_and_equal_their_members_alone() {
    let s = seed(84);
    let w = model(&tiny_agent_cfg(), s);
    let mut engine = Engine::new(&gpu(), &w, EngineOptions::new(5, 64)).unwrap();
    let mut sched = Scheduler::new(&engine, 8);
    let base = Request { tokens: (1..30).collect(), max_new: 9, logit_bias: vec![(5, 2.0)], ..Default::default() };
    let samplers: Vec<Sampler> = (0..4).map(|i| Sampler::temperature(0.9, 100 + i)).collect();
    // a single request first, so the group waits for 4 free rows among 5
    let single = sched.submit(Request { tokens: vec![7; 5], max_new: 20, ..Default::default() }).unwrap();
    let ids = sched.submit_group(base.clone(), &samplers).unwrap();
    let before = engine.stats().chunks;
    let done = sched.run(&mut engine, &mut |_| {}).unwrap();
    assert_eq!(done.len(), 5);
    // the shared 28 tokens prefill once, in 8-token chunks: far fewer chunks than 4 prefills
    assert!(engine.stats().chunks - before < 30, "{} chunks", engine.stats().chunks - before);
    for (k, &id) in ids.iter().enumerate() {
        let mut alone = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
        let mut one = Scheduler::new(&alone, 64);
        one.submit(Request { sampler: samplers[k], ..base.clone() }).unwrap();
        let a = one.run(&mut alone, &mut |_| {}).unwrap();
        let c = done.iter().find(|c| c.id == id).unwrap();
        assert_eq!((&a[0].tokens, &a[0].logprobs), (&c.tokens, &c.logprobs), "seed {s} member {k}");
    }
    assert!(done.iter().any(|c| c.id == single));
    let e = sched.submit_group(base, &[Sampler::GREEDY; 6]).unwrap_err().to_string();
    assert!(e.contains("a group of 6 needs 1 to 5 rows"), "{e}");
}

/// A mixture of experts' requests ask for their routes: a group (prefilled once, forked) and a
/// single request on 3 rows, each completion's routes those the CPU reference gives the prompt
/// and the generated tokens that were fed (all but the last); a request that does not ask gets
/// none, and an engine that keeps no routes refuses the ask.
#[test]
fn moe_requests_return_their_routes() {
    let s = seed(86);
    let w = model(&moe_cfgs()[0], s);
    let opts = EngineOptions { record_routes: true, ..EngineOptions::new(3, 48) };
    let mut engine = Engine::new(&gpu(), &w, opts).unwrap();
    let mut sched = Scheduler::new(&engine, 8);
    let base = Request { tokens: (1..20).collect(), max_new: 7, return_routes: true, ..Default::default() };
    let samplers: Vec<Sampler> = (0..2).map(|i| Sampler::temperature(1.0, 200 + i)).collect();
    sched.submit_group(base.clone(), &samplers).unwrap();
    let plain = sched.submit(Request { tokens: vec![3; 9], max_new: 5, ..Default::default() }).unwrap();
    let done = sched.run(&mut engine, &mut |_| {}).unwrap();
    assert_eq!(done.len(), 3);
    for c in &done {
        if c.id == plain {
            assert!(c.routes.is_none());
            continue;
        }
        let fed: Vec<u32> = base.tokens.iter().chain(&c.tokens[..c.tokens.len() - 1]).copied().collect();
        let (_, want) = kvdecode::model::reference::forward_routed(&w, &fed, Default::default()).unwrap();
        assert_eq!(c.routes.as_ref(), Some(&want), "seed {s}: request {}", c.id);
    }
    let quiet = Engine::new(&gpu(), &w, EngineOptions::new(1, 48)).unwrap();
    let e = Scheduler::new(&quiet, 8).submit(base).unwrap_err().to_string();
    assert!(e.contains("record_routes"), "{e}");
}

#[test]
fn cancel_frees_the_row_and_others_are_untouched() {
    let s = seed(85);
    let w = model(&llama_cfg(), s);
    let reqs = random_requests(6, s);
    let mut engine = Engine::new(&gpu(), &w, EngineOptions::new(2, 64)).unwrap();
    let mut sched = Scheduler::new(&engine, 8);
    let ids: Vec<usize> = reqs.iter().map(|r| sched.submit(r.clone()).unwrap()).collect();
    // one running, one queued: cancelled
    let (_, _) = sched.step(&mut engine, &mut |_| {}).unwrap();
    let running = sched.cancel(&mut engine, ids[0]).expect("running");
    assert_eq!(running.finish, Finish::Cancelled);
    let queued = sched.cancel(&mut engine, ids[5]).expect("queued");
    assert!(queued.finish == Finish::Cancelled && queued.tokens.is_empty());
    assert!(sched.cancel(&mut engine, ids[5]).is_none(), "cancelled twice");
    let done = sched.run(&mut engine, &mut |_| {}).unwrap();
    assert_eq!(done.iter().map(|c| c.id).collect::<Vec<_>>(), ids[1..5].to_vec());
    for c in &done {
        let mut alone = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
        let mut one = Scheduler::new(&alone, 64);
        one.submit(reqs[c.id].clone()).unwrap();
        assert_eq!(one.run(&mut alone, &mut |_| {}).unwrap()[0].tokens, c.tokens, "request {}", c.id);
    }
}

#[test]
fn admission_refuses_what_cannot_fit_and_accounts() {
    let w = model(&llama_cfg(), 82);
    let mut engine = Engine::new(&gpu(), &w, EngineOptions::new(2, 32)).unwrap();
    let mut sched = Scheduler::new(&engine, 8);
    let too_long =
        Request { tokens: vec![1; 30], max_new: 3, stop: vec![], sampler: Sampler::GREEDY, ..Default::default() };
    let err = sched.submit(too_long).unwrap_err();
    assert!(format!("{err}").contains("exceeds the rows' max_len 32"), "{err}");
    let bad =
        Request { tokens: vec![1, 500], max_new: 3, stop: vec![], sampler: Sampler::GREEDY, ..Default::default() };
    assert!(format!("{}", sched.submit(bad).unwrap_err()).contains("token 1 = 500"));
    // asking for no token is refused, not answered with one
    let nothing =
        Request { tokens: vec![1, 2], max_new: 0, stop: vec![], sampler: Sampler::GREEDY, ..Default::default() };
    let err = sched.submit(nothing).unwrap_err().to_string();
    assert!(err.contains("max_new is 0"), "{err}");
    let empty = Request { tokens: vec![], max_new: 3, stop: vec![], sampler: Sampler::GREEDY, ..Default::default() };
    assert!(sched.submit(empty).unwrap_err().to_string().contains("empty prompt"));
    assert_eq!(sched.queued(), 0, "refused requests are not queued");
    for n in [5, 9, 3] {
        sched
            .submit(Request {
                tokens: vec![2; n],
                max_new: 4,
                stop: vec![],
                sampler: Sampler::GREEDY,
                ..Default::default()
            })
            .unwrap();
    }
    assert_eq!(sched.reserved_tokens(&engine), 0);
    let (_, more) = sched.step(&mut engine, &mut |_| {}).unwrap();
    assert!(more);
    // two rows hold requests, the third waits in the queue
    assert_eq!(sched.active(), 2);
    assert_eq!(sched.queued(), 1);
    // blocks of 16 positions: one per row so far
    assert_eq!(sched.allocated_tokens(&engine), 32);
    assert_eq!(sched.reserved_tokens(&engine), 32);
    assert_eq!(sched.used_tokens(&engine), 5 + 8);
    let done = sched.run(&mut engine, &mut |_| {}).unwrap();
    assert_eq!(done.len(), 3, "the queued request runs once a row frees up");
    assert!(done[2].stats.queued_steps > 0);
}

#[test]
fn json_requests_parse_and_bad_ones_name_the_field() {
    let r = Request::from_json(
        r#"{"tokens": [1, 2, 3], "max_tokens": 5, "temperature": 0.7, "seed": 9, "stop": [4]}"#,
        None,
    )
    .unwrap();
    assert_eq!((r.tokens, r.max_new, r.stop, r.sampler.seed), (vec![1, 2, 3], 5, vec![4], 9));
    let bad = [
        (r#"{"tokens": [1], "max_token": 5}"#, "unknown field `max_token`"),
        (r#"{"tokens": [1], "max_tokens": -1}"#, "invalid value: integer `-1`"),
        (r#"{"tokens": [1], "max_tokens": 2.5}"#, "invalid type: floating point"),
        (r#"{"tokens": [1, -2]}"#, "invalid value: integer `-2`"),
        (r#"{"tokens": "1 2"}"#, "invalid type: string"),
        (r#"{"text": "hello"}"#, "needs a tokenizer"),
        (r#"{"tokens": [1], "text": "x"}"#, "not both"),
        (r#"{}"#, "needs \"tokens\""),
        (r#"{"tokens": [1], "top_p": 5}"#, "top_p 5 must be in (0, 1]"),
        (r#"{"tokens": [1], "top_p": 0}"#, "top_p 0 must be in (0, 1]"),
        (r#"{"tokens": [1], "temperature": 1e39}"#, "temperature inf is not finite"),
        (r#"[1, 2]"#, "request:"),
        (r#"{"tokens": [1]"#, "EOF while parsing"),
    ];
    for (line, want) in bad {
        let e = Request::from_json(line, None).err().unwrap_or_else(|| panic!("{line} parsed")).to_string();
        assert!(e.contains(want), "{line}: {e}");
    }
    // the largest max_tokens JSON can say is refused by the scheduler, not an overflow
    let w = model(&llama_cfg(), 83);
    let engine = Engine::new(&gpu(), &w, EngineOptions::new(1, 16)).unwrap();
    let mut sched = Scheduler::new(&engine, 8);
    let r = Request::from_json(r#"{"tokens": [1], "max_tokens": 18446744073709551615}"#, None).unwrap();
    let e = sched.submit(r).unwrap_err().to_string();
    assert!(e.contains("exceeds the rows' max_len 16"), "{e}");
}

/// A constraint that allows only tokens of one parity, flipping after each token, and fails
/// after `fail_after` tokens: the mask is applied to its row only, each member of a group has
/// its own state, and a failing constraint ends its request with the reason.
struct Alternating {
    even: bool,
    seen: usize,
    fail_after: usize,
}

impl kvdecode::TokenConstraint for Alternating {
    fn allowed(&mut self, mask: &mut [u32]) -> kvdecode::Result<()> {
        if self.seen >= self.fail_after {
            return Err(kvdecode::Error::Input(format!("no token fits after {}", self.seen)));
        }
        let bits = if self.even { 0x5555_5555 } else { 0xAAAA_AAAA };
        mask.iter_mut().for_each(|w| *w = bits);
        Ok(())
    }
    fn consume(&mut self, token: u32) -> kvdecode::Result<()> {
        assert_eq!(token.is_multiple_of(2), self.even, "a token outside the mask was sampled");
        self.even = !self.even;
        self.seen += 1;
        Ok(())
    }
}

#[test]
fn token_constraints_shape_their_rows_only() {
    use kvdecode::{ConstraintFactory, TokenConstraint};
    use std::sync::Arc;
    let s = seed(86);
    let w = model(&tiny_agent_cfg(), s);
    let mut engine = Engine::new(&gpu(), &w, EngineOptions::new(4, 64)).unwrap();
    let mut sched = Scheduler::new(&engine, 8);
    let factory = |fail_after: usize| {
        ConstraintFactory(Arc::new(move || {
            Box::new(Alternating { even: true, seen: 0, fail_after }) as Box<dyn TokenConstraint>
        }))
    };
    let plain = Request { tokens: (1..20).collect(), max_new: 10, ..Default::default() };
    let constrained = Request { constraint: Some(factory(100)), ..plain.clone() };
    let failing = Request { constraint: Some(factory(4)), ..plain.clone() };
    let free = sched.submit(plain.clone()).unwrap();
    let group = sched.submit_group(constrained, &[Sampler::temperature(1.0, 1), Sampler::temperature(1.0, 2)]).unwrap();
    let fail = sched.submit(failing).unwrap();
    let done = sched.run(&mut engine, &mut |_| {}).unwrap();
    let get = |id: usize| done.iter().find(|c| c.id == id).unwrap();
    for &id in &group {
        let c = get(id);
        assert_eq!(c.tokens.len(), 10);
        assert!(c.tokens.iter().enumerate().all(|(k, t)| t.is_multiple_of(2) == k.is_multiple_of(2)), "{:?}", c.tokens);
    }
    let f = get(fail);
    assert_eq!((f.finish, f.tokens.len()), (Finish::ConstraintError, 4));
    assert!(f.error.as_deref().unwrap().contains("no token fits after 4"));
    // the unconstrained request in the same batch gets what it gets alone
    let mut alone = Engine::new(&gpu(), &w, EngineOptions::new(1, 64)).unwrap();
    let mut one = Scheduler::new(&alone, 64);
    one.submit(plain).unwrap();
    assert_eq!(one.run(&mut alone, &mut |_| {}).unwrap()[0].tokens, get(free).tokens);
}

/// A pool too small for every row at once: the scheduler admits by free blocks, preempts the
/// newest rows when blocks run out and resumes them by recomputation (often from the prompt
/// cache); every request still gets exactly what it gets with a pool large enough for all.
#[test]
fn a_small_pool_preempts_and_resumes_with_identical_output() {
    let s = seed(84);
    for cfg in [llama_cfg(), tiny_agent_cfg()] {
        let w = model(&cfg, s);
        let mut reqs = random_requests(12, s);
        // half of them share a system prompt (prompt-cache hits where the model allows)
        let system: Vec<u32> = (0..20).map(|i| (i * 13 + 5) % 95 + 1).collect();
        for r in reqs.iter_mut().step_by(2) {
            r.tokens = [&system[..], &r.tokens[..r.tokens.len().min(30)]].concat();
        }
        let run = |pool: Option<usize>, group: bool| {
            let opts = EngineOptions { block_len: 4, pool_blocks: pool, ..EngineOptions::new(4, 64) };
            let mut engine = Engine::new(&gpu(), &w, opts).unwrap();
            let mut sched = Scheduler::new(&engine, 7);
            for r in &reqs {
                sched.submit(r.clone()).unwrap();
            }
            if group {
                let samplers: Vec<Sampler> = (0..3).map(|i| Sampler::temperature(0.9, 40 + i)).collect();
                sched.submit_group(reqs[1].clone(), &samplers).unwrap();
            }
            // step by step: the seed's accounting at block granularity holds throughout
            let mut done = Vec::new();
            loop {
                let (d, more) = sched.step(&mut engine, &mut |_| {}).unwrap();
                done.extend(d);
                let (used, reserved) = (sched.used_tokens(&engine), sched.reserved_tokens(&engine));
                assert!(reserved <= used + 4 * 4, "reserved {reserved} > used {used} + one block per row");
                assert!(sched.allocated_tokens(&engine) >= reserved);
                if !more && sched.queued() == 0 {
                    break;
                }
            }
            done.sort_by_key(|c| c.id);
            engine.cache().check_blocks().unwrap();
            // every row is free again, every block free or only cached
            let u = engine.cache().block_usage();
            assert_eq!((u.used, u.free), (0, u.total), "{u:?}");
            (done, sched.preemptions(), engine.cache().prompt_cache_stats())
        };
        let (want, none, _) = run(None, true);
        assert_eq!(none, 0, "a full-size pool never preempts");
        // 4 rows of up to 16 blocks, 20 blocks in the pool
        let (got, preemptions, pc) = run(Some(20), true);
        println!("seed {s}: {preemptions} preemptions, prompt cache {pc:?}");
        assert!(preemptions > 0, "the small pool never preempted");
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(&want) {
            assert_eq!((a.id, &a.tokens, &a.logprobs, a.finish), (b.id, &b.tokens, &b.logprobs, b.finish), "seed {s}");
        }
        // (the TinyAgent layout recomputes 4 layers x W + spare positions before a reuse point,
        // more than its 20-token system prompt)
        if !cfg.has_local() {
            assert!(pc.hit_tokens > 0, "no prompt-cache hits: {pc:?}");
        }
    }
}
