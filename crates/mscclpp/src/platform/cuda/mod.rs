//! CUDA through the driver API, loaded at run time by `cudarc` (no CUDA needed to build).
//!
//! Every entry point first checks that `libcuda` can be loaded ([`init`]); where it cannot, the
//! call returns `NotAvailable` ("no CUDA driver found") instead of panicking as cudarc would.
//! Every function that calls the driver binds the device's primary context on the calling thread
//! first, so library threads need no setup.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::{result, sys};

use crate::error::{Error, ErrorKind, Result};
use crate::platform::hostmem::Region;
use crate::sync::lock;

mod dmabuf;
pub(crate) mod fifo_mem;
pub(crate) mod graph;
mod ipc;
pub(crate) mod linger;
pub(crate) mod module;
pub(crate) mod nvrtc;
pub(crate) mod queue_probe;
pub(crate) mod usermem;
pub(crate) use dmabuf::reg_ib_mr;
pub use ipc::ipc_mapped_count;
pub(crate) use ipc::{IpcInfo, ipc_export, ipc_open};

const LOG: &str = "mscclpp::gpu";

/// The `atomic_add` kernel: one thread adds a 64-bit value to a word with system scope, so the
/// add is atomic against other GPUs and the host. Loaded with `cuModuleLoadData`; no nvcc at
/// build time.
pub(crate) const ATOMIC_ADD_PTX: &str = r#"//
// mscclpp: remote 64-bit atomic add
.version 7.0
.target sm_60
.address_size 64

.visible .entry mscclpp_atomic_add_u64(
	.param .u64 mscclpp_atomic_add_u64_param_0,
	.param .u64 mscclpp_atomic_add_u64_param_1
)
{
	.reg .b64 	%rd<5>;

	ld.param.u64 	%rd1, [mscclpp_atomic_add_u64_param_0];
	ld.param.u64 	%rd2, [mscclpp_atomic_add_u64_param_1];
	cvta.to.global.u64 	%rd3, %rd1;
	atom.sys.global.add.u64 	%rd4, [%rd3], %rd2;
	ret;
}
"#;
pub(crate) const ATOMIC_ADD_ENTRY: &str = "mscclpp_atomic_add_u64";

/// The block copy both CUDA IPC copy kernels share ([`PUT_TOKEN_PTX`] and the lingering
/// kernel, `linger::LINGER_PTX`): `len` (`%rd3`) bytes from `%rd2` to `%rd1` (global
/// addresses) by `%rd7` threads from thread index `%rd6`, in 16-byte units when both pointers are
/// 16-byte aligned, then single bytes for the rest (all of it otherwise); it falls through to
/// the `COPIED` label that must follow it. One text, so the two kernels cannot drift apart.
macro_rules! ptx_block_copy {
    () => {
        r#"	// %rd14: where the byte loop starts (0 when the pointers are not both 16-byte aligned).
	mov.u64 	%rd14, 0;
	or.b64 	%rd8, %rd1, %rd2;
	and.b64 	%rd8, %rd8, 15;
	setp.ne.u64 	%p1, %rd8, 0;
	@%p1 bra 	TAIL;
	shr.u64 	%rd9, %rd3, 4;
	shl.b64 	%rd14, %rd9, 4;
WIDE:
	setp.ge.u64 	%p2, %rd6, %rd9;
	@%p2 bra 	TAIL;
	shl.b64 	%rd10, %rd6, 4;
	add.s64 	%rd11, %rd2, %rd10;
	ld.global.v2.u64 	{%rd12, %rd13}, [%rd11];
	add.s64 	%rd11, %rd1, %rd10;
	st.global.v2.u64 	[%rd11], {%rd12, %rd13};
	add.s64 	%rd6, %rd6, %rd7;
	bra.uni 	WIDE;
TAIL:
	cvt.u64.u32 	%rd6, %r1;
	add.s64 	%rd6, %rd6, %rd14;
BYTES:
	setp.ge.u64 	%p2, %rd6, %rd3;
	@%p2 bra 	COPIED;
	add.s64 	%rd11, %rd2, %rd6;
	ld.global.u8 	%r3, [%rd11];
	add.s64 	%rd11, %rd1, %rd6;
	st.global.u8 	[%rd11], %r3;
	add.s64 	%rd6, %rd6, %rd7;
	bra.uni 	BYTES;
"#
    };
}
pub(crate) use ptx_block_copy;

/// A copy of `len` bytes by one block of threads, then (when `token` is not 0) one 64-bit word
/// written at `token` after the copy, for CUDA IPC connections whose small copies go through a
/// kernel instead of the copy engine (`MSCCLPP_CUDAIPC_KERNEL_COPY_MAX`). 16-byte loads and
/// stores for the whole 16-byte units when `dst` and `src` are both 16-byte aligned, single
/// bytes for the rest (all of it otherwise). The token
/// is written as `cuStreamWriteValue64` writes it after a copy: every thread's stores, then a
/// barrier, then thread 0's `fence.acq_rel.sys` and relaxed system-scope store (a release
/// pattern, cumulative over the block's stores the barrier ordered before it), so a peer that
/// reads the token with an acquire load sees the data.
pub(crate) const PUT_TOKEN_PTX: &str = concat!(
    r#"//
// mscclpp: copy, then token
.version 7.0
.target sm_70
.address_size 64

.visible .entry mscclpp_put_token_u64(
	.param .u64 p_dst,
	.param .u64 p_src,
	.param .u64 p_len,
	.param .u64 p_token,
	.param .u64 p_value
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<16>;

	ld.param.u64 	%rd1, [p_dst];
	ld.param.u64 	%rd2, [p_src];
	ld.param.u64 	%rd3, [p_len];
	ld.param.u64 	%rd4, [p_token];
	ld.param.u64 	%rd5, [p_value];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd2, %rd2;
	mov.u32 	%r1, %tid.x;
	mov.u32 	%r2, %ntid.x;
	cvt.u64.u32 	%rd6, %r1;
	cvt.u64.u32 	%rd7, %r2;
"#,
    ptx_block_copy!(),
    r#"COPIED:
	bar.sync 	0;
	setp.ne.u32 	%p3, %r1, 0;
	@%p3 bra 	DONE;
	setp.eq.u64 	%p3, %rd4, 0;
	@%p3 bra 	DONE;
	cvta.to.global.u64 	%rd4, %rd4;
	fence.acq_rel.sys;
	st.relaxed.sys.global.u64 	[%rd4], %rd5;
DONE:
	ret;
}
"#
);
pub(crate) const PUT_TOKEN_ENTRY: &str = "mscclpp_put_token_u64";
/// The most threads of the put-token kernel's one block (fewer when the copy has fewer units).
pub(crate) const PUT_TOKEN_THREADS: u64 = 512;

