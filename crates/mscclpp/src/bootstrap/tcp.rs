//! The TCP bootstrap: the I/O shell around the cores in `proto` (wire forms, message framing)
//! and `rendezvous` (the root's state machine).
//!
//! # Protocol
//! * **Handshake.** Every socket of a job opens with a hello: a magic, a version, the
//!   socket's purpose, the job secret from the [`UniqueId`], the sender's rank and the job size.
//!   The acceptor checks all of it before reading anything else; a stranger is logged and dropped
//!   and never counts as a rank. The acceptor answers one byte (`ACK`), so the connector knows it
//!   reached the right job.
//! * **Rendezvous.** Each rank binds a listener for peer traffic, connects to the root (a thread
//!   of rank 0, or a [`RootServer`]) and sends its listening address and host hash. The root
//!   keeps the first ranks' connections open; it answers later ones with a receipt (or a
//!   refusal) and closes. When all ranks have arrived, the root sends the address table on the
//!   held connections and connects to every other rank's listener (a few at a time) to deliver
//!   it; at its deadline it sends the failure naming the missing ranks instead. A rank that has
//!   heard nothing shortly before its own deadline asks the root which ranks are missing, so it
//!   can name them. The root's answers carry the secret back, so a rank knows it talked to its
//!   own root. The root's descriptors are bounded whatever the job size (see [`RootServer`]).
//! * **Messages.** At most one TCP connection per ordered pair of ranks, made on first send.
//!   Frames are a frame header (magic, version, tag, length) and the bytes. A reader thread per
//!   incoming connection files messages by tag, so receives may come in any order across tags and
//!   are FIFO within one.
//! * **Collectives** use the binary tree rooted at rank 0 (parent and two children): up to the
//!   root and back down, 2 log2(n) hops. An `all_gather` of more than 1 MiB in all passes the
//!   pieces around the ring (next and previous rank) instead, and the ring also carries the news
//!   of a failure around a cut tree: at most five peers per rank whatever the job size.
//!   Point-to-point `send`/`recv` connect on demand.
//! * **Failure.** Every wait has a deadline (default 30 s). A peer whose connection closes, or
//!   whose listener refuses us, makes waits on it fail at once with an error naming it. A
//!   collective that finds its peer gone floods an abort notice over the tree and ring links, so
//!   every rank's collective fails naming the failed rank, not its own silent neighbour.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::proto::{
    AbortNotice, FrameReader, GatherBlocks, Hello, KIND_ANSWER, KIND_PEER, KIND_QUERY, KIND_ROOT, RootAnswer,
    RootStatus, frame_header,
};
use super::rendezvous::{Join, Rendezvous, Reply, To};
use super::{
    Bootstrap, RESERVED_TAG_BASE, TAG_ABORT, TAG_ALL_GATHER, TAG_ALL_GATHER_RING, TAG_BARRIER, TAG_BROADCAST,
    TAG_GOODBYE, tree_broadcast, tree_children, tree_parent,
};
use crate::error::{Error, ErrorKind, Result};
use crate::net::{StoppableListener, connect_retry, get_addr, put_addr};
use crate::sync::lock;
use crate::wire::{Reader, WireForm, Writer, length_prefixed, read_length_prefixed};

const LOG: &str = "mscclpp::bootstrap";
const ID_MAGIC: &[u8; 4] = b"MSID";
/// The `UniqueId` form's version (the messages between ranks have their own, in `proto`).
const VERSION: u16 = 1;
const ACK: u8 = 0x5a;
/// The longest a connection may take to present its handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// After a peer's listener refuses us, how long an incoming connection may still show up.
const GONE_GRACE: Duration = Duration::from_millis(500);
/// Default wait limit.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// What a job's ranks share to find each other: the root's address and a 128-bit secret drawn
/// from the OS. Create it on one process, pass it to every rank (MPI broadcast, a file, an
/// environment variable through `Display`/`FromStr`), then call [`TcpBootstrap::initialize`].
///
/// C++ MSCCL++: `UniqueId` (128 bytes, as here).
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    root: SocketAddr,
    secret: [u8; 16],
    /// The root runs in a [`RootServer`], not in rank 0.
    external_root: bool,
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // never print the secret
        f.debug_struct("UniqueId").field("root", &self.root).field("external_root", &self.external_root).finish()
    }
}

impl UniqueId {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const BYTES: usize = 128;

    /// The root's address.
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(ID_MAGIC, VERSION);
        put_addr(&mut w, &self.root);
        w.raw(&self.secret);
        w.u8(self.external_root as u8);
        w.finish()
    }

    /// A fixed-size form, for MPI broadcasts (zero-padded).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        let e = self.encode();
        out[..e.len()].copy_from_slice(&e);
        out
    }

    /// Reads [`to_bytes`](Self::to_bytes) output, or a prefix of it that keeps every field (at
    /// most [`BYTES`](Self::BYTES) bytes; whatever follows the fields must be zero padding).
    ///
    /// # Errors
    /// `InvalidUsage` for anything else (never panics).
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        if b.len() > Self::BYTES {
            return Err(Error::invalid_usage(format!("a UniqueId is at most {} bytes, not {}", Self::BYTES, b.len())));
        }
        let mut r = Reader::new(b, "UniqueId", ID_MAGIC, VERSION)?;
        let id = Self::read_fields(&mut r)?;
        if r.rest().iter().any(|&x| x != 0) {
            return Err(Error::invalid_usage("malformed UniqueId: non-zero bytes after the fields"));
        }
        Ok(id)
    }

    fn read_fields(r: &mut Reader<'_>) -> Result<UniqueId> {
        let root = get_addr(r)?;
        let secret = r.array()?;
        let external_root = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(r.err(format!("bad root flag {x}"))),
        };
        Ok(UniqueId { root, secret, external_root })
    }
}

impl WireForm for UniqueId {
    const WHAT: &'static str = "UniqueId";
    fn to_wire(&self) -> Vec<u8> {
        self.encode()
    }
    /// The unpadded form: nothing may follow it.
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, ID_MAGIC, VERSION)?;
        let id = Self::read_fields(&mut r)?;
        r.finish()?;
        Ok(id)
    }
}

/// The checks of the padded byte form ([`UniqueId::from_bytes`]): never panics, and what decodes
/// is a prefix of its own padded encoding (so the padding was zero and nothing else varies).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_padded(bytes: &[u8]) {
    if let Ok(id) = UniqueId::from_bytes(bytes) {
        assert_eq!(&id.to_bytes()[..bytes.len()], bytes, "UniqueId::from_bytes accepted bytes it does not write");
    }
}

/// The checks of the text form (`FromStr`): never panics, and what parses prints as text that
/// parses to the same id (text is lenient about case and surrounding space, so only the value is
/// canonical).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_text(s: &str) {
    if let Ok(id) = s.parse::<UniqueId>() {
        let again = id.to_string();
        assert_eq!(again.parse::<UniqueId>().ok().as_ref(), Some(&id), "UniqueId text {again:?} does not parse back");
    }
}

impl fmt::Display for UniqueId {
    /// Hex text, for environment variables and command lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.encode() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if !s.len().is_multiple_of(2) || !s.is_ascii() {
            return Err(Error::invalid_usage("a UniqueId in text is an even number of hex digits"));
        }
        let bytes: Result<Vec<u8>> = (0..s.len())
            .step_by(2)
            .map(|i| {
                u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| Error::invalid_usage("bad hex digit in UniqueId"))
            })
            .collect();
        UniqueId::from_bytes(&bytes?)
    }
}

/// Listeners bound by `create_unique_id`, waiting for rank 0 of the same process to take them
/// (MSCCL++ closes the socket and binds again, leaving a window for another process).
static PENDING_ROOTS: Mutex<Vec<(SocketAddr, TcpListener)>> = Mutex::new(Vec::new());

/// A listening socket with a backlog of `backlog` (the kernel caps it at `somaxconn`), so a
/// burst of connections is queued rather than dropped or reset.
fn listen_on(addr: SocketAddr, backlog: usize) -> Result<TcpListener> {
    let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)
        .map_err(|e| Error::io(format!("creating a bootstrap socket for {addr}"), e))?;
    sock.bind(&addr.into()).map_err(|e| Error::io(format!("binding a bootstrap listener on {addr}"), e))?;
    sock.listen(backlog.clamp(128, i32::MAX as usize) as i32)
        .map_err(|e| Error::io(format!("listening on {addr}"), e))?;
    Ok(sock.into())
}

/// The root's backlog: it is bound before the job size is known, so room for a large job.
const ROOT_BACKLOG: usize = 65535;

