//! Write the logits of a model after each append, to compare with another implementation.
//!
//! `cargo run --release --example logits -- --model PATH --tokens FILE.npy [--prefill N] [--kv f32|f16|bf16] [--lora ADAPTER] --out OUT.npy`
//!
//! PATH is a GGUF file, a Hugging Face directory (`config.json` + `*.safetensors`) or a
//! kvdecode/TinyAgent `.safetensors` file. The first N tokens (default: all) go in as one append, the rest one token
//! per append; OUT gets the logits after each append, f32 `[T - N + 1, vocab]`. `--tokens` is an
//! int64 (or int32) `.npy` of shape `[T]` or `[1, T]`. `--lora` applies a LoRA adapter, unmerged:
//! a PEFT folder or a GGUF LoRA file.

use kvdecode::{io::npy, Engine, EngineOptions, Gpu, KvDtype};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let usage =
        "usage: logits --model PATH --tokens FILE.npy [--prefill N] [--kv f32|f16|bf16] [--lora ADAPTER] --out OUT.npy";
    // every argument is a known flag and its value: a misspelt flag is an error, not ignored
    for pair in args.chunks(2) {
        match pair {
            [flag, _] if ["--model", "--tokens", "--prefill", "--kv", "--lora", "--out"].contains(&flag.as_str()) => {}
            [flag] => return Err(format!("{flag} needs a value\n{usage}")),
            [flag, ..] => return Err(format!("unknown argument {flag:?}\n{usage}")),
            [] => {}
        }
    }
    let model_path = get("--model").ok_or(usage)?;
    let tokens_path = get("--tokens").ok_or(usage)?;
    let out_path = get("--out").ok_or(usage)?;
    let kv = KvDtype::parse(get("--kv").as_deref().unwrap_or("f32")).map_err(|e| format!("--kv: {e}"))?;
    let model = kvdecode::io::model_file::load(&model_path, &mut |_, _| {}).map_err(|e| e.to_string())?.weights;
    let arr = npy::read(&tokens_path).map_err(|e| e.to_string())?;
    if !(arr.shape.len() == 1 || (arr.shape.len() == 2 && arr.shape[0] == 1)) {
        return Err(format!("{tokens_path}: shape {:?}, expected [T] or [1, T]", arr.shape));
    }
    let tokens = arr.to_u32().map_err(|e| format!("{tokens_path}: {e}"))?;
    let t = tokens.len();
    if t == 0 {
        return Err(format!("{tokens_path}: no tokens"));
    }
    let n = match get("--prefill") {
        Some(s) => s.parse::<usize>().map_err(|_| format!("--prefill {s}: not a number"))?,
        None => t,
    };
    if n == 0 || n > t {
        return Err(format!("--prefill {n}: must be in 1..={t}"));
    }
    let lora = match get("--lora") {
        Some(p) => Some(kvdecode::io::model_file::open_lora(&p, &model.cfg).map_err(|e| format!("--lora {p}: {e}"))?),
        None => None,
    };
    let rank = lora.iter().flat_map(|a| a.layers.iter().flatten().flatten().map(|m| m.rank)).max().unwrap_or(1);
    let opts =
        EngineOptions { kv, max_loras: usize::from(lora.is_some()), max_lora_rank: rank, ..EngineOptions::new(1, t) };
    let gpu = Gpu::new().map_err(|e| e.to_string())?;
    let mut engine = Engine::new(&gpu, &model, opts).map_err(|e| e.to_string())?;
    if let Some(a) = &lora {
        engine.load_lora("lora", a).map_err(|e| e.to_string())?;
        engine.set_adapter(0, Some("lora")).map_err(|e| e.to_string())?;
    }
    let v = model.cfg.vocab;
    let mut out = Vec::with_capacity((t - n + 1) * v);
    let first = engine.append(&tokens[..n], n, &[n], None).map_err(|e| e.to_string())?;
    out.extend_from_slice(first.row(0).expect("row 0 got tokens"));
    for &tok in &tokens[n..] {
        let l = engine.append(&[tok], 1, &[1], None).map_err(|e| e.to_string())?;
        out.extend_from_slice(l.row(0).expect("row 0 got a token"));
    }
    npy::write_f32(&out_path, &[t - n + 1, v], &out).map_err(|e| e.to_string())?;
    eprintln!("{}: wrote [{}, {v}] logits ({})", out_path, t - n + 1, gpu.describe());
    Ok(())
}
