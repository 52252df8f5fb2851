//! The types of NCCL's `nccl.h` (2.31.2), laid out as C lays them out. Enums are plain `c_int`
//! values with named constants: a caller may pass any integer, and Rust enums must never hold
//! a value outside their variants. `tests/c_abi.rs` compiles a C program against the real header
//! and compares every size, offset and constant with these.
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclResult_t`.
pub type ncclResult_t = c_int;
/// Success.
pub const ncclSuccess: ncclResult_t = 0;
/// A CUDA call failed.
pub const ncclUnhandledCudaError: ncclResult_t = 1;
/// A system call failed.
pub const ncclSystemError: ncclResult_t = 2;
/// A bug in the library.
pub const ncclInternalError: ncclResult_t = 3;
/// A bad argument.
pub const ncclInvalidArgument: ncclResult_t = 4;
/// A call the library cannot make in this state or configuration.
pub const ncclInvalidUsage: ncclResult_t = 5;
/// A peer failed.
pub const ncclRemoteError: ncclResult_t = 6;
/// A non-blocking call is still running.
pub const ncclInProgress: ncclResult_t = 7;
/// A wait ran out of time.
pub const ncclTimeout: ncclResult_t = 8;
/// The number of result codes.
pub const ncclNumResults: ncclResult_t = 9;

/// `ncclDataType_t`.
pub type ncclDataType_t = c_int;
/// `int8_t` (`ncclChar`).
pub const ncclInt8: ncclDataType_t = 0;
/// `uint8_t`.
pub const ncclUint8: ncclDataType_t = 1;
/// `int32_t` (`ncclInt`).
pub const ncclInt32: ncclDataType_t = 2;
/// `uint32_t`.
pub const ncclUint32: ncclDataType_t = 3;
/// `int64_t`.
pub const ncclInt64: ncclDataType_t = 4;
/// `uint64_t`.
pub const ncclUint64: ncclDataType_t = 5;
/// half (`ncclHalf`).
pub const ncclFloat16: ncclDataType_t = 6;
/// float (`ncclFloat`).
pub const ncclFloat32: ncclDataType_t = 7;
/// double (`ncclDouble`).
pub const ncclFloat64: ncclDataType_t = 8;
/// bfloat16.
pub const ncclBfloat16: ncclDataType_t = 9;
/// fp8 e4m3.
pub const ncclFloat8e4m3: ncclDataType_t = 10;
/// fp8 e5m2.
pub const ncclFloat8e5m2: ncclDataType_t = 11;
/// The number of types.
pub const ncclNumTypes: ncclDataType_t = 12;

/// `ncclRedOp_t` (values from `ncclNumOps` up are operations made by `ncclRedOpCreate*`).
pub type ncclRedOp_t = c_int;
/// Sum.
pub const ncclSum: ncclRedOp_t = 0;
/// Product.
pub const ncclProd: ncclRedOp_t = 1;
/// Maximum.
pub const ncclMax: ncclRedOp_t = 2;
/// Minimum.
pub const ncclMin: ncclRedOp_t = 3;
/// Average.
pub const ncclAvg: ncclRedOp_t = 4;
/// The number of built-in operations (the first dynamic one).
pub const ncclNumOps: ncclRedOp_t = 5;
/// The largest valid operation value.
pub const ncclMaxRedOp: ncclRedOp_t = 0x7fff_ffff;

/// `ncclScalarResidence_t`.
pub type ncclScalarResidence_t = c_int;
/// The scalar is device memory, read while the collective runs.
pub const ncclScalarDevice: ncclScalarResidence_t = 0;
/// The scalar is host memory, read before `ncclRedOpCreatePreMulSum` returns.
pub const ncclScalarHostImmediate: ncclScalarResidence_t = 1;

/// `ncclCommMemStat_t`.
pub type ncclCommMemStat_t = c_int;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
/// `NCCL_API_MAGIC`: the `magic` of an initialized `ncclConfig_t`.
pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_SPLIT_NOCOLOR`.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_MAJOR`, `NCCL_MINOR`, `NCCL_PATCH` of the header this library implements.
pub const NCCL_MAJOR: c_int = 2;
/// See [`NCCL_MAJOR`].
pub const NCCL_MINOR: c_int = 31;
/// See [`NCCL_MAJOR`].
pub const NCCL_PATCH: c_int = 2;
/// `NCCL_VERSION_CODE` (what `ncclGetVersion` reports).
pub const NCCL_VERSION_CODE: c_int = NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH;

/// `ncclUniqueId`: 128 opaque bytes; ours carry an [`mscclpp::UniqueId`] (or, for a
/// communicator that only forwards, nothing).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    /// The bytes.
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` (`struct ncclConfig_v23100`). Callers built against older headers pass a
/// shorter struct: only the fields inside its `size` are read.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    /// `sizeof(ncclConfig_t)` of the caller's header.
    pub size: usize,
    /// [`NCCL_API_MAGIC`].
    pub magic: c_uint,
    /// The caller's `NCCL_VERSION_CODE`.
    pub version: c_uint,
    /// 0: non-blocking calls; 1 or undefined: blocking.
    pub blocking: c_int,
    /// CUDA thread-block cluster size.
    pub cgaClusterSize: c_int,
    /// Lower bound on CTAs.
    pub minCTAs: c_int,
    /// Upper bound on CTAs.
    pub maxCTAs: c_int,
    /// Network plugin name.
    pub netName: *const c_char,
    /// Share resources with the parent on split.
    pub splitShare: c_int,
    /// Traffic class.
    pub trafficClass: c_int,
    /// Communicator name.
    pub commName: *const c_char,
    /// CollNet on or off.
    pub collnetEnable: c_int,
    /// `NCCL_CTA_POLICY_*`.
    pub CTAPolicy: c_int,
    /// Share resources with the parent on shrink.
    pub shrinkShare: c_int,
    /// NVLS CTAs.
    pub nvlsCTAs: c_int,
    /// Channels per network peer.
    pub nChannelsPerNetPeer: c_int,
    /// NVLink-centric scheduling.
    pub nvlinkCentricSched: c_int,
    /// Graph usage mode.
    pub graphUsageMode: c_int,
    /// RMA contexts.
    pub numRmaCtx: c_int,
    /// Peers for p2p.
    pub maxP2pPeers: c_int,
    /// Graph stream ordering.
    pub graphStreamOrdering: c_int,
    /// Implicit launch order.
    pub launchOrderImplicit: c_int,
    /// RMA signals.
    pub numRmaSig: c_int,
    /// Eager RMA init.
    pub rmaEagerInit: c_int,
    /// `ncclHostCftMode_t`.
    pub hostCftMode: c_int,
}

