//! Communicators: the handle C callers hold, what it owns (bootstrap, native collectives, the
//! real NCCL's communicator when the fallback is on), and how calls run on it.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, ReservedRoot, RootServer, TcpBootstrap, TransportFlags, UniqueId};
use mscclpp_collectives::{CallOptions, Collectives, Config, P2pConfig, P2pOp, PointToPoint};

use crate::abi::*;
use crate::error::{Failure, Res};
use crate::fallback::Nccl;
use crate::forward;
use crate::mem::{CudaMem, DeviceMem};
use crate::route::{self, Op, Route, Settings};

/// Bootstrap tags of the host-staged point-to-point messages (below mscclpp's reserved range).
const P2P_TAG: u64 = 0x6e63_636c_0000_0000;
/// Bootstrap tags of split's unique-id hand-out.
const SPLIT_TAG: u64 = 0x6e63_5370_0000_0000;
const HANDLE_MAGIC: u64 = 0x6d73_6363_6c70_6e63;

/// How long a wait of ours (bootstrap messages, a stream before host-staged copies, device
/// waits of the native kernels) may last: `MSCCLPP_NCCL_TIMEOUT_S` seconds, default 600 (NCCL
/// waits forever; torch's watchdog gives up after 600 s).
pub fn timeout() -> Duration {
    std::env::var("MSCCLPP_NCCL_TIMEOUT_S")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(600), Duration::from_secs)
}

/// What an `ncclComm_t` points to. Handles are never freed (a few words per communicator):
/// another thread may still hold one while `ncclCommDestroy`/`ncclCommAbort` runs, and it then
/// finds the slot empty instead of freed memory.
pub struct Handle {
    magic: u64,
    slot: Mutex<Slot>,
}

enum Slot {
    /// Queued in a group; built at `ncclGroupEnd`.
    Pending,
    Ready(Arc<Comm>),
    Failed(String),
    Destroyed,
}

impl Handle {
    /// A new handle for `comm`, as a C pointer.
    pub fn leak(comm: Option<Arc<Comm>>) -> ncclComm_t {
        let slot = comm.map_or(Slot::Pending, Slot::Ready);
        Box::into_raw(Box::new(Handle { magic: HANDLE_MAGIC, slot: Mutex::new(slot) })) as ncclComm_t
    }

    /// The handle behind `p`.
    ///
    /// # Safety
    /// `p` is NULL or a pointer this library returned as an `ncclComm_t`.
    pub unsafe fn from_ptr<'a>(p: ncclComm_t, what: &str) -> Res<&'a Handle> {
        if p.is_null() {
            return Err(Failure::arg(format!("{what}: the communicator is NULL")));
        }
        // SAFETY: the caller's contract: handles are never freed, so a pointer we returned stays
        // readable.
        let h = unsafe { &*(p as *const Handle) };
        if h.magic != HANDLE_MAGIC {
            return Err(Failure::arg(format!("{what}: {p:?} is not a communicator of this library")));
        }
        Ok(h)
    }

    /// The communicator, or why there is none.
    pub fn get(&self, what: &str) -> Res<Arc<Comm>> {
        match &*self.slot.lock().unwrap_or_else(|p| p.into_inner()) {
            Slot::Ready(c) => Ok(c.clone()),
            Slot::Pending => {
                Err(Failure::usage(format!("{what}: the communicator is still being built (its group has not ended)")))
            }
            Slot::Failed(m) => Err(Failure::usage(format!("{what}: the communicator failed to initialize: {m}"))),
            Slot::Destroyed => Err(Failure::usage(format!("{what}: the communicator was destroyed or aborted"))),
        }
    }

    /// Fills a pending handle.
    pub fn set(&self, r: Res<Arc<Comm>>) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = match r {
            Ok(c) => Slot::Ready(c),
            Err(e) => Slot::Failed(e.message),
        };
    }

    /// Empties the handle, returning the communicator it held.
    pub fn take(&self) -> Option<Arc<Comm>> {
        match std::mem::replace(&mut *self.slot.lock().unwrap_or_else(|p| p.into_inner()), Slot::Destroyed) {
            Slot::Ready(c) => Some(c),
            _ => None,
        }
    }
}

/// The real NCCL's communicator paired with ours.
pub struct Real {
    /// The library.
    pub nccl: &'static Nccl,
    /// Its `ncclComm_t`.
    pub comm: ncclComm_t,
}

// SAFETY: an ncclComm_t may be used from any thread (NCCL's contract); we only pass it on.
unsafe impl Send for Real {}
// SAFETY: as above.
unsafe impl Sync for Real {}

/// One rank's communicator.
pub struct Comm {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub nranks: usize,
    /// Its GPU.
    pub device: u32,
    /// The bootstrap and connections.
    pub comm: Communicator,
    /// The native collectives, or why there are none.
    pub native: Result<Collectives, String>,
    /// Whether the host-staged point-to-point path works (needs device memory access).
    pub p2p: Result<(), String>,
    /// The device point-to-point path (every rank has it, or none uses it), or why there is
    /// none; without it Send/Recv/AlltoAll/Gather/Scatter run host-staged.
    pub device_p2p: Result<PointToPoint, String>,
    /// The real NCCL's communicator, or why there is none.
    pub real: Result<Real, String>,
    /// The routing settings in force.
    pub settings: Settings,
    mem: Arc<dyn DeviceMem>,
    send_seq: Mutex<Vec<u64>>,
    recv_seq: Mutex<Vec<u64>>,
    self_msgs: Mutex<VecDeque<Vec<u8>>>,
    splits: Mutex<u64>,
    /// The root of the id `ncclCommGetUniqueId` handed out, until `ncclCommGrow` consumes it.
    grow_root: Mutex<Option<ReservedRoot>>,
    reduce_tmp: Mutex<Vec<DeviceBuffer>>,
    aborted: std::sync::atomic::AtomicBool,
    timeout: Duration,
    noop_native: bool,
    /// Per (operation, data type, reduction) of the header's values, whether the native
    /// collectives serve it (computed once at init; see [`native_fast`](Self::native_fast)).
    native_table: [[u8; ROUTE_DTS]; Op::ALL.len()],
}

/// Data types `0..ROUTE_DTS` (every `ncclDataType_t` of the header) are in the route table.
const ROUTE_DTS: usize = 12;
/// Reductions `0..ROUTE_REDS` (the built-in `ncclRedOp_t`s) are in the route table, one bit each.
const ROUTE_REDS: usize = 5;

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {}, GPU{})", self.rank, self.nranks, self.device)
    }
}

/// How a new communicator gets its real-NCCL side.
pub enum RealInit {
    /// A fresh NCCL communicator (rank 0 makes an NCCL unique id and sends it over our bootstrap).
    Fresh,
    /// Already made (by the real `ncclCommSplit`), or why not.
    Given(Result<Real, String>),
}

/// How to build a communicator.
pub struct InitArgs {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub nranks: usize,
    /// The job's id.
    pub id: UniqueId,
    /// The GPU (None: the calling thread's current one, else 0).
    pub device: Option<u32>,
    /// Memory operations (CUDA unless a test says otherwise).
    pub mem: Option<Arc<dyn DeviceMem>>,
    /// Whether to build the native collectives (tests without a GPU say no).
    pub native: bool,
    /// The real NCCL side.
    pub real: RealInit,
    /// Routing settings.
    pub settings: Settings,
    /// Benchmarks of the host path only (no GPU): the native collectives count as present and
    /// every call routed to them returns at once, launching nothing. Never set it otherwise.
    #[doc(hidden)]
    pub noop_native: bool,
}

