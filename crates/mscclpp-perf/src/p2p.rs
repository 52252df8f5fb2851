//! The `p2p` test: a ring, rank r writes to rank (r+1) mod N and signals it (with 2 ranks only
//! 0 -> 1, both ways with `--bidirectional`); the same processes then do the same over plain TCP
//! sockets on the same interface. The round trip passes one token around the ring.
//!
//! The raw baseline's bandwidth uses one TCP connection per direction (to `next`, from `prev`);
//! its round trip is the natural ping-pong: with 2 ranks one connection used both ways, so each
//! reply carries the TCP acknowledgement of the message it answers (with more ranks, each hop
//! goes to another peer, over the ring's connections). Its reads and writes poll a non-blocking
//! socket (spin, then yield), as our semaphore wait does.

use std::io::{IsTerminal, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mscclpp::{Bootstrap, Communicator, Connection, Device, DeviceBuffer, EndpointConfig, RegisteredMemory, Transport};

use crate::Args;
use crate::report::{Meta, RankInfo, Record, Report, Stat};
use mscclpp::bench::{Mem, Memory, Sem};

const TAG_CONN: u32 = 10;
const TAG_MEM: u32 = 11;
const TAG_SEM: u32 = 12;
const TAG_BASELINE: u64 = 77;
const TAG_INFO: u64 = 78;

fn e2s(e: mscclpp::Error) -> String {
    e.to_string()
}

/// The message sizes: `min` times `factor` (at least 2) up to `max`, with `max` itself last.
pub fn sizes(min: u64, max: u64, factor: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s < max {
        v.push(s);
        s = s.saturating_mul(factor.max(2));
    }
    v.push(max);
    v
}

fn iters_for(args: &Args, size: u64, budget: u64, lo: u64, hi: u64) -> u64 {
    args.iters.unwrap_or_else(|| (budget / size.max(1)).clamp(lo, hi)).max(1)
}

/// The bytes rank `rank` sends at `size` (`-c` checks them at the receiver).
fn pattern(rank: usize, size: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(131).wrapping_add(rank as u64 * 29 + size).wrapping_add((i >> 8) as u64) as u8;
    }
}

/// A connection to one neighbour in the ring, with its semaphore.
struct Link {
    conn: Connection,
    sem: Sem,
}

/// Who this rank writes to and hears from.
#[derive(Clone, Copy, Debug)]
struct Ring {
    rank: usize,
    size: usize,
    next: usize,
    prev: usize,
    /// Whether this rank writes in the bandwidth test, and whether it receives.
    sends: bool,
    recvs: bool,
}

impl Ring {
    fn new(rank: usize, size: usize, bidirectional: bool) -> Ring {
        let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
        // Two ranks: one link; 0 -> 1 only unless both directions are asked for.
        let one_way = size == 2 && !bidirectional;
        Ring { rank, size, next, prev, sends: !one_way || rank == 0, recvs: !one_way || rank == 1 }
    }

    /// The header's description.
    fn describe(size: usize, bidirectional: bool) -> String {
        if size == 2 && !bidirectional {
            "rank 0 writes to rank 1 and signals (--bidirectional: both at once); round trip 0 -> 1 -> 0".into()
        } else if size == 2 {
            "ranks 0 and 1 write to each other at once and signal; bandwidth per direction; round trip 0 -> 1 -> 0"
                .into()
        } else {
            format!(
                "ring: rank r writes to rank (r+1) mod {size} and signals, all at once; bandwidth per sender; round \
                 trip = one token around the ring, scaled to 2 hops"
            )
        }
    }
}

struct Ours {
    links: Vec<Link>,
    /// Index in `links` of the connection to `next` and to `prev` (the same with 2 ranks).
    to_next: usize,
    from_prev: usize,
    /// What this rank sends from, and where `prev` writes.
    src: Mem,
    dst: Mem,
    /// `next`'s `dst`.
    remote: RegisteredMemory,
    /// CUDA IPC: a buffer on the next rank's GPU for the raw copy baseline, and one on ours for
    /// the local small-copy figure.
    baseline: Vec<DeviceBuffer>,
}

