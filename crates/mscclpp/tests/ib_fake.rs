//! The IB transport on the in-process verbs provider (`mscclpp::ib::fake`, ranks as threads):
//! the shared connection suite, then IB's fault and accounting tests.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::harnesses::{self, ib_config};
use common::suite::{Harness, T, setup};
use common::{Rank, pattern};
use mscclpp::ib::fake;
use mscclpp::{
    Bootstrap, Buffer, Communicator, Context, Device, Endpoint, EndpointConfig, ErrorKind, Host2DeviceSemaphore,
    IbMode, Transport,
};

static FAKE_IB: Harness = harnesses::FAKE_IB;

connection_suite!(&FAKE_IB);

fn no_atomic_config(queue: Option<usize>) -> EndpointConfig {
    let mut c = ib_config(queue);
    c.ib.mode = IbMode::HostNoAtomic;
    c
}

/// The suite again in HostNoAtomic mode: signals by write-with-immediate and a receive thread.
mod no_atomic {
    use super::*;
    use crate::common;

    static FAKE_IB_NO_ATOMIC: Harness = Harness { config: no_atomic_config, atomics: false, ..harnesses::FAKE_IB };

    connection_suite!(&FAKE_IB_NO_ATOMIC);
}

/// Runs `body` as `size` ranks (threads).
fn threads(size: usize, body: impl Fn(&Rank) + Sync) {
    common::suite::run_threads(size, body)
}

/// A device of its own per fault test, so injected faults stay inside the test.
fn own_device(name: &'static str) -> Harness {
    fake::install().unwrap();
    fake::add_device(name);
    Harness {
        ib_device: Some(name),
        config: |q| {
            let mut c = ib_config(q);
            c.ib.max_cq_size = 4;
            c.ib.max_send_wr = 6;
            c.ib.max_wr_per_send = 3;
            c.ib.max_cq_poll_num = 2;
            c
        },
        ..harnesses::FAKE_IB
    }
}

/// A broken link: flush first times out (naming peer and QP), then fails with "retry counter
/// exceeded"; the waiter and every later call fail at once with that error.
#[test]
fn broken_link_fails_every_call_without_hanging() {
    let h = own_device("brk0");
    threads(2, |r| {
        let s = setup(r, &h, 1 << 20, None);
        let peer = 1 - r.rank;
        let conn = s.conns[peer].as_ref().unwrap();
        let dst = s.remote[peer].as_ref().unwrap();
        if r.rank == 0 {
            fake::set_link_broken("brk0", true).unwrap();
            conn.write(dst, 0, s.local.memory(), 0, 4096).unwrap();
            s.sems[peer].as_ref().unwrap().signal().unwrap();
            let t0 = Instant::now();
            let e = conn.flush(Duration::from_millis(200)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert_eq!(e.peer(), Some(1), "{e}");
            assert!(e.to_string().contains("QP") && e.to_string().contains("brk0"), "{e}");
            // the structured detail, not only the text: the write and the signal are outstanding
            assert_eq!((e.operation(), e.transport()), (Some("flush"), Some(Transport::IB0)), "{e}");
            assert!(e.outstanding().is_some_and(|n| n >= 2), "{e}: outstanding {:?}", e.outstanding());
            // It waited its 200 ms, and returned then, not at some later limit (with a loaded
            // machine's margin).
            assert!(t0.elapsed() >= Duration::from_millis(200), "{:?}", t0.elapsed());
            assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
            let e = conn.flush(T).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Ib, "{e}");
            assert!(e.to_string().contains("retry counter exceeded"), "{e}");
            assert!(t0.elapsed() < fake::RETRY_WINDOW + Duration::from_secs(15), "{:?}", t0.elapsed());
            let t1 = Instant::now();
            let later = conn.write(dst, 0, s.local.memory(), 0, 8).unwrap_err();
            assert!(later.to_string().contains("retry counter exceeded"), "{later}");
            let w = s.sems[peer].as_ref().unwrap().wait(T).unwrap_err();
            assert_ne!(w.kind(), ErrorKind::Timeout, "{w}");
            assert!(conn.status().is_err());
            // At once: not after the wait's 30 s limit (a margin for a loaded machine).
            assert!(t1.elapsed() < T / 3, "later calls must fail at once, took {:?}", t1.elapsed());
            println!("flush: {e}\nwait: {w}");
        }
        s.bs.barrier().unwrap();
        if r.rank == 0 {
            fake::set_link_broken("brk0", false).unwrap();
        }
    });
}

