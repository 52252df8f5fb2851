//! A generated all-pair AllReduce plan registered with `mscclpp-collectives`' selector and served
//! through `Collectives::all_reduce`: 2 ranks as threads on GPU 0, results checked exactly (i32).
//! Needs a CUDA GPU: `cargo test -p mscclpp-executor --test selector_gpu -- --ignored`.

use std::sync::Arc;
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, RootServer, TcpBootstrap, Transport};
use mscclpp_collectives::{CallOptions, Collectives, Config, DataType, ReduceOp};
use mscclpp_executor::generate::{self, Algorithm};
use mscclpp_executor::{ExecutionPlan, Executor, ExecutorConfig, PlanAlgorithm, Protocol};

fn value(r: usize, e: usize) -> i32 {
    (r as i32 + 1).wrapping_mul(1_000_003).wrapping_add((e as i32).wrapping_mul(7919))
}

fn rank_main(rank: usize, n: usize, id: &mscclpp::UniqueId, protocol: Protocol) -> Vec<(String, Vec<i32>)> {
    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(Duration::from_secs(70)).initialize(id).unwrap());
    let comm = Communicator::new(bs.clone());
    let coll = Collectives::new(&comm, Config::new(0).tune(false).timeout(Duration::from_secs(20))).unwrap();
    let exec = Arc::new(Executor::new(&comm, ExecutorConfig::new(0).timeout(Duration::from_secs(20))));
    let plan = generate::plan(Algorithm::AllPairAllReduce, n, protocol, true).unwrap();
    let name = plan.name.clone();
    // Served up to 64 KiB; larger calls keep the built-in algorithms.
    let algo = PlanAlgorithm::new(exec, ExecutionPlan::new(plan)).unwrap().size_range(0, 64 << 10);
    coll.register_algorithm(Arc::new(algo)).unwrap();
    assert_eq!(coll.registered_algorithms(), vec![name.clone()]);
    let stream = Stream::new(0).unwrap();
    let mut out = Vec::new();
    let mut bufs = Vec::new();
    // Elements: a multiple of the plan's chunks per rank (n) so the plan divides it.
    for (count, opts, label) in [
        (1024usize, CallOptions::default(), "selected"),
        (1024, CallOptions::external(&name), "by name"),
        (1024, CallOptions::algorithm(mscclpp_collectives::Algorithm::Packet), "built-in forced"),
        (1 << 16, CallOptions::default(), "above the range"),
    ] {
        let buf = DeviceBuffer::new(comm.context(), 0, count * 4, Transport::CudaIpc.into()).unwrap();
        let input: Vec<u8> = (0..count).flat_map(|e| value(rank, e).to_le_bytes()).collect();
        buf.write(0, &input).unwrap();
        // New buffers: the plan's first use on them is a collective host call; every rank's
        // earlier kernels have finished (synchronized below) before anyone gets here.
        bs.barrier().unwrap();
        // SAFETY: buf holds count i32 and outlives the call (synchronized below).
        unsafe {
            coll.all_reduce(buf.device_ptr(), buf.device_ptr(), count, DataType::I32, ReduceOp::Sum, &stream, &opts)
        }
        .unwrap();
        coll.synchronize(&stream, Duration::from_secs(30)).unwrap();
        let got: Vec<i32> =
            buf.to_vec().unwrap().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        out.push((label.to_string(), got));
        // Kept until the executor is gone: it mapped the buffer into the peer.
        bufs.push(buf);
    }
    bs.barrier().unwrap();
    // The executor (held by the registered algorithm) goes first, then the buffers.
    drop(coll);
    bs.barrier().unwrap();
    drop(bufs);
    out
}

fn run(protocol: Protocol) {
    let n = 2;
    all_hw_queues();
    let (root, id) = RootServer::start(n, Duration::from_secs(70)).unwrap();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let id = id.clone();
                s.spawn(move || rank_main(r, n, &id, protocol))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    drop(root);
    for (rank, res) in results.iter().enumerate() {
        for (label, got) in res {
            let want: Vec<i32> =
                (0..got.len()).map(|e| (0..n).fold(0i32, |a, q| a.wrapping_add(value(q, e)))).collect();
            assert_eq!(got, &want, "rank {rank}, {label}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn registered_allpair_plan_serves_all_reduce_ll() {
    run(Protocol::LL);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn registered_allpair_plan_serves_all_reduce_simple() {
    run(Protocol::Simple);
}

/// Ranks that register different algorithms fail on every rank, naming the other. Runs on CPU
/// only up to `Collectives::new`, which needs a GPU: so ignored too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn mismatched_registration_fails_on_every_rank() {
    let n = 2;
    all_hw_queues();
    let (root, id) = RootServer::start(n, Duration::from_secs(70)).unwrap();
    let errs = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let id = id.clone();
                s.spawn(move || {
                    let bs = Arc::new(
                        TcpBootstrap::config(rank, n).timeout(Duration::from_secs(70)).initialize(&id).unwrap(),
                    );
                    let comm = Communicator::new(bs);
                    let coll = Collectives::new(&comm, Config::new(0).tune(false)).unwrap();
                    let exec = Arc::new(Executor::new(&comm, ExecutorConfig::new(0)));
                    let plan = generate::plan(Algorithm::AllPairAllReduce, n, Protocol::LL, true).unwrap();
                    let max = if rank == 0 { 1 << 10 } else { 1 << 20 };
                    let algo = PlanAlgorithm::new(exec, ExecutionPlan::new(plan)).unwrap().size_range(0, max);
                    let e = coll.register_algorithm(Arc::new(algo)).unwrap_err();
                    assert!(coll.registered_algorithms().is_empty());
                    e
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    drop(root);
    for e in errs {
        assert!(e.message().contains("different algorithms"), "{e}");
        assert_eq!(e.peer(), Some(1));
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
