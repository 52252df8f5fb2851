//! The IB transport: RDMA WRITE for data on one RC queue pair, completions polled by the calling
//! threads. Host mode carries tokens and atomics as 8-byte FETCH_AND_ADD; HostNoAtomic mode sends
//! each token update as a zero-byte WRITE_WITH_IMM holding the low 32 bits of the new value, and a
//! receive thread per connection rebuilds the 64-bit value and stores it into the one semaphore
//! token built on the connection (host memory, or GPU memory through [`TokenForwarder`]).
//!
//! Accounting ([`proto::SendAccounting`], a core without verbs): every work request gets a
//! sequence number. Only the last WR of each post is signalled, with its sequence number as
//! `wr_id`; a successful completion of WR `s` means every WR up to `s` is done (RC completes in
//! order). So `completed` is one number, `flush` waits for it to reach what was posted, and a
//! post waits (polling, backing off) while it would exceed the queue bound
//! (`max_write_queue_size`), the QP's `max_send_wr`, or a signalled count equal to the send CQ's
//! depth: the CQ can never overflow. The first failed completion breaks the connection; every
//! later call returns that error. Waits spin briefly, then yield, then sleep
//! ([`crate::sync::Backoff`]), so a stalled peer costs no core.

pub(crate) mod proto;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::conn::endpoint::{Endpoint, EndpointKind};
use crate::context::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Mem, RegisteredMemory};
use crate::platform::gdr::TokenForwarder;
use crate::platform::hostmem::{HostAlloc, Region};
use crate::platform::verbs::abi::*;
use crate::platform::verbs::dev::{IbMr, IbQp, SendOp as Op, wc_status_text};
use crate::sync::{Backoff, BackoffPolicy, Deadline, lock};
use crate::transport::{IbMode, Transport};
use proto::{Completion, SendAccounting, SendLimits, TokenRebuild};

use super::{ConnInner, Connection, ConnectionImpl};

/// How long a post waits for room in a full queue without any completion before failing.
const QUEUE_WAIT: Duration = Duration::from_secs(30);
/// How `flush` and a post into a full queue wait for completions. A NIC completes small
/// operations within microseconds and large ones at line rate (a 64 MiB write takes ~3 ms at
/// 200 Gb/s), so: spin 50 us, yield until 5 ms (as fast as spinning on an idle core, but
/// threads that share it, such as the test provider's fabric, still run), then sleep in steps
/// of 50 to 200 us, which notices the end of a long transfer within ~0.25 ms and leaves the
/// core free while a peer stalls. (The shared `FAST` policy sleeps up to 1 ms, up to a third of
/// a 3 ms transfer.)
const COMPLETION_WAIT: BackoffPolicy = BackoffPolicy {
    spin: Duration::from_micros(50),
    yield_until: Duration::from_millis(5),
    sleep_min: Duration::from_micros(50),
    sleep_max: Duration::from_micros(200),
};
/// Largest single RDMA WRITE (bigger writes are split).
const MAX_CHUNK: u64 = 1 << 30;

struct SendState {
    acct: SendAccounting,
    wcs: Vec<ibv_wc>,
}

/// Where a HostNoAtomic connection stores the tokens it receives.
enum ForwardTarget {
    /// A host word (the token's first 8 bytes): an atomic store, then waiters are woken.
    Host(Region),
    /// A GPU word, through GDRCopy or a stream.
    Gpu(TokenForwarder),
}

impl ForwardTarget {
    /// The store path into `token`'s first word (local memory of this process).
    fn for_token(token: &RegisteredMemory) -> Result<ForwardTarget> {
        match token.local().map(|l| &l.mem) {
            Some(Mem::Host(r)) => Ok(ForwardTarget::Host(r.clone())),
            Some(Mem::Gpu(g)) => Ok(ForwardTarget::Gpu(TokenForwarder::new(g)?)),
            None => Err(Error::invalid_usage("signals can be forwarded only into a token this process registered")),
        }
    }

    fn kind(&self) -> String {
        match self {
            ForwardTarget::Host(_) => "host store".into(),
            ForwardTarget::Gpu(f) => f.kind().into(),
        }
    }
}

