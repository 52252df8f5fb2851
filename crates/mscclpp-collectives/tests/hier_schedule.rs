//! The two-level schedule on the CPU: for many groupings (one node, one rank per node, odd
//! sizes, several rounds) the simulated result of every rank equals the reference, every
//! cross-rank step is known to both ranks, no phase races, and bad groupings are refused.

use mscclpp::ErrorKind;
use mscclpp_collectives::Collective;
use mscclpp_collectives::hier::schedule::{self, Buf, Layout, Op, Phase, Schedule, Topology, chunk, simulate};

/// Deterministic pseudo-random bytes.
fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn add_u32(d: &mut [u8], s: &[u8]) {
    let v = u32::from_le_bytes([d[0], d[1], d[2], d[3]]).wrapping_add(u32::from_le_bytes([s[0], s[1], s[2], s[3]]));
    d.copy_from_slice(&v.to_le_bytes());
}
fn add_u16(d: &mut [u8], s: &[u8]) {
    let v = u16::from_le_bytes([d[0], d[1]]).wrapping_add(u16::from_le_bytes([s[0], s[1]]));
    d.copy_from_slice(&v.to_le_bytes());
}
/// Neither commutative nor associative: exposes the reduction order.
fn mix_u32(d: &mut [u8], s: &[u8]) {
    let a = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
    let b = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    d.copy_from_slice(&a.wrapping_mul(31).wrapping_add(b ^ 0x5a5a).to_le_bytes());
}

fn schedules(topo: &Topology, lay: &Layout, coll: Collective, nbytes: u64, elem: usize) -> Vec<Schedule> {
    (0..topo.nranks()).map(|r| schedule::schedule(topo, lay, r, coll, nbytes, elem).unwrap()).collect()
}

/// Element-wise reduction of every rank's input in the two-level order: within each node in
/// local order, then the nodes' results in node order.
fn reference_all_reduce(topo: &Topology, inputs: &[Vec<u8>], elem: usize, f: &dyn Fn(&mut [u8], &[u8])) -> Vec<u8> {
    let node_sum = |n: usize| {
        let mut acc = inputs[topo.rank(n, 0)].clone();
        for l in 1..topo.ranks_per_node() {
            for (d, s) in acc.chunks_mut(elem).zip(inputs[topo.rank(n, l)].chunks(elem)) {
                f(d, s);
            }
        }
        acc
    };
    let mut acc = node_sum(0);
    for n in 1..topo.nodes() {
        let b = node_sum(n);
        for (d, s) in acc.chunks_mut(elem).zip(b.chunks(elem)) {
            f(d, s);
        }
    }
    acc
}

fn check_all_reduce(
    nranks: usize,
    rpn: usize,
    count: usize,
    elem: usize,
    round: u64,
    f: &dyn Fn(&mut [u8], &[u8]),
) -> usize {
    let topo = Topology::new(nranks, rpn).unwrap();
    let lay = Layout::new(&topo, round).unwrap();
    let nbytes = (count * elem) as u64;
    let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| data(r as u64 * 1000 + count as u64, count * elem)).collect();
    let s = schedules(&topo, &lay, Collective::AllReduce, nbytes, elem);
    let out = simulate(&s, &inputs, elem, f).unwrap_or_else(|e| panic!("{nranks}x{rpn} count {count}: {e}"));
    let want = reference_all_reduce(&topo, &inputs, elem, f);
    for (r, o) in out.iter().enumerate() {
        assert_eq!(
            o.output, want,
            "AllReduce {nranks} ranks, {rpn} per node, {count} x {elem} B, round {round}: rank {r}"
        );
        assert_eq!(o.input, inputs[r], "the input must not change");
    }
    s.iter().map(|x| x.steps.len()).sum()
}

