//! [`Collectives`]: the per-communicator object that owns the scratch, the channels and the
//! device state, and runs collective calls on a stream.
//!
//! `unsafe` here is the raw-pointer API (device pointers the caller vouches for) and the one
//! launch it leads to; everything else is checked.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream, check_device_range};
use mscclpp::{Communicator, Error, MemoryChannel, MemoryDevice2DeviceSemaphore, Result, Transport, TransportFlags};

use crate::external::{self, CallShape, ExternalAlgorithm, ExternalId};
use crate::kernels::{self, CollArgs, INLINE_PEERS, Kernels, STATE_BYTES};
use crate::select::{self, Layout, Limits, MAX_BLOCKS, Plan};
use crate::status::{DeviceStatus, Reported};
use crate::types::{Algorithm, Collective, DataType, ReduceOp};

mod window;
pub use window::Window;

/// How a [`Collectives`] is built.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// The GPU of this rank.
    pub device: u32,
    /// How long a device wait (for a peer's data or signal) may last before the call fails
    /// naming the peer. Default 30 s; `Duration::MAX` means no limit.
    pub timeout: Duration,
    /// Bytes of each of the two packet halves of the scratch (LL algorithms). Default 8 MiB:
    /// AllReduce by packets up to 1 MiB at 8 ranks.
    pub packet_bytes: u64,
    /// Bytes one round of the staged algorithms moves per rank buffer (the scratch holds two).
    /// Default 32 MiB; larger messages run in rounds.
    pub simple_bytes: u64,
    /// Selector thresholds (algorithm by size); `max_blocks` is lowered to what fits on the GPU.
    pub limits: Limits,
    /// Time AllReduce plans per power-of-two size at setup (see [`crate::tune`]); default on,
    /// off with `MSCCLPP_COLLECTIVES_TUNE=0`.
    pub tune: bool,
    /// Launch the kernels as programmatic dependent launches where the GPU and driver take them
    /// (compute capability 9.0, CUDA 12.3 driver and later): a call's kernel is scheduled while
    /// the kernel before it on the stream finishes, and waits on the GPU for it, which saves the
    /// gap between the two (back-to-back calls, or a call after a kernel that allows it). Used
    /// only for launches small enough that two of every rank sharing the GPU fit at once.
    /// Default on (measured on an H100, 2 processes under MPS: 1 KiB AllReduce 2.85 -> 2.08-2.22
    /// us in a CUDA graph, 3.96 -> 3.21 us eager); off with `MSCCLPP_COLLECTIVES_PDL=0`.
    ///
    /// A kernel *you* launch programmatically right after a call may then be scheduled while the
    /// call still runs (as after any kernel that allows it). With one rank per GPU that is
    /// harmless; when several ranks share a GPU its blocks can take room a peer's collective
    /// kernel needs, and the call then fails at its timeout: keep such launches out of jobs that
    /// share GPUs between ranks, or leave this off. Other collectives objects on the same GPU
    /// (two-level, point-to-point) are not counted either.
    pub programmatic_launch: bool,
}

/// Whether [`Config::programmatic_launch`] is on by default (`MSCCLPP_COLLECTIVES_PDL` unset).
const PDL_DEFAULT: bool = true;

impl Config {
    /// The defaults for GPU `device`.
    pub fn new(device: u32) -> Config {
        let tune = std::env::var("MSCCLPP_COLLECTIVES_TUNE")
            .map_or(true, |v| !matches!(v.trim(), "0" | "false" | "no" | "off"));
        let programmatic_launch = std::env::var("MSCCLPP_COLLECTIVES_PDL")
            .map_or(PDL_DEFAULT, |v| !matches!(v.trim(), "0" | "false" | "no" | "off"));
        Config {
            device,
            timeout: Duration::from_secs(30),
            packet_bytes: 8 << 20,
            simple_bytes: 32 << 20,
            limits: Limits::default(),
            tune,
            programmatic_launch,
        }
    }
    /// Turns programmatic dependent launches on or off (see [`Config::programmatic_launch`]).
    pub fn programmatic_launch(mut self, yes: bool) -> Config {
        self.programmatic_launch = yes;
        self
    }
    /// Turns setup-time tuning on or off.
    pub fn tune(mut self, yes: bool) -> Config {
        self.tune = yes;
        self
    }
    /// Sets the device wait limit.
    pub fn timeout(mut self, t: Duration) -> Config {
        self.timeout = t;
        self
    }
    /// Sets the packet half size.
    pub fn packet_bytes(mut self, n: u64) -> Config {
        self.packet_bytes = n;
        self
    }
    /// Sets the staged round size.
    pub fn simple_bytes(mut self, n: u64) -> Config {
        self.simple_bytes = n;
        self
    }
    /// Sets the selector thresholds.
    pub fn limits(mut self, l: Limits) -> Config {
        self.limits = l;
        self
    }
}

