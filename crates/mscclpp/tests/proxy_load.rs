//! The proxy under load (GPU machine, `--ignored`; issue 25 item 1): a million put triggers from
//! 132 x 256 GPU producer threads through one FIFO to 4 peers over CUDA IPC (ranks of this
//! process, one GPU). Every put lands exactly once: each trigger copies a distinct 8-byte value
//! to a distinct destination slot and the host checks every slot of every peer. Every wait is
//! bounded: the host's (60 s for the whole run), and each push's (`MAX_SPINS` rounds, then the
//! kernel traps), so a proxy that collapses fails with a timeout naming the progress made.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gpu::{args, kernel, launch, module};
use mscclpp::device::proxy::{ProxyConfig, ProxyService};
use mscclpp::gpu::Stream;
use mscclpp::{Bootstrap, Communicator, Device, DeviceBuffer, EndpointConfig, RootServer, TcpBootstrap, Transport};

const T: Duration = Duration::from_secs(60);
const PEERS: usize = 4;
const BLOCKS: u32 = 132;
const THREADS: u32 = 256;
/// 30 per thread: 1,013,760 triggers.
const PER_THREAD: i32 = 30;
/// Rounds a push may wait before its kernel traps (the head of the line reads the host's tail
/// about once a microsecond: seconds once the proxy stops popping).
const MAX_SPINS: i64 = 4_000_000;

const KERNELS: &str = r#"
#include "mscclpp_rs/device.cuh"
typedef unsigned long long u64;

__device__ u64 value(u64 i) { return 0x5a00000000000000ull | (i + 1); }

// Trigger i = k * nthreads + tid: src[i] = value(i), then a put of those 8 bytes to peer
// i % npeers at slot i / npeers. Each push waits at most max_spins rounds (then traps).
struct Peers { unsigned int sem[4]; unsigned int dst[4]; unsigned int src; unsigned int npeers; };
static_assert(sizeof(Peers) == 40, "Peers differs from the Rust struct");
extern "C" __global__ void put_once(mscclpp::FifoDeviceHandle fifo, Peers p, u64* src, int per_thread,
                                    long long max_spins) {
  u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nthreads = (u64)gridDim.x * blockDim.x;
  for (int k = 0; k < per_thread; ++k) {
    u64 i = (u64)k * nthreads + tid;
    unsigned int peer = (unsigned int)(i % p.npeers);
    src[i] = value(i);
    // The trigger's st.release.sys orders this store before the proxy's copy (it pops first).
    fifo.push(mscclpp::ProxyTrigger(mscclpp::TriggerData, p.dst[peer], (i / p.npeers) * 8, p.src, i * 8, 8,
                                    p.sem[peer]), max_spins);
  }
}
"#;

#[repr(C)]
#[derive(Clone, Copy)]
struct Peers {
    sem: [u32; 4],
    dst: [u32; 4],
    src: u32,
    npeers: u32,
}
// Same fields, order and size as the CUDA struct (which static_asserts 40 bytes): all u32.
const _: () = assert!(std::mem::size_of::<Peers>() == 40);

fn value(i: u64) -> u64 {
    0x5a00_0000_0000_0000 | (i + 1)
}

