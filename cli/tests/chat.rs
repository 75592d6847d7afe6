//! `kvdecode chat`, interactive: the conversation stays on its row (later turns prefill only what
//! is new, as `--verbose` reports), `/reset` starts over, and Ctrl-C stops an answer, not the
//! program.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/gguf/llama-f32-chatml.gguf");

/// The `[turn N: prompt P tokens, R reused from the cache, F prefilled; ...]` lines.
fn turns(stderr: &str) -> Vec<(usize, usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| l.split_once("[turn ").map(|x| x.1))
        .map(|l| {
            let n: Vec<usize> = l.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse().ok()).collect();
            (n[1], n[2], n[3])
        })
        .collect()
}

#[test]
fn turns_prefill_only_what_is_new() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["chat", "--model", MODEL, "--verbose", "--temperature", "0", "--max-tokens", "8"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello there\nand now?\none more\n/reset\nhello there\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let t = turns(&err);
    assert_eq!(t.len(), 4, "{err}");
    // turn 1 prefills its prompt; later turns reuse at least the earlier prompts from the row
    // (the earlier answers too, when they tokenize back to the sampled tokens: a random model's
    // odd bytes may not)
    assert_eq!(t[0].1, 0, "{err}");
    for k in 1..3 {
        let (prompt, reused, prefilled) = t[k];
        assert!(
            reused >= t[k - 1].0,
            "turn {}: reused {reused} of the earlier {}-token prompt\n{err}",
            k + 1,
            t[k - 1].0
        );
        assert_eq!(reused + prefilled, prompt);
    }
    // after /reset the same first message is the same prompt again, and the row still holds
    // all of it but the token the first decode step feeds
    assert_eq!(t[3].0, t[0].0, "{err}");
    assert_eq!(t[3].2, 1, "{err}");
    assert!(err.contains("(conversation cleared)"));
}

#[test]
fn ctrl_c_stops_the_answer_not_the_program() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvdecode"))
        .args(["chat", "--model", MODEL, "--verbose", "--temperature", "1", "--max-tokens", "1900", "--window", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let _ = tx.send(line.unwrap_or_default());
        }
    });
    let stdout = child.stdout.take().unwrap();
    let (otx, orx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut buf = [0u8; 64];
        while let Ok(n) = std::io::Read::read(&mut r, &mut buf) {
            if n == 0 {
                break;
            }
            let _ = otx.send(n);
        }
    });
    // ask for a long answer, wait until text streams, then Ctrl-C
    writeln!(stdin, "tell me a long story").unwrap();
    orx.recv_timeout(Duration::from_secs(60)).expect("the answer starts streaming");
    Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let mut seen = Vec::new();
    let stopped = loop {
        let l = rx.recv_timeout(Duration::from_secs(60)).expect("chat reports the stopped answer");
        seen.push(l.clone());
        if l.contains("[turn 1:") {
            break l;
        }
    };
    assert!(seen.iter().any(|l| l.contains("(stopped)")), "{seen:?}");
    let answered: usize = stopped.split("answer ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(answered < 1900, "{stopped}");
    // the program is still there and answers the next turn
    writeln!(stdin, "hi").unwrap();
    let next = loop {
        let l = rx.recv_timeout(Duration::from_secs(120)).expect("a second turn");
        if l.contains("[turn 2:") {
            break l;
        }
    };
    assert!(next.contains("reused"), "{next}");
    writeln!(stdin, "/quit").unwrap();
    assert!(child.wait().unwrap().success());
}
