//! What the command's tests share: run `kvdecode` with `--json` and read its figures.

#![allow(dead_code)]

pub mod server;

use std::process::Command;

/// Run `kvdecode args...`, require success, and return its whole stdout and its last line parsed
/// as the JSON object `--json` ends with.
pub fn run_json(args: &[&str]) -> (String, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvdecode")).args(args).output().expect("run kvdecode");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "kvdecode {args:?}:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().expect("output").to_string();
    let v = serde_json::from_str(&last).unwrap_or_else(|e| panic!("the last line is not JSON ({e}): {last}"));
    (stdout, v)
}
