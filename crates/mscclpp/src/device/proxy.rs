//! The proxy service: a host thread that executes the triggers kernels push into a [`Fifo`].
//!
//! A kernel pushes `put`/`signal`/`flush`/`atomicAdd` requests (see [`trigger`](super::trigger));
//! the proxy thread pops them in order and runs them on the connections of the semaphores they
//! name: `put` is [`Connection::write`] between two registered memories, `signal` is the
//! semaphore's `update_and_sync` (outbound token + 1), `atomicAdd` is
//! [`Connection::atomic_add`], and `flush` records the connection's current sequence number
//! ([`Connection::request_progress`]) and returns at once.
//!
//! # Flushes
//! Each connection has one `flushDonePos` word in mapped pinned host memory (shared by every
//! channel on that connection, as in MSCCL++). A flush at FIFO position `p` is recorded as
//! `(p, s)` with `s` the connection's issued sequence number; between triggers the proxy polls
//! [`Connection::progress`] and, once `completed >= s`, stores `p + 1` into the word (release).
//! A kernel flushing at position `p` waits until the word exceeds `p`. So a flush never blocks
//! other channels' requests, and, because its target is a fixed sequence number rather than
//! "nothing outstanding", it completes under continuous traffic too.
//!
//! # Back pressure
//! With [`ProxyConfig::max_write_queue_size`], the proxy keeps at most that many operations in
//! flight per connection: before issuing more it polls that connection's progress (publishing
//! other connections' flushes meanwhile). Connections also bound their own queues.
//!
//! # Errors
//! The first error (a trigger that does not decode or names an unknown semaphore or memory, a
//! refused request, a transport failure, a peer gone) is kept. It is published to the device at
//! once: the FIFO's error word becomes [`PROXY_FAILED`] and every `flushDonePos` word
//! `u64::MAX`, so `wait_for`/`flush_for` in kernels return false and `flush` returns. The proxy
//! then keeps popping triggers without executing them, so producers never wait on a full FIFO.
//! [`ProxyService::status`] and [`ProxyService::stop`] return the error.
//!
//! # CUDA IPC atomics
//! An `atomicAdd` trigger on a CUDA IPC connection is refused (a recorded error): a proxy can
//! only add through a kernel, and that kernel cannot be scheduled while the pushing kernel
//! occupies the GPU (or costs milliseconds from another context). Kernels add to a peer's memory
//! over CUDA IPC directly, with `atom`/`red` `.sys` on the mapped pointer (MemoryChannel's
//! atomics). Over Ethernet and IB, `atomicAdd` runs on the connection.
//!
//! # Threads and CUDA
//! The proxy thread binds to the GPU's NUMA node, makes the device's context current and sets
//! relaxed stream-capture mode, so a graph capture in another thread is never disturbed; it uses
//! only the connections' non-blocking streams and launches no kernels. It checks its stop flag
//! every 1000 iterations. User code must not launch work on the legacy default stream while a
//! kernel served by a proxy spins (that work waits for the kernel, which waits for the proxy).
//!
//! C++ MSCCL++: `ProxyService` (with `Proxy` and `BaseProxyService`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, warn};

use super::fifo::{DEFAULT_FIFO_SIZE, Fifo};
use super::handles::Host2DeviceSemaphoreDeviceHandle;
use super::trigger::{MAX_MEMORY_ID, MAX_SEMAPHORE_ID, ProxyTrigger, Request, decode};
use crate::conn::Connection;
use crate::context::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::RegisteredMemory;
use crate::platform::hostmem::Region;
use crate::semaphore::{Host2DeviceSemaphore, Semaphore};
use crate::sync::{Backoff, BackoffPolicy, Deadline, lock};
use crate::transport::Transport;

const LOG: &str = "mscclpp::proxy";

/// The FIFO error word's value once the proxy has failed (see the module documentation).
pub const PROXY_FAILED: u64 = 1;
/// The FIFO error word's value once the proxy has stopped cleanly.
pub const PROXY_STOPPED: u64 = 2;

