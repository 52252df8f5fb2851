//! The CUDA IPC transport: copies into a peer's GPU memory mapped into this process.
//!
//! Corrections to MSCCL++'s `CudaIpcConnection`:
//! * one non-blocking stream per context **and device** (MSCCL++ shares the first connection's);
//! * `update_and_sync` writes the token in stream order after the data, at `dst + offset` (MSCCL++
//!   adds the offset twice): by `cuStreamWriteValue64` (on the H200 the PortChannel ping-pong
//!   took 24.0-25.8 us round trip this way against 27.7-30.4 us with 8-byte copies from pinned
//!   memory); right after a copy of 16 MiB or more, and where stream memory operations are
//!   missing, by an 8-byte copy from a pinned slot
//!   that is not reused before a flush has proven the copy ran, slots being recycled by events
//!   once all are in use since the last flush;
//! * `atomic_add` runs on the same stream, so `flush` covers it;
//! * `flush(timeout)` polls an event, so the timeout holds, and returns CUDA errors as errors;
//! * `max_write_queue_size` bounds the operations in flight (MSCCL++ has no bound): an operation
//!   past it waits for the stream to drain, and fails with `Timeout` naming the peer after 30 s;
//! * a peer process that dies is noticed (MSCCL++ never notices: its memory stays mapped and
//!   writes keep landing in it): the endpoint carries the owner's pid and start time, and a
//!   thread per connection to another process polls a pidfd of it (`pidfd_open(2)`), which
//!   becomes readable the moment the process exits. The connection then fails with `Remote`
//!   naming the peer, so the next operation, `flush`, `status()` and semaphore waits fail. A pidfd
//!   rather than the bootstrap's liveness: it needs no socket or heartbeat, tells within
//!   milliseconds, and a CUDA IPC peer is by definition a process of this host. It is used only
//!   when the peer's process hash shows it is that pid in this pid namespace.
//!
//! The accounting and the slot hand-out are a core without CUDA ([`ring::IpcCore`]); this file
//! drives it, holding its lock while it enqueues so a flush counts only what is on the stream.

pub(crate) mod ring;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::linger::{self, Launch, Linger};
use super::{ConnInner, Connection, ConnectionImpl};
use crate::conn::endpoint::Endpoint;
use crate::context::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Mem, RegisteredMemory};
use crate::platform::cuda::linger::{Job, LingerKernel, Mailbox};
use crate::platform::cuda::{Event, GpuDevice, Stream};
use crate::platform::hostmem::Region;
use crate::sync::{Deadline, lock};
use crate::transport::{Device, Transport};
use ring::{IpcCore, TokenSlot};

/// Pinned slots holding token values until their copies run (which slot is free is the core's
/// business), and in event mode the event recorded behind each slot's last copy.
struct SlotMem {
    slots: Region,
    events: Vec<Option<Event>>,
}

impl SlotMem {
    fn new(dev: &Arc<GpuDevice>) -> Result<SlotMem> {
        Ok(SlotMem {
            slots: crate::platform::cuda::PinnedAlloc::region(dev, SLOTS * 8)?,
            events: (0..SLOTS).map(|_| None).collect(),
        })
    }

    /// Stores `value` in slot `i` and returns the slot's address (valid while `self` lives).
    fn fill(&mut self, i: usize, value: u64) -> Result<*mut u8> {
        self.slots.write((i * 8) as u64, &value.to_le_bytes())?;
        Ok(self.slots.as_mut_ptr().wrapping_add(i * 8))
    }
}

