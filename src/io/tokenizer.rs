//! Tokenizers from a GGUF file's metadata (gpt2-style byte-level BPE with its pre-tokenizer) or
//! from a Hugging Face `tokenizer.json`, both run by the `tokenizers` crate; and chat templates
//! (Jinja, from `tokenizer.chat_template`) rendered by `minijinja`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value as Json};

use crate::error::{file_err, Error, Result};
use crate::io::gguf::{GgufFile, Value};

/// A tokenizer with the model's special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Whether the model wants BOS in front of a prompt.
    pub add_bos: bool,
    /// The Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
}

/// One chat message.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (an assistant message that only calls tools may leave it out).
    #[serde(default)]
    pub content: String,
    /// An assistant's tool calls (OpenAI's shape: `[{"id", "type": "function", "function":
    /// {"name", "arguments"}}]`), as templates that take tools read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Json>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message.
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None }
    }
}

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k's pre-tokenizer (gpt-oss's `tokenizer.json`; llama.cpp's `gpt-4o`, whose own regex
/// approximates this one without Unicode case classes): a word splits where lower case turns to
/// upper, digits go in threes.
const O200K_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Tokenizer {
    /// The tokenizer stored in a GGUF file (`tokenizer.ggml.*`): `gpt2` (byte-level BPE with
    /// merges) or `llama` (SentencePiece-style BPE with scores and byte fallback).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        Self::from_gguf_metadata(&g.metadata)
    }

    /// [`Tokenizer::from_gguf`], or `None` for a file whose tokenizer model is `none` (llama.cpp's
    /// mark of a model that carries no vocabulary; its ids are used as they are).
    pub fn from_gguf_if_any(g: &GgufFile) -> Result<Option<Self>> {
        match g.metadata.get("tokenizer.ggml.model").and_then(Value::as_str) {
            Some("none") => Ok(None),
            _ => Self::from_gguf(g).map(Some),
        }
    }

    /// [`Tokenizer::from_gguf`] from the metadata alone (`tokenizer.ggml.*`,
    /// `tokenizer.chat_template`): untrusted input, every missing or malformed key is an error.
    pub fn from_gguf_metadata(g: &BTreeMap<String, Value>) -> Result<Self> {
        let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
        match model {
            "gpt2" => {}
            "llama" => return Self::from_gguf_spm(g),
            other => {
                return Err(Error::Config(format!(
                    "GGUF tokenizer model {other:?} is not supported (supported: gpt2, llama)"
                )))
            }
        }
        let arr = |k: &str| -> Result<&[Value]> {
            g.get(k).and_then(Value::as_array).ok_or_else(|| Error::Config(format!("GGUF metadata `{k}` is missing")))
        };
        let tokens: Vec<&str> = arr("tokenizer.ggml.tokens")?.iter().map(|v| v.as_str().unwrap_or("")).collect();
        let merges: Vec<&str> = arr("tokenizer.ggml.merges")?.iter().map(|v| v.as_str().unwrap_or("")).collect();
        let types: Vec<u64> = g
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
        let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
        let split =
            |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
        let pre_tokenizer = match pre {
            // llama.cpp's GPT-2 regex for all of these
            "default" | "gpt2" | "gpt-2" | "phi-2" | "olmo" | "mpt" => byte_level(true),
            "smollm" => {
                json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]})
            }
            "llama-bpe" | "llama3" => {
                json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]})
            }
            "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}),
            "gpt-4o" => json!({"type": "Sequence", "pretokenizers": [split(O200K_REGEX), byte_level(false)]}),
            other => {
                return Err(Error::Config(format!(
                    "GGUF pre-tokenizer {other:?} is not supported (supported: default, gpt2, gpt-2, phi-2, olmo, mpt, smollm, llama-bpe, qwen2, gpt-4o)"
                )))
            }
        };
        let vocab: serde_json::Map<String, Json> =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
        let added = added_tokens(&tokens, &types);
        // Llama 3's tokenizer takes a pre-token that is itself in the vocabulary whole, without
        // merging (its tokenizer.json's `ignore_merges`, llama.cpp's too): " Việt" is one token
        // there though the merges would split it
        let ignore_merges = matches!(pre, "llama-bpe" | "llama3");
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
            "pre_tokenizer": pre_tokenizer, "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges}
        });
        Self::from_gguf_spec(g, spec, false)
    }

    /// A SentencePiece-style (`llama`) GGUF vocabulary as Hugging Face models it: BPE whose merges
    /// are derived from the piece scores (as transformers' SentencePiece converter does), byte
    /// fallback to `<0xNN>` pieces, spaces as `▁` with a prefix space when the model asks for it.
    fn from_gguf_spm(g: &BTreeMap<String, Value>) -> Result<Self> {
        let arr = |k: &str| -> Result<&[Value]> {
            g.get(k).and_then(Value::as_array).ok_or_else(|| Error::Config(format!("GGUF metadata `{k}` is missing")))
        };
        let tokens: Vec<&str> = arr("tokenizer.ggml.tokens")?.iter().map(|v| v.as_str().unwrap_or("")).collect();
        let scores: Vec<f64> = match g.get("tokenizer.ggml.scores").and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
            None => (0..tokens.len()).map(|i| -(i as f64)).collect(),
        };
        let types: Vec<u64> = g
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_else(|| vec![1; tokens.len()]);
        let index: std::collections::HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
        // merges: every split of a normal piece into two pieces of the vocabulary, ranked by the
        // merged piece's score (higher first), then by the parts' ids
        let mut merges: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
        for (i, piece) in tokens.iter().enumerate() {
            if types.get(i).copied().unwrap_or(1) != 1 {
                continue;
            }
            for (at, _) in piece.char_indices().skip(1) {
                let (l, r) = piece.split_at(at);
                if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                    merges.push((scores.get(i).copied().unwrap_or(0.0), li, ri, l, r));
                }
            }
        }
        merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let merges: Vec<String> = merges.iter().map(|m| format!("{} {}", m.3, m.4)).collect();
        let vocab: serde_json::Map<String, Json> =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
        let added = added_tokens(&tokens, &types);
        let unk = types.iter().position(|&t| t == 2).and_then(|i| tokens.get(i)).map(|s| s.to_string());
        let prefix = !matches!(g.get("tokenizer.ggml.add_space_prefix"), Some(Value::Bool(false)));
        let mut normalizers = Vec::new();
        if prefix {
            normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
        }
        normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if prefix {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        });
        Self::from_gguf_spec(g, spec, true)
    }

    /// Build from a `tokenizer.json`-shaped spec, with BOS/EOS and the chat template from the
    /// GGUF metadata (`add_bos_default` when the file does not say).
    fn from_gguf_spec(g: &BTreeMap<String, Value>, spec: Json, add_bos_default: bool) -> Result<Self> {
        let inner = spec
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| Error::Config(format!("GGUF tokenizer: {e}")))?;
        let id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: match g.get("tokenizer.ggml.add_bos_token") {
                Some(Value::Bool(b)) => *b,
                _ => add_bos_default,
            },
            chat_template: g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string),
        })
    }

    /// A Hugging Face `tokenizer.json` (with `tokenizer_config.json` beside it, if present, for the
    /// chat template and BOS/EOS).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| file_err(path, e))?;
        let mut t = Tokenizer { inner, bos: None, eos: None, add_bos: false, chat_template: None };
        let cfg_path = path.with_file_name("tokenizer_config.json");
        if let Ok(text) = std::fs::read_to_string(&cfg_path) {
            let cfg: Json = serde_json::from_str(&text).map_err(|e| file_err(&cfg_path, e))?;
            let tok = |k: &str| {
                let v = cfg.get(k)?;
                let s = v.as_str().or_else(|| v.get("content").and_then(Json::as_str))?;
                t.inner.token_to_id(s)
            };
            t.bos = tok("bos_token");
            t.eos = tok("eos_token");
            t.add_bos = cfg.get("add_bos_token").and_then(Json::as_bool).unwrap_or(false);
            t.chat_template = cfg.get("chat_template").and_then(Json::as_str).map(str::to_string);
        }
        Ok(t)
    }

    /// Token ids of `text`. Special tokens written in the text are parsed as special. BOS is
    /// prepended only if the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Input(format!("tokenize: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of a rendered chat template: [`Tokenizer::encode`], except that BOS is not added
    /// a second time when the template already wrote it (Llama 3's does).
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        let bos_text = self.bos.and_then(|b| self.inner.id_to_token(b));
        if self.add_bos && bos_text.is_some_and(|b| text.starts_with(&b)) {
            let enc = self.inner.encode(text, false).map_err(|e| Error::Input(format!("tokenize: {e}")))?;
            return Ok(enc.get_ids().to_vec());
        }
        self.encode(text)
    }

    /// Text of `ids` (special tokens included unless `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Input(format!("detokenize: {e}")))
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` document (for libraries that take one,
    /// such as llguidance's tokenizer bridge).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(|e| Error::Input(format!("tokenizer to JSON: {e}")))
    }

    /// The id of a token string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Tokens that end an assistant turn: EOS and the usual end-of-turn markers this vocabulary has
    /// (ChatML's, Llama 3's turn and tool-call ends, Gemma's, Phi-3's `<|end|>`, whose files name
    /// `<|endoftext|>` as EOS).
    pub fn end_of_turn(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eos.into_iter().collect();
        for t in ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>"] {
            if let Some(id) = self.token_id(t) {
                if !v.contains(&id) {
                    v.push(id);
                }
            }
        }
        v
    }

    /// Render the model's chat template for `messages`, ending with the assistant's turn prompt
    /// when `add_generation_prompt`.
    ///
    /// The template comes from the model file, so it is untrusted code: rendering runs under
    /// [`TEMPLATE_LIMITS`] (source size, fuel, recursion depth, output size), and a template that
    /// exceeds one is an error naming the limit.
    pub fn apply_chat_template(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with the function tools the model may call (OpenAI's
    /// `tools` list, passed to the template as `tools`).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tpl =
            self.chat_template.as_deref().ok_or_else(|| Error::Config("the model has no chat template".into()))?;
        let tok = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i)).unwrap_or_default();
        render_chat_template_with_tools(tpl, messages, tools, add_generation_prompt, &tok(self.bos), &tok(self.eos))
    }

    /// Whether the model's chat template takes a list of tools (it reads a `tools` variable).
    pub fn template_takes_tools(&self) -> bool {
        self.chat_template.as_deref().is_some_and(|t| t.contains("tools"))
    }
}

/// Render a chat template (Jinja, untrusted: it comes from a model file) under
/// [`TEMPLATE_LIMITS`] with the variables chat templates expect (`messages`,
/// `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception`).
pub fn render_chat_template(
    tpl: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    render_chat_template_with_tools(tpl, messages, None, add_generation_prompt, bos_token, eos_token)
}

/// [`render_chat_template`] with the tools the model may call (`tools` in the template).
pub fn render_chat_template_with_tools(
    tpl: &str,
    messages: &[Message],
    tools: Option<&Json>,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let lim = TEMPLATE_LIMITS;
    if tpl.len() > lim.source_bytes {
        return Err(Error::Config(format!(
            "chat template: {} bytes is more than the {} accepted",
            tpl.len(),
            lim.source_bytes
        )));
    }
    let mut env = minijinja::Environment::new();
    // as transformers' apply_chat_template (and llama.cpp) render: a block tag takes the newline
    // after it and the spaces before it
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(lim.fuel));
    env.set_recursion_limit(lim.recursion);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_filter("tojson", py_tojson);
    env.add_template("chat", tpl).map_err(|e| Error::Config(format!("chat template: {e}")))?;
    let mut out = BoundedWriter { buf: Vec::new(), max: lim.output_bytes };
    let rendered = env.get_template("chat").and_then(|t| {
        t.render_captured_to(
            minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            },
            &mut out,
        )
        .map(|_| ())
    });
    match rendered {
        Ok(_) => {
            String::from_utf8(out.buf).map_err(|e| Error::Config(format!("chat template: output is not UTF-8: {e}")))
        }
        Err(e) => Err(Error::Config(match e.kind() {
            minijinja::ErrorKind::OutOfFuel => {
                format!("chat template ran out of fuel (more than {} instructions): {e}", lim.fuel)
            }
            minijinja::ErrorKind::WriteFailure => {
                format!("chat template output is larger than {} bytes", lim.output_bytes)
            }
            _ => format!("chat template: {e}"),
        })),
    }
}

/// `tojson` as transformers renders chat templates: Python's `json.dumps(x, ensure_ascii=False)`
/// (keys in their order, `", "` and `": "` between items, `","` at line ends with `indent`,
/// nothing HTML-escaped), with the keyword arguments `indent`, `separators`, `sort_keys` and
/// `ensure_ascii`. minijinja's own filter writes compact JSON with sorted keys and escapes `<`,
/// `>`, `&` and `'`, which changes the tool list Qwen2.5 and Llama 3 were trained to read.
fn py_tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let bad = |m: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, m);
    // (an indent is written once per nesting level of each line: bound it, as the output is)
    let indent: Option<usize> = kwargs.get("indent")?;
    if indent.is_some_and(|i| i > 64) {
        return Err(bad(format!("tojson: indent {} is more than 64", indent.unwrap_or(0))));
    }
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(other) => return Err(bad(format!("tojson: separators needs two strings, got {}", other.len()))),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let json = serde_json::to_value(value).map_err(|e| bad(format!("tojson: {e}")))?;
    let mut out = String::new();
    let style = PyJson {
        indent: indent.map(|n| " ".repeat(n)),
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ascii: ensure_ascii.unwrap_or(false),
        max: TEMPLATE_LIMITS.output_bytes,
    };
    style.write(&json, 0, &mut out).map_err(bad)?;
    Ok(out)
}