fn bind_on_default_interface() -> Result<TcpListener> {
    let ip = crate::net::find_interfaces()?[0].addr;
    listen_on(SocketAddr::new(ip, 0), ROOT_BACKLOG).map_err(|e| e.during("binding the bootstrap root"))
}

fn random_secret() -> Result<[u8; 16]> {
    let mut s = [0u8; 16];
    crate::identity::os_random(&mut s)?;
    Ok(s)
}

/// Reads a length-prefixed [`Hello`] of at most 256 bytes and checks it carries `secret`.
fn read_hello(s: &mut TcpStream, secret: &[u8; 16]) -> Result<Hello> {
    let body = read_length_prefixed(s, 256, "the handshake")?;
    let h = Hello::from_wire(&body)?;
    if &h.secret != secret {
        return Err(Error::remote("wrong job secret"));
    }
    Ok(h)
}

// ---------------------------------------------------------------------------------------------
// Root

/// The rendezvous point of a job, run on its own thread. Rank 0 starts one by itself; a
/// launcher that is not a rank (like `mscclpp-perf --ranks N`) starts one with
/// [`RootServer::start`] and hands the id to its ranks.
///
/// The root keeps the connections of the first 32 ranks to join; it answers every later join
/// with a receipt at once and closes that connection. Once all ranks have joined (or at its
/// deadline) it sends the table (or the failure naming the missing ranks) on the held
/// connections, and connects to the other ranks' listeners to deliver it, 8 at a time. It
/// serves at most 32 new connections at once (the rest wait in the listen backlog, which costs
/// no descriptor), so its process needs under a hundred file descriptors whatever the job size.
pub struct RootServer {
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl RootServer {
    /// Starts a root for `size` ranks that waits at most `timeout` for them, and returns its id.
    pub fn start(size: usize, timeout: Duration) -> Result<(RootServer, UniqueId)> {
        let listener = bind_on_default_interface()?;
        let secret = random_secret()?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the root address", e))?;
        let id = UniqueId { root: addr, secret, external_root: true };
        let server = RootServer::spawn(listener, size, secret, timeout)?;
        Ok((server, id))
    }

    fn spawn(listener: TcpListener, size: usize, secret: [u8; 16], timeout: Duration) -> Result<RootServer> {
        let addr = listener.local_addr().map_err(|e| Error::io("reading the root address", e))?;
        let deadline = Instant::now() + timeout;
        let thread = std::thread::Builder::new()
            .name("mscclpp-bs-root".into())
            .spawn(move || run_root(listener, size, secret, deadline))
            .map_err(|e| Error::io("starting the bootstrap root thread", e))?;
        Ok(RootServer { addr, thread: Some(thread) })
    }

    /// The address ranks connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until the root has answered every rank (or given up).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RootServer {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connections the root serves at once (joins and queries); more wait in the listen backlog.
pub(crate) const ROOT_HANDSHAKES: usize = 32;
/// Join connections the root keeps open to answer on them (the first ranks to arrive).
pub(crate) const ROOT_HELD: usize = 32;
/// Connections the root opens at once to deliver final answers.
pub(crate) const ROOT_DELIVERIES: usize = 8;

/// What a connection to the root asks.
enum RootRequest {
    Join(Join),
    Query,
}

/// A counting semaphore for the root's handshake threads.
struct Slots {
    free: Mutex<usize>,
    cond: Condvar,
}

/// One taken slot, given back when dropped.
struct Slot(Arc<Slots>);

impl Slots {
    /// Takes a slot, waiting while none is free; `None` once `done` is set (the root ended: the
    /// slots still held may never come back, so this must not wait for them).
    fn take(self: &Arc<Self>, done: &AtomicBool) -> Option<Slot> {
        let mut free = lock(&self.free);
        while *free == 0 {
            if done.load(Ordering::Acquire) {
                return None;
            }
            free = self
                .cond
                .wait_timeout(free, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        *free -= 1;
        Some(Slot(self.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        *lock(&self.0.free) += 1;
        self.0.cond.notify_one();
    }
}

/// A connection to the root, with the handshake slot it holds until the root loop is done with it.
type RootConn = (RootRequest, TcpStream, Slot);

/// One handshake at the root: reads the hello and hands the request, with its connection, to
/// the root loop.
fn root_handshake(mut s: TcpStream, secret: [u8; 16], slot: Slot, tx: mpsc::Sender<RootConn>) {
    let peer = s.peer_addr().ok();
    let _ = s.set_read_timeout(Some(HANDSHAKE_LIMIT));
    let req = match read_hello(&mut s, &secret) {
        Ok(Hello { kind: KIND_ROOT, rank, size, listen: Some((listen, host_hash)), .. }) => {
            RootRequest::Join(Join { rank, size, listen, host_hash })
        }
        Ok(Hello { kind: KIND_QUERY, .. }) => RootRequest::Query,
        Ok(h) => {
            warn!(target: LOG, "root: dropping connection from {peer:?}: handshake of kind {} is not a rank joining", h.kind);
            return;
        }
        Err(e) => {
            warn!(target: LOG, "root: dropping connection from {peer:?} that failed the handshake: {e}");
            return;
        }
    };
    let _ = s.set_write_timeout(Some(HANDSHAKE_LIMIT));
    let _ = tx.send((req, s, slot));
}

/// Writes one answer on a connection to the root (which then closes, when dropped).
fn write_answer(s: &mut TcpStream, bytes: &[u8]) {
    if let Err(e) = s.write_all(bytes) {
        debug!(target: LOG, "root: answering {:?}: {e}", s.peer_addr().ok());
    }
}

/// Connects to rank `rank`'s listener and sends it its final answer (`body`, length-prefixed).
fn deliver_answer(rank: u32, addr: SocketAddr, secret: [u8; 16], size: u32, body: &[u8]) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, HANDSHAKE_LIMIT)
        .map_err(|e| Error::io(format!("connecting to rank {rank} at {addr}"), e))?;
    let _ = s.set_nodelay(true);
    let _ = s.set_write_timeout(Some(HANDSHAKE_LIMIT));
    let hello = Hello { kind: KIND_ANSWER, secret, rank, size, listen: None };
    s.write_all(&length_prefixed(&hello.to_wire()))
        .and_then(|_| s.write_all(body))
        .map_err(|e| Error::io(format!("sending rank {rank} its answer"), e))?;
    // The rank writes nothing on this connection: closing now is a clean end after the data.
    Ok(())
}

/// Delivers one final answer to `targets` on [`ROOT_DELIVERIES`] threads (or here, for a job
/// that small: a connect and a write into the socket buffer need no thread of the rank to run).
fn start_deliveries(targets: Vec<(u32, SocketAddr)>, answer: &RootAnswer, size: u32) -> Vec<JoinHandle<()>> {
    let body = Arc::new(length_prefixed(&answer.to_wire()));
    let secret = answer.secret;
    if targets.len() <= ROOT_DELIVERIES {
        for (rank, addr) in targets {
            if let Err(e) = deliver_answer(rank, addr, secret, size, &body) {
                warn!(target: LOG, "root: rank {rank} did not take its answer (it has probably exited): {e}");
            }
        }
        return Vec::new();
    }
    let threads = ROOT_DELIVERIES.min(targets.len());
    let queue = Arc::new(Mutex::new(VecDeque::from(targets)));
    (0..threads)
        .filter_map(|_| {
            let (queue, body) = (queue.clone(), body.clone());
            std::thread::Builder::new()
                .name("mscclpp-bs-root-tx".into())
                .stack_size(128 * 1024)
                .spawn(move || {
                    loop {
                        let Some((rank, addr)) = lock(&queue).pop_front() else { break };
                        if let Err(e) = deliver_answer(rank, addr, secret, size, &body) {
                            warn!(target: LOG, "root: rank {rank} did not take its answer (it has probably exited): {e}");
                        }
                    }
                })
                .map_err(|e| warn!(target: LOG, "root: cannot start a delivery thread: {e}"))
                .ok()
        })
        .collect()
}

/// The root's I/O shell around [`Rendezvous`]: an accept thread, a handshake thread per
/// connection (at most [`ROOT_HANDSHAKES`] at once; a silent stranger cannot hold up the rest),
/// delivery threads, and this loop, which feeds requests and the clock to the core and routes
/// its answers.
fn run_root(listener: TcpListener, size: usize, secret: [u8; 16], deadline: Instant) {
    let addr = listener.local_addr().ok();
    let (tx, rx) = mpsc::channel::<RootConn>();
    let done = Arc::new(AtomicBool::new(false));
    let accept_done = done.clone();
    let slots = Arc::new(Slots { free: Mutex::new(ROOT_HANDSHAKES), cond: Condvar::new() });
    let acceptor = std::thread::Builder::new().name("mscclpp-bs-root-accept".into()).spawn(move || {
        let listener = StoppableListener::new(listener);
        while let Some(conn) = listener.next(|| accept_done.load(Ordering::Acquire)) {
            let s = match conn {
                Ok(s) => s,
                Err(e) => {
                    // out of descriptors or a transient error: do not spin
                    debug!(target: LOG, "root: accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            // The wake-up connection at the end (or one that came with it).
            if accept_done.load(Ordering::Acquire) {
                break;
            }
            let Some(slot) = slots.take(&accept_done) else { break };
            let tx = tx.clone();
            let _ = std::thread::Builder::new()
                .name("mscclpp-bs-root-hs".into())
                .stack_size(128 * 1024)
                .spawn(move || root_handshake(s, secret, slot, tx));
        }
    });
    let mut rv = Rendezvous::new(secret, size, deadline);
    let mut deliveries: Vec<JoinHandle<()>> = Vec::new();
    // The first joins' connections stay open and get the final answer on them (one hop less
    // for small jobs); later joins get a receipt and their answer on their listener.
    let mut held: HashMap<u32, TcpStream> = HashMap::new();
    // Answers on the asking connection go back on it; final answers go on a held connection or
    // to the delivery threads (returned).
    let mut route = |replies: Vec<Reply<()>>, mut conn: Option<(u32, TcpStream)>| -> Vec<JoinHandle<()>> {
        let mut targets = Vec::new();
        let mut final_answer = None;
        let mut final_bytes = None;
        for r in replies {
            if let RootStatus::Failed { message, .. } = &r.answer.status {
                warn!(target: LOG, "root: {message}");
            }
            match r.to {
                To::Conn(()) => {
                    let Some((rank, mut s)) = conn.take() else { continue };
                    if r.answer.status == RootStatus::Joined && held.len() < ROOT_HELD {
                        held.insert(rank, s);
                    } else {
                        write_answer(&mut s, &length_prefixed(&r.answer.to_wire()));
                    }
                }
                To::Rank(rank, a) => match held.remove(&rank) {
                    Some(mut s) => {
                        let b = final_bytes.get_or_insert_with(|| length_prefixed(&r.answer.to_wire()));
                        write_answer(&mut s, b);
                    }
                    None => {
                        targets.push((rank, a));
                        final_answer = Some(r.answer);
                    }
                },
            }
        }
        match final_answer {
            Some(answer) => start_deliveries(targets, &answer, size as u32),
            None => Vec::new(),
        }
    };
    loop {
        let now = Instant::now();
        deliveries.extend(route(rv.on_time(now), None));
        if rv.is_finished() && deliveries.iter().all(|h| h.is_finished()) {
            break;
        }
        // After the end, queries are still answered (with the outcome) while deliveries run.
        let wait = if rv.is_finished() {
            Duration::from_millis(20)
        } else {
            rv.next_wakeup().saturating_duration_since(now).max(Duration::from_millis(1))
        };
        match rx.recv_timeout(wait) {
            Ok((RootRequest::Join(j), s, _slot)) => {
                debug!(target: LOG, "root: rank {} arrived from {}", j.rank, j.listen);
                deliveries.extend(route(rv.on_join((), j), Some((j.rank, s))));
            }
            Ok((RootRequest::Query, s, _slot)) => deliveries.extend(route(vec![rv.on_query(())], Some((u32::MAX, s)))),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(wait),
        }
    }
    for h in deliveries {
        let _ = h.join();
    }
    if rv.missing().is_empty() {
        info!(target: LOG, "root: all {size} ranks joined and were answered");
    }
    // Requests that came too late are dropped with their slots (the acceptor may be waiting for one).
    drop(rx);
    done.store(true, Ordering::Release);
    // wake the acceptor so it sees `done`
    if let Some(a) = addr {
        let _ = TcpStream::connect_timeout(&a, Duration::from_secs(1));
    }
    if let Ok(t) = acceptor {
        let _ = t.join();
    }
}

/// The longest root answer a rank accepts: the table of a `size`-rank job (27 bytes an entry)
/// with room to spare.
fn root_answer_limit(size: usize) -> usize {
    size.saturating_mul(64).saturating_add(64 * 1024)
}

/// Reads one root answer from `s` until `deadline`, checking that it carries the job secret.
fn read_root_answer(s: &mut TcpStream, deadline: Instant, secret: [u8; 16], size: usize) -> Result<RootStatus> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let _ = s.set_read_timeout(Some(left));
    let frame = read_length_prefixed(s, root_answer_limit(size), "the bootstrap root's answer")?;
    let answer = RootAnswer::from_wire(&frame)?;
    if answer.secret != secret {
        return Err(Error::remote("the root's answer does not carry the job secret"));
    }
    Ok(answer.status)
}

/// Asks the root which ranks are still missing (or for the outcome, once there is one).
fn query_root(root: SocketAddr, secret: [u8; 16], rank: usize, size: usize, deadline: Instant) -> Result<RootStatus> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&root, left).map_err(|e| Error::io("connecting to the root", e))?;
    let hello = Hello { kind: KIND_QUERY, secret, rank: rank as u32, size: size as u32, listen: None };
    s.write_all(&length_prefixed(&hello.to_wire())).map_err(|e| Error::io("asking the root", e))?;
    read_root_answer(&mut s, deadline, secret, size)
}

/// Whether the I/O cause of `e` is a read timeout.
fn is_timeout(e: &Error) -> bool {
    use std::error::Error as _;
    e.source()
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|e| matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

fn root_gave_up(timeout: bool, message: &str) -> Error {
    let kind = if timeout { ErrorKind::Timeout } else { ErrorKind::Remote };
    Error::new(kind, format!("the root gave up: {message}"))
}

// ---------------------------------------------------------------------------------------------
// Ranks

#[derive(Debug)]
enum Link {
    /// No connection from this peer yet.
    None,
    /// A reader thread is filing its messages.
    Open,
    /// The peer's connection ended; the reason.
    Closed(String),
}

struct Inbox {
    queues: HashMap<u64, VecDeque<Vec<u8>>>,
    incoming: Link,
    /// When our connection to the peer was found closed or refused.
    out_gone: Option<Instant>,
}

struct Peer {
    out: Mutex<Option<TcpStream>>,
    inbox: Mutex<Inbox>,
    cond: Condvar,
}

struct Shared {
    rank: usize,
    size: usize,
    secret: [u8; 16],
    timeout_ms: AtomicU64,
    listen_addr: SocketAddr,
    /// Every rank's listening address and host hash, once the root's table arrived.
    table: OnceLock<Vec<(SocketAddr, u64)>>,
    /// The root's final answer, delivered to our listener.
    root_answer: Mutex<Option<RootStatus>>,
    root_cond: Condvar,
    peers: Vec<Peer>,
    closing: AtomicBool,
    /// The first failure of another rank this rank heard of; collectives fail with it.
    abort: Mutex<Option<AbortNotice>>,
    /// The thread telling the neighbours of `abort` (joined before closing, so the news leaves
    /// before our goodbye).
    flood: Mutex<Option<JoinHandle<()>>>,
    /// Incoming streams (to shut down on close) and their reader threads.
    readers: Mutex<Vec<(Option<TcpStream>, JoinHandle<()>)>>,
}

/// The peers a rank tells of a failure: its parent and children in the binary tree rooted at
/// rank 0 (every collective's peers) and its ring neighbours, so the news crosses the tree cut
/// by the failed rank. At most five ranks.
pub(crate) fn neighbours(rank: usize, size: usize) -> Vec<usize> {
    let mut v = Vec::with_capacity(6);
    if size > 1 {
        v.push((rank + 1) % size);
        v.push((rank + size - 1) % size);
    }
    if let Some(p) = tree_parent(rank) {
        v.push(p);
    }
    v.extend(tree_children(rank, size));
    v.sort_unstable();
    v.dedup();
    v.retain(|p| *p != rank);
    v
}

/// Settings for [`TcpBootstrap`]; start with [`TcpBootstrap::config`].
#[derive(Clone, Debug)]
pub struct TcpBootstrapConfig {
    rank: usize,
    size: usize,
    timeout: Duration,
}

impl TcpBootstrapConfig {
    /// The wait limit for initialization and for every later call (default 30 s).
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Joins the job named by `id`. Rank 0 hosts the root unless the id came from a
    /// [`RootServer`]; rank 0 must then run in the process that created the id.
    pub fn initialize(self, id: &UniqueId) -> Result<TcpBootstrap> {
        let mut root = None;
        if self.rank == 0 && !id.external_root {
            let listener = {
                let mut pending = lock(&PENDING_ROOTS);
                pending.iter().position(|(a, _)| *a == id.root).map(|i| pending.swap_remove(i).1)
            };
            let listener = match listener {
                Some(l) => l,
                None => listen_on(id.root, ROOT_BACKLOG).map_err(|e| {
                    e.during(format!(
                        "rank 0 binding the bootstrap root at {} (rank 0 must run in the process that called \
                         create_unique_id, or use RootServer)",
                        id.root
                    ))
                })?,
            };
            root = Some(RootServer::spawn(listener, self.size, id.secret, self.timeout)?);
        }
        let res = TcpBootstrap::join(&self, id.root, id.secret);
        if res.is_ok() {
            crate::identity::set_process_rank(self.rank);
        }
        if let Some(r) = root {
            r.join();
        }
        res
    }

    /// Joins the job whose root listens at `"[iface:]host:port"` (see [`crate::net::parse_addr_spec`]:
    /// host names and `[IPv6]` literals are accepted); rank 0 binds that address.
    ///
    /// This form has no per-job secret (all jobs on the address share one fixed key), as in
    /// MSCCL++; prefer a [`UniqueId`] where other users share the network.
    pub fn initialize_with_addr(self, spec: &str) -> Result<TcpBootstrap> {
        let (iface, addr) = crate::net::parse_addr_spec(spec)?;
        let secret = {
            let h = crate::identity::fnv1a64(&[b"mscclpp ip:port bootstrap", addr.to_string().as_bytes()]);
            let mut s = [0u8; 16];
            s[..8].copy_from_slice(&h.to_le_bytes());
            s[8..].copy_from_slice(&(!h).to_le_bytes());
            s
        };
        let mut root = None;
        if self.rank == 0 {
            let bind_ip = match &iface {
                Some(i) => crate::net::resolve_interface(i)?,
                None => addr.ip(),
            };
            let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)
                .map_err(|e| Error::io("creating the bootstrap root socket", e))?;
            let _ = sock.set_reuse_address(true);
            sock.bind(&SocketAddr::new(bind_ip, addr.port()).into())
                .map_err(|e| Error::io(format!("rank 0 binding the bootstrap root at {bind_ip}:{}", addr.port()), e))?;
            sock.listen(ROOT_BACKLOG as i32).map_err(|e| Error::io("listening for the bootstrap root", e))?;
            root = Some(RootServer::spawn(sock.into(), self.size, secret, self.timeout)?);
        }
        let res = TcpBootstrap::join(&self, addr, secret);
        if res.is_ok() {
            crate::identity::set_process_rank(self.rank);
        }
        if let Some(r) = root {
            r.join();
        }
        res
    }
}

/// The built-in [`Bootstrap`] over TCP.
///
/// ```no_run
/// use mscclpp::{Bootstrap, TcpBootstrap};
/// # fn main() -> mscclpp::Result<()> {
/// // rank 0:
/// let id = TcpBootstrap::create_unique_id()?;
/// // ... send `id.to_string()` to the other ranks, then on every rank:
/// let (rank, size) = (0, 2);
/// let bs = TcpBootstrap::initialize(rank, size, &id)?;
/// let all = bs.all_gather(&[rank as u8])?;
/// assert_eq!(all.len(), size);
/// # Ok(()) }
/// ```
///
/// C++ MSCCL++: `TcpBootstrap`.
pub struct TcpBootstrap {
    shared: Arc<Shared>,
    listener_thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpBootstrap")
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("listen", &self.shared.listen_addr)
            .finish()
    }
}

impl TcpBootstrap {
    /// A fresh [`UniqueId`] whose root will be rank 0 of this process. The root's listening
    /// socket is bound now and kept until rank 0 initializes, so no other process can take the
    /// port in between.
    pub fn create_unique_id() -> Result<UniqueId> {
        let listener = bind_on_default_interface()?;
        let root = listener.local_addr().map_err(|e| Error::io("reading the root address", e))?;
        lock(&PENDING_ROOTS).push((root, listener));
        Ok(UniqueId { root, secret: random_secret()?, external_root: false })
    }

    /// Settings for rank `rank` of `size`, to change the timeout before initializing.
    pub fn config(rank: usize, size: usize) -> TcpBootstrapConfig {
        TcpBootstrapConfig { rank, size, timeout: DEFAULT_TIMEOUT }
    }

    /// Joins the job `id` as rank `rank` of `size`, with the default 30 s timeout.
    pub fn initialize(rank: usize, size: usize, id: &UniqueId) -> Result<TcpBootstrap> {
        Self::config(rank, size).initialize(id)
    }

    /// Joins the job whose root listens at `"[iface:]host:port"`, with the default timeout.
    pub fn initialize_with_addr(rank: usize, size: usize, spec: &str) -> Result<TcpBootstrap> {
        Self::config(rank, size).initialize_with_addr(spec)
    }

    /// The current wait limit.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout()
    }

    /// Changes the wait limit of later calls.
    pub fn set_timeout(&self, t: Duration) {
        self.shared.timeout_ms.store(t.as_millis().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// Where this rank listens for peers.
    pub fn listen_addr(&self) -> SocketAddr {
        self.shared.listen_addr
    }

    fn join(cfg: &TcpBootstrapConfig, root: SocketAddr, secret: [u8; 16]) -> Result<TcpBootstrap> {
        let op = format!("bootstrap initialize (rank {} of {})", cfg.rank, cfg.size);
        if cfg.size == 0 || cfg.rank >= cfg.size || cfg.size > u32::MAX as usize {
            return Err(Error::invalid_usage(format!("rank {} is not in 0..{}", cfg.rank, cfg.size)).during(op));
        }
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let mut rs = connect_retry(root, deadline, "the bootstrap root").map_err(|e| {
            if e.kind() == ErrorKind::Timeout {
                Error::new(
                    ErrorKind::Timeout,
                    format!("{} within {:?}; is rank 0 (the root) running?", e.message(), cfg.timeout),
                )
            } else {
                e
            }
            .during(op.clone())
        })?;
        // Listen for peers on the address that reaches the root. Collectives bring at most five
        // peers at once (see `neighbours`); point-to-point traffic may bring any number. The
        // listener runs before we join: the root delivers the table to it, and peers that got
        // the table first may already send.
        let local_ip: IpAddr = rs.local_addr().map_err(|e| Error::io("reading the local address", e))?.ip();
        let listener = listen_on(SocketAddr::new(local_ip, 0), cfg.size)?;
        let listen_addr = listener.local_addr().map_err(|e| Error::io("reading the listening address", e))?;
        let shared = Arc::new(Shared {
            rank: cfg.rank,
            size: cfg.size,
            secret,
            timeout_ms: AtomicU64::new(cfg.timeout.as_millis().min(u64::MAX as u128) as u64),
            listen_addr,
            table: OnceLock::new(),
            root_answer: Mutex::new(None),
            root_cond: Condvar::new(),
            peers: (0..cfg.size)
                .map(|_| Peer {
                    out: Mutex::new(None),
                    inbox: Mutex::new(Inbox { queues: HashMap::new(), incoming: Link::None, out_gone: None }),
                    cond: Condvar::new(),
                })
                .collect(),
            closing: AtomicBool::new(false),
            abort: Mutex::new(None),
            flood: Mutex::new(None),
            readers: Mutex::new(Vec::new()),
        });
        let sh = shared.clone();
        let listener_thread = std::thread::Builder::new()
            .name(format!("mscclpp-bs-listen-{}", cfg.rank))
            .spawn(move || accept_loop(sh, listener))
            .map_err(|e| Error::io("starting the bootstrap listener thread", e))?;
        // From here on, dropping `bs` on an error closes the listener and its threads.
        let bs = TcpBootstrap { shared, listener_thread: Some(listener_thread) };
        let hello = Hello {
            kind: KIND_ROOT,
            secret,
            rank: cfg.rank as u32,
            size: cfg.size as u32,
            listen: Some((listen_addr, crate::identity::host_hash())),
        };
        rs.write_all(&length_prefixed(&hello.to_wire()))
            .map_err(|e| Error::io("sending the hello to the root", e).during(op.clone()))?;
        // The root answers a refusal at once; a receipt (our answer will come to our listener);
        // or, for the first ranks to arrive, the final answer on this connection. Shortly before
        // our deadline, a rank that has heard nothing asks the root which ranks are missing, so
        // it can name them.
        let margin = (cfg.timeout / 10).min(Duration::from_secs(2));
        let first = read_root_answer(&mut rs, deadline - margin, secret, cfg.size);
        // The connection stays ours until the root says our answer goes to our listener.
        let mut held = Some(rs);
        let heard = match first {
            Ok(RootStatus::Joined) => {
                held = None;
                bs.shared.wait_root_answer(deadline - margin)
            }
            Ok(s @ (RootStatus::Done(_) | RootStatus::Failed { .. })) => Some(s),
            Ok(s) => return Err(Error::remote(format!("the root answered the join with {s:?}")).during(op)),
            Err(e) if is_timeout(&e) => None,
            Err(e) => return Err(e.during(op)),
        };
        let status = match heard {
            Some(s) => s,
            None => match query_root(root, secret, cfg.rank, cfg.size, deadline) {
                Ok(RootStatus::Progress { missing }) => {
                    let list: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("not all ranks joined within {:?}; missing ranks [{}]", cfg.timeout, list.join(", ")),
                    )
                    .during(op));
                }
                // the delivery to us was lost, or it crossed the query
                Ok(s) => s,
                // The root may have ended just as we asked (its deadline is close to ours): its
                // final answer then went to the connection we still hold, or to our listener.
                Err(e) => match held
                    .as_mut()
                    .and_then(|rs| read_root_answer(rs, deadline, secret, cfg.size).ok())
                    .or_else(|| bs.shared.wait_root_answer(deadline))
                {
                    Some(s) => s,
                    None => {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "no answer from the bootstrap root within {:?}, and it did not say which ranks are \
                                 missing ({e})",
                                cfg.timeout
                            ),
                        )
                        .during(op));
                    }
                },
            },
        };
        let table = match status {
            RootStatus::Done(t) => t,
            RootStatus::Failed { timeout, message } => return Err(root_gave_up(timeout, &message).during(op)),
            s => return Err(Error::remote(format!("the root's final answer is {s:?}")).during(op)),
        };
        if table.entries.len() != cfg.size {
            return Err(Error::remote(format!("root table has {} ranks, expected {}", table.entries.len(), cfg.size))
                .during(op));
        }
        let _ = bs.shared.table.set(table.entries);
        info!(target: LOG, "rank {} of {} joined in {:?}", cfg.rank, cfg.size, start.elapsed());
        Ok(bs)
    }

    fn check_peer(&self, peer: usize, op: &str) -> Result<()> {
        if peer >= self.shared.size {
            return Err(Error::invalid_usage(format!("peer rank {peer} is not in 0..{}", self.shared.size))
                .during(op.to_string()));
        }
        Ok(())
    }

    fn check_tag(tag: u64) -> Result<()> {
        if tag >= RESERVED_TAG_BASE {
            return Err(Error::invalid_usage(format!("tag {tag:#x} is reserved (user tags are below 2^63)")));
        }
        Ok(())
    }

    /// One send of a collective: a failure to reach `peer` is that rank's failure, told to the
    /// neighbours.
    fn coll_send(&self, peer: usize, tag: u64, data: &[u8], what: &str) -> Result<()> {
        let sh = &self.shared;
        if let Some(e) = sh.abort_error(what) {
            return Err(e);
        }
        sh.send_any(peer, tag, data).map_err(|e| {
            // The peer may have closed on hearing of another rank's failure, and its notice
            // may still be on the way here: give it a moment before blaming the peer.
            let grace = Instant::now() + GONE_GRACE;
            while Instant::now() < grace && lock(&sh.abort).is_none() {
                std::thread::sleep(Duration::from_millis(10));
            }
            let notice = AbortNotice { failed: peer as u32, reporter: sh.rank as u32, reason: e.to_string() };
            raise_abort(sh, notice);
            sh.abort_error(what).unwrap_or_else(|| e.during(what.to_string()).with_peer(peer))
        })
    }

    /// One receive of a collective, waiting until `deadline`.
    fn coll_recv(&self, peer: usize, tag: u64, deadline: Instant, what: &str) -> Result<Vec<u8>> {
        let mut v = self.shared.recv_many(&[peer], tag, deadline, what, true)?;
        v.pop().ok_or_else(|| Error::internal("recv_many returned nothing"))
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout()
    }

    /// The ring: n-1 steps, each passing one rank's piece to the next rank.
    fn ring_all_gather(&self, data: &[u8], deadline: Instant, what: &str) -> Result<Vec<Vec<u8>>> {
        let (me, n) = (self.shared.rank, self.shared.size);
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let mut out = vec![Vec::new(); n];
        out[me] = data.to_vec();
        for step in 0..n - 1 {
            self.coll_send(next, TAG_ALL_GATHER_RING, &out[(me + n - step) % n], what)?;
            out[(me + 2 * n - step - 1) % n] = self.coll_recv(prev, TAG_ALL_GATHER_RING, deadline, what)?;
        }
        Ok(out)
    }
}