const SLOTS: usize = 256;
/// A token written right after a copy of at least this many bytes is an 8-byte copy from a
/// pinned slot rather than `cuStreamWriteValue64`: on the H200 the stream memory operation
/// (which waits for the copy engine, then fences) left about 3 us of stream time between two
/// 64 MiB puts, the slot copy about 1.6 us (putWithSignal at 64 MiB: 0.916 -> 0.953 of plain
/// `cuMemcpyDtoDAsync`; 256 MiB 0.972 -> 0.982; 16 MiB 0.694 -> 0.705), while after small puts the
/// stream memory operation is the faster signal (ping-pong 26.8 us against 29.6 us with slots).
const SLOT_TOKEN_AFTER: u64 = 16 << 20;
/// A kernel-copy limit above this gets a warning: one block copies far slower than the copy
/// engine once a copy is large.
const KERNEL_COPY_WARN: u64 = 1 << 20;
/// How long an operation past `max_write_queue_size` waits for the stream before failing.
const QUEUE_WAIT: Duration = Duration::from_secs(30);
/// How long the switch to event-recycled slots, or the reuse of one, may wait for the stream.
const SLOT_WAIT: Duration = Duration::from_secs(60);

struct IpcState {
    core: IpcCore,
    /// Allocated with the first token that needs a slot.
    slots: Option<SlotMem>,
    /// `cuStreamWriteValue64` is not supported here: tokens go through the slots.
    memops_missing: bool,
    /// The last operation enqueued is a copy of at least [`SLOT_TOKEN_AFTER`] bytes.
    after_large_copy: bool,
    /// Kernel copies through a lingering kernel (`cuda_ipc_kernel_copy_linger`; the connection
    /// then has a stream of its own).
    linger: Option<Linger>,
}

impl IpcState {
    /// Before anything but a kernel copy is enqueued: a lingering kernel is asked to leave, so
    /// that the operation runs after it, in stream order.
    fn plain(&mut self) -> Result<()> {
        match self.linger.as_mut() {
            Some(l) => l.stop(),
            None => Ok(()),
        }
    }

    /// A lingering kernel is the last work on the stream: completion is told by its mailbox.
    fn lingering(&self) -> Option<(Arc<Mailbox>, u64)> {
        self.linger.as_ref().filter(|l| l.armed()).map(|l| (l.mailbox(), l.posted()))
    }
}

pub(crate) struct CudaIpcConnection {
    dev: Arc<GpuDevice>,
    stream: Arc<Stream>,
    /// The first failure (shared with the peer watcher, which sets it when the peer exits).
    failed: Arc<Mutex<Option<Error>>>,
    state: Mutex<IpcState>,
    peer_desc: String,
    /// Completion marks for [`ConnectionImpl::progress`] (locked before `state`, never after).
    marks: Mutex<Marks>,
    /// Kernel copies (`EndpointConfig::cuda_ipc_kernel_copy_max`; `None`: off).
    kernel_copy: Option<KernelCopy>,
}

/// Copies of at most `max` bytes (and a token joined to one) go through the one-block kernel
/// `k`, loaded when the connection was made, or through the lingering kernel `linger`.
#[derive(Clone, Copy)]
struct KernelCopy {
    k: crate::platform::cuda::PutToken,
    max: u64,
    linger: Option<LingerKernel>,
}

/// Launches lingering copy kernels on a connection's stream.
struct OnStream<'a> {
    stream: &'a Stream,
    k: LingerKernel,
}

impl Launch for OnStream<'_> {
    fn launch(&self, mailbox: u64, generation: u64, seq: u64, idle_ns: u64, job: Job) -> Result<()> {
        self.stream.linger_copy(self.k, mailbox, generation, seq, idle_ns, job)
    }
    fn wait_idle(&self, timeout: Duration) -> Result<bool> {
        self.stream.wait_idle(timeout)
    }
}

/// Events recorded behind requested progress positions (or, while a copy kernel lingers, the
/// job numbers it must finish), oldest first, with the flush ticket each proves once it has
/// passed; and spare events to reuse.
#[derive(Default)]
struct Marks {
    pending: std::collections::VecDeque<(ring::FlushTicket, Mark)>,
    spare: Vec<Event>,
}

