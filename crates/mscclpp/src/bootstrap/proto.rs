//! The bootstrap's wire forms and its per-connection framing core, without I/O.
//!
//! Every form here is a [`WireForm`]: [`Hello`] (the first message on every socket),
//! [`RootAnswer`] (what the root sends a rank: a receipt, the table, a failure, or the missing
//! ranks), [`AddressTable`] (every rank's listening address and host hash), [`FrameHeader`] (in
//! front of every message between ranks) and [`AbortNotice`] (a rank telling its neighbours that
//! another rank failed).
//! [`FrameReader`] turns a byte stream cut anywhere into whole messages.

use std::net::SocketAddr;

use crate::error::{Error, Result};
use crate::net::{get_addr, put_addr};
use crate::wire::{Reader, WireForm, Writer};

/// Version of every bootstrap form below (2: frame headers carry a magic, the root's answers
/// and abort notices are structured; 3: the root answers a join at once and delivers the table
/// later on a connection of its own to the rank's listener, and ranks may query the root).
pub(crate) const PROTO_VERSION: u16 = 3;
const HELLO_MAGIC: &[u8; 4] = b"MSBS";
const ANSWER_MAGIC: &[u8; 4] = b"MSRA";
const TABLE_MAGIC: &[u8; 4] = b"MSAT";
const FRAME_MAGIC: &[u8; 4] = b"MSBM";
const ABORT_MAGIC: &[u8; 4] = b"MSAB";
const BLOCKS_MAGIC: &[u8; 4] = b"MSGB";

/// Hello kind: a rank opening a message connection to a peer.
pub(crate) const KIND_PEER: u8 = 1;
/// Hello kind: a rank joining at the root.
pub(crate) const KIND_ROOT: u8 = 2;
/// Hello kind: the root connecting to a rank's listener to deliver its final answer (the table,
/// or the failure); `rank` is the rank it is for.
pub(crate) const KIND_ANSWER: u8 = 3;
/// Hello kind: a rank that has joined asking the root which ranks are still missing.
pub(crate) const KIND_QUERY: u8 = 4;

/// The longest message between two ranks (1 TiB): a header announcing more is corrupt.
pub(crate) const MAX_MESSAGE: u64 = 1 << 40;

fn utf8(r: &Reader<'_>, b: &[u8]) -> Result<String> {
    String::from_utf8(b.to_vec()).map_err(|_| r.err("text is not UTF-8"))
}

/// The handshake every bootstrap socket opens with (after a `u32` length).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// [`KIND_PEER`], [`KIND_ROOT`], [`KIND_ANSWER`] or [`KIND_QUERY`].
    pub(crate) kind: u8,
    /// The job secret from the `UniqueId`.
    pub(crate) secret: [u8; 16],
    /// The sender's rank.
    pub(crate) rank: u32,
    /// The job size the sender believes in.
    pub(crate) size: u32,
    /// Root hellos only: the rank's peer listening address and host hash.
    pub(crate) listen: Option<(SocketAddr, u64)>,
}

impl WireForm for Hello {
    const WHAT: &'static str = "bootstrap hello";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::new(HELLO_MAGIC, PROTO_VERSION);
        w.u8(self.kind);
        w.raw(&self.secret);
        w.u32(self.rank);
        w.u32(self.size);
        if let Some((a, h)) = &self.listen {
            put_addr(&mut w, a);
            w.u64(*h);
        }
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, HELLO_MAGIC, PROTO_VERSION)?;
        let kind = r.u8()?;
        if !matches!(kind, KIND_PEER | KIND_ROOT | KIND_ANSWER | KIND_QUERY) {
            return Err(r.err(format!("unknown hello kind {kind}")));
        }
        let secret = r.array()?;
        let rank = r.u32()?;
        let size = r.u32()?;
        let listen = if kind == KIND_ROOT { Some((get_addr(&mut r)?, r.u64()?)) } else { None };
        r.finish()?;
        Ok(Hello { kind, secret, rank, size, listen })
    }
}

/// Every rank's peer listening address and host hash, indexed by rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AddressTable {
    pub(crate) entries: Vec<(SocketAddr, u64)>,
}

