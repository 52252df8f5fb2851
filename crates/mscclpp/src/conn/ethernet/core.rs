//! The Ethernet protocol without I/O: a sender core and a receiver core, plain state machines fed
//! bytes and operations, returning what to send and what to apply. The shell in `mod.rs` drives
//! them with sockets, threads and GPU staging; the tests here wire two cores back to back in
//! memory.
//!
//! Neither core keeps a clock: the protocol has no timers of its own. The waits (the write-queue
//! bound, `flush`, the small-write grace) are the shell's, bounded by its deadlines.

use std::collections::VecDeque;

use super::wire::{FrameHeader, FrameOp, HEADER, Lane, RECORD, Record, RecordHead};

/// Most frames per batch (one `sendmsg`).
pub(crate) const BATCH_OPS: usize = 64;
/// Most payload bytes per batch (a single larger write goes alone).
pub(crate) const BATCH_BYTES: u64 = 16 << 20;
/// The receiver acknowledges at least every this many frames (at a pause in its input; the
/// sender asks sooner, at half its write-queue bound, and with every flush's probe). Every
/// acknowledgement first lands the small writes received (one copy to the GPU per contiguous
/// run of them): 1024 since session 26 (256 before), with the default queue raised to 2048 to
/// match. Many producers rewriting a ring out of order then leave fewer holes between runs: on
/// an H100 (`mscclpp-perf device --parts load-eth`, 132 producers) 8 B and 512 B puts went from
/// 0.39-0.72 of the host thread to 0.75-0.93 (the receiver's copies to the GPU from 79-193 per
/// 1000 writes to 67-115).
pub(crate) const ACK_EVERY: u64 = 1024;
/// Writes of at least this many bytes travel on the sender's own lane; smaller writes, token
/// updates and probes on the shared one (see "Sockets" in `mod.rs`).
pub(crate) const OWN_LANE_MIN: u64 = 64 << 10;

/// An operation the sender queues; `S` is where a write's payload comes from.
#[derive(Debug)]
pub(crate) enum Op<S> {
    Write {
        region: u64,
        offset: u64,
        src: S,
        src_off: u64,
        len: u64,
    },
    Set {
        region: u64,
        offset: u64,
        value: u64,
    },
    Add {
        region: u64,
        offset: u64,
        value: u64,
    },
    /// A probe asking for an acknowledgement.
    Nop,
}

impl<S> Op<S> {
    /// Payload bytes after the header.
    pub(crate) fn payload(&self) -> u64 {
        match self {
            Op::Write { len, .. } => *len,
            _ => 0,
        }
    }

    /// The lane this operation's frame travels on.
    pub(crate) fn lane(&self) -> Lane {
        if self.payload() >= OWN_LANE_MIN { Lane::Own } else { Lane::Shared }
    }
}

/// Frames to send in one go, all on one lane.
#[derive(Debug)]
pub(crate) struct Batch<S> {
    /// The lane of `frames` (and of `tail`).
    pub(crate) lane: Lane,
    /// A lane switch to send first, on the other lane (the one the last frame went on).
    pub(crate) lead: Option<FrameHeader>,
    pub(crate) frames: Vec<(FrameHeader, Op<S>)>,
    /// A lane switch to send after `frames`, on `lane`: the next queued operation goes on the
    /// other lane.
    pub(crate) tail: Option<FrameHeader>,
}

impl<S> Batch<S> {
    /// A batch with nothing to send.
    pub(crate) fn empty() -> Self {
        Batch { lane: Lane::Shared, lead: None, frames: Vec::new(), tail: None }
    }

    /// Whether there is nothing to send.
    pub(crate) fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }
}

/// [`SenderCore::issue`] found the write queue at its bound.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct QueueFull {
    /// Operations issued and not yet confirmed applied.
    pub(crate) outstanding: u64,
}

