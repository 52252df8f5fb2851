//! Semaphores: counters that one rank signals over a connection and the other waits on.
//!
//! Tokens only grow. The signalling side keeps an outbound counter and each `signal` sets the
//! peer's token to `outbound + 1` with [`Connection::update_and_sync`], which lands after every
//! earlier write of the connection. The waiting side keeps the count it expects; `wait` returns
//! once the token reaches it. So N signals allow N waits, and a waiter sees the data of every
//! write issued before the signal it consumed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::communicator::{Communicator, MsgKind, Pending};
use crate::conn::Connection;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Buffer, RegisteredMemory};
use crate::transport::{Device, Transport};

/// How long `wait` polls (spinning, then yielding) before it blocks.
const SPIN_THEN_YIELD: Duration = Duration::from_millis(1);

/// The local half of a semaphore: a token word registered for the connection's transport.
///
/// C++ MSCCL++: `SemaphoreStub`.
#[derive(Clone, Debug)]
pub struct SemaphoreStub {
    connection: Connection,
    token: Buffer,
}

impl SemaphoreStub {
    /// Allocates and registers the token for `connection` (host memory for now).
    ///
    /// # Errors
    /// `NotAvailable` for a GPU-side connection until the CUDA transport exists.
    pub fn new(connection: &Connection) -> Result<SemaphoreStub> {
        if let Device::Gpu(_) = connection.local_device() {
            return Err(Error::not_available("GPU semaphore tokens need the CUDA support, not part of this build yet"));
        }
        let token = Buffer::new(connection.context(), 8, connection.transport().into())?;
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
    pub(crate) fn local_token(&self) -> &Buffer {
        &self.local.token
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
        if c.local_device() != Device::Cpu {
            return Err(Error::invalid_usage("a Host2HostSemaphore needs a connection whose local device is the CPU"));
        }
        Ok(Host2HostSemaphore { sem, outbound: AtomicU64::new(0), expected: AtomicU64::new(0) })
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
        self.sem.local_token().atomic_u64(0).map(|w| w.load(Ordering::Acquire)).unwrap_or(0)
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
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(Duration::from_millis(20)),
                None => Duration::from_millis(20),
            };
            if ctx.wait_tokens(slice, &mut ready) {
                self.expected.store(want, Ordering::Release);
                return Ok(());
            }
            if let Err(e) = self.connection().status() {
                return Err(e.during("Host2HostSemaphore wait"));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let mut e = Error::new(
                    ErrorKind::Timeout,
                    format!("Host2HostSemaphore: token is {}, waiting for {want}, after {timeout:?}", self.inbound()),
                )
                .during("Host2HostSemaphore wait")
                .with_transport(self.connection().transport());
                if let Some(p) = self.connection().peer_rank() {
                    e = e.with_peer(p);
                }
                return Err(e);
            }
        }
    }
}