/// What the receive thread of a HostNoAtomic connection shares with it.
struct Forwarding {
    target: Mutex<Option<ForwardTarget>>,
    stop: AtomicBool,
    failure: Arc<OnceLock<Error>>,
    /// Set instead of `failure` when the receives were flushed (the QP failed elsewhere).
    flushed: OnceLock<Error>,
    /// Tokens forwarded so far.
    count: AtomicU64,
}

pub(crate) struct IbConnection {
    /// Joined in Drop before any field goes (the QP and the forwarding target outlive it).
    recv_thread: Mutex<Option<JoinHandle<()>>>,
    fwd: Option<Arc<Forwarding>>,
    qp: Arc<IbQp>,
    mode: IbMode,
    /// Where FETCH_AND_ADD returns the old value (never read).
    atomic_src: IbMr,
    _atomic_mem: Arc<HostAlloc>,
    state: Mutex<SendState>,
    failure: Arc<OnceLock<Error>>,
    queue: usize,
    chunk: u64,
    /// "QP 17 on rxe0 port 1 -> QP 18": for errors.
    name: String,
    local_transport: Transport,
    remote_transport: Transport,
}

pub(crate) fn connect(ctx: &Context, local: &Endpoint, remote: &Endpoint, peer: Option<usize>) -> Result<Connection> {
    let t = local.transport();
    let l = local.local().ok_or_else(|| Error::internal("connect: local endpoint is not local"))?;
    let (EndpointKind::Ib { mode: lmode, .. }, EndpointKind::Ib { qp: rqp, mode: rmode }) =
        (&local.desc().kind, &remote.desc().kind)
    else {
        return Err(Error::invalid_usage("an IB connection needs IB endpoints on both sides"));
    };
    if lmode != rmode {
        let name = |m: &IbMode| if *m == IbMode::HostNoAtomic { "host-no-atomic" } else { "host (RDMA atomics)" };
        return Err(Error::invalid_usage(format!(
            "IB mode mismatch: this side uses {}, the peer {}; set the same IbConfig::mode or MSCCLPP_IBV_MODE on both",
            name(lmode),
            name(rmode)
        )));
    }
    let qp = l.take_ib_qp().ok_or_else(|| {
        Error::invalid_usage("this endpoint was already used for a connection (one QP, one connection)")
    })?;
    if qp.port.link_layer != rqp.link_layer {
        return Err(Error::invalid_usage(format!(
            "link layers differ: this side's port is {}, the peer's {}",
            link_name(qp.port.link_layer),
            link_name(rqp.link_layer)
        )));
    }
    let no_atomic = *lmode == IbMode::HostNoAtomic;
    let cfg = &l.config.ib;
    if no_atomic {
        // Receives first, so the peer's first signal never waits for one.
        for _ in 0..qp.limits.max_recv_wr.max(1) {
            qp.post_recv_empty(0)?;
        }
    }
    qp.connect(rqp)?;
    let qp = Arc::new(qp);
    let failure = Arc::new(OnceLock::new());
    let (fwd, recv_thread) = if no_atomic {
        let f = Arc::new(Forwarding {
            target: Mutex::new(None),
            stop: AtomicBool::new(false),
            failure: failure.clone(),
            flushed: OnceLock::new(),
            count: AtomicU64::new(0),
        });
        let (q, f2, c2) = (qp.clone(), f.clone(), ctx.clone());
        let h = std::thread::Builder::new()
            .name(format!("mscclpp-ib-recv-{}", qp.qpn))
            .spawn(move || recv_loop(q, f2, c2))
            .map_err(|e| Error::io("starting the IB receive thread", e))?;
        (Some(f), Some(h))
    } else {
        (None, None)
    };
    let alloc = Arc::new(HostAlloc::zeroed(8)?);
    let atomic_src = qp.dev.reg_mr(alloc.as_ptr() as u64, 8)?;
    let name = format!("{:?} -> QP {}", qp, rqp.qpn);
    debug!(target: "mscclpp::ib", "connected {name} (path MTU index {})", (qp.port.active_mtu as u8).min(rqp.mtu));
    let chunk = MAX_CHUNK.min(qp.port.max_msg_sz.max(4096) as u64);
    let conn = IbConnection {
        recv_thread: Mutex::new(recv_thread),
        fwd,
        mode: *lmode,
        atomic_src,
        _atomic_mem: alloc,
        state: Mutex::new(SendState {
            acct: SendAccounting::new(SendLimits::new(
                local.max_write_queue_size(),
                qp.max_send_wr as usize,
                qp.send_cq.depth,
                cfg.max_wr_per_send as usize,
            )),
            wcs: vec![ibv_wc::default(); cfg.max_cq_poll_num.clamp(1, 4096) as usize],
        }),
        failure,
        queue: local.max_write_queue_size(),
        chunk,
        name,
        local_transport: t,
        remote_transport: remote.transport(),
        qp,
    };
    Ok(Connection::from_inner(ConnInner {
        imp: Box::new(conn),
        transport: t,
        remote_transport: remote.transport(),
        device: local.device(),
        context: ctx.clone(),
        peer,
        peer_desc: peer.map(|p| format!("rank {p}")).unwrap_or_else(|| "peer".into()),
    }))
}

