//! Semaphores: counters that one rank signals over a connection and the other waits on.
//!
//! Tokens only grow. The signalling side keeps an outbound counter and each `signal` sets the
//! peer's token to `outbound + 1` with [`Connection::update_and_sync`], which lands after every
//! earlier write of the connection. The waiting side keeps the count it has consumed; a `wait`
//! consumes one signal once the token is above it. So N signals allow N waits, and a waiter sees
//! the data of every write issued before the signal it consumed.
//!
//! # Threads
//! Signals and waits on one semaphore may come from many threads at once and lose nothing:
//! * `signal` holds a small per-semaphore lock across "next value" and `update_and_sync`, so
//!   token updates of one semaphore enter the connection in increasing order (Ethernet and IB
//!   HostNoAtomic send the absolute value: a lower token landing after a higher one would take
//!   signals back). Uncontended, the lock costs tens of nanoseconds against a signal's
//!   microseconds.
//! * `wait` and `poll` consume with a compare-and-swap on the consumed count, and only while the
//!   token is above it: each signal is consumed by exactly one waiter, and a wait that times out
//!   consumes nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::buffer::Buffer;
use crate::buffer::DeviceBuffer;
use crate::communicator::{Communicator, MsgKind, Pending};
use crate::conn::Connection;
use crate::device::handles::MemoryDevice2DeviceSemaphoreDeviceHandle;
use crate::device::token_pool::{self, PoolToken};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::RegisteredMemory;
use crate::sync::{Backoff, BackoffPolicy, Deadline, lock};
use crate::transport::{Device, Transport};

/// Moved to [`crate::device::handles`]; re-exported here (and at the crate root) for old paths.
pub use crate::device::handles::Host2DeviceSemaphoreDeviceHandle;

/// How a host wait polls before it blocks: spin a few microseconds, then yield up to 1 ms. A
/// signal already on its way lands within microseconds, and yielding (rather than sleeping) keeps
/// the wake-up off the critical path while letting the transport's threads run on a busy machine
/// (measured in mscclpp-perf: an 8-byte round trip drops from about 110 to 50 us on a 2-core VM).
/// After that the wait blocks on the transport's token notification (see `Host2HostSemaphore::wait`).
const HOST_WAIT: BackoffPolicy = BackoffPolicy {
    spin: Duration::from_micros(5),
    yield_until: Duration::from_millis(1),
    sleep_min: Duration::from_micros(50),
    sleep_max: Duration::from_millis(1),
};

/// The counters of one signalling direction and one waiting direction of a semaphore, shared by
/// every thread that signals or waits on it.
#[derive(Debug, Default)]
struct Counters {
    /// Serializes `signal`s of this semaphore (see the module notes).
    signal: Mutex<()>,
    /// The last token value sent to the peer.
    outbound: AtomicU64,
    /// Signals consumed by waits.
    consumed: AtomicU64,
}

impl Counters {
    /// Sends the next token value: `outbound + 1`, in order with every other signal.
    fn signal(&self, conn: &Connection, remote: &RegisteredMemory) -> Result<()> {
        self.signal_with(|outbound, next| conn.update_and_sync(remote, 0, outbound, next))
    }

    /// [`signal`](Self::signal) with the connection's `update_and_sync` as `send(outbound, next)`
    /// (which swaps `outbound` to `next`).
    fn signal_with(&self, send: impl FnOnce(&AtomicU64, u64) -> Result<()>) -> Result<()> {
        let _order = lock(&self.signal);
        // Acquire: pairs with the AcqRel swap of `outbound` in `Connection::update_and_sync` of
        // the previous signal (the lock orders them too; the ordering keeps this correct alone).
        let next = self.outbound.load(Ordering::Acquire) + 1;
        send(&self.outbound, next)
    }

    /// Consumes one signal if the inbound token `inbound` is above the consumed count.
    fn try_consume(&self, inbound: impl Fn() -> u64) -> bool {
        // Acquire: pairs with the AcqRel compare-and-swap below in other waiters. `consumed` is a
        // count only: the data a consumed signal covers is ordered by the inbound token's own
        // Acquire load (`inbound`), which pairs with the transport's Release store of the token.
        let mut seen = self.consumed.load(Ordering::Acquire);
        loop {
            if inbound() <= seen {
                return false;
            }
            // AcqRel on success, Acquire on failure: pairs with the same CAS of other waiters, so
            // each count is claimed once (the host form of device.cuh's `poll_inbound`, with
            // stronger orderings than its relaxed CAS; see tests/ordering_models.rs).
            match self.consumed.compare_exchange_weak(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => seen = now,
            }
        }
    }
}

