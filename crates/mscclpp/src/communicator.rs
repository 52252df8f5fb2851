//! The communicator: setup-time exchange of memories, endpoints and semaphores over a bootstrap.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::bootstrap::{Bootstrap, COMM_TAG_BASE};
use crate::conn::Connection;
use crate::conn::endpoint::Endpoint;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::RegisteredMemory;
use crate::sync::lock;
use crate::transport::{EndpointConfig, TransportFlags};

/// Kind byte in front of every communicator message, so that calls paired out of order give a
/// clear error instead of decoding one object as another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum MsgKind {
    Memory = 1,
    Endpoint = 2,
    Semaphore = 3,
}

impl MsgKind {
    fn name(b: u8) -> &'static str {
        match b {
            1 => "a RegisteredMemory",
            2 => "an Endpoint",
            3 => "a semaphore",
            _ => "an unknown message",
        }
    }
}

/// Receives of one (peer, tag). The peer's messages on it arrive in one FIFO; each carries its
/// kind, and the receives of one kind take that kind's messages in issue order, whatever order
/// `wait` is called in. Messages read for another kind wait in `stash` for their receive.
#[derive(Default)]
struct RecvChain {
    /// Per kind: the sequence number the next `Pending` of that kind gets.
    issued: HashMap<u8, u64>,
    /// Per kind: how many messages of that kind have been taken from the bootstrap.
    received: HashMap<u8, u64>,
    /// Messages received, by (kind, sequence), for pendings that have not waited yet.
    stash: HashMap<(u8, u64), Vec<u8>>,
}

type Chain = Arc<Mutex<RecvChain>>;
/// Builds the received object from the message body.
type Finish<T> = Box<dyn FnOnce(&[u8]) -> Result<T> + Send>;

struct CommInner {
    bootstrap: Arc<dyn Bootstrap>,
    context: Context,
    chains: Mutex<HashMap<(usize, u32), Chain>>,
}

/// A receive that resolves later: call [`wait`](Pending::wait).
///
/// Sends go out at once and receives resolve later, so every rank can issue all its sends and
/// receives for an all-pairs setup before waiting on any, without deadlock (MSCCL++'s rule).
/// Pendings of one kind on one (peer, tag) take the peer's messages of that kind in the order
/// the pendings were created, whatever order they are waited in (see [`Communicator`] for the
/// pairing rules).
#[must_use = "a Pending does nothing until waited on"]
pub struct Pending<T> {
    comm: Arc<CommInner>,
    chain: Arc<Mutex<RecvChain>>,
    seq: u64,
    peer: usize,
    tag: u32,
    kind: MsgKind,
    finish: Finish<T>,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pending({:?} from rank {} tag {} #{})", self.kind, self.peer, self.tag, self.seq)
    }
}

impl<T> Pending<T> {
    /// Receives (within the bootstrap's timeout) and builds the object.
    ///
    /// # Errors
    /// The bootstrap's error (timeout, peer gone), a message that is not the Communicator's, or
    /// the object's own construction error.
    pub fn wait(self) -> Result<T> {
        let what = format!("waiting for {} from rank {} (tag {})", MsgKind::name(self.kind as u8), self.peer, self.tag);
        let kind = self.kind as u8;
        let bytes = {
            let mut ch = lock(&self.chain);
            loop {
                if let Some(b) = ch.stash.remove(&(kind, self.seq)) {
                    break b;
                }
                let m = self
                    .comm
                    .bootstrap
                    .recv(self.peer, COMM_TAG_BASE + u64::from(self.tag))
                    .map_err(|e| e.during(what.clone()).with_peer(self.peer))?;
                let k = match m.first() {
                    Some(&k) if (MsgKind::Memory as u8..=MsgKind::Semaphore as u8).contains(&k) => k,
                    other => {
                        return Err(Error::invalid_usage(format!(
                            "got {} from the peer: not a message of the Communicator",
                            other.map_or("an empty message".to_string(), |k| format!("a message of kind {k}"))
                        ))
                        .during(what)
                        .with_peer(self.peer));
                    }
                };
                let n = ch.received.entry(k).or_default();
                let seq = *n;
                *n += 1;
                ch.stash.insert((k, seq), m);
            }
        };
        (self.finish)(&bytes[1..]).map_err(|e| e.during(what).with_peer(self.peer))
    }
}