struct Side {
    ring: Ring,
    bs: Arc<dyn Bootstrap>,
    ours: Ours,
    /// The baseline's sockets: to `next`, and from `prev`.
    out: TcpStream,
    inn: TcpStream,
    raw_src: Vec<u8>,
    raw_dst: Vec<u8>,
}

fn interface_ip(iface: &Option<String>) -> Result<IpAddr, String> {
    match iface {
        Some(i) => mscclpp::net::resolve_interface(i).map_err(e2s),
        None => Ok(mscclpp::net::find_interfaces().map_err(e2s)?[0].addr),
    }
}

fn transport_of(args: &Args) -> Transport {
    if args.cuda_ipc() {
        Transport::CudaIpc
    } else if args.ib() {
        Transport::IB0
    } else {
        Transport::Ethernet
    }
}

/// The GPU this rank uses with `--memory gpu`.
fn gpu_of(args: &Args, rank: usize) -> Result<Option<u32>, String> {
    match args.memory {
        Memory::Gpu => {
            let n = mscclpp::gpu::device_count().map_err(e2s)? as u32;
            Ok(Some((args.device + rank as u32) % n.max(1)))
        }
        Memory::Host => Ok(None),
    }
}

fn setup(args: &Args, bs: Arc<dyn Bootstrap>, iface: &Option<String>) -> Result<Side, String> {
    let ring = Ring::new(bs.rank(), bs.size(), args.bidirectional);
    let comm = Communicator::new(bs.clone());
    let len = args.max_bytes as usize;
    let ipc = args.cuda_ipc();
    let transport = transport_of(args);
    if let Some(d) = &args.ib_device {
        comm.context().set_ib_device(Transport::IB0, d).map_err(e2s)?;
    }
    let gpu = gpu_of(args, ring.rank)?;
    let alloc = || -> Result<Mem, String> {
        args.memory.alloc(comm.context(), gpu.unwrap_or(0), len, transport.into()).map_err(e2s)
    };
    let (src, dst) = (alloc()?, alloc()?);
    let mut cfg = EndpointConfig::new(transport);
    cfg.ethernet.interface = iface.clone();
    // `--timeout` bounds every wait, the Ethernet sender's on a peer that reads nothing too.
    cfg.ethernet.connect_timeout = args.timeout();
    cfg.ib.gid_index = args.gid_index;
    // CUDA IPC, and IB with GPU memory (its NIC is chosen for that GPU), serve the GPU.
    let gpu_endpoint = ipc || (args.ib() && gpu.is_some());
    if gpu_endpoint {
        cfg.device = Device::Gpu(gpu.unwrap_or(0));
    }
    let peers: Vec<usize> = if ring.next == ring.prev { vec![ring.next] } else { vec![ring.next, ring.prev] };
    let pending: Vec<_> =
        peers.iter().map(|&p| comm.connect(&cfg, p, TAG_CONN)).collect::<mscclpp::Result<_>>().map_err(e2s)?;
    comm.send_memory(dst.memory(), ring.prev, TAG_MEM).map_err(e2s)?;
    let remote = comm.recv_memory(ring.next, TAG_MEM).map_err(e2s)?;
    let conns: Vec<Connection> = pending.into_iter().map(|p| p.wait()).collect::<mscclpp::Result<_>>().map_err(e2s)?;
    let remote = remote.wait().map_err(e2s)?;
    let sems: Vec<_> = conns
        .iter()
        .zip(&peers)
        .map(|(c, &p)| comm.build_semaphore(c, p, TAG_SEM))
        .collect::<mscclpp::Result<_>>()
        .map_err(e2s)?;
    let mut links = Vec::new();
    for (conn, sem) in conns.into_iter().zip(sems) {
        let raw = sem.wait().map_err(e2s)?;
        // The semaphore: host-waited for Ethernet, GPU-side where the endpoint serves the GPU.
        let sem = if gpu_endpoint { Memory::Gpu } else { Memory::Host }.semaphore(raw).map_err(e2s)?;
        links.push(Link { conn, sem });
    }
    let from_prev = if ring.next == ring.prev { 0 } else { 1 };
    let mut baseline = Vec::new();
    if let (Some(d), true) = (gpu, ipc) {
        let next_dev = gpu_of(args, ring.next)?.unwrap_or(d);
        let none = mscclpp::TransportFlags::NONE;
        baseline.push(DeviceBuffer::new(comm.context(), next_dev, len, none).map_err(e2s)?);
        baseline.push(DeviceBuffer::new(comm.context(), d, 8, none).map_err(e2s)?);
    }
    // The baseline: a plain TCP connection to `next` and one from `prev`, same interface.
    let ip = interface_ip(iface)?;
    let l = TcpListener::bind((ip, 0)).map_err(|e| format!("baseline listener on {ip}: {e}"))?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    bs.send(ring.prev, TAG_BASELINE, addr.to_string().as_bytes()).map_err(e2s)?;
    let a = bs.recv(ring.next, TAG_BASELINE).map_err(e2s)?;
    let next_addr: SocketAddr =
        String::from_utf8_lossy(&a).parse().map_err(|_| format!("bad baseline address from rank {}", ring.next))?;
    let out = TcpStream::connect_timeout(&next_addr, args.timeout())
        .map_err(|e| format!("baseline connect to rank {} ({next_addr}): {e}", ring.next))?;
    let inn = accept_within(&l, args.timeout()).map_err(|e| format!("baseline accept from rank {}: {e}", ring.prev))?;
    for s in [&out, &inn] {
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(args.timeout())).map_err(|e| e.to_string())?;
        // A stopped peer fills the socket buffer: the write fails at the timeout, never hangs.
        s.set_write_timeout(Some(args.timeout())).map_err(|e| e.to_string())?;
    }
    Ok(Side {
        ring,
        bs,
        ours: Ours { links, to_next: 0, from_prev, src, dst, remote, baseline },
        out,
        inn,
        // CUDA IPC's baseline is a GPU copy: no host buffers for it.
        raw_src: vec![0x5a; if ipc { 0 } else { len }],
        raw_dst: vec![0; if ipc { 0 } else { len }],
    })
}

