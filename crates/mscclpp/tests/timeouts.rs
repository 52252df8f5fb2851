//! Every public call that takes a duration, with the two ends of the range: `Duration::ZERO`
//! gives an answer at once (success where the answer is already there, `Timeout` otherwise; never
//! a panic or a wait) and `Duration::MAX` means no limit (no "overflow when adding duration to
//! instant" panic, and the call still completes once its operation does).
//!
//! The GPU waits (`Stream::synchronize`, `Host2DeviceSemaphore::wait`) are tested on a GPU
//! machine (`--ignored`).

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use mscclpp::device::ProxyTrigger;
use mscclpp::device::fifo::Fifo;
use mscclpp::launcher::LaunchInfo;
use mscclpp::{
    Bootstrap, Buffer, Connection, Context, Device, Endpoint, EndpointConfig, ErrorKind, EthernetConfig,
    Host2DeviceSemaphore, Host2HostSemaphore, RegisteredMemory, RootServer, Semaphore, SemaphoreStub, TcpBootstrap,
    Transport,
};

/// A limit long enough for anything here to finish; only reached if something is broken.
const LONG: Duration = Duration::from_secs(60);

/// `r` succeeded or timed out (what a zero limit may give, depending on whether the answer was
/// already there).
fn ok_or_timeout<T>(r: mscclpp::Result<T>, what: &str) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Timeout, "{what}: {e}");
            None
        }
    }
}

/// The collectives and point-to-point calls of a joined rank (all ranks call this).
fn exercise(bs: &TcpBootstrap) {
    let (r, n) = (bs.rank(), bs.size());
    let all = bs.all_gather(&[r as u8; 3]).unwrap();
    assert_eq!(all, (0..n).map(|i| vec![i as u8; 3]).collect::<Vec<_>>());
    assert_eq!(bs.broadcast(n - 1, &[r as u8]).unwrap(), vec![(n - 1) as u8]);
    bs.barrier().unwrap();
    bs.send((r + 1) % n, 7, b"hi").unwrap();
    assert_eq!(bs.recv((r + n - 1) % n, 7).unwrap(), b"hi");
    bs.barrier().unwrap();
}

#[test]
fn root_server_and_ranks_without_limit() {
    let (root, id) = RootServer::start(3, Duration::MAX).unwrap();
    let hs: Vec<_> = (0..3)
        .map(|r| {
            let id = id.clone();
            std::thread::spawn(move || {
                let bs = TcpBootstrap::config(r, 3).timeout(Duration::MAX).initialize(&id).unwrap();
                assert_eq!(bs.timeout(), Duration::MAX);
                exercise(&bs);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    root.join();
}

#[test]
fn root_in_rank_0_without_limit_and_set_timeout() {
    let id = TcpBootstrap::create_unique_id().unwrap();
    let bs = TcpBootstrap::config(0, 1).timeout(Duration::MAX).initialize(&id).unwrap();
    exercise(&bs);
    bs.set_timeout(Duration::from_secs(5));
    assert_eq!(bs.timeout(), Duration::from_secs(5));
    bs.set_timeout(Duration::MAX);
    assert_eq!(bs.timeout(), Duration::MAX);
    exercise(&bs);
    // Zero: what is already there is received, nothing else is waited for.
    bs.set_timeout(Duration::ZERO);
    assert_eq!(bs.recv(0, 3).unwrap_err().kind(), ErrorKind::Timeout);
    bs.send(0, 3, b"x").unwrap();
    assert_eq!(bs.recv(0, 3).unwrap(), b"x");
    assert_eq!(bs.all_gather(b"a").unwrap(), vec![b"a".to_vec()]);
    bs.barrier().unwrap();
    assert_eq!(bs.broadcast(0, b"b").unwrap(), b"b");
}

/// A root with a zero limit gives up at once (its `join` returns without any rank); a rank with
/// a zero limit gives up at once too, and the job still works for ranks that come later.
#[test]
fn zero_limits_give_up_at_once() {
    let (root, _id) = RootServer::start(3, Duration::ZERO).unwrap();
    root.join();

    let (root, id) = RootServer::start(1, LONG).unwrap();
    let e = TcpBootstrap::config(0, 1).timeout(Duration::ZERO).initialize(&id).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let bs = TcpBootstrap::config(0, 1).timeout(LONG).initialize(&id).unwrap();
    root.join();
    exercise(&bs);

    // Rank 0 hosting the root: both give up at once, or it is already done.
    let id = TcpBootstrap::create_unique_id().unwrap();
    ok_or_timeout(TcpBootstrap::config(0, 1).timeout(Duration::ZERO).initialize(&id), "rank 0 with a zero limit");
}

/// Two ranks with a zero wait limit after joining: a receive with nothing there times out at
/// once; with the message there, it is received.
#[test]
fn zero_limit_on_a_two_rank_job() {
    let (root, id) = RootServer::start(2, LONG).unwrap();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let id = id.clone();
            std::thread::spawn(move || TcpBootstrap::config(r, 2).timeout(LONG).initialize(&id).unwrap())
        })
        .collect();
    let mut bss: Vec<TcpBootstrap> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    root.join();
    let b1 = bss.pop().unwrap();
    let b0 = bss.pop().unwrap();
    b0.set_timeout(Duration::ZERO);
    assert_eq!(b0.recv(1, 1).unwrap_err().kind(), ErrorKind::Timeout);
    b1.send(0, 1, b"m").unwrap();
    // The message is in flight: wait for it without a limit, then a zero-limit receive of the
    // next one (already sent too) finds it.
    b1.send(0, 1, b"n").unwrap();
    b0.set_timeout(Duration::MAX);
    assert_eq!(b0.recv(1, 1).unwrap(), b"m");
    b0.set_timeout(Duration::ZERO);
    // "n" came on the same connection right after "m": it is there by now or soon.
    match ok_or_timeout(b0.recv(1, 1), "second message with a zero limit") {
        Some(m) => assert_eq!(m, b"n"),
        None => {
            b0.set_timeout(LONG);
            assert_eq!(b0.recv(1, 1).unwrap(), b"n");
        }
    }
}

#[test]
fn launcher_bootstrap_with_zero_and_no_limit() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let vars = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())];
    let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    let info = LaunchInfo::from_vars(&get).unwrap().unwrap();
    let bs = info.bootstrap(Duration::MAX).unwrap();
    exercise(&bs);
    drop(bs);
    ok_or_timeout(info.bootstrap(Duration::ZERO), "launcher bootstrap with a zero limit");
}