/// A completion mark: an event on the stream, or a lingering kernel's job number (with the
/// stream, asked when the job is not done: its errors are reported, not waited out).
enum Mark {
    Event(Event),
    Job(Arc<Mailbox>, u64, Arc<Stream>),
}

impl Mark {
    fn done(&self) -> Result<bool> {
        match self {
            Mark::Event(ev) => ev.done(),
            Mark::Job(m, seq, stream) => linger::job_done(m, *seq, || stream.idle()),
        }
    }
    fn wait(&self, deadline: Deadline) -> Result<bool> {
        match self {
            Mark::Event(ev) => ev.wait(deadline.remaining()),
            Mark::Job(m, seq, stream) => linger::wait_done(m, *seq, deadline, || stream.idle()),
        }
    }
    /// Keeps an event for reuse.
    fn recycle(self, spare: &mut Vec<Event>) {
        if let Mark::Event(ev) = self {
            spare.push(ev);
        }
    }
}

impl CudaIpcConnection {
    /// The kernel that copies `len` bytes (1 up to the kernel-copy limit), if any.
    fn kernel_for(&self, len: u64) -> Option<crate::platform::cuda::PutToken> {
        self.kernel_copy.filter(|c| len > 0 && len <= c.max).map(|c| c.k)
    }

    /// A kernel copy (`len` within the limit): posted to the lingering kernel where one waits;
    /// else, for a copy joined to its token (`arm`: a proxied putWithSignal, the latency-bound
    /// case), a new lingering kernel where the connection lingers; else one launch of the
    /// put-token kernel `k`. A lone write does not start a lingering kernel: a host thread's
    /// write, then signal, would start one only to stop it at once (and synchronous copies
    /// elsewhere in the program may wait for it to leave).
    fn kernel_copy(&self, st: &mut IpcState, k: crate::platform::cuda::PutToken, job: Job, arm: bool) -> Result<()> {
        st.after_large_copy = false;
        if let (Some(l), Some(lk)) = (st.linger.as_mut(), self.kernel_copy.and_then(|c| c.linger)) {
            let taken = l.copy(&OnStream { stream: &self.stream, k: lk }, job, arm);
            if let Err(e) = &taken {
                // A GPU too stuck to free a slot or to let a leaving kernel return (or a failed
                // launch): whether the copy will still run is unknown, so the connection is done.
                lock(&self.failed).get_or_insert_with(|| e.duplicate());
            }
            if taken? {
                return Ok(());
            }
        }
        // No lingering kernel took it (none waits, and this copy does not start one): after any
        // kernel still on the stream, in stream order.
        self.stream.put_token(k, job.dst, job.src, job.len, job.token, job.value)
    }

    fn check_failed(&self) -> Result<()> {
        match lock(&self.failed).as_ref() {
            Some(e) => Err(e.duplicate()),
            None => Ok(()),
        }
    }

    /// A CUDA error breaks the connection: keep it for every later call.
    fn record<T>(&self, r: Result<T>) -> Result<T> {
        // Internal: a lingering kernel that left a copy undone (or another broken invariant):
        // nothing later on the connection can be trusted either.
        if let Err(e) = &r
            && matches!(e.kind(), ErrorKind::Cuda | ErrorKind::Internal)
        {
            lock(&self.failed).get_or_insert_with(|| e.duplicate());
        }
        r
    }

    fn src_ptr(&self, src: &RegisteredMemory) -> Result<u64> {
        match src.local().map(|l| &l.mem) {
            Some(Mem::Gpu(g)) => Ok(g.ptr),
            _ => Err(Error::invalid_usage("the source of a CUDA IPC write must be local GPU memory")),
        }
    }