/// How the raw baseline's round trip polls its socket: like `Host2HostSemaphore::wait`, spin
/// briefly, then yield the CPU, never block in `read`.
const POLL_SPIN: Duration = Duration::from_micros(5);

fn io(what: &str, peer: usize) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("baseline {what} rank {peer}: {e}")
}

/// Moves `len` bytes through `f` (a read or write of a non-blocking socket, given how many
/// bytes are done), polling: spin, then yield while it would block; fails after `t` without
/// progress, or on `Ok(0)` (the peer closed).
fn poll_io(
    what: &str,
    peer: usize,
    len: usize,
    t: Duration,
    mut f: impl FnMut(usize) -> std::io::Result<usize>,
) -> Result<(), String> {
    let mut done = 0;
    let mut t0 = Instant::now();
    while done < len {
        match f(done) {
            Ok(0) => return Err(format!("baseline: rank {peer} closed the socket")),
            Ok(n) => {
                done += n;
                t0 = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let el = t0.elapsed();
                if el > t {
                    return Err(format!("baseline: {what} rank {peer}: no progress in {t:?}"));
                } else if el < POLL_SPIN {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(what, peer)(e)),
        }
    }
    Ok(())
}

/// The frame of every bandwidth figure, ours and the baseline's: `phase(warm)` to warm up, a
/// barrier so that all ranks start together, then seconds for `phase(iters)`; NaN on a rank that
/// does not `take_part` (it runs the phases and the barrier all the same).
fn timed(
    bs: &dyn Bootstrap,
    take_part: bool,
    warm: u64,
    iters: u64,
    mut phase: impl FnMut(u64) -> Result<(), String>,
) -> Result<f64, String> {
    phase(warm)?;
    bs.barrier().map_err(e2s)?;
    let t0 = Instant::now();
    phase(iters)?;
    Ok(if take_part { t0.elapsed().as_secs_f64() } else { f64::NAN })
}

/// The frame of every latency figure: `step` run `warm + iters` times; seconds for the last
/// `iters` of them. The first error ends it and is returned.
fn laps(warm: u64, iters: u64, mut step: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let mut t0 = Instant::now();
    for i in 0..warm + iters {
        if i == warm {
            t0 = Instant::now();
        }
        step()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

impl Side {
    fn next_link(&self) -> &Link {
        &self.ours.links[self.ours.to_next]
    }
    fn prev_link(&self) -> &Link {
        &self.ours.links[self.ours.from_prev]
    }

    /// Seconds for `iters` writes of `size` to `next` (each with a signal), until the last of
    /// them is confirmed by `next`, and for receiving as many from `prev`; NaN on a rank that
    /// does neither.
    fn ours_bw(&self, size: u64, warm: u64, iters: u64, t: Duration) -> Result<f64, String> {
        let o = &self.ours;
        let r = self.ring;
        let phase = |n: u64| -> Result<(), String> {
            let (nx, pv) = (self.next_link(), self.prev_link());
            if r.sends {
                for _ in 0..n {
                    nx.conn.write(&o.remote, 0, o.src.memory(), 0, size).map_err(e2s)?;
                    nx.sem.signal().map_err(e2s)?;
                }
            }
            if r.recvs {
                for _ in 0..n {
                    pv.sem.wait(t).map_err(e2s)?;
                }
                // Tell `prev` all of it arrived.
                pv.sem.signal().map_err(e2s)?;
            }
            if r.sends {
                nx.sem.wait(t).map_err(e2s)?;
            }
            Ok(())
        };
        timed(&*self.bs, r.sends || r.recvs, warm, iters, phase)
    }

    /// The same over the raw sockets: write `iters` x `size` to `next` while a second thread
    /// reads as much from `prev`, then a one-byte confirmation each way.
    fn base_bw(&mut self, size: u64, warm: u64, iters: u64) -> Result<f64, String> {
        let size = size as usize;
        let r = self.ring;
        let (out, inn) = (&self.out, &self.inn);
        let (src, dst) = (&self.raw_src[..size], &mut self.raw_dst[..size]);
        let phase = |n: u64| -> Result<(), String> {
            let send = || -> Result<(), String> {
                if r.sends {
                    let mut w = out;
                    for _ in 0..n {
                        w.write_all(src).map_err(io("write to", r.next))?;
                    }
                }
                Ok(())
            };
            let recv = |dst: &mut [u8]| -> Result<(), String> {
                if r.recvs {
                    let mut rd = inn;
                    for _ in 0..n {
                        rd.read_exact(dst).map_err(io("read from", r.prev))?;
                    }
                    rd.write_all(&[1]).map_err(io("confirm to", r.prev))?;
                }
                Ok(())
            };
            if r.sends && r.recvs {
                std::thread::scope(|s| {
                    let h = s.spawn(send);
                    let got = recv(dst);
                    h.join().map_err(|_| "baseline sender thread panicked".to_string())?.and(got)
                })?;
            } else {
                send()?;
                recv(dst)?;
            }
            if r.sends {
                let mut one = [0u8; 1];
                let mut rd = out;
                rd.read_exact(&mut one).map_err(io("confirmation from", r.next))?;
            }
            Ok(())
        };
        timed(&*self.bs, r.sends || r.recvs, warm, iters, phase)
    }

    /// Seconds per write+signal round trip of `size`: rank 0 starts a token around the ring;
    /// the lap is scaled to two hops.
    fn ours_rtt(&self, size: u64, warm: u64, iters: u64, t: Duration) -> Result<f64, String> {
        let o = &self.ours;
        let (nx, pv) = (self.next_link(), self.prev_link());
        let hop = || -> Result<(), String> {
            nx.conn.write(&o.remote, 0, o.src.memory(), 0, size).map_err(e2s)?;
            nx.sem.signal().map_err(e2s)
        };
        let lap = laps(warm, iters, || {
            if self.ring.rank == 0 {
                hop()?;
                pv.sem.wait(t).map_err(e2s)
            } else {
                pv.sem.wait(t).map_err(e2s)?;
                hop()
            }
        })?;
        Ok(lap / iters as f64 * 2.0 / self.ring.size as f64)
    }

    /// The raw round trip, the natural one: with 2 ranks a ping-pong on one TCP connection used
    /// both ways (rank 0's `out` is rank 1's `inn`), so each reply carries the TCP
    /// acknowledgement of the message before it; with more ranks the same ring over the
    /// sockets (each hop to another peer). Reads poll the socket without blocking (spin, then
    /// yield), as our semaphore wait does.
    fn base_rtt(&mut self, size: u64, warm: u64, iters: u64, t: Duration) -> Result<f64, String> {
        let size = size as usize;
        let r = self.ring;
        // With 2 ranks: the one connection between them (rank 0 dialled it, rank 1 accepted it).
        let (tx, rx) = match (r.size, r.rank) {
            (2, 0) => (&self.out, &self.out),
            (2, _) => (&self.inn, &self.inn),
            _ => (&self.out, &self.inn),
        };
        for s in [tx, rx] {
            s.set_nonblocking(true).map_err(|e| e.to_string())?;
        }
        let (src, dst) = (&self.raw_src[..size], &mut self.raw_dst[..size]);
        let recv = |dst: &mut [u8]| -> Result<(), String> {
            let n = dst.len();
            let mut rd = rx;
            poll_io("read from", r.prev, n, t, |got| rd.read(&mut dst[got..]))
        };
        let send = || -> Result<(), String> {
            let mut w = tx;
            poll_io("write to", r.next, src.len(), t, |sent| w.write(&src[sent..]))
        };
        let res = laps(warm, iters, || {
            if r.rank == 0 { send().and_then(|_| recv(dst)) } else { recv(dst).and_then(|_| send()) }
        });
        for s in [tx, rx] {
            s.set_nonblocking(false).map_err(|e| e.to_string())?;
        }
        Ok(res? / iters as f64 * 2.0 / r.size as f64)
    }

    /// CUDA IPC: seconds for `iters` writes of `size` into the next rank's GPU buffer, then
    /// flush (ranks that send).
    fn ipc_bw(&self, size: u64, warm: u64, iters: u64, t: Duration) -> Result<f64, String> {
        let o = &self.ours;
        let nx = self.next_link();
        let phase = |n: u64| -> Result<(), String> {
            if self.ring.sends {
                for _ in 0..n {
                    nx.conn.write(&o.remote, 0, o.src.memory(), 0, size).map_err(e2s)?;
                }
                nx.conn.flush(t).map_err(e2s)?;
            }
            Ok(())
        };
        timed(&*self.bs, self.ring.sends, warm, iters, phase)
    }

    /// The raw copy engine: the same copy inside this process, from this rank's GPU to the next
    /// rank's (`cuMemcpyPeerAsync` across GPUs), every sending rank at once.
    fn copy_bw(&self, size: u64, warm: u64, iters: u64) -> Result<f64, String> {
        let b = &self.ours.baseline;
        self.bs.barrier().map_err(e2s)?;
        let (Mem::Gpu(src), Some(dst), true) = (&self.ours.src, b.first(), self.ring.sends) else {
            return Ok(f64::NAN);
        };
        Ok(mscclpp::bench::baseline_copy(&[(src, dst)], size as usize, warm, iters).map_err(e2s)?.as_secs_f64())
    }

    /// CUDA IPC: seconds per `update_and_sync` + `flush` of the next rank's token (rank 0).
    fn ipc_signal_latency(&self, warm: u64, iters: u64, t: Duration) -> Result<f64, String> {
        if self.ring.rank != 0 {
            return Ok(f64::NAN);
        }
        let nx = self.next_link();
        let lap = laps(warm, iters, || {
            nx.sem.signal().map_err(e2s)?;
            nx.conn.flush(t).map_err(e2s)
        })?;
        Ok(lap / iters as f64)
    }

    /// The raw small operation into the same destination as ours (the next rank's token, mapped
    /// through CUDA IPC): an 8-byte host-to-device copy and a synchronize (rank 0).
    fn h2d_latency_peer(&self, warm: u64, iters: u64, device: u32) -> Result<f64, String> {
        match &self.next_link().sem {
            Sem::Gpu(s) if self.ring.rank == 0 => {
                Ok(mscclpp::bench::baseline_h2d_8b_into(s.semaphore().remote_memory(), device, warm, iters)
                    .map_err(e2s)?
                    .as_secs_f64())
            }
            _ => Ok(f64::NAN),
        }
    }

    /// The raw small operation: an 8-byte host-to-device copy and a synchronize (rank 0).
    fn h2d_latency(&self, warm: u64, iters: u64) -> Result<f64, String> {
        match self.ours.baseline.last() {
            Some(dst) if self.ring.rank == 0 => {
                Ok(mscclpp::bench::baseline_h2d_8b(dst, warm, iters).map_err(e2s)?.as_secs_f64())
            }
            _ => Ok(f64::NAN),
        }
    }

    /// `-c`: bytes of `dst[..size]` that differ from what `prev` sent.
    fn wrong_bytes(&self, size: u64) -> Result<u64, String> {
        let mut want = vec![0u8; size as usize];
        pattern(self.ring.prev, size, &mut want);
        let mut got = vec![0u8; size as usize];
        self.ours.dst.read(0, &mut got).map_err(e2s)?;
        Ok(want.iter().zip(&got).filter(|(a, b)| a != b).count() as u64)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

fn encode(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn decode(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()
}

/// Per round, the slowest rank's value (NaN where no rank measured).
fn slowest(per_rank: &[Vec<f64>], rounds: usize, col: usize) -> Vec<f64> {
    (0..rounds)
        .map(|i| {
            per_rank
                .iter()
                .filter_map(|v| v.get(i * 4 + col).copied())
                .filter(|x| x.is_finite())
                .fold(f64::NAN, f64::max)
        })
        .collect()
}

fn transport_desc(args: &Args, side: &Side) -> String {
    if args.cuda_ipc() {
        "cuda-ipc".into()
    } else if args.ib() {
        format!(
            "ib (IB0 on {}, {})",
            args.ib_device
                .clone()
                .unwrap_or_else(|| mscclpp::ib::devices().ok().and_then(|d| d.into_iter().next()).unwrap_or_default()),
            match side.next_link().conn.signal_forwarding() {
                Some(how) => format!("HostNoAtomic mode, signals forwarded by {how}"),
                None => "Host mode, RDMA atomics".into(),
            }
        )
    } else {
        "ethernet".into()
    }
}

/// Accepts one connection on `l`, giving up after `limit` (a peer stopped or dead before it
/// connected must not hang this rank).
fn accept_within(l: &TcpListener, limit: std::time::Duration) -> std::io::Result<TcpStream> {
    // `--timeout` is the user's: one too far to be an instant is no limit (no overflow panic).
    let end = std::time::Instant::now().checked_add(limit);
    l.set_nonblocking(true)?;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if end.is_some_and(|end| std::time::Instant::now() >= end) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("nobody connected in {limit:?}"),
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn baseline_desc(args: &Args) -> String {
    if args.cuda_ipc() {
        "bandwidth: the same copy in each sending process (cuMemcpyDtoDAsync on one GPU, cuMemcpyPeerAsync across \
         two); latency column (rank 0): ours = update_and_sync + flush, baseline = 8-byte pinned cuMemcpyHtoDAsync + \
         synchronize into the same peer token"
            .into()
    } else {
        let ib =
            if args.ib() { "; raw verbs figures: perftest ib_write_bw/ib_write_lat on the same device" } else { "" };
        format!(
            "plain TCP sockets (TCP_NODELAY) between the same processes and interface, host memory, in the same \
             pattern (bandwidth: one connection per direction); its round trip is a ping-pong on one connection \
             used both ways (with more than 2 ranks, the ring's connections), polling the socket without blocking \
             (spin, then yield) as our semaphore wait does{ib}"
        )
    }
}

/// Runs the test on every rank; rank 0 reports, a row as each size finishes.
pub fn run(args: &Args, bs: Arc<dyn Bootstrap>, iface: Option<String>) -> Result<(), String> {
    let rank = bs.rank();
    let sizes = sizes(args.min_bytes, args.max_bytes, args.step_factor);
    let mut side = setup(args, bs.clone(), &iface)?;
    let t = args.timeout();
    let ipc = args.cuda_ipc();
    // Where every rank runs, for the header.
    let device = match (&side.ours.src, args.memory) {
        (Mem::Gpu(b), _) => format!("GPU {}", b.device()),
        _ => "host memory (CPU)".to_string(),
    };
    let info = format!("{}\t{}\t{}", hostname(), std::process::id(), device);
    bs.send(0, TAG_INFO, info.as_bytes()).map_err(e2s)?;
    let mut hosts = Vec::new();
    if rank == 0 {
        for r in 0..bs.size() {
            let b = bs.recv(r, TAG_INFO).map_err(e2s)?;
            let s = String::from_utf8_lossy(&b).into_owned();
            let mut f = s.splitn(3, '\t');
            let (h, p, d) = (f.next().unwrap_or(""), f.next().unwrap_or("0"), f.next().unwrap_or(""));
            hosts.push(RankInfo { rank: r, host: h.into(), pid: p.parse().unwrap_or(0), device: d.into() });
        }
    }
    let mut report = Report {
        meta: Meta {
            version: env!("CARGO_PKG_VERSION").into(),
            test: "p2p".into(),
            transport: transport_desc(args, &side),
            memory: match args.memory {
                Memory::Host => "host".into(),
                Memory::Gpu => format!("gpu (device {} + rank)", args.device),
            },
            pattern: Ring::describe(bs.size(), args.bidirectional),
            baseline: baseline_desc(args),
            ranks: bs.size(),
            hosts,
            interface: iface.clone().unwrap_or_else(|| "default (the bootstrap's choice)".into()),
            rounds: args.rounds,
            warmup: args.warmup,
            iters: args.iters,
            check: args.check,
        },
        records: Vec::new(),
    };
    bs.barrier().map_err(e2s)?;
    let bar = (rank == 0 && !args.quiet && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(sizes.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} p2p {pos}/{len} sizes [{bar:30}] {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let print = |lines: Vec<String>| match &bar {
        Some(b) => b.suspend(|| Report::emit(&lines)),
        None => Report::emit(&lines),
    };
    if rank == 0 {
        print(report.header());
    }
    // CUDA IPC: the small-operation latency does not depend on the size: measured with the
    // first size, repeated in the others; and the 8-byte copy into local memory.
    let mut ipc_lat: Option<(Vec<f64>, Vec<f64>)> = None;
    let mut local_h2d: Vec<f64> = Vec::new();
    let rounds = args.rounds.max(1) as usize;
    for &size in &sizes {
        if let Some(b) = &bar {
            b.set_message(crate::report::human(size));
        }
        let bw_iters = iters_for(args, size, (512 << 20) / rounds as u64, 10, 2000);
        let lat_iters = iters_for(args, size, (64 << 20) / rounds as u64, 5, 1000);
        if args.check {
            let mut p = vec![0u8; size as usize];
            pattern(rank, size, &mut p);
            side.ours.src.write(0, &p).map_err(e2s)?;
            side.ours.dst.write(0, &vec![0u8; size as usize]).map_err(e2s)?;
            bs.barrier().map_err(e2s)?;
        }
        // Ours and the baseline alternate, `rounds` times, so a burst of noise on a shared
        // machine does not land on one side only. Per round: [ours bw, base bw, ours rtt,
        // base rtt] in seconds, NaN where this rank did not measure.
        let mut mine: Vec<f64> = Vec::with_capacity(rounds * 4);
        for round in 0..rounds {
            let v = if ipc {
                let ob = side.ipc_bw(size, args.warmup, bw_iters, t)?;
                let bb = side.copy_bw(size, args.warmup, bw_iters)?;
                if ipc_lat.is_none() {
                    let dev = match &side.ours.src {
                        Mem::Gpu(b) => b.device(),
                        Mem::Host(_) => 0,
                    };
                    let l = side.h2d_latency(args.warmup, 1000)?;
                    local_h2d.push(l);
                    let or = side.ipc_signal_latency(args.warmup, 1000, t)?;
                    let br = side.h2d_latency_peer(args.warmup, 1000, dev)?;
                    [ob, bb, or, br]
                } else {
                    let (o, b) = ipc_lat.as_ref().map(|(o, b)| (o[round], b[round])).unwrap_or((f64::NAN, f64::NAN));
                    [ob, bb, o, b]
                }
            } else {
                let ob = side.ours_bw(size, args.warmup, bw_iters, t)?;
                let bb = side.base_bw(size, args.warmup, bw_iters)?;
                bs.barrier().map_err(e2s)?;
                let or = side.ours_rtt(size, args.warmup, lat_iters, t)?;
                bs.barrier().map_err(e2s)?;
                let br = side.base_rtt(size, args.warmup, lat_iters, t)?;
                [ob, bb, or, br]
            };
            mine.extend_from_slice(&v);
        }
        if ipc && ipc_lat.is_none() {
            ipc_lat =
                Some(((0..rounds).map(|i| mine[i * 4 + 2]).collect(), (0..rounds).map(|i| mine[i * 4 + 3]).collect()));
        }
        for l in &side.ours.links {
            l.conn.flush(t).map_err(e2s)?;
        }
        bs.barrier().map_err(e2s)?;
        // What `prev` wrote: in the bandwidth test where this rank receives, and in the round
        // trip on every rank (not with CUDA IPC, whose latency column moves no data).
        let checked = args.check && (side.ring.recvs || !ipc);
        let wrong = if checked { side.wrong_bytes(size)? as f64 } else { f64::NAN };
        mine.push(wrong);
        let all = bs.all_gather(&encode(&mine)).map_err(e2s)?;
        if rank == 0 {
            let per_rank: Vec<Vec<f64>> = all.iter().map(|b| decode(b)).collect();
            let col = |c: usize| Stat::of(&slowest(&per_rank, rounds, c));
            let (ob, bb, or, br) = (col(0), col(1), col(2), col(3));
            let gb = |secs: f64| (size * bw_iters) as f64 / secs / 1e9;
            let ours_gbps = ob.inverse(gb);
            let baseline_gbps = bb.inverse(gb);
            let ours_rtt_us = or.map(|s| s * 1e6);
            let baseline_rtt_us = br.map(|s| s * 1e6);
            let wrong = args.check.then(|| {
                per_rank.iter().filter_map(|v| v.get(rounds * 4)).filter(|x| x.is_finite()).sum::<f64>() as u64
            });
            let rec = Record {
                size,
                time_us: ob.map(|s| s * 1e6 / bw_iters as f64),
                bw_ratio: ours_gbps.median / baseline_gbps.median,
                rtt_ratio: ours_rtt_us.median / baseline_rtt_us.median,
                ours_gbps,
                baseline_gbps,
                ours_rtt_us,
                baseline_rtt_us,
                bw_iters,
                lat_iters,
                wrong,
            };
            print(vec![report.row(&rec)]);
            report.records.push(rec);
            // Rewritten after each size, so a run that fails later keeps what it measured.
            if let Some(p) = &args.json {
                report.write_json(p)?;
            }
        }
        if let Some(b) = &bar {
            b.inc(1);
        }
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if rank == 0 {
        let finite: Vec<f64> = local_h2d.iter().copied().filter(|x| x.is_finite()).collect();
        if ipc && !finite.is_empty() {
            print(vec![format!(
                "# latency baseline above copies into the peer's token (mapped through CUDA IPC); into local GPU memory \
                 the same copy+synchronize takes {:.1} us",
                Stat::of(&finite).median * 1e6
            )]);
        }
        if let Some(w) = report.records.iter().filter_map(|r| r.wrong).find(|w| *w > 0) {
            print(vec![format!("# -c: {w} or more bytes arrived wrong")]);
        }
        if let Some(p) = &args.plot {
            report.write_svg(p)?;
        }
    }
    bs.barrier().map_err(e2s)?;
    if report.records.iter().any(|r| r.wrong.is_some_and(|w| w > 0)) {
        return Err("data check (-c) found wrong bytes".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_ladder() {
        assert_eq!(sizes(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 100, 2), vec![8, 16, 32, 64, 100]);
        assert_eq!(sizes(5, 5, 2), vec![5]);
        assert_eq!(sizes(1, 1000, 10), vec![1, 10, 100, 1000]);
    }

    #[test]
    fn ring_roles() {
        let r = Ring::new(0, 2, false);
        assert!(r.sends && !r.recvs && r.next == 1 && r.prev == 1);
        let r = Ring::new(1, 2, false);
        assert!(!r.sends && r.recvs);
        let r = Ring::new(1, 2, true);
        assert!(r.sends && r.recvs);
        for rank in 0..5 {
            let r = Ring::new(rank, 5, false);
            assert!(r.sends && r.recvs);
            assert_eq!((r.next, r.prev), ((rank + 1) % 5, (rank + 4) % 5));
        }
    }

    #[test]
    fn patterns_differ_by_rank() {
        let (mut a, mut b) = (vec![0u8; 64], vec![0u8; 64]);
        pattern(0, 64, &mut a);
        pattern(1, 64, &mut b);
        assert_ne!(a, b);
    }
}
