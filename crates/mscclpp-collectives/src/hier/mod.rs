//! Two-level collectives for jobs of several nodes: AllReduce and AllGather inside a node over
//! [`MemoryChannel`]s (CUDA IPC, no host thread) and between nodes over
//! [`PortChannel`](mscclpp::device::PortChannel)s through a [`ProxyService`] (any transport the
//! proxy serves: CUDA IPC, Ethernet, IB).
//!
//! Nodes are groups of `ranks_per_node` consecutive ranks ([`Topology`]); they need not be
//! machines: tests group the ranks of one machine into "nodes" and still cross between them
//! through the proxy. [`schedule`] states, as data, who sends which bytes to whom in each phase
//! (and simulates it on the CPU); [`TwoLevel`] runs the same steps on the GPU, with every device
//! wait bounded by [`HierConfig::timeout`].
//!
//! ```no_run
//! # fn f(comm: &mscclpp::Communicator, stream: &mscclpp::gpu::Stream, buf: &mscclpp::DeviceBuffer)
//! # -> mscclpp::Result<()> {
//! use mscclpp::Transport;
//! use mscclpp_collectives::hier::{HierConfig, TwoLevel};
//! use mscclpp_collectives::{DataType, ReduceOp};
//! let two = TwoLevel::new(comm, HierConfig::new(0, 4).inter(Transport::Ethernet))?;
//! // SAFETY: buf holds 1024 f32 and outlives the call (synchronized below).
//! unsafe { two.all_reduce(buf.device_ptr(), buf.device_ptr(), 1024, DataType::F32, ReduceOp::Sum, stream)? };
//! two.synchronize(stream, std::time::Duration::from_secs(10))?;
//! # Ok(()) }
//! ```
#![allow(unsafe_code)]

pub mod schedule;

mod kernels;

use std::sync::Arc;
use std::time::Duration;

use mscclpp::device::{ProxyConfig, ProxyService};
use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{
    Communicator, Device, EndpointConfig, Error, FirstError, Host2DeviceSemaphore, MemoryChannel,
    MemoryDevice2DeviceSemaphore, Result, Transport, TransportFlags,
};

pub use schedule::{Layout, Topology};

use crate::kernels::Kernels;
use crate::status::{DeviceStatus, Reported};
use crate::types::{Collective, DataType, ReduceOp};
use kernels::{HierArgs, STATE_BYTES};

/// How a [`TwoLevel`] is built.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct HierConfig {
    /// The GPU of this rank.
    pub device: u32,
    /// Ranks per node: nodes are groups of this many consecutive ranks.
    pub ranks_per_node: usize,
    /// The endpoint of the inter-node connections (its transport, and for Ethernet its
    /// interface). Default: CUDA IPC on `device`.
    pub inter: EndpointConfig,
    /// How long one device wait (a peer's signal, a free FIFO slot) may last before the call
    /// fails naming the peer. Default 30 s.
    pub timeout: Duration,
    /// Bytes of the buffer one AllReduce round moves (rounded up to a multiple of
    /// `16 * ranks_per_node`); AllGather rounds move `round_bytes / ranks_per_node` of each
    /// segment. Default 4 MiB. The scratch is about `round_bytes * (1 + 1/L + 4 M/L)`.
    pub round_bytes: u64,
    /// Most blocks per launch (capped further so that the kernels of every rank sharing the GPU
    /// are resident together). Default 16.
    pub max_blocks: u32,
    /// How the proxy of the inter-node PortChannels runs.
    pub proxy: ProxyConfig,
}

impl HierConfig {
    /// Defaults for GPU `device` with nodes of `ranks_per_node` ranks.
    pub fn new(device: u32, ranks_per_node: usize) -> HierConfig {
        HierConfig {
            device,
            ranks_per_node,
            inter: EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(device)),
            timeout: Duration::from_secs(30),
            round_bytes: 4 << 20,
            max_blocks: 16,
            proxy: ProxyConfig::default(),
        }
    }
    /// Sets the inter-node transport (an endpoint on this config's GPU).
    pub fn inter(mut self, t: Transport) -> HierConfig {
        self.inter = EndpointConfig::new(t).device(Device::Gpu(self.device));
        self
    }
    /// Sets the inter-node endpoint (e.g. Ethernet on a given interface).
    pub fn inter_endpoint(mut self, e: EndpointConfig) -> HierConfig {
        self.inter = e;
        self
    }
    /// Sets the device wait limit.
    pub fn timeout(mut self, t: Duration) -> HierConfig {
        self.timeout = t;
        self
    }
    /// Sets the AllReduce round size.
    pub fn round_bytes(mut self, n: u64) -> HierConfig {
        self.round_bytes = n;
        self
    }
    /// Sets the proxy's configuration.
    pub fn proxy(mut self, p: ProxyConfig) -> HierConfig {
        self.proxy = p;
        self
    }
    /// Sets the most blocks per launch.
    pub fn max_blocks(mut self, n: u32) -> HierConfig {
        self.max_blocks = n;
        self
    }
}