/// The most bytes of `all_gather` pieces one subtree sends up the tree; larger gathers take the
/// ring.
pub(crate) const TREE_GATHER_LIMIT: usize = 1 << 20;

impl Shared {
    /// Waits until `until` for the root's final answer.
    fn wait_root_answer(&self, until: Instant) -> Option<RootStatus> {
        let mut a = lock(&self.root_answer);
        loop {
            if let Some(s) = a.take() {
                return Some(s);
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            a = self.root_cond.wait_timeout(a, until - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// The error every collective returns once another rank's failure is known.
    fn abort_error(&self, what: &str) -> Option<Error> {
        lock(&self.abort).as_ref().map(|a| {
            Error::remote(format!("rank {} failed (seen by rank {}: {})", a.failed, a.reporter, a.reason))
                .during(what.to_string())
                .with_peer(a.failed as usize)
        })
    }

    fn send_any(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let timeout = self.timeout();
        self.send_until(peer, tag, data, Instant::now() + timeout, timeout)
    }

    fn send_until(&self, peer: usize, tag: u64, data: &[u8], deadline: Instant, write_limit: Duration) -> Result<()> {
        if peer == self.rank {
            let p = &self.peers[peer];
            lock(&p.inbox).queues.entry(tag).or_default().push_back(data.to_vec());
            p.cond.notify_all();
            return Ok(());
        }
        let p = &self.peers[peer];
        let mut out = lock(&p.out);
        if out.is_none() {
            *out = Some(self.connect_peer(peer, deadline)?);
        }
        let Some(s) = out.as_mut() else { return Err(Error::internal("no stream after connecting")) };
        let _ = s.set_write_timeout(Some(write_limit.max(Duration::from_millis(1))));
        let head = frame_header(tag, data.len());
        let res = if data.len() <= 64 * 1024 {
            let mut b = Vec::with_capacity(head.len() + data.len());
            b.extend_from_slice(&head);
            b.extend_from_slice(data);
            s.write_all(&b)
        } else {
            s.write_all(&head).and_then(|_| s.write_all(data))
        };
        if let Err(e) = res {
            *out = None;
            lock(&p.inbox).out_gone.get_or_insert_with(Instant::now);
            p.cond.notify_all();
            let kind = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                ErrorKind::Timeout
            } else {
                ErrorKind::Remote
            };
            return Err(Error::new(kind, format!("sending {} bytes failed", data.len())).with_source(e));
        }
        Ok(())
    }

    fn connect_peer(&self, peer: usize, deadline: Instant) -> Result<TcpStream> {
        let p = &self.peers[peer];
        let addr = self
            .table
            .get()
            .and_then(|t| t.get(peer))
            .map(|(a, _)| *a)
            .ok_or_else(|| Error::internal(format!("no address for rank {peer} before the root's table")))?;
        let mut s = match TcpStream::connect_timeout(
            &addr,
            (deadline.saturating_duration_since(Instant::now())).max(Duration::from_millis(1)),
        ) {
            Ok(s) => s,
            Err(e) => {
                lock(&p.inbox).out_gone.get_or_insert_with(Instant::now);
                p.cond.notify_all();
                return Err(
                    Error::remote(format!("cannot connect to {addr} (the peer has probably exited)")).with_source(e)
                );
            }
        };
        let _ = s.set_nodelay(true);
        let hello = Hello {
            kind: KIND_PEER,
            secret: self.secret,
            rank: self.rank as u32,
            size: self.size as u32,
            listen: None,
        };
        let _ =
            s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))));
        s.write_all(&length_prefixed(&hello.to_wire())).map_err(|e| Error::io("sending the handshake", e))?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).map_err(|e| Error::io("waiting for the handshake answer", e))?;
        if ack[0] != ACK {
            return Err(Error::remote(format!("peer at {addr} answered the handshake with {:#x}", ack[0])));
        }
        let _ = s.set_read_timeout(None);
        Ok(s)
    }

    /// Checks whether our connection to `peer` still stands, connecting if there is none.
    fn probe(&self, peer: usize) {
        let p = &self.peers[peer];
        let mut out = lock(&p.out);
        if out.is_none() {
            match self.connect_peer(peer, Instant::now() + Duration::from_secs(2)) {
                Ok(s) => *out = Some(s),
                Err(e) => debug!(target: LOG, "probe of rank {peer}: {e}"),
            }
            return;
        }
        if let Some(s) = out.as_ref() {
            let mut b = [0u8; 1];
            let _ = s.set_nonblocking(true);
            let gone = match s.peek(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            };
            let _ = s.set_nonblocking(false);
            if gone {
                *out = None;
                lock(&p.inbox).out_gone.get_or_insert_with(Instant::now);
                p.cond.notify_all();
            }
        }
    }

    /// Waits for one message from each of `peers` under `tag`; on failure names every peer
    /// that did not deliver. In a `collective`, a failed peer is told to the neighbours, and a
    /// failure they report ends the wait.
    fn recv_many(
        self: &Arc<Self>,
        peers: &[usize],
        tag: u64,
        deadline: Instant,
        what: &str,
        collective: bool,
    ) -> Result<Vec<Vec<u8>>> {
        let mut got: Vec<Option<Vec<u8>>> = vec![None; peers.len()];
        let mut last_probe = Instant::now();
        loop {
            if let Some(e) = self.abort_error(what).filter(|_| collective) {
                return Err(e);
            }
            let mut pending = Vec::new();
            for (i, &p) in peers.iter().enumerate() {
                if got[i].is_some() {
                    continue;
                }
                let peer = &self.peers[p];
                let mut inbox = lock(&peer.inbox);
                if let Some(m) = inbox.queues.get_mut(&tag).and_then(|q| q.pop_front()) {
                    got[i] = Some(m);
                    continue;
                }
                if let Some(why) = peer_failure(&inbox) {
                    drop(inbox);
                    if collective {
                        raise_abort(
                            self,
                            AbortNotice { failed: p as u32, reporter: self.rank as u32, reason: why.clone() },
                        );
                        if let Some(e) = self.abort_error(what) {
                            return Err(e);
                        }
                    }
                    return Err(Error::remote(why).during(what.to_string()).with_peer(p));
                }
                if let Some(a) = lock(&self.abort).as_ref().filter(|a| a.failed as usize == p) {
                    return Err(Error::remote(format!("the peer failed (seen by rank {}: {})", a.reporter, a.reason))
                        .during(what.to_string())
                        .with_peer(p));
                }
                pending.push(p);
            }
            if pending.is_empty() {
                return Ok(got.into_iter().flatten().collect());
            }
            let now = Instant::now();
            if now >= deadline {
                let list: Vec<String> = pending.iter().map(|p| p.to_string()).collect();
                let mut e =
                    Error::new(ErrorKind::Timeout, format!("no message from rank(s) [{}] in time", list.join(", ")))
                        .during(what.to_string());
                if pending.len() == 1 {
                    e = e.with_peer(pending[0]);
                }
                return Err(e);
            }
            // Probe the liveness of silent peers now and then; wait on the first pending one.
            if now.duration_since(last_probe) >= Duration::from_millis(200) {
                last_probe = now;
                for &p in &pending {
                    let open = matches!(lock(&self.peers[p].inbox).incoming, Link::Open);
                    if !open {
                        self.probe(p);
                    }
                }
            }
            let peer = &self.peers[pending[0]];
            let inbox = lock(&peer.inbox);
            let has = inbox.queues.get(&tag).is_some_and(|q| !q.is_empty()) || peer_failure(&inbox).is_some();
            if !has {
                let wait = (deadline - now).min(Duration::from_millis(50));
                let _ = peer.cond.wait_timeout(inbox, wait);
            }
        }
    }
}