/// A driver call's failure as an [`Error`] of kind `Cuda`, naming the call.
pub(crate) fn cuda_err(call: &str, e: result::DriverError) -> Error {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::new(ErrorKind::Cuda, format!("{call} failed: {name} ({text})")).with_cuda_result(e.0 as i32)
}

pub(crate) fn check(call: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| cuda_err(call, e))
}

/// Loads and initializes the driver once.
///
/// # Errors
/// `NotAvailable` ("no CUDA driver found ...") where `libcuda` cannot be loaded; `Cuda` when
/// `cuInit` fails.
pub(crate) fn init() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), (ErrorKind, String)>> = OnceLock::new();
    let r = INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be loaded; it does not call into it.
        if !unsafe { sys::is_culib_present() } {
            return Err((
                ErrorKind::NotAvailable,
                "no CUDA driver found (libcuda.so could not be loaded; is the NVIDIA driver installed and on \
                 LD_LIBRARY_PATH?)"
                    .to_string(),
            ));
        }
        result::init().map_err(|e| (ErrorKind::Cuda, cuda_err("cuInit", e).message().to_string()))
    });
    r.clone().map_err(|(k, m)| Error::new(k, m))
}

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later drivers).
pub(crate) fn has_batch_copy() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: `culib` loads the driver library (present, checked first) and `get` only looks
        // the symbol up; nothing is called through it here.
        unsafe {
            sys::is_culib_present() && sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2").is_ok()
        }
    })
}

/// The number of CUDA devices.
pub fn device_count() -> Result<usize> {
    init()?;
    result::device::get_count().map(|n| n as usize).map_err(|e| cuda_err("cuDeviceGetCount", e))
}

/// One device with its retained primary context.
pub(crate) struct GpuDevice {
    pub(crate) ordinal: u32,
    ctx: sys::CUcontext,
    /// Whether it takes programmatic dependent launches (`module::programmatic_launch_supported`),
    /// asked of the driver once, not at every launch.
    pub(crate) programmatic: OnceLock<bool>,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe; we
// bind it per thread before use).
unsafe impl Send for GpuDevice {}
// SAFETY: as above; the handle is never mutated after creation.
unsafe impl Sync for GpuDevice {}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU{}", self.ordinal)
    }
}

/// The device `ordinal`, retained once per process.
pub(crate) fn device(ordinal: u32) -> Result<Arc<GpuDevice>> {
    /// Devices `0..FAST` once retained, read without a lock: every `Stream::from_raw` (each call
    /// of the NCCL library, from every rank thread) comes here, and a process-wide mutex there
    /// made the ranks' threads take turns.
    const FAST: usize = 64;
    static READY: [OnceLock<Arc<GpuDevice>>; FAST] = [const { OnceLock::new() }; FAST];
    if let Some(d) = READY.get(ordinal as usize).and_then(OnceLock::get) {
        return Ok(d.clone());
    }
    init()?;
    static DEVICES: Mutex<Vec<Arc<GpuDevice>>> = Mutex::new(Vec::new());
    let mut devs = lock(&DEVICES);
    if let Some(d) = devs.iter().find(|d| d.ordinal == ordinal) {
        return Ok(d.clone());
    }
    let n = device_count()?;
    if ordinal as usize >= n {
        return Err(Error::invalid_usage(format!("GPU {ordinal} does not exist (this machine has {n})")));
    }
    let dev = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    // SAFETY: dev is a valid device handle; the primary context is retained for the process's
    // lifetime (never released), so handles derived from it stay valid.
    let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
    let d = Arc::new(GpuDevice { ordinal, ctx, programmatic: OnceLock::new() });
    devs.push(d.clone());
    if let Some(slot) = READY.get(ordinal as usize) {
        // Set once, under DEVICES' lock, to the one retained device of this ordinal.
        let _ = slot.set(d.clone());
    }
    Ok(d)
}

impl GpuDevice {
    /// Makes this device's primary context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // Asking is cheaper than setting (a thread-local read in the driver), and asking rather
        // than caching keeps us right when user code switches contexts on this thread.
        if result::ctx::get_current().ok().flatten() == Some(self.ctx) {
            return Ok(());
        }
        // SAFETY: ctx is a retained primary context (never released).
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// Whether `raw` (a caller's stream handle) belongs to this device's primary context; the
    /// legacy and per-thread default streams (0, 1, 2) are taken as this device's (they follow
    /// the calling thread's current context, which calls bind first).
    pub(crate) fn owns_stream(&self, raw: u64) -> Result<bool> {
        if raw <= 2 {
            return Ok(true);
        }
        self.bind()?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local handle; the driver validates the stream handle and
        // returns an error for one it does not know.
        check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(raw as sys::CUstream, &mut ctx) })?;
        Ok(ctx == self.ctx)
    }

    /// Lets this device access `peer`'s memory (tolerates "already enabled").
    pub(crate) fn enable_peer_access(&self, peer: &GpuDevice) -> Result<()> {
        if peer.ordinal == self.ordinal {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both contexts are retained primary contexts.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", r)
    }
}

