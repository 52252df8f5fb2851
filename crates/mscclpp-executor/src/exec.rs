//! [`Executor`]: runs plans on the GPU with the interpreter kernel, over memory channels (CUDA IPC
//! mapped peer buffers, device semaphores) and port channels (through a proxy service).
//!
//! `unsafe` here is the raw-pointer API (device pointers the caller vouches for: registering
//! them and launching the kernel on them), as in `mscclpp-collectives`.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use mscclpp::device::compile::{CompileOptions, KernelModule, Ptx, compile};
use mscclpp::device::proxy::{MemoryId, ProxyConfig, ProxyService};
use mscclpp::gpu::{DeviceBuffer, Kernel, PinnedBuffer, Stream};
use mscclpp::{
    BaseMemoryChannel, Communicator, Device, EndpointConfig, Error, FirstError, Host2DeviceSemaphore, MemoryChannel,
    MemoryDevice2DeviceSemaphore, RegisteredMemory, Transport, TransportFlags,
};

use crate::device::{self, ExecArgs, NO_PEER};
use crate::lower::{self, Bindings, Layout, LowerError};
use crate::model::{BufferType, ChannelType, Plan};
use crate::{PlanError, device::ops_bytes};

/// Element types (MSCCL++'s `DataType` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `int32`.
    Int32,
    /// `uint32`.
    Uint32,
    /// `float32`.
    Float32,
    /// `float16`.
    Float16,
    /// `bfloat16`.
    Bfloat16,
}

impl DataType {
    fn code(self) -> u64 {
        match self {
            DataType::Int32 => 0,
            DataType::Uint32 => 1,
            DataType::Float32 => 2,
            DataType::Float16 => 3,
            DataType::Bfloat16 => 4,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Float16 | DataType::Bfloat16 => 2,
            _ => 4,
        }
    }
}

/// LL packet format (MSCCL++'s `PacketType`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PacketType {
    /// 8 data bytes and two flags in 16 bytes.
    #[default]
    LL16,
    /// 4 data bytes and a flag in 8 bytes.
    LL8,
}

/// A loaded plan: [`Plan`] with an identity the executor caches resources under.
#[derive(Clone, Debug)]
pub struct ExecutionPlan {
    plan: Arc<Plan>,
    id: u64,
}

impl ExecutionPlan {
    /// Wraps a plan (already validated by [`Plan::from_json_str`] and friends).
    pub fn new(plan: Plan) -> ExecutionPlan {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        ExecutionPlan { plan: Arc::new(plan), id: NEXT.fetch_add(1, Ordering::Relaxed) }
    }
    /// Loads and validates the plan at `path` (MSCCL++'s `ExecutionPlan(path)`).
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<ExecutionPlan, PlanError> {
        Ok(ExecutionPlan::new(Plan::from_file(path)?))
    }
    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// Its name.
    pub fn name(&self) -> &str {
        &self.plan.name
    }
    /// Its collective.
    pub fn collective(&self) -> &str {
        &self.plan.collective
    }
}

/// What a kernel reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceFailureKind {
    /// A wait passed the timeout.
    Timeout,
    /// The host asked every kernel to stop ([`Executor::abort`]).
    Aborted,
    /// The proxy serving a port channel failed or stopped.
    Proxy,
    /// A launch found this plan's resources failed by an earlier launch and did nothing.
    FailedBefore,
}

/// Why an execution failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The plan file could not be loaded.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The plan cannot run for this rank and these sizes.
    #[error(transparent)]
    Lower(#[from] LowerError),
    /// A kernel of this rank reported a failed wait.
    #[error(
        "rank {rank}, plan {plan}: thread block {block}, operation {op}{}: {}{}",
        if *launch != 0 { format!(" (launch {launch} of these buffers)") } else { String::new() },
        match (kind, peer) {
            (DeviceFailureKind::Timeout, Some(p)) => match counts {
                (seen, need) if *need != 0 => format!("waited for rank {p} past the {timeout:?} timeout: {seen} of its signals had arrived, this wait needed {need} (it never arrived, is behind, or runs another plan)"),
                _ => format!("waited for rank {p} past the {timeout:?} timeout (it never arrived, or runs another plan)"),
            },
            (DeviceFailureKind::Timeout, None) => format!("a barrier or semaphore of this rank waited past the {timeout:?} timeout"),
            (DeviceFailureKind::Aborted, _) => "aborted by the host".to_string(),
            (DeviceFailureKind::Proxy, Some(p)) => format!("the proxy serving the port channel to rank {p} failed or stopped"),
            (DeviceFailureKind::Proxy, None) => "the proxy failed or stopped".to_string(),
            (DeviceFailureKind::FailedBefore, _) => "an earlier execution of this plan failed; it refuses to run".to_string(),
        },
        match proxy {
            Some(n) => format!("; this rank's proxy had handled {n} triggers of its kernels"),
            None => String::new(),
        }
    )]
    Device {
        /// This rank.
        rank: usize,
        /// The plan's name.
        plan: String,
        /// What happened.
        kind: DeviceFailureKind,
        /// The rank waited for, when one is known.
        peer: Option<usize>,
        /// The thread block.
        block: u32,
        /// The operation's index in the block's list (pipeline bodies counted).
        op: u32,
        /// The wait limit.
        timeout: Duration,
        /// For a semaphore wait that timed out: the count it saw and the count it needed (both 0
        /// for other failures).
        counts: (u64, u64),
        /// Which launch of these resources the block was in (1 for the first; 0 when unknown).
        launch: u64,
        /// For a plan with port channels: how many triggers this rank's proxy had handled when
        /// the failure was read (beside the peer's counts: did a signal leave the proxy?).
        proxy: Option<u64>,
    },
    /// Communication, CUDA or usage errors from the core crate.
    #[error(transparent)]
    Mscclpp(#[from] Error),
}

impl ExecError {
    /// The peer the error is about, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            ExecError::Device { peer, .. } => *peer,
            ExecError::Mscclpp(e) => e.peer(),
            _ => None,
        }
    }
}

/// How an [`Executor`] is built.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ExecutorConfig {
    /// This rank's GPU.
    pub device: u32,
    /// How long any device wait may last from the kernel's start. Default 30 s.
    pub timeout: Duration,
    /// The transport of port channels (proxy puts): `CudaIpc` (default) or `Ethernet`.
    pub port_transport: Transport,
    /// Which kernel runs plans: one generated per plan shape (default) or the interpreter. The
    /// default comes from `MSCCLPP_EXECUTOR_KERNEL` (`interpreter` or `per-plan`) when set.
    pub kernel: KernelKind,
}

/// Which kernel runs a plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelKind {
    /// One interpreter kernel for every plan, compiled once per process: each operation's
    /// kind, channel type and counts are read at run time.
    Interpreter,
    /// A kernel generated from the plan's shape (see [`crate::plan_kernel`]), compiled with NVRTC
    /// when a plan's resources are first built (inside that collective call, before its closing
    /// barrier) and cached by shape for the process: the same operation code with the dispatch,
    /// the branches on the shape and the loops over channels and buffers resolved by the
    /// compiler. The first build of each shape costs an NVRTC compile (0.1-0.4 s, against
    /// 8.5 s for the interpreter's one compile). The default: on the H200 it ran every executor
    /// test and a plan spelling out the built-in all-pair AllReduce within 1.1x of the built-in
    /// kernel at every size from 1 KiB to 1 MiB (the interpreter: 1.3-1.5x).
    #[default]
    PerPlan,
}

impl KernelKind {
    /// The kind `name` names: `interpreter` or `per-plan` (any case, `_` for `-`).
    pub fn from_name(name: &str) -> Option<KernelKind> {
        match name.to_ascii_lowercase().replace('_', "-").as_str() {
            "interpreter" => Some(KernelKind::Interpreter),
            "per-plan" => Some(KernelKind::PerPlan),
            _ => None,
        }
    }

