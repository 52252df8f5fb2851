//! `mscclpp-perf device`, MemoryChannel part: one process, two ranks (threads with a loopback
//! bootstrap) on one GPU, two streams, each row next to a raw baseline measured in the same run:
//!
//! * MemoryDevice2DeviceSemaphore signal + wait ping-pong next to a raw flag ping-pong
//!   (`st.release.sys` / `ld.acquire.sys` on plain device words);
//! * MemoryChannel `put` bandwidth, 1 KiB .. `--max-bytes`, next to `cuMemcpyDtoDAsync` between
//!   the same buffers;
//! * LL16 packets: putPackets + unpackPackets ping-pong (one way = half a round trip) at 1 KiB
//!   (latency) and 1 MiB (bandwidth), next to the raw flag one-way time and `cuMemcpyDtoDAsync`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mscclpp::device::compile::{CompileOptions, KernelModule, compile};
use mscclpp::gpu::Stream;
use mscclpp::{
    Communicator, Device, DeviceBuffer, EndpointConfig, MemoryChannel, MemoryDevice2DeviceSemaphore, Transport,
    TransportFlags,
};

use crate::Args;
use crate::kern::{args, clear, e, elapsed_ns, human, launch, row, two_local_ranks};

/// The semaphore, raw flag, copy and packet kernels (`procs.rs` loads them too). Every wait is
/// bounded by `timeout` (ns): a wait that expires sets `out[1]` and ends the kernel's loop.
pub(crate) const KERNELS: &str = r#"
#include "mscclpp_rs/device.cuh"
using namespace mscclpp;
__device__ u64 now() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

extern "C" __global__ void sem_ping(MemoryDevice2DeviceSemaphoreDeviceHandle s, int n, u64 timeout, u64* out) {
  u64 t0 = now();
  for (int i = 0; i < n; ++i) {
    s.signal();
    if (!s.wait_for(timeout)) { out[1] = 1; break; }
  }
  out[0] = now() - t0;
}
extern "C" __global__ void sem_pong(MemoryDevice2DeviceSemaphoreDeviceHandle s, int n, u64 timeout, u64* out) {
  for (int i = 0; i < n; ++i) {
    if (!s.wait_for(timeout)) { out[1] = 1; break; }
    s.signal();
  }
}

// The raw baseline: `mine` is written by the peer, `theirs` is the peer's word (mapped here).
__device__ bool raw_wait(u64* mine, u64 i, u64 timeout) {
  u64 v, t0 = now();
  do {
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(mine) : "memory");
    if (v < i && now() - t0 > timeout) return false;
  } while (v < i);
  return true;
}
extern "C" __global__ void raw_ping(u64* mine, u64* theirs, int n, u64 timeout, u64* out) {
  u64 t0 = now();
  for (u64 i = 1; i <= (u64)n; ++i) {
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(theirs), "l"(i) : "memory");
    if (!raw_wait(mine, i, timeout)) { out[1] = 1; break; }
  }
  out[0] = now() - t0;
}
extern "C" __global__ void raw_pong(u64* mine, u64* theirs, int n, u64 timeout, u64* out) {
  for (u64 i = 1; i <= (u64)n; ++i) {
    if (!raw_wait(mine, i, timeout)) { out[1] = 1; break; }
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(theirs), "l"(i) : "memory");
  }
}

// n collective puts (get = 0: src_ here -> dst_ at the peer) or gets (get = 1: the peer's dst_
// -> src_ here) of `size` bytes by the whole grid.
// The handle by value (a kernel parameter: no load from device memory before each thread's copy,
// which a grid of short-lived threads would pay once per thread).
extern "C" __global__ void copy_bw_val(MemoryChannelDeviceHandle ch, int get, u64 size, int n) {
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  for (int i = 0; i < n; ++i) {
    if (get) ch.get(0, 0, size, tid, nt); else ch.put(0, 0, size, tid, nt);
  }
}
// One put per launch, with a round number as a parameter (as a kernel that signals per round
// has); the flat rows launch it with `round` fixed and changing. Identical back-to-back launches
// of a copy run at ~0.80 of the copy engine at 64-256 MiB on an H200, launches whose parameters
// differ (or with any other stream work between them) at 0.93-0.99 (docs/history.md);
// `round` only makes each launch differ.
extern "C" __global__ void copy_bw_round(MemoryChannelDeviceHandle ch, int get, u64 size, u64 round) {
  if (round == ~0ull) return;
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  if (get) ch.get(0, 0, size, tid, nt); else ch.put(0, 0, size, tid, nt);
}
extern "C" __global__ void copy_bw(MemoryChannelDeviceHandle* ch, int get, u64 size, int n) {
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  for (int i = 0; i < n; ++i) {
    if (get) ch->get(0, 0, size, tid, nt); else ch->put(0, 0, size, tid, nt);
  }
}