/// The PCI bus id (`0000:17:00.0`) of GPU `ordinal`: names one GPU across processes whatever
/// their `CUDA_VISIBLE_DEVICES`.
///
/// # Errors
/// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU.
pub fn pci_bus_id(ordinal: u32) -> Result<String> {
    let d = device(ordinal)?;
    let dev = result::device::get(d.ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: buf is 32 writable bytes; the driver writes a NUL-terminated string within len.
    check("cuDeviceGetPCIBusId", unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) })?;
    // SAFETY: NUL-terminated by the driver (checked above to have succeeded).
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_string_lossy().into_owned())
}

/// The NUMA node of GPU `ordinal`, where the system reports one.
pub fn numa_node(ordinal: u32) -> Option<u32> {
    pci_bus_id(ordinal).ok().and_then(|b| crate::platform::numa::pci_numa_node(&b))
}

/// Runs `f` where the host memory it allocates lands on GPU `dev`'s NUMA node: on a short-lived
/// thread bound to that node's CPUs when the machine has several nodes and the GPU's is known,
/// else on the calling thread. Pinned memory the GPU writes across PCIe (the FIFO's ring, the
/// flush words) is then next to it. The caller's own CPU binding is left alone (MSCCL++ binds
/// the calling thread itself, for good, when it makes a FIFO).
pub(crate) fn near_gpu<T: Send>(dev: &GpuDevice, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    match numa_node(dev.ordinal) {
        Some(node) if crate::platform::numa::numa_node_count() > 1 => crate::platform::numa::run_on_node(node, || {
            // A new thread starts in CUDA's global capture mode, where an allocation while any
            // other thread captures a graph (PyTorch's default mode) would invalidate that capture;
            // relaxed mode, as the proxy thread that may call this uses, leaves it alone.
            relax_stream_capture_mode()?;
            f()
        }),
        _ => f(),
    }
}

/// The name of GPU `ordinal`.
pub fn device_name(ordinal: u32) -> Result<String> {
    device(ordinal)?;
    let dev = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    result::device::get_name(dev).map_err(|e| cuda_err("cuDeviceGetName", e))
}

// ---------------------------------------------------------------------------------------------
// Streams and events

/// A non-blocking stream on one device.
pub(crate) struct Stream {
    pub(crate) raw: sys::CUstream,
    pub(crate) dev: Arc<GpuDevice>,
    /// False for a stream the caller owns (borrowed through `from_raw`): never destroyed here.
    owned: bool,
}

// SAFETY: streams may be used from any thread once the device context is bound, which every
// method does first.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serializes work submitted to one stream.
unsafe impl Sync for Stream {}

impl Stream {
    #[track_caller]
    pub(crate) fn new(dev: &Arc<GpuDevice>) -> Result<Stream> {
        dev.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        created(dev, std::panic::Location::caller());
        Ok(Stream { raw, dev: dev.clone(), owned: true })
    }