/// How often (in loop iterations) the proxy thread looks at its stop flag.
const STOP_CHECK_PERIOD: u32 = 1000;
/// How long `stop` waits for each connection's outstanding operations.
const STOP_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// How long back pressure waits for one connection to make room before failing.
const BACK_PRESSURE_LIMIT: Duration = Duration::from_secs(30);
/// Most triggers handled before the tail is published (at most the FIFO's size).
const POP_BATCH: u64 = 64;
/// While the FIFO stays empty: spin 50 us, then yield (never sleep: the proxy stays ready).
const IDLE_SPIN: BackoffPolicy = BackoffPolicy {
    spin: Duration::from_micros(50),
    yield_until: Duration::MAX,
    sleep_min: Duration::ZERO,
    sleep_max: Duration::ZERO,
};
/// [`ProxyConfig::idle_backoff`]: spin 50 us, yield until 2 ms, then sleeps of 1 us growing to
/// 50 us.
const IDLE_BACKOFF: BackoffPolicy = BackoffPolicy {
    spin: Duration::from_micros(50),
    yield_until: Duration::from_millis(2),
    sleep_min: Duration::from_micros(1),
    sleep_max: Duration::from_micros(50),
};

/// A memory's ID in one [`ProxyService`] (what triggers carry, at most 511).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryId(pub u32);

/// A semaphore's ID in one [`ProxyService`] (what triggers carry, at most 1023).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SemaphoreId(pub u32);

/// How a [`ProxyService`] runs.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// FIFO slots, a power of two (default 512, as MSCCL++).
    pub fifo_size: u32,
    /// Most operations in flight per connection before the proxy waits for completions
    /// (`None`: only the connection's own bound applies; MSCCL++ uses the CQ size for IB).
    pub max_write_queue_size: Option<usize>,
    /// Spin, then yield, then sleep (up to 50 us) while the FIFO stays empty, instead of
    /// spinning a core. Adds wake-up latency after idle periods; off by default.
    pub idle_backoff: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig { fifo_size: DEFAULT_FIFO_SIZE, max_write_queue_size: None, idle_backoff: false }
    }
}

/// A semaphore the proxy signals, made from a [`Host2DeviceSemaphore`] (a kernel waits on its
/// local token) or a plain [`Semaphore`] (`.into()`, or pass either to
/// [`ProxyService::add_semaphore`]). It owns the semaphore: the proxy keeps the outbound count
/// from then on.
#[derive(Debug)]
pub struct ProxySemaphore {
    owner: Owner,
    /// The last token value sent to the peer (continues the semaphore's own count).
    outbound: AtomicU64,
}

/// The semaphore a [`ProxySemaphore`] owns (its local token is what kernels wait on).
#[derive(Debug)]
enum Owner {
    Host2Device(Host2DeviceSemaphore),
    Plain(Semaphore),
}

impl ProxySemaphore {
    /// The underlying semaphore.
    pub fn semaphore(&self) -> &Semaphore {
        match &self.owner {
            Owner::Host2Device(s) => s.semaphore(),
            Owner::Plain(s) => s,
        }
    }
    /// The connection the proxy signals over.
    pub fn connection(&self) -> &Connection {
        self.semaphore().connection()
    }
    /// The handle kernels wait with (`None` for a plain [`Semaphore`]).
    pub fn device_handle(&self) -> Option<Host2DeviceSemaphoreDeviceHandle> {
        match &self.owner {
            Owner::Host2Device(s) => Some(s.device_handle()),
            Owner::Plain(_) => None,
        }
    }
    /// The peer's token becomes outbound + 1, after every earlier operation of the connection.
    fn signal(&self) -> Result<()> {
        // Acquire: pairs with the AcqRel swap in `Connection::update_and_sync` of the previous
        // signal (the proxy thread's own, or the semaphore's before the proxy took it over).
        let next = self.outbound.load(Ordering::Acquire) + 1;
        self.connection().update_and_sync(self.semaphore().remote_memory(), 0, &self.outbound, next)
    }
}

impl From<Host2DeviceSemaphore> for ProxySemaphore {
    /// Hands the semaphore to a proxy service, which signals it from then on (continuing its
    /// outbound count) while kernels wait on its device handle.
    fn from(s: Host2DeviceSemaphore) -> Self {
        let outbound = AtomicU64::new(s.outbound_token());
        ProxySemaphore { owner: Owner::Host2Device(s), outbound }
    }
}

impl From<Semaphore> for ProxySemaphore {
    /// Hands the semaphore to a proxy service, which signals it (from outbound count 0).
    fn from(s: Semaphore) -> Self {
        ProxySemaphore { owner: Owner::Plain(s), outbound: AtomicU64::new(0) }
    }
}

struct SemEntry {
    sem: ProxySemaphore,
    conn: usize,
}

