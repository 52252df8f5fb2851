//! The I/O shells of the collectives: they execute the steps that [`schedule`](super::schedule)
//! computes, over a `send` and a `recv` they are given. The [`Bootstrap`](super::Bootstrap)
//! trait's defaults run them over the trait's `send`/`recv`; [`TcpBootstrap`] runs them over its
//! links, with failure reports and one deadline per call, and takes the ring for large gathers.

use std::time::Duration;

use super::proto::{AbortNotice, GatherBlocks};
use super::schedule::{self, Blocks, Step};
use super::tcp::{GONE_GRACE, TcpBootstrap};
use super::{TAG_ALL_GATHER, TAG_ALL_GATHER_RING, TAG_BARRIER, TAG_BROADCAST};
use crate::error::{Error, Result};
use crate::sync::{Deadline, lock};
use crate::wire::WireForm;

/// The most bytes of `all_gather` pieces one subtree sends up the tree; larger gathers take the
/// ring.
pub(crate) const TREE_GATHER_LIMIT: usize = 1 << 20;

/// Runs [`schedule::tree_gather`] for an `all_gather`: each rank sends its subtree's pieces to
/// its parent, rank 0 sends the whole table down. `Ok(None)` when some subtree holds more than
/// `limit` bytes (every rank then learns so from the table and may take the ring).
pub(super) fn gather_on_tree(
    me: usize,
    n: usize,
    data: &[u8],
    limit: usize,
    what: &str,
    mut send: impl FnMut(usize, &[u8]) -> Result<()>,
    mut recv: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<Option<Vec<Vec<u8>>>> {
    let encode = |g: &GatherBlocks| g.encode().map_err(|e| e.during(what.to_string()));
    // My subtree's pieces, or an overflow marker.
    let mut mine = GatherBlocks { overflow: data.len() > limit, blocks: Vec::new() };
    let mut held = data.len();
    if !mine.overflow {
        mine.blocks.push((me as u32, data.to_vec()));
    }
    // The full table (or the marker), forwarded down as received.
    let mut table: Option<Vec<u8>> = None;
    for step in schedule::tree_gather(me, n) {
        match step {
            Step::Recv { peer, blocks: Blocks::Subtree(_) } => {
                let got =
                    GatherBlocks::from_wire(&recv(peer)?).map_err(|e| e.during(what.to_string()).with_peer(peer))?;
                held = got.blocks.iter().fold(held, |h, (_, b)| h.saturating_add(b.len()));
                mine.overflow |= got.overflow || held > limit;
                if !mine.overflow {
                    mine.blocks.extend(got.blocks);
                }
            }
            Step::Send { peer, blocks: Blocks::Subtree(_) } => send(peer, &encode(finish(&mut mine))?)?,
            Step::Recv { peer, .. } => table = Some(recv(peer)?),
            Step::Send { peer, .. } => {
                let t = match &mut table {
                    Some(t) => t,
                    None => table.insert(encode(finish(&mut mine))?),
                };
                send(peer, t)?;
            }
        }
    }
    let table = match table {
        Some(t) => t,
        None => encode(finish(&mut mine))?,
    };
    let all = GatherBlocks::from_wire(&table).map_err(|e| e.during(what.to_string()))?;
    if all.overflow {
        return Ok(None);
    }
    if all.blocks.len() != n || all.blocks.iter().enumerate().any(|(i, (r, _))| *r as usize != i) {
        return Err(Error::remote(format!(
            "the gathered table has {} pieces, not one from each of {n} ranks",
            all.blocks.len()
        ))
        .during(what.to_string()));
    }
    Ok(Some(all.blocks.into_iter().map(|(_, b)| b).collect()))
}

/// A subtree's pieces as they go up: in rank order, none under an overflow marker.
fn finish(g: &mut GatherBlocks) -> &GatherBlocks {
    if g.overflow {
        g.blocks.clear();
    }
    g.blocks.sort_unstable_by_key(|(r, _)| *r);
    g
}

/// Runs [`schedule::ring_gather`]: n-1 rounds, each passing one rank's piece to the next rank.
fn gather_on_ring(
    me: usize,
    n: usize,
    data: &[u8],
    mut send: impl FnMut(usize, &[u8]) -> Result<()>,
    mut recv: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<Vec<Vec<u8>>> {
    let mut out = vec![Vec::new(); n];
    out[me] = data.to_vec();
    for step in schedule::ring_gather(me, n) {
        match step {
            Step::Send { peer, blocks: Blocks::One(b) } => send(peer, &out[b])?,
            Step::Recv { peer, blocks: Blocks::One(b) } => out[b] = recv(peer)?,
            s => return Err(Error::internal(format!("ring step {s:?} carries more than one piece"))),
        }
    }
    Ok(out)
}

/// Runs [`schedule::tree_broadcast`]: `root`'s `data` on every rank.
pub(super) fn broadcast_on_tree(
    me: usize,
    n: usize,
    root: usize,
    data: &[u8],
    mut send: impl FnMut(usize, &[u8]) -> Result<()>,
    mut recv: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let mut payload = (me == root).then(|| data.to_vec());
    for step in schedule::tree_broadcast(me, n, root) {
        match step {
            // A rank on the root's path hears it twice (up, then down from rank 0): the first
            // copy counts.
            Step::Recv { peer, .. } => {
                let d = recv(peer)?;
                payload.get_or_insert(d);
            }
            Step::Send { peer, .. } => {
                let d = payload.as_deref().ok_or_else(|| Error::internal("broadcast step sends before it has data"))?;
                send(peer, d)?;
            }
        }
    }
    payload.ok_or_else(|| Error::internal("broadcast without data"))
}

/// Runs [`schedule::tree_gather`] as a barrier (empty messages): arrivals up, the release down.
/// Consecutive receives are handed to `recv_all` together, so a timeout names every silent peer.
pub(super) fn barrier_on_tree(
    me: usize,
    n: usize,
    mut send: impl FnMut(usize) -> Result<()>,
    mut recv_all: impl FnMut(&[usize]) -> Result<()>,
) -> Result<()> {
    let mut waiting = Vec::new();
    for step in schedule::tree_gather(me, n) {
        match step {
            Step::Recv { peer, .. } => waiting.push(peer),
            Step::Send { peer, .. } => {
                if !waiting.is_empty() {
                    recv_all(&waiting)?;
                    waiting.clear();
                }
                send(peer)?;
            }
        }
    }
    if !waiting.is_empty() {
        recv_all(&waiting)?;
    }
    Ok(())
}

impl TcpBootstrap {
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
            let grace = Deadline::after(GONE_GRACE);
            while !grace.expired() && lock(&sh.abort).is_none() {
                std::thread::sleep(Duration::from_millis(10));
            }
            let notice = AbortNotice { failed: peer as u32, reporter: sh.rank as u32, reason: e.to_string() };
            super::links::raise_abort(sh, notice);
            sh.abort_error(what).unwrap_or_else(|| e.during(what.to_string()).with_peer(peer))
        })
    }

    /// One receive of a collective, waiting until `deadline`.
    fn coll_recv(&self, peer: usize, tag: u64, deadline: Deadline, what: &str) -> Result<Vec<u8>> {
        let mut v = self.shared.recv_many(&[peer], tag, deadline, what, true)?;
        v.pop().ok_or_else(|| Error::internal("recv_many returned nothing"))
    }

    /// Up the tree, then the table down it; the ring when a subtree holds more than
    /// [`TREE_GATHER_LIMIT`] (see [`Bootstrap::all_gather`](super::Bootstrap::all_gather)).
    pub(super) fn tcp_all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let what = "bootstrap all_gather";
        let (me, n) = (self.shared.rank, self.shared.size);
        let deadline = self.deadline();
        let send = |p: usize, d: &[u8]| self.coll_send(p, TAG_ALL_GATHER, d, what);
        let recv = |p: usize| self.coll_recv(p, TAG_ALL_GATHER, deadline, what);
        if let Some(all) = gather_on_tree(me, n, data, TREE_GATHER_LIMIT, what, send, recv)? {
            return Ok(all);
        }
        gather_on_ring(
            me,
            n,
            data,
            |p, d| self.coll_send(p, TAG_ALL_GATHER_RING, d, what),
            |p| self.coll_recv(p, TAG_ALL_GATHER_RING, deadline, what),
        )
    }

    /// Up the root's path to rank 0, then down the tree.
    pub(super) fn tcp_broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        let what = "bootstrap broadcast";
        self.check_peer(root, what)?;
        let (me, n) = (self.shared.rank, self.shared.size);
        let deadline = self.deadline();
        broadcast_on_tree(
            me,
            n,
            root,
            data,
            |p, d| self.coll_send(p, TAG_BROADCAST, d, what),
            |p| self.coll_recv(p, TAG_BROADCAST, deadline, what),
        )
    }

    /// Arrivals up the tree, then the release down it.
    pub(super) fn tcp_barrier(&self) -> Result<()> {
        let what = "bootstrap barrier";
        let (me, n) = (self.shared.rank, self.shared.size);
        let deadline = self.deadline();
        barrier_on_tree(
            me,
            n,
            |p| self.coll_send(p, TAG_BARRIER, &[], what),
            |ps| self.shared.recv_many(ps, TAG_BARRIER, deadline, what, true).map(drop),
        )
    }
}
