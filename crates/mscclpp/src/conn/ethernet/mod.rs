//! The Ethernet (TCP) transport.
//!
//! # Layout
//! [`core`] holds the protocol without I/O: the sender core (sequence numbers, the write-queue
//! bound, batching, acknowledgement requests, the peer's records) and the receiver core (headers
//! reassembled from any cut of the stream, validation, what to apply and when to acknowledge).
//! [`wire`] holds the byte forms (frame header, records, handshake). This file is the shell that
//! drives the cores: sockets, the three threads, GPU staging.
//!
//! # Sockets
//! Each side of a connection has two TCP sockets: the one it opened to the peer's endpoint
//! (`out`: its frames go out, the peer's acknowledgements come back) and the one the peer opened
//! to its endpoint (`in`: the peer's frames come in, its acknowledgements go out). An endpoint
//! accepts on a thread of its own from the moment it is created, so `connect` never waits for
//! the peer to be inside `connect` too, and all-pairs setup in any order cannot deadlock.
//! Each socket opens with a handshake carrying the endpoint's 128-bit secret (which only the
//! peer learned, through the bootstrap); a connection without it is dropped.
//!
//! # Frames
//! A [`wire::FrameHeader`] (48 bytes, little-endian) names the operation, a sequence number, the
//! destination region (by id, in the receiver's context) and offset, the payload length and a
//! value. The receiver checks every field against its context's table of registered Ethernet
//! regions before it touches memory; a frame that fails is refused: nothing is written, the
//! receiver tells the sender why, and both sides' connection fails with that error.
//!
//! # Ordering and flush
//! One stream per direction applies operations in order, so a token update lands after the
//! writes before it. The receiver acknowledges applied sequence numbers when the sender asks
//! (a flag set on frames once half the queue bound is unconfirmed, and on the probe `flush`
//! sends) and every 256 frames; `flush` waits for the acknowledgement of everything issued.
//!
//! # Closing
//! Dropping a connection acknowledges everything its receiver applied before the socket closes:
//! the receiver is woken (its socket shut for reading), applies what had already arrived, and
//! sends a closing record naming the last frame it applied ([`wire::Record::Closing`]); only then
//! is the socket closed. The peer's `flush` succeeds when every operation it covers is
//! acknowledged and the peer closed this way (the end of the peer's frames does not cut this
//! side's acknowledgement stream short), and fails with the closing error otherwise: for
//! operations still in flight at the close, and after a peer that died (no closing record).
//!
//! # Copies
//! None on either side: the sender hands headers and payloads, straight from the source region, to
//! one `sendmsg` per batch of frames, and the receiver reads payloads straight into the destination
//! region (only bytes that arrived in the same read as a header pass through its small buffer).
//! Token updates, atomics and flush probes are sent by the calling thread itself when the sender
//! thread is idle, together with the small writes (up to [`INLINE_LIMIT`]) queued before them:
//! a write followed by a signal is one `sendmsg` and one packet, with no hand-off to another
//! thread. A small write with nothing after it goes out from the sender thread after a 20 us
//! grace (up to one 1 ms tick later while that thread lingers); larger writes go through the
//! sender thread at once, so `write` never blocks on a big transfer.
//!
//! # Small operations (where the time went, and what was done)
//! Profiled on a 2-core VM (`strace -f -c`, `perf record`, `mscclpp-perf -b 8 -e 8`): per
//! write+signal the caller used to wake the sender thread (a futex wake, a context switch and a
//! yielding grace loop that fought the caller for the state lock: about 2 futex calls and 1-4
//! `sched_yield` per operation); once half the queue bound was unconfirmed every frame asked for
//! an acknowledgement until the answer arrived, so the receiver sent one per frame and woke the
//! sender's acknowledgement thread each time; and each reply in a ping-pong woke the receiver
//! thread from a blocking `recv`. Now the idle sender thread lingers for 1 s, looking at the
//! queue every 1 ms on its own, and is woken only from its long sleep; acknowledgements are
//! asked for once per half bound; and a thread waiting on a semaphore applies what arrived itself
//! (`poll_incoming`: non-blocking reads under the receiver's lock, which the receiver thread
//! takes only with `try_lock` and only after waiting for data in `poll` without it; while a
//! waiter polls, the receiver thread keeps away from the socket), so a ping-pong reply needs no
//! hand-off from the receiver thread.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use self::core::{Op, QueueFull, ReceiverCore, RegionInfo, RxEvent, SenderCore};
use self::wire::{HELLO_ACK_LEN, HELLO_LEN, Hello, HelloAck, Record};
use super::{ConnInner, Connection, ConnectionImpl};
use crate::conn::endpoint::{Endpoint, EndpointKind};
use crate::context::{Context, ContextInner};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{LocalRegion, Mem, RegisteredMemory};
use crate::net::{StoppableListener, readable};
use crate::platform::cuda::GpuRegion;
use crate::platform::hostmem::Region;
use crate::platform::hostmem::{IoPart, send_vectored};
use crate::sync::lock;
use crate::transport::Transport;
use crate::wire::{WireForm, length_prefixed, read_length_prefixed};

pub(crate) mod core;
pub(crate) mod wire;

const LOG: &str = "mscclpp::conn";
/// Writes up to this size may be sent by the calling thread when the sender thread is idle;
/// larger ones always go through the sender thread, so `write` never blocks on a big transfer.
pub const INLINE_LIMIT: u64 = 1 << 20;
/// How long the sender thread holds a small write for the operation that usually follows it.
const COALESCE_GRACE: Duration = Duration::from_micros(20);
/// While it lingers, the idle sender thread looks for held small writes this often on its own,
/// so that queueing one needs no wake-up.
const TX_TICK: Duration = Duration::from_millis(1);
/// How long the sender thread lingers (ticking) after its last small write before it sleeps
/// until woken.
const TX_LINGER: Duration = Duration::from_secs(1);
/// How long dropping a connection waits for its outstanding operations to land.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------------------
// Accepting the peer's socket

struct AcceptShared {
    slot: Mutex<Option<TcpStream>>,
    cond: Condvar,
    stop: AtomicBool,
}

