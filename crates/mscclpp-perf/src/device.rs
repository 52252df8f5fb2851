//! `mscclpp-perf device`: kernels that communicate, one process, two ranks (threads with a
//! loopback bootstrap) on one GPU, two streams. Rows are printed as they finish:
//!
//! * FIFO push -> host pop, one GPU thread (MSCCL++ measured the same way on an H200: 0.89 us;
//!   its own FifoTest reports 1.97 us on an H200);
//! * proxy throughput, 256 .. 65536 GPU producers, no-op triggers (flushes of an idle
//!   connection), and MSCCL++'s push (every waiter polls the host tail) for comparison;
//! * PortChannel ping-pong (putWithSignal + flush + wait, 4 B, CUDA IPC) next to the host-driven
//!   write + update_and_sync + flush round trip, the host cost of the CUDA IPC calls, and the
//!   ping-pong with one flush at the end;
//! * where a PortChannel hop's time goes (`stages.rs`): the ping-pong through instrumented
//!   proxies, one hop cut into push, pickup, copy issue, token issue, and landing + poll;
//! * PortChannel putWithSignal bandwidth, 1 KiB .. `--max-bytes`, next to `cuMemcpyDtoDAsync`,
//!   and plain puts at 64 MiB (what the signals cost);
//! * the proxy under load (`proxyload.rs`): put / putWithSignal / signal triggers to 1, 4 and 8
//!   peers over CUDA IPC and Ethernet from 1 to 132 x 256 producers, beside one host thread
//!   issuing the same calls directly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mscclpp::device::compile::{CompileOptions, Kernel, KernelModule, compile};
use mscclpp::device::fifo::Fifo;
use mscclpp::device::proxy::{ProxyConfig, ProxyService};
use mscclpp::gpu::Stream;
use mscclpp::{
    Communicator, Connection, Device, DeviceBuffer, EndpointConfig, Host2DeviceSemaphore, RegisteredMemory, Semaphore,
    Transport,
};

use crate::kern::{args, clear, e, elapsed_ns, human, launch, row, two_local_ranks};
use crate::{Args, DevicePart};

/// The FIFO, proxy and PortChannel kernels (`procs.rs` loads them too). Every wait is bounded:
/// the ping-pong kernels take `timeout` (ns) and set `out[1]` when a wait or flush timed out.
pub(crate) const KERNELS: &str = r#"
#include "mscclpp_rs/device.cuh"
typedef unsigned long long u64;
__device__ u64 now() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

// One thread pushes n triggers, syncing on the last of every `size` (the ring never overflows
// into the spin-limited wait); out[0] = elapsed ns. `size` is a power of two: the test is a mask,
// not a modulo (a lone thread's integer modulo by a run-time value costs tens of nanoseconds,
// which this row would count as the push's).
// `exclusive`: the same pushes through a `FifoExclusiveProducer` (this thread is the FIFO's
// only producer), made before the clock starts.
extern "C" __global__ void fifo_latency(mscclpp::FifoDeviceHandle fifo, int n, int exclusive, u64* out) {
  mscclpp::ProxyTrigger t(mscclpp::TriggerSync, 0, 0, 0, 0, 0, 0);
  mscclpp::FifoExclusiveProducer sole(fifo);
  u64 t0 = now(), pos = 0;
  for (int i = 0; i < n; ++i) {
    pos = exclusive ? sole.push(t) : fifo.push(t);
    if (((i + 1) & (fifo.size - 1)) == 0) fifo.sync(pos);
  }
  fifo.sync(pos);
  out[0] = now() - t0;
}

