//! `mscclpp-perf device`, proxy rows under load (issue 25 item 1): one FIFO and one proxy on
//! rank 0 serve 1, 4 or 8 peers (ranks of this process, threads with a loopback bootstrap, all on
//! `--device`), over CUDA IPC and over Ethernet (127.0.0.1). Per (transport, operation, size,
//! peers), GPU producer counts of 1, 132, 132 x 32 and 132 x 256 threads push triggers one at a
//! time; one thread also pushes them 32 at a time with `push_batch`, one at a time with
//! `push_relaxed` after one `__threadfence_system()`, and so again through a
//! `FifoExclusiveProducer` (no atomic on `head`). Kernel `proxy_load` of `device.rs`: trigger i
//! goes to peer i mod peers. Each row sets the
//! triggers/s through the proxy beside the rate at which one host thread issues the same
//! connection calls directly in the same run (write, and/or `Host2DeviceSemaphore::signal`),
//! measured just before, and their ratio. Both rates count issue (the proxy's pops, the host
//! loop's calls), not the completion of the last copies. Trigger counts are sized from the
//! baseline (about 0.1 s each, at least one trigger per producer) so the rows take ~30 s.
//! Every push's wait is bounded (`MAX_SPINS` rounds, then the kernel traps) and so is every host
//! wait (`--timeout`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mscclpp::device::compile::Kernel;
use mscclpp::device::fifo::Fifo;
use mscclpp::device::proxy::{ProxyConfig, ProxyService};
use mscclpp::gpu::Stream;
use mscclpp::{
    Communicator, Connection, Device, DeviceBuffer, EndpointConfig, Host2DeviceSemaphore, RegisteredMemory, Semaphore,
    Transport,
};

use crate::kern::{args, e, human, launch, local_ranks, row};

/// Peers of rank 0 (the most any row uses).
const PEERS: usize = 8;
/// Destination slots per peer (of the largest size; a power of two, as the kernel masks by it).
const SLOTS: u64 = 256;
const _: () = assert!(SLOTS.is_power_of_two());
/// Largest put.
const MAX_SIZE: u64 = 4 << 10;
/// Rounds a push may wait for a free slot before its kernel traps: the head of the line reads the
/// host's tail about once a microsecond, so a proxy that stops popping fails the row in seconds.
pub(crate) const MAX_SPINS: i64 = 4_000_000;
/// (blocks, threads per block, triggers per push) of the rows: every producer count pushing one
/// trigger at a time (`push`), one thread pushing `BATCH` at a time (`push_batch`), and one
/// thread pushing one at a time with `push_relaxed` after one `__threadfence_system()`
/// (`RELAXED`), and the same through a `FifoExclusiveProducer` (`EXCLUSIVE`: the thread is the
/// FIFO's only producer, no atomic on `head`).
const PRODUCERS: [(u32, u32, i32); 7] =
    [(1, 1, 1), (1, 1, BATCH), (1, 1, RELAXED), (1, 1, EXCLUSIVE), (132, 1, 1), (132, 32, 1), (132, 256, 1)];
/// The kernel's `batch` for `push_relaxed`.
const RELAXED: i32 = -1;
/// The kernel's `batch` for `FifoExclusiveProducer::push_relaxed` (one thread in the grid).
const EXCLUSIVE: i32 = -2;
/// Triggers per `push_batch` in the batched row (the kernel's most).
const BATCH: i32 = 32;
/// Seconds each measurement aims at.
const TARGET_S: f64 = 0.1;

/// The kernel's peer table (`LoadPeers` in `device.rs`), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LoadPeers {
    sem: [u32; 8],
    dst: [u32; 8],
    src: u32,
    npeers: u32,
    slots: u32,
    pad: u32,
}
impl LoadPeers {
    /// One peer, semaphore and memory IDs 0, `slots` slots: the rows fill in the IDs and the
    /// peer count; the `fifo` part's producer diagnostic, whose consumer only pops, uses it as is.
    pub(crate) fn new(slots: u32) -> LoadPeers {
        LoadPeers { sem: [0; 8], dst: [0; 8], src: 0, npeers: 1, slots, pad: 0 }
    }
}
// Same fields, order and size as the CUDA struct (which static_asserts 80 bytes): all u32.
const _: () = assert!(std::mem::size_of::<LoadPeers>() == 80);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Put,
    PutWithSignal,
    Signal,
}