/// Accepts the one peer connection of an Ethernet endpoint, from the endpoint's creation on.
pub(crate) struct Acceptor {
    addr: SocketAddr,
    shared: Arc<AcceptShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Acceptor {
    pub(crate) fn start(listener: TcpListener, secret: [u8; 16], context_id: u64) -> Result<Acceptor> {
        let addr = listener.local_addr().map_err(|e| Error::io("reading the listening address", e))?;
        let shared =
            Arc::new(AcceptShared { slot: Mutex::new(None), cond: Condvar::new(), stop: AtomicBool::new(false) });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("mscclpp-eth-accept".into())
            .spawn(move || accept_loop(listener, sh, secret, context_id))
            .map_err(|e| Error::io("starting the Ethernet accept thread", e))?;
        Ok(Acceptor { addr, shared, thread: Mutex::new(Some(thread)) })
    }

    /// Takes the peer's socket, waiting until `deadline` (or until `stop` is set).
    fn take(&self, deadline: Instant, stop: &AtomicBool) -> Result<TcpStream> {
        let mut g = lock(&self.shared.slot);
        loop {
            if let Some(s) = g.take() {
                return Ok(s);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(ErrorKind::Timeout, "the peer did not connect back to this endpoint in time"));
            }
            if stop.load(Ordering::Acquire) {
                return Err(Error::new(ErrorKind::Aborted, "connection closed before the peer connected back"));
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            g = self.shared.cond.wait_timeout(g, wait).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<AcceptShared>, secret: [u8; 16], context_id: u64) {
    let mut handshakes: Vec<JoinHandle<()>> = Vec::new();
    let listener = StoppableListener::new(listener);
    let stopped = || sh.stop.load(Ordering::Acquire) || lock(&sh.slot).is_some();
    while let Some(conn) = listener.next(stopped) {
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors or a transient error: do not spin.
                debug!(target: LOG, "accepting on {:?}: {e}", listener.local_addr().ok());
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if stopped() {
            break;
        }
        let sh2 = sh.clone();
        let h = std::thread::Builder::new().name("mscclpp-eth-hs".into()).spawn(move || {
            let from = s.peer_addr().ok();
            match accept_handshake(s, &secret, context_id) {
                Ok(s) => {
                    let mut slot = lock(&sh2.slot);
                    if slot.is_none() && !sh2.stop.load(Ordering::Acquire) {
                        *slot = Some(s);
                        sh2.cond.notify_all();
                    } else {
                        warn!(target: LOG, "endpoint already connected; dropping a second peer connection from {from:?}");
                    }
                }
                Err(e) => warn!(target: LOG, "dropping connection from {from:?} that failed the handshake: {e}"),
            }
        });
        if let Ok(h) = h {
            handshakes.push(h);
        }
        if lock(&sh.slot).is_some() {
            break;
        }
    }
    // Handshake threads finish within their read timeout.
    for h in handshakes {
        let _ = h.join();
    }
}

fn accept_handshake(mut s: TcpStream, secret: &[u8; 16], context_id: u64) -> Result<TcpStream> {
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| Error::io("setting a read timeout", e))?;
    let body = read_length_prefixed(&mut s, HELLO_LEN, "the handshake")?;
    let hello = Hello::from_wire(&body)?;
    if &hello.secret != secret {
        return Err(Error::remote("wrong endpoint secret"));
    }
    s.write_all(&HelloAck { context: context_id }.to_wire()).map_err(|e| Error::io("answering the handshake", e))?;
    s.set_read_timeout(None).map_err(|e| Error::io("clearing the read timeout", e))?;
    let _ = s.set_nodelay(true);
    Ok(s)
}

/// Opens the socket to the peer's endpoint and returns it with the peer's context id.
fn dial(addr: SocketAddr, secret: &[u8; 16], my_context: u64, deadline: Instant) -> Result<(TcpStream, u64)> {
    let mut s = crate::net::connect_retry(
        addr,
        crate::sync::Deadline::after(deadline.saturating_duration_since(Instant::now())),
        "the peer's Ethernet endpoint",
    )?;
    let hello = Hello { secret: *secret, context: my_context }.to_wire();
    s.write_all(&length_prefixed(&hello)).map_err(|e| Error::io("sending the handshake", e))?;
    s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10))))
        .map_err(|e| Error::io("setting a read timeout", e))?;
    let mut ack = [0u8; HELLO_ACK_LEN];
    s.read_exact(&mut ack).map_err(|e| {
        let why = match e.kind() {
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof => {
                "waiting for the peer's handshake answer (the peer closed its endpoint before answering: \
                 it dropped the connection, exited, or the endpoint was already used)"
            }
            _ => "waiting for the peer's handshake answer",
        };
        Error::io(why, e)
    })?;
    let ack = HelloAck::from_wire(&ack)?;
    s.set_read_timeout(None).map_err(|e| Error::io("clearing the read timeout", e))?;
    Ok((s, ack.context))
}

// ---------------------------------------------------------------------------------------------
// Staging GPU memory through pinned host buffers

/// Bytes per staging chunk.
const STAGE_CHUNK: usize = 4 << 20;

pub(crate) enum StageError {
    Io(std::io::Error),
    Mscclpp(Error),
}

impl From<Error> for StageError {
    fn from(e: Error) -> Self {
        StageError::Mscclpp(e)
    }
}
impl From<std::io::Error> for StageError {
    fn from(e: std::io::Error) -> Self {
        StageError::Io(e)
    }
}

/// Two pinned buffers, a stream and two events on one GPU: double buffering between the GPU's
/// copy engine and the socket.
pub(crate) struct Stager {
    stream: crate::platform::cuda::Stream,
    events: [crate::platform::cuda::Event; 2],
    stages: [Region; 2],
    /// Whether `events[k]` was recorded since stage `k` was last waited for.
    pending: [bool; 2],
}

fn stager_for<'a>(map: &'a mut HashMap<u32, Stager>, g: &GpuRegion) -> Result<&'a mut Stager> {
    use std::collections::hash_map::Entry;
    match map.entry(g.dev.ordinal) {
        Entry::Occupied(e) => Ok(e.into_mut()),
        Entry::Vacant(v) => {
            let dev = &g.dev;
            Ok(v.insert(Stager {
                stream: crate::platform::cuda::Stream::new(dev)?,
                events: [crate::platform::cuda::Event::new(dev)?, crate::platform::cuda::Event::new(dev)?],
                stages: [
                    crate::platform::cuda::PinnedAlloc::region(dev, STAGE_CHUNK)?,
                    crate::platform::cuda::PinnedAlloc::region(dev, STAGE_CHUNK)?,
                ],
                pending: [false; 2],
            }))
        }
    }
}

/// Long enough for any one chunk's copy; a stuck GPU fails the connection instead of hanging it.
const STAGE_WAIT: Duration = Duration::from_secs(60);