    /// Enqueues one operation with `op`, first waiting (locks released) while
    /// `max_write_queue_size` operations are in flight.
    ///
    /// The wait is for the oldest completion mark (an event recorded behind the operations its
    /// ticket counts), not for the whole stream to drain: a mark is recorded every half queue,
    /// so at the bound the copy engine still has about half a queue of work while the caller
    /// waits for the first half to finish. (Draining the stream at every bound, as before,
    /// stalled a proxy for the latency of the whole queue every `max_write_queue_size`
    /// operations and left the copy engine idle meanwhile.)
    fn issue(&self, op: impl FnOnce(&Self, &mut IpcState) -> Result<()>) -> Result<()> {
        self.check_failed()?;
        // Lock order: marks, then state (as `progress`).
        let mut m = lock(&self.marks);
        let mut st = lock(&self.state);
        let deadline = Deadline::after(QUEUE_WAIT);
        while !st.core.can_issue() {
            let Some((t, mark)) = m.pending.pop_front() else {
                // No mark yet: one behind everything enqueued so far.
                self.mark(&mut m, &mut st)?;
                continue;
            };
            drop(st);
            drop(m);
            let done = self.record(mark.wait(deadline));
            m = lock(&self.marks);
            st = lock(&self.state);
            match done {
                Ok(true) => {
                    st.core.flush_done(t);
                    mark.recycle(&mut m.spare);
                }
                Ok(false) | Err(_) => {
                    m.pending.push_front((t, mark));
                    done?;
                    if deadline.expired() {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "the write queue toward {} stayed full ({} operations in flight on GPU{}'s \
                                 stream, max_write_queue_size {}) for {QUEUE_WAIT:?}",
                                self.peer_desc,
                                st.core.outstanding(),
                                self.dev.ordinal,
                                st.core.max_queue()
                            ),
                        ));
                    }
                }
            }
        }
        let r = op(self, &mut st);
        if r.is_ok() {
            st.core.on_issued();
            if st.core.wants_mark()
                && m.pending.back().is_none_or(|(t, _)| t.issued() + st.core.mark_every() <= st.core.issued())
            {
                self.mark(&mut m, &mut st)?;
            }
        }
        self.record(r)
    }

    /// Records a completion mark behind everything enqueued so far: an event (a spare one, else
    /// new) and the flush ticket it proves once it has passed. Called with both locks held, so
    /// nothing is enqueued meanwhile and the event follows exactly the operations the ticket
    /// counts.
    fn mark(&self, m: &mut Marks, st: &mut IpcState) -> Result<()> {
        if let Some((mb, posted)) = st.lingering() {
            let t = st.core.begin_flush();
            m.pending.push_back((t, Mark::Job(mb, posted, self.stream.clone())));
            return Ok(());
        }
        let ev = match m.spare.pop() {
            Some(e) => e,
            None => self.record(Event::new(&self.dev))?,
        };
        let t = st.core.begin_flush();
        self.record(self.stream.record(&ev))?;
        m.pending.push_back((t, Mark::Event(ev)));
        Ok(())
    }

    /// Writes the token: by `cuStreamWriteValue64`, else (no stream memory operations, or right
    /// after a large copy) from a free pinned slot, else from an event-recycled slot (only
    /// without stream memory operations; with them, by `cuStreamWriteValue64`).
    fn write_token(&self, st: &mut IpcState, addr: u64, value: u64) -> Result<()> {
        // A stream memory operation first: the GPU's front end writes the value it carries, so
        // the token needs no PCIe read of pinned memory by a copy engine. Right after a large
        // copy, though, a pinned-slot copy follows it on the stream sooner (SLOT_TOKEN_AFTER).
        let after_large = std::mem::take(&mut st.after_large_copy);
        if !st.memops_missing && !after_large {
            if self.stream.write_value64(addr, value)? {
                return Ok(());
            }
            st.memops_missing = true;
        }
        if st.slots.is_none() {
            st.slots = Some(SlotMem::new(&self.dev)?);
        }
        let Some(mem) = st.slots.as_mut() else { return Err(Error::internal("token slots missing")) };
        match st.core.take_slot() {
            TokenSlot::Pinned(i) => {
                // The slot stays untouched until a flush that began after this hand-out completes.
                let p = mem.fill(i, value)?;
                self.stream.copy_htod(addr, p, 8)
            }
            TokenSlot::Event(i) => self.token_by_event(mem, i, addr, value),
            TokenSlot::WriteValue => {
                if self.stream.write_value64(addr, value)? {
                    return Ok(());
                }
                // No stream memory operations: slots handed out since the last flush may still
                // be read by pending copies, so drain before recycling them by events.
                if !self.stream.wait_idle(SLOT_WAIT)? {
                    return Err(Error::new(ErrorKind::Timeout, format!("the stream did not drain in {SLOT_WAIT:?}")));
                }
                st.core.enter_event_mode();
                match st.core.take_slot() {
                    TokenSlot::Event(i) => self.token_by_event(mem, i, addr, value),
                    _ => Err(Error::internal("event mode hands out event slots")),
                }
            }
        }
    }

    /// Copies the token from slot `i` once the event behind its last copy has passed, and
    /// records a new event behind this copy.
    fn token_by_event(&self, mem: &mut SlotMem, i: usize, addr: u64, value: u64) -> Result<()> {
        if let Some(ev) = &mem.events[i]
            && !ev.wait(SLOT_WAIT)?
        {
            return Err(Error::new(ErrorKind::Timeout, format!("a token slot's copy did not finish in {SLOT_WAIT:?}")));
        }
        let p = mem.fill(i, value)?;
        self.stream.copy_htod(addr, p, 8)?;
        let ev = match mem.events[i].take() {
            Some(e) => e,
            None => Event::new(&self.dev)?,
        };
        self.stream.record(&ev)?;
        mem.events[i] = Some(ev);
        Ok(())
    }
}