/// Records the first failure this rank hears of, wakes every wait, and tells the collectives'
/// neighbours (except the failed rank and the reporter) on a thread of its own, so the news
/// floods the ring and the tree: every rank learns who failed, not only that a neighbour went
/// silent. The ring and the tree together stay connected without any one rank.
fn raise_abort(sh: &Arc<Shared>, notice: AbortNotice) {
    if sh.closing.load(Ordering::Acquire) {
        return;
    }
    // The abort lock is held until the flood thread is recorded: a wait that sees the abort
    // returns, and the rank may close at once; its close must find the thread to join, so the
    // news leaves before the goodbye.
    let mut a = lock(&sh.abort);
    if a.is_some() {
        return;
    }
    warn!(target: LOG, "rank {}: rank {} failed (seen by rank {}: {})", sh.rank, notice.failed, notice.reporter, notice.reason);
    *a = Some(notice.clone());
    let sh2 = sh.clone();
    let flood = std::thread::Builder::new().name(format!("mscclpp-bs-abort-{}", sh.rank)).stack_size(128 * 1024).spawn(
        move || {
            let sh = sh2;
            let body = notice.to_wire();
            let limit = sh.timeout().min(Duration::from_secs(5));
            for nb in neighbours(sh.rank, sh.size) {
                if nb == notice.failed as usize || nb == notice.reporter as usize {
                    continue;
                }
                if let Err(e) = sh.send_until(nb, TAG_ABORT, &body, Instant::now() + limit, limit) {
                    debug!(target: LOG, "rank {}: telling rank {nb} of the failure: {e}", sh.rank);
                }
            }
        },
    );
    match flood {
        Ok(h) => *lock(&sh.flood) = Some(h),
        Err(e) => warn!(target: LOG, "rank {}: cannot start the thread telling the neighbours: {e}", sh.rank),
    }
    drop(a);
    for p in &sh.peers {
        p.cond.notify_all();
    }
}

