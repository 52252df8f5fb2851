//! The fake fabric: the thread that executes posted work requests between the fake devices
//! (RDMA writes, atomics, sends into receive queues), with the failures the tests inject.
#![allow(unsafe_code)]

use super::*;

pub(super) fn push_cq(f: &mut Fabric, cq: &Cq, wc: ibv_wc, tag: Option<(Arc<Qp>, u64)>) {
    let mut s = lock(&cq.st);
    if s.entries.len() >= cq.cap {
        s.overflowed = true;
        f.stats.cq_overflows += 1;
        return;
    }
    s.entries.push_back((wc, tag));
    f.stats.max_cq_depth = f.stats.max_cq_depth.max(s.entries.len() as u64);
    if let Some(ch) = &cq.channel
        && cq.armed.swap(false, Ordering::SeqCst)
    {
        lock(&ch.fired).push_back(cq.handle.load(Ordering::SeqCst));
        f.stats.cq_events += 1;
        let _ = nix::unistd::write(&ch.write, &[1u8]);
    }
}

pub(super) enum Outcome {
    Done(c_uint),
    /// No answer yet (peer not ready, link down): try again until RETRY_WINDOW passes.
    Retry,
    /// The receiver has no receive posted (RNR NAK): try again, forever (rnr_retry 7).
    Rnr,
}

pub(super) fn fabric_thread() {
    let g = global();
    loop {
        let seen = *lock(&g.work);
        let progressed = step(g);
        if !progressed {
            let w = lock(&g.work);
            if *w == seen {
                let _ = g.work_cond.wait_timeout(w, Duration::from_millis(2));
            }
        }
    }
}

/// Executes up to a few WRs of every QP; returns whether anything happened.
pub(super) fn step(g: &Global) -> bool {
    let mut f = lock(&g.fabric);
    let qps: Vec<Arc<Qp>> = f.qps.values().cloned().collect();
    let mut progressed = false;
    for a in qps {
        for _ in 0..16 {
            let mut s = lock(&a.st);
            let Some(mut wr) = s.sq.pop_front() else { break };
            let outcome = if s.state == IBV_QPS_ERR {
                Outcome::Done(IBV_WC_WR_FLUSH_ERR)
            } else {
                let dest = s.dest_qpn;
                drop(s);
                let o = execute(&mut f, &a, dest, &wr);
                s = lock(&a.st);
                o
            };
            match outcome {
                Outcome::Rnr => {
                    s.sq.push_front(wr);
                    break;
                }
                Outcome::Retry => {
                    let t = *wr.first_try.get_or_insert_with(Instant::now);
                    if t.elapsed() < RETRY_WINDOW {
                        s.sq.push_front(wr);
                        break;
                    }
                    finish(&mut f, &a, &mut s, &wr, IBV_WC_RETRY_EXC_ERR);
                }
                Outcome::Done(st) => finish(&mut f, &a, &mut s, &wr, st),
            }
            progressed = true;
        }
    }
    progressed
}

pub(super) fn finish(f: &mut Fabric, a: &Arc<Qp>, s: &mut QpState, wr: &Wr, status: c_uint) {
    f.stats.executed += 1;
    if status != IBV_WC_SUCCESS && s.state != IBV_QPS_ERR {
        s.state = IBV_QPS_ERR;
        // Entering the error state flushes the posted receives, as hardware does.
        while let Some(id) = s.rq.pop_front() {
            let wc = ibv_wc {
                wr_id: id,
                status: IBV_WC_WR_FLUSH_ERR,
                opcode: IBV_WC_RECV,
                qp_num: a.qpn,
                ..Default::default()
            };
            push_cq(f, &a.recv_cq, wc, None);
        }
    }
    if wr.signaled || status != IBV_WC_SUCCESS {
        let wc = ibv_wc {
            wr_id: wr.wr_id,
            status,
            opcode: if wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD { IBV_WC_FETCH_ADD } else { IBV_WC_RDMA_WRITE },
            qp_num: a.qpn,
            byte_len: wr.sge.map(|g| g.length).unwrap_or(0),
            ..Default::default()
        };
        push_cq(f, &a.send_cq, wc, Some((a.clone(), wr.seq)));
    }
}

