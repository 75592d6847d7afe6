//! WGSL sources (one file per concept under `shaders/`), their binding layouts, and the pipeline
//! cache keyed by override constants (so no kernel is ever copy-pasted into variants).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::gpu::kernels::Specialize;

const COMMON: &str = include_str!("../../shaders/common.wgsl");
/// The products' bindings and helpers, which every product kernel's module starts with.
const MATMUL: &str =
    concat!(include_str!("../../shaders/matmul.wgsl"), "\n", include_str!("../../shaders/norm_input.wgsl"));
/// The normed input readers the products and the adapters' `A x` share (`inv_rms`, `inputs4`).
const NORM_INPUT: &str = include_str!("../../shaders/norm_input.wgsl");
/// The dense products' epilogue with the LoRA adapters' bindings (every product kernel but the
/// experts', which have no room for two more).
const MATMUL_LORA: &str = include_str!("../../shaders/matmul_lora.wgsl");

/// How a kernel binds one buffer (group 0, in binding order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// `var<uniform>`.
    Uniform,
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
}
use Bind::{Read, ReadWrite, Uniform};

/// Every compute kernel of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Embedding gather (`embed.wgsl`).
    Embed,
    /// RMS norm (`rmsnorm.wgsl`).
    RmsNorm,
    /// Matrix product against a weight part (`matmul.wgsl`), one output per thread.
    Matmul,
    /// The same product, `OUTS` outputs per thread (the `main_wide` entry point of
    /// `matmul.wgsl`): the `wide` shape for CPU adapters.
    MatmulWide,
    /// The same product reading the RMS norm of its input, computed in the workgroup (the
    /// `main_normed` entry point of `matmul.wgsl`): the norm before a product, fused.
    MatmulNormed,
    /// qk-norm + RoPE at per-row positions (`qk_rope.wgsl`).
    QkRope,
    /// Scatter K/V into a global cache or a ring (`kv_write.wgsl`).
    KvWrite,
    /// Attention against the cache (`attention.wgsl`): serial over the keys (the portable
    /// variant), or with `SPLIT` the merge of [`Kernel::AttentionSplit`]'s partitions.
    Attention,
    /// Attention split along the keys, part 1: one workgroup per partition of a query's global
    /// keys, all query heads of a kv head together (`attention_split.wgsl`).
    AttentionSplit,
    /// Attention split along the keys, part 1, one thread per (partition, query head): the
    /// `per_head` entry point of `attention_split.wgsl`.
    AttentionSplitHead,
    /// Attention split along the keys, part 1, for steps of several tokens a row: the
    /// `query_tiles` entry point of `attention_split.wgsl`, a tile of one row's tokens in one
    /// workgroup (each key read once per tile), [`Kernel::AttentionSplit`]'s bits.
    AttentionQueryTiles,
    /// MLP activation (`mlp_act.wgsl`).
    MlpAct,
    /// End-of-chunk bookkeeping: lens, lpos, token history (`commit.wgsl`).
    Commit,
    /// Greedy / temperature sampling, one workgroup a row (`sample.wgsl`): every row without the
    /// split path, and with it the scored positions that truncate or list alternatives.
    Sample,
    /// The split path of sampling, part 1: a workgroup per chunk of a row's vocabulary writes
    /// its partial results (the `chunks` entry point of `sample.wgsl`).
    SampleChunks,
    /// The split path, a radix pass of top-k's or top-p's threshold: a workgroup per chunk adds
    /// its histogram into its row's (the `radix` entry point of `sample.wgsl`, one pipeline a
    /// pass).
    SampleRadix,
    /// The split path, rows that truncate: a workgroup per chunk draws among its kept tokens
    /// (`kept` of `sample.wgsl`).
    SampleKept,
    /// The split path, last: a workgroup per row merges the chunks' results in a fixed order
    /// (`merge` of `sample.wgsl`).
    SampleMerge,
    /// Sparse logit bias added before sampling (`logit_bias.wgsl`).
    LogitBias,
    /// Engram n-gram addresses and table lookup (`engram_gather.wgsl`).
    EngramGather,
    /// Engram gated residual (`engram_mix.wgsl`).
    EngramMix,
    /// Fast path of [`Kernel::Matmul`] with subgroups (`matmul.wgsl` + `matmul_subgroup.wgsl`);
    /// built only on devices with the `subgroups` feature.
    MatmulSubgroup,
    /// The wide product with each block's inputs shared through the subgroup
    /// (`main_wide_subgroup` of `matmul_subgroup.wgsl`): CPU adapters with subgroups of 8 or more.
    MatmulWideSubgroup,
    /// The mat-mat form of [`Kernel::Matmul`] for steps of many tokens (`matmul.wgsl` +
    /// `matmul_tiled.wgsl`): 32 x 32 tiles staged in workgroup memory, the portable bits.
    MatmulTiled,
    /// [`Kernel::MatmulSubgroup`]'s shape without subgroups (`matmul.wgsl` + `matmul_reduce.wgsl`):
    /// a workgroup per output, lanes reading neighbouring weights, their sums in a fixed tree in
    /// workgroup memory.
    MatmulReduce,
    /// A plain copy (`copy.wgsl`): the device's copy bandwidth, the bench's yardstick.
    Copy,
    /// Activations quantized per block of 32 to int8 for [`Kernel::MatmulInt`] (`quantize.wgsl`).
    Quantize,
    /// The integer-dot product (`matmul.wgsl` + `matmul_int.wgsl`): Q8_0 / Q4_0 / Q4_1 weights
    /// against quantized activations with `dot4I8Packed`; built only when asked for.
    MatmulInt,
    /// A mixture of experts' router: each token's top-k experts and their weights (`moe.wgsl`).
    MoeRoute,
    /// The routed experts' products (`matmul.wgsl` + `matmul_experts.wgsl`): each token against
    /// only its experts' rows, the portable kernel's sums.
    MatmulExperts,
    /// LoRA adapters' first half, each token's `A x` with its row's own adapter (`lora.wgsl`);
    /// the products add `B (A x)` as their epilogue (`matmul_lora.wgsl`).
    Lora,
}

