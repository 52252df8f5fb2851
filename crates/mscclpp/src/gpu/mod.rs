//! CUDA through the driver API, loaded at run time by `cudarc` (no CUDA needed to build).
//!
//! Every entry point first checks that `libcuda` can be loaded ([`init`]); where it cannot, the
//! call returns `NotAvailable` ("no CUDA driver found") instead of panicking as cudarc would.
//! Every function that calls the driver binds the device's primary context on the calling thread
//! first, so library threads need no setup.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::CString;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use crate::context::lock;
use crate::error::{Error, ErrorKind, Result};
use crate::sys::hostmem::Region;

pub(crate) mod fifo_mem;
mod forward;
use crate::transport::{Transport, TransportFlags};
pub(crate) use forward::{TokenForwarder, reg_ib_mr};

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

/// A driver call's failure as an [`Error`] of kind `Cuda`, naming the call.
pub(crate) fn cuda_err(call: &str, e: result::DriverError) -> Error {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::new(ErrorKind::Cuda, format!("{call} failed: {name} ({text})"))
}

fn check(call: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| cuda_err(call, e))
}

/// Loads and initializes the driver once.
///
/// # Errors
/// `NotAvailable` ("no CUDA driver found ...") where `libcuda` cannot be loaded; `Cuda` when
/// `cuInit` fails.
pub fn init() -> Result<()> {
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

/// The number of CUDA devices.
pub fn device_count() -> Result<usize> {
    init()?;
    result::device::get_count().map(|n| n as usize).map_err(|e| cuda_err("cuDeviceGetCount", e))
}

/// One device with its retained primary context.
pub(crate) struct GpuDevice {
    pub(crate) ordinal: u32,
    ctx: sys::CUcontext,
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
    let d = Arc::new(GpuDevice { ordinal, ctx });
    devs.push(d.clone());
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

/// The PCI bus id (`0000:17:00.0`) of GPU `ordinal`.
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
    pci_bus_id(ordinal).ok().and_then(|b| crate::sys::numa::pci_numa_node(&b))
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
    raw: sys::CUstream,
    pub(crate) dev: Arc<GpuDevice>,
}

// SAFETY: streams may be used from any thread once the device context is bound, which every
// method does first.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serializes work submitted to one stream.
unsafe impl Sync for Stream {}

impl Stream {
    pub(crate) fn new(dev: &Arc<GpuDevice>) -> Result<Stream> {
        dev.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(Stream { raw, dev: dev.clone() })
    }

    /// Copies `n` bytes device to device, asynchronously.
    pub(crate) fn copy_dtod(&self, dst: u64, src: u64, n: u64) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: callers pass ranges checked against live allocations (GpuRegion::check) that
        // outlive the copy (kept alive until flush/synchronize).
        unsafe { result::memcpy_dtod_async(dst, src, n as usize, self.raw) }
            .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))
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
        if self.dev.bind().is_ok() {
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

/// Device memory from `cuMemAlloc` (exportable through CUDA IPC, unlike pool memory).
pub(crate) struct DeviceAlloc {
    pub(crate) ptr: u64,
    pub(crate) dev: Arc<GpuDevice>,
}

impl DeviceAlloc {
    pub(crate) fn new(dev: &Arc<GpuDevice>, len: usize) -> Result<DeviceAlloc> {
        dev.bind()?;
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
            // SAFETY: ptr came from cuMemAlloc and is freed once; every user of it holds an Arc
            // of this allocation, so none is left.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!(target: LOG, "cuMemFree: {e}");
            }
        }
    }
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
    pub(crate) fn region(dev: &Arc<GpuDevice>, len: usize) -> Result<Region> {
        dev.bind()?;
        // SAFETY: a plain allocation, freed once in Drop; portable so any context may use it.
        let p = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| cuda_err(&format!("cuMemHostAlloc({len} bytes)"), e))?;
        let a = Arc::new(PinnedAlloc { ptr: p.cast(), len, dev: dev.clone() });
        // SAFETY: [ptr, ptr+len) is valid for reads and writes until the PinnedAlloc is freed,
        // and the Region keeps it alive through the keeper.
        Ok(unsafe { Region::from_raw_kept(a.ptr, a.len, a) })
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
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
    _keeper: Option<Arc<DeviceAlloc>>,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuRegion(GPU{} {:#x}+{})", self.dev.ordinal, self.ptr, self.len)
    }
}

