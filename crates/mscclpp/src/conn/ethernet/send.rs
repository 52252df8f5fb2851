//! The sending side of a connection: queueing operations (bounded by the sender core), sending
//! them in batches (from the calling thread when it can, from the sender thread otherwise), and
//! reading the peer's acknowledgements and refusals.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::connection::{Shared, State};
use super::core::{Batch, Op, QueueFull};
use super::stager::{self, GATHER_MAX, StageError, Stager, stager_for};
use super::wire::{self, Lane, Record};
use super::{COALESCE_GRACE, INLINE_LIMIT, TX_LINGER, TX_TICK};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{LocalRegion, Mem};
use crate::platform::hostmem::{IoPart, Region, send_all, send_vectored};
use crate::sync::{Deadline, lock};
use crate::wire::WireForm;

/// A write's payload source on this side: a local registered region.
pub(super) type Src = Arc<LocalRegion>;

/// How long a blocked send (the peer takes no byte) or a blocked read of a frame's remaining
/// bytes waits before the connection fails: the configured wait limit, at least 1 s.
pub(super) fn stall_limit(wait_limit: Duration) -> Duration {
    wait_limit.max(Duration::from_secs(1))
}

/// Batches up to this many bytes (headers and payloads) go through [`Shared::send_small`].
const SMALL_BATCH: usize = 256;

/// Whether the calling thread may send `op` (the sender thread sends larger writes and
/// everything staged from GPU memory).
pub(super) fn inline(op: &Op<Src>) -> bool {
    match op {
        Op::Write { src, len, .. } => *len <= INLINE_LIMIT && matches!(src.mem, Mem::Host(_)),
        _ => true,
    }
}

/// This side's two outgoing sockets, for the frames of each lane.
pub(super) struct OutLanes {
    pub(super) shared: TcpStream,
    pub(super) own: TcpStream,
}

impl OutLanes {
    fn get(&mut self, lane: Lane) -> &mut TcpStream {
        match lane {
            Lane::Shared => &mut self.shared,
            Lane::Own => &mut self.own,
        }
    }
}

/// What the sender thread is doing, so that queueing an operation wakes it only when it must.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tx {
    /// Sending, or about to look at the queue.
    Busy,
    /// Idle but lingering: it looks at the queue every [`TX_TICK`] on its own.
    Ticking,
    /// Asleep until woken.
    Asleep,
}

impl Shared {
    /// Queues `op`, waiting while the queue bound is reached (up to the wait limit in all);
    /// small operations are sent by the calling thread when the sender thread is not sending.
    pub(super) fn enqueue(&self, op: Op<Src>) -> Result<()> {
        self.enqueue_within(op, self.wait_limit)
    }