const ERR_TIMEOUT: u64 = 1;
const ERR_PROXY: u64 = 2;
const ERR_ABORTED: u64 = 3;
const ERR_FAILED_BEFORE: u64 = 4;
const ERR_GRID: u64 = 5;
const ERR_MISMATCH: u64 = 6;

/// A two-level call's signature: what every node peer's and cross-node peer's call must match
/// (collective, type, operation, bytes, and the call's number on this object), as a nonzero
/// word (FNV-1a; 0 is an empty or cleared slot). The number (every call counts, those of no
/// bytes too, which launch nothing) keeps a word or a semaphore token left by a call that a peer
/// never launched from passing for a later call of the same shape.
fn signature(coll: Collective, dtype: DataType, op: Option<ReduceOp>, nbytes: u64, call: u64) -> u64 {
    crate::select::fnv1a_words([coll.code(), dtype.code(), op.map_or(u64::MAX, |o| o.code()), nbytes, call]) | 1
}

const THREADS: u32 = 512;
const TAG_INTRA: u32 = 0x00c0_4a10;
const TAG_INTER: u32 = 0x00c0_4a11;

/// Two-level AllReduce and AllGather over the ranks of one [`Communicator`] (see the
/// [module documentation](self)).
///
/// Built on every rank at once (a collective call). It owns this rank's scratch (registered for
/// CUDA IPC and the inter-node transport), a [`MemoryChannel`] to every other rank of its node,
/// a [`ProxyService`] with a PortChannel to the rank of the same local rank on every other node,
/// and the device state of the bounded waits. Every rank then makes the same calls in the same
/// order, each on its own stream. A rank that never arrives makes the others' kernels return
/// after [`HierConfig::timeout`], and [`check`](Self::check) names it; the object then refuses
/// further calls.
///
/// Each call carries a signature (collective, type, operation, bytes, and the call's number on
/// this object) that every rank compares
/// with those of the ranks it exchanges with, before anything reaches the output: the ranks of a
/// node in the call's first node barrier, and each rank with its cross-node peers (the same
/// local rank on every other node) in the call's first inter-node exchange, where the signature
/// rides at the end of the data the exchange puts anyway (no extra proxy copy). A peer that made
/// another call fails both ranks, each naming the other (`InvalidUsage`); the other ranks then
/// fail too (naming a rank that stopped, or the mismatch they saw). Whole nodes that agree
/// inside but differ from each other, and every call with one rank per node, are named through
/// the cross-node comparison. A rank whose call has no bytes launches nothing, so its peers time
/// out naming it. The setup is checked across all ranks (ranks per node, round size, transport
/// kind).
///
/// The call number counts every call made on this object after its checks of the object's own
/// state, those with no bytes and those refused for their arguments included, in the order the
/// host makes them: a rank that retries a refused call, or skips one, is a call ahead or behind
/// its peers from then on and every later call fails as a mismatch (the object should be
/// rebuilt). A call captured in a CUDA graph keeps the number it had at capture for every
/// replay; every rank must capture the same calls.
///
/// Calls are stream-ordered and keep their device state on the GPU (an exchange counter that
/// picks the half of the exchange slots), so they are meant to be capturable in a CUDA graph (not
/// tested yet). Drop it only after every call finished on every rank (synchronize, then a
/// bootstrap barrier): dropping stops the proxy and frees the scratch peers map (freeing waits
/// for kernels still running, each bounded by the timeout; [`abort`](Self::abort) ends them at
/// once).
pub struct TwoLevel {
    // The proxy first: dropping it stops the thread before the memories it uses go.
    proxy: ProxyService,
    rank: usize,
    device: u32,
    topo: Topology,
    layout: Layout,
    timeout: Duration,
    blocks: u32,
    kernels: Arc<Kernels>,
    scratch: DeviceBuffer,
    handles: DeviceBuffer,
    state: DeviceBuffer,
    /// Page-locked: word 0 is the error the kernels report, word 1 the abort request.
    status: DeviceStatus,
    _mem_channels: Vec<MemoryChannel>,
    _port_channels: Vec<mscclpp::device::PortChannel>,
    /// Calls made so far (part of each call's signature).
    calls: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for TwoLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TwoLevel(rank {} of {}, {} nodes of {}, GPU{}, scratch {} bytes)",
            self.rank,
            self.topo.nranks(),
            self.topo.nodes(),
            self.topo.ranks_per_node(),
            self.device,
            self.layout.total
        )
    }
}