/// Per-call choices that override the selector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallOptions {
    /// Run this built-in algorithm (an error if it cannot serve the call); registered
    /// [`ExternalAlgorithm`]s are then not considered.
    pub algorithm: Option<Algorithm>,
    /// Run the registered [`ExternalAlgorithm`] of this name (an error if it is not registered
    /// or cannot serve the call); see [`CallOptions::external`].
    pub external: Option<ExternalId>,
    /// Blocks per rank (capped to what fits on the GPU).
    pub blocks: Option<u32>,
    /// Threads per block (32..=512, a multiple of 32).
    pub threads: Option<u32>,
    /// Reduce f16/bf16 in f32 and round once at the end (default: round after every step).
    /// Built-in algorithms only: a registered external algorithm (an execution plan) reduces as
    /// it was written.
    pub accumulate_f32: bool,
}

impl CallOptions {
    /// Options naming an algorithm.
    pub fn algorithm(a: Algorithm) -> CallOptions {
        CallOptions { algorithm: Some(a), ..CallOptions::default() }
    }
    /// Options naming a registered [`ExternalAlgorithm`] by its
    /// [`name`](ExternalAlgorithm::name).
    pub fn external(name: &str) -> CallOptions {
        CallOptions { external: Some(ExternalId::of(name)), ..CallOptions::default() }
    }
    /// Sets blocks and threads.
    pub fn shape(mut self, blocks: u32, threads: u32) -> CallOptions {
        self.blocks = Some(blocks);
        self.threads = Some(threads);
        self
    }
    /// Sets f32 accumulation.
    pub fn accumulate_f32(mut self, yes: bool) -> CallOptions {
        self.accumulate_f32 = yes;
        self
    }
}

/// Collectives over the ranks of one [`Communicator`], on one GPU per rank.
///
/// Build it on every rank at once (it exchanges scratch buffers and connects every pair over
/// CUDA IPC, so all ranks must be on one host); then every rank makes the same calls in the same
/// order, each on its own stream. Calls are asynchronous (stream-ordered) and may be captured in
/// a CUDA graph: the scratch, channels and counters are built once here and stay valid for every
/// replay. Every device wait is bounded by [`Config::timeout`]: a rank that never arrives makes
/// the others' kernels end, and [`check`](Self::check) (or the next call) returns an error
/// naming it; after that the object refuses further calls.
///
/// Scratch: [`scratch_bytes`](Self::scratch_bytes) of GPU memory per rank (about 2 x
/// `packet_bytes` + 2 x `simple_bytes`, 80 MiB by default).
///
/// Ranks as threads of one process on one GPU (as in the example) share a CUDA context: set
/// `CUDA_DEVICE_MAX_CONNECTIONS=32` before CUDA starts
/// ([`mscclpp::gpu::use_all_hw_queues`]), and let no rank thread queue its next call (or graph
/// launch) before every rank has queued the current one; a rank that runs two calls ahead can
/// leave a peer's launch queued behind its own until a device timeout (docs/design.md,
/// "Hardware queues and ranks as threads"). Ranks as processes need neither.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use mscclpp::{Communicator, RootServer, TcpBootstrap, gpu::{DeviceBuffer, Stream}, TransportFlags};
/// use mscclpp_collectives::{Collectives, Config, DataType, ReduceOp};
/// // Two ranks as two threads of one process, both on GPU 0.
/// let (root, id) = RootServer::start(2, Duration::from_secs(30))?;
/// let rank_main = |rank: usize| -> mscclpp::Result<Vec<u8>> {
///     let bs = Arc::new(TcpBootstrap::initialize(rank, 2, &id)?);
///     let comm = Communicator::new(bs);
///     let coll = Collectives::new(&comm, Config::new(0))?;
///     let stream = Stream::new(0)?;
///     let buf = DeviceBuffer::new(comm.context(), 0, 4096, TransportFlags::NONE)?;
///     buf.write(0, &[rank as u8 + 1; 4096])?;
///     coll.all_reduce_buffers(&buf, &buf, 1024, DataType::U32, ReduceOp::Sum, &stream)?; // in place
///     coll.synchronize(&stream, Duration::from_secs(10))?;
///     buf.to_vec()
/// };
/// let (a, b) = std::thread::scope(|s| {
///     let other = s.spawn(|| rank_main(1));
///     (rank_main(0), other.join().expect("rank 1 panicked"))
/// });
/// assert_eq!(a?, b?);
/// # drop(root);
/// # Ok::<(), mscclpp::Error>(())
/// ```
pub struct Collectives {
    /// This object's number in the process (a [`Window`] remembers the one it was made by).
    id: u64,
    rank: usize,
    nranks: usize,
    device: u32,
    layout: Layout,
    limits: Limits,
    timeout: Duration,
    kernels: Arc<Kernels>,
    /// Kept alive: every peer has this scratch mapped (the address is in `peers_table`).
    _scratch: DeviceBuffer,
    peers_table: DeviceBuffer,
    /// The first [`INLINE_PEERS`] entries of `peers_table`, passed in every launch's arguments.
    inline_peers: [u64; INLINE_PEERS],
    state: DeviceBuffer,
    expected: DeviceBuffer,
    /// Page-locked: word 0 is the error the kernels report, word 1 the abort request.
    status: DeviceStatus,
    tuned: std::sync::RwLock<Option<Arc<crate::tune::TuneTable>>>,
    /// How long setup spent tuning (`None` with tuning off).
    tuning_time: Option<Duration>,
    _channels: Vec<MemoryChannel>,
    /// Per peer, the semaphore its channels share (windows map more memory through it).
    peer_sems: Vec<(usize, Arc<MemoryDevice2DeviceSemaphore>)>,
    /// Ranks on this rank's host.
    ranks_per_node: usize,
    /// Launches of at most this many blocks are programmatic dependent launches (half the
    /// blocks of this GPU's residency cap, so that a rank's next kernel, scheduled early, never
    /// takes the room a peer's current one needs); 0: none are.
    programmatic_blocks: u32,
    /// Registered external algorithms, in registration order (the same on every rank).
    external: std::sync::RwLock<Vec<Arc<dyn ExternalAlgorithm>>>,
    /// Whether `external` is non-empty (read without the lock on every call).
    has_external: std::sync::atomic::AtomicBool,
    comm: Communicator,
}