impl SemEntry {
    fn connection(&self) -> &Connection {
        self.sem.connection()
    }

    fn signal(&self) -> Result<()> {
        self.sem.signal()
    }
}

/// One connection's flush state, owned by the proxy thread.
struct ConnState {
    conn: Connection,
    /// Recorded flushes: (FIFO position, the connection's issued sequence number then).
    pending: VecDeque<(u64, u64)>,
}

/// What the proxy thread and the service share.
struct Shared {
    fifo: Fifo,
    /// One `flushDonePos` word per connection (mapped pinned host memory for a GPU service).
    flush_words: Region,
    error: Mutex<Option<Error>>,
    failed: AtomicBool,
    stop: AtomicBool,
    processed: AtomicU64,
}

impl Shared {
    fn flush_word(&self, conn: usize) -> Option<&AtomicU64> {
        self.flush_words.atomic_u64(conn as u64 * 8).ok()
    }

    /// Keeps the first error and publishes it to the device: the error word first, then every
    /// flush word (so a kernel that sees a released flush can tell it was released by an error).
    /// All under the error's lock, so that whoever sees the error in [`status`](Self::status)
    /// also sees the words already published.
    fn fail(&self, e: Error, nconns: usize) {
        let mut g = lock(&self.error);
        self.failed.store(true, Ordering::Release);
        self.fifo.set_proxy_error(PROXY_FAILED);
        self.release_flushes(nconns);
        if g.is_none() {
            warn!(target: LOG, "proxy failed: {e}");
            *g = Some(e);
        }
    }

    fn release_flushes(&self, nconns: usize) {
        for i in 0..nconns {
            if let Some(w) = self.flush_word(i) {
                w.store(u64::MAX, Ordering::Release);
            }
        }
    }

    fn status(&self) -> Result<()> {
        match lock(&self.error).as_ref() {
            Some(e) => Err(e.duplicate()),
            None => Ok(()),
        }
    }
}

/// What the proxy thread owns.
struct Worker {
    sh: Arc<Shared>,
    memories: Vec<RegisteredMemory>,
    sems: Vec<SemEntry>,
    conns: Vec<ConnState>,
    max_queue: Option<u64>,
    idle_backoff: bool,
    device: Option<u32>,
    /// The next FIFO position to handle (ahead of the FIFO's tail within a batch of pops).
    cursor: u64,
    /// Whether any connection has recorded flushes to publish.
    flushes_pending: bool,
}

/// Executes the requests kernels push into its FIFO, on the connections of registered
/// semaphores (see the [module documentation](self)).
///
/// Register memories and semaphores, build channels, then [`start`](Self::start); registries
/// are frozen from then on. Several services may serve one GPU (each with its own FIFO, IDs and
/// thread). Dropping a running service stops it (the error, if any, is logged).
///
/// ```no_run
/// # fn f(ctx: &mscclpp::Context, sem: mscclpp::Host2DeviceSemaphore,
/// #      dst: mscclpp::RegisteredMemory, src: mscclpp::RegisteredMemory) -> mscclpp::Result<()> {
/// use mscclpp::device::proxy::{ProxyConfig, ProxyService};
/// let mut proxy = ProxyService::new(ctx, 0, ProxyConfig::default())?;
/// let s = proxy.add_semaphore(sem)?;
/// let (d, m) = (proxy.add_memory(dst)?, proxy.add_memory(src)?);
/// let chan = proxy.port_channel(s, d, m)?;
/// proxy.start()?;
/// // ... launch kernels with chan.device_handle_ptr() ...
/// proxy.stop()?; // the proxy's first error, if any
/// # Ok(()) }
/// ```
///
/// C++ MSCCL++: `ProxyService`.
pub struct ProxyService {
    sh: Arc<Shared>,
    device: Option<u32>,
    ctx: Option<Context>,
    config: ProxyConfig,
    /// Registries until `start` hands them to the thread.
    worker: Option<Worker>,
    /// Device handles of H2D semaphores by ID (`None` for plain ones), kept after `start`.
    sem_handles: Vec<Option<Host2DeviceSemaphoreDeviceHandle>>,
    /// Connection index of each semaphore, kept after `start`.
    sem_conn: Vec<usize>,
    nconns: usize,
    thread: Option<JoinHandle<()>>,
    stopped: bool,
}

