//! The C API: every host function of NCCL 2.31's `nccl.h`, under its `nccl*` name and its
//! `pnccl*` profiling name. Each export catches panics (nothing unwinds into C), records a
//! failure for `ncclGetLastError` and returns its code. The safety contract of every function
//! is NCCL's documented one (valid pointers of the documented sizes, live streams and
//! communicators).
#![allow(clippy::missing_safety_doc, non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::Arc;

use mscclpp::{TcpBootstrap, UniqueId};

use crate::abi::*;
use crate::comm::{Call, Comm, Handle, InitArgs};
use crate::error::{Failure, Res, guard};
use crate::fallback::nccl;
use crate::forward;
use crate::group::{self, Queued};
use crate::route::Op;

/// Defines `$name` and `$pname` (the profiling alias) with one body.
macro_rules! export {
    ($(#[$m:meta])* fn $name:ident / $pname:ident ($($a:ident : $t:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$m])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> $ret $body

        #[doc = concat!("The profiling name of [`", stringify!($name), "`].")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $pname($($a: $t),*) -> $ret {
            // SAFETY: the same contract as the function it names.
            unsafe { $name($($a),*) }
        }
    };
}

fn comm_of(p: ncclComm_t, what: &str) -> Res<Arc<Comm>> {
    // SAFETY: NCCL's contract: p is NULL or a communicator this library returned.
    unsafe { Handle::from_ptr(p, what) }?.get(what)
}

fn out<T>(p: *mut T, what: &str, name: &str) -> Res<*mut T> {
    if p.is_null() {
        return Err(Failure::arg(format!("{what}: {name} is NULL")));
    }
    Ok(p)
}

fn put<T>(p: *mut T, v: T, what: &str, name: &str) -> Res {
    let p = out(p, what, name)?;
    // SAFETY: NCCL's contract: a non-NULL out pointer is writable.
    unsafe { p.write(v) };
    Ok(())
}

/// Checks `config` (NULL is the default): the magic of `NCCL_CONFIG_INITIALIZER`, a size at
/// least up to `blocking`. Returns a copy of the fields the caller's size covers.
fn read_config(config: *const ncclConfig_t, what: &str) -> Res<Option<ncclConfig_t>> {
    if config.is_null() {
        return Ok(None);
    }
    // SAFETY: a non-NULL config points to at least its first three fields (every version has
    // them); the rest is read only within the size it declares.
    let head = unsafe { std::ptr::read_unaligned(config as *const [u8; 16]) };
    let size = usize::from_ne_bytes(head[..8].try_into().unwrap_or([0; 8]));
    let magic = c_uint::from_ne_bytes(head[8..12].try_into().unwrap_or([0; 4]));
    if magic != NCCL_API_MAGIC {
        return Err(Failure::arg(format!(
            "{what}: the config's magic is {magic:#x}, not {NCCL_API_MAGIC:#x}: initialize it with NCCL_CONFIG_INITIALIZER"
        )));
    }
    if size < 20 {
        return Err(Failure::arg(format!("{what}: the config's size {size} is too small")));
    }
    let mut c = ncclConfig_t::initializer();
    let n = size.min(std::mem::size_of::<ncclConfig_t>());
    // SAFETY: the caller's struct has `size` bytes; we copy at most ours.
    unsafe { std::ptr::copy_nonoverlapping(config as *const u8, &mut c as *mut ncclConfig_t as *mut u8, n) };
    Ok(Some(c))
}

/// Our id in NCCL's 128 bytes.
fn nccl_id(id: &UniqueId) -> ncclUniqueId {
    let mut u = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    for (d, s) in u.internal.iter_mut().zip(id.to_bytes()) {
        *d = s as c_char;
    }
    u
}

fn id_of(id: &ncclUniqueId, what: &str) -> Res<UniqueId> {
    let b: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    UniqueId::from_bytes(&b).map_err(|e| {
        Failure::arg(format!("{what}: the ncclUniqueId is not one of this library's (made by ncclGetUniqueId of libmscclpp_nccl.so?): {e}"))
    })
}

fn init(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    config: *const ncclConfig_t,
    what: &str,
) -> Res {
    out(newcomm, what, "comm")?;
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(Failure::arg(format!("{what}: rank {rank} of {nranks} is not valid")));
    }
    let cfg = read_config(config, what)?;
    if let Some(c) = cfg
        && c.blocking == 0
    {
        tracing::debug!(target: "mscclpp::nccl", "{what}: non-blocking config: calls complete before returning (ncclSuccess)");
    }
    let args = InitArgs::new(rank as usize, nranks as usize, id_of(id, what)?);
    if group::active() {
        let h = Handle::leak(None);
        // SAFETY: just made by Handle::leak, never freed.
        let hr: &'static Handle = unsafe { &*(h as *const Handle) };
        group::submit(Queued::Init { handle: hr, args })?;
        return put(newcomm, h, what, "comm");
    }
    let c = Comm::init(args).map_err(|e| e.during(what))?;
    put(newcomm, Handle::leak(Some(c)), what, "comm")
}

