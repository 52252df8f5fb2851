//! MemoryChannel, MemoryDevice2DeviceSemaphore and LL packets.
//!
//! Without a GPU: the header's new device code compiled by NVRTC and assembled by ptxas (the
//! layouts are checked by `device_header`'s table test, which includes the new handles).
//! On the GPU machine (`--ignored`), two processes over CUDA IPC (they time-slice the one GPU,
//! so each test keeps its round trips few): put/get byte-exact from 4 B to 256 MiB at every
//! alignment case, LL16/LL8 rounds with changing flags, semaphore counts under many concurrent
//! signallers and waiters, one IPC mapping for many semaphores, a time-limited wait that
//! expires, and a peer that dies while this side waits.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gpu::{args, gpu_for, kernel, launch, module, read, results};
use common::ptx::{assemble_sm90, nvrtc_or_skip, ptxas, skip};
use common::{Rank, spawn_ranks};
use mscclpp::device::compile::{CompileOptions, compile};
use mscclpp::gpu::Stream;
use mscclpp::{
    Bootstrap, Communicator, Connection, Device, DeviceBuffer, EndpointConfig, MemoryChannel,
    MemoryDevice2DeviceSemaphore, RegisteredMemory, Transport,
};

/// Checks that every rank succeeded and prints the ranks' RESULT lines.
fn relay(job: &common::Job) {
    job.assert_success();
    job.relay_results();
}

const T: Duration = Duration::from_secs(60);
const TIMEOUT_NS: u64 = 30_000_000_000;
const SENTINEL: u8 = 0xa5;

const KERNELS: &str = r#"
#include "mscclpp_rs/device.cuh"
using namespace mscclpp;

__device__ unsigned char pat(u64 x, u64 seed) { return (unsigned char)(((x + seed * 0x1000193ull) * 0x9E3779B97F4A7C15ull) >> 56); }
__device__ u32 word(u32 round, u64 i) { return (u32)(i * 2654435761u) ^ (round * 0x01000193u); }
__device__ u64 now() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

extern "C" __global__ void fill(unsigned char* buf, u64 len, u64 seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) buf[i] = pat(i, seed);
}

template <int A, bool R>
__device__ void mv(MemoryChannelDeviceHandle* ch, int get, u64 t, u64 o, u64 n) {
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  if (get) ch->get<A, R>(t, o, n, tid, nt); else ch->put<A, R>(t, o, n, tid, nt);
}

// One put (get = 0) or get (get = 1) by every thread of the grid.
extern "C" __global__ void move(MemoryChannelDeviceHandle* ch, int get, int align, int rem, u64 t, u64 o, u64 n) {
  if (!rem) mv<16, false>(ch, get, t, o, n);
  else if (align == 16) mv<16, true>(ch, get, t, o, n);
  else if (align == 8) mv<8, true>(ch, get, t, o, n);
  else mv<4, true>(ch, get, t, o, n);
}

extern "C" __global__ void signal_one(MemoryChannelDeviceHandle* ch) { ch->signal(); }

// res[0] += 1 if the wait timed out.
extern "C" __global__ void wait_one(MemoryChannelDeviceHandle* ch, u64 timeout, u64* res) {
  if (!ch->wait_for(timeout)) res[0] += 1;
}

// Bytes [start, start + len) of buf must be pat(org + i, seed), the `guard` bytes on each side
// the sentinel. bad[0] += mismatches.
extern "C" __global__ void check_case(const unsigned char* buf, u64 start, u64 len, u64 org, u64 seed, u64 guard,
                                      unsigned char sentinel, u64* bad) {
  u64 n = 0;
  for (u64 x = start - guard + blockIdx.x * (u64)blockDim.x + threadIdx.x; x < start + len + guard;
       x += (u64)gridDim.x * blockDim.x) {
    unsigned char want = (x >= start && x < start + len) ? pat(org + (x - start), seed) : sentinel;
    n += buf[x] != want;
  }
  if (n) atomicAdd(bad, n);
}