/// Reads records (acknowledgements, refusals) from a byte stream cut anywhere.
#[derive(Debug, Default)]
struct RecordReader {
    head: [u8; RECORD],
    have: usize,
    /// A refusal's reason being read, and its announced length.
    reason: Option<(Vec<u8>, usize)>,
}

impl RecordReader {
    /// Consumes bytes from `input` and returns the number used and a complete record, if one
    /// ended. Stops after a record, so the caller acts on each in order.
    fn read(&mut self, input: &[u8]) -> Result<(usize, Option<Record>), String> {
        if let Some((buf, n)) = &mut self.reason {
            let take = (*n - buf.len()).min(input.len());
            buf.extend_from_slice(&input[..take]);
            if buf.len() < *n {
                return Ok((take, None));
            }
            let rec = Record::decode_reason(buf).map_err(|e| format!("sent a malformed record: {}", e.message()))?;
            self.reason = None;
            return Ok((take, Some(rec)));
        }
        let take = (RECORD - self.have).min(input.len());
        self.head[self.have..self.have + take].copy_from_slice(&input[..take]);
        self.have += take;
        if self.have < RECORD {
            return Ok((take, None));
        }
        self.have = 0;
        match Record::decode_head(&self.head).map_err(|e| format!("sent a malformed record: {}", e.message()))? {
            RecordHead::Ack(v) => Ok((take, Some(Record::Ack(v)))),
            RecordHead::Closing(v) => Ok((take, Some(Record::Closing(v)))),
            RecordHead::Refusal(n) => {
                self.reason = Some((Vec::with_capacity(n), n));
                let (more, rec) = self.read(&input[take..])?;
                Ok((take + more, rec))
            }
        }
    }
}

/// The sending half of a connection: sequence numbers, the write-queue bound, batching, when to
/// ask for an acknowledgement, and what the peer's records say.
#[derive(Debug)]
pub(crate) struct SenderCore<S> {
    queue: VecDeque<(u64, Op<S>)>,
    /// Sequence number of the last operation issued (the first is 1).
    issued: u64,
    /// Highest sequence number the peer confirmed applied.
    applied: u64,
    /// The peer said it is closing ([`Record::Closing`]): its acknowledgements are final.
    peer_closed: bool,
    max_queue: u64,
    /// Sequence number of the last frame that asked for an acknowledgement.
    asked: u64,
    records: RecordReader,
    failed: Option<String>,
    /// The lane the receiver reads next: the last frame's, or the one a switch named.
    lane: Lane,
}

impl<S> SenderCore<S> {
    /// A core allowing `max_queue` (at least 1) unconfirmed operations.
    pub(crate) fn new(max_queue: u64) -> Self {
        SenderCore {
            queue: VecDeque::new(),
            issued: 0,
            applied: 0,
            peer_closed: false,
            max_queue: max_queue.max(1),
            asked: 0,
            records: RecordReader::default(),
            failed: None,
            lane: Lane::Shared,
        }
    }

    /// The bound on unconfirmed operations.
    pub(crate) fn max_queue(&self) -> u64 {
        self.max_queue
    }

    /// Operations issued and not yet confirmed applied by the peer.
    pub(crate) fn outstanding(&self) -> u64 {
        self.issued - self.applied
    }

    /// Sequence number of the last operation issued (0 before the first).
    pub(crate) fn issued(&self) -> u64 {
        self.issued
    }

    /// Highest sequence number confirmed applied.
    pub(crate) fn applied(&self) -> u64 {
        self.applied
    }