impl Stager {
    fn wait(&mut self, k: usize) -> Result<()> {
        if self.pending[k] {
            if !self.events[k].wait(STAGE_WAIT)? {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("a GPU staging copy did not finish in {STAGE_WAIT:?}"),
                ));
            }
            self.pending[k] = false;
        }
        Ok(())
    }

    /// Sends `len` bytes of GPU memory from `off`: chunk i+1 is copied to the host while chunk i
    /// goes into the socket.
    fn send(&mut self, out: &TcpStream, src: &GpuRegion, off: u64, len: u64) -> std::result::Result<(), StageError> {
        src.check(off, len)?;
        let chunks = len.div_ceil(STAGE_CHUNK as u64) as usize;
        let size = |i: usize| (len - (i * STAGE_CHUNK) as u64).min(STAGE_CHUNK as u64) as usize;
        let issue = |st: &mut Stager, i: usize| -> Result<()> {
            let k = i % 2;
            st.wait(k)?;
            st.stream.copy_dtoh(st.stages[k].as_mut_ptr(), src.ptr + off + (i * STAGE_CHUNK) as u64, size(i))?;
            st.stream.record(&st.events[k])?;
            st.pending[k] = true;
            Ok(())
        };
        if chunks > 0 {
            issue(self, 0)?;
        }
        for i in 0..chunks {
            if i + 1 < chunks {
                issue(self, i + 1)?;
            }
            self.wait(i % 2)?;
            send_vectored(out, &[self.stages[i % 2].part(0, size(i) as u64)?])?;
        }
        Ok(())
    }

    /// Receives `len` bytes into GPU memory at `off`: the socket fills one pinned buffer while
    /// the other is copied to the GPU. Returns once the data is in GPU memory.
    fn recv(
        &mut self,
        rd: &mut BufReader<RxSocket>,
        dst: &GpuRegion,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), StageError> {
        dst.check(off, len)?;
        let mut done = 0u64;
        let mut i = 0usize;
        while done < len {
            let n = (len - done).min(STAGE_CHUNK as u64) as usize;
            let k = i % 2;
            self.wait(k)?;
            let b = rd.buffer().len().min(n);
            self.stages[k].write(0, &rd.buffer()[..b])?;
            rd.consume(b);
            if b < n {
                self.stages[k].recv_exact(b as u64, (n - b) as u64, &rd.get_ref().sock)?;
            }
            self.stream.copy_htod(dst.ptr + off + done, self.stages[k].as_mut_ptr(), n)?;
            self.stream.record(&self.events[k])?;
            self.pending[k] = true;
            done += n as u64;
            i += 1;
        }
        self.wait(0)?;
        self.wait(1)?;
        Ok(())
    }

    /// Sets or adds to a GPU word in stream order and waits for it.
    fn token(&mut self, dst: &GpuRegion, off: u64, value: u64, add: bool) -> Result<()> {
        dst.check(off, 8)?;
        let addr = dst.ptr + off;
        if add {
            self.stream.atomic_add(addr, value)?;
        } else if !self.stream.write_value64(addr, value)? {
            // No stream memory operations on this device: copy from a pinned slot, then wait.
            self.wait(0)?;
            self.stages[0].write(0, &value.to_le_bytes())?;
            self.stream.copy_htod(addr, self.stages[0].as_mut_ptr(), 8)?;
        }
        // Bounded: the atomic is a one-thread kernel, which a GPU filled by kernels spinning for
        // this very token cannot schedule (notes 1.7); fail the connection then, never hang.
        if !self.stream.wait_idle(STAGE_WAIT)? {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("a GPU token update did not finish in {STAGE_WAIT:?} (is the GPU full of waiting kernels?)"),
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The connection

/// A write's payload source on this side: a local registered region.
type Src = Arc<LocalRegion>;

/// How long a blocked send (the peer takes no byte) or a blocked read of a frame's remaining
/// bytes waits before the connection fails: the configured wait limit, at least 1 s.
fn stall_limit(wait_limit: Duration) -> Duration {
    wait_limit.max(Duration::from_secs(1))
}

/// Whether the calling thread may send `op` (the sender thread sends larger writes and
/// everything staged from GPU memory).
fn inline(op: &Op<Src>) -> bool {
    match op {
        Op::Write { src, len, .. } => *len <= INLINE_LIMIT && matches!(src.mem, Mem::Host(_)),
        _ => true,
    }
}

/// What the sender thread is doing, so that queueing an operation wakes it only when it must.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tx {
    /// Sending, or about to look at the queue.
    Busy,
    /// Idle but lingering: it looks at the queue every [`TX_TICK`] on its own.
    Ticking,
    /// Asleep until woken.
    Asleep,
}

struct State {
    /// Sequence numbers, the queue and its bound, acknowledgements.
    core: SenderCore<Src>,
    failed: Option<Error>,
    closing: bool,
    tx: Tx,
    /// When the small write now held at the queue's front was queued (it waits up to
    /// [`COALESCE_GRACE`] for the operation that usually follows it).
    held_since: Option<Instant>,
    /// The acknowledgement reader has stopped: no more acknowledgements can arrive.
    acks_ended: bool,
    /// The failure is the peer closing (its frames ended): what it acknowledged still counts.
    failed_by_close: bool,
    /// The receiver thread has finished (after its closing record when closing).
    rx_done: bool,
}

struct Shared {
    st: Mutex<State>,
    /// Signals acknowledgements, free queue slots and failure (to `flush` and full-queue waits).
    cond: Condvar,
    /// Wakes the sender thread: work queued, failure, stop.
    tx_cond: Condvar,
    /// The outgoing socket, locked by whoever sends.
    out: Mutex<TcpStream>,
    /// A clone of the outgoing socket, for shutdown.
    out_ctl: TcpStream,
    /// A clone of the incoming socket once it arrived, for shutdown.
    in_ctl: Mutex<Option<TcpStream>>,
    /// The receiving half, once the peer's socket arrived.
    rx: Mutex<Option<RxState>>,
    /// When a waiting thread last polled the socket itself, in ns since `born`.
    waiter_polled: AtomicU64,
    born: Instant,
    stop: AtomicBool,
    /// Sequence number of the last acknowledgement probe queued by `progress(true)`.
    ack_asked: AtomicU64,
    /// Pinned staging per GPU for the sender.
    stagers: Mutex<HashMap<u32, Stager>>,
    peer_desc: String,
    wait_limit: Duration,
}

impl Shared {
    /// Records the first failure and wakes everyone.
    fn fail(&self, e: Error) {
        self.fail_with(e, true);
    }

    /// Records the first failure and wakes everyone; with `cut_acks`, also shuts the outgoing
    /// socket, ending the acknowledgement stream (not when the peer merely closed its side: its
    /// last acknowledgements may still be on their way here).
    fn fail_with(&self, e: Error, cut_acks: bool) {
        let mut st = lock(&self.st);
        if st.failed.is_none() && !st.closing {
            debug!(target: LOG, "connection with {} failed: {e}", self.peer_desc);
            st.failed = Some(e);
            st.failed_by_close = !cut_acks;
        }
        drop(st);
        self.cond.notify_all();
        self.tx_cond.notify_all();
        if cut_acks {
            let _ = self.out_ctl.shutdown(Shutdown::Both);
        }
        if let Some(s) = lock(&self.in_ctl).as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn failure(&self) -> Option<Error> {
        lock(&self.st).failed.as_ref().map(Error::duplicate)
    }

    /// A read from the peer ended: the peer closed, or `what` failed (ignored while closing).
    fn fail_read(&self, what: &str, e: std::io::Error) {
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        let closed = e.kind() == std::io::ErrorKind::UnexpectedEof;
        let why = if closed {
            format!("peer {} closed the connection", self.peer_desc)
        } else {
            format!("{what} {} failed: {e}", self.peer_desc)
        };
        self.fail_with(Error::remote(why), !closed);
    }

    /// Queues `op`, waiting while the queue bound is reached (up to the wait limit in all);
    /// small operations are sent by the calling thread when the sender thread is not sending.
    fn enqueue(&self, op: Op<Src>) -> Result<()> {
        self.enqueue_within(op, self.wait_limit)
    }

    /// [`enqueue`](Self::enqueue) with its own bound on a full queue (a flush's timeout).
    fn enqueue_within(&self, op: Op<Src>, limit: Duration) -> Result<()> {
        let inline = inline(&op);
        let deferred = inline && matches!(op, Op::Write { .. });
        let mut st = lock(&self.st);
        let mut waited_from: Option<Instant> = None;
        let mut op = Some(op);
        loop {
            if let Some(e) = &st.failed {
                return Err(e.duplicate());
            }
            let Some(o) = op.take() else { break };
            match st.core.issue(o) {
                Ok(_) => break,
                Err((o, QueueFull { outstanding })) => {
                    op = Some(o);
                    let since = *waited_from.get_or_insert_with(Instant::now);
                    if since.elapsed() >= limit {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "write queue full: {outstanding} operations outstanding at {} and none confirmed for {:?}",
                                self.peer_desc, limit
                            ),
                        ));
                    }
                    st = self
                        .cond
                        .wait_timeout(st, Duration::from_millis(100))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            }
        }
        // A small write waits for what follows it (usually a token update) so that both leave in
        // one sendmsg, from this thread, with no hand-off. If nothing follows, the sender thread
        // sends it after a short grace: a lingering one finds it on its next tick; only a
        // sleeping one is woken.
        if deferred {
            if st.held_since.is_none() {
                st.held_since = Some(Instant::now());
            }
            if st.tx == Tx::Asleep {
                st.tx = Tx::Busy;
                drop(st);
                self.tx_cond.notify_one();
            }
            return Ok(());
        }
        drop(st);
        if inline && let Ok(mut out) = self.out.try_lock() {
            self.pump(&mut out, true);
        }
        // Wake the sender thread if anything is left (it re-checks under the lock).
        let mut st = lock(&self.st);
        if !st.core.is_idle() && st.tx != Tx::Busy {
            st.tx = Tx::Busy;
            drop(st);
            self.tx_cond.notify_one();
        }
        Ok(())
    }

    /// Sends queued operations in order, a batch per `sendmsg`. With `inline_only` (the calling
    /// thread), stops at the first operation only the sender thread sends.
    fn pump(&self, out: &mut TcpStream, inline_only: bool) {
        loop {
            let batch = {
                let mut st = lock(&self.st);
                if st.failed.is_some() {
                    return;
                }
                let b = st.core.next_batch(|op| !inline_only || inline(op));
                if st.core.is_idle() {
                    st.held_since = None;
                }
                b
            };
            if batch.is_empty() {
                return;
            }
            if let Err(e) = self.send_batch(out, &batch) {
                // The peer closed its end (its closing record, if any, is still on its way to the
                // acknowledgement reader): a close, not a failure that voids what it acknowledged.
                let closed =
                    matches!(e.io_kind(), Some(std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset));
                self.fail_with(e, !closed);
                return;
            }
        }
    }

    /// Sends one batch: host payloads straight from their regions in one `sendmsg`; GPU
    /// payloads staged through pinned memory, the copy of one chunk overlapping the send of the
    /// previous one.
    fn send_batch(&self, out: &mut TcpStream, batch: &[(wire::FrameHeader, Op<Src>)]) -> Result<()> {
        let io_err = |e: std::io::Error| {
            let why = match e.kind() {
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                    format!("peer {} closed the connection (sending failed)", self.peer_desc)
                }
                // The socket's send timeout (see `connect`): the peer took no byte for that long.
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    return Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "sending to {} stalled: the peer read nothing for {:?} (is it stopped or stuck?)",
                            self.peer_desc,
                            stall_limit(self.wait_limit)
                        ),
                    )
                    .with_source(e);
                }
                _ => format!("sending to {} failed", self.peer_desc),
            };
            Error::remote(why).with_source(e)
        };
        let headers: Vec<[u8; wire::HEADER]> = batch.iter().map(|(h, _)| h.encode()).collect();
        let mut parts: Vec<IoPart<'_>> = Vec::with_capacity(2 * batch.len());
        for ((_, op), h) in batch.iter().zip(&headers) {
            parts.push(h[..].into());
            if let Op::Write { src, src_off, len, .. } = op {
                match &src.mem {
                    Mem::Host(r) => parts.push(r.part(*src_off, *len)?),
                    Mem::Gpu(g) => {
                        send_vectored(out, &parts).map_err(io_err)?;
                        parts.clear();
                        let mut stagers = lock(&self.stagers);
                        let st = stager_for(&mut stagers, g)?;
                        st.send(out, g, *src_off, *len).map_err(|e| match e {
                            StageError::Io(e) => io_err(e),
                            StageError::Mscclpp(e) => e,
                        })?;
                    }
                }
            }
        }
        send_vectored(out, &parts).map_err(io_err)
    }
}