// Packets, rank A: `rounds` rounds of `bytes` payload into the peer's packet buffer, halves
// alternating, flag flag0 + r; before reusing a half, one ack (the peer consumed it).
// res[1]: acks that timed out.
template <typename P>
__device__ void pk_send(MemoryChannelDeviceHandle* ch, int rounds, u32 flag0, u64 bytes, u64 timeout, u64* res) {
  u32* src = (u32*)ch->src_;
  __shared__ int stop;
  if (threadIdx.x == 0) stop = 0;
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    if (r >= 2) {
      if (threadIdx.x == 0 && !ch->wait_for(timeout)) { res[1]++; stop = 1; }
      __syncthreads();
      if (stop) return;
    }
    for (u64 i = threadIdx.x; i < bytes / 4; i += blockDim.x) src[i] = word(flag0 + r, i);
    __syncthreads();
    ch->putPackets<P>((u64)(r % 2) * 2 * bytes, 0, bytes, threadIdx.x, blockDim.x, flag0 + r);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    for (int k = 0; k < 2 && k < rounds; ++k) if (!ch->wait_for(timeout)) res[1]++;
  }
}

// Packets, rank B: unpack each round (time-limited), check every word, ack.
// res[0]: wrong words, res[1]: unpacks that timed out, res[2]: rounds checked.
template <typename P>
__device__ void pk_recv(MemoryChannelDeviceHandle* ch, int rounds, u32 flag0, u64 bytes, u64 timeout, u64* res) {
  u32* dst = (u32*)ch->src_;
  __shared__ int fails;
  if (threadIdx.x == 0) fails = 0;
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    if (!ch->unpackPackets_for<P>((u64)(r % 2) * 2 * bytes, 0, bytes, threadIdx.x, blockDim.x, flag0 + r, timeout))
      atomicAdd(&fails, 1);
    __syncthreads();
    if (fails) { if (threadIdx.x == 0) res[1] += fails; return; }
    u64 bad = 0;
    for (u64 i = threadIdx.x; i < bytes / 4; i += blockDim.x) bad += dst[i] != word(flag0 + r, i);
    if (bad) atomicAdd(&res[0], bad);
    __syncthreads();
    if (threadIdx.x == 0) { ch->signal(); res[2]++; }
  }
}

extern "C" __global__ void ll16_send(MemoryChannelDeviceHandle* ch, int rounds, u32 flag0, u64 bytes, u64 timeout, u64* res) { pk_send<LL16Packet>(ch, rounds, flag0, bytes, timeout, res); }
extern "C" __global__ void ll16_recv(MemoryChannelDeviceHandle* ch, int rounds, u32 flag0, u64 bytes, u64 timeout, u64* res) { pk_recv<LL16Packet>(ch, rounds, flag0, bytes, timeout, res); }
extern "C" __global__ void ll8_send(MemoryChannelDeviceHandle* ch, int rounds, u32 flag0, u64 bytes, u64 timeout, u64* res) { pk_send<LL8Packet>(ch, rounds, flag0, bytes, timeout, res); }
extern "C" __global__ void ll8_recv(MemoryChannelDeviceHandle* ch, int rounds, u32 flag0, u64 bytes, u64 timeout, u64* res) { pk_recv<LL8Packet>(ch, rounds, flag0, bytes, timeout, res); }

// Every thread signals `per` times (even threads signal, odd relaxedSignal), then consumes `per`
// signals (even threads wait_for, odd threads poll until the time limit).
// res[0]: signals consumed, res[1]: consumes that timed out.
extern "C" __global__ void flood(MemoryDevice2DeviceSemaphoreDeviceHandle s, int per, u64 timeout, u64* res) {
  bool even = (threadIdx.x % 2) == 0;
  for (int k = 0; k < per; ++k) { if (even) s.signal(); else s.relaxedSignal(); }
  u64 ok = 0, bad = 0;
  for (int k = 0; k < per; ++k) {
    bool got;
    if (even) got = s.wait_for(timeout);
    else { u64 t0 = now(); while (!(got = s.poll()) && now() - t0 < timeout) {} }
    if (got) ok++; else bad++;
  }
  atomicAdd(&res[0], ok);
  if (bad) atomicAdd(&res[1], bad);
}

