//! `kvdecode generate`: a file of JSONL requests through the continuous-batching scheduler; one
//! JSON line per request, in input order, on stdout; a summary on stderr.

use std::time::Instant;

use kvdecode::{Gpu, Request, Scheduler};
use serde_json::json;

use crate::common::{open_model, EngineArgs, Result};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file, a Hugging Face directory, a kvdecode safetensors file, or `demo`.
    #[arg(long)]
    model: String,
    /// One request per line: {"tokens": [..]} or {"text": ".."}, optional "max_tokens" (32),
    /// "temperature" (0: greedy), "top_k", "top_p", "seed", "stop" (token ids).
    #[arg(long)]
    prompts: String,
    /// Cache rows (requests decoded side by side).
    #[arg(long, default_value_t = 4)]
    rows: usize,
    /// Prompt tokens prefilled per scheduler step.
    #[arg(long, default_value_t = 32)]
    prefill_chunk: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(a: Args) -> Result<()> {
    let (model, tok) = open_model(&a.model)?;
    let text = std::fs::read_to_string(&a.prompts).map_err(|e| format!("{}: {e}", a.prompts))?;
    let mut reqs = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        reqs.push(Request::from_json(line, tok.as_ref()).map_err(|e| format!("{}:{}: {e}", a.prompts, i + 1))?);
    }
    let gpu = Gpu::new()?;
    let max_len = a.engine.max_len(&gpu, model.cfg(), a.rows);
    let mut engine = model.engine(&gpu, a.engine.options(a.rows, max_len))?;
    let mut sched = Scheduler::new(&engine, a.prefill_chunk);
    for (i, r) in reqs.into_iter().enumerate() {
        sched.submit(r).map_err(|e| format!("request {i}: {e}"))?;
    }
    let t0 = Instant::now();
    let done = sched.run(&mut engine, &mut |_| {})?;
    let secs = t0.elapsed().as_secs_f64();
    let generated: usize = done.iter().map(|c| c.tokens.len()).sum();
    for c in &done {
        match &tok {
            Some(t) => println!("{}", json!({"id": c.id, "tokens": c.tokens, "text": t.decode(&c.tokens, true)?})),
            None => println!("{}", json!({"id": c.id, "tokens": c.tokens})),
        }
    }
    eprintln!(
        "{} requests, {generated} tokens in {secs:.2} s ({:.1} tokens/s) on {} with {} rows",
        done.len(),
        generated as f64 / secs,
        gpu.describe(),
        a.rows
    );
    Ok(())
}
