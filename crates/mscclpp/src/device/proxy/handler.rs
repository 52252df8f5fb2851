//! The built-in [`ProxyHandler`]: MSCCL++'s triggers (`put`, `signal`, `flush`, `atomicAdd`)
//! executed on the connections of registered semaphores, with flushes tracked by sequence number
//! and per-connection back pressure. No thread and no FIFO of its own: the loop hands it
//! triggers, and its tests hand them over directly, on in-memory connections.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::runner::{HandlerResult, ProxyHandler, TriggerContext};
use super::service::ProxySemaphore;
use crate::conn::Connection;
use crate::device::trigger::{ProxyTrigger, Request, decode};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::RegisteredMemory;
use crate::platform::hostmem::Region;
use crate::sync::{Backoff, BackoffPolicy, Deadline};
use crate::transport::Transport;

/// How long closing waits for each connection's outstanding operations.
const STOP_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// How long back pressure waits for one connection to make room before failing.
const BACK_PRESSURE_LIMIT: Duration = Duration::from_secs(30);
/// How many rounds of `progress` draining gives pending flushes before kernels are released.
const DRAIN_ROUNDS: u32 = 1000;

/// One `flushDonePos` word per connection, in memory kernels can read (mapped pinned host memory
/// for a GPU service, plain host memory otherwise). Shared by the handler (which publishes) and
/// the service (which hands out addresses and reads them for the host).
#[derive(Debug)]
pub(crate) struct FlushWords {
    region: Region,
}

impl FlushWords {
    /// Words over `region` (zeroed by the caller; one 8-byte word per connection).
    pub(crate) fn new(region: Region) -> FlushWords {
        FlushWords { region }
    }

    pub(crate) fn word(&self, conn: usize) -> Option<&AtomicU64> {
        self.region.atomic_u64(conn as u64 * 8).ok()
    }

    pub(crate) fn addr(&self, conn: usize) -> u64 {
        self.region.addr() as u64 + conn as u64 * 8
    }

    /// Every flush pushed below FIFO position `pos + 1` on `conn` has completed.
    fn publish(&self, conn: usize, pos: u64) {
        if let Some(w) = self.word(conn) {
            // Release: pairs with the kernel's acquire load of flushDonePos in
            // `BasePortChannelDeviceHandle::flush` (device.cuh) and the Acquire load in
            // `ProxyService::flush_done_pos`: whoever sees the position sees the connection's
            // completion that was observed before it. fetch_max keeps the word monotonic.
            w.fetch_max(pos + 1, Ordering::AcqRel);
        }
    }

    /// Every word becomes `u64::MAX`: every flush waiter returns.
    pub(crate) fn release_all(&self, nconns: usize) {
        for i in 0..nconns {
            if let Some(w) = self.word(i) {
                // Release: pairs with the same acquire loads as `publish`.
                w.store(u64::MAX, Ordering::Release);
            }
        }
    }
}

pub(crate) struct SemEntry {
    pub(crate) sem: ProxySemaphore,
    pub(crate) conn: usize,
    /// Signals popped but not sent yet (sent together, as one token write, at the end of the
    /// batch or before a flush of the connection).
    owed: u64,
    /// When the first of the owed signals was owed, and the writes its connection had been
    /// given then (`ConnState::writes`), tracked with a backlog hold on
    /// ([`ProxyConfig::signal_backlog_hold`](super::ProxyConfig::signal_backlog_hold)).
    owed_at: Option<(Instant, u64)>,
}

/// One connection's flush state.
struct ConnState {
    conn: Connection,
    /// Recorded flushes: (FIFO position, the connection's issued sequence number then).
    pending: VecDeque<(u64, u64)>,
    /// Writes (and adds) issued on the connection by this handler.
    writes: u64,
    /// The queue bound a backlog is measured against (the smaller of the connection's and the
    /// proxy's), or 0 where signals are never held for a backlog: only an Ethernet receiver
    /// lands the writes before each token in a round of its own.
    hold_bound: u64,
}

/// Executes decoded triggers on connections (see the [module documentation](super)).
pub(crate) struct ConnectionHandler {
    memories: Vec<RegisteredMemory>,
    sems: Vec<SemEntry>,
    conns: Vec<ConnState>,
    words: Arc<FlushWords>,
    max_queue: Option<u64>,
    /// Whether any connection has recorded flushes to publish.
    flushes_pending: bool,
    /// Semaphores with signals owed (`SemEntry::owed > 0`), in the order they were first owed.
    owing: Vec<usize>,
    /// [`ProxyConfig::signal_coalesce`](super::ProxyConfig::signal_coalesce).
    coalesce: Duration,
    /// Triggers handled since the first of the signals owed now (with coalescing on).
    since_pay: u64,
    /// Triggers handled since the last `poll` (the batch before it).
    last_batch: u64,
    /// The loop's longest batch for this handler's FIFO (`runner::pop_batch`): a shorter one
    /// means the FIFO ran dry.
    full_batch: u64,
    /// When the oldest signal still owed was owed (tracked only with coalescing on).
    owed_since: Option<Instant>,
    /// [`ProxyConfig::signal_pay_interval`](super::ProxyConfig::signal_pay_interval).
    pay_interval: Duration,
    /// When signals were last paid (tracked only with coalescing and a pay interval on).
    last_paid: Option<Instant>,
    /// [`ProxyConfig::signal_backlog_hold`](super::ProxyConfig::signal_backlog_hold).
    backlog_hold: Duration,
}

impl ConnectionHandler {
    pub(crate) fn new(words: Arc<FlushWords>, max_write_queue_size: Option<usize>) -> ConnectionHandler {
        ConnectionHandler {
            memories: Vec::new(),
            sems: Vec::new(),
            conns: Vec::new(),
            words,
            max_queue: max_write_queue_size.map(|q| q.max(1) as u64),
            flushes_pending: false,
            owing: Vec::new(),
            coalesce: Duration::ZERO,
            since_pay: 0,
            last_batch: 0,
            full_batch: super::runner::POP_BATCH,
            owed_since: None,
            pay_interval: Duration::ZERO,
            last_paid: None,
            backlog_hold: Duration::ZERO,
        }
    }

    /// Lets owed signals wait up to `d` while the FIFO (of `fifo_size` slots) keeps delivering
    /// triggers, and paces the payments a dry FIFO starts to one per `pay_interval`.
    pub(crate) fn coalesce(mut self, d: Duration, pay_interval: Duration, fifo_size: u32) -> ConnectionHandler {
        self.coalesce = d;
        self.pay_interval = pay_interval;
        self.full_batch = super::runner::pop_batch(fifo_size);
        self
    }

    /// Lets the owed signals of a backlogged connection wait up to `d`, counted from the first
    /// of them, while the FIFO keeps delivering (see
    /// [`ProxyConfig::signal_backlog_hold`](super::ProxyConfig::signal_backlog_hold); applies
    /// with coalescing on).
    pub(crate) fn backlog_hold(mut self, d: Duration) -> ConnectionHandler {
        self.backlog_hold = d;
        self
    }