fn link_name(l: u8) -> &'static str {
    if l == IBV_LINK_LAYER_ETHERNET { "Ethernet (RoCE)" } else { "InfiniBand" }
}

impl IbConnection {
    fn fail(&self, e: Error) -> Error {
        let _ = self.failure.set(e.duplicate());
        self.failure.get().map(Error::duplicate).unwrap_or(e)
    }

    fn check(&self) -> Result<()> {
        match self.failure.get() {
            Some(e) => Err(e.duplicate()),
            None => match self.receives_flushed() {
                Some(e) => Err(self.root_cause(e, &mut lock(&self.state))),
                None => Ok(()),
            },
        }
    }

    /// The receive thread's "flushed" error: the QP went into the error state for another reason.
    fn receives_flushed(&self) -> Option<&Error> {
        self.fwd.as_ref().and_then(|f| f.flushed.get())
    }

    /// After the receives were flushed, the reason is usually a failed send waiting in the send
    /// CQ: drain it so that error, not the flush, is the connection's.
    fn root_cause(&self, flushed: &Error, st: &mut SendState) -> Error {
        loop {
            match self.poll(st) {
                Err(e) => return e,
                Ok(0) => return self.fail(flushed.duplicate()),
                Ok(_) => {}
            }
        }
    }

    /// Polls the send CQ once; returns how many completions it took.
    fn poll(&self, st: &mut SendState) -> Result<usize> {
        let n = match self.qp.send_cq.poll(&mut st.wcs) {
            Ok(n) => n,
            Err(e) => return Err(self.fail(e.during(format!("polling the send CQ of {}", self.name)))),
        };
        for i in 0..n {
            let wc = st.wcs[i];
            let ok = wc.status == IBV_WC_SUCCESS;
            match st.acct.on_completion(wc.wr_id, ok) {
                Completion::Done => {}
                Completion::Unexpected => {
                    let e = Error::new(
                        ErrorKind::Ib,
                        format!(
                            "an unexpected completion (work request {}, {} posted) on {}: the provider \
                             reported work that was never posted or already completed",
                            wc.wr_id,
                            st.acct.posted(),
                            self.name
                        ),
                    );
                    warn!(target: "mscclpp::ib", "{}", e.message());
                    return Err(self.fail(e));
                }
                // A completion after the connection broke: the first error stands.
                Completion::Failed if ok => {
                    return Err(self.fail(Error::new(ErrorKind::Ib, format!("{} failed earlier", self.name))));
                }
                Completion::Failed => {}
            }
            if !ok {
                let what = match wc.opcode {
                    IBV_WC_FETCH_ADD => "FETCH_AND_ADD",
                    _ => "RDMA WRITE",
                };
                let e = Error::new(
                    ErrorKind::Ib,
                    format!(
                        "{what} (work request {}) failed on {}: {}{}",
                        wc.wr_id,
                        self.name,
                        wc_status_text(self.qp.dev.v, wc.status),
                        hint(wc.status)
                    ),
                );
                warn!(target: "mscclpp::ib", "{}", e.message());
                return Err(self.fail(e));
            }
        }
        Ok(n)
    }

