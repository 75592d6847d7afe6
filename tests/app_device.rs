//! kvdecode on a device an app made (`Gpu::from_device`): the app requests its own adapter and
//! device, as an egui or Bevy app does, and kvdecode's kernels run on it with the same bits as on
//! a device kvdecode made; a device short of a limit or feature is refused by name with nothing
//! changed; the app's error handlers keep being called; engines beside the app's own drawing count
//! their memory once; and a step run through `Pending` hands control back before the GPU is done.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{llama_cfg, max_abs_diff, model, ref_last};
use kvdecode::gpu::variants::MatmulKernel;
use kvdecode::{wgpu, AppHandlers, Engine, EngineOptions, Error, Gpu, GpuOptions, Pending, Sampler};

/// What an app does: its own instance and adapter (the backends `WGPU_BACKEND` names, as CI's GL
/// run sets it), then a device with the features and limits it chooses.
fn app_device(
    choose: impl Fn(&wgpu::Adapter) -> (wgpu::Features, wgpu::Limits),
) -> (wgpu::AdapterInfo, wgpu::Device, wgpu::Queue) {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
        .unwrap_or_else(|e| panic!("no GPU adapter for the test: {e}"));
    let (required_features, required_limits) = choose(&adapter);
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("the app's device"),
        required_features,
        required_limits,
        ..Default::default()
    }))
    .expect("the app's device");
    (adapter.get_info(), device, queue)
}

/// The app's device with what kvdecode asks for, and what the app's drawing needs on top.
fn app_device_for_kvdecode() -> (wgpu::AdapterInfo, wgpu::Device, wgpu::Queue) {
    app_device(|adapter| {
        let (features, limits) = Gpu::device_requirements(adapter, &GpuOptions::default());
        (features, wgpu::Limits { max_texture_dimension_2d: 4096, ..limits })
    })
}

/// The app drawing a frame: a render target cleared by a render pass, as a UI's frame is.
fn draw_a_frame(device: &wgpu::Device, queue: &wgpu::Queue) -> wgpu::Texture {
    let texture = device.create_texture(&wgpu::TextureDescriptor {
        label: Some("the app's frame"),
        size: wgpu::Extent3d { width: 512, height: 512, depth_or_array_layers: 1 },
        mip_level_count: 1,
        sample_count: 1,
        dimension: wgpu::TextureDimension::D2,
        format: wgpu::TextureFormat::Rgba8Unorm,
        usage: wgpu::TextureUsages::RENDER_ATTACHMENT,
        view_formats: &[],
    });
    let view = texture.create_view(&Default::default());
    let mut enc = device.create_command_encoder(&Default::default());
    enc.begin_render_pass(&wgpu::RenderPassDescriptor {
        label: Some("clear"),
        color_attachments: &[Some(wgpu::RenderPassColorAttachment {
            view: &view,
            depth_slice: None,
            resolve_target: None,
            ops: wgpu::Operations { load: wgpu::LoadOp::Clear(wgpu::Color::BLUE), store: wgpu::StoreOp::Store },
        })],
        ..Default::default()
    });
    queue.submit([enc.finish()]);
    texture
}

/// Prompts of three rows, right-padded to the longest.
const PROMPTS: [&[u32]; 3] = [&[5, 17, 3, 40, 2], &[9, 9, 1], &[33, 12, 7, 7]];

fn padded(prompts: &[&[u32]]) -> (Vec<u32>, usize, Vec<usize>) {
    let width = prompts.iter().map(|p| p.len()).max().unwrap_or(1);
    let mut ids = vec![0u32; prompts.len() * width];
    for (r, p) in prompts.iter().enumerate() {
        ids[r * width..r * width + p.len()].copy_from_slice(p);
    }
    (ids, width, prompts.iter().map(|p| p.len()).collect())
}

