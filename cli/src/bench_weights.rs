//! `kvdecode bench --tables weights`: a trainer's weight push (every tensor, f16, by name) timed
//! against its floor, `queue.write_buffer` of the same bytes in the same calls, in one run; then
//! memory (RSS and wgpu's allocator) across many updates and sleep/wake cycles.

use std::time::Instant;

use kvdecode::model::family::{tensors_of, Naming};
use kvdecode::{Engine, EngineOptions, Family, Gpu, HostDtype, HostTensor, InFlight, ModelWeights, Sleep, WeightDtype};
use serde_json::json;

use crate::common::Result;

/// Resident memory of this process, in bytes (Linux; 0 elsewhere).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

/// The middle of `v` once sorted (the upper one of an even count): what the bench tables print.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn wait(gpu: &Gpu) -> Result<()> {
    gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| format!("waiting for the GPU: {e}"))?;
    Ok(())
}

/// Time full updates of `model`'s shape (random f16 weights) against `queue.write_buffer` of the
/// same bytes, `rounds` times each, interleaved; then `updates` more updates and `cycles`
/// sleep/wake cycles, with the memory before and after.
pub fn weights_table(
    gpu: &Gpu,
    model: &ModelWeights,
    rounds: usize,
    updates: usize,
    cycles: usize,
) -> Result<serde_json::Value> {
    let w = ModelWeights::random(&model.cfg, 5)?;
    let naming = if w.cfg.family == Family::Kvdecode { Naming::Kvdecode } else { Naming::HuggingFace("model.") };
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = tensors_of(&w, naming)
        .into_iter()
        .map(|(t, v)| {
            (t.name.clone(), t.file_shape(), v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect())
        })
        .collect();
    let host: Vec<HostTensor> = tensors
        .iter()
        .map(|(name, shape, bytes)| HostTensor {
            name: name.clone(),
            shape: shape.clone(),
            dtype: HostDtype::F16,
            bytes,
        })
        .collect();
    let bytes: u64 = tensors.iter().map(|t| t.2.len() as u64).sum();
    let params: usize = tensors.iter().map(|t| t.1.iter().product::<usize>()).sum();
    let mut e = Engine::new(gpu, &w, EngineOptions { weights: WeightDtype::F16, ..EngineOptions::new(2, 64) })?;
    drop(w);
    // the floor writes the same bytes into buffers of the same sizes (as much fresh memory on
    // both sides as the update touches)
    let scratch: Vec<wgpu::Buffer> = tensors
        .iter()
        .map(|t| {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("bench: write_buffer floor"),
                size: (t.2.len() as u64).next_multiple_of(4).max(4),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
        .collect();
    let (mut update_ms, mut floor_ms) = (Vec::new(), Vec::new());
    for round in 0..=rounds {
        let t = Instant::now();
        e.update_weights(&host, InFlight::Keep)?;
        wait(gpu)?;
        let u = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        for ((_, _, b), dst) in tensors.iter().zip(&scratch) {
            // the floor: the same bytes, one write per tensor (4-byte aligned as WebGPU asks)
            gpu.queue.write_buffer(dst, 0, &b[..b.len() / 4 * 4]);
        }
        gpu.queue.submit([]);
        wait(gpu)?;
        let f = t.elapsed().as_secs_f64() * 1e3;
        if round > 0 {
            // round 0 warms the allocator's staging memory up
            update_ms.push(u);
            floor_ms.push(f);
        }
    }
    let min = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
    let (u_min, f_min) = (min(&update_ms), min(&floor_ms));
    let (u, f) = (median(update_ms), median(floor_ms));
    println!(
        "\n| weights update ({params} parameters, f16, {} tensors by name; {rounds} rounds) | median ms | min ms | MB/s | x floor |",
        tensors.len()
    );
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| update_weights (checked, written in place) | {u:.2} | {u_min:.2} | {:.0} | {:.2}x |",
        bytes as f64 / u / 1e3,
        u / f
    );
    println!(
        "| queue.write_buffer of the same bytes (floor) | {f:.2} | {f_min:.2} | {:.0} | 1.00x |",
        bytes as f64 / f / 1e3
    );
    // memory across many updates and sleep/wake cycles: read at the start, then after each
    // quarter of the updates and of the cycles (flat: a plateau, not a climb)
    let alloc = |e: &Engine| e.memory_report().allocator.map_or(0, |a| a.0);
    let mut marks = vec![("start".to_string(), rss(), alloc(&e))];
    for k in 1..=updates {
        e.update_weights(&host, InFlight::Keep)?;
        if k % updates.div_ceil(4).max(1) == 0 || k == updates {
            wait(gpu)?;
            marks.push((format!("after {k} updates"), rss(), alloc(&e)));
        }
    }
    for k in 1..=cycles {
        e.sleep(Sleep::ALL)?;
        e.wake()?;
        if k % cycles.div_ceil(4).max(1) == 0 || k == cycles {
            wait(gpu)?;
            marks.push((format!("after {k} sleep/wake"), rss(), alloc(&e)));
        }
    }
    let mib = |b: u64| b as f64 / 1048576.0;
    println!("\n| memory | RSS MiB | allocator MiB |");
    println!("|---|---:|---:|");
    for (what, r, a) in &marks {
        println!("| {what} | {:.1} | {:.1} |", mib(*r), mib(*a));
    }
    Ok(json!({
        "parameters": params, "bytes": bytes, "tensors": tensors.len(),
        "update_ms": u, "floor_ms": f, "ratio": u / f, "update_min_ms": u_min, "floor_min_ms": f_min,
        "memory": marks.iter().map(|(what, r, a)| json!({"at": what, "rss_bytes": r, "allocator_bytes": a})).collect::<Vec<_>>(),
        "updates": updates, "sleep_wake_cycles": cycles,
    }))
}
