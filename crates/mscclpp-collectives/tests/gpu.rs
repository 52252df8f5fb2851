//! Collectives on a real GPU: N ranks as threads of this process on GPU 0 (each its own
//! bootstrap, communicator, stream and `Collectives`), every result compared with a CPU
//! reference. Marked `#[ignore = "needs a CUDA GPU"]`; run with `--ignored` on a GPU machine.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, ErrorKind, RootServer, TcpBootstrap, TransportFlags};
use mscclpp_collectives::{Algorithm, CallOptions, Collective, Collectives, Config, DataType, ReduceOp};

/// Runs `f(rank, coll, stream)` on `n` rank threads and returns their results in rank order.
fn ranks<T: Send>(n: usize, config: impl Fn(usize) -> Config + Sync, f: impl Fn(usize, &Collectives, &Stream) -> T + Sync) -> Vec<T> {
    let (root, id) = RootServer::start(n, Duration::from_secs(60)).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, f, config) = (id.clone(), &f, &config);
                s.spawn(move || {
                    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(Duration::from_secs(60)).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let coll = Collectives::new(&comm, config(rank)).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    let stream = Stream::new(0).unwrap();
                    let r = f(rank, &coll, &stream);
                    // Teardown: no rank frees memory (cuMemFree waits for the whole GPU) or its
                    // scratch while a peer's kernel may still use it.
                    let _ = stream.synchronize(Duration::from_secs(60));
                    bs.barrier().unwrap();
                    drop(coll);
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(root);
    out
}

/// Element `i` of rank `r`'s input: small integers, exact in every type and every sum here.
fn value(r: usize, i: usize, op: ReduceOp) -> i64 {
    match op {
        ReduceOp::Prod => ((i + r) % 3) as i64, // 0, 1, 2: products of up to 8 ranks stay exact
        _ => ((r * 7 + i * 3) % 17) as i64 - 8,
    }
}

fn encode(d: DataType, v: f64) -> Vec<u8> {
    match d {
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F16 => f32_to_f16(v as f32).to_le_bytes().to_vec(),
        DataType::Bf16 => (((v as f32).to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        DataType::I32 => (v as i32).to_le_bytes().to_vec(),
        DataType::U32 => (v as i64 as u32).to_le_bytes().to_vec(),
        _ => unreachable!(),
    }
}

fn decode(d: DataType, b: &[u8]) -> f64 {
    match d {
        DataType::F32 => f32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        DataType::F16 => f16_to_f32(u16::from_le_bytes(b[..2].try_into().unwrap())) as f64,
        DataType::Bf16 => f32::from_bits((u16::from_le_bytes(b[..2].try_into().unwrap()) as u32) << 16) as f64,
        DataType::I32 => i32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        DataType::U32 => u32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
        _ => unreachable!(),
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
    let man = ((b >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | man
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    if exp == 0 && man == 0 {
        return f32::from_bits(sign);
    }
    f32::from_bits(sign | ((exp + 127 - 15) << 23) | (man << 13))
}

fn reduce(op: ReduceOp, d: DataType, vals: impl Iterator<Item = i64>, n: usize) -> f64 {
    let v: Vec<i64> = vals.collect();
    let x = match op {
        ReduceOp::Sum | ReduceOp::Avg => v.iter().sum::<i64>(),
        ReduceOp::Prod => v.iter().product(),
        ReduceOp::Min => *v.iter().min().unwrap(),
        ReduceOp::Max => *v.iter().max().unwrap(),
        _ => unreachable!(),
    };
    if op == ReduceOp::Avg {
        if d.is_float() { x as f64 / n as f64 } else { (x / n as i64) as f64 }
    } else {
        x as f64
    }
}

fn input_bytes(d: DataType, r: usize, count: usize, op: ReduceOp) -> Vec<u8> {
    let mut v = Vec::with_capacity(count * d.size());
    for i in 0..count {
        let x = value(r, i, op);
        let x = if d == DataType::U32 && op != ReduceOp::Prod { x + 8 } else { x };
        v.extend(encode(d, x as f64));
    }
    v
}

fn input_value(d: DataType, r: usize, i: usize, op: ReduceOp) -> i64 {
    let x = value(r, i, op);
    if d == DataType::U32 && op != ReduceOp::Prod { x + 8 } else { x }
}

fn close(d: DataType, op: ReduceOp, got: f64, want: f64) -> bool {
    if op == ReduceOp::Avg && d.is_float() {
        let tol = match d {
            DataType::F32 => 1e-5,
            DataType::F16 => 1e-2,
            _ => 6e-2,
        };
        (got - want).abs() <= tol * want.abs().max(1.0)
    } else {
        got == want
    }
}

/// Every rank's earlier kernels have finished before any rank frees a buffer (freeing waits for
/// the whole GPU): a one-element AllReduce completes on a rank only once every peer launched
/// it, i.e. finished everything before it; peers can then finish theirs without this rank.
fn coll_barrier(coll: &Collectives) {
    let ctx = mscclpp::Context::new();
    let one = DeviceBuffer::new(&ctx, 0, 16, TransportFlags::NONE).unwrap();
    let s = Stream::new(0).unwrap();
    coll.all_reduce_buffers(&one, &one, 1, DataType::U32, ReduceOp::Sum, &s).unwrap();
    coll.synchronize(&s, Duration::from_secs(60)).unwrap();
}

#[derive(Clone, Copy, Debug)]
struct Case {
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    algo: Option<Algorithm>,
    in_place: bool,
}

/// Runs `case` on every rank and returns the number of wrong elements (with the first few).
fn run_case(rank: usize, n: usize, coll: &Collectives, stream: &Stream, bufs: &(DeviceBuffer, DeviceBuffer), c: &Case) -> (usize, Vec<String>) {
    let es = c.dtype.size();
    let (in_elems, out_elems) = match c.coll {
        Collective::AllReduce | Collective::Broadcast => (c.count, c.count),
        Collective::AllGather => (c.count, c.count * n),
        Collective::ReduceScatter => (c.count * n, c.count),
        _ => unreachable!(),
    };
    let big = in_elems.max(out_elems) * es;
    let (a, b) = (&bufs.0, &bufs.1);
    assert!(a.len() >= big && b.len() >= big);
    let input = input_bytes(c.dtype, rank, in_elems, c.op);
    // In place: the input sits where NCCL puts it inside the output buffer.
    let (send, recv) = if c.in_place {
        let off = match c.coll {
            Collective::AllGather => rank * c.count * es,
            _ => 0,
        };
        a.write(off, &input).unwrap();
        (a.device_ptr() + off as u64, a.device_ptr())
    } else {
        a.write(0, &input).unwrap();
        b.fill(0, big, 0xee).unwrap();
        (a.device_ptr(), b.device_ptr())
    };
    let (send, recv) = if c.in_place && c.coll == Collective::ReduceScatter {
        (a.device_ptr(), a.device_ptr() + (rank * c.count * es) as u64)
    } else {
        (send, recv)
    };
    let mut opts = c.algo.map(CallOptions::algorithm).unwrap_or_default();
    opts.accumulate_f32 = false;
    // SAFETY: a and b hold `big` bytes and outlive the synchronize below.
    unsafe {
        match c.coll {
            Collective::AllReduce => coll.all_reduce(send, recv, c.count, c.dtype, c.op, stream, &opts),
            Collective::AllGather => coll.all_gather(send, recv, c.count, c.dtype, stream, &opts),
            Collective::ReduceScatter => coll.reduce_scatter(send, recv, c.count, c.dtype, c.op, stream, &opts),
            Collective::Broadcast => coll.broadcast(send, recv, c.count, c.dtype, 1 % n, stream, &opts),
            _ => unreachable!(),
        }
    }
    .unwrap_or_else(|e| panic!("rank {rank} {c:?}: {e}"));
    coll.synchronize(stream, Duration::from_secs(60)).unwrap_or_else(|e| panic!("rank {rank} {c:?}: {e}"));
    let mut out = vec![0u8; out_elems * es];
    let src = if c.in_place { a } else { b };
    let off = if c.in_place && c.coll == Collective::ReduceScatter { rank * c.count * es } else { 0 };
    src.read(off, &mut out).unwrap();
    let mut wrong = 0;
    let mut first = Vec::new();
    for (j, chunk) in out.chunks(es).enumerate() {
        let got = decode(c.dtype, chunk);
        let want = match c.coll {
            Collective::AllReduce => reduce(c.op, c.dtype, (0..n).map(|r| input_value(c.dtype, r, j, c.op)), n),
            Collective::ReduceScatter => {
                reduce(c.op, c.dtype, (0..n).map(|r| input_value(c.dtype, r, rank * c.count + j, c.op)), n)
            }
            Collective::AllGather => input_value(c.dtype, j / c.count, j % c.count, c.op) as f64,
            Collective::Broadcast => input_value(c.dtype, 1 % n, j, c.op) as f64,
            _ => unreachable!(),
        };
        if !close(c.dtype, c.op, got, want) {
            wrong += 1;
            if first.len() < 4 {
                first.push(format!("[{j}] = {got}, want {want}"));
            }
        }
    }
    (wrong, first)
}

fn sweep(n: usize, cases: &[Case]) {
    let t = Instant::now();
    // Buffers are allocated once per rank: freeing memory between cases would wait for the
    // whole GPU, including peers' kernels that wait for this rank.
    let need = cases
        .iter()
        .map(|c| match c.coll {
            Collective::AllGather | Collective::ReduceScatter => c.count * n,
            _ => c.count,
        } * c.dtype.size())
        .max()
        .unwrap_or(16);
    let results = ranks(n, |_| Config::new(0).timeout(Duration::from_secs(20)), |rank, coll, stream| {
        let ctx = mscclpp::Context::new();
        let bufs = (
            DeviceBuffer::new(&ctx, 0, need, TransportFlags::NONE).unwrap(),
            DeviceBuffer::new(&ctx, 0, need, TransportFlags::NONE).unwrap(),
        );
        let r = cases.iter().map(|c| run_case(rank, n, coll, stream, &bufs, c)).collect::<Vec<_>>();
        let _ = stream.synchronize(Duration::from_secs(60));
        coll_barrier(coll);
        r
    });
    let mut bad = Vec::new();
    for (rank, res) in results.iter().enumerate() {
        for (c, (wrong, first)) in cases.iter().zip(res) {
            if *wrong > 0 {
                bad.push(format!("rank {rank} {c:?}: {wrong} wrong, {first:?}"));
            }
        }
    }
    println!("{n} ranks: {} cases in {:?}, {} wrong", cases.len(), t.elapsed(), bad.len());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

const COUNTS: &[usize] = &[1, 2, 3, 7, 8, 15, 16, 17, 255, 1000, 4097, 65_537, 262_147];

fn cases_for(n: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for &count in COUNTS {
        for (i, coll) in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast].into_iter().enumerate() {
            for algo in [None, Some(Algorithm::AllPair), Some(Algorithm::Packet), Some(Algorithm::Simple)] {
                if algo.is_some_and(|a| !a.serves(coll)) {
                    continue;
                }
                let dtype = DataType::ALL[(count + i) % 5];
                let op = if coll.reduces() { [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg, ReduceOp::Prod][(count / 3 + i) % 5] } else { ReduceOp::Sum };
                let packet_too_big = algo.is_some_and(|a| a.is_packet()) && count * n * 4 > (1 << 20);
                if packet_too_big {
                    continue;
                }
                v.push(Case { coll, dtype, op, count, algo, in_place: (count + i) % 2 == 0 });
            }
        }
    }
    // Every type with every op on AllReduce, in and out of place.
    for d in DataType::ALL {
        for op in ReduceOp::ALL {
            for in_place in [false, true] {
                v.push(Case { coll: Collective::AllReduce, dtype: d, op, count: 1001, algo: None, in_place });
                v.push(Case { coll: Collective::ReduceScatter, dtype: d, op, count: 333, algo: Some(Algorithm::Simple), in_place });
            }
        }
    }
    // Large: rounds of the staged algorithms (64 MiB of f32 + a tail).
    v.push(Case { coll: Collective::AllReduce, dtype: DataType::F32, op: ReduceOp::Sum, count: (16 << 20) + 5, algo: None, in_place: true });
    v.push(Case { coll: Collective::AllGather, dtype: DataType::Bf16, op: ReduceOp::Sum, count: (8 << 20) + 3, algo: None, in_place: false });
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_ranks_every_collective_type_op_and_size() {
    sweep(2, &cases_for(2));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn three_ranks_every_collective_type_op_and_size() {
    sweep(3, &cases_for(3));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn four_ranks_every_collective_type_op_and_size() {
    sweep(4, &cases_for(4));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eight_ranks_every_collective_type_op_and_size() {
    sweep(8, &cases_for(8));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_replays_ten_thousand_times_with_changing_inputs() {
    let n = 4;
    let replays = 10_000usize;
    let res = ranks(n, |_| Config::new(0), |rank, coll, stream| {
        let ctx = mscclpp::Context::new();
        let count = 2048usize; // 8 KiB of f32: allpair
        let big_count = (1 << 20) + 3; // packet/simple beyond
        let a = DeviceBuffer::new(&ctx, 0, big_count * 4, TransportFlags::NONE).unwrap();
        let b = DeviceBuffer::new(&ctx, 0, big_count * 4, TransportFlags::NONE).unwrap();
        let c = DeviceBuffer::new(&ctx, 0, big_count * 4, TransportFlags::NONE).unwrap();
        stream.begin_capture().unwrap();
        // SAFETY: a, b and c outlive every replay (synchronized below).
        unsafe {
            coll.all_reduce(a.device_ptr(), b.device_ptr(), count, DataType::F32, ReduceOp::Sum, stream, &CallOptions::default()).unwrap();
            coll.all_reduce(a.device_ptr(), c.device_ptr(), big_count, DataType::F32, ReduceOp::Sum, stream, &CallOptions::default()).unwrap();
        }
        let graph = stream.end_capture().unwrap();
        let mut wrong = 0usize;
        for k in 0..replays {
            // New inputs every replay: element i of rank r is (r + 1) * (k + i % 5).
            let head: Vec<u8> = (0..count).flat_map(|i| (((rank + 1) * (k % 1000 + i % 5)) as f32).to_le_bytes()).collect();
            a.write(0, &head).unwrap();
            graph.launch(stream).unwrap();
            if k % 1000 == 999 {
                // An eager call between replays keeps the state consistent too.
                // SAFETY: as above.
                unsafe { coll.all_reduce(a.device_ptr(), c.device_ptr(), 1, DataType::F32, ReduceOp::Sum, stream, &CallOptions::default()).unwrap() };
            }
            coll.synchronize(stream, Duration::from_secs(30)).unwrap_or_else(|e| panic!("rank {rank} replay {k}: {e}"));
            let mut out = vec![0u8; count * 4];
            b.read(0, &mut out).unwrap();
            let total: usize = (1..=n).sum();
            for (i, w) in out.chunks(4).enumerate() {
                let got = f32::from_le_bytes(w.try_into().unwrap());
                if got != (total * (k % 1000 + i % 5)) as f32 {
                    wrong += 1;
                }
            }
        }
        wrong
    });
    println!("{n} ranks, {replays} graph replays: wrong elements per rank {res:?}");
    assert!(res.iter().all(|&w| w == 0), "{res:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_missing_rank_is_named_within_the_timeout_and_teardown_finishes() {
    let n = 3;
    let gate = Barrier::new(n);
    let t = Instant::now();
    let res = ranks(n, |_| Config::new(0).timeout(Duration::from_secs(2)), |rank, coll, stream| {
        let ctx = mscclpp::Context::new();
        let a = DeviceBuffer::new(&ctx, 0, 1 << 20, TransportFlags::NONE).unwrap();
        let mut outcome = Vec::new();
        if rank != 2 {
            for algo in [Algorithm::AllPair, Algorithm::Simple] {
                // SAFETY: a outlives the synchronize.
                let r = unsafe {
                    coll.all_reduce(a.device_ptr(), a.device_ptr(), 4096, DataType::F32, ReduceOp::Sum, stream, &CallOptions::algorithm(algo))
                }
                .and_then(|_| coll.synchronize(stream, Duration::from_secs(20)))
                .map_or_else(|e| (e.kind(), e.peer(), e.to_string()), |_| (ErrorKind::Internal, None, "no error".to_string()));
                outcome.push(r);
            }
        }
        gate.wait();
        outcome
    });
    println!("missing rank: {res:?} after {:?}", t.elapsed());
    for r in 0..2 {
        let (kind, peer, msg) = &res[r][0];
        assert_eq!(*kind, ErrorKind::Timeout, "rank {r}: {msg}");
        assert_eq!(*peer, Some(2), "rank {r}: {msg}");
        assert!(msg.contains("rank 2"), "{msg}");
        // The second call is refused (the first failure is kept), without hanging.
        assert_ne!(res[r][1].0, ErrorKind::Internal, "{:?}", res[r][1]);
    }
    assert!(t.elapsed() < Duration::from_secs(60), "teardown took {:?}", t.elapsed());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mismatched_calls_are_named_not_corrupted() {
    let n = 2;
    let res = ranks(n, |_| Config::new(0).timeout(Duration::from_secs(3)), |rank, coll, stream| {
        let ctx = mscclpp::Context::new();
        let a = DeviceBuffer::new(&ctx, 0, 1 << 16, TransportFlags::NONE).unwrap();
        let count = if rank == 0 { 1000 } else { 1001 };
        // SAFETY: a outlives the synchronize.
        let r = unsafe { coll.all_reduce(a.device_ptr(), a.device_ptr(), count, DataType::F32, ReduceOp::Sum, stream, &CallOptions::default()) }
            .and_then(|_| coll.synchronize(stream, Duration::from_secs(20)));
        r.map_err(|e| (e.kind(), e.peer(), e.to_string()))
    });
    println!("mismatch: {res:?}");
    for (rank, r) in res.iter().enumerate() {
        let (kind, peer, msg) = r.as_ref().unwrap_err();
        assert_eq!(*kind, ErrorKind::InvalidUsage, "{msg}");
        assert_eq!(*peer, Some(1 - rank), "{msg}");
        assert!(msg.contains("different collective call"), "{msg}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_buffers_are_refused_before_launch() {
    let res = ranks(2, |_| Config::new(0), |_rank, coll, stream| {
        let ctx = mscclpp::Context::new();
        let a = DeviceBuffer::new(&ctx, 0, 4096, TransportFlags::NONE).unwrap();
        let host = [0u8; 4096];
        let mut errs = Vec::new();
        let o = CallOptions::default();
        // SAFETY: every call below is refused before launch (the test checks it is).
        unsafe {
            errs.push(coll.all_reduce(a.device_ptr(), a.device_ptr(), 2048, DataType::F32, ReduceOp::Sum, stream, &o).unwrap_err());
            errs.push(coll.all_reduce(host.as_ptr() as u64, a.device_ptr(), 16, DataType::F32, ReduceOp::Sum, stream, &o).unwrap_err());
            errs.push(coll.all_reduce(a.device_ptr() + 2, a.device_ptr(), 16, DataType::F32, ReduceOp::Sum, stream, &o).unwrap_err());
            errs.push(coll.all_gather(a.device_ptr(), a.device_ptr(), 1024, DataType::F32, stream, &o).unwrap_err());
            errs.push(coll.broadcast(a.device_ptr(), a.device_ptr(), 16, DataType::F32, 5, stream, &o).unwrap_err());
            errs.push(coll.all_reduce(a.device_ptr(), a.device_ptr(), 16, DataType::F32, ReduceOp::Sum, stream, &CallOptions::algorithm(Algorithm::AllPair).shape(1, 33)).unwrap_err());
        }
        // Nothing was launched, so the communicator still works.
        a.write(0, &[1u8; 64]).unwrap();
        coll.all_reduce_buffers(&a, &a, 16, DataType::U32, ReduceOp::Sum, stream).unwrap();
        coll.synchronize(stream, Duration::from_secs(10)).unwrap();
        (errs.iter().map(|e| (e.kind(), e.to_string())).collect::<Vec<_>>(), a.read_u64(0).unwrap())
    });
    for (errs, word) in res {
        for (k, m) in &errs {
            assert_eq!(*k, ErrorKind::InvalidUsage, "{m}");
        }
        assert!(errs[0].1.contains("runs past the end"), "{}", errs[0].1);
        assert!(errs[1].1.contains("not device memory") || errs[1].1.contains("host memory"), "{}", errs[1].1);
        assert!(errs[2].1.contains("not aligned"), "{}", errs[2].1);
        assert!(errs[4].1.contains("root 5"), "{}", errs[4].1);
        assert_eq!(word, 0x0202_0202_0202_0202);
    }
}