// Packet ping-pong, per thread (each thread echoes exactly the packets it unpacked, so no grid
// barrier is needed); round r uses half r % 2 of each packet buffer and flag flag0 + r. An
// unpack that times out sets out[1] and ends that thread's loop.
template <typename P>
__device__ void pk_ping(MemoryChannelDeviceHandle* ch, u64 bytes, int n, u32 flag0, u64 timeout, u64* out) {
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  u64 t0 = now();
  for (int r = 0; r < n; ++r) {
    u64 half = (u64)(r % 2) * 2 * bytes;
    ch->putPackets<P>(half, 0, bytes, tid, nt, flag0 + r);
    if (!ch->unpackPackets_for<P>(half, 0, bytes, tid, nt, flag0 + r, timeout)) { out[1] = 1; break; }
  }
  // The slowest thread's time (threads pipeline independently; out[0] is zeroed before launch).
  atomicMax(out, now() - t0);
}
template <typename P>
__device__ void pk_pong(MemoryChannelDeviceHandle* ch, u64 bytes, int n, u32 flag0, u64 timeout, u64* out) {
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  for (int r = 0; r < n; ++r) {
    u64 half = (u64)(r % 2) * 2 * bytes;
    if (!ch->unpackPackets_for<P>(half, 0, bytes, tid, nt, flag0 + r, timeout)) { out[1] = 1; break; }
    ch->putPackets<P>(half, 0, bytes, tid, nt, flag0 + r);
  }
}
extern "C" __global__ void ll_ping(MemoryChannelDeviceHandle* ch, u64 bytes, int n, u32 flag0, u64 timeout, u64* out) { pk_ping<LL16Packet>(ch, bytes, n, flag0, timeout, out); }
extern "C" __global__ void ll_pong(MemoryChannelDeviceHandle* ch, u64 bytes, int n, u32 flag0, u64 timeout, u64* out) { pk_pong<LL16Packet>(ch, bytes, n, flag0, timeout, out); }
extern "C" __global__ void ll8_ping(MemoryChannelDeviceHandle* ch, u64 bytes, int n, u32 flag0, u64 timeout, u64* out) { pk_ping<LL8Packet>(ch, bytes, n, flag0, timeout, out); }
extern "C" __global__ void ll8_pong(MemoryChannelDeviceHandle* ch, u64 bytes, int n, u32 flag0, u64 timeout, u64* out) { pk_pong<LL8Packet>(ch, bytes, n, flag0, timeout, out); }
"#;

/// Packet payload of the LL rows (the packet buffer holds two halves of twice this).
pub(crate) const LL_MAX: usize = 1 << 20;

struct Rank {
    _comm: Communicator,
    sem: Arc<MemoryDevice2DeviceSemaphore>,
    /// Data (source of puts, destination of the peer's) and packet buffer.
    data: DeviceBuffer,
    chan: MemoryChannel,
    /// The same semaphore with the peer's packet buffer as destination (LL rows).
    pk_chan: MemoryChannel,
    /// Raw flag word (the peer writes it) for the baseline.
    flag: DeviceBuffer,
    peer_flag: u64,
    out: DeviceBuffer,
}

/// Two ranks of this process over CUDA IPC on `dev`, each with a `len`-byte data buffer, a
/// packet buffer, a semaphore and a MemoryChannel to the other.
fn two_ranks(dev: u32, len: usize, timeout: Duration) -> Result<Vec<Rank>, String> {
    two_local_ranks(timeout, |rank, bs| {
        let comm = Communicator::new(bs.clone());
        let peer = 1 - rank;
        let ipc = TransportFlags::from(Transport::CudaIpc);
        let data = DeviceBuffer::new(comm.context(), dev, len, ipc).map_err(e)?;
        let packets = DeviceBuffer::new(comm.context(), dev, 4 * LL_MAX, ipc).map_err(e)?;
        let flag = DeviceBuffer::new(comm.context(), dev, 8, ipc).map_err(e)?;
        let cfg = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
        let pc = comm.connect(&cfg, peer, 0).map_err(e)?;
        for (i, b) in [&data, &packets, &flag].iter().enumerate() {
            comm.send_memory(b.memory(), peer, 1 + i as u32).map_err(e)?;
        }
        let pm: Vec<_> = (0..3).map(|i| comm.recv_memory(peer, 1 + i)).collect::<Result<_, _>>().map_err(e)?;
        let conn = pc.wait().map_err(e)?;
        let remote: Vec<_> = pm.into_iter().map(|p| p.wait()).collect::<Result<_, _>>().map_err(e)?;
        let sem = comm.build_semaphore(&conn, peer, 10).map_err(e)?.wait().map_err(e)?;
        let sem = Arc::new(MemoryDevice2DeviceSemaphore::new(sem).map_err(e)?);
        // Puts go into the peer's data buffer; packets into the peer's packet buffer
        // (a second channel view over the same semaphore).
        let chan = MemoryChannel::new(sem.clone(), &remote[0], data.memory(), Some(packets.memory())).map_err(e)?;
        let pk_chan = MemoryChannel::new(sem.clone(), &remote[1], data.memory(), Some(packets.memory())).map_err(e)?;
        let out = DeviceBuffer::new(comm.context(), dev, 16, TransportFlags::NONE).map_err(e)?;
        bs.barrier().map_err(e)?;
        // The peer's flag word: same process, so its address is the pointer itself.
        let peer_flag = remote[2].addr();
        Ok(Rank { _comm: comm, sem, data, chan, pk_chan, flag, peer_flag, out })
    })
}