    /// A non-blocking stream of the device's greatest (`greatest`) or least priority
    /// (`cuStreamCreateWithPriority`, the range from `cuCtxGetStreamPriorityRange`).
    #[track_caller]
    pub(crate) fn with_priority(dev: &Arc<GpuDevice>, greatest: bool) -> Result<Stream> {
        dev.bind()?;
        let (mut least, mut most) = (0i32, 0i32);
        // SAFETY: two out-pointers to live i32s; the context is bound.
        check("cuCtxGetStreamPriorityRange", unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut most) })?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: one out-pointer to a live handle; flags and priority are plain values.
        check("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                if greatest { most } else { least },
            )
        })?;
        created(dev, std::panic::Location::caller());
        Ok(Stream { raw, dev: dev.clone(), owned: true })
    }

    /// A stream the caller created (a framework's current stream), used but never destroyed.
    ///
    /// # Safety
    /// `raw` is a live stream of `dev`'s primary context (or 0, the legacy default stream) and
    /// outlives the returned value.
    pub(crate) unsafe fn borrowed(dev: &Arc<GpuDevice>, raw: u64) -> Stream {
        Stream { raw: raw as sys::CUstream, dev: dev.clone(), owned: false }
    }

    /// Copies `n` bytes device to device, asynchronously.
    pub(crate) fn copy_dtod(&self, dst: u64, src: u64, n: u64) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: callers pass ranges checked against live allocations (GpuRegion::check) that
        // outlive the copy (kept alive until flush/synchronize).
        unsafe { result::memcpy_dtod_async(dst, src, n as usize, self.raw) }
            .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))
    }

    /// Copies `n` bytes device to device with `cuMemcpyAsync` (unified addressing), asynchronously.
    pub(crate) fn copy_unified(&self, dst: u64, src: u64, n: u64) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: as copy_dtod.
        check("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst, src, n as usize, self.raw) })
    }

    /// Copies `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every `i`, in one driver call
    /// (`cuMemcpyBatchAsync`, CUDA 13): in stream order as a whole, in no order among
    /// themselves. `NotAvailable` where the driver lacks it ([`has_batch_copy`]); the driver
    /// refuses the legacy default stream (a `Cuda` error, `CUDA_ERROR_INVALID_VALUE`).
    pub(crate) fn copy_batch(&self, dsts: &mut [u64], srcs: &mut [u64], sizes: &mut [usize]) -> Result<()> {
        if dsts.len() != srcs.len() || dsts.len() != sizes.len() {
            return Err(Error::invalid_usage("a batch copy needs as many sources and sizes as destinations"));
        }
        if dsts.is_empty() {
            return Ok(());
        }
        if !has_batch_copy() {
            return Err(Error::new(ErrorKind::NotAvailable, "this CUDA driver has no cuMemcpyBatchAsync_v2"));
        }
        self.dev.bind()?;
        let none = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: none,
            dstLocHint: none,
            flags: 0,
        }];
        let mut first = [0usize];
        // SAFETY: the three arrays hold `dsts.len()` entries (checked above) and live through the
        // call; one attribute applies to every copy (index 0); the ranges are checked ranges of
        // live allocations that outlive the copies, as in copy_dtod; the symbol exists
        // (has_batch_copy).
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                dsts.len(),
                attrs.as_mut_ptr(),
                first.as_mut_ptr(),
                1,
                self.raw,
            )
        };
        check("cuMemcpyBatchAsync", r)
    }

    /// Copies `n` bytes from `src` on GPU `src_dev` to `dst` on GPU `dst_dev`, asynchronously
    /// (`cuMemcpyPeerAsync`).
    pub(crate) fn copy_peer(
        &self,
        dst_dev: &GpuDevice,
        dst: u64,
        src_dev: &GpuDevice,
        src: u64,
        n: usize,
    ) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: callers pass ranges checked against live allocations that outlive the copy.
        unsafe { result::memcpy_peer_async(dst_dev.ctx, dst, src_dev.ctx, src, n, self.raw) }
            .map_err(|e| cuda_err("cuMemcpyPeerAsync", e))
    }

    /// Copies host memory (pinned, kept alive by the caller until the copy completes) to the device.
    pub(crate) fn copy_htod(&self, dst: u64, src: *const u8, n: usize) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: the caller keeps [src, src+n) alive and unchanged until the stream passes
        // this copy, and [dst, dst+n) is a checked range of a live allocation.
        check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), n, self.raw) })
    }

    /// Copies device memory to host memory (pinned, kept alive by the caller until complete).
    pub(crate) fn copy_dtoh(&self, dst: *mut u8, src: u64, n: usize) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: as copy_htod, with the roles swapped; no Rust reference to dst exists while
        // the copy may run.
        check("cuMemcpyDtoHAsync", unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, n, self.raw) })
    }

    /// Writes a 64-bit value to device-visible memory in stream order. `Ok(false)` where the
    /// device does not support stream memory operations.
    pub(crate) fn write_value64(&self, addr: u64, value: u64) -> Result<bool> {
        self.dev.bind()?;
        // SAFETY: addr is a checked, 8-byte aligned word of a live allocation.
        let r = unsafe {
            sys::cuStreamWriteValue64_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        };
        if r == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED {
            return Ok(false);
        }
        check("cuStreamWriteValue64", r).map(|_| true)
    }

    /// Adds `value` to the 64-bit word at `addr` with a one-thread kernel, in stream order.
    pub(crate) fn atomic_add(&self, addr: u64, value: u64) -> Result<()> {
        let f = atomic_add_function(&self.dev)?;
        self.dev.bind()?;
        let mut a = addr;
        let mut v = value;
        let mut params = [(&mut a as *mut u64).cast::<std::ffi::c_void>(), (&mut v as *mut u64).cast()];
        // SAFETY: f is the PTX entry taking (u64 pointer, u64 value); params point to two u64s
        // that live until cuLaunchKernel returns (it copies them); addr is a checked aligned word.
        unsafe { result::launch_kernel(f.0, (1, 1, 1), (1, 1, 1), 0, self.raw, &mut params) }
            .map_err(|e| cuda_err("cuLaunchKernel(mscclpp_atomic_add_u64)", e))
    }

    /// Copies `len` bytes from `src` to `dst` with a one-block kernel, then, unless `token` is
    /// 0, writes `value` to the 8-byte word at `token`, visible only after the copy
    /// ([`PUT_TOKEN_PTX`], loaded by [`load_put_token`]); in stream order. One driver call for a
    /// copy and its token, against two (`cuMemcpyDtoDAsync`, `cuStreamWriteValue64`) on the copy
    /// engine, but it needs a free SM: a grid that fills the GPU and waits for this copy waits
    /// until its own timeouts, so connections use it only when asked.
    pub(crate) fn put_token(&self, k: PutToken, dst: u64, src: u64, len: u64, token: u64, value: u64) -> Result<()> {
        self.dev.bind()?;
        let units = if (dst | src).is_multiple_of(16) { len / 16 + len % 16 } else { len };
        let threads = units.clamp(1, PUT_TOKEN_THREADS) as u32;
        let (mut d, mut s, mut n, mut t, mut v) = (dst, src, len, token, value);
        let mut params = [
            (&mut d as *mut u64).cast::<std::ffi::c_void>(),
            (&mut s as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut t as *mut u64).cast(),
            (&mut v as *mut u64).cast(),
        ];
        // SAFETY: k.0 is the PTX entry taking five u64 parameters (two byte ranges' addresses and
        // length, a word's address or 0, a value), loaded in this device's primary context;
        // params point to five u64s that live until cuLaunchKernel returns (it copies them);
        // callers pass ranges checked against live allocations and an aligned word, kept alive
        // until a flush proves the kernel ran.
        unsafe { result::launch_kernel(k.0.0, (1, 1, 1), (threads, 1, 1), 0, self.raw, &mut params) }
            .map_err(|e| cuda_err("cuLaunchKernel(mscclpp_put_token_u64)", e))
    }

    /// Records `ev` on this stream.
    pub(crate) fn record(&self, ev: &Event) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: both handles are live and on the same context.
        unsafe { result::event::record(ev.raw, self.raw) }.map_err(|e| cuda_err("cuEventRecord", e))
    }

    /// Waits until all work on the stream finished.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: raw is a live stream.
        unsafe { result::stream::synchronize(self.raw) }.map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    /// Whether all work submitted so far has finished.
    pub(crate) fn idle(&self) -> Result<bool> {
        self.dev.bind()?;
        // SAFETY: raw is a live stream.
        let r = unsafe { sys::cuStreamQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|_| true)
    }

    /// Waits (polling, so the wait is bounded) until all work submitted so far finished.
    /// `Ok(false)` on timeout.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> Result<bool> {
        poll_until(timeout, || self.idle())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned && self.dev.bind().is_ok() {
            // SAFETY: raw is a live stream destroyed once; pending work completes first (driver).
            if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
                tracing::warn!(target: LOG, "cuStreamDestroy: {e}");
            }
        }
    }
}

