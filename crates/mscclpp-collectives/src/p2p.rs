//! [`PointToPoint`]: send, receive and local copies between the ranks of a [`Communicator`] on
//! the GPU, through per-pair staging scratch mapped over CUDA IPC.
//!
//! Every rank keeps an inbox per sender: per pipe (sender, block) a ring of
//! [`P2pConfig::slots`] slots of [`P2pConfig::slot_bytes`]. A sending block copies a chunk into
//! the receiver's slot and bumps a counter in the receiver's scratch; the receiving block waits
//! for it (bounded), copies the chunk out and bumps a "consumed" counter in the sender's scratch,
//! which frees the slot. Large messages go through the ring in rounds, their chunks spread over
//! up to `bmax` blocks. The counters of every pipe end live in device memory, so launches can be
//! captured in a CUDA graph and replayed.
//!
//! One [`launch`](PointToPoint::launch) runs a whole group of sends, receives and copies in one
//! kernel, all of them at once, so sends and receives of a group never wait on each other's
//! launch (NCCL's group semantics); operations to one peer in one direction run in call order.
//! The kernels of all ranks sharing a GPU must be resident together: the block count is capped
//! at setup as for the collectives.
//!
//! Matching: the n-th send from rank s to rank r pairs with the n-th receive of r from s; their
//! byte counts must be equal (a difference is reported as a mismatch naming the peer, or as a
//! timeout when the two sides split the message differently).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream, check_device_range};
use mscclpp::{Communicator, Error, MemoryChannel, Result, Transport, TransportFlags};

use crate::kernels::{self, Kernels};
use crate::status::{DeviceStatus, Reported};

/// Operations one launch holds at most.
pub const MAX_OPS: usize = 64;
/// Channels (distinct (direction, peer) pairs, plus one for local copies) one launch holds at most.
pub const MAX_CHANNELS: usize = 64;
const THREADS: u32 = 512;

/// Indices of the header words of the kernel's argument block (`P2P_*` in the CUDA source).
const HDR: [&str; 16] = [
    "P2P_PEERS",
    "P2P_STATE",
    "P2P_ERR",
    "P2P_ABORT",
    "P2P_TIMEOUT_NS",
    "P2P_RANK",
    "P2P_NRANKS",
    "P2P_BMAX",
    "P2P_SLOT_BYTES",
    "P2P_SLOTS",
    "P2P_NCH",
    "P2P_DATA_OFF",
    "P2P_POSTED_OFF",
    "P2P_CONSUMED_OFF",
    "P2P_RESERVED0",
    "P2P_RESERVED1",
];
const H_PEERS: usize = 0;
const H_STATE: usize = 1;
const H_ERR: usize = 2;
const H_ABORT: usize = 3;
const H_TIMEOUT_NS: usize = 4;
const H_RANK: usize = 5;
const H_NRANKS: usize = 6;
const H_BMAX: usize = 7;
const H_SLOT_BYTES: usize = 8;
const H_SLOTS: usize = 9;
const H_NCH: usize = 10;
const H_DATA_OFF: usize = 11;
const H_POSTED_OFF: usize = 12;
const H_CONSUMED_OFF: usize = 13;

const KIND_SEND: u64 = 1;
const KIND_RECV: u64 = 2;
const KIND_COPY: u64 = 3;

const ERR_TIMEOUT: u64 = 1;
const ERR_MISMATCH: u64 = 2;
const ERR_ABORTED: u64 = 3;
const ERR_FAILED_BEFORE: u64 = 4;

/// The kernel's argument block (by value, `__grid_constant__`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct P2pArgs {
    hdr: [u64; 16],
    /// Per channel: first block (16 bits), blocks (16), first op (16), end op (16).
    ch: [u64; MAX_CHANNELS],
    /// Per op: kind | peer << 8, pointer (destination of a receive or copy, source of a send),
    /// copy source, bytes.
    op: [[u64; 4]; MAX_OPS],
}

const KERNEL: &str = include_str!("p2p.cu");