impl InitArgs {
    /// The defaults for rank `rank` of `nranks` of job `id`.
    pub fn new(rank: usize, nranks: usize, id: UniqueId) -> InitArgs {
        InitArgs {
            rank,
            nranks,
            id,
            device: None,
            mem: None,
            native: true,
            real: RealInit::Fresh,
            settings: Settings::current(),
            noop_native: false,
        }
    }
}

/// Agreement of every rank: `Ok` only when every rank's `mine` is `Ok` (else the first
/// failing rank's reason).
fn agree(bs: &dyn Bootstrap, mine: &Result<(), String>) -> Res<Result<(), String>> {
    let me = match mine {
        Ok(()) => Vec::new(),
        Err(e) => {
            let mut v = e.as_bytes().to_vec();
            v.insert(0, 1);
            v
        }
    };
    let all = bs.all_gather(&me)?;
    for (r, w) in all.iter().enumerate() {
        if let Some((1, why)) = w.split_first() {
            return Ok(Err(format!("rank {r}: {}", String::from_utf8_lossy(why))));
        }
    }
    Ok(Ok(()))
}

impl Comm {
    /// Builds one rank's communicator (a collective call of all `nranks` ranks).
    ///
    /// # Errors
    /// Bootstrap errors (a rank that never arrives, a bad id), naming the rank.
    pub fn init(a: InitArgs) -> Res<Arc<Comm>> {
        let what = format!("ncclCommInitRank (rank {} of {})", a.rank, a.nranks);
        if a.nranks == 0 || a.rank >= a.nranks {
            return Err(Failure::arg(format!("{what}: rank {} is not in 0..{}", a.rank, a.nranks)));
        }
        let t = timeout();
        let bs = TcpBootstrap::config(a.rank, a.nranks)
            .timeout(t)
            .initialize(&a.id)
            .map_err(|e| Failure::from(e).during(&what))?;
        let comm = Communicator::new(Arc::new(bs));
        let device = a.device.or_else(crate::mem::current_device).unwrap_or(0);
        let bs = comm.bootstrap().clone();
        // The native side: every rank needs a GPU, or nobody builds the collectives.
        let gpu = crate::mem::driver().map(|_| ());
        let have = agree(bs.as_ref(), &if a.native { gpu.clone() } else { Err("native path turned off".into()) })?;
        let native = match have {
            Ok(()) => {
                let mut cfg = Config::new(device).timeout(t);
                cfg.device = device;
                Collectives::new(&comm, cfg).map_err(|e| format!("building the native collectives failed: {e}"))
            }
            Err(e) => Err(e),
        };
        if let Err(e) = &native {
            tracing::warn!(target: "mscclpp::nccl", rank = a.rank, "no native collectives: {e}");
        }
        let device_p2p = build_device_p2p(&comm, bs.as_ref(), &native, a.native, device, t)?;
        match &device_p2p {
            Ok(p) => tracing::debug!(target: "mscclpp::nccl", rank = a.rank, "device point-to-point path: {p:?}"),
            Err(e) => {
                tracing::info!(target: "mscclpp::nccl", rank = a.rank, "no device point-to-point path (Send/Recv run host-staged): {e}")
            }
        }
        let mem: Arc<dyn DeviceMem> = a.mem.unwrap_or_else(|| Arc::new(CudaMem));
        let p2p = if a.native && gpu.is_err() { gpu.clone() } else { Ok(()) };
        let real = match a.real {
            RealInit::Given(r) => r,
            RealInit::Fresh => init_real(bs.as_ref(), a.rank, a.nranks, &a.settings)?,
        };
        if let Err(e) = &real {
            tracing::debug!(target: "mscclpp::nccl", rank = a.rank, "no NCCL fallback: {e}");
        }
        for u in &a.settings.unknown_forced {
            tracing::warn!(target: "mscclpp::nccl", "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION: unknown operation {u:?}");
        }
        tracing::info!(target: "mscclpp::nccl", rank = a.rank, nranks = a.nranks, gpu = device,
            native = native.is_ok(), fallback = real.is_ok(), "communicator ready");
        let n = a.nranks;
        let native_table = native_table(&a.settings.forced, native.is_ok() || a.noop_native);
        Ok(Arc::new(Comm {
            rank: a.rank,
            nranks: n,
            device,
            comm,
            native,
            p2p,
            device_p2p,
            real,
            settings: a.settings,
            mem,
            send_seq: Mutex::new(vec![0; n]),
            recv_seq: Mutex::new(vec![0; n]),
            self_msgs: Mutex::new(VecDeque::new()),
            splits: Mutex::new(0),
            grow_root: Mutex::new(None),
            reduce_tmp: Mutex::new(Vec::new()),
            aborted: std::sync::atomic::AtomicBool::new(false),
            timeout: t,
            noop_native: a.noop_native,
            native_table,
        }))
    }

    /// The bootstrap.
    pub fn bootstrap(&self) -> &Arc<dyn Bootstrap> {
        self.comm.bootstrap()
    }

    /// Whether the real NCCL is there (`Err`: why not).
    pub fn fallback_state(&self) -> Result<(), String> {
        self.real.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// The real communicator, or a failure naming `what`.
    pub fn real(&self, what: &str) -> Res<&Real> {
        self.real.as_ref().map_err(|e| {
            Failure::usage(format!(
                "{what} (rank {}): this library has no native {what} and no NCCL fallback ({e})",
                self.rank
            ))
        })
    }

    /// [`live`](Self::live), describing the call only when it fails.
    pub fn live_with(&self, what: impl FnOnce() -> String) -> Res {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            return self.live(&what());
        }
        Ok(())
    }

