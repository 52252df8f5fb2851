//! Kernels that communicate (GPU machine, `--ignored`): kernels compiled at run time with NVRTC
//! push put/signal/flush through a `ProxyService` and wait on device semaphores. Correctness
//! across processes uses two processes (they time-slice the one GPU: few round trips per test);
//! the same-process test uses two ranks in one process on two streams.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gpu::{Pair, args, gpu_for, kernel, launch, module, pair, read, results};
use common::{Rank, spawn_ranks};
use mscclpp::device::fifo::Fifo;
use mscclpp::device::proxy::{PROXY_FAILED, ProxyConfig, ProxyService};
use mscclpp::device::trigger::{Put, Request, decode};
use mscclpp::gpu::Stream;
use mscclpp::{Bootstrap, Device, DeviceBuffer, EndpointConfig, RootServer, TcpBootstrap, Transport};

const T: Duration = Duration::from_secs(60);

const KERNELS: &str = r#"
#include "mscclpp_rs/device.cuh"
typedef unsigned long long u64;

__device__ unsigned char pat(u64 m, u64 i) { return (unsigned char)((i * 131u + m * 7u + (i >> 9)) & 0xff); }
__device__ u64 msg_size(u64 m, u64 chunk) { return 1 + (m * 7919u) % chunk; }
// Message m's offset in the sender's buffer (slot m % slots).
__device__ u64 msg_off(u64 m, int slots, u64 chunk) { return (m % slots) * chunk; }
// The block writes message m's pattern into its slot of src.
__device__ void fill_msg(unsigned char* src, u64 m, int slots, u64 chunk) {
  u64 off = msg_off(m, slots, chunk), size = msg_size(m, chunk);
  for (u64 i = threadIdx.x; i < size; i += blockDim.x) src[off + i] = pat(m, i);
}

// Message m (in slot m % slots): fill src with pat(m), putWithSignal; flush every 4th and at the
// end. result[0]: flushes that returned false (timeout or proxy error: the kernel then stops).
extern "C" __global__ void sender(mscclpp::PortChannelDeviceHandle* ch, unsigned char* src, int n, int slots,
                                  u64 chunk, u64 timeout_ns, u64* result) {
  __shared__ int stop;
  if (threadIdx.x == 0) stop = 0;
  for (int m = 0; m < n; ++m) {
    fill_msg(src, m, slots, chunk);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      ch->putWithSignal(msg_off(m, slots, chunk), msg_size(m, chunk));
      if ((m % 4 == 3 || m == n - 1) && !ch->flush_for(timeout_ns)) { result[0]++; stop = 1; }
    }
    __syncthreads();
    if (stop) return;
  }
}

// `sender` with `push_relaxed` (FifoDeviceHandle): messages go in groups of 4; the block fills all
// four, synchronizes, and thread 0 makes one __threadfence_system() for the group, then pushes
// its four putWithSignal triggers relaxed and flushes. result[0] as in `sender`.
extern "C" __global__ void sender_relaxed(mscclpp::PortChannelDeviceHandle* ch, unsigned char* src, int n, int slots,
                                          u64 chunk, u64 timeout_ns, u64* result) {
  __shared__ int stop;
  if (threadIdx.x == 0) stop = 0;
  for (int g = 0; g < n; g += 4) {
    const int end = g + 4 < n ? g + 4 : n;
    for (int m = g; m < end; ++m) fill_msg(src, m, slots, chunk);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      for (int m = g; m < end; ++m) {
        u64 off = msg_off(m, slots, chunk);
        ch->fifo_.push_relaxed(ch->put_with_signal_trigger(off, off, msg_size(m, chunk)));
      }
      if (!ch->flush_for(timeout_ns)) { result[0]++; stop = 1; }
    }
    __syncthreads();
    if (stop) return;
  }
}

// `sender_relaxed` through a FifoExclusiveProducer: thread 0 is the only producer, so after the
// group's one fence it pushes the group's triggers without the atomic on head (the first with
// `push`, the rest with `push_relaxed`, the last with `push_relaxed_for`), then flushes through
// the handle; a new producer for each group (the flush's push went through the handle).
extern "C" __global__ void sender_exclusive(mscclpp::PortChannelDeviceHandle* ch, unsigned char* src, int n,
                                            int slots, u64 chunk, u64 timeout_ns, u64* result) {
  __shared__ int stop;
  if (threadIdx.x == 0) stop = 0;
  for (int g = 0; g < n; g += 4) {
    const int end = g + 4 < n ? g + 4 : n;
    for (int m = g; m < end; ++m) fill_msg(src, m, slots, chunk);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      mscclpp::FifoExclusiveProducer sole(ch->fifo_);
      for (int m = g; m < end; ++m) {
        u64 off = msg_off(m, slots, chunk);
        mscclpp::ProxyTrigger t = ch->put_with_signal_trigger(off, off, msg_size(m, chunk));
        if (m == g) {
          sole.push(t);
        } else if (m + 1 < end) {
          sole.push_relaxed(t);
        } else if (!sole.push_relaxed_for(t, timeout_ns)) {
          result[0]++;
          stop = 1;
        }
      }
      if (!stop && !ch->flush_for(timeout_ns)) { result[0]++; stop = 1; }
    }
    __syncthreads();
    if (stop) return;
  }
}