/// The CUDA source of the point-to-point kernel, as compiled.
pub fn source() -> String {
    let mut s = String::from("#include \"mscclpp_rs/device.cuh\"\n\n");
    for (i, h) in HDR.iter().enumerate() {
        s.push_str(&format!("#define {h} {i}\n"));
    }
    for (n, v) in [
        ("P2P_SEND", KIND_SEND),
        ("P2P_RECV", KIND_RECV),
        ("P2P_COPY", KIND_COPY),
        ("P2P_ERR_TIMEOUT", ERR_TIMEOUT),
        ("P2P_ERR_MISMATCH", ERR_MISMATCH),
        ("P2P_ERR_ABORTED", ERR_ABORTED),
        ("P2P_ERR_FAILED_BEFORE", ERR_FAILED_BEFORE),
    ] {
        s.push_str(&format!("#define {n} {v}ull\n"));
    }
    s.push_str(&format!(
        "struct P2pArgs {{\n  mscclpp::u64 hdr[16];\n  mscclpp::u64 ch[{MAX_CHANNELS}];\n  mscclpp::u64 op[{MAX_OPS}][4];\n}};\nstatic_assert(sizeof(P2pArgs) == {}, \"P2pArgs layout\");\n\n",
        std::mem::size_of::<P2pArgs>()
    ));
    s.push_str(KERNEL);
    s
}

fn names() -> Vec<String> {
    vec!["p2p_group".to_string()]
}

/// One operation of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum P2pOp {
    /// Send `bytes` at `ptr` to `peer` (not this rank: use [`P2pOp::Copy`]).
    Send {
        /// The receiving rank.
        peer: usize,
        /// Device pointer of the data.
        ptr: u64,
        /// Bytes.
        bytes: u64,
    },
    /// Receive `bytes` from `peer` into `ptr`.
    Recv {
        /// The sending rank.
        peer: usize,
        /// Device pointer to write.
        ptr: u64,
        /// Bytes.
        bytes: u64,
    },
    /// Copy `bytes` from `src` to `dst` on this rank (a send to itself and its receive).
    Copy {
        /// Destination.
        dst: u64,
        /// Source.
        src: u64,
        /// Bytes.
        bytes: u64,
    },
}

impl P2pOp {
    fn bytes(&self) -> u64 {
        match *self {
            P2pOp::Send { bytes, .. } | P2pOp::Recv { bytes, .. } | P2pOp::Copy { bytes, .. } => bytes,
        }
    }
    /// (kind, peer) of its channel.
    fn channel(&self) -> (u64, usize) {
        match *self {
            P2pOp::Send { peer, .. } => (KIND_SEND, peer),
            P2pOp::Recv { peer, .. } => (KIND_RECV, peer),
            P2pOp::Copy { .. } => (KIND_COPY, 0),
        }
    }
}

/// A run of blocks serving the operations of one direction and peer (or the local copies).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct P2pChannel {
    /// The operations' kind: a send, a receive or a copy channel (`Send`/`Recv`/`Copy` of the
    /// first of them).
    pub first: P2pOp,
    /// Its first block.
    pub first_block: u32,
    /// Its blocks.
    pub blocks: u32,
    /// Its operations, indices into [`P2pPlan::ops`].
    pub ops: std::ops::Range<usize>,
}

/// How one launch runs a group: operations ordered by channel, and the channels' blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct P2pPlan {
    /// The non-empty operations, grouped by channel (call order within each).
    pub ops: Vec<P2pOp>,
    /// The channels, in order of first appearance.
    pub channels: Vec<P2pChannel>,
    /// Blocks of the launch (0: nothing to do).
    pub blocks: u32,
}

/// Blocks a message of `bytes` uses: one per chunk of `slot_bytes`, at most `bmax` (the same on
/// both sides of a pipe, so both split it alike).
pub fn blocks_for(bytes: u64, slot_bytes: u64, bmax: u32) -> u32 {
    bytes.div_ceil(slot_bytes.max(1)).min(bmax as u64) as u32
}