/// Why waits on this peer must fail now, if they must.
fn peer_failure(inbox: &Inbox) -> Option<String> {
    match &inbox.incoming {
        Link::Closed(why) => Some(format!("the peer's connection closed ({why}); it has exited or failed")),
        Link::None => inbox
            .out_gone
            .filter(|t| t.elapsed() >= GONE_GRACE)
            .map(|_| "the peer is unreachable (its listener is closed); it has exited or failed".to_string()),
        Link::Open => None,
    }
}

fn accept_loop(sh: Arc<Shared>, listener: TcpListener) {
    let listener = StoppableListener::new(listener);
    while let Some(conn) = listener.next(|| sh.closing.load(Ordering::Acquire)) {
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                // out of descriptors or a transient error: do not spin
                debug!(target: LOG, "rank {}: accept: {e}", sh.rank);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if sh.closing.load(Ordering::Acquire) {
            break;
        }
        let sh2 = sh.clone();
        let clone = s.try_clone().ok();
        // Forget finished readers (the root's delivery, strangers, peers gone): their stream
        // clones would hold descriptors until the bootstrap closes.
        lock(&sh.readers).retain(|(_, h)| !h.is_finished());
        let h = std::thread::Builder::new()
            .name(format!("mscclpp-bs-rx-{}", sh.rank))
            .stack_size(256 * 1024)
            .spawn(move || serve_incoming(sh2, s));
        match h {
            Ok(h) => lock(&sh.readers).push((clone, h)),
            Err(e) => warn!(target: LOG, "rank {}: cannot start a reader thread: {e}", sh.rank),
        }
    }
}

