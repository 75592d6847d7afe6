//! The occupancy table: every dispatch of one decode step with the workgroups it launches, the
//! threads in them, the longest serial loop any thread runs and the bytes it moves, computed
//! from the kernels' constants and grids as the step would record them. It needs no GPU: an
//! engine on [`crate::Gpu::dry_run`] gives the table of the kernels a discrete GPU would run.

use crate::engine::sampling::Sampler;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gpu::kernels::At;
use crate::gpu::shaders::{Bind, Kernel};

/// One dispatch of a decode step ([`Engine::occupancy`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Occupancy {
    /// The kernel variant's label (`matmul_subgroup_q4_1_normed`), as the profile names it.
    pub label: String,
    /// Workgroups launched.
    pub workgroups: u64,
    /// Threads in them.
    pub threads: u64,
    /// The longest serial loop of any thread, in iterations: one trip of its innermost loop (a
    /// vec4 multiply-add of a product or of attention, one element of a norm or RoPE, one
    /// vocabulary entry of the sampler, one level of a reduction), summed along its path.
    pub serial_iters: usize,
    /// Bytes read and written (a buffer that later passes of the same thread read again counts
    /// once).
    pub bytes: u64,
    /// Whether wgpu puts a barrier before it: one of its buffers was bound `read_write` by an
    /// earlier dispatch of the step, or is now and was bound before (wgpu's usage tracking skips
    /// a transition only between equal read-only uses). Without one it may overlap the dispatch
    /// before.
    pub after_barrier: bool,
}

/// A decode step's dispatches in recording order ([`Engine::occupancy`]).
#[derive(Clone, Debug)]
pub struct OccupancyTable {
    /// One per dispatch.
    pub dispatches: Vec<Occupancy>,
    /// Dispatches of the model's layers, per layer (the step's others: the embedding, the
    /// bookkeeping, the final norm, the LM head and the sampler).
    pub dispatches_per_layer: f64,
}

impl OccupancyTable {
    /// The dispatch with the fewest workgroups (the first of equals).
    pub fn fewest_workgroups(&self) -> Option<&Occupancy> {
        self.dispatches.iter().reduce(|a, b| if b.workgroups < a.workgroups { b } else { a })
    }

    /// The dispatch with the longest serial loop (the first of equals).
    pub fn longest_loop(&self) -> Option<&Occupancy> {
        self.dispatches.iter().reduce(|a, b| if b.serial_iters > a.serial_iters { b } else { a })
    }

    /// How many dispatches wait behind a barrier ([`Occupancy::after_barrier`]).
    pub fn barriers(&self) -> usize {
        self.dispatches.iter().filter(|d| d.after_barrier).count()
    }

    /// How many dispatches launch fewer than `workgroups` workgroups.
    pub fn below(&self, workgroups: u64) -> usize {
        self.dispatches.iter().filter(|d| d.workgroups < workgroups).count()
    }

    /// The dispatches that walk alone: fewer than `workgroups` workgroups (a GPU's SMs or CUs)
    /// and a serial loop longer than `iters`, so most of the GPU idles while a few threads loop.
    pub fn walking_alone(&self, workgroups: u64, iters: usize) -> Vec<&Occupancy> {
        self.dispatches.iter().filter(|d| d.workgroups < workgroups && d.serial_iters > iters).collect()
    }
}

