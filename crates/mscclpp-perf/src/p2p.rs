//! The `p2p` test: rank 0 writes to rank 1 and signals; the same two processes then do the same
//! over a plain TCP socket on the same interface.

use std::io::{IsTerminal, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use mscclpp::{
    Bootstrap, Buffer, Communicator, Connection, Device, DeviceBuffer, EndpointConfig, Host2DeviceSemaphore,
    Host2HostSemaphore, RegisteredMemory, Transport,
};

use crate::Args;
use crate::report::{Record, Report};

const TAG_SETUP: u32 = 10;
const TAG_BASELINE: u64 = 77;

fn e2s(e: mscclpp::Error) -> String {
    e.to_string()
}

/// The message sizes: `min` doubling up to `max`, with `max` itself last.
pub fn sizes(min: u64, max: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s < max {
        v.push(s);
        s = s.saturating_mul(2);
    }
    v.push(max);
    v
}

/// The middle value (the lower middle for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get((v.len().max(1) - 1) / 2).copied().unwrap_or(0.0)
}

fn iters_for(args: &Args, size: u64, budget: u64, lo: u64, hi: u64) -> u64 {
    args.iters.unwrap_or_else(|| (budget / size.max(1)).clamp(lo, hi)).max(1)
}

/// A buffer in host or GPU memory.
enum Mem {
    Host(Buffer),
    Gpu(DeviceBuffer),
}

impl Mem {
    fn memory(&self) -> &RegisteredMemory {
        match self {
            Mem::Host(b) => b.memory(),
            Mem::Gpu(b) => b.memory(),
        }
    }
}

/// The semaphore: host-waited for Ethernet, GPU-side for CUDA IPC.
enum Sem {
    Host(Host2HostSemaphore),
    Gpu(Host2DeviceSemaphore),
}

impl Sem {
    fn signal(&self) -> mscclpp::Result<()> {
        match self {
            Sem::Host(s) => s.signal(),
            Sem::Gpu(s) => s.signal(),
        }
    }
    fn wait(&self, t: std::time::Duration) -> mscclpp::Result<()> {
        match self {
            Sem::Host(s) => s.wait(t),
            Sem::Gpu(s) => s.wait(t),
        }
    }
}

struct Ours {
    conn: Connection,
    sem: Sem,
    local: Mem,
    remote: RegisteredMemory,
    /// Rank 0's buffers for the raw copy baseline: a destination on the peer's GPU, and for
    /// the bidirectional run a source there and a destination on its own GPU.
    baseline: Vec<DeviceBuffer>,
}

struct Side {
    rank: usize,
    bs: Arc<dyn Bootstrap>,
    ours: Ours,
    sock: TcpStream,
    raw: Vec<u8>,
}

fn interface_ip(iface: &Option<String>) -> Result<IpAddr, String> {
    match iface {
        Some(i) => mscclpp::net::resolve_interface(i).map_err(e2s),
        None => Ok(mscclpp::net::find_interfaces().map_err(e2s)?[0].addr),
    }
}

