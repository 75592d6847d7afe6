//! OpenAI responses: the text side of a choice (incremental detokenization, stop strings matched
//! across token boundaries), tool calls split out of the text, and logprobs in the chat and
//! completion shapes.

use kvdecode::io::tokenizer::{TextStream, Tokenizer};
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

/// The text of one choice as tokens arrive: decoded token by token ([`TextStream`]: a character
/// may span tokens), cut at the first stop string, and released only as far as no stop string
/// could still begin. A token costs the bytes it adds, not the text so far: stop strings are
/// matched by automata fed only the new bytes.
#[derive(Default)]
pub struct ChoiceText {
    /// Made at the first token (whether special tokens are text depends on the request).
    stream: Option<TextStream>,
    /// One per stop string.
    stops: Vec<StopMatcher>,
    /// A stop string cut the text: nothing more is added.
    cut: bool,
    pub tokens: Vec<u32>,
    /// The weights versions its tokens were sampled under, in order, each once.
    pub versions: Vec<u64>,
    /// The versions of the request's LoRA adapter its tokens were sampled under, likewise.
    pub adapter_versions: Vec<u64>,
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
            // the end-of-turn token the engine sampled is among the ids and logprobs (as vLLM
            // returns them: an RL client gets the whole sequence it trains on), not in the text
            self.tokens.push(s.token);
            self.logprobs.push(s);
            self.finish = Some("stop");
            return self.release_all(tok);
        }
        let token = s.token;
        self.tokens.push(token);
        self.logprobs.push(s);
        if self.stream.is_none() {
            self.stream = Some(TextStream::new(!g.parses_tool_calls()));
            self.stops = g.stop_strings.iter().map(|s| StopMatcher::new(s)).collect();
        }
        let piece = self.stream.as_mut().expect("made above").push(tok, token).unwrap_or_default();
        if self.append(&piece) {
            return self.release_all(tok);
        }
        // hold back whatever could be the start of a stop string (its automaton's state: the
        // longest prefix of it the text ends with; a prefix starts on a character boundary)
        let held = self.stops.iter().map(|m| m.state).max().unwrap_or(0);
        let safe = self.text.len() - held;
        if safe > self.released {
            let out = self.text[self.released..safe].to_string();
            self.released = safe;
            out
        } else {
            String::new()
        }
    }

    /// The engine finished the choice: release the rest.
    pub fn done(&mut self, tok: &Tokenizer, finish: kvdecode::Finish) -> String {
        if self.finish.is_none() {
            self.finish = Some(match finish {
                kvdecode::Finish::Length => "length",
                // ended by the server (an update with mode `abort`): a client that went away
                // or matched a stop string never sees this
                kvdecode::Finish::Cancelled => "abort",
                _ => "stop",
            });
        }
        self.release_all(tok)
    }

    /// Add decoded text, feeding the stop automata; true if a stop string ended the choice (the
    /// text is cut where the earliest one begins).
    fn append(&mut self, piece: &str) -> bool {
        let before = self.text.len();
        self.text.push_str(piece);
        let cut = self
            .stops
            .iter_mut()
            .filter_map(|m| m.feed(piece.as_bytes()).map(|end| before + end - m.pattern_len()))
            .min();
        if let Some(cut) = cut {
            self.text.truncate(cut);
            self.finish = Some("stop");
            self.cut = true;
        }
        cut.is_some()
    }

    fn release_all(&mut self, tok: &Tokenizer) -> String {
        // what the detokenizer still holds (an unfinished character) ends the text, unless a
        // stop string ended it first
        if !self.cut {
            if let Some(rest) = self.stream.as_mut().and_then(|s| s.finish(tok).ok()) {
                self.append(&rest);
            }
        }
        let out = self.text.get(self.released..).unwrap_or("").to_string();
        self.released = self.text.len();
        out
    }
}

/// A stop string as a Knuth-Morris-Pratt automaton over bytes: fed the text as it grows, it
/// finds the string in time linear in the bytes fed, and its state says how much of the string
/// the text ends with.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    pattern: Vec<u8>,
    /// `fail[i]`: the longest proper prefix of `pattern[..=i]` that is also its suffix.
    fail: Vec<usize>,
    /// Bytes of `pattern` the text fed so far ends with.
    pub state: usize,
}

