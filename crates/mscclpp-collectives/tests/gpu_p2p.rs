//! The point-to-point path on a real GPU: N ranks as threads of this process on GPU 0, every
//! received byte compared exactly. Marked `#[ignore = "needs a CUDA GPU"]`; run with
//! `--ignored` on a GPU machine (under MPS when ranks are processes; threads share a context).

use std::sync::Arc;
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, RootServer, TcpBootstrap, TransportFlags};
use mscclpp_collectives::{P2pConfig, P2pOp, PointToPoint};

const WAIT: Duration = Duration::from_secs(60);

/// Runs `f(rank, comm, p2p, stream)` on `n` rank threads.
fn ranks<T: Send>(
    n: usize,
    config: impl Fn() -> P2pConfig + Sync,
    f: impl Fn(usize, &Communicator, &PointToPoint, &Stream) -> T + Sync,
) -> Vec<T> {
    let (root, id) = RootServer::start(n, WAIT).unwrap();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (id, f, config) = (id.clone(), &f, &config);
                s.spawn(move || {
                    let bs = Arc::new(TcpBootstrap::config(rank, n).timeout(WAIT).initialize(&id).unwrap());
                    let comm = Communicator::new(bs.clone());
                    let p2p = PointToPoint::new(&comm, config()).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    let stream = Stream::new(0).unwrap();
                    let r = f(rank, &comm, &p2p, &stream);
                    let _ = stream.synchronize(WAIT);
                    bs.barrier().unwrap();
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

fn buffer(comm: &Communicator, len: usize) -> DeviceBuffer {
    DeviceBuffer::new(comm.context(), 0, len.max(1), TransportFlags::NONE).unwrap()
}

/// Sizes that hit one chunk, partial 16-byte units, odd bytes, several blocks and several
/// rounds of the ring (small slots so that rounds happen at small sizes).
const SIZES: [usize; 7] = [1, 7, 4096, 4100, (64 << 10) + 3, 1 << 20, (3 << 20) + 18];

fn small_slots() -> P2pConfig {
    P2pConfig::new(0).slot_bytes(64 << 10).max_blocks_per_peer(4).timeout(Duration::from_secs(30))
}

fn ring(n: usize) {
    ranks(n, small_slots, |rank, comm, p2p, stream| {
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        for (round, &len) in SIZES.iter().enumerate() {
            let (sb, rb) = (buffer(comm, len), buffer(comm, len));
            sb.write(0, &message(rank, next, round, len)).unwrap();
            rb.fill(0, len, 0xee).unwrap();
            let ops = [
                P2pOp::Send { peer: next, ptr: sb.device_ptr(), bytes: len as u64 },
                P2pOp::Recv { peer: prev, ptr: rb.device_ptr(), bytes: len as u64 },
            ];
            // SAFETY: both buffers hold len bytes and live until the stream is synchronized.
            unsafe { p2p.launch(&ops, stream) }.unwrap();
            stream.synchronize(WAIT).unwrap();
            p2p.check().unwrap();
            let got = rb.to_vec().unwrap();
            assert!(got[..len] == message(prev, rank, round, len)[..], "rank {rank}: ring of {len} bytes from {prev}");
            comm.bootstrap().barrier().unwrap();
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_2_3_4_ranks() {
    for n in [2, 3, 4] {
        ring(n);
    }
}

/// All-to-all as one group: a send and a receive per peer, a copy for this rank's own chunk;
/// then two sends to the same peer in one group (they pair in order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn all_to_all_and_ordered_sends_4_ranks() {
    let n = 4;
    ranks(n, small_slots, |rank, comm, p2p, stream| {
        for &chunk in &[16usize, 100_000] {
            let (sb, rb) = (buffer(comm, chunk * n), buffer(comm, chunk * n));
            let mut input = Vec::new();
            for p in 0..n {
                input.extend(message(rank, p, 0, chunk));
            }
            sb.write(0, &input).unwrap();
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
            // SAFETY: the buffers hold n chunks and live until the synchronize.
            unsafe { p2p.launch(&ops, stream) }.unwrap();
            stream.synchronize(WAIT).unwrap();
            p2p.check().unwrap();
            let got = rb.to_vec().unwrap();
            for p in 0..n {
                assert!(got[p * chunk..(p + 1) * chunk] == message(p, rank, 0, chunk)[..], "rank {rank}: chunk of {p}");
            }
        }
        // Two messages to the next rank in one group, of different sizes, received in order.
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let (a, b) = (300_000usize, 5usize);
        let (sa, sb, ra, rb) = (buffer(comm, a), buffer(comm, b), buffer(comm, a), buffer(comm, b));
        sa.write(0, &message(rank, next, 1, a)).unwrap();
        sb.write(0, &message(rank, next, 2, b)).unwrap();
        let ops = [
            P2pOp::Send { peer: next, ptr: sa.device_ptr(), bytes: a as u64 },
            P2pOp::Recv { peer: prev, ptr: ra.device_ptr(), bytes: a as u64 },
            P2pOp::Send { peer: next, ptr: sb.device_ptr(), bytes: b as u64 },
            P2pOp::Recv { peer: prev, ptr: rb.device_ptr(), bytes: b as u64 },
        ];
        // SAFETY: as above.
        unsafe { p2p.launch(&ops, stream) }.unwrap();
        stream.synchronize(WAIT).unwrap();
        p2p.check().unwrap();
        assert!(ra.to_vec().unwrap()[..a] == message(prev, rank, 1, a)[..]);
        assert!(rb.to_vec().unwrap()[..b] == message(prev, rank, 2, b)[..]);
    });
}

/// A ring captured once in a CUDA graph and replayed: every replay moves the buffers' current
/// contents (the sequence numbers advance on the GPU).
#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_in_a_cuda_graph_3_ranks() {
    let n = 3;
    ranks(n, small_slots, |rank, comm, p2p, stream| {
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let len = (200 << 10) + 4;
        let (sb, rb) = (buffer(comm, len), buffer(comm, len));
        // One eager call first: the graph continues its sequence.
        let ops = [
            P2pOp::Send { peer: next, ptr: sb.device_ptr(), bytes: len as u64 },
            P2pOp::Recv { peer: prev, ptr: rb.device_ptr(), bytes: len as u64 },
        ];
        sb.write(0, &message(rank, next, 0, len)).unwrap();
        // SAFETY: the buffers live until the end of the closure, after the last synchronize.
        unsafe { p2p.launch(&ops, stream) }.unwrap();
        stream.synchronize(WAIT).unwrap();
        stream.begin_capture().unwrap();
        // SAFETY: as above.
        unsafe { p2p.launch(&ops, stream) }.unwrap();
        let graph = stream.end_capture().unwrap();
        for round in 1..6 {
            sb.write(0, &message(rank, next, round, len)).unwrap();
            comm.bootstrap().barrier().unwrap();
            graph.launch(stream).unwrap();
            stream.synchronize(WAIT).unwrap();
            p2p.check().unwrap();
            assert!(rb.to_vec().unwrap()[..len] == message(prev, rank, round, len)[..], "rank {rank} replay {round}");
            comm.bootstrap().barrier().unwrap();
        }
    });
}

/// A receive with no matching send ends within the timeout with an error naming the peer; a
/// size mismatch is reported as such.
#[test]
#[ignore = "needs a CUDA GPU"]
fn missing_and_mismatched_sends_fail_naming_the_peer() {
    let cfg = || P2pConfig::new(0).timeout(Duration::from_secs(2));
    let errs = ranks(2, cfg, |rank, comm, p2p, stream| {
        let b = buffer(comm, 64);
        let op = if rank == 0 {
            P2pOp::Recv { peer: 1, ptr: b.device_ptr(), bytes: 64 }
        } else {
            P2pOp::Send { peer: 0, ptr: b.device_ptr(), bytes: 32 }
        };
        // SAFETY: b holds 64 bytes and lives past the synchronize.
        unsafe { p2p.launch(&[op], stream) }.unwrap();
        let _ = stream.synchronize(WAIT);
        p2p.check().err().map(|e| e.to_string())
    });
    let e0 = errs[0].clone().unwrap_or_default();
    assert!(e0.contains("rank 1") && e0.contains("another size"), "{e0}");
    let errs = ranks(2, cfg, |rank, comm, p2p, stream| {
        let b = buffer(comm, 64);
        if rank == 0 {
            // SAFETY: as above.
            unsafe { p2p.launch(&[P2pOp::Recv { peer: 1, ptr: b.device_ptr(), bytes: 64 }], stream) }.unwrap();
        }
        let _ = stream.synchronize(WAIT);
        p2p.check().err().map(|e| e.to_string())
    });
    let e0 = errs[0].clone().unwrap_or_default();
    assert!(e0.contains("rank 1") && e0.contains("never made the matching call"), "{e0}");
    assert!(errs[1].is_none());
}