/// The local half of a semaphore: a token word registered for the connection's transport.
///
/// C++ MSCCL++: `SemaphoreStub`.
#[derive(Clone, Debug)]
pub struct SemaphoreStub {
    connection: Connection,
    token: Token,
}

/// Where a semaphore's inbound token lives.
#[derive(Clone, Debug)]
enum Token {
    Host(Buffer),
    Gpu(DeviceBuffer),
    /// A slot of the GPU's token pool (CUDA IPC connections: one mapping per peer allocation).
    Pooled(PoolToken),
}

impl Token {
    fn memory(&self) -> &RegisteredMemory {
        match self {
            Token::Host(b) => b.memory(),
            Token::Gpu(b) => b.memory(),
            Token::Pooled(t) => t.buffer().memory(),
        }
    }
}

impl SemaphoreStub {
    /// Allocates and registers the token for `connection`: in host memory for a CPU-side
    /// connection, in the GPU's memory for a GPU-side one.
    ///
    /// # Errors
    /// Allocation or registration errors (`NotAvailable` without a CUDA driver for a GPU side).
    pub fn new(connection: &Connection) -> Result<SemaphoreStub> {
        let t = connection.transport().into();
        // A forwarding connection (IB HostNoAtomic) stores incoming tokens itself: a GPU token
        // then needs no RDMA registration.
        let fwd = connection.forwards_signals();
        let token = match connection.local_device() {
            Device::Cpu => Token::Host(Buffer::new(connection.context(), 8, t)?),
            // The peer maps CUDA IPC tokens: slots of one pool allocation share one mapping.
            Device::Gpu(d) if connection.transport() == Transport::CudaIpc && !fwd => {
                Token::Pooled(token_pool::take(connection.context(), d, t)?)
            }
            Device::Gpu(d) => Token::Gpu(DeviceBuffer::new(
                connection.context(),
                d,
                8,
                if fwd { crate::TransportFlags::NONE } else { t },
            )?),
        };
        if fwd {
            connection
                .forward_signals_into(token.memory())
                .map_err(|e| connection.ctx_err(e, "building a semaphore"))?;
        }
        Ok(SemaphoreStub { connection: connection.clone(), token })
    }

    /// The token's registration, as the peer needs it.
    pub fn memory(&self) -> &RegisteredMemory {
        self.token.memory()
    }
}

/// Both halves of a semaphore: the local token (the peer signals it) and the peer's token (this
/// side signals it), with the connection between them.
///
/// C++ MSCCL++: `Semaphore`.
#[derive(Clone, Debug)]
pub struct Semaphore {
    local: SemaphoreStub,
    remote: RegisteredMemory,
}

impl Semaphore {
    /// Pairs the local stub with the peer's token memory.
    pub fn new(local: SemaphoreStub, remote: RegisteredMemory) -> Semaphore {
        Semaphore { local, remote }
    }
    /// The connection.
    pub fn connection(&self) -> &Connection {
        &self.local.connection
    }
    /// The local token's registration.
    pub fn local_memory(&self) -> &RegisteredMemory {
        self.local.memory()
    }
    /// The peer's token.
    pub fn remote_memory(&self) -> &RegisteredMemory {
        &self.remote
    }
    fn host_token(&self) -> Option<&Buffer> {
        match &self.local.token {
            Token::Host(b) => Some(b),
            Token::Gpu(_) | Token::Pooled(_) => None,
        }
    }
    fn gpu_token(&self) -> Option<&DeviceBuffer> {
        match &self.local.token {
            Token::Gpu(b) => Some(b),
            Token::Pooled(t) => Some(t.buffer()),
            Token::Host(_) => None,
        }
    }
}