    /// Whether the peer closed the connection deliberately (dropped it) and said what it applied.
    pub(crate) fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Queues `op` under the next sequence number, unless the queue bound is reached (then
    /// `op` comes back).
    pub(crate) fn issue(&mut self, op: Op<S>) -> Result<u64, (Op<S>, QueueFull)> {
        if self.outstanding() >= self.max_queue {
            return Err((op, QueueFull { outstanding: self.outstanding() }));
        }
        self.issued += 1;
        self.queue.push_back((self.issued, op));
        Ok(self.issued)
    }

    /// The next operation to send, if any.
    pub(crate) fn front(&self) -> Option<&Op<S>> {
        self.queue.front().map(|(_, op)| op)
    }

    /// Whether nothing waits to be sent.
    pub(crate) fn is_idle(&self) -> bool {
        self.queue.is_empty()
    }

    /// What `flush` waits for: the sequence number that must be confirmed, or `None` when
    /// everything issued is confirmed already. The shell then issues a [`Op::Nop`] probe so the
    /// peer acknowledges at once.
    pub(crate) fn flush_target(&self) -> Option<u64> {
        (self.applied < self.issued).then_some(self.issued)
    }

    /// Takes the next batch, in order, with the headers to send: at most [`BATCH_OPS`] frames and
    /// [`BATCH_BYTES`] of payload (one larger write goes alone), all of one lane, stopping at
    /// the first operation `may_send` rejects. Lane switches come with it: `lead` when the batch
    /// goes on another lane than the last frame, `tail` when it stops before an operation of the
    /// other lane (sent after the frames, in the same call).
    pub(crate) fn next_batch(&mut self, may_send: impl Fn(&Op<S>) -> bool) -> Batch<S> {
        let lane = self.queue.front().map_or(self.lane, |(_, op)| op.lane());
        let mut batch = Batch { lane, lead: None, frames: Vec::new(), tail: None };
        let mut bytes = 0u64;
        while let Some((seq, op)) = self.queue.front() {
            if !may_send(op) {
                break;
            }
            if op.lane() != lane {
                // The receiver reads the other lane from this frame on.
                batch.tail = Some(FrameHeader { seq: *seq, ack: false, op: FrameOp::Switch });
                self.lane = op.lane();
                break;
            }
            let len = op.payload();
            if !batch.frames.is_empty() && bytes + len > BATCH_BYTES {
                break;
            }
            let Some((seq, op)) = self.queue.pop_front() else { break };
            if batch.frames.is_empty() && self.lane != lane {
                batch.lead = Some(FrameHeader { seq, ack: false, op: FrameOp::Switch });
            }
            self.lane = lane;
            batch.frames.push((self.header(seq, &op), op));
            bytes += len;
            if batch.frames.len() >= BATCH_OPS {
                break;
            }
        }
        batch
    }

    fn header(&mut self, seq: u64, op: &Op<S>) -> FrameHeader {
        // Ask for an acknowledgement once half the bound is unconfirmed, then again only half the
        // bound later (not on every frame until the answer is back: that would have the receiver
        // answer each of them), and on every probe.
        let half = (self.max_queue / 2).max(1);
        let ack = (seq - self.applied >= half && seq - self.asked >= half) || matches!(op, Op::Nop);
        if ack {
            self.asked = seq;
        }
        let op = match *op {
            Op::Write { region, offset, len, .. } => FrameOp::Write { region, offset, len },
            Op::Set { region, offset, value } => FrameOp::Set { region, offset, value },
            Op::Add { region, offset, value } => FrameOp::Add { region, offset, value },
            Op::Nop => FrameOp::Nop,
        };
        FrameHeader { seq, ack, op }
    }

    /// Takes bytes the peer sent back (records, cut anywhere). An error (the peer refused a
    /// frame, acknowledged what was never sent, or sent garbage) ends the connection; its text
    /// follows "peer X ".
    pub(crate) fn handle_bytes(&mut self, mut input: &[u8]) -> Result<(), String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        while !input.is_empty() {
            let r = self.records.read(input).and_then(|(n, rec)| {
                input = &input[n..];
                match rec {
                    Some(Record::Ack(v) | Record::Closing(v)) if v > self.issued => {
                        Err(format!("acknowledged sequence {v} never sent"))
                    }
                    Some(Record::Ack(v)) => {
                        self.applied = self.applied.max(v);
                        Ok(())
                    }
                    Some(Record::Closing(v)) => {
                        self.applied = self.applied.max(v);
                        self.peer_closed = true;
                        Ok(())
                    }
                    Some(Record::Refusal(why)) => Err(format!("refused a frame and closed the connection: {why}")),
                    None => Ok(()),
                }
            });
            if let Err(why) = r {
                self.failed = Some(why.clone());
                return Err(why);
            }
        }
        Ok(())
    }
}

