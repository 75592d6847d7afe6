//! Constrained decoding with llguidance: a JSON schema (or "any JSON object") becomes a
//! [`TokenConstraint`] whose masks the GPU sampler applies to the request's rows only.

use std::sync::{Arc, Mutex};

use kvdecode::io::tokenizer::Tokenizer;
use kvdecode::{ConstraintFactory, Error, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::api::ApiError;

/// What a request asks its output to match, before llguidance compiles it.
pub enum Wanted {
    /// A JSON schema (written compactly unless its `x-guidance` says otherwise).
    Schema(Value),
    /// A Lark grammar in llguidance's dialect.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

/// `response_format`: `None` for plain text.
pub fn response_format(fmt: Value) -> Result<Option<Wanted>, ApiError> {
    let p = "response_format";
    match fmt.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Wanted::Schema(json!({"type": "object"})))),
        Some("json_schema") => {
            let js = fmt.get("json_schema").ok_or_else(|| ApiError::bad(p, "`json_schema` is missing"))?;
            match js.get("schema") {
                Some(s) if s.is_object() => Ok(Some(Wanted::Schema(s.clone()))),
                Some(s) if s.as_bool() == Some(true) => Ok(Some(Wanted::Schema(json!({})))),
                _ => Err(ApiError::bad(p, "`json_schema.schema` must be a JSON schema object")),
            }
        }
        _ => Err(ApiError::bad(
            p,
            format!("`response_format` {fmt} is not supported (text, json_object or json_schema)"),
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema), `grammar` (Lark), `regex` and
/// `choice` (strings, one of which is the output).
pub fn structured_outputs(v: Value) -> Result<Wanted, ApiError> {
    let p = "structured_outputs";
    let Value::Object(o) = v else {
        return Err(ApiError::bad(p, format!("`{p}` must be an object, got {v}")));
    };
    let mut given = o.into_iter().filter(|(_, v)| !v.is_null());
    let (Some((key, v)), None) = (given.next(), given.next()) else {
        return Err(ApiError::bad(p, format!("`{p}` takes exactly one of json, grammar, regex, choice")));
    };
    match (key.as_str(), v) {
        ("json", s @ Value::Object(_)) => Ok(Wanted::Schema(s)),
        ("json", Value::String(s)) => serde_json::from_str::<Value>(&s)
            .ok()
            .filter(Value::is_object)
            .map(Wanted::Schema)
            .ok_or_else(|| ApiError::bad(p, "`structured_outputs.json` must be a JSON schema object")),
        ("grammar", Value::String(g)) => Ok(Wanted::Lark(g)),
        ("regex", Value::String(r)) => Ok(Wanted::Regex(r)),
        ("choice", Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
            // each choice a JSON string literal, which Lark reads as the same string
            let alts: Vec<String> = a.iter().map(Value::to_string).collect();
            Ok(Wanted::Lark(format!("start: {}\n", alts.join(" | "))))
        }
        (k @ ("json" | "grammar" | "regex" | "choice"), v) => {
            Err(ApiError::bad(p, format!("`{p}.{k}` has the wrong type: {v}")))
        }
        (k, _) => Err(ApiError::bad(p, format!("`{p}.{k}` is not supported (json, grammar, regex, choice)"))),
    }
}

/// The model's vocabulary as llguidance sees it, built once at start.
pub struct Guide {
    factory: Arc<ParserFactory>,
}

impl Guide {
    /// llguidance's view of `tok` for a model of `vocab` tokens.
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<Self, String> {
        let json = tok.to_json().map_err(|e| e.to_string())?;
        let bt = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(json.as_bytes()).map_err(|e| e.to_string())?;
        let env = bt.into_tok_env(Some(vocab)).map_err(|e| e.to_string())?;
        let factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        Ok(Guide { factory: Arc::new(factory) })
    }

    /// A constraint for output that matches `wanted`, ended by one of `stop` (the request's end
    /// tokens) once it is complete; an invalid or unsupported one is an error with llguidance's
    /// reason. In a Lark grammar (llguidance's dialect) `%json {...}` embeds a JSON schema and
    /// `<name>` is a special token.
    pub fn compile(&self, wanted: Wanted, stop: Vec<u32>) -> Result<ConstraintFactory, String> {
        let grammar = match wanted {
            Wanted::Schema(mut schema) => {
                compact(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            Wanted::Lark(g) => TopLevelGrammar::from_lark(g),
            Wanted::Regex(r) => TopLevelGrammar::from_regex(&r),
        };
        self.grammar(grammar, stop)
    }

    fn grammar(&self, grammar: TopLevelGrammar, stop: Vec<u32>) -> Result<ConstraintFactory, String> {
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let proto = Matcher::new(Ok(parser));
        if let Some(e) = proto.get_error() {
            return Err(e);
        }
        let proto = Mutex::new(proto);
        let stop = Arc::new(stop);
        Ok(ConstraintFactory(Arc::new(move || {
            let m = proto.lock().unwrap_or_else(|e| e.into_inner()).deep_clone();
            Box::new(Llg { m, stop: stop.clone() }) as Box<dyn TokenConstraint>
        })))
    }
}

/// JSON written compactly (`, ` and `: `, no free whitespace a model could pad forever), unless
/// the schema says otherwise.
fn compact(schema: &mut Value) {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
}

struct Llg {
    m: Matcher,
    /// The request's own end tokens: allowed once the JSON can end (llguidance's idea of EOS
    /// is replaced by them).
    stop: Arc<Vec<u32>>,
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::Input(format!("constrained decoding: {e}"))
}

impl TokenConstraint for Llg {
    fn allowed(&mut self, mask: &mut [u32]) -> kvdecode::Result<()> {
        let end = self.m.is_stopped() || self.m.is_accepting().map_err(err)?;
        if !self.m.is_stopped() {
            let v = self.m.compute_mask().map_err(err)?;
            for (m, w) in mask.iter_mut().zip(v.as_slice()) {
                *m = *w;
            }
            for &t in self.m.tok_env().map_err(err)?.tok_trie().eos_tokens() {
                if let Some(w) = mask.get_mut(t as usize / 32) {
                    *w &= !(1 << (t % 32));
                }
            }
        }
        if end {
            for &t in self.stop.iter() {
                if let Some(w) = mask.get_mut(t as usize / 32) {
                    *w |= 1 << (t % 32);
                }
            }
        }
        Ok(())
    }

    fn consume(&mut self, token: u32) -> kvdecode::Result<()> {
        if self.stop.contains(&token) {
            return Ok(()); // the request ends on it
        }
        self.m.consume_token(token).map_err(err)
    }
}
