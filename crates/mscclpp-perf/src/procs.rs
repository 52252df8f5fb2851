//! `mscclpp-perf device --procs`: the device benchmarks between two processes, rank r on GPU
//! (`--device` + r) mod the GPU count, over CUDA IPC (NVLink between two GPUs; on a machine with
//! one GPU both processes time-slice it, which is slow but checks the code). Started like the
//! p2p test's ranks (local processes, or mpirun/srun/torchrun). Rank 0 prints the rows, each next
//! to a raw baseline measured in the same run between the same processes:
//!
//! * MemoryDevice2DeviceSemaphore signal+wait ping-pong next to a raw flag ping-pong
//!   (`st.release.sys` / `ld.acquire.sys` on the peer's mapped word);
//! * MemoryChannel `put` and `get` bandwidth, `-b` (at least 1 KiB) .. `--max-bytes` (at most
//!   1 GiB), unidirectional (rank 0 only) and bidirectional (both ranks at once, per direction),
//!   next to `cuMemcpyDtoDAsync` on the CUDA IPC-mapped peer pointer (the copy
//!   `cuMemcpyPeerAsync` does) in the same direction(s);
//! * LL16 and LL8 packets: putPackets + unpackPackets ping-pong, one way (half a round trip) at
//!   1 KiB and bandwidth at 1 MiB, next to the raw flag one way and the copy engine;
//! * PortChannel `putWithSignal` + flush + wait ping-pong at 4 B and 1 KiB next to a synchronized
//!   copy-engine copy of the same size, and `putWithSignal` bandwidth next to the copy engine.
//!
//! Times: kernels measure with `%globaltimer` where one GPU thread times a loop (ping-pongs,
//! PortChannel), the host brackets launch + synchronize for the grid-wide copies and the
//! baselines; a bandwidth is the slowest rank's. Each figure is the median of `--rounds`
//! rounds in which ours and the baseline alternate (the JSON has min/median/max). Both ranks
//! check at the start that they agree on sizes, rounds and iterations; every device wait is
//! bounded by `--timeout` (a wait that expires fails the run naming the row), so do host waits
//! (stream synchronize, bootstrap barriers).

use std::sync::Arc;
use std::time::{Duration, Instant};

use mscclpp::device::compile::{CompileOptions, Kernel, KernelModule, compile};
use mscclpp::device::{ProxyConfig, ProxyService};
use mscclpp::gpu::Stream;
use mscclpp::{
    Bootstrap, Communicator, Device, DeviceBuffer, EndpointConfig, Host2DeviceSemaphore, MemoryChannel,
    MemoryDevice2DeviceSemaphore, RegisteredMemory, Transport, TransportFlags,
};
use serde_json::{Value, json};

use crate::Args;
use crate::kern::{args, clear, e, elapsed_ns, human, launch, row};
use crate::memchan::LL_MAX;

/// The sizes of the bandwidth rows: `-b` (at least 1 KiB) to `--max-bytes` (at most 1 GiB),
/// times `-f`.
pub(crate) fn sizes(args: &Args) -> Vec<usize> {
    let max = args.max_bytes.clamp(1 << 10, 1 << 30) as usize;
    let mut s = (args.min_bytes as usize).clamp(1 << 10, max);
    let mut v = Vec::new();
    while s <= max {
        v.push(s);
        s = s.saturating_mul(args.step_factor.max(2) as usize);
    }
    v
}

/// Minimum, median and maximum.
fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => (f64::NAN, f64::NAN, f64::NAN),
        n => (s[0], if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 }, s[n - 1]),
    }
}

fn median(v: &[f64]) -> f64 {
    stats(v).1
}

/// One figure of the run: ours and the baseline per round.
fn record(name: &str, size: usize, unit: &str, ours: &[f64], raw: &[f64]) -> Value {
    let s = |v: &[f64]| {
        let (min, med, max) = stats(v);
        json!({ "min": min, "median": med, "max": max })
    };
    let ratio = if unit == "us" { median(raw) / median(ours) } else { median(ours) / median(raw) };
    json!({ "name": name, "size": size, "unit": unit, "ours": s(ours), "baseline": s(raw), "ratio": ratio })
}

/// One process's side of the run.
struct Me {
    bs: Arc<dyn Bootstrap>,
    rank: usize,
    timeout: Duration,
    /// The timeout for device waits, ns.
    tns: u64,
    rounds: usize,
    warmup: u64,
    iters: Option<u64>,
    stream: Stream,
    /// Kernel result: `out[0]` elapsed ns, `out[1]` a wait timed out.
    out: DeviceBuffer,
}