/// Writing into memory the peer deregistered: a remote access error, not a hang or a stray write.
#[test]
fn deregistered_destination_is_a_remote_access_error() {
    let h = own_device("acc0");
    threads(2, |r| {
        let s = setup(r, &h, 4096, None);
        let extra = Buffer::new(s.comm.context(), 4096, Transport::IB0.into()).unwrap();
        let peer = 1 - r.rank;
        s.comm.send_memory(extra.memory(), peer, 7).unwrap();
        let theirs = s.comm.recv_memory(peer, 7).unwrap().wait().unwrap();
        drop(extra); // deregisters this side's copy
        s.bs.barrier().unwrap();
        if r.rank == 0 {
            let conn = s.conns[1].as_ref().unwrap();
            conn.write(&theirs, 0, s.local.memory(), 0, 64).unwrap();
            let e = conn.flush(T).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Ib, "{e}");
            assert!(e.to_string().contains("remote access error"), "{e}");
            assert_eq!(e.peer(), Some(1));
            println!("{e}");
        }
        s.bs.barrier().unwrap();
    });
}

/// Tiny CQ (4), send queue (6) and batches (3) with many writes and atomics from two threads:
/// the transport never overflows the CQ nor posts past the send queue, and every byte lands.
#[test]
fn tiny_queues_never_overflow() {
    let h = own_device("acct0");
    let before = fake::stats();
    threads(2, |r| {
        let s = setup(r, &h, 1 << 16, Some(5));
        if r.rank == 0 {
            let conn = s.conns[1].as_ref().unwrap().clone();
            let dst = s.remote[1].as_ref().unwrap().clone();
            let src = Buffer::new(s.comm.context(), 1 << 16, Transport::IB0.into()).unwrap();
            src.write(0, &pattern(5, 1 << 16)).unwrap();
            std::thread::scope(|sc| {
                for t in 0..2u64 {
                    let (conn, dst, src) = (conn.clone(), dst.clone(), src.clone());
                    sc.spawn(move || {
                        for i in 0..3000u64 {
                            let off = ((i * 2 + t) * 8) % ((1 << 16) - 64) + 64;
                            conn.write(&dst, off, src.memory(), off, 8).unwrap();
                            if i % 7 == 0 {
                                conn.atomic_add(&dst, 0, 1).unwrap();
                            }
                            assert!(conn.outstanding() <= 5);
                        }
                    });
                }
            });
            conn.flush(T).unwrap();
            s.sems[1].as_ref().unwrap().signal().unwrap();
        } else {
            s.sems[0].as_ref().unwrap().wait(T).unwrap();
            let v = s.local.to_vec().unwrap();
            assert_eq!(s.local.atomic_u64(0).unwrap().load(std::sync::atomic::Ordering::Acquire), 2 * 429);
            // Words 64 .. 64 + 6000 * 8 were written; the rest stays zero.
            let end = 64 + 6000 * 8;
            assert!(v[64..end] == pattern(5, 1 << 16)[64..end], "data differs");
            assert!(v[end..].iter().all(|b| *b == 0), "bytes past the writes changed");
        }
        s.bs.barrier().unwrap();
    });
    let after = fake::stats();
    assert_eq!(after.cq_overflows, before.cq_overflows, "a CQ overflowed: {after:?}");
    assert_eq!(after.sq_full_refusals, before.sq_full_refusals, "a post exceeded max_send_wr: {after:?}");
    println!("{after:?}");
}

