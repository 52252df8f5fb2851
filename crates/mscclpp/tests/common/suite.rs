//! The connection test suite every transport runs: Ethernet between processes, IB on the
//! in-process provider (ranks as threads), IB on a real RDMA device (processes; the soft-RoCE
//! machine) and CUDA IPC (processes on the GPU machine). A test file picks a [`Harness`] and
//! expands [`connection_suite!`]; the harness's [`Memory`] says which buffers (host or GPU) and
//! which semaphores (host-to-host or host-to-device) the tests use.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::sync::atomic::AtomicU64;

use mscclpp::{
    Bootstrap, Communicator, Connection, Context, Device, EndpointConfig, ErrorKind, RegisteredMemory, RootServer,
    Semaphore, Transport, TransportFlags,
};

use super::{Rank, pattern, spawn_ranks};

/// Which memory a suite's buffers and semaphore tokens live in (host, or GPU `rank % count`
/// with endpoints on that GPU), and the buffer and semaphore of that memory: one definition with
/// `mscclpp-perf`'s.
pub use mscclpp::bench::{Mem, Memory, Sem};

pub const T: Duration = Duration::from_secs(30);

/// How a suite's ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One process per rank (the test binary re-runs itself).
    Processes,
    /// One thread per rank in this process (the in-process IB provider).
    Threads,
}

/// A transport under test.
pub struct Harness {
    pub transport: Transport,
    pub mode: Mode,
    /// Called on each rank's context before anything is registered.
    pub prepare: fn(&Context),
    /// The RDMA device the IB transport uses (`Context::set_ib_device`), if not the default.
    pub ib_device: Option<&'static str>,
    /// The endpoint config, with an optional write-queue bound.
    pub config: fn(Option<usize>) -> EndpointConfig,
    /// Whether the connection has remote atomics (`atomic_add`); IB HostNoAtomic has not.
    pub atomics: bool,
    /// Whether the transport's remote atomics are atomic with CPU atomics on the same word
    /// (Ethernet: yes, the receiver applies them with CPU atomics; IB: only with other atomics
    /// of the same NIC, ATOMIC_HCA).
    pub cpu_atomics_coherent: bool,
    /// Where buffers and semaphore tokens live.
    pub memory: Memory,
    /// Whether the transport notices a vanished peer (Ethernet: the socket closes; IB: retries
    /// run out; CUDA IPC: a pidfd of the peer process). Where it does not, the peer's memory
    /// stays mapped and writes keep landing in it, so only waits on the peer's signals end, by
    /// `Timeout`.
    pub detects_peer_gone: bool,
    /// Whether a write may name this process's own registration as its destination (CUDA IPC:
    /// yes, a connection to oneself copies through the pointer; the others refuse it).
    pub local_destination_allowed: bool,
}

impl Harness {
    /// Runs `prepare` and picks `ib_device` on a rank's context.
    pub fn prepare_context(&self, ctx: &Context) {
        (self.prepare)(ctx);
        if let Some(d) = self.ib_device {
            ctx.set_ib_device(self.transport, d).unwrap();
        }
    }

    pub fn flags(&self) -> TransportFlags {
        self.transport.into()
    }

    /// The GPU rank `rank` uses (GPU memory only); two ranks share a GPU when there is one.
    pub fn gpu_for(rank: usize) -> u32 {
        let n = mscclpp::gpu::device_count().expect("CUDA device count").max(1);
        (rank % n) as u32
    }

    /// The endpoint config for `rank`, with an optional write-queue bound.
    pub fn endpoint_config(&self, rank: usize, queue: Option<usize>) -> EndpointConfig {
        let c = (self.config)(queue);
        match self.memory {
            Memory::Host => c,
            Memory::Gpu => c.device(Device::Gpu(Self::gpu_for(rank))),
        }
    }

    /// A buffer of `len` zero bytes in this harness's memory, registered for `transports`.
    pub fn alloc(&self, ctx: &Context, rank: usize, len: usize, transports: TransportFlags) -> Mem {
        let gpu = if self.memory == Memory::Gpu { Self::gpu_for(rank) } else { 0 };
        self.memory.alloc(ctx, gpu, len, transports).unwrap()
    }