fn sender_loop(sh: Arc<Shared>) {
    let mut last_work = Instant::now();
    loop {
        {
            let mut st = lock(&sh.st);
            loop {
                let stop = sh.stop.load(Ordering::Acquire);
                if st.failed.is_some() || (stop && st.core.is_idle()) {
                    return;
                }
                if !st.core.is_idle() {
                    // A small write at the front waits out its grace for the operation that
                    // usually follows it (whose caller then sends both).
                    let held = st.held_since.map(|t| t.elapsed()).filter(|_| st.core.front().is_some_and(inline));
                    match held {
                        Some(age) if age < COALESCE_GRACE && !stop => {
                            st.tx = Tx::Ticking;
                            st = sh
                                .tx_cond
                                .wait_timeout(st, COALESCE_GRACE - age)
                                .map(|(g, _)| g)
                                .unwrap_or_else(|p| p.into_inner().0);
                        }
                        _ => break,
                    }
                } else if last_work.elapsed() < TX_LINGER {
                    st.tx = Tx::Ticking;
                    st = sh.tx_cond.wait_timeout(st, TX_TICK).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
                } else {
                    st.tx = Tx::Asleep;
                    st = sh.tx_cond.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                if st.held_since.is_some() {
                    last_work = Instant::now();
                }
            }
            st.tx = Tx::Busy;
        }
        last_work = Instant::now();
        let mut out = lock(&sh.out);
        sh.pump(&mut out, false);
    }
}

/// Reads acknowledgements and refusals from the outgoing socket and hands them to the core,
/// until the socket ends; then says so (a flush waiting on a closed connection may decide).
fn ack_loop(sh: Arc<Shared>, s: TcpStream) {
    read_acks(&sh, s);
    lock(&sh.st).acks_ended = true;
    sh.cond.notify_all();
}

fn read_acks(sh: &Shared, mut s: TcpStream) {
    let mut buf = [0u8; 4096];
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => {
                sh.fail_read("reading acknowledgements from", std::io::ErrorKind::UnexpectedEof.into());
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                sh.fail_read("reading acknowledgements from", e);
                return;
            }
        };
        let r = lock(&sh.st).core.handle_bytes(&buf[..n]);
        if let Err(why) = r {
            sh.fail(Error::remote(format!("peer {} {why}", sh.peer_desc)));
            return;
        }
        sh.cond.notify_all();
    }
}

fn send_record(s: &TcpStream, rec: &Record) -> std::io::Result<()> {
    let mut w = s;
    w.write_all(&rec.to_wire())
}

/// While a waiting thread polled the socket itself (`poll_incoming`) this recently, the receiver
/// thread keeps away from it (two readers of one socket only contend), and looks again after
/// the rest of this time (each wake-up takes a CPU from a spinning waiter on a small machine).
const RX_DEFER: Duration = Duration::from_millis(1);
/// How often a blocked receiver thread looks at the stop flag.
const RX_STOP_CHECK: Duration = Duration::from_millis(100);

/// The receiver's socket: reads never block (`MSG_DONTWAIT`); "nothing yet" is `WouldBlock`.
/// The receiver thread waits for data with `poll`, outside the receiver's lock, so that a
/// waiting thread (`poll_incoming`) may apply what arrived in the meantime.
struct RxSocket {
    sock: TcpStream,
}

