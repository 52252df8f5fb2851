//! Connections: the one-sided operations every transport implements, behind one handle.

pub(crate) mod cuda_ipc;
pub(crate) mod endpoint;
pub(crate) mod ethernet;
pub(crate) mod ib;
pub(crate) mod linger;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tracing::trace_span;

use crate::conn::endpoint::Endpoint;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::RegisteredMemory;
use crate::transport::{Device, Transport};

/// What every transport implements. Validation common to all transports has already run when a
/// method is called (see [`Connection`]).
pub(crate) trait ConnectionImpl: Send + Sync {
    fn write(&self, dst: &RegisteredMemory, dst_off: u64, src: &RegisteredMemory, src_off: u64, len: u64)
    -> Result<()>;
    /// Makes the peer's word at `dst + dst_off` equal `new`, after earlier operations; `old` is
    /// the value it had (transports that send deltas use it).
    fn update_and_sync(&self, dst: &RegisteredMemory, dst_off: u64, old: u64, new: u64) -> Result<()>;
    fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()>;
    fn flush(&self, timeout: Duration) -> Result<()>;
    /// The first error that broke the connection, if any.
    fn failure(&self) -> Option<Error>;
    fn max_write_queue_size(&self) -> usize;
    /// Operations issued and not yet known to be applied at the peer.
    fn outstanding(&self) -> u64;
    /// Non-blocking: how far operations were issued and are known complete (sequence numbers).
    /// With `request`, also arranges that the completion of everything issued so far shows in
    /// later calls without another request (Ethernet asks the peer for an acknowledgement, CUDA
    /// IPC records an event). The connection's failure is an error.
    fn progress(&self, request: bool) -> Result<Progress>;
    /// Refuses token updates the transport cannot carry (before anything changes).
    fn check_update(&self, _old: u64, _new: u64) -> Result<()> {
        Ok(())
    }
    /// Whether signals arrive through a receive thread that stores them into a local token (the
    /// peer's token then needs no registration for this transport).
    fn forwards_signals(&self) -> bool {
        false
    }
    /// Sets the local token (host or GPU memory of this process) that incoming signals are
    /// stored into (forwarding transports only).
    fn forward_signals_into(&self, _token: &RegisteredMemory) -> Result<()> {
        Ok(())
    }
    /// How signals are forwarded into the local token, for transports that forward.
    fn signal_forwarding(&self) -> Option<String> {
        None
    }
    /// Applies what the peer sent that is already here, without blocking, on the calling thread
    /// (a waiter's poll); false when the transport has nothing to do or another thread is at it.
    /// Transports whose receiving needs no thread keep the default.
    fn poll_incoming(&self) -> bool {
        false
    }
    /// The waiter that called [`poll_incoming`](Self::poll_incoming) stops polling without its
    /// signal (it blocks until the transport reports one): the transport's receive thread takes
    /// over at once.
    fn stop_polling(&self) {}
    /// The largest `write` that [`try_write_and_update`](Self::try_write_and_update) joins with
    /// its token into one operation (0: none; CUDA IPC's kernel copies).
    fn joined_write_max(&self) -> u64 {
        0
    }
    /// `write`, then `update_and_sync`, issued as one operation where the transport can join
    /// them for `len` (at most [`joined_write_max`](Self::joined_write_max)): `Ok(true)`.
    /// `Ok(false)`, with nothing issued, where it cannot (the caller then issues the two).
    #[allow(clippy::too_many_arguments)]
    fn try_write_and_update(
        &self,
        _dst: &RegisteredMemory,
        _dst_off: u64,
        _src: &RegisteredMemory,
        _src_off: u64,
        _len: u64,
        _tok: (&RegisteredMemory, u64),
        _old: u64,
        _new: u64,
    ) -> Result<bool> {
        Ok(false)
    }
}

/// How far a connection has got, in sequence numbers counted from the connection's start: every
/// operation (`write`, `update_and_sync`, `atomic_add`, and transport-internal probes) takes the
/// next number, and `completed >= n` means operation `n` and everything before it has been
/// applied in the peer's memory. Both only grow.
///
/// See [`Connection::progress`] and [`Connection::request_progress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Progress {
    /// Sequence number of the last operation issued (0: none yet).
    pub issued: u64,
    /// Every operation up to this sequence number is applied at the peer.
    pub completed: u64,
}

pub(crate) struct ConnInner {
    pub(crate) imp: Box<dyn ConnectionImpl>,
    pub(crate) transport: Transport,
    pub(crate) remote_transport: Transport,
    pub(crate) device: Device,
    pub(crate) context: Context,
    pub(crate) peer: Option<usize>,
    pub(crate) peer_desc: String,
}

