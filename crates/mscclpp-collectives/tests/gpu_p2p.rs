//! The point-to-point path on a real GPU: N ranks as threads of this process on GPU 0, every
//! received byte compared exactly. Marked `#[ignore = "needs a CUDA GPU"]`; run with
//! `--ignored` on a GPU machine (under MPS when ranks are processes; threads share a context).
//!
//! Ranks share one GPU, and freeing, allocating and the synchronous copies of a `DeviceBuffer`
//! may wait for the whole GPU, including a peer's kernel that spins waiting for this rank: a
//! deadlock until that kernel's timeout. So every test keeps host work and kernels apart across
//! ranks ([`device_phase`]): all its buffers are allocated and its inputs written before the
//! first launch ([`ranks`]'s `setup`), each group of launches runs between two bootstrap
//! barriers (and is synchronized inside them), host reads come after the closing barrier, and
//! the buffers are dropped after a final barrier.
//!
//! Wait bounds: a device wait fails after [`P2P_TIMEOUT`] naming the peer; a stream
//! synchronize gives up after [`SYNC`] (longer, so that the kernel's own timeout reports
//! first); a bootstrap barrier after [`WAIT`] (longer than a phase, so that a rank that failed
//! and left makes its peers fail rather than hang). A test thus ends, pass or fail, within about
//! its phases times `SYNC` plus one `WAIT`.

use std::sync::Arc;
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, RootServer, TcpBootstrap, TransportFlags};
use mscclpp_collectives::{P2pConfig, P2pOp, PointToPoint};

/// The bootstrap's limit (setup, barriers).
const WAIT: Duration = Duration::from_secs(30);
/// The device wait limit of the point-to-point kernels.
const P2P_TIMEOUT: Duration = Duration::from_secs(4);
/// The stream synchronize limit of a device phase.
const SYNC: Duration = Duration::from_secs(10);

/// Runs `launch` as a device phase of this rank: a barrier before it (every rank finished its
/// host work: allocations, writes, reads, frees) and one after it (every rank's kernels are
/// done, as `launch` synchronizes what it enqueues). Between a closing barrier and the next
/// opening one no kernel of any rank runs, so host work there cannot deadlock. `launch`'s result
/// is returned after the closing barrier, so a failed rank still lines up with its peers.
fn device_phase<T>(barrier: &dyn Fn(), launch: impl FnOnce() -> T) -> T {
    barrier();
    let r = launch();
    barrier();
    r
}

/// The bootstrap barrier of `comm`, for [`device_phase`].
fn barrier_of(comm: &Communicator) -> impl Fn() + '_ {
    move || comm.bootstrap().barrier().unwrap_or_else(|e| panic!("rank {}: barrier: {e}", comm.rank()))
}

/// Launches `ops` on `stream` in a device phase and waits for them; the error (if any) names
/// the peer.
///
/// # Safety
/// As [`PointToPoint::launch`]: the pointers hold their bytes past the phase.
unsafe fn run_group(comm: &Communicator, p2p: &PointToPoint, stream: &Stream, ops: &[P2pOp]) -> mscclpp::Result<()> {
    device_phase(&barrier_of(comm), || {
        // SAFETY: the caller's contract.
        unsafe { p2p.launch(ops, stream) }?;
        stream.synchronize(SYNC)?;
        p2p.check()
    })
}

/// Runs `n` rank threads: each builds its `PointToPoint` (collective), runs `setup(rank, comm)`
/// (every allocation and input write of the test, before any launch), then, after a barrier,
/// `body(rank, comm, p2p, stream, &buffers)`; then synchronizes, passes a final barrier and only
/// then drops the buffers and the `PointToPoint`.
fn ranks<B, T: Send>(
    n: usize,
    config: impl Fn() -> P2pConfig + Sync,
    setup: impl Fn(usize, &Communicator) -> B + Sync,
    body: impl Fn(usize, &Communicator, &PointToPoint, &Stream, &B) -> T + Sync,
) -> Vec<T> {
    all_hw_queues();
    let (root, id) = RootServer::start(n, WAIT).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, setup, body, config) = (id.clone(), &setup, &body, &config);
                s.spawn(move || {
                    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(WAIT).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let p2p = PointToPoint::new(&comm, config()).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    let stream = Stream::new(0).unwrap();
                    let bufs = setup(rank, &comm);
                    // Nobody launches before every rank has allocated and written everything.
                    bs.barrier().unwrap();
                    let r = body(rank, &comm, &p2p, &stream, &bufs);
                    let _ = stream.synchronize(SYNC);
                    // Nobody frees before every rank's kernels are done.
                    bs.barrier().unwrap();
                    drop(bufs);
                    drop(p2p);
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(root);
    out
}

/// Byte `i` of the message from `src` to `dst` in round `round`.
fn byte(src: usize, dst: usize, round: usize, i: usize) -> u8 {
    ((src * 31 + dst * 7 + round * 13 + i) % 251) as u8
}
fn message(src: usize, dst: usize, round: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(src, dst, round, i)).collect()
}

