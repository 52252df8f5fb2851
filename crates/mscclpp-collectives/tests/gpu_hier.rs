//! Two-level collectives on a real GPU: N ranks as threads of this process on GPU 0, grouped
//! into "nodes" of consecutive ranks; inside a node over MemoryChannels (CUDA IPC), between
//! nodes over PortChannels through each rank's proxy (CUDA IPC or Ethernet on loopback). Every
//! result is compared with a CPU reference on integer-valued data. The GPU tests are marked
//! `#[ignore = "needs a CUDA GPU"]`; the NVRTC compile check runs anywhere NVRTC is found.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{
    Bootstrap, Communicator, Device, EndpointConfig, ErrorKind, RootServer, TcpBootstrap, Transport, TransportFlags,
};
use mscclpp_collectives::hier::{HierConfig, TwoLevel};
use mscclpp_collectives::{DataType, ReduceOp};

const T: Duration = Duration::from_secs(120);

/// Runs `f(rank, two_level, stream, a, b)` on `n` rank threads (each its own bootstrap,
/// communicator, stream and two `bytes`-byte device buffers on GPU 0) and returns their results
/// in rank order. Nothing is freed before every rank is done: `cuMemFree` waits for the whole
/// GPU, and a rank freeing its buffers while its peers' kernels still wait for its proxy's
/// signals starved those signals (its Ethernet connections' CUDA calls queued behind the free).
fn ranks<R: Send>(
    n: usize,
    bytes: usize,
    config: impl Fn(usize) -> HierConfig + Sync,
    f: impl Fn(usize, &TwoLevel, &Stream, &DeviceBuffer, &DeviceBuffer) -> R + Sync,
) -> Vec<R> {
    // SAFETY: ranks are threads of this process and need their own hardware queues (see
    // use_all_hw_queues). Only the first call in the process writes; the GPU tests run one at a
    // time (--test-threads=1, as the GPU bundle runs them) and this precedes every thread and
    // CUDA call of the first test, so nothing else reads or writes the environment then.
    let _ = unsafe { mscclpp::gpu::use_all_hw_queues() };
    let (root, id) = RootServer::start(n, T).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, f, config) = (id.clone(), &f, &config);
                s.spawn(move || {
                    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(T).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let two = TwoLevel::new(&comm, config(rank)).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    let stream = Stream::new(0).unwrap();
                    let a = DeviceBuffer::new(comm.context(), 0, bytes, TransportFlags::NONE).unwrap();
                    let b = DeviceBuffer::new(comm.context(), 0, bytes, TransportFlags::NONE).unwrap();
                    if let Some(ms) = std::env::var("MSCCLPP_HIER_SLEEP_MS").ok().and_then(|s| s.parse().ok()) {
                        std::thread::sleep(Duration::from_millis(ms));
                    }
                    let r = f(rank, &two, &stream, &a, &b);
                    // No rank frees memory while a peer's kernel may still wait for this rank.
                    let _ = stream.synchronize(T);
                    bs.barrier().unwrap();
                    drop(two);
                    bs.barrier().unwrap();
                    drop((a, b));
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(root);
    out
}

fn config(rpn: usize, inter: Transport) -> HierConfig {
    let secs = std::env::var("MSCCLPP_HIER_TIMEOUT_S").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u32>().ok());
    let mut proxy = mscclpp::device::ProxyConfig::default();
    proxy.idle_backoff = env("MSCCLPP_HIER_IDLE_BACKOFF").unwrap_or(0) != 0;
    let c = HierConfig::new(0, rpn)
        .timeout(Duration::from_secs(secs))
        .max_blocks(env("MSCCLPP_HIER_BLOCKS").unwrap_or(16))
        .proxy(proxy);
    match inter {
        Transport::Ethernet => c.inter_endpoint(
            EndpointConfig::new(Transport::Ethernet).device(Device::Gpu(0)).ethernet_interface("127.0.0.1"),
        ),
        t => c.inter(t),
    }
}

/// Element `i` of rank `r`'s input: small integers, exact in every type and every sum here.
fn value(r: usize, i: usize, op: ReduceOp) -> i64 {
    match op {
        ReduceOp::Prod => ((i + r) % 3) as i64,
        _ => ((r * 7 + i * 3) % 17) as i64 - 8,
    }
}