#[test]
fn an_apps_device_gives_the_bits_of_kvdecodes_own() {
    let (info, device, queue) = app_device_for_kvdecode();
    let _frame = draw_a_frame(&device, &queue);
    let app = Gpu::from_device(info, device, queue).expect("a device with kvdecode's requirements");
    let own = common::gpu();
    assert_eq!(app.subgroup_size(), own.subgroup_size(), "the same features give the same kernel variants");
    let w = model(&llama_cfg(), 41);
    let (ids, width, n_new) = padded(&PROMPTS);
    let mut crowd = Engine::new(&app, &w, EngineOptions::new(3, 40)).expect("engine on the app's device");
    assert_eq!(crowd.matmul_kernel(), Engine::new(&own, &w, EngineOptions::new(1, 8)).unwrap().matmul_kernel());
    let in_crowd = crowd.append(&ids, width, &n_new, None).expect("append");
    // parity: each row against the CPU reference
    for (r, p) in PROMPTS.iter().enumerate() {
        let diff = max_abs_diff(in_crowd.row(r).unwrap(), &ref_last(&w, p));
        assert!(diff < 2e-4, "row {r}: |app device - reference| = {diff}");
    }
    // batch invariance: row 1 alone, on the app's device and on kvdecode's own, the crowd's bits
    for gpu in [&app, &own] {
        let mut alone = Engine::new(gpu, &w, EngineOptions::new(1, 40)).unwrap();
        let (ids1, width1, n1) = padded(&PROMPTS[1..2]);
        let got = alone.append(&ids1, width1, &n1, None).unwrap();
        assert_eq!(got.row(0).unwrap(), in_crowd.row(1).unwrap(), "row 1 alone on {}", gpu.describe());
    }
    // and decoding on from there: the same tokens as kvdecode's own device
    let greedy = [Sampler::GREEDY; 3];
    let first: Vec<u32> = (0..3).map(|r| kvdecode::argmax(in_crowd.row(r).unwrap()) as u32).collect();
    let on_app = crowd.decode_steps(&[0, 1, 2], &first, &greedy, 6).unwrap();
    let mut theirs = Engine::new(&own, &w, EngineOptions::new(3, 40)).unwrap();
    theirs.append(&ids, width, &n_new, None).unwrap();
    assert_eq!(on_app, theirs.decode_steps(&[0, 1, 2], &first, &greedy, 6).unwrap());
    app.check().expect("no error on the app's device");
}