/// Connecting endpoints whose IB modes differ is an error at connect time (MSCCL++ hangs or fails
/// later); an endpoint connects once; the RoCE v2 IPv4 GID is chosen by default.
#[test]
fn mode_mismatch_and_reuse_are_connect_errors() {
    fake::install().unwrap();
    let ctx = Context::new();
    ctx.set_ib_device(Transport::IB0, "fake1").unwrap();
    let a = ctx.create_endpoint(&EndpointConfig::new(Transport::IB0)).unwrap();
    let b = ctx.create_endpoint(&EndpointConfig::new(Transport::IB0)).unwrap();
    let mut bytes = b.serialize();
    let n = bytes.len();
    assert_eq!(bytes[n - 1], 1, "mode byte of a Host endpoint");
    bytes[n - 1] = 2; // the peer says HostNoAtomic
    let odd = Endpoint::deserialize(&bytes).unwrap();
    let e = ctx.connect(&a, &odd).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    assert!(e.to_string().contains("IB mode mismatch"), "{e}");
    // A fresh pair connects; the first endpoint is then used up.
    let c = ctx.create_endpoint(&EndpointConfig::new(Transport::IB0)).unwrap();
    let d = ctx.create_endpoint(&EndpointConfig::new(Transport::IB0)).unwrap();
    let rc = Endpoint::deserialize(&c.serialize()).unwrap();
    let rd = Endpoint::deserialize(&d.serialize()).unwrap();
    let _cd = ctx.connect(&c, &rd).unwrap();
    let _dc = ctx.connect(&d, &rc).unwrap();
    let e = ctx.connect(&c, &rd).unwrap_err();
    assert!(e.to_string().contains("already used"), "{e}");
    assert_eq!(ib_gid_of(&c.serialize()), [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]);
    // A device that does not exist is named.
    let ctx2 = Context::new();
    ctx2.set_ib_device(Transport::IB0, "nope9").unwrap();
    let e = Buffer::new(&ctx2, 64, Transport::IB0.into()).unwrap_err();
    assert!(e.to_string().contains("nope9") && e.to_string().contains("fake0"), "{e}");
}

/// The GID in a serialized IB endpoint (after magic, version, transport, device, hashes, queue,
/// kind, lid and qpn).
fn ib_gid_of(b: &[u8]) -> [u8; 16] {
    let at = 4 + 2 + 1 + 5 + 8 + 8 + 4 + 1 + 2 + 4;
    b[at..at + 16].try_into().unwrap()
}

/// A HostNoAtomic harness on its own device with `max_recv_wr` receives kept posted.
fn no_atomic_on(name: &'static str, recv: u32) -> Harness {
    let mut h = own_device(name);
    h.atomics = false;
    h.config = match recv {
        2 => |q| {
            let mut c = no_atomic_config(q);
            c.ib.max_recv_wr = 2;
            c
        },
        _ => no_atomic_config,
    };
    h
}

/// HostNoAtomic tokens cross 2^32 and take jumps just under 2^32 and arrive whole (the receiver
/// rebuilds the high half); updates it could not rebuild are refused and change nothing.
#[test]
fn no_atomic_tokens_cross_2_pow_32() {
    let h = no_atomic_on("wrap0", 16);
    let mut seq = vec![(1u64 << 32) - 3];
    for _ in 0..6 {
        seq.push(seq[seq.len() - 1] + 1);
    }
    seq.push(seq[seq.len() - 1] + (1 << 32) - 1);
    seq.push(seq[seq.len() - 1] + 1);
    seq.push(seq[seq.len() - 1] + 12345);
    threads(2, |r| {
        let s = setup(r, &h, 4096, None);
        let peer = 1 - r.rank;
        let conn = s.conns[peer].as_ref().unwrap();
        let sem = s.sems[peer].as_ref().unwrap().host().unwrap();
        assert_eq!(conn.signal_forwarding().as_deref(), Some("host store"));
        let out = AtomicU64::new(0);
        for (i, &v) in seq.iter().enumerate() {
            if r.rank == 0 {
                conn.update_and_sync(sem.semaphore().remote_memory(), 0, &out, v).unwrap();
                conn.flush(T).unwrap();
                if i == 0 {
                    for bad in [v, v - 1, v + (1 << 32), 0] {
                        let e = conn.update_and_sync(sem.semaphore().remote_memory(), 0, &out, bad).unwrap_err();
                        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{v} -> {bad}: {e}");
                        assert!(e.to_string().contains("2^32"), "{e}");
                        assert_eq!(out.load(Ordering::Acquire), v, "a refused update changed the outbound token");
                    }
                }
            }
            s.bs.barrier().unwrap();
            if r.rank == 1 {
                common::wait_until(&format!("token {i} = {v}"), T, || sem.inbound_token() == v);
                assert_eq!(sem.inbound_token(), v, "token {i}");
            }
            s.bs.barrier().unwrap();
        }
    });
}

