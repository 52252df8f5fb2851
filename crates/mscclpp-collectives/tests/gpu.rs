//! Collectives on a real GPU: N ranks as threads of this process on GPU 0 (each its own
//! bootstrap, communicator, stream and `Collectives`), every result compared with a CPU
//! reference. Marked `#[ignore = "needs a CUDA GPU"]`; run with `--ignored` on a GPU machine.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, ErrorKind, RootServer, TcpBootstrap, TransportFlags};
use mscclpp_collectives::{Algorithm, CallOptions, Collective, Collectives, Config, DataType, ReduceOp};

mod common;
use common::{Case, cases_for, coll_barrier, run_case};

/// Runs `f(rank, coll, stream)` on `n` rank threads and returns their results in rank order.
fn ranks<T: Send>(
    n: usize,
    config: impl Fn(usize) -> Config + Sync,
    f: impl Fn(usize, &Collectives, &Stream) -> T + Sync,
) -> Vec<T> {
    all_hw_queues();
    let (root, id) = RootServer::start(n, Duration::from_secs(60)).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, f, config) = (id.clone(), &f, &config);
                s.spawn(move || {
                    let bs = Arc::new(
                        TcpBootstrap::config(rank, n).timeout(Duration::from_secs(60)).initialize(&id).unwrap(),
                    );
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

fn sweep(n: usize, cases: &[Case]) {
    sweep_with(n, cases, Config::new(0).tune(false).timeout(Duration::from_secs(20)));
}

/// [`sweep`] with every rank set up with `config`.
fn sweep_with(n: usize, cases: &[Case], config: Config) {
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
    let results = ranks(
        n,
        |_| config.clone(),
        |rank, coll, stream| {
            let ctx = mscclpp::Context::new();
            let bufs = (
                DeviceBuffer::new(&ctx, 0, need, TransportFlags::NONE).unwrap(),
                DeviceBuffer::new(&ctx, 0, need, TransportFlags::NONE).unwrap(),
            );
            let r = cases.iter().map(|c| run_case(rank, n, coll, stream, &bufs, c)).collect::<Vec<_>>();
            let _ = stream.synchronize(Duration::from_secs(60));
            coll_barrier(coll);
            r
        },
    );
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

/// The staged algorithms with rounds of 48 KiB (the scratch's round capacity set small), on
/// messages of two rounds and 20 bytes, 3 ranks, in and out of place, 60 times each: every call
/// exact. Each round's block barriers pair block b with block b of every peer, which orders the
/// reuse of scratch only where block b used the same bytes the round before; a last round
/// sliced by its own (shorter) length handed bytes to other blocks, and a rank ahead of a peer
/// overwrote scratch that peer still read (seen once on an H100 with 3 processes: an AllReduce
/// of 64 MiB + 20 bytes returned 4 elements of its last round in the middle one's place).
#[test]
#[ignore = "needs a CUDA GPU"]
fn staged_calls_with_a_short_last_round_stay_exact() {
    let n = 3usize;
    let round = 3 * 16 * 1024usize;
    let simple = Some(Algorithm::Simple);
    let mut cases = Vec::new();
    for it in 0..60 {
        let in_place = it % 2 == 0;
        for (coll, bytes) in [
            (Collective::AllReduce, 2 * round + 20),
            // Per-rank segments: ReduceScatter's rounds hold round / 3 of each.
            (Collective::ReduceScatter, 2 * (round / n) + 20),
            (Collective::AllGather, 2 * round + 20),
            (Collective::Broadcast, 2 * round + 20),
        ] {
            let op = ReduceOp::Sum;
            cases.push(Case { coll, dtype: DataType::F32, op, count: bytes / 4, algo: simple, in_place });
        }
    }
    sweep_with(n, &cases, Config::new(0).tune(false).timeout(Duration::from_secs(20)).simple_bytes(round as u64));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_replays_ten_thousand_times_with_changing_inputs() {
    let n = 4;
    let replays = 10_000usize;
    let res = ranks(
        n,
        |_| Config::new(0).tune(false),
        |rank, coll, stream| {
            let ctx = mscclpp::Context::new();
            let count = 2048usize; // 8 KiB of f32: allpair
            let big_count = (1 << 20) + 3; // packet/simple beyond
            let a = DeviceBuffer::new(&ctx, 0, big_count * 4, TransportFlags::NONE).unwrap();
            let b = DeviceBuffer::new(&ctx, 0, big_count * 4, TransportFlags::NONE).unwrap();
            let c = DeviceBuffer::new(&ctx, 0, big_count * 4, TransportFlags::NONE).unwrap();
            stream.begin_capture().unwrap();
            // SAFETY: a, b and c outlive every replay (synchronized below).
            unsafe {
                coll.all_reduce(
                    a.device_ptr(),
                    b.device_ptr(),
                    count,
                    DataType::F32,
                    ReduceOp::Sum,
                    stream,
                    &CallOptions::default(),
                )
                .unwrap();
                coll.all_reduce(
                    a.device_ptr(),
                    c.device_ptr(),
                    big_count,
                    DataType::F32,
                    ReduceOp::Sum,
                    stream,
                    &CallOptions::default(),
                )
                .unwrap();
            }
            let graph = stream.end_capture().unwrap();
            let mut wrong = 0usize;
            for k in 0..replays {
                // New inputs every replay: element i of rank r is (r + 1) * (k + i % 5).
                let head: Vec<u8> =
                    (0..count).flat_map(|i| (((rank + 1) * (k % 1000 + i % 5)) as f32).to_le_bytes()).collect();
                a.write(0, &head).unwrap();
                graph.launch(stream).unwrap();
                if k % 1000 == 999 {
                    // An eager call between replays keeps the state consistent too.
                    // SAFETY: as above.
                    unsafe {
                        coll.all_reduce(
                            a.device_ptr(),
                            c.device_ptr(),
                            1,
                            DataType::F32,
                            ReduceOp::Sum,
                            stream,
                            &CallOptions::default(),
                        )
                        .unwrap()
                    };
                }
                coll.synchronize(stream, Duration::from_secs(30))
                    .unwrap_or_else(|e| panic!("rank {rank} replay {k}: {e}"));
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
        },
    );
    println!("{n} ranks, {replays} graph replays: wrong elements per rank {res:?}");
    assert!(res.iter().all(|&w| w == 0), "{res:?}");
}

/// Calls issued back to back on one stream, each reading what the one before it wrote (in place,
/// no host synchronization between them), eager and replayed from a graph, with programmatic
/// dependent launches on (where the GPU takes them): a kernel is then scheduled while its
/// predecessor still runs and must not read its input before that one has finished. Every call
/// doubles the values (f32, exact: powers of two), so a call that read a stale input leaves a
/// value off by a power of two.
#[test]
#[ignore = "needs a CUDA GPU"]
fn back_to_back_calls_read_their_predecessors_results() {
    let n = 2usize;
    let chain = 40i32;
    // allpair, packet and staged sizes (f32 elements).
    let counts = [2048usize, 64 << 10, (1 << 20) + 5];
    let res = ranks(
        n,
        |_| Config::new(0).tune(false).programmatic_launch(true),
        |rank, coll, stream| {
            if rank == 0 {
                println!("programmatic launches of up to {} blocks", coll.programmatic_blocks());
            }
            let ctx = mscclpp::Context::new();
            let max = counts[2];
            let a = DeviceBuffer::new(&ctx, 0, max * 4, TransportFlags::NONE).unwrap();
            let b = DeviceBuffer::new(&ctx, 0, max * 4, TransportFlags::NONE).unwrap();
            let init = |i: usize| ((rank + 1) * (i % 7 + 1)) as f32;
            // After k in-place sums every element is 2^(k-1) times the first sum (exact in f32).
            let first = |i: usize| ((n * (n + 1) / 2) * (i % 7 + 1)) as f32;
            let expect = |i: usize, k: i32| first(i) * 2f32.powi(k - 1);
            let call = |src: &DeviceBuffer, dst: &DeviceBuffer, count: usize| {
                // SAFETY: a and b outlive every call (the stream is synchronized before the
                // closure returns).
                unsafe {
                    coll.all_reduce(
                        src.device_ptr(),
                        dst.device_ptr(),
                        count,
                        DataType::F32,
                        ReduceOp::Sum,
                        stream,
                        &CallOptions::default(),
                    )
                }
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
            };
            let check = |buf: &DeviceBuffer, count: usize, k: i32, what: &str| -> usize {
                coll.synchronize(stream, Duration::from_secs(60)).unwrap_or_else(|e| panic!("rank {rank} {what}: {e}"));
                let mut out = vec![0u8; count * 4];
                buf.read(0, &mut out).unwrap();
                let wrong = out
                    .chunks(4)
                    .enumerate()
                    .filter(|(i, w)| f32::from_le_bytes((*w).try_into().unwrap()) != expect(*i, k))
                    .count();
                if wrong > 0 {
                    println!("rank {rank}: {what}, {count} elements after {k} calls: {wrong} wrong");
                }
                wrong
            };
            let sentinel: Vec<u8> = (0..max).flat_map(|_| (-1f32).to_le_bytes()).collect();
            let mut wrong = 0;
            for &count in &counts {
                let fill: Vec<u8> = (0..count).flat_map(|i| init(i).to_le_bytes()).collect();
                // Eager: `chain` in-place calls, then one out of place into b.
                a.write(0, &fill).unwrap();
                b.write(0, &sentinel).unwrap();
                for _ in 0..chain {
                    call(&a, &a, count);
                }
                call(&a, &b, count);
                wrong += check(&a, count, chain, "eager chain");
                wrong += check(&b, count, chain + 1, "eager, out of place after the chain");
                // The same chain captured once and replayed twice.
                a.write(0, &fill).unwrap();
                stream.begin_capture().unwrap();
                for _ in 0..chain {
                    call(&a, &a, count);
                }
                let graph = stream.end_capture().unwrap();
                graph.launch(stream).unwrap();
                graph.launch(stream).unwrap();
                wrong += check(&a, count, 2 * chain, "two graph replays");
            }
            wrong
        },
    );
    println!("{n} ranks, back-to-back chains: wrong elements per rank {res:?}");
    assert!(res.iter().all(|&w| w == 0), "{res:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_missing_rank_is_named_within_the_timeout_and_teardown_finishes() {
    let n = 3;
    let gate = Barrier::new(n);
    let t = Instant::now();
    let res = ranks(
        n,
        |_| Config::new(0).tune(false).timeout(Duration::from_secs(2)),
        |rank, coll, stream| {
            let ctx = mscclpp::Context::new();
            let a = DeviceBuffer::new(&ctx, 0, 1 << 20, TransportFlags::NONE).unwrap();
            let mut outcome = Vec::new();
            if rank != 2 {
                for algo in [Algorithm::AllPair, Algorithm::Simple] {
                    // SAFETY: a outlives the synchronize.
                    let r = unsafe {
                        coll.all_reduce(
                            a.device_ptr(),
                            a.device_ptr(),
                            4096,
                            DataType::F32,
                            ReduceOp::Sum,
                            stream,
                            &CallOptions::algorithm(algo),
                        )
                    }
                    .and_then(|_| coll.synchronize(stream, Duration::from_secs(20)))
                    .map_or_else(
                        |e| (e.kind(), e.peer(), e.to_string()),
                        |_| (ErrorKind::Internal, None, "no error".to_string()),
                    );
                    outcome.push(r);
                }
            }
            gate.wait();
            outcome
        },
    );
    println!("missing rank: {res:?} after {:?}", t.elapsed());
    for (r, outcome) in res.iter().take(2).enumerate() {
        let (kind, peer, msg) = &outcome[0];
        assert_eq!(*kind, ErrorKind::Timeout, "rank {r}: {msg}");
        assert_eq!(*peer, Some(2), "rank {r}: {msg}");
        assert!(msg.contains("rank 2"), "{msg}");
        // The second call is refused (the first failure is kept), without hanging.
        assert_ne!(outcome[1].0, ErrorKind::Internal, "{:?}", outcome[1]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mismatched_calls_are_named_not_corrupted() {
    let n = 2;
    let res = ranks(
        n,
        |_| Config::new(0).tune(false).timeout(Duration::from_secs(3)),
        |rank, coll, stream| {
            let ctx = mscclpp::Context::new();
            let a = DeviceBuffer::new(&ctx, 0, 1 << 16, TransportFlags::NONE).unwrap();
            let count = if rank == 0 { 1000 } else { 1001 };
            // SAFETY: a outlives the synchronize.
            let r = unsafe {
                coll.all_reduce(
                    a.device_ptr(),
                    a.device_ptr(),
                    count,
                    DataType::F32,
                    ReduceOp::Sum,
                    stream,
                    &CallOptions::default(),
                )
            }
            .and_then(|_| coll.synchronize(stream, Duration::from_secs(20)));
            r.map_err(|e| (e.kind(), e.peer(), e.to_string()))
        },
    );
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
    let res = ranks(
        2,
        |_| Config::new(0).tune(false),
        |_rank, coll, stream| {
            let ctx = mscclpp::Context::new();
            let a = DeviceBuffer::new(&ctx, 0, 4096, TransportFlags::NONE).unwrap();
            let host = [0u8; 4096];
            let mut errs = Vec::new();
            let o = CallOptions::default();
            // SAFETY: every call below is refused before launch (the test checks it is).
            unsafe {
                errs.push(
                    coll.all_reduce(a.device_ptr(), a.device_ptr(), 2048, DataType::F32, ReduceOp::Sum, stream, &o)
                        .unwrap_err(),
                );
                errs.push(
                    coll.all_reduce(host.as_ptr() as u64, a.device_ptr(), 16, DataType::F32, ReduceOp::Sum, stream, &o)
                        .unwrap_err(),
                );
                errs.push(
                    coll.all_reduce(a.device_ptr() + 2, a.device_ptr(), 16, DataType::F32, ReduceOp::Sum, stream, &o)
                        .unwrap_err(),
                );
                errs.push(
                    coll.all_gather(a.device_ptr(), a.device_ptr(), 1024, DataType::F32, stream, &o).unwrap_err(),
                );
                errs.push(
                    coll.broadcast(a.device_ptr(), a.device_ptr(), 16, DataType::F32, 5, stream, &o).unwrap_err(),
                );
                errs.push(
                    coll.all_reduce(
                        a.device_ptr(),
                        a.device_ptr(),
                        16,
                        DataType::F32,
                        ReduceOp::Sum,
                        stream,
                        &CallOptions::algorithm(Algorithm::AllPair).shape(1, 33),
                    )
                    .unwrap_err(),
                );
            }
            // Nothing was launched, so the communicator still works.
            a.write(0, &[1u8; 64]).unwrap();
            coll.all_reduce_buffers(&a, &a, 16, DataType::U32, ReduceOp::Sum, stream).unwrap();
            coll.synchronize(stream, Duration::from_secs(10)).unwrap();
            (errs.iter().map(|e| (e.kind(), e.to_string())).collect::<Vec<_>>(), a.read_u64(0).unwrap())
        },
    );
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn tuning_agrees_on_every_rank_and_tuned_calls_are_right() {
    for n in [2usize, 8] {
        let t = Instant::now();
        let res = ranks(
            n,
            |_| Config::new(0).tune(true),
            |rank, coll, stream| {
                let table = coll.tuning().expect("tuning ran");
                let cases: Vec<Case> = [1usize << 9, 3000, 1 << 15, (1 << 19) + 1, 1 << 22]
                    .into_iter()
                    .map(|count| Case {
                        coll: Collective::AllReduce,
                        dtype: DataType::Bf16,
                        op: ReduceOp::Sum,
                        count,
                        algo: None,
                        in_place: true,
                    })
                    .collect();
                let ctx = mscclpp::Context::new();
                let bufs = (
                    DeviceBuffer::new(&ctx, 0, 16 << 20, TransportFlags::NONE).unwrap(),
                    DeviceBuffer::new(&ctx, 0, 16 << 20, TransportFlags::NONE).unwrap(),
                );
                let wrong: usize = cases.iter().map(|c| run_case(rank, n, coll, stream, &bufs, c).0).sum();
                coll_barrier(coll);
                (table, wrong)
            },
        );
        println!("{n} ranks: setup with tuning took {:?}", t.elapsed());
        for ((bytes, plan), us) in res[0].0.entries.iter().zip(&res[0].0.micros) {
            println!(
                "  {bytes:>9} B: {:>7} x{:>3} blocks x{:>4} threads  {us:8.2} us",
                plan.algorithm.name(),
                plan.blocks,
                plan.threads
            );
        }
        assert_eq!(res[0].0.entries.len(), 15);
        for (rank, (table, wrong)) in res.iter().enumerate() {
            assert_eq!(table.entries, res[0].0.entries, "rank {rank} adopted another table");
            assert_eq!(*wrong, 0, "rank {rank}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_copy_all_reduce_on_registered_windows() {
    for n in [2usize, 3, 4, 8] {
        let res = ranks(
            n,
            |_| Config::new(0).tune(false),
            |rank, coll, stream| {
                let ctx = mscclpp::Context::new();
                let max = (4 << 20) + 64;
                let a = DeviceBuffer::new(&ctx, 0, max, TransportFlags::NONE).unwrap();
                let b = DeviceBuffer::new(&ctx, 0, max, TransportFlags::NONE).unwrap();
                // SAFETY: a and b outlive both windows (dropped at the end of this closure, after
                // the barrier below).
                let (out_of_place, in_place) = unsafe {
                    (
                        coll.register_window(a.device_ptr(), b.device_ptr(), max).unwrap(),
                        coll.register_window(a.device_ptr(), a.device_ptr(), max).unwrap(),
                    )
                };
                let mut wrong = 0usize;
                for (i, &count) in [1usize, 7, 1000, 4097, 65_537, (1 << 20) + 3].iter().enumerate() {
                    let d = DataType::ALL[i % 5];
                    let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][i % 3];
                    let input = common::input_bytes(d, rank, count, op);
                    for (w, dst) in [(&out_of_place, &b), (&in_place, &a)] {
                        a.write(0, &input).unwrap();
                        coll.all_reduce_window(w, count, d, op, stream).unwrap();
                        coll.synchronize(stream, Duration::from_secs(30)).unwrap();
                        let mut out = vec![0u8; count * d.size()];
                        dst.read(0, &mut out).unwrap();
                        for (j, c) in out.chunks(d.size()).enumerate() {
                            let want = common::reduce(op, d, (0..n).map(|r| common::input_value(d, r, j, op)), n);
                            if common::decode(d, c) != want {
                                wrong += 1;
                            }
                        }
                    }
                }
                // Graph replays of a zero-copy call.
                let count = 1 << 18;
                let input = common::input_bytes(DataType::F32, rank, count, ReduceOp::Sum);
                a.write(0, &input).unwrap();
                stream.begin_capture().unwrap();
                coll.all_reduce_window(&out_of_place, count, DataType::F32, ReduceOp::Sum, stream).unwrap();
                let g = stream.end_capture().unwrap();
                for _ in 0..100 {
                    g.launch(stream).unwrap();
                }
                coll.synchronize(stream, Duration::from_secs(30)).unwrap();
                let mut out = vec![0u8; count * 4];
                b.read(0, &mut out).unwrap();
                for (j, c) in out.chunks(4).enumerate() {
                    let want = common::reduce(
                        ReduceOp::Sum,
                        DataType::F32,
                        (0..n).map(|r| common::input_value(DataType::F32, r, j, ReduceOp::Sum)),
                        n,
                    );
                    if common::decode(DataType::F32, c) != want {
                        wrong += 1;
                    }
                }
                coll_barrier(coll);
                wrong
            },
        );
        println!("zero-copy, {n} ranks: wrong elements per rank {res:?}");
        assert!(res.iter().all(|&w| w == 0), "{n} ranks: {res:?}");
    }
}

/// Builds `Collectives` on `n` rank threads with `config(rank)` and returns every rank's
/// outcome (the error's text on failure), then passes a closing barrier.
fn setups(n: usize, config: impl Fn(usize) -> Config + Sync) -> Vec<Result<(), (ErrorKind, String)>> {
    all_hw_queues();
    let (root, id) = RootServer::start(n, Duration::from_secs(60)).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, config) = (id.clone(), &config);
                s.spawn(move || {
                    let bs = Arc::new(
                        TcpBootstrap::config(rank, n).timeout(Duration::from_secs(60)).initialize(&id).unwrap(),
                    );
                    let comm = Communicator::new(bs.clone());
                    let r = Collectives::new(&comm, config(rank)).map(drop).map_err(|e| (e.kind(), e.to_string()));
                    bs.barrier().unwrap();
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(root);
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_scratch_too_large_for_the_gpu_fails_every_rank_at_setup() {
    // Every rank asks for a 512 GiB scratch (a valid layout, more than the GPU holds): each
    // allocation fails, and every rank returns that error at the agreed exchange instead of
    // waiting for the others' scratch until the bootstrap timeout.
    let out = setups(3, |_| Config::new(0).tune(false).simple_bytes(1 << 38));
    println!("{out:?}");
    for (r, o) in out.iter().enumerate() {
        let (kind, msg) = o.clone().unwrap_err();
        assert_eq!(kind, ErrorKind::Cuda, "rank {r}: {msg}");
        assert!(msg.contains("allocating the collectives' buffers"), "rank {r}: {msg}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_set_up_differently_is_refused_naming_it() {
    // Rank 1's staging rounds differ: its kernels would address peers' scratch with another
    // layout. Every rank refuses at setup, before anything is allocated, naming a rank that
    // differs from it.
    let out = setups(3, |rank| {
        let c = Config::new(0).tune(false);
        if rank == 1 { c.simple_bytes(1 << 26) } else { c }
    });
    println!("{out:?}");
    for (r, o) in out.iter().enumerate() {
        let (kind, msg) = o.clone().unwrap_err();
        assert_eq!(kind, ErrorKind::InvalidUsage, "rank {r}: {msg}");
        let named = if r == 1 { 0 } else { 1 };
        assert!(msg.contains(&format!("rank {named} set up its collectives with")), "rank {r}: {msg}");
    }
}

/// Gives this process's rank threads their own hardware queues (`use_all_hw_queues`); every
/// test calls it before its first thread or CUDA call.
fn all_hw_queues() {
    // SAFETY: only the first call in the process writes; the GPU tests run one at a time
    // (--test-threads=1, as the GPU bundle runs them) and this precedes every thread and CUDA
    // call of the first test, so nothing else reads or writes the environment then.
    let _ = unsafe { mscclpp::gpu::use_all_hw_queues() };
}
