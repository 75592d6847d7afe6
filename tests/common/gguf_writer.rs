//! A minimal GGUF writer for tests: a Llama-architecture model with llama.cpp's Q/K row
//! permutation, matrices as their quantized blocks (or F32 / F16), norms as F32.
#![allow(dead_code)]

use kvdecode::model::rope::RopeScaling;
use kvdecode::{Matrix, ModelWeights};

fn s(out: &mut Vec<u8>, v: &str) {
    out.extend((v.len() as u64).to_le_bytes());
    out.extend(v.as_bytes());
}

/// A metadata value to write.
pub enum Meta<'a> {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(&'a str),
    StrArr(Vec<String>),
    F32Arr(Vec<f32>),
    I32Arr(Vec<i32>),
}

/// How a matrix is stored.
#[derive(Clone, Copy)]
pub enum Store {
    F32,
    F16,
    /// its own quantized blocks (the matrix must be quantized)
    Blocks,
}

/// llama.cpp's permutation: GGUF row `h*hd + 2i + j` = HF row `h*hd + j*hd/2 + i`.
fn permute(m: &Matrix, heads: usize) -> Matrix {
    let hd = m.rows / heads;
    let half = hd / 2;
    let order: Vec<usize> = (0..m.rows).map(|r| (r / hd) * hd + (r % hd % 2) * half + (r % hd) / 2).collect();
    m.permute_rows(&order)
}

/// GGUF v3 bytes of a Llama model (`w.cfg` must be the plain Llama layout).
pub fn write_llama(w: &ModelWeights, store: Store) -> Vec<u8> {
    write_llama_with(w, store, Vec::new())
}

/// [`write_llama`] with extra metadata (a tokenizer, say).
pub fn write_llama_with(w: &ModelWeights, store: Store, extra: Vec<(&str, Meta)>) -> Vec<u8> {
    write_arch(w, store, "llama", extra)
}