/// The reader shell of one incoming connection: the handshake, then bytes into a
/// [`FrameReader`] and its messages into the inbox.
fn serve_incoming(sh: Arc<Shared>, mut s: TcpStream) {
    let from = s.peer_addr().ok();
    let _ = s.set_read_timeout(Some(HANDSHAKE_LIMIT.min(sh.timeout().max(Duration::from_millis(100)))));
    let hello = match read_hello(&mut s, &sh.secret) {
        Ok(h) => h,
        Err(e) => {
            if !sh.closing.load(Ordering::Acquire) {
                warn!(target: LOG, "rank {}: dropping connection from {from:?} that failed the handshake: {e}", sh.rank);
            }
            return;
        }
    };
    let rank = hello.rank as usize;
    if hello.kind == KIND_ANSWER && hello.size as usize == sh.size && rank == sh.rank {
        // The root delivering its final answer; nothing else comes on this connection.
        match read_root_answer(&mut s, Instant::now() + HANDSHAKE_LIMIT, sh.secret, sh.size) {
            Ok(status) => {
                *lock(&sh.root_answer) = Some(status);
                sh.root_cond.notify_all();
            }
            Err(e) => warn!(target: LOG, "rank {}: reading the root's answer from {from:?}: {e}", sh.rank),
        }
        return;
    }
    if hello.kind != KIND_PEER || hello.size as usize != sh.size || rank >= sh.size || rank == sh.rank {
        warn!(
            target: LOG,
            "rank {}: dropping connection from {from:?}: bad handshake (kind {}, rank {rank}, size {})",
            sh.rank, hello.kind, hello.size
        );
        return;
    }
    if s.write_all(&[ACK]).is_err() {
        return;
    }
    let _ = s.set_read_timeout(None);
    let peer = &sh.peers[rank];
    {
        lock(&peer.inbox).incoming = Link::Open;
        peer.cond.notify_all();
    }
    debug!(target: LOG, "rank {}: connection from rank {rank} open", sh.rank);
    let mut frames = FrameReader::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut msgs = Vec::new();
    let mut goodbye = false;
    let why = loop {
        let n = match s.read(&mut buf) {
            Ok(0) if goodbye => break "closed".to_string(),
            Ok(0) if frames.at_boundary() => break "closed".to_string(),
            Ok(0) => break "closed in the middle of a message".to_string(),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break e.to_string(),
        };
        if let Err(e) = frames.push(&buf[..n], &mut msgs) {
            break e.to_string();
        }
        for (tag, data) in msgs.drain(..) {
            match tag {
                TAG_GOODBYE => goodbye = true,
                TAG_ABORT => match AbortNotice::from_wire(&data) {
                    Ok(n) if (n.failed as usize) < sh.size => raise_abort(&sh, n),
                    Ok(n) => {
                        warn!(target: LOG, "rank {}: abort notice from rank {rank} names rank {}", sh.rank, n.failed)
                    }
                    Err(e) => warn!(target: LOG, "rank {}: bad abort notice from rank {rank}: {e}", sh.rank),
                },
                _ => {
                    lock(&peer.inbox).queues.entry(tag).or_default().push_back(data);
                    peer.cond.notify_all();
                }
            }
        }
    };
    let closing = sh.closing.load(Ordering::Acquire);
    if !closing {
        debug!(target: LOG, "rank {}: connection from rank {rank} ended: {why}", sh.rank);
    }
    // A close without a goodbye (the peer died) fails the waits on this peer at once; a
    // collective waiting on it then tells the others (`recv_many`). Nothing is raised here: a
    // rank that exits without dropping its bootstrap after its last collective harms no one.
    let why = if goodbye || closing { why } else { format!("{why}, without a goodbye") };
    lock(&peer.inbox).incoming = Link::Closed(why);
    peer.cond.notify_all();
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn ranks_per_node(&self) -> usize {
        let table = self.shared.table.get().map(Vec::as_slice).unwrap_or_default();
        let me = table.get(self.shared.rank).map(|(_, h)| *h);
        table.iter().filter(|(_, h)| Some(*h) == me).count()
    }

    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        Self::check_tag(tag).map_err(|e| e.during("bootstrap send"))?;
        self.check_peer(peer, "bootstrap send")?;
        self.shared
            .send_any(peer, tag, data)
            .map_err(|e| e.during(format!("bootstrap send (tag {tag})")).with_peer(peer))
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        Self::check_tag(tag).map_err(|e| e.during("bootstrap recv"))?;
        self.check_peer(peer, "bootstrap recv")?;
        let mut v =
            self.shared.recv_many(&[peer], tag, self.deadline(), &format!("bootstrap recv (tag {tag})"), false)?;
        v.pop().ok_or_else(|| Error::internal("recv_many returned nothing"))
    }

    /// Up the binary tree rooted at rank 0 (each rank sends its subtree's pieces to its
    /// parent), then the whole table down it: 2 log2(n) hops, at most three tree peers per rank.
    /// When a subtree holds more than 1 MiB, an overflow marker goes up
    /// and down instead and the ranks pass their pieces around the ring (next and previous
    /// rank, n-1 hops), which moves large data without the tree's store-and-forward. Measured in
    /// docs/history.md.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let what = "bootstrap all_gather";
        let (me, n) = (self.shared.rank, self.shared.size);
        let deadline = self.deadline();
        let encode = |g: &GatherBlocks| g.encode().map_err(|e| e.during(what.to_string()));
        // Up: my subtree's pieces, in rank order, or an overflow marker.
        let mut mine = GatherBlocks { overflow: data.len() > TREE_GATHER_LIMIT, blocks: Vec::new() };
        let mut held = data.len();
        if !mine.overflow {
            mine.blocks.push((me as u32, data.to_vec()));
        }
        for c in tree_children(me, n) {
            let got = GatherBlocks::from_wire(&self.coll_recv(c, TAG_ALL_GATHER, deadline, what)?)
                .map_err(|e| e.during(what.to_string()).with_peer(c))?;
            held += got.blocks.iter().map(|(_, b)| b.len()).sum::<usize>();
            mine.overflow |= got.overflow || held > TREE_GATHER_LIMIT;
            if !mine.overflow {
                mine.blocks.extend(got.blocks);
            }
        }
        if mine.overflow {
            mine.blocks.clear();
        }
        mine.blocks.sort_unstable_by_key(|(r, _)| *r);
        // Down: the full table (or the marker), forwarded as received.
        let table = match tree_parent(me) {
            Some(p) => {
                self.coll_send(p, TAG_ALL_GATHER, &encode(&mine)?, what)?;
                self.coll_recv(p, TAG_ALL_GATHER, deadline, what)?
            }
            None => encode(&mine)?,
        };
        for c in tree_children(me, n) {
            self.coll_send(c, TAG_ALL_GATHER, &table, what)?;
        }
        let all = GatherBlocks::from_wire(&table).map_err(|e| e.during(what.to_string()))?;
        if all.overflow {
            return self.ring_all_gather(data, deadline, what);
        }
        if all.blocks.len() != n || all.blocks.iter().enumerate().any(|(i, (r, _))| *r as usize != i) {
            return Err(Error::remote(format!(
                "the gathered table has {} pieces, not one from each of {n} ranks",
                all.blocks.len()
            ))
            .during(what.to_string()));
        }
        Ok(all.blocks.into_iter().map(|(_, b)| b).collect())
    }

    /// Up the binary tree rooted at rank 0 (along the root's ancestors) to rank 0, then down
    /// the tree: at most three tree peers per rank.
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        let what = "bootstrap broadcast";
        self.check_peer(root, what)?;
        let (me, n) = (self.shared.rank, self.shared.size);
        let deadline = self.deadline();
        tree_broadcast(
            me,
            n,
            root,
            data,
            |p, d| self.coll_send(p, TAG_BROADCAST, d, what),
            |p| self.coll_recv(p, TAG_BROADCAST, deadline, what),
        )
    }

    /// Arrivals up the binary tree rooted at rank 0, then the release down it: 2 log2(n) hops.
    fn barrier(&self) -> Result<()> {
        let what = "bootstrap barrier";
        let (me, n) = (self.shared.rank, self.shared.size);
        let deadline = self.deadline();
        let children: Vec<usize> = tree_children(me, n).collect();
        self.shared.recv_many(&children, TAG_BARRIER, deadline, what, true)?;
        if let Some(p) = tree_parent(me) {
            self.coll_send(p, TAG_BARRIER, &[], what)?;
            self.coll_recv(p, TAG_BARRIER, deadline, what)?;
        }
        for &c in &children {
            self.coll_send(c, TAG_BARRIER, &[], what)?;
        }
        Ok(())
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        let sh = &self.shared;
        let flood = {
            let _abort = lock(&sh.abort);
            lock(&sh.flood).take()
        };
        if let Some(t) = flood {
            let _ = t.join();
        }
        // A goodbye on each connection we opened, so the peers tell a close from a death.
        let bye = frame_header(TAG_GOODBYE, 0);
        for p in &sh.peers {
            if let Some(mut s) = lock(&p.out).take() {
                let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                let _ = s.write_all(&bye);
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        sh.closing.store(true, Ordering::Release);
        // wake the accept loop
        let _ = TcpStream::connect_timeout(&sh.listen_addr, Duration::from_secs(1));
        if let Some(t) = self.listener_thread.take() {
            let _ = t.join();
        }
        let readers = std::mem::take(&mut *lock(&sh.readers));
        for (s, _) in &readers {
            if let Some(s) = s {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        for (_, h) in readers {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_text_and_bytes_round_trip() {
        let id = UniqueId { root: "10.1.2.3:4567".parse().unwrap(), secret: [7; 16], external_root: true };
        let t = id.to_string();
        assert_eq!(t.parse::<UniqueId>().unwrap(), id);
        assert_eq!(UniqueId::from_bytes(&id.to_bytes()[..]).unwrap(), id);
        assert!("zz".parse::<UniqueId>().is_err());
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
        assert!(!format!("{id:?}").contains("7, 7"), "Debug must not print the secret");
    }

    proptest::proptest! {
        #[test]
        fn unique_id_wire_form(ip in proptest::prelude::any::<std::net::IpAddr>(), port: u16, secret: [u8; 16], ext: bool,
                               junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let id = UniqueId { root: SocketAddr::new(ip, port), secret, external_root: ext };
            crate::wire::check::check_value(&id);
            crate::wire::check::check_bytes::<UniqueId>(&junk);
        }
    }

    #[test]
    fn unique_id_padding_must_be_zero() {
        let id = UniqueId { root: "10.1.2.3:4567".parse().unwrap(), secret: [7; 16], external_root: false };
        let mut b = id.to_bytes();
        assert_eq!(UniqueId::from_bytes(&b[..60]).unwrap(), id);
        b[127] = 1;
        assert!(UniqueId::from_bytes(&b).unwrap_err().to_string().contains("non-zero bytes after"));
        let mut long = id.to_bytes().to_vec();
        long.push(0);
        assert!(UniqueId::from_bytes(&long).is_err());
        // Text is lenient about case and surrounding space, strict about everything else.
        assert_eq!(format!(" {} ", id.to_string().to_uppercase()).parse::<UniqueId>().unwrap(), id);
        assert_eq!(format!("{id}00").parse::<UniqueId>().unwrap(), id);
        assert!(format!("{id}01").parse::<UniqueId>().is_err());
    }

    proptest::proptest! {
        #[test]
        fn unique_id_padded_and_text_forms(ip in proptest::prelude::any::<std::net::IpAddr>(), port: u16,
                                           secret: [u8; 16], ext: bool, cut in 0usize..=128,
                                           junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..160)) {
            let id = UniqueId { root: SocketAddr::new(ip, port), secret, external_root: ext };
            let padded = id.to_bytes();
            let fields = crate::wire::WireForm::to_wire(&id).len();
            proptest::prop_assert_eq!(UniqueId::from_bytes(&padded[..cut]).is_ok(), cut >= fields);
            check_padded(&padded[..cut]);
            check_padded(&junk);
            check_text(&id.to_string());
            check_text(&String::from_utf8_lossy(&junk));
        }
    }

    #[test]
    fn single_rank_job() {
        let id = TcpBootstrap::create_unique_id().unwrap();
        let bs = TcpBootstrap::config(0, 1).timeout(Duration::from_secs(5)).initialize(&id).unwrap();
        assert_eq!((bs.rank(), bs.size(), bs.ranks_per_node()), (0, 1, 1));
        bs.send(0, 5, b"self").unwrap();
        assert_eq!(bs.recv(0, 5).unwrap(), b"self");
        assert_eq!(bs.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
        bs.barrier().unwrap();
        assert!(bs.send(1, 0, b"").is_err());
        assert_eq!(bs.send(0, u64::MAX, b"").unwrap_err().kind(), ErrorKind::InvalidUsage);
    }

    #[test]
    fn threads_as_ranks() {
        let (root, id) = RootServer::start(4, Duration::from_secs(10)).unwrap();
        let hs: Vec<_> = (0..4)
            .map(|r| {
                let id = id.clone();
                std::thread::spawn(move || {
                    let bs = TcpBootstrap::config(r, 4).timeout(Duration::from_secs(10)).initialize(&id).unwrap();
                    let all = bs.all_gather(&[r as u8; 3]).unwrap();
                    assert_eq!(all, (0..4).map(|i| vec![i as u8; 3]).collect::<Vec<_>>());
                    let b = bs.broadcast(2, &[r as u8]).unwrap();
                    assert_eq!(b, vec![2u8]);
                    bs.barrier().unwrap();
                    bs.send((r + 1) % 4, 1, b"a").unwrap();
                    bs.send((r + 1) % 4, 2, b"b").unwrap();
                    let prev = (r + 3) % 4;
                    assert_eq!(bs.recv(prev, 2).unwrap(), b"b");
                    assert_eq!(bs.recv(prev, 1).unwrap(), b"a");
                    assert_eq!(bs.ranks_per_node(), 4);
                    bs.barrier().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        root.join();
    }

    /// Ranks 0 and 1 of 3 join; rank 2 never comes. Each joined rank's error names rank 2,
    /// whether the root's deadline comes first (it delivers the failure) or the ranks' own (they
    /// ask the root who is missing).
    #[test]
    fn missing_rank_named_whoever_gives_up_first() {
        for (root_timeout, rank_timeout) in
            [(Duration::from_secs(1), Duration::from_secs(20)), (Duration::from_secs(20), Duration::from_millis(1500))]
        {
            let (root, id) = RootServer::start(3, root_timeout).unwrap();
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let id = id.clone();
                    std::thread::spawn(move || {
                        let t0 = Instant::now();
                        let e = TcpBootstrap::config(r, 3).timeout(rank_timeout).initialize(&id).unwrap_err();
                        (e, t0.elapsed())
                    })
                })
                .collect();
            for h in hs {
                let (e, took) = h.join().unwrap();
                assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
                assert!(e.to_string().contains("[2]"), "the error must name rank 2: {e}");
                // which side gave up shows in the words: the root's delivered failure, or the
                // answer to the rank's own question
                let said =
                    if root_timeout < rank_timeout { "did not reach the bootstrap root" } else { "missing ranks [2]" };
                assert!(e.to_string().contains(said), "{e}");
                println!("gave up after {took:?}: {e}");
            }
            if root_timeout < rank_timeout {
                root.join();
            } else {
                // the root waits out its own deadline on a thread of its own
                drop(std::thread::spawn(move || root.join()));
            }
        }
    }

    /// A second rank 1 is refused at once, by name; the job goes on without noticing.
    #[test]
    fn duplicate_rank_refused_at_once() {
        let (root, id) = RootServer::start(2, Duration::from_secs(20)).unwrap();
        let id1 = id.clone();
        let first =
            std::thread::spawn(move || TcpBootstrap::config(1, 2).timeout(Duration::from_secs(20)).initialize(&id1));
        // Let the first rank 1 arrive: ask the root until it no longer misses rank 1.
        let t0 = Instant::now();
        loop {
            let deadline = Instant::now() + Duration::from_secs(5);
            match query_root(id.root, id.secret, 0, 2, deadline) {
                Ok(RootStatus::Progress { missing }) if !missing.contains(&1) => break,
                _ if t0.elapsed() > Duration::from_secs(20) => panic!("the first rank 1 never reached the root"),
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let e = TcpBootstrap::config(1, 2).timeout(Duration::from_secs(20)).initialize(&id).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Remote, "{e}");
        assert!(e.to_string().contains("rank 1 joined twice"), "{e}");
        let r0 = TcpBootstrap::config(0, 2).timeout(Duration::from_secs(20)).initialize(&id).unwrap();
        let r1 = first.join().unwrap().unwrap();
        let hs = [r0, r1].map(|bs| std::thread::spawn(move || bs.all_gather(&[bs.rank() as u8]).unwrap()));
        for h in hs {
            assert_eq!(h.join().unwrap(), vec![vec![0u8], vec![1u8]]);
        }
        root.join();
    }

    /// Rank 2 joins, then dies before the table comes (its hello names a listener that is
    /// already closed). Ranks 0 and 1 still get the table, and their first collective fails
    /// naming rank 2, not a timeout.
    #[test]
    fn rank_dying_after_its_join_is_named() {
        let (root, id) = RootServer::start(3, Duration::from_secs(20)).unwrap();
        let dead_listener = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let mut s = TcpStream::connect(id.root).unwrap();
        let hello = Hello {
            kind: KIND_ROOT,
            secret: id.secret,
            rank: 2,
            size: 3,
            listen: Some((dead_listener, crate::identity::host_hash())),
        };
        s.write_all(&length_prefixed(&hello.to_wire())).unwrap();
        drop(s);
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let id = id.clone();
                std::thread::spawn(move || {
                    let bs = TcpBootstrap::config(r, 3).timeout(Duration::from_secs(20)).initialize(&id).unwrap();
                    bs.all_gather(&[r as u8]).unwrap_err()
                })
            })
            .collect();
        for h in hs {
            let e = h.join().unwrap();
            assert_eq!(e.peer(), Some(2), "{e}");
            assert_ne!(e.kind(), ErrorKind::Timeout, "{e}");
            assert!(e.to_string().contains("rank 2 failed"), "{e}");
        }
        root.join();
    }
}