#[allow(clippy::too_many_arguments)]
fn call(
    op: Op,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: ncclDataType_t,
    red: ncclRedOp_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Res {
    // The common case (a collective the native path serves, outside a group) costs no lock
    // besides the handle's, no allocation and no formatting: messages are made only on failure.
    let name = op.c_name();
    let comm = comm_of(comm, name)?;
    if crate::route::type_size(dt).is_none() {
        return Err(Failure::arg(format!(
            "{name} (rank {}): {} is not an ncclDataType_t",
            comm.rank,
            crate::route::type_name(dt)
        )));
    }
    let c = Call { op, send: send as u64, recv: recv as u64, count, dt, red, peer, stream: stream as u64 };
    if matches!(op, Op::Broadcast | Op::Reduce | Op::Gather | Op::Scatter | Op::Send | Op::Recv)
        && (peer < 0 || peer as usize >= comm.nranks)
    {
        let what = if matches!(op, Op::Send | Op::Recv) { "peer" } else { "root" };
        return Err(Failure::arg(format!("{}: {what} {peer} is not a rank of 0..{}", c.describe(&comm), comm.nranks)));
    }
    if !group::active() && comm.native_fast(op, dt, red, count) {
        // What group::run does for a group of this one call, without building the group.
        comm.live_with(|| c.describe(&comm))?;
        crate::comm::log_native(op, dt, comm.rank);
        return comm.run_native(&c);
    }
    group::submit(Queued::Call { comm, call: c })
}

fn coll_config(config: *const ncclCollConfig_t, what: &str) -> Res {
    if config.is_null() {
        return Ok(());
    }
    // SAFETY: a non-NULL config has at least its size/magic/version head.
    let magic = unsafe { std::ptr::addr_of!((*config).magic).read_unaligned() };
    if magic != NCCL_API_MAGIC {
        return Err(Failure::arg(format!(
            "{what}: the ncclCollConfig_t's magic is {magic:#x}: initialize it with NCCL_COLLCONFIG_INITIALIZER"
        )));
    }
    Ok(())
}

fn fallback_only(what: &str) -> Res<&'static crate::fallback::Nccl> {
    nccl().map_err(|e| Failure::usage(format!("{what}: this library has no native {what} and no NCCL fallback ({e})")))
}

export! {
    /// Allocates `size` bytes of GPU memory on the current GPU (`cuMemAlloc`, shareable over CUDA IPC).
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
        guard("ncclMemAlloc", || {
            out(ptr, "ncclMemAlloc", "ptr")?;
            let dev = crate::mem::current_device().unwrap_or(0);
            crate::mem::bind(dev).map_err(|e| e.during("ncclMemAlloc"))?;
            // SAFETY: a context is current; size bytes are asked for.
            let p = unsafe { cudarc::driver::result::malloc_sync(size.max(1)) }
                .map_err(|e| Failure::new(ncclUnhandledCudaError, format!("ncclMemAlloc of {size} bytes on GPU{dev}: {e}")))?;
            put(ptr, p as *mut c_void, "ncclMemAlloc", "ptr")
        })
    }
}

export! {
    /// Frees memory from [`ncclMemAlloc`].
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) -> ncclResult_t {
        guard("ncclMemFree", || {
            if ptr.is_null() {
                return Ok(());
            }
            crate::mem::bind(crate::mem::current_device().unwrap_or(0)).map_err(|e| e.during("ncclMemFree"))?;
            // SAFETY: NCCL's contract: ptr came from ncclMemAlloc.
            unsafe { cudarc::driver::result::free_sync(ptr as u64) }
                .map_err(|e| Failure::new(ncclUnhandledCudaError, format!("ncclMemFree({ptr:?}): {e}")))
        })
    }
}

export! {
    /// The version of the `nccl.h` implemented ([`NCCL_VERSION_CODE`], 23102).
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) -> ncclResult_t {
        guard("ncclGetVersion", || put(version, NCCL_VERSION_CODE, "ncclGetVersion", "version"))
    }
}

export! {
    /// A new unique id: an mscclpp bootstrap id whose root is this process (it listens from now on).
    fn ncclGetUniqueId / pncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
        guard("ncclGetUniqueId", || {
            let id = TcpBootstrap::create_unique_id().map_err(|e| Failure::from(e).during("ncclGetUniqueId"))?;
            put(uniqueId, nccl_id(&id), "ncclGetUniqueId", "uniqueId")
        })
    }
}

export! {
    /// Builds rank `rank` of `nranks` with a config (NULL: defaults).
    fn ncclCommInitRankConfig / pncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, commId: ncclUniqueId, rank: c_int, config: *mut ncclConfig_t) -> ncclResult_t {
        guard("ncclCommInitRankConfig", || init(comm, nranks, &commId, rank, config, &format!("ncclCommInitRankConfig (rank {rank} of {nranks})")))
    }
}

export! {
    /// Builds rank `rank` of `nranks`.
    fn ncclCommInitRank / pncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, commId: ncclUniqueId, rank: c_int) -> ncclResult_t {
        guard("ncclCommInitRank", || init(comm, nranks, &commId, rank, std::ptr::null(), &format!("ncclCommInitRank (rank {rank} of {nranks})")))
    }
}

