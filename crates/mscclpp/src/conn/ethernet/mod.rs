//! The Ethernet (TCP) transport.
//!
//! # Layout
//! [`core`] holds the protocol without I/O: the sender core (sequence numbers, the write-queue
//! bound, batching, acknowledgement requests, the peer's records) and the receiver core (headers
//! reassembled from any cut of the stream, validation, what to apply and when to acknowledge).
//! [`wire`] holds the byte forms (frame header, records, handshake). The rest is the shell that
//! drives the cores: `acceptor` (the endpoint's accept thread and the handshake both ways),
//! `send` (queueing, batching, the sender thread, acknowledgements), `recv` (applying the
//! peer's frames), `stager` (GPU memory through pinned host buffers) and `connection` (the
//! handle, `flush`, closing, and `connect`, which starts the three threads).
//!
//! # Sockets
//! Each pair of endpoints has three TCP sockets, each opened with a handshake naming its lane
//! (an endpoint accepts on a thread of its own from the moment it is created, so `connect`
//! never waits for the peer to be inside `connect` too, and all-pairs setup in any order cannot
//! deadlock):
//! - each side dials its *own* lane: its writes of 64 KiB and more ([`core::OWN_LANE_MIN`]) go
//!   out on it, and the peer's records of this side's frames (acknowledgements, refusals,
//!   closing) come back on it;
//! - the *low* side (the lower of the two endpoints' `(address, secret)`, which both sides
//!   compute alike) also dials the *shared* lane, which carries both sides' other frames (small
//!   writes, tokens, atomics, probes), one direction each. A ping-pong of small writes and
//!   signals then runs on one TCP connection, so each frame carries the TCP acknowledgement of
//!   the one it answers (with one connection per direction every frame is acknowledged by a
//!   segment of its own: 4 segments per round trip instead of 2).
//!
//! Bulk writes both ways at once still use two connections (64 MiB both ways on a 2-core VM:
//! 0.99x two raw connections; one way 0.95-0.99x). A side's frames keep one sequence over its
//! two lanes: when a frame goes on another lane than the one before it, a `Switch` frame on the
//! old lane names its sequence number, and the receiver reads the other lane from that frame on,
//! so it applies frames exactly in sequence order. A write and the signal after it take three
//! sends when the write is large (a switch, the write and a switch back, the signal): a
//! variant that sent the signal with the switch before the write hung intermittently and was
//! reverted. The high side sends its first frame once its receiver thread has taken the accepted
//! shared socket. Each socket's handshake carries the endpoint's 128-bit secret (which only the
//! peer learned, through the bootstrap); a connection without it is dropped. The handshake's
//! version (3) names this layout: peers of versions 1 and 2 (two sockets) are refused.
//!
//! # Frames
//! A [`wire::FrameHeader`] (48 bytes, little-endian) names the operation, a sequence number, the
//! destination region (by id, in the receiver's context) and offset, the payload length and a
//! value. The receiver checks every field against its context's table of registered Ethernet
//! regions before it touches memory; a frame that fails is refused: nothing is written, the
//! receiver tells the sender why, and both sides' connection fails with that error.
//!
//! # Ordering and flush
//! One stream per direction applies operations in order, so a token update lands after the
//! writes before it. The receiver acknowledges applied sequence numbers when the sender asks
//! (a flag set on frames once half the queue bound is unconfirmed, and on the probe `flush`
//! sends) and every `core::ACK_EVERY` (1024) frames at a pause in its input; `flush` waits for the acknowledgement of everything issued.
//!
//! # Closing
//! Dropping a connection acknowledges everything its receiver applied before the sockets close:
//! the receiver is woken (the sockets it reads shut for reading), applies what had already
//! arrived, and sends a closing record naming the last frame it applied
//! ([`wire::Record::Closing`]) on the peer's own lane; only then are the sockets closed. The
//! peer's `flush` succeeds when every operation it covers is acknowledged and the peer closed this way (the end of the peer's frames does not cut this
//! side's acknowledgement stream short), and fails with the closing error otherwise: for
//! operations still in flight at the close, and after a peer that died (no closing record).
//!
//! # Copies
//! None on either side: the sender hands headers and payloads, straight from the source region, to
//! one `sendmsg` per batch of frames, and the receiver reads payloads straight into the destination
//! region (only bytes that arrived in the same read as a header pass through its small buffer).
//! Token updates, atomics and flush probes are sent by the calling thread itself when the sender
//! thread is idle, together with the small writes (up to [`INLINE_LIMIT`]) queued before them:
//! a write followed by a signal is one `sendmsg` and one packet, with no hand-off to another
//! thread. A small write with nothing after it goes out from the sender thread after a 20 us
//! grace (up to one 1 ms tick later while that thread lingers); larger writes go through the
//! sender thread at once, so `write` never blocks on a big transfer.
//!
//! # GPU memory
//! Payloads in GPU memory pass through two pinned host buffers per GPU (`stager`). Large ones
//! (over 1 MiB) go in 8 MiB chunks, the copy of one chunk overlapping the socket's work on the
//! other. Small ones are gathered, because each copy's round trip to the GPU (a few
//! microseconds of driver calls and waiting) cost more than sending the bytes: the sender copies
//! every small GPU payload of a batch to consecutive places of one buffer, waits for the GPU
//! once, and sends the batch in one `sendmsg` (payloads that continue each other in GPU memory
//! share one copy); the receiver queues the copies of the small
//! payloads it reads to the GPU without waiting, and waits for them only before something that
//! must find them landed: an acknowledgement (so a peer's `flush` covers them), a token into host
//! memory or another GPU (a token into the same GPU follows them on the same stream and is waited
//! for), a write into host memory, and the closing record. When its input runs dry the receiver
//! issues the copies of what waits, so a write nothing follows still lands; but 16 or more
//! payloads mostly out of order on the GPU (producers rewriting a ring of slots, each copy one
//! contiguous run) wait until the input has stayed dry for 250 us or the oldest has waited 10 ms,
//! for the holes between them to fill (`stager::Stager::issue_when_dry`).
//!
//! # Small operations (where the time went, and what was done)
//! Profiled on a 2-core VM (`strace -f -c`, `perf record`, `mscclpp-perf -b 8 -e 8`): per
//! write+signal the caller used to wake the sender thread (a futex wake, a context switch and a
//! yielding grace loop that fought the caller for the state lock: about 2 futex calls and 1-4
//! `sched_yield` per operation); once half the queue bound was unconfirmed every frame asked for
//! an acknowledgement until the answer arrived, so the receiver sent one per frame and woke the
//! sender's acknowledgement thread each time; and each reply in a ping-pong woke the receiver
//! thread from a blocking `recv`. Now the idle sender thread lingers for 1 s, looking at the
//! queue every 1 ms on its own, and is woken only from its long sleep; acknowledgements are
//! asked for once per half bound; and a thread waiting on a semaphore applies what arrived itself
//! (`poll_incoming`: non-blocking reads under the receiver's lock, which the receiver thread
//! takes only with `try_lock` and only after waiting for data in `poll` without it; while a
//! waiter polls, the receiver thread keeps away from the socket), so a ping-pong reply needs no
//! hand-off from the receiver thread.

use std::time::Duration;

pub(crate) use self::acceptor::Acceptor;
pub(crate) use self::connection::connect;

mod acceptor;
mod connection;
pub(crate) mod core;
mod recv;
mod send;
pub(crate) mod stager;
pub(crate) mod wire;

const LOG: &str = "mscclpp::conn";
/// Writes up to this size may be sent by the calling thread when the sender thread is idle;
/// larger ones always go through the sender thread, so `write` never blocks on a big transfer.
pub const INLINE_LIMIT: u64 = 1 << 20;
/// How long the sender thread holds a small write for the operation that usually follows it.
const COALESCE_GRACE: Duration = Duration::from_micros(20);
/// While it lingers, the idle sender thread looks for held small writes this often on its own,
/// so that queueing one needs no wake-up.
const TX_TICK: Duration = Duration::from_millis(1);
/// How long the sender thread lingers (ticking) after its last small write before it sleeps
/// until woken.
const TX_LINGER: Duration = Duration::from_secs(1);
/// How long dropping a connection waits for its outstanding operations to land.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
