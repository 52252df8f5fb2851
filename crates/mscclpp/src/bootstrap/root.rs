//! The root of the rendezvous: [`RootServer`] and the root's I/O shell around the state machine
//! in `rendezvous`, with the rank's side of talking to the root (reading its answers, asking it
//! who is missing).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::UniqueId;
use super::proto::{Hello, KIND_ANSWER, KIND_QUERY, KIND_ROOT, RootAnswer, RootStatus};
use super::rendezvous::{Join, Rendezvous, Reply, To};
use super::tcp::{HANDSHAKE_LIMIT, LOG, listen_on, random_secret, read_hello};
use crate::error::{Error, ErrorKind, Result};
use crate::net::StoppableListener;
use crate::sync::{Deadline, lock};
use crate::wire::{WireForm, length_prefixed, read_length_prefixed};

/// Listeners bound by `create_unique_id`, waiting for rank 0 of the same process to take them
/// (MSCCL++ closes the socket and binds again, leaving a window for another process).
pub(super) static PENDING_ROOTS: Mutex<Vec<(SocketAddr, TcpListener)>> = Mutex::new(Vec::new());

/// The root's backlog: it is bound before the job size is known, so room for a large job.
pub(super) const ROOT_BACKLOG: usize = 65535;

pub(super) fn bind_on_default_interface() -> Result<TcpListener> {
    let ip = crate::net::find_interfaces()?[0].addr;
    listen_on(SocketAddr::new(ip, 0), ROOT_BACKLOG).map_err(|e| e.during("binding the bootstrap root"))
}

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
    /// `Duration::MAX` (or any timeout too far to be a point in time) means no limit: the root
    /// waits until every rank has joined.
    pub fn start(size: usize, timeout: Duration) -> Result<(RootServer, UniqueId)> {
        let listener = bind_on_default_interface()?;
        let secret = random_secret()?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the root address", e))?;
        let id = UniqueId { root: addr, secret, external_root: true };
        let server = RootServer::spawn(listener, size, secret, timeout)?;
        Ok((server, id))
    }

    pub(super) fn spawn(listener: TcpListener, size: usize, secret: [u8; 16], timeout: Duration) -> Result<RootServer> {
        let addr = listener.local_addr().map_err(|e| Error::io("reading the root address", e))?;
        let deadline = Deadline::after(timeout);
        let thread = std::thread::Builder::new()
            .name("mscclpp-bs-root".into())
            .spawn(move || run_root(listener, size, secret, deadline))
            .map_err(|e| Error::io("starting the bootstrap root thread", e))?;
        Ok(RootServer { addr, thread: Some(thread) })
    }

    /// Binds a root now and returns its id, to be served once the job size is known
    /// ([`ReservedRoot::serve`]): for an id that must be handed out before the size is known,
    /// such as the one a communicator hands out before it grows. Ranks that join before the
    /// root serves wait in its listen backlog (within their own timeout). As with
    /// [`start`](Self::start), rank 0 does not host this root.
    ///
    /// ```
    /// use std::time::Duration;
    /// use mscclpp::{Bootstrap, RootServer, TcpBootstrap};
    /// # fn main() -> mscclpp::Result<()> {
    /// let (reserved, id) = RootServer::reserve()?;
    /// // The id can travel now; rank 1 may even start joining.
    /// let id1 = id.clone();
    /// let peer = std::thread::spawn(move || -> mscclpp::Result<usize> {
    ///     Ok(TcpBootstrap::initialize(1, 2, &id1)?.all_gather(&[1])?.len())
    /// });
    /// // Later, once the job size is known:
    /// let root = reserved.serve(2, Duration::from_secs(10))?;
    /// let bs = TcpBootstrap::initialize(0, 2, &id)?;
    /// assert_eq!(bs.all_gather(&[0])?.len(), 2);
    /// assert!(matches!(peer.join(), Ok(Ok(2))));
    /// root.join();
    /// # Ok(()) }
    /// ```
    pub fn reserve() -> Result<(ReservedRoot, UniqueId)> {
        let listener = bind_on_default_interface()?;
        let secret = random_secret()?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the root address", e))?;
        let id = UniqueId { root: addr, secret, external_root: true };
        Ok((ReservedRoot { listener, id: id.clone() }, id))
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

/// A bootstrap root bound by [`RootServer::reserve`] and not yet serving.
#[derive(Debug)]
pub struct ReservedRoot {
    listener: TcpListener,
    id: UniqueId,
}

impl ReservedRoot {
    /// The id ranks join with.
    pub fn id(&self) -> &UniqueId {
        &self.id
    }

    /// Starts serving a job of `size` ranks, waiting at most `timeout` for them (as
    /// [`RootServer::start`]).
    pub fn serve(self, size: usize, timeout: Duration) -> Result<RootServer> {
        if size == 0 {
            return Err(Error::invalid_usage("a bootstrap root for 0 ranks"));
        }
        RootServer::spawn(self.listener, size, self.id.secret, timeout)
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
fn run_root(listener: TcpListener, size: usize, secret: [u8; 16], deadline: Deadline) {
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
    let mut rv = Rendezvous::new(secret, size, deadline.instant());
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
        // (At most 1 s at a time: the wait also paces the loop should the acceptor be gone.)
        let wait = if rv.is_finished() {
            Duration::from_millis(20)
        } else {
            rv.next_wakeup()
                .map_or(Duration::MAX, |d| d.saturating_duration_since(now))
                .clamp(Duration::from_millis(1), Duration::from_secs(1))
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
pub(super) fn read_root_answer(
    s: &mut TcpStream,
    deadline: Deadline,
    secret: [u8; 16],
    size: usize,
) -> Result<RootStatus> {
    let left = deadline.remaining_at_least(Duration::from_millis(1));
    let _ = s.set_read_timeout(Some(left));
    let frame = read_length_prefixed(s, root_answer_limit(size), "the bootstrap root's answer")?;
    let answer = RootAnswer::from_wire(&frame)?;
    if answer.secret != secret {
        return Err(Error::remote("the root's answer does not carry the job secret"));
    }
    Ok(answer.status)
}

/// Asks the root which ranks are still missing (or for the outcome, once there is one).
pub(super) fn query_root(
    root: SocketAddr,
    secret: [u8; 16],
    rank: usize,
    size: usize,
    deadline: Deadline,
) -> Result<RootStatus> {
    let left = deadline.remaining_at_least(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&root, left).map_err(|e| Error::io("connecting to the root", e))?;
    let hello = Hello { kind: KIND_QUERY, secret, rank: rank as u32, size: size as u32, listen: None };
    s.write_all(&length_prefixed(&hello.to_wire())).map_err(|e| Error::io("asking the root", e))?;
    read_root_answer(&mut s, deadline, secret, size)
}

/// Whether the I/O cause of `e` is a read timeout.
pub(super) fn is_timeout(e: &Error) -> bool {
    use std::error::Error as _;
    e.source()
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|e| matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// The rank's error for the root's failure answer.
pub(super) fn root_gave_up(timeout: bool, message: &str) -> Error {
    let kind = if timeout { ErrorKind::Timeout } else { ErrorKind::Remote };
    Error::new(kind, format!("the root gave up: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{Bootstrap, TcpBootstrap};

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
            let deadline = Deadline::after(Duration::from_secs(5));
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
