//! Loaded CUDA modules (PTX) and kernel launches. Every kernel of a module is resolved with
//! `cuModuleGetFunction` when it loads, so nothing is loaded lazily later (CUDA's lazy loading
//! can block a launch behind a spinning kernel; MSCCL++ issue #394).
#![allow(unsafe_code)]

use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, sys};

use super::{GpuDevice, LOG, Stream as RawStream, cuda_err};
use crate::error::{Error, Result};

/// A module loaded into one device's primary context, with its kernels resolved.
pub(crate) struct Module {
    raw: sys::CUmodule,
    dev: Arc<GpuDevice>,
    funcs: Vec<(String, sys::CUfunction)>,
}

// SAFETY: module and function handles may be used from any thread once the context is bound
// (every method binds it first); they are never mutated after load.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.funcs.iter().map(|(n, _)| n.as_str()).collect();
        write!(f, "Module({:?}, kernels {names:?})", self.dev)
    }
}

impl Module {
    /// Loads `ptx` on GPU `ordinal` and resolves each of `entries`.
    pub(crate) fn load(ordinal: u32, ptx: &str, entries: &[String]) -> Result<Arc<Module>> {
        let dev = super::device(ordinal)?;
        dev.bind()?;
        let image = CString::new(ptx).map_err(|_| Error::invalid_usage("PTX contains a NUL byte"))?;
        super::serializing(|| "cuModuleLoadData".into(), ordinal, None);
        // SAFETY: image is a NUL-terminated PTX text alive for the call (the driver copies it).
        let raw = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(|e| cuda_err(&format!("cuModuleLoadData (GPU{ordinal})"), e))?;
        let mut m = Module { raw, dev, funcs: Vec::with_capacity(entries.len()) };
        for name in entries {
            let c =
                CString::new(name.as_str()).map_err(|_| Error::invalid_usage("a kernel name contains a NUL byte"))?;
            // SAFETY: m.raw is the module just loaded (unloaded only in Drop).
            let f = unsafe { result::module::get_function(m.raw, c) }
                .map_err(|e| cuda_err(&format!("cuModuleGetFunction({name})"), e))?;
            m.funcs.push((name.clone(), f));
        }
        Ok(Arc::new(m))
    }

    /// The device ordinal.
    pub(crate) fn device(&self) -> u32 {
        self.dev.ordinal
    }

    /// The kernel `name`, if the module has it.
    pub(crate) fn function(self: &Arc<Self>, name: &str) -> Option<Kernel> {
        self.funcs.iter().find(|(n, _)| n == name).map(|(n, f)| Kernel {
            name: n.clone(),
            raw: *f,
            module: self.clone(),
        })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: raw is a loaded module, unloaded once; every Function holds an Arc of it.
            if let Err(e) = unsafe { result::module::unload(self.raw) } {
                tracing::warn!(target: LOG, "cuModuleUnload: {e}");
            }
        }
    }
}

/// One kernel of a loaded module (it keeps the module loaded). Get it from
/// [`KernelModule::function`](crate::device::compile::KernelModule::function).
#[derive(Clone)]
pub struct Kernel {
    name: String,
    raw: sys::CUfunction,
    module: Arc<Module>,
}

// SAFETY: as for Module.
unsafe impl Send for Kernel {}
// SAFETY: as for Module.
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({} on GPU{})", self.name, self.module.dev.ordinal)
    }
}