fn setup(args: &Args, bs: Arc<dyn Bootstrap>, iface: &Option<String>) -> Result<Side, String> {
    let rank = bs.rank();
    let peer = 1 - rank;
    let comm = Communicator::new(bs.clone());
    let len = args.max_bytes as usize;
    let ipc = args.cuda_ipc();
    let transport = if ipc {
        Transport::CudaIpc
    } else if args.ib() {
        Transport::IB0
    } else {
        Transport::Ethernet
    };
    if let Some(d) = &args.ib_device {
        comm.context().set_ib_device(Transport::IB0, d).map_err(e2s)?;
    }
    let gpu = match args.memory {
        crate::MemoryKind::Gpu => {
            let n = mscclpp::gpu::device_count().map_err(e2s)? as u32;
            Some((args.device + rank as u32) % n.max(1))
        }
        crate::MemoryKind::Host => None,
    };
    let local = match gpu {
        Some(d) => Mem::Gpu(DeviceBuffer::new(comm.context(), d, len, transport.into()).map_err(e2s)?),
        None => Mem::Host(Buffer::new(comm.context(), len, transport.into()).map_err(e2s)?),
    };
    let mut cfg = EndpointConfig::new(transport);
    cfg.ethernet.interface = iface.clone();
    cfg.ib.gid_index = args.gid_index;
    // CUDA IPC, and IB with GPU memory (its NIC is chosen for that GPU), serve the GPU.
    let gpu_endpoint = ipc || (args.ib() && gpu.is_some());
    if gpu_endpoint {
        cfg.device = Device::Gpu(gpu.unwrap_or(0));
    }
    let pc = comm.connect(&cfg, peer, TAG_SETUP).map_err(e2s)?;
    comm.send_memory(local.memory(), peer, TAG_SETUP).map_err(e2s)?;
    let pm = comm.recv_memory(peer, TAG_SETUP).map_err(e2s)?;
    let conn = pc.wait().map_err(e2s)?;
    let remote = pm.wait().map_err(e2s)?;
    let raw = comm.build_semaphore(&conn, peer, TAG_SETUP).map_err(e2s)?.wait().map_err(e2s)?;
    let sem = if gpu_endpoint {
        Sem::Gpu(Host2DeviceSemaphore::new(raw).map_err(e2s)?)
    } else {
        Sem::Host(Host2HostSemaphore::new(raw).map_err(e2s)?)
    };
    let mut baseline = Vec::new();
    if let (Some(d), true, 0) = (gpu, ipc, rank) {
        let n = mscclpp::gpu::device_count().map_err(e2s)? as u32;
        let peer_dev = (args.device + 1) % n.max(1);
        let none = mscclpp::TransportFlags::NONE;
        baseline.push(DeviceBuffer::new(comm.context(), peer_dev, len, none).map_err(e2s)?);
        if args.bidirectional {
            baseline.push(DeviceBuffer::new(comm.context(), peer_dev, len, none).map_err(e2s)?);
        }
        baseline.push(DeviceBuffer::new(comm.context(), d, len.max(8), none).map_err(e2s)?);
    }
    // The baseline: one plain TCP connection between the same two processes, same interface.
    let ip = interface_ip(iface)?;
    let sock = if rank == 1 {
        let l = TcpListener::bind((ip, 0)).map_err(|e| format!("baseline listener on {ip}: {e}"))?;
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        bs.send(0, TAG_BASELINE, addr.to_string().as_bytes()).map_err(e2s)?;
        l.accept().map_err(|e| format!("baseline accept: {e}"))?.0
    } else {
        let a = bs.recv(1, TAG_BASELINE).map_err(e2s)?;
        let addr: SocketAddr =
            String::from_utf8_lossy(&a).parse().map_err(|_| "bad baseline address from rank 1".to_string())?;
        TcpStream::connect(addr).map_err(|e| format!("baseline connect to {addr}: {e}"))?
    };
    sock.set_nodelay(true).map_err(|e| e.to_string())?;
    let _ = sock.set_read_timeout(Some(args.timeout()));
    Ok(Side { rank, bs, ours: Ours { conn, sem, local, remote, baseline }, sock, raw: vec![0x5a; len] })
}