/// GGUF bytes of a `llama`, `qwen2`, `qwen3`, `smollm3` or `gemma3` model, as llama.cpp's
/// converter writes them: Q/K rows (and biases) permuted for llama and smollm3, Gemma norms stored
/// as `1 + w`, Gemma's sliding window, RoPE scaling as `rope.scaling.*` keys (linear, YaRN) or
/// `rope_freqs.weight` (per-pair divisors).
pub fn write_arch(w: &ModelWeights, store: Store, arch: &str, extra: Vec<(&str, Meta)>) -> Vec<u8> {
    let c = &w.cfg;
    let key = |k: &str| -> &'static str { Box::leak(format!("{arch}.{k}").into_boxed_str()) };
    let mut meta: Vec<(&str, Meta)> = vec![
        ("general.architecture", Meta::Str(Box::leak(arch.to_string().into_boxed_str()))),
        (key("block_count"), Meta::U32(c.n_layers() as u32)),
        (key("embedding_length"), Meta::U32(c.d_model as u32)),
        (key("feed_forward_length"), Meta::U32(c.ffn as u32)),
        (key("attention.head_count"), Meta::U32(c.n_heads as u32)),
        (key("attention.head_count_kv"), Meta::U32(c.n_kv_heads as u32)),
        (key("rope.freq_base"), Meta::F32(c.rope_theta)),
        (key("attention.layer_norm_rms_epsilon"), Meta::F32(c.norm_eps)),
        (key("vocab_size"), Meta::U32(c.vocab as u32)),
        (key("attention.key_length"), Meta::U32(c.head_dim as u32)),
    ];
    match &c.rope_scaling {
        Some(RopeScaling::Linear { factor }) => {
            meta.push((key("rope.scaling.type"), Meta::Str("linear")));
            meta.push((key("rope.scaling.factor"), Meta::F32(*factor)));
        }
        Some(RopeScaling::Yarn { factor, original_context, .. }) => {
            meta.push((key("rope.scaling.type"), Meta::Str("yarn")));
            meta.push((key("rope.scaling.factor"), Meta::F32(*factor)));
            meta.push((key("rope.scaling.original_context_length"), Meta::U32(*original_context as u32)));
        }
        _ => {}
    }
    let gemma = arch == "gemma3" || arch == "gemma2";
    if gemma {
        meta.push((key("attention.sliding_window"), Meta::U32(c.window as u32)));
        if let Some(s) = c.logit_softcap {
            meta.push((key("final_logit_softcapping"), Meta::F32(s)));
        }
        if let Some(s) = c.attn_softcap {
            meta.push((key("attn_logit_softcapping"), Meta::F32(s)));
        }
    }
    meta.extend(extra);
    let shift = |v: &Vec<f32>| -> Vec<f32> { v.iter().map(|x| if gemma { x + 1.0 } else { *x }).collect() };
    // (name, dims, type id, bytes)
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = Vec::new();
    let mut mat = |name: String, m: &Matrix| {
        let (ty, bytes) = match (store, &m.quant) {
            (Store::Blocks, Some(q)) => (q.kind.ggml_type(), q.bytes.clone()),
            (Store::F16, _) => (1, m.data.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect()),
            _ => (0, m.data.iter().flat_map(|v| v.to_le_bytes()).collect()),
        };
        tensors.push((name, vec![m.cols as u64, m.rows as u64], ty, bytes));
    };
    let kvd = c.n_kv_heads * c.head_dim;
    let permuted = arch == "llama" || arch == "smollm3";
    mat("token_embd.weight".into(), &w.embed);
    if let Some(h) = &w.head {
        mat("output.weight".into(), h);
    }
    for (i, l) in w.layers.iter().enumerate() {
        let kv = l.kv_global.as_ref().or(l.kv_local.as_ref()).expect("a K/V projection");
        let k = Matrix { rows: kvd, cols: kv.cols, data: kv.data[..kvd * kv.cols].to_vec(), quant: None, half: None };
        let v = Matrix { rows: kvd, cols: kv.cols, data: kv.data[kvd * kv.cols..].to_vec(), quant: None, half: None };
        let split = |m: &Matrix, from: usize, rows: usize| -> Matrix {
            let mut out = Matrix {
                rows,
                cols: m.cols,
                data: m.data[from * m.cols..(from + rows) * m.cols].to_vec(),
                quant: None,
                half: None,
            };
            if let Some(q) = &m.quant {
                let rb = m.cols / q.kind.block_len() * q.kind.block_bytes();
                out.quant = Some(kvdecode::model::quant::QuantData {
                    kind: q.kind,
                    bytes: q.bytes[from * rb..(from + rows) * rb].to_vec(),
                });
            }
            out
        };
        let (k, v) = if kv.quant.is_some() { (split(kv, 0, kvd), split(kv, kvd, kvd)) } else { (k, v) };
        if permuted {
            mat(format!("blk.{i}.attn_q.weight"), &permute(&l.wq, c.n_heads));
            mat(format!("blk.{i}.attn_k.weight"), &permute(&k, c.n_kv_heads));
        } else {
            mat(format!("blk.{i}.attn_q.weight"), &l.wq);
            mat(format!("blk.{i}.attn_k.weight"), &k);
        }
        mat(format!("blk.{i}.attn_v.weight"), &v);
        mat(format!("blk.{i}.attn_output.weight"), &l.wo);
        mat(format!("blk.{i}.ffn_gate.weight"), &split(&l.mlp_in, 0, c.ffn));
        mat(format!("blk.{i}.ffn_up.weight"), &split(&l.mlp_in, c.ffn, c.ffn));
        mat(format!("blk.{i}.ffn_down.weight"), &l.mlp_out);
    }
    let mut vecs: Vec<(String, Vec<f32>)> =
        vec![("output_norm.weight".into(), shift(w.final_norm.as_ref().expect("norm")))];
    if let Some(RopeScaling::Divisors(d)) = &c.rope_scaling {
        vecs.push(("rope_freqs.weight".into(), d.clone()));
    }
    // a vector in the rows order of its matrix
    let permute_vec = |v: &[f32], heads: usize| -> Vec<f32> {
        let m = Matrix { rows: v.len(), cols: 1, data: v.to_vec(), quant: None, half: None };
        if permuted {
            permute(&m, heads).data
        } else {
            v.to_vec()
        }
    };
    for (i, l) in w.layers.iter().enumerate() {
        if let (Some(q), Some(kv)) = (&l.q_bias, &l.kv_bias) {
            vecs.push((format!("blk.{i}.attn_q.bias"), permute_vec(q, c.n_heads)));
            vecs.push((format!("blk.{i}.attn_k.bias"), permute_vec(&kv[..kvd], c.n_kv_heads)));
            vecs.push((format!("blk.{i}.attn_v.bias"), kv[kvd..].to_vec()));
        }
        // (OLMo 2 has neither)
        if let (Some(a), Some(m)) = (&l.attn_norm, &l.mlp_norm) {
            vecs.push((format!("blk.{i}.attn_norm.weight"), shift(a)));
            vecs.push((format!("blk.{i}.ffn_norm.weight"), shift(m)));
        }
        for (name, v) in [
            ("attn_q_norm", &l.q_norm),
            ("attn_k_norm", &l.k_norm),
            ("post_attention_norm", &l.post_attn_norm),
            ("post_ffw_norm", &l.post_mlp_norm),
        ] {
            if let Some(v) = v {
                vecs.push((format!("blk.{i}.{name}.weight"), shift(v)));
            }
        }
    }
    for (n, v) in vecs {
        tensors.push((n, vec![v.len() as u64], 0, v.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }

    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in &meta {
        s(&mut out, k);
        match v {
            Meta::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Str(x) => {
                out.extend(8u32.to_le_bytes());
                s(&mut out, x);
            }
            Meta::Bool(x) => {
                out.extend(7u32.to_le_bytes());
                out.push(*x as u8);
            }
            Meta::StrArr(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    s(&mut out, x);
                }
            }
            Meta::F32Arr(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    out.extend(x.to_le_bytes());
                }
            }
            Meta::I32Arr(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, dims, ty, bytes) in &tensors {
        s(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + bytes.len() as u64).next_multiple_of(32);
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    let base = out.len();
    for ((_, _, _, bytes), off) in tensors.iter().zip(offsets) {
        out.resize(base + off as usize, 0);
        out.extend(bytes);
    }
    out
}