/// Runs the MemoryChannel rows on `--device`.
pub fn run(args: &Args) -> Result<(), String> {
    let dev = args.device;
    let timeout = args.timeout();
    let tns = timeout.as_nanos() as u64;
    row("# MemoryChannel and device-to-device semaphores (one process, two ranks, two streams)".into());
    let ptx = compile(KERNELS, &CompileOptions::for_device(dev)).map_err(e)?;
    let m = KernelModule::load(dev, &ptx).map_err(e)?;
    let k = |n: &str| m.function(n).map_err(e);
    let max = args.max_bytes.clamp(1 << 10, 1 << 30) as usize;
    let ranks = two_ranks(dev, max, timeout)?;
    let streams = [Stream::new(dev).map_err(e)?, Stream::new(dev).map_err(e)?];
    let sync = |s: &Stream| s.synchronize(timeout).map_err(e);

    // 1. Semaphore ping-pong next to the raw flag ping-pong.
    let n = 20_000i32;
    let mut raw_rt = 0.0;
    for (kind, ping, pong) in [("raw", "raw_ping", "raw_pong"), ("sem", "sem_ping", "sem_pong")] {
        let (kp, kq) = (k(ping)?, k(pong)?);
        let mut best = f64::MAX;
        for _ in 0..3 {
            for (i, kern) in [&kq, &kp].into_iter().enumerate() {
                let r = &ranks[1 - i];
                let (mut nn, mut t, mut o) = (n, tns, r.out.device_ptr());
                clear(&r.out)?;
                if kind == "raw" {
                    r.flag.fill(0, 8, 0).map_err(e)?;
                }
                let (mut mine, mut theirs, mut h) = (r.flag.device_ptr(), r.peer_flag, r.sem.device_handle());
                if kind == "raw" {
                    launch(kern, 1, 1, &streams[1 - i], &mut args![mine, theirs, nn, t, o])?;
                } else {
                    launch(kern, 1, 1, &streams[1 - i], &mut args![h, nn, t, o])?;
                }
            }
            streams.iter().try_for_each(sync)?;
            elapsed_ns(&ranks[1].out, ping)?;
            best = best.min(elapsed_ns(&ranks[0].out, ping)? / 1e3 / n as f64);
        }
        if kind == "raw" {
            raw_rt = best;
            row(format!(
                "raw flag ping-pong (st.release.sys / ld.acquire.sys): {best:.2} us round trip ({n} rounds, best of 3)"
            ));
        } else {
            row(format!(
                "MemoryDevice2DeviceSemaphore signal+wait ping-pong: {best:.2} us round trip (raw {raw_rt:.2}; goal <= 2.0, MSCCL++ 2.35 on H100 x2)"
            ));
        }
    }

    // 2. put bandwidth, rank 0 -> rank 1, next to cuMemcpyDtoDAsync between the same buffers.
    {
        let kern = k("copy_bw")?;
        let kern_val = k("copy_bw_val")?;
        let kern_round = k("copy_bw_round")?;
        row(
            "MemoryChannel put bandwidth (GB/s): size, persistent grid (<= 528 x 512 threads, the puts looped in one launch; handle in device memory, handle by value), flat grid (1024-thread blocks, 2 elements of 16 B per thread: 32 KiB per block, one launch per put, the handle passed by value; identical launches, then launches that differ by a round-number parameter), cuMemcpyDtoDAsync, ratio of the better flat column (the looped rows re-read lines L2 still holds up to ~64 MiB)"
                .into(),
        );
        let mut size = 1usize << 10;
        while size <= max {
            let iters = ((8usize << 30) / size).clamp(20, 1000) as i32;
            let (mut c, mut hv, mut get, mut sz) =
                (ranks[0].chan.device_handle_ptr(), ranks[0].chan.device_handle(), 0i32, size as u64);
            // `puts(n)` issues n puts on stream 0; GB/s of the best of 3 timed rounds of `iters`
            // puts after `warm` untimed ones.
            let gbps = |warm: i32, puts: &mut dyn FnMut(i32) -> Result<(), String>| -> Result<f64, String> {
                puts(warm)?;
                sync(&streams[0])?;
                let mut best = f64::MAX;
                for _ in 0..3 {
                    let t0 = Instant::now();
                    puts(iters)?;
                    sync(&streams[0])?;
                    best = best.min(t0.elapsed().as_secs_f64());
                }
                Ok(size as f64 * iters as f64 / best / 1e9)
            };
            // Persistent: few threads, many elements each, every put inside one launch; the
            // handle read from device memory (its stable address, as CUDA graphs want), then
            // passed by value.
            let blocks = (size / (64 << 10)).clamp(1, 528) as u32;
            let by_pointer = gbps(3, &mut |mut n| launch(&kern, blocks, 512, &streams[0], &mut args![c, get, sz, n]))?;
            let by_value =
                gbps(3, &mut |mut n| launch(&kern_val, blocks, 512, &streams[0], &mut args![hv, get, sz, n]))?;
            // Flat: one launch per put, 1024-thread blocks, each thread two elements (32 KiB per
            // block), the handle by value. Blocks of 8 KiB or less are capped by how fast the GPU
            // starts blocks (~210 per us on an H200: 0.80 of the copy engine), 16 KiB and more
            // are not (docs/history.md). A grid that loops puts over few elements per thread
            // would re-copy lines its blocks keep in L2, hence one launch per put.
            let flat_blocks = size.div_ceil(16 * 1024 * 2).clamp(1, 1 << 20) as u32;
            // One kernel for both flat columns, so they differ only in whether each launch's
            // `round` argument changes.
            let mut round = 1u64;
            let mut flat = |vary: bool| {
                gbps(1, &mut |n| {
                    (0..n).try_for_each(|_| {
                        round += vary as u64;
                        launch(&kern_round, flat_blocks, 1024, &streams[0], &mut args![hv, get, sz, round])
                    })
                })
            };
            let (flat, flat_round) = (flat(false)?, flat(true)?);
            let base =
                mscclpp::bench::baseline_copy(&[(&ranks[0].data, &ranks[1].data)], size, 3, iters as u64).map_err(e)?;
            let raw = size as f64 * iters as f64 / base.as_secs_f64() / 1e9;
            row(format!(
                "{:>10}  {by_pointer:9.2}  {by_value:9.2}  {flat:9.2}  {flat_round:9.2}  {raw:9.2}  {:.3}",
                human(size),
                flat.max(flat_round) / raw
            ));
            size *= 4;
        }
    }

    // 3. LL16 ping-pong at 1 KiB and 1 MiB.
    {
        let (kp, kq) = (k("ll_ping")?, k("ll_pong")?);
        let mut flag0 = 1u32;
        for (bytes, blocks, threads, n) in [(1usize << 10, 1u32, 128u32, 10_000i32), (LL_MAX, 64, 256, 500)] {
            let mut best = f64::MAX;
            for _ in 0..3 {
                for (i, kern) in [&kq, &kp].into_iter().enumerate() {
                    let r = 1 - i;
                    clear(&ranks[r].out)?;
                    let (mut c, mut b, mut nn, mut f, mut t, mut o) =
                        (ranks[r].pk_chan.device_handle_ptr(), bytes as u64, n, flag0, tns, ranks[r].out.device_ptr());
                    launch(kern, blocks, threads, &streams[r], &mut args![c, b, nn, f, t, o])?;
                }
                streams.iter().try_for_each(sync)?;
                flag0 += n as u32;
                elapsed_ns(&ranks[1].out, "LL16 pong")?;
                best = best.min(elapsed_ns(&ranks[0].out, "LL16 ping")? / 1e3 / n as f64 / 2.0);
            }
            let base = mscclpp::bench::baseline_copy(&[(&ranks[0].data, &ranks[1].data)], bytes.min(max), 3, 200)
                .map_err(e)?;
            let base_us = base.as_secs_f64() * 1e6 / 200.0;
            row(format!(
                "LL16 putPackets+unpackPackets {}: {best:.2} us one way, {:.2} GB/s (raw flag one way {:.2} us; cuMemcpyDtoDAsync {:.2} us, {:.2} GB/s; MSCCL++ 2 GPUs: 4.07 us at 1 KB, 99.9 GB/s at 1 MB)",
                human(bytes),
                bytes as f64 / best / 1e3,
                raw_rt / 2.0,
                base_us,
                bytes.min(max) as f64 / base_us / 1e3
            ));
        }
    }
    Ok(())
}