// Push diagnostics (issue 25 item 2; not for use: modes 2-3 each drop a guarantee): the
// fifo_latency loop with the push cut down. mode 0: the header's push; 1: the header's
// push_relaxed (the trigger stored relaxed at system scope; the caller's fence, which this loop
// does not need, orders the data);
// 2: a gpu-scope release fence, then that relaxed store; 3: the header's store, the position
// counted by this one thread instead of the atomic on `head` (head is set at the end); 4 and 5:
// the header's push_batch, 8 and 32 triggers a call (n a multiple of 32, fifo.size of 32); 6:
// FifoExclusiveProducer::push_relaxed (what mode 1 costs without the atomic on head, the count
// kept by the header; the producer, like the one fifo_latency makes, is made before the clock
// starts in every mode).
extern "C" __global__ void fifo_push_variant(mscclpp::FifoDeviceHandle fifo, int n, int mode, u64* out) {
  mscclpp::ProxyTrigger t(mscclpp::TriggerSync, 0, 0, 0, 0, 0, 0);
  u64 mine = *fifo.head, pos = 0;
  mscclpp::FifoExclusiveProducer sole(fifo);
  u64 t0 = now();
  if (mode == 4 || mode == 5) {
    mscclpp::ProxyTrigger ts[32];
    const int b = mode == 4 ? 8 : 32;
    for (int k = 0; k < b; ++k) ts[k] = t;
    for (int i = 0; i < n; i += b) {
      pos = fifo.push_batch(ts, (unsigned int)b) + (u64)(b - 1);
      if (((i + b) & (fifo.size - 1)) == 0) fifo.sync(pos);
    }
    fifo.sync(pos);
    out[0] = now() - t0;
    return;
  }
  for (int i = 0; i < n; ++i) {
    if (mode == 0) {
      pos = fifo.push(t);
    } else if (mode == 1) {
      pos = fifo.push_relaxed(t);
    } else if (mode == 6) {
      pos = sole.push_relaxed(t);
    } else {
      pos = mode == 3 ? mine++ : mscclpp::detail::fetch_add_relaxed_gpu(fifo.head, 1);
      if (pos >= (u64)fifo.size + *fifo.tailCache) fifo.sync(pos - fifo.size);
      t.fields.reserved = ((pos >> fifo.sizeShift) & 1ull) ^ 1ull;
      mscclpp::ProxyTrigger* slot = &fifo.triggers[pos & fifo.sizeMask];
      if (mode == 3) {
        mscclpp::detail::store_trigger_release_sys(slot, t.fst, t.snd);
      } else {
        if (mode == 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("st.global.relaxed.sys.v2.u64 [%0], {%1,%2};" ::"l"(slot), "l"(t.fst), "l"(t.snd) : "memory");
      }
    }
    if (((i + 1) & (fifo.size - 1)) == 0) fifo.sync(pos);
  }
  fifo.sync(pos);
  out[0] = now() - t0;
  if (mode == 3) *fifo.head = mine;
}

// Every thread pushes per_thread no-op triggers (a flush of semaphore `sem`'s idle connection).
extern "C" __global__ void flood(mscclpp::FifoDeviceHandle fifo, int per_thread, unsigned int sem) {
  mscclpp::ProxyTrigger t(mscclpp::TriggerSync, 0, 0, 0, 0, 0, sem);
  for (int i = 0; i < per_thread; ++i) fifo.push(t);
}

// PortChannel ping-pong: putWithSignal `size` bytes + flush + wait; out[0] = elapsed ns,
// out[1] = 1 if a flush or wait timed out (after `timeout` ns; the loop stops there).
extern "C" __global__ void ping(mscclpp::PortChannelDeviceHandle* ch, u64 size, int n, u64 timeout, u64* out) {
  u64 t0 = now();
  for (int i = 0; i < n; ++i) {
    ch->putWithSignal(0, size);
    if (!ch->flush_for(timeout) || !ch->wait_for(timeout)) { out[1] = 1; break; }
  }
  out[0] = now() - t0;
}

extern "C" __global__ void pong(mscclpp::PortChannelDeviceHandle* ch, u64 size, int n, u64 timeout, u64* out) {
  for (int i = 0; i < n; ++i) {
    if (!ch->wait_for(timeout)) { out[1] = 1; break; }
    ch->putWithSignal(0, size);
    if (!ch->flush_for(timeout)) { out[1] = 1; break; }
  }
}

// MSCCL++'s push: every producer that finds the ring full polls `tail` across PCIe (for
// comparison with the header's push, which waits on tailCache with backoff).
__device__ u64 push_polling(mscclpp::FifoDeviceHandle& f, mscclpp::ProxyTrigger t) {
  u64 pos = mscclpp::detail::fetch_add_relaxed_gpu(f.head, 1);
  if (pos >= (u64)f.size + *f.tailCache) f.sync(pos - f.size);
  t.fields.reserved = ((pos >> f.sizeShift) & 1ull) ^ 1ull;
  mscclpp::detail::store_trigger_release_sys(&f.triggers[pos & f.sizeMask], t.fst, t.snd);
  return pos;
}
extern "C" __global__ void flood_polling(mscclpp::FifoDeviceHandle fifo, int per_thread, unsigned int sem) {
  mscclpp::ProxyTrigger t(mscclpp::TriggerSync, 0, 0, 0, 0, 0, sem);
  for (int i = 0; i < per_thread; ++i) push_polling(fifo, t);
}

// The ping-pong with one flush at the end instead of one per round (what the flush costs).
extern "C" __global__ void ping_noflush(mscclpp::PortChannelDeviceHandle* ch, u64 size, int n, u64 timeout, u64* out) {
  u64 t0 = now();
  for (int i = 0; i < n; ++i) {
    ch->putWithSignal(0, size);
    if (!ch->wait_for(timeout)) { out[1] = 1; break; }
  }
  if (!ch->flush_for(timeout)) out[1] = 1;
  out[0] = now() - t0;
}
extern "C" __global__ void pong_noflush(mscclpp::PortChannelDeviceHandle* ch, u64 size, int n, u64 timeout, u64* out) {
  for (int i = 0; i < n; ++i) {
    if (!ch->wait_for(timeout)) { out[1] = 1; break; }
    ch->putWithSignal(0, size);
  }
  if (!ch->flush_for(timeout)) out[1] = 1;
}

// Proxy load (proxyload.rs): every thread pushes per_thread triggers; trigger i = k * nthreads + tid
// goes to peer i % npeers, slot (i / npeers) % slots of `size` bytes (same offset on both sides;
// slots is a power of two). op 0: put, 1: putWithSignal, 2: signal. batch > 1: each thread pushes
// its triggers `batch` at a time with push_batch (at most 32; the last batch may be shorter).
// batch < 0: each thread makes one __threadfence_system() (the sources were written before the
// kernel), then pushes its triggers one at a time with push_relaxed; batch == -2 with one thread
// in the grid: through a FifoExclusiveProducer (its push_relaxed; with more threads, -2 is -1).
// Peer and slot advance by addition (a 64-bit division costs one GPU thread a few hundred cycles:
// with one producer, three a trigger cost more than the push itself). Each push's wait is bounded
// by max_spins rounds (the kernel traps past it: the proxy stopped popping), so a stalled proxy
// fails the row, not hangs it.
struct LoadPeers { unsigned int sem[8]; unsigned int dst[8]; unsigned int src; unsigned int npeers; unsigned int slots; unsigned int pad; };
static_assert(sizeof(LoadPeers) == 80, "LoadPeers differs from proxyload.rs");
extern "C" __global__ void proxy_load(mscclpp::FifoDeviceHandle fifo, LoadPeers p, int op, u64 size, int per_thread,
                                      long long max_spins, int batch) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nthreads = (u64)gridDim.x * blockDim.x;
  mscclpp::TriggerType type =
      op == 0 ? mscclpp::TriggerData : op == 1 ? (mscclpp::TriggerData | mscclpp::TriggerFlag) : mscclpp::TriggerFlag;
  if (batch > 32) batch = 32;
  const bool relaxed = batch < 0;
  const bool exclusive = batch == -2 && nthreads == 1;
  if (relaxed) {
    batch = 1;
    // Orders every source before the relaxed triggers below (push_relaxed's contract).
    __threadfence_system();
  }
  mscclpp::ProxyTrigger ts[32];
  int held = 0;
  // i = q * npeers + r, starting at i = tid; each step adds nthreads = step_q * npeers + step_r.
  const u64 step_q = nthreads / p.npeers, step_r = nthreads % p.npeers;
  u64 q = tid / p.npeers, r = tid % p.npeers;
  const u64 slot_mask = (u64)p.slots - 1;
  // A signal carries no put fields (the proxy refuses one that does).
  const bool sig = op == 2;
  // Signals in batches: a trigger names only its peer, and when a batch advances the peer by a
  // whole number of rounds (batch * step_r a multiple of npeers: 1, 2, 4 or 8 peers and batches
  // of 32) every batch is the same, so it is built once and pushed again. The row then times the
  // FIFO and the proxy, not this lone thread rebuilding 32 triggers in local memory for every
  // call (0.13 us a trigger, more than the push: session 24).
  if (sig && batch > 1 && ((u64)batch * step_r) % p.npeers == 0) {
    for (int j = 0; j < batch; ++j) {
      ts[j] = mscclpp::ProxyTrigger(type, 0u, 0, 0u, 0, 0, p.sem[(unsigned int)r]);
      r += step_r;
      if (r >= p.npeers) r -= p.npeers;
    }
    for (int k = 0; k < per_thread; k += batch) {
      const int m = per_thread - k < batch ? per_thread - k : batch;
      fifo.push_batch(ts, (unsigned int)m, max_spins);
    }
    return;
  }
  // Trigger k of this thread; peer and slot advance by addition (see above).
  auto next_trigger = [&]() {
    const unsigned int peer = (unsigned int)r;
    const u64 off = sig ? 0 : (q & slot_mask) * size;
    mscclpp::ProxyTrigger t(type, sig ? 0u : p.dst[peer], off, sig ? 0u : p.src, off, sig ? 0 : size, p.sem[peer]);
    q += step_q;
    r += step_r;
    if (r >= p.npeers) { r -= p.npeers; ++q; }
    return t;
  };
  if (exclusive) {
    mscclpp::FifoExclusiveProducer sole(fifo);
    for (int k = 0; k < per_thread; ++k) sole.push_relaxed(next_trigger(), max_spins);
    return;
  }
  for (int k = 0; k < per_thread; ++k) {
    const mscclpp::ProxyTrigger t = next_trigger();
    if (batch <= 1) {
      if (relaxed) {
        fifo.push_relaxed(t, max_spins);
      } else {
        fifo.push(t, max_spins);
      }
      continue;
    }
    ts[held++] = t;
    if (held == batch || k + 1 == per_thread) {
      fifo.push_batch(ts, (unsigned int)held, max_spins);
      held = 0;
    }
  }
}

