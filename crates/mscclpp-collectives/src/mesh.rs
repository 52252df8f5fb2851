//! The pairwise part of a setup over CUDA IPC: every pair of ranks swaps scratch buffers,
//! connects, builds a semaphore and maps the other's scratch (`Collectives::new` and
//! `PointToPoint::new`).

use std::sync::Arc;

use mscclpp::gpu::DeviceBuffer;
use mscclpp::{
    Communicator, Device, EndpointConfig, FirstError, MemoryChannel, MemoryDevice2DeviceSemaphore, Result, Transport,
};

/// This rank's channels to every peer.
pub(crate) struct Mesh {
    /// Peer `p`'s scratch as this rank addresses it (its own at its rank).
    pub table: Vec<u64>,
    pub channels: Vec<MemoryChannel>,
    /// Per peer, the semaphore its channel uses.
    pub sems: Vec<(usize, Arc<MemoryDevice2DeviceSemaphore>)>,
}

/// Connects this rank with every other over CUDA IPC on GPU `dev` (messages tagged `tag`;
/// errors say they happened while connecting `what`). Everything this rank owes a peer (its
/// scratch, its endpoint, its semaphore) goes out before it waits for anything of that peer's,
/// and a failure with one peer does not stop what it owes the others: a peer is never left
/// waiting for this rank's messages until the bootstrap timeout because of another pair. Returns
/// the first error, naming the peer.
pub(crate) fn mesh(comm: &Communicator, scratch: &DeviceBuffer, dev: u32, tag: u32, what: &str) -> Result<Mesh> {
    let (rank, nranks) = (comm.rank(), comm.size());
    let ep = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
    let mut first = FirstError::default();
    let mut pending = Vec::new();
    for p in (0..nranks).filter(|&p| p != rank) {
        let sent = first.keep(comm.send_memory(scratch.memory(), p, tag).map_err(|e| e.with_peer(p)));
        let mem = first.keep(comm.recv_memory(p, tag).map_err(|e| e.with_peer(p)));
        let conn = first.keep(comm.connect(&ep, p, tag).map_err(|e| e.with_peer(p)));
        if let (Some(()), Some(mem), Some(conn)) = (sent, mem, conn) {
            pending.push((p, mem, conn));
        }
    }
    // The semaphore's message needs the connection; the peer's scratch is waited for after.
    let mut sems = Vec::new();
    for (p, mem, conn) in pending {
        let Some(conn) = first.keep(conn.wait().map_err(|e| e.during(format!("connecting {what}")).with_peer(p)))
        else {
            continue;
        };
        let sem = first.keep(comm.build_semaphore(&conn, p, tag).map_err(|e| e.with_peer(p)));
        let mem =
            first.keep(mem.wait().map_err(|e| e.during(format!("receiving a peer's {what} scratch")).with_peer(p)));
        if let (Some(sem), Some(mem)) = (sem, mem) {
            sems.push((p, mem, sem));
        }
    }
    first.into_result()?;
    // Nothing more is owed to anyone: the rest only waits and maps.
    let mut table = vec![0u64; nranks];
    table[rank] = scratch.device_ptr();
    let mut channels = Vec::new();
    let mut peer_sems = Vec::new();
    for (p, mem, sem) in sems {
        let sem = sem.wait().map_err(|e| e.during(format!("building a {what} semaphore")).with_peer(p))?;
        let sem = Arc::new(MemoryDevice2DeviceSemaphore::new(sem).map_err(|e| e.with_peer(p))?);
        let ch = MemoryChannel::new(sem.clone(), &mem, scratch.memory(), Some(scratch.memory()))
            .map_err(|e| e.during(format!("mapping a peer's {what} scratch")).with_peer(p))?;
        table[p] = ch.device_handle().dst;
        channels.push(ch);
        peer_sems.push((p, sem));
    }
    Ok(Mesh { table, channels, sems: peer_sems })
}
