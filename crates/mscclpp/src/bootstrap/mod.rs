//! Rendezvous and small control messages between ranks.
//!
//! [`Bootstrap`] is the interface the rest of the crate uses (bring your own over MPI if you
//! like); [`TcpBootstrap`] is the built-in implementation over TCP.
//!
//! # Files
//! * `schedule`: who sends what to whom in each collective (tree gather, tree broadcast, ring
//!   gather, failure neighbours), with no I/O; `collectives`: the shells that run those steps
//!   over a `send` and a `recv` (the trait's defaults here, [`TcpBootstrap`]'s links there).
//! * `proto`: the wire forms and message framing; `rendezvous`: the root's state machine.
//! * `unique_id`: [`UniqueId`]; `root`: [`RootServer`] and the rank's talk with the root;
//!   `links`: a rank's connections, inboxes and failure reports; `tcp`: [`TcpBootstrap`].

mod collectives;
mod links;
pub(crate) mod proto;
mod rendezvous;
mod root;
mod schedule;
mod tcp;
mod unique_id;

pub use root::{ReservedRoot, RootServer};
pub use tcp::{TcpBootstrap, TcpBootstrapConfig};
pub use unique_id::UniqueId;
#[cfg(feature = "fuzzing")]
pub(crate) use unique_id::{check_padded, check_text};

use crate::error::{Error, Result};

/// Tags at or above this value are reserved for the library's own messages.
pub const RESERVED_TAG_BASE: u64 = 1 << 63;
pub(crate) const TAG_ALL_GATHER: u64 = u64::MAX;
pub(crate) const TAG_BARRIER: u64 = u64::MAX - 1;
pub(crate) const TAG_BROADCAST: u64 = u64::MAX - 2;
/// A rank's report that another rank failed (`proto::AbortNotice`), flooded over the collectives' links.
pub(crate) const TAG_ABORT: u64 = u64::MAX - 3;
/// The last frame on a connection whose owner closes its bootstrap on purpose.
pub(crate) const TAG_GOODBYE: u64 = u64::MAX - 4;
/// `all_gather` pieces passed around the ring (large gathers).
pub(crate) const TAG_ALL_GATHER_RING: u64 = u64::MAX - 5;
/// Base of the tags the [`Communicator`](crate::Communicator) uses: `COMM_TAG_BASE + user tag`.
pub(crate) const COMM_TAG_BASE: u64 = 1 << 62;

/// Message passing between the ranks of one job, used to exchange endpoints, memories and
/// semaphores at setup.
///
/// Guarantees: messages between two ranks with the same tag arrive in the order sent; messages
/// with different tags are independent (receive them in any order); `send` does not wait for the
/// matching `recv`.
///
/// C++ MSCCL++: `Bootstrap`.
pub trait Bootstrap: Send + Sync {
    /// This process's rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// The number of ranks on this rank's host.
    fn ranks_per_node(&self) -> usize;
    /// Sends `data` to `peer` under `tag` (below [`RESERVED_TAG_BASE`] for user messages).
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Receives the next message from `peer` under `tag`.
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>>;

