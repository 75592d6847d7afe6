//! One step's input and its output choice, as `llama_decode(ctx, batch)` and vLLM's
//! `execute_model` take them: a [`Batch`] (the cache rows that take tokens, their tokens, and
//! where wanted each row's sampler, adapter and following token) and a [`Want`]. The shorthands
//! ([`Engine::append`], [`Engine::feed`], [`Engine::append_sample`], [`Engine::append_all_logits`],
//! [`Engine::append_scored`]) are [`Engine::step`] with one `Want` each, on the right-padded form.

use std::borrow::Cow;

use crate::engine::options::Logits;
use crate::engine::sampling::{Sampled, Sampler};
use crate::engine::Engine;
use crate::error::{Error, Result};

/// The rows of one step and their tokens, with what each row samples and decodes with.
///
/// Build it a row at a time ([`Batch::new`], [`Batch::row`]) or from the right-padded layout the
/// shorthands take ([`Batch::padded`]). Row `r` of the batch is cache row `rows[r]`; outputs come
/// in the batch's row order. A row given no tokens is left untouched.
#[derive(Clone, Debug, Default)]
pub struct Batch<'a> {
    ids: Cow<'a, [u32]>,
    width: usize,
    n_new: Cow<'a, [usize]>,
    rows: Option<Cow<'a, [usize]>>,
    samplers: Option<Cow<'a, [Sampler]>>,
    adapters: Option<Vec<Option<String>>>,
    next: Option<Cow<'a, [u32]>>,
}

impl<'a> Batch<'a> {
    /// An empty batch, to add rows to.
    pub fn new() -> Batch<'static> {
        Batch { rows: Some(Cow::Owned(Vec::new())), ..Batch::default() }
    }

    /// The right-padded layout: `ids` is `[R, width]`, row-major; batch row `r` has `n_new[r]`
    /// real tokens. `rows`: the cache rows the batch rows refer to; `None`, every cache row in
    /// order.
    pub fn padded(ids: &'a [u32], width: usize, n_new: &'a [usize], rows: Option<&'a [usize]>) -> Batch<'a> {
        Batch {
            ids: Cow::Borrowed(ids),
            width,
            n_new: Cow::Borrowed(n_new),
            rows: rows.map(Cow::Borrowed),
            ..Batch::default()
        }
    }

    /// Add cache row `row` with `tokens` (none: the row takes no token this step). Only on a
    /// batch of named rows (not a `padded` one over every cache row).
    pub fn row(mut self, row: usize, tokens: &[u32]) -> Self {
        let width = self.width.max(tokens.len());
        if width > self.width {
            // widen every row so far to the new width
            let old = std::mem::take(&mut self.ids).into_owned();
            let mut ids = vec![0; self.n_new.len() * width];
            for (r, &n) in self.n_new.iter().enumerate() {
                ids[r * width..r * width + n].copy_from_slice(&old[r * self.width..r * self.width + n]);
            }
            (self.ids, self.width) = (Cow::Owned(ids), width);
        }
        let ids = self.ids.to_mut();
        ids.extend(tokens);
        ids.resize(ids.len() + width - tokens.len(), 0);
        self.n_new.to_mut().push(tokens.len());
        self.rows.get_or_insert_with(|| Cow::Owned(Vec::new())).to_mut().push(row);
        self
    }

    /// One sampler per batch row: what [`Want::Sampled`] draws and [`Want::Scored`] scores by
    /// (other wants ignore them).
    pub fn samplers(mut self, samplers: impl Into<Cow<'a, [Sampler]>>) -> Self {
        self.samplers = Some(samplers.into());
        self
    }

    /// One adapter per batch row (`None`: the base model), set on each row before the step as
    /// [`Engine::set_adapter`] sets it (a row holding tokens must have that adapter already).
    pub fn adapters(mut self, names: &[Option<&str>]) -> Self {
        self.adapters = Some(names.iter().map(|n| n.map(str::to_string)).collect());
        self
    }

    /// The token that follows each row's tokens, for [`Want::Scored`] (`u32::MAX`: none).
    pub fn next(mut self, next: impl Into<Cow<'a, [u32]>>) -> Self {
        self.next = Some(next.into());
        self
    }

    /// Batch rows.
    pub fn len(&self) -> usize {
        self.n_new.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.n_new.is_empty()
    }
}

/// What a step reads back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Nothing: the step returns once its work is submitted (prefill, tool results).
    Nothing,
    /// The logits at each row's last token ([`Engine::append`]).
    Logits,
    /// A token drawn on the GPU by each row's sampler, with its log-probability and the
    /// alternatives the sampler asks for ([`Engine::append_sample`]).
    Sampled,
    /// The logits at every token of every row, in one chunk ([`Engine::append_all_logits`]).
    AllLogits,
    /// Every token after a row's first scored as a draw there would report it, and the batch's
    /// `next` tokens ([`Engine::append_scored`]).
    Scored,
}

