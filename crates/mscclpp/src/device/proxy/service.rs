//! [`ProxyService`]: the proxy loop with the built-in handler, registries filled before start.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::handler::{ConnectionHandler, FlushWords};
use super::runner::{LoopShared, Proxy, ProxyOptions};
use super::{MemoryId, PROXY_STOPPED, ProxyConfig, SemaphoreId};
use crate::conn::Connection;
use crate::context::Context;
use crate::device::fifo::Fifo;
use crate::device::handles::Host2DeviceSemaphoreDeviceHandle;
use crate::device::trigger::{MAX_MEMORY_ID, MAX_SEMAPHORE_ID};
use crate::error::{Error, Result};
use crate::memory::RegisteredMemory;
use crate::platform::hostmem::Region;
use crate::semaphore::{Host2DeviceSemaphore, Semaphore};

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
    /// `n` signals at once: the peer's token becomes outbound + `n` (one token write), after
    /// every earlier operation of the connection.
    pub(crate) fn signal_by(&self, n: u64) -> Result<()> {
        // Acquire: pairs with the AcqRel swap in `Connection::update_and_sync` of the previous
        // signal (the proxy thread's own, or the semaphore's before the proxy took it over).
        let next = self.outbound.load(Ordering::Acquire) + n;
        self.connection().update_and_sync(self.semaphore().remote_memory(), 0, &self.outbound, next)
    }
    /// A write on the semaphore's connection, then `n` signals: one operation where the
    /// connection joins them (`Connection::joined_write_max`), else `write` then `signal_by`.
    pub(crate) fn write_then_signal_by(
        &self,
        n: u64,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        // Acquire: as in `signal_by`.
        let next = self.outbound.load(Ordering::Acquire) + n;
        let tok = (self.semaphore().remote_memory(), 0);
        self.connection().write_and_update_and_sync(dst, dst_off, src, src_off, len, tok, &self.outbound, next)
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

/// Executes the requests kernels push into its FIFO, on the connections of registered
/// semaphores (see the [module documentation](super)).
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
    sh: Arc<LoopShared>,
    words: Arc<FlushWords>,
    device: Option<u32>,
    ctx: Option<Context>,
    config: ProxyConfig,
    /// Registries until `start` hands them to the thread.
    handler: Option<ConnectionHandler>,
    proxy: Option<Proxy>,
    /// Device handles of H2D semaphores by ID (`None` for plain ones), kept after `start`.
    sem_handles: Vec<Option<Host2DeviceSemaphoreDeviceHandle>>,
    /// Connection index of each semaphore, kept after `start`.
    sem_conn: Vec<usize>,
    nconns: usize,
    stopped: bool,
}