export! {
    /// Builds `ndev` ranks in this process, one per GPU of `devlist` (NULL: 0..ndev), in parallel.
    fn ncclCommInitAll / pncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
        guard("ncclCommInitAll", || {
            let what = "ncclCommInitAll";
            out(comm, what, "comm")?;
            if ndev < 1 {
                return Err(Failure::arg(format!("{what}: ndev {ndev} < 1")));
            }
            let id = TcpBootstrap::create_unique_id().map_err(|e| Failure::from(e).during(what))?;
            let devs: Vec<u32> = (0..ndev as usize)
                .map(|i| if devlist.is_null() { i as u32 } else {
                    // SAFETY: NCCL's contract: devlist holds ndev entries.
                    unsafe { *devlist.add(i) }.max(0) as u32
                })
                .collect();
            group::start();
            let mut hs = Vec::new();
            for (r, d) in devs.iter().enumerate() {
                let h = Handle::leak(None);
                // SAFETY: just made, never freed.
                let hr: &'static Handle = unsafe { &*(h as *const Handle) };
                let mut a = InitArgs::new(r, devs.len(), id.clone());
                a.device = Some(*d);
                group::submit(Queued::Init { handle: hr, args: a })?;
                hs.push(h);
            }
            group::end()?;
            for (i, h) in hs.into_iter().enumerate() {
                // SAFETY: NCCL's contract: comm holds ndev entries.
                unsafe { *comm.add(i) = h };
            }
            Ok(())
        })
    }
}

export! {
    /// Flushes the communicator (our calls are stream-ordered: nothing is pending on the host) and
    /// finalizes the real NCCL's side.
    fn ncclCommFinalize / pncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
        guard("ncclCommFinalize", || {
            let c = comm_of(comm, "ncclCommFinalize")?;
            if let Ok(r) = &c.real {
                forward!(r.nccl, "ncclCommFinalize", (r.comm => ncclComm_t))?;
            }
            Ok(())
        })
    }
}

export! {
    /// Frees the communicator (the handle stays readable and answers "destroyed").
    fn ncclCommDestroy / pncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
        guard("ncclCommDestroy", || {
            // SAFETY: NCCL's contract on comm.
            let h = unsafe { Handle::from_ptr(comm, "ncclCommDestroy") }?;
            if let Some(c) = h.take()
                && let Ok(r) = &c.real
            {
                forward!(r.nccl, "ncclCommDestroy", (r.comm => ncclComm_t))?;
            }
            Ok(())
        })
    }
}

export! {
    /// Aborts: every wait of the communicator (native kernels, the real NCCL's) ends with an
    /// error, then it is freed.
    fn ncclCommAbort / pncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
        guard("ncclCommAbort", || {
            // SAFETY: NCCL's contract on comm.
            let h = unsafe { Handle::from_ptr(comm, "ncclCommAbort") }?;
            match h.take() {
                Some(c) => c.abort(),
                None => Ok(()),
            }
        })
    }
}

export! {
    /// Revokes: in-flight native work ends with an error; later calls fail until destroyed.
    fn ncclCommRevoke / pncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
        guard("ncclCommRevoke", || comm_of(comm, "ncclCommRevoke")?.revoke(revokeFlags))
    }
}

export! {
    /// Splits by color and key (native, over the parent's bootstrap; the real NCCL splits too).
    fn ncclCommSplit / pncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) -> ncclResult_t {
        guard("ncclCommSplit", || {
            out(newcomm, "ncclCommSplit", "newcomm")?;
            let cfg = read_config(config, "ncclCommSplit")?;
            let c = comm_of(comm, "ncclCommSplit")?;
            let n = c.split(color, key, cfg.as_ref())?;
            put(newcomm, n.map_or(std::ptr::null_mut(), |n| Handle::leak(Some(n))), "ncclCommSplit", "newcomm")
        })
    }
}

export! {
    /// Shrinks: the ranks not excluded form a new communicator (native, point to point over the
    /// parent's bootstrap: excluded ranks take no part).
    fn ncclCommShrink / pncclCommShrink(comm: ncclComm_t, excludeRanksList: *mut c_int, excludeRanksCount: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t, shrinkFlags: c_int) -> ncclResult_t {
        guard("ncclCommShrink", || {
            let what = "ncclCommShrink";
            out(newcomm, what, "newcomm")?;
            let cfg = read_config(config, what)?;
            let c = comm_of(comm, what)?;
            let ex: Vec<c_int> = if excludeRanksList.is_null() || excludeRanksCount <= 0 { Vec::new() } else {
                // SAFETY: NCCL's contract: the list holds excludeRanksCount entries.
                unsafe { std::slice::from_raw_parts(excludeRanksList, excludeRanksCount as usize) }.to_vec()
            };
            if shrinkFlags & 1 != 0
                && let Ok(n) = &c.native
            {
                n.abort().map_err(Failure::from)?;
            }
            let n = crate::comm::shrink(&c, &ex, cfg.as_ref(), shrinkFlags)?;
            put(newcomm, n.map_or(std::ptr::null_mut(), |n| Handle::leak(Some(n))), what, "newcomm")
        })
    }
}