impl Communicator {
    /// Builds a semaphore over `connection` with `peer`: sends the local token at once and
    /// receives the peer's, resolved by [`Pending::wait`].
    ///
    /// C++ MSCCL++: `Communicator::buildSemaphore`.
    pub fn build_semaphore(&self, connection: &Connection, peer: usize, tag: u32) -> Result<Pending<Semaphore>> {
        let stub = SemaphoreStub::new(connection)?;
        self.send_msg(peer, tag, MsgKind::Semaphore, &stub.memory().serialize())
            .map_err(|e| e.during(format!("build_semaphore with rank {peer} (tag {tag})")))?;
        self.pending(peer, tag, MsgKind::Semaphore, move |b| {
            Ok(Semaphore::new(stub, RegisteredMemory::deserialize(b)?))
        })
    }
}

/// A semaphore signalled and waited on by host threads (over Ethernet or IB).
///
/// A cheap-clone handle: clones share the counters, and any number of threads may `signal` and
/// `wait` at once without losing a signal (see the module notes on threads).
///
/// ```no_run
/// # fn f(comm: &mscclpp::Communicator, conn: &mscclpp::Connection) -> mscclpp::Result<()> {
/// use mscclpp::Host2HostSemaphore;
/// use std::time::Duration;
/// let sem = Host2HostSemaphore::new(comm.build_semaphore(conn, 1, 0)?.wait()?)?;
/// sem.signal()?;                              // tell rank 1
/// sem.wait(Duration::from_secs(5))?;          // until rank 1 signals us
/// let other = sem.clone();                    // e.g. for another thread
/// std::thread::spawn(move || other.signal());
/// # Ok(()) }
/// ```
///
/// C++ MSCCL++: `Host2HostSemaphore` (its `wait` takes a spin count; this one a time).
#[derive(Clone, Debug)]
pub struct Host2HostSemaphore {
    inner: Arc<H2h>,
}

#[derive(Debug)]
struct H2h {
    sem: Semaphore,
    token: Buffer,
    counters: Counters,
}

impl Host2HostSemaphore {
    /// Wraps a semaphore built over a host-side connection.
    ///
    /// # Errors
    /// `InvalidUsage` for a CUDA IPC connection or a GPU-side connection.
    pub fn new(sem: Semaphore) -> Result<Host2HostSemaphore> {
        let c = sem.connection();
        if c.transport() == Transport::CudaIpc {
            return Err(Error::invalid_usage("a Host2HostSemaphore cannot use the CUDA IPC transport"));
        }
        let Some(token) = sem.host_token().cloned() else {
            return Err(Error::invalid_usage("a Host2HostSemaphore needs a connection whose local device is the CPU"));
        };
        Ok(Host2HostSemaphore { inner: Arc::new(H2h { sem, token, counters: Counters::default() }) })
    }

    /// The underlying semaphore.
    pub fn semaphore(&self) -> &Semaphore {
        &self.inner.sem
    }
    /// The connection.
    pub fn connection(&self) -> &Connection {
        self.inner.sem.connection()
    }

