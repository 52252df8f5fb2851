//! The proxy service without a GPU: a host-backed FIFO fed by `HostProducer`s (pushing as kernels
//! do) drives a `ProxyService` over Ethernet and over IB on the in-process test provider; two
//! ranks as threads of this process.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::harnesses;
use common::suite::{Harness, T, run_threads};
use common::{Rank, pattern};
use mscclpp::device::proxy::{PROXY_FAILED, PROXY_STOPPED, ProxyConfig, ProxyService, SemaphoreId};
use mscclpp::device::trigger::{ProxyTrigger, Put};
use mscclpp::{Bootstrap, Buffer, Communicator, ErrorKind, Host2HostSemaphore, RegisteredMemory, Semaphore};

static ETHERNET: Harness = harnesses::ETHERNET;
static FAKE_IB: Harness = harnesses::FAKE_IB;

/// One rank's side: the connection to the other rank, this rank's buffer and the peer's, a
/// semaphore the proxy signals (plain) and one this rank waits on (the same pair, host side).
struct Side {
    bs: Arc<dyn Bootstrap>,
    comm: Communicator,
    local: Buffer,
    remote: RegisteredMemory,
    /// Signalled by the proxy (rank 0).
    proxy_sem: Option<Semaphore>,
    /// Waited on by the host (rank 1).
    wait_sem: Option<Host2HostSemaphore>,
}

fn side(r: &Rank, h: &Harness, len: usize, queue: Option<usize>) -> Side {
    let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
    let comm = Communicator::new(bs.clone());
    h.prepare_context(comm.context());
    let peer = 1 - r.rank;
    let local = Buffer::new(comm.context(), len, h.flags()).unwrap();
    let conn = comm.connect(&(h.config)(queue), peer, 0).unwrap();
    comm.send_memory(local.memory(), peer, 1).unwrap();
    let remote = comm.recv_memory(peer, 1).unwrap();
    let conn = conn.wait().unwrap();
    let remote = remote.wait().unwrap();
    let sem = comm.build_semaphore(&conn, peer, 2).unwrap().wait().unwrap();
    let (proxy_sem, wait_sem) =
        if r.rank == 0 { (Some(sem), None) } else { (None, Some(Host2HostSemaphore::new(sem).unwrap())) };
    bs.barrier().unwrap();
    Side { bs, comm, local, remote, proxy_sem, wait_sem }
}

fn config() -> ProxyConfig {
    ProxyConfig::default().idle_backoff(true)
}

/// Waits (bounded) until the flush pushed at `pos` is published.
fn wait_flushed(proxy: &ProxyService, sem: SemaphoreId, pos: u64) {
    common::wait_until(&format!("the flush at position {pos} published"), T, || {
        proxy.flush_done_pos(sem).unwrap() > pos
    });
    let done = proxy.flush_done_pos(sem).unwrap();
    assert_ne!(done, u64::MAX, "the proxy released the flush at {pos} by failing: {:?}", proxy.status());
}

const PRODUCERS: u64 = 4;
const ROUNDS: u64 = 40;
const CHUNK: usize = 4096;

/// Four producer threads push put+signal triggers (distinct source and destination chunks,
/// sizes 1 B .. 4 KiB), each flushing every 8 rounds and waiting for its own flush position;
/// then atomicAdds. The peer sees every chunk byte-exact after its signal, the signal count is
/// exact, flush positions are published, and `stop` returns `Ok`.
fn writes_signals_flushes(r: &Rank, h: &Harness) {
    let len = (PRODUCERS * ROUNDS) as usize * CHUNK + 4096;
    let s = side(r, h, len, Some(64));
    let total = PRODUCERS * ROUNDS;
    let size_of = |k: u64| 1 + ((k * 7919) % CHUNK as u64) as usize;
    if r.rank == 0 {
        let src = Buffer::new(s.comm.context(), len, h.flags()).unwrap();
        for k in 0..total {
            let off = k as usize * CHUNK;
            src.write(off, &pattern(k, size_of(k))).unwrap();
        }
        let mut proxy = ProxyService::host_backed(config().max_write_queue_size(Some(16))).unwrap();
        let sem = proxy.add_semaphore(s.proxy_sem.clone().unwrap()).unwrap();
        let dst = proxy.add_memory(s.remote.clone()).unwrap();
        let srcm = proxy.add_memory(src.memory().clone()).unwrap();
        proxy.start().unwrap();
        assert!(proxy.add_memory(src.memory().clone()).is_err(), "registries are frozen after start");
        std::thread::scope(|sc| {
            for p in 0..PRODUCERS {
                let producer = proxy.fifo().host_producer().unwrap();
                let proxy = &proxy;
                sc.spawn(move || {
                    for i in 0..ROUNDS {
                        let k = i * PRODUCERS + p;
                        let off = (k as usize * CHUNK) as u32;
                        let put = Put {
                            src_mem: srcm.0,
                            src_off: off,
                            dst_mem: dst.0,
                            dst_off: off,
                            size: size_of(k) as u32,
                        };
                        let t = if i % 8 == 7 {
                            ProxyTrigger::put_with_signal_and_flush(sem.0, put).unwrap()
                        } else {
                            ProxyTrigger::put_with_signal(sem.0, put).unwrap()
                        };
                        let pos = producer.push(t, T).unwrap();
                        if i % 8 == 7 {
                            wait_flushed(proxy, sem, pos);
                        }
                    }
                });
            }
        });
        // Atomic adds on the last word, then a signal and a flush.
        let producer = proxy.fifo().host_producer().unwrap();
        let word = (len - 8) as u32;
        for v in [5i64, -2, 1000, 1 << 40] {
            producer.push(ProxyTrigger::atomic_add(sem.0, dst.0, word, v).unwrap(), T).unwrap();
        }
        producer.push(ProxyTrigger::signal(sem.0).unwrap(), T).unwrap();
        let pos = producer.push(ProxyTrigger::flush(sem.0).unwrap(), T).unwrap();
        wait_flushed(&proxy, sem, pos);
        proxy.stop().unwrap();
        assert_eq!(proxy.processed(), total + 6);
        assert_eq!(proxy.flush_done_pos(sem).unwrap(), u64::MAX, "stop releases every flush word");
        assert_eq!(proxy.fifo().proxy_error(), PROXY_STOPPED);
        s.bs.barrier().unwrap();
    } else {
        let sem = s.wait_sem.as_ref().unwrap();
        for _ in 0..total {
            sem.wait(T).unwrap();
        }
        // Signals from four producers interleave: check every chunk once all arrived.
        for k in 0..total {
            let mut got = vec![0u8; size_of(k)];
            s.local.read(k as usize * CHUNK, &mut got).unwrap();
            assert!(got == pattern(k, got.len()), "chunk {k} ({} bytes) differs", got.len());
        }
        sem.wait(T).unwrap();
        let w = s.local.atomic_u64(len - 8).unwrap().load(std::sync::atomic::Ordering::Acquire);
        assert_eq!(w, (5i64 - 2 + 1000 + (1 << 40)) as u64);
        assert_eq!(sem.inbound_token(), total + 1, "exactly one token per signal");
        s.bs.barrier().unwrap();
    }
}