export! {
    /// The unique id for `ncclCommGrow`: an mscclpp bootstrap id whose root this rank binds now
    /// and serves when it calls `ncclCommGrow` with it (one unconsumed id at a time).
    fn ncclCommGetUniqueId / pncclCommGetUniqueId(comm: ncclComm_t, uniqueId: *mut ncclUniqueId) -> ncclResult_t {
        guard("ncclCommGetUniqueId", || {
            let what = "ncclCommGetUniqueId";
            out(uniqueId, what, "uniqueId")?;
            let c = comm_of(comm, what)?;
            let id = c.grow_unique_id()?;
            put(uniqueId, nccl_id(&id), what, "uniqueId")
        })
    }
}

export! {
    /// Grows a communicator (native): existing ranks pass `comm` and `rank` -1 (the one whose
    /// `ncclCommGetUniqueId` made the id passes it, the others NULL); new ranks pass a NULL
    /// `comm`, the id and their rank. Existing ranks keep their ranks.
    fn ncclCommGrow / pncclCommGrow(comm: ncclComm_t, nRanks: c_int, uniqueId: *const ncclUniqueId, rank: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) -> ncclResult_t {
        guard("ncclCommGrow", || {
            let what = format!("ncclCommGrow (rank {rank} of {nRanks})");
            out(newcomm, &what, "newcomm")?;
            if nRanks < 1 {
                return Err(Failure::arg(format!("{what}: nRanks {nRanks} < 1")));
            }
            if comm.is_null() {
                // A new rank: joins like ncclCommInitRankConfig on the grow id.
                if uniqueId.is_null() {
                    return Err(Failure::arg(format!("{what}: a new rank (comm NULL) needs the unique id")));
                }
                // SAFETY: checked non-NULL; NCCL's contract: it points to an ncclUniqueId.
                let id = unsafe { *uniqueId };
                return init(newcomm, nRanks, &id, rank, config, &what);
            }
            let c = comm_of(comm, "ncclCommGrow")?;
            if rank != -1 {
                return Err(Failure::arg(format!(
                    "ncclCommGrow (rank {} of {}): an existing rank passes rank -1 (it keeps its rank), not {rank}",
                    c.rank, c.nranks
                )));
            }
            let cfg = read_config(config, "ncclCommGrow")?;
            let id = if uniqueId.is_null() {
                None
            } else {
                // SAFETY: checked non-NULL; NCCL's contract: it points to an ncclUniqueId.
                Some(id_of(unsafe { &*uniqueId }, "ncclCommGrow")?)
            };
            let n = c.grow(nRanks as usize, id, cfg.as_ref())?;
            put(newcomm, Handle::leak(Some(n)), "ncclCommGrow", "newcomm")
        })
    }
}

export! {
    /// Builds a rank from several ids (the first one is used: our bootstrap has one root).
    fn ncclCommInitRankScalable / pncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int, nId: c_int, commIds: *mut ncclUniqueId, config: *mut ncclConfig_t) -> ncclResult_t {
        guard("ncclCommInitRankScalable", || {
            let what = format!("ncclCommInitRankScalable (rank {myrank} of {nranks})");
            if nId < 1 || commIds.is_null() {
                return Err(Failure::arg(format!("{what}: nId {nId} ids at {commIds:?}")));
            }
            // SAFETY: NCCL's contract: commIds holds nId ids.
            let id = unsafe { *commIds };
            init(newcomm, nranks, &id, myrank, config, &what)
        })
    }
}

export! {
    /// NCCL's text for a result code.
    fn ncclGetErrorString / pncclGetErrorString(result: ncclResult_t) -> *const c_char {
        error_string(result).as_ptr()
    }
}

export! {
    /// The last failure's message (of any communicator: the process's last, as NCCL does).
    fn ncclGetLastError / pncclGetLastError(comm: ncclComm_t) -> *const c_char {
        let _ = comm;
        crate::error::last_error_ptr()
    }
}

export! {
    /// The error a native kernel (or the real NCCL) reported asynchronously, else `ncclSuccess`.
    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: ncclComm_t, asyncError: *mut ncclResult_t) -> ncclResult_t {
        guard("ncclCommGetAsyncError", || {
            // SAFETY: NCCL's contract on comm.
            let h = unsafe { Handle::from_ptr(comm, "ncclCommGetAsyncError") }?;
            let v = match h.get("ncclCommGetAsyncError") {
                Ok(c) => c.async_error(),
                Err(e) if e.message.contains("still being built") => ncclInProgress,
                Err(e) => return Err(e),
            };
            put(asyncError, v, "ncclCommGetAsyncError", "asyncError")
        })
    }
}

export! {
    /// The number of ranks.
    fn ncclCommCount / pncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
        guard("ncclCommCount", || { let c = comm_of(comm, "ncclCommCount")?; put(count, c.nranks as c_int, "ncclCommCount", "count") })
    }
}

