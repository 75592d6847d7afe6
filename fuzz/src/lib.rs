//! What the fuzz targets share: one GPU for the whole run, an engine built (and stepped once) for
//! every model shape a file manages to load, a small tokenizer, and the text formats that turn
//! fuzz bytes into tokenizer metadata and chat conversations.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, OnceLock};

use kvdecode::io::gguf::Value;
use kvdecode::io::tokenizer::{Message, Tokenizer};
use kvdecode::{Engine, EngineOptions, Gpu, ModelWeights};

/// The run's GPU (lavapipe in `scripts/fuzz.sh`). No adapter is a setup error, not a finding.
pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        Gpu::new().expect("the fuzz targets need a GPU adapter (lavapipe: apt-get install mesa-vulkan-drivers)")
    })
}

/// Whether `key` is new to this run. Work whose outcome depends only on part of an input (a
/// tokenizer on the metadata, an engine on the model's shape) runs once per distinct part, not
/// once per mutated byte of a tensor, which keeps the run fast enough for millions of inputs.
pub fn first_time(key: u64) -> bool {
    static SEEN: Mutex<BTreeMap<u64, ()>> = Mutex::new(BTreeMap::new());
    SEEN.lock().unwrap().insert(key, ()).is_none()
}

/// A hash of anything `Debug`.
pub fn key(x: &impl std::fmt::Debug) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{x:?}").hash(&mut h);
    h.finish()
}

/// Build an engine for `w` and run one ragged append, the first time a model of this shape and
/// storage is seen (weights' values cannot change what building does). Errors are fine; panics
/// are findings.
pub fn engine_once(w: &ModelWeights) {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{:?}", w.cfg).hash(&mut h);
    for l in &w.layers {
        for m in
            [&l.wq, &l.wo, &l.mlp_in, &l.mlp_out].into_iter().chain(l.kv_global.as_ref()).chain(l.kv_local.as_ref())
        {
            (m.rows, m.cols, m.quant.as_ref().map(|q| q.kind as u8), m.half.is_some()).hash(&mut h);
        }
    }
    (w.embed.quant.as_ref().map(|q| q.kind as u8), w.embed.half.is_some(), w.head.is_some()).hash(&mut h);
    if !first_time(h.finish()) {
        return;
    }
    let opts = EngineOptions { beyond_trained_context: true, ..EngineOptions::new(2, 8) };
    if let Ok(mut e) = Engine::new(gpu(), w, opts) {
        let v = w.cfg.vocab as u32;
        let _ = e.append(&[1 % v, 2 % v, 3 % v, 0], 2, &[2, 1], None);
    }
}

/// A tiny byte-level BPE tokenizer with a ChatML template, for targets that need one.
pub fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let meta =
            tokenizer_metadata(b"gpt2 smollm 0 1 2\nt <|im_start|>\nt <|im_end|>\nt h\nt i\nt hi\nm h i\ny 3\ny 3\n").0;
        let mut t = Tokenizer::from_gguf_metadata(&meta).expect("the fuzz tokenizer builds");
        t.chat_template = Some(CHATML.into());
        t
    })
}

/// SmolLM2's template without its default system prompt.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Tokenizer metadata from a line format that mutates well: line 1 is
/// `MODEL PRE ADD_BOS BOS EOS` (e.g. `gpt2 smollm 0 1 2`), then `t TOKEN`, `m MERGE`, `s SCORE`,
/// `y TYPE` lines (in order), and `x TEXT` lines, returned as texts to encode.
pub fn tokenizer_metadata(data: &[u8]) -> (BTreeMap<String, Value>, Vec<String>) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let head: Vec<&str> = lines.next().unwrap_or("").split(' ').collect();
    let mut meta = BTreeMap::new();
    let s = |v: &str| Value::Str(v.to_string());
    meta.insert("tokenizer.ggml.model".into(), s(head.first().copied().unwrap_or("gpt2")));
    if let Some(p) = head.get(1) {
        meta.insert("tokenizer.ggml.pre".into(), s(p));
    }
    if let Some(b) = head.get(2) {
        meta.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(*b == "1"));
    }
    for (i, key) in [(3, "tokenizer.ggml.bos_token_id"), (4, "tokenizer.ggml.eos_token_id")] {
        if let Some(id) = head.get(i).and_then(|v| v.parse::<u64>().ok()) {
            meta.insert(key.into(), Value::U(id));
        }
    }
    let (mut tokens, mut merges, mut scores, mut types, mut texts) = (vec![], vec![], vec![], vec![], vec![]);
    for l in lines {
        let Some((tag, rest)) = l.split_once(' ') else { continue };
        match tag {
            "t" => tokens.push(s(rest)),
            "m" => merges.push(s(rest)),
            "s" => scores.push(Value::F(rest.parse().unwrap_or(0.0))),
            "y" => types.push(Value::I(rest.parse().unwrap_or(1))),
            "x" => texts.push(rest.to_string()),
            _ => {}
        }
    }
    meta.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens));
    meta.insert("tokenizer.ggml.merges".into(), Value::Array(merges));
    if !scores.is_empty() {
        meta.insert("tokenizer.ggml.scores".into(), Value::Array(scores));
    }
    if !types.is_empty() {
        meta.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
    }
    (meta, texts)
}

/// A chat from fuzz bytes: the template, a line `---`, then one `ROLE: CONTENT` message per line;
/// the last line `!` asks for the generation prompt.
pub fn conversation(data: &[u8]) -> (String, Vec<Message>, bool) {
    let text = String::from_utf8_lossy(data);
    let (tpl, rest) = text.split_once("\n---\n").unwrap_or((&text, ""));
    let mut msgs = Vec::new();
    let mut gen = false;
    for l in rest.split('\n') {
        match l.split_once(": ") {
            Some((role, content)) => msgs.push(Message::new(role, content)),
            None => gen |= l == "!",
        }
    }
    (tpl.to_string(), msgs, gen)
}

/// A fixed conversation for rendering a model file's own template.
pub fn sample_messages() -> Vec<Message> {
    vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Hi!"),
        Message::new("assistant", "Hello."),
        Message::new("user", "2+2?"),
    ]
}