impl Op {
    fn code(self) -> i32 {
        match self {
            Op::Put => 0,
            Op::PutWithSignal => 1,
            Op::Signal => 2,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::PutWithSignal => "putWithSignal",
            Op::Signal => "signal",
        }
    }
}

/// One rank's side. Rank 0: a connection to each peer, the source buffer, the peers'
/// destinations, semaphores for the proxy and for the host baseline. A peer: its connection to
/// rank 0, its destination buffer, and its ends of the semaphores (kept alive).
struct LoadRank {
    comm: Communicator,
    conns: Vec<Connection>,
    local: DeviceBuffer,
    remotes: Vec<RegisteredMemory>,
    proxy_sems: Vec<Semaphore>,
    host_sems: Vec<Host2DeviceSemaphore>,
    _keep: Vec<Semaphore>,
}

fn endpoint(t: Transport, dev: u32) -> EndpointConfig {
    let c = EndpointConfig::new(t).device(Device::Gpu(dev));
    if t == Transport::Ethernet { c.ethernet_interface("127.0.0.1") } else { c }
}

/// Rank 0 and `PEERS` peers of this process over `t` on `dev`.
fn ranks(t: Transport, dev: u32, timeout: Duration) -> Result<Vec<LoadRank>, String> {
    let len = (SLOTS * MAX_SIZE) as usize;
    local_ranks(PEERS + 1, timeout, |rank, bs| {
        let comm = Communicator::new(bs.clone());
        let local = DeviceBuffer::new(comm.context(), dev, len, t.into()).map_err(e)?;
        local.fill(0, len, 0).map_err(e)?;
        let cfg = endpoint(t, dev);
        let others: Vec<usize> = if rank == 0 { (1..=PEERS).collect() } else { vec![0] };
        let mut pcs = Vec::new();
        let mut pms = Vec::new();
        for &p in &others {
            pcs.push(comm.connect(&cfg, p, 0).map_err(e)?);
            if rank == 0 {
                pms.push(comm.recv_memory(p, 1).map_err(e)?);
            } else {
                comm.send_memory(local.memory(), p, 1).map_err(e)?;
            }
        }
        let mut conns = Vec::new();
        for pc in pcs {
            conns.push(pc.wait().map_err(e)?);
        }
        let mut remotes = Vec::new();
        for pm in pms {
            remotes.push(pm.wait().map_err(e)?);
        }
        let (mut proxy_sems, mut host_sems, mut keep) = (Vec::new(), Vec::new(), Vec::new());
        for (c, &p) in conns.iter().zip(&others) {
            let a = comm.build_semaphore(c, p, 2).map_err(e)?;
            let b = comm.build_semaphore(c, p, 3).map_err(e)?;
            let (a, b) = (a.wait().map_err(e)?, b.wait().map_err(e)?);
            if rank == 0 {
                proxy_sems.push(a);
                host_sems.push(Host2DeviceSemaphore::new(b).map_err(e)?);
            } else {
                keep.push(a);
                keep.push(b);
            }
        }
        bs.barrier().map_err(e)?;
        Ok(LoadRank { comm, conns, local, remotes, proxy_sems, host_sems, _keep: keep })
    })
}

/// Offset of trigger `i` (as the kernel computes it).
fn offset(op: Op, i: u64, peers: usize, size: u64) -> u64 {
    if op == Op::Signal { 0 } else { ((i / peers as u64) % SLOTS) * size }
}