impl Kernel {
    /// All kernels.
    pub const ALL: [Kernel; 31] = [
        Kernel::Embed,
        Kernel::RmsNorm,
        Kernel::Matmul,
        Kernel::MatmulWide,
        Kernel::MatmulNormed,
        Kernel::QkRope,
        Kernel::KvWrite,
        Kernel::Attention,
        Kernel::AttentionSplit,
        Kernel::AttentionSplitHead,
        Kernel::AttentionQueryTiles,
        Kernel::MlpAct,
        Kernel::Commit,
        Kernel::Sample,
        Kernel::SampleChunks,
        Kernel::SampleRadix,
        Kernel::SampleKept,
        Kernel::SampleMerge,
        Kernel::LogitBias,
        Kernel::EngramGather,
        Kernel::EngramMix,
        Kernel::MatmulSubgroup,
        Kernel::MatmulWideSubgroup,
        Kernel::MatmulTiled,
        Kernel::MatmulReduce,
        Kernel::Copy,
        Kernel::Quantize,
        Kernel::MatmulInt,
        Kernel::MoeRoute,
        Kernel::MatmulExperts,
        Kernel::Lora,
    ];

    /// A short name for reports: the WGSL file, and the entry point where two kernels share one.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kernel::AttentionSplitHead => "attention_split.wgsl per_head",
            Kernel::AttentionQueryTiles => "attention_split.wgsl query_tiles",
            Kernel::MatmulWide => "matmul.wgsl main_wide",
            Kernel::MatmulNormed => "matmul.wgsl main_normed",
            Kernel::MatmulSubgroup => "matmul_subgroup.wgsl",
            Kernel::MatmulWideSubgroup => "matmul_subgroup.wgsl main_wide_subgroup",
            Kernel::MatmulTiled => "matmul_tiled.wgsl",
            Kernel::MatmulReduce => "matmul_reduce.wgsl",
            Kernel::MatmulInt => "matmul_int.wgsl",
            Kernel::MatmulExperts => "matmul_experts.wgsl",
            Kernel::SampleChunks => "sample.wgsl chunks",
            Kernel::SampleRadix => "sample.wgsl radix",
            Kernel::SampleKept => "sample.wgsl kept",
            Kernel::SampleMerge => "sample.wgsl merge",
            k => k.file(),
        }
    }

    /// The WGSL file name under `shaders/`.
    pub fn file(self) -> &'static str {
        match self {
            Kernel::Embed => "embed.wgsl",
            Kernel::RmsNorm => "rmsnorm.wgsl",
            Kernel::Matmul | Kernel::MatmulWide | Kernel::MatmulNormed => "matmul.wgsl",
            Kernel::QkRope => "qk_rope.wgsl",
            Kernel::KvWrite => "kv_write.wgsl",
            Kernel::Attention => "attention.wgsl",
            Kernel::AttentionSplit | Kernel::AttentionSplitHead | Kernel::AttentionQueryTiles => "attention_split.wgsl",
            Kernel::MlpAct => "mlp_act.wgsl",
            Kernel::Commit => "commit.wgsl",
            Kernel::Sample | Kernel::SampleChunks | Kernel::SampleRadix | Kernel::SampleKept | Kernel::SampleMerge => {
                "sample.wgsl"
            }
            Kernel::LogitBias => "logit_bias.wgsl",
            Kernel::EngramGather => "engram_gather.wgsl",
            Kernel::EngramMix => "engram_mix.wgsl",
            Kernel::MatmulSubgroup | Kernel::MatmulWideSubgroup => "matmul_subgroup.wgsl",
            Kernel::MatmulTiled => "matmul_tiled.wgsl",
            Kernel::MatmulReduce => "matmul_reduce.wgsl",
            Kernel::Copy => "copy.wgsl",
            Kernel::Quantize => "quantize.wgsl",
            Kernel::MatmulInt => "matmul_int.wgsl",
            Kernel::MoeRoute => "moe.wgsl",
            Kernel::MatmulExperts => "matmul_experts.wgsl",
            Kernel::Lora => "lora.wgsl",
        }
    }

    /// The entry point.
    pub fn entry_point(self) -> &'static str {
        match self {
            Kernel::MatmulSubgroup => "main_subgroup",
            Kernel::MatmulWideSubgroup => "main_wide_subgroup",
            Kernel::MatmulTiled => "main_tiled",
            Kernel::MatmulReduce => "main_reduce",
            Kernel::AttentionSplitHead => "per_head",
            Kernel::AttentionQueryTiles => "query_tiles",
            Kernel::MatmulWide => "main_wide",
            Kernel::MatmulNormed => "main_normed",
            Kernel::MatmulInt => "main_int",
            Kernel::MatmulExperts => "main_experts",
            Kernel::SampleChunks => "chunks",
            Kernel::SampleRadix => "radix",
            Kernel::SampleKept => "kept",
            Kernel::SampleMerge => "merge",
            _ => "main",
        }
    }

    /// Whether the kernel needs the `subgroups` device feature (a fast path).
    pub fn needs_subgroups(self) -> bool {
        matches!(self, Kernel::MatmulSubgroup | Kernel::MatmulWideSubgroup)
    }

    /// Whether the kernel belongs to the integer-dot products, built only for engines that run
    /// them (`dot4I8Packed` is a WGSL language extension not every browser has).
    pub fn int_dot(self) -> bool {
        matches!(self, Kernel::Quantize | Kernel::MatmulInt)
    }

    /// The full WGSL module source: `common.wgsl` followed by the kernel's file.
    pub fn source(self) -> String {
        let body = match self {
            Kernel::Embed => include_str!("../../shaders/embed.wgsl"),
            Kernel::RmsNorm => include_str!("../../shaders/rmsnorm.wgsl"),
            // the products without subgroups: matmul.wgsl with its lane hooks (and a variant's entry)
            Kernel::Matmul | Kernel::MatmulWide | Kernel::MatmulNormed => {
                return format!(
                    "{COMMON}\n{MATMUL}\n{MATMUL_LORA}\n{}",
                    include_str!("../../shaders/matmul_lanes.wgsl")
                );
            }
            Kernel::QkRope => include_str!("../../shaders/qk_rope.wgsl"),
            Kernel::KvWrite => include_str!("../../shaders/kv_write.wgsl"),
            Kernel::Attention => include_str!("../../shaders/attention.wgsl"),
            Kernel::AttentionSplit | Kernel::AttentionSplitHead | Kernel::AttentionQueryTiles => {
                include_str!("../../shaders/attention_split.wgsl")
            }
            Kernel::MlpAct => include_str!("../../shaders/mlp_act.wgsl"),
            Kernel::Commit => include_str!("../../shaders/commit.wgsl"),
            Kernel::Sample | Kernel::SampleChunks | Kernel::SampleRadix | Kernel::SampleKept | Kernel::SampleMerge => {
                include_str!("../../shaders/sample.wgsl")
            }
            Kernel::LogitBias => include_str!("../../shaders/logit_bias.wgsl"),
            Kernel::EngramGather => include_str!("../../shaders/engram_gather.wgsl"),
            Kernel::EngramMix => include_str!("../../shaders/engram_mix.wgsl"),
            Kernel::Copy => include_str!("../../shaders/copy.wgsl"),
            Kernel::Quantize => include_str!("../../shaders/quantize.wgsl"),
            Kernel::MoeRoute => include_str!("../../shaders/moe.wgsl"),
            Kernel::Lora => return format!("{COMMON}\n{}\n{NORM_INPUT}", include_str!("../../shaders/lora.wgsl")),
            Kernel::MatmulExperts => {
                return format!(
                    "{COMMON}\n{MATMUL}\n{}\n{}",
                    include_str!("../../shaders/matmul_lanes.wgsl"),
                    include_str!("../../shaders/matmul_experts.wgsl")
                );
            }
            Kernel::MatmulTiled => {
                return format!(
                    "{COMMON}\n{MATMUL}\n{MATMUL_LORA}\n{}\n{}",
                    include_str!("../../shaders/matmul_lanes.wgsl"),
                    include_str!("../../shaders/matmul_tiled.wgsl")
                );
            }
            Kernel::MatmulInt => {
                return format!(
                    "{COMMON}\n{MATMUL}\n{MATMUL_LORA}\n{}\n{}",
                    include_str!("../../shaders/matmul_lanes.wgsl"),
                    include_str!("../../shaders/matmul_int.wgsl")
                );
            }
            Kernel::MatmulReduce => {
                return format!(
                    "{COMMON}\n{MATMUL}\n{MATMUL_LORA}\n{}\n{}",
                    include_str!("../../shaders/matmul_lanes.wgsl"),
                    include_str!("../../shaders/matmul_reduce.wgsl")
                );
            }
            // the portable kernel's bindings and helpers, plus the subgroup entry points and
            // their lane hooks
            Kernel::MatmulSubgroup | Kernel::MatmulWideSubgroup => {
                return format!(
                    // naga 30 takes subgroup builtins without `enable subgroups;` (the device
                    // feature gates them); it rejects the directive itself
                    "{COMMON}\n{MATMUL}\n{MATMUL_LORA}\n{}",
                    include_str!("../../shaders/matmul_subgroup.wgsl")
                );
            }
        };
        format!("{COMMON}\n{body}")
    }

    /// Binding kinds in binding order (group 0), from which the bind group layouts are made;
    /// `tests/shaders.rs` checks them against naga's reflection of each module.
    pub fn bindings(self) -> &'static [Bind] {
        match self {
            Kernel::Embed => &[Uniform, Read, Read, ReadWrite],
            Kernel::RmsNorm => &[Uniform, Read, Read, Read, ReadWrite, ReadWrite],
            // x, w, y, norm_w, bias; then the LoRA epilogue's A x and adapters (matmul_lora.wgsl)
            Kernel::Matmul | Kernel::MatmulWide | Kernel::MatmulNormed | Kernel::MatmulTiled | Kernel::MatmulReduce => {
                &[Uniform, Read, Read, ReadWrite, Read, Read, Read, Read]
            }
            Kernel::QkRope => &[Uniform, Read, ReadWrite, Read, Read, ReadWrite, Read, ReadWrite, Read],
            Kernel::KvWrite => &[Uniform, Read, Read, ReadWrite, Read],
            Kernel::Attention => &[Uniform, Read, ReadWrite, Read, Read, Read, Read, Uniform, Read, Read],
            Kernel::AttentionSplit | Kernel::AttentionSplitHead | Kernel::AttentionQueryTiles => {
                &[Uniform, Uniform, Read, Read, ReadWrite, ReadWrite, Read, Read]
            }
            Kernel::MlpAct => &[Uniform, Read, ReadWrite],
            Kernel::Commit => &[Uniform, Read, Read, ReadWrite, ReadWrite, ReadWrite],
            Kernel::Sample | Kernel::SampleChunks | Kernel::SampleRadix | Kernel::SampleKept | Kernel::SampleMerge => {
                &[Uniform, Read, Read, Read, ReadWrite, Read, ReadWrite, Read, ReadWrite]
            }
            Kernel::LogitBias => &[Uniform, Read, Read, Read, ReadWrite],
            Kernel::EngramGather => &[Uniform, Read, Read, Read, Read, Read, Read, ReadWrite],
            Kernel::EngramMix => &[Uniform, Read, Read, ReadWrite],
            Kernel::MatmulSubgroup | Kernel::MatmulWideSubgroup => {
                &[Uniform, Read, Read, ReadWrite, Read, Read, Read, Read]
            }
            Kernel::Copy => &[Read, ReadWrite],
            Kernel::Quantize => &[Uniform, Read, ReadWrite],
            // matmul.wgsl's six (x and norm_w unused), the LoRA epilogue's two, then the quantized input
            Kernel::MatmulInt => &[Uniform, Read, Read, ReadWrite, Read, Read, Read, Read, Read],
            Kernel::MoeRoute => &[Uniform, Read, Read, ReadWrite, ReadWrite],
            // matmul.wgsl's six, then the routes (ids and weights), the shared expert's output and gate
            Kernel::MatmulExperts => &[Uniform, Read, Read, ReadWrite, Read, Read, Read, Read, Read],
            Kernel::Lora => &[Uniform, Read, Read, ReadWrite, Read, Read, Read, Read],
        }
    }

    /// Threads per workgroup (the `WG` constant of the kernel; the subgroup matmul's is set per
    /// device).
    pub(crate) fn workgroup_size(self) -> u32 {
        match self {
            Kernel::Sample | Kernel::SampleChunks | Kernel::SampleRadix | Kernel::SampleKept | Kernel::SampleMerge => {
                256
            }
            Kernel::AttentionSplitHead => 8,
            Kernel::AttentionSplit => 256,
            _ => 64,
        }
    }
}