/// A one-sided channel to one peer: writes into the peer's registered memory, token updates and
/// remote atomics, each applied at the peer in the order issued, and `flush` to wait for them.
///
/// A cheap-clone handle; the connection closes when the last clone is dropped (see the
/// transport's notes for what closing waits for).
///
/// Every method validates first: the memories must carry the right transports (the source this
/// connection's, the destination the peer's), the ranges must be in bounds, and 8-byte words must
/// be aligned. A failed check is `InvalidUsage` and sends nothing. Once the connection has failed
/// (peer gone, frame refused), every call returns that first error, with one exception: over
/// Ethernet, after the peer dropped its connection, `flush` still succeeds when every operation
/// it covers had been applied (dropping a connection acknowledges what it applied).
/// Over CUDA IPC a peer process that exits fails the connection (`Remote`, naming the peer),
/// `flush` included.
///
/// C++ MSCCL++: `Connection`.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<ConnInner>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("transport", &self.inner.transport)
            .field("peer", &self.inner.peer_desc)
            .field("device", &self.inner.device)
            .finish()
    }
}

impl Connection {
    pub(crate) fn from_inner(inner: ConnInner) -> Connection {
        Connection { inner: Arc::new(inner) }
    }

    /// Whether `other` is a clone of this connection.
    pub(crate) fn same_as(&self, other: &Connection) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Names the operation, this connection's transport and, where known, the peer in `e`.
    pub(crate) fn ctx_err(&self, e: Error, op: &str) -> Error {
        let e = e.during(op.to_string()).with_transport(self.inner.transport);
        match self.inner.peer {
            Some(p) => e.with_peer(p),
            None => e,
        }
    }

    /// Checks `[off, off + len)` of `dst`, and with `registered` that the peer registered it for
    /// the peer's transport.
    fn check_dst(&self, dst: &RegisteredMemory, off: u64, len: u64, registered: bool) -> Result<()> {
        if registered && !dst.transports().has(self.inner.remote_transport) {
            return Err(Error::invalid_usage(format!(
                "destination memory is registered for {} and not for {}",
                dst.transports(),
                self.inner.remote_transport
            )));
        }
        dst.check_bounds(off, len).map_err(|e| Error::invalid_usage(format!("destination {}", e.message())))
    }

    fn check_word(&self, dst: &RegisteredMemory, off: u64, registered: bool) -> Result<()> {
        self.check_dst(dst, off, 8, registered)?;
        if !(dst.addr().wrapping_add(off)).is_multiple_of(8) {
            return Err(Error::invalid_usage(format!("destination word at offset {off} is not 8-byte aligned")));
        }
        Ok(())
    }

    /// Copies `len` bytes from `src + src_off` (local memory) to `dst + dst_off` (the peer's).
    ///
    /// Asynchronous: it returns once the write is queued; `src` must not change until
    /// [`flush`](Self::flush) returns. Waits (and may time out) only when
    /// [`max_write_queue_size`](Self::max_write_queue_size) operations are outstanding.
    pub fn write(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        let _s = trace_span!(target: "mscclpp::conn", "write", len, dst_off).entered();
        let r = (|| {
            self.check_write(dst, dst_off, src, src_off, len)?;
            self.inner.imp.write(dst, dst_off, src, src_off, len)
        })();
        r.map_err(|e| self.ctx_err(e, "write"))
    }

    /// What `write` checks before anything is issued.
    fn check_write(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        self.check_dst(dst, dst_off, len, true)?;
        if !src.transports().has(self.inner.transport) {
            return Err(Error::invalid_usage(format!(
                "source memory is registered for {} and not for {}",
                src.transports(),
                self.inner.transport
            )));
        }
        if !src.is_local() {
            return Err(Error::invalid_usage("source memory is a peer's; the source of a write must be local"));
        }
        src.check_bounds(src_off, len).map_err(|e| Error::invalid_usage(format!("source {}", e.message())))
    }

    /// The largest write [`write_and_update_and_sync`](Self::write_and_update_and_sync) issues
    /// as one operation with its token (0: it always makes two).
    pub(crate) fn joined_write_max(&self) -> u64 {
        self.inner.imp.joined_write_max()
    }