impl Drop for CudaIpcConnection {
    /// A lingering kernel is asked to leave, and its mailbox freed only once it is gone (kept
    /// for good when the stream does not drain).
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(l) = st.linger.as_mut() else { return };
        // Any kernel ever launched may still run (a stopped one until its next poll) or not have
        // started yet: the stream is the connection's own, so its draining says they are gone.
        let launched = l.launched_any();
        if l.stop().is_err() || (launched && !matches!(self.stream.wait_idle(LINGER_DROP_WAIT), Ok(true))) {
            tracing::warn!(
                target: "mscclpp::conn",
                "the lingering copy kernel toward {} did not return in {LINGER_DROP_WAIT:?}: its mailbox is kept",
                self.peer_desc
            );
            std::mem::forget(l.mailbox());
        }
    }
}

/// How long dropping a connection waits for its lingering copy kernel to return.
const LINGER_DROP_WAIT: Duration = Duration::from_secs(5);

impl ConnectionImpl for CudaIpcConnection {
    fn write(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        self.check_failed()?;
        let d = dst.gpu_ptr(&self.dev)?;
        let s = self.src_ptr(src)?;
        if len == 0 {
            return Ok(());
        }
        if let Some(k) = self.kernel_for(len) {
            let job = Job { dst: d + dst_off, src: s + src_off, len, token: 0, value: 0 };
            return self.issue(|c, st| c.kernel_copy(st, k, job, false));
        }
        self.issue(|c, st| {
            st.plain()?;
            st.after_large_copy = len >= SLOT_TOKEN_AFTER;
            c.stream.copy_dtod(d + dst_off, s + src_off, len)
        })
    }

    fn joined_write_max(&self) -> u64 {
        self.kernel_copy.map_or(0, |c| c.max)
    }

    /// A copy of at most the kernel-copy limit and its token: one kernel, one operation.
    fn try_write_and_update(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
        tok: (&RegisteredMemory, u64),
        _old: u64,
        new: u64,
    ) -> Result<bool> {
        let Some(k) = self.kernel_for(len) else { return Ok(false) };
        self.check_failed()?;
        let d = dst.gpu_ptr(&self.dev)? + dst_off;
        let s = self.src_ptr(src)? + src_off;
        let t = tok.0.gpu_ptr(&self.dev)? + tok.1;
        let job = Job { dst: d, src: s, len, token: t, value: new };
        self.issue(|c, st| c.kernel_copy(st, k, job, true))?;
        Ok(true)
    }

