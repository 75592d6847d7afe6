//! Print the token ids of a text as a JSON array.
//!
//! `cargo run --release --example tokenize -- --model PATH "text"`
//!
//! PATH is a GGUF file or a directory with `tokenizer.json`. Special tokens written in the text
//! are parsed as special; BOS is added only if the model asks for it.

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: tokenize --model PATH \"text\"";
    let at = args.iter().position(|a| a == "--model").ok_or(usage)?;
    let model = args.get(at + 1).ok_or(usage)?;
    let text = args.iter().enumerate().find(|(i, _)| *i != at && *i != at + 1).map(|(_, t)| t).ok_or(usage)?;
    let tok = kvdecode::model_file::load_tokenizer(model)
        .map_err(|e| e.to_string())?
        .ok_or(format!("{model}: no tokenizer (a GGUF file or a directory with tokenizer.json)"))?;
    let ids = tok.encode(text).map_err(|e| e.to_string())?;
    println!("{}", serde_json::to_string(&ids).map_err(|e| e.to_string())?);
    Ok(())
}