/// A buffer of `len` bytes (at least 1) holding `content` (then zeros), or `0xee` everywhere
/// when `content` is empty (a receive buffer). Only in `setup`.
fn buffer(comm: &Communicator, len: usize, content: &[u8]) -> DeviceBuffer {
    let b = DeviceBuffer::new(comm.context(), 0, len.max(1), TransportFlags::NONE).unwrap();
    if content.is_empty() {
        b.fill(0, len.max(1), 0xee).unwrap();
    } else {
        b.write(0, content).unwrap();
    }
    b
}

/// Sizes that hit one chunk, partial 16-byte units, odd bytes, several blocks and several
/// rounds of the ring (small slots so that rounds happen at small sizes).
const SIZES: [usize; 7] = [1, 7, 4096, 4100, (64 << 10) + 3, 1 << 20, (3 << 20) + 18];

fn small_slots() -> P2pConfig {
    P2pConfig::new(0).slot_bytes(64 << 10).max_blocks_per_peer(4).timeout(P2P_TIMEOUT)
}

fn ring(n: usize) {
    ranks(
        n,
        small_slots,
        // Every round's send and receive buffers, inputs written.
        |rank, comm| {
            let next = (rank + 1) % n;
            SIZES
                .iter()
                .enumerate()
                .map(|(round, &len)| (buffer(comm, len, &message(rank, next, round, len)), buffer(comm, len, &[])))
                .collect::<Vec<_>>()
        },
        |rank, comm, p2p, stream, bufs| {
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            for (round, (&len, (sb, rb))) in SIZES.iter().zip(bufs).enumerate() {
                let ops = [
                    P2pOp::Send { peer: next, ptr: sb.device_ptr(), bytes: len as u64 },
                    P2pOp::Recv { peer: prev, ptr: rb.device_ptr(), bytes: len as u64 },
                ];
                // SAFETY: both buffers hold len bytes and live until after the final barrier.
                unsafe { run_group(comm, p2p, stream, &ops) }
                    .unwrap_or_else(|e| panic!("rank {rank}: ring of {len} bytes: {e}"));
                let got = rb.to_vec().unwrap();
                assert!(
                    got[..len] == message(prev, rank, round, len)[..],
                    "rank {rank}: ring of {len} bytes from {prev}"
                );
            }
        },
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_2_3_4_ranks() {
    for n in [2, 3, 4] {
        ring(n);
    }
}

/// The buffers of [`all_to_all_and_ordered_sends_4_ranks`].
struct AllToAll {
    /// Per chunk size: (send, receive) of n chunks.
    a2a: Vec<(usize, DeviceBuffer, DeviceBuffer)>,
    /// The two ordered messages: (send, receive) each.
    ordered: [(usize, DeviceBuffer, DeviceBuffer); 2],
}

/// All-to-all as one group: a send and a receive per peer, a copy for this rank's own chunk;
/// then two sends to the same peer in one group (they pair in order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn all_to_all_and_ordered_sends_4_ranks() {
    let n = 4;
    ranks(
        n,
        small_slots,
        |rank, comm| {
            let a2a = [16usize, 100_000]
                .iter()
                .map(|&chunk| {
                    let input: Vec<u8> = (0..n).flat_map(|p| message(rank, p, 0, chunk)).collect();
                    (chunk, buffer(comm, chunk * n, &input), buffer(comm, chunk * n, &[]))
                })
                .collect();
            // Two messages to the next rank in one group, of different sizes.
            let next = (rank + 1) % n;
            let ordered = [(300_000usize, 1usize), (5, 2)]
                .map(|(len, round)| (len, buffer(comm, len, &message(rank, next, round, len)), buffer(comm, len, &[])));
            AllToAll { a2a, ordered }
        },
        |rank, comm, p2p, stream, bufs| {
            for (chunk, sb, rb) in &bufs.a2a {
                let chunk = *chunk;
                let mut ops = Vec::new();
                for p in 0..n {
                    let (s, r) = (sb.device_ptr() + (p * chunk) as u64, rb.device_ptr() + (p * chunk) as u64);
                    if p == rank {
                        ops.push(P2pOp::Copy { dst: r, src: s, bytes: chunk as u64 });
                    } else {
                        ops.push(P2pOp::Send { peer: p, ptr: s, bytes: chunk as u64 });
                        ops.push(P2pOp::Recv { peer: p, ptr: r, bytes: chunk as u64 });
                    }
                }
                // SAFETY: the buffers hold n chunks and live until after the final barrier.
                unsafe { run_group(comm, p2p, stream, &ops) }
                    .unwrap_or_else(|e| panic!("rank {rank}: all-to-all of {chunk}-byte chunks: {e}"));
                let got = rb.to_vec().unwrap();
                for p in 0..n {
                    assert!(
                        got[p * chunk..(p + 1) * chunk] == message(p, rank, 0, chunk)[..],
                        "rank {rank}: chunk of {p} ({chunk} bytes)"
                    );
                }
            }
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let ops: Vec<P2pOp> = bufs
                .ordered
                .iter()
                .flat_map(|(len, s, r)| {
                    [
                        P2pOp::Send { peer: next, ptr: s.device_ptr(), bytes: *len as u64 },
                        P2pOp::Recv { peer: prev, ptr: r.device_ptr(), bytes: *len as u64 },
                    ]
                })
                .collect();
            // SAFETY: as above.
            unsafe { run_group(comm, p2p, stream, &ops) }
                .unwrap_or_else(|e| panic!("rank {rank}: two ordered sends: {e}"));
            for (i, (len, _, r)) in bufs.ordered.iter().enumerate() {
                assert!(
                    r.to_vec().unwrap()[..*len] == message(prev, rank, i + 1, *len)[..],
                    "rank {rank}: message {i}"
                );
            }
        },
    );
}

/// A ring captured once in a CUDA graph and replayed: every replay moves the buffers' current
/// contents (the sequence numbers advance on the GPU).
#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_in_a_cuda_graph_3_ranks() {
    let n = 3;
    let len = (200 << 10) + 4;
    ranks(
        n,
        small_slots,
        |rank, comm| (buffer(comm, len, &message(rank, (rank + 1) % n, 0, len)), buffer(comm, len, &[])),
        |rank, comm, p2p, stream, (sb, rb)| {
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let ops = [
                P2pOp::Send { peer: next, ptr: sb.device_ptr(), bytes: len as u64 },
                P2pOp::Recv { peer: prev, ptr: rb.device_ptr(), bytes: len as u64 },
            ];
            // One eager call first: the graph continues its sequence.
            // SAFETY: the buffers live until after the final barrier.
            unsafe { run_group(comm, p2p, stream, &ops) }.unwrap_or_else(|e| panic!("rank {rank}: eager: {e}"));
            assert!(rb.to_vec().unwrap()[..len] == message(prev, rank, 0, len)[..], "rank {rank} eager call");
            // The capture (and the graph's instantiation) is host work: no rank's kernel runs.
            stream.begin_capture().unwrap();
            // SAFETY: as above (captured, not run).
            let captured = unsafe { p2p.launch(&ops, stream) };
            let graph = stream.end_capture().unwrap();
            captured.unwrap();
            for round in 1..6 {
                // Host phase: the next input (no rank's kernel runs between phases).
                sb.write(0, &message(rank, next, round, len)).unwrap();
                device_phase(&barrier_of(comm), || {
                    graph.launch(stream)?;
                    stream.synchronize(SYNC)?;
                    p2p.check()
                })
                .unwrap_or_else(|e| panic!("rank {rank} replay {round}: {e}"));
                assert!(
                    rb.to_vec().unwrap()[..len] == message(prev, rank, round, len)[..],
                    "rank {rank} replay {round}"
                );
            }
            // The graph is destroyed here, after the last phase's closing barrier.
        },
    );
}

