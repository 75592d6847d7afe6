//! The parts of the `kvdecode` command (src/main.rs), as a library so that tests and the fuzz
//! targets reach them: the server's request parser above all (`serve::api::parse`).

pub mod bench;
pub mod bench_formats;
pub mod bench_load;
pub mod bench_lora;
pub mod bench_moe;
pub mod bench_occupancy;
pub mod bench_serve;
pub mod bench_weights;
pub mod chat;
pub mod common;
pub mod generate;
pub mod rollout;
pub mod serve;
