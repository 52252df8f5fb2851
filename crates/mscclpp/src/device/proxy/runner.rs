//! The proxy loop, apart from what a trigger means: it polls the FIFO, hands each trigger to a
//! [`ProxyHandler`], pops in batches, backs off while idle, keeps and publishes the first error,
//! and stops on request. [`ProxyService`](super::ProxyService) runs it with the built-in handler
//! (triggers as `put`/`signal`/`flush`/`atomicAdd` on connections); [`Proxy::start`] runs it with
//! yours.
//!
//! The loop itself is a plain state machine (`Runner::step` handles one batch, with no clock
//! and no thread), so tests drive it trigger by trigger; [`Proxy`] puts it on a thread.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, warn};

use super::{LOG, PROXY_FAILED, PROXY_STOPPED};
use crate::device::fifo::Fifo;
use crate::device::trigger::ProxyTrigger;
use crate::error::{Error, Result};
use crate::sync::{Backoff, BackoffPolicy, Deadline, lock};

/// How often (in loop iterations) the proxy thread looks at its stop flag.
const STOP_CHECK_PERIOD: u32 = 1000;
/// Most triggers handled before the tail is published (at most the FIFO's size).
pub(crate) const POP_BATCH: u64 = 64;

/// The longest batch the loop pops from a FIFO of `fifo_size` slots: a batch shorter than this
/// means the FIFO ran dry.
pub(crate) fn pop_batch(fifo_size: u32) -> u64 {
    u64::from(fifo_size).min(POP_BATCH)
}
/// While the FIFO stays empty: spin 50 us, then yield (never sleep: the proxy stays ready).
const IDLE_SPIN: BackoffPolicy = BackoffPolicy {
    spin: Duration::from_micros(50),
    yield_until: Duration::MAX,
    sleep_min: Duration::ZERO,
    sleep_max: Duration::ZERO,
};
/// [`ProxyOptions::idle_backoff`]: spin 50 us, yield until 2 ms, then sleeps of 1 us growing to
/// 50 us.
const IDLE_BACKOFF: BackoffPolicy = BackoffPolicy {
    spin: Duration::from_micros(50),
    yield_until: Duration::from_millis(2),
    sleep_min: Duration::from_micros(1),
    sleep_max: Duration::from_micros(50),
};

/// What the loop does after a trigger.
///
/// C++ MSCCL++: `ProxyHandlerResult`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum HandlerResult {
    /// Pop the trigger and go on.
    Continue,
    /// Pop the trigger and stop the loop (as [`Proxy::stop`] would, without waiting for it).
    Stop,
}

/// Where the trigger handed to [`ProxyHandler::handle`] sits, and what a handler that has to
/// wait may do meanwhile.
#[derive(Debug)]
pub struct TriggerContext<'a> {
    pos: u64,
    fifo: &'a Fifo,
    stop: &'a AtomicBool,
}

impl TriggerContext<'_> {
    /// The trigger's FIFO position (what the producer's `push` returned; positions only grow,
    /// across laps of the ring).
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Frees the slots of every trigger before this one (the loop has handled them all), so that
    /// producers waiting for a slot can push while this handler waits, e.g. for a connection to
    /// drain. The loop pops them anyway once this handler returns.
    pub fn release_handled(&self) {
        self.fifo.pop_to(self.pos);
    }

    /// Whether the proxy was asked to stop: a handler that waits should give up (with an error)
    /// instead of waiting out its limit.
    pub fn stop_requested(&self) -> bool {
        // Acquire: pairs with the Release store in `Proxy::stop` (nothing else is published with
        // the flag; the ordering only keeps the flag's meaning simple).
        self.stop.load(Ordering::Acquire)
    }
}