extern "C" __global__ void poll_once(MemoryDevice2DeviceSemaphoreDeviceHandle s, u64* res) { res[0] = s.poll(); }

// res[0] = wait_for's result, res[1] = elapsed ns.
extern "C" __global__ void lone_wait(MemoryDevice2DeviceSemaphoreDeviceHandle s, u64 timeout, u64* res) {
  u64 t0 = now();
  res[0] = s.wait_for(timeout);
  res[1] = now() - t0;
}

// After the peer died: a semaphore wait and two packet reads, all time-limited.
extern "C" __global__ void orphan_waits(MemoryChannelDeviceHandle* ch, u64 timeout, u64* res) {
  u64 t0 = now();
  res[0] = ch->wait_for(timeout);
  res[1] = ch->unpackPackets_for(0, 0, 64, 0, 1, 77, timeout);
  uint2 v;
  res[2] = ch->unpackPacket_for(0, 78, timeout, v);
  res[3] = now() - t0;
}
"#;

/// Every MemoryChannel/semaphore/packet method, for the NVRTC + ptxas check.
const API_KERNELS: &str = include_str!("kernels/memory_channel_api.cu");

/// Without a GPU: the new header code and this file's kernels compile with NVRTC (no warnings)
/// to compute_90, emit the orderings the header promises, and assemble with ptxas for sm_90.
#[test]
fn memory_channel_code_compiles_with_nvrtc_and_assembles() {
    let test = "memory_channel_code_compiles_with_nvrtc_and_assembles";
    if !nvrtc_or_skip(test) {
        return;
    }
    let opts = CompileOptions::default().arch("compute_90");
    let api = compile(API_KERNELS, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(api.log().trim().is_empty(), "NVRTC warned:\n{}", api.log());
    assert_eq!(api.kernels(), ["d2d_semaphore_api", "base_memory_channel_api", "memory_channel_api", "packets_api"]);
    for insn in [
        "red.release.sys.global.add.u64",
        "red.relaxed.sys.global.add.u64",
        "ld.acquire.sys.u64",
        "ld.relaxed.sys.u64",
        "atom.relaxed.gpu.cas.b64",
        "st.volatile.global.v4.u32",
        "ld.volatile.global.v4.u32",
        "st.volatile.global.v2.u32",
        "ld.volatile.global.v2.u32",
        "%globaltimer",
        "trap;",
    ] {
        assert!(api.as_str().contains(insn), "no {insn} in the PTX");
    }
    let tests = compile(KERNELS, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(tests.kernels().contains(&"flood".to_string()));
    let Some(ptxas) = ptxas() else {
        return skip(test, "NVRTC compiled the header, but no ptxas was found to assemble it (MSCCLPP_PTXAS)");
    };
    assemble_sm90(&ptxas, "memchan-ptx", &[("api", api.as_str()), ("tests", tests.as_str())]);
}

// ------------------------------------------------------------------------------------------
// GPU tests

/// One rank's end of a two-rank CUDA IPC setup: a communicator, the connection, and `bufs`
/// local buffers of the given sizes with the peer's matching registrations.
struct Side {
    bs: Arc<dyn Bootstrap>,
    comm: Communicator,
    conn: Connection,
    dev: u32,
    peer: usize,
    local: Vec<DeviceBuffer>,
    remote: Vec<RegisteredMemory>,
}

fn side(r: &Rank, lens: &[usize]) -> Side {
    let dev = gpu_for(r.rank);
    let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
    let comm = Communicator::new(bs.clone());
    let peer = 1 - r.rank;
    let cfg = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
    let pc = comm.connect(&cfg, peer, 0).unwrap();
    let local: Vec<_> =
        lens.iter().map(|&n| DeviceBuffer::new(comm.context(), dev, n, Transport::CudaIpc.into()).unwrap()).collect();
    for (i, b) in local.iter().enumerate() {
        comm.send_memory(b.memory(), peer, 10 + i as u32).unwrap();
    }
    let pms: Vec<_> = (0..lens.len()).map(|i| comm.recv_memory(peer, 10 + i as u32).unwrap()).collect();
    let conn = pc.wait().unwrap();
    let remote = pms.into_iter().map(|p| p.wait().unwrap()).collect();
    Side { bs, comm, conn, dev, peer, local, remote }
}

impl Side {
    fn semaphore(&self, tag: u32) -> MemoryDevice2DeviceSemaphore {
        MemoryDevice2DeviceSemaphore::new(
            self.comm.build_semaphore(&self.conn, self.peer, tag).unwrap().wait().unwrap(),
        )
        .unwrap()
    }
}

/// One copy case: alignment template, CopyRemainder, bytes, target/origin misalignment, and
/// its place (filled in by `layout`).
#[derive(Clone, Copy, Debug)]
struct Case {
    align: i32,
    rem: bool,
    size: u64,
    tm: u64,
    om: u64,
    tgt: u64,
    org: u64,
}

const GUARD: u64 = 48;

/// Every case and the region length they need: sizes 4 B .. 16 MiB at every misalignment each
/// alignment allows, 256 MiB at two, and the inputs outside the fast path (differently
/// misaligned ends, addresses not 4-aligned, sizes not a multiple of 4), plus one
/// CopyRemainder=false case.
fn layout() -> (Vec<Case>, u64) {
    let c = |align, rem, size, tm, om| Case { align, rem, size, tm, om, tgt: 0, org: 0 };
    let mut v = Vec::new();
    for size in [4u64, 8, 12, 20, 36, 100, 1020, 4096, 65_540, (1 << 20) + 4, (16 << 20) + 12] {
        for (align, ms) in [(16, &[0u64, 4, 8, 12][..]), (8, &[0, 4][..]), (4, &[0][..])] {
            for &m in ms {
                v.push(c(align, true, size, m, m));
            }
        }
    }
    v.push(c(16, true, 256 << 20, 0, 0));
    v.push(c(16, true, 256 << 20, 4, 4));
    v.extend([
        c(16, true, 1000, 4, 8),
        c(16, true, 4096, 2, 6),
        c(16, true, 13, 0, 0),
        c(16, true, 3, 0, 0),
        c(16, true, (1 << 20) + 3, 12, 12),
        c(16, true, 999, 1, 1),
        c(8, true, 777, 3, 1),
        c(4, true, 4098, 4, 0),
        c(16, false, 1000, 4, 4),
    ]);
    let mut at = 256u64;
    for k in v.iter_mut() {
        k.tgt = at + k.tm;
        k.org = at + k.om;
        at = (at + k.tm.max(k.om) + k.size + 256).div_ceil(256) * 256;
    }
    (v, at + 256)
}

/// What a case leaves in the target: (first byte, bytes, origin offset of the first byte).
/// CopyRemainder=false copies only the 16-byte elements (head and tail stay untouched).
fn expected(k: &Case) -> (u64, u64, u64) {
    if k.rem {
        return (k.tgt, k.size, k.org);
    }
    let head = (((16 - k.tgt % 16) % 16) / 4).min(k.size / 4) * 4;
    let body = (k.size - head) / 16 * 16;
    (k.tgt + head, body, k.org + head)
}

/// Rank 0 puts every case from its source region into rank 1's second region and signals;
/// rank 1 waits, checks each case byte by byte on the device (guard bytes included), then gets
/// every case from rank 0's source region into its third region and checks again.
fn put_get(r: &Rank) {
    let (cases, region) = layout();
    let s = side(r, &[3 * region as usize]);
    let m = module(KERNELS, s.dev);
    let stream = Stream::new(s.dev).unwrap();
    let res = results(2, s.comm.context(), s.dev);
    let buf = &s.local[0];
    buf.fill(0, buf.len(), SENTINEL).unwrap();
    let ch = MemoryChannel::new(s.semaphore(1), &s.remote[0], buf.memory(), None).unwrap();
    let mut chp = ch.device_handle_ptr();
    let seed = 7u64;
    let (grid, block) = (264u32, 512u32);
    s.bs.barrier().unwrap();
    let mv = kernel(&m, "move");
    if r.rank == 0 {
        let (mut p, mut len, mut sd) = (buf.device_ptr(), region, seed);
        launch(&kernel(&m, "fill"), grid, block, &stream, &mut args![p, len, sd]);
        for k in &cases {
            let (mut get, mut al, mut rem, mut t, mut o, mut n) =
                (0i32, k.align, k.rem as i32, region + k.tgt, k.org, k.size);
            launch(&mv, grid, block, &stream, &mut args![chp, get, al, rem, t, o, n]);
        }
        launch(&kernel(&m, "signal_one"), 1, 1, &stream, &mut args![chp]);
        // Wait for rank 1's "done" before the source region may go.
        let (mut tmo, mut rp) = (TIMEOUT_NS, res.device_ptr());
        launch(&kernel(&m, "wait_one"), 1, 1, &stream, &mut args![chp, tmo, rp]);
        stream.synchronize(T).unwrap();
        assert_eq!(read(&res, 0), 0, "rank 1's done signal timed out");
    } else {
        let (mut tmo, mut rp) = (TIMEOUT_NS, res.device_ptr());
        launch(&kernel(&m, "wait_one"), 1, 1, &stream, &mut args![chp, tmo, rp]);
        stream.synchronize(T).unwrap();
        assert_eq!(read(&res, 0), 0, "rank 0's signal timed out");
        let check = kernel(&m, "check_case");
        let bad = results(2 * cases.len(), s.comm.context(), s.dev);
        for (j, base) in [region, 2 * region].into_iter().enumerate() {
            if j == 1 {
                for k in &cases {
                    let (mut get, mut al, mut rem, mut t, mut o, mut n) =
                        (1i32, k.align, k.rem as i32, base + k.tgt, k.org, k.size);
                    launch(&mv, grid, block, &stream, &mut args![chp, get, al, rem, t, o, n]);
                }
            }
            for (i, k) in cases.iter().enumerate() {
                let (start, len, org) = expected(k);
                let slot = bad.device_ptr() + 8 * (j * cases.len() + i) as u64;
                let (mut p, mut st, mut ln, mut og, mut sd, mut g, mut sn, mut bp) =
                    (buf.device_ptr(), base + start, len, org, seed, GUARD, SENTINEL, slot);
                launch(&check, 132, 512, &stream, &mut args![p, st, ln, og, sd, g, sn, bp]);
            }
        }
        stream.synchronize(T).unwrap();
        let mut failed = Vec::new();
        for j in 0..2 {
            for (i, k) in cases.iter().enumerate() {
                let n = read(&bad, j * cases.len() + i);
                if n != 0 {
                    failed.push(format!("{} {k:?}: {n} wrong bytes", ["put", "get"][j]));
                }
            }
        }
        launch(&kernel(&m, "signal_one"), 1, 1, &stream, &mut args![chp]);
        stream.synchronize(T).unwrap();
        let biggest = cases.iter().map(|k| k.size).max().unwrap_or(0);
        println!(
            "RESULT put/get: {} cases each (4 B .. {} MiB, alignments 4/8/16, misalignments 0..15), {} failed",
            cases.len(),
            biggest >> 20,
            failed.len()
        );
        assert!(failed.is_empty(), "{}", failed.join("\n"));
    }
    s.bs.barrier().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn put_get_every_size_and_alignment_byte_exact() {
    if let Some(r) = Rank::from_env() {
        return put_get(&r);
    }
    relay(&spawn_ranks("put_get_every_size_and_alignment_byte_exact", 2, &[]));
}

const ROUNDS: i32 = 64;
const PKT_BYTES: u64 = 8192;

/// 64 LL16 rounds, then 64 LL8 rounds (other flags) from rank 0 to rank 1 through rank 1's
/// double-buffered packet buffer; rank 1 unpacks (time-limited), checks every word, acks.
fn packets(r: &Rank) {
    let s = side(r, &[PKT_BYTES as usize, 4 * PKT_BYTES as usize]);
    let (data, pk) = (&s.local[0], &s.local[1]);
    let m = module(KERNELS, s.dev);
    let stream = Stream::new(s.dev).unwrap();
    let ch = MemoryChannel::new(s.semaphore(1), &s.remote[1], data.memory(), Some(pk.memory())).unwrap();
    let res = results(3, s.comm.context(), s.dev);
    s.bs.barrier().unwrap();
    for (kind, flag0) in [("ll16", 1u32), ("ll8", 1001)] {
        let name = format!("{kind}_{}", if r.rank == 0 { "send" } else { "recv" });
        let (mut c, mut n, mut f, mut b, mut tmo, mut rp) =
            (ch.device_handle_ptr(), ROUNDS, flag0, PKT_BYTES, TIMEOUT_NS, res.device_ptr());
        launch(&kernel(&m, &name), 1, 512, &stream, &mut args![c, n, f, b, tmo, rp]);
        stream.synchronize(T).unwrap();
        if r.rank == 0 {
            assert_eq!(read(&res, 1), 0, "{kind}: acks that timed out");
        } else {
            let (bad, timeouts, rounds) = (read(&res, 0), read(&res, 1), read(&res, 2));
            println!(
                "RESULT {kind}: {rounds} rounds of {PKT_BYTES} B checked, {bad} wrong words, {timeouts} timed-out unpacks"
            );
            assert_eq!((bad, timeouts, rounds), (0, 0, ROUNDS as u64), "{kind}");
            res.fill(0, 24, 0).unwrap();
        }
        s.bs.barrier().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ll16_and_ll8_packets_over_many_rounds() {
    if let Some(r) = Rank::from_env() {
        return packets(&r);
    }
    relay(&spawn_ranks("ll16_and_ll8_packets_over_many_rounds", 2, &[]));
}

/// 32 semaphores to the peer open one CUDA IPC mapping (the peer's token pool); then both ranks
/// flood one semaphore from 8192 threads (4 signals each, half relaxed) while the same threads
/// consume 4 each (half wait_for, half poll): every count exact, nothing left over; then a
/// wait nobody signals returns false after its limit and consumes nothing.
fn semaphores(r: &Rank) {
    let s = side(r, &[4096]);
    let before = mscclpp::bench::ipc_mapped_count();
    let sems: Vec<_> = (0..32).map(|i| s.semaphore(100 + i)).collect();
    let opened = mscclpp::bench::ipc_mapped_count() - before;
    println!("RESULT rank {}: 32 semaphores opened {opened} CUDA IPC mapping(s)", r.rank);
    assert_eq!(opened, 1, "tokens of one pool share one mapping");
    let pool = mscclpp::device::token_pool::pool_usage(s.comm.context(), s.dev);
    assert!(pool.0 >= 64 && pool.1 == 1, "32 tokens + 32 expected counts in one chunk: {pool:?}");
    let m = module(KERNELS, s.dev);
    let stream = Stream::new(s.dev).unwrap();
    let res = results(2, s.comm.context(), s.dev);
    let sem = &sems[7];
    let (blocks, threads, per) = (64u32, 128u32, 4i32);
    let total = (blocks * threads) as u64 * per as u64;
    s.bs.barrier().unwrap();
    let (mut h, mut p, mut tmo, mut rp) = (sem.device_handle(), per, TIMEOUT_NS, res.device_ptr());
    launch(&kernel(&m, "flood"), blocks, threads, &stream, &mut args![h, p, tmo, rp]);
    stream.synchronize(T).unwrap();
    let (ok, timeouts) = (read(&res, 0), read(&res, 1));
    s.bs.barrier().unwrap(); // both kernels done: every signal landed
    let (inbound, expected) = (sem.inbound_token().unwrap(), sem.expected_inbound_token().unwrap());
    let one = results(1, s.comm.context(), s.dev);
    let mut op = one.device_ptr();
    launch(&kernel(&m, "poll_once"), 1, 1, &stream, &mut args![h, op]);
    stream.synchronize(T).unwrap();
    let extra = read(&one, 0);
    println!(
        "RESULT rank {}: {total} signals from {} threads: {ok} consumed, {timeouts} timed out, token {inbound}, expected {expected}, extra poll {extra}",
        r.rank,
        blocks * threads
    );
    assert_eq!((ok, timeouts, inbound, expected, extra), (total, 0, total, total, 0));
    let lone = results(2, s.comm.context(), s.dev);
    let (mut tmo, mut lp) = (50_000_000u64, lone.device_ptr());
    launch(&kernel(&m, "lone_wait"), 1, 1, &stream, &mut args![h, tmo, lp]);
    stream.synchronize(T).unwrap();
    let (ret, ns) = (read(&lone, 0), read(&lone, 1));
    println!("RESULT rank {}: wait_for(50 ms) nobody signals: {ret} after {:.3} ms", r.rank, ns as f64 / 1e6);
    assert_eq!(ret, 0);
    assert!(ns >= tmo, "returned after {ns} ns, before its limit");
    assert_eq!(sem.expected_inbound_token().unwrap(), total, "a timed-out wait consumes nothing");
    s.bs.barrier().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn semaphore_counts_exact_under_many_signallers_and_waiters() {
    if let Some(r) = Rank::from_env() {
        return semaphores(&r);
    }
    relay(&spawn_ranks("semaphore_counts_exact_under_many_signallers_and_waiters", 2, &[]));
}

/// Rank 1 dies (SIGKILL) after the setup; rank 0's kernel then waits on the semaphore and for
/// packets, each with a 2 s limit: all return false, the kernel ends, the process goes on.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_dead_peer_releases_time_limited_waits() {
    if let Some(r) = Rank::from_env() {
        let s = side(&r, &[4096, 4096]);
        let ch =
            MemoryChannel::new(s.semaphore(1), &s.remote[1], s.local[0].memory(), Some(s.local[1].memory())).unwrap();
        s.bs.barrier().unwrap();
        if r.rank == 1 {
            common::die();
        }
        // Until rank 1 is dead: it sends nothing, so this receive ends when its bootstrap
        // connection closes with it.
        s.bs.recv(1, 99).expect_err("rank 1 sent something instead of dying");
        let m = module(KERNELS, s.dev);
        let stream = Stream::new(s.dev).unwrap();
        let res = results(4, s.comm.context(), s.dev);
        let (mut c, mut tmo, mut rp) = (ch.device_handle_ptr(), 2_000_000_000u64, res.device_ptr());
        let t0 = Instant::now();
        launch(&kernel(&m, "orphan_waits"), 1, 1, &stream, &mut args![c, tmo, rp]);
        stream.synchronize(T).unwrap();
        let got = [0, 1, 2, 3].map(|i| read(&res, i));
        println!(
            "RESULT after the peer died: wait_for {}, unpackPackets_for {}, unpackPacket_for {}, {:.2} s on the device, {:?} on the host",
            got[0],
            got[1],
            got[2],
            got[3] as f64 / 1e9,
            t0.elapsed()
        );
        assert_eq!(&got[..3], &[0, 0, 0]);
        assert!(got[3] >= 3 * tmo);
        std::process::exit(0);
    }
    let job =
        common::spawn_some("a_dead_peer_releases_time_limited_waits", 2, &[0, 1], T, &[], Duration::from_secs(120));
    job.assert_rank_success(0);
    job.relay_results();
}
