//! `kvdecode rollout --json`: a GRPO group of 8 forks of one 500-token prompt holds the prompt's
//! global K/V once (copy-on-write blocks), and the figures come out as one JSON object.

mod common;

#[test]
fn a_group_of_forks_holds_its_prompt_once() {
    let (_, v) = common::run_json(&[
        "rollout",
        "--rows",
        "8",
        "--group",
        "8",
        "--episodes",
        "8",
        "--prompt-len",
        "500",
        "--json",
    ]);
    let last = v.to_string();
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {last}"));
    let (rows, block, per_position) = (n("rows"), n("block_size"), n("global_kv_bytes_per_position"));
    assert_eq!((rows, n("prompt_len"), block), (8, 500, 16));
    // at its peak the group holds at most one prompt, what the rows added, and a block per row
    let bound = (n("prompt_len") + n("peak_tokens_beyond_prompt") + rows * block) * per_position;
    assert!(n("peak_global_kv_bytes") <= bound, "{} > {bound}: {last}", n("peak_global_kv_bytes"));
    // per-row copies would have held the prompt 8 times
    assert!(n("unshared_peak_global_kv_bytes") >= 8 * 496 * per_position, "{last}");
    assert!(n("unshared_peak_global_kv_bytes") > 3 * n("peak_global_kv_bytes"), "{last}");
}