    /// The semaphore that fits this harness's memory.
    pub fn semaphore(&self, sem: Semaphore) -> Sem {
        self.memory.semaphore(sem).unwrap()
    }

    /// Makes this rank vanish: the process dies (SIGKILL), or in thread mode the rank drops
    /// everything it holds (its QPs and memory regions are destroyed) and its thread ends.
    pub fn die(&self, s: Setup) {
        match self.mode {
            Mode::Processes => super::die(),
            Mode::Threads => drop(s),
        }
    }
}

/// Runs test `name` with `size` ranks of `body`; with `rank0_only`, the other ranks may die.
pub fn run(h: &Harness, name: &str, size: usize, min_free_bytes: u64, rank0_only: bool, body: fn(&Rank, &Harness)) {
    if h.mode == Mode::Processes
        && let Some(r) = Rank::from_env()
    {
        body(&r, h);
        return;
    }
    // Tests that need much memory (min_free_bytes) run one at a time in a test binary: two
    // 4 GiB-write tests at once (the atomic and no-atomic suites) took 17 GB of the CI machine's
    // 24, and the OOM killer took the binary when anything else ran beside it. The lock is held
    // by the test thread, not by the ranks, which it waits for.
    static BIG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _big = (min_free_bytes > 0).then(|| BIG.lock().unwrap_or_else(|p| p.into_inner()));
    if min_free_bytes > 0 && mem_available() < min_free_bytes {
        println!(
            "SKIPPED {name}: needs about {} GiB free, this machine has {} MiB",
            min_free_bytes >> 30,
            mem_available() >> 20
        );
        return;
    }
    match h.mode {
        Mode::Processes => {
            let job = spawn_ranks(name, size, &[]);
            if rank0_only {
                let (_, o) = &job.outputs[0];
                let out = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                assert!(o.status.success(), "rank 0 failed:\n{}\n{}", out(&o.stdout), out(&o.stderr));
                // Rank 0's own report lines (its test harness lines would be counted twice).
                for l in out(&o.stdout).lines().filter(|l| !l.starts_with("test ") && !l.starts_with("running ")) {
                    println!("{l}");
                }
            } else {
                job.assert_success();
            }
        }
        Mode::Threads => run_threads(size, |r| body(r, h)),
    }
}

/// Runs `body` as `size` ranks, one thread each, with a root server in this process; fails when
/// a rank panics (its message is printed above).
pub fn run_threads(size: usize, body: impl Fn(&Rank) + Sync) {
    let (root, id) = RootServer::start(size, T).expect("root server");
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..size)
            .map(|rank| {
                let r = Rank { rank, size, id: id.clone() };
                let body = &body;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(sc, move || body(&r))
                    .expect("spawn rank thread")
            })
            .collect();
        let failed: Vec<usize> =
            hs.into_iter().enumerate().filter_map(|(rank, t)| t.join().is_err().then_some(rank)).collect();
        assert!(failed.is_empty(), "ranks {failed:?} panicked (see above)");
    });
    drop(root);
}

/// The libtest name of test `f` in module `module` (`module_path!()`, whose first part is the
/// test crate): what `--exact` matches.
pub fn test_name(module: &str, f: &str) -> String {
    match module.split_once("::") {
        Some((_, m)) => format!("{m}::{f}"),
        None => f.to_string(),
    }
}