impl GpuRegion {
    pub(crate) fn check(&self, offset: u64, n: u64) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(Error::invalid_usage(format!(
                "range [{offset}, {offset}+{n}) is outside the {}-byte GPU region",
                self.len
            ))),
        }
    }

    /// Copy from the host into the region, complete on the device when this returns.
    pub(crate) fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check(offset, src.len() as u64)?;
        self.dev.bind()?;
        // SAFETY: the range is checked against the live allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + offset, src) }.map_err(|e| cuda_err("cuMemcpyHtoD", e))?;
        // From pageable memory, cuMemcpyHtoD may return once the bytes are staged, before the DMA
        // reaches the device; work on other (non-blocking) streams would then read old bytes.
        // Seen on the H200: a CUDA IPC write right after it sent stale data.
        sync_legacy_stream()
    }

    /// Synchronous copy from the region to the host.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len() as u64)?;
        self.dev.bind()?;
        // SAFETY: the range is checked against the live allocation.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset) }.map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }

    /// Fill, complete on the device when this returns.
    pub(crate) fn fill(&self, offset: u64, n: u64, byte: u8) -> Result<()> {
        self.check(offset, n)?;
        self.dev.bind()?;
        // SAFETY: the range is checked against the live allocation.
        unsafe { result::memset_d8_sync(self.ptr + offset, byte, n as usize) }
            .map_err(|e| cuda_err("cuMemsetD8", e))?;
        // cuMemsetD8 may run asynchronously to the host.
        sync_legacy_stream()
    }
}

/// Owned device memory, registered with a context at allocation.
///
/// ```no_run
/// use mscclpp::{Context, DeviceBuffer, Transport};
/// let ctx = Context::new();
/// let buf = DeviceBuffer::new(&ctx, 0, 1 << 20, Transport::CudaIpc | Transport::Ethernet)?;
/// buf.write(0, b"to the GPU")?;
/// # Ok::<(), mscclpp::Error>(())
/// ```
#[derive(Clone)]
pub struct DeviceBuffer {
    mem: crate::RegisteredMemory,
    region: GpuRegion,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceBuffer").field(&self.region).finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` zeroed bytes on GPU `device` with `cuMemAlloc` and registers them for
    /// `transports` (CUDA IPC, Ethernet, IB: a dma-buf registration, else `ibv_reg_mr` through
    /// nvidia-peermem).
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU or zero length;
    /// `Cuda` when allocation or export fails.
    pub fn new(ctx: &crate::Context, device: u32, len: usize, transports: TransportFlags) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::invalid_usage("a registered buffer needs at least one byte"));
        }
        let dev = self::device(device)?;
        let alloc = Arc::new(DeviceAlloc::new(&dev, len)?);
        let region = GpuRegion { ptr: alloc.ptr, len, dev, _keeper: Some(alloc) };
        let ipc = if transports.has(Transport::CudaIpc) { Some(ipc_export(&region)?) } else { None };
        let mem = crate::RegisteredMemory::new_local_gpu(ctx, region.clone(), transports, ipc)?;
        Ok(DeviceBuffer { mem, region })
    }

    /// The registration, to give to connections or send to peers.
    pub fn memory(&self) -> &crate::RegisteredMemory {
        &self.mem
    }
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }
    /// Always false: buffers hold at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
    pub(crate) fn region(&self) -> &GpuRegion {
        &self.region
    }
    /// The device address (for kernels; do not free).
    pub fn device_ptr(&self) -> u64 {
        self.region.ptr
    }
    /// The GPU ordinal.
    pub fn device(&self) -> u32 {
        self.region.dev.ordinal
    }
    /// Copies `data` to the buffer at `offset` (synchronous).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.region.write(offset as u64, data)
    }
    /// Copies from the buffer at `offset` into `out` (synchronous).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.region.read(offset as u64, out)
    }
    /// Sets `len` bytes at `offset` to `byte` (synchronous).
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.region.fill(offset as u64, len as u64, byte)
    }
    /// Reads the 8-byte word at `offset` (synchronous).
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

