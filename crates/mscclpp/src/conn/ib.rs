//! The IB transport (Host mode): RDMA WRITE for data and 8-byte FETCH_AND_ADD for tokens and
//! atomics on one RC queue pair, completions polled by the calling threads.
//!
//! Accounting: every work request gets a sequence number. Only the last WR of each post is
//! signalled, with its sequence number as `wr_id`; a successful completion of WR `s` means every
//! WR up to `s` is done (RC completes in order). So `completed` is one number, `flush` waits for
//! it to reach what was posted, and a post waits (polling) while it would exceed the queue bound
//! (`max_write_queue_size`), the QP's `max_send_wr`, or a signalled count equal to the send CQ's
//! depth: the CQ can never overflow. The first failed completion breaks the connection; every
//! later call returns that error.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::context::{Context, lock};
use crate::endpoint::{Endpoint, EndpointKind};
use crate::error::{Error, ErrorKind, Result};
use crate::ib::dev::{IbMr, IbQp, SendOp as Op, wc_status_text};
use crate::ib::verbs::abi::*;
use crate::memory::RegisteredMemory;
use crate::sys::hostmem::HostAlloc;
use crate::transport::{IbMode, Transport};

use super::{ConnInner, Connection, ConnectionImpl};

/// How long a post waits for room in a full queue without any completion before failing.
const QUEUE_WAIT: Duration = Duration::from_secs(30);
/// Largest single RDMA WRITE (bigger writes are split).
const MAX_CHUNK: u64 = 1 << 30;

struct SendState {
    /// Sequence number of the next WR.
    posted: u64,
    /// Every WR below this completed successfully.
    completed: u64,
    /// Signalled WRs posted and not yet polled.
    signaled_out: u32,
    wcs: Vec<ibv_wc>,
}

pub(crate) struct IbConnection {
    qp: IbQp,
    /// Where FETCH_AND_ADD returns the old value (never read).
    atomic_src: IbMr,
    _atomic_mem: Arc<HostAlloc>,
    state: Mutex<SendState>,
    failure: OnceLock<Error>,
    queue: usize,
    max_wr_per_send: usize,
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
    qp.connect(rqp)?;
    let alloc = Arc::new(HostAlloc::zeroed(8)?);
    let atomic_src = qp.dev.reg_mr(alloc.as_ptr() as u64, 8)?;
    let name = format!("{:?} -> QP {}", qp, rqp.qpn);
    debug!(target: "mscclpp::ib", "connected {name} (path MTU index {})", (qp.port.active_mtu as u8).min(rqp.mtu));
    let cfg = &l.config.ib;
    let chunk = MAX_CHUNK.min(qp.port.max_msg_sz.max(4096) as u64);
    let conn = IbConnection {
        atomic_src,
        _atomic_mem: alloc,
        state: Mutex::new(SendState {
            posted: 0,
            completed: 0,
            signaled_out: 0,
            wcs: vec![ibv_wc::default(); cfg.max_cq_poll_num.clamp(1, 4096) as usize],
        }),
        failure: OnceLock::new(),
        queue: local.max_write_queue_size(),
        max_wr_per_send: cfg.max_wr_per_send.max(1) as usize,
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
            None => Ok(()),
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
            st.signaled_out = st.signaled_out.saturating_sub(1);
            if wc.status != IBV_WC_SUCCESS {
                let what = match wc.opcode {
                    4 => "FETCH_AND_ADD",
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
            st.completed = st.completed.max(wc.wr_id + 1);
        }
        Ok(n)
    }

    /// Posts `ops` in batches of `max_wr_per_send`, each batch's last WR signalled, waiting for
    /// room when the queue bound, the send queue or the CQ would be exceeded.
    fn post(&self, ops: &[Op]) -> Result<()> {
        self.check()?;
        let sq = (self.qp.max_send_wr as usize).max(1);
        let cq = self.qp.send_cq.depth.max(1);
        let batch_max = self.max_wr_per_send.min(sq).min(self.queue.max(1));
        let mut st = lock(&self.state);
        for batch in ops.chunks(batch_max) {
            let mut waited: Option<Instant> = None;
            loop {
                let inflight = (st.posted - st.completed) as usize;
                if inflight + batch.len() <= self.queue.max(batch.len()).min(sq) && st.signaled_out < cq {
                    break;
                }
                if self.poll(&mut st)? == 0 {
                    let t0 = *waited.get_or_insert_with(Instant::now);
                    if t0.elapsed() > QUEUE_WAIT {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "the send queue of {} stayed full ({} work requests outstanding) for {QUEUE_WAIT:?}",
                                self.name,
                                st.posted - st.completed
                            ),
                        ));
                    }
                    std::hint::spin_loop();
                } else {
                    waited = None;
                }
            }
            self.qp.post_batch(batch, st.posted).map_err(|e| self.fail(e))?;
            st.posted += batch.len() as u64;
            st.signaled_out += 1;
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
    fn remote(&self, dst: &RegisteredMemory, t: Transport, off: u64) -> Result<(u64, u32)> {
        if dst.is_local() {
            return Err(Error::invalid_usage(
                "the destination is this process's own registration; an IB connection writes into a peer's memory",
            ));
        }
        let info = dst.ib_info(t).ok_or_else(|| {
            Error::invalid_usage(format!("the destination memory carries no {t} registration (memory region)"))
        })?;
        Ok((info.addr + off, info.rkey))
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
        self.check()?;
        let t = self.transport_of(dst)?;
        let (raddr, rkey) = self.remote(dst, t, dst_off)?;
        let st = self.local_transport();
        let mr = src
            .local()
            .and_then(|l| st.ib_index().and_then(|i| l.ib_mrs[i].clone()))
            .ok_or_else(|| Error::invalid_usage(format!("the source memory has no {st} memory region")))?;
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
        let t = self.transport_of(dst)?;
        let (raddr, rkey) = self.remote(dst, t, dst_off)?;
        self.post(&[self.fetch_add(raddr, rkey, new.wrapping_sub(old))])
    }

    fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
        let t = self.transport_of(dst)?;
        let (raddr, rkey) = self.remote(dst, t, dst_off)?;
        self.post(&[self.fetch_add(raddr, rkey, value as u64)])
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.check()?;
        let start = Instant::now();
        let target = lock(&self.state).posted;
        let mut spins = 0u32;
        loop {
            {
                let mut st = lock(&self.state);
                if st.completed >= target {
                    return Ok(());
                }
                if self.poll(&mut st)? > 0 {
                    spins = 0;
                    if st.completed >= target {
                        return Ok(());
                    }
                    continue;
                }
                if start.elapsed() >= timeout {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "{} work requests outstanding on {} after {timeout:?}",
                            target.saturating_sub(st.completed),
                            self.name
                        ),
                    ));
                }
            }
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn failure(&self) -> Option<Error> {
        if let Some(e) = self.failure.get() {
            return Some(e.duplicate());
        }
        // Take pending completions when nobody else is, so errors surface to waiters too.
        if let Ok(mut st) = self.state.try_lock() {
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
        let st = lock(&self.state);
        st.posted - st.completed
    }
}

impl IbConnection {
    /// The peer's transport (the one its memory carries MR info for).
    fn transport_of(&self, _dst: &RegisteredMemory) -> Result<Transport> {
        Ok(self.remote_transport)
    }
    fn local_transport(&self) -> Transport {
        self.local_transport
    }
    fn fetch_add(&self, dst: u64, rkey: u32, add: u64) -> Op {
        Op::FetchAdd { src: self.atomic_src.addr, lkey: self.atomic_src.lkey, dst, rkey, add }
    }
}