impl Side {
    /// Seconds for `iters` one-way writes of `size` (after `warm` untimed ones).
    fn ours_bw(&self, size: u64, warm: u64, iters: u64, t: std::time::Duration) -> Result<f64, String> {
        let o = &self.ours;
        let phase = |n: u64| -> Result<(), String> {
            if self.rank == 0 {
                for _ in 0..n {
                    o.conn.write(&o.remote, 0, o.local.memory(), 0, size).map_err(e2s)?;
                    o.sem.signal().map_err(e2s)?;
                }
                o.sem.wait(t).map_err(e2s)
            } else {
                for _ in 0..n {
                    o.sem.wait(t).map_err(e2s)?;
                }
                o.sem.signal().map_err(e2s)
            }
        };
        phase(warm)?;
        let t0 = Instant::now();
        phase(iters)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// CUDA IPC: seconds for `iters` writes of `size` into the peer's GPU buffer, then flush
    /// (rank 0 only, or both ranks at once when `both`).
    fn ipc_bw(&self, size: u64, warm: u64, iters: u64, t: std::time::Duration, both: bool) -> Result<f64, String> {
        let o = &self.ours;
        if self.rank != 0 && !both {
            return Ok(1.0);
        }
        for _ in 0..warm {
            o.conn.write(&o.remote, 0, o.local.memory(), 0, size).map_err(e2s)?;
        }
        o.conn.flush(t).map_err(e2s)?;
        let t0 = Instant::now();
        for _ in 0..iters {
            o.conn.write(&o.remote, 0, o.local.memory(), 0, size).map_err(e2s)?;
        }
        o.conn.flush(t).map_err(e2s)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// The raw copy engine: the same copies inside one process, between the same GPUs
    /// (`cuMemcpyPeerAsync` across GPUs), both ways at once when `both`.
    fn copy_bw(&self, size: u64, warm: u64, iters: u64, both: bool) -> Result<f64, String> {
        let b = &self.ours.baseline;
        let Mem::Gpu(src) = &self.ours.local else { return Ok(1.0) };
        if self.rank != 0 || b.is_empty() {
            return Ok(1.0);
        }
        let pairs: Vec<(&DeviceBuffer, &DeviceBuffer)> =
            if both && b.len() >= 3 { vec![(src, &b[0]), (&b[1], &b[2])] } else { vec![(src, &b[0])] };
        Ok(mscclpp::bench::baseline_copy(&pairs, size as usize, warm, iters).map_err(e2s)?.as_secs_f64())
    }

    /// CUDA IPC: seconds per `update_and_sync` + `flush` of the peer's token.
    fn ipc_signal_latency(&self, warm: u64, iters: u64, t: std::time::Duration) -> Result<f64, String> {
        if self.rank != 0 {
            return Ok(1.0);
        }
        let o = &self.ours;
        let mut t0 = Instant::now();
        for i in 0..warm + iters {
            if i == warm {
                t0 = Instant::now();
            }
            o.sem.signal().map_err(e2s)?;
            o.conn.flush(t).map_err(e2s)?;
        }
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    }

    /// The raw small operation into the same destination as ours (the peer's token, mapped
    /// through CUDA IPC): an 8-byte host-to-device copy and a synchronize.
    fn h2d_latency_peer(&self, warm: u64, iters: u64, device: u32) -> Result<f64, String> {
        match &self.ours.sem {
            Sem::Gpu(s) if self.rank == 0 => {
                Ok(mscclpp::bench::baseline_h2d_8b_into(s.semaphore().remote_memory(), device, warm, iters)
                    .map_err(e2s)?
                    .as_secs_f64())
            }
            _ => Ok(1.0),
        }
    }

    /// The raw small operation: an 8-byte host-to-device copy and a synchronize.
    fn h2d_latency(&self, warm: u64, iters: u64) -> Result<f64, String> {
        match self.ours.baseline.last() {
            Some(dst) if self.rank == 0 => {
                Ok(mscclpp::bench::baseline_h2d_8b(dst, warm, iters).map_err(e2s)?.as_secs_f64())
            }
            _ => Ok(1.0),
        }
    }

    fn base_bw(&mut self, size: u64, warm: u64, iters: u64) -> Result<f64, String> {
        let size = size as usize;
        let mut phase = |n: u64| -> Result<(), String> {
            let mut one = [0u8; 1];
            if self.rank == 0 {
                for _ in 0..n {
                    self.sock.write_all(&self.raw[..size]).map_err(|e| e.to_string())?;
                }
                self.sock.read_exact(&mut one).map_err(|e| e.to_string())
            } else {
                for _ in 0..n {
                    self.sock.read_exact(&mut self.raw[..size]).map_err(|e| e.to_string())?;
                }
                self.sock.write_all(&one).map_err(|e| e.to_string())
            }
        };
        phase(warm)?;
        let t0 = Instant::now();
        phase(iters)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Seconds per write+signal round trip of `size`.
    fn ours_rtt(&self, size: u64, warm: u64, iters: u64, t: std::time::Duration) -> Result<f64, String> {
        let o = &self.ours;
        let mut t0 = Instant::now();
        for i in 0..warm + iters {
            if i == warm {
                t0 = Instant::now();
            }
            if self.rank == 0 {
                o.conn.write(&o.remote, 0, o.local.memory(), 0, size).map_err(e2s)?;
                o.sem.signal().map_err(e2s)?;
                o.sem.wait(t).map_err(e2s)?;
            } else {
                o.sem.wait(t).map_err(e2s)?;
                o.conn.write(&o.remote, 0, o.local.memory(), 0, size).map_err(e2s)?;
                o.sem.signal().map_err(e2s)?;
            }
        }
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    }

    fn base_rtt(&mut self, size: u64, warm: u64, iters: u64) -> Result<f64, String> {
        let size = size as usize;
        let mut t0 = Instant::now();
        for i in 0..warm + iters {
            if i == warm {
                t0 = Instant::now();
            }
            let r = if self.rank == 0 {
                self.sock.write_all(&self.raw[..size]).and_then(|_| self.sock.read_exact(&mut self.raw[..size]))
            } else {
                self.sock.read_exact(&mut self.raw[..size]).and_then(|_| self.sock.write_all(&self.raw[..size]))
            };
            r.map_err(|e| e.to_string())?;
        }
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    }
}

/// Runs the test on every rank; rank 0 reports.
pub fn run(args: &Args, bs: Arc<dyn Bootstrap>, iface: Option<String>) -> Result<(), String> {
    let rank = bs.rank();
    let sizes = sizes(args.min_bytes, args.max_bytes);
    if rank >= 2 {
        // Ranks beyond the pair only keep the job's barriers.
        bs.barrier().map_err(e2s)?;
        for _ in &sizes {
            bs.barrier().map_err(e2s)?;
            bs.barrier().map_err(e2s)?;
        }
        return bs.barrier().map_err(e2s);
    }
    let mut side = setup(args, bs.clone(), &iface)?;
    let t = args.timeout();
    bs.barrier().map_err(e2s)?;
    let bar = (rank == 0 && !args.quiet && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(sizes.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} p2p {pos}/{len} sizes [{bar:30}] {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let mut records: Vec<Record> = Vec::new();
    // CUDA IPC: the 8-byte copy into local memory, reported beside the table.
    let mut local_h2d: Vec<f64> = Vec::new();
    for &size in &sizes {
        if let Some(b) = &bar {
            b.set_message(crate::report::human(size));
        }
        let rounds = args.rounds.max(1);
        let bw_iters = iters_for(args, size, (512 << 20) / rounds, 10, 2000);
        let lat_iters = iters_for(args, size, (64 << 20) / rounds, 5, 1000);
        let ipc = args.cuda_ipc();
        // Ours and the baseline alternate, `rounds` times; each column keeps its median, so a
        // burst of noise on a shared machine does not land on one side only.
        let mut m: [Vec<f64>; 4] = Default::default();
        for _ in 0..rounds {
            let (ob, bb, or, br) = if ipc {
                let ob = side.ipc_bw(size, args.warmup, bw_iters, t, args.bidirectional)?;
                side.bs.barrier().map_err(e2s)?;
                let bb = side.copy_bw(size, args.warmup, bw_iters, args.bidirectional)?;
                // The small-operation latency does not depend on the size: measured in the
                // first row, repeated in the others.
                let (or, br) = match records.first() {
                    Some(r0) => (r0.ours_rtt_us / 1e6, r0.baseline_rtt_us / 1e6),
                    None => {
                        let local = side.h2d_latency(args.warmup, 1000)?;
                        local_h2d.push(local);
                        let dev = match &side.ours.local {
                            Mem::Gpu(b) => b.device(),
                            Mem::Host(_) => 0,
                        };
                        (side.ipc_signal_latency(args.warmup, 1000, t)?, side.h2d_latency_peer(args.warmup, 1000, dev)?)
                    }
                };
                (ob, bb, or, br)
            } else {
                let ob = side.ours_bw(size, args.warmup, bw_iters, t)?;
                side.bs.barrier().map_err(e2s)?;
                let bb = side.base_bw(size, args.warmup, bw_iters)?;
                let or = side.ours_rtt(size, args.warmup, lat_iters, t)?;
                let br = side.base_rtt(size, args.warmup, lat_iters)?;
                (ob, bb, or, br)
            };
            for (v, x) in m.iter_mut().zip([ob, bb, or, br]) {
                v.push(x);
            }
        }
        let [ours_bw, base_bw, ours_rtt, base_rtt] = m.map(median);
        side.ours.conn.flush(t).map_err(e2s)?;
        bs.barrier().map_err(e2s)?;
        let gb = |secs: f64| (size * bw_iters) as f64 / secs / 1e9;
        records.push(Record {
            size,
            ours_gbps: gb(ours_bw),
            baseline_gbps: gb(base_bw),
            ours_rtt_us: ours_rtt * 1e6,
            baseline_rtt_us: base_rtt * 1e6,
            bw_iters,
            lat_iters,
        });
        if let Some(b) = &bar {
            b.inc(1);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if rank == 0 {
        let ipc = args.cuda_ipc();
        let report = Report {
            test: "p2p".into(),
            transport: match (ipc, args.bidirectional) {
                (true, true) => "cuda-ipc (bidirectional)".into(),
                (true, false) => "cuda-ipc".into(),
                _ if args.ib() => format!(
                    "ib (IB0 on {}, {})",
                    args.ib_device.clone().unwrap_or_else(|| mscclpp::ib::devices()
                        .ok()
                        .and_then(|d| d.into_iter().next())
                        .unwrap_or_default()),
                    match side.ours.conn.signal_forwarding() {
                        Some(how) => format!("HostNoAtomic mode, signals forwarded by {how}"),
                        None => "Host mode, RDMA atomics".into(),
                    }
                ),
                _ => "ethernet".into(),
            },
            memory: match args.memory {
                crate::MemoryKind::Host => "host".into(),
                crate::MemoryKind::Gpu => format!("gpu (device {} + rank)", args.device),
            },
            baseline: if ipc {
                format!(
                    "bandwidth{}: the same copies in one process (cuMemcpyDtoDAsync on one GPU, cuMemcpyPeerAsync \
                     across two); latency column: ours = update_and_sync + flush, baseline = 8-byte pinned \
                     cuMemcpyHtoDAsync + synchronize into the same peer token",
                    if args.bidirectional { " per direction, both directions at once" } else { "" }
                )
            } else if args.ib() {
                "plain TCP socket between the same processes and interface (host memory); raw verbs figures: \
                 perftest ib_write_bw/ib_write_lat on the same device"
                    .into()
            } else {
                "plain TCP socket between the same processes and interface (host memory)".into()
            },
            ranks: bs.size(),
            interface: iface.unwrap_or_else(|| "default".into()),
            records,
        };
        report.print();
        if ipc && !local_h2d.is_empty() {
            println!(
                "# latency baseline above copies into the peer's token (mapped through CUDA IPC); into local GPU memory \
                 the same copy+synchronize takes {:.1} us",
                median(local_h2d.clone()) * 1e6
            );
        }
        if let Some(p) = &args.json {
            report.write_json(p)?;
        }
        if let Some(p) = &args.plot {
            report.write_svg(p)?;
        }
    }
    bs.barrier().map_err(e2s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_ladder() {
        assert_eq!(sizes(8, 64), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 100), vec![8, 16, 32, 64, 100]);
        assert_eq!(sizes(5, 5), vec![5]);
    }
}
