//! NCCL, loaded at run time (`--nccl PATH`) to run the same sweep next to ours: the few C
//! functions the collective rows need, declared by hand (NCCL's `nccl.h` ABI, stable since 2.x),
//! and a communicator per rank thread.
//!
//! Several ranks on one GPU need NCCL >= 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1`, which
//! [`prepare_env`] sets (when it is not set) before anything starts a thread.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::Path;

use mscclpp_collectives::{Collective, DataType, ReduceOp};

/// `ncclUniqueId`: 128 opaque bytes (`NCCL_UNIQUE_ID_BYTES`), passed by value to
/// `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

impl UniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// The id's bytes, to pass to the other processes of a job.
    pub fn to_bytes(self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    /// An id from [`to_bytes`](Self::to_bytes); `None` unless `b` has [`BYTES`](Self::BYTES).
    pub fn from_bytes(b: &[u8]) -> Option<UniqueId> {
        let arr: [u8; Self::BYTES] = b.try_into().ok()?;
        Some(UniqueId { internal: arr.map(|c| c as c_char) })
    }
}

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `ncclResult_t` (0 = ncclSuccess).
type NcclResult = c_int;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRankFn = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
type CommDestroyFn = unsafe extern "C" fn(RawComm) -> NcclResult;
type GetErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
/// ncclAllReduce and ncclReduceScatter: send, recv, count, datatype, op, comm, stream.
type ReduceFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
/// ncclAllGather: send, recv, sendcount, datatype, comm, stream.
type GatherFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, *mut c_void) -> NcclResult;

/// The environment variable that lets several ranks share one GPU (NCCL >= 2.30).
pub const MULTI_RANK_ENV: &str = "NCCL_MULTI_RANK_GPU_ENABLE";

/// Sets `NCCL_MULTI_RANK_GPU_ENABLE=1` when it is not set (several ranks of one job share a GPU
/// here) and says whether it did. `main` calls it first thing with `--nccl`, while the process
/// has no other thread.
pub fn prepare_env() -> bool {
    if std::env::var_os(MULTI_RANK_ENV).is_some() {
        return false;
    }
    // SAFETY: called at the top of `main`, right after parsing the command line and before
    // anything (CUDA, the bootstrap, NCCL) has started a thread, so nothing reads or writes the
    // environment at the same time.
    unsafe { std::env::set_var(MULTI_RANK_ENV, "1") };
    true
}

/// A loaded NCCL library: its functions, valid while `_lib` is loaded (as long as this value).
pub struct Nccl {
    get_version: Option<GetVersionFn>,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_destroy: CommDestroyFn,
    get_error_string: GetErrorStringFn,
    all_reduce: ReduceFn,
    all_gather: GatherFn,
    reduce_scatter: ReduceFn,
    /// Where it was loaded from.
    pub path: String,
    _lib: libloading::Library,
}

/// NCCL's `ncclDataType_t` for `d`.
fn nccl_type(d: DataType) -> Result<c_int, String> {
    Ok(match d {
        DataType::I32 => 2,  // ncclInt32
        DataType::U32 => 3,  // ncclUint32
        DataType::F16 => 6,  // ncclFloat16
        DataType::F32 => 7,  // ncclFloat32
        DataType::Bf16 => 9, // ncclBfloat16
        other => return Err(format!("no NCCL type for {other}")),
    })
}

/// NCCL's `ncclRedOp_t` for `op`.
fn nccl_op(op: ReduceOp) -> Result<c_int, String> {
    Ok(match op {
        ReduceOp::Sum => 0,  // ncclSum
        ReduceOp::Prod => 1, // ncclProd
        ReduceOp::Max => 2,  // ncclMax
        ReduceOp::Min => 3,  // ncclMin
        ReduceOp::Avg => 4,  // ncclAvg
        other => return Err(format!("no NCCL operation for {other}")),
    })
}

