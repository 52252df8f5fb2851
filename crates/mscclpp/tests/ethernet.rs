//! The Ethernet transport between real processes on loopback.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Rank, pattern, spawn_ranks};
use mscclpp::{
    Bootstrap, Buffer, Communicator, Connection, EndpointConfig, ErrorKind, Host2HostSemaphore, RegisteredMemory,
    Transport, TransportFlags,
};

const T: Duration = Duration::from_secs(30);

struct Setup {
    bs: Arc<dyn Bootstrap>,
    comm: Communicator,
    conns: Vec<Option<Connection>>,
    local: Buffer,
    remote: Vec<Option<RegisteredMemory>>,
    sems: Vec<Option<Host2HostSemaphore>>,
}

fn eth_config(queue: Option<usize>) -> EndpointConfig {
    let mut c = EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1");
    c.max_write_queue_size = queue;
    c
}

/// Connects every pair, exchanges one buffer of `len` bytes per rank and builds semaphores.
fn setup(r: &Rank, len: usize, queue: Option<usize>) -> Setup {
    let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
    let comm = Communicator::new(bs.clone());
    let local = Buffer::new(comm.context(), len, Transport::Ethernet.into()).unwrap();
    let n = r.size;
    let peers: Vec<usize> = (0..n).filter(|p| *p != r.rank).collect();
    let pc: Vec<_> = peers.iter().map(|&p| (p, comm.connect(&eth_config(queue), p, 0).unwrap())).collect();
    for &p in &peers {
        comm.send_memory(local.memory(), p, 1).unwrap();
    }
    let pm: Vec<_> = peers.iter().map(|&p| (p, comm.recv_memory(p, 1).unwrap())).collect();
    let mut conns: Vec<Option<Connection>> = (0..n).map(|_| None).collect();
    for (p, c) in pc {
        conns[p] = Some(c.wait().unwrap());
    }
    let mut remote: Vec<Option<RegisteredMemory>> = vec![None; n];
    for (p, m) in pm {
        remote[p] = Some(m.wait().unwrap());
    }
    let ps: Vec<_> =
        peers.iter().map(|&p| (p, comm.build_semaphore(conns[p].as_ref().unwrap(), p, 2).unwrap())).collect();
    let mut sems: Vec<Option<Host2HostSemaphore>> = (0..n).map(|_| None).collect();
    for (p, s) in ps {
        sems[p] = Some(Host2HostSemaphore::new(s.wait().unwrap()).unwrap());
    }
    bs.barrier().unwrap();
    Setup { bs, comm, conns, local, remote, sems }
}

/// Writes of 1 B .. 64 MiB at pseudo-random offsets, both directions at once, each verified.
#[test]
fn writes_of_all_sizes_arrive_exact() {
    if let Some(r) = Rank::from_env() {
        let cap = (64 << 20) + 8192;
        let s = setup(&r, cap, None);
        let peer = 1 - r.rank;
        let conn = s.conns[peer].as_ref().unwrap();
        let dst = s.remote[peer].as_ref().unwrap();
        let sem = s.sems[peer].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), cap, Transport::Ethernet.into()).unwrap();
        let mut sizes: Vec<usize> = (0..=26).map(|k| 1usize << k).collect();
        sizes.extend([3, 1000, 65535, 65537, 100_003, 5_000_001]);
        for (i, &len) in sizes.iter().enumerate() {
            let seed = (i as u64) << 8;
            let src_off = (seed as usize * 7919) % (cap - len + 1).min(4096);
            let dst_off = (seed as usize * 104_729) % (cap - len + 1).min(8192);
            src.write(src_off, &pattern(seed + r.rank as u64, len)).unwrap();
            conn.write(dst, dst_off as u64, src.memory(), src_off as u64, len as u64).unwrap();
            sem.signal().unwrap();
            conn.flush(T).unwrap();
            sem.wait(T).unwrap();
            let mut got = vec![0u8; len];
            s.local.read(dst_off, &mut got).unwrap();
            assert!(got == pattern(seed + peer as u64, len), "size {len} at offset {dst_off} differs");
            s.bs.barrier().unwrap();
        }
        return;
    }
    spawn_ranks("writes_of_all_sizes_arrive_exact", 2, &[]).assert_success();
}