impl Engine {
    /// The occupancy table of one decode step (one new token a row) of `rows` rows whose
    /// contexts are `context` tokens after it, sampled with `sampler` (`None`: logits only).
    /// Computed from the dispatches as built, never run: nothing on the GPU changes.
    pub fn occupancy(&self, rows: usize, context: usize, sampler: Option<&Sampler>) -> Result<OccupancyTable> {
        if rows == 0 || rows > self.cache.rows() {
            return Err(Error::Input(format!(
                "occupancy: rows {rows} must be 1 to the engine's {}",
                self.cache.rows()
            )));
        }
        if context == 0 || context > self.cache.max_len() {
            return Err(Error::Input(format!(
                "occupancy: context {context} must be 1 to the engine's max_len {}",
                self.cache.max_len()
            )));
        }
        let (vocab_passes, reductions) = sampler.map_or((0, 0), |s| s.vocabulary_passes(self.cfg.vocab));
        let top_n = sampler.map_or(0, |s| s.top_logprobs.min(crate::engine::sampling::TOP_LOGPROBS_MAX) as usize);
        let at = At { rows, tokens: rows, context, vocab_passes, reductions, top_n };
        let recorded =
            self.chunk_dispatches
                .iter()
                .chain(&self.head_dispatches)
                .filter(|d| d.live(rows, 1))
                .map(|d| d.for_chunk(rows, 1))
                .chain(sampler.map_or(Vec::new(), |s| {
                    self.sample_dispatches.for_samplers(std::slice::from_ref(s), self.cfg.vocab)
                }));
        // (a step binds a few dozen buffers: a list; a buffer's interior mutability keeps it
        // out of a map's keys)
        let mut last_use: Vec<(&wgpu::Buffer, Bind)> = Vec::new();
        let dispatches = recorded
            .map(|d| {
                let after_barrier = d.uses.iter().any(|(b, how)| {
                    last_use
                        .iter()
                        .find(|(u, _)| *u == b)
                        .is_some_and(|(_, was)| *was == Bind::ReadWrite || *how == Bind::ReadWrite || was != how)
                });
                for (b, how) in &d.uses {
                    match last_use.iter_mut().find(|(u, _)| *u == b) {
                        Some(u) => u.1 = *how,
                        None => last_use.push((b, *how)),
                    }
                }
                let (workgroups, threads, serial_iters, bytes) = d.occupancy(1, &at);
                Occupancy { label: d.label.to_string(), workgroups, threads, serial_iters, bytes, after_barrier }
            })
            .collect();
        let in_layers = self
            .chunk_dispatches
            .iter()
            .filter(|d| d.live(rows, 1) && !matches!(d.kernel, Kernel::Embed | Kernel::Commit))
            .count();
        let dispatches_per_layer = in_layers as f64 / self.cfg.n_layers().max(1) as f64;
        Ok(OccupancyTable { dispatches, dispatches_per_layer })
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::sampling::{LogprobMode, Sampler};
    use crate::engine::{Engine, EngineOptions, MatmulKernel};
    use crate::gpu::device::Gpu;
    use crate::model::weights::ModelWeights;

    /// The table lists exactly what a step records: every variant as many times as the profiled
    /// step of the same shape runs it (on the dry-run GPU, which runs nothing but records all),
    /// with the kernels a GPU gets; a product launches a workgroup per output and token there, and
    /// the sampler's dispatches and loops follow its settings. Bad shapes are refused by name.
    #[test]
    fn the_table_lists_what_a_step_records() {
        let gpu = Gpu::dry_run(32).expect("the noop backend");
        let w = ModelWeights::demo();
        let mut e = Engine::new(&gpu, &w, EngineOptions::new(3, 64)).expect("an engine on the dry run");
        assert_eq!(e.matmul_kernel(), MatmulKernel::Subgroup, "the dry run poses as a GPU with subgroups");
        let top_p = Sampler::temperature(0.8, 1).with_top_p(0.9).with_top_logprobs(5);
        for (rows, sampler) in [(1, Sampler::GREEDY), (3, top_p.with_logprobs(LogprobMode::Raw))] {
            let table = e.occupancy(rows, 10, Some(&sampler)).expect("a table");
            let (ids, sub): (Vec<u32>, Vec<usize>) = (vec![1; rows], (0..rows).collect());
            let profile = e
                .profile_step(&ids, 1, &vec![1; rows], Some(&sub), Some(&vec![sampler; rows]))
                .expect("a profiled step");
            let mut counted: Vec<(String, usize)> = Vec::new();
            for d in &table.dispatches {
                match counted.iter_mut().find(|(l, _)| *l == d.label) {
                    Some((_, n)) => *n += 1,
                    None => counted.push((d.label.clone(), 1)),
                }
            }
            let ran: Vec<(String, usize)> = profile.variants.iter().map(|(l, _, n)| (l.clone(), *n)).collect();
            assert_eq!(counted, ran, "{rows} row(s)");
            let free: Vec<&str> =
                table.dispatches.iter().filter(|d| !d.after_barrier).map(|d| d.label.as_str()).collect();
            // a step is a chain, but for its first dispatch, layer 0's second product (the same
            // normed input, into a buffer nothing wrote yet) and the Engram gather (the ids and
            // its tables): nothing before them wrote what they use
            assert_eq!(free, ["embed_f32", "matmul_subgroup_f32_normed", "engram_gather"], "{rows} row(s)");
            assert_eq!(table.barriers(), table.dispatches.len() - free.len());
            let head = table.dispatches.iter().find(|d| d.label.ends_with("_rows")).expect("the LM head");
            // one per output and token (fewer than 4 tokens: one token a workgroup)
            assert_eq!(head.workgroups, (w.cfg.vocab * rows) as u64);
            let sampling: Vec<(String, u64, usize)> = table.dispatches[e.dispatches_per_chunk()..]
                .iter()
                .map(|d| (d.label.clone(), d.workgroups, d.serial_iters))
                .collect();
            // 512 logits, every row on the split path: 2 chunks of 256 a row, 1 entry a thread.
            // The chunks read theirs twice and run 2 trees of 8 levels, then (top-p + 5
            // logprobs) 5 rounds of an entry and a tree; a radix pass two choices of digit (8
            // levels and a load each), the row's max (a tree) and its entry; the kept draw one
            // choice, two trees and its entry. The merge: a chunk a lane, twice, 2 trees, then 5
            // rounds of a tree and one candidate list's head a lane.
            let at = |label: &str, workgroups: usize, iters: usize| (label.to_string(), workgroups as u64, iters);
            let want = match rows {
                1 => vec![at("sample_chunks", 2, 18), at("sample_merge", 1, 18)],
                _ => {
                    let mut w = vec![at("sample_chunks", 2 * rows, 18 + 5 * 9)];
                    w.extend((0..4).map(|p| at(&format!("sample_radix_p{p}"), 2 * rows, 2 * 9 + 8 + 1)));
                    w.extend([at("sample_kept", 2 * rows, 9 + 16 + 1), at("sample_merge", rows, 18 + 5 * 9)]);
                    w
                }
            };
            assert_eq!(sampling, want, "{rows} row(s)");
        }
        assert!(e.occupancy(4, 10, None).is_err_and(|e| e.to_string().contains("rows 4")));
        assert!(e.occupancy(1, 65, None).is_err_and(|e| e.to_string().contains("max_len 64")));
    }
}