/// Far more signals in a burst than receives posted (2): the sender waits for receives (RNR
/// retry) instead of failing, and all of them arrive in order.
#[test]
fn no_atomic_burst_past_the_receive_queue() {
    let h = no_atomic_on("burst0", 2);
    threads(2, |r| {
        let s = setup(r, &h, 1 << 16, None);
        let peer = 1 - r.rank;
        let sem = s.sems[peer].as_ref().unwrap().host().unwrap();
        const N: u64 = 2000;
        if r.rank == 0 {
            let conn = s.conns[1].as_ref().unwrap();
            let src = Buffer::new(s.comm.context(), 1 << 16, Transport::IB0.into()).unwrap();
            src.write(0, &pattern(3, 1 << 16)).unwrap();
            conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 1 << 16).unwrap();
            for _ in 0..N {
                sem.signal().unwrap();
            }
            conn.flush(T).unwrap();
        } else {
            for i in 0..N {
                sem.wait(T).unwrap_or_else(|e| panic!("signal {i}: {e}"));
                if i == 0 {
                    assert!(s.local.to_vec().unwrap() == pattern(3, 1 << 16), "the first signal overtook the write");
                }
            }
            assert_eq!(sem.inbound_token(), N);
        }
        s.bs.barrier().unwrap();
    });
}

/// The receiver closes its connection while signals are in flight: its receive thread stops and
/// the close returns promptly; the sender's calls end with an error or success, never a hang.
#[test]
fn no_atomic_close_with_signals_in_flight() {
    let h = no_atomic_on("close0", 16);
    threads(2, |r| {
        let s = setup(r, &h, 4096, None);
        let peer = 1 - r.rank;
        if r.rank == 1 {
            let sem = s.sems[0].as_ref().unwrap();
            sem.wait(T).unwrap();
            let t0 = Instant::now();
            drop(s);
            assert!(t0.elapsed() < Duration::from_secs(15), "closing took {:?}", t0.elapsed());
            return;
        }
        let conn = s.conns[peer].as_ref().unwrap();
        let sem = s.sems[peer].as_ref().unwrap();
        let t0 = Instant::now();
        let mut first_err = None;
        for _ in 0..20_000 {
            if let Err(e) = sem.signal() {
                first_err = Some(e);
                break;
            }
        }
        let flush = conn.flush(T);
        let el = t0.elapsed();
        assert!(el < fake::RETRY_WINDOW + Duration::from_secs(20), "took {el:?}");
        println!("signal: {first_err:?}\nflush: {flush:?}\nafter {el:?}");
    });
}

/// After a long idle the receive thread sleeps on its CQ's completion channel (no CPU); a signal
/// then wakes it, and data written before the signal is there.
#[test]
fn no_atomic_signal_after_idle_wakes_the_receiver() {
    let h = no_atomic_on("idle0", 16);
    let before = fake::stats().cq_events;
    threads(2, |r| {
        let s = setup(r, &h, 4096, None);
        let peer = 1 - r.rank;
        let sem = s.sems[peer].as_ref().unwrap();
        for round in 0..3u64 {
            if r.rank == 0 {
                // The idle is what this test is about: 300 ms is thousands of times the receive
                // thread's 50 us before it arms its CQ and sleeps. (The fake provider does not
                // say per device whether a CQ is armed, so there is no event to wait for.)
                std::thread::sleep(Duration::from_millis(300));
                let src = Buffer::new(s.comm.context(), 4096, Transport::IB0.into()).unwrap();
                src.write(0, &pattern(round, 4096)).unwrap();
                let conn = s.conns[1].as_ref().unwrap();
                conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 4096).unwrap();
                sem.signal().unwrap();
                conn.flush(T).unwrap();
            } else {
                sem.wait(T).unwrap();
                assert!(s.local.to_vec().unwrap() == pattern(round, 4096), "round {round}: data behind its signal");
            }
            s.bs.barrier().unwrap();
        }
    });
    assert!(fake::stats().cq_events > before, "the receive threads never slept on their completion channel");
}

/// One semaphore per HostNoAtomic connection: a second is refused clearly on both sides.
#[test]
fn no_atomic_second_semaphore_is_refused() {
    let h = no_atomic_on("wrap0", 16);
    threads(2, |r| {
        let s = setup(r, &h, 4096, None);
        let peer = 1 - r.rank;
        let e = s.comm.build_semaphore(s.conns[peer].as_ref().unwrap(), peer, 9).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("one semaphore"), "{e}");
        s.bs.barrier().unwrap();
    });
}