// Trigger i of the exclusive-producer tests: a put whose dstOffset is i.
__device__ mscclpp::ProxyTrigger numbered(u64 i) { return mscclpp::ProxyTrigger(mscclpp::TriggerData, 0, i, 0, 0, 1, 0); }

// One thread, the FIFO's only producer, fills the ring (nobody pops meanwhile) with triggers
// 0..size-1, each pushing method in turn; then one push_for and one push_relaxed_for, each with
// a 2 ms limit, must time out. out = (push_for, push_relaxed_for, position afterwards).
extern "C" __global__ void exclusive_fill(mscclpp::FifoDeviceHandle fifo, u64* out) {
  mscclpp::FifoExclusiveProducer sole(fifo);
  __threadfence_system();
  for (u64 i = 0; i < (u64)fifo.size; ++i) {
    switch (i % 4) {
      case 0: sole.push(numbered(i)); break;
      case 1: sole.push_relaxed(numbered(i)); break;
      case 2: sole.push_for(numbered(i), 1000000000ull); break;
      default: sole.push_relaxed_for(numbered(i), 1000000000ull); break;
    }
  }
  out[0] = sole.push_for(numbered(999999), 2000000);
  out[1] = sole.push_relaxed_for(numbered(999999), 2000000);
  out[2] = sole.position();
}

// One thread pushes triggers first..first+n-1 through a FifoExclusiveProducer (each method in
// turn) while the host pops, then one more (first + n) through the handle, whose position must
// follow theirs: out = (the producer's position afterwards, the handle push's position).
extern "C" __global__ void exclusive_pushes(mscclpp::FifoDeviceHandle fifo, u64 first, int n, u64* out) {
  mscclpp::FifoExclusiveProducer sole(fifo);
  __threadfence_system();
  for (int k = 0; k < n; ++k) {
    const u64 i = first + (u64)k;
    switch (k % 4) {
      case 0: sole.push(numbered(i)); break;
      case 1: sole.push_relaxed(numbered(i)); break;
      case 2: sole.push_for(numbered(i), 10000000000ull); break;
      default: sole.push_relaxed_for(numbered(i), 10000000000ull); break;
    }
  }
  out[0] = sole.position();
  out[1] = fifo.push(numbered(first + (u64)n));
}

// A broken contract: every thread of the block makes a FifoExclusiveProducer of the same FIFO
// and pushes `per_thread` triggers, waiting for free slots without a spin limit (so only the
// producers' check of head can end the kernel: nobody pops).
extern "C" __global__ void exclusive_shared(mscclpp::FifoDeviceHandle fifo, int per_thread) {
  mscclpp::FifoExclusiveProducer sole(fifo);
  for (int k = 0; k < per_thread; ++k) sole.push(numbered((u64)threadIdx.x * 1000 + (u64)k), -1);
}

// Waits for each message, then checks every byte. result[0]: wrong bytes, result[1]: waits that
// timed out (the kernel then stops), result[2]: messages checked.
extern "C" __global__ void receiver(mscclpp::Host2DeviceSemaphoreDeviceHandle sem, const unsigned char* dst, int n,
                                    u64 chunk, u64 timeout_ns, u64* result) {
  __shared__ int ok;
  for (int m = 0; m < n; ++m) {
    if (threadIdx.x == 0) {
      ok = sem.wait_for(timeout_ns);
      if (!ok) result[1]++;
    }
    __syncthreads();
    if (!ok) return;
    u64 off = (u64)m * chunk, size = msg_size(m, chunk);
    u64 bad = 0;
    for (u64 i = threadIdx.x; i < size; i += blockDim.x) bad += (((volatile const unsigned char*)dst)[off + i] != pat(m, i));
    if (bad) atomicAdd(&result[0], bad);
    if (threadIdx.x == 0) result[2]++;
    __syncthreads();
  }
}

// One wait_for on a semaphore nobody signals: result[0] = its return value, result[1] = elapsed ns.
extern "C" __global__ void lone_wait(mscclpp::Host2DeviceSemaphoreDeviceHandle sem, u64 timeout_ns, u64* result) {
  u64 t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  bool r = sem.wait_for(timeout_ns);
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  result[0] = r;
  result[1] = t1 - t0;
}