    /// [`enqueue`](Self::enqueue) with its own bound on a full queue (a flush's timeout).
    pub(super) fn enqueue_within(&self, op: Op<Src>, limit: Duration) -> Result<()> {
        let inline = inline(&op);
        let deferred = inline && matches!(op, Op::Write { .. });
        let mut st = lock(&self.st);
        // The bound starts when the queue is first found full.
        let mut deadline: Option<Deadline> = None;
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
                    let d = *deadline.get_or_insert_with(|| Deadline::after(limit));
                    if d.expired() {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "write queue full: {outstanding} operations outstanding at {} and none confirmed for {:?}",
                                self.peer_desc, limit
                            ),
                        ));
                    }
                    let t0 = Instant::now();
                    st = self
                        .cond
                        .wait_timeout(st, d.remaining().min(Duration::from_millis(100)))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                    stager::timed(stager::T_QUEUE_FULL, t0);
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
        if inline {
            // Send from this thread when no other is sending: the first batch is taken under the
            // state lock already held (`out` is only tried here, never waited for, so the
            // other order elsewhere cannot deadlock).
            if let Ok(mut out) = self.out.try_lock()
                && let Some(out) = out.as_mut()
            {
                let first = take_batch(&mut st, true);
                drop(st);
                if self.pump(out, true, Some(first)) {
                    // The queue was empty after this thread's last batch: an operation queued
                    // since then was looked after by its own caller (whose `try_lock` failed).
                    return Ok(());
                }
            } else {
                drop(st);
            }
        } else {
            drop(st);
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

    /// Sends queued operations in order, a batch per `sendmsg` (on the batch's lane, after the
    /// lane switch on the other one if the lane changes). With `inline_only` (the calling
    /// thread), stops at the first operation only the sender thread sends.
    ///
    /// Returns true when it left the queue empty (after its last batch; a failure counts as
    /// empty: nothing more is sent).
    fn pump(&self, out: &mut OutLanes, inline_only: bool, first: Option<(Batch<Src>, bool)>) -> bool {
        let mut first = first;
        loop {
            let (batch, idle) = match first.take() {
                Some(b) => b,
                None => take_batch(&mut lock(&self.st), inline_only),
            };
            if batch.is_empty() {
                return idle;
            }
            // When a batch that asks for acknowledgements began (for the acknowledgement loop's
            // benchmark counters).
            let asked = batch.frames.iter().any(|(h, _)| h.ack).then(Instant::now);
            if let Err(e) = self.send_batch(out, &batch) {
                // The peer closed its end (its closing record, if any, is still on its way to the
                // acknowledgement reader): a close, not a failure that voids what it acknowledged.
                let closed =
                    matches!(e.io_kind(), Some(std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset));
                self.fail_with(e, !closed);
                return true;
            }
            if let Some(t0) = asked {
                note_asks(&mut lock(&self.st), &batch, t0);
            }
            if idle {
                return true;
            }
        }
    }

    /// Sends one batch: host payloads straight from their regions in one `sendmsg`; GPU
    /// payloads staged through pinned memory, the copy of one chunk overlapping the send of the
    /// previous one.
    fn send_batch(&self, out: &mut OutLanes, batch: &Batch<Src>) -> Result<()> {
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
        if let Some(lead) = &batch.lead {
            send_vectored(out.get(batch.lane.other()), &[lead.encode()[..].into()]).map_err(io_err)?;
        }
        let out = out.get(batch.lane);
        if let Some(r) = self.send_small(out, batch) {
            return r.map_err(io_err);
        }
        let headers: Vec<[u8; wire::HEADER]> = batch.frames.iter().map(|(h, _)| h.encode()).collect();
        let tail = batch.tail.map(|h| h.encode());
        // What goes out, in order: host payloads straight from their regions, small GPU payloads
        // from the gather buffer of their GPU's stager (copied there as they come, waited for
        // once before the pieces go out), large GPU payloads through the stager's pipeline.
        let mut pieces: Vec<Piece<'_>> = Vec::with_capacity(2 * batch.frames.len() + 1);
        // The stagers (taken once the batch has GPU payloads), and the GPU whose gather buffer
        // holds payloads in `pieces`.
        let mut stagers = None;
        let mut gathering: Option<u32> = None;
        let stage_err = |e: StageError| match e {
            StageError::Io(e) => io_err(e),
            StageError::Mscclpp(e) => e,
        };
        for ((_, op), h) in batch.frames.iter().zip(&headers) {
            let Op::Write { src, src_off, len, .. } = op else {
                pieces.push(Piece::Bytes(&h[..]));
                continue;
            };
            let g = match &src.mem {
                Mem::Host(r) => {
                    pieces.push(Piece::Bytes(&h[..]));
                    pieces.push(Piece::Host(r, *src_off, *len));
                    continue;
                }
                Mem::Gpu(g) => g,
            };
            let map = stagers.get_or_insert_with(|| lock(&self.stagers));
            if *len > GATHER_MAX {
                // Everything before it and its header go out, then its payload through the
                // pipeline (which takes both buffers).
                pieces.push(Piece::Bytes(&h[..]));
                send_pieces(out, &pieces, map, gathering.take()).map_err(stage_err)?;
                pieces.clear();
                stager_for(map, g)?.send(out, g, *src_off, *len).map_err(stage_err)?;
                continue;
            }
            let dev = g.dev.ordinal;
            if gathering.is_some_and(|d| d != dev) || !stager_for(map, g)?.room_for(*len) {
                // What was gathered goes out first (one GPU's at a time, as much as a buffer
                // holds).
                send_pieces(out, &pieces, map, gathering.take()).map_err(stage_err)?;
                pieces.clear();
            }
            let pick = stager_for(map, g)?.gather(g, *src_off, *len)?;
            pieces.push(Piece::Bytes(&h[..]));
            pieces.push(Piece::Staged(pick));
            gathering = Some(dev);
        }
        if let Some(t) = &tail {
            pieces.push(Piece::Bytes(&t[..]));
        }
        match stagers.as_mut() {
            Some(map) => send_pieces(out, &pieces, map, gathering).map_err(stage_err),
            None => send_pieces(out, &pieces, &mut HashMap::new(), None).map_err(stage_err),
        }
    }
}