/// A NIC without RDMA atomics: endpoints fall back to HostNoAtomic mode by themselves.
#[test]
fn device_without_atomics_uses_host_no_atomic() {
    fake::install().unwrap();
    fake::add_device("noat0");
    fake::set_atomics("noat0", false).unwrap();
    let ctx = Context::new();
    ctx.set_ib_device(Transport::IB0, "noat0").unwrap();
    let a = ctx.create_endpoint(&EndpointConfig::new(Transport::IB0)).unwrap();
    let b = ctx.create_endpoint(&EndpointConfig::new(Transport::IB0)).unwrap();
    let ab = a.serialize();
    assert_eq!(ab[ab.len() - 1], 2, "mode byte: HostNoAtomic");
    let ra = Endpoint::deserialize(&ab).unwrap();
    let rb = Endpoint::deserialize(&b.serialize()).unwrap();
    let c = ctx.connect(&a, &rb).unwrap();
    let _d = ctx.connect(&b, &ra).unwrap();
    assert_eq!(c.signal_forwarding().as_deref(), Some("none yet (no semaphore built)"));
}

/// GPU memory registers for IB (dma-buf through the CUDA driver, the provider's
/// ibv_reg_dmabuf_mr); where the NIC refuses it, the error names both ways tried.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_memory_registers_for_ib_or_says_why_not() {
    fake::install().unwrap();
    let ctx = Context::new();
    ctx.set_ib_device(Transport::IB0, "fake0").unwrap();
    let buf = mscclpp::gpu::DeviceBuffer::new(&ctx, 0, 1 << 20, Transport::IB0.into()).unwrap();
    let info = buf.memory().ib_info(Transport::IB0).expect("IB0 MR info");
    assert_eq!(info.addr, buf.device_ptr());
    fake::add_device("refuse0");
    fake::set_refuse_registration("refuse0", true).unwrap();
    let ctx2 = Context::new();
    ctx2.set_ib_device(Transport::IB0, "refuse0").unwrap();
    let e = mscclpp::gpu::DeviceBuffer::new(&ctx2, 0, 1 << 20, Transport::IB0.into()).unwrap_err();
    let t = e.to_string();
    assert!(t.contains("dma-buf") && t.contains("ibv_reg_mr") && t.contains("refuse0"), "{t}");
    println!("registered GPU memory: {info:?}\nrefused: {t}");
}

/// HostNoAtomic signals into a GPU token (Host2DeviceSemaphore): forwarded by GDRCopy where it
/// exists, otherwise by the fallback; counted, and across 2^32, exactly.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_token_forwarding_without_gdrcopy() {
    fake::install().unwrap();
    threads(2, |r| {
        let bs: std::sync::Arc<dyn Bootstrap> = std::sync::Arc::new(r.bootstrap(T));
        let comm = Communicator::new(bs.clone());
        comm.context().set_ib_device(Transport::IB0, "fake0").unwrap();
        let peer = 1 - r.rank;
        let mut cfg = no_atomic_config(None);
        cfg.device = Device::Gpu(0);
        let conn = comm.connect(&cfg, peer, 0).unwrap().wait().unwrap();
        let sem = Host2DeviceSemaphore::new(comm.build_semaphore(&conn, peer, 1).unwrap().wait().unwrap()).unwrap();
        let how = conn.signal_forwarding().unwrap();
        println!("rank {}: signal forwarding into the GPU by {how}", r.rank);
        assert!(["GDRCopy (BAR1 mapping)", "cuStreamWriteValue64", "cuMemcpyHtoDAsync"].contains(&how.as_str()));
        const N: u64 = 200;
        if r.rank == 0 {
            for _ in 0..N {
                sem.signal().unwrap();
            }
            conn.flush(T).unwrap();
        } else {
            for _ in 0..N {
                sem.wait(T).unwrap();
            }
            assert_eq!(sem.inbound_token().unwrap(), N);
        }
        bs.barrier().unwrap();
        // Across 2^32: the GPU word holds the whole 64-bit value.
        let target = (1u64 << 32) + 7;
        if r.rank == 0 {
            let out = AtomicU64::new(N);
            conn.update_and_sync(sem.semaphore().remote_memory(), 0, &out, (1 << 32) - 1).unwrap();
            conn.update_and_sync(sem.semaphore().remote_memory(), 0, &out, target).unwrap();
            conn.flush(T).unwrap();
        }
        bs.barrier().unwrap();
        if r.rank == 1 {
            common::wait_until("the token across 2^32", T, || sem.inbound_token().unwrap() == target);
            assert_eq!(sem.inbound_token().unwrap(), target);
        }
        bs.barrier().unwrap();
    });
}
