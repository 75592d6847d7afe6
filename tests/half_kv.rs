//! 16-bit K/V storage (f16 and bf16, packed two per u32). Teacher-forced decoding against two
//! references: the one that stores K/V rounded the same way (tight tolerance, the same top-1 token
//! at every position) and the exact f32 one (a looser tolerance that states the storage error).
//! Forks, rollbacks and sharded caches stay exact (bit for bit) in both formats.

mod common;

use common::*;
use kvdecode::model::reference::{self, RefOptions};
use kvdecode::{argmax, Engine, EngineOptions, KvDtype, ModelWeights, SplitMix64};

/// Absolute logit tolerance against the exact f32 reference for f16 K/V (logits of magnitude ~5;
/// f16 keeps 11 significant bits).
const F16_TOL: f32 = 5e-3;
/// For bf16 K/V (8 significant bits: 8x coarser steps than f16).
const BF16_TOL: f32 = 2e-2;
/// Against the reference that rounds K/V as the cache does: what is left is a rounding boundary
/// crossed differently now and then (the GPU's K differs from the reference's in the last f32 bit).
const ROUNDED_TOL: f32 = 2e-3;

fn tolerance(kv: KvDtype) -> f32 {
    match kv {
        KvDtype::F16 => F16_TOL,
        _ => BF16_TOL,
    }
}

/// Returns the worst |gpu - reference| over every position.
fn teacher_forced(w: &ModelWeights, kv: KvDtype, seed: u64) -> f32 {
    let gpu = gpu();
    let opts = EngineOptions { kv, ..EngineOptions::new(2, 96) };
    let mut e = Engine::new(&gpu, w, opts).unwrap();
    let mut rng = SplitMix64(seed);
    let v = w.cfg.vocab;
    let seqs: Vec<Vec<u32>> = (0..2).map(|_| (0..90).map(|_| rng.below(v) as u32).collect()).collect();
    let refs: Vec<Vec<f32>> = seqs.iter().map(|s| reference::forward(w, s).unwrap()).collect();
    let rounded: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| reference::forward_with(w, s, RefOptions { kv: Some(kv), ..Default::default() }).unwrap())
        .collect();
    // prefill 20 (row 0) and 7 (row 1), then one token per step on both rows
    let mut ids = vec![0u32; 2 * 20];
    ids[..20].copy_from_slice(&seqs[0][..20]);
    ids[20..27].copy_from_slice(&seqs[1][..7]);
    let mut out = e.append(&ids, 20, &[20, 7], None).unwrap();
    let mut pos = [19usize, 6];
    let (mut worst, mut worst_rounded, mut top1_checked) = (0f32, 0f32, 0);
    loop {
        for r in 0..2 {
            let got = out.row(r).unwrap();
            let at = pos[r] * v..(pos[r] + 1) * v;
            let diff = max_abs_diff(got, &refs[r][at.clone()]);
            worst = worst.max(diff);
            assert!(diff <= tolerance(kv), "{kv:?} seed {seed} row {r} pos {}: {diff}", pos[r]);
            let want = &rounded[r][at];
            let diff = max_abs_diff(got, want);
            worst_rounded = worst_rounded.max(diff);
            assert!(diff <= ROUNDED_TOL, "{kv:?} seed {seed} row {r} pos {} vs rounded reference: {diff}", pos[r]);
            // the same top-1 token at every position
            assert_eq!(argmax(got), argmax(want), "{kv:?} seed {seed} row {r} pos {}", pos[r]);
            top1_checked += 1;
        }
        if pos[0] + 1 >= 90 {
            break;
        }
        let next = [seqs[0][pos[0] + 1], seqs[1][pos[1] + 1]];
        out = e.append(&next, 1, &[1, 1], None).unwrap();
        pos = [pos[0] + 1, pos[1] + 1];
    }
    println!(
        "{kv:?} K/V: worst |gpu - f32 ref| = {worst:e}, |gpu - {kv:?}-storage ref| = {worst_rounded:e}, \
         top-1 equal at all {top1_checked} positions"
    );
    worst
}

#[test]
fn half_kv_tiny_agent_teacher_forced() {
    let s = seed(31);
    let w = model(&tiny_agent_cfg(), s);
    let f16 = teacher_forced(&w, KvDtype::F16, s);
    let bf16 = teacher_forced(&w, KvDtype::BF16, s);
    // bf16 is really stored as bf16 (coarser than f16), not silently as f16 or f32
    assert!(bf16 > f16 && f16 > 0.0, "bf16 error {bf16} should exceed f16 error {f16}");
}

#[test]
fn half_kv_llama_teacher_forced() {
    let s = seed(32);
    let w = model(&llama_cfg(), s);
    let f16 = teacher_forced(&w, KvDtype::F16, s);
    let bf16 = teacher_forced(&w, KvDtype::BF16, s);
    assert!(bf16 > f16 && f16 > 0.0, "bf16 error {bf16} should exceed f16 error {f16}");
}

#[test]
fn half_kv_engram_model_teacher_forced() {
    let s = seed(33);
    let w = ModelWeights::demo();
    teacher_forced(&w, KvDtype::BF16, s);
}

