//! The receiving side of a connection: the peer's frames applied as the receiver core directs,
//! by the receiver thread or by a thread waiting for a signal, whichever gets there first.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::net::Shutdown;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::LOG;
use super::acceptor::Acceptor;
use super::connection::Shared;
use super::core::{ReceiverCore, RegionInfo, RxEvent};
use super::send::{OutLanes, send_record, stall_limit};
use super::stager::{C_TOKENS, DRY_GRACE, GATHER_MAX, GpuToken, StageError, Stager, count_n, stager_for};
use super::wire::{Lane, Record};
use crate::context::ContextInner;
use crate::error::{Error, ErrorKind};
use crate::memory::{LocalRegion, Mem};
use crate::sync::{Deadline, lock};
use crate::transport::Transport;

/// While a waiting thread polled the socket itself (`poll_incoming`) this recently, the receiver
/// thread keeps away from it (two readers of one socket only contend), and naps: each wake-up
/// takes a CPU from a spinning waiter on a small machine.
const RX_DEFER: Duration = Duration::from_millis(1);
/// The receiver thread's nap doubles from [`RX_DEFER`] up to this while waiters keep polling
/// (a waiter that stops polling without its signal wakes it at once; frames that come after a
/// waiter returned, with no waiter polling, wait at most this long).
const RX_NAP_MAX: Duration = Duration::from_millis(8);
/// How often a blocked receiver thread looks at the stop flag.
const RX_STOP_CHECK: Duration = Duration::from_millis(100);

/// The receiver's socket: reads never block (`MSG_DONTWAIT`); "nothing yet" is `WouldBlock`.
/// The receiver thread waits for data with `poll`, outside the receiver's lock, so that a
/// waiting thread (`poll_incoming`) may apply what arrived in the meantime.
pub(super) struct RxSocket {
    pub(super) sock: TcpStream,
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
#[cfg(test)]
fn region_info(ctx: &ContextInner, id: u64) -> Option<RegionInfo<Arc<LocalRegion>>> {
    info_of(ctx.lookup_region(id)?)
}

/// The last two regions frames named, by id, held weakly (see [`region_info_cached`]).
type RegionCache = RefCell<[Option<(u64, Weak<LocalRegion>)>; 2]>;

/// [`region_info`] through a two-entry cache of the last regions looked up (a ping-pong names
/// the same two regions, data and token, over and over). The cache holds a weak reference: a
/// region dropped since (which is what deregisters it) fails to upgrade, and the lookup then
/// goes to the context's table, which no longer has it either.
fn region_info_cached(ctx: &ContextInner, cache: &RegionCache, id: u64) -> Option<RegionInfo<Arc<LocalRegion>>> {
    let mut c = cache.borrow_mut();
    for (cid, w) in c.iter().flatten() {
        if *cid == id
            && let Some(r) = w.upgrade()
        {
            return info_of(r);
        }
    }
    let r = ctx.lookup_region(id)?;
    // The newest first; the older of the two goes.
    c.swap(0, 1);
    c[0] = Some((id, Arc::downgrade(&r)));
    info_of(r)
}

fn info_of(r: Arc<LocalRegion>) -> Option<RegionInfo<Arc<LocalRegion>>> {
    Some(RegionInfo {
        addr: r.mem.addr(),
        len: r.mem.len(),
        ethernet: r.transports.has(Transport::Ethernet),
        handle: r,
    })
}

/// The receiving half's state, behind a lock: the receiver thread applies frames with it, and so
/// may a thread waiting for a signal (`poll_incoming`), whichever gets there first.
pub(super) struct RxState {
    /// The peer's frames: on the shared lane, and on its own lane (large writes).
    shared: BufReader<RxSocket>,
    own: BufReader<RxSocket>,
    /// The lane the next frame comes on (both sides start on the shared one).
    lane: Lane,
    /// The peer's own lane, this way: acknowledgements and refusals go out on it.
    rec: TcpStream,
    pub(super) core: ReceiverCore,
    /// The region of the write being received.
    cur: Option<Arc<LocalRegion>>,
    /// The last two regions frames named (see [`region_info_cached`]).
    regions: RegionCache,
    pub(super) stagers: HashMap<u32, Stager>,
    pub(super) ctx: Arc<ContextInner>,
    /// The connection is over on this side (failed or closed): nothing more is read.
    pub(super) done: bool,
    /// No frame failed to apply or was refused: what `core` counts as applied may be
    /// acknowledged on closing.
    applied_all: bool,
    /// When the last drain took input (see [`Stager::issue_when_dry`]).
    input_at: Instant,
    /// Tokens for GPU words held while more input was buffered behind them.
    held: HeldTokens<Arc<LocalRegion>>,
}

/// Most distinct updates held at once (consecutive tokens to one word count as one).
const HOLD_MAX_UPDATES: usize = 64;
/// Most tokens held at once.
const HOLD_MAX_TOKENS: u64 = 4096;

/// Tokens for GPU words of one GPU that arrived with more of the peer's input already buffered
/// behind them. A token to GPU memory costs a round trip to the GPU (queue the update after the
/// copies before it, wait for the stream); tokens that arrive faster than that pile up in the
/// socket, and applying each alone makes the receiver fall further behind. Held ones are applied
/// in one round: queued in order after every copy received before the last of them, one wait.
///
/// Each token's promise still holds: every write before it has landed when it becomes visible
/// (they land before the round's updates, in stream order, or are waited for on other GPUs), and
/// tokens become visible in the order they came (consecutive updates of one word merge into one,
/// which skips only the intermediate values). Writes that came after a held token may land
/// before it becomes visible (never a write to a word it updates: that applies the held tokens
/// first), which no reader can tell from their landing just after it; a write rewriting exactly
/// the bytes of an earlier one may then replace it with a token between them (the earlier bytes
/// were overwritten before the token became visible). Holding is bounded by the input already
/// here: the held tokens are applied before the receiver reads the socket again, before
/// anything that may block on it (a write whose payload is not all buffered, a large write),
/// before a token to host memory or another GPU, before an acknowledgement, and when
/// [`HOLD_MAX_UPDATES`] or [`HOLD_MAX_TOKENS`] is reached.
pub(super) struct HeldTokens<R> {
    /// The GPU they are all for.
    dev: Option<u32>,
    /// The updates in arrival order.
    updates: Vec<GpuToken>,
    /// The region of every token folded in, first to last: kept alive until the round that
    /// applies them has finished (the memory may not be freed under a queued update).
    regions: Vec<R>,
}

impl<R: Clone> HeldTokens<R> {
    pub(super) fn new() -> Self {
        HeldTokens { dev: None, updates: Vec::new(), regions: Vec::new() }
    }