/// What [`Collectives::new`] allocates before it connects.
struct Buffers {
    scratch: DeviceBuffer,
    peers_table: DeviceBuffer,
    state: DeviceBuffer,
    expected: DeviceBuffer,
    status: DeviceStatus,
}

/// The checks every call makes before it launches: the stream is on the collectives' GPU, and
/// each `(pointer, bytes, name)` is device memory of that GPU, aligned to its elements, with
/// `bytes` inside its allocation. Errors say `what()` the call was.
pub(crate) fn check_call<const N: usize>(
    device: u32,
    stream: &Stream,
    dtype: DataType,
    buffers: [(u64, u64, &str); N],
    what: &dyn Fn() -> String,
) -> Result<()> {
    if stream.device() != device {
        return Err(Error::invalid_usage(format!(
            "{}: the stream is on GPU{}, the collectives on GPU{device}",
            what(),
            stream.device()
        )));
    }
    let es = dtype.size() as u64;
    for (ptr, len, name) in buffers {
        if ptr % es != 0 {
            return Err(Error::invalid_usage(format!(
                "{}: the {name} pointer {ptr:#x} is not aligned to its {es}-byte elements",
                what()
            )));
        }
        let g = check_device_range(ptr, len, name).map_err(|e| e.during(what()))?;
        if g != device {
            return Err(Error::invalid_usage(format!(
                "{}: the {name} is on GPU{g}, the collectives on GPU{device}",
                what()
            )));
        }
    }
    Ok(())
}

/// `count` elements of `dtype`, `times` over, in bytes; `InvalidUsage` where that passes what a
/// `u64` holds (it wrapped before: a huge count could become a call of a few bytes).
pub(crate) fn byte_len(count: usize, dtype: DataType, times: usize) -> Result<u64> {
    (count as u64).checked_mul(dtype.size() as u64).and_then(|n| n.checked_mul(times as u64)).ok_or_else(|| {
        Error::invalid_usage(format!(
            "{count} elements of {dtype}{} are more bytes than a 64-bit size holds",
            if times > 1 { format!(" x {times} ranks") } else { String::new() }
        ))
    })
}

/// What every rank's collectives must agree on, as text: kernels write into their peers'
/// scratch with their own layout (a rank with larger packet halves would write past a peer's
/// scratch), the selector's thresholds (or their plans differ) and whether they tune (a
/// collective step).
fn agreement(layout: &Layout, config: &Config) -> String {
    format!(
        "scratch layout {}/{}/{}/{} bytes (packet_bytes {}, simple_bytes {}), allpair_max {}, packet_max {}, tuning {}",
        layout.pkt_off,
        layout.pkt_half,
        layout.simple_round,
        layout.total,
        config.packet_bytes,
        config.simple_bytes,
        config.limits.allpair_max,
        config.limits.packet_max,
        if config.tune { "on" } else { "off" }
    )
}

/// Checks every rank's setup message, `place\nagreement`, against this rank's agreement `mine`
/// (naming the first rank that differs: "rank p set up its `object` with ..., every rank must
/// use the same `settings`") and returns each rank's place, by rank. Shared by the setups of
/// [`Collectives`] and the two-level collectives.
pub(crate) fn agreed_places(all: &[Vec<u8>], mine: &str, object: &str, settings: &str) -> Result<Vec<String>> {
    let mut places = Vec::with_capacity(all.len());
    for (p, w) in all.iter().enumerate() {
        let w = String::from_utf8_lossy(w);
        let (place, theirs) = w.split_once('\n').unwrap_or((&w, ""));
        if theirs != mine {
            return Err(Error::invalid_usage(format!(
                "rank {p} set up its {object} with {theirs:?}, this rank with {mine:?}: every rank must use the same \
                 {settings}"
            ))
            .with_peer(p));
        }
        places.push(place.to_string());
    }
    Ok(places)
}