/// Bytes of a MemoryChannel / PortChannel device handle.
const MEM_HANDLE: usize = 48;
const PORT_HANDLE: usize = 96;

impl TwoLevel {
    /// Builds the two-level collectives of `comm` (every rank calls it with the same
    /// `ranks_per_node`, round size and transport). Compiles the kernels the first time the
    /// process needs them.
    ///
    /// # Errors
    /// `InvalidUsage` when the number of ranks is not a multiple of `ranks_per_node` (or a group
    /// is too large), the round size is zero or the scratch would pass 4 GiB; `NotAvailable`
    /// without CUDA or NVRTC; connection, bootstrap and CUDA errors naming the peer.
    pub fn new(comm: &Communicator, config: HierConfig) -> Result<TwoLevel> {
        let (rank, nranks, dev) = (comm.rank(), comm.size(), config.device);
        // What this rank sets up alone; a rank that cannot fails every rank at the first
        // exchange, named, instead of leaving them waiting for it until the bootstrap timeout.
        let local = (|| -> Result<_> {
            let topo = Topology::new(nranks, config.ranks_per_node)?;
            let layout = Layout::new(&topo, config.round_bytes)?;
            let kernels = kernels::kernels(dev)?;
            let me = format!("{:x}/{}", mscclpp::host_hash(), mscclpp::gpu::pci_bus_id(dev)?);
            let sms = mscclpp::gpu::sm_count(dev)?;
            let per_sm = kernels.min_blocks_per_sm(THREADS)?;
            Ok((topo, layout, kernels, me, sms, per_sm))
        })();
        // Kernels of every rank sharing this GPU wait on each other: all must be resident. Every
        // rank tells its GPU and how many blocks that GPU holds at once, so that every rank
        // checks every GPU: ranks on a crowded GPU fail the others at once, named.
        // Every rank must also lay out its scratch and group its nodes the same way (kernels
        // write into peers' scratch with their own layout): the second line of each message.
        let agree = |layout: &Layout| {
            // The transport's kind only: ranks may use different IB devices (IB0 here, IB3 there).
            let t = config.inter.transport;
            let kind = if t.is_ib() { "InfiniBand".to_string() } else { format!("{t:?}") };
            format!(
                "ranks_per_node {}, round_bytes {} (scratch {} bytes), inter-node transport {kind}",
                config.ranks_per_node, config.round_bytes, layout.total
            )
        };
        let ((topo, layout, kernels, me, sms, per_sm), all) = comm.all_gather_outcome(
            local,
            |(_, layout, _, me, sms, per_sm)| format!("{me}|{}\n{}", sms * per_sm, agree(layout)).into_bytes(),
            "setting up the two-level collectives",
        )?;
        let places = crate::comm::agreed_places(
            &all,
            &agree(&layout),
            "two-level collectives",
            "HierConfig sizes and transport kind",
        )?;
        let gpus = gpus_and_room(&places);
        let inter_t = config.inter.transport;
        let on_gpu = gpus.iter().filter(|(g, _)| *g == me).count().max(1) as u32;
        let fit = (sms * per_sm) / on_gpu;
        if fit == 0 {
            return Err(Error::invalid_usage(format!(
                "{on_gpu} ranks share GPU{dev}: their two-level kernels cannot all be resident at once ({sms} SMs, \
                 {per_sm} blocks each)"
            )));
        }
        if let Some((r, on)) = first_crowded(&gpus) {
            return Err(Error::invalid_usage(format!(
                "{on} ranks share rank {r}'s GPU: their two-level kernels cannot all be resident at once"
            ))
            .with_peer(r));
        }
        let blocks = config.max_blocks.clamp(1, fit);

        let ctx = comm.context();
        let (lr, mr) = (topo.ranks_per_node(), topo.nodes());
        let table_len = lr * MEM_HANDLE + mr * PORT_HANDLE;
        // Allocated after every rank lined up (an allocation may wait for the whole GPU), then
        // agreed: a rank out of memory fails every rank at once, named.
        let buffers = (|| -> Result<_> {
            let flags = TransportFlags::from(Transport::CudaIpc) | TransportFlags::from(inter_t);
            let scratch = DeviceBuffer::new(ctx, dev, layout.total as usize, flags)?;
            scratch.fill(0, layout.total as usize, 0)?;
            let handles = DeviceBuffer::new(ctx, dev, table_len.max(16), TransportFlags::NONE)?;
            let state = DeviceBuffer::new(ctx, dev, STATE_BYTES, TransportFlags::NONE)?;
            state.fill(0, STATE_BYTES, 0)?;
            Ok((scratch, handles, state, DeviceStatus::new(ctx, dev)?))
        })()
        .map_err(|e| e.during("allocating the two-level buffers"));
        let ((scratch, handles, state, status), _) =
            comm.all_gather_outcome(buffers, |_| Vec::new(), "checking that every rank has its two-level buffers")?;

        // The pairwise part, in the order of `mesh`: this rank's scratch and endpoints to every
        // peer, an exchange (a rank that could not send them fails every rank there, named), the
        // semaphores (each needs that peer's endpoint), then the waits; a failure with one peer
        // does not stop what is owed to the others. A rank that fails later (a peer that never
        // answered, a mapping or the proxy that failed) says so at the closing exchange, with
        // its connections kept open until then (`hold`), so that every rank fails at once, named.
        let mut hold = Vec::new();
        let paired = (|| -> Result<_> {
            let mut first = FirstError::default();
            let ipc = EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev));
            let mut pending = Vec::new();
            for (peers, ep, tag) in
                [(topo.node_peers(rank), &ipc, TAG_INTRA), (topo.cross_peers(rank), &config.inter, TAG_INTER)]
            {
                for p in peers {
                    // Without our scratch the peer cannot finish with us: no endpoint either.
                    if first.keep(comm.send_memory(scratch.memory(), p, tag).map_err(|e| e.with_peer(p))).is_none() {
                        continue;
                    }
                    let mem = first.keep(comm.recv_memory(p, tag).map_err(|e| e.with_peer(p)));
                    let conn = first.keep(comm.connect(ep, p, tag).map_err(|e| e.with_peer(p)));
                    if let (Some(mem), Some(conn)) = (mem, conn) {
                        pending.push((p, tag, mem, conn));
                    }
                }
            }
            comm.all_gather_outcome(
                first.into_result(),
                |_| Vec::new(),
                "sending the two-level scratch and endpoints",
            )?;
            let mut first = FirstError::default();
            let mut built = Vec::new();
            for (p, tag, mem, conn) in pending {
                let (what, t) =
                    if tag == TAG_INTRA { ("a node peer", Transport::CudaIpc) } else { ("a cross-node peer", inter_t) };
                let waited = conn.wait().map_err(|e| e.during(format!("connecting to {what} over {t}")).with_peer(p));
                let Some(conn) = first.keep(waited) else { continue };
                hold.push(conn.clone());
                if let Some(sem) = first.keep(comm.build_semaphore(&conn, p, tag).map_err(|e| e.with_peer(p))) {
                    built.push((p, tag, mem, conn, sem));
                }
            }
            let (mut intra_sems, mut inter_sems) = (Vec::new(), Vec::new());
            for (p, tag, mem, conn, sem) in built {
                let Some(mem) = first.keep(mem.wait().map_err(|e| e.with_peer(p))) else { continue };
                if tag == TAG_INTRA {
                    intra_sems.push((p, mem, sem));
                } else {
                    inter_sems.push((p, mem, sem, conn));
                }
            }
            first.into_result()?;
            // Nothing more is owed to anyone: the rest writes, waits and maps. Warm-up: one small
            // write each way before any kernel runs, so that what a transport creates on first
            // use (Ethernet: pinned staging buffers and a stream per direction) is not created
            // while kernels spin waiting for this very data. The bytes land in the peer's
            // AllReduce staging area, which every call overwrites before reading.
            for (p, mem, _, conn) in &inter_sems {
                conn.write(mem, layout.in_off, scratch.memory(), layout.in_off, 16)
                    .map_err(|e| e.during("warming up a cross-node connection").with_peer(*p))?;
            }
            for (p, _, _, conn) in &inter_sems {
                conn.flush(config.timeout).map_err(|e| e.during("warming up a cross-node connection").with_peer(*p))?;
            }

            let mut table = vec![0u8; table_len];
            let mut mem_channels = Vec::new();
            for (p, mem, sem) in intra_sems {
                let sem = sem.wait().map_err(|e| e.during("building a node peer's semaphore").with_peer(p))?;
                let sem = MemoryDevice2DeviceSemaphore::new(sem).map_err(|e| e.with_peer(p))?;
                let ch = MemoryChannel::new(sem, &mem, scratch.memory(), None)
                    .map_err(|e| e.during("mapping a node peer's scratch").with_peer(p))?;
                let l = topo.local_of(p);
                table[l * MEM_HANDLE..(l + 1) * MEM_HANDLE].copy_from_slice(&ch.device_handle().to_bytes());
                mem_channels.push(ch);
            }
            let mut proxy = ProxyService::new(ctx, dev, config.proxy.clone())?;
            let src = proxy.add_memory(scratch.memory().clone())?;
            let mut port_channels = Vec::new();
            for (p, mem, sem, _conn) in inter_sems {
                let sem = sem.wait().map_err(|e| e.during("building a cross-node peer's semaphore").with_peer(p))?;
                let sid = proxy.add_semaphore(Host2DeviceSemaphore::new(sem).map_err(|e| e.with_peer(p))?)?;
                let dst = proxy.add_memory(mem)?;
                let ch = proxy.port_channel(sid, dst, src)?;
                let off = lr * MEM_HANDLE + topo.node_of(p) * PORT_HANDLE;
                table[off..off + PORT_HANDLE].copy_from_slice(&ch.device_handle().to_bytes());
                port_channels.push(ch);
            }
            proxy.start()?;
            handles.write(0, &table)?;
            Ok((proxy, mem_channels, port_channels))
        })();
        // Nobody launches before every rank has its kernels loaded and its peers mapped.
        let ((proxy, mem_channels, port_channels), _) =
            comm.all_gather_outcome(paired, |_| Vec::new(), "connecting the two-level collectives' ranks")?;
        tracing::debug!(target: "mscclpp::collectives", rank, nranks, ranks_per_node = topo.ranks_per_node(), nodes = topo.nodes(), inter = %inter_t, blocks, scratch = layout.total, "two-level collectives ready");
        Ok(TwoLevel {
            proxy,
            rank,
            device: dev,
            topo,
            layout,
            timeout: config.timeout,
            blocks,
            kernels,
            scratch,
            handles,
            state,
            status,
            _mem_channels: mem_channels,
            _port_channels: port_channels,
            calls: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The node groups.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }
    /// The scratch layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Blocks per launch.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }
    /// The schedule this rank runs for a call (`nbytes`: the buffer of an AllReduce, the
    /// segment of an AllGather).
    ///
    /// # Errors
    /// As [`schedule::schedule`].
    pub fn schedule(&self, collective: Collective, nbytes: u64, dtype: DataType) -> Result<schedule::Schedule> {
        schedule::schedule(&self.topo, &self.layout, self.rank, collective, nbytes, dtype.size())
    }

    /// The error a kernel of this rank reported, if any (non-blocking).
    ///
    /// # Errors
    /// `Timeout` naming the rank that never arrived; `Remote` when the proxy failed (with its
    /// error) or after [`abort`](Self::abort) or an earlier failure.
    pub fn check(&self) -> Result<()> {
        let reported = self.status.read()?;
        if !matches!(reported, Reported::Error { .. })
            && let Err(e) = self.proxy.status()
        {
            self.status.mark_failed();
            return Err(e.during(format!("rank {}: the two-level proxy failed", self.rank)));
        }
        let (kind, peer, code) = match reported {
            Reported::Clear => return Ok(()),
            Reported::FailedBefore => {
                return Err(Error::remote(format!(
                    "rank {}: the two-level collectives failed earlier and refuse further calls",
                    self.rank
                )));
            }
            Reported::Error { kind, peer, code } => (kind, peer, code),
        };
        let r = self.rank;
        let e = match kind {
            ERR_TIMEOUT => {
                let how = if self.topo.node_of(peer) == self.topo.node_of(r) {
                    "node peer".to_string()
                } else {
                    let proxy = match self.proxy.status() {
                        Ok(()) => "working".to_string(),
                        Err(e) => format!("failed: {e}"),
                    };
                    format!(
                        "cross-node peer; this rank's proxy executed {} triggers and is {proxy}",
                        self.proxy.processed()
                    )
                };
                Error::timeout(
                    format!("rank {r}: a two-level collective waited for rank {peer} ({how}), which never arrived"),
                    self.timeout,
                )
                .with_peer(peer)
            }
            ERR_PROXY => {
                let why = self.proxy.status().err().map_or_else(|| "no error recorded".to_string(), |e| e.to_string());
                Error::remote(format!("rank {r}: the proxy failed while exchanging with rank {peer}: {why}"))
                    .with_peer(peer)
            }
            ERR_ABORTED => Error::remote(format!("rank {r}: the two-level collectives were aborted")),
            ERR_FAILED_BEFORE => Error::remote(format!(
                "rank {r}: a two-level collective ran after an earlier one failed and did nothing"
            )),
            ERR_MISMATCH => {
                let how = if self.topo.node_of(peer) == self.topo.node_of(r) { "node peer" } else { "cross-node peer" };
                Error::invalid_usage(format!(
                    "rank {r}: {how} rank {peer} made another two-level call (collective, type, operation, count or \
                     call number differ: a call refused, skipped or failed on one rank shifts the numbering); every \
                     rank must make the same calls in the same order"
                ))
                .with_peer(peer)
            }
            ERR_GRID => Error::internal(format!(
                "rank {r}: the blocks of a two-level kernel were not all resident (a grid barrier timed out)"
            )),
            _ => Error::internal(format!("rank {r}: unknown two-level error word {code:#x}")),
        };
        Err(e.during("a two-level collective"))
    }

    /// Asks every running and future kernel of this rank to stop waiting and fail.
    ///
    /// # Errors
    /// CUDA errors writing the request.
    pub fn abort(&self) -> Result<()> {
        self.status.abort()
    }

    /// Waits (bounded) for `stream` to finish, then [`check`](Self::check)s.
    ///
    /// # Errors
    /// `Timeout` when the stream is still busy after `timeout`; the errors of `check`.
    pub fn synchronize(&self, stream: &Stream, timeout: Duration) -> Result<()> {
        let r = stream.synchronize(timeout);
        self.check()?;
        r
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        coll: Collective,
        input: u64,
        in_len: u64,
        output: u64,
        out_len: u64,
        nbytes: u64,
        dtype: DataType,
        op: Option<ReduceOp>,
        stream: &Stream,
    ) -> Result<()> {
        let what =
            || format!("two-level {coll} ({dtype}, {nbytes} bytes, rank {} of {})", self.rank, self.topo.nranks());
        self.check().map_err(|e| e.during(what()))?;
        // Every call counts, one of no bytes or one refused below too: the ranks' numbers stay
        // equal while they make the same calls.
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if nbytes == 0 {
            return Ok(());
        }
        crate::comm::check_call(
            self.device,
            stream,
            dtype,
            [(input, in_len, "input"), (output, out_len, "output")],
            &what,
        )?;
        let (name, opcode) = match coll {
            Collective::AllReduce => (kernels::all_reduce_name(dtype), op.map_or(0, |o| o.code())),
            _ => (kernels::ALL_GATHER_NAME.to_string(), 0),
        };
        let kernel = self.kernels.named(&name)?;
        let l = &self.layout;
        let args = HierArgs {
            input,
            output,
            nbytes,
            op: opcode,
            rank: self.rank as u64,
            nranks: self.topo.nranks() as u64,
            local: self.topo.local_of(self.rank) as u64,
            nlocal: self.topo.ranks_per_node() as u64,
            node: self.topo.node_of(self.rank) as u64,
            nnodes: self.topo.nodes() as u64,
            mem: self.handles.device_ptr(),
            port: self.handles.device_ptr() + (self.topo.ranks_per_node() * MEM_HANDLE) as u64,
            scratch: self.scratch.device_ptr(),
            state: self.state.device_ptr(),
            err: self.status.error_word(),
            abort: self.status.abort_word(),
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX / 8).min(u64::MAX / 8),
            ar_round: l.ar_round,
            ag_round: l.ag_round,
            in_off: l.in_off,
            res_off: l.res_off,
            x_off: l.x_off,
            x_stride: l.x_stride,
            col_off: l.col_off,
            col_stride: l.col_stride,
            sig_off: l.sig_off,
            sig: signature(coll, dtype, op, nbytes, call),
        };
        // SAFETY: the caller guarantees input/output for the sizes checked above until the call
        // finishes on the stream; scratch, handles, state and error words live as long as self.
        unsafe { kernels::launch(kernel, self.blocks, THREADS, stream, &args) }.map_err(|e| e.during(what()))
    }

    /// AllReduce of `count` elements of `dtype` from `send` into `recv` (equal for in place) on
    /// `stream`. Every type of [`DataType`] and every [`ReduceOp`] (`Avg` divides the sum by the
    /// number of ranks; integers truncate). Every rank gets the same bits: the reductions run in
    /// a fixed order (local ranks, then nodes).
    ///
    /// # Errors
    /// `InvalidUsage` for pointers that are not device memory of this GPU for `count` elements,
    /// misaligned pointers, a stream of another GPU; the error of an earlier failed call; CUDA
    /// launch errors.
    ///
    /// # Safety
    /// `send` and `recv` point to `count` elements of device memory that stay valid (and `send`
    /// unchanged) until the call finishes on `stream`; every rank makes the same call.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let n = crate::comm::byte_len(count, dtype, 1)?;
        // SAFETY: the caller's contract.
        unsafe { self.run(Collective::AllReduce, send, n, recv, n, n, dtype, Some(op), stream) }
    }

    /// AllGather: `send_count` elements from every rank's `send` into every rank's `recv`
    /// (`nranks` x `send_count` elements, rank order). In place: `send == recv + rank * bytes`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    ///
    /// # Safety
    /// As `all_reduce`, with `recv` holding `nranks * send_count` elements.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        send_count: usize,
        dtype: DataType,
        stream: &Stream,
    ) -> Result<()> {
        let n = crate::comm::byte_len(send_count, dtype, 1)?;
        let total = crate::comm::byte_len(send_count, dtype, self.topo.nranks())?;
        // SAFETY: the caller's contract.
        unsafe { self.run(Collective::AllGather, send, n, recv, total, n, dtype, None, stream) }
    }

    /// Stops the proxy (after the last call finished on every stream) and returns its first
    /// error, if any. Dropping does the same, logging the error.
    ///
    /// # Errors
    /// The proxy's first error.
    pub fn stop(&mut self) -> Result<()> {
        self.proxy.stop()
    }
}

