//! The two cores wired back to back in memory, in the manner of quinn-proto's tests: the byte
//! stream cut at every boundary and at random, acknowledgements dropped, delayed and reordered,
//! headers corrupted field by field, sequence gaps, unregistered memory, the queue bound, and a
//! property test over random schedules checked against a model of the receiver's memory.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::conn::ethernet::wire::{HEADER, Record};
use crate::wire::WireForm;

/// Region 1: Ethernet, 4096 bytes, aligned. Region 2: registered, not for Ethernet. Region 3:
/// Ethernet, 64 bytes at an address 4 past an 8-byte boundary. Nothing else exists.
fn lookup(id: u64) -> Option<RegionInfo<u64>> {
    match id {
        1 => Some(RegionInfo { handle: 1, addr: 0x10000, len: 4096, ethernet: true }),
        2 => Some(RegionInfo { handle: 2, addr: 0x20000, len: 4096, ethernet: false }),
        3 => Some(RegionInfo { handle: 3, addr: 0x30004, len: 64, ethernet: true }),
        _ => None,
    }
}

/// The receiver's memory: what the shell would apply.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Memory(HashMap<u64, Vec<u8>>);

impl Memory {
    fn new() -> Memory {
        Memory([(1, vec![0u8; 4096]), (2, vec![0u8; 4096]), (3, vec![0u8; 64])].into_iter().collect())
    }
    fn token(&mut self, region: u64, offset: u64, value: u64, add: bool) {
        let w = &mut self.0.get_mut(&region).unwrap()[offset as usize..offset as usize + 8];
        let old = u64::from_le_bytes(w.try_into().unwrap());
        let new = if add { old.wrapping_add(value) } else { value };
        w.copy_from_slice(&new.to_le_bytes());
    }
}

/// A receiver shell in memory: applies events to `mem`, collects acknowledgements.
struct Rx {
    core: ReceiverCore,
    mem: Memory,
    cur: Option<u64>,
    acks: Vec<u64>,
    /// Read payload past the buffered input "directly" (the socket path) instead of as `Data`.
    direct: bool,
}

impl Rx {
    fn new(direct: bool) -> Rx {
        Rx { core: ReceiverCore::default(), mem: Memory::new(), cur: None, acks: Vec::new(), direct }
    }

    /// Feeds one chunk of the stream, as the shell does with what one read returned.
    fn feed(&mut self, mut chunk: &[u8]) -> Result<(), String> {
        loop {
            if self.direct
                && let (Some((offset, left)), Some(region)) = (self.core.payload_pending(), self.cur)
                && !chunk.is_empty()
            {
                // The socket path: payload goes straight to its place, as much as arrived.
                let n = (left as usize).min(chunk.len());
                let dst = &mut self.mem.0.get_mut(&region).unwrap()[offset as usize..][..n];
                dst.copy_from_slice(&chunk[..n]);
                chunk = &chunk[n..];
                self.core.payload_received(n as u64, !chunk.is_empty());
                continue;
            }
            let (used, ev) = self.core.handle_bytes(chunk, &lookup)?;
            match ev {
                None if used == 0 => return Ok(()),
                None => {}
                Some(RxEvent::Write { region, offset, len }) => {
                    assert!(offset + len <= self.mem.0[&region].len() as u64, "a validated write out of bounds");
                    self.cur = Some(region);
                }
                Some(RxEvent::Data { offset, bytes }) => {
                    let region = self.cur.expect("data without a write");
                    self.mem.0.get_mut(&region).unwrap()[offset as usize..][..bytes.len()].copy_from_slice(bytes);
                }
                Some(RxEvent::Token { region, offset, value, add }) => self.mem.token(region, offset, value, add),
                Some(RxEvent::Ack(s)) => {
                    assert_eq!(used, 0, "an acknowledgement used input");
                    self.acks.push(s)
                }
                // One stream holds both lanes here, in the order the receiver reads them.
                Some(RxEvent::Switch) => {}
            }
            chunk = &chunk[used..];
        }
    }
}

type Sender = SenderCore<Vec<u8>>;

fn write(region: u64, offset: u64, data: Vec<u8>) -> Op<Vec<u8>> {
    let len = data.len() as u64;
    Op::Write { region, offset, src: data, src_off: 0, len }
}

