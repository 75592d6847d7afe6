//! kvdecode in the browser: a decoding session the page drives from JavaScript. Everything is
//! async (the browser cannot block); models come from bytes (the embedded demo, or a GGUF file
//! picked from disk), never from paths. A session has several rows: each conversation lives on
//! its own row and continues there (a new turn prefills only what is new), and the conversations
//! that are answering decode together, one batched step for all of them. A GGUF LoRA adapter (as
//! llama.cpp's `convert_lora_to_gguf.py` writes one) can go over a GGUF model: every row decodes
//! with it, unmerged.

use std::cell::RefCell;
use std::rc::Rc;

use js_sys::Promise;
use kvdecode::io::gguf::GgufFile;
use kvdecode::io::model_file::ModelFile;
use kvdecode::io::tokenizer::{Message, Tokenizer};
use kvdecode::{
    Batch, Engine, EngineOptions, Gpu, GpuOptions, KvDtype, LoraAdapter, ModelWeights, Sampler, Want, WeightDtype,
};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

struct Inner {
    engine: Engine,
    tok: Option<Tokenizer>,
    adapter: String,
    sampler: Sampler,
    /// The LoRA adapter every row decodes with, by its name in the engine.
    lora: Option<&'static str>,
}

/// The engine's name for the session's LoRA adapter.
const LORA: &str = "lora";

/// One model on the GPU with a cache of a few rows (one per conversation).
#[wasm_bindgen]
pub struct Session {
    /// Taken out while a step is in flight, so no borrow is held across an await.
    inner: Rc<RefCell<Option<Inner>>>,
}

fn js(e: kvdecode::Error) -> JsValue {
    JsValue::from_str(&e.to_string())
}

/// Where a session's weights come from: the demo model in memory, or a GGUF file's bytes whose
/// tensors go to the GPU one at a time (no host copy of the model beside the file's bytes).
enum Weights {
    Demo(ModelWeights),
    File(ModelFile),
}