impl StopMatcher {
    pub fn new(s: &str) -> Self {
        let p = s.as_bytes().to_vec();
        let mut fail = vec![0; p.len()];
        let mut k = 0;
        for i in 1..p.len() {
            while k > 0 && p[i] != p[k] {
                k = fail[k - 1];
            }
            if p[i] == p[k] {
                k += 1;
            }
            fail[i] = k;
        }
        StopMatcher { pattern: p, fail, state: 0 }
    }

    /// The string's length in bytes.
    pub fn pattern_len(&self) -> usize {
        self.pattern.len()
    }

    /// Feed bytes; the offset just past the first complete match within them, if any.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        if self.pattern.is_empty() {
            return None;
        }
        for (i, &b) in bytes.iter().enumerate() {
            while self.state > 0 && self.pattern[self.state] != b {
                self.state = self.fail[self.state - 1];
            }
            if self.pattern[self.state] == b {
                self.state += 1;
            }
            if self.state == self.pattern.len() {
                return Some(i + 1);
            }
        }
        None
    }
}

/// A token as OpenAI shows it in logprobs: its text and bytes.
pub fn token_entry(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let text = tok.decode(&[id], false).unwrap_or_default();
    json!({"token": text, "logprob": wire_logprob(logprob), "bytes": text.as_bytes()})
}

/// A logprob as JSON can carry it: `-inf` (a token `processed` logprobs did not keep) is
/// -9999.0, as vLLM writes it (JSON has no infinity, and clients expect a number).
fn wire_logprob(l: f32) -> f32 {
    if l == f32::NEG_INFINITY {
        -9999.0
    } else {
        l
    }
}

/// One token's chat logprob entry: its text, logprob, bytes, alternatives and `kept`.
fn logprob_entry(tok: &Tokenizer, s: &Sampled) -> Value {
    let mut e = token_entry(tok, s.token, s.logprob);
    e["top_logprobs"] = s.top.iter().map(|&(t, l)| token_entry(tok, t, l)).collect();
    // how many tokens the draw was among (the support of `processed` logprobs)
    e["kept"] = json!(s.kept);
    e
}

/// Chat logprobs (`{"content": [...]}`) for a run of tokens.
pub fn chat_logprobs(tok: &Tokenizer, entries: &[Sampled]) -> Value {
    json!({ "content": entries.iter().map(|s| logprob_entry(tok, s)).collect::<Vec<_>>() })
}

/// `prompt_logprobs`: `null` for the prompt's first token, then each token's chat logprob entry
/// with its `token_id`.
pub fn prompt_logprobs(tok: &Tokenizer, scored: &[Sampled]) -> Value {
    let entries = scored.iter().map(|s| {
        let mut e = logprob_entry(tok, s);
        e["token_id"] = json!(s.token);
        e
    });
    Value::Array(std::iter::once(Value::Null).chain(entries).collect())
}

/// Completion logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
pub fn completion_logprobs(tok: &Tokenizer, entries: &[Sampled], offset0: usize) -> Value {
    let mut offset = offset0;
    let (mut tokens, mut lps, mut tops, mut offsets, mut kept) = (vec![], vec![], vec![], vec![], vec![]);
    for s in entries {
        let text = tok.decode(&[s.token], false).unwrap_or_default();
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
        lps.push(wire_logprob(s.logprob));
        kept.push(s.kept);
        let m: Map<String, Value> =
            s.top.iter().map(|&(t, l)| (tok.decode(&[t], false).unwrap_or_default(), json!(wire_logprob(l)))).collect();
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets, "kept": kept})
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    /// The automaton finds what `str::find` finds, fed in any split, and its state is the longest
    /// prefix of the pattern the text ends with.
    #[test]
    fn stop_matcher_agrees_with_find() {
        for (pattern, text) in
            [("aab", "aaaab"), ("abab", "abaabab"), ("x", "yyx"), ("日本", "中日日本"), ("aaa", "aa")]
        {
            for split in 0..=text.len() {
                let mut m = StopMatcher::new(pattern);
                let (a, b) = text.as_bytes().split_at(split);
                let got = m.feed(a).or_else(|| m.feed(b).map(|e| e + split));
                assert_eq!(
                    got,
                    text.find(pattern).map(|i| i + pattern.len()),
                    "{pattern:?} in {text:?} split at {split}"
                );
            }
        }
        let mut m = StopMatcher::new("hello");
        m.feed(b"oh hel");
        assert_eq!(m.state, 3);
    }
}