impl Kernel {
    /// The kernel's (PTX entry) name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Launches the kernel on `stream` with `grid` blocks of `block` threads and `shared_mem`
    /// bytes of dynamic shared memory.
    ///
    /// # Errors
    /// `InvalidUsage` when the stream belongs to another GPU; `Cuda` when the launch fails.
    ///
    /// # Safety
    /// `args` holds one pointer per kernel parameter, each to a value of that parameter's type
    /// (the driver copies them during the call), and everything the kernel touches stays valid
    /// until it finishes.
    pub unsafe fn launch(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: &Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_with((grid, block), shared_mem, &stream.inner, args, false) }
    }

    /// [`launch`](Self::launch) as a programmatic dependent launch (compute capability 9.0 and
    /// later): the kernel may start while the kernel before it on `stream` is still running,
    /// once every block of that one has executed `griddepcontrol.launch_dependents` (or exited),
    /// and it must itself execute `griddepcontrol.wait` before it touches anything its
    /// predecessor wrote or reads (that instruction returns when the predecessor has finished
    /// and its memory operations are visible). What it saves is the gap between two kernels.
    /// Captured into a CUDA graph, the dependency stays programmatic.
    ///
    /// Both kernels' blocks can be resident at once: kernels that wait on other ranks' kernels
    /// sharing the GPU must leave room for that.
    ///
    /// # Errors
    /// As [`launch`](Self::launch); `InvalidUsage` where [`programmatic_launch_supported`] says
    /// no.
    ///
    /// # Safety
    /// As [`launch`](Self::launch), and the kernel executes `griddepcontrol.wait` before any
    /// access that depends on earlier work of the stream.
    pub unsafe fn launch_programmatic(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: &Stream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_with((grid, block), shared_mem, &stream.inner, args, true) }
    }

    /// [`launch`](Self::launch) on one of the library's own streams, without dynamic shared
    /// memory (`dims` = (grid, block)).
    ///
    /// # Safety
    /// As [`launch`](Self::launch).
    pub(crate) unsafe fn launch_on(
        &self,
        dims: ((u32, u32, u32), (u32, u32, u32)),
        stream: &RawStream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_with(dims, 0, stream, args, false) }
    }

    /// # Safety
    /// As [`launch`](Self::launch).
    unsafe fn launch_with(
        &self,
        (grid, block): ((u32, u32, u32), (u32, u32, u32)),
        shared_mem: u32,
        stream: &RawStream,
        args: &mut [*mut c_void],
        programmatic: bool,
    ) -> Result<()> {
        if stream.dev.ordinal != self.module.dev.ordinal {
            return Err(Error::invalid_usage(format!(
                "a kernel loaded on GPU{} cannot be launched on a stream of GPU{}",
                self.module.dev.ordinal, stream.dev.ordinal
            )));
        }
        self.module.dev.bind()?;
        if programmatic {
            if !programmatic_supported_on(&self.module.dev)? {
                return Err(Error::invalid_usage(format!(
                    "{}: programmatic dependent launch needs compute capability 9.0 and a CUDA 12.3 driver or later",
                    self.name
                )));
            }
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { pad: [0; 64] },
            };
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: shared_mem,
                hStream: stream.raw,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: config and attr are locals that outlive the call; the function and stream
            // are live handles of the bound context; the caller guarantees the arguments and
            // that the kernel waits (griddepcontrol.wait) before it depends on earlier work.
            let r = unsafe { sys::cuLaunchKernelEx(&config, self.raw, args.as_mut_ptr(), std::ptr::null_mut()) };
            return super::check("cuLaunchKernelEx", r).map_err(|e| e.during(format!("launching {}", self.name)));
        }
        // SAFETY: the function and stream are live handles of the bound context; the caller
        // guarantees the arguments (see `launch`).
        unsafe { result::launch_kernel(self.raw, grid, block, shared_mem, stream.raw, args) }
            .map_err(|e| cuda_err(&format!("cuLaunchKernel({})", self.name), e))
    }

    /// How many blocks of `block_threads` threads (with `shared_mem` bytes of dynamic shared
    /// memory) one SM can hold at once (`cuOccupancyMaxActiveBlocksPerMultiprocessor`): with
    /// [`sm_count`], how many blocks of kernels that wait on each other can be resident together.
    ///
    /// # Errors
    /// `Cuda` when the driver refuses (for example more threads than a block may have).
    pub fn max_active_blocks_per_sm(&self, block_threads: u32, shared_mem: usize) -> Result<u32> {
        self.module.dev.bind()?;
        let mut n: std::ffi::c_int = 0;
        // SAFETY: raw is a live function of the bound context; n is a local out-parameter.
        let r = unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.raw, block_threads as i32, shared_mem)
        };
        super::check("cuOccupancyMaxActiveBlocksPerMultiprocessor", r)?;
        Ok(n.max(0) as u32)
    }
}