/// What a proxy does with the triggers kernels push: MSCCL++'s proxy handler function, as a trait.
///
/// The loop calls [`handle`](Self::handle) once per trigger, in FIFO order, on the proxy thread.
/// The first error it returns becomes the proxy's error: it is published to kernels at once
/// (the FIFO's error word becomes [`PROXY_FAILED`], then [`release_waiters`](Self::release_waiters)
/// runs), returned by [`Proxy::status`] and [`Proxy::stop`], and from then on the loop pops
/// triggers without handing them over, so producers never wait on a full FIFO. A panic in a
/// handler is such an error too.
///
/// ```
/// use mscclpp::device::proxy::{HandlerResult, Proxy, ProxyHandler, ProxyOptions, TriggerContext};
/// use mscclpp::device::{Fifo, ProxyTrigger};
/// use std::sync::{Arc, atomic::{AtomicU64, Ordering}};
///
/// /// Adds up the first word of every trigger; a trigger whose second word is 1 stops the proxy.
/// struct Sum(Arc<AtomicU64>);
/// impl ProxyHandler for Sum {
///     fn handle(&mut self, t: ProxyTrigger, _: &TriggerContext<'_>) -> mscclpp::Result<HandlerResult> {
///         self.0.fetch_add(t.fst, Ordering::Relaxed);
///         Ok(if t.snd == 1 { HandlerResult::Stop } else { HandlerResult::Continue })
///     }
/// }
///
/// let sum = Arc::new(AtomicU64::new(0));
/// // A GPU FIFO comes from `Fifo::new(&ctx, device, size)`: kernels push with its device handle.
/// let fifo = Fifo::host_backed(8)?;
/// let mut proxy = Proxy::start(fifo, Sum(sum.clone()), ProxyOptions::default())?;
/// let producer = proxy.fifo().host_producer().expect("a host-backed FIFO");
/// let timeout = std::time::Duration::from_secs(10);
/// for i in 1..=100 {
///     producer.push(ProxyTrigger { fst: i, snd: 0 }, timeout)?;
/// }
/// let last = producer.push(ProxyTrigger { fst: 0, snd: 1 }, timeout)?;
/// producer.sync(last, timeout)?; // popped: everything before it was handled
/// proxy.stop()?;
/// assert_eq!(sum.load(Ordering::Relaxed), 5050);
/// # Ok::<(), mscclpp::Error>(())
/// ```
///
/// C++ MSCCL++: `ProxyHandler` (a `std::function<ProxyHandlerResult(ProxyTrigger)>`) given to
/// `Proxy`.
pub trait ProxyHandler: Send + 'static {
    /// Handles the trigger at `cx.position()`.
    ///
    /// # Errors
    /// Any error fails the proxy (see the trait's documentation); the trigger is popped.
    fn handle(&mut self, trigger: ProxyTrigger, cx: &TriggerContext<'_>) -> Result<HandlerResult>;

    /// Work between batches of triggers and while the FIFO is empty, such as publishing
    /// operations that completed since (not called once the proxy has failed).
    ///
    /// # Errors
    /// Fails the proxy, as an error of [`handle`](Self::handle) does.
    fn poll(&mut self) -> Result<()> {
        Ok(())
    }

    /// Releases whatever kernels may wait on besides the FIFO (flush words, for the built-in
    /// handler): called when the proxy fails, right after the FIFO's error word is published and
    /// before the error is visible to the host, and once more when the loop ends. Must not block.
    fn release_waiters(&mut self) {}

    /// When the loop ends without a failure (stop requested, or [`HandlerResult::Stop`]): complete
    /// what can be completed before kernels are released (e.g. publish finished flushes).
    ///
    /// # Errors
    /// Fails the proxy.
    fn drain(&mut self) -> Result<()> {
        Ok(())
    }

    /// Last, after kernels were released (the FIFO's error word is nonzero and
    /// [`release_waiters`](Self::release_waiters) ran): finish host-side work, e.g. wait for the
    /// connections' outstanding operations, with a limit. Called after a failure too.
    ///
    /// # Errors
    /// Becomes the proxy's error if it has none yet.
    fn close(&mut self) -> Result<()> {
        Ok(())
    }
}

/// How a [`Proxy`] thread runs.
#[derive(Clone, Debug, Default)]
pub struct ProxyOptions {
    /// The GPU whose kernels push into the FIFO: the thread binds to its NUMA node, makes its
    /// context current and relaxes stream-capture mode (`None` for a host-backed FIFO).
    pub device: Option<u32>,
    /// Spin, then yield, then sleep (up to 50 us) while the FIFO stays empty, instead of spinning
    /// a core. Adds wake-up latency after idle periods; off by default.
    pub idle_backoff: bool,
}

/// What the loop and its owner share.
#[derive(Debug)]
pub(crate) struct LoopShared {
    pub(crate) fifo: Arc<Fifo>,
    error: Mutex<Option<Error>>,
    failed: AtomicBool,
    stop: AtomicBool,
    processed: AtomicU64,
    /// Nanoseconds the loop found the FIFO empty, summed over its ended idle stretches: whether
    /// a slow proxy waited for producers or they waited for it.
    idle_ns: AtomicU64,
    /// When the current idle stretch began (nanoseconds since `base`, plus one; 0 while busy).
    idle_since: AtomicU64,
    base: std::time::Instant,
}

impl LoopShared {
    pub(crate) fn new(fifo: Arc<Fifo>) -> LoopShared {
        LoopShared {
            fifo,
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            processed: AtomicU64::new(0),
            idle_ns: AtomicU64::new(0),
            idle_since: AtomicU64::new(0),
            base: std::time::Instant::now(),
        }
    }