/// What the receiver knows of a region a frame names.
#[derive(Clone, Debug)]
pub(crate) struct RegionInfo<R> {
    /// The shell's handle, returned in events.
    pub(crate) handle: R,
    /// Start address (token words must be 8-byte aligned in memory).
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// Registered for the Ethernet transport.
    pub(crate) ethernet: bool,
}

/// What the receiver shell does next, in order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RxEvent<'a, R> {
    /// A write passed validation; its `len` payload bytes, next in the stream, go to `region` at
    /// `offset`. They come as [`RxEvent::Data`], or the shell reads them straight into place and
    /// reports them with [`ReceiverCore::payload_received`].
    Write { region: R, offset: u64, len: u64 },
    /// Payload bytes of the current write, for `offset` in its region.
    Data { offset: u64, bytes: &'a [u8] },
    /// Store (or with `add`, add) `value` to the token at `offset` of `region`.
    Token { region: R, offset: u64, value: u64, add: bool },
    /// Send [`Record::Ack`] with this sequence number: everything up to it is applied. Comes
    /// from a call that used no input.
    Ack(u64),
    /// The next frame comes on the sender's other lane: read that socket from now on (the
    /// rest of this one waits for the switch back).
    Switch,
}

/// The receiving half: reassembles headers from any cut of the stream, validates each against
/// the expected sequence number and the regions registered for Ethernet, and says what to apply
/// and when to acknowledge.
#[derive(Debug)]
pub(crate) struct ReceiverCore {
    head: [u8; HEADER],
    have: usize,
    /// Sequence number of the next frame.
    expect: u64,
    last_acked: u64,
    /// The current write's next offset and the payload bytes still due.
    payload: Option<(u64, u64)>,
    /// The current write's sequence number and whether its sender asked for an ack.
    current: (u64, bool),
    pending_ack: Option<u64>,
    failed: Option<String>,
}

impl Default for ReceiverCore {
    fn default() -> Self {
        ReceiverCore {
            head: [0; HEADER],
            have: 0,
            expect: 1,
            last_acked: 0,
            payload: None,
            current: (0, false),
            pending_ack: None,
            failed: None,
        }
    }
}