/// A CUDA event without timing.
pub(crate) struct Event {
    raw: sys::CUevent,
    dev: Arc<GpuDevice>,
}

// SAFETY: event handles may be used from any thread with the context bound (each method does).
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    pub(crate) fn new(dev: &Arc<GpuDevice>) -> Result<Event> {
        dev.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_err("cuEventCreate", e))?;
        Ok(Event { raw, dev: dev.clone() })
    }

    /// Whether the work before the last record has finished.
    pub(crate) fn done(&self) -> Result<bool> {
        self.dev.bind()?;
        // SAFETY: raw is a live event.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|_| true)
    }

    /// Polls until done or `timeout`. `Ok(false)` on timeout.
    pub(crate) fn wait(&self, timeout: Duration) -> Result<bool> {
        poll_until(timeout, || self.done())
    }
}

/// Polls `ready` until it is true or `timeout` passes (`Ok(false)`), backing off as
/// [`BackoffPolicy::FAST`](crate::sync::BackoffPolicy::FAST) says.
fn poll_until(timeout: Duration, ready: impl FnMut() -> Result<bool>) -> Result<bool> {
    crate::sync::poll_until(timeout, crate::sync::BackoffPolicy::FAST, ready)
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: raw is a live event destroyed once.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory

/// Logs (debug level) a call from CUDA's implicit-synchronization list (device or pinned
/// allocation or free, a synchronous copy or memset, a module load): work submitted after it
/// does not run beside kernels submitted before it, so one issued while ranks' kernels spin
/// for each other stalls them until a wait times out (suspected for issue #28's two-node runs,
/// whose stall turned out to be queued launches; see docs/design.md). `what` is only built
/// when the line is logged.
pub(crate) fn serializing(what: impl FnOnce() -> String, ordinal: u32, at: Option<&std::panic::Location<'_>>) {
    if !tracing::enabled!(target: LOG, tracing::Level::DEBUG) {
        return;
    }
    let what = what();
    match at {
        Some(at) => tracing::debug!(target: LOG, "{what} on GPU{ordinal} by {}:{} (serializes)", at.file(), at.line()),
        None => tracing::debug!(target: LOG, "{what} on GPU{ordinal} (serializes)"),
    }
}

/// Counts the streams this process made (through this module), and logs each at debug level
/// with its number and maker (which streams existed, and who made them, when a run stalls).
fn created(dev: &GpuDevice, at: &std::panic::Location<'_>) {
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    tracing::debug!(target: LOG, "stream {n} of this process made on GPU{} by {}:{}", dev.ordinal, at.file(), at.line());
}

/// Device memory from `cuMemAlloc` (exportable through CUDA IPC, unlike pool memory).
pub(crate) struct DeviceAlloc {
    pub(crate) ptr: u64,
    pub(crate) dev: Arc<GpuDevice>,
}

impl DeviceAlloc {
    #[track_caller]
    pub(crate) fn new(dev: &Arc<GpuDevice>, len: usize) -> Result<DeviceAlloc> {
        dev.bind()?;
        serializing(|| format!("cuMemAlloc({len}) + cuMemsetD8"), dev.ordinal, Some(std::panic::Location::caller()));
        // SAFETY: a plain allocation; freed once in Drop.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }
            .map_err(|e| cuda_err(&format!("cuMemAlloc({len} bytes on GPU{})", dev.ordinal), e))?;
        // Zero it, as host buffers are, before anyone can use it.
        // SAFETY: [ptr, ptr+len) was just allocated.
        unsafe { result::memset_d8_sync(ptr, 0, len.max(1)) }.map_err(|e| cuda_err("cuMemsetD8", e))?;
        sync_legacy_stream()?;
        Ok(DeviceAlloc { ptr, dev: dev.clone() })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            serializing(|| "cuMemFree".into(), self.dev.ordinal, None);
            // SAFETY: ptr came from cuMemAlloc and is freed once; every user of it holds an Arc
            // of this allocation, so none is left.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!(target: LOG, "cuMemFree: {e}");
            }
        }
    }
}

/// Sets the calling thread's stream-capture interaction mode to relaxed, so that CUDA calls a
/// proxy thread makes never invalidate (or fail because of) a graph capture running in another
/// thread. C++ MSCCL++ does the same when its proxy thread starts.
pub(crate) fn relax_stream_capture_mode() -> Result<()> {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: an in/out pointer to a local enum value; the call only touches thread-local state.
    check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })
}

/// Page-locked host memory from `cuMemHostAlloc`, used for staging.
pub(crate) struct PinnedAlloc {
    ptr: *mut u8,
    len: usize,
    dev: Arc<GpuDevice>,
}

