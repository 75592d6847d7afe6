//! Work that never blocks a frame. Natively a readback waits for the GPU inside `poll`; an app
//! that draws at 60 Hz on the same device cannot stall there for a decode step. A [`Pending`]
//! runs an engine's async call (the same calls the browser awaits) so that its readbacks only
//! check whether the GPU is done: the app polls it once a frame and gets control back at once.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::gpu::device::Gpu;

thread_local! {
    /// Whether readbacks on this thread wait for the GPU (natively). Only [`Pending::poll`]
    /// turns it off, and every blocking call ([`block_on`]) turns it back on for its own work.
    static READBACKS_WAIT: Cell<bool> = const { Cell::new(true) };
}

/// Whether a readback on this thread should wait for the GPU (natively; the browser never waits).
pub(crate) fn readbacks_wait() -> bool {
    READBACKS_WAIT.with(Cell::get)
}

/// Sets [`READBACKS_WAIT`] for a scope and puts the previous value back when dropped.
struct WaitMode(bool);

impl WaitMode {
    fn set(wait: bool) -> WaitMode {
        WaitMode(READBACKS_WAIT.with(|c| c.replace(wait)))
    }
}

impl Drop for WaitMode {
    fn drop(&mut self) {
        READBACKS_WAIT.with(|c| c.set(self.0));
    }
}

/// Run `work` to completion on this thread, its readbacks waiting for the GPU: the blocking
/// forms of the engine's calls. Inside a [`Pending`] too, where a blocking call must still wait
/// (nothing else would poll the device while it blocks).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn block_on<T>(work: impl Future<Output = T>) -> T {
    let _mode = WaitMode::set(true);
    pollster::block_on(work)
}

/// The result of `work` that awaits nothing but submissions (recording and submitting a chunk):
/// with readbacks waiting, nothing in it is pending, so one poll finishes it, natively and in
/// the browser.
pub(crate) fn now<T>(work: impl Future<Output = T>) -> T {
    let _mode = WaitMode::set(true);
    let mut work = std::pin::pin!(work);
    match work.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("submitting a chunk waits for nothing when readbacks wait"),
    }
}

/// A future that is pending once (asking to be polled again) and then ready: where a call in a
/// [`Pending`] gives the app's frame its turn between two submissions.
pub(crate) async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

/// An engine call in flight that the app checks each frame instead of waiting for it: build it
/// from the async form of the call (`Scheduler::step_async`, `Engine::decode_steps_async`, ...),
/// moving the engine into the future, and call [`Pending::poll`] once a frame.
///
/// ```no_run
/// # use kvdecode::{Engine, Event, Gpu, Scheduler, gpu::pending::Pending};
/// # fn frame(gpu: &Gpu, mut engine: Engine, mut sched: Scheduler) {
/// let mut step = Pending::new(gpu, async move {
///     let mut tokens = Vec::new();
///     let done = sched
///         .step_async(&mut engine, &mut |e| {
///             if let Event::Token { id, token, .. } = e {
///                 tokens.push((id, token));
///             }
///         })
///         .await;
///     (engine, sched, tokens, done)
/// });
/// // each frame, after drawing:
/// if let Some((engine, sched, tokens, done)) = step.poll() { /* show the tokens */ }
/// # }
/// ```
///
/// Natively the first `poll` records and submits the step and returns; later ones find the
/// readback done or not. In the browser the event loop completes readbacks, so awaiting the
/// async call there already leaves the page free (as the web crate does).
pub struct Pending<T> {
    // in the browser the event loop completes readbacks: nothing to poll
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    device: wgpu::Device,
    work: Option<Pin<Box<dyn Future<Output = T>>>>,
}

impl<T> Pending<T> {
    /// `work`, not started yet: the first [`Pending::poll`] starts it.
    pub fn new(gpu: &Gpu, work: impl Future<Output = T> + 'static) -> Self {
        Pending { device: gpu.device.clone(), work: Some(Box::pin(work)) }
    }

    /// Let the device finish what it can without waiting, then run the work as far as it goes
    /// without waiting. `Some` with its result once, when it finished; `None` before (and after).
    pub fn poll(&mut self) -> Option<T> {
        let work = self.work.as_mut()?;
        // natively, readback callbacks run inside poll: a step the GPU finished completes now
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.device.poll(wgpu::PollType::Poll);
        let result = {
            let _mode = WaitMode::set(false);
            // the app polls again each frame, so nothing needs waking
            work.as_mut().poll(&mut Context::from_waker(Waker::noop()))
        };
        match result {
            Poll::Ready(v) => {
                self.work = None;
                Some(v)
            }
            Poll::Pending => None,
        }
    }

    /// Whether the work finished and its result was taken.
    pub fn is_done(&self) -> bool {
        self.work.is_none()
    }
}