export! {
    /// The GPU.
    fn ncclCommCuDevice / pncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
        guard("ncclCommCuDevice", || { let c = comm_of(comm, "ncclCommCuDevice")?; put(device, c.device as c_int, "ncclCommCuDevice", "device") })
    }
}

export! {
    /// This rank.
    fn ncclCommUserRank / pncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
        guard("ncclCommUserRank", || { let c = comm_of(comm, "ncclCommUserRank")?; put(rank, c.rank as c_int, "ncclCommUserRank", "rank") })
    }
}

/// A registration handle: the buffer and, with the fallback, the real NCCL's handle.
#[allow(dead_code)] // ptr: kept for debugging output
struct Reg {
    ptr: *mut c_void,
    real: *mut c_void,
}

export! {
    /// Registers a buffer: accepted as a hint (the native collectives stage through their own
    /// mapped scratch and need no registration); the real NCCL registers it too.
    fn ncclCommRegister / pncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> ncclResult_t {
        guard("ncclCommRegister", || {
            let c = comm_of(comm, "ncclCommRegister")?;
            out(handle, "ncclCommRegister", "handle")?;
            let mut real: *mut c_void = std::ptr::null_mut();
            if let Ok(r) = &c.real {
                forward!(r.nccl, "ncclCommRegister", (r.comm => ncclComm_t, buff => *mut c_void, size => usize, &mut real as *mut *mut c_void => *mut *mut c_void))?;
            }
            tracing::debug!(target: "mscclpp::nccl", rank = c.rank, ?buff, size, "ncclCommRegister: a hint for the native path");
            put(handle, Box::into_raw(Box::new(Reg { ptr: buff, real })) as *mut c_void, "ncclCommRegister", "handle")
        })
    }
}

export! {
    /// Releases a registration.
    fn ncclCommDeregister / pncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
        guard("ncclCommDeregister", || {
            let c = comm_of(comm, "ncclCommDeregister")?;
            out(handle, "ncclCommDeregister", "handle")?;
            // SAFETY: NCCL's contract: handle came from ncclCommRegister and is released once.
            let reg = unsafe { Box::from_raw(handle as *mut Reg) };
            if !reg.real.is_null() && let Ok(r) = &c.real {
                forward!(r.nccl, "ncclCommDeregister", (r.comm => ncclComm_t, reg.real => *mut c_void))?;
            }
            Ok(())
        })
    }
}

export! {
    /// Suspends: forwarded to the real NCCL; natively there is nothing to release on demand.
    fn ncclCommSuspend / pncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
        guard("ncclCommSuspend", || { let c = comm_of(comm, "ncclCommSuspend")?; let r = c.real("ncclCommSuspend")?; forward!(r.nccl, "ncclCommSuspend", (r.comm => ncclComm_t, flags => c_int)) })
    }
}

export! {
    /// Resumes: forwarded to the real NCCL.
    fn ncclCommResume / pncclCommResume(comm: ncclComm_t) -> ncclResult_t {
        guard("ncclCommResume", || { let c = comm_of(comm, "ncclCommResume")?; let r = c.real("ncclCommResume")?; forward!(r.nccl, "ncclCommResume", (r.comm => ncclComm_t)) })
    }
}

export! {
    /// Memory statistics of the native side: its scratch is persistent GPU memory, nothing is
    /// suspendable.
    fn ncclCommMemStats / pncclCommMemStats(comm: ncclComm_t, stat: ncclCommMemStat_t, value: *mut u64) -> ncclResult_t {
        guard("ncclCommMemStats", || {
            let c = comm_of(comm, "ncclCommMemStats")?;
            let scratch = c.native.as_ref().map_or(0, |n| n.scratch_bytes());
            let v = match stat {
                0 | 1 => 0,
                2 | 3 => scratch,
                s => return Err(Failure::arg(format!("ncclCommMemStats (rank {}): stat {s} is not an ncclCommMemStat_t", c.rank))),
            };
            put(value, v, "ncclCommMemStats", "value")
        })
    }
}

/// A window: the user pointer and, with the fallback, the real NCCL's window.
struct Win {
    ptr: *mut c_void,
    real: ncclWindow_t,
}

export! {
    /// Registers a window (a collective call). The native collectives do not use windows; the
    /// handle answers `ncclWinGetUserPtr`, and with the fallback the real NCCL registers it too
    /// (for `ncclPutSignal`).
    fn ncclCommWindowRegister / pncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, win: *mut ncclWindow_t, winFlags: c_int) -> ncclResult_t {
        guard("ncclCommWindowRegister", || {
            let c = comm_of(comm, "ncclCommWindowRegister")?;
            out(win, "ncclCommWindowRegister", "win")?;
            let mut real: ncclWindow_t = std::ptr::null_mut();
            if let Ok(r) = &c.real {
                forward!(r.nccl, "ncclCommWindowRegister", (r.comm => ncclComm_t, buff => *mut c_void, size => usize, &mut real as *mut ncclWindow_t => *mut ncclWindow_t, winFlags => c_int))?;
            }
            put(win, Box::into_raw(Box::new(Win { ptr: buff, real })) as ncclWindow_t, "ncclCommWindowRegister", "win")
        })
    }
}

