//! The pairwise part of a setup over CUDA IPC: every pair of ranks swaps scratch buffers,
//! connects, builds a semaphore and maps the other's scratch (`Collectives::new` and
//! `PointToPoint::new`).

use std::sync::Arc;

use mscclpp::gpu::DeviceBuffer;
use mscclpp::{
    Communicator, Connection, Device, EndpointConfig, FirstError, MemoryChannel, MemoryDevice2DeviceSemaphore, Result,
    Transport,
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
/// errors say they happened while connecting `what`). A collective call: every rank calls it at
/// the same point of its setup.
///
/// The messages that need nothing from a peer (this rank's scratch and endpoint) go out to
/// every peer first, and every rank then says whether it sent them all (an exchange): a rank
/// that could not fails every rank there, named, before anyone waits for its messages. Then the
/// semaphores (each needs that peer's endpoint), then the waits for the peers' scratch; a
/// failure with one peer does not stop what is owed to the others. Connections are pushed onto
/// `hold` as they come up: the caller keeps them open until its closing exchange, so that a
/// failing rank does not cut a healthy peer's traffic short before every rank has heard why.
/// Returns the first error, naming the peer.
pub(crate) fn mesh(
    comm: &Communicator,
    scratch: &DeviceBuffer,
    dev: u32,
    tag: u32,
    what: &str,
    hold: &mut Vec<Connection>,
) -> Result<Mesh> {
    let (rank, nranks) = (comm.rank(), comm.size());
    let ep = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
    let mut first = FirstError::default();
    let mut pending = Vec::new();
    for p in (0..nranks).filter(|&p| p != rank) {
        // Without our scratch the peer cannot finish with us: no endpoint either.
        if first.keep(comm.send_memory(scratch.memory(), p, tag).map_err(|e| e.with_peer(p))).is_none() {
            continue;
        }
        let mem = first.keep(comm.recv_memory(p, tag).map_err(|e| e.with_peer(p)));
        let conn = first.keep(comm.connect(&ep, p, tag).map_err(|e| e.with_peer(p)));
        if let (Some(mem), Some(conn)) = (mem, conn) {
            pending.push((p, mem, conn));
        }
    }
    comm.all_gather_outcome(first.into_result(), |_| Vec::new(), &format!("sending the {what} scratch and endpoints"))?;
    let mut first = FirstError::default();
    let mut mems = Vec::new();
    let mut sems = Vec::new();
    for (p, mem, conn) in pending {
        let Some(conn) = first.keep(conn.wait().map_err(|e| e.during(format!("connecting {what}")).with_peer(p)))
        else {
            continue;
        };
        hold.push(conn.clone());
        if let Some(sem) = first.keep(comm.build_semaphore(&conn, p, tag).map_err(|e| e.with_peer(p))) {
            sems.push((p, sem));
            mems.push(mem);
        }
    }
    let mut got = Vec::new();
    for ((p, sem), mem) in sems.into_iter().zip(mems) {
        if let Some(mem) = first.keep(mem.wait().map_err(|e| e.with_peer(p))) {
            got.push((p, mem, sem));
        }
    }
    first.into_result()?;
    // Nothing more is owed to anyone: the rest only waits and maps.
    let mut table = vec![0u64; nranks];
    table[rank] = scratch.device_ptr();
    let mut channels = Vec::new();
    let mut peer_sems = Vec::new();
    for (p, mem, sem) in got {
        let sem = sem.wait().map_err(|e| e.with_peer(p))?;
        let sem = Arc::new(MemoryDevice2DeviceSemaphore::new(sem).map_err(|e| e.with_peer(p))?);
        let ch = MemoryChannel::new(sem.clone(), &mem, scratch.memory(), Some(scratch.memory()))
            .map_err(|e| e.during(format!("mapping a peer's {what} scratch")).with_peer(p))?;
        table[p] = ch.device_handle().dst;
        channels.push(ch);
        peer_sems.push((p, sem));
    }
    Ok(Mesh { table, channels, sems: peer_sems })
}
