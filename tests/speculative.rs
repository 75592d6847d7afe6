//! Speculative decoding (n-gram prompt lookup, verify in one pass, roll back the rest) gives
//! exactly the tokens of plain greedy decoding, and leaves the cache where greedy leaves it.

mod common;

use common::*;
use kvdecode::serve::speculative::{greedy_speculative, ngram_draft};
use kvdecode::{Engine, EngineOptions, Sampler, TurnLimit};

#[test]
fn ngram_lookup() {
    assert_eq!(ngram_draft(&[1, 2, 3, 4, 1, 2], 2, 3), vec![3, 4, 1]);
    assert_eq!(ngram_draft(&[1, 2, 3, 4, 1, 2], 2, 1), vec![3]);
    assert_eq!(ngram_draft(&[1, 2, 3], 2, 3), Vec::<u32>::new());
    assert_eq!(ngram_draft(&[5, 5, 5], 1, 4), vec![5]);
}

#[test]
fn speculative_equals_plain_greedy() {
    let mut total_accepted = 0;
    for (cfg, seed) in [(tiny_agent_cfg(), 101u64), (llama_cfg(), 102), (tiny_agent_cfg(), 103)] {
        let w = model(&cfg, seed);
        // a repetitive prompt so that lookups find something
        let prompt: Vec<u32> = (0..24).map(|i| [7u32, 8, 9, 10, 11, 12][i % 6]).collect();
        for (max_new, stop) in [(40usize, vec![]), (40, vec![9u32]), (13, vec![])] {
            let opts = EngineOptions { rollback: 6, ..EngineOptions::new(2, 96) };
            let mut plain = Engine::new(&gpu(), &w, opts).unwrap();
            plain.feed(&prompt[..23], 23, &[23], Some(&[1])).unwrap();
            let limit = [TurnLimit { max_new, stop: stop.clone() }];
            let want = plain.decode_turns(&[1], &[prompt[23]], &[Sampler::GREEDY], &limit, 1, &|_, _| false).unwrap();
            let mut spec = Engine::new(&gpu(), &w, opts).unwrap();
            let (got, stats) = greedy_speculative(&mut spec, 1, &prompt, max_new, 5, 2, &stop).unwrap();
            assert_eq!(got, want[0].tokens, "seed {seed} max_new {max_new} stop {stop:?}: {stats:?}");
            assert_eq!(spec.cache().history(1), plain.cache().history(1), "caches differ");
            println!(
                "seed {seed}: {} tokens in {} passes, {}/{} drafted accepted",
                got.len(),
                stats.passes,
                stats.accepted,
                stats.drafted
            );
            total_accepted += stats.accepted;
        }
    }
    assert!(total_accepted > 0, "no draft was ever accepted: the test did not exercise verification");
}