/// Plans a group of rank `rank` of `nranks` (pure: unit-tested without a GPU).
///
/// # Errors
/// `InvalidUsage` for a peer that is not a rank, a send or receive to this rank itself (the
/// caller pairs those into [`P2pOp::Copy`]), more than [`MAX_OPS`] operations or
/// [`MAX_CHANNELS`] channels.
pub fn plan(ops: &[P2pOp], rank: usize, nranks: usize, bmax: u32, slot_bytes: u64) -> Result<P2pPlan> {
    let mut order: Vec<(u64, usize)> = Vec::new();
    let mut by: Vec<Vec<P2pOp>> = Vec::new();
    for op in ops {
        if let P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } = *op {
            if peer >= nranks {
                return Err(Error::invalid_usage(format!("point-to-point: peer {peer} is not a rank of 0..{nranks}")));
            }
            if peer == rank {
                return Err(Error::invalid_usage(format!(
                    "point-to-point: rank {rank} sends to or receives from itself; pair those into a copy"
                )));
            }
        }
        if op.bytes() == 0 {
            continue;
        }
        let k = op.channel();
        match order.iter().position(|x| *x == k) {
            Some(i) => by[i].push(*op),
            None => {
                order.push(k);
                by.push(vec![*op]);
            }
        }
    }
    let n_ops: usize = by.iter().map(Vec::len).sum();
    if n_ops > MAX_OPS || by.len() > MAX_CHANNELS {
        return Err(Error::invalid_usage(format!(
            "point-to-point: {n_ops} operations on {} channels in one group; one launch holds at most {MAX_OPS} and {MAX_CHANNELS}",
            by.len()
        )));
    }
    let bmax = bmax.max(1);
    let mut plan = P2pPlan { ops: Vec::with_capacity(n_ops), channels: Vec::new(), blocks: 0 };
    for v in by {
        let blocks = v.iter().map(|o| blocks_for(o.bytes(), slot_bytes, bmax)).max().unwrap_or(1).max(1);
        let lo = plan.ops.len();
        plan.channels.push(P2pChannel { first: v[0], first_block: plan.blocks, blocks, ops: lo..lo + v.len() });
        plan.blocks += blocks;
        plan.ops.extend(v);
    }
    Ok(plan)
}

/// How a [`PointToPoint`] is built.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct P2pConfig {
    /// The GPU of this rank.
    pub device: u32,
    /// How long a device wait may last before the call fails naming the peer (default 30 s).
    pub timeout: Duration,
    /// Bytes of one slot (default 128 KiB; a multiple of 16).
    pub slot_bytes: u64,
    /// Slots per pipe (default 2: the sender fills one while the receiver empties the other).
    pub slots: u32,
    /// Blocks (pipes) per peer and direction at most (default 8; lowered so that every rank's
    /// launch fits on the GPU together).
    pub max_blocks_per_peer: u32,
}

impl P2pConfig {
    /// The defaults for GPU `device`.
    pub fn new(device: u32) -> P2pConfig {
        P2pConfig { device, timeout: Duration::from_secs(30), slot_bytes: 128 << 10, slots: 2, max_blocks_per_peer: 8 }
    }
    /// Sets the device wait limit.
    pub fn timeout(mut self, t: Duration) -> P2pConfig {
        self.timeout = t;
        self
    }
    /// Sets the slot size (rounded up to 16 bytes).
    pub fn slot_bytes(mut self, n: u64) -> P2pConfig {
        self.slot_bytes = n;
        self
    }
    /// Sets the slots per pipe.
    pub fn slots(mut self, n: u32) -> P2pConfig {
        self.slots = n;
        self
    }
    /// Sets the blocks per peer and direction.
    pub fn max_blocks_per_peer(mut self, n: u32) -> P2pConfig {
        self.max_blocks_per_peer = n;
        self
    }
}

/// Where things are in every rank's point-to-point scratch (the same on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pLayout {
    /// posted\[sender\]\[block\] counters.
    pub posted_off: u64,
    /// consumed\[receiver\]\[block\] counters.
    pub consumed_off: u64,
    /// inbox\[sender\]\[block\]\[slot\] (16-byte header, then `slot_bytes`).
    pub data_off: u64,
    /// Total bytes.
    pub total: u64,
}

