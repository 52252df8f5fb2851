//! Plans on a real GPU: N ranks as threads of this process on GPU 0 (each its own bootstrap,
//! communicator, executor and stream), every result compared bit for bit with a CPU reference on
//! integer data. The GPU tests are `#[ignore = "needs a CUDA GPU"]`; run them with `--ignored`.
//! `reference_agrees_with_the_interpreter` runs anywhere: the reference the GPU results are held
//! to equals the CPU interpreter's result for every generated plan.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, RootServer, TcpBootstrap, Transport};
use mscclpp_executor::generate::{self, Algorithm};
use mscclpp_executor::{
    DataType, DeviceFailureKind, ExecError, ExecutionPlan, Executor, ExecutorConfig, KernelKind, PacketType, Plan,
    Protocol,
};

/// Rank r's input element e (distinct, and sums stay exact in i32 with wrapping).
fn value(r: usize, e: usize) -> i32 {
    (r as i32 + 1).wrapping_mul(1_000_003).wrapping_add((e as i32).wrapping_mul(7919))
}

/// What rank `r` must hold after `plan` on inputs of `chunk` elements per chunk.
fn reference(plan: &Plan, r: usize, chunk: usize, input: &dyn Fn(usize, usize) -> i32) -> Vec<i32> {
    let n = plan.gpus.len();
    let g = &plan.gpus[r];
    match plan.collective.as_str() {
        "allreduce" => (0..g.input_chunks as usize * chunk)
            .map(|e| (0..n).fold(0i32, |a, q| a.wrapping_add(input(q, e))))
            .collect(),
        "allgather" => (0..n).flat_map(|q| (0..chunk).map(move |e| input(q, e))).collect(),
        "reducescatter" => {
            let per = g.output_chunks as usize * chunk;
            (0..per).map(|e| (0..n).fold(0i32, |a, q| a.wrapping_add(input(q, r * per + e)))).collect()
        }
        other => panic!("no reference for {other}"),
    }
}

#[test]
fn reference_agrees_with_the_interpreter() {
    for n in [2, 3, 4] {
        for plan in generate::all(n) {
            let inputs: Vec<Vec<i64>> = (0..n)
                .map(|r| (0..plan.gpus[r].input_chunks as usize).map(|c| i64::from(value(r, c))).collect())
                .collect();
            let out = mscclpp_executor::sim::simulate(&plan, &inputs).unwrap();
            for r in 0..n {
                let g = &plan.gpus[r];
                let got: Vec<i64> = match (plan.collective.as_str(), plan.inplace) {
                    ("allreduce", true) => out.input[r].clone(),
                    ("reducescatter", true) => {
                        let per = g.output_chunks as usize;
                        out.input[r][r * per..(r + 1) * per].to_vec()
                    }
                    _ => out.output[r].clone(),
                };
                let want: Vec<i64> = reference(&plan, r, 1, &|q, e| value(q, e)).into_iter().map(i64::from).collect();
                let got: Vec<i64> = got.into_iter().map(|v| i64::from(v as i32)).collect();
                assert_eq!(got, want, "{} rank {r}", plan.name);
            }
        }
    }
}

/// Bootstrap waits in these tests: longer than any kernel timeout and synchronize below, shorter
/// than run.sh's per-test cap, so a rank stranded on the host fails with an error naming the peer
/// instead of being killed without a word.
const BOOTSTRAP_WAIT: Duration = Duration::from_secs(70);

