//! The connection: its shared state, the [`EthernetConnection`] handle (flush, progress,
//! closing) and [`connect`], which dials the peer and starts the three threads.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::acceptor::dial;
use super::core::{Op, SenderCore};
use super::recv::{Drainer, RxState, receiver_loop};
use super::send::{OutLanes, Src, Tx, ack_loop, sender_loop, stall_limit};
use super::stager::Stager;
use super::wire::Lane;
use super::{CLOSE_GRACE, LOG};
use crate::conn::endpoint::{Endpoint, EndpointKind};
use crate::conn::{ConnInner, Connection, ConnectionImpl, Progress};
use crate::context::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::RegisteredMemory;
use crate::sync::{Deadline, lock};
use crate::transport::Transport;

/// The sending side's state, behind one lock (`Shared::st`).
pub(super) struct State {
    /// Sequence numbers, the queue and its bound, acknowledgements.
    pub(super) core: SenderCore<Src>,
    pub(super) failed: Option<Error>,
    closing: bool,
    pub(super) tx: Tx,
    /// When the small write now held at the queue's front was queued (it waits up to
    /// [`COALESCE_GRACE`] for the operation that usually follows it).
    pub(super) held_since: Option<Instant>,
    /// The acknowledgement reader has stopped: no more acknowledgements can arrive.
    pub(super) acks_ended: bool,
    /// The failure is the peer closing (its frames ended): what it acknowledged still counts.
    failed_by_close: bool,
    /// The receiver thread has finished (after its closing record when closing).
    pub(super) rx_done: bool,
    /// Frames sent that asked for an acknowledgement and are not yet acknowledged: their
    /// sequence numbers, and when their batch began to go out (for the benchmark counters of the
    /// acknowledgement loop, `stager::T_ACK_WAIT`; at most `send::ASKS_KEPT`).
    pub(super) asks: std::collections::VecDeque<(u64, Instant)>,
}

/// Everything the handle and the three threads (sender, acknowledgement reader, receiver) share.
pub(super) struct Shared {
    pub(super) st: Mutex<State>,
    /// Signals acknowledgements, free queue slots and failure (to `flush` and full-queue waits).
    pub(super) cond: Condvar,
    /// Wakes the sender thread: work queued, failure, stop.
    pub(super) tx_cond: Condvar,
    /// This side's sockets for its frames (both lanes), locked by whoever sends; `None` until
    /// both are known (on the high side the shared one is accepted: the receiver thread takes
    /// it).
    pub(super) out: Mutex<Option<OutLanes>>,
    /// Clones of the three sockets once known, for shutdown: the shared lane (small frames both
    /// ways), the peer's own lane (its large writes in, this side's records out) and this
    /// side's own lane (large writes out, the peer's records in).
    pub(super) shared_ctl: Mutex<Option<TcpStream>>,
    pub(super) in_ctl: Mutex<Option<TcpStream>>,
    pub(super) own_ctl: Mutex<Option<TcpStream>>,
    /// Whether this side is the low one (see "Sockets" in `mod.rs`): it dials the shared lane.
    pub(super) low: bool,
    /// A connection of an endpoint to itself: it dials the shared lane (as the low side) and
    /// also accepts it; its frames go out on the dialled end and come in on the accepted one.
    pub(super) self_pair: bool,
    /// With `self_pair`: a clone of the accepted end of the shared lane, for shutdown.
    pub(super) loop_ctl: Mutex<Option<TcpStream>>,
    /// The receiver thread has its sockets (so it sends a closing record when closing).
    pub(super) rx_started: AtomicBool,
    /// The receiving half, once the peer's socket arrived.
    pub(super) rx: Mutex<Option<RxState>>,
    /// When a waiting thread last polled the socket itself, in ns since `born` (0: it stopped).
    pub(super) waiter_polled: AtomicU64,
    /// The receiver thread, to wake from its nap when a waiter stops polling.
    pub(super) rx_thread: std::sync::OnceLock<std::thread::Thread>,
    /// The last drain (the receiver thread's or a waiter's, under the `rx` lock) left received
    /// payloads waiting, their landing deferred while the input is dry for less than
    /// `DRY_GRACE` (`Stager::issue_when_dry`): the receiver thread does not nap then, and comes
    /// back for them after that long.
    pub(super) rx_deferred: AtomicBool,
    pub(super) born: Instant,
    pub(super) stop: AtomicBool,
    /// Sequence number of the last acknowledgement probe queued by `progress(true)`.
    ack_asked: AtomicU64,
    /// Pinned staging per GPU for the sender.
    pub(super) stagers: Mutex<HashMap<u32, Stager>>,
    pub(super) peer_desc: String,
    pub(super) wait_limit: Duration,
}