impl std::fmt::Debug for ProxyService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyService")
            .field("device", &self.device)
            .field("semaphores", &self.sem_conn.len())
            .field("connections", &self.nconns)
            .field("running", &self.thread.is_some())
            .finish()
    }
}

/// Most connections one service tracks (one flush word each; 1024 semaphores at most anyway).
const MAX_CONNS: usize = (MAX_SEMAPHORE_ID as usize) + 1;

impl ProxyService {
    /// A service for GPU `device`: its FIFO (mapped pinned ring, device head) and its flush
    /// words in mapped pinned memory.
    ///
    /// # Errors
    /// `InvalidUsage` for a FIFO size that is not a power of two; CUDA errors (`NotAvailable`
    /// without a driver).
    pub fn new(ctx: &Context, device: u32, config: ProxyConfig) -> Result<ProxyService> {
        let fifo = Fifo::new(ctx, device, config.fifo_size)?;
        let dev = crate::platform::cuda::device(device)?;
        let words = crate::platform::cuda::PinnedAlloc::region(&dev, MAX_CONNS * 8)?;
        words.fill(0, (MAX_CONNS * 8) as u64, 0)?;
        let mut s = Self::with_parts(fifo, words, Some(device), config);
        s.ctx = Some(ctx.clone());
        Ok(s)
    }

    /// A service whose FIFO and flush words are plain host memory, fed by a
    /// [`HostProducer`](super::fifo::HostProducer) instead of a kernel: for tests without a GPU
    /// and for host code that wants to drive connections through a proxy thread.
    ///
    /// # Errors
    /// `InvalidUsage` for a FIFO size that is not a power of two; allocation errors.
    pub fn host_backed(config: ProxyConfig) -> Result<ProxyService> {
        let fifo = Fifo::host_backed(config.fifo_size)?;
        let alloc = Arc::new(crate::platform::hostmem::HostAlloc::zeroed(MAX_CONNS * 8)?);
        let words = Region::owned(alloc, MAX_CONNS * 8);
        Ok(Self::with_parts(fifo, words, None, config))
    }

    fn with_parts(fifo: Fifo, flush_words: Region, device: Option<u32>, config: ProxyConfig) -> ProxyService {
        let sh = Arc::new(Shared {
            fifo,
            flush_words,
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            processed: AtomicU64::new(0),
        });
        let worker = Worker {
            sh: sh.clone(),
            memories: Vec::new(),
            sems: Vec::new(),
            conns: Vec::new(),
            max_queue: config.max_write_queue_size.map(|q| q.max(1) as u64),
            idle_backoff: config.idle_backoff,
            device,
            cursor: 0,
            flushes_pending: false,
        };
        ProxyService {
            sh,
            device,
            ctx: None,
            config,
            worker: Some(worker),
            sem_handles: Vec::new(),
            sem_conn: Vec::new(),
            nconns: 0,
            thread: None,
            stopped: false,
        }
    }

    fn registering(&mut self, what: &str) -> Result<&mut Worker> {
        self.worker.as_mut().ok_or_else(|| {
            Error::invalid_usage(format!("{what}: the proxy service has started; register before start"))
        })
    }

    /// Registers a memory that triggers name as a source (local) or destination (the peer's).
    ///
    /// # Errors
    /// `InvalidUsage` after `start` or beyond 512 memories.
    pub fn add_memory(&mut self, memory: RegisteredMemory) -> Result<MemoryId> {
        let w = self.registering("add_memory")?;
        if w.memories.len() > MAX_MEMORY_ID as usize {
            return Err(Error::invalid_usage(format!(
                "a proxy service holds at most {} memories (trigger field width)",
                MAX_MEMORY_ID + 1
            )));
        }
        w.memories.push(memory);
        Ok(MemoryId((w.memories.len() - 1) as u32))
    }

    /// Registers a semaphore: triggers name it, and its connection carries their operations.
    ///
    /// # Errors
    /// `InvalidUsage` after `start` or beyond 1024 semaphores.
    pub fn add_semaphore(&mut self, semaphore: impl Into<ProxySemaphore>) -> Result<SemaphoreId> {
        let sem = semaphore.into();
        let w = self.registering("add_semaphore")?;
        if w.sems.len() > MAX_SEMAPHORE_ID as usize {
            return Err(Error::invalid_usage(format!(
                "a proxy service holds at most {} semaphores (trigger field width)",
                MAX_SEMAPHORE_ID + 1
            )));
        }
        let conn = sem.connection().clone();
        let idx = match w.conns.iter().position(|c| c.conn.same_as(&conn)) {
            Some(i) => i,
            None => {
                w.conns.push(ConnState { conn, pending: VecDeque::new() });
                w.conns.len() - 1
            }
        };
        let handle = sem.device_handle();
        w.sems.push(SemEntry { sem, conn: idx });
        let id = w.sems.len() - 1;
        self.nconns = self.worker.as_ref().map_or(self.nconns, |w| w.conns.len());
        self.sem_handles.push(handle);
        self.sem_conn.push(idx);
        Ok(SemaphoreId(id as u32))
    }