    /// [`write`](Self::write), then [`update_and_sync`](Self::update_and_sync) of the word
    /// `tok`: everything is checked first, then both are issued, as one operation on a transport
    /// that can join them (CUDA IPC with kernel copies: one driver call).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_and_update_and_sync(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
        tok: (&RegisteredMemory, u64),
        outbound: &AtomicU64,
        new_value: u64,
    ) -> Result<()> {
        let _s = trace_span!(target: "mscclpp::conn", "write_and_update_and_sync", len, new_value).entered();
        let r = (|| {
            self.check_write(dst, dst_off, src, src_off, len)?;
            self.check_word(tok.0, tok.1, !self.inner.imp.forwards_signals())?;
            self.inner.imp.check_update(outbound.load(Ordering::Acquire), new_value)?;
            let old = outbound.swap(new_value, Ordering::AcqRel);
            let imp = &self.inner.imp;
            if !imp.try_write_and_update(dst, dst_off, src, src_off, len, tok, old, new_value)? {
                imp.write(dst, dst_off, src, src_off, len)?;
                imp.update_and_sync(tok.0, tok.1, old, new_value)?;
            }
            Ok(())
        })();
        r.map_err(|e| self.ctx_err(e, "write_and_update_and_sync"))
    }

    /// Sets the peer's 8-byte word at `dst + dst_off` to `new_value`, visible only after every
    /// earlier operation of this connection. `outbound` is the local copy of that word (the
    /// semaphore's outbound token): it is set to `new_value` here, and its old value tells
    /// delta-based transports (IB atomics) what to add.
    ///
    /// C++ MSCCL++: `Connection::updateAndSync(dst, dstOffset, src, newValue)`.
    pub fn update_and_sync(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        outbound: &AtomicU64,
        new_value: u64,
    ) -> Result<()> {
        let _s = trace_span!(target: "mscclpp::conn", "update_and_sync", new_value).entered();
        let r = (|| {
            self.check_word(dst, dst_off, !self.inner.imp.forwards_signals())?;
            self.inner.imp.check_update(outbound.load(Ordering::Acquire), new_value)?;
            let old = outbound.swap(new_value, Ordering::AcqRel);
            self.inner.imp.update_and_sync(dst, dst_off, old, new_value)
        })();
        r.map_err(|e| self.ctx_err(e, "update_and_sync"))
    }

    /// Adds `value` to the peer's 8-byte word at `dst + dst_off` atomically (wrapping), after
    /// every earlier operation of this connection; [`flush`](Self::flush) covers it.
    pub fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
        let _s = trace_span!(target: "mscclpp::conn", "atomic_add", value).entered();
        let r = (|| {
            self.check_word(dst, dst_off, true)?;
            self.inner.imp.atomic_add(dst, dst_off, value)
        })();
        r.map_err(|e| self.ctx_err(e, "atomic_add"))
    }

    /// Waits until every operation issued before this call has been applied in the peer's
    /// memory. `Duration::ZERO` checks once (`Ok` when nothing is outstanding);
    /// `Duration::MAX` (or any timeout too far to be a point in time) means no limit.
    ///
    /// # Errors
    /// `Timeout` naming the peer, the transport and how many operations are outstanding; or the
    /// error that broke the connection.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        let _s = trace_span!(target: "mscclpp::conn", "flush").entered();
        self.inner.imp.flush(timeout).map_err(|e| self.ctx_err(e, "flush"))
    }

    /// `Ok` while the connection works; the error that broke it otherwise.
    pub fn status(&self) -> Result<()> {
        match self.inner.imp.failure() {
            Some(e) => Err(self.ctx_err(e, "connection status")),
            None => Ok(()),
        }
    }

    /// How incoming signals reach the local semaphore token when a receive thread forwards them
    /// (IB HostNoAtomic: `"host store"`, `"GDRCopy (BAR1 mapping)"`, `"cuStreamWriteValue64"`,
    /// ...); `None` when the peer's updates land in the token directly.
    pub fn signal_forwarding(&self) -> Option<String> {
        self.inner.imp.signal_forwarding()
    }

    pub(crate) fn forwards_signals(&self) -> bool {
        self.inner.imp.forwards_signals()
    }

    pub(crate) fn forward_signals_into(&self, t: &RegisteredMemory) -> Result<()> {
        self.inner.imp.forward_signals_into(t)
    }

    /// How far this connection has issued and completed operations, without blocking: the
    /// non-blocking counterpart of [`flush`](Self::flush). Record `request_progress()` as a
    /// position, keep working, and poll until `progress()?.completed` reaches it.
    ///
    /// Completion is learnt from the transport (CUDA IPC: events and stream queries; Ethernet: the
    /// peer's acknowledgements; IB: send completions, polled by this call), so without a
    /// [`request_progress`](Self::request_progress) it may lag behind what has actually landed.
    ///
    /// # Errors
    /// The error that broke the connection.
    pub fn progress(&self) -> Result<Progress> {
        self.inner.imp.progress(false).map_err(|e| self.ctx_err(e, "progress"))
    }

    /// Returns the sequence number of the last operation issued so far (a flush position) and
    /// makes sure its completion will show in [`progress`](Self::progress) without further calls:
    /// Ethernet queues an acknowledgement probe (waiting only if the write queue is full), CUDA
    /// IPC records an event on the connection's stream, IB needs nothing. Does not wait for
    /// completion.
    ///
    /// # Errors
    /// The error that broke the connection.
    pub fn request_progress(&self) -> Result<u64> {
        self.inner.imp.progress(true).map(|p| p.issued).map_err(|e| self.ctx_err(e, "request_progress"))
    }

    /// [`request_progress`](Self::request_progress) and [`progress`](Self::progress) in one call:
    /// the progress now, with completion of `issued` requested.
    pub(crate) fn progress_requested(&self) -> Result<Progress> {
        self.inner.imp.progress(true).map_err(|e| self.ctx_err(e, "request_progress"))
    }

    /// Applies incoming operations already here on the calling thread, without blocking (see
    /// `ConnectionImpl::poll_incoming`): a waiter sees a signal without a hand-off from the
    /// transport's receive thread.
    pub(crate) fn poll_incoming(&self) -> bool {
        self.inner.imp.poll_incoming()
    }

    /// The waiter stops polling (see `ConnectionImpl::stop_polling`).
    pub(crate) fn stop_polling(&self) {
        self.inner.imp.stop_polling()
    }

    /// Operations issued whose application at the peer is not yet confirmed.
    pub fn outstanding(&self) -> u64 {
        self.inner.imp.outstanding()
    }
    /// This side's transport.
    pub fn transport(&self) -> Transport {
        self.inner.transport
    }
    /// The peer's transport.
    pub fn remote_transport(&self) -> Transport {
        self.inner.remote_transport
    }
    /// The device this connection serves.
    pub fn local_device(&self) -> Device {
        self.inner.device
    }
    /// The most operations outstanding before `write` waits.
    pub fn max_write_queue_size(&self) -> usize {
        self.inner.imp.max_write_queue_size()
    }
    /// The context the connection belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.context
    }
    /// The peer's rank, when the connection was made through a [`Communicator`](crate::Communicator).
    pub fn peer_rank(&self) -> Option<usize> {
        self.inner.peer
    }
}

