//! The conversation behind the window: a model loaded on a thread of its own (pipelines compile
//! there, not in a frame), and answers decoded one scheduler step at a time through
//! `kvdecode::Pending`, which the window polls once a frame, so no frame waits for the GPU.

use std::sync::mpsc;
use std::time::Instant;

use kvdecode::io::tokenizer::{Message, TextStream, Tokenizer};
use kvdecode::{
    Engine, EngineOptions, Event, Gpu, KvCache, KvDtype, ModelWeights, Pending, Request, Sampler, Scheduler,
    WeightDtype,
};

/// What the window was started with that decides the answers (the same meaning, names and
/// defaults as `kvdecode chat`'s, so both give the same tokens).
#[derive(Clone, Debug)]
pub struct ChatOptions {
    pub model: Option<String>,
    pub lora: Option<String>,
    pub system: Option<String>,
    pub sampler: Sampler,
    pub max_tokens: usize,
    /// Dispatches per submission (`EngineOptions::dispatches_per_submit`).
    pub dispatches_per_submit: usize,
}

/// A model on the GPU, with what the window shows of it.
pub struct Loaded {
    engine: Engine,
    tok: Option<Tokenizer>,
    /// The model's name (its file, or the embedded demo).
    pub model: String,
    /// The adapter's name, when one was loaded.
    pub adapter: Option<String>,
}

/// Load the model (and adapter) and build its engine on a thread of its own; the receiver gets
/// the result.
pub fn load_in_background(gpu: Gpu, o: ChatOptions) -> mpsc::Receiver<Result<Loaded, String>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(load(&gpu, &o).map_err(|e| e.to_string()));
    });
    rx
}

fn load(gpu: &Gpu, o: &ChatOptions) -> Result<Loaded, Box<dyn std::error::Error>> {
    // a file's tensors go to the GPU one at a time, with no host copy of the model
    enum Source {
        Demo(Box<ModelWeights>),
        File(Box<kvdecode::io::model_file::ModelFile>),
    }
    let (mut source, model) = match &o.model {
        None => (
            Source::Demo(Box::new(ModelWeights::demo())),
            "the embedded demo model (random weights, no tokenizer)".to_string(),
        ),
        Some(path) => (Source::File(Box::new(kvdecode::io::model_file::ModelFile::open(path)?)), path.clone()),
    };
    let (tok, cfg) = match &mut source {
        Source::Demo(w) => (None, w.cfg.clone()),
        Source::File(f) => (f.tokenizer.take(), f.config().clone()),
    };
    // as `kvdecode chat`: f16 weights and K/V, rows as long as a 1 GiB K/V allows (at most 4096)
    let max_len = KvCache::fit_max_len(gpu, &cfg, 1, KvDtype::F16, 1 << 30, 4096);
    let opts = EngineOptions {
        kv: KvDtype::F16,
        weights: WeightDtype::F16,
        max_loras: usize::from(o.lora.is_some()),
        // a step in parts, one submitted per frame: the window's frames go in between
        dispatches_per_submit: o.dispatches_per_submit,
        ..EngineOptions::new(1, max_len)
    };
    let mut engine = match &source {
        Source::Demo(w) => Engine::new(gpu, w, opts)?,
        Source::File(f) => Engine::from_file(gpu, f, opts)?,
    };
    let adapter = match &o.lora {
        Some(path) => {
            engine.load_lora_path("adapter", path)?;
            // shown by its file or folder name
            let name = std::path::Path::new(path).file_name().map(|n| n.to_string_lossy().into_owned());
            Some(name.unwrap_or_else(|| path.clone()))
        }
        None => None,
    };
    Ok(Loaded { engine, tok, model, adapter })
}

/// What one scheduler step gave back, with the engine and scheduler it borrowed.
struct StepOut {
    engine: Engine,
    sched: Scheduler,
    tokens: Vec<u32>,
    done: bool,
    result: kvdecode::Result<()>,
}

/// The conversation: the engine and scheduler between steps, or the step in flight.
pub struct Chat {
    parked: Option<(Engine, Scheduler)>,
    step: Option<Pending<StepOut>>,
    gpu: Gpu,
    tok: Option<Tokenizer>,
    options: ChatOptions,
    msgs: Vec<Message>,
    /// The request of the answer being decoded.
    request: Option<usize>,
    text: TextStream,
    stop: Vec<u32>,
    /// The answer so far, as shown.
    pub answer: String,
    /// Its token ids.
    pub answer_ids: Vec<u32>,
    /// Scheduler steps and frames while an answer was being decoded (all answers).
    pub steps: usize,
    pub frames_decoding: usize,
    first_token: Option<Instant>,
    /// Tokens per second of the answer being decoded (or the last one), from its first token.
    pub tokens_per_s: f64,
    stop_asked: bool,
}

impl Chat {
    /// A conversation on `loaded`'s engine.
    pub fn new(gpu: &Gpu, loaded: Loaded, options: ChatOptions) -> (Chat, String, Option<String>) {
        let Loaded { engine, tok, model, adapter } = loaded;
        let sched = Scheduler::new(&engine, 64);
        let stop = tok.as_ref().map(Tokenizer::end_of_turn).unwrap_or_default();
        let msgs = options.system.iter().map(|s| Message::new("system", s)).collect();
        let chat = Chat {
            parked: Some((engine, sched)),
            step: None,
            gpu: gpu.clone(),
            tok,
            options,
            msgs,
            request: None,
            text: TextStream::new(true),
            stop,
            answer: String::new(),
            answer_ids: Vec::new(),
            steps: 0,
            frames_decoding: 0,
            first_token: None,
            tokens_per_s: 0.0,
            stop_asked: false,
        };
        (chat, model, adapter)
    }