/// Two contexts of this process joined by an Ethernet connection each way over loopback, with
/// the given connect (and wait) limit.
fn eth_pair(limit: Duration) -> (Context, Context, Connection, Connection) {
    let cfg = EndpointConfig::new(Transport::Ethernet)
        .ethernet(EthernetConfig::default().interface("127.0.0.1").connect_timeout(limit));
    let (a, b) = (Context::new(), Context::new());
    let (ea, eb) = (a.create_endpoint(&cfg).unwrap(), b.create_endpoint(&cfg).unwrap());
    let (ra, rb) = (Endpoint::deserialize(&ea.serialize()).unwrap(), Endpoint::deserialize(&eb.serialize()).unwrap());
    let a_to_b = a.connect(&ea, &rb).unwrap();
    let b_to_a = b.connect(&eb, &ra).unwrap();
    (a, b, a_to_b, b_to_a)
}

fn as_peer(m: &RegisteredMemory) -> RegisteredMemory {
    RegisteredMemory::deserialize(&m.serialize()).unwrap()
}

/// Host-to-host semaphores over a pair: `a`'s signals `b`'s and back.
fn semaphores(a_to_b: &Connection, b_to_a: &Connection) -> (Host2HostSemaphore, Host2HostSemaphore) {
    let (sa, sb) = (SemaphoreStub::new(a_to_b).unwrap(), SemaphoreStub::new(b_to_a).unwrap());
    let (ma, mb) = (as_peer(sa.memory()), as_peer(sb.memory()));
    (Host2HostSemaphore::new(Semaphore::new(sa, mb)).unwrap(), Host2HostSemaphore::new(Semaphore::new(sb, ma)).unwrap())
}

/// An Ethernet connection whose connect and wait limit is `Duration::MAX` works: writes land,
/// `flush(Duration::MAX)` returns once they did, semaphores wait without limit for a signal.
/// Zero limits answer at once.
#[test]
fn ethernet_flush_and_semaphores_with_zero_and_no_limit() {
    let (a, b, a_to_b, b_to_a) = eth_pair(Duration::MAX);
    let dst = Buffer::new(&b, 4096, Transport::Ethernet.into()).unwrap();
    let src = Buffer::new(&a, 4096, Transport::Ethernet.into()).unwrap();
    src.write(0, &[7u8; 4096]).unwrap();
    let remote = as_peer(dst.memory());
    // Nothing outstanding: a zero flush succeeds.
    a_to_b.flush(Duration::ZERO).unwrap();
    a_to_b.write(&remote, 0, src.memory(), 0, 4000).unwrap();
    ok_or_timeout(a_to_b.flush(Duration::ZERO), "flush of a write just issued, with a zero limit");
    a_to_b.update_and_sync(&remote, 4088, &AtomicU64::new(0), 5).unwrap();
    a_to_b.flush(Duration::MAX).unwrap();
    assert_eq!(&dst.to_vec()[..4000], &[7u8; 4000][..]);
    assert_eq!(dst.atomic_u64(4088).unwrap().load(std::sync::atomic::Ordering::Acquire), 5);

    let (sem_a, sem_b) = semaphores(&a_to_b, &b_to_a);
    // No signal: a zero wait times out at once.
    assert_eq!(sem_b.wait(Duration::ZERO).unwrap_err().kind(), ErrorKind::Timeout);
    sem_a.signal().unwrap();
    sem_b.wait(Duration::MAX).unwrap();
    // The other way, with the signal flushed (landed) before the zero wait: it is consumed.
    sem_b.signal().unwrap();
    b_to_a.flush(Duration::MAX).unwrap();
    sem_a.wait(Duration::ZERO).unwrap();
    assert_eq!(sem_a.wait(Duration::ZERO).unwrap_err().kind(), ErrorKind::Timeout);
}