/// With rows spread over cache shards (a lowered binding limit): a forked row continues bit for
/// bit like the row it was forked from, and appending junk then rolling it back leaves a row that
/// continues bit for bit like one that never saw the junk.
#[test]
fn half_kv_fork_rollback_and_shards_are_exact() {
    let s = seed(34);
    let w = model(&tiny_agent_cfg(), s);
    let opts = kvdecode::GpuOptions { max_storage_binding: Some(4096), ..Default::default() };
    let gpu = kvdecode::Gpu::with_options(&opts).expect("GPU with a lowered binding limit");
    for kv in [KvDtype::F16, KvDtype::BF16] {
        let mut e = Engine::new(&gpu, &w, EngineOptions { kv, rollback: 4, ..EngineOptions::new(4, 40) }).unwrap();
        assert!(e.cache().shard_rows() < 4, "{kv:?}: cache not sharded");
        let mut rng = SplitMix64(s);
        let prompt: Vec<u32> = (0..15).map(|_| rng.below(96) as u32).collect();
        e.append(&prompt, 15, &[15], Some(&[0])).unwrap();
        e.fork(0, &[3]).unwrap();
        // row 0 takes junk and rolls it back; row 3 (the fork, another shard) does not
        e.append(&[7, 8, 9], 3, &[3], Some(&[0])).unwrap();
        e.rollback(&[0], &[3]).unwrap();
        for step in 0..8 {
            let t = rng.below(96) as u32;
            let out = e.append(&[t, t], 1, &[1, 1], Some(&[0, 3])).unwrap();
            let (a, b) = (out.row(0).unwrap(), out.row(1).unwrap());
            assert_eq!(a, b, "{kv:?} step {step}: fork + rollback changed bits");
            let want = ref_last(&w, e.cache().history(0));
            assert!(max_abs_diff(a, &want) <= tolerance(kv), "{kv:?} step {step}");
        }
    }
}

#[test]
fn kv_dtype_names_parse_and_unknown_is_a_clear_error() {
    for k in KvDtype::ALL {
        assert_eq!(KvDtype::parse(k.name()).unwrap(), k);
    }
    let e = KvDtype::parse("fp8").unwrap_err().to_string();
    assert!(e.contains("\"fp8\"") && e.contains("bf16"), "{e}");
}

/// The kernels' f16 rounding (`pack2` in common.wgsl, integer arithmetic) on the device gives
/// `half::f16::from_f32`'s bits, nearest even, for every finite f16, the midpoints between
/// neighbours (the ties) and the f32 values either side of them, subnormals, overflow and the
/// specials. A driver's own `pack2x16float` is not used: its rounding is the driver's, and a
/// compiler may fold a pack-unpack pair within one shader (see common.wgsl's `f16_bits`).
#[test]
fn f16_rounding_on_the_device_is_nearest_even() {
    use wgpu::util::DeviceExt;
    let mut xs: Vec<f32> =
        vec![0.0, f32::INFINITY, f32::NAN, 1e-45, 1e-30, 2.9802322e-8, 65504.0, 65519.99, 65520.0, 1e10];
    for h in 0u16..0x7c00 {
        let v = half::f16::from_bits(h).to_f32();
        let next = half::f16::from_bits(h + 1).to_f32();
        let mid = if h + 1 == 0x7c00 { 65520.0 } else { (v + next) / 2.0 };
        xs.extend([v, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)]);
    }
    xs.extend(xs.clone().iter().map(|x| -x));
    let gpu = gpu();
    let src = format!(
        "{}\n{}",
        include_str!("../shaders/common.wgsl"),
        "@group(0) @binding(0) var<storage, read> xs: array<vec2<f32>>;  // [n / 2]
         @group(0) @binding(1) var<storage, read_write> out: array<u32>;  // [n / 2] f16 pairs
         @compute @workgroup_size(64)
         fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
             if gid.x < arrayLength(&out) { out[gid.x] = pack2(1u, xs[gid.x]); }
         }"
    );
    let d = &gpu.device;
    let module = d.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("f16 rounding"),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    });
    let pipeline = d.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("f16 rounding"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let input = d.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: bytemuck::cast_slice(&xs),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let size = (xs.len() / 2 * 4) as u64;
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    let out = d.create_buffer(&wgpu::BufferDescriptor { label: None, size, usage, mapped_at_creation: false });
    let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
    let read = d.create_buffer(&wgpu::BufferDescriptor { label: None, size, usage, mapped_at_creation: false });
    let bind = d.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: input.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: out.as_entire_binding() },
        ],
    });
    let mut enc = d.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups((xs.len() / 2).div_ceil(64) as u32, 1, 1);
    }
    enc.copy_buffer_to_buffer(&out, 0, &read, 0, size);
    gpu.queue.submit([enc.finish()]);
    read.slice(..).map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    d.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let words: Vec<u32> = bytemuck::cast_slice(&read.slice(..).get_mapped_range().unwrap()).to_vec();
    let mut wrong = Vec::new();
    for (i, x) in xs.iter().enumerate() {
        let got = (words[i / 2] >> (16 * (i % 2))) & 0xffff;
        let want = u32::from(half::f16::from_f32(*x).to_bits());
        if got != want {
            wrong.push(format!("{x:e} ({:#010x}): {got:#06x}, want {want:#06x}", x.to_bits()));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} values rounded wrong, first: {:?}",
        wrong.len(),
        xs.len(),
        &wrong[..wrong.len().min(8)]
    );
}