// n puts of `size` bytes without signals, then one flush; out[0] = elapsed ns, out[1] = 1 if
// the flush timed out.
extern "C" __global__ void put_only_bw(mscclpp::PortChannelDeviceHandle* ch, u64 size, int n, u64 timeout, u64* out) {
  u64 t0 = now();
  for (int i = 0; i < n; ++i) ch->put(0, size);
  if (!ch->flush_for(timeout)) out[1] = 1;
  out[0] = now() - t0;
}

// n puts of `size` bytes with a signal each, then one flush; out[0] = elapsed ns, out[1] = 1 if
// the flush timed out.
extern "C" __global__ void put_bw(mscclpp::PortChannelDeviceHandle* ch, u64 size, int n, u64 timeout, u64* out) {
  u64 t0 = now();
  for (int i = 0; i < n; ++i) ch->putWithSignal(0, size);
  if (!ch->flush_for(timeout)) out[1] = 1;
  out[0] = now() - t0;
}

// Stage breakdown (stages.rs). clock_echo: n bounces of a counter through mapped host memory
// (write i to d2h, wait for i in h2d); t[2i..] = (sent, answer seen) on %globaltimer; out[2] =
// the smallest nonzero step of %globaltimer seen; out[1] = 1 if a wait timed out.
extern "C" __global__ void clock_echo(u64* d2h, u64* h2d, int n, u64 timeout, u64* t, u64* out) {
  u64 step = ~0ull, prev = now();
  for (int i = 0; i < 2000; ++i) {
    u64 x = now();
    if (x != prev && x - prev < step) step = x - prev;
    prev = x;
  }
  out[2] = step;
  for (int i = 0; i < n; ++i) {
    u64 a = now();
    *(volatile u64*)d2h = (u64)i + 1;
    while (*(volatile u64*)h2d < (u64)i + 1) {
      if (now() - a > timeout) { out[1] = 1; return; }
    }
    u64 b = now();
    t[2 * i] = a;
    t[2 * i + 1] = b;
  }
}