/// The order in which the host baseline visits the peers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Call `i` goes to peer `i mod peers`, as one GPU producer pushes.
    RoundRobin,
    /// A fixed pseudo-random peer per call, as many producers' pushes interleave in the FIFO.
    Shuffled,
    /// The calls themselves (peer and slot) permuted within each window of `w`, as that many
    /// single-thread producers' pushes interleave in the FIFO: consecutive calls to one peer no
    /// longer write contiguous slots. Made by [`Order::interleaved`].
    Interleaved { w: u64, a: u64 },
}

impl Order {
    /// [`Order::Interleaved`] over windows of `w`, with its multiplier (x -> (a x + 1) mod w is
    /// a bijection when a and w are coprime) found once, not per call.
    fn interleaved(w: u64) -> Order {
        let mut a = 0x9e37_79b9_u64 % w.max(1);
        while w > 0 && (a < 2 || gcd(a, w) != 1) {
            a += 1;
        }
        Order::Interleaved { w, a }
    }
}

/// Call `j` of `n` in `order`: the index whose peer and slot it takes.
fn call_of(order: Order, j: u64, n: u64) -> u64 {
    match order {
        Order::Interleaved { w, a } if w > 1 && (j / w + 1) * w <= n => (j / w) * w + (a * (j % w) + 1) % w,
        _ => j,
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Peer of call `i` in `order`.
fn peer_of(order: Order, i: u64, peers: usize) -> usize {
    match order {
        Order::RoundRobin | Order::Interleaved { .. } => (i % peers as u64) as usize,
        Order::Shuffled => {
            // splitmix64 of i: deterministic, well spread.
            let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % peers as u64) as usize
        }
    }
}

/// A reading of the process's Ethernet staging counters and when it was taken.
type StagingMark = (mscclpp::bench::EthernetStagingCounts, Instant);

fn staging_mark() -> StagingMark {
    (mscclpp::bench::ethernet_staging_counts(), Instant::now())
}

/// For Ethernet puts: the staging work since `m0` per 1000 of the `writes` issued (receiver
/// landings, copy-engine copies to and from the GPU), where the threads' time went (seconds
/// of thread time per second since `m0`, summed over the connections' threads), and the mean
/// acknowledgement loop (from sending a frame that asks to the answer; a full write queue waits
/// on it) with the number of asks; for Ethernet rows with signals, the receivers' tokens for GPU
/// words (how many a round of updates applied, the wait a round); as a suffix for a row; empty
/// otherwise.
fn staging_note(t: Transport, op: Op, m0: StagingMark, writes: u64, size: u64) -> String {
    if t != Transport::Ethernet || writes == 0 {
        return String::new();
    }
    let (c0, t0) = m0;
    let wall = t0.elapsed().as_secs_f64().max(1e-9);
    let c = mscclpp::bench::ethernet_staging_counts();
    let k = |a: u64, b: u64| (a.saturating_sub(b)) as f64 * 1000.0 / writes as f64;
    let s = |a: Duration, b: Duration| a.saturating_sub(b).as_secs_f64() / wall;
    let tokens = c.gpu_tokens.saturating_sub(c0.gpu_tokens);
    let rounds = c.token_rounds.saturating_sub(c0.token_rounds);
    let token_note = match rounds {
        0 => "no GPU tokens".to_string(),
        r => format!(
            "{tokens} GPU tokens in {r} rounds ({:.1} a round, {:.1} us waited a round)",
            tokens as f64 / r as f64,
            c.token_wait.saturating_sub(c0.token_wait).as_secs_f64() * 1e6 / r as f64
        ),
    };
    let ack_note = match c.acks.saturating_sub(c0.acks) {
        0 => "none".to_string(),
        n => format!("{:.0} us x {n}", c.ack_wait.saturating_sub(c0.ack_wait).as_secs_f64() * 1e6 / n as f64),
    };
    if op == Op::Signal {
        return format!(
            "; receivers: {token_note}; thread s/s on a full write queue {:.2}; acknowledgement loop {ack_note}",
            s(c.queue_full, c0.queue_full),
        );
    }
    format!(
        "; staging per 1000 writes: {:.0} landings, {:.0} copies to the GPU, {:.0} from it (bytes read per \
         byte put {:.1}); thread s/s: to GPU issue {:.2} wait {:.2}, from GPU issue {:.2} wait {:.2}, sendmsg {:.2}, \
         full queue {:.2}; acknowledgement loop {ack_note}; receivers: {token_note}",
        k(c.landings, c0.landings),
        k(c.htod, c0.htod),
        k(c.dtoh, c0.dtoh),
        c.dtoh_bytes.saturating_sub(c0.dtoh_bytes) as f64 / (writes * size.max(1)) as f64,
        s(c.to_gpu_issue, c0.to_gpu_issue),
        s(c.to_gpu_wait, c0.to_gpu_wait),
        s(c.from_gpu_issue, c0.from_gpu_issue),
        s(c.from_gpu_wait, c0.from_gpu_wait),
        s(c.send, c0.send),
        s(c.queue_full, c0.queue_full),
    )
}

/// One host thread issuing the same connection calls directly: calls per second (the final
/// flush, outside the timing, is bounded by `timeout`).
fn direct(r: &LoadRank, op: Op, size: u64, peers: usize, n: u64, timeout: Duration) -> Result<f64, String> {
    direct_in(r, op, size, peers, n, timeout, Order::RoundRobin)
}

/// [`direct`] visiting the peers in `order`.
fn direct_in(
    r: &LoadRank,
    op: Op,
    size: u64,
    peers: usize,
    n: u64,
    timeout: Duration,
    order: Order,
) -> Result<f64, String> {
    let src = r.local.memory();
    let t0 = Instant::now();
    for j in 0..n {
        let i = call_of(order, j, n);
        let p = peer_of(order, i, peers);
        let off = offset(op, i, peers, size);
        if op != Op::Signal {
            r.conns[p].write(&r.remotes[p], off, src, off, size).map_err(e)?;
        }
        if op != Op::Put {
            r.host_sems[p].signal().map_err(e)?;
        }
    }
    let el = t0.elapsed().as_secs_f64();
    for c in &r.conns[..peers] {
        c.flush(timeout).map_err(e)?;
    }
    Ok(n as f64 / el)
}

/// Everything one proxy row needs.
struct Rig<'a> {
    kern: &'a Kernel,
    proxy: &'a ProxyService,
    stream: &'a Stream,
    table: LoadPeers,
    timeout: Duration,
    /// A second FIFO, emptied by a host thread that discards what it pops, and its stream: the
    /// GPU load of the producers without the proxy's work ([`Rig::direct_loaded`]).
    aux: &'a Fifo,
    aux_stream: &'a Stream,
}

