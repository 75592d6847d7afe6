//! Adapter and device acquisition, and the device's health: a lost device and errors no error
//! scope caught are recorded (never panics from wgpu's default handler) and returned as errors by
//! the next call.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Options for [`Gpu::new`].
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Request exactly `wgpu::Limits::default()` (the WebGPU defaults) instead of the adapter's
    /// limits. The engine splits tensors to fit either way; this proves it.
    pub webgpu_default_limits: bool,
    /// Lower `max_storage_buffer_binding_size` to this many bytes (tests use it to force every
    /// split: weight row parts, cache shards, narrower chunks).
    pub max_storage_binding: Option<u64>,
    /// Use only the portable kernels: request no optional kernel feature, so the subgroup fast
    /// path is off (timestamp queries, which change no kernel, are still requested when present).
    /// Defaults to the `KVDECODE_PORTABLE` environment variable being `1` (CI runs the suite both
    /// ways).
    pub portable: bool,
    /// Most bytes of buffers the engines on this device may hold together; creating more is an
    /// out-of-memory error at `Engine::new`. `None`: for adapters that are really the CPU
    /// (lavapipe, llvmpipe, SwiftShader), 90% of the memory available when the `Gpu` is created
    /// (their drivers commit memory lazily, so they accept any size and fail only when it is
    /// touched); for GPUs, the driver's own out-of-memory errors, caught by error scopes.
    pub memory_budget: Option<u64>,
}

impl Default for GpuOptions {
    fn default() -> Self {
        let portable = std::env::var("KVDECODE_PORTABLE").is_ok_and(|v| v == "1");
        GpuOptions { webgpu_default_limits: true, max_storage_binding: None, portable, memory_budget: None }
    }
}

/// A device and its queue, plus what we learned about the adapter.
#[derive(Clone, Debug)]
pub struct Gpu {
    /// The wgpu device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// Adapter name, backend and driver.
    pub info: wgpu::AdapterInfo,
    /// The limits the device was created with (less `GpuOptions::max_storage_binding`).
    pub limits: wgpu::Limits,
    /// Lanes of the subgroup fast path, when the device has it.
    subgroups: Option<u32>,
    health: Arc<Mutex<Health>>,
    memory: Arc<Mutex<Memory>>,
    /// The device's shader modules and pipelines, shared by its engines.
    pub(crate) pipelines: Arc<crate::gpu::shaders::Pipelines>,
}

/// Bytes of buffers engines hold on this device, against the budget (if any).
#[derive(Debug, Default)]
struct Memory {
    budget: Option<u64>,
    in_use: u64,
}

/// Memory the OS can give this process now (Linux `MemAvailable`); `None` where unknown.
fn host_memory_available() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// What the device told us outside any call: that it was lost, or errors no scope caught.
#[derive(Debug, Default)]
struct Health {
    lost: Option<String>,
    uncaptured: Vec<String>,
}

/// The app's own handlers, which kvdecode's handlers call after recording (see
/// [`Gpu::from_device_with`]).
#[derive(Clone, Default)]
pub struct AppHandlers {
    /// Called with every error no error scope caught.
    pub on_uncaptured_error: Option<Arc<dyn wgpu::UncapturedErrorHandler>>,
    /// Called once when the device is lost.
    pub on_device_lost: Option<Arc<dyn Fn(wgpu::DeviceLostReason, String) + Send + Sync>>,
}

impl std::fmt::Debug for AppHandlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppHandlers")
            .field("on_uncaptured_error", &self.on_uncaptured_error.is_some())
            .field("on_device_lost", &self.on_device_lost.is_some())
            .finish()
    }
}

/// Whether the adapter's subgroups have one fixed size of at least 4 lanes (the subgroup
/// products' workgroup is one subgroup).
fn fixed_subgroups(info: &wgpu::AdapterInfo) -> bool {
    info.subgroup_min_size == info.subgroup_max_size && info.subgroup_min_size >= 4
}