    pub(crate) fn status(&self) -> Result<()> {
        match lock(&self.error).as_ref() {
            Some(e) => Err(e.duplicate()),
            None => Ok(()),
        }
    }

    /// Time the loop has spent with the FIFO empty, the current idle stretch included (a
    /// statistic: a stretch that ends while this reads may be left out of this one reading).
    pub(crate) fn idle_time(&self) -> Duration {
        // Acquire: pairs with the Release add in `idle_ends` (see there). The sum is read first,
        // so a stretch ending in between is missed (counted short), never counted twice.
        let ended = self.idle_ns.load(Ordering::Acquire);
        // Relaxed: ordered after the load above.
        let since = self.idle_since.load(Ordering::Relaxed);
        let now = self.base.elapsed().as_nanos() as u64;
        Duration::from_nanos(ended + if since > 0 { now.saturating_sub(since - 1) } else { 0 })
    }

    /// The loop found the FIFO empty: a stretch begins unless one is under way.
    fn idle_begins(&self) {
        // Relaxed: only the loop's thread writes these; readers take a statistic.
        if self.idle_since.load(Ordering::Relaxed) == 0 {
            self.idle_since.store(self.base.elapsed().as_nanos() as u64 + 1, Ordering::Relaxed);
        }
    }

    /// The loop found work (or ends): the current idle stretch, if any, ends.
    fn idle_ends(&self) {
        // Relaxed: only the loop's thread writes `idle_since`.
        let since = self.idle_since.load(Ordering::Relaxed);
        if since > 0 {
            let now = self.base.elapsed().as_nanos() as u64;
            // The stretch is closed first, then added (Release): a reader whose Acquire load of
            // the sum sees it also sees the closed stretch, so nothing is counted twice.
            self.idle_since.store(0, Ordering::Relaxed);
            self.idle_ns.fetch_add(now.saturating_sub(since - 1), Ordering::Release);
        }
    }

    pub(crate) fn processed(&self) -> u64 {
        // Acquire: pairs with the AcqRel fetch_add in `Runner::step`, which comes after the pop
        // of those triggers.
        self.processed.load(Ordering::Acquire)
    }

    /// Keeps the first error and publishes it: `failed`, the FIFO's error word, then
    /// `release` (the handler's other words), all under the error's lock, so that whoever sees
    /// the error in [`status`](Self::status) also sees the words already published.
    fn fail(&self, e: Error, release: impl FnOnce()) {
        let mut g = lock(&self.error);
        // Release: pairs with the Acquire load in `Runner::failed`; only the proxy thread reads
        // it, so this is belt and braces for a handler that calls into the loop from elsewhere.
        self.failed.store(true, Ordering::Release);
        self.fifo.set_proxy_error(PROXY_FAILED);
        release();
        if g.is_none() {
            warn!(target: LOG, "proxy failed: {e}");
            *g = Some(e);
        }
    }
}

/// The loop over one FIFO and one handler, without a thread: [`step`](Self::step) handles one
/// batch, [`finish`](Self::finish) ends it. [`Proxy`] runs it on a thread.
pub(crate) struct Runner<H> {
    sh: Arc<LoopShared>,
    handler: H,
    /// The next FIFO position to handle (ahead of the FIFO's tail within a batch).
    cursor: u64,
    batch: u64,
    /// The position whose trigger the handler is handling now (for a panic that cuts it short).
    handling: Option<u64>,
}

/// What one [`Runner::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Handled (or, after a failure, skipped) this many triggers.
    Worked(u64),
    /// The FIFO was empty.
    Idle,
    /// The handler asked to stop (after handling the triggers of this batch).
    Stop,
}

impl<H: ProxyHandler> Runner<H> {
    pub(crate) fn new(sh: Arc<LoopShared>, handler: H) -> Runner<H> {
        // Pops are batched: the proxy reads ahead of `tail` and publishes it once per batch, so
        // producers waiting for slots see fewer, larger steps and the tail's cache line moves
        // between the CPU and the GPU's reads less often.
        let batch = pop_batch(sh.fifo.size());
        let cursor = sh.fifo.tail();
        Runner { sh, handler, cursor, batch, handling: None }
    }

    #[cfg(test)]
    pub(crate) fn handler(&mut self) -> &mut H {
        &mut self.handler
    }
    #[cfg(test)]
    pub(crate) fn sh_fifo(&self) -> &Fifo {
        &self.sh.fifo
    }
    #[cfg(test)]
    pub(crate) fn sh_status(&self) -> Result<()> {
        self.sh.status()
    }
    /// What `Proxy::stop` does to the flag, without a thread.
    #[cfg(test)]
    pub(crate) fn request_stop(&self) {
        self.sh.stop.store(true, Ordering::Release);
    }