    /// The FIFO kernels push into.
    pub fn fifo(&self) -> &Fifo {
        &self.sh.fifo
    }

    /// The GPU this service serves (`None` for a host-backed service).
    pub fn device(&self) -> Option<u32> {
        self.device
    }

    pub(crate) fn context(&self) -> Option<&Context> {
        self.ctx.as_ref()
    }

    /// The configuration the service was built with.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The device semaphore handle of `sem` (a [`Host2DeviceSemaphore`] registration).
    pub(crate) fn semaphore_handle(&self, sem: SemaphoreId) -> Result<Host2DeviceSemaphoreDeviceHandle> {
        match self.sem_handles.get(sem.0 as usize) {
            Some(Some(h)) => Ok(*h),
            Some(None) => Err(Error::invalid_usage(format!(
                "semaphore {} was registered as a plain Semaphore; a PortChannel needs a Host2DeviceSemaphore",
                sem.0
            ))),
            None => Err(Error::invalid_usage(format!("semaphore {} is not registered in this proxy service", sem.0))),
        }
    }

    pub(crate) fn memory_registered(&self, m: MemoryId) -> bool {
        match &self.worker {
            Some(w) => (m.0 as usize) < w.memories.len(),
            // After start IDs cannot be checked any more; channels are built before start.
            None => true,
        }
    }

    /// Device address of the `flushDonePos` word serving semaphore `sem`'s connection.
    pub fn flush_done_pos_ptr(&self, sem: SemaphoreId) -> Result<u64> {
        let c = self.conn_of(sem)?;
        Ok(self.sh.flush_words.addr() as u64 + c as u64 * 8)
    }

    /// The `flushDonePos` word serving semaphore `sem`'s connection: every flush pushed at a FIFO
    /// position below it has completed (`u64::MAX` once the proxy failed or stopped).
    pub fn flush_done_pos(&self, sem: SemaphoreId) -> Result<u64> {
        let c = self.conn_of(sem)?;
        Ok(self.sh.flush_word(c).map_or(0, |w| w.load(Ordering::Acquire)))
    }

    fn conn_of(&self, sem: SemaphoreId) -> Result<usize> {
        self.sem_conn
            .get(sem.0 as usize)
            .copied()
            .ok_or_else(|| Error::invalid_usage(format!("semaphore {} is not registered in this proxy service", sem.0)))
    }

    /// Triggers popped so far (executed or, after an error, skipped).
    pub fn processed(&self) -> u64 {
        self.sh.processed.load(Ordering::Acquire)
    }

    /// Starts the proxy thread; the registries are frozen from here on.
    ///
    /// # Errors
    /// `InvalidUsage` when already started; `System` when the thread cannot start.
    pub fn start(&mut self) -> Result<()> {
        let Some(mut w) = self.worker.take() else {
            return Err(Error::invalid_usage("the proxy service was already started"));
        };
        self.nconns = w.conns.len();
        let (tx, rx) = std::sync::mpsc::channel::<Result<()>>();
        let t = std::thread::Builder::new()
            .name(match self.device {
                Some(d) => format!("mscclpp-proxy-gpu{d}"),
                None => "mscclpp-proxy".to_string(),
            })
            .spawn(move || {
                let init = w.init();
                let ok = init.is_ok();
                let _ = tx.send(init);
                if ok {
                    w.run();
                }
            })
            .map_err(|e| Error::io("starting the proxy thread", e))?;
        match rx.recv() {
            Ok(Ok(())) => {
                self.thread = Some(t);
                Ok(())
            }
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

    /// `Ok` while the proxy works; its first error otherwise (also after `stop`).
    pub fn status(&self) -> Result<()> {
        self.sh.status()
    }

    /// Stops the proxy thread: completes what it can of the pending flushes, releases every
    /// device waiter (the FIFO error word becomes [`PROXY_STOPPED`] unless it already says
    /// failed, and every `flushDonePos` word `u64::MAX`), and flushes each connection with a
    /// 5 s limit. Calling it again returns the same result.
    ///
    /// # Errors
    /// The proxy's first error; a connection that did not drain within the limit.
    pub fn stop(&mut self) -> Result<()> {
        if !self.stopped {
            self.stopped = true;
            self.sh.stop.store(true, Ordering::Release);
            if let Some(t) = self.thread.take() {
                if t.join().is_err() {
                    self.sh.fail(Error::internal("the proxy thread panicked"), self.nconns);
                }
            } else if let Some(w) = self.worker.as_ref() {
                // Never started: still release anything a kernel may wait on.
                w.shutdown_words();
            }
        }
        self.sh.status()
    }
}

impl Drop for ProxyService {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            debug!(target: LOG, "proxy service dropped after an error: {e}");
        }
    }
}