/// A receive with no matching send ends within the timeout with an error naming the peer; a
/// size mismatch is reported as such.
#[test]
#[ignore = "needs a CUDA GPU"]
fn missing_and_mismatched_sends_fail_naming_the_peer() {
    let cfg = || P2pConfig::new(0).timeout(Duration::from_secs(2));
    let one = |_: usize, comm: &Communicator| buffer(comm, 64, &[]);
    let errs = ranks(2, cfg, one, |rank, comm, p2p, stream, b| {
        let op = if rank == 0 {
            P2pOp::Recv { peer: 1, ptr: b.device_ptr(), bytes: 64 }
        } else {
            P2pOp::Send { peer: 0, ptr: b.device_ptr(), bytes: 32 }
        };
        // SAFETY: b holds 64 bytes and lives until after the final barrier.
        unsafe { run_group(comm, p2p, stream, &[op]) }.err().map(|e| e.to_string())
    });
    let e0 = errs[0].clone().unwrap_or_default();
    assert!(e0.contains("rank 1") && e0.contains("another size"), "{e0}");
    let errs = ranks(2, cfg, one, |rank, comm, p2p, stream, b| {
        // Only rank 0 launches; rank 1 lines up in the phase's barriers (and allocates nothing
        // while rank 0's kernel waits for it).
        let ops: Vec<P2pOp> =
            if rank == 0 { vec![P2pOp::Recv { peer: 1, ptr: b.device_ptr(), bytes: 64 }] } else { Vec::new() };
        // SAFETY: as above.
        unsafe { run_group(comm, p2p, stream, &ops) }.err().map(|e| e.to_string())
    });
    let e0 = errs[0].clone().unwrap_or_default();
    assert!(e0.contains("rank 1") && e0.contains("never made the matching call"), "{e0}");
    assert!(errs[1].is_none());
}