// SAFETY: a uniquely owned block of host memory; accessed only through Region (raw pointers).
unsafe impl Send for PinnedAlloc {}
// SAFETY: as above.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    /// Pinned memory and a [`Region`] over it (the region keeps the allocation alive).
    /// Allocated on the GPU's NUMA node ([`near_gpu`]).
    #[track_caller]
    pub(crate) fn region(dev: &Arc<GpuDevice>, len: usize) -> Result<Region> {
        serializing(|| format!("cuMemHostAlloc({len})"), dev.ordinal, Some(std::panic::Location::caller()));
        // The address travels back from the allocating thread as a number (raw pointers are not
        // Send); the PinnedAlloc below owns it from then on.
        let addr = near_gpu(dev, || {
            dev.bind()?;
            // SAFETY: a plain allocation, freed once in Drop; portable so any context may use it.
            let p = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| cuda_err(&format!("cuMemHostAlloc({len} bytes)"), e))?;
            Ok(p as usize)
        })?;
        let a = Arc::new(PinnedAlloc { ptr: addr as *mut u8, len, dev: dev.clone() });
        // SAFETY: [ptr, ptr+len) is valid for reads and writes until the PinnedAlloc is freed,
        // and the Region keeps it alive through the keeper.
        Ok(unsafe { Region::from_raw_kept(a.ptr, a.len, a) })
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            serializing(|| "cuMemFreeHost".into(), self.dev.ordinal, None);
            // SAFETY: ptr came from cuMemHostAlloc; freed once, after its last Region is gone.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// Waits for the legacy default stream (where the synchronous copy and memset calls run) on the
/// current context.
fn sync_legacy_stream() -> Result<()> {
    // SAFETY: the null stream is always valid for the bound context.
    unsafe { result::stream::synchronize(std::ptr::null_mut()) }.map_err(|e| cuda_err("cuStreamSynchronize(0)", e))
}

/// A checked window of device memory.
#[derive(Clone)]
pub(crate) struct GpuRegion {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) dev: Arc<GpuDevice>,
    /// What keeps the memory alive: the library's allocation, or what the user registered it
    /// with (an owned `CudaSlice`, an exported VMM descriptor); `None` when the caller vouches.
    _keeper: Option<Arc<dyn Send + Sync>>,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuRegion(GPU{} {:#x}+{})", self.dev.ordinal, self.ptr, self.len)
    }
}

impl GpuRegion {
    /// Allocates `len` zeroed bytes on `dev` ([`DeviceAlloc`]); the region keeps them alive.
    pub(crate) fn alloc(dev: &Arc<GpuDevice>, len: usize) -> Result<GpuRegion> {
        let alloc = Arc::new(DeviceAlloc::new(dev, len)?);
        Ok(GpuRegion { ptr: alloc.ptr, len, dev: dev.clone(), _keeper: Some(alloc) })
    }

    /// A region over memory the user allocated, checked by [`usermem::pointer_info`] to lie in
    /// one allocation on `dev`; `keeper` (if any) is kept alive with the region.
    pub(crate) fn user(dev: Arc<GpuDevice>, ptr: u64, len: usize, keeper: Option<Arc<dyn Send + Sync>>) -> GpuRegion {
        GpuRegion { ptr, len, dev, _keeper: keeper }
    }

    pub(crate) fn check(&self, offset: u64, n: u64) -> Result<()> {
        crate::platform::check_range(offset, n, self.len as u64, "GPU region")
    }

    /// The window `[offset, offset + len)` of this region, sharing (and keeping alive) its
    /// allocation: how a token pool hands out 8-byte slots of one allocation.
    pub(crate) fn sub(&self, offset: u64, len: usize) -> Result<GpuRegion> {
        self.check(offset, len as u64)?;
        Ok(GpuRegion { ptr: self.ptr + offset, len, dev: self.dev.clone(), _keeper: self._keeper.clone() })
    }

    /// Copy from the host into the region, complete on the device when this returns.
    #[track_caller]
    pub(crate) fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check(offset, src.len() as u64)?;
        serializing(|| "cuMemcpyHtoD".into(), self.dev.ordinal, Some(std::panic::Location::caller()));
        self.dev.bind()?;
        // SAFETY: the range is checked against the live allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + offset, src) }.map_err(|e| cuda_err("cuMemcpyHtoD", e))?;
        // From pageable memory, cuMemcpyHtoD may return once the bytes are staged, before the DMA
        // reaches the device; work on other (non-blocking) streams would then read old bytes.
        // Seen on the H200: a CUDA IPC write right after it sent stale data.
        sync_legacy_stream()
    }

    /// Synchronous copy from the region to the host.
    #[track_caller]
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len() as u64)?;
        serializing(|| "cuMemcpyDtoH".into(), self.dev.ordinal, Some(std::panic::Location::caller()));
        self.dev.bind()?;
        // SAFETY: the range is checked against the live allocation.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset) }.map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }

    /// Fill, complete on the device when this returns.
    #[track_caller]
    pub(crate) fn fill(&self, offset: u64, n: u64, byte: u8) -> Result<()> {
        self.check(offset, n)?;
        serializing(|| "cuMemsetD8".into(), self.dev.ordinal, Some(std::panic::Location::caller()));
        self.dev.bind()?;
        // SAFETY: the range is checked against the live allocation.
        unsafe { result::memset_d8_sync(self.ptr + offset, byte, n as usize) }
            .map_err(|e| cuda_err("cuMemsetD8", e))?;
        // cuMemsetD8 may run asynchronously to the host.
        sync_legacy_stream()
    }
}

// ---------------------------------------------------------------------------------------------
// The atomic-add kernel

struct Func(sys::CUfunction);
// SAFETY: function handles are context-wide and immutable.
unsafe impl Send for Func {}
// SAFETY: as above.
unsafe impl Sync for Func {}