// Every thread of every block pushes `per_thread` triggers carrying (global thread id, k).
extern "C" __global__ void producers(mscclpp::FifoDeviceHandle fifo, int per_thread) {
  u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  for (int k = 0; k < per_thread; ++k) {
    fifo.push(mscclpp::ProxyTrigger(mscclpp::TriggerData, 0, tid, 0, (u64)k, 1, 0));
  }
}

// Rank A of a ping-pong: n rounds of putWithSignal + flush, then wait for the echo and check it.
// result[0]: bad echoes, result[1]: timeouts.
extern "C" __global__ void ping(mscclpp::PortChannelDeviceHandle* ch, unsigned int* src, const unsigned int* dst,
                                int n, u64 timeout_ns, u64* result) {
  for (int i = 0; i < n; ++i) {
    src[0] = 1000 + i;
    __threadfence_system();
    ch->putWithSignal(0, 4);
    if (!ch->flush_for(timeout_ns) || !ch->wait_for(timeout_ns)) { result[1]++; return; }
    if (((volatile const unsigned int*)dst)[0] != 2000 + i) result[0]++;
  }
}

// Rank B: wait, check, answer.
extern "C" __global__ void pong(mscclpp::PortChannelDeviceHandle* ch, unsigned int* src, const unsigned int* dst,
                                int n, u64 timeout_ns, u64* result) {
  for (int i = 0; i < n; ++i) {
    if (!ch->wait_for(timeout_ns)) { result[1]++; return; }
    if (((volatile const unsigned int*)dst)[0] != 1000 + i) result[0]++;
    src[0] = 2000 + i;
    __threadfence_system();
    ch->putWithSignal(0, 4);
    if (!ch->flush_for(timeout_ns)) { result[1]++; return; }
  }
}

// Fills every SM; block 0 pushes an atomicAdd (refused over CUDA IPC), then every block waits
// (bounded) for the proxy's error word. result[0]: blocks that saw the error.
extern "C" __global__ void occupy_and_atomic_add(mscclpp::PortChannelDeviceHandle* ch, u64 timeout_ns, u64* result) {
  __shared__ int seen;
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) ch->atomicAdd(0, 5);
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    seen = 0;
    do {
      if (ch->fifo_.proxy_error() != 0) { seen = 1; break; }
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < timeout_ns);
    if (seen) atomicAdd(&result[0], 1ull);
  }
  __syncthreads();
}

// Every block's thread 0 watches the token at `inbound` (without consuming it) until it passes
// `start` or `timeout_ns` elapse; the block's other threads wait at the barrier, so the grid
// keeps its SMs. result[0]: blocks that saw the token, result[1]: blocks that did not.
extern "C" __global__ void hold_gpu_watching(const u64* inbound, u64 start, u64 timeout_ns, u64* result) {
  if (threadIdx.x == 0) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    bool seen = false;
    do {
      if (*(volatile const u64*)inbound > start) { seen = true; break; }
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < timeout_ns);
    atomicAdd(&result[seen ? 0 : 1], 1ull);
  }
  __syncthreads();
}

// A trigger naming a semaphore that does not exist, then a bounded wait that must return early.
extern "C" __global__ void bad_trigger(mscclpp::PortChannelDeviceHandle* ch, u64 timeout_ns, u64* result) {
  ch->fifo_.push(mscclpp::ProxyTrigger(mscclpp::TriggerFlag, 0, 0, 0, 0, 0, 1000));
  result[0] = ch->wait_for(timeout_ns);
  result[1] = ch->fifo_.proxy_error();
}
"#;

fn cfg(t: Transport, dev: u32) -> EndpointConfig {
    let c = EndpointConfig::new(t).device(Device::Gpu(dev));
    if t == Transport::Ethernet { c.ethernet_interface("127.0.0.1") } else { c }
}

const MSGS: i32 = 24;
const CHUNK: u64 = 64 << 10;
const TIMEOUT_NS: u64 = 30_000_000_000;

/// The two-process transfer test `name`: in a rank, `transfer_with(t, sender)`; otherwise
/// starts both ranks with `env` and checks that they succeed.
fn transfer_test(name: &str, t: Transport, sender: &str, env: &[(&str, String)]) {
    if let Some(r) = Rank::from_env() {
        return transfer_with(&r, t, sender);
    }
    spawn_ranks(name, 2, env).assert_success();
}