impl P2pLayout {
    /// The layout for `nranks` ranks, `bmax` blocks per pipe set, `slots` slots of `slot_bytes`.
    pub fn new(nranks: usize, bmax: u32, slots: u32, slot_bytes: u64) -> P2pLayout {
        let counters = nranks as u64 * bmax as u64 * 8;
        let data_off = (2 * counters).div_ceil(256) * 256;
        let total = data_off + nranks as u64 * bmax as u64 * slots as u64 * (slot_bytes + 16);
        P2pLayout { posted_off: 0, consumed_off: counters, data_off, total }
    }
}

/// Send, receive and copy between the ranks of a [`Communicator`] on the GPU. See the module
/// documentation for the protocol.
///
/// Build it on every rank at once (it maps every peer's scratch over CUDA IPC, so all ranks are
/// on one host), then [`launch`](Self::launch) groups; a rank's sends to `p` pair in order with
/// `p`'s receives from it.
///
/// # Ranks sharing a GPU
///
/// Freeing device memory (`cuMemFree`, i.e. dropping a [`DeviceBuffer`]), allocating it, and the
/// synchronous copies and fills of a [`DeviceBuffer`] (`write`, `fill`, `read`, `to_vec`) may
/// wait for the whole GPU, including peers' kernels that spin waiting for this rank: where
/// ranks share a GPU (threads of one process, or processes under MPS), such a call made while
/// a peer may still be inside a kernel waiting for this rank deadlocks until that kernel's
/// timeout. The rule:
///
/// - [`new`](Self::new) allocates, fills and maps: call it on every rank after each rank
///   synchronized whatever it launched before (it lines the ranks up before its first CUDA
///   call, and again before returning, so that no rank launches before every rank is built);
/// - [`launch`](Self::launch) never allocates, copies or frees (the argument block goes by
///   value; the error word is page-locked host memory), so groups may follow each other on a
///   stream freely;
/// - allocate the buffers the launches use, and write their inputs, before the launches; between
///   launches and any host copy, allocation or free, synchronize the stream and pass a bootstrap
///   barrier on every rank (then no rank's kernel is still waiting);
/// - drop the `PointToPoint` (its scratch, tables and the peers' mappings) only after that same
///   synchronize-and-barrier on every rank.
pub struct PointToPoint {
    rank: usize,
    nranks: usize,
    device: u32,
    bmax: u32,
    slots: u32,
    slot_bytes: u64,
    layout: P2pLayout,
    timeout: Duration,
    kernels: Arc<Kernels>,
    _scratch: DeviceBuffer,
    peers_table: DeviceBuffer,
    state: DeviceBuffer,
    status: DeviceStatus,
    _channels: Vec<MemoryChannel>,
}

impl std::fmt::Debug for PointToPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PointToPoint(rank {} of {}, GPU{}, {} blocks per peer)",
            self.rank, self.nranks, self.device, self.bmax
        )
    }
}