#[test]
fn ethernet_writes_signals_flushes() {
    run_threads(2, |r| writes_signals_flushes(r, &ETHERNET));
}

#[test]
fn ib_fake_writes_signals_flushes() {
    run_threads(2, |r| writes_signals_flushes(r, &FAKE_IB));
}

/// A trigger naming an unknown semaphore is the recorded error (no crash): published to the
/// FIFO's error word and every flush word, later triggers are popped without running (producers
/// never block, even past the ring size), the first error stays, and `stop` returns it.
#[test]
fn bad_trigger_is_the_recorded_error() {
    let mut proxy = ProxyService::host_backed(config().fifo_size(8)).unwrap();
    proxy.start().unwrap();
    let producer = proxy.fifo().host_producer().unwrap();
    producer.push(ProxyTrigger::signal(5).unwrap(), T).unwrap();
    // Not decodable: a signal carrying put fields. Comes second, so it must not replace the first.
    producer.push(ProxyTrigger { fst: 77, snd: 2 << 50 }, T).unwrap();
    for _ in 0..40 {
        producer.push(ProxyTrigger::flush(0).unwrap(), T).unwrap();
    }
    common::wait_until("the triggers after the error drained", T, || proxy.processed() >= 42);
    assert_eq!(proxy.fifo().proxy_error(), PROXY_FAILED);
    let e = proxy.status().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    assert!(e.to_string().contains("semaphore 5"), "{e}");
    assert!(e.to_string().contains("FIFO position 0"), "{e}");
    let e2 = proxy.stop().unwrap_err();
    assert_eq!(e2.to_string(), e.to_string());
    assert_eq!(proxy.fifo().proxy_error(), PROXY_FAILED, "stop keeps the failure visible");

    let mut p2 = ProxyService::host_backed(config()).unwrap();
    p2.start().unwrap();
    p2.fifo().host_producer().unwrap().push(ProxyTrigger { fst: 77, snd: 2 << 50 }, T).unwrap();
    common::wait_until("an undecodable trigger refused", T, || p2.status().is_err());
    let e = p2.stop().unwrap_err();
    assert!(e.to_string().contains("bad trigger"), "{e}");
}

/// The peer vanishes mid-run: the proxy records the transport's error, releases the pending
/// flush (u64::MAX) and stops with that error.
fn peer_gone(r: &Rank, h: &Harness) {
    let s = side(r, h, 1 << 20, None);
    if r.rank == 1 {
        s.bs.barrier().unwrap();
        drop(s);
        return;
    }
    let src = Buffer::new(s.comm.context(), 1 << 20, h.flags()).unwrap();
    let mut proxy = ProxyService::host_backed(config()).unwrap();
    let sem = proxy.add_semaphore(s.proxy_sem.clone().unwrap()).unwrap();
    let dst = proxy.add_memory(s.remote.clone()).unwrap();
    let srcm = proxy.add_memory(src.memory().clone()).unwrap();
    proxy.start().unwrap();
    s.bs.barrier().unwrap();
    let producer = proxy.fifo().host_producer().unwrap();
    let put = Put { src_mem: srcm.0, src_off: 0, dst_mem: dst.0, dst_off: 0, size: 1 << 20 };
    let t0 = Instant::now();
    let mut last = 0;
    while proxy.status().is_ok() {
        assert!(t0.elapsed() < T, "the proxy never noticed the peer was gone");
        last = producer.push(ProxyTrigger::put_with_signal_and_flush(sem.0, put).unwrap(), T).unwrap();
        // Each round ends with its flush: done (the peer was still there), or failed.
        common::wait_until("the flush done or the proxy failed", T, || {
            proxy.flush_done_pos(sem).unwrap() > last || proxy.status().is_err()
        });
    }
    assert_eq!(proxy.fifo().proxy_error(), PROXY_FAILED);
    assert_eq!(proxy.flush_done_pos(sem).unwrap(), u64::MAX, "the pending flush at {last} is released");
    let e = proxy.stop().unwrap_err();
    assert_ne!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    println!("proxy error after the peer left: {e}");
}

#[test]
fn ethernet_peer_gone_is_the_proxy_error() {
    run_threads(2, |r| peer_gone(r, &ETHERNET));
}