/// Rank 0's kernel `sender` (`sender`, `sender_relaxed` or `sender_exclusive`) puts 24 messages
/// (1 B .. 64 KiB) with signals and flushes through its proxy; rank 1's kernel waits for each on
/// the device and checks every byte.
fn transfer_with(r: &Rank, t: Transport, sender: &str) {
    let dev = gpu_for(r.rank);
    let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
    let p = pair(bs, r.rank, cfg(t, dev), (MSGS as u64 * CHUNK) as usize);
    let m = module(KERNELS, dev);
    let stream = Stream::new(dev).unwrap();
    let res = results(4, p.comm.context(), dev);
    let (mut n, mut chunk, mut tmo, mut resp) = (MSGS, CHUNK, TIMEOUT_NS, res.device_ptr());
    if r.rank == 0 {
        let src = DeviceBuffer::new(p.comm.context(), dev, p.local.len(), t.into()).unwrap();
        let mut proxy = ProxyService::new(p.comm.context(), dev, ProxyConfig::default()).unwrap();
        let sem = proxy.add_semaphore(p.sem).unwrap();
        let dst = proxy.add_memory(p.remote.clone()).unwrap();
        let s = proxy.add_memory(src.memory().clone()).unwrap();
        let ch = proxy.port_channel(sem, dst, s).unwrap();
        proxy.start().unwrap();
        let (mut chp, mut srcp) = (ch.device_handle_ptr().unwrap(), src.device_ptr());
        let mut slots = MSGS;
        launch(&kernel(&m, sender), 1, 256, &stream, &mut args![chp, srcp, n, slots, chunk, tmo, resp]);
        stream.synchronize(T).unwrap();
        assert_eq!(read(&res, 0), 0, "flushes that failed");
        proxy.stop().unwrap();
        p.bs.barrier().unwrap();
    } else {
        let mut h = p.sem.device_handle();
        let mut dstp = p.local.device_ptr();
        launch(&kernel(&m, "receiver"), 1, 256, &stream, &mut args![h, dstp, n, chunk, tmo, resp]);
        stream.synchronize(T).unwrap();
        let (bad, timeouts, checked) = (read(&res, 0), read(&res, 1), read(&res, 2));
        println!("RESULT {t}: {checked} messages checked on the device, {bad} wrong bytes, {timeouts} timeouts");
        assert_eq!((bad, timeouts, checked), (0, 0, MSGS as u64));
        p.bs.barrier().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_over_cuda_ipc() {
    transfer_test("port_channel_over_cuda_ipc", Transport::CudaIpc, "sender", &[]);
}

/// The same over CUDA IPC with kernel copies (`MSCCLPP_CUDAIPC_KERNEL_COPY_MAX=65536`, read from
/// the environment): every message (1 B .. 64 KiB, aligned and not) is one kernel that copies
/// and then writes the token, and the receiving kernel checks every byte after each signal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_over_cuda_ipc_kernel_copies() {
    transfer_test(
        "port_channel_over_cuda_ipc_kernel_copies",
        Transport::CudaIpc,
        "sender",
        &[("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX", "65536".into())],
    );
}

/// The same with the copy kernel lingering 200 us after each copy
/// (`MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US`): the proxy posts each putWithSignal to the waiting
/// kernel through pinned memory, and the receiving kernel checks every byte after each signal.
#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_over_cuda_ipc_lingering_kernel_copies() {
    transfer_test(
        "port_channel_over_cuda_ipc_lingering_kernel_copies",
        Transport::CudaIpc,
        "sender",
        &[("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX", "65536".into()), ("MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US", "200".into())],
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_over_ethernet_gpu_memory() {
    transfer_test("port_channel_over_ethernet_gpu_memory", Transport::Ethernet, "sender", &[]);
}

/// `push_relaxed` through a PortChannel over CUDA IPC: the sending kernel writes four messages,
/// makes one `__threadfence_system()` and pushes their four putWithSignal triggers relaxed; the
/// receiving kernel checks every byte after each signal (a put that overtook its data would copy
/// stale bytes).
#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_relaxed_pushes_over_cuda_ipc() {
    transfer_test("port_channel_relaxed_pushes_over_cuda_ipc", Transport::CudaIpc, "sender_relaxed", &[]);
}

/// The same over Ethernet from GPU memory (the sender stages each put's source with a copy
/// from the GPU after it pops the trigger).
#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_relaxed_pushes_over_ethernet_gpu_memory() {
    transfer_test("port_channel_relaxed_pushes_over_ethernet_gpu_memory", Transport::Ethernet, "sender_relaxed", &[]);
}

/// `FifoExclusiveProducer` through a PortChannel over CUDA IPC: as the relaxed test, the sending
/// thread being the FIFO's only producer (every pushing method of the producer; a flush through
/// the handle and a new producer after each group of four).
#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_exclusive_pushes_over_cuda_ipc() {
    transfer_test("port_channel_exclusive_pushes_over_cuda_ipc", Transport::CudaIpc, "sender_exclusive", &[]);
}

/// The same over Ethernet from GPU memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_exclusive_pushes_over_ethernet_gpu_memory() {
    transfer_test(
        "port_channel_exclusive_pushes_over_ethernet_gpu_memory",
        Transport::Ethernet,
        "sender_exclusive",
        &[],
    );
}