impl Me {
    fn sync(&self) -> Result<(), String> {
        self.stream.synchronize(self.timeout).map_err(|x| format!("rank {}: waiting for the GPU: {x}", self.rank))
    }
    fn barrier(&self) -> Result<(), String> {
        self.bs.barrier().map_err(|x| format!("rank {}: barrier with the peer: {x}", self.rank))
    }
    /// The largest of both ranks' `x` (a rank that sat out passes 0).
    fn slowest(&self, x: f64) -> Result<f64, String> {
        let all = self.bs.all_gather(&x.to_le_bytes()).map_err(|x| format!("gathering times: {x}"))?;
        let mut m = 0f64;
        for b in all {
            let a: [u8; 8] = b.as_slice().try_into().map_err(|_| "gathering times: bad length".to_string())?;
            m = m.max(f64::from_le_bytes(a));
        }
        Ok(m)
    }
    fn iters(&self, default: u64) -> u64 {
        self.iters.unwrap_or(default).max(1)
    }
    fn show(&self, s: String) {
        if self.rank == 0 {
            row(s);
        }
    }
}

/// Runs on each of the two ranks (from `launch::run`).
pub fn run_rank(args: &Args, bs: Arc<dyn Bootstrap>, _iface: Option<String>) -> Result<(), String> {
    let (rank, size) = (bs.rank(), bs.size());
    if size != 2 {
        return Err(format!("device --procs runs between exactly 2 ranks (this job has {size})"));
    }
    let count = mscclpp::gpu::device_count().map_err(e)?.max(1);
    let dev = ((args.device as usize + rank) % count) as u32;
    // Both ranks must run the same rows: compare what decides them.
    let plan = format!(
        "sizes {:?} rounds {} warmup {} iters {:?} timeout {}",
        sizes(args),
        args.rounds,
        args.warmup,
        args.iters,
        args.timeout
    );
    let plans = bs.all_gather(plan.as_bytes()).map_err(|x| format!("rank {rank}: exchanging the plan: {x}"))?;
    if plans.iter().any(|p| p != plan.as_bytes()) {
        let show: Vec<_> = plans.iter().map(|p| String::from_utf8_lossy(p).into_owned()).collect();
        return Err(format!("the ranks disagree on the run: rank 0: {}; rank 1: {}", show[0], show[1]));
    }
    let name = mscclpp::gpu::device_name(dev).unwrap_or_else(|_| format!("GPU{dev}"));
    let names = bs.all_gather(format!("GPU {dev} ({name})").as_bytes()).map_err(e)?;
    let names: Vec<String> = names.iter().map(|n| String::from_utf8_lossy(n).into_owned()).collect();

    let max = args.max_bytes.clamp(1 << 10, 1 << 30) as usize;
    let peer = 1 - rank;
    let comm = Communicator::new(bs.clone());
    let ipc = TransportFlags::from(Transport::CudaIpc);
    let buf = |len: usize| DeviceBuffer::new(comm.context(), dev, len, ipc).map_err(e);
    let (send, recv, packets, flag) = (buf(max)?, buf(max)?, buf(4 * LL_MAX)?, buf(8)?);
    let cfg = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
    let pc = comm.connect(&cfg, peer, 0).map_err(e)?;
    for (i, b) in [&send, &recv, &packets, &flag].iter().enumerate() {
        comm.send_memory(b.memory(), peer, 1 + i as u32).map_err(e)?;
    }
    let pm: Vec<_> = (0..4).map(|i| comm.recv_memory(peer, 1 + i)).collect::<Result<_, _>>().map_err(e)?;
    let conn = pc.wait().map_err(|x| format!("rank {rank}: connecting to rank {peer} over CUDA IPC: {x}"))?;
    let remote: Vec<RegisteredMemory> = pm.into_iter().map(|p| p.wait()).collect::<Result<_, _>>().map_err(e)?;
    let (p_send, p_recv, p_packets, p_flag) = (&remote[0], &remote[1], &remote[2], &remote[3]);
    let d2d = comm.build_semaphore(&conn, peer, 10).map_err(e)?.wait().map_err(e)?;
    let sem = Arc::new(MemoryDevice2DeviceSemaphore::new(d2d).map_err(e)?);
    let h2d = comm.build_semaphore(&conn, peer, 11).map_err(e)?.wait().map_err(e)?;
    let h2d = Host2DeviceSemaphore::new(h2d).map_err(e)?;
    // put: my send -> the peer's recv; get: the peer's send -> my recv; packets: my send -> the
    // peer's packet buffer, unpacked from mine; flag: the peer's flag word mapped here.
    let put_chan = MemoryChannel::new(sem.clone(), p_recv, send.memory(), None).map_err(e)?;
    let get_chan = MemoryChannel::new(sem.clone(), p_send, recv.memory(), None).map_err(e)?;
    let pk_chan = MemoryChannel::new(sem.clone(), p_packets, send.memory(), Some(packets.memory())).map_err(e)?;
    let flag_chan = MemoryChannel::new(sem.clone(), p_flag, flag.memory(), None).map_err(e)?;
    let peer_flag = flag_chan.device_handle().dst;
    let mut proxy = ProxyService::new(comm.context(), dev, ProxyConfig::default()).map_err(e)?;
    let ps = proxy.add_semaphore(h2d).map_err(e)?;
    let dst = proxy.add_memory(p_recv.clone()).map_err(e)?;
    let src = proxy.add_memory(send.memory().clone()).map_err(e)?;
    let port = proxy.port_channel(ps, dst, src).map_err(e)?;
    let port_ptr = port.device_handle_ptr().ok_or("PortChannel: no device handle")?;

    let opts = CompileOptions::for_device(dev);
    let mem_mod = KernelModule::load(dev, &compile(crate::memchan::KERNELS, &opts).map_err(e)?).map_err(e)?;
    let port_mod = KernelModule::load(dev, &compile(crate::device::KERNELS, &opts).map_err(e)?).map_err(e)?;
    let k = |m: &KernelModule, n: &str| m.function(n).map_err(e);
    let me = Me {
        bs: bs.clone(),
        rank,
        timeout: args.timeout(),
        tns: args.timeout().as_nanos() as u64,
        rounds: args.rounds.max(1) as usize,
        warmup: args.warmup,
        iters: args.iters,
        stream: Stream::new(dev).map_err(e)?,
        out: DeviceBuffer::new(comm.context(), dev, 16, TransportFlags::NONE).map_err(e)?,
    };
    me.barrier()?;
    me.show(format!(
        "# mscclpp-perf device --procs: 2 processes over CUDA IPC, rank 0 on {}, rank 1 on {}; medians of {} rounds",
        names[0], names[1], me.rounds
    ));
    let mut recs = Vec::new();
    let json_meta = json!({
        "test": "device --procs", "version": env!("CARGO_PKG_VERSION"), "transport": "cuda-ipc",
        "ranks": 2, "gpus": names, "rounds": me.rounds, "warmup": me.warmup, "iters": me.iters,
    });
    let save = |recs: &Vec<Value>| -> Result<(), String> {
        if let (0, Some(p)) = (rank, &args.json) {
            let v = json!({ "meta": json_meta, "records": recs });
            let text = serde_json::to_string_pretty(&v).map_err(e)?;
            std::fs::write(p, text).map_err(|x| format!("--json {}: {x}", p.display()))?;
        }
        Ok(())
    };

    // 1. Semaphore ping-pong next to the raw flag ping-pong.
    let mut raw_rt = f64::NAN;
    for (kind, ping, pong) in [("raw", "raw_ping", "raw_pong"), ("sem", "sem_ping", "sem_pong")] {
        let kern = k(&mem_mod, if rank == 0 { ping } else { pong })?;
        let n = me.iters(20_000) as i32;
        let mut us = Vec::new();
        for round in 0..=me.rounds {
            if kind == "raw" {
                flag.fill(0, 8, 0).map_err(e)?;
            }
            clear(&me.out)?;
            me.barrier()?;
            let (mut mine, mut theirs, mut h) = (flag.device_ptr(), peer_flag, sem.device_handle());
            let (mut nn, mut t, mut o) = (n, me.tns, me.out.device_ptr());
            if kind == "raw" {
                launch(&kern, 1, 1, &me.stream, &mut args![mine, theirs, nn, t, o])?;
            } else {
                launch(&kern, 1, 1, &me.stream, &mut args![h, nn, t, o])?;
            }
            me.sync()?;
            let ns = elapsed_ns(&me.out, &format!("{kind} ping-pong, rank {rank}"))?;
            let rt = me.slowest(if rank == 0 { ns / 1e3 / n as f64 } else { 0.0 })?;
            // Round 0 warms up (module load, first mapping use).
            if round > 0 {
                us.push(rt);
            }
        }
        if kind == "raw" {
            raw_rt = median(&us);
            recs.push(record("raw_flag_pingpong_us", 8, "us", &us, &us));
        } else {
            let m = median(&us);
            me.show(format!(
                "MemoryDevice2DeviceSemaphore signal+wait ping-pong: {m:.2} us round trip; raw flag ping-pong {raw_rt:.2} us ({n} rounds; goal <= 2.4, MSCCL++ 2.35 on H100 x2)"
            ));
            let raw: Vec<f64> = vec![raw_rt; us.len()];
            recs.push(record("semaphore_pingpong_us", 8, "us", &us, &raw));
        }
    }
    save(&recs)?;

    // 2. MemoryChannel put / get bandwidth, uni- and bidirectional, next to the copy engine.
    let copy = k(&mem_mod, "copy_bw")?;
    for (op, chan, local, far, to_remote) in
        [("put", &put_chan, &send, p_recv, true), ("get", &get_chan, &recv, p_send, false)]
    {
        me.show(format!(
            "MemoryChannel {op} (GB/s per direction): size, iters | unidirectional: ours, cuMemcpyDtoDAsync, ratio | bidirectional: ours, copy engine, ratio"
        ));
        for &size in &sizes(args) {
            let iters = me.iters(((8usize << 30) / size).clamp(20, 1000) as u64);
            let blocks = (size / (64 << 10)).clamp(1, 528) as u32;
            let mut line = format!("{:>10} {iters:>6}", human(size));
            for bidir in [false, true] {
                let active = bidir || rank == 0;
                let (mut ours, mut raw) = (Vec::new(), Vec::new());
                let (mut c, mut g, mut sz) = (chan.device_handle_ptr(), (!to_remote) as i32, size as u64);
                if active {
                    let mut w = me.warmup.max(1) as i32;
                    launch(&copy, blocks, 512, &me.stream, &mut args![c, g, sz, w])?;
                    me.sync()?;
                }
                for _ in 0..me.rounds {
                    me.barrier()?;
                    let mut t = 0.0;
                    if active {
                        let mut nn = iters as i32;
                        let t0 = Instant::now();
                        launch(&copy, blocks, 512, &me.stream, &mut args![c, g, sz, nn])?;
                        me.sync()?;
                        t = t0.elapsed().as_secs_f64();
                    }
                    ours.push(size as f64 * iters as f64 / me.slowest(t)? / 1e9);
                    me.barrier()?;
                    let mut t = 0.0;
                    if active {
                        t = mscclpp::bench::baseline_copy_remote(local, far, to_remote, size, me.warmup, iters, false)
                            .map_err(e)?
                            .as_secs_f64();
                    }
                    raw.push(size as f64 * iters as f64 / me.slowest(t)? / 1e9);
                }
                let (o, r) = (median(&ours), median(&raw));
                line += &format!(" | {o:9.2} {r:9.2} {:.3}", o / r);
                let dir = if bidir { "bidir" } else { "uni" };
                recs.push(record(&format!("memchan_{op}_{dir}_gbps"), size, "GB/s", &ours, &raw));
            }
            me.show(line);
        }
        save(&recs)?;
    }

    // 3. LL16 / LL8 packets: one way at 1 KiB, bandwidth at 1 MiB.
    {
        let mut flag0 = 1u32;
        for (pk, ping, pong) in [("LL16", "ll_ping", "ll_pong"), ("LL8", "ll8_ping", "ll8_pong")] {
            let kern = k(&mem_mod, if rank == 0 { ping } else { pong })?;
            for (bytes, blocks, threads, n0) in [(1usize << 10, 1u32, 128u32, 10_000u64), (LL_MAX, 64, 256, 500)] {
                let bytes = bytes.min(max);
                let n = me.iters(n0) as i32;
                let (mut ours, mut raw) = (Vec::new(), Vec::new());
                for round in 0..=me.rounds {
                    clear(&me.out)?;
                    me.barrier()?;
                    let (mut c, mut b, mut nn, mut f, mut t, mut o) =
                        (pk_chan.device_handle_ptr(), bytes as u64, n, flag0, me.tns, me.out.device_ptr());
                    launch(&kern, blocks, threads, &me.stream, &mut args![c, b, nn, f, t, o])?;
                    me.sync()?;
                    flag0 = flag0.wrapping_add(n as u32);
                    let ns = elapsed_ns(&me.out, &format!("{pk} packets, rank {rank}"))?;
                    let one_way = me.slowest(if rank == 0 { ns / 1e3 / n as f64 / 2.0 } else { 0.0 })?;
                    me.barrier()?;
                    // The copy engine: one synchronized copy (latency) at 1 KiB, queued copies at 1 MiB.
                    let latency = bytes < LL_MAX;
                    let it = if latency { 200 } else { 500 };
                    let mut base = 0.0;
                    if rank == 0 {
                        base = mscclpp::bench::baseline_copy_remote(&send, p_recv, true, bytes, 5, it, latency)
                            .map_err(e)?
                            .as_secs_f64()
                            * 1e6
                            / it as f64;
                    }
                    let base = me.slowest(base)?;
                    if round > 0 {
                        ours.push(one_way);
                        raw.push(base);
                    }
                }
                let (o, r) = (median(&ours), median(&raw));
                let gbps = |us: f64| bytes as f64 / us / 1e3;
                let name = format!("{}_{}", pk.to_ascii_lowercase(), if bytes < LL_MAX { "oneway_us" } else { "gbps" });
                if bytes < LL_MAX {
                    me.show(format!(
                        "{pk} putPackets+unpackPackets {}: {o:.2} us one way (raw flag one way {:.2} us; copy engine copy + synchronize {r:.2} us; MSCCL++ 2 GPUs LL16: 4.07 us at 1 KB)",
                        human(bytes),
                        raw_rt / 2.0
                    ));
                    recs.push(record(&name, bytes, "us", &ours, &raw));
                } else {
                    me.show(format!(
                        "{pk} putPackets+unpackPackets {}: {:.2} GB/s one way ({o:.2} us; copy engine {:.2} GB/s; MSCCL++ 2 GPUs LL16: 99.9 GB/s at 1 MB)",
                        human(bytes),
                        gbps(o),
                        gbps(r)
                    ));
                    let (bo, br): (Vec<f64>, Vec<f64>) =
                        (ours.iter().map(|u| gbps(*u)).collect(), raw.iter().map(|u| gbps(*u)).collect());
                    recs.push(record(&name, bytes, "GB/s", &bo, &br));
                }
            }
        }
        save(&recs)?;
    }

    // 4. PortChannel: ping-pong (putWithSignal + flush + wait) and putWithSignal bandwidth.
    proxy.start().map_err(e)?;
    let res = port_rows(&me, &port_mod, port_ptr, &send, p_recv, args, &mut recs);
    let stopped = proxy.stop().map_err(e);
    res?;
    stopped?;
    save(&recs)?;
    me.barrier()?;
    Ok(())
}

