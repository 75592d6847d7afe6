//! `kvdecode chat`: a conversation kept on one cache row across turns. Each turn renders the whole
//! conversation with the model's chat template, keeps the longest prefix the row already holds
//! (rolling back or, failing that, resetting when the rendering differs) and prefills only the
//! rest, then streams the answer in windows of decode steps. Ctrl-C stops the answer, not the
//! program; `/reset`, `/system TEXT`, `/quit` (or end of input) at the prompt.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvdecode::io::tokenizer::{Message, TextStream, Tokenizer};
use kvdecode::{Engine, EngineOptions, Event, Gpu, Request, Sampler, Scheduler, TurnLimit};

use crate::common::{open_model, EngineArgs, Result};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file, a Hugging Face directory or a kvdecode safetensors file (with a tokenizer).
    #[arg(long)]
    model: String,
    /// Answer these prompts (several: rows of one batch) and exit; none: an interactive chat.
    prompts: Vec<String>,
    /// System prompt.
    #[arg(long)]
    system: Option<String>,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// Keep the K most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    top_k: u32,
    /// Nucleus sampling threshold in (0, 1].
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Decode steps per readback while streaming.
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// Answer with this LoRA adapter (a PEFT folder or a GGUF LoRA file, rank up to 16).
    #[arg(long)]
    lora: Option<String>,
    /// Print per-turn cache reuse and prefill counts on stderr.
    #[arg(long)]
    verbose: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(a: Args) -> Result<()> {
    let t0 = Instant::now();
    let (model, tok) = open_model(&a.model)?;
    let tok = tok.ok_or(format!("{}: the model has no tokenizer to chat with", a.model))?;
    let gpu = Gpu::new()?;
    let sampler =
        Sampler { temperature: a.temperature, seed: a.seed, top_k: a.top_k, top_p: a.top_p, ..Sampler::GREEDY };
    let rows = a.prompts.len().max(1);
    let max_len = a.engine.max_len(&gpu, model.cfg(), rows);
    let opts = EngineOptions {
        rollback: a.window.max(1) - 1,
        max_loras: usize::from(a.lora.is_some()),
        ..a.engine.options(rows, max_len)
    };
    let mut engine = model.engine(&gpu, opts)?;
    if let Some(path) = &a.lora {
        engine.load_lora_path(ADAPTER, path)?;
        // the conversation's row decodes with it (and keeps it when the row starts over)
        engine.set_adapter(0, Some(ADAPTER))?;
    }
    eprintln!(
        "loaded {} in {:.1} s on {}; rows of {max_len} tokens, {} K/V",
        a.model,
        t0.elapsed().as_secs_f64(),
        gpu.describe(),
        a.engine.kv.name()
    );
    if a.prompts.is_empty() {
        interactive(engine, &tok, &a, sampler)
    } else {
        one_shot(engine, &tok, &a, sampler)
    }
}

/// The name `--lora`'s adapter is loaded under.
const ADAPTER: &str = "adapter";

/// The conversation so far and the row it lives on (row 0 of a one-row engine).
pub struct Conversation<'a> {
    pub engine: Engine,
    tok: &'a Tokenizer,
    system: Option<String>,
    msgs: Vec<Message>,
    stop: Vec<u32>,
}

/// What one turn did.
pub struct TurnStats {
    pub prompt_tokens: usize,
    pub reused: usize,
    pub prefilled: usize,
    pub answer_tokens: usize,
    pub interrupted: bool,
    pub seconds: f64,
}

impl<'a> Conversation<'a> {
    pub fn new(engine: Engine, tok: &'a Tokenizer, system: Option<String>) -> Self {
        let stop = tok.end_of_turn();
        let mut c = Conversation { engine, tok, system, msgs: Vec::new(), stop };
        c.clear();
        c
    }

    /// Forget the conversation (the row is reset at the next turn's prefix check).
    pub fn clear(&mut self) {
        self.msgs = self.system.iter().map(|s| Message::new("system", s)).collect();
    }

    pub fn set_system(&mut self, s: Option<String>) {
        self.system = s;
        self.clear();
    }