/// Signals never overtake the writes before them.
#[test]
fn signal_follows_its_writes() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, 1 << 20, Some(16));
        let peer = 1 - r.rank;
        let sem = s.sems[peer].as_ref().unwrap();
        if r.rank == 0 {
            let conn = s.conns[1].as_ref().unwrap();
            let src = Buffer::new(s.comm.context(), 1 << 20, Transport::Ethernet.into()).unwrap();
            for i in 0..300u64 {
                let len = [8usize, 100, 4096, 70_000, 300_000][i as usize % 5];
                let off = (i as usize * 4096) % ((1 << 20) - len);
                src.write(off, &pattern(i, len)).unwrap();
                conn.write(s.remote[1].as_ref().unwrap(), off as u64, src.memory(), off as u64, len as u64).unwrap();
                sem.signal().unwrap();
                sem.wait(T).unwrap(); // the peer has checked; src may change
            }
        } else {
            for i in 0..300u64 {
                sem.wait(T).unwrap();
                let len = [8usize, 100, 4096, 70_000, 300_000][i as usize % 5];
                let off = (i as usize * 4096) % ((1 << 20) - len);
                let mut got = vec![0u8; len];
                s.local.read(off, &mut got).unwrap();
                assert!(got == pattern(i, len), "iteration {i}: the signal arrived before its data");
                sem.signal().unwrap();
            }
        }
        s.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("signal_follows_its_writes", 2, &[]).assert_success();
}

/// Remote atomic adds from the peer (two threads) and local adds on the same word sum exactly.
#[test]
fn atomic_add_from_both_sides_sums_exactly() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, 4096, Some(64));
        let peer = 1 - r.rank;
        let conn = s.conns[peer].as_ref().unwrap().clone();
        let dst = s.remote[peer].as_ref().unwrap().clone();
        const N: i64 = 5000;
        std::thread::scope(|sc| {
            for t in 0..2 {
                let (conn, dst) = (conn.clone(), dst.clone());
                sc.spawn(move || {
                    for _ in 0..N {
                        conn.atomic_add(&dst, 8, 3 + t).unwrap();
                    }
                    conn.atomic_add(&dst, 16, -1).unwrap();
                });
            }
            let w = s.local.atomic_u64(8).unwrap();
            for _ in 0..N {
                w.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
        });
        conn.flush(T).unwrap();
        s.bs.barrier().unwrap();
        let w = s.local.atomic_u64(8).unwrap().load(std::sync::atomic::Ordering::Acquire);
        assert_eq!(w as i64, N * 3 + N * 4 + N);
        assert_eq!(s.local.atomic_u64(16).unwrap().load(std::sync::atomic::Ordering::Acquire), (-2i64) as u64);
        s.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("atomic_add_from_both_sides_sums_exactly", 2, &[]).assert_success();
}

/// Far more writes than the queue bound; write waits instead of growing, and all land.
#[test]
fn many_writes_past_the_queue_bound() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, 1 << 16, Some(8));
        if r.rank == 0 {
            let conn = s.conns[1].as_ref().unwrap();
            assert_eq!(conn.max_write_queue_size(), 8);
            let src = Buffer::new(s.comm.context(), 1 << 16, Transport::Ethernet.into()).unwrap();
            src.write(0, &pattern(9, 1 << 16)).unwrap();
            let mut most = 0;
            for i in 0..20_000u64 {
                let off = (i * 8) % (1 << 16);
                conn.write(s.remote[1].as_ref().unwrap(), off, src.memory(), off, 8).unwrap();
                most = most.max(conn.outstanding());
            }
            conn.flush(T).unwrap();
            assert!(most <= 8, "outstanding reached {most}");
            s.sems[1].as_ref().unwrap().signal().unwrap();
        } else {
            s.sems[0].as_ref().unwrap().wait(T).unwrap();
            assert!(s.local.to_vec() == pattern(9, 1 << 16));
        }
        s.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("many_writes_past_the_queue_bound", 2, &[]).assert_success();
}