const ERR_TIMEOUT: u64 = 1;
const ERR_MISMATCH: u64 = 2;
const ERR_ABORTED: u64 = 3;
const ERR_FAILED_BEFORE: u64 = 4;

impl Collectives {
    /// Builds the collectives of `comm` on `config.device` (a collective call: every rank of
    /// `comm` calls it). Compiles the kernels the first time a process needs them (NVRTC), so
    /// every rank has them loaded before any rank launches one.
    ///
    /// # Errors
    /// `NotAvailable` without CUDA or NVRTC; `InvalidUsage` when a peer is on another host (the
    /// collectives here use CUDA IPC) or more ranks share a GPU than can be resident together;
    /// bootstrap and CUDA errors naming the peer.
    pub fn new(comm: &Communicator, config: Config) -> Result<Collectives> {
        let (rank, nranks, dev) = (comm.rank(), comm.size(), config.device);
        // What this rank sets up alone; a rank that cannot (no NVRTC, a kernel that does not
        // compile, a bad configuration) fails every rank at the first exchange, named, instead of
        // leaving them waiting for it until the bootstrap timeout.
        let local = (|| -> Result<_> {
            let layout = Layout::new(nranks, config.packet_bytes, config.simple_bytes)?;
            let kernels = kernels::kernels(dev)?;
            let me = format!("{:x}/{}", mscclpp::host_hash(), mscclpp::gpu::pci_bus_id(dev)?);
            Ok((layout, kernels, me))
        })();
        // Which ranks share this GPU: kernels that wait on each other must all be resident. The
        // same exchange checks that every rank set up alike (see `agreement`).
        let ((layout, kernels, me), all) = comm.all_gather_outcome(
            local,
            |(layout, _, me)| format!("{me}\n{}", agreement(layout, &config)).into_bytes(),
            "setting up the collectives",
        )?;
        let all = agreed_places(
            &all,
            &agreement(&layout, &config),
            "collectives",
            "Config sizes, limits and tuning setting",
        )?;
        let my_host = me.split('/').next().unwrap_or_default();
        for (p, who) in all.iter().enumerate() {
            if who.split('/').next() != Some(my_host) {
                return Err(Error::invalid_usage(format!(
                    "rank {p} is on another host: these collectives connect ranks over CUDA IPC within one host"
                ))
                .with_peer(p));
            }
        }
        let on_gpu = all.iter().filter(|w| **w == me).count();
        let ranks_per_node = all.iter().filter(|w| w.split('/').next() == Some(my_host)).count();
        let mut limits = config.limits;
        // Only the ranks on this GPU refuse too many ranks sharing it: the others learn of it at
        // the cap exchange, named, instead of waiting for them there. The buffers are allocated
        // before that exchange too, so a rank that runs out of memory fails every rank there.
        let ctx = comm.context();
        let cap = (|| -> Result<(u32, Buffers)> {
            let sms = mscclpp::gpu::sm_count(dev)?;
            let per_sm = kernels.min_blocks_per_sm(512)?.max(1);
            let cap = select::residency_cap(sms, per_sm, on_gpu)?;
            let buffers = (|| -> Result<Buffers> {
                Ok(Buffers {
                    scratch: DeviceBuffer::new(ctx, dev, layout.total as usize, Transport::CudaIpc.into())?,
                    peers_table: DeviceBuffer::new(ctx, dev, nranks * 8, TransportFlags::NONE)?,
                    state: DeviceBuffer::new(ctx, dev, STATE_BYTES, TransportFlags::NONE)?,
                    expected: DeviceBuffer::new(ctx, dev, nranks * MAX_BLOCKS as usize * 8, TransportFlags::NONE)?,
                    status: DeviceStatus::new(ctx, dev)?,
                })
            })()
            .map_err(|e| e.during("allocating the collectives' buffers"))?;
            Ok((cap, buffers))
        })();
        // Every rank plans with the same cap (the smallest), so their default plans agree.
        let max_blocks = limits.max_blocks;
        let ((cap, buffers), caps) = comm.all_gather_outcome(
            cap,
            |(c, _)| max_blocks.min(*c).to_le_bytes().to_vec(),
            "agreeing on the collectives' block cap, buffers allocated",
        )?;
        let Buffers { scratch, peers_table, state, expected, status } = buffers;
        let supported = mscclpp::gpu::programmatic_launch_supported(dev).unwrap_or(false);
        let programmatic_blocks = select::programmatic_blocks(supported, config.programmatic_launch, cap);
        limits.max_blocks = limits.max_blocks.min(cap);
        for c in caps {
            let c: [u8; 4] = c.as_slice().try_into().map_err(|_| Error::remote("a peer sent a malformed block cap"))?;
            limits.max_blocks = limits.max_blocks.min(u32::from_le_bytes(c).max(1));
        }

        // The pairwise part (see `mesh`); a rank that fails in it (a peer that never answered, a
        // mapping that failed) says so at the closing exchange, so that every rank fails at
        // once, named, instead of waiting there for it.
        let mut hold = Vec::new();
        let paired = (|| -> Result<_> {
            let m = crate::mesh::mesh(comm, &scratch, dev, 0x00c0_11ec, "collectives", &mut hold)?;
            let bytes: Vec<u8> = m.table.iter().flat_map(|p| p.to_le_bytes()).collect();
            peers_table.write(0, &bytes)?;
            state.write(0, &1u32.to_le_bytes())?; // the first LL flag
            Ok((m.table, m.channels, m.sems))
        })();
        // Nobody launches before every rank has its kernels loaded and its scratch mapped.
        let ((table, channels, peer_sems), _) =
            comm.all_gather_outcome(paired, |_| Vec::new(), "connecting the collectives' ranks")?;
        let mut inline_peers = [0u64; INLINE_PEERS];
        for (slot, addr) in inline_peers.iter_mut().zip(&table) {
            *slot = *addr;
        }
        tracing::debug!(target: "mscclpp::collectives", rank, nranks, gpu = dev, on_gpu, max_blocks = limits.max_blocks, scratch = layout.total, "collectives ready");
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Collectives {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            rank,
            nranks,
            device: dev,
            layout,
            limits,
            timeout: config.timeout,
            kernels,
            _scratch: scratch,
            peers_table,
            inline_peers,
            state,
            expected,
            status,
            tuned: std::sync::RwLock::new(None),
            tuning_time: None,
            _channels: channels,
            peer_sems,
            ranks_per_node,
            programmatic_blocks,
            external: std::sync::RwLock::new(Vec::new()),
            has_external: std::sync::atomic::AtomicBool::new(false),
            comm: comm.clone(),
        })
        .and_then(|mut c| {
            if config.tune {
                let start = std::time::Instant::now();
                let table = crate::tune::tune_all_reduce(&c, comm)?;
                c.set_tuning(Some(table));
                c.tuning_time = Some(start.elapsed());
            }
            Ok(c)
        })
    }

    /// How long [`Collectives::new`] spent tuning (timing candidates on the GPU and agreeing
    /// with the other ranks; near zero when the process cache had the table); `None` when
    /// tuning was off ([`Config::tune`]).
    pub fn tuning_time(&self) -> Option<Duration> {
        self.tuning_time
    }

    /// The AllReduce plans in force from tuning, if any.
    pub fn tuning(&self) -> Option<Arc<crate::tune::TuneTable>> {
        self.tuned.read().ok().and_then(|t| t.clone())
    }

    /// Installs (or with `None` removes) a tuning table. Every rank must install the same one.
    pub fn set_tuning(&self, table: Option<Arc<crate::tune::TuneTable>>) {
        if let Ok(mut t) = self.tuned.write() {
            *t = table;
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.nranks
    }
    /// The GPU.
    pub fn device(&self) -> u32 {
        self.device
    }
    /// Ranks on this rank's host (all of them: these collectives run within one host).
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// Registers an algorithm from outside this crate (an MSCCL++ execution plan through
    /// `mscclpp_executor::PlanAlgorithm`, or any [`ExternalAlgorithm`]): from now on, a call it
    /// serves (its collective, this communicator's world size and ranks per node, a message size
    /// in its range, a placement it supports) runs it instead of the built-in selection, unless
    /// [`CallOptions::algorithm`] forces a built-in algorithm; [`CallOptions::external`] runs it
    /// by name. Where several serve a call, the first registered wins.
    ///
    /// Each rank decides by its own call, placement included: when a registered algorithm
    /// serves only one placement (an in-place plan), the ranks of one call must all use that
    /// placement or all the other, or some run the algorithm and some the built-in one and the
    /// call times out (NCCL lets ranks differ in placement; MSCCL++'s plans do not either).
    ///
    /// A collective call: every rank registers the same algorithms in the same order. The
    /// ranks exchange each algorithm's metadata over the bootstrap and compare it, so a rank
    /// that registers something else (or refuses it) makes the call fail on every rank, naming
    /// it, and nothing is registered.
    ///
    /// ```no_run
    /// # fn f(coll: &mscclpp_collectives::Collectives, algo: std::sync::Arc<dyn mscclpp_collectives::ExternalAlgorithm>) -> mscclpp::Result<()> {
    /// coll.register_algorithm(algo)?; // on every rank
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `InvalidUsage` for an algorithm no call could use (Broadcast, an empty size range, no
    /// placement, ranks per node not dividing the world size) or a name already registered, on
    /// any rank, and when ranks registered different algorithms; bootstrap errors.
    pub fn register_algorithm(&self, algorithm: Arc<dyn ExternalAlgorithm>) -> Result<()> {
        let what = || format!("registering the algorithm {:?} (rank {})", algorithm.name(), self.rank);
        let local = {
            let reg = self.external.read().map_err(|_| Error::internal("the algorithm registry lock is poisoned"))?;
            external::check_registrable(algorithm.as_ref(), &reg)
        };
        let mine = match &local {
            Ok(()) => format!("+{}", external::descriptor(algorithm.as_ref())),
            Err(why) => format!("-{why}"),
        };
        let all = self.comm.bootstrap().all_gather(mine.as_bytes()).map_err(|e| e.during(what()))?;
        let all: Vec<std::result::Result<String, String>> = all
            .iter()
            .map(|d| {
                let d = String::from_utf8_lossy(d);
                match d.strip_prefix('+') {
                    Some(ok) => Ok(ok.to_string()),
                    None => Err(d.strip_prefix('-').unwrap_or(&d).to_string()),
                }
            })
            .collect();
        external::agreement(&all).map_err(|e| e.during(what()))?;
        let mut reg = self.external.write().map_err(|_| Error::internal("the algorithm registry lock is poisoned"))?;
        reg.push(algorithm);
        self.has_external.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The names of the registered external algorithms, in registration order.
    pub fn registered_algorithms(&self) -> Vec<String> {
        self.external.read().map(|r| r.iter().map(|a| a.name().to_string()).collect()).unwrap_or_default()
    }

    /// The registered algorithm that would serve a call of `coll` with this message size (see
    /// [`ExternalAlgorithm`]) and placement, if any.
    ///
    /// # Errors
    /// As [`external::choose`].
    pub fn external_for(
        &self,
        coll: Collective,
        message_bytes: u64,
        in_place: bool,
        dtype: DataType,
        op: Option<ReduceOp>,
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn ExternalAlgorithm>>> {
        if !self.has_external.load(std::sync::atomic::Ordering::Acquire) {
            let shape = self.call_shape(coll, message_bytes, in_place, dtype, op);
            return Ok(external::choose(&[], &shape, opts)?.cloned());
        }
        let reg = self.external.read().map_err(|_| Error::internal("the algorithm registry lock is poisoned"))?;
        Ok(external::choose(&reg, &self.call_shape(coll, message_bytes, in_place, dtype, op), opts)?.cloned())
    }

    fn call_shape(
        &self,
        collective: Collective,
        message_bytes: u64,
        in_place: bool,
        dtype: DataType,
        op: Option<ReduceOp>,
    ) -> CallShape {
        CallShape {
            collective,
            world_size: self.nranks,
            ranks_per_node: self.ranks_per_node,
            message_bytes,
            in_place,
            dtype,
            op,
        }
    }

    /// GPU memory this rank's scratch takes.
    pub fn scratch_bytes(&self) -> u64 {
        self.layout.total
    }
    /// The scratch layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// The most blocks a launch may have to be a programmatic dependent launch (0: none are;
    /// see [`Config::programmatic_launch`]).
    pub fn programmatic_blocks(&self) -> u32 {
        self.programmatic_blocks
    }

    /// The selector thresholds in force (`max_blocks` already capped for residency).
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The plan the selector makes for a call (`nbytes` as in [`Layout::packet_need`]).
    pub fn plan(&self, coll: Collective, nbytes: u64, opts: &CallOptions) -> Result<Plan> {
        let tuned = self.tuning().and_then(|t| t.lookup(nbytes));
        select::plan(coll, nbytes, &self.layout, &self.limits, tuned, opts)
    }

    /// The error a kernel of this rank reported, if any (non-blocking: reads a page-locked word).
    ///
    /// # Errors
    /// `Timeout` naming the rank that never arrived, `InvalidUsage` naming the rank whose call
    /// differed from ours, `Aborted`-like `Remote` after [`abort`](Self::abort).
    pub fn check(&self) -> Result<()> {
        let (kind, peer, code) = match self.status.read()? {
            Reported::Clear => return self.check_external(),
            Reported::FailedBefore => {
                return Err(Error::remote(format!(
                    "rank {}: the collectives failed earlier and refuse further calls",
                    self.rank
                )));
            }
            Reported::Error { kind, peer, code } => (kind, peer, code),
        };
        let e = match kind {
            ERR_TIMEOUT => Error::timeout(
                format!("rank {}: a collective waited for rank {peer}, which never arrived (stopped, or making another call)", self.rank),
                self.timeout,
            )
            .with_peer(peer),
            ERR_MISMATCH => Error::invalid_usage(format!(
                "rank {}: rank {peer} made a different collective call (collective, type, operation, count, algorithm or shape differ)",
                self.rank
            ))
            .with_peer(peer),
            ERR_ABORTED => Error::remote(format!("rank {}: the collectives were aborted", self.rank)),
            ERR_FAILED_BEFORE => {
                Error::remote(format!("rank {}: a collective ran after an earlier one failed and did nothing", self.rank))
            }
            _ => Error::internal(format!("rank {}: unknown collective error word {code:#x}", self.rank)),
        };
        Err(e.during("a collective"))
    }

    fn check_external(&self) -> Result<()> {
        if !self.has_external.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let reg = self.external.read().map_err(|_| Error::internal("the algorithm registry lock is poisoned"))?;
        for a in reg.iter() {
            a.check().map_err(|e| e.during(format!("the registered algorithm {:?}", a.name())))?;
        }
        Ok(())
    }

    /// Asks every running and future kernel of this rank to stop waiting and fail (what
    /// `ncclCommAbort` needs). Kernels see it within about a millisecond; calls after it fail.
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

    fn base_args(&self) -> CollArgs {
        let l = &self.layout;

        CollArgs {
            peers: self.peers_table.device_ptr(),
            scratch: self.inline_peers,
            state: self.state.device_ptr(),
            expected: self.expected.device_ptr(),
            err: self.status.error_word(),
            abort: self.status.abort_word(),
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX / 2).min(u64::MAX / 2),
            rank: self.rank as u64,
            nranks: self.nranks as u64,
            pkt_off: l.pkt_off,
            pkt_half: l.pkt_half,
            sig_pkt_off: l.sig_pkt_off,
            sig_off: l.sig_off,
            inbox_off: l.inbox_off,
            simple_off: l.simple_off,
            simple_round: l.simple_round,
            ..CollArgs::default()
        }
    }

    /// Validates, plans and launches one call. `in_len`/`out_len` are the buffers' byte sizes.
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
        root: usize,
        stream: &Stream,
        opts: &CallOptions,
    ) -> Result<()> {
        let what = || format!("{coll} ({} of {} bytes, rank {} of {})", dtype, nbytes, self.rank, self.nranks);
        self.check().map_err(|e| e.during(what()))?;
        if nbytes == 0 {
            return Ok(());
        }
        check_call(self.device, stream, dtype, [(input, in_len, "input"), (output, out_len, "output")], &what)?;
        if root >= self.nranks {
            return Err(Error::invalid_usage(format!("{}: root {root} is not a rank", what())));
        }
        if coll != Collective::Broadcast
            && (opts.external.is_some() || self.has_external.load(std::sync::atomic::Ordering::Acquire))
        {
            let rank_off = self.rank as u64 * nbytes;
            let (message, in_place) = match coll {
                Collective::AllGather => (out_len, input == output.wrapping_add(rank_off)),
                Collective::ReduceScatter => (in_len, output == input.wrapping_add(rank_off)),
                _ => (in_len, input == output),
            };
            let ext_op = if coll.reduces() { op } else { None };
            if let Some(a) =
                self.external_for(coll, message, in_place, dtype, ext_op, opts).map_err(|e| e.during(what()))?
            {
                // SAFETY: the caller's contract: input and output are device memory of this GPU
                // (checked above) of in_len and out_len bytes, valid until the call finishes on
                // the stream, and every rank makes the same call.
                return unsafe { a.launch(self.rank, input, output, in_len, out_len, dtype, ext_op, stream) }
                    .map_err(|e| e.during(format!("{} by the registered algorithm {:?}", what(), a.name())));
            }
        } else if opts.external.is_some() {
            return Err(Error::invalid_usage(format!("{}: external algorithms do not serve Broadcast", what())));
        }
        let plan = self.plan(coll, nbytes, opts)?;
        let acc32 = opts.accumulate_f32 && dtype.is_float();
        let sig = select::signature(coll, &plan, coll.reduces().then_some(dtype), op, acc32, nbytes, root);
        let args = CollArgs {
            input,
            output,
            nbytes,
            sig,
            root: root as u64,
            op: op.map_or(0, |o| o.code()),
            acc32: acc32 as u64,
            ..self.base_args()
        };
        let k = self.kernels.get(coll, plan.algorithm, dtype)?;
        // SAFETY: the caller guarantees input/output for the sizes checked above until the call
        // finishes on the stream; the scratch, tables, state and error words live as long as self,
        // which the caller keeps while work is pending (dropping frees them after the GPU is idle).
        unsafe { kernels::launch(k, plan.blocks, plan.threads, stream, &args, self.programmatic_blocks) }
            .map_err(|e| e.during(what()))
    }

    /// AllReduce of `count` elements of `dtype` from `send` into `recv` (equal for in place) on
    /// `stream`.
    ///
    /// # Errors
    /// `InvalidUsage` for pointers the driver does not know as device memory of this GPU,
    /// buffers smaller than `count` elements, misaligned pointers, an algorithm or shape that
    /// cannot serve the call; the error of an earlier failed call; CUDA launch errors.
    ///
    /// # Safety
    /// `send` and `recv` point to `count` elements of device memory that stay valid (and `send`
    /// unchanged) until the call finishes on `stream`; every rank makes the same call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = byte_len(count, dtype, 1)?;
        // SAFETY: the caller's contract.
        unsafe { self.run(Collective::AllReduce, send, n, recv, n, n, dtype, Some(op), 0, stream, opts) }
    }

    /// AllGather: `send_count` elements from every rank's `send` into every rank's `recv`
    /// (`size()` x `send_count` elements, rank order). In place: `send == recv + rank * bytes`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    ///
    /// # Safety
    /// As `all_reduce`, with `recv` holding `size() * send_count` elements.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        send_count: usize,
        dtype: DataType,
        stream: &Stream,
        opts: &CallOptions,
    ) -> Result<()> {
        let (n, total) = (byte_len(send_count, dtype, 1)?, byte_len(send_count, dtype, self.nranks)?);
        // SAFETY: the caller's contract.
        unsafe { self.run(Collective::AllGather, send, n, recv, total, n, dtype, None, 0, stream, opts) }
    }

    /// ReduceScatter: every rank's `send` holds `size()` x `recv_count` elements; rank r gets
    /// segment r of their reduction in `recv`. In place: `recv == send + rank * bytes`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    ///
    /// # Safety
    /// As `all_reduce`, with `send` holding `size() * recv_count` elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
        opts: &CallOptions,
    ) -> Result<()> {
        let (n, total) = (byte_len(recv_count, dtype, 1)?, byte_len(recv_count, dtype, self.nranks)?);
        // SAFETY: the caller's contract.
        unsafe { self.run(Collective::ReduceScatter, send, total, recv, n, n, dtype, Some(op), 0, stream, opts) }
    }

    /// Broadcast of `count` elements from `root`'s `send` into every rank's `recv` (`send` is
    /// read only on the root).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); `InvalidUsage` for a root that is not a rank.
    ///
    /// # Safety
    /// As `all_reduce`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &Stream,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = byte_len(count, dtype, 1)?;
        let send = if self.rank == root { send } else { recv };
        // SAFETY: the caller's contract.
        unsafe { self.run(Collective::Broadcast, send, n, recv, n, n, dtype, None, root, stream, opts) }
    }

    /// [`all_reduce`](Self::all_reduce) on buffers this crate can check: `count` elements must
    /// fit both.
    ///
    /// # Errors
    /// As `all_reduce`; `InvalidUsage` when a buffer is smaller than `count` elements.
    pub fn all_reduce_buffers(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        self.all_reduce_buffers_with(send, recv, count, dtype, op, stream, &CallOptions::default())
    }

    /// [`all_reduce_buffers`](Self::all_reduce_buffers) with [`CallOptions`].
    ///
    /// # Errors
    /// As `all_reduce_buffers`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_buffers_with(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
        opts: &CallOptions,
    ) -> Result<()> {
        let n = byte_len(count, dtype, 1)?;
        for (b, name) in [(send, "send"), (recv, "receive")] {
            if (b.len() as u64) < n {
                return Err(Error::invalid_usage(format!(
                    "the {name} buffer holds {} bytes, the call needs {n}",
                    b.len()
                )));
            }
        }
        // SAFETY: both buffers are live device allocations of at least n bytes; they are kept
        // alive by the caller's borrow only for this call, so the caller must keep them until the
        // stream passes it (documented: synchronize before dropping).
        unsafe { self.all_reduce(send.device_ptr(), recv.device_ptr(), count, dtype, op, stream, opts) }
    }

    /// Whether this rank's kernels reported an error or it was aborted.
    pub fn has_failed(&self) -> bool {
        self.status.failed() || self.check().is_err()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp::ErrorKind;

    /// Ranks whose scratch layouts, thresholds or tuning settings differ are refused at setup,
    /// naming the first such rank, before any kernel could write past a peer's scratch.
    #[test]
    fn setups_that_differ_between_ranks_are_refused_naming_the_rank() {
        let config = Config { tune: false, ..Config::new(0) };
        let layout = Layout::new(2, config.packet_bytes, config.simple_bytes).unwrap();
        let mine = agreement(&layout, &config);
        let msg = |c: &Config| {
            let l = Layout::new(2, c.packet_bytes, c.simple_bytes).unwrap();
            format!("1a2b/0000:17:00.0\n{}", agreement(&l, c)).into_bytes()
        };
        let check = |all: &[Vec<u8>]| agreed_places(all, &mine, "collectives", "Config sizes");
        let same = msg(&config);
        assert_eq!(check(&[same.clone(), same.clone()]).unwrap(), vec!["1a2b/0000:17:00.0"; 2]);
        let bigger = Config { packet_bytes: config.packet_bytes * 2, ..config.clone() };
        let tuned = Config { tune: true, ..config.clone() };
        let limits = Config { limits: Limits { allpair_max: 1 << 10, ..config.limits }, ..config.clone() };
        for other in [bigger, tuned, limits] {
            let e = check(&[same.clone(), msg(&other)]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
            assert_eq!(e.peer(), Some(1), "{e}");
            assert!(e.to_string().contains("rank 1 set up its collectives with"), "{e}");
        }
        // A message without the agreement part (a malformed peer) is refused too.
        assert!(check(&[b"1a2b/0000:17:00.0".to_vec()]).is_err());
    }

    /// Byte counts are checked: a count whose bytes pass 64 bits is refused (it wrapped to a
    /// small call before), not run on a fraction of the data.
    #[test]
    fn byte_counts_never_wrap() {
        assert_eq!(byte_len(1024, DataType::F32, 1).unwrap(), 4096);
        assert_eq!(byte_len(1024, DataType::Bf16, 8).unwrap(), 16384);
        assert!(byte_len(1 << 62, DataType::F32, 1).unwrap_err().message().contains("64-bit"));
        assert!(byte_len((1 << 61) + 64, DataType::F16, 4).is_err());
        assert!(byte_len(usize::MAX, DataType::U32, 1).is_err());
    }
}