    /// Posts `ops` in batches of `max_wr_per_send`, each batch's last WR signalled, waiting for
    /// room when the queue bound, the send queue or the CQ would be exceeded.
    fn post(&self, ops: &[Op]) -> Result<()> {
        self.check()?;
        let mut st = lock(&self.state);
        let batch_max = st.acct.limits().batch_max();
        for batch in ops.chunks(batch_max) {
            if !st.acct.can_post(batch.len()) {
                self.wait_for_room(&mut st, batch.len())?;
            }
            self.qp.post_batch(batch, st.acct.posted()).map_err(|e| self.fail(e))?;
            st.acct.on_posted(batch.len());
        }
        Ok(())
    }

    /// Polls until a post of `n` WRs fits, backing off between empty polls; fails when no
    /// completion arrives for [`QUEUE_WAIT`].
    fn wait_for_room(&self, st: &mut SendState, n: usize) -> Result<()> {
        let mut deadline = Deadline::after(QUEUE_WAIT);
        let mut backoff = Backoff::new(COMPLETION_WAIT);
        while !st.acct.can_post(n) {
            if self.poll(st)? > 0 {
                // Progress: the queue drains, so keep polling at full speed.
                deadline = Deadline::after(QUEUE_WAIT);
                backoff = Backoff::new(COMPLETION_WAIT);
                continue;
            }
            if deadline.expired() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the send queue of {} stayed full ({} work requests outstanding) for {QUEUE_WAIT:?}",
                        self.name,
                        st.acct.outstanding()
                    ),
                ));
            }
            backoff.snooze(&deadline);
        }
        Ok(())
    }
}

fn hint(status: u32) -> &'static str {
    match status {
        IBV_WC_RETRY_EXC_ERR => " (the peer did not answer: it is gone, its QP was destroyed, or the link is down)",
        IBV_WC_REM_ACCESS_ERR => {
            " (the peer refused the access: its memory was deregistered, or the range or key is wrong)"
        }
        IBV_WC_WR_FLUSH_ERR => " (the queue pair was already in the error state)",
        _ => "",
    }
}

impl IbConnection {
    /// The peer's address and rkey for `dst + off`. Without `registered` (a zero-byte write,
    /// which touches no memory) a destination with no memory region for the peer's transport
    /// gets `(0, 0)`.
    fn remote(&self, dst: &RegisteredMemory, off: u64, registered: bool) -> Result<(u64, u32)> {
        if dst.is_local() {
            return Err(Error::invalid_usage(
                "the destination is this process's own registration; an IB connection writes into a peer's memory",
            ));
        }
        let t = self.remote_transport;
        match dst.ib_info(t) {
            Some(info) => Ok((info.addr + off, info.rkey)),
            None if !registered => Ok((0, 0)),
            None => {
                Err(Error::invalid_usage(format!("the destination memory carries no {t} registration (memory region)")))
            }
        }
    }
}

impl ConnectionImpl for IbConnection {
    fn write(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        let (raddr, rkey) = self.remote(dst, dst_off, true)?;
        let st = self.local_transport;
        let mr = src
            .local()
            .and_then(|l| st.ib_index().and_then(|i| l.ib_mrs[i].clone()))
            .ok_or_else(|| Error::invalid_usage(format!("the source memory has no {st} memory region")))?;
        if !Arc::ptr_eq(mr.device(), &self.qp.dev) {
            return Err(Error::invalid_usage(format!(
                "the source memory is registered on {} but this connection uses {} (register it for the same device)",
                mr.device().name,
                self.qp.dev.name
            )));
        }
        if len == 0 {
            return Ok(());
        }
        let laddr = mr.addr + src_off;
        let mut ops = Vec::with_capacity(len.div_ceil(self.chunk) as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(self.chunk);
            ops.push(Op::Write { src: laddr + done, lkey: mr.lkey, len: n as u32, dst: raddr + done, rkey });
            done += n;
        }
        self.post(&ops)
    }