/// Four processes, each writing its rank's pattern into every other and signalling.
#[test]
fn four_ranks_all_to_all() {
    if let Some(r) = Rank::from_env() {
        let n = r.size;
        let slot = 256 * 1024;
        let s = setup(&r, slot * n, None);
        let src = Buffer::new(s.comm.context(), slot, Transport::Ethernet.into()).unwrap();
        src.write(0, &pattern(r.rank as u64, slot)).unwrap();
        for p in (0..n).filter(|p| *p != r.rank) {
            let c = s.conns[p].as_ref().unwrap();
            c.write(s.remote[p].as_ref().unwrap(), (r.rank * slot) as u64, src.memory(), 0, slot as u64).unwrap();
            s.sems[p].as_ref().unwrap().signal().unwrap();
        }
        for p in (0..n).filter(|p| *p != r.rank) {
            s.sems[p].as_ref().unwrap().wait(T).unwrap();
            let mut got = vec![0u8; slot];
            s.local.read(p * slot, &mut got).unwrap();
            assert!(got == pattern(p as u64, slot), "slot of rank {p} differs");
        }
        for p in (0..n).filter(|p| *p != r.rank) {
            s.conns[p].as_ref().unwrap().flush(T).unwrap();
        }
        s.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("four_ranks_all_to_all", 4, &[]).assert_success();
}

/// Bad bounds and transports are refused before anything is sent.
#[test]
fn bad_writes_are_invalid_usage_and_send_nothing() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, 4096, None);
        let peer = 1 - r.rank;
        let conn = s.conns[peer].as_ref().unwrap();
        let dst = s.remote[peer].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), 4096, Transport::Ethernet.into()).unwrap();
        let plain = Buffer::new(s.comm.context(), 4096, TransportFlags::NONE).unwrap();
        src.fill(0, 4096, 0xEE).unwrap();
        let cases: Vec<(&str, mscclpp::Result<()>)> = vec![
            ("dst out of bounds", conn.write(dst, 4000, src.memory(), 0, 200)),
            ("dst offset overflow", conn.write(dst, u64::MAX, src.memory(), 0, 2)),
            ("src out of bounds", conn.write(dst, 0, src.memory(), 4090, 10)),
            ("src without transport", conn.write(dst, 0, plain.memory(), 0, 10)),
            ("src is remote", conn.write(dst, 0, dst, 0, 10)),
            ("dst is local memory", conn.write(s.local.memory(), 0, src.memory(), 0, 10)),
            ("unaligned atomic", conn.atomic_add(dst, 4, 1)),
            ("atomic out of bounds", conn.atomic_add(dst, 4096, 1)),
        ];
        for (what, res) in cases {
            let e = res.expect_err(what);
            assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{what}: {e}");
            assert_eq!(e.peer(), Some(peer), "{what}: {e}");
        }
        assert_eq!(conn.outstanding(), 0, "nothing may have been queued");
        conn.status().unwrap();
        s.bs.barrier().unwrap();
        assert!(s.local.to_vec().iter().all(|b| *b == 0), "nothing may have arrived");
        s.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("bad_writes_are_invalid_usage_and_send_nothing", 2, &[]).assert_success();
}

/// A peer killed mid-transfer: flush and wait fail with an error well within their timeout.
#[test]
fn peer_killed_mid_transfer() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, 8 << 20, None);
        if r.rank == 1 {
            std::thread::sleep(Duration::from_millis(100));
            let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
            std::thread::sleep(Duration::from_secs(30));
            return;
        }
        let conn = s.conns[1].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), 8 << 20, Transport::Ethernet.into()).unwrap();
        let t0 = Instant::now();
        let mut res = Ok(());
        while t0.elapsed() < Duration::from_secs(5) {
            res = conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 8 << 20);
            if res.is_err() {
                break;
            }
        }
        let flush = conn.flush(Duration::from_secs(20));
        let wait = s.sems[1].as_ref().unwrap().wait(Duration::from_secs(20));
        let el = t0.elapsed();
        let fe = flush.expect_err("flush after the peer died");
        let we = wait.expect_err("wait after the peer died");
        assert_ne!(fe.kind(), ErrorKind::Timeout, "{fe}");
        assert_ne!(we.kind(), ErrorKind::Timeout, "{we}");
        assert_eq!(fe.peer(), Some(1), "{fe}");
        assert!(el < Duration::from_secs(15), "took {el:?}");
        println!("write: {res:?}\nflush: {fe}\nwait: {we}\nafter {el:?}");
        return;
    }
    let job = spawn_ranks("peer_killed_mid_transfer", 2, &[]);
    let (_, o) = &job.outputs[0];
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