impl std::fmt::Debug for ProxyService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyService")
            .field("device", &self.device)
            .field("semaphores", &self.sem_conn.len())
            .field("connections", &self.nconns)
            .field("running", &self.proxy.is_some())
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
    /// [`HostProducer`](crate::device::fifo::HostProducer) instead of a kernel: for tests without
    /// a GPU and for host code that wants to drive connections through a proxy thread.
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
        let words = Arc::new(FlushWords::new(flush_words));
        ProxyService {
            sh: Arc::new(LoopShared::new(Arc::new(fifo))),
            handler: Some(
                ConnectionHandler::new(words.clone(), config.max_write_queue_size)
                    .coalesce(config.signal_coalesce, config.signal_pay_interval, config.fifo_size)
                    .backlog_hold(config.signal_backlog_hold),
            ),
            words,
            device,
            ctx: None,
            config,
            proxy: None,
            sem_handles: Vec::new(),
            sem_conn: Vec::new(),
            nconns: 0,
            stopped: false,
        }
    }

    fn registering(&mut self, what: &str) -> Result<&mut ConnectionHandler> {
        self.handler.as_mut().ok_or_else(|| {
            Error::invalid_usage(format!("{what}: the proxy service has started; register before start"))
        })
    }

    /// Registers a memory that triggers name as a source (local) or destination (the peer's).
    ///
    /// # Errors
    /// `InvalidUsage` after `start` or beyond 512 memories.
    pub fn add_memory(&mut self, memory: RegisteredMemory) -> Result<MemoryId> {
        let h = self.registering("add_memory")?;
        if h.memories() > MAX_MEMORY_ID as usize {
            return Err(Error::invalid_usage(format!(
                "a proxy service holds at most {} memories (trigger field width)",
                MAX_MEMORY_ID + 1
            )));
        }
        Ok(MemoryId(h.add_memory(memory) as u32))
    }

    /// Registers a semaphore: triggers name it, and its connection carries their operations.
    ///
    /// # Errors
    /// `InvalidUsage` after `start` or beyond 1024 semaphores.
    pub fn add_semaphore(&mut self, semaphore: impl Into<ProxySemaphore>) -> Result<SemaphoreId> {
        let sem = semaphore.into();
        let h = self.registering("add_semaphore")?;
        if h.semaphores() > MAX_SEMAPHORE_ID as usize {
            return Err(Error::invalid_usage(format!(
                "a proxy service holds at most {} semaphores (trigger field width)",
                MAX_SEMAPHORE_ID + 1
            )));
        }
        let handle = sem.device_handle();
        let (id, conn) = h.add_semaphore(sem);
        self.nconns = h.connections();
        self.sem_handles.push(handle);
        self.sem_conn.push(conn);
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
        match &self.handler {
            Some(h) => (m.0 as usize) < h.memories(),
            // After start IDs cannot be checked any more; channels are built before start.
            None => true,
        }
    }

    /// Device address of the `flushDonePos` word serving semaphore `sem`'s connection.
    pub fn flush_done_pos_ptr(&self, sem: SemaphoreId) -> Result<u64> {
        Ok(self.words.addr(self.conn_of(sem)?))
    }

    /// The `flushDonePos` word serving semaphore `sem`'s connection: every flush pushed at a FIFO
    /// position below it has completed (`u64::MAX` once the proxy failed or stopped).
    pub fn flush_done_pos(&self, sem: SemaphoreId) -> Result<u64> {
        let c = self.conn_of(sem)?;
        // Acquire: pairs with the Release in the handler's publish (`FlushWords::publish`).
        Ok(self.words.word(c).map_or(0, |w| w.load(Ordering::Acquire)))
    }

    fn conn_of(&self, sem: SemaphoreId) -> Result<usize> {
        self.sem_conn
            .get(sem.0 as usize)
            .copied()
            .ok_or_else(|| Error::invalid_usage(format!("semaphore {} is not registered in this proxy service", sem.0)))
    }

    /// Triggers popped so far (executed or, after an error, skipped).
    pub fn processed(&self) -> u64 {
        self.sh.processed()
    }

    /// How long the proxy thread has found the FIFO empty, summed up to the end of its last idle
    /// stretch: beside [`processed`](Self::processed), whether it waited for the kernels'
    /// triggers (much idle time) or they waited for it (little).
    pub fn idle_time(&self) -> std::time::Duration {
        self.sh.idle_time()
    }

    /// Starts the proxy thread; the registries are frozen from here on.
    ///
    /// # Errors
    /// `InvalidUsage` when already started; `System` when the thread cannot start.
    pub fn start(&mut self) -> Result<()> {
        let Some(h) = self.handler.take() else {
            return Err(Error::invalid_usage("the proxy service was already started"));
        };
        self.nconns = h.connections();
        let options = ProxyOptions { device: self.device, idle_backoff: self.config.idle_backoff };
        self.proxy = Some(Proxy::start_shared(self.sh.clone(), h, options)?);
        Ok(())
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
            match self.proxy.as_mut() {
                Some(p) => {
                    let _ = p.stop();
                }
                None => {
                    // Never started (or failed to): still release anything a kernel may wait on.
                    if self.sh.fifo.proxy_error() == 0 {
                        self.sh.fifo.set_proxy_error(PROXY_STOPPED);
                    }
                    self.words.release_all(self.nconns);
                }
            }
        }
        self.sh.status()
    }
}

impl Drop for ProxyService {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::debug!(target: super::LOG, "proxy service dropped after an error: {e}");
        }
    }
}
