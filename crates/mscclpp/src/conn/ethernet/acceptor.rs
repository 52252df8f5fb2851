//! Accepting the peer's socket on an Ethernet endpoint (from the endpoint's creation on) and
//! dialling the peer's: the handshake that carries the endpoint's secret both ways.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, warn};

use super::LOG;
use super::wire::{HELLO_ACK_LEN, HELLO_LEN, Hello, HelloAck, Lane};
use crate::error::{Error, ErrorKind, Result};
use crate::net::StoppableListener;
use crate::sync::{Deadline, lock};
use crate::wire::{WireForm, length_prefixed, read_length_prefixed};

/// The peer's sockets accepted so far, by lane (a lane arrives once; a second socket of the same
/// lane is dropped).
#[derive(Default)]
struct Slots {
    shared: Option<TcpStream>,
    own: Option<TcpStream>,
    /// Lanes that have arrived (taken or not).
    arrived: [bool; 2],
    /// The accept thread has ended: handshakes still running deliver nothing.
    closed: bool,
}

impl Slots {
    fn index(lane: Lane) -> usize {
        match lane {
            Lane::Shared => 0,
            Lane::Own => 1,
        }
    }
    fn slot(&mut self, lane: Lane) -> &mut Option<TcpStream> {
        match lane {
            Lane::Shared => &mut self.shared,
            Lane::Own => &mut self.own,
        }
    }
}

/// What the accept thread and [`Acceptor::take`] share: the accepted sockets, as they arrive.
struct AcceptShared {
    slot: Mutex<Slots>,
    pub(super) cond: Condvar,
    pub(super) stop: AtomicBool,
}