// The instrumented ping-pong: putWithSignal triggers (destination memory 0, source 1,
// semaphore 0) for the stage proxy, and the Host2Device semaphore it signals. ping: t[3i..] =
// (push called, push returned, wait returned); pong: (wait returned, push called, push
// returned); out[0] = ping's elapsed ns, out[1] = 1 if a push or wait timed out.
extern "C" __global__ void stage_ping(mscclpp::FifoDeviceHandle fifo, mscclpp::Host2DeviceSemaphoreDeviceHandle sem,
                                      u64 size, int n, u64 timeout, u64* t, u64* out) {
  mscclpp::ProxyTrigger tr(mscclpp::TriggerData | mscclpp::TriggerFlag, 0, 0, 1, 0, size, 0);
  u64 t0 = now();
  for (int i = 0; i < n; ++i) {
    u64 a = now();
    if (!fifo.push_for(tr, timeout)) { out[1] = 1; break; }
    u64 b = now();
    if (!sem.wait_for(timeout)) { out[1] = 1; break; }
    u64 c = now();
    t[3 * i] = a; t[3 * i + 1] = b; t[3 * i + 2] = c;
  }
  out[0] = now() - t0;
}
extern "C" __global__ void stage_pong(mscclpp::FifoDeviceHandle fifo, mscclpp::Host2DeviceSemaphoreDeviceHandle sem,
                                      u64 size, int n, u64 timeout, u64* t, u64* out) {
  mscclpp::ProxyTrigger tr(mscclpp::TriggerData | mscclpp::TriggerFlag, 0, 0, 1, 0, size, 0);
  u64 t0 = now();
  for (int i = 0; i < n; ++i) {
    if (!sem.wait_for(timeout)) { out[1] = 1; break; }
    u64 c = now();
    u64 a = now();
    if (!fifo.push_for(tr, timeout)) { out[1] = 1; break; }
    u64 b = now();
    t[3 * i] = c; t[3 * i + 1] = a; t[3 * i + 2] = b;
  }
  out[0] = now() - t0;
}
"#;

struct Rank {
    comm: Communicator,
    conn: Connection,
    local: DeviceBuffer,
    remote: RegisteredMemory,
    /// For the host-driven round trip.
    host_sem: Host2DeviceSemaphore,
    /// For the PortChannel (taken by its proxy).
    dev_sem: Option<Host2DeviceSemaphore>,
    /// For the throughput test's no-op triggers (taken by its proxy).
    plain: Option<Semaphore>,
    /// For the stage breakdown (taken by its instrumented proxy; counts start at zero).
    stage_sem: Option<Host2DeviceSemaphore>,
}

/// Two ranks of this process over CUDA IPC on `dev`, each with a `len`-byte buffer.
fn two_ranks(dev: u32, len: usize, timeout: Duration) -> Result<Vec<Rank>, String> {
    two_local_ranks(timeout, |rank, bs| {
        let comm = Communicator::new(bs.clone());
        let peer = 1 - rank;
        let local = DeviceBuffer::new(comm.context(), dev, len, Transport::CudaIpc.into()).map_err(e)?;
        let cfg = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
        let pc = comm.connect(&cfg, peer, 0).map_err(e)?;
        comm.send_memory(local.memory(), peer, 1).map_err(e)?;
        let pm = comm.recv_memory(peer, 1).map_err(e)?;
        let conn = pc.wait().map_err(e)?;
        let remote = pm.wait().map_err(e)?;
        let sems = [2, 3, 4, 5].map(|tag| comm.build_semaphore(&conn, peer, tag));
        let mut got = Vec::new();
        for s in sems {
            got.push(s.map_err(e)?.wait().map_err(e)?);
        }
        let stage_sem = Some(Host2DeviceSemaphore::new(got.pop().ok_or("semaphore")?).map_err(e)?);
        let plain = got.pop();
        let dev_sem = Some(Host2DeviceSemaphore::new(got.pop().ok_or("semaphore")?).map_err(e)?);
        let host_sem = Host2DeviceSemaphore::new(got.pop().ok_or("semaphore")?).map_err(e)?;
        bs.barrier().map_err(e)?;
        Ok(Rank { comm, conn, local, remote, host_sem, dev_sem, plain, stage_sem })
    })
}

