//! Weights pushed in between steps, as a training loop does after every optimizer step: named
//! tensors (any naming kvdecode reads) written into the GPU places the loaders' name map gives
//! them, without rebuilding a pipeline or a bind group; the policy version that every sampled
//! token reports; and what happens to the cache (the prompt cache is flushed, rows in flight
//! keep their K/V, are recomputed, or are reset).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::model::config::{ModelConfig, NormKind};
use crate::model::family::{
    conform, naming_norm, tensor_names, trainer_names, Naming, Place, Slot, TensorName, HF_PREFIXES,
};
use crate::model::tensor::HostTensor;

/// What an update does to the rows that hold tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InFlight {
    /// Rows go on from the K/V they hold, computed by the old weights: partial rollouts, and
    /// the versions of their tokens say so. Their blocks never enter the prompt cache again.
    #[default]
    Keep,
    /// Each row's K/V is computed again under the new weights from its tokens, so it holds
    /// what a fresh engine fed the same tokens holds, bit for bit. Forks of one prompt share
    /// its blocks again through the prompt cache.
    Recompute,
    /// Every row is emptied ([`Engine::reset`]).
    Reset,
}

impl InFlight {
    /// Parse `keep`, `recompute` or `reset`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "keep" => Ok(InFlight::Keep),
            "recompute" => Ok(InFlight::Recompute),
            "reset" => Ok(InFlight::Reset),
            _ => Err(Error::Input(format!("in-flight mode {name:?}: expected keep, recompute or reset"))),
        }
    }
}

/// What [`Engine::update_weights`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightUpdate {
    /// The weights version now ([`Engine::weights_version`]).
    pub version: u64,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes written to the GPU.
    pub bytes: u64,
    /// Names taken but not written: a tied model's LM head (PyTorch's `state_dict()` lists the
    /// shared tensor under both names) and RoPE's `inv_freq` buffers.
    pub ignored: Vec<String>,
    /// Rows recomputed or reset.
    pub rows: Vec<usize>,
}

/// Every name of a model's weights, in every naming, with how its norms hold their values.
pub(crate) type NameIndex = HashMap<String, (TensorName, NormKind)>;

/// The [`NameIndex`] of `cfg`'s weights.
pub(crate) fn name_index(cfg: &ModelConfig) -> NameIndex {
    let namings = [Naming::Kvdecode, Naming::Gguf].into_iter().chain(HF_PREFIXES.map(Naming::HuggingFace));
    let mut index = HashMap::new();
    for naming in namings {
        let norm = naming_norm(cfg, naming);
        for t in tensor_names(cfg, naming) {
            index.insert(t.name.clone(), (t, norm));
        }
    }
    // a transformers trainer's in-memory names of fused experts (no norm among them)
    for prefix in HF_PREFIXES {
        for t in trainer_names(cfg, prefix) {
            index.insert(t.name.clone(), (t, NormKind::Weight));
        }
    }
    index
}

/// Names a trainer's `state_dict()` carries that are not weights of their own.
fn ignorable(cfg: &ModelConfig, name: &str) -> bool {
    let tied_head = cfg.tie_embeddings && ["lm_head.weight", "output.weight", "head.weight"].contains(&name);
    // RoPE's frequencies are the config's, not weights (GGUF's Llama 3.1 factors included)
    tied_head || name.ends_with("rotary_emb.inv_freq") || name == "rope_freqs.weight"
}

impl Engine {
    /// The policy version: 0 for the weights the engine was built with, plus one per
    /// [`Engine::update_weights`]. Every sampled token reports the version it was sampled under.
    pub fn weights_version(&self) -> u64 {
        self.weights_version
    }

