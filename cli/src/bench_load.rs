//! `kvdecode bench --tables load`: a model file onto the GPU, timed, with the host memory it
//! took at its peak: the bytes this process's Rust code held (a counting allocator, the
//! command's global one; the file's mapping and the driver's own allocations are not among
//! them, which on lavapipe include the GPU buffers) and the resident set (`VmHWM`, whatever
//! holds it). `demo` or a `synthetic:` model is first written to a kvdecode safetensors file in
//! f16.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kvdecode::io::safetensors::DiskDtype;
use kvdecode::{Engine, EngineOptions, Gpu, WeightDtype};
use serde_json::json;

use crate::common::Result;

/// The system allocator, counting the bytes held now and at their peak (two relaxed atomic
/// operations an allocation: nothing beside a model's loading).
pub struct CountingAlloc;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = HELD.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call goes to the system allocator with the caller's own arguments; the counters
// only observe.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            HELD.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

/// Start a new peak at what is held now; returns it.
fn restart_peak() -> usize {
    let now = HELD.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// Start the kernel's peak resident set anew (Linux: `clear_refs` 5).
fn restart_rss_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The peak resident set since [`restart_rss_peak`], in bytes (Linux; `None` elsewhere).
fn rss_peak() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// A file to load for `model`: itself, or `demo` or a `synthetic:` model written to a temporary
/// kvdecode safetensors file in f16 (removed when the returned guard drops).
fn model_file(model: &str) -> Result<(std::path::PathBuf, Option<tempfile_guard::Guard>)> {
    if model != "demo" && !model.starts_with("synthetic:") {
        return Ok((model.into(), None));
    }
    let (w, _) = crate::common::load_model(model)?;
    let path = std::env::temp_dir().join(format!("kvdecode-bench-load-{}.safetensors", std::process::id()));
    w.save_safetensors(&path, DiskDtype::F16)?;
    Ok((path.clone(), Some(tempfile_guard::Guard(path))))
}

mod tempfile_guard {
    /// Removes its file when dropped.
    pub struct Guard(pub std::path::PathBuf);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Load `model` onto `gpu` `rounds` times each way and print the medians.
pub fn load_table(gpu: &Gpu, model: &str, weights: WeightDtype, rounds: usize) -> Result<Vec<serde_json::Value>> {
    let (path, _guard) = model_file(model)?;
    let file_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let mib = |b: u64| b as f64 / 1048576.0;
    println!("\nloading {} ({:.1} MiB) onto the GPU, {weights:?} weights", path.display(), mib(file_bytes));
    println!("| way | ms | peak Rust heap MiB | peak RSS MiB |");
    println!("|---|---:|---:|---:|");
    let opts = || EngineOptions { weights, beyond_trained_context: true, ..EngineOptions::new(1, 64) };
    type Way<'a> = (&'a str, Box<dyn Fn() -> kvdecode::Result<Engine> + 'a>);
    let ways: Vec<Way> = vec![
        (
            "host copy: model_file::load, then Engine::new",
            Box::new(|| {
                let loaded = kvdecode::io::model_file::load(&path, &mut |_, _| {})?;
                Engine::new(gpu, &loaded.weights, opts())
            }),
        ),
        (
            "streamed: ModelFile::open, then Engine::from_file",
            Box::new(|| Engine::from_file(gpu, &kvdecode::io::model_file::ModelFile::open(&path)?, opts())),
        ),
    ];
    let mut out = Vec::new();
    for (name, load) in &ways {
        let mut runs = Vec::new();
        for _ in 0..rounds.max(1) {
            restart_rss_peak();
            let base = restart_peak();
            let t = Instant::now();
            let engine = load()?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            let heap = PEAK.load(Ordering::Relaxed).saturating_sub(base) as u64;
            drop(engine);
            runs.push((ms, heap, rss_peak()));
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (ms, heap, rss) = runs[runs.len() / 2];
        let rss_text = rss.map_or("n/a".to_string(), |r| format!("{:.1}", mib(r)));
        println!("| {name} | {ms:.0} | {:.1} | {rss_text} |", mib(heap));
        out.push(
            json!({ "way": name, "ms": ms, "peak_heap_bytes": heap, "peak_rss_bytes": rss, "file_bytes": file_bytes }),
        );
    }
    Ok(out)
}