/// Runs `f(rank, comm)` on `n` rank threads with one bootstrap each.
fn ranks<T: Send>(n: usize, f: impl Fn(usize, &Communicator) -> T + Sync) -> Vec<T> {
    // SAFETY: ranks are threads of this process and need their own hardware queues (see
    // use_all_hw_queues). Only the first call in the process writes; the GPU tests run one at a
    // time (--test-threads=1, as the GPU bundle runs them) and this precedes every thread and
    // CUDA call of the first test, so nothing else reads or writes the environment then.
    let _ = unsafe { mscclpp::gpu::use_all_hw_queues() };
    let (root, id) = RootServer::start(n, BOOTSTRAP_WAIT).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, f) = (id.clone(), &f);
                s.spawn(move || {
                    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(BOOTSTRAP_WAIT).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let r = f(rank, &comm);
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

fn to_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn from_bytes(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// One rank's buffers for `plan` with `chunk` elements per chunk: (send ptr, recv ptr, send
/// bytes, recv bytes, where the result is: (buffer, offset)).
struct Bufs {
    a: DeviceBuffer,
    b: DeviceBuffer,
    send: u64,
    recv: u64,
    send_size: u64,
    recv_size: u64,
}

/// One `execute` of `plan` by `rank` on `bufs`, i32 data (every test's call).
///
/// # Safety
/// As [`Executor::execute`]: the buffers stay valid until the call's work on `stream` ends.
unsafe fn execute_i32(
    ex: &Executor,
    rank: usize,
    bufs: &Bufs,
    plan: &ExecutionPlan,
    stream: &Stream,
    packet: PacketType,
) -> Result<(), ExecError> {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        ex.execute(rank, bufs.send, bufs.recv, bufs.send_size, bufs.recv_size, DataType::Int32, plan, stream, packet)
    }
}

fn buffers(comm: &Communicator, plan: &Plan, rank: usize, chunk: usize) -> Bufs {
    let g = &plan.gpus[rank];
    let cb = (chunk * 4) as u64;
    let (ib, ob) = (g.input_chunks * cb, g.output_chunks * cb);
    let big = ib.max(ob) as usize;
    let ipc = Transport::CudaIpc.into();
    let a = DeviceBuffer::new(comm.context(), 0, big, ipc).unwrap();
    let b = DeviceBuffer::new(comm.context(), 0, big, ipc).unwrap();
    let (send, recv) = if !plan.inplace {
        (a.device_ptr(), b.device_ptr())
    } else if ib == ob {
        (a.device_ptr(), a.device_ptr())
    } else if ib < ob {
        (a.device_ptr() + rank as u64 * ib, a.device_ptr())
    } else {
        (a.device_ptr(), a.device_ptr() + rank as u64 * ob)
    };
    Bufs { a, b, send, recv, send_size: ib, recv_size: ob }
}

/// Writes rank's input (at the send pointer) and zeroes the rest.
fn fill(bufs: &Bufs, rank: usize) {
    let n_in = (bufs.send_size / 4) as usize;
    bufs.a.write(0, &vec![0u8; bufs.a.len()]).unwrap();
    bufs.b.write(0, &vec![0u8; bufs.b.len()]).unwrap();
    let input: Vec<i32> = (0..n_in).map(|e| value(rank, e)).collect();
    let off = (bufs.send - bufs.a.device_ptr()) as usize;
    bufs.a.write(off, &to_bytes(&input)).unwrap();
}

fn result(bufs: &Bufs) -> Vec<i32> {
    let (buf, base) =
        if bufs.recv == bufs.b.device_ptr() { (&bufs.b, bufs.b.device_ptr()) } else { (&bufs.a, bufs.a.device_ptr()) };
    let mut out = vec![0u8; bufs.recv_size as usize];
    buf.read((bufs.recv - base) as usize, &mut out).unwrap();
    from_bytes(&out)
}

/// Runs every plan on `n` ranks, `iters` times each, and returns the failures.
fn run_plans(
    n: usize,
    plans: &[Plan],
    chunk: usize,
    iters: usize,
    config: impl Fn() -> ExecutorConfig + Sync,
) -> Vec<String> {
    let plans: Vec<ExecutionPlan> = plans.iter().cloned().map(ExecutionPlan::new).collect();
    let start = Instant::now();
    let res = ranks(n, |rank, comm| {
        let stream = Stream::new(0).unwrap();
        let mut bad = Vec::new();
        for p in &plans {
            // An executor per plan: `synchronize` reports a failure of any plan the executor ran,
            // so one failed plan would otherwise be reported again by every later one.
            let ex = Executor::new(comm, config());
            for packet in [PacketType::LL16, PacketType::LL8] {
                if p.plan().protocol == Protocol::Simple && packet == PacketType::LL8 {
                    continue;
                }
                let bufs = buffers(comm, p.plan(), rank, chunk);
                for it in 0..iters {
                    if rank == 0 {
                        // Progress on stderr (run.sh keeps it): where a hang or failure started.
                        eprintln!("[{:7.2}s] {} {packet:?} iteration {it}", start.elapsed().as_secs_f64(), p.name());
                    }
                    fill(&bufs, rank);
                    comm.bootstrap().barrier().unwrap();
                    // SAFETY: the buffers live until after the stream is synchronized below.
                    let r = unsafe { execute_i32(&ex, rank, &bufs, p, &stream, packet) }
                        .and_then(|_| ex.synchronize(&stream, Duration::from_secs(60)));
                    comm.bootstrap().barrier().unwrap();
                    if let Err(e) = r {
                        eprintln!(
                            "[{:7.2}s] {} {packet:?} rank {rank} iteration {it}: {e}",
                            start.elapsed().as_secs_f64(),
                            p.name()
                        );
                        bad.push(format!("{} {packet:?} rank {rank} iteration {it}: {e}", p.name()));
                        break;
                    }
                    let got = result(&bufs);
                    let want = reference(p.plan(), rank, chunk, &|q, e| value(q, e));
                    if got != want {
                        let first = got.iter().zip(&want).position(|(a, b)| a != b);
                        bad.push(format!(
                            "{} {packet:?} rank {rank} iteration {it}: first wrong element {first:?} of {}",
                            p.name(),
                            want.len()
                        ));
                        break;
                    }
                }
                comm.bootstrap().barrier().unwrap();
                // Keep the buffers until every rank is done with this plan (peers map them).
                std::mem::forget(bufs);
            }
            let _ = stream.synchronize(Duration::from_secs(60));
            comm.bootstrap().barrier().unwrap();
            drop(ex);
        }
        let _ = stream.synchronize(Duration::from_secs(60));
        comm.bootstrap().barrier().unwrap();
        bad
    });
    res.into_iter().flatten().collect()
}

fn generated(n: usize, algos: &[Algorithm]) -> Vec<Plan> {
    let mut v = Vec::new();
    for &a in algos {
        for protocol in [Protocol::Simple, Protocol::LL] {
            for inplace in [true, false] {
                v.extend(generate::plan(a, n, protocol, inplace));
            }
        }
    }
    v
}

const FLAT: &[Algorithm] =
    &[Algorithm::AllPairAllReduce, Algorithm::RingAllReduce, Algorithm::AllGather, Algorithm::ReduceScatter];

fn cfg() -> ExecutorConfig {
    ExecutorConfig::new(0).timeout(Duration::from_secs(20))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn generated_plans_2_ranks_match_the_reference() {
    let bad = run_plans(2, &generated(2, FLAT), 1024, 3, cfg);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn generated_plans_4_ranks_match_the_reference() {
    let bad = run_plans(4, &generated(4, FLAT), 1024, 3, cfg);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_and_odd_chunks_match_the_reference() {
    // 1 MiB chunks (vector paths) and 12-element chunks (48 bytes: 16-byte aligned, few packets).
    let mut bad = run_plans(2, &generated(2, FLAT), 1 << 18, 2, cfg);
    bad.extend(run_plans(4, &generated(4, &[Algorithm::AllPairAllReduce, Algorithm::RingAllReduce]), 12, 2, cfg));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_plans_run_through_the_proxy_over_cuda_ipc() {
    let bad = run_plans(4, &generated(4, &[Algorithm::HierarchicalAllReduce]), 1024, 3, cfg);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn port_channel_plans_run_through_the_proxy_over_ethernet() {
    let bad = run_plans(4, &generated(4, &[Algorithm::HierarchicalAllReduce]), 1024, 2, || {
        cfg().port_transport(Transport::Ethernet)
    });
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The per-plan kernels (whatever `MSCCLPP_EXECUTOR_KERNEL` says): every generated plan shape,
/// the one-hop splits, odd chunks, and port channels through the proxy.
#[test]
#[ignore = "needs a CUDA GPU"]
fn per_plan_kernels_match_the_reference() {
    let per_plan = || cfg().kernel(KernelKind::PerPlan);
    let mut bad = run_plans(2, &generated(2, FLAT), 1024, 3, per_plan);
    bad.extend(run_plans(4, &generated(4, FLAT), 12, 2, per_plan));
    let one_hop: Vec<Plan> = [(1, 128), (4, 256), (32, 512)]
        .iter()
        .filter_map(|&(b, t)| generate::one_hop_allreduce(2, false, b, t))
        .collect();
    bad.extend(run_plans(2, &one_hop, 4096, 3, per_plan));
    bad.extend(run_plans(4, &generated(4, &[Algorithm::HierarchicalAllReduce]), 1024, 2, per_plan));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_capture_and_replays_match_the_reference() {
    let plans: Vec<ExecutionPlan> = [
        generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::LL, false),
        generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::Simple, false),
        generate::plan(Algorithm::RingAllReduce, 2, Protocol::LL, false),
    ]
    .into_iter()
    .flatten()
    .map(ExecutionPlan::new)
    .collect();
    let bad = ranks(2, |rank, comm| {
        let ex = Executor::new(comm, cfg());
        let stream = Stream::new(0).unwrap();
        let mut bad = Vec::new();
        for p in &plans {
            let bufs = buffers(comm, p.plan(), rank, 4096);
            fill(&bufs, rank);
            // SAFETY: the buffers are forgotten (never freed) below.
            unsafe { ex.prepare(rank, bufs.send, bufs.recv, bufs.send_size, bufs.recv_size, p) }.unwrap();
            stream.begin_capture().unwrap();
            // SAFETY: as above.
            let r = unsafe { execute_i32(&ex, rank, &bufs, p, &stream, PacketType::LL16) };
            let graph = stream.end_capture().unwrap();
            r.unwrap();
            let want = reference(p.plan(), rank, 4096, &|q, e| value(q, e));
            for replay in 0..20 {
                bufs.b.write(0, &vec![0u8; bufs.b.len()]).unwrap();
                comm.bootstrap().barrier().unwrap();
                graph.launch(&stream).unwrap();
                let r = ex.synchronize(&stream, Duration::from_secs(60));
                comm.bootstrap().barrier().unwrap();
                if let Err(e) = r {
                    bad.push(format!("{} replay {replay}: {e}", p.name()));
                    break;
                }
                if result(&bufs) != want {
                    bad.push(format!("{} rank {rank} replay {replay}: wrong result", p.name()));
                    break;
                }
            }
            // Back to back, no host sync between replays: the flag and scratch halves advance on the GPU.
            for _ in 0..50 {
                graph.launch(&stream).unwrap();
            }
            if let Err(e) = ex.synchronize(&stream, Duration::from_secs(60)) {
                bad.push(format!("{} back-to-back replays: {e}", p.name()));
            } else if result(&bufs) != want {
                bad.push(format!("{} rank {rank}: wrong result after back-to-back replays", p.name()));
            }
            comm.bootstrap().barrier().unwrap();
            std::mem::forget(bufs);
        }
        bad
    });
    let bad: Vec<String> = bad.into_iter().flatten().collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_missing_rank_is_named_within_the_timeout() {
    let timeout = Duration::from_secs(2);
    let plan = ExecutionPlan::new(generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::Simple, false).unwrap());
    let out = ranks(2, |rank, comm| {
        let ex = Executor::new(comm, ExecutorConfig::new(0).timeout(timeout));
        let stream = Stream::new(0).unwrap();
        let bufs = buffers(comm, plan.plan(), rank, 1024);
        fill(&bufs, rank);
        // SAFETY: the buffers are forgotten (never freed) below.
        unsafe { ex.prepare(rank, bufs.send, bufs.recv, bufs.send_size, bufs.recv_size, &plan) }.unwrap();
        let r = if rank == 0 {
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { execute_i32(&ex, rank, &bufs, &plan, &stream, PacketType::LL16) }.unwrap();
            let r = ex.synchronize(&stream, Duration::from_secs(30));
            Some((r, t.elapsed()))
        } else {
            None // rank 1 never runs the plan
        };
        // The failure is sticky: the next call is refused at once with the same report.
        // SAFETY: as above.
        let again = (rank == 0).then(|| unsafe { execute_i32(&ex, rank, &bufs, &plan, &stream, PacketType::LL16) });
        let _ = stream.synchronize(Duration::from_secs(30));
        comm.bootstrap().barrier().unwrap();
        // Both ranks' kernels are done (rank 0's failed, rank 1 launched none).
        let diag = ex.diagnostics();
        comm.bootstrap().barrier().unwrap();
        std::mem::forget(bufs);
        (r, again.map(|a| a.is_err()), diag)
    });
    let (r, elapsed) = out[0].0.as_ref().map(|(r, t)| (r, *t)).unwrap();
    match r {
        Err(e @ ExecError::Device { kind: DeviceFailureKind::Timeout, peer: Some(1), .. }) => {
            assert!(e.to_string().contains("rank 1"), "{e}");
            println!("rank 0 reported after {elapsed:?}: {e}");
        }
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
    assert!(elapsed < timeout + Duration::from_secs(3), "reported after {elapsed:?}");
    assert_eq!(out[0].1, Some(true), "a later call after the failure must be refused");
    // The diagnostics tell a launch that ran from one that never did, and pair the channels:
    // the token each rank signals is the one its peer waits on.
    let (d0, d1) = (&out[0].2, &out[1].2);
    println!("diagnostics:\n{}\n{}", d0.join("\n"), d1.join("\n"));
    assert_eq!((d0.len(), d1.len()), (1, 1), "one cached plan per rank");
    assert!(d0[0].contains("launches issued 1, block 0 of launch 1 started last"), "{}", d0[0]);
    assert!(d1[0].contains("launches issued 0, block 0 of launch 0 started last"), "{}", d1[0]);
    let field = |line: &str, peer: usize, key: &str| -> String {
        let at = line.find(&format!("memory channel with rank {peer}: ")).unwrap_or_else(|| panic!("{line}"));
        let rest = &line[at..];
        let k = rest.find(key).unwrap_or_else(|| panic!("{key} in {rest}")) + key.len();
        rest[k..].split([' ', ',', ';']).next().unwrap().to_string()
    };
    assert_eq!(field(&d0[0], 1, "signals into "), field(&d1[0], 0, "inbound "));
    assert_eq!(field(&d1[0], 0, "signals into "), field(&d0[0], 1, "inbound "));
    assert!(
        d0[0].contains(&format!("inbound {} = 0,", field(&d0[0], 1, "inbound "))),
        "rank 1 never signalled: {}",
        d0[0]
    );
}

/// Host cost of `execute` with cached resources (the launch included), 2 ranks, beside the raw
/// baseline of the same threads in the same run: `cuLaunchKernel` of an empty kernel taking a
/// 120-byte argument (the size of the interpreter's). Bursts of 16 and of 256 calls, the stream
/// drained between bursts; only the calls are timed and the median burst reported. If the
/// 256-call bursts cost more per call than the 16-call ones, the launch queue filled and the
/// loop timed the GPU rather than the host. Then the same calls with the ranks in turns, each
/// timed alone (the cost a process with one rank pays, without the other thread's launches
/// contending for the context), the median of 256.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_cost_per_execute_with_cached_resources() {
    use mscclpp::device::compile::{CompileOptions, KernelModule, compile};
    const EMPTY: &str = "struct A { unsigned long long w[15]; };\n\
                         extern \"C\" __global__ void empty_launch(A a) { if (a.w[0] == 1) asm volatile(\"trap;\"); }\n";
    let plan = ExecutionPlan::new(generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::LL, false).unwrap());
    let ptx = compile(EMPTY, &CompileOptions::for_device(0)).unwrap();
    let costs = ranks(2, |rank, comm| {
        let ex = Executor::new(comm, cfg());
        let stream = Stream::new(0).unwrap();
        let module = KernelModule::load(0, &ptx).unwrap();
        let empty = module.function("empty_launch").unwrap();
        let bufs = buffers(comm, plan.plan(), rank, 256);
        fill(&bufs, rank);
        // SAFETY: the buffers are forgotten (never freed) below.
        unsafe { ex.prepare(rank, bufs.send, bufs.recv, bufs.send_size, bufs.recv_size, &plan) }.unwrap();
        let one = |raw: bool| {
            if raw {
                let mut a = [0u64; 15];
                let mut params = [a.as_mut_ptr().cast::<std::ffi::c_void>()];
                // SAFETY: the kernel takes one 120-byte struct by value; `a` outlives the call.
                unsafe { empty.launch((1, 1, 1), (32, 1, 1), 0, &stream, &mut params) }.unwrap();
            } else {
                // SAFETY: the buffers are forgotten (never freed) below, so they outlive every
                // launch.
                unsafe { execute_i32(&ex, rank, &bufs, &plan, &stream, PacketType::LL16) }.unwrap();
            }
        };
        // Both ranks' threads launching at once (they contend for the context's launch path).
        let timed = |n: u32, raw: bool| {
            let mut per_burst = Vec::new();
            for _ in 0..8 {
                comm.bootstrap().barrier().unwrap();
                let t = Instant::now();
                for _ in 0..n {
                    one(raw);
                }
                per_burst.push(t.elapsed() / n);
                ex.synchronize(&stream, Duration::from_secs(60)).unwrap();
            }
            per_burst.sort();
            per_burst[per_burst.len() / 2]
        };
        // The ranks in turns, each call timed alone while the other rank waits at a barrier (a
        // process with one rank, as users run): call k of both ranks is issued before either
        // issues call k + 1, as ranks that are threads must (see mscclpp-perf's lockstep.rs).
        let turns = |n: u32, raw: bool| {
            let mut each = Vec::new();
            for _ in 0..n {
                for r in 0..2 {
                    comm.bootstrap().barrier().unwrap();
                    if r == rank {
                        let t = Instant::now();
                        one(raw);
                        each.push(t.elapsed());
                    }
                }
            }
            comm.bootstrap().barrier().unwrap();
            ex.synchronize(&stream, Duration::from_secs(60)).unwrap();
            each.sort();
            each[each.len() / 2]
        };
        let row = [
            timed(16, true),
            timed(16, false),
            timed(256, true),
            timed(256, false),
            turns(256, true),
            turns(256, false),
        ];
        comm.bootstrap().barrier().unwrap();
        std::mem::forget(bufs);
        row
    });
    for (rank, c) in costs.iter().enumerate() {
        println!(
            "RESULT host cost per call, rank {rank}: bursts of 16: empty launch {:?}, execute {:?}; bursts of 256: empty launch {:?}, execute {:?}; alone (ranks in turns, median of 256): empty launch {:?}, execute {:?}",
            c[0], c[1], c[2], c[3], c[4], c[5]
        );
    }
}