impl Nccl {
    /// Loads the library at `path` and resolves its functions. Call [`prepare_env`] first.
    ///
    /// # Errors
    /// The loader's message when the library or one of its functions cannot be found.
    pub fn load(path: &Path) -> Result<Nccl, String> {
        Nccl::open(path)
    }

    fn open(path: &Path) -> Result<Nccl, String> {
        let shown = path.display().to_string();
        // SAFETY: loading a shared library runs its initializers; NCCL's only set up its own
        // state. The path is the one the user named on the command line.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("loading {shown}: {e}"))?;
        macro_rules! sym {
            ($name:literal, $ty:ty) => {{
                // SAFETY: the symbol is NCCL's C function of that name, whose C signature (nccl.h)
                // `$ty` declares; the pointer is used only while `lib` stays loaded (it is moved
                // into the returned value with the pointers).
                let s: libloading::Symbol<'_, $ty> = unsafe { lib.get($name) }
                    .map_err(|e| format!("{shown}: no {}: {e}", String::from_utf8_lossy(&$name[..$name.len() - 1])))?;
                *s
            }};
        }
        let get_version = {
            // SAFETY: as in `sym!`: ncclGetVersion(int*) from nccl.h; optional (only printed).
            let s: Result<libloading::Symbol<'_, GetVersionFn>, _> = unsafe { lib.get(b"ncclGetVersion\0") };
            s.ok().map(|s| *s)
        };
        let nccl = Nccl {
            get_version,
            get_unique_id: sym!(b"ncclGetUniqueId\0", GetUniqueIdFn),
            comm_init_rank: sym!(b"ncclCommInitRank\0", CommInitRankFn),
            comm_destroy: sym!(b"ncclCommDestroy\0", CommDestroyFn),
            get_error_string: sym!(b"ncclGetErrorString\0", GetErrorStringFn),
            all_reduce: sym!(b"ncclAllReduce\0", ReduceFn),
            all_gather: sym!(b"ncclAllGather\0", GatherFn),
            reduce_scatter: sym!(b"ncclReduceScatter\0", ReduceFn),
            path: shown,
            _lib: lib,
        };
        Ok(nccl)
    }

    /// NCCL's version code (`major * 10000 + minor * 100 + patch` since 2.9), if it says.
    pub fn version(&self) -> Option<i32> {
        let f = self.get_version?;
        let mut v: c_int = 0;
        // SAFETY: ncclGetVersion writes one int to a valid local.
        let r = unsafe { f(&mut v) };
        (r == 0).then_some(v)
    }

    /// `2.30.1` from a version code.
    pub fn version_string(code: i32) -> String {
        if code >= 10000 {
            format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
        } else {
            // Before 2.9: major * 1000 + minor * 100 + patch.
            format!("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100)
        }
    }

    fn check(&self, what: &str, r: NcclResult) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code (or,
        // defensively, null, handled below).
        let p = unsafe { (self.get_error_string)(r) };
        let msg = if p.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a non-null pointer from ncclGetErrorString is a static C string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(format!("{what}: NCCL error {r}: {msg} (NCCL_DEBUG=WARN says more)"))
    }

    /// `ncclGetUniqueId`: the id every rank passes to [`init_rank`](Self::init_rank).
    pub fn unique_id(&self) -> Result<UniqueId, String> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: ncclGetUniqueId fills the 128-byte id it is given (a valid local).
        let r = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", r)?;
        Ok(id)
    }

    /// `ncclCommInitRank` on the calling thread's current GPU (the primary context bound by the
    /// mscclpp call before it): blocks until all `nranks` ranks have called it, so every rank
    /// thread calls it at the same time.
    pub fn init_rank(&self, nranks: usize, id: UniqueId, rank: usize) -> Result<Comm<'_>, String> {
        let n = c_int::try_from(nranks).map_err(|_| format!("{nranks} ranks are too many for NCCL"))?;
        let r_ = c_int::try_from(rank).map_err(|_| format!("rank {rank} is too large for NCCL"))?;
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: raw is a valid out-parameter; the id comes from ncclGetUniqueId of this
        // library, shared by every rank of this job; rank < nranks.
        let r = unsafe { (self.comm_init_rank)(&mut raw, n, id, r_) };
        self.check(&format!("ncclCommInitRank (rank {rank} of {nranks})"), r)?;
        if raw.is_null() {
            return Err(format!("ncclCommInitRank (rank {rank} of {nranks}) returned no communicator"));
        }
        Ok(Comm { nccl: self, raw })
    }
}