    fn update_and_sync(&self, dst: &RegisteredMemory, dst_off: u64, old: u64, new: u64) -> Result<()> {
        if self.mode == IbMode::HostNoAtomic {
            // A zero-byte write accesses no memory: the peer's token needs no registration.
            let (raddr, rkey) = self.remote(dst, dst_off, false)?;
            return self.post(&[Op::Imm { dst: raddr, rkey, imm: new as u32 }]);
        }
        let (raddr, rkey) = self.remote(dst, dst_off, true)?;
        self.post(&[self.fetch_add(raddr, rkey, new.wrapping_sub(old))])
    }

    fn check_update(&self, old: u64, new: u64) -> Result<()> {
        if self.mode == IbMode::HostNoAtomic && !(1..1u64 << 32).contains(&new.wrapping_sub(old)) {
            return Err(Error::invalid_usage(format!(
                "in IB HostNoAtomic mode a token must grow by 1 to 2^32-1 per update (the receiver rebuilds \
                 it from its low 32 bits); {old} -> {new} does not"
            )));
        }
        Ok(())
    }

    fn forwards_signals(&self) -> bool {
        self.fwd.is_some()
    }

    fn forward_signals_into(&self, token: &RegisteredMemory) -> Result<()> {
        let Some(f) = &self.fwd else { return Ok(()) };
        let mut t = lock(&f.target);
        if t.is_some() {
            return Err(Error::invalid_usage(
                "this IB HostNoAtomic connection already forwards signals into a semaphore; signals carry no \
                 semaphore id, so each connection serves one semaphore: create another connection for another",
            ));
        }
        let target = ForwardTarget::for_token(token)?;
        debug!(target: "mscclpp::ib", "{}: forwarding signals by {}", self.name, target.kind());
        *t = Some(target);
        Ok(())
    }

    fn signal_forwarding(&self) -> Option<String> {
        let f = self.fwd.as_ref()?;
        Some(lock(&f.target).as_ref().map(|t| t.kind()).unwrap_or_else(|| "none yet (no semaphore built)".into()))
    }

    fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
        if self.mode == IbMode::HostNoAtomic {
            return Err(Error::invalid_usage(
                "atomic_add is not available in IB HostNoAtomic mode (no RDMA atomics on this connection)",
            ));
        }
        let (raddr, rkey) = self.remote(dst, dst_off, true)?;
        self.post(&[self.fetch_add(raddr, rkey, value as u64)])
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.check()?;
        let deadline = Deadline::after(timeout);
        let target = lock(&self.state).acct.posted();
        let mut backoff = Backoff::new(COMPLETION_WAIT);
        loop {
            {
                let mut st = lock(&self.state);
                if st.acct.covers(target) {
                    return Ok(());
                }
                if self.poll(&mut st)? > 0 {
                    if st.acct.covers(target) {
                        return Ok(());
                    }
                    // Progress: completions are flowing, poll again at full speed.
                    backoff = Backoff::new(COMPLETION_WAIT);
                    continue;
                }
                if deadline.expired() {
                    let left = target.saturating_sub(st.acct.posted() - st.acct.outstanding());
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("{left} work requests outstanding on {} after {timeout:?}", self.name),
                    )
                    .with_outstanding(left));
                }
            }
            backoff.snooze(&deadline);
        }
    }

    fn failure(&self) -> Option<Error> {
        if let Some(e) = self.failure.get() {
            return Some(e.duplicate());
        }
        // Take pending completions when nobody else is, so errors surface to waiters too.
        if let Ok(mut st) = self.state.try_lock() {
            if let Some(f) = self.receives_flushed() {
                return Some(self.root_cause(f, &mut st));
            }
            if let Err(e) = self.poll(&mut st) {
                return Some(e);
            }
        }
        None
    }

    fn max_write_queue_size(&self) -> usize {
        self.queue
    }

    fn outstanding(&self) -> u64 {
        lock(&self.state).acct.outstanding()
    }

    /// Polls the send CQ once (every post's last WR is signalled, so completion needs no request).
    fn progress(&self, _request: bool) -> Result<super::Progress> {
        self.check()?;
        let mut st = lock(&self.state);
        if st.acct.outstanding() > 0 {
            self.poll(&mut st)?;
        }
        let issued = st.acct.posted();
        Ok(super::Progress { issued, completed: issued - st.acct.outstanding() })
    }
}

