//! The Ethernet transport's wire forms: the frame header, the records the receiver sends back
//! (acknowledgement, refusal) and the two handshake messages. Each is a [`WireForm`]: decoding
//! checks everything that does not depend on the receiver's state (known operation and flags,
//! zero padding, fields an operation does not use at zero), so the protocol cores only check
//! sequence numbers and regions.

use crate::error::{Error, Result};
use crate::wire::{Reader, WireForm, Writer};

/// Size of a frame header.
pub(crate) const HEADER: usize = 48;
/// Size of a record's fixed part.
pub(crate) const RECORD: usize = 16;
/// Longest refusal reason a receiver sends or a sender accepts.
pub(crate) const MAX_REASON: usize = 4096;

const OP_WRITE: u8 = 1;
const OP_SET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_NOP: u8 = 4;
const OP_SWITCH: u8 = 5;
const FLAG_ACK: u8 = 1;

const REC_ACK: u8 = 1;
const REC_ERR: u8 = 2;
const REC_CLOSE: u8 = 3;

const HS_MAGIC: &[u8; 4] = b"MSEH";
/// Version 3: three sockets per pair, each opened with its [`Lane`] (see "Sockets" in `mod.rs`);
/// peers of versions 1 and 2 (two sockets) are refused at the handshake.
const HS_VERSION: u16 = 3;
const HS_ACK: u8 = 0xa5;
const HS_LANE_SHARED: u8 = 1;
const HS_LANE_OWN: u8 = 2;
/// Size of a [`Hello`] body.
pub(crate) const HELLO_LEN: usize = 4 + 2 + 16 + 8 + 1;
/// Size of a [`HelloAck`].
pub(crate) const HELLO_ACK_LEN: usize = 9;

/// What a frame asks the receiver to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrameOp {
    /// `len` payload bytes follow the header; they go to `region` at `offset`.
    Write { region: u64, offset: u64, len: u64 },
    /// Store `value` into the 8-byte token at `offset`.
    Set { region: u64, offset: u64, value: u64 },
    /// Add `value` (wrapping) to the 8-byte token at `offset`.
    Add { region: u64, offset: u64, value: u64 },
    /// Nothing to apply: a probe that asks for an acknowledgement (`flush`).
    Nop,
    /// Nothing to apply: frame `seq` (this header's sequence number, still due) and the ones
    /// after it come on the sender's other lane (see "Sockets" in `mod.rs`).
    Switch,
}

/// Which socket a frame travels on, and what a socket carries (named in its [`Hello`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The socket both sides' small frames share (the low side dials it), so that a reply
    /// carries the TCP acknowledgement of the frame it answers.
    Shared,
    /// The socket a side dials for its own large writes; its records (acknowledgements of the
    /// peer's frames) come back on it.
    Own,
}

impl Lane {
    /// The other lane.
    pub(crate) fn other(self) -> Lane {
        match self {
            Lane::Shared => Lane::Own,
            Lane::Own => Lane::Shared,
        }
    }
}

/// The 48-byte header in front of every frame, little-endian: operation, flags, 6 zero bytes,
/// sequence number, region id (in the receiver's context), offset, payload length, value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Sequence number; the first frame of a connection is 1.
    pub(crate) seq: u64,
    /// The sender asks for an acknowledgement once this frame is applied.
    pub(crate) ack: bool,
    pub(crate) op: FrameOp,
}

