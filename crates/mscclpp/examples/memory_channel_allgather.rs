//! An all-gather over N ranks built from MemoryChannels: every rank owns one chunk of a
//! buffer of N chunks; one kernel per rank puts its chunk into every peer's buffer (block p
//! serves peer p), signals that peer, and waits for the peer's signal. Afterwards every rank
//! holds every chunk.
//!
//! Run it with `cargo run --release --example memory_channel_allgather [N]` (default 4) on a
//! machine with a CUDA GPU; ranks go round-robin over the GPUs. It starts the ranks as child
//! processes of itself.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use mscclpp::device::compile::{CompileOptions, KernelModule, compile};
use mscclpp::gpu::Stream;
use mscclpp::{
    Bootstrap, Communicator, Device, DeviceBuffer, EndpointConfig, MemoryChannel, MemoryDevice2DeviceSemaphore,
    RootServer, TcpBootstrap, Transport, TransportFlags, UniqueId,
};

const KERNELS: &str = r#"
#include "mscclpp_rs/device.cuh"
using mscclpp::u64;

__device__ unsigned int value(unsigned int rank, u64 i) { return rank * 1000003u + (unsigned int)i; }

// chans[p] is the channel to the p-th peer (nPeers of them). Block p: put my chunk to peer p,
// signal it, wait for its chunk (bounded), mark a timeout in *bad.
extern "C" __global__ void all_gather(mscclpp::MemoryChannelDeviceHandle* chans, int rank, u64 chunk, u64* bad) {
  mscclpp::MemoryChannelDeviceHandle& ch = chans[blockIdx.x];
  unsigned int* mine = (unsigned int*)((char*)ch.src_ + rank * chunk);
  for (u64 i = threadIdx.x; i < chunk / 4; i += blockDim.x) mine[i] = value(rank, i);
  __syncthreads();
  ch.put(rank * chunk, chunk, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    ch.signal();
    if (!ch.wait_for(20000000000ull)) atomicAdd(bad, 1ull);
  }
}

// After all_gather: count words of every chunk that differ from their owner's values.
extern "C" __global__ void check(const unsigned int* buf, int ranks, u64 chunk, u64* bad) {
  u64 n = 0;
  for (u64 w = blockIdx.x * blockDim.x + threadIdx.x; w < ranks * chunk / 4; w += gridDim.x * blockDim.x)
    n += buf[w] != value((unsigned int)(w / (chunk / 4)), w % (chunk / 4));
  if (n) atomicAdd(bad, n);
}
"#;

fn rank_main(rank: usize, size: usize, id: &UniqueId) -> Result<(), Box<dyn std::error::Error>> {
    let timeout = Duration::from_secs(60);
    let gpu = (rank % mscclpp::gpu::device_count()?) as u32;
    let bootstrap = Arc::new(TcpBootstrap::config(rank, size).timeout(timeout).initialize(id)?);
    let comm = Communicator::new(bootstrap.clone());
    let chunk = 256usize << 10;
    let buffer = DeviceBuffer::new(comm.context(), gpu, chunk * size, Transport::CudaIpc.into())?;
    let peers: Vec<usize> = (0..size).filter(|&p| p != rank).collect();
    let config = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(gpu));
    // Send everything first, then wait: no rank blocks on a peer that is still sending.
    let mut pending = Vec::new();
    for &p in &peers {
        comm.send_memory(buffer.memory(), p, 0)?;
        pending.push((comm.recv_memory(p, 0)?, comm.connect(&config, p, 0)?));
    }
    let mut channels = Vec::new();
    let mut sems = Vec::new();
    for (&p, (mem, conn)) in peers.iter().zip(pending) {
        let (mem, conn) = (mem.wait()?, conn.wait()?);
        sems.push((p, mem, comm.build_semaphore(&conn, p, 0)?));
    }
    for (_, mem, sem) in sems {
        let sem = MemoryDevice2DeviceSemaphore::new(sem.wait()?)?;
        channels.push(MemoryChannel::new(sem, &mem, buffer.memory(), None)?);
    }
    // The kernel takes an array of handles: copy them to device memory.
    let handles: Vec<u8> = channels.iter().flat_map(|c| c.device_handle().to_bytes()).collect();
    let table = DeviceBuffer::new(comm.context(), gpu, handles.len().max(1), TransportFlags::NONE)?;
    table.write(0, &handles)?;
    bootstrap.barrier()?;

    let module = KernelModule::load(gpu, &compile(KERNELS, &CompileOptions::for_device(gpu))?)?;
    let stream = Stream::new(gpu)?;
    let bad = DeviceBuffer::new(comm.context(), gpu, 16, TransportFlags::NONE)?;
    let (mut t, mut r, mut c, mut b) = (table.device_ptr(), rank as i32, chunk as u64, bad.device_ptr());
    let a = |p: *mut u8| p as *mut c_void;
    let f = module.function("all_gather")?;
    // SAFETY: all_gather takes (MemoryChannelDeviceHandle*, int, u64, u64*): the table, the
    // channels and `bad` live until the synchronize below.
    unsafe {
        f.launch(
            (peers.len().max(1) as u32, 1, 1),
            (512, 1, 1),
            0,
            &stream,
            &mut [
                a(&mut t as *mut u64 as *mut u8),
                a(&mut r as *mut i32 as *mut u8),
                a(&mut c as *mut u64 as *mut u8),
                a(&mut b as *mut u64 as *mut u8),
            ],
        )?
    };
    stream.synchronize(timeout)?;
    let timeouts = bad.read_u64(0)?;
    let (mut p, mut n, mut b2) = (buffer.device_ptr(), size as i32, bad.device_ptr() + 8);
    let f = module.function("check")?;
    // SAFETY: check takes (const unsigned*, int, u64, u64*): the buffer and `bad` are live.
    unsafe {
        f.launch(
            (64, 1, 1),
            (256, 1, 1),
            0,
            &stream,
            &mut [
                a(&mut p as *mut u64 as *mut u8),
                a(&mut n as *mut i32 as *mut u8),
                a(&mut c as *mut u64 as *mut u8),
                a(&mut b2 as *mut u64 as *mut u8),
            ],
        )?
    };
    stream.synchronize(timeout)?;
    let wrong = bad.read_u64(8)?;
    bootstrap.barrier()?;
    if timeouts != 0 || wrong != 0 {
        return Err(format!("rank {rank}: {timeouts} waits timed out, {wrong} wrong words").into());
    }
    println!("rank {rank}: all {size} chunks of {chunk} bytes correct");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let size: usize =
        std::env::var("WORLD_SIZE").ok().or_else(|| std::env::args().nth(1)).map_or(Ok(4), |s| s.parse())?;
    if size < 2 {
        return Err("an all-gather needs at least 2 ranks".into());
    }
    if let (Ok(rank), Ok(id)) = (std::env::var("RANK"), std::env::var("MSCCLPP_UNIQUE_ID")) {
        return rank_main(rank.parse()?, size, &id.parse()?);
    }
    let (root, id) = RootServer::start(size, Duration::from_secs(60))?;
    let me = std::env::current_exe()?;
    let children: Vec<_> = (0..size)
        .map(|r| {
            std::process::Command::new(&me)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", size.to_string())
                .env("MSCCLPP_UNIQUE_ID", id.to_string())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut ok = true;
    for mut c in children {
        ok &= c.wait()?.success();
    }
    root.join();
    if !ok {
        return Err("a rank failed".into());
    }
    println!("memory_channel_allgather ({size} ranks): OK");
    Ok(())
}