    /// Whether the backlog hold applies (a hold given, and coalescing on).
    fn holding(&self) -> bool {
        !self.backlog_hold.is_zero() && !self.coalesce.is_zero()
    }

    /// Whether semaphore `id`'s owed signals keep waiting at a payment the FIFO's delivery did
    /// not start (a full batch): its connection has at least half its queue bound in flight,
    /// fewer than a quarter of the bound writes went on it since the first of them was owed,
    /// and that one is younger than the hold. A token paid then would queue behind at least
    /// half a queue of writes anyway; one paid a quarter of a queue later lands a little later
    /// and spares the peer a round of landings (an Ethernet receiver lands every write before a
    /// token first, one copy per contiguous run).
    fn held_by_backlog(&self, id: usize) -> bool {
        let e = &self.sems[id];
        let Some((at, from)) = e.owed_at else { return false };
        let c = &self.conns[e.conn];
        c.writes - from < c.hold_bound / 4
            && at.elapsed() < self.backlog_hold
            && c.conn.outstanding() * 2 >= c.hold_bound
    }

    /// Whether the owed signals go out at this `poll`, after a batch of `batch` triggers: at once
    /// without coalescing; with it, once the FIFO ran dry (a batch shorter than the loop's
    /// longest for this FIFO; after a full batch that emptied it, at the next, empty, step) and
    /// the last payment is `pay_interval` old, or once
    /// [`COALESCE_MAX_TRIGGERS`](super::COALESCE_MAX_TRIGGERS) triggers passed, or the oldest
    /// waited `coalesce`.
    fn pay_now(&self, batch: u64) -> bool {
        if self.coalesce.is_zero()
            || self.since_pay >= super::COALESCE_MAX_TRIGGERS
            || self.owed_since.is_none_or(|t| t.elapsed() >= self.coalesce)
        {
            return true;
        }
        // Dry: paid unless a payment went out less than `pay_interval` ago (signals are
        // streaming in; the next dry step after the interval pays them).
        batch < self.full_batch && self.last_paid.is_none_or(|t| t.elapsed() >= self.pay_interval)
    }

    pub(crate) fn memories(&self) -> usize {
        self.memories.len()
    }
    pub(crate) fn semaphores(&self) -> usize {
        self.sems.len()
    }
    pub(crate) fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Registers a memory; its index is its ID.
    pub(crate) fn add_memory(&mut self, m: RegisteredMemory) -> usize {
        self.memories.push(m);
        self.memories.len() - 1
    }

    /// Registers a semaphore (its connection once, shared by every semaphore on it); returns the
    /// semaphore's ID and its connection's index.
    pub(crate) fn add_semaphore(&mut self, sem: ProxySemaphore) -> (usize, usize) {
        let conn = sem.connection().clone();
        let idx = match self.conns.iter().position(|c| c.conn.same_as(&conn)) {
            Some(i) => i,
            None => {
                let bound = conn.max_write_queue_size() as u64;
                let hold_bound = match conn.transport() {
                    Transport::Ethernet => self.max_queue.map_or(bound, |m| m.min(bound)),
                    _ => 0,
                };
                self.conns.push(ConnState { conn, pending: VecDeque::new(), writes: 0, hold_bound });
                self.conns.len() - 1
            }
        };
        self.sems.push(SemEntry { sem, conn: idx, owed: 0, owed_at: None });
        (self.sems.len() - 1, idx)
    }

    /// Executes one decoded request pushed at FIFO position `pos`.
    pub(crate) fn execute(&mut self, req: Request, cx: &TriggerContext<'_>) -> Result<()> {
        match req {
            Request::Ops { sem_id, put, signal, flush } => {
                let ci = self.sem(sem_id)?.conn;
                let mut signal = signal;
                if let Some(p) = put {
                    // Checked before waiting for room, used by reference after (no clones: the
                    // per-trigger work allocates nothing and touches no reference count).
                    self.memory(p.dst_mem, "destination")?;
                    self.memory(p.src_mem, "source")?;
                    self.make_room(ci, cx)?;
                    let (doff, soff, len) = (p.dst_off as u64, p.src_off as u64, p.size as u64);
                    // A connection that joins a small write and its token into one operation
                    // (CUDA IPC kernel copies): the signal goes with the put, now, together with
                    // any this semaphore owes (paying early keeps every promise).
                    // The owed count is taken only once the operation is issued: a failure
                    // leaves it owed. (Not a payment round for `signal_pay_interval`: the token
                    // rides with the copy and costs no operation of its own.)
                    let joined = signal && len > 0 && len <= self.conns[ci].conn.joined_write_max();
                    let (dst, src) = (&self.memories[p.dst_mem as usize], &self.memories[p.src_mem as usize]);
                    if joined {
                        let e = &self.sems[sem_id as usize];
                        e.sem.write_then_signal_by(e.owed + 1, dst, doff, src, soff, len)?;
                        self.take_owed(sem_id as usize);
                        signal = false;
                    } else {
                        self.conns[ci].conn.write(dst, doff, src, soff, len)?;
                    }
                    self.conns[ci].writes += 1;
                }
                if signal {
                    // Owed, not sent: every signal of this semaphore popped in this batch goes
                    // out as one token write (token += n) when the batch ends (`poll`) or before
                    // a flush of the connection, after every put popped before it. A signal
                    // promises that the puts before it landed; one sent after later puts too
                    // still keeps that promise, and n signals in one write cost what one does.
                    self.sem(sem_id)?;
                    let id = sem_id as usize;
                    if self.sems[id].owed == 0 {
                        self.sems[id].owed_at = self.holding().then(|| (Instant::now(), self.conns[ci].writes));
                        self.owing.push(id);
                        if !self.coalesce.is_zero() && self.owed_since.is_none() {
                            // The first signal owed since everything was paid: counting starts.
                            self.owed_since = Some(Instant::now());
                            self.since_pay = 0;
                        }
                    }
                    self.sems[id].owed += 1;
                }
                if flush {
                    self.pay_signals(Some((ci, cx)), false)?;
                    self.flush(ci, cx.position())?;
                }
                Ok(())
            }
            Request::AtomicAdd { sem_id, dst_mem, dst_off, value } => {
                let ci = self.sem(sem_id)?.conn;
                let conn = self.conns[ci].conn.clone();
                if conn.transport() == Transport::CudaIpc {
                    return Err(Error::invalid_usage(
                        "atomicAdd over a CUDA IPC connection is refused by the proxy: it would need a \
                         kernel that cannot run while the pushing kernel occupies the GPU; add to the \
                         peer's memory from the kernel itself with MemoryChannel's direct device atomics \
                         (atom/red .sys on the CUDA IPC-mapped pointer)",
                    ));
                }
                self.memory(dst_mem, "destination")?;
                self.make_room(ci, cx)?;
                conn.atomic_add(&self.memories[dst_mem as usize], dst_off as u64, value)?;
                self.conns[ci].writes += 1;
                Ok(())
            }
        }
    }

