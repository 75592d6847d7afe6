//! Timestamp profiling: a profiled step times every dispatch it ran, per kernel class (inside the
//! step's one pass where the device writes timestamps there), and is a real step (the engine's
//! results afterwards are bit for bit those of an unprofiled engine).
//! Adapters without timestamp queries (Mesa's GL) get an error naming the feature instead.

mod common;

use common::{gpu, model, tiny_agent_cfg};
use kvdecode::{Engine, EngineOptions, Error, Sampler};

#[test]
fn profiled_steps_time_every_dispatch_and_change_no_result() {
    let gpu = gpu();
    let w = model(&tiny_agent_cfg(), 31);
    let mut plain = Engine::new(&gpu, &w, EngineOptions::new(2, 64)).unwrap();
    let mut profiled = Engine::new(&gpu, &w, EngineOptions::new(2, 64)).unwrap();
    let prompt = [5u32, 9, 13, 2, 7, 0];
    plain.append(&prompt, 3, &[3, 2], None).unwrap();
    profiled.append(&prompt, 3, &[3, 2], None).unwrap();
    let greedy = [Sampler::GREEDY; 2];
    let step = [17u32, 4];
    let before = plain.stats().dispatches;
    plain.append_sample(&step, 1, &[1, 1], None, &greedy).unwrap();
    let per_step = plain.stats().dispatches - before;

    let got = profiled.profile_step(&step, 1, &[1, 1], None, Some(&greedy));
    if !gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY) {
        let err = got.expect_err("no timestamp queries: profiling must be refused");
        assert!(matches!(&err, Error::Device(m) if m.contains("TIMESTAMP_QUERY")), "{err}");
        assert!(profiled.copy_bandwidth(1 << 20).is_err());
        return;
    }
    let p = got.unwrap();
    println!("{p:?}");
    assert_eq!(p.dispatches as u64, per_step, "every dispatch of the step is timed");
    let inside = gpu.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);
    assert_eq!(p.in_one_pass, inside && std::env::var("KVDECODE_PROFILE_PASSES").as_deref() != Ok("each"));
    assert!(p.matmul > 0.0 && p.attention > 0.0 && p.other > 0.0, "{p:?}");
    assert!(p.total() < 10.0, "{p:?}");
    // the profiled step was a real step: the same state, the same next logits, bit for bit
    assert_eq!(plain.cache().lens(), profiled.cache().lens());
    let a = plain.append(&[3, 8], 1, &[1, 1], None).unwrap();
    let b = profiled.append(&[3, 8], 1, &[1, 1], None).unwrap();
    assert!(a.data.iter().zip(&b.data).all(|(x, y)| x.to_bits() == y.to_bits()));
    // one chunk at most, checked before anything runs
    let wide = vec![1u32; 2 * (profiled.chunk_width() + 1)];
    let err = profiled.profile_step(&wide, profiled.chunk_width() + 1, &[1, 1], None, None).unwrap_err();
    assert!(err.to_string().contains("more than one chunk"), "{err}");
    let err = profiled.profile_step(&step, 1, &[1, 1], None, Some(&greedy[..1])).unwrap_err();
    assert!(err.to_string().contains("1 samplers for 2 chunk rows"), "{err}");
    assert_eq!(plain.cache().lens(), profiled.cache().lens());
    let bw = profiled.copy_bandwidth(8 << 20).unwrap();
    println!("copy bandwidth {:.2} GB/s", bw / 1e9);
    assert!(bw > 1e6, "{bw}");
}
