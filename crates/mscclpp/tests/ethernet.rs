//! The Ethernet transport between real processes on loopback: the shared connection suite
//! (`common/suite.rs`) and Ethernet's own tests.

mod common;

use std::time::{Duration, Instant};

use common::Rank;
use common::harnesses;
use common::suite::{Harness, Mode, T, setup};
use mscclpp::{Buffer, ErrorKind, Transport};

static ETHERNET: Harness = Harness { mode: Mode::Processes, ..harnesses::ETHERNET };

connection_suite!(&ETHERNET);

/// flush returns Timeout (naming the peer) when the peer stops reading.
#[test]
fn flush_times_out_when_peer_stalls() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, &ETHERNET, 64 << 20, None);
        let Some(peer_pid) = stop_rank_1(&r, &s) else { return };
        let conn = s.conns[1].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), 64 << 20, Transport::Ethernet.into()).unwrap();
        conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 64 << 20).unwrap();
        let t0 = Instant::now();
        let e = conn.flush(Duration::from_millis(500)).unwrap_err();
        let el = t0.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert_eq!(e.peer(), Some(1));
        assert!(e.to_string().contains("not yet applied"), "{e}");
        // the structured detail, not only the text
        assert_eq!((e.operation(), e.transport()), (Some("flush"), Some(Transport::Ethernet)), "{e}");
        assert!(e.outstanding().is_some_and(|n| n >= 1), "{e}: outstanding {:?}", e.outstanding());
        // It waited its 500 ms and returned then (a loaded machine's margin above it).
        assert!(el >= Duration::from_millis(500) && el < Duration::from_secs(10), "{el:?}");
        println!("{e}");
        let _ = std::process::Command::new("kill").args(["-KILL", &peer_pid]).status();
        std::process::exit(0);
    }
    let job = common::spawn_some("flush_times_out_when_peer_stalls", 2, &[0, 1], T, &[], Duration::from_secs(120));
    job.assert_rank_success(0);
}

/// Rank 1 of a two-rank test hands its pid to rank 0 and idles (`None`: its test body returns);
/// rank 0 stops it (SIGSTOP, not a kill: its sockets stay open but nothing is read), waits until
/// the kernel shows it stopped, and gets its pid to kill it at the end.
fn stop_rank_1(r: &Rank, s: &common::suite::Setup) -> Option<String> {
    if r.rank == 1 {
        s.bs.send(0, 9, std::process::id().to_string().as_bytes()).unwrap();
        // Until rank 0 stops and kills it (rank 0 sends nothing under this tag: the receive
        // ends only if rank 0 goes away first, or at the bootstrap's timeout).
        let _ = s.bs.recv(0, 10);
        return None;
    }
    let pid = String::from_utf8(s.bs.recv(1, 9).unwrap()).unwrap();
    stop_and_wait_stopped(&pid);
    Some(pid)
}

/// Stops process `pid` (SIGSTOP) and waits until the kernel shows it stopped.
fn stop_and_wait_stopped(pid: &str) {
    let ok = std::process::Command::new("kill").args(["-STOP", pid]).status().unwrap().success();
    assert!(ok, "kill -STOP {pid}");
    // The state follows the command name, which is in parentheses.
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_string))
    };
    common::wait_until(&format!("process {pid} stopping"), Duration::from_secs(60), || state().as_deref() == Some("T"));
}

/// Ethernet with a 2 s wait limit and room for many outstanding writes (so that the socket,
/// not the write queue, is what fills when the peer stops reading).
fn short_limit_config(_queue: Option<usize>) -> mscclpp::EndpointConfig {
    harnesses::eth_config(Some(4096))
        .ethernet(mscclpp::EthernetConfig::default().interface("127.0.0.1").connect_timeout(Duration::from_secs(2)))
}

static ETHERNET_SHORT_LIMIT: Harness = Harness { config: short_limit_config, ..ETHERNET };

/// Writes and signals sent by the calling thread itself (1 MiB and smaller, from host memory)
/// into a peer that stopped reading fill the socket; the send that finds it full gives up after
/// the wait limit and fails the connection (Timeout, naming the peer) instead of blocking the
/// caller for ever. (Before the send timeout this hung until the peer died.)
#[test]
fn inline_sends_to_a_stopped_peer_fail_instead_of_hanging() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, &ETHERNET_SHORT_LIMIT, 64 << 20, None);
        let Some(peer_pid) = stop_rank_1(&r, &s) else { return };
        let conn = s.conns[1].as_ref().unwrap();
        let dst = s.remote[1].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), 1 << 20, Transport::Ethernet.into()).unwrap();
        let t0 = Instant::now();
        let mut sent = 0u64;
        // A loopback socket pair buffers some MiB: the loop fills it within a few dozen rounds.
        let e = loop {
            let r = conn.write(dst, 1 << 20, src.memory(), 0, 1 << 20).and_then(|_| conn.atomic_add(dst, 0, 1));
            match r {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{sent} writes into a stopped peer all succeeded");
        };
        // Two bounded waits see the stopped peer, both after the 2 s limit: the socket send that
        // finds the socket full ("stalled"), or, when the sender thread holds the socket, the
        // caller's wait for room in the full write queue ("none confirmed"). Which comes first
        // depends on the machine's load; either is a Timeout naming the peer, never a hang.
        let stopped = |m: &str| m.contains("stalled") || m.contains("none confirmed");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert_eq!(e.peer(), Some(1), "{e}");
        assert!(stopped(&e.to_string()), "{e}");
        // Nothing more lands: a flush fails too, naming the peer.
        let f = conn.flush(Duration::from_secs(5)).unwrap_err();
        assert_eq!(f.peer(), Some(1), "{f}");
        assert!(f.kind() == ErrorKind::Timeout || stopped(&f.to_string()), "{f}");
        println!("after {sent} rounds of 1 MiB + signal, {:?}: {e}", t0.elapsed());
        let _ = std::process::Command::new("kill").args(["-KILL", &peer_pid]).status();
        std::process::exit(0);
    }
    let job = common::spawn_some(
        "inline_sends_to_a_stopped_peer_fail_instead_of_hanging",
        2,
        &[0, 1],
        T,
        &[],
        Duration::from_secs(120),
    );
    println!("{}", job.assert_rank_success(0));
}