/// [`device_phase`] on CPU threads: no rank's host work overlaps any rank's device phase.
#[test]
fn device_phases_keep_every_rank_host_work_apart_from_kernels() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};
    let (n, rounds) = (4usize, 20usize);
    let clock = AtomicU64::new(0);
    // (rank, is device phase, start, end) on one logical clock.
    let spans: Mutex<Vec<(usize, bool, u64, u64)>> = Mutex::new(Vec::new());
    let barrier = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        for rank in 0..n {
            let (clock, spans, barrier) = (&clock, &spans, &barrier);
            s.spawn(move || {
                let work = |device: bool, round: usize| {
                    let start = clock.fetch_add(1, Ordering::SeqCst);
                    // Ranks take different times, as host copies and kernels do.
                    std::thread::sleep(Duration::from_micros(((rank * 7 + round * 3) % 5) as u64 * 100));
                    let end = clock.fetch_add(1, Ordering::SeqCst);
                    spans.lock().unwrap().push((rank, device, start, end));
                };
                let wait = || {
                    barrier.wait();
                };
                for round in 0..rounds {
                    work(false, round);
                    device_phase(&wait, || work(true, round));
                }
                work(false, rounds);
            });
        }
    });
    let spans = spans.into_inner().unwrap();
    assert_eq!(spans.len(), n * (2 * rounds + 1));
    for &(hr, _, hs, he) in spans.iter().filter(|x| !x.1) {
        for &(dr, _, ds, de) in spans.iter().filter(|x| x.1) {
            assert!(
                he < ds || de < hs,
                "host work of rank {hr} [{hs}, {he}] overlaps a device phase of rank {dr} [{ds}, {de}]"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_out_of_memory_fails_every_rank_at_setup_naming_it() {
    // Rank 2 asks for slots of 1 TiB: its scratch allocation fails. The others must fail at
    // the same exchange, naming rank 2, not wait for its scratch until the bootstrap timeout.
    let n = 3;
    all_hw_queues();
    let (root, id) = RootServer::start(n, WAIT).unwrap();
    let out: Vec<Result<(), (mscclpp::ErrorKind, String)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let id = id.clone();
                s.spawn(move || {
                    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(WAIT).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let config = if rank == 2 { small_slots().slot_bytes(1 << 40) } else { small_slots() };
                    let r = PointToPoint::new(&comm, config).map(drop).map_err(|e| (e.kind(), e.to_string()));
                    bs.barrier().unwrap();
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(root);
    println!("{out:?}");
    let (kind, msg) = out[2].clone().unwrap_err();
    assert_eq!(kind, mscclpp::ErrorKind::Cuda, "rank 2: {msg}");
    for r in [0, 1] {
        let (_, msg) = out[r].clone().unwrap_err();
        assert!(msg.contains("rank 2 cannot go on"), "rank {r}: {msg}");
        assert!(msg.contains("allocating the point-to-point buffers"), "rank {r}: {msg}");
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