/// Everything the sender has queued, as the bytes it puts on the wire (all batches, both lanes
/// in one stream in the order the receiver reads them, lane switches included).
fn drain(tx: &mut Sender) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let batch = tx.next_batch(|_| true);
        if batch.is_empty() {
            return out;
        }
        out.extend(batch.lead.iter().flat_map(|h| h.encode()));
        for (h, op) in batch.frames {
            out.extend_from_slice(&h.encode());
            if let Op::Write { src, src_off, len, .. } = op {
                out.extend_from_slice(&src[src_off as usize..][..len as usize]);
            }
        }
        out.extend(batch.tail.iter().flat_map(|h| h.encode()));
    }
}

/// Applies `ops` to the model memory.
fn model_apply(mem: &mut Memory, op: &Op<Vec<u8>>) {
    match op {
        Op::Write { region, offset, src, .. } => {
            mem.0.get_mut(region).unwrap()[*offset as usize..][..src.len()].copy_from_slice(src)
        }
        Op::Set { region, offset, value } => mem.token(*region, *offset, *value, false),
        Op::Add { region, offset, value } => mem.token(*region, *offset, *value, true),
        Op::Nop => {}
    }
}

/// A fixed schedule touching every operation and several payload sizes.
fn schedule() -> Vec<Op<Vec<u8>>> {
    let data = |n: usize, seed: u8| (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    vec![
        write(1, 0, data(100, 1)),
        Op::Set { region: 1, offset: 1024, value: 7 },
        write(1, 100, vec![]),
        write(1, 4095, data(1, 2)),
        Op::Add { region: 1, offset: 1024, value: u64::MAX },
        Op::Nop,
        write(3, 0, data(64, 3)),
        Op::Add { region: 3, offset: 4, value: 5 },
        write(1, 2000, data(77, 4)),
        Op::Nop,
    ]
}

fn issued(ops: Vec<Op<Vec<u8>>>, max_queue: u64) -> (Sender, Memory, Vec<u8>) {
    let mut tx = Sender::new(max_queue);
    let mut model = Memory::new();
    for op in ops {
        model_apply(&mut model, &op);
        tx.issue(op).unwrap();
    }
    let bytes = drain(&mut tx);
    (tx, model, bytes)
}

#[test]
fn every_byte_boundary_gives_the_same_memory_and_acks() {
    let (_, model, bytes) = issued(schedule(), 1000);
    let mut whole = Rx::new(false);
    whole.feed(&bytes).unwrap();
    assert_eq!(whole.mem, model);
    assert_eq!(whole.acks, vec![6, 10], "the two probes are acknowledged");
    for direct in [false, true] {
        for cut in 0..=bytes.len() {
            let mut rx = Rx::new(direct);
            rx.feed(&bytes[..cut]).unwrap();
            rx.feed(&bytes[cut..]).unwrap();
            assert_eq!(rx.mem, model, "cut at {cut}, direct {direct}");
            assert_eq!(rx.acks, whole.acks, "cut at {cut}");
        }
        // One byte at a time.
        let mut rx = Rx::new(direct);
        for b in &bytes {
            rx.feed(std::slice::from_ref(b)).unwrap();
        }
        assert_eq!(rx.mem, model);
        assert_eq!(rx.acks, whole.acks);
    }
}

#[test]
fn nothing_is_applied_before_its_frame_is_whole() {
    // A token frame's effect appears only once its 48th byte arrived.
    let (_, _, bytes) = issued(vec![Op::Set { region: 1, offset: 8, value: 0x0102 }], 8);
    let mut rx = Rx::new(false);
    rx.feed(&bytes[..HEADER - 1]).unwrap();
    assert_eq!(rx.mem, Memory::new());
    rx.feed(&bytes[HEADER - 1..]).unwrap();
    assert_eq!(rx.mem.0[&1][8..10], [2, 1]);
}

#[test]
fn periodic_acks_wait_for_a_pause_in_the_input() {
    let n = ACK_EVERY + 44;
    let ops: Vec<_> = (0..n).map(|i| Op::Set { region: 1, offset: 0, value: i }).collect();
    let (_, _, bytes) = issued(ops, 100_000);
    // All in one read: no pause before the end, one acknowledgement of everything.
    let mut rx = Rx::new(false);
    rx.feed(&bytes).unwrap();
    assert_eq!(rx.acks, vec![n]);
    // Frame by frame: a pause after each, so frame ACK_EVERY is acknowledged, then nothing
    // until another ACK_EVERY.
    let mut rx = Rx::new(false);
    for f in bytes.chunks(HEADER) {
        rx.feed(f).unwrap();
    }
    assert_eq!(rx.acks, vec![ACK_EVERY]);
}

#[test]
fn the_queue_bound_is_honoured_and_acks_free_it() {
    let mut tx = Sender::new(4);
    for i in 0..4 {
        assert_eq!(tx.issue(Op::Set { region: 1, offset: 0, value: i }).unwrap(), i + 1);
    }
    let (op, full) = tx.issue(Op::Nop).unwrap_err();
    assert!(matches!(op, Op::Nop));
    assert_eq!(full, QueueFull { outstanding: 4 });
    // Headers ask for an acknowledgement once half the bound is unconfirmed, then every half
    // bound (not on every frame while the answer is on its way).
    let acks: Vec<bool> = tx.next_batch(|_| true).frames.iter().map(|(h, _)| h.ack).collect();
    assert_eq!(acks, [false, true, false, true]);
    tx.handle_bytes(&Record::Ack(1).to_wire()).unwrap();
    assert_eq!(tx.outstanding(), 3);
    assert_eq!(tx.issue(Op::Nop).unwrap(), 5);
    assert!(tx.issue(Op::Nop).is_err());
    // A zero bound is one.
    assert_eq!(Sender::new(0).max_queue(), 1);
}

#[test]
fn batches_keep_order_and_limits() {
    // More than one batch's worth, whatever BATCH_OPS is.
    let n = BATCH_OPS + BATCH_OPS / 2 + 1;
    let mut tx = Sender::new(2 * n as u64);
    for _ in 0..n {
        tx.issue(Op::Nop).unwrap();
    }
    let b = tx.next_batch(|_| true);
    assert_eq!(b.frames.len(), BATCH_OPS);
    assert!(b.frames.iter().enumerate().all(|(i, (h, _))| h.seq == i as u64 + 1));
    assert_eq!(tx.next_batch(|_| true).frames.len(), n - BATCH_OPS);
    // Payload bytes: a batch stops before passing BATCH_BYTES, a single larger write goes alone.
    let big = BATCH_BYTES / 2 + 1;
    let small = OWN_LANE_MIN - 1;
    for len in [big, big, small, small, small] {
        tx.issue(Op::Write { region: 1, offset: 0, src: Vec::new(), src_off: 0, len }).unwrap();
    }
    assert_eq!(tx.next_batch(|_| true).frames.len(), 1);
    assert_eq!(tx.next_batch(|_| true).frames.len(), 1);
    assert_eq!(tx.next_batch(|_| true).frames.len(), 3);
    // `may_send` stops a batch (the calling thread leaves large writes to the sender thread).
    tx.issue(Op::Nop).unwrap();
    tx.issue(write(1, 0, vec![1])).unwrap();
    tx.issue(Op::Nop).unwrap();
    assert_eq!(tx.next_batch(|op| !matches!(op, Op::Write { .. })).frames.len(), 1);
    assert!(matches!(tx.front(), Some(Op::Write { .. })));
    assert_eq!(tx.next_batch(|_| true).frames.len(), 2);
    assert!(tx.is_idle());
}

/// Large writes go on the own lane, the rest on the shared one; a batch holds one lane, and a
/// switch names the frame that comes next on the other lane (sent before the batch on the old
/// lane, or after it on its own lane when the next operation is already queued).
#[test]
fn lanes_follow_write_size_with_switches_between() {
    let mut tx = Sender::new(1000);
    let big =
        |tx: &mut Sender| tx.issue(Op::Write { region: 1, offset: 0, src: Vec::new(), src_off: 0, len: OWN_LANE_MIN });
    tx.issue(write(1, 0, vec![1; 8])).unwrap();
    tx.issue(Op::Set { region: 1, offset: 0, value: 1 }).unwrap();
    big(&mut tx).unwrap();
    big(&mut tx).unwrap();
    tx.issue(Op::Set { region: 1, offset: 0, value: 2 }).unwrap();
    // Shared: the small write and the token, then a switch to the big write (seq 3).
    let b = tx.next_batch(|_| true);
    assert_eq!((b.lane, b.frames.len(), b.lead), (Lane::Shared, 2, None));
    assert_eq!(b.tail.map(|h| (h.seq, h.op)), Some((3, FrameOp::Switch)));
    // Own: both big writes, then the switch back to the token (seq 5).
    let b = tx.next_batch(|_| true);
    assert_eq!((b.lane, b.frames.len(), b.lead), (Lane::Own, 2, None));
    assert_eq!(b.tail.map(|h| (h.seq, h.op)), Some((5, FrameOp::Switch)));
    let b = tx.next_batch(|_| true);
    assert_eq!((b.lane, b.frames.len(), b.lead, b.tail), (Lane::Shared, 1, None, None));
    // A big write queued after the last batch went: the switch leads its batch, on the old lane.
    big(&mut tx).unwrap();
    let b = tx.next_batch(|_| true);
    assert_eq!((b.lane, b.frames.len(), b.tail), (Lane::Own, 1, None));
    assert_eq!(b.lead.map(|h| (h.seq, h.ack, h.op)), Some((6, false, FrameOp::Switch)));
    assert!(tx.next_batch(|_| true).is_empty());
}

/// The receiver follows switches across two streams, and refuses a switch that does not name
/// the frame due next, or a frame read on the old lane after a switch (a sequence gap there).
#[test]
fn receiver_follows_lane_switches() {
    let switch = |seq| FrameHeader { seq, ack: false, op: FrameOp::Switch }.encode();
    let set = |seq, value| FrameHeader { seq, ack: false, op: FrameOp::Set { region: 1, offset: 8, value } }.encode();
    // Shared: set(1), switch(2), set(4). Own: set(2), set(3), switch(4).
    let shared: Vec<u8> = [set(1, 10), switch(2), set(4, 40)].concat();
    let own: Vec<u8> = [set(2, 20), set(3, 30), switch(4)].concat();
    let mut core = ReceiverCore::default();
    let (mut lanes, mut pos, mut lane, mut values) = ([shared.clone(), own], [0usize; 2], 0usize, Vec::new());
    loop {
        let (used, ev) = core.handle_bytes(&lanes[lane][pos[lane]..], &lookup).unwrap();
        pos[lane] += used;
        match ev {
            None if used == 0 => break,
            Some(RxEvent::Switch) => lane ^= 1,
            Some(RxEvent::Token { value, .. }) => values.push(value),
            _ => {}
        }
    }
    assert_eq!(values, [10, 20, 30, 40]);
    assert_eq!((pos[0], pos[1], core.applied_through()), (lanes[0].len(), lanes[1].len(), 4));
    // Ignoring the switch: the frame after it on the old lane is out of sequence.
    let mut core = ReceiverCore::default();
    lanes[0] = [set(1, 10), set(4, 40)].concat();
    let (used, _) = core.handle_bytes(&lanes[0], &lookup).unwrap();
    assert!(core.handle_bytes(&lanes[0][used..], &lookup).unwrap_err().contains("sequence 4 where 2 was due"));
    // A switch naming another frame than the one due.
    let mut core = ReceiverCore::default();
    assert!(core.handle_bytes(&switch(2), &lookup).unwrap_err().contains("sequence 2 where 1 was due"));
}

#[test]
fn acks_split_dropped_delayed_and_reordered() {
    let mut tx = Sender::new(100);
    for _ in 0..10 {
        tx.issue(Op::Nop).unwrap();
    }
    drain(&mut tx);
    assert_eq!(tx.flush_target(), Some(10));
    // Records cut at every byte: a partial record changes nothing.
    let recs: Vec<u8> = [3u64, 5].iter().flat_map(|s| Record::Ack(*s).to_wire()).collect();
    for cut in 0..=recs.len() {
        let mut t = Sender::new(100);
        for _ in 0..10 {
            t.issue(Op::Nop).unwrap();
        }
        t.handle_bytes(&recs[..cut]).unwrap();
        assert_eq!(
            t.applied(),
            if cut >= 32 {
                5
            } else if cut >= 16 {
                3
            } else {
                0
            }
        );
        t.handle_bytes(&recs[cut..]).unwrap();
        assert_eq!(t.applied(), 5);
    }
    // Reordered (a late, older ack changes nothing) and dropped (a later ack covers it).
    tx.handle_bytes(&Record::Ack(7).to_wire()).unwrap();
    tx.handle_bytes(&Record::Ack(4).to_wire()).unwrap();
    assert_eq!(tx.applied(), 7);
    assert_eq!(tx.flush_target(), Some(10));
    tx.handle_bytes(&Record::Ack(10).to_wire()).unwrap();
    assert_eq!(tx.flush_target(), None);
    assert_eq!(tx.outstanding(), 0);
    // An ack of what was never sent ends the connection.
    let e = tx.handle_bytes(&Record::Ack(11).to_wire()).unwrap_err();
    assert!(e.contains("never sent"), "{e}");
    assert!(tx.handle_bytes(&Record::Ack(10).to_wire()).is_err(), "a failed core stays failed");
}

#[test]
fn refusals_and_garbage_records_end_the_sender() {
    let refusal = Record::refusal("frame names region 9 which is not registered").to_wire();
    for cut in 0..=refusal.len() {
        let mut tx = Sender::new(8);
        tx.issue(Op::Nop).unwrap();
        let r = tx.handle_bytes(&refusal[..cut]);
        let e = if cut == refusal.len() {
            r.unwrap_err()
        } else {
            r.unwrap();
            tx.handle_bytes(&refusal[cut..]).unwrap_err()
        };
        assert!(e.contains("refused a frame") && e.contains("region 9"), "{e}");
    }
    for i in 0..16 {
        let mut rec = Record::Ack(0).to_wire();
        rec[i] ^= 0x40;
        let mut tx = Sender::new(8);
        tx.issue(Op::Nop).unwrap();
        match tx.handle_bytes(&rec) {
            Ok(()) => assert!(i >= 8, "byte {i}: a changed kind or padding accepted"),
            Err(e) => assert!(i < 8 || e.contains("never sent"), "byte {i}: {e}"),
        }
    }
}

/// Feeds `bytes` to a fresh receiver and expects a refusal containing `why`, with nothing of
/// the refused frame applied (memory equal to `before`) and the core failed for good.
fn refused(bytes: &[u8], before: &Memory, why: &str) {
    for direct in [false, true] {
        let mut rx = Rx::new(direct);
        let e = rx.feed(bytes).unwrap_err();
        assert!(e.contains(why), "{e} (expected {why})");
        assert_eq!(&rx.mem, before, "{why}: memory changed");
        assert_eq!(rx.core.handle_bytes(&[], &lookup).unwrap_err(), e, "a failed core stays failed");
    }
}

#[test]
fn corrupted_header_fields_are_refused() {
    // A good frame, then a write whose header gets one field changed.
    let (_, model_first, first) = issued(vec![Op::Set { region: 1, offset: 0, value: 1 }], 8);
    let mut tx = Sender::new(8);
    tx.issue(Op::Set { region: 1, offset: 0, value: 1 }).unwrap();
    tx.issue(write(1, 8, vec![9; 16])).unwrap();
    let bytes = drain(&mut tx);
    assert_eq!(&bytes[..first.len()], &first[..]);
    let h = first.len();
    // (byte offset in the header, new value of that byte, expected reason)
    let cases: &[(usize, u8, &str)] = &[
        (0, 0, "unknown operation"),
        (0, 9, "unknown operation"),
        (0, 4, "probe frame with non-zero"),
        (0, 2, "token frame with length 16"),
        (1, 2, "unknown flags"),
        (1, 0x80, "unknown flags"),
        (3, 1, "unknown flags"),
        (7, 1, "unknown flags"),
        (8, 3, "sequence 3 where 2 was due"),
        (15, 1, "where 2 was due"),
        (16, 2, "not registered for Ethernet"),
        (16, 7, "which is not registered"),
        (23, 1, "which is not registered"),
        (25, 0xf9, "outside"),
        (31, 0x80, "outside"),
        (33, 0xff, "outside"),
        (39, 1, "outside"),
        (40, 1, "non-zero value"),
        (47, 1, "non-zero value"),
    ];
    for &(at, v, why) in cases {
        let mut b = bytes.clone();
        b[h + at] = v;
        refused(&b, &model_first, why);
    }
    // Token-specific checks.
    let mut tx = Sender::new(8);
    tx.issue(Op::Set { region: 3, offset: 0, value: 1 }).unwrap();
    refused(&drain(&mut tx), &Memory::new(), "unaligned");
    let mut tx = Sender::new(8);
    tx.issue(Op::Add { region: 1, offset: 4096, value: 1 }).unwrap();
    refused(&drain(&mut tx), &Memory::new(), "outside");
}

#[test]
fn sequence_gaps_and_repeats_are_refused() {
    let (_, _, bytes) = issued(vec![Op::Nop, Op::Set { region: 1, offset: 0, value: 5 }, Op::Nop], 8);
    let frame = |i: usize| &bytes[i * HEADER..(i + 1) * HEADER];
    // Frame 2 missing.
    let gap: Vec<u8> = [frame(0), frame(2)].concat();
    refused(&gap, &Memory::new(), "sequence 3 where 2 was due");
    // Frame 1 twice.
    let twice: Vec<u8> = [frame(0), frame(0)].concat();
    refused(&twice, &Memory::new(), "sequence 1 where 2 was due");
    // Starting anywhere but 1.
    refused(frame(1), &Memory::new(), "sequence 2 where 1 was due");
}

#[test]
fn unregistered_memory_is_refused_and_nothing_applied() {
    for (region, offset, len, why) in [
        (7, 0, 16, "not registered"),
        (2, 0, 16, "not registered for Ethernet"),
        (1, 4090, 16, "outside"),
        (1, u64::MAX - 4, 16, "outside"),
        (3, 0, 65, "outside"),
    ] {
        let mut tx = Sender::new(8);
        tx.issue(Op::Write { region, offset, src: vec![0xAA; len as usize], src_off: 0, len }).unwrap();
        let mut bytes = drain(&mut tx);
        bytes.extend_from_slice(&[0xAA; 64]);
        refused(&bytes, &Memory::new(), why);
    }
}

/// One step of a random schedule.
#[derive(Clone, Debug)]
enum Step {
    Write {
        offset: u16,
        data: Vec<u8>,
    },
    Set {
        slot: u8,
        value: u64,
    },
    Add {
        slot: u8,
        value: u64,
    },
    Flush,
    /// Deliver this many of the bytes in flight to the receiver.
    Deliver(u16),
    /// Deliver the acknowledgements in flight, the `first`th first (reordering), dropping those
    /// whose bit is set in `drop` except the newest (TCP loses nothing; a dropped ack stands for
    /// one the receiver skipped, which a later cumulative ack covers).
    Acks {
        first: u8,
        drop: u8,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u16..3900, proptest::collection::vec(any::<u8>(), 0..196)).prop_map(|(offset, data)| Step::Write { offset, data }),
        2 => (0u8..8, any::<u64>()).prop_map(|(slot, value)| Step::Set { slot, value }),
        2 => (0u8..8, any::<u64>()).prop_map(|(slot, value)| Step::Add { slot, value }),
        1 => Just(Step::Flush),
        3 => any::<u16>().prop_map(Step::Deliver),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(first, drop)| Step::Acks { first, drop }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Random schedules of writes, token updates, atomics and flushes, the stream delivered in
    /// random pieces and acknowledgements reordered and dropped: the receiver's memory matches a
    /// model byte for byte, the queue bound holds, and a flush completes exactly when everything
    /// issued before it is applied.
    #[test]
    fn random_schedules_match_the_model(steps in proptest::collection::vec(step(), 1..60),
                                        max_queue in 1u64..16, direct: bool) {
        let mut tx = Sender::new(max_queue);
        let mut rx = Rx::new(direct);
        let mut model = Memory::new();
        let mut wire: Vec<u8> = Vec::new();
        let mut acks_seen = 0usize;
        let mut acks_in_flight: Vec<Vec<u8>> = Vec::new();
        // Operations applied by the model up to each sequence number: the receiver's memory
        // equals the model state at its last complete frame.
        let mut issued_ops: Vec<Op<Vec<u8>>> = Vec::new();
        let tokens = 2048u64;
        let deliver_all = |tx: &mut Sender, rx: &mut Rx, wire: &mut Vec<u8>, acks_seen: &mut usize,
                           in_flight: &mut Vec<Vec<u8>>| {
            for a in in_flight.drain(..) {
                tx.handle_bytes(&a).unwrap();
            }
            wire.extend(drain(tx));
            rx.feed(wire).unwrap();
            wire.clear();
            for a in &rx.acks[*acks_seen..] {
                tx.handle_bytes(&Record::Ack(*a).to_wire()).unwrap();
            }
            *acks_seen = rx.acks.len();
        };
        for s in steps {
            let op = match s {
                Step::Write { offset, data } => Some(write(1, offset as u64, data)),
                Step::Set { slot, value } => Some(Op::Set { region: 1, offset: tokens + 8 * slot as u64, value }),
                Step::Add { slot, value } => Some(Op::Add { region: 1, offset: tokens + 8 * slot as u64, value }),
                Step::Flush => {
                    // flush: the target, a probe, then everything delivered: done exactly then.
                    let target = tx.flush_target();
                    if let Some(t) = target {
                        if tx.issue(Op::Nop).is_ok() {
                            issued_ops.push(Op::Nop);
                            deliver_all(&mut tx, &mut rx, &mut wire, &mut acks_seen, &mut acks_in_flight);
                            prop_assert!(tx.applied() >= t, "flush target {t} not reached: {}", tx.applied());
                            prop_assert_eq!(&rx.mem, &model, "flushed, memory differs");
                        }
                    } else {
                        prop_assert_eq!(tx.outstanding(), 0);
                    }
                    None
                }
                Step::Deliver(n) => {
                    wire.extend(drain(&mut tx));
                    let n = (n as usize).min(wire.len());
                    rx.feed(&wire[..n]).unwrap();
                    wire.drain(..n);
                    for a in &rx.acks[acks_seen..] {
                        acks_in_flight.push(Record::Ack(*a).to_wire());
                    }
                    acks_seen = rx.acks.len();
                    None
                }
                Step::Acks { first, drop } => {
                    if !acks_in_flight.is_empty() {
                        let k = first as usize % acks_in_flight.len();
                        let a = acks_in_flight.remove(k);
                        tx.handle_bytes(&a).unwrap();
                        let last = acks_in_flight.len().saturating_sub(1);
                        for (i, a) in acks_in_flight.drain(..).enumerate() {
                            if i == last || drop & (1 << (i % 8)) == 0 {
                                tx.handle_bytes(&a).unwrap();
                            }
                        }
                    }
                    None
                }
            };
            if let Some(op) = op {
                let rec = match &op {
                    Op::Write { region, offset, src, .. } => write(*region, *offset, src.clone()),
                    Op::Set { region, offset, value } => Op::Set { region: *region, offset: *offset, value: *value },
                    Op::Add { region, offset, value } => Op::Add { region: *region, offset: *offset, value: *value },
                    Op::Nop => Op::Nop,
                };
                match tx.issue(op) {
                    Ok(seq) => {
                        prop_assert_eq!(seq as usize, issued_ops.len() + 1);
                        model_apply(&mut model, &rec);
                        issued_ops.push(rec);
                    }
                    Err((_, full)) => prop_assert_eq!(full.outstanding, max_queue),
                }
            }
            prop_assert!(tx.outstanding() <= max_queue);
            prop_assert!(tx.applied() <= issued_ops.len() as u64);
        }
        // The end: everything delivered, memory exact, everything acknowledged after a flush.
        if tx.issue(Op::Nop).is_err() {
            deliver_all(&mut tx, &mut rx, &mut wire, &mut acks_seen, &mut acks_in_flight);
            prop_assert!(tx.issue(Op::Nop).is_ok(), "the bound did not free after delivery");
        }
        deliver_all(&mut tx, &mut rx, &mut wire, &mut acks_seen, &mut acks_in_flight);
        prop_assert_eq!(&rx.mem, &model);
        prop_assert_eq!(tx.flush_target(), None);
    }

    /// Any cut of a random stream into random pieces gives the same memory as one piece.
    #[test]
    fn random_splits_give_the_same_memory(sizes in proptest::collection::vec(0usize..300, 1..12),
                                          cuts in proptest::collection::vec(any::<u16>(), 0..20), direct: bool) {
        let mut ops = Vec::new();
        let mut off = 0u64;
        for (i, n) in sizes.iter().enumerate() {
            ops.push(write(1, off, vec![i as u8 + 1; *n]));
            ops.push(Op::Add { region: 1, offset: 4088, value: 1 });
            off += *n as u64;
        }
        ops.push(Op::Nop);
        let (_, model, bytes) = issued(ops, 1000);
        let mut points: Vec<usize> = cuts.iter().map(|c| *c as usize % (bytes.len() + 1)).collect();
        points.sort_unstable();
        let mut rx = Rx::new(direct);
        let mut at = 0;
        for p in points.into_iter().chain([bytes.len()]) {
            rx.feed(&bytes[at..p]).unwrap();
            at = p;
        }
        prop_assert_eq!(rx.mem, model);
        prop_assert_eq!(rx.acks.last().copied(), Some(2 * sizes.len() as u64 + 1));
    }
}

proptest! {
    /// The fuzz check, on random bytes and on mutated valid streams.
    #[test]
    fn fuzz_stream_holds(junk in proptest::collection::vec(any::<u8>(), 0..400), mode: u8, flips in proptest::collection::vec(any::<(u16, u8)>(), 0..4)) {
        fuzz_stream(&junk);
        let (_, _, bytes) = issued(schedule(), 1000);
        let mut b = [&[mode & !1][..], &bytes].concat();
        for (at, x) in flips {
            let i = 1 + at as usize % bytes.len();
            b[i] ^= x;
        }
        fuzz_stream(&b);
    }
}

// ---- liveness over bounded lanes ----------------------------------------------------------------

/// One batch as the shell sends it (`Shared::send_batch`): each entry one blocking send, in order,
/// as (lane index: 0 shared, 1 own, bytes).
fn sends_of_batch(b: Batch<Vec<u8>>) -> Vec<(usize, Vec<u8>)> {
    let (this, other) = match b.lane {
        Lane::Shared => (0, 1),
        Lane::Own => (1, 0),
    };
    let mut out = Vec::new();
    if let Some(l) = b.lead {
        out.push((other, l.encode().to_vec()));
    }
    let mut v = Vec::new();
    for (h, op) in b.frames {
        v.extend_from_slice(&h.encode());
        if let Op::Write { src, .. } = op {
            v.extend_from_slice(&src);
        }
    }
    v.extend(b.tail.iter().flat_map(|h| h.encode()));
    out.push((this, v));
    out
}

/// Two lanes of `cap` bytes each (socket buffers), a sender whose sends block until their bytes
/// fit, a receiver that reads only its current lane: returns the tokens the receiver applied and
/// whether everything was delivered (false: neither side can move, a deadlock).
fn run_over_bounded_lanes(sends: &[(usize, Vec<u8>)], cap: usize) -> (Vec<u64>, bool) {
    let lookup_big = |id: u64| match id {
        9 => Some(RegionInfo { handle: 9u64, addr: 0x100000, len: 1 << 20, ethernet: true }),
        _ => lookup(id),
    };
    let mut fifo = [Vec::<u8>::new(), Vec::new()];
    let (mut next, mut off, mut cur, mut got) = (0usize, 0usize, 0usize, Vec::new());
    let mut core = ReceiverCore::default();
    loop {
        let mut moved = false;
        // The sender: the current send goes into its lane as far as there is room (it blocks
        // there otherwise: nothing after it is sent).
        while let Some((lane, bytes)) = sends.get(next) {
            let n = (cap - fifo[*lane].len()).min(bytes.len() - off);
            fifo[*lane].extend_from_slice(&bytes[off..off + n]);
            off += n;
            moved |= n > 0;
            if off < bytes.len() {
                break;
            }
            (next, off) = (next + 1, 0);
        }
        // The receiver: what its current lane holds.
        loop {
            let lane = cur;
            let (used, ev) = core.handle_bytes(&fifo[lane], &lookup_big).unwrap();
            let none = ev.is_none();
            match ev {
                Some(RxEvent::Switch) => cur ^= 1,
                Some(RxEvent::Token { value, .. }) => got.push(value),
                _ => {}
            }
            fifo[lane].drain(..used);
            moved |= used > 0 || !none;
            if used == 0 && none {
                break;
            }
        }
        if !moved {
            return (got, next == sends.len() && fifo.iter().all(|f| f.is_empty()));
        }
    }
}

/// The p2p bandwidth pattern (large write, signal, large write, signal, ...), the first write
/// taken alone by the sender thread and the rest queued while it went, over lanes much smaller
/// than a write: every signal arrives, nothing is left (no send waits on the receiver reading a
/// lane it only reaches later). The variant reverted in d904a50 (the operations queued after a
/// batch sent with its lead switch, on the other lane, before the batch) fails it: a large
/// write went out ahead of the signal the receiver was waiting for on the shared lane, and the
/// sender blocked in that write's send while the receiver waited on the shared lane.
#[test]
fn bounded_lanes_never_deadlock() {
    let big = |i: u8| Op::Write {
        region: 9,
        offset: 0,
        src: vec![i; 4 * OWN_LANE_MIN as usize],
        src_off: 0,
        len: 4 * OWN_LANE_MIN,
    };
    let set = |v: u64| Op::Set { region: 1, offset: 0, value: v };
    for first_alone in [true, false] {
        let mut tx = Sender::new(1000);
        let mut sends = Vec::new();
        let take = |tx: &mut Sender, sends: &mut Vec<(usize, Vec<u8>)>| loop {
            let b = tx.next_batch(|_| true);
            if b.is_empty() {
                break;
            }
            sends.extend(sends_of_batch(b));
        };
        tx.issue(big(1)).unwrap();
        if first_alone {
            take(&mut tx, &mut sends);
        }
        tx.issue(set(1)).unwrap();
        for i in 2..=4u8 {
            tx.issue(big(i)).unwrap();
            tx.issue(set(i as u64)).unwrap();
        }
        take(&mut tx, &mut sends);
        let (got, done) = run_over_bounded_lanes(&sends, 64 << 10);
        println!("first write alone {first_alone}: signals applied {got:?}, all delivered {done}");
        assert!(done && got == vec![1, 2, 3, 4], "deadlock: signals applied {got:?}");
    }
}