impl Shared {
    /// Records the first failure and wakes everyone.
    pub(super) fn fail(&self, e: Error) {
        self.fail_with(e, true);
    }

    /// Records the first failure and wakes everyone, and shuts the shared lane and the peer's
    /// lane (frames both ways, this side's records); with `cut_acks`, also this side's own lane
    /// both ways, ending the peer's acknowledgement stream (not when the peer merely closed its
    /// side: its last acknowledgements may still be on their way here; then only this side's
    /// frames end).
    pub(super) fn fail_with(&self, e: Error, cut_acks: bool) {
        let mut st = lock(&self.st);
        if st.failed.is_none() && !st.closing {
            debug!(target: LOG, "connection with {} failed: {e}", self.peer_desc);
            st.failed = Some(e);
            st.failed_by_close = !cut_acks;
        }
        drop(st);
        self.cond.notify_all();
        self.tx_cond.notify_all();
        self.wake_receiver();
        for c in [&self.shared_ctl, &self.in_ctl, &self.loop_ctl] {
            if let Some(s) = lock(c).as_ref() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        if let Some(s) = lock(&self.own_ctl).as_ref() {
            let _ = s.shutdown(if cut_acks { Shutdown::Both } else { Shutdown::Write });
        }
    }

    /// A failure the peer stated in a record (a refusal): it replaces a failure recorded as the
    /// peer closing, because the refusing side closes its sockets right after sending the
    /// record and this side's receiver may see the close before the record is read (the error
    /// then said "closed", at random, instead of why).
    pub(super) fn fail_stated(&self, e: Error) {
        {
            let mut st = lock(&self.st);
            if st.failed_by_close && !st.closing {
                st.failed = None;
                st.failed_by_close = false;
            }
        }
        self.fail(e);
    }

    /// Wakes the receiver thread from a nap (see `recv.rs`).
    pub(super) fn wake_receiver(&self) {
        if let Some(t) = self.rx_thread.get() {
            t.unpark();
        }
    }

    /// Shuts every socket both ways (those known).
    fn shut_all(&self) {
        for c in [&self.shared_ctl, &self.in_ctl, &self.own_ctl, &self.loop_ctl] {
            if let Some(s) = lock(c).as_ref() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    pub(super) fn failure(&self) -> Option<Error> {
        lock(&self.st).failed.as_ref().map(Error::duplicate)
    }

    /// A read from the peer ended: the peer closed, or `what` failed (ignored while closing).
    pub(super) fn fail_read(&self, what: &str, e: std::io::Error) {
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
        let deadline = Deadline::after(timeout);
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
                if final_ || now.duration_since(since) >= CLOSE_GRACE || deadline.expired() {
                    return Err(e.duplicate().with_outstanding(target - st.core.applied().min(target)));
                }
            }
            if deadline.expired() {
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
            // (At most 1 s at a time: a flush without limit still looks at the close grace.)
            let left = deadline.remaining().min(Duration::from_secs(1));
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

    fn stop_polling(&self) {
        self.sh.waiter_polled.store(0, Ordering::Relaxed);
        self.sh.wake_receiver();
    }

    /// Acknowledgements come every `ACK_EVERY` (1024) frames or when asked: a request queues one probe (a frame
    /// asking for an acknowledgement) unless one is already queued behind everything issued.
    fn progress(&self, request: bool) -> Result<Progress> {
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
        Ok(Progress { issued, completed: applied })
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
            self.sh.stop.store(true, Ordering::SeqCst);
        }
        self.sh.cond.notify_all();
        self.sh.tx_cond.notify_all();
        self.sh.wake_receiver();
        // The receiver first: its sockets shut for reading wake it, it acknowledges every frame
        // it applied (see "Closing" above), and only then do the sockets close.
        for c in [&self.sh.shared_ctl, &self.sh.in_ctl, &self.sh.loop_ctl] {
            if let Some(s) = lock(c).as_ref() {
                let _ = s.shutdown(Shutdown::Read);
            }
        }
        {
            let end = Deadline::after(CLOSE_GRACE);
            let mut st = lock(&self.sh.st);
            while !st.rx_done && self.sh.rx_started.load(Ordering::SeqCst) && !end.expired() {
                st =
                    self.sh.cond.wait_timeout(st, end.remaining()).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
            }
        }
        self.sh.shut_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // A receiver that had not yet taken its sockets may have stored them after the shutdown
        // above.
        self.sh.shut_all();
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
    // A far limit (`Duration::MAX`) means no limit: the deadline never passes.
    let deadline = Deadline::after(cfg.ethernet.connect_timeout);
    let peer_desc = match peer {
        Some(p) => format!("rank {p} ({addr})"),
        None => addr.to_string(),
    };
    let EndpointKind::Ethernet { addr: my_addr, secret: my_secret } = &local.desc().kind else {
        return Err(Error::invalid_usage("not a pair of Ethernet endpoints"));
    };
    // Both sides order the two endpoints alike: the low side dials the shared lane too (see
    // "Sockets" in `mod.rs`).
    // A connection of an endpoint to itself dials the shared lane too, and reads it where it
    // is accepted.
    let self_pair = (*my_addr, *my_secret) == (*addr, *secret);
    let low = self_pair || (*my_addr, *my_secret) < (*addr, *secret);
    let dial_lane = |lane: Lane| {
        let (s, ctx_id) = dial(*addr, secret, ctx.inner().id, lane, deadline)
            .map_err(|e| e.during(format!("connecting to {peer_desc}")))?;
        // A send blocks while the peer's socket is full; a peer that reads nothing for this long
        // (stopped, stuck) fails the connection instead of hanging the sending thread, which may
        // be the caller's own (small writes and signals are sent inline).
        s.set_write_timeout(Some(stall_limit(cfg.ethernet.connect_timeout)))
            .map_err(|e| Error::io("setting the send timeout of a socket", e))?;
        let _ = s.set_nodelay(true);
        Ok::<_, Error>((s, ctx_id))
    };
    let (own, remote_context) = dial_lane(Lane::Own)?;
    let shared = if low { Some(dial_lane(Lane::Shared)?.0) } else { None };
    let clone = |s: &TcpStream| s.try_clone().map_err(|e| Error::io("cloning a socket", e));
    let (own_ctl, own_acks) = (clone(&own)?, clone(&own)?);
    let (out, shared_ctl) = match &shared {
        Some(sh) => (Some(OutLanes { shared: clone(sh)?, own: clone(&own)? }), Some(clone(sh)?)),
        None => (None, None),
    };
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
            asks: std::collections::VecDeque::new(),
        }),
        cond: Condvar::new(),
        tx_cond: Condvar::new(),
        out: Mutex::new(out),
        shared_ctl: Mutex::new(shared_ctl),
        in_ctl: Mutex::new(None),
        own_ctl: Mutex::new(Some(own_ctl)),
        low,
        self_pair,
        loop_ctl: Mutex::new(None),
        rx_started: AtomicBool::new(false),
        rx: Mutex::new(None),
        waiter_polled: AtomicU64::new(0),
        rx_deferred: AtomicBool::new(false),
        rx_thread: std::sync::OnceLock::new(),
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
    threads.push(spawn("mscclpp-eth-ack", Box::new(move || ack_loop(s2, own_acks)))?);
    threads.push(spawn(
        "mscclpp-eth-rx",
        Box::new(move || {
            pin("mscclpp-eth-rx");
            // A self-connection reads the accepted end of the shared lane, not the dialled one.
            receiver_loop(s3, ctx_inner, acceptor, deadline, if self_pair { None } else { shared }, own)
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