    fn failed(&self) -> bool {
        // Acquire: pairs with the Release store in `LoopShared::fail`.
        self.sh.failed.load(Ordering::Acquire)
    }

    fn fail(&mut self, e: Error) {
        let h = &mut self.handler;
        self.sh.fail(e, || h.release_waiters());
    }

    /// Lets the handler poll, then handles up to one batch of triggers and pops them.
    pub(crate) fn step(&mut self) -> Step {
        if !self.failed()
            && let Err(e) = self.handler.poll()
        {
            self.fail(e);
        }
        let first = self.cursor;
        let mut stop = false;
        while self.cursor - first < self.batch && !stop {
            let Some(t) = self.sh.fifo.poll_at(self.cursor) else { break };
            let pos = self.cursor;
            if !self.failed() {
                let cx = TriggerContext { pos, fifo: &self.sh.fifo, stop: &self.sh.stop };
                self.handling = Some(pos);
                let r = self.handler.handle(t, &cx);
                self.handling = None;
                match r {
                    Ok(HandlerResult::Continue) => {}
                    Ok(HandlerResult::Stop) => stop = true,
                    Err(e) => self.fail(at_position(e, pos)),
                }
            }
            self.cursor += 1;
        }
        if self.cursor > first {
            self.sh.fifo.pop_to(self.cursor);
            // AcqRel: the Release half pairs with the Acquire load in `LoopShared::processed`,
            // so a host that sees the count also sees the tail (and the handlers' effects).
            self.sh.processed.fetch_add(self.cursor - first, Ordering::AcqRel);
        }
        match (stop, self.cursor - first) {
            (true, _) => Step::Stop,
            (false, 0) => Step::Idle,
            (false, n) => Step::Worked(n),
        }
    }

    /// Ends the loop: the handler drains (unless failed), kernels are released (the FIFO's error
    /// word becomes [`PROXY_STOPPED`] unless it says failed, and the handler's waiters are
    /// released), then the handler closes.
    pub(crate) fn finish(&mut self) {
        self.sh.idle_ends();
        if !self.failed()
            && let Err(e) = self.handler.drain()
        {
            self.fail(e);
        }
        if self.sh.fifo.proxy_error() == 0 {
            self.sh.fifo.set_proxy_error(PROXY_STOPPED);
        }
        self.handler.release_waiters();
        if let Err(e) = self.handler.close() {
            self.fail(e.during("stopping the proxy"));
        }
    }

    /// Steps until asked to stop (the flag is checked every 1000 iterations), backing off while
    /// idle, then [`finish`](Self::finish)es.
    fn run(&mut self, idle_backoff: bool) {
        let mut countdown = STOP_CHECK_PERIOD;
        let mut idle: Option<Backoff> = None;
        let idle_policy = if idle_backoff { IDLE_BACKOFF } else { IDLE_SPIN };
        loop {
            countdown -= 1;
            if countdown == 0 {
                countdown = STOP_CHECK_PERIOD;
                // Acquire: pairs with the Release store in `Proxy::stop`.
                if self.sh.stop.load(Ordering::Acquire) {
                    break;
                }
            }
            match self.step() {
                Step::Worked(_) => {
                    // The clock is read only at an idle stretch's two ends.
                    if idle.take().is_some() {
                        self.sh.idle_ends();
                    }
                }
                Step::Idle => {
                    if idle.is_none() {
                        self.sh.idle_begins();
                    }
                    idle.get_or_insert_with(|| Backoff::new(idle_policy)).snooze(&Deadline::never())
                }
                Step::Stop => {
                    self.sh.stop.store(true, Ordering::Release);
                    break;
                }
            }
        }
        self.finish();
    }

    /// [`run`](Self::run), with a panic of the handler turned into the proxy's error. The loop
    /// then goes on, failed: it pops triggers without handing them over until asked to stop, as
    /// after an error, so producers never wait on a full FIFO. A second panic (the handler's
    /// `release_waiters` or `close` while finishing) ends the thread; the error word is already
    /// set by then.
    fn run_guarded(&mut self, idle_backoff: bool) {
        let mut panicked = false;
        loop {
            let Err(p) = catch_unwind(AssertUnwindSafe(|| self.run(idle_backoff))) else { return };
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            let e = Error::internal(format!("the proxy handler panicked: {what}"));
            // The handler may be half-way through something: release its waiters only if that
            // does not panic too.
            let h = &mut self.handler;
            self.sh.fail(e, || {
                let _ = catch_unwind(AssertUnwindSafe(|| h.release_waiters()));
            });
            // The batch the panic cut short: the triggers handled in it and the one whose
            // handling panicked are popped (an error pops its trigger too), so that no later
            // proxy on this FIFO hands them over again.
            let upto = self.handling.take().map_or(self.cursor, |pos| pos + 1).max(self.cursor);
            let before = self.sh.fifo.tail();
            self.cursor = upto;
            if upto > before {
                self.sh.fifo.pop_to(upto);
                // AcqRel: as in `step`.
                self.sh.processed.fetch_add(upto - before, Ordering::AcqRel);
            }
            if panicked {
                return;
            }
            panicked = true;
        }
    }
}

