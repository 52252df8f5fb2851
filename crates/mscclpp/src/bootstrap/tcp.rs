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
//!
//! The files: `unique_id` (the id and its forms), `root` (the rendezvous root and the rank's
//! talk with it), `links` (connections to peers, inboxes, failure reports), `schedule` (who
//! sends what to whom in each collective, without I/O) and `collectives` (the shells that run
//! those steps); this one holds [`TcpBootstrap`] itself: joining, settings, closing.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::info;

use super::links::{Inbox, Link, Peer, Shared, accept_loop};
use super::proto::{Hello, KIND_ROOT, RootStatus, frame_header};
use super::root::{
    PENDING_ROOTS, ROOT_BACKLOG, bind_on_default_interface, is_timeout, query_root, read_root_answer, root_gave_up,
};
use super::{Bootstrap, RESERVED_TAG_BASE, RootServer, TAG_GOODBYE, UniqueId};
use crate::error::{Error, ErrorKind, Result};
use crate::net::connect_retry;
use crate::sync::{Deadline, lock};
use crate::wire::{WireForm, length_prefixed, read_length_prefixed};

pub(super) const LOG: &str = "mscclpp::bootstrap";
/// The one-byte answer to a peer's good handshake.
pub(super) const ACK: u8 = 0x5a;
/// The longest a connection may take to present its handshake.
pub(super) const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// After a peer's listener refuses us, how long an incoming connection may still show up.
pub(super) const GONE_GRACE: Duration = Duration::from_millis(500);
/// Default wait limit.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A listening socket with a backlog of `backlog` (the kernel caps it at `somaxconn`), so a
/// burst of connections is queued rather than dropped or reset.
pub(super) fn listen_on(addr: SocketAddr, backlog: usize) -> Result<TcpListener> {
    let sock = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)
        .map_err(|e| Error::io(format!("creating a bootstrap socket for {addr}"), e))?;
    sock.bind(&addr.into()).map_err(|e| Error::io(format!("binding a bootstrap listener on {addr}"), e))?;
    sock.listen(backlog.clamp(128, i32::MAX as usize) as i32)
        .map_err(|e| Error::io(format!("listening on {addr}"), e))?;
    Ok(sock.into())
}

/// A fresh job secret from the OS.
pub(super) fn random_secret() -> Result<[u8; 16]> {
    let mut s = [0u8; 16];
    crate::identity::os_random(&mut s)?;
    Ok(s)
}

/// Reads a length-prefixed [`Hello`] of at most 256 bytes and checks it carries `secret`.
pub(super) fn read_hello(s: &mut TcpStream, secret: &[u8; 16]) -> Result<Hello> {
    let body = read_length_prefixed(s, 256, "the handshake")?;
    let h = Hello::from_wire(&body)?;
    if &h.secret != secret {
        return Err(Error::remote("wrong job secret"));
    }
    Ok(h)
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
    /// `Duration::MAX` (or any limit too far to be a point in time) means no limit;
    /// `Duration::ZERO` gives up at once where an answer is not already there.
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
    pub(super) shared: Arc<Shared>,
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

    /// Changes the wait limit of later calls (`Duration::MAX`: no limit).
    pub fn set_timeout(&self, t: Duration) {
        self.shared.timeout_ms.store(timeout_ms(t), Ordering::Relaxed);
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
        let deadline = Deadline::after_from(start, cfg.timeout);
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
            timeout_ms: AtomicU64::new(timeout_ms(cfg.timeout)),
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
        let ask_at = Deadline::after_from(start, cfg.timeout - margin);
        let first = read_root_answer(&mut rs, ask_at, secret, cfg.size);
        // The connection stays ours until the root says our answer goes to our listener.
        let mut held = Some(rs);
        let heard = match first {
            Ok(RootStatus::Joined) => {
                held = None;
                bs.shared.wait_root_answer(ask_at)
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

    pub(super) fn check_peer(&self, peer: usize, op: &str) -> Result<()> {
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

    /// The deadline of a call that starts now.
    pub(super) fn deadline(&self) -> Deadline {
        Deadline::after(self.timeout())
    }
}

/// A wait limit in whole milliseconds, as stored; `u64::MAX` stands for "no limit".
fn timeout_ms(t: Duration) -> u64 {
    u64::try_from(t.as_millis()).unwrap_or(u64::MAX)
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
        self.tcp_all_gather(data)
    }

    /// Up the binary tree rooted at rank 0 (along the root's ancestors) to rank 0, then down
    /// the tree: at most three tree peers per rank.
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        self.tcp_broadcast(root, data)
    }

    /// Arrivals up the binary tree rooted at rank 0, then the release down it: 2 log2(n) hops.
    fn barrier(&self) -> Result<()> {
        self.tcp_barrier()
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