/// Runs one WR of QP `a` against its peer `dest`.
pub(super) fn execute(f: &mut Fabric, a: &Arc<Qp>, dest: u32, wr: &Wr) -> Outcome {
    let link_broken = f.devs.get(a.dev).is_some_and(|d| d.link_broken.load(Ordering::SeqCst));
    let Some(b) = f.qps.get(&dest).cloned() else { return Outcome::Retry };
    if link_broken || f.devs.get(b.dev).is_some_and(|d| d.link_broken.load(Ordering::SeqCst)) {
        return Outcome::Retry;
    }
    let (b_state, b_access) = {
        let s = lock(&b.st);
        (s.state, s.access)
    };
    if b_state != IBV_QPS_RTR && b_state != IBV_QPS_RTS {
        // A QP not yet at RTR (or in error) drops the packets: the sender retries.
        return Outcome::Retry;
    }
    // Local buffer.
    let local = match wr.sge {
        Some(g) if g.length > 0 || wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD => {
            let ok = f.mrs.get(&g.lkey).is_some_and(|m| {
                m.pd == a.pd
                    && g.addr >= m.addr
                    && g.addr.checked_add(g.length as u64).is_some_and(|e| e <= m.addr + m.len)
                    && (wr.opcode != IBV_WR_ATOMIC_FETCH_AND_ADD || m.access & IBV_ACCESS_LOCAL_WRITE != 0)
            });
            if !ok {
                return Outcome::Done(IBV_WC_LOC_PROT_ERR);
            }
            Some(g)
        }
        _ => None,
    };
    let len = local.map(|g| g.length as u64).unwrap_or(0);
    let (need, n) = match wr.opcode {
        IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => (IBV_ACCESS_REMOTE_WRITE, len),
        IBV_WR_ATOMIC_FETCH_AND_ADD => {
            if local.is_none_or(|g| g.length != 8) || !wr.remote_addr.is_multiple_of(8) {
                return Outcome::Done(IBV_WC_REM_INV_REQ_ERR);
            }
            (IBV_ACCESS_REMOTE_ATOMIC, 8)
        }
        _ => return Outcome::Done(IBV_WC_REM_INV_REQ_ERR),
    };
    if n > 0 {
        let ok = b_access & need != 0
            && f.mrs.get(&wr.rkey).is_some_and(|m| {
                m.dev == b.dev
                    && m.pd == b.pd
                    && m.access & need != 0
                    && wr.remote_addr >= m.addr
                    && wr.remote_addr.checked_add(n).is_some_and(|e| e <= m.addr + m.len)
            });
        if !ok {
            return Outcome::Done(IBV_WC_REM_ACCESS_ERR);
        }
    }
    let recv = if wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM {
        match lock(&b.st).rq.pop_front() {
            Some(id) => Some(id),
            None => return Outcome::Rnr,
        }
    } else {
        None
    };
    match wr.opcode {
        IBV_WR_ATOMIC_FETCH_AND_ADD => {
            let Some(g) = local else { return Outcome::Done(IBV_WC_LOC_PROT_ERR) };
            // SAFETY: both words are 8-aligned and inside live MRs (checked above under the
            // fabric lock, which dereg_mr takes, so they stay registered while we touch them);
            // a registered region is memory its owner keeps valid while registered.
            unsafe {
                let word = &*(wr.remote_addr as *const AtomicU64);
                let old = word.fetch_add(wr.add, Ordering::AcqRel);
                std::ptr::write_unaligned(g.addr as *mut u64, old);
            }
        }
        _ => {
            if let Some(g) = local {
                // SAFETY: both ranges are inside live MRs (see above); ptr::copy allows overlap.
                unsafe { std::ptr::copy(g.addr as *const u8, wr.remote_addr as *mut u8, g.length as usize) };
            }
        }
    }
    if let Some(id) = recv {
        let wc = ibv_wc {
            wr_id: id,
            status: IBV_WC_SUCCESS,
            opcode: IBV_WC_RECV_RDMA_WITH_IMM,
            byte_len: n as u32,
            imm_data: wr.imm,
            qp_num: b.qpn,
            src_qp: a.qpn,
            wc_flags: IBV_WC_WITH_IMM,
            ..Default::default()
        };
        push_cq(f, &b.recv_cq, wc, None);
    }
    Outcome::Done(IBV_WC_SUCCESS)
}