    /// The GPU the held tokens are for, if any are held.
    pub(super) fn dev(&self) -> Option<u32> {
        self.dev
    }

    /// Adds a token for GPU `dev` (the caller applies what is held first when it is another
    /// GPU's); one to the word the last update is for merges into it.
    pub(super) fn push(&mut self, dev: u32, region: &R, t: GpuToken) {
        debug_assert!(self.dev.is_none_or(|d| d == dev));
        self.dev = Some(dev);
        self.regions.push(region.clone());
        match self.updates.last_mut() {
            Some(last) if last.addr == t.addr => *last = last.then(t),
            _ => self.updates.push(t),
        }
    }

    /// Whether none are held.
    pub(super) fn is_empty(&self) -> bool {
        self.dev.is_none()
    }

    /// Whether a held update is for a word overlapping GPU bytes [`start`, `end`).
    pub(super) fn touches(&self, start: u64, end: u64) -> bool {
        self.updates.iter().any(|t| t.addr < end && start < t.addr + 8)
    }

    /// Whether no more may be held.
    pub(super) fn is_full(&self) -> bool {
        self.updates.len() >= HOLD_MAX_UPDATES || self.regions.len() as u64 >= HOLD_MAX_TOKENS
    }

    /// Takes what is held: the regions of the tokens (the first token's first) and the updates
    /// in order.
    pub(super) fn take(&mut self) -> Option<(Vec<R>, Vec<GpuToken>)> {
        self.dev.take()?;
        Some((std::mem::take(&mut self.regions), std::mem::take(&mut self.updates)))
    }
}

/// Applies the held tokens in one round (see [`HeldTokens`]): first every copy received for
/// other GPUs is waited for, then the updates go on their GPU's stream after its copies, and one
/// wait covers them all. Returns whether any were applied (waiters should look again).
fn apply_held(
    held: &mut HeldTokens<Arc<LocalRegion>>,
    stagers: &mut HashMap<u32, Stager>,
) -> std::result::Result<bool, StageError> {
    let Some((regions, updates)) = held.take() else { return Ok(false) };
    let res = match regions.first().map(|r| &r.mem) {
        Some(Mem::Gpu(g)) => settle(stagers, Some(g.dev.ordinal))
            .and_then(|()| stager_for(stagers, g))
            .and_then(|st| st.tokens_at(&updates)),
        _ => Err(Error::internal("held tokens for memory that is not a GPU's")),
    };
    if res.is_err() {
        // An update may still be queued (a round that timed out): its memory is never freed
        // under it (the connection has failed; the regions are leaked, as the stager's buffers).
        std::mem::forget(regions);
    }
    res.map(|()| true).map_err(StageError::from)
}

/// [`apply_held`], then tells the context's token waiters to look again if any were applied.
fn apply_held_notifying(
    held: &mut HeldTokens<Arc<LocalRegion>>,
    stagers: &mut HashMap<u32, Stager>,
    ctx: &ContextInner,
) -> std::result::Result<(), StageError> {
    if apply_held(held, stagers)? {
        ctx.notify_tokens();
    }
    Ok(())
}

/// Who is applying frames.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Drainer {
    /// The receiver thread: may read the rest of a payload it has begun straight into place.
    Thread,
    /// A waiting thread: only what is already here.
    Waiter,
}