    /// The choice `MSCCLPP_EXECUTOR_KERNEL` names ([`from_name`](Self::from_name), or `plan`);
    /// the default when unset or empty, and (with a warning, once per process) when it names
    /// neither.
    pub fn from_env() -> KernelKind {
        match std::env::var("MSCCLPP_EXECUTOR_KERNEL") {
            Err(_) => KernelKind::default(),
            Ok(v) => match (KernelKind::from_name(v.trim()), v.trim()) {
                (Some(k), _) => k,
                (None, "") => KernelKind::default(),
                (None, p) if p.eq_ignore_ascii_case("plan") => KernelKind::PerPlan,
                (None, other) => {
                    // Once per process: every executor (one per rank thread) reads it.
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| {
                        tracing::warn!(
                            target: "mscclpp::executor",
                            "MSCCLPP_EXECUTOR_KERNEL={other:?} is neither \"interpreter\" nor \"per-plan\": using the default ({:?})",
                            KernelKind::default()
                        )
                    });
                    KernelKind::default()
                }
            },
        }
    }
}

impl ExecutorConfig {
    /// Defaults for GPU `device`.
    pub fn new(device: u32) -> ExecutorConfig {
        ExecutorConfig {
            device,
            timeout: Duration::from_secs(30),
            port_transport: Transport::CudaIpc,
            kernel: KernelKind::from_env(),
        }
    }
    /// Sets the device wait limit.
    pub fn timeout(mut self, t: Duration) -> ExecutorConfig {
        self.timeout = t;
        self
    }
    /// Sets the port channels' transport.
    pub fn port_transport(mut self, t: Transport) -> ExecutorConfig {
        self.port_transport = t;
        self
    }
    /// Sets which kernel runs plans.
    pub fn kernel(mut self, k: KernelKind) -> ExecutorConfig {
        self.kernel = k;
        self
    }
}

/// Checks every rank's `(send_size, recv_size)` (16 bytes each, as the build's first exchange
/// carries them) against this rank's, naming the first rank that differs.
pub(crate) fn check_same_sizes(plan: &str, mine: (u64, u64), all: &[Vec<u8>]) -> Result<(), ExecError> {
    for (p, b) in all.iter().enumerate() {
        let word = |i: usize| b.get(i * 8..i * 8 + 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes);
        let theirs = match (word(0), word(1)) {
            (Some(s), Some(r)) if b.len() == 16 => (s, r),
            _ => {
                return Err(Error::remote(format!("rank {p} sent malformed buffer sizes for plan {plan}"))
                    .with_peer(p)
                    .into());
            }
        };
        if theirs != mine {
            return Err(Error::invalid_usage(format!(
                "plan {plan}: rank {p} runs it with {} send / {} receive bytes, this rank with {} / {}: every rank must \
                 pass the same sizes",
                theirs.0, theirs.1, mine.0, mine.1
            ))
            .with_peer(p)
            .into());
        }
    }
    Ok(())
}

/// What resources are cached under: the plan's identity (a number given when it was loaded,
/// never its contents) and the buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    plan: u64,
    send: u64,
    recv: u64,
    send_size: u64,
    recv_size: u64,
}

/// A multiply-rotate hasher for [`Key`]s (five words; the executor's own pointers and sizes, not
/// attacker-chosen keys): a few nanoseconds where the default SipHash takes tens.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type KeyMap<V> = HashMap<Key, Arc<V>, BuildHasherDefault<KeyHasher>>;

/// The resource cache: (plan, buffers) to what was built for them.
struct Cache<V> {
    map: Mutex<KeyMap<V>>,
}

impl<V> Cache<V> {
    fn new() -> Self {
        Cache { map: Mutex::new(HashMap::default()) }
    }
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, KeyMap<V>>, Error> {
        self.map.lock().map_err(|_| Error::internal("the executor's cache lock is poisoned"))
    }
    /// The cached entry: one uncontended lock, one cheap hash, one reference-count increment.
    fn get(&self, key: &Key) -> Result<Option<Arc<V>>, Error> {
        Ok(self.lock()?.get(key).cloned())
    }
    fn insert(&self, key: Key, v: Arc<V>) -> Result<(), Error> {
        self.lock()?.insert(key, v);
        Ok(())
    }
    fn all(&self) -> Result<Vec<Arc<V>>, Error> {
        Ok(self.lock()?.values().cloned().collect())
    }
}

/// The kernel's argument block for one launch: the cached block with the call's element type
/// (nothing else changes between calls on cached resources).
fn launch_args(cached: &ExecArgs, dtype: DataType) -> ExecArgs {
    ExecArgs { dtype: dtype.code(), ..*cached }
}

/// The resources of one (plan, buffers): built once, reused by every execution.
struct Resources {
    // Dropped first: the proxy stops before the memories it moves go.
    proxy: Option<ProxyService>,
    plan_name: String,
    kernels: Arc<Kernels>,
    args: ExecArgs,
    nblocks: u32,
    threads: u32,
    status: PinnedBuffer,
    _ops: DeviceBuffer,
    /// `ExecState`, barrier counters, semaphores, per-block flags.
    state: DeviceBuffer,
    _mem_handles: Option<DeviceBuffer>,
    _port_handles: Option<DeviceBuffer>,
    _mem_channels: Vec<BaseMemoryChannel>,
    _mappings: Vec<MemoryChannel>,
    _remote: Vec<RegisteredMemory>,
    _local: Vec<RegisteredMemory>,
    _scratch: DeviceBuffer,
    /// The channels' semaphore words, for [`Executor::diagnostics`].
    diag: Diag,
    /// Launches issued on these resources.
    launches: AtomicU64,
}

/// A rank's channel semaphores by peer, and the sizes of the call: what
/// [`Executor::diagnostics`] reads after a failed wait.
struct Diag {
    /// The send and receive sizes these resources were built for.
    sizes: (u64, u64),
    /// Memory channels: (peer, the semaphore).
    mem: Vec<(usize, Arc<MemoryDevice2DeviceSemaphore>)>,
    /// Port channels (their semaphores belong to the proxy).
    port: Vec<PortDiag>,
}

/// One port channel's semaphore words; see [`Diag`].
struct PortDiag {
    peer: usize,
    /// The inbound token's and the expected count's buffers.
    token: DeviceBuffer,
    expected: DeviceBuffer,
    /// The address of the peer's token that this rank's proxy signals, as the peer registered
    /// it.
    remote: u64,
}