impl ReceiverCore {
    /// Takes bytes of the stream and returns how many it used and the next event, if any. Call it
    /// again with the rest of the input (perhaps empty) until it returns `(0, None)`: only then
    /// does it need more bytes (a due acknowledgement comes out of a call with no input).
    ///
    /// # Errors
    /// A frame that fails validation: the reason to send the peer in a [`Record::Refusal`]. The
    /// connection is over; nothing of that frame was applied, and every later call fails alike.
    pub(crate) fn handle_bytes<'a, R>(
        &mut self,
        input: &'a [u8],
        lookup: &impl Fn(u64) -> Option<RegionInfo<R>>,
    ) -> Result<(usize, Option<RxEvent<'a, R>>), String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        if let Some(seq) = self.pending_ack.take() {
            return Ok((0, Some(RxEvent::Ack(seq))));
        }
        if let Some((offset, left)) = self.payload {
            let n = left.min(input.len() as u64) as usize;
            if n == 0 {
                return Ok((0, None));
            }
            self.payload_received(n as u64, n < input.len());
            return Ok((n, Some(RxEvent::Data { offset, bytes: &input[..n] })));
        }
        let take = (HEADER - self.have).min(input.len());
        self.head[self.have..self.have + take].copy_from_slice(&input[..take]);
        self.have += take;
        if self.have < HEADER {
            return Ok((take, None));
        }
        self.have = 0;
        let more = take < input.len();
        match self.validate(lookup) {
            Ok(ev) => {
                let ev = match ev {
                    Validated::Write { region, offset, len, seq, ack } => {
                        self.current = (seq, ack);
                        self.payload = Some((offset, len));
                        if len == 0 {
                            self.payload_received(0, more);
                        }
                        RxEvent::Write { region, offset, len }
                    }
                    Validated::Token { region, offset, value, add, seq, ack } => {
                        self.complete(seq, ack, more);
                        RxEvent::Token { region, offset, value, add }
                    }
                    Validated::Nop { seq, ack } => {
                        // Nothing to apply; the acknowledgement (if due) comes from the next call.
                        self.complete(seq, ack, more);
                        return Ok((take, None));
                    }
                    // Nothing applied: the frame it names is still due, on the other lane.
                    Validated::Switch => RxEvent::Switch,
                };
                Ok((take, Some(ev)))
            }
            Err(why) => {
                self.failed = Some(why.clone());
                Err(why)
            }
        }
    }

    /// The last sequence number applied: every frame up to it has been handed to the shell as
    /// an event, and a write's payload has fully arrived (between calls, once the shell has acted
    /// on the events it got, all of them are in memory). What a closing receiver acknowledges.
    pub(crate) fn applied_through(&self) -> u64 {
        self.expect - 1
    }

    /// Whether an acknowledgement is due (the next call returns it, whatever the input).
    pub(crate) fn ack_due(&self) -> bool {
        self.pending_ack.is_some()
    }

    /// The current write's next offset and the payload bytes still due, if a write is being
    /// received.
    pub(crate) fn payload_pending(&self) -> Option<(u64, u64)> {
        self.payload
    }

    /// `n` payload bytes of the current write are in place (the shell read them itself);
    /// `more_input` says whether the shell holds further bytes of the stream already (the
    /// periodic acknowledgement waits for a pause in the input).
    pub(crate) fn payload_received(&mut self, n: u64, more_input: bool) {
        let Some((offset, left)) = self.payload else { return };
        let n = n.min(left);
        if n < left {
            self.payload = Some((offset + n, left - n));
            return;
        }
        self.payload = None;
        let (seq, ack) = self.current;
        self.complete(seq, ack, more_input);
    }

    /// Frame `seq` is applied (once the shell acts on the event in hand): decides whether to
    /// acknowledge.
    fn complete(&mut self, seq: u64, asked: bool, more_input: bool) {
        self.expect = seq + 1;
        if asked || (seq - self.last_acked >= ACK_EVERY && !more_input) {
            self.last_acked = seq;
            self.pending_ack = Some(seq);
        }
    }

    fn validate<R>(&self, lookup: &impl Fn(u64) -> Option<RegionInfo<R>>) -> Result<Validated<R>, String> {
        let h = FrameHeader::decode(&self.head)?;
        if h.seq != self.expect {
            return Err(format!("frame sequence {} where {} was due", h.seq, self.expect));
        }
        let (seq, ack) = (h.seq, h.ack);
        let (region, offset, need) = match h.op {
            FrameOp::Nop => return Ok(Validated::Nop { seq, ack }),
            FrameOp::Switch => return Ok(Validated::Switch),
            FrameOp::Write { region, offset, len } => (region, offset, len),
            FrameOp::Set { region, offset, .. } | FrameOp::Add { region, offset, .. } => (region, offset, 8),
        };
        let info = lookup(region).ok_or_else(|| format!("frame names region {region} which is not registered"))?;
        if !info.ethernet {
            return Err(format!("frame names region {region} which is not registered for Ethernet"));
        }
        let token = !matches!(h.op, FrameOp::Write { .. });
        if token && info.addr.wrapping_add(offset) % 8 != 0 {
            return Err(format!("token frame at unaligned offset {offset}"));
        }
        match offset.checked_add(need) {
            Some(end) if end <= info.len => {}
            _ => {
                return Err(format!(
                    "frame for region {region}: range [{offset}, {offset}+{need}) is outside the {}-byte region",
                    info.len
                ));
            }
        }
        let handle = info.handle;
        Ok(match h.op {
            FrameOp::Write { len, .. } => Validated::Write { region: handle, offset, len, seq, ack },
            FrameOp::Set { value, .. } => Validated::Token { region: handle, offset, value, add: false, seq, ack },
            FrameOp::Add { value, .. } => Validated::Token { region: handle, offset, value, add: true, seq, ack },
            FrameOp::Nop => Validated::Nop { seq, ack },
            FrameOp::Switch => Validated::Switch,
        })
    }
}