/// What a step read back, as its [`Want`] asked.
#[derive(Clone, Debug)]
pub enum StepOutput {
    /// [`Want::Nothing`].
    Nothing,
    /// [`Want::Logits`].
    Logits(Logits),
    /// [`Want::Sampled`]: per batch row, `None` where it took no token.
    Sampled(Vec<Option<Sampled>>),
    /// [`Want::AllLogits`]: `[row][token][vocab]`.
    AllLogits(Vec<Vec<Vec<f32>>>),
    /// [`Want::Scored`]: per batch row, its tokens after the first and its `next`.
    Scored(Vec<Vec<Sampled>>),
}

impl StepOutput {
    fn other(&self, asked: &str) -> Error {
        Error::Input(format!("the step's output is {}, not {asked}", self.name()))
    }
    fn name(&self) -> &'static str {
        match self {
            StepOutput::Nothing => "nothing",
            StepOutput::Logits(_) => "logits",
            StepOutput::Sampled(_) => "sampled tokens",
            StepOutput::AllLogits(_) => "all-position logits",
            StepOutput::Scored(_) => "scores",
        }
    }
    /// The logits of [`Want::Logits`].
    pub fn into_logits(self) -> Result<Logits> {
        match self {
            StepOutput::Logits(l) => Ok(l),
            o => Err(o.other("logits")),
        }
    }
    /// The tokens of [`Want::Sampled`].
    pub fn into_sampled(self) -> Result<Vec<Option<Sampled>>> {
        match self {
            StepOutput::Sampled(s) => Ok(s),
            o => Err(o.other("sampled tokens")),
        }
    }
    /// The logits of [`Want::AllLogits`].
    pub fn into_all_logits(self) -> Result<Vec<Vec<Vec<f32>>>> {
        match self {
            StepOutput::AllLogits(l) => Ok(l),
            o => Err(o.other("all-position logits")),
        }
    }
    /// The scores of [`Want::Scored`].
    pub fn into_scored(self) -> Result<Vec<Vec<Sampled>>> {
        match self {
            StepOutput::Scored(s) => Ok(s),
            o => Err(o.other("scores")),
        }
    }
}

impl Engine {
    /// Run one step: `batch`'s tokens into their rows' caches, and read back what `want` asks.
    /// Everything is checked before anything is written (the rows, ids, capacity, samplers,
    /// adapters): on error no row changes, its adapter included. Blocks until the readback is
    /// done; [`Engine::step_async`] awaits it instead.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, batch: &Batch, want: Want) -> Result<StepOutput> {
        crate::gpu::pending::block_on(self.step_async(batch, want))
    }

    /// [`Engine::step`] that awaits the readback instead of blocking (the browser's form).
    pub async fn step_async(&mut self, batch: &Batch<'_>, want: Want) -> Result<StepOutput> {
        let (ids, width, n_new, rows) = (&batch.ids[..], batch.width, &batch.n_new[..], batch.rows.as_deref());
        let samplers = batch.samplers.as_deref();
        let needs_samplers =
            || samplers.ok_or_else(|| Error::Input(format!("Want::{want:?} needs the batch's samplers, one per row")));
        let restore = match &batch.adapters {
            Some(names) => Some(self.set_batch_adapters(ids, width, n_new, rows, names)?),
            None => None,
        };
        let out = match want {
            Want::Nothing => {
                self.run(ids, width, n_new, rows, None, super::step::Output::None).await.map(|_| StepOutput::Nothing)
            }
            Want::Logits => self.run_logits(ids, width, n_new, rows).await.map(StepOutput::Logits),
            Want::Sampled => match needs_samplers() {
                Ok(s) => self.run_sampled(ids, width, n_new, rows, s).await.map(StepOutput::Sampled),
                Err(e) => Err(e),
            },
            Want::AllLogits => self.run_all_logits(ids, width, n_new, rows).await.map(StepOutput::AllLogits),
            Want::Scored => match needs_samplers() {
                Ok(s) => {
                    self.run_scored(ids, width, n_new, rows, s, batch.next.as_deref()).await.map(StepOutput::Scored)
                }
                Err(e) => Err(e),
            },
        };
        if let (Err(_), Some(before)) = (&out, restore) {
            // the step wrote nothing: its rows go back to the adapters they had
            for (row, slot) in before {
                self.put_adapter(row, slot);
            }
        }
        out
    }

    /// Set each batch row's adapter, all checked first (the batch's shape included); returns each
    /// changed row's slot before, to put back if the step fails.
    fn set_batch_adapters(
        &mut self,
        ids: &[u32],
        width: usize,
        n_new: &[usize],
        rows: Option<&[usize]>,
        names: &[Option<String>],
    ) -> Result<Vec<(usize, Option<usize>)>> {
        let cache_rows = self.check(ids, width, n_new, rows)?;
        if names.len() != cache_rows.len() {
            return Err(Error::Input(format!("{} adapters for {} batch rows", names.len(), cache_rows.len())));
        }
        for (&row, name) in cache_rows.iter().zip(names) {
            self.check_adapter(row, name.as_deref())?;
        }
        let mut before = Vec::new();
        for (&row, name) in cache_rows.iter().zip(names) {
            let slot = self.adapter_slot(row);
            self.set_adapter(row, name.as_deref())?;
            if self.adapter_slot(row) != slot {
                before.push((row, slot));
            }
        }
        Ok(before)
    }
}