// ---------------------------------------------------------------------------------------------
// Raw baselines for mscclpp-perf

/// Times `iters` rounds of plain copies of `size` bytes, one stream per (source, destination)
/// pair, all pairs at once (after `warmup` untimed rounds): `cuMemcpyDtoDAsync` where both
/// buffers are on one GPU, `cuMemcpyPeerAsync` between two GPUs. This is the raw copy-engine
/// baseline for CUDA IPC; two pairs in opposite directions give the bidirectional one.
pub fn baseline_copy(
    pairs: &[(&DeviceBuffer, &DeviceBuffer)],
    size: usize,
    warmup: u64,
    iters: u64,
) -> Result<Duration> {
    let mut streams = Vec::with_capacity(pairs.len());
    for (src, dst) in pairs {
        src.region.check(0, size as u64)?;
        dst.region.check(0, size as u64)?;
        if src.region.dev.ordinal != dst.region.dev.ordinal {
            src.region.dev.enable_peer_access(&dst.region.dev)?;
        }
        streams.push(Stream::new(&src.region.dev)?);
    }
    let round = |n: u64| -> Result<()> {
        for _ in 0..n {
            for ((src, dst), s) in pairs.iter().zip(&streams) {
                if src.region.dev.ordinal == dst.region.dev.ordinal {
                    s.copy_dtod(dst.region.ptr, src.region.ptr, size as u64)?;
                } else {
                    s.dev.bind()?;
                    // SAFETY: both ranges are checked against live allocations above.
                    unsafe {
                        result::memcpy_peer_async(
                            dst.region.dev.ctx,
                            dst.region.ptr,
                            src.region.dev.ctx,
                            src.region.ptr,
                            size,
                            s.raw,
                        )
                    }
                    .map_err(|e| cuda_err("cuMemcpyPeerAsync", e))?;
                }
            }
        }
        streams.iter().try_for_each(|s| s.synchronize())
    };
    round(warmup)?;
    let t0 = Instant::now();
    round(iters)?;
    Ok(t0.elapsed())
}

/// Times `iters` plain 8-byte host-to-device copies from pinned memory, each followed by a stream
/// synchronize: the raw small-operation latency baseline. Returns the time per operation.
pub fn baseline_h2d_8b(dst: &DeviceBuffer, warmup: u64, iters: u64) -> Result<Duration> {
    dst.region.check(0, 8)?;
    h2d_8b(&dst.region.dev, dst.region.ptr, warmup, iters)
}

/// As [`baseline_h2d_8b`], into GPU memory registered by any process of this host (a peer's
/// memory is mapped through CUDA IPC, as a CUDA IPC connection would map it), from GPU `device`.
pub fn baseline_h2d_8b_into(dst: &crate::RegisteredMemory, device: u32, warmup: u64, iters: u64) -> Result<Duration> {
    dst.check_bounds(0, 8)?;
    let dev = self::device(device)?;
    let p = dst.gpu_ptr(&dev)?;
    h2d_8b(&dev, p, warmup, iters)
}