fn check_all_gather(nranks: usize, rpn: usize, count: usize, elem: usize, round: u64) {
    let topo = Topology::new(nranks, rpn).unwrap();
    let lay = Layout::new(&topo, round).unwrap();
    let nbytes = (count * elem) as u64;
    let inputs: Vec<Vec<u8>> = (0..nranks).map(|r| data(r as u64 * 77 + 5, count * elem)).collect();
    let s = schedules(&topo, &lay, Collective::AllGather, nbytes, elem);
    let out = simulate(&s, &inputs, elem, &add_u32).unwrap_or_else(|e| panic!("{nranks}x{rpn} count {count}: {e}"));
    let want: Vec<u8> = inputs.concat();
    for (r, o) in out.iter().enumerate() {
        assert_eq!(
            o.output, want,
            "AllGather {nranks} ranks, {rpn} per node, {count} x {elem} B, round {round}: rank {r}"
        );
    }
}

/// (nranks, ranks_per_node) pairs: one node, one rank per node, and mixed groupings.
const GROUPINGS: [(usize, usize); 16] = [
    (1, 1),
    (2, 1),
    (2, 2),
    (3, 1),
    (3, 3),
    (4, 2),
    (4, 4),
    (4, 1),
    (6, 2),
    (6, 3),
    (8, 2),
    (8, 4),
    (9, 3),
    (10, 5),
    (12, 4),
    (12, 3),
];
const COUNTS: [usize; 9] = [1, 2, 3, 7, 15, 16, 17, 1000, 4099];

#[test]
fn all_reduce_matches_the_reference_for_every_grouping_and_size() {
    let mut cases = 0;
    let mut steps = 0;
    for (n, l) in GROUPINGS {
        for count in COUNTS {
            // Rounds small enough that larger counts take several (parity alternates), and one
            // round larger than everything.
            for round in [64, 1000, 1 << 20] {
                steps += check_all_reduce(n, l, count, 4, round, &add_u32);
                steps += check_all_reduce(n, l, count, 2, round, &add_u16);
                cases += 2;
            }
        }
    }
    println!("AllReduce: {cases} cases, {steps} steps simulated");
}

#[test]
fn all_reduce_reduces_in_the_same_order_on_every_rank() {
    // With an operation that is neither commutative nor associative, every rank still gets the
    // two-level order's result: the same bits everywhere (what floats need).
    for (n, l) in GROUPINGS {
        for count in [1, 5, 33, 1001] {
            check_all_reduce(n, l, count, 4, 128, &mix_u32);
        }
    }
}

#[test]
fn all_gather_matches_the_reference_for_every_grouping_and_size() {
    let mut cases = 0;
    for (n, l) in GROUPINGS {
        for count in COUNTS {
            for round in [64, 1000, 1 << 20] {
                if count > 1000 && round < 1000 {
                    continue;
                }
                check_all_gather(n, l, count, 4, round);
                check_all_gather(n, l, count, 2, round);
                cases += 2;
            }
        }
    }
    println!("AllGather: {cases} cases");
}

#[test]
fn sends_match_the_peers_receives() {
    for (n, l) in GROUPINGS {
        let topo = Topology::new(n, l).unwrap();
        let lay = Layout::new(&topo, 256).unwrap();
        for coll in [Collective::AllReduce, Collective::AllGather] {
            let s = schedules(&topo, &lay, coll, 4 * 301, 4);
            for (r, sched) in s.iter().enumerate() {
                for t in sched.sends() {
                    assert!(
                        s[t.dst_rank].receives().any(|u| u == t),
                        "{coll} rank {r} sends what nobody receives: {t}"
                    );
                }
                for t in sched.receives() {
                    assert!(s[t.src_rank].sends().any(|u| u == t), "{coll} rank {r} receives what nobody sends: {t}");
                }
                // Inside a node only node peers talk; across nodes only the same local rank,
                // and only in the exchange phase.
                for t in sched.sends().chain(sched.receives()) {
                    let (a, b) = (t.src_rank, t.dst_rank);
                    if topo.node_of(a) == topo.node_of(b) {
                        assert_ne!(t.phase, Phase::InterExchange, "{t}");
                    } else {
                        assert_eq!(topo.local_of(a), topo.local_of(b), "{t}");
                        assert_eq!(t.phase, Phase::InterExchange, "{t}");
                        assert_eq!((t.src_buf, t.dst_buf, t.op), (Buf::Scratch, Buf::Scratch, Op::Copy), "{t}");
                    }
                }
            }
            // Each rank sends its exchange slot to every other node once per round.
            let rounds = s[0].rounds as usize;
            for sched in &s {
                let x = sched.sends().filter(|t| t.phase == Phase::InterExchange).count();
                assert_eq!(x, rounds * (topo.nodes() - 1), "{coll} rank {}", sched.rank);
            }
        }
    }
}

