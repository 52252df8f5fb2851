//! Rendezvous and small control messages between ranks.
//!
//! [`Bootstrap`] is the interface the rest of the crate uses (bring your own over MPI if you
//! like); [`TcpBootstrap`] is the built-in implementation over TCP.

pub(crate) mod proto;
mod rendezvous;
mod tcp;

pub use tcp::{RootServer, TcpBootstrap, TcpBootstrapConfig, UniqueId};
#[cfg(feature = "fuzzing")]
pub(crate) use tcp::{check_padded, check_text};

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
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (me, n) = (self.rank(), self.size());
        for p in (0..n).filter(|p| *p != me) {
            self.send(p, TAG_ALL_GATHER, data)?;
        }
        (0..n).map(|p| if p == me { Ok(data.to_vec()) } else { self.recv(p, TAG_ALL_GATHER) }).collect()
    }

    /// `root`'s `data`, on every rank (other ranks' `data` is ignored).
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.size() {
            return Err(Error::invalid_usage(format!("broadcast root {root} is not a rank of {}", self.size())));
        }
        if self.rank() == root {
            for p in (0..self.size()).filter(|p| *p != root) {
                self.send(p, TAG_BROADCAST, data)?;
            }
            Ok(data.to_vec())
        } else {
            self.recv(root, TAG_BROADCAST)
        }
    }

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        for p in (0..n).filter(|p| *p != me) {
            self.send(p, TAG_BARRIER, &[])?;
        }
        for p in (0..n).filter(|p| *p != me) {
            self.recv(p, TAG_BARRIER)?;
        }
        Ok(())
    }
}