fn h2d_8b(dev: &Arc<GpuDevice>, dst: u64, warmup: u64, iters: u64) -> Result<Duration> {
    let s = Stream::new(dev)?;
    let slot = PinnedAlloc::region(dev, 8)?;
    let mut t0 = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            t0 = Instant::now();
        }
        slot.write(0, &i.to_le_bytes())?;
        s.copy_htod(dst, slot.as_mut_ptr(), 8)?;
        s.synchronize()?;
    }
    Ok(t0.elapsed() / iters.max(1) as u32)
}

/// Page-locked host memory (`cuMemHostAlloc`), registered with a context like a
/// [`Buffer`](crate::Buffer): host memory the GPU copy engines reach directly, for staging.
///
/// ```no_run
/// use mscclpp::{Context, Transport, gpu::PinnedBuffer};
/// let pinned = PinnedBuffer::new(&Context::new(), 0, 1 << 20, Transport::Ethernet.into())?;
/// pinned.write(0, b"staged")?;
/// # Ok::<(), mscclpp::Error>(())
/// ```
#[derive(Clone)]
pub struct PinnedBuffer {
    mem: crate::RegisteredMemory,
    region: Region,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PinnedBuffer").field(&self.region).finish()
    }
}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory (in GPU `device`'s context, portable to all)
    /// and registers them for `transports` (host transports: Ethernet, IB).
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for zero length or a transport host
    /// memory cannot use; `Cuda` when the allocation fails.
    pub fn new(ctx: &crate::Context, device: u32, len: usize, transports: TransportFlags) -> Result<PinnedBuffer> {
        crate::memory::check_host_transports(transports)?;
        if len == 0 {
            return Err(Error::invalid_usage("a registered buffer needs at least one byte"));
        }
        let dev = self::device(device)?;
        let region = PinnedAlloc::region(&dev, len)?;
        region.fill(0, len as u64, 0)?;
        let mem = crate::RegisteredMemory::new_local(ctx, region.clone(), transports, crate::Device::Cpu)?;
        Ok(PinnedBuffer { mem, region })
    }
    /// The registration.
    pub fn memory(&self) -> &crate::RegisteredMemory {
        &self.mem
    }
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// Always false: buffers hold at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.region.write(offset as u64, data)
    }
    /// Copies from the buffer at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.region.read(offset as u64, out)
    }
    /// The address of the first byte (for FFI; do not free).
    pub fn as_ptr(&self) -> *const u8 {
        self.region.as_mut_ptr()
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA IPC

/// What a peer process needs to map a device allocation: the legacy IPC handle of the
/// allocation's base, its size, the offset of the registered range, and the owner's device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IpcInfo {
    pub(crate) handle: [u8; 64],
    pub(crate) base_size: u64,
    pub(crate) offset: u64,
    pub(crate) device: u32,
}

impl IpcInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(84);
        v.extend_from_slice(&self.handle);
        v.extend_from_slice(&self.base_size.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.device.to_le_bytes());
        v
    }
    pub(crate) fn decode(b: &[u8]) -> Result<IpcInfo> {
        if b.len() != 84 {
            return Err(Error::invalid_usage(format!("CUDA IPC info of {} bytes (expected 84)", b.len())));
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[..64]);
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap_or_default());
        let base_size = u(64..72);
        let offset = u(72..80);
        let device = u32::from_le_bytes(b[80..84].try_into().unwrap_or_default());
        if offset >= base_size.max(1) {
            return Err(Error::invalid_usage("CUDA IPC info: offset beyond the allocation"));
        }
        Ok(IpcInfo { handle, base_size, offset, device })
    }
}

pub(crate) fn ipc_export(r: &GpuRegion) -> Result<IpcInfo> {
    r.dev.bind()?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers to locals; ptr is a live allocation of this process.
    check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, r.ptr) })?;
    let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: h is written by the driver on success (checked before assume_init).
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) })?;
    // SAFETY: initialized by the successful call above.
    let h = unsafe { h.assume_init() };
    let mut handle = [0u8; 64];
    for (d, s) in handle.iter_mut().zip(h.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(IpcInfo { handle, base_size: size as u64, offset: r.ptr - base, device: r.dev.ordinal })
}

