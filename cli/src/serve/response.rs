//! OpenAI responses: the text side of a choice (incremental detokenization, stop strings matched
//! across token boundaries), tool calls split out of the text, and logprobs in the chat and
//! completion shapes.

use kvdecode::io::tokenizer::Tokenizer;
use kvdecode::Sampled;
use serde_json::{json, Map, Value};

use super::api::{Gen, CALL_CLOSE, CALL_OPEN};

/// Split a reply into its text and the tool calls it makes (`<tool_call>{"name", "arguments"}
/// </tool_call>` blocks); blocks that do not parse stay text.
pub fn split_tool_calls(text: &str, id_prefix: &str) -> (String, Vec<Value>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(a) = rest.find(CALL_OPEN) {
        let after = &rest[a + CALL_OPEN.len()..];
        let Some(b) = after.find(CALL_CLOSE) else { break };
        let body = after[..b].trim();
        match serde_json::from_str::<Value>(body) {
            Ok(v) if v.get("name").and_then(Value::as_str).is_some() => {
                content.push_str(&rest[..a]);
                let args = v.get("arguments").cloned().unwrap_or(json!({}));
                calls.push(json!({
                    "id": format!("{id_prefix}-call-{}", calls.len()),
                    "type": "function",
                    "function": {"name": v["name"], "arguments": args.to_string()},
                }));
            }
            _ => content.push_str(&rest[..a + CALL_OPEN.len() + b + CALL_CLOSE.len()]),
        }
        rest = &after[b + CALL_CLOSE.len()..];
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// The text of one choice as tokens arrive: decoded whole (a character may span tokens), cut at
/// the first stop string, and released only as far as no stop string could still begin.
#[derive(Default)]
pub struct ChoiceText {
    pub tokens: Vec<u32>,
    /// The weights versions its tokens were sampled under, in order, each once.
    pub versions: Vec<u64>,
    pub logprobs: Vec<Sampled>,
    pub text: String,
    /// Bytes of `text` already released.
    pub released: usize,
    pub finish: Option<&'static str>,
    /// The experts its tokens were routed to (`return_routed_experts`), flat.
    pub routes: Option<Vec<u32>>,
}

impl ChoiceText {
    /// Take a token; returns the text that can be released now. Sets `finish` when a stop token
    /// or a stop string ends the choice.
    pub fn push(&mut self, g: &Gen, tok: &Tokenizer, s: Sampled) -> String {
        if self.finish.is_some() {
            return String::new();
        }
        if g.stop_ids.contains(&s.token) {
            self.finish = Some("stop");
            return self.release_all();
        }
        self.tokens.push(s.token);
        self.logprobs.push(s);
        self.text = tok.decode(&self.tokens, !g.parses_tool_calls()).unwrap_or_default();
        if let Some(cut) = g.stop_strings.iter().filter_map(|s| self.text.find(s.as_str())).min() {
            self.text.truncate(cut);
            self.finish = Some("stop");
            return self.release_all();
        }
        // hold back a partial character and whatever could be the start of a stop string
        let mut safe = self.text.len();
        if self.text.ends_with('\u{fffd}') {
            safe -= '\u{fffd}'.len_utf8();
        }
        let held = g
            .stop_strings
            .iter()
            .filter_map(|s| (1..s.len()).rev().find(|&k| s.is_char_boundary(k) && self.text[..safe].ends_with(&s[..k])))
            .max()
            .unwrap_or(0);
        safe -= held;
        if safe > self.released {
            let out = self.text[self.released..safe].to_string();
            self.released = safe;
            out
        } else {
            String::new()
        }
    }

    /// The engine finished the choice: release the rest.
    pub fn done(&mut self, finish: kvdecode::Finish) -> String {
        if self.finish.is_none() {
            self.finish = Some(match finish {
                kvdecode::Finish::Length => "length",
                // ended by the server (an update with mode `abort`): a client that went away
                // or matched a stop string never sees this
                kvdecode::Finish::Cancelled => "abort",
                _ => "stop",
            });
        }
        self.release_all()
    }

    fn release_all(&mut self) -> String {
        let out = self.text.get(self.released..).unwrap_or("").to_string();
        self.released = self.text.len();
        out
    }
}

/// A token as OpenAI shows it in logprobs: its text and bytes.
pub fn token_entry(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let text = tok.decode(&[id], false).unwrap_or_default();
    json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
}

/// Chat logprobs (`{"content": [...]}`) for a run of tokens.
pub fn chat_logprobs(tok: &Tokenizer, entries: &[Sampled]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|s| {
            let mut e = token_entry(tok, s.token, s.logprob);
            e["top_logprobs"] = s.top.iter().map(|&(t, l)| token_entry(tok, t, l)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completion logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
pub fn completion_logprobs(tok: &Tokenizer, entries: &[Sampled], offset0: usize) -> Value {
    let mut offset = offset0;
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for s in entries {
        let text = tok.decode(&[s.token], false).unwrap_or_default();
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
        lps.push(s.logprob);
        let m: Map<String, Value> =
            s.top.iter().map(|&(t, l)| (tok.decode(&[t], false).unwrap_or_default(), json!(l))).collect();
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}