impl Worker {
    fn init(&self) -> Result<()> {
        if let Some(d) = self.device {
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

    fn failed(&self) -> bool {
        self.sh.failed.load(Ordering::Acquire)
    }

    fn fail(&self, e: Error) {
        self.sh.fail(e, self.conns.len());
    }

    fn run(&mut self) {
        let mut countdown = STOP_CHECK_PERIOD;
        let mut idle: Option<Backoff> = None;
        let idle_policy = if self.idle_backoff { IDLE_BACKOFF } else { IDLE_SPIN };
        // Pops are batched: the proxy reads ahead of `tail` and publishes it once per batch, so
        // producers waiting for slots see fewer, larger steps and the tail's cache line moves
        // between the CPU and the GPU's reads less often.
        let batch = u64::from(self.sh.fifo.size()).min(POP_BATCH);
        self.cursor = self.sh.fifo.tail();
        loop {
            countdown -= 1;
            if countdown == 0 {
                countdown = STOP_CHECK_PERIOD;
                if self.sh.stop.load(Ordering::Acquire) {
                    break;
                }
            }
            if !self.failed()
                && self.flushes_pending
                && let Err(e) = self.progress_flushes()
            {
                self.fail(e);
            }
            let first = self.cursor;
            while self.cursor - first < batch {
                let Some(t) = self.sh.fifo.poll_at(self.cursor) else { break };
                let pos = self.cursor;
                if !self.failed()
                    && let Err(e) = self.handle(t, pos)
                {
                    self.fail(e.during(format!("executing the trigger at FIFO position {pos}")));
                }
                self.cursor += 1;
            }
            if self.cursor > first {
                idle = None;
                self.sh.fifo.pop_to(self.cursor);
                self.sh.processed.fetch_add(self.cursor - first, Ordering::AcqRel);
            } else {
                idle.get_or_insert_with(|| Backoff::new(idle_policy)).snooze(&Deadline::never());
            }
        }
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if !self.failed() {
            for _ in 0..1000 {
                if self.conns.iter().all(|c| c.pending.is_empty()) {
                    break;
                }
                if let Err(e) = self.progress_flushes() {
                    self.fail(e);
                    break;
                }
                std::thread::yield_now();
            }
        }
        self.shutdown_words();
        for c in &self.conns {
            if c.conn.outstanding() > 0
                && let Err(e) = c.conn.flush(STOP_FLUSH_TIMEOUT)
            {
                self.fail(e.during("stopping the proxy service"));
            }
        }
    }

    /// Marks the service stopped on the device and releases every flush waiter.
    fn shutdown_words(&self) {
        if self.sh.fifo.proxy_error() == 0 {
            self.sh.fifo.set_proxy_error(PROXY_STOPPED);
        }
        self.sh.release_flushes(self.conns.len());
    }

    /// Publishes every recorded flush whose connection has completed its sequence number.
    fn progress_flushes(&mut self) -> Result<()> {
        let mut left = false;
        for (i, c) in self.conns.iter_mut().enumerate() {
            if c.pending.is_empty() {
                continue;
            }
            let done = c.conn.progress()?.completed;
            let mut publish = None;
            while let Some(&(pos, seq)) = c.pending.front() {
                if seq > done {
                    break;
                }
                publish = Some(pos);
                c.pending.pop_front();
            }
            if let (Some(pos), Some(w)) = (publish, self.sh.flush_word(i)) {
                w.fetch_max(pos + 1, Ordering::AcqRel);
            }
            left |= !c.pending.is_empty();
        }
        self.flushes_pending = left;
        Ok(())
    }

    /// Records the flush at `pos` on connection `ci`, or publishes it at once when nothing is
    /// outstanding.
    fn flush(&mut self, ci: usize, pos: u64) -> Result<()> {
        let c = &mut self.conns[ci];
        let p = c.conn.progress_requested()?;
        if p.completed >= p.issued && c.pending.is_empty() {
            // Nothing outstanding: done now (the common case for back-to-back flushes).
            if let Some(w) = self.sh.flush_word(ci) {
                w.fetch_max(pos + 1, Ordering::AcqRel);
            }
        } else {
            c.pending.push_back((pos, p.issued));
            self.flushes_pending = true;
        }
        Ok(())
    }

    fn sem(&self, id: u32) -> Result<&SemEntry> {
        self.sems.get(id as usize).ok_or_else(|| {
            Error::invalid_usage(format!(
                "the trigger names semaphore {id}, but this proxy service has {} semaphores",
                self.sems.len()
            ))
        })
    }

    fn memory(&self, id: u32, role: &str) -> Result<&RegisteredMemory> {
        self.memories.get(id as usize).ok_or_else(|| {
            Error::invalid_usage(format!(
                "the trigger names {role} memory {id}, but this proxy service has {} memories",
                self.memories.len()
            ))
        })
    }

    /// Waits, publishing flushes meanwhile, until connection `ci` has fewer than the bound in
    /// flight. Triggers handled before this one are popped first, so their slots are free while
    /// it waits.
    fn make_room(&mut self, ci: usize) -> Result<()> {
        let Some(max) = self.max_queue else { return Ok(()) };
        let conn = self.conns[ci].conn.clone();
        let p = conn.progress()?;
        if p.issued - p.completed < max {
            return Ok(());
        }
        self.sh.fifo.pop_to(self.cursor);
        conn.request_progress()?;
        let deadline = Deadline::after(BACK_PRESSURE_LIMIT);
        let mut backoff = Backoff::new(BackoffPolicy::FAST);
        loop {
            self.progress_flushes()?;
            let p = conn.progress()?;
            if p.issued - p.completed < max {
                return Ok(());
            }
            if self.sh.stop.load(Ordering::Acquire) {
                return Err(Error::invalid_usage(format!(
                    "the proxy service was stopped while {} operations were in flight on a full connection",
                    p.issued - p.completed
                )));
            }
            if deadline.expired() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{} operations in flight on the connection to {} and none completed for {BACK_PRESSURE_LIMIT:?}",
                        p.issued - p.completed,
                        conn.peer_rank().map_or_else(|| "the peer".to_string(), |r| format!("rank {r}"))
                    ),
                ));
            }
            backoff.snooze(&deadline);
        }
    }

    fn handle(&mut self, t: ProxyTrigger, pos: u64) -> Result<()> {
        match decode(t)? {
            Request::Ops { sem_id, put, signal, flush } => {
                let ci = self.sem(sem_id)?.conn;
                if let Some(p) = put {
                    let dst = self.memory(p.dst_mem, "destination")?.clone();
                    let src = self.memory(p.src_mem, "source")?.clone();
                    self.make_room(ci)?;
                    let conn = &self.conns[ci].conn;
                    conn.write(&dst, p.dst_off as u64, &src, p.src_off as u64, p.size as u64)?;
                }
                if signal {
                    self.make_room(ci)?;
                    self.sem(sem_id)?.signal()?;
                }
                if flush {
                    self.flush(ci, pos)?;
                }
                Ok(())
            }
            Request::AtomicAdd { sem_id, dst_mem, dst_off, value } => {
                let ci = self.sem(sem_id)?.conn;
                let conn = self.sem(sem_id)?.connection().clone();
                if conn.transport() == Transport::CudaIpc {
                    return Err(Error::invalid_usage(
                        "atomicAdd over a CUDA IPC connection is refused by the proxy: it would need a \
                         kernel that cannot run while the pushing kernel occupies the GPU; add to the \
                         peer's memory from the kernel itself with MemoryChannel's direct device atomics \
                         (atom/red .sys on the CUDA IPC-mapped pointer)",
                    ));
                }
                let dst = self.memory(dst_mem, "destination")?.clone();
                self.make_room(ci)?;
                conn.atomic_add(&dst, dst_off as u64, value)
            }
        }
    }
}
