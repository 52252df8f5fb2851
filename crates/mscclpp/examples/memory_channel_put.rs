//! Two ranks, one GPU each (or both on GPU 0): rank 0's kernel copies a buffer straight into
//! rank 1's GPU memory with a `MemoryChannel` (CUDA IPC) and signals; rank 1's kernel waits for
//! the signal and checks every byte. No host thread moves data or signals.
//!
//! Run it with `cargo run --release --example memory_channel_put` on a machine with a CUDA GPU:
//! it starts both ranks as child processes of itself. The kernels are compiled at run time with
//! NVRTC (`MSCCLPP_NVRTC_PATH` names libnvrtc if it is not in the usual places).

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

// Rank 0: every thread of the grid copies its share, then one thread signals once all are done.
extern "C" __global__ void send(mscclpp::MemoryChannelDeviceHandle* ch, u64 bytes) {
  unsigned int tid = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
  // Fill the local source, then put it into the peer's buffer at the same offset.
  for (u64 i = tid; i < bytes; i += n) ((unsigned char*)ch->src_)[i] = (unsigned char)(i * 7 + 3);
  __syncthreads();  // one block here; with several, put the signal in a second kernel
  ch->put(0, bytes, tid, n);
  __syncthreads();
  if (tid == 0) ch->signal();  // release: the peer sees the data once it sees the signal
}

// Rank 1: wait (at most 10 s), then count wrong bytes into *bad (or mark a timeout).
extern "C" __global__ void receive(mscclpp::MemoryChannelDeviceHandle* ch, u64 bytes, u64* bad) {
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = ch->wait_for(10000000000ull);
  __syncthreads();
  if (!ok) { if (threadIdx.x == 0) *bad = ~0ull; return; }
  u64 n = 0;
  for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) n += ((unsigned char*)ch->src_)[i] != (unsigned char)(i * 7 + 3);
  if (n) atomicAdd(bad, n);
}
"#;

fn rank_main(rank: usize, id: &UniqueId) -> Result<(), Box<dyn std::error::Error>> {
    let timeout = Duration::from_secs(30);
    let gpu = (rank % mscclpp::gpu::device_count()?) as u32;
    let bootstrap = Arc::new(TcpBootstrap::config(rank, 2).timeout(timeout).initialize(id)?);
    let comm = Communicator::new(bootstrap.clone());
    let peer = 1 - rank;

    // 1. GPU memory the peer may map (CUDA IPC), exchanged; a CUDA IPC connection.
    let bytes = 1usize << 20;
    let buffer = DeviceBuffer::new(comm.context(), gpu, bytes, Transport::CudaIpc.into())?;
    comm.send_memory(buffer.memory(), peer, 0)?;
    let peer_buffer = comm.recv_memory(peer, 0)?;
    let config = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(gpu));
    let connection = comm.connect(&config, peer, 0)?.wait()?;
    let peer_buffer = peer_buffer.wait()?;

    // 2. A device-to-device semaphore and the channel: the peer's buffer is the destination.
    let semaphore = MemoryDevice2DeviceSemaphore::new(comm.build_semaphore(&connection, peer, 0)?.wait()?)?;
    let channel = MemoryChannel::new(semaphore, &peer_buffer, buffer.memory(), None)?;
    bootstrap.barrier()?;

    // 3. The kernels.
    let module = KernelModule::load(gpu, &compile(KERNELS, &CompileOptions::for_device(gpu))?)?;
    let stream = Stream::new(gpu)?;
    let (mut ch, mut len) = (channel.device_handle_ptr(), bytes as u64);
    let bad = DeviceBuffer::new(comm.context(), gpu, 8, TransportFlags::NONE)?;
    let mut badp = bad.device_ptr();
    let arg = |p: &mut u64| p as *mut u64 as *mut c_void;
    if rank == 0 {
        let f = module.function("send")?;
        // SAFETY: `send` takes (MemoryChannelDeviceHandle*, u64); the handle lives in the
        // channel, which outlives the synchronize below.
        unsafe { f.launch((1, 1, 1), (1024, 1, 1), 0, &stream, &mut [arg(&mut ch), arg(&mut len)])? };
    } else {
        let f = module.function("receive")?;
        // SAFETY: `receive` takes (MemoryChannelDeviceHandle*, u64, u64*); all live until the
        // synchronize below.
        unsafe { f.launch((1, 1, 1), (1024, 1, 1), 0, &stream, &mut [arg(&mut ch), arg(&mut len), arg(&mut badp)])? };
    }
    stream.synchronize(timeout)?;
    if rank == 1 {
        let wrong = bad.read_u64(0)?;
        if wrong != 0 {
            return Err(format!("rank 1: {wrong} wrong bytes (u64::MAX: the wait timed out)").into());
        }
        println!("rank 1 received {bytes} bytes from rank 0's kernel, all correct");
    }
    // Nobody may drop memory the other's kernel still uses: meet before leaving.
    bootstrap.barrier()?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let (Ok(rank), Ok(id)) = (std::env::var("RANK"), std::env::var("MSCCLPP_UNIQUE_ID")) {
        return rank_main(rank.parse()?, &id.parse()?);
    }
    let (root, id) = RootServer::start(2, Duration::from_secs(30))?;
    let me = std::env::current_exe()?;
    let children: Vec<_> = (0..2)
        .map(|r| {
            std::process::Command::new(&me)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
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
    println!("memory_channel_put: OK");
    Ok(())
}