/// One piece of a batch on the wire: a header (or the tail), a host payload (region, offset,
/// length), or a gathered GPU payload (its number in the gathering stager).
enum Piece<'b> {
    Bytes(&'b [u8]),
    Host(&'b Region, u64, u64),
    Staged(usize),
}

/// Sends `pieces` in one `sendmsg`, after waiting for the copies of the payloads gathered on
/// GPU `gathering`'s stager (whose buffers are free again afterwards).
fn send_pieces(
    out: &TcpStream,
    pieces: &[Piece<'_>],
    stagers: &mut HashMap<u32, Stager>,
    gathering: Option<u32>,
) -> std::result::Result<(), StageError> {
    if pieces.is_empty() {
        return Ok(());
    }
    let st = match gathering {
        Some(dev) => {
            let st = stagers
                .get_mut(&dev)
                .ok_or_else(|| Error::internal(format!("no stager for GPU {dev} holding gathered payloads")))?;
            st.gathered()?;
            Some(&*st)
        }
        None => None,
    };
    let mut parts: Vec<IoPart<'_>> = Vec::with_capacity(pieces.len());
    for p in pieces {
        parts.push(match *p {
            Piece::Bytes(b) => b.into(),
            Piece::Host(r, off, len) => r.part(off, len)?,
            Piece::Staged(pick) => {
                st.ok_or_else(|| Error::internal("a gathered payload without its stager"))?.part(pick)?
            }
        });
    }
    let t0 = Instant::now();
    send_vectored(out, &parts)?;
    if st.is_some() {
        stager::timed(stager::T_SEND, t0);
    }
    if let Some(dev) = gathering
        && let Some(st) = stagers.get_mut(&dev)
    {
        st.settle()?;
    }
    Ok(())
}

impl Shared {
    /// A batch of at most [`SMALL_BATCH`] bytes from host memory (a small write and its signal)
    /// gathered into one buffer, headers and payloads, and sent with one `send`; `None` (nothing
    /// sent) for any other batch.
    fn send_small(&self, out: &TcpStream, batch: &Batch<Src>) -> Option<std::io::Result<()>> {
        let mut total = usize::from(batch.tail.is_some()) * wire::HEADER;
        for (_, op) in &batch.frames {
            if let Op::Write { src, .. } = op
                && !matches!(src.mem, Mem::Host(_))
            {
                return None;
            }
            total += wire::HEADER + usize::try_from(op.payload()).ok()?;
            if total > SMALL_BATCH {
                return None;
            }
        }
        let mut buf = [0u8; SMALL_BATCH];
        let mut n = 0usize;
        for (h, op) in &batch.frames {
            put(&mut buf, &mut n, &h.encode())?;
            if let Op::Write { src, src_off, len, .. } = op
                && let Mem::Host(r) = &src.mem
            {
                let len = usize::try_from(*len).ok()?;
                let dst = buf.get_mut(n..n.checked_add(len)?)?;
                // The range was checked when the write was issued; should this fail, nothing
                // was sent yet and the general path reports it.
                r.read(*src_off, dst).ok()?;
                n += len;
            }
        }
        if let Some(t) = &batch.tail {
            put(&mut buf, &mut n, &t.encode())?;
        }
        Some(send_all(out, buf.get(..n).unwrap_or_default()))
    }
}

/// Appends `bytes` to `buf` at `*n`; `None` if they do not fit.
fn put(buf: &mut [u8], n: &mut usize, bytes: &[u8]) -> Option<()> {
    buf.get_mut(*n..n.checked_add(bytes.len())?)?.copy_from_slice(bytes);
    *n += bytes.len();
    Some(())
}

/// Takes the next batch (see [`super::core::SenderCore::next_batch`]) and whether the queue is empty after
/// it; nothing once the connection has failed (which counts as empty: nothing more is sent).
fn take_batch(st: &mut State, inline_only: bool) -> (Batch<Src>, bool) {
    if st.failed.is_some() {
        return (Batch::empty(), true);
    }
    let b = st.core.next_batch(|op| !inline_only || inline(op));
    let idle = st.core.is_idle();
    if idle {
        st.held_since = None;
    }
    (b, idle)
}

pub(super) fn sender_loop(sh: Arc<Shared>) {
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
        match out.as_mut() {
            Some(out) => {
                sh.pump(out, false, None);
            }
            // The high side's frame socket is the accepted one: the receiver thread installs it.
            None => {
                drop(out);
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(TX_TICK);
            }
        }
    }
}

/// Reads acknowledgements and refusals from the record socket and hands them to the core,
/// until the socket ends; then says so (a flush waiting on a closed connection may decide).
pub(super) fn ack_loop(sh: Arc<Shared>, s: TcpStream) {
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
        let r = {
            let mut st = lock(&sh.st);
            let r = st.core.handle_bytes(&buf[..n]);
            note_acks(&mut st);
            r
        };
        if let Err(why) = r {
            sh.fail_stated(Error::remote(format!("peer {} {why}", sh.peer_desc)));
            return;
        }
        sh.cond.notify_all();
    }
}

/// Most asks [`State::asks`] keeps (a flush probes once per call; asks beyond this many
/// unanswered are not timed).
const ASKS_KEPT: usize = 64;

/// `batch`, with frames that ask for an acknowledgement, went out; it began at `t0` (its
/// gather from the GPU and its `sendmsg` are part of the loop). Answers may be back already.
fn note_asks(st: &mut State, batch: &Batch<Src>, t0: Instant) {
    for (h, _) in batch.frames.iter().filter(|(h, _)| h.ack) {
        if st.asks.len() < ASKS_KEPT {
            st.asks.push_back((h.seq, t0));
        }
    }
    note_acks(st);
}

/// The asks that what the peer acknowledged so far answers count, with their wait
/// (`stager::C_ACKS`, `stager::T_ACK_WAIT`).
fn note_acks(st: &mut State) {
    let applied = st.core.applied();
    let mut n = 0;
    while let Some(&(seq, t0)) = st.asks.front() {
        if seq > applied {
            break;
        }
        st.asks.pop_front();
        stager::timed(stager::T_ACK_WAIT, t0);
        n += 1;
    }
    if n > 0 {
        stager::count_n(stager::C_ACKS, n);
    }
}

pub(super) fn send_record(s: &TcpStream, rec: &Record) -> std::io::Result<()> {
    let mut w = s;
    w.write_all(&rec.to_wire())
}