/// A proxy thread running a [`ProxyHandler`] on a [`Fifo`]: MSCCL++'s `Proxy`. See the
/// handler's documentation for an example. Dropping a running proxy stops it (the error, if
/// any, is logged).
///
/// C++ MSCCL++: `Proxy`.
pub struct Proxy {
    sh: Arc<LoopShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("fifo_size", &self.sh.fifo.size())
            .field("running", &self.thread.is_some())
            .finish()
    }
}

impl Proxy {
    /// Starts a thread that hands every trigger pushed into `fifo` to `handler`.
    ///
    /// A FIFO has one proxy at a time. A FIFO whose earlier proxy stopped or failed can be
    /// served again (pass the same `Arc<Fifo>`): its error word goes back to 0, so kernels'
    /// time-limited waits work again, and the new proxy starts at the earlier one's `tail`
    /// (triggers it left unpopped are handed over; those it handled, or whose handling failed
    /// or panicked, are not).
    ///
    /// # Errors
    /// `InvalidUsage` while another proxy serves `fifo`; `System` when the thread cannot start;
    /// with `options.device`, CUDA errors making the device's context current on it.
    pub fn start(fifo: impl Into<Arc<Fifo>>, handler: impl ProxyHandler, options: ProxyOptions) -> Result<Proxy> {
        Self::start_shared(Arc::new(LoopShared::new(fifo.into())), handler, options)
    }

    pub(crate) fn start_shared(
        sh: Arc<LoopShared>,
        handler: impl ProxyHandler,
        options: ProxyOptions,
    ) -> Result<Proxy> {
        sh.fifo.claim()?;
        // Ends the claim when dropped: when the thread ends, whatever way, or with the closure
        // if the thread cannot start.
        let claim = Claim(sh.fifo.clone());
        let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
        let mut runner = Runner::new(sh.clone(), handler);
        let t = std::thread::Builder::new()
            .name(match options.device {
                Some(d) => format!("mscclpp-proxy-gpu{d}"),
                None => "mscclpp-proxy".to_string(),
            })
            .spawn(move || {
                let _claim = claim;
                let init = init_thread(options.device);
                let ok = init.is_ok();
                if ok && runner.sh.fifo.proxy_error() != 0 {
                    // An earlier proxy of this FIFO stopped or failed: this one runs now.
                    runner.sh.fifo.set_proxy_error(0);
                }
                let _ = tx.send(init);
                if ok {
                    runner.run_guarded(options.idle_backoff);
                }
            })
            .map_err(|e| Error::io("starting the proxy thread", e))?;
        match rx.recv() {
            Ok(Ok(())) => Ok(Proxy { sh, thread: Some(t) }),
            Ok(Err(e)) => {
                let _ = t.join();
                Err(e.during("starting the proxy thread"))
            }
            Err(_) => {
                let _ = t.join();
                Err(Error::internal("the proxy thread ended before it started"))
            }
        }
    }

    /// The FIFO the proxy serves.
    pub fn fifo(&self) -> &Fifo {
        &self.sh.fifo
    }

    /// Triggers popped so far (handled or, after an error, skipped).
    pub fn processed(&self) -> u64 {
        self.sh.processed()
    }

    /// How long the loop has found the FIFO empty, the current idle stretch included: beside
    /// [`processed`](Self::processed), whether the proxy waited for producers (much idle time)
    /// or they waited for it (little).
    pub fn idle_time(&self) -> Duration {
        self.sh.idle_time()
    }

    /// `Ok` while the proxy works; its first error otherwise (also after `stop`).
    pub fn status(&self) -> Result<()> {
        self.sh.status()
    }

