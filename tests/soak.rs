//! A short soak in CI (the long one is `cargo run --release --example soak`, figures in
//! docs/RELIABILITY.md): random resets, forks, rollbacks, tool results and sub-batches, checked against the
//! reference at checkpoints, with memory that must not grow.

mod common;

#[path = "../examples/soak.rs"]
mod soak;

use common::*;
use kvdecode::KvDtype;

#[test]
fn short_soak_stays_exact_and_flat() {
    let s = seed(97);
    let o = soak::SoakOptions { steps: 1500, rows: 6, seed: s, check_every: 60, kv: KvDtype::F32 };
    // a device of its own: the allocator's report covers every engine on the device
    let gpu = own_gpu();
    let r = soak::soak(&gpu, o, &mut |_| {}).unwrap();
    println!("{r:?}");
    assert!(r.checks >= 40 && r.worst_diff <= 1e-4, "{r:?}");
    assert!(r.turns > 0 && r.tool_results > 0 && r.forks > 0 && r.rollbacks > 0 && r.prompts > 0, "{r:?}");
    assert_eq!(r.engine_bytes_end, r.engine_bytes, "engine buffers changed during the run");
    if let (Some(a), Some(b)) = (r.gpu_allocated_start, r.gpu_allocated_end) {
        assert!(b <= a, "GPU allocations grew from {a} to {b} bytes");
    }
    // host memory: allow allocator noise, not growth with the number of steps
    assert!(r.rss_end <= r.rss_start + (32 << 20), "RSS grew from {} to {} bytes", r.rss_start, r.rss_end);
}

/// The soak's flags: a misspelt one, or one without its value, is refused by name (it ran with
/// the defaults before).
#[test]
fn misspelt_soak_flags_are_refused() {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(soak::check_flags(&args(&["--steps", "10", "--json"])), Ok(()));
    let e = soak::check_flags(&args(&["--step", "10"])).unwrap_err();
    assert!(e.contains("\"--step\""), "{e}");
    assert!(soak::check_flags(&args(&["--rows"])).is_err(), "a flag without its value");
}