fn f32_to_f16(f: f32) -> u16 {
    // Exact for the small integers used here.
    if f == 0.0 {
        return if f.is_sign_negative() { 0x8000 } else { 0 };
    }
    let b = f.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let mant = ((b >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | mant
}

/// The bytes of `v` as `d` (integers: `v` is a whole number).
fn encode(d: DataType, v: f64) -> Vec<u8> {
    match d {
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F16 => f32_to_f16(v as f32).to_le_bytes().to_vec(),
        DataType::Bf16 => (((v as f32).to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        DataType::I32 => (v as i64 as i32).to_le_bytes().to_vec(),
        _ => (v as i64 as u32).to_le_bytes().to_vec(),
    }
}

/// The reference reduction (`Avg`: float division for floats, truncating for integers).
fn reduce(d: DataType, op: ReduceOp, vals: impl Iterator<Item = i64>, n: usize) -> f64 {
    let v: Vec<i64> = vals.collect();
    match op {
        ReduceOp::Sum => v.iter().sum::<i64>() as f64,
        ReduceOp::Prod => v.iter().product::<i64>() as f64,
        ReduceOp::Min => v.iter().copied().min().unwrap_or(0) as f64,
        ReduceOp::Max => v.iter().copied().max().unwrap_or(0) as f64,
        ReduceOp::Avg if d.is_float() => v.iter().sum::<i64>() as f64 / n as f64,
        ReduceOp::Avg => (v.iter().sum::<i64>() / n as i64) as f64,
        _ => unreachable!(),
    }
}

#[derive(Clone, Copy, Debug)]
enum Call {
    AllReduce(DataType, ReduceOp),
    AllGather(DataType),
}

#[derive(Clone, Copy, Debug)]
struct Case {
    call: Call,
    count: usize,
    in_place: bool,
}

const COUNTS: [usize; 4] = [1, 1000, 65537, (1 << 20) + 3];

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for count in COUNTS {
        for d in [DataType::F32, DataType::I32, DataType::U32, DataType::Bf16, DataType::F16] {
            v.push(Case { call: Call::AllReduce(d, ReduceOp::Sum), count, in_place: false });
        }
        v.push(Case { call: Call::AllReduce(DataType::F32, ReduceOp::Sum), count, in_place: true });
        v.push(Case { call: Call::AllGather(DataType::U32), count, in_place: false });
        v.push(Case { call: Call::AllGather(DataType::Bf16), count, in_place: false });
        v.push(Case { call: Call::AllGather(DataType::F32), count, in_place: true });
    }
    for op in [ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
        v.push(Case { call: Call::AllReduce(DataType::I32, op), count: 1001, in_place: false });
        v.push(Case { call: Call::AllReduce(DataType::F32, op), count: 4099, in_place: false });
    }
    v
}

/// Runs one case on this rank and returns (wrong elements, first wrong index).
fn run_case(
    rank: usize,
    n: usize,
    two: &TwoLevel,
    stream: &Stream,
    a: &DeviceBuffer,
    b: &DeviceBuffer,
    c: &Case,
) -> (usize, Option<usize>) {
    let (dtype, op) = match c.call {
        Call::AllReduce(d, op) => (d, op),
        Call::AllGather(d) => (d, ReduceOp::Sum),
    };
    let es = dtype.size();
    let bytes = c.count * es;
    let input: Vec<u8> = (0..c.count).flat_map(|i| encode(dtype, value(rank, i, op) as f64)).collect();
    let (send, recv, out_off, out_len) = match (c.call, c.in_place) {
        (Call::AllReduce(..), false) => (a.device_ptr(), b.device_ptr(), 0, bytes),
        (Call::AllReduce(..), true) => (b.device_ptr(), b.device_ptr(), 0, bytes),
        (Call::AllGather(_), false) => (a.device_ptr(), b.device_ptr(), 0, bytes * n),
        (Call::AllGather(_), true) => (b.device_ptr() + (rank * bytes) as u64, b.device_ptr(), 0, bytes * n),
    };
    let in_buf_off = if send == a.device_ptr() { None } else { Some((send - b.device_ptr()) as usize) };
    b.fill(0, out_len, 0xee).unwrap();
    match in_buf_off {
        None => a.write(0, &input).unwrap(),
        Some(off) => b.write(off, &input).unwrap(),
    }
    // SAFETY: a and b hold every byte the call touches and outlive it (synchronized below).
    let r = unsafe {
        match c.call {
            Call::AllReduce(d, op) => two.all_reduce(send, recv, c.count, d, op, stream),
            Call::AllGather(d) => two.all_gather(send, recv, c.count, d, stream),
        }
    };
    r.unwrap_or_else(|e| panic!("rank {rank} {c:?}: {e}"));
    two.synchronize(stream, T).unwrap_or_else(|e| panic!("rank {rank} {c:?}: {e}"));
    let mut out = vec![0u8; out_len];
    b.read(out_off, &mut out).unwrap();
    let want: Vec<u8> = match c.call {
        Call::AllReduce(d, op) => {
            (0..c.count).flat_map(|i| encode(d, reduce(d, op, (0..n).map(|r| value(r, i, op)), n))).collect()
        }
        Call::AllGather(d) => {
            (0..n).flat_map(|r| (0..c.count).flat_map(move |i| encode(d, value(r, i, ReduceOp::Sum) as f64))).collect()
        }
    };
    let wrong: Vec<usize> =
        (0..out_len / es).filter(|&i| out[i * es..(i + 1) * es] != want[i * es..(i + 1) * es]).collect();
    (wrong.len(), wrong.first().copied())
}

fn sweep(n: usize, rpn: usize, inter: Transport) {
    let t = Instant::now();
    let cases = cases();
    let need = COUNTS.iter().max().copied().unwrap_or(1) * 4 * n;
    let res = ranks(
        n,
        need,
        |_| config(rpn, inter),
        |rank, two, stream, a, b| {
            let r: Vec<_> = cases.iter().map(|c| run_case(rank, n, two, stream, a, b, c)).collect();
            (r, two.blocks())
        },
    );
    let mut bad = Vec::new();
    for (rank, (res, _)) in res.iter().enumerate() {
        for (c, (wrong, first)) in cases.iter().zip(res) {
            if *wrong > 0 {
                bad.push(format!("rank {rank} {c:?}: {wrong} wrong, first at {first:?}"));
            }
        }
    }
    println!(
        "RESULT {n} ranks as {} nodes x {rpn}, inter-node {inter}: {} cases in {:?} ({} blocks), {} wrong",
        n / rpn,
        cases.len(),
        t.elapsed(),
        res[0].1,
        bad.len()
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn four_ranks_as_2x2_over_cuda_ipc() {
    sweep(4, 2, Transport::CudaIpc);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn four_ranks_as_2x2_over_ethernet() {
    sweep(4, 2, Transport::Ethernet);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eight_ranks_as_2x4_over_cuda_ipc() {
    sweep(8, 4, Transport::CudaIpc);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eight_ranks_as_2x4_over_ethernet() {
    sweep(8, 4, Transport::Ethernet);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eight_ranks_as_4x2_over_cuda_ipc() {
    sweep(8, 2, Transport::CudaIpc);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eight_ranks_as_4x2_over_ethernet() {
    sweep(8, 2, Transport::Ethernet);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn four_ranks_as_4x1_over_ethernet() {
    sweep(4, 1, Transport::Ethernet);
}

/// Any grouping: `MSCCLPP_HIER_SWEEP="nranks,ranks_per_node,ipc|eth"` (default `8,2,eth`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sweep_from_env() {
    let spec = std::env::var("MSCCLPP_HIER_SWEEP").unwrap_or_else(|_| "8,2,eth".to_string());
    let f: Vec<&str> = spec.split(',').collect();
    let (n, rpn) = (f[0].parse().unwrap(), f[1].parse().unwrap());
    sweep(n, rpn, if f.get(2) == Some(&"ipc") { Transport::CudaIpc } else { Transport::Ethernet });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_node_and_one_rank_per_node() {
    sweep(4, 4, Transport::CudaIpc);
    sweep(4, 1, Transport::CudaIpc);
}

/// Small rounds: many rounds per call, the exchange slots' halves alternating within and
/// across calls, AllReduce and AllGather interleaved.
#[test]
#[ignore = "needs a CUDA GPU"]
fn many_small_rounds_and_few_blocks() {
    let n = 4;
    let res = ranks(
        n,
        1 << 22,
        |_| config(2, Transport::CudaIpc).round_bytes(4096).max_blocks(2),
        |rank, two, stream, a, b| {
            let mut wrong = 0;
            for count in [1usize, 3, 1023, 1025, 65537] {
                for c in [
                    Case { call: Call::AllReduce(DataType::I32, ReduceOp::Sum), count, in_place: false },
                    Case { call: Call::AllGather(DataType::F16), count, in_place: false },
                    Case { call: Call::AllReduce(DataType::Bf16, ReduceOp::Sum), count, in_place: true },
                ] {
                    wrong += run_case(rank, n, two, stream, a, b, &c).0;
                }
            }
            wrong
        },
    );
    assert!(res.iter().all(|&w| w == 0), "wrong elements per rank: {res:?}");
}

/// Rank 3 (node 1) never calls: its node peer and its cross-node peer time out naming it, the
/// other rank times out too, and a later call is refused at once; teardown finishes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_missing_rank_times_out_naming_it() {
    let n = 4;
    let t = Instant::now();
    let res = ranks(
        n,
        1 << 16,
        |_| config(2, Transport::CudaIpc).timeout(Duration::from_secs(2)),
        |rank, two, stream, a, _| {
            if rank == 3 {
                return None;
            }
            // SAFETY: a outlives the synchronize.
            let first =
                unsafe { two.all_reduce(a.device_ptr(), a.device_ptr(), 4096, DataType::F32, ReduceOp::Sum, stream) }
                    .and_then(|_| two.synchronize(stream, T))
                    .map_err(|e| (e.kind(), e.peer(), e.to_string()));
            // SAFETY: as above.
            let second = unsafe { two.all_gather(a.device_ptr(), a.device_ptr(), 16, DataType::F32, stream) }
                .map_err(|e| e.to_string());
            Some((first, second))
        },
    );
    println!("RESULT missing rank: {res:?} after {:?}", t.elapsed());
    for (rank, r) in res.iter().enumerate().take(3) {
        let (first, second) = r.as_ref().unwrap_or_else(|| panic!("rank {rank} made no call"));
        let (kind, peer, msg) = first.as_ref().unwrap_err();
        assert_eq!(*kind, ErrorKind::Timeout, "rank {rank}: {msg}");
        if rank != 0 {
            assert_eq!(*peer, Some(3), "rank {rank}: {msg}");
            assert!(msg.contains("rank 3"), "{msg}");
        }
        assert!(second.is_err(), "rank {rank}: a call after a failure must be refused");
    }
    assert!(t.elapsed() < Duration::from_secs(90), "took {:?}", t.elapsed());
}

/// Ranks 0 and 1 (node 0) make different calls (4096 and 2048 elements): each names the other as
/// a node peer that made another call, within its first round, instead of reducing the wrong
/// data (the node comparison comes before the inter-node exchange, so neither puts anything to
/// node 1); node 1's ranks, which agree, then time out on their cross-node peer.
#[test]
#[ignore = "needs a CUDA GPU"]
fn node_peers_making_different_calls_are_named() {
    let res = ranks(
        4,
        1 << 16,
        |_| config(2, Transport::CudaIpc).timeout(Duration::from_secs(2)),
        |rank, two, stream, a, _| {
            let count = if rank == 1 { 2048 } else { 4096 };
            // SAFETY: a (64 KiB) holds 4096 f32 and outlives the synchronize.
            unsafe { two.all_reduce(a.device_ptr(), a.device_ptr(), count, DataType::F32, ReduceOp::Sum, stream) }
                .and_then(|_| two.synchronize(stream, T))
                .map_err(|e| (e.kind(), e.peer(), e.to_string()))
        },
    );
    println!("RESULT different calls: {res:?}");
    for (rank, other) in [(0usize, 1usize), (1, 0)] {
        let (kind, peer, msg) = res[rank].as_ref().unwrap_err();
        assert_eq!((*kind, *peer), (ErrorKind::InvalidUsage, Some(other)), "rank {rank}: {msg}");
        assert!(msg.contains("made another two-level call"), "rank {rank}: {msg}");
    }
}

/// What a call returned on one rank: Ok, or the error's kind, peer and message.
type Outcome = Result<(), (ErrorKind, Option<usize>, String)>;

/// Runs one failing call per rank on 4 ranks as 2 nodes of 2 (CUDA IPC between nodes, 2 s
/// timeout): `count(rank)` elements of f32, an AllReduce or an AllGather (`a` in, `b` out).
fn different_calls(all_gather: bool, count: impl Fn(usize) -> usize + Sync) -> Vec<Outcome> {
    ranks(
        4,
        1 << 16,
        |_| config(2, Transport::CudaIpc).timeout(Duration::from_secs(2)),
        |rank, two, stream, a, b| {
            let count = count(rank);
            // SAFETY: a and b (64 KiB each) hold the 4096 f32 of an AllReduce, and the 1024 f32
            // per rank of an AllGather's input and the 4 x 1024 of its output; they outlive the
            // synchronize.
            unsafe {
                if all_gather {
                    two.all_gather(a.device_ptr(), b.device_ptr(), count, DataType::F32, stream)
                } else {
                    two.all_reduce(a.device_ptr(), a.device_ptr(), count, DataType::F32, ReduceOp::Sum, stream)
                }
            }
            .and_then(|_| two.synchronize(stream, T))
            .map_err(|e| (e.kind(), e.peer(), e.to_string()))
        },
    )
}

/// Asserts that `rank` failed with `InvalidUsage` naming `other` as a peer (`how`: "node peer"
/// or "cross-node peer") that made another call.
fn assert_named(res: &[Outcome], rank: usize, other: usize, how: &str) {
    let (kind, peer, msg) = res[rank].as_ref().expect_err("a mismatched call must fail");
    assert_eq!((*kind, *peer), (ErrorKind::InvalidUsage, Some(other)), "rank {rank}: {msg}");
    assert!(msg.contains(&format!(": {how} rank {other} made another two-level call")), "rank {rank}: {msg}");
}

/// Both ranks of node 1 (ranks 2 and 3) make another call than node 0 (2048 elements instead
/// of 4096, AllReduce, then AllGather with 512 instead of 1024): each node agrees inside, so
/// only the cross-node comparison (the signature at the end of the first exchange's put) sees
/// it, and every rank names its cross-node peer (0 <-> 2, 1 <-> 3) before writing its output.
/// Then only rank 2 makes another call: its node peer (rank 3) names it first, at the node
/// barrier before the exchange, and rank 2 names rank 3; neither puts anything to node 0, whose
/// ranks fail waiting for them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_node_peers_making_different_calls_are_named() {
    let cross = [(0usize, 2usize), (1, 3), (2, 0), (3, 1)];
    let res = different_calls(false, |rank| if rank >= 2 { 2048 } else { 4096 });
    println!("RESULT nodes making different AllReduce calls: {res:?}");
    for (rank, other) in cross {
        assert_named(&res, rank, other, "cross-node peer");
    }
    let res = different_calls(true, |rank| if rank >= 2 { 512 } else { 1024 });
    println!("RESULT nodes making different AllGather calls: {res:?}");
    for (rank, other) in cross {
        assert_named(&res, rank, other, "cross-node peer");
    }
    let res = different_calls(false, |rank| if rank == 2 { 2048 } else { 4096 });
    println!("RESULT one rank making another AllReduce call: {res:?}");
    assert_named(&res, 2, 3, "node peer");
    assert_named(&res, 3, 2, "node peer");
    for (rank, other) in [(0usize, 2usize), (1, 3)] {
        let (kind, peer, msg) = res[rank].as_ref().expect_err("a rank whose cross-node peer stopped must fail");
        assert_eq!((*kind, *peer), (ErrorKind::Timeout, Some(other)), "rank {rank}: {msg}");
    }
}

/// Groupings that do not divide the ranks are refused before anything is connected.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_grouping_that_does_not_divide_is_refused() {
    let (root, id) = RootServer::start(1, T).unwrap();
    let bs = Arc::new(TcpBootstrap::config(0, 1).timeout(T).initialize(&id).unwrap());
    let comm = Communicator::new(bs as Arc<dyn Bootstrap>);
    let e = TwoLevel::new(&comm, HierConfig::new(0, 2)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage);
    assert!(e.to_string().contains("multiple of ranks_per_node"), "{e}");
    drop(root);
}