    /// Every rank's `data`, indexed by rank.
    ///
    /// The default runs on the binary tree rooted at rank 0 over [`send`](Self::send) and
    /// [`recv`](Self::recv): each rank sends its subtree's pieces to its parent, rank 0 sends
    /// the whole table down, so a rank talks to at most three peers (2 log2 n hops) and an
    /// implementation whose `send` connects on demand opens a bounded number of connections.
    /// [`TcpBootstrap`] overrides it with the same tree plus a ring for large gathers and
    /// failure reports that name the failed rank on every rank.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let what = "bootstrap all_gather";
        collectives::gather_on_tree(
            self.rank(),
            self.size(),
            data,
            usize::MAX,
            what,
            |p, d| self.send(p, TAG_ALL_GATHER, d),
            |p| self.recv(p, TAG_ALL_GATHER),
        )?
        .ok_or_else(|| Error::internal("a tree all_gather without a size limit overflowed").during(what))
    }

    /// [`all_gather`](Self::all_gather) for a step of a collective setup where a rank may be
    /// unable to go on: each rank gives `Ok(data)` or `Err(reason)`. Without a failure, every
    /// rank's data by rank; with one, on every rank (the failing ones too), an error naming the
    /// first failing rank (its [`peer`](crate::Error::peer)), the step and the reason, so that
    /// no rank is left waiting for a peer that gave up until a timeout. A failing rank usually
    /// returns its own, more precise error instead (it still has to call this: the others wait
    /// for its part).
    ///
    /// ```
    /// # use mscclpp::{Bootstrap, RootServer, TcpBootstrap};
    /// # use std::time::Duration;
    /// let (root, id) = RootServer::start(2, Duration::from_secs(10))?;
    /// let errs: Vec<String> = std::thread::scope(|s| {
    ///     let hs: Vec<_> = (0..2)
    ///         .map(|rank| {
    ///             let id = id.clone();
    ///             s.spawn(move || {
    ///                 let bs = TcpBootstrap::config(rank, 2).initialize(&id).unwrap();
    ///                 let mine: Result<&[u8], &str> = if rank == 1 { Err("no GPU") } else { Ok(b"ready") };
    ///                 bs.all_gather_ready(mine, "opening the plan").unwrap_err().to_string()
    ///             })
    ///         })
    ///         .collect();
    ///     hs.into_iter().map(|h| h.join().unwrap()).collect()
    /// });
    /// assert!(errs[0].contains("rank 1") && errs[0].contains("no GPU"));
    /// drop(root);
    /// # Ok::<(), mscclpp::Error>(())
    /// ```
    fn all_gather_ready(&self, mine: std::result::Result<&[u8], &str>, step: &str) -> Result<Vec<Vec<u8>>> {
        let all = self.all_gather(&readiness::encode(mine)).map_err(|e| e.during(step.to_string()))?;
        let mut out = Vec::with_capacity(all.len());
        for (r, m) in all.into_iter().enumerate() {
            match readiness::decode(&m) {
                Some(Ok(d)) => out.push(d.to_vec()),
                Some(Err(why)) => {
                    return Err(Error::remote(format!("rank {r} cannot go on ({step}): {why}")).with_peer(r));
                }
                None => {
                    return Err(
                        Error::remote(format!("rank {r} sent a malformed readiness report ({step})")).with_peer(r)
                    );
                }
            }
        }
        Ok(out)
    }

    /// `root`'s `data`, on every rank (other ranks' `data` is ignored).
    ///
    /// The default climbs from `root` to rank 0 along the binary tree, then goes down it: at
    /// most three peers per rank.
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.size() {
            return Err(Error::invalid_usage(format!("broadcast root {root} is not a rank of {}", self.size())));
        }
        collectives::broadcast_on_tree(
            self.rank(),
            self.size(),
            root,
            data,
            |p, d| self.send(p, TAG_BROADCAST, d),
            |p| self.recv(p, TAG_BROADCAST),
        )
    }

    /// Returns once every rank has called `barrier`.
    ///
    /// The default gathers arrivals up the binary tree rooted at rank 0 and sends the release
    /// down it: at most three peers per rank.
    fn barrier(&self) -> Result<()> {
        collectives::barrier_on_tree(
            self.rank(),
            self.size(),
            |p| self.send(p, TAG_BARRIER, &[]),
            |ps| ps.iter().try_for_each(|&p| self.recv(p, TAG_BARRIER).map(drop)),
        )
    }
}

/// The message of [`Bootstrap::all_gather_ready`]: a flag byte (0 ready, 1 cannot go on), then
/// the data or the reason (UTF-8, read leniently).
pub(crate) mod readiness {
    use std::borrow::Cow;

    pub(crate) fn encode(mine: std::result::Result<&[u8], &str>) -> Vec<u8> {
        let (flag, body) = match mine {
            Ok(d) => (0u8, d),
            Err(why) => (1u8, why.as_bytes()),
        };
        let mut msg = Vec::with_capacity(1 + body.len());
        msg.push(flag);
        msg.extend_from_slice(body);
        msg
    }

