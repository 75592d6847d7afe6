//! Out of memory and device loss: an engine larger than the device can hold is a clear error at
//! `Engine::new` (and leaves the device usable), a lost device makes every later call an error
//! that says so (no panic, no hang), and a new `Gpu` + `Engine` work afterwards.

mod common;

use common::*;
use kvdecode::{Engine, EngineOptions, Error, Gpu, GpuOptions, KvDtype, ModelConfig, Sampler};

/// 8 layers x (K + V) x 8 KV heads x 64 dims x 4 bytes = 32 KiB of K/V per position and row.
fn wide_kv_model() -> kvdecode::ModelWeights {
    model(&ModelConfig::llama(96, 64, 8, 8, 64, 64, 8, 10000.0, 1e-6, false), 1)
}

#[test]
fn an_engine_larger_than_the_device_is_a_clear_error() {
    let gpu = own_gpu();
    let w = wide_kv_model();
    // 2048 rows x 8192 positions x 32 KiB = 512 GiB of K/V: more than this machine has
    let huge = EngineOptions { kv: KvDtype::F32, ..EngineOptions::new(2048, 8192) };
    let e = Engine::new(&gpu, &w, huge).err().expect("a 512 GiB engine must be refused");
    let msg = e.to_string();
    println!("{msg}");
    assert!(matches!(e, Error::Device(_)) && msg.contains("out of GPU memory"), "{msg}");
    assert_eq!(gpu.memory_in_use(), 0, "a failed engine gives its budget back");
    // the device is still usable: a normal engine builds and decodes correctly
    let small = model(&llama_cfg(), 2);
    let mut ok = Engine::new(&gpu, &small, EngineOptions::new(2, 32)).unwrap();
    let out = ok.append(&[1, 2, 3, 0, 0, 0], 3, &[3, 0], None).unwrap();
    assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&small, &[1, 2, 3])) <= 1e-4);
}

#[test]
fn an_explicit_memory_budget_is_shared_by_the_engines_of_a_device() {
    let w = model(&llama_cfg(), 3);
    let gpu = Gpu::with_options(&GpuOptions { memory_budget: Some(4 << 20), ..Default::default() }).unwrap();
    assert_eq!(gpu.memory_budget(), Some(4 << 20));
    let a = Engine::new(&gpu, &w, EngineOptions::new(2, 64)).unwrap();
    let used = gpu.memory_in_use();
    assert!(used > 0 && used < 4 << 20, "{used}");
    let msg = Engine::new(&gpu, &w, EngineOptions::new(64, 4096)).err().unwrap().to_string();
    assert!(msg.contains("out of GPU memory") && msg.contains("of the 4.0 MiB budget"), "{msg}");
    assert_eq!(gpu.memory_in_use(), used);
    drop(a);
    assert_eq!(gpu.memory_in_use(), 0, "dropping an engine gives its budget back");
}

#[test]
fn a_lost_device_is_an_error_on_every_later_call_and_a_new_one_works() {
    let w = model(&tiny_agent_cfg(), 4);
    let gpu = own_gpu();
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(3, 32)).unwrap();
    e.append(&[1, 2, 3, 4, 5, 6], 2, &[2, 2, 2], None).unwrap();
    gpu.device.destroy();
    let lost = |r: Result<(), Error>, what: &str| {
        let err = r.err().unwrap_or_else(|| panic!("{what} succeeded on a lost device"));
        assert!(matches!(err, Error::DeviceLost(_)), "{what}: {err}");
        assert!(err.to_string().contains("device lost") && err.to_string().contains("create a new Gpu"), "{err}");
    };
    lost(e.append(&[7, 8, 9], 1, &[1, 1, 1], None).map(|_| ()), "append");
    lost(e.append_sample(&[7], 1, &[1], Some(&[0]), &[Sampler::GREEDY]).map(|_| ()), "append_sample");
    lost(e.decode_steps(&[0], &[7], &[Sampler::GREEDY], 2).map(|_| ()), "decode_steps");
    lost(e.feed(&[7], 1, &[1], Some(&[1])), "feed");
    lost(e.reset(&[0]), "reset");
    lost(e.fork(0, &[1]), "fork");
    lost(e.rollback(&[0], &[1]), "rollback");
    lost(Engine::new(&gpu, &w, EngineOptions::new(1, 8)).map(|_| ()), "Engine::new on the lost device");
    assert_eq!(e.cache().lens(), &[2, 2, 2], "nothing changed");
    drop(e);
    // rebuilt on a new device, the engine decodes correctly again
    let gpu2 = own_gpu();
    let mut e2 = Engine::new(&gpu2, &w, EngineOptions::new(3, 32)).unwrap();
    let out = e2.append(&[1, 2, 3, 0, 0, 0, 0, 0, 0], 3, &[3, 0, 0], None).unwrap();
    assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&w, &[1, 2, 3])) <= 1e-4);
}

#[test]
fn validation_errors_come_back_as_errors_not_panics() {
    let gpu = own_gpu();
    let w = model(&llama_cfg(), 5);
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(1, 16)).unwrap();
    // a misuse of wgpu outside any scope (mapping a buffer that cannot be mapped) would panic in
    // wgpu's default handler; here it is recorded and the next call reports it once
    let bad = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("not mappable"),
        size: 16,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    bad.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    let _ = gpu.device.poll(wgpu::PollType::wait_indefinitely());
    let err = e.append(&[1], 1, &[1], None).expect_err("the recorded validation error is reported");
    assert!(matches!(err, Error::Device(_)) && err.to_string().contains("the GPU reported an error"), "{err}");
    // reported once; the engine keeps working
    let out = e.append(&[1], 1, &[1], None).unwrap();
    assert!(max_abs_diff(out.row(0).unwrap(), &ref_last(&w, &[1])) <= 1e-4);
}