    /// Whether the thread is still running (false once it stopped, on request or by
    /// [`HandlerResult::Stop`]).
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the thread and waits for it: the loop ends (see [`ProxyHandler`] for what the
    /// handler does then) and kernels see a nonzero FIFO error word. Calling it again returns
    /// the same result.
    ///
    /// # Errors
    /// The proxy's first error.
    pub fn stop(&mut self) -> Result<()> {
        // Release: pairs with the Acquire loads in `Runner::run` and
        // `TriggerContext::stop_requested`.
        self.sh.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            // `run_guarded` catches the handler's panics: this is a panic of the loop itself.
            self.sh.fail(Error::internal("the proxy thread panicked"), || {});
        }
        self.sh.status()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            debug!(target: LOG, "proxy dropped after an error: {e}");
        }
    }
}

/// A proxy's claim on its FIFO ([`Fifo::claim`]), ended when dropped.
struct Claim(Arc<Fifo>);

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.release_claim();
    }
}

/// Names the trigger's FIFO position in a handler's error: as the operation, or, when the error
/// already names one (a connection's `write`, say), in a note, so both stay visible.
fn at_position(e: Error, pos: u64) -> Error {
    let what = format!("executing the trigger at FIFO position {pos}");
    if e.operation().is_some() { e.with_note(format!("while {what}")) } else { e.during(what) }
}