    fn update_and_sync(&self, dst: &RegisteredMemory, dst_off: u64, _old: u64, new: u64) -> Result<()> {
        self.check_failed()?;
        let addr = dst.gpu_ptr(&self.dev)? + dst_off;
        self.issue(|c, st| {
            st.plain()?;
            c.write_token(st, addr, new)
        })
    }

    fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
        self.check_failed()?;
        let addr = dst.gpu_ptr(&self.dev)? + dst_off;
        self.issue(|c, st| {
            st.plain()?;
            st.after_large_copy = false;
            c.stream.atomic_add(addr, value as u64)
        })
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.check_failed()?;
        let deadline = Deadline::after(timeout);
        // With lingering: the mailbox while a kernel lingers (it is the last work on the stream:
        // everything before its jobs has run once it finished them), else an event recorded
        // behind the ticket's operations (draining the stream could wait for a kernel another
        // thread starts meanwhile, up to its linger time or for as long as copies keep coming).
        enum Until {
            Idle,
            Job(Arc<Mailbox>, u64),
            Event(Event),
        }
        let (ticket, until) = {
            let mut m = lock(&self.marks);
            let st = lock(&self.state);
            let ticket = st.core.begin_flush();
            let until = match (st.lingering(), st.linger.is_some()) {
                (Some((mb, posted)), _) => Until::Job(mb, posted),
                (None, true) => {
                    let ev = match m.spare.pop() {
                        Some(e) => e,
                        None => self.record(Event::new(&self.dev))?,
                    };
                    self.record(self.stream.record(&ev))?;
                    Until::Event(ev)
                }
                (None, false) => Until::Idle,
            };
            (ticket, until)
        };
        let r = match &until {
            Until::Job(m, posted) => linger::wait_done(m, *posted, deadline, || self.stream.idle()),
            Until::Event(ev) => ev.wait(deadline.remaining()),
            Until::Idle => self.stream.wait_idle(timeout),
        };
        if let Until::Event(ev) = until {
            lock(&self.marks).spare.push(ev);
        }
        if self.record(r)? {
            lock(&self.state).core.flush_done(ticket);
            return Ok(());
        }
        let left = lock(&self.state).core.outstanding();
        Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "{left} operations on GPU{}'s stream toward {} not finished after {timeout:?}",
                self.dev.ordinal, self.peer_desc
            ),
        )
        .with_outstanding(left))
    }

    fn failure(&self) -> Option<Error> {
        lock(&self.failed).as_ref().map(Error::duplicate)
    }

    fn max_write_queue_size(&self) -> usize {
        lock(&self.state).core.max_queue()
    }

    fn outstanding(&self) -> u64 {
        lock(&self.state).core.outstanding()
    }

    /// Completion from events recorded behind requested positions (so it advances under
    /// continuous traffic; a passed event also frees the token slots its ticket covers, as a
    /// flush does) and, without a request, from an idle stream; nothing blocks.
    fn progress(&self, request: bool) -> Result<super::Progress> {
        self.check_failed()?;
        let mut m = lock(&self.marks);
        while let Some((t, mark)) = m.pending.front() {
            if !self.record(mark.done())? {
                break;
            }
            let t = *t;
            lock(&self.state).core.flush_done(t);
            if let Some((_, mark)) = m.pending.pop_front() {
                mark.recycle(&mut m.spare);
            }
        }
        let mut st = lock(&self.state);
        let (issued, completed) = (st.core.issued(), st.core.completed());
        if completed >= issued {
            return Ok(super::Progress { issued, completed });
        }
        if request {
            if m.pending.back().is_none_or(|(t, _)| t.issued() < issued) {
                self.mark(&mut m, &mut st)?;
            }
        } else if m.pending.is_empty() {
            let t = st.core.begin_flush();
            let lingering = st.lingering();
            drop(st);
            // Everything enqueued before the query has run (the stream may carry other
            // connections' work too: completion is then only seen later, never early). With a
            // lingering kernel at the end of the stream, its mailbox tells.
            let idle = match lingering {
                Some((mb, posted)) => linger::job_done(&mb, posted, || self.stream.idle()),
                None => self.stream.idle(),
            };
            if self.record(idle)? {
                st = lock(&self.state);
                st.core.flush_done(t);
                return Ok(super::Progress { issued, completed: st.core.completed() });
            }
            return Ok(super::Progress { issued, completed });
        }
        Ok(super::Progress { issued, completed })
    }
}