async fn open(
    weights: Weights,
    tok: Option<Tokenizer>,
    max_len: usize,
    rows: usize,
    lora: Option<LoraAdapter>,
) -> Result<Session, JsValue> {
    let gpu = Gpu::new_async(&GpuOptions::default()).await.map_err(js)?;
    let rank = lora.iter().flat_map(|a| a.layers.iter().flatten().flatten().map(|m| m.rank)).max().unwrap_or(1);
    let opts = EngineOptions {
        kv: KvDtype::F16,
        weights: WeightDtype::F16,
        max_loras: usize::from(lora.is_some()),
        max_lora_rank: rank,
        ..EngineOptions::new(rows.max(1), max_len)
    };
    let mut engine = match &weights {
        Weights::Demo(w) => Engine::new_async(&gpu, w, opts).await,
        Weights::File(f) => Engine::from_file_async(&gpu, f, opts, &mut |_, _| {}).await,
    }
    .map_err(js)?;
    drop(weights);
    if let Some(a) = &lora {
        engine.load_lora(LORA, a).map_err(js)?;
        for r in 0..rows.max(1) {
            engine.set_adapter(r, Some(LORA)).map_err(js)?;
        }
    }
    let adapter = gpu.describe();
    let inner = Inner { engine, tok, adapter, sampler: Sampler::GREEDY, lora: lora.map(|_| LORA) };
    Ok(Session { inner: Rc::new(RefCell::new(Some(inner))) })
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
    /// The embedded demo model (no download), with `rows` rows of `max_len` tokens.
    pub async fn demo(max_len: usize, rows: usize) -> Result<Session, JsValue> {
        open(Weights::Demo(ModelWeights::demo()), None, max_len, rows, None).await
    }

    /// A GGUF file's bytes (its tokenizer and chat template come with it; a file without a
    /// vocabulary takes token ids), with `rows` rows of `max_len` tokens, or of the model's
    /// trained context where that is shorter.
    pub async fn gguf(bytes: Vec<u8>, max_len: usize, rows: usize) -> Result<Session, JsValue> {
        let mut f = GgufFile::parse(bytes).and_then(ModelFile::from_gguf).map_err(js)?;
        let tok = f.tokenizer.take();
        let max_len = f.config().context_len.map_or(max_len, |c| max_len.min(c));
        open(Weights::File(f), tok, max_len, rows, None).await
    }

    /// [`Session::gguf`] with a GGUF LoRA adapter's bytes over it (llama.cpp's
    /// `convert_lora_to_gguf.py` format): every row decodes with the adapter, unmerged. An
    /// adapter for another model is an error that names the tensor.
    pub async fn gguf_with_lora(
        bytes: Vec<u8>,
        lora: Vec<u8>,
        max_len: usize,
        rows: usize,
    ) -> Result<Session, JsValue> {
        let mut f = GgufFile::parse(bytes).and_then(ModelFile::from_gguf).map_err(js)?;
        let adapter = GgufFile::parse(lora).and_then(|a| a.lora(f.config())).map_err(js)?;
        let tok = f.tokenizer.take();
        let max_len = f.config().context_len.map_or(max_len, |c| max_len.min(c));
        open(Weights::File(f), tok, max_len, rows, Some(adapter)).await
    }

    /// Whether the rows decode with a LoRA adapter.
    pub fn has_lora(&self) -> Result<bool, JsValue> {
        self.get(|s| s.lora.is_some())
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

    /// Token ids of a whole conversation, `[{"role": "user", "content": "..."}, ...]` as JSON,
    /// in the model's chat template with the assistant's turn opened (the plain text when it has
    /// none). Without a tokenizer (the demo model) each message is its UTF-8 bytes (an answer: the
    /// ids it shows) and token 0.
    pub fn conversation_ids(&self, messages_json: &str) -> Result<Vec<u32>, JsValue> {
        #[derive(serde::Deserialize)]
        struct Msg {
            role: String,
            content: String,
        }
        let msgs: Vec<Msg> = serde_json::from_str(messages_json).map_err(|e| format!("messages: {e}"))?;
        self.get(|s| match &s.tok {
            Some(tok) => {
                let msgs: Vec<Message> = msgs.iter().map(|m| Message::new(&m.role, &m.content)).collect();
                match tok.apply_chat_template(&msgs, true) {
                    Ok(text) => tok.encode_rendered(&text).map_err(js),
                    // no template: the conversation as plain text
                    Err(_) => {
                        tok.encode(&msgs.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n")).map_err(js)
                    }
                }
            }
            // the demo's answers read back as the ids they show ("12 7 301 "), so a conversation
            // renders to exactly the tokens its row holds
            None => Ok(msgs
                .iter()
                .flat_map(|m| {
                    let ids: Option<Vec<u32>> = m.content.split_whitespace().map(|w| w.parse().ok()).collect();
                    match ids.filter(|_| m.role == "assistant") {
                        Some(ids) => ids,
                        None => m.content.bytes().map(u32::from).collect(),
                    }
                    .into_iter()
                    .chain([0])
                })
                .collect()),
        })?
    }

    /// Make conversation row `row` hold `ids` but the last token, prefilling only what it does
    /// not hold already (see `Engine::continue_row`); returns how many tokens were kept. The page
    /// then feeds the last token to the row's first decode step.
    pub fn continue_row(&self, row: usize, ids: Vec<u32>) -> Result<usize, JsValue> {
        let mut cell = self.inner.borrow_mut();
        let s = cell.as_mut().ok_or("the session is busy with another step")?;
        s.engine.continue_row(row, &ids).map_err(js)
    }

    /// Tokens row `row` holds.
    pub fn row_len(&self, row: usize) -> Result<usize, JsValue> {
        self.get(|s| s.engine.cache().lens().get(row).copied().unwrap_or(0))
    }

    /// One batched decode step for several conversations: append `tokens[i]` to `rows[i]` and
    /// resolve to the token each row samples next (temperature 0 = greedy; row i draws with
    /// seed `seed + row`).
    pub fn step_rows(&self, rows: Vec<usize>, tokens: Vec<u32>, temperature: f32, seed: u32) -> Promise {
        future_to_promise(with(self.inner.clone(), move |mut s| async move {
            let out = async {
                if rows.len() != tokens.len() {
                    return Err(JsValue::from_str("step_rows: one token per row"));
                }
                let samplers: Vec<Sampler> =
                    rows.iter().map(|&r| Sampler::temperature(temperature, seed.wrapping_add(r as u32))).collect();
                let ones = vec![1; rows.len()];
                let got = sample(&mut s.engine, &tokens, 1, &ones, &rows, &samplers).await.map_err(js)?;
                let next: Vec<u32> = got.iter().map(|g| g.unwrap_or(0)).collect();
                Ok(js_sys::Uint32Array::from(&next[..]).into())
            }
            .await;
            (s, out)
        }))
    }

    /// Whether `token` ends the assistant's turn.
    pub fn is_stop(&self, token: u32) -> Result<bool, JsValue> {
        self.get(|s| s.tok.as_ref().is_some_and(|t| t.end_of_turn().contains(&token)))
    }

    /// Reset row 0, feed `prompt` and resolve to the first sampled token
    /// (temperature 0 = greedy).
    pub fn start(&self, prompt: Vec<u32>, temperature: f32, seed: u32) -> Promise {
        future_to_promise(with(self.inner.clone(), move |mut s| async move {
            s.sampler = Sampler::temperature(temperature, seed);
            let out = async {
                s.engine.reset(&[0]).map_err(js)?;
                // a reset puts the row on the base model: back on the session's adapter
                s.engine.set_adapter(0, s.lora).map_err(js)?;
                let n = prompt.len();
                let got = sample(&mut s.engine, &prompt, n, &[n], &[0], &[s.sampler]).await.map_err(js)?;
                Ok(JsValue::from(got[0].ok_or("empty prompt")?))
            }
            .await;
            (s, out)
        }))
    }

    /// Feed `token` to row 0 and resolve to the next sampled token.
    pub fn step(&self, token: u32) -> Promise {
        future_to_promise(with(self.inner.clone(), move |mut s| async move {
            let out = async {
                let got = sample(&mut s.engine, &[token], 1, &[1], &[0], &[s.sampler]).await.map_err(js)?;
                Ok(JsValue::from(got[0].ok_or("no token")?))
            }
            .await;
            (s, out)
        }))
    }
}

/// One step that feeds `n_new[r]` of `ids` (`[rows, width]`) to each of `rows` and samples a token
/// for each: [`Engine::step_async`] with [`Want::Sampled`].
async fn sample(
    engine: &mut Engine,
    ids: &[u32],
    width: usize,
    n_new: &[usize],
    rows: &[usize],
    samplers: &[Sampler],
) -> kvdecode::Result<Vec<Option<u32>>> {
    let batch = Batch::padded(ids, width, n_new, Some(rows)).samplers(samplers);
    let got = engine.step_async(&batch, Want::Sampled).await?.into_sampled()?;
    Ok(got.into_iter().map(|g| g.map(|g| g.token)).collect())
}