    /// Whether an answer is being decoded.
    pub fn busy(&self) -> bool {
        self.request.is_some()
    }

    /// The conversation so far (user and assistant turns).
    pub fn messages(&self) -> &[Message] {
        &self.msgs
    }

    /// Ask `user`: render the conversation (the model's chat template, as `kvdecode chat`) and
    /// queue it; the frames that follow decode the answer.
    pub fn send(&mut self, user: &str) -> Result<(), String> {
        let Some((engine, sched)) = self.parked.as_mut().filter(|_| self.request.is_none()) else {
            return Err("an answer is still being decoded".into());
        };
        self.msgs.push(Message::new("user", user));
        let ids = match &self.tok {
            Some(tok) => match tok.apply_chat_template(&self.msgs, true) {
                Ok(text) => tok.encode_rendered(&text),
                Err(_) => tok.encode(user), // no template: plain completion
            }
            .map_err(|e| e.to_string())?,
            // the demo model: each message its UTF-8 bytes and token 0 (as the browser page)
            None => self.msgs.iter().flat_map(|m| m.content.bytes().map(u32::from).chain([0])).collect(),
        };
        let max_len = engine.cache().max_len();
        if ids.len() + 1 > max_len {
            self.msgs.pop();
            return Err(format!("the conversation ({} tokens) does not fit the row's {max_len}", ids.len()));
        }
        let id = sched
            .submit(Request {
                tokens: ids.clone(),
                max_new: self.options.max_tokens.min(max_len - ids.len()),
                stop: self.stop.clone(),
                sampler: self.options.sampler,
                adapter: self.options.lora.as_ref().map(|_| "adapter".to_string()),
                ..Default::default()
            })
            .map_err(|e| e.to_string())?;
        self.request = Some(id);
        self.text = TextStream::new(true);
        self.answer.clear();
        self.answer_ids.clear();
        self.first_token = None;
        self.stop_asked = false;
        Ok(())
    }

    /// Stop the answer at the end of the step in flight.
    pub fn stop(&mut self) {
        self.stop_asked = self.request.is_some();
    }

    /// Once a frame: take a finished step's tokens, then start the next step. Never waits for the
    /// GPU. Returns an error of the step, which ends the answer.
    pub fn frame(&mut self) -> Result<(), String> {
        if self.request.is_none() {
            return Ok(());
        }
        self.frames_decoding += 1;
        // a step with no readback (a prompt chunk that samples nothing) finishes in the poll that
        // starts it; the next one then starts in the same frame
        for _ in 0..8 {
            if self.step.is_none() {
                self.start_step();
            }
            // the first poll records and submits the step; a later one finds it done
            let Some(out) = self.step.as_mut().and_then(Pending::poll) else { return Ok(()) };
            self.step = None;
            self.steps += 1;
            let StepOut { mut engine, mut sched, tokens, done, result } = out;
            for t in tokens {
                self.show(t);
            }
            let end = if let Err(e) = result {
                Some(Err(e.to_string()))
            } else if done {
                Some(Ok(()))
            } else if self.stop_asked {
                sched.cancel(&mut engine, self.request.expect("decoding"));
                Some(Ok(()))
            } else {
                None
            };
            self.parked = Some((engine, sched));
            if let Some(end) = end {
                self.finish();
                return end;
            }
        }
        Ok(())
    }

    /// The next scheduler step, as a `Pending` holding the engine and scheduler until it ends.
    fn start_step(&mut self) {
        let (mut engine, mut sched) = self.parked.take().expect("parked between steps");
        let mine = self.request;
        self.step = Some(Pending::new(&self.gpu, async move {
            let (mut tokens, mut done) = (Vec::new(), false);
            let result = sched
                .step_async(&mut engine, &mut |ev| match ev {
                    Event::Token { id, token, .. } if Some(id) == mine => tokens.push(token),
                    Event::Done(c) if Some(c.id) == mine => done = true,
                    _ => {}
                })
                .await
                .map(|_| ());
            StepOut { engine, sched, tokens, done, result }
        }));
    }

    /// Add a sampled token to the answer shown.
    fn show(&mut self, t: u32) {
        let now = Instant::now();
        let first = *self.first_token.get_or_insert(now);
        self.answer_ids.push(t);
        let secs = (now - first).as_secs_f64();
        if secs > 0.0 {
            self.tokens_per_s = (self.answer_ids.len() - 1) as f64 / secs;
        }
        if self.stop.contains(&t) {
            return;
        }
        match &self.tok {
            Some(tok) => self.answer.push_str(&self.text.push(tok, t).unwrap_or_default()),
            None => self.answer.push_str(&format!("{t} ")),
        }
    }

    /// The answer ended: flush its text and keep it in the conversation.
    fn finish(&mut self) {
        if let Some(tok) = &self.tok {
            self.answer.push_str(&self.text.finish(tok).unwrap_or_default());
        }
        self.msgs.push(Message::new("assistant", &self.answer));
        self.request = None;
    }

    /// Bytes of GPU buffers the engine holds (between steps).
    pub fn engine_bytes(&self) -> Option<u64> {
        self.parked.as_ref().map(|(e, _)| e.memory_report().engine_bytes)
    }
}