/// Each limit of `have` below what kvdecode's kernels rely on, named as wgpu names it: the
/// WebGPU defaults (what the test suite runs with) for everything a compute kernel touches.
/// Binding and buffer sizes are left out: the engine splits tensors to fit them.
fn missing_limits(have: &wgpu::Limits) -> Vec<String> {
    let d = wgpu::Limits::default();
    let needed = wgpu::Limits {
        max_bind_groups: d.max_bind_groups,
        max_bindings_per_bind_group: d.max_bindings_per_bind_group,
        max_storage_buffers_per_shader_stage: d.max_storage_buffers_per_shader_stage,
        max_uniform_buffers_per_shader_stage: d.max_uniform_buffers_per_shader_stage,
        max_uniform_buffer_binding_size: d.max_uniform_buffer_binding_size,
        min_uniform_buffer_offset_alignment: d.min_uniform_buffer_offset_alignment,
        min_storage_buffer_offset_alignment: d.min_storage_buffer_offset_alignment,
        max_compute_workgroup_storage_size: d.max_compute_workgroup_storage_size,
        max_compute_invocations_per_workgroup: d.max_compute_invocations_per_workgroup,
        max_compute_workgroup_size_x: d.max_compute_workgroup_size_x,
        max_compute_workgroup_size_y: d.max_compute_workgroup_size_y,
        max_compute_workgroup_size_z: d.max_compute_workgroup_size_z,
        max_compute_workgroups_per_dimension: d.max_compute_workgroups_per_dimension,
        ..have.clone()
    };
    let mut short = Vec::new();
    needed.check_limits_with_fail_fn(have, false, |name, need, has| {
        short.push(format!("{name} is {has}, kvdecode needs {need}"))
    });
    short
}

const INSTALL_HINT: &str = "install a Vulkan driver (Debian/Ubuntu: `apt-get install mesa-vulkan-drivers` \
     for lavapipe, Mesa's CPU Vulkan) or pick another backend with WGPU_BACKEND=vulkan|gl|metal|dx12";

