//! The TCP bootstrap.
//!
//! # Protocol
//! * **Handshake.** Every socket of a job opens with [`Hello`]: a magic, a version, the socket's
//!   purpose, the job secret from the [`UniqueId`], the sender's rank and the job size. The
//!   acceptor checks all of it before reading anything else; a stranger is logged and dropped and
//!   never counts as a rank. The acceptor answers one byte (`ACK`), so the connector knows it
//!   reached the right job.
//! * **Rendezvous.** Each rank binds a listener for peer traffic, connects to the root (a thread
//!   of rank 0, or a [`RootServer`]) and sends its listening address and host hash. When all ranks
//!   have arrived, the root sends everyone the table; while it waits it sends progress notes that
//!   list the missing ranks, so a rank that times out can name them. The root's answers carry the
//!   secret back, so a rank knows it talked to its own root.
//! * **Messages.** One TCP connection per ordered pair of ranks, made on first send. Frames are
//!   `[tag u64][len u64][len bytes]`. A reader thread per incoming connection files messages by
//!   tag, so receives may come in any order across tags and are FIFO within one.
//! * **Failure.** Every wait has a deadline (default 30 s). A peer whose connection closes, or
//!   whose listener refuses us, makes waits on it fail at once with an error naming it.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::{Bootstrap, RESERVED_TAG_BASE, TAG_ALL_GATHER};
use crate::error::{Error, ErrorKind, Result};
use crate::net::{connect_retry, get_addr, put_addr};
use crate::sync::lock;
use crate::wire::{Reader, Writer, length_prefixed, read_length_prefixed};

const LOG: &str = "mscclpp::bootstrap";
const HELLO_MAGIC: &[u8; 4] = b"MSBS";
const ID_MAGIC: &[u8; 4] = b"MSID";
const VERSION: u16 = 1;
const KIND_PEER: u8 = 1;
const KIND_ROOT: u8 = 2;
const ACK: u8 = 0x5a;
const ROOT_DONE: u8 = 0;
const ROOT_FAILED: u8 = 1;
const ROOT_PROGRESS: u8 = 2;
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

impl crate::wire::WireForm for UniqueId {
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

fn bind_on_default_interface() -> Result<TcpListener> {
    let ip = crate::net::find_interfaces()?[0].addr;
    TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("binding the bootstrap root on {ip}"), e))
}

fn random_secret() -> Result<[u8; 16]> {
    let mut s = [0u8; 16];
    crate::identity::os_random(&mut s)?;
    Ok(s)
}

/// The handshake every bootstrap socket opens with.
struct Hello {
    kind: u8,
    secret: [u8; 16],
    rank: u32,
    size: u32,
    /// Root hellos: the rank's peer listening address and host hash.
    listen: Option<(SocketAddr, u64)>,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(HELLO_MAGIC, VERSION);
        w.u8(self.kind);
        w.raw(&self.secret);
        w.u32(self.rank);
        w.u32(self.size);
        if let Some((a, h)) = &self.listen {
            put_addr(&mut w, a);
            w.u64(*h);
        }
        length_prefixed(&w.finish())
    }

    /// Reads a hello of at most 256 bytes and checks magic, version and secret.
    fn read(s: &mut TcpStream, secret: &[u8; 16]) -> Result<Hello> {
        let body = read_length_prefixed(s, 256, "the handshake")?;
        let mut r = Reader::new(&body, "bootstrap handshake", HELLO_MAGIC, VERSION)?;
        let kind = r.u8()?;
        let their: [u8; 16] = r.array()?;
        if &their != secret {
            return Err(Error::remote("wrong job secret"));
        }
        let rank = r.u32()?;
        let size = r.u32()?;
        let listen = if kind == KIND_ROOT { Some((get_addr(&mut r)?, r.u64()?)) } else { None };
        r.finish()?;
        Ok(Hello { kind, secret: their, rank, size, listen })
    }
}

fn write_frame(s: &mut TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    s.write_all(&length_prefixed(&parts.concat()))
}