impl PointToPoint {
    /// Builds the point-to-point path of `comm` (a collective call of every rank): compiles the
    /// kernel once per process (NVRTC), allocates and maps the scratch.
    ///
    /// Each rank must have synchronized what it launched before (see [`PointToPoint`] on ranks
    /// sharing a GPU): the ranks line up (a bootstrap all-gather) before the first CUDA call here
    /// that may wait for the GPU, and meet again (an exchange that also carries any rank's
    /// failure, so that every rank fails at once, naming it) before returning.
    ///
    /// # Errors
    /// `NotAvailable` without CUDA or NVRTC; `InvalidUsage` when a peer is on another host or
    /// too many ranks share a GPU; bootstrap and CUDA errors naming the peer.
    pub fn new(comm: &Communicator, config: P2pConfig) -> Result<PointToPoint> {
        let (rank, nranks, dev) = (comm.rank(), comm.size(), config.device);
        let slot_bytes = config.slot_bytes.max(16).div_ceil(16) * 16;
        let slots = config.slots.max(1);
        let me = mscclpp::gpu::pci_bus_id(dev).map(|id| format!("{:x}/{id}", mscclpp::host_hash()));
        // Every rank is here (done launching, its streams synchronized) before any loads a
        // module or allocates: either may wait for the whole GPU. A rank without its GPU fails
        // every rank here, named.
        let (me, all) =
            comm.all_gather_outcome(me, |me| me.as_bytes().to_vec(), "lining up for the point-to-point path")?;
        // A rank whose kernel does not load still takes part in the block-cap exchange below,
        // so that every rank fails there, named, instead of waiting for it.
        let kernels = kernels::load("point-to-point", "p2p.cu", dev, source, names);
        let my_host = me.split('/').next().unwrap_or_default();
        for (p, who) in all.iter().enumerate() {
            if String::from_utf8_lossy(who).split('/').next() != Some(my_host) {
                return Err(Error::invalid_usage(format!(
                    "rank {p} is on another host: the point-to-point path connects ranks over CUDA IPC within one host"
                ))
                .with_peer(p));
            }
        }
        let on_gpu = all.iter().filter(|w| w.as_slice() == me.as_bytes()).count();
        let channels_max = (2 * nranks.saturating_sub(1) + 1) as u32;
        let mine = kernels.and_then(|k| {
            let sms = mscclpp::gpu::sm_count(dev)?;
            let per_sm = k.min_blocks_per_sm(THREADS)?.max(1);
            let cap = crate::select::residency_cap(sms, per_sm, on_gpu)?;
            Ok((k, (cap / channels_max).clamp(1, config.max_blocks_per_peer.clamp(1, u16::MAX as u32))))
        });
        let ((kernels, mut bmax), caps) =
            comm.all_gather_outcome(mine, |(_, b)| b.to_le_bytes().to_vec(), "setting up the point-to-point path")?;
        for c in caps {
            let c: [u8; 4] = c.as_slice().try_into().map_err(|_| Error::remote("a peer sent a malformed block cap"))?;
            bmax = bmax.min(u32::from_le_bytes(c).max(1));
        }
        let layout = P2pLayout::new(nranks, bmax, slots, slot_bytes);
        let ctx = comm.context();
        // Allocated, then agreed: a rank out of memory fails every rank at once, named, instead
        // of leaving them waiting for its scratch.
        let state_len = (1 + 2 * nranks * bmax as usize) * 8;
        let buffers = (|| -> Result<_> {
            let scratch = DeviceBuffer::new(ctx, dev, layout.total as usize, Transport::CudaIpc.into())?;
            scratch.fill(0, layout.data_off as usize, 0)?;
            let peers_table = DeviceBuffer::new(ctx, dev, nranks * 8, TransportFlags::NONE)?;
            let state = DeviceBuffer::new(ctx, dev, state_len, TransportFlags::NONE)?;
            state.fill(0, state_len, 0)?;
            Ok((scratch, peers_table, state, DeviceStatus::new(ctx, dev)?))
        })()
        .map_err(|e| e.during("allocating the point-to-point buffers"));
        let ((scratch, peers_table, state, status), _) = comm.all_gather_outcome(
            buffers,
            |_| Vec::new(),
            "checking that every rank has its point-to-point buffers",
        )?;
        // The pairwise part (see `mesh`); a rank that fails in it says so at the closing
        // exchange, so that every rank fails at once, named.
        let mut hold = Vec::new();
        let paired = (|| -> Result<_> {
            let m = crate::mesh::mesh(comm, &scratch, dev, 0x00b2_b0b2, "point-to-point", &mut hold)?;
            let bytes: Vec<u8> = m.table.iter().flat_map(|p| p.to_le_bytes()).collect();
            peers_table.write(0, &bytes)?;
            Ok(m.channels)
        })();
        // Nobody launches before every rank has mapped every scratch.
        let (channels, _) = comm.all_gather_outcome(paired, |_| Vec::new(), "connecting the point-to-point ranks")?;
        tracing::debug!(target: "mscclpp::collectives", rank, nranks, gpu = dev, on_gpu, bmax, scratch = layout.total, "point-to-point ready");
        Ok(PointToPoint {
            rank,
            nranks,
            device: dev,
            bmax,
            slots,
            slot_bytes,
            layout,
            timeout: config.timeout,
            kernels,
            _scratch: scratch,
            peers_table,
            state,
            status,
            _channels: channels,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.nranks
    }
    /// Blocks per peer and direction (the same on every rank).
    pub fn blocks_per_peer(&self) -> u32 {
        self.bmax
    }
    /// The scratch layout.
    pub fn layout(&self) -> &P2pLayout {
        &self.layout
    }

    /// How this communicator would run `ops` (see [`plan`]).
    ///
    /// # Errors
    /// As [`plan`].
    pub fn plan(&self, ops: &[P2pOp]) -> Result<P2pPlan> {
        plan(ops, self.rank, self.nranks, self.bmax, self.slot_bytes)
    }

    /// The error a kernel of this rank reported, if any (non-blocking).
    ///
    /// # Errors
    /// `Timeout` naming the peer that never sent or received, `InvalidUsage` naming the peer
    /// whose message size differed, `Remote` after [`abort`](Self::abort) or an earlier failure.
    pub fn check(&self) -> Result<()> {
        let (kind, peer) = match self.status.read()? {
            Reported::Clear => return Ok(()),
            Reported::FailedBefore => {
                return Err(Error::remote(format!(
                    "rank {}: the point-to-point path failed earlier and refuses further calls",
                    self.rank
                )));
            }
            Reported::Error { kind, peer, .. } => (kind, peer),
        };
        let e = match kind {
            ERR_TIMEOUT => Error::timeout(
                format!(
                    "rank {}: a send or receive waited for rank {peer}, which never made the matching call",
                    self.rank
                ),
                self.timeout,
            )
            .with_peer(peer),
            ERR_MISMATCH => Error::invalid_usage(format!(
                "rank {}: rank {peer} sent a message of another size than this rank receives",
                self.rank
            ))
            .with_peer(peer),
            ERR_ABORTED => Error::remote(format!("rank {}: the point-to-point path was aborted", self.rank)),
            ERR_FAILED_BEFORE => Error::remote(format!(
                "rank {}: a send or receive ran after an earlier one failed and did nothing",
                self.rank
            )),
            _ => Error::internal(format!("rank {}: unknown point-to-point error kind {kind}", self.rank)),
        };
        Err(e.during("a send or receive"))
    }

    /// Asks every running and later kernel of this rank to stop waiting and fail.
    ///
    /// # Errors
    /// CUDA errors writing the request.
    pub fn abort(&self) -> Result<()> {
        self.status.abort()
    }

    /// Runs `ops` (a group) in one kernel on `stream`: every send, receive and copy of it at
    /// once. Stream-ordered and capturable in a CUDA graph.
    ///
    /// It allocates, copies and frees nothing (no per-launch upload: the plan travels in the
    /// kernel's argument block), so it is safe while peers' kernels run; the host copies that
    /// fill and read the operations' buffers are not (see [`PointToPoint`]).
    ///
    /// # Errors
    /// As [`plan`]; `InvalidUsage` for pointers that are not device memory of this GPU or too
    /// small, a stream of another GPU; the error of an earlier failed call; CUDA launch errors.
    ///
    /// # Safety
    /// Every pointer holds its `bytes` of device memory (readable for sends and copy sources,
    /// writable for receives and copy destinations) until the launch finishes on `stream`; the
    /// peers make the matching calls.
    pub unsafe fn launch(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        let what = || format!("a group of {} sends/receives (rank {} of {})", ops.len(), self.rank, self.nranks);
        self.check().map_err(|e| e.during(what()))?;
        if stream.device() != self.device {
            return Err(Error::invalid_usage(format!(
                "{}: the stream is on GPU{}, the point-to-point path on GPU{}",
                what(),
                stream.device(),
                self.device
            )));
        }
        let p = self.plan(ops).map_err(|e| e.during(what()))?;
        if p.blocks == 0 {
            return Ok(());
        }
        for op in &p.ops {
            let ranges: [(u64, &str); 2] = match *op {
                P2pOp::Send { ptr, .. } => [(ptr, "send buffer"), (0, "")],
                P2pOp::Recv { ptr, .. } => [(ptr, "receive buffer"), (0, "")],
                P2pOp::Copy { dst, src, .. } => [(dst, "copy destination"), (src, "copy source")],
            };
            for (ptr, name) in ranges {
                if name.is_empty() {
                    continue;
                }
                let g = check_device_range(ptr, op.bytes(), name).map_err(|e| e.during(what()))?;
                if g != self.device {
                    return Err(Error::invalid_usage(format!(
                        "{}: the {name} is on GPU{g}, the point-to-point path on GPU{}",
                        what(),
                        self.device
                    )));
                }
            }
        }
        let args = self.args(&p);
        let k = self.kernels.named("p2p_group")?;
        let mut a = args;
        let mut params = [(&mut a as *mut P2pArgs).cast::<c_void>()];
        // SAFETY: the kernel takes one P2pArgs by value (the CUDA struct is generated from the
        // same sizes and asserted); `a` lives until cuLaunchKernel returns (it copies it); the
        // scratch, tables, state and status words live as long as self; the caller guarantees
        // the operations' pointers.
        unsafe { k.launch((p.blocks, 1, 1), (THREADS, 1, 1), 0, stream, &mut params) }.map_err(|e| e.during(what()))
    }

    fn args(&self, p: &P2pPlan) -> P2pArgs {
        let mut a = P2pArgs { hdr: [0; 16], ch: [0; MAX_CHANNELS], op: [[0; 4]; MAX_OPS] };
        a.hdr[H_PEERS] = self.peers_table.device_ptr();
        a.hdr[H_STATE] = self.state.device_ptr();
        a.hdr[H_ERR] = self.status.error_word();
        a.hdr[H_ABORT] = self.status.abort_word();
        a.hdr[H_TIMEOUT_NS] = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX / 2).min(u64::MAX / 2);
        a.hdr[H_RANK] = self.rank as u64;
        a.hdr[H_NRANKS] = self.nranks as u64;
        a.hdr[H_BMAX] = self.bmax as u64;
        a.hdr[H_SLOT_BYTES] = self.slot_bytes;
        a.hdr[H_SLOTS] = self.slots as u64;
        a.hdr[H_NCH] = p.channels.len() as u64;
        a.hdr[H_DATA_OFF] = self.layout.data_off;
        a.hdr[H_POSTED_OFF] = self.layout.posted_off;
        a.hdr[H_CONSUMED_OFF] = self.layout.consumed_off;
        for (slot, c) in a.ch.iter_mut().zip(&p.channels) {
            *slot = encode_channel(c);
        }
        for (slot, op) in a.op.iter_mut().zip(&p.ops) {
            *slot = encode_op(op);
        }
        a
    }
}

fn encode_channel(c: &P2pChannel) -> u64 {
    (c.first_block as u64 & 0xffff)
        | ((c.blocks as u64 & 0xffff) << 16)
        | ((c.ops.start as u64 & 0xffff) << 32)
        | ((c.ops.end as u64 & 0xffff) << 48)
}

fn encode_op(op: &P2pOp) -> [u64; 4] {
    match *op {
        P2pOp::Send { peer, ptr, bytes } => [KIND_SEND | ((peer as u64) << 8), ptr, 0, bytes],
        P2pOp::Recv { peer, ptr, bytes } => [KIND_RECV | ((peer as u64) << 8), ptr, 0, bytes],
        P2pOp::Copy { dst, src, bytes } => [KIND_COPY, dst, src, bytes],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(peer: usize, bytes: u64) -> P2pOp {
        P2pOp::Send { peer, ptr: 0x1000 * (peer as u64 + 1), bytes }
    }
    fn r(peer: usize, bytes: u64) -> P2pOp {
        P2pOp::Recv { peer, ptr: 0x9000 * (peer as u64 + 1), bytes }
    }

    #[test]
    fn plans_group_by_direction_and_peer_in_call_order() {
        let c = P2pOp::Copy { dst: 1, src: 2, bytes: 8 };
        let ops = [s(1, 100), r(2, 300 << 10), c, s(1, 1 << 20), r(2, 0), s(3, 0)];
        let p = plan(&ops, 0, 4, 8, 128 << 10).unwrap();
        // Empty operations are dropped; the two sends to 1 share a channel, in order.
        assert_eq!(p.ops, vec![s(1, 100), s(1, 1 << 20), r(2, 300 << 10), c]);
        assert_eq!(p.channels.len(), 3);
        // 1 MiB / 128 KiB = 8 chunks -> 8 blocks; 300 KiB -> 3; a copy of 8 bytes -> 1.
        assert_eq!((p.channels[0].first_block, p.channels[0].blocks, p.channels[0].ops.clone()), (0, 8, 0..2));
        assert_eq!((p.channels[1].first_block, p.channels[1].blocks, p.channels[1].ops.clone()), (8, 3, 2..3));
        assert_eq!((p.channels[2].first_block, p.channels[2].blocks, p.channels[2].ops.clone()), (11, 1, 3..4));
        assert_eq!(p.blocks, 12);
        assert_eq!(encode_channel(&p.channels[1]), 8 | (3 << 16) | (2 << 32) | (3 << 48));
        assert_eq!(encode_op(&s(3, 7)), [KIND_SEND | (3 << 8), 0x4000, 0, 7]);
    }

    #[test]
    fn blocks_cap_and_agree_on_both_sides() {
        assert_eq!(blocks_for(1, 128 << 10, 8), 1);
        assert_eq!(blocks_for(128 << 10, 128 << 10, 8), 1);
        assert_eq!(blocks_for((128 << 10) + 1, 128 << 10, 8), 2);
        assert_eq!(blocks_for(1 << 30, 128 << 10, 8), 8);
        assert_eq!(blocks_for(1 << 30, 128 << 10, 1), 1);
        // A send and its receive of the same size plan the same blocks on their two ranks.
        let a = plan(&[s(1, 5 << 20)], 0, 2, 4, 1 << 20).unwrap();
        let b = plan(&[r(0, 5 << 20)], 1, 2, 4, 1 << 20).unwrap();
        assert_eq!(a.blocks, b.blocks);
        assert!(plan(&[], 0, 2, 4, 16).unwrap().blocks == 0);
    }

    #[test]
    fn refuses_bad_peers_self_and_oversized_groups() {
        assert!(plan(&[s(2, 4)], 0, 2, 8, 16).unwrap_err().to_string().contains("peer 2"));
        assert!(plan(&[r(1, 4)], 1, 2, 8, 16).unwrap_err().to_string().contains("itself"));
        let many: Vec<P2pOp> = (0..MAX_OPS + 1).map(|_| s(1, 4)).collect();
        assert!(plan(&many, 0, 2, 8, 16).unwrap_err().to_string().contains("at most"));
        let ok: Vec<P2pOp> = (0..MAX_OPS).map(|_| s(1, 4)).collect();
        assert_eq!(plan(&ok, 0, 2, 8, 16).unwrap().channels.len(), 1);
    }

    #[test]
    fn layout_and_source() {
        let l = P2pLayout::new(4, 8, 2, 128 << 10);
        assert_eq!(l.consumed_off, 4 * 8 * 8);
        assert_eq!(l.data_off % 256, 0);
        assert!(l.data_off >= 2 * 4 * 8 * 8);
        assert_eq!(l.total, l.data_off + 4 * 8 * 2 * ((128 << 10) + 16));
        assert_eq!(std::mem::size_of::<P2pArgs>(), (16 + MAX_CHANNELS + 4 * MAX_OPS) * 8);
        assert!(std::mem::size_of::<P2pArgs>() <= 4096, "kernel parameters are limited to 4 KiB");
        let src = source();
        for (i, h) in HDR.iter().enumerate() {
            assert!(src.contains(&format!("#define {h} {i}\n")));
        }
        assert!(src.contains("p2p_group"));
        // Every header word the host fills is read by the kernel.
        for h in &HDR[..14] {
            assert!(KERNEL.contains(&format!("a.hdr[{h}]")), "the kernel never reads {h}");
        }
    }
}