impl Resources {
    /// Word `i` of the 64-byte status buffer (kernel.cu `fail`): 0 the error word (0 while no
    /// kernel failed), 1 the abort word, 2-4 the failed wait's counts and launch. One load from
    /// page-locked host memory in this process's address space (a cached line while it stays
    /// unchanged; the GPU's write invalidates it), with no CUDA call; 0 past the buffer, which
    /// no caller reaches (i < 8).
    fn status_word(&self, i: usize) -> u64 {
        self.status.atomic_u64(8 * i).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// The error word the kernels write (0 while none failed).
    fn error_word(&self) -> u64 {
        self.status_word(0)
    }

    /// Whether [`Executor::abort`] was called.
    fn aborted(&self) -> bool {
        self.status_word(1) != 0
    }

    /// The flag of the last launch whose block 0 started (`ExecState.started`, written by
    /// kernel.cu `begin`; 0 before the first): a synchronous read of device memory, for
    /// [`Executor::diagnostics`].
    fn started(&self) -> Result<u64, Error> {
        let mut w = [0u8; 4];
        self.state.read(std::mem::offset_of!(crate::device::ExecState, started), &mut w)?;
        Ok(u32::from_le_bytes(w).into())
    }
}

/// Runs execution plans on this rank's GPU (MSCCL++'s `Executor`).
///
/// Every rank of the communicator builds one and makes the same `execute` calls in the same
/// order. The first call for a (plan, send, receive, sizes) is collective and builds the
/// channels, scratch and device program (or call [`prepare`](Self::prepare) first); later calls
/// only launch the kernel, and may be captured in a CUDA graph and replayed (the LL flag
/// advances on the GPU).
///
/// **The first call with new buffers is a collective host call, as in MSCCL++**: it allocates
/// and fills device memory (`cuMemAlloc`, synchronous copies and memsets on the legacy stream)
/// and may wait for the whole GPU while doing so. Where ranks share a GPU (threads of one
/// process, or processes under MPS), a rank that builds while a peer's kernel still spins
/// waiting for it deadlocks until that kernel's timeout. So before such a call every rank must
/// have finished its earlier kernels (synchronize the stream); the build then opens with an
/// exchange among all ranks (a barrier), so that no rank allocates before every rank got there,
/// and ends with another, so that no rank launches before every rank is built. A rank that
/// cannot build (sizes that do not fit the plan, a buffer on another GPU, a kernel that does not
/// compile, blocks that cannot all be resident) says so at one of those exchanges, and every
/// rank's call fails at once naming it (MSCCL++ leaves the others waiting). Freeing (dropping
/// the executor) follows the same rule: synchronize, barrier, then drop. Every device wait is
/// bounded by [`ExecutorConfig::timeout`]; a failed wait makes [`check`](Self::check) and the
/// next call return [`ExecError::Device`] naming the rank waited for, and that plan's resources
/// refuse further runs.
///
/// Ranks as threads of one process on one GPU share a CUDA context: set
/// `CUDA_DEVICE_MAX_CONNECTIONS=32` before CUDA starts (`mscclpp::gpu::use_all_hw_queues`), and
/// let no rank thread queue its next `execute` (or graph launch) before every rank has queued
/// the current one, as `mscclpp-perf` does; a rank that runs two calls ahead can leave a peer's
/// launch queued behind its own until the device timeout (docs/design.md, "Hardware queues and
/// ranks as threads"). Ranks as processes need neither.
pub struct Executor {
    comm: Communicator,
    config: ExecutorConfig,
    contexts: Cache<Resources>,
    /// The next build's number (its connection tags come from it); held through a build, so
    /// builds run one at a time, and advanced once every rank passed the build's first exchange
    /// (which every rank passes or fails alike): a build that never got there on some ranks (say,
    /// one rank found its buffers cached and never came) leaves every rank's number as it was,
    /// and one that failed later leaves no message behind under the next number.
    next_ctx: Mutex<u32>,
}

const TAG_BASE: u32 = 0x0e00_0000;

fn tag(ctx: u32, what: u32, pair: usize) -> u32 {
    // 8 bits of build number (builds run one at a time and finish their exchanges, so a
    // wrapped number never meets a message of its namesake), 4 of kind, 12 of pair
    // (`lower::MAX_PAIRS` channels of one type to one peer at most).
    TAG_BASE | ((ctx & 0xff) << 16) | ((what & 0xf) << 12) | (pair as u32 & 0xfff)
}

impl Executor {
    /// An executor for `comm`'s rank on `config.device`. Compiles the interpreter kernel (NVRTC,
    /// once per process and architecture) when first needed.
    pub fn new(comm: &Communicator, config: ExecutorConfig) -> Executor {
        Executor { comm: comm.clone(), config, contexts: Cache::new(), next_ctx: Mutex::new(0) }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Builds the resources of `plan` for these buffers (a collective call) unless cached.
    ///
    /// A build allocates and copies synchronously: every rank's earlier kernels must have
    /// finished (each rank synchronized its stream) before any rank calls this with new buffers
    /// (see [`Executor`]). The build opens and ends with a meeting of all ranks; a rank that
    /// cannot build fails every rank's call, named.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this executor's GPU, `send_size` and `recv_size`
    /// bytes long, that stay allocated while this executor lives (peers map them).
    pub unsafe fn prepare(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        send_size: u64,
        recv_size: u64,
        plan: &ExecutionPlan,
    ) -> Result<(), ExecError> {
        // SAFETY: the caller's contract.
        unsafe { self.resources(rank, send, recv, send_size, recv_size, plan) }.map(|_| ())
    }

    /// Runs `plan` on `send` (`send_size` bytes) into `recv` (`recv_size` bytes) on `stream`
    /// (MSCCL++'s `Executor::execute`). The first call for these (plan, buffers) is collective
    /// (see [`prepare`](Self::prepare)): it is a blocking host call that must come after every
    /// rank's earlier kernels finished, and must not be inside a stream capture. Later calls
    /// only launch (no allocation, copy or free).
    ///
    /// Each rank looks its own buffers up, so every rank must reach its first call for new
    /// buffers together: where addresses change on some ranks only (a caching allocator
    /// handing out another block), one rank builds while another launches, and both fail at
    /// their timeouts. Keep the buffers fixed (as MSCCL++'s users do), or call `prepare` on
    /// every rank when they change. Every rank must pass the same sizes (checked at the build).
    ///
    /// # Errors
    /// [`ExecError::Lower`] for sizes or a plan this rank cannot run; [`ExecError::Device`] for a
    /// failure an earlier launch reported; core errors for setup and the launch.
    ///
    /// # Safety
    /// As [`prepare`](Self::prepare); the buffers stay valid (and `send` unchanged) until the call
    /// finishes on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn execute(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        send_size: u64,
        recv_size: u64,
        dtype: DataType,
        plan: &ExecutionPlan,
        stream: &Stream,
        packet_type: PacketType,
    ) -> Result<(), ExecError> {
        // SAFETY: the caller's contract.
        let res = unsafe { self.resources(rank, send, recv, send_size, recv_size, plan)? };
        self.check_resources(&res)?;
        // The kernels loaded at setup: no global lock or lookup on this path.
        let k = match packet_type {
            PacketType::LL16 => &res.kernels.ll16,
            PacketType::LL8 => &res.kernels.ll8,
        };
        let mut a = launch_args(&res.args, dtype);
        let mut params = [(&mut a as *mut ExecArgs).cast::<c_void>()];
        // SAFETY: the kernel takes one ExecArgs by value (its CUDA definition is generated from
        // the Rust one and checked by static_asserts); `a` outlives the call (the driver copies
        // it); every pointer in it is owned by `res` (kept in the cache for the executor's life)
        // or is the caller's buffer, valid until the stream passes this launch.
        unsafe { k.launch((res.nblocks, 1, 1), (res.threads, 1, 1), 0, stream, &mut params) }?;
        res.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Diagnostics after a failed call, a line per cached (plan, buffers): the sizes, launches
    /// issued (calls of `execute`; calls captured in a CUDA graph count once, replays not) and
    /// the last launch whose block 0 started (the kernel's flag: 1 for the first, counting
    /// launches that found the rank failed and returned at once), the error word, the proxy's
    /// handled triggers, and for every channel the semaphore words by peer: this rank's inbound
    /// token (address and value) and expected count, and the address of the peer's token it
    /// signals. With ranks as threads of one process, that address is the peer's own inbound
    /// address (a different one means it was given another token); across processes the
    /// addresses differ (each process maps the peer's memory at its own address).
    ///
    /// Reads device memory with synchronous copies: call it once the rank's kernels have ended
    /// (a read can wait for a kernel of this rank that still runs until its own timeout). Not
    /// API.
    #[doc(hidden)]
    pub fn diagnostics(&self) -> Vec<String> {
        let show = |r: Result<u64, Error>| r.map_or_else(|e| format!("? ({e})"), |v| v.to_string());
        let all = match self.contexts.all() {
            Ok(a) => a,
            Err(e) => return vec![format!("rank {}: no diagnostics: {e}", self.comm.rank())],
        };
        all.iter()
            .map(|r| {
                let mut line = format!(
                    "rank {} plan {} ({} B in, {} B out): launches issued {}, block 0 of launch {} started last (0: none), error word {:#x}, proxy handled {}",
                    self.comm.rank(),
                    r.plan_name,
                    r.diag.sizes.0,
                    r.diag.sizes.1,
                    r.launches.load(Ordering::Relaxed),
                    show(r.started()),
                    r.error_word(),
                    r.proxy.as_ref().map_or_else(|| "-".to_string(), |p| p.processed().to_string()),
                );
                for (peer, sem) in &r.diag.mem {
                    let h = sem.device_handle();
                    line += &format!(
                        "; memory channel with rank {peer}: inbound {:#x} = {}, expected = {}, signals into {:#x}",
                        h.inbound_token,
                        show(sem.inbound_token()),
                        show(sem.expected_inbound_token()),
                        h.remote_inbound_token
                    );
                }
                for p in &r.diag.port {
                    line += &format!(
                        "; port channel with rank {}: inbound {:#x} = {}, expected = {}, proxy signals into {:#x}",
                        p.peer,
                        p.token.device_ptr(),
                        show(p.token.read_u64(0)),
                        show(p.expected.read_u64(0)),
                        p.remote
                    );
                }
                line
            })
            .collect()
    }

    /// The error a kernel of this rank reported for any cached plan, if any (reads page-locked
    /// words; no CUDA call).
    pub fn check(&self) -> Result<(), ExecError> {
        for r in self.contexts.all()? {
            self.check_resources(&r)?;
        }
        Ok(())
    }

    /// Asks every running and later kernel of this executor to stop waiting and fail.
    pub fn abort(&self) -> Result<(), ExecError> {
        for r in self.contexts.all()? {
            r.status.write(8, &1u64.to_le_bytes())?;
        }
        Ok(())
    }

    /// Waits (bounded) for `stream`, then [`check`](Self::check)s.
    pub fn synchronize(&self, stream: &Stream, timeout: Duration) -> Result<(), ExecError> {
        let r = stream.synchronize(timeout);
        self.check()?;
        Ok(r?)
    }

    fn check_resources(&self, r: &Resources) -> Result<(), ExecError> {
        let mut code = r.error_word();
        // Words 2-4 belong to a code a kernel wrote (written before it, kernel.cu `fail`).
        let from_kernel = code != 0;
        if code == 0 {
            if !r.aborted() {
                return Ok(());
            }
            // Aborted before any kernel noticed: refuse as the kernels would (they no longer
            // read the abort word at launch; see kernel.cu).
            code = (1 << 63) | (2 << 48) | (u64::from(NO_PEER) << 32);
        }
        let kind = match (code >> 48) & 0x7fff {
            1 => DeviceFailureKind::Timeout,
            2 => DeviceFailureKind::Aborted,
            3 => DeviceFailureKind::Proxy,
            _ => DeviceFailureKind::FailedBefore,
        };
        let peer = ((code >> 32) & 0xffff) as u32;
        let (seen, need, launch) =
            if from_kernel { (r.status_word(2), r.status_word(3), r.status_word(4)) } else { (0, 0, 0) };
        Err(ExecError::Device {
            rank: self.comm.rank(),
            plan: r.plan_name.clone(),
            kind,
            peer: (peer != NO_PEER).then_some(peer as usize),
            block: ((code >> 16) & 0xffff) as u32,
            op: (code & 0xffff) as u32,
            timeout: self.config.timeout,
            counts: (seen, need),
            launch,
            proxy: r.proxy.as_ref().map(ProxyService::processed),
        })
    }

    unsafe fn resources(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        send_size: u64,
        recv_size: u64,
        plan: &ExecutionPlan,
    ) -> Result<Arc<Resources>, ExecError> {
        let key = Key { plan: plan.id, send, recv, send_size, recv_size };
        if let Some(r) = self.contexts.get(&key)? {
            // Built before, so the plan's size was checked then; the rank is an argument.
            if rank != self.comm.rank() {
                return Err(wrong_rank(rank, self.comm.rank()).into());
            }
            return Ok(r);
        }
        // The rank and the plan's size are checked in the build, at its first exchange: a rank
        // that refuses them fails every rank there, named.
        let mut next = self.next_ctx.lock().map_err(|_| Error::internal("the executor's build lock is poisoned"))?;
        // Another thread of this rank may have built these while this one waited for the lock.
        if let Some(r) = self.contexts.get(&key)? {
            return Ok(r);
        }
        // SAFETY: the caller's contract.
        let r = Arc::new(unsafe { self.build(&mut next, rank, send, recv, send_size, recv_size, &plan.plan) }?);
        self.contexts.insert(key, r.clone())?;
        Ok(r)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn build(
        &self,
        next: &mut u32,
        rank: usize,
        send: u64,
        recv: u64,
        send_size: u64,
        recv_size: u64,
        plan: &Plan,
    ) -> Result<Resources, ExecError> {
        let dev = self.config.device;
        let comm = &self.comm;
        let ctx = comm.context();
        // What this rank can check alone: the sizes against the plan, the buffers, the channels.
        let local = (|| -> Result<(Layout, Vec<lower::ChannelLink>), ExecError> {
            if rank != comm.rank() {
                return Err(wrong_rank(rank, comm.rank()).into());
            }
            if plan.gpus.len() != comm.size() {
                return Err(Error::invalid_usage(format!(
                    "plan {} is for {} ranks, the communicator has {}",
                    plan.name,
                    plan.gpus.len(),
                    comm.size()
                ))
                .into());
            }
            let layout = Layout::new(plan, rank, send_size, recv_size)?;
            for (p, n, what) in [(send, send_size, "send"), (recv, recv_size, "receive")] {
                let g = mscclpp::gpu::check_device_range(p, n, what)?;
                if g != dev {
                    return Err(Error::invalid_usage(format!(
                        "the {what} buffer is on GPU{g}, the executor on GPU{dev}"
                    ))
                    .into());
                }
            }
            Ok((layout, lower::channel_links(plan, rank)?))
        })();
        // Nobody allocates, copies synchronously or loads a module (each may wait for the whole
        // GPU) before every rank got here, i.e. is done launching and has synchronized what it
        // launched before: a peer's kernel still waiting for this rank would never finish. The
        // meeting point also tells every rank whether every other can run the plan: a rank that
        // cannot fails every rank at once, named, instead of leaving them to a bootstrap timeout.
        // Every rank must pass the same sizes: chunk offsets into a peer's buffers are computed
        // from this rank's own, so a rank with larger buffers would write past a peer's.
        let ((layout, links), sizes) = comm.all_gather_outcome(
            local,
            |_| [send_size.to_le_bytes(), recv_size.to_le_bytes()].concat(),
            &format!("plan {}: checking its sizes and buffers", plan.name),
        )?;
        check_same_sizes(&plan.name, (send_size, recv_size), &sizes)?;
        // Every rank got this far or none did (the exchange above tells each the others'
        // outcome) and no pairwise message is out yet: the build's number advances here, on
        // every rank alike, whatever happens next. A retry after a later failure uses fresh
        // tags, so it never meets a message left over from this attempt.
        let seq = *next;
        *next = next.wrapping_add(1);
        let gpu = &plan.gpus[rank];
        let flags: TransportFlags = [Transport::CudaIpc, self.config.port_transport].into_iter().collect();
        // Allocated and registered, then agreed: a rank out of memory (or whose buffers do not
        // register) fails every rank at once, named, instead of leaving them waiting for its
        // buffers in the pairwise part below.
        let allocated = (|| -> Result<_, ExecError> {
            let scratch = DeviceBuffer::new(ctx, dev, layout.scratch_bytes.max(64) as usize, flags)
                .map_err(|e| e.during(format!("allocating the scratch of plan {}", plan.name)))?;
            // SAFETY: the caller promises both ranges stay allocated while this executor (which
            // keeps the registrations) lives.
            let send_mem = unsafe { ctx.register_device(send, send_size as usize, flags) }
                .map_err(|e| e.during("registering the send buffer"))?;
            // SAFETY: as above.
            let recv_mem = unsafe { ctx.register_device(recv, recv_size as usize, flags) }
                .map_err(|e| e.during("registering the receive buffer"))?;
            Ok((scratch, send_mem, recv_mem))
        })();
        let ((scratch, send_mem, recv_mem), _) = comm.all_gather_outcome(
            allocated,
            |_| Vec::new(),
            &format!("plan {}: allocating its scratch and registering its buffers", plan.name),
        )?;
        let local_of = |t: BufferType| match t {
            BufferType::Input => &send_mem,
            BufferType::Output => &recv_mem,
            BufferType::Scratch => scratch.memory(),
        };
        // The pairwise part. What needs nothing from a peer (this rank's endpoints and buffers)
        // goes out to every peer first, then an exchange (a rank that could not send them fails
        // every rank there, named, before anyone waits for its messages), then the semaphores
        // (each needs that peer's endpoint); a failure with one peer does not stop what is owed
        // to the others, and every wait is bounded and names the peer. A rank that fails later
        // (a peer that never answered, a mapping or the proxy that failed, a plan its lowering
        // refuses) reports at the second exchange below with everything else it prepares, its
        // connections kept open until the build ends (`hold`).
        let mut hold = Vec::new();
        let paired = (|| -> Result<_, ExecError> {
            let mut first = FirstError::<Error>::default();
            // Connections, one per channel, tagged (type, pair) so each meets its partner.
            let mut pending = Vec::new();
            for l in &links {
                let (what, transport) = match l.channel_type {
                    ChannelType::Port => (1, self.config.port_transport),
                    _ => (0, Transport::CudaIpc),
                };
                let ep = EndpointConfig::new(transport).device(Device::Gpu(dev));
                let tg = tag(seq, what, l.pair);
                if let Some(c) = first.keep(comm.connect(&ep, l.peer, tg).map_err(|e| e.with_peer(l.peer))) {
                    pending.push((l, tg, c));
                }
            }
            for (peer, t) in lower::buffer_sends(plan, rank) {
                first.keep(
                    comm.send_memory(local_of(t), peer, tag(seq, 4 + t as u32, 0)).map_err(|e| e.with_peer(peer)),
                );
            }
            let mut recvs = Vec::new();
            for (owner, t) in lower::buffer_recvs(plan, rank) {
                if let Some(m) =
                    first.keep(comm.recv_memory(owner, tag(seq, 4 + t as u32, 0)).map_err(|e| e.with_peer(owner)))
                {
                    recvs.push((owner, t, m));
                }
            }
            // Port peers swap scratch buffers for the warm-up below (whatever else the plan sends).
            let mut port_peers: Vec<usize> =
                links.iter().filter(|l| l.channel_type == ChannelType::Port).map(|l| l.peer).collect();
            port_peers.sort_unstable();
            port_peers.dedup();
            let mut warm_recvs = Vec::new();
            for &p in &port_peers {
                first.keep(comm.send_memory(scratch.memory(), p, tag(seq, 3, 0)).map_err(|e| e.with_peer(p)));
                if let Some(m) = first.keep(comm.recv_memory(p, tag(seq, 3, 0)).map_err(|e| e.with_peer(p))) {
                    warm_recvs.push((p, m));
                }
            }
            comm.all_gather_outcome(
                first.into_result(),
                |_| Vec::new(),
                &format!("plan {}: sending its endpoints and buffers", plan.name),
            )?;
            let mut first = FirstError::<Error>::default();
            let mut sems = Vec::new();
            let mut warm = Vec::new();
            // Peers a wait already failed with: their other channels are not waited for (each
            // wait would cost the full timeout again; a plan has several channels per peer), the
            // build fails with the first error anyway.
            let mut failed_peers = Vec::new();
            for (l, tg, conn) in pending {
                if failed_peers.contains(&l.peer) {
                    continue;
                }
                let waited = conn.wait().map_err(|e| e.during("connecting a plan's channel").with_peer(l.peer));
                let Some(conn) = first.keep(waited) else {
                    failed_peers.push(l.peer);
                    continue;
                };
                hold.push(conn.clone());
                match first.keep(comm.build_semaphore(&conn, l.peer, tg).map_err(|e| e.with_peer(l.peer))) {
                    Some(s) => sems.push((l, s)),
                    None => failed_peers.push(l.peer),
                }
                if l.channel_type == ChannelType::Port {
                    warm.push((l.peer, conn));
                }
            }
            first.into_result()?;
            // Nothing more is owed to anyone: the rest writes, waits and maps.
            // Warm-up (as the two-level collectives do): one small write over every port connection
            // each way before any kernel runs, so that what a transport creates on first use
            // (Ethernet: pinned staging buffers and a stream per direction and GPU) is not created
            // while kernels spin waiting for this very data. It copies 16 zero bytes of the fresh
            // (zeroed) scratch onto the peer's fresh scratch, which no kernel uses before the
            // exchange at the end of this setup; the flush proves it arrived.
            let mut warm_mem = Vec::new();
            for (p, m) in warm_recvs {
                warm_mem.push((p, m.wait().map_err(|e| e.with_peer(p))?));
            }
            for (p, conn) in &warm {
                if let Some((_, m)) = warm_mem.iter().find(|(q, _)| q == p) {
                    conn.write(m, 0, scratch.memory(), 0, 16)
                        .map_err(|e| e.during("warming up a port channel's connection").with_peer(*p))?;
                }
            }
            for (p, conn) in &warm {
                conn.flush(self.config.timeout)
                    .map_err(|e| e.during("warming up a port channel's connection").with_peer(*p))?;
            }
            let mut remote: Vec<(usize, BufferType, RegisteredMemory)> = Vec::new();
            for (owner, t, m) in recvs {
                let m = m.wait().map_err(|e| e.during("receiving a peer's buffer for a plan").with_peer(owner))?;
                remote.push((owner, t, m));
            }
            let mut mem_sems: Vec<(usize, Arc<MemoryDevice2DeviceSemaphore>)> = Vec::new();
            let mut mem_channels = Vec::new();
            let mut port_sems = Vec::new();
            for (l, s) in sems {
                let s = s.wait().map_err(|e| e.during("building a plan's semaphore").with_peer(l.peer))?;
                if l.channel_type == ChannelType::Memory {
                    let s = Arc::new(MemoryDevice2DeviceSemaphore::new(s).map_err(|e| e.with_peer(l.peer))?);
                    mem_channels.push(BaseMemoryChannel::new(s.clone()));
                    mem_sems.push((l.peer, s));
                } else {
                    port_sems.push((l.peer, Host2DeviceSemaphore::new(s).map_err(|e| e.with_peer(l.peer))?));
                }
            }
            // Remote buffers: mapped (memory access) and registered with the proxy (port access).
            let mut proxy =
                if port_sems.is_empty() { None } else { Some(ProxyService::new(ctx, dev, ProxyConfig::default())?) };
            let mut bindings = Bindings {
                remote_base: vec![0; gpu.remote_buffers.len()],
                remote_mem: vec![u32::MAX; gpu.remote_buffers.len()],
                local_mem: [0, 1, 2],
            };
            if let Some(p) = proxy.as_mut() {
                for (i, t) in [BufferType::Input, BufferType::Output, BufferType::Scratch].into_iter().enumerate() {
                    bindings.local_mem[i] = p.add_memory(local_of(t).clone())?.0;
                }
            }
            let mut mappings = Vec::new();
            for (gi, rb) in gpu.remote_buffers.iter().enumerate() {
                let Some((_, _, m)) = remote.iter().find(|(o, t, _)| *o == rb.rank && *t == rb.buffer_type) else {
                    continue;
                };
                if rb.access_channel_types.contains(&ChannelType::Memory) {
                    let Some((_, s)) = mem_sems.iter().find(|(p, _)| *p == rb.rank) else {
                        return Err(LowerError::Invalid {
                            path: format!("gpus[{rank}].remote_buffers[{gi}]"),
                            reason: format!(
                                "accessed through memory channels, but the rank has no memory channel to rank {}",
                                rb.rank
                            ),
                        }
                        .into());
                    };
                    let ch = MemoryChannel::new(s.clone(), m, &send_mem, None)?;
                    bindings.remote_base[gi] = ch.device_handle().dst;
                    mappings.push(ch);
                }
                if let (true, Some(p)) = (rb.access_channel_types.contains(&ChannelType::Port), proxy.as_mut()) {
                    bindings.remote_mem[gi] = p.add_memory(m.clone())?.0;
                }
            }
            let mut port_bytes = Vec::new();
            let mut diag = Diag { sizes: (send_size, recv_size), mem: mem_sems, port: Vec::new() };
            if let Some(p) = proxy.as_mut() {
                let scratch_id = MemoryId(bindings.local_mem[2]);
                for (peer, s) in port_sems {
                    let (token, expected) = s.word_buffers();
                    diag.port.push(PortDiag { peer, token, expected, remote: s.semaphore().remote_memory().addr() });
                    let id = p.add_semaphore(s)?;
                    port_bytes.extend_from_slice(
                        &p.port_channel(id, scratch_id, scratch_id)?.device_handle().base.to_bytes(),
                    );
                }
            }
            Ok(Paired { remote, mem_channels, proxy, bindings, mappings, port_bytes, diag })
        })();
        // Lowering, the kernel and the uploads may fail on one rank only: every rank reports at
        // the residency exchange below, so that a rank that cannot go on fails the others at once,
        // named, instead of leaving them at the closing exchange.
        let threads = plan.num_threads_per_block.clamp(32, 1024);
        let prepared = paired.and_then(|paired| {
            let low = lower::lower(plan, rank, &layout, &paired.bindings)?;
            // The interpreter's kernels too (NVRTC, a module load): a rank without them says so
            // here rather than leaving the others at this exchange.
            let kernels = match self.config.kernel {
                KernelKind::Interpreter => kernels(dev)?,
                KernelKind::PerPlan => plan_kernels(dev, &crate::plan_kernel::source(&low.ops, &low.blocks))
                    .map_err(|e| e.during(format!("building the per-plan kernel of plan {}", plan.name)))?,
            };
            let upload = |bytes: &[u8]| -> Result<Option<DeviceBuffer>, Error> {
                if bytes.is_empty() {
                    return Ok(None);
                }
                let b = DeviceBuffer::new(ctx, dev, bytes.len(), TransportFlags::NONE)?;
                b.write(0, bytes)?;
                Ok(Some(b))
            };
            let mem_bytes: Vec<u8> = paired.mem_channels.iter().flat_map(|c| c.device_handle().to_bytes()).collect();
            let mem_handles = upload(&mem_bytes)?;
            let port_handles = upload(&paired.port_bytes)?;
            // Block b's operations at slots b * stride .. (padded with no-ops), each carrying the
            // block's count: the kernel copies its block's slots to shared memory in one step.
            let image = low.device_image();
            let ops_buf = DeviceBuffer::new(
                ctx,
                dev,
                (image.slots.len() * std::mem::size_of::<device::DevOp>()).max(64),
                TransportFlags::NONE,
            )?;
            ops_buf.write(0, &ops_bytes(&image.slots))?;
            // State: ExecState, barrier counters, semaphores, per-block LL flags.
            let state = DeviceBuffer::new(ctx, dev, image.state.len(), TransportFlags::NONE)?;
            state.write(0, &image.state)?;
            let status = PinnedBuffer::new(ctx, dev, 64, TransportFlags::NONE)?;
            // Kernels that wait on each other must all be resident: count the blocks of every
            // rank on this GPU, and hold them to the fewest blocks per SM that any of those
            // ranks' kernels allows (per-plan kernels differ between ranks, and ranks may run
            // different kinds): the same bound on every rank, so that all of them refuse or none
            // does.
            let per_sm = kernels
                .ll16
                .max_active_blocks_per_sm(threads, 0)?
                .min(kernels.ll8.max_active_blocks_per_sm(threads, 0)?);
            let me = format!("{:x}/{}", mscclpp::host_hash(), mscclpp::gpu::pci_bus_id(dev)?);
            Ok((
                paired,
                Prepared { low, kernels, mem_handles, port_handles, image, ops_buf, state, status, me, per_sm },
            ))
        });
        let (
            (
                Paired { remote, mem_channels, mut proxy, mappings, diag, .. },
                Prepared { low, kernels, mem_handles, port_handles, image, ops_buf, state, status, me, per_sm },
            ),
            all,
        ) = comm.all_gather_outcome(
            prepared,
            |(_, p)| format!("{}|{}|{}", p.me, p.image.nblocks, p.per_sm).into_bytes(),
            &format!("plan {}: connecting its channels and preparing its program", plan.name),
        )?;
        let (stride, nblocks_low) = (image.stride, image.nblocks);
        let (bar_off, sem_off, flags_off) = (image.barriers_off, image.sems_off, image.flags_off);
        let nblocks = nblocks_low as u32;
        // Only the ranks on this GPU refuse a count of blocks that cannot all be resident, and the
        // proxy may fail to start on one rank only: the closing meeting carries either, so that
        // the ranks on other GPUs fail at once too, named, instead of waiting for them there.
        let started = (|| -> Result<(), ExecError> {
            let (on_gpu, per_sm) = residency(&all, &me, per_sm);
            let fit = u64::from(mscclpp::gpu::sm_count(dev)?) * u64::from(per_sm);
            if on_gpu > fit {
                return Err(Error::invalid_usage(format!(
                    "the ranks on GPU{dev} run {on_gpu} thread blocks of {threads} threads; only {fit} fit at once, and blocks that wait on each other must all be resident"
                ))
                .into());
            }
            if let Some(p) = proxy.as_mut() {
                p.start()?;
            }
            Ok(())
        })();
        // Nobody launches before every rank has its resources.
        comm.all_gather_outcome(started, |_| Vec::new(), &format!("plan {}: starting", plan.name))?;
        let args = ExecArgs {
            input: send,
            output: recv,
            scratch: scratch.device_ptr(),
            scratch_half: layout.scratch_half,
            ops: ops_buf.device_ptr(),
            ops_stride: stride as u64,
            mem_chans: mem_handles.as_ref().map_or(0, DeviceBuffer::device_ptr),
            port_chans: port_handles.as_ref().map_or(0, DeviceBuffer::device_ptr),
            state: state.device_ptr(),
            barriers: state.device_ptr() + bar_off as u64,
            sems: state.device_ptr() + sem_off as u64,
            err: status.as_ptr() as u64,
            abort: status.as_ptr() as u64 + 8,
            timeout_ns: u64::try_from(self.config.timeout.as_nanos()).unwrap_or(u64::MAX / 2).min(u64::MAX / 2),
            dtype: 0,
            flags: state.device_ptr() + flags_off as u64,
        };
        tracing::debug!(target: "mscclpp::executor", rank, plan = %plan.name, blocks = nblocks, ops = low.ops.len(), scratch = layout.scratch_bytes, "plan resources ready");
        Ok(Resources {
            proxy,
            plan_name: plan.name.clone(),
            kernels,
            args,
            nblocks,
            threads,
            status,
            _ops: ops_buf,
            state,
            _mem_handles: mem_handles,
            _port_handles: port_handles,
            _mem_channels: mem_channels,
            _mappings: mappings,
            _remote: remote.into_iter().map(|(_, _, m)| m).collect(),
            _local: vec![send_mem, recv_mem],
            _scratch: scratch,
            diag,
            launches: AtomicU64::new(0),
        })
    }
}

/// The refusal of a call whose `rank` is not the communicator's.
fn wrong_rank(given: usize, mine: usize) -> Error {
    Error::invalid_usage(format!("execute: rank {given} given, the communicator's rank is {mine}"))
}

/// What a rank's pairwise part of a build leaves: the peers' buffers, its channels, the proxy
/// (not started), where the plan's buffers are bound and the port channels' device handles.
struct Paired {
    remote: Vec<(usize, BufferType, RegisteredMemory)>,
    mem_channels: Vec<BaseMemoryChannel>,
    proxy: Option<ProxyService>,
    bindings: Bindings,
    mappings: Vec<MemoryChannel>,
    port_bytes: Vec<u8>,
    diag: Diag,
}

/// What a rank prepares between the build's first and second exchanges: its program, kernels
/// and device buffers, and what the residency check needs (`me`: its GPU; `per_sm`: its
/// kernels' blocks per SM).
struct Prepared {
    low: lower::Lowered,
    kernels: Arc<Kernels>,
    mem_handles: Option<DeviceBuffer>,
    port_handles: Option<DeviceBuffer>,
    image: lower::DeviceImage,
    ops_buf: DeviceBuffer,
    state: DeviceBuffer,
    status: PinnedBuffer,
    me: String,
    per_sm: u32,
}

/// The thread blocks that the ranks on GPU `me` run together, and the fewest blocks per SM any
/// of their kernels allows (`own` if none says), from every rank's `"{gpu}|{blocks}|{per SM}"`.
fn residency(all: &[Vec<u8>], me: &str, own: u32) -> (u64, u32) {
    let (mut blocks, mut per_sm) = (0u64, own);
    for w in all {
        let w = String::from_utf8_lossy(w);
        let mut f = w.split('|');
        if f.next() != Some(me) {
            continue;
        }
        blocks += f.next().and_then(|b| b.parse::<u64>().ok()).unwrap_or(0);
        if let Some(p) = f.next().and_then(|p| p.parse::<u32>().ok()) {
            per_sm = per_sm.min(p);
        }
    }
    (blocks, per_sm)
}

/// The kernels of a plan on one GPU (the interpreter's, or its per-plan ones).
struct Kernels {
    ll16: Kernel,
    ll8: Kernel,
    _module: KernelModule,
}

/// Compiles (once per process and architecture) and loads (once per GPU) the kernels.
fn kernels(device: u32) -> Result<Arc<Kernels>, Error> {
    type Cache<K, V> = OnceLock<Mutex<HashMap<K, Arc<V>>>>;
    static LOADED: Cache<u32, Kernels> = OnceLock::new();
    static COMPILED: Cache<String, Ptx> = OnceLock::new();
    let poisoned = || Error::internal("the executor kernel cache lock is poisoned");
    let mut map = LOADED.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(k) = map.get(&device) {
        return Ok(k.clone());
    }
    let opts = CompileOptions::for_device(device).name("executor.cu");
    let arch = opts.resolved_arch();
    let ptx = {
        let mut c = COMPILED.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
        match c.get(&arch) {
            Some(p) => p.clone(),
            None => {
                let p =
                    Arc::new(compile(&device::source(), &opts).map_err(|e| e.during("compiling the executor kernel"))?);
                c.insert(arch, p.clone());
                p
            }
        }
    };
    let module = KernelModule::load(device, &ptx)?;
    let k = Arc::new(Kernels {
        ll16: module.function(device::KERNEL_LL16)?,
        ll8: module.function(device::KERNEL_LL8)?,
        _module: module,
    });
    map.insert(device, k.clone());
    Ok(k)
}

/// A cache whose values are built at most once per key, different keys in parallel: the map's
/// lock is held only to find (or add) the key's slot, the slot's own lock while its value is
/// built, so that ranks compiling different shapes do not wait for each other while ranks
/// needing the same one wait for the first. A failed build leaves the slot empty (the next
/// caller tries again).
struct OnceMap<V> {
    map: Mutex<HashMap<String, Arc<Slot<V>>>>,
}

/// One key's value of a [`OnceMap`], once built.
type Slot<V> = Mutex<Option<Arc<V>>>;

impl<V> OnceMap<V> {
    fn new() -> OnceMap<V> {
        OnceMap { map: Mutex::new(HashMap::new()) }
    }

    fn get_or_build(&self, key: String, build: impl FnOnce() -> Result<V, Error>) -> Result<Arc<V>, Error> {
        let poisoned = || Error::internal("the per-plan kernel cache lock is poisoned");
        let slot = self.map.lock().map_err(|_| poisoned())?.entry(key).or_default().clone();
        let mut v = slot.lock().map_err(|_| poisoned())?;
        if let Some(v) = v.as_ref() {
            return Ok(v.clone());
        }
        let built = Arc::new(build()?);
        *v = Some(built.clone());
        Ok(built)
    }
}

/// Compiles (once per process, architecture and source) and loads (once per GPU and source)
/// a per-plan kernel.
fn plan_kernels(device: u32, source: &str) -> Result<Arc<Kernels>, Error> {
    static LOADED: OnceLock<OnceMap<Kernels>> = OnceLock::new();
    static COMPILED: OnceLock<OnceMap<Ptx>> = OnceLock::new();
    LOADED.get_or_init(OnceMap::new).get_or_build(format!("{device}\n{source}"), || {
        let opts = CompileOptions::for_device(device).name("executor_plan.cu");
        let ptx =
            COMPILED.get_or_init(OnceMap::new).get_or_build(format!("{}\n{source}", opts.resolved_arch()), || {
                let t = std::time::Instant::now();
                let p = compile(source, &opts).map_err(|e| e.during("compiling a per-plan executor kernel"))?;
                tracing::debug!(target: "mscclpp::executor", elapsed = ?t.elapsed(), "per-plan kernel compiled");
                Ok(p)
            })?;
        let module = KernelModule::load(device, &ptx)?;
        Ok(Kernels {
            ll16: module.function(crate::plan_kernel::KERNEL_LL16)?,
            ll8: module.function(crate::plan_kernel::KERNEL_LL8)?,
            _module: module,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks that pass different buffer sizes are refused at the build's first exchange,
    /// naming the first such rank (chunk offsets into peers' buffers come from each rank's own
    /// sizes); a malformed message is a remote error.
    #[test]
    fn sizes_that_differ_between_ranks_are_refused_naming_the_rank() {
        let msg = |s: u64, r: u64| [s.to_le_bytes(), r.to_le_bytes()].concat();
        check_same_sizes("p", (4096, 8192), &[msg(4096, 8192), msg(4096, 8192)]).unwrap();
        let e = check_same_sizes("p", (4096, 8192), &[msg(4096, 8192), msg(8192, 8192)]).unwrap_err();
        let ExecError::Mscclpp(e) = e else { panic!("{e}") };
        assert_eq!((e.kind(), e.peer()), (mscclpp::ErrorKind::InvalidUsage, Some(1)), "{e}");
        assert!(e.to_string().contains("rank 1 runs it with 8192 send / 8192 receive bytes"), "{e}");
        let ExecError::Mscclpp(e) = check_same_sizes("p", (1, 1), &[vec![1, 2, 3]]).unwrap_err() else { panic!() };
        assert_eq!(e.kind(), mscclpp::ErrorKind::Remote, "{e}");
    }

    #[test]
    fn kernel_kinds_are_named_in_any_case_with_either_separator() {
        for (name, kind) in [
            ("interpreter", Some(KernelKind::Interpreter)),
            ("Per-Plan", Some(KernelKind::PerPlan)),
            ("per_plan", Some(KernelKind::PerPlan)),
            ("jit", None),
            ("", None),
        ] {
            assert_eq!(KernelKind::from_name(name), kind, "{name:?}");
        }
    }

    #[test]
    fn once_map_builds_each_key_once_and_different_keys_in_parallel() {
        use std::sync::atomic::AtomicUsize;
        let m = OnceMap::<usize>::new();
        let builds = AtomicUsize::new(0);
        let started = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            // Two keys built at once: each build waits for the other to start, which would
            // deadlock if the map's lock were held while building.
            for k in ["a", "b"] {
                let (m, builds, started) = (&m, &builds, &started);
                s.spawn(move || {
                    m.get_or_build(k.into(), || {
                        started.wait();
                        builds.fetch_add(1, Ordering::Relaxed);
                        Ok(k.len())
                    })
                    .unwrap();
                });
            }
        });
        // Cached: no third build; a failed build leaves the key empty for the next caller.
        assert_eq!(*m.get_or_build("a".into(), || Ok(99)).unwrap(), 1);
        assert!(m.get_or_build("c".into(), || Err(Error::internal("no"))).is_err());
        assert_eq!(*m.get_or_build("c".into(), || Ok(3)).unwrap(), 3);
        assert_eq!(builds.load(Ordering::Relaxed), 2);
    }

    /// A build's exchange (`Communicator::all_gather_outcome` with the executor's error): a rank
    /// that cannot go on fails every other rank at once, named, with its reason; its own error
    /// comes back unchanged; with none failing, every rank's data comes back in rank order.
    #[test]
    fn a_build_exchange_names_the_rank_that_cannot_go_on() {
        use mscclpp::{Bootstrap, RootServer, TcpBootstrap};
        type Outcome = Result<(usize, Vec<Vec<u8>>), ExecError>;
        let run = |fail: Option<usize>| -> Vec<Outcome> {
            let n = 3;
            let (root, id) = RootServer::start(n, Duration::from_secs(30)).unwrap();
            let out = std::thread::scope(|s| {
                let hs: Vec<_> = (0..n)
                    .map(|rank| {
                        let id = id.clone();
                        s.spawn(move || {
                            let bs = Arc::new(
                                TcpBootstrap::config(rank, n).timeout(Duration::from_secs(30)).initialize(&id).unwrap(),
                            );
                            let comm = Communicator::new(bs.clone());
                            let mine = if fail == Some(rank) {
                                Err(LowerError::Size { send: 7, recv: 7, reason: "not whole chunks".into() }.into())
                            } else {
                                Ok(rank * 10)
                            };
                            let r = comm.all_gather_outcome(
                                mine,
                                |v: &usize| format!("r{}", v / 10).into_bytes(),
                                "plan p: checking its sizes",
                            );
                            bs.barrier().unwrap();
                            r
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
            });
            drop(root);
            out
        };
        for (rank, r) in run(None).into_iter().enumerate() {
            let (v, texts) = r.unwrap();
            assert_eq!((v, texts), (rank * 10, vec![b"r0".to_vec(), b"r1".to_vec(), b"r2".to_vec()]));
        }
        let res = run(Some(1));
        match &res[1] {
            Err(ExecError::Lower(LowerError::Size { reason, .. })) => assert_eq!(reason, "not whole chunks"),
            other => panic!("rank 1's own error changed: {other:?}"),
        }
        for r in [0, 2] {
            let Err(ExecError::Mscclpp(e)) = &res[r] else { panic!("rank {r}: {:?}", res[r]) };
            assert_eq!(e.peer(), Some(1), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("rank 1 cannot go on (plan p: checking its sizes)") && msg.contains("not whole chunks"),
                "{msg}"
            );
        }
    }

    #[test]
    fn residency_takes_the_fewest_blocks_per_sm_of_the_ranks_on_the_gpu() {
        let all: Vec<Vec<u8>> =
            ["h/0|4|2", "h/1|8|1", "h/0|3|4", "h/0|5|3"].iter().map(|s| s.as_bytes().to_vec()).collect();
        // Ranks 0, 2 and 3 share GPU h/0: 12 blocks, the tightest kernel allows 2 per SM,
        // whatever this rank's own kernel allows.
        assert_eq!(residency(&all, "h/0", 4), (12, 2));
        assert_eq!(residency(&all, "h/0", 1), (12, 1));
        assert_eq!(residency(&all, "h/1", 3), (8, 1));
        assert_eq!(residency(&all, "h/2", 3), (0, 3));
    }

    #[test]
    fn tags_separate_contexts_kinds_and_pairs() {
        let mut seen = std::collections::HashSet::new();
        for ctx in 0..4 {
            for what in 0..7 {
                for pair in [0, 1, 2, 255, 256, 257, crate::lower::MAX_PAIRS - 1] {
                    assert!(seen.insert(tag(ctx, what, pair)), "{ctx} {what} {pair}");
                }
            }
        }
        assert!(tag(255, 15, crate::lower::MAX_PAIRS - 1) >> 24 == TAG_BASE >> 24, "fields stay below the base");
    }

    /// The host work of a cached `execute` before the driver call: the cache lookup (lock, hash,
    /// reference count) and the argument block find the right entry every time. It prints the
    /// cost per call (`mscclpp-perf` measures it beside the launch; no time is asserted here).
    #[test]
    fn cached_lookup_and_arguments_find_every_entry() {
        let cache = Cache::new();
        let key = |i: u64| Key {
            plan: i % 4,
            send: 0x7f00_0000_0000 + i * 4096,
            recv: 0x7f10_0000_0000,
            send_size: 1 << 20,
            recv_size: 1 << 20,
        };
        for i in 0..64 {
            cache.insert(key(i), Arc::new(ExecArgs { input: i, ..ExecArgs::default() })).unwrap();
        }
        let n = 200_000u64;
        let t = std::time::Instant::now();
        let mut acc = 0u64;
        for i in 0..n {
            let r = cache.get(&key(i % 64)).unwrap().unwrap();
            let a = launch_args(&r, DataType::Bfloat16);
            acc = acc.wrapping_add(std::hint::black_box(a).input);
        }
        let per = t.elapsed() / n as u32;
        assert_eq!(acc, (0..n).map(|i| i % 64).sum::<u64>());
        println!("cached lookup + argument block: {per:?} per execute");
        assert!(cache.get(&key(1000)).unwrap().is_none());
    }

    #[test]
    fn key_hasher_spreads_nearby_buffers() {
        use std::hash::BuildHasher;
        let b = BuildHasherDefault::<KeyHasher>::default();
        let (mut seen, mut top, mut low) =
            (std::collections::HashSet::new(), std::collections::HashSet::new(), std::collections::HashSet::new());
        for i in 0..1000u64 {
            let p = 0x7f00_0000_0000 + i * 256;
            let h = b.hash_one(Key { plan: 1, send: p, recv: p, send_size: 256, recv_size: 256 });
            assert!(seen.insert(h), "collision at {i}");
            // hashbrown picks the bucket from the low bits and the tag from the top 7.
            top.insert(h >> 57);
            low.insert(h & 1023);
        }
        assert!(top.len() > 100 && low.len() > 500, "{} {}", top.len(), low.len());
    }

    #[test]
    fn device_errors_name_the_peer() {
        let e = ExecError::Device {
            rank: 0,
            plan: "p".into(),
            kind: DeviceFailureKind::Timeout,
            peer: Some(1),
            block: 2,
            op: 3,
            timeout: Duration::from_secs(2),
            counts: (0, 0),
            launch: 0,
            proxy: None,
        };
        assert_eq!(e.peer(), Some(1));
        let s = e.to_string();
        assert!(s.contains("rank 1") && s.contains("thread block 2") && s.contains("operation 3"), "{s}");
        assert!(!s.contains("launch") && !s.contains("signals"), "{s}");
    }

    #[test]
    fn semaphore_timeouts_say_how_far_the_peer_got_and_in_which_launch() {
        let e = |seen, need| {
            ExecError::Device {
                rank: 2,
                plan: "p".into(),
                kind: DeviceFailureKind::Timeout,
                peer: Some(3),
                block: 0,
                op: 2,
                timeout: Duration::from_secs(5),
                counts: (seen, need),
                launch: 7,
                proxy: Some(41),
            }
            .to_string()
        };
        let behind = e(13, 14);
        assert!(behind.contains("operation 2 (launch 7 of these buffers)"), "{behind}");
        assert!(behind.contains("13 of its signals had arrived, this wait needed 14"), "{behind}");
        assert!(behind.contains("is behind"), "{behind}");
        assert!(behind.ends_with("; this rank's proxy had handled 41 triggers of its kernels"), "{behind}");
    }
}
