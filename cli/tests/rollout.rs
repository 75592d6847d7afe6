//! `kvdecode rollout --json`: a GRPO group of 8 forks of one 500-token prompt holds the prompt's
//! global K/V once (copy-on-write blocks), and the figures come out as one JSON object.

use std::process::Command;

#[test]
fn a_group_of_forks_holds_its_prompt_once() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["rollout", "--rows", "8", "--group", "8", "--episodes", "8", "--prompt-len", "500", "--json"])
        .output()
        .expect("run kvdecode rollout");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().expect("output");
    let v: serde_json::Value = serde_json::from_str(last).expect("the last line is JSON");
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