// ---------------------------------------------------------------------------------------------
// Root

struct Arrival {
    rank: usize,
    size: usize,
    stream: TcpStream,
    listen: SocketAddr,
    host_hash: u64,
}

/// The rendezvous point of a job, run on its own thread. Rank 0 starts one by itself; a
/// launcher that is not a rank (like `mscclpp-perf --ranks N`) starts one with
/// [`RootServer::start`] and hands the id to its ranks.
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

fn run_root(listener: TcpListener, size: usize, secret: [u8; 16], deadline: Instant) {
    let addr = listener.local_addr().ok();
    let (tx, rx) = mpsc::channel::<Arrival>();
    let done = Arc::new(AtomicBool::new(false));
    let accept_done = done.clone();
    // Accept on a thread of its own; each connection's handshake on another, so that a silent
    // stranger cannot hold up the rendezvous.
    let acceptor = std::thread::Builder::new().name("mscclpp-bs-root-accept".into()).spawn(move || {
        for conn in listener.incoming() {
            if accept_done.load(Ordering::Acquire) {
                break;
            }
            let Ok(mut s) = conn else { continue };
            let tx = tx.clone();
            let _ = std::thread::Builder::new().name("mscclpp-bs-root-hs".into()).spawn(move || {
                let peer = s.peer_addr().ok();
                let _ = s.set_read_timeout(Some(HANDSHAKE_LIMIT));
                match Hello::read(&mut s, &secret) {
                    Ok(h) if h.kind == KIND_ROOT => {
                        let (listen, host_hash) = h.listen.unwrap_or((crate::net::NO_ADDR, 0));
                        let _ = s.set_read_timeout(None);
                        let _ = tx.send(Arrival { rank: h.rank as usize, size: h.size as usize, stream: s, listen, host_hash });
                    }
                    Ok(h) => warn!(target: LOG, "root: dropping connection from {peer:?}: handshake of kind {} is not a rank joining", h.kind),
                    Err(e) => warn!(target: LOG, "root: dropping connection from {peer:?} that failed the handshake: {e}"),
                }
            });
        }
    });
    let mut arrived: Vec<Option<Arrival>> = (0..size).map(|_| None).collect();
    let mut count = 0;
    let mut last_progress = Instant::now();
    let reply = |s: &mut TcpStream, status: u8, body: &[u8]| {
        let _ = write_frame(s, &[&[status], &secret, body]);
    };
    while count < size {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if now.duration_since(last_progress) >= Duration::from_millis(300) {
            last_progress = now;
            let missing = missing_list(&arrived);
            for a in arrived.iter_mut().flatten() {
                reply(&mut a.stream, ROOT_PROGRESS, missing.as_bytes());
            }
        }
        let wait = (deadline - now).min(Duration::from_millis(100));
        let Ok(mut a) = rx.recv_timeout(wait) else { continue };
        if a.size != size {
            let msg = format!("rank {} says the job has {} ranks, the root expects {size}", a.rank, a.size);
            warn!(target: LOG, "root: {msg}");
            reply(&mut a.stream, ROOT_FAILED, msg.as_bytes());
        } else if a.rank >= size {
            let msg = format!("rank {} is out of range for {size} ranks", a.rank);
            warn!(target: LOG, "root: {msg}");
            reply(&mut a.stream, ROOT_FAILED, msg.as_bytes());
        } else if arrived[a.rank].is_some() {
            let msg = format!("rank {} joined twice; refusing the second", a.rank);
            warn!(target: LOG, "root: {msg}");
            reply(&mut a.stream, ROOT_FAILED, msg.as_bytes());
        } else {
            debug!(target: LOG, "root: rank {} arrived from {}", a.rank, a.listen);
            let r = a.rank;
            arrived[r] = Some(a);
            count += 1;
        }
    }
    if count == size {
        let mut w = Writer::default();
        w.u32(size as u32);
        for a in arrived.iter().flatten() {
            put_addr(&mut w, &a.listen);
            w.u64(a.host_hash);
        }
        let table = w.finish();
        for a in arrived.iter_mut().flatten() {
            reply(&mut a.stream, ROOT_DONE, &table);
        }
        info!(target: LOG, "root: all {size} ranks joined");
    } else {
        let msg = format!("ranks {} did not reach the bootstrap root", missing_list(&arrived));
        warn!(target: LOG, "root: giving up: {msg}");
        for a in arrived.iter_mut().flatten() {
            reply(&mut a.stream, ROOT_FAILED, msg.as_bytes());
        }
    }
    done.store(true, Ordering::Release);
    // wake the acceptor so it sees `done`
    if let Some(a) = addr {
        let _ = TcpStream::connect_timeout(&a, Duration::from_secs(1));
    }
    if let Ok(t) = acceptor {
        let _ = t.join();
    }
}