/// A peer's allocation mapped into this process; unmapped when the last user drops it.
pub(crate) struct IpcMapping {
    pub(crate) base: u64,
    pub(crate) size: u64,
    dev: Arc<GpuDevice>,
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: base came from cuIpcOpenMemHandle and is closed once (the cache holds Weak
            // references only, so this is the last user).
            let r = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            IPC_LIVE.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(target: LOG, "cuIpcCloseMemHandle: {r:?}");
            }
        }
    }
}

/// Opens (once per process, shared by reference count) a peer's allocation on `dev`.
pub(crate) fn ipc_open(info: &IpcInfo, dev: &Arc<GpuDevice>) -> Result<Arc<IpcMapping>> {
    static CACHE: Mutex<Option<HashMap<[u8; 64], Weak<IpcMapping>>>> = Mutex::new(None);
    let mut cache = lock(&CACHE);
    let map = cache.get_or_insert_with(HashMap::new);
    if let Some(m) = map.get(&info.handle).and_then(Weak::upgrade) {
        return Ok(m);
    }
    dev.bind()?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(info.handle.iter()) {
        *d = *s as std::ffi::c_char;
    }
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer to a local; the handle bytes came from cuIpcGetMemHandle in the peer.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut base, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
    })?;
    IPC_LIVE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let m = Arc::new(IpcMapping { base, size: info.base_size, dev: dev.clone() });
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(info.handle, Arc::downgrade(&m));
    Ok(m)
}

/// How many peer allocations this process has mapped through CUDA IPC right now.
pub fn ipc_mapped_count() -> usize {
    IPC_LIVE.load(std::sync::atomic::Ordering::Relaxed)
}
static IPC_LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// ---------------------------------------------------------------------------------------------
// The atomic-add kernel

struct Func(sys::CUfunction);
// SAFETY: function handles are context-wide and immutable.
unsafe impl Send for Func {}
// SAFETY: as above.
unsafe impl Sync for Func {}

fn atomic_add_function(dev: &Arc<GpuDevice>) -> Result<&'static Func> {
    static FUNCS: Mutex<Vec<(u32, &'static Func)>> = Mutex::new(Vec::new());
    let mut fs = lock(&FUNCS);
    if let Some((_, f)) = fs.iter().find(|(o, _)| *o == dev.ordinal) {
        return Ok(f);
    }
    dev.bind()?;
    let image = CString::new(ATOMIC_ADD_PTX).map_err(|_| Error::internal("PTX contains a NUL byte"))?;
    // SAFETY: image is a NUL-terminated PTX text; the module stays loaded for the process.
    let module =
        unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(|e| cuda_err("cuModuleLoadData", e))?;
    let name = CString::new(ATOMIC_ADD_ENTRY).map_err(|_| Error::internal("bad entry name"))?;
    // SAFETY: module is loaded and never unloaded; name is NUL-terminated.
    let f = unsafe { result::module::get_function(module, name) }.map_err(|e| cuda_err("cuModuleGetFunction", e))?;
    let f: &'static Func = Box::leak(Box::new(Func(f)));
    fs.push((dev.ordinal, f));
    Ok(f)
}

#[cfg(test)]
mod tests {
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
    fn without_a_driver_calls_fail_cleanly() {
        // SAFETY: probe only.
        if unsafe { sys::is_culib_present() } {
            return; // a machine with CUDA: covered by the GPU tests
        }
        let e = device_count().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotAvailable);
        assert!(e.to_string().contains("no CUDA driver found"), "{e}");
        let ctx = crate::Context::new();
        let e = DeviceBuffer::new(&ctx, 0, 64, Transport::CudaIpc.into()).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver found"), "{e}");
        let e = PinnedBuffer::new(&ctx, 0, 64, Transport::Ethernet.into()).unwrap_err();
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