impl RxState {
    /// The lane the next frame comes on.
    pub(super) fn lane(&self) -> Lane {
        self.lane
    }

    /// Applies every frame the socket holds now, in order; returns whether any byte was taken.
    /// A payload begun is finished (reads of its remaining bytes may block, bounded by the
    /// socket's read timeout). Failures end the connection (`done`).
    pub(super) fn drain(&mut self, sh: &Shared, who: Drainer) -> bool {
        let mut progressed = false;
        let (ctx, cache) = (&self.ctx, &self.regions);
        let lookup = |id: u64| region_info_cached(ctx, cache, id);
        let report = |e: StageError| {
            let e = match e {
                // The socket's read timeout (the stall limit) passed in the middle of a payload.
                StageError::Io(e)
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    Error::timeout(
                        format!(
                            "receiving a write from {}: the peer stopped sending in the middle of it",
                            sh.peer_desc
                        ),
                        stall_limit(sh.wait_limit),
                    )
                }
                StageError::Io(e) => Error::remote(format!("receiving a write from {} failed: {e}", sh.peer_desc)),
                StageError::Mscclpp(e) => Error::remote(format!("receiving a write from {} failed: {e}", sh.peer_desc)),
            };
            if !sh.stop.load(Ordering::Acquire) {
                sh.fail(e);
            }
        };
        while !self.done {
            let rd = match self.lane {
                Lane::Shared => &mut self.shared,
                Lane::Own => &mut self.own,
            };
            let (used, ev) = match self.core.handle_bytes(rd.buffer(), &lookup) {
                Ok(x) => x,
                Err(why) => {
                    warn!(target: LOG, "refusing a frame from {}: {why}", sh.peer_desc);
                    // Tokens held from before the refused frame were valid: they are applied, as
                    // they would have been had nothing been buffered behind them (best effort).
                    if apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx).is_err() {
                        debug!(target: LOG, "tokens from {} before a refused frame could not be applied", sh.peer_desc);
                    }
                    let _ = send_record(&self.rec, &Record::refusal(&why));
                    sh.fail(Error::remote(format!("refused a frame from peer {}: {why}", sh.peer_desc)));
                    self.applied_all = false;
                    self.done = true;
                    break;
                }
            };
            let applied: std::result::Result<(), StageError> = match ev {
                None if used > 0 => {
                    rd.consume(used);
                    Ok(())
                }
                // The buffered input is used up: held tokens go before anything more is read
                // (then this comes round again with nothing held).
                None if !self.held.is_empty() => apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx),
                None => match (self.core.payload_pending(), self.cur.as_ref().map(|r| &r.mem), who) {
                    // Past what was buffered: the rest of a host write goes straight to its place.
                    (Some((offset, left)), Some(Mem::Host(reg)), Drainer::Thread) => reg
                        .recv_exact(offset, left, &rd.get_ref().sock)
                        .map_err(StageError::from)
                        .map(|()| self.core.payload_received(left, false)),
                    _ => match rd.fill_buf() {
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
                    rd.consume(used);
                    r
                }
                Some(RxEvent::Write { region, offset, len }) => {
                    rd.consume(used);
                    // Held tokens wait behind a write only when it lands without reading the
                    // socket (a small GPU write whose payload is all here) and does not rewrite
                    // a word they update (the write must win); otherwise they go first.
                    let behind = match &region.mem {
                        Mem::Gpu(g) => {
                            len <= GATHER_MAX
                                && len <= rd.buffer().len() as u64
                                && !self.held.touches(
                                    g.ptr.saturating_add(offset),
                                    g.ptr.saturating_add(offset.saturating_add(len)),
                                )
                        }
                        Mem::Host(_) => false,
                    };
                    let first = if behind {
                        Ok(())
                    } else {
                        apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx)
                    };
                    let r = first.and_then(|()| match &region.mem {
                        // Earlier writes to GPU memory land before this one's bytes do.
                        Mem::Host(_) => settle(&mut self.stagers, None).map_err(StageError::from),
                        // GPU memory: staged through pinned buffers, the whole payload at once.
                        Mem::Gpu(g) => stager_for(&mut self.stagers, g)
                            .map_err(StageError::from)
                            .and_then(|st| st.recv(rd, g, offset, len))
                            .map(|()| self.core.payload_received(len, !rd.buffer().is_empty())),
                    });
                    self.cur = Some(region);
                    r
                }
                Some(RxEvent::Token { region, offset, value, add }) => {
                    rd.consume(used);
                    // Every write before the token has landed before the token does: queued
                    // copies to other GPUs are waited for first, those to this token's GPU are
                    // ahead of it on the same stream (and the round waits for that stream).
                    let r = match &region.mem {
                        Mem::Gpu(g) => {
                            count_n(C_TOKENS, 1);
                            let dev = g.dev.ordinal;
                            let mut r = g.check(offset, 8).map_err(StageError::from);
                            if r.is_ok() && self.held.dev().is_some_and(|d| d != dev) {
                                // Another GPU's tokens were held: they go first, in order.
                                r = apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx);
                            }
                            if r.is_ok() {
                                self.held.push(dev, &region, GpuToken { addr: g.ptr + offset, value, add });
                                // With more input here the token is held, to be applied with
                                // those behind it in one round (`HeldTokens`).
                                if rd.buffer().is_empty() || self.held.is_full() || self.core.ack_due() {
                                    r = apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx);
                                }
                            }
                            r
                        }
                        // Host memory: held GPU tokens first (tokens become visible in order),
                        // then every write before it lands, then the word.
                        Mem::Host(reg) => apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx)
                            .and_then(|()| settle(&mut self.stagers, None).map_err(StageError::from))
                            .and_then(|()| reg.atomic_u64(offset).map_err(StageError::from))
                            .map(|w| {
                                if add {
                                    w.fetch_add(value, Ordering::AcqRel);
                                } else {
                                    w.store(value, Ordering::Release);
                                }
                                self.ctx.notify_tokens();
                            }),
                    };
                    // A token usually ends what the peer sent: with nothing buffered, nothing
                    // held and no acknowledgement due, return now (a waiter sees its signal
                    // without another read, which would only find the socket empty).
                    if r.is_ok() && self.held.is_empty() && rd.buffer().is_empty() && !self.core.ack_due() {
                        progressed = true;
                        break;
                    }
                    r
                }
                Some(RxEvent::Ack(seq)) => {
                    rd.consume(used);
                    // An acknowledgement says every frame up to `seq` is applied: held tokens
                    // too, and every write landed.
                    let applied = apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx)
                        .and_then(|()| settle(&mut self.stagers, None).map_err(StageError::from));
                    if let Err(e) = applied {
                        report(e);
                        self.applied_all = false;
                        self.done = true;
                        break;
                    }
                    if let Err(e) = send_record(&self.rec, &Record::Ack(seq)) {
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
                Some(RxEvent::Switch) => {
                    rd.consume(used);
                    self.lane = self.lane.other();
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
        // Held tokens are applied before the drain ends (normally already, as the buffered input
        // ran out). After a later frame failed to apply (a failure to apply them empties them
        // first) they are still applied, best effort, as they would have been had nothing been
        // buffered behind them.
        if !self.held.is_empty() {
            let was_done = self.done;
            if let Err(e) = apply_held_notifying(&mut self.held, &mut self.stagers, &self.ctx) {
                self.applied_all = false;
                if was_done {
                    debug!(target: LOG, "tokens from {} before a failed frame could not be applied", sh.peer_desc);
                } else {
                    report(e);
                    self.done = true;
                }
            }
        }
        // The input ran dry (or a token ended it): copies of small writes still waiting are
        // queued to their GPUs now, not waited for, so a write nothing follows (packets a
        // kernel polls for) lands too; many out of order wait for more input a little longer
        // (`issue_when_dry`; the receiver thread comes back for them after `DRY_GRACE`).
        let mut deferred = false;
        if !self.done {
            let now = Instant::now();
            if progressed {
                self.input_at = now;
            }
            let grace_over = now.duration_since(self.input_at) >= DRY_GRACE;
            for st in self.stagers.values_mut() {
                match st.issue_when_dry(grace_over) {
                    Ok(d) => deferred |= d,
                    Err(e) => {
                        self.applied_all = false;
                        report(StageError::Mscclpp(e));
                        self.done = true;
                        deferred = false;
                        break;
                    }
                }
            }
        }
        // Relaxed: written only here, under the receiver's lock; the receiver thread reads it
        // for its next wait, and again under the lock before it acts.
        let was = sh.rx_deferred.swap(deferred, Ordering::Relaxed);
        if deferred && !was && who == Drainer::Waiter {
            // The receiver thread may be napping while this waiter polls; the waiter may return
            // (its signal came) and leave these payloads waiting.
            sh.wake_receiver();
        }
        progressed
    }
}