impl Read for RxSocket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use nix::errno::Errno;
        use nix::sys::socket::{MsgFlags, recv};
        use std::os::fd::AsRawFd;
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            match recv(self.sock.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => return Ok(n),
                Err(Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// What the receiver core learns of a region of this context.
fn region_info(ctx: &ContextInner, id: u64) -> Option<RegionInfo<Arc<LocalRegion>>> {
    let r = ctx.lookup_region(id)?;
    Some(RegionInfo {
        addr: r.mem.addr(),
        len: r.mem.len(),
        ethernet: r.transports.has(Transport::Ethernet),
        handle: r,
    })
}

/// The receiving half's state, behind a lock: the receiver thread applies frames with it, and so
/// may a thread waiting for a signal (`poll_incoming`), whichever gets there first.
struct RxState {
    rd: BufReader<RxSocket>,
    core: ReceiverCore,
    /// The region of the write being received.
    cur: Option<Arc<LocalRegion>>,
    stagers: HashMap<u32, Stager>,
    ctx: Arc<ContextInner>,
    /// The connection is over on this side (failed or closed): nothing more is read.
    done: bool,
    /// No frame failed to apply or was refused: what `core` counts as applied may be
    /// acknowledged on closing.
    applied_all: bool,
}

/// Who is applying frames.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Drainer {
    /// The receiver thread: may read the rest of a payload it has begun straight into place.
    Thread,
    /// A waiting thread: only what is already here.
    Waiter,
}

impl RxState {
    /// Applies every frame the socket holds now, in order; returns whether any byte was taken.
    /// A payload begun is finished (reads of its remaining bytes may block, bounded by the
    /// socket's read timeout). Failures end the connection (`done`).
    fn drain(&mut self, sh: &Shared, who: Drainer) -> bool {
        let mut progressed = false;
        let ctx = self.ctx.clone();
        let lookup = |id: u64| region_info(&ctx, id);
        let report = |e: StageError| {
            let e = match e {
                StageError::Io(e) => e.to_string(),
                StageError::Mscclpp(e) => e.to_string(),
            };
            if !sh.stop.load(Ordering::Acquire) {
                sh.fail(Error::remote(format!("receiving a write from {} failed: {e}", sh.peer_desc)));
            }
        };
        while !self.done {
            let (used, ev) = match self.core.handle_bytes(self.rd.buffer(), &lookup) {
                Ok(x) => x,
                Err(why) => {
                    warn!(target: LOG, "refusing a frame from {}: {why}", sh.peer_desc);
                    let _ = send_record(&self.rd.get_ref().sock, &Record::refusal(&why));
                    sh.fail(Error::remote(format!("refused a frame from peer {}: {why}", sh.peer_desc)));
                    self.applied_all = false;
                    self.done = true;
                    break;
                }
            };
            let applied: std::result::Result<(), StageError> = match ev {
                None if used > 0 => {
                    self.rd.consume(used);
                    Ok(())
                }
                None => match (self.core.payload_pending(), self.cur.as_ref().map(|r| &r.mem), who) {
                    // Past what was buffered: the rest of a host write goes straight to its place.
                    (Some((offset, left)), Some(Mem::Host(reg)), Drainer::Thread) => reg
                        .recv_exact(offset, left, &self.rd.get_ref().sock)
                        .map_err(StageError::from)
                        .map(|()| self.core.payload_received(left, false)),
                    _ => match self.rd.fill_buf() {
                        Ok([]) => {
                            sh.fail_read("reading frames from", std::io::ErrorKind::UnexpectedEof.into());
                            self.done = true;
                            break;
                        }
                        Ok(_) => Ok(()),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
                        // Nothing more for now.
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            sh.fail_read("reading frames from", e);
                            self.done = true;
                            break;
                        }
                    },
                },
                Some(RxEvent::Data { offset, bytes }) => {
                    let r = match self.cur.as_ref().map(|r| &r.mem) {
                        Some(Mem::Host(reg)) => reg.write(offset, bytes).map_err(StageError::from),
                        _ => Err(StageError::Mscclpp(Error::internal("write payload without a host region"))),
                    };
                    self.rd.consume(used);
                    r
                }
                Some(RxEvent::Write { region, offset, len }) => {
                    self.rd.consume(used);
                    let r = match &region.mem {
                        Mem::Host(_) => Ok(()),
                        // GPU memory: staged through pinned buffers, the whole payload at once.
                        Mem::Gpu(g) => stager_for(&mut self.stagers, g)
                            .map_err(StageError::from)
                            .and_then(|st| st.recv(&mut self.rd, g, offset, len))
                            .map(|()| self.core.payload_received(len, !self.rd.buffer().is_empty())),
                    };
                    self.cur = Some(region);
                    r
                }
                Some(RxEvent::Token { region, offset, value, add }) => {
                    self.rd.consume(used);
                    let r = match &region.mem {
                        Mem::Host(reg) => reg
                            .atomic_u64(offset)
                            .map(|w| {
                                if add {
                                    w.fetch_add(value, Ordering::AcqRel);
                                } else {
                                    w.store(value, Ordering::Release);
                                }
                            })
                            .map_err(StageError::from),
                        Mem::Gpu(g) => stager_for(&mut self.stagers, g)
                            .and_then(|st| st.token(g, offset, value, add))
                            .map_err(StageError::from),
                    };
                    if r.is_ok() {
                        self.ctx.notify_tokens();
                    }
                    r
                }
                Some(RxEvent::Ack(seq)) => {
                    self.rd.consume(used);
                    if let Err(e) = send_record(&self.rd.get_ref().sock, &Record::Ack(seq)) {
                        if !sh.stop.load(Ordering::Acquire) {
                            sh.fail(Error::remote(format!("acknowledging to {} failed: {e}", sh.peer_desc)));
                        }
                        // Part of the record may have gone out (a send timeout): no closing
                        // record may follow it.
                        self.applied_all = false;
                        self.done = true;
                        break;
                    }
                    Ok(())
                }
            };
            progressed = true;
            if let Err(e) = applied {
                // A read that ended mid-payload leaves that write unapplied (and uncounted); a
                // failed token store was counted as applied: nothing more may be acknowledged then.
                if !matches!(e, StageError::Io(_)) {
                    self.applied_all = false;
                }
                report(e);
                self.done = true;
            }
        }
        progressed
    }
}

/// Takes the peer's socket, then applies its frames as the receiver core directs, waiting for
/// data outside the receiver's lock; then says it has finished.
fn receiver_loop(sh: Arc<Shared>, ctx: Arc<ContextInner>, acceptor: Arc<Acceptor>, deadline: Instant) {
    receive(&sh, ctx, acceptor, deadline);
    lock(&sh.st).rx_done = true;
    sh.cond.notify_all();
}

/// How long a closing receiver's last acknowledgement may take to send.
const LAST_ACK_WAIT: Duration = Duration::from_secs(1);