    /// Takes the signals semaphore `id` owes (they are then sent by the caller), 0 if none.
    fn take_owed(&mut self, id: usize) -> u64 {
        let n = std::mem::take(&mut self.sems[id].owed);
        if n > 0 {
            self.owing.retain(|&i| i != id);
            if self.owing.is_empty() {
                self.since_pay = 0;
                self.owed_since = None;
            }
        }
        n
    }

    /// Sends the owed signals: of connection `only.0` (with room made on it first), or of every
    /// connection (at the end of a batch: at most one operation per semaphore beyond the
    /// connection's queue bound), but with `hold`, not those [`held_by_backlog`](Self::held_by_backlog).
    fn pay_signals(&mut self, only: Option<(usize, &TriggerContext<'_>)>, hold: bool) -> Result<()> {
        let mut i = 0;
        let mut paid = false;
        let mut held = false;
        while i < self.owing.len() {
            let id = self.owing[i];
            let ci = self.sems[id].conn;
            if let Some((want, cx)) = only {
                if ci != want {
                    i += 1;
                    continue;
                }
                self.make_room(ci, cx)?;
            } else if hold && self.held_by_backlog(id) {
                i += 1;
                held = true;
                continue;
            }
            let n = std::mem::take(&mut self.sems[id].owed);
            self.owing.remove(i);
            self.sems[id].sem.signal_by(n)?;
            paid = true;
        }
        if self.owing.is_empty() {
            self.since_pay = 0;
            self.owed_since = None;
        } else if held {
            // Only held signals are left: coalescing starts over, so signals owed from now on
            // wait as usual instead of going out after every batch (and the holds are looked at
            // again when those are paid).
            self.since_pay = 0;
            self.owed_since = Some(Instant::now());
        }
        if paid && !self.coalesce.is_zero() && !self.pay_interval.is_zero() {
            self.last_paid = Some(Instant::now());
        }
        Ok(())
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
            if let Some(pos) = publish {
                self.words.publish(i, pos);
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
            self.words.publish(ci, pos);
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
    fn make_room(&mut self, ci: usize, cx: &TriggerContext<'_>) -> Result<()> {
        let Some(max) = self.max_queue else { return Ok(()) };
        let conn = self.conns[ci].conn.clone();
        let p = conn.progress()?;
        if p.issued - p.completed < max {
            return Ok(());
        }
        cx.release_handled();
        conn.request_progress()?;
        let deadline = Deadline::after(BACK_PRESSURE_LIMIT);
        let mut backoff = Backoff::new(BackoffPolicy::FAST);
        loop {
            self.progress_flushes()?;
            let p = conn.progress()?;
            if p.issued - p.completed < max {
                return Ok(());
            }
            if cx.stop_requested() {
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
}

impl ProxyHandler for ConnectionHandler {
    fn handle(&mut self, trigger: ProxyTrigger, cx: &TriggerContext<'_>) -> Result<HandlerResult> {
        self.since_pay += 1;
        self.last_batch += 1;
        self.execute(decode(trigger)?, cx)?;
        Ok(HandlerResult::Continue)
    }

    fn poll(&mut self) -> Result<()> {
        let batch = std::mem::take(&mut self.last_batch);
        if !self.owing.is_empty() && self.pay_now(batch) {
            // A dry FIFO pays everything: its producers may be waiting for these signals.
            let hold = self.holding() && batch >= self.full_batch;
            self.pay_signals(None, hold)?;
        }
        if self.flushes_pending { self.progress_flushes() } else { Ok(()) }
    }

    fn release_waiters(&mut self) {
        self.words.release_all(self.conns.len());
    }

    fn drain(&mut self) -> Result<()> {
        self.pay_signals(None, false)?;
        for _ in 0..DRAIN_ROUNDS {
            if self.conns.iter().all(|c| c.pending.is_empty()) {
                break;
            }
            self.progress_flushes()?;
            std::thread::yield_now();
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        let mut first = None;
        for c in &self.conns {
            if c.conn.outstanding() > 0
                && let Err(e) = c.conn.flush(STOP_FLUSH_TIMEOUT)
            {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::super::runner::{LoopShared, Runner, Step};
    use super::super::{PROXY_FAILED, PROXY_STOPPED};
    use super::*;
    use crate::buffer::Buffer;
    use crate::conn::{ConnInner, ConnectionImpl, Progress};
    use crate::context::Context;
    use crate::device::fifo::Fifo;
    use crate::device::trigger::Put;
    use crate::platform::hostmem::HostAlloc;
    use crate::semaphore::{Semaphore, SemaphoreStub};
    use crate::sync::lock;
    use crate::transport::{Device, TransportFlags};

    /// What the fake connection was asked to do.
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Op {
        Write {
            dst_off: u64,
            src_off: u64,
            len: u64,
        },
        Update {
            old: u64,
            new: u64,
        },
        Add {
            dst_off: u64,
            value: i64,
        },
        /// A write and its token as one operation (`try_write_and_update`).
        Joined {
            len: u64,
            old: u64,
            new: u64,
        },
        Flush,
    }

    /// The far side of the fake: what arrived, how far the "peer" has applied, and a failure to
    /// inject. Operations take sequence numbers 1, 2, ... as on a real connection.
    #[derive(Default)]
    struct Wire {
        ops: Vec<Op>,
        completed: u64,
        fail: Option<String>,
        /// `joined_write_max` (0: the fake joins nothing, as most transports).
        joined_max: u64,
        /// `max_write_queue_size` (0: 2^20).
        queue: u64,
    }

    struct Fake(Arc<Mutex<Wire>>);

    impl Fake {
        fn op(&self, op: Op) -> Result<()> {
            let mut w = lock(&self.0);
            if let Some(m) = &w.fail {
                return Err(Error::new(ErrorKind::Remote, m.clone()));
            }
            w.ops.push(op);
            Ok(())
        }
    }

    impl ConnectionImpl for Fake {
        fn write(
            &self,
            _: &RegisteredMemory,
            dst_off: u64,
            _: &RegisteredMemory,
            src_off: u64,
            len: u64,
        ) -> Result<()> {
            self.op(Op::Write { dst_off, src_off, len })
        }
        fn update_and_sync(&self, _: &RegisteredMemory, _: u64, old: u64, new: u64) -> Result<()> {
            self.op(Op::Update { old, new })
        }
        fn atomic_add(&self, _: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
            self.op(Op::Add { dst_off, value })
        }
        fn joined_write_max(&self) -> u64 {
            lock(&self.0).joined_max
        }
        fn try_write_and_update(
            &self,
            _: &RegisteredMemory,
            _: u64,
            _: &RegisteredMemory,
            _: u64,
            len: u64,
            _: (&RegisteredMemory, u64),
            old: u64,
            new: u64,
        ) -> Result<bool> {
            if len > self.joined_write_max() {
                return Ok(false);
            }
            self.op(Op::Joined { len, old, new }).map(|()| true)
        }
        fn flush(&self, _: Duration) -> Result<()> {
            let mut w = lock(&self.0);
            w.completed = w.ops.iter().filter(|o| **o != Op::Flush).count() as u64;
            w.ops.push(Op::Flush);
            Ok(())
        }
        fn failure(&self) -> Option<Error> {
            lock(&self.0).fail.as_ref().map(|m| Error::new(ErrorKind::Remote, m.clone()))
        }
        fn max_write_queue_size(&self) -> usize {
            match lock(&self.0).queue {
                0 => 1 << 20,
                q => q as usize,
            }
        }
        fn outstanding(&self) -> u64 {
            let w = lock(&self.0);
            w.ops.iter().filter(|o| **o != Op::Flush).count() as u64 - w.completed
        }
        /// Keeps answering after an injected failure, so that the failing operation (not the
        /// proxy's polling) reports it.
        fn progress(&self, _request: bool) -> Result<Progress> {
            let w = lock(&self.0);
            Ok(Progress { issued: w.ops.iter().filter(|o| **o != Op::Flush).count() as u64, completed: w.completed })
        }
    }

    /// A handler with one fake connection (peer rank 1), one plain semaphore on it (ID 0), and
    /// two memories (ID 0: the peer's, 1: local), driven by a runner over a host FIFO.
    struct Rig {
        runner: Runner<ConnectionHandler>,
        wire: Arc<Mutex<Wire>>,
        words: Arc<FlushWords>,
        _ctx: Context,
    }

    fn rig(fifo_size: u32, max_queue: Option<usize>) -> Rig {
        rig_coalescing(fifo_size, max_queue, Duration::ZERO, Duration::ZERO)
    }

    fn rig_coalescing(fifo_size: u32, max_queue: Option<usize>, coalesce: Duration, pay_interval: Duration) -> Rig {
        rig_holding(fifo_size, max_queue, coalesce, pay_interval, Duration::ZERO, 0)
    }

    fn rig_holding(
        fifo_size: u32,
        max_queue: Option<usize>,
        coalesce: Duration,
        pay_interval: Duration,
        hold: Duration,
        queue: u64,
    ) -> Rig {
        let ctx = Context::new();
        let wire = Arc::new(Mutex::new(Wire { queue, ..Wire::default() }));
        let conn = Connection::from_inner(ConnInner {
            imp: Box::new(Fake(wire.clone())),
            transport: Transport::Ethernet,
            remote_transport: Transport::Ethernet,
            device: Device::Cpu,
            context: ctx.clone(),
            peer: Some(1),
            peer_desc: "the fake peer".to_string(),
        });
        let flags = TransportFlags::from(Transport::Ethernet);
        let stub = SemaphoreStub::new(&conn).unwrap();
        let peer_token = Buffer::new(&ctx, 8, flags).unwrap();
        let sem = Semaphore::new(stub, peer_token.memory().clone());
        let alloc = Arc::new(HostAlloc::zeroed(4 * 8).unwrap());
        let words = Arc::new(FlushWords::new(Region::owned(alloc, 4 * 8)));
        let mut h = ConnectionHandler::new(words.clone(), max_queue)
            .coalesce(coalesce, pay_interval, fifo_size)
            .backlog_hold(hold);
        assert_eq!(h.add_semaphore(sem.into()), (0, 0));
        for _ in 0..2 {
            h.add_memory(Buffer::new(&ctx, 1 << 16, flags).unwrap().memory().clone());
        }
        let fifo = Arc::new(Fifo::host_backed(fifo_size).unwrap());
        Rig { runner: Runner::new(Arc::new(LoopShared::new(fifo)), h), wire, words, _ctx: ctx }
    }

    impl Rig {
        fn fifo(&self) -> &Fifo {
            self.runner.sh_fifo()
        }
        /// Pushes `t` and steps once; returns its position.
        fn run(&mut self, t: ProxyTrigger) -> u64 {
            let pos = self.fifo().host_producer().unwrap().push(t, Duration::ZERO).unwrap();
            assert_eq!(self.runner.step(), Step::Worked(1));
            pos
        }
        fn flush_done(&self) -> u64 {
            self.words.word(0).unwrap().load(Ordering::Acquire)
        }
        fn complete_up_to(&self, seq: u64) {
            lock(&self.wire).completed = seq;
        }
        fn ops(&self) -> Vec<Op> {
            lock(&self.wire).ops.clone()
        }
    }

    fn put(size: u32, off: u32) -> Put {
        Put { src_mem: 1, src_off: off, dst_mem: 0, dst_off: off, size }
    }

    /// A put+signal becomes a write then a token update (outbound 0 -> 1, then 1 -> 2), an
    /// atomicAdd an add, in FIFO order.
    #[test]
    fn triggers_become_connection_operations() {
        let mut r = rig(4, None);
        r.run(ProxyTrigger::put_with_signal(0, put(100, 8)).unwrap());
        r.run(ProxyTrigger::signal(0).unwrap());
        r.run(ProxyTrigger::atomic_add(0, 0, 16, -3).unwrap());
        assert_eq!(
            r.ops(),
            vec![
                Op::Write { dst_off: 8, src_off: 8, len: 100 },
                Op::Update { old: 0, new: 1 },
                Op::Update { old: 1, new: 2 },
                Op::Add { dst_off: 16, value: -3 },
            ]
        );
        assert!(r.runner.sh_status().is_ok());
    }

    /// On a connection that joins small writes with their tokens (CUDA IPC kernel copies), a
    /// putWithSignal up to its limit is one operation at once, carrying the signals its semaphore
    /// owed; a larger one is a write, its signal owed until the batch ends as usual.
    #[test]
    fn a_small_put_with_signal_is_one_joined_operation() {
        let mut r = rig(16, None);
        lock(&r.wire).joined_max = 64;
        let p = r.fifo().host_producer().unwrap();
        p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        p.push(ProxyTrigger::put_with_signal(0, put(64, 0)).unwrap(), Duration::ZERO).unwrap();
        p.push(ProxyTrigger::put_with_signal(0, put(65, 8)).unwrap(), Duration::ZERO).unwrap();
        assert_eq!(r.runner.step(), Step::Worked(3));
        assert_eq!(
            r.ops(),
            vec![Op::Joined { len: 64, old: 0, new: 2 }, Op::Write { dst_off: 8, src_off: 8, len: 65 }],
            "the owed signal went with the joined put; the larger put's signal is owed"
        );
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops().last(), Some(&Op::Update { old: 2, new: 3 }));
        // A plain put joins nothing (no signal to join); a lone signal is a token write.
        r.run(ProxyTrigger::put(0, put(8, 0)).unwrap());
        r.run(ProxyTrigger::put_with_signal(0, put(8, 0)).unwrap());
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops()[3..], [Op::Write { dst_off: 0, src_off: 0, len: 8 }, Op::Joined { len: 8, old: 3, new: 4 }]);
        assert!(r.runner.sh_status().is_ok());
    }

    /// A joined operation that fails leaves the signals its semaphore owed still owed (and the
    /// proxy failed with the connection's error).
    #[test]
    fn a_failed_joined_operation_keeps_what_was_owed() {
        let mut r = rig(16, None);
        lock(&r.wire).joined_max = 64;
        lock(&r.wire).fail = Some("injected".to_string());
        let p = r.fifo().host_producer().unwrap();
        p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        p.push(ProxyTrigger::put_with_signal(0, put(64, 0)).unwrap(), Duration::ZERO).unwrap();
        r.runner.step();
        let e = r.runner.sh_status().unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        assert_eq!(r.ops(), vec![]);
        let h = r.runner.handler();
        assert_eq!((h.sems[0].owed, h.owing.as_slice()), (1, &[0usize][..]), "the owed signal was dropped");
    }

    /// Signals popped in one batch go out as one token write per semaphore, after the batch's
    /// puts and before a flush of their connection; a lone signal goes out at the next step.
    #[test]
    fn signals_of_one_batch_are_one_token_write() {
        let mut r = rig(16, None);
        let p = r.fifo().host_producer().unwrap();
        p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        p.push(ProxyTrigger::put_with_signal(0, put(8, 0)).unwrap(), Duration::ZERO).unwrap();
        p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        assert_eq!(r.runner.step(), Step::Worked(3));
        assert_eq!(r.ops(), vec![Op::Write { dst_off: 0, src_off: 0, len: 8 }], "signals wait for the batch's end");
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Write { dst_off: 0, src_off: 0, len: 8 }, Op::Update { old: 0, new: 3 }]);
        // Owed signals go out before a flush of their connection, in the same step.
        let p = r.fifo().host_producer().unwrap();
        p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        p.push(ProxyTrigger::flush(0).unwrap(), Duration::ZERO).unwrap();
        assert_eq!(r.runner.step(), Step::Worked(2));
        assert_eq!(r.ops().last(), Some(&Op::Update { old: 3, new: 4 }));
        assert!(r.runner.sh_status().is_ok());
    }

    /// With coalescing on, a full batch leaves its signals owed while the FIFO holds more
    /// triggers; they go out as one token write once the FIFO runs dry.
    #[test]
    fn coalesced_signals_wait_until_the_fifo_runs_dry() {
        let mut r = rig_coalescing(512, None, Duration::from_secs(3600), Duration::ZERO);
        let p = r.fifo().host_producer().unwrap();
        for _ in 0..74 {
            p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        }
        assert_eq!(r.runner.step(), Step::Worked(64));
        assert_eq!(r.runner.step(), Step::Worked(10));
        assert_eq!(r.ops(), vec![], "the FIFO kept delivering: nothing paid yet");
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 74 }]);
        // A lone signal goes out at the next step, as without coalescing.
        r.run(ProxyTrigger::signal(0).unwrap());
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops().last(), Some(&Op::Update { old: 74, new: 75 }));
        assert!(r.runner.sh_status().is_ok());
    }

    /// In a FIFO smaller than the loop's longest batch, a batch that fills the FIFO is a full
    /// one: its signals stay owed while the producers refill it (they were paid after every
    /// batch, as if the FIFO were always dry, when the rule compared with 64 whatever the size).
    #[test]
    fn a_small_fifo_full_batch_keeps_signals_owed() {
        let mut r = rig_coalescing(16, None, Duration::from_secs(3600), Duration::ZERO);
        let p = r.fifo().host_producer().unwrap();
        for _ in 0..16 {
            p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        }
        assert_eq!(r.runner.step(), Step::Worked(16));
        let p = r.fifo().host_producer().unwrap();
        for _ in 0..5 {
            p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        }
        assert_eq!(r.runner.step(), Step::Worked(5));
        assert_eq!(r.ops(), vec![], "the FIFO kept delivering: nothing paid yet");
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 21 }]);
    }

    /// Under continuous load, owed signals go out after at most COALESCE_MAX_TRIGGERS triggers
    /// (plus one batch), whatever the time limit; and at once when the time limit has passed.
    #[test]
    fn coalescing_is_bounded_by_triggers_and_time() {
        let mut r = rig_coalescing(512, None, Duration::from_secs(3600), Duration::ZERO);
        let p = r.fifo().host_producer().unwrap();
        for _ in 0..512 {
            p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        }
        let mut steps = 0;
        while r.ops().is_empty() {
            assert_eq!(r.runner.step(), Step::Worked(64));
            steps += 1;
            assert!(steps <= 6, "still owed after {steps} full batches");
        }
        let first = r.ops()[0].clone();
        let Op::Update { old: 0, new } = first else { panic!("{first:?}") };
        assert!(
            (super::super::COALESCE_MAX_TRIGGERS..512).contains(&new),
            "paid {new} of 512 while the FIFO held more"
        );
        while r.runner.step() != Step::Idle {}
        // The last batch was full and emptied the FIFO: the step after it finds it dry.
        assert_eq!(r.ops().len(), 1);
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops().last(), Some(&Op::Update { old: new, new: 512 }));

        // A limit already passed pays after every batch, as without coalescing.
        let mut r = rig_coalescing(512, None, Duration::from_nanos(1), Duration::ZERO);
        let p = r.fifo().host_producer().unwrap();
        for _ in 0..74 {
            p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
        }
        assert_eq!(r.runner.step(), Step::Worked(64));
        assert_eq!(r.runner.step(), Step::Worked(10));
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 64 }]);
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 64 }, Op::Update { old: 64, new: 74 }]);
    }

    /// With a pay interval, a dry FIFO pays owed signals at once after a quiet spell (here: the
    /// first payment), then holds them while the last payment is younger than the interval; a
    /// flush pays its connection at once, and COALESCE_MAX_TRIGGERS bounds the hold.
    #[test]
    fn dry_payments_are_paced_while_signals_stream() {
        let hour = Duration::from_secs(3600);
        let mut r = rig_coalescing(512, None, hour, hour);
        let push = |r: &Rig, n: usize| {
            let p = r.fifo().host_producer().unwrap();
            for _ in 0..n {
                p.push(ProxyTrigger::signal(0).unwrap(), Duration::ZERO).unwrap();
            }
        };
        push(&r, 3);
        assert_eq!(r.runner.step(), Step::Worked(3));
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 3 }], "the first payment goes out at once");
        push(&r, 2);
        assert_eq!(r.runner.step(), Step::Worked(2));
        for _ in 0..100 {
            assert_eq!(r.runner.step(), Step::Idle);
        }
        assert_eq!(r.ops().len(), 1, "dry, but the last payment is younger than the interval: held");
        // A flush pays its connection's owed signals at once, whatever the pace.
        r.run(ProxyTrigger::flush(0).unwrap());
        assert_eq!(r.ops().last(), Some(&Op::Update { old: 3, new: 5 }));
        // Held signals go out once COALESCE_MAX_TRIGGERS triggers passed since the first of them.
        let max = super::super::COALESCE_MAX_TRIGGERS;
        let mut pushed = 0;
        while r.ops().len() == 2 {
            assert!(pushed <= max, "still held after {pushed} signals");
            push(&r, 10);
            pushed += 10;
            assert_eq!(r.runner.step(), Step::Worked(10));
            assert_eq!(r.runner.step(), Step::Idle);
        }
        assert!(pushed >= max, "paid after {pushed} signals, before the bound");
        assert_eq!(r.ops().last(), Some(&Op::Update { old: 5, new: 5 + pushed }));
        assert!(r.runner.sh_status().is_ok());
    }

    /// A backlogged connection (half its queue bound in flight) keeps its owed signals through
    /// full batches until a quarter of the bound more writes went on it; a connection that has
    /// drained, a dry FIFO, and an expired hold pay at once.
    #[test]
    fn a_backlogged_connection_holds_signals_for_a_quarter_queue() {
        // Coalescing's own limit has passed at every poll: without the hold every batch pays.
        let rig = |hold| rig_holding(512, None, Duration::from_nanos(1), Duration::ZERO, hold, 1024);
        let push = |r: &mut Rig, n: usize, signal: bool| {
            let p = r.fifo().host_producer().unwrap();
            for _ in 0..n {
                let t =
                    if signal { ProxyTrigger::put_with_signal(0, put(8, 0)) } else { ProxyTrigger::put(0, put(8, 0)) };
                p.push(t.unwrap(), Duration::ZERO).unwrap();
            }
            while r.runner.step() != Step::Idle {}
        };
        let updates = |r: &Rig| {
            r.ops()
                .into_iter()
                .filter_map(|o| match o {
                    Op::Update { old, new } => Some((old, new)),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        // A full batch of puts with signals, then one of puts: the loop polls the handler at the
        // start of each step, so the second step decides about the first batch's signals.
        let full_batch = |r: &mut Rig| {
            let p = r.fifo().host_producer().unwrap();
            for _ in 0..64 {
                p.push(ProxyTrigger::put_with_signal(0, put(8, 0)).unwrap(), Duration::ZERO).unwrap();
            }
            for _ in 0..64 {
                p.push(ProxyTrigger::put(0, put(8, 0)).unwrap(), Duration::ZERO).unwrap();
            }
            assert_eq!(r.runner.step(), Step::Worked(64));
            assert_eq!(r.runner.step(), Step::Worked(64));
        };

        let mut r = rig(Duration::from_secs(3600));
        push(&mut r, 512, false); // 512 in flight: backlogged (bound 1024)
        // Signals owed from write 513 on: held while fewer than 256 writes followed.
        full_batch(&mut r); // writes 513..640, decided at 576
        assert_eq!(updates(&r), vec![], "backlogged: held");
        full_batch(&mut r); // 641..768, decided at 640 and 704
        assert_eq!(updates(&r), vec![], "a quarter queue not reached: held");
        full_batch(&mut r); // 769..896, decided at 768 (255 after 513: held) and 832 (paid)
        assert_eq!(updates(&r), vec![(0, 192)]);
        assert_eq!(r.runner.step(), Step::Idle);

        // Drained below half: paid after the batch.
        let done = r.ops().len() as u64;
        r.complete_up_to(done);
        full_batch(&mut r);
        assert_eq!(updates(&r).last(), Some(&(192, 256)), "not backlogged: paid");
        assert_eq!(r.runner.step(), Step::Idle);

        // Backlogged again, but the FIFO runs dry: paid at once.
        push(&mut r, 512, false);
        push(&mut r, 10, true);
        assert_eq!(updates(&r).last(), Some(&(256, 266)), "a dry FIFO pays");

        // A hold that has expired, and no hold: every full batch pays.
        for hold in [Duration::from_nanos(1), Duration::ZERO] {
            let mut r = rig(hold);
            push(&mut r, 512, false);
            full_batch(&mut r);
            assert_eq!(updates(&r), vec![(0, 64)], "hold {hold:?}");
        }
    }

    /// Only a payment that wrote a token starts the interval: a flush with nothing owed does not,
    /// so the first signal after it still goes out at once.
    #[test]
    fn a_flush_with_nothing_owed_is_not_a_payment() {
        let hour = Duration::from_secs(3600);
        let mut r = rig_coalescing(512, None, hour, hour);
        r.run(ProxyTrigger::flush(0).unwrap());
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![], "nothing was owed");
        r.run(ProxyTrigger::signal(0).unwrap());
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 1 }]);
    }

    /// A held payment goes out at a dry step once the interval since the last one has passed,
    /// and not before.
    #[test]
    fn a_held_payment_goes_out_after_the_interval() {
        let interval = Duration::from_millis(20);
        let mut r = rig_coalescing(512, None, Duration::from_secs(3600), interval);
        let before_first = Instant::now();
        r.run(ProxyTrigger::signal(0).unwrap());
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 1 }]);
        r.run(ProxyTrigger::signal(0).unwrap());
        let deadline = Instant::now() + Duration::from_secs(60);
        while r.ops().len() == 1 {
            assert!(Instant::now() < deadline, "a held signal was never paid");
            assert_eq!(r.runner.step(), Step::Idle);
        }
        assert!(before_first.elapsed() >= interval, "paid {:?} after the first payment", before_first.elapsed());
        assert_eq!(r.ops(), vec![Op::Update { old: 0, new: 1 }, Op::Update { old: 1, new: 2 }]);
    }

    /// A flush is recorded with the connection's issued sequence number and published (as its
    /// position plus one) once `completed` reaches that number, not when the connection is idle:
    /// later traffic does not hold it back. Flushes publish in order; one with nothing
    /// outstanding publishes at once.
    #[test]
    fn flushes_are_tracked_by_sequence_number() {
        let mut r = rig(8, None);
        r.run(ProxyTrigger::put(0, put(64, 0)).unwrap()); // seq 1
        r.run(ProxyTrigger::put(0, put(64, 64)).unwrap()); // seq 2
        let f1 = r.run(ProxyTrigger::flush(0).unwrap()); // waits for seq 2
        assert_eq!(r.flush_done(), 0, "nothing completed yet");
        r.run(ProxyTrigger::put(0, put(64, 128)).unwrap()); // seq 3
        let f2 = r.run(ProxyTrigger::put_with_signal_and_flush(0, put(8, 256)).unwrap()); // seqs 4, 5
        r.complete_up_to(1);
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.flush_done(), 0, "seq 1 of 2: the first flush is not done");
        r.complete_up_to(3); // traffic after the first flush is outstanding too
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.flush_done(), f1 + 1, "the first flush published although seq 3 is outstanding");
        r.complete_up_to(5);
        assert_eq!(r.runner.step(), Step::Idle);
        assert_eq!(r.flush_done(), f2 + 1);
        // Nothing outstanding: published while handling the trigger.
        let f3 = r.run(ProxyTrigger::flush(0).unwrap());
        assert_eq!(r.flush_done(), f3 + 1);
        assert!(r.runner.sh_status().is_ok());
    }

    /// Flush positions keep counting across laps of a small ring: 200 put+flush triggers through
    /// a 2-slot FIFO each publish their own position.
    #[test]
    fn flush_positions_count_across_fifo_laps() {
        let mut r = rig(2, None);
        for i in 0..200u64 {
            let pos = r.run(ProxyTrigger::put_with_signal_and_flush(0, put(8, 0)).unwrap());
            assert_eq!(pos, i);
            assert_eq!(r.flush_done(), i, "flush {i} waits for its two operations");
            r.complete_up_to(2 * (i + 1));
            assert_eq!(r.runner.step(), Step::Idle);
            assert_eq!(r.flush_done(), i + 1);
        }
        assert_eq!(r.ops().len(), 400);
    }

    /// A connection error is the proxy's error: the FIFO's error word is `PROXY_FAILED` and every
    /// flush word `u64::MAX` (the pending flush is released) before the host sees the error,
    /// which names the FIFO position, the peer and the transport; later triggers, more than the
    /// ring holds, are popped and not executed.
    #[test]
    fn a_connection_error_is_published_and_returned() {
        let mut r = rig(4, None);
        r.run(ProxyTrigger::put(0, put(64, 0)).unwrap());
        r.run(ProxyTrigger::flush(0).unwrap());
        lock(&r.wire).fail = Some("the peer reset the connection".into());
        let bad = r.run(ProxyTrigger::put(0, put(64, 64)).unwrap());
        assert_eq!(r.fifo().proxy_error(), PROXY_FAILED);
        assert_eq!(r.flush_done(), u64::MAX, "the pending flush is released");
        let e = r.runner.sh_status().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Remote, "{e}");
        let text = e.to_string();
        assert!(text.contains(&format!("FIFO position {bad}")), "{text}");
        assert!(text.contains("the peer reset the connection") && text.contains("write"), "{text}");
        lock(&r.wire).fail = None;
        for _ in 0..10 {
            r.run(ProxyTrigger::signal(0).unwrap());
        }
        assert_eq!(r.ops().len(), 1, "nothing executed after the failure");
        r.runner.finish();
        assert_eq!(r.fifo().proxy_error(), PROXY_FAILED, "a stop keeps the failure visible");
    }

    /// Triggers that do not decode or name what is not registered fail the proxy with
    /// `InvalidUsage`, and only the first error is kept.
    #[test]
    fn bad_triggers_fail_with_the_first_error() {
        let mut r = rig(4, None);
        r.run(ProxyTrigger::put(0, Put { dst_mem: 9, ..put(8, 0) }).unwrap());
        r.run(ProxyTrigger { fst: 77, snd: 2 << 50 });
        let e = r.runner.sh_status().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage);
        assert!(e.to_string().contains("destination memory 9"), "{e}");
        let mut r = rig(4, None);
        r.run(ProxyTrigger::signal(3).unwrap());
        assert!(r.runner.sh_status().unwrap_err().to_string().contains("semaphore 3"));
        let mut r = rig(4, None);
        r.run(ProxyTrigger { fst: 77, snd: 2 << 50 });
        assert!(r.runner.sh_status().unwrap_err().to_string().contains("bad trigger"));
    }

    /// With a bound of 2 in flight, a third operation waits for completions; a stop request ends
    /// the wait with an error instead of the 30 s limit (no clock in the test: the connection
    /// never completes, and stop is requested before the trigger is handled).
    #[test]
    fn back_pressure_waits_for_room_and_gives_up_on_stop() {
        let mut r = rig(4, Some(2));
        r.run(ProxyTrigger::put(0, put(8, 0)).unwrap());
        r.run(ProxyTrigger::put(0, put(8, 8)).unwrap());
        r.complete_up_to(1);
        r.run(ProxyTrigger::put(0, put(8, 16)).unwrap()); // room: 1 in flight
        assert_eq!(r.ops().len(), 3);
        r.runner.request_stop();
        r.run(ProxyTrigger::put(0, put(8, 24)).unwrap()); // 2 in flight: waits, sees the stop
        assert_eq!(r.ops().len(), 3);
        let e = r.runner.sh_status().unwrap_err();
        assert!(e.to_string().contains("stopped while 2 operations were in flight"), "{e}");
    }

    /// A clean stop drains completed flushes, publishes `PROXY_STOPPED`, releases the flush words
    /// and flushes the connection.
    #[test]
    fn finishing_drains_releases_and_flushes() {
        let mut r = rig(4, None);
        r.run(ProxyTrigger::put_with_signal_and_flush(0, put(8, 0)).unwrap());
        r.runner.finish();
        assert_eq!(r.fifo().proxy_error(), PROXY_STOPPED);
        assert_eq!(r.flush_done(), u64::MAX);
        assert_eq!(r.ops().last(), Some(&Op::Flush), "outstanding operations flushed at the end");
        assert!(r.runner.sh_status().is_ok());
    }
}