/// The PortChannel rows (the proxy is running).
fn port_rows(
    me: &Me,
    m: &KernelModule,
    port_ptr: u64,
    send: &DeviceBuffer,
    p_recv: &RegisteredMemory,
    args: &Args,
    recs: &mut Vec<Value>,
) -> Result<(), String> {
    let rank = me.rank;
    let k = |n: &str| m.function(n).map_err(e);
    let pingpong: Kernel = k(if rank == 0 { "ping" } else { "pong" })?;
    for size in [4usize, 1 << 10] {
        let n = me.iters(10_000) as i32;
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for round in 0..=me.rounds {
            clear(&me.out)?;
            me.barrier()?;
            let (mut c, mut sz, mut nn, mut t, mut o) = (port_ptr, size as u64, n, me.tns, me.out.device_ptr());
            launch(&pingpong, 1, 1, &me.stream, &mut args![c, sz, nn, t, o])?;
            me.sync()?;
            let ns = elapsed_ns(&me.out, &format!("PortChannel ping-pong, rank {rank}"))?;
            let rt = me.slowest(if rank == 0 { ns / 1e3 / n as f64 } else { 0.0 })?;
            me.barrier()?;
            let mut base = 0.0;
            if rank == 0 {
                base = mscclpp::bench::baseline_copy_remote(send, p_recv, true, size, 5, 200, true)
                    .map_err(e)?
                    .as_secs_f64()
                    * 1e6
                    / 200.0;
            }
            let base = me.slowest(base)?;
            if round > 0 {
                ours.push(rt);
                raw.push(base);
            }
        }
        me.show(format!(
            "PortChannel putWithSignal {} + flush + wait ping-pong: {:.2} us round trip (copy engine copy + synchronize, one way: {:.2} us; MSCCL++ tutorial: 20.5 us at 1 KB)",
            human(size),
            median(&ours),
            median(&raw)
        ));
        recs.push(record("portchannel_pingpong_us", size, "us", &ours, &raw));
    }
    let bw = k("put_bw")?;
    me.show("PortChannel putWithSignal bandwidth (GB/s), rank 0 -> rank 1: size, iters, ours, cuMemcpyDtoDAsync, ratio (MSCCL++ tutorial: 367 GB/s at 128 MB)".into());
    for &size in &sizes(args) {
        let iters = me.iters(((8usize << 30) / size).clamp(20, 1000) as u64);
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for round in 0..=me.rounds {
            me.barrier()?;
            let mut t = 0.0;
            if rank == 0 {
                clear(&me.out)?;
                let n0 = if round == 0 { me.warmup.max(1) } else { iters };
                let (mut c, mut sz, mut nn, mut tn, mut o) =
                    (port_ptr, size as u64, n0 as i32, me.tns, me.out.device_ptr());
                launch(&bw, 1, 1, &me.stream, &mut args![c, sz, nn, tn, o])?;
                me.sync()?;
                t = elapsed_ns(&me.out, "PortChannel putWithSignal bandwidth")? / 1e9;
            }
            let t = me.slowest(t)?;
            me.barrier()?;
            let mut b = 0.0;
            if rank == 0 && round > 0 {
                b = mscclpp::bench::baseline_copy_remote(send, p_recv, true, size, me.warmup, iters, false)
                    .map_err(e)?
                    .as_secs_f64();
            }
            let b = me.slowest(b)?;
            if round > 0 {
                ours.push(size as f64 * iters as f64 / t / 1e9);
                raw.push(size as f64 * iters as f64 / b / 1e9);
            }
        }
        let (o, r) = (median(&ours), median(&raw));
        me.show(format!("{:>10} {iters:>6}  {o:9.2}  {r:9.2}  {:.3}", human(size), o / r));
        recs.push(record("portchannel_put_with_signal_gbps", size, "GB/s", &ours, &raw));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn sizes_start_at_1k_and_stop_at_1g() {
        let a = Args::parse_from(["mscclpp-perf", "device", "--procs", "-e", "16K", "-f", "4"]);
        assert_eq!(sizes(&a), vec![1 << 10, 4 << 10, 16 << 10]);
        let a = Args::parse_from(["mscclpp-perf", "device", "--procs", "-b", "64M", "-e", "4G"]);
        assert_eq!(sizes(&a), vec![64 << 20, 128 << 20, 256 << 20, 512 << 20, 1 << 30]);
    }

    #[test]
    fn stats_are_min_median_max() {
        assert_eq!(stats(&[3.0, 1.0, 2.0]), (1.0, 2.0, 3.0));
        assert_eq!(stats(&[4.0, 1.0, 2.0, 3.0]), (1.0, 2.5, 4.0));
        let r = record("x", 1, "us", &[2.0], &[1.0]);
        assert_eq!(r["ratio"], json!(0.5));
    }

    /// The kernels this mode loads compile with NVRTC without warnings and assemble with ptxas
    /// for sm_90 when one is found (`mscclpp::device::compile::ptxas_path`); skips
    /// without NVRTC, as the header tests do.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if mscclpp::device::compile::nvrtc_info().is_err() {
            println!("SKIPPED: no NVRTC (pip install nvidia-cuda-nvrtc)");
            return;
        }
        let have_ptxas = mscclpp::device::compile::ptxas_path().is_some();
        let opts = CompileOptions::default().arch("compute_90");
        for (src, want) in [
            (
                crate::memchan::KERNELS,
                &["sem_ping", "raw_pong", "copy_bw", "copy_bw_val", "copy_bw_round", "ll_ping", "ll8_pong"][..],
            ),
            (
                crate::device::KERNELS,
                &[
                    "ping",
                    "pong",
                    "put_bw",
                    "put_only_bw",
                    "flood",
                    "proxy_load",
                    "clock_echo",
                    "stage_ping",
                    "stage_pong",
                    "fifo_latency",
                    "fifo_push_variant",
                ][..],
            ),
        ] {
            let ptx = compile(src, &opts).unwrap_or_else(|x| panic!("{x}"));
            assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
            let ks = ptx.kernels();
            for w in want {
                assert!(ks.iter().any(|k| k == w), "no kernel {w} in {ks:?}");
            }
            if !have_ptxas {
                println!("NVRTC compiled {} kernels; no ptxas found to assemble them", ks.len());
                continue;
            }
            if let Err(x) = mscclpp::device::compile::assemble(ptx.as_str(), "sm_90") {
                panic!("{x}");
            }
            println!("assembled {} kernels for sm_90", ks.len());
        }
    }
}