pub fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("MemAvailable:")).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()))
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// Expands to one `#[test]` per suite test, run with harness `$h` (an expression of type
/// `&'static Harness`); extra attributes (`#[ignore = "..."]`) go on every test.
#[macro_export]
macro_rules! connection_suite {
    ($h:expr $(, #[$m:meta])*) => {
        $crate::connection_suite!(@one $h, writes_of_all_sizes_arrive_exact, 2, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, signal_follows_its_writes, 2, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, atomic_add_from_both_sides_sums_exactly, 2, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, many_writes_past_the_queue_bound, 2, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, progress_reaches_requested_positions, 2, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, four_ranks_all_to_all, 4, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, bad_writes_are_invalid_usage_and_send_nothing, 2, 0, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, peer_gone_mid_transfer, 2, 0, true $(, #[$m])*);
        $crate::connection_suite!(@one $h, write_over_4gib, 2, 10 << 30, false $(, #[$m])*);
        $crate::connection_suite!(@one $h, semaphore_shared_by_threads, 2, 0, false $(, #[$m])*);
    };
    (@one $h:expr, $name:ident, $size:expr, $mem:expr, $r0:expr $(, #[$m:meta])*) => {
        #[test]
        $(#[$m])*
        fn $name() {
            let name = common::suite::test_name(module_path!(), stringify!($name));
            common::suite::run($h, &name, $size, $mem, $r0, common::suite::$name);
        }
    };
}

pub struct Setup {
    pub bs: Arc<dyn Bootstrap>,
    pub comm: Communicator,
    pub conns: Vec<Option<Connection>>,
    pub local: Mem,
    pub remote: Vec<Option<RegisteredMemory>>,
    pub sems: Vec<Option<Sem>>,
}

/// Connects every pair, exchanges one buffer of `len` bytes per rank and builds semaphores.
pub fn setup(r: &Rank, h: &Harness, len: usize, queue: Option<usize>) -> Setup {
    let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
    let comm = Communicator::new(bs.clone());
    h.prepare_context(comm.context());
    let local = h.alloc(comm.context(), r.rank, len, h.flags());
    let cfg = h.endpoint_config(r.rank, queue);
    let super::Links { conns, remote, sems } =
        super::connect_all(&comm, r.rank, r.size, &cfg, local.memory(), |s| h.semaphore(s));
    bs.barrier().unwrap();
    Setup { bs, comm, conns, local, remote, sems }
}

/// Writes of 1 B .. 64 MiB at pseudo-random offsets, both directions at once, each verified.
pub fn writes_of_all_sizes_arrive_exact(r: &Rank, h: &Harness) {
    let cap = (64 << 20) + 8192;
    let s = setup(r, h, cap, None);
    let peer = 1 - r.rank;
    let conn = s.conns[peer].as_ref().unwrap();
    let dst = s.remote[peer].as_ref().unwrap();
    let sem = s.sems[peer].as_ref().unwrap();
    let src = h.alloc(s.comm.context(), r.rank, cap, h.flags());
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
}

/// One semaphore shared by 16 threads on each rank, 8 signalling and 8 waiting at once: no
/// signal is lost or consumed twice (every wait returns, the totals are exact, and nothing is left
/// over). Host semaphores are shared as clones (one handle each), GPU ones by reference.
pub fn semaphore_shared_by_threads(r: &Rank, h: &Harness) {
    const THREADS: u64 = 8;
    const EACH: u64 = 200;
    let s = setup(r, h, 4096, None);
    let peer = 1 - r.rank;
    let sem = s.sems[peer].as_ref().unwrap();
    std::thread::scope(|sc| {
        for i in 0..2 * THREADS {
            let mine = match sem {
                Sem::Host(h) => Some(Sem::Host(h.clone())),
                Sem::Gpu(_) => None,
            };
            sc.spawn(move || {
                let sem = mine.as_ref().unwrap_or(sem);
                for _ in 0..EACH {
                    if i < THREADS { sem.signal().unwrap() } else { sem.wait(T).unwrap() }
                }
            });
        }
    });
    match sem {
        Sem::Host(h) => {
            assert_eq!(h.inbound_token(), THREADS * EACH, "the peer's signals as counted here");
            assert!(!h.poll().unwrap(), "a signal was left unconsumed");
        }
        Sem::Gpu(g) => assert_eq!(g.inbound_token().unwrap(), THREADS * EACH, "the peer's signals"),
    }
    s.bs.barrier().unwrap();
}

/// Signals never overtake the writes before them.
pub fn signal_follows_its_writes(r: &Rank, h: &Harness) {
    let s = setup(r, h, 1 << 20, Some(16));
    let peer = 1 - r.rank;
    let sem = s.sems[peer].as_ref().unwrap();
    if r.rank == 0 {
        let conn = s.conns[1].as_ref().unwrap();
        let src = h.alloc(s.comm.context(), r.rank, 1 << 20, h.flags());
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
}

/// Remote atomic adds from the peer (two threads), and local CPU adds on the same word where the
/// transport makes them atomic with each other, sum exactly.
pub fn atomic_add_from_both_sides_sums_exactly(r: &Rank, h: &Harness) {
    let s = setup(r, h, 4096, Some(64));
    let peer = 1 - r.rank;
    let conn = s.conns[peer].as_ref().unwrap().clone();
    let dst = s.remote[peer].as_ref().unwrap().clone();
    if !h.atomics {
        let e = conn.atomic_add(&dst, 8, 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert_eq!(conn.outstanding(), 0);
        s.bs.barrier().unwrap();
        return;
    }
    const N: i64 = 5000;
    let local_adds = if h.cpu_atomics_coherent { N } else { 0 };
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
        if local_adds > 0 {
            let w = s.local.atomic_u64(8).unwrap();
            for _ in 0..local_adds {
                w.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
        }
    });
    conn.flush(T).unwrap();
    s.bs.barrier().unwrap();
    assert_eq!(s.local.read_u64(8).unwrap() as i64, N * 3 + N * 4 + local_adds);
    assert_eq!(s.local.read_u64(16).unwrap(), (-2i64) as u64);
    s.bs.barrier().unwrap();
}

/// Far more writes than the queue bound; write waits instead of growing, and all land.
pub fn many_writes_past_the_queue_bound(r: &Rank, h: &Harness) {
    let s = setup(r, h, 1 << 16, Some(8));
    if r.rank == 0 {
        let conn = s.conns[1].as_ref().unwrap();
        assert_eq!(conn.max_write_queue_size(), 8);
        let src = h.alloc(s.comm.context(), r.rank, 1 << 16, h.flags());
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
        assert!(s.local.to_vec().unwrap() == pattern(9, 1 << 16));
    }
    s.bs.barrier().unwrap();
}

/// The non-blocking completion sequence: a position taken with `request_progress` is reached by
/// polling `progress` alone (no flush), under more traffic issued behind it, and every write up to
/// it has landed by then; `completed` never passes `issued` and never goes back.
pub fn progress_reaches_requested_positions(r: &Rank, h: &Harness) {
    let len = 1 << 16;
    let s = setup(r, h, len, Some(32));
    if r.rank == 0 {
        let conn = s.conns[1].as_ref().unwrap();
        let dst = s.remote[1].as_ref().unwrap();
        let src = h.alloc(s.comm.context(), r.rank, len, h.flags());
        src.write(0, &pattern(11, len)).unwrap();
        let p0 = conn.progress().unwrap();
        assert_eq!(p0.completed, p0.issued, "a fresh connection has nothing outstanding: {p0:?}");
        let mut last = p0.completed;
        for round in 0..50u64 {
            // Half the buffer per round, then a position, then more traffic behind it.
            let off = (round % 2) * (len as u64 / 2);
            for k in 0..8u64 {
                let chunk = len as u64 / 16;
                conn.write(dst, off + k * chunk, src.memory(), off + k * chunk, chunk).unwrap();
            }
            let pos = conn.request_progress().unwrap();
            assert!(pos >= 8 * (round + 1), "position {pos} after {} writes", 8 * (round + 1));
            conn.write(dst, 0, src.memory(), 0, 8).unwrap();
            let t0 = Instant::now();
            loop {
                let p = conn.progress().unwrap();
                assert!(p.completed <= p.issued && p.completed >= last, "{p:?} after {last}");
                last = p.completed;
                if p.completed >= pos {
                    break;
                }
                assert!(t0.elapsed() < T, "round {round}: completed {p:?} never reached {pos}");
                std::thread::yield_now();
            }
        }
        conn.flush(T).unwrap();
        let p = conn.progress().unwrap();
        assert_eq!(p.completed, p.issued, "after a flush: {p:?}");
        s.sems[1].as_ref().unwrap().signal().unwrap();
    } else {
        s.sems[0].as_ref().unwrap().wait(T).unwrap();
        assert!(s.local.to_vec().unwrap() == pattern(11, len), "a write reported complete has not landed");
    }
    s.bs.barrier().unwrap();
}

/// Four ranks, each writing its rank's pattern into every other and signalling.
pub fn four_ranks_all_to_all(r: &Rank, h: &Harness) {
    let n = r.size;
    let slot = 256 * 1024;
    let s = setup(r, h, slot * n, None);
    let src = h.alloc(s.comm.context(), r.rank, slot, h.flags());
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
}

/// Bad bounds and transports are refused before anything is sent.
pub fn bad_writes_are_invalid_usage_and_send_nothing(r: &Rank, h: &Harness) {
    let s = setup(r, h, 4096, None);
    let peer = 1 - r.rank;
    let conn = s.conns[peer].as_ref().unwrap();
    let dst = s.remote[peer].as_ref().unwrap();
    let src = h.alloc(s.comm.context(), r.rank, 4096, h.flags());
    let plain = h.alloc(s.comm.context(), r.rank, 4096, TransportFlags::NONE);
    src.fill(0, 4096, 0xEE).unwrap();
    let mut cases: Vec<(&str, mscclpp::Result<()>)> = vec![
        ("dst out of bounds", conn.write(dst, 4000, src.memory(), 0, 200)),
        ("dst offset overflow", conn.write(dst, u64::MAX, src.memory(), 0, 2)),
        ("src out of bounds", conn.write(dst, 0, src.memory(), 4090, 10)),
        ("src without transport", conn.write(dst, 0, plain.memory(), 0, 10)),
        ("src is remote", conn.write(dst, 0, dst, 0, 10)),
        ("unaligned atomic", conn.atomic_add(dst, 4, 1)),
        ("atomic out of bounds", conn.atomic_add(dst, 4096, 1)),
        ("unaligned token", conn.update_and_sync(dst, 4, &AtomicU64::new(0), 1)),
        ("token out of bounds", conn.update_and_sync(dst, 4096, &AtomicU64::new(0), 1)),
    ];
    if !h.local_destination_allowed {
        cases.push(("dst is local memory", conn.write(s.local.memory(), 0, src.memory(), 0, 10)));
    }
    for (what, res) in cases {
        let e = res.expect_err(what);
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{what}: {e}");
        assert_eq!(e.peer(), Some(peer), "{what}: {e}");
    }
    assert_eq!(conn.outstanding(), 0, "nothing may have been queued");
    conn.status().unwrap();
    s.bs.barrier().unwrap();
    assert!(s.local.to_vec().unwrap().iter().all(|b| *b == 0), "nothing may have arrived");
    s.bs.barrier().unwrap();
}

/// The peer vanishes mid-transfer (killed, or its QPs and memory destroyed): write, flush and
/// wait fail with an error (not a timeout) well within their timeouts, naming the peer. Where
/// the transport cannot notice, nothing hangs or breaks: flush succeeds (the peer's memory
/// stays mapped) and the wait for the peer's signal ends by `Timeout` naming the peer.
pub fn peer_gone_mid_transfer(r: &Rank, h: &Harness) {
    const WRITING: u64 = 77;
    let s = setup(r, h, 8 << 20, None);
    if r.rank == 1 {
        // Mid-transfer: once rank 0 says its first write is issued.
        s.bs.recv(0, WRITING).unwrap();
        h.die(s);
        return;
    }
    let conn = s.conns[1].as_ref().unwrap();
    let src = h.alloc(s.comm.context(), r.rank, 8 << 20, h.flags());
    conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 8 << 20).unwrap();
    s.bs.send(1, WRITING, &[]).unwrap();
    if !h.detects_peer_gone {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 8 << 20).unwrap();
        }
        conn.flush(T).unwrap();
        let we = s.sems[1].as_ref().unwrap().wait(Duration::from_secs(2)).expect_err("wait after the peer died");
        assert_eq!(we.kind(), ErrorKind::Timeout, "{we}");
        assert_eq!(we.peer(), Some(1), "{we}");
        conn.status().unwrap();
        println!("writes and flush after the peer died: Ok\nwait: {we}");
        return;
    }
    let t0 = Instant::now();
    let mut res = Ok(());
    while t0.elapsed() < Duration::from_secs(5) {
        res = conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 8 << 20);
        if res.is_err() {
            break;
        }
    }
    let flush = conn.flush(Duration::from_secs(60));
    let wait = s.sems[1].as_ref().unwrap().wait(Duration::from_secs(60));
    let el = t0.elapsed();
    let fe = flush.expect_err("flush after the peer died");
    let we = wait.expect_err("wait after the peer died");
    assert_ne!(fe.kind(), ErrorKind::Timeout, "{fe}");
    assert_ne!(we.kind(), ErrorKind::Timeout, "{we}");
    assert_eq!(fe.peer(), Some(1), "{fe}");
    // The cause, not its echo (HostNoAtomic: the receives flushed by the QP's error state).
    assert!(!fe.to_string().contains("flushed"), "{fe}");
    assert!(!we.to_string().contains("flushed"), "{we}");
    // Not a timeout (asserted above), and well inside the 60 s ones with a loaded machine's
    // margin (5 s of writes included): the death was noticed, not waited out.
    assert!(el < Duration::from_secs(40), "took {el:?}");
    println!("write: {res:?}\nflush: {fe}\nwait: {we}\nafter {el:?}");
}

/// One write larger than 4 GiB (sizes past 32 bits), byte-exact. Needs about 9 GiB free.
pub fn write_over_4gib(r: &Rank, h: &Harness) {
    const LEN: usize = (4 << 30) + 4099;
    let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
    let comm = Communicator::new(bs.clone());
    h.prepare_context(comm.context());
    let buf = h.alloc(comm.context(), r.rank, LEN, h.flags());
    let peer = 1 - r.rank;
    let pc = comm.connect(&h.endpoint_config(r.rank, None), peer, 0).unwrap();
    comm.send_memory(buf.memory(), peer, 1).unwrap();
    let remote = comm.recv_memory(peer, 1).unwrap().wait().unwrap();
    let conn = pc.wait().unwrap();
    let sem = h.semaphore(comm.build_semaphore(&conn, peer, 2).unwrap().wait().unwrap());
    // A position-dependent pattern, cheap to make and to check in every profile (slice copies
    // and comparisons, no per-byte loop over 4 GiB): bytes repeat with a period that is no power
    // of two, and each MiB starts with its own offset, so a misplaced chunk shows.
    const PERIOD: usize = (1 << 20) + 7;
    const CHUNK: usize = 1 << 20;
    let word = |i: usize| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes();
    let pat: Vec<u8> = (0..PERIOD + CHUNK).map(|i| word((i % PERIOD) / 8)[(i % PERIOD) % 8]).collect();
    let expected = |base: usize, n: usize, chunk: &mut [u8]| {
        chunk[..n].copy_from_slice(&pat[base % PERIOD..][..n]);
        chunk[..8].copy_from_slice(&(base as u64).to_le_bytes());
    };
    let mut chunk = vec![0u8; CHUNK];
    if r.rank == 0 {
        for base in (0..LEN).step_by(CHUNK) {
            let n = (LEN - base).min(CHUNK);
            expected(base, n, &mut chunk);
            buf.write(base, &chunk[..n]).unwrap();
        }
        let t0 = Instant::now();
        conn.write(&remote, 0, buf.memory(), 0, LEN as u64).unwrap();
        sem.signal().unwrap();
        conn.flush(Duration::from_secs(300)).unwrap();
        println!("4 GiB + 4099 B write: {:.2} GB/s", LEN as f64 / t0.elapsed().as_secs_f64() / 1e9);
    } else {
        sem.wait(Duration::from_secs(300)).unwrap();
        let mut want = vec![0u8; CHUNK];
        for base in (0..LEN).step_by(CHUNK) {
            let n = (LEN - base).min(CHUNK);
            buf.read(base, &mut chunk[..n]).unwrap();
            expected(base, n, &mut want);
            if chunk[..n] != want[..n] {
                let j = (0..n).find(|&j| chunk[j] != want[j]).unwrap_or(0);
                panic!("byte {} differs: {:#04x} where {:#04x} was sent", base + j, chunk[j], want[j]);
            }
        }
    }
    bs.barrier().unwrap();
}