/// Accepts the peer's sockets of an Ethernet endpoint (its own lane, and the shared lane when the
/// peer is the low side), from the endpoint's creation on.
pub(crate) struct Acceptor {
    addr: SocketAddr,
    shared: Arc<AcceptShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Acceptor {
    pub(crate) fn start(listener: TcpListener, secret: [u8; 16], context_id: u64) -> Result<Acceptor> {
        let addr = listener.local_addr().map_err(|e| Error::io("reading the listening address", e))?;
        let shared = Arc::new(AcceptShared {
            slot: Mutex::new(Slots::default()),
            cond: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("mscclpp-eth-accept".into())
            .spawn(move || accept_loop(listener, sh, secret, context_id))
            .map_err(|e| Error::io("starting the Ethernet accept thread", e))?;
        Ok(Acceptor { addr, shared, thread: Mutex::new(Some(thread)) })
    }

    /// Takes the peer's socket of `lane`, waiting until `deadline` (or until `stop` is set).
    pub(super) fn take(&self, lane: Lane, deadline: Deadline, stop: &AtomicBool) -> Result<TcpStream> {
        let mut g = lock(&self.shared.slot);
        loop {
            if let Some(s) = g.slot(lane).take() {
                return Ok(s);
            }
            if deadline.expired() {
                return Err(Error::new(ErrorKind::Timeout, "the peer did not connect back to this endpoint in time"));
            }
            if stop.load(Ordering::Acquire) {
                return Err(Error::new(ErrorKind::Aborted, "connection closed before the peer connected back"));
            }
            let wait = deadline.remaining().min(Duration::from_millis(50));
            g = self.shared.cond.wait_timeout(g, wait).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// The accept thread: a handshake thread per connection until both lanes have arrived (or
/// `stop`: the connection drops the acceptor once it has what it needs).
fn accept_loop(listener: TcpListener, sh: Arc<AcceptShared>, secret: [u8; 16], context_id: u64) {
    // Each handshake thread, a clone of its socket, and whether it delivered the socket.
    let mut handshakes: Vec<(JoinHandle<()>, Option<TcpStream>, Arc<AtomicBool>)> = Vec::new();
    let listener = StoppableListener::new(listener);
    let all_arrived = || lock(&sh.slot).arrived.iter().all(|a| *a);
    let stopped = || sh.stop.load(Ordering::Acquire) || all_arrived();
    while let Some(conn) = listener.next(stopped) {
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors or a transient error: do not spin.
                debug!(target: LOG, "accepting on {:?}: {e}", listener.local_addr().ok());
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if stopped() {
            break;
        }
        let sh2 = sh.clone();
        let ctl = s.try_clone().ok();
        let delivered = Arc::new(AtomicBool::new(false));
        let delivered2 = delivered.clone();
        let h = std::thread::Builder::new().name("mscclpp-eth-hs".into()).spawn(move || {
            let from = s.peer_addr().ok();
            match accept_handshake(s, &secret, context_id) {
                Ok((s, lane)) => {
                    let mut slots = lock(&sh2.slot);
                    let i = Slots::index(lane);
                    if !slots.arrived[i] && !slots.closed && !sh2.stop.load(Ordering::Acquire) {
                        slots.arrived[i] = true;
                        delivered2.store(true, Ordering::Relaxed);
                        *slots.slot(lane) = Some(s);
                        sh2.cond.notify_all();
                    } else {
                        warn!(target: LOG, "endpoint already connected; dropping a second peer connection ({lane:?} lane) from {from:?}");
                    }
                }
                Err(e) => warn!(target: LOG, "dropping connection from {from:?} that failed the handshake: {e}"),
            }
        });
        if let Ok(h) = h {
            handshakes.push((h, ctl, delivered));
        }
        if all_arrived() {
            break;
        }
    }
    // Handshakes still running (a stray or slow connection) are cut short rather than waited
    // for up to their read timeout: from now on they deliver nothing (decided under the lock
    // they deliver under), so shutting their sockets touches no delivered lane.
    let undelivered: Vec<TcpStream> = {
        let mut slots = lock(&sh.slot);
        slots.closed = true;
        handshakes.iter_mut().filter(|(_, _, d)| !d.load(Ordering::Relaxed)).filter_map(|(_, c, _)| c.take()).collect()
    };
    for c in &undelivered {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
    for (h, _, _) in handshakes {
        let _ = h.join();
    }
}

/// The acceptor's side of the handshake: the peer's hello must carry `secret`; the answer
/// carries this side's context id. Returns the socket and the lane the peer opened it for.
pub(super) fn accept_handshake(mut s: TcpStream, secret: &[u8; 16], context_id: u64) -> Result<(TcpStream, Lane)> {
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| Error::io("setting a read timeout", e))?;
    let body = read_length_prefixed(&mut s, HELLO_LEN, "the handshake")?;
    let hello = Hello::from_wire(&body)?;
    if &hello.secret != secret {
        return Err(Error::remote("wrong endpoint secret"));
    }
    s.write_all(&HelloAck { context: context_id }.to_wire()).map_err(|e| Error::io("answering the handshake", e))?;
    s.set_read_timeout(None).map_err(|e| Error::io("clearing the read timeout", e))?;
    let _ = s.set_nodelay(true);
    Ok((s, hello.lane))
}

/// Opens a socket of `lane` to the peer's endpoint and returns it with the peer's context id.
pub(super) fn dial(
    addr: SocketAddr,
    secret: &[u8; 16],
    my_context: u64,
    lane: Lane,
    deadline: Deadline,
) -> Result<(TcpStream, u64)> {
    let mut s = crate::net::connect_retry(addr, deadline, "the peer's Ethernet endpoint")?;
    let hello = Hello { secret: *secret, context: my_context, lane }.to_wire();
    s.write_all(&length_prefixed(&hello)).map_err(|e| Error::io("sending the handshake", e))?;
    s.set_read_timeout(Some(deadline.remaining_at_least(Duration::from_millis(10))))
        .map_err(|e| Error::io("setting a read timeout", e))?;
    let mut ack = [0u8; HELLO_ACK_LEN];
    s.read_exact(&mut ack).map_err(|e| {
        let why = match e.kind() {
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof => {
                "waiting for the peer's handshake answer (the peer closed its endpoint before answering: \
                 it dropped the connection, exited, or the endpoint was already used)"
            }
            _ => "waiting for the peer's handshake answer",
        };
        Error::io(why, e)
    })?;
    let ack = HelloAck::from_wire(&ack)?;
    s.set_read_timeout(None).map_err(|e| Error::io("clearing the read timeout", e))?;
    Ok((s, ack.context))
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// The accept thread ends on its stop flag alone, without the drop's self-connect (which can
    /// fail): it looks at the flag while no connection comes.
    #[test]
    fn accept_thread_stops_without_a_wake_up_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let acc = Acceptor::start(listener, [7; 16], 1).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        acc.shared.stop.store(true, Ordering::Release);
        let t = lock(&acc.thread).take().unwrap();
        let t0 = Instant::now();
        while !t.is_finished() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(t.is_finished(), "the accept thread ignored its stop flag");
        t.join().unwrap();
        // Dropping the acceptor now finds no thread to join (its self-connect goes unanswered).
        drop(acc);
    }

    /// A stray connection that never sends its handshake does not hold up the acceptor: both
    /// lanes are taken, and dropping the acceptor cuts the stray handshake short instead of
    /// waiting out its 10 s read timeout; the delivered lanes stay usable.
    #[test]
    fn a_stray_connection_does_not_delay_the_acceptor() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let secret = [7u8; 16];
        let acc = Acceptor::start(listener, secret, 1).unwrap();
        let _stray = TcpStream::connect(addr).unwrap();
        let deadline = Deadline::after(Duration::from_secs(5));
        let (mut own, _) = dial(addr, &secret, 2, Lane::Own, deadline).unwrap();
        let (_shared, _) = dial(addr, &secret, 2, Lane::Shared, deadline).unwrap();
        let stop = AtomicBool::new(false);
        let mut a = acc.take(Lane::Own, deadline, &stop).unwrap();
        let _b = acc.take(Lane::Shared, deadline, &stop).unwrap();
        let t0 = Instant::now();
        drop(acc);
        assert!(t0.elapsed() < Duration::from_secs(3), "dropping the acceptor took {:?}", t0.elapsed());
        // The delivered lane still carries bytes.
        own.write_all(b"ok").unwrap();
        let mut got = [0u8; 2];
        a.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ok");
    }
}