/// Pops `n` triggers from `fifo` (bounded by `T`), each a put handed to `each`.
fn pop_puts(fifo: &Fifo, n: usize, mut each: impl FnMut(&Put)) {
    let t0 = Instant::now();
    let mut got = 0;
    while got < n {
        match fifo.poll() {
            Some(t) => {
                let req = decode(t).expect("a trigger pushed by the kernel decodes");
                let Request::Ops { put: Some(p), .. } = req else {
                    panic!("unexpected request {req:?}");
                };
                each(&p);
                fifo.pop();
                got += 1;
            }
            None => assert!(t0.elapsed() < T, "only {got} of {n} triggers arrived"),
        }
    }
}

/// Pops `n` triggers from `fifo`: each must be trigger `first + k` (its `dstOffset`), in order.
fn pop_numbered(fifo: &Fifo, first: u64, n: u64) {
    let mut want = first;
    pop_puts(fifo, n as usize, |p| {
        assert_eq!(u64::from(p.dst_off), want, "trigger at position {want}");
        want += 1;
    });
}

/// One GPU thread as a FIFO's only producer (`FifoExclusiveProducer`, every pushing method in
/// turn): on a full ring nobody pops, its time-limited pushes return false and push nothing; then
/// 20,000 triggers through 16 slots (1250 laps) while the host pops, each exactly once and in
/// order; and a push through the handle afterwards takes the next position (the producer kept
/// `head` right).
#[test]
#[ignore = "needs a CUDA GPU"]
fn exclusive_producer_wraps_times_out_and_keeps_head() {
    const SLOTS: u64 = 16;
    let ctx = mscclpp::Context::new();
    let fifo = Fifo::new(&ctx, 0, SLOTS as u32).unwrap();
    let m = module(KERNELS, 0);
    let stream = Stream::new(0).unwrap();
    let res = results(3, &ctx, 0);
    let (mut h, mut resp) = (fifo.device_handle(), res.device_ptr());
    launch(&kernel(&m, "exclusive_fill"), 1, 1, &stream, &mut args![h, resp]);
    stream.synchronize(T).unwrap();
    assert_eq!((read(&res, 0), read(&res, 1), read(&res, 2)), (0, 0, SLOTS), "pushes on a full ring");
    pop_numbered(&fifo, 0, SLOTS);
    assert!(fifo.poll().is_none(), "a timed-out push left a trigger");

    let n = 20_000i32;
    let (mut first, mut count) = (SLOTS, n);
    let t0 = Instant::now();
    launch(&kernel(&m, "exclusive_pushes"), 1, 1, &stream, &mut args![h, first, count, resp]);
    pop_numbered(&fifo, SLOTS, n as u64 + 1);
    stream.synchronize(T).unwrap();
    let end = SLOTS + n as u64;
    assert_eq!((read(&res, 0), read(&res, 1)), (end, end), "the producer's count and the handle's next position");
    assert!(fifo.poll().is_none());
    println!(
        "RESULT exclusive producer: {SLOTS} pushes filled the ring, 2 timed-out pushes pushed nothing; \
         {n} more through {SLOTS} slots in {:?}, then the handle's push at position {end}",
        t0.elapsed()
    );
}

/// A broken contract traps: 32 threads each make a `FifoExclusiveProducer` of one 16-slot FIFO
/// (in a child process: the trap ends its CUDA context) and push 64 triggers each, nobody
/// popping and no spin limit: the kernel must end with a CUDA error (the check of `head`), not
/// hang until the stream's limit (a `Timeout`) or end well having lost triggers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn exclusive_producers_sharing_a_fifo_trap() {
    if Rank::from_env().is_some() {
        let ctx = mscclpp::Context::new();
        let fifo = Fifo::new(&ctx, 0, 16).unwrap();
        let m = module(KERNELS, 0);
        let stream = Stream::new(0).unwrap();
        let (mut h, mut per) = (fifo.device_handle(), 64i32);
        launch(&kernel(&m, "exclusive_shared"), 1, 32, &stream, &mut args![h, per]);
        // Nobody pops: without the check, 32 producers would fill the ring and wait for slots
        // until their spin limit.
        let t0 = Instant::now();
        let r = stream.synchronize(T);
        println!("RESULT shared exclusive producers: the kernel ended after {:?} with {r:?}", t0.elapsed());
        let e = r.expect_err("the kernel must trap");
        assert_eq!(e.kind(), mscclpp::ErrorKind::Cuda, "a trap, not a wait that ran out: {e}");
        println!("CHECKED");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }
    // The child joins no bootstrap: the root gives up on it after a second.
    let job = common::spawn_some(
        "exclusive_producers_sharing_a_fifo_trap",
        1,
        &[0],
        Duration::from_secs(1),
        &[],
        Duration::from_secs(120),
    );
    let out = job.assert_rank_success(0);
    job.relay_results();
    assert!(out.contains("\nCHECKED"), "the child never reached the check of its error:\n{out}");
}

