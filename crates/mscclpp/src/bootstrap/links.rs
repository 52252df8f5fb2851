//! A rank's links to its peers: at most one TCP connection per ordered pair of ranks (made on
//! first send), a reader thread per incoming connection filing messages by tag into the peer's
//! inbox, liveness probes, and the flood of failure reports (abort notices) along the
//! collectives' links.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::proto::{AbortNotice, FrameReader, Hello, KIND_ANSWER, KIND_PEER, RootStatus, frame_header};
use super::root::read_root_answer;
use super::schedule::neighbours;
use super::tcp::{ACK, GONE_GRACE, HANDSHAKE_LIMIT, LOG, read_hello};
use super::{TAG_ABORT, TAG_GOODBYE};
use crate::error::{Error, ErrorKind, Result};
use crate::net::StoppableListener;
use crate::sync::{Deadline, lock};
use crate::wire::{WireForm, length_prefixed};

/// The state of the connection a peer opened to us.
#[derive(Debug)]
pub(super) enum Link {
    /// No connection from this peer yet.
    None,
    /// A reader thread is filing its messages.
    Open,
    /// The peer's connection ended; the reason.
    Closed(String),
}

/// What has come from one peer: messages by tag, and the state of its links.
pub(super) struct Inbox {
    pub(super) queues: HashMap<u64, VecDeque<Vec<u8>>>,
    pub(super) incoming: Link,
    /// When our connection to the peer was found closed or refused.
    pub(super) out_gone: Option<Instant>,
}

/// One peer: our connection to it (made on first send) and its inbox.
pub(super) struct Peer {
    pub(super) out: Mutex<Option<TcpStream>>,
    pub(super) inbox: Mutex<Inbox>,
    pub(super) cond: Condvar,
}

/// A rank's state, shared by its calls, its accept thread and its reader threads.
pub(super) struct Shared {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) secret: [u8; 16],
    /// The wait limit in milliseconds (`u64::MAX`: no limit).
    pub(super) timeout_ms: AtomicU64,
    pub(super) listen_addr: SocketAddr,
    /// Every rank's listening address and host hash, once the root's table arrived.
    pub(super) table: OnceLock<Vec<(SocketAddr, u64)>>,
    /// The root's final answer, delivered to our listener.
    pub(super) root_answer: Mutex<Option<RootStatus>>,
    pub(super) root_cond: Condvar,
    pub(super) peers: Vec<Peer>,
    pub(super) closing: AtomicBool,
    /// The first failure of another rank this rank heard of; collectives fail with it.
    pub(super) abort: Mutex<Option<AbortNotice>>,
    /// The thread telling the neighbours of `abort` (joined before closing, so the news leaves
    /// before our goodbye).
    pub(super) flood: Mutex<Option<JoinHandle<()>>>,
    /// Incoming streams (to shut down on close) and their reader threads.
    pub(super) readers: Mutex<Vec<(Option<TcpStream>, JoinHandle<()>)>>,
}

impl Shared {
    /// Waits until `until` for the root's final answer.
    pub(super) fn wait_root_answer(&self, until: Deadline) -> Option<RootStatus> {
        let mut a = lock(&self.root_answer);
        loop {
            if let Some(s) = a.take() {
                return Some(s);
            }
            if until.expired() {
                return None;
            }
            a = self
                .root_cond
                .wait_timeout(a, until.remaining().min(Duration::from_secs(1)))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// The wait limit of a call (`Duration::MAX`: none).
    pub(super) fn timeout(&self) -> Duration {
        match self.timeout_ms.load(Ordering::Relaxed) {
            u64::MAX => Duration::MAX,
            ms => Duration::from_millis(ms),
        }
    }

    /// The error every collective returns once another rank's failure is known.
    pub(super) fn abort_error(&self, what: &str) -> Option<Error> {
        lock(&self.abort).as_ref().map(|a| {
            Error::remote(format!("rank {} failed (seen by rank {}: {})", a.failed, a.reporter, a.reason))
                .during(what.to_string())
                .with_peer(a.failed as usize)
        })
    }

    /// Sends one message to `peer` (connecting first if need be), within the wait limit.
    pub(super) fn send_any(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let timeout = self.timeout();
        self.send_until(peer, tag, data, Deadline::after(timeout), timeout)
    }

    /// Sends one message to `peer`, connecting by `deadline`; each write may block for
    /// `write_limit` (a peer that reads nothing for that long fails the send).
    fn send_until(&self, peer: usize, tag: u64, data: &[u8], deadline: Deadline, write_limit: Duration) -> Result<()> {
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

    fn connect_peer(&self, peer: usize, deadline: Deadline) -> Result<TcpStream> {
        let p = &self.peers[peer];
        let addr = self
            .table
            .get()
            .and_then(|t| t.get(peer))
            .map(|(a, _)| *a)
            .ok_or_else(|| Error::internal(format!("no address for rank {peer} before the root's table")))?;
        let mut s = match TcpStream::connect_timeout(&addr, deadline.remaining_at_least(Duration::from_millis(1))) {
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
        let _ = s.set_read_timeout(Some(deadline.remaining_at_least(Duration::from_millis(1))));
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
            match self.connect_peer(peer, Deadline::after(Duration::from_secs(2))) {
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
    pub(super) fn recv_many(
        self: &Arc<Self>,
        peers: &[usize],
        tag: u64,
        deadline: Deadline,
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
            if deadline.expired() {
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
                let wait = deadline.remaining().min(Duration::from_millis(50));
                let _ = peer.cond.wait_timeout(inbox, wait);
            }
        }
    }
}

/// Records the first failure this rank hears of, wakes every wait, and tells the collectives'
/// neighbours (except the failed rank and the reporter) on a thread of its own, so the news
/// floods the ring and the tree: every rank learns who failed, not only that a neighbour went
/// silent. The ring and the tree together stay connected without any one rank.
pub(super) fn raise_abort(sh: &Arc<Shared>, notice: AbortNotice) {
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
                if let Err(e) = sh.send_until(nb, TAG_ABORT, &body, Deadline::after(limit), limit) {
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

/// The accept thread of a rank's listener: a reader thread per incoming connection.
pub(super) fn accept_loop(sh: Arc<Shared>, listener: TcpListener) {
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
        match read_root_answer(&mut s, Deadline::after(HANDSHAKE_LIMIT), sh.secret, sh.size) {
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