#[test]
fn a_device_short_of_a_limit_is_refused_by_name_and_left_as_it_was() {
    // the app's drawing limits only (WebGL 2's): no storage buffers in compute at all
    let (info, device, queue) = app_device(|_| (wgpu::Features::empty(), wgpu::Limits::downlevel_webgl2_defaults()));
    let app_errors = Arc::new(AtomicUsize::new(0));
    let seen = app_errors.clone();
    device.on_uncaptured_error(Arc::new(move |_| {
        seen.fetch_add(1, Ordering::SeqCst);
    }));
    let err = Gpu::from_device(info, device.clone(), queue).expect_err("WebGL 2 limits are too small");
    let msg = err.to_string();
    println!("{msg}");
    assert!(matches!(err, Error::Limit(_)), "{err:?}");
    for named in ["max_storage_buffers_per_shader_stage", "max_compute_invocations_per_workgroup"] {
        assert!(msg.contains(named), "the error names {named}: {msg}");
    }
    // nothing was installed: the app's handler still gets the app's errors
    let _bad = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("invalid on purpose"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let _ = device.poll(wgpu::PollType::wait_indefinitely());
    assert_eq!(app_errors.load(Ordering::SeqCst), 1, "the app's handler saw its own error");
}

#[test]
fn a_variant_without_its_feature_is_refused_by_name() {
    // enough limits, but no subgroups: the subgroup products cannot run
    let (info, device, queue) = app_device(|_| (wgpu::Features::empty(), wgpu::Limits::default()));
    let gpu = Gpu::from_device(info, device, queue).expect("the limits are enough");
    assert_eq!(gpu.subgroup_size(), None, "a device without the feature gets no subgroup kernels");
    let w = model(&llama_cfg(), 3);
    let opts = EngineOptions { matmul: Some(MatmulKernel::Subgroup), ..EngineOptions::new(1, 16) };
    let Err(err) = Engine::new(&gpu, &w, opts) else { panic!("the subgroup products need the feature") };
    println!("{err}");
    assert!(err.to_string().contains("wgpu::Features::SUBGROUP"), "{err}");
    assert_eq!(gpu.memory_in_use(), 0, "the refused engine holds nothing");
    // the variants the device can run work
    let mut e = Engine::new(&gpu, &w, EngineOptions::new(1, 16)).expect("an engine on what the device has");
    let got = e.append(&[4, 5, 6], 3, &[3], None).unwrap();
    assert!(max_abs_diff(got.row(0).unwrap(), &ref_last(&w, &[4, 5, 6])) < 2e-4);
}

#[test]
fn the_apps_handlers_are_chained_and_errors_still_reach_the_engine() {
    let (info, device, queue) = app_device_for_kvdecode();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = errors.clone();
    let handlers = AppHandlers {
        on_uncaptured_error: Some(Arc::new(move |e: wgpu::Error| seen.lock().unwrap().push(e.to_string()))),
        on_device_lost: None,
    };
    let gpu = Gpu::from_device_with(info, device.clone(), queue, &GpuOptions::default(), handlers).unwrap();
    let _bad = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("invalid on purpose"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let _ = device.poll(wgpu::PollType::wait_indefinitely());
    assert_eq!(errors.lock().unwrap().len(), 1, "the app's handler was called");
    let err = gpu.check().expect_err("kvdecode recorded it too");
    assert!(err.to_string().contains("invalid on purpose"), "{err}");
    gpu.check().expect("reported once");
}

#[test]
fn two_engines_beside_the_apps_frame_count_their_memory_once() {
    let (info, device, queue) = app_device_for_kvdecode();
    let frame = draw_a_frame(&device, &queue);
    let gpu = Gpu::from_device(info, device, queue).unwrap();
    assert_eq!(gpu.memory_in_use(), 0, "the app's own frame is not kvdecode's");
    let w = model(&llama_cfg(), 5);
    let a = Engine::new(&gpu, &w, EngineOptions::new(2, 64)).unwrap();
    let b = Engine::new(&gpu.clone(), &w, EngineOptions::new(4, 32)).unwrap();
    let (ra, rb) = (a.memory_report(), b.memory_report());
    println!(
        "engine a {} B, engine b {} B, device {} B, allocator {:?}",
        ra.engine_bytes, rb.engine_bytes, rb.device_bytes, rb.allocator
    );
    assert!(ra.engine_bytes > 0 && rb.engine_bytes > 0);
    assert_eq!(rb.device_bytes, ra.engine_bytes + rb.engine_bytes, "each engine's buffers counted once");
    if let Some((allocated, _)) = rb.allocator {
        // the allocator sees everything on the device: both engines and the app's frame
        let frame_bytes = 512 * 512 * 4;
        assert!(allocated >= rb.device_bytes + frame_bytes, "allocator {allocated} B < engines + frame");
    }
    drop(a);
    assert_eq!(b.memory_report().device_bytes, rb.engine_bytes, "a dropped engine's buffers leave the count");
    drop(frame);
}

#[test]
fn a_pending_step_returns_before_the_gpu_is_done_with_the_same_tokens() {
    let (info, device, queue) = app_device_for_kvdecode();
    let gpu = Gpu::from_device(info, device, queue).unwrap();
    let w = model(&llama_cfg(), 9);
    let sampler = Sampler { temperature: 0.8, seed: 7, top_k: 20, top_p: 0.9, ..Sampler::GREEDY };
    let mut blocking = Engine::new(&gpu, &w, EngineOptions::new(1, 64)).unwrap();
    blocking.append(&[3, 1, 4, 1, 5], 5, &[5], None).unwrap();
    let want = blocking.decode_steps(&[0], &[9], &[sampler], 8).unwrap();

    // in parts of 5 dispatches, one part per poll: the same dispatches in the same order
    let opts = EngineOptions { dispatches_per_submit: 5, ..EngineOptions::new(1, 64) };
    let mut engine = Engine::new(&gpu, &w, opts).unwrap();
    engine.append(&[3, 1, 4, 1, 5], 5, &[5], None).unwrap();
    let mut step = Pending::new(&gpu, async move {
        let out = engine.decode_steps_async(&[0], &[9], &[sampler], 8).await;
        (engine, out)
    });
    // the first poll records and submits the steps and returns: the readback's map completes
    // only inside a later poll of the device
    assert!(step.poll().is_none(), "the first poll returned the result: it waited for the GPU");
    let mut polls = 1;
    let (engine, out) = loop {
        polls += 1;
        if let Some(done) = step.poll() {
            break done;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    println!("finished at poll {polls}");
    // 8 steps of several parts each, one part submitted per poll
    assert!(polls > 16, "{polls} polls: the parts were not submitted one per poll");
    assert!(step.is_done() && step.poll().is_none(), "a finished Pending gives its result once");
    let got: Vec<Vec<u32>> = out.unwrap().into_iter().map(|r| r.0).collect();
    assert_eq!(got, want, "the same tokens as the blocking call");
    // a blocking call inside a Pending still waits (and the engine is usable after)
    let mut engine = engine;
    let mut inner = Pending::new(&gpu, async move { engine.decode_steps(&[0], &[1], &[Sampler::GREEDY], 2) });
    assert!(inner.poll().expect("a blocking call finishes in one poll").is_ok());
}