/// A million puts from 132 x 256 producers to 4 peers over CUDA IPC, each landed exactly once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn million_puts_from_many_producers_land_once() {
    let total = (BLOCKS * THREADS) as u64 * PER_THREAD as u64;
    let per_peer = total.div_ceil(PEERS as u64) as usize;
    let dev = 0u32;
    let cfg = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
    // Rank 0 (the producers' side) and 4 peers, threads of this process.
    let (root, id) = RootServer::start(PEERS + 1, T).unwrap();
    let mut ranks = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..=PEERS)
            .map(|rank| {
                let (id, cfg) = (id.clone(), cfg.clone());
                sc.spawn(move || {
                    let bs: Arc<dyn Bootstrap> =
                        Arc::new(TcpBootstrap::config(rank, PEERS + 1).timeout(T).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let len = if rank == 0 { total as usize * 8 } else { per_peer * 8 };
                    let local = DeviceBuffer::new(comm.context(), dev, len, Transport::CudaIpc.into()).unwrap();
                    local.fill(0, len, 0).unwrap();
                    let others: Vec<usize> = if rank == 0 { (1..=PEERS).collect() } else { vec![0] };
                    let mut conns = Vec::new();
                    let mut remotes = Vec::new();
                    for &p in &others {
                        let c = comm.connect(&cfg, p, 0).unwrap();
                        if rank == 0 {
                            remotes.push(comm.recv_memory(p, 1).unwrap());
                        } else {
                            comm.send_memory(local.memory(), p, 1).unwrap();
                        }
                        conns.push(c);
                    }
                    let conns: Vec<_> = conns.into_iter().map(|c| c.wait().unwrap()).collect();
                    let remotes: Vec<_> = remotes.into_iter().map(|m| m.wait().unwrap()).collect();
                    let sems: Vec<_> = conns
                        .iter()
                        .zip(&others)
                        .map(|(c, &p)| comm.build_semaphore(c, p, 2).unwrap().wait().unwrap())
                        .collect();
                    bs.barrier().unwrap();
                    (comm, conns, local, remotes, sems)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    drop(root);

    let (comm, _conns, src, remotes, sems) = &mut ranks[0];
    let mut proxy = ProxyService::new(comm.context(), dev, ProxyConfig::default()).unwrap();
    let fifo_size = proxy.fifo().size() as u64;
    let mut table = Peers { sem: [0; 4], dst: [0; 4], src: 0, npeers: PEERS as u32 };
    for (p, s) in std::mem::take(sems).into_iter().enumerate() {
        table.sem[p] = proxy.add_semaphore(s).unwrap().0;
        table.dst[p] = proxy.add_memory(remotes[p].clone()).unwrap().0;
    }
    table.src = proxy.add_memory(src.memory().clone()).unwrap().0;
    proxy.start().unwrap();
    let m = module(KERNELS, dev);
    let stream = Stream::new(dev).unwrap();
    let (mut h, mut srcp, mut per, mut ms) = (proxy.fifo().device_handle(), src.device_ptr(), PER_THREAD, MAX_SPINS);
    let t0 = Instant::now();
    launch(&kernel(&m, "put_once"), BLOCKS, THREADS, &stream, &mut args![h, table, srcp, per, ms]);
    loop {
        let done = proxy.processed();
        if done >= total {
            break;
        }
        if let Err(x) = proxy.status() {
            panic!("the proxy failed after {done} of {total} triggers: {x}");
        }
        if t0.elapsed() > T {
            // Stop the proxy: the kernel's pushes then trap within MAX_SPINS rounds; wait
            // (bounded) for that so the failure is reported with the kernel ended.
            let _ = proxy.stop();
            let ended = stream.synchronize(Duration::from_secs(60));
            panic!(
                "TIMEOUT: only {done} of {total} put triggers popped after {:?} ({:.0} triggers/s; FIFO wrapped {} \
                 times); the proxy was stopped and the kernel then ended with {ended:?}",
                t0.elapsed(),
                done as f64 / t0.elapsed().as_secs_f64(),
                done / fifo_size
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let el = t0.elapsed();
    stream
        .synchronize(T)
        .unwrap_or_else(|x| panic!("the kernel failed after the proxy popped everything (a trapped push?): {x}"));
    // Stop flushes every connection (bounded), so every copy has landed when it returns.
    proxy.stop().unwrap_or_else(|x| panic!("stopping the proxy: {x}"));
    assert_eq!(proxy.processed(), total, "triggers popped: one per push, none twice");
    let wraps = total / fifo_size;
    println!(
        "RESULT proxy load: {total} put triggers from {} producers to {PEERS} peers (CUDA IPC) in {el:?}: {:.3} M \
         triggers/s; the {fifo_size}-slot FIFO wrapped {wraps} times",
        BLOCKS * THREADS,
        total as f64 / el.as_secs_f64() / 1e6
    );
    assert!(wraps >= 1000, "the FIFO must wrap many times ({wraps})");

    // Every slot of every peer holds its value: each put landed, at its own slot, once.
    let mut bad = Vec::new();
    let mut checked = 0u64;
    for (q, r) in ranks[1..].iter().enumerate() {
        let bytes = r.2.to_vec().unwrap();
        for (j, w) in bytes.chunks_exact(8).enumerate() {
            let got = u64::from_le_bytes(w.try_into().unwrap());
            let i = j as u64 * PEERS as u64 + q as u64;
            let want = if i < total { value(i) } else { 0 };
            if got != want {
                if bad.len() < 10 {
                    bad.push(format!("peer {} slot {j}: {got:#x}, want {want:#x}", q + 1));
                }
            } else if i < total {
                checked += 1;
            }
        }
    }
    println!("RESULT proxy load: {checked} of {total} destination slots checked on the host");
    assert!(bad.is_empty(), "wrong destination slots (first 10): {bad:#?}");
    assert_eq!(checked, total);
}

/// The kernel compiles with NVRTC and assembles for sm_90 (no GPU needed; skipped without NVRTC
/// or ptxas, except in CI).
#[test]
fn proxy_load_kernel_compiles() {
    common::ptx::kernels_compile("proxy_load_kernel_compiles", "proxy-load", KERNELS, &["put_once"]);
}