impl AddressTable {
    fn put(&self, w: &mut Writer) {
        w.u32(self.entries.len() as u32);
        for (a, h) in &self.entries {
            put_addr(w, a);
            w.u64(*h);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<AddressTable> {
        let n = r.u32()? as usize;
        // no allocation sized by the peer beyond what the input can hold (27 bytes an entry)
        let mut entries = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            entries.push((get_addr(r)?, r.u64()?));
        }
        Ok(AddressTable { entries })
    }
}

impl WireForm for AddressTable {
    const WHAT: &'static str = "bootstrap address table";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::new(TABLE_MAGIC, PROTO_VERSION);
        self.put(&mut w);
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, TABLE_MAGIC, PROTO_VERSION)?;
        let t = Self::get(&mut r)?;
        r.finish()?;
        Ok(t)
    }
}

/// What the root tells a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RootStatus {
    /// Still waiting; these ranks have not arrived yet (the answer to a query).
    Progress { missing: Vec<u32> },
    /// The root gave up on this rank or on the job; `timeout` when ranks did not arrive in time.
    Failed { timeout: bool, message: String },
    /// Everyone arrived.
    Done(AddressTable),
    /// The join is recorded; the final answer comes later, on a connection from the root to the
    /// rank's listener.
    Joined,
}

/// A root answer: the job secret (so a rank knows it talked to its own root) and a status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RootAnswer {
    pub(crate) secret: [u8; 16],
    pub(crate) status: RootStatus,
}

impl WireForm for RootAnswer {
    const WHAT: &'static str = "bootstrap root answer";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::new(ANSWER_MAGIC, PROTO_VERSION);
        w.raw(&self.secret);
        match &self.status {
            RootStatus::Progress { missing } => {
                w.u8(0);
                w.u32(missing.len() as u32);
                for m in missing {
                    w.u32(*m);
                }
            }
            RootStatus::Failed { timeout, message } => {
                w.u8(1);
                w.u8(*timeout as u8);
                // messages are the root's own text, far below 4 GiB
                let _ = w.bytes(message.as_bytes());
            }
            RootStatus::Done(t) => {
                w.u8(2);
                t.put(&mut w);
            }
            RootStatus::Joined => w.u8(3),
        }
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, ANSWER_MAGIC, PROTO_VERSION)?;
        let secret = r.array()?;
        let status = match r.u8()? {
            0 => {
                let n = r.u32()? as usize;
                let mut missing = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    missing.push(r.u32()?);
                }
                RootStatus::Progress { missing }
            }
            1 => {
                let timeout = match r.u8()? {
                    0 => false,
                    1 => true,
                    x => return Err(r.err(format!("bad timeout flag {x}"))),
                };
                let b = r.bytes()?;
                RootStatus::Failed { timeout, message: utf8(&r, b)? }
            }
            2 => RootStatus::Done(AddressTable::get(&mut r)?),
            3 => RootStatus::Joined,
            s => return Err(r.err(format!("unknown root status {s}"))),
        };
        r.finish()?;
        Ok(RootAnswer { secret, status })
    }
}

/// The header in front of every message between two ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub(crate) tag: u64,
    pub(crate) len: u64,
}

impl FrameHeader {
    /// Encoded size: magic, version, tag, length.
    pub(crate) const LEN: usize = 4 + 2 + 8 + 8;
}

impl WireForm for FrameHeader {
    const WHAT: &'static str = "bootstrap message header";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::new(FRAME_MAGIC, PROTO_VERSION);
        w.u64(self.tag);
        w.u64(self.len);
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, FRAME_MAGIC, PROTO_VERSION)?;
        let tag = r.u64()?;
        let len = r.u64()?;
        if len > MAX_MESSAGE {
            return Err(r.err(format!("message length {len} is above the {MAX_MESSAGE}-byte limit")));
        }
        r.finish()?;
        Ok(FrameHeader { tag, len })
    }
}

/// A rank's report that another rank failed, flooded over the collectives' links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AbortNotice {
    /// The rank that failed.
    pub(crate) failed: u32,
    /// The rank that saw it fail.
    pub(crate) reporter: u32,
    /// What the reporter saw.
    pub(crate) reason: String,
}

impl WireForm for AbortNotice {
    const WHAT: &'static str = "bootstrap abort notice";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::new(ABORT_MAGIC, PROTO_VERSION);
        w.u32(self.failed);
        w.u32(self.reporter);
        // reasons are our own text, far below 4 GiB
        let _ = w.bytes(self.reason.as_bytes());
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, ABORT_MAGIC, PROTO_VERSION)?;
        let failed = r.u32()?;
        let reporter = r.u32()?;
        let b = r.bytes()?;
        let reason = utf8(&r, b)?;
        r.finish()?;
        Ok(AbortNotice { failed, reporter, reason })
    }
}