/// How [`py_tojson`] lays out JSON.
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ascii: bool,
    max: usize,
}

impl PyJson {
    fn write(&self, v: &Json, level: usize, out: &mut String) -> std::result::Result<(), String> {
        if out.len() > self.max {
            return Err(format!("tojson: output is larger than {} bytes", self.max));
        }
        let newline = |out: &mut String, level: usize| {
            if let Some(ind) = &self.indent {
                out.push('\n');
                (0..level).for_each(|_| out.push_str(ind));
            }
        };
        match v {
            Json::String(s) => self.string(s, out),
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    newline(out, level + 1);
                    self.write(x, level + 1, out)?;
                }
                newline(out, level);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    newline(out, level + 1);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, level + 1, out)?;
                }
                newline(out, level);
                out.push('}');
            }
            // null, booleans, numbers, [] and {}: as serde_json writes them
            other => out.push_str(&other.to_string()),
        }
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = Json::String(s.to_string()).to_string();
        if !self.ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

/// Limits on rendering a chat template (untrusted code from a model file).
#[derive(Clone, Copy, Debug)]
pub struct TemplateLimits {
    /// Largest template source accepted.
    pub source_bytes: usize,
    /// Instructions the template may run (minijinja's fuel).
    pub fuel: u64,
    /// Nesting depth of loops, conditions, macros and includes.
    pub recursion: usize,
    /// Largest rendered prompt.
    pub output_bytes: usize,
}