/// Setup of a job's connections: registers memory, and exchanges memories, endpoints and
/// semaphores with peers over a [`Bootstrap`].
///
/// # How sends and receives pair up
/// Three kinds of object travel between two ranks: memories ([`send_memory`](Self::send_memory)
/// on one side, [`recv_memory`](Self::recv_memory) on the other), endpoints (both sides call
/// [`connect`](Self::connect), which sends one and receives one) and semaphores (both sides call
/// `build_semaphore` on the connection). For one peer and one tag:
/// * each kind pairs up on its own: the *n*-th memory that rank A sends to B on tag *t* is what
///   B's *n*-th `recv_memory(A, t)` returns, and likewise for endpoints and semaphores;
/// * the kinds do not pair with each other, so their calls may come in any order: one rank may
///   `send_memory` then `connect` while the other calls `connect` then `recv_memory`;
/// * different tags (or peers) are independent streams; use distinct tags to tell apart two
///   memories or two connections to the same peer without relying on call order.
///
/// Sends go out at once; receives return a [`Pending`] resolved by [`Pending::wait`], so a rank
/// can issue every send and receive of an all-pairs setup before waiting on any. A receive with
/// no matching send times out after the bootstrap's timeout with an error naming the peer, the
/// tag and the kind it waited for.
///
/// C++ MSCCL++: `Communicator`.
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<CommInner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.inner.bootstrap.rank(), self.inner.bootstrap.size())
    }
}

impl Communicator {
    /// A communicator over `bootstrap` with a new [`Context`].
    pub fn new(bootstrap: Arc<dyn Bootstrap>) -> Communicator {
        Self::with_context(bootstrap, Context::new())
    }

    /// A communicator over `bootstrap` sharing `context`.
    pub fn with_context(bootstrap: Arc<dyn Bootstrap>, context: Context) -> Communicator {
        Communicator { inner: Arc::new(CommInner { bootstrap, context, chains: Mutex::new(HashMap::new()) }) }
    }

    /// The bootstrap.
    pub fn bootstrap(&self) -> &Arc<dyn Bootstrap> {
        &self.inner.bootstrap
    }