#[test]
fn bad_groupings_and_calls_are_refused_with_a_clear_error() {
    for (n, l) in [(6, 4), (5, 2), (7, 3), (3, 2)] {
        let e = Topology::new(n, l).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage);
        assert!(e.to_string().contains("multiple of ranks_per_node"), "{e}");
        assert!(e.to_string().contains(&format!("{n} ranks")), "{e}");
    }
    assert!(Topology::new(4, 0).is_err());
    assert!(Topology::new(0, 1).is_err());
    assert!(Topology::new(65 * 2, 65).unwrap_err().to_string().contains("at most 64"));
    let topo = Topology::new(4, 2).unwrap();
    assert!(Layout::new(&topo, 0).is_err());
    let lay = Layout::new(&topo, 1 << 16).unwrap();
    assert!(schedule::schedule(&topo, &lay, 4, Collective::AllReduce, 16, 4).is_err(), "rank 4 of 4");
    assert!(schedule::schedule(&topo, &lay, 0, Collective::AllReduce, 6, 4).is_err(), "a split element");
    let e = schedule::schedule(&topo, &lay, 0, Collective::Broadcast, 16, 4).unwrap_err();
    assert!(e.to_string().contains("not implemented"), "{e}");
}

#[test]
fn layout_and_chunks() {
    let topo = Topology::new(8, 4).unwrap();
    let lay = Layout::new(&topo, 1000).unwrap();
    assert_eq!(lay.ar_round % (16 * 4), 0);
    assert!(lay.ar_round >= 1000);
    assert_eq!(lay.sig_off, lay.col(&topo, 2, 0));
    assert_eq!(lay.total, lay.sig_off + 8 * schedule::MAX_LOCAL);
    assert_eq!(lay.col_off, lay.x(&topo, 2, 0));
    // Chunks cover the range in order, 16-byte aligned, possibly empty at the end.
    for len in [0u64, 2, 4, 30, 64, 100, 4099 * 2] {
        for parts in 1..9 {
            let mut at = 0;
            for i in 0..parts {
                let c = chunk(len, parts, i);
                assert_eq!(c.start, at, "len {len} parts {parts} chunk {i}");
                assert!(c.start.is_multiple_of(16) || c.start == len);
                at = c.end;
            }
            assert_eq!(at, len);
        }
    }
    let big = Topology::new(64, 1).unwrap();
    assert!(Layout::new(&big, 1 << 30).unwrap_err().to_string().contains("4 GiB"));
    // Rounds whose arithmetic would wrap to a small layout are refused too.
    for round in [u64::MAX, u64::MAX / 2, 1 << 62] {
        let e = Layout::new(&big, round).unwrap_err().to_string();
        assert!(e.contains("4 GiB"), "{round}: {e}");
    }
}