fn receive(sh: &Shared, ctx: Arc<ContextInner>, acceptor: Arc<Acceptor>, deadline: Instant) {
    let s = match acceptor.take(deadline, &sh.stop) {
        Ok(s) => s,
        Err(e) => {
            if !sh.stop.load(Ordering::Acquire) {
                sh.fail(e.during(format!("waiting for {} to connect back", sh.peer_desc)));
            }
            return;
        }
    };
    drop(acceptor);
    if let Ok(c) = s.try_clone() {
        *lock(&sh.in_ctl) = Some(c);
    }
    if sh.stop.load(Ordering::Acquire) || lock(&sh.st).failed.is_some() {
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    // Reads of a payload's remaining bytes block; a peer that stops in the middle of a frame
    // fails the connection after this long instead of hanging it. So do acknowledgements sent
    // back to a peer that stopped reading them (from this thread or a waiter's).
    let _ = s.set_read_timeout(Some(stall_limit(sh.wait_limit)));
    let _ = s.set_write_timeout(Some(stall_limit(sh.wait_limit)));
    let Ok(watch) = s.try_clone() else {
        sh.fail(Error::new(ErrorKind::Internal, "cloning the incoming socket failed"));
        return;
    };
    *lock(&sh.rx) = Some(RxState {
        rd: BufReader::with_capacity(256 * 1024, RxSocket { sock: s }),
        core: ReceiverCore::default(),
        cur: None,
        stagers: HashMap::new(),
        ctx,
        done: false,
        applied_all: true,
    });
    loop {
        if sh.stop.load(Ordering::Acquire) {
            break;
        }
        let since = (sh.born.elapsed().as_nanos() as u64).saturating_sub(sh.waiter_polled.load(Ordering::Relaxed));
        if since < RX_DEFER.as_nanos() as u64 {
            // A waiter is reading the socket itself.
            std::thread::sleep(RX_DEFER - Duration::from_nanos(since));
            continue;
        }
        // Block in `poll` without the lock, so a waiter may take the data first.
        if !readable(&watch, RX_STOP_CHECK) {
            continue;
        }
        // Never queue behind a waiter that holds the lock (its unlock would then have to wake
        // this thread, on the waiter's critical path).
        let Ok(mut g) = sh.rx.try_lock() else {
            std::thread::yield_now();
            continue;
        };
        let Some(rx) = g.as_mut() else { return };
        rx.drain(sh, Drainer::Thread);
        if rx.done {
            break;
        }
    }
    // Closing (this side dropped the connection): apply what had already arrived (the socket is
    // shut for reading, so the reads end), then acknowledge every frame applied, so that the
    // peer's flush of those succeeds; the socket closes after this.
    if !sh.stop.load(Ordering::Acquire) {
        return;
    }
    let mut g = lock(&sh.rx);
    let Some(rx) = g.as_mut() else { return };
    while !rx.done && rx.drain(sh, Drainer::Thread) {}
    if rx.applied_all {
        let s = &rx.rd.get_ref().sock;
        let _ = s.set_write_timeout(Some(LAST_ACK_WAIT));
        if let Err(e) = send_record(s, &Record::Closing(rx.core.applied_through())) {
            debug!(target: LOG, "last acknowledgement to {}: {e}", sh.peer_desc);
        }
    }
}

pub(crate) struct EthernetConnection {
    sh: Arc<Shared>,
    remote_context: u64,
    threads: Vec<JoinHandle<()>>,
}

impl EthernetConnection {
    fn region_of(&self, dst: &RegisteredMemory) -> Result<u64> {
        let d = dst.desc();
        if d.context_id != self.remote_context {
            return Err(Error::invalid_usage(format!(
                "destination memory belongs to context {:#x}, but this connection's peer is context {:#x}",
                d.context_id, self.remote_context
            )));
        }
        Ok(d.region_id)
    }
}

impl ConnectionImpl for EthernetConnection {
    fn write(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        let region = self.region_of(dst)?;
        let src = src.local().cloned().ok_or_else(|| Error::invalid_usage("source memory is not local"))?;
        self.sh.enqueue(Op::Write { region, offset: dst_off, src, src_off, len })
    }

    fn update_and_sync(&self, dst: &RegisteredMemory, dst_off: u64, _old: u64, new: u64) -> Result<()> {
        let region = self.region_of(dst)?;
        self.sh.enqueue(Op::Set { region, offset: dst_off, value: new })
    }

    fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
        let region = self.region_of(dst)?;
        self.sh.enqueue(Op::Add { region, offset: dst_off, value: value as u64 })
    }

    /// Succeeds once every operation issued before it is acknowledged, even when the peer has
    /// dropped the connection since (its closing record acknowledges what it applied); fails with
    /// the closing error once no more acknowledgements can come (or [`CLOSE_GRACE`] after it).
    /// Any other failure (a peer that died, a refused frame, an I/O error) fails every flush.
    fn flush(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let target = {
            let st = lock(&self.sh.st);
            match (&st.failed, st.core.flush_target()) {
                (Some(e), _) if !st.failed_by_close => return Err(e.duplicate()),
                (None, None) => return Ok(()),
                (_, t) => t.unwrap_or(st.core.issued()),
            }
        };
        // Ask the peer to acknowledge now (a failed connection sends nothing more; what the peer
        // said on closing decides).
        // (On a full queue it waits no longer than this flush may, and is not needed: the sender
        // already asked for acknowledgements; the wait below then gives the flush's own error.)
        if let Err(e) = self.sh.enqueue_within(Op::Nop, timeout.min(self.sh.wait_limit))
            && self.sh.failure().is_none()
            && e.kind() != ErrorKind::Timeout
        {
            return Err(e);
        }
        let mut failed_at: Option<Instant> = None;
        let mut st = lock(&self.sh.st);
        loop {
            // After a failure, only a peer that closed deliberately (a Closing record: its
            // acknowledgements are final) lets a flush succeed; a peer that died fails it.
            let acked = st.core.applied() >= target;
            if acked && (st.failed.is_none() || st.core.peer_closed()) {
                return Ok(());
            }
            let now = Instant::now();
            if let Some(e) = &st.failed {
                let since = *failed_at.get_or_insert(now);
                let final_ = st.acks_ended || !st.failed_by_close || st.core.peer_closed();
                if final_ || now.duration_since(since) >= CLOSE_GRACE || deadline.is_some_and(|d| now >= d) {
                    return Err(e.duplicate().with_outstanding(target - st.core.applied().min(target)));
                }
            }
            let left = match deadline {
                Some(d) if now >= d => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "{} of {} operations not yet applied at peer {} after {timeout:?}",
                            target - st.core.applied(),
                            target,
                            self.sh.peer_desc
                        ),
                    )
                    .with_outstanding(target - st.core.applied()));
                }
                Some(d) => d - now,
                None => Duration::from_secs(1),
            };
            st = self.sh.cond.wait_timeout(st, left).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    fn failure(&self) -> Option<Error> {
        self.sh.failure()
    }

    fn max_write_queue_size(&self) -> usize {
        lock(&self.sh.st).core.max_queue() as usize
    }

    fn outstanding(&self) -> u64 {
        lock(&self.sh.st).core.outstanding()
    }

    fn poll_incoming(&self) -> bool {
        self.sh.waiter_polled.store(self.sh.born.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // Only if nobody else is at it: the receiver thread holds the lock while it applies.
        match self.sh.rx.try_lock() {
            Ok(mut g) => g.as_mut().is_some_and(|rx| !rx.done && rx.drain(&self.sh, Drainer::Waiter)),
            Err(_) => false,
        }
    }

    /// Acknowledgements come every 256 frames or when asked: a request queues one probe (a frame
    /// asking for an acknowledgement) unless one is already queued behind everything issued.
    fn progress(&self, request: bool) -> Result<super::Progress> {
        let (issued, applied) = {
            let st = lock(&self.sh.st);
            if let Some(e) = &st.failed {
                return Err(e.duplicate());
            }
            (st.core.issued(), st.core.applied())
        };
        if request && applied < issued && self.sh.ack_asked.load(Ordering::Acquire) < issued {
            self.sh.enqueue(Op::Nop)?;
            // The probe's number is at least `issued + 1` and its acknowledgement covers all
            // before it: a later request with nothing new issued (the probe itself) skips.
            self.sh.ack_asked.fetch_max(issued + 1, Ordering::AcqRel);
        }
        Ok(super::Progress { issued, completed: applied })
    }
}