export! {
    /// Deregisters a window.
    fn ncclCommWindowDeregister / pncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
        guard("ncclCommWindowDeregister", || {
            let c = comm_of(comm, "ncclCommWindowDeregister")?;
            out(win, "ncclCommWindowDeregister", "win")?;
            // SAFETY: NCCL's contract: win came from ncclCommWindowRegister, released once.
            let w = unsafe { Box::from_raw(win as *mut Win) };
            if !w.real.is_null() && let Ok(r) = &c.real {
                forward!(r.nccl, "ncclCommWindowDeregister", (r.comm => ncclComm_t, w.real => ncclWindow_t))?;
            }
            Ok(())
        })
    }
}

fn win_of<'a>(win: ncclWindow_t, what: &str) -> Res<&'a Win> {
    out(win, what, "window")?;
    // SAFETY: NCCL's contract: a window this library returned, not yet deregistered.
    Ok(unsafe { &*(win as *const Win) })
}

export! {
    /// The user pointer a window was registered with.
    fn ncclWinGetUserPtr / pncclWinGetUserPtr(comm: ncclComm_t, win: ncclWindow_t, outUserPtr: *mut *mut c_void) -> ncclResult_t {
        guard("ncclWinGetUserPtr", || { comm_of(comm, "ncclWinGetUserPtr")?; let w = win_of(win, "ncclWinGetUserPtr")?; put(outUserPtr, w.ptr, "ncclWinGetUserPtr", "outUserPtr") })
    }
}

export! {
    /// PreMulSum: made by the real NCCL (the native kernels have no pre-multiplication), so
    /// calls using it go there.
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(op: *mut ncclRedOp_t, scalar: *mut c_void, datatype: ncclDataType_t, residence: ncclScalarResidence_t, comm: ncclComm_t) -> ncclResult_t {
        guard("ncclRedOpCreatePreMulSum", || {
            let c = comm_of(comm, "ncclRedOpCreatePreMulSum")?;
            let r = c.real("ncclRedOpCreatePreMulSum")?;
            forward!(r.nccl, "ncclRedOpCreatePreMulSum", (op => *mut ncclRedOp_t, scalar => *mut c_void, datatype => c_int, residence => c_int, r.comm => ncclComm_t))
        })
    }
}

export! {
    /// Destroys a PreMulSum operation.
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
        guard("ncclRedOpDestroy", || {
            let c = comm_of(comm, "ncclRedOpDestroy")?;
            if op < ncclNumOps {
                return Err(Failure::arg(format!("ncclRedOpDestroy (rank {}): {op} is a built-in operation", c.rank)));
            }
            let r = c.real("ncclRedOpDestroy")?;
            forward!(r.nccl, "ncclRedOpDestroy", (op => c_int, r.comm => ncclComm_t))
        })
    }
}

export! {
    /// Reduce to `root` (native: an AllReduce into the root's buffer, the others' into scratch).
    fn ncclReduce / pncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclReduce", || call(Op::Reduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream))
    }
}

export! {
    /// In-place broadcast.
    fn ncclBcast / pncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclBcast", || call(Op::Broadcast, buff, buff, count, datatype, 0, root, comm, stream))
    }
}

export! {
    /// Broadcast.
    fn ncclBroadcast / pncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclBroadcast", || call(Op::Broadcast, sendbuff, recvbuff, count, datatype, 0, root, comm, stream))
    }
}

export! {
    /// AllReduce.
    fn ncclAllReduce / pncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclAllReduce", || call(Op::AllReduce, sendbuff, recvbuff, count, datatype, op, 0, comm, stream))
    }
}

export! {
    /// ReduceScatter.
    fn ncclReduceScatter / pncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclReduceScatter", || call(Op::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream))
    }
}

export! {
    /// AllGather.
    fn ncclAllGather / pncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclAllGather", || call(Op::AllGather, sendbuff, recvbuff, sendcount, datatype, 0, 0, comm, stream))
    }
}

export! {
    /// AllToAll (native: host-staged point to point).
    fn ncclAlltoAll / pncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclAlltoAll", || call(Op::AllToAll, sendbuff, recvbuff, count, datatype, 0, 0, comm, stream))
    }
}

export! {
    /// Gather to `root` (native: host-staged).
    fn ncclGather / pncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclGather", || call(Op::Gather, sendbuff, recvbuff, count, datatype, 0, root, comm, stream))
    }
}

export! {
    /// Scatter from `root` (native: host-staged).
    fn ncclScatter / pncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclScatter", || call(Op::Scatter, sendbuff, recvbuff, count, datatype, 0, root, comm, stream))
    }
}

export! {
    /// [`ncclAllReduce`] with a per-call config (tuning hints; the native path ignores them).
    fn ncclAllReduceConfig / pncclAllReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclAllReduceConfig", || { coll_config(config, "ncclAllReduceConfig")?; call(Op::AllReduce, sendbuff, recvbuff, count, datatype, op, 0, comm, stream) })
    }
}

