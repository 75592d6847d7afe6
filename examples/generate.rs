//! Serve a file of requests through the continuous-batching scheduler.
//!
//! `cargo run --release --example generate -- --model PATH --prompts FILE.jsonl [--rows S] [--prefill-chunk N] [--max-len L] [--kv f32|f16|bf16] [--weights f32|f16]`
//!
//! One request per line: `{"tokens": [..]}` or `{"text": ".."}` (when the model has a tokenizer),
//! optional `"max_tokens"` (default 32), `"temperature"` (0 = greedy, the default), `"top_k"`,
//! `"top_p"`, `"seed"`, `"stop"` (token ids). Prints one JSON line per request, in input order:
//! `{"id": i, "tokens": [generated ids], "text": ".."}` (text when a tokenizer exists), and a
//! summary on stderr. PATH is a GGUF file, a Hugging Face directory, a kvdecode safetensors file,
//! or `demo` for the embedded model.

use std::time::Instant;

use kvdecode::{Engine, EngineOptions, Gpu, KvCache, KvDtype, ModelWeights, Request, Scheduler, WeightDtype};
use serde_json::json;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let usage = "usage: generate --model PATH|demo --prompts FILE.jsonl [--rows S] [--prefill-chunk N] [--max-len L]";
    let model_path = get("--model").ok_or(usage)?;
    let prompts = get("--prompts").ok_or(usage)?;
    let num = |name: &str, default: usize| -> Result<usize, String> {
        get(name).map_or(Ok(default), |s| s.parse().map_err(|_| format!("{name} {s}: not a number")))
    };
    let rows = num("--rows", 4)?;
    let prefill_chunk = num("--prefill-chunk", 32)?;
    // the model, and its tokenizer when it has one (GGUF metadata or tokenizer.json)
    let (model, tok) = if model_path == "demo" {
        (ModelWeights::demo(), None)
    } else {
        let m = kvdecode::model_file::load(&model_path, &mut |_, _| {}).map_err(|e| e.to_string())?;
        (m.weights, m.tokenizer)
    };
    let text = std::fs::read_to_string(&prompts).map_err(|e| format!("{prompts}: {e}"))?;
    let mut reqs = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        reqs.push(Request::from_json(line, tok.as_ref()).map_err(|e| format!("{prompts}:{}: {e}", i + 1))?);
    }
    let gpu = Gpu::new().map_err(|e| e.to_string())?;
    let kv = KvDtype::parse(get("--kv").as_deref().unwrap_or("f32")).map_err(|e| format!("--kv: {e}"))?;
    let weights = if get("--weights").as_deref() == Some("f16") { WeightDtype::F16 } else { WeightDtype::F32 };
    // default: the model's trained context, capped so the K/V of all rows fits in 1 GiB
    let max_len = num("--max-len", KvCache::fit_max_len(&gpu, &model.cfg, rows, kv, 1 << 30, 1024))?;
    let opts = EngineOptions { kv, weights, ..EngineOptions::new(rows, max_len) };
    let mut engine = Engine::new(&gpu, &model, opts).map_err(|e| e.to_string())?;
    let mut sched = Scheduler::new(&engine, prefill_chunk);
    for (i, r) in reqs.into_iter().enumerate() {
        sched.submit(r).map_err(|e| format!("request {i}: {e}"))?;
    }
    let t0 = Instant::now();
    let done = sched.run(&mut engine, &mut |_| {}).map_err(|e| e.to_string())?;
    let secs = t0.elapsed().as_secs_f64();
    let generated: usize = done.iter().map(|c| c.tokens.len()).sum();
    for c in &done {
        match &tok {
            Some(t) => {
                let text = t.decode(&c.tokens, true).map_err(|e| e.to_string())?;
                println!("{}", json!({"id": c.id, "tokens": c.tokens, "text": text}));
            }
            None => println!("{}", json!({"id": c.id, "tokens": c.tokens})),
        }
    }
    eprintln!(
        "{} requests, {generated} tokens in {secs:.2} s ({:.1} tokens/s) on {} with {rows} rows",
        done.len(),
        generated as f64 / secs,
        gpu.describe()
    );
    Ok(())
}