    /// Answer `user`, calling `out` with text as it is decoded; `stop_now` ends the answer early.
    pub fn turn(
        &mut self,
        user: &str,
        sampler: Sampler,
        max_tokens: usize,
        window: usize,
        stop_now: &AtomicBool,
        out: &mut dyn FnMut(&str),
    ) -> Result<TurnStats> {
        let t = Instant::now();
        self.msgs.push(Message::new("user", user));
        let text = match self.tok.apply_chat_template(&self.msgs, true) {
            Ok(t) => t,
            Err(e) => {
                self.msgs.pop();
                return Err(e.into());
            }
        };
        let ids = self.tok.encode_rendered(&text)?;
        if ids.is_empty() {
            self.msgs.pop();
            return Err("the rendered prompt is empty".into());
        }
        let room = self.engine.cache().max_len().saturating_sub(ids.len());
        if room == 0 {
            self.msgs.pop();
            return Err(format!(
                "the conversation ({} tokens) fills the row's {} tokens; /reset to start over",
                ids.len(),
                self.engine.cache().max_len()
            )
            .into());
        }
        // keep what the row already holds of this prompt (all but the last token, which is fed
        // to the first decode step), roll back what differs, or start over (from the prompt
        // cache) when that is too deep; prefill the rest
        let keep = self.engine.continue_row(0, &ids)?;
        // decode in windows of `window` steps, streaming each window's text
        let mut answer: Vec<u32> = Vec::new();
        let mut next = ids[ids.len() - 1];
        // whole characters only: a multi-byte character may span tokens (TextStream holds it)
        let mut text = TextStream::new(true);
        let mut interrupted = false;
        let max_tokens = max_tokens.min(room);
        loop {
            let n = window.min(max_tokens - answer.len()).max(1);
            let limit = TurnLimit { max_new: n, stop: self.stop.clone() };
            let turn = self.engine.decode_turns(&[0], &[next], &[sampler], &[limit], n, &|_, _| false)?.remove(0);
            answer.extend_from_slice(&turn.tokens);
            for &t in turn.tokens.iter().filter(|t| !self.stop.contains(t)) {
                let piece = text.push(self.tok, t)?;
                if !piece.is_empty() {
                    out(&piece);
                }
            }
            if turn.stopped || answer.len() >= max_tokens {
                break;
            }
            if stop_now.swap(false, Ordering::SeqCst) {
                interrupted = true;
                break;
            }
            next = *answer.last().expect("a window decodes at least one token");
        }
        let rest = text.finish(self.tok)?;
        if !rest.is_empty() {
            out(&rest);
        }
        let shown: Vec<u32> = answer.iter().copied().filter(|t| !self.stop.contains(t)).collect();
        self.msgs.push(Message::new("assistant", &self.tok.decode(&shown, true)?));
        Ok(TurnStats {
            prompt_tokens: ids.len(),
            reused: keep,
            prefilled: ids.len() - keep,
            answer_tokens: answer.len(),
            interrupted,
            seconds: t.elapsed().as_secs_f64(),
        })
    }
}

fn interactive(engine: Engine, tok: &Tokenizer, a: &Args, sampler: Sampler) -> Result<()> {
    let stop_now = Arc::new(AtomicBool::new(false));
    let flag = stop_now.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))?;
    let mut conv = Conversation::new(engine, tok, a.system.clone());
    eprintln!("chat: Ctrl-C stops an answer; /reset, /system TEXT, /quit (or end of input) at the prompt");
    let stdin = std::io::stdin();
    let mut turn_no = 0;
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                conv.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            s if s.starts_with("/system") => {
                let text = s["/system".len()..].trim();
                conv.set_system((!text.is_empty()).then(|| text.to_string()));
                eprintln!("(system prompt set; conversation cleared)");
                continue;
            }
            _ => {}
        }
        stop_now.store(false, Ordering::SeqCst);
        let mut stdout = std::io::stdout();
        let stats = conv.turn(line, sampler, a.max_tokens, a.window, &stop_now, &mut |s| {
            print!("{s}");
            let _ = stdout.flush();
        });
        println!();
        turn_no += 1;
        match stats {
            Ok(s) => {
                if s.interrupted {
                    eprintln!("(stopped)");
                }
                if a.verbose {
                    eprintln!(
                        "[turn {turn_no}: prompt {} tokens, {} reused from the cache, {} prefilled; answer {} tokens in {:.2} s]",
                        s.prompt_tokens, s.reused, s.prefilled, s.answer_tokens, s.seconds
                    );
                }
            }
            Err(e) => eprintln!("error: {e}"),
        }
    }
    Ok(())
}

fn one_shot(mut engine: Engine, tok: &Tokenizer, a: &Args, sampler: Sampler) -> Result<()> {
    let rows = a.prompts.len();
    let mut texts = Vec::new();
    for p in &a.prompts {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(Message::new("system", s));
        }
        msgs.push(Message::new("user", p));
        // the template's rendering, without a second BOS where it wrote one (as a conversation's
        // turns are encoded); no template: plain completion
        texts.push(match tok.apply_chat_template(&msgs, true) {
            Ok(text) => tok.encode_rendered(&text)?,
            Err(_) => tok.encode(p)?,
        });
    }
    let longest = texts.iter().map(Vec::len).max().unwrap_or(0);
    let max_len = engine.cache().max_len();
    if longest + 1 > max_len {
        return Err(format!("a prompt of {longest} tokens does not fit in max_len {max_len}").into());
    }
    let max_tokens = a.max_tokens.min(max_len - longest);
    let stop = tok.end_of_turn();
    let mut sched = Scheduler::new(&engine, 64);
    for ids in texts {
        sched.submit(Request {
            tokens: ids,
            max_new: max_tokens,
            stop: stop.clone(),
            sampler,
            adapter: a.lora.as_ref().map(|_| ADAPTER.to_string()),
            ..Default::default()
        })?;
    }
    let t1 = Instant::now();
    let stream = rows == 1;
    let mut streams: Vec<TextStream> = vec![TextStream::new(true); rows];
    let mut first_token: Option<Instant> = None;
    let done = sched.run(&mut engine, &mut |ev| {
        if let Event::Token { id, token, .. } = ev {
            first_token.get_or_insert_with(Instant::now);
            if stop.contains(&token) || !stream {
                return;
            }
            if let Ok(piece) = streams[id].push(tok, token) {
                print!("{piece}");
                let _ = std::io::stdout().flush();
            }
        }
    })?;
    let secs = t1.elapsed().as_secs_f64();
    if stream {
        println!();
    } else {
        for c in &done {
            println!("[{}] {}\n", c.id, tok.decode(&c.tokens, true)?.trim_end());
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