    fn inbound(&self) -> u64 {
        // The token buffer is 8 bytes at a page-aligned address: offset 0 is a valid atomic word.
        // Acquire: pairs with the Release store (or AcqRel add) of the token by the transport's
        // receive thread (Ethernet's `RxEvent::Token`, IB HostNoAtomic's forwarding), made after
        // it applied every earlier write of the connection; over IB with atomics the NIC writes
        // the token after the data (RDMA ordering), and this load reads it.
        self.inner.token.atomic_u64(0).map(|w| w.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// The peer's last signal count as seen here.
    pub fn inbound_token(&self) -> u64 {
        self.inbound()
    }

    /// Signals the peer once (after every earlier write of the connection).
    ///
    /// Safe to call from several threads at once: each call adds exactly one to the peer's token.
    pub fn signal(&self) -> Result<()> {
        self.inner.counters.signal(self.connection(), self.inner.sem.remote_memory())
    }

    fn try_consume(&self) -> bool {
        self.inner.counters.try_consume(|| self.inbound())
    }

    /// Consumes one signal if one is available.
    ///
    /// # Errors
    /// The connection's failure, when no signal is available and the connection has failed.
    pub fn poll(&self) -> Result<bool> {
        if self.try_consume() {
            return Ok(true);
        }
        self.connection().status().map(|_| false)
    }

    /// Waits until a signal not yet consumed (by this or another thread) is available, and
    /// consumes it.
    ///
    /// Polls for up to 1 ms (spinning briefly, then yielding the CPU), then sleeps until the
    /// transport reports a token change, so a long wait does not hold a CPU core.
    /// `Duration::ZERO` takes only a signal already there; `Duration::MAX` means no limit.
    ///
    /// # Errors
    /// `Timeout` naming the peer and the counts (a wait that times out consumes nothing); or the
    /// connection's failure (a peer that closed or died), as soon as it is known.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let deadline = Deadline::after(timeout);
        let mut backoff = Backoff::new(HOST_WAIT);
        while backoff.polling() {
            if self.try_consume() {
                return Ok(());
            }
            // Apply what already arrived ourselves (Ethernet), rather than wait for the
            // transport's receive thread to be scheduled.
            if self.connection().poll_incoming() && self.try_consume() {
                return Ok(());
            }
            backoff.snooze(&deadline);
        }
        // The transport's receive thread applies what comes from now on.
        self.connection().stop_polling();
        let ctx = self.connection().context().inner().clone();
        // The NIC writes IB tokens without telling this process: poll them often. Other
        // transports wake the waiter when they apply a token.
        let cap =
            if self.connection().transport().is_ib() { Duration::from_micros(50) } else { Duration::from_millis(20) };
        loop {
            if ctx.wait_tokens(deadline.remaining().min(cap), &mut || self.try_consume()) {
                return Ok(());
            }
            if let Err(e) = self.connection().status() {
                return Err(e.during("Host2HostSemaphore wait"));
            }
            if deadline.expired() {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "Host2HostSemaphore: token is {}, {} signals consumed, after {timeout:?}",
                        self.inbound(),
                        // Acquire: as in `Counters::try_consume` (for the message only).
                        self.inner.counters.consumed.load(Ordering::Acquire)
                    ),
                );
                return Err(self.connection().ctx_err(e, "Host2HostSemaphore wait"));
            }
        }
    }
}

/// A semaphore signalled by the host (or a proxy thread) and waited on by the GPU: its token lives
/// in GPU memory and the peer's transport (CUDA IPC or Ethernet) updates it after the data.
///
/// Kernels use [`device_handle`](Self::device_handle); [`wait`](Self::wait) lets host code and
/// tests wait too, by polling the token with small device-to-host copies.
///
/// C++ MSCCL++: `Host2DeviceSemaphore`.
#[derive(Debug)]
pub struct Host2DeviceSemaphore {
    sem: Semaphore,
    token: DeviceBuffer,
    expected: DeviceBuffer,
    counters: Counters,
}

impl Host2DeviceSemaphore {
    /// Wraps a semaphore built over a GPU-side connection.
    ///
    /// # Errors
    /// `InvalidUsage` when the connection's local device is not a GPU.
    pub fn new(sem: Semaphore) -> Result<Host2DeviceSemaphore> {
        let Some(token) = sem.gpu_token().cloned() else {
            return Err(Error::invalid_usage("a Host2DeviceSemaphore needs a connection whose local device is a GPU"));
        };
        let expected = DeviceBuffer::new(sem.connection().context(), token.device(), 8, crate::TransportFlags::NONE)?;
        Ok(Host2DeviceSemaphore { sem, token, expected, counters: Counters::default() })
    }

    /// The underlying semaphore.
    pub fn semaphore(&self) -> &Semaphore {
        &self.sem
    }
    /// The connection.
    pub fn connection(&self) -> &Connection {
        self.sem.connection()
    }

    /// The pointers a kernel waits with.
    pub fn device_handle(&self) -> Host2DeviceSemaphoreDeviceHandle {
        Host2DeviceSemaphoreDeviceHandle {
            inbound_token: self.token.device_ptr(),
            expected_inbound_token: self.expected.device_ptr(),
        }
    }

    /// Signals the peer once (after every earlier operation of the connection); safe to call
    /// from several threads at once.
    pub fn signal(&self) -> Result<()> {
        self.counters.signal(self.connection(), self.sem.remote_memory())
    }

    /// The inbound token as the GPU holds it now.
    pub fn inbound_token(&self) -> Result<u64> {
        self.token.read_u64(0)
    }

