//! `kvdecode`: one command for what people do with the engine.
//!
//! - `kvdecode chat --model PATH [PROMPT]`: a conversation kept on its cache row across turns
//! - `kvdecode serve --model PATH --host H --port P`: an OpenAI-compatible server
//! - `kvdecode generate --model PATH --prompts FILE.jsonl`: a JSONL batch through the scheduler
//! - `kvdecode rollout`: batched multi-turn RL rollouts on the embedded demo model (the main job)
//! - `kvdecode bench`: prefill / decode throughput tables
//! - `kvdecode bench-serve --url URL`: a load test of a running server that checks every answer
//! - `kvdecode tokenize --model PATH TEXT`: token ids as JSON

use clap::{Parser, Subcommand};
use kvdecode_cli::{bench, bench_serve, chat, common, generate, rollout, serve};

/// Counts the bytes held, for `bench --tables load`'s peak host memory.
#[global_allocator]
static ALLOC: kvdecode_cli::bench_load::CountingAlloc = kvdecode_cli::bench_load::CountingAlloc;

#[derive(Parser)]
#[command(name = "kvdecode", version, about = "Incremental transformer decoding on WebGPU, many sequences at once")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Chat with a model: interactive (a conversation kept on its cache row), or one answer to PROMPT.
    Chat(chat::Args),
    /// An OpenAI-compatible HTTP server (chat and text completions, streaming, metrics).
    Serve(serve::Args),
    /// Run a file of JSONL requests through the continuous-batching scheduler.
    Generate(generate::Args),
    /// Batched multi-turn rollouts with forks and tool results on the embedded demo model.
    Rollout(rollout::Args),
    /// Prefill and decode throughput on this machine's adapter.
    Bench(bench::Args),
    /// Load-test a running server and check every answer against the same request alone.
    BenchServe(bench_serve::Args),
    /// Print the token ids of a text as a JSON array.
    Tokenize {
        /// A GGUF file or a directory with tokenizer.json.
        #[arg(long)]
        model: String,
        /// The text (special tokens written in it are parsed as special).
        text: String,
    },
}

fn main() {
    quiet_headless_wsi();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Chat(a) => chat::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Rollout(a) => rollout::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchServe(a) => bench_serve::run(a),
        Command::Tokenize { model, text } => tokenize(&model, &text),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// Mesa's Vulkan drivers (lavapipe among them) print "error: XDG_RUNTIME_DIR is invalid or not
/// set in the environment." when they probe for a Wayland display at device creation on a headless
/// machine, though compute needs no display. Without the variable, the command uses a runtime
/// dir of the user's own in the temp dir (mode 0700, as the XDG spec asks), set before any thread
/// starts.
fn quiet_headless_wsi() {
    #[cfg(target_os = "linux")]
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else { return };
        let dir = std::env::temp_dir().join(format!("kvdecode-runtime-{uid}"));
        let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        // only a real directory of ours that nobody else can read (never a planted link)
        let ours = std::fs::symlink_metadata(&dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o777 == 0o700);
        if ours {
            // no thread exists yet: nothing reads the environment while it changes
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    }
}

fn tokenize(model: &str, text: &str) -> common::Result<()> {
    let tok = kvdecode::io::model_file::load_tokenizer(model)?
        .ok_or(format!("{model}: no tokenizer (a GGUF file or a directory with tokenizer.json)"))?;
    println!("{}", serde_json::to_string(&tok.encode(text)?)?);
    Ok(())
}