/// flush returns Timeout (naming the peer) when the peer stops reading.
#[test]
fn flush_times_out_when_peer_stalls() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, 64 << 20, None);
        if r.rank == 1 {
            // Stop this process (not kill) so its sockets stay open but nothing is read.
            s.bs.barrier().unwrap();
            let _ = std::process::Command::new("kill").args(["-STOP", &std::process::id().to_string()]).status();
            return;
        }
        s.bs.barrier().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let conn = s.conns[1].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), 64 << 20, Transport::Ethernet.into()).unwrap();
        conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 64 << 20).unwrap();
        let t0 = Instant::now();
        let e = conn.flush(Duration::from_millis(500)).unwrap_err();
        let el = t0.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert_eq!(e.peer(), Some(1));
        assert!(e.to_string().contains("not yet applied"), "{e}");
        assert!(el < Duration::from_secs(2), "{el:?}");
        println!("{e}");
        std::process::exit(0);
    }
    let job = common::spawn_some("flush_times_out_when_peer_stalls", 2, &[0, 1], T, &[], Duration::from_secs(8));
    let (_, o) = &job.outputs[0];
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("MemAvailable:")).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()))
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// One write larger than 4 GiB (sizes past 32 bits), byte-exact. Needs about 9 GiB free.
#[test]
fn write_over_4gib() {
    const LEN: usize = (4 << 30) + 4099;
    if let Some(r) = Rank::from_env() {
        let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
        let comm = Communicator::new(bs.clone());
        let buf = Buffer::new(comm.context(), LEN, Transport::Ethernet.into()).unwrap();
        let peer = 1 - r.rank;
        let pc = comm.connect(&eth_config(None), peer, 0).unwrap();
        comm.send_memory(buf.memory(), peer, 1).unwrap();
        let remote = comm.recv_memory(peer, 1).unwrap().wait().unwrap();
        let conn = pc.wait().unwrap();
        let sem = Host2HostSemaphore::new(comm.build_semaphore(&conn, peer, 2).unwrap().wait().unwrap()).unwrap();
        // A position-dependent pattern, cheap to make and check.
        let word = |i: usize| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes();
        if r.rank == 0 {
            let mut chunk = vec![0u8; 1 << 20];
            for base in (0..LEN).step_by(1 << 20) {
                let n = (LEN - base).min(1 << 20);
                for (j, b) in chunk[..n].iter_mut().enumerate() {
                    *b = word((base + j) / 8)[(base + j) % 8];
                }
                buf.write(base, &chunk[..n]).unwrap();
            }
            let t0 = Instant::now();
            conn.write(&remote, 0, buf.memory(), 0, LEN as u64).unwrap();
            sem.signal().unwrap();
            conn.flush(Duration::from_secs(300)).unwrap();
            println!("4 GiB + 4099 B write: {:.2} GB/s", LEN as f64 / t0.elapsed().as_secs_f64() / 1e9);
        } else {
            sem.wait(Duration::from_secs(300)).unwrap();
            let mut chunk = vec![0u8; 1 << 20];
            for base in (0..LEN).step_by(1 << 20) {
                let n = (LEN - base).min(1 << 20);
                buf.read(base, &mut chunk[..n]).unwrap();
                for (j, b) in chunk[..n].iter().enumerate() {
                    assert_eq!(*b, word((base + j) / 8)[(base + j) % 8], "byte {} differs", base + j);
                }
            }
        }
        bs.barrier().unwrap();
        return;
    }
    let avail = mem_available();
    if avail < 10 << 30 {
        println!("SKIPPED write_over_4gib: needs about 9 GiB free, this machine has {} MiB", avail >> 20);
        return;
    }
    spawn_ranks("write_over_4gib", 2, &[]).assert_success();
}