/// Override constants of one pipeline in the form wgpu takes: name and value (bools as 0/1).
/// Made only by the typed structs of [`crate::gpu::kernels`].
pub(crate) type Constants = Vec<(&'static str, f64)>;

/// Whether shader modules keep wgpu's runtime bounds checks: only when the environment variable
/// `KVDECODE_BOUNDS_CHECKS` is `1` (to compare, or to chase a suspected out-of-range index). Our
/// modules are created trusted otherwise. (Browsers check bounds whatever we ask.)
pub fn bounds_checked() -> bool {
    std::env::var("KVDECODE_BOUNDS_CHECKS").is_ok_and(|v| v == "1")
}

/// The runtime checks of trusted modules: no bounds checks. Integer division keeps its guard,
/// and loops keep naga's bounding (without it, lavapipe's process grew by 285 MB over the short
/// soak test's 1500 steps, with every result still right; with it, memory stays flat).
fn trusted_checks() -> wgpu::ShaderRuntimeChecks {
    let mut checks = wgpu::ShaderRuntimeChecks::unchecked();
    checks.int_div_checks = true;
    checks.force_loop_bounding = true;
    checks
}

type Key = (Kernel, Vec<(&'static str, u64)>);

/// A kernel's shader module and layouts.
struct KernelObjects {
    module: wgpu::ShaderModule,
    /// Natively, the module as naga IR, from which each pipeline gets its own specialized module.
    #[cfg(not(target_arch = "wasm32"))]
    parsed: Option<crate::gpu::specialize::Parsed>,
    bind_layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
}

/// Shader modules, bind group layouts and pipelines, each created once per device and shared by
/// every engine on it (a second engine of the same shape compiles nothing). A kernel's module is
/// made when a pipeline first asks for it, so a device never builds the integer-dot or subgroup
/// modules unless an engine runs them (`dot4I8Packed` is a WGSL extension not every browser has).
pub(crate) struct Pipelines {
    device: wgpu::Device,
    kernels: Mutex<HashMap<Kernel, Arc<KernelObjects>>>,
    cache: Mutex<HashMap<Key, Arc<wgpu::ComputePipeline>>>,
}

impl std::fmt::Debug for Pipelines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.cache.lock().map(|c| c.len()).unwrap_or(0);
        write!(f, "Pipelines({n} built)")
    }
}

impl Pipelines {
    /// An empty cache for `device`.
    pub(crate) fn new(device: &wgpu::Device) -> Self {
        Pipelines { device: device.clone(), kernels: Mutex::new(HashMap::new()), cache: Mutex::new(HashMap::new()) }
    }

    /// The module and layouts of `k`, made on first use.
    fn kernel(&self, k: Kernel) -> Arc<KernelObjects> {
        let mut kernels = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        kernels.entry(k).or_insert_with(|| Arc::new(self.make_kernel(k))).clone()
    }

    fn make_kernel(&self, k: Kernel) -> KernelObjects {
        let device = &self.device;
        let source = k.source();
        // (a kernel naga cannot parse natively is one wgpu reports on its own module below)
        #[cfg(not(target_arch = "wasm32"))]
        let parsed = crate::gpu::specialize::Parsed::new(&source).ok();
        let module = self.module(wgpu::ShaderModuleDescriptor {
            label: Some(k.file()),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let entries: Vec<_> = k
            .bindings()
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match b {
                        Uniform => wgpu::BufferBindingType::Uniform,
                        Read => wgpu::BufferBindingType::Storage { read_only: true },
                        ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let bind_layout = device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(k.file()), entries: &entries });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(k.file()),
            bind_group_layouts: &[Some(&bind_layout)],
            immediate_size: 0,
        });
        KernelObjects {
            module,
            #[cfg(not(target_arch = "wasm32"))]
            parsed,
            bind_layout,
            pipeline_layout,
        }
    }

    /// A shader module of ours, trusted unless `KVDECODE_BOUNDS_CHECKS=1`.
    fn module(&self, desc: wgpu::ShaderModuleDescriptor) -> wgpu::ShaderModule {
        if bounds_checked() {
            self.device.create_shader_module(desc)
        } else {
            // SAFETY: these are our own shaders, not user input. Every index they compute
            // stays inside its binding: the host checks rows, positions and lengths against
            // the buffers' sizes before a step is recorded (`Engine::check`), reads past a
            // chunk's last token are clamped to it (`row_bases` in matmul.wgsl), and padding
            // writes a scratch slot or nothing. The whole suite runs these modules on Vulkan
            // and GL in CI.
            unsafe { self.device.create_shader_module_trusted(desc, trusted_checks()) }
        }
    }

    /// Natively, a module of `objects`' kernel specialized to `constants`
    /// ([`crate::gpu::specialize`]); `None` where that cannot be made, and in the browser.
    fn specialized(
        &self,
        objects: &KernelObjects,
        kernel: Kernel,
        constants: &Constants,
    ) -> Option<wgpu::ShaderModule> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            let module = objects.parsed.as_ref()?.specialize(kernel.entry_point(), constants).ok()?;
            Some(self.module(wgpu::ShaderModuleDescriptor {
                label: Some(kernel.file()),
                source: wgpu::ShaderSource::Naga(std::borrow::Cow::Owned(module)),
            }))
        }
        #[cfg(target_arch = "wasm32")]
        {
            let _ = (objects, kernel, constants);
            None
        }
    }

    /// The pipeline of `spec`'s kernel specialized with its constants, built on first use and
    /// labelled with its variant's name.
    pub(crate) fn get(&self, spec: &dyn Specialize) -> Arc<wgpu::ComputePipeline> {
        let (kernel, constants) = (spec.kernel(), spec.constants());
        let mut key_consts: Vec<(&'static str, u64)> = constants.iter().map(|(n, v)| (*n, v.to_bits())).collect();
        key_consts.sort();
        let key = (kernel, key_consts);
        let objects = self.kernel(kernel);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(key)
            .or_insert_with(|| {
                // the specialized module has no overrides left; the shared one takes them
                let specialized = self.specialized(&objects, kernel, &constants);
                let (module, constants) = match &specialized {
                    Some(m) => (m, &[][..]),
                    None => (&objects.module, &constants[..]),
                };
                Arc::new(self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&spec.label()),
                    layout: Some(&objects.pipeline_layout),
                    module,
                    entry_point: Some(kernel.entry_point()),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                }))
            })
            .clone()
    }

    /// A bind group of `kernel` over whole buffers, in binding order, labelled `label`.
    pub(crate) fn bind(&self, kernel: Kernel, label: &str, buffers: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        assert_eq!(buffers.len(), kernel.bindings().len(), "{}: binding count", kernel.file());
        let entries: Vec<_> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &self.kernel(kernel).bind_layout,
            entries: &entries,
        })
    }
}