    /// The signals kernels have consumed so far (the expected count), read by the host.
    pub fn expected_inbound_token(&self) -> Result<u64> {
        self.expected.read_u64(0)
    }

    /// The inbound token's and the expected count's buffers (shared, not copied): they outlive
    /// the semaphore while held, so a tool can still read them once a proxy has taken the
    /// semaphore. For diagnostics (`mscclpp_executor::Executor::diagnostics`); not API.
    #[doc(hidden)]
    pub fn word_buffers(&self) -> (DeviceBuffer, DeviceBuffer) {
        (self.token.clone(), self.expected.clone())
    }

    /// The last token value sent to the peer (signals sent so far, from this semaphore's
    /// start): where a proxy that takes the semaphore over continues counting.
    pub fn outbound_token(&self) -> u64 {
        // Acquire: pairs with the AcqRel swap in `Connection::update_and_sync` of the last
        // `signal`, so a proxy taking over continues from the value actually sent.
        self.counters.outbound.load(Ordering::Acquire)
    }

    /// Host-side wait for one more signal (for tests and host code; kernels use the handle).
    /// `Duration::ZERO` takes only a signal already there; `Duration::MAX` means no limit.
    ///
    /// # Errors
    /// `Timeout` naming the peer and the counts; the connection's failure; CUDA errors.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let mut have = 0;
        let ready = || -> Result<bool> {
            have = self.inbound_token()?;
            if self.counters.try_consume(|| have) {
                return Ok(true);
            }
            self.connection().status().map_err(|e| e.during("Host2DeviceSemaphore wait"))?;
            Ok(false)
        };
        if crate::sync::poll_until(timeout, BackoffPolicy::FAST, ready)? {
            return Ok(());
        }
        let e = Error::new(
            ErrorKind::Timeout,
            format!(
                "Host2DeviceSemaphore: token is {have}, {} signals consumed, after {timeout:?}",
                // Acquire: as in `Counters::try_consume` (for the message only).
                self.counters.consumed.load(Ordering::Acquire)
            ),
        );
        Err(self.connection().ctx_err(e, "Host2DeviceSemaphore wait"))
    }
}

/// A semaphore one GPU signals directly in another GPU's memory and the other waits on, both
/// from kernels, with no host thread: over a CUDA IPC connection the local token is a slot of
/// this GPU's token pool, and the peer's token is mapped into this process, where the kernel's
/// `signal()` adds one to it (`red.release.sys`).
///
/// Kernels use [`device_handle`](Self::device_handle) (24 bytes, MSCCL++'s layout), usually
/// through a [`MemoryChannel`](crate::MemoryChannel) or
/// [`BaseMemoryChannel`](crate::BaseMemoryChannel), which take it (or an `Arc` of it) with
/// `into()`. Many semaphores to one peer cost that peer one CUDA IPC mapping per pool
/// allocation (32768 tokens), not one per semaphore.
///
/// Lifetime: the peer's kernels signal the local token until they stop; keep the semaphore (and
/// its peer's) alive until every kernel that uses either has finished.
///
/// C++ MSCCL++: `MemoryDevice2DeviceSemaphore`.
#[derive(Debug)]
pub struct MemoryDevice2DeviceSemaphore {
    sem: Semaphore,
    token: DeviceBuffer,
    expected: PoolToken,
    remote_token: u64,
    device: u32,
}

impl MemoryDevice2DeviceSemaphore {
    /// Wraps a semaphore built over a CUDA IPC connection between GPUs (maps the peer's token).
    ///
    /// # Errors
    /// `InvalidUsage` for another transport or a connection whose local side is the CPU; CUDA
    /// errors mapping the peer's token or allocating the expected count.
    pub fn new(sem: Semaphore) -> Result<MemoryDevice2DeviceSemaphore> {
        let c = sem.connection();
        if c.transport() != Transport::CudaIpc {
            return Err(c.ctx_err(
                Error::invalid_usage("a MemoryDevice2DeviceSemaphore needs a CUDA IPC connection"),
                "MemoryDevice2DeviceSemaphore::new",
            ));
        }
        let (Device::Gpu(device), Some(token)) = (c.local_device(), sem.gpu_token().cloned()) else {
            return Err(Error::invalid_usage("a MemoryDevice2DeviceSemaphore needs a GPU on the local side"));
        };
        let gpu = crate::platform::cuda::device(device)?;
        let remote_token = sem
            .remote_memory()
            .gpu_ptr(&gpu)
            .map_err(|e| c.ctx_err(e, "MemoryDevice2DeviceSemaphore: mapping the peer's token"))?;
        let expected = token_pool::take(c.context(), device, crate::TransportFlags::NONE)?;
        Ok(MemoryDevice2DeviceSemaphore { sem, token, expected, remote_token, device })
    }