impl Gpu {
    /// Acquire an adapter on the native backends (honouring `WGPU_BACKEND`) and create a device
    /// that needs neither `shader-f16` nor subgroups. Blocks until done (native only; the browser
    /// uses [`Gpu::new_async`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Self> {
        Self::with_options(&GpuOptions::default())
    }

    /// [`Gpu::new`] with options.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_options(opts: &GpuOptions) -> Result<Self> {
        crate::gpu::pending::block_on(Self::new_async(opts))
    }

    /// Async construction (the form the browser needs).
    pub async fn new_async(opts: &GpuOptions) -> Result<Self> {
        // WGPU_BACKEND picks the backends; otherwise the primary ones (Vulkan, Metal, DX12) and, only
        // if none has an adapter, GL (probing GL first prints EGL noise on headless machines).
        let tries = match std::env::var("WGPU_BACKEND") {
            Ok(env) => {
                let chosen = wgpu::Backends::from_comma_list(&env);
                if chosen.is_empty() {
                    return Err(Error::Device(format!(
                        "WGPU_BACKEND={env:?} names no known backend (use vulkan, gl, metal, dx12 or webgpu)"
                    )));
                }
                vec![chosen]
            }
            Err(_) => vec![wgpu::Backends::PRIMARY | wgpu::Backends::BROWSER_WEBGPU, wgpu::Backends::SECONDARY],
        };
        let mut failures = Vec::new();
        let mut found = None;
        for backends in tries {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
            desc.backends = backends;
            // Resource creation past 90% of the driver's memory budget is an out-of-memory error
            // (Vulkan, VK_EXT_memory_budget): drivers that commit memory lazily, lavapipe among
            // them, would otherwise accept any engine and fail later, when it is touched.
            desc.memory_budget_thresholds.for_resource_creation = Some(90);
            let instance = wgpu::Instance::new(desc);
            match instance
                .request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::HighPerformance,
                    ..Default::default()
                })
                .await
            {
                Ok(a) => {
                    found = Some(a);
                    break;
                }
                Err(e) => failures.push(format!("{backends:?}: {e}")),
            }
        }
        let adapter = found
            .ok_or_else(|| Error::Device(format!("no GPU adapter found ({}); {INSTALL_HINT}", failures.join("; "))))?;
        let info = adapter.get_info();
        let (required_features, required_limits) = Self::device_requirements(&adapter, opts);
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("kvdecode"),
                required_features,
                required_limits,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::Device(format!("adapter {} refused a device: {e}", info.name)))?;
        Self::from_device_with(info, device, queue, opts, AppHandlers::default())
    }

    /// A `Gpu` that runs nothing but says it is a discrete GPU with subgroups of
    /// `subgroup_size` lanes (wgpu's noop backend: buffers hold their bytes, dispatches are
    /// dropped). An engine built on it picks the kernels such a GPU gets, so
    /// [`crate::Engine::occupancy`] gives that GPU's table on a machine without one.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn dry_run(subgroup_size: u32) -> Result<Self> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::NOOP;
        desc.backend_options.noop = wgpu::NoopBackendOptions {
            enable: true,
            device_type: Some(wgpu::DeviceType::DiscreteGpu),
            subgroup_min_size: Some(subgroup_size),
            subgroup_max_size: Some(subgroup_size),
            ..Default::default()
        };
        let instance = wgpu::Instance::new(desc);
        use crate::gpu::pending::block_on;
        let adapter = block_on(instance.request_adapter(&Default::default()))
            .map_err(|e| Error::Device(format!("wgpu's noop backend gave no adapter: {e}")))?;
        let mut info = adapter.get_info();
        // wgpu 30's noop adapter says Cpu whatever it was told; the kernel choice reads this
        info.device_type = wgpu::DeviceType::DiscreteGpu;
        info.name = format!("dry run: a discrete GPU with {subgroup_size}-lane subgroups (wgpu's noop backend)");
        let (required_features, required_limits) = Self::device_requirements(&adapter, &GpuOptions::default());
        let (device, queue) = block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kvdecode dry run"),
            required_features,
            required_limits,
            ..Default::default()
        }))
        .map_err(|e| Error::Device(format!("wgpu's noop backend refused a device: {e}")))?;
        Self::from_device(info, device, queue)
    }

    /// The features and limits kvdecode asks of `adapter` when it makes its own device: an app
    /// that makes the device ([`Gpu::from_device`]) puts them in its `wgpu::DeviceDescriptor`
    /// (raising any limit its own drawing needs) to get the kernels kvdecode would pick.
    /// - Features: subgroups, where the adapter has them with one fixed subgroup size (the
    ///   subgroup products' workgroup is one subgroup) and `opts` is not portable; timestamp
    ///   queries, and inside passes, where present (they change no kernel; the bench times
    ///   kernels with them).
    /// - Limits: the WebGPU defaults (or the adapter's own, see
    ///   [`GpuOptions::webgpu_default_limits`]), with `max_storage_binding` applied.
    pub fn device_requirements(adapter: &wgpu::Adapter, opts: &GpuOptions) -> (wgpu::Features, wgpu::Limits) {
        let info = adapter.get_info();
        let mut limits = if opts.webgpu_default_limits { wgpu::Limits::default() } else { adapter.limits() };
        if let Some(max) = opts.max_storage_binding {
            limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(max);
        }
        let fast = !opts.portable && fixed_subgroups(&info) && adapter.features().contains(wgpu::Features::SUBGROUP);
        let features = if fast { wgpu::Features::SUBGROUP } else { wgpu::Features::empty() };
        let timing = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        (features | (adapter.features() & timing), limits)
    }

    /// A `Gpu` on a device the app made and keeps using (its UI draws on it, say), so buffers
    /// can pass between them and memory is one budget. [`Gpu::from_device_with`] with the
    /// default options and no handler of the app's to chain.
    pub fn from_device(adapter_info: wgpu::AdapterInfo, device: wgpu::Device, queue: wgpu::Queue) -> Result<Self> {
        Self::from_device_with(adapter_info, device, queue, &GpuOptions::default(), AppHandlers::default())
    }

    /// A `Gpu` on the app's own device.
    ///
    /// - **Checked first:** every limit kvdecode's kernels rely on (the WebGPU defaults the test
    ///   suite runs with: bind groups, storage and uniform buffers per stage, workgroup sizes,
    ///   workgroup memory, dispatch size, offset alignments). A device made with less is an
    ///   [`Error::Limit`] naming each such limit, and nothing is installed on the device.
    ///   Binding and buffer sizes are the device's own: the engine splits tensors to fit, and
    ///   what cannot fit is an error at [`crate::Engine::new`] that names the limit.
    /// - **Kernel variants** follow what the device was created with: the subgroup products
    ///   only if it has `wgpu::Features::SUBGROUP` (and the adapter one fixed subgroup size, and
    ///   `opts` is not portable). A variant forced onto a device without its feature is a
    ///   named error when the engine is built. See [`Gpu::device_requirements`].
    /// - **Handlers:** wgpu keeps one uncaptured-error handler and one device-lost callback per
    ///   device, and cannot hand back the ones set. This installs kvdecode's (they record what
    ///   [`Gpu::check`] reports), which then call the app's in `handlers`. An app that set its
    ///   own before passes them here; one it sets after this call replaces kvdecode's, and then
    ///   a lost device shows only as failed calls. An error no scope caught, from the app's
    ///   drawing as well, fails the engine's next call once: it may have hit shared state.
    /// - Make one `Gpu` per device and clone it for each engine: clones share the pipelines
    ///   and the memory count.
    pub fn from_device_with(
        adapter_info: wgpu::AdapterInfo,
        device: wgpu::Device,
        queue: wgpu::Queue,
        opts: &GpuOptions,
        handlers: AppHandlers,
    ) -> Result<Self> {
        let device_limits = device.limits();
        let short = missing_limits(&device_limits);
        if !short.is_empty() {
            return Err(Error::Limit(format!(
                "the device was created with limits too small for kvdecode: {} (request Gpu::device_requirements' \
                 limits, or wgpu::Limits::default())",
                short.join("; ")
            )));
        }
        let mut limits = device_limits;
        if let Some(max) = opts.max_storage_binding {
            limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(max);
        }
        let subgroups =
            (!opts.portable && fixed_subgroups(&adapter_info) && device.features().contains(wgpu::Features::SUBGROUP))
                .then_some(adapter_info.subgroup_min_size);
        let health = Arc::new(Mutex::new(Health::default()));
        let h = health.clone();
        let AppHandlers { on_uncaptured_error, on_device_lost } = handlers;
        device.set_device_lost_callback(move |reason, msg| {
            if let Ok(mut h) = h.lock() {
                h.lost = Some(format!("{reason:?}: {msg}"));
            }
            if let Some(app) = &on_device_lost {
                app(reason, msg);
            }
        });
        // wgpu's default handler panics; an engine reports errors instead
        let h = health.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut h) = h.lock() {
                h.uncaptured.push(e.to_string());
            }
            if let Some(app) = &on_uncaptured_error {
                app(e);
            }
        }));
        let budget = opts.memory_budget.or_else(|| {
            (adapter_info.device_type == wgpu::DeviceType::Cpu)
                .then(host_memory_available)
                .flatten()
                .map(|b| b / 10 * 9)
        });
        let memory = Arc::new(Mutex::new(Memory { budget, in_use: 0 }));
        let pipelines = Arc::new(crate::gpu::shaders::Pipelines::new(&device));
        Ok(Gpu { device, queue, info: adapter_info, limits, subgroups, health, memory, pipelines })
    }

    /// The budget engines on this device share, in bytes (see [`GpuOptions::memory_budget`]).
    pub fn memory_budget(&self) -> Option<u64> {
        self.memory.lock().ok().and_then(|m| m.budget)
    }

    /// Bytes of buffers the engines on this device hold now.
    pub fn memory_in_use(&self) -> u64 {
        self.memory.lock().map(|m| m.in_use).unwrap_or(0)
    }

    /// Error unless `bytes` more fit in the memory budget; `what` says what needs them.
    pub(crate) fn check_budget(&self, bytes: u64, what: &str) -> Result<()> {
        let m = self.memory.lock().map_err(|_| Error::Device("memory lock poisoned".into()))?;
        match m.budget {
            Some(budget) if m.in_use.saturating_add(bytes) > budget => {
                let mib = |b: u64| b as f64 / (1 << 20) as f64;
                Err(Error::Device(format!(
                    "out of GPU memory: {what} needs {:.1} MiB, {:.1} MiB of the {:.1} MiB budget are free \
                     (GpuOptions::memory_budget)",
                    mib(bytes),
                    mib(budget.saturating_sub(m.in_use)),
                    mib(budget)
                )))
            }
            _ => Ok(()),
        }
    }

    /// Give back `bytes` of the budget (an engine that was dropped, or failed to build).
    pub(crate) fn release(&self, bytes: u64) {
        if let Ok(mut m) = self.memory.lock() {
            m.in_use = m.in_use.saturating_sub(bytes);
        }
    }

    /// A buffer of `size` bytes counted against the memory budget; the error names it.
    pub(crate) fn buffer(&self, label: &str, size: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer> {
        {
            let mut m = self.memory.lock().map_err(|_| Error::Device("memory lock poisoned".into()))?;
            if let Some(budget) = m.budget.filter(|&b| m.in_use.saturating_add(size) > b) {
                return Err(Error::Device(format!(
                    "out of GPU memory: {label} needs {size} bytes, {} of the {budget}-byte budget are in use \
                     (GpuOptions::memory_budget)",
                    m.in_use
                )));
            }
            m.in_use += size;
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: false,
        }))
    }

    /// `Ok` while the device is usable. A lost device (driver reset, `Device::destroy`, a browser
    /// that reclaimed the GPU) is [`Error::DeviceLost`] from then on: build a new `Gpu` and
    /// `Engine`. An error no scope caught since the last call (a validation error, out of memory
    /// while running) is returned once as [`Error::Device`].
    pub fn check(&self) -> Result<()> {
        // natively, callbacks (the device-lost one among them) run inside poll; a non-blocking
        // poll lets a loss that already happened be seen before this call changes anything
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.device.poll(wgpu::PollType::Poll);
        let mut h = self.health.lock().map_err(|_| Error::Device("device health lock poisoned".into()))?;
        if let Some(why) = &h.lost {
            return Err(Error::DeviceLost(why.clone()));
        }
        if !h.uncaptured.is_empty() {
            let all = std::mem::take(&mut h.uncaptured).join("; ");
            return Err(Error::Device(format!("the GPU reported an error: {all}")));
        }
        Ok(())
    }

    /// Whether the device was lost (unlike [`Gpu::check`], it leaves errors not yet reported for
    /// the next `check`). Owners of a shared `Gpu` use it to decide whether to make a new one.
    pub fn is_lost(&self) -> bool {
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.device.poll(wgpu::PollType::Poll);
        self.health.lock().map(|h| h.lost.is_some()).unwrap_or(true)
    }

    /// One line describing the adapter, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) on Vulkan (llvmpipe)`.
    /// Browsers often hide the adapter's name; then the device type stands in for it.
    pub fn describe(&self) -> String {
        let name = if self.info.name.is_empty() {
            format!("{:?} adapter", self.info.device_type)
        } else {
            self.info.name.clone()
        };
        if self.info.driver.is_empty() {
            format!("{name} on {:?}", self.info.backend)
        } else {
            format!("{name} on {:?} ({})", self.info.backend, self.info.driver)
        }
    }

    /// The subgroup size of the fast path, when the device has one (`None`: portable path).
    pub fn subgroup_size(&self) -> Option<u32> {
        self.subgroups
    }

    /// Largest storage binding, in bytes.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size
    }
}

impl Gpu {
    /// A zeroed storage buffer of `size` bytes that fits one binding; the error names it.
    pub(crate) fn storage(&self, label: &str, size: u64) -> Result<wgpu::Buffer> {
        self.check_binding(label, size)?;
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
        self.buffer(label, size.max(16).next_multiple_of(4), usage)
    }

    /// A storage buffer holding `data` (padded to at least 16 bytes).
    pub(crate) fn storage_init(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let buf = self.storage(label, data.len() as u64)?;
        if !data.is_empty() {
            let mut padded;
            let bytes = if !data.len().is_multiple_of(4) {
                padded = data.to_vec();
                padded.resize(data.len().next_multiple_of(4), 0);
                &padded[..]
            } else {
                data
            };
            self.queue.write_buffer(&buf, 0, bytes);
        }
        Ok(buf)
    }

    /// Error unless `size` bytes fit in one storage binding.
    pub(crate) fn check_binding(&self, label: &str, size: u64) -> Result<()> {
        if size > self.max_binding() {
            return Err(Error::Limit(format!(
                "{label} needs {size} bytes in one binding, the device allows {} (max_storage_buffer_binding_size)",
                self.max_binding()
            )));
        }
        Ok(())
    }
}