export! {
    /// [`ncclBroadcast`] with a per-call config.
    fn ncclBroadcastConfig / pncclBroadcastConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclBroadcastConfig", || { coll_config(config, "ncclBroadcastConfig")?; call(Op::Broadcast, sendbuff, recvbuff, count, datatype, 0, root, comm, stream) })
    }
}

export! {
    /// [`ncclReduce`] with a per-call config.
    fn ncclReduceConfig / pncclReduceConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclReduceConfig", || { coll_config(config, "ncclReduceConfig")?; call(Op::Reduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream) })
    }
}

export! {
    /// [`ncclAllGather`] with a per-call config.
    fn ncclAllGatherConfig / pncclAllGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclAllGatherConfig", || { coll_config(config, "ncclAllGatherConfig")?; call(Op::AllGather, sendbuff, recvbuff, sendcount, datatype, 0, 0, comm, stream) })
    }
}

export! {
    /// [`ncclReduceScatter`] with a per-call config.
    fn ncclReduceScatterConfig / pncclReduceScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclReduceScatterConfig", || { coll_config(config, "ncclReduceScatterConfig")?; call(Op::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream) })
    }
}

export! {
    /// [`ncclAlltoAll`] with a per-call config.
    fn ncclAlltoAllConfig / pncclAlltoAllConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclAlltoAllConfig", || { coll_config(config, "ncclAlltoAllConfig")?; call(Op::AllToAll, sendbuff, recvbuff, count, datatype, 0, 0, comm, stream) })
    }
}

export! {
    /// [`ncclGather`] with a per-call config.
    fn ncclGatherConfig / pncclGatherConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclGatherConfig", || { coll_config(config, "ncclGatherConfig")?; call(Op::Gather, sendbuff, recvbuff, count, datatype, 0, root, comm, stream) })
    }
}

export! {
    /// [`ncclScatter`] with a per-call config.
    fn ncclScatterConfig / pncclScatterConfig(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t, config: *const ncclCollConfig_t) -> ncclResult_t {
        guard("ncclScatterConfig", || { coll_config(config, "ncclScatterConfig")?; call(Op::Scatter, sendbuff, recvbuff, count, datatype, 0, root, comm, stream) })
    }
}

export! {
    /// Send to `peer` (native: host-staged; pair it with the peer's ncclRecv, in a group or not).
    fn ncclSend / pncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclSend", || call(Op::Send, sendbuff, std::ptr::null_mut(), count, datatype, 0, peer, comm, stream))
    }
}

export! {
    /// Receive from `peer`.
    fn ncclRecv / pncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclRecv", || call(Op::Recv, std::ptr::null(), recvbuff, count, datatype, 0, peer, comm, stream))
    }
}

export! {
    /// One-sided put with a signal: forwarded to the real NCCL (with its window).
    fn ncclPutSignal / pncclPutSignal(localbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int, peerWin: ncclWindow_t, peerWinOffset: usize, sigIdx: c_int, ctx: c_int, flags: c_uint, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclPutSignal", || {
            let c = comm_of(comm, "ncclPutSignal")?;
            let r = c.real("ncclPutSignal")?;
            let w = win_of(peerWin, "ncclPutSignal")?;
            forward!(r.nccl, "ncclPutSignal", (localbuff => *const c_void, count => usize, datatype => c_int, peer => c_int, w.real => ncclWindow_t, peerWinOffset => usize, sigIdx => c_int, ctx => c_int, flags => c_uint, r.comm => ncclComm_t, stream => cudaStream_t))
        })
    }
}

export! {
    /// A signal without data: forwarded to the real NCCL.
    fn ncclSignal / pncclSignal(peer: c_int, sigIdx: c_int, ctx: c_int, flags: c_uint, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclSignal", || {
            let c = comm_of(comm, "ncclSignal")?;
            let r = c.real("ncclSignal")?;
            forward!(r.nccl, "ncclSignal", (peer => c_int, sigIdx => c_int, ctx => c_int, flags => c_uint, r.comm => ncclComm_t, stream => cudaStream_t))
        })
    }
}

export! {
    /// Waits for signals: forwarded to the real NCCL.
    fn ncclWaitSignal / pncclWaitSignal(nDesc: c_int, signalDescs: *mut ncclWaitSignalDesc_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        guard("ncclWaitSignal", || {
            let c = comm_of(comm, "ncclWaitSignal")?;
            let r = c.real("ncclWaitSignal")?;
            forward!(r.nccl, "ncclWaitSignal", (nDesc => c_int, signalDescs => *mut ncclWaitSignalDesc_t, r.comm => ncclComm_t, stream => cudaStream_t))
        })
    }
}

export! {
    /// Opens a group on this thread: calls are queued until the matching [`ncclGroupEnd`].
    fn ncclGroupStart / pncclGroupStart() -> ncclResult_t {
        guard("ncclGroupStart", || { group::start(); Ok(()) })
    }
}