/// Ranks' pieces of an `all_gather` travelling up or down the tree: `(rank, bytes)` in
/// increasing rank order, each rank at most once; or `overflow`, with no pieces, when a subtree
/// holds too much for the tree and the ranks take the ring instead.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub(crate) struct GatherBlocks {
    pub(crate) overflow: bool,
    pub(crate) blocks: Vec<(u32, Vec<u8>)>,
}

impl GatherBlocks {
    /// The encoding, failing only for a piece of 4 GiB or more.
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let mut w = Writer::new(BLOCKS_MAGIC, PROTO_VERSION);
        w.u8(self.overflow as u8);
        w.u32(self.blocks.len() as u32);
        for (r, b) in &self.blocks {
            w.u32(*r);
            w.bytes(b)?;
        }
        Ok(w.finish())
    }
}

impl WireForm for GatherBlocks {
    const WHAT: &'static str = "bootstrap all_gather blocks";
    fn to_wire(&self) -> Vec<u8> {
        self.encode().unwrap_or_default()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, BLOCKS_MAGIC, PROTO_VERSION)?;
        let overflow = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(r.err(format!("bad overflow flag {x}"))),
        };
        let n = r.u32()? as usize;
        if overflow && n != 0 {
            return Err(r.err("an overflow marker carries no pieces"));
        }
        let mut blocks: Vec<(u32, Vec<u8>)> = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let rank = r.u32()?;
            if blocks.last().is_some_and(|(prev, _)| *prev >= rank) {
                return Err(r.err(format!("rank {rank} out of order")));
            }
            blocks.push((rank, r.bytes()?.to_vec()));
        }
        r.finish()?;
        Ok(GatherBlocks { overflow, blocks })
    }
}

/// What [`FrameReader`] reserves for a message before its bytes arrive, at most.
const INITIAL_RESERVE: usize = 16 << 20;

/// Turns the bytes of one incoming connection, cut at any boundary, into whole messages.
///
/// Feed it what each `read` returned; it returns the messages completed so far. After an error
/// (a corrupt header, a length it cannot allocate) the stream is unusable and every later call
/// fails too.
#[derive(Default)]
pub(crate) struct FrameReader {
    head: Vec<u8>,
    /// The message being read: tag, bytes so far, full length.
    body: Option<(u64, Vec<u8>, usize)>,
    broken: Option<String>,
}

