//! `kvdecode bench --json`: the figures scripts read (scripts/bench-llamacpp.sh) come out as one
//! JSON object on the last line, with every table that ran.

use std::process::Command;

#[test]
fn bench_json_carries_throughput_and_attention_variants() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["bench", "--model", "demo", "--rows", "1,2", "--ctx", "8", "--steps", "2", "--kv", "f32"])
        .args(["--tables", "throughput,attention", "--attention-ctx", "70", "--json"])
        .output()
        .expect("run kvdecode bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().expect("output");
    let v: serde_json::Value = serde_json::from_str(last).expect("the last line is JSON");
    let rows = v["throughput"].as_array().expect("throughput");
    assert_eq!(rows.len(), 2, "one entry per (kv, rows, context): {last}");
    for (r, want_rows) in rows.iter().zip([1, 2]) {
        assert_eq!(r["rows"], want_rows);
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0 && r["prefill_tok_s"].as_f64().unwrap() > 0.0);
    }
    // the attention table times every variant, against serial first (whose speedup is 1)
    let att = v["attention"].as_array().expect("attention");
    let names: Vec<&str> = att.iter().map(|a| a["attention"].as_str().unwrap()).collect();
    assert_eq!(names, ["serial", "split-group", "split-head"], "{last}");
    assert_eq!(att[0]["attention_speedup"], 1.0);
    assert!(!stdout.contains("multi-step"), "--tables left the multi-step table out");
    let bad = Command::new(env!("CARGO_BIN_EXE_kvdecode")).args(["bench", "--tables", "nope"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown table \"nope\""));
}