/// A wait nobody signals returns false, after (not before) its limit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn wait_for_times_out_with_false() {
    let ctx = mscclpp::Context::new();
    let token = results(1, &ctx, 0);
    let expected = results(1, &ctx, 0);
    let res = results(2, &ctx, 0);
    let mut h = mscclpp::Host2DeviceSemaphoreDeviceHandle {
        inbound_token: token.device_ptr(),
        expected_inbound_token: expected.device_ptr(),
    };
    let (mut tmo, mut resp) = (50_000_000u64, res.device_ptr());
    let m = module(KERNELS, 0);
    let stream = Stream::new(0).unwrap();
    launch(&kernel(&m, "lone_wait"), 1, 1, &stream, &mut args![h, tmo, resp]);
    stream.synchronize(T).unwrap();
    let (ret, ns) = (read(&res, 0), read(&res, 1));
    println!("RESULT wait_for(50 ms) returned {ret} after {:.3} ms (device clock)", ns as f64 / 1e6);
    assert_eq!(ret, 0, "nobody signalled");
    assert!(ns >= tmo, "returned after {ns} ns, before its {tmo} ns limit");
    assert_eq!(expected.read_u64(0).unwrap(), 0, "a timed-out wait gives its expected count back");
}

/// Rank 1 dies (SIGKILL) while rank 0's kernel streams puts to it over Ethernet: rank 0's proxy
/// records the transport's error, and the kernel's flushes and a second block's wait return.
#[test]
#[ignore = "needs a CUDA GPU"]
fn peer_killed_mid_run_releases_device_waiters() {
    if let Some(r) = Rank::from_env() {
        let dev = gpu_for(r.rank);
        let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
        let p = pair(bs, r.rank, cfg(Transport::Ethernet, dev), (MSGS as u64 * CHUNK) as usize);
        // Rank 0 says when its kernels run (the sender has far more to send than can go).
        const RUNNING: u64 = 5;
        if r.rank == 1 {
            p.bs.barrier().unwrap();
            p.bs.recv(0, RUNNING).unwrap();
            common::die();
        }
        let src = DeviceBuffer::new(p.comm.context(), dev, p.local.len(), Transport::Ethernet.into()).unwrap();
        let mut proxy = ProxyService::new(p.comm.context(), dev, ProxyConfig::default()).unwrap();
        let sem = proxy.add_semaphore(p.sem).unwrap();
        let dst = proxy.add_memory(p.remote.clone()).unwrap();
        let s = proxy.add_memory(src.memory().clone()).unwrap();
        let ch = proxy.port_channel(sem, dst, s).unwrap();
        proxy.start().unwrap();
        p.bs.barrier().unwrap();
        let m = module(KERNELS, dev);
        let (send_s, wait_s) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
        let (res, res2) = (results(4, p.comm.context(), dev), results(2, p.comm.context(), dev));
        // Far more messages than can go before the peer dies.
        let (mut chp, mut srcp, mut n, mut chunk, mut tmo) =
            (ch.device_handle_ptr().unwrap(), src.device_ptr(), 1_000_000i32, CHUNK, TIMEOUT_NS);
        let mut resp = res.device_ptr();
        let mut resp2 = res2.device_ptr();
        let t0 = Instant::now();
        // The waiter: one ping round flushes its put, then waits for an echo that never comes.
        let mut one = 1i32;
        let (mut s2, mut d2) = (src.device_ptr(), p.local.device_ptr());
        launch(&kernel(&m, "ping"), 1, 1, &wait_s, &mut args![chp, s2, d2, one, tmo, resp2]);
        let mut slots = MSGS;
        launch(&kernel(&m, "sender"), 1, 256, &send_s, &mut args![chp, srcp, n, slots, chunk, tmo, resp]);
        p.bs.send(1, RUNNING, &[]).unwrap();
        send_s.synchronize(T).unwrap();
        wait_s.synchronize(T).unwrap();
        let e = proxy.status().unwrap_err();
        println!("RESULT after the peer was killed: kernels returned in {:?}; proxy error: {e}", t0.elapsed());
        assert_eq!(proxy.fifo().proxy_error(), PROXY_FAILED);
        assert!(read(&res, 0) > 0, "the sender's flushes must have returned false");
        assert_eq!(read(&res2, 1), 1, "the waiter returned through its failure path");
        assert!(proxy.stop().is_err());
        std::process::exit(0);
    }
    let job =
        common::spawn_some("peer_killed_mid_run_releases_device_waiters", 2, &[0, 1], T, &[], Duration::from_secs(150));
    job.assert_rank_success(0);
    job.relay_results();
}