impl FrameHeader {
    /// The header's bytes, for a vectored send.
    pub(crate) fn encode(&self) -> [u8; HEADER] {
        let (op, region, offset, len, value) = match self.op {
            FrameOp::Write { region, offset, len } => (OP_WRITE, region, offset, len, 0),
            FrameOp::Set { region, offset, value } => (OP_SET, region, offset, 8, value),
            FrameOp::Add { region, offset, value } => (OP_ADD, region, offset, 8, value),
            FrameOp::Nop => (OP_NOP, 0, 0, 0, 0),
            FrameOp::Switch => (OP_SWITCH, 0, 0, 0, 0),
        };
        let mut b = [0u8; HEADER];
        b[0] = op;
        b[1] = if self.ack { FLAG_ACK } else { 0 };
        for (i, v) in [self.seq, region, offset, len, value].into_iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Decodes a header, refusing (with the reason the receiver reports) anything malformed.
    pub(crate) fn decode(b: &[u8; HEADER]) -> std::result::Result<FrameHeader, String> {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(w)
        };
        let (op, flags) = (b[0], b[1]);
        if flags & !FLAG_ACK != 0 || b[2..8] != [0; 6] {
            return Err(format!("frame with unknown flags {flags:#x}"));
        }
        let (seq, region, offset, len, value) = (word(0), word(1), word(2), word(3), word(4));
        let op = match op {
            OP_NOP => {
                if region != 0 || offset != 0 || len != 0 || value != 0 {
                    return Err("probe frame with non-zero fields".into());
                }
                FrameOp::Nop
            }
            OP_SWITCH => {
                if region != 0 || offset != 0 || len != 0 || value != 0 || flags != 0 {
                    return Err("lane switch with non-zero fields or flags".into());
                }
                FrameOp::Switch
            }
            OP_WRITE => {
                if value != 0 {
                    return Err("write frame with a non-zero value field".into());
                }
                FrameOp::Write { region, offset, len }
            }
            OP_SET | OP_ADD => {
                if len != 8 {
                    return Err(format!("token frame with length {len}"));
                }
                if op == OP_SET {
                    FrameOp::Set { region, offset, value }
                } else {
                    FrameOp::Add { region, offset, value }
                }
            }
            op => return Err(format!("frame with unknown operation {op}")),
        };
        Ok(FrameHeader { seq, ack: flags & FLAG_ACK != 0, op })
    }
}

impl WireForm for FrameHeader {
    const WHAT: &'static str = "Ethernet frame header";
    fn to_wire(&self) -> Vec<u8> {
        self.encode().to_vec()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let b: &[u8; HEADER] = bytes.try_into().map_err(|_| {
            Error::remote(format!("malformed {}: {} bytes where {HEADER} are due", Self::WHAT, bytes.len()))
        })?;
        FrameHeader::decode(b).map_err(|why| Error::remote(format!("malformed {}: {why}", Self::WHAT)))
    }
}

/// What the receiver sends back on the sender's socket: 16 bytes (kind, 7 zero bytes, a
/// little-endian value), and for a refusal the reason's UTF-8 bytes (as many as the value says).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Record {
    /// Every frame up to this sequence number is applied.
    Ack(u64),
    /// A frame was refused for this reason; the receiver closes the connection.
    Refusal(String),
    /// The receiver is closing (its connection was dropped): every frame up to this sequence
    /// number is applied, and nothing after it will be.
    Closing(u64),
}

/// What the fixed part of a record says.
pub(crate) enum RecordHead {
    /// A complete acknowledgement.
    Ack(u64),
    /// A refusal whose reason (this many bytes) follows.
    Refusal(usize),
    /// A complete closing acknowledgement.
    Closing(u64),
}

impl Record {
    /// A refusal, its reason cut (at a character boundary) to [`MAX_REASON`] bytes.
    pub(crate) fn refusal(why: &str) -> Record {
        let mut n = why.len().min(MAX_REASON);
        while !why.is_char_boundary(n) {
            n -= 1;
        }
        Record::Refusal(why[..n].to_string())
    }

