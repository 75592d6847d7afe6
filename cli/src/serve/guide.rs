//! Constrained decoding with llguidance: a JSON schema (or "any JSON object") becomes a
//! [`TokenConstraint`] whose masks the GPU sampler applies to the request's rows only.

use std::sync::{Arc, Mutex};

use kvdecode::io::tokenizer::Tokenizer;
use kvdecode::{ConstraintFactory, Error, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

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

    /// A constraint for output that matches `schema`, ended by one of `stop` (the request's end
    /// tokens) once the JSON is complete; an invalid or unsupported schema is an error with
    /// llguidance's reason.
    pub fn json_schema(&self, mut schema: Value, stop: Vec<u32>) -> Result<ConstraintFactory, String> {
        compact(&mut schema);
        self.grammar(TopLevelGrammar::from_json_schema(schema), stop)
    }

    /// A constraint for output that matches a Lark grammar (llguidance's dialect: `%json {...}`
    /// embeds a JSON schema, `<name>` is a special token), ended by one of `stop`.
    pub fn lark(&self, grammar: &str, stop: Vec<u32>) -> Result<ConstraintFactory, String> {
        self.grammar(TopLevelGrammar::from_lark(grammar.to_string()), stop)
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
