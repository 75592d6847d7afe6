//! kvdecode in the browser: a decoding session the page drives from JavaScript. Everything is
//! async (the browser cannot block); models come from bytes (the embedded demo, or a GGUF file
//! picked from disk), never from paths.

use std::cell::RefCell;
use std::rc::Rc;

use js_sys::Promise;
use kvdecode::gguf::GgufFile;
use kvdecode::tokenizer::{Message, Tokenizer};
use kvdecode::{Engine, EngineOptions, Gpu, GpuOptions, KvDtype, ModelWeights, Sampler, WeightDtype};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

struct Inner {
    engine: Engine,
    tok: Option<Tokenizer>,
    adapter: String,
    sampler: Sampler,
}

/// One model on the GPU with a one-row cache.
#[wasm_bindgen]
pub struct Session {
    /// Taken out while a step is in flight, so no borrow is held across an await.
    inner: Rc<RefCell<Option<Inner>>>,
}

fn js(e: kvdecode::Error) -> JsValue {
    JsValue::from_str(&e.to_string())
}

async fn open(weights: ModelWeights, tok: Option<Tokenizer>, max_len: usize) -> Result<Session, JsValue> {
    let gpu = Gpu::new_async(&GpuOptions::default()).await.map_err(js)?;
    let opts = EngineOptions { kv: KvDtype::F16, weights: WeightDtype::F16, ..EngineOptions::new(1, max_len) };
    let engine = Engine::new_async(&gpu, &weights, opts).await.map_err(js)?;
    let adapter = gpu.describe();
    Ok(Session { inner: Rc::new(RefCell::new(Some(Inner { engine, tok, adapter, sampler: Sampler::GREEDY }))) })
}

/// Run `f` on the session's state; the state is put back whatever `f` returns.
async fn with<F, Fut>(cell: Rc<RefCell<Option<Inner>>>, f: F) -> Result<JsValue, JsValue>
where
    F: FnOnce(Inner) -> Fut,
    Fut: std::future::Future<Output = (Inner, Result<JsValue, JsValue>)>,
{
    let taken = cell.borrow_mut().take().ok_or("the session is busy with another step")?;
    let (inner, out) = f(taken).await;
    *cell.borrow_mut() = Some(inner);
    out
}

impl Session {
    fn get<T>(&self, f: impl FnOnce(&Inner) -> T) -> Result<T, JsValue> {
        self.inner.borrow().as_ref().map(f).ok_or_else(|| "the session is busy with another step".into())
    }
}

#[wasm_bindgen]
impl Session {
    /// The embedded demo model (no download).
    pub async fn demo(max_len: usize) -> Result<Session, JsValue> {
        open(ModelWeights::demo(), None, max_len).await
    }

    /// A GGUF file's bytes (its tokenizer and chat template come with it).
    pub async fn gguf(bytes: Vec<u8>, max_len: usize) -> Result<Session, JsValue> {
        let g = GgufFile::parse(bytes).map_err(js)?;
        let w = g.weights().map_err(js)?;
        let tok = Tokenizer::from_gguf(&g).map_err(js)?;
        open(w, Some(tok), max_len).await
    }

    /// The adapter the session runs on.
    pub fn adapter(&self) -> Result<String, JsValue> {
        self.get(|s| s.adapter.clone())
    }

    /// Destroy the session's GPU device, as a driver reset or a browser reclaiming the GPU of a
    /// background tab would: every later step is an error that says "device lost", and the page
    /// has to build a new session. The page's `?lose=N` uses it to test that recovery.
    pub fn lose_device(&self) -> Result<(), JsValue> {
        self.get(|s| s.engine.gpu().device.destroy())
    }

    /// Whether the model has a tokenizer.
    pub fn has_tokenizer(&self) -> Result<bool, JsValue> {
        self.get(|s| s.tok.is_some())
    }

    /// Token ids of a user message in the model's chat template (or the plain text).
    pub fn chat_prompt(&self, user: &str) -> Result<Vec<u32>, JsValue> {
        self.get(|s| {
            let tok = s.tok.as_ref().ok_or(JsValue::from_str("this model has no tokenizer"))?;
            let text =
                tok.apply_chat_template(&[Message::new("user", user)], true).unwrap_or_else(|_| user.to_string());
            tok.encode(&text).map_err(js)
        })?
    }

    /// Text of token ids (special tokens skipped), or the ids when there is no tokenizer.
    pub fn decode(&self, ids: Vec<u32>) -> Result<String, JsValue> {
        self.get(|s| match &s.tok {
            Some(t) => t.decode(&ids, true).unwrap_or_default(),
            None => ids.iter().map(|i| format!("{i} ")).collect(),
        })
    }

    /// Whether `token` ends the assistant's turn.
    pub fn is_stop(&self, token: u32) -> Result<bool, JsValue> {
        self.get(|s| s.tok.as_ref().is_some_and(|t| t.end_of_turn().contains(&token)))
    }

    /// Reset the row, feed `prompt` and resolve to the first sampled token
    /// (temperature 0 = greedy).
    pub fn start(&self, prompt: Vec<u32>, temperature: f32, seed: u32) -> Promise {
        future_to_promise(with(self.inner.clone(), move |mut s| async move {
            s.sampler = Sampler::temperature(temperature, seed);
            let out = async {
                s.engine.reset(&[0]).map_err(js)?;
                let n = prompt.len();
                let got =
                    s.engine.append_sample_logprobs_async(&prompt, n, &[n], None, &[s.sampler]).await.map_err(js)?;
                Ok(JsValue::from(got[0].ok_or("empty prompt")?.0))
            }
            .await;
            (s, out)
        }))
    }

    /// Feed `token` and resolve to the next sampled token.
    pub fn step(&self, token: u32) -> Promise {
        future_to_promise(with(self.inner.clone(), move |mut s| async move {
            let out = async {
                let got =
                    s.engine.append_sample_logprobs_async(&[token], 1, &[1], None, &[s.sampler]).await.map_err(js)?;
                Ok(JsValue::from(got[0].ok_or("no token")?.0))
            }
            .await;
            (s, out)
        }))
    }
}