    /// Decodes the fixed part of a record.
    pub(crate) fn decode_head(b: &[u8; RECORD]) -> Result<RecordHead> {
        let mut v = [0u8; 8];
        v.copy_from_slice(&b[8..]);
        let v = u64::from_le_bytes(v);
        if b[1..8] != [0; 7] {
            return Err(Error::remote(format!("malformed Ethernet record: padding {:02x?}", &b[1..8])));
        }
        match b[0] {
            REC_ACK => Ok(RecordHead::Ack(v)),
            REC_CLOSE => Ok(RecordHead::Closing(v)),
            REC_ERR => match usize::try_from(v) {
                Ok(n) if n <= MAX_REASON => Ok(RecordHead::Refusal(n)),
                _ => Err(Error::remote(format!("a refusal of {v} bytes is longer than {MAX_REASON}"))),
            },
            k => Err(Error::remote(format!("unknown record kind {k}"))),
        }
    }

    /// Decodes a refusal's reason.
    pub(crate) fn decode_reason(b: &[u8]) -> Result<Record> {
        let s =
            std::str::from_utf8(b).map_err(|e| Error::remote(format!("a refusal reason that is not UTF-8: {e}")))?;
        Ok(Record::Refusal(s.to_string()))
    }
}

impl WireForm for Record {
    const WHAT: &'static str = "Ethernet record";
    fn to_wire(&self) -> Vec<u8> {
        let (kind, v, extra) = match self {
            Record::Ack(s) => (REC_ACK, *s, &[][..]),
            Record::Closing(s) => (REC_CLOSE, *s, &[][..]),
            Record::Refusal(why) => (REC_ERR, why.len() as u64, why.as_bytes()),
        };
        let mut b = Vec::with_capacity(RECORD + extra.len());
        b.push(kind);
        b.extend_from_slice(&[0; 7]);
        b.extend_from_slice(&v.to_le_bytes());
        b.extend_from_slice(extra);
        b
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let short = || Error::remote(format!("malformed {}: {} bytes", Self::WHAT, bytes.len()));
        let head: &[u8; RECORD] = bytes.get(..RECORD).and_then(|h| h.try_into().ok()).ok_or_else(short)?;
        let rest = &bytes[RECORD..];
        match Record::decode_head(head)? {
            RecordHead::Ack(v) if rest.is_empty() => Ok(Record::Ack(v)),
            RecordHead::Closing(v) if rest.is_empty() => Ok(Record::Closing(v)),
            RecordHead::Refusal(n) if rest.len() == n => Record::decode_reason(rest),
            _ => Err(short()),
        }
    }
}

/// The first message on a socket, from the side that opened it: the endpoint's secret, the
/// opener's context id and what the socket carries. Sent length-prefixed; this is the body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) secret: [u8; 16],
    pub(crate) context: u64,
    pub(crate) lane: Lane,
}

impl WireForm for Hello {
    const WHAT: &'static str = "Ethernet handshake";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::new(HS_MAGIC, HS_VERSION);
        w.raw(&self.secret);
        w.u64(self.context);
        w.u8(match self.lane {
            Lane::Shared => HS_LANE_SHARED,
            Lane::Own => HS_LANE_OWN,
        });
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, HS_MAGIC, HS_VERSION)?;
        let secret = r.array()?;
        let context = r.u64()?;
        let lane = match r.u8()? {
            HS_LANE_SHARED => Lane::Shared,
            HS_LANE_OWN => Lane::Own,
            l => return Err(r.err(format!("unknown lane {l}"))),
        };
        r.finish()?;
        Ok(Hello { secret, context, lane })
    }
}

/// The accepting side's answer to a [`Hello`] with the right secret: a marker byte and its
/// context id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HelloAck {
    pub(crate) context: u64,
}

