//! Chat with a model: streams tokens as they are sampled, stops at end-of-turn, prints tokens/s.
//!
//! `cargo run --release --example chat -- --model PATH "prompt" ["another prompt" ...] [--system TEXT]
//!   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--max-tokens N] [--max-len L] [--kv f16|bf16|f32]`
//!
//! PATH is a GGUF file (its tokenizer and chat template are used) or a Hugging Face directory with
//! `tokenizer.json`. `--temperature 0` is greedy. Several prompts decode as rows of one batch.

use std::io::Write;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kvdecode::tokenizer::Message;
use kvdecode::{Engine, EngineOptions, Event, Gpu, KvCache, KvDtype, Request, Sampler, Scheduler, WeightDtype};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = std::collections::HashMap::new();
    let mut prompts = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if let Some(name) = args[i].strip_prefix("--") {
            let v = args.get(i + 1).ok_or(format!("--{name} needs a value"))?;
            opts.insert(name.to_string(), v.clone());
            i += 2;
        } else {
            prompts.push(args[i].clone());
            i += 1;
        }
    }
    let usage = "usage: chat --model PATH \"prompt\" [...] [--system T] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--max-tokens N] [--max-len L] [--kv f16|bf16|f32]";
    let model_path = opts.get("model").ok_or(usage)?.clone();
    if prompts.is_empty() {
        return Err(usage.into());
    }
    let num = |k: &str, d: f64| -> Result<f64, String> {
        opts.get(k).map_or(Ok(d), |v| v.parse().map_err(|_| format!("--{k} {v}: not a number")))
    };
    let sampler = Sampler {
        temperature: num("temperature", 0.7)? as f32,
        seed: num("seed", 0.0)? as u32,
        top_k: num("top-k", 40.0)? as u32,
        top_p: num("top-p", 0.95)? as f32,
    };
    let max_tokens = num("max-tokens", 256.0)? as usize;

    // load with a progress bar
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers").map_err(|e| e.to_string())?,
    );
    bar.set_message(model_path.clone());
    let t0 = Instant::now();
    let loaded = kvdecode::model_file::load(&model_path, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .map_err(|e| e.to_string())?;
    let weights = loaded.weights;
    let tok = loaded.tokenizer.ok_or(format!("{model_path}: the model has no tokenizer to chat with"))?;
    bar.finish_and_clear();
    let gpu = Gpu::new().map_err(|e| e.to_string())?;
    let rows = prompts.len();
    let mut texts = Vec::new();
    for p in &prompts {
        let mut msgs = Vec::new();
        if let Some(s) = opts.get("system") {
            msgs.push(Message::new("system", s));
        }
        msgs.push(Message::new("user", p));
        let text = match tok.apply_chat_template(&msgs, true) {
            Ok(t) => t,
            Err(_) => p.clone(), // no template: plain completion
        };
        texts.push(tok.encode(&text).map_err(|e| e.to_string())?);
    }
    let kv = KvDtype::parse(opts.get("kv").map_or("f16", String::as_str)).map_err(|e| format!("--kv: {e}"))?;
    // rows as long as the model's trained context (capped so the K/V fits in 1 GiB), or --max-len
    let fit = KvCache::fit_max_len(&gpu, &weights.cfg, rows, kv, 1 << 30, 4096);
    let max_len = num("max-len", fit as f64)? as usize;
    let longest = texts.iter().map(Vec::len).max().unwrap_or(0);
    if longest + 1 > max_len {
        return Err(format!("a prompt of {longest} tokens does not fit in max_len {max_len}"));
    }
    let max_tokens = max_tokens.min(max_len - longest);
    let eopts = EngineOptions { kv, weights: WeightDtype::F16, ..EngineOptions::new(rows, max_len) };
    let mut engine = Engine::new(&gpu, &weights, eopts).map_err(|e| e.to_string())?;
    eprintln!("loaded in {:.1} s; {} on {}", t0.elapsed().as_secs_f64(), model_path, gpu.describe());
    let stop = tok.end_of_turn();
    let mut sched = Scheduler::new(&engine, 64);
    for ids in texts {
        sched
            .submit(Request { tokens: ids, max_new: max_tokens, stop: stop.clone(), sampler })
            .map_err(|e| e.to_string())?;
    }
    let t1 = Instant::now();
    let stream = rows == 1;
    let mut pending: Vec<Vec<u32>> = vec![Vec::new(); rows];
    let mut printed: Vec<usize> = vec![0; rows];
    let mut first_token: Option<Instant> = None;
    let done = sched
        .run(&mut engine, &mut |ev| {
            if let Event::Token { id, token, .. } = ev {
                first_token.get_or_insert_with(Instant::now);
                if stop.contains(&token) || !stream {
                    return;
                }
                // print the text as it grows (decode the whole turn so multi-byte characters
                // split across tokens come out whole)
                pending[id].push(token);
                if let Ok(text) = tok.decode(&pending[id], true) {
                    if !text.ends_with('\u{fffd}') {
                        print!("{}", &text[printed[id].min(text.len())..]);
                        printed[id] = text.len();
                        let _ = std::io::stdout().flush();
                    }
                }
            }
        })
        .map_err(|e| e.to_string())?;
    let secs = t1.elapsed().as_secs_f64();
    if stream {
        println!();
    } else {
        for c in &done {
            let text = tok.decode(&c.tokens, true).map_err(|e| e.to_string())?;
            println!("[{}] {}\n", c.id, text.trim_end());
        }
    }
    let n: usize = done.iter().map(|c| c.tokens.len()).sum();
    let ttft = first_token.map_or(secs, |t| (t - t1).as_secs_f64());
    eprintln!(
        "{n} tokens in {secs:.2} s ({rows} row{}): prompt processed in {ttft:.2} s, then {:.1} tokens/s",
        if rows > 1 { "s" } else { "" },
        n.saturating_sub(rows) as f64 / (secs - ttft).max(1e-9)
    );
    Ok(())
}