/// Waits for the copies queued on every stager (but the one of GPU `except`): the writes
/// received so far have landed.
fn settle(stagers: &mut HashMap<u32, Stager>, except: Option<u32>) -> crate::error::Result<()> {
    for (dev, st) in stagers.iter_mut() {
        if Some(*dev) != except {
            st.settle()?;
        }
    }
    Ok(())
}

/// Takes the peer's sockets, then applies its frames as the receiver core directs, waiting for
/// data outside the receiver's lock; then says it has finished.
pub(super) fn receiver_loop(
    sh: Arc<Shared>,
    ctx: Arc<ContextInner>,
    acceptor: Arc<Acceptor>,
    deadline: Deadline,
    shared: Option<TcpStream>,
    own: TcpStream,
) {
    receive(&sh, ctx, acceptor, deadline, shared, own);
    lock(&sh.st).rx_done = true;
    sh.cond.notify_all();
}

/// How long a closing receiver's last acknowledgement may take to send.
const LAST_ACK_WAIT: Duration = Duration::from_secs(1);

/// Waits up to `timeout` for something to read on `lane`'s socket, or with `both`, on either.
fn readable_lanes(shared: &TcpStream, own: &TcpStream, lane: Lane, both: bool, timeout: Duration) -> bool {
    use nix::poll::{PollFd, PollFlags, ppoll};
    use nix::sys::time::TimeSpec;
    use std::os::fd::AsFd;
    let (first, second) = match lane {
        Lane::Shared => (shared, own),
        Lane::Own => (own, shared),
    };
    let mut fds = [PollFd::new(first.as_fd(), PollFlags::POLLIN), PollFd::new(second.as_fd(), PollFlags::POLLIN)];
    let n = if both { 2 } else { 1 };
    // Interrupted: let the caller look again.
    // `ppoll` for its nanosecond timeout (`DRY_GRACE` is 250 us); no signal mask change.
    ppoll(&mut fds[..n], Some(TimeSpec::from_duration(timeout)), None).is_ok_and(|n| n > 0)
}

