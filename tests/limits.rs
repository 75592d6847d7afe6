//! Under exactly the WebGPU default limits (128 MiB per storage binding), a model whose embedding
//! and LM head are each larger than one binding still runs and matches the reference: the tensors
//! are split into row parts, each its own binding and dispatch.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, ModelConfig};

#[test]
fn embedding_and_head_over_128_mib_are_split() {
    let gpu = gpu();
    assert_eq!(gpu.limits, wgpu::Limits::default(), "the device must have exactly the WebGPU defaults");
    let limit = gpu.limits.max_storage_buffer_binding_size;
    assert_eq!(limit, 128 << 20);
    // 66000 x 512 f32 = 135 MB per matrix, above the 134 MB binding limit
    let cfg = ModelConfig::llama(66_000, 512, 8, 2, 64, 256, 1, 10000.0, 1e-5, false);
    let w = model(&cfg, 161);
    assert!((w.embed.data.len() * 4) as u64 > limit && (w.head().data.len() * 4) as u64 > limit);
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(1, 8)).unwrap();
    // ids from both parts of the embedding; logits from both parts of the head
    let ids = [3u32, 65_999, 40_000, 1, 65_000];
    let out = e.append(&ids, 5, &[5], None).unwrap();
    let want = ref_last(&w, &ids);
    let d = max_abs_diff(out.row(0).unwrap(), &want);
    println!("66000 x 512 embedding and head, split in row parts: max |gpu - reference| = {d:e}");
    assert!(d <= 1e-4, "{d}");
}