impl Drop for EthernetConnection {
    fn drop(&mut self) {
        if self.sh.failure().is_none()
            && self.outstanding() > 0
            && let Err(e) = self.flush(CLOSE_GRACE)
        {
            warn!(target: LOG, "closing the connection with {}: {e}", self.sh.peer_desc);
        }
        {
            // `stop` is set under the lock the sender thread reads it under before it sleeps, so
            // the notify below cannot fall between its check and its wait (a lost wake-up would
            // leave the join below waiting for ever).
            let mut st = lock(&self.sh.st);
            st.closing = true;
            self.sh.stop.store(true, Ordering::Release);
        }
        self.sh.cond.notify_all();
        self.sh.tx_cond.notify_all();
        // The receiver first: its socket shut for reading wakes it, it acknowledges every frame
        // it applied (see "Closing" above), and only then does the socket close.
        if let Some(s) = lock(&self.sh.in_ctl).as_ref() {
            let _ = s.shutdown(Shutdown::Read);
        }
        {
            let end = Instant::now() + CLOSE_GRACE;
            let mut st = lock(&self.sh.st);
            while !st.rx_done && lock(&self.sh.in_ctl).is_some() {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                st = self.sh.cond.wait_timeout(st, end - now).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
            }
        }
        let _ = self.sh.out_ctl.shutdown(Shutdown::Both);
        if let Some(s) = lock(&self.sh.in_ctl).as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // A receiver that had not yet taken its socket may have stored it after the shutdown above.
        if let Some(s) = lock(&self.sh.in_ctl).as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Builds an Ethernet connection from a local endpoint and the peer's.
pub(crate) fn connect(ctx: &Context, local: &Endpoint, remote: &Endpoint, peer: Option<usize>) -> Result<Connection> {
    let (Some(l), EndpointKind::Ethernet { addr, secret }) = (local.local(), &remote.desc().kind) else {
        return Err(Error::invalid_usage("not a pair of Ethernet endpoints"));
    };
    let acceptor =
        l.take_acceptor().ok_or_else(|| Error::invalid_usage("this endpoint was already used for a connection"))?;
    let cfg = &l.config;
    let deadline = Instant::now() + cfg.ethernet.connect_timeout;
    let peer_desc = match peer {
        Some(p) => format!("rank {p} ({addr})"),
        None => addr.to_string(),
    };
    let (out, remote_context) =
        dial(*addr, secret, ctx.inner().id, deadline).map_err(|e| e.during(format!("connecting to {peer_desc}")))?;
    // A send blocks while the peer's socket is full; a peer that reads nothing for this long
    // (stopped, stuck) fails the connection instead of hanging the sending thread, which may be
    // the caller's own (small writes and signals are sent inline).
    out.set_write_timeout(Some(stall_limit(cfg.ethernet.connect_timeout)))
        .map_err(|e| Error::io("setting the send timeout of a socket", e))?;
    let out_ctl = out.try_clone().map_err(|e| Error::io("cloning a socket", e))?;
    let ack_sock = out.try_clone().map_err(|e| Error::io("cloning a socket", e))?;
    let max_queue = local.max_write_queue_size().max(1) as u64;
    let sh = Arc::new(Shared {
        st: Mutex::new(State {
            core: SenderCore::new(max_queue),
            failed: None,
            closing: false,
            tx: Tx::Busy,
            held_since: None,
            acks_ended: false,
            failed_by_close: false,
            rx_done: false,
        }),
        cond: Condvar::new(),
        tx_cond: Condvar::new(),
        out: Mutex::new(out),
        out_ctl,
        in_ctl: Mutex::new(None),
        rx: Mutex::new(None),
        waiter_polled: AtomicU64::new(0),
        born: Instant::now(),
        stop: AtomicBool::new(false),
        ack_asked: AtomicU64::new(0),
        stagers: Mutex::new(HashMap::new()),
        peer_desc: peer_desc.clone(),
        wait_limit: cfg.ethernet.connect_timeout,
    });
    let mut threads = Vec::new();
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(f)
            .map_err(|e| Error::io(format!("starting thread {name}"), e))
    };
    let mut conn = EthernetConnection { sh: sh.clone(), remote_context, threads: Vec::new() };
    let (s1, s2, s3) = (sh.clone(), sh.clone(), sh.clone());
    let ctx_inner = ctx.inner().clone();
    // Threads serving a GPU run on its NUMA node (where its staging copies are cheapest); for
    // host memory they are left to the scheduler.
    let node = match local.device() {
        crate::Device::Gpu(d) => crate::platform::cuda::numa_node(d),
        crate::Device::Cpu => None,
    };
    let pin = move |name: &str| {
        if let Some(n) = node {
            match crate::platform::numa::bind_thread_to_node(n) {
                Ok(()) => debug!(target: LOG, "{name} bound to NUMA node {n}"),
                Err(e) => warn!(target: LOG, "{name}: could not bind to NUMA node {n}: {e}"),
            }
        }
    };
    threads.push(spawn(
        "mscclpp-eth-tx",
        Box::new(move || {
            pin("mscclpp-eth-tx");
            sender_loop(s1)
        }),
    )?);
    threads.push(spawn("mscclpp-eth-ack", Box::new(move || ack_loop(s2, ack_sock)))?);
    threads.push(spawn(
        "mscclpp-eth-rx",
        Box::new(move || {
            pin("mscclpp-eth-rx");
            receiver_loop(s3, ctx_inner, acceptor, deadline)
        }),
    )?);
    conn.threads = threads;
    debug!(target: LOG, "Ethernet connection to {peer_desc} established");
    Ok(Connection::from_inner(ConnInner {
        imp: Box::new(conn),
        transport: Transport::Ethernet,
        remote_transport: Transport::Ethernet,
        device: local.device(),
        context: ctx.clone(),
        peer,
        peer_desc,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Buffer, TransportFlags};

    const OP_WRITE: u8 = 1;
    const OP_SET: u8 = 2;
    const OP_ADD: u8 = 3;
    const OP_NOP: u8 = 4;

    /// The accept thread ends on its stop flag alone, without the drop's self-connect (which can
    /// fail): it looks at the flag while no connection comes.
    #[test]
    fn accept_thread_stops_without_a_wake_up_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let acc = Acceptor::start(listener, [7; 16], 1).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        acc.shared.stop.store(true, Ordering::Release);
        let t = lock(&acc.thread).take().unwrap();
        let t0 = Instant::now();
        while !t.is_finished() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(t.is_finished(), "the accept thread ignored its stop flag");
        t.join().unwrap();
        // Dropping the acceptor now finds no thread to join (its self-connect goes unanswered).
        drop(acc);
    }

    /// A header's bytes, any field as given (malformed ones included).
    fn header(op: u8, seq: u64, region: u64, offset: u64, len: u64, value: u64) -> [u8; wire::HEADER] {
        let mut b = [0u8; wire::HEADER];
        b[0] = op;
        for (i, v) in [seq, region, offset, len, value].into_iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// The receiver core against a real context's region table: what it accepts and what it
    /// refuses, and why.
    #[test]
    fn validation_refuses_what_it_must() {
        let ctx = Context::new();
        let eth = Buffer::new(&ctx, 64, Transport::Ethernet.into()).unwrap();
        let none = Buffer::new(&ctx, 64, TransportFlags::NONE).unwrap();
        let id = eth.memory().desc().region_id;
        let nid = none.memory().desc().region_id;
        let lookup = |i: u64| region_info(ctx.inner(), i);
        // The event of one header (and the acknowledgement after it, if one is due).
        let first = |h: [u8; wire::HEADER]| {
            let mut core = ReceiverCore::default();
            let (n, ev) = core.handle_bytes(&h, &lookup)?;
            assert_eq!(n, wire::HEADER);
            let mut out = match ev {
                Some(RxEvent::Write { offset, len, .. }) => format!("write {offset} {len}"),
                Some(RxEvent::Token { offset, value, add, .. }) => format!("token {offset} {value} {add}"),
                ev => format!("{ev:?}"),
            };
            if let (0, Some(RxEvent::Ack(s))) = core.handle_bytes::<Arc<LocalRegion>>(&[], &lookup)? {
                out += &format!(", ack {s}");
            }
            Ok::<_, String>(out)
        };
        assert_eq!(first(header(OP_WRITE, 1, id, 0, 64, 0)).unwrap(), "write 0 64");
        assert_eq!(first(header(OP_SET, 1, id, 8, 8, 9)).unwrap(), "token 8 9 false");
        assert_eq!(first(header(OP_ADD, 1, id, 56, 8, 9)).unwrap(), "token 56 9 true");
        let mut probe = header(OP_NOP, 1, 0, 0, 0, 0);
        probe[1] = 1;
        assert_eq!(first(probe).unwrap(), "None, ack 1");
        let bad = [
            (header(OP_WRITE, 1, id, 1, 64, 0), "outside"),
            (header(OP_WRITE, 1, id, u64::MAX, 2, 0), "outside"),
            (header(OP_WRITE, 2, id, 0, 1, 0), "sequence"),
            (header(OP_WRITE, 1, id + 100, 0, 1, 0), "not registered"),
            (header(OP_WRITE, 1, nid, 0, 1, 0), "not registered for Ethernet"),
            (header(OP_WRITE, 1, id, 0, 1, 5), "non-zero value"),
            (header(OP_SET, 1, id, 4, 8, 0), "unaligned"),
            (header(OP_ADD, 1, id, 64, 8, 0), "outside"),
            (header(OP_SET, 1, id, 0, 4, 0), "length"),
            (header(9, 1, id, 0, 0, 0), "unknown operation"),
            (header(OP_NOP, 1, 1, 0, 0, 0), "non-zero"),
        ];
        for (h, why) in bad {
            let e = first(h).unwrap_err();
            assert!(e.contains(why), "{e} (expected {why})");
        }
        let mut flagged = header(OP_NOP, 1, 0, 0, 0, 0);
        flagged[1] = 0x80;
        assert!(first(flagged).unwrap_err().contains("flags"));
        let mut padded = header(OP_NOP, 1, 0, 0, 0, 0);
        padded[5] = 1;
        assert!(first(padded).is_err());
        drop(eth);
        assert!(first(header(OP_WRITE, 1, id, 0, 1, 0)).unwrap_err().contains("not registered"));
    }

    /// A peer that passes the handshake and then sends a frame naming memory that is not
    /// registered (or past a region's end) is refused: nothing is written, the sender is told
    /// why, and the connection fails on our side too.
    #[test]
    fn raw_peer_with_bad_frames_is_refused() {
        use crate::conn::endpoint::EndpointDesc;
        for bad in ["unregistered", "past the end", "wrong sequence"] {
            let ctx = Context::new();
            let target = Buffer::new(&ctx, 4096, Transport::Ethernet.into()).unwrap();
            let ep = ctx
                .create_endpoint(&crate::EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1"))
                .unwrap();
            let EndpointKind::Ethernet { addr: ep_addr, secret: ep_secret } = ep.desc().kind.clone() else { panic!() };
            // The fake peer's own "endpoint": a raw listener that answers the handshake.
            let fake = TcpListener::bind("127.0.0.1:0").unwrap();
            let fake_secret = [3u8; 16];
            let remote = Endpoint::from_desc_for_test(EndpointDesc {
                transport: Transport::Ethernet,
                device: crate::Device::Cpu,
                host_hash: 1,
                process_hash: 2,
                max_write_queue_size: 8,
                kind: EndpointKind::Ethernet { addr: fake.local_addr().unwrap(), secret: fake_secret },
            });
            let fake_ctx = 0xfeed_u64;
            let acc = std::thread::spawn(move || {
                let (s, _) = fake.accept().unwrap();
                accept_handshake(s, &fake_secret, fake_ctx).unwrap()
            });
            let conn = ctx.connect(&ep, &remote).unwrap();
            let _their_in = acc.join().unwrap();
            // The fake dials our endpoint with the right secret and sends a bad frame.
            let (mut s, _) = dial(ep_addr, &ep_secret, fake_ctx, Instant::now() + Duration::from_secs(5)).unwrap();
            let id = target.memory().desc().region_id;
            let h = match bad {
                "unregistered" => header(OP_WRITE, 1, id + 1000, 0, 16, 0),
                "past the end" => header(OP_WRITE, 1, id, 4090, 16, 0),
                _ => header(OP_WRITE, 7, id, 0, 16, 0),
            };
            let mut frame = h.to_vec();
            frame.extend_from_slice(&[0xAA; 16]);
            s.write_all(&frame).unwrap();
            // We are told why, then the socket closes.
            let mut rec = [0u8; 16];
            s.read_exact(&mut rec).unwrap();
            assert_eq!(rec[0], 2, "{bad}: not a refusal record");
            let n = u64::from_le_bytes(rec[8..].try_into().unwrap()) as usize;
            let mut msg = vec![0u8; n];
            s.read_exact(&mut msg).unwrap();
            let msg = String::from_utf8(msg).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            assert!(target.to_vec().iter().all(|b| *b == 0), "{bad}: memory changed");
            // Our side of the connection has failed with that reason.
            let t0 = Instant::now();
            while conn.status().is_ok() && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(5));
            }
            let e = conn.status().unwrap_err();
            assert!(e.to_string().contains("refused a frame"), "{bad}: {e}");
            assert!(e.to_string().contains(&msg), "{bad}: {e} / {msg}");
            assert!(conn.flush(Duration::from_secs(1)).is_err());
        }
    }
}