/// 64 blocks x 128 threads push 4 triggers each (32768 triggers, 64 laps of a 512-slot ring)
/// with the device protocol; a host consumer pops them all: each (thread, k) exactly once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fifo_wraps_with_many_gpu_producers() {
    let ctx = mscclpp::Context::new();
    let fifo = Fifo::new(&ctx, 0, 512).unwrap();
    let m = module(KERNELS, 0);
    let stream = Stream::new(0).unwrap();
    let (blocks, threads, per) = (64u32, 128u32, 4i32);
    let mut h = fifo.device_handle();
    let mut per_thread = per;
    launch(&kernel(&m, "producers"), blocks, threads, &stream, &mut args![h, per_thread]);
    let total = (blocks * threads) as usize * per as usize;
    let mut seen = vec![0u8; total];
    let t0 = Instant::now();
    pop_puts(&fifo, total, |p| {
        let idx = p.dst_off as usize * per as usize + p.src_off as usize;
        assert!(idx < total, "put {p:?} out of range");
        seen[idx] += 1;
    });
    stream.synchronize(T).unwrap();
    assert!(seen.iter().all(|&c| c == 1), "a trigger was lost or duplicated");
    assert!(fifo.poll().is_none());
    println!(
        "RESULT FIFO: {total} triggers from {} GPU threads through 512 slots in {:?}",
        blocks * threads,
        t0.elapsed()
    );
}

/// Two ranks of one process (threads, loopback bootstrap, one GPU, two streams) connected over
/// CUDA IPC with PortChannels.
struct Local {
    pairs: Vec<Pair>,
}

fn local_pairs(t: Transport) -> Local {
    local_pairs_with(cfg(t, 0))
}