/// The number of streaming multiprocessors of GPU `ordinal`.
///
/// # Errors
/// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU.
pub fn sm_count(ordinal: u32) -> Result<u32> {
    let dev = super::device(ordinal)?;
    let raw = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    dev.bind()?;
    // SAFETY: raw is a valid device handle and the attribute a valid enum value.
    let n = unsafe {
        result::device::get_attribute(raw, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }
    .map_err(|e| cuda_err("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", e))?;
    Ok(n.max(0) as u32)
}

/// Whether GPU `ordinal` and the driver take programmatic dependent launches
/// ([`Kernel::launch_programmatic`]): compute capability 9.0 or later, and a driver of CUDA 12.3
/// or later (which also captures them into graphs). The answer is asked of the driver once per
/// GPU.
///
/// # Errors
/// As [`compute_capability`].
pub fn programmatic_launch_supported(ordinal: u32) -> Result<bool> {
    programmatic_supported_on(&*super::device(ordinal)?)
}

/// [`programmatic_launch_supported`] for a retained device, from its cache after the first ask
/// (every programmatic launch checks it).
fn programmatic_supported_on(dev: &GpuDevice) -> Result<bool> {
    if let Some(&yes) = dev.programmatic.get() {
        return Ok(yes);
    }
    let (major, _) = compute_capability(dev.ordinal)?;
    let mut driver: std::ffi::c_int = 0;
    // SAFETY: driver is a local out-parameter; the driver is loaded (compute_capability above).
    let r = unsafe { sys::cuDriverGetVersion(&mut driver) };
    let yes = major >= 9 && r == sys::CUresult::CUDA_SUCCESS && driver >= 12030;
    Ok(*dev.programmatic.get_or_init(|| yes))
}

/// The compute capability `(major, minor)` of GPU `ordinal`.
///
/// # Errors
/// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU.
pub fn compute_capability(ordinal: u32) -> Result<(i32, i32)> {
    let dev = super::device(ordinal)?;
    let raw = result::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    dev.bind()?;
    let attr = |a| {
        // SAFETY: raw is a valid device handle and `a` a valid attribute.
        unsafe { result::device::get_attribute(raw, a) }.map_err(|e| cuda_err("cuDeviceGetAttribute", e))
    };
    Ok((
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// A non-blocking CUDA stream on one GPU (it never synchronizes with the legacy default stream),
/// for launching kernels compiled with `mscclpp::device::compile`. Public as `mscclpp::gpu::Stream`.
pub struct Stream {
    inner: RawStream,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(GPU{})", self.device())
    }
}

impl Stream {
    /// A new non-blocking stream on GPU `device`.
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU; `Cuda` when the
    /// driver refuses.
    #[track_caller]
    pub fn new(device: u32) -> Result<Stream> {
        Ok(Stream { inner: RawStream::new(&super::device(device)?)? })
    }

    /// A stream someone else created on GPU `device` (PyTorch's `torch.cuda.current_stream()
    /// .cuda_stream`, a `cudaStream_t` from C), wrapped without taking ownership: dropping the
    /// wrapper leaves the stream alone. `raw = 0` is the legacy default stream.
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU.
    ///
    /// # Safety
    /// `raw` is a live stream of GPU `device`'s primary context (the runtime API's context) and
    /// outlives the returned value and everything launched through it.
    pub unsafe fn from_raw(device: u32, raw: u64) -> Result<Stream> {
        let dev = super::device(device)?;
        // SAFETY: the caller's contract, passed on.
        Ok(Stream { inner: unsafe { RawStream::borrowed(&dev, raw) } })
    }

    /// [`from_raw`](Self::from_raw), after asking the driver whether `raw` is a stream of GPU
    /// `device`'s primary context (`cuStreamGetCtx`, a fraction of a microsecond): a stream of
    /// another GPU (a framework's current stream on the wrong device) is refused with a clear
    /// error instead of failing the launch later. For bindings (Python), where that mistake is
    /// easy and the check's cost small next to the call's.
    ///
    /// # Errors
    /// As `from_raw`; `InvalidUsage` for a stream of another GPU or context; `Cuda` for a handle
    /// the driver does not know.
    ///
    /// # Safety
    /// As `from_raw`, except that the stream may be of another GPU (it is then refused).
    pub unsafe fn from_raw_checked(device: u32, raw: u64) -> Result<Stream> {
        let dev = super::device(device)?;
        if !dev.owns_stream(raw).map_err(|e| e.during(format!("checking stream {raw:#x}")))? {
            return Err(Error::invalid_usage(format!(
                "stream {raw:#x} belongs to another GPU or context than GPU{device}'s (make it current on GPU{device})"
            )));
        }
        // SAFETY: the caller's contract, passed on (the stream is of this device's context).
        Ok(Stream { inner: unsafe { RawStream::borrowed(&dev, raw) } })
    }

    /// The driver's handle (`CUstream`, the same value as a runtime `cudaStream_t`), for FFI.
    pub fn as_raw(&self) -> u64 {
        self.inner.raw as u64
    }

    /// Starts capturing the work submitted to this stream into a CUDA graph, in thread-local
    /// mode: only this thread is barred from calls that would break the capture, so other
    /// threads (other ranks of the process) go on allocating and synchronizing.
    /// [`end_capture`](Self::end_capture) ends it.
    ///
    /// # Errors
    /// `Cuda` when the driver refuses (the stream is already capturing, or is the legacy stream).
    pub fn begin_capture(&self) -> Result<()> {
        super::graph::begin_capture(&self.inner)
    }

    /// Ends a capture begun with [`begin_capture`](Self::begin_capture) and instantiates the
    /// graph, ready to [`launch`](super::graph::Graph::launch).
    ///
    /// # Errors
    /// `Cuda` when the capture was invalidated (an operation not allowed during capture) or the
    /// graph cannot be instantiated.
    pub fn end_capture(&self) -> Result<super::graph::Graph> {
        super::graph::end_capture(&self.inner)
    }

    /// Whether this stream is capturing a graph right now.
    ///
    /// # Errors
    /// `Cuda` when the driver cannot say.
    pub fn is_capturing(&self) -> Result<bool> {
        super::graph::is_capturing(&self.inner)
    }

    /// The GPU it belongs to.
    pub fn device(&self) -> u32 {
        self.inner.dev.ordinal
    }

    /// Whether everything submitted so far has finished.
    ///
    /// # Errors
    /// `Cuda` when a kernel on it failed (for example trapped).
    pub fn is_idle(&self) -> Result<bool> {
        self.inner.idle()
    }

    /// Waits, polling with backoff, until everything submitted so far has finished
    /// (`Duration::MAX`: no limit; `Duration::ZERO`: checks once).
    ///
    /// # Errors
    /// `Timeout` when work is still running after `timeout` (the stream is left as it is);
    /// `Cuda` when a kernel on it failed.
    pub fn synchronize(&self, timeout: Duration) -> Result<()> {
        if self.inner.wait_idle(timeout)? {
            Ok(())
        } else {
            Err(Error::timeout(format!("stream of GPU{} to finish", self.device()), timeout))
        }
    }
}