/// Endpoints and connections: `Context`'s methods of the connection layer (defined here because
/// `context` sits below `conn` in the layers).
impl Context {
    /// Creates an endpoint for `config`: for Ethernet, a socket listening on the configured (or
    /// chosen) interface; for CUDA IPC, the owner's identity; for IB, a queue pair.
    ///
    /// # Errors
    /// `NotAvailable` for a transport this build does not have yet; `InvalidUsage` for a bad
    /// interface; `System` when the socket cannot be opened.
    pub fn create_endpoint(&self, config: &crate::transport::EndpointConfig) -> Result<Endpoint> {
        endpoint::create_endpoint(self, config)
    }

    /// Connects a local endpoint with a peer's (received) endpoint.
    ///
    /// The peer must make the matching call (with the two endpoints swapped) within the
    /// endpoint's connect timeout; neither side waits for the other to be inside this call.
    ///
    /// # Errors
    /// `InvalidUsage` for mismatched transports, a non-local `local`, or an endpoint already
    /// used; transport errors otherwise.
    pub fn connect(&self, local: &Endpoint, remote: &Endpoint) -> Result<Connection> {
        self.connect_with_peer(local, remote, None)
    }

    pub(crate) fn connect_with_peer(
        &self,
        local: &Endpoint,
        remote: &Endpoint,
        peer: Option<usize>,
    ) -> Result<Connection> {
        let op = "connect";
        let t = local.transport();
        let wrap = |e: Error| {
            let e = e.during(op).with_transport(t);
            match peer {
                Some(p) => e.with_peer(p),
                None => e,
            }
        };
        let Some(l) = local.local() else {
            return Err(wrap(Error::invalid_usage(
                "the local endpoint was received from a peer; create one with create_endpoint",
            )));
        };
        if !Arc::ptr_eq(l.context.inner(), self.inner()) {
            return Err(wrap(Error::invalid_usage("the local endpoint belongs to another context")));
        }
        if remote.transport() != t && !(remote.transport().is_ib() && t.is_ib()) {
            return Err(wrap(Error::invalid_usage(format!(
                "transport mismatch: local endpoint is {t}, remote is {}",
                remote.transport()
            ))));
        }
        match t {
            Transport::Ethernet => ethernet::connect(self, local, remote, peer).map_err(wrap),
            Transport::CudaIpc => cuda_ipc::connect(self, local, remote, peer).map_err(wrap),
            _ => ib::connect(self, local, remote, peer).map_err(wrap),
        }
    }
}