/// The socket of the peer that carries `lane`: the shared one is dialled by the low side.
fn take_lane(sh: &Shared, acceptor: &Acceptor, lane: Lane, deadline: Deadline) -> std::result::Result<TcpStream, ()> {
    acceptor.take(lane, deadline, &sh.stop).map_err(|e| {
        if !sh.stop.load(Ordering::Acquire) {
            sh.fail(e.during(format!("waiting for {} to connect back", sh.peer_desc)));
        }
    })
}

pub(super) fn receive(
    sh: &Arc<Shared>,
    ctx: Arc<ContextInner>,
    acceptor: Arc<Acceptor>,
    deadline: Deadline,
    shared: Option<TcpStream>,
    own: TcpStream,
) {
    // The peer's own lane; and the shared lane, when the peer dialled it (this side is high, or
    // the peer is this endpoint itself).
    let Ok(s_in) = take_lane(sh, &acceptor, Lane::Own, deadline) else { return };
    let shared = match shared {
        Some(s) => s,
        None => match take_lane(sh, &acceptor, Lane::Shared, deadline) {
            Ok(s) => s,
            Err(()) => {
                let _ = s_in.shutdown(Shutdown::Both);
                return;
            }
        },
    };
    drop(acceptor);
    // Reads of a payload's remaining bytes block; a peer that stops in the middle of a payload
    // fails the connection after this long (a Timeout) instead of hanging the receiver. So do
    // frames and acknowledgements sent to a peer that stopped reading them (from any thread).
    // A peer that stops between frames, or inside a header, leaves the receiver polling: the
    // waits of the callers (flush, semaphore waits) are bounded by their own timeouts.
    for s in [&s_in, &shared] {
        let _ = s.set_read_timeout(Some(stall_limit(sh.wait_limit)));
        let _ = s.set_write_timeout(Some(stall_limit(sh.wait_limit)));
        let _ = s.set_nodelay(true);
    }
    let clones = (
        s_in.try_clone(),
        s_in.try_clone(),
        s_in.try_clone(),
        shared.try_clone(),
        shared.try_clone(),
        shared.try_clone(),
    );
    let (Ok(in_ctl), Ok(in_watch), Ok(rec), Ok(shared_ctl), Ok(shared_out), Ok(shared_watch)) = clones else {
        sh.fail(Error::new(ErrorKind::Internal, "cloning a socket failed"));
        let _ = s_in.shutdown(Shutdown::Both);
        let _ = shared.shutdown(Shutdown::Both);
        return;
    };
    *lock(&sh.in_ctl) = Some(in_ctl);
    if sh.self_pair {
        *lock(&sh.loop_ctl) = Some(shared_ctl);
    } else if !sh.low {
        *lock(&sh.shared_ctl) = Some(shared_ctl);
    }
    // Started before the stop check (SeqCst both here and in Drop, which stores `stop` and then
    // reads this): either Drop sees it started and waits for `rx_done` (set when this returns,
    // early or not), or this sees the stop. Set after the check, a Drop in between skipped the
    // wait and closed the sockets under a receiver about to apply frames and send its closing
    // record.
    sh.rx_started.store(true, Ordering::SeqCst);
    if sh.stop.load(Ordering::SeqCst) || lock(&sh.st).failed.is_some() {
        let _ = s_in.shutdown(Shutdown::Both);
        let _ = shared.shutdown(Shutdown::Both);
        return;
    }
    if !sh.low {
        *lock(&sh.out) = Some(OutLanes { shared: shared_out, own });
        sh.tx_cond.notify_all();
    }
    *lock(&sh.rx) = Some(RxState {
        rec,
        shared: BufReader::with_capacity(256 * 1024, RxSocket { sock: shared }),
        own: BufReader::with_capacity(256 * 1024, RxSocket { sock: s_in }),
        lane: Lane::Shared,
        core: ReceiverCore::default(),
        cur: None,
        regions: RefCell::new([None, None]),
        stagers: HashMap::new(),
        ctx,
        done: false,
        applied_all: true,
        input_at: Instant::now(),
        held: HeldTokens::new(),
    });
    // The lane to wait on; while the other lane has data and this one not (the peer's frames
    // after a switch not yet here), wait on this one alone for a while.
    let mut lane = Lane::Shared;
    let mut one_lane = false;
    let _ = sh.rx_thread.set(std::thread::current());
    let mut nap = RX_DEFER;
    loop {
        if sh.stop.load(Ordering::Acquire) {
            break;
        }
        // Received payloads wait for their landing (`Shared::rx_deferred`; set by a waiter's
        // drain too).
        let deferred = sh.rx_deferred.load(Ordering::Relaxed);
        let since = (sh.born.elapsed().as_nanos() as u64).saturating_sub(sh.waiter_polled.load(Ordering::Relaxed));
        if since < RX_DEFER.as_nanos() as u64 && !deferred {
            // A waiter is reading the sockets itself: nap (longer each time it still is), unless
            // it stops polling and wakes this thread.
            std::thread::park_timeout(nap.saturating_sub(Duration::from_nanos(since)).max(RX_DEFER / 2));
            nap = (nap * 2).min(RX_NAP_MAX);
            continue;
        }
        nap = RX_DEFER;
        // Block in `poll` without the lock, so a waiter may take the data first.
        let wait = if deferred {
            DRY_GRACE
        } else if one_lane {
            RX_DEFER
        } else {
            RX_STOP_CHECK
        };
        let ready = readable_lanes(&shared_watch, &in_watch, lane, !one_lane, wait);
        one_lane = false;
        if !ready {
            // (A waiter may have switched lanes meanwhile.)
            if let Ok(mut g) = sh.rx.try_lock()
                && let Some(rx) = g.as_mut()
            {
                lane = rx.lane();
                if sh.rx_deferred.load(Ordering::Relaxed) {
                    // The input stayed dry: this drain reads nothing and lands what waits (or
                    // reads what came meanwhile).
                    rx.drain(sh, Drainer::Thread);
                    if rx.done {
                        break;
                    }
                }
            }
            continue;
        }
        // Never queue behind a waiter that holds the lock (its unlock would then have to wake
        // this thread, on the waiter's critical path).
        let Ok(mut g) = sh.rx.try_lock() else {
            std::thread::yield_now();
            continue;
        };
        let Some(rx) = g.as_mut() else { return };
        let progressed = rx.drain(sh, Drainer::Thread);
        if rx.done {
            break;
        }
        one_lane = !progressed && rx.lane() == lane;
        lane = rx.lane();
    }
    // Closing (this side dropped the connection): apply what had already arrived (the socket is
    // shut for reading, so the reads end), then acknowledge every frame applied, so that the
    // peer's flush of those succeeds; the socket closes after this.
    if !sh.stop.load(Ordering::Acquire) {
        // The connection failed: writes that arrived whole still land (as they would have when
        // the input ran dry), best effort, though nothing more is acknowledged.
        if let Some(rx) = lock(&sh.rx).as_mut() {
            for st in rx.stagers.values_mut() {
                if let Err(e) = st.issue_when_dry(true) {
                    debug!(target: LOG, "landing the last writes from {} after the connection failed: {e}", sh.peer_desc);
                }
            }
        }
        return;
    }
    let mut g = lock(&sh.rx);
    let Some(rx) = g.as_mut() else { return };
    while !rx.done && rx.drain(sh, Drainer::Thread) {}
    // What the closing record acknowledges has landed (a GPU that cannot finish the copies
    // leaves it unsent: the peer's flush then fails instead of trusting writes that never landed).
    if let Err(e) = settle(&mut rx.stagers, None) {
        debug!(target: LOG, "closing the connection to {}: {e}", sh.peer_desc);
        rx.applied_all = false;
    }
    if rx.applied_all {
        let s = &rx.rec;
        let _ = s.set_write_timeout(Some(LAST_ACK_WAIT));
        if let Err(e) = send_record(s, &Record::Closing(rx.core.applied_through())) {
            debug!(target: LOG, "last acknowledgement to {}: {e}", sh.peer_desc);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Instant;

    use super::super::acceptor::{accept_handshake, dial};
    use super::super::wire;
    use super::*;
    use crate::Context;
    use crate::conn::endpoint::{Endpoint, EndpointKind};
    use crate::{Buffer, TransportFlags};

    const OP_WRITE: u8 = 1;
    const OP_SET: u8 = 2;
    const OP_ADD: u8 = 3;
    const OP_NOP: u8 = 4;

    /// A header's bytes, any field as given (malformed ones included).
    fn header(op: u8, seq: u64, region: u64, offset: u64, len: u64, value: u64) -> [u8; wire::HEADER] {
        let mut b = [0u8; wire::HEADER];
        b[0] = op;
        for (i, v) in [seq, region, offset, len, value].into_iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Held tokens: consecutive ones to one word merge (as `GpuToken::then`), others keep their
    /// order; the bounds hold; a write overlapping a held word is seen; taking empties it.
    #[test]
    fn held_tokens_merge_only_consecutive_updates_of_a_word() {
        let t = |addr: u64, value: u64, add: bool| GpuToken { addr, value, add };
        let mut h = HeldTokens::<u8>::new();
        assert!(h.is_empty() && h.dev().is_none() && h.take().is_none());
        for tok in [t(64, 1, true), t(64, 2, true), t(128, 7, false), t(64, 1, true), t(64, 9, false), t(64, 1, true)] {
            h.push(3, &0, tok);
        }
        assert_eq!(h.dev(), Some(3));
        assert!(h.touches(60, 65) && h.touches(128, 129) && h.touches(135, 200));
        assert!(!h.touches(0, 64) && !h.touches(72, 128) && !h.touches(136, 1 << 20));
        let (regions, ups) = h.take().unwrap();
        assert_eq!(ups, vec![t(64, 3, true), t(128, 7, false), t(64, 10, false)]);
        assert_eq!(regions.len(), 6, "every token's region is kept until the round");
        assert!(h.is_empty() && !h.is_full());
        // Bounded by distinct updates, and by tokens even when they all merge.
        for i in 0..HOLD_MAX_UPDATES as u64 {
            assert!(!h.is_full());
            h.push(0, &0, t(8 * (i % 2), 1, true));
        }
        assert!(h.is_full());
        h.take();
        for _ in 0..HOLD_MAX_TOKENS {
            assert!(!h.is_full());
            h.push(0, &0, t(8, 1, true));
        }
        assert!(h.is_full());
        assert_eq!(h.take().unwrap().1, vec![t(8, HOLD_MAX_TOKENS, true)]);
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

    /// A fake peer that passed the handshakes, connected to `ep` of `ctx`: our connection to it,
    /// its socket for frames (the shared lane, where our receiver starts reading), its own lane
    /// (where our records come back), and the ends it accepted of our lanes (kept open: a
    /// closed one is the peer closing).
    #[allow(clippy::type_complexity)]
    fn fake_peer(ctx: &Context, ep: &Endpoint) -> (crate::Connection, TcpStream, TcpStream, Vec<(TcpStream, Lane)>) {
        use crate::conn::endpoint::EndpointDesc;
        let EndpointKind::Ethernet { addr: ep_addr, secret: ep_secret } = ep.desc().kind.clone() else { panic!() };
        // The fake peer's own "endpoint": a raw listener that answers the handshake.
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_secret = [3u8; 16];
        let fake_addr = fake.local_addr().unwrap();
        let remote = Endpoint::from_desc_for_test(EndpointDesc {
            transport: Transport::Ethernet,
            device: crate::Device::Cpu,
            host_hash: 1,
            process_hash: 2,
            max_write_queue_size: 8,
            kind: EndpointKind::Ethernet { addr: fake_addr, secret: fake_secret },
        });
        let fake_ctx = 0xfeed_u64;
        let we_are_low = (ep_addr, ep_secret) < (fake_addr, fake_secret);
        // We dial the fake's own lane, and the shared lane too when we are the low side.
        let acc = std::thread::spawn(move || {
            let mut got = Vec::new();
            for _ in 0..if we_are_low { 2 } else { 1 } {
                let (s, _) = fake.accept().unwrap();
                got.push(accept_handshake(s, &fake_secret, fake_ctx).unwrap());
            }
            got
        });
        let conn = ctx.connect(ep, &remote).unwrap();
        let mut ours = acc.join().unwrap();
        // The fake dials our endpoint with the right secret (its own lane, where our records
        // come back, and the shared lane when it is the low side).
        let dial_lane = |lane| dial(ep_addr, &ep_secret, fake_ctx, lane, Deadline::after(Duration::from_secs(5)));
        let (s, _) = dial_lane(Lane::Own).unwrap();
        let frames = if we_are_low {
            let i = ours.iter().position(|(_, l)| *l == Lane::Shared).unwrap();
            ours.swap_remove(i).0
        } else {
            dial_lane(Lane::Shared).unwrap().0
        };
        (conn, frames, s, ours)
    }

    /// Waits (5 s at most) for `conn` to fail and returns its error.
    fn failure_of(conn: &crate::Connection) -> crate::Error {
        let t0 = Instant::now();
        while conn.status().is_ok() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        conn.status().unwrap_err()
    }

    /// A peer that passes the handshake and then sends a frame naming memory that is not
    /// registered (or past a region's end) is refused: nothing is written, the sender is told
    /// why, and the connection fails on our side too.
    #[test]
    fn raw_peer_with_bad_frames_is_refused() {
        for bad in ["unregistered", "past the end", "wrong sequence"] {
            let ctx = Context::new();
            let target = Buffer::new(&ctx, 4096, Transport::Ethernet.into()).unwrap();
            let ep = ctx
                .create_endpoint(&crate::EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1"))
                .unwrap();
            let (conn, mut frames, mut s, _accepted) = fake_peer(&ctx, &ep);
            let id = target.memory().desc().region_id;
            let h = match bad {
                "unregistered" => header(OP_WRITE, 1, id + 1000, 0, 16, 0),
                "past the end" => header(OP_WRITE, 1, id, 4090, 16, 0),
                _ => header(OP_WRITE, 7, id, 0, 16, 0),
            };
            let mut frame = h.to_vec();
            frame.extend_from_slice(&[0xAA; 16]);
            frames.write_all(&frame).unwrap();
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
            let e = failure_of(&conn);
            assert!(e.to_string().contains("refused a frame"), "{bad}: {e}");
            assert!(e.to_string().contains(&msg), "{bad}: {e} / {msg}");
            assert!(conn.flush(Duration::from_secs(1)).is_err());
        }
    }

    /// A peer that stops in the middle of a write's payload (its socket open, nothing more
    /// sent) fails the connection with a Timeout naming the peer after the stall limit, not a
    /// hang and not an I/O error's text.
    #[test]
    fn a_peer_that_stops_mid_payload_is_a_timeout() {
        let ctx = Context::new();
        let target = Buffer::new(&ctx, 4096, Transport::Ethernet.into()).unwrap();
        let cfg = crate::EndpointConfig::new(Transport::Ethernet)
            .ethernet(crate::EthernetConfig::default().interface("127.0.0.1").connect_timeout(Duration::from_secs(1)));
        let ep = ctx.create_endpoint(&cfg).unwrap();
        let (conn, mut frames, _s, _accepted) = fake_peer(&ctx, &ep);
        let id = target.memory().desc().region_id;
        let mut frame = header(OP_WRITE, 1, id, 0, 2048, 0).to_vec();
        frame.extend_from_slice(&[0xAA; 100]);
        frames.write_all(&frame).unwrap();
        let t0 = Instant::now();
        let e = failure_of(&conn);
        assert_eq!(e.kind(), crate::ErrorKind::Timeout, "{e}");
        assert!(e.to_string().contains("stopped sending in the middle"), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(900), "{:?}", t0.elapsed());
    }
}