/// The host cost of the proxy's trigger path, without a GPU: host producer threads push into a
/// host-backed FIFO, a proxy thread runs the built-in handler on counting in-memory connections
/// (one per peer), and the rate is set beside one host thread issuing the same connection calls
/// directly. Run with
/// `cargo test --release -p mscclpp --lib proxy_host_path_throughput -- --ignored --nocapture`.
#[cfg(test)]
mod bench {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::super::runner::{Proxy, ProxyOptions};
    use super::*;
    use crate::buffer::Buffer;
    use crate::conn::{ConnInner, ConnectionImpl, Progress};
    use crate::context::Context;
    use crate::device::fifo::Fifo;
    use crate::device::trigger::Put;
    use crate::platform::hostmem::HostAlloc;
    use crate::semaphore::{Semaphore, SemaphoreStub};
    use crate::transport::{Device, TransportFlags};

    /// Operations issued, writes among them, and the signals the token writes carried.
    #[derive(Default)]
    struct Counts {
        ops: AtomicU64,
        writes: AtomicU64,
        signals: AtomicU64,
    }

    /// Counts operations; everything completes at once (the cost measured is the proxy's).
    struct Counting(Arc<Counts>);

    impl ConnectionImpl for Counting {
        fn write(&self, _: &RegisteredMemory, _: u64, _: &RegisteredMemory, _: u64, _: u64) -> Result<()> {
            self.0.ops.fetch_add(1, Ordering::Relaxed);
            self.0.writes.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn update_and_sync(&self, _: &RegisteredMemory, _: u64, old: u64, new: u64) -> Result<()> {
            self.0.ops.fetch_add(1, Ordering::Relaxed);
            self.0.signals.fetch_add(new - old, Ordering::Relaxed);
            Ok(())
        }
        fn atomic_add(&self, _: &RegisteredMemory, _: u64, _: i64) -> Result<()> {
            self.0.ops.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn flush(&self, _: Duration) -> Result<()> {
            Ok(())
        }
        fn failure(&self) -> Option<Error> {
            None
        }
        fn max_write_queue_size(&self) -> usize {
            1 << 20
        }
        fn outstanding(&self) -> u64 {
            0
        }
        fn progress(&self, _: bool) -> Result<Progress> {
            let n = self.0.ops.load(Ordering::Relaxed);
            Ok(Progress { issued: n, completed: n })
        }
    }

    struct Setup {
        handler: ConnectionHandler,
        conns: Vec<Connection>,
        memories: Vec<RegisteredMemory>,
        counts: Arc<Counts>,
        _ctx: Context,
    }

    fn setup(peers: usize) -> Setup {
        let ctx = Context::new();
        let counts = Arc::new(Counts::default());
        let flags = TransportFlags::from(Transport::Ethernet);
        let alloc = Arc::new(HostAlloc::zeroed(64 * 8).unwrap());
        let words = Arc::new(FlushWords::new(Region::owned(alloc, 64 * 8)));
        let mut handler = ConnectionHandler::new(words, None);
        let mut conns = Vec::new();
        for p in 0..peers {
            let conn = Connection::from_inner(ConnInner {
                imp: Box::new(Counting(counts.clone())),
                transport: Transport::Ethernet,
                remote_transport: Transport::Ethernet,
                device: Device::Cpu,
                context: ctx.clone(),
                peer: Some(p + 1),
                peer_desc: format!("counting peer {p}"),
            });
            let stub = SemaphoreStub::new(&conn).unwrap();
            let token = Buffer::new(&ctx, 8, flags).unwrap();
            let _ = handler.add_semaphore(Semaphore::new(stub, token.memory().clone()).into());
            conns.push(conn);
        }
        let memories: Vec<_> = (0..2).map(|_| Buffer::new(&ctx, 1 << 16, flags).unwrap().memory().clone()).collect();
        for m in &memories {
            handler.add_memory(m.clone());
        }
        Setup { handler, conns, memories, counts, _ctx: ctx }
    }

    #[derive(Clone, Copy, Debug)]
    enum Op {
        Put,
        PutWithSignal,
        Signal,
    }

    fn trigger(op: Op, sem: u32, i: u64) -> ProxyTrigger {
        let p = Put { src_mem: 1, src_off: (i % 64) as u32 * 8, dst_mem: 0, dst_off: (i % 64) as u32 * 8, size: 8 };
        let r = match op {
            Op::Put => ProxyTrigger::put(sem, p),
            Op::PutWithSignal => ProxyTrigger::put_with_signal(sem, p),
            Op::Signal => ProxyTrigger::signal(sem),
        };
        r.unwrap()
    }

    /// Triggers per second through the proxy with `producers` host threads.
    fn through_proxy(op: Op, peers: usize, producers: usize, total: u64) -> f64 {
        let s = setup(peers);
        let counts = s.counts.clone();
        let mut proxy = Proxy::start(Fifo::host_backed(512).unwrap(), s.handler, ProxyOptions::default()).unwrap();
        let each = total / producers as u64;
        let t0 = Instant::now();
        std::thread::scope(|sc| {
            for id in 0..producers {
                let proxy = &proxy;
                sc.spawn(move || {
                    let p = proxy.fifo().host_producer().unwrap();
                    for i in 0..each {
                        let sem = ((id as u64 + i) % peers as u64) as u32;
                        p.push(trigger(op, sem, i), Duration::from_secs(60)).unwrap();
                    }
                });
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        while proxy.processed() < each * producers as u64 {
            assert!(Instant::now() < deadline, "the proxy did not drain");
            std::thread::yield_now();
        }
        let el = t0.elapsed().as_secs_f64();
        proxy.stop().unwrap();
        let n = each * producers as u64;
        let (puts, signals) = match op {
            Op::Put => (n, 0),
            Op::PutWithSignal => (n, n),
            Op::Signal => (0, n),
        };
        // Every put once; every signal counted once in the token writes (a batch's signals of
        // one semaphore share one write).
        assert_eq!(counts.writes.load(Ordering::Relaxed), puts, "every put issued once");
        assert_eq!(counts.signals.load(Ordering::Relaxed), signals, "every signal sent once");
        (each * producers as u64) as f64 / el
    }

    /// Nanoseconds of proxy work per trigger (poll, decode, handle, batched pop), the loop
    /// stepped on this thread over a ring filled beforehand: no producer competes for the core.
    fn proxy_ns_per_trigger(op: Op, peers: usize, total: u64) -> f64 {
        use super::super::runner::{LoopShared, Runner, Step};
        let s = setup(peers);
        let mut r = Runner::new(Arc::new(LoopShared::new(Arc::new(Fifo::host_backed(512).unwrap()))), s.handler);
        let (mut done, mut busy) = (0u64, Duration::ZERO);
        while done < total {
            let p = r.sh_fifo().host_producer().unwrap();
            for i in 0..512 {
                p.push(trigger(op, ((done + i) % peers as u64) as u32, i), Duration::ZERO).unwrap();
            }
            let t0 = Instant::now();
            while let Step::Worked(n) = r.step() {
                done += n;
            }
            busy += t0.elapsed();
        }
        busy.as_nanos() as f64 / done as f64
    }

    /// The same connection calls from one host thread, no FIFO and no proxy.
    fn direct(op: Op, peers: usize, total: u64) -> f64 {
        let s = setup(peers);
        let outbound: Vec<AtomicU64> = (0..peers).map(|_| AtomicU64::new(0)).collect();
        let (dst, src) = (&s.memories[0], &s.memories[1]);
        let t0 = Instant::now();
        for i in 0..total {
            let c = (i % peers as u64) as usize;
            let off = (i % 64) * 8;
            if matches!(op, Op::Put | Op::PutWithSignal) {
                s.conns[c].write(dst, off, src, off, 8).unwrap();
            }
            if matches!(op, Op::Signal | Op::PutWithSignal) {
                let next = outbound[c].load(Ordering::Relaxed) + 1;
                s.conns[c].update_and_sync(dst, 0, &outbound[c], next).unwrap();
            }
        }
        total as f64 / t0.elapsed().as_secs_f64()
    }

    #[test]
    #[ignore = "benchmark: run in release with --ignored --nocapture"]
    fn proxy_host_path_throughput() {
        const TOTAL: u64 = 2_000_000;
        for op in [Op::Put, Op::PutWithSignal, Op::Signal] {
            for peers in [1usize, 4, 8] {
                let d = direct(op, peers, TOTAL);
                let ns = proxy_ns_per_trigger(op, peers, TOTAL);
                println!(
                    "{op:?}, {peers} peers: proxy work {ns:.0} ns/trigger ({:.1} M/s on one core), direct {:.0} ns \
                     ({:.2} M/s), ratio {:.2}",
                    1e3 / ns,
                    1e9 / d,
                    d / 1e6,
                    (1e9 / ns) / d
                );
                for producers in [1usize, 2, 8] {
                    let r = through_proxy(op, peers, producers, TOTAL);
                    println!(
                        "{op:?}, {peers} peers, {producers} host producers: {:.2} M triggers/s through the proxy \
                         ({:.0} ns each), direct {:.2} M/s, ratio {:.2}",
                        r / 1e6,
                        1e9 / r,
                        d / 1e6,
                        r / d
                    );
                }
            }
        }
    }
}