/// The limits every chat template renders under. Real templates (ChatML, Llama 3, Qwen3 with
/// tools, Gemma) are a few KiB, run a few hundred instructions per message and nest a few levels.
/// These limits bound the time and output a template can take; minijinja also caps a repeated
/// string (100 MB) and a `range` (100k items), but not string concatenation, so a hostile
/// template can still build large intermediate strings within its fuel.
pub const TEMPLATE_LIMITS: TemplateLimits =
    TemplateLimits { source_bytes: 256 << 10, fuel: 2_000_000, recursion: 64, output_bytes: 8 << 20 };

/// Collects rendered output up to `max` bytes, then fails the write (and so the render).
struct BoundedWriter {
    buf: Vec<u8>,
    max: usize,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.max {
            return Err(std::io::Error::other("chat template output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Control (type 3) and user-defined (type 4) tokens, matched whole in text, as added tokens.
fn added_tokens(tokens: &[&str], types: &[u64]) -> Vec<Json> {
    types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == 3 || t == 4)
        .map(|(i, &t)| {
            json!({"id": i, "content": tokens.get(i).copied().unwrap_or(""), "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t == 3})
        })
        .collect()
}

/// Text of a growing sequence of token ids, released as soon as it is final: the one incremental
/// detokenizer of every stream (the server's events, `kvdecode chat`).
///
/// A token is decoded with the few tokens before it as context, never the whole sequence, so a
/// token costs the text it adds: a SentencePiece decoder drops the first piece's leading space,
/// and byte-fallback tokens (`<0xF0>`, ...) make a character only together. Text that ends in an
/// unfinished character (a U+FFFD per byte so far) is held until the character's last byte
/// arrives, or until [`TextStream::finish`]; so released text never splits a character. For valid
/// text what a stream releases in all is the whole sequence's decoded text; bytes that never make
/// a character come out as U+FFFDs, without taking back the valid characters released before
/// them (a whole-sequence byte-fallback decode turns a whole run of byte tokens into U+FFFDs when
/// any of it is invalid, those characters too).
#[derive(Clone, Debug)]
pub struct TextStream {
    skip_special: bool,
    /// The context tokens, then the held ones (released tokens before the context are dropped).
    ids: Vec<u32>,
    /// `ids[..read]` was released; its text is the context of what comes next.
    read: usize,
}

/// Tokens a held run may grow to before it is released as it stands: a character is at most 4
/// byte tokens, so a longer run of U+FFFD-ending text is invalid bytes, not a character to wait
/// for (the bound keeps a token's cost small).
const TEXT_STREAM_MAX_HELD: usize = 8;

impl TextStream {
    /// A stream that decodes special tokens as text unless `skip_special`.
    pub fn new(skip_special: bool) -> Self {
        TextStream { skip_special, ids: Vec::new(), read: 0 }
    }

    /// Take one token; returns the text that is final now (empty while a character is unfinished).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.release(tok, false)
    }

    /// The end of the sequence: everything still held (an unfinished character as U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        self.release(tok, true)
    }

    fn release(&mut self, tok: &Tokenizer, all: bool) -> Result<String> {
        let context = tok.decode(&self.ids[..self.read], self.skip_special)?;
        let text = tok.decode(&self.ids, self.skip_special)?;
        let held = self.ids.len() - self.read;
        if !all && text.ends_with('\u{fffd}') && held < TEXT_STREAM_MAX_HELD {
            return Ok(String::new());
        }
        // the context's text is a prefix of the longer text for every decoder kvdecode reads; were
        // it not, the text past the context's length, from a character boundary only
        let new = text.strip_prefix(context.as_str()).or_else(|| text.get(context.len()..)).unwrap_or("").to_string();
        // the tokens just released become the next context: they start where the last release
        // ended, on a character's first byte (a byte-fallback decoder turns a run of byte tokens
        // that starts inside a character into U+FFFDs, the whole run)
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(new)
    }
}