fn local_pairs_with(c: EndpointConfig) -> Local {
    let (root, id) = RootServer::start(2, T).unwrap();
    let pairs = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (id, c) = (id.clone(), c.clone());
                sc.spawn(move || {
                    let bs: Arc<dyn Bootstrap> =
                        Arc::new(TcpBootstrap::config(rank, 2).timeout(T).initialize(&id).unwrap());
                    pair(bs, rank, c, 1 << 20)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    drop(root);
    Local { pairs }
}

/// Same-process peers: 200 device ping-pong rounds over CUDA IPC, each echo checked; then an
/// atomicAdd trigger over CUDA IPC while a kernel occupies every SM is refused with an error
/// pointing to MemoryChannel, and every block sees it; then a bad trigger in another service on
/// the same GPU is an error, and its kernel's wait returns.
#[test]
#[ignore = "needs a CUDA GPU"]
fn same_process_ping_pong_and_refused_requests() {
    let l = local_pairs(Transport::CudaIpc);
    let m = module(KERNELS, 0);
    let mut proxies = Vec::new();
    let mut chans = Vec::new();
    let mut srcs = Vec::new();
    for p in l.pairs {
        let src = DeviceBuffer::new(p.comm.context(), 0, 4096, Transport::CudaIpc.into()).unwrap();
        let mut proxy = ProxyService::new(p.comm.context(), 0, ProxyConfig::default()).unwrap();
        let sem = proxy.add_semaphore(p.sem).unwrap();
        let dst = proxy.add_memory(p.remote.clone()).unwrap();
        let s = proxy.add_memory(src.memory().clone()).unwrap();
        chans.push(proxy.port_channel(sem, dst, s).unwrap());
        proxy.start().unwrap();
        proxies.push((proxy, p.local, p.comm));
        srcs.push(src);
    }
    assert_eq!(mscclpp::bench::ipc_mapped_count(), 0, "same-process peers use the pointer, not an IPC mapping");
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let res: Vec<_> = (0..2).map(|i| results(2, proxies[i].2.context(), 0)).collect();
    let (mut n, mut tmo) = (200i32, TIMEOUT_NS);
    for (i, name) in ["ping", "pong"].iter().enumerate() {
        let (mut chp, mut s, mut d, mut r) = (
            chans[i].device_handle_ptr().unwrap(),
            srcs[i].device_ptr(),
            proxies[i].1.device_ptr(),
            res[i].device_ptr(),
        );
        launch(&kernel(&m, name), 1, 1, &streams[i], &mut args![chp, s, d, n, tmo, r]);
    }
    let t0 = Instant::now();
    for s in &streams {
        s.synchronize(T).unwrap();
    }
    let el = t0.elapsed();
    for (i, r) in res.iter().enumerate() {
        assert_eq!((read(r, 0), read(r, 1)), (0, 0), "rank {i}: bad echoes, timeouts");
    }
    println!(
        "RESULT same-process ping-pong: 200 rounds in {el:?} ({:.2} us/round incl. launch)",
        el.as_secs_f64() * 1e6 / 200.0
    );

    // atomicAdd over CUDA IPC with every SM busy.
    let occ = results(1, proxies[0].2.context(), 0);
    let (mut chp, mut tmo10, mut r) = (chans[0].device_handle_ptr().unwrap(), 10_000_000_000u64, occ.device_ptr());
    let blocks = 1024u32;
    launch(&kernel(&m, "occupy_and_atomic_add"), blocks, 256, &streams[0], &mut args![chp, tmo10, r]);
    streams[0].synchronize(T).unwrap();
    let e = proxies[0].0.status().unwrap_err();
    println!("RESULT atomicAdd over CUDA IPC: {} of {blocks} blocks saw the error; {e}", read(&occ, 0));
    assert!(e.to_string().contains("MemoryChannel"), "{e}");
    assert_eq!(read(&occ, 0), blocks as u64, "every block must see the proxy's error");
    assert!(proxies[0].0.stop().is_err());

    // A bad trigger, in a second service on the same GPU (rank 1's).
    let bad = results(2, proxies[1].2.context(), 0);
    let (mut chp, mut r) = (chans[1].device_handle_ptr().unwrap(), bad.device_ptr());
    launch(&kernel(&m, "bad_trigger"), 1, 1, &streams[1], &mut args![chp, tmo, r]);
    streams[1].synchronize(T).unwrap();
    assert_eq!((read(&bad, 0), read(&bad, 1)), (0, PROXY_FAILED), "wait_for returns false on the proxy's error");
    let e = proxies[1].0.stop().unwrap_err();
    assert!(e.to_string().contains("semaphore 1000"), "{e}");
}

/// Kernel copies (`cuda_ipc_kernel_copy_max`) behind a GPU whose every SM is held by a kernel
/// that waits for the copy: the copy cannot start until that kernel's bounded waits end (the
/// documented cost of the mode), and then it lands whole, its token after it, and the flush
/// succeeds: late, never lost, never hung.
#[test]
#[ignore = "needs a CUDA GPU"]
fn kernel_copies_behind_a_full_gpu_wait_then_land() {
    let l = local_pairs_with(cfg(Transport::CudaIpc, 0).cuda_ipc_kernel_copy_max(4096));
    let m = module(KERNELS, 0);
    let [p0, p1] = <[Pair; 2]>::try_from(l.pairs).unwrap_or_else(|_| panic!("two pairs"));
    let src = DeviceBuffer::new(p0.comm.context(), 0, 4096, Transport::CudaIpc.into()).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    src.write(0, &data).unwrap();
    p1.local.write(0, &[0u8; 4096]).unwrap();
    let stream = Stream::new(0).unwrap();
    let res = results(2, p1.comm.context(), 0);
    let h = p1.sem.device_handle();
    let start = p1.sem.inbound_token().unwrap();
    let sms = mscclpp::gpu::sm_count(0).unwrap();
    // Two 1024-thread blocks per SM: every thread slot of the GPU.
    let blocks = 2 * sms;
    let (mut inb, mut st, mut tmo, mut r) = (h.inbound_token, start, 500_000_000u64, res.device_ptr());
    launch(&kernel(&m, "hold_gpu_watching"), blocks, 1024, &stream, &mut args![inb, st, tmo, r]);
    // Let the grid take the GPU, then issue the copy (a kernel) and its token behind it.
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    p0.conn.write(&p0.remote, 0, src.memory(), 0, 4096).unwrap();
    p0.sem.signal().unwrap();
    p0.conn.flush(T).unwrap();
    let landed = t0.elapsed();
    stream.synchronize(T).unwrap();
    let (seen, missed) = (read(&res, 0), read(&res, 1));
    assert_eq!(seen + missed, blocks as u64, "every block reported");
    let mut got = vec![0u8; 4096];
    p1.local.read(0, &mut got).unwrap();
    assert!(got == data, "the copy landed wrong");
    assert_eq!(p1.sem.inbound_token().unwrap(), start + 1, "one token, after the copy");
    println!(
        "RESULT kernel copy behind {blocks} blocks holding every SM: {seen} blocks saw the token within 0.5 s, \
         {missed} did not; flush returned after {landed:?}; data exact"
    );
}

/// The kernels above compile with NVRTC and assemble for sm_90 (no GPU needed; skipped without
/// NVRTC or ptxas, except in CI), so a mistake in them shows on any machine.
#[test]
fn device_kernels_compile() {
    let kernels = [
        "sender",
        "sender_relaxed",
        "sender_exclusive",
        "exclusive_fill",
        "exclusive_pushes",
        "exclusive_shared",
        "receiver",
        "ping",
        "pong",
        "bad_trigger",
    ];
    common::ptx::kernels_compile("device_kernels_compile", "device kernels", KERNELS, &kernels);
}