export! {
    /// Closes a group; the outermost end runs the queued calls.
    fn ncclGroupEnd / pncclGroupEnd() -> ncclResult_t {
        guard("ncclGroupEnd", group::end)
    }
}

export! {
    /// Ends a group without running it (as NCCL's simulation does) and fails: there is no
    /// timing model to fill `simInfo` with.
    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
        guard("ncclGroupSimulateEnd", || {
            let _ = simInfo;
            let n = group::queued();
            group::discard()?;
            Err(Failure::usage(format!("ncclGroupSimulateEnd: libmscclpp_nccl has no performance model; the group's {n} queued calls were dropped without running")))
        })
    }
}

macro_rules! param_get {
    ($(#[$m:meta])* $name:ident / $pname:ident, $t:ty) => {
        export! {
            $(#[$m])*
            fn $name / $pname(h: ncclParamHandle_t, out: *mut $t) -> ncclResult_t {
                guard(stringify!($name), || { let n = fallback_only(stringify!($name))?; forward!(n, stringify!($name), (h => ncclParamHandle_t, out => *mut $t)) })
            }
        }
    };
}

export! {
    /// Binds an NCCL parameter: forwarded to the real NCCL (its parameters are its own).
    fn ncclParamBind / pncclParamBind(out: *mut ncclParamHandle_t, key: *const c_char) -> ncclResult_t {
        guard("ncclParamBind", || { let n = fallback_only("ncclParamBind")?; forward!(n, "ncclParamBind", (out => *mut ncclParamHandle_t, key => *const c_char)) })
    }
}

param_get!(/// Reads a parameter (forwarded).
    ncclParamGetI8 / pncclParamGetI8, i8);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetI16 / pncclParamGetI16, i16);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetI32 / pncclParamGetI32, i32);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetI64 / pncclParamGetI64, i64);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetU8 / pncclParamGetU8, u8);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetU16 / pncclParamGetU16, u16);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetU32 / pncclParamGetU32, u32);
param_get!(/// Reads a parameter (forwarded).
    ncclParamGetU64 / pncclParamGetU64, u64);
param_get!(/// Reads a parameter as a string (forwarded).
    ncclParamGetStr / pncclParamGetStr, *const c_char);

export! {
    /// Reads a parameter's raw bytes (forwarded).
    fn ncclParamGet / pncclParamGet(h: ncclParamHandle_t, out: *mut c_void, maxLen: c_int, len: *mut c_int) -> ncclResult_t {
        guard("ncclParamGet", || { let n = fallback_only("ncclParamGet")?; forward!(n, "ncclParamGet", (h => ncclParamHandle_t, out => *mut c_void, maxLen => c_int, len => *mut c_int)) })
    }
}

export! {
    /// Reads a parameter by key (forwarded).
    fn ncclParamGetParameter / pncclParamGetParameter(key: *const c_char, value: *mut *const c_char, valueLen: *mut c_int) -> ncclResult_t {
        guard("ncclParamGetParameter", || {
            let k = if key.is_null() { String::new() } else {
                // SAFETY: NCCL's contract: key is a NUL-terminated string.
                unsafe { CStr::from_ptr(key) }.to_string_lossy().into_owned()
            };
            let n = fallback_only(&format!("ncclParamGetParameter({k:?})"))?;
            forward!(n, "ncclParamGetParameter", (key => *const c_char, value => *mut *const c_char, valueLen => *mut c_int))
        })
    }
}

export! {
    /// Lists parameter keys (forwarded).
    fn ncclParamGetAllParameterKeys / pncclParamGetAllParameterKeys(table: *mut *mut *const c_char, tableLen: *mut c_int) -> ncclResult_t {
        guard("ncclParamGetAllParameterKeys", || { let n = fallback_only("ncclParamGetAllParameterKeys")?; forward!(n, "ncclParamGetAllParameterKeys", (table => *mut *mut *const c_char, tableLen => *mut c_int)) })
    }
}

export! {
    /// Dumps parameters (forwarded; without NCCL, records why for `ncclGetLastError`).
    fn ncclParamDumpAll / pncclParamDumpAll() -> () {
        let _ = guard("ncclParamDumpAll", || { let n = fallback_only("ncclParamDumpAll")?;
            type F = unsafe extern "C" fn();
            // SAFETY: the header's signature.
            let f: F = unsafe { n.sym::<F>("ncclParamDumpAll") }?;
            // SAFETY: no arguments.
            unsafe { f() };
            Ok(())
        });
    }
}

export! {
    /// Deprecated in the header ("not supported as part of the NCCL API"): re-reads the real
    /// NCCL's debug settings when the fallback is loaded; natively there is nothing to reset
    /// (mscclpp reads its log settings once).
    fn ncclResetDebugInit / pncclResetDebugInit() -> () {
        if let Ok(n) = nccl() {
            type F = unsafe extern "C" fn();
            // SAFETY: the header's signature.
            if let Ok(f) = unsafe { n.sym::<F>("ncclResetDebugInit") } {
                // SAFETY: no arguments.
                unsafe { f() };
            }
        }
    }
}
