//! `kvdecode bench --json`: the figures scripts read (scripts/bench-llamacpp.sh, gpu-bench.sh)
//! come out as one JSON object on the last line, with every table that ran.

use std::process::Command;

mod common;

#[test]
fn bench_json_carries_throughput_and_attention_variants() {
    let (stdout, v) = common::run_json(&[
        "bench",
        "--model",
        "demo",
        "--rows",
        "1,2",
        "--ctx",
        "8",
        "--steps",
        "2",
        "--kv",
        "f32",
        "--tables",
        "throughput,attention,occupancy,load",
        "--weight-rounds",
        "1",
        "--attention-ctx",
        "70",
        "--occupancy-models",
        "demo",
        "--occupancy-rows",
        "1,2",
        "--occupancy-ctx",
        "64",
        "--json",
    ]);
    let last = v.to_string();
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
    // and the prompt's last chunk (70 tokens: 6, then a chunk of 64 timed)
    assert_eq!(att[0]["chunk_attention_speedup"], 1.0);
    for a in att {
        assert_eq!(a["last_chunk_tokens"], 64, "{last}");
        assert!(a["chunk_attention_ms"].as_f64().unwrap() > 0.0, "{last}");
    }
    assert!(!stdout.contains("multi-step"), "--tables left the multi-step table out");
    // the load table: the streamed load holds less of the heap at its peak than the host copy,
    // which holds every weight in f32 (the allocator's count is exact, not a timing)
    let load = v["load"].as_array().expect("load");
    let heap: Vec<u64> = load.iter().map(|w| w["peak_heap_bytes"].as_u64().unwrap()).collect();
    assert_eq!(heap.len(), 2, "{last}");
    assert!(heap[1] < heap[0], "streamed {} bytes against the host copy's {}: {last}", heap[1], heap[0]);
    // the occupancy table (dry run, computed): a row per dispatch of each configuration, ending
    // with the sampling dispatches, and a summary per configuration (2 rows x 1 context x 2
    // samplers)
    let occ = v["occupancy"].as_array().expect("occupancy");
    for key in ["label", "workgroups", "threads", "serial_iters", "bytes"] {
        assert!(occ.iter().all(|d| !d[key].is_null()), "{key} in every row: {last}");
    }
    // both samplers take the split path (the dry run poses as a GPU): greedy its chunks and
    // merge, top-p its four radix passes and the draw among the kept between them
    for (sampler, stages) in [("greedy", 2), ("top-p + 5 logprobs", 7)] {
        let step: Vec<&serde_json::Value> = occ.iter().filter(|d| d["rows"] == 1 && d["sampler"] == sampler).collect();
        let labels: Vec<&str> = step[step.len() - stages..].iter().map(|d| d["label"].as_str().unwrap()).collect();
        assert_eq!(labels.first(), Some(&"sample_chunks"), "{last}");
        assert_eq!(labels.last(), Some(&"sample_merge"), "{last}");
    }
    assert!(v["dispatches_per_layer"]["demo"].as_f64().unwrap() >= 4.0, "{last}");
    assert_eq!(v["occupancy_summary"].as_array().map(|s| s.len()), Some(4), "{last}");
    for s in v["occupancy_summary"].as_array().unwrap() {
        let (barriers, dispatches) = (s["barriers"].as_u64().unwrap(), s["dispatches"].as_u64().unwrap());
        assert!(barriers > 0 && barriers < dispatches, "the first dispatch waits for none: {s}");
    }
    assert!(stdout.contains("| sample_radix_p3 * | 1 | 2 | 512 |"), "a radix pass is a workgroup a chunk: {stdout}");
    let bad = Command::new(env!("CARGO_BIN_EXE_kvdecode")).args(["bench", "--tables", "nope"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown table \"nope\""));
}

#[test]
fn bench_prefix_table_reports_the_prompt_cache() {
    let (_, v) = common::run_json(&[
        "bench",
        "--model",
        "synthetic:tiny",
        "--tables",
        "prefix",
        "--prefix-len",
        "64",
        "--prefix-requests",
        "6",
        "--prefix-rows",
        "2",
        "--json",
    ]);
    let last = v.to_string();
    let rows = v["prefix"].as_array().expect("prefix");
    let (off, on) = (&rows[0], &rows[1]);
    assert_eq!((off["prompt_cache"].as_bool(), on["prompt_cache"].as_bool()), (Some(false), Some(true)));
    // 2 rows: the first two requests miss, the other four find the 64-token prefix (4 blocks)
    let computed = |r: &serde_json::Value| r["prompt_tokens_computed"].as_u64().unwrap();
    assert_eq!(computed(off), off["prompt_tokens"].as_u64().unwrap());
    assert_eq!(computed(on), computed(off) - 4 * 64, "{last}");
    assert!(v["prefix_hit_rate"].as_f64().unwrap() > 0.3, "{last}");
}

/// The LoRA table runs its four engines and the update, `--lora-sets` makes them anew for each
/// set and gives the median of the sets' ratios, and `--lora-variants` charges `lora.wgsl` to the
/// engines with adapters only: no other test runs `--tables lora`, whose figures #36's notes and
/// docs/BENCHMARKS.md quote.
#[test]
fn bench_lora_table_times_the_adapters_and_their_variants() {
    let (_, v) = common::run_json(&[
        "bench",
        "--model",
        "synthetic:tiny",
        "--tables",
        "lora",
        "--lora-rows",
        "2",
        "--lora-rank",
        "4",
        "--lora-variants",
        "--lora-sets",
        "2",
        "--steps",
        "1",
        "--weight-rounds",
        "1",
        "--json",
    ]);
    let last = v.to_string();
    let lora = &v["lora"];
    let step = &lora["steps"][0];
    assert_eq!(step["rows"], 2, "{last}");
    for key in ["ratio", "ratio_f16", "adapters_lora_ms", "adapters_f16_lora_ms"] {
        assert!(step[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {last}");
    }
    let each: Vec<f64> = step["ratio_each_set"].as_array().unwrap().iter().map(|r| r.as_f64().unwrap()).collect();
    assert_eq!(each.len(), 2, "{last}");
    assert_eq!(step["ratio"].as_f64(), Some(each[0].max(each[1])), "the upper median of two: {last}");
    assert!(lora["update_ratio"].as_f64().is_some_and(|x| x > 0.0), "{last}");
    let variants = lora["variants"][0]["variants"].as_array().expect("--lora-variants");
    let ms = |label: &serde_json::Value| -> Vec<f64> {
        label["ms"].as_array().unwrap().iter().map(|m| m.as_f64().unwrap()).collect()
    };
    let ax: Vec<Vec<f64>> =
        variants.iter().filter(|l| l["label"].as_str().unwrap().starts_with("lora_ax")).map(ms).collect();
    assert!(!ax.is_empty(), "lora.wgsl's variants are listed: {last}");
    // the base engine has no slots: no lora.wgsl; the slot engine runs the f32 variants, the f16
    // engine its own
    assert!(ax.iter().all(|m| m[0] == 0.0), "{last}");
    assert!(ax.iter().any(|m| m[1] > 0.0 && m[2] > 0.0) && ax.iter().any(|m| m[3] > 0.0), "{last}");
}