fn missing_list(arrived: &[Option<Arrival>]) -> String {
    let m: Vec<String> = arrived.iter().enumerate().filter(|(_, a)| a.is_none()).map(|(i, _)| i.to_string()).collect();
    format!("[{}]", m.join(", "))
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
    addr: SocketAddr,
    host_hash: u64,
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
    peers: Vec<Peer>,
    closing: AtomicBool,
    /// Incoming streams (to shut down on close) and their reader threads.
    readers: Mutex<Vec<(Option<TcpStream>, JoinHandle<()>)>>,
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
                None => TcpListener::bind(id.root).map_err(|e| {
                    Error::io(
                        format!(
                            "rank 0 binding the bootstrap root at {} (rank 0 must run in the process that called \
                             create_unique_id, or use RootServer)",
                            id.root
                        ),
                        e,
                    )
                })?,
            };
            root = Some(RootServer::spawn(listener, self.size, id.secret, self.timeout)?);
        }
        let res = TcpBootstrap::join(&self, id.root, id.secret);
        if let Some(r) = root {
            r.join();
        }
        res
    }

    /// Joins the job whose root listens at `"[iface:]ip:port"`; rank 0 binds that address.
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
            sock.listen(1024).map_err(|e| Error::io("listening for the bootstrap root", e))?;
            root = Some(RootServer::spawn(sock.into(), self.size, secret, self.timeout)?);
        }
        let res = TcpBootstrap::join(&self, addr, secret);
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

    /// Joins the job whose root listens at `"[iface:]ip:port"`, with the default timeout.
    pub fn initialize_with_addr(rank: usize, size: usize, spec: &str) -> Result<TcpBootstrap> {
        Self::config(rank, size).initialize_with_addr(spec)
    }

    /// The current wait limit.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.shared.timeout_ms.load(Ordering::Relaxed))
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
        // Listen for peers on the address that reaches the root.
        let local_ip: IpAddr = rs.local_addr().map_err(|e| Error::io("reading the local address", e))?.ip();
        let listener =
            TcpListener::bind((local_ip, 0)).map_err(|e| Error::io(format!("binding a listener on {local_ip}"), e))?;
        let listen_addr = listener.local_addr().map_err(|e| Error::io("reading the listening address", e))?;
        let hello = Hello {
            kind: KIND_ROOT,
            secret,
            rank: cfg.rank as u32,
            size: cfg.size as u32,
            listen: Some((listen_addr, crate::identity::host_hash())),
        };
        rs.write_all(&hello.encode()).map_err(|e| Error::io("sending the hello to the root", e).during(op.clone()))?;
        // Wait for the table, keeping the root's latest list of missing ranks.
        let mut missing = String::from("(unknown: the root sent no progress)");
        let table = loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("not all ranks joined within {:?}; missing ranks {missing}", cfg.timeout),
                )
                .during(op));
            }
            let _ = rs.set_read_timeout(Some(deadline - now));
            let frame = match read_length_prefixed(&mut rs, 1 << 30, "the bootstrap root's answer") {
                Ok(f) => f,
                Err(e) if e.source_is_timeout() => continue,
                Err(e) => return Err(e.during(op)),
            };
            if frame.len() < 17 || frame[1..17] != secret {
                return Err(Error::remote("the root's answer does not carry the job secret").during(op));
            }
            let body = &frame[17..];
            match frame[0] {
                ROOT_PROGRESS => missing = String::from_utf8_lossy(body).into_owned(),
                ROOT_FAILED => {
                    let msg = String::from_utf8_lossy(body).into_owned();
                    let kind = if msg.contains("did not reach") { ErrorKind::Timeout } else { ErrorKind::Remote };
                    return Err(Error::new(kind, format!("the root gave up: {msg}")).during(op));
                }
                ROOT_DONE => break body.to_vec(),
                s => return Err(Error::remote(format!("unknown root status {s}")).during(op)),
            }
        };
        let peers = parse_table(&table, cfg.size).map_err(|e| e.during(op.clone()))?;
        let shared = Arc::new(Shared {
            rank: cfg.rank,
            size: cfg.size,
            secret,
            timeout_ms: AtomicU64::new(cfg.timeout.as_millis().min(u64::MAX as u128) as u64),
            listen_addr,
            peers: peers
                .into_iter()
                .map(|(addr, host_hash)| Peer {
                    addr,
                    host_hash,
                    out: Mutex::new(None),
                    inbox: Mutex::new(Inbox { queues: HashMap::new(), incoming: Link::None, out_gone: None }),
                    cond: Condvar::new(),
                })
                .collect(),
            closing: AtomicBool::new(false),
            readers: Mutex::new(Vec::new()),
        });
        let sh = shared.clone();
        let listener_thread = std::thread::Builder::new()
            .name(format!("mscclpp-bs-listen-{}", cfg.rank))
            .spawn(move || accept_loop(sh, listener))
            .map_err(|e| Error::io("starting the bootstrap listener thread", e))?;
        info!(target: LOG, "rank {} of {} joined in {:?}", cfg.rank, cfg.size, start.elapsed());
        Ok(TcpBootstrap { shared, listener_thread: Some(listener_thread) })
    }

    fn check_peer(&self, peer: usize, op: &str) -> Result<()> {
        if peer >= self.shared.size {
            return Err(Error::invalid_usage(format!("peer rank {peer} is not in 0..{}", self.shared.size))
                .during(op.to_string()));
        }
        Ok(())
    }

    fn send_any(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let sh = &self.shared;
        if peer == sh.rank {
            let p = &sh.peers[peer];
            lock(&p.inbox).queues.entry(tag).or_default().push_back(data.to_vec());
            p.cond.notify_all();
            return Ok(());
        }
        let p = &sh.peers[peer];
        let mut out = lock(&p.out);
        if out.is_none() {
            let deadline = Instant::now() + self.timeout();
            *out = Some(self.connect_peer(peer, deadline)?);
        }
        let Some(s) = out.as_mut() else { return Err(Error::internal("no stream after connecting")) };
        let _ = s.set_write_timeout(Some(self.timeout().max(Duration::from_millis(1))));
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&tag.to_le_bytes());
        head[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        let res = if data.len() <= 64 * 1024 {
            let mut b = Vec::with_capacity(16 + data.len());
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
        let sh = &self.shared;
        let p = &sh.peers[peer];
        let mut s = match TcpStream::connect_timeout(
            &p.addr,
            (deadline.saturating_duration_since(Instant::now())).max(Duration::from_millis(1)),
        ) {
            Ok(s) => s,
            Err(e) => {
                lock(&p.inbox).out_gone.get_or_insert_with(Instant::now);
                p.cond.notify_all();
                return Err(Error::remote(format!("cannot connect to {} (the peer has probably exited)", p.addr))
                    .with_source(e));
            }
        };
        let _ = s.set_nodelay(true);
        let hello =
            Hello { kind: KIND_PEER, secret: sh.secret, rank: sh.rank as u32, size: sh.size as u32, listen: None };
        let _ =
            s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))));
        s.write_all(&hello.encode()).map_err(|e| Error::io("sending the handshake", e))?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).map_err(|e| Error::io("waiting for the handshake answer", e))?;
        if ack[0] != ACK {
            return Err(Error::remote(format!("peer at {} answered the handshake with {:#x}", p.addr, ack[0])));
        }
        let _ = s.set_read_timeout(None);
        Ok(s)
    }

    /// Checks whether our connection to `peer` still stands, connecting if there is none.
    fn probe(&self, peer: usize) {
        let p = &self.shared.peers[peer];
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
    /// that did not deliver.
    fn recv_many(&self, peers: &[usize], tag: u64, what: &str) -> Result<Vec<Vec<u8>>> {
        let timeout = self.timeout();
        let deadline = Instant::now() + timeout;
        let mut got: Vec<Option<Vec<u8>>> = vec![None; peers.len()];
        let mut last_probe = Instant::now();
        loop {
            let mut pending = Vec::new();
            for (i, &p) in peers.iter().enumerate() {
                if got[i].is_some() {
                    continue;
                }
                let peer = &self.shared.peers[p];
                let mut inbox = lock(&peer.inbox);
                if let Some(m) = inbox.queues.get_mut(&tag).and_then(|q| q.pop_front()) {
                    got[i] = Some(m);
                    continue;
                }
                if let Some(why) = peer_failure(&inbox) {
                    return Err(Error::remote(why).during(what.to_string()).with_peer(p));
                }
                pending.push(p);
            }
            if pending.is_empty() {
                return Ok(got.into_iter().flatten().collect());
            }
            let now = Instant::now();
            if now >= deadline {
                let list: Vec<String> = pending.iter().map(|p| p.to_string()).collect();
                let mut e = Error::new(
                    ErrorKind::Timeout,
                    format!("no message from rank(s) [{}] within {timeout:?}", list.join(", ")),
                )
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
                    let open = matches!(lock(&self.shared.peers[p].inbox).incoming, Link::Open);
                    if !open {
                        self.probe(p);
                    }
                }
            }
            let peer = &self.shared.peers[pending[0]];
            let inbox = lock(&peer.inbox);
            let has = inbox.queues.get(&tag).is_some_and(|q| !q.is_empty()) || peer_failure(&inbox).is_some();
            if !has {
                let wait = (deadline - now).min(Duration::from_millis(50));
                let _ = peer.cond.wait_timeout(inbox, wait);
            }
        }
    }

    fn check_tag(tag: u64) -> Result<()> {
        if tag >= RESERVED_TAG_BASE {
            return Err(Error::invalid_usage(format!("tag {tag:#x} is reserved (user tags are below 2^63)")));
        }
        Ok(())
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

fn parse_table(b: &[u8], size: usize) -> Result<Vec<(SocketAddr, u64)>> {
    let mut w = Writer::new(HELLO_MAGIC, VERSION);
    w.raw(b);
    let framed = w.finish();
    let mut r = Reader::new(&framed, "root address table", HELLO_MAGIC, VERSION)?;
    let n = r.u32()? as usize;
    if n != size {
        return Err(Error::remote(format!("root table has {n} ranks, expected {size}")));
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push((get_addr(&mut r)?, r.u64()?));
    }
    r.finish()?;
    Ok(v)
}

fn accept_loop(sh: Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        if sh.closing.load(Ordering::Acquire) {
            break;
        }
        let Ok(s) = conn else { continue };
        let sh2 = sh.clone();
        let clone = s.try_clone().ok();
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

fn serve_incoming(sh: Arc<Shared>, mut s: TcpStream) {
    let from = s.peer_addr().ok();
    let _ = s.set_read_timeout(Some(
        HANDSHAKE_LIMIT.min(Duration::from_millis(sh.timeout_ms.load(Ordering::Relaxed).max(100))),
    ));
    let hello = match Hello::read(&mut s, &sh.secret) {
        Ok(h) => h,
        Err(e) => {
            if !sh.closing.load(Ordering::Acquire) {
                warn!(target: LOG, "rank {}: dropping connection from {from:?} that failed the handshake: {e}", sh.rank);
            }
            return;
        }
    };
    let rank = hello.rank as usize;
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
    let why = loop {
        let mut head = [0u8; 16];
        if let Err(e) = s.read_exact(&mut head) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof { "closed".to_string() } else { e.to_string() };
        }
        let tag = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(head[8..].try_into().unwrap_or_default());
        let Ok(len) = usize::try_from(len) else { break format!("message of {len} bytes is too large") };
        let mut data = Vec::new();
        if data.try_reserve_exact(len).is_err() {
            break format!("cannot allocate {len} bytes for a message");
        }
        data.resize(len, 0);
        if let Err(e) = s.read_exact(&mut data) {
            break format!("message cut short: {e}");
        }
        lock(&peer.inbox).queues.entry(tag).or_default().push_back(data);
        peer.cond.notify_all();
    };
    if !sh.closing.load(Ordering::Acquire) {
        debug!(target: LOG, "rank {}: connection from rank {rank} ended: {why}", sh.rank);
    }
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
        let me = self.shared.peers[self.shared.rank].host_hash;
        self.shared.peers.iter().filter(|p| p.host_hash == me).count()
    }

    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        Self::check_tag(tag).map_err(|e| e.during("bootstrap send"))?;
        self.check_peer(peer, "bootstrap send")?;
        self.send_any(peer, tag, data).map_err(|e| e.during(format!("bootstrap send (tag {tag})")).with_peer(peer))
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        Self::check_tag(tag).map_err(|e| e.during("bootstrap recv"))?;
        self.check_peer(peer, "bootstrap recv")?;
        let mut v = self.recv_many(&[peer], tag, &format!("bootstrap recv (tag {tag})"))?;
        v.pop().ok_or_else(|| Error::internal("recv_many returned nothing"))
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (me, n) = (self.shared.rank, self.shared.size);
        for p in (0..n).filter(|p| *p != me) {
            self.send_any(p, TAG_ALL_GATHER, data).map_err(|e| e.during("bootstrap all_gather").with_peer(p))?;
        }
        let others: Vec<usize> = (0..n).filter(|p| *p != me).collect();
        let mut got = self.recv_many(&others, TAG_ALL_GATHER, "bootstrap all_gather")?.into_iter();
        Ok((0..n).map(|p| if p == me { data.to_vec() } else { got.next().unwrap_or_default() }).collect())
    }

    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        self.check_peer(root, "bootstrap broadcast")?;
        if self.shared.rank == root {
            for p in (0..self.shared.size).filter(|p| *p != root) {
                self.send_any(p, super::TAG_BROADCAST, data)
                    .map_err(|e| e.during("bootstrap broadcast").with_peer(p))?;
            }
            Ok(data.to_vec())
        } else {
            let mut v = self.recv_many(&[root], super::TAG_BROADCAST, "bootstrap broadcast")?;
            v.pop().ok_or_else(|| Error::internal("recv_many returned nothing"))
        }
    }

    fn barrier(&self) -> Result<()> {
        let (me, n) = (self.shared.rank, self.shared.size);
        for p in (0..n).filter(|p| *p != me) {
            self.send_any(p, super::TAG_BARRIER, &[]).map_err(|e| e.during("bootstrap barrier").with_peer(p))?;
        }
        let others: Vec<usize> = (0..n).filter(|p| *p != me).collect();
        self.recv_many(&others, super::TAG_BARRIER, "bootstrap barrier").map(|_| ())
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.closing.store(true, Ordering::Release);
        for p in &sh.peers {
            if let Some(s) = lock(&p.out).take() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
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

impl Error {
    /// Whether the I/O cause of this error is a read timeout.
    fn source_is_timeout(&self) -> bool {
        use std::error::Error as _;
        self.source()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|e| matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
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
}