    /// A setup step's outcome shared with every rank ([`Bootstrap::all_gather_ready`]): this
    /// rank's `data(&value)`, or its error's text. This rank's own error comes back unchanged;
    /// otherwise another rank's failure, naming it (an [`Error`] converted into `E`); otherwise
    /// this rank's value and every rank's data, by rank. Every rank calls it, failed or not.
    pub fn all_gather_outcome<T, E>(
        &self,
        mine: std::result::Result<T, E>,
        data: impl FnOnce(&T) -> Vec<u8>,
        step: &str,
    ) -> std::result::Result<(T, Vec<Vec<u8>>), E>
    where
        E: From<Error> + std::fmt::Display,
    {
        let report = match &mine {
            Ok(v) => Ok(data(v)),
            Err(e) => Err(e.to_string()),
        };
        let all = self.bootstrap().all_gather_ready(
            match &report {
                Ok(d) => Ok(d.as_slice()),
                Err(w) => Err(w.as_str()),
            },
            step,
        );
        let value = mine?;
        Ok((value, all?))
    }
    /// The context.
    pub fn context(&self) -> &Context {
        &self.inner.context
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.bootstrap.rank()
    }
    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.inner.bootstrap.size()
    }

    /// Allocates and registers an owned host buffer (see [`Buffer::new`](crate::Buffer::new)).
    pub fn register_buffer(&self, len: usize, transports: TransportFlags) -> Result<crate::Buffer> {
        crate::Buffer::new(&self.inner.context, len, transports)
    }

    /// Registers caller-owned host memory; see [`Context::register_host`] for the rules.
    ///
    /// # Safety
    /// As for [`Context::register_host`].
    #[allow(unsafe_code)]
    pub unsafe fn register_memory(
        &self,
        ptr: *mut u8,
        len: usize,
        transports: TransportFlags,
    ) -> Result<RegisteredMemory> {
        // SAFETY: forwarded verbatim; the caller upholds register_host's contract.
        unsafe { self.inner.context.register_host(ptr, len, transports) }
    }

    pub(crate) fn send_msg(&self, peer: usize, tag: u32, kind: MsgKind, body: &[u8]) -> Result<()> {
        let mut m = Vec::with_capacity(1 + body.len());
        m.push(kind as u8);
        m.extend_from_slice(body);
        self.inner.bootstrap.send(peer, COMM_TAG_BASE + u64::from(tag), &m)
    }

    pub(crate) fn pending<T>(
        &self,
        peer: usize,
        tag: u32,
        kind: MsgKind,
        finish: impl FnOnce(&[u8]) -> Result<T> + Send + 'static,
    ) -> Result<Pending<T>> {
        if peer >= self.size() {
            return Err(Error::invalid_usage(format!("peer rank {peer} is not in 0..{}", self.size())));
        }
        let chain = lock(&self.inner.chains).entry((peer, tag)).or_default().clone();
        let seq = {
            let mut c = lock(&chain);
            let n = c.issued.entry(kind as u8).or_default();
            *n += 1;
            *n - 1
        };
        Ok(Pending { comm: self.inner.clone(), chain, seq, peer, tag, kind, finish: Box::new(finish) })
    }

    /// Sends `memory`'s description to `peer` under `tag` (at once).
    ///
    /// C++ MSCCL++: `Communicator::sendMemory`.
    pub fn send_memory(&self, memory: &RegisteredMemory, peer: usize, tag: u32) -> Result<()> {
        self.send_msg(peer, tag, MsgKind::Memory, &memory.serialize())
            .map_err(|e| e.during(format!("send_memory to rank {peer} (tag {tag})")))
    }

    /// Creates a local endpoint from `config`, sends it to `peer` at once, and returns a pending
    /// connection: [`Pending::wait`] receives the peer's endpoint and connects.
    ///
    /// C++ MSCCL++: `Communicator::connect`.
    pub fn connect(&self, config: &EndpointConfig, peer: usize, tag: u32) -> Result<Pending<Connection>> {
        let op = format!("connect to rank {peer} (tag {tag})");
        let local = self.inner.context.create_endpoint(config).map_err(|e| e.during(op.clone()))?;
        self.send_msg(peer, tag, MsgKind::Endpoint, &local.serialize()).map_err(|e| e.during(op.clone()))?;
        let ctx = self.inner.context.clone();
        self.pending(peer, tag, MsgKind::Endpoint, move |b| {
            let remote = Endpoint::deserialize(b)?;
            ctx.connect_with_peer(&local, &remote, Some(peer))
        })
    }

    /// Receives a memory description from `peer` under `tag`, resolved by [`Pending::wait`].
    ///
    /// C++ MSCCL++: `Communicator::recvMemory`.
    pub fn recv_memory(&self, peer: usize, tag: u32) -> Result<Pending<RegisteredMemory>> {
        self.pending(peer, tag, MsgKind::Memory, RegisteredMemory::deserialize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Buffer, TcpBootstrap, Transport};
    use std::time::Duration;

    #[test]
    fn self_exchange_resolves_in_issue_order() {
        let id = TcpBootstrap::create_unique_id().unwrap();
        let bs = TcpBootstrap::config(0, 1).timeout(Duration::from_secs(5)).initialize(&id).unwrap();
        let comm = Communicator::new(Arc::new(bs));
        let a = Buffer::new(comm.context(), 16, Transport::Ethernet.into()).unwrap();
        let b = Buffer::new(comm.context(), 32, Transport::Ethernet.into()).unwrap();
        let pa = comm.recv_memory(0, 0).unwrap();
        let pb = comm.recv_memory(0, 0).unwrap();
        comm.send_memory(a.memory(), 0, 0).unwrap();
        comm.send_memory(b.memory(), 0, 0).unwrap();
        // wait out of order: each still gets its own message
        assert_eq!(&pb.wait().unwrap(), b.memory());
        assert_eq!(&pa.wait().unwrap(), a.memory());
        // kinds pair up on their own: a memory received while an endpoint message came first
        comm.send_msg(0, 1, MsgKind::Endpoint, b"endpoint").unwrap();
        comm.send_memory(a.memory(), 0, 1).unwrap();
        assert_eq!(&comm.recv_memory(0, 1).unwrap().wait().unwrap(), a.memory());
        // the endpoint message stayed for the endpoint receive
        let ep = comm.pending(0, 1, MsgKind::Endpoint, |b| Ok(b.to_vec())).unwrap();
        assert_eq!(ep.wait().unwrap(), b"endpoint");
        // a message that is not the Communicator's is a clear error
        comm.inner.bootstrap.send(0, COMM_TAG_BASE + 2, &[9, 9]).unwrap();
        let err = comm.recv_memory(0, 2).unwrap().wait().unwrap_err();
        assert!(err.to_string().contains("not a message of the Communicator"), "{err}");
        assert!(comm.recv_memory(3, 0).is_err());
    }
}