impl WireForm for HelloAck {
    const WHAT: &'static str = "Ethernet handshake answer";
    fn to_wire(&self) -> Vec<u8> {
        let mut b = vec![HS_ACK];
        b.extend_from_slice(&self.context.to_le_bytes());
        b
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let b: &[u8; HELLO_ACK_LEN] = bytes.try_into().map_err(|_| {
            Error::remote(format!("malformed {}: {} bytes where {HELLO_ACK_LEN} are due", Self::WHAT, bytes.len()))
        })?;
        if b[0] != HS_ACK {
            return Err(Error::remote(format!("the peer answered the handshake with {:#x}", b[0])));
        }
        let mut c = [0u8; 8];
        c.copy_from_slice(&b[1..]);
        Ok(HelloAck { context: u64::from_le_bytes(c) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::check::{check_bytes, check_value};
    use proptest::prelude::*;

    fn frame_op() -> impl Strategy<Value = FrameOp> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(region, offset, len)| FrameOp::Write {
                region,
                offset,
                len
            }),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(region, offset, value)| FrameOp::Set {
                region,
                offset,
                value
            }),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(region, offset, value)| FrameOp::Add {
                region,
                offset,
                value
            }),
            Just(FrameOp::Nop),
            Just(FrameOp::Switch),
        ]
    }

    proptest! {
        #[test]
        fn frame_header_wire_form(seq: u64, ack: bool, op in frame_op(),
                                  junk in proptest::collection::vec(any::<u8>(), HEADER..HEADER + 1)) {
            // A lane switch never asks for an acknowledgement.
            let h = FrameHeader { seq, ack: ack && op != FrameOp::Switch, op };
            check_value(&h);
            prop_assert_eq!(FrameHeader::from_wire(&h.to_wire()).unwrap(), h);
            check_bytes::<FrameHeader>(&junk);
        }

        #[test]
        fn record_wire_form(seq: u64, why in ".{0,40}", junk in proptest::collection::vec(any::<u8>(), 0..40)) {
            check_value(&Record::Ack(seq));
            check_value(&Record::Closing(seq));
            check_value(&Record::refusal(&why));
            check_bytes::<Record>(&junk);
        }

        #[test]
        fn handshake_wire_forms(secret: [u8; 16], context: u64, junk in proptest::collection::vec(any::<u8>(), 0..40)) {
            check_value(&Hello { secret, context, lane: Lane::Shared });
            check_value(&Hello { secret, context, lane: Lane::Own });
            check_value(&HelloAck { context });
            check_bytes::<Hello>(&junk);
            check_bytes::<HelloAck>(&junk);
        }
    }

    #[test]
    fn older_handshakes_are_refused() {
        for v in [1u16, 2] {
            let mut b = Hello { secret: [1; 16], context: 2, lane: Lane::Own }.to_wire();
            b[4..6].copy_from_slice(&v.to_le_bytes());
            let e = Hello::from_wire(&b).unwrap_err().to_string();
            assert!(e.contains(&format!("version {v} is not supported")), "{e}");
        }
        let mut b = Hello { secret: [1; 16], context: 2, lane: Lane::Own }.to_wire();
        let last = b.len() - 1;
        b[last] = 7;
        let e = Hello::from_wire(&b).unwrap_err().to_string();
        assert!(e.contains("unknown lane 7"), "{e}");
    }

    #[test]
    fn lane_switches_carry_nothing_else() {
        let mut b = FrameHeader { seq: 9, ack: false, op: FrameOp::Switch }.encode();
        assert_eq!(FrameHeader::decode(&b).unwrap().op, FrameOp::Switch);
        b[1] = FLAG_ACK;
        assert!(FrameHeader::decode(&b).unwrap_err().contains("lane switch"));
        b[1] = 0;
        b[40] = 1;
        assert!(FrameHeader::decode(&b).unwrap_err().contains("lane switch"));
    }

    #[test]
    fn refusal_reasons_are_bounded() {
        let long = "é".repeat(MAX_REASON);
        let Record::Refusal(r) = Record::refusal(&long) else { unreachable!() };
        assert!(r.len() <= MAX_REASON && r.len() >= MAX_REASON - 1);
        let mut b = Record::Refusal("x".repeat(MAX_REASON + 1)).to_wire();
        assert!(Record::from_wire(&b).unwrap_err().to_string().contains("longer than"));
        b.truncate(RECORD);
        b[0] = 9;
        assert!(Record::from_wire(&b).unwrap_err().to_string().contains("unknown record kind 9"));
    }
}