enum Validated<R> {
    Write { region: R, offset: u64, len: u64, seq: u64, ack: bool },
    Token { region: R, offset: u64, value: u64, add: bool, seq: u64, ack: bool },
    Nop { seq: u64, ack: bool },
    Switch,
}

#[cfg(test)]
mod tests;

/// The fuzz check of both cores on arbitrary peer bytes (`mscclpp::fuzzing`, form
/// `ethernet_stream`): the first byte picks the core (bit 0) and the size of the pieces the rest
/// is cut into. Nothing panics; every write and token the receiver lets through lies inside a
/// region registered for Ethernet, payload never exceeds its write, acknowledgements only grow
/// and name frames that arrived; the sender never counts more applied than it issued, and a
/// failed core stays failed.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_stream(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let piece = (mode >> 1) as usize + 1;
    if mode & 1 == 0 {
        let lookup = |id: u64| match id {
            1 => Some(RegionInfo { handle: 4096u64, addr: 0x10000, len: 4096, ethernet: true }),
            2 => Some(RegionInfo { handle: 4096, addr: 0x20000, len: 4096, ethernet: false }),
            3 => Some(RegionInfo { handle: 64, addr: 0x30004, len: 64, ethernet: true }),
            _ => None,
        };
        let mut core = ReceiverCore::default();
        let mut write_left = 0u64;
        let mut last_ack = 0u64;
        for chunk in rest.chunks(piece) {
            let mut input = chunk;
            loop {
                let (used, ev) = match core.handle_bytes(input, &lookup) {
                    Ok(x) => x,
                    Err(why) => {
                        assert!(core.handle_bytes(&[1], &lookup).is_err(), "a failed receiver went on: {why}");
                        return;
                    }
                };
                assert!(used <= input.len());
                match ev {
                    None if used == 0 => break,
                    None => {}
                    Some(RxEvent::Write { region, offset, len }) => {
                        assert_eq!(write_left, 0, "a write began inside another's payload");
                        assert!(offset.checked_add(len).is_some_and(|e| e <= region), "write outside its region");
                        write_left = len;
                    }
                    Some(RxEvent::Data { offset, bytes }) => {
                        assert!(bytes.len() as u64 <= write_left, "more payload than the write announced");
                        assert!(offset < 4096 && !bytes.is_empty());
                        write_left -= bytes.len() as u64;
                    }
                    Some(RxEvent::Token { region, offset, .. }) => {
                        assert!(offset.checked_add(8).is_some_and(|e| e <= region), "token outside its region");
                    }
                    Some(RxEvent::Ack(s)) => {
                        assert!(s > last_ack && s < core.expect, "ack {s} after {last_ack}, next due {}", core.expect);
                        last_ack = s;
                    }
                    Some(RxEvent::Switch) => assert_eq!(write_left, 0, "a lane switch inside a payload"),
                }
                input = &input[used..];
            }
        }
    } else {
        let mut core = SenderCore::<()>::new(64);
        for _ in 0..50 {
            let _ = core.issue(Op::Nop);
        }
        for chunk in rest.chunks(piece) {
            if let Err(why) = core.handle_bytes(chunk) {
                assert!(core.handle_bytes(&[]).is_err(), "a failed sender went on: {why}");
                return;
            }
            assert!(core.applied() <= 50 && core.outstanding() <= 50);
        }
    }
}