/// A zero connect limit gives up at once with `Timeout`.
#[test]
fn ethernet_connect_with_a_zero_limit() {
    let cfg = EndpointConfig::new(Transport::Ethernet)
        .ethernet(EthernetConfig::default().interface("127.0.0.1").connect_timeout(Duration::ZERO));
    let (a, b) = (Context::new(), Context::new());
    let (ea, eb) = (a.create_endpoint(&cfg).unwrap(), b.create_endpoint(&cfg).unwrap());
    let rb = Endpoint::deserialize(&eb.serialize()).unwrap();
    ok_or_timeout(a.connect(&ea, &rb), "Ethernet connect with a zero limit");
}

/// The FIFO's host producer: pushes into free slots succeed whatever the limit; on a full ring
/// a zero limit gives up at once; `sync` of a popped position succeeds at once, of one not yet
/// popped times out at once, and waits without limit until the consumer pops it.
#[test]
fn fifo_waits_with_zero_and_no_limit() {
    let f = Fifo::host_backed(2).unwrap();
    let p = f.host_producer().unwrap();
    let t = |x: u64| ProxyTrigger { fst: x, snd: 0 };
    let p0 = p.push(t(1), Duration::ZERO).unwrap();
    let p1 = p.push_for(t(2), Duration::MAX).unwrap().unwrap();
    assert_eq!(p.push_for(t(3), Duration::ZERO).unwrap(), None, "full ring");
    assert_eq!(p.sync(p0, Duration::ZERO).unwrap_err().kind(), ErrorKind::Timeout);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| p.sync(p1, Duration::MAX));
        let pusher = s.spawn(|| p.push(t(4), Duration::MAX));
        for _ in 0..3 {
            while f.poll().is_none() {
                std::thread::yield_now();
            }
            f.pop();
        }
        waiter.join().unwrap().unwrap();
        assert_eq!(pusher.join().unwrap().unwrap(), 2);
    });
    p.sync(p0, Duration::ZERO).unwrap();
}

/// `Stream::synchronize` of an idle stream succeeds with either limit; `Host2DeviceSemaphore::wait`
/// (its token in GPU memory, written over Ethernet through the GPU staging) times out at once
/// with nothing there, takes a signal already landed with a zero limit, and waits without
/// limit for the next one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_waits_with_zero_and_no_limit() {
    let s = mscclpp::gpu::Stream::new(0).unwrap();
    s.synchronize(Duration::ZERO).unwrap();
    s.synchronize(Duration::MAX).unwrap();

    let host = EndpointConfig::new(Transport::Ethernet)
        .ethernet(EthernetConfig::default().interface("127.0.0.1").connect_timeout(Duration::MAX));
    let gpu = host.clone().device(Device::Gpu(0));
    let (a, b) = (Context::new(), Context::new());
    let (ea, eb) = (a.create_endpoint(&host).unwrap(), b.create_endpoint(&gpu).unwrap());
    let (ra, rb) = (Endpoint::deserialize(&ea.serialize()).unwrap(), Endpoint::deserialize(&eb.serialize()).unwrap());
    let a_to_b = a.connect(&ea, &rb).unwrap();
    let b_to_a = b.connect(&eb, &ra).unwrap();
    let (sa, sb) = (SemaphoreStub::new(&a_to_b).unwrap(), SemaphoreStub::new(&b_to_a).unwrap());
    let (ma, mb) = (as_peer(sa.memory()), as_peer(sb.memory()));
    let on_host = Host2HostSemaphore::new(Semaphore::new(sa, mb)).unwrap();
    let on_gpu = Host2DeviceSemaphore::new(Semaphore::new(sb, ma)).unwrap();
    assert_eq!(on_gpu.wait(Duration::ZERO).unwrap_err().kind(), ErrorKind::Timeout);
    on_host.signal().unwrap();
    a_to_b.flush(Duration::MAX).unwrap();
    on_gpu.wait(Duration::ZERO).unwrap();
    on_host.signal().unwrap();
    on_gpu.wait(Duration::MAX).unwrap();
    assert_eq!(on_gpu.wait(Duration::ZERO).unwrap_err().kind(), ErrorKind::Timeout);
}