    /// `None` for a message that is neither (empty, or another flag).
    pub(crate) fn decode(msg: &[u8]) -> Option<std::result::Result<&[u8], Cow<'_, str>>> {
        match msg.split_first() {
            Some((0, d)) => Some(Ok(d)),
            Some((1, why)) => Some(Err(String::from_utf8_lossy(why))),
            _ => None,
        }
    }

    /// The fuzz check: decoding never panics, and what decodes (a reason: when it is UTF-8)
    /// encodes back to the same bytes.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn check(msg: &[u8]) {
        match decode(msg) {
            Some(Ok(d)) => assert_eq!(encode(Ok(d)), msg),
            Some(Err(Cow::Borrowed(why))) => assert_eq!(encode(Err(why)), msg),
            Some(Err(Cow::Owned(_))) | None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::schedule::{tree_children, tree_parent};
    use super::*;
    use std::collections::{BTreeSet, HashMap, VecDeque};
    use std::sync::{Arc, Condvar, Mutex};

    /// Messages in flight, keyed by (from, to, tag).
    type Mailboxes = HashMap<(usize, usize, u64), VecDeque<Vec<u8>>>;

    /// An in-memory job: mailboxes; each rank records whom it sent to.
    struct Mem {
        boxes: Mutex<Mailboxes>,
        cond: Condvar,
        sent_to: Vec<Mutex<BTreeSet<usize>>>,
    }

    impl Mem {
        /// A job of `n` ranks with empty mailboxes.
        fn job(n: usize) -> Arc<Mem> {
            Arc::new(Mem {
                boxes: Mutex::new(HashMap::new()),
                cond: Condvar::new(),
                sent_to: (0..n).map(|_| Mutex::new(BTreeSet::new())).collect(),
            })
        }
    }

    /// One rank of a [`Mem`] job, with only the required methods: the collectives are the
    /// trait's defaults.
    struct MemRank {
        rank: usize,
        job: Arc<Mem>,
    }

    impl Bootstrap for MemRank {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.job.sent_to.len()
        }
        fn ranks_per_node(&self) -> usize {
            self.size()
        }
        fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
            self.job.sent_to[self.rank].lock().unwrap().insert(peer);
            self.job.boxes.lock().unwrap().entry((self.rank, peer, tag)).or_default().push_back(data.to_vec());
            self.job.cond.notify_all();
            Ok(())
        }
        fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
            let mut b = self.job.boxes.lock().unwrap();
            loop {
                if let Some(m) = b.get_mut(&(peer, self.rank, tag)).and_then(|q| q.pop_front()) {
                    return Ok(m);
                }
                let (g, t) = self.job.cond.wait_timeout(b, std::time::Duration::from_secs(20)).unwrap();
                assert!(!t.timed_out(), "rank {} waited 20 s for rank {peer}", self.rank);
                b = g;
            }
        }
    }

    /// The default collectives give the right results at sizes that fill the tree unevenly,
    /// and each rank sends to at most three peers (its tree parent and children).
    #[test]
    fn default_collectives_use_the_tree() {
        for n in [1usize, 2, 3, 7, 10, 33] {
            let job = Mem::job(n);
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let bs = MemRank { rank, job: job.clone() };
                    std::thread::spawn(move || {
                        let all = bs.all_gather(&vec![rank as u8; rank % 5]).unwrap();
                        assert_eq!(all, (0..n).map(|i| vec![i as u8; i % 5]).collect::<Vec<_>>());
                        for root in [0, n / 2, n - 1] {
                            let got = bs.broadcast(root, &[rank as u8; 3]).unwrap();
                            assert_eq!(got, vec![root as u8; 3], "rank {rank}, root {root}");
                        }
                        bs.barrier().unwrap();
                        assert_eq!(bs.broadcast(n, b"x").unwrap_err().kind(), crate::ErrorKind::InvalidUsage);
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            for (r, s) in job.sent_to.iter().enumerate() {
                let s = s.lock().unwrap();
                let tree: BTreeSet<usize> = tree_parent(r).into_iter().chain(tree_children(r, n)).collect();
                assert!(s.is_subset(&tree), "{n} ranks: rank {r} sent to {s:?}, outside its tree peers {tree:?}");
            }
            assert!(job.boxes.lock().unwrap().values().all(|q| q.is_empty()), "{n} ranks: messages left over");
        }
    }

    /// A rank that cannot go on fails every rank's `all_gather_ready`, named (the first failing
    /// rank, by rank), its reason and the step in the message; without one, the data by rank.
    #[test]
    fn all_gather_ready_names_the_rank_that_cannot_go_on() {
        for fail in [None, Some(vec![2]), Some(vec![1, 3])] {
            let n = 4;
            let job = Mem::job(n);
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let bs = MemRank { rank, job: job.clone() };
                    let fail = fail.clone();
                    std::thread::spawn(move || {
                        // Bytes that frame nothing: '|', a NUL, the readiness flag's values.
                        let why = format!("rank {rank}'s own reason|\0\u{1}");
                        let data = vec![rank as u8; rank];
                        let mine = match &fail {
                            Some(f) if f.contains(&rank) => Err(why.as_str()),
                            _ => Ok(data.as_slice()),
                        };
                        bs.all_gather_ready(mine, "the test step")
                    })
                })
                .collect();
            for h in hs {
                let r = h.join().unwrap();
                match &fail {
                    None => assert_eq!(r.unwrap(), (0..n).map(|i| vec![i as u8; i]).collect::<Vec<_>>()),
                    Some(f) => {
                        let e = r.unwrap_err();
                        assert_eq!(e.peer(), Some(f[0]), "{e}");
                        assert_eq!(e.kind(), crate::ErrorKind::Remote, "{e}");
                        let m = e.to_string();
                        let want =
                            format!("rank {0} cannot go on (the test step): rank {0}'s own reason|\0\u{1}", f[0]);
                        assert!(m.contains(&want), "{m}");
                    }
                }
            }
        }
    }
}