/// One rank's NCCL communicator. It is destroyed only by [`destroy`](Comm::destroy), which every
/// rank calls once every rank is done; dropped otherwise (after an error) it is leaked, because
/// destroying it while a peer is gone may wait forever.
pub struct Comm<'a> {
    nccl: &'a Nccl,
    raw: RawComm,
}

impl Comm<'_> {
    /// Enqueues one NCCL collective on `stream` (the raw handle of an mscclpp stream of the
    /// communicator's GPU), with our conventions: `count` is the per-rank count of
    /// [`Collectives`](mscclpp_collectives::Collectives) (AllReduce: elements of the buffer;
    /// AllGather: send count; ReduceScatter: receive count), the same as NCCL's.
    ///
    /// # Safety
    /// `send` and `recv` are device addresses on the communicator's GPU holding what the
    /// collective reads and writes for `count` elements of `dtype` (as for NCCL), valid until
    /// the call has finished on `stream`; every rank makes the same call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn call(
        &self,
        coll: Collective,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<(), String> {
        let (t, o) = (nccl_type(dtype)?, nccl_op(op)?);
        let (s, r, st) = (send as usize as *const c_void, recv as usize as *mut c_void, stream as usize as *mut c_void);
        let res = match coll {
            // SAFETY: the caller's contract (buffers and stream); the comm is live.
            Collective::AllReduce => unsafe { (self.nccl.all_reduce)(s, r, count, t, o, self.raw, st) },
            // SAFETY: as above.
            Collective::AllGather => unsafe { (self.nccl.all_gather)(s, r, count, t, self.raw, st) },
            // SAFETY: as above.
            Collective::ReduceScatter => unsafe { (self.nccl.reduce_scatter)(s, r, count, t, o, self.raw, st) },
            other => return Err(format!("no NCCL call here for {other}")),
        };
        self.nccl.check(&format!("nccl {}", coll.name()), res)
    }

    /// `ncclCommDestroy`, once the communicator's work has finished on every rank.
    pub fn destroy(self) -> Result<(), String> {
        // SAFETY: raw is a live communicator, destroyed once (self is consumed); its streams were
        // synchronized by the caller.
        let r = unsafe { (self.nccl.comm_destroy)(self.raw) };
        self.nccl.check("ncclCommDestroy", r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_are_nccl_h() {
        assert_eq!(nccl_type(DataType::I32).unwrap(), 2);
        assert_eq!(nccl_type(DataType::U32).unwrap(), 3);
        assert_eq!(nccl_type(DataType::F16).unwrap(), 6);
        assert_eq!(nccl_type(DataType::F32).unwrap(), 7);
        assert_eq!(nccl_type(DataType::Bf16).unwrap(), 9);
        assert_eq!(nccl_op(ReduceOp::Sum).unwrap(), 0);
        assert_eq!(nccl_op(ReduceOp::Prod).unwrap(), 1);
        assert_eq!(nccl_op(ReduceOp::Max).unwrap(), 2);
        assert_eq!(nccl_op(ReduceOp::Min).unwrap(), 3);
        assert_eq!(nccl_op(ReduceOp::Avg).unwrap(), 4);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
        assert_eq!(Nccl::version_string(23001), "2.30.1");
        assert_eq!(Nccl::version_string(2708), "2.7.8");
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_crash() {
        let e = Nccl::open(Path::new("/nonexistent/libnccl.so.2")).err().unwrap();
        assert!(e.contains("loading /nonexistent/libnccl.so.2"), "{e}");
    }
}