impl FrameReader {
    /// Consumes all of `input`, appending completed `(tag, message)` pairs to `out`.
    pub(crate) fn push(&mut self, mut input: &[u8], out: &mut Vec<(u64, Vec<u8>)>) -> Result<()> {
        if let Some(why) = &self.broken {
            return Err(Error::remote(format!("message stream already broken: {why}")));
        }
        while !input.is_empty() {
            match &mut self.body {
                None => {
                    let want = FrameHeader::LEN - self.head.len();
                    let n = want.min(input.len());
                    self.head.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if self.head.len() == FrameHeader::LEN {
                        let h = match FrameHeader::from_wire(&self.head) {
                            Ok(h) => h,
                            Err(e) => return Err(self.fail(e)),
                        };
                        self.head.clear();
                        // MAX_MESSAGE fits in usize on the 64-bit targets we build for
                        let len = usize::try_from(h.len).unwrap_or(usize::MAX);
                        // Room for the whole message up to 16 MiB now; beyond that the buffer
                        // grows as bytes arrive, so a header alone cannot claim much memory.
                        let mut data = Vec::new();
                        if data.try_reserve_exact(len.min(INITIAL_RESERVE)).is_err() {
                            return Err(self.fail(Error::remote(format!("cannot allocate {len} bytes for a message"))));
                        }
                        if len == 0 {
                            out.push((h.tag, data));
                        } else {
                            self.body = Some((h.tag, data, len));
                        }
                    }
                }
                Some((tag, data, len)) => {
                    let n = (*len - data.len()).min(input.len());
                    if data.try_reserve(n).is_err() {
                        let len = *len;
                        return Err(self.fail(Error::remote(format!("cannot allocate {len} bytes for a message"))));
                    }
                    data.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if data.len() == *len {
                        let tag = *tag;
                        if let Some((_, data, _)) = self.body.take() {
                            out.push((tag, data));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the stream is between messages (an end of stream here is a clean close).
    pub(crate) fn at_boundary(&self) -> bool {
        self.head.is_empty() && self.body.is_none() && self.broken.is_none()
    }

    fn fail(&mut self, e: Error) -> Error {
        self.broken = Some(e.to_string());
        e
    }
}

/// The bytes that carry message `data` under `tag`: a header, then the data.
pub(crate) fn frame_header(tag: u64, len: usize) -> Vec<u8> {
    FrameHeader { tag, len: len as u64 }.to_wire()
}

/// For the fuzz registry: any byte stream, fed whole and cut at one point chosen by its first
/// byte, gives the same messages or the same refusal, and never panics.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_frame_stream(data: &[u8]) {
    let mut whole = FrameReader::default();
    let mut a = Vec::new();
    let ra = whole.push(data, &mut a);
    let cut = data.first().map_or(0, |b| *b as usize % (data.len() + 1));
    let mut split = FrameReader::default();
    let mut b = Vec::new();
    let rb = split.push(&data[..cut], &mut b).and_then(|_| split.push(&data[cut..], &mut b));
    assert_eq!(ra.is_ok(), rb.is_ok(), "a cut changed whether the stream is refused");
    if ra.is_ok() {
        assert_eq!(a, b, "a cut changed the messages");
        assert_eq!(whole.at_boundary(), split.at_boundary());
    }
    // what was decoded re-encodes to a prefix of the input
    let mut re = Vec::new();
    for (t, m) in &a {
        re.extend_from_slice(&frame_header(*t, m.len()));
        re.extend_from_slice(m);
    }
    assert_eq!(&data[..re.len()], &re[..], "decoded messages do not re-encode to the input");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::check::{check_bytes, check_value};
    use proptest::prelude::*;

    fn frames(msgs: &[(u64, Vec<u8>)]) -> Vec<u8> {
        let mut v = Vec::new();
        for (t, m) in msgs {
            v.extend_from_slice(&frame_header(*t, m.len()));
            v.extend_from_slice(m);
        }
        v
    }

    #[test]
    fn frames_split_at_every_byte_boundary() {
        let msgs = vec![(1u64, b"hello".to_vec()), (u64::MAX, vec![]), (7, (0..200u8).collect()), (0, vec![9])];
        let bytes = frames(&msgs);
        for cut in 0..=bytes.len() {
            let mut r = FrameReader::default();
            let mut out = Vec::new();
            r.push(&bytes[..cut], &mut out).unwrap();
            r.push(&bytes[cut..], &mut out).unwrap();
            assert_eq!(out, msgs, "cut at {cut}");
            assert!(r.at_boundary());
        }
        // one byte at a time
        let mut r = FrameReader::default();
        let mut out = Vec::new();
        for (i, b) in bytes.iter().enumerate() {
            r.push(std::slice::from_ref(b), &mut out).unwrap();
            let done: usize = msgs
                .iter()
                .map(|(_, m)| FrameHeader::LEN + m.len())
                .scan(0, |s, l| {
                    *s += l;
                    Some(*s)
                })
                .filter(|end| *end <= i + 1)
                .count();
            assert_eq!(out.len(), done, "after byte {i}");
        }
        assert_eq!(out, msgs);
    }

    #[test]
    fn a_stream_cut_mid_message_is_not_at_a_boundary() {
        let bytes = frames(&[(3, vec![1, 2, 3])]);
        for cut in 1..bytes.len() {
            let mut r = FrameReader::default();
            let mut out = Vec::new();
            r.push(&bytes[..cut], &mut out).unwrap();
            assert!(!r.at_boundary(), "cut at {cut}");
            assert!(out.is_empty());
        }
    }

    #[test]
    fn corrupted_headers_break_the_stream() {
        let good = frames(&[(3, vec![1, 2, 3])]);
        // every byte of magic and version, and the length's top bytes, matter
        for i in (0..6).chain(14 + 5..FrameHeader::LEN) {
            let mut bad = good.clone();
            bad[i] ^= 0x80;
            let mut r = FrameReader::default();
            let mut out = Vec::new();
            let e = r.push(&bad, &mut out).unwrap_err();
            assert!(e.to_string().contains("message header"), "byte {i}: {e}");
            assert!(out.is_empty());
            assert!(!r.at_boundary());
            assert!(r.push(&good, &mut out).is_err(), "a broken stream stays broken");
        }
        // a length just over the limit
        let mut bad = FrameHeader { tag: 0, len: MAX_MESSAGE }.to_wire();
        bad[14..].copy_from_slice(&(MAX_MESSAGE + 1).to_le_bytes());
        assert!(FrameReader::default().push(&bad, &mut Vec::new()).is_err());
    }

    #[test]
    fn root_answer_kinds_round_trip() {
        let t =
            AddressTable { entries: vec![("10.0.0.1:5".parse().unwrap(), 7), ("[::1]:9".parse().unwrap(), u64::MAX)] };
        for status in [
            RootStatus::Progress { missing: vec![] },
            RootStatus::Progress { missing: vec![3, 4, 511] },
            RootStatus::Failed { timeout: true, message: "ranks [2] did not reach the root".into() },
            RootStatus::Done(t.clone()),
            RootStatus::Joined,
        ] {
            check_value(&RootAnswer { secret: [5; 16], status });
        }
        check_value(&t);
        // non-UTF-8 text is refused (it would not re-encode the same)
        let mut b = RootAnswer { secret: [0; 16], status: RootStatus::Failed { timeout: false, message: "ab".into() } }
            .to_wire();
        let n = b.len();
        b[n - 1] = 0xff;
        assert!(RootAnswer::from_wire(&b).is_err());
    }

    fn any_addr() -> impl Strategy<Value = SocketAddr> {
        (any::<std::net::IpAddr>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::new(ip, p))
    }

    proptest! {
        #[test]
        fn hello_wire_form(kind in 1u8..=4, secret: [u8; 16], rank: u32, size: u32, addr in any_addr(), hash: u64,
                           junk in proptest::collection::vec(any::<u8>(), 0..96)) {
            let root = kind == KIND_ROOT;
            let h = Hello { kind, secret, rank, size, listen: root.then_some((addr, hash)) };
            check_value(&h);
            check_bytes::<Hello>(&junk);
        }

        #[test]
        fn address_table_wire_form(entries in proptest::collection::vec((any_addr(), any::<u64>()), 0..6),
                                   junk in proptest::collection::vec(any::<u8>(), 0..96)) {
            check_value(&AddressTable { entries });
            check_bytes::<AddressTable>(&junk);
        }

        #[test]
        fn root_answer_wire_form(secret: [u8; 16], which in 0..4u8, missing in proptest::collection::vec(any::<u32>(), 0..6),
                                 timeout: bool, message in ".{0,20}",
                                 entries in proptest::collection::vec((any_addr(), any::<u64>()), 0..4),
                                 junk in proptest::collection::vec(any::<u8>(), 0..96)) {
            let status = match which {
                0 => RootStatus::Progress { missing },
                1 => RootStatus::Failed { timeout, message },
                2 => RootStatus::Done(AddressTable { entries }),
                _ => RootStatus::Joined,
            };
            check_value(&RootAnswer { secret, status });
            check_bytes::<RootAnswer>(&junk);
        }

        #[test]
        fn frame_header_wire_form(tag: u64, len in 0..=MAX_MESSAGE, junk in proptest::collection::vec(any::<u8>(), 0..40)) {
            check_value(&FrameHeader { tag, len });
            check_bytes::<FrameHeader>(&junk);
        }

        #[test]
        fn abort_notice_wire_form(failed: u32, reporter: u32, reason in ".{0,30}",
                                  junk in proptest::collection::vec(any::<u8>(), 0..64)) {
            check_value(&AbortNotice { failed, reporter, reason });
            check_bytes::<AbortNotice>(&junk);
        }

        #[test]
        fn frame_stream_check(junk in proptest::collection::vec(any::<u8>(), 0..200), tag: u64, body in proptest::collection::vec(any::<u8>(), 0..50)) {
            check_frame_stream(&junk);
            let mut v = frame_header(tag, body.len());
            v.extend_from_slice(&body);
            v.extend_from_slice(&junk);
            check_frame_stream(&v);
        }

        #[test]
        fn gather_blocks_wire_form(ranks in proptest::collection::btree_set(any::<u32>(), 0..6), len in 0usize..20,
                                   junk in proptest::collection::vec(any::<u8>(), 0..96)) {
            let blocks = ranks.into_iter().map(|r| (r, vec![r as u8; len])).collect();
            check_value(&GatherBlocks { overflow: false, blocks });
            check_value(&GatherBlocks { overflow: true, blocks: vec![] });
            check_bytes::<GatherBlocks>(&junk);
        }

        /// Random messages, cut into random pieces, come out whole and in order.
        #[test]
        fn frames_survive_random_cuts(msgs in proptest::collection::vec((any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300)), 0..8),
                                      cuts in proptest::collection::vec(0usize..4000, 0..12)) {
            let bytes = frames(&msgs);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort();
            let mut r = FrameReader::default();
            let mut out = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                r.push(&bytes[at..c], &mut out).unwrap();
                at = c;
            }
            prop_assert_eq!(out, msgs);
            prop_assert!(r.at_boundary());
        }
    }
}