    /// Replace some or all weights in place, between steps. `tensors` are named as in the file
    /// the model came from (Hugging Face `model.layers.3.self_attn.q_proj.weight`, GGUF
    /// `blk.3.attn_q.weight`, or kvdecode's `blocks.3.attn.w_q.weight`), or as a transformers
    /// trainer's `state_dict()` names them (a mixture of experts' fused
    /// `mlp.experts.gate_up_proj` `[E, 2F, d]` and `mlp.experts.down_proj` `[E, d, F]`,
    /// [`crate::model::family::trainer_names`]), in f32, f16 or bf16: a name whose rows live in a
    /// fused matrix (q, k and v; gate and up) writes just those rows, and a subset writes just
    /// what it names. Values are stored as the engine stores that
    /// weight: 16-bit weights rounded, quantized weights quantized on the host by this crate's
    /// quantizer for that format (`quant::quantize`: llama.cpp's for Q8_0, Q4_0, Q4_1, Q5_0 and
    /// Q5_1; plain per-sub-block ranges for Q4_K and Q6_K; the nearest table entry for IQ4_NL), so
    /// the engine holds what a fresh engine built from the new weights holds.
    ///
    /// Everything is checked before anything is written: an unknown name, a name given twice, a
    /// wrong shape or byte length, or a value that is not finite is an error naming the tensor,
    /// and the engine is unchanged. Then the version rises, the prompt cache is flushed (its K/V
    /// came from the old weights), and rows holding tokens are kept, recomputed or reset as
    /// `in_flight` says. No pipeline, bind group or buffer is created; the values are checked on
    /// every CPU thread first, then written through the queue's staging memory, which reaches the
    /// GPU with the next submit.
    pub fn update_weights(&mut self, tensors: &[HostTensor], in_flight: InFlight) -> Result<WeightUpdate> {
        self.ready()?;
        // every naming's names, built at the first update and kept (the map never changes)
        let index = self.names.take().unwrap_or_else(|| name_index(&self.cfg));
        // a tensor is taken in the shape its name has here where its values are those rows in
        // that order, and a matrix its files hold as stacked transposes (gpt-oss's experts) is
        // transposed back (`conform`, the loaders' own)
        let conformed = tensors
            .iter()
            .map(|t| index.get(&t.name).map_or(Ok(None), |(spec, _)| conform(spec, t)))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| match e {
                Error::Weights(m) => Error::Weights(format!("update: {m}")),
                e => e,
            });
        let result = match conformed {
            Err(e) => Err(e),
            Ok(c) if c.iter().all(Option::is_none) => self.update_with(&index, tensors, in_flight),
            Ok(c) => {
                let views: Vec<HostTensor> =
                    tensors.iter().zip(&c).map(|(t, moved)| moved.as_ref().map_or(t.clone(), |m| m.apply(t))).collect();
                self.update_with(&index, &views, in_flight)
            }
        };
        self.names = Some(index);
        result
    }

    fn update_with(&mut self, index: &NameIndex, tensors: &[HostTensor], in_flight: InFlight) -> Result<WeightUpdate> {
        let mut seen = HashSet::new();
        let mut filled: HashMap<(Slot, usize), &str> = HashMap::new();
        let mut plan = Vec::new();
        let mut ignored = Vec::new();
        for t in tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(Error::Weights(format!("update: tensor `{}` is given twice", t.name)));
            }
            let Some((spec, norm)) = index.get(&t.name) else {
                if ignorable(&self.cfg, &t.name) {
                    ignored.push(t.name.clone());
                    continue;
                }
                let example = tensor_names(&self.cfg, Naming::Kvdecode).into_iter().nth(1).map(|t| t.name);
                return Err(Error::Weights(format!(
                    "update: tensor `{}` is not a weight of this {:?}-family model (names look like `{}`)",
                    t.name,
                    self.cfg.family,
                    example.unwrap_or_default()
                )));
            };
            t.check_shape(&spec.shape)?;
            for &Place { slot, row0, .. } in &spec.places {
                if let Some(other) = filled.insert((slot, row0), &t.name) {
                    return Err(Error::Weights(format!(
                        "update: tensors `{other}` and `{}` both fill {slot:?} (two namings of one weight)",
                        t.name
                    )));
                }
                if self.weights.place(&self.cfg, slot, row0).is_none() {
                    return Err(Error::Weights(format!(
                        "update: tensor `{}` fills {slot:?}, which this engine lacks",
                        t.name
                    )));
                }
            }
            plan.push((t, spec, *norm));
        }
        crate::model::tensor::check_all_values(&plan.iter().map(|p| p.0).collect::<Vec<_>>())?;
        let mut bytes = 0;
        for (t, spec, norm) in &plan {
            for p in &spec.places {
                // (every place was checked above; the engine's own upload writes through the same)
                bytes += self.weights.write_place(&self.gpu, &self.cfg, p, *norm, t).unwrap_or(0);
            }
        }
        // the writes reach the GPU with this submit, and their staging memory is freed once done
        self.gpu.queue.submit([]);
        self.weights_version += 1;
        let held: Vec<usize> = (0..self.cache.rows()).filter(|&r| self.cache.position(r) > 0).collect();
        self.cache.blocks.flush_prompt_cache(true);
        match in_flight {
            InFlight::Keep => {}
            InFlight::Reset => self.reset(&held)?,
            InFlight::Recompute => self.recompute(&held)?,
        }
        Ok(WeightUpdate {
            version: self.weights_version,
            tensors: plan.len(),
            bytes,
            ignored,
            rows: if in_flight == InFlight::Keep { Vec::new() } else { held },
        })
    }

    /// Forget every block the prompt cache holds (blocks rows hold stay theirs, and rows keep
    /// registering new ones): later prompts are computed afresh.
    pub fn reset_prefix_cache(&mut self) -> Result<()> {
        self.ready()?;
        self.cache.blocks.flush_prompt_cache(false);
        Ok(())
    }

    /// [`Engine::update_weights`] from a file: a safetensors file (Hugging Face or kvdecode
    /// names), a Hugging Face directory (every `*.safetensors` in it) or a GGUF file (quantized
    /// tensors taken as their blocks). Every tensor in it is an update.
    pub fn update_weights_from_path(&mut self, path: impl AsRef<Path>, in_flight: InFlight) -> Result<WeightUpdate> {
        let path = path.as_ref();
        let files = crate::io::model_file::TensorFiles::open(path)?;
        let tensors = files.tensors().map_err(|e| crate::error::file_err(path, e))?;
        self.update_weights(&tensors, in_flight).map_err(|e| crate::error::file_err(path, e))
    }

    /// Compute `rows`' K/V again from their tokens (and skipped positions), one row after
    /// another with the prompt cache on, so forks of one prompt share its blocks again. A row
    /// keeps its sampling state and owner. If the pool runs out of blocks, the rows not yet
    /// recomputed are reset and the error names them.
    pub(super) fn recompute(&mut self, rows: &[usize]) -> Result<()> {
        let was_on = self.cache.blocks.prompt_cache();
        self.cache.blocks.set_prompt_cache(true);
        let mut result = Ok(());
        for (k, &r) in rows.iter().enumerate() {
            if let Err(e) = self.recompute_row(r) {
                let rest = &rows[k..];
                self.reset(rest)?;
                result = Err(Error::Limit(format!(
                    "the weights were updated (version {}), but recomputing row {r} failed ({e}): rows {rest:?} were reset",
                    self.weights_version
                )));
                break;
            }
        }
        if !was_on {
            // the cache held only what this recompute put there, all of the new weights
            self.cache.blocks.flush_prompt_cache(false);
            self.cache.blocks.set_prompt_cache(false);
        }
        result
    }

    fn recompute_row(&mut self, r: usize) -> Result<()> {
        let history = self.cache.history(r).to_vec();
        let skips = self.cache.skips(r).to_vec();
        self.cache.reset(&self.gpu, &[r])?;
        let mut at = 0;
        for (stored, count) in skips.iter().copied().chain([(history.len(), 0)]) {
            if stored > at {
                let kept = if self.cache.position(r) == 0 { self.reuse_prefix(r, &history[..stored])? } else { at };
                let rest = &history[kept..stored];
                if !rest.is_empty() {
                    self.feed(rest, rest.len(), &[rest.len()], Some(&[r]))?;
                }
                at = stored;
            }
            if count > 0 {
                self.cache.skip(&[r], &[count])?;
            }
        }
        Ok(())
    }
}