/// Kernel `entry` of the built-in module `ptx`, loaded on `dev` at the first call and kept for
/// the process (modules are never unloaded).
fn builtin_function(dev: &Arc<GpuDevice>, ptx: &'static str, entry: &'static str) -> Result<&'static Func> {
    static FUNCS: Mutex<Vec<(u32, &'static str, &'static Func)>> = Mutex::new(Vec::new());
    let mut fs = lock(&FUNCS);
    if let Some((_, _, f)) = fs.iter().find(|(o, e, _)| *o == dev.ordinal && *e == entry) {
        return Ok(f);
    }
    dev.bind()?;
    let image = CString::new(ptx).map_err(|_| Error::internal("PTX contains a NUL byte"))?;
    // SAFETY: image is a NUL-terminated PTX text; the module stays loaded for the process.
    let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
        .map_err(|e| cuda_err(&format!("cuModuleLoadData({entry})"), e))?;
    let name = CString::new(entry).map_err(|_| Error::internal("bad entry name"))?;
    // SAFETY: module is loaded and never unloaded; name is NUL-terminated.
    let f = unsafe { result::module::get_function(module, name) }
        .map_err(|e| cuda_err(&format!("cuModuleGetFunction({entry})"), e))?;
    let f: &'static Func = Box::leak(Box::new(Func(f)));
    fs.push((dev.ordinal, entry, f));
    Ok(f)
}

fn atomic_add_function(dev: &Arc<GpuDevice>) -> Result<&'static Func> {
    builtin_function(dev, ATOMIC_ADD_PTX, ATOMIC_ADD_ENTRY)
}