impl Drop for IbConnection {
    fn drop(&mut self) {
        // As Ethernet: give operations in flight up to 2 s to land before the QP goes.
        if self.failure.get().is_none()
            && self.outstanding() > 0
            && let Err(e) = self.flush(Duration::from_secs(2))
        {
            debug!(target: "mscclpp::ib", "closing {} with work outstanding: {e}", self.name);
        }
        // The receive thread stops before the QP and the forwarding target go.
        if let Some(f) = &self.fwd {
            f.stop.store(true, Ordering::Release);
        }
        if let Some(h) = lock(&self.recv_thread).take() {
            let _ = h.join();
        }
        if let Some(f) = &self.fwd {
            debug!(target: "mscclpp::ib", "{}: forwarded {} signals", self.name, f.count.load(Ordering::Relaxed));
        }
    }
}

/// The receive thread of a HostNoAtomic connection: takes WRITE_WITH_IMM completions, rebuilds
/// each 64-bit token from its low 32 bits (a smaller low half means the high half grew by one),
/// stores it into the target, and posts the receive again. Any failure is kept as the
/// connection's error (the next flush or wait returns it) and ends the thread.
fn recv_loop(qp: Arc<IbQp>, f: Arc<Forwarding>, ctx: Context) {
    let mut wcs = [ibv_wc::default(); 16];
    let mut tokens = TokenRebuild::new();
    let mut idle_since: Option<Instant> = None;
    let mut armed = false;
    let fail = |e: Error| {
        warn!(target: "mscclpp::ib", "{qp:?}: signal forwarding stopped: {e}");
        let _ = f.failure.set(e);
    };
    while !f.stop.load(Ordering::Acquire) {
        let n = match qp.poll_recv(&mut wcs) {
            Ok(n) => n,
            Err(e) => return fail(e.during("polling the receive CQ")),
        };
        if n == 0 {
            // Spin briefly (a signal on its way lands within microseconds), then sleep on the
            // CQ's completion channel, so an idle connection costs no CPU: arm, poll once more (a
            // completion that came before arming raises no event), then wait. The 100 ms bound
            // only serves the stop flag.
            let t0 = *idle_since.get_or_insert_with(Instant::now);
            if t0.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
            } else if !armed {
                if let Err(e) = qp.arm_recv() {
                    return fail(e.during("arming the receive CQ"));
                }
                armed = true;
            } else {
                if let Err(e) = qp.wait_recv(Duration::from_millis(100)) {
                    return fail(e.during("waiting for a signal"));
                }
                armed = false;
            }
            continue;
        }
        armed = false;
        idle_since = None;
        for wc in &wcs[..n] {
            if wc.status == IBV_WC_WR_FLUSH_ERR {
                // The QP is in the error state: the cause (a failed send) is in the send CQ,
                // and the connection reports that one.
                let _ = f.flushed.set(Error::new(
                    ErrorKind::Ib,
                    format!("{qp:?} entered the error state (its posted receives were flushed)"),
                ));
                return;
            }
            if wc.status != IBV_WC_SUCCESS {
                return fail(Error::new(
                    ErrorKind::Ib,
                    format!("a signal receive failed on {qp:?}: {}", wc_status_text(qp.dev.v, wc.status)),
                ));
            }
            let value = tokens.next(u32::from_be(wc.imm_data));
            let stored = match lock(&f.target).as_ref() {
                None => Err(Error::remote(format!(
                    "a signal (token {value}) arrived on {qp:?}, but no semaphore was built on this connection"
                ))),
                Some(ForwardTarget::Host(r)) => r.atomic_u64(0).map(|w| {
                    w.store(value, Ordering::Release);
                    ctx.inner().notify_tokens();
                }),
                Some(ForwardTarget::Gpu(g)) => g.store(value),
            };
            if let Err(e) = stored.and_then(|_| qp.post_recv_empty(0)) {
                return fail(e);
            }
            f.count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl IbConnection {
    fn fetch_add(&self, dst: u64, rkey: u32, add: u64) -> Op {
        Op::FetchAdd { src: self.atomic_src.addr, lkey: self.atomic_src.lkey, dst, rkey, add }
    }
}
