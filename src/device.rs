//! Adapter and device acquisition.

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
    /// Use only the portable path: request no optional feature, so the subgroup fast path is off.
    /// Defaults to the `KVDECODE_PORTABLE` environment variable being `1` (CI runs the suite both
    /// ways).
    pub portable: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        let portable = std::env::var("KVDECODE_PORTABLE").is_ok_and(|v| v == "1");
        GpuOptions { webgpu_default_limits: true, max_storage_binding: None, portable }
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
    /// The limits the device was created with.
    pub limits: wgpu::Limits,
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
        pollster::block_on(Self::new_async(opts))
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
        let mut limits = if opts.webgpu_default_limits { wgpu::Limits::default() } else { adapter.limits() };
        if let Some(max) = opts.max_storage_binding {
            limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(max);
        }
        // optional fast paths: subgroups, when the adapter has them with a fixed subgroup size
        // (the subgroup matmul's workgroup is one subgroup) and the caller did not ask for the
        // portable path
        let fixed = info.subgroup_min_size == info.subgroup_max_size && info.subgroup_min_size >= 4;
        let fast_features = if !opts.portable && fixed && adapter.features().contains(wgpu::Features::SUBGROUP) {
            wgpu::Features::SUBGROUP
        } else {
            wgpu::Features::empty()
        };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("kvdecode"),
                required_features: fast_features,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| Error::Device(format!("adapter {} refused a device: {e}", info.name)))?;
        Ok(Gpu { device, queue, info, limits })
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
        self.device.features().contains(wgpu::Features::SUBGROUP).then_some(self.info.subgroup_min_size)
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
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size.max(16).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        }))
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