/// The put-token kernel of one device ([`load_put_token`], [`Stream::put_token`]).
#[derive(Clone, Copy)]
pub(crate) struct PutToken(&'static Func);

/// Loads the put-token kernel on `dev` now (a module loaded later, while a kernel that waits for
/// the copy spins, could wait for the GPU) and returns it: launches then take no lock.
pub(crate) fn load_put_token(dev: &Arc<GpuDevice>) -> Result<PutToken> {
    builtin_function(dev, PUT_TOKEN_PTX, PUT_TOKEN_ENTRY).map(PutToken)
}

/// The variable the CUDA driver reads, when a context is created, for how many hardware work
/// queues the context's streams share (8 unless set). Ranks that are threads of one process
/// share a context, and streams that share a queue start their work in order: a rank's launch
/// can then wait behind a peer's queued launches that wait for it (docs/design.md, "Hardware
/// queues and ranks as threads"). The library warns once when that setup meets fewer than
/// [`HW_QUEUES_MAX`] queues; `mscclpp-perf` sets it to that for its ranks as threads.
pub const HW_QUEUES_VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// The most hardware queues [`HW_QUEUES_VAR`] can ask for.
pub const HW_QUEUES_MAX: u32 = 32;

/// For a program whose ranks are threads of one process: sets [`HW_QUEUES_VAR`] to
/// [`HW_QUEUES_MAX`] unless it is set already, so that the context's streams (several ranks'
/// streams and their connection streams) do not share hardware queues. Returns the value in
/// force and whether this call set it. It must run before CUDA starts in this process (the driver
/// reads the variable once, when it creates a context); later it changes nothing.
///
/// # Safety
/// It writes the environment: no other thread may read or write the environment while it runs
/// (call it at the top of `main`, before starting threads or CUDA; in a test binary, first thing
/// in every test, the tests run one at a time: only the first call writes).
///
/// ```no_run
/// // SAFETY: the first thing main does, before any thread exists.
/// let (queues, set_here) = unsafe { mscclpp::gpu::use_all_hw_queues() };
/// println!("{} = {queues} ({})", mscclpp::gpu::HW_QUEUES_VAR, if set_here { "set here" } else { "yours" });
/// ```
pub unsafe fn use_all_hw_queues() -> (String, bool) {
    match std::env::var_os(HW_QUEUES_VAR) {
        Some(v) => (v.to_string_lossy().into_owned(), false),
        None => {
            // SAFETY: the caller guarantees that no other thread touches the environment now.
            unsafe { std::env::set_var(HW_QUEUES_VAR, HW_QUEUES_MAX.to_string()) };
            (HW_QUEUES_MAX.to_string(), true)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn ptx_is_well_formed() {
        // The header directives, one entry with the name we look up, balanced braces, and the
        // system-scope atomic the transport relies on.
        assert!(ATOMIC_ADD_PTX.contains(".version 7.0"));
        assert!(ATOMIC_ADD_PTX.contains(".target sm_60"));
        assert!(ATOMIC_ADD_PTX.contains(".address_size 64"));
        assert_eq!(ATOMIC_ADD_PTX.matches(".entry").count(), 1);
        assert!(ATOMIC_ADD_PTX.contains(&format!(".entry {ATOMIC_ADD_ENTRY}(")));
        assert_eq!(ATOMIC_ADD_PTX.matches('{').count(), ATOMIC_ADD_PTX.matches('}').count());
        assert!(ATOMIC_ADD_PTX.contains("atom.sys.global.add.u64"));
        assert!(ATOMIC_ADD_PTX.is_ascii() && !ATOMIC_ADD_PTX.contains('\0'));
        // Pin the text: a change must be deliberate (and run on a GPU).
        assert_eq!(crate::identity::fnv1a64(&[ATOMIC_ADD_PTX.as_bytes()]), PTX_HASH, "PTX text changed");
    }
    const PTX_HASH: u64 = 14083864026707903609;

    #[test]
    fn put_token_ptx_is_well_formed() {
        // One entry under the name looked up, five u64 parameters in the launch's order, the
        // barrier before the token, and the token's release pattern (fence, then a relaxed
        // system-scope store), skipped when the token address is 0.
        let p = PUT_TOKEN_PTX;
        assert!(p.contains(".version 7.0") && p.contains(".target sm_70") && p.contains(".address_size 64"));
        assert_eq!(p.matches(".entry").count(), 1);
        assert!(p.contains(&format!(".entry {PUT_TOKEN_ENTRY}(")));
        let params: Vec<&str> = p.lines().filter(|l| l.trim_start().starts_with(".param .u64")).collect();
        assert_eq!(params.len(), 5, "{params:?}");
        for (i, name) in ["p_dst", "p_src", "p_len", "p_token", "p_value"].iter().enumerate() {
            assert!(params[i].contains(name), "parameter {i} is {:?}", params[i]);
        }
        let at = |needle: &str| p.find(needle).unwrap_or_else(|| panic!("no {needle}"));
        assert!(at("bar.sync") < at("fence.acq_rel.sys"));
        assert!(at("fence.acq_rel.sys") < at("st.relaxed.sys.global.u64"));
        assert!(at("setp.eq.u64 \t%p3, %rd4, 0") < at("fence.acq_rel.sys"));
        // The byte loop starts after the wide units (or at 0): the tail is never copied twice.
        assert!(at("mov.u64 \t%rd14, 0") < at("WIDE:") && at("add.s64 \t%rd6, %rd6, %rd14") < at("BYTES:"));
        assert_eq!(p.matches('{').count(), p.matches('}').count());
        assert!(p.is_ascii() && !p.contains('\0'));
        assert_eq!(crate::identity::fnv1a64(&[p.as_bytes()]), PUT_TOKEN_HASH, "PTX text changed");
    }
    const PUT_TOKEN_HASH: u64 = 7483407124001082376;

    #[test]
    fn without_a_driver_calls_fail_cleanly() {
        // SAFETY: probe only.
        if unsafe { sys::is_culib_present() } {
            return; // a machine with CUDA: covered by the GPU tests
        }
        let e = device_count().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAvailable);
        assert!(e.to_string().contains("no CUDA driver found"), "{e}");
        assert!(pci_bus_id(0).is_err());
        assert_eq!(numa_node(0), None);
    }

    /// Where the time of a small stream operation goes (run on a GPU machine with `--ignored`).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_small_op_latency_probe() {
        let dev = device(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ev = Event::new(&dev).unwrap();
        let a = DeviceAlloc::new(&dev, 64).unwrap();
        let slot = PinnedAlloc::region(&dev, 8).unwrap();
        let n = 3000u32;
        let time = |name: &str, f: &mut dyn FnMut()| {
            for _ in 0..200 {
                f();
            }
            let t0 = Instant::now();
            for _ in 0..n {
                f();
            }
            println!("PROBE {name:<40} {:6.2} us", t0.elapsed().as_secs_f64() * 1e6 / n as f64);
        };
        time("writeValue64 + cuStreamSynchronize", &mut || {
            s.write_value64(a.ptr, 1).unwrap();
            s.synchronize().unwrap();
        });
        time("writeValue64 + poll cuStreamQuery", &mut || {
            s.write_value64(a.ptr, 1).unwrap();
            s.wait_idle(Duration::from_secs(5)).unwrap();
        });
        time("writeValue64 + event record + poll", &mut || {
            s.write_value64(a.ptr, 1).unwrap();
            s.record(&ev).unwrap();
            ev.wait(Duration::from_secs(5)).unwrap();
        });
        time("pinned HtoD 8 B + cuStreamSynchronize", &mut || {
            s.copy_htod(a.ptr, slot.as_mut_ptr(), 8).unwrap();
            s.synchronize().unwrap();
        });
        time("pinned HtoD 8 B + poll cuStreamQuery", &mut || {
            s.copy_htod(a.ptr, slot.as_mut_ptr(), 8).unwrap();
            s.wait_idle(Duration::from_secs(5)).unwrap();
        });
        time("pinned DtoH 8 B + event record + poll", &mut || {
            s.copy_dtoh(slot.as_mut_ptr(), a.ptr, 8).unwrap();
            s.record(&ev).unwrap();
            ev.wait(Duration::from_secs(5)).unwrap();
        });
        let big = PinnedAlloc::region(&dev, 64 << 10).unwrap();
        let ab = DeviceAlloc::new(&dev, 64 << 10).unwrap();
        time("pinned DtoH 16 KiB + event record + poll", &mut || {
            s.copy_dtoh(big.as_mut_ptr(), ab.ptr, 16 << 10).unwrap();
            s.record(&ev).unwrap();
            ev.wait(Duration::from_secs(5)).unwrap();
        });
        time("pinned DtoH 64 KiB + event record + poll", &mut || {
            s.copy_dtoh(big.as_mut_ptr(), ab.ptr, 64 << 10).unwrap();
            s.record(&ev).unwrap();
            ev.wait(Duration::from_secs(5)).unwrap();
        });
        time("bind (get_current) alone", &mut || dev.bind().unwrap());
        time("cuStreamQuery on an idle stream", &mut || {
            s.idle().unwrap();
        });
        time("writeValue64 alone (queue only)", &mut || {
            s.write_value64(a.ptr, 1).unwrap();
        });
        s.synchronize().unwrap();
    }

    #[test]
    fn ipc_info_round_trip() {
        let i = IpcInfo { handle: [7; 64], base_size: 1 << 20, offset: 4096, device: 3 };
        assert_eq!(IpcInfo::decode(&i.encode()).unwrap(), i);
        assert!(IpcInfo::decode(&i.encode()[..83]).is_err());
        let bad = IpcInfo { offset: 1 << 20, ..i };
        assert!(IpcInfo::decode(&bad.encode()).is_err());
    }
}