/// Every exchange slot leaves room for the signature after a chunk that fills it, the areas of
/// the scratch do not overlap, every slot is 16-byte aligned, and the total covers them all.
#[test]
fn layout_slots_leave_room_for_the_signature() {
    for (n, l) in GROUPINGS.iter().copied().chain([(64, 1), (64, 64), (128, 2)]) {
        let topo = Topology::new(n, l).unwrap();
        for round in [1u64, 16, 1000, 4096, 65536, 1 << 22] {
            let lay = Layout::new(&topo, round).unwrap();
            let (m, slot) = (topo.nodes(), lay.x_slot(&topo));
            assert_eq!(lay.ag_round, slot);
            assert_eq!(lay.x_stride, slot + schedule::SIG_ROOM, "{n}x{l} round {round}");
            assert_eq!(lay.col_stride, lay.ag_round + schedule::SIG_ROOM, "{n}x{l} round {round}");
            // The largest put (a full chunk, then its signature) stays inside the stride.
            for bytes in [0, 1, 2, 8, 15, 16, slot.saturating_sub(2), slot] {
                assert!(schedule::exchange_put_bytes(0, bytes) <= lay.x_stride, "{bytes} of {slot}");
                assert!(schedule::sig_at(bytes) >= bytes && schedule::sig_at(bytes).is_multiple_of(8));
            }
            assert_eq!(schedule::exchange_put_bytes(0, 0), 8);
            assert_eq!(schedule::exchange_put_bytes(0, 30), 40);
            assert_eq!(schedule::exchange_put_bytes(1, 30), 30);
            // Every area, as (start, end): IN, RES, each X and COL slot's stride, the signatures.
            let mut areas = vec![(lay.in_off, lay.in_off + lay.ar_round), (lay.res_off, lay.res_off + slot)];
            for p in 0..2 {
                for node in 0..m {
                    areas.push((lay.x(&topo, p, node), lay.x(&topo, p, node) + lay.x_stride));
                    areas.push((lay.col(&topo, p, node), lay.col(&topo, p, node) + lay.col_stride));
                    assert!(lay.x(&topo, p, node).is_multiple_of(16) && lay.col(&topo, p, node).is_multiple_of(16));
                }
            }
            areas.push((lay.sig_off, lay.sig_off + 8 * schedule::MAX_LOCAL));
            areas.sort();
            for w in areas.windows(2) {
                assert!(w[0].1 <= w[1].0, "{n}x{l} round {round}: {:?} overlaps {:?}", w[0], w[1]);
            }
            assert_eq!(areas.last().map(|a| a.1), Some(lay.total), "{n}x{l} round {round}");
            let used: u64 = areas.iter().map(|a| a.1 - a.0).sum();
            assert_eq!(used, lay.total, "{n}x{l} round {round}: gaps in the scratch");
            assert_eq!(lay.total, lay.ar_round + slot + 4 * m as u64 * (slot + 16) + 8 * schedule::MAX_LOCAL);
        }
    }
    // The slots' room counts against the 4 GiB limit: 64 nodes of 1, rounds of r bytes take
    // 2 r + 256 (r + 16) + 512 bytes; the largest round that fits would fit 16 bytes larger
    // without the room.
    let topo = Topology::new(64, 1).unwrap();
    let r = (u32::MAX as u64 - 256 * 16 - 8 * schedule::MAX_LOCAL) / 258 / 16 * 16;
    assert_eq!(Layout::new(&topo, r).unwrap().total, 258 * r + 256 * 16 + 512);
    assert!(258 * (r + 16) + 512 <= u32::MAX as u64);
    assert!(Layout::new(&topo, r + 16).unwrap_err().to_string().contains("4 GiB"));
}

#[test]
fn the_simulator_catches_broken_schedules() {
    let topo = Topology::new(4, 2).unwrap();
    let lay = Layout::new(&topo, 1 << 12).unwrap();
    let inputs: Vec<Vec<u8>> = (0..4).map(|r| data(r, 4 * 100)).collect();
    let good = schedules(&topo, &lay, Collective::AllReduce, 400, 4);
    assert!(simulate(&good, &inputs, 4, &add_u32).is_ok());
    // A receive dropped on one side only.
    let mut s = good.clone();
    let i = s[1].steps.iter().position(|t| t.src_rank != 1 && t.dst_rank == 1).unwrap();
    s[1].steps.remove(i);
    assert!(simulate(&s, &inputs, 4, &add_u32).unwrap_err().to_string().contains("does not know"));
    // A local reduce step dropped: the result is wrong.
    let mut s = good.clone();
    let i = s[0].steps.iter().position(|t| t.phase == Phase::InterReduce && t.op == Op::Reduce).unwrap();
    s[0].steps.remove(i);
    let out = simulate(&s, &inputs, 4, &add_u32).unwrap();
    assert_ne!(out[0].output, reference_all_reduce(&topo, &inputs, 4, &add_u32));
    // A peer read moved into the phase that writes the same bytes: a race.
    let mut s = good;
    for sched in &mut s {
        for t in &mut sched.steps {
            if t.phase == Phase::IntraReduceScatter {
                t.phase = Phase::Stage;
            }
        }
    }
    assert!(simulate(&s, &inputs, 4, &add_u32).unwrap_err().to_string().contains("same phase"));
}