impl ncclConfig_t {
    /// What `NCCL_CONFIG_INITIALIZER` makes.
    pub fn initializer() -> ncclConfig_t {
        let u = NCCL_CONFIG_UNDEF_INT;
        ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(),
            magic: NCCL_API_MAGIC,
            version: NCCL_VERSION_CODE as c_uint,
            blocking: u,
            cgaClusterSize: u,
            minCTAs: u,
            maxCTAs: u,
            netName: std::ptr::null(),
            splitShare: u,
            trafficClass: u,
            commName: std::ptr::null(),
            collnetEnable: u,
            CTAPolicy: u,
            shrinkShare: u,
            nvlsCTAs: u,
            nChannelsPerNetPeer: u,
            nvlinkCentricSched: u,
            graphUsageMode: u,
            numRmaCtx: u,
            maxP2pPeers: u,
            graphStreamOrdering: u,
            launchOrderImplicit: u,
            numRmaSig: u,
            rmaEagerInit: u,
            hostCftMode: u,
        }
    }
}

/// `ncclCollConfig_t` (`struct ncclCollConfig_v23100`), taken by the `nccl*Config` collectives.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclCollConfig_t {
    /// `sizeof(ncclCollConfig_t)` of the caller's header.
    pub size: usize,
    /// [`NCCL_API_MAGIC`].
    pub magic: c_uint,
    /// The caller's version.
    pub version: c_uint,
    /// Vendor extensions (a list of `ncclConfigExt_t`).
    pub ext: *mut c_void,
    /// Lower bound on CTAs.
    pub minCTAs: c_int,
    /// Upper bound on CTAs.
    pub maxCTAs: c_int,
    /// NVLS CTAs.
    pub nvlsCTAs: c_int,
    /// Cluster size.
    pub cgaClusterSize: c_int,
    /// Algorithm selection string.
    pub algSelection: *const c_char,
    /// Whether an unsatisfiable selection is an error.
    pub forceAlgSelection: c_int,
    /// CTA policy.
    pub CTAPolicy: c_int,
    /// Profiler tag.
    pub userProfilerTag: u64,
}

/// `ncclSimInfo_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclSimInfo_t {
    /// `sizeof`.
    pub size: usize,
    /// `0x74685283`.
    pub magic: c_uint,
    /// Version.
    pub version: c_uint,
    /// Estimated time.
    pub estimatedTime: f32,
}

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclWaitSignalDesc_t {
    /// Signals to wait for.
    pub opCnt: c_int,
    /// From this peer.
    pub peer: c_int,
    /// Signal index.
    pub sigIdx: c_int,
    /// Context.
    pub ctx: c_int,
}

/// `ncclComm_t`: an opaque pointer (ours points to a [`crate::comm::Handle`]).
pub type ncclComm_t = *mut c_void;
/// `ncclWindow_t`.
pub type ncclWindow_t = *mut c_void;
/// `cudaStream_t`.
pub type cudaStream_t = *mut c_void;
/// `ncclParamHandle_t`.
pub type ncclParamHandle_t = *mut c_void;

/// `ncclGetErrorString`'s texts (NCCL's own wording), by result code.
pub fn error_string(r: ncclResult_t) -> &'static std::ffi::CStr {
    match r {
        ncclSuccess => c"no error",
        ncclUnhandledCudaError => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        ncclSystemError => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        ncclInternalError => c"internal error - please report this issue to the NCCL developers",
        ncclInvalidArgument => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        ncclInvalidUsage => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        ncclRemoteError => c"remote process exited or there was a network error",
        ncclInProgress => c"NCCL operation in progress",
        ncclTimeout => c"NCCL operation timed out",
        _ => c"unknown result code",
    }
}