/// One rank connected to itself over Ethernet on 127.0.0.1 (one endpoint on both sides) with
/// `config`'s settings: the communicator, the connection, a `len`-byte destination buffer, the
/// same buffer as the connection's remote memory, and a `len`-byte source buffer.
struct SelfConnected {
    comm: mscclpp::Communicator,
    conn: mscclpp::Connection,
    dst: Buffer,
    remote: mscclpp::RegisteredMemory,
    src: Buffer,
}

fn connect_to_itself(len: usize, config: mscclpp::EndpointConfig, t: Duration) -> SelfConnected {
    use std::sync::Arc;

    use mscclpp::{Communicator, TcpBootstrap};
    let id = TcpBootstrap::create_unique_id().unwrap();
    let bs = Arc::new(TcpBootstrap::config(0, 1).timeout(t).initialize(&id).unwrap());
    let comm = Communicator::new(bs);
    let dst = Buffer::new(comm.context(), len, Transport::Ethernet.into()).unwrap();
    comm.send_memory(dst.memory(), 0, 0).unwrap();
    let remote = comm.recv_memory(0, 0).unwrap();
    let conn = comm.connect(&config.ethernet_interface("127.0.0.1"), 0, 0).unwrap().wait().unwrap();
    let remote = remote.wait().unwrap();
    let src = Buffer::new(comm.context(), len, Transport::Ethernet.into()).unwrap();
    SelfConnected { comm, conn, dst, remote, src }
}

/// A rank connected to itself over Ethernet (one endpoint on both sides, as the Python
/// package's one-rank tests do): small and large writes (both lanes) and signals arrive in
/// order, flush succeeds, and dropping the connection returns at once.
#[test]
fn a_connection_to_itself_works_on_both_lanes() {
    use mscclpp::{EndpointConfig, Host2HostSemaphore};
    let t = Duration::from_secs(20);
    let SelfConnected { comm, conn, dst, remote, src } =
        connect_to_itself(1 << 20, EndpointConfig::new(Transport::Ethernet), t);
    let sem = Host2HostSemaphore::new(comm.build_semaphore(&conn, 0, 0).unwrap().wait().unwrap()).unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
    src.write(0, &data).unwrap();
    // A small write (shared lane), a large one (own lane), a small one again, each signalled.
    for (off, len) in [(0usize, 8usize), (4096, 512 << 10), (1000, 24)] {
        conn.write(&remote, off as u64, src.memory(), off as u64, len as u64).unwrap();
        sem.signal().unwrap();
        sem.wait(t).unwrap();
        let mut got = vec![0u8; len];
        dst.read(off, &mut got).unwrap();
        assert!(got == data[off..off + len], "write of {len} bytes at {off} did not arrive intact");
    }
    conn.flush(t).unwrap();
    let t0 = Instant::now();
    drop(sem);
    drop(conn);
    assert!(t0.elapsed() < Duration::from_secs(2), "closing took {:?}", t0.elapsed());
}

/// The acknowledgement loop is counted (`mscclpp::bench::ethernet_staging_counts`, which
/// `mscclpp-perf device` prints for its Ethernet rows): a flush asks once, and writes past a
/// small write-queue bound ask every half bound, each answered. The counters are process-wide,
/// so other tests running beside this one can only raise them: the checks are lower bounds.
#[test]
fn acknowledgement_loops_are_counted() {
    use mscclpp::EndpointConfig;
    let t = Duration::from_secs(20);
    let SelfConnected { conn, dst, remote, src, .. } =
        connect_to_itself(4096, EndpointConfig::new(Transport::Ethernet).max_write_queue_size(8), t);
    src.write(0, &[7u8; 4096]).unwrap();

    let c0 = mscclpp::bench::ethernet_staging_counts();
    conn.write(&remote, 0, src.memory(), 0, 64).unwrap();
    conn.flush(t).unwrap();
    let c1 = mscclpp::bench::ethernet_staging_counts();
    assert!(c1.acks > c0.acks, "a flush's probe asks and is answered: {c0:?} -> {c1:?}");
    assert!(c1.ack_wait > c0.ack_wait, "the answered ask was timed: {c0:?} -> {c1:?}");

    // 200 writes through a bound of 8: each further 8 need an acknowledgement, asked every 4.
    for i in 0..200u64 {
        conn.write(&remote, (i % 64) * 64, src.memory(), 0, 64).unwrap();
    }
    conn.flush(t).unwrap();
    let c2 = mscclpp::bench::ethernet_staging_counts();
    let asks = c2.acks - c1.acks;
    println!(
        "200 writes through a bound of 8: {asks} asks answered, {:?} on average",
        (c2.ack_wait - c1.ack_wait) / asks.max(1) as u32
    );
    assert!(asks >= 24, "200 writes through a bound of 8 answered only {asks} asks");
    let mut got = [0u8; 4096];
    dst.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7), "the writes did not all land");
}