/// How often the peer watcher looks whether its connection is still there.
const WATCH_PERIOD: Duration = Duration::from_millis(500);

/// Starts a thread that fails the connection (`failed`) when the peer process `pid` exits, and
/// ends once the connection is gone. Does nothing (with a debug line) where the peer is not
/// that pid in this pid namespace, or pidfds are missing.
fn watch_peer(pid: u32, start: u64, peer_hash: u64, failed: &Arc<Mutex<Option<Error>>>, peer: &str, ctx: &Context) {
    const LOG: &str = "mscclpp::conn";
    if crate::identity::process_hash_of(pid) != peer_hash {
        tracing::debug!(target: LOG, "{peer} (pid {pid}) is in another pid namespace: its exit is not watched");
        return;
    }
    let fd = match crate::platform::pidfd::PidFd::open(pid, Some(start).filter(|s| *s != 0)) {
        Ok(fd) => fd,
        Err(e) if e.kind() == ErrorKind::Remote => {
            // Already gone: fail at once.
            lock(failed).get_or_insert_with(|| peer_exited(peer, pid));
            return;
        }
        Err(e) => {
            tracing::debug!(target: LOG, "{peer}'s exit is not watched: {e}");
            return;
        }
    };
    let weak = Arc::downgrade(failed);
    let ctx = Arc::downgrade(ctx.inner());
    let name = peer.to_string();
    let spawned = std::thread::Builder::new().name("mscclpp-ipc-watch".into()).stack_size(64 << 10).spawn(move || {
        loop {
            let exited = match fd.wait_exit(WATCH_PERIOD) {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(target: LOG, "watching {name}: {e}");
                    return;
                }
            };
            let Some(failed) = weak.upgrade() else { return };
            if exited {
                tracing::debug!(target: LOG, "{name} (pid {pid}) exited");
                lock(&failed).get_or_insert_with(|| peer_exited(&name, pid));
                // Wake host-side semaphore waits, so they see the failure now.
                if let Some(c) = ctx.upgrade() {
                    c.notify_tokens();
                }
                return;
            }
        }
    });
    if let Err(e) = spawned {
        tracing::debug!(target: LOG, "{peer}'s exit is not watched: no thread: {e}");
    }
}

fn peer_exited(peer: &str, pid: u32) -> Error {
    Error::remote(format!(
        "{peer} (process {pid}) exited: its GPU memory is no longer a live peer's, CUDA IPC operations toward it \
         are refused"
    ))
}