/// Producers of the load beside the loaded host baseline (one thread per block, as the rows
/// whose ratio is lowest).
const LOAD_BLOCKS: u32 = 132;
/// Pops per second assumed when sizing that load so it outlasts the baseline (a faster popper
/// ends it early, which the row says; a slower one makes the row wait for the kernel longer).
/// Session 18 (H100): 10e6 ended every load early.
const LOAD_RATE: f64 = 40e6;

impl Rig<'_> {
    /// [`direct`] while 132 GPU producers push into [`Rig::aux`], which a host thread empties
    /// (discarding the triggers): the GPU, PCIe and the pinned ring busy as in a proxy row, but
    /// no proxy work. Calls per second, and whether the load lasted the whole baseline. `est_s`:
    /// the unloaded baseline's time for `n` calls.
    fn direct_loaded(
        &self,
        r: &LoadRank,
        op: Op,
        size: u64,
        peers: usize,
        n: u64,
        est_s: f64,
    ) -> Result<(f64, bool), String> {
        let per = ((LOAD_RATE * est_s * 2.0) / f64::from(LOAD_BLOCKS)).ceil().clamp(1.0, 1e6) as i32;
        let total = u64::from(LOAD_BLOCKS) * per as u64;
        let stop = AtomicBool::new(false);
        let popped = AtomicU64::new(0);
        std::thread::scope(|sc| {
            let popper = sc.spawn(|| {
                while !stop.load(Ordering::Acquire) {
                    if self.aux.poll().is_some() {
                        self.aux.pop();
                        popped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            let (mut h, mut table, mut o, mut sz, mut p, mut ms) =
                (self.aux.device_handle(), self.table, op.code(), size, per, MAX_SPINS);
            table.npeers = peers as u32;
            let mut b = 1i32;
            let res = launch(self.kern, LOAD_BLOCKS, 1, self.aux_stream, &mut args![h, table, o, sz, p, ms, b])
                .and_then(|()| {
                    // Let the producers fill the ring before the baseline starts.
                    std::thread::sleep(Duration::from_millis(2));
                    direct(r, op, size, peers, n, self.timeout)
                });
            let lasted = popped.load(Ordering::Relaxed) < total;
            // The popper keeps emptying the ring until the kernel ends (its pushes are bounded;
            // a kernel left pushing into a ring nobody empties would trap and end the run).
            let synced = self.aux_stream.synchronize(self.timeout.max(Duration::from_secs(60))).map_err(e);
            stop.store(true, Ordering::Release);
            let _ = popper.join();
            let rate = res?;
            synced?;
            Ok((rate, lasted))
        })
    }

    /// Triggers per second through the proxy (launch until the proxy popped every trigger), and
    /// the share of that time the proxy found its FIFO empty (waiting for the producers).
    ///
    /// Also the share of the polls (every ~0.2 ms) that found one of `conns` with its write queue
    /// at least 90% full (`max_write_queue_size`): how often the proxy may have been waiting for
    /// a connection rather than working.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        op: Op,
        size: u64,
        peers: usize,
        blocks: u32,
        threads: u32,
        per: i32,
        batch: i32,
        conns: &[Connection],
    ) -> Result<(f64, f64, f64), String> {
        let total = (blocks * threads) as u64 * per as u64;
        let (mut polls, mut full, mut round) = (0u64, 0u64, 0u64);
        let before = self.proxy.processed();
        let mut table = self.table;
        table.npeers = peers as u32;
        let (mut h, mut o, mut sz, mut p, mut ms, mut b) =
            (self.proxy.fifo().device_handle(), op.code(), size, per, MAX_SPINS, batch);
        let idle0 = self.proxy.idle_time();
        let t0 = Instant::now();
        launch(self.kern, blocks, threads, self.stream, &mut args![h, table, o, sz, p, ms, b])?;
        loop {
            let done = self.proxy.processed() - before;
            if done >= total {
                break;
            }
            self.proxy.status().map_err(|x| format!("proxy load row: the proxy failed: {x}"))?;
            if t0.elapsed() > self.timeout {
                return Err(format!(
                    "proxy load row ({} {}, {peers} peers, {} producers): only {done} of {total} triggers popped \
                     after {:?} (the kernel's pushes trap {MAX_SPINS} wait rounds after the proxy stops)",
                    op.name(),
                    human(size as usize),
                    blocks * threads,
                    self.timeout
                ));
            }
            // Every tenth round (the connections' state is behind locks the proxy takes too).
            if round % 10 == 0 {
                polls += 1;
                if conns.iter().any(|c| c.outstanding() * 10 >= c.max_write_queue_size() as u64 * 9) {
                    full += 1;
                }
            }
            round += 1;
            std::thread::sleep(Duration::from_micros(20));
        }
        let el = t0.elapsed().as_secs_f64();
        let idle = self.proxy.idle_time().saturating_sub(idle0).as_secs_f64();
        self.stream.synchronize(self.timeout).map_err(|x| {
            format!("proxy load kernel: {x} (a trap means a push waited {MAX_SPINS} rounds for a free slot)")
        })?;
        Ok((total as f64 / el, (idle / el).min(1.0), full as f64 / polls.max(1) as f64))
    }
}

/// The proxy rows over `t`.
fn rows_over(t: Transport, dev: u32, kern: &Kernel, timeout: Duration, config: &ProxyConfig) -> Result<(), String> {
    let mut rs = ranks(t, dev, timeout)?;
    let r0 = &mut rs[0];
    let mut proxy = ProxyService::new(r0.comm.context(), dev, config.clone()).map_err(e)?;
    let mut table = LoadPeers::new(SLOTS as u32);
    for (p, s) in std::mem::take(&mut r0.proxy_sems).into_iter().enumerate() {
        table.sem[p] = proxy.add_semaphore(s).map_err(e)?.0;
        table.dst[p] = proxy.add_memory(r0.remotes[p].clone()).map_err(e)?.0;
    }
    table.src = proxy.add_memory(r0.local.memory().clone()).map_err(e)?.0;
    proxy.start().map_err(e)?;
    let stream = Stream::new(dev).map_err(e)?;
    let aux = Fifo::new(r0.comm.context(), dev, 512).map_err(e)?;
    let aux_stream = Stream::new(dev).map_err(e)?;
    let rig = Rig { kern, proxy: &proxy, stream: &stream, table, timeout, aux: &aux, aux_stream: &aux_stream };
    let r0 = &rs[0];
    let groups = [
        (Op::Put, 8u64),
        (Op::Put, 512),
        (Op::Put, MAX_SIZE),
        (Op::PutWithSignal, 8),
        (Op::PutWithSignal, MAX_SIZE),
        (Op::Signal, 0),
    ];
    let res = (|| -> Result<(), String> {
        for peers in [1usize, 4, 8] {
            for (op, size) in groups {
                // Size the counts from a short baseline run, then time the baseline itself.
                let probe = direct(r0, op, size, peers, 2048, timeout)?;
                let n = ((probe * TARGET_S) as u64).clamp(8192, 1 << 20);
                let c0 = staging_mark();
                let base = direct(r0, op, size, peers, n, timeout)?;
                let st_base = staging_note(t, op, c0, n, size);
                let what = if op == Op::Signal {
                    format!("{t} signal")
                } else {
                    format!("{t} {} {}", op.name(), human(size as usize))
                };
                for (blocks, threads, batch) in PRODUCERS {
                    let producers = (blocks * threads) as u64;
                    let per = n.div_ceil(producers).max(1);
                    let per = i32::try_from(per).map_err(|_| "proxy load: too many triggers per thread".to_string())?;
                    let c0 = staging_mark();
                    let (rate, idle, full) =
                        rig.run(op, size, peers, blocks, threads, per, batch, &r0.conns[..peers])?;
                    let staging = staging_note(t, op, c0, producers * per as u64, size);
                    let who = if batch > 1 {
                        format!("{producers:>5} producer, push_batch of {batch}")
                    } else if batch == RELAXED {
                        format!("{producers:>5} producer, push_relaxed")
                    } else if batch == EXCLUSIVE {
                        format!("{producers:>5} producer, exclusive push_relaxed")
                    } else {
                        format!("{producers:>5} producers")
                    };
                    let goal = if op == Op::Signal { "goal >= 5 M/s" } else { "goal ratio >= 0.8" };
                    row(format!(
                        "proxy load, {what} -> {peers} peers, {who}: {:7.3} M triggers/s, host \
                         direct {:7.3} M/s, ratio {:.2}, proxy idle {:.0}%, a write queue >= 90% full in {:.0}% \
                         of polls ({} triggers; {goal}){staging}",
                        rate / 1e6,
                        base / 1e6,
                        rate / base,
                        idle * 100.0,
                        full * 100.0,
                        producers * per as u64
                    ));
                }
                if t == Transport::Ethernet && op == Op::Signal {
                    row(format!("proxy load, {what} -> {peers} peers, host direct {:7.3} M/s{st_base}", base / 1e6));
                }
                // Over Ethernet the puts' rates fall short of the baseline with many producers:
                // the same baseline in the order many producers interleave, and under their GPU
                // load, say whether the order or the load costs (rather than the proxy's work).
                if t == Transport::Ethernet && op != Op::Signal {
                    // A diagnostic: its failure is printed and the rows go on.
                    let inter = Order::interleaved(u64::from(LOAD_BLOCKS));
                    let (mut st_shuffled, mut st_inter) = (String::new(), String::new());
                    let diag = (|| {
                        let c0 = staging_mark();
                        let shuffled = direct_in(r0, op, size, peers, n, timeout, Order::Shuffled)?;
                        st_shuffled = staging_note(t, op, c0, n, size);
                        let c0 = staging_mark();
                        let interleaved = direct_in(r0, op, size, peers, n, timeout, inter)?;
                        st_inter = staging_note(t, op, c0, n, size);
                        rig.direct_loaded(r0, op, size, peers, n, n as f64 / base).map(|l| (shuffled, interleaved, l))
                    })();
                    row(match diag {
                        Ok((shuffled, interleaved, (loaded, lasted))) => format!(
                            "proxy load, {what} -> {peers} peers, host direct (round robin{st_base}), in shuffled peer order {:7.3} M/s \
                             (ratio {:.2}{st_shuffled}), with calls interleaved as {LOAD_BLOCKS} producers push them \
                             {:7.3} M/s (ratio {:.2}{st_inter}), under {LOAD_BLOCKS} GPU producers' load {:7.3} M/s \
                             (ratio {:.2}{})",
                            shuffled / 1e6,
                            shuffled / base,
                            interleaved / 1e6,
                            interleaved / base,
                            loaded / 1e6,
                            loaded / base,
                            if lasted { "" } else { "; the load ended before the baseline" }
                        ),
                        Err(x) => format!("proxy load, {what} -> {peers} peers, host direct diagnostics failed: {x}"),
                    });
                }
            }
        }
        Ok(())
    })();
    let stopped = proxy.stop().map_err(e);
    res.and(stopped)
}

/// The proxy load rows over each of `transports` (see the module doc).
pub fn run(
    dev: u32,
    kern: &Kernel,
    timeout: Duration,
    config: &ProxyConfig,
    transports: &[Transport],
) -> Result<(), String> {
    row(format!(
        "proxy load: one FIFO + proxy on rank 0 serving 1/4/8 in-process peers; GPU producers (blocks x threads) \
         push triggers; host direct = one host thread issuing the same calls; signals coalesced for up to {} us \
         while the FIFO delivers (--signal-coalesce), dry-FIFO payments at least {} us apart (--signal-pay-interval), \
         a backlogged Ethernet connection's signals held up to {} us (--signal-backlog-hold)",
        config.signal_coalesce.as_secs_f64() * 1e6,
        config.signal_pay_interval.as_secs_f64() * 1e6,
        config.signal_backlog_hold.as_secs_f64() * 1e6
    ));
    for &t in transports {
        rows_over(t, dev, kern, timeout, config)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_calls_are_a_permutation_within_each_window() {
        for (w, n) in [(132u64, 132 * 7 + 50), (8, 64), (2, 9), (1, 5)] {
            let order = Order::interleaved(w);
            let calls: Vec<u64> = (0..n).map(|j| call_of(order, j, n)).collect();
            let mut sorted = calls.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "window {w}: not a permutation");
            // Whole windows stay in place; the trailing partial one is left in order.
            for (j, &i) in calls.iter().enumerate() {
                let j = j as u64;
                if (j / w + 1) * w <= n {
                    assert_eq!(i / w, j / w, "window {w}: call {j} left its window");
                } else {
                    assert_eq!(i, j);
                }
            }
            if w > 2 {
                let moved = calls.iter().enumerate().filter(|&(j, &i)| i != j as u64).count();
                assert!(moved as u64 > n / 2, "window {w}: only {moved} of {n} calls moved");
            }
        }
        assert_eq!(call_of(Order::RoundRobin, 17, 100), 17);
        assert_eq!(call_of(Order::Shuffled, 17, 100), 17);
    }
}