/// The CUDA source of the two-level kernels (the device header included by name).
pub fn kernel_source() -> String {
    kernels::source()
}

/// Every rank's GPU and how many two-level blocks it holds at once, by rank, from each rank's
/// `"{gpu}|{blocks}"` (a rank that sent no count holds none).
pub(crate) fn gpus_and_room(all: &[String]) -> Vec<(String, u64)> {
    all.iter()
        .map(|w| match w.rsplit_once('|') {
            Some((g, room)) => (g.to_string(), room.parse().unwrap_or(0)),
            None => (w.clone(), 0),
        })
        .collect()
}

/// The first rank (by rank) on a GPU that cannot hold one block of every rank on it at once,
/// and how many ranks share that GPU.
fn first_crowded(gpus: &[(String, u64)]) -> Option<(usize, usize)> {
    let mut on = std::collections::HashMap::new();
    for (g, _) in gpus {
        *on.entry(g.as_str()).or_insert(0usize) += 1;
    }
    gpus.iter().enumerate().find_map(|(r, (g, room))| {
        let n = on[g.as_str()];
        (*room / n as u64 == 0).then_some((r, n))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank finds the first rank whose GPU is crowded, its own GPU or another.
    #[test]
    fn a_crowded_gpu_is_found_by_every_rank() {
        let all = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let g = gpus_and_room(&all(&["h/0|4", "h/1|2", "h/1|2", "h/0|4"]));
        assert_eq!(g[1], ("h/1".to_string(), 2));
        assert_eq!(first_crowded(&g), None);
        let g = gpus_and_room(&all(&["h/0|4", "h/1|2", "h/1|2", "h/1|2"]));
        assert_eq!(first_crowded(&g), Some((1, 3)));
        // A GPU id with '|' in it, a count that does not parse.
        let g = gpus_and_room(&all(&["a|b|8", "x/9|many"]));
        assert_eq!(g, vec![("a|b".to_string(), 8), ("x/9".to_string(), 0)]);
        assert_eq!(first_crowded(&g), Some((1, 1)));
    }
}