/// Builds a CUDA IPC connection.
pub(crate) fn connect(ctx: &Context, local: &Endpoint, remote: &Endpoint, peer: Option<usize>) -> Result<Connection> {
    let Device::Gpu(ordinal) = local.device() else {
        return Err(Error::invalid_usage("a CUDA IPC connection needs a GPU as its local device"));
    };
    if remote.host_hash() != local.host_hash() {
        return Err(Error::invalid_usage("CUDA IPC connects ranks on one host; the peer is on another"));
    }
    let dev = crate::platform::cuda::device(ordinal)?;
    if remote.process_hash() == local.process_hash()
        && let Device::Gpu(r) = remote.device()
    {
        // Same process, another GPU: the pointer path needs peer access.
        let rdev = crate::platform::cuda::device(r)?;
        dev.enable_peer_access(&rdev)?;
    }
    let kernel_copy_max = match local.local().and_then(|l| l.config.cuda_ipc_kernel_copy_max) {
        Some(b) => b,
        None => crate::env::env()?.cudaipc_kernel_copy_max.unwrap_or(0),
    };
    let linger_for = match local.local().and_then(|l| l.config.cuda_ipc_kernel_copy_linger) {
        Some(d) => d,
        None => crate::env::env()?.cudaipc_kernel_copy_linger.unwrap_or(Duration::ZERO),
    };
    if !linger_for.is_zero() && kernel_copy_max == 0 {
        tracing::warn!(
            target: "mscclpp::conn",
            "cuda_ipc_kernel_copy_linger is set but cuda_ipc_kernel_copy_max is 0: no copy goes through a kernel, \
             so none lingers"
        );
    }
    if linger_for > linger::MAX_LINGER {
        tracing::warn!(
            target: "mscclpp::conn",
            "cuda_ipc_kernel_copy_linger is {linger_for:?}: copy kernels linger at most {:?}",
            linger::MAX_LINGER
        );
    }
    let lingers = !linger_for.is_zero() && kernel_copy_max > 0;
    // A lingering kernel is the last work on its stream while it waits: the connection gets a
    // stream of its own, so other connections' work never queues behind it.
    let stream =
        if lingers { Arc::new(crate::context::new_ipc_stream(&dev)?) } else { ctx.inner().cuda_stream(&dev)? };
    // Loaded now: loading it at the first copy, while a kernel that waits for it spins, could
    // wait for the GPU.
    let kernel_copy = if kernel_copy_max > 0 {
        Some(KernelCopy {
            k: crate::platform::cuda::load_put_token(&dev)?,
            max: kernel_copy_max,
            linger: if lingers { Some(crate::platform::cuda::linger::load_linger(&dev)?) } else { None },
        })
    } else {
        None
    };
    let linger = if lingers { Some(Linger::new(Mailbox::gpu(&dev)?, linger_for)) } else { None };
    if kernel_copy_max > KERNEL_COPY_WARN {
        tracing::warn!(
            target: "mscclpp::conn",
            "cuda_ipc_kernel_copy_max is {kernel_copy_max} bytes: copies that large go through one block of one SM \
             (slower than the copy engine past a few hundred KiB)"
        );
    }
    let peer_desc = match peer {
        Some(p) => format!("rank {p}"),
        None => "the peer".to_string(),
    };
    let failed = Arc::new(Mutex::new(None));
    if remote.process_hash() != local.process_hash()
        && let Some((pid, start)) = remote.owner_process()
    {
        watch_peer(pid, start, remote.process_hash(), &failed, &peer_desc, ctx);
    }
    let conn = CudaIpcConnection {
        dev,
        stream,
        failed,
        state: Mutex::new(IpcState {
            core: IpcCore::new(local.max_write_queue_size(), SLOTS),
            slots: None,
            memops_missing: false,
            after_large_copy: false,
            linger,
        }),
        peer_desc: peer_desc.clone(),
        marks: Mutex::new(Marks::default()),
        kernel_copy,
    };
    if kernel_copy_max > 0 {
        tracing::info!(
            target: "mscclpp::conn",
            "CUDA IPC connection to {peer_desc}: copies of at most {kernel_copy_max} bytes (and a signal after one) \
             go through a kernel on GPU{ordinal}, which needs a free SM{}",
            if lingers { format!("; the kernel stays {linger_for:?} after each copy for the next one") } else { String::new() }
        );
    }
    Ok(Connection::from_inner(ConnInner {
        imp: Box::new(conn),
        transport: Transport::CudaIpc,
        remote_transport: Transport::CudaIpc,
        device: local.device(),
        context: ctx.clone(),
        peer,
        peer_desc,
    }))
}