    /// Fails when the communicator was aborted or revoked.
    pub fn live(&self, what: &str) -> Res {
        if self.aborted.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Failure::new(
                ncclInvalidUsage,
                format!("{what} (rank {}): the communicator was aborted or revoked", self.rank),
            ));
        }
        Ok(())
    }

    /// Stops every wait of this communicator: running and future native kernels end with an
    /// error, the real NCCL's communicator is aborted, later calls fail.
    pub fn abort(&self) -> Res {
        self.aborted.store(true, std::sync::atomic::Ordering::Release);
        let mut first = Ok(());
        if let Ok(c) = &self.native {
            first = c.abort().map_err(Failure::from);
        }
        if let Ok(p) = &self.device_p2p {
            first = first.and(p.abort().map_err(Failure::from));
        }
        if let Ok(r) = &self.real {
            let res = forward!(r.nccl, "ncclCommAbort", (r.comm => ncclComm_t));
            first = first.and(res);
        }
        first
    }

    /// Marks the communicator revoked (native kernels stop; the real NCCL's is revoked).
    pub fn revoke(&self, flags: c_int) -> Res {
        self.aborted.store(true, std::sync::atomic::Ordering::Release);
        let mut first = Ok(());
        if let Ok(c) = &self.native {
            first = c.abort().map_err(Failure::from);
        }
        if let Ok(p) = &self.device_p2p {
            first = first.and(p.abort().map_err(Failure::from));
        }
        if let Ok(r) = &self.real {
            first = first.and(forward!(r.nccl, "ncclCommRevoke", (r.comm => ncclComm_t, flags => c_int)));
        }
        first
    }

    /// `ncclCommGetAsyncError`: the native kernels' reported error, then the real NCCL's.
    pub fn async_error(&self) -> ncclResult_t {
        if let Ok(c) = &self.native
            && let Err(e) = c.check()
        {
            let f = Failure::from(e).during(&format!("rank {}", self.rank));
            return crate::error::record(&f);
        }
        if let Ok(p) = &self.device_p2p
            && let Err(e) = p.check()
        {
            let f = Failure::from(e).during(&format!("rank {}", self.rank));
            return crate::error::record(&f);
        }
        if let Ok(r) = &self.real {
            let mut v: ncclResult_t = 0;
            let res = forward!(r.nccl, "ncclCommGetAsyncError", (r.comm => ncclComm_t, &mut v as *mut ncclResult_t => *mut ncclResult_t));
            if res.is_ok() {
                return v;
            }
        }
        ncclSuccess
    }

    fn native_for(&self, op: Op, dt: ncclDataType_t, red: ncclRedOp_t, count: usize) -> Result<(), String> {
        // The call's own limits first: they name the most specific reason.
        route::native_support(op, dt, red, count)?;
        if self.noop_native && !op.is_p2p() {
            return Ok(());
        }
        if op.is_p2p() { self.p2p.clone() } else { self.native.as_ref().map(|_| ()).map_err(Clone::clone) }
    }

    /// Whether this call of a collective (not point to point) goes to the native collectives,
    /// answered from the table built at init: no lock, no allocation, no environment read.
    /// `false` means "ask [`route`](Self::route)", which decides every other case (and says
    /// why). Agrees with `route` wherever it answers `true` (a unit test checks every entry).
    #[inline]
    pub fn native_fast(&self, op: Op, dt: ncclDataType_t, red: ncclRedOp_t, count: usize) -> bool {
        fast_native(&self.native_table, op, dt, red, count)
    }

    /// Where `op` goes on this communicator, logged once per (operation, route).
    pub fn route(&self, op: Op, dt: ncclDataType_t, red: ncclRedOp_t, count: usize) -> Route {
        let r = route::route(op, &self.settings.forced, self.native_for(op, dt, red, count), self.fallback_state());
        log_route(op, dt, &r, self.rank, self.device_p2p.is_ok());
        r
    }

    /// Native AllReduce / AllGather / ReduceScatter / Broadcast / Reduce.
    pub fn run_native(&self, c: &Call) -> Res {
        if self.noop_native {
            return Ok(());
        }
        // Described only on failure: formatting it on every call costs a good part of the
        // per-call budget (<= 1 us over a direct call).
        let what = || c.describe(self);
        let coll = self.native.as_ref().map_err(|e| Failure::usage(format!("{}: {e}", what())))?;
        // SAFETY: the caller's stream (NCCL's contract: live while the call is enqueued).
        let stream =
            unsafe { Stream::from_raw(self.device, c.stream) }.map_err(|e| Failure::from(e).during(&what()))?;
        let opts = CallOptions::default();
        let es = route::type_size(c.dt).unwrap_or(1);
        let err = |e: mscclpp::Error| Failure::from(e).during(&what());
        let bad = |m: String| Failure::usage(format!("{}: {m}", what()));
        let bytes = c.count.checked_mul(es).ok_or_else(|| bad(format!("{} elements overflow a size", c.count)))?;
        match c.op {
            Op::AllReduce | Op::ReduceScatter | Op::Reduce => {
                let dt = route::native_reduce_type(c.dt).map_err(bad)?;
                let op = route::native_op(c.red).map_err(bad)?;
                match c.op {
                    Op::AllReduce => {
                        // SAFETY: NCCL's contract on the buffers (count elements, live until done).
                        unsafe { coll.all_reduce(c.send, c.recv, c.count, dt, op, &stream, &opts) }.map_err(err)
                    }
                    Op::ReduceScatter => {
                        // SAFETY: as above (send holds nranks x count).
                        unsafe { coll.reduce_scatter(c.send, c.recv, c.count, dt, op, &stream, &opts) }.map_err(err)
                    }
                    _ => {
                        // Reduce: an AllReduce into the root's receive buffer; the others reduce
                        // into a scratch they keep (their receive buffer may be NULL).
                        let out = if c.peer as usize == self.rank { c.recv } else { self.reduce_scratch(bytes)? };
                        // SAFETY: as above; `out` is the root's buffer or our own scratch.
                        unsafe { coll.all_reduce(c.send, out, c.count, dt, op, &stream, &opts) }.map_err(err)
                    }
                }
            }
            Op::AllGather | Op::Broadcast => {
                let nbytes = bytes;
                let align = c.send | c.recv;
                let (dt, n) =
                    words(nbytes, align).ok_or_else(|| bad(format!("{nbytes} bytes are not 2-byte words")))?;
                if c.op == Op::AllGather {
                    // SAFETY: NCCL's contract (recv holds nranks x count).
                    unsafe { coll.all_gather(c.send, c.recv, n, dt, &stream, &opts) }.map_err(err)
                } else {
                    // SAFETY: NCCL's contract.
                    unsafe { coll.broadcast(c.send, c.recv, n, dt, c.peer as usize, &stream, &opts) }.map_err(err)
                }
            }
            _ => Err(Failure::new(ncclInternalError, format!("{}: not a collective", what()))),
        }
    }

    fn reduce_scratch(&self, bytes: usize) -> Res<u64> {
        let mut v = self.reduce_tmp.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = v.last()
            && b.len() >= bytes
        {
            return Ok(b.device_ptr());
        }
        // Older, smaller ones stay alive: work queued on them may still run.
        let b = DeviceBuffer::new(self.comm.context(), self.device, bytes.max(1 << 20), TransportFlags::NONE).map_err(
            |e| Failure::from(e).during(&format!("ncclReduce scratch of {bytes} bytes (rank {})", self.rank)),
        )?;
        let p = b.device_ptr();
        v.push(b);
        Ok(p)
    }

    /// Forwards a collective call to the real NCCL.
    pub fn run_fallback(&self, c: &Call) -> Res {
        let r = self.real(c.op.name())?;
        let (n, rc) = (r.nccl, r.comm);
        let (s, rv, cnt, dt, red, peer, st) =
            (c.send as *const c_void, c.recv as *mut c_void, c.count, c.dt, c.red, c.peer, c.stream as cudaStream_t);
        match c.op {
            Op::AllReduce => {
                forward!(n, "ncclAllReduce", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, red => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::ReduceScatter => {
                forward!(n, "ncclReduceScatter", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, red => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::Reduce => {
                forward!(n, "ncclReduce", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, red => c_int, peer => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::AllGather => {
                forward!(n, "ncclAllGather", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::Broadcast => {
                forward!(n, "ncclBroadcast", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, peer => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::Send => {
                forward!(n, "ncclSend", (s => *const c_void, cnt => usize, dt => c_int, peer => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::Recv => {
                forward!(n, "ncclRecv", (rv => *mut c_void, cnt => usize, dt => c_int, peer => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::AllToAll => {
                forward!(n, "ncclAlltoAll", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::Gather => {
                forward!(n, "ncclGather", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, peer => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
            Op::Scatter => {
                forward!(n, "ncclScatter", (s => *const c_void, rv => *mut c_void, cnt => usize, dt => c_int, peer => c_int, rc => ncclComm_t, st => cudaStream_t))
            }
        }
    }

    /// Splits this communicator (a collective call of all its ranks): ranks of one `color` form
    /// a new one, ordered by `key` then rank; `NCCL_SPLIT_NOCOLOR` gets `None`.
    pub fn split(self: &Arc<Comm>, color: c_int, key: c_int, config: Option<&ncclConfig_t>) -> Res<Option<Arc<Comm>>> {
        let what = format!("ncclCommSplit (rank {} of {}, color {color}, key {key})", self.rank, self.nranks);
        self.live(&what)?;
        let bs = self.bootstrap().clone();
        let mut me = color.to_le_bytes().to_vec();
        me.extend_from_slice(&key.to_le_bytes());
        let all = bs.all_gather(&me).map_err(|e| Failure::from(e).during(&what))?;
        let mut ck = Vec::new();
        for w in &all {
            let b: [u8; 8] = w
                .as_slice()
                .try_into()
                .map_err(|_| Failure::new(ncclRemoteError, format!("{what}: a peer sent a malformed split request")))?;
            let c = c_int::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let k = c_int::from_le_bytes([b[4], b[5], b[6], b[7]]);
            ck.push((c, k));
        }
        let seq = {
            let mut s = self.splits.lock().unwrap_or_else(|p| p.into_inner());
            *s += 1;
            *s
        };
        // The real NCCL splits too (all its ranks call it), whatever our side decides.
        let real = match &self.real {
            Ok(r) => {
                let mut newc: ncclComm_t = std::ptr::null_mut();
                let cfg = config.map_or(std::ptr::null_mut(), |c| c as *const ncclConfig_t as *mut ncclConfig_t);
                forward!(r.nccl, "ncclCommSplit", (r.comm => ncclComm_t, color => c_int, key => c_int, &mut newc as *mut ncclComm_t => *mut ncclComm_t, cfg => *mut ncclConfig_t))?;
                if newc.is_null() {
                    Err("no NCCL communicator for this color".to_string())
                } else {
                    Ok(Real { nccl: r.nccl, comm: newc })
                }
            }
            Err(e) => Err(e.clone()),
        };
        let Some(g) = split_group(&ck, self.rank) else { return Ok(None) };
        let tag = SPLIT_TAG | seq;
        let id = if g.leader == self.rank {
            let id = TcpBootstrap::create_unique_id().map_err(|e| Failure::from(e).during(&what))?;
            let bytes = id.to_bytes();
            for &m in &g.members {
                if m != self.rank {
                    bs.send(m, tag, &bytes).map_err(|e| Failure::from(e).during(&what))?;
                }
            }
            id
        } else {
            let b = bs.recv(g.leader, tag).map_err(|e| Failure::from(e).during(&what))?;
            UniqueId::from_bytes(&b).map_err(|e| Failure::from(e).during(&what))?
        };
        let mut a = InitArgs::new(g.new_rank, g.members.len(), id);
        a.device = Some(self.device);
        a.mem = Some(self.mem.clone());
        a.native = self.p2p.is_ok();
        a.real = RealInit::Given(real);
        a.settings = self.settings.clone();
        Comm::init(a).map(Some)
    }

    /// Records `c` for the host-staged point-to-point path: its primitives.
    pub fn p2p_prims(&self, c: &Call) -> Res<Vec<Prim>> {
        let what = || c.describe(self);
        let es = route::type_size(c.dt).ok_or_else(|| Failure::arg(format!("{}: unknown data type", what())))?;
        let bytes = c.count.checked_mul(es).ok_or_else(|| Failure::arg(format!("{}: count overflows", what())))?;
        let n = self.nranks;
        let peer_ok = |p: c_int| -> Res<usize> {
            if p < 0 || p as usize >= n {
                return Err(Failure::arg(format!("{}: peer {p} is not a rank of 0..{n}", what())));
            }
            Ok(p as usize)
        };
        p2p_prims(c.op, self.rank, n, c.send, c.recv, bytes, c.peer, c.stream)
            .and_then(|v| {
                for p in &v {
                    if let Prim::Send { peer, .. } | Prim::Recv { peer, .. } = p {
                        peer_ok(*peer as c_int)?;
                    }
                }
                Ok(v)
            })
            .map_err(|e| if e.message.starts_with(&what()) { e } else { e.during(&what()) })
    }

    fn next_seq(v: &Mutex<Vec<u64>>, peer: usize) -> u64 {
        let mut v = v.lock().unwrap_or_else(|p| p.into_inner());
        let s = v.get(peer).copied().unwrap_or(0);
        if let Some(x) = v.get_mut(peer) {
            *x = s + 1;
        }
        s
    }

    /// Sends: waits for the stream, reads the buffer and posts it to the peer (never blocks on
    /// the peer's receive: the bootstrap queues messages).
    fn exec_send(&self, peer: usize, ptr: u64, len: usize, stream: u64) -> Res {
        let what = || format!("ncclSend of {len} bytes to rank {peer} (rank {} of {})", self.rank, self.nranks);
        self.mem.wait_stream(self.device, stream, self.timeout).map_err(|e| e.during(&what()))?;
        // SAFETY: NCCL's contract: ptr holds len bytes.
        let data = unsafe { self.mem.read(self.device, ptr, len) }.map_err(|e| e.during(&what()))?;
        if peer == self.rank {
            self.self_msgs.lock().unwrap_or_else(|p| p.into_inner()).push_back(data);
            return Ok(());
        }
        let tag = P2P_TAG | (Self::next_seq(&self.send_seq, peer) & 0xffff_ffff);
        self.bootstrap().send(peer, tag, &data).map_err(|e| Failure::from(e).during(&what()))
    }

    fn exec_recv(&self, peer: usize, ptr: u64, len: usize, stream: u64) -> Res {
        let what = || format!("ncclRecv of {len} bytes from rank {peer} (rank {} of {})", self.rank, self.nranks);
        let data = if peer == self.rank {
            self.self_msgs.lock().unwrap_or_else(|p| p.into_inner()).pop_front().ok_or_else(|| {
                Failure::usage(format!("{}: no ncclSend to itself came before it in the group", what()))
            })?
        } else {
            let tag = P2P_TAG | (Self::next_seq(&self.recv_seq, peer) & 0xffff_ffff);
            self.bootstrap().recv(peer, tag).map_err(|e| Failure::from(e).during(&what()))?
        };
        if data.len() != len {
            return Err(Failure::usage(format!(
                "{}: rank {peer} sent {} bytes (send and receive sizes must match)",
                what(),
                data.len()
            )));
        }
        self.mem.wait_stream(self.device, stream, self.timeout).map_err(|e| e.during(&what()))?;
        // SAFETY: NCCL's contract: ptr holds len writable bytes.
        unsafe { self.mem.write(self.device, ptr, &data) }.map_err(|e| e.during(&what()))
    }
}

/// Words for the native data movers: U32 when bytes and pointers allow, else 16-bit.
fn words(nbytes: usize, align: u64) -> Option<(mscclpp_collectives::DataType, usize)> {
    match route::as_words(nbytes)? {
        (mscclpp_collectives::DataType::U32, n) if !align.is_multiple_of(4) => {
            align.is_multiple_of(2).then_some((mscclpp_collectives::DataType::F16, n * 2))
        }
        w => Some(w),
    }
}

/// The group of a split: ordered members (old ranks), this rank's new rank, the leader.
#[derive(Debug, PartialEq, Eq)]
pub struct SplitGroup {
    /// Old ranks of the new communicator, in new-rank order.
    pub members: Vec<usize>,
    /// This rank's new rank.
    pub new_rank: usize,
    /// The old rank that makes the new unique id (new rank 0).
    pub leader: usize,
}

/// The group of rank `me` given every rank's `(color, key)`; `None` for `NCCL_SPLIT_NOCOLOR`
/// (any negative color).
pub fn split_group(ck: &[(c_int, c_int)], me: usize) -> Option<SplitGroup> {
    let (color, _) = *ck.get(me)?;
    if color < 0 {
        return None;
    }
    let mut members: Vec<usize> = (0..ck.len()).filter(|&r| ck[r].0 == color).collect();
    members.sort_by_key(|&r| (ck[r].1, r));
    let new_rank = members.iter().position(|&r| r == me)?;
    Some(SplitGroup { leader: members[0], members, new_rank })
}

/// Whether `MSCCLPP_NCCL_P2P` allows the device point-to-point path (`host` turns it off; every
/// rank must agree, which `build_device_p2p` checks).
pub fn device_p2p_setting(v: Option<&str>) -> Result<(), String> {
    match v.map(|v| v.trim().to_ascii_lowercase()) {
        Some(v) if v == "host" || v == "0" || v == "off" => Err(format!("turned off (MSCCLPP_NCCL_P2P={v})")),
        _ => Ok(()),
    }
}

/// Builds the device point-to-point path when every rank wants it (a GPU, the native
/// collectives, `MSCCLPP_NCCL_P2P` not `host`) and keeps it only when every rank built it, so
/// all ranks of a communicator use the same path (a device send never meets a host-staged
/// receive).
fn build_device_p2p(
    comm: &Communicator,
    bs: &dyn Bootstrap,
    native: &Result<Collectives, String>,
    want_native: bool,
    device: u32,
    t: Duration,
) -> Res<Result<PointToPoint, String>> {
    let setting = std::env::var("MSCCLPP_NCCL_P2P").ok();
    let mine = if !want_native {
        Err("native path turned off".to_string())
    } else {
        native.as_ref().map(|_| ()).map_err(Clone::clone).and(device_p2p_setting(setting.as_deref()))
    };
    if let Err(e) = agree(bs, &mine)? {
        return Ok(Err(e));
    }
    let built = PointToPoint::new(comm, P2pConfig::new(device).timeout(t))
        .map_err(|e| format!("building the device point-to-point path failed: {e}"));
    Ok(match agree(bs, &built.as_ref().map(|_| ()).map_err(Clone::clone))? {
        Ok(()) => built,
        Err(e) => Err(e),
    })
}

/// The device operations of one communicator's point-to-point primitives of a group, and their
/// stream: sends and receives to this rank itself pair (in order) into copies. `Err` says why
/// the group cannot run on the device path (more than one stream, unpaired self messages).
pub fn device_ops(me: usize, prims: &[Prim]) -> Result<(Vec<P2pOp>, Option<u64>), String> {
    let mut stream = None;
    let (mut self_sends, mut self_recvs) = (Vec::new(), Vec::new());
    let mut ops = Vec::with_capacity(prims.len());
    for p in prims {
        let (Prim::Send { stream: s, .. } | Prim::Recv { stream: s, .. } | Prim::Copy { stream: s, .. }) = *p;
        match stream {
            None => stream = Some(s),
            Some(x) if x != s => {
                return Err(format!(
                    "the group's sends and receives of this communicator use more than one stream ({x:#x} and {s:#x})"
                ));
            }
            Some(_) => {}
        }
        match *p {
            Prim::Send { peer, ptr, len, .. } if peer == me => self_sends.push((ptr, len)),
            Prim::Recv { peer, ptr, len, .. } if peer == me => self_recvs.push((ptr, len)),
            Prim::Send { peer, ptr, len, .. } => ops.push(P2pOp::Send { peer, ptr, bytes: len as u64 }),
            Prim::Recv { peer, ptr, len, .. } => ops.push(P2pOp::Recv { peer, ptr, bytes: len as u64 }),
            Prim::Copy { dst, src, len, .. } => ops.push(P2pOp::Copy { dst, src, bytes: len as u64 }),
        }
    }
    if self_sends.len() != self_recvs.len() {
        return Err(format!(
            "{} sends to this rank itself and {} receives from it in one group (they must pair)",
            self_sends.len(),
            self_recvs.len()
        ));
    }
    for ((src, n), (dst, m)) in self_sends.into_iter().zip(self_recvs) {
        if n != m {
            return Err(format!("a send of {n} bytes to this rank itself meets a receive of {m} bytes"));
        }
        ops.push(P2pOp::Copy { dst, src, bytes: n as u64 });
    }
    Ok((ops, stream))
}

impl Comm {
    /// Runs this communicator's point-to-point primitives of a group on the device path: one
    /// kernel (graph-capturable).
    pub fn exec_p2p_device(&self, d: &PointToPoint, prims: &[Prim]) -> Res {
        let what = format!("send/recv (rank {} of {}, device path)", self.rank, self.nranks);
        let (ops, stream) = device_ops(self.rank, prims).map_err(|m| Failure::usage(format!("{what}: {m}")))?;
        let Some(stream) = stream else { return Ok(()) };
        // SAFETY: the caller's stream (NCCL's contract: live while the call is enqueued).
        let stream = unsafe { Stream::from_raw(self.device, stream) }.map_err(|e| Failure::from(e).during(&what))?;
        // SAFETY: NCCL's contract on the buffers (count elements, live until the call is done on
        // the stream; the peers make the matching calls).
        unsafe { d.launch(&ops, &stream) }.map_err(|e| Failure::from(e).during(&what))
    }
}

fn init_real(bs: &dyn Bootstrap, rank: usize, nranks: usize, s: &Settings) -> Res<Result<Real, String>> {
    let mine = crate::fallback::nccl_with(s).map(|_| ());
    if let Err(e) = agree(bs, &mine)? {
        return Ok(Err(e));
    }
    let nccl = match crate::fallback::nccl_with(s) {
        Ok(n) => n,
        Err(e) => return Ok(Err(e)),
    };
    let mut id = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    let got = if rank == 0 {
        forward!(nccl, "ncclGetUniqueId", (&mut id as *mut ncclUniqueId => *mut ncclUniqueId)).map(|_| ())
    } else {
        Ok(())
    };
    // Rank 0 sends the id, or an empty message when NCCL failed to make one.
    let bytes: Vec<u8> = match &got {
        Ok(()) => id.internal.iter().map(|&c| c as u8).collect(),
        Err(_) => Vec::new(),
    };
    let bytes = bs.broadcast(0, &bytes)?;
    if bytes.len() != NCCL_UNIQUE_ID_BYTES {
        return Ok(Err(format!("rank 0 could not make an NCCL unique id: {:?}", got.err().map(|e| e.message))));
    }
    for (d, s) in id.internal.iter_mut().zip(&bytes) {
        *d = *s as std::ffi::c_char;
    }
    let mut rc: ncclComm_t = std::ptr::null_mut();
    let r = forward!(nccl, "ncclCommInitRank", (&mut rc as *mut ncclComm_t => *mut ncclComm_t, nranks as c_int => c_int, id => ncclUniqueId, rank as c_int => c_int));
    Ok(match r {
        Ok(()) if !rc.is_null() => Ok(Real { nccl, comm: rc }),
        Ok(()) => Err("the NCCL fallback returned no communicator".into()),
        Err(e) => Err(e.message),
    })
}

/// [`Comm::native_fast`] on a table made by [`native_table`].
#[inline]
fn fast_native(
    table: &[[u8; ROUTE_DTS]; Op::ALL.len()],
    op: Op,
    dt: ncclDataType_t,
    red: ncclRedOp_t,
    count: usize,
) -> bool {
    // Only reductions depend on `red`; the table holds every other operation's answer in bit 0.
    let red = if op.reduces() { red } else { 0 };
    if op.is_p2p() || !(0..ROUTE_DTS as c_int).contains(&dt) || !(0..ROUTE_REDS as c_int).contains(&red) {
        return false;
    }
    let bits = table[op as usize][dt as usize];
    if bits & (1 << red) == 0 {
        return false;
    }
    // Data movement runs as 2- or 4-byte words: an odd byte count is not native.
    op.reduces() || route::type_size(dt).is_some_and(|es| count.saturating_mul(es).is_multiple_of(2))
}

/// The native-route table of a communicator: bit `red` of `[op][dt]` is set when
/// [`route::route`] sends that call (of an even byte count) to the native collectives.
fn native_table(forced: &[Op], native_up: bool) -> [[u8; ROUTE_DTS]; Op::ALL.len()] {
    let mut t = [[0u8; ROUTE_DTS]; Op::ALL.len()];
    if !native_up {
        return t;
    }
    for op in Op::ALL {
        if op.is_p2p() {
            continue;
        }
        for dt in 0..ROUTE_DTS as c_int {
            for red in 0..ROUTE_REDS as c_int {
                let native = route::native_support(op, dt, red, 2);
                if route::route(op, forced, native, Err(String::new())) == Route::Native {
                    t[op as usize][dt as usize] |= 1 << red;
                }
            }
        }
    }
    t
}

/// Logs where `(op, dt)` went, once per process per (operation, type, route). After the first
/// time it is one relaxed atomic load (no lock, no allocation, no formatting).
fn log_route(op: Op, dt: ncclDataType_t, r: &Route, rank: usize, device_p2p: bool) {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// Bit `dt` (types past 62 share bit 63) of word `op * 4 + route kind`.
    static SEEN: [AtomicU64; Op::ALL.len() * 4] = [const { AtomicU64::new(0) }; Op::ALL.len() * 4];
    let k = match r {
        Route::Native if op.is_p2p() && device_p2p => 3,
        Route::Native => 0,
        Route::Fallback => 1,
        Route::Refuse(_) => 2,
    };
    let bit = 1u64 << (dt.clamp(0, 63) as u32);
    let w = &SEEN[op as usize * 4 + k];
    if w.load(Ordering::Relaxed) & bit != 0 || w.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
        return;
    }
    let to = match r {
        Route::Native if op.is_p2p() && device_p2p => "native (device point-to-point over CUDA IPC)".to_string(),
        Route::Native if op.is_p2p() => "native (host-staged point-to-point over the bootstrap)".to_string(),
        Route::Native => "native (mscclpp collectives)".to_string(),
        Route::Fallback => "NCCL fallback".to_string(),
        Route::Refuse(m) => format!("refused: {m}"),
    };
    tracing::info!(target: "mscclpp::nccl", rank, "{op} of {} -> {to}", route::type_name(dt));
}

/// Logs a call the fast path sends to the native collectives (once, as [`Comm::route`] would).
pub(crate) fn log_native(op: Op, dt: ncclDataType_t, rank: usize) {
    log_route(op, dt, &Route::Native, rank, false);
}

/// One queued or immediate call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    /// Which operation.
    pub op: Op,
    /// Send buffer (device pointer).
    pub send: u64,
    /// Receive buffer.
    pub recv: u64,
    /// Element count as the C call gave it.
    pub count: usize,
    /// Element type.
    pub dt: ncclDataType_t,
    /// Reduction (reducing calls).
    pub red: ncclRedOp_t,
    /// Root (rooted calls) or peer (Send/Recv).
    pub peer: c_int,
    /// The caller's stream.
    pub stream: u64,
}

impl Call {
    /// `"ncclAllReduce (rank r of n, count x type)"`.
    pub fn describe(&self, c: &Comm) -> String {
        format!("{} (rank {} of {}, {} x {})", self.op, c.rank, c.nranks, self.count, route::type_name(self.dt))
    }
}

/// A host-staged point-to-point primitive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prim {
    /// Send `len` bytes at `ptr` to `peer` (may be this rank).
    Send {
        /// Peer.
        peer: usize,
        /// Buffer.
        ptr: u64,
        /// Bytes.
        len: usize,
        /// Stream.
        stream: u64,
    },
    /// Receive `len` bytes from `peer` into `ptr`.
    Recv {
        /// Peer.
        peer: usize,
        /// Buffer.
        ptr: u64,
        /// Bytes.
        len: usize,
        /// Stream.
        stream: u64,
    },
    /// A local copy, ordered on `stream`.
    Copy {
        /// Destination.
        dst: u64,
        /// Source.
        src: u64,
        /// Bytes.
        len: usize,
        /// Stream.
        stream: u64,
    },
}

/// The primitives of one point-to-point call of rank `me` of `n` (`bytes` per peer chunk).
#[allow(clippy::too_many_arguments)]
pub fn p2p_prims(
    op: Op,
    me: usize,
    n: usize,
    send: u64,
    recv: u64,
    bytes: usize,
    peer: c_int,
    stream: u64,
) -> Res<Vec<Prim>> {
    let chunk = |base: u64, i: usize| base + (i * bytes) as u64;
    let root = || -> Res<usize> {
        if peer < 0 || peer as usize >= n {
            return Err(Failure::arg(format!("{op}: root {peer} is not a rank of 0..{n}")));
        }
        Ok(peer as usize)
    };
    let mut v = Vec::new();
    if bytes == 0 {
        return Ok(v);
    }
    match op {
        Op::Send => v.push(Prim::Send { peer: peer.max(0) as usize, ptr: send, len: bytes, stream }),
        Op::Recv => v.push(Prim::Recv { peer: peer.max(0) as usize, ptr: recv, len: bytes, stream }),
        Op::AllToAll => {
            for p in 0..n {
                if p == me {
                    v.push(Prim::Copy { dst: chunk(recv, p), src: chunk(send, p), len: bytes, stream });
                } else {
                    v.push(Prim::Send { peer: p, ptr: chunk(send, p), len: bytes, stream });
                    v.push(Prim::Recv { peer: p, ptr: chunk(recv, p), len: bytes, stream });
                }
            }
        }
        Op::Gather => {
            let r = root()?;
            if me == r {
                for p in 0..n {
                    if p == me {
                        v.push(Prim::Copy { dst: chunk(recv, p), src: send, len: bytes, stream });
                    } else {
                        v.push(Prim::Recv { peer: p, ptr: chunk(recv, p), len: bytes, stream });
                    }
                }
            } else {
                v.push(Prim::Send { peer: r, ptr: send, len: bytes, stream });
            }
        }
        Op::Scatter => {
            let r = root()?;
            if me == r {
                for p in 0..n {
                    if p == me {
                        v.push(Prim::Copy { dst: recv, src: chunk(send, p), len: bytes, stream });
                    } else {
                        v.push(Prim::Send { peer: p, ptr: chunk(send, p), len: bytes, stream });
                    }
                }
            } else {
                v.push(Prim::Recv { peer: r, ptr: recv, len: bytes, stream });
            }
        }
        _ => return Err(Failure::new(ncclInternalError, format!("{op} is not point-to-point"))),
    }
    Ok(v)
}

/// Runs host-staged primitives of several communicators so that no pairing deadlocks: every
/// send first (they only queue), then local copies, then every receive, each class in call order.
/// Fails before moving anything when a stream is capturing a CUDA graph (the host-staged path
/// cannot be captured).
pub fn exec_p2p(batch: &[(Arc<Comm>, Prim)]) -> Res {
    for (c, p) in batch {
        let (Prim::Send { stream, .. } | Prim::Recv { stream, .. } | Prim::Copy { stream, .. }) = *p;
        if c.mem.capturing(c.device, stream)? {
            return Err(Failure::usage(format!(
                "send/recv (rank {} of {}): the native point-to-point path is host-staged and cannot be captured in a CUDA graph; set MSCCLPP_ENABLE_NCCL_FALLBACK=1 to send it to NCCL",
                c.rank, c.nranks
            )));
        }
    }
    for (c, p) in batch {
        if let Prim::Send { peer, ptr, len, stream } = *p {
            c.exec_send(peer, ptr, len, stream)?;
        }
    }
    for (c, p) in batch {
        if let Prim::Copy { dst, src, len, stream } = *p {
            // SAFETY: NCCL's contract on the caller's buffers.
            unsafe { c.mem.copy(c.device, dst, src, len, stream) }?;
        }
    }
    for (c, p) in batch {
        if let Prim::Recv { peer, ptr, len, stream } = *p {
            c.exec_recv(peer, ptr, len, stream)?;
        }
    }
    Ok(())
}

impl Comm {
    /// `ncclCommGetUniqueId`: an id for growing this communicator, whose root this rank binds
    /// now and serves when it calls [`grow`](Self::grow) with it. One at a time: a second id
    /// before the first was consumed by a grow is refused (as in NCCL).
    pub fn grow_unique_id(&self) -> Res<UniqueId> {
        let what = format!("ncclCommGetUniqueId (rank {} of {})", self.rank, self.nranks);
        self.live(&what)?;
        let mut g = self.grow_root.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_some() {
            return Err(Failure::usage(format!(
                "{what}: the id of an earlier ncclCommGetUniqueId on this rank was not consumed by ncclCommGrow yet"
            )));
        }
        let (root, id) = RootServer::reserve().map_err(|e| Failure::from(e).during(&what))?;
        *g = Some(root);
        Ok(id)
    }

    /// `ncclCommGrow` on an existing rank (a collective call of all of this communicator's
    /// ranks, with the new ranks calling [`Comm::init`] on the same id): the new communicator
    /// has `nranks` ranks, this rank keeps its rank, the new ones take the rest. Exactly one
    /// existing rank passes the id (the one whose `ncclCommGetUniqueId` made it: it serves the
    /// new job's bootstrap root); the others pass none and learn it from that rank.
    pub fn grow(&self, nranks: usize, id: Option<UniqueId>, config: Option<&ncclConfig_t>) -> Res<Arc<Comm>> {
        let what = format!("ncclCommGrow (rank {} of {} growing to {nranks})", self.rank, self.nranks);
        self.live(&what)?;
        let _ = config; // blocking or not, the call completes before it returns
        if nranks <= self.nranks {
            return Err(Failure::arg(format!("{what}: a grown communicator needs more than {} ranks", self.nranks)));
        }
        // Every existing rank says the size it asks for and whether it holds the id (checked
        // here first: an id its communicator did not make fails every rank at once, rather
        // than leaving the others waiting for a root that never serves).
        let mut mine = (nranks as u64).to_le_bytes().to_vec();
        if let Some(id) = &id {
            let ours = self.grow_root.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|r| r.id() == id);
            if ours {
                mine.push(1);
                mine.extend_from_slice(&id.to_bytes());
            } else {
                mine.push(2);
                mine.extend_from_slice(b"the unique id was not made by ncclCommGetUniqueId on this communicator");
            }
        }
        let all = self.bootstrap().all_gather(&mine).map_err(|e| Failure::from(e).during(&what))?;
        let mut root: Option<(usize, UniqueId)> = None;
        for (r, w) in all.iter().enumerate() {
            let malformed = || Failure::new(ncclRemoteError, format!("{what}: rank {r} sent a malformed grow request"));
            let (size, rest) = w.split_at_checked(8).ok_or_else(malformed)?;
            let size = u64::from_le_bytes(size.try_into().map_err(|_| malformed())?);
            if size != nranks as u64 {
                return Err(Failure::arg(format!("{what}: rank {r} grows to {size} ranks, this rank to {nranks}")));
            }
            match rest.split_first() {
                None => {}
                Some((2, why)) => {
                    return Err(Failure::arg(format!("{what}: rank {r}: {}", String::from_utf8_lossy(why))));
                }
                Some((1, bytes)) => {
                    let rid = UniqueId::from_bytes(bytes).map_err(|e| Failure::from(e).during(&what))?;
                    if let Some((first, _)) = &root {
                        return Err(Failure::arg(format!(
                            "{what}: ranks {first} and {r} both passed a unique id (only the rank that called ncclCommGetUniqueId passes it)"
                        )));
                    }
                    root = Some((r, rid));
                }
                Some(_) => return Err(malformed()),
            }
        }
        let Some((root_rank, id)) = root else {
            return Err(Failure::arg(format!(
                "{what}: no existing rank passed the unique id (the rank that called ncclCommGetUniqueId passes it)"
            )));
        };
        // The rank that made the id serves its root, for the new size (the id is consumed).
        let server = if root_rank == self.rank {
            let reserved = self.grow_root.lock().unwrap_or_else(|p| p.into_inner()).take();
            let reserved =
                reserved.ok_or_else(|| Failure::usage(format!("{what}: the unique id was consumed meanwhile")))?;
            Some(reserved.serve(nranks, self.timeout).map_err(|e| Failure::from(e).during(&what))?)
        } else {
            None
        };
        let mut a = InitArgs::new(self.rank, nranks, id);
        a.device = Some(self.device);
        a.mem = Some(self.mem.clone());
        a.settings = self.settings.clone();
        let c = Comm::init(a);
        if let Some(s) = server {
            s.join();
        }
        c.map_err(|e| e.during(&what))
    }
}

/// `ncclCommShrink`: the ranks not in `exclude` form a new communicator, in old-rank order.
/// Point to point over the parent's bootstrap (new rank 0 hands out the id), so the excluded
/// ranks need not take part.
pub fn shrink(c: &Arc<Comm>, exclude: &[c_int], config: Option<&ncclConfig_t>, flags: c_int) -> Res<Option<Arc<Comm>>> {
    let what = format!("ncclCommShrink (rank {} of {})", c.rank, c.nranks);
    let members: Vec<usize> = (0..c.nranks).filter(|r| !exclude.contains(&(*r as c_int))).collect();
    let Some(new_rank) = members.iter().position(|&r| r == c.rank) else {
        return Err(Failure::usage(format!(
            "{what}: this rank is in the exclusion list; excluded ranks do not call ncclCommShrink"
        )));
    };
    let real = match &c.real {
        Ok(r) => {
            let mut newc: ncclComm_t = std::ptr::null_mut();
            let cfg = config.map_or(std::ptr::null_mut(), |x| x as *const ncclConfig_t as *mut ncclConfig_t);
            let ex = exclude.as_ptr() as *mut c_int;
            forward!(r.nccl, "ncclCommShrink", (r.comm => ncclComm_t, ex => *mut c_int, exclude.len() as c_int => c_int, &mut newc as *mut ncclComm_t => *mut ncclComm_t, cfg => *mut ncclConfig_t, flags => c_int))?;
            if newc.is_null() {
                Err("the NCCL fallback made no communicator".to_string())
            } else {
                Ok(Real { nccl: r.nccl, comm: newc })
            }
        }
        Err(e) => Err(e.clone()),
    };
    let seq = {
        let mut s = c.splits.lock().unwrap_or_else(|p| p.into_inner());
        *s += 1;
        *s
    };
    let tag = SPLIT_TAG | seq;
    let bs = c.bootstrap().clone();
    let leader = members[0];
    let id = if leader == c.rank {
        let id = TcpBootstrap::create_unique_id().map_err(|e| Failure::from(e).during(&what))?;
        for &m in &members[1..] {
            bs.send(m, tag, &id.to_bytes()).map_err(|e| Failure::from(e).during(&what))?;
        }
        id
    } else {
        let b = bs.recv(leader, tag).map_err(|e| Failure::from(e).during(&what))?;
        UniqueId::from_bytes(&b).map_err(|e| Failure::from(e).during(&what))?
    };
    let mut a = InitArgs::new(new_rank, members.len(), id);
    a.device = Some(c.device);
    a.mem = Some(c.mem.clone());
    a.native = c.p2p.is_ok();
    a.real = RealInit::Given(real);
    a.settings = c.settings.clone();
    Comm::init(a).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_route_agrees_with_the_router() {
        let forced_sets: [&[Op]; 3] = [&[], &[Op::AllReduce, Op::Broadcast], &Op::ALL];
        for forced in forced_sets {
            for up in [true, false] {
                let t = native_table(forced, up);
                for op in Op::ALL {
                    for dt in -1..14 {
                        for red in -1..7 {
                            for count in [0, 1, 2, 3, 1001] {
                                let native = route::native_support(op, dt, red, count).and(if up {
                                    Ok(())
                                } else {
                                    Err("down".into())
                                });
                                let r = route::route(op, forced, native, Err("no NCCL".into()));
                                let fast = fast_native(&t, op, dt, red, count);
                                if fast {
                                    assert_eq!(r, Route::Native, "{op} {dt} {red} {count} {forced:?}");
                                }
                                if r == Route::Native && !op.is_p2p() {
                                    assert!(fast, "the fast path misses {op} {dt} {red} {count} {forced:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn split_groups() {
        // colors 0,1,0,1,-1 ; keys reverse the order within color 0
        let ck = [(0, 5), (1, 0), (0, 1), (1, 0), (NCCL_SPLIT_NOCOLOR, 0)];
        assert_eq!(split_group(&ck, 0), Some(SplitGroup { members: vec![2, 0], new_rank: 1, leader: 2 }));
        assert_eq!(split_group(&ck, 2), Some(SplitGroup { members: vec![2, 0], new_rank: 0, leader: 2 }));
        // equal keys: old rank order
        assert_eq!(split_group(&ck, 3), Some(SplitGroup { members: vec![1, 3], new_rank: 1, leader: 1 }));
        assert_eq!(split_group(&ck, 4), None);
        assert_eq!(split_group(&ck, 9), None);
    }

    #[test]
    fn device_path_ops_pair_self_messages_and_need_one_stream() {
        let s = 7;
        // AllToAll of rank 1 of 3: sends and receives per peer, its own chunk a copy.
        let prims = p2p_prims(Op::AllToAll, 1, 3, 1000, 2000, 10, 0, s).unwrap();
        let (ops, st) = device_ops(1, &prims).unwrap();
        assert_eq!(st, Some(s));
        assert_eq!(
            ops,
            vec![
                P2pOp::Send { peer: 0, ptr: 1000, bytes: 10 },
                P2pOp::Recv { peer: 0, ptr: 2000, bytes: 10 },
                P2pOp::Copy { dst: 2010, src: 1010, bytes: 10 },
                P2pOp::Send { peer: 2, ptr: 1020, bytes: 10 },
                P2pOp::Recv { peer: 2, ptr: 2020, bytes: 10 },
            ]
        );
        // A receive from itself before its send (any order inside a group) pairs into a copy.
        let prims = [
            Prim::Recv { peer: 0, ptr: 50, len: 4, stream: s },
            Prim::Send { peer: 1, ptr: 60, len: 4, stream: s },
            Prim::Send { peer: 0, ptr: 70, len: 4, stream: s },
        ];
        let (ops, _) = device_ops(0, &prims).unwrap();
        assert_eq!(ops, vec![P2pOp::Send { peer: 1, ptr: 60, bytes: 4 }, P2pOp::Copy { dst: 50, src: 70, bytes: 4 }]);
        // Unpaired or unequal self messages, and two streams, cannot run on the device path.
        let e = device_ops(0, &prims[2..]).unwrap_err();
        assert!(e.contains("1 sends to this rank itself and 0 receives"), "{e}");
        let bad =
            [Prim::Send { peer: 0, ptr: 1, len: 4, stream: s }, Prim::Recv { peer: 0, ptr: 2, len: 8, stream: s }];
        assert!(device_ops(0, &bad).unwrap_err().contains("4 bytes"));
        let two =
            [Prim::Send { peer: 1, ptr: 1, len: 4, stream: 1 }, Prim::Recv { peer: 1, ptr: 2, len: 4, stream: 2 }];
        assert!(device_ops(0, &two).unwrap_err().contains("more than one stream"));
        assert_eq!(device_ops(0, &[]).unwrap(), (vec![], None));
    }

    #[test]
    fn device_p2p_setting_values() {
        assert!(device_p2p_setting(None).is_ok());
        assert!(device_p2p_setting(Some("device")).is_ok());
        for v in ["host", "HOST", "0", "off"] {
            assert!(device_p2p_setting(Some(v)).unwrap_err().contains("MSCCLPP_NCCL_P2P"), "{v}");
        }
    }

    #[test]
    fn p2p_decomposition() {
        let s = 7;
        let v = p2p_prims(Op::AllToAll, 1, 3, 1000, 2000, 10, 0, s).unwrap();
        assert_eq!(
            v,
            vec![
                Prim::Send { peer: 0, ptr: 1000, len: 10, stream: s },
                Prim::Recv { peer: 0, ptr: 2000, len: 10, stream: s },
                Prim::Copy { dst: 2010, src: 1010, len: 10, stream: s },
                Prim::Send { peer: 2, ptr: 1020, len: 10, stream: s },
                Prim::Recv { peer: 2, ptr: 2020, len: 10, stream: s },
            ]
        );
        let g = p2p_prims(Op::Gather, 0, 2, 1000, 2000, 4, 0, s).unwrap();
        assert_eq!(
            g,
            vec![
                Prim::Copy { dst: 2000, src: 1000, len: 4, stream: s },
                Prim::Recv { peer: 1, ptr: 2004, len: 4, stream: s }
            ]
        );
        assert_eq!(
            p2p_prims(Op::Scatter, 1, 2, 1000, 2000, 4, 0, s).unwrap(),
            vec![Prim::Recv { peer: 0, ptr: 2000, len: 4, stream: s }]
        );
        assert!(p2p_prims(Op::Gather, 0, 2, 0, 0, 4, 5, s).unwrap_err().message.contains("root 5"));
        assert!(p2p_prims(Op::AllToAll, 0, 2, 0, 0, 0, 0, s).unwrap().is_empty());
        assert_eq!(words(8, 0x1002), Some((mscclpp_collectives::DataType::F16, 4)));
        assert_eq!(words(8, 0x1000), Some((mscclpp_collectives::DataType::U32, 2)));
        assert_eq!(words(8, 0x1001), None);
    }
}