/// Runs the device benchmarks on `--device`.
pub fn run(args: &Args) -> Result<(), String> {
    let dev = args.device;
    let timeout = args.timeout();
    let name = mscclpp::gpu::device_name(dev).unwrap_or_else(|_| format!("GPU{dev}"));
    row(format!("# mscclpp-perf device: one process, two ranks on {name} (GPU {dev}), two streams"));
    if let Some(q) = crate::queues::setting() {
        row(format!("# hardware queues: {q}"));
    }
    // Where the FIFO's pinned ring lives relative to the GPU (the library allocates it on the
    // GPU's node): a ring across the socket link makes every push's system-scope fence slower.
    let nodes = mscclpp::numa_node_count();
    let gpu_node = mscclpp::gpu::numa_node(dev).map_or_else(|| "unknown".to_string(), |n| n.to_string());
    row(format!("# NUMA: {nodes} node(s); GPU {dev} on node {gpu_node}"));
    if let Some(b) = mscclpp::env::env().ok().and_then(|v| v.cudaipc_kernel_copy_max).filter(|&b| b > 0) {
        row(format!(
            "# CUDA IPC copies of at most {b} B, and a signal joined to one, go through a kernel \
             (MSCCLPP_CUDAIPC_KERNEL_COPY_MAX; off by default)"
        ));
        if let Some(d) = mscclpp::env::env().ok().and_then(|v| v.cudaipc_kernel_copy_linger).filter(|d| !d.is_zero()) {
            row(format!(
                "# the copy kernel of a putWithSignal stays {d:?} for the next copy \
                 (MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US; off by default)"
            ));
        }
    }
    let ptx = compile(KERNELS, &CompileOptions::default()).map_err(e)?;
    let m = KernelModule::load(dev, &ptx).map_err(e)?;
    let k = |n: &str| m.function(n).map_err(e);
    let want = |p: DevicePart| args.parts.as_ref().is_none_or(|ps| ps.contains(&p));

    // 1. FIFO push -> host pop latency, one GPU thread.
    if want(DevicePart::Fifo) {
        let ctx = mscclpp::Context::new();
        let fifo = Arc::new(Fifo::new(&ctx, dev, 512).map_err(e)?);
        let out = DeviceBuffer::new(&ctx, dev, 8, mscclpp::TransportFlags::NONE).map_err(e)?;
        let stream = Stream::new(dev).map_err(e)?;
        let stop = Arc::new(AtomicBool::new(false));
        let popped = Arc::new(AtomicU64::new(0));
        let consumer = {
            let (fifo, stop, popped) = (fifo.clone(), stop.clone(), popped.clone());
            std::thread::spawn(move || {
                // On the GPU's NUMA node, as the library's proxy thread is (and MSCCL++'s).
                if let Some(n) = mscclpp::gpu::numa_node(dev) {
                    let _ = mscclpp::bind_thread_to_node(n);
                }
                while !stop.load(Ordering::Relaxed) {
                    if fifo.poll().is_some() {
                        fifo.pop();
                        popped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let kern = k("fifo_latency")?;
        // The handle's push, then the same loop through a FifoExclusiveProducer (this thread
        // being the FIFO's only producer: no atomic on head).
        for (exclusive, how) in [(0i32, ""), (1, ", FifoExclusiveProducer::push")] {
            for (n, label) in [(1000i32, "warm-up"), (100_000, "timed")] {
                let (mut h, mut n2, mut x, mut o) = (fifo.device_handle(), n, exclusive, out.device_ptr());
                launch(&kern, 1, 1, &stream, &mut args![h, n2, x, o])?;
                stream.synchronize(timeout).map_err(e)?;
                if label == "timed" {
                    let ns = out.read_u64(0).map_err(e)? as f64;
                    row(format!(
                        "fifo push->pop, 1 GPU thread{how}: {:.3} us/trigger ({n} triggers; goal <= 0.85; MSCCL++ measured the same way on an H200: 0.89)",
                        ns / 1e3 / n as f64
                    ));
                }
            }
        }
        // What the push's parts cost (diagnostics; see the kernel): one thread, same loop.
        let kv = k("fifo_push_variant")?;
        let variants = (|| -> Result<Vec<f64>, String> {
            let mut us = Vec::new();
            for mode in 0..7i32 {
                let (mut h, mut n, mut md, mut o) = (fifo.device_handle(), 100_000i32, mode, out.device_ptr());
                launch(&kv, 1, 1, &stream, &mut args![h, n, md, o])?;
                stream.synchronize(timeout).map_err(e)?;
                us.push(out.read_u64(0).map_err(e)? as f64 / 1e3 / n as f64);
            }
            Ok(us)
        })();
        match variants {
            Ok(us) => row(format!(
                "fifo push->pop parts (diagnostics, us/trigger): the push {:.3}; push_relaxed (no release) {:.3}; \
                 with a gpu-scope fence {:.3}; position without the atomic on head {:.3}; push_batch of 8 {:.3}, \
                 of 32 {:.3} (one atomic and one fence a call); FifoExclusiveProducer::push_relaxed {:.3}",
                us[0], us[1], us[2], us[3], us[4], us[5], us[6]
            )),
            Err(x) => row(format!("fifo push->pop parts: failed: {x}")),
        }
        // The proxy load rows' producer (kernel `proxy_load`, one thread, signals) against this
        // bare pop loop instead of a proxy: whether a row is bound by the producer or the proxy.
        let kl = k("proxy_load")?;
        let producer = (|| -> Result<Vec<f64>, String> {
            let mut rates = Vec::new();
            for (batch, n) in [(1i32, 20_000i32), (32, 200_000), (-2, 200_000)] {
                let (mut h, mut t, mut op, mut sz, mut per, mut ms, mut b) = (
                    fifo.device_handle(),
                    crate::proxyload::LoadPeers::new(1),
                    2i32,
                    0u64,
                    n,
                    crate::proxyload::MAX_SPINS,
                    batch,
                );
                let t0 = Instant::now();
                launch(&kl, 1, 1, &stream, &mut args![h, t, op, sz, per, ms, b])?;
                stream.synchronize(timeout).map_err(e)?;
                rates.push(f64::from(n) / t0.elapsed().as_secs_f64() / 1e6);
            }
            Ok(rates)
        })();
        row(match producer {
            Ok(r) => format!(
                "proxy load rows' producer (1 thread, signals) against a bare pop loop: push {:.2} M/s, push_batch of 32 {:.2} M/s, \
                 FifoExclusiveProducer::push_relaxed {:.2} M/s",
                r[0], r[1], r[2]
            ),
            Err(x) => format!("proxy load rows' producer against a bare pop loop: failed: {x}"),
        });
        stop.store(true, Ordering::Relaxed);
        let _ = consumer.join();
    }

    if want(DevicePart::Channels) {
        channel_rows(args, dev, timeout, &k)?;
    }
    // 5. Whether the proxy's writes escape a hardware queue they share with a waiting kernel,
    // by stream priority (child processes with 1 and 32 queues; queues.rs).
    if want(DevicePart::Queues) {
        for r in crate::queues::probe_rows(dev) {
            row(r);
        }
    }
    // 6. The proxy under load: puts, putWithSignal and signals to 1/4/8 peers from 1 to 132 x 256
    // producers, over CUDA IPC and Ethernet, beside one host thread issuing the same calls.
    let transports: Vec<Transport> =
        [(DevicePart::LoadIpc, Transport::CudaIpc), (DevicePart::LoadEth, Transport::Ethernet)]
            .into_iter()
            .filter(|(p, _)| want(*p))
            .map(|(_, t)| t)
            .collect();
    if transports.is_empty() {
        return Ok(());
    }
    let us = |v: f64| Duration::from_secs_f64(v / 1e6);
    let mut config = mscclpp::device::ProxyConfig::default();
    if let Some(v) = args.signal_coalesce {
        config.signal_coalesce = us(v);
    }
    if let Some(v) = args.signal_pay_interval {
        config.signal_pay_interval = us(v);
    }
    if let Some(v) = args.signal_backlog_hold {
        config.signal_backlog_hold = us(v);
    }
    crate::proxyload::run(dev, &k("proxy_load")?, timeout, &config, &transports)
}

/// Sections 2 to 4: proxy throughput with no-op triggers, the PortChannel ping-pong and where
/// a hop's time goes, bandwidth; two ranks of this process over CUDA IPC.
fn channel_rows(
    args: &Args,
    dev: u32,
    timeout: Duration,
    k: &dyn Fn(&str) -> Result<Kernel, String>,
) -> Result<(), String> {
    let tns = timeout.as_nanos() as u64;
    // Two ranks for the rest.
    let max = args.max_bytes.clamp(1 << 10, 1 << 30) as usize;
    let mut ranks = two_ranks(dev, max, timeout)?;

    // 2. Proxy throughput with many producers (no-op triggers: flushes of an idle connection).
    {
        let r = &mut ranks[0];
        let mut proxy = ProxyService::new(r.comm.context(), dev, ProxyConfig::default()).map_err(e)?;
        let sem = proxy.add_semaphore(r.plain.take().ok_or("semaphore")?).map_err(e)?;
        proxy.start().map_err(e)?;
        let stream = Stream::new(dev).map_err(e)?;
        let kern = k("flood")?;
        let flood = |kern: &Kernel, proxy: &ProxyService, blocks: u32, threads: u32, per: i32| -> Result<f64, String> {
            let total = (blocks * threads) as u64 * per as u64;
            let before = proxy.processed();
            let (mut h, mut p, mut s) = (proxy.fifo().device_handle(), per, sem.0);
            let t0 = Instant::now();
            launch(kern, blocks, threads, &stream, &mut args![h, p, s])?;
            stream.synchronize(timeout).map_err(e)?;
            while proxy.processed() < before + total {
                if t0.elapsed() > timeout {
                    return Err("the proxy did not drain the FIFO".into());
                }
                std::hint::spin_loop();
            }
            Ok(t0.elapsed().as_secs_f64())
        };
        let configs = [(8u32, 32u32, 64i32), (16, 128, 64), (64, 256, 16), (128, 512, 4)];
        for (blocks, threads, per) in configs {
            let total = (blocks * threads) as u64 * per as u64;
            let el = flood(&kern, &proxy, blocks, threads, per)?;
            row(format!(
                "proxy throughput, {} producer threads, no-op triggers: {:.2} M triggers/s ({total} in {:.1} ms; goal >= 5)",
                blocks * threads,
                total as f64 / el / 1e6,
                el * 1e3
            ));
        }
        // MSCCL++'s push, where every waiter polls the host tail across PCIe, for comparison.
        let kp = k("flood_polling")?;
        for (blocks, threads, per) in [(16u32, 128u32, 64i32), (64, 256, 16)] {
            let total = (blocks * threads) as u64 * per as u64;
            let el = flood(&kp, &proxy, blocks, threads, per)?;
            row(format!(
                "proxy throughput, {} producer threads, MSCCL++'s polling push: {:.2} M triggers/s",
                blocks * threads,
                total as f64 / el / 1e6
            ));
        }
        proxy.stop().map_err(e)?;
    }

    // 3. PortChannel ping-pong next to the host-driven round trip; 4. bandwidth.
    let mut proxies = Vec::new();
    let mut chans = Vec::new();
    let mut srcs = Vec::new();
    for r in ranks.iter_mut() {
        let src = DeviceBuffer::new(r.comm.context(), dev, max, Transport::CudaIpc.into()).map_err(e)?;
        let mut proxy = ProxyService::new(r.comm.context(), dev, ProxyConfig::default()).map_err(e)?;
        let sem = proxy.add_semaphore(r.dev_sem.take().ok_or("semaphore")?).map_err(e)?;
        let dst = proxy.add_memory(r.remote.clone()).map_err(e)?;
        let s = proxy.add_memory(src.memory().clone()).map_err(e)?;
        chans.push(proxy.port_channel(sem, dst, s).map_err(e)?);
        proxies.push(proxy);
        srcs.push(src);
    }
    // Host-driven first (the proxies are not running yet, so nothing else uses the semaphores).
    {
        let n = 2000u64;
        let t0 = Instant::now();
        std::thread::scope(|sc| -> Result<(), String> {
            let hs: Vec<_> = (0..2)
                .map(|i| {
                    let (r, src) = (&ranks[i], &srcs[i]);
                    sc.spawn(move || -> Result<(), String> {
                        for k in 0..n {
                            if i == 1 {
                                host_wait(&r.host_sem, k + 1, timeout)?;
                            }
                            r.conn.write(&r.remote, 0, src.memory(), 0, 4).map_err(e)?;
                            r.host_sem.signal().map_err(e)?;
                            r.conn.flush(timeout).map_err(e)?;
                            if i == 0 {
                                host_wait(&r.host_sem, k + 1, timeout)?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in hs {
                h.join().map_err(|_| "a host ping-pong thread panicked".to_string())??;
            }
            Ok(())
        })?;
        let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        row(format!(
            "host-driven write 4 B + update_and_sync + flush, token polled by 8 B copies: {us:.2} us round trip"
        ));
        // The host's one-way cost alone: what a proxy-free host loop pays per signalled write.
        let r = &ranks[0];
        let t0 = Instant::now();
        for _ in 0..n {
            r.conn.write(&r.remote, 0, srcs[0].memory(), 0, 4).map_err(e)?;
            r.host_sem.signal().map_err(e)?;
            r.conn.flush(timeout).map_err(e)?;
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        row(format!("host-driven write 4 B + update_and_sync + flush, one way (no wait): {us:.2} us"));
        {
            // The host cost of one 4-byte CUDA IPC write call, alone and while another thread of
            // this process drives the other rank's connection (write, event, polls) as a proxy does.
            let time_writes = |busy: bool| -> Result<(f64, f64), String> {
                let stop = AtomicBool::new(false);
                std::thread::scope(|sc| -> Result<(f64, f64), String> {
                    let other = busy.then(|| {
                        let (r1, src1, stop) = (&ranks[1], &srcs[1], &stop);
                        sc.spawn(move || -> Result<(), String> {
                            while !stop.load(Ordering::Relaxed) {
                                r1.conn.write(&r1.remote, 0, src1.memory(), 0, 4).map_err(e)?;
                                let want = r1.conn.request_progress().map_err(e)?;
                                while r1.conn.progress().map_err(e)?.completed < want {}
                            }
                            Ok(())
                        })
                    });
                    let r = &ranks[0];
                    let (mut wsum, mut ssum) = (0.0, 0.0);
                    for _ in 0..n {
                        let t0 = Instant::now();
                        r.conn.write(&r.remote, 0, srcs[0].memory(), 0, 4).map_err(e)?;
                        let t1 = Instant::now();
                        r.host_sem.signal().map_err(e)?;
                        ssum += t1.elapsed().as_secs_f64();
                        wsum += (t1 - t0).as_secs_f64();
                        r.conn.flush(timeout).map_err(e)?;
                    }
                    stop.store(true, Ordering::Relaxed);
                    if let Some(h) = other {
                        h.join().map_err(|_| "the busy thread panicked".to_string())??;
                    }
                    Ok((wsum * 1e6 / n as f64, ssum * 1e6 / n as f64))
                })
            };
            let (w, s) = time_writes(false)?;
            let (wb, sb) = time_writes(true)?;
            row(format!(
                "host calls: CUDA IPC write 4 B {w:.2} us, update_and_sync {s:.2} us; with the other rank's connection busy: {wb:.2} / {sb:.2} us"
            ));
        }
        // The driver calls those are made of, and the batched copy a proxy could use instead.
        match mscclpp::bench::driver_call_costs(&srcs[0], &ranks[1].local, 4, 16, 20, 100) {
            Ok(costs) => {
                let list: Vec<String> = costs.iter().map(|(what, us)| format!("{what} {us:.2}")).collect();
                row(format!("driver calls, host us per call (one stream, 100 back to back): {}", list.join("; ")));
            }
            Err(x) => row(format!("driver calls: failed: {x}")),
        }
    }
    for p in proxies.iter_mut() {
        p.start().map_err(e)?;
    }
    let streams = [Stream::new(dev).map_err(e)?, Stream::new(dev).map_err(e)?];
    let outs: Vec<DeviceBuffer> = (0..2)
        .map(|i| DeviceBuffer::new(ranks[i].comm.context(), dev, 16, mscclpp::TransportFlags::NONE).map_err(e))
        .collect::<Result<_, _>>()?;
    {
        let (pk, qk) = (k("ping")?, k("pong")?);
        let (pk2, qk2) = (k("ping_noflush")?, k("pong_noflush")?);
        let pingpong_with = |n: i32, pk: &Kernel, qk: &Kernel| -> Result<f64, String> {
            for (i, kern) in [pk, qk].iter().enumerate() {
                clear(&outs[i])?;
                let (mut c, mut sz, mut n2, mut t, mut o) =
                    (chans[i].device_handle_ptr().ok_or("no device handle")?, 4u64, n, tns, outs[i].device_ptr());
                launch(kern, 1, 1, &streams[i], &mut args![c, sz, n2, t, o])?;
            }
            for s in &streams {
                s.synchronize(timeout).map_err(e)?;
            }
            elapsed_ns(&outs[1], "PortChannel pong")?;
            Ok(elapsed_ns(&outs[0], "PortChannel ping")? / 1e3 / n as f64)
        };
        let pingpong = |n: i32| pingpong_with(n, &pk, &qk);
        pingpong(100)?;
        let n = 10_000;
        let l0 = mscclpp::bench::linger_counts();
        let us = pingpong(n)?;
        let l1 = mscclpp::bench::linger_counts();
        // With MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US: how the hops' copies reached the GPU.
        let lingered = if l1 != l0 {
            format!(
                "; lingering copy kernels: {} launched, {} copies posted to one waiting, {} launched again",
                l1.launches - l0.launches,
                l1.posted - l0.posted,
                l1.relaunched - l0.relaunched
            )
        } else {
            String::new()
        };
        row(format!(
            "PortChannel ping-pong, putWithSignal 4 B + flush + wait, CUDA IPC: {us:.2} us round trip ({n} rounds; goal <= 19, MSCCL++ 19.0 on H200){lingered}"
        ));
        pingpong_with(100, &pk2, &qk2)?;
        let us = pingpong_with(n, &pk2, &qk2)?;
        row(format!("PortChannel ping-pong without a flush per round (one at the end): {us:.2} us round trip"));
        // Where a hop's time goes: the same ping-pong through instrumented proxies.
        let kernels =
            crate::stages::StageKernels { echo: &k("clock_echo")?, ping: &k("stage_ping")?, pong: &k("stage_pong")? };
        let mut sems = Vec::new();
        for r in ranks.iter_mut() {
            sems.push(r.stage_sem.take().ok_or("semaphore")?);
        }
        let mut stage_ranks = Vec::new();
        for ((r, src), sem) in ranks.iter().zip(&srcs).zip(sems) {
            stage_ranks.push(crate::stages::StageRank { conn: &r.conn, remote: &r.remote, src: src.memory(), sem });
        }
        let stage_ranks: [crate::stages::StageRank<'_>; 2] =
            stage_ranks.try_into().map_err(|_| "two ranks".to_string())?;
        // A diagnostic: its failure is reported and the remaining rows still run.
        if let Err(x) = crate::stages::run(dev, ranks[0].comm.context(), &kernels, stage_ranks, us, timeout) {
            row(format!("PortChannel hop stages: failed: {x}"));
        }
    }
    // 4. Bandwidth (rank 0 -> rank 1), next to cuMemcpyDtoDAsync between the same buffers.
    {
        let kern = k("put_bw")?;
        let mut size = 1usize << 10;
        row("PortChannel putWithSignal bandwidth (GB/s): size, ours, cuMemcpyDtoDAsync, ratio".into());
        while size <= max {
            // Enough bytes per measurement (8 GiB, 20 to 1000 puts) that the first push and the
            // last flush (tens of us) stay small next to the copies.
            let iters = ((8usize << 30) / size).clamp(20, 1000) as i32;
            let (mut c, mut sz, mut n, mut t, mut o) =
                (chans[0].device_handle_ptr().ok_or("no device handle")?, size as u64, 3i32, tns, outs[0].device_ptr());
            clear(&outs[0])?;
            launch(&kern, 1, 1, &streams[0], &mut args![c, sz, n, t, o])?;
            streams[0].synchronize(timeout).map_err(e)?;
            let mut best = f64::MAX;
            for _ in 0..3 {
                let mut n = iters;
                clear(&outs[0])?;
                launch(&kern, 1, 1, &streams[0], &mut args![c, sz, n, t, o])?;
                streams[0].synchronize(timeout).map_err(e)?;
                best = best.min(elapsed_ns(&outs[0], "PortChannel putWithSignal")? / 1e9);
            }
            let ours = size as f64 * iters as f64 / best / 1e9;
            let base =
                mscclpp::bench::baseline_copy(&[(&srcs[0], &ranks[1].local)], size, 3, iters as u64).map_err(e)?;
            let raw = size as f64 * iters as f64 / base.as_secs_f64() / 1e9;
            row(format!("{:>10}  {ours:9.2}  {raw:9.2}  {:.3}", human(size), ours / raw));
            size *= 4;
        }
        // What the signals cost: the same puts without them.
        let kp = k("put_only_bw")?;
        let size = max.min(64 << 20);
        let iters = ((8usize << 30) / size).clamp(20, 1000) as i32;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let (mut c, mut sz, mut n, mut t, mut o) = (
                chans[0].device_handle_ptr().ok_or("no device handle")?,
                size as u64,
                iters,
                tns,
                outs[0].device_ptr(),
            );
            clear(&outs[0])?;
            launch(&kp, 1, 1, &streams[0], &mut args![c, sz, n, t, o])?;
            streams[0].synchronize(timeout).map_err(e)?;
            best = best.min(elapsed_ns(&outs[0], "PortChannel put")? / 1e9);
        }
        let base = mscclpp::bench::baseline_copy(&[(&srcs[0], &ranks[1].local)], size, 3, iters as u64).map_err(e)?;
        let (ours, raw) = (size as f64 * iters as f64 / best, size as f64 * iters as f64 / base.as_secs_f64());
        row(format!(
            "{:>10}  {:9.2}  {:9.2}  {:.3}  (put without signals)",
            human(size),
            ours / 1e9,
            raw / 1e9,
            ours / raw
        ));
    }
    for mut p in proxies {
        p.stop().map_err(e)?;
    }
    drop(ranks);
    Ok(())
}

/// Polls the GPU token with 8-byte copies until it reaches `want`.
fn host_wait(sem: &Host2DeviceSemaphore, want: u64, timeout: Duration) -> Result<(), String> {
    let t0 = Instant::now();
    while sem.inbound_token().map_err(e)? < want {
        if t0.elapsed() > timeout {
            return Err(format!("host ping-pong: token below {want} after {timeout:?}"));
        }
    }
    Ok(())
}