/// Binds the proxy thread to the GPU's NUMA node, makes its context current and relaxes
/// stream-capture mode (so a graph capture in another thread is never disturbed).
fn init_thread(device: Option<u32>) -> Result<()> {
    if let Some(d) = device {
        if let Some(n) = crate::platform::cuda::numa_node(d)
            && let Err(e) = crate::platform::numa::bind_thread_to_node(n)
        {
            warn!(target: LOG, "proxy thread: could not bind to NUMA node {n}: {e}");
        }
        crate::platform::cuda::device(d)?.bind()?;
        crate::platform::cuda::relax_stream_capture_mode()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ErrorKind;
    use crate::device::fifo::HostProducer;

    /// Records what it was handed; fails at one position; stops at another.
    #[derive(Default)]
    struct Recorder {
        seen: Vec<(u64, ProxyTrigger)>,
        fail_at: Option<u64>,
        stop_at: Option<u64>,
        released: u32,
        polls: u64,
        drained: bool,
        closed: bool,
    }

    impl ProxyHandler for Recorder {
        fn handle(&mut self, t: ProxyTrigger, cx: &TriggerContext<'_>) -> Result<HandlerResult> {
            self.seen.push((cx.position(), t));
            if self.fail_at == Some(cx.position()) {
                return Err(Error::invalid_usage(format!("refusing {}", t.fst)));
            }
            Ok(if self.stop_at == Some(cx.position()) { HandlerResult::Stop } else { HandlerResult::Continue })
        }
        fn poll(&mut self) -> Result<()> {
            self.polls += 1;
            Ok(())
        }
        fn release_waiters(&mut self) {
            self.released += 1;
        }
        fn drain(&mut self) -> Result<()> {
            self.drained = true;
            Ok(())
        }
        fn close(&mut self) -> Result<()> {
            self.closed = true;
            Ok(())
        }
    }

    fn runner(size: u32, h: Recorder) -> Runner<Recorder> {
        Runner::new(Arc::new(LoopShared::new(Arc::new(Fifo::host_backed(size).unwrap()))), h)
    }

    fn producer<H>(r: &Runner<H>) -> HostProducer<'_> {
        r.sh.fifo.host_producer().unwrap()
    }

    fn trig(i: u64) -> ProxyTrigger {
        ProxyTrigger { fst: i, snd: i.wrapping_mul(0x9e37_79b9) & !(1 << 63) }
    }

    /// Pushes what fits (never blocking: `push_for` with no time), steps, and repeats: many more
    /// triggers than slots go through in order, each handed over once at its position, popped in
    /// batches of at most the FIFO's size.
    #[test]
    fn many_more_triggers_than_slots_wrap_in_order() {
        for size in [1u32, 2, 8, 128] {
            let mut r = runner(size, Recorder::default());
            let total = u64::from(size) * 50 + 3;
            let (mut pushed, mut steps) = (0u64, 0u64);
            while r.handler().seen.len() < total as usize {
                while pushed < total && producer(&r).push_for(trig(pushed), Duration::ZERO).unwrap().is_some() {
                    pushed += 1;
                }
                match r.step() {
                    Step::Worked(n) => assert!(n <= u64::from(size).min(POP_BATCH), "size {size}: batch of {n}"),
                    s => panic!("size {size}: {s:?} with {pushed} pushed and {} seen", r.handler().seen.len()),
                }
                assert_eq!(r.sh.fifo.tail(), r.handler().seen.len() as u64, "popped what was handled");
                steps += 1;
                assert!(steps <= total, "size {size}: no progress");
            }
            assert_eq!(r.step(), Step::Idle);
            let seen = &r.handler().seen;
            assert!(
                seen.iter().enumerate().all(|(i, &(pos, t))| pos == i as u64 && t == trig(i as u64)),
                "size {size}"
            );
            assert_eq!(r.sh.processed(), total);
            assert!(r.sh.status().is_ok());
        }
    }

    /// The first error is published before the host can see it: the FIFO's error word and the
    /// handler's waiters, then the error naming the position. Later triggers (more than the
    /// FIFO holds) are popped without being handed over, a later error does not replace the
    /// first, and `finish` keeps the failure visible (no drain after a failure; close still runs).
    #[test]
    fn the_first_error_is_published_and_kept() {
        let mut r = runner(4, Recorder { fail_at: Some(2), ..Recorder::default() });
        for i in 0..4 {
            producer(&r).push(trig(i), Duration::ZERO).unwrap();
        }
        assert_eq!(r.step(), Step::Worked(4));
        assert_eq!(r.sh.fifo.proxy_error(), PROXY_FAILED);
        assert_eq!(r.handler().released, 1, "waiters released once, at the failure");
        assert_eq!(r.handler().seen.len(), 3, "nothing handed over after the failure");
        let e = r.sh.status().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage);
        assert!(e.to_string().contains("FIFO position 2") && e.to_string().contains("refusing 2"), "{e}");
        // More than the ring holds: producers are never stuck behind a failed proxy.
        let polls = r.handler().polls;
        for i in 4..40 {
            producer(&r).push(trig(i), Duration::ZERO).unwrap();
            assert_eq!(r.step(), Step::Worked(1));
        }
        assert_eq!(r.handler().seen.len(), 3);
        assert_eq!(r.handler().polls, polls, "no polling once failed");
        assert_eq!(r.sh.processed(), 40);
        r.fail(Error::internal("a second error"));
        assert!(r.sh.status().unwrap_err().to_string().contains("refusing 2"), "the first error stays");
        r.finish();
        assert_eq!(r.sh.fifo.proxy_error(), PROXY_FAILED, "stopping keeps the failure visible");
        let h = r.handler();
        assert!(!h.drained && h.closed);
    }

    /// `HandlerResult::Stop` ends the batch after that trigger (it is popped, the next is not);
    /// `finish` drains, publishes `PROXY_STOPPED`, releases waiters and closes.
    #[test]
    fn a_handler_can_stop_the_loop() {
        let mut r = runner(8, Recorder { stop_at: Some(1), ..Recorder::default() });
        for i in 0..3 {
            producer(&r).push(trig(i), Duration::ZERO).unwrap();
        }
        assert_eq!(r.step(), Step::Stop);
        assert_eq!(r.sh.fifo.tail(), 2);
        r.finish();
        assert_eq!(r.sh.fifo.proxy_error(), PROXY_STOPPED);
        let h = r.handler();
        assert!(h.drained && h.closed && h.released == 1);
        assert!(r.sh.status().is_ok());
    }

    /// Counts what it is handed; panics on a trigger whose `fst` is 7.
    struct Panics(Arc<AtomicU64>);
    impl ProxyHandler for Panics {
        fn handle(&mut self, t: ProxyTrigger, _: &TriggerContext<'_>) -> Result<HandlerResult> {
            self.0.fetch_add(1, Ordering::Relaxed);
            assert!(t.fst != 7, "seven is not allowed");
            Ok(HandlerResult::Continue)
        }
    }

    /// A handler that panics fails the proxy instead of leaving kernels waiting: the error word
    /// is published, the loop goes on popping without handing over (many more triggers than
    /// the FIFO holds go through), and `stop` returns the panic as the error.
    #[test]
    fn a_panicking_handler_is_the_proxy_error() {
        let seen = Arc::new(AtomicU64::new(0));
        let mut p = Proxy::start(Fifo::host_backed(4).unwrap(), Panics(seen.clone()), ProxyOptions::default()).unwrap();
        let producer = p.fifo().host_producer().unwrap();
        let t = Duration::from_secs(30);
        producer.push(trig(1), t).unwrap();
        producer.push(ProxyTrigger { fst: 7, snd: 0 }, t).unwrap();
        let mut last = 0;
        for i in 0..40 {
            last = producer.push(trig(100 + i), t).unwrap();
        }
        producer.sync(last, t).unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), 2, "nothing handed over after the panic");
        assert_eq!(p.fifo().proxy_error(), PROXY_FAILED);
        assert!(p.is_running(), "the loop goes on after a panic, popping");
        let e = p.stop().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
        assert!(e.to_string().contains("seven is not allowed"), "{e}");
        assert_eq!(p.fifo().proxy_error(), PROXY_FAILED);
        assert_eq!(p.processed(), 42);
    }

    /// One proxy at a time per FIFO; after it stopped (here: failed on a panic) another serves
    /// the same FIFO from where it left off: the error word is back to 0, the panicking trigger
    /// and those before it are not handed over again, triggers pushed meanwhile are.
    #[test]
    fn a_fifo_is_served_by_one_proxy_at_a_time_and_again_after_it() {
        let fifo = Arc::new(Fifo::host_backed(4).unwrap());
        let first_seen = Arc::new(AtomicU64::new(0));
        let mut first = Proxy::start(fifo.clone(), Panics(first_seen.clone()), ProxyOptions::default()).unwrap();
        let e = Proxy::start(fifo.clone(), Panics(Arc::default()), ProxyOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("already serves this FIFO"), "{e}");
        let producer = fifo.host_producer().unwrap();
        let t = Duration::from_secs(30);
        producer.push(trig(1), t).unwrap();
        let bad = producer.push(ProxyTrigger { fst: 7, snd: 0 }, t).unwrap();
        producer.sync(bad, t).unwrap();
        assert!(first.stop().is_err());
        assert_eq!(fifo.proxy_error(), PROXY_FAILED);
        // Pushed while no proxy runs (fits in the ring), handled by the next one.
        producer.push(trig(2), t).unwrap();
        let second_seen = Arc::new(AtomicU64::new(0));
        let mut second = Proxy::start(fifo.clone(), Panics(second_seen.clone()), ProxyOptions::default()).unwrap();
        assert_eq!(fifo.proxy_error(), 0, "a new proxy publishes that it runs");
        let last = producer.push(trig(3), t).unwrap();
        producer.sync(last, t).unwrap();
        second.stop().unwrap();
        assert_eq!(first_seen.load(Ordering::Relaxed), 2);
        assert_eq!(second_seen.load(Ordering::Relaxed), 2, "only the triggers the first proxy never popped");
        assert_eq!(fifo.proxy_error(), PROXY_STOPPED);
    }

    /// The loop adds up the time it finds the FIFO empty, the current stretch included: the
    /// count grows while nothing is pushed (waited for as an event, not timed), stops growing
    /// while the loop has work, and never goes back.
    #[test]
    fn idle_time_adds_up_the_empty_stretches() {
        let mut p =
            Proxy::start(Fifo::host_backed(4).unwrap(), Panics(Arc::default()), ProxyOptions::default()).unwrap();
        let producer = p.fifo().host_producer().unwrap();
        let t = Duration::from_secs(30);
        let pos = producer.push(trig(1000), t).unwrap();
        producer.sync(pos, t).unwrap();
        let first = p.idle_time();
        let deadline = std::time::Instant::now() + t;
        while p.idle_time() <= first {
            assert!(std::time::Instant::now() < deadline, "the idle time never grew with an empty FIFO");
            std::thread::yield_now();
        }
        let mut last = p.idle_time();
        for i in 0..100 {
            let pos = producer.push(trig(1001 + i), t).unwrap();
            producer.sync(pos, t).unwrap();
            last = last.max(p.idle_time());
        }
        p.stop().unwrap();
        // Stopped: the last stretch ended, the count is final and no reading exceeded it.
        let end = p.idle_time();
        assert!(end >= last, "a reading ({last:?}) passed the final count ({end:?})");
        assert_eq!(p.idle_time(), end, "the count grew after the loop ended");
    }

    /// On a thread, with a producer far ahead of a small FIFO: every trigger is handled once, in
    /// order, and `stop` joins cleanly.
    #[test]
    fn the_thread_handles_every_trigger_once() {
        struct Check {
            next: u64,
        }
        impl ProxyHandler for Check {
            fn handle(&mut self, t: ProxyTrigger, cx: &TriggerContext<'_>) -> Result<HandlerResult> {
                if t != trig(self.next) || cx.position() != self.next {
                    return Err(Error::internal(format!("expected {} at {}, got {t:?}", self.next, cx.position())));
                }
                self.next += 1;
                Ok(HandlerResult::Continue)
            }
        }
        let mut p = Proxy::start(Fifo::host_backed(4).unwrap(), Check { next: 0 }, ProxyOptions::default()).unwrap();
        let producer = p.fifo().host_producer().unwrap();
        let t = Duration::from_secs(30);
        let mut last = 0;
        for i in 0..10_000 {
            last = producer.push(trig(i), t).unwrap();
        }
        producer.sync(last, t).unwrap();
        p.stop().unwrap();
        // After the join: the count is added after each batch's pop, so `sync` alone does not
        // order it.
        assert_eq!(p.processed(), 10_000);
        assert_eq!(p.fifo().proxy_error(), PROXY_STOPPED);
    }
}