    /// The underlying semaphore.
    pub fn semaphore(&self) -> &Semaphore {
        &self.sem
    }
    /// The connection.
    pub fn connection(&self) -> &Connection {
        self.sem.connection()
    }
    /// The GPU whose kernels use this semaphore.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The pointers a kernel signals and waits with.
    pub fn device_handle(&self) -> MemoryDevice2DeviceSemaphoreDeviceHandle {
        MemoryDevice2DeviceSemaphoreDeviceHandle {
            inbound_token: self.token.device_ptr(),
            remote_inbound_token: self.remote_token,
            expected_inbound_token: self.expected.device_ptr(),
        }
    }

    /// The inbound token as the GPU holds it now (signals received), read by the host.
    pub fn inbound_token(&self) -> Result<u64> {
        self.token.read_u64(0)
    }

    /// The signals kernels have consumed so far (the expected count), read by the host.
    pub fn expected_inbound_token(&self) -> Result<u64> {
        self.expected.buffer().read_u64(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicBool;

    /// The counter logic under 8 signalling and 8 waiting threads, with a transport that behaves
    /// like Ethernet (a FIFO of absolute token values applied by one receiver thread, which checks
    /// that tokens only grow): every signal is sent once, with a distinct value, in order, and
    /// every signal is consumed exactly once.
    #[test]
    fn counters_lose_nothing_under_contention() {
        const THREADS: u64 = 8;
        const EACH: u64 = 2000;
        let c = Arc::new(Counters::default());
        let wire = Arc::new(Mutex::new(VecDeque::<u64>::new()));
        let token = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let receiver = {
            let (wire, token, stop) = (wire.clone(), token.clone(), stop.clone());
            std::thread::spawn(move || {
                loop {
                    let next = lock(&wire).pop_front();
                    match next {
                        Some(v) => {
                            let old = token.swap(v, Ordering::AcqRel);
                            assert_eq!(v, old + 1, "token went from {old} to {v}");
                        }
                        None if stop.load(Ordering::Acquire) => return,
                        None => std::thread::yield_now(),
                    }
                }
            })
        };
        let signallers: Vec<_> = (0..THREADS)
            .map(|_| {
                let (c, wire) = (c.clone(), wire.clone());
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        c.signal_with(|outbound, next| {
                            // like Connection::update_and_sync: checks (here a yield, which
                            // widens the window a racing signal would need), swap, enqueue
                            std::thread::yield_now();
                            let old = outbound.swap(next, Ordering::AcqRel);
                            assert_eq!(next, old + 1);
                            lock(&wire).push_back(next);
                            Ok(())
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        let waiters: Vec<_> = (0..THREADS)
            .map(|_| {
                let (c, token) = (c.clone(), token.clone());
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        while !c.try_consume(|| token.load(Ordering::Acquire)) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        for t in signallers.into_iter().chain(waiters) {
            t.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        receiver.join().unwrap();
        assert_eq!(token.load(Ordering::Acquire), THREADS * EACH);
        assert_eq!(c.outbound.load(Ordering::Acquire), THREADS * EACH);
        assert_eq!(c.consumed.load(Ordering::Acquire), THREADS * EACH);
        // nothing left to consume
        assert!(!c.try_consume(|| token.load(Ordering::Acquire)));
    }

    /// A consume happens only while the token is above the consumed count, so a failed wait
    /// takes nothing.
    #[test]
    fn try_consume_takes_only_what_arrived() {
        let c = Counters::default();
        assert!(!c.try_consume(|| 0));
        assert!(c.try_consume(|| 2));
        assert!(c.try_consume(|| 2));
        assert!(!c.try_consume(|| 2));
        assert_eq!(c.consumed.load(Ordering::Acquire), 2);
    }
}
