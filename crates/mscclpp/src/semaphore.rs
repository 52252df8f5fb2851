//! Semaphores: counters that one rank signals over a connection and the other waits on.
//!
//! Tokens only grow. The signalling side keeps an outbound counter and each `signal` sets the
//! peer's token to `outbound + 1` with [`Connection::update_and_sync`], which lands after every
//! earlier write of the connection. The waiting side keeps the count it expects; `wait` returns
//! once the token reaches it. So N signals allow N waits, and a waiter sees the data of every
//! write issued before the signal it consumed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::buffer::Buffer;
use crate::buffer::DeviceBuffer;
use crate::communicator::{Communicator, MsgKind, Pending};
use crate::conn::Connection;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::RegisteredMemory;
use crate::transport::{Device, Transport};

/// Moved to [`crate::device::handles`]; re-exported here (and at the crate root) for old paths.
pub use crate::device::handles::Host2DeviceSemaphoreDeviceHandle;

/// How long `wait` polls (spinning, then yielding) before it blocks.
const SPIN_THEN_YIELD: Duration = Duration::from_millis(1);

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
}

impl Token {
    fn memory(&self) -> &RegisteredMemory {
        match self {
            Token::Host(b) => b.memory(),
            Token::Gpu(b) => b.memory(),
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
            Token::Gpu(_) => None,
        }
    }
    fn gpu_token(&self) -> Option<&DeviceBuffer> {
        match &self.local.token {
            Token::Gpu(b) => Some(b),
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

/// A semaphore signalled and waited on by host threads (over Ethernet, and IB later).
///
/// ```no_run
/// # fn f(comm: &mscclpp::Communicator, conn: &mscclpp::Connection) -> mscclpp::Result<()> {
/// use mscclpp::Host2HostSemaphore;
/// use std::time::Duration;
/// let sem = Host2HostSemaphore::new(comm.build_semaphore(conn, 1, 0)?.wait()?)?;
/// sem.signal()?;                              // tell rank 1
/// sem.wait(Duration::from_secs(5))?;          // until rank 1 signals us
/// # Ok(()) }
/// ```
///
/// C++ MSCCL++: `Host2HostSemaphore` (its `wait` takes a spin count; this one a time).
#[derive(Debug)]
pub struct Host2HostSemaphore {
    sem: Semaphore,
    token: Buffer,
    outbound: AtomicU64,
    expected: AtomicU64,
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
        Ok(Host2HostSemaphore { sem, token, outbound: AtomicU64::new(0), expected: AtomicU64::new(0) })
    }

    /// The underlying semaphore.
    pub fn semaphore(&self) -> &Semaphore {
        &self.sem
    }
    /// The connection.
    pub fn connection(&self) -> &Connection {
        self.sem.connection()
    }

    fn inbound(&self) -> u64 {
        // The token buffer is 8 bytes at a page-aligned address: offset 0 is a valid atomic word.
        self.token.atomic_u64(0).map(|w| w.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// The peer's last signal count as seen here.
    pub fn inbound_token(&self) -> u64 {
        self.inbound()
    }

    /// Signals the peer once (after every earlier write of the connection).
    pub fn signal(&self) -> Result<()> {
        let next = self.outbound.load(Ordering::Acquire) + 1;
        self.connection().update_and_sync(self.sem.remote_memory(), 0, &self.outbound, next)
    }

    /// Consumes one signal if one is available.
    ///
    /// # Errors
    /// The connection's failure, when no signal is available and the connection has failed.
    pub fn poll(&self) -> Result<bool> {
        let want = self.expected.load(Ordering::Acquire) + 1;
        if self.inbound() >= want {
            self.expected.store(want, Ordering::Release);
            return Ok(true);
        }
        self.connection().status().map(|_| false)
    }

    /// Waits until the peer has signalled once more than this side has consumed.
    ///
    /// Polls for up to 1 ms (spinning, then yielding the CPU), then sleeps until the transport
    /// reports a token change, so a long wait does not hold a CPU core.
    ///
    /// # Errors
    /// `Timeout` naming the peer and the counts; or the connection's failure (a peer that
    /// closed or died), as soon as it is known.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let want = self.expected.load(Ordering::Acquire) + 1;
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        // Short spin: a signal that is already on its way lands within microseconds.
        // Spin, then yield, then block: a signal already on its way lands within microseconds,
        // and yielding (rather than sleeping) keeps the wake-up off the critical path while
        // letting the transport's threads run on a busy machine (measured in mscclpp-perf: an
        // 8-byte round trip drops from about 110 to 50 us on a 2-core VM).
        let mut n = 0u32;
        while start.elapsed() < SPIN_THEN_YIELD {
            if self.inbound() >= want {
                self.expected.store(want, Ordering::Release);
                return Ok(());
            }
            if n < 64 {
                std::hint::spin_loop();
                n += 1;
            } else {
                std::thread::yield_now();
            }
        }
        let ctx = self.connection().context().inner().clone();
        loop {
            let mut ready = || self.inbound() >= want;
            // The NIC writes IB tokens without telling this process: poll them often. Other
            // transports wake the waiter when they apply a token.
            let cap = if self.connection().transport().is_ib() {
                Duration::from_micros(50)
            } else {
                Duration::from_millis(20)
            };
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(cap),
                None => cap,
            };
            if ctx.wait_tokens(slice, &mut ready) {
                self.expected.store(want, Ordering::Release);
                return Ok(());
            }
            if let Err(e) = self.connection().status() {
                return Err(e.during("Host2HostSemaphore wait"));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!("Host2HostSemaphore: token is {}, waiting for {want}, after {timeout:?}", self.inbound()),
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
    outbound: AtomicU64,
    host_expected: AtomicU64,
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
        Ok(Host2DeviceSemaphore { sem, token, expected, outbound: AtomicU64::new(0), host_expected: AtomicU64::new(0) })
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

    /// Signals the peer once (after every earlier operation of the connection).
    pub fn signal(&self) -> Result<()> {
        let next = self.outbound.load(Ordering::Acquire) + 1;
        self.connection().update_and_sync(self.sem.remote_memory(), 0, &self.outbound, next)
    }

    /// The inbound token as the GPU holds it now.
    pub fn inbound_token(&self) -> Result<u64> {
        self.token.read_u64(0)
    }

    /// Host-side wait for one more signal (for tests and host code; kernels use the handle).
    ///
    /// # Errors
    /// `Timeout` naming the peer and the counts; the connection's failure; CUDA errors.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let want = self.host_expected.load(Ordering::Acquire) + 1;
        let start = Instant::now();
        let mut sleep = Duration::from_micros(2);
        loop {
            let have = self.inbound_token()?;
            if have >= want {
                self.host_expected.store(want, Ordering::Release);
                return Ok(());
            }
            self.connection().status().map_err(|e| e.during("Host2DeviceSemaphore wait"))?;
            if start.elapsed() >= timeout {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!("Host2DeviceSemaphore: token is {have}, waiting for {want}, after {timeout:?}"),
                );
                return Err(self.connection().ctx_err(e, "Host2DeviceSemaphore wait"));
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_micros(200));
        }
    }
}

impl From<Host2DeviceSemaphore> for crate::device::proxy::ProxySemaphore {
    /// Hands the semaphore to a proxy service, which signals it from then on (continuing its
    /// outbound count) while kernels wait on its device handle.
    fn from(s: Host2DeviceSemaphore) -> Self {
        let handle = s.device_handle();
        let outbound = s.outbound.load(Ordering::Acquire);
        let (conn, remote) = (s.connection().clone(), s.sem.remote_memory().clone());
        crate::device::proxy::ProxySemaphore::from_parts(conn, remote, outbound, Some(handle), Box::new(s))
    }
}

impl From<Semaphore> for crate::device::proxy::ProxySemaphore {
    /// Hands the semaphore to a proxy service, which signals it (from outbound count 0).
    fn from(s: Semaphore) -> Self {
        let (conn, remote) = (s.connection().clone(), s.remote_memory().clone());
        crate::device::proxy::ProxySemaphore::from_parts(conn, remote, 0, None, Box::new(s))
    }
}
